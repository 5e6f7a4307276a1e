"""Run one forward configuration a few times, for a profiler (Nsight Compute) to attach to.

Picks the problem and config from a `tune_kernels.py --dot-forward` JSON: the default config
or the fastest one measured. Nothing is timed here; ncu does the measuring.

Usage (GPU):
    ncu --section SpeedOfLight --section Occupancy -k regex:ln_tanh_linear_relu_fwd \\
        --launch-skip 2 --launch-count 1 \\
        python benchmarks/profile_forward.py --sweep dot_forward.json --problem 0 --pick best
"""
from __future__ import annotations

import argparse
import json

import torch

from recfuse.ops import launch
from recfuse.ops.launch import KernelConfig  # noqa: F401 - eval() of the config strings

DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


def pick_config(entry: dict, pick: str) -> str:
    if pick == "default":
        return entry["default"]
    timed = [r for r in entry["rows"] if r.get("us")]
    return min(timed, key=lambda r: r["us"])["config"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", required=True, help="JSON written by tune_kernels.py --dot-forward")
    ap.add_argument("--problem", type=int, required=True, help="index into its dot_forward list")
    ap.add_argument("--pick", choices=("default", "best"), default="best")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    entry = json.load(open(args.sweep))["dot_forward"][args.problem]
    F, B, D, H, dtype = entry["problem"]
    dtype = DTYPES[dtype]
    cfg = eval(pick_config(entry, args.pick), {"KernelConfig": KernelConfig})  # noqa: S307 - our own JSON
    print(f"problem F={F} B={B} D={D} H={H} {dtype}; {args.pick}: {cfg}", flush=True)
    x = torch.randn(B, F * D, device="cuda", dtype=dtype).view(B, F, D)
    w = torch.randn(H, D, device="cuda", dtype=dtype) / D ** 0.5
    b = torch.randn(H, device="cuda", dtype=dtype) * 0.1
    launch.forward_config = lambda *a, **k: cfg
    for _ in range(args.calls):
        launch.forward(x, w, b, None, None, 0.0, 1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
