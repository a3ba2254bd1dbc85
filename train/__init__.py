"""Learn which (layer, KV head) pairs must stay retrieval heads (LycheeDecode) and write a role manifest.

``train.run(model, tokenizer, dataset, config) -> RoleManifest`` is the Python entry point; ``train-heads``
(= ``rolecall train``) wraps it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolecall.train.config import TrainConfig, build_config
    from rolecall.train.recipe import run

__all__ = ["TrainConfig", "build_config", "run"]


def __getattr__(name: str):
    # imported on first use, so `import rolecall.train.gates` stays light (no transformers, no accelerate)
    if name == "run":
        from rolecall.train.recipe import run

        return run
    if name in ("TrainConfig", "build_config"):
        from rolecall.train import config

        return getattr(config, name)
    raise AttributeError(f"module 'rolecall.train' has no attribute {name!r}")
