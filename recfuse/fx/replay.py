"""`recfuse.transform(..., cuda_graph=True)`: the transformed GraphModule, replayed as CUDA graphs."""
from __future__ import annotations

import torch
from torch.fx import Graph

from ..cuda_graph import CudaGraphCache, ModuleTensors
from .graph_module import TransformedGraphModule

__all__ = ["CudaGraphReplayModule"]


class CudaGraphReplayModule(TransformedGraphModule):
    """A transformed GraphModule whose inference calls replay captured CUDA graphs.

    Same graph, parameters and state_dict keys as the plain result of `recfuse.transform`. Calls
    with CUDA tensors that need no autograd record (``torch.no_grad()``, ``inference_mode()`` or
    nothing requiring grad) go through `recfuse.cuda_graph.CudaGraphCache`, whose docstring gives
    the capture and re-capture rule; other calls (training, CPU tensors, keyword arguments,
    torch.compile, autocast, vmap) run the graph as usual. A replayed call does not go through
    GraphModule's wrapped call (see `recompile`).

    Example:
        >>> import torch, recfuse
        >>> from recfuse.puzzler import SplitStack
        >>> x = torch.randn(4 * 3 * 8)
        >>> fused = recfuse.transform(SplitStack(8, 1), (x, 4, 8), cuda_graph=True)
        >>> type(fused).__mro__[1].__name__, fused(x, 4, 8).shape   # CPU: runs as usual
        ('CudaGraphReplayModule', torch.Size([3, 4, 1]))
    """

    def __init__(self, root, graph: Graph, class_name: str = "GraphModule", max_graphs: int = 8):
        super().__init__(root, graph, class_name)
        self.__dict__["_cuda_graph_cache"] = CudaGraphCache(max_graphs)

    @property
    def cuda_graphs(self) -> CudaGraphCache:
        """The captured graphs (a deep copy of the module starts with none)."""
        cache = self.__dict__.get("_cuda_graph_cache")
        if cache is None:  # GraphModule.__deepcopy__ re-initialises without our __init__
            cache = self.__dict__["_cuda_graph_cache"] = CudaGraphCache()
        return cache

    def recompile(self):
        code = super().recompile()
        # GraphModule.recompile gives this instance's own class a __call__ that goes through
        # `_wrapped_call` (two more Python frames per call); ours takes its place and the eager
        # path still goes through `_wrapped_call` (its error report for the generated code).
        type(self).__call__ = CudaGraphReplayModule._replay_call
        return code

    def _replay_call(self, *args, **kwargs):
        """A call of the module (installed as its class's __call__ by `recompile`)."""
        if kwargs:
            return self._eager_call(*args, **kwargs)
        d = self.__dict__
        cache, tensors_of = d.get("_cuda_graph_cache"), d.get("_module_tensors")
        if cache is None:
            cache = self.cuda_graphs
        if tensors_of is None:
            tensors_of = d["_module_tensors"] = ModuleTensors(self)
        return cache.call(self._eager_call, args, tensors_of())

    def _eager_call(self, *args, **kwargs):
        # `_wrapped_call` (set by GraphModule.recompile) reaches torch.nn.Module.__call__, looked up
        # at call time (fx's tracer patches it), since no class above this instance's defines one.
        return self._wrapped_call(self, *args, **kwargs)
