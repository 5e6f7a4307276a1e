"""A/B of the relu mask a training forward saves for the backward (`launch._relu_mask_words`)
against the backward recomputing z with a dot, in one process, on the same inputs and configs.

16-bit inputs also A/B the mask's lo part (`kernels._lo_part_product`, the forward's
``MASK_LO_PART``): the forward saving the mask of its 16-bit z alone, timed, and the gradient
errors against float64 with grad_y *not* zeroed at relu ties (what a user's step sees) of: the
backward reading either mask, the backward recomputing z, PyTorch's own autograd of the
per-slice chain run in that dtype ("torch", the 16-bit contract: no worse than it), and of the
batched composite ("composite": it computes in float32 and casts back, so it is not a 16-bit peer).

For every (D, H, dtype): the training forward (saved row stats) with and without the mask's bits,
and the backward (fused kernel(s) and the reduction: `launch.BackwardPlan`) reading the mask or
recomputing z, each timed with do_bench (median, GPU time of the kernels), with the training
step's share of the memory floor (3 x + 2 y at the copy bandwidth measured here) and every
gradient's error against float64 (grad_y zeroed where the float64 |z| < 1e-4, as the tuner does).
Configs are the shipped ones (`configs.forward_config` / `backward_config`).

Example:
    $ python benchmarks/ab_relu_mask.py --json benchmarks/results/checks/ab_relu_mask_h100.json
    $ python benchmarks/ab_relu_mask.py --device cpu --shapes 32x16 --x-mb 0.05  # interpreter smoke run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="32x16,64x16,128x16,160x16,256x16,512x16,64x64,128x64,256x64",
                    help="DxH,...")
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--x-mb", type=float, default=256.0)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import _common as C  # noqa: E402
from recfuse.chain import chain_of  # noqa: E402
from recfuse.ops import launch  # noqa: E402
from recfuse.ops.composite import composite_backward  # noqa: E402
from recfuse.reference import batched_feature_mlp, batched_ln_tanh_linear_relu, ln_tanh_linear_relu  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RELU_TIE = 1e-4


def measure(D, H, dtype, args, bench, copy_GBps) -> dict:
    F = args.features
    B = max(1, int(args.x_mb * 2 ** 20) // (F * D * torch.finfo(dtype).bits // 8))
    inp = C.op_inputs(F, B, D, H, dtype, args.device, ln="per_feature")
    params = (inp.weight, inp.bias, inp.ln_weight, inp.ln_bias)
    f64 = [t.double() for t in (inp.x,) + params]
    z = batched_feature_mlp(*f64, 1e-5, inp.feature_dim, chain_of("layer_norm", "tanh", None))
    gy = inp.grad_y.masked_fill(z.abs() < RELU_TIE, 0)
    del z
    ref = composite_backward(gy.double(), *f64, 1e-5, inp.feature_dim)
    del f64
    fplan = launch.forward_plan(inp.x, *params, 1e-5, inp.feature_dim, save_stats=True)
    words = fplan.stats_shape[0] - 2
    row = dict(D=D, H=H, dtype=str(dtype).split(".")[-1], F=F, B=B, mask_words=words,
               floor_train_us=C.floor_us(C.training_bytes(inp.x, inp.grad_y), copy_GBps))
    if not words:
        row["note"] = "no mask saved for this shape (16-bit, or a backward off the tl.dot path)"
        return row
    F_, B_ = fplan.stats_shape[1:]
    plain_meta = {k: v for k, v in fplan.meta.items() if k != "SAVE_MASK"}
    fplan_plain = dataclasses.replace(fplan, meta=plain_meta, stats_shape=(2, F_, B_), bound=None)
    y, stats = fplan(inp.x, *params)
    row["fwd_mask_us"] = bench(lambda: fplan(inp.x, *params))
    row["fwd_plain_us"] = bench(lambda: fplan_plain(inp.x, *params))
    stats2 = stats[:2].contiguous()
    for name, s in (("mask", stats), ("z", stats2)):
        bplan = launch.backward_plan(gy, inp.x, *params, 1e-5, inp.feature_dim, s)
        arg = s if bplan.reads_stats else None
        call = lambda: bplan(gy, inp.x, *params, arg)  # noqa: E731
        grads = call()
        row[f"bwd_{name}_us"] = bench(call)
        row[f"bwd_{name}_err"] = max(C.relative_error(g, r) for g, r in zip(grads, ref) if r is not None)
        row[f"bwd_{name}_load_mask"] = bool(bplan.meta.get("LOAD_MASK"))
    for name in ("mask", "z"):
        fwd = row["fwd_mask_us"] if name == "mask" else row["fwd_plain_us"]
        row[f"train_{name}_pct"] = 100 * row["floor_train_us"] / (fwd + row[f"bwd_{name}_us"])
    if dtype != torch.float32:
        row.update(lo_part_ab(inp, params, fplan, stats, stats2, bench))
        row["train_mask_hi_pct"] = 100 * row["floor_train_us"] / (row["fwd_mask_hi_us"] + row["bwd_mask_us"])
    return row


def lo_part_ab(inp, params, fplan, stats, stats2, bench) -> dict:
    """The 16-bit forward's mask without its lo part: forward time, and every path's gradient
    error against float64 with the caller's grad_y as drawn (relu ties not zeroed)."""
    fplan_hi = dataclasses.replace(fplan, meta=dict(fplan.meta, MASK_LO_PART=False), bound=None)
    out = {"fwd_mask_hi_us": bench(lambda: fplan_hi(inp.x, *params))}
    _, stats_hi = fplan_hi(inp.x, *params)
    out["mask_hi_flipped"] = float((stats_hi[2:] != stats[2:]).float().mean())  # of the mask words
    gy = inp.grad_y
    f64 = [t.double() for t in (inp.x,) + params]
    ref = composite_backward(gy.double(), *f64, 1e-5, inp.feature_dim)
    del f64
    for name, s in (("mask", stats), ("mask_hi", stats_hi), ("z", stats2)):
        bplan = launch.backward_plan(gy, inp.x, *params, 1e-5, inp.feature_dim, s)
        grads = bplan(gy, inp.x, *params, s if bplan.reads_stats else None)
        out[f"untied_{name}_errs"] = [C.relative_error(g, r) for g, r in zip(grads, ref) if r is not None]
    for name, fn in (("torch", ln_tanh_linear_relu), ("composite", batched_ln_tanh_linear_relu)):
        leaves = [t.detach().requires_grad_() for t in (inp.x,) + params]
        w, b, lw, lb = leaves[1:]
        y = fn(leaves[0], w, b, ln_weight=lw, ln_bias=lb, eps=1e-5, feature_dim=inp.feature_dim)
        torch.autograd.backward(y, gy)
        out[f"untied_{name}_errs"] = [C.relative_error(t.grad, r) for t, r in zip(leaves, ref) if r is not None]
    return out


def main(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; --device cpu runs the interpreter smoke run", file=sys.stderr)
        return 2
    bench = C.make_bench(args.device)
    copy = C.copy_bandwidth(int(args.x_mb * 2 ** 20), args.device, bench)
    env = C.environment(args.device) | {"copy_GBps": copy["GBps"], "command": C.command_line()}
    print(json.dumps(env), flush=True)
    rows = []
    header = f"{'dtype':>8} {'D':>4} {'H':>3} | {'fwd mask':>9} {'fwd':>9} | {'bwd mask':>9} {'bwd z':>9} {'x':>5} | " \
             f"{'trn% mask':>9} {'trn% z':>7} | {'err mask':>8} {'err z':>8}"
    print(header, flush=True)
    for dt in args.dtypes:
        for shape in args.shapes.split(","):
            D, H = map(int, shape.split("x"))
            row = measure(D, H, DTYPES[dt], args, bench, copy["GBps"])
            rows.append(row)
            if "note" in row:
                print(f"{row['dtype']:>8} {D:>4} {H:>3} | {row['note']}", flush=True)
                continue
            print(f"{row['dtype']:>8} {D:>4} {H:>3} | {row['fwd_mask_us']:9.1f} {row['fwd_plain_us']:9.1f} | "
                  f"{row['bwd_mask_us']:9.1f} {row['bwd_z_us']:9.1f} {row['bwd_z_us'] / row['bwd_mask_us']:5.2f} | "
                  f"{row['train_mask_pct']:9.0f} {row['train_z_pct']:7.0f} | "
                  f"{row['bwd_mask_err']:8.1e} {row['bwd_z_err']:8.1e}", flush=True)
            if "fwd_mask_hi_us" in row:
                errs = " ".join(f"{n} {max(row[f'untied_{n}_errs']):.1e}" for n in ("mask", "mask_hi", "z", "torch", "composite"))
                print(f"{'':>8} {'':>4} {'':>3} | fwd mask without lo part {row['fwd_mask_hi_us']:.1f} us "
                      f"(trn% {row['train_mask_hi_pct']:.0f}, {100 * row['mask_hi_flipped']:.2f}% of mask words "
                      f"differ) | untied grad errors, worst of x/w/b/lnw/lnb: {errs}", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(C.json_safe({"env": env, "rows": rows}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
