"""The fused ops: `ln_tanh_linear_relu` and the family `feature_mlp` as torch.library custom ops,
and their kernels."""
from .ln_tanh_linear_relu import ln_tanh_linear_relu, uses_triton
from .feature_mlp import feature_mlp
from ._cpu_compiled import cpu_backend, get_cpu_backend, set_cpu_backend
# installs configs' first-use hook (tuning on first use; does nothing unless RECFUSE_AUTOTUNE=1)
from . import autotune  # noqa: E402,F401

__all__ = ["ln_tanh_linear_relu", "feature_mlp", "uses_triton", "cpu_backend", "get_cpu_backend", "set_cpu_backend"]
