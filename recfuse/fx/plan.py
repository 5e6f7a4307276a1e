"""`GroupPlan`: how the slices of one group can be computed as one batched tensor.

A plan says where the batched input comes from, which parameters are shared or stacked, which
node the batched result replaces, which per-slice values are also used elsewhere, and where the
new nodes go. It is what every fusion needs and decides nothing about *how* to fuse: whether a
group becomes one fused kernel, a batched chain of ops, or something a user registered is the
business of the fusions in `rules/`.

Example:
    >>> import torch
    >>> from recfuse.fx.analysis import GraphAnalysis
    >>> from recfuse.fx.capture import capture
    >>> gm, _ = capture(lambda x: torch.stack([s.tanh() for s in x.split(4, 1)]), (torch.randn(2, 12),))
    >>> plan = GraphAnalysis(gm.graph, gm).groups()[0]
    >>> plan.size, plan.ops_text(), plan.source.describe()
    (3, 'tanh', 'zero-copy view of x')
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.fx import Node

from .patterns import ParamRef, SliceChain, _split_kind, classify, keeps_shape, submodule, view_sizes
from .values import tensor_shape

__all__ = ["BatchedSource", "SinkReplacement", "ParamPlan", "SideUse", "GroupPlan", "plan_group",
           "attr_tensor", "ref_shape", "TensorAliases"]


@dataclass(frozen=True)
class BatchedSource:
    """Where a group's batched input comes from.

    kind 'view': `count` aligned slices of `node` along `dim` from `start`, in order (zero-copy);
    'gather': the same slots picked in `index` order (one copy); 'stack': the slices stacked.
    `length` is the slice length (-1: the slices tile the whole dim; None: index slices).

    Example:
        >>> BatchedSource("stack").describe()
        'stack of the slices'
    """

    kind: str
    node: Optional[Node] = None
    dim: int = 0
    start: int = 0
    count: int = 0
    length: Optional[int] = None
    index: Optional[tuple] = None
    # A slice runs to the end (``x[9:]``): the size of `dim` the plan holds (checked on each call,
    # where the original's slice would grow with it), and that slice's text.
    size: Optional[int] = None
    open_slice: str = ""

    def describe(self) -> str:
        if self.kind == "view":
            return "zero-copy view of " + self.node.name
        if self.kind == "gather":
            return "index_select of " + self.node.name
        return "stack of the slices"


@dataclass(frozen=True)
class SinkReplacement:
    """The node whose value the batched result takes over: the stack/cat itself, or the view that
    turns a cat into a stack. `dim` is where its feature dim is; how 'cat' flattens it again.

    Example:
        >>> SinkReplacement(None, 1, "stack").how
        'stack'
    """

    node: Node
    dim: int
    how: str


@dataclass(frozen=True)
class ParamPlan:
    """One parameter of a per-slice op: 'shared' (one ref, the same for every slice) or 'stacked'
    (one ref per slice, distinct, equal shapes).

    `tied`: why the per-slice tensors must stay the model's tensors (one of them is also reachable
    under another name, or shares storage with another tensor of the model): they are then
    stacked in the graph on each call, never copied into a new parameter (which would untie them).

    Example:
        >>> ParamPlan("shared", (ParamRef("lin.weight"),)).refs[0].attr
        'lin.weight'
    """

    how: str
    refs: tuple
    tied: Optional[str] = None
    # the tensors the refs named when planned (None: look them up); not part of the plan's identity
    tensors: Optional[tuple] = field(default=None, compare=False, repr=False)

    @property
    def shared(self) -> bool:
        return self.how == "shared"


@dataclass(frozen=True)
class SideUse:
    """A per-slice value read outside its chain: op `op` of slice `slice` (indices into the group's
    chains), whose `users` must get a view of the batched value instead.

    Example:
        >>> SideUse(1, 0, None, ()).slice
        1
    """

    slice: int
    op: int
    node: Node
    users: tuple


@dataclass(eq=False)
class GroupPlan:
    """Slices of one sink whose chains are identical, and how to batch them (see the module doc).

    `feature_dim` is where the feature dim sits in the batched input as built from `source`;
    `reshape_rows`: each slice is reshaped to [rows, D] before its chain. `replaces` is None when
    the stack/cat also has inputs outside the group: then each slice's final value is served by a
    view. `followers`: the ops after the replaced node, each the only reader of the one before
    (a fusion may take some of them in). `insert_before` is the first place that needs the
    batched values; everything the group reads exists before it.

    Example:
        >>> GroupPlan.__name__
        'GroupPlan'
    """

    sink: Node
    sink_kind: str
    sink_dim: int
    positions: list
    chains: list
    source: BatchedSource
    feature_dim: int
    reshape_rows: bool
    replaces: Optional[SinkReplacement]
    params: list
    side_uses: list
    insert_before: Node
    followers: tuple = ()

    @property
    def size(self) -> int:
        return len(self.chains)

    @property
    def kinds(self) -> tuple:
        return tuple(o.kind for o in self.chains[0].ops)

    @property
    def where(self) -> str:
        return f"{self.sink_kind} `{self.sink.name}`"

    @property
    def layout(self) -> int:
        """The feature dim of the batched values: the stack's dim when that is a core dim (the
        result then needs no movedim), else where the source has it. Never inside the dims a norm
        of the chain normalizes over (a LayerNorm over each slice's (B, D)): those stay trailing."""
        nd = len(self.chains[0].core_in)
        if self.replaces is not None and self.replaces.dim <= nd - _norm_dims(self.chains[0]):
            return self.replaces.dim
        return self.feature_dim

    def ops_text(self, tail: tuple = ()) -> str:
        return " -> ".join(list(self.kinds) + list(tail))

    def slices_text(self, limit: int = 6) -> str:
        labels = [c.slice.label() if c.slice is not None else c.start.name for c in self.chains]
        if len(labels) > limit:
            return ", ".join(labels[: limit - 2]) + f", ... ({len(labels) - limit + 1} more), " + labels[-1]
        return ", ".join(labels)


def attr_tensor(root, qualname: str) -> Optional[torch.Tensor]:
    """``root.<qualname>`` if it is a tensor, else None.

    Example:
        >>> import torch
        >>> attr_tensor(torch.nn.Linear(2, 3), "weight").shape
        torch.Size([3, 2])
    """
    if root is None:
        return None
    owner, _, name = qualname.rpartition(".")
    try:
        mod = submodule(root, owner) if owner else root
    except AttributeError:
        return None
    t = mod._parameters.get(name)
    if t is None:
        t = mod._buffers.get(name)
    if t is None:
        t = getattr(mod, name, None)
    return t if isinstance(t, torch.Tensor) else None


class TensorAliases:
    """Every tensor reachable from `root` (parameters, buffers, plain tensor attributes of every
    module, shared modules under each of their names), indexed by identity and by storage, so that
    "is this tensor also something else?" costs a dict lookup.

    Example:
        >>> import torch
        >>> m = torch.nn.Module(); m.a = torch.nn.Linear(2, 2); m.b = torch.nn.Linear(2, 2)
        >>> m.b.weight = m.a.weight
        >>> TensorAliases(m).tie("a.weight", m.a.weight)
        '`a.weight` is the same tensor as `b.weight` (tied)'
        >>> TensorAliases(m).tie("a.bias", m.a.bias) is None
        True
    """

    def __init__(self, root, alone: Optional["Alone"] = None):
        self.names: dict = {}  # id(tensor) -> qualified names
        self.storages: dict = {}  # (device, storage address) -> {id(tensor): name}
        self._storage_of: dict = {}  # id(tensor) -> its key in `storages` (None: no storage)
        self._keep: list = []  # the tensors themselves, so that ids stay valid
        self._alone = alone.tensors if alone is not None else frozenset()
        skip = alone.modules if alone is not None else frozenset()
        for prefix, mod in root.named_modules(remove_duplicate=False):
            if id(mod) in skip:
                continue
            pre = prefix + "." if prefix else ""
            for d in (mod._parameters, mod._buffers):
                for k, t in d.items():
                    if t is not None:
                        self._add(pre + k, t)
            for k, v in mod.__dict__.items():
                if isinstance(v, torch.Tensor):
                    self._add(pre + k, v)

    def _add(self, name: str, t: torch.Tensor) -> None:
        names = self.names.get(id(t))
        if names is None:
            self.names[id(t)] = names = []
            self._keep.append(t)
            key = self._storage_of[id(t)] = _storage_key(t)
            if key is not None:
                self.storages.setdefault(key, {})[id(t)] = name
        if name not in names:
            names.append(name)

    def tie(self, name: str, t: torch.Tensor) -> Optional[str]:
        """Why `t` (read as `name`) is not a tensor of its own, or None."""
        if id(t) in self._alone:
            return None
        others = [n for n in self.names.get(id(t), ()) if n != name]
        if others:
            return f"`{name}` is the same tensor as `{others[0]}` (tied)"
        # the key found when indexing `t` (a tensor of the root keeps its storage) saves asking torch again
        key = self._storage_of[id(t)] if id(t) in self._storage_of else _storage_key(t)
        sharing = [n for i, n in self.storages.get(key, {}).items() if i != id(t)] if key is not None else []
        if sharing:
            return f"`{name}` shares storage with `{sharing[0]}`"
        return None


@dataclass(frozen=True)
class Alone:
    """Tensors of a root known to be tensors of their own (one name, no other tensor in their
    storage), and the modules holding only such tensors: `TensorAliases` need not index them.
    `capture.copy_sharing_leaves` finds them while it walks the model anyway."""

    modules: frozenset  # ids of modules whose parameters, buffers and tensor attributes are all alone
    tensors: frozenset  # ids of those tensors


def _storage_key(t: torch.Tensor):
    try:
        if t.is_meta:
            return None
        st = t.untyped_storage()
        if st.nbytes() == 0:
            return None
        return (t.device, st.data_ptr())
    except Exception:  # tensor subclasses without storage
        return None


def ref_shape(r: ParamRef, root) -> Optional[tuple]:
    """The shape of the tensor a parameter reference points to, when known.

    Example:
        >>> import torch
        >>> ref_shape(ParamRef("weight"), torch.nn.Linear(2, 3))
        (3, 2)
    """
    if r.node is not None:
        return tensor_shape(r.node)
    if r.attr is not None and root is not None:
        t = attr_tensor(root, r.attr)
        return tuple(t.shape) if t is not None else None
    return None


def _norm_dims(chain) -> int:
    """How many trailing dims of a slice the chain's norms normalize over (1 without a norm)."""
    return max((len(o.attr("shape")) for o in chain.ops if o.kind in ("layer_norm", "rms_norm")), default=1)


def plan_group(sink: Node, sink_kind: str, sink_dim: int, positions: list, chains: list, covers_all: bool,
               root, attr_uses: Callable[[str], int], aliases: Optional["TensorAliases"] = None):
    """Plan one group of identical chains; returns a `GroupPlan`, or the reason (a str) there is none.

    `covers_all`: the group holds every input of the sink (only then can the sink be replaced).
    `attr_uses(qualname)`: how many places in the graph read that attribute. `aliases`: the
    root's tensors by identity (`TensorAliases`; built from `root` when not given).

    Example:
        >>> import torch
        >>> from recfuse.fx.analysis import GraphAnalysis
        >>> from recfuse.fx.capture import capture
        >>> gm, _ = capture(lambda x: torch.stack([s.tanh() for s in x.split(4, 1)]), (torch.randn(2, 8),))
        >>> GraphAnalysis(gm.graph, gm).groups()[0].replaces.how
        'stack'
    """
    c0 = chains[0]
    core, out, start_shape = c0.core_in, c0.core_out, tensor_shape(c0.start)
    if core is None or out is None or start_shape is None:
        return "shapes unknown (pass example_inputs)"
    if len(core) == 0:
        return "per-slice values are scalars"
    if aliases is None and root is not None:
        aliases = TensorAliases(root)
    params = _param_plans(chains, root, attr_uses, aliases)
    if isinstance(params, str):
        return params
    for op in c0.ops:
        if op.kind in ("layer_norm", "rms_norm"):
            ns = op.attr("shape")
            if tuple(core[len(core) - len(ns):]) != tuple(ns):
                return f"{op.kind} normalized_shape {list(ns)} does not match the slice shape {list(core)}"
    squeezed = next((c.start for c in chains if _is_squeeze(c.start)), None)
    if squeezed is not None:
        return (f"the slices come from `{squeezed.name}` (a squeeze), whose result's rank depends on the "
                "batch size; left per slice")
    source, fd, slice_shape = _source_plan(chains)
    if slice_shape != start_shape:
        return f"internal: slice shape {start_shape} vs planned {slice_shape}"
    reshape_rows = False
    kept = tuple(core) == tuple(start_shape)
    if kept and any(not keeps_shape(p) for c in chains for p in c.pre):
        bad = next(p for c in chains for p in c.pre if not keeps_shape(p))
        return (f"per-slice view `{bad.node.name}` keeps the slice shape {list(start_shape)} only at the "
                "example's sizes; left per slice")
    if c0.pre and not kept:
        if len(core) != 2:
            return f"per-slice reshape from {list(start_shape)} to {list(core)} is not supported (only to [rows, D])"
        reshape_rows, fd = True, 0
    nd = len(core)  # core dims; batched tensors have nd + 1
    if fd == nd:  # features after the last dim: put them first so row ops stay row ops
        fd = 0
    if fd > nd - _norm_dims(c0):
        fd = 0
    replaces = _sink_replacement(sink, sink_kind, sink_dim, chains, root) if covers_all else None
    side_uses = _side_uses(sink, chains, replaces)
    insert_before = _insertion_point(chains, source, params, replaces, side_uses)
    if isinstance(insert_before, str):
        return insert_before
    followers = _followers(replaces.node, root) if replaces is not None else ()
    return GroupPlan(sink, sink_kind, sink_dim, positions, chains, source, fd, reshape_rows, replaces, params,
                     side_uses, insert_before, followers)


def _param_plans(chains: list, root, attr_uses, aliases=None):
    plans = []
    for j, op in enumerate(chains[0].ops):
        specs = {}
        for name in op.params:
            refs = [c.ops[j].params.get(name) for c in chains]
            if all(r is None for r in refs):
                specs[name] = None
                continue
            if any(r is None or r.key is None for r in refs):
                return f"{op.kind} {name} is a constant tensor in the code; cannot batch it"
            keys = [r.key for r in refs]
            if len(set(keys)) == 1:
                specs[name] = ParamPlan("shared", (refs[0],))
            elif len(set(keys)) == len(keys):
                for r in refs:
                    if r.attr is not None and attr_uses(r.attr) > 1:
                        return f"{op.kind} {name} `{r.attr}` is also used outside this group; stacking it would untie it"
                # Names differ, but tensors may not: tied parameters (``lins[1].weight =
                # lins[0].weight``), a LayerNorm whose bias is its weight, a feature's weight that is
                # also a head's. Judged by identity and storage, over every tensor of the root.
                tensors = [attr_tensor(root, r.attr) if r.attr is not None else None for r in refs]
                if tensors and all(t is not None and t is tensors[0] for t in tensors):
                    specs[name] = ParamPlan("shared", (refs[0],))  # one tensor under F names: exact
                    continue
                shapes = {tuple(_known_shape(r, t, root) or ()) for r, t in zip(refs, tensors)}
                if len(shapes) != 1:
                    return f"{op.kind} {name} shapes differ across slices: {sorted(shapes)}"
                tied = None
                if aliases is not None:
                    for r, t in zip(refs, tensors):
                        if t is not None:
                            tied = aliases.tie(r.attr, t)
                            if tied is not None:
                                tied = f"{op.kind} {name} {tied}"
                                break
                specs[name] = ParamPlan("stacked", tuple(refs), tied, tuple(tensors))
            else:
                return f"{op.kind} {name} is shared by some slices but not all; batching would untie it"
        plans.append(specs)
    return plans


def _known_shape(r: ParamRef, t: Optional[torch.Tensor], root) -> Optional[tuple]:
    """`ref_shape(r, root)`, from `t` (the tensor `r.attr` names, already looked up) when there is one."""
    if r.node is None and r.attr is not None and t is not None:
        return tuple(t.shape)
    return ref_shape(r, root)


def _sized_at_run_time(start: Node) -> bool:
    """Whether the slice `start` has a length the original computes from the source's size on every
    call (`chunk`, `tensor_split(x, n)`, `split(x.shape[0] // F)`), not a constant of its code
    (`split(8, 1)`, `narrow(1, i * 8, 8)`, `x[:, 8:16]`): a wider source at run time gives the
    original longer slices in the first case, and the same slices (of a prefix) in the second."""
    if not (start.op == "call_function" and start.target is operator.getitem and isinstance(start.args[0], Node)):
        return False
    split = _split_kind(start.args[0])
    if split is None:
        return False
    parent = start.args[0]
    size = parent.args[1] if len(parent.args) > 1 else next(
        (v for k, v in parent.kwargs.items() if k not in ("dim", "input", "tensor", "self")), None)
    if split[0] == "chunk":
        return True
    if split[0] == "tensor_split":
        return not isinstance(size, (list, tuple))
    return isinstance(size, Node) or (isinstance(size, (list, tuple)) and any(isinstance(v, Node) for v in size))


def _source_plan(chains: list) -> tuple:
    """A view of the common source when the slices tile it in order (zero-copy), an index_select
    when they are aligned but permuted, else a stack. Returns (source, feature dim, slice shape)."""
    infos = [c.slice for c in chains]
    n = len(chains)
    i0 = infos[0]
    if all(i is not None and i.kind in ("range", "index") for i in infos) and all(
        (i.source, i.kind, i.dim, i.length) == (i0.source, i0.kind, i0.dim, i0.length) for i in infos
    ):
        src_shape = tensor_shape(i0.source)
        L = i0.length
        starts = [i.start for i in infos]
        base = min(starts)
        # Offsets counted from the end (negative) and from the start only agree at one size.
        same_end = all(s < 0 for s in starts) or all(s >= 0 for s in starts)
        if src_shape is not None and L > 0 and same_end and all((s - base) % L == 0 for s in starts):
            idx = [(s - base) // L for s in starts]
            length = L if i0.kind == "range" else None
            # Slices that tile the whole dim are sized from the source at run time (-1): the
            # dim may be the batch (split of [F*B, D] on dim 0).
            count = max(idx) + 1
            if (length is not None and base == 0 and count * L == src_shape[i0.dim]
                    and _sized_at_run_time(chains[0].start)):
                length = -1
            d = i0.dim
            if i0.kind == "range":
                slice_shape = tuple(src_shape[:d]) + (L,) + tuple(src_shape[d + 1:])
            else:
                slice_shape = tuple(src_shape[:d]) + tuple(src_shape[d + 1:])
            opened = next((i for i in infos if i.open_end), None)
            guard = {} if opened is None else {"size": src_shape[d], "open_slice": f"{i0.source.name}[{opened.start}:] along dim {d}"}
            if idx == list(range(n)):
                return BatchedSource("view", i0.source, d, base, n, length, **guard), d, slice_shape
            if len(set(idx)) == n:
                return BatchedSource("gather", i0.source, d, base, count, length, tuple(idx), **guard), d, slice_shape
    return BatchedSource("stack"), 0, tensor_shape(chains[0].start)


def _sink_replacement(sink: Node, kind: str, dim: int, chains: list, root) -> Optional[SinkReplacement]:
    c0 = chains[0]
    out = c0.core_out
    end_shape = tensor_shape(c0.end)
    no_post_reshape = end_shape == tuple(out) and all(keeps_shape(p) for c in chains for p in c.post)
    if kind == "stack":
        return SinkReplacement(sink, dim % (len(out) + 1), "stack") if no_post_reshape else None
    cd = dim % len(end_shape)
    fixed_rows = any(o.kind in ("layer_norm", "rms_norm", "linear") for o in c0.ops)
    if not no_post_reshape:
        if end_shape == tuple(out[:cd]) + (1,) + tuple(out[cd:]) and all(
                len(c.post) == 1 and _inserts_dim(c.post[0].node, len(out), cd, 1, fixed_rows) for c in chains):
            return SinkReplacement(sink, cd, "stack")
        return None
    # cat -> view to 3D is a stack; other users may only read the cat's shape
    # (``y.view(y.shape[0], F, -1)``), which dies with it.
    want = tuple(out[:cd]) + (len(chains),) + tuple(out[cd:])
    views = [u for u in sink.users if _is_view_op(u, root) and tensor_shape(u) == want
             and _inserts_dim(u, len(out), cd, len(chains), fixed_rows)]
    others = [u for u in sink.users if u not in views]
    if len(views) == 1 and all(_is_shape_query(u) and _feeds_only(u, views) for u in others):
        return SinkReplacement(views[0], cd, "stack")
    return SinkReplacement(sink, cd, "cat")


def _is_squeeze(n: Node) -> bool:
    return (n.op == "call_method" and n.target == "squeeze") or (n.op == "call_function" and n.target is torch.squeeze)


def _inserts_dim(n: Node, nd: int, cd: int, size: int, fixed_rows: bool) -> bool:
    """Whether the view `n` of an `nd`-dim value (a cat of per-slice results, or one slice's result
    when `size` is 1) yields a new dim `cd` of `size` for every batch size, judged from its code:
    the example's shape may match by coincidence (``cat(dim=0).view(-1, F, D)`` when B == F;
    ``.view(-1, 1, D)`` when B == 1). The new dim must be the literal `size` (``unsqueeze(cd)``
    when 1); other sizes must be -1 or computed in the graph (``x.shape[0]``), except the row
    width (the last dim, when a norm or Linear fixes it), whose literal cannot depend on the batch.
    """
    if size == 1 and n.op in ("call_method", "call_function") and n.target in ("unsqueeze", torch.unsqueeze):
        d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        return isinstance(d, int) and not isinstance(d, bool) and d % (nd + 1) == cd
    sizes = view_sizes(n)
    if sizes is None or len(sizes) != nd + 1:
        return False
    for i, v in enumerate(sizes):
        if i == cd:
            if type(v) is not int or v != size:
                return False
        elif type(v) is int and v != -1 and not (i == nd and fixed_rows):
            return False
        elif not (type(v) is int or isinstance(v, Node)):
            return False
    return True


def _followers(node: Node, root) -> tuple:
    ops = []
    while len(node.users) == 1:
        op = classify(next(iter(node.users)), root)
        if op is None or op.data is not node:
            break
        ops.append(op)
        node = op.node
    return tuple(ops)


def _is_view_op(n: Node, root) -> bool:
    op = classify(n, root)
    return op is not None and op.kind == "view"


def _is_shape_query(n: Node) -> bool:
    if n.op == "call_function" and n.target is getattr and len(n.args) == 2 and n.args[1] == "shape":
        return True
    return n.op == "call_method" and n.target in ("size", "dim")


def _feeds_only(n: Node, targets: list, depth: int = 3) -> bool:
    """True if every use of `n` (a shape query) ends, within `depth` steps, in one of `targets`."""
    if depth == 0:
        return False
    return all(u in targets or (u.op == "call_function" and _feeds_only(u, targets, depth - 1)) for u in n.users)


def _side_uses(sink: Node, chains: list, replaces: Optional[SinkReplacement]) -> list:
    side = []
    replaced = replaces.node if replaces is not None else None
    for i, c in enumerate(chains):
        inner = set(c.seq)
        last = len(c.ops) - 1
        for j, op in enumerate(c.ops):
            ext = [u for u in op.node.users if u not in inner and not (replaced is sink and u is sink)]
            if replaced is not None and replaced is not sink and j == last:
                ext = [u for u in ext if u is not sink]
            if ext:
                side.append(SideUse(i, j, op.node, tuple(ext)))
    return side


def _insertion_point(chains, source, params, replaces, side_uses):
    """The first node that will read a batched value, after checking that everything the group
    reads is defined before it; a str when per-slice code is interleaved with those reads."""
    first_use = [replaces.node] if replaces is not None else []
    first_use += [u for s in side_uses for u in s.users]
    if replaces is None:
        # Each slice's final value is then served by a view of the batched result (read by its
        # trailing views too, which are not side uses).
        first_use += [u for c in chains for u in c.ops[-1].node.users]
    if not first_use:
        return "no use of the per-slice results found"
    deps = [source.node] if source.kind != "stack" else [c.start for c in chains]
    for specs in params:
        for spec in specs.values():
            if spec is not None:
                deps += [r.node for r in spec.refs if r.node is not None]
    insert_before = min(first_use)
    if any(not d < insert_before for d in deps):
        return "per-slice results are used before all slices exist (interleaved code); left per slice"
    return insert_before
