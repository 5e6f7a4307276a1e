#!/usr/bin/env python
"""Why gradients of every fp32 implementation disagree with float64 by ~5e-4 at F=128 B=8192 H=16.

Compares the backward kernel (several tile configs and dot precisions) and the torch composite,
in fp32, with a float64 run of the same composite. Measured on the H100 (2026-11-22): at
F=16 B=1024 everything is within 3e-7; at F=128 B=8192 with eps=0 the fp32 *torch* composite is
5.9e-4 off as well. The cause is relu ties: with 16M pre-relu values, one or two lie within an
fp32 rounding of 0, fp32 and float64 put them on different sides, and each flip moves bias.grad
by |grad_y|. The benchmark therefore zeroes grad_y on ties (split_stack_vs_combined._relu_ties).
It also showed the fp32 H=16 backward tile choice: 16-row tiles over two waves ran 4.1 ms,
32-row tiles 11.9 ms.

Usage (GPU): PYTHONPATH=. python benchmarks/relu_ties_h16.py
"""
import os, sys, dataclasses, torch
import recfuse
from recfuse.ops import launch
from recfuse.ops.ln_tanh_linear_relu import _composite_backward
print("tf32 matmul", torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
      "NVIDIA_TF32_OVERRIDE", os.environ.get("NVIDIA_TF32_OVERRIDE"))
def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
for (F, B, eps) in ((128, 8192, 0.0), (16, 1024, 0.0), (128, 8192, 1e-5)):
    D, H = 256, 16
    torch.manual_seed(0)
    x = torch.randn(B, F * D, device="cuda").view(B, F, D)
    w = torch.randn(H, D, device="cuda") / 16
    b = torch.randn(H, device="cuda") * 0.1
    gy = torch.randn(B, F, H, device="cuda")
    ref = _composite_backward(gy.double(), x.double(), w.double(), b.double(), None, None, eps, 1)
    torch.backends.cuda.matmul.allow_tf32 = False
    comp32 = _composite_backward(gy, x, w, b, None, None, eps, 1)
    print(F, B, eps, "composite fp32:", ["%.1e" % rel(o, r) for o, r in zip(comp32[:3], ref[:3])])
    orig = launch.backward_config
    for bb, nw, waves, prec in ((32, 8, 1, "tf32x3"), (16, 8, 2, "tf32x3"), (16, 8, 2, "ieee"), (16, 8, 2, "tf32")):
        cfg = dataclasses.replace(orig(D, H, torch.float32, False), block_b=bb, num_warps=nw, waves=waves)
        launch.backward_config = lambda *a, _c=cfg: _c
        launch._BWD_PRECISION[(D, H, torch.float32, 2, "cuda")] = prec
        try:
            out = launch.backward(gy, x, w, b, None, None, eps, 1)
            import triton.testing
            t = triton.testing.do_bench(lambda: launch.backward(gy, x, w, b, None, None, eps, 1), rep=50)
            print("  ", bb, nw, waves, prec, ["%.1e" % rel(o, r) for o, r in zip(out[:3], ref[:3])], "%.0f us" % (t * 1e3))
        except Exception as e:
            print("  ", bb, nw, waves, prec, "failed", type(e).__name__, str(e)[:100])
        finally:
            launch.backward_config = orig
            launch._BWD_PRECISION.clear()
