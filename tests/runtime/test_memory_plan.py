"""The memory plan (``rolecall plan``, and ``rolecall serve`` before it loads): KV bytes a token and weights against
closed forms and transformers' own parameter count, pages of sliding windows and of Lethe's kept tokens, and the
refusals, each one line before anything loads."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from rolecall.cli import main
from rolecall.core.models import list_aliases, load_config, resolve_model
from rolecall.runtime.engine.shape import ModelShape
from rolecall.runtime.memory import (
    GIB,
    activation_bytes,
    held_weight_bytes,
    layer_pages,
    plan_memory,
    window_pages,
)
from tests.tiny import tiny_config


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_qwen_14b_holds_196608_bytes_a_token_and_its_weights_are_its_parameters(capsys):
    from transformers import AutoModelForCausalLM

    plan = plan_json(capsys, "--model", "qwen-14b")
    assert plan["kv_bytes_per_token"] == plan["kv_bytes_per_token_full"] == 2 * 48 * 8 * 128 * 2 == 196_608
    with torch.device("meta"):
        params = AutoModelForCausalLM.from_config(load_config("qwen-14b")).num_parameters()
    assert plan["weight_bytes"] == 2 * params  # 14.77 B parameters in bf16
    assert 14.7e9 < params < 14.8e9
    # 0.9 of an 80 GB H100 less weights and activations, in pages of 16 tokens of every layer
    pool = int(plan["device_bytes"] * 0.9) - plan["weight_bytes"] - plan["activation_bytes"]
    assert plan["pool_bytes"] == pool and plan["pool_pages"] == pool // (196_608 * 16)
    assert plan["pool_tokens"] == 16 * plan["pool_pages"]
    assert plan["max_concurrency"] == pool // (196_608 * 131_072) == 1


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_held_weights_are_the_models_parameters(family):
    from transformers import AutoModelForCausalLM

    for tied in (False, True):
        config = tiny_config(family, tie_word_embeddings=tied)
        model = AutoModelForCausalLM.from_config(config)
        assert held_weight_bytes(ModelShape.from_config(config), 4) == 4 * model.num_parameters(), (family, tied)


def test_a_gemma3_hybrid_holds_its_windows_pages_only():
    # 12 layers, every sixth full, windows of 512 tokens, one KV head of 256: 1,024 bytes a token of a layer (bf16)
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    config = tiny_config("gemma3", layers=12, heads=4, kv_heads=1, head_dim=256, sliding_window=512,
                         layer_types=types, max_position_embeddings=32768)
    shape = ModelShape.from_config(config)
    plan = plan_memory(shape, max_context=32768, element=2, device_bytes=80 * GIB, cuda=True)
    request = (2 * 2048 + 10 * 33) * 16 * 1024  # full layers: 2,048 pages; a window straddles 33 pages
    assert plan.request_bytes == request and plan.kv_bytes_per_token == request / 32768
    assert plan.kv_bytes_per_token_full == 12 * 1024


@pytest.mark.parametrize("window, context, pages", [
    (512, 100, 7), (512, 512, 32), (512, 513, 33), (512, 100_000, 33), (16, 16, 1), (16, 17, 2), (16, 999, 2),
    (17, 999, 2), (18, 999, 3),
])
def test_window_pages(window, context, pages):
    assert window_pages(window, context) == pages

    def touched(end: int) -> int:  # pages the positions a window ending at ``end`` reads lie on
        return len({p // 16 for p in range(max(0, end - window), end)})

    assert touched(context) <= pages
    if context >= window + 16:  # the worst of the window's 16 offsets in a page
        assert max(touched(end) for end in range(context, context + 16)) == pages


def test_lethe_at_a_quarter_holds_a_quarter_of_the_pages(capsys):
    full = plan_json(capsys, "--model", "qwen-14b", "--max-context", "32768")
    lethe = plan_json(capsys, "--model", "qwen-14b", "--max-context", "32768", "--policy", "lethe",
                      "-p", "sparse_ratio=0.25")
    kept = math.ceil(0.25 * 32768) + 1  # the capacity and the new token
    assert lethe["request_bytes"] == 48 * math.ceil(kept / 16) * 16 * 8 * 128 * 2 * 2
    assert lethe["max_concurrency"] >= 3 * full["max_concurrency"] >= 3


def test_layer_pages_take_the_smaller_of_context_and_what_is_held():
    shape = ModelShape.from_config(tiny_config("llama", layers=3))
    assert layer_pages(shape, 100, [10, 200, 16]) == [1, 7, 1]
    assert layer_pages(shape, 33) == [3, 3, 3]


def test_activation_estimate_counts_a_chunk_and_the_logits():
    shape = ModelShape.from_config(tiny_config("llama", layers=2, heads=4, kv_heads=1, head_dim=16))
    per_token = 3 * 64 + 96 + 64 + 3 * 128  # hidden ×3, q/k/v, attention output, MLP ×3
    assert activation_bytes(shape, 2, rows=3, chunk=10, cuda=False) == 2 * 10 * per_token + 8 * 3 * shape.vocab
    assert activation_bytes(shape, 2, rows=3, chunk=10, cuda=True) - activation_bytes(
        shape, 2, rows=3, chunk=10, cuda=False) == GIB


def test_a_plan_that_cannot_hold_one_request_exits_2_in_one_line(capsys):
    assert main(["plan", "--model", "qwen-14b", "--kv-cache-gib", "8"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.startswith("rolecall plan: error: qwen-14b with policy full cannot hold one "
                                                   "request of 131,072 tokens: it needs 24.00 GiB of KV and the pool "
                                                   "has 8.00 GiB"), err
    assert "--max-context 43680 or less" in err  # 8 GiB / 196,608 bytes, in whole pages
    assert "maximum concurrency for 131,072 tokens per request: 0" in captured.out
    assert main(["plan", "--model", "qwen-32b", "--gpu-memory-gib", "40"]) == 2
    err = capsys.readouterr().err
    assert "qwen-32b does not fit: 61.03 GiB of weights" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag, value", [("--gpu-memory-utilization", "0"), ("--gpu-memory-utilization", "1.5"),
                                         ("--gpu-memory-utilization", "nan"), ("--gpu-memory-utilization", "inf"),
                                         ("--kv-cache-gib", "-1"), ("--kv-cache-gib", "inf"),
                                         ("--gpu-memory-gib", "nan")])
def test_bad_memory_flags_are_one_line(flag, value, capsys):
    assert main(["plan", "--model", "qwen-14b", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rolecall plan: error: {flag} {float(value)!r}: give ") and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, says", [
    (["--gpu-memory-utilization", "inf"], "--gpu-memory-utilization inf: give the fraction"),
    (["--kv-cache-gib", "8", "--max-context", "131072"], "cannot hold one request of 131,072 tokens"),
    # a contiguous cache (--no-paged-kv): each row holds its whole context
    (["--kv-cache-gib", "30", "--max-context", "65536", "--slots", "3", "--dtype", "bfloat16", "--no-paged-kv"],
     "--slots 3: each row holds --max-context 65,536 tokens of KV (12.00 GiB) and the pool (30.00 GiB) holds 2; "
     "ask for --slots 2 or fewer"),
    # a served row of lethe's holds its whole context until KV is held by the page (rolecall plan says 39 here)
    (["--kv-cache-gib", "30", "--max-context", "65536", "--slots", "3", "--dtype", "bfloat16", "--policy", "lethe",
      "-p", "budget=4096"], "the pool (30.00 GiB) holds 2; ask for --slots 2 or fewer"),
])
def test_serve_refuses_a_plan_before_any_weight_loads(flags, says, monkeypatch, capsys):
    def load(*_, **__):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("rolecall.runtime.engine.Weights.random", load)
    argv = ["serve", "--model", "qwen-14b", "--random-weights", "--device", "cpu", "--policy", "full", "--port", "0"]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rolecall serve: error: ") and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("alias", list_aliases())
def test_every_alias_has_its_config_offline_and_it_matches_its_description(alias, monkeypatch):
    spec = resolve_model(alias)
    if spec.gguf:  # the config comes with the packaged weights (converted once, slow): the description is checked
        pytest.skip("read from its GGUF package")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config(alias)
    shape = ModelShape.from_config(config)
    layers, heads, kv = map(int, re.search(r"\((\d+) layers, (\d+) query / (\d+) KV heads", spec.description).groups())
    assert (shape.layers, shape.heads, shape.kv_heads) == (layers, heads, kv)
    assert config.max_position_embeddings == spec.context and shape.head_dim == 128


def test_a_paged_policy_serves_its_slots_over_the_plans_pages():
    """``full`` reads the cache through block tables: ``serve`` takes ``--slots`` rows (past the two requests of
    64K the pool holds at once) over a pool of the plan's pages and the null page; a hybrid's rings are set aside
    from the pool first, in every row."""
    from rolecall.cli import build_parser
    from rolecall.cli.serve import planned_slots
    from rolecall.runtime.memory import engine_pages
    from rolecall.runtime.session import bound_policy

    args = build_parser().parse_args(["serve", "--model", "qwen-14b", "--random-weights", "--kv-cache-gib", "30",
                                      "--max-context", "65536", "--slots", "16", "--dtype", "bfloat16"])
    config = load_config("qwen-14b")
    slots, plan, pool = planned_slots(args, config, bound_policy("full", None, config), "cpu", 65536)
    assert (slots, plan.max_concurrency, pool) == (16, 2, 30 * GIB // (16 * 196_608) + 1)  # 10,240 pages and the null one
    gemma = ModelShape.from_config(tiny_config("gemma3", layers=6))  # 2 full layers, 4 sliding of its window
    hybrid = plan_memory(gemma, max_context=4096, element=2, device_bytes=0, cuda=False, kv_cache_bytes=10 * 2**20)
    token = 2 * gemma.kv_heads * gemma.head_dim * 2
    rings = 4 * (min(gemma.windows[0], 4096) + 1) * token
    assert engine_pages(hybrid, gemma, 2, rows=3) == (10 * 2**20 - 3 * rings) // (16 * token * 2)
