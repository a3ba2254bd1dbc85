"""The engine's weights: a transformers model's tensors in the fused layout the decode step reads.

``Weights.from_model(model)`` takes any model whose config :func:`rolecall.runtime.engine.shape.unsupported` accepts:
q, k and v projections stacked into one matrix, gate and up into another (one GEMV each per layer), norms with
Gemma's ``1 + w`` folded in, and the RoPE cos/sin tables computed once by the model's own rotary module (so
every static RoPE variant, llama3 and YaRN included, is exactly the model's). ``Weights.random(shape)`` builds
the same structure for benchmarks. Stacking copies the attention and gate/up matrices once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from rolecall.runtime.engine.shape import ModelShape


@dataclass
class LayerWeights:
    norm_attn: torch.Tensor  # [H] input norm of the attention (offset folded in)
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q, k, v projections stacked
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) D] or None
    q_norm: torch.Tensor | None  # [D] (Qwen3, Gemma 3) or None
    k_norm: torch.Tensor | None  # [D]
    wo: torch.Tensor  # [H, Hq D]
    bo: torch.Tensor | None  # [H] or None
    norm_attn_out: torch.Tensor | None  # [H] Gemma 3's norm of the attention output, else None
    norm_mlp: torch.Tensor  # [H] input norm of the MLP
    w_gate_up: torch.Tensor  # [2 I, H]: gate, then up
    w_down: torch.Tensor  # [H, I]
    norm_mlp_out: torch.Tensor | None  # [H] Gemma 3's norm of the MLP output, else None


@dataclass
class Weights:
    shape: ModelShape
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # kind -> (cos, sin) [positions, D] in the weights' dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def max_positions(self) -> int:
        return min(cos.shape[0] for cos, _ in self.rope.values())

    @classmethod
    def random(cls, shape: ModelShape, device: Any = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               std: float = 0.02, positions: int = 1 << 17) -> Weights:
        """Random weights of ``shape`` (speed does not depend on the values; norms are 1 so nothing overflows)."""
        g = torch.Generator(device=device).manual_seed(seed)

        def rnd(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=g, device=device, dtype=dtype) * std

        h, d = shape.hidden, shape.head_dim
        qkv = (shape.heads + 2 * shape.kv_heads) * d

        def ones(n: int = h) -> torch.Tensor:
            return torch.ones(n, device=device, dtype=dtype)

        layers = [LayerWeights(ones(), rnd(qkv, h), rnd(qkv) if shape.qkv_bias else None,
                               ones(d) if shape.qk_norm else None, ones(d) if shape.qk_norm else None,
                               rnd(h, shape.heads * d), None, ones() if shape.sandwich else None, ones(),
                               rnd(2 * shape.intermediate, h), rnd(h, shape.intermediate),
                               ones() if shape.sandwich else None) for _ in range(shape.layers)]
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        tables = {kind: _tables(inv_freq, positions, dtype) for kind in set(shape.rope_kinds)}
        embed = rnd(shape.vocab, h)
        return cls(shape, embed, layers, ones(), embed if shape.tied else rnd(shape.vocab, h), tables)

    @classmethod
    @torch.no_grad()
    def from_model(cls, model: torch.nn.Module, positions: int | None = None, share: bool = False) -> Weights:
        """The weights of a transformers causal LM of a supported family, with RoPE tables for ``positions``
        positions (default: the model's ``max_position_embeddings``).

        Stacking q/k/v and gate/up copies more than half of the weights. With ``share`` the model's own
        projections become views of the stacked matrices, layer by layer as they are made, so no copy stays
        (memory grows by one layer at most, and the model computes what it computed); :meth:`release` gives
        the model standalone tensors again. :func:`shared_weights` does both around a block."""
        shape = ModelShape.from_config(model.config)
        misplaced = placement_problem(model)
        if misplaced:
            raise ValueError(misplaced)
        base = decoder_of(model)
        off = shape.norm_offset

        def norm(module: torch.nn.Module | None) -> torch.Tensor | None:
            if module is None:
                return None
            return (module.weight.float() + off).to(module.weight.dtype)

        layers = []
        for layer in base.layers:
            att, mlp = layer.self_attn, layer.mlp
            biases = [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]
            qkv, gate_up = _stacked(layer)
            wqkv, w_gate_up = torch.cat([p.detach() for p in qkv]), torch.cat([p.detach() for p in gate_up])
            if share:
                _view_into(qkv, wqkv)
                _view_into(gate_up, w_gate_up)
            layers.append(LayerWeights(
                norm(layer.input_layernorm), wqkv, torch.cat(biases) if biases[0] is not None else None,
                norm(getattr(att, "q_norm", None)), norm(getattr(att, "k_norm", None)),
                att.o_proj.weight.detach(), att.o_proj.bias,
                norm(layer.post_attention_layernorm) if shape.sandwich else None,
                norm(layer.pre_feedforward_layernorm if shape.sandwich else layer.post_attention_layernorm),
                w_gate_up, mlp.down_proj.weight.detach(),
                norm(layer.post_feedforward_layernorm) if shape.sandwich else None))
        embed = model.get_input_embeddings().weight.detach()
        head = model.get_output_embeddings().weight.detach()
        return cls(shape, embed, layers, norm(base.norm), head, _rope_of(model, shape, positions, embed))

    def with_positions(self, model: torch.nn.Module, positions: int) -> Weights:
        """The same weights with RoPE tables for ``positions`` positions (from ``model``, whose they are)."""
        return replace(self, rope=_rope_of(model, self.shape, positions, self.embed))

    @torch.no_grad()
    def release(self, model: torch.nn.Module) -> None:
        """Undo :meth:`from_model`'s ``share``: layer by layer, the model's projections become standalone tensors
        again and these weights drop their stacked matrices (memory grows by one layer at most). These weights
        are then spent: :meth:`taken_from` says False."""
        for layer, lw in zip(decoder_of(model).layers, self.layers):
            qkv, gate_up = _stacked(layer)
            for p in qkv + gate_up:
                p.data = p.data.clone()
            lw.wqkv = lw.w_gate_up = None
        self.layers = []

    def taken_from(self, model: torch.nn.Module) -> bool:
        """Whether these weights were taken from ``model`` where its parameters now are (the same embedding
        storage: a model moved or cast since then holds new tensors, and its weights must be taken again) and
        are not spent (:meth:`release`)."""
        embed = model.get_input_embeddings().weight
        return bool(self.layers) and self.embed.data_ptr() == embed.data_ptr() and self.embed.shape == embed.shape


@contextmanager
def shared_weights(model: torch.nn.Module, positions: int | None = None) -> Iterator[Weights]:
    """The engine's weights of ``model``, its q/k/v and gate/up projections views of their stacked matrices
    inside the block (no second copy of them), standalone again after it, also when the block raises."""
    weights = Weights.from_model(model, positions, share=True)
    try:
        yield weights
    finally:
        weights.release(model)


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def _stacked(layer: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """A decoder layer's projections that the engine stacks: q, k, v and gate, up."""
    att, mlp = layer.self_attn, layer.mlp
    return [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], [mlp.gate_proj.weight, mlp.up_proj.weight]


def _view_into(params: list[torch.nn.Parameter], stacked: torch.Tensor) -> None:
    """Each parameter's data becomes its rows of ``stacked`` (their concatenation): its own storage is freed."""
    for p, rows in zip(params, stacked.split([p.shape[0] for p in params])):
        p.data = rows


def _rope_of(model: torch.nn.Module, shape: ModelShape, positions: int | None, embed: torch.Tensor):
    """cos/sin tables per RoPE kind for ``positions`` (default: the model's ``max_position_embeddings``)."""
    base = decoder_of(model)
    config = getattr(base, "config", model.config)
    count = positions or int(getattr(config, "max_position_embeddings", 0) or 32768)
    return {kind: _model_tables(base.rotary_emb, kind, count, embed.dtype, embed.device)
            for kind in sorted(set(shape.rope_kinds))}


def placement_problem(model: torch.nn.Module) -> str | None:
    """Why the engine cannot take ``model``'s weights where they are (one line), or None: the engine runs on one
    device and reads every weight there, so a model that a device map spread over GPUs, or offloaded in part to
    the CPU or the disk, decodes on the transformers path."""
    devices = sorted({str(p.device) for p in model.parameters()})
    if "meta" in devices:
        return "part of the model is offloaded (a device map's disk offload); the engine needs every weight on one GPU"
    if len(devices) > 1:
        return f"a device map spread the model over {', '.join(devices)}; the engine runs a model on one device"
    return None


def _tables(inv_freq: torch.Tensor, count: int, dtype: torch.dtype, scaling: float = 1.0):
    """cos, sin ``[count, D]`` as transformers computes them (float32, then cast)."""
    freqs = torch.arange(count, device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _model_tables(rotary: torch.nn.Module, kind: str, count: int, dtype: torch.dtype, device: Any):
    """cos, sin ``[count, D]`` from the model's own rotary module (``kind`` is Gemma 3's layer type)."""
    x = torch.zeros(1, dtype=dtype, device=device)
    positions = torch.arange(count, device=device)[None]
    try:
        cos, sin = rotary(x, positions, kind) if kind != "default" else rotary(x, positions)
    except TypeError:
        cos, sin = rotary(x, positions)
    return cos[0].to(dtype), sin[0].to(dtype)
