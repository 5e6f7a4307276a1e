"""Red-team round 25: the Triton kernels (interpreter) with numeric extremes and degenerate inputs,
forward and backward (autograd through the public op: the fused backward kernel and the
reduction), against the float64 per-slice reference (`recfuse.reference`); where the float64
answer is NaN / inf, torch's own fp32 per-slice chain decides whether a non-finite value is due.
Tolerances: fp32 y 1e-5, gradients 1e-4, relative to the reference's largest finite magnitude,
over the entries finite in both; NaN exactly where the reference's NaN is (NaN for the reference's
+-inf counts as loud, not as a silent wrong answer).

Found wrong (each a test below that fails before its fix):

1. relu's backward at a NaN pre-activation z. torch's relu backward keeps grad_y unless
   relu(z) <= 0 (``threshold_backward`` on the result), so a NaN z passes its grad_y into the weight
   and bias gradients; every backward kernel, the saved relu mask and the composite backward took
   ``z > 0`` and dropped it. A NaN in one element or row of x (F=2 B=3 D=17 H=17, per-feature
   bias) left that feature's bias.grad 0.47 (relative to its max) off float64 with both finite,
   on the row, tl.dot and default paths; a NaN weight / bias / LayerNorm weight or bias element
   left weight.grad 0.78-0.95, bias.grad 0.64, ln_weight.grad 0.62-0.94, ln_bias.grad 0.57-1.0
   off in their finite entries, silently (x.grad of that row is NaN, but a model whose x needs no
   gradient sees none). A constant row with eps = 0 (NaN, as torch's) did the same: bias.grad
   0.95 off float64 in the other, finite rows' feature. Now ``z <= 0`` selects 0 (the same one select; NaN keeps grad_y) in
   kernels.py (`_activate_grad`, `_store_relu_mask`, the per-column, whole-row, two-part and
   chunked backwards), composite.py, chain.activation_grad and _cpu_compiled's saved mask.
2. An infinite weight on the fp32 tl.dot backward: `_split16` split w into bf16 parts, the
   remainder inf - inf = NaN, so the recomputed z was NaN where it is +-inf, the relu mask closed
   and that feature's weight / bias / ln_weight / ln_bias gradients came out exactly 0 where
   float64 has finite values (F=2 B=3 D=17 H=1, w[1, 0, 2] = +-inf: all four 1.0 off; H=17:
   0.30-0.49 off). Now the weight's split zeroes a NaN remainder (``INF_SAFE``; the weight is split
   once a program, or once a chunk in the K-chunked backward, not per row element).

Probed and found right, or left as documented (probe scripts; the cheap ones pinned below), F=2,
B=3-5, fp32, forced row / tl.dot / K-chunked / split weight gradient / two-pass / persistent /
per-column / two-part paths, both layouts:
* NaN and +-inf in one element and a whole row of x, in weight, bias, ln_weight, ln_bias and
  grad_y at D in {5, 17, 48}, H in {1, 3, 17}: after the fixes NaN exactly where the reference's
  is; NaN where the reference has +-inf in x.grad (a closed relu's 0 times the inf weight: torch
  gives 0 * inf = NaN in some entries, +-inf in others) and in the weight gradients of an
  infinite grad_y on the tl.dot backward (the split of dz, per element: left, loud); an inf
  x.grad where the reference has NaN at H=1 on the row path (loud).
* NaN in one feature's slice: the other feature's per-feature gradients equal float64's.
* NaN in grad_y entries that a strided grad_y view skips: nothing leaks.
* x scaled by 1e-20 (eps 1e-5 and 0): within tolerance. 1e-38 with eps = 0 (variance underflows):
  finite rows 0.5-0.7 off float64, as torch's fp32 LayerNorm (round 23's open item, the same in
  the kernels). 1e15: within tolerance. 1e19 (variance overflows fp32): NaN rows, as documented
  in `chain.normalized_rows` (torch's fp32 gives a finite row far from float64).
* constant rows (3.7, -1234.5678) with eps = 0 (NaN, as the reference; after finding 1), 1e-5, 1e30 and inf
  (y = relu(bias): rstd 0): within tolerance, NaN exactly where the reference's.
* RMSNorm with an inf element: NaN rows (the mean square overflowed: documented), torch's fp32
  rms_norm NaN only in that element. Not probed this round (time): 16-bit inputs near their max,
  every chain at every path, B = 129; a probe of chains x paths was cut short.

File: 22 tests, ~22 s under the interpreter (the relu-mask test ~3.6 s, the rest < 2 s).
"""
from __future__ import annotations

import functools

import pytest
import torch

import recfuse
from recfuse.ops import configs, launch

pytestmark = pytest.mark.interpret

INF, NAN = float("inf"), float("nan")


def _fwd(**knobs):
    return lambda D, H, dt, full=True: configs.heuristic_forward(D, H, dt, full, **knobs)


def _bwd(**knobs):
    return lambda D, H, dt: configs.heuristic_backward(D, H, dt, **knobs)


PATHS = {
    "row": (_fwd(use_dot=False, block_k=0, unroll_h=0), _bwd(use_dot=False, unroll_h=0, block_b=4)),
    "dot": (_fwd(use_dot=True, block_k=0, block_b=16),
            _bwd(use_dot=True, block_k=0, block_b=16, prefetch=0, split_dw=0, two_pass=0, row_parts=0)),
    "kchunk": (_fwd(use_dot=True, block_k=16, block_b=16),
               _bwd(use_dot=True, block_k=16, block_b=16, prefetch=0, split_dw=0, two_pass=0)),
}


def _inputs(F=2, B=3, D=17, H=17, feature_dim=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    kw = dict(dtype=torch.float64, generator=g)
    x = torch.randn((F, B, D) if feature_dim == 0 else (B, F, D), **kw)
    w = torch.randn(F, H, D, **kw) / D ** 0.5
    b = 0.1 + 0.1 * torch.randn(F, H, **kw)
    lw = 1 + 0.2 * torch.randn(F, D, **kw)
    lb = 0.2 * torch.randn(F, D, **kw)
    gy = torch.randn((F, B, H) if feature_dim == 0 else (B, F, H), **kw)
    return [x, w, b, lw, lb, gy]


def _run(fn, tensors, dtype, feature_dim, eps, gy=None):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in tensors[:5]]
    y = fn(*leaves[:3], ln_weight=leaves[3], ln_bias=leaves[4], eps=eps, feature_dim=feature_dim)
    y.backward(tensors[5].to(dtype) if gy is None else gy)
    return [y.detach()] + [t.grad for t in leaves]


def _check(tensors, path, feature_dim=0, eps=1e-5, gy=None):
    """The op on the forced `path` against float64: finite entries within tolerance, NaN where the
    reference's NaN is, no finite value where the reference (float64 and fp32) is non-finite and
    no NaN / inf where it is finite."""
    ref = functools.partial(recfuse.reference.ln_tanh_linear_relu)
    r64 = _run(ref, tensors, torch.float64, feature_dim, eps, None if gy is None else gy.double())
    r32 = _run(ref, tensors, torch.float32, feature_dim, eps, gy)
    fwd, bwd = PATHS[path]
    with configs.override(forward=fwd, backward=bwd), launch.trace_launches() as seen:
        out = _run(recfuse.ln_tanh_linear_relu, tensors, torch.float32, feature_dim, eps, gy)
    assert [kind for kind, *_ in seen] == ["forward", "backward"]  # the kernels ran, no composite
    for name, o, r, r3, tol in zip(("y", "x", "weight", "bias", "ln_weight", "ln_bias"), out, r64, r32,
                                   (1e-5,) + (1e-4,) * 5):
        o = o.double()
        nonfinite = ~torch.isfinite(r) & ~torch.isfinite(r3.double())
        assert not (torch.isfinite(o) & nonfinite).any(), f"{path} {name}: finite where the reference is not"
        assert not (~torch.isfinite(o) & torch.isfinite(r)).any(), f"{path} {name}: non-finite where float64 is finite"
        assert not (o.isnan() & ~r.isnan() & torch.isfinite(r)).any(), name
        both = torch.isfinite(o) & torch.isfinite(r)
        if both.any():
            scale = max(r[torch.isfinite(r)].abs().max().item(), 1e-30)
            err = (o[both] - r[both]).abs().max().item() / scale
            assert err < tol, f"{path} {name}: {err:.2e} >= {tol:.0e} (scale {scale:.2e})"
    return out


# ---------------------------------------------------------------------------------------------
# finding 1: relu's backward at a NaN z keeps grad_y, as torch's does

@pytest.mark.parametrize("path", ["row", "dot"])
@pytest.mark.parametrize("where", ["x_elem", "x_row", "weight", "ln_bias"])
def test_nan_pre_activation_keeps_grad_y_in_the_parameter_gradients(path, where):
    """Before: bias.grad of the NaN feature 0.47 off float64 (x), weight / bias / norm-affine
    gradients 0.57-1.0 off (parameters), both finite; the other feature's always right."""
    t = _inputs(D=17, H=17)
    index = {"x_elem": (0, (1, 1, 2)), "x_row": (0, (1, 1)), "weight": (1, (1, 0, 2)), "ln_bias": (4, (1, 2))}
    i, idx = index[where]
    t[i][idx] = NAN
    _check(t, path)


def test_nan_pre_activation_relu_mask_and_feature_mlp_chains():
    """The saved relu mask (fp32 D=64: the forward saves it, the tl.dot backward reads it) and the
    inner relu activation (`_activate_grad`) of feature_mlp, a NaN in one element of x."""
    t = _inputs(D=64, H=17)
    t[0][1, 1, 2] = NAN
    _check(t, "dot")
    t = _inputs(D=5, H=3)
    t[0][1, 1, 2] = NAN
    x, w, b, lw, lb, gy = t
    kw = dict(norm="layer_norm", activation="relu", out_activation="relu", eps=1e-5)
    outs = []
    for dtype, fn in ((torch.float64, recfuse.reference.feature_mlp), (torch.float32, recfuse.feature_mlp)):
        leaves = [v.detach().to(dtype).requires_grad_(True) for v in (x, w, b, lw, lb)]
        fn(*leaves[:3], ln_weight=leaves[3], ln_bias=leaves[4], **kw).backward(gy.to(dtype))
        outs.append([v.grad.double() for v in leaves])
    for name, o, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), *outs):
        assert torch.equal(o.isnan(), r.isnan()), name
        fin = torch.isfinite(r)
        assert ((o[fin] - r[fin]).abs().max() / r[fin].abs().max().clamp_min(1e-30)).item() < 1e-4, name


# ---------------------------------------------------------------------------------------------
# finding 2: an infinite weight through the fp32 tl.dot backward's bf16 parts

@pytest.mark.parametrize("H", [1, 17])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_infinite_weight_on_the_split_dot_backward(H, sign):
    """Before: weight / bias / ln_weight / ln_bias gradients of the feature with the inf weight
    exactly 0 (H=1: 1.0 off float64; H=17: 0.30-0.49 off)."""
    t = _inputs(D=17, H=H)
    t[1][1, 0, 2] = sign * INF
    _check(t, "dot")


def test_infinite_weight_on_the_k_chunked_backward():
    t = _inputs(D=32, H=17)
    t[1][1, 0, 2] = INF
    _check(t, "kchunk")


# ---------------------------------------------------------------------------------------------
# probes that found nothing, pinned

@pytest.mark.parametrize("path", ["row", "dot"])
def test_nan_grad_y_skipped_by_a_strided_view_does_not_leak(path):
    t = _inputs(D=17, H=3, feature_dim=1)
    big = torch.full((3, 2, 6), NAN, dtype=torch.float32, device=t[5].device)
    big[:, :, ::2] = t[5].float()
    gy = big[:, :, ::2]
    assert not gy.isnan().any() and not gy.is_contiguous()
    _check(t, path, feature_dim=1, gy=gy)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 1e30, INF])
def test_constant_rows_and_huge_eps(eps):
    t = _inputs(D=17, H=3)
    t[0][1, 1] = 3.7
    t[0][0, 2] = -1234.5678
    _check(t, "row", eps=eps)


@pytest.mark.parametrize("scale", [1e-20, 1e15])
def test_scaled_rows(scale):
    t = _inputs(D=17, H=3)
    t[0] = t[0] * scale
    _check(t, "dot")
