"""``full``: dense decode through the rolecall path; the reference every other policy is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from runtime.policies import Plan, Step


@dataclass
class Full:
    name: ClassVar[str] = "full"

    def bind(self, manifest: Any, config: Any) -> None:
        """Any manifest (or none) is fine: full attention ignores roles."""

    def plan(self, step: Step) -> Plan:
        return Plan()
