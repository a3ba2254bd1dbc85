"""Prefill: the prompt's K/V into the static cache, in chunks, with fused SDPA attention.

Chunks bound the activation memory (a 128K-token prompt never holds a ``[P, P]`` score matrix). Every chunk
of an unpadded batch runs SDPA's causal kernel on the layers without a sliding window (flash attention on the
GPU): the first with ``is_causal``, a later one with a causal mask aligned to the lower right
(``torch.nn.attention.bias.causal_lower_right``: the chunk's queries are the last of the keys it reads), so a
long prompt never leaves the fused kernel. Padded rows and windows pass a boolean mask (then grouped K/V heads
are repeated for the masked kernel, which does not take grouped heads). A sliding-window layer attends in blocks
of ``max(window, WINDOW_BLOCK)`` queries, each reading only the keys its window reaches (the block and the
``window - 1`` slots before it): per query at most one block and one window of keys, not the whole chunk
(Gemma 3's 512-token windows in a 4,096-token chunk: under a third of the keys, and a block × keys mask per call).
A hybrid model's sliding layer holds a ring (:class:`~rolecall.runtime.engine.cache.StaticCache`): a chunk reads the
``window - 1`` tokens before it from the ring and its own from its projections, then leaves as many of its last
tokens there as the ring holds.

A short prompt's prefill is bound by launching its kernels, not by its arithmetic (SmolLM2-135M, one row of a
few dozen tokens: about 57 ms on an H100, against 0.73 ms for a decode step). A batch whose width is one of
:data:`GRAPH_WIDTHS` (``generate`` left-pads short prompts to the next one on the GPU) prefills in one masked pass
over that width, and a decoder kept for further requests replays it from a CUDA graph from the second time it
sees the width (:class:`PrefillGraphs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rolecall.runtime.engine import layers as L

DEFAULT_CHUNK = 4096  # tokens per row of a chunk, at least
GRAPH_WIDTHS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)  # the prompt widths graphs are made for
GRAPH_TOKENS = 4096  # rows × width of a graphed prefill, at most
CHUNK_TOKENS = 32768  # tokens of a chunk over all rows: fewer rows take longer chunks
WINDOW_BLOCK = 1024  # queries per attention call of a sliding-window layer, at least (its window, if larger)


def chunk_for(rows: int, padded: bool = False) -> int:
    """Tokens per row of a prefill chunk for ``rows`` rows: ``max(DEFAULT_CHUNK, CHUNK_TOKENS // rows)``. A chunk
    past the first runs the causal kernel over every key before it, and a short chunk of one row leaves most
    of the GPU idle there (SmolLM2-135M, 32K-token prompt, one row, H200: 145K tokens/s in chunks of 4,096
    against 261K for transformers' one pass); a batch of rows fills it with short chunks. A padded batch passes
    a boolean mask of chunk × keys per row instead, so it keeps ``DEFAULT_CHUNK``."""
    return DEFAULT_CHUNK if padded else max(DEFAULT_CHUNK, CHUNK_TOKENS // max(rows, 1))


def graph_width(longest: int, rows: int) -> int | None:
    """The width ``rows`` prompts of at most ``longest`` ids are left-padded to for a graphed prefill: the smallest
    of :data:`GRAPH_WIDTHS` that holds them, or None where there is none or ``rows`` × width passes
    :data:`GRAPH_TOKENS` (a prefill that long is bound by its arithmetic)."""
    width = next((w for w in GRAPH_WIDTHS if w >= longest), None)
    return width if width is not None and rows * width <= GRAPH_TOKENS else None


def prefill(dec, input_ids: torch.Tensor, pads: list[int] | None = None, chunk: int | None = None,
            graph: bool = False) -> torch.Tensor:
    """See :meth:`rolecall.runtime.engine.decoder.StaticDecoder.prefill`."""
    c = dec.cache
    b, p = input_ids.shape
    pads = list(pads or [0] * b)
    _check_fits(dec, b, p, pads)
    input_ids = input_ids.to(c.length.device)
    c.pads.copy_(torch.tensor(pads, device=c.length.device))
    if input_ids.is_cuda and graph_width(p, b) == p:  # a short batch: one masked pass, the same with or without graph
        h_last = dec.prefill_graphs.run(dec, input_ids, graph and dec.reusable)
    else:
        chunk = chunk or chunk_for(b, padded=any(pads))
        for start in range(0, p, chunk):
            end = min(start + chunk, p)
            h_last = _forward(dec, input_ids[:, start:end], start, plain=not any(pads))[:, -1]
    dec.choose(L.logits(dec.weights, h_last))
    dec.set_length(p)
    return dec.logits


def _check_fits(dec, b: int, p: int, pads: list[int]) -> None:
    """A prefill of ``[b, p]`` with ``pads`` fits this decoder's empty cache, or a one-line error."""
    c = dec.cache
    room = c.min_slots - (c.min_slots < c.slots)  # a compact layer keeps a slot free for the first new token
    if b != dec.batch or p > room or len(pads) != b or any(not 0 <= x < p for x in pads):
        raise ValueError(f"prefill of [{b}, {p}] with pads {pads} does not fit a cache of {dec.batch} rows × "
                         f"{room} slots (each row needs at least one token)")
    if dec.position:
        raise RuntimeError("prefill needs an empty cache; make a new decoder for a new request")


class PrefillGraphs:
    """A decoder's prefill graphs: per width of :data:`GRAPH_WIDTHS` it has prefilled before, a CUDA graph of the
    dense pass over that width (the ids copied into its input, the pads read from the cache's), all in one memory
    pool, since they never run at once. A width's first prefill runs eagerly: a decoder that serves one request
    captures nothing, and the capture needs no warm-up of its own (that run compiled and loaded every kernel)."""

    def __init__(self) -> None:
        self.graphs: dict[int, tuple[torch.Tensor, Any, torch.Tensor]] = {}  # width → input ids, graph, last hidden
        self.seen: set[int] = set()
        self.pool: Any = None

    def run(self, dec, ids: torch.Tensor, graph: bool) -> torch.Tensor:
        """The last position's normed hidden states ``[B, H]`` of the dense pass over ``ids [B, width]``."""
        width = ids.shape[1]
        if graph and width in self.seen and width not in self.graphs:
            self.graphs[width] = self._capture(dec, width)
        self.seen.add(width)
        if width not in self.graphs:
            return _forward(dec, ids, 0, plain=False)[:, -1]
        inputs, cuda_graph, out = self.graphs[width]
        inputs.copy_(ids)
        cuda_graph.replay()
        return out

    def _capture(self, dec, width: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
        self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        inputs = torch.zeros(dec.batch, width, dtype=torch.long, device=dec.cache.length.device)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=self.pool):
            out = _forward(dec, inputs, 0, plain=False)[:, -1]
        return inputs, cuda_graph, out


@dataclass
class Prefilled:
    """A prefill's result in the model's own KV head order, which another decoder over the same weights loads
    instead of reading the prompts again (:func:`load`): several policies evaluated on one batch share one
    prefill, the dense pass that every policy starts from."""

    ids: torch.Tensor  # [B, P] the left-padded prompt ids
    pads: list[int]
    k: list[torch.Tensor]  # per layer [B, Hkv, P, D] (a ring: the last min(P, window) slots', in slot order)
    v: list[torch.Tensor]
    logits: torch.Tensor  # [B, V] the last prompt position's

    def matches(self, ids: torch.Tensor, pads: list[int]) -> bool:
        return self.ids.shape == ids.shape and list(self.pads) == list(pads) and \
            bool(torch.equal(self.ids, ids.to(self.ids.device)))


def snapshot(dec, ids: torch.Tensor, pads: list[int]) -> Prefilled:
    """The prompt's K/V and last logits of a decoder that has just prefilled ``ids`` (copies, model head order)."""
    c, p = dec.cache, ids.shape[1]
    if c.paged:
        raise ValueError("snapshot reads a contiguous cache; a paged one serves the scheduler's rows")
    if dec.position != p:
        raise RuntimeError(f"snapshot needs the decoder right after its prefill of {p} tokens (it holds {dec.position})")
    k, v = [], []
    for i in range(len(c.k)):
        if i in c.rings:  # what any decoder's ring keeps of the prompt, whatever its size (at least min(P, window))
            ki, vi = c.read_ring(i, p - min(p, c.rings[i]), p)
        else:
            ki, vi = c.k[i][:, :, :p], c.v[i][:, :, :p]
        if c.head_order is not None:  # slot j holds the model's head order[j]: back to the model's order
            back = torch.argsort(c.head_order[i]).to(ki.device)
            ki, vi = ki.index_select(1, back), vi.index_select(1, back)
        k.append(ki.clone())
        v.append(vi.clone())
    return Prefilled(ids.clone(), list(pads), k, v, dec.logits.clone())


def load(dec, pre: Prefilled) -> torch.Tensor:
    """:func:`prefill` from a :class:`Prefilled` of the same prompts and model: the K/V copied into this
    decoder's cache (in its head order), the next tokens chosen from the kept logits."""
    c = dec.cache
    b, p = pre.ids.shape
    if c.paged:
        raise ValueError("load writes a contiguous cache; a paged one serves the scheduler's rows")
    _check_fits(dec, b, p, pre.pads)
    want = [(b, dec.shape.kv_heads, min(p, c.rings[i]) if i in c.rings else p, dec.shape.head_dim)
            for i in range(len(c.k))]
    if len(pre.k) != len(c.k) or any(tuple(t.shape) != shape or t.dtype != c.k[0].dtype
                                     for t, shape in zip(pre.k + pre.v, want * 2)):
        raise ValueError(f"the prefill's K/V are not this model's: {len(c.k)} layers of {want[0]} in "
                         f"{c.k[0].dtype} needed")
    c.pads.copy_(torch.tensor(pre.pads, device=c.length.device))
    for i in range(len(c.k)):
        k, v = pre.k[i], pre.v[i]
        if c.head_order is not None:
            order = c.head_order[i].to(k.device)
            k, v = k.index_select(1, order), v.index_select(1, order)
        if i in c.rings:
            c.write_ring(i, p - k.shape[2], k, v)
        else:
            c.k[i][:, :, :p].copy_(k)
            c.v[i][:, :, :p].copy_(v)
    dec.choose(pre.logits)
    dec.set_length(p)
    return dec.logits


def dense_logits(dec, tokens: torch.Tensor, start: int, chunk: int | None = None) -> torch.Tensor:
    """Full attention's logits ``[B, C, V]`` along ``tokens [B, C]`` fed at slots ``start, start + 1, …`` (``start``:
    the prefill's padded width) over the prompt's K/V in the cache, by the prefill's dense pass: the
    teacher-forced reference of a trace a policy generated, without reading the prompt again. Their K/V overwrite
    what the decode steps wrote there, so the decoder's generation is over. A policy that evicts prompt tokens
    (compact layers) leaves no prompt to score against; a sliding layer's ring holds the prompt's last tokens only
    until the first decode step, so with rings this runs right after the prefill (or a :func:`load`)."""
    if compacts(dec):
        raise ValueError(f"policy {dec.policy.name!r} keeps compact layers: the prompt keys it evicted are gone")
    if dec.cache.rings and dec.position != start:
        raise ValueError(f"the sliding layers' rings hold slots up to {dec.position}, not the prompt's last tokens "
                         f"before slot {start}: run the dense pass on a decoder that has just prefilled")
    c, (b, n) = dec.cache, tokens.shape
    if b != dec.batch or not 0 < start <= dec.position or start + n > c.slots:
        raise ValueError(f"{n} tokens at slot {start} do not fit a cache of {dec.batch} rows × {c.slots} slots "
                         f"holding {dec.position}")
    tokens = tokens.to(c.length.device)
    plain = not bool(c.pads.any())
    chunk = chunk or chunk_for(b, padded=not plain)
    parts = [L.logits(dec.weights, _forward(dec, tokens[:, k:k + chunk], start + k, plain=plain))
             for k in range(0, n, chunk)]
    return torch.cat(parts, 1) if parts else dec.logits.new_empty(b, 0, dec.shape.vocab)


def keeps_prompt(dec) -> bool:
    """Whether the prompt's K/V are still in the cache after decoding: no layer of the policy's is compact, and
    no sliding layer keeps a ring (the decode steps overwrite the prompt's last tokens there)."""
    return not compacts(dec) and not dec.cache.rings


def compacts(dec) -> bool:
    """Whether the decoder's policy keeps compact layers (Lethe's), which evict prompt tokens from the cache."""
    return bool(getattr(dec.static, "owned_layers", None))


def _masks(windows: list[int | None], start: int, end: int, q_slots: torch.Tensor, pad_t: torch.Tensor,
           plain: bool) -> dict[int | None, list[tuple[int, int, int, torch.Tensor]] | None]:
    """Per attention window of the model (None: none), what a chunk of queries at slots ``start … end − 1`` reads:
    None where SDPA's causal kernel serves (``plain``, no window), else its blocks of queries as (first and end
    query in the chunk, first key slot read, mask ``[B, 1, queries, keys]``); ``pad_t [B, 1]`` each row's first
    real slot."""
    masks: dict[int | None, list[tuple[int, int, int, torch.Tensor]] | None] = {}
    for window in set(windows):
        if plain and window is None:
            masks[window] = None
            continue
        block = end - start if window is None else max(window, WINDOW_BLOCK)
        masks[window] = []
        for q0 in range(start, end, block):
            q1 = min(q0 + block, end)
            first = 0 if window is None else max(0, q0 - window + 1)  # a window reads no key before this
            qs, ks = q_slots[q0 - start:q1 - start], torch.arange(first, q1, device=q_slots.device)
            m = (ks[None, None, :] <= qs[None, :, None]) & (ks[None, None, :] >= pad_t[:, :, None])
            if window is not None:
                m = m & (ks[None, None, :] > qs[None, :, None] - window)
            # a padding slot reads itself: no query row is empty, so no NaN reaches the cache
            m = m | (ks[None, None, :] == qs[None, :, None])
            masks[window].append((q0 - start, q1 - start, first, m[:, None]))
    return masks


def _forward(dec, input_ids: torch.Tensor, start: int, plain: bool) -> torch.Tensor:
    """The dense pass of ``input_ids [B, C]`` at slots ``start …``: writes their K/V into the cache and returns the
    last layer's normed hidden states ``[B, C, H]``. ``plain`` (no padding): SDPA's causal kernel where no window
    applies, aligned to the lower right when the chunk starts past slot 0."""
    s, w, c = dec.shape, dec.weights, dec.cache
    device = c.length.device
    end = start + input_ids.shape[1]
    pad_t = c.pads[:, None]  # [B, 1]
    g = s.heads // s.kv_heads
    q_slots = torch.arange(start, end, device=device)  # [C]
    positions = (q_slots[None, :] - pad_t).clamp_min(0)  # [B, C]
    masks = _masks(s.windows, start, end, q_slots, pad_t, plain)
    rope = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in dec._rope.items()}  # [B, C, D]
    x, h = L.first_input(w, input_ids)  # [B, C, H]
    for i, lw in enumerate(w.layers):
        order = dec.head_maps[i]  # the cache's head order: q, k, v in it, the output back in the model's
        q, k, v = L.qkv(lw, s, h, *rope[s.rope_kinds[i]], order)  # [B, C, H*, D]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, C, D]
        if i in c.rings:  # the keys of slots base .. end - 1: the window before the chunk, from the ring, and its own
            base = max(0, start - s.windows[i] + 1)
            if base == start:  # the first chunk: nothing before it
                keys_all, values_all = k, v
            else:
                before_k, before_v = c.read_ring(i, base, start)
                keys_all, values_all = torch.cat([before_k, k], 2), torch.cat([before_v, v], 2)
            c.write_ring(i, start, k, v)
        else:  # slots 0 .. end - 1: the chunk's own and, past the first chunk, those before it from the cache
            c.write_span(i, start, k, v)
            base, (keys_all, values_all) = 0, ((k, v) if start == 0 else c.read_span(i, end))
        blocks, q = masks[s.windows[i]], q.transpose(1, 2)  # q [B, Hq, C, D]
        if blocks is None:
            causal = {"is_causal": True} if start == 0 else {"attn_mask": causal_lower_right(end - start, end)}
            o = F.scaled_dot_product_attention(q, keys_all, values_all, **causal,
                                               scale=s.attention_scale, enable_gqa=g > 1)
        else:
            parts = []
            for q0, q1, first, mask in blocks:
                keys = keys_all[:, :, first - base:start + q1 - base]
                values = values_all[:, :, first - base:start + q1 - base]
                if g > 1:
                    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
                parts.append(F.scaled_dot_product_attention(q[:, :, q0:q1], keys, values, attn_mask=mask,
                                                            scale=s.attention_scale))
            o = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
        o = L.placed(o, None, order)  # [B, Hq, C, D] in the model's head order
        x, h = L.finish_layer(w, i, x, o.transpose(1, 2).flatten(2))
    return h
