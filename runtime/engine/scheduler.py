"""Serving many requests on one engine: a scheduler over a fixed number of row slots (continuous batching).

A :class:`Scheduler` owns one :class:`~rolecall.runtime.engine.decoder.StaticDecoder` of ``slots`` rows and a thread that
drives it. :meth:`Scheduler.submit` checks a :class:`Request` at once (a bad one raises :class:`RequestError`,
naming the field, before any work) and queues it; the thread admits waiting requests into free rows at step
boundaries (each after its own prefill, into its own row, which keeps its own length and positions), steps every
live row together, and frees a row when its request ends (EOS, a stop string, ``max_new_tokens``, or
:meth:`Scheduler.cancel`). Each request's ``emit`` callback receives :class:`Event` objects in order, from the
scheduler's thread: new token ids and their text as they come, then one event with ``finish_reason`` set.

The callback must not block (the HTTP server hands events to its event loop with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolecall.runtime.engine.sampling import Sampling
from rolecall.runtime.engine.text import TokenText
from rolecall.runtime.memory import pages


class RequestError(ValueError):
    """A request the scheduler refuses before any work: ``field`` names the offending request field, the message
    says the value, the limit and the fix in one line."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SchedulerClosed(RuntimeError):
    """The scheduler drains or has stopped: it takes no new request."""


@dataclass(frozen=True)
class Request:
    """One generation request: ``prompt`` token ids (at least one), at most ``max_new_tokens`` new tokens,
    ``sampling`` (greedy by default; per request: temperature, top-k, top-p, seed), ``stop`` strings (the
    answer ends after the first one, which is kept), and ``ignore_eos`` (run to ``max_new_tokens``: load
    benchmarks)."""

    prompt: tuple[int, ...] | list[int]
    max_new_tokens: int = 16
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class Event:
    """What a request's ``emit`` receives: ``token_ids`` and ``text`` new since the previous event; the last event
    has ``finish_reason`` (``"stop"``: EOS or a stop string, ``"length"``: ``max_new_tokens``, ``"cancelled"``,
    ``"error"`` with ``error`` saying why in one line). ``prompt_tokens`` and ``completion_tokens`` count the
    request's tokens so far; ``first_token_s`` is the time from submission to the first token."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_s: float | None = None
    error: str | None = None


@dataclass
class _Live:
    """A request in the scheduler's hands."""

    id: int
    request: Request
    emit: Callable[[Event], None]
    submitted: float
    tokens: list[int] = field(default_factory=list)
    text: Any = None  # its TokenText, with a tokenizer
    first_token_s: float | None = None
    cancelled: bool = False


class Scheduler:
    """Continuous batching over ``slots`` rows of one engine decoder (see the module's docstring).

    ``weights``: the engine's weights; ``policy``: a bound policy with a static step; ``max_context``: the most
    tokens (prompt + new) one request may hold, default the weights' RoPE positions; ``tokenizer``: for text
    and stop strings (without one, events carry ids only and ``stop`` is refused); ``eos_token_id``: an id or
    ids that end a request. ``kernels`` as :class:`~rolecall.runtime.engine.decoder.StaticDecoder`'s. ``min_context``: a
    sparse policy's step runs only once the longest live request holds this many tokens; below it every row takes
    the full step (faster there: the sparse step's selection costs more than the reads it saves). Default: the
    measured crossover for the policy at ``slots`` rows (:func:`rolecall.runtime.engine.default_min_context`); 0: always
    the policy's step.

    KV by the page: where the policy's step reads the cache through block tables (``reads_pages``: every policy but
    lethe) the rows share a pool of ``kv_pages`` 16-token pages (one the null page; default: as many
    as ``slots`` rows of ``max_context`` tokens take, plus it), and ``slots`` is the step's row capacity, not a
    reservation. A request is admitted while a row and the pages of its prompt and of the next run of steps are free;
    before each run every live row is given the pages that run writes, and when the pool runs out the latest request
    that runs is preempted (its KV copied to host memory, its pages and row freed; it waits at the head of the queue
    and takes its KV back into new pages when they are free: its client sees only latency, and its tokens are those
    of an uninterrupted run under any policy, a sampled one's draws continuing from its seed). Pages return on
    finish, cancel, error and disconnect. A request that could never fit the pool is refused at once.
    ``paged=False`` keeps a contiguous cache of ``slots`` × ``max_context`` for any policy (lethe always has one)."""

    def __init__(self, weights: Any, policy: Any, *, slots: int = 8, max_context: int | None = None,
                 tokenizer: Any = None, eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
                 kernels: str = "auto", check_every: int = 8, min_context: int | None = None,
                 kv_pages: int | None = None, paged: bool | None = None) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer ≥ 1, got {slots!r}")
        most = weights.max_positions
        max_context = most if max_context is None else int(max_context)
        if not 2 <= max_context <= most:
            raise ValueError(f"max_context {max_context} must be in [2, {most}] (the model's RoPE positions)")
        from rolecall.runtime.engine.decoder import reads_pages, rows_refusal, static_step_of

        step = static_step_of(policy, weights.shape)
        why = rows_refusal(step)
        if why:
            raise NotImplementedError(f"policy {policy.name!r} cannot serve yet: {why}")
        paged = reads_pages(step) if paged is None else bool(paged and reads_pages(step))
        if kv_pages is not None and (not isinstance(kv_pages, int) or isinstance(kv_pages, bool) or kv_pages < 2):
            raise ValueError(f"kv_pages must be an integer ≥ 2 (one is the null page), got {kv_pages!r}")
        self.kv_pages = (kv_pages or slots * pages(max_context) + 1) if paged else None
        self.weights, self.policy, self.slots, self.max_context = weights, policy, slots, max_context
        self.tokenizer, self.pad_token_id, self.kernels = tokenizer, int(pad_token_id), kernels
        self.eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self.check_every = check_every
        if min_context is not None and (not isinstance(min_context, int) or isinstance(min_context, bool)
                                        or min_context < 0):
            raise ValueError(f"min_context must be an integer ≥ 0, got {min_context!r}; 0 always runs the policy's "
                             "step, None takes the measured crossover")
        self.min_context = min_context
        self._ids = itertools.count(1)
        self._waiting: deque[_Live] = deque()
        self._running: dict[int, _Live] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._draining = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.generated = 0  # tokens generated since start
        self.preemptions = 0  # requests preempted for pages since start
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens) per engine call, for tokens/s
        self.kv_bytes = 0
        # where the engine's time goes: prefills of admitted requests (each alone, between runs of steps) and runs
        # of decode steps (from the first step's launch to the tokens read back)
        self.prefill_s, self.prefill_tokens, self.decode_s, self.decode_steps = 0.0, 0, 0.0, 0
        self.failure: str | None = None
        self.engine: Any = None  # the Batcher, once the scheduler's thread built it

    # -- the client side -----------------------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Raise :class:`RequestError` for a request this scheduler cannot run (before any work)."""
        from rolecall.runtime.prompts import PromptError, check_max_new_tokens, check_prompts

        try:
            check_max_new_tokens(request.max_new_tokens, "max_tokens")
        except PromptError as e:
            raise RequestError("max_tokens", str(e)) from None
        try:  # the one prompt check of the commands and the Python API, in this server's words
            check_prompts([list(request.prompt)], vocab_size=self.weights.shape.vocab,
                          max_new_tokens=request.max_new_tokens, context=self.max_context, opt_in=None,
                          row_names=["the prompt"], new_name="max_tokens", fix="shorten the prompt or lower max_tokens",
                          limit_name="this server's context of {limit}")
        except ValueError as e:
            raise RequestError("prompt", " ".join(str(e).split())) from None
        need = len(request.prompt) + request.max_new_tokens - 1  # the last token is never written
        if self.kv_pages is not None and pages(need) > self.kv_pages - 1:
            raise RequestError("prompt", f"the request needs {need:,} tokens of KV ({pages(need):,} pages of 16) and "
                               f"this server's pool holds {self.kv_pages - 1:,} pages ({16 * (self.kv_pages - 1):,} "
                               "tokens); shorten the prompt or lower max_tokens")
        if request.stop and self.tokenizer is None:
            raise RequestError("stop", "stop strings need a tokenizer, and this server has none")
        if not isinstance(request.sampling, Sampling):
            raise RequestError("sampling", "sampling must be a rolecall.runtime.engine.Sampling")

    def submit(self, request: Request, emit: Callable[[Event], None]) -> int:
        """Check ``request`` (:class:`RequestError` if bad, :class:`SchedulerClosed` while draining) and queue it;
        returns its id (for :meth:`cancel`). Starts the scheduler's thread on first use."""
        self.check(request)
        with self._lock:
            if self._draining or self._stopped:
                raise SchedulerClosed("the server is shutting down and takes no new requests")
            live = _Live(next(self._ids), request, emit, time.perf_counter(),
                         text=None if self.tokenizer is None else TokenText(self.tokenizer, request.stop))
            self._waiting.append(live)
        self.start()
        self._wake.set()
        return live.id

    def cancel(self, request_id: int) -> None:
        """End a request early (its client went away); its row is freed at the next step boundary."""
        with self._lock:
            for live in list(self._waiting) + list(self._running.values()):
                if live.id == request_id:
                    live.cancelled = True
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        """``running``, ``waiting`` requests, ``slots`` and ``slots_in_use``, ``kv_bytes`` held by the cache,
        ``kv_pages_total`` (the 16-token pages of :mod:`rolecall.runtime.memory` of the pool, or those the rows
        reserve, ``slots`` × ``max_context``, with a contiguous cache) and ``kv_pages_used`` (the pages the running
        requests hold; with a contiguous cache those their tokens fill, prompt and answer), ``preemptions``,
        ``generated_tokens`` since start and ``tokens_per_s`` over the last engine calls; the engine's seconds in
        prefills (``prefill_seconds``, of ``prefill_tokens``) and in decode steps (``decode_seconds``, of
        ``decode_steps``, each step of every live row together): their ratio over an interval is the step's time
        there, apart from the prefills that ran between steps."""
        with self._lock:
            running, waiting = len(self._running), len(self._waiting)
            used = sum(pages(len(live.request.prompt) + len(live.tokens)) for live in self._running.values())
        pool = getattr(self.engine, "tables", None)
        total = self.slots * pages(self.max_context) if self.kv_pages is None else self.kv_pages - 1
        if pool is not None:
            used = pool.pool.used  # the pages the running requests hold
        rate = 0.0
        if len(self._rate) >= 2:
            (t0, _), (t1, _) = self._rate[0], self._rate[-1]
            rate = sum(n for _, n in list(self._rate)[1:]) / max(t1 - t0, 1e-9)
        return {"running": running, "waiting": waiting, "slots": self.slots, "slots_in_use": running,
                "kv_bytes": self.kv_bytes, "kv_pages_total": total, "kv_pages_used": used,
                "preemptions": self.preemptions, "generated_tokens": self.generated, "tokens_per_s": rate,
                "prefill_seconds": self.prefill_s, "prefill_tokens": self.prefill_tokens,
                "decode_seconds": self.decode_s, "decode_steps": self.decode_steps}

    # -- lifetime --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._serve, name="rolecall-scheduler", daemon=True)
                self._thread.start()

    def drain(self, timeout: float | None = None) -> bool:
        """Take no new request, finish the ones queued and running, then stop; True when all finished in time."""
        with self._lock:
            self._draining = True
        self._wake.set()
        done = self._thread is None or (self._thread.join(timeout) or not self._thread.is_alive())
        self.close()
        return done

    def close(self) -> None:
        """Stop now: requests not finished end with ``finish_reason="cancelled"``."""
        with self._lock:
            self._stopped = True
            self._draining = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            left = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
        for live in left:
            self._finish(live, "cancelled")

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the scheduler's thread ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            from rolecall.runtime.engine.batcher import Batcher

            engine = self.engine = Batcher(self)
            while True:
                with self._lock:
                    idle = not self._waiting and not self._running
                    if self._stopped or (idle and self._draining):
                        return
                if idle:
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                engine.advance()
        except Exception as e:  # noqa: BLE001 - the engine failed: every request learns why, the process lives
            self.failure = f"{type(e).__name__}: {e}"
            print(f"rolecall: the engine stopped: {self.failure}", file=sys.stderr)
            if self.engine is not None:
                self.engine.release_all()
            with self._lock:
                left = list(self._waiting) + list(self._running.values())
                self._waiting.clear()
                self._running.clear()
                self._stopped = True
            for live in left:
                self._finish(live, "error", self.failure)

    def _deliver(self, live: _Live, new: list[int], finish: str | None) -> str | None:
        """Hand ``live`` its ``new`` tokens and their text; a stop string in the text ends the request there (the
        tokens after the one that completes it are dropped). Returns why the request ended (``finish``, or
        ``"stop"`` for a stop string), None while it runs."""
        if new and live.first_token_s is None:
            live.first_token_s = time.perf_counter() - live.submitted
        text = ""
        if live.text is not None:
            text = live.text.add(new, final=finish is not None)
            cut = live.text.stop_cut()
            if cut is not None:  # the text through the stop string, less what went out before
                sent = len(live.text.text) - len(text)
                new, text, finish = new[:max(0, cut - len(live.tokens))], live.text.stop_text()[sent:], "stop"
        live.tokens.extend(new)
        if new or finish is not None:
            self._emit(live, Event(new, text, finish, len(live.request.prompt), len(live.tokens),
                                   live.first_token_s))
        return finish

    def _finish(self, live: _Live, reason: str, error: str | None = None) -> None:
        self._emit(live, Event([], "", reason, len(live.request.prompt), len(live.tokens), live.first_token_s, error))

    @staticmethod
    def _emit(live: _Live, event: Event) -> None:
        try:
            live.emit(event)
        except Exception as e:  # noqa: BLE001 - a client's callback must not stop the engine
            print(f"rolecall: a request's callback failed ({type(e).__name__}: {e}); it is cancelled", file=sys.stderr)
            live.cancelled = True


__all__ = ["Event", "Request", "RequestError", "Scheduler", "SchedulerClosed"]
