"""`GraphAnalysis`: the candidate groups of a graph (as `GroupPlan`s) and its near misses, kept
up to date across rewrites.

Every torch.stack/torch.cat over two or more per-slice chains is a sink. Its slices are
partitioned by chain signature; each partition of two or more is planned (`plan.plan_group`),
the rest become near misses that say how a slice differs. A sink's result depends only on the
nodes it read (its footprint: chains, slice sources, the sink and what reads it), so after a
rewrite only the sinks whose footprint the rewrite touched are analysed again, plus sinks the
rewrite created: the cost of a rewrite is bounded by the size of what it touched, not the graph.

Example:
    >>> import torch
    >>> from recfuse.fx.capture import capture
    >>> from recfuse.puzzler import split_stack
    >>> gm, _ = capture(split_stack, (torch.randn(96), 4, 8, torch.nn.Linear(8, 1)))
    >>> a = GraphAnalysis(gm.graph, gm)
    >>> [(p.where, p.size) for p in a.groups()], a.near_misses
    ([('stack `stack`', 3)], [])
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.fx import Graph, Node

from .patterns import SliceChain, fmt_float, sink_info, walk_chain
from .plan import Alone, GroupPlan, TensorAliases, plan_group
from .report import NearMiss
from .values import tensor_dtype

__all__ = ["GraphAnalysis", "GENERATED"]

# meta key of nodes a rewrite created: never re-matched as per-slice chains
GENERATED = "recfuse_generated"


class _SinkResult:
    """What the analysis of one sink found, and the nodes whose change would invalidate it."""

    def __init__(self, groups: list, reads: set, reads_users: set, candidates: int):
        self.groups = groups
        self.reads = reads  # invalid when one of these is erased or gets other inputs
        self.reads_users = reads_users  # also invalid when one of these gets or loses a user
        self.candidates = candidates


class GraphAnalysis:
    """Candidate groups and near misses of `graph`; `update` after each rewrite keeps them current.

    `root` is the module owning the graph's attributes (None for a bare graph).

    Example:
        >>> import torch, torch.fx
        >>> a = GraphAnalysis(torch.fx.symbolic_trace(lambda x: x.tanh()).graph, None)
        >>> a.groups(), a.near_misses, a.sinks_seen
        ([], [], 0)
    """

    def __init__(self, graph: Graph, root: Optional[nn.Module], alone: Optional[Alone] = None):
        self.graph = graph
        self.root = root
        self._alone = alone  # tensors of root TensorAliases need not index (see plan.Alone)
        self.near_misses: list[NearMiss] = []
        self._seen_misses: set = set()
        self._sinks: dict[Node, _SinkResult] = {}
        self._readers: dict[Node, set] = {}  # node -> sinks whose result read it
        self._user_readers: dict[Node, set] = {}  # node -> sinks whose result read its readers
        self._by_target: dict[str, list] = {}  # get_attr / call_module target -> nodes
        self._aliases: Optional[TensorAliases] = None
        for n in graph.nodes:
            self._index_target(n)
        for n in graph.nodes:
            if sink_info(n) is not None:
                self._analyze(n)

    # -- queries ----------------------------------------------------------------------------

    def groups(self) -> list[GroupPlan]:
        """Every planned group, sinks in graph order."""
        return [g for s in sorted(self._sinks) for g in self._sinks[s].groups]

    @property
    def sinks_seen(self) -> int:
        """How many sinks have two or more per-slice chains."""
        return sum(r.candidates >= 2 for r in self._sinks.values())

    def attr_uses(self, qualname: str) -> int:
        """How many places read attribute `qualname` of the root: its get_attr nodes' uses, and calls
        of the module owning it (a call reads all of its module's parameters)."""
        by_target = self._by_target
        uses = 0
        if qualname in by_target:
            for n in self._live(qualname):
                if n.op == "get_attr":
                    uses += max(len(n.users), 1)
        dot = qualname.find(".")
        while dot >= 0:  # each owning module's path: "a", "a.b" of "a.b.weight"
            path = qualname[:dot]
            if path in by_target:
                for n in self._live(path):
                    if n.op == "call_module":
                        uses += 1
            dot = qualname.find(".", dot + 1)
        return uses

    @property
    def aliases(self) -> Optional[TensorAliases]:
        """The root's tensors by identity and storage, built on first use. Rewrites add only new
        tensors (stacked copies), which alias nothing the plans read."""
        if self._aliases is None and self.root is not None:
            self._aliases = TensorAliases(self.root, self._alone)
        return self._aliases

    def _live(self, target: str) -> list:
        nodes = self._by_target.get(target)
        if nodes is None:
            return []
        for n in nodes:
            if getattr(n, "_erased", False):
                nodes[:] = [n for n in nodes if not getattr(n, "_erased", False)]
                break
        return nodes

    def _index_target(self, n: Node) -> None:
        if n.op in ("get_attr", "call_module") and isinstance(n.target, str):
            self._by_target.setdefault(n.target, []).append(n)

    # -- incremental update -----------------------------------------------------------------

    def update(self, inserted: list, erased: Iterable[Node], changed: Iterable[Node],
               lost_readers: Iterable[Node] = ()) -> None:
        """Bring the analysis up to date after a rewrite that created `inserted`, erased `erased`,
        may have changed the inputs or readers of `changed`, and left `lost_readers` with fewer
        readers. Only sinks that read one of these (or are one) are analysed again."""
        inserted_set, erased = set(inserted), set(erased)
        changed = set(changed)
        for n in inserted:
            n.meta[GENERATED] = True
            self._index_target(n)
        new_inputs = changed | erased
        new_readers = changed | set(lost_readers)
        for n in inserted:
            new_readers.update(n.all_input_nodes)
            new_inputs.update(u for u in n.users if u not in inserted_set)
        dirty = set()
        for n in new_inputs:
            dirty |= self._readers.get(n, set())
        for n in new_readers:
            dirty |= self._user_readers.get(n, set())
        for sink in dirty:
            self._forget(sink)
        dirty |= {n for n in new_inputs | new_readers | inserted_set if n in self._sinks or sink_info(n) is not None}
        for sink in sorted(s for s in dirty if s not in erased and not getattr(s, "_erased", False)):
            self._analyze(sink)

    def _forget(self, sink: Node) -> None:
        result = self._sinks.pop(sink, None)
        if result is None:
            return
        for n in result.reads:
            self._readers.get(n, set()).discard(sink)
        for n in result.reads_users:
            self._user_readers.get(n, set()).discard(sink)

    # -- one sink ---------------------------------------------------------------------------

    def _analyze(self, sink: Node) -> None:
        self._forget(sink)
        info = sink_info(sink)
        if info is None:
            return
        kind, inputs, dim = info
        chains = [walk_chain(x, self.root) for x in inputs]
        cand = [i for i, c in enumerate(chains) if c.ops and not any(GENERATED in n.meta for n in c.seq)]
        reads, reads_users = {sink}, {sink}
        reads_users.update(sink.users)
        for c in chains:
            reads.update(_chain_reads(c))
            reads_users.update(c.seq)
        groups: list[GroupPlan] = []
        if len(cand) >= 2:
            groups = self._plan_sink(sink, kind, dim, inputs, chains, cand)
        for g in groups:
            if g.replaces is not None:
                reads_users.add(g.replaces.node)
            for op in g.followers:
                reads.add(op.node)
                reads_users.add(op.node)
                reads.update(r.node for r in op.params.values() if r is not None and r.node is not None)
        self._sinks[sink] = _SinkResult(groups, reads, reads_users, len(cand))
        for n in reads:
            self._readers.setdefault(n, set()).add(sink)
        for n in reads_users:
            self._user_readers.setdefault(n, set()).add(sink)

    def _plan_sink(self, sink: Node, kind: str, dim: int, inputs: list, chains: list, cand: list) -> list:
        where = f"{kind} `{sink.name}`"
        counts = Counter(n for i in cand for n in set(chains[i].seq))
        shared = [i for i in cand if any(counts[n] > 1 for n in chains[i].seq)]
        if shared:
            self._miss(where, f"slices {shared} share per-slice op nodes (the same value stacked twice); "
                              f"left per slice")
            cand = [i for i in cand if i not in shared]
        quantized = [i for i in cand if _quantized(chains[i])]
        if quantized:
            # an op on quantized tensors requantizes to its own output scale, so a stack before the
            # ops (one scale for all slices) computes other numbers than per-slice ops then a stack
            self._miss(where, f"slices {quantized} are quantized tensors ({tensor_dtype(chains[quantized[0]].start)}); "
                              f"left per slice")
            cand = [i for i in cand if i not in quantized]
        by_sig: dict[Any, list] = {}
        for i in cand:
            by_sig.setdefault(chains[i].signature(), []).append(i)
        parts = sorted(by_sig.values(), key=len, reverse=True)
        major = parts[0] if parts else []
        for part in parts:
            if len(part) >= 2:
                continue
            i = part[0]
            ref = major if len(major) >= 2 else [j for j in cand if j != i][:1]
            if not ref:
                continue
            label = "the others" if len(major) >= 2 else f"slice {ref[0]}"
            self._miss(where, diff_reason(i, chains[i], chains[ref[0]], label))
        multi = [p for p in parts if len(p) >= 2]
        for p in multi[1:]:
            first = p[0]
            self._miss(where, f"slices {p} fused as a separate group: "
                              + diff_reason(first, chains[first], chains[major[0]], "the others").split(": ", 1)[-1])
        groups = []
        for part in multi:
            plan = plan_group(sink, kind, dim, part, [chains[i] for i in part], len(part) == len(inputs),
                              self.root, self.attr_uses, self.aliases)
            if isinstance(plan, str):
                self._miss(where, plan)
            else:
                groups.append(plan)
        return groups

    def _miss(self, where: str, reason: str) -> None:
        if (where, reason) not in self._seen_misses:
            self._seen_misses.add((where, reason))
            self.near_misses.append(NearMiss(where, reason))


def _chain_reads(c: SliceChain) -> set:
    reads = set(c.seq)
    reads.update((c.start, c.end))
    reads.update(c.start.all_input_nodes)
    if c.slice is not None:
        reads.add(c.slice.source)
    for o in c.ops:
        reads.update(r.node for r in o.params.values() if r is not None and r.node is not None)
    return reads


_QUANTIZED = frozenset({torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def _quantized(c: SliceChain) -> bool:
    """Whether a value of the chain (its input, an op's result, its end) is a quantized tensor
    (a model converted by torch.ao.quantization): fusion leaves such chains per slice."""
    return any(tensor_dtype(n) in _QUANTIZED for n in (c.start, c.end, *c.seq) if isinstance(n, Node))


def diff_reason(i: int, chain: SliceChain, ref: SliceChain, ref_label: str) -> str:
    """Why slice `i`'s chain cannot be batched with `ref`'s, in words.

    Example:
        >>> import torch, torch.fx
        >>> gm = torch.fx.symbolic_trace(lambda a, b: torch.stack([a.tanh(), b.sigmoid()]))
        >>> a, b = [walk_chain(x, gm) for x in list(gm.graph.nodes)[-2].args[0]]
        >>> diff_reason(1, b, a, "slice 0")
        'slice 1 applies sigmoid, slice 0 tanh'
    """
    si, sr = chain.signature(), ref.signature()
    ki, kr = [o.kind for o in chain.ops], [o.kind for o in ref.ops]
    if ki != kr:
        if len(ki) == len(kr):
            j = next(j for j in range(len(ki)) if ki[j] != kr[j])
            return f"slice {i} applies {ki[j]}, {ref_label} {kr[j]}"
        return f"slice {i} runs {chain.describe()}, {ref_label} {ref.describe()}"
    if si[0] != sr[0] or si[2] != sr[2]:
        return f"slice {i} has shape {list(si[2] or si[0] or [])}, {ref_label} {list(sr[2] or sr[0] or [])}"
    for oi, orf in zip(chain.ops, ref.ops):
        if oi.attrs != orf.attrs:
            ai, ar = dict(oi.attrs), dict(orf.attrs)
            for k in ai:
                if ai[k] != ar.get(k):
                    fi = fmt_float(ai[k]) if isinstance(ai[k], float) else ai[k]
                    fr = fmt_float(ar[k]) if isinstance(ar.get(k), float) else ar.get(k)
                    return f"slice {i}: {oi.kind} {k} {fi} vs {fr} ({ref_label})"
        pi = {k: v is not None for k, v in oi.params.items()}
        pr = {k: v is not None for k, v in orf.params.items()}
        if pi != pr:
            return (f"slice {i}: {oi.kind} parameters {sorted(k for k, v in pi.items() if v)} vs "
                    f"{sorted(k for k, v in pr.items() if v)} ({ref_label})")
    if si[1] != sr[1]:
        return f"slice {i} has dtype {si[1]}, {ref_label} {sr[1]}"
    return f"slice {i}: chain differs from {ref_label} ({chain.describe()}; parameter shapes or output shape)"
