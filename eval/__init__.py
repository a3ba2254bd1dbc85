"""Evaluate a policy against dense attention on held-out prompts.

The runner (prompts, decoding, checkpoints, results) is :mod:`rolecall.eval.runner`; the intervals it
reports, :mod:`rolecall.eval.stats`."""

from rolecall.eval.runner import (
    NEW_TOKENS_WHY,
    SUITES,
    TIME_PARTS,
    Checkpoint,
    EvalSettings,
    Job,
    answer_correct,
    check_samples,
    device_label,
    devices_of,
    evaluate,
    evaluate_many,
    fidelity,
    format_fidelity,
    format_table,
    load_prompts,
    longbench_prompts,
    passkey_prompts,
    policy_steps,
    prompt_rows,
    record_of,
    resume_plan,
    row_steps,
    ruler_prompts,
    sample_score,
    step_divergence,
    suite_new_tokens,
    suite_prompts,
    task_scores,
    time_split,
)
from rolecall.eval.stats import bootstrap_interval, paired_difference, wilson_interval

__all__ = ["Checkpoint", "EvalSettings", "Job", "NEW_TOKENS_WHY", "SUITES", "TIME_PARTS", "answer_correct", "bootstrap_interval", "check_samples", "device_label", "devices_of", "evaluate", "evaluate_many", "fidelity", "format_fidelity", "format_table", "load_prompts", "longbench_prompts", "paired_difference", "passkey_prompts", "policy_steps", "prompt_rows", "record_of", "resume_plan", "row_steps", "ruler_prompts", "sample_score", "step_divergence", "suite_new_tokens", "suite_prompts", "task_scores", "time_split", "wilson_interval"]
