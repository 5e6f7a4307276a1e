"""Fusions as plugins: a fusion registered from outside the package, as a user would write it;
enabling and disabling fusions by name; what `explain` says about each."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from recfuse.fx import Claim, Decline, Fusion, register_fusion, unregister_fusion
from recfuse.puzzler import SplitStack

from fx_cases import count_layer_norm, count_recfuse


def tanh_relu(x: torch.Tensor) -> torch.Tensor:
    """The user's batched kernel (here plain torch): relu(tanh(x)) over all features at once."""
    return torch.relu(torch.tanh(x))


class TanhRelu(Fusion):
    """A user's fusion: per-slice tanh -> relu chains become one call of `tanh_relu`."""

    name = "tanh_relu"
    title = "tanh-relu fusion"

    def match(self, plan, analysis):
        if plan.kinds != ("tanh", "relu"):
            return Decline(f"the chain is {plan.ops_text()}, not tanh -> relu")
        if plan.side_uses:
            return Decline("a per-slice value is also used elsewhere")
        return Claim()

    def fuse(self, plan, claim, rw):
        out = rw.fn(tanh_relu, [rw.batched_input(plan.layout)])
        rw.finish(out)
        return "1 tanh_relu call"


class PerFeatureTanhRelu(nn.Module):
    def __init__(self, D=8):
        super().__init__()
        self.D = D

    def forward(self, x):
        return torch.stack([torch.relu(torch.tanh(s)) for s in x.split(self.D, 1)], 1)


class Both(nn.Module):
    """One group for the toy fusion and one for the built-in vertical fusion."""

    def __init__(self, F_=3, D=8, H=2):
        super().__init__()
        self.D = D
        self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(F_)])
        self.lin = nn.Linear(D, H)

    def forward(self, x, z):
        a = torch.stack([torch.relu(torch.tanh(s)) for s in z.split(self.D, 1)], 1)
        b = F.relu(self.lin(torch.stack([torch.tanh(ln(s)) for ln, s in zip(self.lns, x.split(self.D, 1))], 1)))
        return a.sum() + b.sum(), a, b


@pytest.fixture
def toy_fusion():
    fusion = TanhRelu()
    register_fusion(fusion, before="horizontal_chain")
    try:
        yield fusion
    finally:
        unregister_fusion(fusion.name)


def _calls(gm, fn) -> int:
    return sum(n.op == "call_function" and n.target is fn for n in gm.graph.nodes)


def _close(a, b):
    for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def test_a_fusion_registered_from_outside_is_applied(toy_fusion):
    m = Both()
    x, z = torch.randn(5, 24), torch.randn(5, 24)
    gm = recfuse.transform(m, (x, z))
    assert _calls(gm, tanh_relu) == 1 and count_recfuse(gm) == 1
    assert not any(n.target in (torch.tanh, torch.relu) for n in gm.graph.nodes)
    report = recfuse.explain(m, (x, z))
    by_fusion = {g.fusion: g for g in report.groups}
    assert set(by_fusion) == {"tanh_relu", "vertical_ln_tanh_linear_relu"}
    assert by_fusion["tanh_relu"].replaced_by == "1 tanh_relu call"
    text = str(report)
    assert "claimed by tanh_relu" in text
    # the vertical fusion was asked first and said why not
    assert "vertical fusion skipped (vertical_ln_tanh_linear_relu): the chain is tanh -> relu" in text
    x2, z2 = torch.randn(7, 24), torch.randn(7, 24)
    with torch.no_grad():
        _close(gm(x2, z2), m(x2, z2))


def test_a_registered_fusion_can_be_disabled_by_name(toy_fusion):
    m = PerFeatureTanhRelu()
    x = torch.randn(3, 32)
    enabled = ["vertical_ln_tanh_linear_relu", "vertical_feature_mlp", "horizontal_chain"]
    gm = recfuse.transform(m, (x,), fusions=enabled)
    assert _calls(gm, tanh_relu) == 0
    report = recfuse.explain(m, (x,), fusions=enabled)
    assert [g.fusion for g in report.groups] == ["horizontal_chain"]
    assert report.disabled == ["tanh_relu"] and "disabled: tanh_relu" in str(report)
    x2 = torch.randn(6, 32)
    _close(gm(x2), m(x2))


def test_disabling_the_vertical_fusion_leaves_the_batched_chain():
    m = SplitStack(8)
    x = torch.randn(4 * 3 * 8)
    gm = recfuse.transform(m, (x, 4, 8), fusions=["horizontal_chain"])
    assert count_recfuse(gm) == 0 and count_layer_norm(gm) == 1
    report = gm.recfuse_report
    assert report.groups[0].fusion == "horizontal_chain" and report.groups[0].mode == "horizontal"
    assert "disabled: vertical_ln_tanh_linear_relu, vertical_feature_mlp" in str(report)
    x2 = torch.randn(4 * 3 * 8)
    _close(gm(x2, 4, 8), m(x2, 4, 8))


def test_no_fusion_enabled_leaves_the_graph_and_says_why():
    m = SplitStack(8)
    x = torch.randn(4 * 3 * 8)
    gm = recfuse.transform(m, (x, 4, 8), fusions=[])
    assert count_recfuse(gm) == 0 and count_layer_norm(gm) == 3
    text = str(gm.recfuse_report)
    assert "no fusion is enabled" in text and "left per slice" in text
    _close(gm(x, 4, 8), m(x, 4, 8))


def test_a_group_every_enabled_fusion_declines_is_a_near_miss(toy_fusion):
    m = SplitStack(8)
    x = torch.randn(4 * 3 * 8)
    report = recfuse.explain(m, (x, 4, 8), fusions=["tanh_relu"])
    assert not report.groups
    assert "tanh-relu fusion skipped (tanh_relu): the chain is layer_norm -> tanh, not tanh -> relu" in str(report)


@pytest.mark.parametrize("call", [recfuse.transform, recfuse.explain])
def test_an_unknown_fusion_name_is_a_value_error_naming_the_known_ones(call):
    m = SplitStack(8)
    with pytest.raises(ValueError) as e:
        call(m, (torch.randn(96), 4, 8), fusions=["vertical", "horizontal_chain"])
    msg = str(e.value)
    assert "'vertical'" in msg and "fusions" in msg
    assert "'vertical_ln_tanh_linear_relu'" in msg and "'horizontal_chain'" in msg


def test_fusions_must_be_a_list_of_names():
    with pytest.raises(TypeError, match="list of fusion names"):
        recfuse.transform(SplitStack(8), (torch.randn(96), 4, 8), fusions="horizontal_chain")


def test_registering_a_taken_name_or_a_non_fusion_fails():
    class Again(Fusion):
        name = "horizontal_chain"

    with pytest.raises(ValueError, match="registered already"):
        register_fusion(Again())
    with pytest.raises(TypeError):
        register_fusion(object())
    with pytest.raises(ValueError, match="unknown fusion 'nope'"):
        register_fusion(TanhRelu(), before="nope")
    assert [f.name for f in recfuse.fx.FUSIONS] == ["vertical_ln_tanh_linear_relu", "vertical_feature_mlp",
                                                    "horizontal_chain"]


def test_a_match_that_returns_something_else_is_a_type_error():
    class Sloppy(Fusion):
        name = "sloppy"

        def match(self, plan, analysis):
            return True

    register_fusion(Sloppy(), first=True)
    try:
        with pytest.raises(TypeError, match="'sloppy': match returned bool"):
            recfuse.transform(SplitStack(8), (torch.randn(96), 4, 8))
    finally:
        unregister_fusion("sloppy")
