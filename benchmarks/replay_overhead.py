"""Host (Python) time of a replayed call of the opt-in CUDA-graph mode, measured on the CPU.

A replayed call's cost on the GPU host is `cudaGraphLaunch` plus the Python that decides to
replay (`recfuse.cuda_graph`). This times that Python alone: the recorder makes one real call for
the outputs and its "replay" does nothing, and `replay_applies` (which requires CUDA tensors) is
replaced in this process by the same check with the device type "cpu" -- that check only runs
when a call cannot take the last signature's fast path, so the replayed calls timed here run the
production code unchanged. Cases:

    cache.run      `CudaGraphCache.run(fn, (x, B, D), params)` directly (the caller's checks done)
    transform      `recfuse.transform(SplitStack(D, H), (x, B, D), cuda_graph=True)`, `fused(x, B, D)`
    ffp            `FusedFeatureProcessor(..., cuda_graph=True)` called with a [B, F*D] tensor (a view of x)

All under `torch.no_grad()`; each call's result is dropped before the next (one graph replayed).
Per case: the best of `--repeats` means over `--calls` calls, in microseconds per call.

Example:
    $ PYTHONPATH=. python benchmarks/replay_overhead.py --calls 20000 --repeats 7 --json /tmp/after.json \\
          --baseline /tmp/before.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time

import torch

import recfuse
import recfuse.cuda_graph
import recfuse.fx.replay
import recfuse.module
from recfuse.cuda_graph import CudaGraphCache
from recfuse.puzzler import SplitStack

CASES = ("cache.run", "transform", "ffp")


def noop_recorder(fn, args):
    """A stand-in for `record_cuda_graph`: one real call for the outputs, a replay that does nothing."""
    return (lambda: None), fn(*args)


def _cpu_replay_applies(tensors, params) -> bool:
    # recfuse.cuda_graph.replay_applies before this benchmark's changes, device type "cpu".
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if not tensors or any(type(t) is not torch.Tensor or t.device.type != "cpu" for t in tensors):
        return False
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *params)):
        return False
    return True


def replay_on_cpu() -> None:
    """Let CPU tensors take the replay path in this process.

    recfuse.cuda_graph._DEVICE_TYPE names the device whose calls replay; before it existed, the
    check is replaced wherever `replay_applies` is looked up.
    """
    if hasattr(recfuse.cuda_graph, "_DEVICE_TYPE"):
        recfuse.cuda_graph._DEVICE_TYPE = "cpu"
        return
    for mod in (recfuse.cuda_graph, recfuse.module, recfuse.fx.replay):
        if hasattr(mod, "replay_applies"):
            mod.replay_applies = _cpu_replay_applies


def build(case: str, F: int, B: int, D: int, H: int):
    """A zero-argument function making one replayed call of `case`, and the cache it replays from."""
    torch.manual_seed(0)
    x = torch.randn(B * F * D)
    if case in ("cache.run", "transform"):
        fused = recfuse.transform(SplitStack(D, H), (x, B, D), cuda_graph=True)
        fused.cuda_graphs.recorder = noop_recorder
        if case == "transform":
            return (lambda: fused(x, B, D)), fused.cuda_graphs
        cache = CudaGraphCache(recorder=noop_recorder)
        params = list(fused.parameters())
        fn = fused.forward
        return (lambda: cache.run(fn, (x, B, D), params)), cache
    if case == "ffp":
        fp = recfuse.FusedFeatureProcessor([f"f{i}" for i in range(F)], D, out_features=H,
                                           ln_affine=False, eps=0.0, cuda_graph=True)
        fp._cuda_graphs.recorder = noop_recorder
        fp.requires_grad_(False)
        buffer = x.view(B, F * D)
        return (lambda: fp(buffer)), fp._cuda_graphs
    raise ValueError(case)


def time_case(call, calls: int, repeats: int) -> float:
    """Best mean microseconds per call over `repeats` runs of `calls` calls."""
    for _ in range(200):
        call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per case (the best is kept)")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--out", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--profile", default=None, choices=CASES, help="also print cProfile's top entries for one case")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--baseline", default=None, help="a --json file of an earlier run: print before/after")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    replay_on_cpu()
    cases = [c for c in args.cases.split(",") if c]
    results = {}
    with torch.no_grad():
        for case in cases:
            call, cache = build(case, args.features, args.batch, args.dim, args.out)
            us = time_case(call, args.calls, args.repeats)
            if cache.captures != 1 or cache.eager_calls != 0:
                raise RuntimeError(f"{case}: expected one capture and only replays, got "
                                   f"{cache.captures} captures, {cache.eager_calls} direct calls")
            results[case] = us
        if args.profile:
            call, _ = build(args.profile, args.features, args.batch, args.dim, args.out)
            call()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                call()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
            print(out.getvalue())

    report = {"us_per_call": results, "recfuse": recfuse.__file__, "torch": torch.__version__,
              "python": platform.python_version(), "calls": args.calls, "repeats": args.repeats,
              "shape": {"F": args.features, "B": args.batch, "D": args.dim, "H": args.out}}
    before = None
    if args.baseline:
        with open(args.baseline) as f:
            before = json.load(f)["us_per_call"]
    print(f"recfuse from {recfuse.__file__}; torch {torch.__version__}, Python {platform.python_version()}")
    print("host us per replayed call (replay stubbed; best of %d x %d calls)" % (args.repeats, args.calls))
    if before:
        print(f"{'case':<12} {'before':>8} {'after':>8} {'ratio':>7}")
        for case, us in results.items():
            b = before.get(case)
            if b is None:
                print(f"{case:<12} {'-':>8} {us:8.2f}")
            else:
                print(f"{case:<12} {b:8.2f} {us:8.2f} {b / us:6.2f}x")
    else:
        print(f"{'case':<12} {'us':>8}")
        for case, us in results.items():
            print(f"{case:<12} {us:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
