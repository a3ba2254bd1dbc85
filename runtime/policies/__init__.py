"""Decode policies, one per file, found by name.

A policy is a small dataclass that checks its parameters in ``__post_init__`` and has two methods:

* ``bind(manifest, config)`` — check that the manifest has what the policy needs, remember the per-layer plan;
* ``plan(step) -> Plan`` — for one decode step of one layer, say which keys each KV head reads.

The engine (``rolecall.runtime.engine``) turns the plan into attention with the sparse-attention kernel and keeps the
statistics. ``get_policy("delta", budget=1024)`` builds one from a name and keyword parameters.
"""

from rolecall.runtime.policies.base import (
    POLICIES,
    Plan,
    PolicyError,
    Step,
    UnknownPolicyError,
    engine_policies,
    get_policy,
    mean_tokens_read,
    policy_class,
    positive,
)

__all__ = ["POLICIES", "Plan", "PolicyError", "Step", "UnknownPolicyError", "engine_policies", "get_policy",
           "mean_tokens_read", "policy_class", "positive"]
