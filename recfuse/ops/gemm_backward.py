"""The GEMM backward (`BackwardConfig.gemm`): backwards whose dots are too large for one fused
kernel's registers run them as tensor-core GEMMs of their own.

The fused backward kernels hold a whole row tile beside the [H, D] weight and its gradient
accumulator; at fp32 H = 32-64 they run at 255 registers, 12% occupancy, latency-bound, at 6-9%
of the memory floor on the H200 (benchmarks/NOTES.md). Here each piece is a kernel that does one
thing (`gemm_backward_kernels`):

1. `masked_grad_rows`: dz = grad_y masked by the forward's relu mask, [F, B, H] in x's dtype.
2. per chunk of features (so that the scratch buffer stays a fraction of x, `chunk_features`):
   a. `dz_times_weight`: dt = dz @ w into the scratch buffer ([chunk, B, D] in x's dtype);
   b. `norm_act_backward_rows`: dx, t over dt, the affine's column sums per program;
   c. `weight_grad_partials`: dz^T @ t, one fp32 partial a program slot, added over chunks in
      chunk order.
3. the weight, bias and LayerNorm-affine gradients: fixed-order sums (`torch.sum`) of the
   kernels' per-program partials (the bias's from `masked_grad_rows`).

Every gradient is written in its final shape and dtype. fp32 dots run as three bf16 parts a value,
six products on the tensor cores (fp32's rounding, whatever the process's TF32 setting; "tf32x3"
as a `BackwardConfig.fp32_dots` knob), 16-bit ones in their dtype with fp32 accumulation, as
PyTorch's 16-bit Linear backward does. No atomics and no cuBLAS: the same inputs
give the same bits, with or without ``torch.use_deterministic_algorithms``.
(Until session 30 the two dots were cuBLAS fp32 GEMMs, on the SIMT cores: 29.5 TF/s, half the
H200's training step at fp32 D=512 H=64; benchmarks/NOTES.md.)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import triton

from . import configs
from ._compiled_launch import CompiledLaunchCache
from .gemm_backward_kernels import dz_times_weight, masked_grad_rows, norm_act_backward_rows, weight_grad_partials

_launch_masked_grad = CompiledLaunchCache(masked_grad_rows)
_launch_dt = CompiledLaunchCache(dz_times_weight)
_launch_rows = CompiledLaunchCache(norm_act_backward_rows)
_launch_dw = CompiledLaunchCache(weight_grad_partials)

# The scratch buffer (dt, then t, of one chunk of features) stays under this fraction of x's bytes,
# or under SCRATCH_FLOOR_BYTES where that is larger: extra memory of bytes(x) / 4, not bytes(x).
SCRATCH_FRACTION = 4
SCRATCH_FLOOR_BYTES = 32 << 20


def chunk_features(F: int, B: int, D: int, x_bytes: int, min_chunks: int, element_size: int = 4) -> int:
    """Features a chunk: the [chunk, B, D] scratch buffer (``element_size`` bytes an element, x's)
    under max(x_bytes / SCRATCH_FRACTION, SCRATCH_FLOOR_BYTES), and at least ``min_chunks`` chunks
    (`BackwardConfig.gemm`).

    Example:
        >>> chunk_features(64, 2048, 512, 256 << 20, 1)  # x 256 MB: a 64 MB buffer, 16 features
        16
        >>> chunk_features(8, 100, 64, 1 << 20, 3)
        3
    """
    budget = max(x_bytes // SCRATCH_FRACTION, SCRATCH_FLOOR_BYTES)
    per_feature = max(1, B * D * element_size)
    by_budget = max(1, budget // per_feature)
    by_count = triton.cdiv(F, max(1, min_chunks))
    return max(1, min(F, by_budget, by_count))


def gemm_grid(cfg: configs.BackwardConfig, B: int, D: int, chunk: int, per_feature_weight: bool,
              num_sms: int) -> tuple[int, int]:
    """(columns a GEMM tile, the weight gradient's program slots): ``cfg.gemm_cols`` capped at D's
    power of two, and enough slots (row ranges) that column tiles x slots (x features of a chunk,
    per-feature weights) make about ``cfg.gemm_dw_per_sm`` programs an SM, each over whole
    ``cfg.dw_block_b``-row steps. The other tiles are ``cfg``'s gemm_* and dw_* knobs.

    Example:
        >>> from recfuse.ops import configs
        >>> gemm_grid(configs.gemm_backward_config(512, 64), 2048, 512, 16, False, 132)  # 8 x 66: 4 an SM
        (64, 66)
    """
    cols = min(cfg.gemm_cols, triton.next_power_of_2(max(D, 16)))
    row_steps = triton.cdiv(B * (1 if per_feature_weight else chunk), cfg.dw_block_b)
    per_slot = triton.cdiv(D, cols) * (chunk if per_feature_weight else 1)
    return cols, max(1, min(row_steps, triton.cdiv(cfg.gemm_dw_per_sm * num_sms, per_slot)))


def row_slots(cfg: configs.BackwardConfig, block_d: int, element_size: int) -> int:
    """The row kernel's column-sum slots (`norm_act_backward_rows`' ROW_SLOTS): ``cfg.row_slots``
    where set, else the rows one layout tile of its [block_b, block_d] tiles spans
    (`configs.layout_row_span`), so that folding a tile into that many slots adds inside each
    thread.

    Example:
        >>> from recfuse.ops import configs
        >>> cfg = configs.gemm_backward_config(512, 64)  # 4 rows, 4 warps
        >>> row_slots(cfg, 512, 4), row_slots(cfg, 512, 2)  # fp32: 4 warps along a row; bf16: 2 x 2
        (1, 2)
    """
    if cfg.row_slots:
        return min(cfg.row_slots, cfg.block_b)
    return configs.layout_row_span(cfg.block_b, block_d, cfg.num_warps, element_size)


def _sum_into(src: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    """out = src summed over ``dim`` (fp32 partials into a gradient of the parameter's dtype)."""
    if src.dtype == out.dtype:
        torch.sum(src, dim, out=out)
    else:
        out.copy_(src.sum(dim))


@dataclasses.dataclass(frozen=True)
class LaunchStep:
    """One kernel launch of a GEMM backward call: its launcher, grid, the names of the call's
    tensors it takes (in order, `GemmBackwardPlan.__call__`'s), then its fixed integers, constexprs
    and launch options."""

    launcher: CompiledLaunchCache
    grid: tuple
    tensors: tuple
    ints: tuple
    meta: dict
    options: dict


@dataclasses.dataclass
class GemmBackwardPlan:
    """Everything a GEMM backward call of one signature needs but its tensors: its launches in
    order (`steps`: the masked dz, then per chunk of features dt, the row kernel and the weight
    gradient's partials), each bound to its compiled kernel after its first launch."""

    cfg: configs.BackwardConfig
    F: int
    B: int
    D: int
    H: int
    chunk: int
    programs: int  # row programs a feature, both row kernels
    dw_slots: int  # the weight gradient's program slots (`gemm_grid`)
    meta: dict  # `norm_act_backward_rows`' constexprs
    ints: tuple  # its integers after f0 (F, B, D, stats_half, rows_per_program, strides, eps, 1 / D)
    steps: list
    zero_dx: bool = False
    reads_stats: bool = True
    tracer: Optional[Callable[[], Optional[list]]] = None  # `launch.trace_launches`' list, or None
    bound_steps: list = dataclasses.field(default_factory=list)  # per step: its bound launcher, or None

    @property
    def grid(self) -> tuple:
        return (self.programs, min(self.chunk, self.F))

    @property
    def launcher(self) -> CompiledLaunchCache:
        """The row kernel's launcher (`norm_act_backward_rows`)."""
        return _launch_rows

    @property
    def bound(self) -> Optional[bool]:
        """True once every launch is bound to its compiled kernel (CUDA, after the first call)."""
        return True if self.bound_steps and all(b is not None for b in self.bound_steps) else None

    def _launch(self, i: int, step: LaunchStep, tensors: tuple) -> None:
        bound = self.bound_steps[i] if i < len(self.bound_steps) else None
        if bound is not None:
            bound(*tensors)
            return
        args = tensors + step.ints
        step.launcher(step.grid, args, step.meta, **step.options)
        bound = step.launcher.bind(step.grid, args, step.meta, len(tensors), **step.options)
        if i < len(self.bound_steps):
            self.bound_steps[i] = bound
        else:
            self.bound_steps.append(bound)

    def __call__(self, grad_y, x, weight, bias, ln_weight, ln_bias, stats):
        F, B, D, H = self.F, self.B, self.D, self.H
        dx = torch.empty_like(x)
        contiguous = torch.contiguous_format
        gw = torch.empty_like(weight, memory_format=contiguous)
        gb = x.new_empty((0,)) if bias is None else torch.empty_like(bias, memory_format=contiguous)
        glw = x.new_empty((0,)) if ln_weight is None else torch.empty_like(ln_weight, memory_format=contiguous)
        glb = x.new_empty((0,)) if ln_bias is None else torch.empty_like(ln_bias, memory_format=contiguous)
        dz = x.new_empty((F, B, H))
        has_affine = ln_weight is not None or ln_bias is not None
        partial = x.new_empty((2, self.programs, F, D) if has_affine else (1,), dtype=torch.float32)
        bias_partial = x.new_empty((self.programs, F, H) if bias is not None else (1,), dtype=torch.float32)
        w_partial = x.new_empty((self.dw_slots,) + tuple(gw.shape), dtype=torch.float32)
        # no norm and no relu: the kernels read no stats (any pointer will do); absent affine: x
        tensors = dict(grad_y=grad_y, x=x, weight=weight, stats=dz if stats is None else stats, dz=dz,
                       dx=dx, scratch=x.new_empty((min(self.chunk, F), B, D)), partial=partial,
                       bias_partial=bias_partial, w_partial=w_partial,
                       lnw=ln_weight if ln_weight is not None else x, lnb=ln_bias if ln_bias is not None else x)
        trace = self.tracer() if self.tracer is not None else None
        for i, step in enumerate(self.steps):
            if trace is not None and step.launcher is _launch_rows:
                trace.append(("backward", step.grid, self.meta, self.cfg))
            self._launch(i, step, tuple(tensors[name] for name in step.tensors))
        _sum_into(w_partial, 0, gw)
        if bias is not None:
            if bias.dim() == 2:
                _sum_into(bias_partial, 0, gb)
            else:
                _sum_into(bias_partial.view(self.programs * F, H), 0, gb)
        for i, (p, g) in enumerate(((ln_weight, glw), (ln_bias, glb))):
            if p is not None:
                if p.dim() == 2:
                    _sum_into(partial[i], 0, g)
                else:
                    _sum_into(partial[i].view(self.programs * F, D), 0, g)
        if self.zero_dx:
            dx.zero_()
        return dx, gw, gb, glw, glb


def gemm_dot_meta(cfg: configs.BackwardConfig, dtype: torch.dtype, dot_args: dict, device_type: str) -> dict:
    """The GEMM kernels' dot constexprs (`gemm_backward_kernels._gemm_dot`): fp32 operands split
    into bf16 parts where ``cfg.fp32_dots`` is "bf16x6" (the default), else one tl.dot at that
    precision; ``dot_args`` the forward's DOT_DTYPE / DOT_PRECISION for x on its device.

    Example:
        >>> import torch
        >>> from recfuse.ops import configs
        >>> cfg = configs.gemm_backward_config(512, 64)
        >>> gemm_dot_meta(cfg, torch.float32, {}, "cuda")["SPLIT"]
        True
    """
    split = dtype == torch.float32 and cfg.fp32_dots == "bf16x6"
    precision = "ieee" if device_type == "cpu" or cfg.fp32_dots == "ieee" else "tf32x3"
    return dict(dot_args, SPLIT=split, DOT_PRECISION=precision, UPCAST=device_type == "cpu")


def gemm_backward_eligible(grad_y, x, weight, params, norm: int, out_act: int, has_mask: bool, stats) -> bool:
    """Whether a call can take the GEMM backward: one floating dtype throughout (fp32, bf16 or
    fp16), the forward's row stats (unless there is no norm) and, with relu, its mask, rows and
    features to walk.

    Example:
        >>> import torch
        >>> x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
        >>> gemm_backward_eligible(torch.randn(2, 3, 5), x, w, (), 1, 3, False, None)  # no relu mask
        False
    """
    dtype = x.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if weight.dtype != dtype or grad_y.dtype != dtype or any(p is not None and p.dtype != dtype for p in params):
        return False
    if x.numel() == 0 or grad_y.numel() == 0:
        return False
    if out_act not in (0, 3) or (out_act == 3 and not has_mask):
        return False
    return norm == 0 or stats is not None


def build(cfg: configs.BackwardConfig, grad_y, x, weight, bias, ln_weight, ln_bias, eps: float, feature_dim: int,
          F: int, B: int, D: int, H: int, num_sms: int, feature_major: Callable, param_stride: Callable,
          norm: int, act: int, fast_tanh: int, load_mask: bool, stats_half: int, dot_meta: dict,
          zero_dx: bool, tracer: Optional[Callable[[], Optional[list]]] = None) -> GemmBackwardPlan:
    """The plan of a GEMM backward (the caller checked `gemm_backward_eligible`); ``dot_meta`` the
    GEMM kernels' DOT_DTYPE and DOT_PRECISION for x's dtype on its device (`gemm_dot_meta`)."""
    block_b, block_d = cfg.block_b, triton.next_power_of_2(D)
    chunk = chunk_features(F, B, D, x.numel() * x.element_size(), cfg.gemm, x.element_size())
    # programs_per_sm counts one launch's programs: the row kernel's launches cover a chunk of
    # features each, not all F (with all F, 4 chunks launched a quarter of the programs asked for)
    programs = max(1, min(triton.cdiv(B, block_b), triton.cdiv(num_sms * cfg.programs_per_sm, chunk)))
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
    dz_step = LaunchStep(_launch_masked_grad, (programs, F), ("grad_y", "stats", "dz", "bias_partial"),
                         (B, H, stats_half, rows_per_program, sgf, sgb, grad_y.stride(2)),
                         dict(LOAD_MASK=load_mask, HAS_BIAS=bias is not None, BLOCK_B=dz_block_b, BLOCK_H=block_h),
                         dict(num_warps=4))
    ints = (F, B, D, stats_half, rows_per_program, sxf, sxb, x.stride(2), sdf, sdb, dx_strides[2],
            param_stride(ln_weight, 2), param_stride(ln_bias, 2), float(eps), 1.0 / D)
    meta = dict(HAS_LNW=ln_weight is not None, HAS_LNB=ln_bias is not None, NORM=norm, ACT=act,
                FAST_TANH=fast_tanh, EVEN_D=D == block_d, X_EVICT=cfg.x_evict,
                BLOCK_B=block_b, BLOCK_D=block_d, LOOP_STAGES=max(1, cfg.loop_stages),
                ROW_SLOTS=row_slots(cfg, block_d, x.element_size()))
    per_feature_w = weight.dim() == 3
    cols, dw_slots = gemm_grid(cfg, B, D, chunk, per_feature_w, num_sms)
    dot_meta = gemm_dot_meta(cfg, x.dtype, dot_meta, x.device.type)
    gemm_block_h = max(16, block_h)
    col_tiles = triton.cdiv(D, cols)
    w_strides = (weight.stride(0) if per_feature_w else 0,) + tuple(weight.stride()[-2:])
    dt_meta = dict(dot_meta, BLOCK_M=cfg.gemm_rows, BLOCK_N=cols, BLOCK_H=gemm_block_h, ROW_TILES=cfg.gemm_row_tiles)
    dw_meta = dict(dot_meta, PER_FEATURE=per_feature_w, COLS_MAJOR=bool(cfg.gemm_cols_major), BLOCK_K=cfg.dw_block_b,
                   BLOCK_N=cols, BLOCK_H=gemm_block_h, LOOP_STAGES=cfg.dw_num_stages)
    slot_stride = H * D * (F if per_feature_w else 1)
    steps = [dz_step]
    for f0 in range(0, F, chunk):
        n = min(chunk, F - f0)
        rows_total = B if per_feature_w else n * B
        rows_per_slot = triton.cdiv(triton.cdiv(rows_total, dw_slots), cfg.dw_block_b) * cfg.dw_block_b
        steps += [
            LaunchStep(_launch_dt, (triton.cdiv(B, cfg.gemm_rows * cfg.gemm_row_tiles), col_tiles, n),
                       ("dz", "weight", "scratch"), (f0, B, H, D) + w_strides, dt_meta,
                       dict(num_warps=cfg.gemm_dt_warps)),
            LaunchStep(_launch_rows, (programs, n), ("x", "scratch", "dx", "stats", "lnw", "lnb", "partial"),
                       (f0,) + ints, meta, dict(num_warps=cfg.num_warps)),
            # the weight gradient's partials: a weight shared by the features adds each chunk's
            # rows to the previous chunks' in the same program slot (chunk order: deterministic)
            LaunchStep(_launch_dw, (dw_slots, col_tiles, n if per_feature_w else 1),
                       ("dz", "scratch", "w_partial"), (f0, B, rows_total, rows_per_slot, H, D, slot_stride),
                       dict(dw_meta, ACCUMULATE=f0 > 0 and not per_feature_w), dict(num_warps=cfg.dw_num_warps)),
        ]
    return GemmBackwardPlan(cfg, F, B, D, H, chunk, programs, dw_slots, meta, ints, steps, zero_dx=zero_dx,
                            tracer=tracer)
