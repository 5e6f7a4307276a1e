"""Red-team round 17: spellings and usages a recommender engineer writes around `recfuse.transform`
and `FusedFeatureProcessor` that earlier rounds did not (activation and norm spellings, in-place
writes into the pooled embedding, one transformed module called twice, dtype casts and copies
after transform, checkpoints of mixed-dim processors and of transformed models), on CPU. Each
test compares with the untouched original model (a deep copy taken before `transform`) or the
eager per-feature loop, or checks the error that refuses the case; each docstring says what the
case gave before its fix.

Found wrong (each a test below that fails before its fix):

1. `FusedFeatureProcessor.load_state_dict` of a checkpoint saved with the same feature names but
   other embedding dims (``[4, 4, 8]`` saved, ``[4, 8, 4]`` loading): the dim groups' parameters
   (``weight_d4``, ``ln_weight_d4``, ...) had the same keys and shapes but other members, so
   "<All keys matched successfully>" and "c" computed exactly what the saver's "b" computes, "b"
   took "c"'s rows (every feature whose dim changed got another feature's weights; also with
   nothing per feature, where each feature took the other's group). Round 15's names check passed
   (same names). An eager per-feature ModuleDict refuses the size mismatch. Now refused naming the
   features and both dims (`module/processor.py`; mixed-dim modules save their dims in the
   state_dict's `_metadata` and in `_extra_state`, ``{"names": [...], "dims": [...]}``).
2. A transformed model's own checkpoint (``recfuse_g0_ln_weight`` [F, D], ...) loaded into another
   transform of the same model whose stacked rows stand for other features: a model that stacks
   its dict input in the dict's order (``for k, v in feats.items()``), transformed again with an
   example whose keys came in another order (a resumed job's first batch, a sharded EBC's
   KeyedTensor), or a forward that runs its two towers in the other order (groups numbered g1,
   g0). Rows loaded by position: "<All keys matched successfully>" and every feature computed with
   another's weights, 5.45 and 3.00 off the original given the same checkpoint (max abs),
   silently. Now `TransformedGraphModule._save_to_state_dict` keeps `stacked_parameters()` in the
   state_dict's metadata, and a load splits rows stacked otherwise into their original names,
   which `map_original_keys` puts where this transform holds them (`fx/graph_module.py`
   `unstack_saved_rows`); a loader built with stack_parameters=False (which refused the stacked
   keys) loads it too. Survives torch.save / torch.load (weights_only=True included).

Probed and found right (probe scripts, no test of their own unless below):

Spellings through `transform` (compiled and eager CPU backends), each against the original in
train and eval, every gradient, SGD / Adam steps and the original's state_dict loaded after
training: nn.GELU(approximate="tanh") and F.gelu(approximate="tanh") (-> gelu_tanh), silu written
as ``t * torch.sigmoid(t)`` (left unfused), nn.RMSNorm with eps=None and a hand-written RMSNorm
module (inlined; the silu -> Linear -> relu after it fused), LayerNorm(bias=False), LayerNorm and
RMSNorm without affine, GELU("tanh") / nn.SiLU as the out activation, LeakyReLU / Softplus(beta,
threshold) / ELU(alpha) (horizontal), per-feature LayerNorms of random eps (left unfused).
`.half()` / `.bfloat16()` / `.double()` of the result and the original (LayerNorm, RMSNorm eps=None
and 1e-6; fused within 16-bit rounding of float64, no worse than the original). In-place writes into
the pooled embedding (``p.mul_`` / ``relu_`` / ``clamp_`` / ``add_`` of a parameter on split or
``x[:, a:b]`` slices, ``x.mul_`` between the split and the norms, the processed value copied back
into the buffer): left unfused, same values and the same autograd errors as the original; the
buffer modified after forward and before backward raises the version-counter error in the
transformed model and FusedFeatureProcessor as in the original (where the original's RMSNorm does
not save x, the fused op still raises: loud). Shape arithmetic after the pattern (``y.sum(0) /
x.shape[0]``, ``math.sqrt(B)``, ``x.size(0)`` in ``torch.arange``, ``B // 2`` slices, a view by
``x.shape[0] * F``) over B = 5, 7, 2, 1, 4, 6: right; ``len(x)``, ``x.numel()``, ``if B > 4``,
``torch.full((B, ...), B * 0.5)``, ``torch.tensor(x.shape[0])`` (Dynamo): refused clearly on
another B. ``.item()`` / ``math.exp`` of a buffer (followed after load_state_dict and in-place
changes), ``float()`` of a parameter (refused), a buffer annealed in place in forward (left
unfused). ``if self.training`` branches (refused in the other mode), nn.LazyLinear (refused
uninitialized). torchrec KeyedTensors (4,4,4) and (4,8,4) through ``values().split
(length_per_key())``, ``to_dict()`` and ``kt[key]``, calls in other key orders and B = 1 (right or
refused by name). Nested transformed submodules: the parent's original state_dict strict and
non-strict (same missing_keys), the result's state_dict into another nested transform, torch.save.
FusedFeatureProcessor against an independent float64 loop over 80 random configurations (mixed
dims, all chains, shared / per-feature, bias, affine, eps None / 0.1, KeyedTensor / dict / [B,
F*D] / [B, F, D] / [F, B, D] inputs in shuffled key orders, fp32 and bf16 inputs, three calls of
B = 1-5 per module, compiled and eager backends): y, input and parameter gradients within 1e-4
(fp32) and no worse than the bf16 loop; outliers were D = 2 LayerNorms (ill-conditioned, as
PyTorch's own fp32) and cancelling gradients. The op's compiled CPU path against float64 over 60
random shapes / parameter kinds / layouts / strides: outliers only at D <= 2 or eps = 0 with tiny
inputs (ill-conditioned; the reference's gradient norm ~0).

Not fixed (reported):

* A *global* module hook registered after transform
  (``torch.nn.modules.module.register_module_forward_hook``) runs on the modules the graph still
  calls but not on those fusion replaced (``lns.0``, ``lin``): a hook that changes outputs (here:
  clamps every Linear's output) leaves the result 0.125 off the original, silently. Refusing would
  also refuse PyTorch's observers that use global hooks (FlopCounterMode's ModTracker,
  CommDebugMode, torch.utils.module_tracker), which change nothing. Now a warning through
  ``logging`` (once per model and set of hooks) names the replaced modules
  (`graph_module._note_global_hooks`; the last test below).
* Finding 2 maps the *model's* rows by name; an optimizer state_dict saved with the first
  transform (Adam's exp_avg of ``recfuse_g0_ln_weight``) still loads by position into the second,
  so on resume the moments of the reordered rows belong to other features. A state_dict without
  its `_metadata` (``dict(sd)``, safetensors) still loads the model's stacked rows by position.
* Module-type walks over the result (``isinstance(m, nn.LayerNorm)`` to keep norms in float32
  after ``.half()``, to pick weight-decay groups or to re-initialise) do not see the fused modules
  (their paths hold `_FusedAway` / `_FusedHolder`), so such a recipe applied after transform
  silently treats the stacked parameters differently (the README's "Parameter names" caveat,
  for module types).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from trust_helpers import close as _close, randomized as _randomized, reloaded as _reloaded

D_, H_ = 4, 2


# -- FusedFeatureProcessor checkpoints: the same features with other embedding dims ---------------


@pytest.mark.parametrize("how", ["state_dict", "saved_file", "extra_state_only", "nested"])
@pytest.mark.parametrize("saver_dims,loader_dims,kw", [
    ((4, 4, 8), (4, 8, 4), {}),
    ((4, 4, 8), (4, 8, 4), {"shared_linear": False}),
    ((4, 8), (8, 4), {"shared_layer_norm": True}),  # nothing per feature: the groups' members differ
])
def test_state_dict_of_features_with_other_dims_is_refused(how, saver_dims, loader_dims, kw):
    """Before: a checkpoint of FusedFeatureProcessor(["a", "b", "c"], [4, 4, 8]) loaded into one
    built with dims [4, 8, 4] ("<All keys matched successfully>"): the dim groups' parameters
    (``weight_d4``, ``ln_weight_d4``, ...) have the same keys and shapes, but group d4 holds rows
    of a, b there and a, c here, so "c" got "b"'s weights and "b" got "c"'s (with everything
    shared per group, [4, 8] -> [8, 4], each feature took the other's group), silently: "c"
    computed exactly what the saver's "b" computes. The names matched, so round 15's check passed.
    An eager per-feature ModuleDict refuses the size mismatch. Now refused, naming the features and
    both dims; the same dims (or a reordered module of the same dims and shared rows) still load."""
    names = ["a", "b", "c"][:len(saver_dims)]
    saver = _randomized(recfuse.FusedFeatureProcessor(names, list(saver_dims), out_features=H_, **kw))
    loader = recfuse.FusedFeatureProcessor(names, list(loader_dims), out_features=H_, **kw)
    src, dst = saver, loader
    if how == "nested":
        src, dst = nn.Sequential(saver), nn.Sequential(loader)
    sd = src.state_dict()
    if how == "saved_file":
        sd = _reloaded(sd)
    elif how == "extra_state_only":
        sd = dict(sd)  # no _metadata: the dims travel in `_extra_state`
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    changed = [(n, s, d) for n, s, d in zip(names, saver_dims, loader_dims) if s != d]
    text = ", ".join(f"'{n}': {s} there, {d} here" for n, s, d in changed)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"saved by a module whose features have other embedding dims \("
                                               + text + r"\).*embedding_dims=\["):
            dst.load_state_dict(sd, strict=strict)
    for k, v in dst.state_dict().items():  # nothing loaded
        assert torch.equal(v, before[k]), k
    same = recfuse.FusedFeatureProcessor(names, list(saver_dims), out_features=H_, **kw)
    (nn.Sequential(same) if how == "nested" else same).load_state_dict(sd)
    x = torch.randn(5, sum(saver_dims))
    _close(same(x), saver(x))


def test_state_dict_of_mixed_dims_loads_into_the_same_features_by_name_when_rows_are_shared():
    """Pinned: the same features and dims in another order, everything shared per dim group (no
    per-feature rows), load as an eager loop with one Linear and one LayerNorm per dim would; a
    checkpoint of a single-dim module (no dims saved) is unchanged."""
    saver = _randomized(recfuse.FusedFeatureProcessor(["a", "b", "c"], [4, 8, 4], out_features=H_,
                                                      shared_layer_norm=True))
    loader = recfuse.FusedFeatureProcessor(["c", "b", "a"], [4, 8, 4], out_features=H_, shared_layer_norm=True)
    loader.load_state_dict(dict(saver.state_dict()))
    feats = {n: torch.randn(5, d) for n, d in zip("abc", (4, 8, 4))}
    got, want = loader(feats), saver(feats)
    for n in feats:
        _close(got[n], want[n])
    single = recfuse.FusedFeatureProcessor(["a", "b"], 4)
    assert recfuse.FusedFeatureProcessor._decode_names(single.state_dict()["_extra_state"]) == ["a", "b"]
    assert recfuse.FusedFeatureProcessor._decode_dims(single.state_dict()["_extra_state"]) is None


# -- a transformed model's own checkpoint loaded into another transform of the model --------------


class DictFeatures(nn.Module):
    """Per-feature LayerNorm -> tanh -> Linear -> relu over a dict of pooled embeddings, stacked in
    the dict's order (``feats.items()``): a transform stacks the features in its example's key order."""

    def __init__(self, names=("u", "i", "c")):
        super().__init__()
        self.lns = nn.ModuleDict({k: nn.LayerNorm(D_) for k in names})
        self.lins = nn.ModuleDict({k: nn.Linear(D_, H_) for k in names})
        _randomized(self)

    def forward(self, feats: dict):
        return torch.stack([torch.relu(self.lins[k](torch.tanh(self.lns[k](v)))) for k, v in feats.items()], 1)


class TwoTowers(nn.Module):
    """Two per-feature groups of one shape; `order` says which the forward runs first (the
    transform numbers its stacked groups g0, g1 in graph order)."""

    def __init__(self, order=("user", "item")):
        super().__init__()
        self.order = order
        self.towers = nn.ModuleDict({t: nn.ModuleList(nn.LayerNorm(D_) for _ in range(2)) for t in ("user", "item")})
        self.lins = nn.ModuleDict({t: nn.Linear(D_, H_) for t in ("user", "item")})
        _randomized(self)

    def forward(self, user, item):
        xs = {"user": user, "item": item}
        out = {}
        for t in self.order:
            ts = [torch.tanh(ln(p)) for ln, p in zip(self.towers[t], xs[t].split(D_, 1))]
            out[t] = torch.relu(self.lins[t](torch.stack(ts, 1)))
        return out["user"] - out["item"]


def _sgd_step(model, inputs):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    y = model(*inputs)
    (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
    opt.step()


def _all_close(a, b, tol=1e-5):
    _close(a, b, tol)


@pytest.mark.parametrize("case", ["dict_order", "group_order", "unstacked_loader", "nested", "saved_file"])
def test_transformed_checkpoint_loads_by_name_into_another_transform(case, caplog):
    """Before: a state_dict of a transformed model (``recfuse_g0_ln_weight`` [F, D], ...) loaded
    row by row into another transform of the same model whose rows stand for other features:
    a dict input whose keys came in another order at transform time (a resumed job's first batch,
    a sharded EBC's KeyedTensor.to_dict()) stacks the features in that order, and a forward that
    runs its two towers in the other order numbers the groups the other way. "<All keys matched
    successfully>", and every feature computed with another's weights: 5.45 (dict order, also
    nested and through a saved file) and 3.00 (towers swapped) off the original given the same
    checkpoint (max abs), silently; a loader built with stack_parameters=False refused the
    stacked keys. Now the state_dict's metadata keeps each stacked parameter's original names
    (`stacked_parameters()`), and a load splits rows stacked otherwise into those names, which go
    where this transform holds them."""
    torch.manual_seed(0)
    if case == "group_order":
        model = TwoTowers(("user", "item"))
        inputs = (torch.randn(5, 2 * D_), torch.randn(5, 2 * D_))
        other_model, other_inputs = TwoTowers(("item", "user")), inputs
    else:
        model = DictFeatures()
        feats = {k: torch.randn(5, D_) for k in ("u", "i", "c")}
        inputs = (feats,)
        other_model, other_inputs = DictFeatures(), ({k: feats[k] for k in ("c", "u", "i")},)
    ref = copy.deepcopy(model)
    saver = recfuse.transform(model, inputs)
    _sgd_step(saver, inputs)  # the checkpoint is a trained one
    _sgd_step(ref, inputs)
    loader = recfuse.transform(other_model, other_inputs, stack_parameters=case != "unstacked_loader")
    src, dst = saver, loader
    if case == "nested":
        src, dst = nn.ModuleDict({"proc": saver}), nn.ModuleDict({"proc": loader})
    sd = src.state_dict()
    if case == "saved_file":
        sd = _reloaded(sd)
    with caplog.at_level("WARNING", logger="recfuse"):
        assert str(dst.load_state_dict(sd)) == "<All keys matched successfully>"
    # the rows moved: an optimizer state saved beside the checkpoint would not, which is said
    moved = [r.getMessage() for r in caplog.records if "optimizer state_dict" in r.getMessage()]
    assert bool(moved) == (case != "unstacked_loader"), moved
    want = ref(*other_inputs)
    _all_close(loader(*other_inputs), want)
    _all_close(saver(*inputs), ref(*inputs))
    # and back: the loader's checkpoint into the saver's transform
    back = recfuse.transform(copy.deepcopy(ref), inputs)
    _randomized(back)
    back.load_state_dict(loader.state_dict())
    _all_close(back(*inputs), ref(*inputs))


# -- probed and right: pinned ---------------------------------------------------------------------


class Spelled(nn.Module):
    """Per-feature norm -> activation, one shared Linear -> out activation, in the spelling given."""

    def __init__(self, norm, act, out_act, F=3):
        super().__init__()
        self.norms = nn.ModuleList(norm() for _ in range(F))
        self.act, self.out_act = act, out_act
        self.lin = nn.Linear(D_, H_)
        _randomized(self)

    def forward(self, x):
        ts = [self.act(n(p)) for n, p in zip(self.norms, x.split(D_, 1))]
        return self.out_act(self.lin(torch.stack(ts, 1)))


SPELLINGS = {
    "GELU(approximate='tanh') module": (lambda: nn.LayerNorm(D_), nn.GELU(approximate="tanh"), torch.relu),
    "F.gelu(approximate='tanh')": (lambda: nn.LayerNorm(D_), lambda t: F.gelu(t, approximate="tanh"), torch.relu),
    "silu written out (left unfused)": (lambda: nn.LayerNorm(D_), lambda t: t * torch.sigmoid(t), torch.relu),
    "RMSNorm(eps=None) -> F.silu": (lambda: nn.RMSNorm(D_), F.silu, torch.relu),
    "LayerNorm(bias=False)": (lambda: nn.LayerNorm(D_, bias=False), torch.tanh, torch.relu),
    "RMSNorm without affine -> sigmoid": (lambda: nn.RMSNorm(D_, elementwise_affine=False), torch.sigmoid, torch.relu),
    "out GELU('tanh') module": (lambda: nn.LayerNorm(D_), torch.tanh, nn.GELU(approximate="tanh")),
    "out nn.SiLU": (lambda: nn.LayerNorm(D_), torch.tanh, nn.SiLU()),
    "Softplus(beta, threshold) (horizontal)": (lambda: nn.LayerNorm(D_), nn.Softplus(beta=2.0, threshold=1.0), torch.relu),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("cast", [None, "double"])
def test_activation_and_norm_spellings_match_the_original(spelling, cast):
    """Pinned: outputs in train and eval, every gradient and two SGD steps equal the original's,
    also after ``.double()`` of both (RMSNorm's eps=None then is float64's, read at run time)."""
    torch.manual_seed(0)
    model = Spelled(*SPELLINGS[spelling])
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3 * D_)
    g = recfuse.transform(model, (x,))
    if cast:
        g, ref, x = getattr(g, cast)(), getattr(ref, cast)(), x.double()
    tol = 1e-5 if cast is None else 1e-12
    for mode in ("train", "eval"):
        getattr(g, mode)(), getattr(ref, mode)()
        _close(g(x), ref(x), tol)
    g.train(), ref.train()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (g, ref)]
    for _ in range(2):
        for m, opt in zip((g, ref), opts):
            opt.zero_grad()
            (m(x) * torch.linspace(-1, 1, 5 * 3 * H_, dtype=x.dtype).view(5, 3, H_)).sum().backward()
            opt.step()
    _close(g(x), ref(x), tol * 10)


class Processor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(D_) for _ in range(3))
        self.lins = nn.ModuleList(nn.Linear(D_, H_) for _ in range(3))
        _randomized(self)

    def forward(self, x):
        return torch.stack([torch.relu(l(torch.tanh(n(p)))) for n, l, p in zip(self.lns, self.lins, x.split(D_, 1))], 1)


class SharedProcessor(nn.Module):
    """One processor for the user and the item side (a shared tower), then a dot product."""

    def __init__(self):
        super().__init__()
        self.proc = Processor()
        self.head = nn.Linear(3 * H_, 4)

    def forward(self, user, item):
        return (self.head(self.proc(user).flatten(1)) * self.head(self.proc(item).flatten(1))).sum(1)


def test_a_transformed_processor_called_twice_and_a_deep_copy_train_as_the_original():
    """Pinned: a transformed submodule called on two inputs by its (untransformed) parent, and a
    deep copy of the transformed model trained separately: outputs and three Adam steps match
    the original's; the copy and the original stay independent. The parent's state_dict of the
    original (strict, and non-strict with a feature missing) loads into the nested transform."""
    torch.manual_seed(0)
    user, item = torch.randn(5, 3 * D_), torch.randn(5, 3 * D_)
    model = SharedProcessor()
    ref = copy.deepcopy(model)
    model.proc = recfuse.transform(model.proc, (user,))
    twin, twin_ref = copy.deepcopy(model), copy.deepcopy(ref)
    for m, r, inputs in ((model, ref, (user, item)), (twin, twin_ref, (item, 2 * user))):
        opts = [torch.optim.Adam(p.parameters(), lr=0.05) for p in (m, r)]
        for _ in range(3):
            for p, opt in zip((m, r), opts):
                opt.zero_grad()
                p(*inputs).square().sum().backward()
                opt.step()
        _close(m(user, item), r(user, item))
    assert not torch.equal(model(user, item), twin(user, item))
    other = SharedProcessor()
    assert str(model.load_state_dict(other.state_dict())) == "<All keys matched successfully>"
    _close(model(user, item), other(user, item))
    partial = {k: v for k, v in _randomized(SharedProcessor()).state_dict().items() if "lns.1" not in k}
    assert model.load_state_dict(partial, strict=False).missing_keys == \
        other.load_state_dict(partial, strict=False).missing_keys == ["proc.lns.1.weight", "proc.lns.1.bias"]
    _close(model(user, item), other(user, item))


# -- global module hooks: not refused (observers use them), but never silent ----------------------


def test_a_global_forward_hook_after_transform_is_named_in_a_warning(caplog):
    """A global forward hook that clamps every Linear's output changes the original's answer but
    not the transformed graph's (its Linear call is fused away): the difference is measured, and
    the first call with the hook set logs a warning naming the replaced modules, once."""
    torch.manual_seed(0)
    model = Spelled(lambda: nn.LayerNorm(D_), torch.tanh, torch.relu)
    x = torch.randn(5, 3 * D_)
    g = recfuse.transform(copy.deepcopy(model), (x,))
    with caplog.at_level("WARNING", logger="recfuse"):
        _close(g(x), model(x))
        assert not [r for r in caplog.records if "global module forward hooks" in r.getMessage()]
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out.clamp(max=0.1) if isinstance(m, nn.Linear) else None)
        try:
            hooked_original, transformed = model(x), g(x)
            g(x)
        finally:
            handle.remove()
    assert (hooked_original - transformed).abs().max() > 0.05
    warned = [r.getMessage() for r in caplog.records if "global module forward hooks" in r.getMessage()]
    assert len(warned) == 1 and "lin" in warned[0]
