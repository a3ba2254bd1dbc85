"""Generation on the engine: prefill, then graph-replayed steps, stopping per row, text streamed as it comes.

The step chooses the next token (:mod:`rolecall.runtime.engine.sampling`) and keeps the books of finished rows on the
device (:class:`Stopper`): a row finishes on an EOS token or at its ``max_new_tokens``, and from then on emits
padding. The host looks only every ``check_every`` steps: to stop when every row is done, to stream text and
to look for stop strings (a row whose text contains one is finished there and cut after it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rolecall.runtime.engine.compiling import compiles_on, rows_for
from rolecall.runtime.engine.decoder import StaticDecoder, pad_left
from rolecall.runtime.engine.prefill import graph_width
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
    info: dict[str, Any] = field(default_factory=dict)

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


@torch.no_grad()
def generate(weights: Weights, policy: Any, prompts: list[list[int]], *, max_new_tokens: int | list[int] = 64,
             sampling: Sampling | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
             stop_strings: list[str] | tuple[str, ...] = (), tokenizer: Any = None, streamer: Any = None,
             check_every: int = 8, kernels: str = "auto", min_context: int | None = None,
             graphs: bool | None = None, prefill_chunk: int | None = None, output_logits: bool = False,
             decoders: Decoders | None = None) -> Generation:
    """Generate for every prompt (token id lists of any lengths: a ragged batch is left-padded).

    ``policy``: a bound policy with a static step. ``streamer``: an object with ``put(ids)`` / ``end()``
    (transformers' ``TextStreamer`` works), fed row 0's prompt first, as ``model.generate`` does, then its new
    tokens at every check. The cache holds ``longest prompt + max(max_new_tokens)`` tokens per row.
    ``decoders``: run on the decoder it keeps when this request fits it, and keep this request's decoder there
    (see :class:`Decoders`; not with ``output_logits``, whose buffer is sized to the request).

    Checked before any work (:func:`rolecall.runtime.prompts.check_prompts`), each refused in one line (``ValueError``):
    ``prompts`` a list of token id lists (or 1-D integer tensors) or a ``[batch, tokens]`` integer tensor, each
    prompt at least one id in the model's vocabulary; ``max_new_tokens`` whole numbers ≥ 1; the longest prompt
    plus ``max_new_tokens`` within the positions of the weights' RoPE tables (``Weights.from_model``'s
    ``positions``, by default the model's ``max_position_embeddings``).

    :func:`generate` is :func:`prepare`, :meth:`Request.prefill` and :meth:`Request.decode` in a row; a caller
    that needs more of a request (the evaluation: full attention's logits along the tokens, a prefill shared
    between policies) runs the three itself.
    """
    request = prepare(weights, policy, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                      eos_token_id=eos_token_id, pad_token_id=pad_token_id, stop_strings=stop_strings,
                      tokenizer=tokenizer, kernels=kernels, min_context=min_context, graphs=graphs,
                      output_logits=output_logits, decoders=decoders)
    request.prefill(prefill_chunk)
    return request.decode(streamer, check_every)


@torch.no_grad()
def prepare(weights: Weights, policy: Any, prompts: list[list[int]], *,
            max_new_tokens: int | list[int] = 64, sampling: Sampling | None = None,
            eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
            stop_strings: list[str] | tuple[str, ...] = (), tokenizer: Any = None, kernels: str = "auto",
            min_context: int | None = None, graphs: bool | None = None, output_logits: bool = False,
            decoders: Decoders | None = None, width: int | None = None) -> Request:
    """A request checked and made ready on the engine, nothing run yet: its rows left-padded (to ``width``
    when given and at least the longest prompt) and the decoder that runs them (``decoders``' when it fits).
    The arguments are :func:`generate`'s, checked as there."""
    start = time.perf_counter()
    prompts, limits, eos = _request(weights, prompts, max_new_tokens, stop_strings, tokenizer, eos_token_id)
    live, device = len(prompts), weights.device
    if decoders is not None and output_logits:
        decoders.clear()  # its memory goes to this request's decoder, which is not kept
        decoders = None
    graphs = device.type == "cuda" if graphs is None else graphs
    prompts, limits, ids, pads = _rows(weights, prompts, limits, pad_token_id, graphs, decoders, width)
    dec, stopper = _decoder(weights, policy, ids, limits, eos, sampling or Sampling(), pad_token_id, kernels,
                            min_context, graphs, output_logits, decoders)
    return Request(dec, stopper, prompts, limits, eos, ids, pads, live, list(stop_strings), tokenizer, graphs,
                   decoders is not None, output_logits, start, dec.capture_s)


@dataclass
class Request:
    """A request made ready by :func:`prepare`: its rows (``ids [B, P]`` left-padded by ``pads``; ``live`` of
    them the caller's, the rest idle padding rows), their token limits and EOS ids, and the decoder and
    stopper that run them. :meth:`prefill` fills the decoder's cache, :meth:`decode` then decodes; afterwards
    ``dec`` still holds the cache (a caller may read it, or set ``dec`` to None to free it)."""

    dec: StaticDecoder | None
    stopper: Stopper
    prompts: list[list[int]]
    limits: list[int]
    eos: list[int]
    ids: torch.Tensor
    pads: list[int]
    live: int
    stop_strings: list[str]
    tokenizer: Any
    graphs: bool
    kept: bool  # the decoder is kept for the next request (Decoders): a short prefill replays a graph
    output_logits: bool
    start: float  # perf_counter() when the request came
    captured: float  # the decoder's capture_s before this request
    filled: float = 0.0  # perf_counter() when the prefill began
    prefill_s: float = 0.0

    def sync(self) -> None:
        """Wait for the device (on CUDA), so that the host's clock times its work."""
        if self.ids.device.type == "cuda":
            torch.cuda.synchronize()

    def fill(self, chunk: int | None = None) -> None:
        """Prefill the prompts into the decoder's empty cache, in chunks of ``chunk`` tokens (default: the
        prefill's); a short prompt's prefill replays a CUDA graph where the decoder is kept."""
        self.dec.prefill(self.ids, self.pads, chunk, graph=self.graphs and self.kept)

    @torch.no_grad()
    def prefill(self, chunk: int | None = None, fill: Any = None) -> Any:
        """:meth:`fill` (or ``fill()``, another way to fill the cache: loading a kept prefill), timed as
        ``prefill_s`` up to the device's end; returns what ``fill`` returned (None for :meth:`fill`)."""
        self.filled = time.perf_counter()
        made = self.fill(chunk) if fill is None else fill()
        self.sync()
        self.prefill_s = time.perf_counter() - self.filled
        return made

    @torch.no_grad()
    def decode(self, streamer: Any = None, check_every: int = 8) -> Generation:
        """The steps after the prefill (graph-captured on the GPU): stopping per row, the host looking every
        ``check_every`` steps, row 0 streamed to ``streamer`` (its prompt first)."""
        dec, stopper, limits = self.dec, self.stopper, self.limits
        if self.graphs and max(limits) > 1:
            dec.capture()  # timed by the decoder (capture_s), as is one it defers until the policy settles
        # as transformers does: the prompt first (TextStreamer(skip_prompt=True) drops it)
        if streamer is not None:
            streamer.put(torch.tensor(self.prompts[0]))
        loop = _Loop(dec, stopper, limits, self.eos, self.stop_strings, self.tokenizer, streamer)
        steps, decode_s = _timed_run(loop, check_every, self.sync)
        count = int(stopper.count)
        tokens, finish = _rows_out(loop, stopper.out[:, :count].cpu().tolist(), self.live, limits, self.eos,
                                   streamer)
        # every step's logits, past a row's end too (it reads padding then, as in transformers), on the device
        logits = stopper.logits_out[:, :count] if self.output_logits else None
        info = {"graphs": bool(dec.graphs), "rows": len(self.prompts), "cache_slots": dec.max_len,
                "cache_bytes": dec.cache.nbytes, "setup_s": self.filled - self.start,
                "capture_s": dec.capture_s - self.captured, "min_context": dec.min_context,
                "kernels": "triton" if dec.triton else "naive",
                "attended_fraction": _fraction(dec, self.ids.shape[1], steps)}
        lengths = [len(p) for p in self.prompts[:self.live]]
        return Generation(tokens, finish, lengths, self.prefill_s, decode_s, steps, logits, info)


def _timed_run(loop: _Loop, check_every: int, sync: Any) -> tuple[int, float]:
    """``loop.run``'s steps and its seconds, less a graph capture it ran (one the decoder deferred until the policy
    settled, as lethe's)."""
    before, start = loop.dec.capture_s, time.perf_counter()
    steps = loop.run(check_every)
    sync()
    return steps, time.perf_counter() - start - (loop.dec.capture_s - before)


def _rows(weights: Weights, prompts: list[list[int]], limits: list[int], pad_token_id: int, graphs: bool,
          decoders: Decoders | None,
          width: int | None) -> tuple[list[list[int]], list[int], torch.Tensor, list[int]]:
    """The request's rows, left-padded: ``(prompts, limits, ids, pads)``. A kept decoder's rows are rounded up
    to a bucket (:mod:`rolecall.runtime.engine.compiling`: a bounded number of compilations and captures for
    any batch size; the extra rows are one padding token each, finished at the prefill), and short prompts on
    the GPU are padded to a width the decoder keeps a prefill graph of
    (:mod:`rolecall.runtime.engine.prefill`), or to ``width`` where it is given and at least the longest
    prompt (a kept prefill's prompts, padded as they were then)."""
    if decoders is not None and compiles_on(weights.device):
        idle = rows_for(len(prompts)) - len(prompts)
        prompts, limits = list(prompts) + [[pad_token_id]] * idle, limits + [1] * idle
    longest = max(len(p) for p in prompts)
    if width is not None:
        width = max(width, longest)
    else:
        width = graph_width(longest, len(prompts)) if graphs else None
    ids, pads = pad_left(prompts, pad_token_id, weights.device, width)
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
