"""The static decoder: one decode step over a :class:`StaticCache`, eager or replayed from a CUDA graph.

Weights are plain tensors (:class:`Weights`), the cache is preallocated, the current length is a device
scalar, the new token's K/V are written at that length (with its RoPE: one kernel on the GPU), the next token
is chosen on the device (greedy, or the sampler's choice) and ``length += 1`` happens on the device. No ``.item()``, no host
sync and no shape that changes per step, so the step is captured in a CUDA graph (:meth:`capture`) and
replayed. Attention goes through the policy's static step (``policy.static_step(shape)``, written in the
policy's own file), which calls the attention operations of :mod:`rolecall.runtime.engine.attention`
(``dec.attn``, a :class:`~rolecall.runtime.engine.attention.DecodeAttention`); sliding-window layers of hybrid
models read their window themselves, from a ring of at most ``window + 1`` slots
(:class:`~rolecall.runtime.engine.cache.StaticCache`).
This module is the step runner: the step, its CUDA graphs (capture, replay) and the policy's settling.

A selection layer's choice may run beside the step on a second stream (``DecodeAttention.attend_and_choose``:
DELTA's page scores and top-k), joined where the choice is first read and at the end of the step, so the graph
captures both branches.

Short contexts: a sparse policy reads nothing less than full below its budget and pays for selection, so
below ``min_context`` tokens :meth:`step` runs the full step instead (two graphs over the same buffers; the
host knows the length because it issued every step). The default threshold is the measured crossover for
the policy and batch size (:func:`rolecall.runtime.engine.crossovers.default_min_context`).

A policy whose held state stops growing may settle a few steps after each fill (``steps_to_settle``, then
``settle``: lethe shrinks its prompt-sized buffers to its capacity there); the step's graphs are captured once
it has, over the buffers it keeps.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rolecall.runtime.engine import layers as L
from rolecall.runtime.engine.attention import DecodeAttention
from rolecall.runtime.engine.cache import (
    KeySpan,
    StaticCache,
    head_order_of,
    ring_slots,
    ring_span,
    same_order,
)
from rolecall.runtime.engine.compiling import compiled, compiles_on
from rolecall.runtime.engine.crossovers import default_min_context
from rolecall.runtime.engine.prefill import PrefillGraphs
from rolecall.runtime.engine.prefill import prefill as _prefill
from rolecall.runtime.engine.weights import Weights
from rolecall.runtime.kernels import graphed
from rolecall.runtime.kernels.rope_cache import rope_and_store as naive_rope_and_store
from rolecall.runtime.kernels.skinny_linear import linear

RING_BLOCK = 64  # a ring is read as blocks of this many slots (a gathered set's launch: more, shorter programs)


def static_step_of(policy: Any, shape: Any) -> Any:
    """The policy's static step for ``shape``, or a ``NotImplementedError`` saying why it has none."""
    make = getattr(policy, "static_step", None)
    if make is None:
        raise NotImplementedError(f"policy {policy.name!r} has no static step on the engine yet")
    return make(shape)


def reads_pages(step: Any) -> bool:
    """Whether a policy's static ``step`` reads the cache only through :class:`DecodeAttention`'s calls (so a paged
    cache serves it: the calls read through the span's block table): the step declares ``paged``."""
    return bool(getattr(step, "paged", False))


def rows_refusal(step: Any) -> str | None:
    """Why a policy's static ``step`` cannot run rows of their own lengths (the scheduler's), or None when it can:
    the step declares ``row_lengths`` when it keeps nothing across steps that assumes one length for all rows."""
    if getattr(step, "row_lengths", False):
        return None
    return ("its engine step keeps state that assumes one length for all rows (served: full, delta, lethe, lychee, "
            "quest, vattention)")


class StaticDecoder:
    """``policy``: a bound policy from ``rolecall.runtime.policies`` (``Full()`` when None). ``kernels``: ``"auto"``
    (Triton on CUDA), ``"naive"`` (the PyTorch references) or ``"triton"`` (also on the CPU under
    ``TRITON_INTERPRET=1``). ``cache``: share one cache between decoders (benchmarks). ``sampler``: chooses
    the next token from the logits inside the step (greedy when None); ``stopper``: bookkeeping of finished
    rows inside the step (``rolecall.runtime.engine.generate``). ``compile``: fuse each layer's small ops around its GEMMs
    with ``torch.compile`` (default: on CUDA, unless ``ROLECALL_COMPILE=0``; ``ROLECALL_COMPILE=1`` compiles on
    any device; see :mod:`rolecall.runtime.engine.compiling` for how many times). ``row_lengths``: each row keeps its own
    length, unpadded (the scheduler's rows, :mod:`rolecall.runtime.engine.batcher`); the policy's step must run so
    (``row_lengths`` true) and the stopper says which rows advance (``running()``). ``attn``: the attention
    operations the policy's step calls (:class:`~rolecall.runtime.engine.attention.DecodeAttention`)."""

    def __init__(self, weights: Weights, policy: Any = None, batch: int = 1, max_len: int = 4096, *,
                 cache: StaticCache | None = None, min_context: int | None = None, kernels: str = "auto",
                 sampler: Any = None, stopper: Any = None, compile: bool | None = None,
                 prompt_tokens: int | None = None, row_lengths: bool = False, pages: int | None = None) -> None:
        from rolecall.runtime.policies.full import Full

        self.policy = policy if policy is not None else Full()
        s = weights.shape
        self.static = static_step_of(self.policy, s)
        self.full = Full().static_step(s)
        self._check_step(row_lengths, pages is not None)
        head_order = head_order_of(self.static.head_order, s)
        if max_len > weights.max_positions:
            raise ValueError(f"the cache needs {max_len} positions, the model's RoPE tables hold "
                             f"{weights.max_positions}; ask for fewer tokens")
        self.weights, self.shape, self.batch = weights, s, batch
        device, dtype = weights.device, weights.dtype
        self.owns_cache = cache is None  # a policy may resize only a cache of its own
        self.cache = self._cache(cache, batch, max_len, head_order, prompt_tokens, row_lengths, pages)
        self.max_len = max_len
        # A cache that keeps a layer's KV heads in another order (the policy's head_order) does not reorder the
        # weights: the new token's heads are read in the cache's order (rope_and_store) and every attention call
        # writes its output back in the model's (out_heads), so the decoder shares the session's tensors.
        self.head_maps = [None if o is None or torch.equal(o, torch.arange(s.kv_heads)) else
                          o.to(device=device, dtype=torch.int32) for o in (head_order or [None] * s.layers)]
        self.min_context = self._min_context(min_context, batch)
        # attention calls of the policy's step and of the sliding layers' rings, their kernels chosen here
        self.attn = DecodeAttention(s, batch, dtype, self.cache, kernels, device, self.static.block_sizes,
                                    self.policy.name, row_lengths)
        self.triton = self.attn.triton
        if self.triton:
            from rolecall.runtime.kernels.rope_cache import triton as rope_triton

            self._rope_triton = rope_triton
        prepare = getattr(self.static, "prepare", None)  # a policy's own buffers beside the cache (quest's pages)
        if prepare is not None:
            prepare(self)
        self.sampler, self.stopper = sampler, stopper
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)  # the next step's input
        self.logits = torch.zeros(batch, s.vocab, dtype=dtype, device=device)  # the last step's output
        self.position = 0  # host mirror of cache.length: the host issued every step
        self._last_kind: str | None = None  # "full" or "policy": the step that ran last
        self._settle_at: int | None = None  # the position at which the policy settles (see _after_fill)
        self._capture_when_settled: int | None = None  # capture()'s warm-up, deferred until then
        self.capture_s = 0.0  # seconds spent capturing graphs, a deferred capture included
        self._rope = {kind: (cos[:max_len], L.signed_sin(sin[:max_len])) for kind, (cos, sin) in weights.rope.items()}
        # A hybrid model's sliding layers keep their own attention (as in rolecall.core.models.sliding_layers), over
        # their rings; a window on every layer (Mistral) is part of every layer's mask and the policy still runs.
        # per ring size n: its last readable slot (a device scalar) and the blocks that cover it
        self._ring_reads = {n: (torch.tensor(n - 1, device=device),
                                torch.arange(-(-n // RING_BLOCK), device=device, dtype=torch.int32)[None, None]
                                .expand(batch, s.kv_heads, -1)) for n in set(self.cache.rings.values())}
        self.graphs: dict[tuple[str, Any], Any] = {}  # (kind, the sampler's mode) → its graph
        self.prefill_graphs = PrefillGraphs()  # a short prompt's prefill per width, kept across reset()
        if compile is None:
            compile = compiles_on(device)
        self.compiles = compile  # whether the step's small ops go through torch.compile (policies may too)
        self._post = L.compiled_finish(s) if compile else L.bound_finish(s)

    def _check_step(self, row_lengths: bool, paged: bool) -> None:
        """Refuse (``NotImplementedError``, one line) rows of their own lengths or a paged cache for a policy whose
        step cannot run them."""
        why = rows_refusal(self.static) if row_lengths else None
        if why:
            raise NotImplementedError(f"policy {self.policy.name!r}: {why}")
        if paged and not reads_pages(self.static):
            raise NotImplementedError(f"policy {self.policy.name!r}: its engine step reads the cache's slots itself, "
                                      "not through a block table (paged: every policy but lethe)")

    def _cache(self, cache: StaticCache | None, batch: int, max_len: int, head_order: Any,
               prompt_tokens: int | None, row_lengths: bool, pages: int | None) -> StaticCache:
        """A new cache of ``batch`` rows × ``max_len`` slots (a policy that keeps some layers compact sizes them
        to the prompt and its budget; ``pages``: a pool of that many pages instead), or the shared ``cache``,
        refused where its size or head order differs."""
        if cache is None:
            sizes = getattr(self.static, "cache_slots", None)
            return StaticCache(self.shape, batch, max_len, self.weights.device, self.weights.dtype, head_order,
                               sizes(max_len, prompt_tokens) if sizes is not None else None, row_lengths, pages)
        if cache.paged and not reads_pages(self.static):
            raise NotImplementedError(f"policy {self.policy.name!r}: its engine step reads the cache's slots itself, "
                                      "not through a block table")
        if cache.batch != batch or cache.slots != max_len:
            raise ValueError(f"the shared cache has {cache.batch} rows × {cache.slots} slots, this decoder needs "
                             f"{batch} × {max_len}")
        if not same_order(cache.head_order, head_order):
            raise ValueError("the shared cache keeps its KV heads in another order than this decoder reads them "
                             "(create it with head_order=policy.static_step(shape).head_order)")
        return cache

    def _min_context(self, min_context: int | None, batch: int) -> int:
        """Below this many tokens the full step runs: 0 for a dense policy and for one whose state follows every
        step from the first (``full_fallback`` false: asking for more is refused), else as given or the measured
        crossover (:func:`default_min_context`)."""
        if not getattr(self.static, "full_fallback", True):
            if min_context:
                raise ValueError(f"policy {self.policy.name!r} runs its own step from the first token (its "
                                 f"scores and evictions start there); min_context={min_context} needs 0")
            return 0
        if not self.static.sparse:
            return 0
        return default_min_context(self.policy, batch) if min_context is None else min_context

    # -- host-side control -------------------------------------------------------------------------------------
    def set_length(self, length: int) -> None:
        """Declare the first ``length`` slots valid (after a prefill or filling them by other means); a policy
        whose step keeps state derived from the cache (quest's page bounds) rebuilds it here."""
        self.cache.length.fill_(length)
        self.position = length
        self._after_fill()

    def row_filled(self, row: int) -> None:
        """Row ``row`` of the scheduler's now holds a new request's prompt (its length set in the cache): a policy
        whose step keeps per-row state (quest's and refining delta's page bounds, lethe's held slots and scores)
        builds that row's from its own slots, the other rows' untouched. Below the crossover the full step runs,
        and the first policy step after it rebuilds every row instead."""
        if self._last_kind != "full":
            self._after_fill(row)

    def _after_fill(self, row: int | None = None) -> None:
        """The policy's ``after_fill(dec, row)``: its state derived from the cache, rebuilt for every row (None)
        or for ``row`` alone; then when it settles (``steps_to_settle``: steps from here, None for never)."""
        after_fill = getattr(self.static, "after_fill", None)
        if after_fill is not None:
            after_fill(self, row)
        settle = getattr(self.static, "steps_to_settle", None)
        steps = settle(self) if settle is not None else None
        self._settle_at = None if steps is None else self.position + steps

    def _settle(self) -> None:
        """The policy settles (its buffers may change: graphs over the old ones go), then the deferred capture."""
        self._settle_at = None
        if self.static.settle(self):
            self.graphs.clear()
        warmup, self._capture_when_settled = self._capture_when_settled, None
        if warmup is not None and self.max_len - self.position >= warmup:
            self.capture(warmup)

    @property
    def reusable(self) -> bool:
        """Whether :meth:`reset` readies this decoder for another request: its cache is its own and its policy's
        buffers keep their sizes (lethe's shrink to its budget when it settles, so each request builds anew)."""
        return self.owns_cache and getattr(self.static, "reusable", True)

    def reset(self) -> None:
        """Ready for a new request over the same buffers, so the graphs captured so far replay for it: the cache
        zeroed (as a new decoder's), no length, no padding, and the policy's cache-derived state rebuilt at the
        next fill. The sampler's and the stopper's books are the caller's (``rolecall.runtime.engine.generate``)."""
        if not self.reusable:
            raise RuntimeError(f"policy {self.policy.name!r}: this decoder cannot be reset; make a new one")
        for t in self.cache.k + self.cache.v:
            t.zero_()
        for t in (self.cache.length, self.cache.pads, self.tokens, self.logits):
            t.zero_()
        self.position = 0
        self._last_kind = self._settle_at = self._capture_when_settled = None

    def uses_full(self) -> bool:
        """Whether the next step falls back to full attention (a sparse policy below ``min_context``)."""
        return self.static.sparse and self.position < self.min_context

    def step(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per row (``tokens`` or the previous step's choice); returns the logits buffer
        ``[B, vocab]`` (overwritten by the next step). Rows that keep their own lengths (the scheduler's) advance
        while their stopper has not finished them; the scheduler keeps each within the cache."""
        if self.position >= self.max_len and not self.cache.row_lengths:
            raise RuntimeError(f"the cache is full: {self.max_len} tokens")
        if tokens is not None:
            self.tokens.copy_(tokens, non_blocking=True)
        if self._settle_at is not None and self.position >= self._settle_at:
            self._settle()
        which = "full" if self.uses_full() else "policy"
        if which == "policy" and self._last_kind == "full":
            self._after_fill()  # the full steps did not keep the policy's cache-derived state
        self._last_kind = which
        graph = self.graphs.get((which, self._mode()))
        if graph is not None:
            graph.replay()
        else:
            self._run(self.full if which == "full" else self.static)
        self.position += 1
        return self.logits

    def capture(self, warmup: int = 2) -> None:
        """Capture the step (and the full fallback when the policy can use it) in CUDA graphs, one per mode of the
        sampler (a :class:`~rolecall.runtime.engine.sampling.RowSampler` has a greedy one and a sampling one); a graph
        captured before (a reused decoder, :meth:`reset`) is kept, so with nothing new to capture this does nothing.

        Warm-up runs (on a side stream) compile the kernels; afterwards the length, the next tokens, the
        sampler's and stopper's state and the cache slots they wrote are restored. Before a policy settles
        (lethe's first step) the capture waits for it, and the steps up to it run eagerly."""
        if self._settle_at is not None:
            self._capture_when_settled = warmup
            return
        start = time.perf_counter()
        kinds = ["policy"] + (["full"] if self.static.sparse and self.min_context > self.position else [])
        modes = self.sampler.modes if self.sampler is not None else (None,)
        kinds = [(kind, mode) for kind in kinds for mode in modes if (kind, mode) not in self.graphs]
        if not kinds:
            return
        mode_before = self._mode()
        c = self.cache
        if self.max_len - self.position < warmup:
            raise RuntimeError(f"capture needs {warmup} free cache slots for its warm-up, "
                               f"{self.max_len - self.position} left")
        saved_state = [t.clone() for t in self._state()]
        written = self.position + torch.arange(warmup, device=c.length.device)
        owned = getattr(self.static, "owned_layers", set())  # compact layers: whole buffers in the step's state()
        # a paged layer's warm-up writes go to each row's next slots, which its next step writes again before any
        # step reads them (an idle row's, and a row's past its pages, to the null page, which nothing reads)
        plain = [i for i in range(len(c.k)) if i not in owned and c.table_of(i) is None and i not in c.rings]
        saved = [(c.k[i].index_select(2, written), c.v[i].index_select(2, written)) for i in plain]
        rings = {i: (c.k[i].clone(), c.v[i].clone()) for i in c.rings}  # a few hundred slots: kept whole
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), graphed():  # graphed: the kernels the capture launches, compiled here
            for kind, mode in kinds:
                self._set_mode(mode)
                for _ in range(warmup):
                    self._run(self.full if kind == "full" else self.static)
                for t, s in zip(self._state(), saved_state):  # each kind warms up from the same state
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self._state(), saved_state):
            t.copy_(s)
        for i, (sk, sv) in zip(plain, saved):
            c.k[i].index_copy_(2, written, sk)
            c.v[i].index_copy_(2, written, sv)
        for i, (sk, sv) in rings.items():
            c.k[i].copy_(sk)
            c.v[i].copy_(sv)
        for kind, mode in kinds:
            self._set_mode(mode)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), graphed():
                self._run(self.full if kind == "full" else self.static)
            self.graphs[kind, mode] = graph
        self._set_mode(mode_before)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start

    def _mode(self) -> Any:
        """The sampler's variant of the step the next step takes (a graph per kind and variant)."""
        return self.sampler.mode if self.sampler is not None else None

    def _set_mode(self, mode: Any) -> None:
        if self.sampler is not None:
            self.sampler.mode = mode

    def _state(self) -> list[torch.Tensor]:
        """What a step changes besides the cache slots it writes: restored after the capture's warm-up (a policy
        that keeps state of its own, such as lethe's held slots and scores, lists it in ``state()``)."""
        parts = (self.sampler, self.stopper, self.static)
        extra = [t for part in parts if part is not None and hasattr(part, "state") for t in part.state()]
        return [self.cache.length, self.tokens, self.logits, *extra]

    def compiled(self, fn: Any) -> Any:
        """``fn`` through ``torch.compile`` where this decoder compiles, else ``fn``: how a policy's step fuses its
        small ops (:func:`rolecall.runtime.engine.compiling.compiled`: static shapes, a bounded number of compilations,
        the eager function when compilation fails)."""
        return compiled(fn, dynamic=None) if self.compiles else fn

    # -- one step ----------------------------------------------------------------------------------------------
    def _spans(self, length: torch.Tensor, positions: torch.Tensor) -> tuple[dict[Any, KeySpan], dict[int, Any]]:
        """The readable slots of this step (``None`` → every valid slot; a window W → its span) and, per size n of
        the cache's rings, a ring's span, the slot ``[B]`` each row writes there and the blocks that cover it
        (``positions [B]``: each row's position of the new token)."""
        c = self.cache
        pads = c.pads
        spans: dict[Any, KeySpan] = {None: KeySpan(pads, length, c.table)}
        for w in sorted({w for i, w in enumerate(self.shape.windows) if w is not None and i not in c.rings}):
            spans[w] = KeySpan(torch.maximum(pads, length - w + 1), length, c.table)
        rings = {n: (ring_span(positions, n, last), ring_slots(positions, n), blocks)
                 for n, (last, blocks) in self._ring_reads.items()}
        return spans, rings

    @torch.no_grad()
    def _run(self, static: Any) -> None:
        s, w, c = self.shape, self.weights, self.cache
        b, hq, d = self.batch, s.heads, s.head_dim
        length = c.length
        positions = length - c.pads  # [B]
        rope = {kind: (cos.index_select(0, positions), sin.index_select(0, positions))
                for kind, (cos, sin) in self._rope.items()}  # [B, D]
        spans, rings = self._spans(length, positions)
        self.attn.new_step()  # the new token's block per block size (last_block)
        state: dict[str, Any] = {}
        rope_store = self._rope_triton.rope_and_store if self.triton else naive_rope_and_store
        slots = dict(static.write_slots()) if hasattr(static, "write_slots") else {}  # compact layers write elsewhere
        slots.update({i: rings[n][1] for i, n in c.rings.items()})  # each row at its own slot of a ring
        x, h = L.first_input(w, self.tokens)  # [B, H]: the residual stream and the first layer's normed input
        try:
            for i, lw in enumerate(w.layers):
                # q and the cache in the cache's head order, o in the model's
                self.attn.layer_heads = self.head_maps[i]
                q = rope_store(linear(h, lw.wqkv, lw.bqkv), hq, s.kv_heads, *rope[s.rope_kinds[i]], c.k[i], c.v[i],
                               slots.get(i, length), lw.q_norm, lw.k_norm, s.eps, self.head_maps[i],
                               block_table=c.table_of(i))  # K/V stored (through the table into a paged layer)
                window = s.windows[i]
                if i in c.rings:  # a hybrid model's sliding layer: its own attention, over its ring
                    span, _, blocks = rings[c.rings[i]]
                    o = self.attn.attend(q, c.k[i], c.v[i], span, blocks, RING_BLOCK)
                else:
                    o = static.attention(self, i, q, c.k[i], c.v[i], spans[window], state)  # [B, Hq, D]
                x, h = self._post(x, o.view(b, hq * d), lw.wo, lw.bo, lw.norm_attn_out, lw.norm_mlp, lw.w_gate_up,
                                  lw.w_down, lw.norm_mlp_out, L.next_norm(w, i))
        finally:
            self.attn.layer_heads = None
        self.attn.join()  # work put beside the step (attend_and_choose) ends within it
        self.choose(L.logits(w, h))
        if length.dim():  # each row its own length: the rows still decoding advance
            length.add_(self.stopper.running())
        else:
            length.add_(1)

    def choose(self, logits: torch.Tensor) -> None:
        """Keep ``logits [B, V]`` and choose the next tokens from them (sampler, then the stopper's books)."""
        self.logits.copy_(logits)
        token = self.sampler(logits) if self.sampler is not None else logits.argmax(-1)
        if self.stopper is not None:
            token = self.stopper(token)
        self.tokens.copy_(token)

    # -- prefill -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, pads: list[int] | None = None, chunk: int | None = None,
                graph: bool = False) -> torch.Tensor:
        """Fill an empty cache with ``input_ids [B, P]`` (left-padded: row b's first ``pads[b]`` ids are
        padding); returns the last position's logits ``[B, vocab]`` and sets the next tokens to the choice
        made from them. ``graph``: a short prompt's prefill replays a CUDA graph of its width from the second
        time this decoder sees that width. See :func:`rolecall.runtime.engine.prefill.prefill`."""
        return _prefill(self, input_ids, pads, chunk, graph)


def pad_left(rows: list[list[int]], pad_id: int, device: Any = "cpu",
             width: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """Token id lists of any lengths → a left-padded ``[B, P]`` tensor (``P``: ``width``, default the longest
    row) and the pad count of each row."""
    longest = max(len(r) for r in rows)
    if width is not None and width < longest:
        raise ValueError(f"width {width} is shorter than the longest row ({longest} ids)")
    width = width or longest
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[pad_id] * p + list(r) for p, r in zip(pads, rows)], dtype=torch.long, device=device)
    return ids, pads


def padding_mask(pads: list[int], width: int, device: Any = "cpu") -> torch.Tensor:
    """``[B, width]`` long: 1 on the real tokens of rows left-padded by ``pads`` (:func:`pad_left`), 0 on padding,
    the ``attention_mask`` transformers takes."""
    return (torch.arange(width, device=device)[None, :] >= torch.tensor(pads, device=device)[:, None]).long()


__all__ = ["StaticDecoder", "pad_left", "padding_mask", "reads_pages", "rows_refusal", "static_step_of"]

