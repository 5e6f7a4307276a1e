"""Regression tests for the red-team's semantics findings: each compares the transformed model
with an untouched deep copy of the original (outputs, gradients, after SGD steps), or checks the
error / the report."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from fx_cases import PerFeatureChain, reloaded

NF, D, H = 4, 8, 3


def _flat(o):
    return list(o) if isinstance(o, tuple) else [o]


def _assert_same_training(ref: nn.Module, gm: nn.Module, x: torch.Tensor, steps: int = 2, lr: float = 0.05):
    """Outputs, then outputs after `steps` SGD steps on each model's own parameters."""
    for a, b in zip(_flat(ref(x)), _flat(gm(x))):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in gm.parameters())
    for m in (ref, gm):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            sum(o.pow(2).sum() for o in _flat(m(x))).backward()
            opt.step()
    with torch.no_grad():
        for a, b in zip(_flat(ref(x)), _flat(gm(x))):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


class _PerFeature(nn.Module):
    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(NF)])
        self.lins = nn.ModuleList([nn.Linear(D, H) for _ in range(NF)])
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn_like(p) * 0.3)

    def feats(self, x):
        return torch.stack([torch.relu(l(torch.tanh(n(t))))
                            for n, l, t in zip(self.lns, self.lins, x.split(D, 1))], 1)

    def forward(self, x):
        return self.feats(x)


class _Tied(_PerFeature):
    def __init__(self):
        super().__init__()
        self.lins[1].weight = self.lins[0].weight


class _HeadTied(_PerFeature):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, H)
        self.head.weight = self.lins[0].weight

    def forward(self, x):
        return self.feats(x), self.head(x[:, :D])


class _LNTied(_PerFeature):
    def __init__(self):
        super().__init__()
        self.lns[2].weight = self.lns[0].weight


class _WeightIsBias(_PerFeature):
    def __init__(self):
        super().__init__()
        for n in self.lns:
            n.bias = n.weight


class _AllOne(_PerFeature):
    def __init__(self):
        super().__init__()
        for lin in self.lins[1:]:
            lin.weight = self.lins[0].weight


# -- 1: tied parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [_Tied, _HeadTied, _LNTied, _WeightIsBias, _AllOne])
def test_tied_parameters_stay_tied(cls):
    torch.manual_seed(0)
    m = cls()
    ref = copy.deepcopy(m)
    gm = recfuse.transform(m, (torch.randn(3, NF * D),))
    assert gm.recfuse_report.groups
    _assert_same_training(ref, gm, torch.randn(6, NF * D))
    if cls is not _AllOne:
        assert any("tied" in n for g in gm.recfuse_report.groups for n in g.notes), str(gm.recfuse_report)
    # the state_dict still has the original's keys, and the original's state loads
    assert set(gm.state_dict()) >= set(ref.state_dict()) - {k for v in getattr(gm, "_recfuse_stacked", {}).values()
                                                             for k in v}
    gm.load_state_dict(ref.state_dict())


# -- 2: patched forward ---------------------------------------------------------------------------


def test_instance_patched_forward_is_not_fused_as_plain_module():
    class M(PerFeatureChain):
        def __init__(self):
            super().__init__(NF, D, H)

            def scaled(self, z):
                return F.linear(z, self.weight, self.bias) * 2.0

            self.lin.forward = types.MethodType(scaled, self.lin)
            self.lns[0].forward = types.MethodType(lambda self, z: F.layer_norm(z, (D,)) * 3.0, self.lns[0])

    m = M()
    gm = recfuse.transform(m, (torch.randn(3, NF * D),))
    x = torch.randn(5, NF * D)
    torch.testing.assert_close(gm(x), m(x))


# -- 3: in-place ops through aliases ----------------------------------------------------------------


@pytest.mark.parametrize("alias", ["identity", "dropout_eval", "f_dropout_eval", "cpu", "type", "atleast_2d",
                                   "broadcast_to"])
def test_inplace_through_an_alias_is_kept(alias):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(NF)])
            self.lins = nn.ModuleList([nn.Linear(D, H) for _ in range(NF)])
            self.skip = nn.Identity()
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            outs = []
            for ln, lin, t in zip(self.lns, self.lins, x.split(D, 1)):
                h = ln(t)
                s = {"identity": self.skip, "dropout_eval": self.drop,
                     "f_dropout_eval": lambda z: F.dropout(z, 0.1, training=False),
                     "cpu": lambda z: z.cpu(), "type": lambda z: z.type(torch.float32),
                     "atleast_2d": torch.atleast_2d,
                     "broadcast_to": lambda z: torch.broadcast_to(z, z.shape)}[alias](h)
                h.tanh_()
                outs.append(torch.relu(lin(h)) + s.mean(-1, keepdim=True))
            return torch.stack(outs, 1)

    torch.manual_seed(0)
    m = M().eval()
    gm = recfuse.transform(m, (torch.randn(3, NF * D),))
    x = torch.randn(5, NF * D)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), m(x))


# -- 4: hooks through deepcopy / save / load -------------------------------------------------------


def _times3(mod, inp, out):
    return out * 3


def _halve_input(mod, inp):
    return (inp[0] * 0.5,)


class _Plain(PerFeatureChain):
    def __init__(self):
        super().__init__(NF, D, H)



def test_forward_hooks_survive_deepcopy_and_save_load():
    m = _Plain()
    m.register_forward_hook(_times3)
    m.register_forward_pre_hook(_halve_input)
    gm = recfuse.transform(m, (torch.randn(3, NF * D),))
    x = torch.randn(5, NF * D)
    want = m(x)
    for mod in (gm, copy.deepcopy(gm), reloaded(gm)):
        torch.testing.assert_close(mod(x), want)


# -- 5: unused parameters and non-persistent buffers -----------------------------------------------


class _Unused(_Plain):
    def __init__(self):
        super().__init__()
        self.unused_head = nn.Linear(D, 1)
        self.register_buffer("step", torch.zeros(()))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def test_unused_parameters_and_buffers_are_kept():
    m = _Unused()
    gm = recfuse.transform(m, (torch.randn(3, NF * D),))
    assert gm.recfuse_report.groups
    for mod in (gm, copy.deepcopy(gm), reloaded(gm)):
        stacked = {k for v in mod._recfuse_stacked.values() for k in v}
        # `_extra_state`: the stacked rows' original names, recfuse's own record (red-team round 19)
        assert set(mod.state_dict()) - set(mod._recfuse_stacked) - {"_extra_state"} == set(m.state_dict()) - stacked
        mod.load_state_dict(m.state_dict())  # strict
        assert sum(p.numel() for p in mod.parameters()) == sum(p.numel() for p in m.parameters())
        assert torch.equal(mod.unused_head.weight, m.unused_head.weight)
        assert torch.equal(mod.scratch, m.scratch)
    assert gm.unused_head.weight is not m.unused_head.weight  # a copy: the original is untouched


def test_nonpersistent_per_feature_buffers_stay_nonpersistent():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            for i in range(NF):
                self.register_buffer(f"gamma{i}", torch.rand(D) + 0.5, persistent=False)
            self.lin = nn.Linear(D, H)

        def forward(self, x):
            return torch.relu(self.lin(torch.stack(
                [torch.tanh(F.layer_norm(t, (D,), getattr(self, f"gamma{i}"))) for i, t in enumerate(x.split(D, 1))],
                1)))

    m = M()
    gm = recfuse.transform(m, (torch.randn(3, NF * D),))
    assert gm.recfuse_report.groups
    assert set(gm.state_dict()) == set(m.state_dict())
    gm.load_state_dict(m.state_dict())
    x = torch.randn(5, NF * D)
    torch.testing.assert_close(gm(x), m(x))


# -- 6: batch size 0 -------------------------------------------------------------------------------


def test_batch_size_zero():
    m = _Plain()
    gm = recfuse.transform(m, (torch.randn(3, NF * D),))
    x = torch.randn(0, NF * D)
    assert gm(x).shape == m(x).shape == (0, NF, H)


class _PerFeatureLinear(nn.Module):
    """Per-feature Linear layers and softplus (no fused kernel for it): a horizontal group (batched `feature_linear`)."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, H) for _ in range(NF)])

    def forward(self, x):
        return torch.stack([F.softplus(lin(s)) for lin, s in zip(self.lins, x.split(D, dim=1))], dim=1)


def test_batch_size_zero_through_batched_per_feature_linear():
    torch.manual_seed(0)
    m = _PerFeatureLinear()
    gm = recfuse.transform(m, (torch.randn(3, NF * D),))
    assert gm.recfuse_report.groups, "expected the per-feature Linear group to be fused"
    x = torch.randn(0, NF * D)
    assert gm(x).shape == m(x).shape == (0, NF, H)
    x = torch.randn(4, NF * D)
    torch.testing.assert_close(gm(x), m(x))


# -- 7: FusedFeatureProcessor ----------------------------------------------------------------------


def test_from_modules_refuses_subclasses_with_their_own_forward():
    class ScaledLN(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2.0

    class LoRALinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    with pytest.raises(ValueError, match="ScaledLN.*overrides nn.LayerNorm.forward"):
        recfuse.FusedFeatureProcessor.from_modules(nn.ModuleList([ScaledLN(D) for _ in range(3)]), nn.Linear(D, H))
    with pytest.raises(ValueError, match="LoRALinear.*overrides nn.Linear.forward"):
        recfuse.FusedFeatureProcessor.from_modules(nn.ModuleList([nn.LayerNorm(D) for _ in range(3)]),
                                                   nn.ModuleList([LoRALinear(D, H) for _ in range(3)]))
    lin = nn.Linear(D, H)
    lin.forward = types.MethodType(lambda self, z: z, lin)
    with pytest.raises(ValueError, match="instance"):
        recfuse.FusedFeatureProcessor.from_modules(nn.LayerNorm(D), lin, ["a", "b"])


def test_ffp_refuses_mixed_dict_dtypes_bool_feature_dim_and_inf_eps():
    fp = recfuse.FusedFeatureProcessor(["u", "i", "c"], 4, out_features=2)
    with pytest.raises(TypeError, match="dtype"):
        fp({"u": torch.randn(2, 4), "i": torch.randn(2, 4, dtype=torch.float64), "c": torch.randn(2, 4)})
    fp(torch.randn(3, 3, 4), feature_dim=1)  # cached plan for feature_dim=1 must not serve True
    with pytest.raises(ValueError, match="feature_dim"):
        fp(torch.randn(3, 3, 4), feature_dim=True)
    with pytest.raises(ValueError, match="finite"):
        recfuse.FusedFeatureProcessor(["a"], 4, eps=float("inf"))
    with pytest.raises(TypeError, match="float64"):
        recfuse.ln_tanh_linear_relu(torch.zeros(2, 2, 4, dtype=torch.int64), torch.zeros(1, 4))


def test_name_based_parameter_groups_follow_the_stacked_parameters():
    """AdamW without weight decay on LayerNorm parameters, chosen by name: on the result the
    per-feature names are gone (stacked), and `stacked_parameters` says which stacked parameter
    holds which originals, so the same groups train the same."""
    torch.manual_seed(0)
    ref = _PerFeature()
    with torch.no_grad():  # non-trivial affine, so that decaying it would show
        for ln in ref.lns:
            ln.weight.add_(torch.randn(D) * 0.3)
            ln.bias.add_(torch.randn(D) * 0.3)
    x = torch.randn(5, NF * D)
    gm = recfuse.transform(copy.deepcopy(ref), (x,))
    stacked = gm.stacked_parameters()
    assert any("lns.0.weight" in olds for olds in stacked.values())

    def groups(model, originals_of):
        no_decay = [p for n, p in model.named_parameters() if any(".lns." in f".{o}" for o in originals_of(n))]
        decay = [p for n, p in model.named_parameters() if not any(".lns." in f".{o}" for o in originals_of(n))]
        return [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}]

    models = ((ref, lambda n: [n]), (gm, lambda n: stacked.get(n, [n])))
    opts = [torch.optim.AdamW(groups(m, orig), lr=0.05) for m, orig in models]
    assert [len(g["params"]) for g in opts[1].param_groups][1] < [len(g["params"]) for g in opts[0].param_groups][1]
    for _ in range(3):
        for (m, _), opt in zip(models, opts):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), ref(x), rtol=1e-5, atol=1e-5)
