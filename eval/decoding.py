"""The engine driven for evaluation, beyond what a user's decoding needs.

* :func:`traced_generate`: :func:`rolecall.runtime.engine.generate` that also gives full attention's logits
  along the generated tokens (the reference of a policy's), and shares one prefill between policies (kept from
  one request, loaded by the next), returned as :class:`Traced`;
* :func:`lockstep`: a policy fed full attention's greedy tokens step by step, the two next-token distributions
  compared on one context (the reasoning suite, :func:`rolecall.eval.fidelity`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rolecall.runtime.engine.decoder import StaticDecoder, pad_left
from rolecall.runtime.engine.generate import Generation, Request, prepare
from rolecall.runtime.engine.prefill import dense_logits, keeps_prompt, snapshot
from rolecall.runtime.engine.prefill import load as load_prefill
from rolecall.runtime.engine.weights import Weights


@dataclass
class Traced(Generation):
    """:class:`~rolecall.runtime.engine.Generation` and, when asked for, per row ``[steps, V]`` full
    attention's logits along the generated tokens (the reference of ``logits[1:]``; a policy that evicted
    prompt keys: from a copy of the prefill, in a full-attention cache), and the prefill the request ran or
    loaded (:class:`rolecall.runtime.engine.prefill.Prefilled`)."""

    reference_logits: list[torch.Tensor] | None = None
    prefilled: Any = None


@torch.no_grad()
def traced_generate(weights: Weights, policy: Any, prompts: list[list[int]], *,
                    reference_logits: bool = False, prefilled: Any = None, keep_prefill: bool = False,
                    prefill_chunk: int | None = None, streamer: Any = None, check_every: int = 8,
                    **request: Any) -> Traced:
    """:func:`rolecall.runtime.engine.generate` (``request``: its other arguments, checked as there), and:
    ``reference_logits``: full attention's logits along the generated tokens (``Traced.reference_logits``,
    timed as ``info["reference_s"]``); ``keep_prefill``: keep a copy of the prefill in ``Traced.prefilled``;
    ``prefilled``: such a copy, made for the same prompts on the same model (with any policy), loaded instead
    of prefilling again (other prompts are refused in one line, ``ValueError``). Not on a kept decoder with
    ``reference_logits`` (its buffers are sized to the request): ``decoders`` is cleared then."""
    decoders = request.pop("decoders", None)
    if decoders is not None and reference_logits:
        decoders.clear()  # its memory goes to this request's decoder, which is not kept
        decoders = None
    width = prefilled.ids.shape[1] if prefilled is not None else None
    req = prepare(weights, policy, prompts, decoders=decoders, width=width, **request)
    if prefilled is not None and not prefilled.matches(req.ids, req.pads):
        raise ValueError("prefilled holds the prefill of other prompts (ids or padding differ)")
    keep = keep_prefill or (reference_logits and not keeps_prompt(req.dec))

    def fill() -> Any:
        if prefilled is not None:
            load_prefill(req.dec, prefilled)
            return prefilled
        req.fill(prefill_chunk)
        return snapshot(req.dec, req.ids, req.pads) if keep else None

    prefilled = req.prefill(fill=fill)
    out = req.decode(streamer, check_every)
    start = time.perf_counter()
    reference = _reference(weights, req, prefilled) if reference_logits else None
    req.sync()
    out.info["reference_s"] = time.perf_counter() - start
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(Generation)}
    return Traced(**fields, reference_logits=reference, prefilled=prefilled if keep_prefill else None)


def _reference(weights: Weights, req: Request, prefilled: Any) -> list[torch.Tensor]:
    """Full attention's logits at each step after the first, over the tokens the policy generated, in the same
    slots: on the request's decoder where its policy kept the prompt, else (the policy's decoder, its cache
    and graphs let go first) on a full decoder loaded with the prefill's copy."""
    new = req.stopper.out[:, :int(req.stopper.count) - 1]
    dec = req.dec
    if not keeps_prompt(dec):
        rows, slots = dec.batch, dec.max_len
        req.dec = dec = None
        dec = _full_with_prompt(weights, rows, slots, prefilled)
    return list(dense_logits(dec, new, req.ids.shape[1]))


def _full_with_prompt(weights: Weights, batch: int, slots: int, prefilled: Any) -> StaticDecoder:
    """A full-attention decoder over ``weights`` (the model's) with the prefill loaded, for the dense pass
    only: the reference of a policy that evicted prompt keys (it reads them all)."""
    from rolecall.runtime.policies.full import Full

    full = StaticDecoder(weights, Full(), batch, slots, kernels="naive", compile=False)  # no step runs
    load_prefill(full, prefilled)
    return full


@dataclass
class Lockstep:
    """Per row of :func:`lockstep`: the reference's greedy tokens, and per step after the first the KL
    divergence ``KL(p_ref ‖ p_policy)`` and whether the policy's top token is the reference's."""

    tokens: list[list[int]]
    kl: list[torch.Tensor]  # [steps] float32
    agree: list[torch.Tensor]  # [steps] bool

    def divergence(self, row: int) -> int | None:
        """The first generated position (1-based, the prefill's token being 1) whose token the policy would
        choose otherwise, or None when it agrees all along."""
        miss = (~self.agree[row]).nonzero()
        return int(miss[0]) + 2 if len(miss) else None


@torch.no_grad()
def lockstep(weights: Weights, policy: Any, prompts: list[list[int]],
             compare: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], *,
             max_new_tokens: int, eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
             kernels: str = "auto", graphs: bool | None = None) -> Lockstep:
    """Full attention decodes every prompt greedily; ``policy`` is fed the very same tokens (teacher forcing)
    in a second decoder over the same weights, so each step compares the two next-token distributions on one
    context: ``compare(full_logits, policy_logits)`` (``[B, V]`` each) gives the step's KL ``[B]`` and top-1
    agreement ``[B]`` (``rolecall.eval.step_divergence``). A row ends at its first EOS (kept). ``policy``
    never falls back to the full step here."""
    from rolecall.runtime.policies.full import Full

    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
    ids, pads = pad_left(prompts, pad_token_id, weights.device)
    slots = ids.shape[1] + max_new_tokens
    decoders = [StaticDecoder(weights, p, len(prompts), slots, min_context=0, kernels=kernels,
                              prompt_tokens=ids.shape[1]) for p in (Full(), policy)]
    for dec in decoders:
        dec.prefill(ids, pads)
        if (weights.device.type == "cuda" if graphs is None else graphs) and max_new_tokens > 1:
            dec.capture()
    ref, pol = decoders
    trace = [ref.tokens.clone()]
    kl, agree = [], []
    for _ in range(max_new_tokens - 1):
        token = trace[-1]
        step_kl, step_agree = compare(ref.step(token), pol.step(token))
        kl.append(step_kl)
        agree.append(step_agree)
        trace.append(ref.tokens.clone())  # the reference's greedy choice
    tokens = torch.stack(trace, 1).cpu().tolist()
    kl_all = torch.stack(kl, 1).cpu() if kl else torch.zeros(len(prompts), 0)
    agree_all = torch.stack(agree, 1).cpu() if agree else torch.zeros(len(prompts), 0, dtype=torch.bool)
    out = Lockstep([], [], [])
    for r, row in enumerate(tokens):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.tokens.append(row[:end])
        out.kl.append(kl_all[r, :end - 1])
        out.agree.append(agree_all[r, :end - 1])
    return out


__all__ = ["Lockstep", "Traced", "lockstep", "traced_generate"]
