"""rolecall's runtime: role manifests, model loading and the attention integration that inference uses."""

__version__ = "0.1.0"

__all__ = ["__version__"]
