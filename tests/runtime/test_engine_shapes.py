"""A long-lived session meets every request shape: bounded compilations, and never a compile failure."""

from __future__ import annotations

import os
import random

import pytest
import torch

from rolecall.runtime.engine.compiling import COMPILE_LIMIT, ROW_BUCKETS, FallsBackToEager, rows_for
from tests.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rows_round_up_to_the_nearest_bucket():
    assert [rows_for(n) for n in (1, 2, 3, 5, 8, 9, 13, 40, 65, 256, 300)] == [1, 2, 4, 8, 8, 12, 16, 48, 96, 256, 300]
    assert all(rows_for(n) < 1.5 * n for n in range(9, 257))  # less than half again as many rows past 8
    assert len(ROW_BUCKETS) < COMPILE_LIMIT


def test_a_function_past_the_recompile_limit_runs_eagerly_with_one_line(capsys):
    """Static code for each new shape until the limit; then the eager function, same values, one notice."""
    def scaled(x):
        return x * 2 + 1

    fn = FallsBackToEager(scaled, torch.compile(scaled, dynamic=False, fullgraph=True, backend="eager"))
    for n in range(1, COMPILE_LIMIT + 4):
        x = torch.arange(n, dtype=torch.float32)
        assert torch.equal(fn(x), x * 2 + 1)
    err = capsys.readouterr().err
    assert err.count("torch.compile failed on") == 1 and "FailOnRecompileLimitHit" in err and "scaled" in err


def _requests(seed: int, count: int, vocab: int) -> list[tuple[torch.Tensor, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        rows, width = rng.randint(1, 40), rng.randint(1, 300)
        ids = torch.randint(0, vocab - 8, (rows, width), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        out.append((ids, rng.randint(1, 6)))
    return out


@pytest.mark.slow
def test_a_session_survives_fifty_random_request_shapes_compiled(monkeypatch):
    """50 requests of 1–40 rows and 1–300 prompt tokens in one session with the step compiled (as on a GPU):
    every one succeeds, the engine compiles once per row bucket and no more, and the tokens are the ones the
    uncompiled engine gives."""
    monkeypatch.setenv("ROLECALL_COMPILE", "1")
    from rolecall.runtime import attach
    from rolecall.runtime.engine import Weights, generate
    from rolecall.runtime.policies.full import Full

    torch._dynamo.reset()
    model = tiny_model("qwen2")
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    requests = _requests(0, 50, model.config.vocab_size)
    buckets = set()
    with attach(model, None, "full", engine="static") as session:
        for ids, new in requests:
            out = session.generate(input_ids=ids, max_new_tokens=new, do_sample=False, eos_token_id=[])
            assert out.shape == (ids.shape[0], ids.shape[1] + new)
            assert session.last.info["rows"] == rows_for(ids.shape[0])
            buckets.add(rows_for(ids.shape[0]))
    compilations = counters["stats"]["unique_graphs"] - before
    assert 0 < compilations <= len(buckets)
    monkeypatch.setenv("ROLECALL_COMPILE", "0")
    weights = Weights.from_model(model)
    for ids, new in requests[:3]:  # the same tokens without compilation, without bucket rows
        want = generate(weights, Full(), ids.tolist(), max_new_tokens=new, eos_token_id=[])
        with attach(model, None, "full", engine="static") as session:
            monkeypatch.setenv("ROLECALL_COMPILE", "1")
            got = session.generate(input_ids=ids, max_new_tokens=new, do_sample=False, eos_token_id=[])
            monkeypatch.setenv("ROLECALL_COMPILE", "0")
        assert got[:, ids.shape[1]:].tolist() == want.tokens


@pytest.mark.gpu
@pytest.mark.slow
def test_the_embedded_model_survives_fifty_random_request_shapes_on_gpu():
    """The embedded SmolLM2 in bf16 on the engine (compiled, CUDA graphs): 50 requests of 1–40 rows and random
    prompt lengths in one session, none fails."""
    from rolecall.core.models import load_model
    from rolecall.runtime import attach

    name = os.environ.get("ROLECALL_TEST_MODEL", "smollm2-135m")
    model = load_model(name, dtype=torch.bfloat16).to("cuda")
    rng = random.Random(1)
    with attach(model, None, "full") as session:
        for i in range(50):
            rows, width, new = rng.randint(1, 40), rng.randint(1, 2000), rng.randint(1, 32)
            ids = torch.randint(100, 40000, (rows, width), device="cuda")
            out = session.generate(input_ids=ids, max_new_tokens=new, do_sample=False, eos_token_id=[])
            assert out.shape == (rows, width + new), i
            assert session.last.info["graphs"] or new == 1, i  # one new token is the prefill's: no step to capture
