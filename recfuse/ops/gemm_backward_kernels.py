"""Triton kernels of the GEMM backward (`recfuse.ops.gemm_backward`): the backward's two dots
(dt = dz @ w and the weight gradient dz^T @ t) run as cuBLAS GEMMs, and these two kernels do the
rest, row by row, with no dot and no [H, D] accumulator.

1. `masked_grad_rows`: dz = grad_y where the forward's relu mask is set, else 0 (or grad_y itself
   without an out-activation), as a contiguous [F, B, H] fp32 operand.
2. `norm_act_backward_rows`: from x, the forward's row stats and the GEMM's dt, the norm and
   activation backward: dx, t (written over dt, the weight-gradient GEMM's operand) and each
   program's column sums of the LayerNorm affine's gradients.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _activate_grad, _dx_of_rows, _load_relu_mask_rows, _normalize_activate


@triton.jit
def masked_grad_rows(
    GY, STATS, DZ,
    B, H, stats_half, rows_per_program,
    stride_gy_f, stride_gy_b, stride_gy_h,
    LOAD_MASK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """dz[f, b, h] in fp32, contiguous [F, B, H]; grid (row programs, F). With LOAD_MASK, 0 where
    the forward's z <= 0 (its saved relu mask, `kernels._store_relu_mask`), as torch's relu
    backward selects (a NaN grad_y there is dropped, not multiplied)."""
    pid = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < H
    row_start = pid * rows_per_program
    for r0 in range(row_start, row_start + rows_per_program, BLOCK_B):
        rows = r0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        mask = rmask[:, None] & hmask[None, :]
        gy_ptrs = GY + f * stride_gy_f + rows64[:, None] * stride_gy_b + hs[None, :] * stride_gy_h
        dz = tl.load(gy_ptrs, mask=mask, other=0.0).to(tl.float32)
        if LOAD_MASK:
            keep = _load_relu_mask_rows(STATS, stats_half, f, B, rows64, rmask, hs, H, BLOCK_H)
            dz = tl.where(keep, dz, 0.0)
        tl.store(DZ + (f * B + rows64)[:, None] * H + hs[None, :], dz, mask=mask)


@triton.jit
def norm_act_backward_rows(
    X, DT, DX, STATS, LNW, LNB, PARTIAL,
    f0, F, B, D, stats_half, rows_per_program,
    stride_x_f, stride_x_b, stride_x_d,
    stride_dx_f, stride_dx_b, stride_dx_d,
    stride_lnw_f, stride_lnb_f,
    eps, inv_d,
    HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
    FAST_TANH: tl.constexpr, EVEN_D: tl.constexpr, X_EVICT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """The backward of norm -> affine -> activation for features f0 .. f0 + grid[1] - 1, given
    dt = dL/dt of their rows as a contiguous [grid[1], B, D] fp32 buffer; grid (row programs,
    features of the chunk).

    Writes dx in x's strides, t = activation(affine(xhat)) over dt (each tile is read before it is
    written, by the program that owns it), and the program's column sums of da * xhat and da (the
    LayerNorm weight's and bias's gradients) into PARTIAL [2, programs, F, D] fp32, which a
    fixed-order sum over programs reduces. Row stats are the forward's (STATS planes 0 and 1).
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    f_local = tl.program_id(1).to(tl.int64)
    f = f0 + f_local
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc_w = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_D], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, B)
    for r0 in tl.range(row_start, row_end, BLOCK_B, num_stages=LOOP_STAGES):
        rows = r0 + tl.arange(0, BLOCK_B)
        rmask = rows < row_end
        rows64 = rows.to(tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        x_ptrs = X + f * stride_x_f + rows64[:, None] * stride_x_b + cols[None, :] * stride_x_d
        stat_ptrs = STATS + f * B + rows64
        xhat, a, t, mean, rstd, g = _normalize_activate(
            x_ptrs, x_ptrs, mask, cmask, f, cols, D, eps, LNW, LNB, stride_lnw_f, stride_lnb_f,
            stat_ptrs, stat_ptrs + stats_half, rmask,
            HAS_LNW, HAS_LNB, FAST_TANH, True, EVEN_D, False, X_EVICT, NORM, ACT)
        dt_ptrs = DT + (f_local * B + rows64)[:, None] * D + cols[None, :]
        dt = tl.load(dt_ptrs, mask=mask, other=0.0)
        # padded lanes exact zeros: sigmoid'(0) is not 0, and a NaN there would reach the row sums
        da = tl.where(mask, dt * _activate_grad(a, t, ACT, FAST_TANH), 0.0)
        dx = _dx_of_rows(da * g[None, :], xhat, rstd, inv_d, NORM)
        dx_ptrs = DX + f * stride_dx_f + rows64[:, None] * stride_dx_b + cols[None, :] * stride_dx_d
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(dt_ptrs, t, mask=mask)
        if HAS_LNW:
            acc_w += tl.sum(da * xhat, axis=0)
        if HAS_LNB:
            acc_b += tl.sum(da, axis=0)
    part = PARTIAL + (pid * F + f) * D + cols
    if HAS_LNW:
        tl.store(part, acc_w, mask=cmask)
    if HAS_LNB:
        tl.store(part + n_prog * F * D, acc_b, mask=cmask)
