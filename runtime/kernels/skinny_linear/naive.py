"""Reference of :mod:`rolecall.runtime.kernels.skinny_linear`, and the rule that picks the GPU kernel's tiles."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

TILE_ROWS = 16  # the kernel pads the rows to a power of two from one 16-row tensor-core tile ...
MAX_ROWS = 64  # ... up to this many (the gated kernel at a large decode batch, such as DELTA's 64 rows)
GATED = ("silu", "gelu_pytorch_tanh")  # activations the kernel applies itself to a gated projection


class Config(NamedTuple):
    dot: bool  # rows through tl.dot (padded to 16, 32 or 64) instead of a float32 multiply-add
    block_n: int  # output features per program
    block_k: int  # weight columns per tile
    warps: int
    stages: int
    split: int = 1  # programs splitting K per feature tile, the last to finish summing their partials


def shared_bytes(config: Config, rows: int, itemsize: int, gated: bool = False) -> int:
    """Shared memory the kernel may take with ``config`` at ``rows`` rows, at most: the pipeline's buffers of the row
    tile (padded to 16, 32 or 64 rows) and the weight tile (both halves' features for ``gated``), one fewer than
    ``stages`` below 64 rows (on sm90 a 64-row tile keeps all ``stages``), and room for the result's layout change.
    Compiled for sm80, sm89 and sm90 (Triton 3.9; 2 to 64 rows, 16 to 64 features of 64 to 512 columns, 2 to 4
    stages, 2- and 4-byte dtypes, plain, gated and split; 1,296 cases) it bounded every size; 16 rows × 32 features
    × 512 columns of bf16 in four stages, the tile of 2 to 16 rows, took 147,456 bytes on each."""
    m_pad = max(TILE_ROWS, 1 << (rows - 1).bit_length())
    features = 2 * max(TILE_ROWS, config.block_n // 2) if gated else config.block_n
    buffers = config.stages if m_pad >= 64 else config.stages - 1
    return buffers * (m_pad + features) * config.block_k * itemsize + m_pad * features * 4


def kernel_config(rows: int, n: int, k: int, itemsize: int = 2, gated: bool = False,
                  shared: int | None = None) -> Config | None:
    """The Triton kernel's tiles for ``rows × [N, K]`` (``gated``: the gated gate/up kernel), or None where cuBLAS
    measured as fast or faster, or where the tiles may not fit ``shared`` bytes of shared memory a program (the
    GPU's limit, :func:`rolecall.runtime.kernels.max_shared`; None: no limit: Triton would fail to launch them). The tiles
    were measured on the H100 and H200; on GPUs of 101,376 bytes a program (sm86, sm89) the ``tl.dot`` tiles of 2 to
    16 rows (and the one-row tile of a long narrow projection) do not fit and cuBLAS runs, while the gated kernel of
    33 to 64 rows and the other one-row tiles do.

    From ``benchmarks/kernels.py --linear`` on an H200 (bf16, DS-Qwen-7B and 1.5B projections, weights streamed
    from HBM as in a decode step). One row: a float32 multiply-add over 512-column tiles, 8 features a program
    (32 over 256 columns for a wide projection such as gate/up, N ≥ 8 K) — 7B: q/k/v 10.5 µs against cuBLAS's
    11.7, o 8.8 / 11.6, gate/up 64.1 / 70.9. Several rows: ``tl.dot`` over 32 features × 512 columns, taken for
    N ≤ K only (7B o 9.4 / 11.5 µs at 8 rows, down 36.1 / 39.1); wider projections measured no faster with these
    tiles. A long narrow projection (K ≥ 4 N) over fewer than 2048 features has too few programs to stream its
    weight in one program per tile (1.5B's down: 13.2 µs against cuBLAS's split-K 11.7): it takes the split
    kernel, 32 features × 128 columns a tile and K split over 8 programs, 10.5 µs at 1, 8 and 16 rows against
    cuBLAS's 12.3, 11.9 and 12.1 (7B's down stays unsplit: 33.7–34.5 µs against the best split's 35.4–35.7;
    ``--linear-tiles --projections "1.5b down,7b down" --rows 1,8,16,64``, ``kernels_split_h200.json``).
    ``tl.dot`` tiles of a 4-byte dtype take half the columns, so their pipeline stages fit in shared memory.

    A wide projection (N ≥ 8 K: gate/up) at several rows takes ``tl.dot`` over 64 features × 128 columns in three
    stages, the best of 72 tiles at 2, 8 and 16 rows (``python -m benchmarks.kernels --no-attention
    --linear-tiles``, ``benchmarks/results/kernels_tiles_h200.json``): 7B's gate/up 65.2–66.7 µs against cuBLAS's
    71.7–73.1, 1.5B's 15.8–16.2 against 17.4–17.9. Llama-3-8B's (N = 7 K) stays with cuBLAS (57.3 µs at 8 rows,
    the best tile 57.6), as do large q/k/v (7B: 11.4 against 11.5); the tiles above stay best for o and down. A small
    q/k/v (N ≤ 2 K and at most 8 MB, such as the 1.5B's 6.3 MB) takes the ``tl.dot`` tiles since the kernels take
    part in dependent launches (``rolecall.runtime.kernels.pdl``): the 1.5B's step at 8 rows 1.0–1.4 % faster, where the
    7B's q/k/v on the kernel made its step 0.2–1.2 % slower (H100, two alternating runs each,
    ``decode_qkv_rows8_ab_{on,off}{1,2}_h100.json``).

    From 33 to 64 rows (a large batch such as DELTA's 64, padded to 64 in the kernel) the gated gate/up kernel,
    over 64 features × 64 columns in four stages, and a small q/k/v or o (N ≤ 2 K and at most 8 MB: the 1.5B's),
    over 16 features × 256 columns in four stages: the best of 36 tiles at 64 rows on the 1.5B's projections
    (``benchmarks/results/kernels_tiles64_h200.json``; q/k/v 5.5 µs against cuBLAS's 6.0, o 5.1 against 5.4).
    ``python -m benchmarks.kernels --no-attention --linear --rows 32,64`` (``kernels_linear64_h200.json``): the
    gated kernel at 64 rows 1.5B 18.2 µs against cuBLAS then the activation 22.9, 7B 74.0 against 75.8; at 32 rows
    it lost (22.7 / 21.2, 80.2 / 73.9), as did every other plain projection from 17 rows on (7B's by 0.7–10 µs,
    Llama-3-8B's gate/up by 20–48), and the split kernel on the 1.5B's down (13.2 against 12.5). The small q/k/v and
    o, which gained 0.3–0.5 µs alone, take the kernel at 33 to 64 rows since the kernels take part in dependent
    launches: DELTA's setting over three lengths (H100, two alternating runs each) 2.15×, 2.15× → 2.19×, 2.19×, delta
    64.3, 63.9 → 62.0, 62.3 s and full 138.0, 137.8 → 136.0, 136.3 s
    (``decode_small64_{off,on}{1,2}_h100.json``). A long narrow projection of fewer than 2048 features (the 1.5B's
    down) takes the split kernel there, 32 features × 256 columns in four stages, K split over 2 programs, the best
    of 255 tiles at 64 rows: 14.4 µs against cuBLAS's split-K 15.6 (H100, ``--linear-tiles --projections "1.5b down,7b
    down,1.5b gate_up" --rows 64``, ``kernels_tiles_down64_h100.json``; the 7B's down, 53.4 against 54.3 on its best
    tile, stays with cuBLAS, and no gated tile beat the engine's 24.1 µs by more than 0.1); DELTA's setting 2.18×,
    2.19× → 2.21×, 2.21×, delta 62.7, 62.2 → 61.0, 61.2 s and full 136.7, 136.3 → 135.1, 135.3 s
    (``decode_down64split_{off,on}{1,2}_h100.json``). These tiles are for 2-byte dtypes only: in float32, 48 and 64
    rows of the small tile missed the float32 reference by more than 1e-4 on an H100, where 16 rows met it."""
    config = _measured_config(rows, n, k, itemsize, gated)
    if config is None or (shared is not None and shared_bytes(config, rows, itemsize, gated) > shared):
        return None
    return config


def _measured_config(rows: int, n: int, k: int, itemsize: int, gated: bool) -> Config | None:
    if rows > MAX_ROWS or rows < 1:
        return None
    long_narrow = k >= 4 * n and n < 2048  # few feature tiles (the 1.5B's down): K split over programs
    if rows > TILE_ROWS:
        if rows <= 2 * TILE_ROWS or itemsize != 2:  # float32 tiles of 64 rows missed float32's accuracy on an H100
            return None
        if gated:
            return Config(True, 64, 128 // itemsize, 4, 4) if n >= 8 * k else None
        if long_narrow:  # over 2 programs
            return Config(True, 32, 512 // itemsize, 4, 4, 2)
        small = n <= 2 * k and n * k * itemsize <= 8 << 20  # a small q/k/v or o (the 1.5B's)
        return Config(True, 16, 512 // itemsize, 4, 4) if small else None
    if long_narrow:  # over 8 programs
        return Config(True, 32, 256 // itemsize, 4, 4, 8)
    dot = Config(True, 32, 1024 // itemsize, 4, 4)
    if k >= 4 * n:  # long and narrow (7B's down projection)
        return dot
    if rows == 1:
        return Config(False, 32, 256, 8, 3) if n >= 8 * k else Config(False, 8, 512, 8, 2)
    if n >= 8 * k:
        return Config(True, 64, 256 // itemsize, 4, 3)
    return dot if n <= k or (n <= 2 * k and n * k * itemsize <= 8 << 20) else None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` accumulated in float32 and rounded once to ``x``'s dtype."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """An MLP's activation by its config name (``silu``, ``gelu_pytorch_tanh``, ``gelu``)."""
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_pytorch_tanh" else "none")


def gated_linear(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """Reference of the gated kernel: ``act(gate) · up`` in float32 from the two halves of ``x @ weight.T``, each
    rounded to ``x``'s dtype, then rounded once."""
    gate, up = skinny_linear(x, weight).float().chunk(2, -1)
    return (activation(gate, kind) * up).to(x.dtype)
