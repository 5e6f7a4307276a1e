"""`FusionReport`: what `recfuse.transform` fused, what it left alone and why."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FusionReport", "GroupReport", "NearMiss", "Declined"]


@dataclass(frozen=True)
class Declined:
    """A fusion that passed over a group (`fusion` is its registry name), and why.

    Example:
        >>> str(Declined("vertical_ln_tanh_linear_relu", "vertical fusion", "dtype torch.int64"))
        'vertical fusion skipped (vertical_ln_tanh_linear_relu): dtype torch.int64'
    """

    fusion: str
    title: str
    reason: str

    def __str__(self):
        return f"{self.title or self.fusion} skipped ({self.fusion}): {self.reason}"


@dataclass
class NearMiss:
    """A place that looked fusable but was not (or not fully), and why.

    Example:
        >>> str(NearMiss("stack", "slice 6 applies sigmoid, the others tanh"))
        'stack: slice 6 applies sigmoid, the others tanh'
    """

    where: str
    reason: str

    def __str__(self):
        return f"{self.where}: {self.reason}"


@dataclass
class GroupReport:
    """One fused group of slices, as the report shows it: `fusion` names the fusion that claimed
    it, `declined` lists the fusions tried before it (`Declined`, with their reasons).

    Example:
        >>> GroupReport(0, "stack `stack`", 3, "x.narrow(1, 0, 8), ...", "layer_norm -> tanh",
        ...             "vertical", "1 recfuse.ln_tanh_linear_relu node").slices
        3
    """

    index: int
    where: str
    slices: int
    slice_labels: str
    ops: str
    mode: str
    replaced_by: str
    stacked_params: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    fusion: str = ""
    declined: list = field(default_factory=list)


@dataclass
class FusionReport:
    """What a transform fused (`groups`), what it did not (`near_misses`) and, when nothing was
    fused, why (`reason`); `fusions` are the fusions that were enabled, in priority order, and
    `disabled` the registered ones that were not. ``str(report)`` is a readable table.

    Example:
        >>> import torch, recfuse
        >>> from recfuse.puzzler import split_stack
        >>> r = recfuse.explain(split_stack, (torch.randn(4 * 3 * 8), 4, 8, torch.nn.Linear(8, 1)))
        >>> r.groups[0].slices, r.groups[0].mode
        (3, 'vertical')
        >>> print(r)  # doctest: +SKIP
    """

    model: str = ""
    capture: str = ""
    groups: list = field(default_factory=list)
    near_misses: list = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0
    fusions: list = field(default_factory=list)
    disabled: list = field(default_factory=list)

    @property
    def fused(self) -> bool:
        return bool(self.groups)

    def summary(self) -> str:
        """One line: the INFO log line of `transform`.

        Example:
            >>> FusionReport(model="m").summary()
            'recfuse: m: fused 0 group(s); nothing to fuse'
        """
        if not self.groups:
            why = self.reason or "nothing to fuse"
            return f"recfuse: {self.model}: fused 0 group(s); {why}"
        n = sum(g.slices for g in self.groups)
        v = sum(g.mode == "vertical" for g in self.groups)
        h = sum(g.mode == "horizontal" for g in self.groups)
        other = len(self.groups) - v - h
        others = f", {other} by other fusions" if other else ""
        return (f"recfuse: {self.model}: fused {len(self.groups)} group(s) of {n} slices "
                f"({v} into one fused op, {h} horizontal{others}), "
                f"{len(self.near_misses)} near-miss(es), {self.seconds:.2f}s")

    def __str__(self) -> str:
        lines = [f"recfuse fusion report for {self.model} (captured with {self.capture})"]
        if self.disabled:
            lines.append(f"fusions enabled: {', '.join(self.fusions) or 'none'}; disabled: {', '.join(self.disabled)}")
        if self.groups:
            rows = [("#", "where", "slices", "ops fused", "replaced by")]
            for g in self.groups:
                rows.append((str(g.index), g.where, str(g.slices), g.ops, g.replaced_by))
            lines += _table(rows)
            for g in self.groups:
                lines.append(f"  group {g.index} slices: {g.slice_labels}")
                if g.fusion:
                    lines.append(f"  group {g.index} claimed by {g.fusion}")
                for d in g.declined:
                    lines.append(f"  group {g.index} note: {d}")
                if g.stacked_params:
                    first = next(iter(g.stacked_params.items()))
                    lines.append(f"  group {g.index} stacked {len(g.stacked_params)} parameter(s) once, e.g. "
                                 f"{first[0]} <- {first[1][0]}, ... ({len(first[1])} rows)")
                for note in g.notes:
                    lines.append(f"  group {g.index} note: {note}")
        else:
            lines.append(f"nothing fused: {self.reason or 'no candidate found'}")
        if self.near_misses:
            lines.append("near misses:")
            rows = [("where", "reason")] + [(m.where, m.reason) for m in self.near_misses]
            lines += _table(rows)
        return "\n".join(lines)


def _table(rows) -> list:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  " + " | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            out.append("  " + "-+-".join("-" * w for w in widths))
    return out
