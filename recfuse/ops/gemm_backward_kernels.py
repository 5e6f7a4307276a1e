"""Triton kernels of the GEMM backward (`recfuse.ops.gemm_backward`): the backward's two dots as
tensor-core GEMMs, and the norm and activation backward row by row between them, with no [H, D]
accumulator beside a row tile.

1. `masked_grad_rows`: dz = grad_y where the forward's relu mask is set, else 0 (or grad_y itself
   without an out-activation), as a contiguous [F, B, H] operand in the inputs' dtype (fp32 for
   fp32, else 16-bit: masking is exact).
2. `dz_times_weight`: dt = dz @ w for a chunk of features, one [rows, columns] tile a program,
   into the scratch buffer.
3. `norm_act_backward_rows`: from x, the forward's row stats and dt, the norm and activation
   backward: dx, t (written over dt, the weight gradient's operand) and each program's column
   sums of the LayerNorm affine's gradients.
4. `weight_grad_partials`: dz^T @ t over a range of rows a program, one [H, columns] fp32 partial
   a program (added to the previous chunk's in the same slot, for a weight shared by the
   features), which a fixed-order sum over programs reduces.

The dots (`_gemm_dot`): 16-bit operands in their dtype with fp32 accumulation, the precision of
PyTorch's own 16-bit Linear backward. fp32 operands by default as three bf16 parts each, the six
largest cross products on the bf16 tensor cores (``SPLIT``, "bf16x6" of `BackwardConfig.fp32_dots`:
within fp32's rounding, whatever the process's TF32 setting, non-finite values as IEEE products
give them), or one tl.dot of ``DOT_PRECISION`` ("tf32x3", "ieee"). The interpreter's numpy dot
takes fp32 (``UPCAST``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import (_activate_grad, _dot_parts, _dx_of_rows, _fold_rows, _load_relu_mask_rows, _normalize_activate,
                      _split16)


@triton.jit
def _gemm_operand(v, SPLIT: tl.constexpr):
    """A GEMM operand as the parts `_gemm_dot_parts` multiplies: three bf16 parts with SPLIT (an
    infinite value's NaN remainder zeroed), else v itself (three times, the last two unused)."""
    # one return statement: Triton types every return of a function, constexpr branches too
    if SPLIT:
        p0, p1, p2 = _split16(v, tl.bfloat16, 3, True)
    else:
        p0, p1, p2 = v, v, v
    return p0, p1, p2


@triton.jit
def _gemm_dot_parts(a0, a1, a2, b0, b1, b2, acc, SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in fp32 from `_gemm_operand`'s parts. SPLIT: the six largest cross products
    (`kernels._dot_parts` ORDER 3), the lower-order products' non-finite sum dropped (NAN_SAFE),
    so that inf and NaN reach acc as in an IEEE product. Else one tl.dot of DOT_DTYPE operands at
    DOT_PRECISION."""
    if SPLIT:
        return _dot_parts(a0, a1, a2, b0, b1, b2, acc, 3, 3, 3, UPCAST, True)
    return tl.dot(a0.to(DOT_DTYPE), b0.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)


@triton.jit
def masked_grad_rows(
    GY, STATS, DZ, BIAS_PARTIAL,
    B, H, stats_half, rows_per_program,
    stride_gy_f, stride_gy_b, stride_gy_h,
    LOAD_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """dz[f, b, h] in DZ's dtype, contiguous [F, B, H]; grid (row programs, F). With LOAD_MASK, 0 where
    the forward's z <= 0 (its saved relu mask, `kernels._store_relu_mask`), as torch's relu
    backward selects (a NaN grad_y there is dropped, not multiplied). With HAS_BIAS, the program's
    column sums of dz (the bias gradient's share of its rows, summed in fp32 as dz is stored)
    into BIAS_PARTIAL[pid, f, :H], which a fixed-order sum over programs reduces."""
    pid = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
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
        dz = dz.to(DZ.dtype.element_ty)
        tl.store(DZ + (f * B + rows64)[:, None] * H + hs[None, :], dz, mask=mask)
        if HAS_BIAS:
            acc += tl.sum(dz.to(tl.float32), axis=0)
    if HAS_BIAS:
        tl.store(BIAS_PARTIAL + (pid * tl.num_programs(1) + f) * H + hs, acc, mask=hmask)


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
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, LOOP_STAGES: tl.constexpr, ROW_SLOTS: tl.constexpr,
):
    """The backward of norm -> affine -> activation for features f0 .. f0 + grid[1] - 1, given
    dt = dL/dt of their rows as a contiguous [grid[1], B, D] buffer (fp32, or the inputs' 16-bit
    dtype); grid (row programs,
    features of the chunk).

    Writes dx in x's strides, t = activation(affine(xhat)) over dt (each tile is read before it is
    written, by the program that owns it), and the program's column sums of da * xhat and da (the
    LayerNorm weight's and bias's gradients) into PARTIAL [2, programs, F, D] fp32, which a
    fixed-order sum over programs reduces. Row stats are the forward's (STATS planes 0 and 1).

    The column sums collect in ROW_SLOTS slots (tile row r into slot r % ROW_SLOTS,
    `kernels._fold_rows`), summed once after the row loop: with ROW_SLOTS the rows one layout tile
    spans (its warps along rows), each thread adds its own rows, where a sum per tile crossed the
    warps through shared memory, with a barrier, every tile.
    """
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    f_local = tl.program_id(1).to(tl.int64)
    f = f0 + f_local
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc_w = tl.zeros([ROW_SLOTS, BLOCK_D], dtype=tl.float32)
    acc_b = tl.zeros([ROW_SLOTS, BLOCK_D], dtype=tl.float32)
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
        dt = tl.load(dt_ptrs, mask=mask, other=0.0).to(tl.float32)
        # padded lanes exact zeros: sigmoid'(0) is not 0, and a NaN there would reach the row sums
        da = tl.where(mask, dt * _activate_grad(a, t, ACT, FAST_TANH), 0.0)
        dx = _dx_of_rows(da * g[None, :], xhat, rstd, inv_d, NORM)
        dx_ptrs = DX + f * stride_dx_f + rows64[:, None] * stride_dx_b + cols[None, :] * stride_dx_d
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(dt_ptrs, t.to(DT.dtype.element_ty), mask=mask)
        if HAS_LNW:
            acc_w += _fold_rows(da * xhat, ROW_SLOTS)
        if HAS_LNB:
            acc_b += _fold_rows(da, ROW_SLOTS)
    part = PARTIAL + (pid * F + f) * D + cols
    if HAS_LNW:
        tl.store(part, tl.sum(acc_w, axis=0), mask=cmask)
    if HAS_LNB:
        tl.store(part + n_prog * F * D, tl.sum(acc_b, axis=0), mask=cmask)


@triton.jit
def dz_times_weight(
    DZ, W, DT,
    f0, B, H, D,
    stride_w_f, stride_w_h, stride_w_d,
    SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, ROW_TILES: tl.constexpr,
):
    """dt[f - f0, b, :] = dz[f, b, :] @ w[f] for the features f0 .. f0 + grid[2] - 1 (stride_w_f
    0: one weight shared by all): dz contiguous [F, B, H], dt the contiguous [grid[2], B, D]
    scratch buffer; grid (row programs, column tiles, features of the chunk), ROW_TILES
    consecutive [BLOCK_M, BLOCK_N] tiles a program, the weight's tile loaded (and split) once for
    them. H fits one tile (BLOCK_H >= H, at least 16 for the tensor cores; the padding reads
    zeros)."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    f_local = tl.program_id(2).to(tl.int64)
    f = f0 + f_local
    hs = tl.arange(0, BLOCK_H)
    cmask = cols < D
    hmask = hs < H
    w = tl.load(W + f * stride_w_f + hs[:, None] * stride_w_h + cols[None, :] * stride_w_d,
                mask=hmask[:, None] & cmask[None, :], other=0.0)
    w0, w1, w2 = _gemm_operand(w, SPLIT)
    row0 = tl.program_id(0) * (ROW_TILES * BLOCK_M)
    for i in tl.static_range(ROW_TILES):
        rows = row0 + i * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        dz = tl.load(DZ + (f * B + rows64)[:, None] * H + hs[None, :], mask=rmask[:, None] & hmask[None, :],
                     other=0.0)
        d0, d1, d2 = _gemm_operand(dz, SPLIT)
        dt = _gemm_dot_parts(d0, d1, d2, w0, w1, w2, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), SPLIT,
                             DOT_DTYPE, DOT_PRECISION, UPCAST)
        tl.store(DT + (f_local * B + rows64)[:, None] * D + cols[None, :], dt.to(DT.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


@triton.jit
def weight_grad_partials(
    DZ, T, PARTIAL,
    f0, B, rows_total, rows_per_program, H, D, slot_stride,
    PER_FEATURE: tl.constexpr, ACCUMULATE: tl.constexpr, COLS_MAJOR: tl.constexpr,
    SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """One program's share of the weight gradient dz^T @ t for the features f0 .. f0 + n - 1 of a
    chunk, in fp32: rows [pid0 * rows_per_program, + rows_per_program) of ``rows_total``, columns
    of tile pid1. dz is contiguous [F, B, H], t the chunk's contiguous [n, B, D] scratch buffer.

    A weight shared by the features (grid[2] = 1): the chunk's n * B rows flattened, written to
    PARTIAL[pid0] ([H, D]), with ACCUMULATE added to what that slot holds (the previous chunk's:
    the same program slot, in chunk order). Per-feature weights (PER_FEATURE, grid[2] = n): the
    B rows of feature f0 + pid2, written to PARTIAL[pid0, f0 + pid2]. ``slot_stride`` is a
    program slot's elements (H * D, or F * H * D).

    COLS_MAJOR accumulates the partial's transpose, [columns, H] = t^T @ dz: the columns are the
    dot's M (64+ rows, as Hopper's tensor cores take them) and H (16-64) its N; else [H, columns]
    = dz^T @ t."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    f_local = tl.program_id(2).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    cmask = cols < D
    hmask = hs < H
    dz_base = DZ + (f0 + f_local).to(tl.int64) * B * H
    t_base = T + f_local * B * D
    if COLS_MAJOR:
        acc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, rows_total)
    for r0 in tl.range(row_start, row_end, BLOCK_K, num_stages=LOOP_STAGES):
        rows = r0 + tl.arange(0, BLOCK_K)
        rmask = rows < row_end
        rows64 = rows.to(tl.int64)
        dz = tl.load(dz_base + rows64[:, None] * H + hs[None, :], mask=rmask[:, None] & hmask[None, :], other=0.0)
        t = tl.load(t_base + rows64[:, None] * D + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        d0, d1, d2 = _gemm_operand(dz, SPLIT)
        t0, t1, t2 = _gemm_operand(t, SPLIT)
        if COLS_MAJOR:
            acc = _gemm_dot_parts(tl.trans(t0), tl.trans(t1), tl.trans(t2), d0, d1, d2, acc, SPLIT, DOT_DTYPE,
                                  DOT_PRECISION, UPCAST)
        else:
            acc = _gemm_dot_parts(tl.trans(d0), tl.trans(d1), tl.trans(d2), t0, t1, t2, acc, SPLIT, DOT_DTYPE,
                                  DOT_PRECISION, UPCAST)
    slot = PARTIAL + pid.to(tl.int64) * slot_stride
    if PER_FEATURE:
        slot += (f0 + f_local) * H * D
    if COLS_MAJOR:
        part = slot + hs[None, :] * D + cols[:, None]
        mask = cmask[:, None] & hmask[None, :]
    else:
        part = slot + hs[:, None] * D + cols[None, :]
        mask = hmask[:, None] & cmask[None, :]
    if ACCUMULATE:
        acc += tl.load(part, mask=mask, other=0.0)
    tl.store(part, acc, mask=mask)
