"""Red-team round 17: spellings and usages a recommender engineer writes around `recfuse.transform`
and `FusedFeatureProcessor` that earlier rounds did not (activation and norm spellings, in-place
writes into the pooled embedding, one transformed module called twice, dtype casts and copies
after transform, checkpoints of mixed-dim processors), on CPU. Each test compares with the
untouched original model (a deep copy taken before `transform`) or the eager per-feature loop, or
checks the error that refuses the case; each docstring says what the case gave before its fix.

Found wrong (each a test below that fails before its fix):

FINDINGS

Probed and found right (probe scripts, no test of their own unless below):

PROBED

Not fixed (reported):

NOTFIXED
"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse

D_, H_ = 4, 2


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def _randomized(m: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


def _reloaded(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


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
def test_transformed_checkpoint_loads_by_name_into_another_transform(case):
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
    assert str(dst.load_state_dict(sd)) == "<All keys matched successfully>"
    want = ref(*other_inputs)
    _all_close(loader(*other_inputs), want)
    _all_close(saver(*inputs), ref(*inputs))
    # and back: the loader's checkpoint into the saver's transform
    back = recfuse.transform(copy.deepcopy(ref), inputs)
    _randomized(back)
    back.load_state_dict(loader.state_dict())
    _all_close(back(*inputs), ref(*inputs))
