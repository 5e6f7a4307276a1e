"""Red-team round 18: training recipes a recommender engineer applies around a model that
`recfuse.transform` returned (re-initialisation through ``model.apply``, freezing, gradient
scaling, parametrizations, train/eval toggles), on CPU. Each test compares with the untouched
original model (a deep copy taken before `transform`) treated the same way, or checks the error
that refuses the case; each docstring says what the case gave before its fix.

Found wrong (each a test below that fails before its fix):

1. ``transformed.apply(init_fn)`` with a re-initialisation function that picks modules by type
   (``if isinstance(m, nn.LayerNorm): nn.init.ones_(m.weight)``, ``if isinstance(m, nn.Linear):
   nn.init.xavier_uniform_(m.weight)``): ``apply`` met recfuse's holders (`_FusedAway`,
   `_FusedHolder`) at the paths of the fused LayerNorms and Linears, so fn skipped every one of
   them (the unfused head was re-initialised): parameters 0.89 (shared Linear) and 1.10
   (per-feature Linears) off the original re-initialised the same way, outputs 0.41 and 0.30
   off (max abs / max(|ref|, 1)), silently. The same for a freezing recipe through apply
   (``m.requires_grad_(False)`` on every LayerNorm): the stacked LayerNorm parameters kept
   training. Now `TransformedGraphModule.apply` (`fx/graph_module.py` `apply_to_fused`) hands fn,
   at each fused path, a module of the original class and settings holding the result's tensors
   (the holder's own parameters as themselves, stacked rows as copies written back after fn);
   what the graph could not follow is refused by name: new settings (``m.eps = ...``), hooks,
   tensors added or removed, one row of a stacked parameter frozen while the others train, and
   any use of such a stand-in after apply returned (a module kept to build an optimizer group
   later would hand out copies the graph never reads). Fused modules without tensors that torch.fx
   dropped from the result (nn.Tanh, the out activation) are met too, so a setting fn changes
   there (``GELU.approximate``) is refused rather than ignored (``inplace`` is accepted).

Probed and found right (probe scripts; the cheap ones pinned below): ``torch.amp.GradScaler("cpu")``
with an overflowing first step (skipped, scale halved, same parameters after 3 steps);
``model.eval()`` + a ``torch.no_grad()`` evaluation between forward and backward, ``train()`` again
before the step; ``nn.utils.parametrizations.weight_norm`` / ``spectral_norm`` and the old
hook-based ``nn.utils.spectral_norm`` on the shared Linear before transform, trained with AdamW
(1.5e-7 off after 3 steps); two of three LayerNorms frozen, and every LayerNorm weight (not bias)
frozen, before transform (AdamW over the trainable ones: 1.5e-7); apply after deepcopy,
torch.save / torch.load, on cuda_graph=True and stack_parameters=False results and through a
parent module (nn.Sequential(transformed)); ``m.weight.data = ...`` and ``m.weight =
nn.Parameter(...)`` inside fn, then an SGD step.

Not fixed (reported):

* Walks over ``model.modules()`` / ``named_modules()`` (not ``apply``) still meet the holders: a
  recipe ``for m in model.modules(): if isinstance(m, nn.LayerNorm): ...`` (init, freezing,
  weight-decay groups by module type) silently skips the fused modules (README "Parameter names").
  Substituting stand-ins there would hand torch's own walks (``train()``, ``to()``) objects that
  are not the model's.
* `torch.nn.utils.prune` on a LayerNorm or the Linear before transform: `transform` fails in
  torch's deepcopy ("Only Tensors created explicitly by the user (graph leaves) support the
  deepcopy protocol"), loud but not a RecfuseError (``copy.deepcopy`` of the pruned model fails
  the same way).
"""
import copy

import pytest
import torch
import torch.nn as nn

import recfuse
from recfuse.errors import RecfuseError

F_, D, H, B = 3, 8, 4, 5


class PerFeature(nn.Module):
    def __init__(self, per_lin=False):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(D) for _ in range(F_))
        self.per_lin = per_lin
        if per_lin:
            self.lins = nn.ModuleList(nn.Linear(D, H) for _ in range(F_))
        else:
            self.lin = nn.Linear(D, H)
        self.head = nn.Linear(F_ * H, 1)

    def forward(self, x):
        ts = [torch.tanh(ln(s)) for ln, s in zip(self.lns, x.split(D, 1))]
        if self.per_lin:
            y = torch.stack([torch.relu(lin(t)) for lin, t in zip(self.lins, ts)], 1)
        else:
            y = torch.relu(self.lin(torch.stack(ts, 1)))
        return self.head(y.flatten(1))


def _pair(per_lin=False, prep=None, **kw):
    torch.manual_seed(0)
    m = PerFeature(per_lin)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    if prep is not None:
        prep(m)
    ref = copy.deepcopy(m)
    x = torch.randn(B, F_ * D)
    return ref, recfuse.transform(m, (x,), **kw), x


def _err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def _as_original(g):
    """The result's state_dict under the original's keys (stacked rows split)."""
    stacked = g.stacked_parameters()
    out = {}
    for k, v in g.state_dict().items():
        if k in stacked:
            out.update({o: v[i] for i, o in enumerate(stacked[k])})
        else:
            out[k] = v
    return out


def _params_err(ref, g):
    mine = _as_original(g)
    return max(_err(mine[k], v) for k, v in ref.state_dict().items())


def _steps(models_opts, xs):
    for m, opt in models_opts:
        for x in xs:
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()


def _fused(g):
    assert g.stacked_parameters(), "the pattern was expected to fuse"


def _init_fn(m):
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight, generator=torch.Generator().manual_seed(hash(m.weight.shape) % 1000))
        nn.init.constant_(m.bias, 0.05)
    if isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


@pytest.mark.parametrize("per_lin", [False, True])
def test_apply_init_fn_reaches_fused_modules(per_lin):
    """Before: fn skipped every fused LayerNorm / Linear; parameters 0.89 (shared) / 1.10
    (per-feature Linears) off, outputs 0.41 / 0.30 off the original re-initialised alike."""
    ref, g, x = _pair(per_lin)
    _fused(g)
    ref.apply(_init_fn)
    assert g.apply(_init_fn) is g
    assert _params_err(ref, g) == 0.0
    for mode in ("train", "eval"):
        getattr(ref, mode)(), getattr(g, mode)()
        assert _err(g(x), ref(x)) < 1e-5
    ref.train(), g.train()
    xs = [torch.randn(B, F_ * D) for _ in range(3)]
    _steps([(ref, torch.optim.Adam(ref.parameters(), lr=0.05)), (g, torch.optim.Adam(g.parameters(), lr=0.05))], xs)
    assert _params_err(ref, g) < 1e-5


def test_apply_replacing_tensors_inside_fn():
    """``.data =`` and a new nn.Parameter set by fn reach the stacked rows and the held Linear."""
    def fn(m):
        if isinstance(m, nn.LayerNorm):
            m.weight.data = torch.full_like(m.weight, 2.0)
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(torch.full_like(m.weight, 0.5))

    ref, g, x = _pair()
    ref.apply(fn), g.apply(fn)
    assert _params_err(ref, g) == 0.0
    _steps([(ref, torch.optim.SGD(ref.parameters(), lr=0.1)), (g, torch.optim.SGD(g.parameters(), lr=0.1))], [x])
    assert _params_err(ref, g) < 1e-5


def test_apply_freezes_every_layernorm():
    """Before: the stacked LayerNorm parameters stayed trainable (and an optimizer trained them)."""
    def freeze(m):
        if isinstance(m, nn.LayerNorm):
            m.requires_grad_(False)

    ref, g, x = _pair()
    ref.apply(freeze), g.apply(freeze)
    assert not g.recfuse_g0_ln_weight.requires_grad and not g.recfuse_g0_ln_bias.requires_grad
    xs = [torch.randn(B, F_ * D) for _ in range(2)]
    _steps([(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.05)),
            (g, torch.optim.AdamW([p for p in g.parameters() if p.requires_grad], lr=0.05))], xs)
    assert _params_err(ref, g) < 1e-5


def test_apply_refuses_what_the_graph_cannot_follow():
    ref, g, x = _pair()
    before = copy.deepcopy(g.state_dict())
    seen = []

    def freeze_first(m):
        if isinstance(m, nn.LayerNorm) and not seen:
            seen.append(m)
            m.requires_grad_(False)

    with pytest.raises(RecfuseError, match=r"requires_grad of `lns.0.weight`.*recfuse_g0_ln_weight"):
        g.apply(freeze_first)
    with pytest.raises(RecfuseError, match="cannot register a hook on `lns.0`"):
        g.apply(lambda m: m.register_forward_hook(lambda *a: None) if isinstance(m, nn.LayerNorm) else None)
    with pytest.raises(RecfuseError, match=r"changed the settings of `lns.0`"):
        g.apply(lambda m: setattr(m, "eps", 1e-3) if isinstance(m, nn.LayerNorm) else None)
    kept = []
    g.apply(lambda m: kept.append(m) if isinstance(m, nn.LayerNorm) else None)
    with pytest.raises(RecfuseError, match=r"stood in for `lns.0`.*recfuse_g0_ln_bias"):
        [p for m in kept for p in m.parameters()]
    with pytest.raises(RecfuseError, match="stood in for"):
        kept[0].weight
    assert all(torch.equal(v, g.state_dict()[k]) for k, v in before.items())
    assert _err(g(x), ref(x)) < 1e-5


@pytest.mark.parametrize("how", ["deepcopy", "cuda_graph", "nested", "no_stack"])
def test_apply_on_copies_and_wrappers(how):
    ref, g, x = _pair(True, cuda_graph=how == "cuda_graph", stack_parameters=how != "no_stack")
    if how == "deepcopy":
        g = copy.deepcopy(g)
    target, reference = (nn.Sequential(g), nn.Sequential(ref)) if how == "nested" else (g, ref)
    reference.apply(_init_fn), target.apply(_init_fn)
    assert _params_err(ref, g) == 0.0
    assert _err(g(x), ref(x)) < 1e-5


# Probed and found right (pinned).

def test_grad_scaler_skips_overflowing_step_as_original():
    ref, g, x = _pair()
    xb = x.clone()
    xb[0, 0] = 1e30
    scales = []
    for m in (ref, g):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
        for xx in (xb, x, x):
            opt.zero_grad()
            scaler.scale(m(xx).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
        scales.append(scaler.get_scale())
    assert scales[0] == scales[1]
    assert _params_err(ref, g) < 1e-5


def test_eval_under_no_grad_between_forward_and_backward():
    ref, g, x = _pair()
    xs = [torch.randn(B, F_ * D) for _ in range(3)]
    for m in (ref, g):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for xx in xs:
            opt.zero_grad(set_to_none=False)
            loss = m(xx).pow(2).mean()
            m.eval()
            with torch.no_grad():
                m(xx)
            loss.backward()
            m.train()
            opt.step()
    assert _params_err(ref, g) < 1e-5


@pytest.mark.parametrize("prep", [
    lambda m: nn.utils.parametrizations.weight_norm(m.lin),
    lambda m: nn.utils.parametrizations.spectral_norm(m.lin),
    lambda m: [m.lns[i].requires_grad_(False) for i in (0, 2)],
    lambda m: [ln.weight.requires_grad_(False) for ln in m.lns],
], ids=["weight_norm", "spectral_norm", "two_of_three_frozen", "ln_weights_frozen"])
def test_recipes_applied_before_transform(prep):
    ref, g, x = _pair(prep=prep)
    xs = [torch.randn(B, F_ * D) for _ in range(3)]
    for m in (ref, g):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.05)
        _steps([(m, opt)], xs)
    assert _params_err(ref, g) < 1e-5
    for mode in ("train", "eval"):
        getattr(ref, mode)(), getattr(g, mode)()
        assert _err(g(x), ref(x)) < 1e-5


class BlocksThenAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(D), nn.Tanh()) for _ in range(F_))
        self.lin = nn.Linear(D, H)
        self.act = act

    def forward(self, x):
        return self.act(self.lin(torch.stack([b(s) for b, s in zip(self.blocks, x.split(D, 1))], 1)))


def test_apply_meets_fused_modules_without_tensors():
    """Activation modules fusion replaced and torch.fx dropped from the result (no tensors) are
    met by fn too: a changed setting the graph would ignore (GELU's approximate) is refused, a
    change of `inplace` (no value changes) is accepted."""
    torch.manual_seed(0)
    m = BlocksThenAct(nn.GELU(approximate="tanh"))
    ref = copy.deepcopy(m)
    x = torch.randn(B, F_ * D)
    g = recfuse.transform(m, (x,))
    met = []
    g.apply(lambda mod: met.append(type(mod).__name__))
    assert met.count("Tanh") == F_ and met.count("LayerNorm") == F_ and met.count("Linear") == 1
    if "act" in g._recfuse_absorbed:
        with pytest.raises(RecfuseError, match=r"changed the settings of `act`"):
            g.apply(lambda mod: setattr(mod, "approximate", "none") if isinstance(mod, nn.GELU) else None)
    torch.manual_seed(0)
    m = BlocksThenAct(nn.ReLU())
    ref = copy.deepcopy(m)
    g = recfuse.transform(m, (x,))
    fn = lambda mod: setattr(mod, "inplace", True) if isinstance(mod, nn.ReLU) else None  # noqa: E731
    ref.apply(fn), g.apply(fn)
    assert _err(g(x), ref(x)) < 1e-5
