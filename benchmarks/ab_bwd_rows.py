"""A/B of H=1 backward kernel designs against the shipped backward, same run, same inputs.

The H = 1 backward (the puzzler's shape) runs at 50-70% of its floor on the H100 (grid_h100) where
the forward reaches 80-88%. This tool times a candidate kernel, `bwd_rows_h1`, written from scratch
for H = 1, LayerNorm -> tanh -> relu, full tiles, saved row statistics, over a sweep of its knobs:

* ACC_COLS: the column sums of the weight / LayerNorm-affine gradients per tile (one cross-warp
  reduction a tile) instead of [BLOCK_B, BLOCK_D] row slots (registers that cap occupancy);
* STAGES: `tl.range(num_stages=STAGES)`, Triton's software pipelining of the row loop's loads
  (tiles of x in flight while one is computed), instead of a serial load -> compute -> store loop;
* BLOCK_B, num_warps, programs per SM.

Every candidate writes the shipped partial-row layout and runs the shipped reduction kernel, so the
times compare kernel + reduction with kernel + reduction; its gradients are checked against the
shipped backward's (which the test-suite holds to float64). A copy of x into dx (`torch.copy_`) in
the same run gives the bandwidth the floor is computed from.

Example:
    $ python benchmarks/ab_bwd_rows.py --json benchmarks/results/checks/ab_bwd_rows_h100.json
    $ TRITON_INTERPRET=1 python benchmarks/ab_bwd_rows.py --device cpu     # correctness smoke run
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import subprocess
import sys
import time

import torch
import triton
import triton.language as tl

from _common import do_bench_us, environment, perf_counter_us
from recfuse.ops import configs, launch
from recfuse.ops.kernels import _tanh_of

log = logging.getLogger("recfuse.bench")


@triton.jit
def bwd_rows_h1(
    GY, X, W, BIAS, LNW, LNB, DX, PARTIAL, STATS,
    B, rows_per_program, stats_half,
    stride_x_f, stride_x_b, stride_gy_f, stride_gy_b, stride_dx_f, stride_dx_b,
    stride_lnw_f, stride_lnb_f, stride_part_prog, inv_d,
    FAST_TANH: tl.constexpr, ACC_COLS: tl.constexpr, STAGES: tl.constexpr, X_EVICT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_p = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(W + cols).to(tl.float32)
    bias = tl.load(BIAS).to(tl.float32)
    g = tl.load(LNW + f * stride_lnw_f + cols).to(tl.float32)
    beta = tl.load(LNB + f * stride_lnb_f + cols).to(tl.float32)
    ACC_ROWS: tl.constexpr = 1 if ACC_COLS else BLOCK_B
    acc_w = tl.zeros([ACC_ROWS, BLOCK_D], dtype=tl.float32)
    acc_g = tl.zeros([ACC_ROWS, BLOCK_D], dtype=tl.float32)
    acc_beta = tl.zeros([ACC_ROWS, BLOCK_D], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_B], dtype=tl.float32)
    row_start = pid_p * rows_per_program
    for r0 in tl.range(row_start, row_start + rows_per_program, BLOCK_B, num_stages=STAGES):
        rows = (r0 + tl.arange(0, BLOCK_B)).to(tl.int64)
        x = tl.load(X + f * stride_x_f + rows[:, None] * stride_x_b + cols[None, :],
                    eviction_policy=X_EVICT).to(tl.float32)
        mean = tl.load(STATS + f * B + rows)
        rstd = tl.load(STATS + stats_half + f * B + rows)
        gy = tl.load(GY + f * stride_gy_f + rows * stride_gy_b).to(tl.float32)
        xhat = (x - mean[:, None]) * rstd[:, None]
        t = _tanh_of(xhat * g[None, :] + beta[None, :], FAST_TANH)
        z = tl.sum(t * w[None, :], axis=1) + bias
        dz = tl.where(z > 0, gy, 0.0)
        da = (dz[:, None] * w[None, :]) * (1.0 - t * t)
        dxhat = da * g[None, :]
        c1 = tl.sum(dxhat * xhat, axis=1) * inv_d
        c2 = tl.sum(dxhat, axis=1) * inv_d
        dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + f * stride_dx_f + rows[:, None] * stride_dx_b + cols[None, :], dx.to(DX.dtype.element_ty))
        if ACC_COLS:
            acc_w += tl.sum(dz[:, None] * t, axis=0, keep_dims=True)
            acc_g += tl.sum(da * xhat, axis=0, keep_dims=True)
            acc_beta += tl.sum(da, axis=0, keep_dims=True)
        else:
            acc_w += dz[:, None] * t
            acc_g += da * xhat
            acc_beta += da
        acc_b += dz
    # The shipped partial row: [H*D weight | H bias | D ln_weight | D ln_bias], H = 1.
    part = PARTIAL + (f * n_prog + pid_p) * stride_part_prog
    tl.store(part + cols, tl.sum(acc_w, axis=0))
    tl.store(part + BLOCK_D, tl.sum(acc_b, axis=0))
    tl.store(part + BLOCK_D + 1 + cols, tl.sum(acc_g, axis=0))
    tl.store(part + 2 * BLOCK_D + 1 + cols, tl.sum(acc_beta, axis=0))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def candidates(D: int, device: str) -> list[dict]:
    out = []
    for block_b, warps, acc_cols, stages in itertools.product((4, 8, 16, 32, 64, 128), (2, 4, 8), (0, 1), (1, 2, 3)):
        per_thread = block_b * D / (32 * warps)
        if 4 <= per_thread <= 32 and block_b * D <= 8192:
            out.append(dict(block_b=block_b, num_warps=warps, acc_cols=acc_cols, stages=stages))
    if device == "cpu":
        out = out[:: max(1, len(out) // 4)]
    return out


def make_case(dtype, D: int, F: int, B: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device=device, generator=g) * scale + shift).to(dtype)

    x = rnd(B, F * D).view(B, F, D)
    case = dict(x=x, w=rnd(1, D, scale=D ** -0.5), b=rnd(1, scale=0.1, shift=0.1),
                lw=rnd(F, D, scale=0.2, shift=1.0), lb=rnd(F, D, scale=0.2), gy=rnd(B, F, 1))
    fplan = launch.forward_plan(case["x"], case["w"], case["b"], case["lw"], case["lb"], 1e-5, 1, save_stats=True)
    case["stats"] = fplan(case["x"], case["w"], case["b"], case["lw"], case["lb"])[1]
    return case


def shipped_call(c: dict):
    plan = launch.backward_plan(c["gy"], c["x"], c["w"], c["b"], c["lw"], c["lb"], 1e-5, 1, c["stats"])
    stats = c["stats"] if plan.meta["LOAD_STATS"] else None
    return (lambda: plan(c["gy"], c["x"], c["w"], c["b"], c["lw"], c["lb"], stats)), plan


def candidate_call(c: dict, cand: dict, pps: int, sms: int):
    x, dtype = c["x"], c["x"].dtype
    B, F, D = x.shape
    P = max(1, min(triton.cdiv(B, cand["block_b"]), triton.cdiv(pps * sms, F)))
    rpp = triton.cdiv(triton.cdiv(B, P), cand["block_b"]) * cand["block_b"]
    P = triton.cdiv(B, rpp)
    if B % rpp:
        return None  # full tiles only
    K = configs.partial_row_size(D, 1)
    base = launch.backward_plan(c["gy"], x, c["w"], c["b"], c["lw"], c["lb"], 1e-5, 1, c["stats"])
    gy, lw, lb, stats = c["gy"], c["lw"], c["lb"], c["stats"]
    fast = dtype != torch.float32 and x.device.type == "cuda"

    def call():
        dx = torch.empty_like(x)
        partial = torch.empty((F * P, K), dtype=torch.float32, device=x.device)
        gw, gb = torch.empty_like(c["w"]), torch.empty_like(c["b"])
        glw, glb = torch.empty_like(lw), torch.empty_like(lb)
        bwd_rows_h1[(P, F)](
            gy, x, c["w"], c["b"], lw, lb, dx, partial, stats,
            B, rpp, F * B, x.stride(1), x.stride(0), gy.stride(1), gy.stride(0), dx.stride(1), dx.stride(0),
            lw.stride(0), lb.stride(0), K, 1.0 / D,
            FAST_TANH=fast, ACC_COLS=bool(cand["acc_cols"]), STAGES=cand["stages"], X_EVICT="",
            BLOCK_B=cand["block_b"], BLOCK_D=D, num_warps=cand["num_warps"])
        launch._launch_partials_to_grads(base.reduce_grid, (partial, gw, gb, glw, glb, F, P, K, 1, D),
                                         base.reduce_meta)
        return dx, gw, gb, glw, glb
    return call


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_shape(dtype_name: str, D: int, x_mb: float, F: int, device: str, bench, sms: int, copy_us_per_byte):
    dtype = DTYPES[dtype_name]
    B = max(64, int(x_mb * 2 ** 20 / (F * D * dtype.itemsize)) // 256 * 256)
    c = make_case(dtype, D, F, B, device)
    ship, plan = shipped_call(c)
    ref = ship()
    x_bytes = c["x"].numel() * c["x"].element_size()
    floor_us = (2 * x_bytes + c["gy"].numel() * c["gy"].element_size()) * copy_us_per_byte
    rows = [{"name": "shipped", "config": configs.config_to_entry(plan.cfg), "us": bench(ship), "err": 0.0}]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for cand in candidates(D, device):
        for pps in ((2, 4, 8, 16) if device == "cuda" else (2,)):
            row = {"name": "rows_h1", "config": dict(cand, programs_per_sm=pps)}
            try:
                fn = candidate_call(c, cand, pps, sms)
                if fn is None:
                    continue
                out = fn()
                row["err"] = max(rel_err(o, r) for o, r in zip(out, ref))
                if row["err"] > tol:
                    row["rejected"] = f"error {row['err']:.1e}"
                else:
                    row["us"] = bench(fn)
            except Exception as e:  # noqa: BLE001 - reported as a row
                row["rejected"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            rows.append(row)
    for r in rows:
        if "us" in r:
            r["pct_floor"] = 100 * floor_us / r["us"]
    timed = sorted((r for r in rows if "us" in r and r["name"] != "shipped"), key=lambda r: r["us"])
    return {"dtype": dtype_name, "D": D, "F": F, "B": B, "x_MB": x_bytes / 2 ** 20, "floor_us": floor_us,
            "shipped": rows[0], "best": timed[:5], "rows": rows}


def compile_worker(spec: str) -> int:
    dtype_name, D, x_mb, F, shard, n = spec.split(",")
    D, F, shard, n = int(D), int(F), int(shard), int(n)
    dtype = DTYPES[dtype_name]
    B = max(64, int(float(x_mb) * 2 ** 20 / (F * D * dtype.itemsize)) // 256 * 256)
    c = make_case(dtype, D, F, B, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, cand in enumerate(candidates(D, "cuda")):
        if i % n == shard:
            try:
                fn = candidate_call(c, cand, 4, sms)
                if fn is not None:
                    fn()
            except Exception:  # noqa: BLE001
                pass
    torch.cuda.synchronize()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["fp32:256", "bf16:256", "fp32:64", "bf16:64"],
                    help="dtype:D pairs")
    ap.add_argument("--x-mb", type=float, default=256.0)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    ap.add_argument("--json")
    ap.add_argument("--compile-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_worker:
        return compile_worker(args.compile_worker)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = args.device
    shapes = [(s.split(":")[0], int(s.split(":")[1])) for s in args.shapes]
    if dev == "cuda":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, __file__, "--compile-worker",
                                   f"{dt},{D},{args.x_mb},{args.features},{i},{args.workers}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for dt, D in shapes for i in range(args.workers)]
        for p in procs:
            p.wait()
        log.info("compiled in %.0f s", time.perf_counter() - t0)
        def bench(fn):
            return do_bench_us(fn, warmup_ms=5, rep_ms=20)
        src = torch.empty(int(args.x_mb * 2 ** 20), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_us_per_byte = bench(lambda: dst.copy_(src)) / (2 * src.numel())
        del src, dst
    else:
        sms, args.x_mb, args.features = 2, 0.02, 2
        def bench(fn):
            return perf_counter_us(fn, warmup_ms=0, rep_ms=0, min_calls=1)
        copy_us_per_byte = 1e-3
    results = []
    for dt, D in shapes:
        r = run_shape(dt, D, args.x_mb, args.features, dev, bench, sms, copy_us_per_byte)
        results.append(r)
        s = r["shipped"]
        print(f"{dt} D={D} B={r['B']} floor {r['floor_us']:.1f} us | shipped {s['us']:.1f} us "
              f"({s.get('pct_floor', 0):.0f}%) {s['config']}")
        for b in r["best"]:
            print(f"    rows_h1 {b['us']:8.1f} us ({b['pct_floor']:.0f}%) err {b['err']:.1e} {b['config']}")
        rej = [x for x in r["rows"] if "rejected" in x]
        if rej:
            print(f"    {len(rej)} rejected, e.g. {rej[0]['config']}: {rej[0]['rejected']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"tool": "ab_bwd_rows", "env": environment(dev), "copy_us_per_byte": copy_us_per_byte,
                       "shapes": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
