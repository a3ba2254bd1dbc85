"""``full``: dense decode; the reference every other policy is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rolecall.runtime.policies import Plan, Step, mean_tokens_read


@dataclass
class Full:
    name: ClassVar[str] = "full"

    def bind(self, manifest: Any, config: Any) -> None:
        """Any manifest (or none) is fine: full attention ignores roles."""

    def plan(self, step: Step) -> Plan:
        return Plan()

    def static_step(self, shape: Any) -> FullStep:
        return FullStep()


@dataclass
class FullStep:
    """The engine's step: every layer reads every valid slot."""

    head_order: ClassVar[None] = None
    sparse: ClassVar[bool] = False
    row_lengths: ClassVar[bool] = True  # runs on rows of their own lengths (the scheduler's)
    paged: ClassVar[bool] = True  # reads the cache only through the decoder's attention calls (block tables)
    block_sizes: ClassVar[tuple[int, ...]] = ()

    def reads(self, shape: Any, context: int) -> float:
        """Mean tokens read per (layer, KV head) at ``context`` tokens (a sliding layer reads its window)."""
        return mean_tokens_read(shape, context, context, [1.0] * shape.layers)

    def attention(self, dec: Any, layer: int, q, k, v, span, state: dict) -> Any:
        return dec.attn.attend(q, k, v, span)
