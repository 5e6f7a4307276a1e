"""Capture's fast paths (direct node creation, the flat-argument `__torch_function__`, the cached
submodule lookup) record the same graph as torch.fx's generic ones: same code, names, module
stacks and example values."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Proxy

import recfuse.fx.capture as cap
from recfuse.fx.values import VAL_KEY

from fx_cases import PerFeature
from test_transform import CORPUS


class _Odd(nn.Module):
    """Arguments fx's fast paths must hand back to fx: nested lists, dtypes, kwargs, capitals and
    dunders in names, a shared module called under two names, an in-place op."""

    def __init__(self):
        super().__init__()
        self.lnA = nn.LayerNorm(4)
        self.alias = self.lnA
        self.act = nn.ReLU(inplace=True)

    def forward(self, x, n: int):
        a, b = torch.split(x, 4, dim=1)
        h = torch.cat([self.lnA(a), self.alias(b)], dim=1)
        h = h.to(torch.float64).to(dtype=torch.float32)
        h = torch.clamp(h, min=-1.0, max=1.0) + x.shape[1] * 0.5
        h = operator.mul(h, 2)
        h = self.act(h.view(n, -1))
        return F.layer_norm(h, (h.shape[-1],)).sum(dim=[0], keepdim=True)


def _models():
    for kw, _, _ in CORPUS:
        torch.manual_seed(0)
        m = PerFeature(**kw)
        yield m, m.example()
    torch.manual_seed(0)
    yield _Odd(), (torch.randn(3, 8), 3)


def _summary(gm):
    return gm.code, [(n.name, n.op, n.target, n.meta.get(VAL_KEY), n.meta.get("nn_module_stack"))
                     for n in gm.graph.nodes]


@pytest.mark.parametrize("i", range(len(CORPUS) + 1))
def test_fast_tracing_records_what_fx_records(i, monkeypatch):
    model, args = list(_models())[i]
    fast = _summary(cap.capture(model, args)[0])
    monkeypatch.setattr(cap._ValueTracer, "_can_append_directly", lambda self: False)
    monkeypatch.setattr(cap._ValueTracer, "_submodule", lambda self, t: self.root.get_submodule(t))
    monkeypatch.setattr(cap._ValueProxy, "__torch_function__", classmethod(Proxy.__torch_function__.__func__))
    slow = _summary(cap.capture(model, args)[0])
    assert fast == slow


def test_name_candidates_match_fx():
    g = torch.fx.Graph()
    cache: dict = {}
    for target in ("lns.0", "lnA", "__add__", "Tanh", "relu_", "_0", "a.B", operator.getitem, torch.tanh,
                   F.layer_norm, "layer_norm"):
        assert cap._name_candidate(g, target, cache) == g._target_to_str(target)
        assert cap._name_candidate(g, target, cache) == g._target_to_str(target)  # cached


class _UnevenSlices(nn.Module):
    """Per-slice ops whose results the capture may defer, with slices that differ in dtype and
    width, a BatchNorm (state), an in-place op, a grad-mode region, `len()` and a data read of
    per-slice values: every value that is needed must be the one eager execution computes.
    (Autocast inside forward and `.item()` in control flow, used here before, are now refused.)"""

    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(4) for _ in range(3)] + [nn.LayerNorm(4).double(), nn.LayerNorm(6)])
        self.bn = nn.BatchNorm1d(4)
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        parts = torch.split(x, [4, 4, 4, 4, 6], dim=1)
        outs = [torch.tanh(ln(p.double() if i == 3 else p)) for i, p in enumerate(zip(self.lns, parts)) for ln, p in [p]]
        a = torch.relu(self.lin(torch.stack(outs[:3], dim=1)))  # deferred: tanh, stack, linear, relu
        a = a * (len(outs[0]) + outs[3].shape[-1])  # len() of a deferred value
        b = self.bn(outs[1])  # BatchNorm (not deferrable) reads pending values: computed first
        outs[2].mul_(0.5)  # in place on a (pending) value
        scale = outs[2].sum().item() + 2.0  # a data read (kept in the graph: no control flow on it)
        with torch.no_grad():
            c = self.lin(outs[0] * scale).to(torch.bfloat16)
        return a.sum() + b.sum() + c.float().sum() + outs[4].sum() + outs[3].sum()


def _uneven_example():
    torch.manual_seed(0)
    m = _UnevenSlices().train()
    return m, (torch.randn(5, 22),)


def test_deferred_values_give_the_eager_capture(monkeypatch):
    model, args = _uneven_example()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fast = _summary(cap.capture(model, args)[0])
    monkeypatch.setattr(cap._ValueTracer, "defer_values", False)
    slow = _summary(cap.capture(model, args)[0])
    assert fast == slow
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # BatchNorm stats untouched


def test_deferred_capture_transforms_to_the_same_module(monkeypatch):
    import recfuse

    results = []
    for defer in (True, False):
        monkeypatch.setattr(cap._ValueTracer, "defer_values", defer)
        model, args = _uneven_example()
        gm = recfuse.transform(model, args)
        torch.manual_seed(1)
        results.append((gm.code, gm(*args)))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])


def test_deferred_values_are_not_computed_for_a_per_feature_model(monkeypatch):
    torch.manual_seed(0)
    model = PerFeature(F_=6)
    runs = []
    real_run = cap._ValueTracer._run
    monkeypatch.setattr(cap._ValueTracer, "_run", lambda self, node, *a, **k: (runs.append(node.op), real_run(self, node, *a, **k))[1])
    cap.capture(model, model.example())
    # the first slice's LayerNorm and tanh run; the other five are known from their metadata
    assert runs.count("call_module") == 1 + 1 and runs.count("call_function") < 6 + 6


def test_op_key_refuses_what_may_change_state_or_alias():
    lookup = {"ln": nn.LayerNorm(4), "relu_": nn.ReLU(inplace=True), "bn": nn.BatchNorm1d(4)}.get
    x = torch.zeros(2, 4)
    assert cap.deferred.op_key("call_module", "ln", (x,), {}, lookup) is not None
    assert cap.deferred.op_key("call_module", "relu_", (x,), {}, lookup) is None
    assert cap.deferred.op_key("call_module", "bn", (x,), {}, lookup) is None
    assert cap.deferred.op_key("call_function", F.relu, (x,), {"inplace": True}, lookup) is None
    assert cap.deferred.op_key("call_function", F.dropout, (x,), {}, lookup) is None
    assert cap.deferred.op_key("call_method", "relu_", (x,), {}, lookup) is None
    assert cap.deferred.op_key("call_function", torch.tanh, (x.to(torch.int32),), {}, lookup) is None
