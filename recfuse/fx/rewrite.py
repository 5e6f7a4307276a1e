"""`Rewriter`: what a fusion's `fuse` uses to build the batched computation of one group.

It creates nodes at the group's insertion point, builds the batched input from the plan's
source, stacks per-slice parameters (once, as new parameters of the root, where that keeps every
parameter's `requires_grad` and gradient hooks intact), and hands the batched result to the
per-slice code's readers. It records what it replaced, so the pass can remove exactly the nodes
that died.

Example:
    >>> import torch
    >>> from recfuse.fx.analysis import GraphAnalysis
    >>> from recfuse.fx.capture import capture
    >>> gm, _ = capture(lambda x: torch.stack([s.tanh() for s in x.split(4, 1)]), (torch.randn(2, 8),))
    >>> plan = GraphAnalysis(gm.graph, gm).groups()[0]
    >>> rw = Rewriter(gm.graph, gm, plan, gid=0)
    >>> with gm.graph.inserting_before(plan.insert_before):
    ...     x = rw.batched_input(plan.layout)
    ...     rw.finish(rw.fn(torch.tanh, [x]))
    >>> plan.sink.users
    {}
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.fx import Graph, Node

from . import runtime
from .plan import GroupPlan, ParamPlan, attr_tensor

__all__ = ["Rewriter", "fold_split_guards"]


class Rewriter:
    """Node factory and bookkeeping for rewriting one planned group (see the module doc).

    With ``stack_params_once`` per-slice parameters that are attributes of `root` become one new
    stacked parameter of `root` (``recfuse_g{gid}_{role}``, recorded in `stacked_params`);
    otherwise (Dynamo graphs, whose parameters are inputs) they are stacked in the graph.

    Example:
        >>> Rewriter.__name__
        'Rewriter'
    """

    def __init__(self, graph: Graph, root: Optional[nn.Module], plan: GroupPlan, gid: int,
                 stack_params_once: bool = True):
        self.graph, self.root, self.plan, self.gid = graph, root, plan, gid
        self.stack_params_once = stack_params_once and root is not None
        self.stacked_params: dict = {}  # new attribute -> the per-slice attributes it holds, in order
        self.replaced: list = []  # nodes whose readers now read a batched value
        self.notes: list = []  # what the report should say about this group's parameters

    def fn(self, target, args, kwargs=None) -> Node:
        return self.graph.call_function(target, tuple(args), kwargs or {})

    def param(self, spec: Optional[ParamPlan], role: str) -> Optional[Node]:
        """A node holding the parameter: the shared one, or the per-slice ones stacked [F, ...]."""
        if spec is None:
            return None
        if spec.shared:
            ref = spec.refs[0]
            return self.graph.get_attr(ref.attr) if ref.attr is not None else ref.node
        refs, root = spec.refs, self.root
        tensors = list(spec.tensors) if spec.tensors is not None else [
            attr_tensor(root, r.attr) if r.attr is not None else None for r in refs]
        # One stacked tensor has one requires_grad: with frozen and trainable rows mixed, the
        # originals stay the parameters and are stacked in the graph on each call.
        mixed = len({t.requires_grad for t in tensors if t is not None}) > 1
        # Gradient hooks on a per-feature parameter (clipping, logging) must keep firing: its
        # gradient must keep flowing to it, which an in-graph stack does and a new parameter not.
        hooked = any(t is not None and (getattr(t, "_backward_hooks", None) or
                                        getattr(t, "_post_accumulate_grad_hooks", None)) for t in tensors)
        # Tied tensors (one parameter under two names, shared storage) must stay the model's own:
        # a stacked copy would train apart from the other name.
        tied = spec.tied is not None
        # A non-persistent buffer stacked with persistent ones (or with parameters) has no one
        # persistence: leave them the model's own too.
        persistent = [_persistent(root, r.attr, t) for r, t in zip(refs, tensors) if t is not None]
        mixed_persistence = len(set(persistent)) > 1
        if self.stack_params_once and (tied or mixed_persistence):
            why = spec.tied if tied else f"{role}: persistent and non-persistent buffers mixed"
            self.notes.append(f"{why}: the per-feature tensors stay the model's own and are stacked on each call")
        if (self.stack_params_once and not (mixed or hooked or tied or mixed_persistence)
                and all(r.attr is not None for r in refs)):
            stacked = torch.stack([t.detach() for t in tensors]).clone()
            name = _unique_attr(root, f"recfuse_g{self.gid}_{role}")
            if all(isinstance(t, nn.Parameter) for t in tensors):
                root.register_parameter(name, nn.Parameter(stacked, requires_grad=any(t.requires_grad for t in tensors)))
            else:
                root.register_buffer(name, stacked, persistent=all(persistent))
            self.stacked_params[name] = [r.attr for r in refs]
            return self.graph.get_attr(name)
        nodes = [self.graph.get_attr(r.attr) if r.attr is not None else r.node for r in refs]
        return self.fn(torch.stack, [nodes])

    def batched_input(self, layout: int) -> Node:
        """The group's slices as one tensor with the feature dim at `layout`."""
        plan, src = self.plan, self.plan.source
        if src.size is not None:
            self.fn(runtime.check_slice_end, [src.node, src.dim, src.size, src.open_slice])
        if src.kind == "stack":
            x = self.fn(torch.stack, [[c.start for c in plan.chains], 0])
            fd = 0
        elif src.kind == "view":
            x = self.fn(runtime.slices_view, [src.node, src.dim, src.start, src.count, src.length])
            fd = src.dim
        else:
            x = self.fn(runtime.gather_slices, [src.node, src.dim, src.start, src.count, src.length, src.index])
            fd = src.dim
        if plan.reshape_rows:
            x = self.fn(runtime.rows_view, [x, fd, plan.chains[0].core_in[-1]])
            fd = 0
        if fd != layout:
            x = self.fn(torch.movedim, [x, fd, layout])
        return x

    def replace_all_uses(self, old: Node, new: Node) -> None:
        old.replace_all_uses_with(new)
        self.replaced.append(old)

    def finish(self, out: Node, intermediates: Optional[list] = None, *, through: Optional[Node] = None,
               contiguous: bool = False) -> None:
        """Give every reader of the group's values the batched result `out` (feature dim at
        ``plan.layout``), or a view of it.

        `through`: the last op fused after the replaced node (its readers get the result);
        `contiguous`: `out` is already laid out as the stack it replaces. `intermediates`: the
        batched value after each op, to serve side uses of per-slice intermediates (without them
        the plan must have none but uses of the final values).
        """
        plan, layout = self.plan, self.plan.layout
        last = len(plan.chains[0].ops) - 1
        if plan.replaces is not None:
            rep = plan.replaces
            if contiguous and rep.how == "stack" and rep.dim == layout:
                val = out
            else:
                val = self.fn(runtime.from_batched, [out, layout, rep.dim, rep.how == "cat"])
            self.replace_all_uses(through if through is not None else rep.node, val)
        else:
            # The stack is not ours to replace: serve each slice's result as a view.
            for i, c in enumerate(plan.chains):
                self.replace_all_uses(c.ops[last].node, self._slice(out, i, c.ops[last].node))
        for use in plan.side_uses:
            if intermediates is None or use.op == last and plan.replaces is None:
                continue
            sel = self._slice(intermediates[use.op], use.slice, use.node)
            for u in use.users:
                u.replace_input_with(use.node, sel)
            self.replaced.append(use.node)


    def _slice(self, batched: Node, i: int, old: Node) -> Node:
        """Slice `i` of a batched value, standing for the per-slice value `old`. A select of a
        batched tensor is strided where `old` (an op's fresh result) was contiguous: when `old` is
        read through ``.view`` (which needs compatible strides), the slice is made contiguous."""
        sel = self.fn(torch.select, [batched, self.plan.layout, i])
        if _viewed(old):
            sel = self.graph.call_method("contiguous", (sel,))
        return sel


_ALIASING_METHODS = {"unsqueeze", "squeeze", "transpose", "permute", "t", "expand", "select", "narrow",
                     "__getitem__", "unflatten", "movedim"}


def _viewed(n: Node, depth: int = 4) -> bool:
    """Whether `n` is read by ``.view`` / ``.view_as``, directly or through ops that return views."""
    import operator
    if depth == 0:
        return False
    for u in n.users:
        if u.op == "call_method" and u.target in ("view", "view_as"):
            return True
        aliasing = (u.op == "call_method" and u.target in _ALIASING_METHODS) or (
            u.op == "call_function" and (u.target is operator.getitem or getattr(u.target, "__name__", None)
                                         in _ALIASING_METHODS) and u.args and u.args[0] is n)
        if aliasing and _viewed(u, depth - 1):
            return True
    return False


def _persistent(root, qualname: str, t) -> bool:
    """Whether ``root.<qualname>`` is in its owner's state_dict (a parameter, or a persistent buffer)."""
    if isinstance(t, nn.Parameter):
        return True
    owner_path, _, name = qualname.rpartition(".")
    try:
        owner = root.get_submodule(owner_path) if owner_path else root
    except AttributeError:
        return True
    return name not in owner._non_persistent_buffers_set


def _unique_attr(root, base: str) -> str:
    name, k = base, 1
    while hasattr(root, name):
        name, k = f"{base}_{k}", k + 1
    return name


def fold_split_guards(graph: Graph) -> int:
    """Hand each split's piece-count guard to the `slices_view` of its group that comes right after
    it (only attribute reads between): one helper call a transformed forward saves (~1.4 us),
    and the guard's work is skipped where the view's own shape test implies it. Returns how many
    guards were folded.

    The guard (`runtime.check_specialized` of ``(src, "split", size, dim)``, how ``"pieces"``)
    holds when ``src.shape[dim]`` splits into the example's count of pieces; a `slices_view` of the
    same source, dim and count, from 0, with slices of the split's size, tiles the dim exactly in
    that case, so when its shape test passes the count is right and otherwise it runs the guard.
    Nothing with an effect runs between the two, so the refusal comes at the same point.
    """
    folded = 0
    for guard in list(graph.nodes):
        if guard.op != "call_function" or guard.target is not runtime.check_specialized or guard.kwargs:
            continue
        split, how, expected = guard.args[:3]
        if how != "pieces" or not (isinstance(split, tuple) and len(split) == 4):
            continue
        src, kind, size, dim = split
        view = guard.next
        while view.op == "get_attr":
            view = view.next
        if (view.op != "call_function" or view.target is not runtime.slices_view or view.kwargs
                or len(view.args) != 5 or kind != "split" or type(size) is not int):
            continue
        v_src, v_dim, v_start, v_count, v_length = view.args
        if v_src is src and v_dim == dim and v_start == 0 and v_count == expected and v_length == size:
            view.args = view.args + (guard.args,)
            graph.erase_node(guard)
            folded += 1
    return folded
