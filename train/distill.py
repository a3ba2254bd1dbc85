"""One distillation step: the frozen model as teacher (its own attention) and as student (hybrid attention).

A sample is ``input_ids`` and ``labels`` (1-D; labels −100 except on the target tokens, e.g. passkey
answers, aligned with ``input_ids`` as in transformers). Everything before the target span is the prompt:

1. the teacher prefills the prompt once, in chunks, into a KV cache (no gradients);
2. the teacher runs the target span on top of that cache and gives logits y_T;
3. the cache is cropped back to the prompt, and the student runs the same span with hybrid attention,
   reading the teacher's prompt keys and values, and gives logits y_S;
4. loss = Σ_t ‖y_S[t] − y_T[t]‖² / N over the N target tokens.

So the student differs from the teacher only in how the target-span queries read the context, which is
what head roles change at decode time, and the prompt is processed once per step however long it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from rolecall.core.distributed import model_device, pad_forwards
from rolecall.core.models import cache_keyword, sliding_layers
from rolecall.runtime.attention import use_attention
from rolecall.train.hybrid import ATTENTION_NAME, HybridAttention


class NotFiniteError(FloatingPointError, ValueError):
    """A loss or gradient became NaN/inf; the message names the step and the tensor."""


@dataclass
class TargetSpan:
    prompt: Tensor  # [1, P] token ids before the span
    span: Tensor  # [1, S] inputs whose logits predict the targets
    mask: Tensor  # [S] bool, True where the predicted token is a target

    @property
    def num_targets(self) -> int:
        return int(self.mask.sum())


def split_sample(input_ids: Tensor, labels: Tensor) -> TargetSpan:
    """Prompt, target span and target mask of one sample; the logits at position t predict token t + 1."""
    ids, lab = input_ids.reshape(-1), labels.reshape(-1)
    if ids.shape != lab.shape:
        raise ValueError(f"input_ids and labels must have the same length, got {ids.numel()} and {lab.numel()}")
    where = torch.nonzero(lab != -100).flatten()
    if where.numel() == 0:
        raise ValueError("a sample has no target tokens (every label is -100); label the answer tokens")
    first, last = int(where[0]), int(where[-1])
    if first < 1:
        raise ValueError("the first target token is the first token of the sample; put a prompt before it")
    return TargetSpan(prompt=ids[None, : first - 1], span=ids[None, first - 1 : last],
                      mask=lab[first : last + 1] != -100)


def prefill_calls(prompt_tokens: int, chunk: int) -> int:
    return -(-prompt_tokens // chunk)


@torch.no_grad()
def prefill(model, prompt: Tensor, chunk: int, calls: int | None = None) -> DynamicCache:
    """The teacher's KV cache for ``prompt`` [1, P], filled ``chunk`` tokens at a time.

    ``calls``: run the model this many times in all, padding with one-token forwards that touch no cache
    (:func:`rolecall.core.distributed.pad_forwards`): under ZeRO-3 processes with shorter prompts pad up to the
    longest one's chunk count.
    """
    # A sliding-window cache layer cannot be cropped back (step 3) once past its window: on a hybrid model keep
    # every key of every layer; the sliding layers' masks still come from the config.
    cache = DynamicCache() if sliding_layers(model) else DynamicCache(config=model.config)
    keyword = cache_keyword(model)
    for start in range(0, prompt.shape[1], chunk):
        # logits_to_keep=1: the prompt's logits are never used, so skip the [chunk, vocab] projection
        model(input_ids=prompt[:, start : start + chunk], **{keyword: cache}, use_cache=True, logits_to_keep=1)
    pad_forwards(model, prompt, (calls or 0) - prefill_calls(prompt.shape[1], chunk))
    return cache


def _drop_after(cache: DynamicCache, length: int) -> None:
    """Forget every cached position from ``length`` on (a negative count means the same in every release)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def distill_loss(model, hybrid: HybridAttention, z: Tensor, input_ids: Tensor, labels: Tensor,
                 prefill_chunk: int = 1000, calls: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one sample and the tensors it came from (for diagnostics).

    ``z`` [L − 1, Hkv] are the gate values of layers 1..L−1 (layer 0 is always retrieval). ``calls``: see
    :func:`prefill`.
    """
    device = model_device(model)
    sample = split_sample(input_ids.to(device), labels.to(device))
    cache = prefill(model, sample.prompt, prefill_chunk, calls)
    prompt_len = sample.prompt.shape[1]
    keyword = cache_keyword(model)
    with torch.no_grad():
        teacher = model(input_ids=sample.span, **{keyword: cache}, use_cache=True).logits[0].float()  # [S, V]
    _drop_after(cache, prompt_len)
    hybrid.gates = z
    try:
        with use_attention(model, hybrid, ATTENTION_NAME):
            student = model(input_ids=sample.span, **{keyword: cache}, use_cache=True).logits[0].float()  # [S, V]
    finally:
        hybrid.gates = None
    diff = (student - teacher)[sample.mask]  # [N, V]
    loss = diff.pow(2).sum() / sample.num_targets
    return loss, {"student logits": student, "teacher logits": teacher, "gates z": z}
