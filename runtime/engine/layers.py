"""The decoder's arithmetic, written once for the prefill (``[B, P, ...]``) and the decode step (``[B, ...]``).

Every function takes the layer's weights and the :class:`~rolecall.runtime.engine.shape.ModelShape` switches; nothing
here knows a model family by name.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rolecall.runtime.engine.shape import ModelShape
from rolecall.runtime.engine.weights import LayerWeights, Weights
from rolecall.runtime.kernels.add_rms_norm import add_rms_norm
from rolecall.runtime.kernels.add_rms_norm.naive import rms_norm
from rolecall.runtime.kernels.rope_cache import split_rope
from rolecall.runtime.kernels.skinny_linear import gated_linear, linear


def embed(w: Weights, ids: torch.Tensor) -> torch.Tensor:
    x = F.embedding(ids, w.embed)
    s = w.shape.embed_scale
    # as transformers scales it: the factor rounded to the weights' dtype first
    return x * float(torch.tensor(s, dtype=x.dtype)) if s != 1.0 else x


def qkv(lw: LayerWeights, s: ModelShape, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        order: torch.Tensor | None = None):
    """See :func:`qkv_tensors`."""
    return qkv_tensors(s, h, lw.wqkv, lw.bqkv, lw.q_norm, lw.k_norm, cos, sin, order)


MLP_TOKENS = 8192  # tokens of a prefill chunk whose output projection and MLP run at once, at most


def finish_layer(w: Weights, i: int, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`finish_tensors`; layer ``i`` of ``w``, over ``x``, ``attn [B, C, ...]`` in parts of at most
    :data:`MLP_TOKENS` tokens (rows of ``[B · C, ...]``). Each token's MLP is its own, so a long chunk (one row's:
    32K tokens, for its attention) need not hold its MLP's activations all at once: DS-Qwen-32B's gate/up output
    alone is 3.6 GB at 32K tokens, against 0.9 GB in parts, whose GEMMs are still thousands of rows tall."""
    lw = w.layers[i]
    finish = functools.partial(finish_tensors, w.shape, wo=lw.wo, bo=lw.bo, norm_attn_out=lw.norm_attn_out,
                               norm_mlp=lw.norm_mlp, w_gate_up=lw.w_gate_up, w_down=lw.w_down,
                               norm_mlp_out=lw.norm_mlp_out, norm_next=next_norm(w, i))
    tokens = x.shape[:-1].numel()
    if tokens <= MLP_TOKENS:
        return finish(x, attn)
    x_rows, attn_rows = x.reshape(tokens, -1), attn.reshape(tokens, -1)  # parts of these are contiguous
    parts = [finish(x_rows[k:k + MLP_TOKENS], attn_rows[k:k + MLP_TOKENS]) for k in range(0, tokens, MLP_TOKENS)]
    return torch.cat([p[0] for p in parts]).view_as(x), torch.cat([p[1] for p in parts]).view_as(x)


def next_norm(w: Weights, i: int) -> torch.Tensor:
    """The norm applied to layer ``i``'s output: the next layer's input norm, or the final norm."""
    return w.layers[i + 1].norm_attn if i + 1 < len(w.layers) else w.norm


def first_input(w: Weights, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids → the residual stream ``x`` and the first layer's normed input ``h``."""
    x = embed(w, ids)
    return x, rms_norm(x, w.layers[0].norm_attn, w.shape.eps)


@functools.cache
def bound_finish(s: ModelShape):
    """:func:`finish_tensors` for ``s``: what the decode step runs through ``torch.compile``
    (:func:`rolecall.runtime.engine.compiling.compiled`), which fuses what no kernel of ours covers (the activation of a
    projection the gated kernel does not take, the casts) instead of a launch for each small op (a batch-1 step
    is otherwise bound by the launch latency of a dozen small kernels per layer). Compiled once per shape and
    row count, in the engine's eager warm-up, before its CUDA-graph capture; one object per shape, so later
    decoders of the same model reuse its compilations.

    On CUDA each residual add and the norm after it are one kernel of ours
    (:func:`rolecall.runtime.kernels.add_rms_norm.add_rms_norm`), which takes part in the chain of dependent launches: an
    add and norm that inductor fused measured 0.3–4.5 % slower a step, since it cannot. The GEMMs of a decode
    step are :func:`rolecall.runtime.kernels.skinny_linear.linear`'s custom op where it measured faster than cuBLAS; the
    compiled graph calls both ops as they are. Inductor's pattern matcher is off: it would fold a residual add
    into its GEMM as an ``addmm``, which first copies the residual into the output (one more kernel)."""
    return functools.partial(finish_tensors, s)


@functools.cache
def compiled_finish(s: ModelShape):
    """:func:`bound_finish` of ``s`` compiled, one object per shape (its compilations shared by every decoder)."""
    from rolecall.runtime.engine.compiling import compiled

    return compiled(bound_finish(s), pattern_matcher=False)


def qkv_tensors(s: ModelShape, h, wqkv, bqkv, q_norm, k_norm, cos, sin, order=None):
    """Normed hidden ``h [..., H]`` → ``q [..., Hq, D]``, ``k``, ``v [..., Hkv, D]`` with RoPE applied
    (:func:`rolecall.runtime.kernels.rope_cache.split_rope`; KV heads in ``order`` when given, query groups with them).

    ``cos``/``sin`` broadcast against ``[..., 1, D]`` (one row per position); ``sin`` is signed
    (:func:`signed_sin`) so that rotating half of a head is one ``roll``."""
    return split_rope(linear(h, wqkv, bqkv), s.heads, s.kv_heads, cos, sin, q_norm, k_norm, s.eps, order)


def placed(o: torch.Tensor, out: torch.Tensor | None, out_heads: torch.Tensor | None) -> torch.Tensor:
    """Attention output ``o [B, h · G, ...]`` (h KV heads' query groups) in the model's head order, as the GPU
    kernels write it: into ``out`` (else a new tensor), KV head j's query heads at ``out_heads[j]``'s when given
    (a cache that keeps heads in another order, ``StaticDecoder.head_maps``)."""
    if out_heads is None:
        return out.copy_(o) if out is not None else o
    out = torch.empty_like(o) if out is None else out
    g = o.shape[1] // out_heads.shape[0]
    out.unflatten(1, (-1, g)).index_copy_(1, out_heads.long(), o.unflatten(1, (-1, g)).to(out.dtype))
    return out


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``sin [..., D]`` with its first half negated: ``rotate_half(x) · sin = roll(x, D/2) · signed``."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def finish_tensors(s: ModelShape, x, attn, wo, bo, norm_attn_out, norm_mlp, w_gate_up, w_down, norm_mlp_out,
                   norm_next):
    """Residual stream after the attention output ``attn [..., Hq D]`` and the MLP, and that stream normed by
    ``norm_next`` (the next layer's input norm or the final norm), so the norm fuses with the residual add."""
    x, h = add_rms_norm(x, linear(attn.to(x.dtype), wo, bo), norm_mlp, s.eps, norm_attn_out)
    m = linear(gated_linear(h, w_gate_up, s.activation), w_down)
    return add_rms_norm(x, m, norm_next, s.eps, norm_mlp_out)


def logits(w: Weights, h: torch.Tensor) -> torch.Tensor:
    """Logits from the last layer's output after the final norm. The output head is a projection like the others
    (the Triton kernel where :func:`~rolecall.runtime.kernels.skinny_linear.linear` takes it, up to 16 rows for a head this
    wide): against cuBLAS the full step measured 0.2–0.8 % faster (H100, DS-Qwen 7B and 1.5B shapes at 32K, one and
    eight rows, two alternating runs each, ``decode_lm_head_ab_{on,off}{1,2}_h100.json``)."""
    out = linear(h, w.lm_head)
    cap = w.shape.final_softcap
    return torch.tanh(out / cap) * cap if cap else out
