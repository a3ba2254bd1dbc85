"""GPU kernels, each in its own folder beside its PyTorch reference (see docs/kernels.md).

``dispatch.py`` decides where a call goes (:func:`use_triton`, :func:`kernel_call`) and reads the GPU's figures.
"""

from rolecall.runtime.kernels.dispatch import (
    graphed,
    kernel_call,
    max_shared,
    peak_bandwidth,
    sm_count,
    use_triton,
)

__all__ = ["graphed", "kernel_call", "max_shared", "peak_bandwidth", "sm_count", "use_triton"]
