"""Check the Triton kernels on CUDA at realistic sizes, then time them against `combined` and a copy.

Correctness: every case of the op test matrix plus realistic shapes, forward and backward, against
the float64 per-slice reference on the same (dtype-rounded) inputs. Timing: `triton.testing.do_bench`
medians of the fused op, the batched torch composite (`combined`), torch.compile of it, and a
device-to-device copy of x, whose bandwidth sets the memory floor of the forward.

Usage (on a GPU machine):
    python benchmarks/gpu_kernels.py --json benchmarks/results/gpu_kernels.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import recfuse  # noqa: E402
from op_cases import Case, check_against_float64  # noqa: E402
from _timing import wall_us_with_sync  # noqa: E402
from recfuse.reference import batched_ln_tanh_linear_relu  # noqa: E402

log = logging.getLogger("recfuse.bench")

CHECK_CASES = [
    (Case(16, 1024, 256, 1, feature_dim=1, strided_view=True, ln="none", eps=0.0), torch.float32),
    (Case(128, 8192, 256, 1, feature_dim=1, strided_view=True, ln="none", eps=0.0), torch.float32),
    (Case(128, 8192, 256, 1, feature_dim=1, strided_view=True, ln="none", eps=0.0), torch.bfloat16),
    (Case(16, 1024, 100, 1, ln="per_feature"), torch.float32),
    (Case(16, 1024, 256, 16, feature_dim=1, ln="per_feature"), torch.float32),
    (Case(16, 1024, 256, 16, feature_dim=1, ln="per_feature"), torch.bfloat16),
    (Case(16, 1024, 256, 64, per_feature_weight=True, bias="per_feature"), torch.float32),
    (Case(8, 333, 4096, 1, ln="shared"), torch.float32),
    (Case(8, 333, 1000, 3, ln="shared", eps=0.0), torch.bfloat16),
    (Case(3, 5, 7, 3, feature_dim=1, per_feature_weight=True, bias="per_feature"), torch.float16),
    (Case(1, 1, 1, 1, ln="shared"), torch.float32),
    # Persistent forward configs: D=512 (64-row 16-bit tiles), fp16, fp32 H < BLOCK_H.
    (Case(4, 512, 512, 32, feature_dim=1, per_feature_weight=True), torch.bfloat16),
    (Case(4, 256, 256, 64, ln="shared"), torch.float16),
    (Case(4, 96, 128, 40, bias="per_feature"), torch.float32),
]

TIME_SHAPES = [(16, 1024, 256, 1), (128, 8192, 256, 1), (128, 8192, 256, 16), (128, 8192, 256, 64)]


def check_all():
    rows = []
    for case, dtype in CHECK_CASES:
        try:
            # Twice: the first call of a signature goes through JITFunction.run, the second
            # through the cached compiled-kernel launch, which must give the same answers.
            check_against_float64(case, dtype, device="cuda")
            check_against_float64(case, dtype, device="cuda")
            status = "ok"
        except AssertionError as e:
            status = f"FAIL: {e}"
        rows.append({"case": str(case), "dtype": str(dtype), "status": status})
        print(f"check {case} {dtype}: {status}", flush=True)
        torch.cuda.empty_cache()
    return rows


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3  # us


def time_shape(F, B, D, H, dtype):
    dev = "cuda"
    x = torch.randn(B, F * D, device=dev, dtype=dtype).view(B, F, D)
    w = (torch.randn(H, D, device=dev, dtype=dtype) / D ** 0.5)
    b = torch.randn(H, device=dev, dtype=dtype) * 0.1
    out = {"F": F, "B": B, "D": D, "H": H, "dtype": str(dtype)}
    bytes_io = x.numel() * x.element_size() + B * F * H * x.element_size()
    copy_src = torch.randn(x.numel(), device=dev, dtype=dtype)
    copy_dst = torch.empty_like(copy_src)
    t_copy = bench(lambda: copy_dst.copy_(copy_src))
    copy_bw = 2 * copy_src.numel() * copy_src.element_size() / (t_copy * 1e-6)
    out["copy_us"] = t_copy
    out["copy_GBps"] = copy_bw / 1e9
    out["floor_fwd_us"] = bytes_io / copy_bw * 1e6

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
    gy = torch.randn(B, F, H, device=dev, dtype=dtype)

    def fused_train():
        y = recfuse.ln_tanh_linear_relu(xg, wg, bg, eps=0.0, feature_dim=1)
        torch.autograd.grad(y, (xg, wg, bg), gy)

    def combined_train():
        y = batched_ln_tanh_linear_relu(xg, wg, bg, None, None, 0.0, 1)
        torch.autograd.grad(y, (xg, wg, bg), gy)

    for name, fn in (("fused", fused_train), ("combined", combined_train)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        out[f"{name}_train_extra_peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        out[f"{name}_train_us"] = bench(fn, rep=100)
    # Small shape: also the wall time per call with host sync, which is launch-bound.
    out["fused_fwd_wall_us"] = wall_us_with_sync(fused)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--checks-only", action="store_true", help="correctness checks, no timing")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    print(meta, flush=True)
    checks = [] if args.skip_check else check_all()
    timings = []
    for F, B, D, H in [] if args.checks_only else TIME_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            r = time_shape(F, B, D, H, dtype)
            timings.append(r)
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
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
