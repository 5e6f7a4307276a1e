"""[norm] -> [activation] -> Linear -> [out activation] over F slices -> one `recfuse.feature_mlp`
node: every chain of the op family (`recfuse.chain.Chain`) except the default one, which
`vertical_ln_tanh_linear_relu` claims first.

The norm is a LayerNorm or an RMSNorm over the last dim (module or function; with or without
affine; an RMSNorm's eps=None becomes what `F.rms_norm` uses then, read at run time from the
input's dtype: `vertical_base.dtype_eps`); the activations are tanh, sigmoid, relu, gelu (erf or tanh approximation)
and silu, in any spelling `patterns.classify` knows. The Linear may be one per slice (stacked
into [F, H, D]), one shared in the chain, or one after the stack (with what follows it). A lone
Linear (no norm, no activation) is fused too: the op then is a batched matmul that reads the
slices in place. Any other chain (two Linears, a norm over more dims, an activation the op
does not have such as leaky_relu or softplus, mismatched dtypes) is declined with the reason
and stays batched by `horizontal_chain`.

Example:
    >>> import torch, recfuse
    >>> def f(x, lin):
    ...     return torch.stack([torch.nn.functional.gelu(lin(s), approximate="tanh")
    ...                         for s in x.split(8, 1)], 1)
    >>> g = recfuse.explain(f, (torch.randn(4, 24), torch.nn.Linear(8, 2))).groups[0]
    >>> g.fusion, g.replaced_by
    ('vertical_feature_mlp', '1 recfuse.feature_mlp node (linear -> gelu_tanh, feature_dim=1, weight shared, input: zero-copy view of x)')
"""
from __future__ import annotations

from ...chain import DEFAULT
from ...ops import feature_mlp
from ..plan import GroupPlan
from .vertical_base import ChainMatch, VerticalChainFusion, eps_text

__all__ = ["VerticalFeatureMlp"]


class VerticalFeatureMlp(VerticalChainFusion):
    """Claims every group that reads as one non-default `feature_mlp` chain (see the module doc)
    and rewrites it into one `recfuse.feature_mlp` call.

    Example:
        >>> from recfuse.fx.registry import FUSIONS
        >>> [f.name for f in FUSIONS][:2]
        ['vertical_ln_tanh_linear_relu', 'vertical_feature_mlp']
    """

    name = "vertical_feature_mlp"

    def accepts(self, m: ChainMatch, plan: GroupPlan):
        if m.chain == DEFAULT:
            return "the default chain is vertical_ln_tanh_linear_relu's"
        return None

    def emit(self, rw, x, m, params, eps_node, layout):
        kwargs = {"norm": m.chain.norm, "ln_weight": params["ln_weight"], "ln_bias": params["ln_bias"],
                  "eps": eps_node, "activation": m.chain.activation,
                  "out_activation": m.chain.out_activation, "feature_dim": layout}
        return rw.fn(feature_mlp, [x, params["weight"], params["bias"]], kwargs)

    def describe(self, m, plan):
        lin = plan.params[m.linear_index] if m.linear_index < len(plan.params) else None
        shared = lin is None or lin["weight"].shared
        parts = [m.chain.describe(), f"feature_dim={plan.layout}", eps_text(m),
                 "weight shared" if shared else "weight per feature", f"input: {plan.source.describe()}"]
        return "1 recfuse.feature_mlp node (" + ", ".join(p for p in parts if p) + ")"
