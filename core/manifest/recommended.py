"""A manifest's recommended setting (``RoleManifest.recommended``, written by ``rolecall tune``) in words.

The entry is ``{"policy": name, "params": {...}, "evidence": {...}}``; the evidence holds the setting's score
difference to full attention in points with its 95 % interval and prompt count (``difference``, ``interval``,
``n``), its TPOT and full attention's (``tpot_ms``, ``full_tpot_ms``) at ``batch`` and ``context`` on ``device``,
and what the run was (``suite``, ``lengths``, ``seed``, ``command``).
"""

from __future__ import annotations

from typing import Any


def setting_text(policy: str, params: dict[str, Any]) -> str:
    """A setting as the commands take it: ``delta -p budget=1024 -p refine=4`` (parameters in name order)."""
    return " ".join([policy, *(f"-p {k}={params[k]}" for k in sorted(params))])


def evidence_text(evidence: dict[str, Any]) -> str:
    """The evidence in one clause: ``-0.4 points [-1.2, +0.5] against full attention over 140 prompts; TPOT
    4.10 ms against 8.20 ms at batch 8, 32,768 tokens on NVIDIA H200``; empty without a difference."""
    if evidence.get("difference") is None:
        return ""
    low, high = evidence["interval"]
    text = (f"{evidence['difference']:+.1f} points [{low:+.1f}, {high:+.1f}] against full attention over "
            f"{evidence['n']} prompts")
    if evidence.get("tpot_ms") is not None and evidence.get("full_tpot_ms") is not None:
        text += (f"; TPOT {evidence['tpot_ms']:.2f} ms against {evidence['full_tpot_ms']:.2f} ms at batch "
                 f"{evidence.get('batch')}, {evidence.get('context', 0):,} tokens on {evidence.get('device')}")
    return text


__all__ = ["evidence_text", "setting_text"]
