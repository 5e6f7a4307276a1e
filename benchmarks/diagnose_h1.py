"""Two H100 questions about the large H=1 fp32 shape (F=128 B=8192 D=256), answered in one run.

1. gpu_kernels v11 failed its x.grad check there (1.8e-3) where v10 passed on the same code: are
   relu ties the cause? Runs the op and the float64 reference on the check's inputs three times
   and counts rows whose relu side differs, and rows within 1e-6 of zero.
2. The transform's training step runs the forward kernel at ~565 us where the op's takes ~377 us:
   times `launch.forward` on the same x for both y layouts (feature_dim=1 as the op row calls it,
   feature_dim=0 on a movedim view as the transformed graph does), with and without saved stats,
   and with the y-stride specialisation on and off (`launch.UNSPECIALIZE_Y_STRIDE_1`).

Usage (GPU): PYTHONPATH=.:tests python benchmarks/diagnose_h1.py
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

import recfuse
from op_cases import Case, make_inputs, rel_err, run_op
from recfuse.ops import launch


def ties():
    case = Case(128, 8192, 256, 1, feature_dim=1, strided_view=True, ln="none", eps=0.0)
    for attempt in range(3):
        tensors = tuple(None if t is None else t.float().double() for t in make_inputs(case, "cuda"))
        y_ref, g_ref = run_op(recfuse.reference.ln_tanh_linear_relu, tensors, torch.float64, case, keep_view=False)
        y, grads = run_op(recfuse.ln_tanh_linear_relu, tensors, torch.float32, case)
        side = ((y > 0) != (y_ref > 0)).sum().item()
        near = (y_ref.abs() < 1e-6).sum().item()
        print(f"ties attempt {attempt}: y err {rel_err(y, y_ref):.1e}, x.grad err {rel_err(grads[0], g_ref[0]):.1e}, "
              f"rows on the other relu side {side}, |z_ref| < 1e-6: {near}, x[0,0] {tensors[0].flatten()[0].item():.6f}",
              flush=True)


def forward_layouts():
    F, B, D, H = 128, 8192, 256, 1
    flat = torch.randn(B * F * D, device="cuda")
    w = torch.randn(H, D, device="cuda") / 16
    b = torch.randn(H, device="cuda") * 0.1
    x_bfd = flat.view(B, F, D)
    x_fbd = x_bfd.movedim(1, 0)
    for unspecialized in (False, True):
        launch.UNSPECIALIZE_Y_STRIDE_1 = unspecialized
        for name, x, fd in (("feature_dim=1 ([B,F,D])", x_bfd, 1), ("feature_dim=0 (movedim view)", x_fbd, 0)):
            for save in (False, True):
                fn = lambda: launch.forward(x, w, b, None, None, 0.0, fd, save_stats=save)  # noqa: E731
                us = triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median") * 1e3
                print(f"forward {name} save_stats={save} y stride 1 unspecialized={unspecialized}: "
                      f"{us:.1f} us", flush=True)
    launch.UNSPECIALIZE_Y_STRIDE_1 = True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-ties", action="store_true", help="only the forward timings (question 2)")
    args = ap.parse_args()
    forward_layouts()
    if not args.skip_ties:
        ties()


if __name__ == "__main__":
    main()
