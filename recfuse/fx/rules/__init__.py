"""The built-in fusions, one file each, registered here in priority order: the fused kernel
first, the batched chain (which takes any group) last.

Example:
    >>> from recfuse.fx.registry import FUSIONS
    >>> [type(f).__name__ for f in FUSIONS]
    ['VerticalLnTanhLinearRelu', 'HorizontalChain']
"""
from ..registry import register_fusion
from .horizontal_chain import HorizontalChain
from .vertical_ln_tanh_linear_relu import VerticalLnTanhLinearRelu

__all__ = ["VerticalLnTanhLinearRelu", "HorizontalChain"]

register_fusion(VerticalLnTanhLinearRelu())
register_fusion(HorizontalChain())
