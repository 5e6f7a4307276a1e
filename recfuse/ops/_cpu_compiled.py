"""CPU fast path: the op's forward and backward compiled by Inductor (C++), per parameter variant.

On CPU tensors the op's plain eager calls (`recfuse.ln_tanh_linear_relu`, and so a transformed
model and `FusedFeatureProcessor`, which call it) run ``torch.compile`` of three small torch
functions, one set per variant: which of bias / ln_weight / ln_bias are present, each shared or
per feature, shared or per-feature weight, its [H, D], eps, feature_dim and the dtype.

* inference forward: x -> y. For a narrow Linear (H <= `SMALL_H`) the matmul is written as a
  broadcast-multiply-sum, so Inductor emits one C++ loop over rows: each row of x is read once,
  normalised, tanh'd and reduced against the weight in cache; nothing of size [F, B, D] is written.
* training forward: the same, also returning what the backward needs: the float32 tanh output
  t ([F, B, D]), the rows' mean and rstd and the relu mask. On a CPU tanh is most of the
  forward's time, so the backward reads t instead of recomputing it (the GPU kernels recompute:
  there memory traffic is the cost).
* backward: the five gradients from grad_y, x and those saved tensors; nothing is recomputed.

Sizes: F and B are dynamic (marked on a variant's first call), D and H static (part of the
variant), so the loops over a row have constant trip counts and a new F or B reuses the code
(sizes 0 and 1 are specialised and compile once more). Inputs are passed detached, so
requires_grad (inference, frozen parameters) never compiles again. Low-precision inputs are
computed in float32 and y cast back (the numerics contract of the eager composite and the
kernels); NaN where the eager composite has NaN; no atomics, so results are deterministic.

First-call cost (2-core AMD EPYC, idle machine): ~6 s for a variant's first compile in a fresh
process with an empty Inductor cache (about half of it is Dynamo/Inductor's own start in the
process), ~3 s for each further graph of the variant; a later process reads the compiled code
from Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_$USER``)
in ~0.5-2.5 s; a new F or B of a compiled variant costs nothing. `INDUCTOR_OPTIONS` keeps it low.
benchmarks/results/split_stack_vs_combined_cpu.txt has the measured numbers.

Calls without Dynamo (`_DirectCalls`): a ``torch.compile``'d function costs ~33 us of Dynamo's
frame evaluation, guard check and wrappers per call (F=4 B=8 D=64 on one thread: 50 us a call,
17 us for the compiled graph itself), more than the kernel at small shapes. So once Dynamo has run
a call, the graph it ran is kept under the call's exact signature (shapes, strides, dtypes,
devices of every argument, and the variant), and later calls with that signature call the graph
directly: the graph Dynamo would pick for them, as its guards are a function of that signature
(inputs are detached, so requires_grad and the grad mode change nothing the graph computes).
Inductor's code still checks sizes and strides of its inputs on every call.

When a compile fails (no C++ compiler, an Inductor error) the variant falls back to the eager
composite for the rest of the process, with one warning; a second backward through a retained
graph (the saved tensors are consumed by the first) runs the eager composite backward. The
custom op's own implementation (what torch.compile, export and ``torch.ops.recfuse...`` calls
run) stays on the eager composite, so that tracing and fake tensors see plain torch code.

Switch (``compiled`` is the default: it is faster than ``torch.compile`` of the batched
composite at the benchmark's CPU shapes, forward and training step):

* ``RECFUSE_CPU_BACKEND=compiled|eager`` in the environment, read at import;
* ``recfuse.ops.set_cpu_backend("eager")`` (returns the previous setting);
* ``with recfuse.ops.cpu_backend("eager"): ...`` (restores the previous setting on exit).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import types
import warnings
from typing import Any, Callable, Optional, Union

import torch

__all__ = ["set_cpu_backend", "get_cpu_backend", "cpu_backend", "CPU_BACKENDS"]

log = logging.getLogger(__name__)

CPU_BACKENDS = ("compiled", "eager")
_ENV = "RECFUSE_CPU_BACKEND"
_DEFAULT_BACKEND = "compiled"

_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _backend_from_env() -> str:
    value = os.environ.get(_ENV, _DEFAULT_BACKEND).strip().lower() or _DEFAULT_BACKEND
    if value not in CPU_BACKENDS:
        warnings.warn(f"{_ENV}={value!r} is not one of {CPU_BACKENDS}; using {_DEFAULT_BACKEND!r}", stacklevel=2)
        return _DEFAULT_BACKEND
    return value


class _State(threading.local):
    # Per thread, so that a context manager in one thread does not switch another; a new thread
    # starts from the process-wide default (the environment variable or set_cpu_backend's value).
    def __init__(self):
        self.backend = _DEFAULT[0]
        self.dynamo_backend = _DEFAULT[1]


_DEFAULT: list = [_backend_from_env(), "inductor"]
_STATE = _State()


def get_cpu_backend() -> str:
    """The CPU backend of the op in this thread: ``"compiled"`` or ``"eager"``."""
    return _STATE.backend


def set_cpu_backend(backend: str, *, dynamo_backend: Union[str, Callable] = "inductor") -> str:
    """Choose how CPU tensors run the op: ``"compiled"`` (Inductor C++, the default) or ``"eager"``.

    Sets the process-wide default and this thread's setting; returns the previous backend.
    ``dynamo_backend`` is the ``torch.compile`` backend of the compiled path (tests pass one that
    raises, to exercise the eager fallback).

    Example:
        >>> import recfuse
        >>> previous = recfuse.ops.set_cpu_backend("eager")
        >>> _ = recfuse.ops.set_cpu_backend(previous)
    """
    if backend not in CPU_BACKENDS:
        raise ValueError(f"cpu backend must be one of {CPU_BACKENDS}, got {backend!r}")
    previous = _STATE.backend
    _DEFAULT[0], _DEFAULT[1] = backend, dynamo_backend
    _STATE.backend, _STATE.dynamo_backend = backend, dynamo_backend
    return previous


@contextlib.contextmanager
def cpu_backend(backend: str, *, dynamo_backend: Union[str, Callable] = "inductor"):
    """Context manager: run the op's CPU path with `backend` (``"compiled"`` or ``"eager"``) in
    this thread, restoring the previous setting on exit.

    Example:
        >>> import torch, recfuse
        >>> with recfuse.ops.cpu_backend("eager"):
        ...     y = recfuse.ln_tanh_linear_relu(torch.randn(2, 3, 4), torch.randn(1, 4))
    """
    if backend not in CPU_BACKENDS:
        raise ValueError(f"cpu backend must be one of {CPU_BACKENDS}, got {backend!r}")
    saved = (_STATE.backend, _STATE.dynamo_backend)
    _STATE.backend, _STATE.dynamo_backend = backend, dynamo_backend
    try:
        yield
    finally:
        _STATE.backend, _STATE.dynamo_backend = saved


# ---------------------------------------------------------------------------------------------
# compiled functions, one per variant

_FAILED = object()
_CACHE: dict = {}
_LOCK = threading.Lock()


def _kind(t: Optional[torch.Tensor], per_feature_ndim: int):
    if t is None:
        return None
    return ("F" if t.dim() == per_feature_ndim else "S", t.dtype)


def _fresh_code(fn: Callable, name: str) -> Callable:
    """A copy of `fn` with its own code object: Dynamo keeps its compiled entries (and counts its
    recompile limit) per code object, so each variant gets its own."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _per_feature(p: Optional[torch.Tensor], compute: torch.dtype, feature_dim: int = 0) -> Optional[torch.Tensor]:
    """A [F, K] parameter broadcast over B: [F, 1, K] against [F, B, K] (feature_dim 0), as it is
    against [B, F, K] (feature_dim 1); a shared [K] one as it is."""
    if p is None:
        return None
    p = p.to(compute)
    return p.unsqueeze(1) if p.dim() == 2 and feature_dim == 0 else p


# At or below this many outputs the Linear is written as broadcast-multiply-sum over D (or H),
# which Inductor fuses into the row's loop (x read once, nothing of size [F, B, D] written but
# what the backward keeps); above it, a matmul (Inductor calls the BLAS one).
SMALL_H = 8


def _linear(t: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], feature_dim: int = 0) -> torch.Tensor:
    """z = t @ w.T + b on t [F, B, D] (feature_dim 0) or [B, F, D] (1); w [H, D] or [F, H, D];
    b as `_per_feature` gives it."""
    if w.shape[-2] <= SMALL_H:
        wb = w.unsqueeze(1) if w.dim() == 3 and feature_dim == 0 else w   # [F, 1, H, D], [F, H, D] or [H, D]
        z = (t.unsqueeze(-2) * wb).sum(-1)
    elif w.dim() == 3:
        tf = t if feature_dim == 0 else t.transpose(0, 1)
        z = torch.bmm(tf, w.transpose(1, 2))
        z = z if feature_dim == 0 else z.transpose(0, 1)
    else:
        z = torch.matmul(t, w.t())
    return z if b is None else z + b


def _row_sum(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Sum of g [F, B, ...] over B, and over F too where the parameter p is shared, accumulated
    in float64. float64 on purpose: Inductor guards a float32 sum over more than 4096 elements
    (it switches to a cascade accumulator there), so float32 sums over the dynamic rows would
    compile the backward again the first time F*B crosses 4096; a float64 sum has no such
    guard, and is at least as accurate."""
    per_feature = p.dim() == g.dim() - 1     # [F, K] / [F, H, D] parameters keep F
    return g.sum(1 if per_feature else (0, 1), dtype=torch.float64)


def _linear_backward(dz: torch.Tensor, t: torch.Tensor, w: torch.Tensor):
    """(dt, gw) of z = t @ w.T: dt = dz @ w [F, B, D], gw = dz.T @ t ([H, D] or [F, H, D])."""
    if w.shape[-2] <= SMALL_H:
        wb = w.unsqueeze(1) if w.dim() == 3 else w
        dt = (dz.unsqueeze(-1) * wb).sum(-2)
        outer = dz.unsqueeze(-1) * t.unsqueeze(-2)              # [F, B, H, D], fused into its sum
        return dt, _row_sum(outer, w)
    if w.dim() == 3:
        return torch.bmm(dz, w), torch.bmm(dz.transpose(1, 2), t)
    H, D = w.shape
    return torch.matmul(dz, w), torch.matmul(dz.reshape(-1, H).t(), t.reshape(-1, D))


def _make_forward(eps: float, feature_dim: int, save: bool, y_transposed: bool = False) -> Callable:
    """y, or with `save` (y, t, mean, rstd, mask): t = the float32 tanh output [F, B, D], the
    rows' LayerNorm statistics [F, B, 1] and z > 0 [F, B, H], what `_make_backward` reads
    instead of recomputing them."""

    def features_first(v):
        return v if feature_dim == 0 else v.transpose(0, 1)

    def forward(x, weight, bias, ln_weight, ln_bias):
        # In x's own layout: rows are visited in memory order ([B, F, D] walked F-first reads
        # 64-float rows 16 KB apart: the forward was 0.94x torch.compile(combined) at
        # F=64 B=4096 D=64, 1.05x in x's order).
        out_dtype = x.dtype
        compute = _compute_dtype(x.dtype)
        xf = x.to(compute)
        D = x.shape[-1]
        # Statistics of the rows shifted by their first element: a constant row (one value c in
        # all D columns) is then exactly 0, its mean exactly c and its variance 0, as the eager
        # composite gives. Inductor's var_mean of the unshifted row left its mean a few ulps off
        # c, which rstd = eps**-0.5 carried into h (red-team round 13: y 2.5e-4 off float64 at
        # c = 1000.1, D=24 H=1; finite rows where the reference gives NaN at eps = 0).
        pivot = xf[..., :1]
        xs = xf - pivot
        var, shift = torch.var_mean(xs, dim=-1, keepdim=True, correction=0)
        mean = pivot + shift
        # NaN where the float32 variance overflowed (rows near 1e19 and up), as the kernels and
        # the eager composite give, not rstd = 0 and a silently finite row.
        rstd = torch.where(torch.isinf(var), float("nan"), torch.rsqrt(var + eps))
        h = (xs - shift) * rstd
        lw, lb = _per_feature(ln_weight, compute, feature_dim), _per_feature(ln_bias, compute, feature_dim)
        if lw is not None:
            h = h * lw
        if lb is not None:
            h = h + lb
        t = torch.tanh(h)
        z = _linear(t, weight.to(compute), _per_feature(bias, compute, feature_dim), feature_dim)
        y = torch.relu(z).to(out_dtype)
        # y_transposed: x came as the transposed view of the caller's (`forward`); y is stored
        # in the caller's dims by this loop, not copied after it.
        y = (y.transpose(0, 1) if y_transposed else y).contiguous()
        if save:  # the backward works features first
            return y, features_first(t), features_first(mean), features_first(rstd), features_first(~(z <= 0))
        return y

    return forward


def _make_backward(eps: float, feature_dim: int) -> Callable:
    """The five gradients from grad_y, x, the forward's saved t/mean/rstd/mask and the parameters.

    Nothing of the forward is recomputed: no LayerNorm statistics, no tanh (most of the forward's
    time on a CPU), no z."""

    def backward(grad_y, x, t, mean, rstd, mask, weight, bias, ln_weight, ln_bias):
        compute = _compute_dtype(x.dtype)
        xf = x.to(compute)
        gy = grad_y.to(compute)
        if feature_dim == 1:
            xf, gy = xf.transpose(0, 1), gy.transpose(0, 1)
        # rstd is NaN where the variance overflowed (the forward saved it so), as the kernels and
        # the eager composite backward give. rstd == 0 is not that: eps=inf gives rstd = 0 and the
        # reference's finite dx = 0 (it was turned into NaN here).
        xhat = (xf - mean) * rstd
        dz = torch.where(mask, gy, torch.zeros((), dtype=compute))
        dt, gw = _linear_backward(dz, t, weight.to(compute))
        da = dt * (1 - t * t)

        def reduce_param(g, p):  # sum over B, and over F when the parameter is shared
            if p is None:
                return x.new_empty((0,))
            return _row_sum(g, p).to(p.dtype)

        gb = reduce_param(dz, bias)
        glw = reduce_param(da * xhat, ln_weight)
        glb = reduce_param(da, ln_bias)
        lw = _per_feature(ln_weight, compute)
        dxhat = da if lw is None else da * lw
        gx = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        # In x's layout (x is usually contiguous in it), so that no copy follows.
        gx = (gx if feature_dim == 0 else gx.transpose(0, 1)).to(x.dtype).contiguous()
        return gx, gw.to(weight.dtype), gb, glw, glb

    return backward


# Inductor options of the compiled path (first-call time on a 2-core machine):
# * compile_threads=1: compile the one C++ kernel in this process; a pool of compile workers
#   (the default, one per core) costs seconds to start and has nothing to run in parallel.
# * pattern_matcher=False: none of Inductor's pattern rewrites applies to this graph, and
#   building their tables is ~1 s of the first compile in a process.
INDUCTOR_OPTIONS = {"compile_threads": 1, "pattern_matcher": False, "cpp.vec_isa_ok": True}

# "_t": the same function on a transposed x (`forward`).
_WHAT = {"fwd": "forward", "fwd_save": "training forward", "bwd": "backward"}


def _compiled(which: str, key: tuple, dynamo_backend) -> Any:
    full_key = (which, dynamo_backend, key)
    fn = _CACHE.get(full_key)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(full_key)
            if fn is None:
                eps, feature_dim = key[0], key[1]
                if which == "bwd":
                    plain = _make_backward(eps, feature_dim)
                else:
                    plain = _make_forward(eps, feature_dim, save=which.startswith("fwd_save"),
                                          y_transposed=which.endswith("_t"))
                plain = _fresh_code(plain, f"recfuse_cpu_{which}_{len(_CACHE)}")
                # dynamic=None: sizes are static unless marked (`_mark_dynamic`): F and B are
                # marked on the first call, D and H (the parameters' shapes) stay static, so the
                # C++ loops over a row have constant trip counts, as torch.compile of a fixed
                # shape gives. A new F or B reuses the code.
                fn = torch.compile(plain, dynamic=None, backend=_RecordingBackend(dynamo_backend))
                fn = _FirstCall(fn)
                _CACHE[full_key] = fn
    return fn


class _FirstCall:
    """A compiled function that marks the batch dims of its first call's inputs dynamic."""

    __slots__ = ("fn", "called")

    def __init__(self, fn):
        self.fn, self.called = fn, False

    def __call__(self, *args):
        if not self.called:
            _mark_dynamic(args)
            self.called = True
        return self.fn(*args)


def _mark_dynamic(args) -> None:
    """F and B dynamic: dims 0 and 1 of 3D tensors (x, grad_y, t, mean, rstd, a per-feature
    weight's F), dim 0 of 2D ones (per-feature bias / LayerNorm parameters). Sizes 0 and 1 stay
    specialised (Dynamo's rule), so those compile once more if they come."""
    for t in args:
        if isinstance(t, torch.Tensor):
            dims = (0, 1) if t.dim() == 3 else (0,) if t.dim() == 2 else ()
            for d in dims:
                if t.shape[d] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, d)


def _variant(x, weight, bias, ln_weight, ln_bias, eps, feature_dim) -> Optional[tuple]:
    """The variant key, or None where the compiled path does not apply (eager composite)."""
    if _STATE.backend != "compiled" or x.dtype not in _LOW_PRECISION or x.numel() == 0:
        return None
    if weight.numel() == 0:  # H == 0 or D == 0: nothing to compile
        return None
    return (float(eps), int(feature_dim), x.dtype, _kind(weight, 3), _kind(bias, 2),
            _kind(ln_weight, 2), _kind(ln_bias, 2), tuple(weight.shape[-2:]))


def _run(which: str, key: tuple, args: tuple, signature=None, transposed: bool = False):
    """The compiled function's output on `args`, or None where the variant falls back to eager.

    `signature`: the call's exact signature (see `_DirectCalls`); given, the graph Dynamo runs for
    it is kept, so that the next call with this signature skips Dynamo. `transposed`: `args` hold
    the caller's x (and grad_y) with dims 0 and 1 swapped (`_swapped`)."""
    fn = _compiled(which, key, _STATE.dynamo_backend)
    if fn is _FAILED:
        return None
    # Detached: requires_grad is part of Dynamo's guards, and the compiled functions never build
    # an autograd graph (the op's autograd.Function runs `backward`), so a frozen parameter or an
    # inference call must not compile again.
    args = tuple(None if a is None else a.detach() for a in args)
    try:
        if signature is None:
            return fn(*args)
        with _RecordingBackend.recording() as calls:
            out = fn(*args)
        _DIRECT.learn(signature, args, out, calls, transposed)
        return out
    except Exception as e:  # noqa: BLE001 - any compile failure: the eager composite instead
        _CACHE[(which, _STATE.dynamo_backend, key)] = _FAILED
        warnings.warn(
            f"recfuse: compiling the CPU {_WHAT[which.removesuffix('_t')]} failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); using the eager "
            f"composite for this variant. Set {_ENV}=eager to skip compiling.",
            RuntimeWarning, stacklevel=3)
        log.debug("recfuse CPU compile failure", exc_info=True)
        return None


# ---------------------------------------------------------------------------------------------
# calling a compiled graph without Dynamo


class _RecordingBackend:
    """The Dynamo backend of the compiled path (Inductor with `INDUCTOR_OPTIONS`, or the backend
    `set_cpu_backend` names), whose compiled graphs note each call in this thread's recording
    (`recording`): which graph ran, on which arguments, with which outputs. `_DirectCalls` learns
    from that how to call the graph without Dynamo."""

    _local = threading.local()

    def __init__(self, backend):
        if backend == "inductor":
            # What torch.compile(backend="inductor", options=INDUCTOR_OPTIONS) builds.
            self.backend = torch._TorchCompileInductorWrapper(None, dict(INDUCTOR_OPTIONS), None)
        else:
            from torch._dynamo.backends.registry import lookup_backend

            self.backend = lookup_backend(backend)
        self.__name__ = getattr(self.backend, "compiler_name", getattr(backend, "__name__", str(backend)))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        compiled = self.backend(gm, example_inputs)
        return _RecordedGraph(compiled, _size_sources(gm))

    def get_compiler_config(self):
        get = getattr(self.backend, "get_compiler_config", None)
        return get() if get is not None else None

    def reset(self):
        reset = getattr(self.backend, "reset", None)
        if reset is not None:
            reset()

    @classmethod
    @contextlib.contextmanager
    def recording(cls):
        """A list that collects (graph, args, outputs) of every compiled graph called inside."""
        saved = getattr(cls._local, "calls", None)
        cls._local.calls = calls = []
        try:
            yield calls
        finally:
            cls._local.calls = saved


def _size_sources(gm: torch.fx.GraphModule) -> Optional[tuple]:
    """Per placeholder of a Dynamo graph: None for a tensor; for a SymInt (a dynamic F or B, or a
    stride made of them: a transposed grad_y's), (placeholder index, dim, is_stride) of a tensor
    whose size or stride it is. None overall where one cannot be found."""
    values = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    tensors = [(j, t) for j, t in enumerate(values) if isinstance(t, torch.Tensor)]
    sources = []
    for v in values:
        if isinstance(v, torch.Tensor):
            sources.append(None)
            continue
        if not isinstance(v, torch.SymInt):
            return None
        found = next(((j, d, is_stride) for is_stride in (False, True) for j, t in tensors
                      for d, size in enumerate(t.stride() if is_stride else t.shape)
                      if isinstance(size, torch.SymInt) and size.node.expr == v.node.expr), None)
        if found is None:
            return None
        sources.append(found)
    return tuple(sources)


class _RecordedGraph:
    """A compiled graph as Dynamo calls it (positional graph inputs), noting its calls while a
    `_RecordingBackend.recording` is open in this thread."""

    __slots__ = ("compiled", "size_sources")

    def __init__(self, compiled, size_sources):
        self.compiled, self.size_sources = compiled, size_sources

    def __call__(self, *args):
        out = self.compiled(*args)
        calls = getattr(_RecordingBackend._local, "calls", None)
        if calls is not None:
            calls.append((self, args, out))
        return out


class _DirectCall:
    """One learned call: the graph, where each graph input comes from ((argument index, None, False)
    for an argument, (index, dim, is_stride) for a size or stride of one), where each element of the function's result is among the graph's outputs, and whether
    the caller's x is passed transposed (`_swapped`)."""

    __slots__ = ("compiled", "inputs", "outputs", "transposed")

    def __init__(self, compiled, inputs, outputs, transposed):
        self.compiled, self.inputs, self.outputs, self.transposed = compiled, inputs, outputs, transposed

    def __call__(self, args: tuple):
        out = self.compiled(*[args[i] if d is None else args[i].stride(d) if is_stride else args[i].shape[d]
                              for i, d, is_stride in self.inputs])
        outputs = self.outputs
        return out[outputs] if type(outputs) is int else tuple(out[k] for k in outputs)


class _DirectCalls:
    """Exact call signature -> `_DirectCall`, learned from the call Dynamo ran for it.

    A signature is kept only when Dynamo ran exactly one compiled graph for the call, every graph
    input is an argument (by identity) or a size of one (by the graph's symbols), and every tensor
    the function returned is one of the graph's outputs (by identity); otherwise that signature
    keeps going through Dynamo. Bounded: past `limit` signatures it starts over."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.calls: dict = {}

    def get(self, signature):
        return self.calls.get(signature)

    def learn(self, signature, args: tuple, result, calls: list, transposed: bool) -> None:
        if len(calls) != 1:
            return
        graph, graph_args, graph_out = calls[0]
        if graph.size_sources is None or not isinstance(graph_out, (tuple, list)):
            return
        position = {id(a): i for i, a in enumerate(args) if a is not None}
        inputs = []
        for a, source in zip(graph_args, graph.size_sources):
            if source is None:
                if id(a) not in position:
                    return
                inputs.append((position[id(a)], None, False))
            else:
                tensor = graph_args[source[0]]
                if id(tensor) not in position:
                    return
                j, d, is_stride = position[id(tensor)], source[1], source[2]
                if (args[j].stride(d) if is_stride else args[j].shape[d]) != a:  # as Dynamo passed it
                    return
                inputs.append((j, d, is_stride))
        produced = {id(t): k for k, t in enumerate(graph_out)}
        if isinstance(result, torch.Tensor):
            outputs = produced.get(id(result))
        elif isinstance(result, tuple) and all(id(t) in produced for t in result):
            outputs = tuple(produced[id(t)] for t in result)
        else:
            outputs = None
        if outputs is None:
            return
        if len(self.calls) >= self.limit:
            self.calls.clear()
        self.calls[signature] = _DirectCall(graph.compiled, tuple(inputs), outputs, transposed)

    def forget(self, signature) -> None:
        self.calls.pop(signature, None)

    def clear(self) -> None:
        self.calls.clear()


_DIRECT = _DirectCalls()


def _direct(signature, call: _DirectCall, args: tuple):
    """The learned graph's output on `args` (already transposed where `call.transposed`), or None
    (then the caller goes through Dynamo)."""
    try:
        return call(args)
    except Exception:  # noqa: BLE001 - not expected (Inductor checks sizes/strides): back to Dynamo
        log.debug("recfuse direct call failed; going through Dynamo", exc_info=True)
        _DIRECT.forget(signature)
        return None


class Saved(tuple):
    """What the compiled training forward keeps for the compiled backward: (t, mean, rstd, z > 0)."""

    __slots__ = ()


def _swapped(x: torch.Tensor) -> bool:
    """Whether x's dims 0 and 1 are the other way round in memory (a [B, F, D] buffer seen as
    [F, B, D], as `transform`'s graphs pass it): the compiled loops walk dims in order, so they
    run on the transposed view, which visits the rows in memory order (F=16 B=256 D=64, one
    thread: 813 -> ~660 us for `transform`'s forward); y is stored in x's dims by the same loop."""
    return x.dim() == 3 and x.shape[0] > 1 and x.shape[1] > 1 and x.stride(0) < x.stride(1)


def forward(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save=False, key=None):
    """The compiled composite's y, or None where the caller should run the eager composite.

    With ``save``: (y, saved) where saved is a `Saved` (the float32 tanh output and the rows'
    LayerNorm statistics) for `backward`, or None (then `backward` recomputes everything).
    y is contiguous, as the eager composite and the kernels give it.

    ``key``: the op's call signature (`recfuse._checks.call_signature`: every argument's shape,
    strides, dtype and device, eps and feature_dim); with it, a call seen before skips Dynamo.
    """
    signature = None
    if key is not None and _STATE.backend == "compiled":
        signature = ("fwd", save, _STATE.dynamo_backend, key)
        call = _DIRECT.get(signature)
        if call is not None:
            out = _direct(signature, call, (x.transpose(0, 1) if call.transposed else x,
                                            weight, bias, ln_weight, ln_bias))
            if out is not None:
                return (out[0], Saved(out[1:])) if save else out
    transposed = _swapped(x)
    if transposed:  # computed on the view in memory order; y written back in x's dims
        x, feature_dim = x.transpose(0, 1), 1 - feature_dim
    variant = _variant(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    if variant is None:
        return None
    which = ("fwd_save" if save else "fwd") + ("_t" if transposed else "")
    out = _run(which, variant, (x, weight, bias, ln_weight, ln_bias), signature, transposed)
    if out is None or not save:
        return out
    return out[0], Saved(out[1:])


def backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, saved=None, key=None) -> Optional[tuple]:
    """The five gradients (as `composite_backward` returns them), or None (eager instead).

    Needs the `Saved` tensors of the compiled training forward; without them (a second backward
    through a retained graph) the caller runs the eager composite backward.
    ``key``: the forward's call signature (see `forward`), which fixes the saved tensors' too;
    with it and grad_y's layout, a call seen before skips Dynamo.
    """
    if not isinstance(saved, Saved):
        return None
    signature = None
    if key is not None and _STATE.backend == "compiled":
        signature = ("bwd", _STATE.dynamo_backend, key, grad_y.shape, grad_y.stride(), grad_y.dtype)
        call = _DIRECT.get(signature)
        if call is not None:
            if call.transposed:
                out = _direct(signature, call, (grad_y.transpose(0, 1), x.transpose(0, 1), *saved,
                                                weight, bias, ln_weight, ln_bias))
                if out is not None:
                    return (_gradients_in_x_layout(out[0], x.transpose(0, 1)).transpose(0, 1),) + tuple(out[1:])
            else:
                out = _direct(signature, call, (grad_y, x, *saved, weight, bias, ln_weight, ln_bias))
                if out is not None:
                    return (_gradients_in_x_layout(out[0], x),) + tuple(out[1:])
    if _swapped(x):  # as `forward` ran it
        out = _backward_in_order(grad_y.transpose(0, 1), x.transpose(0, 1), weight, bias, ln_weight, ln_bias,
                                 eps, 1 - feature_dim, saved, signature, True)
        return None if out is None else (out[0].transpose(0, 1),) + tuple(out[1:])
    return _backward_in_order(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, saved, signature, False)


def _backward_in_order(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, saved, signature, transposed):
    """`backward` on x (and grad_y) in memory order; `transposed`: they are the caller's, swapped."""
    variant = _variant(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    if variant is None or grad_y.dtype != x.dtype:
        return None
    out = _run("bwd", variant, (grad_y, x, *saved, weight, bias, ln_weight, ln_bias), signature, transposed)
    if out is None:
        return None
    return (_gradients_in_x_layout(out[0], x),) + tuple(out[1:])


def _gradients_in_x_layout(gx, x):
    """dx with x's strides, as the eager composite's and the kernel's dx."""
    if not (x.is_contiguous() and gx.is_contiguous()):
        like_x = torch.empty_like(x)
        if gx.stride() != like_x.stride():
            gx = like_x.copy_(gx)
    return gx


def clear_cache() -> None:
    """Forget the compiled functions (and failures) of this process (tests)."""
    with _LOCK:
        _CACHE.clear()
        _DIRECT.clear()
