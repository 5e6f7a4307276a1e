"""The fusion registry: each fusion is a class that owns its decision (`match`) and its rewrite
(`fuse`), registered under a name, tried in priority order (the shape of Inductor's
group_batch_fusion).

For every planned group (`plan.GroupPlan`) the pass asks the enabled fusions in order; the first
that returns a `Claim` rewrites it, and each that returned a `Decline` is named in the report
with its reason. The built-in fusions live in `rules/`, one file each.

Example:
    >>> [f.name for f in FUSIONS]
    ['vertical_ln_tanh_linear_relu', 'vertical_feature_mlp', 'horizontal_chain']
    >>> [f.name for f in select_fusions(["horizontal_chain"])]
    ['horizontal_chain']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["Fusion", "Claim", "Decline", "FUSIONS", "register_fusion", "unregister_fusion", "select_fusions"]


@dataclass(frozen=True)
class Claim:
    """A fusion takes the group. `takes`: the plan's followers (ops after the stack) it fuses
    too; `detail`: anything else its `fuse` needs from the decision.

    Example:
        >>> Claim().takes
        ()
    """

    takes: tuple = ()
    detail: Any = None


@dataclass(frozen=True)
class Decline:
    """A fusion leaves the group to the next one, and says why in words.

    Example:
        >>> Decline("the chain is tanh, not layer_norm -> tanh").reason
        'the chain is tanh, not layer_norm -> tanh'
    """

    reason: str


class Fusion:
    """Base class of a fusion. Subclasses set `name` (the registry key, also what
    ``fusions=[...]`` names), `title` (how the report speaks of it) and `mode` (how
    `FusionReport.summary` counts it: 'vertical', 'horizontal' or anything else), and implement:

    * ``match(plan, analysis) -> Claim | Decline``: its own checks on one planned group.
    * ``fuse(plan, claim, rw) -> str``: rewrite the group with the `rewrite.Rewriter` `rw` (nodes
      are created at ``plan.insert_before`` by default; replace readers through `rw` so the
      pass removes what died) and return what replaced it, in words, for the report.

    Example:
        >>> class Nothing(Fusion):
        ...     name = "nothing"
        ...     def match(self, plan, analysis):
        ...         return Decline("never fuses")
        >>> Nothing().match(None, None).reason
        'never fuses'
    """

    name = "fusion"
    title = ""
    mode = "custom"

    def match(self, plan, analysis) -> "Claim | Decline":
        raise NotImplementedError

    def fuse(self, plan, claim: Claim, rw) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<fusion {self.name}>"


# The registry, in priority order.
FUSIONS: list = []


def register_fusion(fusion: Fusion, first: bool = False, *, before: Optional[str] = None) -> None:
    """Add `fusion` to the registry: last, first (`first`), or just before the fusion named `before`.

    Raises:
        ValueError: a fusion of that name is registered already, or `before` names none.

    Example:
        >>> class Nothing(Fusion):
        ...     name = "nothing"
        ...     def match(self, plan, analysis): return Decline("never fuses")
        >>> register_fusion(Nothing(), before="horizontal_chain")
        >>> [f.name for f in FUSIONS]
        ['vertical_ln_tanh_linear_relu', 'vertical_feature_mlp', 'nothing', 'horizontal_chain']
        >>> unregister_fusion("nothing").name
        'nothing'
    """
    if not isinstance(fusion, Fusion):
        raise TypeError(f"register_fusion expects a recfuse.fx.Fusion instance, got {type(fusion).__name__}")
    if any(f.name == fusion.name for f in FUSIONS):
        raise ValueError(f"a fusion named {fusion.name!r} is registered already (unregister_fusion it first)")
    if before is not None:
        FUSIONS.insert(_index(before, "before"), fusion)
    elif first:
        FUSIONS.insert(0, fusion)
    else:
        FUSIONS.append(fusion)


def unregister_fusion(name: str) -> Fusion:
    """Remove the fusion called `name` from the registry and return it.

    Example:
        >>> f = unregister_fusion("horizontal_chain"); register_fusion(f)
        >>> FUSIONS[-1].name
        'horizontal_chain'
    """
    return FUSIONS.pop(_index(name, "name"))


def select_fusions(names: Optional[Sequence[str]] = None) -> list:
    """The registered fusions named in `names`, in priority order (all of them for None).

    Raises:
        ValueError: a name is not registered (the message lists the known names).

    Example:
        >>> select_fusions([])
        []
    """
    if names is None:
        return list(FUSIONS)
    if isinstance(names, str):
        raise TypeError(f"fusions must be a list of fusion names, got the string {names!r}; "
                        f"write fusions=[{names!r}]")
    names = list(names)
    for n in names:
        _index(n, "fusions")
    return [f for f in FUSIONS if f.name in names]


def _index(name: str, argument: str) -> int:
    for i, f in enumerate(FUSIONS):
        if f.name == name:
            return i
    known = ", ".join(repr(f.name) for f in FUSIONS)
    raise ValueError(f"unknown fusion {name!r} in `{argument}`; registered fusions: {known}")
