"""What the vertical fusions share: reading a planned group as one `recfuse.chain.Chain`
([norm] -> [activation] -> Linear -> [out activation] on [rows, D] slices), the checks that make
one fused op node exact, and the rewrite into that node.

The Linear (and what follows it) may run per slice or once after the stack: then those ops are
the plan's followers, and the fusion takes them in (`Claim.takes`). Subclasses choose which chains
they claim (`accepts`) and which op they emit (`emit`).

Example:
    >>> import torch, recfuse
    >>> from torch import nn
    >>> class M(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.norms = nn.ModuleList([nn.RMSNorm(8) for _ in range(3)])
    ...         self.lins = nn.ModuleList([nn.Linear(8, 2) for _ in range(3)])
    ...     def forward(self, x):
    ...         return torch.stack([lin(nn.functional.silu(n(s))) for n, lin, s
    ...                             in zip(self.norms, self.lins, x.split(8, 1))], 1)
    >>> g = recfuse.explain(M(), (torch.randn(4, 24),)).groups[0]
    >>> g.fusion, g.replaced_by.split(" (")[0]
    ('vertical_feature_mlp', '1 recfuse.feature_mlp node')
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ...chain import ACTIVATIONS as CHAIN_ACTIVATIONS, DEFAULT, NORMS, Chain  # noqa: F401 (DEFAULT: doctest)
from ..patterns import ACTIVATIONS, fmt_float
from ..plan import GroupPlan, ParamPlan, attr_tensor, ref_shape
from ..registry import Claim, Decline, Fusion
from ..runtime import _graph_leaf
from ..values import tensor_dtype

__all__ = ["ChainMatch", "VerticalChainFusion", "chain_activation", "dtype_eps", "eps_text", "FUSED_ACTIVATIONS"]

_NORMS = tuple(n for n in NORMS if n is not None)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# graph op kinds that are activations, whether or not the op has them
_ACTIVATION_KINDS = ACTIVATIONS
FUSED_ACTIVATIONS = tuple(a for a in CHAIN_ACTIVATIONS if a is not None)


def chain_activation(op) -> "str | None":
    """The op's activation as `recfuse.feature_mlp` names it, or None if it has no such one.

    gelu's ``approximate`` decides: "none" is "gelu" (erf), "tanh" is "gelu_tanh".

    Example:
        >>> from recfuse.fx.patterns import OpInfo
        >>> chain_activation(OpInfo("gelu", None, None, (("approximate", "tanh"),)))
        'gelu_tanh'
        >>> chain_activation(OpInfo("leaky_relu", None, None, (("negative_slope", 0.2),))) is None
        True
    """
    if op.kind == "gelu":
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(op.attr("approximate", "none"))
    return op.kind if op.kind in FUSED_ACTIVATIONS else None


def _describe_activation(op) -> str:
    attrs = ", ".join(f"{k}={v!r}" for k, v in op.attrs)
    return f"{op.kind}({attrs})" if attrs else op.kind


@dataclass(frozen=True)
class ChainMatch:
    """A group read as one fused chain: `chain`, the norm's eps (None: RMSNorm's default,
    `dtype_eps` of the input at run time), where the norm and the Linear are in ``chain ops + takes``, and the
    followers taken in (`takes`).

    Example:
        >>> ChainMatch(DEFAULT, 1e-5, 0, 2, ()).chain.describe()
        'layer_norm -> tanh -> linear -> relu'
    """

    chain: Chain
    eps: Optional[float]
    norm_index: Optional[int]
    linear_index: int
    takes: tuple


class VerticalChainFusion(Fusion):
    """Base of the vertical fusions: `match` reads the group as a `ChainMatch` and checks that one
    fused node computes exactly what the slices did; subclasses say which chains they take
    (`accepts`) and emit the node (`emit`).

    Example:
        >>> VerticalChainFusion.mode
        'vertical'
    """

    title = "vertical fusion"
    mode = "vertical"

    # -- subclass hooks ------------------------------------------------------------------------

    def accepts(self, m: ChainMatch, plan: GroupPlan) -> Optional[str]:
        """None if this fusion claims the chain `m`, else why not."""
        return None

    def emit(self, rw, x, m: ChainMatch, params: dict, eps_node, layout: int):
        """The fused node on the batched input `x` (feature dim at `layout`)."""
        raise NotImplementedError

    def describe(self, m: ChainMatch, plan: GroupPlan) -> str:
        """What replaced the group, in words, for the report."""
        raise NotImplementedError

    # -- match -----------------------------------------------------------------------------------

    def match(self, plan: GroupPlan, analysis):
        m = self.read_chain(plan, analysis.root if analysis is not None else None)
        if isinstance(m, str):
            return Decline(m)
        why = self.accepts(m, plan)
        if why is not None:
            return Decline(why)
        why = self._check(plan, m, analysis.root if analysis is not None else None)
        if why is not None:
            return Decline(why)
        return Claim(takes=m.takes, detail=m)

    @staticmethod
    def read_chain(plan: GroupPlan, root) -> "ChainMatch | str":
        """The group (with the followers it can take) as [norm] -> [activation] -> Linear ->
        [out activation], or why it is not one."""
        c0 = plan.chains[0]
        ops, core = list(c0.ops), c0.core_in
        text = plan.ops_text()
        if core is None or len(core) != 2:
            n = "?" if core is None else len(core)
            return f"the chain is {text} on {n}D slices, not on [rows, D] slices"
        rep = plan.replaces
        can_follow = rep is not None and rep.how == "stack" and rep.dim < len(c0.core_out)
        seq = ops + (list(plan.followers) if can_follow else [])
        i, norm_index = 0, None
        if seq[0].kind in _NORMS:
            norm_index, i = 0, 1
        act = None
        if i < len(seq) and seq[i].kind in _ACTIVATION_KINDS:
            act, i = seq[i], i + 1
        grammar = "[layer_norm|rms_norm] -> [activation] -> linear -> [activation]"
        if i >= len(seq) or seq[i].kind != "linear":
            if i < len(ops):
                return f"the chain is {text}, not {grammar}"
            if rep is None:
                after = "the stack has other inputs too, so nothing after it is fused"
            elif rep.how != "stack":
                after = f"its {rep.how} is not followed by a linear on the features"
            elif not can_follow:
                after = "its stack puts the features last, where a linear after it would mix them"
            else:
                after = "its stack is not followed by a linear"
            return f"the chain is {text}, with no linear: it stops at {ops[-1].kind} and {after}"
        lin, i = i, i + 1
        out = None
        if i < len(seq) and seq[i].kind in _ACTIVATION_KINDS:
            if chain_activation(seq[i]) is not None or i < len(ops):
                out, i = seq[i], i + 1
        if i < len(ops):
            return f"the chain is {text}, not {grammar} (it goes on after {seq[i - 1].kind})"
        for a in (act, out):
            if a is not None and chain_activation(a) is None:
                return (f"activation {_describe_activation(a)} is not one recfuse.feature_mlp has "
                        f"({', '.join(FUSED_ACTIVATIONS)})")
        norm = seq[norm_index] if norm_index is not None else None
        eps = norm.attr("eps") if norm is not None else 1e-5
        chain = Chain(norm.kind if norm is not None else None, chain_activation(act) if act is not None else None,
                      chain_activation(out) if out is not None else None)
        return ChainMatch(chain, eps, norm_index, lin, tuple(seq[len(ops):i]))

    def _check(self, plan: GroupPlan, m: ChainMatch, root) -> Optional[str]:
        """Why one fused node would not compute what the slices do, or None."""
        c0 = plan.chains[0]
        core = c0.core_in
        if m.norm_index is not None:
            norm = c0.ops[m.norm_index]
            if norm.attr("shape") != (core[-1],):
                return f"{norm.kind} normalizes over {list(norm.attr('shape'))}, not the last dim only"
            eps = norm.attr("eps")
            if eps is not None and not (eps >= 0 and math.isfinite(eps)):
                return f"{norm.kind} eps={eps} is not a finite eps >= 0"
        for op in m.takes:
            if op.kind == "linear":
                why = self._follower_linear(plan, op, root)
                if why is not None:
                    return why
        last = len(c0.ops) - 1
        # Without a replaceable sink every use of a slice's final value is served by a view of
        # the fused result, so only uses of intermediates block the fusion.
        blocking = [s for s in plan.side_uses if not (plan.replaces is None and s.op == last)]
        if blocking:
            s = blocking[0]
            return (f"slice {plan.positions[s.slice]}'s {plan.chains[s.slice].ops[s.op].kind} output "
                    f"`{s.node.name}` is also used by `{s.users[0].name}` (served by a view)")
        dtype = tensor_dtype(c0.start)
        if dtype not in _DTYPES:
            return f"dtype {dtype} not supported by the fused op"
        for op in list(c0.ops) + list(m.takes):
            for name, r in op.params.items():
                pd = _ref_dtype(r, root) if r is not None else None
                if pd is not None and pd != dtype:
                    return (f"{op.kind} {name} has dtype {pd} but the slices are {dtype}; the fused op "
                            f"computes in one dtype")
        return None

    @staticmethod
    def _follower_linear(plan: GroupPlan, op, root) -> Optional[str]:
        w, b = op.params.get("weight"), op.params.get("bias")
        shape = ref_shape(w, root) if w is not None else None
        if shape is None or len(shape) != 2 or shape[1] != plan.chains[0].core_out[-1]:
            return f"the linear after the stack has weight shape {shape}, not [H, D]"
        if b is not None and b.key is None:
            return "the linear after the stack has a constant bias"
        late = [r.node for r in (w, b) if r is not None and r.node is not None and not r.node < plan.insert_before]
        if late:
            return f"the linear after the stack reads `{late[0].name}`, defined after the slices are used"
        return None

    # -- fuse ------------------------------------------------------------------------------------

    def fuse(self, plan: GroupPlan, claim: Claim, rw) -> str:
        m: ChainMatch = claim.detail
        layout = plan.layout
        x = rw.batched_input(layout)
        ops = plan.chains[0].ops + list(claim.takes)
        if m.linear_index < len(plan.params):
            lin_specs = plan.params[m.linear_index]
        else:  # after the stack: one Linear for every feature
            lin_specs = {k: None if r is None else ParamPlan("shared", (r,)) for k, r in ops[m.linear_index].params.items()}
        norm_specs = plan.params[m.norm_index] if m.norm_index is not None else {}
        params = {
            "weight": rw.param(lin_specs.get("weight"), "weight"),
            "bias": rw.param(lin_specs.get("bias"), "bias"),
            "ln_weight": rw.param(norm_specs.get("weight"), "ln_weight"),
            "ln_bias": rw.param(norm_specs.get("bias"), "ln_bias"),
        }
        eps_node = m.eps
        if m.chain.norm is not None and m.eps is None:
            eps_node = rw.fn(dtype_eps, [x])
        out = self.emit(rw, x, m, params, eps_node, layout)
        rw.finish(out, through=claim.takes[-1].node if claim.takes else None, contiguous=True)
        return self.describe(m, plan)


def _ref_dtype(r, root) -> Optional[torch.dtype]:
    if r.node is not None:
        return tensor_dtype(r.node)
    if r.attr is not None:
        t = attr_tensor(root, r.attr)
        return t.dtype if t is not None else None
    return None


@_graph_leaf
def dtype_eps(x: torch.Tensor) -> float:
    """The eps `F.rms_norm` uses when given eps=None, for x: the machine epsilon of its compute
    type (float64 for float64, else float32: 16-bit inputs get float32's epsilon, not their own,
    whatever the docs say). Read at run time from the tensor being normalized, so a model moved
    to another dtype after the transform gets what the per-slice RMSNorm would have used.

    Example:
        >>> dtype_eps(torch.zeros(1, dtype=torch.bfloat16)) == torch.finfo(torch.float32).eps
        True
    """
    return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps


def eps_text(m: ChainMatch) -> str:
    """The eps part of a fused node's description ('' without a norm).

    Example:
        >>> eps_text(ChainMatch(Chain("rms_norm", None, None), None, 0, 1, ()))
        "eps=None (F.rms_norm's default for the input's dtype, at run time)"
    """
    if m.chain.norm is None:
        return ""
    if m.eps is None:
        return "eps=None (F.rms_norm's default for the input's dtype, at run time)"
    return f"eps={fmt_float(m.eps)}"
