"""The shared memory Triton's compiler gives the projection kernel's launches on a given GPU, found without one.

Run as a script, outside Triton's interpreter (which the CPU tests turn on): it takes a JSON list of cases
``[rows, n, k, itemsize, gated, capability]`` on stdin, makes the launch the engine would make for each with the
tiles :func:`~rolecall.runtime.kernels.skinny_linear.naive.kernel_config` measured best (no shared-memory limit), captures
it instead of running it, compiles it for ``sm<capability>`` and prints the bytes of shared memory each took as a
JSON list.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch


def compiled_shared(call, capability: int) -> list[int]:
    """Bytes of shared memory of each kernel that ``call()`` launches, compiled for ``sm<capability>``."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    launches = []
    original = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    try:
        call()
    finally:
        JITFunction.run = original
    kinds = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32"}
    sizes = []
    for kernel, args, kwargs in launches:
        values = dict(zip((p.name for p in kernel.params), args)) | kwargs
        signature, constants, attributes = {}, {}, {}
        for i, param in enumerate(kernel.params):
            value = values.get(param.name)
            if param.is_constexpr:
                signature[param.name], constants[(i,)] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = kinds[value.dtype]
                attributes[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            else:
                signature[param.name] = "i32"
                if value % 16 == 0:
                    attributes[(i,)] = [["tt.divisibility", 16]]
        options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
        compiled = triton_compile(ASTSource(kernel, signature, constants, attributes),
                                  target=GPUTarget("cuda", capability, 32), options=options)
        sizes.append(compiled.metadata.shared)
    return sizes


def main() -> None:
    from rolecall.runtime.kernels.skinny_linear.naive import kernel_config
    from rolecall.runtime.kernels.skinny_linear.triton import launch

    out = []
    for rows, n, k, itemsize, gated, capability in json.load(sys.stdin):
        dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
        config = kernel_config(rows, n, k, itemsize, gated)
        x, weight = torch.empty(rows, k, dtype=dtype), torch.empty(n, k, dtype=dtype)
        call = functools.partial(launch, x, weight, None, config, gated="silu" if gated else None)
        out.append(compiled_shared(call, capability))
    print(json.dumps(out))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run outside Triton's interpreter: TRITON_INTERPRET=0")
    main()
