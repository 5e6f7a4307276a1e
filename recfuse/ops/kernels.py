"""Triton kernels of norm -> activation -> Linear -> out activation over F features (no torch logic).

One kernel family for every `feature_mlp` chain: the norm (LayerNorm, RMSNorm or none) and the two
activations are compile-time constants (NORM, ACT, OUT_ACT; codes in `recfuse.chain`), so each
chain compiles to its own specialised kernel and the default LayerNorm -> tanh -> relu compiles to
exactly the code it always did. The descriptions below name the default chain.

Three kernels, as in Triton's layer-norm tutorial:

* `ln_tanh_linear_relu_fwd`: one program per (tile of BLOCK_B rows, feature). Reads each row of x
  once, keeps mean, rstd, the normalised row, tanh, the dot with the weight, the bias and the relu
  in registers, writes y once. Nothing of x's size is written.
* `ln_tanh_linear_relu_bwd`: one program per (chunk of rows, feature). Recomputes the normalised
  row, tanh and the relu mask from x (no activation is saved, not even y), writes dx, and accumulates per-program partial
  sums of the weight, bias and LayerNorm-affine gradients in registers.
  `ln_tanh_linear_relu_bwd_chunked` is its tl.dot path a slice of columns at a time, for rows too
  wide for the whole-row tile (H * D > 16384); its partial sums go through global memory.
  `ln_tanh_linear_relu_bwd_weight`: with DZ_OUT the whole-row kernel writes dz and the row stats
  instead of the weight gradient, and this GEMM over rows makes it a chunk of columns at a time.
  `ln_tanh_linear_relu_bwd_rows2`: H = 1 with D the sum of two powers of two, each row walked as
  those two unmasked parts instead of one padded tile; `ln_tanh_linear_relu_bwd_rows2_dot` the
  same for the tl.dot path.
  `ln_tanh_linear_relu_bwd_two_pass`, launched twice: the two-pass tl.dot backward, column
  chunks of every row tile, from the forward's row stats and relu mask: the first launch writes
  each chunk's share of dx's two row sums, the second dx and the partial sums.
* `partials_to_grads`: the second stage of the weight-gradient reduction, a fixed-order sum over
  the per-program partials that writes every parameter gradient in its final shape and dtype. No
  float atomics anywhere, so the same inputs give the same bits.

Precision: every dtype accumulates in float32. With ``USE_DOT`` the row tile is multiplied with
``tl.dot``: for float32 inputs ``DOT_PRECISION`` is "tf32x3" on the GPU (three TF32 products that
recover float32 accuracy, within 1e-5 of float64, where plain TF32 gives ~1e-3) and "ieee" in the
interpreter; for bf16/fp16 the forward rounds the tanh tile to the input dtype before the
tensor-core dot (fp32 accumulate), the precision PyTorch's own bf16 Linear has. The backward's dots
(``BWD_DOT_DTYPE``) take bf16 operands for bf16 inputs and, by default, for fp32 inputs too: fp32
values go in as 2 or 3 bf16 parts whose cross products (``SPLIT_*``, `_dot_parts`) recover ~2^-16
or fp32 accuracy on bf16 tensor cores; fp16 inputs take fp32 operands (3xTF32).
``DOT_DTYPE`` is the dtype the dot operands are rounded to: the input dtype on the GPU, float32 in
the Triton interpreter (its numpy dot has no bf16).
"""
import triton
import triton.language as tl


@triton.jit
def _tanh_signed(a, t):
    """tanh(a) from t = (1 - e) / (1 + e), e = exp(-2|a|) (tanh |a|): t with a's sign, and for
    |a| < 1/16 the odd Taylor series to a^7 instead. Near 0, 1 - e cancels: its absolute error is
    an ulp of 1, a relative error of ~6e-8 / |2a| (3e-4 at |a| = 1e-4, as small LayerNorm weights
    give); the series' truncation error is < 1e-11 relative there, and from 1/16 on the exp form is
    within ~5e-7. Three FMAs: on the H100 the series to a^11 below 0.25 cost 4% of the fp32 forward
    (413 vs 398 us at F=128 B=8192 D=256 H=1, results/checks/gpu_trust_h100.txt)."""
    t = tl.where(a < 0, -t, t)
    a2 = a * a
    p = -17.0 / 315.0
    p = p * a2 + 2.0 / 15.0
    p = p * a2 - 1.0 / 3.0
    return tl.where(a2 < 0.00390625, a + a * (a2 * p), t)


@triton.jit
def _tanh(a):
    # tanh from exp of a non-positive argument: no overflow, exact sign, and portable to the
    # interpreter (libdevice is CUDA-only).
    e = tl.exp(-2.0 * tl.abs(a))
    return _tanh_signed(a, (1.0 - e) / (1.0 + e))


@triton.jit
def _tanh_approx(a):
    # The GPU's MUFU tanh (max relative error ~2^-11): ample for bf16/fp16 outputs (eps 2^-8,
    # 2^-11) and a fraction of the exp-and-divide cost, which makes bf16 compute-bound otherwise.
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [a], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _tanh_mufu(a):
    # `_tanh` with its exp and divide as one MUFU instruction each (CUDA only: inline PTX).
    # Triton's fp32 exp and `/` guard denormal and huge operands (4 and 5 extra instructions),
    # which these operands never are: 2|a| log2(e) <= 0 (a result below 2^-126 flushes to 0, so
    # tanh is 1) and 1 + e is in [1, 2]. ex2.approx.ftz is within 2 ulp, rcp.approx.ftz 1 ulp:
    # the accuracy of Triton's forms (2 ulp `/`). The fp32 forward is instruction-bound (H200
    # ncu, D=256 H=1: issue slots 88% busy, DRAM 48%; results/checks/ncu_fwd_h200.txt) and the
    # exact tanh was ~22 of its ~40 instructions an element (sm_90 SASS).
    e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [tl.abs(a) * -2.8853900817779268],
                                  dtype=tl.float32, is_pure=True, pack=1)
    r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32,
                                  is_pure=True, pack=1)
    return _tanh_signed(a, (1.0 - e) * r)


@triton.jit
def _tanh_of(a, FAST_TANH: tl.constexpr):
    # FAST_TANH (`launch._tanh_mode`): 0 the portable exact form, 1 the MUFU tanh (16-bit
    # outputs), 2 the exact form on MUFU exp and reciprocal (fp32 on CUDA).
    if FAST_TANH == 1:
        return _tanh_approx(a)
    if FAST_TANH == 2:
        return _tanh_mufu(a)
    return _tanh(a)


@triton.jit
def _sigmoid(a):
    # 1 / (1 + e^-a): e^-a overflows to inf for a < -88, giving exactly 0, as torch.sigmoid does.
    return 1.0 / (1.0 + tl.exp(-a))


@triton.jit
def _sigmoid_of(a, FAST_TANH: tl.constexpr):
    # 16-bit outputs: 1/2 + tanh(a/2)/2 on the MUFU tanh (error ~2^-12, under bf16/fp16 rounding)
    # instead of an exp and an IEEE divide: 16-bit forwards are instruction-bound.
    if FAST_TANH == 1:
        return 0.5 + 0.5 * _tanh_approx(0.5 * a)
    return _sigmoid(a)


@triton.jit
def _activate(a, ACT: tl.constexpr, FAST_TANH: tl.constexpr):
    """The activation coded by ACT (`recfuse.chain.ACTIVATIONS`): 0 none, 1 tanh, 2 sigmoid,
    3 relu, 4 gelu (erf), 5 gelu (tanh approximation), 6 silu. fp32 in, fp32 out.
    (0.7978845608028654 = sqrt(2 / pi), 0.7071067811865476 = 1 / sqrt(2).)"""
    if ACT == 1:
        r = _tanh_of(a, FAST_TANH)
    elif ACT == 2:
        r = _sigmoid_of(a, FAST_TANH)
    elif ACT == 3:
        r = tl.where(a < 0.0, 0.0, a)  # keeps NaN, as torch.relu does (tl.maximum would not)
    elif ACT == 4:
        if FAST_TANH == 1:
            # 16-bit outputs: the erf form through the tanh form on the MUFU tanh. They differ by
            # < 5e-4 absolute (< 2e-4 relative), under bf16's and fp16's rounding of the result;
            # libdevice erf made the bf16 forward 2.7x slower than tanh's (H100, D=256 H=1).
            r = 0.5 * a * (1.0 + _tanh_approx(0.7978845608028654 * (a + 0.044715 * a * a * a)))
        else:
            r = 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))
    elif ACT == 5:
        r = 0.5 * a * (1.0 + _tanh_of(0.7978845608028654 * (a + 0.044715 * a * a * a), FAST_TANH))
    elif ACT == 6:
        r = a * _sigmoid_of(a, FAST_TANH)
    else:
        r = a
    return r


@triton.jit
def _activate_grad(a, t, ACT: tl.constexpr, FAST_TANH: tl.constexpr):
    """d activation / da at a, given t = activation(a) (which tanh and sigmoid reuse).
    (0.3989422804014327 = 1 / sqrt(2 pi).)"""
    if ACT == 1:
        r = 1.0 - t * t
    elif ACT == 2:
        r = t * (1.0 - t)
    elif ACT == 3:
        # 1 where a is NaN too: torch's relu backward keeps grad unless relu(a) <= 0 (red-team
        # round 25: a NaN z dropped its row's grad_y from the weight and bias gradients)
        r = tl.where(a <= 0.0, 0.0, 1.0)
    elif ACT == 4:
        r = 0.5 * (1.0 + tl.erf(a * 0.7071067811865476)) + a * 0.3989422804014327 * tl.exp(-0.5 * a * a)
    elif ACT == 5:
        th = _tanh_of(0.7978845608028654 * (a + 0.044715 * a * a * a), FAST_TANH)
        r = 0.5 * (1.0 + th) + 0.5 * a * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * a * a)
    elif ACT == 6:
        s = _sigmoid(a)
        r = s * (1.0 + a * (1.0 - s))
    else:
        r = tl.full(a.shape, 1.0, tl.float32)
    return r


@triton.jit
def _normalize_activate(
    x_ptrs, pivot_ptrs, mask, cmask, f, cols, D, eps,
    LNW, LNB, stride_lnw_f, stride_lnb_f,
    mean_ptrs, rstd_ptrs, rmask,
    HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, FAST_TANH: tl.constexpr, LOAD_STATS: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr,
):
    """Load a [rows, BLOCK_D] tile, return (xhat, a = affine(xhat), t = activation(a), mean, rstd,
    norm weight). NORM (`recfuse.chain.NORMS`): 1 LayerNorm, 2 RMSNorm (mean is 0), 0 none
    (xhat is x, rstd 1, no affine).

    LOAD_STATS: read the rows' mean and rstd (saved by the forward) instead of two reductions.
    EVEN_D (D == BLOCK_D) / EVEN_B (no padded rows in the tile): the masks and the selects that
    zero padded lanes are compiled out. They are several of the ~15 instructions per element,
    which is what bounds the 16-bit kernels (half the bytes per element of fp32).
    """
    if EVEN_D and EVEN_B:
        x = tl.load(x_ptrs, eviction_policy=X_EVICT).to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy=X_EVICT).to(tl.float32)
    mean = tl.zeros([x.shape[0]], dtype=tl.float32)
    rstd = tl.full([x.shape[0]], 1.0, tl.float32)
    if NORM != 0 and LOAD_STATS:
        if EVEN_B:
            mean = tl.load(mean_ptrs)
            rstd = tl.load(rstd_ptrs)
        else:
            mean = tl.load(mean_ptrs, mask=rmask, other=0.0)
            rstd = tl.load(rstd_ptrs, mask=rmask, other=0.0)
    # fp32 LayerNorm statistics are taken about each row's first value (see `_norm_act_tile`):
    # one [rows] load, no reduction (a row reduction for it cost the row forward 3-7%, H100).
    pivot = mean
    if NORM == 1 and not LOAD_STATS and x_ptrs.dtype.element_ty == tl.float32:
        if EVEN_B:
            pivot = tl.load(pivot_ptrs).to(tl.float32)
        else:
            pivot = tl.load(pivot_ptrs, mask=rmask, other=0.0).to(tl.float32)
    return _norm_act_tile(x, pivot, mean, rstd, mask, cmask, f, cols, D, eps, LNW, LNB, stride_lnw_f, stride_lnb_f,
                          HAS_LNW, HAS_LNB, FAST_TANH, LOAD_STATS, EVEN_D, EVEN_B, NORM, ACT,
                          x_ptrs.dtype.element_ty == tl.float32)


@triton.jit
def _norm_act_tile(
    x, pivot, mean, rstd, mask, cmask, f, cols, D, eps,
    LNW, LNB, stride_lnw_f, stride_lnb_f,
    HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, FAST_TANH: tl.constexpr, LOAD_STATS: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
    SHIFT: tl.constexpr,
):
    """`_normalize_activate` of a tile of x already loaded (fp32, padded lanes 0), with the rows'
    saved mean and rstd when LOAD_STATS. SHIFT (fp32 inputs): `pivot` holds each row's first
    value, about which the LayerNorm statistics are taken."""
    if NORM == 0:
        mean = tl.zeros([x.shape[0]], dtype=tl.float32)
        rstd = tl.full([x.shape[0]], 1.0, tl.float32)
        xc = x
    elif LOAD_STATS:
        xc = x - mean[:, None]
        if not EVEN_D:
            xc = tl.where(cmask[None, :], xc, 0.0)
    elif NORM == 2:
        mean = tl.zeros([x.shape[0]], dtype=tl.float32)
        xc = x  # padded columns load as 0
        # NaN where the fp32 mean square overflowed, as LayerNorm's variance below (torch's
        # rms_norm takes rsqrt(inf) = 0 there: a finite row far from float64's, silently).
        ms = tl.sum(x * x, axis=1) / D
        rstd = 1.0 / tl.sqrt(ms + eps) + (ms - ms)
    else:
        # `/ D`, not `* inv_d`: measured on the H100 (F=128 B=8192 D=256 fp32, 8-row tiles)
        # the multiply form compiled to a 466 us forward, the divide to 400 us.
        # A row of one repeated value c (a constant feature slice) has mean c and variance 0, as
        # torch's (Welford) LayerNorm gives. Its fp32 sum rounds (3c is not 3 * c), x - sum / D
        # was a few ulps of c, and rstd = eps**-0.5 carried that into xhat: y 0.45 off float64 at
        # c = -12345.678 (D=24 H=17), a finite row where torch gives NaN at eps = 0 (red-team
        # round 13). fp32 rows are shifted by their first value (exactly 0 for such a row);
        # 16-bit values sum exactly in fp32, and a correctly rounded `/` (not the GPU's
        # approximate one) gives c back. H100, same run: the fp32 shift cost the forward +0-4%
        # (row path and tl.dot), nothing measurable in training; taken for 16-bit rows too it
        # cost their chunked forward up to 22% (benchmarks/NOTES.md).
        if SHIFT:
            xs = x - pivot[:, None]
            if not EVEN_D:
                xs = tl.where(cmask[None, :], xs, 0.0)
            mean = pivot + tl.sum(xs, axis=1) / D
        else:
            mean = tl.math.div_rn(tl.sum(x, axis=1), tl.full([x.shape[0]], D, tl.float32))
        xc = x - mean[:, None]  # as from saved stats (LOAD_STATS): the same bits either way
        if not EVEN_D:
            xc = tl.where(cmask[None, :], xc, 0.0)
        var = tl.sum(xc * xc, axis=1) / D
        # `+ (var - var)`: NaN where the fp32 variance overflowed to inf (rows near 1e19 and up),
        # instead of rstd = 0 and a silently finite row; 0 otherwise. Per row, not per element.
        rstd = 1.0 / tl.sqrt(var + eps) + (var - var)
    if NORM == 0:
        xhat = xc
    else:
        xhat = xc * rstd[:, None]
    if not (EVEN_D and EVEN_B):
        # Padded rows have zero variance: with eps=0 their rstd is inf, so mask them to exact
        # zeros (a NaN there would poison the weight-gradient sums of the whole tile).
        xhat = tl.where(mask, xhat, 0.0)
    a = xhat
    g = tl.full([x.shape[1]], 1.0, tl.float32)
    if HAS_LNW:
        if EVEN_D:
            g = tl.load(LNW + f * stride_lnw_f + cols).to(tl.float32)
        else:
            g = tl.load(LNW + f * stride_lnw_f + cols, mask=cmask, other=0.0).to(tl.float32)
        a = a * g[None, :]
    if HAS_LNB:
        if EVEN_D:
            beta = tl.load(LNB + f * stride_lnb_f + cols).to(tl.float32)
        else:
            beta = tl.load(LNB + f * stride_lnb_f + cols, mask=cmask, other=0.0).to(tl.float32)
        a = a + beta[None, :]
    t = _activate(a, ACT, FAST_TANH)
    if not (EVEN_D and EVEN_B):
        # Zero the padded columns and rows so that they add nothing to the dots with the weight
        # (sigmoid(0) is not 0).
        t = tl.where(mask, t, 0.0)
    return xhat, a, t, mean, rstd, g


@triton.jit
def _row_linear(t, w, USE_DOT: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """z[r, h] = sum_d t[r, d] * w[h, d] in fp32: tl.dot, a row reduction (H=1) or a 3D sum."""
    if USE_DOT:
        z = tl.dot(t, tl.trans(w), input_precision=PRECISION, out_dtype=tl.float32)
    elif BLOCK_H == 1:
        # H=1 as a row reduction: 2D only (size-1 dims of 3D tiles are a poor fit for Triton).
        z = tl.sum(t * w.to(tl.float32), axis=1)[:, None]
    else:
        z = tl.sum(t[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return z


@triton.jit
def _dot_16bit(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b for 16-bit operands with fp32 accumulation. UPCAST (the interpreter, whose numpy
    dots have no bf16) multiplies the same 16-bit values as fp32: their products are exact in fp32,
    so only the summation order differs from the tensor cores."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
    return tl.dot(a, b, acc, out_dtype=tl.float32)


@triton.jit
def _split16(a, DT: tl.constexpr, PARTS: tl.constexpr, INF_SAFE: tl.constexpr = False):
    """fp32 `a` as (p0, p1, p2) 16-bit parts, largest first: p0 = a rounded, each next part the
    rounded remainder (the remainders are exact in fp32). bf16 keeps 8 significant bits a part, so
    p0 + p1 is a to ~2^-17 relative and p0 + p1 + p2 to fp32's own 2^-24. Unused parts repeat p0
    (never multiplied: `_dot_parts` reads only the first PARTS).

    An infinite `a` leaves the remainder inf - inf = NaN, which turned the products NaN where the
    exact ones are +-inf (a weight of inf: z NaN, the relu mask and the gradients of the weight,
    bias and norm affine of every row of that feature wrong; red-team round 25). INF_SAFE zeroes
    a NaN remainder (p0 keeps a NaN of `a`): taken for the weight, split once a program or chunk,
    not for the per-row operands (one more select an element)."""
    p0 = a.to(DT)
    p1 = p0
    p2 = p0
    if PARTS > 1:
        r = a - p0.to(tl.float32)
        if INF_SAFE:
            r = tl.where(r == r, r, 0.0)
        p1 = r.to(DT)
        if PARTS > 2:
            p2 = (r - p1.to(tl.float32)).to(DT)
    return p0, p1, p2


@triton.jit
def _dot_parts(a0, a1, a2, b0, b1, b2, acc, NA: tl.constexpr, NB: tl.constexpr, ORDER: tl.constexpr,
               UPCAST: tl.constexpr, NAN_SAFE: tl.constexpr = False):
    """acc + a @ b from 16-bit parts a = a0 + a1 + a2 (the first NA) and b likewise (NB): the
    cross products a_i @ b_j with i + j < ORDER, each on the tensor cores with fp32 accumulation.
    ORDER 2 ("bf16x3" where both sides are split): a0 b0 + a0 b1 + a1 b0, dropping a1 b1
    (~2^-16 relative); ORDER 3 ("bf16x6"): also a0 b2, a1 b1, a2 b0 (~2^-24, fp32's rounding).
    Largest term first, as the 16-bit path always summed.

    NAN_SAFE (z, which decides the relu mask): the lower-order products are summed apart, and a
    non-finite sum of them is dropped before a0 b0 is added. An infinite b0 (an infinite weight)
    times a lower part of a of the other sign (round to nearest leaves either sign) or equal to 0
    gave +-inf against a0 b0's -+inf, or NaN: z NaN where the exact z is +-inf, and the mask of a
    z = -inf opened: the weight, bias and norm-affine gradients of that feature silently wrong
    (red-team round 27, found on the GPU; the interpreter's truncating bf16 conversion keeps
    remainders' signs, so only the zero part shows there). A non-finite lower-order sum always
    comes with a non-finite a0 b0 (an inf or NaN operand part is in a0 or b0 too, and a zero a0
    means a zero a), so nothing finite is lost. Triton's own tf32x3 drops only a NaN there."""
    if NAN_SAFE and ORDER > 1:
        small = _dot_cross_parts(a0, a1, a2, b0, b1, b2, tl.zeros_like(acc), NA, NB, ORDER, UPCAST)
        return _dot_16bit(a0, b0, acc + _finite_or_zero(small), UPCAST)
    acc = _dot_16bit(a0, b0, acc, UPCAST)
    return _dot_cross_parts(a0, a1, a2, b0, b1, b2, acc, NA, NB, ORDER, UPCAST)


@triton.jit
def _finite_or_zero(v):
    """v where finite, else 0 (NaN compares false)."""
    return tl.where(tl.abs(v) < float("inf"), v, 0.0)


@triton.jit
def _dot_cross_parts(a0, a1, a2, b0, b1, b2, acc, NA: tl.constexpr, NB: tl.constexpr, ORDER: tl.constexpr,
                     UPCAST: tl.constexpr):
    """acc + the cross products of `_dot_parts` after a0 b0, largest first."""
    if ORDER > 1:
        if NA > 1:
            acc = _dot_16bit(a1, b0, acc, UPCAST)
        if NB > 1:
            acc = _dot_16bit(a0, b1, acc, UPCAST)
    if ORDER > 2:
        if NA > 2:
            acc = _dot_16bit(a2, b0, acc, UPCAST)
        if NA > 1 and NB > 1:
            acc = _dot_16bit(a1, b1, acc, UPCAST)
        if NB > 2:
            acc = _dot_16bit(a0, b2, acc, UPCAST)
    return acc


@triton.jit
def _bias_act_store(z, bias, y_ptrs, ymask, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr, OUT_ACT: tl.constexpr,
                    FAST_TANH: tl.constexpr):
    if HAS_BIAS:
        z += bias[None, :]
    y = _activate(z, OUT_ACT, FAST_TANH)
    if MASKED:
        tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=ymask)
    else:
        tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty))


@triton.jit
def _output_store(z, z_lo, bias, y_ptrs, ymask, STATS, stats_half, f, B, rows, rmask, hs, HAS_BIAS: tl.constexpr,
                  MASKED: tl.constexpr, OUT_ACT: tl.constexpr, FAST_TANH: tl.constexpr, SAVE_MASK: tl.constexpr,
                  LO_PART: tl.constexpr, EVEN_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """`_bias_act_store` of the forward's z, and with SAVE_MASK (relu) its mask for the backward,
    of z + z_lo with LO_PART (`_lo_part_product`)."""
    if HAS_BIAS:
        z += bias[None, :]
    if SAVE_MASK:
        if LO_PART:
            # z_lo is +-inf or NaN where an infinite weight meets a lower part of t of the other
            # sign or 0, with z itself non-finite there: dropped, as `_dot_parts`'s NAN_SAFE does.
            _store_relu_mask(z + _finite_or_zero(z_lo), STATS, stats_half, f, B, rows, rmask, hs, EVEN_B, BLOCK_H)
        else:
            _store_relu_mask(z, STATS, stats_half, f, B, rows, rmask, hs, EVEN_B, BLOCK_H)
    _bias_act_store(z, bias, y_ptrs, ymask, False, MASKED, OUT_ACT, FAST_TANH)


@triton.jit
def _multiple_of(n, ALIGN: tl.constexpr):
    """n, stated to be a multiple of ALIGN (the launcher's word: `launch.column_alignment`). The
    masks `cols < D` of a D that is not a power of two are then constant over ALIGN columns and the
    row offsets ALIGN-aligned, so masked column loads and stores vectorise (a runtime D is otherwise
    divisible by 1 to Triton's analysis: one scalar load per element)."""
    if ALIGN > 1:
        n = (n // ALIGN) * ALIGN
    return n


@triton.jit
def _aligned_rows(D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f,
                  ALIGN: tl.constexpr):
    """`_multiple_of` over D and the strides of x's rows and of the [D]-wide parameter rows."""
    return (_multiple_of(D, ALIGN), _multiple_of(stride_x_f, ALIGN), _multiple_of(stride_x_b, ALIGN),
            _multiple_of(stride_w_f, ALIGN), _multiple_of(stride_w_h, ALIGN), _multiple_of(stride_lnw_f, ALIGN),
            _multiple_of(stride_lnb_f, ALIGN))


@triton.jit
def _load_rows(ptrs, rmask, EVEN_B: tl.constexpr, EVICT: tl.constexpr):
    """A [rows, cols] block as fp32; padded rows (not EVEN_B) read as zeros."""
    if EVEN_B:
        return tl.load(ptrs, eviction_policy=EVICT).to(tl.float32)
    return tl.load(ptrs, mask=rmask[:, None], other=0.0, eviction_policy=EVICT).to(tl.float32)


@triton.jit
def _load_chunk(ptrs, rmask, kmask, EVEN_B: tl.constexpr, MASK_K: tl.constexpr, EVICT: tl.constexpr):
    """A [rows, BLOCK_K] chunk of x as fp32 (`_load_rows`); MASK_K: columns past D read as zeros."""
    if MASK_K:
        return tl.load(ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0, eviction_policy=EVICT).to(tl.float32)
    return _load_rows(ptrs, rmask, EVEN_B, EVICT)


@triton.jit
def _load_param_chunk(ptrs, kmask, MASK_K: tl.constexpr):
    """A [BLOCK_K] chunk of a LayerNorm affine row as fp32; MASK_K: columns past D read as zeros."""
    if MASK_K:
        return tl.load(ptrs, mask=kmask, other=0.0).to(tl.float32)
    return tl.load(ptrs).to(tl.float32)


@triton.jit
def _store_relu_mask(z, STATS, stats_half, f, B, rows, rmask, hs, EVEN_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """The relu mask of a [rows, BLOCK_H] tile of z (bias added) as bits: bit h % 32 of word h // 32
    is z[:, h] > 0, word w stored (bitcast to fp32) in row-stats plane 2 + w ([2 + words, F, B]),
    as the rows' mean and rstd are. The backward reads it instead of recomputing z
    (`_load_relu_mask`). The bits of a word are distinct, so their int32 sum is their OR."""
    bits = tl.where(z <= 0, 0, 1 << (hs % 32)[None, :])  # NaN sets its bit: relu's backward keeps grad there
    for w in tl.static_range(max(1, BLOCK_H // 32)):
        word = tl.sum(tl.where((hs // 32 == w)[None, :], bits, 0), axis=1)
        ptrs = STATS + (2 + w) * stats_half + f * B + rows
        if EVEN_B:
            tl.store(ptrs, word.to(tl.float32, bitcast=True))
        else:
            tl.store(ptrs, word.to(tl.float32, bitcast=True), mask=rmask)


@triton.jit
def _load_relu_mask(STATS, stats_half, f, B, rows64, rmask, hs, H):
    """[rows, BLOCK_H] booleans: the forward's z > 0 (`_store_relu_mask`); False for padded rows
    and columns (the forward's words may be fewer than this tile's BLOCK_H needs)."""
    ptrs = STATS + (2 + hs // 32)[None, :] * stats_half + (f * B + rows64)[:, None]
    words = tl.load(ptrs, mask=rmask[:, None] & (hs < H)[None, :], other=0.0).to(tl.int32, bitcast=True)
    return ((words >> (hs % 32)[None, :]) & 1) != 0


@triton.jit
def _load_relu_mask_rows(STATS, stats_half, f, B, rows64, rmask, hs, H, BLOCK_H: tl.constexpr):
    """`_load_relu_mask` from one load per row and word (at most two: BLOCK_H <= 64) instead of one
    per element: the bits are shifted out of the rows' words in registers. A tile wider than 32
    columns holds H > 32 (`configs.dot_block_h`), so the forward saved both words."""
    plane = STATS + f * B + rows64
    word = tl.load(plane + 2 * stats_half, mask=rmask, other=0.0).to(tl.int32, bitcast=True)
    bits = word[:, None] >> (hs % 32)[None, :]
    if BLOCK_H > 32:
        word_hi = tl.load(plane + 3 * stats_half, mask=rmask, other=0.0).to(tl.int32, bitcast=True)
        bits = tl.where((hs < 32)[None, :], bits, word_hi[:, None] >> (hs % 32)[None, :])
    return ((bits & 1) != 0) & (hs < H)[None, :]


@triton.jit
def _lo_part_product(t, t_dot, w, acc, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """acc + (t - t_dot) @ w^T: the part of t that rounding it to the 16-bit t_dot dropped, as a
    16-bit operand too. z_hi + z_lo is z to ~fp32 accuracy (the backward's `_dot_parts` of hi and
    lo parts), so the relu mask saved for the backward is the exact function's, as the backward
    that recomputes z has it; y keeps z_hi, the same bits as a forward that saves no mask."""
    t_lo = (t - t_dot.to(tl.float32)).to(DOT_DTYPE)
    return tl.dot(t_lo, tl.trans(w), acc, input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def _chunked_norm_act_linear(
    x_rows, rmask, f, D, H, eps,
    W, LNW, LNB, stride_x_d, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f,
    HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, FAST_TANH: tl.constexpr, EVEN_B: tl.constexpr,
    X_EVICT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr,
    LO_PART: tl.constexpr = False, K_LOOP: tl.constexpr = 0, MASK_K: tl.constexpr = False,
):
    """(z = act(norm(x)) @ w^T, z_lo, mean, rstd) of a row tile, BLOCK_K columns at a time
    (D == K_CHUNKS * BLOCK_K: no column masks, also where D is not a power of two; MASK_K: the last
    chunk holds D - (K_CHUNKS - 1) * BLOCK_K columns, masked, and counts only those).
    The product: tl.dot, or (not USE_DOT, H <= 4) a row reduction or [rows, H, BLOCK_K] sum per chunk.
    K_LOOP 0: both chunk loops unrolled (every chunk's loads may be in flight at once, and hold
    registers: 255 with spills at bf16 D=512 H=16); n >= 1: runtime loops, the next n - 1 chunks'
    loads in flight (`tl.range(num_stages=n)`).

    Only a [rows, BLOCK_K] slice of x and of the weight is live at once, instead of the whole
    [rows, D] tile and [H, D] weight (with 3xTF32 those held 255 registers and spilled). The
    row statistics come first, chunk by chunk (each chunk's mean and centred sum of squares,
    combined as Chan et al. do, so no E[x^2] - mean^2 cancellation); then each chunk is read
    again (from L1/L2), normalised, put through tanh and multiplied into the accumulator.
    LO_PART (16-bit dots): z_lo = (t - t rounded to DOT_DTYPE) @ w^T, what t's rounding left out
    of z (`_lo_part_product`); else zeros.
    """
    ks = tl.arange(0, BLOCK_K)
    hs = tl.arange(0, BLOCK_H)
    mean = tl.zeros([BLOCK_B], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_B], dtype=tl.float32)
    # LayerNorm statistics of the rows shifted by their first element: a constant row is exactly
    # 0, its mean exactly its value and its variance 0 (see `_norm_act_tile`).
    pivot = tl.zeros([BLOCK_B], dtype=tl.float32)
    if NORM == 1 and x_rows.dtype.element_ty == tl.float32:  # 16-bit chunk sums are exact
        pivot = tl.load(x_rows, mask=rmask, other=0.0).to(tl.float32)
    if NORM != 0:
        if K_LOOP:
            for kc in tl.range(0, K_CHUNKS, num_stages=K_LOOP):
                mean, m2 = _chunk_stats_step(x_rows, kc, ks, rmask, pivot, mean, m2, stride_x_d, EVEN_B, X_EVICT,
                                             NORM, BLOCK_K, D, MASK_K)
        else:
            for kc in tl.static_range(K_CHUNKS):
                mean, m2 = _chunk_stats_step(x_rows, kc, ks, rmask, pivot, mean, m2, stride_x_d, EVEN_B, X_EVICT,
                                             NORM, BLOCK_K, D, MASK_K)
    var = m2 / D
    mean = pivot + mean
    if NORM == 1:
        rstd = 1.0 / tl.sqrt(var + eps) + (var - var)  # NaN where the variance overflowed (see above)
    elif NORM == 2:
        rstd = 1.0 / tl.sqrt(var + eps) + (var - var)  # var: the mean square here
    else:
        rstd = tl.full([BLOCK_B], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    hmask = hs < H
    if K_LOOP:
        for kc in tl.range(0, K_CHUNKS, num_stages=K_LOOP):
            acc, acc_lo = _chunk_linear_step(x_rows, kc, ks, hs, hmask, rmask, f, mean, rstd, acc, acc_lo, W, LNW, LNB,
                                             stride_x_d, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f, HAS_LNW,
                                             HAS_LNB, FAST_TANH, EVEN_B, DOT_DTYPE, PRECISION, NORM, ACT, USE_DOT,
                                             BLOCK_H, BLOCK_K, LO_PART, D, MASK_K)
    else:
        for kc in tl.static_range(K_CHUNKS):
            acc, acc_lo = _chunk_linear_step(x_rows, kc, ks, hs, hmask, rmask, f, mean, rstd, acc, acc_lo, W, LNW, LNB,
                                             stride_x_d, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f, HAS_LNW,
                                             HAS_LNB, FAST_TANH, EVEN_B, DOT_DTYPE, PRECISION, NORM, ACT, USE_DOT,
                                             BLOCK_H, BLOCK_K, LO_PART, D, MASK_K)
    return acc, acc_lo, mean, rstd


@triton.jit
def _chunk_stats_step(x_rows, kc, ks, rmask, pivot, mean, m2, stride_x_d, EVEN_B: tl.constexpr,
                      X_EVICT: tl.constexpr, NORM: tl.constexpr, BLOCK_K: tl.constexpr, D=0,
                      MASK_K: tl.constexpr = False):
    """Chunk kc's columns added to the rows' running (mean, m2) of `_chunked_norm_act_linear`:
    the chunk's own mean and centred sum of squares, combined as Chan et al. do. MASK_K: columns
    past D count for nothing (only the last chunk has any)."""
    cols = kc * BLOCK_K + ks
    kmask = cols < D
    xk = _load_chunk(x_rows[:, None] + cols[None, :] * stride_x_d, rmask, kmask, EVEN_B, MASK_K, X_EVICT)
    if NORM == 2:
        m2 = m2 + tl.sum(xk * xk, axis=1)  # mean stays 0 (masked columns are 0)
    else:
        xk = xk - pivot[:, None]
        if MASK_K:
            n_k = tl.minimum(D - kc * BLOCK_K, BLOCK_K).to(tl.float32)
            xk = tl.where(kmask[None, :], xk, 0.0)
            mk = tl.sum(xk, axis=1) / n_k
            dk = tl.where(kmask[None, :], xk - mk[:, None], 0.0)
        else:
            n_k = BLOCK_K
            mk = tl.sum(xk, axis=1) / BLOCK_K
            dk = xk - mk[:, None]
        delta = mk - mean
        # kc * BLOCK_K columns of statistics so far (whole chunks) combine with n_k new ones.
        seen = kc * BLOCK_K
        mean = mean + delta * (n_k / (seen + n_k))
        m2 = m2 + tl.sum(dk * dk, axis=1) + delta * delta * (seen * n_k / (seen + n_k))
    return mean, m2


@triton.jit
def _chunk_linear_step(x_rows, kc, ks, hs, hmask, rmask, f, mean, rstd, acc, acc_lo, W, LNW, LNB, stride_x_d,
                       stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f, HAS_LNW: tl.constexpr,
                       HAS_LNB: tl.constexpr, FAST_TANH: tl.constexpr, EVEN_B: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
                       USE_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, LO_PART: tl.constexpr,
                       D=0, MASK_K: tl.constexpr = False):
    """Chunk kc of `_chunked_norm_act_linear`'s product: normalised, activated, multiplied into acc.
    MASK_K: columns past D load as 0 and leave t (and the weight) 0 there."""
    cols = kc * BLOCK_K + ks
    kmask = cols < D
    xk = _load_chunk(x_rows[:, None] + cols[None, :] * stride_x_d, rmask, kmask, EVEN_B, MASK_K, "")
    if NORM == 0:
        a = xk
    else:
        a = (xk - mean[:, None]) * rstd[:, None]
    if HAS_LNW:
        a = a * _load_param_chunk(LNW + f * stride_lnw_f + cols, kmask, MASK_K)[None, :]
    if HAS_LNB:
        a = a + _load_param_chunk(LNB + f * stride_lnb_f + cols, kmask, MASK_K)[None, :]
    t = _activate(a, ACT, FAST_TANH)
    if MASK_K:
        t = tl.where(rmask[:, None] & kmask[None, :], t, 0.0)
    elif not EVEN_B:
        t = tl.where(rmask[:, None], t, 0.0)  # padded rows: rstd may be inf, t NaN
    wmask = hmask[:, None] & kmask[None, :] if MASK_K else hmask[:, None]
    wk = tl.load(W + f * stride_w_f + hs[:, None] * stride_w_h + cols[None, :], mask=wmask, other=0.0)
    if USE_DOT:
        t_dot = t.to(DOT_DTYPE)
        acc = tl.dot(t_dot, tl.trans(wk.to(DOT_DTYPE)), acc, input_precision=PRECISION, out_dtype=tl.float32)
        if LO_PART:
            acc_lo = _lo_part_product(t, t_dot, wk.to(DOT_DTYPE), acc_lo, DOT_DTYPE, PRECISION)
    else:
        acc += _row_linear(t, wk.to(tl.float32), False, BLOCK_H, PRECISION)
    return acc, acc_lo


@triton.jit
def _row_program(FEATURES_FIRST: tl.constexpr):
    """(row program, feature, row programs per feature) of this forward program on a (row
    programs, F) grid, or on an (F, row programs) one (FEATURES_FIRST). The hardware starts
    programs in grid order, first axis fastest: features first, the programs running at once read
    one span of rows across all features, which in a [B, F*D] buffer (torchrec's layout) is
    contiguous, where one feature's rows are D-wide pieces F*D apart (a DRAM page opened for 64
    bytes at bf16 D=32). `configs.forward_features_first` says where that was faster."""
    if FEATURES_FIRST:
        return tl.program_id(1), tl.program_id(0).to(tl.int64), tl.num_programs(1)
    else:
        return tl.program_id(0), tl.program_id(1).to(tl.int64), tl.num_programs(0)


@triton.jit
def _forward_tile(
    tile, f, w1, bias1,
    X, W, BIAS, LNW, LNB, Y, STATS,
    B, D, H, stats_half,
    stride_x_f, stride_x_b, stride_x_d,
    stride_w_f, stride_w_h,
    stride_bias_f, stride_lnw_f, stride_lnb_f,
    stride_y_f, stride_y_b,
    eps,
    HAS_BIAS: tl.constexpr, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FAST_TANH: tl.constexpr, SAVE_STATS: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr, W_LOADED: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    K_CHUNKS: tl.constexpr, SAVE_MASK: tl.constexpr, K_LOOP: tl.constexpr, MASK_K: tl.constexpr = False,
    MASK_LO_PART: tl.constexpr = True,
):
    """One tile of BLOCK_B rows of feature f. W_LOADED: the caller holds the whole weight block
    (w1, bias1: H <= BLOCK_H); otherwise the weight is read block by block after the tanh."""
    rows = tile * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < B
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    x_rows = X + f * stride_x_f + rows.to(tl.int64) * stride_x_b
    x_ptrs = x_rows[:, None] + cols[None, :] * stride_x_d
    stat_ptrs = STATS + f * B + rows
    # The relu mask for the backward from z to ~fp32 accuracy: 16-bit dots add t's rounding error
    # (MASK_LO_PART False: the mask of the 16-bit z alone, as PyTorch's 16-bit autograd has it).
    LO_PART: tl.constexpr = SAVE_MASK and USE_DOT and DOT_DTYPE != tl.float32 and MASK_LO_PART
    if BLOCK_K < BLOCK_D:
        z, z_lo, mean, rstd = _chunked_norm_act_linear(
            x_rows, rmask, f, D, H, eps, W, LNW, LNB, stride_x_d, stride_w_f, stride_w_h,
            stride_lnw_f, stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, EVEN_B, X_EVICT, DOT_DTYPE,
            DOT_PRECISION, NORM, ACT, USE_DOT, BLOCK_B, BLOCK_H, BLOCK_K, K_CHUNKS, LO_PART, K_LOOP, MASK_K,
        )
    else:
        _, _, t, mean, rstd, _ = _normalize_activate(
            x_ptrs, x_rows, mask, cmask, f, cols, D, eps, LNW, LNB, stride_lnw_f, stride_lnb_f,
            stat_ptrs, stat_ptrs + stats_half, rmask, HAS_LNW, HAS_LNB, FAST_TANH, False,
            EVEN_D, EVEN_B, X_EVICT, NORM, ACT,
        )
    if SAVE_STATS:
        if EVEN_B:
            tl.store(stat_ptrs, mean)
            tl.store(stat_ptrs + stats_half, rstd)
        else:
            tl.store(stat_ptrs, mean, mask=rmask)
            tl.store(stat_ptrs + stats_half, rstd, mask=rmask)
    y_row = Y + f * stride_y_f + rows.to(tl.int64) * stride_y_b
    if BLOCK_K < BLOCK_D:
        hs = tl.arange(0, BLOCK_H)
        hmask = hs < H
        bias = tl.zeros([BLOCK_H], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(BIAS + f * stride_bias_f + hs, mask=hmask, other=0.0).to(tl.float32)
        _output_store(z, z_lo, bias, y_row[:, None] + hs[None, :], rmask[:, None] & hmask[None, :], STATS,
                      stats_half, f, B, rows, rmask, hs, HAS_BIAS, True, OUT_ACT, FAST_TANH, SAVE_MASK, LO_PART,
                      EVEN_B, BLOCK_H)
    elif W_LOADED:
        hs = tl.arange(0, BLOCK_H)
        t_dot = t
        if USE_DOT:
            t_dot = t.to(DOT_DTYPE)
        z_lo = 0.0
        if LO_PART:
            z_lo = _lo_part_product(t, t_dot, w1, tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32), DOT_DTYPE,
                                    DOT_PRECISION)
        _output_store(_row_linear(t_dot, w1, USE_DOT, BLOCK_H, DOT_PRECISION), z_lo, bias1,
                      y_row[:, None] + hs[None, :], rmask[:, None] & (hs < H)[None, :], STATS, stats_half, f, B,
                      rows, rmask, hs, HAS_BIAS, not (EVEN_B and BLOCK_H == 1), OUT_ACT, FAST_TANH, SAVE_MASK,
                      LO_PART, EVEN_B, BLOCK_H)
    else:
        t_dot = t
        if USE_DOT:
            t_dot = t.to(DOT_DTYPE)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            hmask = hs < H
            w_ptrs = W + f * stride_w_f + hs[:, None] * stride_w_h + cols[None, :]
            if EVEN_D and BLOCK_H == 1:
                w = tl.load(w_ptrs)  # H=1 row path: hs is 0 < H
            else:
                w = tl.load(w_ptrs, mask=hmask[:, None] & cmask[None, :], other=0.0)
            if USE_DOT:
                w = w.to(DOT_DTYPE)
            bias = tl.zeros([BLOCK_H], dtype=tl.float32)
            if HAS_BIAS:
                bias = tl.load(BIAS + f * stride_bias_f + hs, mask=hmask, other=0.0).to(tl.float32)
            z_lo = 0.0
            if LO_PART:
                z_lo = _lo_part_product(t, t_dot, w, tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32), DOT_DTYPE,
                                        DOT_PRECISION)
            # SAVE_MASK needs H <= BLOCK_H: one block, h0 = 0.
            _output_store(_row_linear(t_dot, w, USE_DOT, BLOCK_H, DOT_PRECISION), z_lo, bias,
                          y_row[:, None] + hs[None, :], rmask[:, None] & hmask[None, :], STATS, stats_half, f, B,
                          rows, rmask, hs, HAS_BIAS, not (EVEN_B and BLOCK_H == 1), OUT_ACT, FAST_TANH, SAVE_MASK,
                          LO_PART, EVEN_B, BLOCK_H)


@triton.jit
def ln_tanh_linear_relu_fwd(
    X, W, BIAS, LNW, LNB, Y, STATS,
    B, D, H, stats_half,
    stride_x_f, stride_x_b, stride_x_d,
    stride_w_f, stride_w_h,
    stride_bias_f, stride_lnw_f, stride_lnb_f,
    stride_y_f, stride_y_b,
    eps,
    HAS_BIAS: tl.constexpr, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FAST_TANH: tl.constexpr, SAVE_STATS: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr,
    PERSISTENT: tl.constexpr, TILE_STAGES: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    K_CHUNKS: tl.constexpr, SAVE_MASK: tl.constexpr = False, K_LOOP: tl.constexpr = 0, D_ALIGN: tl.constexpr = 1,
    MASK_K: tl.constexpr = False, FEATURES_FIRST: tl.constexpr = False, MASK_LO_PART: tl.constexpr = True,
):
    # STATS (SAVE_STATS, for a backward that follows): [2, F, B] fp32, mean then rstd; with
    # SAVE_MASK (relu, H <= BLOCK_H <= 64) also z's relu mask as bits in the planes after them
    # (`_store_relu_mask`), so that the backward need not recompute z.
    # BLOCK_K < BLOCK_D (tl.dot path, D == K_CHUNKS * BLOCK_K, H <= BLOCK_H): the row tile is
    # normalised and multiplied BLOCK_K columns at a time (`_chunked_norm_act_linear`), the weight
    # read per chunk; a D that is not a power of two (160 = 5 x 32) then has no padded columns.
    # Grid (programs per feature, F). Not PERSISTENT: one program per row tile. PERSISTENT
    # (needs H <= BLOCK_H): fewer programs, each loads the weight once and walks the row tiles
    # pid, pid + P, ... with TILE_STAGES tiles of x in flight, so that the loads of the next
    # tiles overlap this tile's LayerNorm, tanh and dot instead of taking turns with them
    # (measured on the H100: one program per tile leaves DRAM idle ~half the time at bf16 H=64).
    # D_ALIGN: D and the strides of x's rows and of the [D]-wide parameter rows are multiples of
    # it (masked columns vectorise, `_multiple_of`). MASK_K: the chunks' last is partial (K_CHUNKS
    # = cdiv(D, BLOCK_K): rows of no 16-column chunk too wide to stage whole, D = 600, 1000).
    D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f = _aligned_rows(
        D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f, D_ALIGN)
    pid_b, f, n_row_programs = _row_program(FEATURES_FIRST)
    w1 = 0.0
    bias1 = 0.0
    if PERSISTENT and BLOCK_K == BLOCK_D:
        hs = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_D)
        hmask = hs < H
        w1 = tl.load(W + f * stride_w_f + hs[:, None] * stride_w_h + cols[None, :],
                     mask=hmask[:, None] & (cols < D)[None, :], other=0.0)
        if USE_DOT:
            w1 = w1.to(DOT_DTYPE)
        bias1 = tl.zeros([BLOCK_H], dtype=tl.float32)
        if HAS_BIAS:
            bias1 = tl.load(BIAS + f * stride_bias_f + hs, mask=hmask, other=0.0).to(tl.float32)
    if PERSISTENT:
        for tile in tl.range(pid_b, tl.cdiv(B, BLOCK_B), n_row_programs, num_stages=TILE_STAGES):
            _forward_tile(
                tile, f, w1, bias1, X, W, BIAS, LNW, LNB, Y, STATS, B, D, H, stats_half,
                stride_x_f, stride_x_b, stride_x_d, stride_w_f, stride_w_h,
                stride_bias_f, stride_lnw_f, stride_lnb_f, stride_y_f, stride_y_b, eps,
                HAS_BIAS, HAS_LNW, HAS_LNB, NORM, ACT, OUT_ACT, USE_DOT, DOT_DTYPE, DOT_PRECISION, FAST_TANH,
                SAVE_STATS, EVEN_D, EVEN_B, X_EVICT, BLOCK_K == BLOCK_D, BLOCK_B, BLOCK_D, BLOCK_H, BLOCK_K,
                K_CHUNKS, SAVE_MASK, K_LOOP, MASK_K, MASK_LO_PART,
            )
    else:
        _forward_tile(
            pid_b, f, w1, bias1, X, W, BIAS, LNW, LNB, Y, STATS, B, D, H, stats_half,
            stride_x_f, stride_x_b, stride_x_d, stride_w_f, stride_w_h,
            stride_bias_f, stride_lnw_f, stride_lnb_f, stride_y_f, stride_y_b, eps,
            HAS_BIAS, HAS_LNW, HAS_LNB, NORM, ACT, OUT_ACT, USE_DOT, DOT_DTYPE, DOT_PRECISION, FAST_TANH,
            SAVE_STATS, EVEN_D, EVEN_B, X_EVICT, False, BLOCK_B, BLOCK_D, BLOCK_H, BLOCK_K, K_CHUNKS, SAVE_MASK,
            K_LOOP, MASK_K, MASK_LO_PART,
        )


# The same forward with Triton's "== 1" specialisation of stride_y_b turned off. Specialised,
# y rows that are contiguous (H=1, [F, B, 1]) get a vectorised store layout, and together with
# the saved-stats stores that compiled to a 556 us kernel where y strided over features took
# 380 us (F=128 B=8192 D=256 fp32 on the H100, results/checks/diagnose_h1_h100.txt): the
# transformed graph's training step hits exactly this case.
ln_tanh_linear_relu_fwd_y_strided = triton.jit(do_not_specialize=["stride_y_b"])(ln_tanh_linear_relu_fwd.fn)


@triton.jit
def _dx_of_rows(dxhat, xhat, rstd, inv_d, NORM: tl.constexpr):
    """dx of whole [rows, D] tiles from dL/dxhat: LayerNorm (NORM 1) subtracts dxhat's row mean and
    xhat times the row mean of dxhat * xhat, RMSNorm (2) the latter only, both scaled by rstd; no
    norm (0) passes dxhat through."""
    if NORM == 0:
        dx = dxhat
    else:
        # inv_d = 1/D correctly rounded on the host: a GPU fp32 `/` is approximate (2 ulp).
        c1 = tl.sum(dxhat * xhat, axis=1) * inv_d
        if NORM == 2:
            dx = (dxhat - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(dxhat, axis=1) * inv_d
            dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    return dx


@triton.jit
def _load_bwd_tile(
    X, GY, STATS, f, rows, last_row, cols, cmask, hs, hmask, B, stats_half,
    stride_x_f, stride_x_b, stride_x_d, stride_gy_f, stride_gy_b, stride_gy_h,
    LOAD_STATS: tl.constexpr, EVEN_D: tl.constexpr, X_EVICT: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The backward's loads of one row tile, in their own dtypes: x (padded columns 0), grad_y
    (padded columns 0), and the rows' saved mean and rstd (LOAD_STATS; else 0 and 1). Rows past
    `last_row` read `last_row` again: no row masks, and the prefetch past a program's last tile
    stays in bounds; the caller zeroes what padded rows contribute."""
    rows64 = tl.minimum(rows, last_row).to(tl.int64)
    x_ptrs = X + f * stride_x_f + rows64[:, None] * stride_x_b + cols[None, :] * stride_x_d
    if EVEN_D:
        x = tl.load(x_ptrs, eviction_policy=X_EVICT)
    else:
        x = tl.load(x_ptrs, mask=cmask[None, :], other=0.0, eviction_policy=X_EVICT)
    gy_ptrs = GY + f * stride_gy_f + rows64[:, None] * stride_gy_b + hs[None, :] * stride_gy_h
    if BLOCK_H == 1:
        gy = tl.load(gy_ptrs)
    else:
        gy = tl.load(gy_ptrs, mask=hmask[None, :], other=0.0)
    if LOAD_STATS:
        mean = tl.load(STATS + f * B + rows64)
        rstd = tl.load(STATS + stats_half + f * B + rows64)
    elif X.dtype.element_ty == tl.float32:
        # not saved: the rows' first values in its place, the pivot of their LayerNorm statistics
        mean = tl.load(X + f * stride_x_f + rows64 * stride_x_b).to(tl.float32)
        rstd = tl.full([rows.shape[0]], 1.0, tl.float32)
    else:
        mean = tl.zeros([rows.shape[0]], dtype=tl.float32)
        rstd = tl.full([rows.shape[0]], 1.0, tl.float32)
    return x, gy, mean, rstd


@triton.jit
def _fold_rows(v, ACC_ROWS: tl.constexpr):
    """A [rows, cols] tile's column sums into ACC_ROWS slots: row r into slot r % ACC_ROWS (the
    tile itself when ACC_ROWS is its row count; one slot: the tile's column sums)."""
    if ACC_ROWS == v.shape[0]:
        return v
    if ACC_ROWS == 1:
        return tl.sum(v, axis=0, keep_dims=True)
    return tl.sum(tl.reshape(v, [v.shape[0] // ACC_ROWS, ACC_ROWS, v.shape[1]]), axis=0)


@triton.jit
def _column_init(W, bias, hs, f, h: tl.constexpr, stride_w_f, stride_w_h, cols, cmask, H, EVEN_D: tl.constexpr,
                 BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, ACC_ROWS: tl.constexpr):
    """Row h of feature f's weight as fp32 [BLOCK_D] (zeros for a padded h >= H), its bias (a
    scalar taken from the [BLOCK_H] `bias` once, not per row tile), and zeroed [ACC_ROWS, BLOCK_D]
    weight-gradient (row slots, or one row of per-tile sums) and [BLOCK_B] bias-gradient row slots
    of that column."""
    ptrs = W + f * stride_w_f + h * stride_w_h + cols
    if EVEN_D and h == 0:
        w_h = tl.load(ptrs).to(tl.float32)
    else:
        w_h = tl.load(ptrs, mask=cmask & ((cols * 0 + h) < H), other=0.0).to(tl.float32)
    b_h = tl.sum(tl.where(hs == h, bias, 0.0), axis=0)
    return w_h, b_h, tl.zeros([ACC_ROWS, BLOCK_D], dtype=tl.float32), tl.zeros([BLOCK_B], dtype=tl.float32)


@triton.jit
def _column_dz(t, w_h, b_h, GY, f, h: tl.constexpr, rows64, rmask, H, stride_gy_f, stride_gy_b, stride_gy_h,
               OUT_ACT: tl.constexpr, FAST_TANH: tl.constexpr, EVEN_B: tl.constexpr):
    """dz[:, h] of one output column, fp32 [rows]: z[:, h] = t . w[h] + bias[h] as a row reduction,
    then the out-activation's derivative times grad_y[:, h]. Padded rows and an h >= H give 0."""
    gy_ptrs = GY + f * stride_gy_f + rows64 * stride_gy_b + h * stride_gy_h
    if EVEN_B and h == 0:
        gy = tl.load(gy_ptrs).to(tl.float32)
    else:
        gy = tl.load(gy_ptrs, mask=rmask & ((rows64 * 0 + h) < H), other=0.0).to(tl.float32)
    if OUT_ACT == 0:
        return gy
    z = tl.sum(t * w_h[None, :], axis=1) + b_h
    if OUT_ACT == 3:
        return tl.where(z <= 0, 0.0, gy)
    return gy * _activate_grad(z, _activate(z, OUT_ACT, FAST_TANH), OUT_ACT, FAST_TANH)


@triton.jit
def _column_step(t, dt, w_h, b_h, acc_w_h, acc_b_h, GY, f, h: tl.constexpr, rows64, rmask, H,
                 stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT: tl.constexpr, FAST_TANH: tl.constexpr,
                 EVEN_B: tl.constexpr, ACC_ROWS: tl.constexpr):
    """One output column of a row tile: dt += dz[:, h] w[h], and dz[:, h] added into that column's
    weight- and bias-gradient row slots (summed over rows once, after the row loop): the tile's
    rows folded into ACC_ROWS weight-gradient slots (`_fold_rows`; one: summed over the tile now)."""
    dz_h = _column_dz(t, w_h, b_h, GY, f, h, rows64, rmask, H, stride_gy_f, stride_gy_b, stride_gy_h,
                      OUT_ACT, FAST_TANH, EVEN_B)
    acc_w_h += _fold_rows(dz_h[:, None] * t, ACC_ROWS)
    return dt + dz_h[:, None] * w_h[None, :], acc_w_h, acc_b_h + dz_h


@triton.jit
def _column_store(part, acc_w_h, acc_b_h, h: tl.constexpr, cols, cmask, hs, D, H):
    """Store column h's weight-gradient row into the program's partial row (nothing for a padded
    h >= H); return its bias-gradient sum placed at h of a [BLOCK_H] vector."""
    tl.store(part + h * D + cols, tl.sum(acc_w_h, axis=0), mask=cmask & ((cols * 0 + h) < H))
    return tl.where(hs == h, tl.sum(acc_b_h, axis=0), 0.0)


@triton.jit
def ln_tanh_linear_relu_bwd(
    GY, X, W, BIAS, LNW, LNB, DX, PARTIAL, STATS, DZ,
    B, D, H, rows_per_program, stats_half,
    stride_x_f, stride_x_b, stride_x_d,
    stride_gy_f, stride_gy_b, stride_gy_h,
    stride_dx_f, stride_dx_b, stride_dx_d,
    stride_w_f, stride_w_h,
    stride_bias_f, stride_lnw_f, stride_lnb_f,
    stride_part_prog,
    eps, inv_d,
    HAS_BIAS: tl.constexpr, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr,
    USE_DOT: tl.constexpr, BWD_DOT_PRECISION: tl.constexpr, BWD_DOT_DTYPE: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SPLIT_Z: tl.constexpr, SPLIT_DT: tl.constexpr, SPLIT_DW: tl.constexpr,
    FAST_TANH: tl.constexpr,
    LOAD_STATS: tl.constexpr, EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PREFETCH: tl.constexpr = False,
    UNROLL_H: tl.constexpr = False, LOOP_STAGES: tl.constexpr = None, COL_SUMS: tl.constexpr = False,
    DZ_OUT: tl.constexpr = False, LOAD_MASK: tl.constexpr = False, LN_IN_WEIGHT: tl.constexpr = False,
    ROW_SLOTS: tl.constexpr = 0, D_ALIGN: tl.constexpr = 1,
):
    # EVEN_B: every program's rows are all < B (B is a multiple of rows_per_program).
    # LOAD_STATS: STATS holds the forward's per-row mean and rstd ([2, F, B] fp32).
    # PREFETCH: the next row tile's x, grad_y (and stats) are loaded before this tile is computed,
    # so that their HBM latency overlaps the tile's arithmetic (B > 0).
    # UNROLL_H (no tl.dot, 2 <= BLOCK_H <= 8): each output column on its own, as the H=1 path does
    # it: z[:, h] a row reduction, dt += dz[:, h] w[h], the weight gradient's column sums in
    # [BLOCK_B, BLOCK_D] row slots per h. Only 2D tiles: the broadcast sum's [rows, BLOCK_H,
    # BLOCK_D] products hold BLOCK_H times the registers (and gave wrong dx at 16-row tiles on
    # the H100, Triton 3.6: see `configs.heuristic_backward`).
    # LOOP_STAGES (None: a plain loop): Triton's software pipelining of the row loop, the loads of
    # the next LOOP_STAGES - 1 tiles in flight (shared memory) while this one is computed. The
    # launch's num_stages does not pipeline a loop whose loads feed no tl.dot; `tl.range` does.
    # COL_SUMS (no tl.dot; H = 1 or UNROLL_H): the gradient columns summed per tile (one cross-warp
    # reduction a tile and column) instead of [BLOCK_B, BLOCK_D] row slots (one per output column
    # with UNROLL_H), whose registers cap the programs per SM.
    # ROW_SLOTS (no tl.dot, H = 1 or UNROLL_H, not COL_SUMS; 0: BLOCK_B): the row slots are
    # [ROW_SLOTS, BLOCK_D], each tile's rows folded into them (`_fold_rows`: row r into slot
    # r % ROW_SLOTS), adds inside a thread where ROW_SLOTS is the rows a layout tile spans.
    # On the tl.dot path (0: one cross-warp sum a tile) the same for the LayerNorm affine's sums.
    # DZ_OUT (tl.dot path): no weight gradient here. dz goes to DZ ([F, B, H], contiguous: in
    # grad_y's dtype where it is exactly that, else fp32) and, unless LOAD_STATS, the rows' mean
    # and rstd to STATS; `ln_tanh_linear_relu_bwd_weight` makes the weight gradient from them in
    # column chunks. The [H, D] accumulator and its dot leave this kernel's registers.
    # LOAD_MASK (tl.dot path, relu): the forward's relu mask from STATS's planes after mean and
    # rstd (`_load_relu_mask`) instead of z recomputed: no z dot, and t needs no parts for it.
    # LN_IN_WEIGHT (with DZ_OUT): the LayerNorm affine's gradients are the weight kernel's too
    # (its LN_GRADS); this kernel neither sums nor writes them.
    # PARTIAL row of this program: [H*D weight | H bias | D ln_weight | D ln_bias], fp32.
    # D_ALIGN: D and the strides of x's and dx's rows and of the [D]-wide parameter rows are
    # multiples of it (masked columns vectorise, `_multiple_of`).
    D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f = _aligned_rows(
        D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f, D_ALIGN)
    stride_dx_f = _multiple_of(stride_dx_f, D_ALIGN)
    stride_dx_b = _multiple_of(stride_dx_b, D_ALIGN)
    pid_p = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    hs = tl.arange(0, BLOCK_H)
    cmask = cols < D
    hmask = hs < H
    # BWD_DOT_DTYPE: the operand dtype of the tl.dot path: fp32 with BWD_DOT_PRECISION, or bf16
    # on tensor cores with fp32 accumulation, fp32 values split into bf16 parts. SPLIT_Z,
    # SPLIT_DT, SPLIT_DW: the order of the cross products of those parts kept in z = t @ w^T,
    # dt = dz @ w and the weight gradient dz^T @ t (`_dot_parts`): 2 is bf16x3, 3 bf16x6.
    # The 16-bit path runs order 2 (fp32 t and dz as hi + lo against its exact 16-bit weight).
    SPLIT16: tl.constexpr = USE_DOT and BWD_DOT_DTYPE != tl.float32
    # Parts of each split operand (see `_dot_parts`): a 16-bit weight is exact in one; t goes
    # into the weight gradient rounded to 16 bits for 16-bit inputs, as PyTorch's bf16 autograd
    # does (a lo part there cost 35 more registers a thread at D=64, spills at D=256); a 16-bit
    # grad_y through relu (or no out-activation) is a 16-bit dz already.
    W_PARTS: tl.constexpr = 1 if W.dtype.element_ty == BWD_DOT_DTYPE else max(SPLIT_Z, SPLIT_DT)
    T_DW_PARTS: tl.constexpr = 1 if X.dtype.element_ty == BWD_DOT_DTYPE or DZ_OUT else SPLIT_DW
    T_PARTS: tl.constexpr = max(SPLIT_Z if OUT_ACT != 0 and not LOAD_MASK else 1, T_DW_PARTS)
    DZ_EXACT: tl.constexpr = (OUT_ACT == 0 or OUT_ACT == 3) and GY.dtype.element_ty == BWD_DOT_DTYPE
    DZ_PARTS: tl.constexpr = 1 if DZ_EXACT else (SPLIT_DT if DZ_OUT else max(SPLIT_DT, SPLIT_DW))
    # With LOAD_MASK STATS is the forward's (read-only here): the weight kernel reads its mean / rstd.
    STORE_STATS: tl.constexpr = DZ_OUT and NORM != 0 and not LOAD_STATS and not LOAD_MASK
    w = tl.load(W + f * stride_w_f + hs[:, None] * stride_w_h + cols[None, :],
                mask=hmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if SPLIT16:
        # Split once, outside the row loop.
        w0, w1, w2 = _split16(w, BWD_DOT_DTYPE, W_PARTS, True)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + f * stride_bias_f + hs, mask=hmask, other=0.0).to(tl.float32)
    # Column sums over rows are kept per row slot ([ACC_ROWS, BLOCK_D], elementwise adds) and
    # reduced once after the loop, or summed per tile (SUM_PER_TILE): the tl.dot path (see below),
    # and COL_SUMS without it, where the slots' registers would cap the programs per SM.
    SUM_PER_TILE: tl.constexpr = USE_DOT or (COL_SUMS and (BLOCK_H == 1 or UNROLL_H))
    ACC_ROWS: tl.constexpr = 1 if SUM_PER_TILE else (ROW_SLOTS if ROW_SLOTS else BLOCK_B)
    if UNROLL_H:
        # Column h's weight row and bias, and its weight-gradient and bias-gradient row slots.
        w_0, b_0, acc_w_0, acc_b_0 = _column_init(W, bias, hs, f, 0, stride_w_f, stride_w_h, cols, cmask, H,
                                                    EVEN_D, BLOCK_B, BLOCK_D, ACC_ROWS)
        w_1, b_1, acc_w_1, acc_b_1 = _column_init(W, bias, hs, f, 1, stride_w_f, stride_w_h, cols, cmask, H,
                                                    EVEN_D, BLOCK_B, BLOCK_D, ACC_ROWS)
        if BLOCK_H > 2:
            w_2, b_2, acc_w_2, acc_b_2 = _column_init(W, bias, hs, f, 2, stride_w_f, stride_w_h, cols, cmask, H,
                                                        EVEN_D, BLOCK_B, BLOCK_D, ACC_ROWS)
            w_3, b_3, acc_w_3, acc_b_3 = _column_init(W, bias, hs, f, 3, stride_w_f, stride_w_h, cols, cmask, H,
                                                        EVEN_D, BLOCK_B, BLOCK_D, ACC_ROWS)
        if BLOCK_H > 4:
            w_4, b_4, acc_w_4, acc_b_4 = _column_init(W, bias, hs, f, 4, stride_w_f, stride_w_h, cols, cmask, H,
                                                        EVEN_D, BLOCK_B, BLOCK_D, ACC_ROWS)
            w_5, b_5, acc_w_5, acc_b_5 = _column_init(W, bias, hs, f, 5, stride_w_f, stride_w_h, cols, cmask, H,
                                                        EVEN_D, BLOCK_B, BLOCK_D, ACC_ROWS)
            w_6, b_6, acc_w_6, acc_b_6 = _column_init(W, bias, hs, f, 6, stride_w_f, stride_w_h, cols, cmask, H,
                                                        EVEN_D, BLOCK_B, BLOCK_D, ACC_ROWS)
            w_7, b_7, acc_w_7, acc_b_7 = _column_init(W, bias, hs, f, 7, stride_w_f, stride_w_h, cols, cmask, H,
                                                        EVEN_D, BLOCK_B, BLOCK_D, ACC_ROWS)
    acc_w = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    acc_b_rows = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    # Column sums over rows are kept per row slot ([ACC_ROWS, BLOCK_D], elementwise adds) and
    # reduced once after the loop: a cross-warp reduction per tile would cost more than the tile,
    # and ACC_ROWS short chains instead of one long one keep fp32 sums over 1e6 rows accurate.
    acc_w_rows = tl.zeros([ACC_ROWS, BLOCK_D], dtype=tl.float32)
    # The tl.dot path sums its tiles' columns as it goes: [BLOCK_B, BLOCK_D] slots beside the
    # weight and its accumulator cost registers, and a dot tile is long enough to pay for one
    # cross-warp reduction (H100, F=64 x 256 MB, 32-row tiles: bf16 D=256 H=16 1197 -> 758 us,
    # D=64 1061 -> 796 us, fp32 D=128 787 -> 705 us; benchmarks/NOTES.md). ROW_SLOTS as many as
    # the layout's row span keep the sums in each thread at a few registers (the GEMM backward's
    # row kernel: bf16 1.5-1.8x faster, session 31; not measured here yet).
    LN_ROWS: tl.constexpr = ROW_SLOTS if USE_DOT and ROW_SLOTS else ACC_ROWS
    acc_lnw_rows = tl.zeros([LN_ROWS, BLOCK_D], dtype=tl.float32)
    acc_lnb_rows = tl.zeros([LN_ROWS, BLOCK_D], dtype=tl.float32)
    row_start = pid_p * rows_per_program
    if PREFETCH:
        last_row = tl.minimum(row_start + rows_per_program, B) - 1
        x_next, gy_next, mean_next, rstd_next = _load_bwd_tile(
            X, GY, STATS, f, row_start + tl.arange(0, BLOCK_B), last_row, cols, cmask, hs, hmask, B, stats_half,
            stride_x_f, stride_x_b, stride_x_d, stride_gy_f, stride_gy_b, stride_gy_h,
            LOAD_STATS and NORM != 0, EVEN_D, X_EVICT, BLOCK_H)
    for r0 in tl.range(row_start, row_start + rows_per_program, BLOCK_B, num_stages=LOOP_STAGES):
        rows = r0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        if PREFETCH:
            x_cur, gy_cur, mean_cur, rstd_cur = x_next, gy_next, mean_next, rstd_next
            x_next, gy_next, mean_next, rstd_next = _load_bwd_tile(
                X, GY, STATS, f, rows + BLOCK_B, last_row, cols, cmask, hs, hmask, B, stats_half,
                stride_x_f, stride_x_b, stride_x_d, stride_gy_f, stride_gy_b, stride_gy_h,
                LOAD_STATS and NORM != 0, EVEN_D, X_EVICT, BLOCK_H)
            xhat, a, t, mean, rstd, g = _norm_act_tile(
                x_cur.to(tl.float32), mean_cur, mean_cur, rstd_cur, mask, cmask, f, cols, D, eps, LNW, LNB,
                stride_lnw_f, stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, LOAD_STATS, EVEN_D, EVEN_B, NORM, ACT,
                X.dtype.element_ty == tl.float32)
            gy = gy_cur.to(tl.float32)
            if not EVEN_B:
                gy = tl.where(rmask[:, None], gy, 0.0)  # padded rows re-read the last row
        else:
            x_rows = X + f * stride_x_f + rows64 * stride_x_b
            x_ptrs = x_rows[:, None] + cols[None, :] * stride_x_d
            stat_ptrs = STATS + f * B + rows64
            xhat, a, t, mean, rstd, g = _normalize_activate(
                x_ptrs, x_rows, mask, cmask, f, cols, D, eps, LNW, LNB, stride_lnw_f, stride_lnb_f,
                stat_ptrs, stat_ptrs + stats_half, rmask, HAS_LNW, HAS_LNB, FAST_TANH, LOAD_STATS,
                EVEN_D, EVEN_B, X_EVICT, NORM, ACT,
            )
            # Any strides: the gradient of `y.sum()` is an expanded scalar (all strides 0), read as it is.
            if not UNROLL_H:
                gy_ptrs = GY + f * stride_gy_f + rows64[:, None] * stride_gy_b + hs[None, :] * stride_gy_h
                if EVEN_B and BLOCK_H == 1:
                    gy = tl.load(gy_ptrs).to(tl.float32)
                else:
                    gy = tl.load(gy_ptrs, mask=rmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        if UNROLL_H:
            dt = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
            dt, acc_w_0, acc_b_0 = _column_step(t, dt, w_0, b_0, acc_w_0, acc_b_0, GY, f, 0, rows64, rmask, H,
                                                    stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT, FAST_TANH, EVEN_B,
                                                    ACC_ROWS)
            dt, acc_w_1, acc_b_1 = _column_step(t, dt, w_1, b_1, acc_w_1, acc_b_1, GY, f, 1, rows64, rmask, H,
                                                    stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT, FAST_TANH, EVEN_B,
                                                    ACC_ROWS)
            if BLOCK_H > 2:
                dt, acc_w_2, acc_b_2 = _column_step(t, dt, w_2, b_2, acc_w_2, acc_b_2, GY, f, 2, rows64, rmask, H,
                                                    stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT, FAST_TANH, EVEN_B,
                                                    ACC_ROWS)
                dt, acc_w_3, acc_b_3 = _column_step(t, dt, w_3, b_3, acc_w_3, acc_b_3, GY, f, 3, rows64, rmask, H,
                                                    stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT, FAST_TANH, EVEN_B,
                                                    ACC_ROWS)
            if BLOCK_H > 4:
                dt, acc_w_4, acc_b_4 = _column_step(t, dt, w_4, b_4, acc_w_4, acc_b_4, GY, f, 4, rows64, rmask, H,
                                                    stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT, FAST_TANH, EVEN_B,
                                                    ACC_ROWS)
                dt, acc_w_5, acc_b_5 = _column_step(t, dt, w_5, b_5, acc_w_5, acc_b_5, GY, f, 5, rows64, rmask, H,
                                                    stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT, FAST_TANH, EVEN_B,
                                                    ACC_ROWS)
                dt, acc_w_6, acc_b_6 = _column_step(t, dt, w_6, b_6, acc_w_6, acc_b_6, GY, f, 6, rows64, rmask, H,
                                                    stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT, FAST_TANH, EVEN_B,
                                                    ACC_ROWS)
                dt, acc_w_7, acc_b_7 = _column_step(t, dt, w_7, b_7, acc_w_7, acc_b_7, GY, f, 7, rows64, rmask, H,
                                                    stride_gy_f, stride_gy_b, stride_gy_h, OUT_ACT, FAST_TANH, EVEN_B,
                                                    ACC_ROWS)
        else:
            if SPLIT16:
                t0, t1, t2 = _split16(t, BWD_DOT_DTYPE, T_PARTS)
            # out_act'(z) from the forward's relu mask (LOAD_MASK), or from z recomputed in fp32 (one
            # small dot).
            if OUT_ACT == 0:
                dz = gy
            elif LOAD_MASK:
                dz = tl.where(_load_relu_mask(STATS, stats_half, f, B, rows64, rmask, hs, H), gy, 0.0)
            else:
                if SPLIT16:
                    # t (and an fp32 weight) in 16-bit parts: z to ~fp32 accuracy, so the mask is
                    # the exact function's as in the fp32-operand path.
                    z = _dot_parts(t0, t1, t2, tl.trans(w0), tl.trans(w1), tl.trans(w2),
                                   tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32),
                                   SPLIT_Z, W_PARTS, SPLIT_Z, DOT_UPCAST, True) + bias[None, :]
                else:
                    z = _row_linear(t, w, USE_DOT, BLOCK_H, BWD_DOT_PRECISION) + bias[None, :]
                if OUT_ACT == 3:
                    dz = tl.where(z <= 0, 0.0, gy)
                else:
                    dz = gy * _activate_grad(z, _activate(z, OUT_ACT, FAST_TANH), OUT_ACT, FAST_TANH)
            if DZ_OUT:
                dz_ptrs = DZ + (f * B + rows64)[:, None] * H + hs[None, :]
                if EVEN_B:
                    tl.store(dz_ptrs, dz.to(DZ.dtype.element_ty), mask=hmask[None, :])
                else:
                    tl.store(dz_ptrs, dz.to(DZ.dtype.element_ty), mask=rmask[:, None] & hmask[None, :])
                if STORE_STATS:
                    stat_out = STATS + f * B + rows64
                    if EVEN_B:
                        tl.store(stat_out, mean)
                        tl.store(stat_out + stats_half, rstd)
                    else:
                        tl.store(stat_out, mean, mask=rmask)
                        tl.store(stat_out + stats_half, rstd, mask=rmask)
            if USE_DOT and BWD_DOT_DTYPE == tl.float32:
                dt = tl.dot(dz, w, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
                if not DZ_OUT:
                    acc_w += tl.dot(tl.trans(dz), t, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
            elif USE_DOT:
                # 16-bit tensor cores with fp32 accumulation. dx = rstd * (projection of dt) cancels,
                # so a dz rounded to bf16 would cost ~3e-2 relative error in dx: dz goes in as 16-bit
                # parts (and so does an fp32 weight), so dt is fp32-accurate.
                dz0, dz1, dz2 = _split16(dz, BWD_DOT_DTYPE, DZ_PARTS)
                dt = _dot_parts(dz0, dz1, dz2, w0, w1, w2, tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32),
                                min(DZ_PARTS, SPLIT_DT), W_PARTS, SPLIT_DT, DOT_UPCAST)
                if not DZ_OUT:
                    acc_w = _dot_parts(tl.trans(dz0), tl.trans(dz1), tl.trans(dz2), t0, t1, t2, acc_w,
                                       min(DZ_PARTS, SPLIT_DW), T_DW_PARTS, SPLIT_DW, DOT_UPCAST)
            elif BLOCK_H == 1:
                dz1 = tl.sum(dz, axis=1)
                dt = dz1[:, None] * tl.sum(w, axis=0)[None, :]
                if SUM_PER_TILE:
                    acc_w += tl.sum(dz1[:, None] * t, axis=0, keep_dims=True)
                else:
                    acc_w_rows += _fold_rows(dz1[:, None] * t, ACC_ROWS)
            else:
                dt = tl.sum(dz[:, :, None] * w[None, :, :], axis=1)
                acc_w += tl.sum(dz[:, :, None] * t[:, None, :], axis=0)
            acc_b_rows += dz
        da = dt * _activate_grad(a, t, ACT, FAST_TANH)
        if not (EVEN_D and EVEN_B):
            da = tl.where(mask, da, 0.0)
        if HAS_LNW and not LN_IN_WEIGHT:
            acc_lnw_rows += _fold_rows(da * xhat, LN_ROWS)
        if HAS_LNB and not LN_IN_WEIGHT:
            acc_lnb_rows += _fold_rows(da, LN_ROWS)
        dx = _dx_of_rows(da * g[None, :], xhat, rstd, inv_d, NORM)
        # dx has x's strides, D not necessarily innermost (a permuted [D, B, F] buffer).
        dx_ptrs = DX + f * stride_dx_f + rows64[:, None] * stride_dx_b + cols[None, :] * stride_dx_d
        if EVEN_D and EVEN_B:
            tl.store(dx_ptrs, dx.to(DX.dtype.element_ty))
        else:
            tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)
    part = PARTIAL + (f * n_prog + pid_p) * stride_part_prog
    if UNROLL_H:
        db = _column_store(part, acc_w_0, acc_b_0, 0, cols, cmask, hs, D, H)
        db += _column_store(part, acc_w_1, acc_b_1, 1, cols, cmask, hs, D, H)
        if BLOCK_H > 2:
            db += _column_store(part, acc_w_2, acc_b_2, 2, cols, cmask, hs, D, H)
            db += _column_store(part, acc_w_3, acc_b_3, 3, cols, cmask, hs, D, H)
        if BLOCK_H > 4:
            db += _column_store(part, acc_w_4, acc_b_4, 4, cols, cmask, hs, D, H)
            db += _column_store(part, acc_w_5, acc_b_5, 5, cols, cmask, hs, D, H)
            db += _column_store(part, acc_w_6, acc_b_6, 6, cols, cmask, hs, D, H)
            db += _column_store(part, acc_w_7, acc_b_7, 7, cols, cmask, hs, D, H)
        tl.store(part + H * D + hs, db, mask=hmask)
    else:
        if BLOCK_H == 1 and not SUM_PER_TILE:
            acc_w += tl.sum(acc_w_rows, axis=0)[None, :]
        if not DZ_OUT:
            tl.store(part + hs[:, None] * D + cols[None, :], acc_w, mask=hmask[:, None] & cmask[None, :])
        tl.store(part + H * D + hs, tl.sum(acc_b_rows, axis=0), mask=hmask)
    part += H * D + H
    # Absent LayerNorm affine: zeros, so the reduction stays one uniform pass.
    if not LN_IN_WEIGHT:
        tl.store(part + cols, tl.sum(acc_lnw_rows, axis=0), mask=cmask)
        tl.store(part + D + cols, tl.sum(acc_lnb_rows, axis=0), mask=cmask)


@triton.jit
def _part_norm_act(X, x_rows, cols, rmask, f, mean, rstd, LNW, LNB, stride_x_d, stride_lnw_f, stride_lnb_f,
                   HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, FAST_TANH: tl.constexpr, EVEN_B: tl.constexpr,
                   X_EVICT: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr):
    """(xhat, a, t, norm weight) of the columns `cols` (all < D) of a row tile with the rows' mean
    and rstd; padded rows come out as exact zeros."""
    ptrs = x_rows[:, None] + cols[None, :] * stride_x_d
    if EVEN_B:
        x = tl.load(ptrs, eviction_policy=X_EVICT).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=rmask[:, None], other=0.0, eviction_policy=X_EVICT).to(tl.float32)
    xhat = x
    if NORM != 0:
        xhat = (x - mean[:, None]) * rstd[:, None]
    if not EVEN_B:
        xhat = tl.where(rmask[:, None], xhat, 0.0)
    a = xhat
    g = tl.full([x.shape[1]], 1.0, tl.float32)
    if HAS_LNW:
        g = tl.load(LNW + f * stride_lnw_f + cols).to(tl.float32)
        a = a * g[None, :]
    if HAS_LNB:
        a = a + tl.load(LNB + f * stride_lnb_f + cols).to(tl.float32)[None, :]
    t = _activate(a, ACT, FAST_TANH)
    if not EVEN_B:
        t = tl.where(rmask[:, None], t, 0.0)
    return xhat, a, t, g


@triton.jit
def _part_grads(dz, w, a, t, xhat, g, ACT: tl.constexpr, FAST_TANH: tl.constexpr):
    """One column part of an H = 1 row tile: (dxhat, the weight-gradient, LayerNorm-weight and
    LayerNorm-bias column sums of the tile)."""
    da = (dz[:, None] * w[None, :]) * _activate_grad(a, t, ACT, FAST_TANH)
    dxhat = da * g[None, :]
    return dxhat, tl.sum(dz[:, None] * t, axis=0), tl.sum(da * xhat, axis=0), tl.sum(da, axis=0)


@triton.jit
def _two_part_rows(X, STATS, LNW, LNB, f, rows64, rmask, cols1, cols2, B, stats_half, stride_x_f, stride_x_b,
                   stride_x_d, stride_lnw_f, stride_lnb_f, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
                   FAST_TANH: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr, NORM: tl.constexpr,
                   ACT: tl.constexpr):
    """A row tile of the two-part row backwards: the rows' rstd (the forward's saved stats; 1
    without a norm) and (xhat, a, t, norm weight) of each column part."""
    x_rows = X + f * stride_x_f + rows64 * stride_x_b
    mean = tl.zeros([rows64.shape[0]], dtype=tl.float32)
    rstd = tl.full([rows64.shape[0]], 1.0, tl.float32)
    if NORM != 0:
        if EVEN_B:
            mean = tl.load(STATS + f * B + rows64)
            rstd = tl.load(STATS + stats_half + f * B + rows64)
        else:
            mean = tl.load(STATS + f * B + rows64, mask=rmask, other=0.0)
            rstd = tl.load(STATS + stats_half + f * B + rows64, mask=rmask, other=0.0)
    xhat1, a1, t1, g1 = _part_norm_act(X, x_rows, cols1, rmask, f, mean, rstd, LNW, LNB, stride_x_d, stride_lnw_f,
                                       stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, EVEN_B, X_EVICT, NORM, ACT)
    xhat2, a2, t2, g2 = _part_norm_act(X, x_rows, cols2, rmask, f, mean, rstd, LNW, LNB, stride_x_d, stride_lnw_f,
                                       stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, EVEN_B, X_EVICT, NORM, ACT)
    return rstd, xhat1, a1, t1, g1, xhat2, a2, t2, g2


@triton.jit
def _two_part_dx_store(DX, f, rows64, rmask, cols1, cols2, dxhat1, xhat1, dxhat2, xhat2, rstd, inv_d,
                       stride_dx_f, stride_dx_b, stride_dx_d, NORM: tl.constexpr, EVEN_B: tl.constexpr):
    """dx of a two-part row tile from each part's dxhat and xhat (dx's two row sums add the
    parts'), stored in x's strides."""
    if NORM == 0:
        dx1 = dxhat1
        dx2 = dxhat2
    else:
        # inv_d = 1/D correctly rounded on the host: a GPU fp32 `/` is approximate (2 ulp).
        c1 = (tl.sum(dxhat1 * xhat1, axis=1) + tl.sum(dxhat2 * xhat2, axis=1)) * inv_d
        if NORM == 2:
            dx1 = (dxhat1 - xhat1 * c1[:, None]) * rstd[:, None]
            dx2 = (dxhat2 - xhat2 * c1[:, None]) * rstd[:, None]
        else:
            c2 = (tl.sum(dxhat1, axis=1) + tl.sum(dxhat2, axis=1)) * inv_d
            dx1 = (dxhat1 - (xhat1 * c1[:, None] + c2[:, None])) * rstd[:, None]
            dx2 = (dxhat2 - (xhat2 * c1[:, None] + c2[:, None])) * rstd[:, None]
    dx_rows = DX + f * stride_dx_f + rows64 * stride_dx_b
    if EVEN_B:
        tl.store(dx_rows[:, None] + cols1[None, :] * stride_dx_d, dx1.to(DX.dtype.element_ty))
        tl.store(dx_rows[:, None] + cols2[None, :] * stride_dx_d, dx2.to(DX.dtype.element_ty))
    else:
        tl.store(dx_rows[:, None] + cols1[None, :] * stride_dx_d, dx1.to(DX.dtype.element_ty), mask=rmask[:, None])
        tl.store(dx_rows[:, None] + cols2[None, :] * stride_dx_d, dx2.to(DX.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def ln_tanh_linear_relu_bwd_rows2(
    GY, X, W, BIAS, LNW, LNB, DX, PARTIAL, STATS, DZ,
    B, D, H, rows_per_program, stats_half,
    stride_x_f, stride_x_b, stride_x_d,
    stride_gy_f, stride_gy_b, stride_gy_h,
    stride_dx_f, stride_dx_b, stride_dx_d,
    stride_w_f, stride_w_h,
    stride_bias_f, stride_lnw_f, stride_lnb_f,
    stride_part_prog,
    eps, inv_d,
    HAS_BIAS: tl.constexpr, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr,
    USE_DOT: tl.constexpr, BWD_DOT_PRECISION: tl.constexpr, BWD_DOT_DTYPE: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SPLIT_Z: tl.constexpr, SPLIT_DT: tl.constexpr, SPLIT_DW: tl.constexpr,
    FAST_TANH: tl.constexpr,
    LOAD_STATS: tl.constexpr, EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr,
    LOOP_STAGES: tl.constexpr = None,
):
    """`ln_tanh_linear_relu_bwd` for H = 1 (no tl.dot) where D is the sum of two powers of two,
    D = BLOCK_D + BLOCK_D2 (48 = 32 + 16, 160 = 128 + 32): each row tile is loaded and computed
    as two unmasked parts instead of one tile padded to the next power of two (160 -> 256 lanes,
    60% more normalisation, tanh and products). The same arguments (the dot-path constexprs are
    unused), partial-row layout and numbers up to summation order. The rows' mean and rstd are
    the forward's (LOAD_STATS; NORM == 0 needs none). Column sums per tile.
    """
    pid_p = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    n_prog = tl.num_programs(0)
    cols1 = tl.arange(0, BLOCK_D)
    cols2 = BLOCK_D + tl.arange(0, BLOCK_D2)
    w1 = tl.load(W + f * stride_w_f + cols1).to(tl.float32)
    w2 = tl.load(W + f * stride_w_f + cols2).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(BIAS + f * stride_bias_f).to(tl.float32)
    acc_w1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_w2 = tl.zeros([BLOCK_D2], dtype=tl.float32)
    acc_lnw1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_lnw2 = tl.zeros([BLOCK_D2], dtype=tl.float32)
    acc_lnb1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_lnb2 = tl.zeros([BLOCK_D2], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_B], dtype=tl.float32)
    row_start = pid_p * rows_per_program
    for r0 in tl.range(row_start, row_start + rows_per_program, BLOCK_B, num_stages=LOOP_STAGES):
        rows = r0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        rstd, xhat1, a1, t1, g1, xhat2, a2, t2, g2 = _two_part_rows(
            X, STATS, LNW, LNB, f, rows64, rmask, cols1, cols2, B, stats_half, stride_x_f, stride_x_b, stride_x_d,
            stride_lnw_f, stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, EVEN_B, X_EVICT, NORM, ACT)
        gy_ptrs = GY + f * stride_gy_f + rows64 * stride_gy_b
        if EVEN_B:
            gy = tl.load(gy_ptrs).to(tl.float32)
        else:
            gy = tl.load(gy_ptrs, mask=rmask, other=0.0).to(tl.float32)
        if OUT_ACT == 0:
            dz = gy
        else:
            z = tl.sum(t1 * w1[None, :], axis=1) + tl.sum(t2 * w2[None, :], axis=1) + bias
            if OUT_ACT == 3:
                dz = tl.where(z <= 0, 0.0, gy)
            else:
                dz = gy * _activate_grad(z, _activate(z, OUT_ACT, FAST_TANH), OUT_ACT, FAST_TANH)
        acc_b += dz
        dxhat1, sw1, slw1, slb1 = _part_grads(dz, w1, a1, t1, xhat1, g1, ACT, FAST_TANH)
        dxhat2, sw2, slw2, slb2 = _part_grads(dz, w2, a2, t2, xhat2, g2, ACT, FAST_TANH)
        acc_w1 += sw1
        acc_w2 += sw2
        if HAS_LNW:  # absent: the partial's columns stay zeros
            acc_lnw1 += slw1
            acc_lnw2 += slw2
        if HAS_LNB:
            acc_lnb1 += slb1
            acc_lnb2 += slb2
        _two_part_dx_store(DX, f, rows64, rmask, cols1, cols2, dxhat1, xhat1, dxhat2, xhat2, rstd, inv_d,
                           stride_dx_f, stride_dx_b, stride_dx_d, NORM, EVEN_B)
    # PARTIAL row: [D weight | 1 bias | D ln_weight | D ln_bias] (H = 1)
    part = PARTIAL + (f * n_prog + pid_p) * stride_part_prog
    tl.store(part + cols1, acc_w1)
    tl.store(part + cols2, acc_w2)
    tl.store(part + D, tl.sum(acc_b, axis=0))
    tl.store(part + D + 1 + cols1, acc_lnw1)
    tl.store(part + D + 1 + cols2, acc_lnw2)
    tl.store(part + 2 * D + 1 + cols1, acc_lnb1)
    tl.store(part + 2 * D + 1 + cols2, acc_lnb2)


@triton.jit
def _part_dot_grads(dz0, dz1, dz2, dz, w, w0, w1, w2, t, acc_w, BWD_DOT_PRECISION: tl.constexpr,
                    BWD_DOT_DTYPE: tl.constexpr, DOT_UPCAST: tl.constexpr, SPLIT_DT: tl.constexpr,
                    SPLIT_DW: tl.constexpr, DZ_PARTS: tl.constexpr, W_PARTS: tl.constexpr, T_DW_PARTS: tl.constexpr):
    """One column part of a tl.dot row tile: (dt = dz @ w, acc_w + dz^T @ t), as the whole-row
    kernel takes them (16-bit parts of fp32 values on bf16 tensor cores, or fp32 operands)."""
    if BWD_DOT_DTYPE != tl.float32:
        t0, t1, t2 = _split16(t, BWD_DOT_DTYPE, T_DW_PARTS)
        dt = _dot_parts(dz0, dz1, dz2, w0, w1, w2, tl.zeros([dz.shape[0], w.shape[1]], dtype=tl.float32),
                        min(DZ_PARTS, SPLIT_DT), W_PARTS, SPLIT_DT, DOT_UPCAST)
        acc_w = _dot_parts(tl.trans(dz0), tl.trans(dz1), tl.trans(dz2), t0, t1, t2, acc_w,
                           min(DZ_PARTS, SPLIT_DW), T_DW_PARTS, SPLIT_DW, DOT_UPCAST)
    else:
        dt = tl.dot(dz, w, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
        acc_w += tl.dot(tl.trans(dz), t, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
    return dt, acc_w


@triton.jit
def ln_tanh_linear_relu_bwd_rows2_dot(
    GY, X, W, BIAS, LNW, LNB, DX, PARTIAL, STATS, DZ,
    B, D, H, rows_per_program, stats_half,
    stride_x_f, stride_x_b, stride_x_d,
    stride_gy_f, stride_gy_b, stride_gy_h,
    stride_dx_f, stride_dx_b, stride_dx_d,
    stride_w_f, stride_w_h,
    stride_bias_f, stride_lnw_f, stride_lnb_f,
    stride_part_prog,
    eps, inv_d,
    HAS_BIAS: tl.constexpr, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr,
    USE_DOT: tl.constexpr, BWD_DOT_PRECISION: tl.constexpr, BWD_DOT_DTYPE: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SPLIT_Z: tl.constexpr, SPLIT_DT: tl.constexpr, SPLIT_DW: tl.constexpr,
    FAST_TANH: tl.constexpr,
    LOAD_STATS: tl.constexpr, EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr,
    LOAD_MASK: tl.constexpr = False, LOOP_STAGES: tl.constexpr = None,
):
    """`ln_tanh_linear_relu_bwd`'s tl.dot path where D is the sum of two powers of two, D = BLOCK_D
    + BLOCK_D2 with BLOCK_D2 >= 16 (48 = 32 + 16, 160 = 128 + 32), as `ln_tanh_linear_relu_bwd_rows2`
    is its H = 1 path: each row tile is two unmasked parts, each with its slice of the weight, its
    dt = dz @ w and its weight-gradient accumulator, instead of one tile padded to the next power
    of two (160 -> 256 columns: 60% more lanes through tanh and both dots) or five 32-column chunks
    whose partial sums go through global memory (`ln_tanh_linear_relu_bwd_chunked`). dz comes
    from grad_y and, with relu, the forward's mask (LOAD_MASK; no z here: OUT_ACT is relu with the
    mask or none); the rows' mean and rstd are the forward's (LOAD_STATS; NORM == 0 needs none).
    The same arguments, partial-row layout and numbers up to summation order (dx's two row sums
    add the parts' sums). Column sums per tile, as the whole-row tl.dot path takes them.
    """
    pid_p = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    n_prog = tl.num_programs(0)
    cols1 = tl.arange(0, BLOCK_D)
    cols2 = BLOCK_D + tl.arange(0, BLOCK_D2)
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < H
    # operand parts as `ln_tanh_linear_relu_bwd` counts them (no z: t needs parts for the weight
    # gradient only)
    W_PARTS: tl.constexpr = 1 if W.dtype.element_ty == BWD_DOT_DTYPE else max(SPLIT_Z, SPLIT_DT)
    T_DW_PARTS: tl.constexpr = 1 if X.dtype.element_ty == BWD_DOT_DTYPE else SPLIT_DW
    DZ_EXACT: tl.constexpr = (OUT_ACT == 0 or OUT_ACT == 3) and GY.dtype.element_ty == BWD_DOT_DTYPE
    DZ_PARTS: tl.constexpr = 1 if DZ_EXACT else max(SPLIT_DT, SPLIT_DW)
    w_rows = W + f * stride_w_f + hs[:, None] * stride_w_h
    wa = tl.load(w_rows + cols1[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    wb = tl.load(w_rows + cols2[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    wa0, wa1, wa2 = _split16(wa, BWD_DOT_DTYPE, W_PARTS, True)
    wb0, wb1, wb2 = _split16(wb, BWD_DOT_DTYPE, W_PARTS, True)
    acc_wa = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    acc_wb = tl.zeros([BLOCK_H, BLOCK_D2], dtype=tl.float32)
    acc_b_rows = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    acc_lnwa = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_lnwb = tl.zeros([BLOCK_D2], dtype=tl.float32)
    acc_lnba = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_lnbb = tl.zeros([BLOCK_D2], dtype=tl.float32)
    row_start = pid_p * rows_per_program
    for r0 in tl.range(row_start, row_start + rows_per_program, BLOCK_B, num_stages=LOOP_STAGES):
        rows = r0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        rstd, xhat_a, a_a, t_a, g_a, xhat_b, a_b, t_b, g_b = _two_part_rows(
            X, STATS, LNW, LNB, f, rows64, rmask, cols1, cols2, B, stats_half, stride_x_f, stride_x_b, stride_x_d,
            stride_lnw_f, stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, EVEN_B, X_EVICT, NORM, ACT)
        # Any strides: the gradient of `y.sum()` is an expanded scalar (all strides 0), read as it is.
        gy = tl.load(GY + f * stride_gy_f + rows64[:, None] * stride_gy_b + hs[None, :] * stride_gy_h,
                     mask=rmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        dz = gy
        if LOAD_MASK:
            dz = tl.where(_load_relu_mask_rows(STATS, stats_half, f, B, rows64, rmask, hs, H, BLOCK_H), gy, 0.0)
        acc_b_rows += dz
        dz0, dz1, dz2 = _split16(dz, BWD_DOT_DTYPE, DZ_PARTS)
        dt_a, acc_wa = _part_dot_grads(dz0, dz1, dz2, dz, wa, wa0, wa1, wa2, t_a, acc_wa, BWD_DOT_PRECISION,
                                       BWD_DOT_DTYPE, DOT_UPCAST, SPLIT_DT, SPLIT_DW, DZ_PARTS, W_PARTS, T_DW_PARTS)
        dt_b, acc_wb = _part_dot_grads(dz0, dz1, dz2, dz, wb, wb0, wb1, wb2, t_b, acc_wb, BWD_DOT_PRECISION,
                                       BWD_DOT_DTYPE, DOT_UPCAST, SPLIT_DT, SPLIT_DW, DZ_PARTS, W_PARTS, T_DW_PARTS)
        da_a = dt_a * _activate_grad(a_a, t_a, ACT, FAST_TANH)
        da_b = dt_b * _activate_grad(a_b, t_b, ACT, FAST_TANH)
        if not EVEN_B:
            da_a = tl.where(rmask[:, None], da_a, 0.0)
            da_b = tl.where(rmask[:, None], da_b, 0.0)
        if HAS_LNW:  # absent: the partial's columns stay zeros
            acc_lnwa += tl.sum(da_a * xhat_a, axis=0)
            acc_lnwb += tl.sum(da_b * xhat_b, axis=0)
        if HAS_LNB:
            acc_lnba += tl.sum(da_a, axis=0)
            acc_lnbb += tl.sum(da_b, axis=0)
        dxhat_a = da_a * g_a[None, :]
        dxhat_b = da_b * g_b[None, :]
        _two_part_dx_store(DX, f, rows64, rmask, cols1, cols2, dxhat_a, xhat_a, dxhat_b, xhat_b, rstd, inv_d,
                           stride_dx_f, stride_dx_b, stride_dx_d, NORM, EVEN_B)
    # PARTIAL row of this program: [H*D weight | H bias | D ln_weight | D ln_bias], fp32.
    part = PARTIAL + (f * n_prog + pid_p) * stride_part_prog
    tl.store(part + hs[:, None] * D + cols1[None, :], acc_wa, mask=hmask[:, None])
    tl.store(part + hs[:, None] * D + cols2[None, :], acc_wb, mask=hmask[:, None])
    tl.store(part + H * D + hs, tl.sum(acc_b_rows, axis=0), mask=hmask)
    part += H * D + H
    tl.store(part + cols1, acc_lnwa)
    tl.store(part + cols2, acc_lnwb)
    tl.store(part + D + cols1, acc_lnba)
    tl.store(part + D + cols2, acc_lnbb)


@triton.jit
def ln_tanh_linear_relu_bwd_weight(
    X, DZ, STATS, LNW, LNB, PARTIAL, W,
    B, D, H, rows_per_program, stats_half,
    stride_x_f, stride_x_b, stride_x_d,
    stride_lnw_f, stride_lnb_f, stride_part_prog, stride_w_f, stride_w_h,
    HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
    FAST_TANH: tl.constexpr, BWD_DOT_PRECISION: tl.constexpr, BWD_DOT_DTYPE: tl.constexpr,
    DOT_UPCAST: tl.constexpr, SPLIT_DW: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    LN_GRADS: tl.constexpr = False, SPLIT_DT: tl.constexpr = 3, D_ALIGN: tl.constexpr = 1,
):
    """The weight gradient dz^T @ t of `ln_tanh_linear_relu_bwd` with DZ_OUT, as a GEMM over rows.

    Program (p, f, k) owns columns [k * BLOCK_K, (k + 1) * BLOCK_K) of feature f's weight
    gradient over the rows of backward program p (the same `rows_per_program`), and writes them
    into that program's partial row (no atomics: the reduction's order is fixed). t is recomputed
    from those columns of x and the rows' saved mean and rstd, so the live state is a [BLOCK_H,
    BLOCK_K] accumulator and one [BLOCK_B, BLOCK_K] tile, whatever D. The products are the fused
    kernel's: 16-bit parts of fp32 values (`_dot_parts`, SPLIT_DW) or fp32 operands.
    LN_GRADS: the LayerNorm affine's gradients of these columns too (the fused kernel then makes
    none): dt = dz @ w for the columns (the fused kernel's product, SPLIT_DT), the activation's
    gradient, and the column sums of da * xhat and da kept per row slot ([BLOCK_B, BLOCK_K],
    elementwise adds) and reduced once after the loop: a program owns its columns, so the
    fused kernel's cross-warp reduction per row tile and the [D] accumulators leave the row loop.
    EVEN_D: D % BLOCK_K == 0. EVEN_B: every tile's rows are < B.
    """
    # D_ALIGN: as `ln_tanh_linear_relu_fwd`'s (a masked last column chunk vectorises).
    D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f = _aligned_rows(
        D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f, D_ALIGN)
    pid_p = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_prog = tl.num_programs(0)
    kmask = cols < D
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < H
    SPLIT16: tl.constexpr = BWD_DOT_DTYPE != tl.float32
    DZ_PARTS: tl.constexpr = 1 if DZ.dtype.element_ty == BWD_DOT_DTYPE else max(SPLIT_DW, SPLIT_DT if LN_GRADS else 1)
    T_PARTS: tl.constexpr = 1 if X.dtype.element_ty == BWD_DOT_DTYPE else SPLIT_DW
    W_PARTS: tl.constexpr = 1 if W.dtype.element_ty == BWD_DOT_DTYPE else SPLIT_DT
    acc = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
    acc_lnw_rows = tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32)
    acc_lnb_rows = tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32)
    if LN_GRADS:
        wk = tl.load(W + f * stride_w_f + hs[:, None] * stride_w_h + cols[None, :],
                     mask=hmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        if SPLIT16:
            w0, w1, w2 = _split16(wk, BWD_DOT_DTYPE, W_PARTS, True)
    row_start = pid_p * rows_per_program
    for r0 in tl.range(row_start, row_start + rows_per_program, BLOCK_B):
        rows = r0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        mean = tl.zeros([BLOCK_B], dtype=tl.float32)
        rstd = tl.full([BLOCK_B], 1.0, tl.float32)
        if NORM != 0:
            if EVEN_B:
                mean = tl.load(STATS + f * B + rows64)
                rstd = tl.load(STATS + stats_half + f * B + rows64)
            else:
                mean = tl.load(STATS + f * B + rows64, mask=rmask, other=0.0)
                rstd = tl.load(STATS + stats_half + f * B + rows64, mask=rmask, other=0.0)
        xhat, a, t, g = _chunk_norm_act(
            X, f * stride_x_f + rows64 * stride_x_b, cols, kmask, rmask, f, mean, rstd, LNW, LNB, stride_x_d,
            stride_lnw_f, stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, EVEN_D, EVEN_B, X_EVICT, NORM, ACT)
        dz_ptrs = DZ + (f * B + rows64)[:, None] * H + hs[None, :]
        if EVEN_B:
            dz = tl.load(dz_ptrs, mask=hmask[None, :], other=0.0)
        else:
            dz = tl.load(dz_ptrs, mask=rmask[:, None] & hmask[None, :], other=0.0)
        if not SPLIT16:
            dz = dz.to(tl.float32)
            acc += tl.dot(tl.trans(dz), t, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
            if LN_GRADS:
                dt = tl.dot(dz, wk, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
        else:
            dz0, dz1, dz2 = _split16(dz.to(tl.float32), BWD_DOT_DTYPE, DZ_PARTS)
            t0, t1, t2 = _split16(t, BWD_DOT_DTYPE, T_PARTS)
            acc = _dot_parts(tl.trans(dz0), tl.trans(dz1), tl.trans(dz2), t0, t1, t2, acc,
                             min(DZ_PARTS, SPLIT_DW), T_PARTS, SPLIT_DW, DOT_UPCAST)
            if LN_GRADS:
                dt = _dot_parts(dz0, dz1, dz2, w0, w1, w2, tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32),
                                min(DZ_PARTS, SPLIT_DT), W_PARTS, SPLIT_DT, DOT_UPCAST)
        if LN_GRADS:
            da = dt * _activate_grad(a, t, ACT, FAST_TANH)
            if not (EVEN_D and EVEN_B):
                da = tl.where(rmask[:, None] & kmask[None, :], da, 0.0)
            if HAS_LNW:
                acc_lnw_rows += da * xhat
            if HAS_LNB:
                acc_lnb_rows += da
    part = PARTIAL + (f * n_prog + pid_p) * stride_part_prog
    tl.store(part + hs[:, None] * D + cols[None, :], acc, mask=hmask[:, None] & kmask[None, :])
    if LN_GRADS:
        # Absent LayerNorm affine: zeros (the fused kernel's rule), so the reduction stays uniform.
        tl.store(part + H * D + H + cols, tl.sum(acc_lnw_rows, axis=0), mask=kmask)
        tl.store(part + H * D + H + D + cols, tl.sum(acc_lnb_rows, axis=0), mask=kmask)


@triton.jit
def _column_tile_grads(
    GY, X, STATS, LNW, LNB, f, rows64, rmask, cols, kmask, hs, hmask, B, H, stats_half,
    w0, w1, w2, wk,
    stride_x_f, stride_x_b, stride_x_d, stride_gy_f, stride_gy_b, stride_gy_h, stride_lnw_f, stride_lnb_f,
    HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr,
    FAST_TANH: tl.constexpr, BWD_DOT_PRECISION: tl.constexpr, BWD_DOT_DTYPE: tl.constexpr,
    DOT_UPCAST: tl.constexpr, SPLIT_DT: tl.constexpr, DZ_PARTS: tl.constexpr, W_PARTS: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [rows, BLOCK_K] tile of the two-pass backward (`ln_tanh_linear_relu_bwd_two_pass`): the rows' saved mean / rstd, the tile's xhat and t, dz from
    grad_y and the forward's relu mask (no z: the whole row is not here), dt = dz @ w for these
    columns, and da, dxhat. dz comes back in fp32 and in the 16-bit parts the dots took (fp32 dz
    again when the dots take fp32 operands). Padded rows and columns come out as exact zeros."""
    mean = tl.zeros([rows64.shape[0]], dtype=tl.float32)
    rstd = tl.full([rows64.shape[0]], 1.0, tl.float32)
    if NORM != 0:
        if EVEN_B:
            mean = tl.load(STATS + f * B + rows64)
            rstd = tl.load(STATS + stats_half + f * B + rows64)
        else:
            mean = tl.load(STATS + f * B + rows64, mask=rmask, other=0.0)
            rstd = tl.load(STATS + stats_half + f * B + rows64, mask=rmask, other=0.0)
    xhat, a, t, g = _chunk_norm_act(
        X, f * stride_x_f + rows64 * stride_x_b, cols, kmask, rmask, f, mean, rstd, LNW, LNB, stride_x_d,
        stride_lnw_f, stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, EVEN_D, EVEN_B, X_EVICT, NORM, ACT)
    # Any strides: the gradient of `y.sum()` is an expanded scalar (all strides 0), read as it is.
    gy = tl.load(GY + f * stride_gy_f + rows64[:, None] * stride_gy_b + hs[None, :] * stride_gy_h,
                 mask=rmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
    if OUT_ACT == 0:
        dz = gy
    else:  # relu: the forward's mask
        dz = tl.where(_load_relu_mask_rows(STATS, stats_half, f, B, rows64, rmask, hs, H, hs.shape[0]), gy, 0.0)
    if BWD_DOT_DTYPE != tl.float32:
        dz0, dz1, dz2 = _split16(dz, BWD_DOT_DTYPE, DZ_PARTS)
        dt = _dot_parts(dz0, dz1, dz2, w0, w1, w2, tl.zeros([rows64.shape[0], BLOCK_K], dtype=tl.float32),
                        min(DZ_PARTS, SPLIT_DT), W_PARTS, SPLIT_DT, DOT_UPCAST)
    else:
        dz0, dz1, dz2 = dz, dz, dz
        dt = tl.dot(dz, wk, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
    da = dt * _activate_grad(a, t, ACT, FAST_TANH)
    if not (EVEN_D and EVEN_B):
        da = tl.where(rmask[:, None] & kmask[None, :], da, 0.0)
    dxhat = da * g[None, :]
    return xhat, t, da, dxhat, dz, dz0, dz1, dz2, rstd


@triton.jit
def ln_tanh_linear_relu_bwd_two_pass(
    GY, X, W, BIAS, LNW, LNB, DX, PARTIAL, STATS, ROWSUMS,
    B, D, H, rows_per_program, stats_half,
    stride_x_f, stride_x_b, stride_x_d,
    stride_gy_f, stride_gy_b, stride_gy_h,
    stride_dx_f, stride_dx_b, stride_dx_d,
    stride_w_f, stride_w_h,
    stride_bias_f, stride_lnw_f, stride_lnb_f,
    stride_part_prog,
    eps, inv_d,
    HAS_BIAS: tl.constexpr, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr,
    BWD_DOT_PRECISION: tl.constexpr, BWD_DOT_DTYPE: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SPLIT_DT: tl.constexpr, SPLIT_DW: tl.constexpr, FAST_TANH: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, DX_PASS: tl.constexpr,
    LOOP_STAGES: tl.constexpr = None, DW_FIRST: tl.constexpr = False, D_ALIGN: tl.constexpr = 1,
):
    """The two-pass backward, BLOCK_K columns at a time; launched twice, DX_PASS False then True.

    LayerNorm's dx = (dxhat - xhat * mean(dxhat * xhat) - mean(dxhat)) * rstd needs sums over the
    whole row, so the whole-row kernels hold every column of a row tile at once (255 registers,
    12% occupancy at H >= 16). Here program (k, p, f) owns columns [k * BLOCK_K, (k + 1) * BLOCK_K)
    of feature f over the rows of program p, and holds only that slice of the weight and one
    [BLOCK_B, BLOCK_K] tile (`_column_tile_grads`: xhat, t, dz from grad_y and the forward's relu
    mask, dt = dz @ w, dxhat). Needs the forward's row stats and, with relu, its relu mask.

    * First pass: the slice's sums of dxhat * xhat and dxhat per row, into ROWSUMS ([n_chunks, 2,
      F, B] fp32).
    * Second pass (DX_PASS): the same tile again (the same products, so the same values), the row
      sums of all slices added in slice order, dx for these columns, and the columns' weight
      gradient dz^T @ t ([BLOCK_H, BLOCK_K] in registers), LayerNorm-affine column sums and, for
      k = 0, the bias gradient, into the program's partial row (program p of feature f, the fused
      kernel's layout), which `partials_to_grads` sums in a fixed order: no atomics.

    DW_FIRST: the weight gradient's columns are the first pass's instead (its accumulator and the
    dz^T @ t product leave the second pass, which held 255 registers and spilled at bf16 D=512
    H=64; benchmarks/NOTES.md, eighteenth session).
    The other arguments are `ln_tanh_linear_relu_bwd`'s (BIAS unused; DX and PARTIAL by the
    second pass only).
    """
    # D_ALIGN: as `ln_tanh_linear_relu_bwd`'s (a masked last column chunk vectorises).
    D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f = _aligned_rows(
        D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f, D_ALIGN)
    stride_dx_f = _multiple_of(stride_dx_f, D_ALIGN)
    stride_dx_b = _multiple_of(stride_dx_b, D_ALIGN)
    pid_k = tl.program_id(0)
    pid_p = tl.program_id(1)
    f = tl.program_id(2).to(tl.int64)
    n_prog = tl.num_programs(1)
    n_chunks = tl.num_programs(0)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = cols < D
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < H
    SPLIT16: tl.constexpr = BWD_DOT_DTYPE != tl.float32
    DZ_EXACT: tl.constexpr = (OUT_ACT == 0 or OUT_ACT == 3) and GY.dtype.element_ty == BWD_DOT_DTYPE
    DZ_PARTS: tl.constexpr = 1 if DZ_EXACT else max(SPLIT_DT, SPLIT_DW)
    W_PARTS: tl.constexpr = 1 if W.dtype.element_ty == BWD_DOT_DTYPE else SPLIT_DT
    # t goes into the weight gradient rounded to 16 bits for 16-bit inputs (`ln_tanh_linear_relu_bwd`)
    T_PARTS: tl.constexpr = 1 if X.dtype.element_ty == BWD_DOT_DTYPE else SPLIT_DW
    wk = tl.load(W + f * stride_w_f + hs[:, None] * stride_w_h + cols[None, :],
                 mask=hmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
    w0, w1, w2 = _split16(wk, BWD_DOT_DTYPE, W_PARTS, True)
    acc_w = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
    # Column sums per tile (one cross-warp reduction a tile), not [BLOCK_B, ...] row slots, whose
    # registers (as many as the x tile's, each) capped the programs per SM.
    acc_b = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_lnw = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc_lnb = tl.zeros([BLOCK_K], dtype=tl.float32)
    chunk_planes = tl.full([], 2, tl.int64) * stats_half  # ROWSUMS elements a chunk (64-bit offsets)
    row_start = pid_p * rows_per_program
    for r0 in tl.range(row_start, row_start + rows_per_program, BLOCK_B, num_stages=LOOP_STAGES):
        rows = r0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        xhat, t, da, dxhat, dz, dz0, dz1, dz2, rstd = _column_tile_grads(
            GY, X, STATS, LNW, LNB, f, rows64, rmask, cols, kmask, hs, hmask, B, H, stats_half, w0, w1, w2, wk,
            stride_x_f, stride_x_b, stride_x_d, stride_gy_f, stride_gy_b, stride_gy_h, stride_lnw_f, stride_lnb_f,
            HAS_LNW, HAS_LNB, NORM, ACT, OUT_ACT, FAST_TANH, BWD_DOT_PRECISION, BWD_DOT_DTYPE, DOT_UPCAST,
            SPLIT_DT, DZ_PARTS, W_PARTS, EVEN_D, EVEN_B, X_EVICT, BLOCK_K)
        if DW_FIRST != DX_PASS:  # this pass makes the weight gradient's columns
            if SPLIT16:
                t0, t1, t2 = _split16(t, BWD_DOT_DTYPE, T_PARTS)
                acc_w = _dot_parts(tl.trans(dz0), tl.trans(dz1), tl.trans(dz2), t0, t1, t2, acc_w,
                                   min(DZ_PARTS, SPLIT_DW), T_PARTS, SPLIT_DW, DOT_UPCAST)
            else:
                acc_w += tl.dot(tl.trans(dz0), t, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
        if not DX_PASS:
            plane = ROWSUMS + pid_k * chunk_planes + f * B + rows64
            if EVEN_B:
                tl.store(plane, tl.sum(dxhat * xhat, axis=1))
                tl.store(plane + stats_half, tl.sum(dxhat, axis=1))
            else:
                tl.store(plane, tl.sum(dxhat * xhat, axis=1), mask=rmask)
                tl.store(plane + stats_half, tl.sum(dxhat, axis=1), mask=rmask)
        else:
            if NORM == 0:
                dx = dxhat
            else:
                c1 = tl.zeros([BLOCK_B], dtype=tl.float32)
                c2 = tl.zeros([BLOCK_B], dtype=tl.float32)
                for k in range(0, n_chunks):
                    plane = ROWSUMS + k * chunk_planes + f * B + rows64
                    if EVEN_B:
                        c1 += tl.load(plane)
                        c2 += tl.load(plane + stats_half)
                    else:
                        c1 += tl.load(plane, mask=rmask, other=0.0)
                        c2 += tl.load(plane + stats_half, mask=rmask, other=0.0)
                # inv_d = 1/D correctly rounded on the host: a GPU fp32 `/` is approximate (2 ulp).
                c1 = c1 * inv_d
                if NORM == 2:
                    dx = (dxhat - xhat * c1[:, None]) * rstd[:, None]
                else:
                    c2 = c2 * inv_d
                    dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            dx_ptrs = DX + f * stride_dx_f + rows64[:, None] * stride_dx_b + cols[None, :] * stride_dx_d
            if EVEN_D and EVEN_B:
                tl.store(dx_ptrs, dx.to(DX.dtype.element_ty))
            else:
                tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=rmask[:, None] & kmask[None, :])
            if pid_k == 0:  # the bias gradient is the first column chunk's
                acc_b += tl.sum(dz, axis=0)
            if HAS_LNW:
                acc_lnw += tl.sum(da * xhat, axis=0)
            if HAS_LNB:
                acc_lnb += tl.sum(da, axis=0)
    part = PARTIAL + (f * n_prog + pid_p) * stride_part_prog
    if DW_FIRST != DX_PASS:
        tl.store(part + hs[:, None] * D + cols[None, :], acc_w, mask=hmask[:, None] & kmask[None, :])
    if DX_PASS:
        # Absent LayerNorm affine: zeros (the fused kernel's rule), so the reduction stays uniform.
        tl.store(part + H * D + H + cols, acc_lnw, mask=kmask)
        tl.store(part + H * D + H + D + cols, acc_lnb, mask=kmask)
        if pid_k == 0:
            tl.store(part + H * D + hs, acc_b, mask=hmask)


@triton.jit
def _chunk_norm_act(
    X, x_row_off, cols, kmask, rmask, f, mean, rstd, LNW, LNB, stride_x_d, stride_lnw_f, stride_lnb_f,
    HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr, FAST_TANH: tl.constexpr, EVEN_D: tl.constexpr,
    EVEN_B: tl.constexpr, X_EVICT: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
):
    """(xhat, a, t, norm weight) of the columns `cols` of a row tile, given the rows' mean and
    rstd: `_normalize_activate` for one chunk. Padded rows and columns come out as exact zeros."""
    ptrs = X + x_row_off[:, None] + cols[None, :] * stride_x_d
    mask = rmask[:, None] & kmask[None, :]
    if EVEN_D and EVEN_B:
        x = tl.load(ptrs, eviction_policy=X_EVICT).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=X_EVICT).to(tl.float32)
    if NORM == 0:
        xhat = x
    else:
        xhat = (x - mean[:, None]) * rstd[:, None]
    if not (EVEN_D and EVEN_B):
        xhat = tl.where(mask, xhat, 0.0)  # padded rows may have rstd = inf (see `_normalize_activate`)
    a = xhat
    g = tl.full([x.shape[1]], 1.0, tl.float32)
    if HAS_LNW:
        g = tl.load(LNW + f * stride_lnw_f + cols, mask=kmask, other=0.0).to(tl.float32)
        a = a * g[None, :]
    if HAS_LNB:
        a = a + tl.load(LNB + f * stride_lnb_f + cols, mask=kmask, other=0.0).to(tl.float32)[None, :]
    t = _activate(a, ACT, FAST_TANH)
    if not (EVEN_D and EVEN_B):
        t = tl.where(mask, t, 0.0)
    return xhat, a, t, g


@triton.jit
def _accumulate_partial(ptrs, vals, mask, r0, row_start):
    """Add `vals` into this program's partial sums at `ptrs` (written by its first row tile, read
    back and added by the next: the program owns its partial row, so no atomics, same bits).
    The same thread stores and reloads each element (same code, same layout every tile)."""
    not_first = (mask.to(tl.int32) * 0 + r0) > row_start  # a tensor: the interpreter masks with no scalar
    prev = tl.load(ptrs, mask=mask & not_first, other=0.0)
    tl.store(ptrs, prev + vals, mask=mask)


@triton.jit
def ln_tanh_linear_relu_bwd_chunked(
    GY, X, W, BIAS, LNW, LNB, DX, PARTIAL, STATS, DZ,
    B, D, H, rows_per_program, stats_half,
    stride_x_f, stride_x_b, stride_x_d,
    stride_gy_f, stride_gy_b, stride_gy_h,
    stride_dx_f, stride_dx_b, stride_dx_d,
    stride_w_f, stride_w_h,
    stride_bias_f, stride_lnw_f, stride_lnb_f,
    stride_part_prog,
    eps, inv_d,
    HAS_BIAS: tl.constexpr, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
    NORM: tl.constexpr, ACT: tl.constexpr, OUT_ACT: tl.constexpr,
    USE_DOT: tl.constexpr, BWD_DOT_PRECISION: tl.constexpr, BWD_DOT_DTYPE: tl.constexpr, DOT_UPCAST: tl.constexpr,
    SPLIT_Z: tl.constexpr, SPLIT_DT: tl.constexpr, SPLIT_DW: tl.constexpr,
    FAST_TANH: tl.constexpr,
    LOAD_STATS: tl.constexpr, EVEN_D: tl.constexpr, EVEN_B: tl.constexpr, X_EVICT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    LOAD_MASK: tl.constexpr = False, D_ALIGN: tl.constexpr = 1,
):
    """`ln_tanh_linear_relu_bwd` (tl.dot path) BLOCK_K columns at a time: the same arguments, the
    same partial-sum layout, the same numbers up to summation order.

    Whole-row tiles held 255 registers and spilled at every dot config (2 CTAs of 4 warps per SM,
    benchmarks/NOTES.md). Here only [rows, BLOCK_K] slices of x and of the weight are live; each
    row tile is walked three times (from L1/L2 after the first): (1) z = t @ w^T chunk by chunk,
    then dz; (2) dt = dz @ w, the row sums of dx's projection, and the weight and LayerNorm-affine
    gradients of the chunk, added into the program's partial row in global memory (a chunk loop
    cannot index a register accumulator by chunk); (3) dt again, and dx. With LOAD_MASK (relu)
    walk (1) is the forward's relu mask instead (`_load_relu_mask`). Row statistics are the
    forward's (LOAD_STATS) or two passes over the chunks (mean, then centred squares).
    The chunk loops stop at D, not BLOCK_D: EVEN_D here means D % BLOCK_K == 0, so a D that is not
    a power of two (160 = 5 x 32) walks no padded columns and needs no column masks.
    """
    # D_ALIGN: as `ln_tanh_linear_relu_bwd`'s (a masked last column chunk vectorises).
    D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f = _aligned_rows(
        D, stride_x_f, stride_x_b, stride_w_f, stride_w_h, stride_lnw_f, stride_lnb_f, D_ALIGN)
    stride_dx_f = _multiple_of(stride_dx_f, D_ALIGN)
    stride_dx_b = _multiple_of(stride_dx_b, D_ALIGN)
    pid_p = tl.program_id(0)
    f = tl.program_id(1).to(tl.int64)
    n_prog = tl.num_programs(0)
    ks = tl.arange(0, BLOCK_K)
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < H
    SPLIT16: tl.constexpr = BWD_DOT_DTYPE != tl.float32
    W_PARTS: tl.constexpr = 1 if W.dtype.element_ty == BWD_DOT_DTYPE else max(SPLIT_Z, SPLIT_DT)
    T_DW_PARTS: tl.constexpr = 1 if X.dtype.element_ty == BWD_DOT_DTYPE else SPLIT_DW
    T_Z_PARTS: tl.constexpr = SPLIT_Z if OUT_ACT != 0 else 1
    DZ_EXACT: tl.constexpr = (OUT_ACT == 0 or OUT_ACT == 3) and GY.dtype.element_ty == BWD_DOT_DTYPE
    DZ_PARTS: tl.constexpr = 1 if DZ_EXACT else max(SPLIT_DT, SPLIT_DW)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + f * stride_bias_f + hs, mask=hmask, other=0.0).to(tl.float32)
    part = PARTIAL + (f * n_prog + pid_p) * stride_part_prog
    w_rows = W + f * stride_w_f + hs[:, None] * stride_w_h
    acc_b_rows = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    row_start = pid_p * rows_per_program
    for r0 in range(row_start, row_start + rows_per_program, BLOCK_B):
        rows = r0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        x_row_off = f * stride_x_f + rows64 * stride_x_b
        # -- the rows' statistics
        if NORM == 0:
            mean = tl.zeros([BLOCK_B], dtype=tl.float32)
            rstd = tl.full([BLOCK_B], 1.0, tl.float32)
        elif LOAD_STATS:
            mean = tl.load(STATS + f * B + rows64, mask=rmask, other=0.0)
            rstd = tl.load(STATS + stats_half + f * B + rows64, mask=rmask, other=0.0)
        else:
            s1 = tl.zeros([BLOCK_B], dtype=tl.float32)
            # LayerNorm: the rows shifted by their first element, so that a constant row has
            # exactly its value as mean and variance 0 (see `_norm_act_tile`).
            pivot = tl.zeros([BLOCK_B], dtype=tl.float32)
            if NORM == 1 and X.dtype.element_ty == tl.float32:  # 16-bit sums are exact
                pivot = tl.load(X + x_row_off, mask=rmask, other=0.0).to(tl.float32)
            if NORM == 1:
                for k0 in range(0, D, BLOCK_K):
                    cols = k0 + ks
                    xk = tl.load(X + x_row_off[:, None] + cols[None, :] * stride_x_d,
                                 mask=rmask[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
                    s1 += tl.sum(tl.where((cols < D)[None, :], xk - pivot[:, None], 0.0), axis=1)
            if X.dtype.element_ty == tl.float32:
                mean = pivot + s1 * inv_d
            else:  # a correctly rounded `/`: a constant 16-bit row's exact sum gives its value back
                mean = tl.math.div_rn(s1, tl.full([BLOCK_B], D, tl.float32))
            s2 = tl.zeros([BLOCK_B], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                cols = k0 + ks
                kmask = cols < D
                xk = tl.load(X + x_row_off[:, None] + cols[None, :] * stride_x_d,
                             mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                xc = tl.where(kmask[None, :], xk - mean[:, None], 0.0)
                s2 += tl.sum(xc * xc, axis=1)
            var = s2 * inv_d
            if NORM == 1:
                rstd = 1.0 / tl.sqrt(var + eps) + (var - var)  # NaN where the variance overflowed
            else:
                rstd = 1.0 / tl.sqrt(var + eps) + (var - var)  # RMSNorm: var is the mean square
        # -- (1) z, then dz
        z = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
        if OUT_ACT != 0 and not LOAD_MASK:
            for k0 in range(0, D, BLOCK_K):
                cols = k0 + ks
                kmask = cols < D
                _, _, tk, _ = _chunk_norm_act(X, x_row_off, cols, kmask, rmask, f, mean, rstd, LNW, LNB, stride_x_d,
                                              stride_lnw_f, stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH, EVEN_D,
                                              EVEN_B, "", NORM, ACT)
                wk = tl.load(w_rows + cols[None, :], mask=hmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                if SPLIT16:
                    t0, t1, t2 = _split16(tk, BWD_DOT_DTYPE, T_Z_PARTS)
                    w0, w1, w2 = _split16(wk, BWD_DOT_DTYPE, W_PARTS, True)
                    z = _dot_parts(t0, t1, t2, tl.trans(w0), tl.trans(w1), tl.trans(w2), z,
                                   SPLIT_Z, W_PARTS, SPLIT_Z, DOT_UPCAST, True)
                else:
                    z = tl.dot(tk, tl.trans(wk), z, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
        z += bias[None, :]
        gy = tl.load(GY + f * stride_gy_f + rows64[:, None] * stride_gy_b + hs[None, :] * stride_gy_h,
                     mask=rmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        if OUT_ACT == 0:
            dz = gy
        elif LOAD_MASK:
            dz = tl.where(_load_relu_mask(STATS, stats_half, f, B, rows64, rmask, hs, H), gy, 0.0)
        elif OUT_ACT == 3:
            dz = tl.where(z <= 0, 0.0, gy)
        else:
            dz = gy * _activate_grad(z, _activate(z, OUT_ACT, FAST_TANH), OUT_ACT, FAST_TANH)
        acc_b_rows += dz
        if SPLIT16:
            dz0, dz1, dz2 = _split16(dz, BWD_DOT_DTYPE, DZ_PARTS)
        # -- (2) the chunk's column gradients and dx's row sums; (3) dx
        c1 = tl.zeros([BLOCK_B], dtype=tl.float32)
        c2 = tl.zeros([BLOCK_B], dtype=tl.float32)
        for step in tl.static_range(2):
            if step == 1:
                c1 = c1 * inv_d
                c2 = c2 * inv_d
            for k0 in range(0, D, BLOCK_K):
                cols = k0 + ks
                kmask = cols < D
                xhat, a, tk, g = _chunk_norm_act(X, x_row_off, cols, kmask, rmask, f, mean, rstd, LNW, LNB,
                                                 stride_x_d, stride_lnw_f, stride_lnb_f, HAS_LNW, HAS_LNB, FAST_TANH,
                                                 EVEN_D, EVEN_B, X_EVICT if step == 1 else "", NORM, ACT)
                wk = tl.load(w_rows + cols[None, :], mask=hmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                if SPLIT16:
                    w0, w1, w2 = _split16(wk, BWD_DOT_DTYPE, W_PARTS, True)
                    dt = _dot_parts(dz0, dz1, dz2, w0, w1, w2, tl.zeros([BLOCK_B, BLOCK_K], dtype=tl.float32),
                                    min(DZ_PARTS, SPLIT_DT), W_PARTS, SPLIT_DT, DOT_UPCAST)
                else:
                    dt = tl.dot(dz, wk, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
                da = dt * _activate_grad(a, tk, ACT, FAST_TANH)
                if not (EVEN_D and EVEN_B):
                    da = tl.where(rmask[:, None] & kmask[None, :], da, 0.0)
                dxhat = da * g[None, :]
                if step == 0:
                    if NORM != 0:
                        c1 += tl.sum(dxhat * xhat, axis=1)
                        if NORM == 1:
                            c2 += tl.sum(dxhat, axis=1)
                    if SPLIT16:
                        t0, t1, t2 = _split16(tk, BWD_DOT_DTYPE, T_DW_PARTS)
                        dwk = _dot_parts(tl.trans(dz0), tl.trans(dz1), tl.trans(dz2), t0, t1, t2,
                                         tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32),
                                         min(DZ_PARTS, SPLIT_DW), T_DW_PARTS, SPLIT_DW, DOT_UPCAST)
                    else:
                        dwk = tl.dot(tl.trans(dz), tk, input_precision=BWD_DOT_PRECISION, out_dtype=tl.float32)
                    _accumulate_partial(part + hs[:, None] * D + cols[None, :], dwk,
                                        hmask[:, None] & kmask[None, :], r0, row_start)
                    if HAS_LNW:
                        _accumulate_partial(part + H * D + H + cols, tl.sum(da * xhat, axis=0), kmask, r0, row_start)
                    if HAS_LNB:
                        _accumulate_partial(part + H * D + H + D + cols, tl.sum(da, axis=0), kmask, r0, row_start)
                else:
                    if NORM == 0:
                        dx = dxhat
                    elif NORM == 2:
                        dx = (dxhat - xhat * c1[:, None]) * rstd[:, None]
                    else:
                        dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
                    dx_ptrs = DX + f * stride_dx_f + rows64[:, None] * stride_dx_b + cols[None, :] * stride_dx_d
                    if EVEN_D and EVEN_B:
                        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty))
                    else:
                        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=rmask[:, None] & kmask[None, :])
    tl.store(part + H * D + hs, tl.sum(acc_b_rows, axis=0), mask=hmask)
    # Absent LayerNorm affine: zeros, so the reduction stays one uniform pass.
    if not HAS_LNW:
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + ks
            tl.store(part + H * D + H + cols, tl.zeros([BLOCK_K], dtype=tl.float32), mask=cols < D)
    if not HAS_LNB:
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + ks
            tl.store(part + H * D + H + D + cols, tl.zeros([BLOCK_K], dtype=tl.float32), mask=cols < D)


@triton.jit
def _store_segment(OUT, vals, ks, kmask, start, size, f, PER_FEATURE: tl.constexpr):
    """Columns [start, start + size) of a partial row are one parameter's gradient: store them in
    its own tensor (row f of a per-feature [F, ...] parameter), in its dtype."""
    m = kmask & (ks >= start) & (ks < start + size)
    off = ks - start
    if PER_FEATURE:
        off += f * size
    tl.store(OUT + off, vals.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def partials_to_grads(
    PARTIAL, GW, GB, GLW, GLB, F, n_per_feature, K, H, D, first_pf_block,
    HAS_BIAS: tl.constexpr, HAS_LNW: tl.constexpr, HAS_LNB: tl.constexpr,
    W_PER_F: tl.constexpr, B_PER_F: tl.constexpr, LNW_PER_F: tl.constexpr, LNB_PER_F: tl.constexpr,
    ANY_PER_F: tl.constexpr, ANY_SHARED: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The final parameter gradients from the backward's per-program partial rows, in a fixed order.

    PARTIAL is [F * n_per_feature, K], K = H*D weight | H bias | D ln_weight | D ln_bias. Program
    (k block, f) sums feature f's rows into the per-feature parameters' row f; program (k block, 0)
    also sums all rows into the shared parameters. Each gradient is written once, in its
    parameter's shape and dtype: nothing is left for torch to reshape, sum or cast.
    BLOCK_J rows are added per step into BLOCK_J separate accumulators summed at the end, so the
    rounding chains are n / BLOCK_J long.
    The grid is one axis: feature 0's programs for every k block, then for each other feature
    those from `first_pf_block` (the first block with a per-feature column) on. A shared [H, D]
    weight beside per-feature LayerNorm affine has all its columns first: features 1.. then skip
    them (bf16 D=512 H=64, F=64: 135K programs, most of them empty, took 135 us on the H200).
    """
    n_blocks = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    f = tl.where(pid < n_blocks, 0, 1 + (pid - n_blocks) // tl.maximum(n_blocks - first_pf_block, 1))
    kb = tl.where(pid < n_blocks, pid, first_pf_block + (pid - n_blocks) % tl.maximum(n_blocks - first_pf_block, 1))
    ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    js = tl.arange(0, BLOCK_J)
    kmask = ks < K
    HD = H * D
    per_f = ks < 0
    if W_PER_F:
        per_f = per_f | (ks < HD)
    if B_PER_F:
        per_f = per_f | ((ks >= HD) & (ks < HD + H))
    if LNW_PER_F:
        per_f = per_f | ((ks >= HD + H) & (ks < HD + H + D))
    if LNB_PER_F:
        per_f = per_f | (ks >= HD + H + D)
    if ANY_PER_F:
        acc = tl.zeros([BLOCK_J, BLOCK_K], dtype=tl.float32)
        for j0 in range(0, n_per_feature, BLOCK_J):
            rows = (f * n_per_feature + j0 + js).to(tl.int64)
            m = ((j0 + js) < n_per_feature)[:, None] & (kmask & per_f)[None, :]
            acc += tl.load(PARTIAL + rows[:, None] * K + ks[None, :], mask=m, other=0.0)
        s = tl.sum(acc, axis=0)
        if W_PER_F:
            _store_segment(GW, s, ks, kmask, 0, HD, f, True)
        if HAS_BIAS and B_PER_F:
            _store_segment(GB, s, ks, kmask, HD, H, f, True)
        if HAS_LNW and LNW_PER_F:
            _store_segment(GLW, s, ks, kmask, HD + H, D, f, True)
        if HAS_LNB and LNB_PER_F:
            _store_segment(GLB, s, ks, kmask, HD + H + D, D, f, True)
    if ANY_SHARED:
        if f == 0:
            shared = kmask & (per_f == 0)
            n = F * n_per_feature
            acc2 = tl.zeros([BLOCK_J, BLOCK_K], dtype=tl.float32)
            for j0 in range(0, n, BLOCK_J):
                rows = (j0 + js).to(tl.int64)
                m = (rows < n)[:, None] & shared[None, :]
                acc2 += tl.load(PARTIAL + rows[:, None] * K + ks[None, :], mask=m, other=0.0)
            t = tl.sum(acc2, axis=0)
            if not W_PER_F:
                _store_segment(GW, t, ks, kmask, 0, HD, 0, False)
            if HAS_BIAS and not B_PER_F:
                _store_segment(GB, t, ks, kmask, HD, H, 0, False)
            if HAS_LNW and not LNW_PER_F:
                _store_segment(GLW, t, ks, kmask, HD + H, D, 0, False)
            if HAS_LNB and not LNB_PER_F:
                _store_segment(GLB, t, ks, kmask, HD + H + D, D, 0, False)
