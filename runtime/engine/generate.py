"""Generation on the engine: prefill, then graph-replayed steps, stopping per row, text streamed as it comes.

The step chooses the next token (:mod:`rolecall.runtime.engine.sampling`) and keeps the books of finished rows on the
device (:class:`Stopper`): a row finishes on an EOS token or at its ``max_new_tokens``, and from then on emits
padding. The host looks only every ``check_every`` steps: to stop when every row is done, to stream text and
to look for stop strings (a row whose text contains one is finished there and cut after it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rolecall.runtime.engine.compiling import compiles_on, rows_for
from rolecall.runtime.engine.decoder import StaticDecoder, pad_left
from rolecall.runtime.engine.prefill import dense_logits, graph_width, keeps_prompt, snapshot
from rolecall.runtime.engine.prefill import load as load_prefill
from rolecall.runtime.engine.sampling import Sampler, Sampling
from rolecall.runtime.engine.text import TokenText, cut_at_stop
from rolecall.runtime.engine.weights import Weights


class Stopper:
    """Device-side bookkeeping, called inside the step with the chosen tokens ``[B]``."""

    def __init__(self, batch: int, limits: list[int], eos: list[int], pad: int, device: Any,
                 vocab: int | None = None, dtype: torch.dtype = torch.float32, width: int | None = None) -> None:
        width = max(limits) if width is None else width  # the most tokens a row may take (a reused one: any request)
        self.out = torch.full((batch, width), pad, dtype=torch.long, device=device)  # generated tokens
        self.count = torch.zeros((), dtype=torch.long, device=device)  # tokens generated so far
        self.limits = torch.tensor(limits, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.eos = torch.tensor(eos or [-1], dtype=torch.long, device=device)
        self.pad, self.width = pad, width
        self.logits_out = None
        if vocab is not None:  # per-step logits, for evaluation, in the decoder's dtype (a wider one adds nothing)
            self.logits_out = torch.zeros(batch, width, vocab, dtype=dtype, device=device)
        self.source: torch.Tensor | None = None  # the decoder's logits buffer, set by generate()

    def state(self) -> list[torch.Tensor]:
        extra = [self.logits_out] if self.logits_out is not None else []
        return [self.out, self.count, self.finished, *extra]

    def reset(self, limits: list[int]) -> None:
        """Empty books for a new request of the same rows (a reused decoder), each row its own limit."""
        if len(limits) != len(self.finished) or max(limits) > self.width:
            raise ValueError(f"the stopper keeps {len(self.finished)} rows of up to {self.width} tokens, "
                             f"not {len(limits)} of up to {max(limits)}")
        self.limits.copy_(torch.tensor(limits, dtype=torch.long))
        self.out.fill_(self.pad)
        self.count.zero_()
        self.finished.zero_()

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        token = torch.where(self.finished, self.pad, token)
        at = self.count.clamp_max(self.width - 1).view(1)
        self.out.index_copy_(1, at, token[:, None])
        if self.logits_out is not None:
            self.logits_out.index_copy_(1, at, self.source[:, None])
        self.count.add_(1)
        self.finished |= torch.isin(token, self.eos) | (self.count >= self.limits)
        return token


@dataclass
class Generation:
    """What :func:`generate` returns: per row the generated ids (EOS kept, padding dropped, cut after a stop
    string), why it stopped (``eos``, ``length``, ``stop``), and timings."""

    tokens: list[list[int]]
    finish: list[str]
    prompt_lengths: list[int]
    prefill_s: float
    decode_s: float
    steps: int
    step_logits: torch.Tensor | None = None  # [B, steps + 1, V] in the model's dtype on the device, when asked for
    # per row [steps, V]: full attention's logits along the generated tokens (the reference of logits[1:]), when
    # asked for (a policy that evicted prompt keys: from a copy of the prefill, in a full-attention cache)
    reference_logits: list[torch.Tensor] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    prefilled: Any = None  # the prefill it ran or loaded (rolecall.runtime.engine.prefill.Prefilled), when kept

    @property
    def logits(self) -> list[torch.Tensor] | None:
        """Per row ``[steps + 1, V]``: views of :attr:`step_logits` (no copy), when asked for."""
        return None if self.step_logits is None else list(self.step_logits.unbind(0))

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.decode_s + self.prefill_s, 1e-9)


def _row_end(row: list[int], cut: int | None, eos: list[int]) -> tuple[int, str]:
    """Where a row's answer ends and why: after its stop string (``cut``), else after its first EOS, else at
    its last token (``stop``, ``eos``, ``length``)."""
    if cut is not None:
        return cut, "stop"
    end = next((i + 1 for i, t in enumerate(row) if t in eos), None)
    return (end, "eos") if end is not None else (len(row), "length")


def answer_end(row: list[int], eos: list[int], stop_strings: Any = (), tokenizer: Any = None) -> tuple[int, str]:
    """Where a row of generated ids ends and why (``stop``, ``eos``, ``length``), cut as the engine cuts its rows:
    for the rows of ``model.generate`` (padding after the end) as well as the engine's."""
    return _row_end(row, cut_at_stop(tokenizer, row, list(stop_strings)) if stop_strings else None, eos)


def _stream(streamer: Any, row: list[int], sent: int, cut: int | None, eos: list[int]) -> int:
    """Hand the streamer row 0's tokens from ``sent`` up to its end (its stop string or EOS, inclusive)."""
    end = _row_end(row, cut, eos)[0]
    if end > sent:
        streamer.put(torch.tensor(row[sent:end]))
    return max(sent, end)


MIN_SLOTS = 256  # the smallest cache a kept decoder gets (see Decoders)


class Decoders:
    """The decoder of the last request, kept for the next one (what :class:`runtime.Session` holds): a request of
    the same kind (the same weights and policy objects; rows, sampling, EOS and padding ids, kernels) whose
    prompt and new tokens fit its cache runs on it after a :meth:`StaticDecoder.reset`, so its CUDA graphs replay
    instead of being captured again (at one row, capture took about half of a 128-token request). A decoder is
    built with its slots rounded up to an eighth of a power of two (at most a quarter more cache than the
    request needs), so a run of similar requests fits one; a request that needs more, or of another kind, frees
    the kept decoder first and builds its own."""

    def __init__(self) -> None:
        self._held: tuple[Any, Any, tuple, StaticDecoder] | None = None  # weights, policy, the rest, the decoder

    def take(self, weights: Weights, policy: Any, kind: tuple, slots: int) -> StaticDecoder | None:
        """The kept decoder, reset, when the request is of its kind and needs ``slots``, at least half of its
        cache (or any part of the smallest one); else None, and the kept decoder is freed."""
        if self._held is not None:
            w, p, k, dec = self._held
            if w is weights and p is policy and k == kind and slots <= dec.max_len <= max(2 * slots, MIN_SLOTS):
                dec.reset()
                return dec
        self.clear()
        return None

    @property
    def kept(self) -> StaticDecoder | None:
        """The decoder kept for the next request, or None."""
        return self._held[3] if self._held is not None else None

    def keep(self, weights: Weights, policy: Any, kind: tuple, dec: StaticDecoder) -> None:
        self._held = (weights, policy, kind, dec) if dec.reusable else None

    def clear(self) -> None:
        """Free the kept decoder (its cache, its graphs)."""
        self._held = None

    @staticmethod
    def slots_for(slots: int, most: int) -> int:
        """``slots`` rounded up to a multiple of an eighth of the next power of two (:data:`MIN_SLOTS` at least),
        within ``most`` (never below ``slots``)."""
        step = 1 << max(0, (slots - 1).bit_length() - 3)
        return max(slots, min(max(MIN_SLOTS, -(-slots // step) * step), most))


def _full_with_prompt(weights: Weights, batch: int, slots: int, prefilled: Any) -> StaticDecoder:
    """A full-attention decoder over ``weights`` (the model's) with the prefill loaded, for the dense pass only:
    the reference of a policy that evicted prompt keys (it reads them all)."""
    from rolecall.runtime.policies.full import Full

    full = StaticDecoder(weights, Full(), batch, slots, kernels="naive", compile=False)  # no step runs
    load_prefill(full, prefilled)
    return full


@torch.no_grad()
def generate(weights: Weights, policy: Any, prompts: list[list[int]], *, max_new_tokens: int | list[int] = 64,
             sampling: Sampling | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
             stop_strings: list[str] | tuple[str, ...] = (), tokenizer: Any = None, streamer: Any = None,
             check_every: int = 8, kernels: str = "auto", min_context: int | None = None,
             graphs: bool | None = None, prefill_chunk: int | None = None,
             output_logits: bool = False, reference_logits: bool = False, prefilled: Any = None,
             keep_prefill: bool = False, decoders: Decoders | None = None) -> Generation:
    """Generate for every prompt (token id lists of any lengths: a ragged batch is left-padded).

    ``policy``: a bound policy with a static step. ``streamer``: an object with ``put(ids)`` / ``end()``
    (transformers' ``TextStreamer`` works), fed row 0's prompt first, as ``model.generate`` does, then its new
    tokens at every check. The cache holds ``longest prompt + max(max_new_tokens)`` tokens per row.
    ``keep_prefill``: keep a copy of the prefill in ``Generation.prefilled``; ``prefilled``: such a copy, made for
    the same prompts on the same model (with any policy), loaded instead of prefilling again. ``decoders``: run on
    the decoder it keeps when this request fits it, and keep this request's decoder there (see :class:`Decoders`;
    not with ``output_logits`` or ``reference_logits``, whose buffers are sized to the request).

    Checked before any work (:func:`rolecall.runtime.prompts.check_prompts`), each refused in one line (``ValueError``):
    ``prompts`` a list of token id lists (or 1-D integer tensors) or a ``[batch, tokens]`` integer tensor, each
    prompt at least one id in the model's vocabulary; ``max_new_tokens`` whole numbers ≥ 1; the longest prompt
    plus ``max_new_tokens`` within the positions of the weights' RoPE tables (``Weights.from_model``'s
    ``positions``, by default the model's ``max_position_embeddings``).
    """
    start = time.perf_counter()
    prompts, limits, eos = _request(weights, prompts, max_new_tokens, stop_strings, tokenizer, eos_token_id)
    live, device = len(prompts), weights.device
    if decoders is not None and (output_logits or reference_logits):
        decoders.clear()  # its memory goes to this request's decoder, which is not kept
        decoders = None
    graphs = device.type == "cuda" if graphs is None else graphs
    prompts, limits, ids, pads = _rows(weights, prompts, limits, pad_token_id, graphs, decoders, prefilled)
    dec, stopper = _decoder(weights, policy, ids, limits, eos, sampling or Sampling(), pad_token_id, kernels,
                            min_context, graphs, output_logits, decoders)
    captured, sync = dec.capture_s, (torch.cuda.synchronize if device.type == "cuda" else (lambda: None))
    t0 = time.perf_counter()
    prefilled = _prefill(dec, ids, pads, prefilled, prefill_chunk, graphs and decoders is not None,
                         keep_prefill or (reference_logits and not keeps_prompt(dec)))
    sync()
    t1 = time.perf_counter()
    if graphs and max(limits) > 1:
        dec.capture()  # timed by the decoder (capture_s), as is a capture it defers until the policy settles
    if streamer is not None:  # as transformers does: the prompt first (TextStreamer(skip_prompt=True) drops it)
        streamer.put(torch.tensor(prompts[0]))
    loop = _Loop(dec, stopper, limits, eos, stop_strings, tokenizer, streamer)
    steps, decode_s = _timed_run(loop, check_every, sync)
    count = int(stopper.count)
    tokens, finish = _rows_out(loop, stopper.out[:, :count].cpu().tolist(), live, limits, eos, streamer)
    # every step's logits, past a row's end too (it reads padding then, as in transformers); left on the device
    logits = stopper.logits_out[:, :count] if output_logits else None
    info = {"graphs": bool(dec.graphs), "rows": len(prompts), "cache_slots": dec.max_len, "cache_bytes":
            dec.cache.nbytes, "setup_s": t0 - start, "capture_s": dec.capture_s - captured, "min_context":
            dec.min_context, "kernels": "triton" if dec.triton else "naive", "attended_fraction":
            _fraction(dec, ids.shape[1], steps)}
    del dec  # the loop holds it: the reference logits may let it go for a full decoder
    t4 = time.perf_counter()
    reference = _reference(weights, loop, stopper.out[:, :count - 1], ids, prefilled) if reference_logits else None
    sync()
    info["reference_s"] = time.perf_counter() - t4
    return Generation(tokens, finish, [len(p) for p in prompts[:live]], t1 - t0, decode_s, steps, logits,
                      reference, info, prefilled if keep_prefill else None)


def _reference(weights: Weights, loop: _Loop, new: torch.Tensor, ids: torch.Tensor, prefilled: Any) -> list:
    """Full attention's logits at each step after the first, over the tokens ``new`` the policy generated, in the
    same slots: on the loop's decoder where its policy kept the prompt, else (the policy's decoder, its cache and
    graphs let go first) on a full decoder loaded with the prefill's copy."""
    dec = loop.dec
    if not keeps_prompt(dec):
        rows, slots = dec.batch, dec.max_len
        loop.dec = dec = None
        dec = _full_with_prompt(weights, rows, slots, prefilled)
    return list(dense_logits(dec, new, ids.shape[1]))


def _timed_run(loop: _Loop, check_every: int, sync: Any) -> tuple[int, float]:
    """``loop.run``'s steps and its seconds, less a graph capture it ran (one the decoder deferred until the policy
    settled, as lethe's)."""
    before, start = loop.dec.capture_s, time.perf_counter()
    steps = loop.run(check_every)
    sync()
    return steps, time.perf_counter() - start - (loop.dec.capture_s - before)


def _prefill(dec: StaticDecoder, ids: torch.Tensor, pads: torch.Tensor, prefilled: Any, chunk: int | None,
             graph: bool, keep: bool) -> Any:
    """Prefill ``dec`` (from ``prefilled``, a kept copy, when given); returns the copy, made when ``keep`` (asked
    for, or a policy that evicts prompt keys leaves no prompt for the reference logits)."""
    if prefilled is not None:
        load_prefill(dec, prefilled)
        return prefilled
    dec.prefill(ids, pads, chunk, graph=graph)
    return snapshot(dec, ids, pads) if keep else None


def _rows(weights: Weights, prompts: list[list[int]], limits: list[int], pad_token_id: int, graphs: bool,
          decoders: Decoders | None, prefilled: Any) -> tuple[list[list[int]], list[int], torch.Tensor, torch.Tensor]:
    """The request's rows, left-padded: ``(prompts, limits, ids, pads)``. A kept decoder's rows are rounded up to
    a bucket (:mod:`rolecall.runtime.engine.compiling`: a bounded number of compilations and captures for any
    batch size; the extra rows are one padding token each, finished at the prefill), and short prompts on the
    GPU are padded to a width the decoder keeps a prefill graph of (:mod:`rolecall.runtime.engine.prefill`); a
    kept prefill's prompts are padded as they were then."""
    if decoders is not None and compiles_on(weights.device):
        idle = rows_for(len(prompts)) - len(prompts)
        prompts, limits = list(prompts) + [[pad_token_id]] * idle, limits + [1] * idle
    longest = max(len(p) for p in prompts)
    if prefilled is not None:
        width = max(prefilled.ids.shape[1], longest)
    else:
        width = graph_width(longest, len(prompts)) if graphs else None
    ids, pads = pad_left(prompts, pad_token_id, weights.device, width)
    if prefilled is not None and not prefilled.matches(ids, pads):
        raise ValueError("prefilled holds the prefill of other prompts (ids or padding differ)")
    return prompts, limits, ids, pads


def _decoder(weights: Weights, policy: Any, ids: torch.Tensor, limits: list[int], eos: list[int],
             sampling: Sampling, pad_token_id: int, kernels: str, min_context: int | None, graphs: bool,
             output_logits: bool, decoders: Decoders | None) -> tuple[StaticDecoder, Stopper]:
    """The decoder for ``ids`` with ``limits`` new tokens a row and its stopper: the one ``decoders`` keeps when
    the request fits it (reset), else a new one (kept there for the next request, with room to spare)."""
    b, slots, device = ids.shape[0], ids.shape[1] + max(limits), weights.device
    kind = (b, sampling, tuple(eos), pad_token_id, kernels, min_context, graphs)
    dec = decoders.take(weights, policy, kind, slots) if decoders is not None else None
    if dec is not None:
        dec.stopper.reset(limits)
        dec.sampler.reset()
        return dec, dec.stopper
    if decoders is not None:  # room for the next requests (see Decoders)
        slots = Decoders.slots_for(slots, weights.max_positions)
    stopper = Stopper(b, limits, eos, pad_token_id, device, weights.shape.vocab if output_logits else None,
                      weights.dtype, width=None if decoders is None else slots - 1)
    dec = StaticDecoder(weights, policy, b, slots, min_context=min_context, kernels=kernels,
                        sampler=Sampler(sampling, device), stopper=stopper, prompt_tokens=ids.shape[1])
    stopper.source = dec.logits
    if decoders is not None:
        decoders.keep(weights, policy, kind, dec)
    return dec, stopper


def _rows_out(loop: _Loop, out: list[list[int]], live: int, limits: list[int], eos: list[int],
              streamer: Any) -> tuple[list[list[int]], list[str]]:
    """Each live row's tokens up to its end and why it ended; the streamer gets row 0's rest and its end."""
    tokens, finish = [], []
    for r, row in enumerate(out[:live]):
        end, why = loop.row_end(r, row[:limits[r]])
        tokens.append(row[:end])
        finish.append(why)
    if streamer is not None:
        _stream(streamer, out[0][:limits[0]], loop.sent, loop.cut.get(0), eos)
        streamer.end()
    return tokens, finish


def _request(weights: Weights, prompts: Any, max_new_tokens: int | list[int], stop_strings: Any, tokenizer: Any,
             eos_token_id: int | list[int] | None) -> tuple[list[list[int]], list[int], list[int]]:
    """Checks a request before any work: the prompts as id lists, the per-row token limits and the EOS ids."""
    from rolecall.runtime.prompts import check_prompts

    rows = check_prompts(prompts, vocab_size=weights.shape.vocab, max_new_tokens=max_new_tokens, per_row=True,
                         name="prompts", context=weights.max_positions, opt_in=None,
                         limit_name="the {limit} positions of these weights' RoPE tables",
                         fix="shorten the prompt, lower max_new_tokens or build the weights with more positions "
                             "(Weights.from_model(model, positions=N), shared_weights(model, positions=N))")
    b = len(rows)
    limits = [int(n) for n in max_new_tokens] if isinstance(max_new_tokens, (list, tuple)) else [int(max_new_tokens)] * b
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer (tokenizer=...) to read the text")
    return rows, limits, [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])


@dataclass
class _Loop:
    """The decode loop: steps on the device, and every ``check_every`` steps one sync that reads which rows
    finished, cuts rows at stop strings and streams row 0."""

    dec: StaticDecoder
    stopper: Stopper
    limits: list[int]
    eos: list[int]
    stop_strings: Any
    tokenizer: Any
    streamer: Any
    sent: int = 0  # tokens of row 0 streamed so far
    cut: dict[int, int | None] = field(default_factory=dict)  # row -> where its stop string ends (None: none)
    rows: list[list[int]] = field(default_factory=list)  # the tokens read back so far, per row
    texts: dict[int, TokenText] = field(default_factory=dict)  # row -> its text so far (stop strings)

    def run(self, check_every: int) -> int:
        steps, last = 0, max(self.limits) - 1
        while steps < last:
            self.dec.step()
            steps += 1
            if steps % check_every and steps < last:
                continue
            done = self.stopper.finished.cpu()  # the one sync every check_every steps
            if self.streamer is not None or self.stop_strings:
                self.check(done)
            if bool(done.all()):
                break
        return steps

    def check(self, done: torch.Tensor) -> None:
        seen = len(self.rows[0]) if self.rows else 0  # only the tokens since the last check are read back
        new = self.stopper.out[:, seen:int(self.stopper.count)].cpu().tolist()
        if self.rows:
            for row, more in zip(self.rows, new):
                row.extend(more)
        else:
            self.rows = new
        out = self.rows
        for r in range(len(out)):  # stop strings first, so that nothing past one is streamed
            if self.stop_strings and r not in self.cut:
                text = self.texts.setdefault(r, TokenText(self.tokenizer, self.stop_strings))
                text.add(out[r][len(text.ids):], final=bool(done[r]))
                n = text.stop_cut()
                if n is not None or done[r]:  # a row finished by EOS is scanned once, then never again
                    self.cut[r] = n
                if n is not None:
                    self.stopper.finished[r] = True
                    done[r] = True
        if self.streamer is not None:
            self.sent = _stream(self.streamer, out[0], self.sent, self.cut.get(0), self.eos)

    def row_end(self, r: int, row: list[int]) -> tuple[int, str]:
        if r not in self.cut and self.stop_strings:  # the steps since the last check
            self.cut[r] = cut_at_stop(self.tokenizer, row, list(self.stop_strings))
        return _row_end(row, self.cut.get(r), self.eos)


def _fraction(dec: StaticDecoder, prompt: int, steps: int) -> float | None:
    """Mean fraction of the context the decode steps read (from the policy's static step)."""
    if steps < 1:
        return None
    shape = dec.shape
    total = read = 0.0
    for t in range(prompt, prompt + steps):
        use = dec.full if dec.static.sparse and t < dec.min_context else dec.static
        read += use.reads(shape, t + 1)
        total += t + 1
    return read / total


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
