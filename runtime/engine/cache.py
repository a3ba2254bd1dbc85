"""The static KV cache: K and V per layer ``[B, Hkv, S, D]``, allocated once, sized to the requests.

Rows of a ragged batch are left-padded, so every row writes its next token into the same slot
(``length``, a device scalar) and a decode step has one shape for the whole batch; ``pads [B]`` says how many
leading slots of each row are padding. A row's token in slot ``t`` sits at position ``t - pads[b]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.engine.shape import ModelShape


class StaticCache:
    """``layer_slots``: layers that hold fewer slots than ``slots`` (a policy that evicts into a compact buffer,
    ``lethe``). ``head_order``: per layer, the model's KV head each cache head holds (position j holds head
    ``head_order[l][j]``), or ``None`` for the model's own order. A policy that stores a layer's heads in
    another order (``lychee`` keeps retrieval heads first) gives its order here, so that every decoder reading
    a shared cache sees the same model state."""

    def __init__(self, shape: ModelShape, batch: int, slots: int, device: Any, dtype: torch.dtype,
                 head_order: list[torch.Tensor] | None = None, layer_slots: dict[int, int] | None = None) -> None:
        self.shape, self.batch, self.slots = shape, batch, int(slots)
        sizes = [min(int((layer_slots or {}).get(i, slots)), self.slots) for i in range(shape.layers)]
        self.k = [torch.zeros(batch, shape.kv_heads, n, shape.head_dim, device=device, dtype=dtype) for n in sizes]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.pads = torch.zeros(batch, dtype=torch.long, device=device)
        self.head_order = head_order_of(head_order, shape)

    @property
    def min_slots(self) -> int:
        """Slots of the smallest layer (a policy that keeps a layer's tokens compact may hold fewer)."""
        return min(k.shape[2] for k in self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_needed(shape: ModelShape, batch: int, slots: int, element: int = 2) -> int:
        return 2 * element * batch * shape.kv_heads * shape.head_dim * slots * shape.layers

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


def head_order_of(orders: list[torch.Tensor] | None, shape: ModelShape) -> list[torch.Tensor] | None:
    """``orders`` as CPU long tensors, checked; ``None`` when every layer keeps the model's order."""
    if orders is None:
        return None
    orders = [torch.as_tensor(o).long().cpu() for o in orders]
    identity = torch.arange(shape.kv_heads)
    if len(orders) != shape.layers or any(not torch.equal(o.sort().values, identity) for o in orders):
        raise ValueError(f"head_order needs one permutation of the {shape.kv_heads} KV heads per layer "
                         f"({shape.layers} layers)")
    return None if all(torch.equal(o, identity) for o in orders) else orders


def same_order(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class KeySpan:
    """The slots a row may read this step: ``first[b] .. last`` (left padding before, unwritten slots after;
    a sliding window moves ``first`` up). The GPU kernels take the two bounds instead of a mask."""

    first: torch.Tensor  # [B] long
    last: torch.Tensor  # [] long: the new token's slot

    def as_mask(self, slots: int) -> torch.Tensor:
        """``[B, slots]`` bool, True on the readable slots (what the reference kernels take)."""
        ids = torch.arange(slots, device=self.last.device)
        return (ids[None, :] >= self.first[:, None]) & (ids[None, :] <= self.last)
