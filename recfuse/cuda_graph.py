"""Opt-in CUDA-graph replay of fixed-shape inference calls.

`FusedFeatureProcessor(..., cuda_graph=True)` and `recfuse.transform(..., cuda_graph=True)` use
this. At the puzzler's small shape (F=16, B=1024, D=256) one fused kernel takes ~16 us of GPU time
while a Python call into it (argument checks, dispatch, the Triton launcher) costs more than that
on the host; a replayed graph costs one `cudaGraphLaunch`.

When a graph is captured, replayed or re-captured:

* **Signature.** A graph serves one call signature: every tensor argument's shape, strides,
  dtype and device, every other argument's value, and the address and dtype of every parameter.
  A new signature (another batch size, parameters moved or replaced rather than updated in place)
  warms up and captures a new graph. In-place parameter updates (optimizer steps,
  ``load_state_dict``) are seen by the next replay: the graph reads parameters where they are.
* **Inputs, read in place.** The first graph of a signature reads the caller's input tensors
  where they are: no copy. Calls that pass tensors at the same addresses (the same buffers,
  refilled or not) replay it as is. The first call whose inputs are at other addresses switches
  the signature for good to graphs that own their input buffers, and every call then copies its
  inputs in (one device copy per tensor, what torch's own CUDA-graph runners do).
* **Outputs are never overwritten while held.** A replay writes into memory that the graph owns,
  and the call returns tensors on that memory (no copy). Each signature keeps up to two graphs
  and replays one whose outputs nobody holds any more (the tensor and every view of it dropped),
  so the usual ``y = model(x)`` loop, which still holds the previous result during the call,
  alternates between the two with no copy. A call that finds both held (results kept across
  calls) runs without a graph: same result, no replay, nothing overwritten.
* **At most `max_graphs` graphs** are kept (each has its own memory pool); the least recently
  used signature is dropped first. Results already handed out stay valid.

Example:
    >>> import torch
    >>> cache = CudaGraphCache()
    >>> lin = torch.nn.Linear(8, 2).cuda()                     # doctest: +SKIP
    >>> x = torch.randn(4, 8, device="cuda")                    # doctest: +SKIP
    >>> with torch.no_grad():                                   # doctest: +SKIP
    ...     y = cache.run(lin, (x,), list(lin.parameters()))    # captured, then replayed
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_unflatten

log = logging.getLogger("recfuse")

__all__ = ["CudaGraphCache", "ModuleTensors", "replay_applies"]

# Argument kinds that may be baked into a graph by value. Containers are left out on purpose: a
# list holding tensors would key by identity and replay stale addresses.
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, nn.Module)
_GRAPHS_PER_SIGNATURE = 2

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def replay_applies(tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """Whether a call may be replayed: CUDA tensors, no autograd record wanted, plain eager.

    Example:
        >>> import torch
        >>> replay_applies([torch.zeros(2)], [])   # a CPU tensor: run it normally
        False
    """
    if not tensors or any(type(t) is not torch.Tensor or t.device.type != "cuda" for t in tensors):
        return False
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *params)):
        return False
    return True


class ModuleTensors:
    """A module's parameters and buffers, looked up by name on every call (the graph's key).

    `nn.Module.parameters()` walks every submodule through generators (the largest host cost of a
    replayed call); this walks precomputed names instead and reads the owning dicts each time,
    so a parameter or buffer replaced by a new tensor (``load_state_dict(assign=True)``,
    ``module.to()``) gives a new key and a new graph. A name that no longer resolves (a submodule
    removed) re-reads the names.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 3)
        >>> [t.shape for t in ModuleTensors(lin)()]
        [torch.Size([3, 2]), torch.Size([3])]
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.paths = None  # read on the first call: a module registers its parameters after this

    def _refresh(self) -> None:
        names = [(n, "_parameters") for n, _ in self.module.named_parameters()]
        names += [(n, "_buffers") for n, _ in self.module.named_buffers()]
        self.paths = [(tuple(n.split(".")[:-1]), n.rsplit(".", 1)[-1], kind) for n, kind in names]

    def __call__(self) -> list[torch.Tensor]:
        if self.paths is None:
            self._refresh()
        try:
            out = []
            for path, leaf, kind in self.paths:
                m = self.module
                for p in path:
                    m = m._modules[p]
                t = getattr(m, kind)[leaf]
                if t is not None:
                    out.append(t)
            return out
        except KeyError:
            self._refresh()
            return self()


def _signature(args: tuple, params: Sequence[torch.Tensor]) -> Optional[tuple]:
    """The cache key of a call, or None when an argument cannot be baked into a graph."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device))
        elif isinstance(a, _SCALARS):
            key.append(a)
        else:
            return None
    key.extend((p.data_ptr(), p.dtype) for p in params)
    return tuple(key)


def record_cuda_graph(fn: Callable, args: tuple):
    """Warm `fn(*args)` up on a side stream, capture it; returns (replay, outputs).

    The outputs live in the graph's private memory pool and are rewritten by every replay.
    """
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    # Warm-up off the capturing stream: Triton compiles and the allocator settles first.
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph.replay, out


class _CapturedCall:
    """One captured graph: its input tensors, its outputs, and who still holds them."""

    __slots__ = ("replay", "inputs", "owns_inputs", "outputs", "spec", "storages", "counts", "single")

    def __init__(self, recorder, fn: Callable, args: tuple, own_inputs: bool):
        if own_inputs:
            args = tuple(
                torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
                if isinstance(a, torch.Tensor) else a for a in args
            )
        self.inputs = [a for a in args if isinstance(a, torch.Tensor)]
        self.owns_inputs = own_inputs
        self.replay, out = recorder(fn, args)
        self.single = isinstance(out, torch.Tensor)
        self.outputs, self.spec = tree_flatten(out)
        self.storages = [o.untyped_storage() for o in self.outputs if isinstance(o, torch.Tensor)]
        # What we hold ourselves; any reference beyond it is a caller's tensor or view.
        self.counts = [_use_count(s._cdata) for s in self.storages] if _use_count else None

    def reads_from(self, tensors: Sequence[torch.Tensor]) -> bool:
        return all(a.data_ptr() == b.data_ptr() for a, b in zip(self.inputs, tensors))

    def outputs_free(self) -> bool:
        if self.counts is None:  # no way to tell: never overwrite
            return False
        return all(_use_count(s._cdata) <= c for s, c in zip(self.storages, self.counts))

    def __call__(self, tensors: Sequence[torch.Tensor]):
        if self.owns_inputs:
            for dst, src in zip(self.inputs, tensors):
                dst.copy_(src)
        self.replay()
        # Fresh tensor objects on the graph's memory: holding one (or a view) marks it in use.
        if self.single:
            return self.outputs[0].detach()
        return tree_unflatten([o.detach() if isinstance(o, torch.Tensor) else o for o in self.outputs], self.spec)


class CudaGraphCache:
    """Captured CUDA graphs of a function, replayed for repeated fixed-signature calls.

    The module docstring gives the rule. `recorder(fn, args) -> (replay, outputs)` captures one
    call; tests pass a stand-in that re-runs `fn` on replay, so the rule runs without a GPU.

    Example:
        >>> import torch
        >>> cache = CudaGraphCache(max_graphs=4)
        >>> len(cache)
        0
    """

    def __init__(self, max_graphs: int = 8, recorder: Callable = record_cuda_graph):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.max_graphs = max_graphs
        self.recorder = recorder
        # signature -> graphs of that signature (most recently used signature last)
        self._graphs: dict[tuple, list[_CapturedCall]] = {}
        self.captures = 0
        self.eager_calls = 0

    def __len__(self) -> int:
        return sum(len(g) for g in self._graphs.values())

    def __deepcopy__(self, memo) -> "CudaGraphCache":
        # A copied module gets its own graphs on its own parameters; CUDA graphs cannot be copied.
        return CudaGraphCache(self.max_graphs, self.recorder)

    def run(self, fn: Callable, args: tuple, params: Sequence[torch.Tensor]):
        """`fn(*args)`, from a replayed graph where the rule allows, else called directly.

        The caller checks `replay_applies` first (CUDA inputs, no autograd needed).
        """
        key = _signature(args, params)
        if key is None:
            self.eager_calls += 1
            return fn(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        graphs = self._graphs.pop(key, None) or []
        if graphs and not graphs[0].owns_inputs and not graphs[0].reads_from(tensors):
            log.debug("recfuse: CUDA graph inputs moved; copying inputs in from now on (%s)", key[:1])
            graphs = []  # its handed-out results stay valid: it is never replayed again
            own = True
        else:
            own = bool(graphs) and graphs[0].owns_inputs
        self._graphs[key] = graphs
        for g in graphs:
            if g.outputs_free():
                return g(tensors)
        if len(graphs) < _GRAPHS_PER_SIGNATURE:
            self._make_room()
            g = _CapturedCall(self.recorder, fn, args, own)
            self.captures += 1
            log.debug("recfuse: captured CUDA graph %d for %s", self.captures, key[:1])
            graphs.append(g)
            self._graphs[key] = graphs  # _make_room may have dropped this signature's entry
            return g(tensors)
        self.eager_calls += 1  # every graph's results are still held: overwrite none
        return fn(*args)

    def _make_room(self) -> None:
        while len(self) >= self.max_graphs and self._graphs:
            oldest = next(iter(self._graphs))
            graphs = self._graphs[oldest]
            if graphs:
                graphs.pop(0)
            if not graphs:
                del self._graphs[oldest]
