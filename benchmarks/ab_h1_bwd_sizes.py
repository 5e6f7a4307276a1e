"""A/B of H=1 backward configs over sizes of x: is the tuner's pick at F=64, x 256 MB right at 1 GB?

The puzzler's F=128 B=8192 D=256 fp32 training step got slower (1546 -> 1712 us GPU) after the
H100 table took the pipelined loop (2 warps, 16 programs/SM, 3 stages) that won at F=64 B=4096.
Times the backward (kernel + reduction) of the old entry, the new one and variants at several
(F, B), same inputs, same run.

Example:
    $ python benchmarks/ab_h1_bwd_sizes.py --json benchmarks/results/checks/ab_h1_bwd_sizes_h100.json
"""
import argparse
import json

import torch

from _common import do_bench_us, environment
from recfuse.ops import configs
from tune_kernels import backward_call, check, forward_call, make_inputs, references

VARIANTS = {
    "old (4 rows, 4 warps, 4/SM, plain)": dict(block_b=4, num_warps=4, programs_per_sm=4, loop_stages=0),
    "new (8 rows, 2 warps, 16/SM, 3 stages)": dict(block_b=8, num_warps=2, programs_per_sm=16, loop_stages=3),
    "new, no evict_first": dict(block_b=8, num_warps=2, programs_per_sm=16, loop_stages=3, x_evict=""),
    "new, 8/SM": dict(block_b=8, num_warps=2, programs_per_sm=8, loop_stages=3),
    "new, 32/SM": dict(block_b=8, num_warps=2, programs_per_sm=32, loop_stages=3),
    "new, 2 stages": dict(block_b=8, num_warps=2, programs_per_sm=16, loop_stages=2),
    "4 rows, 2 warps, 16/SM, 3 stages": dict(block_b=4, num_warps=2, programs_per_sm=16, loop_stages=3),
    "old, 3 stages": dict(block_b=4, num_warps=4, programs_per_sm=4, loop_stages=3),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["128,8192", "64,4096", "64,16384", "128,2048"])
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"env": environment("cuda"), "rows": []}
    for size in args.sizes:
        F, B = map(int, size.split(","))
        p = dict(F=F, B=B, D=256, H=1, dtype=args.dtype)
        t = make_inputs(p, "cuda")
        ref = references(t)
        stats = forward_call(t, configs.heuristic_forward(256, 1, t["x"].dtype), True)()[1]
        for name, knobs in VARIANTS.items():
            cfg = configs.heuristic_backward(256, 1, t["x"].dtype, **knobs)
            fn = backward_call(t, cfg, stats)
            err = check("backward", fn(), ref, t["x"].dtype)
            us = do_bench_us(fn, warmup_ms=5, rep_ms=30)
            row = dict(F=F, B=B, variant=name, us=us, err=err, x_MB=t["x"].numel() * t["x"].element_size() / 2**20)
            out["rows"].append(row)
            print(f"F={F:4d} B={B:6d} x {row['x_MB']:6.0f} MB  {name:42s} {us:8.1f} us  err {err:.1e}", flush=True)
        del t, ref, stats
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
