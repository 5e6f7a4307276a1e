"""The fused op: `ln_tanh_linear_relu` as a torch.library custom op, and its kernels."""
from .ln_tanh_linear_relu import ln_tanh_linear_relu, uses_triton

__all__ = ["ln_tanh_linear_relu", "uses_triton"]
