"""Silent wrong answers the op must not give: each test compares numbers with an independent
reference (float64 per-slice reference, the float32/float64 torch composite, autograd of it).

Every test runs on the path its process selects: the CPU composite in a plain run, the Triton
kernels (under the interpreter) in a `TRITON_INTERPRET=1` run. The `path` parameter labels the
two: its "triton" value is marked `interpret`, so each process runs the value that matches it.
Sizes stay tiny (the interpreter runs numpy per program).
"""
import os
import types

import pytest
import torch
import torch.nn.functional as F_

import recfuse
from recfuse.ops import configs, uses_triton
from recfuse.reference import batched_ln_tanh_linear_relu
from op_cases import TOLERANCE, rel_err

PATHS = [pytest.param("composite", id="composite"),
         pytest.param("triton", id="triton", marks=pytest.mark.interpret),
         # On a GPU machine: the same checks with the fused op's tensors moved to CUDA (the Triton
         # kernels at full speed); references stay on the CPU.
         pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="no CUDA device"))]

# The op's compiled CPU path (Inductor C++, the library's CPU default; the suite runs eager):
# for the numerical edge cases, which it must get right as the kernels do.
EDGE_PATHS = PATHS + [pytest.param("compiled", id="compiled", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") == "1", reason="CPU tensors run the Triton interpreter"))]

_FUSED_ON_CUDA = False


@pytest.fixture(autouse=True)
def _restore_cpu_backend():
    saved = recfuse.ops.get_cpu_backend()
    yield
    recfuse.ops.set_cpu_backend(saved)


def _on_path(path, cuda_ok=True):
    global _FUSED_ON_CUDA
    _FUSED_ON_CUDA = path == "cuda"
    if path == "cuda":
        if not cuda_ok:
            pytest.skip("this check runs on the CPU paths only")
        return
    # The process decides the path (TRITON_INTERPRET is read at import); make sure it is this one.
    assert uses_triton(torch.device("cpu")) == (path == "triton")
    if path == "compiled":
        recfuse.ops.set_cpu_backend("compiled")  # restored by _restore_cpu_backend


def _on_cuda(fn):
    """`fn` with its tensor arguments moved to CUDA and its result moved back (both differentiable,
    strides preserved), so CPU-side references and autograd leaves stay as they are."""

    def call(*args, **kwargs):
        dev = lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t  # noqa: E731
        return fn(*[dev(a) for a in args], **{k: dev(v) for k, v in kwargs.items()}).cpu()

    return call


def _params(F, D, H, dtype=torch.float64, per_feature=True, lw_scale=0.2, lw_center=1.0, bias=True):
    g = torch.Generator().manual_seed(1234)
    kw = dict(dtype=dtype, generator=g)
    w = torch.randn((F, H, D) if per_feature else (H, D), **kw) / D ** 0.5
    b = 0.1 + 0.1 * torch.randn((F, H) if per_feature else (H,), **kw) if bias else None
    lw = lw_center + lw_scale * torch.randn(F, D, **kw)
    lb = 0.2 * torch.randn(D, **kw)
    return w, b, lw, lb


def _float64_leaves(F, B, D, H):
    """x [B, F, D] (feature_dim=1) and `_params`, float64 leaves that require grad."""
    w, b, lw, lb = (t.requires_grad_(True) for t in _params(F, D, H))
    x = torch.randn(B, F, D, dtype=torch.float64, requires_grad=True)
    return x, w, b, lw, lb


def _assert_rel_errors(names, outs, refs, bound, prefix=""):
    for name, out, ref in zip(names, outs, refs):
        err = rel_err(out, ref)
        assert err < bound, f"{prefix}{name}: relative error {err:.2e}"


def _call(fn, x, w, b, lw, lb, fd, eps=1e-5):
    if _FUSED_ON_CUDA and fn is not recfuse.reference.ln_tanh_linear_relu:
        fn = _on_cuda(fn)
    return fn(x, w, b, ln_weight=lw, ln_bias=lb, eps=eps, feature_dim=fd)


def _op_positional(x, w, b, ln_weight=None, ln_bias=None, eps=1e-5, feature_dim=0):
    return torch.ops.recfuse.ln_tanh_linear_relu(x, w, b, ln_weight, ln_bias, eps, feature_dim)


ENTRY_POINTS = [pytest.param(recfuse.ln_tanh_linear_relu, id="eager"),
                pytest.param(_op_positional, id="custom_op")]


# ---------------------------------------------------------------------------------------------
# 1. x whose D dim is not innermost: forward and every gradient


def _layouts(F, B, D):
    """(name, feature_dim, buffer shape, function buffer -> x view with x.stride(2) != 1)."""
    return [
        ("DBF_permuted_fd0", 0, (D, B, F), lambda t: t.permute(2, 1, 0)),        # [F, B, D]
        ("DFB_permuted_fd1", 1, (D, F, B), lambda t: t.permute(2, 1, 0)),        # [B, F, D]
        ("FDB_transposed_fd0", 0, (F, D, B), lambda t: t.transpose(1, 2)),       # [F, B, D], stride(1) == 1
        ("FD_B_transposed_fd1", 1, (F * D, B), lambda t: t.t().view(B, F, D)),   # [F*D, B] buffer seen as [B, F, D]
        ("BDF_permuted_fd1", 1, (B, D, F), lambda t: t.permute(0, 2, 1)),        # [B, F, D]
    ]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("D, H", [(5, 1), (12, 3), (5, 6)])
def test_d_not_innermost_forward_and_gradients_match_float64(path, D, H):
    _on_path(path)
    F, B = 3, 7
    w64, b64, lw64, lb64 = _params(F, D, H)
    for name, fd, shape, view in _layouts(F, B, D):
        buf64 = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        x_shape = (F, B, D) if fd == 0 else (B, F, D)
        gy64 = torch.randn(x_shape[:2] + (H,), dtype=torch.float64)
        # float64 reference on a contiguous copy (an independent layout).
        ref_in = [view(buf64).contiguous().requires_grad_(True)] + [
            t.clone().requires_grad_(True) for t in (w64, b64, lw64, lb64)]
        y_ref = _call(recfuse.reference.ln_tanh_linear_relu, *ref_in, fd)
        g_ref = torch.autograd.grad(y_ref, ref_in, gy64)

        base = buf64.float().requires_grad_(True)
        x = view(base)
        assert x.shape == x_shape and x.stride(2) != 1, (name, x.stride())
        params = [t.float().requires_grad_(True) for t in (w64, b64, lw64, lb64)]
        y = _call(recfuse.ln_tanh_linear_relu, x, *params, fd)
        grads = torch.autograd.grad(y, [x] + params, gy64.float())
        assert rel_err(y, y_ref) < TOLERANCE[torch.float32], name
        _assert_rel_errors(["x", "weight", "bias", "ln_weight", "ln_bias"], grads, g_ref, TOLERANCE[torch.float32],
                           f"{name} d")
        # Through the base buffer too (autograd's view backward takes dx in x's strides).
        y2 = _call(recfuse.ln_tanh_linear_relu, view(base), *params, fd)
        (y2 * gy64.float()).sum().backward()
        assert rel_err(view(base.grad), g_ref[0]) < TOLERANCE[torch.float32], name


# ---------------------------------------------------------------------------------------------
# 2. double backward: a gradient penalty


def _gradient_penalty(fn, x, w, b, lw, lb, gy, fd):
    y = _call(fn, x, w, b, lw, lb, fd)
    (gx,) = torch.autograd.grad(y, x, gy, create_graph=True)
    return (gx * gx).sum()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("fd, per_feature", [(0, True), (1, False)])
def test_gradient_penalty_matches_float64_composite(path, entry, fd, per_feature):
    _on_path(path)
    F, B, D, H = 3, 5, 12, 3
    params64 = _params(F, D, H, per_feature=per_feature)
    x64 = torch.randn((F, B, D) if fd == 0 else (B, F, D), dtype=torch.float64)
    gy64 = torch.randn(x64.shape[:2] + (H,), dtype=torch.float64)

    def run(fn, dtype):
        x = x64.to(dtype).requires_grad_(True)
        params = [t.to(dtype).requires_grad_(True) for t in params64]
        pen = _gradient_penalty(fn, x, *params, gy64.to(dtype), fd)
        return pen, torch.autograd.grad(pen, [x] + params)

    pen_ref, g_ref = run(recfuse.reference.ln_tanh_linear_relu, torch.float64)
    pen, grads = run(entry, torch.float32)
    assert rel_err(pen, pen_ref) < 1e-5
    assert all(g.dtype == torch.float32 for g in grads)
    _assert_rel_errors(["x", "weight", "bias", "ln_weight", "ln_bias"], grads, g_ref, 1e-4, "d(penalty)/d")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_gradgradcheck_float64(path, entry):
    _on_path(path)
    x, w, b, lw, lb = _float64_leaves(F=2, B=3, D=5, H=2)
    assert torch.autograd.gradgradcheck(
        lambda *a: _call(entry, *a, fd=1), (x, w, b, lw, lb))


# ---------------------------------------------------------------------------------------------
# 3. torch.compile(dynamic=True): symbolic sizes in the argument checks


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("ln_shape", ["D", "FD"])
def test_compile_dynamic_shapes_matches_reference(path, backend, ln_shape):
    _on_path(path, cuda_ok=False)
    torch._dynamo.reset()
    F, D, H = 3, 5, 2
    w = torch.randn(H, D)
    lw = torch.randn(F, D) if ln_shape == "FD" else torch.randn(D)
    lb = torch.randn(D)
    fn = torch.compile(lambda x, w, lw, lb: recfuse.ln_tanh_linear_relu(x, w, ln_weight=lw, ln_bias=lb, feature_dim=1),
                       fullgraph=True, dynamic=True, backend=backend)
    for B in (4, 7, 9):
        x = torch.randn(B, F, D)
        y = fn(x, w, lw, lb)
        y_ref = recfuse.reference.ln_tanh_linear_relu(x.double(), w.double(), ln_weight=lw.double(),
                                                      ln_bias=lb.double(), feature_dim=1)
        assert y.shape == (B, F, H)
        assert rel_err(y, y_ref) < TOLERANCE[torch.float32], B


# ---------------------------------------------------------------------------------------------
# 4. torch.func transforms


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_torch_func_grad_matches_composite(path, entry):
    _on_path(path)
    F, B, D, H = 2, 4, 5, 3
    w, b, lw, lb = (t.float() for t in _params(F, D, H))
    x = torch.randn(B, F, D)
    gy = torch.randn(B, F, H)

    def loss(fn, x, w, lw):
        return (_call(fn, x, w, b, lw, lb, 1) * gy).sum()

    grad_fn = torch.func.grad(lambda x, w, lw: loss(entry, x, w, lw), argnums=(0, 1, 2))
    if entry is _op_positional:
        # torch's own custom ops take no torch.func.grad (their autograd.Function has no
        # setup_context); the error says so. recfuse.ln_tanh_linear_relu is the supported entry.
        with pytest.raises(RuntimeError, match="functorch transforms"):
            grad_fn(x, w, lw)
        return
    got = grad_fn(x, w, lw)
    args64 = [t.double().requires_grad_(True) for t in (x, w, lw)]
    ref = torch.autograd.grad(
        (_call(batched_ln_tanh_linear_relu_kw, args64[0], args64[1], b.double(), args64[2], lb.double(), 1)
         * gy.double()).sum(), args64)
    for what, g, r in zip(["x", "weight", "ln_weight"], got, ref):
        assert rel_err(g, r) < TOLERANCE[torch.float32], what


def batched_ln_tanh_linear_relu_kw(x, w, b, ln_weight=None, ln_bias=None, eps=1e-5, feature_dim=0):
    return batched_ln_tanh_linear_relu(x, w, b, ln_weight, ln_bias, eps, feature_dim)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("fd", [0, 1])
def test_torch_func_vmap_matches_composite(path, entry, requires_grad, fd):
    _on_path(path)
    F, B, D, H, N = 2, 3, 5, 3, 4
    # fd=0: per-feature parameters; fd=1: shared ones (the vmap rule repeats or keeps them).
    w, b, lw, lb = (t.float().requires_grad_(requires_grad) for t in _params(F, D, H, per_feature=fd == 0))
    x_shape = (F, B, D) if fd == 0 else (B, F, D)
    xs = torch.randn((N,) + x_shape)

    def ref(x, w_):
        return recfuse.reference.ln_tanh_linear_relu(x.double(), w_.double(), b.double(), ln_weight=lw.double(),
                                                     ln_bias=lb.double(), feature_dim=fd)

    ys = torch.func.vmap(lambda x: _call(entry, x, w, b, lw, lb, fd))(xs)
    # Batched over the weight too (in_dims on a parameter), the vmapped dim last.
    ws = torch.randn(tuple(w.shape) + (N,))
    yw = torch.func.vmap(lambda x, w_: _call(entry, x, w_, b, lw, lb, fd), in_dims=(0, -1), out_dims=1)(xs, ws)
    for n in range(N):
        assert rel_err(ys[n], ref(xs[n], w)) < TOLERANCE[torch.float32]
        assert rel_err(yw[:, n], ref(xs[n], ws[..., n])) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("path", PATHS)
def test_torch_func_jacrev_matches_autograd(path):
    _on_path(path)
    F, B, D, H = 2, 2, 5, 1
    w, b, lw, lb = (t.float() for t in _params(F, D, H))
    x = torch.randn(F, B, D)
    jac = torch.func.jacrev(lambda x: _call(recfuse.ln_tanh_linear_relu, x, w, b, lw, lb, 0))(x)
    ref = torch.autograd.functional.jacobian(
        lambda x: _call(recfuse.reference.ln_tanh_linear_relu, x, w.double(), b.double(), lw.double(),
                        lb.double(), 0), x.double())
    assert rel_err(jac, ref) < TOLERANCE[torch.float32]


# ---------------------------------------------------------------------------------------------
# 5. autocast: the dtype of the eager chain, gradients in the parameters' dtypes


def _eager_chain(x, w, b, lw, lb):
    return torch.relu(F_.linear(torch.tanh(F_.layer_norm(x, (x.shape[-1],), lw, lb, 1e-5)), w, b))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_autocast_output_dtype_and_gradients_match_eager(path, entry, x_dtype):
    _on_path(path, cuda_ok=False)
    F, B, D, H = 3, 6, 12, 3
    w64, b64, _, _ = _params(F, D, H, per_feature=False)
    lw64 = 1 + 0.2 * torch.randn(D, dtype=torch.float64)
    lb64 = 0.2 * torch.randn(D, dtype=torch.float64)
    x64 = torch.randn(F, B, D, dtype=torch.float64).to(x_dtype).double()  # representable in x_dtype
    gy = torch.randn(F, B, H, dtype=torch.float64)

    def leaves(dtype):
        return [x64.to(dtype if dtype == torch.float64 else x_dtype).requires_grad_(True)] + [
            t.to(dtype).requires_grad_(True) for t in (w64, b64, lw64, lb64)]

    ref_in = leaves(torch.float64)
    y_ref = _eager_chain(*ref_in)
    g_ref = torch.autograd.grad(y_ref, ref_in, gy)

    eager_in = leaves(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_eager = _eager_chain(*eager_in)
    op_in = leaves(torch.float32)  # fp32 parameters, x in x_dtype (mixed under autocast, as eager allows)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _call(entry, *op_in, 0)
    assert y_eager.dtype == torch.bfloat16
    assert y.dtype == y_eager.dtype and y.shape == y_eager.shape
    assert rel_err(y, y_ref) < TOLERANCE[torch.bfloat16]
    grads = torch.autograd.grad(y, op_in, gy.to(y.dtype))
    for t, g, r in zip(op_in, grads, g_ref):
        assert g.dtype == t.dtype
        assert rel_err(g, r) < 2e-2


@pytest.mark.parametrize("path", PATHS)
def test_autocast_under_compile_matches_eager_dtype(path):
    _on_path(path, cuda_ok=False)
    torch._dynamo.reset()
    F, B, D, H = 2, 4, 5, 2
    w, b, lw, lb = (t.float() for t in _params(F, D, H))
    x = torch.randn(B, F, D)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fn(x, w, b, lw, lb):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=1)

    y = fn(x, w, b, lw, lb)
    ref = recfuse.reference.ln_tanh_linear_relu(x.double(), w.double(), b.double(), ln_weight=lw.double(),
                                                ln_bias=lb.double(), feature_dim=1)
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) < TOLERANCE[torch.bfloat16]


def test_no_autocast_keeps_the_input_dtype():
    x, w = torch.randn(2, 3, 5), torch.randn(2, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert recfuse.ln_tanh_linear_relu(x, w).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y64 = recfuse.ln_tanh_linear_relu(x.double(), w.double())
    assert y64.dtype == torch.float64  # autocast leaves float64 alone, as for nn.Linear


# ---------------------------------------------------------------------------------------------
# 6. fp32 tanh accuracy near 0 (small LayerNorm weights)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scale", [1e-4, 3e-4, 1e-3, 1e-2])
@pytest.mark.parametrize("H", [1, 3, 6])
def test_small_ln_weight_fp32_is_accurate(path, scale, H):
    _on_path(path)
    F, B, D = 2, 9, 12
    w64, _, lw64, _ = _params(F, D, H, lw_scale=0.3 * scale, lw_center=scale)
    x64 = torch.randn(F, B, D, dtype=torch.float64).float().double()
    args64 = [t.float().double().requires_grad_(True) for t in (x64, w64, lw64)]
    y_ref = recfuse.reference.ln_tanh_linear_relu(args64[0], args64[1], ln_weight=args64[2])
    if y_ref.abs().sum() == 0:
        raise AssertionError("degenerate case")
    gy = torch.randn(y_ref.shape, dtype=torch.float64)
    g_ref = torch.autograd.grad(y_ref, args64, gy)
    args = [t.detach().float().requires_grad_(True) for t in args64]
    y = _call(recfuse.ln_tanh_linear_relu, args[0], args[1], None, args[2], None, 0)
    grads = torch.autograd.grad(y, args, gy.float())
    err = rel_err(y, y_ref)
    assert err < 1e-6, f"y relative error {err:.2e}"
    _assert_rel_errors(["x", "weight", "ln_weight"], grads, g_ref, 1e-5, "d")


# ---------------------------------------------------------------------------------------------
# 7. float64: exact, gradcheck passes


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_float64_gradcheck_and_exact_forward(path, entry):
    _on_path(path)
    x, w, b, lw, lb = _float64_leaves(F=3, B=4, D=5, H=2)
    y = _call(entry, x, w, b, lw, lb, 1)
    y_ref = _call(recfuse.reference.ln_tanh_linear_relu, x, w, b, lw, lb, 1)
    assert y.dtype == torch.float64 and rel_err(y, y_ref) < 1e-12
    assert torch.autograd.gradcheck(lambda *a: _call(entry, *a, fd=1), (x, w, b, lw, lb))


# ---------------------------------------------------------------------------------------------
# 8. huge and non-finite inputs: NaN where the float32 torch composite is not finite


def _huge_rows(F, B, D):
    x = torch.randn(F, B, D)
    x[0, 0, 1] = 1e30            # one huge element: fp32 variance overflows
    x[0, 1, :4] = 1e30           # most of a row (a constant row of 1e30 is its own case below)
    x[0, 2, :3] = torch.tensor([1e30, -1e30, 1e30])
    x[1, 0, 2] = 3e38            # near float32 max
    x[1, 1, 3] = float("inf")
    x[1, 2, 0] = float("nan")
    x[2, 3, 4] = -3e38
    x[2, 5, :] = -float("inf")
    return x


@pytest.mark.parametrize("path", EDGE_PATHS)
@pytest.mark.parametrize("H", [1, 3, 6])
def test_huge_and_nonfinite_rows_give_nan_where_torch_does(path, H):
    _on_path(path)
    F, B, D = 3, 7, 5
    x = _huge_rows(F, B, D)
    w, b, lw, lb = (t.float() for t in _params(F, D, H))
    ref = batched_ln_tanh_linear_relu(x, w, b, lw, lb, 1e-5, 0)  # float32 torch composite
    bad = ~torch.isfinite(ref)
    assert bad.any() and not bad.all()
    y = _call(recfuse.ln_tanh_linear_relu, x, w, b, lw, lb, 0)
    assert torch.equal(torch.isnan(y), bad), (torch.isnan(y), bad)
    assert torch.isfinite(y[~bad]).all()
    ref64 = recfuse.reference.ln_tanh_linear_relu(x.double(), w.double(), b.double(), ln_weight=lw.double(),
                                                  ln_bias=lb.double())
    assert rel_err(y[~bad], ref64[~bad]) < TOLERANCE[torch.float32]
    # dx: NaN on the rows whose output is NaN, right on the others (rows are independent).
    xg = x.clone().requires_grad_(True)
    (dx,) = torch.autograd.grad(_call(recfuse.ln_tanh_linear_relu, xg, w, b, lw, lb, 0), xg, torch.ones_like(y))
    bad_rows = bad.any(-1)
    assert torch.isnan(dx[bad_rows]).all(-1).all()
    x64 = x.double().requires_grad_(True)
    y64 = recfuse.reference.ln_tanh_linear_relu(x64, w.double(), b.double(), ln_weight=lw.double(), ln_bias=lb.double())
    (dx64,) = torch.autograd.grad(y64, x64, torch.ones_like(y64))
    assert rel_err(dx[~bad_rows], dx64[~bad_rows]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("path", EDGE_PATHS)
def test_constant_huge_row_is_finite_on_the_kernels(path):
    # A constant row of 1e30 has exactly zero variance: its LayerNorm is 0 and y = relu(w @
    # tanh(ln_bias) + b), finite, as float64 gives. torch's float32 CPU layer_norm gives NaN
    # there (its moments overflow); the interpreted kernels, the compiled CPU path and (since
    # red-team round 10: var_mean, not F.layer_norm) the eager composite give the exact value.
    # The GPU's kernels gave NaN until their fp32 statistics were taken about each row's first
    # value (session 10: the approximate fp32 `/` put the mean an ulp off 1e30, and that ulp
    # squared overflowed); NaN is still accepted there, never another finite row.
    _on_path(path)
    F, B, D, H = 2, 3, 5, 2
    x = torch.randn(F, B, D)
    x[1, 1, :] = 1e30
    w, b, lw, lb = (t.float() for t in _params(F, D, H))
    y = _call(recfuse.ln_tanh_linear_relu, x, w, b, lw, lb, 0)
    ref64 = recfuse.reference.ln_tanh_linear_relu(x.double(), w.double(), b.double(), ln_weight=lw.double(),
                                                  ln_bias=lb.double())
    assert torch.isfinite(ref64).all()
    if path == "cuda" and torch.isnan(y[1, 1]).all():
        ok = torch.ones(F, B, dtype=torch.bool)
        ok[1, 1] = False
        assert rel_err(y[ok], ref64[ok]) < TOLERANCE[torch.float32]
        return
    assert rel_err(y, ref64) < TOLERANCE[torch.float32]


# ---------------------------------------------------------------------------------------------
# GPU-only failures the interpreter does not show (found on the H100; the cuda path checks them)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("H", [2, 3, 4, 6])
@pytest.mark.parametrize("D", [5, 12, 32, 64])
def test_row_path_and_small_d_gradients_match_float64(path, H, D):
    """fp32 2 <= H <= 4 with 16-row backward tiles gave dx ~100% off on the H100, and D < 16 with
    H >= 5 (tl.dot with K < 16) failed to compile there."""
    _on_path(path)
    F, B = 3, 37
    w64, b64, lw64, lb64 = _params(F, D, H)
    x64 = torch.randn(B, F, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    gy = torch.randn(B, F, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref_in = [t.clone().requires_grad_(True) for t in (x64, w64, b64, lw64, lb64)]
    g_ref = torch.autograd.grad(_call(recfuse.reference.ln_tanh_linear_relu, *ref_in, 1), ref_in, gy)
    args = [t.float().requires_grad_(True) for t in (x64, w64, b64, lw64, lb64)]
    grads = torch.autograd.grad(_call(recfuse.ln_tanh_linear_relu, *args, 1), args, gy.float())
    _assert_rel_errors(["x", "weight", "bias", "ln_weight", "ln_bias"], grads, g_ref, TOLERANCE[torch.float32], "d")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels on a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D, H", [(32, 4), (48, 3), (256, 2), (256, 4), (512, 4), (64, 8), (160, 6)])
def test_unrolled_small_h_backward_on_the_gpu_matches_float64(D, H, dtype):
    """The per-column backward (`BackwardConfig.unroll_h`) as the GPU compiles it, at short and
    long row tiles the tuner may pick, with padded rows (B=1000) and a shared weight: the broadcast
    sum it stands beside miscompiled at 16-row tiles there, which the interpreter did not show."""
    from recfuse.ops.composite import composite_backward

    F, B = 3, 1000
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, F, D, generator=g).to(dtype)
    w, b, lw, lb = (t.to(dtype) for t in _params(F, D, H, dtype=torch.float32, per_feature=False))
    x64, w64, b64, lw64, lb64 = (t.double() for t in (x, w, b, lw, lb))
    assert batched_ln_tanh_linear_relu(x64, w64, b64, lw64, lb64, 1e-5, 1).abs().sum() > 0
    # relu ties (|z| within rounding of 0): any path's rounding decides the mask there
    z = recfuse.reference.feature_mlp(x64, w64, b64, ln_weight=lw64, ln_bias=lb64, eps=1e-5, feature_dim=1,
                                      out_activation=None)
    gy = torch.randn(B, F, H, generator=g).masked_fill(z.abs() < 1e-3, 0).to(dtype)
    ref = composite_backward(gy.double(), x64, w64, b64, lw64, lb64, 1e-5, 1)
    for block_b in (8, 32):
        forced = lambda D_, H_, dt: configs.heuristic_backward(  # noqa: E731
            D_, H_, dt, use_dot=False, block_b=block_b, num_warps=4, block_k=0, unroll_h=1)
        args = [t.cuda().requires_grad_(True) for t in (x, w, b, lw, lb)]
        with configs.override(backward=forced):
            y = recfuse.ln_tanh_linear_relu(*args[:3], ln_weight=args[3], ln_bias=args[4], feature_dim=1)
            grads = [t.cpu() for t in torch.autograd.grad(y, args, gy.cuda())]
        _assert_rel_errors(["x", "weight", "bias", "ln_weight", "ln_bias"], grads, ref, TOLERANCE[dtype],
                           f"block_b={block_b} d")


def test_configs_avoid_the_gpu_failures():
    from recfuse.ops.configs import heuristic_backward, heuristic_forward

    for D in (1, 5, 7, 8):  # block_d < 16
        for H in (5, 16, 64):
            assert not heuristic_forward(D, H, torch.float32).use_dot
            assert not heuristic_backward(D, H, torch.bfloat16).use_dot
    for D in (8, 16, 32, 64, 256):
        for H in (2, 3, 4):
            # the broadcast-sum path's 16-row fp32 and 32-row bf16 tiles miscompiled on the H100;
            # a tuned entry (an H=1 entry is the nearest for H=2-3) cannot ask for them either
            # (the per-column product, `unroll_h`, is another kernel path: its long tiles are checked
            # on the GPU by test_unrolled_small_h_backward_on_the_gpu_matches_float64)
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for cfg in (heuristic_backward(D, H, dtype, unroll_h=0),
                            heuristic_backward(D, H, dtype, block_b=16, use_dot=False, unroll_h=0),
                            heuristic_backward(D, H, dtype, block_b=32, use_dot=False, unroll_h=0)):
                    assert cfg.use_dot or cfg.block_b <= 8, (D, H, dtype, cfg)
                assert heuristic_backward(D, H, dtype).unroll_h == 1


def test_small_h_never_borrows_an_h1_entry():
    """H = 1 entries are tuned for the row reduction; H = 2-3 borrow only small-H (H = 4) entries."""
    from recfuse.ops import configs

    table = configs.load_table("h100-80gb-hbm3")
    assert table, "the shipped H100 table is missing"
    borrowed = 0
    for kind in ("forward", "backward"):
        for (k, D, H, dtype_name, full_tiles), entry in table.items():
            if k != kind or H != 4:
                continue
            for small_h in (2, 3):
                got = configs._nearest_entry(table, kind, D, small_h, dtype_name, full_tiles)
                h1 = table.get((kind, D, 1, dtype_name, full_tiles))
                assert got is not None and (h1 is None or got is not h1), (kind, D, small_h, dtype_name)
                borrowed += 1
    assert borrowed > 0
    # and with no small-H entry of that width, none at all (the heuristic decides)
    only_h1 = {key: e for key, e in table.items() if key[2] == 1}
    assert configs._nearest_entry(only_h1, "backward", 32, 2, "bfloat16", True) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA kernels")
@pytest.mark.parametrize("per_feature_ln", [False, True])
def test_a_training_step_launches_only_the_ops_kernels(per_feature_ln):
    """Forward: one kernel. Backward of `y.sum()`: the fill of the scalar's gradient (autograd's,
    for the caller's loss), the fused backward and the reduction that writes every parameter
    gradient in its final shape and dtype -- no reshapes, sums over F or casts after it."""
    F, B, D, H = 4, 64, 32, 1
    x = torch.randn(B, F * D, device="cuda").view(B, F, D)
    w = torch.randn(H, D, device="cuda", requires_grad=True)
    b = torch.zeros(H, device="cuda", requires_grad=True)
    shape = (F, D) if per_feature_ln else (D,)
    lw = torch.ones(shape, device="cuda", requires_grad=True)
    lb = torch.zeros(shape, device="cuda", requires_grad=True)

    def kernels(fn):
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return out, names

    fwd = lambda: recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=1)  # noqa: E731
    _, names = kernels(fwd)
    assert len(names) == 1, names

    def step():
        for p in (w, b, lw, lb):
            p.grad = None
        loss = fwd().sum()
        torch.cuda.synchronize()
        loss.backward()

    _, names = kernels(step)
    assert len(names) <= 1 + 1 + 3, names  # forward, the loss's sum, fill + backward + reduction
    assert all(p.grad is not None and p.grad.dtype == p.dtype and p.grad.shape == p.shape for p in (w, b, lw, lb))


def test_a_tuned_whole_row_entry_does_not_hold_back_the_chunked_forward(monkeypatch):
    """A table tuned before D=160 could be chunked holds its padded whole-row config: ignored for
    a D that chunks evenly; a power-of-two D's tuned whole-row entry still stands."""
    whole_row = {"block_b": 32, "num_warps": 4, "use_dot": True, "x_evict": "", "persistent": 0,
                 "tile_stages": 1, "block_k": 0}
    table = {("forward", 160, 16, "float32", False): whole_row, ("forward", 128, 16, "float32", True): whole_row}
    monkeypatch.setattr(configs, "device_slug", lambda device: "fake-gpu")
    # an architecture no shipped table has: the fake table alone (`configs.device_entries`)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(major=1, minor=0, multi_processor_count=1))
    monkeypatch.setattr(configs, "load_table", lambda slug: table)
    configs._cached_forward_config.cache_clear()
    try:
        masked = configs.forward_config(160, 16, torch.float32, 0, full_tiles=False)
        assert (masked.block_k, masked.block_b) == (32, 64)
        full = configs.forward_config(128, 16, torch.float32, 0, full_tiles=True)
        assert (full.block_k, full.block_b) == (0, 32)
    finally:
        configs._cached_forward_config.cache_clear()


def test_a_masked_width_runs_its_own_tuned_backward_entry(monkeypatch):
    """The tuner files D=160 (not a power of two) under full_tiles=False; the backward looked up
    full-tile entries only, so D=160 ran D=256's tiles and its own tuned entry was never used.
    A width with no masked entry of its class still borrows the full-tile one where the heuristic
    does not chunk."""
    own = {"block_b": 64, "num_warps": 4, "use_dot": True, "x_evict": "", "programs_per_sm": 16, "num_stages": 1,
           "block_k": 32}
    pow2 = {"block_b": 16, "num_warps": 8, "use_dot": True, "x_evict": "", "programs_per_sm": 4, "num_stages": 2,
            "block_k": 64}
    table = {("backward", 160, 64, "float32", False): own, ("backward", 256, 64, "float32", True): pow2}
    monkeypatch.setattr(configs, "device_slug", lambda device: "fake-gpu")
    # an architecture no shipped table has: the fake table alone (`configs.device_entries`)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(major=1, minor=0, multi_processor_count=1))
    monkeypatch.setattr(configs, "load_table", lambda slug: table)
    configs._cached_backward_config.cache_clear()
    try:
        cfg = configs.backward_config(160, 64, torch.float32, 0)
        assert (cfg.block_b, cfg.num_warps, cfg.programs_per_sm, cfg.block_k) == (64, 4, 16, 32)
        cfg = configs.backward_config(200, 64, torch.float32, 0)  # nearest masked entry of its BLOCK_D
        assert configs.heuristic_backward(200, 64, torch.float32).block_k == 0  # (no chunks: may borrow)
        assert (cfg.block_b, cfg.block_k) == (64, 32)
        cfg = configs.backward_config(256, 64, torch.float32, 0)
        assert (cfg.block_b, cfg.num_warps, cfg.programs_per_sm, cfg.block_k) == (16, 8, 4, 64)
        # where the heuristic takes the GEMM backward (fp32 D=512 H=64), a neighbour's entry does not
        # replace it; the shape's own entry (D=256 above) does
        assert configs.heuristic_backward(512, 64, torch.float32).gemm
        assert configs.backward_config(512, 64, torch.float32, 0) == configs.heuristic_backward(512, 64, torch.float32)
        del table[("backward", 160, 64, "float32", False)]
        configs._cached_backward_config.cache_clear()
        # none of its own: not D=256's either (the heuristic chunks D=160 H=64)
        assert configs.backward_config(160, 64, torch.float32, 0) == configs.heuristic_backward(160, 64, torch.float32)
        table[("backward", 256, 4, "float32", True)] = dict(pow2, use_dot=False, block_b=4, block_k=0)
        configs._cached_backward_config.cache_clear()
        cfg = configs.backward_config(160, 4, torch.float32, 0)  # where it does not chunk: borrowed
        assert (cfg.block_b, cfg.num_warps, cfg.programs_per_sm) == (4, 8, 4)
    finally:
        configs._cached_backward_config.cache_clear()
