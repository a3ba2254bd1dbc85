"""Prefill: the prompt's K/V into the static cache, in chunks, with fused SDPA attention.

Chunks bound the activation memory (a 128K-token prompt never holds a ``[P, P]`` score matrix). The first
chunk of an unpadded batch without sliding windows runs SDPA's causal kernel (flash attention on the GPU);
later chunks, padded rows and windows pass a boolean mask (then grouped K/V heads are repeated for the
masked kernel, which does not take grouped heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.engine import layers as L

DEFAULT_CHUNK = 4096


def prefill(dec, input_ids: torch.Tensor, pads: list[int] | None = None, chunk: int | None = None) -> torch.Tensor:
    """See :meth:`runtime.engine.decoder.StaticDecoder.prefill`."""
    s, w, c = dec.shape, dec.weights, dec.cache
    b, p = input_ids.shape
    pads = list(pads or [0] * b)
    room = c.min_slots - (c.min_slots < c.slots)  # a compact layer keeps a slot free for the first new token
    if b != dec.batch or p > room or len(pads) != b or any(not 0 <= x < p for x in pads):
        raise ValueError(f"prefill of [{b}, {p}] with pads {pads} does not fit a cache of {dec.batch} rows × "
                         f"{room} slots (each row needs at least one token)")
    if dec.position:
        raise RuntimeError("prefill needs an empty cache; make a new decoder for a new request")
    device = c.length.device
    input_ids = input_ids.to(device)
    c.pads.copy_(torch.tensor(pads, device=device))
    chunk = chunk or DEFAULT_CHUNK
    pad_t = c.pads[:, None]  # [B, 1]
    g = s.heads // s.kv_heads
    h_last = None
    for start in range(0, p, chunk):
        end = min(start + chunk, p)
        q_slots = torch.arange(start, end, device=device)  # [C]
        k_slots = torch.arange(end, device=device)  # [T]
        positions = (q_slots[None, :] - pad_t).clamp_min(0)  # [B, C]
        plain = start == 0 and not any(pads)
        masks = {}
        for window in set(s.windows):
            if plain and window is None:
                masks[window] = None  # SDPA's causal kernel
                continue
            m = (k_slots[None, None, :] <= q_slots[None, :, None]) & (k_slots[None, None, :] >= pad_t[:, :, None])
            if window is not None:
                m = m & (k_slots[None, None, :] > q_slots[None, :, None] - window)
            # a padding slot reads itself: no query row is empty, so no NaN reaches the cache
            m = m | (k_slots[None, None, :] == q_slots[None, :, None])
            masks[window] = m[:, None]  # [B, 1, C, T]
        rope = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in dec._rope.items()}  # [B, C, D]
        x, h = L.first_input(w, input_ids[:, start:end])  # [B, C, H]
        for i, lw in enumerate(w.layers):
            q, k, v = L.qkv(lw, s, h, *rope[s.rope_kinds[i]])  # [B, C, H*, D]
            c.k[i][:, :, start:end] = k.transpose(1, 2)
            c.v[i][:, :, start:end] = v.transpose(1, 2)
            keys, values = c.k[i][:, :, :end], c.v[i][:, :, :end]
            mask = masks[s.windows[i]]
            if mask is None:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True,
                                                   scale=s.attention_scale, enable_gqa=g > 1)
            else:
                if g > 1:
                    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                                   scale=s.attention_scale)
            x, h = L.finish_layer(w, i, x, o.transpose(1, 2).flatten(2))
        h_last = h[:, -1]
    dec.choose(L.logits(w, h_last))
    dec.set_length(p)
    return dec.logits
