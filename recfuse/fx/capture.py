"""Capture a model or function as a torch.fx GraphModule whose nodes carry example values.

`torch.fx.symbolic_trace` alone cannot trace the code recfuse exists for: the seed
`split_stack` iterates over the tuple that `torch.split` returns, and symbolic proxies have no
length. The tracer here runs every node on the example inputs while it records it, so a proxy
knows its value: tuples and lists of tensors can be iterated, dicts (a torchrec
`KeyedTensor.to_dict()`) can be walked with `.items()`, and `len()` works. Control flow on a
*tensor* value stays an error (it would silently specialise the graph to the example data);
control flow on Python scalars (shapes) is specialised to the example.

Non-tensor example inputs (ints such as `batch_size`, modules passed as arguments) become
constants of the graph, as `concrete_args` do in `symbolic_trace`.

Every captured node gets ``node.meta["recfuse_val"]``: the summary of its example value that
`values.summarise` keeps (shapes and dtypes, never data).
"""
from __future__ import annotations

import bisect
import builtins
import contextlib
import copy
import copyreg
import dis
import itertools
import inspect
import linecache
import logging
import operator
import os
import re
import sys
import sysconfig
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.fx import Graph, GraphModule, Proxy, Tracer
from torch.fx.immutable_collections import immutable_dict
from torch.fx.node import Node, map_aggregate

from ..errors import RecfuseError
from . import deferred, runtime
from .graph_module import TransformedGraphModule
from .plan import Alone
from .values import VAL_KEY, annotate_from_meta, summarise

__all__ = ["capture", "RebuildTracer"]

logger = logging.getLogger("recfuse")
_fx_proxy_log = logging.getLogger("torch.fx.proxy")

# ---------------------------------------------------------------------------------------------
# the value-carrying tracer


class _DataDependentControlFlow(Exception):
    pass


def _resolve_attr(root: nn.Module, qualname: str) -> Any:
    """``root.<qualname>`` without going through ``nn.Module.__getattr__``, which fx patches while
    tracing (going through it from inside the tracer recurses forever)."""
    obj = root
    for part in qualname.split("."):
        d = obj.__dict__ if hasattr(obj, "__dict__") else {}
        for store in ("_parameters", "_buffers", "_modules"):
            if part in d.get(store, ()):
                obj = d[store][part]
                break
        else:
            obj = object.__getattribute__(obj, part) if isinstance(obj, nn.Module) else getattr(obj, part)
    return obj


_SET_GRAD_ENABLED = torch._C._set_grad_enabled  # the real one: capture patches the attribute while tracing
_IS_GRAD_ENABLED = torch.is_grad_enabled
_GET_DEFAULT_DTYPE = torch.get_default_dtype
_AUTOCAST_ENTER = torch.amp.autocast_mode.autocast.__enter__
_GRAD_MODE_FNS = (runtime.grad_enabled, runtime.set_grad_mode)
_ACTIVE_TRACERS: list = []  # the tracer tracing now (innermost last)
_GRAD_MODE_FILE = os.path.join(os.path.dirname(torch.__file__), "autograd", "grad_mode.py")


def _tracing_user_code() -> Optional["Tracer"]:
    """The active tracer when the model's code (not a value being computed) is running, else None."""
    if not _ACTIVE_TRACERS:
        return None
    tracer = _ACTIVE_TRACERS[-1]
    # The patches that call this are process-wide: another thread's grad-mode changes, prints,
    # setattrs and Function calls (its own transform, or a model it serves) are not the model's.
    # (A second transform in parallel recorded its `set_grad_enabled` into this tracer's graph:
    # "Argument ... does not belong to this Graph".)
    if getattr(tracer, "_thread", None) != threading.get_ident():
        return None
    return None if getattr(tracer, "_executing", False) else tracer


def _traced_is_grad_enabled() -> Any:
    # `torch.is_grad_enabled()` read by the model's code (or by torch.no_grad & co. saving the mode
    # to restore) becomes a node read on every call; any other caller gets the real flag.
    tracer = _tracing_user_code()
    if tracer is not None:
        f = sys._getframe(1)
        if _is_user_code(f) or f.f_code.co_filename == _GRAD_MODE_FILE:
            return tracer.create_proxy("call_function", runtime.grad_enabled, (), {})
    return _IS_GRAD_ENABLED()


def _traced_get_default_dtype() -> torch.dtype:
    # `torch.get_default_dtype()` read by the model's code: the graph keeps the dtype as a constant,
    # so the capture guards calls under another default dtype (`_guard_default_dtype`).
    tracer = _tracing_user_code()
    if tracer is not None and _is_user_code(sys._getframe(1)):
        tracer.__dict__["recfuse_default_dtype_read"] = _user_frame()
    return _GET_DEFAULT_DTYPE()


def _traced_set_grad_enabled(mode) -> None:
    # torch.no_grad() / enable_grad() / set_grad_enabled() in the model's code: the region's entry
    # and exit are nodes of the graph, so the transformed model records autograd where it did.
    tracer = _tracing_user_code()
    if tracer is None:
        return _SET_GRAD_ENABLED(mode)
    tracer.create_proxy("call_function", runtime.set_grad_mode, (mode,), {})
    if not isinstance(tracer, _ValueTracer):
        _SET_GRAD_ENABLED(bool(mode) if isinstance(mode, bool) else True)
    return None


def _traced_autocast_enter(self):
    if _tracing_user_code() is None:
        return _AUTOCAST_ENTER(self)
    raise RecfuseError(
        f"cannot capture `torch.autocast` inside the model's forward (at {_user_frame()}): recfuse.transform "
        f"does not keep autocast regions in its graph, and the fused ops would run in the input dtype. Call "
        f"the transformed model inside `with torch.autocast(...)` instead, or cast explicitly in forward "
        f"(e.g. `.to(torch.bfloat16)`).")


_INFERENCE_ENTER = torch.inference_mode.__enter__
_INFERENCE_EXIT = torch.inference_mode.__exit__


def _traced_inference_enter(self):
    # `torch.inference_mode()` in the model's code enters a C++ guard, not `_set_grad_enabled`: the
    # trace saw no region, so the transformed model recorded autograd where the original did not
    # (gradients reached the LayerNorm and Linear parameters of features the original computed under
    # inference_mode, and an optimizer trained them; red-team round 15). It is kept as a
    # `torch.no_grad()` region: the same values, and no autograd record inside it.
    if _tracing_user_code() is None:
        return _INFERENCE_ENTER(self)
    if not self.mode:
        raise RecfuseError(
            f"cannot capture `torch.inference_mode(False)` inside the model's forward (at {_user_frame()}): "
            f"recfuse.transform keeps grad-mode regions, not inference-mode ones. Use `torch.enable_grad()` "
            f"there, or leave the region out of forward.")
    region = self.__dict__["_recfuse_region"] = torch.no_grad()
    region.__enter__()
    return None


def _traced_inference_exit(self, exc_type, exc_value, traceback):
    region = self.__dict__.pop("_recfuse_region", None)
    if region is None:
        return _INFERENCE_EXIT(self, exc_type, exc_value, traceback)
    return region.__exit__(exc_type, exc_value, traceback)


_MODULE_SETATTR = nn.Module.__setattr__


def _traced_module_setattr(self, name, value):
    # `self.n = self.n + 1` (or `self.n += 1`) on a buffer, `self.cache = y`: a rebinding of a module
    # attribute to a traced value is not an op of the graph; fx would drop it and leave a Proxy in
    # the module. Refused (in-place updates of a buffer, `self.n.add_(1)`, are ops and are kept).
    if isinstance(value, Proxy) and _tracing_user_code() is not None:
        kind = "buffer" if name in self.__dict__.get("_buffers", {}) else "attribute"
        raise RecfuseError(
            f"cannot capture an assignment of a traced value to module {kind} `{name}` of "
            f"{type(self).__name__} inside forward (at {_user_frame()}): the transformed graph would drop it. "
            f"Update the buffer in place instead (`self.{name}.add_(1)`, or `with torch.no_grad(): "
            f"self.{name}.copy_(new_value)`), or return the value from forward.")
    if (not isinstance(value, (torch.Tensor, nn.Module)) and name in self.__dict__
            and _tracing_user_code() is not None and _is_user_code(sys._getframe(1))
            and not _same_plain_value(self.__dict__[name], value)):
        # `self.calls += 1` on a Python int: the trace runs it once and bakes the value it read
        # into the graph, so the transformed model would repeat the first call's value forever.
        raise RecfuseError(
            f"cannot capture forward changing the plain attribute `{name}` of {type(self).__name__} "
            f"(from {self.__dict__[name]!r} to {value!r}, at {_user_frame()}): the captured graph runs the "
            f"assignment once, at capture, so every call of the transformed model would see the value of "
            f"that one call. Keep the state in a buffer updated in place (`self.{name}.add_(1)`), or "
            f"compute it outside forward.")
    return _MODULE_SETATTR(self, name, value)


def _same_plain_value(old, new) -> bool:
    if old is new:
        return True
    try:
        return type(old) is type(new) and bool(old == new)
    except Exception:
        return False


def _refuse_lazy(module: Optional[nn.Module], fn_name: str) -> None:
    """Raise if `module` has uninitialized lazy parameters or buffers (nn.LazyLinear before its
    first call): capture would initialize the copy's with other random values than the original's
    first call will, so the two would compute with different weights."""
    if module is None:
        return
    for name, m in module.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            # copy.deepcopy of a scripted module gives parameters that are not leaves, or not the
            # tensors its compiled code reads: the copy's would get no gradients and ignore updates.
            raise RecfuseError(
                f"cannot transform {fn_name}: `{name or type(module).__name__}` is a torch.jit.ScriptModule; "
                f"recfuse.transform works on a deep copy of the model, and a copy of a scripted module does not "
                f"keep its parameters connected to its compiled code (training would not reach them). Transform "
                f"the eager module, before torch.jit.script.")
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if isinstance(t, nn.parameter.UninitializedTensorMixin):
            raise RecfuseError(
                f"cannot transform {fn_name}: `{name}` is an uninitialized lazy parameter (nn.LazyLinear & co.); "
                f"the transformed copy would initialize it with other random values than the original's first "
                f"call. Run the model once (e.g. on example_inputs) before recfuse.transform.")


_FUNCTION_APPLY = torch.autograd.function.Function.__dict__["apply"]


def _traced_function_apply(cls, *args, **kwargs):
    # A custom torch.autograd.Function (gradient reversal, a straight-through estimator, reentrant
    # torch.utils.checkpoint) called on traced values: fx would trace its `forward` as plain ops and
    # drop its `backward`, so the captured graph would compute other gradients. Refused for
    # torch.fx; the caller falls back to Dynamo, which keeps the backward or fails loudly.
    if _tracing_user_code() is not None and any(
            isinstance(a, Proxy) for a in itertools.chain(args, kwargs.values())):
        if cls.__module__ == "torch.utils.checkpoint" and cls.__name__ == "_NoopSaveInputs":
            # torch < 2.13's non-reentrant checkpoint saves its inputs through this no-op Function
            # and skips its saved-tensor hooks when the result has no grad_fn: the body is then
            # traced as plain ops, as in newer torch (the H100 image's torch 2.11 refused it).
            return torch.empty((0,))
        if cls.__module__ == "torch.utils.checkpoint":
            # Dynamo would capture it as a non-reentrant checkpoint, which also gives parameters
            # gradients when no input requires grad (the reentrant one gives them none).
            raise RecfuseError(
                f"cannot capture torch.utils.checkpoint.checkpoint(..., use_reentrant=True) (at {_user_frame()}): "
                f"its gradients depend on whether the inputs require grad in a way a captured graph does not "
                f"keep. Use use_reentrant=False (PyTorch's recommendation), which recfuse captures exactly.")
        raise torch.fx.proxy.TraceError(
            f"the model calls the custom autograd.Function {cls.__qualname__}.apply (at {_user_frame()}): "
            f"torch.fx would trace its forward and drop its backward")
    return _FUNCTION_APPLY.__func__(cls, *args, **kwargs)


_PRINT = builtins.print
_LOGGER_ENABLED_FOR = logging.Logger.isEnabledFor
_LOGGING_DIR = os.path.dirname(logging.__file__)


def _user_site(f) -> str:
    return f"{f.f_code.co_filename}:{f.f_lineno}: {linecache.getline(f.f_code.co_filename, f.f_lineno).strip()}"


def _note_dropped_output(tracer, what: str, where: str) -> None:
    tracer.__dict__.setdefault("_dropped_output", {}).setdefault(where, what)


def _traced_print(*args, **kwargs):
    # print() in the model's code: fx records no node for it, so the transformed model is silent
    # where the original prints on every call. Output changes no value: noted and warned about
    # after capture (`_warn_dropped_output`), not refused; not printed here (the arguments are
    # traced values).
    tracer = _tracing_user_code()
    if tracer is not None and _is_user_code(sys._getframe(1)):
        _note_dropped_output(tracer, "print()", _user_site(sys._getframe(1)))
        return None
    return _PRINT(*args, **kwargs)


def _traced_logger_enabled_for(self, level):
    # Every logging call (logger.info(...), logging.warning(...)) asks isEnabledFor first. One the
    # model's code makes and the logger would emit runs at capture only: noted, warned about after
    # capture, and not emitted here. A disabled one (a debug line at INFO) loses nothing.
    enabled = _LOGGER_ENABLED_FOR(self, level)
    tracer = _tracing_user_code()
    if enabled and tracer is not None:
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(_LOGGING_DIR):
            f = f.f_back
        if _is_user_code(f) and not f.f_code.co_filename.startswith(_STDLIB_DIR):
            _note_dropped_output(tracer, f"logging (logger `{self.name}`)", _user_site(f))
            return False
    return enabled


def _warn_dropped_output(tracer, fn_name: str) -> None:
    """One warning naming the print / logging calls of the model's forward that the transformed
    model will not repeat (they hold no tensor op; the graph runs without them)."""
    sites = getattr(tracer, "_dropped_output", None)
    if sites:
        listed = "; ".join(f"{what} at {where}" for where, what in sites.items())
        warnings.warn(
            f"recfuse.transform({fn_name}): the transformed model does not repeat the output of its forward "
            f"({listed}): the captured graph holds tensor ops only. Its values are unchanged; to keep the "
            f"output, move it into a forward hook on the transformed model (hooks run on every call).",
            stacklevel=3)


@contextlib.contextmanager
def _patched_global_state(tracer: "Tracer"):
    """While `tracer` traces: grad-mode reads and changes of the model's code are recorded as nodes,
    autocast is refused. The real grad mode is restored afterwards."""
    grad = torch._C.is_grad_enabled()
    _ACTIVE_TRACERS.append(tracer)
    torch.is_grad_enabled = _traced_is_grad_enabled
    torch.get_default_dtype = _traced_get_default_dtype
    torch._C._set_grad_enabled = _traced_set_grad_enabled
    torch.amp.autocast_mode.autocast.__enter__ = _traced_autocast_enter
    torch.inference_mode.__enter__ = _traced_inference_enter
    torch.inference_mode.__exit__ = _traced_inference_exit
    nn.Module.__setattr__ = _traced_module_setattr
    torch.autograd.function.Function.apply = classmethod(_traced_function_apply)
    builtins.print = _traced_print
    logging.Logger.isEnabledFor = _traced_logger_enabled_for
    try:
        yield
    finally:
        builtins.print = _PRINT
        logging.Logger.isEnabledFor = _LOGGER_ENABLED_FOR
        torch.is_grad_enabled = _IS_GRAD_ENABLED
        torch.get_default_dtype = _GET_DEFAULT_DTYPE
        torch._C._set_grad_enabled = _SET_GRAD_ENABLED
        torch.amp.autocast_mode.autocast.__enter__ = _AUTOCAST_ENTER
        torch.inference_mode.__enter__ = _INFERENCE_ENTER
        torch.inference_mode.__exit__ = _INFERENCE_EXIT
        nn.Module.__setattr__ = _MODULE_SETATTR
        torch.autograd.function.Function.apply = _FUNCTION_APPLY
        _ACTIVE_TRACERS.pop()
        _SET_GRAD_ENABLED(grad)


_MODE = "recfuse_mode"  # on nodes whose value depends on a module's `training` flag: (target, flag)


_LIVE = "_recfuse_live"  # real example value, dropped once capture ends


def _flat_args(args: tuple, kwargs: dict) -> bool:
    """Whether every argument is a Node or an atom (None, bool, int, float, str): no nesting, no
    symbolic ints. Almost every node a per-feature model records is of this kind."""
    for a in args:
        if type(a) is not Node and type(a) not in _ATOMIC:
            return False
    for a in kwargs.values():
        if type(a) is not Node and type(a) not in _ATOMIC:
            return False
    return True


_GRAPH_INTERNALS = ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len", "_target_to_str")


def _can_append_directly(graph: Graph) -> bool:
    return graph.owning_module is None and all(hasattr(graph, a) for a in _GRAPH_INTERNALS)


def _name_candidate(graph: Graph, target: Any, candidates: dict) -> str:
    """``graph._target_to_str(target)``, the name fx gives a node, cached per target."""
    if type(target) is str and target.islower() and not target.startswith("__"):
        return target  # fx's snake-casing changes nothing here: no capitals, not a dunder
    try:
        name = candidates.get(target)
    except TypeError:  # an unhashable target
        return graph._target_to_str(target)
    if name is None:
        name = candidates[target] = graph._target_to_str(target)
    return name


def _append_node(graph: Graph, kind: str, target: Any, args: tuple, kwargs: dict, name: Optional[str],
                 type_expr: Any, candidates: dict) -> Node:
    """``graph.create_node`` for flat arguments (`_flat_args`) of a graph without an owning module,
    doing what it does but in a third of the time: create_node walks every node's arguments
    through pytree looking for symbolic ints (there are none in flat arguments) and derives the
    name from the target with regular expressions (cached per target in `candidates` here)."""
    if name is None:
        name = _name_candidate(graph, target, candidates)
    name = graph._graph_namespace.create_name(name, None)
    n = Node(graph, name, kind, target, args, kwargs if kwargs else immutable_dict(), type_expr)
    graph._graph_namespace.associate_name_with_obj(name, n)
    graph._insert(n)
    graph._find_nodes_lookup_table.insert(n)
    graph._len += 1
    return n


_TENSOR_METHOD: dict = {}  # torch function -> whether fx records it as a method call


def _is_tensor_method(fn) -> bool:
    try:
        found = _TENSOR_METHOD.get(fn)
    except TypeError:
        return torch.overrides.is_tensor_method_or_property(fn)
    if found is None:
        found = _TENSOR_METHOD[fn] = torch.overrides.is_tensor_method_or_property(fn)
    return found


_LEAVES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _flat_tracer(cls: type, args: tuple, kwargs: dict):
    """The one tracer of the `cls` proxies among flat arguments (proxies and leaves), or None
    when there is nesting, another kind of proxy, no proxy or more than one tracer."""
    tracer = None
    for a in itertools.chain(args, kwargs.values()):
        t = type(a)
        if t is cls:
            if tracer is None:
                tracer = a.tracer
            elif a.tracer is not tracer:
                return None
        elif t not in _LEAVES:
            return None
    return tracer


class _ValueProxy(Proxy):
    @classmethod
    def __torch_function__(cls, orig_method, types, args=None, kwargs=None):
        # Proxy.__torch_function__ for the common case of flat arguments, without its pytree walk
        # over the arguments and torch.overrides' per-call warning filters (half of a torch call's
        # tracing cost); anything else goes to fx.
        args = args if args else ()
        kwargs = kwargs if kwargs else {}
        tracer = _flat_tracer(cls, args, kwargs)
        if tracer is None or not isinstance(tracer, _ValueTracer) or isinstance(
                orig_method, (torch._C.ScriptMethod, torch._ops.HigherOrderOperator)):
            return super().__torch_function__(orig_method, types, args, kwargs)
        if _is_tensor_method(orig_method):
            return tracer.create_proxy("call_method", orig_method.__name__, args, kwargs)
        name = _name_candidate(tracer.graph, orig_method.__name__, tracer._name_candidates)
        return tracer.create_proxy("call_function", orig_method, args, kwargs, name=name)

    def __iter__(self):
        # What fx's Proxy.__iter__ does (`a, b = x` unpacks as many as the bytecode names, anything
        # else asks the tracer), without keeping its own frame in a local: that reference cycle kept
        # the model's frame, every proxy and the model's copy alive until the collector found it
        # (0.1-0.2 s of a 10,000-feature transform went to that collection).
        count = _unpack_count(sys._getframe(1))
        if count is not None:
            if isinstance(self.node.meta.get(_LIVE), (tuple, list)) and hasattr(self.tracer, "_guard_count"):
                self.tracer._guard_count(self.node, count)  # `a, b = x.split(D, 1)` of a wider x raises in the original
            return (self[i] for i in range(count))
        return self.tracer.iter(self)

    def __len__(self):
        v = self.node.meta.get(_LIVE)
        if type(v) is deferred.Deferred:
            self.tracer._compute_pending()
            v = self.node.meta.get(_LIVE)
        if isinstance(v, torch.Tensor):
            # `len(x)` turns a size into a Python int: the graph is specialised to it, so guard it.
            self.tracer._specialise(self.node, "len", len(v))
            return len(v)
        if isinstance(v, (tuple, list)):
            self.tracer._guard_count(self.node, len(v))  # as in `iter`: `range(len(x.unbind(1)))`
            return len(v)
        if isinstance(v, Mapping):
            return len(v)
        return super().__len__()

    # `isinstance(x, torch.Tensor)` and `torch.is_tensor(x)` in the model's code see what the traced
    # value is, so the branch captured is the one the real tensor takes (a bare Proxy is no Tensor).
    @property
    def __class__(self):
        v = self.node.meta.get(_LIVE)
        if isinstance(v, torch.Tensor) or type(v) is deferred.Deferred:
            f = sys._getframe(1)
            if f.f_code is _IS_TENSOR_CODE or (_is_user_code(f) and not _calls_a_torch_function(f)):
                return type(v) if isinstance(v, torch.Tensor) else torch.Tensor
        return _ValueProxy

    def __setattr__(self, name, value):
        if name not in ("node", "tracer") and _is_user_code(sys._getframe(1)):
            raise RecfuseError(
                f"cannot capture setting `.{name}` of a traced value inside forward (at {_user_frame()}): "
                f"the transformed graph would drop it.")
        object.__setattr__(self, name, value)

    def _python_value(self, how: str):
        v = self.node.meta.get(_LIVE)
        if isinstance(v, (bool, int, float)):
            v = runtime._HOW[how](v)
            self.tracer._specialise(self.node, how, v)
            return v
        if isinstance(v, torch.Tensor) or type(v) is deferred.Deferred:
            raise _DataDependentControlFlow(f"{how}() of a tensor at {_user_frame()}")
        raise TypeError(f"{how}() of a traced {type(v).__name__}")

    def __index__(self):
        return self._python_value("index")

    def __int__(self):
        return self._python_value("int")

    def __float__(self):
        return self._python_value("float")


def _unpack_count(frame) -> Optional[int]:
    """How many values the instruction `frame` is executing unpacks (`a, b = x`), else None."""
    instructions = list(dis.get_instructions(frame.f_code))
    if sys.version_info >= (3, 11):
        i = bisect.bisect_left(instructions, frame.f_lasti, key=lambda x: x.offset)
    else:
        i = frame.f_lasti // 2
    inst = instructions[i]
    return inst.argval if inst.opname == "UNPACK_SEQUENCE" else None


_IS_TENSOR_CODE = torch.is_tensor.__code__ if hasattr(torch.is_tensor, "__code__") else None
_CALL_SITES: dict = {}  # (code, offset) -> whether the call there is not a type check
_TYPE_CHECKS = frozenset({"isinstance", "issubclass", "is_tensor"})


def _calls_a_torch_function(frame) -> bool:
    """Whether the user code at `frame` is calling something other than a type check, so that the
    `__class__` read comes from C: torch's argument parser calls isinstance(arg, Tensor) on every
    argument, before `__torch_function__`, and unpacks an argument that passes as a tensor (for a
    Scalar parameter of an overload, `torch.where(c, x, 0.0)`): a proxy there crashed the process.
    The callee is the last name loaded at the call expression's first column (`torch.where` ->
    `where`, `isinstance(x, T)` -> `isinstance`). Unknown (no positions: Python 3.10): False, the
    type check's answer."""
    key = (frame.f_code, frame.f_lasti)
    found = _CALL_SITES.get(key)
    if found is None:
        found = _CALL_SITES[key] = _callee_is_not_a_type_check(frame.f_code, frame.f_lasti)
    return found


def _callee_is_not_a_type_check(code, offset: int) -> bool:
    try:
        instructions = list(dis.get_instructions(code))
        current = next((i for i in instructions if i.offset == offset), None)
        pos = getattr(current, "positions", None)
        if current is None or not current.opname.startswith("CALL") or pos is None or pos.col_offset is None:
            return False
        name = None
        for i in instructions:
            if i.offset >= offset:
                break
            p = i.positions
            if (p is not None and (p.lineno, p.col_offset) == (pos.lineno, pos.col_offset)
                    and i.opname.startswith("LOAD_") and isinstance(i.argval, str)):
                name = i.argval
        return name is not None and name not in _TYPE_CHECKS
    except Exception:  # pragma: no cover - bytecode this reading does not know
        return False


_NEW_VALUE_PROXY = object.__new__
_OBJECT_SETATTR = object.__setattr__


class _TracedTypeMeta(type):
    """Metaclass of `_TracedType`: calls and isinstance/issubclass checks behave as `type`'s."""

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], Proxy):
            return _type_of_traced(args[0])
        return builtins.type(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, builtins.type)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, builtins.type)


class _TracedType(metaclass=_TracedTypeMeta):
    """Stands for the builtin `type` in the model's modules while they are traced: `type(x)` of a
    traced value is the type of its example value (a bare `type(x)` would be the proxy class, and
    `type(x) is torch.Tensor` would silently take the other branch)."""


def _type_of_traced(p: Proxy) -> type:
    if _LIVE in p.node.meta:
        v = p.node.meta[_LIVE]
        return torch.Tensor if builtins.type(v) is deferred.Deferred else builtins.type(v)
    if _tracing_user_code() is not None:
        raise RecfuseError(
            f"cannot capture `type(...)` of a traced value without example_inputs (at {_user_frame()}): the "
            f"symbolic trace has no value to take the type of. Pass example_inputs.")
    return builtins.type(p)


def _skip_globals_of(filename: str) -> bool:
    if not filename or filename.startswith(_INTERNAL_DIRS + ("<frozen",)):
        return True
    return filename.startswith(_STDLIB_DIR) and "-packages" + os.sep not in filename  # site-/dist-packages are not stdlib


def _namespaces_naming_type(root: nn.Module, fn: Any, name: str = "type") -> list:
    """Global namespaces of code the trace may run that reads the global name `type`: the methods of the
    model's module classes, the function, and the functions and classes that code names, followed
    through user code (not torch, recfuse.fx or the standard library). A namespace that binds
    `type` itself is left alone."""
    stack: list = [fn] if fn is not None else []
    for cls in {builtins.type(m) for m in root.modules()}:  # 10,000 LayerNorms: one class to follow
        stack.extend(cls.__mro__)
    seen: set = set()
    found: dict = {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            stack.append(obj.__func__)
        elif isinstance(obj, property):
            stack.extend(f for f in (obj.fget, obj.fset) if f is not None)
        elif isinstance(obj, builtins.type):
            mod = sys.modules.get(getattr(obj, "__module__", None) or "")
            if mod is not None and not _skip_globals_of(getattr(mod, "__file__", None) or ""):
                stack.extend(vars(obj).values())
        elif isinstance(obj, types.FunctionType):
            code = obj.__code__
            if _skip_globals_of(code.co_filename):
                continue
            names, codes = set(), [code]
            while codes:
                c = codes.pop()
                names.update(c.co_names)
                codes.extend(k for k in c.co_consts if inspect.iscode(k))
            g = obj.__globals__
            if name in names and name not in g:
                found[id(g)] = g
            stack.extend(g[n] for n in names if n in g)
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:
                    pass
    return list(found.values())


def _traced_sorted(iterable, /, *, key=None, reverse=False):
    """Stands for the builtin `sorted` in the model's modules while they are traced. Round 13:
    `for k in sorted(feats)` over a dict argument was recorded as an iteration in the caller's key
    order, so a call with the same keys in another order was refused although the original does
    not depend on it; here the keys are sorted from the example and the guard checks the key set."""
    if isinstance(iterable, Proxy) and key is None and isinstance(iterable.tracer, _ValueTracer):
        d = iterable.node.meta.get(_LIVE)
        if isinstance(d, Mapping) and all(builtins.type(k) is str for k in d):
            iterable.tracer.key_set_guards.append((iterable.node, tuple(builtins.sorted(d))))
            return builtins.sorted(d, reverse=reverse)
    return builtins.sorted(iterable, key=key, reverse=reverse)


@contextlib.contextmanager
def _traced_type_builtin(root: nn.Module, fn: Any):
    """`type` in the model's code is `_TracedType` while it is traced (and `sorted` is
    `_traced_sorted`), restored afterwards."""
    patched = [(name, stand_in, _namespaces_naming_type(root, fn, name))
               for name, stand_in in (("type", _TracedType), ("sorted", _traced_sorted))]
    for name, stand_in, namespaces in patched:
        for g in namespaces:
            g[name] = stand_in
    try:
        yield
    finally:
        for name, stand_in, namespaces in patched:
            for g in namespaces:
                if g.get(name) is stand_in:
                    del g[name]


# Each with a trailing separator: a bare ".../site-packages/torch" prefix also matched
# ".../site-packages/torchrec/...", so torchrec's code (EBC, DLRM) counted as torch's own.
_INTERNAL_DIRS = (os.path.join(os.path.dirname(__file__), ""), os.path.join(os.path.dirname(torch.__file__), ""))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]


def _user_frame() -> str:
    """file:line of the innermost frame outside torch and recfuse.fx: where the user's code is."""
    f = sys._getframe(1)
    while f is not None:
        filename = f.f_code.co_filename
        if not filename.startswith(_INTERNAL_DIRS):
            line = linecache.getline(filename, f.f_lineno).strip()
            return f"{filename}:{f.f_lineno}: {line}"
        f = f.f_back
    return "<unknown>"


def _is_user_code(frame) -> bool:
    return frame is not None and not frame.f_code.co_filename.startswith(_INTERNAL_DIRS)


def _arg_name(target: str, names) -> str:
    # symbolic_trace names the placeholder of a concrete arg `name_<count>`.
    name = target.lstrip("*")
    if name not in names:
        base, _, count = name.rpartition("_")
        if count.isdigit() and base in names:
            return base
    return name


class _SymbolicProxy(Proxy):
    """A proxy of a trace without example values. Its type is unknown, so `isinstance(x, ...)`,
    `torch.is_tensor(x)` and `x.__class__` in the model's code raise instead of answering False
    (a bare fx Proxy is no Tensor, and the trace would silently take the non-tensor branch)."""

    @property
    def __class__(self):
        f = sys._getframe(1)
        if (f.f_code is _IS_TENSOR_CODE or _is_user_code(f)) and _tracing_user_code() is not None:
            raise RecfuseError(
                f"cannot capture a type check (isinstance, torch.is_tensor, __class__) of a traced value without "
                f"example_inputs (at {_user_frame()}): the symbolic trace has no value to check. Pass example_inputs.")
        return _SymbolicProxy


_TRACE_LOCK = threading.RLock()


class _ModeTracer(Tracer):
    """A Tracer that keeps `self.training` reads as graph nodes and explains foreign modules."""

    # Rebuilding a saved module: every module's flag is read at run time (all modules are leaves
    # there, so nothing runs their code; a bool read from a leaf would be baked otherwise).
    proxy_every_flag = False

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # recfuse's own FusedFeatureProcessor is already fused, and reads a KeyedTensor argument
        # (which a traced value only stands for): one call_module node, run as it is.
        from ..module import FusedFeatureProcessor

        return isinstance(m, FusedFeatureProcessor) or super().is_leaf_module(m, module_qualified_name)

    def __init__(self):
        super().__init__()
        # Buffers read through `self.name` become get_attr nodes, not constants baked from their
        # value at capture time (`self.scale.repeat(F)` would otherwise freeze `scale`).
        self.proxy_buffer_attributes = True
        self.mode_guards: dict[str, tuple[bool, str]] = {}  # training target -> (flag, where)
        self.key_order_guards: list[tuple[Node, tuple]] = []  # dict node -> keys iterated
        self.key_set_guards: list[tuple[Node, tuple]] = []  # dict node -> its sorted keys (`sorted(d)`)
        self._training_saved: list[tuple[nn.Module, bool]] = []

    # `self.training` read in traced code becomes a node reading the flag at run time, so that
    # .train()/.eval() after transform still switch dropout and friends (fx would bake a bool).
    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        out = super().create_args_for_root(root_fn, is_module, concrete_args)
        if is_module:
            inside: set[str] = set()  # leaf modules and what they contain
            for path, m in self.root.named_modules():
                if path and path.rpartition(".")[0] in inside:
                    inside.add(path)  # (named_modules gives each module's parent before it)
                    continue  # inside a leaf module
                if path and not self.proxy_every_flag and self.is_leaf_module(m, path):
                    inside.add(path)
                    continue  # leaf modules read their own flag when they run
                target = f"{path}.training" if path else "training"
                proxy = self.create_proxy("get_attr", target, (), {})
                proxy.node.meta[_MODE] = (target, bool(m.training))
                self._training_saved.append((m, m.training))
                m.__dict__["training"] = proxy
        return out

    def proxy(self, node: Node) -> Proxy:
        return _SymbolicProxy(node, self)

    # The thread tracing (`trace`); module calls and attribute reads of other threads are not ours.
    _thread = None

    def trace(self, root, concrete_args=None):
        # One recfuse trace at a time in a process: fx patches nn.Module.__call__ / __getattr__
        # process-wide and restores what it found on exit, so two traces in parallel threads
        # recorded each other's module calls (a RecfuseError "neither a submodule of the model")
        # and could leave a finished tracer's patch installed. Re-entrant: a trace may trace.
        with _TRACE_LOCK:
            self._thread = threading.get_ident()
            return self._trace_locked(root, concrete_args)

    def _trace_locked(self, root, concrete_args):
        if self.proxy_every_flag:  # rebuilding saved code: its helpers are recorded, never run
            ctx = _rebuilding(self)
        else:
            ctx = _patched_global_state(self)
        try:
            with ctx:
                graph = super().trace(root, concrete_args)
        finally:
            for m, flag in self._training_saved:
                m.__dict__["training"] = flag
            self._training_saved.clear()
        for n in list(graph.nodes):
            if n.op == "get_attr" and _MODE in n.meta and not n.users:
                graph.erase_node(n)
        return graph

    def path_of_module(self, mod: nn.Module) -> str:
        try:
            return super().path_of_module(mod)
        except NameError:
            raise RecfuseError(
                f"the model calls an nn.{type(mod).__name__} that is neither a submodule of the model nor a "
                f"global or closure variable of the function (constructed inside forward?): its parameters "
                f"would be new on every call, so there is nothing to fuse or train. Create it once outside "
                f"and pass it in (at {_user_frame()})") from None


@contextlib.contextmanager
def _rebuilding(tracer):
    runtime._REBUILDING.append(tracer)
    try:
        yield
    finally:
        runtime._REBUILDING.pop()


class RebuildTracer(_ModeTracer):
    """The tracer `torch.load` re-traces a saved transformed module's code with."""

    proxy_every_flag = True
    # recfuse's public ops record themselves, not the torch.ops node they trace to elsewhere
    record_public_ops = True

    def proxy(self, node: Node) -> Proxy:
        return Proxy(node, self)  # generated code: nothing to check


TransformedGraphModule.rebuild_tracer = RebuildTracer


_LEAF_CLASSES: dict = {}  # module class -> fx's Tracer.is_leaf_module verdict
_CLASS_LEAF_RULES = (Tracer.is_leaf_module, _ModeTracer.is_leaf_module)


class _ValueTracer(_ModeTracer):
    def __init__(self, placeholder_values: Optional[dict[str, Any]] = None):
        super().__init__()
        self._ph_values = placeholder_values or {}
        self._name_candidates: dict = {}  # target -> the name fx derives from it
        self._checked_graph, self._direct_ok = None, False  # whether `_append_node` may build its nodes
        self._result_meta: dict = {}  # deferred.op_key -> result metadata
        self._pending: list = []  # nodes whose value is a Deferred, in graph order
        self._module_at: Optional[dict] = None  # qualified name -> submodule, built on first use
        self.value_guards: list = []  # (node, how, value, what, where): see `_specialise`
        self._specialised: set = set()
        self._shared: set = set()  # ids of the original's tensors the traced model holds (`copy_sharing_leaves`)
        self._privates: dict = {}  # id of one of them -> the copy the graph's reads of it get

    # Leave values of per-slice ops uncomputed when only their metadata is needed (see `deferred`).
    defer_values = True

    # While tracing, torch.fx routes nn.Module calls and attribute reads through these two hooks to
    # record them; running a module on real example values must bypass them.
    _executing = False

    def call_module(self, m, forward, args, kwargs):
        # Another thread's module call (fx's patch of nn.Module.__call__ is process-wide): run it.
        if self._executing or threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        path = self.path_of_module(m)
        if not self._is_leaf(m, path):
            return super().call_module(m, forward, args, kwargs)
        return self._call_leaf_module(m, path, args, kwargs)

    def _is_leaf(self, m: nn.Module, path: str) -> bool:
        """``self.is_leaf_module(m, path)``; fx's own rule reads only the module's class (its
        ``__module__``) and is answered once per class."""
        # fx's rule and `_ModeTracer`'s (recfuse's FusedFeatureProcessor) read only the class.
        if type(self).is_leaf_module not in _CLASS_LEAF_RULES or "__module__" in m.__dict__:
            return self.is_leaf_module(m, path)
        cls = type(m)
        leaf = _LEAF_CLASSES.get(cls)
        if leaf is None:
            leaf = _LEAF_CLASSES[cls] = self.is_leaf_module(m, path)
        return leaf

    def _call_leaf_module(self, m: nn.Module, path: str, args, kwargs) -> Any:
        """What fx's Tracer.call_module does for a leaf module (the scope and module stack its node
        is recorded under, then a call_module node), without a ScopeContextManager and the copy of
        the scope it makes per call (the 10,000 LayerNorms of a per-feature model)."""
        scope = self.scope
        outer = (scope.module_path, scope.module_type)
        scope.module_path, scope.module_type = path, type(m)
        try:
            num_calls = self.num_calls.get(path, 0)
            key = f"{path}@{num_calls}" if num_calls > 0 else path
            self.module_stack[key] = (path, type(m))
            self.num_calls[path] = num_calls + 1
            proxy = self.create_proxy("call_module", path, args, kwargs)
            popped, _ = self.module_stack.popitem(last=True)
            if popped != key:
                raise AssertionError(f"Unexpected key {popped}, expected {key}")
            return proxy
        finally:
            scope.module_path, scope.module_type = outer

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._executing or threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: Node) -> Proxy:
        # Proxy.__init__ sets `tracer` and `node`, each through _ValueProxy.__setattr__'s check
        p = _NEW_VALUE_PROXY(_ValueProxy)
        _OBJECT_SETATTR(p, "tracer", self)
        _OBJECT_SETATTR(p, "node", node)
        return p

    def _can_append_directly(self) -> bool:
        graph = self.graph
        if self._checked_graph is not graph:
            self._checked_graph, self._direct_ok = graph, _can_append_directly(graph)
        return self._direct_ok and graph.owning_module is None

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> Node:
        # What TracerBase.create_node does when no fx debugging option is on (mutation checks, stack
        # traces, preserved node meta, debug logs), with `_append_node` for flat arguments.
        if (self.check_mutable_operations or self.record_stack_traces or fx_traceback.has_preserved_node_meta()
                or _fx_proxy_log.isEnabledFor(logging.DEBUG) or not _flat_args(args, kwargs)
                or not self._can_append_directly()):
            return super().create_node(kind, target, args, kwargs, name, type_expr)
        node = _append_node(self.graph, kind, target, args, kwargs, name, type_expr, self._name_candidates)
        # (fx's node_name_to_scope is not filled: nothing reads it, and capture drops it after the trace)
        if self.module_stack:
            node.meta["nn_module_stack"] = self.module_stack.copy()  # copy.copy's result, without its reduce protocol
        return node

    def create_arg(self, a: Any) -> Any:
        # The arguments of almost every node are proxies, Python scalars and flat tuples of them;
        # those are lowered here as fx lowers them, without fx's generic checks (about 40 us a
        # node). Anything else (parameters, tensors, modules, namedtuples, ...) goes to fx.
        t = type(a)
        if t is _ValueProxy and a.tracer is self:
            return a.node
        if t in _ATOMIC_TYPES:
            return a
        if t is tuple or t is list:  # the two cases above inlined for the elements: one call per node, not per argument
            return t([x.node if type(x) is _ValueProxy and x.tracer is self else
                      x if type(x) in _ATOMIC_TYPES else self.create_arg(x) for x in a])
        if t is dict and all(type(k) is str for k in a):
            return {k: self.create_arg(v) for k, v in a.items()}
        return super().create_arg(a)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if kind == "call_method" and target in _AUTOGRAD_FLAG_METHODS and not self._executing:
            raise RecfuseError(
                f"cannot capture `.{target}()` on a traced tensor inside forward (at {_user_frame()}): it changes "
                f"autograd bookkeeping of one intermediate tensor, which the fused graph may not compute as a "
                f"tensor of its own. Call it outside forward (on the transformed model's inputs or outputs), or "
                f"use a tensor hook on a returned value.")
        if kind == "call_method" and target in ("keys", "values", "items") and args and isinstance(args[0], Proxy):
            d = args[0].node.meta.get(_LIVE)
            if isinstance(d, Mapping):
                # A dict of tensors is walked in Python: keys are constants, values get one getitem
                # node each, which is what the matcher sees as a dict slice source.
                keys = list(d.keys())
                self.key_order_guards.append((args[0].node, tuple(keys)))
                if target == "keys":
                    return keys
                if target == "values":
                    return [args[0][k] for k in keys]
                return [(k, args[0][k]) for k in keys]
        if proxy_factory_fn is None and type(args) is tuple and (not kwargs or type(kwargs) is dict):
            # fx's Tracer.create_proxy: lower the arguments, create the node, wrap it
            node = self.create_node(kind, target, self.create_arg(args), self.create_arg(kwargs) if kwargs else {},
                                    name, type_expr)
            p = self.proxy(node)
        else:
            p = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
            node = p.node
        for a in (node._input_nodes if type(getattr(node, "_input_nodes", None)) is dict else node.all_input_nodes):
            if _MODE in a.meta:
                node.meta[_MODE] = a.meta[_MODE]
                break
        if kind != "output":
            node.meta[_LIVE] = self._execute(node)
            v = node.meta[_LIVE]
            if kind in ("call_function", "call_method") and isinstance(v, tuple):
                self._guard_split_sizes(node)
            # Strings and lists of strings (feature keys) are folded to constants so that user
            # code can loop over them; ints stay symbolic so batch sizes are not baked in.
            if isinstance(v, str) or (
                isinstance(v, (list, tuple)) and v and all(isinstance(k, str) for k in v)
            ):
                # ... and guarded: `kt.keys()` of a KeyedTensor in another order (a sharded EBC's)
                # would otherwise run the graph with the example's names, zipped to other slices.
                if node.op in ("call_method", "call_function"):
                    self.value_guards.append((node, "strings", tuple(v) if isinstance(v, list) else v,
                                              _expr(node), _user_frame()))
                return v
        return p

    def _live(self, x: Node) -> Any:
        if _LIVE not in x.meta:
            # fx creates get_attr nodes for buffers and tensor constants without create_proxy
            x.meta[_LIVE] = self._execute(x)
        return x.meta[_LIVE]

    def _live_arg(self, a: Any) -> Any:
        # map_aggregate(a, live value of each Node), with a fast path for the common flat cases
        t = type(a)
        if t is Node:
            m = a.meta
            return m[_LIVE] if _LIVE in m else self._live(a)
        if t in _ATOMIC:
            return a
        if t is tuple or t is list:
            return t([self._live_arg(x) for x in a])
        return map_aggregate(a, lambda x: self._live(x) if isinstance(x, Node) else x)

    def _execute(self, node: Node) -> Any:
        op = node.op
        if op == "placeholder":
            return self._ph_values.get(_arg_name(node.target, self._ph_values))
        if op == "get_attr":
            if _MODE in node.meta:
                return node.meta[_MODE][1]
            v = _resolve_attr(self.root, node.target)
            if self._shared and id(v) in self._shared:
                v = self._private(v)
            return v
        if (op == "call_function" and node.target is builtins.getattr and len(node.args) == 2
                and node.args[1] == "requires_grad" and isinstance(node.args[0], Node)):
            return self._would_require_grad(node.args[0])
        args = self._live_arg(node.args)
        kwargs = {k: self._live_arg(v) for k, v in node.kwargs.items()} if node.kwargs else {}
        if (op == "call_function" and node.target is operator.getitem and not kwargs and len(args) == 2
                and type(args[1]) is int and type(args[0]) in (tuple, list) and -len(args[0]) <= args[1] < len(args[0])):
            return args[0][args[1]]  # a piece of a split: Python indexing, what `_run` would do, directly
        if op == "call_function" and node.target in _GRAD_MODE_FNS:
            if node.target is runtime.grad_enabled:
                return torch._C.is_grad_enabled()
            _SET_GRAD_ENABLED(bool(args[0]))  # the region's mode, for real: the code after reads it
            return None
        if self.defer_values:
            key = deferred.op_key(op, node.target, args, kwargs, self._submodule)
            if key is not None and deferred.plain_state():
                v = self._deferred_value(node, key, args, kwargs)
                if v is not None:
                    return v
            elif key is None and deferred.is_container_getitem(node.target, args):
                return self._run(node, args, kwargs)
            if self._pending:
                # Any other op may change a tensor a pending value reads: compute them first.
                self._compute_pending()
                args = self._live_arg(node.args)
                kwargs = {k: self._live_arg(v) for k, v in node.kwargs.items()} if node.kwargs else {}
        return self._run(node, args, kwargs)

    def _would_require_grad(self, node: Node) -> bool:
        """`node`'s value's requires_grad in an eager run. Capture computes values under no_grad,
        so an intermediate's own flag is always False: a branch on `y.requires_grad` was specialised
        (and guarded) to False, which refused every training call. Autograd's rule instead: a
        floating result requires grad when grad mode is on (the mode where the model's code reads
        the flag) and a tensor it was computed from does (an input, a parameter, a module's
        parameter); `detach` ends it."""
        grad = torch.is_grad_enabled()
        stack = [node]
        while stack:
            n = stack[-1]
            if "recfuse_rg" in n.meta:
                stack.pop()
                continue
            v = n.meta.get(_LIVE)
            tensor = isinstance(v, torch.Tensor) or type(v) is deferred.Deferred
            if not tensor:
                n.meta["recfuse_rg"] = False
            elif n.op in ("placeholder", "get_attr"):
                n.meta["recfuse_rg"] = bool(getattr(v, "requires_grad", False))
            elif (not grad or not (v.dtype.is_floating_point or v.dtype.is_complex)
                  or n.target in (torch.detach, "detach", "detach_")):
                n.meta["recfuse_rg"] = False
            else:
                todo = [a for a in n.all_input_nodes if "recfuse_rg" not in a.meta]
                if todo:
                    stack.extend(todo)
                    continue
                r = any(a.meta["recfuse_rg"] for a in n.all_input_nodes)
                if not r and n.op == "call_module":
                    r = any(p.requires_grad for p in self._submodule(n.target).parameters())
                n.meta["recfuse_rg"] = r
            stack.pop()
        return node.meta["recfuse_rg"]

    def _private(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of the original's tensor `t` for the graph's reads of it: an in-place update the
        model's code makes through the graph (``self.w.data.mul_(2)``) changes the copy only."""
        c = self._privates.get(id(t))
        if c is None:
            c = self._privates[id(t)] = nn.Parameter(t.detach().clone(memory_format=torch.preserve_format),
                                                     t.requires_grad)
        return c

    def _run(self, node: Node, args: tuple, kwargs: dict, errors: bool = True) -> Any:
        """Run `node`'s op on values (never proxies); `errors=False` lets its exception through."""
        op = node.op
        self._executing = True
        grad = torch._C.is_grad_enabled()
        try:
            _SET_GRAD_ENABLED(False)  # torch.no_grad() without its per-call object
            if op == "call_function":
                return node.target(*args, **kwargs)
            if op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            if op == "call_module":
                return self._submodule(node.target)(*args, **kwargs)
        except Exception as e:
            if not errors:
                raise
            raise RecfuseError(
                f"running the model on example_inputs failed at `{node.format_node()}`: {e}"
            ) from e
        finally:
            _SET_GRAD_ENABLED(grad)
            self._executing = False
        return None

    def _deferred_value(self, node: Node, key: tuple, args: tuple, kwargs: dict) -> Any:
        """A `Deferred` for `node` when its result metadata is known for these arguments' metadata
        (learnt here if need be), its real value when all arguments are real and the metadata is
        new, None when it must run for real (the stand-ins raised)."""
        meta = self._result_meta.get(key)
        if meta is None:
            has_deferred = [False]

            def real_or_stand_in(a):
                if type(a) is deferred.Deferred:
                    has_deferred[0] = True
                    return deferred.stand_in(a)
                return a

            stand_args = map_aggregate(args, real_or_stand_in)
            stand_kwargs = map_aggregate(kwargs, real_or_stand_in)
            if not has_deferred[0]:
                v = self._run(node, args, kwargs)
                if deferred.tensor_meta(v) is not None and type(v) is torch.Tensor:
                    self._result_meta[key] = deferred.tensor_meta(v)
                return v
            try:
                v = self._run(node, stand_args, stand_kwargs, errors=False)
            except Exception:
                return None  # the real run raises the error the user should see, or succeeds
            if type(v) is not torch.Tensor or deferred.tensor_meta(v) is None:
                return None
            meta = self._result_meta[key] = deferred.tensor_meta(v)
        self._pending.append(node)
        return deferred.Deferred(node, *meta)

    def _compute_pending(self) -> None:
        """Compute every deferred value, in graph order, in the plain global state they were
        deferred in."""
        pending, self._pending = self._pending, []
        ctx = contextlib.nullcontext() if deferred.plain_state() else deferred.plain_context()
        with ctx:
            for n in pending:
                if type(n.meta.get(_LIVE)) is deferred.Deferred:
                    args = self._live_arg(n.args)
                    kwargs = {k: self._live_arg(v) for k, v in n.kwargs.items()} if n.kwargs else {}
                    n.meta[_LIVE] = self._run(n, args, kwargs)

    def _submodule(self, target: str) -> nn.Module:
        # fx's own map of the root's modules (filled by `trace`), inverted once: get_submodule walks
        # the path on every call.
        if self._module_at is None:
            self._module_at = {name: m for m, name in (self.submodule_paths or {}).items()}
        m = self._module_at.get(target)
        return m if m is not None else self.root.get_submodule(target)

    def iter(self, obj: Proxy):
        v = obj.node.meta.get(_LIVE)
        if type(v) is deferred.Deferred:
            self._compute_pending()
            v = obj.node.meta.get(_LIVE)
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            # `for row in x` unrolls over x's first size: guarded like len(x)
            self._specialise(obj.node, "len", len(v))
            return iter([obj[i] for i in range(len(v))])
        if isinstance(v, (tuple, list)):
            self._guard_count(obj.node, len(v))
            return iter([obj[i] for i in range(len(v))])
        if isinstance(v, Mapping):
            self.key_order_guards.append((obj.node, tuple(v.keys())))
            return iter(list(v.keys()))
        return super().iter(obj)

    def to_bool(self, obj: Proxy) -> bool:
        v = obj.node.meta.get(_LIVE)
        if _MODE in obj.node.meta:
            # `if self.training:` can only follow one branch: the graph keeps the one taken, and a
            # guard refuses calls in the other mode instead of running the wrong branch.
            target, flag = obj.node.meta[_MODE]
            self.mode_guards.setdefault(target, (flag, _user_frame()))
        if isinstance(v, (bool, int, float)) and not isinstance(v, torch.Tensor):
            # shape arithmetic or tensor metadata: specialised to the example, and guarded
            if not (obj.node.op == "get_attr" and _MODE in obj.node.meta):
                self._specialise(obj.node, "bool", bool(v))
            return bool(v)
        raise _DataDependentControlFlow(f"a Python `if`/`while`/`and`/`or` on a tensor value at {_user_frame()}")

    def _specialise(self, node: Node, how: str, value: Any) -> None:
        """Record that the model's code turned `node`'s value into the Python value `value` (`how`:
        bool, int, index, float, len): the graph follows it, so a guard checks it on every call.
        A value computed from tensor data (`.item()`, `.tolist()`) cannot be guarded usefully: refused."""
        key = (node, how)
        if key in self._specialised:
            return
        self._specialised.add(key)
        if how != "len":  # len(tensor) reads its first size, never its data
            self._check_not_data(node)
        what = f"len({_expr(node)})" if how == "len" else _expr(node)
        self.value_guards.append((node, how, value, what, _user_frame()))

    def _guard_count(self, node: Node, count: int) -> None:
        """Guard the number of items of a tuple/list value the model's code unrolled (`for t in
        x.split(D, 1)`, `x.unbind(1)`, `len(...)`, `a, b = ...`): the graph holds the example's
        count, the original would follow the call's. A split's count is guarded from its source's
        size (`runtime.piece_count`), so that the split itself need not run once it is fused."""
        if (node, "count") in self._specialised:
            return
        self._specialised.add((node, "count"))
        split = _split_pieces(node)
        if split is False:
            return  # a count fixed by the code: tensor_split(x, n), split(x, [sizes])
        how = "len" if split is None else "pieces"
        self.value_guards.append((node, how, count, f"len({_expr(node)})", _user_frame()))

    def _guard_split_sizes(self, node: Node) -> None:
        """`x.split([8, 8, 8, 8], 1)` (or `split_with_sizes`, `tensor_split(x, [8, 16, 24], 1)`) raises
        in the original when x's dim is not the sizes' sum (or gives a last piece of another length):
        once fused, the split no longer runs, so its source's size is guarded."""
        split = _split_pieces(node)
        if split is not False or node.target not in ("split", "split_with_sizes", "tensor_split", torch.split,
                                                     torch.tensor_split):
            return
        src = node.args[0]
        names = ("split_size_or_sections", "split_size", "split_sizes", "indices_or_sections", "indices", "sections",
                 "dim")
        args = list(node.args[1:]) + [node.kwargs[k] for k in names if k in node.kwargs]
        dim = args[1] if len(args) > 1 else 0
        sv = src.meta.get(_LIVE)
        if (not args or not isinstance(args[0], (list, tuple)) or not isinstance(dim, int)
                or not isinstance(sv, torch.Tensor) or not -sv.dim() <= dim < sv.dim()):
            return
        what = f"the size of dim {dim} of {_expr(src)} (which `{_expr(node)}` splits)"
        self.value_guards.append((node, "size", sv.shape[dim], what, _user_frame()))

    def _check_not_data(self, node: Node) -> None:
        """Raise `_DataDependentControlFlow` when `node`'s Python value is computed from tensor data
        rather than tensor metadata (shapes, dtype, requires_grad, ...)."""
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op in ("placeholder", "get_attr") or _MODE in n.meta:
                continue
            for a in n.all_input_nodes:
                v = a.meta.get(_LIVE)
                if isinstance(v, torch.Tensor) or type(v) is deferred.Deferred:
                    if not _reads_metadata(n):
                        raise _DataDependentControlFlow(
                            f"`{_expr(n)}` reads a tensor's data into Python (used in control flow or as a "
                            f"Python number) at {_user_frame()}")
                elif v is None or isinstance(v, (bool, int, float, str, torch.Size, tuple, list, torch.dtype,
                                                 torch.device)):
                    stack.append(a)


_AUTOGRAD_FLAG_METHODS = frozenset({"requires_grad_", "retain_grad"})
_METADATA_ATTRS = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_cuda", "is_cpu", "is_meta", "ndim", "is_leaf", "layout",
    "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "names", "itemsize"})
_METADATA_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous", "is_floating_point",
    "is_complex", "element_size", "get_device", "storage_offset", "is_signed", "is_inference", "has_names"})
_METADATA_FUNCTIONS = frozenset({torch.numel, torch.is_floating_point, torch.is_complex})


_SPLIT_FUNCTIONS = {torch.split: "split", torch.chunk: "chunk", torch.unbind: "unbind",
                    torch.tensor_split: "tensor_split"}


def _split_pieces(node: Node):
    """(source, kind, size, dim) of a split-like node whose number of pieces depends on its source's
    size, False for one whose count the code fixes, None for any other node."""
    if node.op == "call_function":
        kind = _SPLIT_FUNCTIONS.get(node.target)
    elif node.op == "call_method" and node.target in ("split", "chunk", "unbind", "tensor_split", "split_with_sizes"):
        kind = node.target
    else:
        return None
    if kind is None or not node.args or not isinstance(node.args[0], Node):
        return None
    if kind in ("tensor_split", "split_with_sizes"):
        return False
    names = ("dim",) if kind == "unbind" else ("split_size_or_sections", "split_size", "chunks", "dim")
    args = list(node.args[1:]) + [node.kwargs[k] for k in names if k in node.kwargs]
    if kind == "unbind":
        return node.args[0], kind, None, args[0] if args else 0
    size = args[0] if args else None
    if isinstance(size, (list, tuple)) or size is None:
        return False
    return node.args[0], kind, size, args[1] if len(args) > 1 else 0


def _split_source(node: Node) -> tuple:
    """(source, dim) of a split whose sizes the code fixes (see `_guard_split_sizes`)."""
    args = list(node.args[1:]) + [v for k, v in node.kwargs.items() if k != "dim"] + (
        [node.kwargs["dim"]] if "dim" in node.kwargs else [])
    return node.args[0], args[1] if len(args) > 1 else 0


def _reads_metadata(n: Node) -> bool:
    """Whether `n` reads only metadata of its tensor arguments (a size, the dtype, a flag)."""
    if n.op == "call_function":
        if n.target is builtins.getattr:
            return len(n.args) >= 2 and n.args[1] in _METADATA_ATTRS
        return n.target in _METADATA_FUNCTIONS
    if n.op == "call_method":
        return n.target in _METADATA_METHODS
    return False


_OPERATOR_TEXT = {operator.gt: ">", operator.ge: ">=", operator.lt: "<", operator.le: "<=", operator.eq: "==",
                  operator.ne: "!=", operator.add: "+", operator.sub: "-", operator.mul: "*",
                  operator.floordiv: "//", operator.mod: "%", operator.truediv: "/", operator.and_: "&",
                  operator.or_: "|"}


def _expr(n: Any, depth: int = 0) -> str:
    """The Python expression a node stands for, as the model's code wrote it (for messages)."""
    if not isinstance(n, Node):
        return repr(n)
    if depth > 6:
        return n.name
    if n.op == "placeholder":
        return n.target.lstrip("*")
    if n.op == "get_attr":
        return f"self.{n.target}"
    a = [_expr(x, depth + 1) for x in n.args]
    if n.op == "call_method":
        return f"{a[0]}.{n.target}({', '.join(a[1:])})"
    if n.op == "call_function":
        if n.target is builtins.getattr and len(a) == 2:
            return f"{a[0]}.{n.args[1]}"
        if n.target is operator.getitem and len(a) == 2:
            return f"{a[0]}[{a[1]}]"
        if n.target in _OPERATOR_TEXT and len(a) == 2:
            return f"({a[0]} {_OPERATOR_TEXT[n.target]} {a[1]})"
        if n.target is runtime.grad_enabled:
            return "torch.is_grad_enabled()"
        name = getattr(n.target, "__name__", str(n.target))
        return f"{name}({', '.join(a)})"
    return n.name


class _FunctionModule(nn.Module):
    """Wraps a plain function so it can be traced; module arguments become its submodules."""

    def __init__(self, fn, module_args: dict[str, nn.Module]):
        super().__init__()
        self._fn = fn
        self._module_arg_names = tuple(module_args)
        for name, m in module_args.items():
            self.add_module(name, m)



def _wrap_function(fn, params: list[inspect.Parameter], module_args: dict[str, nn.Module]) -> nn.Module:
    names = [p.name for p in params]
    # The tracer reads the forward's code object for argument names, so build a real one.
    call_args = ", ".join(f"self.{n}" if n in module_args else n for n in names)
    src = f"def forward(self, {', '.join(names)}):\n    return self._fn({call_args})\n"
    ns: dict[str, Any] = {}
    exec(compile(src, f"<recfuse wrapper of {getattr(fn, '__name__', 'fn')}>", "exec"), ns)
    # Tracer.trace reads type(root).forward, so each wrapped function gets its own class.
    cls = type(getattr(fn, "__name__", "Function"), (_FunctionModule,), {"forward": ns["forward"]})
    return cls(fn, module_args)


def _global_modules(fn) -> dict[str, nn.Module]:
    """nn.Modules a plain function reads as globals or closure variables (its code and the code of
    its comprehensions and nested functions): constants of the function, like module arguments."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if inspect.iscode(k))
    found = {n: v for n, v in getattr(fn, "__globals__", {}).items() if n in names and isinstance(v, nn.Module)}
    for n, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if isinstance(v, nn.Module):
            found[n] = v
    return found


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_CONTAINERS = (list, dict, set, bytearray, __import__("collections").deque)
_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_OPAQUE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, nn.Module,
           torch.Tensor, torch.dtype, torch.device)
_BIG = 10_000  # a container this long is compared by length only (a vocabulary: fingerprinting costs)


def _plain_object(v: Any) -> bool:
    """A Python object whose attributes the model's code may change (a config namespace, a
    dataclass instance): one with a `__dict__` that is not a module, tensor, function or class."""
    return not isinstance(v, _OPAQUE) and isinstance(getattr(v, "__dict__", None), dict)


def _fingerprint(v: Any, depth: int = 0) -> Any:
    """What a change of a plain Python value made in place changes: atoms by value; lists, dicts,
    sets and plain objects by their items / attributes (a few levels deep); anything else (tensors,
    modules) by identity."""
    if isinstance(v, _ATOMS):
        return (type(v), repr(v) if isinstance(v, (float, complex)) else v)  # repr: nan == nan
    if depth > 3:
        return id(v)
    if isinstance(v, _CONTAINERS):
        if len(v) > _BIG:
            return (type(v), id(v), len(v))
        if isinstance(v, dict):
            return (type(v), tuple((_fingerprint(k, 4), _fingerprint(x, depth + 1)) for k, x in v.items()))
        if isinstance(v, set):
            return (type(v), frozenset(_fingerprint(x, 4) for x in v))
        if isinstance(v, bytearray):
            return bytes(v)
        return (type(v), tuple(_fingerprint(x, depth + 1) for x in v))
    if isinstance(v, tuple):
        return (type(v), tuple(_fingerprint(x, depth + 1) for x in v))
    if _plain_object(v):
        return (type(v), id(v), _fingerprint(vars(v), depth + 1))
    return id(v)


def _code_names(code, out: set) -> set:
    """The global names `code` and the code objects nested in it (comprehensions) read."""
    out.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, out)
    return out


class _PlainStateSnapshot:
    """The plain Python state a model's forward can change without a tensor op: the attributes of
    every module of the model (lists, dicts, config objects, values of new attributes) and the
    mutable globals its forward methods name. Such a change is no op of the graph: the transformed
    model would make it once, at capture, and never on its calls (`self.seen.append(...)`,
    `self.stats["mean"] = ...`, `self.cfg.calls += 1` on a namespace, whose value the graph then
    also bakes in, `STATS.append(...)` on a global). Rebinding an existing attribute of a module
    (`self.n = ...`) is refused while tracing, by `_traced_module_setattr`."""

    def __init__(self, root: Optional[nn.Module], fn=None):
        self.modules, self.globals = [], []
        codes = []
        if root is not None:
            seen_types = set()
            for path, mod in root.named_modules(remove_duplicate=True):
                self.modules.append((path, mod, self._state(mod)))
                f = getattr(type(mod), "forward", None)
                if type(mod) not in seen_types and isinstance(f, types.FunctionType):
                    seen_types.add(type(mod))
                    codes.append(f)
        if isinstance(fn, types.FunctionType):
            codes.append(fn)
        done = set()
        for f in codes:
            g = f.__globals__
            for name in _code_names(f.__code__, set()):
                v = g.get(name)
                if (id(v) in done or not (isinstance(v, _CONTAINERS) or _plain_object(v))
                        or isinstance(v, _OPAQUE)):
                    continue
                done.add(id(v))
                saved = copy.copy(v) if isinstance(v, _CONTAINERS) else None
                self.globals.append((f"{f.__module__}.{name}", v, _fingerprint(v), saved))

    @staticmethod
    def _state(mod: nn.Module) -> dict:
        """name -> fingerprint of a module's own attributes. Atoms and tuples (eps,
        normalized_shape) cannot change in place, and rebinding an attribute goes through
        `_traced_module_setattr`: they are kept by identity, which is cheap (a model of 10,000
        LayerNorms has 30,000 of them)."""
        return {k: (id(v) if type(v) is tuple or isinstance(v, _ATOMS) else _fingerprint(v))
                for k, v in mod.__dict__.items() if k not in _MODULE_INTERNALS}

    def check(self, fn_name: str, dynamo: bool = False, graph: Optional[Graph] = None,
              tracer: Optional[Tracer] = None) -> None:
        # A module the graph calls (a call_module leaf: a FusedFeatureProcessor, whose plan cache
        # fills on its first call) runs its own forward on every call of the result, so what it
        # changes in place changes as in the original; a new attribute is still looked for (the
        # caller's code may have set it: `self.lin.tagged = True`).
        leaves = {n.target for n in graph.nodes if n.op == "call_module"} if graph is not None else set()
        # torch.fx stores a tensor constant made in forward (`li, lj = torch.tril_indices(...)`,
        # `torch.tensor([...])` indices in a DLRM interaction) as a new attribute `_tensor_constantN`
        # of the traced root (a copy of the model): the tracer's doing, not the model's. Round 13:
        # such a DLRM was refused as "changed the attribute `_tensor_constant0` ... in place".
        made = ({q for t, q in tracer.tensor_attrs.items() if "." not in q} if tracer is not None else set())
        for path, mod, old in self.modules:
            state = self._state(mod)
            if made and path == "":
                state = {k: v for k, v in state.items() if k in old or k not in made}
            # path or one of its parents is a leaf: walk the dotted prefixes (a set lookup each, not
            # a scan of the leaves: 10,000 modules x 10,000 leaves took 15 s)
            if leaves and (path in leaves or any(path[:i] in leaves for i, c in enumerate(path) if c == ".")):
                state = {k: old.get(k, v) for k, v in state.items()}
            if dynamo:  # Dynamo marks the modules it traces (`_is_torch_compile`): not the model's doing
                state = {k: v for k, v in state.items() if k in old or not k.startswith("_")}
            if state != old:
                names = [k for k, v in state.items() if old.get(k, v) != v or k not in old]
                names += [k for k in old if k not in state]
                what = ", ".join(f"`{path + '.' if path else ''}{k}`" for k in names) or "an attribute"
                self._refuse(fn_name, f"the attribute {what} of {type(mod).__name__}")
        for name, v, fp, saved in self.globals:
            if _fingerprint(v) != fp:
                if saved is not None:  # the trace ran the real code on the real global: put it back
                    try:
                        v.clear()
                        v.update(saved) if isinstance(v, (dict, set)) else v.extend(saved)
                    except Exception:
                        pass
                self._refuse(fn_name, f"the global `{name}`")

    @staticmethod
    def _refuse(fn_name: str, what: str) -> None:
        raise RecfuseError(
            f"cannot capture {fn_name}: its forward changed {what} in place (an append, an item or "
            f"attribute set, a new attribute): the captured graph holds tensor ops only, so the transformed "
            f"model would make that change once, at capture, and never on its calls (and would keep any "
            f"value read from it fixed). Keep such state in a buffer updated in place (`self.n.add_(1)`, "
            f"which is kept), in a forward hook on the transformed model, or outside forward.")


class _StateSnapshot:
    """Buffers of a module and the RNG state, restored on exit: capturing runs the forward once
    (BatchNorm statistics, `num_batches_tracked`, dropout's random draws) and must change nothing."""

    def __init__(self, module: nn.Module, example: Any):
        self.module = module
        devices = sorted({t.device.index or 0 for t in _tensors(example) if t.device.type == "cuda"})
        self.rng = torch.random.fork_rng(devices=devices)

    def __enter__(self):
        self.buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        self.rng.__enter__()
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, saved in self.buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)
        return self.rng.__exit__(*exc)


@contextlib.contextmanager
def _one_thread():
    """Run the example values on one intra-op thread. Capture runs every node's op once on the
    example inputs, tens of thousands of tiny ops for a per-feature model; each parallel region
    waits for all threads, so on a busy machine (more runnable threads than cores) an op of a
    few microseconds took a millisecond: a 10,000-feature capture took 20-35 s instead of 3 s."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


def _tensors(v: Any) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, Mapping):
        v = list(v.values())
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _insert_guards(gm: GraphModule, tracer: "_ModeTracer") -> bool:
    """Guards for what the capture specialised: a `training` flag a branch was taken on, and the
    key order of dicts the model iterated (the original follows the caller's order)."""
    graph = gm.graph
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for target, (flag, where) in tracer.mode_guards.items():
        with graph.inserting_before(first), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fx warns on get_attr of a non-tensor attribute
            flag_node = graph.get_attr(target)
            graph.call_function(runtime.check_training_mode, (flag_node, flag, where))
    value_guards = getattr(tracer, "value_guards", ())
    for node, how, value, what, where in value_guards:
        if node.graph is not graph:
            continue
        with graph.inserting_after(node):
            arg = _split_pieces(node) if how == "pieces" else _split_source(node) if how == "size" else node
            graph.call_function(runtime.check_specialized, (arg, how, value, what, where))
    seen = set()
    for node, keys in tracer.key_order_guards:
        if (node, keys) in seen or node.graph is not graph:
            continue
        seen.add((node, keys))
        with graph.inserting_after(node):
            graph.call_function(runtime.check_key_order, (node, keys, node.name))
    for node, keys in getattr(tracer, "key_set_guards", ()):
        if (node, keys, "set") in seen or node.graph is not graph:
            continue
        seen.add((node, keys, "set"))
        with graph.inserting_after(node):
            graph.call_function(runtime.check_key_set, (node, keys, node.name))
    return bool(tracer.mode_guards or seen or value_guards)


def _guard_default_dtype(graph: Graph, root: nn.Module, tracer: Tracer) -> bool:
    """A `runtime.check_default_dtype` node at the start of the graph where it holds what the default
    dtype was while it was traced: a floating tensor constant the model's forward made in it
    (``torch.ones(F)``: torch.fx stores such a tensor as a `_tensor_constantN` attribute) or a read of
    ``torch.get_default_dtype()`` by the model's code. Before (red-team round 20), a call under another
    default dtype silently computed with the trace's (a float32 result where the original gave
    float64). Returns whether the graph changed."""
    dtype = _GET_DEFAULT_DTYPE()
    where = tracer.__dict__.pop("recfuse_default_dtype_read", None)
    if where is None:
        for n in graph.nodes:
            if n.op == "get_attr" and n.target.startswith("_tensor_constant"):
                t = getattr(root, n.target, None)
                if isinstance(t, torch.Tensor) and t.dtype is dtype:
                    where = f"a tensor constant `{n.target}` of the graph, used by `{next(iter(n.users), n).name}`"
                    break
    if where is None:
        return False
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    with graph.inserting_before(first):
        graph.call_function(runtime.check_default_dtype, (dtype, where))
    return True


_NOT_REGION_USERS = (runtime.set_grad_mode, runtime.grad_enabled, runtime.check_specialized, runtime.check_dynamo_guards,
                     runtime.check_key_order, runtime.check_key_set, runtime.check_none, runtime.check_not_none,
                     runtime.check_training_mode, runtime.check_default_dtype)


def _separate_grad_regions(graph: Graph) -> bool:
    """Put a `runtime.grad_region_boundary` between each value and its uses in another grad-mode
    region (the code between two `set_grad_mode` nodes), so that no fusion merges work of two
    regions into one op that would run in one mode. Returns whether the graph changed."""
    region, where = 0, {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is runtime.set_grad_mode:
            region += 1
        where[n] = region
    if region == 0:
        return False
    for n in list(graph.nodes):
        if n.op == "output" or (n.op == "call_function" and n.target in _NOT_REGION_USERS):
            continue
        for a in list(n.all_input_nodes):
            if where.get(a, where[n]) == where[n] or (a.op == "call_function" and a.target in _NOT_REGION_USERS):
                continue
            with graph.inserting_before(n):
                b = graph.call_function(runtime.grad_region_boundary, (a,))
            b.meta.update({k: v for k, v in a.meta.items() if k == VAL_KEY})
            where[b] = where[n]
            n.replace_input_with(a, b)
    return True


def _is_constant(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, nn.Module, torch.dtype, torch.device))


def _clone_inputs(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        c = v.detach().clone()
        return c.requires_grad_() if v.requires_grad else c  # read by `x.requires_grad` in the model's code
    if isinstance(v, Mapping):
        return type(v)((k, _clone_inputs(x)) for k, x in v.items()) if type(v) is dict else {
            k: _clone_inputs(x) for k, x in v.items()
        }
    if type(v) in (list, tuple):
        return type(v)(_clone_inputs(x) for x in v)
    return v


def _guard_optional_arguments(gm: GraphModule, params: list, values: dict, constants: dict) -> bool:
    """Guard arguments whose default is None but whose example value was a tensor (`mask=None`):
    the graph holds the code path for the tensor; a call passing None would fail inside it with an
    unrelated TypeError (or `x * None`), while the original takes its None branch."""
    optional = {p.name for p in params
                if p.default is None and p.name not in constants and values.get(p.name) is not None}
    if not optional:
        return False
    changed = False
    for n in list(gm.graph.nodes):
        if n.op == "placeholder" and n.target in optional:
            with gm.graph.inserting_after(n):
                gm.graph.call_function(runtime.check_not_none, (n, n.target))
            changed = True
    return changed


def _finish_concrete(gm: GraphModule, constants: dict[str, Any], defaults: Optional[dict] = None) -> None:
    """Give constant arguments defaults, and drop guards on module-valued ones.

    symbolic_trace guards a specialised int with an assert (kept: calling with another batch size
    than the graph was built for must fail loudly) but cannot guard a module argument; ours are
    submodules of the graph, so the argument may be omitted, and passing any module other than
    the one given at transform time raises (it would be ignored otherwise).
    """
    for n in list(gm.graph.nodes):
        if n.op != "placeholder" or _arg_name(n.target, constants) not in constants:
            continue
        value = constants[_arg_name(n.target, constants)]
        if isinstance(value, nn.Module):
            for u in list(n.users):
                if not u.users:
                    gm.graph.erase_node(u)
            n.args = (None,)
            with gm.graph.inserting_after(n):
                gm.graph.call_function(runtime.check_module_argument,
                                       (n, runtime.remember_module_argument(value), _arg_name(n.target, constants)))
        elif value is None or isinstance(value, (bool, int, float, str)):
            default = (defaults or {}).get(_arg_name(n.target, constants), value)
            if not (default is None or type(default) in (bool, int, float, str)) or _same_plain_value(default, value):
                default = value
            # An argument with a default of its own keeps it: a call that leaves it out means the
            # original's default, not the example's value (`forward(x, scale=1.0)` transformed with
            # scale=2.0 returned y * 2 for `g(x)`); the guard below then refuses that call.
            n.args = (default,)
            if value is not None and not any(u.target is torch._assert or getattr(u.target, "__name__", "") == "eq"
                                             or u.target in (operator.eq, runtime.check_constant) for u in n.users):
                # fx guards a baked int/float/bool with `torch._assert(x == value)`; a str (whose
                # comparison the value tracer answers at once) had no guard: `forward(x, mode="sum")`
                # transformed with "mean" ran the mean path for `g(x, "sum")`.
                with gm.graph.inserting_after(n):
                    gm.graph.call_function(runtime.check_constant, (n, value, _arg_name(n.target, constants)))
            if value is None:
                # fx's own `_assert_is_none` for it is pure, and dead-code elimination drops it
                for u in list(n.users):
                    if getattr(u.target, "__name__", "") == "_assert_is_none" and not u.users:
                        gm.graph.erase_node(u)
                with gm.graph.inserting_after(n):
                    gm.graph.call_function(runtime.check_none, (n, _arg_name(n.target, constants)))
    # symbolic_trace names a concrete argument's placeholder `scale_1`: give the signature back its
    # name, so that the argument can be passed by keyword (`g(x, scale=2.0)`) as to the original.
    taken = {n.name for n in gm.graph.nodes} | {n.target for n in gm.graph.nodes if n.op == "placeholder"}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.target not in constants:
            name = _arg_name(n.target, constants)
            if name in constants and name not in taken:
                n.target = name
                taken.add(name)


def capture(model, example_inputs: Optional[tuple] = None, *, codegen: bool = True,
            share_leaves: bool = False) -> tuple[GraphModule, dict]:
    """Trace `model` (an nn.Module or a function) into a GraphModule annotated with example values.

    Returns the GraphModule and a dict of facts for the report (``"how"``: the capture path,
    ``"constants"``: arguments baked in, ``"shapes"``: whether shapes are known). The model is
    deep-copied first, so the result never shares parameters with the original. With
    ``codegen=False`` the module's code is not generated: the caller changes the graph and calls
    ``gm.recompile()`` before running it.

    Raises:
        RecfuseError: the model branches on tensor values (data-dependent control flow), or
            running it on `example_inputs` fails.

    Example:
        >>> import torch
        >>> gm, facts = capture(lambda x, n: x.view(n, -1).tanh(), (torch.randn(6), 2))
        >>> facts["constants"]
        {'n': 2}

    ``share_leaves=True`` (for `transform`, which calls `unshare` on what it keeps): the plain
    leaves of an nn.Module model are traced as shallow copies holding the original's parameters
    (`copy_sharing_leaves`); ``facts["shared"]`` lists those tensors. The original is never
    changed: if the trace changed one of them, it is put back and the capture is redone on a full
    copy (then ``facts["shared"]`` is empty).
    """
    if share_leaves and isinstance(model, nn.Module):
        try:
            return _capture(model, example_inputs, codegen, True)
        except _RetryWithCopy:
            logger.debug("recfuse: the trace changed a shared tensor of the original (restored); capturing a copy")
    return _capture(model, example_inputs, codegen, False)


def _capture(model, example_inputs, codegen: bool, share: bool) -> tuple[GraphModule, dict]:
    if isinstance(example_inputs, (torch.Tensor, Mapping)) or (
            example_inputs is not None and not isinstance(example_inputs, (tuple, list))):
        raise TypeError(
            f"example_inputs must be a tuple of the model's positional arguments, got a "
            f"{type(example_inputs).__name__}; for a single tensor x pass (x,)")
    example_inputs = tuple(example_inputs) if example_inputs is not None else None
    shared: list = []
    alone = None
    if isinstance(model, nn.Module):
        root, shared, special, alone = copy_sharing_leaves(model) if share else (deepcopy_module(model), [], True, None)
        if special:  # copy_sharing_leaves found no tensor hook and no lazy parameter otherwise
            _copy_tensor_hooks(model, root)
        sig = inspect.signature(root.forward)
        fn_name = type(model).__name__ + ".forward"
    elif callable(model):
        special = True
        sig = inspect.signature(model)
        fn_name = getattr(model, "__qualname__", repr(model))
        root = None
    else:
        raise RecfuseError(f"transform expects an nn.Module or a function, got {type(model).__name__}")

    params = [
        p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) != len(sig.parameters):
        raise RecfuseError(f"cannot capture {fn_name}: *args/**kwargs/keyword-only parameters are not supported")
    values: dict[str, Any] = {}
    if example_inputs is not None:
        if len(example_inputs) > len(params):
            raise RecfuseError(f"{fn_name} takes {len(params)} arguments, example_inputs has {len(example_inputs)}")
        for p, v in zip(params, example_inputs):
            values[p.name] = v
        for p in params[len(example_inputs):]:
            if p.default is p.empty:
                raise RecfuseError(f"example_inputs gives no value for argument `{p.name}` of {fn_name}")
            values[p.name] = p.default
    constants = {k: v for k, v in values.items() if _is_constant(v)}
    if root is not None and special:
        _refuse_lazy(root, fn_name)
    for v in constants.values():
        if isinstance(v, nn.Module):
            _refuse_lazy(v, fn_name)
    adopted: list[str] = []
    if root is None:
        module_args = {k: deepcopy_module(v) for k, v in constants.items() if isinstance(v, nn.Module)}
        for k, v in module_args.items():
            _copy_tensor_hooks(constants[k], v)
        root = _wrap_function(model, params, module_args)
        # Globals are called by identity from the function's code: registered as they are for the
        # trace, replaced by copies in the result (which owns its parameters, as for arguments).
        for name, m in _global_modules(model).items():
            _refuse_lazy(m, fn_name)
            attr = f"_recfuse_global_{name}"
            root.add_module(attr, m)
            adopted.append(attr)

    tracer = _ValueTracer({k: (None if isinstance(v, nn.Module) else _clone_inputs(v)) for k, v in values.items()})
    if example_inputs is None:
        tracer = _ModeTracer()  # no values: plain symbolic tracing, shapes stay unknown
    concrete = {k: (None if isinstance(v, nn.Module) else v) for k, v in constants.items()}
    if shared:
        tracer._shared = {id(t) for t in shared}
    guard = _SharedGuard(shared) if shared else None
    containers = _PlainStateSnapshot(root, None if isinstance(model, nn.Module) else model)
    try:
        with warnings.catch_warnings(), _StateSnapshot(root, example_inputs), _one_thread(), \
                _traced_type_builtin(root, model if not isinstance(model, nn.Module) else None):
            warnings.simplefilter("ignore")
            graph = tracer.trace(root, concrete_args=concrete or None)
    except _DataDependentControlFlow as e:
        _check_guard(guard)
        raise RecfuseError(
            f"cannot capture {fn_name}: data-dependent control flow: {e}. The fused graph would be "
            f"specialised to the example data. Use torch.where or torch.cond instead of Python control "
            f"flow on tensor values (or keep the value a tensor instead of `.item()`), or apply "
            f"recfuse.FusedFeatureProcessor by hand."
        ) from None
    except RecfuseError:
        _check_guard(guard)
        raise
    # ValueError too (round 13): torch.vmap refuses a Proxy as a batched argument with one, which
    # escaped transform as a bare ValueError instead of the Dynamo fallback / a RecfuseError.
    except (torch.fx.proxy.TraceError, TypeError, ValueError, RuntimeError, NotImplementedError) as e:
        _check_guard(guard)
        if shared:
            raise _RetryWithCopy() from None  # Dynamo runs the model too: only ever on a full copy
        if isinstance(e, torch.fx.proxy.TraceError) and "control flow" in str(e):
            raise RecfuseError(
                f"cannot capture {fn_name}: data-dependent control flow ({e}). Pass example_inputs, or "
                f"use torch.where/torch.cond instead of a Python `if` on a tensor."
            ) from None
        gm, facts = _capture_dynamo(root, values, constants, fn_name, e)
        containers.check(fn_name, dynamo=True)
        return gm, facts
    except BaseException:
        _check_guard(guard)
        raise
    _check_guard(guard)
    containers.check(fn_name, graph=graph, tracer=tracer)
    _warn_dropped_output(tracer, fn_name)
    _release_trace_state(tracer)
    graph._tracer_cls = None  # a loaded copy re-traces its code with RebuildTracer
    for n in graph.nodes:
        if isinstance(n.type, str):
            # A string annotation (`from __future__ import annotations`) becomes a str-valued
            # global of the generated code, which torch.save cannot write as an import.
            n.type = None
    class_name = getattr(model, "__name__", type(root).__name__)
    if share:
        # `transform` fuses first and builds the module after (`PendingModule.build`): built now, the
        # GraphModule would register every per-feature leaf the graph calls (10,000 of them) only for
        # fusion to prune them.
        _carry_hooks(root, types.SimpleNamespace(**{k: {} for k in _MODULE_HOOK_DICTS}))  # refuses as before
        gm = PendingModule(root, graph, class_name)
    else:
        gm = TransformedGraphModule(root, graph, class_name=class_name, codegen=codegen)
        gm.training = root.training
        _carry_hooks(root, gm)
    for attr in adopted:
        if attr in gm._modules:
            original = gm._modules[attr]
            gm._modules[attr] = deepcopy_module(original)
            _copy_tensor_hooks(original, gm._modules[attr])
    infos: dict = {}  # (shape, dtype) -> its ValueInfo (frozen: one serves every node of that metadata)
    for n in gm.graph.nodes:
        live = n.meta.pop(_LIVE, None)
        if example_inputs is not None and n.op != "output":
            t = type(live)
            if t is deferred.Deferred or t is torch.Tensor:
                key = (live.shape, live.dtype)
                info = infos.get(key)
                if info is None:
                    info = infos[key] = live.value_info() if t is deferred.Deferred else summarise(live)
                n.meta[VAL_KEY] = info
            else:
                n.meta[VAL_KEY] = summarise(live)
    changed = _insert_guards(gm, tracer)
    changed = _guard_default_dtype(gm.graph, root, tracer) or changed
    changed = _guard_optional_arguments(gm, params, values, constants) or changed
    changed = _separate_grad_regions(gm.graph) or changed
    if constants:
        _finish_concrete(gm, constants, {p.name: p.default for p in params if p.default is not p.empty})
    if codegen and (changed or constants) and not share:
        gm.recompile()
    return gm, {"how": "torch.fx", "constants": {k: v for k, v in constants.items() if not isinstance(v, nn.Module)},
                "shapes": example_inputs is not None, "name": fn_name, "shared": shared,
                "alone": alone if shared else None}


class PendingModule:
    """What ``capture(..., share_leaves=True)`` returns instead of a GraphModule: the traced copy
    `root` (which owns the graph's attributes and modules; the graph has no owning module
    meanwhile) and the graph, for `transform` to fuse before `build` makes the GraphModule (which
    then registers only what the fused graph reads)."""

    def __init__(self, root: nn.Module, graph: Graph, class_name: str):
        self.root, self.graph, self.class_name = root, graph, class_name

    def build(self, codegen: bool = True) -> GraphModule:
        root, graph = self.root, self.graph
        gm = TransformedGraphModule(root, graph, class_name=self.class_name, codegen=codegen)
        gm.training = root.training
        _carry_hooks(root, gm)
        return gm


def _check_guard(guard: Optional["_SharedGuard"]) -> None:
    """After a trace of shared leaves: if it changed one of the original's tensors, put it back
    and ask for a capture on a full copy."""
    if guard is not None and guard.changed():
        guard.restore()
        raise _RetryWithCopy()


def _release_trace_state(tracer: Tracer) -> None:
    """Drop what the tracer holds once its graph is built. fx's trace leaves the tracer in a
    reference cycle (its patcher and the wrappers it installed), so whatever the tracer holds
    lives until the collector finds the cycle: the model copy's per-feature modules (which fusion
    prunes) and nodes (which it erases) were freed only then, by a collection walking all of them
    (0.1-0.2 s at 10,000 features)."""
    tracer.root = None
    tracer.tensor_attrs = {}
    tracer.submodule_paths = None
    tracer.node_name_to_scope = {}  # a tuple per node, read by nothing after the trace
    if isinstance(tracer, _ValueTracer):
        tracer._module_at = None
        tracer._pending = []  # values never needed: capture drops every example value next
        tracer._result_meta = {}
        tracer._privates = {}
        tracer._shared = set()


def _restore_attr_names(gm: GraphModule, root: nn.Module) -> None:
    """Dynamo flattens `lns.0.weight` to `L__self___lns_0_weight`; put the original names back
    (found by identity) so that state_dict keys of the original model keep meaning."""
    from torch.fx.graph_module import _assign_attr

    by_id = {id(t): name for name, t in itertools.chain(root.named_parameters(), root.named_buffers())}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or "." in n.target:
            continue
        t = getattr(gm, n.target, None)
        name = by_id.get(id(t))
        if name is None or name == n.target:
            continue
        _assign_attr(t, gm, name)
        if hasattr(gm, n.target):
            delattr(gm, n.target)
        n.target = name


def _capture_dynamo(root: nn.Module, values, constants, fn_name, fx_error) -> tuple[GraphModule, dict]:
    """Fallback for code torch.fx cannot trace: Dynamo's export, which needs example values."""
    if not values:
        raise RecfuseError(f"cannot capture {fn_name} with torch.fx ({fx_error}); pass example_inputs") from None
    logger.info("recfuse: torch.fx could not trace %s (%s); trying torch._dynamo.export", fn_name, fx_error)
    args = [values[k] for k in values]
    mode, grad = root.training, torch.is_grad_enabled()

    def export(training: bool, grad_mode: bool = grad, inputs: list = args):
        root.train(training)
        try:
            with _StateSnapshot(root, inputs), torch.set_grad_enabled(grad_mode):
                return torch._dynamo.export(root, aten_graph=False)(*inputs)
        finally:
            root.train(mode)

    try:
        exported = export(mode)
        gm = exported.graph_module
        # Dynamo bakes train/eval behaviour (dropout, BatchNorm) into the graph: when the other
        # mode traces differently, the result refuses calls in that mode instead of ignoring it.
        # The same for the grad mode and the inputs' requires_grad, which Dynamo guards always:
        # kept as guards only where the code depends on them (inference under no_grad is common).
        mode_dependent = export(not mode).graph_module.code != gm.code
        grad_dependent = export(mode, grad_mode=not grad).graph_module.code != gm.code
        flipped = _flip_requires_grad(args)
        requires_grad_dependent = flipped is not None and export(mode, inputs=flipped).graph_module.code != gm.code
    except Exception as e:  # dynamo raises many types; all mean "cannot capture"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RecfuseError(
            f"cannot capture {fn_name}: torch.fx failed ({fx_error}) and torch._dynamo.export failed "
            f"({type(e).__name__}: {msg})"
        ) from None
    annotate_from_meta(gm.graph)
    _inference_mode_as_grad_regions(gm.graph, fn_name)
    _restore_attr_names(gm, root)
    graph = gm.graph
    graph._tracer_cls = None
    result = TransformedGraphModule(gm, graph, class_name=type(root).__name__)
    result.training = mode
    _carry_hooks(root, result)
    _keep_state(result, root)
    _guard_dynamo_specialisation(result, exported.guards, list(values), args, fn_name, fx_error,
                                 grad if grad_dependent else None, requires_grad_dependent)
    if mode_dependent:
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fx warns on get_attr of a non-tensor attribute
            flag = graph.get_attr("training")
            graph.call_function(runtime.check_training_mode, (
                flag, mode, f"{fn_name} was captured by torch._dynamo.export because torch.fx could not "
                            f"trace it, which fixes dropout/BatchNorm behaviour at capture time"))
        result.recompile()
    return result, {"how": "torch._dynamo.export", "constants": {}, "shapes": True, "name": fn_name}


_ENTER_INFERENCE = getattr(torch.autograd.grad_mode, "_enter_inference_mode", None)
_EXIT_INFERENCE = getattr(torch.autograd.grad_mode, "_exit_inference_mode", None)


def _inference_mode_as_grad_regions(graph: Graph, fn_name: str) -> None:
    """Dynamo's ``_enter_inference_mode(True)`` / ``_exit_inference_mode(ctx)`` nodes (a
    ``torch.inference_mode()`` block in forward) as a grad-mode region, as the fx capture keeps it
    (`_traced_inference_enter`). fx takes those two nodes for pure, and dead-code elimination
    dropped them: the transformed model recorded autograd inside the block and trained the
    parameters the original computed under inference_mode (red-team round 15)."""
    if _ENTER_INFERENCE is None:
        return
    changed = False
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not _ENTER_INFERENCE:
            continue
        if n.args[:1] != (True,) or n.kwargs:
            raise RecfuseError(
                f"cannot capture {fn_name}: it enters torch.inference_mode{n.args} in forward; recfuse.transform "
                f"keeps grad-mode regions, not inference-mode ones (use torch.no_grad() / torch.enable_grad())")
        exits = [u for u in n.users if u.op == "call_function" and u.target is _EXIT_INFERENCE]
        if len(exits) != len(n.users):
            raise RecfuseError(f"cannot capture {fn_name}: a torch.inference_mode() block of its forward is used "
                               f"in a way recfuse.transform cannot keep; use torch.no_grad() there")
        with graph.inserting_before(n):
            prev = graph.call_function(runtime.grad_enabled, ())
            graph.call_function(runtime.set_grad_mode, (False,))
        for e in exits:
            with graph.inserting_before(e):
                graph.call_function(runtime.set_grad_mode, (prev,))
            graph.erase_node(e)
        graph.erase_node(n)
        changed = True
    if changed:
        _separate_grad_regions(graph)


def _flip_requires_grad(args: list) -> Optional[list]:
    """`args` with requires_grad flipped on every floating tensor (None when there is none)."""
    leaves, spec = torch.utils._pytree.tree_flatten(args)
    if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
        return None
    flipped = [t.detach().clone().requires_grad_(not t.requires_grad)
               if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in leaves]
    return torch.utils._pytree.tree_unflatten(flipped, spec)


def _dynamo_source(names: list, path: tuple) -> tuple:
    """The argument path of a flattened leaf of ``(args, {})`` (`path` from pytree), as keys under
    Dynamo's ``L``: ``("d", "a")`` stands for ``L['d']['a']``."""
    keys = []
    for k in path[1:]:  # path[0] selects the args tuple of (args, kwargs)
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                keys.append(getattr(k, attr))
                break
        else:
            return ()
    if not keys or not isinstance(keys[0], int) or keys[0] >= len(names):
        return ()
    return (names[keys[0]],) + tuple(keys[1:])


def _only_reads_arguments(text: str, names: list) -> bool:
    """Whether a Dynamo guard's text reads forward's arguments (``L['x']``) only: not globals
    (``G[...]``) nor the module itself (``L['self']``), whose parameters are the graph's own."""
    read = re.findall(r"\bL\[\'([^\']*)\'\]", text)
    return bool(read) and "G[" not in text and all(r in names and r != "self" for r in read)


def _guard_dynamo_specialisation(gm: GraphModule, guards, names: list, args: list, fn_name: str, fx_error,
                                 grad: Optional[bool], requires_grad_dependent: bool) -> None:
    """Insert `runtime.check_dynamo_guards` as the graph's first op: Dynamo's own conditions on the
    inputs (shape-environment guards: sizes, strides, relations between sizes; each input's dtype,
    device and dimensions; requires_grad and the grad mode where the code depends on them). A
    condition that cannot be evaluated here is replaced by the example's exact metadata."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    try:
        with_paths, _ = torch.utils._pytree.tree_flatten_with_path((args, {}))
    except Exception as e:  # a pytree node without key paths (torchrec's KeyedTensor)
        raise RecfuseError(
            f"cannot capture {fn_name}: torch.fx failed ({fx_error}), and the arguments passed to torch._dynamo.export "
            f"cannot be matched to the inputs of its graph ({e}). Pass plain tensors (e.g. `kt.values()` or "
            f"`kt.to_dict()` instead of a KeyedTensor), or make the code torch.fx can trace.") from None
    paths = tuple(_dynamo_source(names, p) for p, _ in with_paths)
    if len(paths) != len(placeholders) or not all(paths):
        raise RecfuseError(f"cannot capture {fn_name}: torch.fx failed and the inputs of the graph "
                           f"torch._dynamo.export returned could not be matched to forward's arguments")
    texts: list = []
    for g in guards or ():
        kind, codes = g.create_fn_name(), list(getattr(g, "code_list", None) or ())
        if kind == "SHAPE_ENV":
            texts += [c for c in codes if _only_reads_arguments(c, names)]  # not the model's own tensors
        elif kind == "TENSOR_MATCH" and _only_reads_arguments(g.name, names):
            texts += [c for c in codes if c.startswith("str(") or ".ndimension()" in c
                      or (requires_grad_dependent and ".requires_grad ==" in c)]
    if grad is not None:
        texts.append(f"___grad_enabled() == {grad}")
    leaves = [v for _, v in with_paths]
    for path, v in zip(paths, leaves):
        # Python values (`n`, an optional argument left None) are constants of Dynamo's graph
        src = "L" + "".join(f"[{k!r}]" for k in path)
        if v is None or isinstance(v, bool):
            texts.append(f"{src} is {v!r}")
        elif type(v) in (int, float, str):
            texts.append(f"type({src}) is {type(v).__name__} and {src} == {v!r}")
        elif isinstance(v, nn.Module):
            texts.append(f"{src} is None or {src} is ___module({runtime.remember_module_argument(v)!r})")
        elif not isinstance(v, torch.Tensor):
            raise RecfuseError(f"cannot capture {fn_name}: torch.fx failed ({fx_error}), and torch._dynamo.export "
                               f"would bake the {type(v).__name__} argument at {src} into its graph unguarded")
    kept = []
    for text in dict.fromkeys(texts):
        try:
            runtime.check_dynamo_guards(tuple(leaves), paths, (text,), fn_name)
            kept.append(text)
        except Exception:  # a form not understood here: the example's exact metadata instead
            kept = None
            break
    if kept is None:
        kept = []
        for path, t in zip(paths, leaves):
            if isinstance(t, torch.Tensor):
                src = "L" + "".join(f"[{k!r}]" for k in path)
                kept += [f"tuple({src}.shape) == {tuple(t.shape)}", f"{src}.stride() == {t.stride()}",
                         f"str({src}.dtype) == {str(t.dtype)!r}", f"str({src}.device) == {str(t.device)!r}",
                         f"{src}.requires_grad == {t.requires_grad}"]
        kept.append(f"___grad_enabled() == {torch.is_grad_enabled()}")
    if not kept:
        return
    with graph.inserting_after(placeholders[-1] if placeholders else None):
        graph.call_function(runtime.check_dynamo_guards, (tuple(placeholders), paths, tuple(kept), fn_name))
    gm.recompile()


# ---------------------------------------------------------------------------------------------
# copying the model


_ATOMIC = (type(None), bool, int, float, str)
_ATOMIC_TYPES = frozenset(_ATOMIC)
# the keys nn.Module.__setstate__ adds when a state lacks them (old checkpoints)
_MODULE_STATE_KEYS = frozenset({
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_non_persistent_buffers_set", "_is_full_backward_hook", "_backward_pre_hooks"})
_PLAIN_CLASSES: dict[type, bool] = {}


def _plain_module_class(cls: type) -> bool:
    """Whether `copy.deepcopy` of a `cls` instance is nn.Module's default: ``cls.__new__(cls)``,
    then ``__setstate__`` of a deep copy of ``__getstate__()`` (no override of any of them)."""
    ok = _PLAIN_CLASSES.get(cls)
    if ok is None:
        ok = (cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
              and cls.__getstate__ is nn.Module.__getstate__ and cls.__setstate__ is nn.Module.__setstate__
              and getattr(cls, "__deepcopy__", None) is None and cls not in copyreg.dispatch_table
              and not hasattr(cls, "__getnewargs_ex__") and not hasattr(cls, "__getnewargs__"))
        _PLAIN_CLASSES[cls] = ok
    return ok


def _recomputed_by_hook(module: nn.Module, name: str) -> bool:
    """Whether the plain tensor attribute `name` of `module` is recomputed from its parameters by
    a forward pre-hook at each call: ``torch.nn.utils.prune`` (`weight` = `weight_orig` * `weight_mask`)
    and the old ``torch.nn.utils.weight_norm``. Such an attribute is a non-leaf, which
    `copy.deepcopy` refuses ("Only Tensors created explicitly by the user (graph leaves) support the
    deepcopy protocol"): `transform` of a pruned model failed so (red-team rounds 18 and 24). Its
    copy may be a detached clone: the copy's hook replaces it before the forward reads it."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.weight_norm import WeightNorm

    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, BasePruningMethod) and getattr(hook, "_tensor_name", None) == name:
            return True
        if isinstance(hook, WeightNorm) and hook.name == name:
            return True
    return False


def deepcopy_module(module: nn.Module, memo: Optional[dict] = None) -> nn.Module:
    """``copy.deepcopy(module)``, the same result made faster for a model of many small modules.

    `copy.deepcopy` walks every module's ``__dict__`` through its generic reduce protocol
    (about 100 us per LayerNorm; a 10,000-feature model took 1-1.5 s). Here a module whose class
    keeps nn.Module's default copy behaviour is rebuilt directly: ``cls.__new__`` and
    ``__setstate__`` of its state, with atomic values (None, bool, int, float, str) and empty
    dicts/sets recreated as deepcopy would, parameters, buffers and every other value copied by
    `copy.deepcopy` itself, submodules recursively, all through one memo (shared parameters and
    modules stay shared). Any other module is copied by `copy.deepcopy`.

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
        >>> m[1].weight = m[0].bias  # a tied parameter stays tied in the copy
        >>> c = deepcopy_module(m)
        >>> c[1].weight is c[0].bias, c[0].weight is m[0].weight, torch.equal(c[0].weight, m[0].weight)
        (True, False, True)
    """
    if memo is None:
        memo = {}
        _share_storage_in_copy(module, memo)
    get = memo.get
    found = get(id(module), memo)
    if found is not memo:
        return found
    cls = type(module)
    if not _plain_module_class(cls):
        return copy.deepcopy(module, memo)
    new = cls.__new__(cls)
    memo[id(module)] = new
    state = module.__getstate__()  # a new dict: its entries are replaced by their copies
    for k, v in state.items():
        t = type(v)
        if (t is OrderedDict or t is dict or t is set) and not v:
            # most of a module's state: its empty hook dicts (checked first, being the most common)
            y = get(id(v))
            if y is None:
                y = memo[id(v)] = t()
            state[k] = y
            continue
        if t in _ATOMIC_TYPES:
            continue
        y = get(id(v), memo)
        if y is not memo:
            state[k] = y
        elif k == "_modules" and t is dict:
            d = memo[id(v)] = {}
            for name, m in v.items():
                d[name] = None if m is None else deepcopy_module(m, memo)
            state[k] = d
        elif k in ("_parameters", "_buffers") and t is dict:
            d = memo[id(v)] = {}
            for name, x in v.items():
                if type(x) is nn.Parameter:  # nn.Parameter.__deepcopy__, inlined
                    c = get(id(x))
                    if c is None:
                        c = memo[id(x)] = nn.Parameter(x.data.clone(memory_format=torch.preserve_format),
                                                       x.requires_grad)
                    d[name] = c
                else:
                    d[name] = copy.deepcopy(x, memo)
            state[k] = d
        elif t is tuple and all(type(e) in _ATOMIC for e in v):
            continue  # what deepcopy returns for a tuple of atoms
        elif isinstance(v, torch.Tensor) and v.grad_fn is not None and _recomputed_by_hook(module, k):
            state[k] = memo[id(v)] = v.detach().clone()
        else:
            state[k] = copy.deepcopy(v, memo)
    if _MODULE_STATE_KEYS.issubset(state):
        new.__dict__.update(state)  # all nn.Module.__setstate__ does when no key is missing
    else:
        new.__setstate__(state)
    return new


def _share_storage_in_copy(module: nn.Module, memo: dict) -> None:
    """Prepare `memo` so that parameters and buffers of `module` that share storage (a buffer
    registered as ``param.detach()`` or a view of a parameter) share it in the copy too: the
    original sees an in-place update of one (an optimizer step) through the other. Buffers find
    the shared copy of the storage through deepcopy's own storage memo; parameters (whose
    `__deepcopy__` clones) are created here as views of it."""
    groups: dict = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if type(t) not in (torch.Tensor, nn.Parameter) or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st.nbytes():
            groups.setdefault(st._cdata, (st, []))[1].append(t)
    for key, (st, tensors) in groups.items():
        if len(tensors) < 2:
            continue
        copied = memo.setdefault("torch", {}).get(key)
        if copied is None:
            copied = memo["torch"][key] = st.clone()
        for t in tensors:
            if type(t) is nn.Parameter and id(t) not in memo:
                view = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    copied, t.storage_offset(), t.size(), t.stride())
                memo[id(t)] = nn.Parameter(view, t.requires_grad)


def _copy_tensor_hooks(model: nn.Module, copied: nn.Module) -> None:
    """Gradient hooks of the model's parameters and buffers on their deep copies (deepcopy drops
    tensor hooks; a transformed model must still scale, clip or log the same gradients)."""
    originals = list(itertools.chain(model.parameters(), model.buffers()))
    if not any(getattr(t, "_backward_hooks", None) or getattr(t, "_post_accumulate_grad_hooks", None)
               for t in originals):
        return  # the usual case; walking the copy's tensors too took as long again
    for t, c in zip(originals, itertools.chain(copied.parameters(), copied.buffers())):
        if c is t:
            continue  # the original's own tensor (`copy_sharing_leaves`): it has its hooks
        for hook in (getattr(t, "_backward_hooks", None) or {}).values():
            c.register_hook(hook)
        for hook in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values():
            c.register_post_accumulate_grad_hook(hook)


_MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                      "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


def _carry_hooks(root: nn.Module, gm: nn.Module) -> None:
    """Forward hooks registered on the model itself run on the result too (called with it)."""
    for name in _MODULE_HOOK_DICTS:
        hooks = getattr(root, name, None)
        if hooks:
            getattr(gm, name).update(hooks)
    if root._backward_hooks or getattr(root, "_backward_pre_hooks", None):
        raise RecfuseError("the model has full backward hooks (register_full_backward_hook); recfuse.transform "
                           "cannot carry them over. Register them on the transformed module instead.")


def _keep_state(gm: GraphModule, root: nn.Module) -> None:
    """Give `gm` every parameter and buffer of `root` under its original name that the graph does
    not read (`num_batches_tracked`, unused parameters), so the original state_dict loads strictly."""
    have = set(gm.state_dict(keep_vars=True))
    for name, t in itertools.chain(root.named_parameters(), root.named_buffers()):
        if name in have:
            continue
        *path, leaf = name.split(".")
        owner = gm
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        if isinstance(t, nn.Parameter):
            owner.register_parameter(leaf, t)
        else:
            owner.register_buffer(leaf, t)


# ---------------------------------------------------------------------------------------------
# tracing without copying the per-feature leaves
#
# `transform` used to trace a deep copy of the whole model. For a per-feature model most of that
# copy (10,000 LayerNorms and their 20,000 parameters) is pruned by fusion right after the trace,
# and copying it was a tenth of a 10,000-feature transform. Here plain leaf modules of a few
# known classes (`_SHAREABLE_LEAVES`, whose forward reads its parameters and changes nothing) are
# traced as *shallow* copies that hold the original's parameter tensors: new module objects (so
# nothing the trace does to a module reaches the original), the original's tensors (never
# cloned). `transform` clones the ones the fused graph still holds once fusion has pruned the
# rest (`unshare`). Nothing may change those tensors meanwhile:
#
# * the trace's reads of them through the graph (`self.lns[0].weight` in the model's code, a
#   get_attr node) get a private copy (`_ValueTracer._private`), so an in-place update recorded
#   in the graph (`.data.mul_`, `add_` under no_grad) runs on that copy;
# * `_SharedGuard` snapshots their values and metadata before the trace and compares after it:
#   code that reaches the real tensors around the graph (`for p in self.parameters(): ...` in
#   forward) is detected, the original is put back exactly (values, storage, requires_grad,
#   grad, hooks, version counter) and the model is traced again as a full deep copy, as before.

_SHAREABLE_LEAVES = frozenset(c for c in (nn.LayerNorm, nn.Linear, getattr(nn, "RMSNorm", None)) if c is not None)
_EMPTY_STATE_TYPES = (dict, OrderedDict, set)


class _RetryWithCopy(Exception):
    """Capture of a model with shared leaves must be redone on a full copy."""


def _atomic_value(v: Any) -> bool:
    t = type(v)
    return t in _ATOMIC_TYPES or (t is tuple and all(type(e) in _ATOMIC_TYPES for e in v))


def _plain_parameters(params: dict) -> bool:
    """Every parameter a plain strided, materialised `nn.Parameter` without tensor hooks."""
    for p in params.values():
        if p is not None and (type(p) is not nn.Parameter or p.layout is not torch.strided or p.is_meta
                              or p._backward_hooks or p._post_accumulate_grad_hooks):
            return False
    return True


def _shareable_entry(k: str, v: Any) -> bool:
    """Whether a shallow leaf copy may hold `__dict__` entry ``k: v`` as the original does: a
    Python atom, a tuple of atoms, or a ``_parameters`` dict of plain parameters (which the copy
    holds a copy of)."""
    if k == "_parameters" and type(v) is dict:
        return _plain_parameters(v)
    return _atomic_value(v)


def _shallow_leaf(m: nn.Module) -> Optional[nn.Module]:
    """A shallow copy of `m` that holds `m`'s parameters (not cloned), or None when `m` may not be
    traced so: `m` must be of an exact class of `_SHAREABLE_LEAVES` with no hooks of any kind, no
    buffers or submodules, no per-instance forward, nothing but Python atoms (and tuples of them)
    besides its parameters, which are plain strided `nn.Parameter`s without tensor hooks. The
    copy is a new module with `m`'s atoms and fresh empty hook dicts."""
    cls = type(m)
    if cls not in _SHAREABLE_LEAVES:
        return None
    d = m.__dict__
    layout = _LEAF_LAYOUTS.get(cls)
    if layout is not None and layout[0] == tuple(d):
        return _shallow_leaf_like(m, d, layout)
    state = d.copy()
    for k, v in d.items():
        if _shareable_entry(k, v):
            continue
        t = type(v)
        if t not in _EMPTY_STATE_TYPES or v:
            # hooks, buffers, submodules; `forward` bound per instance, tensors, other objects:
            # copied as before
            return None
        state[k] = t()
    if "_parameters" not in state or "training" not in state:
        return None
    if type(state["_parameters"]) is dict:
        state["_parameters"] = state["_parameters"].copy()
    _LEAF_LAYOUTS[cls] = (tuple(d), tuple((k, type(v)) for k, v in d.items() if type(v) in _EMPTY_STATE_TYPES
                                          and k != "_parameters"),
                          tuple(k for k, v in d.items() if type(v) not in _EMPTY_STATE_TYPES or k == "_parameters"))
    new = cls.__new__(cls)
    new.__dict__.update(state)
    return new


_LEAF_LAYOUTS: dict = {}  # class -> (its instances' keys, the empty-container keys and types, the other keys)


def _shallow_leaf_like(m: nn.Module, d: dict, layout: tuple) -> Optional[nn.Module]:
    """`_shallow_leaf` of a module whose `__dict__` has the keys of one it accepted before: the
    same checks and copy, without working out per key what kind of entry it is."""
    _, containers, others = layout
    for k, t in containers:
        v = d[k]
        if type(v) is not t or v:
            return None
    for k in others:
        if not _shareable_entry(k, d[k]):
            return None
    state = d.copy()
    state["_parameters"] = d["_parameters"].copy()
    for k, t in containers:
        state[k] = t()
    new = type(m).__new__(type(m))
    new.__dict__.update(state)
    return new


def _storage_key(t: torch.Tensor) -> Any:
    """The identity of `t`'s storage (None for tensors without one)."""
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout is not torch.strided or t.is_meta:
        return None
    return torch._C._storage_address(t)


def copy_sharing_leaves(model: nn.Module) -> tuple[nn.Module, list, bool, Alone]:
    """``deepcopy_module(model)``, except that the leaves `_shallow_leaf` accepts are shallow
    copies holding the original's parameters (returned in the list, each once). A leaf is
    copied as before when one of its parameters shares storage with another tensor of the model,
    when the model is its own leaf, or while global module hooks are registered. The bool says
    whether a parameter or buffer of the model has gradient hooks or is an uninitialized lazy one,
    or a submodule is scripted (then `_copy_tensor_hooks` and `_refuse_lazy` have work to do). The `plan.Alone` names the
    shallow copies reached once whose parameters are held nowhere else (tie checks skip them).

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.LayerNorm(3), torch.nn.BatchNorm1d(3))
        >>> c, shared, special, alone = copy_sharing_leaves(m)
        >>> c[0] is m[0], c[0].weight is m[0].weight, c[1].weight is m[1].weight, len(shared), special
        (False, True, False, 2, False)
    """
    from .deferred import _global_module_hooks

    if _global_module_hooks():
        return deepcopy_module(model), [], True, None
    shallow: list = []  # (module, its shallow copy, its parameters)
    first_in: dict = {}  # storage key -> id of the first tensor seen in it
    crowded: set = set()  # storage keys holding two or more distinct tensors
    held: set = set()  # ids of the tensors seen
    held_again: set = set()  # ids of tensors held in two or more places
    address = torch._C._storage_address
    special = False
    seen: set = set()
    again: set = set()  # modules reached more than once (their tensors have several names)
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            again.add(id(m))
            continue
        seen.add(id(m))
        d = m.__dict__
        copy_ = _shallow_leaf(m) if m is not model else None
        if copy_ is not None:  # plain strided parameters (`_shallow_leaf` checked), nothing else
            tensors = [p for p in d["_parameters"].values() if p is not None]
            shallow.append((m, copy_, tensors))
            keys = [address(p) for p in tensors]
        else:
            tensors = []
            if isinstance(m, torch.jit.ScriptModule):
                special = True  # `_refuse_lazy` refuses it (a copy's parameters leave its compiled code)
            for t in itertools.chain(d.get("_parameters", {}).values(), d.get("_buffers", {}).values(),
                                     (v for v in d.values() if isinstance(v, torch.Tensor))):
                if t is None:
                    continue
                if (isinstance(t, nn.parameter.UninitializedTensorMixin) or getattr(t, "_backward_hooks", None)
                        or getattr(t, "_post_accumulate_grad_hooks", None)):
                    special = True
                tensors.append(t)
            keys = [_storage_key(t) for t in tensors]
            stack.extend(c for c in d.get("_modules", {}).values() if c is not None)
        for t, key in zip(tensors, keys):
            i = id(t)
            if i in held:
                held_again.add(i)
            else:
                held.add(i)
            if key is not None:
                first = first_in.setdefault(key, i)
                if first != i:
                    crowded.add(key)
    memo: dict = {}
    shared: list = []
    alone_modules, alone_tensors = set(), set()
    for m, copy_, tensors in shallow:
        if crowded and any(address(p) in crowded for p in tensors):
            continue  # a view or alias of another tensor: copied with it, as before
        memo[id(m)] = copy_
        for p in tensors:
            if id(p) not in memo:
                memo[id(p)] = p
                shared.append(p)
        if id(m) not in again and not any(id(p) in held_again for p in tensors):
            alone_modules.add(id(copy_))
            alone_tensors.update(id(p) for p in tensors)
    if crowded:
        _share_storage_in_copy(model, memo)  # what deepcopy_module does with its own memo
    return deepcopy_module(model, memo), shared, special, Alone(frozenset(alone_modules), frozenset(alone_tensors))


def _version_of(t: torch.Tensor) -> int:
    """t's version counter, or -1 for an inference tensor (made under torch.inference_mode), which
    keeps none: its changes show in `_SharedGuard`'s value comparison alone."""
    return -1 if t.is_inference() else t._version


class _SharedGuard:
    """What could change the original's tensors that a trace shares (see the section comment),
    checked after the trace: `changed()` says whether anything did, `restore()` puts it back
    (a tensor whose storage was swapped gets its own storage back, holding its old values)."""

    def __init__(self, tensors: list):
        self.tensors = tensors
        self.meta = [(_version_of(t), t.requires_grad, t.data_ptr(), t.shape, t.grad, t._backward_hooks,
                      t._post_accumulate_grad_hooks) for t in tensors]  # as `changed` reads them
        self.layout = [(t.stride(), t.storage_offset(), t.untyped_storage()) for t in tensors]
        self.groups: dict = {}  # (dtype, device, 1-D) -> indices into `tensors`
        keys = [(t.dtype, t.device, t.dim() == 1) for t in tensors]
        if keys and keys.count(keys[0]) == len(keys):
            self.groups[keys[0]] = list(range(len(keys)))
        else:
            for i, key in enumerate(keys):
                self.groups.setdefault(key, []).append(i)
        # 1-D tensors are concatenated as they are (`changed` checks their shapes first)
        self.flat_lists = [[tensors[i] for i in idx] if key[2] else None for key, idx in self.groups.items()]
        self.values = self._flat()

    def _flat(self) -> list:
        ts = self.tensors
        with torch.no_grad(), _one_thread():  # cat of 20,000 small tensors: 5 ms on one thread, 20 on two
            return [torch.cat(flat if flat is not None else [ts[i].reshape(-1) for i in idx]).view(torch.uint8)
                    for idx, flat in zip(self.groups.values(), self.flat_lists)]

    def changed(self) -> bool:
        try:  # tuples compare their entries by identity first: a replaced grad or hook dict differs
            if [(_version_of(t), t.requires_grad, t.data_ptr(), t.shape, t.grad, t._backward_hooks,
                 t._post_accumulate_grad_hooks) for t in self.tensors] != self.meta:
                return True
        except Exception:  # a tensor compared with another (a grad replaced): changed
            return True
        try:
            now = self._flat()
        except Exception:
            return True
        return not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(now, self.values))

    def restore(self) -> None:
        with torch.no_grad():
            for (dtype, device, _), idx, flat in zip(self.groups, self.groups.values(), self.values):
                start = 0
                for i in idx:
                    t = self.tensors[i]
                    version, requires_grad, ptr, shape, grad, hooks, post = self.meta[i]
                    stride, offset, storage = self.layout[i]
                    n = shape.numel()
                    saved = flat.view(dtype)[start:start + n].view(shape)
                    start += n
                    if (t.data_ptr(), t.dtype, t.shape, t.stride(), t.storage_offset()) != (
                            ptr, dtype, shape, stride, offset):
                        t.data = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)
                    t.data.copy_(saved)
                    if t.requires_grad != requires_grad:
                        t.requires_grad_(requires_grad)
                    if t.grad is not grad:
                        t.grad = grad
                    if t._backward_hooks is not hooks:
                        t._backward_hooks = hooks
                    if t._post_accumulate_grad_hooks is not post:
                        t._post_accumulate_grad_hooks = post
                    if version >= 0 and t._version != version:
                        torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def unshare(gm: nn.Module, shared: list, extra: Optional[dict] = None) -> None:
    """Replace, in `gm` (and in `extra`, name -> (tensor, persistent)), every tensor of `shared`
    (the original's, from `copy_sharing_leaves`) by a copy of its own, as deepcopy would have
    made it: one copy per tensor (tied parameters stay tied), gradient hooks carried over."""
    ids = {id(t) for t in shared}
    copies: dict = {}

    def fresh(t):
        c = copies.get(id(t))
        if c is None:
            c = copies[id(t)] = copy.deepcopy(t)
            for hook in (getattr(t, "_backward_hooks", None) or {}).values():
                c.register_hook(hook)
            for hook in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values():
                c.register_post_accumulate_grad_hook(hook)
        return c

    for m in gm.modules():
        for store in (m._parameters, m._buffers):
            for k, t in store.items():
                if t is not None and id(t) in ids:
                    store[k] = fresh(t)
        for k, v in m.__dict__.items():
            if isinstance(v, torch.Tensor) and id(v) in ids:
                m.__dict__[k] = fresh(v)
    if extra:
        for name, (t, persistent) in extra.items():
            if id(t) in ids:
                extra[name] = (fresh(t), persistent)
    # No tensor of the result may alias one of the original's: fusion only adds stacked copies.
    keys = {_storage_key(t) for t in shared} - {None}
    for m in gm.modules():
        for t in itertools.chain(m._parameters.values(), m._buffers.values()):
            if t is not None and (id(t) in ids or _storage_key(t) in keys):
                raise RecfuseError("internal: the transformed module still shares a tensor with the original model")
