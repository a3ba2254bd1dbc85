"""What inference needs on top of :mod:`rolecall.core`: the attention hook, the decode policies, the GPU kernels,
the engine, the server and ``attach`` (also ``rolecall.attach``). It imports none of calibration, training, the
datasets or the evaluation."""

__all__ = ["attach"]


def __getattr__(name: str):
    if name == "attach":  # imported on first use: reading a manifest should not load transformers
        from rolecall.runtime.session import attach

        return attach
    raise AttributeError(f"module 'rolecall.runtime' has no attribute {name!r}")
