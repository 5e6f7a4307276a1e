"""Red-team round 27: the red-team rounds 25 and 26 (interpreter-only until now) run on the GPU
(a pytest plugin moved their inputs to CUDA), and what the interpreter cannot show.

Found wrong (a test below fails before its fix):

1. An infinite weight on the fp32 and 16-bit tl.dot backwards that recompute z from 16-bit parts
   (`kernels._dot_parts`), and on the 16-bit forward's saved relu mask (z + the product of t's
   rounding error), on the GPU: round 25's test of it failed there (weight.grad 0.21-2.98 off
   float64, relative to its largest entry, finite in both). z = t0 w0 + t1 w0 + ...: with w0 =
   -inf, a lower part t1 of the other sign than t0 (round to nearest leaves either; the
   interpreter's bf16 conversion truncates, so its remainders keep the sign and hid it) makes
   t1 w0 = +inf, and t1 = 0 (t exactly a bf16 value) makes it NaN: z = NaN where it is -inf, the
   relu mask opens and that feature's weight / bias / norm-affine gradients come out finite and
   wrong (H200 probe, B=3: bias.grad 0.14-0.43 off, fp32 D=17 and bf16 D=17/64/256, the saved mask
   and the recomputed z alike). The zero-part case shows in the interpreter too: activation None,
   a LayerNorm column with weight 0 and bias 0.5 gives t = 0.5 in every row (fp32 D=17/32,
   H=1/17: weight.grad 0.44-1.8, bias.grad 0.06-8.8 off float64). Now `_dot_parts(..., NAN_SAFE)`
   sums the lower-order products apart and drops a non-finite sum before adding t0 w0 (a first
   fix that dropped only NaN, as Triton's own tf32x3 does, passed the interpreter and failed 6
   CUDA cases); the 16-bit forward's mask does the same with its lower part (`_output_store`).

Run on the GPU (H200, torch 2.11, triton 3.6; results/checks/session28_call{1..9}_h200*.txt):
rounds 25 and 26 on CUDA (a pytest plugin moved their inputs there; 48 tests: 41 passed before
the fix, the 5 infinite-weight cases above failed, 2 failed on a CPU tensor the test built, now on
the inputs' device; all 48 after), this file (20 passed, 8 skipped: the K-chunked path below
D=32), the CUDA cases of test_feature_mlp / test_op_trust / test_split_backward /
test_trust_round13_kernels and the CUDA property test; bf16 subnormal x / parameters / norm
affine / grad_y on the row, tl.dot and K-chunked paths, both layouts (a build script, GPU only):
every entry within 1.1e-2 of float64's bf16 rounding, finite where it is (torch's own bf16
per-slice chain: up to 0.49 off); more than 65535 features (F = 70001, fp32 and bf16, both
layouts) against float64; x of more than 2^31 elements (fp32 8.6 GB, bf16, both layouts: every
offset of the last feature or the last rows past int32), the test below (3 passed, call 6); one
non-finite value on each of round 26's eight forced paths, fp32 and bf16, three chains (320 runs,
call 8: nothing silent, nothing loud), pinned below on four paths and two chains (16 passed, call
9).
"""
from __future__ import annotations

import pytest
import torch

import recfuse
from test_trust_round25 import _inputs  # noqa: E402
from test_trust_round26 import _forced, _run  # noqa: E402

INF = float("inf")
CHAIN = dict(norm="layer_norm", activation=None, out_activation="relu", eps=1e-5)


def _exact_part_inputs(D, H, sign, device="cpu"):
    """Feature 1's column 2 of t is 0.5 in every row (LayerNorm weight 0, bias 0.5, no activation):
    its lower 16-bit parts are 0, so 0 * w0 meets the infinite weight w[1, 0, 2]."""
    t = [v.to(device) for v in _inputs(D=D, H=H, seed=3)]
    t[3][1, 2] = 0.0
    t[4][1, 2] = 0.5
    t[1][1, 0, 2] = sign * INF
    return t


NAMES = ("y", "x", "weight", "bias", "ln_weight", "ln_bias")


def _assert_finite_entries_match(out, ref, tol, rounding=None, names=NAMES):
    for name, o, r in zip(names, out, ref):
        r = r if rounding is None else r.to(rounding).double()
        o = o.double()
        assert torch.equal(torch.isfinite(o), torch.isfinite(r)), f"{name}: finite where float64 is not, or not"
        fin = torch.isfinite(r)
        err = ((o[fin] - r[fin]).abs().max() / r[fin].abs().max().clamp_min(1e-30)).item()
        assert err < tol, f"{name}: {err:.2e} >= {tol:.0e}"


@pytest.mark.interpret
@pytest.mark.parametrize("path,D", [("dot", 17), ("kchunk", 32)])
@pytest.mark.parametrize("H", [1, 17])
def test_infinite_weight_meets_zero_lower_parts_of_t(path, D, H):
    """Before: z NaN where it is -inf, the mask open: weight.grad 0.44-1.8 and bias.grad 0.06-8.8
    off float64, finite."""
    t = _exact_part_inputs(D, H, -1.0)
    ref = _run(recfuse.reference.feature_mlp, t, torch.float64, **CHAIN)
    out = _forced(path, recfuse.feature_mlp, t, torch.float32, **CHAIN)
    _assert_finite_entries_match(out, ref, 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: round to nearest bf16 parts")
@pytest.mark.parametrize("path", ["dot", "kchunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,H", [(17, 17), (64, 17), (256, 64)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_infinite_weight_on_the_gpu_dot_backwards(path, dtype, D, H, sign):
    """The default chain (tanh: t's parts of either sign) and the exact-part chain, on the tl.dot
    and K-chunked paths; bf16 also through the forward's saved relu mask (16-bit z + lower part)."""
    if path == "kchunk" and D < 32:
        pytest.skip("the K-chunked path takes D >= 32")
    t = [v.cuda() for v in _inputs(D=D, H=H, seed=4)]
    t[1][1, 0, 2] = sign * INF
    tol, rounding = (1e-4, None) if dtype == torch.float32 else (2e-2, torch.bfloat16)
    if rounding is not None:
        t = [v.to(rounding).double() for v in t]
    ref = _run(recfuse.reference.ln_tanh_linear_relu, t, torch.float64, eps=1e-5)
    out = _forced(path, recfuse.ln_tanh_linear_relu, t, dtype, eps=1e-5)
    # x.grad of feature 1 is inf / NaN (a closed relu's 0 times the inf weight: torch mixes both)
    _assert_finite_entries_match(out[:1] + out[2:], ref[:1] + ref[2:], tol, rounding, NAMES[:1] + NAMES[2:])
    t = _exact_part_inputs(D, H, sign, "cuda")
    if rounding is not None:
        t = [v.to(rounding).double() for v in t]
    ref = _run(recfuse.reference.feature_mlp, t, torch.float64, **CHAIN)
    out = _forced(path, recfuse.feature_mlp, t, dtype, **CHAIN)
    _assert_finite_entries_match(out, ref, tol, rounding)


# ---------------------------------------------------------------------------------------------
# more than 2^31 elements in x: every offset past int32 (a GPU with room for it)

def _big_gpu(gib: float) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory >= gib * 2 ** 30


@pytest.mark.skipif(not _big_gpu(60), reason="needs a CUDA GPU with 60 GiB")
@pytest.mark.parametrize("dtype,feature_dim", [(torch.float32, 1), (torch.bfloat16, 0), (torch.float32, 0)])
def test_more_than_2_31_elements_on_the_gpu(dtype, feature_dim):
    """x of F * B * D > 2^31 elements (fp32: 8.6 GB; the last feature's or the last row's offsets
    pass int32 in the [F, B, D] / [B, F*D] layouts): y and every gradient of the first, middle and
    last features against float64 on those slices. The bias is +-20 by output (|z - bias| < 12
    here): every relu decided, no ties for rounding to flip, half the outputs closed."""
    F, D, H = 256, 128, 4
    B = 2 ** 31 // (F * D) + 64
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((F, B, D) if feature_dim == 0 else (B, F * D), device="cuda", dtype=dtype,
                    generator=g).requires_grad_(True)
    xin = x if feature_dim == 0 else x.view(B, F, D)
    bias = 20.0 * (1 - 2 * (torch.arange(H, device="cuda") % 2)).float().expand(F, H)
    params = [torch.randn(F, H, D, device="cuda", generator=g) / D ** 0.5, bias,
              1 + 0.2 * torch.randn(F, D, device="cuda", generator=g), 0.2 * torch.randn(F, D, device="cuda", generator=g)]
    params = [p.to(dtype).contiguous().requires_grad_(True) for p in params]
    y = recfuse.ln_tanh_linear_relu(xin, params[0], params[1], ln_weight=params[2], ln_bias=params[3],
                                    feature_dim=feature_dim)
    gy = torch.randn(y.shape, device="cuda", dtype=dtype, generator=g)
    y.backward(gy)
    x_grad = x.grad if feature_dim == 0 else x.grad.view(B, F, D)
    tol_y, tol_g = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    for f in (0, F // 2, F - 1):
        sl = (lambda t: t[f]) if feature_dim == 0 else (lambda t: t[:, f])
        leaves = [sl(xin).detach().double().requires_grad_(True)] + [p[f].detach().double().requires_grad_(True)
                                                                     for p in params]
        a = torch.nn.functional.layer_norm(leaves[0], (D,), leaves[3], leaves[4], 1e-5)
        y64 = torch.relu(torch.tanh(a) @ leaves[1].T + leaves[2])
        y64.backward(sl(gy).double())
        assert ((sl(y).double() - y64).abs().max() / y64.abs().max()).item() < tol_y, f
        for name, o, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), [sl(x_grad)] + [p.grad[f] for p in params],
                              leaves):
            assert ((o.double() - r.grad).abs().max() / r.grad.abs().max()).item() < tol_g, (f, name)


# ---------------------------------------------------------------------------------------------
# one non-finite value on the forced kernel paths (GPU): nothing silent, nothing loud either

def _non_finite_at(D, H):
    """(tensor index into (x, w, b, lw, lb, gy), element, value) per injection."""
    return {"w-inf": (1, (1, 0, 2), -INF), "w+inf": (1, (1, H - 1, D - 2), INF), "b+inf": (2, (1, H // 2), INF),
            "lw+inf": (3, (1, D // 2), INF), "lb-inf": (4, (1, D - 1), -INF), "x+inf": (0, (1, 2, 3), INF),
            "xnan": (0, (1, 1, 3), float("nan"))}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: round to nearest, the GPU's dots")
@pytest.mark.parametrize("path,D,H", [("row", 17, 3), ("dot", 17, 17), ("kchunk", 32, 17), ("two_pass", 17, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["tanh", None])
def test_one_non_finite_value_on_the_gpu_kernel_paths(path, D, H, dtype, activation):
    """No entry finite and off float64 (fp32 1e-4, bf16 2e-2 of the largest), none finite where
    float64 and the dtype's own torch chain are not, none non-finite where float64 is finite. The
    H200 sweep this pins (8 paths, 3 chains, 320 runs) found none of either."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    kw = dict(norm="layer_norm", activation=activation, out_activation="relu", eps=1e-5)
    for what, (i, idx, val) in _non_finite_at(D, H).items():
        t = [v.cuda() for v in _inputs(B=5, D=D, H=H, seed=D + H)]
        t[i][idx] = val
        t = [v.to(dtype).double() for v in t]
        z = recfuse.reference.feature_mlp(*t[:3], ln_weight=t[3], ln_bias=t[4], **dict(kw, out_activation=None))
        t[5] = t[5].masked_fill((z.abs() < (1e-3 if dtype == torch.float32 else 3e-2)) & torch.isfinite(z), 0)
        ref = _run(recfuse.reference.feature_mlp, t, torch.float64, **kw)
        own = _run(recfuse.reference.feature_mlp, t, dtype, **kw)
        out = _forced(path, recfuse.feature_mlp, t, dtype, **kw)
        for name, o, r, r2 in zip(NAMES, out, ref, own):
            o, r2 = o.double(), r2.double()
            assert not (torch.isfinite(o) & ~torch.isfinite(r) & ~torch.isfinite(r2)).any(), (what, name)
            assert not (~torch.isfinite(o) & torch.isfinite(r)).any(), (what, name)
            fin = torch.isfinite(r)
            if fin.any():
                err = ((o[fin] - r[fin]).abs().max() / r[fin].abs().max().clamp_min(1e-30)).item()
                assert err < tol, (what, name, err)
