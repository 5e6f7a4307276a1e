"""Fusions as data: each is a small object with `match(ctx) -> groups` and `rewrite(ctx, group)`,
kept in an ordered registry (the shape of Inductor's group_batch_fusion).

`analyze` does the shared work once per round: it finds every torch.stack/torch.cat whose inputs
are per-slice chains, partitions the slices by chain signature, and plans each partition (how
to build the batched input without copying, which parameters to stack, whether the stack is
followed by Linear -> relu). The fusions then pick the groups they handle:

* `VerticalLnTanhLinearRelu`: LayerNorm -> tanh -> Linear -> relu (the Linear and relu per slice
  or after the stack) becomes one `recfuse.ln_tanh_linear_relu` node.
* `HorizontalChain`: any other chain of recognised ops runs once on the batched tensor.

Correctness rules: a rewrite only replaces uses of nodes with values equal to theirs (a view of
the batched result for a per-slice intermediate, the batched result for the stack); nothing that is
still used is erased, so an unplanned side use keeps its per-slice computation.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Graph, Node

from . import runtime
from .patterns import (ParamRef, SliceChain, classify, fmt_float, sink_info, tensor_dtype,
                       tensor_shape, walk_chain)

__all__ = ["SliceGroup", "NearMiss", "Fusion", "VerticalLnTanhLinearRelu", "HorizontalChain", "FUSIONS",
           "register_fusion", "analyze", "MatchContext"]

logger = logging.getLogger("recfuse")

_GENERATED = "recfuse_generated"
_VERTICAL = ("layer_norm", "tanh", "linear", "relu")


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
class SliceGroup:
    """Slices of one sink whose chains are identical, with the plan to batch them.

    Example:
        >>> SliceGroup.__name__
        'SliceGroup'
    """

    sink: Node
    sink_kind: str
    sink_dim: int
    positions: list
    chains: list
    mode: str = "horizontal"  # or 'vertical'
    source: tuple = ()  # ('view'|'gather', src, dim, start, count, length, index) or ('stack',)
    fd: int = 0  # feature dim of the batched input
    reshape_rows: bool = False  # per-slice reshape to [rows, D] before the chain
    eff: Optional[tuple] = None  # (node replaced, stack dim, 'stack'|'cat')
    tail: list = field(default_factory=list)  # Linear/relu ops after the stack
    params: list = field(default_factory=list)  # per op: {name: ('shared', ref)|('stacked', refs)|None}
    side: list = field(default_factory=list)  # (slice i, op j, node, users needing a view)
    notes: list = field(default_factory=list)
    # filled by rewrite, for the report
    replaced_by: str = ""
    stacked_params: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.chains)

    def ops_text(self) -> str:
        kinds = [o.kind for o in self.chains[0].ops] + [o.kind for o in self.tail]
        return " -> ".join(kinds)

    def slices_text(self, limit: int = 6) -> str:
        labels = [c.slice.label() if c.slice is not None else c.start.name for c in self.chains]
        if len(labels) > limit:
            return ", ".join(labels[: limit - 2]) + f", ... ({len(labels) - limit + 1} more), " + labels[-1]
        return ", ".join(labels)


# ---------------------------------------------------------------------------------------------
# analysis


def _attr_tensor(root, qualname: str):
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def _attr_uses(graph: Graph, root) -> Counter:
    uses: Counter = Counter()
    for n in graph.nodes:
        if n.op == "get_attr":
            uses[n.target] += max(len(n.users), 1)
        elif n.op == "call_module" and root is not None:
            try:
                mod = root.get_submodule(n.target)
            except AttributeError:
                continue
            for pname, _ in itertools.chain(mod.named_parameters(recurse=True), mod.named_buffers(recurse=True)):
                uses[f"{n.target}.{pname}"] += 1
    return uses


def _diff_reason(i: int, chain: SliceChain, ref: SliceChain, ref_label: str) -> str:
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
            return f"slice {i}: {oi.kind} parameters {sorted(k for k, v in pi.items() if v)} vs {sorted(k for k, v in pr.items() if v)} ({ref_label})"
    if si[1] != sr[1]:
        return f"slice {i} has dtype {si[1]}, {ref_label} {sr[1]}"
    return f"slice {i}: chain differs from {ref_label} ({chain.describe()}; parameter shapes or output shape)"


class MatchContext:
    """One round of analysis of a graph: candidate groups (planned) and near-misses.

    Example:
        >>> import torch, torch.fx
        >>> ctx = MatchContext(torch.fx.symbolic_trace(lambda x: x.tanh()).graph, None)
        >>> ctx.groups, [str(m) for m in ctx.near_misses]
        ([], [])
    """

    def __init__(self, graph: Graph, root: Optional[nn.Module], stack_params_once: bool = True):
        self.graph = graph
        self.root = root
        self.stack_params_once = stack_params_once and root is not None
        self.groups: list[SliceGroup] = []
        self.near_misses: list[NearMiss] = []
        self.sinks_seen = 0
        self._order = {n: i for i, n in enumerate(graph.nodes)}
        self._attr_uses = _attr_uses(graph, root)
        for node in list(graph.nodes):
            info = sink_info(node)
            if info is not None:
                self._analyze_sink(node, *info)

    # -- sinks ------------------------------------------------------------------------------

    def _analyze_sink(self, sink: Node, kind: str, inputs: list, dim: int) -> None:
        where = f"{kind} `{sink.name}`"
        chains = [walk_chain(x, self.root) for x in inputs]
        cand = [i for i, c in enumerate(chains) if c.ops and not any(n.meta.get(_GENERATED) for n in c.seq)]
        if len(cand) < 2:
            return
        self.sinks_seen += 1
        counts = Counter(n for i in cand for n in set(chains[i].seq))
        shared = [i for i in cand if any(counts[n] > 1 for n in chains[i].seq)]
        if shared:
            self.near_misses.append(NearMiss(where, f"slices {shared} share per-slice op nodes (the same "
                                                    f"value stacked twice); left per slice"))
            cand = [i for i in cand if i not in shared]
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
            self.near_misses.append(NearMiss(where, _diff_reason(i, chains[i], chains[ref[0]], label)))
        multi = [p for p in parts if len(p) >= 2]
        if len(multi) > 1:
            for p in multi[1:]:
                first = p[0]
                self.near_misses.append(NearMiss(
                    where, f"slices {p} fused as a separate group: "
                           + _diff_reason(first, chains[first], chains[major[0]], "the others").split(": ", 1)[-1]))
        for part in multi:
            g = SliceGroup(sink, kind, dim, part, [chains[i] for i in part])
            reason = self._plan(g, covers_all=len(part) == len(inputs))
            if reason is None:
                self.groups.append(g)
            else:
                self.near_misses.append(NearMiss(where, reason))

    # -- planning ---------------------------------------------------------------------------

    def _plan(self, g: SliceGroup, covers_all: bool) -> Optional[str]:
        c0 = g.chains[0]
        Fn = g.size
        core = c0.core_in
        out = c0.core_out
        start_shape = tensor_shape(c0.start)
        if core is None or out is None or start_shape is None:
            return "shapes unknown (pass example_inputs)"
        if len(core) == 0:
            return "per-slice values are scalars"
        # parameters
        for j, op in enumerate(c0.ops):
            specs = {}
            for name, ref0 in op.params.items():
                refs = [c.ops[j].params.get(name) for c in g.chains]
                if all(r is None for r in refs):
                    specs[name] = None
                    continue
                if any(r is None or r.key is None for r in refs):
                    return f"{op.kind} {name} is a constant tensor in the code; cannot batch it"
                keys = [r.key for r in refs]
                if len(set(keys)) == 1:
                    specs[name] = ("shared", refs[0])
                elif len(set(keys)) == len(keys):
                    for r in refs:
                        if r.attr is not None and self._attr_uses[r.attr] > 1:
                            return f"{op.kind} {name} `{r.attr}` is also used outside this group; stacking it would untie it"
                    shapes = {tuple(_ref_value_shape(r, self.root) or ()) for r in refs}
                    if len(shapes) != 1:
                        return f"{op.kind} {name} shapes differ across slices: {sorted(shapes)}"
                    specs[name] = ("stacked", refs)
                else:
                    return f"{op.kind} {name} is shared by some slices but not all; batching would untie it"
            g.params.append(specs)
            if op.kind == "layer_norm":
                ns = op.attr("shape")
                if tuple(core[len(core) - len(ns):]) != tuple(ns):
                    return f"layer_norm normalized_shape {list(ns)} does not match the slice shape {list(core)}"
        # where the batched input comes from
        g.source, fd, slice_shape = _source_plan(g)
        if slice_shape != start_shape:
            return f"internal: slice shape {start_shape} vs planned {slice_shape}"
        if c0.pre and tuple(core) != tuple(start_shape):
            if len(core) != 2:
                return f"per-slice reshape from {list(start_shape)} to {list(core)} is not supported (only to [rows, D])"
            g.reshape_rows = True
            fd = 0
        nd = len(core)  # core dims; batched tensors have nd + 1
        if fd == nd:  # features after the last dim: put them first so row ops stay row ops
            fd = 0
        ln_dims = max((len(o.attr("shape")) for o in c0.ops if o.kind == "layer_norm"), default=1)
        if fd > nd - ln_dims:
            fd = 0
        g.fd = fd
        # the sink: is the whole stack/cat replaceable by the batched result?
        post_none = tensor_shape(c0.end) == tuple(out)
        if covers_all:
            if g.sink_kind == "stack" and post_none:
                g.eff = (g.sink, g.sink_dim % (len(out) + 1), "stack")
            elif g.sink_kind == "cat":
                p = tensor_shape(c0.end)
                cd = g.sink_dim % len(p)
                if not post_none and p == tuple(out[:cd]) + (1,) + tuple(out[cd:]):
                    g.eff = (g.sink, cd, "stack")
                elif post_none:
                    # cat -> view to 3D is a stack; other users may only read the cat's shape
                    # (``y.view(y.shape[0], F, -1)``), which dies with it.
                    want = tuple(out[:cd]) + (Fn,) + tuple(out[cd:])
                    views = [u for u in g.sink.users if (lambda o: o is not None and o.kind == "view")(classify(u, self.root))
                             and tensor_shape(u) == want]
                    others = [u for u in g.sink.users if u not in views]
                    if len(views) == 1 and all(_is_shape_query(u) and _feeds_only(u, views) for u in others):
                        g.eff = (views[0], cd, "stack")
                    else:
                        g.eff = (g.sink, cd, "cat")
        # side uses: per-slice values used by something other than the next op of the chain
        replaced = g.eff[0] if g.eff else None
        for i, c in enumerate(g.chains):
            inner = set(c.seq)
            for j, op in enumerate(c.ops):
                ext = [u for u in op.node.users if u not in inner and not (replaced is g.sink and u is g.sink)]
                if replaced is not None and replaced is not g.sink and j == len(c.ops) - 1:
                    ext = [u for u in ext if u is not g.sink]
                if ext:
                    g.side.append((i, j, op.node, ext))
        # vertical: the chain (with a Linear/relu tail after the stack) is exactly LN -> tanh -> Linear -> relu
        kinds = tuple(o.kind for o in c0.ops)
        if nd == 2 and kinds == _VERTICAL[: len(kinds)] and len(kinds) >= 2:
            tail = self._tail(g, _VERTICAL[len(kinds):], out) if len(kinds) < 4 else []
            last = len(c0.ops) - 1
            # Without a replaceable sink every use of a slice's final value is served by a view
            # of the fused result (`_finish`), so only uses of intermediates block the fusion.
            blocking = [s for s in g.side if not (g.eff is None and s[1] == last)]
            if tail is not None and c0.ops[0].attr("shape") == (core[-1],):
                if blocking:
                    i, j, node, users = blocking[0]
                    g.notes.append(f"vertical fusion skipped: slice {g.positions[i]}'s {g.chains[i].ops[j].kind} "
                                   f"output `{node.name}` is also used by `{users[0].name}` (served by a view)")
                elif tensor_dtype(c0.start) not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
                    g.notes.append("vertical fusion skipped: dtype not supported by the fused op")
                else:
                    g.mode, g.tail = "vertical", tail
        # dependencies must all exist before the first place a replaced value is used
        first_use = [g.eff[0]] if g.eff else []
        first_use += [u for (_, _, _, us) in g.side for u in us]
        if g.mode == "vertical" and not g.eff:
            first_use += list(c0.ops[-1].node.users)
        deps = [g.source[1]] if g.source[0] != "stack" else [c.start for c in g.chains]
        for specs in g.params:
            for spec in specs.values():
                if spec is None:
                    continue
                refs = [spec[1]] if spec[0] == "shared" else spec[1]
                deps += [r.node for r in refs if r.node is not None]
        for op in g.tail:
            for r in op.params.values():
                if r is not None and r.node is not None:
                    deps.append(r.node)
        if not first_use:
            return "no use of the per-slice results found"
        g._insert_before = min(first_use, key=lambda n: self._order.get(n, 1 << 60))
        last_dep = max((self._order.get(d, -1) for d in deps), default=-1)
        if last_dep >= self._order.get(g._insert_before, 1 << 60):
            return "per-slice results are used before all slices exist (interleaved code); left per slice"
        return None

    def _tail(self, g: SliceGroup, needed: tuple, out: tuple) -> Optional[list]:
        """Ops after the stack that complete the vertical chain, or None when they are not there."""
        if g.eff is None or g.eff[2] != "stack" or g.eff[1] >= len(out):
            return None
        cur, tail = g.eff[0], []
        for kind in needed:
            users = list(cur.users)
            if len(users) != 1:
                return None
            op = classify(users[0], self.root)
            if op is None or op.kind != kind or op.data is not cur:
                return None
            if kind == "linear":
                w = op.params.get("weight")
                shape = _ref_value_shape(w, self.root) if w is not None else None
                if shape is None or len(shape) != 2 or shape[1] != out[-1]:
                    return None
                b = op.params.get("bias")
                if b is not None and b.key is None:
                    return None
            tail.append(op)
            cur = users[0]
        return tail


def _is_shape_query(n: Node) -> bool:
    if n.op == "call_function" and n.target is getattr and len(n.args) == 2 and n.args[1] == "shape":
        return True
    return n.op == "call_method" and n.target in ("size", "dim")


def _feeds_only(n: Node, targets: list, depth: int = 3) -> bool:
    """True if every use of `n` (a shape query) ends, within `depth` steps, in one of `targets`."""
    if depth == 0:
        return False
    return all(u in targets or (u.op == "call_function" and _feeds_only(u, targets, depth - 1)) for u in n.users)


def _ref_value_shape(r: ParamRef, root) -> Optional[tuple]:
    if r.node is not None:
        return tensor_shape(r.node)
    if r.attr is not None and root is not None:
        t = _attr_tensor(root, r.attr)
        return tuple(t.shape) if t is not None else None
    return None


def _source_plan(g: SliceGroup):
    """How to build the batched input: a view of the common source when the slices tile it in
    order (zero-copy), an index_select when they are aligned but permuted, else a stack."""
    infos = [c.slice for c in g.chains]
    Fn = g.size
    i0 = infos[0]
    if all(i is not None and i.kind in ("range", "index") for i in infos) and all(
        (i.source, i.kind, i.dim, i.length) == (i0.source, i0.kind, i0.dim, i0.length) for i in infos
    ):
        src_shape = tensor_shape(i0.source)
        L = i0.length
        starts = [i.start for i in infos]
        base = min(starts)
        if src_shape is not None and L > 0 and all((s - base) % L == 0 for s in starts):
            idx = [(s - base) // L for s in starts]
            length = L if i0.kind == "range" else None
            # Slices that tile the whole dim are sized from the source at run time (-1): the
            # dim may be the batch (split of [F*B, D] on dim 0).
            count = max(idx) + 1
            if length is not None and base == 0 and count * L == src_shape[i0.dim]:
                length = -1
            d = i0.dim
            if i0.kind == "range":
                slice_shape = tuple(src_shape[:d]) + (L,) + tuple(src_shape[d + 1:])
            else:
                slice_shape = tuple(src_shape[:d]) + tuple(src_shape[d + 1:])
            if idx == list(range(Fn)):
                return ("view", i0.source, d, base, Fn, length, None), d, slice_shape
            if len(set(idx)) == Fn:
                return ("gather", i0.source, d, base, count, length, tuple(idx)), d, slice_shape
    return ("stack",), 0, tensor_shape(g.chains[0].start)


# ---------------------------------------------------------------------------------------------
# rewriting


class _Emitter:
    """Creates nodes of the batched computation and the stacked parameters."""

    def __init__(self, ctx: MatchContext, g: SliceGroup, gid: int):
        self.ctx, self.g, self.gid = ctx, g, gid
        self.graph = ctx.graph

    def fn(self, target, args, kwargs=None) -> Node:
        n = self.graph.call_function(target, tuple(args), kwargs or {})
        n.meta[_GENERATED] = True
        return n

    def method(self, name, args) -> Node:
        n = self.graph.call_method(name, tuple(args))
        n.meta[_GENERATED] = True
        return n

    def param(self, spec, role: str) -> Optional[Node]:
        if spec is None:
            return None
        how, ref = spec
        if how == "shared":
            return self.graph.get_attr(ref.attr) if ref.attr is not None else ref.node
        refs = ref
        root = self.ctx.root
        tensors = [_attr_tensor(root, r.attr) if r.attr is not None else None for r in refs]
        # One stacked tensor has one requires_grad: with frozen and trainable rows mixed, the
        # originals stay the parameters and are stacked in the graph on each call.
        mixed = len({t.requires_grad for t in tensors if t is not None}) > 1
        # Gradient hooks on a per-feature parameter (clipping, logging) must keep firing: its
        # gradient must keep flowing to it, which an in-graph stack does and a new parameter not.
        hooked = any(t is not None and (getattr(t, "_backward_hooks", None) or
                                        getattr(t, "_post_accumulate_grad_hooks", None)) for t in tensors)
        if self.ctx.stack_params_once and not (mixed or hooked) and all(r.attr is not None for r in refs):
            stacked = torch.stack([t.detach() for t in tensors]).clone()
            name = _unique_attr(root, f"recfuse_g{self.gid}_{role}")
            if all(isinstance(t, nn.Parameter) for t in tensors):
                root.register_parameter(name, nn.Parameter(stacked, requires_grad=any(t.requires_grad for t in tensors)))
            else:
                root.register_buffer(name, stacked)
            self.g.stacked_params[name] = [r.attr for r in refs]
            return self.graph.get_attr(name)
        nodes = [self.graph.get_attr(r.attr) if r.attr is not None else r.node for r in refs]
        return self.fn(torch.stack, [nodes])


def _unique_attr(root, base: str) -> str:
    name, k = base, 1
    while hasattr(root, name):
        name, k = f"{base}_{k}", k + 1
    return name


def _emit_input(e: _Emitter, layout: int) -> Node:
    g = e.g
    if g.source[0] == "stack":
        x = e.fn(torch.stack, [[c.start for c in g.chains], 0])
        fd = 0
    elif g.source[0] == "view":
        _, src, d, start, count, length, _ = g.source
        x = e.fn(runtime.slices_view, [src, d, start, count, length])
        fd = d
    else:
        _, src, d, start, count, length, index = g.source
        x = e.fn(runtime.gather_slices, [src, d, start, count, length, index])
        fd = d
    if g.reshape_rows:
        x = e.fn(runtime.rows_view, [x, fd, g.chains[0].core_in[-1]])
        fd = 0
    if fd != layout:
        x = e.fn(torch.movedim, [x, fd, layout])
    return x


def _layout(g: SliceGroup) -> int:
    nd = len(g.chains[0].core_in)
    if g.eff is not None and g.eff[1] < nd:
        return g.eff[1]
    return g.fd


def _finish(e: _Emitter, g: SliceGroup, out: Node, layout: int, inter: Optional[list]) -> None:
    graph = e.graph
    if g.eff is not None:
        node, sd, how = g.eff
        if g.mode == "vertical" and how == "stack" and sd == layout:
            val = out
        else:
            val = e.fn(runtime.from_batched, [out, layout, sd, how == "cat"])
        target = g.tail[-1].node if g.tail else node
        target.replace_all_uses_with(val)
    else:
        # The stack is not ours to replace: serve each slice's result as a view.
        last = len(g.chains[0].ops) - 1
        for i, c in enumerate(g.chains):
            sel = e.fn(torch.select, [out, layout, i])
            c.ops[last].node.replace_all_uses_with(sel)
    for i, j, node, users in g.side:
        if inter is None or j == len(g.chains[0].ops) - 1 and g.eff is None:
            continue
        sel = e.fn(torch.select, [inter[j], layout, i])
        for u in users:
            u.replace_input_with(node, sel)


class Fusion:
    """Base of a fusion: `match` picks the planned groups it handles, `rewrite` replaces one.

    Example:
        >>> class Nothing(Fusion):
        ...     name = "nothing"
        ...     def match(self, ctx): return []
        >>> Nothing().match(None)
        []
    """

    name = "fusion"

    def match(self, ctx: MatchContext) -> list:
        raise NotImplementedError

    def rewrite(self, ctx: MatchContext, group: SliceGroup, gid: int) -> None:
        raise NotImplementedError


class VerticalLnTanhLinearRelu(Fusion):
    """LayerNorm -> tanh -> Linear -> relu over F slices -> one `recfuse.ln_tanh_linear_relu` node.

    Example:
        >>> VerticalLnTanhLinearRelu().name
        'vertical_ln_tanh_linear_relu'
    """

    name = "vertical_ln_tanh_linear_relu"

    def match(self, ctx):
        return [g for g in ctx.groups if g.mode == "vertical"]

    def rewrite(self, ctx, g, gid):
        from ..ops import ln_tanh_linear_relu

        e = _Emitter(ctx, g, gid)
        layout = _layout(g)
        c0 = g.chains[0]
        with ctx.graph.inserting_before(g._insert_before):
            x = _emit_input(e, layout)
            ops = c0.ops + g.tail
            ln_i = 0
            lin_i = next(k for k, o in enumerate(ops) if o.kind == "linear")
            ln_specs = g.params[ln_i]
            if lin_i < len(c0.ops):
                lin_specs = g.params[lin_i]
            else:
                lin_op = ops[lin_i]
                lin_specs = {k: (None if r is None else ("shared", r)) for k, r in lin_op.params.items()}
            w = e.param(lin_specs.get("weight"), "weight")
            b = e.param(lin_specs.get("bias"), "bias")
            lw = e.param(ln_specs.get("weight"), "ln_weight")
            lb = e.param(ln_specs.get("bias"), "ln_bias")
            out = e.fn(ln_tanh_linear_relu, [x, w, b],
                       {"ln_weight": lw, "ln_bias": lb, "eps": ops[0].attr("eps"), "feature_dim": layout})
            _finish(e, g, out, layout, None)
        src = "zero-copy view of " + g.source[1].name if g.source[0] == "view" else (
            "index_select of " + g.source[1].name if g.source[0] == "gather" else "stack of the slices")
        g.replaced_by = f"1 recfuse.ln_tanh_linear_relu node (feature_dim={layout}, input: {src})"


class HorizontalChain(Fusion):
    """Any chain of recognised ops over F slices -> the same ops once on the batched 3D tensor.

    Example:
        >>> HorizontalChain().name
        'horizontal_chain'
    """

    name = "horizontal_chain"

    def match(self, ctx):
        return [g for g in ctx.groups if g.mode == "horizontal"]

    def rewrite(self, ctx, g, gid):
        e = _Emitter(ctx, g, gid)
        layout = _layout(g)
        c0 = g.chains[0]
        inter = []
        with ctx.graph.inserting_before(g._insert_before):
            x = _emit_input(e, layout)
            for j, op in enumerate(c0.ops):
                specs = g.params[j]
                if op.kind == "layer_norm":
                    ws, bs = specs.get("weight"), specs.get("bias")
                    shared = all(s is None or s[0] == "shared" for s in (ws, bs))
                    ns = list(op.attr("shape"))
                    if shared:
                        x = e.fn(F.layer_norm, [x, ns, e.param(ws, f"{j}_ln_weight"), e.param(bs, f"{j}_ln_bias"),
                                                op.attr("eps")])
                    else:
                        x = e.fn(F.layer_norm, [x, ns, None, None, op.attr("eps")])
                        per = (ws is not None and ws[0] == "stacked", bs is not None and bs[0] == "stacked")
                        x = e.fn(runtime.feature_affine, [x, e.param(ws, f"{j}_ln_weight"),
                                                          e.param(bs, f"{j}_ln_bias"), layout, per])
                elif op.kind == "linear":
                    ws, bs = specs.get("weight"), specs.get("bias")
                    if ws[0] == "shared" and (bs is None or bs[0] == "shared"):
                        x = e.fn(F.linear, [x, e.param(ws, f"{j}_weight"), e.param(bs, f"{j}_bias")])
                    else:
                        bn = e.param(bs, f"{j}_bias")
                        if bs is not None and bs[0] == "shared":
                            bn = e.fn(torch.Tensor.expand, [bn, g.size, -1])
                        x = e.fn(runtime.feature_linear, [x, e.param(ws, f"{j}_weight"), bn, layout])
                elif op.kind == "gelu":
                    x = e.fn(F.gelu, [x], {"approximate": op.attr("approximate", "none")})
                else:
                    x = e.fn({"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid,
                              "silu": F.silu}[op.kind], [x])
                inter.append(x)
            _finish(e, g, x, layout, inter)
        src = "zero-copy view of " + g.source[1].name if g.source[0] == "view" else (
            "index_select of " + g.source[1].name if g.source[0] == "gather" else "stack of the slices")
        g.replaced_by = f"batched {g.ops_text()} on one [F={g.size}, ...] tensor (input: {src})"


FUSIONS: list = [VerticalLnTanhLinearRelu(), HorizontalChain()]


def register_fusion(fusion: Fusion, first: bool = False) -> None:
    """Add a fusion to the registry (tried in order; `first` puts it before the built-ins).

    Example:
        >>> len(FUSIONS) >= 2
        True
    """
    if first:
        FUSIONS.insert(0, fusion)
    else:
        FUSIONS.append(fusion)


def analyze(graph: Graph, root=None, stack_params_once: bool = True) -> MatchContext:
    """Analyze `graph` once: planned groups and near-misses.

    Example:
        >>> import torch, torch.fx
        >>> analyze(torch.fx.symbolic_trace(lambda x: x.tanh()).graph).groups
        []
    """
    return MatchContext(graph, root, stack_params_once)
