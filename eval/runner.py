"""Evaluate a policy against dense attention on held-out prompts.

For each prompt the policy generates greedily (``evaluate``); a dense pass then gives the full-attention logits
at the very same positions (on the engine over the generated tokens alone, on the prompt's K/V it already
holds; elsewhere one forward over the prompt and that generation), so every decode step yields

* the KL divergence ``KL(p_full ‖ p_policy)`` and whether both pick the same top-1 token;
* per layer, the attention recall (true attention mass inside the set the layer read) and the fraction of
  the context it read;
* passkey accuracy (single passkey in a haystack, from ``rolecall.data.passkey``) per context length and depth, and the
  generation length;
* with the RULER-style suite (``suite="ruler"``, ``rolecall.data.ruler``), RULER's score per task and length (the share
  of the expected strings generated), each with its Wilson 95 % interval.

Prompts come from ``rolecall.data.passkey.build_niah_dataset``, ``rolecall.data.ruler.build_ruler_dataset`` or a JSONL file
(``{"prompt": ..., "answer": ...}`` or ``{"prompt": ..., "answers": [...]}`` per line, answers optional).
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from rolecall.core import atomic
from rolecall.core.models import cache_keyword, pad_token
from rolecall.eval.stats import bootstrap_interval, wilson_interval
from rolecall.runtime.session import attach


@dataclass
class EvalSettings:
    lengths: tuple[int, ...] = (1000, 2000, 4000)  # context lengths in tokens (passkey prompts)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)  # where the passkey sits (0 = start, 1 = end)
    samples_per_cell: int = 1
    passkey_words: int = 2
    alphabet: str = "nato"  # passkey words: "nato" code words, or "digits" (what small models can copy)
    source: str = "pg-essays"  # haystack text (see rolecall.data.corpora)
    prompts: str | None = None  # a JSONL file instead of passkey prompts
    max_new_tokens: int = 12  # RULER prompts carry their own budget (rolecall.data.ruler.TASKS)
    suite: str = "passkey"  # "passkey", "ruler" (rolecall.data.ruler) or "longbench" (rolecall.data.longbench; lengths truncate)
    tasks: tuple[str, ...] = ()  # RULER or LongBench tasks; () = all
    seed: int = 0
    data: str | None = None  # LongBench's data.zip or folder (None: the Hugging Face Hub when it answers)

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise ValueError(f"suite must be one of {', '.join(SUITES)}, got {self.suite!r}")
        from rolecall.runtime.prompts import check_max_new_tokens

        check_max_new_tokens(self.max_new_tokens, least=2, why=NEW_TOKENS_WHY)
        if self.prompts is None and (not self.lengths or not self.depths):
            raise ValueError("give at least one context length and one depth, or --prompts FILE.jsonl")


SUITES = ("passkey", "ruler", "longbench")
NEW_TOKENS_WHY = " (the first token comes from the dense prefill)"  # why an evaluation generates at least 2


def prompt_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """The rows of a JSONL prompt file, each with its line number: one JSON object with a ``"prompt"`` string per
    line (blank lines skipped); a file that is not so is refused in one line naming the line."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ok = isinstance(row["prompt"], str)
        except (json.JSONDecodeError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError(f"{path}:{i + 1}: each line must be a JSON object with a 'prompt' string")
        rows.append((i + 1, row))
    if not rows:
        raise ValueError(f"{path}: no prompts in the file; write one JSON object per line")
    return rows


def load_prompts(path: str | Path, tokenizer) -> list[dict[str, Any]]:
    """JSONL prompts → samples ``{"input_ids" [T], "answer" | None, "task": "prompts", "context_length", "depth":
    None}`` (task ``prompts``: scored per length in the task table, not as passkeys)."""
    samples = []
    for _, row in prompt_rows(path):
        ids = torch.tensor(tokenizer(row["prompt"])["input_ids"], dtype=torch.long)
        sample = {"input_ids": ids, "answer": row.get("answer"), "task": "prompts", "context_length": len(ids),
                  "depth": None}
        if row.get("answers") is not None:
            sample["answers"] = [str(a) for a in row["answers"]]
        samples.append(sample)
    return samples


def passkey_prompts(tokenizer, settings: EvalSettings) -> list[dict[str, Any]]:
    from rolecall.data.passkey import (
        build_niah_dataset,  # evaluation only: runtime does not need data otherwise
    )

    grid = build_niah_dataset(tokenizer, source=settings.source, lengths=settings.lengths, depths=settings.depths,
                              samples_per_cell=settings.samples_per_cell, passkey_words=settings.passkey_words,
                              alphabet=settings.alphabet)
    return [{"input_ids": s["input_ids"][: s["prompt_length"]], "answer": s["answer"],
             "context_length": int(s["context_length"]), "depth": float(s["depth"])} for s in grid]


def ruler_prompts(tokenizer, settings: EvalSettings) -> list[dict[str, Any]]:
    from rolecall.data.ruler import TASKS, build_ruler_dataset, prompt_ids

    suite = build_ruler_dataset(tokenizer, tasks=settings.tasks or tuple(TASKS), lengths=settings.lengths,
                                samples_per_cell=settings.samples_per_cell, seed=settings.seed, source=settings.source)
    return [{"input_ids": prompt_ids(s), "answers": list(s["answers"]), "task": s["task"],
             "context_length": int(s["context_length"]), "depth": s["depth"],
             "max_new_tokens": int(s["max_new_tokens"])} for s in suite]


def longbench_prompts(tokenizer, settings: EvalSettings) -> list[dict[str, Any]]:
    """The first ``samples_per_cell`` samples of each LongBench task, each cut to every length of ``lengths``
    (its first and last halves); ``context_length`` is that length, the cell it is reported in."""
    from rolecall.data.longbench import TASKS, load_tasks, prompt_ids

    rows = load_tasks(settings.tasks or tuple(TASKS), settings.data, limit=settings.samples_per_cell)
    return [{"input_ids": torch.tensor(prompt_ids(tokenizer, r, n), dtype=torch.long), "answers": r["answers"],
             "classes": r["all_classes"], "task": r["task"], "suite": "longbench", "context_length": int(n),
             "depth": None, "max_new_tokens": TASKS[r["task"]].max_new_tokens} for n in settings.lengths for r in rows]


def suite_prompts(tokenizer, settings: EvalSettings) -> list[dict[str, Any]]:
    """The prompts ``settings`` ask for: a JSONL file, the RULER-style suite, LongBench or the passkey grid."""
    if settings.prompts:
        return load_prompts(settings.prompts, tokenizer)
    build = {"ruler": ruler_prompts, "longbench": longbench_prompts}.get(settings.suite, passkey_prompts)
    return build(tokenizer, settings)


def suite_new_tokens(settings: EvalSettings) -> int:
    """The most tokens a prompt of ``settings`` generates: a suite's tasks carry their own budgets, a prompt
    file and the passkey grid use ``max_new_tokens``. Unknown task names are refused (``ValueError``)."""
    if settings.prompts or settings.suite not in ("ruler", "longbench"):
        return settings.max_new_tokens
    if settings.suite == "ruler":
        from rolecall.data.ruler import TASKS, check_tasks
    else:
        from rolecall.data.longbench import TASKS, check_tasks
    return max(TASKS[t].max_new_tokens for t in check_tasks(settings.tasks or TASKS))


def sample_score(generated: str, sample: dict[str, Any]) -> float | None:
    """LongBench's metric for its samples, 1/0 for a passkey answer, RULER's share of expected strings for
    ``answers``, None without either."""
    if sample.get("suite") == "longbench":
        from rolecall.data.longbench import score

        return score(sample["task"], generated, sample["answers"], sample["classes"])
    if sample.get("answers"):
        from rolecall.data.ruler import score

        return score(generated, sample["answers"])
    if sample.get("answer"):
        return float(answer_correct(generated, sample["answer"]))
    return None


def answer_correct(generated: str, answer: str) -> bool:
    """The generation starts with the answer's words (case and punctuation ignored)."""
    want = re.findall(r"[a-z0-9]+", answer.lower())
    return re.findall(r"[a-z0-9]+", generated.lower())[: len(want)] == want


def step_divergence(full_logits: torch.Tensor, policy_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` each → KL(p_full ‖ p_policy) ``[N]`` and top-1 agreement ``[N]`` (bool)."""
    lf, lp = full_logits.float().log_softmax(-1), policy_logits.float().log_softmax(-1)
    kl = (lf.exp() * (lf - lp)).sum(-1).clamp_min(0)
    return kl, full_logits.argmax(-1) == policy_logits.argmax(-1)


def row_steps(steps: list[torch.Tensor], r: int, n: int) -> torch.Tensor:
    """Row ``r``'s logits at steps ``1 … n − 1`` ``[n − 1, V]`` from per-step ``[B, V]`` tensors: what
    ``torch.stack(steps, 1)[r, 1:n]`` holds, without a stacked copy of the whole batch."""
    return torch.stack([step[r] for step in steps[1:n]]) if n > 1 else steps[0][r:r]


def policy_steps(generation: Any, steps: list[torch.Tensor], r: int, n: int) -> torch.Tensor:
    """Row ``r``'s logits at steps ``1 … n − 1``: on the engine (``generation``, the session's last) a view of
    its ``[B, steps + 1, V]`` buffer, no copy; off it (None) stacked from the per-step ``steps``."""
    if generation is not None and generation.step_logits is not None:
        return generation.step_logits[r, 1:n]
    return row_steps(steps, r, n)


def _batches(samples: list[dict[str, Any]], size: int, default_budget: int) -> list[list[int]]:
    """Sample indices in batches of at most ``size`` prompts of one token count and one generation budget, in
    a fixed order. Equal lengths need no padding, so page-based policies see each prompt's pages exactly as
    when it runs alone (left padding would shift every page boundary of a shorter row)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, sample in enumerate(samples):
        key = (int(sample.get("max_new_tokens", default_budget)), len(sample["input_ids"]))
        groups.setdefault(key, []).append(i)
    return [group[k:k + size] for _, group in sorted(groups.items()) for k in range(0, len(group), size)]


def _dense_logits(model, rows: list[list[int]], last: list[int]) -> list[torch.Tensor]:
    """Full attention's logits at the last ``last[r]`` positions of each token list in ``rows``, in one batched
    forward (left-padded, positions counted from each row's first real token)."""
    from rolecall.runtime.engine import pad_left, padding_mask

    ids, pads = pad_left(rows, 0, model.device)
    mask = padding_mask(pads, ids.shape[1], ids.device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(ids, attention_mask=mask, position_ids=positions, use_cache=False,
                   logits_to_keep=max(last)).logits  # [B, max(last), V]
    return [logits[r, logits.shape[1] - n:] for r, n in enumerate(last)]


def _decode_batch(model, tokenizer, session, batch: list[dict[str, Any]], settings: EvalSettings,
                  on_engine: bool, share: dict[str, Any] | None = None
                  ) -> tuple[list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]], dict | None]:
    """Decode prompts of one length together; per prompt its record, per-step KL and top-1 agreement, and the
    engine's figures (None off the engine): the fraction of keys its step read and the KV cache bytes per
    prompt. ``share`` (on the engine): ``{"prefilled": ...}`` from an earlier policy on this batch, loaded instead
    of a prefill, or an empty dict that receives this call's prefill."""
    eos = tokenizer.eos_token_id
    pad = pad_token(tokenizer)
    prompts = [s["input_ids"].tolist() for s in batch]  # one length (see _batches): no padding
    budgets = [int(s.get("max_new_tokens", settings.max_new_tokens)) for s in batch]
    width = len(prompts[0])
    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max(budgets),
                  do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
    if on_engine:  # full attention's logits along the trace, from the prompt's K/V the engine already holds
        from rolecall.eval.decoding import traced_generate

        run = functools.partial(traced_generate, reference_logits=True,
                                prefilled=share["prefilled"] if share else None,
                                keep_prefill=share is not None and not share)
        out = session.generate_on_engine(run, **kwargs)
    else:
        # A plain cache: Lethe then masks instead of freeing (same outputs, tested), so recall still counts the
        # attention mass that fell on evicted tokens.
        kwargs[cache_keyword(model)] = DynamicCache(config=model.config)
        out = session.generate(**kwargs)
    if share is not None and not share and session.last is not None:
        share["prefilled"] = session.last.prefilled
    info = session.last.info if session.last is not None else None
    engine = None if info is None else {"fraction": info["attended_fraction"],
                                        "kv_bytes": info["cache_bytes"] / len(batch),
                                        "seconds": {"setup": info["setup_s"], "prefill": session.last.prefill_s,
                                                    "capture": info["capture_s"], "decode": session.last.decode_s,
                                                    "reference": info["reference_s"]}}
    steps = out.logits  # N tensors [B, V]; step 0 comes from the dense prefill (not stacked: at a large vocabulary
    # a stacked copy of a batch's logits is gigabytes)
    news = [out.sequences[r, width:width + budgets[r]].tolist() for r in range(len(batch))]
    news = [row[:next((k + 1 for k, t in enumerate(row) if t == eos), len(row))] for row in news]  # to EOS
    # the reference of steps 1 … n − 1: the engine's dense pass over the generated tokens, or (off the engine, and
    # for a policy that evicted prompt keys) one transformers forward over prompt and trace
    dense = session.last.reference_logits if session.last is not None else None
    if dense is None:
        dense = [d[1:] for d in _dense_logits(model, [p + n[:-1] for p, n in zip(prompts, news)],
                                              [len(n) for n in news])]
    rows = []
    for r, sample in enumerate(batch):
        n = len(news[r])
        kl, top1 = step_divergence(dense[r][:n - 1], policy_steps(session.last, steps, r, n).to(dense[r].device))
        rows.append((record_of(sample, tokenizer.decode(news[r], skip_special_tokens=True), n, kl, top1),
                     kl.cpu(), top1.cpu()))
    session.last = None  # its logits (gigabytes at a large vocabulary) go now, not when the next policy's session ends
    return rows, engine


class Checkpoint:
    """Finished batches of one :func:`evaluate` call, one JSON line each after a header line that names the
    run (policy, parameters, settings, prompts) and its plan (the prompts of each batch), so a run stopped
    midway (a lost machine) resumes at its first unfinished batch with the same result. A torn last line
    (killed while writing) is dropped; a file of another run is refused, not mixed in. A rerun with another
    batch size (one that ran out of memory) keeps what was finished: see :meth:`adopt`."""

    def __init__(self, path: str | Path, header: dict[str, Any], batches: list[list[int]]) -> None:
        self.path, self.done = Path(path), {}
        self.header, self.batches = json.loads(json.dumps(header)), batches  # as they read back
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        if lines:
            stored = json.loads(lines[0])
            self.batches = stored.pop("batches", batches)
            if stored != self.header:
                raise ValueError(f"{self.path} holds the batches of another run (other policy, parameters or "
                                 "prompts); delete it, or pass another checkpoint file")
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break
            self.done[entry["batch"]] = entry
        self._write()  # without a torn tail

    def finished(self) -> list[list[int]]:
        """The prompts of each finished batch, in the plan's order."""
        return [self.batches[k] for k in sorted(self.done)]

    def adopt(self, batches: list[list[int]]) -> None:
        """Go on under the plan ``batches``: a finished batch that is one of them keeps its result (numbered
        anew), any other is dropped and runs again."""
        if batches == self.batches:
            return
        where = {tuple(b): k for k, b in enumerate(batches)}
        moved = {where[tuple(self.batches[k])]: entry for k, entry in self.done.items() if tuple(self.batches[k]) in where}
        self.batches, self.done = batches, {k: {**moved[k], "batch": k} for k in sorted(moved)}
        self._write()

    def add(self, entry: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[entry["batch"]] = entry

    def _write(self) -> None:
        # atomically: a kill meanwhile leaves the old file, not a shorter one
        lines = [json.dumps({**self.header, "batches": self.batches})] + [json.dumps(e) for e in self.done.values()]
        atomic.write_text(self.path, "\n".join(lines) + "\n")


def resume_plan(fresh: list[list[int]], finished: list[list[int]]) -> list[list[int]]:
    """The batches of a run resumed under another plan (another batch size): the ``finished`` batches first, as
    they ran, then the ``fresh`` plan's batches less the prompts already finished (each still of one length)."""
    covered = {i for batch in finished for i in batch}
    return [list(b) for b in finished] + [rest for b in fresh if (rest := [i for i in b if i not in covered])]


def device_label(model) -> str:
    """The device a model decodes on, as results name it: the GPU's name, or ``CPU``."""
    device = next(model.parameters()).device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()


def _entry(k: int, rows: list, figures: dict | None, seconds: float, device: str) -> dict[str, Any]:
    """A finished batch as its checkpoint line keeps it. ``seconds``: the batch's wall time (with the session's
    attach where each batch opens its own), kept beside the engine's split of it; ``device``: where it ran
    (a run resumed on another machine ran its batches on two)."""
    if figures is not None and "seconds" in figures:
        figures["seconds"]["total"] = seconds
    return {"batch": k, "records": [r for r, _, _ in rows], "kl": [kl.tolist() for _, kl, _ in rows],
            "top1": [t.tolist() for _, _, t in rows], "figures": figures, "device": device}


def devices_of(entries: list[dict[str, Any]]) -> dict[str, int]:
    """How many batches ran on each device, in the order the devices first ran one (batches kept by an earlier
    version of the checkpoint name none and are not counted)."""
    counts: dict[str, int] = {}
    for e in entries:
        if e.get("device"):
            counts[e["device"]] = counts.get(e["device"], 0) + 1
    return counts


TIME_PARTS = ("setup", "prefill", "capture", "decode", "reference", "total")


def time_split(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where an evaluation's time went on the engine: the seconds of every part summed over the batches that
    recorded them (``batches`` of them; batches kept by an earlier version of the checkpoint have none), and
    ``other`` = total − the parts: attaching the policy, KL against the reference and the host's bookkeeping.
    None off the engine."""
    timed = [e["figures"]["seconds"] for e in entries if (e.get("figures") or {}).get("seconds")]
    if not timed:
        return None
    split = {part: sum(t[part] for t in timed) for part in TIME_PARTS}
    split["other"] = max(0.0, split["total"] - sum(split[p] for p in TIME_PARTS[:-1]))
    return {"batches": len(timed), **split}


def _run_batches(model, tokenizer, session, samples, batches, settings, on_engine, checkpoint) -> list[dict]:
    """Each batch's entry ``{batch, records, kl, top1, figures}``, from the checkpoint where it holds it."""
    from tqdm.auto import tqdm

    entries, device = [], device_label(model)
    with tqdm(total=sum(map(len, batches)), desc="prompts", unit="prompt", leave=False) as bar:
        for k, batch in enumerate(batches):
            if checkpoint is not None and k in checkpoint.done:
                entries.append(checkpoint.done[k])
            else:
                start = time.perf_counter()
                rows, figures = _decode_batch(model, tokenizer, session, [samples[i] for i in batch], settings,
                                              on_engine)
                entries.append(_entry(k, rows, figures, time.perf_counter() - start, device))
                if checkpoint is not None:
                    checkpoint.add(entries[-1])
            bar.update(len(batch))
    return entries


def _in_prompt_order(entries: list[dict], batches: list[list[int]], n: int) -> tuple[list, list, list, list, list]:
    """Per prompt, in the suite's order: its record, per-step KL and top-1 agreement; per prompt on the engine,
    the fraction of keys its batch read and the KV bytes it held (empty lists off the engine)."""
    records, kls, agree = [None] * n, [None] * n, [None] * n
    fractions, kv = [], []
    for batch, entry in zip(batches, entries):
        if entry["figures"] is not None:
            fractions += [entry["figures"]["fraction"]] * len(batch)
            kv += [entry["figures"]["kv_bytes"]] * len(batch)
        for i, record, kl, top1 in zip(batch, entry["records"], entry["kl"], entry["top1"]):
            records[i], kls[i], agree[i] = record, torch.tensor(kl, dtype=torch.float32), torch.tensor(top1, dtype=torch.bool)
    return records, kls, agree, fractions, kv


@dataclass
class Job:
    """One evaluation of :func:`evaluate_many`: a policy, its manifest (a path or a ``RoleManifest``) and
    parameters, and the file that keeps its finished batches (:class:`Checkpoint`)."""

    policy: str = "delta"
    manifest: Any = None
    params: dict[str, Any] | None = None
    checkpoint: str | Path | None = None
    seconds: float = 0.0  # set by evaluate_many: the seconds of this job's batches in that call


@dataclass(eq=False)
class _Run:
    """A job as :func:`evaluate_many` runs it."""

    job: Job
    params: dict[str, Any]
    measure: bool
    on_engine: bool
    batches: list[list[int]]
    kept: Checkpoint | None
    summary: dict[str, Any]
    fresh: list[list[int]]  # the batches of this batch size, before a checkpoint's own plan
    entries: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    allow_long: bool = False  # evaluate_many's allow_long_context

    def session(self, model):
        return attach(model, self.job.manifest, self.job.policy, record_recall=self.measure, min_context=0,
                      **{"allow_long_context": self.allow_long, **self.params})


@torch.no_grad()
def evaluate(model, tokenizer, manifest=None, policy: str = "delta", params: dict[str, Any] | None = None,
             settings: EvalSettings | None = None, samples: list[dict[str, Any]] | None = None,
             measure: bool | None = None, batch_size: int | None = None,
             checkpoint: str | Path | None = None, allow_long_context: bool = False) -> dict[str, Any]:
    """Run the evaluation; returns a JSON-ready dict (see the module docstring).

    On a GPU the policy decodes on the engine (never falling back to full attention at short contexts:
    ``min_context=0``) and the attended fraction comes from its static step. ``measure`` (default: only on
    the CPU, where the transformers path runs anyway) records per-layer recall and keys read on that path.
    ``batch_size``: prompts of one length decoded together (default 16 on the engine, 1 elsewhere); each
    prompt's tokens are the ones it generates alone, up to floating-point differences of the batched products.
    ``params["engine"]`` goes to :func:`runtime.attach` (``"static"`` runs the engine on the CPU too). On the
    engine the result also gives ``kv_bytes_per_prompt``, the mean KV cache a prompt held (a Lethe layer's
    compact buffer included), None elsewhere. ``checkpoint``: a file that keeps every finished batch
    (:class:`Checkpoint`); a rerun with the same file resumes there. A measuring run keeps none (its per-layer
    figures would miss the batches before the stop). The prompts are checked before any decoding, as
    :func:`evaluate_many` checks them; ``allow_long_context``: prompts past the model's context run (a model whose
    RoPE was extended on purpose), as ``--allow-long-context`` lets them.
    """
    return evaluate_many(model, tokenizer, [Job(policy, manifest, params, checkpoint)], settings, samples, measure,
                         batch_size, allow_long_context=allow_long_context)[0]


@torch.no_grad()
def evaluate_many(model, tokenizer, jobs: list[Job], settings: EvalSettings | None = None,
                  samples: list[dict[str, Any]] | None = None, measure: bool | None = None,
                  batch_size: int | None = None, share_prefill: bool = True,
                  allow_long_context: bool = False) -> list[dict[str, Any]]:
    """:func:`evaluate` for several policies on the same prompts; one result per job, in order.

    The jobs that decode on the engine without measuring go through the batches together: each batch is
    prefilled once, by the first of them that still needs it, and the others load that prefill
    (:func:`rolecall.eval.decoding.traced_generate`'s ``prefilled``) instead of reading the prompts again,
    which is most of the time at long contexts. Every policy then starts from the very same dense pass (up to
    rounding, it is the one each would compute: the order of KV heads in a policy's cache changes the order of
    some sums). ``Job.seconds``: each job's own time; a shared prefill counts to the job that ran it.
    ``share_prefill=False`` runs each job on its own, one after the other, as the others (measuring, off the
    engine) always do.

    Before any decoding the samples' prompts are checked (:func:`check_samples`): each a 1-D integer tensor of
    at least one id in the model's vocabulary, each budget (``max_new_tokens``, the sample's own or the
    settings') a whole number ≥ 2, and the longest prompt plus its budget within the model's context
    (``max_position_embeddings``) unless ``allow_long_context``; a bad one is refused in one line (``ValueError``)."""
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    settings = settings or EvalSettings()
    if samples is None:
        samples = suite_prompts(tokenizer, settings)
    check_samples(samples, model.config, settings, allow_long_context)
    runs = [_plan(model, job, settings, samples, measure, batch_size) for job in jobs]
    for r in runs:
        r.allow_long = allow_long_context
    together = [r for r in runs if r.on_engine and not r.measure] if share_prefill else []
    together = together if len(together) > 1 else []
    if together:
        _one_plan(together)
    for r in runs:
        if r not in together:
            with r.session(model) as session:
                start = time.perf_counter()
                r.entries = _run_batches(model, tokenizer, session, samples, r.batches, settings, r.on_engine, r.kept)
                r.seconds = time.perf_counter() - start
                r.summary = session.summary()
    if together:
        _run_together(model, tokenizer, together, samples, settings)
    for r in runs:
        r.job.seconds = r.seconds
    return [_result(r, samples, settings) for r in runs]


def check_samples(samples: list[dict[str, Any]], config: Any, settings: EvalSettings,
                  allow_long_context: bool = False, name: str = "samples", **how: Any) -> None:
    """The samples' prompts (``input_ids``) and budgets, checked for a model of ``config`` as
    :func:`rolecall.runtime.prompts.check_prompts` checks prompts (see :func:`evaluate_many`); a sample without
    ``input_ids`` is refused too. ``name``: what to call the samples in a message; ``how``: the rest of
    ``check_prompts``' wording (the commands name their flags: ``new_name``, ``opt_in``, ``warn_as``, ``fix``)."""
    from rolecall.core.models import context_limit
    from rolecall.core.tokens import vocab_size
    from rolecall.runtime.prompts import PromptError, check_prompts

    if not isinstance(samples, (list, tuple)) or not samples:
        raise PromptError(f"{name} must be a non-empty list of samples (dicts with 'input_ids'), got "
                          f"{type(samples).__name__ if samples else samples!r}")
    missing = next((i for i, s in enumerate(samples) if not isinstance(s, dict) or "input_ids" not in s), None)
    if missing is not None:
        raise PromptError(f"sample {missing + 1} of {name} has no 'input_ids'; each sample is a dict with its "
                          "prompt's token ids under 'input_ids'")
    how = {"fix": "shorten the prompts or lower max_new_tokens", **how}
    check_prompts([s["input_ids"] for s in samples], vocab_size=vocab_size(config),
                  max_new_tokens=[s.get("max_new_tokens", settings.max_new_tokens) for s in samples], per_row=True,
                  least=2, why=NEW_TOKENS_WHY, context=context_limit(config), allow_long=allow_long_context,
                  name=name, **how)


def _plan(model, job: Job, settings: EvalSettings, samples: list[dict[str, Any]], measure: bool | None,
          batch_size: int | None) -> _Run:
    """A job's path (engine or not, measuring or not), its batches and its checkpoint, before any decoding."""
    params = dict(job.params or {})
    measure = model.device.type != "cuda" and params.get("engine") != "static" if measure is None else measure
    with attach(model, job.manifest, job.policy, record_recall=measure, min_context=0, **params) as session:
        on_engine = session.engine_reason({"input_ids": None}) is None
        summary = session.summary()
    size = batch_size or (16 if on_engine else 1)
    if not on_engine and size > 1:
        raise ValueError(f"batch_size {size} needs the engine (a CUDA device and an engine policy); "
                         "the transformers path evaluates one prompt at a time: pass batch_size=1")
    fresh = _batches(samples, size, settings.max_new_tokens)
    kept = None if job.checkpoint is None or measure else Checkpoint(
        job.checkpoint, {"policy": job.policy, "params": params, "settings": asdict(settings), "prompts": len(samples)},
        fresh)
    if kept is not None and kept.batches != fresh:  # begun with another batch size: its finished batches stay
        kept.adopt(resume_plan(fresh, kept.finished()))
    return _Run(job, params, measure, on_engine, fresh if kept is None else kept.batches, kept, summary, fresh)


def _one_plan(runs: list[_Run]) -> None:
    """Runs that decode together go through one plan: where their checkpoints hold different ones (a rerun with
    another batch size), the batches all of them finished, then the rest afresh; a run's other finished
    batches run again."""
    if all(r.batches == runs[0].batches for r in runs):
        return
    finished = [r.kept.finished() if r.kept is not None else [] for r in runs]
    common = [b for b in finished[0] if all(b in f for f in finished[1:])]
    plan = resume_plan(runs[0].fresh, common)
    for r in runs:
        r.batches = plan
        if r.kept is not None:
            r.kept.adopt(plan)


def _run_together(model, tokenizer, runs: list[_Run], samples, settings: EvalSettings) -> None:
    """Batch by batch, every run in turn, one prefill a batch (see :func:`evaluate_many`)."""
    from tqdm.auto import tqdm

    batches, device = runs[0].batches, device_label(model)
    with tqdm(total=sum(map(len, batches)) * len(runs), desc=f"prompts × {len(runs)} policies", unit="prompt",
              leave=False) as bar:
        for k, batch in enumerate(batches):
            share: dict[str, Any] = {}
            for r in runs:
                if r.kept is not None and k in r.kept.done:
                    r.entries.append(r.kept.done[k])
                else:
                    start = time.perf_counter()
                    with r.session(model) as session:
                        rows, figures = _decode_batch(model, tokenizer, session, [samples[i] for i in batch],
                                                      settings, True, share)
                    seconds = time.perf_counter() - start
                    r.entries.append(_entry(k, rows, figures, seconds, device))
                    if r.kept is not None:
                        r.kept.add(r.entries[-1])
                    r.seconds += seconds
                bar.update(len(batch))


def _result(r: _Run, samples: list[dict[str, Any]], settings: EvalSettings) -> dict[str, Any]:
    records, kls, agree, fractions, kv = _in_prompt_order(r.entries, r.batches, len(samples))
    summary = dict(r.summary)
    if fractions:  # the engine ran: what its static step reads, no per-layer measurement
        summary["attended_fraction"] = sum(fractions) / len(fractions)
    kl_all, agree_all = torch.cat(kls), torch.cat(agree)
    scored = [x for x in records if x["score"] is not None and x["task"] == "passkey"]
    cells: dict[str, dict[str, list[bool]]] = {}
    for x in scored:
        cells.setdefault(str(x["context_length"]), {}).setdefault(f"{x['depth']}", []).append(x["correct"])
    manifest = r.job.manifest
    return {
        "policy": r.job.policy, "params": r.params, "settings": asdict(settings),
        "manifest": getattr(getattr(manifest, "model", None), "name", None),
        "passkey_accuracy": sum(x["correct"] for x in scored) / len(scored) if scored else None,
        "passkey_grid": {n: {d: sum(v) / len(v) for d, v in row.items()} for n, row in cells.items()},
        "tasks": task_scores(records),
        "kl_mean": float(kl_all.mean()) if kl_all.numel() else None,
        "top1_agreement": float(agree_all.float().mean()) if agree_all.numel() else None,
        "generated_tokens_mean": sum(x["generated_tokens"] for x in records) / len(records),
        "attended_fraction": summary["attended_fraction"],
        "kv_bytes_per_prompt": sum(kv) / len(kv) if kv else None,
        "seconds": time_split(r.entries),
        "devices": devices_of(r.entries),
        "layers": summary["layers"],
        "samples": records,
    }


@torch.no_grad()
def fidelity(model, tokenizer, manifest=None, policy: str = "delta", params: dict[str, Any] | None = None,
             source: str = "champ", limit: int = 8, max_new_tokens: int = 1024, batch: int = 8) -> dict[str, Any]:
    """Reasoning fidelity (DELTA's concern: sparse attention's errors accumulate over long generations). On
    reasoning prompts (``rolecall.data.reasoning``: CHAMP by default, chat-formatted), full attention decodes its own
    greedy trace of up to ``max_new_tokens`` tokens on the engine, and the policy, in a second decoder, is fed
    the same tokens: per step, KL(p_full ‖ p_policy) and top-1 agreement over the whole generation, and the
    divergence point, the first generated token the policy would have chosen otherwise (from there on its
    own greedy generation would part from full's)."""
    from rolecall.data.reasoning import build_reasoning_dataset
    from rolecall.eval.decoding import lockstep
    from rolecall.runtime.engine import shared_weights, static_step_of

    prompts = [s["input_ids"].tolist() for s in build_reasoning_dataset(tokenizer, source, limit)]
    with attach(model, manifest, policy, engine="static", **dict(params or {})) as session:
        bound = session.policy
    with shared_weights(model, positions=max(map(len, prompts)) + max_new_tokens) as weights:  # no second copy of them
        try:  # parameters the engine cannot run (a set size that changes per step) are refused here, in one line
            static_step_of(bound, weights.shape)
        except NotImplementedError as e:
            raise ValueError(f"the reasoning suite runs on the engine: {e}") from None
        eos = tokenizer.eos_token_id
        pad = pad_token(tokenizer)
        records, agreed = [], 0
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            run = lockstep(weights, bound, chunk, step_divergence, max_new_tokens=max_new_tokens, eos_token_id=eos,
                           pad_token_id=pad)
            for r in range(len(chunk)):
                agreed += int(run.agree[r].sum())
                records.append({"prompt_tokens": len(chunk[r]), "generated_tokens": len(run.tokens[r]),
                                "kl_mean": float(run.kl[r].mean()) if run.kl[r].numel() else None,
                                "top1_agreement": float(run.agree[r].float().mean()) if run.agree[r].numel() else None,
                                "divergence": run.divergence(r), "kl": run.kl[r].tolist()})
    steps = [k for r in records for k in r["kl"]]
    points = sorted(r["divergence"] for r in records if r["divergence"] is not None)
    scored = [r for r in records if r["kl_mean"] is not None]
    kl_interval = bootstrap_interval([r["kl_mean"] for r in scored], [len(r["kl"]) for r in scored]) if scored else None
    return {"policy": policy, "params": dict(params or {}), "source": source, "prompts": len(records),
            "max_new_tokens": max_new_tokens, "kl_mean": sum(steps) / len(steps) if steps else None,
            "kl_interval": kl_interval,
            "top1_agreement": agreed / len(steps) if steps else None,
            "divergence_median": points[len(points) // 2] if points else None,
            "never_diverged": sum(r["divergence"] is None for r in records) / len(records), "samples": records}


def format_fidelity(result: dict[str, Any]) -> str:
    """The report ``rolecall eval --suite reasoning`` prints."""
    lines = [f"policy {result['policy']} {result['params'] or ''}".rstrip() + f": full attention's greedy traces "
             f"on {result['source']} ({result['prompts']} prompts, up to {result['max_new_tokens']} tokens), the "
             "policy fed the same tokens", "", f"{'prompt':>7} {'tokens':>7} {'KL':>9} {'top-1':>6} {'diverges at':>12}"]
    for i, r in enumerate(result["samples"]):
        kl = "-" if r["kl_mean"] is None else f"{r['kl_mean']:.2e}"
        top1 = "-" if r["top1_agreement"] is None else f"{r['top1_agreement']:.3f}"
        lines.append(f"{i:>7} {r['generated_tokens']:>7} {kl:>9} {top1:>6} {r['divergence'] or 'never':>12}")
    kl, top1 = result["kl_mean"], result["top1_agreement"]
    ci = result.get("kl_interval")
    kl_text = "-" if kl is None else format(kl, ".3e") + (f" [{ci[0]:.2e}, {ci[1]:.2e}]" if ci else "")
    lines += ["", f"KL per step {kl_text}  top-1 agreement "
                  f"{'-' if top1 is None else format(top1, '.4f')}  median divergence point "
                  f"{result['divergence_median'] or 'none'}  never diverged {result['never_diverged']:.2f}"]
    return "\n".join(lines)


def record_of(sample: dict[str, Any], text: str, tokens: int, kl: torch.Tensor, top1: torch.Tensor) -> dict[str, Any]:
    """One prompt's line of the report: its task, cell, answer, generation, score and per-step divergence."""
    got = sample_score(text, sample)
    return {"task": sample.get("task", "passkey" if sample.get("answer") else None),
            "context_length": sample["context_length"], "depth": sample["depth"],
            "answer": sample.get("answers") or sample.get("answer"), "generated": text, "score": got,
            "correct": None if got is None else got == 1.0, "generated_tokens": tokens,
            "kl_mean": float(kl.mean()) if kl.numel() else None,
            "top1_agreement": float(top1.float().mean()) if top1.numel() else None}


def task_scores(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Mean score per task and context length, with its sample count and Wilson 95 % interval."""
    groups: dict[str, dict[str, list[float]]] = {}
    for r in records:
        if r["score"] is not None and r["task"] is not None:
            groups.setdefault(r["task"], {}).setdefault(str(r["context_length"]), []).append(r["score"])
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for task, by_length in groups.items():
        for n, scores in by_length.items():
            low, high = wilson_interval(sum(scores), len(scores))
            out.setdefault(task, {})[n] = {"score": sum(scores) / len(scores), "n": len(scores),
                                           "interval": [low, high]}
    return out


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report printed by ``rolecall eval``."""
    def f(x: Any, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    lines = [f"policy {result['policy']} {result['params'] or ''}".rstrip(), "",
             f"{'task':>20} {'length':>7} {'depth':>6} {'score':>6} {'tokens':>7} {'KL':>9} {'top-1':>6}  generated"]
    for r in result["samples"]:
        lines.append(f"{r['task'] or '-':>20} {r['context_length']:>7} {f(r['depth'], '.2f'):>6} "
                     f"{f(r['score'], '.2f'):>6} {r['generated_tokens']:>7} {f(r['kl_mean'], '.2e'):>9} "
                     f"{f(r['top1_agreement'], '.2f'):>6}  {r['generated'][:40]!r}")
    if result.get("tasks"):
        lines += ["", f"{'task':>20} {'length':>7} {'n':>5} {'score':>6}  Wilson 95 %"]
        for task, by_length in result["tasks"].items():
            for n, cell in by_length.items():
                low, high = cell["interval"]
                lines.append(f"{task:>20} {n:>7} {cell['n']:>5} {cell['score']:>6.3f}  [{low:.3f}, {high:.3f}]")
    if result.get("passkey_grid"):
        depths = sorted({d for row in result["passkey_grid"].values() for d in row})  # "0.1", ... or "None"
        lines += ["", "passkey accuracy by length (rows) and depth (columns)",
                  f"{'':>7} " + " ".join(f"{d:>6}" for d in depths)]
        for n, row in result["passkey_grid"].items():
            lines.append(f"{n:>7} " + " ".join(f"{f(row.get(d), '.2f'):>6}" for d in depths))
    lines += ["", f"{'layer':>5} {'read':>6} {'recall':>7} {'kept':>6}"]
    for layer in result["layers"]:
        lines.append(f"{layer['layer']:>5} {f(layer['attended_fraction']):>6} {f(layer['recall']):>7} "
                     f"{f(layer['kept_fraction']):>6}")
    passkeys = "" if result["passkey_accuracy"] is None else f"passkey accuracy {f(result['passkey_accuracy'])}  "
    lines += ["", f"{passkeys}KL {f(result['kl_mean'], '.3e')}  "
                  f"top-1 agreement {f(result['top1_agreement'])}  attended fraction {f(result['attended_fraction'])}  "
                  f"generated tokens {result['generated_tokens_mean']:.1f}"
                  + (f"  KV cache {result['kv_bytes_per_prompt'] / 2**20:.2f} MiB per prompt"
                     if result.get("kv_bytes_per_prompt") is not None else "")]
    split = result.get("seconds")
    if split:
        lines.append(f"time {split['total']:.1f} s over {split['batches']} batches: "
                     + ", ".join(f"{part} {split[part]:.1f}" for part in (*TIME_PARTS[1:-1], "setup", "other")))
    devices = result.get("devices") or {}
    if len(devices) > 1:  # a run resumed on another machine: which batches ran where
        lines.append("ran on " + ", ".join(f"{name} ({n} batch{'' if n == 1 else 'es'})" for name, n in devices.items()))
    return "\n".join(lines)
