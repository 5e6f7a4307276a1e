"""A/B of the fp32 backward's tl.dot products: fp32 operands with 3xTF32 ("tf32x3", the old path)
against fp32 values split into bf16 parts on bf16 tensor cores ("bf16x3": 2 parts, 3 products;
"bf16x6": 3 parts, 6 products; "bf16x6z3": bf16x6 but z, which only decides the relu mask, in
bf16x3), in one process, on the same inputs.

For every (D, H) and mode: the backward alone (the fused backward kernel and the reduction of its
partial sums, `launch.BackwardPlan`) timed with ``triton.testing.do_bench`` (median), its share
of the memory floor (x and grad_y read, dx written, at the bandwidth of a device-to-device copy
timed here), and every gradient's ||g - g64|| / ||g64|| against the float64 composite backward,
grad_y zeroed where the float64 |z| < 1e-4 (relu ties, as ``benchmarks/tune_kernels.py``).

Each mode runs with the fp32 config (tuned table or heuristic: what `configs.backward_config`
gives) and, with ``--cfg-from both``, also with the bf16 config of the shape (tuned for bf16
tensor-core operands). A mode whose kernel does not fit the device (Triton's OutOfResources at
compile time) is reported as such, and the fallback recfuse would take (fp32 FMA dots, "ieee")
is timed in its place.

Usage (CUDA):
    python benchmarks/ab_fp32_bwd.py --json ab_fp32_bwd_h100.json
CPU check of the script itself (Triton interpreter, tiny shapes, perf_counter timing):
    python benchmarks/ab_fp32_bwd.py --small --json /tmp/ab_small.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = "64x16,128x16,256x16,512x16,64x64,128x64,256x64"
SMALL_SHAPES = "40x16,64x64"
RELU_TIE = 1e-4
NAMES = ("x", "weight", "bias", "ln_weight", "ln_bias")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--shapes", default=None, help=f"DxH,... (default {SHAPES}; --small: {SMALL_SHAPES})")
    ap.add_argument("--modes", default="tf32x3,bf16x3,bf16x6,bf16x6z3")
    ap.add_argument("--cfg-from", default="both", choices=("float32", "bfloat16", "both"),
                    help="whose tuned config the split modes run with (tf32x3 always the fp32 one)")
    ap.add_argument("--mb", type=float, default=256.0, help="MB of fp32 x per shape")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--rep", type=float, default=100.0, help="do_bench rep, ms")
    ap.add_argument("--small", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    return ap.parse_args(argv)


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.small:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

sys.path.insert(0, str(REPO))
import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from recfuse.ops import configs, launch  # noqa: E402
from recfuse.ops.composite import composite_backward  # noqa: E402


def inputs(F, B, D, H, device, seed=0):
    """x as a [B, F*D] buffer seen as [B, F, D] (feature_dim=1), a shared weight and bias,
    per-feature LayerNorm affine, grad_y; as benchmarks/tune_kernels.py builds them."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, device=device, generator=g) * scale + shift

    return dict(x=rnd(B, F * D).view(B, F, D), w=rnd(H, D, scale=D ** -0.5), b=rnd(H, scale=0.1, shift=0.1),
                lw=rnd(F, D, scale=0.2, shift=1.0), lb=rnd(F, D, scale=0.2), gy=rnd(B, F, H))


def reference(t, eps):
    """float64 gradients; zeroes t["gy"] in place at relu ties."""
    x, w, b, lw, lb = (t[k].double() for k in ("x", "w", "b", "lw", "lb"))
    xc = x - x.mean(-1, keepdim=True)
    a = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps) * lw + lb  # [B, F, D] * [F, D]
    z = torch.tanh(a) @ w.t() + b
    del xc, a
    t["gy"].masked_fill_(z.abs() < RELU_TIE, 0)
    del z
    return composite_backward(t["gy"].double(), x, w, b, lw, lb, eps, 1)


def rel_err(g, r):
    return ((g.double() - r).norm() / r.norm().clamp_min(1e-300)).item()


def make_timer(device, rep_ms):
    if device == "cuda":
        return lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")

    def cpu(fn, n=3):
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    return cpu


def run_mode(t, cfg, eps):
    """(plan, grads) of one forced config; OutOfResources propagates."""
    with configs.override(backward=cfg):
        plan = launch.backward_plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], eps, 1)
    call = lambda: plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], None)  # noqa: E731
    grads = call()
    if t["x"].is_cuda:
        torch.cuda.synchronize()
    return plan, call, grads


def main(args) -> int:
    device = "cpu" if args.small else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --small for the interpreter check", file=sys.stderr)
        return 2
    dev_index = "cpu" if device == "cpu" else torch.cuda.current_device()
    bench = make_timer(device, args.rep)
    eps = 1e-5
    shapes = [tuple(map(int, s.split("x"))) for s in (args.shapes or (SMALL_SHAPES if args.small else SHAPES)).split(",")]
    modes = args.modes.split(",")
    env = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
               torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    gbps = None
    if device == "cuda":
        buf = torch.empty(int(args.mb * 2 ** 20) // 4, device=device)
        out = torch.empty_like(buf)
        copy_us = bench(lambda: out.copy_(buf))
        gbps = 2 * buf.numel() * 4 / copy_us / 1e3
        env["copy_GBps"] = gbps
        del buf, out
    print(json.dumps(env), flush=True)
    rows = []
    for D, H in shapes:
        F = 2 if args.small else args.features
        B = 64 if args.small else max(1, int(args.mb * 2 ** 20) // (4 * F * D))
        t = inputs(F, B, D, H, device)
        ref = reference(t, eps)
        floor_us = None
        if gbps:
            floor_us = (t["x"].numel() * 4 * 2 + t["gy"].numel() * 4) / gbps / 1e3
        base = {"float32": configs.backward_config(D, H, torch.float32, dev_index),
                "bfloat16": configs.backward_config(D, H, torch.bfloat16, dev_index)}
        runs = []
        for mode in modes:
            sources = ["float32"] if mode == "tf32x3" or args.cfg_from == "float32" else (
                ["bfloat16"] if args.cfg_from == "bfloat16" else ["float32", "bfloat16"])
            for src in sources:
                if base[src] is None:
                    continue
                runs.append((mode, src, dataclasses.replace(base[src], use_dot=True, fp32_dots=mode)))
        for mode, src, cfg in runs:
            row = dict(D=D, H=H, F=F, B=B, mode=mode, cfg_from=src,
                       config={k: getattr(cfg, k) for k in ("block_b", "num_warps", "num_stages", "programs_per_sm")})
            try:
                plan, call, grads = run_mode(t, cfg, eps)
                row["status"] = "ok"
            except OutOfResources as err:
                row["status"] = f"out of resources: {err}"
                try:  # what recfuse falls back to: fp32 FMA dots
                    plan, call, grads = run_mode(t, dataclasses.replace(cfg, fp32_dots="ieee"), eps)
                    row["status"] += "; timed: the ieee fallback"
                except OutOfResources as err2:
                    row["status"] += f"; ieee fallback too: {err2}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
            meta = plan.meta
            row["kernel"] = dict(BWD_DOT_DTYPE=str(meta["BWD_DOT_DTYPE"]), BWD_DOT_PRECISION=meta["BWD_DOT_PRECISION"],
                                 SPLIT=(meta["SPLIT_Z"], meta["SPLIT_DT"], meta["SPLIT_DW"]))
            row["errors"] = {n: rel_err(g, r) for n, g, r in zip(NAMES, grads, ref) if r is not None and g.numel()}
            row["max_error"] = max(row["errors"].values())
            row["within_1e-4"] = row["max_error"] < 1e-4
            row["within_1e-5"] = row["max_error"] < 1e-5
            del grads
            row["us"] = bench(call)
            if floor_us:
                row["floor_us"] = floor_us
                row["pct_floor"] = 100 * floor_us / row["us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del t, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    summary = []
    for r in rows:
        if "us" in r:
            old = next((o for o in rows if o["D"] == r["D"] and o["H"] == r["H"] and o["mode"] == "tf32x3" and "us" in o), None)
            summary.append(f"D={r['D']:4d} H={r['H']:3d} {r['mode']:7s} cfg={r['cfg_from']:8s} {r['us']:10.1f} us"
                           + (f" {r['pct_floor']:5.1f}% floor" if "pct_floor" in r else "")
                           + (f" x{old['us'] / r['us']:.2f} vs tf32x3" if old else "")
                           + f"  max err {r['max_error']:.1e}" + ("" if r["status"] == "ok" else "  [" + r["status"][:60] + "]"))
        else:
            summary.append(f"D={r['D']:4d} H={r['H']:3d} {r['mode']:7s} cfg={r['cfg_from']:8s} {r['status'][:100]}")
    print("\n".join(summary))
    Path(args.json).write_text(json.dumps(dict(env=env, rows=rows, summary=summary), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
