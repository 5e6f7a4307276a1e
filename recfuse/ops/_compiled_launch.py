"""Launch compiled Triton kernels without re-binding their arguments on every call.

`JITFunction.run` binds and re-specialises every argument on each call: for our kernels (about
25 arguments) that is 20-30 us of host time on the H100 machine, several times the GPU time of the
puzzler's shape (F=16, B=1024, D=256). What Triton specialises on is fixed by the argument
dtypes, the integer values and the 16-byte alignment of each pointer, so those (plus the
constexprs and launch options) form a key; the first call of a key goes through
`JITFunction.run`, and later calls launch the `CompiledKernel` it returned directly.

The key holds every integer exactly (not only Triton's "== 1" / "% 16" classes): a few more
compilations-cache lookups for new batch sizes, never a kernel specialised for other values.
If the direct launch ever fails (a Triton version whose launcher takes other arguments), it is
switched off for the process with a warning and `JITFunction.run` is used from then on.
Set `RECFUSE_COMPILED_LAUNCH=0` to switch it off.

A bound launch (`CompiledLaunchCache.bind`) goes one step further where this Triton's runner makes
the call it knows (`runner_call_is_known`) and no launch hook is registered: it calls the C
launcher itself, with the tensors' data pointers as integers. On the H200 host (triton 3.6) the
op's forward kernel launch fell from 14.6 to 9.1 us (benchmarks/NOTES.md, twentieth session): the
runner records launch metadata for its (empty) hook chains on every call, and the launcher
queries the driver about each tensor's pointer. `RECFUSE_DIRECT_LAUNCH=0` keeps the runner.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import re
from typing import Any, Optional, Sequence

import torch
import triton

from .._checks import BoundedDict

log = logging.getLogger("recfuse")


class CompiledLaunchCache:
    """Wraps one `@triton.jit` function; call it like `fn[grid](*args, **meta)`.

    Example:
        >>> from recfuse.ops import kernels
        >>> launch = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd)
        >>> launch.defaults
        {'PREFETCH': False, 'UNROLL_H': False, 'LOOP_STAGES': None, 'COL_SUMS': False, 'DZ_OUT': False, 'LOAD_MASK': False, 'LN_IN_WEIGHT': False, 'ROW_SLOTS': 0, 'D_ALIGN': 1}
    """

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.arg_names = list(jit_fn.arg_names)
        # Constexprs with a default in the kernel's signature may be left out of `meta` (as with
        # `JITFunction.run`); the direct launch passes every parameter, so it fills them in.
        self.defaults = {name: p.default for name, p in inspect.signature(jit_fn.fn).parameters.items()
                         if p.default is not inspect.Parameter.empty}
        # keyed by exact integers (every batch size its own entry): bounded
        self.kernels: dict[tuple, Any] = BoundedDict()
        self.enabled = os.environ.get("RECFUSE_COMPILED_LAUNCH", "1") != "0"

    def _key(self, args: Sequence, meta: dict, options: dict) -> tuple:
        # Alignment is what Triton's pointer specialisation looks at; dtype picks the kernel.
        spec = tuple((a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor) else a for a in args)
        return spec, tuple(meta.items()), tuple(options.items()), args[0].device.index

    def trailing_args(self, args: Sequence, meta: dict) -> Optional[list]:
        """The parameters after `args`, in signature order (`meta`'s values, else the kernel's
        defaults), or None when one is in neither: such a call is never cached.

        Example:
            >>> from recfuse.ops import kernels
            >>> launch = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd)
            >>> n = len(launch.arg_names)  # the last ten: BLOCK_H, then nine with defaults
            >>> launch.trailing_args(range(n - 10), {"BLOCK_H": 16})
            [16, False, False, None, False, False, False, False, 0, 1]
            >>> launch.trailing_args(range(n - 10), {}) is None  # BLOCK_H has no default
            True
        """
        trailing = []
        for name in self.arg_names[len(args):]:
            if name in meta:
                trailing.append(meta[name])
            elif name in self.defaults:
                trailing.append(self.defaults[name])
            else:
                return None
        return trailing

    def __call__(self, grid: tuple, args: Sequence, meta: dict, **options) -> None:
        jit = self.jit_fn
        if not (self.enabled and args[0].device.type == "cuda"):
            jit[grid](*args, **meta, **options)
            return
        key = self._key(args, meta, options)
        compiled = self.kernels.get(key)
        if compiled is None:
            compiled = jit[grid](*args, **meta, **options)
            if compiled is not None and self.trailing_args(args, meta) is not None:
                self.kernels[key] = compiled
            return
        # All parameters in signature order: the constexprs follow the runtime arguments.
        full = list(args)
        full.extend(self.trailing_args(args, meta))
        try:
            stream = torch._C._cuda_getCurrentRawStream(args[0].device.index)
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*full, stream=stream)  # it indexes grid[2]
        except Exception as err:  # noqa: BLE001 - any launcher mismatch falls back, loudly
            self._disable(err)
            jit[grid](*args, **meta, **options)

    def _disable(self, err: Exception) -> None:
        log.warning("recfuse: direct launch of %s failed (%s: %s); using JITFunction.run from now on",
                    getattr(self.jit_fn, "__name__", self.jit_fn), type(err).__name__, err)
        self.enabled = False
        self.kernels.clear()

    def bind(self, grid: tuple, args: Sequence, meta: dict, n_tensors: int, **options):
        """A launcher of the kernel already compiled for these arguments, taking only their first
        `n_tensors` (the tensors; every other argument is fixed), or None if there is none.

        A launch plan binds once per call signature: the call then costs the C launch and a
        stream lookup, with no argument walk. If the launch fails, the cache switches itself off
        and the launch goes through `JITFunction.run`.
        """
        if not (self.enabled and args[0].device.type == "cuda"):
            return None
        compiled = self.kernels.get(self._key(args, meta, options))
        if compiled is None:
            return None
        return self.bound_launch(compiled, grid, args, meta, n_tensors, args[0].device.index,
                                 torch._C._cuda_getCurrentRawStream, options)

    def bound_launch(self, compiled, grid: tuple, args: Sequence, meta: dict, n_tensors: int, device_index,
                     current_stream, options: dict):
        """`bind`'s launcher of ``compiled`` (a `CompiledKernel`), whose stream is
        ``current_stream(device_index)``; benchmarks/host_path_stub.py times it with a no-op kernel."""
        tail = list(args[n_tensors:])
        tail.extend(self.trailing_args(args, meta))
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        runner = compiled[grid3]
        jit, fixed = self.jit_fn, tuple(args[n_tensors:])
        # The runner's own call, made directly where this Triton's runner makes the call we know
        # and no hook is registered with Triton (a profiler's hook sends the call through the
        # runner): without the runner's launch-metadata record for hooks that are not there, and
        # with the tensors' data pointers as integers, which the C launcher takes as they are (a
        # tensor costs it a method call and a driver query of the pointer; the plan is per
        # device, so that query has nothing to find).
        run, function, packed = (getattr(compiled, name, None) for name in ("run", "function", "packed_metadata"))
        direct = runner_call_is_known() and run is not None
        g0, g1, g2 = grid3
        hooks = _knobs_runtime()
        data_ptr = torch.Tensor.data_ptr

        def launch(*tensors):
            try:
                if direct and no_launch_hooks(hooks):
                    run(g0, g1, g2, current_stream(device_index), function, packed, None, None, None,
                        *map(data_ptr, tensors), *tail)
                else:
                    runner(*tensors, *tail, stream=current_stream(device_index))
            except Exception as err:  # noqa: BLE001 - a launcher mismatch falls back, loudly
                self._disable(err)
                jit[grid](*tensors, *fixed, **meta, **options)

        return launch


def _knobs_runtime():
    knobs = getattr(triton, "knobs", None)
    return getattr(knobs, "runtime", None)


def no_launch_hooks(runtime) -> bool:
    """Whether Triton's launch hooks (``triton.knobs.runtime.launch_enter_hook`` / ``..._exit_hook``)
    are unset or empty chains: then a launch may pass None for them, as a launch without hooks does.

    Example:
        >>> import triton
        >>> no_launch_hooks(triton.knobs.runtime)
        True
        >>> seen = []
        >>> triton.knobs.runtime.launch_enter_hook.add(seen.append)
        >>> no_launch_hooks(triton.knobs.runtime)
        False
        >>> triton.knobs.runtime.launch_enter_hook.remove(seen.append)
    """
    if runtime is None:
        return False
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and (type(hook) is not _HOOK_CHAIN or hook.calls):
            return False
    return True


_HOOK_CHAIN = getattr(getattr(triton, "knobs", None), "HookChain", None)
# `CompiledKernel.__getitem__`'s runner, as Triton 3.4-3.9 write it: the call `bind`'s launches make
# themselves. Another Triton's runner (another argument order) keeps its launches on the runner.
_RUNNER_CALL = re.compile(r"self\.run\(\s*grid\[0\],\s*grid\[1\],\s*grid\[2\],\s*stream,\s*self\.function,"
                          r"\s*self\.packed_metadata,\s*launch_metadata,\s*knobs\.runtime\.launch_enter_hook,"
                          r"\s*knobs\.runtime\.launch_exit_hook,\s*\*args\)")


@functools.lru_cache(maxsize=None)
def runner_call_is_known() -> bool:
    """Whether this Triton's compiled-kernel runner launches with the call `CompiledLaunchCache.bind`
    makes directly (read from its source once a process), and its launch hooks are chains whose
    emptiness can be seen; False turns the direct call off. Set ``RECFUSE_DIRECT_LAUNCH=0`` to
    turn it off by hand.

    Example:
        >>> isinstance(runner_call_is_known(), bool)
        True
    """
    if os.environ.get("RECFUSE_DIRECT_LAUNCH", "1") == "0" or _HOOK_CHAIN is None or _knobs_runtime() is None:
        return False
    try:
        from triton.compiler.compiler import CompiledKernel
        source = inspect.getsource(CompiledKernel.__getitem__)
    except (ImportError, OSError, TypeError):
        return False
    return _RUNNER_CALL.search(source) is not None
