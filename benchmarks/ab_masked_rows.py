"""A/B of the forward when B is not a multiple of the row tile (masked rows): the whole-row masked
config the heuristic gave before (full_tiles=False) against the K-chunked config it gives now, at
power-of-two D, in one process on the same inputs (BFD layout, per-feature affine, x ~256 MB,
B = a multiple of 64 minus 17). do_bench medians; outputs compared (max |diff| / max |y|).

Usage (CUDA): python benchmarks/ab_masked_rows.py --json $OUT/ab_masked_rows_h100.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402

import _common  # noqa: E402
from recfuse.ops import configs, launch  # noqa: E402


def old_masked(D, H, dtype):
    """`configs._heuristic_forward(D, H, dtype, full_tiles=False)` of commit 4f57fc9, tl.dot path."""
    block_d, block_h = triton.next_power_of_2(D), configs.dot_block_h(H)
    if dtype == torch.float32 and block_h == 32:
        return configs.ForwardConfig(16, block_d, block_h, True, 4)
    block_b = 32 if 32 * block_d <= configs.TILE_BUDGET else 16
    return configs.ForwardConfig(block_b, block_d, block_h, True, 4 if dtype == torch.float32 and block_h <= 16 else 8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", default="64x16,128x16,256x16,128x64,256x64,512x16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bench = _common.make_bench(dev, rep_ms=60)
    out = {"env": _common.environment(dev), "command": _common.command_line(argv), "rows": []}
    for dt_name in args.dtypes.split(","):
        dtype = getattr(torch, dt_name)
        for shape in args.shapes.split(","):
            D, H = map(int, shape.split("x"))
            F = 64
            B = max(64, int(256 * 2**20 / (F * D * dtype.itemsize)) // 64 * 64) - 17
            inp = _common.op_inputs(F, B, D, H, dtype, dev, layout="BFD", ln="per_feature")
            call = lambda: launch.forward(inp.x, inp.weight, inp.bias, inp.ln_weight, inp.ln_bias, 1e-5, 1)  # noqa: E731
            copy = _common.copy_bandwidth(inp.x.numel() * inp.x.element_size(), dev, bench)
            floor = _common.floor_us(inp.x.numel() * inp.x.element_size() + B * F * H * dtype.itemsize, copy["GBps"])
            row = {"D": D, "H": H, "dtype": dt_name, "B": B}
            y_new = call()
            row["new_us"] = bench(call)
            row["new_meta"] = {k: launch.forward_plan(inp.x, inp.weight, inp.bias, inp.ln_weight, inp.ln_bias, 1e-5, 1).meta[k]
                               for k in ("BLOCK_B", "BLOCK_K", "K_CHUNKS", "PERSISTENT", "EVEN_B")}
            with configs.override(forward=old_masked(D, H, dtype)):
                y_old = call()
                row["old_us"] = bench(call)
            row["pct_floor_new"], row["pct_floor_old"] = 100 * floor / row["new_us"], 100 * floor / row["old_us"]
            row["diff"] = ((y_new.float() - y_old.float()).abs().max() / y_old.float().abs().max()).item()
            out["rows"].append(row)
            print(f"{dt_name} D={D} H={H} B={B}: old {row['old_us']:.0f} us -> new {row['new_us']:.0f} us "
                  f"({row['pct_floor_old']:.0f} -> {row['pct_floor_new']:.0f}% floor) diff {row['diff']:.1e} {row['new_meta']}",
                  flush=True)
            Path(args.json).write_text(json.dumps(_common.json_safe(out), indent=1))


if __name__ == "__main__":
    main()
