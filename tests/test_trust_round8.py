"""Red-team round 8: "never a silent wrong answer" for spellings a recommender engineer writes,
through `recfuse.transform`. Each test compares with the untouched original model, or checks the
error that refuses the case. Each docstring says what the case did before its fix."""
import copy
import io
import logging
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from fx_cases import randomized

F_, D_, H_ = 3, 6, 4


class Chain(nn.Module):
    """F_ slices of width D_ -> LayerNorm -> tanh -> stack -> shared Linear -> relu."""

    def __init__(self):
        super().__init__()
        self.ns = nn.ModuleList([nn.LayerNorm(D_) for _ in range(F_)])
        self.lin = nn.Linear(D_, H_)

    def chain(self, x):
        return torch.relu(self.lin(torch.stack([torch.tanh(n(t)) for n, t in zip(self.ns, x.split(D_, 1))], 1)))

    def forward(self, x):
        return self.chain(x)


def _grads(model, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    y = model(*xs)
    (y ** 2).sum().backward()
    return y.detach(), [x.grad for x in xs]


def _same(g, ref, *xs, atol=1e-5):
    yg, gg = _grads(g, *xs)
    yr, gr = _grads(ref, *xs)
    torch.testing.assert_close(yg, yr, atol=atol, rtol=atol)
    for a, b in zip(gg, gr):
        torch.testing.assert_close(a, b, atol=10 * atol, rtol=10 * atol)


# -- a norm over the batch of column slices (x.T.split) --------------------------------------------


class ColumnSlices(nn.Module):
    """The features are row blocks of x.T ([F*D, B]); each [D, B] slice is normalized over the batch
    with a normalized_shape read from its own shape."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.lin = nn.Linear(D_, H_)

    def forward(self, x):
        xt = {"T": x.T, "t": x.t(), "mT": x.mT, "permute": x.permute(1, 0)}[self.spelling]
        hs = [torch.tanh(F.layer_norm(t, t.shape[1:])) for t in xt.split(D_, 0)]
        return torch.relu(self.lin(torch.stack(hs, 0).transpose(1, 2)))


@pytest.mark.parametrize("spelling", ["T", "t", "mT", "permute"])
def test_a_computed_norm_shape_over_the_batch_works_at_any_batch_size(spelling):
    """Before: the batched layer_norm kept the example's [B] as its normalized_shape (the shape was
    computed from the slice, t.shape[1:], and taken for the row width): right at the traced batch
    size, "RuntimeError: Given normalized_shape=[5] ..." at any other."""
    model = randomized(ColumnSlices(spelling))
    ref = copy.deepcopy(model)
    g = recfuse.transform(model, (torch.randn(5, F_ * D_),))
    assert g.recfuse_report.groups and g.recfuse_report.groups[0].fusion == "horizontal_chain"
    for b in (5, 7, 2):
        _same(g, ref, torch.randn(b, F_ * D_))
    again = copy.deepcopy(g)
    buf = io.BytesIO()
    torch.save(g, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(9, F_ * D_)
    for m in (again, loaded):
        torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)


# -- torch.func.functional_call with the original's parameter names ---------------------------------


class SharedBias(Chain):
    """Per-feature LayerNorm weights with one bias parameter shared by every feature: the
    LayerNorm modules survive fusion (they still own their unused bias)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(D_))

    def forward(self, x):
        hs = [torch.tanh(F.layer_norm(t, (D_,), n.weight, self.bias)) for n, t in zip(self.ns, x.split(D_, 1))]
        return torch.relu(self.lin(torch.stack(hs, 1)))


@pytest.mark.parametrize("cls", [Chain, SharedBias])
@pytest.mark.parametrize("copy_how", ["none", "deepcopy", "save_load"])
def test_functional_call_with_the_original_names_is_refused_by_name_and_mapped_on_request(cls, copy_how):
    """Before: torch.func.functional_call(transformed, {original names: tensors}, x) raised
    "AttributeError: Chain has no attribute `ns`" (fusion pruned the LayerNorm modules) or, where
    the modules survived (SharedBias), set a plain attribute that the fused graph never reads and
    silently ran with the stacked parameter: max diff 1.12 from the original's functional_call."""
    model = randomized(cls())
    ref = copy.deepcopy(model)
    x = torch.randn(5, F_ * D_)
    g = recfuse.transform(model, (x,))
    if copy_how == "deepcopy":
        g = copy.deepcopy(g)
    elif copy_how == "save_load":
        buf = io.BytesIO()
        torch.save(g, buf)
        buf.seek(0)
        g = torch.load(buf, weights_only=False)
    params = {k: v.detach() * 2 + 0.1 for k, v in ref.named_parameters()}
    want = torch.func.functional_call(ref, params, (x,))
    with pytest.raises(recfuse.RecfuseError, match=r"`ns\.0\.weight` of the original model is row 0 of"):
        torch.func.functional_call(g, params, (x,))
    torch.testing.assert_close(g(x), ref(x), atol=1e-5, rtol=1e-5)  # nothing left swapped in
    torch.testing.assert_close(torch.func.functional_call(g, g.transformed_parameters(params), (x,)), want,
                               atol=1e-5, rtol=1e-5)
    # gradients reach the caller's tensors through the mapping (torch.func.grad over the original names)
    def loss(m, p):
        return (torch.func.functional_call(m, p, (x,)) ** 2).sum()
    gr = torch.func.grad(lambda p: loss(ref, p))(params)
    gg = torch.func.grad(lambda p: loss(g, g.transformed_parameters(p)))(params)
    for k in params:
        torch.testing.assert_close(gg[k], gr[k], atol=1e-4, rtol=1e-4)
    # the original's state_dict still loads, and the names of the result's own work as before
    g.load_state_dict(ref.state_dict())
    own = {k: v.detach() * 2 for k, v in g.named_parameters()}
    torch.testing.assert_close(torch.func.functional_call(g, own, (x,)),
                               torch.func.functional_call(ref, {k: v.detach() * 2 for k, v in ref.named_parameters()},
                                                          (x,)), atol=1e-5, rtol=1e-5)


# -- side effects in forward that the graph would drop --------------------------------------------


class AppendsToList(Chain):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return self.chain(x)


class KeepsLastOutput(Chain):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def forward(self, x):
        y = self.chain(x)
        self.outputs.append(y.detach())
        return y


class WritesStatsDict(Chain):
    def __init__(self):
        super().__init__()
        self.stats = {}

    def forward(self, x):
        y = self.chain(x)
        self.stats["mean"] = y.mean().detach()
        return y


class NestedList(Chain):
    def __init__(self):
        super().__init__()
        self.log = {"shapes": []}

    def forward(self, x):
        self.log["shapes"].append(tuple(x.shape))
        return self.chain(x)


class Prints(Chain):
    def forward(self, x):
        print("batch of", x.shape[0])
        return self.chain(x)


class Logs(Chain):
    def forward(self, x):
        logging.getLogger("recsys.model").debug("batch of %s", x.shape[0])
        return self.chain(x)


STATS = []


class AppendsToGlobal(Chain):
    def forward(self, x):
        STATS.append(x.shape[0])
        return self.chain(x)


class CountsInConfig(Chain):
    """Counts its calls in a plain config object and scales by the count."""

    def __init__(self):
        super().__init__()
        self.cfg = types.SimpleNamespace(calls=0)

    def forward(self, x):
        self.cfg.calls += 1
        return self.chain(x) * self.cfg.calls


class TagsSubmodule(Chain):
    def forward(self, x):
        self.lin.tagged = True  # a new attribute of a submodule
        return self.chain(x)


@pytest.mark.parametrize("cls, what", [(AppendsToList, "attribute `seen` of AppendsToList"),
                                       (KeepsLastOutput, "attribute `outputs`"),
                                       (WritesStatsDict, "attribute `stats`"),
                                       (NestedList, "attribute `log`"),
                                       (AppendsToGlobal, r"global `test_trust_round8\.STATS`"),
                                       (CountsInConfig, "attribute `cfg`"),
                                       (TagsSubmodule, r"attribute `lin\.tagged` of Linear")])
def test_a_side_effect_the_graph_would_drop_is_refused(cls, what):
    """Before: the side effect ran once, at capture (on the traced copy), and never again: the
    transformed model's list/dict stayed as it was (or did not exist) where the original's grows
    on every call, a global list grew once at transform time and never on calls, and
    `self.cfg.calls += 1` on a config namespace
    was baked in: y * 1 on every call where the original returns y * 1, y * 2, ... (max diff 6.4
    at the third call)."""
    model = randomized(cls())
    before = copy.deepcopy(model.__dict__.get("seen", model.__dict__.get("stats")))
    with pytest.raises(recfuse.RecfuseError, match=what):
        recfuse.transform(model, (torch.randn(5, F_ * D_),))
    assert model.__dict__.get("seen", model.__dict__.get("stats")) == before  # the original is untouched
    assert STATS == []  # a global the trace changed is put back
    if cls is CountsInConfig:
        assert model.cfg.calls == 0


class CountsInBuffer(Chain):
    def __init__(self):
        super().__init__()
        self.register_buffer("rows", torch.zeros((), dtype=torch.long))
        self.register_buffer("running", torch.zeros(F_ * D_))

    def forward(self, x):
        self.rows.add_(x.shape[0])
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * x.mean(0))
        return self.chain(x)


def test_in_place_buffer_updates_in_forward_are_kept():
    """In-place buffer updates are ops of the graph and stay (this round's decision for the side
    effects that are not): the counters of the transformed model move as the original's."""
    model = randomized(CountsInBuffer())
    ref = copy.deepcopy(model)
    g = recfuse.transform(model, (torch.randn(5, F_ * D_),))
    assert int(model.rows) == 0
    for b in (5, 3):
        x = torch.randn(b, F_ * D_)
        torch.testing.assert_close(g(x), ref(x), atol=1e-5, rtol=1e-5)
    assert int(g.rows) == int(ref.rows) == 8
    torch.testing.assert_close(g.running, ref.running)


# -- torch.func over a transformed model after torch.save / torch.load ----------------------------


class RmsSiluChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.ns = nn.ModuleList([nn.RMSNorm(D_) for _ in range(F_)])
        self.lin = nn.Linear(D_, H_)

    def forward(self, x):
        return self.lin(torch.stack([F.silu(n(t)) for n, t in zip(self.ns, x.split(D_, 1))], 1))


@pytest.mark.parametrize("cls, fusion", [(Chain, "vertical_ln_tanh_linear_relu"),
                                         (RmsSiluChain, "vertical_feature_mlp")])
def test_torch_func_over_a_loaded_transformed_model(cls, fusion):
    """Before: torch.load re-traced the saved code into torch.ops.recfuse.* nodes (the public op's
    symbolic-trace branch), which have no torch.func rule: torch.func.grad / jvp / jacrev over the
    loaded model raised "In order to use an autograd.Function with functorch transforms ... it
    must override the setup_context staticmethod", where the model before saving worked."""
    import torch.autograd.forward_ad as fwAD

    model = randomized(cls())
    ref = copy.deepcopy(model)
    x = torch.randn(5, F_ * D_)
    g = recfuse.transform(model, (x,))
    assert g.recfuse_report.groups[0].fusion == fusion
    buf = io.BytesIO()
    torch.save(g, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (g, loaded):
        gx = torch.func.grad(lambda t: (m(t) ** 2).sum())(x)
        torch.testing.assert_close(gx, torch.func.grad(lambda t: (ref(t) ** 2).sum())(x), atol=1e-4, rtol=1e-4)
        own = {k: v.detach() for k, v in m.named_parameters()}
        gp = torch.func.grad(lambda p: (torch.func.functional_call(m, p, (x,)) ** 2).sum())(own)
        assert set(gp) == set(own)
        tx = torch.randn_like(x)
        with fwAD.dual_level():
            tg = fwAD.unpack_dual(m(fwAD.make_dual(x, tx))).tangent
            tr = fwAD.unpack_dual(ref(fwAD.make_dual(x, tx))).tangent
        torch.testing.assert_close(tg, tr, atol=1e-4, rtol=1e-4)
    _same(loaded, ref, x)


# -- constant arguments: defaults and str values ------------------------------------------------


class WithOptions(Chain):
    def forward(self, x, scale=1.0, reduce="sum"):
        y = self.chain(x) * scale
        return y.sum(1) if reduce == "sum" else y.mean(1)


def test_a_left_out_argument_means_the_originals_default_not_the_examples_value():
    """Before: transformed with scale=2.0, the result's signature had scale=2.0 as its default, so
    `g(x)` silently returned y * 2 where the original's `model(x)` returns y * 1 (max diff 2.99)."""
    model = randomized(WithOptions())
    ref = copy.deepcopy(model)
    x = torch.randn(5, F_ * D_)
    g = recfuse.transform(model, (x, 2.0))
    torch.testing.assert_close(g(x, 2.0), ref(x, 2.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g(x, scale=2.0), ref(x, 2.0), atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match="scale has been specialized to have value 2.0"):
        g(x)
    # an example value equal to the default may still be left out
    g1 = recfuse.transform(copy.deepcopy(ref), (x, 1.0))
    torch.testing.assert_close(g1(x), ref(x), atol=1e-5, rtol=1e-5)


def test_a_str_argument_is_guarded_like_a_number():
    """Before: a str argument (reduce="mean" at transform time) got no guard (torch.fx asserts
    ints, floats and bools only): `g(x, 1.0, "sum")` silently ran the mean path (max diff 4.6)."""
    model = randomized(WithOptions())
    ref = copy.deepcopy(model)
    x = torch.randn(5, F_ * D_)
    g = recfuse.transform(model, (x, 1.0, "mean"))
    torch.testing.assert_close(g(x, 1.0, "mean"), ref(x, 1.0, "mean"), atol=1e-5, rtol=1e-5)
    with pytest.raises(recfuse.RecfuseError, match="argument `reduce` was 'mean'.* passes 'sum'"):
        g(x, 1.0, "sum")
    with pytest.raises(recfuse.RecfuseError, match="argument `reduce` was 'mean'"):
        g(x, reduce="sum")
    with pytest.raises(recfuse.RecfuseError, match="argument `reduce` was 'mean'"):
        g(x)  # the original's default, "sum"
    buf = io.BytesIO()
    torch.save(g, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with pytest.raises(recfuse.RecfuseError, match="argument `reduce` was 'mean'"):
        loaded(x, 1.0, "sum")
    torch.testing.assert_close(loaded(x, 1.0, "mean"), ref(x, 1.0, "mean"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls, what", [(Prints, r"print\(\) at .*batch of"), (Logs, r"logging \(logger `recsys.model`\)")])
def test_output_in_forward_is_warned_about_not_silently_dropped(cls, what, capsys):
    """print / logging in forward hold no tensor op: the transformed model does not repeat them.
    Before: silent (and printed traced values once at transform time). Now: one warning at
    transform naming the call; values unchanged; nothing printed at capture. A logging call the
    logger would not emit (debug at the default WARNING level) loses nothing and is not warned."""
    model = randomized(cls())
    x = torch.randn(5, F_ * D_)
    logger = logging.getLogger("recsys.model")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with pytest.warns(UserWarning, match=what):
            g = recfuse.transform(model, (x,))
    finally:
        logger.setLevel(old_level)
    assert capsys.readouterr().out == ""  # no traced values printed at capture
    torch.testing.assert_close(g(x), model(x), rtol=1e-5, atol=1e-6)
    if cls is Logs:  # at the default level the debug line is off: nothing to warn about
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g2 = recfuse.transform(model, (x,))
        torch.testing.assert_close(g2(x), model(x), rtol=1e-5, atol=1e-6)
