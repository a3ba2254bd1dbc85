"""``/metrics``: the scheduler's and the server's numbers in Prometheus' text exposition format (version 0.0.4)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help, the key of Scheduler.stats())
FROM_STATS = {
    "rolecall_requests_running": ("gauge", "Requests in a slot, generating.", "running"),
    "rolecall_requests_waiting": ("gauge", "Requests queued for a free slot.", "waiting"),
    "rolecall_slots": ("gauge", "Row slots of the engine's decoder.", "slots"),
    "rolecall_slots_in_use": ("gauge", "Row slots holding a request.", "slots_in_use"),
    "rolecall_kv_cache_bytes": ("gauge", "Bytes of KV cache the engine holds.", "kv_bytes"),
    "rolecall_kv_pages_total": ("gauge", "16-token KV pages of the engine's pool (or that its rows reserve).",
                                "kv_pages_total"),
    "rolecall_kv_pages_used": ("gauge", "16-token KV pages the running requests hold.", "kv_pages_used"),
    "rolecall_preemptions_total": ("counter", "Requests preempted when the KV pool ran out (their KV kept in host "
                                   "memory, resumed as they were).", "preemptions"),
    "rolecall_generated_tokens_total": ("counter", "Tokens generated since the server started.", "generated_tokens"),
    "rolecall_tokens_per_second": ("gauge", "Tokens generated per second over the engine's last calls.",
                                   "tokens_per_s"),
    "rolecall_prefill_seconds_total": ("counter", "Engine seconds spent in prefills of admitted requests.",
                                       "prefill_seconds"),
    "rolecall_prefill_tokens_total": ("counter", "Prompt tokens the engine prefilled.", "prefill_tokens"),
    "rolecall_decode_seconds_total": ("counter", "Engine seconds spent in decode steps (all live rows at once).",
                                      "decode_seconds"),
    "rolecall_decode_steps_total": ("counter", "Decode steps the engine ran.", "decode_steps"),
}


def exposition(stats: Mapping[str, Any], prompt_tokens: int, finished: Mapping[str, int], draining: bool) -> str:
    """The exposition text: every :data:`FROM_STATS` metric from the scheduler's ``stats``; the server's own
    ``rolecall_prompt_tokens_total`` (``prompt_tokens`` of the requests admitted), ``rolecall_requests_total``
    by ``finish_reason`` (``finished``) and ``rolecall_draining`` (1 while shutting down)."""
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, Any]]) -> None:
        lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {_value(v)}" for labels, v in samples)

    for name, (kind, help, key) in FROM_STATS.items():
        metric(name, kind, help, [("", stats[key])])
    metric("rolecall_prompt_tokens_total", "counter", "Prompt tokens of the requests admitted.", [("", prompt_tokens)])
    metric("rolecall_requests_total", "counter", "Requests finished, by finish reason.",
           [(f'{{finish_reason="{reason}"}}', n) for reason, n in sorted(finished.items())])
    metric("rolecall_draining", "gauge", "1 while the server drains before it exits, else 0.", [("", int(draining))])
    return "\n".join(lines) + "\n"


def _value(v: Any) -> str:
    return str(int(v)) if isinstance(v, (bool, int)) or float(v).is_integer() else repr(float(v))


__all__ = ["CONTENT_TYPE", "FROM_STATS", "exposition"]
