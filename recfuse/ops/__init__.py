"""The fused op: `ln_tanh_linear_relu` as a torch.library custom op, and its kernels."""
from .ln_tanh_linear_relu import ln_tanh_linear_relu, uses_triton
from ._cpu_compiled import cpu_backend, get_cpu_backend, set_cpu_backend

__all__ = ["ln_tanh_linear_relu", "uses_triton", "cpu_backend", "get_cpu_backend", "set_cpu_backend"]
