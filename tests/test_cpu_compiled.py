"""The op's compiled CPU path (Inductor C++ of the batched composite and the analytic backward).

The rest of the suite runs the eager composite (tests/conftest.py); every test here switches the
compiled path on with `recfuse.ops.cpu_backend("compiled")`. Each parameter variant compiles once
(forward and backward, ~5-10 s each on 2 cores with a cold Inductor cache), so the cases share
variants where they can.
"""
import os
import warnings

import pytest
import torch

import recfuse
from recfuse.ops import _cpu_compiled
from recfuse.reference import batched_ln_tanh_linear_relu

from op_cases import Case, check_against_float64, make_inputs, rel_err, TOLERANCE

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                reason="CPU tensors run the Triton interpreter under TRITON_INTERPRET=1")


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _variants_compiled() -> int:
    return sum(1 for v in _cpu_compiled._CACHE.values() if v is not _cpu_compiled._FAILED)


def _fwd_bwd(tensors, dtype, feature_dim, eps=1e-5):
    x, w, b, lw, lb, gy = tensors
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in (x, w, b, lw, lb)]
    y = recfuse.ln_tanh_linear_relu(leaves[0], leaves[1], leaves[2], ln_weight=leaves[3], ln_bias=leaves[4],
                                    eps=eps, feature_dim=feature_dim)
    y.backward(gy.to(dtype))
    return y.detach(), [None if t is None else t.grad for t in leaves]


def _assert_matches_eager(tensors, dtype, feature_dim, eps=1e-5):
    """Compiled vs eager composite: same NaNs, within the dtype's tolerance elsewhere."""
    with recfuse.ops.cpu_backend("compiled"):
        y, grads = _fwd_bwd(tensors, dtype, feature_dim, eps)
    with recfuse.ops.cpu_backend("eager"):
        y_e, grads_e = _fwd_bwd(tensors, dtype, feature_dim, eps)
    for out, ref in zip([y] + grads, [y_e] + grads_e):
        if ref is None:
            continue
        assert out.dtype == ref.dtype and out.shape == ref.shape and out.stride() == ref.stride()
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(out), nan)
        if (~nan).any():
            assert rel_err(out[~nan], ref[~nan]) < TOLERANCE[dtype]
    return y, grads


# One shared-weight fp32 variant (feature_dim 0) and one per-feature bf16 variant (feature_dim 1,
# strided torchrec-style view): forward and backward against the float64 per-slice reference.
CASES = [
    (Case(8, 600, 32, 4, feature_dim=0, bias="shared", ln="per_feature"), torch.float32),
    (Case(6, 700, 32, 3, feature_dim=1, per_feature_weight=True, bias="per_feature", ln="shared",
          strided_view=True), torch.bfloat16),
]


@pytest.mark.parametrize("case,dtype", CASES, ids=lambda v: str(v))
def test_compiled_matches_float64_and_eager(case, dtype):
    with recfuse.ops.cpu_backend("compiled"):
        before = _variants_compiled()
        check_against_float64(case, dtype)
        assert _variants_compiled() == before + 2, "forward and backward should both run compiled"
    _assert_matches_eager(make_inputs(case), dtype, case.feature_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features_first_view_of_a_batch_major_buffer(dtype):
    # `transform`'s graphs pass a [B, F*D] buffer as movedim'd [F, B, D] with feature_dim=0: the
    # compiled path runs it transposed (rows in memory order) and must give the eager composite's
    # y and gradients, with its strides, and match float64.
    F, B, D, H = 5, 300, 16, 2
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(B, F * D, generator=g, dtype=torch.float64)
    x = buf.view(B, F, D).transpose(0, 1)
    assert _cpu_compiled._swapped(x)
    w = torch.randn(H, D, generator=g, dtype=torch.float64) / D ** 0.5
    b = 0.1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64)
    lw = 1 + 0.2 * torch.randn(F, D, generator=g, dtype=torch.float64)
    lb = 0.2 * torch.randn(F, D, generator=g, dtype=torch.float64)
    gy = torch.randn(F, B, H, generator=g, dtype=torch.float64)
    tensors = (x.to(dtype), w, b, lw, lb, gy)
    assert tensors[0].stride() == x.stride()
    y, grads = _assert_matches_eager(tensors, dtype, feature_dim=0)
    ran = {(which, key[1]) for (which, _, key) in _cpu_compiled._CACHE if key[2] == dtype and key[-1] == (H, D)}
    assert ran == {("fwd_save_t", 1), ("bwd", 1)}  # the batch-major variant, transposed
    leaves = [t.detach().to(dtype).double().requires_grad_(True) for t in (x, w, b, lw, lb)]
    y64 = batched_ln_tanh_linear_relu(*leaves, 1e-5, 0)
    y64.backward(gy.to(dtype).double())
    assert rel_err(y, y64) < TOLERANCE[dtype]
    for out, leaf in zip(grads, leaves):
        assert rel_err(out, leaf.grad) < TOLERANCE[dtype] * (1 if dtype == torch.float32 else 2)


def test_new_shape_reuses_compiled_variant():
    case, dtype = CASES[0]
    tensors = make_inputs(case)
    with recfuse.ops.cpu_backend("compiled"):
        _fwd_bwd(tensors, dtype, case.feature_dim)   # compiled already, or compiles here
        graphs = _graphs()
        # Another F and B, across 4096 rows (8*600 -> 5*500): float32 sums over more than 4096
        # elements carry an Inductor guard, which the backward's float64 row sums avoid.
        bigger = make_inputs(Case(5, 500, 32, 4, feature_dim=0, bias="shared", ln="per_feature"))
        y, grads = _fwd_bwd(bigger, dtype, 0)
        assert _graphs() == graphs, "a new shape of a compiled variant recompiled"
    _assert_matches_eager(bigger, dtype, 0)


def test_compiled_is_deterministic():
    case, dtype = CASES[0]
    tensors = make_inputs(case)
    with recfuse.ops.cpu_backend("compiled"):
        y1, g1 = _fwd_bwd(tensors, dtype, 0)
        y2, g2 = _fwd_bwd(tensors, dtype, 0)
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(g1, g2) if a is not None)


def test_compiled_nan_rows():
    """A constant row with eps=0 and a row holding inf give NaN where the eager composite does."""
    x = torch.randn(4, 300, 16, dtype=torch.float64)
    x[1, 2] = 2.0
    x[3, 5, 7] = float("inf")
    w = torch.randn(2, 16, dtype=torch.float64)
    gy = torch.randn(4, 300, 2, dtype=torch.float64)
    y, grads = _assert_matches_eager((x, w, None, None, None, gy), torch.float32, 0, eps=0.0)
    assert torch.isnan(y[1, 2]).all() and torch.isnan(y[3, 5]).all() and not torch.isnan(y[0]).any()


def _broken_backend(gm, example_inputs):
    raise RuntimeError("simulated: no C++ compiler")


def _backward_only_broken_backend(gm, example_inputs):
    """Runs the traced forward graphs as they are (no compile cost) and fails on the backward's
    (the one graph with grad_y and the saved tensors: 6 or more tensor inputs)."""
    if sum(isinstance(t, torch.Tensor) for t in example_inputs) >= 6:
        raise RuntimeError("simulated: backward does not compile")
    return gm.forward


def _eager_reference(x, w):
    with recfuse.ops.cpu_backend("eager"):
        y_ref = recfuse.ln_tanh_linear_relu(x, w)
        gx_ref, gw_ref = torch.autograd.grad(y_ref.sum(), [x, w])
    return y_ref, gx_ref, gw_ref


def test_compile_failure_falls_back_to_eager():
    """A forward that does not compile: one warning, then the eager composite (forward and
    backward) for that variant, same numbers."""
    x, w = torch.randn(3, 5, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    y_ref, gx_ref, gw_ref = _eager_reference(x, w)
    with recfuse.ops.cpu_backend("compiled", dynamo_backend=_broken_backend):
        with pytest.warns(RuntimeWarning, match="training forward failed.*using the eager composite"):
            y = recfuse.ln_tanh_linear_relu(x, w)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning per variant, then quietly eager
            gx, gw = torch.autograd.grad(y.sum(), [x, w])
            y2 = recfuse.ln_tanh_linear_relu(x, w)
    assert torch.equal(y, y_ref) and torch.equal(y2, y_ref)
    assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)


def test_backward_compile_failure_falls_back_to_eager():
    x, w = torch.randn(3, 5, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    y_ref, gx_ref, gw_ref = _eager_reference(x, w)
    with recfuse.ops.cpu_backend("compiled", dynamo_backend=_backward_only_broken_backend):
        y = recfuse.ln_tanh_linear_relu(x, w)
        with pytest.warns(RuntimeWarning, match="backward failed"):
            gx, gw = torch.autograd.grad(y.sum(), [x, w])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            gx2, gw2 = torch.autograd.grad(recfuse.ln_tanh_linear_relu(x, w).sum(), [x, w])
    torch.testing.assert_close(y, y_ref)
    for out, ref in ((gx, gx_ref), (gw, gw_ref), (gx2, gx_ref), (gw2, gw_ref)):
        torch.testing.assert_close(out, ref)


def test_second_backward_through_retained_graph():
    """The compiled backward consumes the forward's saved tensors; a second backward through a
    retained graph runs the eager composite backward, with the same gradients."""
    case, dtype = CASES[0]
    x, w, b, lw, lb, gy = make_inputs(case)
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, w, b, lw, lb)]
    with recfuse.ops.cpu_backend("compiled"):
        y = recfuse.ln_tanh_linear_relu(leaves[0], leaves[1], leaves[2], ln_weight=leaves[3], ln_bias=leaves[4])
        first = torch.autograd.grad(y, leaves, gy.to(dtype), retain_graph=True)
        second = torch.autograd.grad(y, leaves, gy.to(dtype))
    for a, b_ in zip(first, second):
        assert rel_err(a, b_) < TOLERANCE[dtype]


def test_frozen_and_inference_calls_do_not_recompile():
    """requires_grad is not part of what compiles: inference, frozen parameters and training
    calls of one variant share its compiled code."""
    case, dtype = CASES[0]
    x, w, b, lw, lb, gy = [t.to(dtype) for t in make_inputs(case)]
    with recfuse.ops.cpu_backend("compiled"):
        _fwd_bwd((x, w, b, lw, lb, gy), dtype, 0)      # compiled already, or compiles here
        with torch.no_grad():
            recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb)   # inference graph
        graphs = _graphs()
        with torch.no_grad():
            recfuse.ln_tanh_linear_relu(x.requires_grad_(True), w, b, ln_weight=lw, ln_bias=lb)
        x.requires_grad_(False)
        xs = x.detach().requires_grad_(True)             # frozen parameters: only x trains
        y = recfuse.ln_tanh_linear_relu(xs, w, b, ln_weight=lw, ln_bias=lb)
        y.backward(gy)
        assert _graphs() == graphs, "requires_grad alone compiled again"
    with recfuse.ops.cpu_backend("eager"):
        x_ref = x.detach().requires_grad_(True)
        recfuse.ln_tanh_linear_relu(x_ref, w, b, ln_weight=lw, ln_bias=lb).backward(gy)
    assert rel_err(xs.grad, x_ref.grad) < TOLERANCE[dtype]


def test_eager_switch_compiles_nothing():
    x, w = torch.randn(3, 5, 8), torch.randn(2, 8)
    with recfuse.ops.cpu_backend("eager"):
        cached = len(_cpu_compiled._CACHE)
        y = recfuse.ln_tanh_linear_relu(x, w, eps=1e-3)
        assert len(_cpu_compiled._CACHE) == cached
    torch.testing.assert_close(y, batched_ln_tanh_linear_relu(x, w, None, None, None, 1e-3, 0))


def test_switch_api():
    # The suite's backend is tests/conftest.py's (eager, or RECFUSE_CPU_BACKEND's when set).
    suite = os.environ["RECFUSE_CPU_BACKEND"]
    other = "eager" if suite == "compiled" else "compiled"
    assert recfuse.ops.get_cpu_backend() == suite
    with recfuse.ops.cpu_backend(other):
        assert recfuse.ops.get_cpu_backend() == other
        with recfuse.ops.cpu_backend(suite):
            assert recfuse.ops.get_cpu_backend() == suite
        assert recfuse.ops.get_cpu_backend() == other
    assert recfuse.ops.get_cpu_backend() == suite
    previous = recfuse.ops.set_cpu_backend(other)
    try:
        assert previous == suite and recfuse.ops.get_cpu_backend() == other
    finally:
        recfuse.ops.set_cpu_backend(previous)
    with pytest.raises(ValueError):
        recfuse.ops.set_cpu_backend("fast")
    with pytest.raises(ValueError):
        with recfuse.ops.cpu_backend("triton"):
            pass


@pytest.mark.parametrize("value,expected", [("eager", "eager"), ("compiled", "compiled"), (" Compiled ", "compiled"),
                                            ("", "compiled"), (None, "compiled")])
def test_environment_variable(monkeypatch, value, expected):
    """What `recfuse.ops` reads from RECFUSE_CPU_BACKEND at import (the function it calls)."""
    if value is None:
        monkeypatch.delenv("RECFUSE_CPU_BACKEND", raising=False)
    else:
        monkeypatch.setenv("RECFUSE_CPU_BACKEND", value)
    assert _cpu_compiled._backend_from_env() == expected


def test_environment_variable_unknown_value_warns(monkeypatch):
    monkeypatch.setenv("RECFUSE_CPU_BACKEND", "fast")
    with pytest.warns(UserWarning, match="RECFUSE_CPU_BACKEND"):
        assert _cpu_compiled._backend_from_env() == "compiled"
