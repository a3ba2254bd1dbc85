"""The static KV cache: K and V per layer ``[B, Hkv, S, D]``, allocated once, sized to the requests.

Rows of a ragged batch are left-padded, so every row writes its next token into the same slot
(``length``, a device scalar) and a decode step has one shape for the whole batch; ``pads [B]`` says how many
leading slots of each row are padding. A row's token in slot ``t`` sits at position ``t - pads[b]``.

The sliding-window layers of a hybrid model (Gemma 3: five of every six layers) never read a key more than
``window - 1`` positions back, so each holds a ring of ``n + 1`` slots instead (:attr:`StaticCache.rings`), where
``n = min(window, slots)``: a row's position ``p`` goes to slot ``n - 1 - (p mod n)``, each row by its own
position, so a new token overwrites the one that just left its window (a request shorter than the window never
wraps), and the readable slots are always one span ending at slot ``n - 1`` (:func:`ring_span`). Padding goes to
the last slot, which no step reads. At 128K tokens this holds a Gemma 3 model's KV in about a sixth of the
memory, as transformers' own cache does.

A paged cache (``pages=N``, the scheduler's rows) holds each layer that is not a ring as a pool of ``N`` pages of
:data:`~rolecall.runtime.memory.PAGE_TOKENS` tokens, ``[N, Hkv, 16, D]``, shared by every row, and ``table [B, W]``
int32 says which page holds each row's slots ``16 j … 16 j + 15`` (:mod:`rolecall.runtime.engine.pages` hands them
out; page 0 is the null page an idle row's entries point at). A row's slots are the same slots as a contiguous
cache's; the step reads them through the table (:attr:`KeySpan.table`), the prefill through :meth:`read_span` and
:meth:`write_span`, so memory follows the pages requests hold, not rows × slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rolecall.runtime.engine.shape import ModelShape
from rolecall.runtime.kernels.paged_attention.tables import gather_pages
from rolecall.runtime.memory import PAGE_TOKENS
from rolecall.runtime.memory import pages as page_count


class StaticCache:
    """``layer_slots``: layers that hold fewer slots than ``slots`` (a policy that evicts into a compact buffer,
    ``lethe``). ``head_order``: per layer, the model's KV head each cache head holds (position j holds head
    ``head_order[l][j]``), or ``None`` for the model's own order. A policy that stores a layer's heads in
    another order (``lychee`` keeps retrieval heads first) gives its order here, so that every decoder reading
    a shared cache sees the same model state. ``pages``: hold the layers that are not rings as a pool of that many
    16-token pages read through :attr:`table` (see the module's docstring; the scheduler's rows only: each row keeps
    its own length)."""

    def __init__(self, shape: ModelShape, batch: int, slots: int, device: Any, dtype: torch.dtype,
                 head_order: list[torch.Tensor] | None = None, layer_slots: dict[int, int] | None = None,
                 row_lengths: bool = False, pages: int | None = None) -> None:
        self.shape, self.batch, self.slots = shape, batch, int(slots)
        self.rings = ring_lengths(shape, self.slots)  # layer -> n: a ring of n tokens and the padding's slot
        if pages is not None and (layer_slots or not row_lengths):
            raise ValueError("a paged cache holds rows of their own lengths, every slot of every layer that is not a "
                             "ring (no compact layers)")
        self.table = None if pages is None else torch.zeros(batch, page_count(self.slots), dtype=torch.int32,
                                                            device=device)
        sizes = [self.rings[i] + 1 if i in self.rings else min(int((layer_slots or {}).get(i, slots)), self.slots)
                 for i in range(shape.layers)]
        self.k = [torch.zeros(pages, shape.kv_heads, PAGE_TOKENS, shape.head_dim, device=device, dtype=dtype)
                  if pages is not None and i not in self.rings else
                  torch.zeros(batch, shape.kv_heads, n, shape.head_dim, device=device, dtype=dtype)
                  for i, n in enumerate(sizes)]
        self.v = [torch.zeros_like(k) for k in self.k]
        # the next slot each row writes: one for all rows (a left-padded batch), or each row's own (row_lengths:
        # the scheduler's rows, each a request of its own, unpadded)
        self.length = torch.zeros((batch,) if row_lengths else (), dtype=torch.long, device=device)
        self.pads = torch.zeros(batch, dtype=torch.long, device=device)
        self.head_order = head_order_of(head_order, shape)

    @property
    def row_lengths(self) -> bool:
        """Whether each row keeps its own length (``length [B]``) rather than one for all (``length []``)."""
        return self.length.dim() == 1

    @property
    def paged(self) -> bool:
        """Whether the layers that are not rings are pools of pages read through :attr:`table`."""
        return self.table is not None

    def table_of(self, layer: int) -> torch.Tensor | None:
        """The block table ``layer`` is read through: :attr:`table` for a paged layer, None for a ring or a
        contiguous cache."""
        return None if self.table is None or layer in self.rings else self.table

    def row(self, r: int) -> StaticCache:
        """Row ``r`` as a cache of one row over the same memory (a request's own prefill into its row), with a
        length of its own; a paged cache's row shares the pools and reads row ``r`` of the table."""
        view = object.__new__(StaticCache)
        view.shape, view.batch, view.slots, view.rings = self.shape, 1, self.slots, self.rings
        view.table = None if self.table is None else self.table[r:r + 1]
        view.k = [t if view.table_of(i) is not None else t[r:r + 1] for i, t in enumerate(self.k)]
        view.v = [t if view.table_of(i) is not None else t[r:r + 1] for i, t in enumerate(self.v)]
        view.length = torch.zeros((), dtype=torch.long, device=self.length.device)
        view.pads = torch.zeros(1, dtype=torch.long, device=self.length.device)
        view.head_order = self.head_order
        return view

    def read_span(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, Hkv, end, D]`` of slots ``0 … end - 1`` of a layer that is not a ring (views of a contiguous
        cache; gathered through the table from a paged one)."""
        table = self.table_of(layer)
        if table is None:
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        table = table[:, :page_count(end)]
        return gather_pages(self.k[layer], table)[:, :, :end], gather_pages(self.v[layer], table)[:, :, :end]

    def write_span(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v [B, Hkv, m, D]`` into slots ``start … start + m - 1`` of a layer that is not a ring (a paged
        row's pages for those slots must be in its table)."""
        table = self.table_of(layer)
        end = start + k.shape[2]
        if table is None:
            self.k[layer][:, :, start:end] = k
            self.v[layer][:, :, start:end] = v
            return
        slots = torch.arange(start, end, device=table.device)
        page = table.long().index_select(1, slots // PAGE_TOKENS)  # [B, m]
        at = slots % PAGE_TOKENS
        for pool, new in ((self.k[layer], k), (self.v[layer], v)):
            pool[page, :, at[None, :].expand_as(page)] = new.transpose(1, 2).to(pool.dtype)  # [B, m, Hkv, D]

    def take_out(self, row: int, held: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies in host memory of what row ``row`` holds, per layer: its pages ``held`` (in token order) of a paged
        layer, its ring of a sliding one (a request preempted whole, :meth:`put_back` restores it)."""
        at = torch.tensor(held, dtype=torch.long, device=self.length.device)
        return [(k.index_select(0, at).cpu(), v.index_select(0, at).cpu()) if self.table_of(i) is not None else
                (k[row].cpu(), v[row].cpu()) for i, (k, v) in enumerate(zip(self.k, self.v))]

    def put_back(self, row: int, held: list[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Row ``row`` holds again what :meth:`take_out` copied, in the pages ``held`` now (at least as many, in token
        order): the same bytes, so the request goes on as if it had never stopped."""
        for i, (k, v) in enumerate(saved):
            if self.table_of(i) is None:
                self.k[i][row].copy_(k)
                self.v[i][row].copy_(v)
                continue
            at = torch.tensor(held[:k.shape[0]], dtype=torch.long, device=self.length.device)
            self.k[i].index_copy_(0, at, k.to(self.k[i].device))
            self.v[i].index_copy_(0, at, v.to(self.v[i].device))

    @property
    def min_slots(self) -> int:
        """Slots of the smallest layer that is not a ring (a policy that keeps a layer's tokens compact may hold
        fewer; a paged layer holds every slot)."""
        if self.paged:
            return self.slots
        return min(k.shape[2] for i, k in enumerate(self.k) if i not in self.rings)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_needed(shape: ModelShape, batch: int, slots: int, element: int = 2) -> int:
        rings = ring_lengths(shape, slots)
        held = sum(rings[i] + 1 if i in rings else slots for i in range(shape.layers))
        return 2 * element * batch * shape.kv_heads * shape.head_dim * held

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

    def read_ring(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, Hkv, end - start, D]`` of slots ``start .. end - 1`` from ``layer``'s ring (those
        slots' tokens must still be in the window of the last one written)."""
        at = self._ring_index(layer, start, end)
        return self.k[layer].gather(2, at), self.v[layer].gather(2, at)

    def write_ring(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v [B, Hkv, m, D]`` of slots ``start .. start + m - 1`` into ``layer``'s ring: the last
        ``n`` of them, the ones the ring keeps (no two of those share a slot, but padding)."""
        skip = max(0, k.shape[2] - self.rings[layer])
        at = self._ring_index(layer, start + skip, start + k.shape[2])
        self.k[layer].scatter_(2, at, k[:, :, skip:].to(self.k[layer].dtype))
        self.v[layer].scatter_(2, at, v[:, :, skip:].to(self.v[layer].dtype))

    def _ring_index(self, layer: int, start: int, end: int) -> torch.Tensor:
        """``[B, Hkv, end - start, D]``: the ring slot of each row's token in slots ``start .. end - 1``."""
        positions = torch.arange(start, end, device=self.pads.device)[None, :] - self.pads[:, None]
        at = ring_slots(positions, self.rings[layer])
        return at[:, None, :, None].expand(-1, self.shape.kv_heads, -1, self.shape.head_dim)


def ring_lengths(shape: ModelShape, slots: int) -> dict[int, int]:
    """The layers a cache of ``slots`` slots holds as rings, with the tokens each ring holds (its window, or
    ``slots`` if fewer): the sliding-window layers of a hybrid model. A window on every layer (Mistral) is part
    of every layer's mask, where a policy's step runs: those layers keep every slot."""
    return {i: min(int(shape.windows[i]), int(slots)) for i in shape.sliding_layers}


def ring_slots(positions: torch.Tensor, n: int) -> torch.Tensor:
    """The slot of each position (long, any shape) in a ring of ``n`` tokens: ``n - 1 - (p mod n)``, and ``n``
    (the slot no step reads) where ``p < 0`` (padding)."""
    return torch.where(positions >= 0, n - 1 - positions.remainder(n), n)


def ring_span(positions: torch.Tensor, n: int, last: torch.Tensor) -> KeySpan:
    """The readable slots of a ring of ``n`` tokens whose rows have just written positions ``positions [B]``: the
    row's last ``min(p + 1, n)`` tokens, slots ``n - 1 - p`` (at least 0) to ``last`` (``n - 1``, a device
    scalar)."""
    return KeySpan((n - 1 - positions).clamp_min(0), last)


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
    last: torch.Tensor  # [] or [B] long: the new token's slot (each row's, where rows keep their own lengths)
    table: torch.Tensor | None = None  # [B, W] int32: the keys are a pool of pages read through it (a paged cache)

    def slots(self, k: torch.Tensor) -> int:
        """Slots a row of the keys ``k`` holds: ``k``'s third dimension, or the table's pages × 16 for a pool."""
        return k.shape[2] * (self.table.shape[1] if self.table is not None else 1)

    def as_mask(self, slots: int) -> torch.Tensor:
        """``[B, slots]`` bool, True on the readable slots (what the reference kernels take)."""
        ids = torch.arange(slots, device=self.last.device)
        last = self.last[:, None] if self.last.dim() else self.last
        return (ids[None, :] >= self.first[:, None]) & (ids[None, :] <= last)
