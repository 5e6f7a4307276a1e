"""Input adapters: one call's input, whatever its kind, unpacked once by `read_input`.

Each kind knows its signature (what its plan and validation depend on), its checks (by feature
name, against the module's `FeatureLayout`), how to plan the fused call, and how to run the
per-slice reference, answering in its own kind:

* `BufferInput`: a [B, sum(D)] tensor (features in the module's order) or a torchrec
  KeyedTensor's values (features named by its keys, any order) -> [B, F*H] or a KeyedTensor;
* `StackedInput`: a [B, F, D] / [F, B, D] tensor (single embedding dim) -> [B, F, H] / [F, B, H];
* `DictInput`: a dict name -> [B, D] (any key order) -> a dict name -> [B, H], same key order.

Example:
    >>> import torch
    >>> from recfuse.module.features import FeatureLayout
    >>> layout = FeatureLayout.build(("a", "b"), (4, 4))
    >>> inp = read_input(torch.zeros(3, 2, 4), feature_dim=1)
    >>> type(inp).__name__, inp.signature()[1:3]
    ('StackedInput', (1, torch.Size([3, 2, 4])))
    >>> read_input(torch.zeros(3, 9), 1).plan(layout, ((torch.zeros(1, 4),) + (None,) * 3,), 1e-5)
    Traceback (most recent call last):
    ...
    ValueError: input must be [B, 8] (features a:4, b:4 side by side), got shape [3, 9]
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Optional, Sequence

import torch

from .._checks import _check_strided, check_feature_dim
from ..chain import DEFAULT
from ..torchrec import is_keyed_tensor, keyed_tensor_parts, make_keyed_tensor, wait_if_lazy_awaitable
from .features import FeatureLayout
from .plan import BufferPlan, DictPlan, GroupParams, StackedPlan

__all__ = ["read_input", "BufferInput", "StackedInput", "DictInput"]

_Tensor = torch.Tensor
# feature name, its [B, D] slice -> [B, H]: the per-slice oracle `forward_reference` passes in.
FeatureFn = Callable[[str, torch.Tensor], torch.Tensor]


def read_input(x, feature_dim: int):
    """The adapter of `x`'s kind; raises naming what kinds are accepted.

    A torchrec ``LazyAwaitable`` (a sharded EBC's output) is waited on first, since its keys are
    read before any torch function would wait implicitly.

    Example:
        >>> import torch
        >>> type(read_input({"a": torch.zeros(2, 4)}, 1)).__name__
        'DictInput'
        >>> read_input([torch.zeros(2, 4)], 1)
        Traceback (most recent call last):
        ...
        TypeError: input must be a torchrec KeyedTensor, a 2D/3D torch.Tensor or a dict name -> [B, D] tensor, got list
    """
    if isinstance(x, torch.Tensor):
        ndim = x.dim()
        if ndim == 2:
            return BufferInput(x)
        if ndim == 3:
            return StackedInput(x, feature_dim)
        raise ValueError(
            f"input tensor must be 2D [B, sum(D)] or 3D [B, F, D] / [F, B, D], got shape "
            f"{list(x.shape)} ({x.dim()}D)"
        )
    if isinstance(x, Mapping):
        return DictInput(x)
    x = wait_if_lazy_awaitable(x)
    if is_keyed_tensor(x):
        keys, lengths, values = keyed_tensor_parts(x)
        return BufferInput(values, tuple(keys), tuple(lengths))
    raise TypeError(
        f"input must be a torchrec KeyedTensor, a 2D/3D torch.Tensor or a dict name -> [B, D] "
        f"tensor, got {type(x).__name__}"
    )


def _tensor_signature(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


class BufferInput:
    """A [B, sum(D)] buffer: a 2D tensor in the module's feature order, or a KeyedTensor's parts.

    Example:
        >>> import torch
        >>> from recfuse.module.features import FeatureLayout
        >>> layout = FeatureLayout.build(("a", "b"), (4, 4))
        >>> BufferInput(torch.zeros(2, 8), ("b", "a"), (4, 6)).plan(layout, (), 1e-5)
        Traceback (most recent call last):
        ...
        ValueError: feature 'a': KeyedTensor has embedding dim 6 but the module was built with embedding_dims['a'] = 4
    """

    def __init__(self, values: torch.Tensor, keys: Optional[tuple[str, ...]] = None,
                 lengths: Optional[tuple[int, ...]] = None):
        self.values = values
        self.keys = keys  # None: a plain tensor, features in the module's order
        self.lengths = lengths
        self.what = "input" if keys is None else "KeyedTensor"

    def signature(self) -> Optional[tuple]:
        v = self.values
        if type(v) is not _Tensor:
            return None
        return (BufferInput, self.keys, self.lengths, v.shape, v.stride(), v.dtype, v.device)

    def _names_dims(self, layout: FeatureLayout) -> tuple[Sequence[str], Sequence[int]]:
        return (layout.names, layout.dims) if self.keys is None else (self.keys, self.lengths)

    def validate(self, layout: FeatureLayout) -> None:
        names, dims = self._names_dims(layout)
        if self.keys is not None:
            layout.check_names(names, self.what)
            layout.check_dims(names, dims, self.what)
        total = sum(dims)
        values = self.values
        # Before the strided views the plan takes: a sparse buffer failed there with aten's
        # "Could not run 'aten::view' with arguments from the 'SparseCPU' backend" (round 15).
        _check_strided(self.what, values)
        if values.dim() != 2 or values.shape[1] != total:
            layout_text = ", ".join(f"{n}:{d}" for n, d in zip(names, dims))
            raise ValueError(
                f"{self.what} must be [B, {total}] (features {layout_text} side by side), got shape "
                f"{list(values.shape)}"
            )

    def plan(self, layout: FeatureLayout, params: Sequence[GroupParams], eps: float) -> BufferPlan:
        self.validate(layout)
        names, dims = self._names_dims(layout)
        return BufferPlan.build(layout, names, dims, self.values, params, eps)

    def _answer(self, y: torch.Tensor, out_features):
        """y as the input's kind; `out_features`: each key's output width (a list), or one int for all."""
        if self.keys is None:
            return y
        lengths = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features] * len(self.keys)
        return make_keyed_tensor(list(self.keys), lengths, y)

    def fused(self, plan: BufferPlan, params: Sequence[GroupParams], eps, out_features: int, chain=DEFAULT):
        return self._answer(plan.run(self.values, params, eps, chain), out_features)

    def reference(self, layout: FeatureLayout, feature_fn: FeatureFn, out_features: int):
        outs, offset = [], 0
        for name, d in zip(*self._names_dims(layout)):
            outs.append(feature_fn(name, self.values.narrow(1, offset, d)))
            offset += d
        return self._answer(torch.cat(outs, dim=1), out_features)


class StackedInput:
    """A 3D tensor, [B, F, D] (``feature_dim=1``) or [F, B, D] (``feature_dim=0``).

    Example:
        >>> import torch
        >>> from recfuse.module.features import FeatureLayout
        >>> StackedInput(torch.zeros(3, 5, 8), 1).validate(FeatureLayout.build(("a", "b", "c"), (8,) * 3))
        Traceback (most recent call last):
        ...
        ValueError: 3D input with feature_dim=1 must be [B, F, D] with F=3 features ['a', 'b', 'c'], got shape [3, 5, 8]; if it is [F, B, D], pass feature_dim=0
    """

    def __init__(self, x: torch.Tensor, feature_dim: int):
        self.x = x
        self.feature_dim = feature_dim

    def signature(self) -> Optional[tuple]:
        x, feature_dim = self.x, self.feature_dim
        if type(x) is not _Tensor or type(feature_dim) is not int or feature_dim not in (0, 1):
            return None
        return (StackedInput, feature_dim, x.shape, x.stride(), x.dtype, x.device)

    def validate(self, layout: FeatureLayout) -> None:
        x, feature_dim = self.x, self.feature_dim
        if len(layout.groups) != 1:
            raise ValueError(
                f"a 3D input needs every feature to have one embedding dim, but this module has "
                f"dims {dict(zip(layout.names, layout.dims))}; pass a [B, sum(D)] "
                f"tensor, a KeyedTensor or a dict"
            )
        check_feature_dim(feature_dim)
        F, D = len(layout.names), layout.groups[0].dim
        shape = "[F, B, D]" if feature_dim == 0 else "[B, F, D]"
        if x.shape[feature_dim] != F:
            hint = ""
            if x.shape[1 - feature_dim] == F:
                hint = f"; if it is {'[B, F, D]' if feature_dim == 0 else '[F, B, D]'}, pass feature_dim={1 - feature_dim}"
            raise ValueError(
                f"3D input with feature_dim={feature_dim} must be {shape} with F={F} features "
                f"{list(layout.names)}, got shape {list(x.shape)}{hint}"
            )
        if x.shape[2] != D:
            raise ValueError(
                f"3D input must have the features' embedding dim D={D} last, got shape {list(x.shape)}"
            )

    def plan(self, layout: FeatureLayout, params: Sequence[GroupParams], eps: float) -> StackedPlan:
        self.validate(layout)
        return StackedPlan.build(self.x, params, eps, self.feature_dim)

    def fused(self, plan: StackedPlan, params: Sequence[GroupParams], eps, out_features: int, chain=DEFAULT):
        return plan.run(self.x, params, eps, chain)

    def reference(self, layout: FeatureLayout, feature_fn: FeatureFn, out_features: int):
        outs = [feature_fn(name, self.x.select(self.feature_dim, f)) for f, name in enumerate(layout.names)]
        return torch.stack(outs, dim=self.feature_dim)


class DictInput:
    """A dict name -> [B, D] tensor, keys in any order.

    Example:
        >>> import torch
        >>> from recfuse.module.features import FeatureLayout
        >>> layout = FeatureLayout.build(("a", "b"), (4, 4))
        >>> DictInput({"a": torch.zeros(2, 4), "b": torch.zeros(3, 4)}).validate(layout)
        Traceback (most recent call last):
        ...
        ValueError: feature 'b': batch size 3 differs from feature 'a''s batch size 2
    """

    def __init__(self, x: Mapping):
        self.x = x

    def signature(self) -> Optional[tuple]:
        sig: list = [DictInput]
        for name, t in self.x.items():
            if type(t) is not _Tensor:
                return None
            sig += (name, t.shape, t.stride(), t.dtype, t.device)
        return tuple(sig)

    def validate(self, layout: FeatureLayout) -> None:
        layout.check_names(list(self.x), "input dict")
        batch = None
        dtype = None
        for name, t in self.x.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"feature {name!r}: input dict value must be a [B, D] tensor, got {got}")
            # One fused call computes in one dtype; promoting would change the other features'
            # outputs (a per-feature loop keeps each feature's dtype, or fails on the mismatch).
            if dtype is None:
                dtype = (name, t.dtype)
            elif t.dtype != dtype[1]:
                raise TypeError(
                    f"feature {name!r}: input dict value has dtype {t.dtype} but feature {dtype[0]!r} has "
                    f"{dtype[1]}; every feature of one call must share a dtype (cast them first)")
            layout.check_dims([name], [t.shape[1]], "input dict")
            if batch is None:
                batch = (name, t.shape[0])
            elif t.shape[0] != batch[1]:
                raise ValueError(
                    f"feature {name!r}: batch size {t.shape[0]} differs from feature "
                    f"{batch[0]!r}'s batch size {batch[1]}"
                )

    def plan(self, layout: FeatureLayout, params: Sequence[GroupParams], eps: float) -> DictPlan:
        self.validate(layout)
        return DictPlan.build(layout, self.x, params, eps)

    def fused(self, plan: DictPlan, params: Sequence[GroupParams], eps, out_features: int, chain=DEFAULT):
        return plan.run(self.x, params, eps, chain)

    def reference(self, layout: FeatureLayout, feature_fn: FeatureFn, out_features: int):
        return {name: feature_fn(name, t) for name, t in self.x.items()}
