"""A static, graph-capturable decode step for Qwen2/Llama-shaped decoders, with attention by role.

The transformers decode step is 5–15× above the byte bound on long contexts (mostly Python and cache
overhead, measured on an H200), so end-to-end speed-ups of a sparse policy only mean something against a lean dense
step. :class:`StaticDecoder` is that step: weights as plain tensors (QKV and gate/up fused), a preallocated
KV cache ``[B, Hkv, S, D]`` per layer, the current length in a device tensor, the new token's K/V written with
``index_copy_`` at that length, greedy next token chosen on the device, ``length += 1`` on the device. No
``.item()``, no host sync and no shape that changes per step, so one step is captured in a CUDA graph
(:meth:`StaticDecoder.capture`) and replayed; everything but attention is plain torch ops.

Attention per layer by policy, on the repo's kernels (Triton on CUDA, the references elsewhere):

* :class:`Full` — every layer reads the valid length (``key_mask = arange(S) <= length``);
* :class:`Delta` — full layers read everything; Δ-layers read everything *and* score pages in the same pass
  (``decode_and_score``: logits kept, ``S[u] = Σ_{t∈u} max_h p_h[t]``), then the top pages plus the last
  ``recent_pages`` are chosen on the device (``torch.topk``); sparse layers read only those pages;
* :class:`Lychee` — per layer, retrieval KV heads read everything and choose, per head, the top blocks the
  same head index reads in the next layer; sparse heads read what they inherit and pass it on unchanged
  (layer 0 is all retrieval). A layer's retrieval heads are stored first, so they are one dense
  ``decode_and_score`` launch over a head-prefix view of the cache and the sparse heads one block-sparse
  launch (the kernel's ``full_rows`` mixes both in one launch but cannot keep logits for scoring);
  a manifest whose retrieval heads are not a prefix gets its weights' KV heads reordered once, and its cache
  keeps them in that order (:attr:`StaticCache.head_order`);
* :class:`Lethe` — the steady state of per-layer eviction: each layer's cache is compacted to its budget
  (plus an optional recent window), the new token takes a slot (``length mod slots``), and the kernel reads
  every slot. The scoring and eviction work itself (amortised over many steps) is not modelled, so this
  times Lethe's steady-state attention, not its bookkeeping.

Short contexts: a sparse policy reads nothing less than full below its budget and pays for selection, so
below ``min_context`` tokens :meth:`StaticDecoder.step` runs the full-attention step instead (two graphs
over the same buffers; the host knows the length because it issued every step). By default the threshold
is the measured crossover for the policy and batch size (:func:`default_min_context`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from runtime.kernels.page_scores import attention_probs, pool_pages
from runtime.kernels.sparse_attention import naive as naive_attention
from runtime.kernels.sparse_attention import use_triton

# The context from which a sparse policy (2K budget) is faster than full end to end, measured on one H200
# (benchmarks/decode.py: bf16, CUDA graphs, contexts 4K–128K in powers of two, the smallest context from
# which the policy stays faster):
#
#   shape          batch   delta    lychee               lethe
#   DS-Qwen-7B       1     32768    never (up to 131072)  8192
#   DS-Qwen-7B       8      8192    32768                 4096
#   DS-Qwen-1.5B     1     32768    never (up to 131072) 16384
#   DS-Qwen-1.5B     8      8192    32768                 4096
#
# Both shapes agree but for lethe at batch 1, where the later crossover is kept. Per policy, the row of the
# largest measured batch not above ``batch`` applies: batches 2–7 take batch 1's thresholds, batches above 8
# batch 8's. The crossover only falls as the batch grows (K/V bytes grow with it, weight bytes do not), so
# both err towards the full step where the sparse one is not known to win. Other budgets shift the
# crossovers (a larger budget reads more, so it wins later); pass ``min_context`` for them.
NEVER = 1 << 62  # a threshold no context reaches: the policy always runs the full step
MIN_CONTEXT_BY_BATCH: dict[str, tuple[tuple[int, int], ...]] = {  # policy -> ((from batch, threshold), ...)
    "delta": ((1, 32768), (8, 8192)),
    "lychee": ((1, NEVER), (8, 32768)),
    "lethe": ((1, 16384), (8, 4096)),  # for reference: a compacted cache has no full step to fall back to
}
DEFAULT_MIN_CONTEXT = 4096  # the former default for every policy and batch, kept for callers that import it


def default_min_context(policy: Any, batch: int) -> int:
    """Below how many tokens ``policy`` (a policy or its name) should run the full step at ``batch`` rows:
    the measured crossover of :data:`MIN_CONTEXT_BY_BATCH` (0 for ``full``, :data:`NEVER` where the sparse
    step never won). :class:`StaticDecoder` uses it when no ``min_context`` is given; policies that cannot
    fall back (``Lethe``) ignore it."""
    name = getattr(policy, "name", policy)
    if name == "full":
        return 0
    if name not in MIN_CONTEXT_BY_BATCH:
        raise ValueError(f"no measured threshold for policy {name!r}; known: full, {', '.join(MIN_CONTEXT_BY_BATCH)}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    return [threshold for first, threshold in MIN_CONTEXT_BY_BATCH[name] if first <= batch][-1]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Qwen2/Llama-shaped decoder (what a decode step's cost depends on)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0
    eps: float = 1e-6
    qkv_bias: bool = True

    def weight_bytes(self, batch: int, element: int = 2) -> int:
        """Bytes of weights one decode step reads: every matrix once, and ``batch`` rows of the embedding."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        per_layer = (self.hidden * qkv + (qkv if self.qkv_bias else 0) + self.heads * self.head_dim * self.hidden
                     + 3 * self.hidden * self.intermediate + 2 * self.hidden)
        return element * (self.layers * per_layer + self.hidden + self.vocab * self.hidden + batch * self.hidden)

    def kv_bytes(self, batch: int, tokens_per_head: float, element: int = 2) -> float:
        """Bytes of K and V read when every (layer, KV head) reads ``tokens_per_head`` tokens on average."""
        return 2.0 * element * batch * self.layers * self.kv_heads * tokens_per_head * self.head_dim


SHAPES = {
    # DeepSeek-R1-Distill-Qwen-7B / -1.5B (Qwen2 architecture, untied embeddings)
    "7b": ModelShape(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064),
    "1.5b": ModelShape(layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936),
}


# -- weights -------------------------------------------------------------------------------------------------------
@dataclass
class LayerWeights:
    norm_in: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q, k, v projections stacked
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) D] (Qwen2) or None (Llama)
    wo: torch.Tensor  # [H, Hq D]
    norm_post: torch.Tensor  # [H]
    w_gate_up: torch.Tensor  # [2 I, H]: gate, then up
    w_down: torch.Tensor  # [H, I]


@dataclass
class Weights:
    shape: ModelShape
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def random(cls, shape: ModelShape, device: Any = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               std: float = 0.02) -> Weights:
        """Random weights of ``shape`` (speed does not depend on the values; norms are 1 so nothing overflows)."""
        g = torch.Generator(device=device).manual_seed(seed)

        def rnd(*size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=g, device=device, dtype=dtype) * std)

        h, d = shape.hidden, shape.head_dim
        qkv = (shape.heads + 2 * shape.kv_heads) * d
        ones = torch.ones(h, device=device, dtype=dtype)
        layers = [LayerWeights(ones.clone(), rnd(qkv, h), rnd(qkv) if shape.qkv_bias else None,
                               rnd(h, shape.heads * d), ones.clone(), rnd(2 * shape.intermediate, h),
                               rnd(h, shape.intermediate)) for _ in range(shape.layers)]
        return cls(shape, rnd(shape.vocab, h), layers, ones.clone(), rnd(shape.vocab, h))

    @classmethod
    def from_hf(cls, model: torch.nn.Module) -> Weights:
        """The weights of a transformers Llama/Qwen2/Mistral causal LM (copied into the fused layout)."""
        config = model.config
        kind = getattr(config, "model_type", "")
        if kind not in ("llama", "qwen2", "mistral"):
            raise NotImplementedError(f"fastdecode supports llama, qwen2 and mistral decoders, not {kind!r}")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"fastdecode implements default RoPE only, not {rope.get('rope_type')!r}")
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
        if getattr(config, "mlp_bias", False) or sliding or (kind == "mistral" and config.sliding_window):
            raise NotImplementedError("fastdecode does not implement MLP biases or sliding-window attention")
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        d = getattr(config, "head_dim", None) or config.hidden_size // heads
        base = model.model
        layers = []
        for layer in base.layers:
            att, mlp = layer.self_attn, layer.mlp
            if att.o_proj.bias is not None:
                raise NotImplementedError("fastdecode does not implement an o_proj bias")
            biases = [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]
            layers.append(LayerWeights(
                layer.input_layernorm.weight.detach(),
                torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach(),
                torch.cat(biases).detach() if biases[0] is not None else None,
                att.o_proj.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), mlp.down_proj.weight.detach()))
        shape = ModelShape(len(layers), config.hidden_size, heads, kv, d, config.intermediate_size,
                           config.vocab_size, float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
                           float(config.rms_norm_eps), layers[0].bqkv is not None)
        return cls(shape, base.embed_tokens.weight.detach(), layers, base.norm.weight.detach(),
                   model.lm_head.weight.detach())

    def permute_kv_heads(self, perms: list[torch.Tensor]) -> Weights:
        """The same model with each layer's KV heads (and their query groups) stored in order ``perms[l]``
        (position j holds original head ``perms[l][j]``); the cache then follows that order too."""
        s = self.shape
        g, d = s.heads // s.kv_heads, s.head_dim
        layers = []
        for lw, p in zip(self.layers, perms):
            p = p.to(lw.wqkv.device)
            wo = lw.wo.unflatten(1, (s.kv_heads, g * d))[:, p].flatten(1, 2)
            layers.append(replace(lw, wqkv=_permute_qkv(lw.wqkv, p, s), wo=wo,
                                  bqkv=None if lw.bqkv is None else _permute_qkv(lw.bqkv, p, s)))
        return replace(self, layers=layers)


def _permute_qkv(w: torch.Tensor, order: torch.Tensor, s: ModelShape) -> torch.Tensor:
    """Rows (or bias entries) of the stacked q, k, v projections with KV heads in ``order``."""
    g, d, hkv = s.heads // s.kv_heads, s.head_dim, s.kv_heads
    q, k, v = w.split([s.heads * d, hkv * d, hkv * d])
    return torch.cat([q.unflatten(0, (hkv, g * d))[order].flatten(0, 1),
                      k.unflatten(0, (hkv, d))[order].flatten(0, 1), v.unflatten(0, (hkv, d))[order].flatten(0, 1)])


# -- policies ------------------------------------------------------------------------------------------------------
@dataclass
class Full:
    """Every layer reads every valid token."""

    name = "full"
    sparse = False

    def slots(self, layer: int, max_len: int) -> int:
        return max_len

    def tokens_read(self, shape: ModelShape, context: int) -> float:
        """Mean tokens read per (layer, KV head) at ``context`` tokens."""
        return float(context)


@dataclass
class Delta:
    """DELTA layer roles (0 full, 1 Δ, 2 sparse); sparse layers read ``budget`` tokens of pages."""

    roles: list[int]
    budget: int = 2048
    page_size: int = 16
    recent_pages: int = 8
    name = "delta"
    sparse = True

    def __post_init__(self) -> None:
        self.roles = [int(r) for r in self.roles]
        if any(r not in (0, 1, 2) for r in self.roles):
            raise ValueError(f"delta: layer roles are 0 (full), 1 (Δ), 2 (sparse), got {self.roles}")
        first = self.roles.index(1) if 1 in self.roles else len(self.roles)
        if 2 in self.roles[:first]:
            raise ValueError("delta: a sparse layer comes before any Δ-layer, so it has no pages to read")
        self.num_pages = math.ceil(self.budget / self.page_size)
        self.recent_pages = min(self.recent_pages, self.num_pages)

    @classmethod
    def standard(cls, layers: int, selection: tuple[int, ...] = (2, 14, 22), **kw: Any) -> Delta:
        """Layers 0–1 full, Δ-layers at ``selection`` (DELTA's choice for DS-Qwen-7B), the rest sparse."""
        roles = [0 if i < 2 else 1 if i in selection else 2 for i in range(layers)]
        return cls(roles, **kw)

    @classmethod
    def from_manifest(cls, manifest: Any, **kw: Any) -> Delta:
        return cls(manifest.layer_role.tolist(), **kw)

    def slots(self, layer: int, max_len: int) -> int:
        return max_len

    def tokens_read(self, shape: ModelShape, context: int) -> float:
        sparse = min(context, self.num_pages * self.page_size)
        return sum(sparse if r == 2 else context for r in self.roles) / len(self.roles)


@dataclass
class Lychee:
    """LycheeDecode head roles: ``retrieval [L, Hkv]`` bool (layer 0 is made all retrieval)."""

    retrieval: torch.Tensor
    budget: int = 2048
    block_size: int = 16
    recent: int = 1  # last tokens always kept (the current one)
    name = "lychee"
    sparse = True

    def __post_init__(self) -> None:
        self.retrieval = torch.as_tensor(self.retrieval).bool().cpu().clone()
        self.retrieval[0] = True
        self.num_blocks = math.ceil(self.budget / self.block_size)
        self.recent_blocks = math.ceil(self.recent / self.block_size) if self.recent else 0
        self.num_blocks = max(self.num_blocks, self.recent_blocks, 1)

    @classmethod
    def spread(cls, layers: int, kv_heads: int, count: int, seed: int = 0, **kw: Any) -> Lychee:
        """``count`` retrieval heads: all of layer 0, the rest at random places, each layer's stored first
        (a random model's heads have no identity, so no reordering is needed)."""
        g = torch.Generator().manual_seed(seed)
        per_layer = torch.zeros(layers, dtype=torch.long)
        per_layer[0] = kv_heads
        rest = torch.randperm((layers - 1) * kv_heads, generator=g)[:max(count - kv_heads, 0)]
        per_layer[1:] += torch.bincount(rest // kv_heads, minlength=layers - 1)
        return cls(torch.arange(kv_heads)[None, :] < per_layer[:, None], **kw)

    @classmethod
    def from_manifest(cls, manifest: Any, **kw: Any) -> Lychee:
        return cls(manifest.head_role == 1, **kw)

    def orders(self) -> list[torch.Tensor]:
        """Per layer, the stored order of KV heads: retrieval heads first (each group in original order)."""
        return [torch.argsort((~row).to(torch.int8), stable=True) for row in self.retrieval]

    def slots(self, layer: int, max_len: int) -> int:
        return max_len

    def tokens_read(self, shape: ModelShape, context: int) -> float:
        r = float(self.retrieval.sum())
        n = self.retrieval.numel()
        return (r * context + (n - r) * min(context, self.num_blocks * self.block_size)) / n


@dataclass
class Lethe:
    """Steady-state Lethe: each layer keeps ``budget`` tokens (an int, or one per layer) plus ``recent``."""

    budget: int | list[int] = 2048
    recent: int = 0
    name = "lethe"
    sparse = False  # it reads its whole (compacted) cache: nothing to fall back from

    def layer_budget(self, layer: int) -> int:
        b = self.budget if isinstance(self.budget, int) else self.budget[layer]
        return int(b) + self.recent

    def slots(self, layer: int, max_len: int) -> int:
        return min(max_len, self.layer_budget(layer))

    def tokens_read(self, shape: ModelShape, context: int) -> float:
        return sum(min(context, self.layer_budget(i)) for i in range(shape.layers)) / shape.layers


POLICY_NAMES = ("full", "delta", "lychee", "lethe")


# -- the cache -----------------------------------------------------------------------------------------------------
class StaticCache:
    """K and V per layer ``[B, Hkv, slots_l, D]``, allocated once, and the length as a device scalar.

    ``head_order``: per layer, the model's KV head each cache head holds (position j holds head
    ``head_order[l][j]``), or ``None`` for the model's own order. A :class:`Lychee` decoder whose retrieval
    heads are not a prefix stores its heads in :meth:`Lychee.orders`; a cache it shares must be created with
    that order, so that every decoder reading it sees the same model state.
    """

    def __init__(self, shape: ModelShape, batch: int, slots: list[int], device: Any, dtype: torch.dtype,
                 head_order: list[torch.Tensor] | None = None) -> None:
        self.shape, self.batch, self.slots = shape, batch, list(slots)
        self.k = [torch.zeros(batch, shape.kv_heads, s, shape.head_dim, device=device, dtype=dtype) for s in slots]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.head_order = _head_order(head_order, shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_needed(shape: ModelShape, batch: int, slots: list[int], element: int = 2) -> int:
        return 2 * element * batch * shape.kv_heads * shape.head_dim * sum(slots)

    def fill_random(self, seed: int = 0) -> None:
        """Random keys and values in every slot (a benchmark's stand-in for a prefill).

        Drawn in the model's head order, then stored in ``head_order``: the same seed gives the same model
        state whatever order a cache keeps its heads in."""
        g = torch.Generator(device=self.length.device).manual_seed(seed)
        for t in self.k + self.v:
            t.normal_(generator=g)
        if self.head_order is not None:
            for t, order in zip(self.k + self.v, self.head_order * 2):
                t.copy_(t.index_select(1, order.to(t.device)))


def _head_order(orders: list[torch.Tensor] | None, shape: ModelShape) -> list[torch.Tensor] | None:
    """``orders`` as CPU long tensors, checked; ``None`` when every layer keeps the model's order."""
    if orders is None:
        return None
    orders = [torch.as_tensor(o).long().cpu() for o in orders]
    identity = torch.arange(shape.kv_heads)
    if len(orders) != shape.layers or any(not torch.equal(o.sort().values, identity) for o in orders):
        raise ValueError(f"head_order needs one permutation of the {shape.kv_heads} KV heads per layer "
                         f"({shape.layers} layers)")
    return None if all(torch.equal(o, identity) for o in orders) else orders


def _same_order(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- the decoder ---------------------------------------------------------------------------------------------------
class StaticDecoder:
    """One decode step over a :class:`StaticCache`, eager or replayed from a CUDA graph.

    ``kernels``: ``"auto"`` (Triton on CUDA), ``"naive"`` (the PyTorch references) or ``"triton"`` (also on
    the CPU under ``TRITON_INTERPRET=1``, to test the calls). ``cache``: share one cache between decoders
    (benchmarks); by default the decoder allocates its own with ``max_len`` slots per layer. ``min_context``:
    below this many tokens a sparse policy runs the full step; ``None`` (the default) takes
    :func:`default_min_context` for the policy and ``batch``.
    """

    def __init__(self, weights: Weights, policy: Any = None, batch: int = 1, max_len: int = 4096, *,
                 cache: StaticCache | None = None, min_context: int | None = None,
                 kernels: str = "auto") -> None:
        self.policy = policy if policy is not None else Full()
        s = weights.shape
        self.order: list[torch.Tensor] | None = None
        head_order = None  # the order the cache keeps KV heads in (None: the model's)
        if isinstance(self.policy, Lychee):
            if tuple(self.policy.retrieval.shape) != (s.layers, s.kv_heads):
                raise ValueError(f"lychee: retrieval roles {tuple(self.policy.retrieval.shape)} do not fit "
                                 f"{s.layers} layers × {s.kv_heads} KV heads")
            orders = self.policy.orders()
            head_order = _head_order(orders, s)
            if head_order is not None:
                weights = weights.permute_kv_heads(orders)
            self.order = [o.to(weights.device) for o in orders]
            self.n_retrieval = [int(r) for r in self.policy.retrieval.sum(1)]
        if isinstance(self.policy, Delta) and len(self.policy.roles) != s.layers:
            raise ValueError(f"delta: {len(self.policy.roles)} layer roles for a {s.layers}-layer model")
        self.weights, self.shape, self.batch = weights, s, batch
        device, dtype = weights.device, weights.dtype
        slots = [self.policy.slots(i, max_len) for i in range(s.layers)]
        if cache is None:
            cache = StaticCache(s, batch, slots, device, dtype, head_order)
        elif cache.batch != batch or cache.slots != slots:
            raise ValueError(f"the shared cache has {cache.batch} rows × slots {sorted(set(cache.slots))}, "
                             f"this decoder needs {batch} × {sorted(set(slots))}")
        elif not _same_order(cache.head_order, head_order):
            raise ValueError("the shared cache keeps its KV heads in another order than this decoder reads them "
                             "(create it with head_order=policy.orders())")
        self.cache, self.max_len = cache, max_len
        if min_context is None:
            min_context = default_min_context(self.policy, batch) if self.policy.sparse else 0
        self.min_context = min_context if self.policy.sparse else 0
        if kernels not in ("auto", "naive", "triton"):
            raise ValueError(f"kernels must be auto, naive or triton, not {kernels!r}")
        self.triton = kernels == "triton" or (kernels == "auto" and use_triton(torch.empty(0, device=device)))
        if self.triton:
            from runtime.kernels.page_scores import triton as page_triton
            from runtime.kernels.sparse_attention import triton as sparse_triton

            self._page_triton, self._sparse_triton = page_triton, sparse_triton
            for name, size in (("page_size", getattr(self.policy, "page_size", 16)),
                               ("block_size", getattr(self.policy, "block_size", 16))):
                if size & (size - 1):
                    raise ValueError(f"{name} must be a power of two for the GPU kernels, got {size}")
        self.scale = s.head_dim ** -0.5
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)  # the next step's input
        self.logits = torch.zeros(batch, s.vocab, dtype=dtype, device=device)  # the last step's output
        self.position = 0  # host mirror of cache.length: the host issued every step
        self._inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.int64, device=device)
                                                 .float() / s.head_dim))
        self._arange = torch.arange(max(slots), device=device)
        self.graphs: dict[str, Any] = {}

    # -- host-side control -------------------------------------------------------------------------------------
    def set_length(self, length: int) -> None:
        """Declare the first ``length`` slots valid (after filling them by other means, with the KV heads in
        ``cache.head_order``)."""
        self.cache.length.fill_(length)
        self.position = length

    def _ring_free(self) -> int:
        """Slots left before a step would write past the cache (Lethe's ring never runs out)."""
        return 1 << 62 if isinstance(self.policy, Lethe) else min(self.cache.slots) - self.position

    def uses_full(self) -> bool:
        """Whether the next step falls back to full attention (a sparse policy below ``min_context``)."""
        return self.policy.sparse and self.position < self.min_context

    def step(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per row (``tokens`` or the previous step's greedy choice); returns the logits
        buffer ``[B, vocab]`` (overwritten by the next step)."""
        if self._ring_free() < 1:
            raise RuntimeError(f"the cache is full: {self.max_len} tokens")
        if tokens is not None:
            self.tokens.copy_(tokens, non_blocking=True)
        which = "full" if self.uses_full() else "policy"
        if which in self.graphs:
            self.graphs[which].replay()
        else:
            self._run(Full() if which == "full" else self.policy)
        self.position += 1
        return self.logits

    def capture(self, warmup: int = 2) -> None:
        """Capture the step (and the full fallback when the policy can use it) in CUDA graphs.

        Warm-up runs (on a side stream) compile the kernels; afterwards the length, the next tokens and the
        cache slots they wrote are restored, so the state is what it was before the call.
        """
        kinds = ["policy"] + (["full"] if self.policy.sparse and self.min_context > 0 else [])
        c = self.cache
        length, tokens = c.length.clone(), self.tokens.clone()
        if self._ring_free() < warmup:
            raise RuntimeError(f"capture needs {warmup} free cache slots for its warm-up, {self._ring_free()} left")
        written = [torch.remainder(length + torch.arange(warmup, device=length.device), n) for n in c.slots]
        saved = [(k.index_select(2, i), v.index_select(2, i)) for k, v, i in zip(c.k, c.v, written)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for kind in kinds:
                for _ in range(warmup):
                    self._run(Full() if kind == "full" else self.policy)
                c.length.copy_(length)  # each kind warms up from the same length
        torch.cuda.current_stream().wait_stream(side)
        c.length.copy_(length)
        self.tokens.copy_(tokens)
        for k, v, i, (sk, sv) in zip(c.k, c.v, written, saved):
            k.index_copy_(2, i, sk)
            v.index_copy_(2, i, sv)
        for kind in kinds:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._run(Full() if kind == "full" else self.policy)
            self.graphs[kind] = graph

    # -- prefill -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Dense causal prefill of an empty cache with ``input_ids [B, P]`` (not graphed); returns the last
        position's logits ``[B, vocab]`` and sets the next tokens to their greedy choice."""
        s, w = self.shape, self.weights
        b, p = input_ids.shape
        if b != self.batch or p > min(self.cache.slots):
            raise ValueError(f"prefill of [{b}, {p}] does not fit a cache of {self.batch} rows × "
                             f"{min(self.cache.slots)} slots")
        hq, hkv, d = s.heads, s.kv_heads, s.head_dim
        cos, sin = self._rope(torch.arange(p, device=input_ids.device))  # [P, D]
        x = F.embedding(input_ids, w.embed)  # [B, P, H]
        for i, lw in enumerate(w.layers):
            h = F.rms_norm(x, (s.hidden,), lw.norm_in, s.eps)
            qkv = F.linear(h, lw.wqkv, lw.bqkv)
            qk = qkv[..., :(hq + hkv) * d].unflatten(-1, (hq + hkv, d))  # [B, P, Hq + Hkv, D]
            qk = qk * cos[:, None] + qk.roll(d // 2, -1) * sin[:, None]
            q, k = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)
            v = qkv[..., (hq + hkv) * d:].unflatten(-1, (hkv, d)).transpose(1, 2)
            self.cache.k[i][:, :, :p] = k
            self.cache.v[i][:, :, :p] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).flatten(2), lw.wo)
            h = F.rms_norm(x, (s.hidden,), lw.norm_post, s.eps)
            gate, up = F.linear(h, lw.w_gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, lw.w_down)
        logits = F.linear(F.rms_norm(x[:, -1], (s.hidden,), w.norm, s.eps), w.lm_head)
        self.logits.copy_(logits)
        self.tokens.copy_(logits.argmax(-1))
        self.set_length(p)
        return self.logits

    # -- one step ----------------------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[N, D]`` for positions ``[N]``, ``sin`` signed so that ``rotate_half(x) · sin`` is
        ``roll(x, D/2) · sin`` (one op fewer per layer)."""
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [N, D/2], as transformers computes them
        cos = torch.cat([freqs, freqs], -1).cos()
        sin = torch.cat([-freqs.sin(), freqs.sin()], -1)
        return cos.to(self.weights.dtype), sin.to(self.weights.dtype)

    @torch.no_grad()
    def _run(self, policy: Any) -> None:
        s, w, c = self.shape, self.weights, self.cache
        b, hq, hkv, d = self.batch, s.heads, s.kv_heads, s.head_dim
        length = c.length
        cos, sin = self._rope(length.view(1))  # [1, D]
        masks: dict[int, torch.Tensor] = {}  # slots -> key mask [1, slots]
        state: dict[str, torch.Tensor] = {}
        x = F.embedding(self.tokens, w.embed)  # [B, H]
        for i, lw in enumerate(w.layers):
            h = F.rms_norm(x, (s.hidden,), lw.norm_in, s.eps)
            qkv = F.linear(h, lw.wqkv, lw.bqkv)  # [B, (Hq + 2 Hkv) D]
            qk = qkv[:, :(hq + hkv) * d].view(b, hq + hkv, d)
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d:].view(b, hkv, d)
            slots = c.slots[i]
            if isinstance(policy, Lethe):
                slot = torch.remainder(length, slots).view(1)  # the slot eviction freed (steady state)
            else:
                slot = length.view(1)
            c.k[i].index_copy_(2, slot, k[:, :, None])
            c.v[i].index_copy_(2, slot, v[:, :, None])
            if slots not in masks:
                mask = (self._arange[:slots] <= length)[None]
                masks[slots] = mask.to(torch.int8) if self.triton else mask
            o = self._attention(policy, i, q, c.k[i], c.v[i], masks[slots], state)  # [B, Hq, D] float32
            x = torch.addmm(x, o.to(x.dtype).view(b, hq * d), lw.wo.t())
            h = F.rms_norm(x, (s.hidden,), lw.norm_post, s.eps)
            gate, up = F.linear(h, lw.w_gate_up).chunk(2, -1)
            x = torch.addmm(x, F.silu(gate) * up, lw.w_down.t())
        logits = F.linear(F.rms_norm(x, (s.hidden,), w.norm, s.eps), w.lm_head)
        self.logits.copy_(logits)
        self.tokens.copy_(logits.argmax(-1))
        length.add_(1)

    def _attention(self, policy: Any, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(policy, Delta):
            role = policy.roles[layer]
            if role == 1:
                out, scores = self._attend_and_score(q, k, v, policy.page_size, mask, per_kv_head=False)
                pages = self._select(scores, policy.page_size, policy.num_pages, policy.recent_pages)  # [B, N]
                state["pages"] = pages[:, None, :].expand(self.batch, k.shape[1], pages.shape[-1]).contiguous()
                return out
            if role == 2:
                return self._attend(q, k, v, mask, state["pages"], policy.page_size)
            return self._attend(q, k, v, mask)
        if isinstance(policy, Lychee):
            return self._lychee(policy, layer, q, k, v, mask, state)
        return self._attend(q, k, v, mask)

    def _lychee(self, policy: Lychee, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """Retrieval heads (stored first) read all and choose; sparse heads read the inherited blocks.

        ``state["sets"]`` ``[B, Hkv, N]`` holds the blocks per *original* head index, as the next layer's same
        head index inherits them."""
        hkv = k.shape[1]
        g = q.shape[1] // hkv
        r, order, bs = self.n_retrieval[layer], self.order[layer], policy.block_size
        outs = []
        if r:
            out, scores = self._attend_and_score(q[:, :r * g], k[:, :r], v[:, :r], bs, mask, per_kv_head=True)
            chosen = self._select(scores, bs, policy.num_blocks, policy.recent_blocks)  # [B, r, N]
            outs.append(out)
        if r < hkv:
            inherited = state["sets"].index_select(1, order[r:])
            outs.append(self._attend(q[:, r * g:], k[:, r:], v[:, r:], mask, inherited, bs))
        if r:
            sets = state.get("sets")
            sets = torch.empty_like(chosen) if sets is None else sets  # layer 0 chooses for every head
            state["sets"] = sets.index_copy(1, order[:r], chosen)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _select(self, scores: torch.Tensor, block: int, k: int, recent: int) -> torch.Tensor:
        """Block scores ``[..., n]`` → ``[..., min(k, n)]`` int32 block ids (-1 = none): the last ``recent`` valid
        blocks always, then the highest scores among the valid ones. On the device, no sync."""
        n = scores.shape[-1]
        ids = self._arange[:n]
        last = torch.div(self.cache.length, block, rounding_mode="floor")  # the block of the new token
        valid = ids <= last
        ranked = scores.float().masked_fill(~valid, float("-inf"))
        if recent:
            ranked = torch.where(valid & (ids > last - recent), float("inf"), ranked)
        top = ranked.topk(min(k, n), dim=-1, sorted=False)
        return torch.where(top.values > float("-inf"), top.indices, -1).to(torch.int32)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                indices: torch.Tensor | None = None, block_size: int = 1) -> torch.Tensor:
        if self.triton:
            out, _ = self._sparse_triton.sparse_decode_attention(q, k, v, indices, scale=self.scale,
                                                                 block_size=block_size, key_mask=mask)
        else:
            out, _ = naive_attention.sparse_decode_attention(q, k, v, indices, scale=self.scale,
                                                             block_size=block_size, key_mask=mask)
        return out

    def _attend_and_score(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page: int, mask: torch.Tensor,
                          per_kv_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense attention and page scores ``[B, n]`` (max over all heads) or ``[B, Hkv, n]`` (per KV head)."""
        if self.triton:
            out, _, scores = self._page_triton.decode_and_score(q, k, v, self.scale, page, key_mask=mask,
                                                                per_kv_head=per_kv_head)
            return out, scores
        out, _ = naive_attention.sparse_decode_attention(q, k, v, scale=self.scale, key_mask=mask)
        probs = attention_probs(q, k, self.scale, mask)  # [B, Hq, T]
        b, hq, t = probs.shape
        best = probs.view(b, k.shape[1], hq // k.shape[1], t).amax(2) if per_kv_head else probs.amax(1)
        return out, pool_pages(best, page)


__all__ = ["DEFAULT_MIN_CONTEXT", "MIN_CONTEXT_BY_BATCH", "NEVER", "POLICY_NAMES", "SHAPES", "Delta", "Full", "Lethe",
           "Lychee", "ModelShape", "StaticCache", "StaticDecoder", "Weights", "default_min_context"]
