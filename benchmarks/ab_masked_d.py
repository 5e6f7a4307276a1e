"""A/B for a D that is not a power of two (48, 96, 160): whole-row tiles padded to BLOCK_D
against the K-chunked kernels walking D in whole chunks (no padded columns), in one process, on
the same inputs (BFD layout, per-feature LayerNorm affine, shared weight + bias, x ~256 MB).

Forward: the committed tuned entry or old heuristic (whole row, masked columns) against the new
default (`configs.forward_config`: chunked where D is a whole number of chunks). Backward: the
default (whole-row kernel) against `ln_tanh_linear_relu_bwd_chunked` with chunk_width(D, 64)
columns, 32 rows / 4 warps and 64 rows / 8 warps. Each timed with ``triton.testing.do_bench``
(median), as % of the floor at the bandwidth of a device copy timed in the same run; each
variant's output checked against the default's (max |diff| / max |ref|).

Usage (CUDA): python benchmarks/ab_masked_d.py --json $OUT/ab_masked_d_h100.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import _common  # noqa: E402
from recfuse.ops import configs, launch  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", default="48x4,48x16,48x64,96x16,96x64,160x16,160x64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--mb", type=float, default=256.0)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--dots", default="", help="fp32: also run each backward variant with these fp32_dots modes")
    ap.add_argument("--chunk-widths", default="", help="chunk widths of the chunked backward (default chunk_width(D, 64))")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bench = _common.make_bench(dev, rep_ms=60)
    table = configs.load_table(configs.device_slug(0))
    out = {"env": _common.environment(dev), "command": _common.command_line(argv), "rows": []}
    for dt_name in args.dtypes.split(","):
        dtype = getattr(torch, dt_name)
        for shape in args.shapes.split(","):
            D, H = map(int, shape.split("x"))
            if dtype != torch.float32 and H < configs.DOT_MIN_H:
                continue
            F = args.features
            B = max(64, int(args.mb * 2**20 / (F * D * dtype.itemsize)) // 64 * 64)
            inp = _common.op_inputs(F, B, D, H, dtype, dev, layout="BFD", ln="per_feature")
            x, w, b, lw, lb, gy = inp.x, inp.weight, inp.bias, inp.ln_weight, inp.ln_bias, inp.grad_y
            eps = 1e-5
            copy = _common.copy_bandwidth(x.numel() * x.element_size(), dev, bench)
            y_bytes = B * F * H * dtype.itemsize
            x_bytes = x.numel() * x.element_size()
            floor_f = _common.floor_us(x_bytes + y_bytes, copy["GBps"])
            floor_b = _common.floor_us(2 * x_bytes + y_bytes, copy["GBps"])
            row = {"D": D, "H": H, "dtype": dt_name, "F": F, "B": B, "copy_GBps": copy["GBps"], "fwd": {}, "bwd": {}}

            def fwd():
                return launch.forward(x, w, b, lw, lb, eps, 1)

            ref_y = fwd()
            variants = {"new_default": None}
            entry = table.get(("forward", D, H, dt_name, False))
            if entry is not None:
                variants["tuned_whole_row"] = configs.config_from_entry("forward", entry, D, H, dtype, False)
            variants["heuristic_whole_row"] = configs.heuristic_forward(D, H, dtype, False, block_k=0)
            for name, cfg in variants.items():
                try:
                    if cfg is None:
                        us = bench(fwd)
                        y = ref_y
                        meta = launch.forward_plan(x, w, b, lw, lb, eps, 1, False).meta
                    else:
                        with configs.override(forward=cfg):
                            y = fwd()
                            us = bench(fwd)
                            meta = launch.forward_plan(x, w, b, lw, lb, eps, 1, False).meta
                    err = ((y.float() - ref_y.float()).abs().max() / ref_y.float().abs().max().clamp_min(1e-12)).item()
                    row["fwd"][name] = {"us": us, "pct_floor": 100 * floor_f / us, "diff_vs_default": err,
                                        "BLOCK_K": meta["BLOCK_K"], "K_CHUNKS": meta["K_CHUNKS"],
                                        "config": dataclasses.asdict(cfg) if cfg is not None else None}
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    row["fwd"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}

            def bwd():
                return launch.backward(gy, x, w, b, lw, lb, eps, 1)

            ref = bwd()
            base = configs.backward_config(D, H, dtype, 0)
            widths = [int(k) for k in args.chunk_widths.split(",") if k] or [configs.chunk_width(D, 64)]
            bvariants = {"default": None}
            if base is not None and base.use_dot:
                if base.block_k:
                    bvariants["whole_row"] = configs.heuristic_backward(D, H, dtype, block_k=0, block_b=16, num_warps=8,
                                                                        programs_per_sm=4)
                for width in widths:
                    if not width or D % width:
                        continue
                    for bb, nw in ((32, 4), (64, 8)):
                        bvariants[f"chunked_k{width}_b{bb}_w{nw}"] = dataclasses.replace(
                            base, block_k=width, block_b=bb, num_warps=nw, programs_per_sm=max(1, 32 // nw))
            if dtype == torch.float32 and args.dots:
                for name, cfg in list(bvariants.items()):
                    for mode in args.dots.split(","):
                        c = cfg if cfg is not None else base
                        if c is not None and c.use_dot and mode != c.fp32_dots:
                            bvariants[f"{name}_{mode}"] = dataclasses.replace(c, fp32_dots=mode)
            for name, cfg in bvariants.items():
                try:
                    if cfg is None:
                        grads, us = ref, bench(bwd)
                    else:
                        with configs.override(backward=cfg):
                            grads = bwd()
                            us = bench(bwd)
                    errs = {n: ((g.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item()
                            for n, g, r in zip(("x", "w", "b", "lnw", "lnb"), grads, ref) if g is not None}
                    row["bwd"][name] = {"us": us, "pct_floor": 100 * floor_b / us, "diff_vs_default": errs,
                                        "config": dataclasses.asdict(cfg) if cfg is not None else None}
                except Exception as e:  # noqa: BLE001
                    row["bwd"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            out["rows"].append(row)
            f_s = "  ".join(f"{k} {v.get('us', float('nan')):.0f}us" for k, v in row["fwd"].items())
            b_s = "  ".join(f"{k} {v.get('us', float('nan')):.0f}us" for k, v in row["bwd"].items())
            print(f"{dt_name} D={D} H={H} B={B} | fwd {f_s} | bwd {b_s}", flush=True)
            Path(args.json).write_text(json.dumps(_common.json_safe(out), indent=1))


if __name__ == "__main__":
    main()
