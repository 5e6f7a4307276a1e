"""Seeded random per-feature models for the differential fuzzer of `recfuse.transform`.

A `Spec` says how one model is spelled; `random_spec(seed, features)` draws one from
`random.Random(seed)`, turning on only the exotic features named in `features` (each a key of
`FEATURES`). `FuzzModel(spec)` is an nn.Module whose `forward` branches on the spec in plain
Python, so torch.fx sees one straight-line per-feature graph:

    x --split spelling--> F slices [B, D] --per slice: [LayerNorm] [exotics] [tanh] [Linear] [relu]-->
      --stack spelling--> [Linear -> relu after the stack] [BatchNorm1d] [buffer scale] --> y

The exotic feature "chain" swaps the op family's other members in: RMSNorm or no norm for the
LayerNorm, another activation for tanh and for relu (each as a function, a module or a method).

Everything a model needs (parameters, buffers, inputs) comes from `torch.manual_seed(spec.seed)`,
so `build(spec)` gives bit-identical models every time it is called.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as Fn
from torch import nn

SPLITS = ["torch.split", "x.split", "torch.chunk", "tensor_split", "slicing", "unbind_view"]
SINKS = ["stack0", "stack1", "cat_view"]

# Exotic features, each on/off; `random_spec` draws their details.
FEATURES = {
    "inplace": "an in-place op in the per-slice chain (relu_ with unused return, tanh_, clamp_, add_)",
    "dropout": "nn.Dropout or F.dropout(training=self.training), p in {0.0, 0.3}",
    "batchnorm": "BatchNorm1d after the stack",
    "frozen": "requires_grad_(False) on one feature's LayerNorm or Linear",
    "tied": "the same per-feature Linear serves two features",
    "buffer": "a registered buffer (scale) read in forward",
    "dict_input": "dict-of-tensors input (x[name], x.values() or x.items()), called with keys in another order",
    "side_output": "a per-slice intermediate returned as a second output",
    "chain": "another chain of the feature_mlp family: RMSNorm (eps None or a float) or no norm, other activations "
             "(sigmoid, relu, gelu, gelu tanh, silu; leaky_relu and softplus, which only batch) as functions, "
             "modules or methods",
}
# Drawn from a random stream of their own, so that the specs of every other feature stay as they were.
_OWN_STREAM = ("chain",)
CHAIN_ACTS = ["sigmoid", "relu", "gelu", "gelu_tanh", "silu", "leaky_relu", "softplus"]
CHAIN_OUT_ACTS = ["relu", "sigmoid", "gelu", "silu", "tanh", "leaky_relu"]


@dataclass
class Spec:
    seed: int
    F: int = 3
    D: int = 4
    H: int = 2
    B: int = 3             # example batch (given to transform)
    B_fresh: int = 4       # batch of the comparison inputs
    split: str = "torch.split"
    sink: str = "stack1"
    ln: str = "module"     # 'module' (ModuleList per feature) | 'shared' | 'functional'
    affine: bool = True
    eps: float = 1e-5
    tanh: str = "torch"    # 'torch' | 'method' | 'none'
    lin: str = "after"     # 'none' | 'after' (one Linear after the stack) | 'shared' (one in the chain) | 'per_feature'
    bias: bool = True
    relu: bool = True
    transform_mode: str = "train"  # mode of the model when transform is called
    # exotic features (None / False = off)
    inplace: str | None = None     # 'relu_' | 'tanh_' | 'clamp_' | 'add_'
    dropout: str | None = None     # 'module' | 'functional'
    dropout_p: float = 0.0
    dropout_where: str = "slice"   # 'slice' | 'out'
    batchnorm: bool = False
    frozen: str | None = None      # 'ln' | 'lin'
    frozen_index: int = 0
    tied: bool = False
    buffer: str | None = None      # 'slice' | 'out'
    dict_input: bool = False
    dict_spelling: str = "getitem"  # 'getitem' (x[name]) | 'values' (x.values()) | 'items' (x.items())
    side_output: int | None = None  # index of the slice whose intermediate is returned too
    # chain (the op family): the norm (spelled by `ln`), the activation after it (spelled by
    # `tanh` when it is tanh; 'none' there means no activation) and the one after the Linear
    norm: str = "layer_norm"       # 'layer_norm' | 'rms_norm' | 'none'
    rms_eps: float | None = None   # RMSNorm's eps (None: the dtype's machine epsilon)
    act: str = "tanh"              # 'tanh' | one of CHAIN_ACTS
    out_act: str = "relu"          # one of CHAIN_OUT_ACTS (only when `relu`)
    act_spelling: str = "function"  # 'function' | 'module' | 'method' (method: sigmoid/relu/tanh only)
    features: tuple = field(default_factory=tuple)

    def short(self) -> str:
        """The non-default fields, one line: what a failure message names."""
        base = Spec(self.seed)
        parts = [f"seed={self.seed}"]
        for f in dataclasses.fields(self):
            if f.name in ("seed", "features"):
                continue
            v = getattr(self, f.name)
            if v != getattr(base, f.name) or f.name in ("F", "D", "B", "split", "sink", "lin"):
                parts.append(f"{f.name}={v!r}")
        return "Spec(" + ", ".join(parts) + ")"

    @property
    def exotic(self) -> bool:
        return bool(self.features)


def random_spec(seed: int, features=(), force=()) -> Spec:
    """A random spec; exotic features only from `features`, each drawn on with probability 1/2,
    except those in `force`, which are always on."""
    r = random.Random(seed)
    unknown = (set(features) | set(force)) - set(FEATURES)
    assert not unknown, unknown
    s = Spec(seed)
    s.F = r.randint(2, 5)
    s.D = r.choice([3, 4, 8])
    s.H = r.randint(1, 3)
    s.B = r.randint(1, 6)
    s.B_fresh = r.randint(1, 6)
    s.split = r.choice(SPLITS)
    s.sink = r.choice(SINKS)
    s.ln = r.choice(["module", "module", "shared", "functional"])
    s.affine = False if s.ln == "functional" else r.random() < 0.8
    s.eps = r.choice([0.0, 1e-5])
    s.tanh = r.choice(["torch", "torch", "method", "none"])
    s.lin = r.choice(["none", "after", "after", "shared", "per_feature"])
    s.bias = r.random() < 0.7
    s.relu = r.random() < 0.8
    s.transform_mode = r.choice(["train", "eval"])

    on = {f for f in FEATURES if f not in _OWN_STREAM and (f in force or (f in features and r.random() < 0.5))}
    rc = random.Random(seed * 7919 + 17)
    on |= {f for f in _OWN_STREAM if f in force or (f in features and rc.random() < 0.5)}
    s.features = tuple(sorted(on))
    if "chain" in on:
        s.norm = rc.choice(["layer_norm", "rms_norm", "rms_norm", "none"])
        s.rms_eps = rc.choice([None, None, 1e-6, 0.1])
        s.act = rc.choice(["tanh"] + CHAIN_ACTS)
        s.out_act = rc.choice(CHAIN_OUT_ACTS)
        s.act_spelling = rc.choice(["function", "module", "method"])
        if s.norm == "none" and s.lin == "none":
            s.lin = rc.choice(["after", "shared", "per_feature"])  # else the chain is one activation
    if "inplace" in on:
        s.inplace = r.choice(["relu_", "tanh_", "clamp_", "add_"])
        if s.inplace == "relu_":
            s.relu = True
            s.out_act = "relu"
            if s.lin == "none":
                s.lin = r.choice(["shared", "per_feature", "after"])
        if s.inplace == "tanh_":
            s.tanh = "method"
            s.act = "tanh"
        if s.inplace != "relu_" and s.norm == "none":
            s.norm = "layer_norm"  # the in-place op would change the input's own slice
    if "dropout" in on:
        s.dropout = r.choice(["module", "functional"])
        s.dropout_p = r.choice([0.0, 0.3])
        s.dropout_where = r.choice(["slice", "out"])
    if "batchnorm" in on:
        s.batchnorm = True
        s.B = max(s.B, 2)
        s.B_fresh = max(s.B_fresh, 2)
    if "frozen" in on:
        s.frozen = r.choice(["ln", "lin"])
        if s.frozen == "ln":
            s.ln, s.affine = "module", True
            s.norm = "layer_norm" if s.norm == "none" else s.norm
        else:
            s.lin = "per_feature"
        s.frozen_index = r.randrange(s.F)
    if "tied" in on:
        s.tied = True
        s.lin = "per_feature"
    if "buffer" in on:
        s.buffer = r.choice(["slice", "out"])
    if "dict_input" in on:
        s.dict_input = True
        s.dict_spelling = r.choice(["getitem", "values", "items"])
    if "side_output" in on:
        s.side_output = r.randrange(s.F)
    return s


def variant(feature: str, s: Spec) -> str:
    """The coarse variant of `feature` in `s`: the CI picks one spec per variant."""
    if feature == "inplace":
        return str(s.inplace)
    if feature == "dropout":
        return f"{s.dropout} p={'>0' if s.dropout_p > 0 else '0'}"
    if feature == "batchnorm":
        return f"transform in {s.transform_mode}"
    if feature == "frozen":
        return str(s.frozen)
    if feature == "buffer":
        return f"at {s.buffer}"
    if feature == "dict_input":
        return s.dict_spelling
    if feature == "chain":
        return s.norm
    return ""


def isolated_specs(first_seed: int = 100, per_variant: int = 1) -> list:
    """(feature, seed) pairs: for each feature alone, the first seeds from `first_seed` on that
    cover each of its variants `per_variant` times."""
    out = []
    for feature in FEATURES:
        seen: dict = {}
        seed = first_seed
        while seed < first_seed + 400:
            v = variant(feature, random_spec(seed, force=[feature]))
            if seen.get(v, 0) < per_variant:
                seen[v] = seen.get(v, 0) + 1
                out.append((feature, seed))
            seed += 1
    return out


class FuzzModel(nn.Module):
    def __init__(self, spec: Spec):
        super().__init__()
        s = self.spec = spec
        self.names = [f"f{i}" for i in range(s.F)]
        if s.norm != "none" and s.ln == "module":
            self.lns = nn.ModuleList([self._norm_module() for _ in range(s.F)])
        elif s.norm != "none" and s.ln == "shared":
            self.ln = self._norm_module()
        if s.act_spelling == "module":
            if s.act != "tanh":
                self.act_mod = _ACT_MODULES[s.act]()
            if s.relu and s.out_act != "relu":
                self.out_mod = _ACT_MODULES[s.out_act]()
        width = s.D
        if s.lin in ("after", "shared"):
            self.lin = nn.Linear(s.D, s.H, bias=s.bias)
            width = s.H
        elif s.lin == "per_feature":
            n = s.F - 1 if s.tied else s.F
            self.lins = nn.ModuleList([nn.Linear(s.D, s.H, bias=s.bias) for _ in range(n)])
            # tied: features 0 and 1 share lins[0]
            self.lin_index = [0] + list(range(n)) if s.tied else list(range(s.F))
            width = s.H
        self.width = width
        if s.dropout == "module":
            self.drop = nn.Dropout(s.dropout_p)
        if s.batchnorm:
            self.bn = nn.BatchNorm1d(s.F * width)
        if s.buffer is not None:
            self.register_buffer("scale", torch.rand(s.D if s.buffer == "slice" else width) + 0.5)
        for m in self.modules():  # non-trivial norm affine parameters
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.weight is not None:
                with torch.no_grad():
                    m.weight.uniform_(0.5, 1.5)
                    if getattr(m, "bias", None) is not None:
                        m.bias.uniform_(-0.5, 0.5)
        if s.frozen == "ln":
            self.lns[s.frozen_index].requires_grad_(False)
        elif s.frozen == "lin":
            self.lins[self.lin_index[s.frozen_index]].requires_grad_(False)

    def _norm_module(self):
        s = self.spec
        if s.norm == "rms_norm":
            return nn.RMSNorm(s.D, eps=s.rms_eps, elementwise_affine=s.affine)
        return nn.LayerNorm(s.D, eps=s.eps, elementwise_affine=s.affine)

    def _activation(self, h, name, module):
        """`name` applied to h, spelled as a module (`module`), a method or a function."""
        if module is not None:
            return module(h)
        if self.spec.act_spelling == "method" and name in ("sigmoid", "relu", "tanh"):
            return getattr(h, name)()
        return _ACT_FUNCTIONS[name](h)

    # -- pieces --------------------------------------------------------------------------------

    def _slices(self, x):
        s, F_, D = self.spec, self.spec.F, self.spec.D
        if s.dict_input:
            # 'values'/'items' follow the order of the dict the model is called with (Python semantics)
            if s.dict_spelling == "values":
                return list(x.values())
            if s.dict_spelling == "items":
                return [v for _, v in x.items()]
            return [x[n] for n in self.names]
        if s.split == "torch.split":
            return torch.split(x, D, dim=1)
        if s.split == "x.split":
            return x.split([D] * F_, 1)
        if s.split == "torch.chunk":
            return torch.chunk(x, F_, dim=1)
        if s.split == "tensor_split":
            return torch.tensor_split(x, F_, dim=1)
        if s.split == "slicing":
            return [x[:, i * D:(i + 1) * D] for i in range(F_)]
        if s.split == "unbind_view":
            return x.view(x.shape[0], F_, D).unbind(1)
        raise ValueError(s.split)

    def _dropout(self, h):
        s = self.spec
        if s.dropout == "module":
            return self.drop(h)
        return Fn.dropout(h, s.dropout_p, training=self.training)

    def _chain(self, i, h):
        s = self.spec
        if s.norm == "none":
            pass
        elif s.ln == "module":
            h = self.lns[i](h)
        elif s.ln == "shared":
            h = self.ln(h)
        elif s.norm == "rms_norm":
            h = Fn.rms_norm(h, (s.D,), eps=s.rms_eps)
        else:
            h = Fn.layer_norm(h, (s.D,), eps=s.eps)
        # in-place ops on the LayerNorm output (its backward does not need it)
        if s.inplace == "clamp_":
            h.clamp_(-1.0, 1.0)
        elif s.inplace == "add_":
            h.add_(0.25)  # h is used later (by tanh / the rest of the chain)
        if s.buffer == "slice":
            h = h * self.scale
        if s.inplace == "tanh_":
            h.tanh_()  # return value unused
        elif s.act != "tanh":
            h = self._activation(h, s.act, getattr(self, "act_mod", None))
        elif s.tanh == "torch":
            h = torch.tanh(h)
        elif s.tanh == "method":
            h = h.tanh()
        if s.dropout is not None and s.dropout_where == "slice":
            h = self._dropout(h)
        if s.lin == "shared":
            h = self.lin(h)
        elif s.lin == "per_feature":
            h = self.lins[self.lin_index[i]](h)
        if s.relu and s.lin != "after":
            h = self._relu(h)
        return h

    def _relu(self, h):
        if self.spec.out_act != "relu":
            return self._activation(h, self.spec.out_act, getattr(self, "out_mod", None))
        # relu_ only follows a Linear (relu_ on a tanh output would break tanh's backward)
        if self.spec.inplace == "relu_" and (self.spec.lin != "none"):
            torch.relu_(h)  # return value unused
            return h
        return torch.relu(h)

    def forward(self, x):
        s = self.spec
        parts = self._slices(x)
        outs = [self._chain(i, parts[i]) for i in range(s.F)]
        if s.sink == "stack0":
            y = torch.stack(outs, dim=0)            # [F, B, W]
        elif s.sink == "stack1":
            y = torch.stack(outs, dim=1)            # [B, F, W]
        else:
            y = torch.cat(outs, dim=1)
            y = y.view(y.shape[0], s.F, -1)         # [B, F, W]
        if s.lin == "after":
            y = self.lin(y)
            if s.relu:
                y = self._relu(y)
        if s.dropout is not None and s.dropout_where == "out":
            y = self._dropout(y)
        if s.batchnorm:
            z = y.transpose(0, 1) if s.sink == "stack0" else y
            y = self.bn(z.reshape(z.shape[0], -1))
        if s.buffer == "out":
            y = y * self.scale if not s.batchnorm else y * self.scale.repeat(s.F)
        if s.side_output is not None:
            return y, outs[s.side_output]
        return y

    # -- inputs --------------------------------------------------------------------------------

    def make_input(self, B: int, gen: torch.Generator, *, reorder: bool = False):
        s = self.spec
        if s.dict_input:
            vals = {n: torch.randn(B, s.D, generator=gen) for n in self.names}
            keys = list(reversed(self.names)) if reorder else list(self.names)
            if reorder and len(keys) > 2:
                keys = keys[1:] + keys[:1]  # neither the example's order nor a plain reversal
            return ({k: vals[k] for k in keys},)
        return (torch.randn(B, s.F * s.D, generator=gen),)


_ACT_FUNCTIONS = {
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": Fn.relu, "gelu": Fn.gelu,
    "gelu_tanh": lambda h: Fn.gelu(h, approximate="tanh"), "silu": Fn.silu,
    "leaky_relu": lambda h: Fn.leaky_relu(h, 0.2), "softplus": Fn.softplus,
}
_ACT_MODULES = {
    "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "relu": nn.ReLU, "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.2), "softplus": nn.Softplus,
}


def build(spec: Spec) -> FuzzModel:
    """The model of `spec`, bit-identical on every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return FuzzModel(spec)
