"""Corpus of per-feature model variants for `recfuse.transform` / `recfuse.explain`.

Each case checks, on FRESH inputs (another batch size than the example), that outputs, input
gradients and parameter gradients equal the untransformed model run in float64, and that the
expected number of groups was fused (recfuse op nodes and remaining layer_norm nodes).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from recfuse.puzzler import SplitStack, split_stack

from fx_cases import PerFeature, assert_equivalent, count_layer_norm, count_recfuse

# (kwargs of PerFeature, expected recfuse nodes, expected layer_norm nodes)
CORPUS = [
    (dict(source="split_int"), 1, 0),
    (dict(source="split_list", tail="per_slice"), 1, 0),
    (dict(source="chunk", tail="shared_in_chain", stack_dim=1), 1, 0),
    (dict(source="tensor_split", tail="none"), 0, 1),
    (dict(source="index", ln="functional", affine=False, eps=0.0), 1, 0),
    (dict(source="narrow", ln="dict", tail="none", stack_dim=2), 0, 1),
    (dict(source="unbind", ln="shared", stack_dim=1), 1, 0),
    (dict(source="unbind", tail="none", act="method"), 0, 1),
    (dict(source="rows", tail="per_slice"), 1, 0),
    (dict(source="dict", ln="dict"), 1, 0),
    (dict(source="dict", tail="none", order=[2, 0, 1]), 0, 1),
    (dict(order=[2, 0, 1], F_=3), 1, 0),
    (dict(order=[3, 2, 1, 0], F_=4, tail="none", stack_dim=1), 0, 1),
    (dict(sink="cat_view"), 1, 0),
    (dict(sink="cat_view", tail="none", source="chunk"), 0, 1),
    (dict(F_=2, D=16, H=1, stack_dim=-1, tail="per_slice"), 1, 0),
    (dict(F_=6, D=4, H=3, eps=0.1), 1, 0),
]


def _ids(case):
    return "-".join(f"{k}={v}" for k, v in case[0].items())


@pytest.mark.parametrize("case", CORPUS, ids=[_ids(c) for c in CORPUS])
def test_corpus(case):
    kwargs, n_op, n_ln = case
    m = PerFeature(**kwargs)
    gm = recfuse.transform(m, m.example(B=3))
    assert count_recfuse(gm) == n_op, gm.code
    assert count_layer_norm(gm) == n_ln, gm.code
    assert_equivalent(m, gm, m.example(B=5))


@pytest.mark.interpret
@pytest.mark.parametrize("case", [CORPUS[0], CORPUS[2], CORPUS[9]], ids=[_ids(c) for c in (CORPUS[0], CORPUS[2], CORPUS[9])])
def test_corpus_interpreter(case):
    """The same rewrites with the op running its Triton kernels under TRITON_INTERPRET=1."""
    kwargs, n_op, n_ln = case
    m = PerFeature(**{**kwargs, "D": 4})
    gm = recfuse.transform(m, m.example(B=2))
    assert count_recfuse(gm) == n_op
    assert_equivalent(m, gm, m.example(B=3), tol=1e-4)


# ---------------------------------------------------------------------------------------------
# the seed


def test_seed_function_one_node_no_per_slice_ops():
    lin = nn.Linear(8, 1)
    x = torch.randn(4 * 5 * 8)
    gm = recfuse.transform(split_stack, (x, 4, 8, lin))
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    assert count_recfuse(gm) == 1
    assert count_layer_norm(gm) == 0
    assert not any(n.target in (torch.tanh, torch.stack, torch.split) or n.op == "call_module" for n in calls)
    x2 = torch.randn(4 * 5 * 8)
    # callable with or without the constant arguments
    torch.testing.assert_close(gm(x2), split_stack(x2, 4, 8, lin), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gm(x2, 4, 8, lin), split_stack(x2, 4, 8, lin), rtol=1e-5, atol=1e-6)
    assert_equivalent(split_stack, gm, (x2, 4, 8, lin))
    with pytest.raises(AssertionError, match="specialized"):
        gm(x2, 2, 16, lin)


def test_seed_module():
    m = SplitStack(8, 3)
    gm = recfuse.transform(m, (torch.randn(3 * 4 * 8), 3, 8), verify=True)
    assert count_recfuse(gm) == 1 and count_layer_norm(gm) == 0
    x = torch.randn(3 * 4 * 8)
    torch.testing.assert_close(gm(x, 3, 8), m(x, 3, 8), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# several groups, negatives, side uses


class TwoGroups(nn.Module):
    """Two independent per-slice groups: a vertical one and a horizontal one."""

    def __init__(self):
        super().__init__()
        self.a = PerFeature(F_=3, D=4, H=2, source="split_int")
        self.b = PerFeature(F_=2, D=8, tail="none", source="chunk", ln="shared", stack_dim=1)

    def forward(self, x, y):
        return self.a(x).sum(0), self.b(y).flatten(1)


def test_two_independent_groups():
    m = TwoGroups()
    ex = (torch.randn(3, 12), torch.randn(3, 16))
    gm = recfuse.transform(m, ex)
    assert count_recfuse(gm) == 1 and count_layer_norm(gm) == 1
    r = gm.recfuse_report
    assert len(r.groups) == 2
    fresh = (torch.randn(5, 12), torch.randn(5, 16))
    got, want = gm(*fresh), m(*fresh)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    recfuse.fx.verify(m, gm, fresh)


class Mixed(nn.Module):
    """Slice `odd` uses another activation or eps, or all slices have unequal sizes."""

    def __init__(self, mode, F_=4, D=8):
        super().__init__()
        self.mode, self.F, self.D = mode, F_, D
        self.lns = nn.ModuleList([nn.LayerNorm(D, eps=0.1 if (mode == "eps" and i == 2) else 1e-5) for i in range(F_)])
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        outs = []
        for i, s in enumerate(x.split(self.D, dim=1)):
            h = self.lns[i](s)
            h = torch.sigmoid(h) if (self.mode == "act" and i == 2) else torch.tanh(h)
            outs.append(h)
        return F.relu(self.lin(torch.stack(outs, 1)))


def test_mixed_activation_is_split_off_with_reason():
    m = Mixed("act")
    ex = (torch.randn(3, 32),)
    gm = recfuse.transform(m, ex)
    # slices 0, 1, 3 are batched (one layer_norm); slice 2 keeps its own chain
    assert count_recfuse(gm) == 0 and count_layer_norm(gm) == 2
    assert_equivalent(m, gm, (torch.randn(5, 32),))
    text = str(recfuse.explain(m, ex))
    assert "slice 2 applies sigmoid, the others tanh" in text


def test_mixed_eps_reason():
    m = Mixed("eps")
    text = str(recfuse.explain(m, (torch.randn(3, 32),)))
    assert "eps 0.1 vs 1e-5" in text
    gm = recfuse.transform(m, (torch.randn(3, 32),))
    assert_equivalent(m, gm, (torch.randn(5, 32),))


class Unequal(nn.Module):
    def forward(self, x):
        outs = [torch.tanh(F.layer_norm(s, s.shape[-1:])) for s in torch.split(x, [4, 8, 8], dim=1)]
        return torch.cat(outs, dim=1)


def test_unequal_splits():
    m = Unequal()
    gm = recfuse.transform(m, (torch.randn(3, 20),))
    assert count_layer_norm(gm) == 2  # the two 8-wide slices batched, the 4-wide one alone
    assert "has shape [3, 4], the others [3, 8]" in str(gm.recfuse_report)
    assert_equivalent(m, gm, (torch.randn(3, 20),))


class SideUse(nn.Module):
    """The tanh output of slice 1 is also returned: it must still be provided."""

    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(4) for _ in range(3)])
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        outs = [torch.tanh(ln(s)) for ln, s in zip(self.lns, x.split(4, 1))]
        return F.relu(self.lin(torch.stack(outs))) + outs[1].sum()


def test_side_use_of_intermediate_is_served_by_a_view():
    m = SideUse()
    gm = recfuse.transform(m, (torch.randn(3, 12),))
    assert count_recfuse(gm) == 0 and count_layer_norm(gm) == 1
    assert "vertical fusion skipped" in str(gm.recfuse_report)
    assert_equivalent(m, gm, (torch.randn(5, 12),))


class Nothing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_nothing_to_fuse_is_unchanged():
    m = Nothing()
    gm = recfuse.transform(m, (torch.randn(2, 4),))
    assert count_recfuse(gm) == 0
    assert "no torch.stack/torch.cat" in str(gm.recfuse_report)
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), m(x))


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x.tanh()
        return x


def test_data_dependent_control_flow_error():
    with pytest.raises(recfuse.RecfuseError, match="data-dependent control flow") as e:
        recfuse.transform(DataDependent(), (torch.randn(2, 4),))
    assert "x.sum() > 0" in str(e.value)


# ---------------------------------------------------------------------------------------------
# parameters, state dicts, verify, logging


def test_state_dict_of_original_loads_and_grads_reach_parameters():
    m = PerFeature(F_=4, D=4, H=2, tail="per_slice")
    gm = recfuse.transform(m, m.example())
    names = dict(gm.named_parameters())
    assert not any(k.startswith("lns.") or k.startswith("lins.") for k in names)
    other = PerFeature(F_=4, D=4, H=2, tail="per_slice")
    for p in other.parameters():
        nn.init.normal_(p)
    gm.load_state_dict(other.state_dict())
    x = other.example(B=5)[0]
    torch.testing.assert_close(gm(x), other(x), rtol=1e-5, atol=1e-5)
    gm(x).sum().backward()
    assert all(p.grad is not None for p in gm.parameters())
    # stacked once: the same parameter objects serve every forward
    ids = {id(p) for p in gm.parameters()}
    gm(x)
    assert ids == {id(p) for p in gm.parameters()}


def test_verify_passes_and_catches_a_wrong_rewrite(monkeypatch):
    m = PerFeature(F_=3, D=4, tail="none")
    recfuse.transform(m, m.example(), verify=True)
    import recfuse.fx.runtime as rt

    monkeypatch.setattr(rt, "feature_affine", lambda h, w, b, fd, per: h)
    with pytest.raises(recfuse.RecfuseError, match="largest difference"):
        recfuse.transform(m, m.example(), verify=True)


def test_info_log_and_report_table(caplog):
    m = PerFeature(F_=3, D=4)
    with caplog.at_level(logging.INFO, logger="recfuse"):
        recfuse.transform(m, m.example())
    assert any("fused 1 group(s) of 3 slices" in r.message for r in caplog.records)
    text = str(recfuse.explain(m, m.example()))
    assert "layer_norm -> tanh -> linear -> relu" in text and "recfuse.ln_tanh_linear_relu" in text


def test_torchrec_keyed_tensor_to_dict():
    torchrec = pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import KeyedTensor

    keys = ["a", "b", "c"]

    class KT(nn.Module):
        def __init__(self):
            super().__init__()
            self.lns = nn.ModuleDict({k: nn.LayerNorm(4) for k in keys})
            self.lin = nn.Linear(4, 2)

        def forward(self, kt):
            d = kt.to_dict()
            return F.relu(self.lin(torch.stack([torch.tanh(self.lns[k](d[k])) for k in keys], 1)))

    def make(B):
        return KeyedTensor(keys=keys, length_per_key=[4, 4, 4], values=torch.randn(B, 12))

    m = KT()
    gm = recfuse.transform(m, (make(3),))
    assert count_recfuse(gm) == 1
    kt = make(5)
    torch.testing.assert_close(gm(kt), m(kt), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# torch.compile (few: slow on CPU)


def test_compile_backend_eager_inner():
    m = PerFeature(F_=3, D=4, tail="per_slice")
    be = recfuse.fx.make_backend("eager")
    cm = torch.compile(copy.deepcopy(m), backend=be, fullgraph=True)
    x = m.example(B=4)[0]
    torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-6)
    assert be.last_report is not None and be.last_report.groups[0].mode == "vertical"


@pytest.mark.slow
def test_inductor_pre_grad_pass():
    from torch._inductor import config

    m = PerFeature(F_=3, D=4)
    x = m.example(B=4)[0]
    torch._dynamo.reset()
    with config.patch(pre_grad_custom_pass=recfuse.fx.pre_grad_pass):
        y = torch.compile(m)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-6)
    assert recfuse.fx.pre_grad_pass.last_report.groups


class NeedsDynamo(nn.Module):
    """`torch._check` in forward defeats torch.fx; the Dynamo capture path takes over. (`int()` of a
    traced size, used here before, is now captured by torch.fx with a guard on the size.)"""

    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(4) for _ in range(3)])
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        torch._check(x.shape[1] % 3 == 0)
        d = x.shape[1] // 3
        outs = [ln(s).tanh() for ln, s in zip(self.lns, x.split(d, dim=1))]
        return F.relu(self.lin(torch.stack(outs, 1)))


def test_dynamo_capture_fallback_keeps_state_dict_names():
    m = NeedsDynamo()
    gm = recfuse.transform(m, (torch.randn(3, 12),), verify=True)
    assert "dynamo" in gm.recfuse_report.capture
    assert count_recfuse(gm) == 1
    other = NeedsDynamo()
    gm.load_state_dict(other.state_dict())
    x = torch.randn(3, 12)
    torch.testing.assert_close(gm(x), other(x), rtol=1e-5, atol=1e-6)


def test_a_different_module_argument_is_refused_not_ignored():
    from recfuse.puzzler import split_stack

    lin = torch.nn.Linear(8, 1)
    x = torch.randn(4 * 5 * 8)
    fused = recfuse.transform(split_stack, (x, 4, 8, lin))
    expected = split_stack(x, 4, 8, lin)
    torch.testing.assert_close(fused(x, 4, 8, lin), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused(x, 4, 8), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(recfuse.RecfuseError, match="argument `linear` was captured"):
        fused(x, 4, 8, torch.nn.Linear(8, 1))
