"""The graph pass on the op family's other chains: [LayerNorm|RMSNorm] -> [activation] -> Linear ->
[activation] per feature becomes one `recfuse.feature_mlp` node (fusion `vertical_feature_mlp`),
in every spelling; chains the op does not have stay batched, and `explain` says why.

Each fused spelling runs the differential fuzzer's full set of checks (tests/test_transform_fuzz.py:
forward and input gradients in train and eval mode, an SGD step, state_dict keys, loading the
original's state_dict, save/load, deepcopy, transform of the transform) against the untouched
original, plus the report and node checks here.
"""
from __future__ import annotations

import copy
import functools
import io
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import recfuse  # noqa: E402
from recfuse.ops import feature_mlp  # noqa: E402

from fuzz_models import Spec, build  # noqa: E402
from fx_cases import assert_equivalent, count_recfuse  # noqa: E402
from test_transform_fuzz import Case, assert_case  # noqa: E402


def count_feature_mlp(gm) -> int:
    return sum(n.op == "call_function" and (n.target is feature_mlp or n.target in (
        torch.ops.recfuse.feature_mlp, torch.ops.recfuse.feature_mlp.default)) for n in gm.graph.nodes)


def _spec(seed, **kw) -> Spec:
    base = dict(F=3, D=8, H=2, B=3, B_fresh=4, split="torch.split", sink="stack1", features=("chain",))
    base.update(kw)
    return Spec(seed, **base)


# (id, spec, the chain the fused node runs, weight text)
FUSED = [
    ("rms_module_eps_none_silu_per_feature_linear",
     _spec(1, norm="rms_norm", rms_eps=None, act="silu", lin="per_feature", relu=False),
     "rms_norm -> silu -> linear", "weight per feature"),
    ("rms_functional_eps_gelu_tanh_module_linear_after_sigmoid",
     _spec(2, norm="rms_norm", ln="functional", affine=False, rms_eps=1e-6, act="gelu_tanh",
           act_spelling="module", lin="after", out_act="sigmoid"),
     "rms_norm -> gelu_tanh -> linear -> sigmoid", "weight shared"),
    ("rms_shared_eps_big_relu_method_shared_linear_gelu_cat",
     _spec(3, norm="rms_norm", ln="shared", rms_eps=0.1, act="relu", act_spelling="method", lin="shared",
           out_act="gelu", sink="cat_view", split="slicing"),
     "rms_norm -> relu -> linear -> gelu", "weight shared"),
    ("layer_norm_no_affine_sigmoid_method_linear_after_silu",
     _spec(4, ln="module", affine=False, act="sigmoid", act_spelling="method", lin="after", out_act="silu",
           sink="stack0"),
     "layer_norm -> sigmoid -> linear -> silu", "weight shared"),
    ("layer_norm_functional_gelu_erf_module_per_feature_no_out",
     _spec(5, ln="functional", affine=False, eps=0.0, act="gelu", act_spelling="module", lin="per_feature",
           relu=False, split="unbind_view"),
     "layer_norm -> gelu -> linear", "weight per feature"),
    ("layer_norm_tanh_linear_no_out_activation",
     _spec(6, ln="module", lin="per_feature", bias=False, relu=False),
     "layer_norm -> tanh -> linear", "weight per feature"),
    ("linear_relu_alone",
     _spec(7, norm="none", tanh="none", lin="per_feature", split="tensor_split"),
     "linear -> relu", "weight per feature"),
    ("silu_module_linear_tanh_out",
     _spec(8, norm="none", act="silu", act_spelling="module", lin="shared", out_act="tanh"),
     "silu -> linear -> tanh", "weight shared"),
    ("linear_alone",
     _spec(9, norm="none", tanh="none", lin="per_feature", relu=False, sink="stack0"),
     "linear", "weight per feature"),
    ("rms_frozen_feature_keeps_requires_grad",
     _spec(10, norm="rms_norm", rms_eps=None, act="silu", lin="per_feature", frozen="lin", frozen_index=1,
           out_act="sigmoid", features=("chain", "frozen")),
     "rms_norm -> silu -> linear -> sigmoid", "weight per feature"),
]


@pytest.mark.parametrize("spec,chain,weight", [c[1:] for c in FUSED], ids=[c[0] for c in FUSED])
def test_chain_is_fused_into_one_feature_mlp_node_and_equals_the_original(spec, chain, weight):
    case = Case(spec)
    orig, _, gm, example = case.pair()
    report = gm.recfuse_report
    assert [g.fusion for g in report.groups] == ["vertical_feature_mlp"], str(report)
    g = report.groups[0]
    assert g.mode == "vertical" and g.ops == chain.replace("gelu_tanh", "gelu")  # ops: the graph's op kinds
    assert g.replaced_by.startswith(f"1 recfuse.feature_mlp node ({chain}, feature_dim="), g.replaced_by
    assert weight in g.replaced_by
    if spec.norm == "rms_norm":
        want = "eps=None (F.rms_norm's default for the input's dtype, at run time)" if spec.rms_eps is None else "eps="
        assert want in g.replaced_by
    text = str(report)
    assert "claimed by vertical_feature_mlp" in text
    assert (f"vertical fusion skipped (vertical_ln_tanh_linear_relu): the chain is {chain}, not "
            f"layer_norm -> tanh -> linear -> relu") in text
    assert count_feature_mlp(gm) == 1 and count_recfuse(gm) == 0
    # no per-slice or batched norm / activation / linear is left
    left = [n for n in gm.graph.nodes if n.op == "call_module" or n.target in (
        F.linear, F.layer_norm, F.rms_norm, torch.tanh, torch.sigmoid, torch.relu, F.relu, F.gelu, F.silu,
        "tanh", "sigmoid", "relu")]
    assert not left, [n.format_node() for n in left]
    # every check of the differential fuzzer against the untouched original
    assert_case(spec)


def test_the_default_chain_still_takes_ln_tanh_linear_relu():
    case = Case(_spec(11, ln="module", lin="per_feature"))
    _, _, gm, _ = case.pair()
    assert [g.fusion for g in gm.recfuse_report.groups] == ["vertical_ln_tanh_linear_relu"]
    assert count_recfuse(gm) == 1 and count_feature_mlp(gm) == 0


# ---------------------------------------------------------------------------------------------
# RMSNorm's eps=None is the dtype's epsilon at run time, not the example's


class RmsChain(nn.Module):
    def __init__(self, eps=None, functional=False, F_=3, D=8, H=2):
        super().__init__()
        self.D, self.eps, self.functional = D, eps, functional
        self.norms = nn.ModuleList([nn.RMSNorm(D, eps=eps) for _ in range(F_)])
        self.lins = nn.ModuleList([nn.Linear(D, H) for _ in range(F_)])
        with torch.no_grad():
            for n in self.norms:
                n.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        outs = []
        for n, lin, s in zip(self.norms, self.lins, x.split(self.D, 1)):
            h = F.rms_norm(s, (self.D,), n.weight, self.eps) if self.functional else n(s)
            outs.append(F.gelu(lin(torch.sigmoid(h)), approximate="tanh"))
        return torch.stack(outs, 1)


@pytest.mark.parametrize("functional", [False, True])
def test_rms_eps_none_follows_the_dtype_after_transform(functional):
    m = RmsChain(None, functional)
    gm = recfuse.transform(m, (torch.randn(3, 24),))
    assert count_feature_mlp(gm) == 1
    # small inputs: mean(x^2) ~ 1e-6, where float32's eps (1.2e-7) and float64's (2.2e-16) differ
    x = torch.randn(5, 24, dtype=torch.float64) * 1e-3
    m64, gm64 = copy.deepcopy(m).double(), copy.deepcopy(gm).double()
    want, got = m64(x), gm64(x)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-13)
    # baking float32's eps in would be visibly off
    baked = recfuse.reference.feature_mlp(
        x.view(5, 3, 8), torch.stack([lin.weight for lin in m64.lins]), torch.stack([lin.bias for lin in m64.lins]),
        norm="rms_norm", ln_weight=torch.stack([n.weight for n in m64.norms]), eps=torch.finfo(torch.float32).eps,
        activation="sigmoid", out_activation="gelu_tanh", feature_dim=1)
    assert not torch.allclose(baked, want, rtol=1e-6, atol=0)
    # bfloat16 after the transform: F.rms_norm(eps=None) then uses float32's eps (its compute
    # type's), not bfloat16's 2^-7, which would be comparable to mean(x^2) here
    mb, gmb = copy.deepcopy(m).bfloat16(), copy.deepcopy(gm).bfloat16()
    xb = (torch.randn(5, 24) * 0.05).bfloat16()
    with torch.no_grad():
        want, got = mb(xb).double(), gmb(xb).double()
    assert float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_dtype_eps_is_what_rms_norm_uses_for_eps_none(dtype):
    from recfuse.fx.rules.vertical_base import dtype_eps

    x = (torch.randn(16, 8) * 0.02).to(dtype)
    assert torch.equal(F.rms_norm(x, (8,), None, None), F.rms_norm(x, (8,), None, dtype_eps(x)))


def test_rms_eps_none_survives_save_load_and_retransform():
    m = RmsChain(None)
    gm = recfuse.transform(m, (torch.randn(3, 24),))
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    gm2 = torch.load(buf, weights_only=False)
    gm3 = recfuse.transform(gm, (torch.randn(3, 24),))
    x = torch.randn(4, 24, dtype=torch.float64) * 1e-3
    want = copy.deepcopy(m).double()(x)
    for g in (gm2, gm3):
        assert torch.allclose(copy.deepcopy(g).double()(x), want, rtol=1e-10, atol=1e-13)


def test_explicit_rms_eps_is_used():
    m = RmsChain(0.25, functional=True)
    gm = recfuse.transform(m, (torch.randn(3, 24),))
    assert "eps=0.25" in gm.recfuse_report.groups[0].replaced_by
    assert_equivalent(m, gm, (torch.randn(5, 24),))


# ---------------------------------------------------------------------------------------------
# bfloat16


BF16 = [FUSED[0][1], FUSED[1][1], FUSED[3][1], FUSED[6][1]]


@pytest.mark.parametrize("spec", BF16, ids=[c[0] for c in FUSED if c[1] in BF16])
def test_bfloat16_chain_against_the_original_and_float64(spec):
    m = build(spec).bfloat16()
    gen = torch.Generator().manual_seed(3)
    gm = recfuse.transform(m, (torch.randn(3, spec.F * spec.D, generator=gen).bfloat16(),))
    assert count_feature_mlp(gm) == 1
    x = torch.randn(6, spec.F * spec.D, generator=gen)
    m64 = copy.deepcopy(m).double()
    x64 = x.double().requires_grad_()
    ref = m64(x64)
    cot = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (gref,) = torch.autograd.grad(ref, x64, cot)
    errs = {}
    for name, model in (("fused", gm), ("orig", m)):
        xb = x.bfloat16().requires_grad_()
        y = model(xb)
        (g,) = torch.autograd.grad(y, xb, cot.bfloat16())
        errs[name] = (float((y.double() - ref).norm() / ref.norm()), float((g.double() - gref).norm() / gref.norm()))
    assert errs["fused"][0] < 1e-2, errs
    assert errs["fused"][1] <= max(2 * errs["orig"][1], 2e-2), errs


# ---------------------------------------------------------------------------------------------
# declined: stays horizontally batched, the report says why, the numbers are the original's


DECLINED = [
    ("leaky_relu", _spec(20, act="leaky_relu", lin="per_feature"),
     "activation leaky_relu(negative_slope=0.2) is not one recfuse.feature_mlp has"),
    ("leaky_relu_out", _spec(21, norm="rms_norm", act="silu", lin="per_feature", out_act="leaky_relu"),
     "activation leaky_relu(negative_slope=0.2) is not one recfuse.feature_mlp has"),
    ("softplus_act", _spec(22, norm="none", act="softplus", lin="shared"),
     "activation softplus(beta=1.0, threshold=20.0) is not one recfuse.feature_mlp has"),
    ("no_linear", _spec(23, norm="rms_norm", act="silu", lin="none", relu=False),
     "the chain is rms_norm -> silu, with no linear"),
]


@pytest.mark.parametrize("spec,reason", [c[1:] for c in DECLINED], ids=[c[0] for c in DECLINED])
def test_chain_the_op_lacks_stays_batched_with_the_reason(spec, reason):
    case = Case(spec)
    _, _, gm, _ = case.pair()
    report = gm.recfuse_report
    assert [g.fusion for g in report.groups] == ["horizontal_chain"], str(report)
    assert count_feature_mlp(gm) == 0 and count_recfuse(gm) == 0
    assert f"vertical fusion skipped (vertical_feature_mlp): {reason}" in str(report)
    assert_case(spec)


class TwoLinears(nn.Module):
    def __init__(self, F_=3, D=8, H=4):
        super().__init__()
        self.D = D
        self.a = nn.ModuleList([nn.Linear(D, H) for _ in range(F_)])
        self.b = nn.ModuleList([nn.Linear(H, 2) for _ in range(F_)])

    def forward(self, x):
        return torch.stack([F.silu(b(torch.tanh(a(s)))) for a, b, s in zip(self.a, self.b, x.split(self.D, 1))], 1)


class NormOverTwoDims(nn.Module):
    """Per feature: a norm over the slice's last two dims (2, D), an activation, a shared Linear and
    an optional out-activation. x [B, F, 2, D]."""

    def __init__(self, norm=nn.RMSNorm, act=F.silu, out_act=None, F_=3, D=4):
        super().__init__()
        self.norms = nn.ModuleList([norm((2, D)) for _ in range(F_)])
        self.lin = nn.Linear(D, 2)
        self.act, self.out_act = act, out_act

    def forward(self, x):
        outs = [self.lin(self.act(n(s))) for n, s in zip(self.norms, x.unbind(1))]
        return torch.stack([o if self.out_act is None else self.out_act(o) for o in outs], 1)


@pytest.mark.parametrize("model,x,reason", [
    (TwoLinears, (5, 24), "the chain is linear -> tanh -> linear -> silu, not [layer_norm|rms_norm] -> [activation] "
                          "-> linear -> [activation] (it goes on after tanh)"),
    (NormOverTwoDims, (5, 3, 2, 4), "the chain is rms_norm -> silu -> linear on 3D slices, not on [rows, D] slices"),
    (functools.partial(NormOverTwoDims, nn.LayerNorm, torch.tanh, torch.relu), (5, 3, 2, 4),
     "the chain is layer_norm -> tanh -> linear -> relu on 3D slices"),
], ids=["two_linears", "rms_norm_over_2_dims", "layer_norm_over_2_dims"])
def test_declined_structures_keep_the_original_numbers(model, x, reason):
    m = model()
    gm = recfuse.transform(m, (torch.randn(*x),))
    report = gm.recfuse_report
    assert [g.fusion for g in report.groups] == ["horizontal_chain"], str(report)
    assert count_feature_mlp(gm) == 0 and count_recfuse(gm) == 0
    assert f"(vertical_feature_mlp): {reason}" in str(report), str(report)
    assert_equivalent(m, gm, (torch.randn(*x),))


class MixedDtype(nn.Module):
    """bfloat16 slices, float32 LayerNorm affine (PyTorch's mixed-dtype layer_norm)."""

    def __init__(self, F_=3, D=8):
        super().__init__()
        self.D = D
        self.norm = nn.LayerNorm(D)
        self.lins = nn.ModuleList([nn.Linear(D, 2).bfloat16() for _ in range(F_)])

    def forward(self, x):
        return torch.stack([F.silu(lin(self.norm(s))) for lin, s in zip(self.lins, x.split(self.D, 1))], 1)


def test_parameter_dtype_other_than_the_slices_is_declined():
    m = MixedDtype()
    x = torch.randn(4, 24).bfloat16()
    try:
        want = m(x)
    except RuntimeError:
        pytest.skip("this torch has no mixed-dtype layer_norm")
    gm = recfuse.transform(m, (x,))
    text = str(gm.recfuse_report)
    assert count_feature_mlp(gm) == 0 and gm.recfuse_report.groups[0].fusion == "horizontal_chain"
    assert "layer_norm weight has dtype torch.float32 but the slices are torch.bfloat16" in text
    torch.testing.assert_close(gm(x), want, rtol=2e-2, atol=2e-3)  # bfloat16 rounding of the batched matmul


# ---------------------------------------------------------------------------------------------
# the Triton kernels themselves (interpreter)


@pytest.mark.interpret
@pytest.mark.parametrize("spec", [FUSED[0][1], FUSED[1][1], FUSED[6][1]], ids=[FUSED[i][0] for i in (0, 1, 6)])
def test_fused_chain_under_the_interpreter(spec):
    m = build(spec)
    gen = torch.Generator().manual_seed(4)
    gm = recfuse.transform(m, (torch.randn(3, spec.F * spec.D, generator=gen),))
    assert count_feature_mlp(gm) == 1
    assert_equivalent(m, gm, (torch.randn(5, spec.F * spec.D, generator=gen),), tol=1e-5)
