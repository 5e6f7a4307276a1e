"""The GEMM backward (`BackwardConfig.gemm`): fp32 backwards whose dots are too large for one fused
kernel's registers run them as cuBLAS GEMMs.

The fused backward kernels hold a whole row tile beside the [H, D] weight and its gradient
accumulator; at fp32 H = 32-64 they run at 255 registers, 12% occupancy, latency-bound, at 6-9%
of the memory floor on the H200 (benchmarks/NOTES.md). Here each piece is what its hardware does
well:

1. `masked_grad_rows` (Triton): dz = grad_y masked by the forward's relu mask, [F, B, H] fp32.
2. per chunk of features (so that the scratch buffer stays a fraction of x, `chunk_features`):
   a. dt = dz @ w (cuBLAS; `torch.bmm` for per-feature weights) into the scratch buffer;
   b. `norm_act_backward_rows` (Triton): dx, t over dt, the affine's column sums per program;
   c. the weight gradient dz^T @ t (cuBLAS), added over chunks in chunk order.
3. the bias and LayerNorm-affine gradients: fixed-order sums (`torch.sum`) over rows / programs.

Every gradient is written in its final shape and dtype (fp32 everywhere on this path).
Deterministic: the same kernels, GEMMs and sums in the same order on every call.
cuBLAS honours the process's TF32 setting; with TF32 on for fp32 matmuls the GEMMs would carry
~1e-3 relative error, and with deterministic algorithms on torch refuses CUDA GEMMs without a
deterministic cuBLAS workspace: such calls run the fused kernels instead (`cublas_allowed`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

import torch
import triton

from . import configs
from ._compiled_launch import CompiledLaunchCache
from .gemm_backward_kernels import masked_grad_rows, norm_act_backward_rows

_launch_masked_grad = CompiledLaunchCache(masked_grad_rows)
_launch_rows = CompiledLaunchCache(norm_act_backward_rows)

# The scratch buffer (dt, then t, of one chunk of features) stays under this fraction of x's bytes,
# or under SCRATCH_FLOOR_BYTES where that is larger: extra memory of bytes(x) / 4, not bytes(x).
SCRATCH_FRACTION = 4
SCRATCH_FLOOR_BYTES = 32 << 20


def fp32_matmul_exact(device_type: str) -> bool:
    """Whether fp32 matmuls on this device type run in full fp32 (no TF32), read without touching
    the setting (reading the legacy ``allow_tf32`` flag raises once the new API has been used).

    Example:
        >>> fp32_matmul_exact("cpu")
        True
    """
    if device_type != "cuda":
        return True
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is not None:
        return precision != "tf32"
    return not torch.backends.cuda.matmul.allow_tf32


# The cuBLAS workspace settings under which torch lets GEMMs run with deterministic algorithms on
# (torch.use_deterministic_algorithms raises on a CUDA GEMM without one of them).
_DETERMINISTIC_CUBLAS_CONFIGS = (":4096:8", ":16:8")


def cublas_allowed(device_type: str) -> bool:
    """Whether this process lets the GEMM backward's GEMMs run as it needs them: full fp32
    (`fp32_matmul_exact`), and, with ``torch.use_deterministic_algorithms`` on, a deterministic
    cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``), without which torch raises on a CUDA GEMM. The
    fused kernels need neither (they are deterministic), so a call without them runs those.

    Example:
        >>> cublas_allowed("cpu")
        True
    """
    if not fp32_matmul_exact(device_type):
        return False
    if device_type != "cuda" or not torch.are_deterministic_algorithms_enabled():
        return True
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG") in _DETERMINISTIC_CUBLAS_CONFIGS


def chunk_features(F: int, B: int, D: int, x_bytes: int, min_chunks: int) -> int:
    """Features a chunk: the [chunk, B, D] fp32 scratch buffer under max(x_bytes / SCRATCH_FRACTION,
    SCRATCH_FLOOR_BYTES), and at least ``min_chunks`` chunks (`BackwardConfig.gemm`).

    Example:
        >>> chunk_features(64, 2048, 512, 256 << 20, 1)  # x 256 MB: a 64 MB buffer, 16 features
        16
        >>> chunk_features(8, 100, 64, 1 << 20, 3)
        3
    """
    budget = max(x_bytes // SCRATCH_FRACTION, SCRATCH_FLOOR_BYTES)
    per_feature = max(1, B * D * 4)
    by_budget = max(1, budget // per_feature)
    by_count = triton.cdiv(F, max(1, min_chunks))
    return max(1, min(F, by_budget, by_count))


@dataclasses.dataclass
class GemmBackwardPlan:
    """Everything a GEMM backward call of one signature needs but its tensors."""

    cfg: configs.BackwardConfig
    F: int
    B: int
    D: int
    H: int
    chunk: int
    programs: int  # row programs a feature, both Triton kernels
    dz_meta: dict
    dz_ints: tuple
    meta: dict  # `norm_act_backward_rows`' constexprs
    ints: tuple  # its integers after f0 (F, B, D, stats_half, rows_per_program, strides, eps, 1 / D)
    options: dict
    fallback: Any  # the fused kernels' plan, for calls made with TF32 on (None: no fused kernel fits)
    zero_dx: bool = False
    reads_stats: bool = True
    tracer: Optional[Callable[[], Optional[list]]] = None  # `launch.trace_launches`' list, or None

    @property
    def grid(self) -> tuple:
        return (self.programs, min(self.chunk, self.F))

    @property
    def launcher(self) -> CompiledLaunchCache:
        """The row kernel's launcher (`norm_act_backward_rows`)."""
        return _launch_rows

    def __call__(self, grad_y, x, weight, bias, ln_weight, ln_bias, stats):
        if self.fallback is not None and not cublas_allowed(x.device.type):
            return self.fallback(grad_y, x, weight, bias, ln_weight, ln_bias,
                                 stats if self.fallback.reads_stats else None)
        F, B, D, H = self.F, self.B, self.D, self.H
        dx = torch.empty_like(x)
        contiguous = torch.contiguous_format
        gw = torch.empty_like(weight, memory_format=contiguous)
        gb = x.new_empty((0,)) if bias is None else torch.empty_like(bias, memory_format=contiguous)
        glw = x.new_empty((0,)) if ln_weight is None else torch.empty_like(ln_weight, memory_format=contiguous)
        glb = x.new_empty((0,)) if ln_bias is None else torch.empty_like(ln_bias, memory_format=contiguous)
        dz = x.new_empty((F, B, H), dtype=torch.float32)
        if stats is None:  # no norm and no relu: the kernels read no stats (any pointer will do)
            stats = dz
        _launch_masked_grad((self.programs, F), (grad_y, stats, dz) + self.dz_ints, self.dz_meta, num_warps=4)
        has_affine = ln_weight is not None or ln_bias is not None
        partial = x.new_empty((2, self.programs, F, D) if has_affine else (1,), dtype=torch.float32)
        scratch = x.new_empty((min(self.chunk, F), B, D), dtype=torch.float32)
        lnw = ln_weight if ln_weight is not None else x
        lnb = ln_bias if ln_bias is not None else x
        per_feature_w = weight.dim() == 3
        for f0 in range(0, F, self.chunk):
            n = min(self.chunk, F - f0)
            dz_c = dz[f0:f0 + n]
            buf = scratch[:n]
            if per_feature_w:
                torch.bmm(dz_c, weight[f0:f0 + n], out=buf)
            else:
                torch.mm(dz_c.view(n * B, H), weight, out=buf.view(n * B, D))
            trace = self.tracer() if self.tracer is not None else None
            if trace is not None:
                trace.append(("backward", (self.programs, n), self.meta, self.cfg))
            _launch_rows((self.programs, n), (x, buf, dx, stats, lnw, lnb, partial, f0) + self.ints,
                         self.meta, **self.options)
            if per_feature_w:
                torch.bmm(dz_c.transpose(1, 2), buf, out=gw[f0:f0 + n])
            elif f0 == 0:
                torch.mm(dz_c.view(n * B, H).t(), buf.view(n * B, D), out=gw)
            else:
                gw.addmm_(dz_c.view(n * B, H).t(), buf.view(n * B, D))
        if bias is not None:
            if bias.dim() == 2:
                torch.sum(dz, 1, out=gb)
            else:
                torch.sum(dz.view(F * B, H), 0, out=gb)
        for i, (p, g) in enumerate(((ln_weight, glw), (ln_bias, glb))):
            if p is not None:
                if p.dim() == 2:
                    torch.sum(partial[i], 0, out=g)
                else:
                    torch.sum(partial[i].view(self.programs * F, D), 0, out=g)
        if self.zero_dx:
            dx.zero_()
        return dx, gw, gb, glw, glb


def gemm_backward_eligible(grad_y, x, weight, params, norm: int, out_act: int, has_mask: bool, stats) -> bool:
    """Whether a call can take the GEMM backward: fp32 throughout, the forward's row stats (unless
    there is no norm) and, with relu, its mask, rows and features to walk.

    Example:
        >>> import torch
        >>> x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
        >>> gemm_backward_eligible(torch.randn(2, 3, 5), x, w, (), 1, 3, False, None)  # no relu mask
        False
    """
    fp32 = torch.float32
    if x.dtype != fp32 or weight.dtype != fp32 or grad_y.dtype != fp32:
        return False
    if any(p is not None and p.dtype != fp32 for p in params):
        return False
    if x.numel() == 0 or grad_y.numel() == 0:
        return False
    if out_act not in (0, 3) or (out_act == 3 and not has_mask):
        return False
    return norm == 0 or stats is not None


def build(cfg: configs.BackwardConfig, grad_y, x, weight, ln_weight, ln_bias, eps: float, feature_dim: int,
          F: int, B: int, D: int, H: int, num_sms: int, feature_major: Callable, param_stride: Callable,
          norm: int, act: int, fast_tanh: int, load_mask: bool, stats_half: int, fallback,
          zero_dx: bool, tracer: Optional[Callable[[], Optional[list]]] = None) -> GemmBackwardPlan:
    """The plan of a GEMM backward (the caller checked `gemm_backward_eligible`)."""
    block_b, block_d = cfg.block_b, triton.next_power_of_2(D)
    programs = max(1, min(triton.cdiv(B, block_b), triton.cdiv(num_sms * cfg.programs_per_sm, F)))
    rows_per_program = triton.cdiv(triton.cdiv(B, programs), block_b) * block_b
    programs = triton.cdiv(B, rows_per_program)
    sxf, sxb = feature_major(x, feature_dim)
    sgf, sgb = feature_major(grad_y, feature_dim)
    dx_strides = torch.empty_like(x, device="meta").stride()
    sdf, sdb = (dx_strides[0], dx_strides[1]) if feature_dim == 0 else (dx_strides[1], dx_strides[0])
    block_h = triton.next_power_of_2(H)
    # dz tiles of up to 4096 elements that divide a program's rows (a power of two: rows_per_program
    # is a multiple of block_b)
    dz_block_b = min(rows_per_program & -rows_per_program, max(1, 4096 // block_h))
    dz_ints = (B, H, stats_half, rows_per_program, sgf, sgb, grad_y.stride(2))
    dz_meta = dict(LOAD_MASK=load_mask, BLOCK_B=dz_block_b, BLOCK_H=block_h)
    ints = (F, B, D, stats_half, rows_per_program, sxf, sxb, x.stride(2), sdf, sdb, dx_strides[2],
            param_stride(ln_weight, 2), param_stride(ln_bias, 2), float(eps), 1.0 / D)
    meta = dict(HAS_LNW=ln_weight is not None, HAS_LNB=ln_bias is not None, NORM=norm, ACT=act,
                FAST_TANH=fast_tanh, EVEN_D=D == block_d, X_EVICT=cfg.x_evict,
                BLOCK_B=block_b, BLOCK_D=block_d, LOOP_STAGES=max(1, cfg.loop_stages))
    chunk = chunk_features(F, B, D, x.numel() * x.element_size(), cfg.gemm)
    return GemmBackwardPlan(cfg, F, B, D, H, chunk, programs, dz_meta, dz_ints, meta, ints,
                            dict(num_warps=cfg.num_warps), fallback, zero_dx=zero_dx, tracer=tracer)
