"""Red-team round 28: the GEMM backward (`BackwardConfig.gemm`) with non-finite values, under the
interpreter (its Triton GEMMs' dots are numpy's fp32 over bf16 parts there; on a GPU the bf16
tensor cores': run this file on CUDA with tools/rounds_on_cuda.py, 29 passed on the H200 in
session 30), through the public op's autograd against the float64 per-slice reference, with round 25's
rules (`test_trust_round25._check`): finite entries within 1e-4 of the largest finite reference
magnitude, NaN exactly where the reference's NaN is, no finite value where the reference (float64
and fp32) is non-finite.

Probed (66 cases, all right, the cheap ones pinned below): NaN, +inf and -inf in one element of x,
a whole row of x, the weight, the bias, the LayerNorm weight and bias and grad_y, at F=2 B=3
D=17 H=3 ([F, B, D]), D=17 H=17 ([B, F, D]) and D=48 H=40 (two relu-mask words); constant rows
with eps 0, 1e-5 and 1e30 (session 29, its GEMMs then cuBLAS's). Nothing found: the GEMMs propagate
NaN and inf as torch's own matmuls in the reference do, the relu mask comes from the forward (round 25's NaN rule), and the row
kernel's padded lanes are exact zeros before the row sums.
Not probed: values near fp32's max in the GEMMs (3xTF32's split of such a value is not exact).
"""
from __future__ import annotations

import pytest

from test_trust_round25 import PATHS, _bwd, _check, _fwd, _inputs

pytestmark = pytest.mark.interpret

INF, NAN = float("inf"), float("nan")
GEMM = "gemm"


@pytest.fixture(autouse=True)
def _gemm_path(monkeypatch):
    """Round 25's `_check` forces the configs of `PATHS[path]`: the GEMM backward's, for each test
    only (round 26 copies round 25's paths when it is imported)."""
    monkeypatch.setitem(PATHS, GEMM, (_fwd(use_dot=True, block_k=0, block_b=16),
                                      _bwd(gemm=1, block_b=4, programs_per_sm=2)))

WHERE = {"x_elem": (0, (1, 1, 2)), "x_row": (0, (1, 1)), "weight": (1, (1, 0, 2)), "bias": (2, (1, 0)),
         "ln_weight": (3, (1, 2)), "ln_bias": (4, (1, 2)), "grad_y": (5, (1, 1, 0))}


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", list(WHERE))
def test_one_non_finite_value_on_the_gemm_backward(where, value):
    t = _inputs(D=17, H=17, feature_dim=1)
    i, idx = WHERE[where]
    t[i][idx] = value
    _check(t, GEMM, feature_dim=1)


@pytest.mark.parametrize("where", ["x_elem", "weight", "grad_y"])
def test_non_finite_values_across_two_relu_mask_words(where):
    t = _inputs(D=48, H=40)
    i, idx = WHERE[where]
    t[i][idx] = NAN
    _check(t, GEMM)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 1e30])
def test_constant_rows_on_the_gemm_backward(eps):
    t = _inputs(D=17, H=17)
    t[0][1, 1, :] = 3.7
    _check(t, GEMM, eps=eps)


@pytest.mark.parametrize("D, H, feature_dim", [(17, 17, 1), (48, 40, 0)])
def test_these_inputs_take_the_gemm_backward(D, H, feature_dim):
    # `_check` asserts that the kernels ran; this, that the backward that ran is the GEMM one
    import torch

    import recfuse
    from recfuse.ops import configs, launch

    x, w, b, lw, lb, gy = [t.float() for t in _inputs(D=D, H=H, feature_dim=feature_dim)]
    x.requires_grad_(True)
    fwd, bwd = PATHS[GEMM]
    with configs.override(forward=fwd, backward=bwd), launch.trace_launches() as seen:
        recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=feature_dim).backward(gy)
    assert [cfg.gemm for kind, _, _, cfg in seen if kind == "backward"] == [1]
    assert torch.isfinite(x.grad).all()
