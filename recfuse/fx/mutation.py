"""In-place ops in a captured graph: made out-of-place where that is exact, kept (and fusion refused)
where it is not.

torch.fx records ``torch.relu_(y)`` or ``h.tanh_()`` as nodes whose return value is often unused;
the value they change is read through the *mutated* tensor's own node. A rewrite that reads that
node (or dead-code elimination, which drops a node nobody uses) would silently lose the mutation.
Before fusing, each in-place node `n` changing a tensor `y` is handled in one of three ways:

* `y` is a fresh intermediate (made by an op known to return a new tensor: an allow-list, since
  many ops may return their input itself or a view of it: ``nn.Identity``, dropout in eval,
  ``x.cpu()`` on a CPU tensor, ``x.type(x.dtype)``, ``torch.atleast_2d``, ``broadcast_to``, any
  unknown module or function) read by nothing but `n`: nothing can observe the mutation but
  `n`'s users, so `n` is an ordinary op.
* `y` is a fresh intermediate whose readers before `n` are all ops known to return a new tensor
  (or no tensor: ``y.shape``): the readers that run after `n` read `n` instead, and `n` becomes
  its out-of-place twin (``relu_`` -> ``relu``).
  The graph then says what the code did, without aliasing (later in-place ops on the same value
  are handled in turn, on `n`).
* anything else (`y` is an input, a parameter, a view or possible alias, or was read before `n`
  by an op that may return it or a view of it): the mutation is
  visible through aliases the graph does not show; `n` is kept exactly where it is and nothing in
  the graph is fused (the report says which op).
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Graph, Node

from .patterns import INPLACE_POS, _has_hooks as has_hooks, _own_forward as own_forward, submodule

__all__ = ["is_inplace", "functionalize_inplace", "keeps_node"]

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor}
_OUT_OF_PLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                           operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
                           operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
                           operator.ior: operator.or_, operator.ixor: operator.xor}
# Ops whose result shares storage with their first argument: mutating either changes the other.
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "narrow", "select", "transpose", "permute", "t",
                 "expand", "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "movedim", "moveaxis",
                 "as_strided", "detach", "contiguous", "split", "split_with_sizes", "chunk", "unbind",
                 "tensor_split", "diagonal", "unfold", "swapaxes", "swapdims", "real", "imag", "__getitem__",
                 "values", "to", "type_as", "float", "half", "bfloat16", "double"}
_VIEW_FNS = {operator.getitem, torch.narrow, torch.select, torch.transpose, torch.permute, torch.t,
             torch.squeeze, torch.unsqueeze, torch.flatten, torch.reshape, torch.movedim, torch.moveaxis,
             torch.split, torch.chunk, torch.unbind, torch.tensor_split, torch.diagonal, torch.as_strided,
             torch.detach, torch.swapaxes, torch.swapdims}


# Ops known to return a new tensor (never their input, nor a view of it). Anything not listed may
# alias its input, and an in-place op on it, or on a value it read, is kept as it is.
_FRESH_FNS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.matmul, operator.and_, operator.or_, operator.xor, operator.invert, operator.abs,
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide, torch.true_divide,
    torch.pow, torch.neg, torch.abs, torch.exp, torch.expm1, torch.log, torch.log1p, torch.log2, torch.sqrt,
    torch.rsqrt, torch.square, torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.relu, torch.erf,
    torch.reciprocal, torch.sign, torch.floor, torch.ceil, torch.round, torch.trunc, torch.clamp, torch.clip,
    torch.clamp_min, torch.clamp_max, torch.where, torch.lerp, torch.addcmul, torch.addcdiv, torch.maximum,
    torch.minimum, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.cat, torch.concat,
    torch.concatenate, torch.stack, torch.sum, torch.mean, torch.prod, torch.amax, torch.amin, torch.logsumexp,
    torch.softmax, torch.log_softmax, torch.cumsum, torch.clone, torch.zeros_like, torch.ones_like,
    torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like, torch.layer_norm, torch.rms_norm,
    torch.var, torch.std, torch.norm, torch.masked_fill,
    F.relu, F.gelu, F.silu, F.sigmoid, F.tanh, F.leaky_relu, F.elu, F.softplus, F.softmax, F.log_softmax,
    F.layer_norm, F.rms_norm, F.linear, F.normalize, F.embedding, F.embedding_bag, F.mish, F.hardswish,
    F.hardsigmoid, F.relu6, F.selu, F.celu, F.glu, F.logsigmoid, F.softsign, F.tanhshrink, F.batch_norm,
    F.group_norm, F.instance_norm, torch._C._nn.linear,
}
# Fresh only when their `inplace` flag is off (F.relu(x, True) returns x).
_FRESH_UNLESS_INPLACE = set(INPLACE_POS) - {F.dropout, F.alpha_dropout, F.rrelu}
_FRESH_METHODS = {
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "pow", "neg", "abs", "exp", "expm1",
    "log", "log1p", "log2", "sqrt", "rsqrt", "square", "sin", "cos", "tanh", "sigmoid", "relu", "erf",
    "reciprocal", "sign", "floor", "ceil", "round", "trunc", "clamp", "clip", "clamp_min", "clamp_max", "where",
    "lerp", "addcmul", "addcdiv", "maximum", "minimum", "matmul", "mm", "bmm", "addmm", "sum", "mean", "prod",
    "amax", "amin", "logsumexp", "softmax", "log_softmax", "cumsum", "clone", "var", "std", "norm",
    "masked_fill", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__mod__", "__pow__", "__rpow__", "__neg__", "__matmul__", "__abs__",
}
# Attributes of a tensor that are not tensors (reading them creates no alias).
_META_ATTRS = {"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout", "is_sparse"}
_META_METHODS = {"size", "dim", "numel", "stride", "storage_offset", "is_contiguous", "element_size",
                 "nelement", "ndimension", "get_device", "is_floating_point", "is_complex"}
# Modules known to return a new tensor (their class's own forward, not in-place); exact types.
_FRESH_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.Linear, nn.Tanh, nn.Sigmoid, nn.GELU, nn.Softplus,
                  nn.Softmax, nn.LogSoftmax, nn.Embedding, nn.EmbeddingBag, nn.BatchNorm1d,
                  nn.BatchNorm2d, nn.GroupNorm, nn.Bilinear)
_FRESH_UNLESS_INPLACE_MODULES = (nn.ReLU, nn.LeakyReLU, nn.ELU, nn.ReLU6, nn.Hardswish, nn.Hardsigmoid, nn.SELU,
                                 nn.CELU, nn.Hardtanh, nn.SiLU, nn.Mish)
# The out-of-place function (and its keyword arguments) each in-place activation module computes:
# an `nn.ReLU(inplace=True)` on a fresh value becomes `F.relu(x)`, so that a rewrite may batch it and
# dead-code elimination may drop it (a module node with inplace=True is kept as impure).
_MODULE_TWINS = {
    nn.ReLU: lambda m: (F.relu, {}), nn.SiLU: lambda m: (F.silu, {}), nn.Mish: lambda m: (F.mish, {}),
    nn.ReLU6: lambda m: (F.relu6, {}), nn.SELU: lambda m: (F.selu, {}), nn.Hardswish: lambda m: (F.hardswish, {}),
    nn.Hardsigmoid: lambda m: (F.hardsigmoid, {}),
    nn.LeakyReLU: lambda m: (F.leaky_relu, {"negative_slope": m.negative_slope}),
    nn.ELU: lambda m: (F.elu, {"alpha": m.alpha}), nn.CELU: lambda m: (F.celu, {"alpha": m.alpha}),
    nn.Hardtanh: lambda m: (F.hardtanh, {"min_val": m.min_val, "max_val": m.max_val}),
}


def _own_forward(mod: nn.Module) -> bool:
    """The module runs its class's own torch forward (no patched `forward`) and has no hooks."""
    return own_forward(mod) and not has_hooks(mod)


def _returns_fresh(node: Node, root: Optional[nn.Module]) -> bool:
    """True if `node` is known to return a new tensor (or no tensor), never an alias of an input."""
    op, t = node.op, node.target
    if op == "call_function":
        if t is getattr:
            return len(node.args) == 2 and node.args[1] in _META_ATTRS
        if t in _FRESH_UNLESS_INPLACE:
            return not is_inplace(node, root)
        try:
            return t in _FRESH_FNS and not is_inplace(node, root)
        except TypeError:  # unhashable target
            return False
    if op == "call_method":
        return t in _META_METHODS or (t in _FRESH_METHODS and not is_inplace(node, root))
    if op == "call_module":
        mod = _module(node, root)
        if mod is None or not _own_forward(mod):
            return False
        if type(mod) in _FRESH_MODULES:
            return True
        return type(mod) in _FRESH_UNLESS_INPLACE_MODULES and getattr(mod, "inplace", False) is not True
    return False


def _module(node: Node, root: Optional[nn.Module]) -> Optional[nn.Module]:
    if node.op != "call_module" or root is None:
        return None
    try:
        return submodule(root, node.target)
    except AttributeError:
        return None


def is_inplace(node: Node, root: Optional[nn.Module] = None) -> bool:
    """True if `node` changes its first tensor argument in place.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: x.relu_())
        >>> [is_inplace(n) for n in gm.graph.nodes]
        [False, True, False]
    """
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        t = node.target
        if t in _INPLACE_OPERATORS or t is operator.setitem:
            return True
        if node.kwargs.get("inplace") is True or "out" in node.kwargs:
            return True
        pos = INPLACE_POS.get(t)
        if pos is not None and len(node.args) > pos and node.args[pos] is True:
            return True  # F.relu(x, True)
        name = getattr(t, "__name__", "")
        return name.endswith("_") and not name.endswith("__") and not name.startswith("_")
    mod = _module(node, root)
    return mod is not None and _module_attr(mod, "inplace") is True


def _is_view(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        return node.target in _VIEW_FNS
    return False


def _out_of_place(node: Node, root) -> bool:
    """Turn `node` into its out-of-place twin; False when there is none."""
    if node.op == "call_method":
        twin = node.target[:-1]
        if not hasattr(torch.Tensor, twin):
            return False
        node.target = twin
        return True
    if node.op == "call_function":
        t = node.target
        if t in _OUT_OF_PLACE_OPERATORS:
            node.target = _OUT_OF_PLACE_OPERATORS[t]
            return True
        if node.kwargs.get("inplace") is True:
            node.kwargs = {**node.kwargs, "inplace": False}
            return True
        pos = INPLACE_POS.get(t)
        if pos is not None and len(node.args) > pos and node.args[pos] is True:
            node.args = node.args[:pos] + (False,) + node.args[pos + 1:]
            return True
        if "out" in node.kwargs or t is operator.setitem:
            return False
        name = t.__name__[:-1]
        for ns in (torch, torch.nn.functional, torch.special):
            twin = getattr(ns, name, None)
            if callable(twin) and getattr(ns, t.__name__, None) is t:
                node.target = twin
                return True
        return False
    mod = _module(node, root)
    twin = _MODULE_TWINS.get(type(mod)) if mod is not None and _own_forward(mod) else None
    if twin is not None:  # a known activation module: its out-of-place function, as a function node
        fn, kwargs = twin(mod)
        node.op, node.target, node.kwargs = "call_function", fn, kwargs
    return True  # (other modules with inplace=True: the result is y itself, readers are redirected to it)


def functionalize_inplace(graph: Graph, root: Optional[nn.Module] = None) -> list[str]:
    """Apply the rule in this module's docstring; returns the in-place ops that had to stay (each
    as ``"`name`: op"``), for which the caller must not fuse.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: (lambda y: (y.relu_(), y * 2)[1])(x + 1))
        >>> functionalize_inplace(gm.graph, gm), [n.target for n in gm.graph.nodes if n.op == "call_method"]
        ([], ['relu'])
    """
    order = None  # node -> position, built at the first in-place node (most graphs have none)
    by_target: dict = {}  # call_function target -> is_inplace, for nodes whose verdict is the target's alone
    kept = []
    for n in list(graph.nodes):
        if n.op == "call_function" and not n.kwargs:
            try:
                inplace = by_target.get(n.target) if n.target not in INPLACE_POS else None
                if inplace is None:
                    inplace = is_inplace(n, root)
                    if n.target not in INPLACE_POS:
                        by_target[n.target] = inplace
            except TypeError:  # an unhashable target
                inplace = is_inplace(n, root)
        else:
            inplace = is_inplace(n, root)
        if not inplace:
            continue
        if order is None:
            order = {m: i for i, m in enumerate(graph.nodes)}
        y = n.args[0] if n.args else None
        if not isinstance(y, Node):
            kept.append(f"`{n.name}`: {n.format_node()}")
            continue
        fresh = _returns_fresh(y, root)
        readers = [u for u in y.users if u is not n]
        # A reader before `n` that may have returned `y` itself or a view of it (nn.Identity,
        # x.cpu(), broadcast_to, ...) would see the mutation; only known-fresh readers are safe.
        aliased = any(not _returns_fresh(u, root) for u in readers if order[u] < order[n])
        if not fresh or aliased:
            kept.append(f"`{n.name}`: {n.format_node()}")
            continue
        if not readers and n.op != "call_module":
            continue
        later = [u for u in readers if order[u] > order[n]]
        if not _out_of_place(n, root):
            kept.append(f"`{n.name}`: {n.format_node()}")
            continue
        for u in later:
            u.replace_input_with(y, n)
    return kept


def keeps_node(root: Optional[nn.Module] = None):
    """An ``is_impure_node`` for `Graph.eliminate_dead_code`: fx's own rule, plus in-place ops.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: (x.relu_(), x)[1])
        >>> gm.graph.eliminate_dead_code(is_impure_node=keeps_node(gm))
        False
    """

    verdicts: dict = {}  # call_function target -> fx's verdict, which depends on the target alone
    whole: dict = {}  # call_function target -> this rule's verdict, for nodes without kwargs or inplace flag

    def impure(node: Node) -> bool:
        op = node.op
        if op == "call_module" and root is not None and (
                (owner := node.graph.owning_module) is root or owner is None):
            # fx's rule reads the module's `_is_impure`; one lookup serves both rules. (A graph
            # without an owning module: `root` owns its modules, as in `transform` before the
            # GraphModule is built, see capture.PendingModule.)
            mod = _module(node, root)
            if mod is not None:
                return _module_attr(mod, "_is_impure") or _module_attr(mod, "inplace") is True
            if owner is None:
                return True  # fx's rule cannot look it up: kept
        elif op == "call_function" and not isinstance(node.target, torch._ops.HigherOrderOperator):
            # (a higher-order op's verdict depends on its arguments: not cached)
            try:
                if node.kwargs or node.target in INPLACE_POS:  # is_inplace reads the arguments too
                    return _verdict_of_target(node, verdicts) or is_inplace(node, root)
                # without keyword arguments or an inplace flag position, is_inplace reads the target alone
                both = whole.get(node.target)
                if both is None:
                    both = whole[node.target] = _verdict_of_target(node, verdicts) or is_inplace(node, root)
                return both
            except TypeError:  # an unhashable target
                return node.is_impure() or is_inplace(node, root)
        return node.is_impure() or is_inplace(node, root)

    return impure


def _verdict_of_target(node: Node, verdicts: dict) -> bool:
    """fx's `node.is_impure()` of a call_function node, cached per target in `verdicts`."""
    try:
        verdict = verdicts.get(node.target)
        if verdict is None:
            verdict = verdicts[node.target] = node.is_impure()
    except TypeError:  # an unhashable target
        verdict = node.is_impure()
    return verdict


_CLASS_HAS: dict = {}  # (module class, name) -> whether the class or a base defines the name


def _module_attr(mod: nn.Module, name: str) -> Any:
    """``getattr(mod, name, False)``, without the AttributeError nn.Module.__getattr__ raises (and
    getattr catches) when neither the module nor its class has the name, the usual case: a few
    microseconds per node of a large graph."""
    cls = type(mod)
    found = _CLASS_HAS.get((cls, name))
    if found is None:
        found = _CLASS_HAS[cls, name] = any(name in vars(k) for k in cls.__mro__)
    d = mod.__dict__
    if found or name in d or cls.__getattr__ is not nn.Module.__getattr__:
        return getattr(mod, name, False)
    for store in ("_parameters", "_buffers", "_modules"):  # where nn.Module.__getattr__ looks
        if name in d.get(store, ()):
            return d[store][name]
    return False
