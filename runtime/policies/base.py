"""What every policy shares: the registry of names, the step and plan a policy works on, its errors, and the
parameter checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rolecall.core.registry import Registry


class PolicyError(ValueError):
    """A policy was given parameters or a manifest it cannot work with; the message says how to fix it."""


class UnknownPolicyError(PolicyError):
    pass


# name -> "module:class", imported on use
POLICIES = Registry("policy", UnknownPolicyError, lead="known policies:", ordered=True)
POLICIES.update({
    "full": "rolecall.runtime.policies.full:Full",
    "delta": "rolecall.runtime.policies.delta:Delta",
    "lychee": "rolecall.runtime.policies.lychee:Lychee",
    "lethe": "rolecall.runtime.policies.lethe:Lethe",
    "vattention": "rolecall.runtime.policies.vattention:VAttention",
    "quest": "rolecall.runtime.policies.quest:Quest",
})


@dataclass
class Step:
    """One decode step of one layer, as the engine hands it to a policy."""

    layer: int
    query: torch.Tensor  # [B, Hq, D] after RoPE
    key: torch.Tensor  # [B, Hkv, T, D] the cache as stored (physical slots)
    value: torch.Tensor  # [B, Hkv, T, D]
    keep: torch.Tensor  # [B, T] bool: slots this query may read (padding and causality applied)
    scale: float
    scratch: dict[str, Any]  # per-request state shared by the layers of one step (and across steps)
    cache_layer: Any = None  # the cache layer when it can evict (Lethe), else None

    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.key.shape[1]


@dataclass
class Plan:
    """What a layer reads in one decode step. All ``None`` = every slot in ``step.keep`` (dense)."""

    indices: torch.Tensor | None = None  # [B, Hkv, N] token or block ids, -1 padded
    block_size: int = 1
    log_weights: torch.Tensor | None = None  # [B, Hkv, N]
    key_mask: torch.Tensor | None = None  # [B, T] bool, replaces step.keep when set
    info: dict[str, Any] = field(default_factory=dict)


def get_policy(name: str | Any, **params: Any):
    """A policy instance from its name and parameters (an instance passes through when no params are given)."""
    if not isinstance(name, str):
        if params:
            raise PolicyError("pass parameters either to the policy object or to attach(), not both")
        return name
    kind = policy_class(name)
    fields = [f.name for f in dataclasses.fields(kind) if f.init and not f.name.startswith("_")]
    unknown = [k for k in params if k not in fields]
    if unknown:
        known = ", ".join(fields) or "none"
        noun = "parameter" if len(unknown) == 1 else "parameters"
        raise PolicyError(f"policy {name!r} has no {noun} {', '.join(map(repr, unknown))}; its parameters are: "
                          f"{known}")
    return kind(**params)


def policy_class(name: str) -> type:
    return POLICIES.lookup(name)


def engine_policies() -> tuple[str, ...]:
    """The policies with a static step: those the engine runs (lychee with ``budget=``)."""
    return tuple(name for name in POLICIES if hasattr(policy_class(name), "static_step"))


def mean_tokens_read(shape: Any, context: int, budget: int, full_share: list[float]) -> float:
    """Mean tokens a static step reads per (layer, KV head) at ``context`` tokens (its byte bound): in layer l
    a share ``full_share[l]`` of the KV heads reads everything and the others ``budget`` tokens; a layer with
    a sliding window reads its window."""
    sparse = min(context, budget)
    per_layer = [min(context, w) if w is not None else f * context + (1 - f) * sparse
                 for f, w in zip(full_share, shape.windows)]
    return sum(per_layer) / len(per_layer)


@runtime_checkable
class Evicting(Protocol):
    """A policy that holds fewer tokens than the context (Lethe): ``capacity(layer, logical)`` is the most tokens
    layer ``layer`` keeps at ``logical`` tokens of context. The others (DELTA, Quest, LycheeDecode,
    vAttention) restrict what a step reads and keep every token."""

    def capacity(self, layer: int, logical: int) -> int: ...


def tokens_held(policy: Any, layers: int, context: int) -> list[int] | None:
    """Tokens each of ``layers`` layers keeps for a request of ``context`` tokens under a bound ``policy``, once
    decoding has begun: an evicting policy's capacity and the one new token beside it, at most ``context``;
    None when the policy keeps every token. (A sliding-window layer's window bounds it further; the memory
    plan applies that.)"""
    if not isinstance(policy, Evicting):
        return None
    return [min(context, policy.capacity(i, context) + 1) for i in range(layers)]


def positive(name: str, value: Any, allow_zero: bool = False, policy: str = "") -> None:
    """Shared parameter check: a number > 0 (or ≥ 0)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = "≥ 0" if allow_zero else "> 0"
        raise PolicyError(f"policy {policy!r}: {name} must be a number {bound}, got {value!r}")


__all__ = ["POLICIES", "Evicting", "Plan", "PolicyError", "Step", "UnknownPolicyError", "engine_policies", "get_policy",
           "tokens_held"]
