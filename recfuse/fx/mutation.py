"""In-place ops in a captured graph: made out-of-place where that is exact, kept (and fusion refused)
where it is not.

torch.fx records ``torch.relu_(y)`` or ``h.tanh_()`` as nodes whose return value is often unused;
the value they change is read through the *mutated* tensor's own node. A rewrite that reads that
node (or dead-code elimination, which drops a node nobody uses) would silently lose the mutation.
Before fusing, each in-place node `n` changing a tensor `y` is handled in one of three ways:

* `y` is a fresh intermediate (not an input, parameter or view) read by nothing but `n`: nothing
  can observe the mutation but `n`'s users, so `n` is an ordinary op.
* `y` is a fresh intermediate whose other readers are all plain (non-view) ops: the readers that
  run after `n` read `n` instead, and `n` becomes its out-of-place twin (``relu_`` -> ``relu``).
  The graph then says what the code did, without aliasing (later in-place ops on the same value
  are handled in turn, on `n`).
* anything else (`y` is an input, a parameter, a view, or was viewed before `n`): the mutation is
  visible through aliases the graph does not show; `n` is kept exactly where it is and nothing in
  the graph is fused (the report says which op).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import nn
from torch.fx import Graph, Node

from .patterns import INPLACE_POS, submodule

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
    return mod is not None and getattr(mod, "inplace", False) is True


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
    return True  # a module with inplace=True: its result is y itself, readers are redirected to it


def functionalize_inplace(graph: Graph, root: Optional[nn.Module] = None) -> list[str]:
    """Apply the rule in this module's docstring; returns the in-place ops that had to stay (each
    as ``"`name`: op"``), for which the caller must not fuse.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: (lambda y: (y.relu_(), y * 2)[1])(x + 1))
        >>> functionalize_inplace(gm.graph, gm), [n.target for n in gm.graph.nodes if n.op == "call_method"]
        ([], ['relu'])
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    kept = []
    for n in list(graph.nodes):
        if not is_inplace(n, root):
            continue
        y = n.args[0] if n.args else None
        if not isinstance(y, Node):
            kept.append(f"`{n.name}`: {n.format_node()}")
            continue
        fresh = y.op in ("call_function", "call_method", "call_module") and not _is_view(y) and not is_inplace(y, root)
        readers = [u for u in y.users if u is not n]
        aliased = any(_is_view(u) or is_inplace(u, root) for u in readers if order[u] < order[n])
        if not fresh or aliased:
            kept.append(f"`{n.name}`: {n.format_node()}")
            continue
        if not readers:
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

    def impure(node: Node) -> bool:
        op = node.op
        if op == "call_module" and root is not None and root is node.graph.owning_module:
            # fx's rule reads the module's `_is_impure`; one lookup serves both rules
            mod = _module(node, root)
            if mod is not None:
                return getattr(mod, "_is_impure", False) or getattr(mod, "inplace", False) is True
        elif op == "call_function" and not isinstance(node.target, torch._ops.HigherOrderOperator):
            # (a higher-order op's verdict depends on its arguments: not cached)
            try:
                verdict = verdicts.get(node.target)
                if verdict is None:
                    verdict = verdicts[node.target] = node.is_impure()
            except TypeError:  # an unhashable target
                verdict = node.is_impure()
            return verdict or is_inplace(node, root)
        return node.is_impure() or is_inplace(node, root)

    return impure
