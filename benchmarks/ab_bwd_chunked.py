"""A/B of the backward's tl.dot path: the whole-row kernel (the shipped config of each shape)
against the K-chunked kernel (`ln_tanh_linear_relu_bwd_chunked`) at a few configs, in one
process, on the tuner's inputs (torchrec layout, x ~256 MB, F=64, shared weight and bias,
per-feature LayerNorm affine, the forward's saved row stats as a training step reads them).

Per shape and variant: the backward's GPU time (kernel + reduction, do_bench median), % of its
floor (x and grad_y read, dx written, at the copy bandwidth of this run) and the largest gradient
error vs float64 (relu ties zeroed, as the tuner does). Compiles run first in parallel processes
(the tuner's `precompile`).

Usage (CUDA): python benchmarks/ab_bwd_chunked.py --json out.json [--shapes bf16:256:16,...]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tune_kernels as tk  # noqa: E402
from _common import copy_bandwidth, do_bench_us, environment  # noqa: E402
from recfuse.ops import configs  # noqa: E402

SHAPES = "bf16:256:16,fp32:128:16,bf16:64:64,fp32:256:64,bf16:512:16,fp32:64:16,bf16:160:16,fp32:512:64,bf16:128:4"
VARIANTS = {"k64_b32_w4": dict(block_k=64, block_b=32, num_warps=4, programs_per_sm=8),
            "k64_b64_w8": dict(block_k=64, block_b=64, num_warps=8, programs_per_sm=4),
            "k32_b32_w4": dict(block_k=32, block_b=32, num_warps=4, programs_per_sm=8),
            "k64_b16_w4": dict(block_k=64, block_b=16, num_warps=4, programs_per_sm=16)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--x-mb", type=float, default=256.0)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args()
    points = []
    for s in args.shapes.split(","):
        dt, D, H = s.split(":")
        D, H = int(D), int(H)
        dtype = tk.DTYPES[dt]
        B = max(64, int(args.x_mb * 2 ** 20 / (64 * D * dtype.itemsize)) // 64 * 64)
        p = dict(F=64, B=B, D=D, H=H, dtype=dt)
        full = D == configs.triton.next_power_of_2(D)
        shipped = configs.backward_config(D, H, dtype, torch.cuda.current_device())
        variants = {"shipped": shipped}
        for name in filter(None, args.variants.split(",")):
            cfg = configs.heuristic_backward(D, H, dtype, use_dot=True, **VARIANTS[name])
            if cfg is not None and configs.backward_fits(cfg, D, H) and cfg.block_k < cfg.block_d:
                variants[name] = cfg
        points.append((p, full, variants))
    work = [{"shape": p, "kind": "backward", "candidates": [configs.config_to_entry(c) for c in v.values() if c]}
            for p, _, v in points]
    print("compile s", round(tk.precompile(work, args.workers, os.environ.get("OUT", "/tmp")), 1), flush=True)
    bench = lambda fn: do_bench_us(fn, warmup_ms=10, rep_ms=50)  # noqa: E731
    copy = copy_bandwidth(256 << 20, "cuda", bench)
    out = dict(env=environment("cuda"), copy=copy, rows=[])
    for p, full, variants in points:
        t = tk.make_inputs(p, "cuda")
        stats = tk.forward_call(t, configs.heuristic_forward(p["D"], p["H"], tk.DTYPES[p["dtype"]]), True)()[1]
        ref = tk.references(t)
        x, gy = t["x"], t["gy"]
        floor = (2 * x.numel() * x.element_size() + gy.numel() * gy.element_size()) / (copy["GBps"] * 1e3)
        for name, cfg in variants.items():
            row = dict(shape=f"{p['dtype']}:{p['D']}:{p['H']}", variant=name, B=p["B"], floor_us=floor,
                       config=configs.config_to_entry(cfg) if cfg else None)
            if cfg is None:
                row["note"] = "composite (no kernel config)"
            else:
                try:
                    call = tk.backward_call(t, cfg, stats)
                    row["max_err"] = tk.check("backward", call(), ref, tk.DTYPES[p["dtype"]])
                    row["us"] = bench(call)
                    row["pct_floor"] = 100 * floor / row["us"]
                except Exception as err:  # noqa: BLE001
                    row["error"] = f"{type(err).__name__}: {err}"[:200]
            out["rows"].append(row)
            print("%-12s %-11s %9s %5s %9s %s" % (row["shape"], name, "%.1f" % row["us"] if "us" in row else "-",
                                                  "%.0f%%" % row["pct_floor"] if "us" in row else "",
                                                  "%.1e" % row["max_err"] if "max_err" in row else "",
                                                  row.get("error", row.get("note", ""))), flush=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        del t, stats, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
