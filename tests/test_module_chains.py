"""FusedFeatureProcessor with the op family's other chains (norm, activation, out_activation):
against its own per-slice oracle and `recfuse.reference.feature_mlp` in float64, forward and
backward; from_modules of nn.RMSNorm loops; the constructor's errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from recfuse import FusedFeatureProcessor

CHAINS = [
    dict(norm="rms_norm", activation="silu", out_activation=None),
    dict(norm="rms_norm", activation="gelu_tanh", out_activation="sigmoid", eps=None),
    dict(norm=None, activation="relu", out_activation="gelu"),
    dict(norm=None, activation=None, out_activation=None),
    dict(norm="layer_norm", activation="sigmoid", out_activation="tanh", ln_affine=False),
    dict(norm="layer_norm", activation="gelu", out_activation="silu", shared_layer_norm=True),
]


def _rand_params(fp, gen):
    with torch.no_grad():
        for p in fp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)


def _grads(y, leaves, cot):
    return torch.autograd.grad(y, leaves, cot, allow_unused=True)


@pytest.mark.parametrize("shared_linear", [True, False])
@pytest.mark.parametrize("kw", CHAINS, ids=lambda kw: "-".join(str(kw.get(k)) for k in ("norm", "activation", "out_activation")))
def test_chain_matches_its_per_slice_reference_in_float64(kw, shared_linear):
    names = ["a", "b", "c"]
    gen = torch.Generator().manual_seed(0)
    fp = FusedFeatureProcessor(names, 8, out_features=3, shared_linear=shared_linear, dtype=torch.float64, **kw)
    _rand_params(fp, gen)
    assert fp.norm == kw["norm"] and fp.activation == kw["activation"] and fp.out_activation == kw["out_activation"]
    x = torch.randn(5, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    y = fp(x)
    y_ref = fp.forward_reference(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    # and the op family's per-slice reference on the stacked parameters
    p = fp.feature_parameters
    stack = lambda k: None if p("a")[k] is None else torch.stack([p(n)[k] for n in names])  # noqa: E731
    eps = kw.get("eps", 1e-5)
    want = recfuse.reference.feature_mlp(
        x.view(5, 3, 8), stack("weight"), stack("bias"), norm=kw["norm"], ln_weight=stack("ln_weight"),
        ln_bias=stack("ln_bias"), eps=torch.finfo(torch.float64).eps if eps is None else eps,
        activation=kw["activation"], out_activation=kw["out_activation"], feature_dim=1).flatten(1)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-12)
    cot = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    leaves = [x] + list(fp.parameters())
    for a, b in zip(_grads(y, leaves, cot), _grads(y_ref, leaves, cot)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_input_kinds_and_mixed_dims_with_another_chain():
    gen = torch.Generator().manual_seed(1)
    fp = FusedFeatureProcessor(["a", "b", "c"], [4, 8, 4], out_features=2, shared_linear=False, norm="rms_norm",
                               activation="silu", out_activation="sigmoid", dtype=torch.float64)
    _rand_params(fp, gen)
    x = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fp(x), fp.forward_reference(x), rtol=1e-10, atol=1e-12)
    d = {"c": x[:, 12:], "a": x[:, :4], "b": x[:, 4:12]}
    out, ref = fp(d), fp.forward_reference(d)
    assert list(out) == ["c", "a", "b"]
    for k in out:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-10, atol=1e-12)
    fp1 = FusedFeatureProcessor(["a", "b"], 8, out_features=2, norm=None, activation="gelu", out_activation=None,
                                dtype=torch.float64)
    x3 = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fp1(x3, feature_dim=0), fp1.forward_reference(x3, feature_dim=0), rtol=1e-10, atol=1e-12)


def test_norm_none_has_no_affine_and_rms_norm_a_weight_only():
    fp = FusedFeatureProcessor(["a", "b"], 4, norm=None, activation="relu")
    assert fp.ln_affine is False and fp.ln_weight is None and fp.ln_bias is None
    assert sorted(fp.state_dict()) == ["_extra_state", "bias", "weight"]  # _extra_state: the feature names
    fp = FusedFeatureProcessor(["a", "b"], 4, norm="rms_norm")
    assert fp.ln_affine is True and fp.ln_weight.shape == (2, 4) and fp.ln_bias is None
    assert sorted(fp.state_dict()) == ["_extra_state", "bias", "ln_weight", "weight"]
    assert "norm='rms_norm', activation='tanh', out_activation='relu'" in repr(fp)
    assert "activation=" not in repr(FusedFeatureProcessor(["a"], 4))  # the default chain's repr is unchanged
    fp = FusedFeatureProcessor(["a", "b"], 4, norm="rms_norm", ln_affine=False)
    assert fp.ln_weight is None


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(norm="batch_norm"), ValueError, "norm must be one of 'layer_norm', 'rms_norm' or None, got 'batch_norm'"),
    (dict(activation="leaky_relu"), ValueError, "activation must be one of 'tanh', 'sigmoid', 'relu', 'gelu', "
                                                "'gelu_tanh', 'silu' or None, got 'leaky_relu'"),
    (dict(out_activation=1), ValueError, "out_activation must be one of"),
    (dict(norm=None, ln_affine=True), ValueError, "ln_affine=True needs a norm, but norm=None"),
    (dict(ln_affine="yes"), TypeError, "ln_affine must be a bool or None"),
    (dict(eps=None), ValueError, "eps=None is RMSNorm's default (norm='rms_norm'); with norm='layer_norm'"),
    (dict(norm="rms_norm", eps=-1.0), ValueError, "eps"),
])
def test_constructor_errors_name_the_argument(kwargs, exc, msg):
    with pytest.raises(exc) as e:
        FusedFeatureProcessor(["a", "b"], 4, **kwargs)
    assert msg in str(e.value)


class RmsLoop(nn.Module):
    """The per-feature loop FusedFeatureProcessor.from_modules replaces, with RMSNorm."""

    def __init__(self, names, D, H, eps):
        super().__init__()
        self.names = names
        self.norms = nn.ModuleDict({n: nn.RMSNorm(D, eps=eps) for n in names})
        self.lins = nn.ModuleDict({n: nn.Linear(D, H) for n in names})
        with torch.no_grad():
            for m in self.norms.values():
                m.weight.uniform_(0.5, 1.5)

    def forward(self, d):
        return {n: F.gelu(self.lins[n](F.silu(self.norms[n](d[n]))), approximate="tanh") for n in self.names}


@pytest.mark.parametrize("eps", [None, 1e-3])
def test_from_modules_of_rms_norms_matches_the_loop(eps):
    loop = RmsLoop(["u", "v", "w"], 8, 2, eps)
    fp = FusedFeatureProcessor.from_modules(loop.norms, loop.lins, activation="silu", out_activation="gelu_tanh")
    assert fp.norm == "rms_norm" and fp.eps == eps and fp.ln_bias is None and not fp.shared_linear
    gen = torch.Generator().manual_seed(2)
    # small inputs: an eps of the wrong dtype would show (mean(x^2) ~ 1e-4)
    d = {n: torch.randn(4, 8, generator=gen) * 0.01 for n in ["w", "u", "v"]}
    d64 = {k: v.double() for k, v in d.items()}
    want = RmsLoop.forward(loop.double(), d64)
    got = fp.double()(d64)
    for k in d:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
    # bfloat16 inputs (float32 parameters cast per call): F.rms_norm's eps=None default is float32's
    loop, fp = loop.float(), fp.float()
    db = {k: v.bfloat16() for k, v in d.items()}
    with torch.no_grad():
        want = RmsLoop.forward(loop.bfloat16(), db)
        got = fp(db)
    for k in d:
        assert float((got[k].double() - want[k].double()).norm() / want[k].double().norm()) < 2e-2


def test_from_modules_refuses_mixed_norm_types():
    norms = {"a": nn.LayerNorm(4), "b": nn.RMSNorm(4)}
    with pytest.raises(ValueError, match=r"layer_norms\['b'\] is an nn.RMSNorm but layer_norms\['a'\] an nn.LayerNorm"):
        FusedFeatureProcessor.from_modules(norms, nn.Linear(4, 2))
    with pytest.raises(TypeError, match="must be an nn.LayerNorm or nn.RMSNorm"):
        FusedFeatureProcessor.from_modules({"a": nn.BatchNorm1d(4)}, nn.Linear(4, 2))
