"""The built-in fusions, one file each, registered here in priority order: the fused kernels
first (the default chain's own op, then the rest of the op family), the batched chain (which
takes any group) last.

Example:
    >>> from recfuse.fx.registry import FUSIONS
    >>> [type(f).__name__ for f in FUSIONS]
    ['VerticalLnTanhLinearRelu', 'VerticalFeatureMlp', 'HorizontalChain']
"""
from ..registry import register_fusion
from .horizontal_chain import HorizontalChain
from .vertical_feature_mlp import VerticalFeatureMlp
from .vertical_ln_tanh_linear_relu import VerticalLnTanhLinearRelu

__all__ = ["VerticalLnTanhLinearRelu", "VerticalFeatureMlp", "HorizontalChain"]

register_fusion(VerticalLnTanhLinearRelu())
register_fusion(VerticalFeatureMlp())
register_fusion(HorizontalChain())
