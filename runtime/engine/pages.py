"""KV pages: a pool of fixed-size pages and the page lists (block tables) of the requests that hold them.

A page holds :data:`~rolecall.runtime.memory.PAGE_TOKENS` (16) consecutive tokens of one request, in every layer
at once: page ``p`` of layer ``l`` is row ``p`` of that layer's ``[pages, Hkv, 16, D]`` tensors, so one table per
request serves every layer (a layer that holds fewer tokens, a sliding window or Lethe's kept set, is a
different table over the same pool). The page is the page DELTA and Quest select: a selected page *is* a KV
page, found through the table.

:class:`PagePool` owns the pages: a free list and a reference count per page (a page shared by two requests,
a cached prefix, is freed when the last lets it go). Page 0 is the null page: never handed out, it pads the
fixed-width tables a captured step reads, so a padded entry points at memory that exists.

:class:`PageTables` hands pages to requests. ``reserve(request, tokens)`` makes a request hold ``tokens`` tokens,
all or nothing: when the pool has too few free pages nothing changes and it returns False, so the scheduler
can preempt (the most recently admitted request first: :meth:`PageTables.youngest`) and try again.
``release(request)`` returns a request's pages on finish, cancel, error or disconnect. ``table(requests, width)``
is the ``[rows, width]`` int32 tensor a step reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from rolecall.runtime.memory import pages

NULL_PAGE = 0


class PagePool:
    """``num_pages`` pages, page 0 the null page: ``num_pages - 1`` can be handed out."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is the null page), got {num_pages!r}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._refs = [0] * num_pages

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - self.free

    def take(self, n: int) -> list[int]:
        """``n`` free pages, each now referenced once; ``MemoryError`` (and nothing taken) if fewer are free."""
        if n > len(self._free):
            raise MemoryError(f"{n} pages asked for, {len(self._free)} free of {self.capacity}")
        taken = [self._free.popleft() for _ in range(n)]
        for p in taken:
            self._refs[p] = 1
        return taken

    def share(self, page: int) -> None:
        """One more holder of ``page`` (already held)."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is free: only a held page can be shared")
        self._refs[page] += 1

    def give_back(self, held: Sequence[int]) -> None:
        """One holder fewer for each page of ``held``; a page no one holds goes back to the free list."""
        for p in held:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is already free")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refs(self, page: int) -> int:
        return self._refs[page]


class PageTables:
    """The pages each request holds, in token order, over one :class:`PagePool`."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._held: dict[Hashable, list[int]] = {}  # insertion order = admission order

    def __contains__(self, request: Hashable) -> bool:
        return request in self._held

    def pages_of(self, request: Hashable) -> list[int]:
        return list(self._held.get(request, ()))

    def count(self, request: Hashable) -> int:
        """Pages ``request`` holds (no copy of the list: the scheduler asks for every live row before each run)."""
        return len(self._held.get(request, ()))

    def fits(self, tokens: int) -> bool:
        """Whether a new request of ``tokens`` tokens could be given its pages now."""
        return pages(tokens) <= self.pool.free

    def reserve(self, request: Hashable, tokens: int) -> bool:
        """Make ``request`` hold at least ``tokens`` tokens (a new request is admitted by this): True when it does,
        False, with nothing changed, when the pool has too few free pages."""
        held = self._held.get(request, [])
        more = pages(tokens) - len(held)
        if more > self.pool.free:
            return False
        if more > 0:
            self._held.setdefault(request, []).extend(self.pool.take(more))
        elif request not in self._held:
            self._held[request] = held
        return True

    def release(self, request: Hashable) -> int:
        """Give back every page ``request`` holds (none if it holds none); returns how many it held."""
        held = self._held.pop(request, [])
        self.pool.give_back(held)
        return len(held)

    def youngest(self) -> Hashable | None:
        """The most recently admitted request holding pages: the one to preempt first."""
        return next(reversed(self._held), None)

    def table(self, requests: Sequence[Hashable | None], width: int, device: Any = "cpu") -> torch.Tensor:
        """``[len(requests), width]`` int32: each request's pages in token order, padded with the null page; a
        ``None`` row (a free row of the step) is all null. A request holding more than ``width`` pages is refused
        (``ValueError``): the step's width bounds one request's context."""
        out = torch.full((len(requests), width), NULL_PAGE, dtype=torch.int32)
        for row, request in enumerate(requests):
            held = self._held.get(request, []) if request is not None else []
            if len(held) > width:
                raise ValueError(f"request {request!r} holds {len(held)} pages, more than the table's {width}")
            out[row, :len(held)] = torch.tensor(held, dtype=torch.int32)
        return out.to(device)


__all__ = ["NULL_PAGE", "PagePool", "PageTables"]
