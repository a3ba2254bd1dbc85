"""One token budget in each policy's own parameters, so that policies compare at equal reads.

``MAPPING`` says in words what :func:`policy_params` does; the quality grid writes it into its summary and
``rolecall tune`` into its record.
"""

from __future__ import annotations

import math
from typing import Any

PAGE = 16  # DELTA's and Quest's page size P

MAPPING = {
    "delta": "K = ceil(budget / 16) pages of 16 tokens, the L = max(1, K / 8) most recent among them (the paper's "
             "L/K = 8/64); full and Δ-layers read everything",
    "lychee": "budget tokens (block size 1, the current token included) for each sparse head; retrieval heads "
              "read everything",
    "lethe": "budget = mean slots per layer, shared out over layers in proportion to the manifest's layers.budget "
             "(uniform without --lethe); memory stops growing there",
    "vattention": "deterministic set of 4 sinks + window budget/4 + heavy hitters budget/2 per KV head, then the "
                  "CLT sample that ε, δ need on top, at most budget tokens (max_sample: the engine's fixed shape; "
                  "its reads are the 'read' column)",
    "quest": "K = ceil(budget / 16) pages per KV head by the min/max key bound, the current page included; layers "
             "0 and 1 dense",
}


def policy_params(policy: str, budget: int, epsilon: float = 0.05, delta: float = 0.05) -> dict[str, Any]:
    """A token ``budget`` in ``policy``'s own parameters (see ``MAPPING``); ``epsilon`` and ``delta`` are
    vAttention's. Full attention (or a policy without a budget) takes none: ``{}``."""
    if policy == "delta":
        pages = math.ceil(budget / PAGE)
        return {"budget": budget, "page_size": PAGE, "recent_pages": max(1, pages // 8)}
    if policy in ("lychee", "lethe"):
        return {"budget": budget}
    if policy == "vattention":
        return {"epsilon": epsilon, "delta": delta, "sinks": 4, "window": budget // 4, "heavy": budget // 2,
                "max_sample": budget}
    if policy == "quest":
        return {"budget": budget, "page_size": PAGE}
    return {}
