"""rolecall's one integration point with transformers: a named function in ``AttentionInterface``.

transformers calls the function named by ``config._attn_implementation`` as::

    fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs) -> (output, weights)

with ``query`` ``[B, Hq, S, D]`` after RoPE, ``key``/``value`` ``[B, Hkv, T, D]`` from the cache (T ≥ S, the
last S keys are the queries' own positions), ``module.layer_idx`` set, and ``output`` expected as
``[B, S, Hq, D]``. :func:`use_attention` registers a function under a name, switches a model to it with
``set_attn_implementation`` and switches back on exit, also when the body raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def register_attention(name: str, fn: AttentionFn, mask_like: str = "sdpa") -> None:
    """Register ``fn`` under ``name``, with the mask builder of ``mask_like`` (``sdpa`` gives boolean masks
    or ``None`` when the mask is plainly causal, which is what every rolecall function expects)."""
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_like])


@contextmanager
def use_attention(model: torch.nn.Module, fn: AttentionFn, name: str = "rolecall",
                  mask_like: str = "sdpa") -> Iterator[torch.nn.Module]:
    """Run ``model`` with ``fn`` as its attention inside the ``with`` block; restore the previous one after."""
    register_attention(name, fn, mask_like)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def passthrough(base: str = "sdpa") -> AttentionFn:
    """An attention function that only forwards to the registered implementation ``base``."""
    inner = ALL_ATTENTION_FUNCTIONS[base]

    def attention(module, query, key, value, attention_mask, **kwargs):
        return inner(module, query, key, value, attention_mask, **kwargs)

    return attention


def keep_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int,
              device: torch.device | None = None) -> torch.Tensor:
    """Which keys each query may read, as a boolean ``[B or 1, 1, S, T]`` (True = attend).

    ``attention_mask`` is what transformers passes: ``None`` for a plain causal mask (queries are the last
    ``q_len`` of the ``kv_len`` positions), a boolean mask, or an additive float mask.
    """
    if attention_mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        k_pos = torch.arange(kv_len, device=device)
        return (k_pos[None, :] <= q_pos[:, None])[None, None]
    mask = attention_mask[..., :kv_len]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` → ``[B, Hkv * groups, T, D]``, each KV head repeated for its query heads."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)
