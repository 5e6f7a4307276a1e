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


def sweep_forward(F, B, D, H, dtype):
    x, w, b = inputs(F, B, D, H, dtype)
    ref = launch.forward(x, w, b, None, None, 0.0, 1)
    base = launch.forward_config(D, H, dtype, False)
    out = []
    orig = launch.forward_config
    for block_b, warps in itertools.product([2, 4, 8, 16, 32, 64], [2, 4, 8]):
        if base.use_dot and block_b < 16:
            continue
        cfg = launch.KernelConfig(block_b, base.block_d, base.block_h, base.use_dot, warps)
        launch.forward_config = lambda *a, _c=cfg: _c
        try:
            y = launch.forward(x, w, b, None, None, 0.0, 1)
            err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            t = bench(lambda: launch.forward(x, w, b, None, None, 0.0, 1))
            out.append({"block_b": block_b, "warps": warps, "us": t, "err_vs_default": err})
        except Exception as e:  # noqa: BLE001 - an invalid config is a row, not a crash
            out.append({"block_b": block_b, "warps": warps, "us": None, "error": str(e)[:80]})
        finally:
            launch.forward_config = orig
    return base, out


def sweep_backward(F, B, D, H, dtype):
    x, w, b = inputs(F, B, D, H, dtype)
    gy = torch.randn(B, F, H, device="cuda", dtype=dtype)
    ref = launch.backward(gy, x, w, b, None, None, 0.0, 1)
    base = launch.backward_config(D, H, dtype, False)
    out = []
    orig_cfg = launch.backward_config
    for block_b, warps, waves in itertools.product([8, 16, 32], [4, 8], [1, 2, 4]):
        if base.use_dot and block_b < 16:
            continue
        cfg = launch.BackwardConfig(block_b, base.block_d, base.block_h, base.use_dot, warps, waves)
        launch.backward_config = lambda *a, _c=cfg: _c
        try:
            g = launch.backward(gy, x, w, b, None, None, 0.0, 1)
            err = max(((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item() for a, r in zip(g[:3], ref[:3]))
            t = bench(lambda: launch.backward(gy, x, w, b, None, None, 0.0, 1))
            out.append({"block_b": block_b, "warps": warps, "waves": waves, "us": t, "err_vs_default": err})
        except Exception as e:  # noqa: BLE001
            out.append({"block_b": block_b, "warps": warps, "waves": waves, "us": None, "error": str(e)[:80]})
        finally:
            launch.backward_config = orig_cfg
    return base, out


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
            USE_DOT=cfg.use_dot, **launch._dot_args(x), BLOCK_B=cfg.block_b, BLOCK_D=cfg.block_d,
            BLOCK_H=cfg.block_h, num_warps=cfg.num_warps)

    layers = {
        "check_op_args": lambda: check_op_args(x, w, b, None, None, 0.0, 1),
        "raw triton launch": raw,
        "launch.forward": lambda: launch.forward(x, w, b, None, None, 0.0, 1),
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
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 200 * 1e6
        out[name] = {"host_us_per_call": host, "wall_us_with_sync": wall}
        print(f"{name:>32}: host {host:7.1f} us/call, wall with sync {wall:7.1f} us", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--skip-backward", action="store_true")
    args = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "host_overhead": host_overhead(), "forward": [], "backward": []}
    for F, B, D, H, dtype in PROBLEMS:
        base, rows = sweep_forward(F, B, D, H, dtype)
        ok = [r for r in rows if r.get("us")]
        best = min(ok, key=lambda r: r["us"])
        default = next((r for r in ok if r["block_b"] == base.block_b and r["warps"] == base.num_warps), None)
        print(f"fwd {F},{B},{D},{H} {dtype}: default {base} -> {default and round(default['us'], 1)} us; best {best}", flush=True)
        result["forward"].append({"problem": [F, B, D, H, str(dtype)], "default": str(base), "rows": rows, "best": best})
        torch.cuda.empty_cache()
    if not args.skip_backward:
        for F, B, D, H, dtype in PROBLEMS:
            base, rows = sweep_backward(F, B, D, H, dtype)
            ok = [r for r in rows if r.get("us")]
            best = min(ok, key=lambda r: r["us"])
            print(f"bwd {F},{B},{D},{H} {dtype}: default {base}; best {best}", flush=True)
            top = sorted(ok, key=lambda r: r["us"])[:5]
            print("   top5:", [(r["block_b"], r["warps"], r["waves"], round(r["us"], 1)) for r in top], flush=True)
            result["backward"].append({"problem": [F, B, D, H, str(dtype)], "default": str(base), "rows": rows, "best": best})
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
