"""Timing helpers shared by the benchmark tools: wall time with a sync per call, CUDA kernels per call."""
from __future__ import annotations

import time

import torch


def wall_us_with_sync(fn, calls: int = 200, warmup: int = 20) -> float:
    """Mean microseconds of `fn()` + `torch.cuda.synchronize()`, launch overhead included.

    Example:
        >>> wall_us_with_sync(lambda: torch.relu(x))  # doctest: +SKIP
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def kernels_per_call(fn) -> int:
    """CUDA events (kernels, memsets, copies) of one call of `fn`, after one unprofiled call.

    Example:
        >>> kernels_per_call(lambda: torch.relu(x))  # doctest: +SKIP
        1
    """
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
