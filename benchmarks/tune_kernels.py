"""Sweep kernel block configs on the GPU and break down the host overhead of one op call.

Prints, per problem, the GPU time (do_bench median) of each forward and backward configuration
and the best one; then the per-call host cost of each layer of the op (argument checks, the
custom-op dispatch, the Triton launch). Results feed the heuristics in `recfuse/ops/launch.py`.

GPU only (it times Triton kernels; there is no CPU mode).

Example:
    python benchmarks/tune_kernels.py --json benchmarks/results/tune_kernels_h100.json
    python benchmarks/tune_kernels.py --dot-forward --chunked --json /tmp/dot_forward.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import recfuse
from _common import copy_bandwidth, do_bench_us, environment, loop_us, op_inputs, wall_us
from recfuse._checks import check_op_args
from recfuse.ops import launch

PROBLEMS = [  # F, B, D, H, dtype
    (128, 8192, 256, 1, torch.float32),
    (128, 8192, 256, 1, torch.bfloat16),
    (16, 1024, 256, 1, torch.float32),
    (128, 8192, 256, 16, torch.float32),
    (128, 8192, 256, 16, torch.bfloat16),
    (128, 8192, 256, 64, torch.float32),
    (128, 8192, 256, 64, torch.bfloat16),
]
# The backward sweep covers the training-step shapes of the benchmark.
BACKWARD_PROBLEMS = [p for p in PROBLEMS if p[0] == 128 and (p[3] == 1 or p[4] == torch.bfloat16)]


def bench(fn, rep=100):
    return do_bench_us(fn, warmup_ms=10, rep_ms=rep)


def inputs(F, B, D, H, dtype):
    inp = op_inputs(F, B, D, H, dtype, "cuda", layout="BFD", ln="none")
    return inp.x, inp.weight, inp.bias


def copy_us(F, B, D, H, dtype):
    """A device-to-device copy of as many bytes as the forward moves (x + y): the bandwidth bar."""
    return copy_bandwidth(F * B * (D + H) * dtype.itemsize, "cuda", bench)["time_us"]


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


def forward_variants(base, dtype, B):
    if base.use_dot:
        rows = (16, 32, 64) if dtype == torch.float32 else (32, 64, 128)
        return [launch.KernelConfig(bb, base.block_d, base.block_h, True, nw)
                for bb in rows for nw in (4, 8)]
    rows = (4, 8, 16) if dtype == torch.float32 else (8, 16, 32)
    evicts = ("", "evict_first") if B >= 8192 else ("",)  # a small x stays in L2 anyway
    return [launch.KernelConfig(bb, base.block_d, base.block_h, False, nw, x_evict=ev)
            for bb in rows for nw in (1, 2, 4) for ev in evicts]


def sweep_forward(F, B, D, H, dtype):
    x, w, b = inputs(F, B, D, H, dtype)
    ref = launch.forward(x, w, b, None, None, 0.0, 1)
    base = launch.forward_config(D, H, dtype, False)
    out = []
    orig = launch.forward_config
    for cfg in forward_variants(base, dtype, B):
        launch.forward_config = lambda *a, _c=cfg, **k: _c
        try:
            row = _timed(lambda: launch.forward(x, w, b, None, None, 0.0, 1), ref)
        finally:
            launch.forward_config = orig
        out.append({"config": str(cfg), **row})
    return base, out


def backward_variants(base):
    if base.use_dot:
        return [launch.BackwardConfig(bb, base.block_d, base.block_h, True, nw, waves=wv)
                for bb in (16, 32) for nw in (4, 8) for wv in (1, 2)]
    grid = [launch.BackwardConfig(bb, base.block_d, base.block_h, False, nw, waves=wv)
            for bb in (8, 16, 32) for nw in (4, 8) for wv in (1, 2, 4)]
    return grid + [dataclasses.replace(c, x_evict="evict_first") for c in grid if c.waves == 1 and c.num_warps == 8]


def sweep_backward(F, B, D, H, dtype):
    x, w, b = inputs(F, B, D, H, dtype)
    gy = torch.randn(B, F, H, device="cuda", dtype=dtype)
    _, stats = launch.forward(x, w, b, None, None, 0.0, 1, save_stats=True)
    ref = launch.backward(gy, x, w, b, None, None, 0.0, 1, stats)
    base = launch.backward_config(D, H, dtype, False)
    out = []
    orig = launch.backward_config
    for cfg in backward_variants(base):
        launch.backward_config = lambda *a, _c=cfg, **k: _c
        try:
            # With the forward's saved row stats, as the eager training step runs it.
            row = _timed(lambda: launch.backward(gy, x, w, b, None, None, 0.0, 1, stats), ref)
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

    layers = {
        "check_op_args": lambda: check_op_args(x, w, b, None, None, 0.0, 1),
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
        host = loop_us(fn, 2000, "cuda", warmup=50, repeats=1)
        wall = wall_us(fn, "cuda", warmup=0)
        out[name] = {"host_us_per_call": host, "wall_us_with_sync": wall}
        print(f"{name:>32}: host {host:7.1f} us/call, wall with sync {wall:7.1f} us", flush=True)
    out["compiled_launch_cache_entries"] = len(launch._launch_fwd.kernels)
    print("compiled launch cache entries (forward):", out["compiled_launch_cache_entries"], flush=True)
    return out


DOT_FORWARD_PROBLEMS = [  # the tl.dot forward shapes, plus H=1 to check that the tile loop costs nothing
    (128, 8192, 256, 16, torch.float32),
    (128, 8192, 256, 64, torch.float32),
    (128, 8192, 256, 32, torch.float32),
    (128, 8192, 256, 16, torch.bfloat16),
    (128, 8192, 256, 64, torch.bfloat16),
    (128, 8192, 256, 32, torch.bfloat16),
    (128, 8192, 256, 1, torch.float32),
    (128, 8192, 256, 1, torch.bfloat16),
]


# --wide: also 16-warp tiles. --chunked: only the default and K-chunked configs.
WIDE = False
CHUNKED = False


def chunked_variants(base, dtype):
    """The default and K-chunked tiles (block_k columns at a time), one program per tile or
    persistent. The grid is the neighbourhood of the first sweep's winners
    (dot_forward_chunked_h100.txt@22b1a40: fp32 64 rows/4 warps/64 columns, bf16 H=16 persistent)."""
    out = [base]
    if dtype == torch.float32:
        out += [dataclasses.replace(base, block_b=bb, num_warps=nw, block_k=bk, persistent=0, tile_stages=1)
                for bb in (64, 128) for nw in (4, 8) for bk in (32, 64)]
        out += [dataclasses.replace(base, block_b=bb, num_warps=4, block_k=64, persistent=p, tile_stages=2)
                for bb in (64, 128) for p in (1, 2)]
        return out
    return out + [dataclasses.replace(base, block_b=bb, num_warps=nw, block_k=bk, persistent=p, tile_stages=st)
                  for bb, nw in ((64, 4), (128, 4), (128, 8)) for bk in (32, 64)
                  for p, st in ((0, 1), (1, 2), (1, 3))]


def persistent_variants(base, dtype):
    """The default, one program per tile (32-row tiles), and persistent programs with 1-3 tiles
    of x in flight (8 warps: 4 never won the first sweep, checks/dot_forward_v1_h100.json)."""
    if not base.use_dot:
        return [base]
    if CHUNKED:
        return chunked_variants(base, dtype)
    single = dataclasses.replace(base, block_b=32, num_warps=4 if dtype == torch.float32 else 8,
                                 persistent=0, tile_stages=1)
    out = [base] + ([single] if single != base else [])
    if dtype == torch.float32:
        # 3xTF32 spills (ncu: 255 registers, local memory traffic): smaller row tiles, and
        # narrower H blocks looped over (the weight's hi/lo operands take fewer registers).
        out += [dataclasses.replace(single, num_warps=8, persistent=p, tile_stages=st)
                for p, st in ((1, 1), (1, 2), (2, 2))]
        out += [dataclasses.replace(single, block_b=16, num_warps=nw) for nw in (2, 4)]
        out += [dataclasses.replace(single, block_b=16, num_warps=4, persistent=2, tile_stages=2)]
        if WIDE:
            out += [dataclasses.replace(single, block_b=bb, num_warps=16, persistent=p, tile_stages=st)
                    for bb in (32, 64) for p, st in ((0, 1), (1, 2))]
        for bh in (16, 32):
            if bh < base.block_h:
                out += [dataclasses.replace(single, block_h=bh, block_b=bb, num_warps=4)
                        for bb in (16, 32)]
        return out
    out += [dataclasses.replace(base, block_b=bb, num_warps=8, persistent=p, tile_stages=st)
            for bb in (64, 128) for p, st in ((1, 2), (1, 3), (2, 3))]
    if WIDE:
        # 16 warps: the same tile over twice the threads, half the registers a thread (ncu: 2
        # warps per scheduler at 8 warps and 194 registers, latency-bound).
        out += [dataclasses.replace(base, block_b=bb, num_warps=16, persistent=p, tile_stages=st)
                for bb in (64, 128, 256) for p, st in ((1, 2), (1, 3), (2, 2))]
    return out


def sweep_dot_forward(only=None, skip=0):
    """GPU time of persistent forward configs against one program per tile, per problem."""
    out = []
    for F, B, D, H, dtype in DOT_FORWARD_PROBLEMS[skip:only]:
        x, w, b = inputs(F, B, D, H, dtype)
        ref = launch.forward(x, w, b, None, None, 0.0, 1)
        base = launch.forward_config(D, H, dtype, False)
        orig = launch.forward_config
        rows = []
        for cfg in persistent_variants(base, dtype):
            launch.forward_config = lambda *a, _c=cfg, **k: _c
            try:
                rows.append({"config": str(cfg), **_timed(lambda: launch.forward(x, w, b, None, None, 0.0, 1), ref)})
            finally:
                launch.forward_config = orig
        copy = copy_us(F, B, D, H, dtype)
        default_us = next((r["us"] for r in rows if r["config"] == str(base)), None)
        print(f"dot forward {F},{B},{D},{H} {dtype}: copy {copy:.1f} us; default {default_us} us ({base})", flush=True)
        for r in sorted((r for r in rows if r.get("us")), key=lambda r: r["us"])[:5]:
            print(f"    {r['us']:8.1f} us = {100 * copy / r['us']:5.1f}% of copy  err {r['err_vs_default']:.1e}"
                  f"  {r['config']}", flush=True)
        bad = [r for r in rows if not r.get("us")]
        if bad:
            print(f"    {len(bad)} configs failed, e.g. {bad[0]}", flush=True)
        out.append({"problem": [F, B, D, H, str(dtype)], "default": str(base), "copy_us": copy, "rows": rows})
        del x, w, b, ref
        torch.cuda.empty_cache()
    return out


def _env() -> dict:
    env = environment("cuda")
    return {"gpu": env["device_name"], "torch": env["torch"], "triton": env["triton"], "env": env}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--skip-backward", action="store_true")
    ap.add_argument("--only", type=int, default=None, help="with --dot-forward: the first N problems")
    ap.add_argument("--skip", type=int, default=0, help="with --dot-forward: skip the first N problems")
    ap.add_argument("--wide", action="store_true", help="with --dot-forward: add 16-warp configs")
    ap.add_argument("--chunked", action="store_true", help="with --dot-forward: default vs K-chunked configs")
    ap.add_argument("--dot-forward", action="store_true",
                    help="only sweep persistent forward configs (tile loop, x loads in flight)")
    args = ap.parse_args()
    if args.dot_forward:
        global WIDE, CHUNKED
        WIDE, CHUNKED = args.wide, args.chunked
        result = {**_env(), "dot_forward": sweep_dot_forward(args.only, args.skip)}
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
        return
    result = {**_env(), "host_overhead": host_overhead(), "forward": [], "backward": []}
    for kind, sweep, problems in (("forward", sweep_forward, PROBLEMS),
                                  ("backward", None if args.skip_backward else sweep_backward, BACKWARD_PROBLEMS)):
        if sweep is None:
            continue
        for F, B, D, H, dtype in problems:
            base, rows = sweep(F, B, D, H, dtype)
            ok = sorted((r for r in rows if r.get("us")), key=lambda r: r["us"])
            copy = copy_us(F, B, D, H, dtype)
            default_us = next((r["us"] for r in rows if r["config"] == str(base)), None)
            print(f"{kind} {F},{B},{D},{H} {dtype}: copy of x+y {copy:.1f} us; default {base}"
                  f" {default_us if default_us is None else round(default_us, 1)} us", flush=True)
            for r in ok[:4]:
                print(f"    {r['us']:8.1f} us  err {r['err_vs_default']:.1e}  {r['config']}", flush=True)
            bad = [r for r in rows if not r.get("us")]
            if bad:
                print(f"    {len(bad)} configs failed, e.g. {bad[0]}", flush=True)
            result[kind].append({"problem": [F, B, D, H, str(dtype)], "default": str(base), "copy_us": copy,
                                 "rows": rows})
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
