"""Red-team round 10: "never a silent wrong answer" for what a user does to a transformed model
*after* `recfuse.transform` (hooks, module settings, module replacement, in-place ops on its
result), through the graph pass. Each test compares with the untouched original model (a deep
copy taken before transform), or checks the error that refuses the case. Each docstring says what
the case did before its fix.

(Spellings probed this round that matched the original and need no test of their own: per-feature
LayerNorms with different eps, elementwise_affine or bias per feature; LayerNorm over the last two
dims (one shared, one per feature); F.layer_norm with weight only, bias only, neither, a shared
weight with per-feature biases, a weight computed from a buffer; slices by torch.chunk,
tensor_split, narrow, x[..., a:b], x[:, i*w:(i+1)*w] with w computed from x.shape, view+unbind(1)
and unbind(-2); stack on dim 0 / -2, stack(-1)+transpose, cat+view / reshape / unflatten; Linear
without bias; one Linear shared by a fused chain and a direct call, or by two fused chains (SGD
steps included); activations as nn.Tanh, x.tanh(), F.hardtanh / softsign / tanh_ (left unfused),
relu spelled as nn.ReLU(inplace=True), clamp(min=0), clamp_min, x * (x > 0), maximum with zeros,
where, relu6, threshold; forward(x, y=None, scale=1.0) with two inputs (one chain each), keyword
calls and left-out arguments (other values refused by name); dict and list inputs; .half() /
.to(bfloat16) / .double() after transform; replacing lin / lin.weight / .data after transform;
load_state_dict of the original's state_dict (strict, partial non-strict) and back; a LayerNorm
submodule's own load_state_dict; requires_grad_(False) on some or all parameters after transform;
torch.no_grad and inference_mode calls; dropout between LayerNorm and tanh with train()/eval()
toggles (model and submodule); forward hooks and pre-hooks on the transformed model itself;
parametrize on lin after transform; F=1, D=1, B=0, B=1, odd B; 1e4 inputs and constant rows;
bf16 models, autocast, a transform under autocast called outside; float64 / int / non-contiguous /
expanded inputs. Left as they are: `forward` with keyword-only parameters is refused by name; a
fp32-LayerNorm-then-bf16 chain is left unfused.)"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from recfuse.errors import RecfuseError
from fx_cases import randomized

F_, D_, H_ = 3, 4, 2


class SharedLN(nn.Module):
    """One LayerNorm for every slice -> tanh -> stack -> Linear -> relu (fuses vertically; the
    transformed model keeps `ln` and `lin` only as holders of the tensors the fused op reads)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D_)
        self.lin = nn.Linear(D_, H_)

    def forward(self, x):
        return torch.relu(self.lin(torch.stack([torch.tanh(self.ln(t)) for t in x.split(D_, 1)], 1)))


class PerFeatureLN(nn.Module):
    """A LayerNorm per slice (stacked by fusion); `side` also returns lin of the first slice."""

    def __init__(self, side=False):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(D_) for _ in range(F_)])
        self.lin = nn.Linear(D_, H_)
        self.side = side

    def forward(self, x):
        y = torch.relu(self.lin(torch.stack([torch.tanh(n(t)) for n, t in zip(self.lns, x.split(D_, 1))], 1)))
        return (y, self.lin(x[:, :D_])) if self.side else y


def _pair(cls, *args):
    model = randomized(cls(*args))
    ref = copy.deepcopy(model)
    g = recfuse.transform(model, (torch.randn(5, F_ * D_),))
    assert g.recfuse_report.groups
    return g, ref


def _out(m, x):
    y = m(x)
    return y[0] if isinstance(y, tuple) else y


def _copies(g):
    buf = io.BytesIO()
    torch.save(g, buf)
    buf.seek(0)
    return [g, copy.deepcopy(g), torch.load(buf, weights_only=False)]


def _double(m, i, o):
    return o * 2


@pytest.mark.parametrize("model", ["shared_ln", "per_feature", "side_output"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_a_hook_on_a_fused_module_after_transform_is_refused(model, kind):
    """Before: a hook registered after transform on `lin` or on a LayerNorm whose calls fusion
    replaced (a holder of their tensors, a stand-in, or a Linear still called by a side branch) was
    silently never run: with `o * 2` forward hooks y was 0.93-1.02 off the original (0.12-0.26 on
    a LayerNorm), and a full backward hook zeroing the input gradient left dx 0.48 off (the
    original's dx 0). Now registering it raises RecfuseError naming the module; a module the graph
    still calls takes hooks as before, and so do the copies and reloads of the model."""
    cls, args = {"shared_ln": (SharedLN, ()), "per_feature": (PerFeatureLN, ()),
                 "side_output": (PerFeatureLN, (True,))}[model]
    g, ref = _pair(cls, *args)
    paths = ["lin", "ln"] if model == "shared_ln" else ["lin", "lns.0", "lns.2"]
    for copy_ in _copies(g):
        for path in paths:
            mod = copy_.get_submodule(path)
            with pytest.raises(RecfuseError, match=f"hook on `{path}`"):
                if kind == "forward":
                    mod.register_forward_hook(lambda m, i, o: o * 2)
                elif kind == "forward_pre":
                    mod.register_forward_pre_hook(lambda m, i: (i[0] * 2,))
                else:
                    mod.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0,))
        x = torch.randn(4, F_ * D_)
        torch.testing.assert_close(_out(copy_, x), _out(ref, x), atol=1e-5, rtol=1e-5)


def test_weight_norm_spectral_norm_and_pruning_after_transform_are_refused():
    """Before: torch.nn.utils.spectral_norm(transformed.lin) (a forward pre-hook computes the
    normalised weight) was silently ignored: y 15 off the original; weight_norm and
    prune.l1_unstructured (pre-hooks too) gave the original's first output, then trained the
    weight they computed once: the second SGD step raised "Trying to backward through the graph a
    second time". Now each refuses, naming `lin` (prune's own clean-up then raises a KeyError,
    whose context is the refusal)."""
    import torch.nn.utils.prune as prune

    for apply in (torch.nn.utils.spectral_norm, torch.nn.utils.weight_norm,
                  lambda m: prune.l1_unstructured(m, "weight", 0.5)):
        g, _ = _pair(SharedLN)
        with pytest.raises((RecfuseError, KeyError)) as info:
            apply(g.lin)
        err = info.value if isinstance(info.value, RecfuseError) else info.value.__context__
        # (since round 24 prune and spectral_norm are refused earlier, at `weight_orig`, by name)
        assert isinstance(err, RecfuseError) and ("hook on `lin`" in str(err) or "reparametrize `lin.weight`" in str(err))


def test_a_module_the_graph_still_calls_takes_hooks_as_before():
    """A LayerNorm left unfused (its own eps) keeps its calls: hooks on it run as on the original."""

    class Mixed(PerFeatureLN):
        def __init__(self):
            super().__init__()
            self.lns[1] = nn.LayerNorm(D_, eps=0.5)

    g, ref = _pair(Mixed)
    g.get_submodule("lns.1").register_forward_hook(_double)
    ref.lns[1].register_forward_hook(_double)
    g.lin.register_forward_hook(lambda m, i, o: o * 3)
    ref.lin.register_forward_hook(lambda m, i, o: o * 3)
    x = torch.randn(4, F_ * D_)
    torch.testing.assert_close(g(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["shared_ln", "per_feature"])
def test_a_setting_of_a_fused_module_set_after_transform_is_refused(model):
    """Before: `transformed.ln.eps = 3.0` (the holder of a fused LayerNorm's tensors) or
    `transformed.lns[1].eps = 10.0` (its stand-in) set a plain attribute that the fused graph, which
    keeps eps=1e-5, never reads: y 0.37 (0.61) off the original, silently. Now RecfuseError naming
    `ln.eps` / `lns.1.eps`; tensors and train()/eval() are set as before."""
    g, ref = _pair(SharedLN if model == "shared_ln" else PerFeatureLN)
    path = "ln" if model == "shared_ln" else "lns.1"
    for copy_ in _copies(g):
        with pytest.raises(RecfuseError, match=f"`{path}.eps`"):
            copy_.get_submodule(path).eps = 3.0
        copy_.eval()
        copy_.train()
    new = torch.rand(D_) + 0.5
    g.lin.weight = nn.Parameter(torch.randn(H_, D_))
    ref.lin.weight = nn.Parameter(g.lin.weight.detach().clone())
    if model == "shared_ln":
        g.ln.weight = nn.Parameter(new.clone())
        ref.ln.weight = nn.Parameter(new.clone())
    x = torch.randn(4, F_ * D_)
    torch.testing.assert_close(g(x), ref(x), atol=1e-5, rtol=1e-5)


class LoRALinear(nn.Linear):
    """A Linear with a low-rank update in its forward (what an adapter library puts in place)."""

    def __init__(self, base):
        super().__init__(base.in_features, base.out_features)
        self.load_state_dict(base.state_dict())
        self.a = nn.Parameter(torch.randn(1, base.in_features))
        self.b = nn.Parameter(torch.randn(base.out_features, 1))

    def forward(self, x):
        return super().forward(x) + x @ self.a.t() @ self.b.t()


def test_replacing_a_fused_module_by_another_kind_is_refused():
    """Before: `transformed.lin = LoRALinear(...)` (a Linear subclass with its own forward) ran the
    fused op on its weight and bias alone: y 6.4 off the original with the same replacement; a
    LayerNorm(eps=2.0) put at `ln` (setattr, add_module or register_module) kept the fused eps=1e-5:
    y 0.16-0.32 off; a new LayerNorm at the
    stand-in `lns.1` was never read: y off, silently. Now each raises RecfuseError naming the path;
    a module of the same class and settings still replaces it (its tensors are read, as before),
    and refuses hooks as the one it replaced."""
    g, ref = _pair(SharedLN)
    with pytest.raises(RecfuseError, match="replace `lin` with this LoRALinear"):
        g.lin = LoRALinear(ref.lin)
    with pytest.raises(RecfuseError, match="replace `ln` with this LayerNorm"):
        g.ln = nn.LayerNorm(D_, eps=2.0)
    with pytest.raises(RecfuseError, match="replace `ln` with this LayerNorm"):
        g.add_module("ln", nn.LayerNorm(D_, eps=2.0))
    with pytest.raises(RecfuseError, match="replace `ln` with this LayerNorm"):
        g.register_module("ln", nn.LayerNorm(D_, eps=2.0))
    lin = nn.Linear(D_, 3)  # another H: the graph reads the weight's shape at each call
    ln = randomized(nn.LayerNorm(D_))
    g.lin, ref.lin = lin, copy.deepcopy(lin)
    g.ln, ref.ln = ln, copy.deepcopy(ln)
    x = torch.randn(4, F_ * D_)
    torch.testing.assert_close(g(x), ref(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(RecfuseError, match="hook on `ln`"):
        g.ln.register_forward_hook(_double)

    g, ref = _pair(PerFeatureLN)
    with pytest.raises(RecfuseError, match="cannot replace `1`"):
        setattr(g.lns, "1", nn.LayerNorm(D_))


@pytest.mark.parametrize("B", [1, 0])
def test_an_in_place_activation_on_the_fused_result_at_batch_one(B):
    """Before: `F.relu(self.lin(h), inplace=True)` after the stack became feature_mlp(...,
    out_activation=None) followed by the in-place relu; at B == 1 (and B == 0) the op's composite
    returned a view (the [F, 1, H] -> [1, F, H] transpose is contiguous, so .contiguous() kept the
    view) and the in-place relu raised "Output 0 of _EagerLnTanhLinearRelu is a view and is being
    modified inplace" where the original runs. The same for `recfuse.feature_mlp(...).relu_()`
    called directly at B == 1 or F == 1."""

    class InplaceRelu(PerFeatureLN):
        def forward(self, x):
            h = torch.stack([torch.tanh(n(t)) for n, t in zip(self.lns, x.split(D_, 1))], 1)
            return F.relu(self.lin(h), inplace=True)

    g, ref = _pair(InplaceRelu)
    x = torch.randn(B, F_ * D_)
    xg, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yg, yr = g(xg), ref(xr)
    torch.testing.assert_close(yg, yr, atol=1e-5, rtol=1e-5)
    (yg * 2).sum().backward()
    (yr * 2).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, atol=1e-4, rtol=1e-4)

    for shape in ((1, 3, 4), (2, 1, 4)):
        xs = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        w = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
        y = recfuse.feature_mlp(xs, w, norm="layer_norm", out_activation=None, feature_dim=1).relu_()
        expected = recfuse.reference.feature_mlp(xs, w, norm="layer_norm", out_activation=None, feature_dim=1).relu()
        torch.testing.assert_close(y, expected)
        y.sum().backward()
