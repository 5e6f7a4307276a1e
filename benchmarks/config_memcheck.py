"""Every shipped config a GPU looks up, run once on a small batch and checked against float64: the
run to put under compute-sanitizer after a table or a kernel changes.

A tuned entry is timed and checked at x ~256 MB with full row tiles; a fault that only some tiles
trigger (the twenty-first session's two-part tl.dot rows faulted at D=48 H=64 on 64-row tiles: an
out-of-bounds shared-memory read in what Triton 3.6 compiled, benchmarks/NOTES.md) shows up as an
illegal address in a large run or, under ``compute-sanitizer --tool memcheck``, as the bad access
itself. This tool runs, per (D, H, dtype) and batch, the op as a caller does (the table's config, no
forcing), on a batch that fills every tile (the full-tile configs) and one that does not (the
masked-tile configs, which the forward looks up apart): the forward recording autograd, then the backward of
sum(y^2), both layouts, per-feature LayerNorm affine; y and every gradient are compared with the
float64 composite (y: max |y - ref| / max |ref|; gradients: relative L2 norm). It exits 1 when any
error is over its bound (float32 1e-5 / 1e-4, bfloat16 1e-2 / 2e-2: the tests' and the tuner's), 0
otherwise. The configs each shape ran are in the JSON.

Examples:
    $ compute-sanitizer --tool memcheck python benchmarks/config_memcheck.py   # on a GPU: in-scope grid shapes
    $ python benchmarks/config_memcheck.py --shapes 48x16 160x64 --dtypes bf16 --json memcheck.json
    $ python benchmarks/config_memcheck.py --device cpu --shapes 48x16 --B 16 20  # the kernels under the interpreter
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="DxH ... (default: the grid's D x H, H=64 for 16-bit only, as the targets' scope)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--F", type=int, default=4, help="features")
    ap.add_argument("--B", type=int, nargs="+", default=[256, 300],
                    help="batches: a multiple of every tile (the full-tile configs) and one that is not (the "
                         "masked-tile configs, a masked last tile)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the Triton kernels under TRITON_INTERPRET=1 (set before Triton is imported)")
    ap.add_argument("--json", default=None, help="write the rows here")
    return ap.parse_args(argv)


ARGS = parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import _common as C  # noqa: E402
import recfuse  # noqa: E402
from recfuse.ops import configs, launch  # noqa: E402
from recfuse.reference import batched_ln_tanh_linear_relu  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (y, gradients) relative-error bounds against float64: the tests' forward bound and the tuner's.
BOUNDS = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 2e-2)}
GRADS = ("x", "weight", "bias", "ln_weight", "ln_bias")


def shapes_of(args) -> list[tuple[int, int, str]]:
    """(D, H, dtype name) to run: the named shapes for each dtype, or the grid's in-scope ones."""
    if args.shapes:
        pairs = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
        return [(D, H, dt) for (D, H), dt in itertools.product(pairs, args.dtypes)]
    return [(D, H, dt) for dt in args.dtypes for D in C.GRID_DIMS for H in C.GRID_HS if H <= 16 or dt != "fp32"]


def check_shape(D: int, H: int, B: int, dtype_name: str, args) -> dict:
    """One shape in both layouts: errors against float64 and the configs the lookup gave."""
    dtype = DTYPES[dtype_name]
    row = {"D": D, "H": H, "dtype": dtype_name, "F": args.F, "B": B, "errors": {}}
    dev = torch.device(args.device)
    bwd = configs.backward_config(D, H, dtype, (dev.index or 0) if dev.type == "cuda" else "cpu")
    row["backward_config"] = None if bwd is None else configs.config_to_entry(bwd)
    for layout in ("BFD", "FBD"):
        inp = C.op_inputs(args.F, B, D, H, dtype, args.device, layout=layout, ln="per_feature", seed=D + H)
        tensors = [t.detach().requires_grad_() for t in (inp.x, inp.weight, inp.bias, inp.ln_weight, inp.ln_bias)]
        x, w, b, lw, lb = tensors
        # the training forward's plan, which the call below takes (full- or masked-tile config)
        plan = launch.forward_plan(x, w, b, lw, lb, 1e-5, inp.feature_dim, save_stats=True)
        row.setdefault("forward_config", configs.config_to_entry(plan.cfg))
        y = recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=inp.feature_dim)
        y.float().square().sum().backward()
        ref_in = [t.detach().double().requires_grad_() for t in tensors]
        ref = batched_ln_tanh_linear_relu(*ref_in, 1e-5, inp.feature_dim)
        ref.square().sum().backward()
        scale = ref.abs().max().item() or 1.0
        row["errors"][f"{layout} y"] = (y.double() - ref).abs().max().item() / scale
        for name, t, r in zip(GRADS, tensors, ref_in):
            row["errors"][f"{layout} {name}.grad"] = C.relative_error(t.grad, r.grad)
    y_bound, grad_bound = BOUNDS[dtype]
    row["worst_y"] = max(v for k, v in row["errors"].items() if k.endswith(" y"))
    row["worst_grad"] = max(v for k, v in row["errors"].items() if k.endswith(".grad"))
    row["ok"] = row["worst_y"] <= y_bound and row["worst_grad"] <= grad_bound
    return row


def main(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; --device cpu runs the kernels under the interpreter", file=sys.stderr)
        return 2
    env = C.environment(args.device) | {"command": C.command_line()}
    print(json.dumps(env), flush=True)
    print(f"{'dtype':>5} {'D':>4} {'H':>3} {'B':>5} | {'worst y':>8} {'worst grad':>10} | ok", flush=True)
    rows = []
    for (D, H, dt), B in itertools.product(shapes_of(args), args.B):
        row = check_shape(D, H, B, dt, args)
        rows.append(row)
        print(f"{dt:>5} {D:>4} {H:>3} {B:>5} | {row['worst_y']:8.1e} {row['worst_grad']:10.1e} | "
              f"{'ok' if row['ok'] else 'OVER THE BOUND'}", flush=True)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} runs (shape x batch), {len(bad)} over the bound", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(C.json_safe({"env": env, "rows": rows}), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
