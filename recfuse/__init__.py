"""recfuse: horizontal and vertical fusion of per-feature dense preprocessing.

Example:
    >>> import torch, recfuse
    >>> x = torch.randn(16, 8, 32)                      # [F, B, D]
    >>> w = torch.randn(1, 32)
    >>> y = recfuse.ln_tanh_linear_relu(x, w)             # one fused op over the 16 features
    >>> torch.allclose(y, recfuse.reference.ln_tanh_linear_relu(x, w), atol=1e-5)
    True
"""
import logging as _logging

from . import reference
from .errors import RecfuseError
from .ops import feature_mlp, ln_tanh_linear_relu
from .module import FusedFeatureProcessor
from .fx import transform, explain, FusionReport

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__version__ = "0.1.0"
__all__ = ["ln_tanh_linear_relu", "feature_mlp", "reference", "RecfuseError", "FusedFeatureProcessor", "transform", "explain",
           "FusionReport"]
