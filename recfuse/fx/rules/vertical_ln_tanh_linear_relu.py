"""LayerNorm -> tanh -> Linear -> relu over F slices -> one `recfuse.ln_tanh_linear_relu` node.

The Linear and relu may run per slice or once after the stack (then they are the plan's
followers). The fused op reads [rows, D] slices with a per-row LayerNorm over D. The reading of
the chain, the checks and the rewrite are shared with `vertical_feature_mlp`
(`vertical_base.VerticalChainFusion`); this fusion takes the default chain only, and emits the
op the seed model's graphs have always held.

Example:
    >>> import torch, recfuse
    >>> from recfuse.puzzler import split_stack
    >>> r = recfuse.explain(split_stack, (torch.randn(96), 4, 8, torch.nn.Linear(8, 1)))
    >>> r.groups[0].fusion
    'vertical_ln_tanh_linear_relu'
"""
from __future__ import annotations

from ...chain import DEFAULT
from ...ops import ln_tanh_linear_relu
from ..plan import GroupPlan
from .vertical_base import ChainMatch, VerticalChainFusion

__all__ = ["VerticalLnTanhLinearRelu"]


class VerticalLnTanhLinearRelu(VerticalChainFusion):
    """Claims groups whose chain, with the ops after the stack, is exactly LayerNorm -> tanh ->
    Linear -> relu on [rows, D] slices, and rewrites each into one fused op node.

    Example:
        >>> from recfuse.fx.registry import FUSIONS
        >>> FUSIONS[0].name, FUSIONS[0].mode
        ('vertical_ln_tanh_linear_relu', 'vertical')
    """

    name = "vertical_ln_tanh_linear_relu"

    def accepts(self, m: ChainMatch, plan: GroupPlan):
        if m.chain != DEFAULT:
            return f"the chain is {m.chain.describe()}, not {DEFAULT.describe()}"
        return None

    def emit(self, rw, x, m, params, eps_node, layout):
        return rw.fn(ln_tanh_linear_relu, [x, params["weight"], params["bias"]],
                     {"ln_weight": params["ln_weight"], "ln_bias": params["ln_bias"], "eps": eps_node,
                      "feature_dim": layout})

    def describe(self, m, plan):
        return f"1 recfuse.ln_tanh_linear_relu node (feature_dim={plan.layout}, input: {plan.source.describe()})"
