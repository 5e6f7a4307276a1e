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
