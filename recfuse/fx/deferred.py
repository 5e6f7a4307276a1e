"""Example values that capture leaves uncomputed: their exact metadata, no data.

Capture runs every op of the model on the example inputs to learn shapes. A per-feature model runs
the same few ops thousands of times on arguments of the same shape, stride, dtype and device
(10,000 LayerNorms, 10,000 tanh), and running them was the largest share of capturing it. For the
ops in `op_key`'s list, whose result metadata is a function of their arguments' metadata (no
state, no randomness, no mutation, a fresh strided tensor out), the metadata of the first result
is kept per argument metadata, and a later call with the same argument metadata gives a
`Deferred` (shape, stride, dtype, device) instead of a tensor. A call with a `Deferred` argument
and new metadata runs once on uninitialised stand-ins of the same metadata to learn its result's.

A deferred value is computed (by the caller, see `capture._ValueTracer`) only when something
needs its data. That happens later than eager execution would have, so it must see the same
inputs and the same global state: every op not in the list (any of which may mutate a tensor)
first computes all pending values, ops in the list mutate nothing, values are deferred only in
the plain global state (`plain_state`), and pending values are computed under it
(`plain_context`).

Example:
    >>> import torch
    >>> d = Deferred(None, *tensor_meta(torch.zeros(2, 3)))
    >>> d.value_info(), tuple(stand_in(d).shape)
    (ValueInfo(shape=(2, 3), dtype=torch.float32), (2, 3))
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _nn_module

from .values import ValueInfo

__all__ = ["Deferred", "tensor_meta", "stand_in", "op_key", "plain_state", "plain_context",
           "is_container_getitem"]


class Deferred:
    """The value of `node`, not computed: what running it would give, metadata only."""

    __slots__ = ("node", "shape", "stride", "dtype", "device")

    def __init__(self, node, shape: torch.Size, stride: tuple, dtype: torch.dtype, device: torch.device):
        self.node, self.shape, self.stride, self.dtype, self.device = node, shape, stride, dtype, device

    def meta(self) -> tuple:
        return (self.shape, self.stride, self.dtype, self.device)

    def value_info(self) -> ValueInfo:
        return ValueInfo(tuple(int(s) for s in self.shape), self.dtype)


def tensor_meta(t: Any) -> Optional[tuple]:
    """(shape, stride, dtype, device) of a plain strided floating tensor (or a `Deferred`), else None."""
    if type(t) is Deferred:
        return t.meta()
    if (type(t) is torch.Tensor or type(t) is nn.Parameter) and t.layout is torch.strided and t.dtype.is_floating_point:
        return (t.shape, t.stride(), t.dtype, t.device)
    return None


def stand_in(d: Deferred) -> torch.Tensor:
    """An uninitialised tensor with `d`'s metadata."""
    return torch.empty_strided(d.shape, d.stride, dtype=d.dtype, device=d.device)


def plain_state() -> bool:
    """No autocast, no torch function or dispatch mode: the state deferred values are computed in."""
    return not (torch._C._is_any_autocast_enabled() or torch._C._is_torch_function_mode_enabled()
                or torch._C._len_torch_dispatch_stack())


@contextlib.contextmanager
def plain_context():
    """Autocast and torch function / dispatch modes off (deferred arguments are plain tensors)."""
    with torch._C._DisableAutocast(), torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        yield


# function -> the keyword arguments it may get; positional arguments are checked in `_call_allowed`
_FUNCTIONS: dict = {torch.tanh: (), torch.sigmoid: (), torch.relu: (), F.relu: (), torch.stack: ("dim",),
                    torch.cat: ("dim",), F.layer_norm: ("normalized_shape", "weight", "bias", "eps"),
                    F.linear: ("weight", "bias")}
_METHODS = {"tanh", "sigmoid", "relu"}
_ACTIVATION_MODULES = (nn.Tanh, nn.Sigmoid, nn.ReLU)


def _call_allowed(fn, args: tuple, kwargs: dict) -> bool:
    if fn is F.relu:  # F.relu(x, True) is in place
        return len(args) == 1 and (not kwargs or (len(kwargs) == 1 and kwargs.get("inplace") is False))
    allowed = _FUNCTIONS.get(fn)
    return allowed is not None and all(k in allowed for k in kwargs)


def _arg_key(a: Any, tensors: list) -> Any:
    """A hashable summary of an argument's metadata (tensors found are appended to `tensors`);
    `_NO` when the argument is not supported."""
    t = type(a)
    if t is Deferred:
        tensors.append(a)
        return (a.shape, a.stride, a.dtype, a.device)
    if t is torch.Tensor or t is nn.Parameter:
        if a.layout is not torch.strided or not a.is_floating_point():
            return _NO
        tensors.append(a)
        return (a.shape, a.stride(), a.dtype, a.device)
    if a is None or t is bool or t is int or t is float:
        return (t, a)
    if isinstance(a, (tuple, list)):  # fx keeps list arguments as its immutable_list
        keys = tuple(_arg_key(x, tensors) for x in a)
        return _NO if any(k is _NO for k in keys) else (t, keys)
    return _NO


_NO = object()


def _global_module_hooks() -> bool:
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks
                or getattr(_nn_module, "_global_forward_hooks_always_called", None))


def _module_key(m: nn.Module) -> Any:
    """What of module `m` its result metadata depends on; `_NO` unless it is a plain module of the list."""
    t = type(m)
    if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
            or "forward" in m.__dict__ or _global_module_hooks()):
        return _NO
    # Parameters are read from `_parameters`: while tracing, fx patches nn.Module.__getattr__.
    params = m._parameters
    if t is nn.LayerNorm:
        return (t, tuple(m.normalized_shape), m.eps, m.elementwise_affine,
                _arg_key(params.get("weight"), []), _arg_key(params.get("bias"), []))
    if t is nn.Linear:
        return (t, m.in_features, m.out_features, _arg_key(params.get("weight"), []),
                _arg_key(params.get("bias"), []))
    if t in _ACTIVATION_MODULES:
        return _NO if getattr(m, "inplace", False) else (t,)
    return _NO


def op_key(op: str, target: Any, args: tuple, kwargs: dict, submodule: Callable[[str], nn.Module]) -> Optional[tuple]:
    """The cache key of a node's result metadata (op and arguments' metadata), or None when the
    node is not one whose value may be deferred.

    Example:
        >>> import torch
        >>> op_key("call_function", torch.tanh, (torch.zeros(2),), {}, None)[0] is torch.tanh
        True
        >>> op_key("call_function", torch.tanh, (torch.zeros(2, dtype=torch.int64),), {}, None) is None
        True
    """
    if op == "call_function":
        if not _call_allowed(target, args, kwargs):
            return None
        head = target
    elif op == "call_method":
        if target not in _METHODS or len(args) != 1 or kwargs:
            return None
        head = ("method", target)
    elif op == "call_module":
        head = _module_key(submodule(target))
        if head is _NO:
            return None
    else:
        return None
    if len(args) == 1 and type(args) is tuple and type(args[0]) is Deferred and not kwargs:
        a = args[0]  # the usual case (an op on a deferred per-slice value): `_arg_key`'s key, inline
        return (head, (tuple, ((a.shape, a.stride, a.dtype, a.device),)))
    tensors: list = []
    keys = _arg_key(args, tensors)
    if keys is _NO or not tensors:
        return None
    if kwargs:
        kw = tuple(sorted((k, _arg_key(v, tensors)) for k, v in kwargs.items()))
        if any(v is _NO for _, v in kw):
            return None
        return (head, keys, kw)
    return (head, keys)


def is_container_getitem(target: Any, args: tuple) -> bool:
    """``operator.getitem`` on a tuple, list or dict: Python indexing, which reads and changes no tensor."""
    return target is operator.getitem and len(args) == 2 and type(args[0]) in (tuple, list, dict)
