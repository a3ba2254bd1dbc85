"""Reductions of one attention row: head-max vector, cosine shift, Hoyer sparsity, page sums, simulated recall.

Every function works on the last dimension and broadcasts over the leading ones, so the same code reduces one
query row ``[n]`` or a block of them ``[Hq, Q, n]``.
"""

from __future__ import annotations

import math

import torch

from rolecall.runtime.kernels.topk_select import topk_mask_with_recent


def hoyer_sparsity(p: torch.Tensor, n: torch.Tensor | int | None = None) -> torch.Tensor:
    """Hoyer sparsity ``(√n − ‖p‖₁/‖p‖₂) / (√n − 1)`` of ``p [..., n]`` → ``[...]``.

    0 for a uniform row, 1 for a one-hot row. ``n`` is the row length; pass it (a tensor broadcastable to
    ``[...]``) when ``p`` is zero-padded beyond a shorter causal prefix, since padding changes n but not the norms.
    A row of length 1 is both uniform and one-hot; it gets 0. An all-zero row gets 0.
    """
    if n is None:
        n = p.shape[-1]
    n = torch.as_tensor(n, dtype=torch.float64 if p.dtype == torch.float64 else torch.float32, device=p.device)
    l1 = p.abs().sum(-1)
    l2 = torch.linalg.vector_norm(p, dim=-1)
    root = n.sqrt()
    ratio = torch.where(l2 > 0, l1 / l2.clamp_min(torch.finfo(l2.dtype).tiny), root)
    out = (root - ratio) / (root - 1).clamp_min(torch.finfo(l2.dtype).eps)
    return torch.where(n > 1, out, torch.zeros_like(out))


def cosine_shift(a_prev: torch.Tensor, a_next: torch.Tensor) -> torch.Tensor:
    """``1 − cos(a_prev, a_next)`` over the last dimension: ``[..., n]`` × ``[..., n]`` → ``[...]``.

    0 when the two attention vectors point the same way, 1 when they are orthogonal (attention vectors are
    non-negative, so the shift lies in [0, 1]). A zero vector counts as orthogonal to everything.
    """
    dot = (a_prev * a_next).sum(-1)
    norms = torch.linalg.vector_norm(a_prev, dim=-1) * torch.linalg.vector_norm(a_next, dim=-1)
    cos = torch.where(norms > 0, dot / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.zeros_like(dot))
    return 1.0 - cos


def head_max(p: torch.Tensor) -> torch.Tensor:
    """DELTA's token score: ``[Hq, ..., n]`` attention probabilities → ``[..., n]`` max over query heads."""
    return p.amax(0)


def page_sums(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """Sum ``x [..., n]`` over consecutive pages of ``page_size`` keys → ``[..., ceil(n / page_size)]``.

    The last page may be partial (it is zero-padded before the sum).
    """
    n = x.shape[-1]
    pages = math.ceil(n / page_size)
    pad = pages * page_size - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], pages, page_size).sum(-1)


def selected_pages(score: torch.Tensor, last_page: torch.Tensor, num_pages: int, recent_pages: int) -> torch.Tensor:
    """DELTA's page choice for rows of page scores: ``num_pages`` (K) pages in all, the last ``recent_pages``
    (L) up to and including ``last_page`` (the page of the query itself) and the K − L highest-scoring older
    pages, the same rule (``rolecall.runtime.kernels.topk_select``) as the runtime's ``delta`` policy and engine.

    ``score``: ``[..., P]``; ``last_page``: ``[...]`` int, index of the query's page. Returns a bool ``[..., P]``.
    Pages after ``last_page`` are never chosen (they do not exist yet at that decode step).
    """
    return topk_mask_with_recent(score, num_pages, recent_pages, last=last_page)


def pair_recall(score: torch.Tensor, mass: torch.Tensor, last_page: torch.Tensor, num_pages: int,
                recent_pages: int) -> torch.Tensor:
    """Simulated recall of every (selection layer s, reading layer l) pair for a block of sampled queries.

    ``score``: ``[L, Q, P]`` page scores ``S[u] = Σ_{t∈u} a[l][t]``; ``mass``: ``[L, Q, P]`` attention mass per
    page averaged over heads (rows sum to 1); ``last_page``: ``[Q]``. Returns ``[L, L, Q]`` where ``[s, l, q]``
    is the share of layer l's attention mass that falls on the pages layer s would select for query q.
    """
    keep = selected_pages(score, last_page.unsqueeze(0).expand(score.shape[:2]), num_pages, recent_pages)
    return torch.einsum("sqp,lqp->slq", keep.to(mass.dtype), mass)
