"""The static decoder: one decode step over a :class:`StaticCache`, eager or replayed from a CUDA graph.

Weights are plain tensors (:class:`Weights`), the cache is preallocated, the current length is a device
scalar, the new token's K/V are written at that length (with its RoPE: one kernel on the GPU), the next token
is chosen on the device (greedy, or the sampler's choice) and ``length += 1`` happens on the device. No ``.item()``, no host
sync and no shape that changes per step, so the step is captured in a CUDA graph (:meth:`capture`) and
replayed. Attention goes through the policy's static step (``policy.static_step(shape)``, written in the
policy's own file); sliding-window layers of hybrid models read their window themselves, from a ring of at most
``window + 1`` slots (:class:`~rolecall.runtime.engine.cache.StaticCache`).

A selection layer's choice may run beside the step on a second stream (:meth:`StaticDecoder.attend_and_choose`:
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

import contextlib
import time
from typing import Any

import torch

from rolecall.runtime.engine import layers as L
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
from rolecall.runtime.kernels import graphed, use_triton
from rolecall.runtime.kernels.page_scores import decode_and_score as naive_decode_and_score
from rolecall.runtime.kernels.rope_cache import rope_and_store as naive_rope_and_store
from rolecall.runtime.kernels.skinny_linear import linear
from rolecall.runtime.kernels.sparse_attention import naive as naive_attention
from rolecall.runtime.kernels.topk_select import topk_with_recent

RING_BLOCK = 64  # a ring is read as blocks of this many slots (a gathered set's launch: more, shorter programs)
LAYER_ORDER = "layer"  # out_heads' default: the running layer's head map (StaticDecoder.head_maps)
MIXED_MAX_BATCH = 8  # from this batch size a mixed layer takes two launches (see attend_mixed_and_choose)
# Tokens a program of a dense call reads where rows keep their own lengths (the scheduler's). choose_launch gives
# many rows one program each, which suits rows of one length; rows of 12K-32K tokens then wait on the longest.
# DS-Qwen-7B shape, 64 such rows (mean 21.5K) in 32K-slot rows against the static step at the mean, H200
# (benchmarks/results/rows_chunk_h200.json): full 1.178 one program a row, 1.064 / 1.056 / 1.079 / 1.152 with
# chunks of 1,024 / 2,048 / 4,096 / 8,192; delta's dense layers 1.099 against 1.075 at 2,048.
ROWS_CHUNK: int | None = 2048


def static_step_of(policy: Any, shape: Any) -> Any:
    """The policy's static step for ``shape``, or a ``NotImplementedError`` saying why it has none."""
    make = getattr(policy, "static_step", None)
    if make is None:
        raise NotImplementedError(f"policy {policy.name!r} has no static step on the engine yet")
    return make(shape)


def rows_refusal(step: Any) -> str | None:
    """Why a policy's static ``step`` cannot run rows of their own lengths (the scheduler's), or None when it can:
    the step declares ``row_lengths`` when it keeps nothing across steps that assumes one length for all rows."""
    if getattr(step, "row_lengths", False):
        return None
    return ("its engine step keeps state that assumes one length for all rows (served: full, delta without refine, "
            "lychee)")


class StaticDecoder:
    """``policy``: a bound policy from ``rolecall.runtime.policies`` (``Full()`` when None). ``kernels``: ``"auto"``
    (Triton on CUDA), ``"naive"`` (the PyTorch references) or ``"triton"`` (also on the CPU under
    ``TRITON_INTERPRET=1``). ``cache``: share one cache between decoders (benchmarks). ``sampler``: chooses
    the next token from the logits inside the step (greedy when None); ``stopper``: bookkeeping of finished
    rows inside the step (``rolecall.runtime.engine.generate``). ``compile``: fuse each layer's small ops around its GEMMs
    with ``torch.compile`` (default: on CUDA, unless ``ROLECALL_COMPILE=0``; ``ROLECALL_COMPILE=1`` compiles on
    any device; see :mod:`rolecall.runtime.engine.compiling` for how many times). ``row_lengths``: each row keeps its own
    length, unpadded (the scheduler's rows, :mod:`rolecall.runtime.engine.batcher`); the policy's step must run so
    (``row_lengths`` true) and the stopper says which rows advance (``running()``)."""

    def __init__(self, weights: Weights, policy: Any = None, batch: int = 1, max_len: int = 4096, *,
                 cache: StaticCache | None = None, min_context: int | None = None, kernels: str = "auto",
                 sampler: Any = None, stopper: Any = None, compile: bool | None = None,
                 prompt_tokens: int | None = None, row_lengths: bool = False) -> None:
        from rolecall.runtime.policies.full import Full

        self.policy = policy if policy is not None else Full()
        s = weights.shape
        self.static = static_step_of(self.policy, s)
        self.full = Full().static_step(s)
        why = rows_refusal(self.static) if row_lengths else None
        if why:
            raise NotImplementedError(f"policy {self.policy.name!r}: {why}")
        head_order = head_order_of(self.static.head_order, s)
        if max_len > weights.max_positions:
            raise ValueError(f"the cache needs {max_len} positions, the model's RoPE tables hold "
                             f"{weights.max_positions}; ask for fewer tokens")
        self.weights, self.shape, self.batch = weights, s, batch
        device, dtype = weights.device, weights.dtype
        self.owns_cache = cache is None  # a policy may resize only a cache of its own
        self.cache = self._cache(cache, batch, max_len, head_order, prompt_tokens, row_lengths)
        self.max_len = max_len
        # A cache that keeps a layer's KV heads in another order (the policy's head_order) does not reorder the
        # weights: the new token's heads are read in the cache's order (rope_and_store) and every attention call
        # writes its output back in the model's (out_heads), so the decoder shares the session's tensors.
        self.head_maps = [None if o is None or torch.equal(o, torch.arange(s.kv_heads)) else
                          o.to(device=device, dtype=torch.int32) for o in (head_order or [None] * s.layers)]
        self._layer_heads: torch.Tensor | None = None  # the running layer's head map (out_heads' default)
        self.min_context = self._min_context(min_context, batch)
        self._choose_kernels(kernels, device)
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
        self._last_block: dict[int, torch.Tensor] = {}  # the new token's block per block size (last_block)
        self._aside: dict[Any, Any] = {}  # per (device, role), a stream beside the step's (_side_stream)
        self._joins: set[Any] = set()  # the streams this step put work on, waited for at its end
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
        self._out = {"out_dtype": dtype} if self.triton else {}  # the GPU kernels write the model's dtype
        self._dense = dict(self._out, chunk=ROWS_CHUNK) if self.triton and row_lengths and ROWS_CHUNK else self._out

    def _cache(self, cache: StaticCache | None, batch: int, max_len: int, head_order: Any,
               prompt_tokens: int | None, row_lengths: bool) -> StaticCache:
        """A new cache of ``batch`` rows × ``max_len`` slots (a policy that keeps some layers compact sizes them
        to the prompt and its budget), or the shared ``cache``, refused where its size or head order differs."""
        if cache is None:
            sizes = getattr(self.static, "cache_slots", None)
            return StaticCache(self.shape, batch, max_len, self.weights.device, self.weights.dtype, head_order,
                               sizes(max_len, prompt_tokens) if sizes is not None else None, row_lengths)
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

    def _choose_kernels(self, kernels: str, device: torch.device) -> None:
        """Triton (on CUDA by default, or under the interpreter when asked) or the PyTorch references."""
        if kernels not in ("auto", "naive", "triton"):
            raise ValueError(f"kernels must be auto, naive or triton, not {kernels!r}")
        self.triton = kernels == "triton" or (kernels == "auto" and use_triton(torch.empty(0, device=device)))
        if not self.triton:
            return
        from rolecall.runtime.kernels.page_scores import triton as page_triton
        from rolecall.runtime.kernels.rope_cache import triton as rope_triton
        from rolecall.runtime.kernels.sparse_attention import triton as sparse_triton
        from rolecall.runtime.kernels.topk_select import triton as topk_triton

        self._page_triton, self._sparse_triton, self._rope_triton = page_triton, sparse_triton, rope_triton
        self._topk_triton = topk_triton
        for size in self.static.block_sizes:
            if size & (size - 1):
                raise ValueError(f"policy {self.policy.name!r}: block size {size} must be a power of two "
                                 "for the GPU kernels")

    # -- host-side control -------------------------------------------------------------------------------------
    def set_length(self, length: int) -> None:
        """Declare the first ``length`` slots valid (after a prefill or filling them by other means); a policy
        whose step keeps state derived from the cache (quest's page bounds) rebuilds it here."""
        self.cache.length.fill_(length)
        self.position = length
        self._after_fill()

    def _after_fill(self) -> None:
        after_fill = getattr(self.static, "after_fill", None)
        if after_fill is not None:
            after_fill(self)
        settle = getattr(self.static, "steps_to_settle", None)
        self._settle_at = self.position + settle(self) if settle is not None else None

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
        plain = [i for i in range(len(c.k)) if i not in owned and i not in c.rings]
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

    # -- attention helpers the policies' static steps call -------------------------------------------------------
    def keys(self, span: KeySpan, slots: int) -> dict[str, Any]:
        """The kernels' argument for the readable slots: the bounds (GPU kernels) or a mask (references)."""
        return {"key_span": (span.first, span.last)} if self.triton else {"key_mask": span.as_mask(slots)}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: KeySpan,
               indices: torch.Tensor | None = None, block_size: int = 1, log_weights: torch.Tensor | None = None,
               with_lse: bool = False, key_mask: torch.Tensor | None = None, index_rows: torch.Tensor | None = None,
               out: torch.Tensor | None = None, out_heads: Any = LAYER_ORDER) -> Any:
        """``[B, Hq, D]`` attention over ``indices`` (blocks of ``block_size``; None = every slot; ``log_weights``
        added to each entry's logits; ``key_mask [B, S]`` narrows the span further; ``index_rows [Hkv]`` int32: KV
        head h reads ``indices[:, index_rows[h]]``), float32 from the references, the model's dtype from the GPU
        kernels, written into ``out`` when given; with ``with_lse`` also each head's log-sum-exp (in the cache's
        head order). The output is in the model's head order: KV head h's query heads go to ``out_heads[h]``'s
        (``LAYER_ORDER``: the running layer's map, None where the cache keeps the model's order; a call over a
        part of the heads passes its part of the map, and ``out`` then holds all of them)."""
        out_heads = self._heads(out_heads)
        keys = self.keys(span, k.shape[2])
        if key_mask is not None:
            keys["key_mask"] = keys["key_mask"] & key_mask if "key_mask" in keys else key_mask
        scale = self.shape.attention_scale
        if self.triton:
            o, lse = self._sparse_triton.sparse_decode_attention(
                q, k, v, indices, scale=scale, block_size=block_size, log_weights=log_weights, index_rows=index_rows,
                out=out, out_heads=out_heads, **keys, **(self._dense if indices is None else self._out))
        else:
            if index_rows is not None:
                rows = index_rows.long()
                indices = indices.index_select(1, rows)
                log_weights = log_weights.index_select(1, rows) if log_weights is not None else None
            o, lse = naive_attention.sparse_decode_attention(q, k, v, indices, scale=scale, block_size=block_size,
                                                             log_weights=log_weights, **keys)
            o = L.placed(o, out, out_heads)
        return (o, lse) if with_lse else o

    def _heads(self, out_heads: Any) -> torch.Tensor | None:
        return self._layer_heads if out_heads is LAYER_ORDER else out_heads

    def attend_and_score(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: KeySpan,
                         block_size: int, per_kv_head: bool, out: torch.Tensor | None = None,
                         out_heads: Any = LAYER_ORDER) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense attention (written into ``out`` when given, ``out_heads`` as in :meth:`attend`) and block scores
        ``[B, n]`` (max over all heads) or ``[B, Hkv, n]`` (per KV head, in the cache's order)."""
        out_heads = self._heads(out_heads)
        keys = self.keys(span, k.shape[2])
        if self.triton:
            o, _, scores = self._page_triton.decode_and_score(q, k, v, self.shape.attention_scale, block_size,
                                                              per_kv_head=per_kv_head, out=out, out_heads=out_heads,
                                                              **keys, **self._dense)
            return o, scores
        o, _, scores = naive_decode_and_score(q, k, v, self.shape.attention_scale, block_size,
                                              per_kv_head=per_kv_head, **keys)
        return L.placed(o, out, out_heads), scores

    def attend_mixed_and_choose(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: KeySpan,
                                indices: torch.Tensor, block_size: int, full_heads: int, count: int, recent: int,
                                index_rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                                out_rows: torch.Tensor | None = None, choosing: int | None = None,
                                out_heads: Any = LAYER_ORDER) -> tuple[torch.Tensor, Pending | None]:
        """The first ``full_heads`` KV heads read everything, and the first ``choosing`` of them (default all)
        choose blocks per KV head (as :meth:`attend_and_choose`); the others read ``indices`` (KV head h its row
        ``index_rows[h]`` when given, see :meth:`attend`): ``(out [B, Hq, D], Pending(choice [B, choosing,
        count]))``, or ``(out, None)`` when none chooses; with ``out``/``out_rows`` the choice goes into rows of
        ``out`` as in :meth:`select`; the attention's output in the model's head order (``out_heads``, see
        :meth:`attend`).

        On the GPU below :data:`MIXED_MAX_BATCH` rows the attention is one launch; from there on a dense launch
        over the head prefix and a block-sparse one over the rest, which measured faster (DS-Qwen-7B shape, 32 of
        112 retrieval heads, 2K budget, H200: 128K × 1 7.21 vs 7.30 ms a step, 32K × 1 6.12 vs 6.25; 128K × 8
        12.78 vs 11.91, 32K × 8 7.69 vs 7.61: at 8 rows the long rows' split-K partials outweigh the saved
        launch). The references always take the two calls."""
        g = q.shape[1] // k.shape[1]
        r = full_heads
        c = r if choosing is None else choosing
        heads = self._heads(out_heads)
        rows = index_rows[r:] if index_rows is not None else None
        sparse = indices if index_rows is not None else indices[:, r:]
        if self.triton and q.is_cuda and self.batch < MIXED_MAX_BATCH:
            o, lse, logits = self._page_triton.mixed_keeping_logits(
                q, k, v, indices, self.shape.attention_scale, block_size, r, index_rows=index_rows,
                keeping_heads=c, out_heads=heads, **self.keys(span, k.shape[2]), **self._out)
            if not c:
                return o, None
            return o, self._choose_aside(logits, lse[:, :c * g], block_size, c, True, count, recent, out, out_rows,
                                         span.last)
        o = q.new_empty(q.shape, dtype=self.weights.dtype if self.triton else torch.float32)
        # each part writes its heads: into its slice of o, or by its part of the map into all of o
        if heads is None:
            (sparse_out, sparse_heads), (dense_out, dense_heads) = (o[:, r * g:], None), (o[:, :r * g], None)
        else:
            (sparse_out, sparse_heads), (dense_out, dense_heads) = (o, heads[r:]), (o, heads[:r])
        # On the GPU the sparse heads' gathers (latency-bound) run on a stream of their own beside the dense heads'
        # streaming launch; the step's stream waits for them before anything reads the output
        side = self._side_stream(q.device, "sparse") if self.triton and q.is_cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self.attend(q[:, r * g:], k[:, r:], v[:, r:], span, sparse, block_size, index_rows=rows,
                        out=sparse_out, out_heads=sparse_heads)
        _, chosen = self.attend_and_choose(q[:, :r * g], k[:, :r], v[:, :r], span, block_size, True, count, recent,
                                           out=out, out_rows=out_rows, into=dense_out, choosing=c,
                                           out_heads=dense_heads)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        return o, chosen

    def attend_and_choose(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: KeySpan, block_size: int,
                          per_kv_head: bool, count: int, recent: int, out: torch.Tensor | None = None,
                          out_rows: torch.Tensor | None = None, into: torch.Tensor | None = None,
                          choosing: int | None = None,
                          out_heads: Any = LAYER_ORDER) -> tuple[torch.Tensor, Pending | None]:
        """Dense attention (written into ``into`` when given), and the blocks :meth:`select` chooses from its
        block scores (as :meth:`attend_and_score` then :meth:`select`, ``out``/``out_rows`` as there), the
        choice :class:`Pending`: on the GPU the block scores and the top-k run on a second stream beside the rest
        of the layer and the next layer's projections, and the step's stream waits for them where the choice is
        first read (``Pending.result``) or at the end of the step. The references (and the Triton kernels under
        the CPU interpreter) compute it in line. ``choosing`` (per KV head only): only the first ``choosing`` KV
        heads choose, and only their logits are kept; with 0 the choice is None and this is plain attention.
        ``out_heads``: as in :meth:`attend`."""
        out_heads = self._heads(out_heads)
        if choosing is not None and not per_kv_head:
            raise ValueError("choosing needs per_kv_head: a choice shared by all heads is made by all of them")
        c = k.shape[1] if choosing is None else choosing
        if not c:
            return self.attend(q, k, v, span, out=into, out_heads=out_heads), None
        if not (self.triton and q.is_cuda):
            o, scores = self.attend_and_score(q, k, v, span, block_size, per_kv_head, out=into, out_heads=out_heads)
            return o, Pending(self.select(scores[:, :c] if per_kv_head else scores, block_size, count, recent,
                                          out=out, out_rows=out_rows))
        o, lse, logits = self._page_triton.decode_keeping_logits(q, k, v, self.shape.attention_scale, out=into,
                                                                 out_heads=out_heads, keeping_heads=c,
                                                                 **self.keys(span, k.shape[2]), **self._dense)
        g = q.shape[1] // k.shape[1]
        return o, self._choose_aside(logits, lse[:, :c * g], block_size, c, per_kv_head, count, recent, out, out_rows,
                                     span.last)

    def _choose_aside(self, logits: torch.Tensor, lse: torch.Tensor, block_size: int, kv_heads: int,
                      per_kv_head: bool, count: int, recent: int, out: torch.Tensor | None,
                      out_rows: torch.Tensor | None, last: torch.Tensor | None = None) -> Pending:
        """Block scores from kept ``logits``/``lse`` (up to each row's ``last`` slot: the rest is not read) and the
        top-k over them, on the second stream (see :meth:`attend_and_choose`)."""
        self.last_block(block_size)  # made on the step's stream, which every later selection may read
        side = self._side_stream(logits.device, "choice")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            scores = self._page_triton.page_scores_from_logits(logits, lse, block_size, kv_heads, per_kv_head, last)
            chosen = self.select(scores, block_size, count, recent, out=out, out_rows=out_rows)
        self._joins.add(side)
        # the logits stay referenced until the step's stream has waited: no kernel of it reuses their memory early
        return Pending(chosen, side, keep=(logits, lse, scores))

    def _side_stream(self, device: torch.device, role: str) -> Any:
        """The CUDA stream that runs ``role``'s work beside the step on ``device``, made once."""
        side = self._aside.get((device, role))
        if side is None:
            side = self._aside[(device, role)] = torch.cuda.Stream(device)
        return side

    def compiled(self, fn: Any) -> Any:
        """``fn`` through ``torch.compile`` where this decoder compiles, else ``fn``: how a policy's step fuses its
        small ops (:func:`rolecall.runtime.engine.compiling.compiled`: static shapes, a bounded number of compilations,
        the eager function when compilation fails)."""
        return compiled(fn, dynamic=None) if self.compiles else fn

    def triton_topk(self, n: int) -> Any:
        """The Triton top-k (ascending ids, -1 padded) when this decoder runs it over rows of ``n`` scores,
        else None (the reference kernels, or rows longer than one program holds)."""
        return self._topk_triton.topk_with_recent if self.triton and n <= self._topk_triton.MAX_N else None

    def select(self, scores: torch.Tensor, block_size: int, k: int, recent: int, out: torch.Tensor | None = None,
               out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Block scores ``[..., n]`` → ``[..., min(k, n)]`` int32 block ids (-1 = none): the last ``recent``
        blocks up to the new token's, then the highest scores among the existing ones. No sync; ascending
        when :meth:`triton_topk` of ``n`` is not None. With ``out`` and ``out_rows`` (see
        :func:`rolecall.runtime.kernels.topk_select.triton.topk_with_recent`) row i of the choice is written to row
        ``out_rows[i]`` of ``out`` in place, and ``out`` is returned."""
        last = self.last_block(block_size)
        if last.dim() and scores.dim() == 3:  # each row's own last block, for each of its KV heads
            last = last[:, None].expand(scores.shape[:2])
        fast = self.triton_topk(scores.shape[-1])
        if fast is not None:
            return fast(scores, k, recent, last=last, out=out, out_rows=out_rows)
        chosen = topk_with_recent(scores, k, recent, last=last, ascending=False).to(torch.int32)
        if out is None:
            return chosen
        width = chosen.shape[-1]
        return out.view(-1, width).index_copy_(0, out_rows.long(), chosen.reshape(-1, width)).view(out.shape)

    def last_block(self, block_size: int) -> torch.Tensor:
        """The new token's block (a device scalar, or ``[B]`` where rows keep their own lengths), made once a step
        per block size."""
        last = self._last_block.get(block_size)
        if last is None:
            last = self._last_block[block_size] = torch.div(self.cache.length, block_size, rounding_mode="floor")
        return last

    # -- one step ----------------------------------------------------------------------------------------------
    def _spans(self, length: torch.Tensor, positions: torch.Tensor) -> tuple[dict[Any, KeySpan], dict[int, Any]]:
        """The readable slots of this step (``None`` → every valid slot; a window W → its span) and, per size n of
        the cache's rings, a ring's span, the slot ``[B]`` each row writes there and the blocks that cover it
        (``positions [B]``: each row's position of the new token)."""
        c = self.cache
        pads = c.pads
        spans: dict[Any, KeySpan] = {None: KeySpan(pads, length)}
        for w in sorted({w for i, w in enumerate(self.shape.windows) if w is not None and i not in c.rings}):
            spans[w] = KeySpan(torch.maximum(pads, length - w + 1), length)
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
        self._last_block = {}  # the new token's block per block size (last_block)
        state: dict[str, Any] = {}
        rope_store = self._rope_triton.rope_and_store if self.triton else naive_rope_and_store
        slots = dict(static.write_slots()) if hasattr(static, "write_slots") else {}  # compact layers write elsewhere
        slots.update({i: rings[n][1] for i, n in c.rings.items()})  # each row at its own slot of a ring
        x, h = L.first_input(w, self.tokens)  # [B, H]: the residual stream and the first layer's normed input
        try:
            for i, lw in enumerate(w.layers):
                self._layer_heads = self.head_maps[i]  # q and the cache in the cache's head order, o in the model's
                q = rope_store(linear(h, lw.wqkv, lw.bqkv), hq, s.kv_heads, *rope[s.rope_kinds[i]], c.k[i], c.v[i],
                               slots.get(i, length), lw.q_norm, lw.k_norm, s.eps, self.head_maps[i])  # K/V stored
                window = s.windows[i]
                if i in c.rings:  # a hybrid model's sliding layer: its own attention, over its ring
                    span, _, blocks = rings[c.rings[i]]
                    o = self.attend(q, c.k[i], c.v[i], span, blocks, RING_BLOCK)
                else:
                    o = static.attention(self, i, q, c.k[i], c.v[i], spans[window], state)  # [B, Hq, D]
                x, h = self._post(x, o.view(b, hq * d), lw.wo, lw.bo, lw.norm_attn_out, lw.norm_mlp, lw.w_gate_up,
                                  lw.w_down, lw.norm_mlp_out, L.next_norm(w, i))
        finally:
            self._layer_heads = None
        for side in self._joins:  # work put beside the step (attend_and_choose) ends within it
            torch.cuda.current_stream().wait_stream(side)
        self._joins.clear()
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


class Pending:
    """A value computed on another stream (``stream``) or already in hand (``stream=None``). :meth:`result` makes the
    current stream wait for it once, then returns it; ``keep`` holds the tensors that work reads until then."""

    def __init__(self, value: Any, stream: Any = None, keep: tuple = ()) -> None:
        self.value, self._stream, self._keep = value, stream, keep

    def result(self) -> Any:
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
            self._stream, self._keep = None, ()
        return self.value


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


__all__ = ["Pending", "StaticDecoder", "pad_left", "padding_mask", "rows_refusal", "static_step_of"]

