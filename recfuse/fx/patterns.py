"""Pattern vocabulary of the pass: what a per-slice op, a slice and a sink look like in a graph.

One model can spell the same computation many ways (``nn.LayerNorm`` module or
``F.layer_norm``; ``x.tanh()``, ``torch.tanh`` or ``nn.Tanh``; ``torch.split`` or ``x[:, a:b]``).
This module maps each spelling onto one normal form, so the analysis in `analysis.py` compares
normal forms only:

* `OpInfo`: a per-slice op (kind, data input, hyper-parameters, parameter references).
* `SliceInfo`: where a slice comes from (source tensor, dim, range or index, or a dict key).
* `SliceChain`: the ops between one slice and the sink, and its `signature` (two slices can be
  batched together exactly when their signatures are equal).
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node
from torch.nn.modules import module as _nn_module

from .values import ValueInfo, tensor_dtype, tensor_shape, value_of

__all__ = ["ParamRef", "OpInfo", "SliceInfo", "SliceChain", "classify", "slice_info", "sink_info",
           "walk_chain", "fmt_float", "submodule"]


def fmt_float(v: float) -> str:
    """Short float text for reports: 1e-05 -> '1e-5', 0.1 -> '0.1'.

    Example:
        >>> fmt_float(1e-5), fmt_float(0.0)
        ('1e-5', '0')
    """
    s = f"{v:g}"
    if "e" in s:
        m, e = s.split("e")
        s = f"{m}e{int(e)}"
    return s


@dataclass(frozen=True)
class ParamRef:
    """A parameter of a per-slice op: an attribute of the root module, or an in-graph tensor node
    (Dynamo lifts parameters to graph inputs)."""

    attr: Optional[str] = None
    node: Optional[Node] = None

    @property
    def key(self):
        return self.attr if self.attr is not None else self.node


@dataclass
class OpInfo:
    """One per-slice op in normal form.

    kind: 'layer_norm', 'rms_norm' (both with attrs eps and shape; an RMSNorm's eps may be None:
    F.rms_norm's default for the input's dtype, at run time), 'linear', an activation (`ACTIVATIONS`; gelu's
    attr 'approximate', leaky_relu's 'negative_slope', softplus's 'beta' and 'threshold', elu's
    'alpha') or 'view' (view/reshape/squeeze/unsqueeze/flatten/contiguous). attrs: the
    hyper-parameters that must match across slices. params: name -> ParamRef or None.
    """

    kind: str
    node: Node
    data: Node
    attrs: tuple = ()
    params: dict = field(default_factory=dict)

    def attr(self, name, default=None):
        return dict(self.attrs).get(name, default)


ACTIVATIONS = ("tanh", "relu", "sigmoid", "gelu", "silu", "leaky_relu", "softplus", "elu")

_FN_ACTIVATION = {
    torch.tanh: "tanh", F.tanh: "tanh", torch.relu: "relu", F.relu: "relu", torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid", F.gelu: "gelu", F.silu: "silu", F.leaky_relu: "leaky_relu", F.softplus: "softplus",
    F.elu: "elu",
}
_MODULE_ACTIVATION = {nn.Tanh: "tanh", nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.GELU: "gelu", nn.SiLU: "silu",
                      nn.LeakyReLU: "leaky_relu", nn.Softplus: "softplus", nn.ELU: "elu"}
_METHOD_ACTIVATION = {"tanh": "tanh", "relu": "relu", "sigmoid": "sigmoid"}
# Hyper-parameters of the activations that have some: (name, position after the input, default).
_ACTIVATION_ATTRS = {
    "gelu": (("approximate", 1, "none"),),
    "leaky_relu": (("negative_slope", 1, 0.01),),
    "softplus": (("beta", 1, 1.0), ("threshold", 2, 20.0)),
    "elu": (("alpha", 1, 1.0),),
}
# Position of the `inplace` flag of functions that have one (F.relu(x, True)).
INPLACE_POS = {F.relu: 1, F.silu: 1, F.leaky_relu: 2, F.elu: 2, F.relu6: 1, F.hardtanh: 3, F.dropout: 3,
               F.alpha_dropout: 3, F.selu: 1, F.celu: 2, F.hardswish: 1, F.hardsigmoid: 1, F.mish: 1,
               F.threshold: 3, F.rrelu: 4}
_VIEW_METHODS = {"view", "reshape", "squeeze", "unsqueeze", "flatten", "contiguous", "view_as", "reshape_as"}
_VIEW_FNS = {torch.reshape, torch.squeeze, torch.unsqueeze, torch.flatten}
_LAYER_NORM_FNS = {F.layer_norm, torch.layer_norm}
_LINEAR_FNS = {F.linear, torch._C._nn.linear}
_RMS_NORM_FNS = {F.rms_norm, torch.rms_norm}


def _arg(node: Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _param_ref(a) -> Optional[ParamRef]:
    if a is None:
        return None
    if isinstance(a, Node):
        return ParamRef(attr=a.target) if a.op == "get_attr" else ParamRef(node=a)
    return ParamRef()  # a constant tensor baked into the code: cannot be referenced, never batched


def submodule(root: nn.Module, qualname: str) -> nn.Module:
    """``root.get_submodule(qualname)`` through the `_modules` dicts: the pass looks up one
    module per node, and `nn.Module.__getattr__` made that a large share of analysing a big graph.

    Raises:
        AttributeError: no submodule has that name.

    Example:
        >>> m = nn.Sequential(nn.Sequential(nn.Tanh()))
        >>> submodule(m, "0.0")
        Tanh()
    """
    mod = root
    for part in qualname.split("."):
        child = mod._modules.get(part)
        if child is None:
            return root.get_submodule(qualname)  # raises the usual error, or finds what _modules does not hold
        mod = child
    return mod


def _has_hooks(mod: nn.Module) -> bool:
    _m = _nn_module  # global hooks fire on every module call too
    return bool(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                or getattr(mod, "_backward_pre_hooks", None)
                or _m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks
                or getattr(_m, "_global_backward_pre_hooks", None))


_TORCH_FORWARD: dict = {}  # (class, its forward) -> whether that is torch's own forward of the class


def _own_forward(mod: nn.Module) -> bool:
    """The module computes what its torch class says: no `forward` assigned on the instance
    (monkeypatching, wrappers), and the class's forward is still torch's own (not replaced)."""
    if "forward" in mod.__dict__:
        return False
    cls = type(mod)
    fwd = cls.__dict__.get("forward")
    try:
        return _TORCH_FORWARD[cls, fwd]
    except (KeyError, TypeError):
        pass
    own = fwd is not None and getattr(fwd, "__module__", "").startswith("torch.nn.modules.") and \
        getattr(fwd, "__qualname__", "") == f"{cls.__name__}.forward"
    try:
        _TORCH_FORWARD[cls, fwd] = own
    except TypeError:  # an unhashable forward
        pass
    return own


_CLASS_HAS_INPLACE: dict = {}  # module class -> whether the class (or a base) defines `inplace`


def _inplace_flag(mod: nn.Module) -> Any:
    """``getattr(mod, "inplace", False)`` without the AttributeError nn.Module.__getattr__ raises
    (and getattr catches) for the modules that have no such flag (LayerNorm, Linear)."""
    cls = type(mod)
    found = _CLASS_HAS_INPLACE.get(cls)
    if found is None:
        found = _CLASS_HAS_INPLACE[cls] = any("inplace" in vars(k) for k in cls.__mro__)
    d = mod.__dict__
    if found or "inplace" in d or cls.__getattr__ is not nn.Module.__getattr__:
        return getattr(mod, "inplace", False)
    for store in ("_parameters", "_buffers", "_modules"):  # where nn.Module.__getattr__ looks
        if "inplace" in d.get(store, ()):
            return d[store]["inplace"]
    return False


def _normalized_shape(shape) -> Optional[tuple]:
    computed = isinstance(shape, Node)
    if computed:  # e.g. s.shape[-1:], known from the example
        shape = value_of(shape)
    shape = (shape,) if isinstance(shape, int) else tuple(shape) if isinstance(shape, (list, tuple, torch.Size)) else None
    if shape is None or not all(isinstance(s, int) for s in shape):
        return None
    if computed and len(shape) > 1:
        # ``F.layer_norm(t, t.shape)`` normalizes over the batch too: a batched norm would keep
        # the example's batch size in its normalized_shape. Only the row width is taken as fixed.
        return None
    return shape


def _computed_shape(shape) -> tuple:
    """attrs marking a normalized_shape computed in the graph (``t.shape[-1:]``, ``(x.shape[0],)``):
    its value is the example's, and the size it reads may be the batch (a slice of ``x.T``), so a
    batched norm reads it from its input per call (`runtime.trailing_shape`) instead."""
    return (("computed_shape", True),) if isinstance(shape, Node) else ()


def _eps_attr(eps) -> Optional[float]:
    """A norm's eps as an attr: a float, or None (RMSNorm's default, which depends on the dtype)."""
    return None if eps is None else float(eps)


def classify(node: Node, root: Optional[nn.Module]) -> Optional[OpInfo]:
    """Normal form of `node` if it is a per-slice op recfuse can batch, else None.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: x.tanh())
        >>> [classify(n, gm).kind for n in gm.graph.nodes if n.op == "call_method"]
        ['tanh']
    """
    op, t = node.op, node.target
    if op == "call_module" and root is not None:
        try:
            mod = submodule(root, t)
        except AttributeError:
            return None
        if not node.args or not isinstance(node.args[0], Node) or node.kwargs or len(node.args) != 1:
            return None
        if _has_hooks(mod):
            return None  # a batched rewrite would never call the module, so its hooks would not run
        if not _own_forward(mod):
            return None  # a patched forward: the module's type no longer says what it computes
        if _inplace_flag(mod) is True:
            return None  # changes its input (mutation.py makes the known ones functions first)
        x = node.args[0]
        if type(mod) is nn.LayerNorm:
            return OpInfo("layer_norm", node, x, (("eps", float(mod.eps)), ("shape", tuple(mod.normalized_shape))),
                          {"weight": ParamRef(f"{t}.weight") if mod.weight is not None else None,
                           "bias": ParamRef(f"{t}.bias") if getattr(mod, "bias", None) is not None else None})
        if type(mod) is nn.RMSNorm:
            return OpInfo("rms_norm", node, x, (("eps", _eps_attr(mod.eps)), ("shape", tuple(mod.normalized_shape))),
                          {"weight": ParamRef(f"{t}.weight") if mod.weight is not None else None})
        if type(mod) is nn.Linear:
            return OpInfo("linear", node, x, (), {"weight": ParamRef(f"{t}.weight"),
                                                  "bias": ParamRef(f"{t}.bias") if mod.bias is not None else None})
        kind = _MODULE_ACTIVATION.get(type(mod))
        if kind is not None:
            attrs = tuple((name, getattr(mod, name)) for name, _, _ in _ACTIVATION_ATTRS.get(kind, ()))
            return OpInfo(kind, node, x, attrs)
        if type(mod) is nn.Identity:
            return OpInfo("view", node, x)
        return None
    if op == "call_function":
        if not node.args or not isinstance(node.args[0], Node):
            return None
        if "out" in node.kwargs:
            return None  # torch.tanh(x, out=buf) writes buf, which a batched rewrite would not
        x = node.args[0]
        if t in _LAYER_NORM_FNS:
            shape = _normalized_shape(_arg(node, 1, "normalized_shape"))
            eps = _arg(node, 4, "eps", 1e-5)
            if shape is None or not isinstance(eps, (int, float)):
                return None
            return OpInfo("layer_norm", node, x, (("eps", float(eps)), ("shape", shape))
                          + _computed_shape(_arg(node, 1, "normalized_shape")),
                          {"weight": _param_ref(_arg(node, 2, "weight")), "bias": _param_ref(_arg(node, 3, "bias"))})
        if t in _RMS_NORM_FNS:
            shape = _normalized_shape(_arg(node, 1, "normalized_shape"))
            eps = _arg(node, 3, "eps", None)
            if shape is None or not (eps is None or isinstance(eps, (int, float))) or isinstance(eps, bool):
                return None
            return OpInfo("rms_norm", node, x, (("eps", _eps_attr(eps)), ("shape", shape))
                          + _computed_shape(_arg(node, 1, "normalized_shape")),
                          {"weight": _param_ref(_arg(node, 2, "weight"))})
        if t in _LINEAR_FNS:
            w = _arg(node, 1, "weight")
            if not isinstance(w, Node):
                return None
            return OpInfo("linear", node, x, (), {"weight": _param_ref(w), "bias": _param_ref(_arg(node, 2, "bias"))})
        if t in _FN_ACTIVATION:
            kind = _FN_ACTIVATION[t]
            if t in INPLACE_POS and _arg(node, INPLACE_POS[t], "inplace", False) is not False:
                return None  # F.relu(x, True): changes x, which a batched rewrite would not
            attrs = []
            for name, pos, default in _ACTIVATION_ATTRS.get(kind, ()):
                v = _arg(node, pos, name, default)
                if isinstance(v, Node):
                    return None  # a hyper-parameter computed in the graph: not comparable across slices
                attrs.append((name, v))
            return OpInfo(kind, node, x, tuple(attrs))
        if t in _VIEW_FNS:
            return OpInfo("view", node, x)
        return None
    if op == "call_method":
        if not node.args or not isinstance(node.args[0], Node):
            return None
        x = node.args[0]
        if t in _METHOD_ACTIVATION and len(node.args) == 1 and not node.kwargs:
            return OpInfo(_METHOD_ACTIVATION[t], node, x)
        if t in _VIEW_METHODS:
            return OpInfo("view", node, x)
    return None


# ---------------------------------------------------------------------------------------------
# slices


@dataclass(frozen=True)
class SliceInfo:
    """Where one slice comes from: `source` sliced along `dim`, either a `range` [start,
    start+length) (split, chunk, tensor_split, narrow, x[:, a:b]) keeping the dim, an `index`
    (unbind, select, x[:, i]) removing it, or a `key` of a dict of tensors."""

    source: Node
    kind: str  # 'range' | 'index' | 'dict'
    dim: int = 0
    start: int = 0
    length: int = 1
    key: Any = None
    open_end: bool = False  # ``x[9:]``: its length is the example's size of `dim` less `start`

    def label(self) -> str:
        if self.kind == "dict":
            return f"{self.source.name}[{self.key!r}]"
        if self.kind == "index":
            return f"{self.source.name}.select({self.dim}, {self.start})"
        return f"{self.source.name}.narrow({self.dim}, {self.start}, {self.length})"


_SPLIT_FNS = {torch.split: "split", torch.chunk: "chunk", torch.tensor_split: "tensor_split", torch.unbind: "unbind"}
_SPLIT_METHODS = {"split", "chunk", "tensor_split", "unbind", "split_with_sizes"}


def _norm_dim(d, ndim) -> Optional[int]:
    if not isinstance(d, int) or not -ndim <= d < ndim:
        return None
    return d % ndim


def _parse_index(idx, shape) -> Optional[tuple]:
    """x[idx] selecting along exactly one dim -> ('range'|'index', dim, start, length[, open_end])."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(i is Ellipsis for i in idx):
        k = idx.index(Ellipsis)
        fill = len(shape) - (len(idx) - 1)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    if len(idx) > len(shape):
        return None
    found = None
    for d, i in enumerate(idx):
        if isinstance(i, slice):
            if i == slice(None) or (i.step in (None, 1) and i.start in (None, 0) and i.stop is None):
                continue
            if i.step not in (None, 1) or isinstance(i.start, Node) or isinstance(i.stop, Node):
                return None
            neg_start = i.start is not None and i.start < 0
            if neg_start or (i.stop is not None and i.stop < 0):
                # Counted from the end (``x[-6:-3]``): the offset follows the dim's size on each call,
                # so it is kept negative (narrow takes it so); a length that depends on the size
                # (``x[2:-2]``, ``x[-6:4]``) is not a slice of fixed place.
                stop = 0 if i.stop is None else i.stop
                if not neg_start or stop > 0 or -i.start > shape[d] or stop <= i.start:
                    return None
                cand = ("range", d, i.start, stop - i.start)
            else:
                start, stop, _ = i.indices(shape[d])
                cand = ("range", d, start, max(stop - start, 0), i.stop is None)
        elif isinstance(i, int) and not isinstance(i, bool):
            if not -shape[d] <= i < shape[d]:
                return None
            cand = ("index", d, i, 1)  # negative: counted from the end on each call
        else:
            return None
        if found is not None:
            return None
        found = cand
    return found


def slice_info(node: Node) -> Optional[SliceInfo]:
    """How `node` slices a tensor (or a dict of tensors), or None.

    Example:
        >>> import torch, recfuse.fx.capture as c
        >>> gm, _ = c.capture(lambda x: x[:, 2:4], (torch.randn(3, 8),))
        >>> n = [n for n in gm.graph.nodes if n.op == "call_function"][0]
        >>> slice_info(n).kind, slice_info(n).start, slice_info(n).length
        ('range', 2, 2)
    """
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        parent, idx = node.args
        if not isinstance(parent, Node):
            return None
        pv = value_of(parent)
        if type(pv) is not tuple and type(pv) is not list and isinstance(pv, Mapping):
            return SliceInfo(parent, "dict", key=idx) if not isinstance(idx, Node) else None
        if isinstance(pv, (tuple, list)) and isinstance(idx, int):
            split = _split_kind(parent)
            if split is None:
                return None
            kind, src, dim = split
            shape = tensor_shape(src)
            if shape is None:
                return None
            d = _norm_dim(dim, len(shape))
            if d is None:
                return None
            if kind == "unbind":
                return SliceInfo(src, "index", d, idx % len(pv), 1)
            # Offsets of all pieces, computed once per split node (1000-way splits are common).
            starts = parent.meta.get("recfuse_starts")
            if starts is None or starts[0] != d:
                if not all(isinstance(x, ValueInfo) for x in pv):
                    return None
                lengths = [x.shape[d] for x in pv]
                offs = [0]
                for n in lengths:
                    offs.append(offs[-1] + n)
                starts = (d, offs)
                parent.meta["recfuse_starts"] = starts
            offs = starts[1]
            i = idx % len(pv)
            return SliceInfo(src, "range", d, offs[i], offs[i + 1] - offs[i])
        shape = tensor_shape(parent)
        if shape is None:
            return None
        parsed = _parse_index(idx, shape)
        if parsed is None:
            return None
        kind, d, start, length, *open_end = parsed
        return SliceInfo(parent, kind, d, start, length, open_end=bool(open_end and open_end[0]))
    if node.op in ("call_method", "call_function") and node.args and isinstance(node.args[0], Node):
        name = node.target if node.op == "call_method" else {torch.narrow: "narrow", torch.select: "select"}.get(node.target)
        src = node.args[0]
        shape = tensor_shape(src)
        if name not in ("narrow", "select") or shape is None:
            return None
        d = _norm_dim(_arg(node, 1, "dim"), len(shape))
        if d is None:
            return None
        # A negative start or index counts from the end on each call: it is kept negative.
        if name == "narrow":
            start, length = _arg(node, 2, "start"), _arg(node, 3, "length")
            if isinstance(start, int) and isinstance(length, int) and (start >= 0 or start + length <= 0):
                return SliceInfo(src, "range", d, start, length)
        else:
            i = _arg(node, 2, "index")
            if isinstance(i, int):
                return SliceInfo(src, "index", d, i, 1)
    return None


def _split_kind(parent: Node) -> Optional[tuple]:
    if parent.op == "call_function" and parent.target in _SPLIT_FNS:
        kind = _SPLIT_FNS[parent.target]
    elif parent.op == "call_method" and parent.target in _SPLIT_METHODS:
        kind = "split" if parent.target == "split_with_sizes" else parent.target
    else:
        return None
    if not parent.args or not isinstance(parent.args[0], Node):
        return None
    dim = _arg(parent, 1, "dim", 0) if kind == "unbind" else _arg(parent, 2, "dim", 0)
    return kind, parent.args[0], dim


# ---------------------------------------------------------------------------------------------
# sinks and chains


_STACK_FNS = {torch.stack: "stack", torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat"}


def sink_info(node: Node) -> Optional[tuple[str, list, int]]:
    """('stack'|'cat', inputs, dim) for a torch.stack/torch.cat node over a list of tensors.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda a, b: torch.stack([a, b], 1))
        >>> [sink_info(n)[::2] for n in gm.graph.nodes if n.op == "call_function"]
        [('stack', 1)]
    """
    if node.op != "call_function" or node.target not in _STACK_FNS:
        return None
    xs = _arg(node, 0, "tensors")
    if not isinstance(xs, (list, tuple)) or not all(isinstance(x, Node) for x in xs):
        return None
    dim = _arg(node, 1, "dim", 0)
    if not isinstance(dim, int):
        return None
    return _STACK_FNS[node.target], list(xs), dim


@dataclass
class SliceChain:
    """The per-slice ops between one slice `start` and the sink input `end`.

    pre: leading view ops, ops: compute ops (views that keep the shape are dropped), post:
    trailing view ops. `start` is whatever feeds the chain (a slice node, a dict entry, or any
    tensor: slices of unknown origin are batched by stacking).
    """

    start: Node
    pre: list
    ops: list
    post: list
    end: Node
    slice: Optional[SliceInfo] = None
    seq: list = field(default_factory=list)  # every op node walked, views included

    @property
    def core_in(self) -> Optional[tuple]:
        return tensor_shape(self.ops[0].data) if self.ops else None

    @property
    def core_out(self) -> Optional[tuple]:
        return tensor_shape(self.ops[-1].node) if self.ops else None

    def nodes(self) -> list:
        return [o.node for o in self.pre + self.ops + self.post]

    def signature(self) -> tuple:
        """Everything two slices must share to be batched (not parameter identities)."""
        ops = []
        for o in self.ops:
            pshapes = tuple((k, None if r is None else _ref_shape(r, o)) for k, r in sorted(o.params.items()))
            ops.append((o.kind, o.attrs, pshapes))
        return (tensor_shape(self.start), tensor_dtype(self.start), self.core_in, tuple(ops),
                tensor_shape(self.end))

    def describe(self) -> str:
        return " -> ".join(o.kind for o in self.ops)


def _ref_shape(r: ParamRef, op: OpInfo):
    if r.node is not None:
        return tensor_shape(r.node)
    if r.attr is not None:
        return "attr"  # attribute shapes are checked when parameters are gathered
    return "const"


def view_sizes(n: Node) -> Optional[list]:
    """The sizes a view/reshape node asks for, as written (ints, -1, or graph values), else None.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: x.view(-1, 4))
        >>> view_sizes([n for n in gm.graph.nodes if n.op == "call_method"][0])
        [-1, 4]
    """
    if n.op == "call_method" and n.target in ("view", "reshape") and len(n.args) >= 2 and not n.kwargs:
        sizes = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
    elif n.op == "call_function" and n.target is torch.reshape and len(n.args) == 2 and not n.kwargs:
        sizes = n.args[1]
    else:
        return None
    return list(sizes) if isinstance(sizes, (list, tuple)) else None


def keeps_shape(o: OpInfo) -> bool:
    """Whether the view op `o` keeps its input's shape at every batch size, judged from its code:
    the example may keep it by coincidence (``h.squeeze()`` or ``h.squeeze(0)`` when B > 1 drop the
    batch dim of a call with B == 1; ``h.reshape(H, -1)`` of [B, H] when B == H). Sizes must be -1,
    computed in the graph (``h.shape[0]``) or, for the row width (the last dim), a literal."""
    n = o.node
    if n.op == "call_module" or (n.op == "call_method" and n.target == "contiguous"):
        return True
    shape = tensor_shape(o.data)
    if shape is None or shape != tensor_shape(n):
        return False
    sizes = view_sizes(n)
    if sizes is None or len(sizes) != len(shape):
        return False
    last = len(sizes) - 1
    return all(isinstance(v, Node) or (type(v) is int and (v == -1 or i == last)) for i, v in enumerate(sizes))


def walk_chain(end: Node, root) -> SliceChain:
    """Walk back from a sink input through per-slice ops to where the slice starts.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.stack([x.tanh().relu()]))
        >>> out = [n for n in gm.graph.nodes if n.op == "call_function"][0]
        >>> walk_chain(out.args[0][0], gm).describe()
        'tanh -> relu'
    """
    seq = []
    cur = end
    while True:
        o = classify(cur, root)
        if o is None:
            break
        seq.append(o)
        cur = o.data
    seq.reverse()
    # Leading and trailing views are reshapes around the batched chain; a shape-changing view in
    # the middle ends the chain (what is before it is left per slice).
    last_view = -1
    for i, o in enumerate(seq):
        if o.kind == "view":
            inner = any(p.kind != "view" for p in seq[:i]) and any(p.kind != "view" for p in seq[i + 1:])
            if inner and not keeps_shape(o):
                last_view = i
    if last_view >= 0:
        seq = seq[last_view + 1:]
        cur = seq[0].data if seq else end
    n_pre = 0
    while n_pre < len(seq) and seq[n_pre].kind == "view":
        n_pre += 1
    n_post = 0
    while n_post < len(seq) - n_pre and seq[len(seq) - 1 - n_post].kind == "view":
        n_post += 1
    pre = seq[:n_pre]
    post = seq[len(seq) - n_post:] if n_post else []
    ops = [o for o in seq[n_pre:len(seq) - n_post] if o.kind != "view"]
    start = seq[0].data if seq else end
    return SliceChain(start, pre, ops, post, end, slice_info(start), [o.node for o in seq])
