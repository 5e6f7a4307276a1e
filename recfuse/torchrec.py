"""Adapters between torchrec's `KeyedTensor` and recfuse, imported lazily.

`import recfuse` must work where torchrec is not installed (the GPU image has none), so nothing
here imports torchrec at module level. `is_keyed_tensor` does not import it at all: if
`torchrec.sparse.jagged_tensor` is not already in `sys.modules`, no KeyedTensor can exist in the
process, so the answer is False without paying torchrec's import time.
"""
from __future__ import annotations

import sys
from typing import List

import torch

__all__ = ["is_keyed_tensor", "keyed_tensor_parts", "make_keyed_tensor", "wait_if_lazy_awaitable"]

_JAGGED_TENSOR_MODULE = "torchrec.sparse.jagged_tensor"
_DISTRIBUTED_TYPES_MODULE = "torchrec.distributed.types"


def is_keyed_tensor(obj) -> bool:
    """Whether `obj` is a torchrec `KeyedTensor`, without importing torchrec.

    Example:
        >>> import torch
        >>> is_keyed_tensor(torch.zeros(2, 3))
        False
    """
    module = sys.modules.get(_JAGGED_TENSOR_MODULE)
    return module is not None and isinstance(obj, module.KeyedTensor)


def wait_if_lazy_awaitable(obj):
    """The value of a torchrec `LazyAwaitable` (what a sharded EBC returns), else `obj` itself.

    torchrec waits on a LazyAwaitable implicitly when it reaches a torch function; the module
    has to look at the KeyedTensor's keys first, so it waits explicitly. `_wait_async` is the
    waiting torchrec itself uses: it caches the result, so a later implicit wait does not run
    the all-to-all a second time.

    Example:
        >>> import torch
        >>> wait_if_lazy_awaitable(torch.zeros(1))
        tensor([0.])
    """
    module = sys.modules.get(_DISTRIBUTED_TYPES_MODULE)
    if module is not None and isinstance(obj, module.LazyAwaitable):
        return module.LazyAwaitable._wait_async(obj)
    return obj


def keyed_tensor_parts(kt) -> tuple[List[str], List[int], torch.Tensor]:
    """Split a KeyedTensor into (keys, length per key, [B, sum(lengths)] values).

    Only the pooled-embedding layout (``key_dim=1``, 2D values) is accepted: that is what an
    EmbeddingBagCollection returns, and what the module's strided per-feature view assumes.

    Example:
        >>> import torch
        >>> from torchrec.sparse.jagged_tensor import KeyedTensor  # doctest: +SKIP
        >>> kt = KeyedTensor(["a", "b"], [4, 4], torch.zeros(2, 8))  # doctest: +SKIP
        >>> keyed_tensor_parts(kt)[:2]  # doctest: +SKIP
        (['a', 'b'], [4, 4])
    """
    values = kt.values()
    if kt.key_dim() != 1 or values.dim() != 2:
        raise ValueError(
            f"KeyedTensor must hold pooled embeddings [B, sum(D)] with key_dim=1, got values of "
            f"shape {list(values.shape)} and key_dim={kt.key_dim()}"
        )
    return list(kt.keys()), list(kt.length_per_key()), values


def make_keyed_tensor(keys: List[str], length_per_key: List[int], values: torch.Tensor):
    """Build a KeyedTensor (``key_dim=1``) from keys, lengths and [B, sum(lengths)] values.

    Example:
        >>> import torch
        >>> kt = make_keyed_tensor(["a", "b"], [1, 1], torch.zeros(3, 2))  # doctest: +SKIP
        >>> kt["b"].shape  # doctest: +SKIP
        torch.Size([3, 1])
    """
    from torchrec.sparse.jagged_tensor import KeyedTensor

    return KeyedTensor(keys=list(keys), length_per_key=list(length_per_key), values=values, key_dim=1)
