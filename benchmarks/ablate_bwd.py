"""Where the tl.dot backward's time goes: the shipped backward kernel against copies of it with one
part removed (the z recompute, the dt product, the weight-gradient product, the LayerNorm-affine
column sums, the row sums of dx), and against a copy kernel with the same grid (load x and grad_y,
store dx). Variants are wrong on purpose; only their time is read. One-off investigation.

Usage (CUDA): python benchmarks/ablate_bwd.py --json out.json [--points bf16:256:16:per_feature,...]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import _common  # noqa: E402
from recfuse.ops import configs, kernels, launch  # noqa: E402

SRC = Path(kernels.__file__).read_text()

Z_DOT = """z = _dot_parts(t0, t1, t2, tl.trans(w0), tl.trans(w1), tl.trans(w2),
                               tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32),
                               SPLIT_Z, W_PARTS, SPLIT_Z, DOT_UPCAST) + bias[None, :]"""
DT_DOT = """dt = _dot_parts(dz0, dz1, dz2, w0, w1, w2, tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32),
                            min(DZ_PARTS, SPLIT_DT), W_PARTS, SPLIT_DT, DOT_UPCAST)"""
DW_DOT = """acc_w = _dot_parts(tl.trans(dz0), tl.trans(dz1), tl.trans(dz2), t0, t1, t2, acc_w,
                               min(DZ_PARTS, SPLIT_DW), T_DW_PARTS, SPLIT_DW, DOT_UPCAST)"""
LNW_SUM = "acc_lnw_rows += tl.sum(da * xhat, axis=0, keep_dims=True)"
LNB_SUM = "acc_lnb_rows += tl.sum(da, axis=0, keep_dims=True)"
C1 = "c1 = tl.sum(dxhat * xhat, axis=1) * inv_d"
C2 = "c2 = tl.sum(dxhat, axis=1) * inv_d"

EDITS = {
    "no_z": [(Z_DOT, "z = gy + bias[None, :]")],
    "no_dt": [(DT_DOT, "dt = t * tl.sum(dz, axis=1)[:, None]")],
    "no_dw": [(DW_DOT, "acc_w += tl.sum(dz, axis=0)[:, None] * w")],
    "no_colsum": [(LNW_SUM, "pass"), (LNB_SUM, "pass")],
    "no_rowsum": [(C1, "c1 = rstd * inv_d"), (C2, "c2 = rstd * inv_d")],
}
EDITS["no_dots"] = EDITS["no_z"] + EDITS["no_dt"] + EDITS["no_dw"]
EDITS["no_dots_sums"] = EDITS["no_dots"] + EDITS["no_colsum"] + EDITS["no_rowsum"]


def variant_module(name: str):
    src = SRC
    for old, new in EDITS.get(name, []):
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"kernels_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"kernels_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@triton.jit
def copy_like_bwd(GY, X, DX, B, D, H, rows_per_program, stride_x_f, stride_x_b, stride_gy_f, stride_gy_b,
                  stride_dx_f, stride_dx_b, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_p = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    hs = tl.arange(0, BLOCK_H)
    row_start = pid_p * rows_per_program
    for r0 in range(row_start, row_start + rows_per_program, BLOCK_B):
        rows = (r0 + tl.arange(0, BLOCK_B)).to(tl.int64)
        x = tl.load(X + f * stride_x_f + rows[:, None] * stride_x_b + cols[None, :]).to(tl.float32)
        gy = tl.load(GY + f * stride_gy_f + rows[:, None] * stride_gy_b + hs[None, :]).to(tl.float32)
        s = tl.sum(gy, axis=1)
        tl.store(DX + f * stride_dx_f + rows[:, None] * stride_dx_b + cols[None, :], (x + s[:, None]).to(DX.dtype.element_ty))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--points", default="bf16:256:16:per_feature,fp32:128:16:per_feature,bf16:64:4:none,bf16:256:64:per_feature")
    ap.add_argument("--variants", default="ship,base,no_z,no_dt,no_dw,no_dots,no_colsum,no_rowsum,no_dots_sums,copy")
    ap.add_argument("--mb", type=float, default=256.0)
    ap.add_argument("--waves", action="store_true", help="add whole-wave grids and --cfgs variants")
    ap.add_argument("--cfgs", default="", help="cfg=block_b:warps:programs_per_sm,...")
    ap.add_argument("--once", action="store_true", help="one call of each variant (for ncu), no timing")
    args = ap.parse_args()
    bench = _common.make_bench("cuda", rep_ms=100)
    copy = _common.copy_bandwidth(int(args.mb * 2 ** 20), "cuda", bench)
    out = dict(env=_common.environment("cuda"), copy=copy, rows=[])
    print(json.dumps(copy), flush=True)
    mods = {"base": variant_module("base")}
    for point in args.points.split(","):
        dt_name, D, H, aff = point.split(":")
        D, H = int(D), int(H)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt_name]
        F = 64
        B = int(args.mb * 2 ** 20) // (F * D * dtype.itemsize)
        inp = _common.op_inputs(F, B, D, H, dtype, "cuda", ln=aff)
        x, w, b, lw, lb, gy = inp.x, inp.weight, inp.bias, inp.ln_weight, inp.ln_bias, inp.grad_y
        plan = launch.backward_plan(gy, x, w, b, lw, lb, 1e-5, 1)
        floor = _common.floor_us(2 * x.numel() * x.element_size() + gy.numel() * gy.element_size(), copy["GBps"])
        dx = torch.empty_like(x)
        partial = torch.empty(plan.partial_shape, dtype=torch.float32, device="cuda")
        tensors = (gy, x, w, b if b is not None else w, lw if lw is not None else w, lb if lb is not None else w,
                   dx, partial, partial)
        cfg = plan.cfg
        variants = args.variants.split(",")
        if args.waves:
            # programs per feature that fill whole waves, from the base kernel's occupancy
            k = mods["base"].ln_tanh_linear_relu_bwd[plan.grid](*tensors, *plan.ints, **plan.meta,
                                                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            torch.cuda.synchronize()
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            per_sm = min(65536 // (max(k.n_regs, 1) * 32 * cfg.num_warps), (227 * 1024) // (k.metadata.shared + 1024),
                         64 // cfg.num_warps)
            slots = per_sm * sms
            print(f"{point}: {per_sm} CTAs/SM, {slots} slots, shipped grid {plan.grid}", flush=True)
            variants += [f"P={max(1, (n * slots) // F)}" for n in (1, 2, 4)]
            variants += args.cfgs.split(",") if args.cfgs else []
        for var in variants:
            row = dict(point=point, variant=var, F=F, B=B, floor_us=floor,
                       cfg=configs.config_to_entry(cfg), meta={k: str(v) for k, v in plan.meta.items()})
            if var == "ship":
                fn = lambda: plan(gy, x, w, b, lw, lb, None)  # noqa: E731
            elif var.startswith("P="):
                # the base kernel over another number of programs per feature (whole waves)
                P = int(var[2:])
                rpp = triton.cdiv(triton.cdiv(B, P), cfg.block_b) * cfg.block_b
                ints = plan.ints[:3] + (rpp,) + plan.ints[4:]
                meta = dict(plan.meta, EVEN_B=B % rpp == 0)
                part_p = torch.empty((F * triton.cdiv(B, rpp), plan.partial_shape[1]), dtype=torch.float32, device="cuda")
                tens_p = tensors[:7] + (part_p, part_p)
                kern = mods["base"].ln_tanh_linear_relu_bwd
                fn = lambda: kern[(triton.cdiv(B, rpp), F)](*tens_p, *ints, **meta,  # noqa: E731
                                                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            elif var.startswith("cfg="):
                bb, nw, pps = map(int, var[4:].split(":"))
                import dataclasses
                c2 = dataclasses.replace(cfg, block_b=bb, num_warps=nw, programs_per_sm=pps)
                with configs.override(backward=c2):
                    plan2 = launch.backward_plan(gy, x, w, b, lw, lb, 1e-5, 1)
                row["grid"] = plan2.grid
                fn = lambda: plan2(gy, x, w, b, lw, lb, None)  # noqa: E731
            elif var == "copy":
                sxb, sxf = x.stride(0), x.stride(1)
                fn = lambda: copy_like_bwd[plan.grid](  # noqa: E731
                    gy, x, dx, B, D, H, plan.ints[3], sxf, sxb, gy.stride(1), gy.stride(0), dx.stride(1), dx.stride(0),
                    BLOCK_B=cfg.block_b, BLOCK_D=cfg.block_d, BLOCK_H=triton.next_power_of_2(H),
                    num_warps=cfg.num_warps)
            else:
                if not plan.meta["USE_DOT"] and var != "base":
                    continue
                if var not in mods:
                    mods[var] = variant_module(var)
                mod = mods[var]
                kern = mod.ln_tanh_linear_relu_bwd
                fn = lambda: kern[plan.grid](*tensors, *plan.ints, **plan.meta,  # noqa: E731
                                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            try:
                res = fn()
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {err}"[:300]
                print(row["point"], row["variant"], row["error"][:200], flush=True)
                out["rows"].append(row)
                break
            if hasattr(res, "n_regs"):
                row.update(regs=res.n_regs, spills=res.n_spills, shared=res.metadata.shared)
            if not args.once:
                row["us"] = bench(fn)
                row["pct_floor"] = 100 * floor / row["us"]
            print(row["point"], row["variant"], row.get("grid"), "%.1f us" % row.get("us", 0), row.get("regs"), row.get("spills"), flush=True)
            out["rows"].append(row)
        Path(args.json).write_text(json.dumps(out, indent=1))
        del inp, x, w, b, lw, lb, gy, dx, partial, tensors
        torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps(out, indent=1))
    print("\n%-26s %-13s %9s %6s %5s %6s %7s" % ("point", "variant", "us", "%flr", "regs", "spill", "smem"))
    for r in out["rows"]:
        print("%-26s %-13s %9s %6s %5s %6s %7s" % (r["point"], r["variant"], "%.1f" % r["us"] if "us" in r else "-",
                                                   "%.0f" % r["pct_floor"] if "pct_floor" in r else "-",
                                                   r.get("regs", "-"), r.get("spills", "-"), r.get("shared", "-")))


if __name__ == "__main__":
    main()
