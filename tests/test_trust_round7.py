"""Red-team round 7: "never a silent wrong answer" for general chains, several groups, autograd
semantics, options and edge shapes through `recfuse.transform`. Each test compares with the
untouched original model, or checks the error that refuses the case. Each docstring says what the
case did before its fix."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from fx_cases import PerFeatureChain, randomized
from trust_helpers import assert_same_jvp
from recfuse.ops import cpu_backend

F_, D_, H_ = 3, 6, 4


class Chain(PerFeatureChain):
    """F_ slices of width D_ -> LayerNorm -> tanh -> stack -> shared Linear -> relu."""

    def __init__(self):
        super().__init__(F_, D_, H_)


def _grads(model, x):
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    (y ** 2).sum().backward()
    return y.detach(), x.grad


# -- transform under torch.inference_mode() --------------------------------------------------------


@pytest.mark.parametrize("inside", [True, False], ids=["transform_inside", "transform_outside"])
def test_a_model_built_under_inference_mode_transforms_and_matches(inside):
    """Before: parameters created under inference_mode (a model loaded for serving there) made
    every transform raise "Inference tensors do not track version counter" from the guard that
    watches the original's tensors during capture."""
    with torch.inference_mode():
        model = randomized(Chain())
        x = torch.randn(4, F_ * D_)
        if inside:
            fused = recfuse.transform(model, (x,))
    if not inside:
        fused = recfuse.transform(model, (x,))
    x2 = torch.randn(7, F_ * D_)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x2), model(x2), rtol=1e-5, atol=1e-6)



def test_transform_under_inference_mode_gives_a_trainable_model():
    """Before: the stacked parameters were made inside the caller's inference_mode block, so they
    were inference tensors: the first training call outside raised "Inference tensors cannot be
    saved for backward" and load_state_dict / optimizer steps could not update them, where the
    original trains as usual."""
    model = randomized(Chain())
    ref = copy.deepcopy(model)
    x = torch.randn(5, F_ * D_)
    with torch.inference_mode():
        g = recfuse.transform(model, (x,))
    assert g.recfuse_report.groups[0].fusion == "vertical_ln_tanh_linear_relu"
    assert not any(t.is_inference() for t in list(g.parameters()) + list(g.buffers()))
    yg, gg = _grads(g, x)
    yr, gr = _grads(ref, x)
    torch.testing.assert_close(yg, yr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gg, gr, atol=1e-4, rtol=1e-4)
    opt = torch.optim.SGD(g.parameters(), lr=0.1)
    (g(x) ** 2).sum().backward()
    opt.step()
    g.load_state_dict(ref.state_dict())
    torch.testing.assert_close(g(x), ref(x), atol=1e-5, rtol=1e-5)


# -- a norm over the batch and the row: the batched norm must keep those dims trailing ------------


class NormOverRows(nn.Module):
    """Each [B, D] slice normalized over (B, D) at once (normalized_shape includes the batch)."""

    def __init__(self, kind, B):
        super().__init__()
        self.B = B
        norm = nn.RMSNorm if kind.startswith("rms") else nn.LayerNorm
        self.kind = kind
        self.ns = nn.ModuleList([norm((B, D_)) for _ in range(F_)])
        self.lin = nn.Linear(D_, H_)

    def forward(self, x):
        hs = []
        for n, t in zip(self.ns, x.split(D_, 1)):
            if self.kind == "layer_norm":
                h = F.layer_norm(t, (self.B, D_))
            elif self.kind == "rms_norm":
                h = F.rms_norm(t, (self.B, D_))
            else:
                h = n(t)
            hs.append(torch.tanh(h))
        return torch.relu(self.lin(torch.stack(hs, 1)))


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "layer_norm_mod", "rms_norm_mod"])
@pytest.mark.parametrize("B", [F_, 5])
def test_a_norm_over_batch_and_row_is_batched_with_its_dims_trailing(kind, B):
    """Before: horizontal_chain batched the slices as [B, F, D] (the stack's layout) and ran the
    norm over its last two dims, (F, D) instead of each slice's (B, D): at B == F silently wrong
    (max diff 0.89 for layer_norm, 0.22 for rms_norm), else a shape error at the first call."""
    model = randomized(NormOverRows(kind, B))
    ref = copy.deepcopy(model)
    x = torch.randn(B, F_ * D_)
    g = recfuse.transform(model, (x,))
    yg, gg = _grads(g, x)
    yr, gr = _grads(ref, x)
    torch.testing.assert_close(yg, yr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gg, gr, atol=1e-4, rtol=1e-4)
    g.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    (g(x) ** 2).sum().backward()
    (ref(x) ** 2).sum().backward()
    stacked = getattr(g, "_recfuse_stacked", {})
    refp = dict(ref.named_parameters())
    for name, p in g.named_parameters():
        want = torch.stack([refp[o].grad for o in stacked[name]]) if name in stacked else refp[name].grad
        torch.testing.assert_close(p.grad, want, atol=1e-4, rtol=1e-4)


# -- an activation that writes into `out=` -------------------------------------------------------


class ActivationIntoBuffer(nn.Module):
    """The last feature's tanh writes into a buffer through `out=` (inference only: out= does not
    support autograd)."""

    def __init__(self):
        super().__init__()
        self.ns = nn.ModuleList([nn.LayerNorm(D_) for _ in range(F_)])
        self.lin = nn.Linear(D_, H_)
        self.register_buffer("last", torch.zeros(5, D_))

    def forward(self, x):
        hs = []
        for i, (n, t) in enumerate(zip(self.ns, x.split(D_, 1))):
            hs.append(torch.tanh(n(t), out=self.last) if i == F_ - 1 else torch.tanh(n(t)))
        return torch.relu(self.lin(torch.stack(hs, 1)))


def test_an_activation_with_out_is_not_batched():
    """Before: `torch.tanh(h, out=buf)` was taken for a plain tanh and the group fused, but the
    out= call (it writes the buffer) stayed in the graph reading the pruned LayerNorm: every call
    raised AttributeError "'LayerNorm' object has no attribute 'weight'"."""
    model = randomized(ActivationIntoBuffer())
    ref = copy.deepcopy(model)
    x = torch.randn(5, F_ * D_)
    g = recfuse.transform(model, (x,))
    with torch.no_grad():
        y, yr = g(x), ref(x)
    torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.last, ref.last, atol=1e-6, rtol=1e-6)
    assert ref.last.abs().sum() > 0


# -- forward-mode AD (torch.autograd.forward_ad) through the fused ops -----------------------------


class GeneralChain(nn.Module):
    def __init__(self, norm, act, out):
        super().__init__()
        self.act, self.out = act, out
        self.ns = nn.ModuleList([norm(D_) for _ in range(F_)])
        self.lin = nn.Linear(D_, H_)

    def forward(self, x):
        y = self.lin(torch.stack([self.act(n(t)) for n, t in zip(self.ns, x.split(D_, 1))], 1))
        return self.out(y) if self.out is not None else y


_FWD_CHAINS = {
    "ln_tanh_relu": (nn.LayerNorm, torch.tanh, torch.relu, "vertical_ln_tanh_linear_relu"),
    "rms_gelu": (nn.RMSNorm, F.gelu, None, "vertical_feature_mlp"),
    "ln_sigmoid_sigmoid": (nn.LayerNorm, torch.sigmoid, torch.sigmoid, "vertical_feature_mlp"),
}


@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("chain", list(_FWD_CHAINS))
def test_forward_ad_through_the_fused_op_gives_the_tangent(chain, grad, backend):
    """Before: with dual tensors (torch.autograd.forward_ad) the fused op raised "You must implement
    the jvp function for custom autograd.Function" when grad was on, and under no_grad the
    ln_tanh_linear_relu path returned the primal with no tangent at all (unpack_dual(y).tangent
    None, where the original gives the jvp, on the compiled CPU backend), also for dual parameters
    through functional_call."""
    with cpu_backend(backend):
        _check_forward_ad(chain, grad)


def _check_forward_ad(chain, grad):
    import torch.autograd.forward_ad as fwAD

    norm, act, out, fusion = _FWD_CHAINS[chain]
    model = randomized(GeneralChain(norm, act, out))
    ref = copy.deepcopy(model)
    x = torch.randn(5, F_ * D_)
    tx = torch.randn_like(x)
    g = recfuse.transform(model, (x,))
    assert g.recfuse_report.groups[0].fusion == fusion
    with torch.no_grad():
        g(x), g(x)  # the op's later calls may take another path than its first
    assert_same_jvp(g, ref, x, tx, grad)
    # dual parameters (a jvp in the parameters' direction), the stacked ones stacked from the original's
    stacked = getattr(g, "_recfuse_stacked", {})
    tangents = {k: torch.randn_like(v) for k, v in ref.named_parameters()}
    tangent_of = {k: torch.stack([tangents[o] for o in stacked[k]]) if k in stacked else tangents[k]
                  for k, _ in g.named_parameters()}
    got = []
    for mod, tans in ((g, tangent_of), (ref, tangents)):
        with torch.set_grad_enabled(grad), fwAD.dual_level():
            p = {k: fwAD.make_dual(v.detach(), tans[k]) for k, v in mod.named_parameters()}
            got.append(fwAD.unpack_dual(torch.func.functional_call(mod, p, (x,))).tangent)
    assert got[0] is not None
    torch.testing.assert_close(got[0], got[1], atol=1e-4, rtol=1e-4)


# -- a forward that changes a plain attribute of the module -----------------------------------------


class CountingModel(Chain):
    """Counts its calls in a Python int and scales its result by the count."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * self.calls


class FlagModel(Chain):
    """Sets a plain attribute to the same value on every call (harmless: nothing depends on the count)."""

    def forward(self, x):
        self.ran = True
        return super().forward(x)


def test_a_forward_that_changes_a_plain_attribute_is_refused():
    """Before: the trace ran `self.calls += 1` once and baked the count into the graph: the
    transformed model returned y * 1 on every call where the original returns y * 1, y * 2, ...
    (max diff 2.03 at the third call), and its `calls` never moved."""
    with pytest.raises(recfuse.RecfuseError, match="calls"):
        recfuse.transform(CountingModel(), (torch.randn(5, F_ * D_),))


def test_a_forward_that_sets_a_plain_attribute_to_the_same_value_is_still_fused():
    model = randomized(FlagModel())
    model.ran = True
    ref = copy.deepcopy(model)
    x = torch.randn(5, F_ * D_)
    g = recfuse.transform(model, (x,))
    assert g.recfuse_report.groups[0].fusion == "vertical_ln_tanh_linear_relu"
    torch.testing.assert_close(g(x), ref(x), atol=1e-5, rtol=1e-5)
