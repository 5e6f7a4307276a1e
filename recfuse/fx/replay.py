"""`recfuse.transform(..., cuda_graph=True)`: the transformed GraphModule, replayed as CUDA graphs."""
from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule

from ..cuda_graph import CudaGraphCache, ModuleTensors, replay_applies

__all__ = ["CudaGraphReplayModule"]


class CudaGraphReplayModule(GraphModule):
    """A transformed GraphModule whose inference calls replay captured CUDA graphs.

    Same graph, parameters and state_dict keys as the plain result of `recfuse.transform`. Calls
    with CUDA tensors that need no autograd record (``torch.no_grad()``, ``inference_mode()`` or
    nothing requiring grad) go through `recfuse.cuda_graph.CudaGraphCache`, whose docstring gives
    the capture and re-capture rule; other calls (training, CPU tensors, keyword arguments,
    torch.compile) run the graph as usual.

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

    def __call__(self, *args, **kwargs):
        if not kwargs:
            tensors_of = self.__dict__.get("_module_tensors")
            if tensors_of is None:
                tensors_of = self.__dict__["_module_tensors"] = ModuleTensors(self)
            params = tensors_of()
            if replay_applies([a for a in args if isinstance(a, torch.Tensor)], params):
                return self.cuda_graphs.run(self._eager_call, args, params)
        return self._eager_call(*args, **kwargs)

    def _eager_call(self, *args, **kwargs):
        return torch.nn.Module.__call__(self, *args, **kwargs)
