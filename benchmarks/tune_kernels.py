"""Sweep kernel block configs on the GPU and break down the host overhead of one op call.

Prints, per problem, the GPU time (do_bench median) of each forward and backward configuration
and the best one; then the per-call host cost of each layer of the op (argument checks, the
custom-op dispatch, the Triton launch). Results feed the heuristics in `recfuse/ops/launch.py`.

Usage (GPU): python benchmarks/tune_kernels.py --json benchmarks/results/tune_h100.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
import triton.testing

import recfuse
from recfuse._checks import check_op_args
from recfuse.ops import launch

from _timing import wall_us_with_sync

PROBLEMS = [  # F, B, D, H, dtype
    (128, 8192, 256, 1, torch.float32),
    (128, 8192, 256, 1, torch.bfloat16),
    (128, 8192, 256, 16, torch.float32),
    (128, 8192, 256, 16, torch.bfloat16),
    (128, 8192, 256, 64, torch.bfloat16),
]


def bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def inputs(F, B, D, H, dtype):
    x = torch.randn(B, F * D, device="cuda", dtype=dtype).view(B, F, D)
    w = torch.randn(H, D, device="cuda", dtype=dtype) / D ** 0.5
    b = torch.randn(H, device="cuda", dtype=dtype) * 0.1
    return x, w, b


def _timed(fn, ref):
    try:
        out = fn()
        out = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        err = max(((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item()
                  for a, r in zip(out[:3], refs[:3]))
        return {"us": bench(fn), "err_vs_default": err}
    except Exception as e:  # noqa: BLE001 - an invalid config is a row, not a crash
        return {"us": None, "error": str(e)[:80]}


def sweep_forward(F, B, D, H, dtype):
    x, w, b = inputs(F, B, D, H, dtype)
    ref = launch.forward(x, w, b, None, None, 0.0, 1)
    base = launch.forward_config(D, H, dtype, False)
    variants = []
    if base.use_dot:
        variants += [launch.KernelConfig(bb, base.block_d, base.block_h, True, nw)
                     for bb in (16, 32, 64) for nw in (4, 8)]
        variants += [launch.KernelConfig(bb, base.block_d, 4, False, nw)
                     for bb in (1, 2, 4) for nw in (2, 4, 8)]
    else:
        variants += [launch.KernelConfig(bb, base.block_d, base.block_h, False, nw)
                     for bb in (4, 8, 16, 32) for nw in (2, 4)]
    out = []
    orig = launch.forward_config
    precisions = ("tf32x3", "ieee") if dtype == torch.float32 and base.use_dot else ("tf32x3",)
    for cfg in variants:
        for precision in precisions if cfg.use_dot else ("tf32x3",):
            launch.forward_config = lambda *a, _c=cfg: _c
            launch.FP32_DOT_PRECISION = precision
            try:
                row = _timed(lambda: launch.forward(x, w, b, None, None, 0.0, 1), ref)
            finally:
                launch.forward_config = orig
                launch.FP32_DOT_PRECISION = "tf32x3"
            out.append({"config": f"{cfg} fp32 dots {precision}" if dtype == torch.float32 else str(cfg), **row})
    return base, out


def sweep_backward(F, B, D, H, dtype):
    x, w, b = inputs(F, B, D, H, dtype)
    gy = torch.randn(B, F, H, device="cuda", dtype=dtype)
    ref = launch.backward(gy, x, w, b, None, None, 0.0, 1)
    base = launch.backward_config(D, H, dtype, False)
    if base.use_dot:
        variants = [launch.BackwardConfig(bb, base.block_d, base.block_h, True, nw, wv, 1)
                    for bb in (16, 32) for nw in (4, 8) for wv in (1, 2)]
        if dtype == torch.float32 and H <= 16:
            variants += [launch.BackwardConfig(bb, base.block_d, base.block_h, False, nw, wv, st)
                         for bb in (1, 2) for nw in (4, 8) for wv in (1, 4) for st in (1, 2)]
    else:
        variants = [launch.BackwardConfig(bb, base.block_d, base.block_h, False, nw, wv, st)
                    for bb in (8, 16, 32) for nw in (4, 8) for wv in (1, 2, 8) for st in (1, 2, 3)]
    out = []
    orig = launch.backward_config
    for cfg in variants:
        launch.backward_config = lambda *a, _c=cfg: _c
        try:
            row = _timed(lambda: launch.backward(gy, x, w, b, None, None, 0.0, 1), ref)
        finally:
            launch.backward_config = orig
        out.append({"config": str(cfg), **row})
    return base, out


def _without_compiled_launch(fn):
    launch._launch_fwd.enabled = False
    try:
        return fn()
    finally:
        launch._launch_fwd.enabled = True


def host_overhead():
    F, B, D, H = 16, 1024, 256, 1
    x, w, b = inputs(F, B, D, H, torch.float32)
    cfg = launch.forward_config(D, H, torch.float32, False)
    y = torch.empty(B, F, H, device="cuda")
    grid = (triton.cdiv(B, cfg.block_b), F)

    def raw():
        launch.kernels.ln_tanh_linear_relu_fwd[grid](
            x, w, b, w, w, y, B, D, H, x.stride(1), x.stride(0), 1, 0, w.stride(0), 0, 0, 0,
            y.stride(1), y.stride(0), 0.0, HAS_BIAS=True, HAS_LNW=False, HAS_LNB=False,
            USE_DOT=cfg.use_dot, **launch._dot_args(x), FAST_TANH=False, BLOCK_B=cfg.block_b, BLOCK_D=cfg.block_d,
            BLOCK_H=cfg.block_h, num_warps=cfg.num_warps)

    layers = {
        "check_op_args": lambda: check_op_args(x, w, b, None, None, 0.0, 1),
        "raw triton launch": raw,
        "launch.forward": lambda: launch.forward(x, w, b, None, None, 0.0, 1),
        "launch.forward via JITFunction.run": lambda: _without_compiled_launch(
            lambda: launch.forward(x, w, b, None, None, 0.0, 1)),
        "torch.ops.recfuse (custom op)": lambda: torch.ops.recfuse.ln_tanh_linear_relu(x, w, b, None, None, 0.0, 1),
        "recfuse.ln_tanh_linear_relu": lambda: recfuse.ln_tanh_linear_relu(x, w, b, eps=0.0, feature_dim=1),
        "torch.empty (reference)": lambda: torch.empty(B, F, H, device="cuda"),
        "torch relu (one aten kernel)": lambda: torch.relu(x),
    }
    out = {}
    for name, fn in layers.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        host = (time.perf_counter() - t0) / n * 1e6
        wall = wall_us_with_sync(fn, warmup=0)
        out[name] = {"host_us_per_call": host, "wall_us_with_sync": wall}
        print(f"{name:>32}: host {host:7.1f} us/call, wall with sync {wall:7.1f} us", flush=True)
    out["compiled_launch_cache_entries"] = len(launch._launch_fwd.kernels)
    print("compiled launch cache entries (forward):", out["compiled_launch_cache_entries"], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--skip-backward", action="store_true")
    args = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "host_overhead": host_overhead(), "forward": [], "backward": []}
    for kind, sweep in (("forward", sweep_forward), ("backward", None if args.skip_backward else sweep_backward)):
        if sweep is None:
            continue
        for F, B, D, H, dtype in PROBLEMS:
            base, rows = sweep(F, B, D, H, dtype)
            ok = sorted((r for r in rows if r.get("us")), key=lambda r: r["us"])
            print(f"{kind} {F},{B},{D},{H} {dtype}: default {base}", flush=True)
            for r in ok[:4]:
                print(f"    {r['us']:8.1f} us  err {r['err_vs_default']:.1e}  {r['config']}", flush=True)
            bad = [r for r in rows if not r.get("us")]
            if bad:
                print(f"    {len(bad)} configs failed, e.g. {bad[0]}", flush=True)
            result[kind].append({"problem": [F, B, D, H, str(dtype)], "default": str(base), "rows": rows})
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
