"""`fuse_graph`: analyse a graph once, then let the enabled fusions claim and rewrite its groups
one at a time, keeping the analysis current after each rewrite (see `analysis.GraphAnalysis`).

Example:
    >>> import torch
    >>> from recfuse.fx.capture import capture
    >>> from recfuse.puzzler import split_stack
    >>> gm, _ = capture(split_stack, (torch.randn(96), 4, 8, torch.nn.Linear(8, 1)))
    >>> [g.fusion for g in fuse_graph(gm.graph, gm, fusions=["horizontal_chain"]).groups]
    ['horizontal_chain']
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn
from torch.fx import Graph, Node

from .analysis import GraphAnalysis
from .mutation import functionalize_inplace, keeps_node
from .plan import GroupPlan
from .registry import FUSIONS, Claim, Decline, select_fusions
from .report import Declined, FusionReport, GroupReport, NearMiss
from .rewrite import Rewriter, fold_split_guards

__all__ = ["fuse_graph"]


def fuse_graph(graph: Graph, root: Optional[nn.Module] = None, *, stack_params_once: bool = True,
               report: Optional[FusionReport] = None, fusions: Optional[Sequence[str]] = None,
               alone=None) -> FusionReport:
    """Run the registered fusions (or those named in `fusions`, in registry order) on `graph`
    until none applies; returns the report.

    Nodes must carry example values (``capture`` or Dynamo's ``example_value``). With
    ``stack_params_once`` per-slice parameters that are attributes of `root` are stacked into new
    parameters of `root`; otherwise they are stacked in the graph (Dynamo graphs, whose
    parameters are inputs). Dead nodes are removed; `root` is not recompiled. `alone` (a
    `plan.Alone`, from capture) names tensors of `root` known to be tensors of their own, which
    the tie checks then need not index.

    Raises:
        ValueError: `fusions` names a fusion that is not registered.

    Example:
        >>> import torch
        >>> from recfuse.fx.capture import capture
        >>> from recfuse.puzzler import split_stack
        >>> gm, _ = capture(split_stack, (torch.randn(96), 4, 8, torch.nn.Linear(8, 1)))
        >>> len(fuse_graph(gm.graph, gm).groups)
        1
    """
    enabled = select_fusions(fusions)
    report = report or FusionReport()
    report.fusions = [f.name for f in enabled]
    report.disabled = [f.name for f in FUSIONS if f not in enabled]
    kept_inplace = functionalize_inplace(graph, root)
    if kept_inplace:
        # The mutation is visible through an alias the graph does not show (an input, a
        # parameter, a view): any reordering could change what is read, so nothing is fused.
        report.reason = (f"in-place op {kept_inplace[0]} changes a tensor that is an input, parameter or "
                         f"view; fusing around it could change what is read, so the graph is left as it is")
        report.near_misses.append(NearMiss("graph", report.reason))
        return report
    analysis = GraphAnalysis(graph, root, alone)
    verdicts: dict = {}
    impure = keeps_node(root)
    while True:
        chosen = _first_claim(analysis, enabled, verdicts)
        if chosen is None:
            break
        fusion, plan, claim = chosen
        gid = len(report.groups)
        rw = Rewriter(graph, root, plan, gid, stack_params_once)
        anchor = plan.insert_before
        before_anchor = anchor.prev
        with graph.inserting_before(anchor):
            replaced_by = fusion.fuse(plan, claim, rw)
        inserted = _nodes_between(before_anchor, anchor)
        region = _region(plan, claim)
        erased, freed = _remove_dead(graph, list(region) + rw.replaced, impure)
        analysis.update(inserted, erased, region, freed)
        tried = enabled[: enabled.index(fusion)]
        report.groups.append(GroupReport(
            gid, plan.where, plan.size, plan.slices_text(), plan.ops_text(tuple(o.kind for o in claim.takes)),
            fusion.mode, replaced_by, dict(rw.stacked_params), notes=list(rw.notes), fusion=fusion.name,
            declined=[Declined(f.name, f.title, verdicts[plan, f.name].reason) for f in tried]))
    report.near_misses.extend(analysis.near_misses)
    for plan in analysis.groups():
        report.near_misses.append(NearMiss(plan.where, _unclaimed_reason(plan, enabled, verdicts)))
    if report.groups:
        graph.eliminate_dead_code(is_impure_node=impure)
        fold_split_guards(graph)
    elif analysis.sinks_seen == 0:
        report.reason = ("no torch.stack/torch.cat over two or more per-slice chains of layer_norm/tanh/"
                         "linear/relu was found")
    elif report.near_misses:
        report.reason = "every candidate was a near miss (see below)"
    return report


def _first_claim(analysis: GraphAnalysis, enabled: list, verdicts: dict):
    """The highest-priority fusion's first claimed group, in graph order; verdicts are cached per
    plan (a plan is replaced, never changed, when a rewrite touches it)."""
    plans = analysis.groups()
    for fusion in enabled:
        for plan in plans:
            v = verdicts.get((plan, fusion.name))
            if v is None:
                v = verdicts[plan, fusion.name] = fusion.match(plan, analysis)
                if not isinstance(v, (Claim, Decline)):
                    raise TypeError(f"fusion {fusion.name!r}: match returned {type(v).__name__}, expected a "
                                    f"recfuse.fx.Claim or Decline")
            if isinstance(v, Claim):
                return fusion, plan, v
    return None


def _unclaimed_reason(plan: GroupPlan, enabled: list, verdicts: dict) -> str:
    head = f"slices {plan.positions} ({plan.ops_text()}) left per slice: "
    if not enabled:
        return head + "no fusion is enabled (fusions=[])"
    return head + "; ".join(str(Declined(f.name, f.title, verdicts[plan, f.name].reason)) for f in enabled)


def _nodes_between(first_exclusive: Node, last_exclusive: Node) -> list:
    nodes, n = [], first_exclusive.next
    while n is not last_exclusive:
        nodes.append(n)
        n = n.next
    return nodes


def _region(plan: GroupPlan, claim: Claim) -> set:
    """The nodes of the group a rewrite may have changed or left dead."""
    region = {plan.sink}
    if plan.replaces is not None:
        region.add(plan.replaces.node)
    region.update(o.node for o in claim.takes)
    for c in plan.chains:
        region.update(c.seq)
        region.add(c.start)
    return region


def _remove_dead(graph: Graph, candidates: list, impure) -> tuple:
    """Erase the candidates nobody reads any more, and what only they read, as
    `Graph.eliminate_dead_code` would, without visiting the rest of the graph. Returns the
    erased nodes and the surviving nodes that lost readers."""
    erased: set = set()
    freed: set = set()
    work = list(candidates)
    names = _names_of(graph)
    erase = graph.erase_node
    while work:
        n = work.pop()
        if n in erased or getattr(n, "_erased", False) or n.users or impure(n):
            continue
        inputs = n.all_input_nodes
        erase(n)
        if names is not None:
            names.pop(n, None)  # see `_forget_name`
        erased.add(n)
        freed.update(inputs)
        work.extend(inputs)
    return erased, freed - erased


def _names_of(graph: Graph) -> Optional[dict]:
    """The namespace's node -> name dict (`_forget_name`), or None where fx keeps it otherwise."""
    names = getattr(getattr(graph, "_graph_namespace", None), "_obj_to_name", None)
    return names if isinstance(names, dict) else None


def _forget_name(graph: Graph, node: Node) -> None:
    """Drop an erased node from the graph's namespace, its name staying taken (later nodes are named
    as before). fx's namespace maps every node it ever named to its name, so erased nodes (30,000
    of a 10,000-feature model, with their metadata) lived as long as the graph, and every garbage
    collection walked them."""
    namespace = getattr(graph, "_graph_namespace", None)
    names = getattr(namespace, "_obj_to_name", None)
    if isinstance(names, dict):
        names.pop(node, None)
