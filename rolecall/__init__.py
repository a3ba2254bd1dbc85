"""rolecall: which layers and attention heads of a language model need full attention during long decoding,
shipped as a role manifest that a sparse-decode runtime loads.

The parts, each a folder of the repository mapped into this package at install:

* :mod:`rolecall.runtime`: what inference needs (manifests, model loading, policies, kernels, the engine, the
  server); ``rolecall.attach`` is its entry point.
* :mod:`rolecall.calibrate`: DELTA's Δ-layers and Lethe's budgets from recorded attention.
* :mod:`rolecall.train`: LycheeDecode's retrieval heads from HardKuma gates.
* :mod:`rolecall.data`: datasets and prompt suites, offline by default.
* :mod:`rolecall.configs`: model aliases and the shipped calibration and training settings (package data).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "attach"]


def __getattr__(name: str):
    if name == "attach":  # imported on first use: importing the package loads neither torch nor transformers
        from rolecall.runtime.session import attach

        return attach
    raise AttributeError(f"module 'rolecall' has no attribute {name!r}")
