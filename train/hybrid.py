"""The student's attention during training: per (layer, KV head), a mix of full attention and sparse
attention over tokens inherited from the previous layer, weighted by the head's gate z.

For layer l > 0 and KV head h:

    out = z[l, h] · full + (1 − z[l, h]) · sparse

where ``full`` is ordinary causal attention and ``sparse`` attends only to the token set that layer l − 1's
full attention of the same head index selected: per query, the top-k keys of its attention probabilities,
averaged over the query heads of the KV head's group (GQA). Layer 0 has no previous layer, so it is all
retrieval (z = 1). This is LycheeDecode's decode-time behaviour (retrieval heads pick tokens for the same
head in the next layer, sparse heads read them) made differentiable in z.

The budget k is a fraction of the keys each forward sees (``0 < budget <= 1``, e.g. 0.3) or a fixed count
(an int ``>= 1``). With ``gates`` unset the function is plain full attention (used to check it).

Hybrid models: sliding-window layers keep their own attention at decode time, so here they run it unmixed
(the student equals the teacher there), pass on the selection they received unchanged, and their gates are
held open and left out of E[L0] (:class:`GateLayout`). The first full-attention layer then has nothing to
inherit, so like layer 0 it is all retrieval. ``include_sliding`` treats sliding layers like any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rolecall.runtime.attention import keep_mask
from rolecall.runtime.kernels.dispatch import use_triton

ATTENTION_NAME = "rolecall-hybrid"


def budget_tokens(budget: float | int, kv_len: int) -> int:
    """How many keys the sparse set holds for ``kv_len`` keys."""
    if isinstance(budget, int) and not isinstance(budget, bool):
        return max(1, min(budget, kv_len))
    return max(1, min(kv_len, math.ceil(budget * kv_len)))


@contextmanager
def fast_float32_matmul(enabled: bool = True) -> Iterator[None]:
    """TF32 tensor cores for float32 matrix products inside the block (the float32 scores above and their
    backward), restored on exit. About 10 significant bits, enough for attention scores; CPUs ignore it."""
    before = torch.get_float32_matmul_precision()
    try:
        if enabled:
            torch.set_float32_matmul_precision("high")
        yield
    finally:
        torch.set_float32_matmul_precision(before)


_MIN_MASS = 1e-20  # below this share of a query's probability, the selected keys are renormalised exactly


def top_keys(mean_probs: Tensor, keep: Tensor, k: int) -> Tensor:
    """The top-``k`` keys of each query by its group's mean probability ``mean_probs`` [B, Hkv, S, T] (GQA: the
    query heads of a KV head choose together), within ``keep`` [B|1, 1, S, T]: [B, Hkv, S, T] bool."""
    with torch.no_grad():
        top = mean_probs.topk(k, dim=-1, sorted=False).indices  # order irrelevant
        return torch.zeros(mean_probs.shape, dtype=torch.bool, device=mean_probs.device).scatter_(-1, top, True) & keep


def sparse_keys(inherited: Tensor, keep: Tensor) -> Tensor:
    """The keys a sparse head reads, [B, Hkv, S, T] bool: the inherited set within ``keep`` [B|1, 1, S, T].

    A window (a sliding layer, with include_sliding) can hide every inherited key: such a query reads its own
    position, as the runtime's sparse heads always read the current token.
    """
    sparse_keep = inherited & keep
    own = keep & (keep.cumsum(-1) == keep.sum(-1, keepdim=True))
    return torch.where(sparse_keep.any(-1, keepdim=True), sparse_keep, own)


def _selection(probs: Tensor, keep: Tensor, k: int, memo: dict[str, Tensor] | None) -> Tensor:
    """:func:`top_keys` of the probabilities ``[B, Hkv, G, S, T]`` (from ``memo`` when a checkpointed layer
    recomputes)."""
    if memo is not None and "selected" in memo:
        return memo["selected"]
    selected = top_keys(probs.detach().mean(2), keep, k)
    if memo is not None:
        memo["selected"] = selected
    return selected


def hybrid_layer(query: Tensor, key: Tensor, value: Tensor, keep: Tensor, scaling: float,
                 inherited: Tensor | None, z: Tensor | None, k: int,
                 memo: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """One layer of hybrid attention.

    query [B, Hq, S, D]; key/value [B, Hkv, T, D]; keep [B|1, 1, S, T] bool (True = may attend);
    inherited [B, Hkv, S, T] bool, the previous layer's selection (None: full attention only);
    z [Hkv] gates. Returns the output [B, S, Hq, D] and this layer's selection [B, Hkv, S, T] bool.
    ``memo``: where the first call leaves its selection, so that the recomputation of a checkpointed layer in
    the backward pass (same inputs, same selection) skips the top-k.

    Query heads are grouped under their KV head ([B, Hkv, G, S, T]), so keys and values are never repeated.
    The sparse attention is the full attention renormalised over the selected keys (a softmax restricted to
    a subset is exactly that), so a layer runs one softmax; the renormalising mass comes out of the sparse
    product with the values, through a column of ones. Where the selected keys' share of a query's
    probability underflows, the restricted softmax is taken from the scores instead.
    """
    b, hq, s, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    groups = hq // hkv
    # float32 scores: the top-k must not flip on bf16 rounding, and the softmax needs the range
    q = (query.float() * scaling).reshape(b, hkv, groups * s, d)
    scores = torch.matmul(q, key.float().transpose(-1, -2))  # [B, Hkv, G·S, T]
    # The mask enters as an added bias, in place on the product (not on a view of it, which autograd would
    # answer with a copy of the whole gradient): an addition passes its gradient through untouched, and the
    # softmax's backward is zero at masked keys anyway.
    bias = torch.zeros(keep.shape, dtype=scores.dtype, device=scores.device).masked_fill_(~keep, float("-inf"))
    scores.add_(bias[:, :, None].expand(-1, -1, groups, -1, -1).reshape(bias.shape[0], 1, groups * s, t))
    probs = torch.softmax(scores, dim=-1).view(b, hkv, groups, s, t)
    selected = _selection(probs, keep, k, memo)
    v = value.float()
    out = torch.matmul(probs.view(b, hkv, groups * s, t), v)  # [B, Hkv, G·S, D]
    if inherited is not None and z is not None:
        sparse_keep = sparse_keys(inherited, keep)[:, :, None]
        # one product gives the selected keys' weighted values and, from a column of ones, their mass;
        # the columns are padded to a multiple of 8 for the tensor-core kernels
        ones = torch.zeros(*v.shape[:-1], 8, dtype=v.dtype, device=v.device)
        ones[..., 0] = 1
        # masked_fill, not a product with the mask: its backward needs no float copy of the mask
        picked = torch.matmul(probs.masked_fill(~sparse_keep, 0.0).view(b, hkv, groups * s, t), torch.cat([v, ones], -1))
        mass = picked[..., d : d + 1]
        if bool((mass < _MIN_MASS).any()):
            sparse = torch.matmul(torch.softmax(scores.view(b, hkv, groups, s, t).masked_fill(
                ~sparse_keep, float("-inf")), dim=-1).view(b, hkv, groups * s, t), v)
        else:
            sparse = picked[..., :d] / mass
        zg = z.float().view(1, hkv, 1, 1)
        out = zg * out + (1 - zg) * sparse
    out = out.view(b, hq, s, d)
    return out.to(query.dtype).transpose(1, 2).contiguous(), selected


def hybrid_layer_fused(query: Tensor, key: Tensor, value: Tensor, keep: Tensor, scaling: float,
                       inherited: Tensor | None, z: Tensor | None, k: int) -> tuple[Tensor, Tensor]:
    """:func:`hybrid_layer` through the fused kernels of :mod:`rolecall.train.hybrid_kernel`: the same inputs,
    outputs and selection, without the float32 ``[B, Hq, S, T]`` tensors (so without checkpointing)."""
    from rolecall.train.hybrid_kernel import hybrid_attention

    b, hq, s, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(b, hkv, (hq // hkv) * s, d)
    mixed = inherited is not None and z is not None
    sparse_keep = sparse_keys(inherited, keep) if mixed else None
    out, mean = hybrid_attention(q, key, value, z if mixed else None, keep[:, 0], sparse_keep, scaling)
    return out.view(b, hq, s, d).to(query.dtype).transpose(1, 2).contiguous(), top_keys(mean, keep, k)


@dataclass(frozen=True)
class GateLayout:
    """Which of the gated layers 1..L−1 are learned and which are held open (z = 1).

    ``sliding``: layers that keep their own attention (empty when sliding layers are included).
    """

    num_layers: int
    sliding: tuple[int, ...] = ()

    @classmethod
    def of(cls, model, include_sliding: bool = False) -> GateLayout:
        from rolecall.core.models import sliding_layers

        config = getattr(model, "config", model)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(int(text.num_hidden_layers), () if include_sliding else tuple(sliding_layers(config)))

    @property
    def first_full(self) -> int:
        """The first layer that is not sliding: it has no earlier selection to read, so it is all retrieval."""
        return next((i for i in range(self.num_layers) if i not in self.sliding), 0)

    @property
    def held(self) -> list[int]:
        """Layers ≥ 1 whose gates are held open: the sliding ones and a first full layer past layer 0."""
        return sorted({i for i in self.sliding if i > 0} | ({self.first_full} - {0}))

    def fixed_open(self, num_kv: int) -> Tensor | None:
        """bool [L − 1, Hkv], True for held gates; None when every gate is learned."""
        if not self.held:
            return None
        mask = torch.zeros(self.num_layers - 1, num_kv, dtype=torch.bool)
        mask[[i - 1 for i in self.held]] = True
        return mask

    def gated_heads(self, num_kv: int) -> int:
        """How many (layer, KV head) gates are learned: the most a target can ask for."""
        return (self.num_layers - 1 - len(self.held)) * num_kv


def _align(inherited: Tensor, t: int) -> Tensor:
    """A selection ``[B, Hkv, S, T']`` over keys that end at the same position as ``t`` keys → ``[.., t]``.

    Keys of every layer end at the current position; a sliding-window cache holds fewer of them (only with
    ``include_sliding`` does a selection cross such a layer), so align on the right.
    """
    have = inherited.shape[-1]
    if have == t:
        return inherited
    if have > t:
        return inherited[..., have - t :]
    return torch.nn.functional.pad(inherited, (t - have, 0), value=False)


@dataclass
class HybridAttention:
    """Attention function for ``rolecall.runtime.attention.use_attention``; set ``gates`` before each forward.

    ``gates``: z for layers 1..L−1, [L − 1, Hkv]; ``None`` gives full attention everywhere.
    ``checkpoint``: recompute each layer's scores in the backward pass instead of keeping them
    ([B, Hq, S, T] float32 twice per layer), which is what bounds memory at long prompts.
    ``sliding``: layers that run their own attention unmixed and pass their inherited selection on.
    ``fused``: on a GPU, run :func:`hybrid_layer_fused` (the same result from kernels that never write the
    scores; ``checkpoint`` is then moot); off, or on a CPU, or with ``ROLECALL_KERNELS=naive``,
    :func:`hybrid_layer`.
    """

    num_layers: int
    budget: float | int = 0.3
    checkpoint: bool = False
    sliding: tuple[int, ...] = ()
    fused: bool = True
    gates: Tensor | None = None
    _selected: Tensor | None = field(default=None, repr=False)
    _last_layer: int = field(default=-1, repr=False)

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if isinstance(self.budget, bool) or not (
            (isinstance(self.budget, int) and self.budget >= 1) or (isinstance(self.budget, float) and 0 < self.budget <= 1)
        ):
            raise ValueError(f"token budget must be a fraction in (0, 1] or a token count >= 1, got {self.budget!r}")

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        if layer == 0:
            self._selected = None
        elif layer != self._last_layer + 1:
            raise RuntimeError(f"hybrid attention saw layer {layer} after layer {self._last_layer}; layers must run in order")
        self._last_layer = layer
        s, t = query.shape[2], key.shape[2]
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        keep = keep_mask(attention_mask, s, t, device=query.device)
        z = None
        if self.gates is not None and layer > 0:
            if self.gates.shape != (self.num_layers - 1, key.shape[1]):
                raise ValueError(f"gates have shape {tuple(self.gates.shape)}, expected {(self.num_layers - 1, key.shape[1])}")
            z = self.gates[layer - 1].to(query.device)  # layers may sit on other GPUs (device_map="auto")
        passing = self._selected
        if layer in self.sliding:
            z = None  # its own (windowed) attention, as the teacher runs it
        inherited = _align(self._selected, t) if z is not None and self._selected is not None else None
        args = (query, key, value, keep, scaling, inherited, z, budget_tokens(self.budget, t))
        if self.fused and use_triton(query):
            out, self._selected = hybrid_layer_fused(*args)
        elif self.checkpoint and torch.is_grad_enabled():
            out, self._selected = checkpoint(hybrid_layer, *args, {}, use_reentrant=False)
        else:
            out, self._selected = hybrid_layer(*args)
        if layer in self.sliding:
            self._selected = passing
        if layer == self.num_layers - 1:
            self._selected, self._last_layer = None, -1  # nothing outlives a forward pass
        return out, None
