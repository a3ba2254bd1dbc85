"""The decoder's arithmetic, written once for the prefill (``[B, P, ...]``) and the decode step (``[B, ...]``).

Every function takes the layer's weights and the :class:`~runtime.engine.shape.ModelShape` switches; nothing
here knows a model family by name.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from runtime.engine.shape import ModelShape
from runtime.engine.weights import LayerWeights, Weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_pytorch_tanh" else "none")


def embed(w: Weights, ids: torch.Tensor) -> torch.Tensor:
    x = F.embedding(ids, w.embed)
    s = w.shape.embed_scale
    # as transformers scales it: the factor rounded to the weights' dtype first
    return x * float(torch.tensor(s, dtype=x.dtype)) if s != 1.0 else x


def qkv(lw: LayerWeights, s: ModelShape, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """See :func:`qkv_tensors`."""
    return qkv_tensors(s, x, lw.norm_attn, lw.wqkv, lw.bqkv, lw.q_norm, lw.k_norm, cos, sin)


def finish_layer(lw: LayerWeights, s: ModelShape, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """See :func:`finish_tensors`."""
    return finish_tensors(s, x, attn, lw.wo, lw.bo, lw.norm_attn_out, lw.norm_mlp, lw.w_gate_up, lw.w_down,
                          lw.norm_mlp_out)


@functools.cache
def compiled_layers(s: ModelShape):
    """:func:`qkv_tensors` and :func:`finish_tensors` for ``s`` through ``torch.compile``: the norms, RoPE,
    activation and residual adds of a decode step fuse into a few kernels around the GEMMs (a batch-1 step is
    otherwise bound by the launch latency of about twenty small kernels per layer). Compiled once per shape
    and batch, in the engine's eager warm-up, before its CUDA-graph capture; kept per shape, so later decoders
    of the same model reuse the compiled code."""
    # dynamic=None: the first batch size compiles static code; a second one recompiles with the batch symbolic,
    # which then serves every batch size (a serving process sees many; the recompile limit is never reached)
    opts = dict(dynamic=None, fullgraph=True)
    return (torch.compile(functools.partial(qkv_tensors, s), **opts),
            torch.compile(functools.partial(finish_tensors, s), **opts))


def qkv_tensors(s: ModelShape, x, norm_attn, wqkv, bqkv, q_norm, k_norm, cos, sin):
    """Normed hidden ``x [..., H]`` → ``q [..., Hq, D]``, ``k``, ``v [..., Hkv, D]`` with RoPE applied.

    ``cos``/``sin`` broadcast against ``[..., 1, D]`` (one row per position); ``sin`` is signed
    (:func:`signed_sin`) so that rotating half of a head is one ``roll``."""
    hq, hkv, d = s.heads, s.kv_heads, s.head_dim
    h = rms_norm(x, norm_attn, s.eps)
    y = F.linear(h, wqkv, bqkv)
    q = y[..., : hq * d].unflatten(-1, (hq, d))
    k = y[..., hq * d:(hq + hkv) * d].unflatten(-1, (hkv, d))
    v = y[..., (hq + hkv) * d:].unflatten(-1, (hkv, d))
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, s.eps), rms_norm(k, k_norm, s.eps)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    q = q * cos + q.roll(d // 2, -1) * sin
    k = k * cos + k.roll(d // 2, -1) * sin
    return q, k, v


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``sin [..., D]`` with its first half negated: ``rotate_half(x) · sin = roll(x, D/2) · signed``."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def finish_tensors(s: ModelShape, x, attn, wo, bo, norm_attn_out, norm_mlp, w_gate_up, w_down, norm_mlp_out):
    """Residual stream after the attention output ``attn [..., Hq D]`` and the MLP."""
    o = F.linear(attn.to(x.dtype), wo, bo)
    if norm_attn_out is not None:
        o = rms_norm(o, norm_attn_out, s.eps)
    x = x + o
    h = rms_norm(x, norm_mlp, s.eps)
    gate, up = F.linear(h, w_gate_up).chunk(2, -1)
    m = F.linear(activation(gate, s.activation) * up, w_down)
    if norm_mlp_out is not None:
        m = rms_norm(m, norm_mlp_out, s.eps)
    return x + m


def logits(w: Weights, x: torch.Tensor) -> torch.Tensor:
    out = F.linear(rms_norm(x, w.norm, w.shape.eps), w.lm_head)
    cap = w.shape.final_softcap
    return torch.tanh(out / cap) * cap if cap else out
