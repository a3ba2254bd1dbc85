"""Timing helpers shared by the benchmark scripts: CUDA-event times, measured copy bandwidth, GPU names."""

from __future__ import annotations

import re
import statistics
import time

import torch


def event_times(fn, reps: int = 30, warmup: int = 5) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed calls.

    CUDA events on a GPU (each call waited for, so a call's time is its own); the wall clock on a CPU.
    """
    for _ in range(warmup):
        fn()
    times = []
    if not torch.cuda.is_available():
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    torch.cuda.synchronize()
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def median_ms(fn, reps: int = 30, warmup: int = 5) -> float:
    return statistics.median(event_times(fn, reps, warmup))


def copy_bandwidth(device: str = "cuda", elements: int = 2**30) -> float:
    """Bytes read + written per second of a device-to-device copy of ``elements`` fp16 values: the bandwidth
    that byte bounds are taken over."""
    src = torch.empty(elements, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps=20, warmup=3)
    return 2 * elements * 2 / (ms / 1e3)


def gpu_slug(name: str) -> str:
    """``NVIDIA H200`` → ``h200``: the file name suffix of benchmark results."""
    m = re.search(r"\b([A-Z]+\d+[A-Za-z]*)\b", name.replace("NVIDIA", ""))
    return m.group(1).lower() if m else re.sub(r"\W+", "_", name.lower()).strip("_")


def step_timeline(events: list[dict]) -> dict:
    """The GPU work of one profiled step, from a Chrome trace's events (``torch.profiler``'s
    ``export_chrome_trace``): each kernel, copy and memset as ``[name, stream, start µs, µs, grid]`` from the
    step's first start, in start order; the step's wall time, the time some kernel ran (the union of their
    intervals, so work on side streams is not counted twice), the idle rest, and per name the count and the
    summed time (which may exceed the wall time where streams overlap)."""
    work = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not work:
        return {"wall_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "by_name": {}, "kernels": []}
    t0 = work[0]["ts"]
    rows = [[e["name"], e.get("args", {}).get("stream", e.get("tid")), e["ts"] - t0, float(e["dur"]),
             e.get("args", {}).get("grid")] for e in work]
    busy, covered = 0.0, 0.0  # covered: the end of the union so far
    for _, _, start, dur, _ in rows:
        busy += max(0.0, start + dur - max(start, covered))
        covered = max(covered, start + dur)
    by_name: dict[str, dict] = {}
    for name, _, _, dur, _ in rows:
        entry = by_name.setdefault(name, {"count": 0, "us": 0.0})
        entry["count"] += 1
        entry["us"] += dur
    wall = covered
    return {"wall_us": wall, "busy_us": busy, "idle_us": wall - busy,
            "by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["us"])), "kernels": rows}
