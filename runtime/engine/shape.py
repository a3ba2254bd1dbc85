"""What the engine needs to know of a decoder: its sizes and the few switches in which families differ.

Llama, Mistral, Qwen2, Qwen3 and Gemma 3 are one decoder with switches: a bias on the q/k/v projections
(Qwen2), RMS norms on q and k per head (Qwen3, Gemma 3), norms that scale by ``1 + w`` (Gemma), norms around
the attention and MLP outputs as well as their inputs (Gemma 3), a scaled embedding (Gemma), the MLP's
activation, a per-layer sliding window (Gemma 3's hybrid layers, Mistral's window on every layer) and tied
input/output embeddings. :func:`unsupported` says, in one line, why a config is outside that family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# RoPE variants whose frequencies do not change with the sequence length: the engine reads cos/sin tables
# computed once by the model's own rotary module, so any of these works unchanged.
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class ModelShape:
    """Sizes and switches of a decoder (what a decode step computes and what its cost depends on)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0  # random weights only; real models bring their own cos/sin tables
    eps: float = 1e-6
    qkv_bias: bool = True
    qk_norm: bool = False
    norm_offset: float = 0.0  # Gemma's norms scale by 1 + w
    sandwich: bool = False  # Gemma 3: norms after attention and MLP too
    embed_scale: float = 1.0
    activation: str = "silu"
    windows: tuple[int | None, ...] = ()  # per layer: sliding window in tokens, or None (full attention)
    scale: float | None = None  # attention logit scale; None = head_dim ** -0.5
    final_softcap: float | None = None
    tied: bool = False
    rope_kinds: tuple[str, ...] = field(default=())  # per layer: which cos/sin table (Gemma 3: two)

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} query heads do not split into {self.kv_heads} KV head groups")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if not self.windows:
            object.__setattr__(self, "windows", (None,) * self.layers)
        if not self.rope_kinds:
            object.__setattr__(self, "rope_kinds", ("default",) * self.layers)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers with a window in a hybrid model (Gemma 3); none where every layer or none has one (a window
        on every layer, Mistral's, is part of every layer's mask): :func:`rolecall.core.models.sliding_layers` for a
        shape."""
        windowed = tuple(i for i, w in enumerate(self.windows) if w is not None)
        return windowed if len(windowed) < self.layers else ()

    @property
    def attention_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    def weight_bytes(self, batch: int, element: int = 2) -> int:
        """Bytes of weights one decode step reads: every matrix once, and ``batch`` rows of the embedding."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        norms = (4 if self.sandwich else 2) * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = (self.hidden * qkv + (qkv if self.qkv_bias else 0) + self.heads * self.head_dim * self.hidden
                     + 3 * self.hidden * self.intermediate + norms)
        return element * (self.layers * per_layer + self.hidden + self.vocab * self.hidden + batch * self.hidden)

    def kv_bytes(self, batch: int, tokens_per_head: float, element: int = 2) -> float:
        """Bytes of K and V read when every (layer, KV head) reads ``tokens_per_head`` tokens on average."""
        return 2.0 * element * batch * self.layers * self.kv_heads * tokens_per_head * self.head_dim

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape of a transformers config of a supported family (see :func:`unsupported`)."""
        reason = unsupported(config)
        if reason:
            raise NotImplementedError(reason)
        c = _text(config)
        kind = c.model_type
        heads, kv = c.num_attention_heads, c.num_key_value_heads
        d = getattr(c, "head_dim", None) or c.hidden_size // heads
        gemma = kind == "gemma3_text"
        types = list(getattr(c, "layer_types", None) or [])
        window = getattr(c, "sliding_window", None)
        if types:
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        else:  # Mistral: one window on every layer when set
            windows = (window,) * c.num_hidden_layers
        act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
        return cls(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=heads, kv_heads=kv, head_dim=d,
                   intermediate=c.intermediate_size, vocab=c.vocab_size, eps=float(c.rms_norm_eps),
                   qkv_bias=bool(getattr(c, "attention_bias", False)) or kind == "qwen2",
                   qk_norm=kind in ("qwen3", "gemma3_text"), norm_offset=1.0 if gemma else 0.0, sandwich=gemma,
                   embed_scale=float(c.hidden_size ** 0.5) if gemma else 1.0, activation=act, windows=windows,
                   scale=float(c.query_pre_attn_scalar) ** -0.5 if gemma else None,
                   final_softcap=getattr(c, "final_logit_softcapping", None),
                   tied=bool(getattr(c, "tie_word_embeddings", False)),
                   rope_kinds=tuple(types) if gemma else ("default",) * c.num_hidden_layers)


def _text(config: Any) -> Any:
    config = getattr(config, "config", config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_types(config: Any) -> list[str]:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma 3)
        return [str((v or {}).get("rope_type", "default")) for v in rope.values()]
    scaling = getattr(config, "rope_scaling", None) or {}
    return [str(rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default")]


def unsupported(config: Any) -> str | None:
    """Why the engine cannot run a model of ``config`` (one line), or None when it can."""
    c = _text(config)
    kind = getattr(c, "model_type", "?")
    if kind not in FAMILIES:
        return f"the engine covers {', '.join(FAMILIES)} decoders, not {kind!r}"
    if getattr(c, "mlp_bias", False):
        return "the engine does not implement MLP biases"
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"the engine implements the activations {', '.join(ACTIVATIONS)}, not {act!r}"
    dynamic = [t for t in _rope_types(c) if t not in STATIC_ROPE]
    if dynamic:
        return f"the engine needs RoPE frequencies fixed in advance, not {dynamic[0]!r}"
    if getattr(c, "attn_logit_softcapping", None):
        return "the engine does not implement attention logit soft-capping"
    if kind == "gemma3_text" and getattr(c, "use_bidirectional_attention", False):
        return "the engine decodes causal models only"
    quantized = getattr(getattr(config, "config", config), "quantization_config", None) or getattr(
        c, "quantization_config", None)
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
        return f"the engine reads unquantized weights, and this model is quantized ({getattr(method, 'value', method)})"
    return None


# DeepSeek-R1-Distill-Qwen-7B / -1.5B (Qwen2 architecture, untied embeddings): the benchmarks' shapes.
SHAPES = {
    "7b": ModelShape(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064),
    "1.5b": ModelShape(layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936),
}
