"""Check the Triton kernels on CUDA at realistic sizes, then time them against `combined` and a copy.

Correctness: a matrix of op cases (layouts, per-feature or shared weight, bias and LayerNorm
affine, eps=0, odd sizes) plus realistic shapes, forward and backward, against the float64
per-slice reference (`recfuse.reference`) on the same dtype-rounded inputs; each case twice (the
first call of a signature goes through `JITFunction.run`, the second through the cached
compiled-kernel launch). Timing: `triton.testing.do_bench` medians of the fused op, the batched
torch composite (`combined`), torch.compile of it, and a device-to-device copy of x, whose
bandwidth sets the memory floor of the forward.

``--device cpu`` is a smoke run of the same code: the checks whose x has at most 2**20 values
(the op runs its CPU path, or the kernels under Triton's interpreter with TRITON_INTERPRET=1) and
one small timed shape (perf_counter medians).

Example:
    python benchmarks/gpu_kernels.py --json benchmarks/results/gpu_kernels_h100.json   # on a GPU
    python benchmarks/gpu_kernels.py --device cpu --checks-only                         # smoke run
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass

import torch

import recfuse
from _common import (TOLERANCE, Shape, copy_bandwidth, environment, extra_peak_bytes, floor_us, make_bench, op_inputs,
                     relative_error, wall_us)
from recfuse.reference import batched_ln_tanh_linear_relu

log = logging.getLogger("recfuse.bench")


@dataclass(frozen=True)
class Case(Shape):
    """One op configuration: the `op_inputs` options of its arguments, the op's eps and whether x
    is passed as the view of the [B, F*D] buffer; str() is the id recorded in the JSON."""

    layout: str = "FBD"           # "FBD" ([F, B, D], feature_dim=0) | "BFD" ([B, F*D] as [B, F, D], feature_dim=1)
    weight: str = "shared"        # "shared" | "per_feature"
    bias: str = "shared"          # "none" | "shared" | "per_feature"
    ln: str = "per_feature"       # "none" | "shared" | "per_feature" (affine weight and bias)
    eps: float = 1e-5
    x_is_view: bool = False       # "BFD": the op reads x as a view of the buffer (else a copy of x)

    @property
    def feature_dim(self) -> int:
        return 1 if self.layout == "BFD" else 0

    def inputs(self, dtype, device):
        """The op's arguments (`op_inputs`): a small positive bias keeps most relus open."""
        return op_inputs(self.F, self.B, self.D, self.H, dtype, device, layout=self.layout, weight=self.weight,
                         bias=self.bias, ln=self.ln, bias_mean=0.1, ln_scale=0.2)

    def __str__(self):
        # the ids of the recorded results: fd<feature_dim>, "-Wf" for a per-feature weight
        return (f"F{self.F}B{self.B}D{self.D}H{self.H}fd{self.feature_dim}"
                f"{'-Wf' if self.weight == 'per_feature' else ''}-b{self.bias}-ln{self.ln}-eps{self.eps}"
                f"{'-view' if self.x_is_view else ''}")


CHECK_CASES = [
    (Case(16, 1024, 256, 1, layout="BFD", x_is_view=True, ln="none", eps=0.0), torch.float32),
    (Case(128, 8192, 256, 1, layout="BFD", x_is_view=True, ln="none", eps=0.0), torch.float32),
    (Case(128, 8192, 256, 1, layout="BFD", x_is_view=True, ln="none", eps=0.0), torch.bfloat16),
    (Case(16, 1024, 100, 1, ln="per_feature"), torch.float32),
    (Case(16, 1024, 256, 16, layout="BFD", ln="per_feature"), torch.float32),
    (Case(16, 1024, 256, 16, layout="BFD", ln="per_feature"), torch.bfloat16),
    (Case(16, 1024, 256, 64, weight="per_feature", bias="per_feature"), torch.float32),
    (Case(8, 333, 4096, 1, ln="shared"), torch.float32),
    (Case(8, 333, 1000, 3, ln="shared", eps=0.0), torch.bfloat16),
    (Case(3, 5, 7, 3, layout="BFD", weight="per_feature", bias="per_feature"), torch.float16),
    (Case(1, 1, 1, 1, ln="shared"), torch.float32),
    # Persistent forward configs: D=512 (64-row 16-bit tiles), fp16, fp32 H < BLOCK_H.
    (Case(4, 512, 512, 32, layout="BFD", weight="per_feature"), torch.bfloat16),
    (Case(4, 256, 256, 64, ln="shared"), torch.float16),
    (Case(4, 96, 128, 40, bias="per_feature"), torch.float32),
    # H = 2-4 and narrow rows: the 16-wide tl.dot, its chunked forward, 64-128-row backward tiles,
    # and the broadcast sum with masked rows (bf16 D=32 H=2 B=1000 gave a wrong dx with 32-row tiles)
    (Case(3, 1000, 32, 2, layout="BFD", x_is_view=True), torch.bfloat16),
    (Case(3, 1000, 32, 2, layout="BFD", x_is_view=True), torch.float32),
    (Case(3, 4096, 32, 4, layout="BFD", x_is_view=True), torch.bfloat16),
    (Case(3, 1000, 160, 4, layout="BFD", x_is_view=True), torch.float32),
    (Case(3, 1000, 64, 3, ln="shared"), torch.bfloat16),
]

TIME_SHAPES = [(16, 1024, 256, 1), (128, 8192, 256, 1), (128, 8192, 256, 16), (128, 8192, 256, 64)]
CPU_TIME_SHAPES = [(4, 256, 64, 1)]
CPU_MAX_X = 2**20  # --device cpu checks only the cases with at most this many values of x
NAMES = ["y", "x.grad", "weight.grad", "bias.grad", "ln_weight.grad", "ln_bias.grad"]


def run_case(fn, case: Case, inp, dtype, negate: bool = False):
    """Forward and backward of `fn` on leaves cast to `dtype`: (y, [grads of x and present params])."""
    B, F, D = case.B, case.F, case.D
    if case.x_is_view:
        xleaf = inp.buf.detach().to(dtype).clone().requires_grad_(True)
        xin = xleaf.view(B, F, D)
    else:
        xleaf = xin = inp.x.detach().to(dtype).clone().requires_grad_(True)
    sign = -1.0 if negate else 1.0
    w, b, lw, lb = (None if t is None else (t.detach().to(dtype) * (sign if i < 2 else 1.0)).requires_grad_(True)
                    for i, t in enumerate((inp.weight, inp.bias, inp.ln_weight, inp.ln_bias)))
    y = fn(xin, w, b, ln_weight=lw, ln_bias=lb, eps=case.eps, feature_dim=case.feature_dim)
    y.backward(inp.grad_y.to(dtype))
    return y.detach(), [xleaf.grad.reshape(inp.x.shape)] + [p.grad for p in (w, b, lw, lb) if p is not None]


def check_case(case: Case, dtype, device) -> str:
    """'ok', or 'FAIL: ...' naming the first tensor whose error vs float64 is over TOLERANCE."""
    inp = case.inputs(dtype, device)
    negate = False
    y_ref, g_ref = run_case(recfuse.reference.ln_tanh_linear_relu, case, inp, torch.float64)
    if y_ref.abs().sum() == 0:  # every relu closed (tiny cases): negating the Linear opens them all
        negate = True
        y_ref, g_ref = run_case(recfuse.reference.ln_tanh_linear_relu, case, inp, torch.float64, negate)
    present = [True, True, True, inp.bias is not None, inp.ln_weight is not None, inp.ln_bias is not None]
    names = [n for n, p in zip(NAMES, present) if p]
    # Twice: the first call of a signature goes through JITFunction.run, the second through the
    # cached compiled-kernel launch, which must give the same answers.
    for _ in range(2):
        y, grads = run_case(recfuse.ln_tanh_linear_relu, case, inp, dtype, negate)
        if y.dtype != dtype or y.shape != y_ref.shape:
            return f"FAIL: {case} {dtype} y: {y.dtype} {tuple(y.shape)} vs {tuple(y_ref.shape)}"
        for name, out, ref in zip(names, [y] + grads, [y_ref] + g_ref):
            # The floor keeps gradients that are zero up to rounding (D=1 rows) from dividing by ~1e-15.
            err = relative_error(out, ref, floor=1e-6)
            if not err < TOLERANCE[dtype]:
                return f"FAIL: {case} {dtype} {name}: relative error {err:.2e} >= {TOLERANCE[dtype]:.0e}"
    return "ok"


def check_all(device):
    rows = []
    for case, dtype in CHECK_CASES:
        if device != "cuda" and case.numel_x() > CPU_MAX_X:
            continue
        try:
            status = check_case(case, dtype, device)
        except Exception as e:  # noqa: BLE001 - a case that raises is a failed case, not a crash
            status = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append({"case": str(case), "dtype": str(dtype), "status": status})
        print(f"check {case} {dtype}: {status}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def time_shape(F, B, D, H, dtype, dev="cuda"):
    inp = op_inputs(F, B, D, H, dtype, dev, layout="BFD", ln="none", seed=F + B + D + H)
    x, w, b = inp.x, inp.weight, inp.bias
    bench, bench_train = make_bench(dev, 25, 200), make_bench(dev, 25, 100)
    out = {"F": F, "B": B, "D": D, "H": H, "dtype": str(dtype)}
    copy = copy_bandwidth(x.numel() * x.element_size(), dev, bench)
    out["copy_us"] = copy["time_us"]
    out["copy_GBps"] = copy["GBps"]
    out["floor_fwd_us"] = floor_us(x.numel() * x.element_size() + B * F * H * x.element_size(), copy["GBps"])

    def fused():
        return recfuse.ln_tanh_linear_relu(x, w, b, eps=0.0, feature_dim=1)

    def combined():
        return batched_ln_tanh_linear_relu(x, w, b, None, None, 0.0, 1)

    compiled = torch.compile(combined)
    out["fused_fwd_us"] = bench(fused)
    out["combined_fwd_us"] = bench(combined)
    try:
        compiled()
        out["compiled_combined_fwd_us"] = bench(compiled)
    except Exception as e:  # noqa: BLE001 - a peer failing must not hide our numbers
        out["compiled_combined_fwd_us"] = f"failed: {type(e).__name__}"
    out["fused_fwd_pct_of_copy_bw"] = 100 * out["floor_fwd_us"] / out["fused_fwd_us"]

    xg = x.detach().clone().requires_grad_(True)
    wg = w.detach().clone().requires_grad_(True)
    bg = b.detach().clone().requires_grad_(True)
    gy = inp.grad_y

    def fused_train():
        y = recfuse.ln_tanh_linear_relu(xg, wg, bg, eps=0.0, feature_dim=1)
        torch.autograd.grad(y, (xg, wg, bg), gy)

    def combined_train():
        y = batched_ln_tanh_linear_relu(xg, wg, bg, None, None, 0.0, 1)
        torch.autograd.grad(y, (xg, wg, bg), gy)

    for name, fn in (("fused", fused_train), ("combined", combined_train)):
        peak = extra_peak_bytes(fn, dev)
        out[f"{name}_train_extra_peak_MB"] = None if peak is None else peak / 2**20
        out[f"{name}_train_us"] = bench_train(fn)
    # Small shape: also the wall time per call with host sync, which is launch-bound.
    out["fused_fwd_wall_us"] = wall_us(fused, dev, repeats=200 if dev == "cuda" else 10, warmup=20 if dev == "cuda" else 2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--checks-only", action="store_true", help="correctness checks, no timing")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: a smoke run (small checks, one small timed shape)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU (--device cpu is a smoke run)")
    env = environment(dev)
    meta = {"gpu": env["device_name"], "torch": env["torch"], "triton": env["triton"], "python": env["python"],
            "date": env["date"], "env": env}
    print({k: v for k, v in meta.items() if k != "env"}, flush=True)
    checks = [] if args.skip_check else check_all(dev)
    timings = []
    for F, B, D, H in [] if args.checks_only else (TIME_SHAPES if dev == "cuda" else CPU_TIME_SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            r = time_shape(F, B, D, H, dtype, dev)
            timings.append(r)
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            if dev == "cuda":
                torch.cuda.empty_cache()
    result = {"meta": meta, "checks": checks, "timings": timings}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    fails = [c for c in checks if c["status"] != "ok"]
    print(f"{len(checks) - len(fails)} passed, {len(fails)} failed")
    print(f"{'shape':>22} {'dtype':>15} {'fused':>9} {'combined':>9} {'compiled':>9} {'floor':>8} {'%bw':>5} {'train':>9} {'comb.train':>10} {'wall':>7}")
    for r in timings:
        c = r["compiled_combined_fwd_us"]
        print(f"{str((r['F'], r['B'], r['D'], r['H'])):>22} {r['dtype']:>15} {r['fused_fwd_us']:9.1f} {r['combined_fwd_us']:9.1f} "
              f"{c if isinstance(c, str) else f'{c:9.1f}':>9} {r['floor_fwd_us']:8.1f} {r['fused_fwd_pct_of_copy_bw']:5.0f} "
              f"{r['fused_train_us']:9.1f} {r['combined_train_us']:10.1f} {r['fused_fwd_wall_us']:7.1f}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
