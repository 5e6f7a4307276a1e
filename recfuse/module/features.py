"""The features a `FusedFeatureProcessor` was built for, and the checks of an input's features.

A `FeatureLayout` holds the names in the module's order, each feature's embedding dim, the
features grouped by dim (a group shares one op call and one set of stacked parameters), and
where each feature's parameters live (group, row). Inputs are matched against it by name.

Example:
    >>> layout = FeatureLayout.build(["user", "item", "ctx"], [8, 4, 8])
    >>> [(g.dim, g.names, g.suffix) for g in layout.groups]
    [(8, ('user', 'ctx'), '_d8'), (4, ('item',), '_d4')]
    >>> layout.slot["ctx"], layout.total_dim
    ((0, 1), 20)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from .._checks import check_eps

__all__ = ["DimGroup", "FeatureLayout", "check_config"]


@dataclass(frozen=True)
class DimGroup:
    """The features sharing one embedding dim: they share one op call and one set of parameters.

    Example:
        >>> DimGroup(dim=8, names=("a", "b"), suffix="").names
        ('a', 'b')
    """

    dim: int
    names: tuple[str, ...]  # in the module's configured order = row order of the stacked params
    suffix: str  # "" when the module has a single dim, else "_d{dim}" (parameter name suffix)


@dataclass(frozen=True)
class FeatureLayout:
    """Feature names and dims of a module, grouped by dim; see the module docstring.

    Example:
        >>> layout = FeatureLayout.build(["a", "b"], [4, 4])
        >>> layout.groups[0].suffix, layout.dim_of["b"]
        ('', 4)
    """

    names: tuple[str, ...]
    dims: tuple[int, ...]
    groups: tuple[DimGroup, ...]
    slot: dict[str, tuple[int, int]]  # name -> (group index, row within the group's parameters)
    dim_of: dict[str, int]
    total_dim: int  # a [B, sum(D)] buffer's second dim

    @classmethod
    def build(cls, names: tuple[str, ...], dims: tuple[int, ...]) -> "FeatureLayout":
        """Group checked names and dims (`check_config`) by dim, in first-appearance order.

        Example:
            >>> FeatureLayout.build(("a", "b", "c"), (2, 3, 2)).slot
            {'a': (0, 0), 'c': (0, 1), 'b': (1, 0)}
        """
        distinct = list(dict.fromkeys(dims))
        groups = tuple(
            DimGroup(
                dim=d,
                names=tuple(n for n, nd in zip(names, dims) if nd == d),
                suffix="" if len(distinct) == 1 else f"_d{d}",
            )
            for d in distinct
        )
        slot = {n: (g, j) for g, grp in enumerate(groups) for j, n in enumerate(grp.names)}
        return cls(tuple(names), tuple(dims), groups, slot, dict(zip(names, dims)), sum(dims))

    def check_names(self, names: Sequence[str], what: str) -> None:
        """Raise unless `names` holds every feature of the module exactly once, in any order.

        Example:
            >>> FeatureLayout.build(("a", "b"), (4, 4)).check_names(["b"], "input dict")
            Traceback (most recent call last):
            ...
            ValueError: input dict is missing feature(s) ['a'] that this FusedFeatureProcessor was built for
        """
        seen, duplicates = set(), []
        for n in names:
            if n in seen:
                duplicates.append(n)
            seen.add(n)
        if duplicates:
            raise ValueError(f"{what} has duplicate feature(s) {duplicates}")
        unknown = [n for n in names if n not in self.slot]
        if unknown:
            raise ValueError(
                f"{what} has feature(s) {unknown} unknown to this FusedFeatureProcessor, which was "
                f"built for {list(self.names)}"
            )
        missing = [n for n in self.names if n not in seen]
        if missing:
            raise ValueError(
                f"{what} is missing feature(s) {missing} that this FusedFeatureProcessor was built for"
            )

    def check_dims(self, names: Sequence[str], dims: Sequence[int], what: str) -> None:
        """Raise unless each named feature arrives with the embedding dim it was built with.

        Example:
            >>> FeatureLayout.build(("a",), (4,)).check_dims(["a"], [6], "KeyedTensor")
            Traceback (most recent call last):
            ...
            ValueError: feature 'a': KeyedTensor has embedding dim 6 but the module was built with embedding_dims['a'] = 4
        """
        for name, d in zip(names, dims):
            expected = self.dim_of[name]
            if d != expected:
                raise ValueError(
                    f"feature {name!r}: {what} has embedding dim {d} but the module was built "
                    f"with embedding_dims[{name!r}] = {expected}"
                )


def check_config(
    feature_names, embedding_dims: Union[int, Sequence[int]], out_features, eps
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Checked constructor arguments: (names, one dim per feature).

    Example:
        >>> check_config(["a", "b"], 8, 2, 1e-5)
        (('a', 'b'), (8, 8))
    """
    if isinstance(feature_names, str) or not isinstance(feature_names, Sequence):
        raise TypeError(f"feature_names must be a list of str, got {type(feature_names).__name__}")
    names = tuple(feature_names)
    if not names:
        raise ValueError("feature_names must name at least one feature")
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"feature_names must be str, got {n!r} ({type(n).__name__})")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"feature_names has duplicates {duplicates}")
    if isinstance(embedding_dims, int) and not isinstance(embedding_dims, bool):
        dims = (embedding_dims,) * len(names)
    elif isinstance(embedding_dims, (bool, str)) or not isinstance(embedding_dims, Sequence):
        raise TypeError(
            f"embedding_dims must be an int (one dim for all features) or a sequence of ints (one per "
            f"feature), got {embedding_dims!r} ({type(embedding_dims).__name__})")
    else:
        dims = tuple(embedding_dims)
        if len(dims) != len(names):
            raise ValueError(
                f"embedding_dims has {len(dims)} entries but feature_names has {len(names)}; give "
                f"one int for all or one per feature"
            )
    for n, d in zip(names, dims):
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"feature {n!r}: embedding dim must be an int >= 1, got {d!r}")
    if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"out_features must be an int >= 1, got {out_features!r}")
    check_eps(eps, finite=True)  # as transform, which leaves a norm with a non-finite eps unfused
    return names, dims
