"""Time `recfuse.transform` on a model written per feature (default 1000 features) on the CPU.

The model is the shape of a real recommender's dense preprocessing: a [B, F*D] buffer split into F
slices, one LayerNorm per feature (a ModuleList), tanh, stack, a shared Linear and relu. Target:
under 2 s for 1000 features.

Example:
    $ python benchmarks/transform_time.py --features 1000 --json /tmp/transform_time.json
    $ python benchmarks/transform_time.py --features 16 --repeats 1     # a quick smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import recfuse
from _common import PerSlice, cpu_name


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", type=int, default=1000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--out", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=str, default=None, help="also write the results to this file")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = PerSlice(args.features, args.dim, args.out)
    x = torch.randn(args.batch, args.features * args.dim)
    times, gm = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        gm = recfuse.transform(model, (x,))
        times.append(time.perf_counter() - t0)
    report = gm.recfuse_report
    x2 = torch.randn(args.batch + 1, args.features * args.dim)
    with torch.no_grad():
        err = float((gm(x2) - model(x2)).abs().max())
    # Graph size before fusion: the pass's own capture (plain symbolic_trace cannot iterate split).
    nodes_before = len(recfuse.fx.capture.capture(model, (x,))[0].graph.nodes) if args.features <= 64 else None
    result = {
        "features": args.features, "dim": args.dim, "out": args.out, "batch": args.batch,
        "transform_s_median": statistics.median(times), "transform_s_min": min(times),
        "groups": len(report.groups), "mode": report.groups[0].mode if report.groups else None,
        "nodes_after": len(gm.graph.nodes), "max_abs_diff": err, "target_s": 2.0,
        "torch": torch.__version__, "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
    }
    rows = [("features", str(args.features)), ("D, H, B", f"{args.dim}, {args.out}, {args.batch}"),
            ("transform (median of %d)" % args.repeats, f"{result['transform_s_median']:.3f} s"),
            ("transform (min)", f"{result['transform_s_min']:.3f} s"),
            ("target", "< 2 s " + ("(met)" if result["transform_s_median"] < 2.0 else "(MISSED)")),
            ("groups fused / mode", f"{result['groups']} / {result['mode']}"),
            ("graph nodes after", str(result["nodes_after"])),
            ("max |fused - original| on fresh input", f"{err:.2e}")]
    w = max(len(k) for k, _ in rows)
    print("recfuse.transform time (CPU)")
    for k, v in rows:
        print(f"  {k.ljust(w)}  {v}")
    if nodes_before:
        print(f"  (graph nodes before: {nodes_before})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
