"""Wall time per call with a host synchronisation after each call, shared by the GPU scripts."""
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
