"""The fused op on its CPU composite path: numbers, errors, and how fx/compile/export see it."""
import math

import pytest
import torch

import recfuse
from op_cases import TOLERANCE, Case, check_against_float64, check_nan_parity, make_inputs, rel_err, run_op

CASES = [
    Case(4, 6, 16, 1),
    Case(3, 5, 7, 3, feature_dim=1, per_feature_weight=True, bias="per_feature"),
    Case(1, 1, 1, 1, bias="shared", ln="shared"),
    Case(1, 4, 100, 2, ln="shared", eps=0.0),
    Case(2, 3, 7, 16, feature_dim=1, strided_view=True, ln="none", bias="none"),
    Case(5, 1, 9, 4, per_feature_weight=True, ln="per_feature", eps=0.0),
    Case(16, 8, 33, 1, feature_dim=1, strided_view=True, eps=0.0, ln="none"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64_reference(case, dtype):
    check_against_float64(case, dtype)


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_float64_equals_per_slice_reference(case):
    tensors = make_inputs(case)
    y_ref, g_ref = run_op(recfuse.reference.ln_tanh_linear_relu, tensors, torch.float64, case)
    y, g = run_op(recfuse.ln_tanh_linear_relu, tensors, torch.float64, case)
    for a, b in zip([y] + g, [y_ref] + g_ref):
        assert rel_err(a, b) < 1e-12


def test_gradcheck_float64():
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    lw = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    lb = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: recfuse.ln_tanh_linear_relu(a[0], a[1], a[2], ln_weight=a[3], ln_bias=a[4], feature_dim=1),
        (x, w, b, lw, lb),
    )


def test_nan_exactly_where_pytorch_gives_nan():
    y = check_nan_parity((3, 4, 8), (1, 2))
    assert torch.isnan(y[1, 2]).all() and not torch.isnan(y[0]).any()


def test_empty_batch_returns_empty_with_gradients():
    x = torch.randn(3, 0, 8, requires_grad=True)
    w = torch.randn(2, 8, requires_grad=True)
    y = recfuse.ln_tanh_linear_relu(x, w)
    assert y.shape == (3, 0, 2)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


def test_strided_view_is_not_copied():
    buf = torch.randn(4, 3 * 8)
    x = buf.view(4, 3, 8)
    assert x.data_ptr() == buf.data_ptr()
    y = recfuse.ln_tanh_linear_relu(x, torch.randn(1, 8), feature_dim=1)
    assert y.shape == (4, 3, 1)


def _args():
    return torch.randn(3, 4, 8), torch.randn(2, 8)


@pytest.mark.parametrize(
    "mutate, exc, fragment",
    [
        (lambda a: a.update(x=torch.randn(12, 8)), ValueError, "x must be 3D"),
        (lambda a: a.update(x=torch.randint(0, 3, (3, 4, 8))), TypeError, "x must be a floating"),
        (lambda a: a.update(weight=torch.randn(2, 7)), ValueError, "weight must be [H, D=8]"),
        (lambda a: a.update(weight=torch.randn(5, 2, 8)), ValueError, "weight must be [F=3, H, D=8]"),
        (lambda a: a.update(weight=torch.randn(2)), ValueError, "weight must be 2D"),
        (lambda a: a.update(bias=torch.randn(3)), ValueError, "bias must be [H=2] or [F=3, H=2]"),
        (lambda a: a.update(ln_weight=torch.randn(4, 8)), ValueError, "ln_weight must be [D=8] or [F=3, D=8]"),
        (lambda a: a.update(ln_bias=torch.randn(9)), ValueError, "ln_bias must be [D=8]"),
        (lambda a: a.update(weight=torch.randn(2, 8, dtype=torch.float64)), TypeError, "weight has dtype torch.float64"),
        (lambda a: a.update(bias=torch.randn(2, device="meta")), ValueError, "bias is on meta"),
        (lambda a: a.update(eps=-1.0), ValueError, "eps must be a float >= 0"),
        (lambda a: a.update(feature_dim=2), ValueError, "feature_dim must be 0"),
        (lambda a: a.update(x=torch.randn(3, 4, 0)), ValueError, "D >= 1"),
    ],
)
def test_bad_input_raises_naming_the_argument(mutate, exc, fragment):
    x, w = _args()
    kwargs = dict(x=x, weight=w, bias=None, ln_weight=None, ln_bias=None, eps=1e-5, feature_dim=0)
    mutate(kwargs)
    for fn in (recfuse.ln_tanh_linear_relu, recfuse.reference.ln_tanh_linear_relu):
        with pytest.raises(exc) as info:
            fn(kwargs["x"], kwargs["weight"], kwargs["bias"],
               ln_weight=kwargs["ln_weight"], ln_bias=kwargs["ln_bias"], eps=kwargs["eps"],
               feature_dim=kwargs["feature_dim"])
        assert fragment in str(info.value)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 8))
        self.lw = torch.nn.Parameter(torch.ones(3, 8))

    def forward(self, x):
        return recfuse.ln_tanh_linear_relu(x, self.w, ln_weight=self.lw, feature_dim=1)


def test_symbolic_trace_gives_one_op_node():
    gm = torch.fx.symbolic_trace(_Model())
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [torch.ops.recfuse.ln_tanh_linear_relu]
    x = torch.randn(4, 3, 8)
    assert rel_err(gm(x), _Model.forward(gm, x)) < 1e-6


def test_torch_compile_fullgraph_forward_and_backward():
    m = _Model()
    x = torch.randn(4, 3, 8, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y_ref = recfuse.reference.ln_tanh_linear_relu(x.double(), m.w.double(), ln_weight=m.lw.double(), feature_dim=1)
    assert rel_err(y, y_ref) < TOLERANCE[torch.float32]
    y.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    m(x).sum().backward()
    assert rel_err(gx, x.grad) < 1e-6


def test_torch_compile_inductor_runs():
    m = _Model()
    x = torch.randn(4, 3, 8)
    y = torch.compile(m, fullgraph=True)(x)
    assert rel_err(y, m(x)) < 1e-6


def test_torch_export_keeps_the_op():
    ep = torch.export.export(_Model(), (torch.randn(4, 3, 8),))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.recfuse.ln_tanh_linear_relu.default in targets
    m = _Model()
    ep = torch.export.export(m, (torch.randn(4, 3, 8),))
    x = torch.randn(4, 3, 8)
    y_ref = recfuse.reference.ln_tanh_linear_relu(x, m.w, ln_weight=m.lw, feature_dim=1)
    assert rel_err(ep.module()(x), y_ref) < 1e-6


def test_opcheck_schema_fake_and_autograd():
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    lb = torch.randn(8, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.recfuse.ln_tanh_linear_relu.default, (x, w, None, None, lb, 1e-5, 0))


def test_eps_changes_result_as_layer_norm_does():
    x, w = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)
    for eps in (0.0, 1e-5, 0.5, 3):
        y = recfuse.ln_tanh_linear_relu(x, w, eps=eps)
        ref = torch.relu(torch.tanh(torch.nn.functional.layer_norm(x, (8,), eps=float(eps))) @ w.t())
        assert rel_err(y, ref) < 1e-12, eps
    assert not math.isclose(recfuse.ln_tanh_linear_relu(x, w, eps=0.5).sum().item(),
                            recfuse.ln_tanh_linear_relu(x, w, eps=0.0).sum().item())


def test_eager_path_and_custom_op_path_agree():
    # Plain eager calls skip the custom-op dispatcher; both must compute the same thing.
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    lb = torch.randn(8, dtype=torch.float64, requires_grad=True)
    y1 = recfuse.ln_tanh_linear_relu(x, w, ln_bias=lb)
    g1 = torch.autograd.grad(y1.sum(), (x, w, lb))
    y2 = torch.ops.recfuse.ln_tanh_linear_relu(x, w, None, None, lb, 1e-5, 0)
    g2 = torch.autograd.grad(y2.sum(), (x, w, lb))
    assert torch.equal(y1, y2)
    for a, b in zip(g1, g2):
        assert rel_err(a, b) < 1e-12


def test_grad_of_a_permuted_view_keeps_its_strides():
    # [B, F*D] -> [F, B, D] view: dx in the view's strides lets autograd hand the base's gradient
    # over without a copy of x's size (the graph pass feeds the op exactly this view).
    B, F, D = 5, 3, 8
    base = torch.randn(B, F * D, requires_grad=True)
    xv = base.view(B, F, D).transpose(0, 1)
    w = torch.randn(2, D)
    y = recfuse.ln_tanh_linear_relu(xv, w, feature_dim=0)
    (gx,) = torch.autograd.grad(y, xv, torch.ones_like(y))
    assert gx.stride() == xv.stride()
    xr = base.detach().double().view(B, F, D).transpose(0, 1).requires_grad_(True)
    yr = recfuse.reference.ln_tanh_linear_relu(xr, w.double(), feature_dim=0)
    (gr,) = torch.autograd.grad(yr, xr, torch.ones_like(yr))
    torch.testing.assert_close(gx.double(), gr, rtol=1e-5, atol=1e-6)
