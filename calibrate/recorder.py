"""The recording attention function: normal attention output, plus statistics of sampled query rows.

transformers calls :class:`AttentionRecorder` through ``AttentionInterface`` (see ``rolecall.runtime.attention``) once per
layer and forward. It first returns exactly what SDPA returns, so the model's outputs do not change; then, for
the sampled query positions inside the current chunk (every ``stride`` tokens from ``min_context`` on), it
computes those rows' attention probabilities in float32 over their causal prefix, ``query_block`` rows at a
time (never ``[H, T, T]``: at most ``[Hq, query_block, T]``), and folds them into :class:`CalibrationTotals`.

Teacher forcing makes this exact: in a causal forward pass over a trace, the row of position t is the
attention of decode step t, so one pass per trace replaces token-by-token decoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rolecall.calibrate.stats import cosine_shift, head_max, hoyer_sparsity, page_sums, pair_recall
from rolecall.calibrate.totals import CalibrationTotals
from rolecall.core.distributed import model_device
from rolecall.core.models import cache_keyword
from rolecall.runtime.attention import keep_mask, use_attention

ATTENTION_NAME = "rolecall-record"


class AttentionRecorder:
    """Attention function that records DELTA and Lethe statistics; use it through :meth:`attached`."""

    def __init__(self, num_layers: int, num_heads: int, *, stride: int = 16, min_context: int = 128,
                 page_size: int = 16, num_pages: int = 64, recent_pages: int = 8, bins: int = 8,
                 query_block: int = 16, base: str = "sdpa", layers: list[int] | None = None,
                 full_keys: bool = False):
        if (stride < 1 or min_context < 0 or page_size < 1 or num_pages < recent_pages or recent_pages < 1
                or query_block < 1):
            raise ValueError("recorder needs stride ≥ 1, min_context ≥ 0, page_size ≥ 1, num_pages ≥ recent_pages "
                             "≥ 1 (K counts the L recent pages) and query_block ≥ 1")
        self.num_layers, self.num_heads = num_layers, num_heads
        # Layers to record (default all). The others only run their attention: their rows and columns of the
        # totals stay zero, and the shift of a recorded layer is taken against the previous recorded layer.
        self.layers = sorted(layers) if layers is not None else list(range(num_layers))
        if not self.layers or self.layers[0] < 0 or self.layers[-1] >= num_layers:
            raise ValueError(f"layers to record must be a non-empty subset of 0..{num_layers - 1}, got {layers}")
        self._before = dict(zip(self.layers[1:], self.layers[:-1]))  # recorded layer -> previous recorded layer
        self._recorded = set(self.layers)
        self.full_keys = full_keys  # record_traces keeps every key of every layer (sliding layers are recorded)
        self.stride, self.min_context, self.page_size = stride, min_context, page_size
        self.num_pages, self.recent_pages, self.bins, self.query_block = num_pages, recent_pages, bins, query_block
        self._inner = ALL_ATTENTION_FUNCTIONS[base]
        self.totals: CalibrationTotals | None = None
        self._length = 0
        self._last_a: dict[int, torch.Tensor] = {}  # layer -> a [t+1] of the trace's latest sampled query
        self._reset_chunk()

    # -- driving -----------------------------------------------------------------------------------------------
    @contextmanager
    def attached(self, model: torch.nn.Module) -> Iterator[AttentionRecorder]:
        """Record while inside the block; the model's previous attention implementation comes back on exit."""
        with use_attention(model, self, ATTENTION_NAME):
            yield self

    def begin_trace(self, length: int) -> None:
        """Call before the first forward of a trace of ``length`` tokens (sets the bins, resets the drift)."""
        self._length = int(length)
        self._last_a = {}
        self._reset_chunk()

    def sampled_positions(self, start: int, end: int) -> list[int]:
        """Sampled query positions in ``[start, end)`` of the current trace."""
        first = self.min_context + max(0, -(-(start - self.min_context) // self.stride)) * self.stride
        return list(range(first, min(end, self._length), self.stride))

    def flush(self) -> None:
        """Fold the recall of the chunk just run into the totals (call after every forward)."""
        if self.totals is not None and self._score:
            layers = sorted(self._score)
            if layers != self.layers:
                raise RuntimeError(f"recorder saw layers {layers} in one forward, expected {self.layers}")
            score = torch.stack([self._score[i] for i in layers])  # [Lr, Q, P]
            mass = torch.stack([self._mass[i] for i in layers])  # [Lr, Q, P]
            recall = pair_recall(score, mass, self._pages, self.num_pages, self.recent_pages)  # [Lr, Lr, Q]
            idx = torch.tensor(layers, device=self.totals.recall_sum.device)
            self.totals.recall_sum[idx[:, None], idx[None, :]] += recall.sum(-1).double()
            self.totals.recall_count += recall.shape[-1]
        self._reset_chunk()

    def _reset_chunk(self) -> None:
        self._score: dict[int, torch.Tensor] = {}  # layer -> [Q, P] page scores Σ a over the page
        self._mass: dict[int, torch.Tensor] = {}  # layer -> [Q, P] head-mean attention mass per page
        self._pages = torch.zeros(0, dtype=torch.long)  # [Q] page index of each sampled query
        self._prev: tuple[int, torch.Tensor] | None = None  # (layer, a [Q, T]) of the layer just recorded

    # -- the attention function --------------------------------------------------------------------------------
    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        out = self._inner(module, query, key, value, attention_mask, **kwargs)
        if module.layer_idx in self._recorded:
            with torch.no_grad():
                self._record(module.layer_idx, query, key, attention_mask, kwargs)
        return out

    def _record(self, layer: int, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs) -> None:
        # query [B, Hq, S, D] after RoPE, key [B, Hkv, T, D]: the queries are the last S of the T positions.
        b, hq, s, d = query.shape
        t_len = key.shape[2]
        if b != 1:
            raise ValueError(f"the recorder takes one trace per forward, got a batch of {b}; pass traces one by one")
        positions = self.sampled_positions(t_len - s, t_len)
        if not positions:
            return
        if self.totals is None:
            self.totals = CalibrationTotals.zeros(self.num_layers, hq, self.bins, device=query.device)
        tot = self.totals
        dev = query.device
        pos = torch.tensor(positions, device=dev)  # [Q]
        keep = keep_mask(attention_mask, s, t_len, device=dev)[0, 0]  # [S or 1, T]
        keep = keep.expand(s, t_len)[pos - (t_len - s)]  # [Q, T]
        scaling = kwargs.get("scaling") or d ** -0.5
        softcap = kwargs.get("softcap")
        groups = hq // key.shape[1]
        a_rows, score_rows, mass_rows = [], [], []
        for i in range(0, len(positions), self.query_block):
            blk = slice(i, i + self.query_block)
            end = max(positions[blk]) + 1  # keys beyond the block's last query are masked anyway (host ints: no sync)
            q = query[0, :, (pos[blk] - (t_len - s))].float()  # [Hq, Qb, D]
            k = key[0, :, :end].float()  # [Hkv, Tb, D]
            # Group query heads by their KV head instead of repeating K: [Hkv, G*Qb, D] @ [Hkv, D, Tb].
            logits = (q.reshape(key.shape[1], groups * q.shape[1], d) @ k.transpose(1, 2)).reshape(hq, -1, end)
            logits = logits * scaling
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            allowed = keep[blk, :end]  # [Qb, Tb]
            p = logits.masked_fill(~allowed, float("-inf")).softmax(-1)  # [Hq, Qb, Tb]
            p = torch.nan_to_num(p, nan=0.0)  # a row with no allowed key (padding) contributes zeros
            pad = (0, t_len - end)
            a = torch.nn.functional.pad(head_max(p), pad)  # [Qb, T]
            hoyer = hoyer_sparsity(p, allowed.sum(-1))  # [Hq, Qb]
            a_rows.append(a)
            score_rows.append(page_sums(a, self.page_size))
            mass_rows.append(page_sums(torch.nn.functional.pad(p.mean(0), pad), self.page_size))
            self._add_hoyer(layer, pos[blk], hoyer)
        a = torch.cat(a_rows)  # [Q, T]
        tdev = tot.shift_sum.device
        self._score[layer] = torch.cat(score_rows).to(tdev)
        self._mass[layer] = torch.cat(mass_rows).to(tdev)
        self._pages = (pos // self.page_size).to(tdev)
        if self._prev is not None and self._prev[0] == self._before.get(layer):
            shift = cosine_shift(self._prev[1].to(dev), a)  # [Q]
            tot.shift_sum[layer] += shift.sum().double().to(tdev)
            tot.shift_count[layer] += len(positions)
        self._prev = (layer, a)
        self._add_drift(layer, a, positions)

    def _bin(self, pos: torch.Tensor) -> torch.Tensor:
        # Decode-time bins are fractions of each trace's sampled span, so traces of any length share them.
        span = max(self._length - self.min_context, 1)
        return ((pos - self.min_context).clamp_min(0) * self.bins // span).clamp_max(self.bins - 1)

    def _add_hoyer(self, layer: int, pos: torch.Tensor, hoyer: torch.Tensor) -> None:
        tot = self.totals
        tdev = tot.hoyer_sum.device
        bins = self._bin(pos).to(tdev)  # [Qb]
        tot.hoyer_sum[layer].index_add_(1, bins, hoyer.double().to(tdev))
        tot.hoyer_count[layer].index_add_(0, bins, torch.ones_like(bins, dtype=torch.float64))
        if layer == self.layers[0]:
            tot.position_sum.index_add_(0, bins, pos.double().to(tdev))
            tot.position_count.index_add_(0, bins, torch.ones_like(bins, dtype=torch.float64))

    def _add_drift(self, layer: int, a: torch.Tensor, positions: list[int]) -> None:
        # Cosine between a layer's a at consecutive sampled queries of the trace (the earlier one is zero on
        # the keys that did not exist yet). The last row is kept, cropped to its prefix, for the next chunk.
        prev = self._last_a.get(layer)
        rows = a if prev is None else torch.cat([torch.nn.functional.pad(prev.to(a.device), (0, a.shape[1] - prev.shape[0]))[None], a])
        if rows.shape[0] > 1:
            cos = 1.0 - cosine_shift(rows[:-1], rows[1:])  # [pairs]
            tot = self.totals
            tot.drift_sum[layer] += cos.sum().double().to(tot.drift_sum.device)
            tot.drift_count[layer] += cos.shape[0]
        self._last_a[layer] = a[-1, : positions[-1] + 1].clone()


def record_traces(model: torch.nn.Module, traces: list[list[int]], recorder: AttentionRecorder,
                  chunk_size: int = 4096, progress: bool = True) -> CalibrationTotals:
    """Run every trace through ``model`` (one forward per chunk of ``chunk_size`` tokens) while recording.

    Returns the recorder's totals (an all-zero total when no trace was long enough to sample a query).
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    device = model_device(model)
    if recorder.totals is None:
        recorder.totals = CalibrationTotals.zeros(recorder.num_layers, recorder.num_heads, recorder.bins, device=device)
    # no_grad, not inference_mode: ZeRO-3 re-partitions the weights after each forward, and under inference_mode
    # their shards would become inference tensors that no later autograd pass (train-heads) can use
    keyword = cache_keyword(model)
    with recorder.attached(model), torch.no_grad():
        for ids in tqdm(traces, desc="recording attention", unit="trace", disable=not progress):
            recorder.begin_trace(len(ids))
            x = torch.tensor([list(ids)], dtype=torch.long, device=device)
            # A cache built from the config crops sliding-window layers to their window; recording one needs
            # every key (key index = position), and the sliding mask still comes from the config.
            cache = None
            if len(ids) > chunk_size:
                cache = DynamicCache() if recorder.full_keys else DynamicCache(config=model.config)
            for c0 in range(0, len(ids), chunk_size):
                # logits_to_keep=1: the vocabulary projection of every position would dwarf the recording.
                model(input_ids=x[:, c0 : c0 + chunk_size], **{keyword: cache}, use_cache=cache is not None,
                      logits_to_keep=1)
                recorder.flush()
            recorder.totals.traces += 1
            recorder.totals.tokens += len(ids)
    return recorder.totals
