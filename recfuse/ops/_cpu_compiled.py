"""CPU fast path: the batched composite (forward) and the analytic backward, compiled by Inductor.

On CPU tensors the op's plain eager calls run ``torch.compile`` (Inductor's C++ codegen) of
`reference.batched_ln_tanh_linear_relu` and of the analytic backward `_composite_backward`,
one compiled function per parameter-kind variant: which of bias / ln_weight / ln_bias are present,
each shared or per feature, shared or per-feature weight, feature_dim, eps and the dtypes. Each
is compiled with ``dynamic=True``, so a new shape of a compiled variant reuses its code (sizes 0
and 1 are specialised by Dynamo and compile once more); Inductor's on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_$USER``) makes a later process's first
call cheap. Low-precision inputs are upcast inside the compiled functions (float32 accumulation,
as on the eager composite and the Triton kernels).

When a compile fails (no C++ compiler, an Inductor error) the variant falls back to the eager
composite for the rest of the process, with one warning. The fast path is used only for real
tensors on the eager path of `recfuse.ln_tanh_linear_relu` (inference, and the forward/backward
of its autograd.Function); the custom op's own implementation (what torch.compile, export and
``torch.ops.recfuse...`` calls run) stays on the eager composite.

Switch (``eager`` is the default for now: the first call of a variant compiles for ~10-13 s on a
2-core machine, over the 10 s budget, and the CPU benchmark has not yet shown the compiled path
against `torch.compile(combined)`; opt in with ``compiled``):

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

_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _backend_from_env() -> str:
    value = os.environ.get(_ENV, "eager").strip().lower() or "eager"
    if value not in CPU_BACKENDS:
        warnings.warn(f"{_ENV}={value!r} is not one of {CPU_BACKENDS}; using 'eager'", stacklevel=2)
        return "eager"
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
    """Choose how CPU tensors run the op: ``"compiled"`` (Inductor C++) or ``"eager"`` (the default).

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


def _make_forward(eps: float, feature_dim: int) -> Callable:
    from ..reference import batched_ln_tanh_linear_relu

    def forward(x, weight, bias, ln_weight, ln_bias):
        return batched_ln_tanh_linear_relu(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)

    return forward


def _make_backward(eps: float, feature_dim: int) -> Callable:
    from .composite import composite_backward as _composite_backward

    def backward(grad_y, x, weight, bias, ln_weight, ln_bias):
        return _composite_backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim)

    return backward


def _compiled(which: str, key: tuple, dynamo_backend) -> Any:
    full_key = (which, dynamo_backend, key)
    fn = _CACHE.get(full_key)
    if fn is None:
        with _LOCK:
            fn = _CACHE.get(full_key)
            if fn is None:
                eps, feature_dim = key[0], key[1]
                make = _make_forward if which == "fwd" else _make_backward
                plain = _fresh_code(make(eps, feature_dim), f"recfuse_cpu_{which}_{len(_CACHE)}")
                fn = torch.compile(plain, dynamic=True, backend=dynamo_backend)
                _CACHE[full_key] = fn
    return fn


def _variant(x, weight, bias, ln_weight, ln_bias, eps, feature_dim) -> Optional[tuple]:
    """The variant key, or None where the compiled path does not apply (eager composite)."""
    if _STATE.backend != "compiled" or x.dtype not in _LOW_PRECISION or x.numel() == 0:
        return None
    if weight.numel() == 0:  # H == 0 or D == 0: nothing to compile
        return None
    return (float(eps), int(feature_dim), x.dtype, _kind(weight, 3), _kind(bias, 2),
            _kind(ln_weight, 2), _kind(ln_bias, 2))


def _run(which: str, key: tuple, args: tuple):
    fn = _compiled(which, key, _STATE.dynamo_backend)
    if fn is _FAILED:
        return None
    try:
        with torch.no_grad():
            return fn(*args)
    except Exception as e:  # noqa: BLE001 - any compile failure: the eager composite instead
        _CACHE[(which, _STATE.dynamo_backend, key)] = _FAILED
        warnings.warn(
            f"recfuse: compiling the CPU {'forward' if which == 'fwd' else 'backward'} failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); using the eager "
            f"composite for this variant. Set {_ENV}=eager to skip compiling.",
            RuntimeWarning, stacklevel=3)
        log.debug("recfuse CPU compile failure", exc_info=True)
        return None


def forward(x, weight, bias, ln_weight, ln_bias, eps, feature_dim) -> Optional[torch.Tensor]:
    """y from the compiled composite, or None where the caller should run the eager composite."""
    key = _variant(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    if key is None:
        return None
    return _run("fwd", key, (x, weight, bias, ln_weight, ln_bias))


def backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim) -> Optional[tuple]:
    """The five gradients (as `_composite_backward` returns them), or None (eager instead)."""
    key = _variant(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    if key is None or grad_y.dtype != x.dtype:
        return None
    out = _run("bwd", key, (grad_y, x, weight, bias, ln_weight, ln_bias))
    if out is None:
        return None
    gx = out[0]
    like_x = torch.empty_like(x)  # x's strides, as the eager composite's and the kernel's dx
    if gx.stride() != like_x.stride():
        gx = like_x.copy_(gx)
    return (gx,) + tuple(out[1:])


def clear_cache() -> None:
    """Forget the compiled functions (and failures) of this process (tests)."""
    with _LOCK:
        _CACHE.clear()
