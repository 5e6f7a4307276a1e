"""A/B of the GEMM backward (`BackwardConfig.gemm`, `recfuse.ops.gemm_backward`) against the fused
backward kernels' heuristic config, in one process, on the same inputs.

For every point (dtype, layout, D, H, LayerNorm affine, x size): the op's training step (forward with the
saved stats and relu mask, then backward, parameter grads None before it) with each backward
forced (`configs.override`), as GPU time (the sum of kernel durations, `device_activity`), its
share of the memory floor (3 x + 2 y at the copy bandwidth measured here), kernels per step,
extra peak memory, and every gradient's max |g - g64| / max |g64| against the float64 composite
with grad_y zeroed where the float64 |z| < 1e-4 (relu ties flip with rounding, as the tuner does).
The forced configs also reach the forward (which saves the relu mask for either backward).
``--gemm-knobs`` adds GEMM-backward variants (its row kernel's and GEMMs' knobs), ``--kernel-times``
each variant's GPU time by kernel (where the step's time goes).

Example:
    $ python benchmarks/ab_gemm_bwd.py --json benchmarks/results/checks/ab_gemm_bwd_h200.json
    $ python benchmarks/ab_gemm_bwd.py --dtypes bf16 --dims 512 --hs 64 --kernel-times --gemm-knobs '{"programs_per_sm": 16}'
    $ python benchmarks/ab_gemm_bwd.py --device cpu --dims 48 --hs 33 --x-mb 0.05  # interpreter smoke run
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RELU_TIE = 1e-4


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", nargs="+", type=int, default=[96, 128, 160, 256, 512])
    ap.add_argument("--hs", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--layouts", nargs="+", default=["BFD"], choices=["BFD", "FBD"])
    ap.add_argument("--affine", nargs="+", default=["per_feature"], choices=["per_feature", "none"])
    ap.add_argument("--x-mb", nargs="+", type=float, default=[256.0])
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--gemm-knobs", nargs="*", default=[], metavar="JSON",
                    help='more GEMM-backward variants, each a JSON object of knobs (e.g. \'{"block_b": 8}\')')
    ap.add_argument("--kernel-times", action="store_true",
                    help="also record each variant's GPU time per kernel (printed under its point)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import recfuse  # noqa: E402
from recfuse.ops import configs  # noqa: E402
from recfuse.reference import batched_feature_mlp  # noqa: E402

from _common import (command_line, copy_bandwidth, device_activity, environment, extra_peak_bytes, floor_us,  # noqa: E402
                     json_safe, kernel_times, op_inputs, training_bytes)

VARIANTS = {
    "fused": configs.fused_backward_config,
    "gemm": lambda D, H, dt: configs.heuristic_backward(D, H, dt, gemm=1),
}


def reference_grads(inp, gy):
    """float64 gradients of every leaf and grad_y with relu ties (float64 |z| < RELU_TIE) zeroed."""
    leaves = [inp.buf] + [p for p in (inp.weight, inp.bias, inp.ln_weight, inp.ln_bias) if p is not None]
    d = [t.detach().double().requires_grad_(True) for t in leaves]
    it = iter(d[1:])
    w, b = next(it), next(it)
    lw = next(it) if inp.ln_weight is not None else None
    lb = next(it) if inp.ln_bias is not None else None
    x = d[0].view(inp.x.shape) if inp.feature_dim == 1 else d[0]
    chain_z = recfuse.chain.Chain("layer_norm", "tanh", None)
    with torch.no_grad():
        z = batched_feature_mlp(x, w, b, lw, lb, 1e-5, inp.feature_dim, chain_z)
    gy = torch.where(z.abs() < RELU_TIE, torch.zeros_like(gy), gy)
    del z
    y = batched_feature_mlp(x, w, b, lw, lb, 1e-5, inp.feature_dim)
    return gy, torch.autograd.grad(y, d, gy.double())


def measure(p: dict, args, copy_GBps: float) -> None:
    dev, dtype = args.device, {"fp32": torch.float32, "bf16": torch.bfloat16}[p["dtype"]]
    B = max(1, int(p["x_MB"] * 2**20 / (dtype.itemsize * args.features * p["D"])))
    inp = op_inputs(args.features, B, p["D"], p["H"], dtype, dev, layout=p["layout"],
                    ln="per_feature" if p["affine"] == "per_feature" else "none", seed=11)
    p.update(F=args.features, B=B)
    gy, ref = reference_grads(inp, inp.grad_y)
    p["floor_train_us"] = floor_us(training_bytes(inp.x, gy), copy_GBps)
    params = [t for t in (inp.weight, inp.bias, inp.ln_weight, inp.ln_bias) if t is not None]
    xg = inp.buf.detach().clone().requires_grad_(True)
    leaves = [xg] + [t.requires_grad_(True) for t in params]

    def step():
        for t in leaves:
            t.grad = None
        x = xg.view(inp.x.shape) if inp.feature_dim == 1 else xg
        recfuse.ln_tanh_linear_relu(x, inp.weight, inp.bias, ln_weight=inp.ln_weight, ln_bias=inp.ln_bias,
                                    feature_dim=inp.feature_dim).backward(gy)

    variants = dict(VARIANTS)
    for text in args.gemm_knobs:
        knobs = json.loads(text)
        # a knob's own "gemm" (the feature chunks) replaces the default 1
        variants["gemm " + text] = (
            lambda k: lambda D, H, dt: configs.heuristic_backward(D, H, dt, **dict({"gemm": 1}, **k)))(knobs)
    for name, source in variants.items():
        r = p.setdefault(name, {})
        try:
            with configs.override(backward=source):
                step()
                r["err"] = [((t.grad.double() - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                            for t, g in zip(leaves, ref)]
                peak = extra_peak_bytes(step, dev)
                r["extra_peak_MB"] = None if peak is None else peak / 2**20
                r["kernels"], r["train_us"] = device_activity(step, dev, calls=5)
                if args.kernel_times:
                    r["kernel_us"] = kernel_times(step, dev, calls=3)
            if r["train_us"]:
                r["pct_floor"] = 100 * p["floor_train_us"] / r["train_us"]
        except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
            r["error"] = f"{type(e).__name__}: {e}"[:400]
    if p["fused"].get("train_us") and p["gemm"].get("train_us"):
        p["speedup"] = p["fused"]["train_us"] / p["gemm"]["train_us"]


def table(points) -> str:
    head = (f"{'dtype':5} {'layout':6} {'affine':11} {'D':>4} {'H':>3} {'x MB':>6} | {'fused us':>9} {'%fl':>5} "
            f"{'gemm us':>9} {'%fl':>5} {'x':>5} | {'k f/g':>6} {'peak MB f/g':>12} | max err fused / gemm")
    rows = [head, "-" * len(head)]
    for p in points:
        f, g = p.get("fused", {}), p.get("gemm", {})

        def num(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        rows.append(
            f"{p['dtype']:5} {p['layout']:6} {p['affine']:11} {p['D']:>4} {p['H']:>3} {p['x_MB']:>6.0f} | "
            f"{num(f.get('train_us'), '9.0f')} {num(f.get('pct_floor'), '5.1f')} "
            f"{num(g.get('train_us'), '9.0f')} {num(g.get('pct_floor'), '5.1f')} {num(p.get('speedup'), '5.2f')} | "
            f"{num(f.get('kernels'), '>2')}/{num(g.get('kernels'), '<3')} "
            f"{num(f.get('extra_peak_MB'), '5.0f')}/{num(g.get('extra_peak_MB'), '<6.0f')} | "
            f"{num(max(f.get('err', [0])), '.1e')} / {num(max(g.get('err', [0])), '.1e')}"
            + (f"  ({f.get('error') or g.get('error')})" if f.get("error") or g.get("error") else ""))
        for name, r in p.items():
            if name.startswith("gemm ") and isinstance(r, dict):
                rows.append(f"{'':12} {name:40} | {num(r.get('train_us'), '9.0f')} {num(r.get('pct_floor'), '5.1f')}"
                            f" {r.get('error', '')}")
        for name, r in p.items():
            if isinstance(r, dict) and r.get("kernel_us"):
                rows.append(f"{'':12} {name} kernels: " + ", ".join(
                    f"{k[:36]} {v:.0f}" for k, v in r["kernel_us"].items()))
    return "\n".join(rows)


def main(args) -> int:
    env = environment(args.device)
    env["command"] = command_line()
    copy = copy_bandwidth(256 << 20 if args.device == "cuda" else 1 << 16, args.device)
    env["copy_GBps"] = copy["GBps"]
    points = [dict(dtype=dt, layout=lay, affine=aff, D=D, H=H, x_MB=mb)
              for dt, mb, lay, aff, H, D in itertools.product(args.dtypes, args.x_mb, args.layouts, args.affine,
                                                              args.hs, args.dims)]
    for p in tqdm(points, desc="ab_gemm_bwd", disable=None):
        measure(p, args, copy["GBps"])
        tqdm.write("\n".join(table([p]).splitlines()[2:]))  # a run cut short keeps its finished points
        if args.device == "cuda":
            torch.cuda.empty_cache()
    text = table(points)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(json_safe({"env": env, "points": points}), fh, indent=1)
        with open(os.path.splitext(args.json)[0] + ".txt", "w") as fh:
            fh.write(f"{env}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
