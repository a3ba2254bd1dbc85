"""What ``rolecall decode`` and ``rolecall eval`` share: the model, manifest and policy flags and their checks."""

from __future__ import annotations

import argparse
from typing import Any

from runtime.models import DEFAULT_MODEL


def parse_params(pairs: list[str] | None) -> dict[str, Any]:
    """``["budget=1024", "ratio=0.1", "mode=x"]`` → ``{"budget": 1024, "ratio": 0.1, "mode": "x"}``."""
    params: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {pair!r}: write it as NAME=VALUE, e.g. --param budget=1024")
        for kind in (int, float):
            try:
                params[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            params[key] = {"true": True, "false": False, "none": None}.get(value.lower(), value)
    return params


def policy_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """``-p`` parameters and the ``--manifest`` of ``decode``/``eval``, checked before the model loads: a bad
    policy name or parameter, or a bad manifest file, fails here in one line."""
    from runtime.manifest import RoleManifest
    from runtime.policies import get_policy
    from runtime.session import SESSION_PARAMS

    params = parse_params(args.param)
    get_policy(args.policy, **{k: v for k, v in params.items() if k not in SESSION_PARAMS})
    return params, (RoleManifest.load(args.manifest) if args.manifest else None)


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"alias, Hugging Face id or local folder (default {DEFAULT_MODEL})")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model folder's own Python code (auto_map in config.json); off by default")
    parser.add_argument("--manifest", default=None, help="role manifest (.safetensors): delta needs layers.role, lychee heads.role, "
                        "lethe layers.budget unless -p budget=N or -p sparse_ratio=F; full and vattention run without")
    parser.add_argument("--policy", default="delta", help="full, delta, lychee, lethe, vattention or quest (default delta)")
    parser.add_argument("--param", "-p", action="append", metavar="NAME=VALUE",
                        help="policy parameter, repeatable (e.g. -p budget=1024, -p ratio=0.1, -p epsilon=0.05)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one); on cuda "
                        "full, delta and lychee run on the engine (static cache, CUDA graphs)")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="weights dtype (default: bfloat16 on cuda, float32 on cpu)")
