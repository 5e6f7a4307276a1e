"""Red-team round 15: what a user does with the results of `recfuse.transform` and
`FusedFeatureProcessor` around the calls (the transform's options cuda_graph / verify /
stack_parameters, checkpoints, module arguments, replacing what fusion stacked, grad and inference
modes inside forward), on CPU. Each test compares with the untouched original model (a deep copy taken
before `transform`) or an eager per-feature reference, or checks the error that refuses the case;
each docstring says what the case gave before its fix.

Found wrong (each a test below that fails before its fix):

1. `transform(model, x, cuda_graph=True)` (accepted on CPU too) built its replaying module from the
   GraphModule, whose constructor keeps only what the graph reads: the model's forward hooks and
   pre-hooks were silently dropped (y 2.38 off with an ``out * 3 + 1`` hook) and so was the state the
   graph does not read (an unused Linear, buffers: the original's state_dict failed to load).
   Fixed in `fx/transform.py` `_replaying` (restores them as deepcopy / torch.load do).
2. `FusedFeatureProcessor.load_state_dict` of a checkpoint saved with *other* feature names of the
   same count (a feature dropped, another added) loaded row by row: a kept feature got the dropped
   feature's weights (1.06 off), silently; only a permutation of the same names was refused.
   Now refused naming the features that differ (`module/processor.py`).
3. A module argument of a transformed function (`transform(fn, (x, lin))`) changed after transform
   (``lin.weight.add_``, an optimizer step on `lin`, ``.data =``, a new Parameter) and passed again:
   the graph computed with its copy's old weights, 0.35 off ``fn(x, lin)``, silently. Now refused
   (`fx/runtime.py` `check_module_argument`: identity, version and data pointer of its parameters).
4. `torch.inference_mode()` inside forward (a block or a decorated method): invisible to the fx
   trace (a C++ guard), and Dynamo's enter/exit nodes were dropped as dead code, so the transformed
   model recorded autograd through the features the original computes under inference_mode: the
   stacked LayerNorm parameters and `lin` got gradients the original never gives them and an
   optimizer trained them. Now a `no_grad` region in both capture paths (`fx/capture.py`);
   `inference_mode(False)` in forward is refused.
5. ``verify=True`` / `recfuse.fx.verify` on any model with a frozen parameter raised torch's "One of
   the differentiated Tensors does not require grad". Fixed (`fx/transform.py`); a requires_grad that
   differs between original and result is now a verify failure.
6. An original state_dict key of a stacked row with another shape: a checkpoint of another D raised a
   bare "The expanded size of the tensor ..." RuntimeError, and a scalar was broadcast over the whole
   row silently (the original refuses both as "size mismatch"). Now torch's size-mismatch message,
   naming the row (`fx/graph_module.py` `map_original_keys`).
7. Unclear errors: assigning an ``nn.Parameter`` under an original name that fusion stacked
   (``transformed.lns.1.weight = nn.Parameter(...)``) raised a bare ``KeyError: "attribute 'weight'
   already exists"`` (now the RecfuseError naming the stacked parameter and row); a sparse buffer input
   to FusedFeatureProcessor failed in aten::view (now refused by name).

Probed and found right (probe scripts, no test of their own): FusedFeatureProcessor's bound fast
path with feature_dim as -2 / numpy / 0-dim tensor (refused or right), torch.func.functional_call
with plain and transposed-stride tensors, grads through it, torch.func.grad and vmap of the module;
the compiled CPU backend (the default; the suite runs eager) through the module over [B, F*D]
buffers, reordered KeyedTensors (H = 12, bmm path), mixed dims, bf16 inputs with fp32 parameters and
[F, B, D] views, B = 5, 1, 9, 5 (y and every gradient within 2.3e-7 fp32, 5.7e-3 bf16 of float64);
a transformed model over batch sizes 5, 1, 7, 0, 2 with gradients accumulated; transform and explain
leave the original's module classes, hook dicts and settings as they were; stack_parameters=False
with parameters replaced, `.data` set, `.double()`, save/load, the original's state_dict and
gradients; FusedFeatureProcessor nested in a model that is transformed; input widths other than the
example's with zip / chunk / unbind / reversed / negative / tail slices (guarded or right);
no_grad / set_grad_enabled / detach / saved_tensors_hooks around the features; cuda_graph=True with
eval()/train(), BatchNorm and dropout; bad FusedFeatureProcessor inputs (int, complex, 1D, 4D,
wrong width or D, meta, dicts with missing keys / other B / 1D values, a list): clear errors.

Known, not fixed (reported):
* State-dict hooks of the model itself (``_register_load_state_dict_pre_hook`` that upgrades old
  checkpoint keys, ``_register_state_dict_hook``) are not carried to the transformed model: an old
  checkpoint fails a strict load and is silently partly skipped by ``strict=False`` (the original
  loads it). Carrying them also needs `TransformedGraphModule._load_from_state_dict` to run them
  before it maps the original keys onto the stacked rows.
* A module argument trained through the transformed call's gradients is not: backward reaches the
  copy, so an optimizer built on the original `lin` steps nothing (no error; README says the
  result owns copies). Only a *changed* `lin` passed again is refused now.
* ``transformed.lns.1.weight`` (a stacked-away name) reads as None, so ``.data = ...`` on it fails
  with "'NoneType' object has no attribute 'data'" (None is what functional_call needs there).
* The eager composite warns "var_mean(): degrees of freedom is <= 0" on a B = 0 call.
* `recfuse.fx.verify` passes a tensor whose relative error in norm is under rtol even if one element
  is far off (its `_max_diff` accepts either criterion).
"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from fx_cases import GradReverse, reloaded  # torch.fx cannot keep it: such models go to Dynamo

F_, D_, H_ = 3, 8, 2


class PerFeature(nn.Module):
    """split -> per-feature LayerNorm -> tanh -> stack -> shared Linear -> relu, with state the
    forward never reads (an unused Linear, a persistent and a non-persistent buffer)."""

    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(D_) for _ in range(F_))
        self.lin = nn.Linear(D_, H_)
        self.unused = nn.Linear(2, 2)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("scratch", torch.ones(3), persistent=False)
        with torch.no_grad():
            for ln in self.lns:
                ln.weight.normal_()
                ln.bias.normal_()

    def forward(self, x):
        ts = [torch.tanh(ln(p)) for ln, p in zip(self.lns, x.split(D_, 1))]
        return torch.relu(self.lin(torch.stack(ts, 1)))


def _halve_input(mod, args):
    return (args[0] * 0.5,)


def _affine_output(mod, args, out):
    return out * 3.0 + 1.0


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# -- transform(..., cuda_graph=True): the replaying module kept only what its graph reads --------


@pytest.mark.parametrize("copy_how", ["none", "deepcopy", "save_load"])
def test_cuda_graph_result_keeps_forward_hooks_and_unread_state(copy_how):
    """Before: `transform(model, x, cuda_graph=True)` (accepted on any device; CPU calls run the
    graph as usual) built its `CudaGraphReplayModule` from the transformed GraphModule, whose
    constructor keeps only what the graph reads: the model's forward hook and forward pre-hook
    were dropped (y 2.38 off the original, max abs, with a hook ``out * 3 + 1``), and so were the
    unused Linear and the buffers (``state_dict`` lacked ``unused.weight``, ``unused.bias``,
    ``steps``; the original's state_dict failed to load: "Unexpected key(s)"). Same result with
    cuda_graph=False, which has kept them since round 5."""
    model = PerFeature()
    model.register_forward_pre_hook(_halve_input)
    model.register_forward_hook(_affine_output)
    ref = copy.deepcopy(model)
    x = torch.randn(4, F_ * D_)
    g = recfuse.transform(model, (x,), cuda_graph=True)
    assert "CudaGraphReplayModule" in [c.__name__ for c in type(g).__mro__]
    if copy_how == "deepcopy":
        g = copy.deepcopy(g)
    elif copy_how == "save_load":
        g = reloaded(g)
    _close(g(x), ref(x))
    stacked = {o for olds in g.stacked_parameters().values() for o in olds}
    assert set(ref.state_dict()) - stacked <= set(g.state_dict())
    assert "scratch" not in g.state_dict()  # still non-persistent
    other = PerFeature()
    g.load_state_dict(other.state_dict())  # strict: every key of the original is known
    other.register_forward_pre_hook(_halve_input)
    other.register_forward_hook(_affine_output)
    _close(g(x), other(x))
    g.eval()
    other.eval()
    with torch.no_grad():
        _close(g(x), other(x))


# -- FusedFeatureProcessor.load_state_dict of a module with other features -----------------------


def _randomized_ffp(names, **kw):
    fp = recfuse.FusedFeatureProcessor(names, 4, out_features=2, **kw)
    with torch.no_grad():
        for p in fp.parameters():
            p.normal_()
    return fp


@pytest.mark.parametrize("how", ["state_dict", "saved_file", "extra_state_only"])
def test_state_dict_of_other_features_is_refused_not_loaded_by_position(how):
    """Before: a checkpoint saved by FusedFeatureProcessor(["u", "i", "c"]) loaded without error
    into one built with ["u", "c", "x"] (feature "i" dropped, "x" added, same count): rows load by
    position, so "c" got the dropped "i"'s weights and "x" got "c"'s ("<All keys matched
    successfully>"); outputs of "c" 1.06 off (max abs, normal(0, 1) parameters, B=5). Only a permutation of the same names was
    refused (round 4). An eager per-feature ModuleDict refuses the missing and unexpected keys."""
    a = _randomized_ffp(["u", "i", "c"], shared_linear=False)
    b = recfuse.FusedFeatureProcessor(["u", "c", "x"], 4, out_features=2, shared_linear=False)
    sd = a.state_dict()
    if how == "saved_file":
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        sd = torch.load(buf)
    elif how == "extra_state_only":
        sd = dict(sd)  # no _metadata: the names travel in `_extra_state` only
    before = {k: v.clone() for k, v in b.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"saved by a module with features \['u', 'i', 'c'\].*not saved: "
                                               r"\['x'\]; not in this module: \['i'\]"):
            b.load_state_dict(sd, strict=strict)
    for k, v in b.state_dict().items():  # nothing loaded
        assert torch.equal(v, before[k]), k
    # the same names load, and a module with no per-feature rows loads whatever its features
    same = recfuse.FusedFeatureProcessor(["u", "i", "c"], 4, out_features=2, shared_linear=False)
    same.load_state_dict(sd)
    x = torch.randn(5, 12)
    _close(same(x), a(x))
    shared = _randomized_ffp(["u", "i", "c"], shared_layer_norm=True)
    recfuse.FusedFeatureProcessor(["p", "q", "r"], 4, out_features=2, shared_layer_norm=True).load_state_dict(
        shared.state_dict())


def test_state_dict_of_a_renamed_feature_inside_a_model_is_refused():
    """Before: the same silent positional load one level down (``model.proc``), via the
    state_dict's `_metadata`."""
    a = nn.Sequential(_randomized_ffp(["u", "i"], shared_linear=False))
    b = nn.Sequential(recfuse.FusedFeatureProcessor(["u", "v"], 4, out_features=2, shared_linear=False))
    with pytest.raises(RuntimeError, match=r"at '0': the state_dict was saved by a module with features \['u', 'i'\]"):
        b.load_state_dict(a.state_dict())


# -- assigning a Parameter under a name fusion stacked away --------------------------------------


def test_a_parameter_assigned_under_a_stacked_name_is_refused_by_name():
    """Before: ``transformed.lns[1].weight = nn.Parameter(...)`` (through `get_submodule`, as the
    GraphModule's holders are plain modules) raised nn.Module's bare ``KeyError: "attribute
    'weight' already exists"``: nothing said that fusion stacked `lns.1.weight` into row 1 of
    `recfuse_g0_ln_weight`. A plain tensor assigned there already raised that RecfuseError."""
    model = PerFeature()
    x = torch.randn(4, F_ * D_)
    g = recfuse.transform(model, (x,))
    owner = g.get_submodule("lns.1")
    with pytest.raises(recfuse.RecfuseError, match=r"`lns\.1\.weight` of the original model is row 1 of the "
                                                   r"parameter `recfuse_g0_ln_weight`"):
        owner.weight = nn.Parameter(torch.ones(D_))
    with pytest.raises(recfuse.RecfuseError, match=r"`lns\.1\.bias` of the original model is row 1"):
        owner.register_parameter("bias", nn.Parameter(torch.ones(D_)))
    with pytest.raises(recfuse.RecfuseError, match=r"`lns\.1\.weight` of the original model is row 1"):
        owner.weight = torch.ones(D_)
    _close(g(x), model(x))  # nothing was set
    # a new name on the holder is an ordinary parameter
    owner.register_parameter("extra", nn.Parameter(torch.ones(1)))
    assert "lns.1.extra" in dict(g.named_parameters())


# -- a module argument changed after transform ---------------------------------------------------


def _split_stack_fn(x, lin):
    ts = [torch.tanh(F.layer_norm(p, (D_,))) for p in x.split(D_, 1)]
    return torch.relu(lin(torch.stack(ts, 1)))


@pytest.mark.parametrize("change", ["add_", "optimizer_step", "data", "new_parameter"])
def test_a_module_argument_changed_after_transform_is_refused(change):
    """Before: `transform(fn, (x, lin))` owns a copy of `lin` and accepts a call passing the very
    `lin` (or none); after ``lin.weight.add_(1)`` (an optimizer step on `lin`, ``.data = ...``,
    a new Parameter) a call ``g(x, lin)`` still computed with the copy's old weights, silently:
    0.35 off ``fn(x, lin)`` (max abs, D=8 H=2) with no error. Now such a call is refused naming
    the argument; the copy's own training (call without `lin`) is unaffected."""
    fn = _split_stack_fn
    lin = nn.Linear(D_, H_)
    x = torch.randn(4, F_ * D_)
    g = recfuse.transform(fn, (x, lin))
    _close(g(x, lin), fn(x, lin))
    _close(g(x), fn(x, lin))
    if change == "add_":
        with torch.no_grad():
            lin.weight.add_(1.0)
    elif change == "optimizer_step":
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        fn(x, lin).pow(2).sum().backward()
        opt.step()
    elif change == "data":
        lin.bias.data = torch.full((H_,), 3.0)
    else:
        lin.weight = nn.Parameter(torch.randn(H_, D_))
    assert (fn(x, lin) - g(x)).abs().max() > 1e-3  # the copy still holds the old values
    with pytest.raises(recfuse.RecfuseError, match=r"argument `lin` changed since recfuse.transform"):
        g(x, lin)
    # training the copy, called without the argument, as before
    copy_params = [p for n, p in g.named_parameters() if n.startswith("lin.")]
    assert copy_params
    opt = torch.optim.SGD(g.parameters(), lr=0.1)
    g(x).sum().backward()
    opt.step()
    g(x)


# -- the original's state_dict keys of stacked rows, with another shape ---------------------------


class _PerFeatureD(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.lns = nn.ModuleList(nn.LayerNorm(d) for _ in range(F_))
        self.lin = nn.Linear(d, H_)

    def forward(self, x):
        ts = [torch.tanh(ln(p)) for ln, p in zip(self.lns, x.split(self.d, 1))]
        return torch.relu(self.lin(torch.stack(ts, 1)))


@pytest.mark.parametrize("strict", [True, False])
def test_a_stacked_row_of_another_shape_is_a_size_mismatch_not_a_broadcast(strict):
    """Before: loading the original's keys into the stacked parameters did ``row[i] = value``:
    a checkpoint of a D=16 model into a D=8 transformed one raised a bare "The expanded size of the
    tensor (8) must match the existing size (16)" (the original: "size mismatch for lns.0.weight"),
    and a scalar ``lns.1.weight`` (which the original refuses as a size mismatch) was broadcast
    over row 1 silently: every weight of feature 1 became 5.0."""
    model = _PerFeatureD(D_)
    g = recfuse.transform(copy.deepcopy(model), (torch.randn(4, F_ * D_),))
    with pytest.raises(RuntimeError, match=r"size mismatch for lns\.0\.weight: copying a param with shape "
                                           r"torch\.Size\(\[16\]\) from checkpoint, the shape in current model is "
                                           r"torch\.Size\(\[8\]\) \(row 0 of `recfuse_g0_ln_weight`"):
        g.load_state_dict(_PerFeatureD(16).state_dict(), strict=strict)
    sd = model.state_dict()
    sd["lns.1.weight"] = torch.tensor(5.0)
    with pytest.raises(RuntimeError, match="size mismatch for lns.1.weight"):
        copy.deepcopy(model).load_state_dict(sd, strict=strict)  # what the original says
    before = g.recfuse_g0_ln_weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"size mismatch for lns\.1\.weight: copying a param with shape "
                                           r"torch\.Size\(\[\]\)"):
        g.load_state_dict(sd, strict=strict)
    assert torch.equal(g.recfuse_g0_ln_weight[1], before[1])  # row 1 not overwritten by the scalar
    # matching shapes still load, from the original's keys and in another dtype
    other = _PerFeatureD(D_)
    with torch.no_grad():
        for ln in other.lns:
            ln.weight.normal_()
    g.load_state_dict({k: v.double() for k, v in other.state_dict().items()}, strict=strict)
    x = torch.randn(5, F_ * D_)
    _close(g(x), other(x))


# -- verify=True on a model with a frozen parameter ----------------------------------------------


@pytest.mark.parametrize("frozen", ["lin", "lns.1", "lns", "everything"])
def test_verify_takes_a_model_with_frozen_parameters(frozen):
    """Before: ``transform(model, x, verify=True)`` (and `recfuse.fx.verify`) raised torch's
    "RuntimeError: One of the differentiated Tensors does not require grad" for any model with a
    frozen parameter (a frozen Linear, one frozen LayerNorm, all of them): it asked autograd for the
    gradient of every parameter. Now frozen parameters are left out of the gradient comparison, and
    a requires_grad that differs between the original and the result is itself a failure."""
    model = PerFeature()
    model.get_submodule(frozen).requires_grad_(False) if frozen != "everything" else model.requires_grad_(False)
    x = torch.randn(4, F_ * D_)
    g = recfuse.transform(model, (x,), verify=True)
    _close(g(x), model(x))
    assert recfuse.fx.verify(model, g, (x,)) < 1e-4
    if frozen == "lin":
        g.lin.weight.requires_grad_(True)  # the result would train what the original does not
        with pytest.raises(recfuse.RecfuseError, match=r"requires_grad of lin\.weight"):
            recfuse.fx.verify(model, g, (x,))


def test_a_sparse_buffer_input_is_refused_by_name():
    """Before: a sparse [B, F*D] input to FusedFeatureProcessor failed inside the plan's strided
    view with aten's "NotImplementedError: Could not run 'aten::view' with arguments from the
    'SparseCPU' backend"; the op names a sparse x, the module's own input check did not."""
    fp = recfuse.FusedFeatureProcessor(["a", "b", "c"], 4, out_features=2)
    x = torch.randn(5, 12)
    with pytest.raises(TypeError, match=r"input must be a dense \(strided\) tensor, got a sparse_coo tensor"):
        fp(x.to_sparse())
    _close(fp(x), fp.forward_reference(x))


# -- torch.inference_mode() inside forward -------------------------------------------------------


class FrozenFeatures(PerFeature):
    """The per-feature chain computed under inference_mode (a frozen feature extractor), a
    trainable head after it."""

    spelling = "with"

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(F_ * H_, 1)

    def features(self, x):
        return super().forward(x)

    @torch.inference_mode()
    def features_decorated(self, x):
        return super().forward(x)

    def forward(self, x):
        if self.spelling == "decorator":
            f = self.features_decorated(x)
        else:
            with torch.inference_mode():
                f = self.features(x)
        y = self.head(f.flatten(1).clone())  # clone: a normal tensor, as inference tensors need
        return GradReverse.apply(y) if self.spelling == "dynamo" else y


@pytest.mark.parametrize("spelling", ["with", "decorator", "dynamo"])
def test_inference_mode_inside_forward_keeps_its_region(spelling):
    """Before: `torch.inference_mode()` in forward enters a C++ guard that the fx capture never
    saw (and Dynamo's `_enter_inference_mode` / `_exit_inference_mode` nodes were dropped as dead
    code): the transformed model recorded autograd through the fused features, so backward gave
    gradients to the stacked LayerNorm parameters and `lin` (the original gives them none) and an
    optimizer step trained what the original keeps frozen. Now the block is a `torch.no_grad()`
    region of the graph: the same outputs, gradients only for the head."""
    model = FrozenFeatures()
    model.spelling = spelling
    ref = copy.deepcopy(model)
    x = torch.randn(4, F_ * D_)
    g = recfuse.transform(model, (x,))
    assert g.recfuse_report.groups and g.recfuse_report.groups[0].fusion == "vertical_ln_tanh_linear_relu"
    assert ("dynamo" in g.recfuse_report.capture) == (spelling == "dynamo")
    y, r = g(x), ref(x)
    _close(y, r)
    r.pow(2).sum().backward()
    y.pow(2).sum().backward()
    want = {n for n, p in ref.named_parameters() if p.grad is not None}
    got = {n for n, p in g.named_parameters() if p.grad is not None}
    assert want == {"head.weight", "head.bias"} and got == want
    for n in want:
        _close(dict(g.named_parameters())[n].grad, dict(ref.named_parameters())[n].grad, 1e-4)
    if spelling == "dynamo":
        return  # Dynamo's graph is guarded on the grad mode it was captured in (README)
    with torch.no_grad():  # the caller's mode is restored after the region
        _close(g(x), ref(x))
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


class _InferenceModeOff(PerFeature):
    def forward(self, x):
        with torch.inference_mode(False):
            return super().forward(x)


def test_inference_mode_false_inside_forward_is_refused():
    """`torch.inference_mode(False)` in forward turns grad mode on inside (the C++ guard): not a
    region the graph keeps, so it is refused by name (before: ignored, like the True case)."""
    with pytest.raises(recfuse.RecfuseError, match=r"torch\.inference_mode\(False\)"):
        recfuse.transform(_InferenceModeOff(), (torch.randn(4, F_ * D_),))
