"""The scheduler's engine side: continuous batching over the row slots of one decoder.

One :class:`~rolecall.runtime.engine.decoder.StaticDecoder` of ``slots`` rows, each row keeping its own length (no left
padding: a request's pages start at its first token wherever it joins), its own sampling settings
(:class:`~rolecall.runtime.engine.sampling.RowSampler`) and its own token limit and EOS ids (:class:`RowStopper`). The
step is captured once, over idle rows, and replayed for the process's lifetime: one compilation per scheduler and
one capture per kind of step (the policy's, its full fallback) and sampler mode (greedy while no row samples),
whatever the requests. Between runs of ``check_every`` steps the host admits waiting requests into
free rows (each prefilled alone into its row's memory, :meth:`StaticCache.row`), reads the tokens of the steps
run (one sync), hands them to their requests, cuts rows at stop strings and frees the rows that finished.

A policy's step runs on such rows when it keeps nothing across steps that assumes one length for all rows
(``row_lengths`` on its step: every policy of :mod:`rolecall.runtime.policies`; quest's and refining delta's page
bounds and lethe's held slots and scores are kept per row and built for a row when it takes a new request,
:meth:`StaticDecoder.row_filled`); the scheduler refuses another in one line.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rolecall.runtime.engine.decoder import StaticDecoder
from rolecall.runtime.engine.pages import NULL_PAGE, PagePool, PageTables
from rolecall.runtime.engine.sampling import RowSampler, Sampler


class RowStopper:
    """Device-side books of the scheduler's rows, called inside the step with the chosen tokens ``[B]``: a row
    finishes on one of its EOS ids or at its limit, and idle or finished rows emit padding. ``emitted [B]``
    says which rows produced a token this step; :meth:`running` which rows advance."""

    def __init__(self, rows: int, eos_width: int, pad: int, device: Any) -> None:
        self.limits = torch.zeros(rows, dtype=torch.long, device=device)
        self.count = torch.zeros(rows, dtype=torch.long, device=device)
        self.finished = torch.ones(rows, dtype=torch.bool, device=device)  # idle rows count as finished
        self.emitted = torch.zeros(rows, dtype=torch.bool, device=device)
        self.eos = torch.full((rows, max(eos_width, 1)), -1, dtype=torch.long, device=device)
        self.pad = pad

    def state(self) -> list[torch.Tensor]:
        return [self.count, self.finished, self.emitted]

    def running(self) -> torch.Tensor:
        """``[B]`` long: 1 for the rows still decoding."""
        return (~self.finished).long()

    def set_row(self, row: int, limit: int, eos: list[int], first: int) -> bool:
        """Row ``row`` starts a request of at most ``limit`` tokens whose first (the prefill's) is ``first``;
        returns whether that already finished it."""
        ids = (list(eos) + [-1] * self.eos.shape[1])[:self.eos.shape[1]]
        done = first in eos or limit <= 1
        self.eos[row] = torch.tensor(ids, dtype=torch.long)
        self.limits[row], self.count[row], self.finished[row] = limit, 1, done
        return done

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        running = ~self.finished
        token = torch.where(running, token, self.pad)
        self.count.add_(running.long())
        ended = (token[:, None] == self.eos).any(-1) | (self.count >= self.limits)
        self.finished |= running & ended
        self.emitted.copy_(running)
        return token


class Batcher:
    """Drives the scheduler's decoder: :meth:`advance` admits, steps ``check_every`` times, and delivers."""

    def __init__(self, sched: Any) -> None:
        s = self.sched = sched
        w = s.weights
        self.rows = s.slots
        self.stopper = RowStopper(self.rows, len(s.eos), s.pad_token_id, w.device)
        self.sampler = RowSampler(self.rows, w.device)
        # below min_context (of the longest live request: position, set before each run) the full step runs
        self.dec = StaticDecoder(w, s.policy, self.rows, s.max_context, min_context=s.min_context, kernels=s.kernels,
                                 sampler=self.sampler, stopper=self.stopper, row_lengths=True, pages=s.kv_pages)
        # the pages each request holds, over the cache's pool (None: a contiguous cache, every row its context)
        self.tables = PageTables(PagePool(s.kv_pages)) if s.kv_pages is not None else None
        self.swapped: dict[int, Any] = {}  # a preempted request's id -> its KV, in host memory
        s.min_context = self.dec.min_context  # the crossover the decoder took, when None
        self.graphs = w.device.type == "cuda"
        if self.graphs:
            self.dec.capture()
        n = s.check_every
        self.tokens = torch.zeros(n, self.rows, dtype=torch.long, device=w.device)  # per step of a run
        self.emitted = torch.zeros(n, self.rows, dtype=torch.bool, device=w.device)
        self.live: dict[int, Any] = {}  # row -> the request in it
        s.kv_bytes = self.dec.cache.nbytes

    # -- pages ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _written(live: Any, steps: int = 0) -> int:
        """Tokens ``live`` has in the cache after ``steps`` more steps: its prompt and every token but the last
        (the next step's input), at most all but its last possible one."""
        r = live.request
        return min(len(r.prompt) + max(len(live.tokens) - 1, 0) + steps, len(r.prompt) + r.max_new_tokens - 1)

    def _hold(self, row: int, live: Any, tokens: int) -> bool:
        """Make ``live`` (in ``row``) hold the pages of ``tokens`` tokens, its table row updated; False when the
        pool has too few free pages (nothing changed)."""
        held = self.tables.count(live.id)
        if not self.tables.reserve(live.id, tokens):
            return False
        if self.tables.count(live.id) != held:
            table = self.dec.cache.table
            table[row].copy_(self.tables.table([live.id], table.shape[1])[0])
        return True

    def _grow(self, steps: int) -> None:
        """Every live row holds the pages the next ``steps`` steps write, the earliest requests first; where the
        pool runs out, the latest request that runs is preempted (:meth:`_preempt`), until it does or is itself."""
        for row, live in sorted(self.live.items(), key=lambda item: item[1].id):
            while row in self.live and not self._hold(row, live, self._written(live, steps)):
                self._preempt(max(self.live, key=lambda r: self.live[r].id))

    def _preempt(self, row: int) -> None:
        """Free ``row`` and its request's pages, its KV copied to host memory first; the request waits at the head of
        the queue and takes them back (:meth:`_start`) when pages are free again."""
        s, live = self.sched, self.live.pop(row)
        self.swapped[live.id] = self.dec.cache.take_out(row, self.tables.pages_of(live.id))
        self._free(row, live)
        with s._lock:
            s._running.pop(live.id, None)
            s._waiting.appendleft(live)
        s.preemptions += 1

    def _free(self, row: int, live: Any) -> None:
        """``row`` is idle: its request's pages go back to the pool, its table row to the null page, and it reads
        one slot, not its last request's context, until a request joins it."""
        self.sampler.free_row(row)
        self.stopper.finished[row] = True
        c = self.dec.cache
        c.length[row], c.pads[row] = 0, 0
        if self.tables is not None:
            self.tables.release(live.id)
            c.table[row].fill_(NULL_PAGE)

    def release_all(self) -> None:
        """Every page back to the pool (the engine stopped: no request runs on)."""
        for row, live in list(self.live.items()):
            del self.live[row]
            if self.tables is not None:
                self.tables.release(live.id)

    # -- admission -----------------------------------------------------------------------------------------------
    def _admit(self, steps: int) -> None:
        """Waiting requests into free rows, in order, while the pool holds each one's prompt and the next ``steps``
        steps (a request that does not fit waits, and those behind it with it)."""
        s = self.sched
        while len(self.live) < self.rows:
            with s._lock:
                if not s._waiting:
                    return
                live = s._waiting[0]
                if not live.cancelled and self.tables is not None and \
                        not self.tables.fits(self._written(live, steps)):
                    return
                s._waiting.popleft()
                if live.cancelled:
                    self.swapped.pop(live.id, None)
                    s._finish(live, "cancelled")
                    continue
                s._running[live.id] = live
            row = next(r for r in range(self.rows) if r not in self.live)
            if self.tables is not None and not self._hold(row, live, self._written(live, steps)):
                raise RuntimeError("the pages that were free at admission were gone")  # nothing else takes them
            self._start(row, live)

    def _start(self, row: int, live: Any) -> None:
        """Prefill ``live``'s prompt alone into ``row``'s memory and set the row's books; its first token goes out.
        A preempted request takes back its KV instead (the same bytes, into its new pages), and its last token is
        the row's next input, as if it had never stopped: under any policy its tokens are an uninterrupted run's
        (recomputing them by a prefill would not be: a sparse policy's decode steps wrote KV that a dense pass
        does not)."""
        s, r = self.sched, live.request
        done_before = len(live.tokens)
        written = len(r.prompt) + max(done_before - 1, 0)
        c = self.dec.cache
        if done_before:
            c.put_back(row, self.tables.pages_of(live.id), self.swapped.pop(live.id))
            first = live.tokens[-1]
        else:
            start = time.perf_counter()
            pre = StaticDecoder(s.weights, s.policy, 1, s.max_context, cache=c.row(row), min_context=0,
                                kernels=s.kernels, sampler=Sampler(r.sampling, s.weights.device), compile=False)
            pre.prefill(torch.tensor([list(r.prompt)], dtype=torch.long, device=s.weights.device))
            first = int(pre.tokens[0])  # one sync per admitted request
            s.prefill_s += time.perf_counter() - start
            s.prefill_tokens += written
        c.length[row], c.pads[row] = written, 0
        self.dec.row_filled(row)
        self.dec.tokens[row] = first
        self.sampler.set_row(row, r.sampling, max(done_before, 1))
        eos = [] if r.ignore_eos else s.eos
        done = self.stopper.set_row(row, r.max_new_tokens - max(done_before - 1, 0), eos, first)
        self.live[row] = live
        if done_before:  # its tokens went out before it was preempted
            return
        s.generated += 1
        if not self._deliver(row, [first], done):
            self.stopper.finished[row] = True

    # -- one run of steps ------------------------------------------------------------------------------------------
    def advance(self) -> None:
        s = self.sched
        n = s.check_every
        if self.tables is not None:
            self._grow(n)  # the live rows' pages for this run first: an admission takes only what is left
        self._admit(n)
        if not self.live:
            return
        # the full-step fallback's one length: the longest live request's tokens in the cache (its prompt and all
        # its tokens but the last, which the next step writes), as the decoder's position counts them for a request
        # alone; the rows keep their own lengths on the device
        self.dec.position = max(len(live.request.prompt) + len(live.tokens) - 1 for live in self.live.values())
        start = time.perf_counter()
        for i in range(n):
            self.dec.step()
            self.tokens[i].copy_(self.dec.tokens)
            self.emitted[i].copy_(self.stopper.emitted)
        tokens, emitted = self.tokens.cpu().tolist(), self.emitted.cpu().tolist()  # the one sync of a run
        finished = self.stopper.finished.cpu().tolist()
        s.decode_s += time.perf_counter() - start
        s.decode_steps += n
        made = 0
        for row in list(self.live):
            new = [tokens[i][row] for i in range(n) if emitted[i][row]]
            made += len(new)
            if not self._deliver(row, new, finished[row]):
                self.stopper.finished[row] = True
        s.generated += made
        s._rate.append((time.perf_counter(), made))

    def _deliver(self, row: int, new: list[int], finished: bool) -> bool:
        """Hand ``row``'s new tokens to its request; end it on a stop string, cancellation or when ``finished``
        (then its row is free). Returns whether the row still runs."""
        s, live = self.sched, self.live[row]
        r = live.request
        reason = None
        if finished:
            last = (new or live.tokens)[-1:]
            reason = "stop" if last and not r.ignore_eos and last[0] in s.eos else "length"
        elif live.cancelled:
            reason = "cancelled"
        if s._deliver(live, new, reason) is None:
            return True
        del self.live[row]
        self._free(row, live)
        with s._lock:
            s._running.pop(live.id, None)
        return False
