"""benchmarks/calibrate.py, multi_gpu.py, train_step.py, memory.py, serve_overlap.py, plan_fit.py and cpu_step.py refuse bad counts, lengths
and parts in one line (exit status 2, the flag, its limit and the value given) before any model is built, command
launched or file written."""

import pytest

from tests.benchmarks import load_benchmark, refusal


def too_low(script: str, flag: str, value: str, low: int, why: str = "") -> tuple[str, list[str], str]:
    """The case of ``script``'s ``flag`` given ``value``, below its ``low``: the refusal names the flag, the low,
    why where there is a reason, and the value."""
    return script, [flag, value], f"{flag} must be at least {low}{f' ({why})' if why else ''}, got {value}"


WORK = {"calibrate": ("build",), "multi_gpu": ("launch", "traces_file"), "train_step": ("build_model",),
        "memory": ("measure",), "serve_overlap": ("measure",), "plan_fit": ("measure",),
        "cpu_step": ("step_ms", "run_load")}


@pytest.mark.parametrize("script, flags, says", [
    too_low("calibrate", "--traces", "0", 1),
    too_low("calibrate", "--length", "-8", 1),
    too_low("calibrate", "--stride", "0", 1),
    too_low("calibrate", "--query-block", "0", 1),
    too_low("calibrate", "--min-context", "-1", 0),
    ("calibrate", ["--length", "512"], "--min-context must be below --length (512): queries are recorded from that "
                                       "position on, got 1024"),
    ("calibrate", ["--budget-s", "0"], "--budget-s must be a positive number of seconds, got 0.0"),
    ("calibrate", ["--baseline-lengths", "4096,0"],
     "--baseline-lengths takes comma-separated lengths of at least 1 each, got '4096,0'"),
    ("calibrate", ["--baseline-lengths", "-4096,8192"],  # a value, not an unknown option
     "--baseline-lengths takes comma-separated lengths of at least 1 each, got '-4096,8192'"),
    ("calibrate", ["--baseline-lengths", "16384"],
     "--baseline-lengths takes lengths of at most --length (8192) each, got '16384'"),
    ("multi_gpu", ["--parts", "calibrate,foo"], "--parts: unknown foo; known: calibrate, ddp, zero3, large"),
    ("multi_gpu", ["--parts", ","], "--parts: none given; known: calibrate, ddp, zero3, large"),
    too_low("multi_gpu", "--traces", "0", 1),
    too_low("multi_gpu", "--trace-tokens", "256", 257, "calibrate-delta records from position 256 on"),
    too_low("multi_gpu", "--steps", "1", 2, "a 1-GPU run resumes the half-way checkpoint"),
    ("multi_gpu", ["--warmup", "30"], "--warmup must be below --steps (30): the steps after it are timed, got 30"),
    too_low("multi_gpu", "--zero3-steps", "2", 3, "the resumed runs continue from the step-2 checkpoint"),
    ("multi_gpu", ["--prompt-lengths", "16384", "0"], "--prompt-lengths must be at least 1 each, got 16384 0"),
    too_low("multi_gpu", "--large-steps", "0", 1),
    too_low("multi_gpu", "--limit", "0", 1),
    ("train_step", ["--lengths", "1000", "0"], "--lengths must be at least 1 each, got 1000 0"),
    too_low("train_step", "--span", "1", 2, "the labelled tokens follow its first"),
    ("train_step", ["--answers", "730"], "--answers must be below --span (730): each labels one of the span's tokens "
                                         "after its first, got 730"),
    too_low("train_step", "--layers", "1", 2, "layer 0 stays full, the others get gates"),
    ("train_step", ["--budget", "1.5"],
     "--budget must be the fraction of the context a sparse head reads, in (0, 1], got 1.5"),
    too_low("train_step", "--repeats", "0", 1),
    too_low("train_step", "--prefill-chunk", "0", 1),
    ("memory", ["--models", "7b,9b"], "--models: unknown 9b; known: 7b, 1.5b, 32b"),
    too_low("memory", "--prompt", "0", 1),
    too_low("memory", "--new", "-1", 1),
    ("serve_overlap", ["--policies", "delta,quest"], "--policies takes comma-separated names of full, delta, lychee, "
                                                     "got 'delta,quest'"),
    ("serve_overlap", ["--policies", ","], "--policies takes comma-separated names of full, delta, lychee, got ','"),
    ("serve_overlap", ["--prompt", "0"], "--prompt must be 1 to 32767 (the prefill's decoder holds 32768 slots), got 0"),
    ("plan_fit", ["--models", "qwen-14b,qwen-99b"], "--models: unknown qwen-99b; known: "),
    too_low("plan_fit", "--requests", "0", 1),
    ("plan_fit", ["--prompt-tokens", "0:8"], "--prompt-tokens takes token counts of at least 1, got '0:8'"),
    ("cpu_step", ["--contexts", "512,32"], "--contexts takes comma-separated token counts of at least 64 each"),
    too_low("cpu_step", "--slots", "0", 1),
    ("cpu_step", ["--contexts", "64", "--prompt-tokens", "40", "--new-tokens", "30"],
     "--prompt-tokens + --new-tokens (70) must fit the smallest context (64)"),
    ("serve_overlap", ["--prompt", "32768"],
     "--prompt must be 1 to 32767 (the prefill's decoder holds 32768 slots), got 32768"),
])
def test_bad_numbers_are_refused_in_one_line_before_any_work(tmp_path, monkeypatch, capsys, script, flags, says):
    module = load_benchmark(script)
    for name in WORK[script]:
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("work started on flags that should be refused"))
    monkeypatch.chdir(tmp_path)
    out = ["--json", "r.json"] if script == "train_step" else ["--out", "o"]
    err = refusal(capsys, module, [*flags, *out])
    assert says in err and err.endswith(f"(`{script}.py --help` lists the options)")
    assert not list(tmp_path.iterdir())
