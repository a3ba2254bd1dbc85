"""Triton kernels against their PyTorch references: on a GPU, and on the CPU through Triton's interpreter.

The interpreter runs the kernel's code on CPU tensors (slowly), so CI checks its logic on small shapes; the
GPU run covers the odd shapes and dtypes that matter for speed (T up to 131072, bf16/fp16).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rolecall.runtime.kernels.sparse_attention import naive

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _case(b, hq, hkv, t, d, n, bs, dtype, device, seed=0, weights=False, mask=False, full=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(device, dtype)
    k = torch.randn(b, hkv, t, d, generator=g).to(device, dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(device, dtype)
    blocks = -(-t // bs)
    idx = torch.stack([torch.randperm(blocks, generator=g)[:n] for _ in range(b * hkv)]).view(b, hkv, -1)
    if idx.shape[-1] < n:  # pad rows when there are fewer blocks than requested
        idx = torch.cat([idx, torch.full((b, hkv, n - idx.shape[-1]), -1)], -1)
    idx[..., -1:] = torch.where(torch.rand(b, hkv, 1, generator=g) < 0.3, -1, idx[..., -1:])  # ragged rows
    idx = idx.sort(-1).values.to(device)
    kw = {}
    if weights:
        kw["log_weights"] = (torch.rand(b, hkv, n, generator=g) * 2).to(device)
    if mask:
        km = torch.ones(b, t, dtype=torch.bool)
        km[0, : t // 3] = False  # left padding of the first sequence
        kw["key_mask"] = km.to(device)
    fr = (torch.rand(b, hkv, generator=g) < 0.5).to(device) if full else None
    return q, k, v, idx, kw, fr


def _reference(q, k, v, idx, kw, fr, bs, scale):
    out, lse = naive.sparse_decode_attention(q, k, v, idx, scale=scale, block_size=bs, **kw)
    if fr is not None:
        kw = {k_: v_ for k_, v_ in kw.items() if k_ != "log_weights"}
        dense_out, dense_lse = naive.sparse_decode_attention(q, k, v, None, scale=scale, **kw)
        g = q.shape[1] // k.shape[1]
        rows = fr.repeat_interleave(g, dim=1)
        out = torch.where(rows[..., None], dense_out, out)
        lse = torch.where(rows, dense_lse, lse)
    return out, lse


def _check(case, bs, tol, chunk=None):
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    q, k, v, idx, kw, fr = case
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = _reference(q, k, v, idx, kw, fr, bs, scale)
    out, lse = tri.sparse_decode_attention(q, k, v, idx, scale=scale, block_size=bs, full_rows=fr, chunk=chunk, **kw)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    err = (out - ref_out).norm(dim=-1) / ref_out.norm(dim=-1).clamp_min(1e-6)
    assert err[finite].max() < tol, err.max()
    assert (lse[finite] - ref_lse[finite]).abs().max() < tol * 10


INTERPRET_CASES = [
    # b, hq, hkv, t, d, n, bs, extras
    (1, 4, 1, 17, 16, 5, 1, {}),
    (2, 4, 4, 100, 32, 3, 16, {"weights": True}),
    (3, 7, 1, 70, 16, 2, 16, {"mask": True, "full": True}),
    (2, 8, 2, 130, 16, 2, 64, {"full": True, "weights": True}),
    (1, 4, 2, 1100, 16, 30, 16, {"full": True, "mask": True}),  # 18 splits: the combine loops over blocks
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("b, hq, hkv, t, d, n, bs, extra", INTERPRET_CASES)
def test_sparse_decode_matches_reference_in_interpreter(monkeypatch, b, hq, hkv, t, d, n, bs, extra):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check(_case(b, hq, hkv, t, d, n, bs, torch.float32, "cpu", **extra), bs, 1e-4, chunk=64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
def test_sparse_decode_with_uneven_chunks_matches_reference_in_interpreter():
    """A chunk of three tiles (not a power of two), so programs start mid-way through a power-of-two range."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    case = _case(1, 4, 2, 1100, 16, 30, 16, torch.float32, "cpu", full=True, mask=True)
    _check(case, 16, 1e-4, chunk=192)


def _check_one_program_a_row(monkeypatch, b, hq, hkv, t, d, n, dtype, device, tol):
    """A call of many rows: one program a row (choose_launch), which writes the output itself (no merge is
    launched), equal to the reference with log weights, a key mask and ragged rows."""
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    def no_merge(*args, **kwargs):
        raise AssertionError("a call of one program a row launched the merge")

    monkeypatch.setattr(tri, "combine_partials", no_merge)
    _check(_case(b, hq, hkv, t, d, n, 16, dtype, device, weights=True, mask=True), 16, tol)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
def test_sparse_decode_one_program_a_row_matches_reference_in_interpreter(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.sparse_attention.triton import choose_launch

    assert choose_launch(13 * 16, 6 * 2, 8, dense=False) == (256, 128, 3)  # the CPU stands for 8 SMs
    _check_one_program_a_row(monkeypatch, 6, 6, 2, 300, 16, 13, torch.float32, "cpu", 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("b, hq, hkv, n, dtype", [(64, 12, 2, 64, torch.bfloat16), (48, 28, 4, 128, torch.float16)])
def test_sparse_decode_one_program_a_row_matches_reference_on_gpu(monkeypatch, b, hq, hkv, n, dtype):
    _check_one_program_a_row(monkeypatch, b, hq, hkv, 4096, 128, n, dtype, "cuda", 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("d, dtype", [(256, torch.bfloat16), (128, torch.float32)])
def test_many_rows_whose_tiles_do_not_fit_split_on_gpu(d, dtype):
    """128 rows of heads of 256 (Gemma 3) or of a float32 cache, read through bounds as the engine reads: one
    program a row would not fit in shared memory (test_one_program_a_row_only_where_its_tiles_fit), so these calls
    split instead of failing to launch; gathered and dense, as the reference."""
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    b, t = 64, 2048
    q, k, v, idx, _, _ = _case(b, 8, 2, t, d, 64, 16, dtype, "cuda")
    first = torch.zeros(b, dtype=torch.long, device="cuda")
    first[0] = t // 3  # left padding of the first sequence
    last = torch.tensor(t - 2, device="cuda")
    ids = torch.arange(t, device="cuda")
    mask = (ids[None, :] >= first[:, None]) & (ids[None, :] <= last)
    for indices in (idx, None):
        got, lse = tri.sparse_decode_attention(q, k, v, indices, scale=d**-0.5, block_size=16, key_span=(first, last))
        want, want_lse = _reference(q, k, v, indices, {"key_mask": mask}, None, 16, d**-0.5)
        finite = torch.isfinite(want_lse)
        err = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
        assert torch.equal(finite, torch.isfinite(lse)) and err[finite].max() < 2e-2


@pytest.mark.gpu
def test_split_launch_of_a_smaller_gpu_matches_reference_on_gpu(monkeypatch):
    """As on sm86/sm89 (101,376 bytes a program): heads of 256 in a float32 cache take 32-token tiles, which must give
    the reference's output too, gathered and dense, split over programs with their merge."""
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    monkeypatch.setattr(tri, "max_shared", lambda tensor: 101376)
    b, t, d = 3, 3000, 256
    q, k, v, idx, _, _ = _case(b, 8, 2, t, d, 64, 16, torch.float32, "cuda")
    assert tri.choose_launch(t, b * 2, 132, dense=True, head_dim=d, itemsize=4, shared=101376)[1] == 32
    for indices in (idx, None):
        got, lse = tri.sparse_decode_attention(q, k, v, indices, scale=d**-0.5, block_size=16)
        want, want_lse = _reference(q, k, v, indices, {}, None, 16, d**-0.5)
        err = (got - want).norm(dim=-1) / want.norm(dim=-1)
        assert err.max() < 1e-2 and (lse - want_lse).abs().max() < 1e-2  # float32 through TF32 products


@pytest.mark.parametrize("tokens, rows, dense, expected", [
    (1024, 128, False, (1024, 128, 3)),  # DELTA's setting: 64 rows × 2 KV heads, one program a row
    (1000, 96, False, (1024, 128, 3)),  # whole tiles, from 96 gathered rows of 132 SMs on
    (1024, 64, False, (128, 64, 2)),  # 64 gathered rows split, as choose_chunk says
    (18432, 128, True, (18432, 128, 3)),  # rows that stream the cache too (DELTA's Δ-layers) ...
    (32768, 96, True, (32768, 128, 3)),  # ... from 93 rows on (7B heads at 32K × 24)
    (32768, 64, True, (4096, 64, 2)),  # Llama-3-8B heads at 32K × 8 split: 64 programs stream too little
    (131072, 32, True, (8192, 64, 2)),  # 7B at 128K × 8
    (2048, 32, False, (128, 64, 2)),  # 7B sparse layer at 8 rows
])
def test_choose_launch_gives_many_rows_one_program_each(tokens, rows, dense, expected):
    from rolecall.runtime.kernels.sparse_attention.triton import choose_launch

    assert choose_launch(tokens, rows, 132, dense=dense) == expected


@pytest.mark.parametrize("rows, bandwidth, one", [
    (93, None, True),  # torch does not say: by the SMs alone (93 rows of 132 SMs)
    (92, None, False),
    (93, 2.619e9 * 2 * 640, True),  # an H100 SXM's HBM3 (3.35 TB/s): 84 rows stream it, below the SMs' 93
    (96, 4.8e12, False),  # an H200: 120 rows stream its rated 4.8 TB/s ...
    (120, 4.8e12, True),  # ... at 40 GB/s each
    (92, 2.0e12, False),  # a slower memory does not lower the SMs' threshold
])
def test_rows_that_stream_the_cache_are_one_program_each_only_where_they_reach_the_peak_bandwidth(rows, bandwidth,
                                                                                                   one):
    from rolecall.runtime.kernels.sparse_attention.triton import choose_launch

    chunk, tile, stages = choose_launch(131072, rows, 132, dense=True, bandwidth=bandwidth)
    assert (chunk, tile, stages) == ((131072, 128, 3) if one else (chunk, 64, 2)) and (chunk < 131072) != one
    assert choose_launch(1024, 128, 132, dense=False, bandwidth=4.8e12)[1] == 128  # gathered rows: by the SMs


def test_peak_bandwidth_is_the_memory_clock_times_two_times_the_bus(monkeypatch):
    """Bytes a second from torch's device properties (double data rate); None where torch does not say or on the
    CPU."""
    from types import SimpleNamespace

    from rolecall.runtime.kernels import peak_bandwidth

    cuda = SimpleNamespace(is_cuda=True, device="cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120))
    assert peak_bandwidth(cuda) == pytest.approx(3.352e12, rel=1e-3)  # an H100 SXM
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(memory_bus_width=5120))
    assert peak_bandwidth(cuda) is None
    assert peak_bandwidth(torch.zeros(1)) is None


@pytest.mark.gpu
def test_torch_tells_the_gpus_peak_bandwidth_on_gpu():
    """The launch rule reads the memory's peak from torch's device properties; were torch to stop giving it, the
    rule would fall back to the SMs' alone without a word, so this test says so instead."""
    from rolecall.runtime.kernels import peak_bandwidth

    peak = peak_bandwidth(torch.empty(1, device="cuda"))
    assert peak is not None and 0.3e12 < peak < 20e12  # HBM and GDDR GPUs of today: 0.3 to 8 TB/s


@pytest.mark.parametrize("head_dim, itemsize, shared, one", [
    (128, 2, 232448, True),  # bf16 heads of 128 on an H100: 139,264 bytes compiled
    (128, 2, 101376, False),  # ... not on sm86/sm89
    (256, 2, 232448, False),  # Gemma 3's heads of 256: 274,432 bytes compiled, more than an H100 has
    (128, 4, 232448, False),  # a float32 cache: 278,528
    (64, 2, 101376, True),  # SmolLM2's heads of 64 fit sm89 (71,680)
])
def test_one_program_a_row_only_where_its_tiles_fit(head_dim, itemsize, shared, one):
    """The tiles of one program a row must fit the GPU's shared memory, else the launch fails (Triton's
    OutOfResources): where they would not, the call splits as it did before."""
    from rolecall.runtime.kernels.sparse_attention.triton import choose_launch, shared_bytes

    chunk, tile, stages = choose_launch(1024, 128, 132, dense=True, head_dim=head_dim, itemsize=itemsize,
                                        shared=shared)
    assert (tile == 128) == one and (stages == 3) == one
    compiled = {(128, 2): 139264, (256, 2): 274432, (128, 4): 278528, (64, 2): 71680}[(head_dim, itemsize)]
    assert compiled <= shared_bytes(128, 3, head_dim, itemsize)  # the estimate bounds what Triton took


@pytest.mark.parametrize("head_dim, itemsize, shared, tile", [
    (256, 4, 101376, 32),  # Gemma 3's heads in a float32 cache on sm86/sm89: 64-token tiles took 151,552 bytes
    (256, 2, 101376, 64),  # ... in bf16 75,776
    (128, 4, 101376, 64),  # heads of 128 in float32: 77,824
    (256, 4, 232448, 64),  # an H100 holds them
    (256, 4, None, 64),  # the CPU: no limit
])
def test_split_launch_tiles_fit_shared_memory(head_dim, itemsize, shared, tile):
    """The split launch's tiles (two stages) also fit the GPU: 32-token tiles where 64 would not. Compiled sizes for
    sm80, sm89 and sm90 (Triton 3.9, dense and gathered calls alike within 512 bytes) are bounded by the estimate."""
    from rolecall.runtime.kernels.sparse_attention.triton import choose_launch, shared_bytes, split_tile

    assert split_tile(head_dim, itemsize, shared) == tile
    assert choose_launch(4096, 16, 132, dense=True, head_dim=head_dim, itemsize=itemsize, shared=shared)[1:] == (tile, 2)
    compiled = {(256, 4, 64): 152064, (256, 4, 32): 84224, (256, 2, 64): 76288, (128, 4, 64): 78336}
    assert compiled[(head_dim, itemsize, tile)] <= shared_bytes(tile, 2, head_dim, itemsize) <= (shared or 1 << 30)
    if tile == 32:
        assert compiled[(head_dim, itemsize, 64)] > shared  # the tile it replaced would have failed to launch


@pytest.mark.parametrize("tokens, rows, dense, tile, expected", [
    (18432, 128, True, 64, 4608),  # 1.5B heads at 18K x 64: four even chunks (a power of two gave three)
    (13120, 64, False, 64, 1664),  # 10 % of 64-token blocks at 128K x 8: eight chunks
    (2048, 32, False, 64, 128),  # 7B sparse layer at 8 rows: 16 chunks of two tiles
    (131072, 32, True, 64, 8192),
    (100, 1, True, 64, 256),  # the floor for rows that stream the cache
    (1000, 4, False, 128, 128),  # gathered sets: floor 128, one tile
])
def test_choose_chunk_splits_rows_evenly_in_whole_tiles(tokens, rows, dense, tile, expected):
    from rolecall.runtime.kernels.sparse_attention.triton import choose_chunk

    chunk = choose_chunk(tokens, rows, 132, dense=dense, tile=tile)
    assert chunk == expected
    assert chunk % tile == 0 and chunk >= (256 if dense else 128)
    splits = math.ceil(tokens / chunk)
    assert (splits - 1) * chunk < tokens <= splits * chunk  # no program of a full row is left without tokens
    assert rows * splits <= 8 * 132 or chunk == (256 if dense else 128)  # about four programs per SM, not more


GPU_CASES = [
    (b, hq, hkv, t, d, bs, dtype)
    for (b, hq, hkv) in [(1, 8, 8), (3, 32, 8), (2, 28, 4)]  # GQA ratios 1, 4, 7
    for t in (1, 17, 1000, 131072)
    for d in (64, 128)
    for bs in (1, 16, 64)
    for dtype in (torch.bfloat16, torch.float16)
    if not (t == 131072 and (b > 1 or bs == 1))
]


@pytest.mark.gpu
@pytest.mark.parametrize("b, hq, hkv, t, d, bs, dtype", GPU_CASES)
def test_sparse_decode_matches_reference_on_gpu(b, hq, hkv, t, d, bs, dtype):
    n = max(1, min(-(-t // bs), 40))
    case = _case(b, hq, hkv, t, d, n, bs, dtype, "cuda", weights=True, mask=True, full=True)
    _check(case, bs, 2e-2)


def _check_page_scores(b, hq, hkv, t, d, page, dtype, device, per_kv):
    from rolecall.runtime.kernels.page_scores import naive as page_naive
    from rolecall.runtime.kernels.page_scores import triton as page_tri

    g = torch.Generator(device="cpu").manual_seed(1)
    q = (torch.randn(b, hq, d, generator=g) * 2).to(device, dtype)
    k = torch.randn(b, hkv, t, d, generator=g).to(device, dtype)
    km = torch.ones(b, t, dtype=torch.bool)
    km[-1, : t // 4] = False
    km = km.to(device)
    scale = d ** -0.5
    _, lse = naive.sparse_decode_attention(q, k, k, None, scale=scale, key_mask=km)
    got = page_tri.page_scores(q, k, lse, scale, page, key_mask=km, per_kv_head=per_kv)
    probs = page_naive.attention_probs(q, k, scale, km)  # [B, Hq, T]
    if per_kv:
        want = page_naive.pool_pages(probs.view(b, hkv, hq // hkv, t).amax(2), page)
    else:
        want = page_naive.page_scores(q, k, scale, page, km)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-3 if dtype != torch.float32 else 1e-5, rtol=1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("b, hq, hkv, t, d, page, per_kv", [(2, 4, 2, 50, 16, 16, False), (1, 7, 1, 33, 32, 16, True),
                                                            (2, 8, 2, 130, 16, 64, True)])
def test_page_scores_match_reference_in_interpreter(b, hq, hkv, t, d, page, per_kv):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_page_scores(b, hq, hkv, t, d, page, torch.float32, "cpu", per_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("b, hq, hkv, t, d", [(1, 8, 8, 17, 64), (3, 32, 8, 1000, 128), (2, 28, 4, 131072, 128)])
@pytest.mark.parametrize("per_kv", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_page_scores_match_reference_on_gpu(b, hq, hkv, t, d, per_kv, dtype):
    _check_page_scores(b, hq, hkv, t, d, 16, dtype, "cuda", per_kv)


def _check_decode_and_score(b, hq, hkv, t, d, page, dtype, device, per_kv):
    from rolecall.runtime.kernels.page_scores import naive as page_naive
    from rolecall.runtime.kernels.page_scores import triton as page_tri

    g = torch.Generator(device="cpu").manual_seed(2)
    q = (torch.randn(b, hq, d, generator=g) * 2).to(device, dtype)
    k = torch.randn(b, hkv, t, d, generator=g).to(device, dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(device, dtype)
    km = torch.ones(b, t, dtype=torch.bool)
    km[0, : t // 5] = False
    km = km.to(device)
    scale = d ** -0.5
    out, lse, scores = page_tri.decode_and_score(q, k, v, scale, page, key_mask=km, per_kv_head=per_kv,
                                                 **({"chunk": 64} if device == "cpu" else {}))
    ref_out, ref_lse = naive.sparse_decode_attention(q, k, v, None, scale=scale, key_mask=km)
    probs = page_naive.attention_probs(q, k, scale, km)
    want = page_naive.pool_pages(probs.view(b, hkv, hq // hkv, t).amax(2), page) if per_kv else \
        page_naive.page_scores(q, k, scale, page, km)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(scores, want, atol=tol * 10, rtol=tol * 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("per_kv", [False, True])
def test_decode_and_score_in_interpreter(per_kv):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_decode_and_score(2, 8, 2, 150, 16, 16, torch.float32, "cpu", per_kv)


def test_logits_kept_in_float16_in_interpreter():
    """A bfloat16 model keeps its logits in float16: the attention pass stores each logit rounded once, and the
    page scores read from them stay within float16's rounding of the float32 ones."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.page_scores import triton as page_tri
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    assert page_tri.logits_dtype(torch.bfloat16) is torch.float16 is page_tri.logits_dtype(torch.float16)
    assert page_tri.logits_dtype(torch.float32) is torch.float32
    q, k, v, _, _, _ = _case(2, 8, 2, 150, 16, 0, 16, torch.float32, "cpu", seed=4)
    q = q * 3  # logits of several units, where float16's rounding shows
    kept = {}
    for dtype in (torch.float32, torch.float16):
        kept[dtype] = torch.empty(2, 8, 150, dtype=dtype)
        tri.sparse_decode_attention(q, k, v, scale=0.25, chunk=64, logits_out=kept[dtype])
    torch.testing.assert_close(kept[torch.float16], kept[torch.float32].half(), atol=0, rtol=0)
    _, lse = naive.sparse_decode_attention(q, k, v, None, scale=0.25)
    want = page_tri.page_scores_from_logits(kept[torch.float32], lse, 16, 2, per_kv_head=True)
    got = page_tri.page_scores_from_logits(kept[torch.float16], lse, 16, 2, per_kv_head=True)
    assert not torch.equal(got, want)  # the rounding is there ...
    # ... and bounded: a logit l rounds by at most |l|·2^-11, so each probability moves by a factor within that
    bound = kept[torch.float32].abs().max().item() * 2 ** -11
    assert bound > 1e-3
    torch.testing.assert_close(got, want, atol=1e-7, rtol=bound * 1.01)


@pytest.mark.gpu
@pytest.mark.parametrize("b, hq, hkv, t, d", [(1, 8, 8, 17, 64), (3, 28, 4, 1000, 128), (2, 32, 8, 131072, 128)])
@pytest.mark.parametrize("per_kv", [False, True])
def test_decode_and_score_on_gpu(b, hq, hkv, t, d, per_kv):
    _check_decode_and_score(b, hq, hkv, t, d, 16, torch.bfloat16, "cuda", per_kv)


def _check_rope_cache(b, hq, hkv, d, norms, dtype, device, tol, ordered=False, per_row=False):
    from rolecall.runtime.kernels.rope_cache import naive as rope_naive
    from rolecall.runtime.kernels.rope_cache import triton as rope_tri

    g = torch.Generator(device="cpu").manual_seed(3)
    y = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    cos, sin = torch.randn(2, b, d, generator=g).to(device, dtype)
    qn, kn = (1 + 0.1 * torch.randn(2, d, generator=g)).to(device, dtype) if norms else (None, None)
    slot = torch.tensor(5, device=device)
    order = torch.randperm(hkv, generator=g).to(device, torch.int32) if ordered else None
    caches = {}
    for name, impl, heads in (("plain", rope_naive, None), ("naive", rope_naive, order), ("triton", rope_tri, order)):
        kc, vc = torch.zeros(2, b, hkv, 9, d, device=device, dtype=dtype)
        q = impl.rope_and_store(y, hq, hkv, cos, sin, kc, vc, slot, qn, kn, 1e-6, heads)
        caches[name] = (q.float(), kc.float(), vc.float())
    (q0, k0, v0), (q1, k1, v1) = caches["naive"], caches["triton"]
    assert torch.equal(v0, v1)  # values are copied as they are
    assert k1[:, :, 5].abs().sum() > 0 and k1[:, :, :5].abs().sum() == 0 and k1[:, :, 6:].abs().sum() == 0
    if per_row:  # each row its own slot (a sliding layer's ring): the same K/V, at that row's slot only
        rows = torch.tensor([(8 - 3 * r) % 9 for r in range(b)], device=device)
        for impl in (rope_naive, rope_tri):
            kc, vc = torch.zeros(2, b, hkv, 9, d, device=device, dtype=dtype)
            q = impl.rope_and_store(y, hq, hkv, cos, sin, kc, vc, rows, qn, kn, 1e-6, order)
            assert torch.equal(q.float(), q0 if impl is rope_naive else q1)
            for r, at in enumerate(rows.tolist()):
                k_want, v_want = (k0 if impl is rope_naive else k1)[r, :, 5], v0[r, :, 5]
                assert torch.equal(kc[r, :, at].float(), k_want) and torch.equal(vc[r, :, at].float(), v_want)
                others = [j for j in range(9) if j != at]
                assert kc[r, :, others].abs().sum() == 0 and vc[r, :, others].abs().sum() == 0
        with pytest.raises(ValueError, match="one per row"):
            rope_tri.rope_and_store(y, hq, hkv, cos, sin, kc, vc, rows[:1].repeat(b + 1), qn, kn, 1e-6, order)
    assert (q0 - q1).abs().max() < tol * q0.abs().max() and (k0 - k1).abs().max() < tol * k0.abs().max()
    if ordered:  # stored KV head j is the model's head order[j], its query heads with it
        qp, kp, vp = caches["plain"]
        heads = order.long()
        assert torch.equal(k0, kp.index_select(1, heads)) and torch.equal(v0, vp.index_select(1, heads))
        assert torch.equal(q0.unflatten(1, (hkv, -1)), qp.unflatten(1, (hkv, -1)).index_select(1, heads))
        assert not torch.equal(order.cpu(), torch.arange(hkv, dtype=torch.int32))
        with pytest.raises(ValueError, match="order must be int32"):
            rope_tri.rope_and_store(y, hq, hkv, cos, sin, kc, vc, slot, qn, kn, 1e-6, order.long())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("b, hq, hkv, d, norms, ordered", [(2, 4, 2, 16, False, False), (1, 6, 3, 24, True, False),
                                                           (3, 2, 1, 32, True, False), (2, 8, 4, 16, True, True),
                                                           (1, 6, 3, 24, False, True)])
def test_rope_cache_matches_reference_in_interpreter(b, hq, hkv, d, norms, ordered):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_rope_cache(b, hq, hkv, d, norms, torch.float32, "cpu", 1e-5, ordered, per_row=b > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("b, hq, hkv, d, norms, ordered", [(1, 28, 4, 128, False, False), (8, 32, 8, 128, True, False),
                                                           (4, 9, 3, 64, False, False), (2, 4, 1, 256, True, False),
                                                           (1, 28, 4, 128, False, True), (8, 32, 8, 128, True, True)])
def test_rope_cache_matches_reference_on_gpu(b, hq, hkv, d, norms, ordered):
    _check_rope_cache(b, hq, hkv, d, norms, torch.bfloat16, "cuda", 2e-2, ordered, per_row=b > 1)


def _check_combine(splits, device, d=16, parts=None):
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    g = torch.Generator(device="cpu").manual_seed(4)
    b, hkv, grp = 2, 3, 2
    out_p = torch.randn(b, hkv, splits, grp, d, generator=g)
    lse_p = torch.randn(b, hkv, splits, grp, generator=g) * 3
    lse_p[0, 0, : splits // 2] = float("-inf")  # empty partials (idle programs)
    lse_p[1, 2] = float("-inf")  # a row that read nothing
    out, lse = tri.combine_partials(out_p.to(device), lse_p.to(device), parts=parts)
    w = torch.softmax(lse_p, dim=2).nan_to_num(0.0)
    want = (w[..., None] * out_p).sum(2).reshape(b, hkv * grp, d)
    want_lse = torch.logsumexp(lse_p, 2).reshape(b, hkv * grp)
    assert torch.allclose(out.cpu(), want, atol=1e-5)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(want_lse))
    assert torch.allclose(lse.cpu()[~torch.isinf(want_lse)], want_lse[~torch.isinf(want_lse)], atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("splits, d, parts", [(1, 16, None), (5, 16, None), (128, 16, None), (300, 16, None),
                                              (7, 72, 4), (130, 64, 2)])  # 300: three blocks of 128, merged online
def test_combine_matches_logsumexp_in_interpreter(splits, d, parts):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_combine(splits, "cpu", d, parts)  # parts: each head's D dims merged by that many programs (72: ragged)


@pytest.mark.gpu
@pytest.mark.parametrize("splits, d", [(1, 16), (5, 16), (128, 128), (300, 128)])
def test_combine_matches_logsumexp_on_gpu(splits, d):
    _check_combine(splits, "cuda", d)


def _check_head_map_and_out(device, dtype, tol):
    """Sets kept in another head order read through ``index_rows`` give what the reordered sets give, and ``out``
    receives the result in a slice of a larger buffer, leaving the rest of it as it was."""
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    q, k, v, idx, kw, _ = _case(2, 12, 3, 300, 16, 6, 16, dtype, device, weights=True)
    rows = torch.tensor([2, 0, 1], device=device, dtype=torch.int32)
    moved = {"log_weights": kw["log_weights"].index_select(1, rows.long())}
    want, want_lse = tri.sparse_decode_attention(q, k, v, idx.index_select(1, rows.long()), scale=0.25, block_size=16,
                                                 chunk=64, **moved)
    buffer = torch.full((2, 20, 16), float("nan"), device=device)
    got, lse = tri.sparse_decode_attention(q, k, v, idx, scale=0.25, block_size=16, chunk=64, index_rows=rows,
                                           out=buffer[:, 5:17], **kw)
    assert got.data_ptr() == buffer[:, 5:17].data_ptr()
    assert torch.equal(got, want) and torch.equal(lse, want_lse)  # the same programs over the same blocks
    assert buffer[:, :5].isnan().all() and buffer[:, 17:].isnan().all()
    ref, _ = _reference(q.cpu(), k.cpu(), v.cpu(), idx.cpu().index_select(1, rows.long().cpu()),
                        {"log_weights": moved["log_weights"].cpu()}, None, 16, 0.25)
    assert (got.cpu() - ref).abs().max() < tol
    with pytest.raises(ValueError, match="index_rows must be int32"):
        tri.sparse_decode_attention(q, k, v, idx, scale=0.25, block_size=16, index_rows=rows.long())
    with pytest.raises(ValueError, match="out must be"):
        tri.sparse_decode_attention(q, k, v, idx, scale=0.25, block_size=16, out=buffer[:, :11])
    # out_heads: KV head h's four query heads go to the output's group out_heads[h], whether the programs write
    # the output themselves (one chunk a row) or the merge of their partials does (chunks of 64 of 96 tokens)
    for chunk in (64, 256):
        plain, plain_lse = tri.sparse_decode_attention(q, k, v, idx, scale=0.25, block_size=16, chunk=chunk, **kw)
        placed = torch.full((2, 12, 16), float("nan"), device=device)
        got, lse = tri.sparse_decode_attention(q, k, v, idx, scale=0.25, block_size=16, chunk=chunk, out=placed,
                                               out_heads=rows, **kw)
        assert got.data_ptr() == placed.data_ptr() and torch.equal(lse, plain_lse)  # lse in the call's order
        assert torch.equal(got.unflatten(1, (3, 4)).index_select(1, rows.long()), plain.unflatten(1, (3, 4)))
        # a call over a part of the heads (KV heads 1 and 2) writes its groups (rows[1:] = 0, 1) and no other
        part = torch.full((2, 12, 16), float("nan"), device=device)
        tri.sparse_decode_attention(q[:, 4:], k[:, 1:], v[:, 1:], idx[:, 1:], scale=0.25, block_size=16, chunk=chunk,
                                    out=part, out_heads=rows[1:], log_weights=kw["log_weights"][:, 1:])
        assert torch.equal(part[:, :8], plain[:, 4:]) and part[:, 8:].isnan().all()
    with pytest.raises(ValueError, match="out_heads must be int32"):
        tri.sparse_decode_attention(q, k, v, idx, scale=0.25, block_size=16, out_heads=rows.long())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
def test_head_map_and_out_slice_in_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_head_map_and_out("cpu", torch.float32, 1e-4)


@pytest.mark.gpu
def test_head_map_and_out_slice_on_gpu():
    _check_head_map_and_out("cuda", torch.float32, 1e-2)  # the GPU's dots round to TF32


def _check_topk_rows(device, parts):
    """``out`` and ``out_rows``: each row's ids land in the named row of ``out``, the other rows are untouched."""
    from rolecall.runtime.kernels.topk_select import triton as topk_tri

    g = torch.Generator(device="cpu").manual_seed(9)
    scores = torch.randn(2, 3, 200, generator=g).to(device)
    plain = topk_tri.topk_with_recent(scores, 16, 2, last=150, parts=parts)
    out = torch.full((2, 5, 16), -7, dtype=torch.int32, device=device)
    rows = torch.tensor([4, 0, 2, 9, 6, 7], dtype=torch.int32, device=device)  # b·5 + a head order, per row
    got = topk_tri.topk_with_recent(scores, 16, 2, last=150, parts=parts, out=out, out_rows=rows)
    assert got is out
    flat = out.view(-1, 16)
    assert torch.equal(flat[rows.long()], plain.view(-1, 16))
    untouched = torch.ones(10, dtype=torch.bool, device=device)
    untouched[rows.long()] = False
    assert (flat[untouched] == -7).all()
    with pytest.raises(ValueError, match="out and out_rows go together"):
        topk_tri.topk_with_recent(scores, 16, 2, last=150, out=out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("parts", [1, 2])
def test_topk_into_named_rows_in_interpreter(parts):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_topk_rows("cpu", parts)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [1, 2])
def test_topk_into_named_rows_on_gpu(parts):
    _check_topk_rows("cuda", parts)


def _check_topk(shape, k, recent, last, device, bits=2, parts=None):
    from rolecall.runtime.kernels.arrivals import arrival_counters
    from rolecall.runtime.kernels.topk_select import naive as topk_naive
    from rolecall.runtime.kernels.topk_select import triton as topk_tri

    g = torch.Generator(device="cpu").manual_seed(5)
    scores = torch.randn(*shape, generator=g)  # both signs: Quest bounds are often negative
    scores[..., 3] = float("-inf")  # a block with no valid token
    last_t = torch.as_tensor(last)
    want = topk_naive.topk_with_recent(scores, k, recent, last=last_t)
    on_device = scores.to(device)
    got = topk_tri.topk_with_recent(on_device, k, recent, last=last_t.to(device), bits=bits, parts=parts).cpu()
    assert got.dtype == torch.int32 and got.shape == want.shape
    assert torch.equal(got.long(), want)  # both ascending, -1 padded
    assert not arrival_counters(on_device.device, 1).any()  # the last part of each row set it back to zero


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("shape, k, recent, last", [((2, 3, 50), 8, 2, 40), ((4, 20), 30, 0, 19), ((1, 2, 9), 4, 4, 6),
                                                    ((3, 100), 100, 1, 99)])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])  # bits of the k-th key fixed per round (8: by histogram)
def test_topk_matches_reference_in_interpreter(shape, k, recent, last, bits):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_topk(shape, k, recent, last, "cpu", bits)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("shape, k, recent, last", [((2, 3, 200), 16, 2, 150), ((3, 100), 30, 0, 99),
                                                    ((1, 64), 8, 8, 63)])
@pytest.mark.parametrize("parts", [2, 4])
def test_split_topk_matches_reference_in_interpreter(shape, k, recent, last, parts):
    """A row split over programs: each part keeps its k largest, the last to finish chooses among them."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_topk(shape, k, recent, last, "cpu", 2, parts)


def test_split_parts_sizes_both_stages():
    from rolecall.runtime.kernels.topk_select import triton as topk_tri

    assert topk_tri.split_parts(8, 8192, 128, 132) == (8, 1024)  # a final row of 8 x 128 kept scores
    assert topk_tri.split_parts(8, 8192, 512, 132) == (4, 2048)
    assert topk_tri.split_parts(256, 8192, 128, 132) == (1, 8192)  # the rows alone fill the GPU
    assert topk_tri.split_parts(8, 512, 128, 132) == (1, 512)  # a part would keep half of what it reads


@pytest.mark.gpu
@pytest.mark.parametrize("shape, k, recent, last", [((8, 4, 8192), 128, 4, 8100), ((8, 8192), 64, 8, 8191),
                                                    ((1, 3, 1000), 128, 1, 999), ((2, 16384), 2048, 0, 16000),
                                                    ((8, 8192), 512, 8, 8000)])
@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.parametrize("parts", [None, 1, 4])
def test_topk_matches_reference_on_gpu(shape, k, recent, last, bits, parts):
    _check_topk(shape, k, recent, last, "cuda", bits, parts)


def _check_key_span(device, dtype, t, tol):
    """Bounds ``first[b]..last`` read exactly what the matching key mask reads, dense and over blocks."""
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    q, k, v, idx, _, fr = _case(3, 8, 2, t, 16, 4, 16, dtype, device, full=True)
    first = torch.tensor([0, 7, t // 2], device=device)
    last = torch.tensor(t - 5, device=device)
    ids = torch.arange(t, device=device)
    mask = (ids[None, :] >= first[:, None]) & (ids[None, :] <= last)
    for indices, full in ((None, None), (idx, None), (idx, fr)):
        want, want_lse = tri.sparse_decode_attention(q, k, v, indices, scale=0.25, block_size=16, key_mask=mask,
                                                     full_rows=full, chunk=64)
        got, lse = tri.sparse_decode_attention(q, k, v, indices, scale=0.25, block_size=16, key_span=(first, last),
                                               full_rows=full, chunk=64)
        ref, ref_lse = _reference(q, k, v, indices, {"key_mask": mask.cpu()} if device == "cpu" else
                                  {"key_mask": mask}, full, 16, 0.25) if indices is not None else (want, want_lse)
        assert torch.allclose(got, want, atol=tol) and torch.allclose(lse, want_lse, atol=tol)
        assert torch.allclose(got, ref.to(got.dtype), atol=tol)  # the GPU's dots round to TF32


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
def test_key_span_reads_as_the_mask_in_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_key_span("cpu", torch.float32, 200, 1e-5)


@pytest.mark.gpu
def test_key_span_reads_as_the_mask_on_gpu():
    _check_key_span("cuda", torch.float32, 5000, 1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers the kernel")
def test_topk_breaks_ties_toward_lower_ids_in_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.topk_select import triton as topk_tri

    scores = torch.tensor([[0.5, 2.0, 0.5, 0.5, -1.0, 0.5, 0.5, 3.0]])
    got = topk_tri.topk_with_recent(scores, 4, 1, last=7)  # 7 is recent; then 1 (2.0); then the lowest 0.5s
    assert got.tolist() == [[0, 1, 2, 7]]
    got = topk_tri.topk_with_recent(torch.zeros(1, 6), 3, 0, last=5)  # all equal
    assert got.tolist() == [[0, 1, 2]]
    # a row split over 4 programs of 16: ties that cross the parts still go to the lower ids
    scores = torch.zeros(1, 64)
    scores[0, [5, 40]] = 1.0
    scores[0, 10:50] = torch.where(scores[0, 10:50] > 0, 1.0, 0.5)
    got = topk_tri.topk_with_recent(scores, 6, 1, last=63, parts=4)  # 63 recent, 5 and 40, then 10, 11, 12
    assert got.tolist() == [[5, 10, 11, 12, 40, 63]]


def _check_page_bounds(b, hq, hkv, t, d, p, group, dtype, device, tol):
    from rolecall.runtime.kernels.page_bounds import naive as pb_naive
    from rolecall.runtime.kernels.page_bounds import triton as pb_tri

    g = torch.Generator(device="cpu").manual_seed(6)
    k = torch.randn(b, hkv, t, d, generator=g).to(device, dtype)
    q = torch.randn(b, hq, d, generator=g).to(device, dtype)
    keep = torch.ones(b, t, dtype=torch.bool)
    keep[0, : 2 * p + 3] = False  # left padding: two empty pages and a partial one
    kmin, kmax = pb_naive.page_minmax(k, keep.to(device), p)
    want = pb_naive.page_scores(q, kmin, kmax, 0.3, group)
    got = pb_tri.page_scores(q, kmin, kmax, 0.3, group)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    assert (got[finite] - want[finite]).abs().max() <= tol * want[finite].abs().max()
    # the new token's page, recomputed from the keys in first[b]..last, as the reference does it
    first = torch.tensor([2 * p + 3] + [0] * (b - 1), device=device)
    rows = torch.tensor([t - 1 - 7 * i for i in range(b)], device=device)  # each row's own (the scheduler's rows)
    for last in (torch.tensor(t - 1, device=device), torch.tensor(2 * p + 1, device=device), rows):
        ref = (kmin.clone(), kmax.clone())
        pb_naive.update_page(k, *ref, first, last, p)
        mine = (kmin.clone(), kmax.clone())
        pb_tri.update_page(k, *mine, first, last, p)
        assert torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1])
        # the same keys in shuffled 16-token pages of a pool, read through a block table: the same bounds
        padded = torch.nn.functional.pad(k.cpu(), (0, 0, 0, -t % 16))
        pool, _, table = _paged(padded, padded, seed=t)
        for impl in (pb_naive, pb_tri):
            paged = (kmin.clone(), kmax.clone())
            impl.update_page(pool.to(device), *paged, first, last, p, block_table=table.to(device))
            assert torch.equal(paged[0], ref[0]) and torch.equal(paged[1], ref[1]), impl


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("group", ["max", "sum"])
def test_page_bounds_match_reference_in_interpreter(group):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_page_bounds(2, 6, 2, 150, 16, 16, group, torch.float32, "cpu", 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("group", ["max", "sum"])
def test_page_bounds_match_reference_on_gpu(group):
    _check_page_bounds(3, 28, 4, 40000, 128, 16, group, torch.bfloat16, "cuda", 1e-2)


def _check_skinny_linear(m, n, k, bias, config, device, dtype, tol):
    from rolecall.runtime.kernels.skinny_linear import naive as sl_naive
    from rolecall.runtime.kernels.skinny_linear import triton as sl_tri

    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    want = sl_naive.skinny_linear(x, w, b)
    got = sl_tri.launch(x, w, b, config) if config is not None else sl_tri.skinny_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    assert (got.float() - want.float()).abs().max() <= tol


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("m, n, k, bias, dot, bn, bk", [
    (1, 70, 300, True, False, 8, 128), (1, 33, 40, False, False, 32, 64), (5, 50, 200, True, True, 32, 64),
    (16, 17, 130, False, True, 16, 128), (20, 40, 70, True, True, 16, 64), (64, 33, 90, False, True, 32, 32)])
def test_skinny_linear_matches_reference_in_interpreter(m, n, k, bias, dot, bn, bk):
    """Each kind of tile (multiply-add for one row, tl.dot over 16, 32 or 64 padded rows), ragged N and K, with and
    without bias."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.skinny_linear.naive import Config

    _check_skinny_linear(m, n, k, bias, Config(dot, bn, bk, 4, 2), "cpu", torch.float32, 1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("m, n, k, bias, split", [(1, 40, 300, True, 4), (5, 33, 500, False, 3), (20, 70, 260, True, 8),
                                                  (64, 16, 129, False, 2)])
def test_split_linear_matches_reference_in_interpreter(m, n, k, bias, split):
    """K split over programs whose last sums the partials: ragged N and K, parts past K, 1 to 64 rows; a second
    launch reuses the arrival counters the first left at zero."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.skinny_linear.naive import Config

    for _ in range(2):
        _check_skinny_linear(m, n, k, bias, Config(True, 16, 32, 4, 2, split), "cpu", torch.float32, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 64])
@pytest.mark.parametrize("n, k, split", [(1536, 8960, 4), (3584, 18944, 2), (1000, 4100, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_linear_matches_reference_on_gpu(m, n, k, split, dtype):
    from rolecall.runtime.kernels.skinny_linear.naive import Config

    bk = 128 if dtype == torch.bfloat16 else 64
    for _ in range(2):
        _check_skinny_linear(m, n, k, False, Config(True, 32, bk, 4, 3, split), "cuda", dtype,
                             0.02 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, bias", [(1, 4608, 3584, True), (8, 3584, 3584, False), (1, 37888, 3584, False),
                                           (8, 3584, 18944, False), (1, 2048, 1536, True), (16, 1536, 1536, False),
                                           (8, 37888, 3584, False), (3, 17920, 1536, True), (1, 1536, 8960, False),
                                           (16, 1536, 8960, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_linear_matches_reference_on_gpu(m, n, k, bias, dtype):
    # the custom op with the measured tiles (float32: tiles that fit shared memory, IEEE dots); bf16 output:
    # one rounding of a float32 sum
    _check_skinny_linear(m, n, k, bias, None, "cuda", dtype, 0.02 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, bias", [(64, 2048, 1536, True), (48, 1536, 1536, False), (33, 960, 576, True),
                                           (64, 1536, 8960, False), (40, 576, 2304, True)])
def test_small_projection_of_many_rows_matches_reference_on_gpu(m, n, k, bias):
    """The 1.5B's q/k/v, o and down (and SmolLM2's q/k/v, and a narrow odd shape) at 33 to 64 rows take the kernel in
    bf16 (float32 takes cuBLAS there): the op with its measured tile against the reference."""
    _check_skinny_linear(m, n, k, bias, None, "cuda", torch.bfloat16, 0.02)


def _check_gated(rows, n, k, kind, config, device, dtype, tol):
    """The gated kernel against the reference: ``act(gate) · up`` of the two rounded halves."""
    from rolecall.runtime.kernels.skinny_linear import naive as ref
    from rolecall.runtime.kernels.skinny_linear import triton as tri

    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    w = (torch.randn(2 * n, k, generator=g) * 0.2).to(device, dtype)
    want = ref.gated_linear(x.cpu().float(), w.cpu().float(), kind)
    if config is None:
        from rolecall.runtime.kernels import graphed
        from rolecall.runtime.kernels.skinny_linear import gated_linear

        with graphed():  # as the captured decode step calls it
            got = gated_linear(x, w, kind)
    else:
        got = tri.launch(x, w, None, config, gated=kind)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert (got.cpu().float() - want).abs().max() < tol * (1 + want.abs().max())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("rows, n, k, kind, dot", [(1, 40, 300, "silu", False), (5, 70, 130, "gelu_pytorch_tanh", True),
                                                   (16, 17, 64, "silu", True), (40, 33, 80, "silu", True)])
def test_gated_linear_matches_reference_in_interpreter(rows, n, k, kind, dot):
    """Both tile kinds, ragged N and K: each program's features of the gate and of the up half, activation last."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.skinny_linear.naive import Config

    _check_gated(rows, n, k, kind, Config(dot, 32, 64, 4, 2), "cpu", torch.float32, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n, k", [(1, 18944, 3584), (8, 18944, 3584), (3, 8960, 1536), (16, 8960, 1536),
                                        (64, 8960, 1536), (33, 18944, 3584)])
@pytest.mark.parametrize("kind", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_linear_matches_reference_on_gpu(rows, n, k, kind, dtype):
    _check_gated(rows, n, k, kind, None, "cuda", dtype, 0.02 if dtype == torch.bfloat16 else 1e-4)


def test_gated_linear_off_the_kernel_is_the_projection_then_the_activation():
    from rolecall.runtime.kernels.skinny_linear import gated_linear

    x, w = torch.randn(3, 8), torch.randn(10, 8)
    gate, up = torch.nn.functional.linear(x, w).chunk(2, -1)
    assert torch.equal(gated_linear(x, w, "gelu"), torch.nn.functional.gelu(gate) * up)  # the CPU: no kernel


def test_skinny_linear_rule_keeps_cublas_where_it_measured_faster():
    from rolecall.runtime.kernels.skinny_linear import kernel_config, linear
    from rolecall.runtime.kernels.skinny_linear.naive import Config

    assert kernel_config(65, 3584, 3584) is None  # more rows than the kernel pads to
    # from 17 rows, only the gated MLP and only from 33 rows
    assert kernel_config(64, 17920, 1536, gated=True) == Config(True, 64, 64, 4, 4)
    assert kernel_config(64, 17920, 1536) is None and kernel_config(32, 17920, 1536, gated=True) is None
    assert kernel_config(64, 2048, 1536) == Config(True, 16, 256, 4, 4)  # 1.5B's q/k/v at DELTA's 64 rows ...
    assert kernel_config(32, 2048, 1536) is None and kernel_config(64, 3584, 3584) is None  # ... from 33, small only
    assert kernel_config(64, 2048, 1536, itemsize=4) is None and kernel_config(64, 17920, 1536, 4, gated=True) is None
    assert kernel_config(64, 28672, 4096, gated=True) is None
    assert kernel_config(8, 1536, 8960) == Config(True, 32, 128, 4, 4, 8)  # 1.5B's down: K split over 8 programs
    assert kernel_config(64, 1536, 8960) == Config(True, 32, 256, 4, 4, 2)  # ... over 2 at DELTA's 64 rows ...
    assert kernel_config(32, 1536, 8960) is None and kernel_config(64, 3584, 18944) is None  # ... not 32, not 7B's
    assert kernel_config(1, 3584, 18944).dot and not kernel_config(1, 3584, 3584).dot
    assert kernel_config(8, 37888, 3584) == Config(True, 64, 128, 4, 3)  # 7B's gate/up at 8 rows: measured faster
    assert kernel_config(8, 37888, 3584, itemsize=4).block_k == 64  # float32: half the columns a tile
    assert kernel_config(8, 28672, 4096) is None and kernel_config(8, 4608, 3584) is None  # Llama-3-8B, q/k/v
    assert kernel_config(8, 2048, 1536) == Config(True, 32, 512, 4, 4)  # 1.5B's q/k/v: small, measured faster
    assert kernel_config(8, 3072, 1536) is None  # wider than 2 K
    x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))  # the CPU takes F.linear


SHARED_LIMITS = {80: 166912, 89: 101376, 90: 232448}  # bytes a program may take: A100, sm86/sm89 (L40S, RTX 4090), H100


@pytest.mark.parametrize("rows, n, k, itemsize, gated, fits_sm89", [
    (8, 2048, 1536, 2, False, False),  # 1.5B's q/k/v at 8 rows: 16 × 512 and 32 × 512 tiles of bf16, four stages
    (16, 3584, 3584, 2, False, False),  # 7B's o at 16 rows
    (1, 3584, 18944, 2, False, False),  # 7B's down at one row (long and narrow: tl.dot)
    (8, 3584, 3584, 4, False, False),  # float32
    (1, 3584, 3584, 2, False, True),  # one row, no tl.dot
    (8, 1536, 8960, 2, False, True),  # the split kernel (1.5B's down)
    (8, 37888, 3584, 2, True, True),  # 7B's gated gate/up at 8 rows
    (64, 17920, 1536, 2, True, True),  # the gated kernel at DELTA's 64 rows
    (64, 1536, 8960, 2, False, False),  # the split kernel there (1.5B's down)
])
def test_projection_tiles_only_where_they_fit(rows, n, k, itemsize, gated, fits_sm89):
    """Where a projection's tiles would take more shared memory than the GPU gives a program, Triton fails to launch
    them (OutOfResources): the engine takes cuBLAS there. The bound the rule uses is checked against the compiler:
    each case compiled for sm80, sm89 and sm90 (outside the interpreter, in a subprocess) takes at most
    ``shared_bytes``, and the rule never picks a tile a GPU cannot hold."""
    from rolecall.runtime.kernels.skinny_linear.naive import kernel_config, shared_bytes

    config = kernel_config(rows, n, k, itemsize, gated)
    assert config is not None
    assert kernel_config(rows, n, k, itemsize, gated, shared=SHARED_LIMITS[90]) == config  # the H100 keeps its tiles
    assert (kernel_config(rows, n, k, itemsize, gated, shared=SHARED_LIMITS[89]) == config) == fits_sm89
    cases = [[rows, n, k, itemsize, gated, cc] for cc in SHARED_LIMITS]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "tests.runtime.compiled_shared"], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for (*_, cc), sizes in zip(cases, json.loads(done.stdout)):
        assert sizes and max(sizes) <= shared_bytes(config, rows, itemsize, gated), (cc, sizes)
        if kernel_config(rows, n, k, itemsize, gated, shared=SHARED_LIMITS[cc]) is not None:
            assert max(sizes) <= SHARED_LIMITS[cc], (cc, sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("b, hkv, groups, n, width, k", [(8, 4, 7, 8192, 512, 128), (3, 8, 4, 2049, 1000, 64),
                                                         (1, 2, 1, 40, 17, 9)])
def test_refine_candidates_on_gpu(b, hkv, groups, n, width, k):
    """bf16 metadata at the benchmark's shape (8 × 4 KV heads, 8K pages, 4·128 candidates) and odd ones: each
    head keeps its recent pages and a top-k of the reference's scores (up to bf16 ties), in ascending order."""
    from rolecall.runtime.kernels.page_bounds import naive as pb_naive
    from rolecall.runtime.kernels.page_bounds import triton as pb_tri
    from rolecall.runtime.kernels.topk_select import triton as topk_tri

    g = torch.Generator(device="cpu").manual_seed(5)
    kmin = torch.randn(b, hkv, n, 128, generator=g)
    kmax = (kmin + torch.rand(b, hkv, n, 128, generator=g)).cuda().bfloat16()
    kmin = kmin.cuda().bfloat16()
    query = torch.randn(b, hkv * groups, 128, generator=g).cuda().bfloat16()
    last = n - 1 - torch.arange(b, device="cuda")  # ragged: each row's new page
    candidates = topk_tri.topk_with_recent(torch.rand(b, hkv, n, device="cuda"), width, 8, last=last[:, None])
    fast = pb_tri.refine_candidates(query, kmin, kmax, candidates, 0.088, k, 8)
    for parts in (1, 3):  # fewer programs scoring each head's candidates: the same scores, so the same choice
        assert torch.equal(pb_tri.refine_candidates(query, kmin, kmax, candidates, 0.088, k, 8, parts=parts), fast)
    scores = pb_naive.page_scores(query, kmin, kmax, 0.088, pages=candidates)  # [B, Hkv, C]
    ref = pb_naive.refine_candidates(query, kmin, kmax, candidates, 0.088, k, 8)
    assert fast.shape == ref.shape == (b, hkv, min(k, width))
    for row in range(b):
        for h in range(hkv):
            got = [u for u in fast[row, h].tolist() if u >= 0]
            assert got == sorted(got) and len(got) == len([u for u in ref[row, h].tolist() if u >= 0])
            cand = candidates[row, h].tolist()
            score = {u: float(x) for u, x in zip(cand, scores[row, h].tolist()) if u >= 0}
            recent = {u for u in score if u > int(last[row]) - 8}
            assert recent <= set(got)
            kept, left = set(got) - recent, set(score) - set(got)
            if kept and left:
                assert min(score[u] for u in kept) >= max(score[u] for u in left) - 0.02 * (1 + abs(max(score.values())))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers the engine's step")
def test_refine_candidates_kernel_equals_the_reference_in_interpreter():
    """The fused second stage (bounds of the candidates, then the top-k rule, in one program per KV head) picks
    the reference's pages: a Δ-layer's ascending choice shared by the heads or per head, -1 padded rows, and
    the same candidates shuffled (the rule is by page id, not by place); page_scores over a candidate list
    equals gathering."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.arrivals import arrival_counters
    from rolecall.runtime.kernels.page_bounds import naive as pb_naive
    from rolecall.runtime.kernels.page_bounds import triton as pb_tri
    from rolecall.runtime.kernels.topk_select import triton as topk_tri

    g = torch.Generator().manual_seed(3)
    b, hkv, groups, d, n = 2, 2, 3, 16, 40
    kmin = torch.randn(b, hkv, n, d, generator=g)
    kmax = kmin + torch.rand(b, hkv, n, d, generator=g)
    kmin[1, :, :2], kmax[1, :, :2] = math.inf, -math.inf  # empty pages (left padding)
    query = torch.randn(b, hkv * groups, d, generator=g)
    for last, width, per_head in ((39, 12, False), (25, 12, True), (6, 12, False), (39, 150, True)):
        pooled = torch.rand(b, hkv if per_head else 1, n, generator=g)
        candidates = topk_tri.topk_with_recent(pooled, width, 3, last=last).expand(b, hkv, -1)  # -1 past last + 1
        got = pb_tri.page_scores(query, kmin, kmax, 0.25, pages=candidates)
        want = pb_naive.page_scores(query, kmin, kmax, 0.25, pages=candidates)
        assert torch.allclose(got, want, atol=1e-4) and torch.equal(got.isinf(), (candidates < 0) | want.isinf())
        ref = pb_naive.refine_candidates(query, kmin, kmax, candidates, 0.25, 5, 2)
        fast = pb_tri.refine_candidates(query, kmin, kmax, candidates.contiguous(), 0.25, 5, 2)
        assert fast.dtype == torch.int32 and torch.equal(fast.long(), ref.long()), (last, fast, ref)
        assert (ref[..., -1] >= 0).all() and {last - 1, last} <= set(ref[0, 0].tolist())
        shuffled = candidates.gather(-1, torch.randperm(candidates.shape[-1], generator=g).expand_as(candidates))
        fast = pb_tri.refine_candidates(query, kmin, kmax, shuffled.contiguous(), 0.25, 5, 2)
        def chosen(pages):
            return [sorted(u for u in row if u >= 0) for row in pages.reshape(-1, pages.shape[-1]).tolist()]

        assert chosen(fast) == chosen(ref)
        for parts in (1, 2):  # the candidates scored by fewer programs, each looping over its share
            fast = pb_tri.refine_candidates(query, kmin, kmax, candidates.contiguous(), 0.25, 5, 2, parts=parts)
            assert torch.equal(fast.long(), ref.long()), (parts, fast, ref)
    # the last program of each row set its arrival counter back to zero, ready for the next launch
    assert not arrival_counters(query.device, b * hkv).any()
    # the new token's page updated in the same launch (recent pages ≥ 1), or before it (none): the metadata and
    # the choice equal the reference's update, then refinement
    p = 4
    key = torch.randn(b, hkv, n * p, d, generator=g)
    first, last = torch.tensor([0, 9]), torch.tensor(n * p - 3)
    candidates = topk_tri.topk_with_recent(torch.rand(b, 1, n, generator=g), 12, 3, last=n - 1).expand(b, hkv, -1)
    for recent in (2, 0):
        ref_meta, meta = (kmin.clone(), kmax.clone()), (kmin.clone(), kmax.clone())
        ref = pb_naive.refine_candidates(query, *ref_meta, candidates, 0.25, 5, recent, new_page=(key, first, last, p))
        fast = pb_tri.refine_candidates(query, *meta, candidates.contiguous(), 0.25, 5, recent,
                                        new_page=(key, first, last, p))
        assert torch.equal(meta[0], ref_meta[0]) and torch.equal(meta[1], ref_meta[1])
        assert not torch.equal(meta[0], kmin)  # the page of slot `last` changed
        assert torch.equal(fast.long(), ref.long()), (recent, fast, ref)
        # the keys in shuffled pages of a pool, through a block table: the same update and choice
        pool, _, table = _paged(torch.nn.functional.pad(key, (0, 0, 0, -key.shape[2] % 16)),
                                torch.nn.functional.pad(key, (0, 0, 0, -key.shape[2] % 16)), seed=recent)
        for impl in (pb_naive, pb_tri):
            paged = (kmin.clone(), kmax.clone())
            got = impl.refine_candidates(query, *paged, candidates.contiguous(), 0.25, 5, recent,
                                         new_page=(pool, first, last, p, table))
            assert torch.equal(paged[0], ref_meta[0]) and torch.equal(got.long(), ref.long()), (impl, recent)


@pytest.mark.gpu
def test_arrival_counters_are_per_stream_on_gpu():
    """Kernels on two streams may run at once: each stream counts in a buffer of its own."""
    from rolecall.runtime.kernels import arrivals

    device = torch.device("cuda")
    main = arrivals.arrival_counters(device, 8)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        beside = arrivals.arrival_counters(device, 8)
        assert arrivals.arrival_counters(device, 8) is beside
    assert beside is not main and beside.data_ptr() != main.data_ptr()
    assert arrivals.arrival_counters(device, 8) is main


def test_arrival_counters_grow_and_keep_what_graphs_hold():
    """A launch with more rows gets a larger zeroed buffer; the outgrown one stays allocated (a captured graph
    may still launch on it) and later calls reuse the larger one."""
    from rolecall.runtime.kernels import arrivals

    device = torch.device("cpu")
    small = arrivals.arrival_counters(device, 8)
    assert small.numel() >= 8 and not small.any()
    big = arrivals.arrival_counters(device, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any()
    assert any(t is small for t in arrivals._OUTGROWN)
    assert arrivals.arrival_counters(device, 8) is big


def _check_add_rms_norm(device, dtype, n, with_add_norm, atol):
    from rolecall.runtime.kernels.add_rms_norm import naive as an_naive
    from rolecall.runtime.kernels.add_rms_norm import triton as an_tri

    g = torch.Generator(device="cpu").manual_seed(n)
    x, o = (torch.randn(5, n, generator=g) * 3).to(device, dtype), torch.randn(5, n, generator=g).to(device, dtype)
    w, ow = (torch.rand(2, n, generator=g) + 0.5).to(device, dtype)
    ow = ow if with_add_norm else None
    got_x, got_h = an_tri.add_rms_norm(x, o, w, 1e-6, ow)
    want_x, want_h = an_naive.add_rms_norm(x, o, w, 1e-6, ow)
    assert got_x.dtype == got_h.dtype == dtype
    torch.testing.assert_close(got_x, want_x, atol=atol, rtol=0)
    torch.testing.assert_close(got_h, want_h, atol=atol, rtol=atol)
    # the sum is rounded before it is normed: the norm of the returned sum, not of an unrounded one
    torch.testing.assert_close(got_h, an_naive.rms_norm(got_x, w, 1e-6), atol=atol, rtol=atol)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
@pytest.mark.parametrize("n,with_add_norm", [(96, False), (100, True), (1536, False)])
def test_add_rms_norm_matches_reference_in_interpreter(n, with_add_norm):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    _check_add_rms_norm("cpu", torch.float32, n, with_add_norm, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n,with_add_norm", [(1536, False), (3584, False), (640, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_reference_on_gpu(n, with_add_norm, dtype):
    _check_add_rms_norm("cuda", dtype, n, with_add_norm, 1e-5 if dtype == torch.float32 else 0.04)


def traced_call(fn, *args):
    """``fn(*args)`` through torch.compile (one full graph) and the functions its graph calls, in order."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)(*args), targets


def test_add_rms_norm_takes_its_kernel_only_where_it_is_compiled_or_graphed(monkeypatch):
    """Eager calls (the prefill) get the reference, bit for bit; a traced call (the compiled decode step) is the
    kernel's custom op, and a call inside ``graphed()`` (a step captured without torch.compile) its plain launch;
    both give the reference's values within float32 rounding."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    import operator

    import rolecall.runtime.kernels.add_rms_norm as an
    from rolecall.runtime.kernels import graphed
    from rolecall.runtime.kernels.add_rms_norm import naive as an_naive
    from rolecall.runtime.kernels.add_rms_norm import triton as an_tri

    monkeypatch.setattr(an, "use_triton", lambda t: True)  # the CPU tensors below stand for CUDA ones
    g = torch.Generator().manual_seed(0)
    x, o = torch.randn(2, 4, 64, generator=g).unbind(0)
    w = torch.rand(64, generator=g) + 0.5
    want = an_naive.add_rms_norm(x, o, w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(an.add_rms_norm(x, o, w, 1e-6), want))
    traced, targets = traced_call(lambda a, b, c: an.add_rms_norm(a, b, c, 1e-6), x, o, w)
    assert torch.ops.rolecall.add_rms_norm in targets
    assert all(t is torch.ops.rolecall.add_rms_norm or t is operator.getitem or "view" in str(t) or
               "reshape" in str(t) or "contiguous" in str(t) for t in targets), targets
    with graphed():
        launched = an.add_rms_norm(x, o, w, 1e-6)
    plain = an_tri.add_norm_rows(x.reshape(4, 64), o.reshape(4, 64), w, 1e-6)
    for got, ref, kernel, direct in zip(traced, want, launched, plain):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(kernel, got) and torch.equal(kernel.reshape(4, 64), direct)


def test_kernel_call_is_the_op_when_traced_the_plain_launch_when_graphed_and_none_when_eager():
    """``kernel_call``: the custom op inside torch.compile, the function behind it inside ``graphed()`` (nested
    too, and undone on exit, also when the body raises), and None for an eager call, which then runs the
    reference."""
    import operator

    from rolecall.runtime.kernels import graphed, kernel_call
    from rolecall.runtime.kernels.skinny_linear import triton as sl_tri

    assert kernel_call("skinny_linear", sl_tri.linear_rows) is None
    with graphed():
        assert kernel_call("skinny_linear", sl_tri.linear_rows) is sl_tri.linear_rows
        with graphed():
            assert kernel_call("skinny_gated", sl_tri.gated_rows) is sl_tri.gated_rows
        assert kernel_call("skinny_gated", sl_tri.gated_rows) is sl_tri.gated_rows
    with pytest.raises(KeyError), graphed():
        raise KeyError("inside")
    assert kernel_call("skinny_gated", sl_tri.gated_rows) is None
    probe = []

    def call(x):
        probe.append(kernel_call("skinny_linear", sl_tri.linear_rows))
        return x + 1

    _, targets = traced_call(call, torch.zeros(2))
    assert probe == [torch.ops.rolecall.skinny_linear] and operator.add in targets


def test_projections_take_their_kernels_only_where_they_are_compiled_or_graphed(monkeypatch):
    """``linear``/``gated_linear`` on a kernel shape: an eager call is cuBLAS's ``F.linear`` bit for bit (a
    prefill's launch through Triton costs the host several times more), a graphed call the kernel's plain launch,
    a traced call its custom op; the kernel's two forms give the same bits."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    import operator

    import rolecall.runtime.kernels.skinny_linear as sl
    from rolecall.runtime.kernels import graphed
    from rolecall.runtime.kernels.skinny_linear import triton as sl_tri

    monkeypatch.setattr(sl, "use_triton", lambda t: True)  # the CPU tensors below stand for CUDA ones
    launched = []
    kernel = sl_tri._skinny_linear

    class Spy:  # records each launch of the kernel, then launches it
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(sl_tri, "_skinny_linear", Spy())
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 576, generator=g), torch.randn(576, 576, generator=g) / 24
    assert sl.kernel_config(2, 576, 576, 4) is not None  # a shape the kernel takes at two rows
    eager = sl.linear(x, w)
    assert torch.equal(eager, torch.nn.functional.linear(x, w)) and not launched
    with graphed():
        plain = sl.linear(x, w)
    assert len(launched) == 1
    traced, targets = traced_call(lambda a, b: sl.linear(a, b), x, w)
    assert targets[0] is torch.ops.rolecall.skinny_linear and all(t is operator.getitem or "view" in str(t)
                                                                  for t in targets[1:]), targets
    assert torch.equal(traced, plain) and len(launched) == 2  # the compiled graph's op launched the same kernel
    torch.testing.assert_close(plain, x @ w.T, atol=1e-4, rtol=1e-4)
    wg = torch.randn(2 * 96, 576, generator=g) / 24
    gate, up = torch.nn.functional.linear(x, wg).chunk(2, -1)
    assert torch.equal(sl.gated_linear(x, wg, "silu"), torch.nn.functional.silu(gate) * up)
    with graphed():
        torch.testing.assert_close(sl.gated_linear(x, wg, "silu"), torch.nn.functional.silu(gate) * up,
                                   atol=1e-4, rtol=1e-4)
    assert len(launched) == 2 + (sl.kernel_config(2, 192, 576, 4, gated=True) is not None)


def test_naive_kernels_switch_sends_every_dispatching_call_to_the_references(monkeypatch):
    """``ROLECALL_KERNELS=naive`` is read by the one function every kernel wrapper asks (the projections' and the
    add-and-norm's too), so it forces the references everywhere."""
    import types

    from rolecall.runtime.kernels import use_triton

    cuda_like = types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("ROLECALL_KERNELS", raising=False)
    assert use_triton(cuda_like) and not use_triton(torch.empty(1))
    monkeypatch.setenv("ROLECALL_KERNELS", "naive")
    assert not use_triton(cuda_like)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_naive_kernels_switch_runs_the_references_on_gpu(monkeypatch):
    from rolecall.runtime.kernels import graphed
    from rolecall.runtime.kernels.add_rms_norm import add_rms_norm
    from rolecall.runtime.kernels.add_rms_norm import triton as an_tri
    from rolecall.runtime.kernels.skinny_linear import linear
    from rolecall.runtime.kernels.skinny_linear import triton as sl_tri

    launched = []

    class Spy:  # records each launch of the wrapped kernel, then launches it
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(an_tri, "_add_rms_norm", Spy("add_rms_norm", an_tri._add_rms_norm))
    monkeypatch.setattr(sl_tri, "_skinny_linear", Spy("linear", sl_tri._skinny_linear))
    x, o = torch.randn(2, 3, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(896, 896, device="cuda", dtype=torch.bfloat16)  # a shape the kernel takes at 3 rows

    def compiled_norm():  # the add-and-norm's kernel runs where torch.compile traces it (the decode step)
        torch._dynamo.reset()
        return torch.compile(lambda a, b, c: add_rms_norm(a, b, c, 1e-6), fullgraph=True)(x, o, w)

    compiled_norm()
    linear(x, weight)  # eager: cuBLAS
    with graphed():  # as the captured decode step calls it
        linear(x, weight)
    assert launched == ["add_rms_norm", "linear"]
    monkeypatch.setenv("ROLECALL_KERNELS", "naive")
    compiled_norm()
    with graphed():
        linear(x, weight)
    assert launched == ["add_rms_norm", "linear"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test covers this")
def test_one_split_writes_the_output_itself_in_interpreter():
    """A call whose rows each fit one program writes its output and log-sum-exp directly (no merge launch), into
    a strided ``out`` view too, and matches the split call and the reference."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    q, k, v, idx, kw, _ = _case(2, 8, 2, 300, 32, 5, 16, torch.float32, "cpu")
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = _reference(q, k, v, idx, kw, None, 16, scale)
    split_out, split_lse = tri.sparse_decode_attention(q, k, v, idx, scale=scale, block_size=16, chunk=64)
    big = torch.full((2, 11, 32), 7.0)
    out, lse = tri.sparse_decode_attention(q, k, v, idx, scale=scale, block_size=16, chunk=128, out=big[:, 2:10])
    assert out.data_ptr() == big[:, 2:10].data_ptr()
    assert torch.equal(big[:, :2], torch.full((2, 2, 32), 7.0)) and torch.equal(big[:, 10:], torch.full((2, 1, 32), 7.0))
    for got, want, split in ((out, ref_out, split_out), (lse, ref_lse, split_lse)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, split, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_row", [False, True])
def test_page_scores_from_logits_read_nothing_past_the_last_slot_in_interpreter(per_row):
    """With ``last`` (one slot for all rows, or each row's), the logits past it are not read: NaN there changes
    nothing, and the scores are those of the logits with every later slot at -inf (pages past it score 0)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.page_scores import triton as page_tri

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 200, generator=g)
    lse = logits.logsumexp(-1)
    last = torch.tensor([37, 150, 199]) if per_row else torch.tensor(120)
    slots = torch.arange(200)
    past = slots[None, :] > (last[:, None] if per_row else last)  # [B or 1, T]
    masked = logits.masked_fill(past[:, None, :], float("-inf"))
    garbage = logits.masked_fill(past[:, None, :], float("nan"))
    want = page_tri.page_scores_from_logits(masked, lse, 16, 2, per_kv_head=True)
    got = page_tri.page_scores_from_logits(garbage, lse, 16, 2, per_kv_head=True, last=last)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert float(got[0, :, 3:].abs().sum() if per_row else got[:, :, 8:].abs().sum()) == 0  # pages past last: 0


def _paged(k: torch.Tensor, v: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A contiguous cache ``[B, Hkv, T, D]`` (T a whole number of 16-token pages) as a pool of pages in shuffled order
    (page 0 the null page, NaN, which no read may touch) and its ``[B, T / 16]`` block table."""
    b, hkv, t, d = k.shape
    w = t // 16
    order = torch.randperm(b * w, generator=torch.Generator().manual_seed(seed)) + 1
    table = order.view(b, w).to(torch.int32)
    pools = []
    for cache in (k, v):
        pool = torch.full((b * w + 1, hkv, 16, d), float("nan"), dtype=cache.dtype)
        pool[table.reshape(-1).long()] = cache.view(b, hkv, w, 16, d).permute(0, 2, 1, 3, 4).reshape(b * w, hkv, 16, d)
        pools.append(pool)
    return pools[0], pools[1], table


PAGED_CASES = [
    # b, hq, hkv, t, d, n, bs, extras: dense over ragged rows, pages with full rows and log weights, single tokens
    (3, 4, 2, 80, 16, 0, 16, {}),
    (2, 8, 2, 96, 16, 3, 16, {"full": True, "weights": True}),
    (2, 4, 4, 64, 16, 9, 1, {"weights": True}),
]


@pytest.mark.parametrize("b, hq, hkv, t, d, n, bs, extra", PAGED_CASES)
def test_a_paged_cache_reads_as_the_contiguous_one(b, hq, hkv, t, d, n, bs, extra):
    """The kernel reading a pool through block tables (pages shuffled, the null page NaN) gives what it gives over
    the contiguous cache holding the same tokens, and the reference's answer: dense rows of their own lengths (a key
    span ending mid-page), sets of pages mixed with full rows, sets of single tokens; and the logits a selection
    layer keeps. On the GPU, or on the CPU in Triton's interpreter."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 before importing triton to run kernels on the CPU")
    from rolecall.runtime.kernels.page_scores import triton as scores
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    q, k, v, idx, kw, fr = _case(b, hq, hkv, t, d, max(n, 1), bs, torch.float32, "cpu", **extra)
    kp, vp, table = _paged(k, v, seed=t)
    q, k, v, idx, kp, vp, table = (x.to(device) for x in (q, k, v, idx, kp, vp, table))
    kw = {key: value.to(device) for key, value in kw.items()}
    fr = fr.to(device) if fr is not None else None
    scale = d ** -0.5
    if n == 0:  # dense, each row up to its own last slot (one mid-page)
        idx, first, last = None, torch.zeros(b, dtype=torch.long, device=device), torch.tensor([t - 1, 16, 40])[:b]
        last = last.to(device)
        kw = {"key_span": (first, last)}
        held = torch.arange(t, device=device)[None, :] <= last[:, None]
        ref = naive.sparse_decode_attention(q, k, v, scale=scale, key_mask=held)
    else:
        ref = _reference(q, k, v, idx, kw, fr, bs, scale)
    flat = tri.sparse_decode_attention(q, k, v, idx, scale=scale, block_size=bs, full_rows=fr, chunk=32, **kw)
    paged = tri.sparse_decode_attention(q, kp, vp, idx, scale=scale, block_size=bs, full_rows=fr, chunk=32,
                                        block_table=table, **kw)
    tol = 1e-4 if device == "cpu" else 5e-3  # the GPU's float32 dots round as TF32
    for got in (flat, paged):
        torch.testing.assert_close(got[0], ref[0], atol=tol, rtol=tol)
        torch.testing.assert_close(got[1], ref[1], atol=tol, rtol=tol)
    torch.testing.assert_close(paged[0], flat[0], atol=1e-6, rtol=1e-6)  # the same tiles in the same order
    if n == 0:  # a selection layer's kept logits, the same through the pages
        _, _, want = scores.decode_keeping_logits(q, k, v, scale, chunk=32, **kw)
        _, _, got = scores.decode_keeping_logits(q, kp, vp, scale, chunk=32, block_table=table, **kw)
        assert got.shape == want.shape == (b, hq, t)
        read = held[:, None, :].expand(b, hq, t)  # past a row's last slot nothing is written
        torch.testing.assert_close(got[read], want[read], atol=1e-6, rtol=1e-6)


def test_a_block_table_of_another_batch_is_refused():
    from rolecall.runtime.kernels.sparse_attention import triton as tri

    q, k, v, _, _, _ = _case(2, 4, 2, 32, 16, 1, 16, torch.float32, "cpu")
    kp, vp, table = _paged(k, v, seed=1)
    with pytest.raises(ValueError, match=r"block_table must be int32 \[B, W\] with B = 3"):
        tri.sparse_decode_attention(torch.cat([q, q[:1]]), kp, vp, scale=0.25, block_table=table)
