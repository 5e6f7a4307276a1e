"""Red-team round 16: what a recommender engineer does to the model `recfuse.transform` returns
beyond the pattern itself (settings of the surrounding code, hooks and replacements on submodules
whose forward the trace inlined) and how `FusedFeatureProcessor.from_modules` reads a loop's
modules, on CPU. Each test compares with the untouched original model (a deep copy taken before
`transform`) or the eager loop, or checks the error that refuses the case; each docstring says what
the case gave before its fix.

Found wrong (each a test below that fails before its fix):

1. `FusedFeatureProcessor.from_modules(loop.lns, loop.lins, feature_names=kt.keys())` with the
   LayerNorms in a ModuleDict, the Linears in a ModuleList built alongside it (the loop zips
   ``lns.items()`` with ``lins``) and feature_names in another order than the dict's: the list was
   paired with feature_names by position, so two features swapped Linears, 3.55 and 3.03 off the
   loop (max abs), silently. Now refused as ambiguous, naming both orders
   (`module/parameters.py` `_names_from_modules`); the dict's order, or both as dicts, still build.
2. A plain attribute read by the traced forward (``self.temperature``, a ``use_residual`` flag, a
   traced submodule's ``self.scale``) set on the result after transform: the graph holds the value the
   trace read as a constant, so the new value was silently ignored: 0.26 / 1.55 / 0.39 off the
   original with the same setting (relative, max abs). Round 10 refused this only on modules whose
   calls fusion replaced. Now refused on the result and on the holders of traced submodules, naming
   the attribute and the value the graph holds (`fx/graph_module.py` `guard_settings`, settings
   recorded by `fx/transform.py` `_run`; carried by deepcopy, torch.save and cuda_graph=True).
3. A hook registered on a submodule of the result whose forward the trace inlined (``g.tower``, a
   custom module; torch.fx leaves a plain holder of its tensors there) was accepted and never ran:
   0.90 off the original with a forward hook ``out * 10``, 0.61 with a pre-hook. Now refused
   naming the path (`guard_settings`); hooks on leaves the graph calls (``tower.out``) and hooks
   registered before transform run as before.
4. Replacing such a submodule (``g.tower = SigmoidTower()``, or a Tower with another ``scale``)
   was accepted and the graph computed the original forward with the new module's tensors: 1.70 and
   0.79 off the original given the same module. Now refused like a replacement of a fused module
   (`check_replacement`); a module of the same class and settings still replaces it.

Probed and found right (probe scripts, no test of their own): the same feature stacked twice,
overlapping slices, stack on the last dim before a Linear over F (left unfused), [B, T, F*D] inputs
(left unfused), torch.split by unequal sizes, slices with a step (``x[:, i::3]``), a split along the
batch dim and slices of a transposed input, a ModuleDict iterated in sorted order, LayerNorms with and
without affine in one group (left unfused), one LayerNorm module used for two features (left
unfused), a LayerNorm weight or a per-feature Linear's weight / bias tied between features, a Linear
tied to another module's weight, a LayerNorm weight also read outside the chain: outputs, every
gradient and 3 SGD / Adam steps match; casts, detach, clone, contiguous, dropout, einsum / matmul /
negated or detached weights between the stages (left unfused or right); float64 / bf16 / fp16 inputs
to an fp32 model and fp32 inputs to a bf16 model (refused as the original refuses); transposed,
strided, expanded and offset inputs, B = 0, 1, 7, autocast; the original's state_dict with a key
missing under strict=False (same missing_keys), assign=True (then trained), nested and wrapped
transformed models; `.eval()` / `.train()` of a traced submodule alone (dropout follows it); the
guards above through Dynamo capture (a custom autograd Function in forward); from_modules with
dicts in other orders, shared modules, and mismatched eps / bias / H / D / dtype (refused by name).

Not fixed (reported): an unused custom submodule of the result is a plain holder right after
transform but its own class after deepcopy / torch.load (both compute the same; only its type and
which hooks it accepts differ). A list-valued setting mutated in place (``g.dims[0] = 5``) is not
seen by the guard (it checks assignments only).
"""
import copy

import pytest
import torch
from torch import nn

import recfuse
from trust_helpers import close as _close, randomized as _randomized, reloaded as _reloaded

D_, H_ = 4, 2


# -- FusedFeatureProcessor.from_modules: a list of modules beside a dict in another order ---------


class DictLoop(nn.Module):
    """A per-feature loop written with the LayerNorms in a ModuleDict and the Linears in a
    ModuleList built alongside it (one per LayerNorm, in the dict's order)."""

    def __init__(self, names):
        super().__init__()
        self.lns = nn.ModuleDict({n: nn.LayerNorm(D_) for n in names})
        self.lins = nn.ModuleList(nn.Linear(D_, H_) for _ in names)
        _randomized(self)

    def forward(self, feats: dict) -> dict:
        return {name: torch.relu(lin(torch.tanh(ln(feats[name]))))
                for (name, ln), lin in zip(self.lns.items(), self.lins)}


@pytest.mark.parametrize("list_arg", ["linear", "layer_norms"])
def test_from_modules_list_beside_a_dict_in_another_order_is_refused(list_arg):
    """Before: ``from_modules(loop.lns, loop.lins, feature_names=kt.keys())`` with the KeyedTensor's
    keys in another order than the ModuleDict's paired the ModuleList with feature_names by
    position, not with the dict's order the loop zips it with: "item" got "user"'s Linear and
    "user" got "item"'s, y 3.55 and 3.03 off the loop (max abs), silently. Now refused (which order the list follows is ambiguous);
    the list beside a dict in the feature order, or both as dicts, still build the loop's module."""
    torch.manual_seed(0)
    loop = DictLoop(["user", "item", "ctx"])
    feats = {n: torch.randn(5, D_) for n in ("item", "user", "ctx")}
    want = loop(feats)
    lns, lins = loop.lns, loop.lins
    if list_arg == "layer_norms":  # the same loop with the roles swapped
        lns = list(loop.lns.values())
        lins = nn.ModuleDict(zip(loop.lns.keys(), loop.lins))
    with pytest.raises(ValueError, match=rf"{list_arg} is a list .* key order \['user', 'item', 'ctx'\] is not "
                                         r"the feature order \['item', 'user', 'ctx'\]"):
        recfuse.FusedFeatureProcessor.from_modules(lns, lins, feature_names=["item", "user", "ctx"])
    for names in (None, ["user", "item", "ctx"]):  # the dict's order: unambiguous
        fp = recfuse.FusedFeatureProcessor.from_modules(lns, lins, feature_names=names)
        got = fp(feats)
        assert list(got) == list(feats)
        for n in feats:
            _close(got[n], want[n])
    by_name = nn.ModuleDict(zip(loop.lns.keys(), loop.lins))
    fp = recfuse.FusedFeatureProcessor.from_modules(loop.lns, by_name, feature_names=["item", "user", "ctx"])
    got = fp(feats)
    for n in feats:
        _close(got[n], want[n])


# -- plain settings of traced modules, set on the transformed model ------------------------------


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0
        self.out = nn.Linear(3 * H_, 1)

    def forward(self, y):
        return self.out(y.flatten(1)) * self.scale


class WithSettings(nn.Module):
    """The pattern, then settings read in forward: a temperature, a flag, and a traced
    submodule's scale (plain attributes a user anneals or toggles between epochs)."""

    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(D_) for _ in range(3))
        self.lin = nn.Linear(D_, H_)
        self.tower = Tower()
        self.temperature = 1.0
        self.use_residual = True
        self.tag = ["not", "a", "number"]  # an object setting: any new value is refused
        _randomized(self)

    def forward(self, x):
        ts = [torch.tanh(ln(p)) for ln, p in zip(self.lns, x.split(D_, 1))]
        out = self.tower(torch.relu(self.lin(torch.stack(ts, 1))) / self.temperature)
        if self.use_residual:
            out = out + x[:, :1]
        return out


def _transformed_with_settings(copy_how: str):
    """(transformed WithSettings, its untouched original, an input), the result copied as asked:
    "none", "deepcopy", "save_load" (torch.save / torch.load) or "cuda_graph" (the replaying module)."""
    torch.manual_seed(0)
    model = WithSettings()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3 * D_)
    g = recfuse.transform(model, (x,), cuda_graph=copy_how == "cuda_graph")
    if copy_how == "deepcopy":
        g = copy.deepcopy(g)
    elif copy_how == "save_load":
        g = _reloaded(g)
    return g, ref, x


@pytest.mark.parametrize("copy_how", ["none", "deepcopy", "save_load", "cuda_graph"])
@pytest.mark.parametrize("path,name,value", [("", "temperature", 3.0), ("", "use_residual", False),
                                             ("tower", "scale", 5.0), ("", "tag", ["other"])])
def test_a_plain_setting_read_by_the_traced_forward_set_after_transform_is_refused(copy_how, path, name, value):
    """Before: ``transformed.temperature = 3.0`` (or ``use_residual = False``, or
    ``transformed.tower.scale = 5.0`` on the holder torch.fx leaves for a traced submodule) added
    an attribute that nothing reads: the graph keeps the value the trace read as a constant, so the
    result silently stayed 0.26 / 1.55 / 0.39 off the original with the same setting (relative, max
    abs). Round 10 refused this on modules whose calls fusion replaced only. Now refused, naming
    the attribute and the value the graph holds; setting the value it already has is allowed."""
    g, ref, x = _transformed_with_settings(copy_how)
    _close(g(x), ref(x))
    target = g.get_submodule(path) if path else g
    where = rf"`{path}\.{name}`" if path else rf"`{name}` of the transformed model"
    with pytest.raises(recfuse.RecfuseError, match=where + r" = .*traced the original module's forward with "
                                                   + name + "="):
        setattr(target, name, value)
    _close(g(x), ref(x))  # nothing changed
    old = getattr(ref.get_submodule(path) if path else ref, name)
    if not isinstance(old, list):
        setattr(target, name, old)  # the value the graph holds: harmless
    _close(g(x), ref(x))
    g.train(False)  # training is read at run time, as before
    ref.train(False)
    _close(g(x), ref(x))


@pytest.mark.parametrize("copy_how", ["none", "deepcopy", "save_load", "cuda_graph"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_a_hook_on_a_traced_submodule_of_the_result_is_refused(copy_how, kind):
    """Before: a hook registered on the transformed model's `tower` (a submodule with a forward of
    its own, which the trace inlined; torch.fx leaves a plain holder of its tensors at the path) was
    accepted and never ran: with a forward hook ``out * 10`` the result stayed 0.90 off the original
    with the same hook (relative, max abs), 0.61 with a pre-hook ``x * 2``. Round 10 refused hooks on
    modules whose calls fusion replaced only. Now refused, naming the path; hooks on a module the graph
    still calls (`tower.out`, a Linear) and hooks registered before transform run as before."""
    torch.manual_seed(0)
    model = WithSettings()
    x = torch.randn(5, 3 * D_)
    hooked = copy.deepcopy(model)
    hooked.tower.register_forward_hook(lambda mod, args, out: out * 10)
    ref_hooked = copy.deepcopy(hooked)
    _close(recfuse.transform(hooked, (x,))(x), ref_hooked(x))  # registered before: runs
    ref = copy.deepcopy(model)
    g = recfuse.transform(model, (x,), cuda_graph=copy_how == "cuda_graph")
    if copy_how == "deepcopy":
        g = copy.deepcopy(g)
    elif copy_how == "save_load":
        g = _reloaded(g)
    register = {"forward": lambda m: m.register_forward_hook(lambda mod, args, out: out * 10),
                "forward_pre": lambda m: m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,)),
                "full_backward": lambda m: m.register_full_backward_hook(lambda mod, gi, go: None)}[kind]
    with pytest.raises(recfuse.RecfuseError, match=r"cannot register a hook on `tower`: .*traced this module's forward"):
        register(g.tower)
    _close(g(x), ref(x))
    g.tower.out.register_forward_hook(lambda mod, args, out: out * 10)  # a leaf the graph calls
    ref.tower.out.register_forward_hook(lambda mod, args, out: out * 10)
    _close(g(x), ref(x))


class SigmoidTower(Tower):
    def forward(self, y):
        return torch.sigmoid(self.out(y.flatten(1)))


@pytest.mark.parametrize("copy_how", ["none", "deepcopy", "save_load", "cuda_graph"])
def test_replacing_a_traced_submodule_of_the_result_by_another_class_or_settings_is_refused(copy_how):
    """Before: ``transformed.tower = SigmoidTower()`` (another forward) or a Tower with another
    ``scale`` was accepted, and the graph, which inlined the original Tower's forward and reads only
    the tensors at ``tower.out``, silently computed the original forward with the new weights: 1.70
    (another class) and 0.79 (scale 7.0 for 2.0) off the original given the same module (relative,
    max abs). Now refused as for a module whose calls fusion replaced (round 10); a Tower of the
    same settings still replaces it (its tensors are read), and so does a new leaf (``tower.out``)."""
    g, ref, x = _transformed_with_settings(copy_how)
    other_scale = _randomized(Tower())
    other_scale.scale = 7.0
    for bad in (_randomized(SigmoidTower()), other_scale):
        with pytest.raises(recfuse.RecfuseError, match=rf"cannot replace `tower` with this {type(bad).__name__}"):
            g.tower = bad
        _close(g(x), ref(x))
    same = _randomized(Tower())
    g.tower = same
    ref.tower = copy.deepcopy(same)
    _close(g(x), ref(x))
    lin = _randomized(nn.Linear(3 * H_, 1))
    g.tower.out = lin
    ref.tower.out = copy.deepcopy(lin)
    _close(g(x), ref(x))


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_unused_and_sequential_submodules_still_copy_save_and_load(cuda_graph):
    """Kept right (the guards above must not refuse recfuse's own holders): a transformed model with
    an unused custom submodule and an unused Sequential holding one deep-copies, saves and loads,
    and the original's state_dict loads into each copy."""
    class Unused(WithSettings):
        def __init__(self):
            super().__init__()
            self.spare = Tower()
            self.seq = nn.Sequential(nn.Linear(2, 2), Tower())

    torch.manual_seed(0)
    model = Unused()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3 * D_)
    g = recfuse.transform(model, (x,), cuda_graph=cuda_graph)
    for h in (g, copy.deepcopy(g), _reloaded(g)):
        h.load_state_dict(ref.state_dict())
        _close(h(x), ref(x))
