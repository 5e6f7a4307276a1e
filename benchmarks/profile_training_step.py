"""Kernel-by-kernel GPU time of one training step of the op, transform and module rows.

The benchmark gives each row's whole-step time; this lists what each step launched (torch
profiler, CUDA time per kernel name, averaged over `--steps` steps) so that two rows with the
same number of kernels but different times can be told apart.

Usage (GPU): python benchmarks/profile_training_step.py --shape 128,8192,256 --steps 20
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import split_stack_vs_combined as bench

ROWS = ("recfuse_op", "recfuse_transform", "fused_feature_processor")


def kernel_table(step, steps: int) -> list[tuple[str, int, float]]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        cuda_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if cuda_us > 0 and ev.count:
            rows.append((ev.key[:90], ev.count // steps, cuda_us / steps))
    return sorted(rows, key=lambda r: -r[2])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="128,8192,256", help="F,B,D[,H]")
    ap.add_argument("--dtype", default="float32", choices=sorted(bench.DTYPES))
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    F, B, D, H = bench.parse_shape(args.shape)
    case = bench.Case(F, B, D, H, bench.DTYPES[args.dtype], backward=True)
    device = torch.device("cuda")
    inputs = bench.make_inputs(case, device, seed=0)
    for name in ROWS:
        row = bench.ROW_BUILDERS[name](inputs, case, device)
        step = bench.make_step(row, case)
        table = kernel_table(step, args.steps)
        print(f"== {name}: training step {case.title()}, per step:")
        for key, count, us in table:
            print(f"   {us:9.1f} us  x{count}  {key}")
        del row, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
