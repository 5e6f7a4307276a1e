"""LayerNorm -> tanh -> Linear -> relu over F slices -> one `recfuse.ln_tanh_linear_relu` node.

The Linear and relu may run per slice or once after the stack (then they are the plan's
followers). The fused op reads [rows, D] slices with a per-row LayerNorm over D.

Example:
    >>> import torch, recfuse
    >>> from recfuse.puzzler import split_stack
    >>> r = recfuse.explain(split_stack, (torch.randn(96), 4, 8, torch.nn.Linear(8, 1)))
    >>> r.groups[0].fusion
    'vertical_ln_tanh_linear_relu'
"""
from __future__ import annotations

import torch

from ...ops import ln_tanh_linear_relu
from ..plan import GroupPlan, ParamPlan, ref_shape
from ..registry import Claim, Decline, Fusion
from ..values import tensor_dtype

__all__ = ["VerticalLnTanhLinearRelu"]

_CHAIN = ("layer_norm", "tanh", "linear", "relu")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class VerticalLnTanhLinearRelu(Fusion):
    """Claims groups whose chain, with the ops after the stack, is exactly LayerNorm -> tanh ->
    Linear -> relu on [rows, D] slices, and rewrites each into one fused op node.

    Example:
        >>> from recfuse.fx.registry import FUSIONS
        >>> FUSIONS[0].name, FUSIONS[0].mode
        ('vertical_ln_tanh_linear_relu', 'vertical')
    """

    name = "vertical_ln_tanh_linear_relu"
    title = "vertical fusion"
    mode = "vertical"

    def match(self, plan: GroupPlan, analysis):
        c0 = plan.chains[0]
        kinds, core = plan.kinds, c0.core_in
        if len(core) != 2 or len(kinds) < 2 or kinds != _CHAIN[: len(kinds)]:
            return Decline(f"the chain is {plan.ops_text()} on {len(core)}D slices, not layer_norm -> tanh "
                           f"[-> linear -> relu] on [rows, D] slices")
        tail = self._tail(plan, _CHAIN[len(kinds):], analysis.root)
        if isinstance(tail, str):
            return Decline(tail)
        if c0.ops[0].attr("shape") != (core[-1],):
            return Decline(f"layer_norm normalizes over {list(c0.ops[0].attr('shape'))}, not the last dim only")
        last = len(c0.ops) - 1
        # Without a replaceable sink every use of a slice's final value is served by a view of
        # the fused result, so only uses of intermediates block the fusion.
        blocking = [s for s in plan.side_uses if not (plan.replaces is None and s.op == last)]
        if blocking:
            s = blocking[0]
            return Decline(f"slice {plan.positions[s.slice]}'s {plan.chains[s.slice].ops[s.op].kind} output "
                           f"`{s.node.name}` is also used by `{s.users[0].name}` (served by a view)")
        dtype = tensor_dtype(c0.start)
        if dtype not in _DTYPES:
            return Decline(f"dtype {dtype} not supported by the fused op")
        return Claim(takes=tail)

    @staticmethod
    def _tail(plan: GroupPlan, needed: tuple, root):
        """The followers that complete the chain, or why they do not."""
        if not needed:
            return ()
        want = " -> ".join(needed)
        rep = plan.replaces
        if rep is None or rep.how != "stack" or rep.dim >= len(plan.chains[0].core_out):
            return f"the chain stops at {plan.kinds[-1]} and its stack is not followed by {want} on the features"
        tail = plan.followers[: len(needed)]
        if tuple(o.kind for o in tail) != needed:
            return f"the chain stops at {plan.kinds[-1]} and its stack is not followed by {want}"
        for op in tail:
            if op.kind != "linear":
                continue
            w, b = op.params.get("weight"), op.params.get("bias")
            shape = ref_shape(w, root) if w is not None else None
            if shape is None or len(shape) != 2 or shape[1] != plan.chains[0].core_out[-1]:
                return f"the linear after the stack has weight shape {shape}, not [H, D]"
            if b is not None and b.key is None:
                return "the linear after the stack has a constant bias"
            late = [r.node for r in (w, b) if r is not None and r.node is not None and not r.node < plan.insert_before]
            if late:
                return f"the linear after the stack reads `{late[0].name}`, defined after the slices are used"
        return tuple(tail)

    def fuse(self, plan: GroupPlan, claim: Claim, rw) -> str:
        layout = plan.layout
        x = rw.batched_input(layout)
        ops = plan.chains[0].ops + list(claim.takes)
        lin_i = next(k for k, o in enumerate(ops) if o.kind == "linear")
        ln_specs = plan.params[0]
        if lin_i < len(plan.params):
            lin_specs = plan.params[lin_i]
        else:
            lin_specs = {k: None if r is None else ParamPlan("shared", (r,)) for k, r in ops[lin_i].params.items()}
        w = rw.param(lin_specs.get("weight"), "weight")
        b = rw.param(lin_specs.get("bias"), "bias")
        lw = rw.param(ln_specs.get("weight"), "ln_weight")
        lb = rw.param(ln_specs.get("bias"), "ln_bias")
        out = rw.fn(ln_tanh_linear_relu, [x, w, b],
                    {"ln_weight": lw, "ln_bias": lb, "eps": ops[0].attr("eps"), "feature_dim": layout})
        rw.finish(out, through=claim.takes[-1].node if claim.takes else None, contiguous=True)
        return f"1 recfuse.ln_tanh_linear_relu node (feature_dim={layout}, input: {plan.source.describe()})"
