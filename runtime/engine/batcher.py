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
                                 sampler=self.sampler, stopper=self.stopper, row_lengths=True)
        s.min_context = self.dec.min_context  # the crossover the decoder took, when None
        self.graphs = w.device.type == "cuda"
        if self.graphs:
            self.dec.capture()
        n = s.check_every
        self.tokens = torch.zeros(n, self.rows, dtype=torch.long, device=w.device)  # per step of a run
        self.emitted = torch.zeros(n, self.rows, dtype=torch.bool, device=w.device)
        self.live: dict[int, Any] = {}  # row -> the request in it
        s.kv_bytes = self.dec.cache.nbytes

    # -- admission -----------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        s = self.sched
        while len(self.live) < self.rows:
            with s._lock:
                if not s._waiting:
                    return
                live = s._waiting.popleft()
                if live.cancelled:
                    s._finish(live, "cancelled")
                    continue
                s._running[live.id] = live
            row = next(r for r in range(self.rows) if r not in self.live)
            self._start(row, live)

    def _start(self, row: int, live: Any) -> None:
        """Prefill ``live``'s prompt alone into ``row``'s memory and set the row's books; its first token goes out."""
        s, r = self.sched, live.request
        prompt = list(r.prompt)
        start = time.perf_counter()
        pre = StaticDecoder(s.weights, s.policy, 1, s.max_context, cache=self.dec.cache.row(row), min_context=0,
                            kernels=s.kernels, sampler=Sampler(r.sampling, s.weights.device), compile=False)
        pre.prefill(torch.tensor([prompt], dtype=torch.long, device=s.weights.device))
        first = int(pre.tokens[0])  # one sync per admitted request
        s.prefill_s += time.perf_counter() - start
        s.prefill_tokens += len(prompt)
        c = self.dec.cache
        c.length[row], c.pads[row] = len(prompt), 0
        self.dec.row_filled(row)
        self.dec.tokens[row] = first
        self.sampler.set_row(row, r.sampling, 1)
        eos = [] if r.ignore_eos else s.eos
        done = self.stopper.set_row(row, r.max_new_tokens, eos, first)
        self.live[row] = live
        s.generated += 1
        if not self._deliver(row, [first], done):
            self.stopper.finished[row] = True

    # -- one run of steps ------------------------------------------------------------------------------------------
    def advance(self) -> None:
        s = self.sched
        self._admit()
        if not self.live:
            return
        n = s.check_every
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
        self.sampler.free_row(row)
        # an idle row reads one slot, not its last request's context, until a request joins it
        self.dec.cache.length[row], self.dec.cache.pads[row] = 0, 0
        with s._lock:
            s._running.pop(live.id, None)
        return False
