"""The attention operations a decode step calls, over one decoder's cache: dense and block-sparse attention,
block scores, the choice of blocks (the recent ones, then the top-k), and a choice made beside the step on a
second stream.

:class:`DecodeAttention` is what a policy's static step calls (``dec.attn``: :meth:`~DecodeAttention.attend`,
:meth:`~DecodeAttention.attend_and_score`, :meth:`~DecodeAttention.attend_and_choose`,
:meth:`~DecodeAttention.attend_mixed_and_choose`, :meth:`~DecodeAttention.select`); each call takes the Triton
kernels (on CUDA, or under the CPU interpreter when asked) or the PyTorch references. The step runner
(:class:`~rolecall.runtime.engine.decoder.StaticDecoder`) sets the running layer's head map
(:attr:`~DecodeAttention.layer_heads`), starts each step (:meth:`~DecodeAttention.new_step`) and ends it by
waiting for the work put beside it (:meth:`~DecodeAttention.join`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rolecall.runtime.engine import layers as L
from rolecall.runtime.engine.cache import KeySpan, StaticCache
from rolecall.runtime.engine.shape import ModelShape
from rolecall.runtime.kernels import use_triton
from rolecall.runtime.kernels.page_scores import decode_and_score as naive_decode_and_score
from rolecall.runtime.kernels.sparse_attention import naive as naive_attention
from rolecall.runtime.kernels.topk_select import topk_with_recent

LAYER_ORDER = "layer"  # out_heads' default: the running layer's head map (StaticDecoder.head_maps)
MIXED_MAX_BATCH = 8  # from this batch size a mixed layer takes two launches (see attend_mixed_and_choose)
# Tokens a program of a dense call reads where rows keep their own lengths (the scheduler's). choose_launch gives
# many rows one program each, which suits rows of one length; rows of 12K-32K tokens then wait on the longest.
# DS-Qwen-7B shape, 64 such rows (mean 21.5K) in 32K-slot rows against the static step at the mean, H200
# (benchmarks/results/rows_chunk_h200.json): full 1.178 one program a row, 1.064 / 1.056 / 1.079 / 1.152 with
# chunks of 1,024 / 2,048 / 4,096 / 8,192; delta's dense layers 1.099 against 1.075 at 2,048.
ROWS_CHUNK: int | None = 2048


class DecodeAttention:
    """The attention calls of one decoder's step over ``cache`` (``batch`` rows of a model of ``shape`` whose
    weights are ``dtype``). ``kernels``: ``"auto"`` (Triton on CUDA), ``"naive"`` (the PyTorch references) or
    ``"triton"`` (also on the CPU under ``TRITON_INTERPRET=1``); the policy's ``block_sizes`` must then be
    powers of two (``policy``: its name, for the message). ``row_lengths``: each row keeps its own length (the
    scheduler's), so a dense call on the GPU reads in chunks of :data:`ROWS_CHUNK` tokens a program."""

    def __init__(self, shape: ModelShape, batch: int, dtype: torch.dtype, cache: StaticCache, kernels: str,
                 device: torch.device, block_sizes: Any, policy: str, row_lengths: bool = False) -> None:
        self.shape, self.batch, self.dtype, self.cache = shape, batch, dtype, cache
        self.layer_heads: torch.Tensor | None = None  # the running layer's head map (out_heads' default)
        self._choose_kernels(kernels, device, block_sizes, policy)
        self._last_block: dict[int, torch.Tensor] = {}  # the new token's block per block size (last_block)
        self._aside: dict[Any, Any] = {}  # per (device, role), a stream beside the step's (_side_stream)
        self._joins: set[Any] = set()  # the streams this step put work on, waited for at its end
        self._out = {"out_dtype": dtype} if self.triton else {}  # the GPU kernels write the model's dtype
        chunked = self.triton and row_lengths and ROWS_CHUNK
        self._dense = dict(self._out, chunk=ROWS_CHUNK) if chunked else self._out

    def _choose_kernels(self, kernels: str, device: torch.device, block_sizes: Any, policy: str) -> None:
        """Triton (on CUDA by default, or under the interpreter when asked) or the PyTorch references."""
        if kernels not in ("auto", "naive", "triton"):
            raise ValueError(f"kernels must be auto, naive or triton, not {kernels!r}")
        self.triton = kernels == "triton" or (kernels == "auto" and use_triton(torch.empty(0, device=device)))
        if not self.triton:
            return
        from rolecall.runtime.kernels.page_scores import triton as page_triton
        from rolecall.runtime.kernels.sparse_attention import triton as sparse_triton
        from rolecall.runtime.kernels.topk_select import triton as topk_triton

        self._page_triton, self._sparse_triton, self._topk_triton = page_triton, sparse_triton, topk_triton
        for size in block_sizes:
            if size & (size - 1):
                raise ValueError(f"policy {policy!r}: block size {size} must be a power of two "
                                 "for the GPU kernels")

    # -- the step runner's calls ---------------------------------------------------------------------------
    def new_step(self) -> None:
        """A new step begins: the new token's block is made again per block size (:meth:`last_block`)."""
        self._last_block = {}

    def join(self) -> None:
        """The step's stream waits for the work put beside it (:meth:`attend_and_choose`): it ends within the
        step."""
        for side in self._joins:
            torch.cuda.current_stream().wait_stream(side)
        self._joins.clear()

    # -- what the policies' static steps call --------------------------------------------------------------
    def keys(self, span: KeySpan, k: torch.Tensor) -> dict[str, Any]:
        """The kernels' arguments for the slots of the keys ``k`` that ``span`` reads: the bounds (GPU kernels) or a
        mask over the row's slots (references), and a paged cache's block table (:attr:`KeySpan.table`)."""
        keys: dict[str, Any] = ({"key_span": (span.first, span.last)} if self.triton else
                                {"key_mask": span.as_mask(span.slots(k))})
        if span.table is not None:
            keys["block_table"] = span.table
        return keys

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
        if not self.triton and k.device.type == "cpu":  # no graph here: read only up to the last readable slot
            k, v, key_mask, span = within_reach(span, k, v, key_mask)
        keys = self.keys(span, k)
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
        return self.layer_heads if out_heads is LAYER_ORDER else out_heads

    def attend_and_score(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: KeySpan,
                         block_size: int, per_kv_head: bool, out: torch.Tensor | None = None,
                         out_heads: Any = LAYER_ORDER) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense attention (written into ``out`` when given, ``out_heads`` as in :meth:`attend`) and block scores
        ``[B, n]`` (max over all heads) or ``[B, Hkv, n]`` (per KV head, in the cache's order)."""
        out_heads = self._heads(out_heads)
        keys = self.keys(span, k)
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
                keeping_heads=c, out_heads=heads, **self.keys(span, k), **self._out)
            if not c:
                return o, None
            return o, self._choose_aside(logits, lse[:, :c * g], block_size, c, True, count, recent, out, out_rows,
                                         span.last)
        o = q.new_empty(q.shape, dtype=self.dtype if self.triton else torch.float32)
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
                                                                 **self.keys(span, k), **self._dense)
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


def within_reach(span: KeySpan, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, KeySpan]:
    """``k``, ``v [B, Hkv, S, D]``, ``key_mask [B, S]`` and ``span`` cut to the slots before ``span``'s last readable
    one and it (a paged cache: its table cut to the pages that hold them, and the mask to those pages' slots): no
    row reads past it, so the result is the same, and a reference call's cost follows the longest live row instead
    of the cache's size. It reads the bound on the host, so only where nothing is captured in a graph (the CPU)."""
    reach = int(span.last.max()) + 1
    if span.table is not None:
        width = -(-reach // k.shape[2])  # pages of the longest row
        if width >= span.table.shape[1]:
            return k, v, key_mask, span
        cut = KeySpan(span.first, span.last, span.table[:, :width])
        return k, v, key_mask[..., :width * k.shape[2]] if key_mask is not None else None, cut
    if reach >= k.shape[2]:
        return k, v, key_mask, span
    return k[:, :, :reach], v[:, :, :reach], key_mask[..., :reach] if key_mask is not None else None, span


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


__all__ = ["LAYER_ORDER", "MIXED_MAX_BATCH", "ROWS_CHUNK", "DecodeAttention", "Pending"]
