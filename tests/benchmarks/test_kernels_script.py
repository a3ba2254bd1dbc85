"""benchmarks/kernels.py and benchmarks/decode.py refuse bad shapes and counts in one line before anything is timed (or
a GPU is looked for)."""

import shlex
import sys

import pytest


@pytest.mark.parametrize("flags, says", [
    ("--contexts 32k", "--contexts takes comma-separated context lengths, got '32k'"),
    ("--batches 1,0", "--batches takes comma-separated batch sizes of at least 1 each, got '1,0'"),
    ("--rows 8,x", "--rows takes comma-separated row counts, got '8,x'"),
    ("--contexts 4096,100", "--contexts takes multiples of the 64-token blocks the sparse calls read, got "
                            "'4096,100'"),
    ("--contexts ,", "--contexts takes comma-separated context lengths of at least 64 each, got ','"),
    ("--rounds 0", "--rounds must be at least 1, got 0"),
])
def test_bad_shape_lists_are_refused_in_one_line(monkeypatch, capsys, flags, says):
    from benchmarks import kernels

    monkeypatch.setattr(sys, "argv", ["kernels.py", *shlex.split(flags)])
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: pytest.fail("looked for a GPU first"))
    with pytest.raises(SystemExit) as done:
        kernels.main()
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and says in err and "\n" not in err


def test_kernels_benchmark_takes_every_projection_when_none_is_named():
    from benchmarks import kernels

    assert kernels.parse_args([]).projections == ()
    assert kernels.parse_args(["--projections", "7b o, 1.5b o"]).projections == ("7b o", "1.5b o")


def test_rounds_merge_by_median_and_ratios_follow_the_medians():
    from benchmarks import kernels

    def round_(ours, fi, sdpa):  # one round at 1K × 1: 2 of the 16 blocks read by a sparse head
        return {"batch": 1, "context": 1024, "blocks_read_per_sparse_head": 2, "dense_launch": {"tile": 128},
                "sdpa_ms": sdpa, "ours_dense_ms": ours, "sparse_0_ms": ours, "sparse_4_ms": 0.6, "sparse_8_ms": 0.2,
                "gather_sdpa_ms": 1.0, "page_scores_ms": 0.5, "decode_and_score_ms": 1.5,
                "flashinfer_dense_ms": fi, "flashinfer_sparse_ms": 0.25, "flashinfer_version": "0.5.3"}

    row = kernels.merge_rounds([round_(1.0, 0.9, 2.0), round_(1.2, 1.1, 1.0), round_(0.8, 1.0, 4.0)])
    assert row["rounds_ms"]["ours_dense_ms"] == [1.0, 1.2, 0.8] and row["rounds_ms"]["flashinfer_dense_ms"] == [0.9, 1.1, 1.0]
    assert (row["ours_dense_ms"], row["flashinfer_dense_ms"], row["sdpa_ms"]) == (1.0, 1.0, 2.0)
    assert row["dense_launch"] == {"tile": 128} and row["flashinfer_version"] == "0.5.3"
    assert "rounds_ms" not in kernels.merge_rounds([round_(1.0, 0.9, 2.0)])

    bw = 1e9
    row = kernels.derive(row, bw)
    dense = 8 * 1024 * 128 * 2 * 2  # 8 KV heads' K and V, bf16
    sparse = 2 * 64 * 128 * 2 * 2  # 2 blocks of 64 tokens
    assert row["sparse_8_bytes"] == 8 * sparse and row["sparse_4_bytes"] == 4 * dense // 8 + 4 * sparse
    assert row["sparse_8_byte_limit"] == pytest.approx(8.0) and row["sparse_8_speedup_vs_sdpa"] == pytest.approx(10.0)
    assert row["sparse_8_bandwidth_fraction"] == pytest.approx(8 * sparse / 0.2e-3 / bw)
    assert row["ours_dense_bandwidth_fraction"] == pytest.approx(dense / 1e-3 / bw)
    assert row["selection_overhead"] == pytest.approx(0.5) and row["selection_overhead_fused"] == pytest.approx(0.5)
    assert row["flashinfer_sparse_vs_ours"] == pytest.approx(1.25)


@pytest.mark.parametrize("flags, says", [
    ("--contexts a,b", "--contexts takes comma-separated context lengths, got 'a,b'"),
    ("--batches 0", "--batches takes comma-separated batch sizes of at least 1 each, got '0'"),
    ("--budgets 0,2048", "--budgets takes comma-separated token budgets of at least 1 each, got '0,2048'"),
    ("--steps 0", "--steps must be at least 1, got 0"),
    ("--delta-batch 0", "--delta-batch must be at least 1, got 0"),
    ("--retrieval-heads -2", "--retrieval-heads must be at least 0, got -2"),
    ("--delta-total 512", "--delta-total must be past --delta-prompt (512), got 512"),
    ("--policies ,", "--policies: none given; known: full, delta, delta-refine, lychee, quest, vattention, lethe"),
    ("--models ''", "--models: none given; known: 7b, 1.5b"),
    ("--models '' --real x --policies quick", "--policies: unknown quick; known: full, delta"),
    ("--generate 32768", "--generate: '32768' is not CONTEXTxBATCH (e.g. 32768x8)"),
    ("--generate 32768x0", "--generate: '32768x0' is not CONTEXTxBATCH (e.g. 32768x8)"),
    ("--generate 64x1 --smoke", "--generate times the engine on a GPU; --smoke runs on the CPU"),
    ("--generate-new 1", "--generate-new must be at least 2, got 1"),
])
def test_decode_benchmark_refuses_bad_counts_in_one_line(capsys, flags, says):
    from benchmarks import decode

    with pytest.raises(SystemExit) as done:
        decode.parse_args(shlex.split(flags))
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and says in err and "\n" not in err


def test_decode_benchmark_times_only_the_real_model_without_models():
    from benchmarks import decode

    args = decode.parse_args(["--models", "", "--no-delta-setting", "--real", "smollm2-135m"])
    assert args.models == [] and args.real == "smollm2-135m"


def test_the_gemma_shape_is_what_the_engine_reads_of_its_config_and_its_roles_skip_sliding_layers():
    """decode.py's and memory.py's Gemma 3 4B shape is the shape the engine reads from the config memory.py builds
    for it (a hybrid model: 29 of 34 layers slide), and DELTA's roles for it give sliding layers role 0, the first
    full-attention layer full, then Δ and sparse in turn."""
    from benchmarks import decode, memory
    from rolecall.core.models import sliding_layers
    from rolecall.runtime.engine import ModelShape

    shape = decode.GEMMA3_4B
    assert ModelShape.from_config(memory.config_of(shape)) == shape
    assert sum(w is not None for w in shape.windows) == 29
    assert list(shape.sliding_layers) == sliding_layers(memory.config_of(shape)) == \
        sliding_layers(decode._config(shape))  # the shape, its config and the policies' config agree
    assert decode.SHAPES["7b"].sliding_layers == () and "layer_types" not in vars(decode._config(decode.SHAPES["7b"]))
    assert decode.delta_manifest(shape).layer_role.tolist() == \
        [{11: 1, 17: 2, 23: 1, 29: 2}.get(i, 0) for i in range(34)]
    assert decode.delta_manifest(decode.SHAPES["7b"]).layer_role.tolist() == \
        [0, 0, 1] + [2] * 11 + [1] + [2] * 7 + [1] + [2] * 5
    assert memory.parse_args(["--policies", "full,lychee"]).policies == ["full", "lychee"]


def test_the_users_path_runs_each_policy_beside_its_step_row():
    """``--generate`` (here on the CPU, a tiny shape): every policy's request goes through ``session.generate``
    twice, decodes the asked tokens, and is set beside the grid's row of the same configuration (or None)."""
    from benchmarks import decode

    args = decode.parse_args(["--models", "7b", "--policies", "full,delta,lychee", "--budgets", "32",
                              "--generate", "96x2", "--generate-new", "8", "--retrieval-heads", "40"])
    assert args.generate == [(96, 2)]
    steps = [{"model": "tiny", "batch": 2, "context": 96, "policy": "delta", "budget": 32, "tpot_ms": 2.0}]
    rows = decode.users_path(args, "tiny", decode.SMOKE_SHAPE, steps, device="cpu")
    assert [r["policy"] for r in rows] == ["full", "delta", "lychee"]
    for r in rows:
        assert r["generate_tpot_ms"] > 0 and r["first_request_tpot_ms"] > 0 and r["new_tokens"] == 8
    delta = rows[1]
    assert delta["step_tpot_ms"] == 2.0 and delta["generate_over_step"] == pytest.approx(delta["generate_tpot_ms"] / 2.0)
    assert rows[0]["step_tpot_ms"] is None and rows[0]["generate_over_step"] is None
