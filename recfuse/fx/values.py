"""Value metadata of traced nodes: the shapes and dtypes the matcher reasons about.

A node's value comes from recfuse's own capture (``node.meta["recfuse_val"]``) or, for graphs
that Dynamo or ShapeProp produced, from their ``val`` / ``example_value`` / ``tensor_meta``
entries. Only summaries are kept (a `ValueInfo` for a tensor, the same structure for tuples,
lists and dicts, small Python constants as they are), never tensor data.

Example:
    >>> import torch, torch.fx
    >>> gm = torch.fx.symbolic_trace(lambda x: x + 1)
    >>> x = next(iter(gm.graph.nodes))
    >>> x.meta[VAL_KEY] = summarise(torch.zeros(2, 3))
    >>> tensor_shape(x), tensor_dtype(x)
    ((2, 3), torch.float32)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

__all__ = ["ValueInfo", "VAL_KEY", "summarise", "value_of", "annotate_from_meta", "tensor_shape", "tensor_dtype"]

VAL_KEY = "recfuse_val"


@dataclass(frozen=True)
class ValueInfo:
    """Shape and dtype of a tensor value seen while capturing (no data is kept).

    Example:
        >>> import torch
        >>> ValueInfo.of(torch.zeros(2, 3)).shape
        (2, 3)
    """

    shape: tuple
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "ValueInfo":
        shape = []
        for s in t.shape:
            try:
                shape.append(int(s))
            except Exception:  # symbolic size without a hint: unknown
                shape.append(None)
        return ValueInfo(tuple(shape), t.dtype)


def summarise(v: Any) -> Any:
    """The summary kept for a traced value: `ValueInfo` for tensors, structure for containers.

    Example:
        >>> import torch
        >>> summarise((torch.zeros(2), 3, "a"))
        (ValueInfo(shape=(2,), dtype=torch.float32), 3, 'a')
    """
    if isinstance(v, torch.Tensor):
        return ValueInfo.of(v)
    if isinstance(v, torch.Size):
        return tuple(int(x) for x in v)
    if isinstance(v, Mapping):
        return {k: summarise(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return type(v)(summarise(x) for x in v) if type(v) in (tuple, list) else tuple(summarise(x) for x in v)
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return v
    return type(v)  # anything else: only its type is useful to the matcher


def value_of(node: Node) -> Any:
    """The value summary of `node`: from capture, or from Dynamo/ShapeProp metadata.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda x: x + 1)
        >>> value_of(next(iter(gm.graph.nodes))) is None
        True
    """
    if VAL_KEY in node.meta:
        return node.meta[VAL_KEY]
    for key in ("val", "example_value"):
        if key in node.meta:
            return summarise(node.meta[key])
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return ValueInfo(tuple(int(s) for s in tm.shape), tm.dtype)
    return None


def annotate_from_meta(graph: Graph) -> bool:
    """Copy Dynamo's fake-tensor metadata into ``recfuse_val``; True if every tensor node had some.

    Example:
        >>> import torch, torch.fx
        >>> annotate_from_meta(torch.fx.symbolic_trace(lambda x: x + 1).graph)
        False
    """
    complete = True
    for n in graph.nodes:
        if n.op == "output":
            continue
        v = value_of(n)
        if v is None:
            complete = False
        else:
            n.meta[VAL_KEY] = v
    return complete


def tensor_shape(node: Any) -> Optional[tuple]:
    """The example shape of a tensor-valued node, or None when unknown / not a tensor.

    Example:
        >>> tensor_shape(3) is None
        True
    """
    if not isinstance(node, Node):
        return None
    v = node.meta.get(VAL_KEY)
    if v is None:
        v = value_of(node)
    if isinstance(v, ValueInfo) and None not in v.shape:
        return v.shape
    return None


def tensor_dtype(node: Node) -> Optional[torch.dtype]:
    """The example dtype of a tensor-valued node, or None.

    Example:
        >>> import torch, torch.fx
        >>> tensor_dtype(next(iter(torch.fx.symbolic_trace(lambda x: x).graph.nodes))) is None
        True
    """
    v = value_of(node)
    return v.dtype if isinstance(v, ValueInfo) else None
