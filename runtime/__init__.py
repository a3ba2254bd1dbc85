"""rolecall's runtime: role manifests, model loading and the attention integration that inference uses."""

__version__ = "0.1.0"

__all__ = ["__version__", "attach"]


def __getattr__(name: str):
    if name == "attach":  # imported on first use: reading a manifest should not load transformers
        from rolecall.runtime.session import attach

        return attach
    raise AttributeError(f"module 'rolecall.runtime' has no attribute {name!r}")
