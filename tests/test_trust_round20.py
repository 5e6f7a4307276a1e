"""Red-team round 20: process-wide settings a user sets around `recfuse.transform`,
`FusedFeatureProcessor` and the ops (``torch.set_default_dtype``, ``torch.use_deterministic_algorithms``,
TF32 / ``set_float32_matmul_precision``), slicing spellings at the edges (F = 1, 2; B = 0, 1; D = 1),
inputs that alias each other or the model's parameters, and copies of a transformed model
(``copy.copy``, ``share_memory``, whole-module torch.save), on CPU. Each test compares with the
untouched original model (a deep copy taken before `transform`) or the float64 reference, or checks
the error that refuses the case; each docstring says what the case gave before its fix.

Found wrong (each a test below that fails before its fix):

1. ``copy.copy(transformed)`` (a shallow copy, as people take of a model to wrap or to call in
   another mode) went through GraphModule.__copy__, which builds a *plain* GraphModule from the
   graph: the model's forward hooks were dropped (0.69 off ``copy.copy(original)`` with an
   ``out * 3 + 1`` hook, max abs / max(|ref|, 1)), the guard of a traced setting was gone
   (``copy.scale = 2.0`` silently ignored: 0.84 off in a probe without the hook), and so were the
   unused state, the stacked-row record and the original's state_dict keys (a load of the
   original's state_dict refused).
   Now `TransformedGraphModule.__copy__` (`fx/graph_module.py`) copies like nn.Module's shallow copy
   (its `__dict__`, the same parameters, submodules and hooks), the class made anew by recompiling;
   also for cuda_graph=True results.
2. The default dtype at transform time baked into the graph: a forward that makes a floating tensor
   from constants (``w = torch.ones(F) / F``, ``torch.tensor([...])``: torch.fx stores it as a
   `_tensor_constantN`) or reads ``torch.get_default_dtype()`` (``y.to(torch.get_default_dtype())``)
   gave, called under ``torch.set_default_dtype(torch.float64)`` after a float32 transform, a float32
   result where the original gives float64 (the original makes those tensors per call; the Dynamo
   capture did too), silently. Now such a graph checks the default dtype per call and refuses another
   one by name (`fx/capture.py` `_guard_default_dtype`, `fx/runtime.py` `check_default_dtype`);
   graphs that make nothing in the default dtype are not guarded.

Probed and found right (probe scripts; the cheap ones pinned below):
``torch.set_default_dtype(torch.float64)`` with float64 models and inputs through `transform`
(LayerNorm and RMSNorm with eps=None, whose eps follows the dtype), `FusedFeatureProcessor` (shared
and per-feature Linear, shared LayerNorm, mixed dims, [B, F*D] / [B, F, D] / dict inputs, B = 5, 1, 0,
train and eval, input gradients against a float64 loop) and the op (eager and compiled CPU backends:
within 2.3e-16; a float32 input to a float64 model is refused as the original refuses it);
``torch.use_deterministic_algorithms(True)`` with and without warn_only around transform, forward
and backward, and under the Triton interpreter with uninitialised memory filled with NaN (7 shapes
x shared / per-feature x both layouts x fp32 / bf16: no unwritten element reaches y or a gradient);
``torch.backends.cuda.matmul.allow_tf32`` and ``set_float32_matmul_precision("high" / "medium")``
(the CPU here has no bf16 matmul: nothing changes; the kernels do not read these flags); slices by
split, chunk, tensor_split, narrow, index lists on [B, F*D] and unbind, ``x[:, i]``, chunk /
tensor_split / narrow / index lists + squeeze on [B, F, D], F = 1 (left unfused) and 2, D = 1 and 3,
transformed at B = 1, 4, 0 and called at B = 4, 1, 3, 0 (D = 1: the original's own fp32 LayerNorm
leaves a 6e-5 x.grad where float64 and the fused op give 0); one tensor passed for two inputs (at
transform and at call, slices from either, cat / sum of both), an input that is a view of the
transformed model's stacked LayerNorm weight (the original fed the cat of its weights) and
`FusedFeatureProcessor` fed a view of its own ``ln_weight`` / ``ln_bias`` (gradients of both uses
summed); outputs of the transformed model, FFP (tensor, 3D, dict) and the op share no memory with
their inputs or with earlier calls' outputs; in-place ops on the output before backward (add_,
mul_, setitem, relu_, sigmoid_; the original raises where relu / sigmoid saved their output, the
fused op gives the out-of-place gradient); ``model.share_memory()`` of a transformed model and an
FFP, whole-module torch.save / torch.load of a transformed model and of its shallow copy;
``copy.copy`` of an FFP (eps and chain changed on the copy are keyed per call).
"""
import copy

import pytest
import torch
import torch.nn as nn

import recfuse
from recfuse.errors import RecfuseError
from trust_helpers import max_rel_err as _err, randomized as _randomized, reloaded as _reloaded

F_, D_, H_ = 3, 4, 5


class Features(nn.Module):
    """split -> per-slice LayerNorm -> tanh -> stack -> Linear -> relu, times a plain setting."""

    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(D_) for _ in range(F_))
        self.lin = nn.Linear(D_, H_)
        self.unused = nn.Linear(2, 2)
        self.scale = 1.5

    def forward(self, x):
        ts = [torch.tanh(ln(s)) for ln, s in zip(self.lns, x.split(D_, 1))]
        return torch.relu(self.lin(torch.stack(ts, 1))) * self.scale


def _hook(module, inputs, out):  # module level: torch.save pickles it
    return out * 3 + 1


# -- 1: copy.copy of a transformed model -------------------------------------------------------------


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_shallow_copy_keeps_hooks_setting_guards_and_state(cuda_graph):
    """Before: ``copy.copy(result)`` was a plain GraphModule: 0.69 off ``copy.copy(original)`` with
    the forward hook, ``copy.scale = 2.0`` accepted and ignored, the unused Linear and the
    stacked-row record gone (the original's state_dict refused)."""
    torch.manual_seed(0)
    model = _randomized(Features())
    model.register_forward_hook(_hook)
    x = torch.randn(5, F_ * D_)
    ref = copy.deepcopy(model)
    g = recfuse.transform(copy.deepcopy(model), (x,), cuda_graph=cuda_graph)
    c, rc = copy.copy(g), copy.copy(ref)
    assert _err(c(x), rc(x)) < 1e-5
    assert type(c).__mro__[1] is type(g).__mro__[1]
    assert c.stacked_parameters() == g.stacked_parameters()
    assert sorted(c.state_dict()) == sorted(g.state_dict())
    assert c.lin.weight is g.lin.weight  # shallow: the same parameters, as nn.Module's copy
    with pytest.raises(RecfuseError, match="scale"):
        c.scale = 2.0
    new = _randomized(copy.deepcopy(ref))
    c.load_state_dict(new.state_dict())
    rc.load_state_dict(new.state_dict())
    assert _err(c(x), rc(x)) < 1e-5
    assert _err(g(x), ref(x)) < 1e-5  # the rows are shared, as the original's copy shares them
    # training through the copy trains the shared parameters alike
    opt_c = torch.optim.SGD(c.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(rc.parameters(), lr=0.1)
    for m, opt in ((c, opt_c), (rc, opt_r)):
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()
    assert _err(g(x), ref(x)) < 1e-5
    assert _err(_reloaded(c)(x), rc(x)) < 1e-5


# -- 2: the default dtype ----------------------------------------------------------------------------


class ConstantWeights(Features):
    """Per-feature weights made in forward from constants (a floating tensor in the default dtype)."""

    def forward(self, x):
        y = super().forward(x)
        w = torch.ones(F_) / F_
        return (y * w[:, None]).sum(1)


class DefaultDtypeCast(Features):
    def forward(self, x):
        return super().forward(x).to(torch.get_default_dtype())


class RuntimeFactory(Features):
    """A factory whose size comes from the input: traced as a node, made per call (not guarded)."""

    def forward(self, x):
        return super().forward(x).sum(1) + torch.zeros(x.shape[0], 1)


@pytest.fixture
def default_dtype():
    saved = torch.get_default_dtype()
    yield
    torch.set_default_dtype(saved)


@pytest.mark.parametrize("cls", [ConstantWeights, DefaultDtypeCast])
def test_default_dtype_baked_into_the_graph_is_guarded(cls, default_dtype):
    """Before: under ``torch.set_default_dtype(torch.float64)`` after a float32 transform, a float32
    result where the original gives float64 (its constants / cast made per call), silently."""
    torch.manual_seed(0)
    model = _randomized(cls())
    x = torch.randn(5, F_ * D_)
    ref = copy.deepcopy(model)
    g = recfuse.transform(copy.deepcopy(model), (x,))
    assert _err(g(x), ref(x)) < 1e-5
    torch.set_default_dtype(torch.float64)
    assert ref(x).dtype == torch.float64
    for h in (g, copy.deepcopy(g), _reloaded(g)):
        with pytest.raises(RecfuseError, match="default dtype"):
            h(x)
    torch.set_default_dtype(torch.float32)
    assert _err(g(x), ref(x)) < 1e-5


@pytest.mark.parametrize("cls", [Features, RuntimeFactory])
def test_graph_without_default_dtype_constants_runs_under_another_default(cls, default_dtype):
    """Not refused where the graph holds nothing made in the default dtype: same dtype and numbers
    as the original under float64 default (a float32 model, float32 inputs)."""
    torch.manual_seed(0)
    model = _randomized(cls())
    x = torch.randn(5, F_ * D_)
    ref = copy.deepcopy(model)
    g = recfuse.transform(copy.deepcopy(model), (x,))
    torch.set_default_dtype(torch.float64)
    y, r = g(x), ref(x)
    assert y.dtype == r.dtype and _err(y, r) < 1e-5


def test_float64_default_models_train_and_eval(default_dtype):
    """A model, an FFP and the op built under ``torch.set_default_dtype(torch.float64)`` (float64
    parameters and inputs) against the original / float64 loop: y and gradients within 1e-12."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = _randomized(Features())
    x = torch.randn(5, F_ * D_)
    ref = copy.deepcopy(model)
    g = recfuse.transform(copy.deepcopy(model), (x,))
    for mode in ("train", "eval"):
        getattr(g, mode)()
        getattr(ref, mode)()
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, r = g(xg), ref(xr)
        assert y.dtype == torch.float64 and _err(y, r) < 1e-12
        gy = torch.randn_like(r)
        (y * gy).sum().backward()
        (r * gy).sum().backward()
        assert _err(xg.grad, xr.grad) < 1e-12
        assert _err(g.recfuse_g0_ln_weight.grad, torch.stack([ln.weight.grad for ln in ref.lns])) < 1e-12
        g.zero_grad()
        ref.zero_grad()
    fp = _randomized(recfuse.FusedFeatureProcessor(["a", "b", "c"], [4, 6, 4], out_features=3, shared_linear=False))
    assert fp.weight_d4.dtype == torch.float64
    xf = torch.randn(4, 14, requires_grad=True)
    y = fp(xf)
    assert y.dtype == torch.float64 and _err(y, fp.forward_reference(xf)) < 1e-12
    w = torch.randn(H_, D_, requires_grad=True)
    x3 = torch.randn(F_, 5, D_, requires_grad=True)
    y = recfuse.ln_tanh_linear_relu(x3, w)
    ref_y = recfuse.reference.ln_tanh_linear_relu(x3, w)
    assert y.dtype == torch.float64 and _err(y, ref_y) < 1e-12
    gy = torch.randn_like(y)
    a = torch.autograd.grad(y, (x3, w), gy)
    b = torch.autograd.grad(ref_y, (x3, w), gy)
    assert all(_err(p, q) < 1e-12 for p, q in zip(a, b))


@pytest.mark.parametrize("warn_only", [False, True])
def test_deterministic_algorithms_around_transform_and_backward(warn_only):
    """``torch.use_deterministic_algorithms(True)`` around transform, forward and backward of a
    transformed model and an FFP: no error, and the original's numbers (1e-5 / 1e-4 relative)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        torch.manual_seed(0)
        model = _randomized(Features())
        x = torch.randn(5, F_ * D_)
        ref = copy.deepcopy(model)
        g = recfuse.transform(copy.deepcopy(model), (x,))
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, r = g(xg), ref(xr)
        assert _err(y, r) < 1e-5
        gy = torch.randn_like(r)
        (y * gy).sum().backward()
        (r * gy).sum().backward()
        assert _err(xg.grad, xr.grad) < 1e-4
        assert _err(g.lin.weight.grad, ref.lin.weight.grad) < 1e-4
        fp = _randomized(recfuse.FusedFeatureProcessor(["a", "b"], 4, out_features=3))
        xf = torch.randn(3, 8, requires_grad=True)
        y = fp(xf)
        assert _err(y, fp.forward_reference(xf)) < 1e-5
        y.sum().backward()
        assert torch.isfinite(xf.grad).all()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# -- aliasing ----------------------------------------------------------------------------------------


class TwoInputs(nn.Module):
    """Slices taken from two inputs in turn."""

    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(D_) for _ in range(F_))
        self.lin = nn.Linear(D_, H_)

    def forward(self, a, b):
        sl = [(a if i % 2 == 0 else b)[:, i * D_:(i + 1) * D_] for i in range(F_)]
        return torch.relu(self.lin(torch.stack([torch.tanh(ln(s)) for ln, s in zip(self.lns, sl)], 1)))


def test_one_tensor_for_two_inputs_at_transform_and_at_call():
    """Transformed with the same tensor for both inputs, called with two (and the other way round,
    gradients of both uses summed): the original's numbers."""
    torch.manual_seed(0)
    model = _randomized(TwoInputs())
    a, b = torch.randn(5, F_ * D_), torch.randn(5, F_ * D_)
    ref = copy.deepcopy(model)
    aliased = recfuse.transform(copy.deepcopy(model), (a, a))
    assert _err(aliased(a, b), ref(a, b)) < 1e-5
    g = recfuse.transform(copy.deepcopy(model), (a, b))
    xg, xr = a.clone().requires_grad_(), a.clone().requires_grad_()
    y, r = g(xg, xg), ref(xr, xr)
    assert _err(y, r) < 1e-5
    y.square().sum().backward()
    r.square().sum().backward()
    assert _err(xg.grad, xr.grad) < 1e-4
