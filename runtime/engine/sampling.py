"""Choosing the next token on the device, inside the captured step: greedy, or sampling with temperature,
top-k and top-p.

Sampling draws its randomness from a counter-based hash of ``(seed, step, row, token id)`` instead of a
generator's state, so a graph replay needs no RNG bookkeeping and the same seed gives the same draws on any
device. A draw is Gumbel-max over the kept logits: ``argmax(logits / T + G)`` with ``G = -log(-log u)`` is an
exact sample of ``softmax(logits / T)`` restricted to the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """``do_sample=False`` is greedy; otherwise temperature > 0, ``top_k`` ≥ 0 (0 = off), ``top_p`` in (0, 1]."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}; use do_sample=False "
                             "for greedy decoding")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer ≥ 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed <= M32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values < 2**32 (products stay below 2**63)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & M32
    return x ^ (x >> 16)


def uniform(seed: int, step: torch.Tensor, rows: int, vocab: int, device) -> torch.Tensor:
    """Uniforms in (0, 1) ``[rows, vocab]`` from the hash of (seed, step, row, token id)."""
    h = mix32((step.long() * 0x2545F491 + seed) & M32)  # step: a device scalar
    h = mix32(h ^ (torch.arange(rows, device=device, dtype=torch.long)[:, None] * 0x9E3779B))
    h = mix32(h ^ torch.arange(vocab, device=device, dtype=torch.long)[None, :])
    return (h.double() + 0.5) / 4294967296.0


class Sampler:
    """Called inside the step with the logits ``[B, V]``; returns the chosen tokens ``[B]``.

    ``modes`` and ``mode``: the variants of the step the decoder captures a graph for, and the one the next step
    takes (one here; :class:`RowSampler` has two)."""

    modes: tuple = (None,)
    mode = None

    def __init__(self, sampling: Sampling, device) -> None:
        self.sampling = sampling
        self.step = torch.zeros((), dtype=torch.long, device=device)

    def state(self) -> list[torch.Tensor]:
        return [self.step]

    def reset(self) -> None:
        """Draw from step 0 again (a new request on a reused decoder)."""
        self.step.zero_()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        if not s.do_sample:
            return logits.argmax(-1)
        x = filtered_logits(logits.float() / s.temperature, s.top_k, s.top_p)
        u = uniform(s.seed, self.step, x.shape[0], x.shape[1], x.device)
        self.step.add_(1)
        return (x - torch.log(-torch.log(u)).float()).argmax(-1)


def filtered_logits(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``x [B, V]`` with the tokens outside the top k and outside the nucleus of mass ``top_p`` at -inf (the
    most likely token always stays), in the order transformers applies them: top-k, then top-p."""
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = x.sort(dim=-1, descending=True)
        mass = ordered.softmax(-1).cumsum(-1)
        drop = (mass - ordered.softmax(-1)) >= top_p  # the mass before a token already reaches top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return x


class RowSampler:
    """Each row its own sampling settings (the scheduler's rows, each a request of its own), called inside the
    step like :class:`Sampler`. A row draws what :class:`Sampler` draws for a request of one row with the same
    settings (the hash of its seed, its own step count and row 0), so a request sampled in any row of a busy
    scheduler gets the tokens it gets alone. :meth:`set_row` (on the host, between steps) gives a row a request's
    settings, :meth:`free_row` takes them back.

    Two ``modes``, each a graph of the step: ``"greedy"`` while no row samples (an argmax, the whole cost of a greedy
    batch) and ``"sample"`` (every row filtered and drawn, greedy rows still take their argmax). The host knows
    which rows sample, so ``mode`` follows :meth:`set_row` and :meth:`free_row`."""

    modes = ("greedy", "sample")

    def __init__(self, rows: int, device) -> None:
        self.sample = torch.zeros(rows, dtype=torch.bool, device=device)
        self.temperature = torch.ones(rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows, dtype=torch.long, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.seed = torch.zeros(rows, dtype=torch.long, device=device)
        self.step = torch.zeros(rows, dtype=torch.long, device=device)
        self._sampling: set[int] = set()  # the rows that sample
        self.mode = "greedy"

    def state(self) -> list[torch.Tensor]:
        return [self.step]

    def set_row(self, row: int, sampling: Sampling, step: int) -> None:
        """Row ``row`` samples as ``sampling`` from draw ``step`` on (1 after a prefill's choice)."""
        self.sample[row] = sampling.do_sample
        self.temperature[row] = sampling.temperature if sampling.do_sample else 1.0
        self.top_k[row] = sampling.top_k
        self.top_p[row] = sampling.top_p
        self.seed[row] = sampling.seed
        self.step[row] = step
        (self._sampling.add if sampling.do_sample else self._sampling.discard)(row)
        self.mode = "sample" if self._sampling else "greedy"

    def free_row(self, row: int) -> None:
        """Row ``row``'s request ended: it no longer samples."""
        self._sampling.discard(row)
        self.mode = "sample" if self._sampling else "greedy"

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.mode == "greedy":
            return logits.argmax(-1)
        v = logits.shape[-1]
        x = logits.float() / self.temperature[:, None]
        ordered, order = x.sort(dim=-1, descending=True)
        k = torch.where(self.top_k > 0, self.top_k.clamp_max(v), v)  # [B]
        # top-k as filtered_logits (and transformers) apply it: every token below the k-th value goes, so a tie
        # with the k-th stays; the order is unchanged
        cut = ordered < ordered.gather(-1, (k - 1)[:, None])
        ordered = ordered.masked_fill(cut, float("-inf"))
        p = ordered.softmax(-1)
        drop = cut | ((p.cumsum(-1) - p) >= self.top_p[:, None])  # as filtered_logits
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        h = mix32((self.step * 0x2545F491 + self.seed) & M32)  # [B], as uniform() for row 0
        h = mix32(mix32(h)[:, None] ^ torch.arange(v, device=x.device, dtype=torch.long)[None, :])
        u = (h.double() + 0.5) / 4294967296.0
        self.step.add_(1)
        drawn = (x - torch.log(-torch.log(u)).float()).argmax(-1)
        return torch.where(self.sample, drawn, logits.argmax(-1))
