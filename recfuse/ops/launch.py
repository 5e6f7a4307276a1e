"""Tensors -> kernel launches for `recfuse::ln_tanh_linear_relu` and `recfuse::feature_mlp`.

Every entry point takes the call's `chain` (`recfuse.chain.Chain`: norm, activation, out
activation; default LayerNorm -> tanh -> relu), which becomes three constexprs of one kernel family.

A call's *signature* (shapes, strides, dtypes, devices and 16-byte alignment of every tensor,
which parameters are present, eps, feature_dim) fixes everything but the data pointers: the
config (`configs.py`), the grid, every integer argument and constexpr of the kernels, and the
compiled kernel. The first call of a signature builds a plan with all of that; later calls look
the plan up, allocate the outputs and launch. Inside a `configs.override` block plans are built
fresh and not kept, so a forced config is what runs.

x is read in place (a [B, F*D] buffer viewed as [B, F, D] costs no copy); the maths lives in
`kernels.py`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..chain import ACTIVATIONS, DEFAULT, codes as chain_codes
from .._checks import BoundedDict, call_signature as signature, stats_planes, tensor_signature as _tensor_signature
from . import configs, gemm_backward, kernels
from ._compiled_launch import CompiledLaunchCache

log = logging.getLogger("recfuse")

_launch_fwd = CompiledLaunchCache(kernels.ln_tanh_linear_relu_fwd)
_launch_fwd_y_strided = CompiledLaunchCache(kernels.ln_tanh_linear_relu_fwd_y_strided)
_launch_bwd = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd)
_launch_bwd_chunked = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd_chunked)
_launch_bwd_weight = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd_weight)
_launch_bwd_two_pass = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd_two_pass)
_launch_bwd_rows2 = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd_rows2)
_launch_bwd_rows2_dot = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd_rows2_dot)
_launch_partials_to_grads = CompiledLaunchCache(kernels.partials_to_grads)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float64: tl.float64}

# fp32 tl.dot on CUDA: plain TF32 costs ~1e-3 relative error; 3xTF32 keeps float32 accuracy at
# tensor-core speed. The interpreter (CPU) computes dots in numpy float32 and knows only "ieee".
_FP32_DOT_PRECISION = "tf32x3"


# A list while a `trace_launches` block is open: every plan launch appends (kind, grid, meta, ...).
_TRACE: Optional[list] = None


def _current_trace() -> Optional[list]:
    return _TRACE


@contextlib.contextmanager
def trace_launches():
    """Record the launches made inside the block, to check which kernel path a shape takes.

    Yields a list that fills with ``("forward", grid, meta, y_row_stride_specialised)`` and
    ``("backward", grid, meta, cfg)`` tuples; an observation seam, it changes nothing that runs.

    Example:
        >>> import torch
        >>> with trace_launches() as seen:  # doctest: +SKIP
        ...     forward(torch.randn(2, 4, 8), torch.randn(1, 8), None, None, None, 1e-5, 0)
        >>> seen[0][2]["BLOCK_D"]  # doctest: +SKIP
        8
    """
    global _TRACE
    outer, _TRACE = _TRACE, []
    try:
        yield _TRACE
    finally:
        _TRACE = outer


def _fp32_dot_precision(device_type: str) -> str:
    return "ieee" if device_type == "cpu" else _FP32_DOT_PRECISION


def _tanh_mode(dtype: torch.dtype, device_type: str, backward: bool = False, exact: bool = False) -> int:
    """The kernels' FAST_TANH: which tanh (and 16-bit sigmoid / gelu) form they compile.

    1: MUFU tanh.approx, for 16-bit inputs on CUDA. 2: the exact exp form with its exp and
    divide as single MUFU instructions (`kernels._tanh_mufu`), fp32 on CUDA (1e-5 target), and
    wherever ``exact`` asks for the exact form on CUDA. 0: the portable exact form (CPU,
    the interpreter).

    The fp16 backward keeps the exact form too: dx is a cancelling projection that amplifies
    the approximation's ~5e-4 relative error past fp16's budget (measured at H=64 on the H100).
    """
    if device_type != "cuda":
        return 0
    if exact or (backward and dtype == torch.float16):
        return 2
    return 1 if dtype in (torch.bfloat16, torch.float16) else 2


def _bwd_dot_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, fp32_dots: str = "tf32x3"):
    """Operand dtype of the backward's tl.dot path.

    bf16 x and weight: bf16 tensor cores with fp32 accumulation, z and dt fp32-accurate through
    hi + lo parts (`kernels.ln_tanh_linear_relu_bwd`); on the H100 1.5-7x faster than fp32
    operands, gradients within 1.7e-3-2.8e-3 of float64 (PyTorch's bf16 autograd: 1.7e-3).
    fp32 x and weight with ``fp32_dots`` "bf16x3" / "bf16x6" (`configs.BackwardConfig`): bf16
    tensor cores too, every fp32 operand split into 2 / 3 bf16 parts (`_FP32_SPLITS`).
    The interpreter multiplies the same bf16 values in fp32 (the plan's DOT_UPCAST).
    Otherwise fp32 operands (3xTF32), fp16 too: gradients below its range (6e-8, common before
    loss scaling) would flush to zero.
    """
    if x_dtype == torch.bfloat16 and w_dtype == torch.bfloat16:
        return tl.bfloat16
    if x_dtype == torch.float32 and w_dtype == torch.float32 and fp32_dots in _FP32_SPLITS:
        return tl.bfloat16
    return tl.float32


# fp32_dots -> (SPLIT_Z, SPLIT_DT, SPLIT_DW) of the backward kernel: the order of the kept cross
# products of bf16 parts in z = t @ w^T, dt = dz @ w and the weight gradient dz^T @ t
# (`kernels._dot_parts`). Every gradient vs float64 in the interpreter (F=2 B=256, D 32-512,
# H 2-64, with and without LayerNorm affine, relu ties zeroed; 58 shapes): bf16x3 1.9e-5-4.0e-5
# (bias 2e-7), bf16x6 and fp32 operands <= 3e-7. bf16x3 passes the tuner's 1e-4, not the tests' 1e-5.
# "bf16x6z3": z (which only decides the relu mask) in bf16x3, dt and the weight gradient in
# bf16x6: as accurate as bf16x6 away from relu ties (z ~1e-5 off, so masks flip only within
# ~1e-5 of 0), and it fits D=256 H=64 on the H100 (204 KB shared memory, bf16x6 244 KB).
_FP32_SPLITS = {"bf16x3": (2, 2, 2), "bf16x6": (3, 3, 3), "bf16x6z3": (2, 3, 3)}


def _bwd_splits(x_dtype: torch.dtype, fp32_dots: str, out_activation: Optional[str]) -> dict:
    """SPLIT_* constexprs: the fp32 split of `fp32_dots`; the 16-bit path keeps order 2 (hi + lo
    parts of fp32 values against exact 16-bit ones).

    z from fewer products than dt ("bf16x6z3") only where z decides a relu mask (or nothing): an
    out-activation's derivative takes z's value, and a tanh out-activation gave x.grad 1.5e-5 off
    float64 with z in bf16x3 (interpreter).
    """
    if x_dtype != torch.float32 or fp32_dots not in _FP32_SPLITS:
        return dict(SPLIT_Z=2, SPLIT_DT=2, SPLIT_DW=2)
    z, dt, dw = _FP32_SPLITS[fp32_dots]
    if out_activation not in (None, "relu"):
        z = max(z, dt)
    return dict(SPLIT_Z=z, SPLIT_DT=dt, SPLIT_DW=dw)


def _unfit_key(x: torch.Tensor, weight: torch.Tensor, chain) -> tuple:
    """Key of a backward kernel variant whose resources are known not to fit this device: what
    the kernel's shared memory and registers depend on besides the config."""
    return (x.shape[2], weight.shape[-2], x.dtype, weight.dim(), x.device.type, chain)


def _dot_args(dtype: torch.dtype, device_type: str) -> dict:
    """DOT_DTYPE / DOT_PRECISION constexprs of the forward kernel for x's dtype and device."""
    if device_type == "cpu":  # Triton interpreter: numpy has no bf16 matmul
        return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}
    return {"DOT_DTYPE": _TL_DTYPES[dtype], "DOT_PRECISION": _fp32_dot_precision(device_type)}


def device_constexprs(kind: str, dtype: torch.dtype, device_type: str, chain=DEFAULT, fp32_dots: str = "") -> dict:
    """The constexprs of a ``kind`` ("forward" / "backward") kernel that depend on the device type:
    the dot operands' dtype and precision, the interpreter's fp32 upcast, the tanh form. Plans
    take them for their device; `benchmarks/offline_sass.py` for "cuda" on a CPU machine.

    Example:
        >>> device_constexprs("backward", torch.float32, "cpu")["FAST_TANH"], device_constexprs("forward", torch.float32, "cuda")["FAST_TANH"]
        (0, 2)
    """
    if kind == "forward":
        return dict(_dot_args(dtype, device_type), FAST_TANH=_tanh_mode(dtype, device_type))
    return dict(
        BWD_DOT_PRECISION=_fp32_dot_precision(device_type) if fp32_dots != "ieee" else "ieee",
        DOT_UPCAST=device_type == "cpu",
        # Not the approximation for gelu: its fast form (the tanh form) is biased by up to 5e-4, and
        # recomputing z with it flipped relu masks of the exact chain: dW 1e-2 off float64 in bf16
        # on the H100.
        FAST_TANH=_tanh_mode(dtype, device_type, backward=True,
                             exact="gelu" in (chain.activation, chain.out_activation)))


def _num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; the interpreter counts 2, so its tests walk several tiles a program."""
    if device.type != "cuda":
        return 2
    return _SMS.get(device.index) or _SMS.setdefault(device.index, torch.cuda.get_device_properties(device).multi_processor_count)


_SMS: dict = {}


def _config_device(device: torch.device):
    return "cpu" if device.type == "cpu" else (device.index if device.index is not None else torch.cuda.current_device())


def _feature_major(t: torch.Tensor, feature_dim: int) -> tuple[int, int]:
    """(stride over features, stride over rows) of a 3D tensor in either layout."""
    return (t.stride(0), t.stride(1)) if feature_dim == 0 else (t.stride(1), t.stride(0))


def _param_stride(p: Optional[torch.Tensor], per_feature_ndim: int) -> int:
    """Stride over features of an optional parameter; 0 broadcasts a shared one."""
    if p is None or p.dim() != per_feature_ndim:
        return 0
    return p.stride(0)


def column_alignment(D: int, *strides: int) -> int:
    """The power of two (at most 16) that D and every given stride are multiples of: what a kernel
    with masked columns may state about them (`kernels._multiple_of`) so that its column loads
    vectorise. A claim that is not true would misalign vector accesses, so every stride the
    kernel states it for is passed here.

    Example:
        >>> column_alignment(24, 24, 1536), column_alignment(24, 25, 1536), column_alignment(160, 0, 10240)
        (8, 1, 16)
    """
    g = math.gcd(D, *strides)
    return min(16, g & -g) if g else 16


def _aligned_columns(align: int) -> dict:
    """The ``D_ALIGN`` constexpr of a kernel whose columns are masked, where it says something new:
    Triton already specialises integer arguments that are multiples of 16 (so the grid's D = 48,
    160 compile as before)."""
    return {"D_ALIGN": align} if align < 16 else {}


def _relu_mask_words(D: int, H: int, dtype: torch.dtype, device, chain, fwd_block_h: int) -> int:
    """Words (32 bits) of relu mask a training forward saves per row beside the row stats, 0 for
    none: where the backward would otherwise recompute z with a dot (its tl.dot paths), reading
    4-8 bytes a row saves that dot and t's parts for it (`kernels._load_relu_mask`). The mask is
    that of z to ~fp32 accuracy, as the backward's recomputed z: a 16-bit forward adds the product
    of t's rounding error (`kernels._lo_part_product`; y keeps its bits). Taken from the forward's
    16-bit z alone it flipped z within ~1e-3 of 0 and moved bf16 gradients from ~3e-3 to ~3e-2 off
    float64 (as PyTorch's own bf16 autograd is). That forward (``MASK_LO_PART=False``, only
    benchmarks/ab_relu_mask.py sets it) is 20-30% faster on the H200 at D = 160-512 H = 16/64:
    kept out, for the tests' 1e-2 bound (benchmarks/NOTES.md, thirty-second session)."""
    if chain.out_activation != "relu" or chain.norm is None or not H <= fwd_block_h <= 64:
        return 0
    min_d = configs.relu_mask_min_d(dtype)
    if min_d is None:
        return 0
    bwd = configs.backward_config(D, H, dtype, _config_device(device))
    if bwd is None or not bwd.use_dot:
        return 0
    # The two-pass backward has no whole row to recompute z from, and the two-part row backward
    # (`kernels.ln_tanh_linear_relu_bwd_rows2_dot`) and the GEMM backward take none: they need the
    # mask at any D.
    if D < min_d and not bwd.two_pass and not bwd.gemm and not (bwd.row_parts and configs.row_parts_dot_fits(D)):
        return 0
    return max(1, fwd_block_h // 32)


def _weight_strides(weight: torch.Tensor) -> tuple[int, int]:
    """(feature stride, row stride) of a shared [H, D] or per-feature [F, H, D] weight."""
    return weight.stride(0) if weight.dim() == 3 else 0, weight.stride(-2)


def _sizes(x: torch.Tensor, weight: torch.Tensor, feature_dim: int) -> tuple[int, int, int, int]:
    F = x.shape[feature_dim]
    B = x.shape[1 - feature_dim]
    return F, B, x.shape[2], weight.shape[-2]


def _contiguous_rows(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return p if p is None or p.stride(-1) == 1 else p.contiguous()


# ---------------------------------------------------------------------------------------------
# forward


@dataclasses.dataclass
class ForwardPlan:
    """Everything a forward call of one signature needs but its tensors.

    ``grid``, ``meta`` and ``cfg.num_warps`` are what the kernel is launched with; tests read them
    to check which path a shape takes.
    """

    cfg: configs.ForwardConfig
    launcher: CompiledLaunchCache
    grid: tuple
    ints: tuple  # every non-tensor runtime argument, in kernel order after the 7 tensors
    meta: dict
    y_shape: tuple
    stats_shape: Optional[tuple]
    bound: Optional[Callable] = None  # the compiled kernel, bound after the first launch
    empty: bool = False  # y has no elements (B == 0 or F == 0): nothing to launch

    def __post_init__(self):
        self.empty = 0 in self.y_shape

    def __call__(self, x, weight, bias, ln_weight, ln_bias, y_shape=None):
        # ``y_shape``: y's memory as another contiguous shape (a [B, F*H] buffer for [B, F, H]);
        # x may likewise be any tensor whose data pointer, dtype and device are the planned x's
        # (the [B, F*D] buffer the planned [B, F, D] view is of): the kernel reads pointers and
        # the plan's strides only.
        y = x.new_empty(self.y_shape if y_shape is None else y_shape)
        stats = x.new_empty(self.stats_shape, dtype=torch.float32) if self.stats_shape is not None else None
        if self.empty:
            return y, stats
        dummy = weight  # never read: the HAS_* flags are False for absent parameters
        tensors = (x, weight, bias if bias is not None else dummy, ln_weight if ln_weight is not None else dummy,
                   ln_bias if ln_bias is not None else dummy, y, stats if stats is not None else dummy)
        if _TRACE is not None:
            _TRACE.append(("forward", self.grid, self.meta, self.launcher is _launch_fwd))
        if self.bound is not None:
            self.bound(*tensors)
        else:
            args = tensors + self.ints
            options = launch_options(self.cfg)
            self.launcher(self.grid, args, self.meta, **options)
            self.bound = self.launcher.bind(self.grid, args, self.meta, len(tensors), **options)
        return y, stats


def forward_plan(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats=False,
                 chain=DEFAULT) -> ForwardPlan:
    """The launch plan of a forward call (built on a signature's first call, then cached).

    Parameters must have contiguous rows (stride 1 in their last dim), as `forward` ensures.

    Example:
        >>> import torch
        >>> plan = forward_plan(torch.randn(3, 64, 256), torch.randn(1, 256), None, None, None, 1e-5, 0)
        >>> plan.meta["BLOCK_D"], plan.grid[1]
        (256, 3)
    """
    if configs.override_active():
        return _build_forward_plan(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats, chain)
    key = signature(x, weight, bias, ln_weight, ln_bias, eps, feature_dim) + (save_stats, chain)
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = _FORWARD_PLANS[key] = _build_forward_plan(x, weight, bias, ln_weight, ln_bias, eps, feature_dim,
                                                         save_stats, chain)
    return plan


_FORWARD_PLANS: dict = BoundedDict()  # per call signature; bounded (every batch size is one)
# (D, H, dtype, device type) whose persistent forward config did not fit the device.
_FWD_NOT_PERSISTENT: set = set()
# Keyed by `_forward_unfit_key`: forward variants whose tl.dot operands did not fit this device's
# shared memory with their precision's operand copies (3xTF32 keeps hi/lo copies), and those that
# did not fit even with plain fp32 FMA dots (the composite runs them).
_FWD_PRECISION: dict = {}
_FWD_UNFIT: set = set()


def _forward_unfit_key(x: torch.Tensor, weight: torch.Tensor, chain, full_tiles: bool) -> tuple:
    """`_unfit_key` of a forward kernel variant: full and masked tiles have configs of their own."""
    return _unfit_key(x, weight, chain) + (full_tiles,)


# CUDA's limit on a grid's second and third axes.
_MAX_GRID_YZ = 65535


def features_first(sxf: int, sxb: int, row_programs: int, F: int) -> bool:
    """Whether the forward's (row programs, F) programs may launch on an (F, row programs) grid
    (`kernels._row_program`'s FEATURES_FIRST; `configs.forward_features_first` says where it
    does): where x holds a row's features side by side (its feature stride below its batch
    stride: torchrec's [B, F*D] buffer), so that the programs the hardware runs at once (the
    grid's first axis fastest) read whole spans of rows, not one feature's D-wide pieces F*D
    apart. The row programs must fit the grid's second axis.

    Example:
        >>> features_first(64, 64 * 26, 500, 26), features_first(64 * 1000, 64, 500, 26)  # [B, F*D], [F, B, D]
        (True, False)
    """
    return F > 1 and sxf < sxb and row_programs <= _MAX_GRID_YZ


def row_programs(grid: tuple, meta: dict) -> int:
    """The row programs per feature of a forward launch's ``grid`` and ``meta``."""
    return grid[1] if meta.get("FEATURES_FIRST") else grid[0]


def _build_forward_plan(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats,
                        chain=DEFAULT) -> ForwardPlan:
    F, B, D, H = _sizes(x, weight, feature_dim)
    save_stats = save_stats and chain.norm is not None  # without a norm there are no row stats
    dev = x.device
    cfg = configs.forward_config(D, H, x.dtype, _config_device(dev))
    even_d = D == cfg.block_d
    even_b = B > 0 and B % cfg.block_b == 0
    if not (even_d and even_b):
        # Masked tiles have their own config, and EVEN_B is that config's: its tiles may be longer
        # than the full-tile config's. (EVEN_B of the full-tile block_b once launched 64-row
        # tiles unmasked at B=1000, fp32 D=160 H=2-4 on the H100: rows past B read and written,
        # y and every gradient wrong.)
        cfg = configs.forward_config(D, H, x.dtype, _config_device(dev), full_tiles=False)
        even_b = B > 0 and B % cfg.block_b == 0
    if cfg.persistent and (D, H, x.dtype, dev.type) in _FWD_NOT_PERSISTENT:
        cfg = dataclasses.replace(cfg, persistent=0, tile_stages=1)
    y_shape = (F, B, H) if feature_dim == 0 else (B, F, H)
    # y's strides follow from its shape (a fresh contiguous tensor).
    syf, syb = (B * H, H) if feature_dim == 0 else (H, F * H)
    n_tiles = triton.cdiv(B, cfg.block_b)
    persistent = cfg.persistent > 0 and H <= cfg.block_h
    n_programs = n_tiles
    if persistent:
        n_programs = max(1, min(n_tiles, triton.cdiv(cfg.persistent * _num_sms(dev), max(F, 1))))
    sxf, sxb = _feature_major(x, feature_dim)
    by_features = configs.forward_features_first(cfg, x.element_size()) and features_first(sxf, sxb, n_programs, F)
    # More features than a grid's second axis holds (a CUDA launch error on the (row programs,
    # F) grid): features first, whatever the layout; the kernel reads either order.
    by_features = by_features or F > _MAX_GRID_YZ
    grid = (F, n_programs) if by_features else (n_programs, F)
    ints = (
        B, D, H, F * B,
        sxf, sxb, x.stride(2),
        *_weight_strides(weight),
        _param_stride(bias, 2), _param_stride(ln_weight, 2), _param_stride(ln_bias, 2),
        syf, syb,
        float(eps),
    )
    # Chunks need no column masks where D is a whole number of them (also a D that is not a power
    # of two); otherwise the last is masked (`MASK_K`). Without tl.dot (H <= 4, the row reduction
    # or broadcast sum) too, unless one column at a time.
    chunked = bool(cfg.block_k) and H <= cfg.block_h and (cfg.use_dot or not cfg.unroll_h)
    mask_k = chunked and D % cfg.block_k != 0
    norm, act, out_act = chain_codes(chain)
    meta = dict(
        HAS_BIAS=bias is not None, HAS_LNW=ln_weight is not None, HAS_LNB=ln_bias is not None,
        NORM=norm, ACT=act, OUT_ACT=out_act,
        USE_DOT=cfg.use_dot, **device_constexprs("forward", x.dtype, dev.type, chain),
        SAVE_STATS=save_stats, EVEN_D=even_d, EVEN_B=even_b, X_EVICT=cfg.x_evict,
        PERSISTENT=persistent, TILE_STAGES=cfg.tile_stages,
        BLOCK_B=cfg.block_b, BLOCK_D=cfg.block_d, BLOCK_H=cfg.block_h,
        BLOCK_K=cfg.block_k if chunked else cfg.block_d, K_CHUNKS=triton.cdiv(D, cfg.block_k) if chunked else 1,
        K_LOOP=cfg.k_loop if chunked else 0,
    )
    if mask_k:
        meta["MASK_K"] = True
    if by_features:
        meta["FEATURES_FIRST"] = True
    if (mask_k if chunked else not even_d):  # columns masked: state their alignment
        meta.update(_aligned_columns(column_alignment(D, sxf, sxb, *_weight_strides(weight),
                                                      _param_stride(ln_weight, 2), _param_stride(ln_bias, 2))))
    if cfg.use_dot and _FWD_PRECISION.get(_forward_unfit_key(x, weight, chain, even_d and even_b)) == "ieee":
        meta["DOT_PRECISION"] = "ieee"
    mask_words = _relu_mask_words(D, H, x.dtype, dev, chain, cfg.block_h) if save_stats else 0
    if mask_words:
        meta["SAVE_MASK"] = True
    # With saved stats and contiguous y rows (H=1, [F, B, 1]) Triton's "== 1" specialisation of
    # the y row stride compiled to a slow store layout on the H100; that case takes the copy of
    # the kernel compiled without it (benchmarks/NOTES.md).
    launcher = _launch_fwd_y_strided if save_stats and syb == 1 else _launch_fwd
    return ForwardPlan(cfg, launcher, grid, ints, meta, y_shape,
                       (2 + mask_words, F, B) if save_stats else None)


def forward(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats=False, key=None, chain=DEFAULT):
    """Run the fused forward kernel; returns y in x's layout with D replaced by H.

    With ``save_stats`` returns ``(y, stats)``: stats is [2, F, B] fp32, every row's LayerNorm
    mean and rstd, for `backward` to read instead of recomputing (8 bytes a row: O(F*B)); None
    for a chain without a norm. Where the backward would recompute z for relu's mask, the
    mask's bits follow as 1-2 more planes ([2 + words, F, B], `_relu_mask_words`).
    ``key``: the call's `signature`, when the caller has it already.

    Example:
        >>> import torch
        >>> y = forward(torch.randn(3, 64, 256), torch.randn(1, 256), None, None, None, 1e-5, 0)  # doctest: +SKIP
    """
    if key is not None and not configs.override_active():
        plan = _FORWARD_PLANS.get(key + (save_stats, chain))
        if plan is not None:  # a stored plan's parameters had contiguous rows, so these do too
            try:
                y, stats = plan(x, weight, bias, ln_weight, ln_bias)
                return (y, stats) if save_stats else y
            except OutOfResources:
                pass  # a plan built but never launched (`forward_plan` called on its own): handled below
    weight = _contiguous_rows(weight)
    bias, ln_weight, ln_bias = _contiguous_rows(bias), _contiguous_rows(ln_weight), _contiguous_rows(ln_bias)
    plan = forward_plan(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats, chain)
    unfit_key = _forward_unfit_key(x, weight, chain, plan.meta["EVEN_D"] and plan.meta["EVEN_B"])
    if unfit_key in _FWD_UNFIT:
        # Not kept for the signature's later calls: its fast path above would launch it.
        _FORWARD_PLANS.pop(signature(x, weight, bias, ln_weight, ln_bias, eps, feature_dim) + (save_stats, chain), None)
        return _composite_forward_logged(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats,
                                         "the forward kernel does not fit this device for", unfit_key, chain)
    try:
        y, stats = plan(x, weight, bias, ln_weight, ln_bias)
    except OutOfResources as err:
        # Found at compile time, before anything ran. Each step needs fewer resources: the tiles
        # in flight of a persistent config go (one program per tile needs one tile's worth), then
        # fp32's 3xTF32 operand copies (plain fp32 FMA dots, found by the H100 property test at
        # fp32 H >= 40 with 512-1024-wide rows: 401-659 KB of shared memory), then the composite
        # (16-bit whole rows of D=1024 H=64 needed 405 KB on the H100).
        D, H = x.shape[2], weight.shape[-2]
        _FORWARD_PLANS.clear()
        if plan.meta["PERSISTENT"]:
            log.warning("recfuse: forward D=%d H=%d %s: %s; using one program per tile", D, H, x.dtype, err)
            _FWD_NOT_PERSISTENT.add((D, H, x.dtype, x.device.type))
        elif plan.meta["USE_DOT"] and plan.meta["DOT_DTYPE"] == tl.float32 and plan.meta["DOT_PRECISION"] != "ieee":
            log.warning("recfuse: forward D=%d H=%d %s: %s; retrying with fp32 FMA dots", D, H, x.dtype, err)
            _FWD_PRECISION[unfit_key] = "ieee"
        else:
            _FWD_UNFIT.add(unfit_key)
            return _composite_forward_logged(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats,
                                             f"the forward kernel ran out of resources ({err}) for", unfit_key,
                                             chain)
        return forward(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats, chain=chain)
    return (y, stats) if save_stats else y


def _composite_forward_logged(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats, why, key, chain):
    from ..reference import batched_feature_mlp

    level = logging.DEBUG if key in _WARNED else logging.WARNING  # once per shape, not per call
    _WARNED.add(key)
    log.log(level, "recfuse: %s D=%d, H=%d, %s; using the torch composite forward", why, key[0], key[1], x.dtype)
    y = batched_feature_mlp(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, chain)
    return (y, None) if save_stats else y


# ---------------------------------------------------------------------------------------------
# backward


@dataclasses.dataclass
class BackwardPlan:
    """Everything a backward call of one signature needs but its tensors: the fused backward
    kernel's grid, arguments and constexprs, and the reduction kernel's."""

    cfg: configs.BackwardConfig
    grid: tuple
    ints: tuple
    meta: dict
    partial_shape: tuple
    reduce_grid: tuple
    reduce_ints: tuple
    reduce_meta: dict
    zero_dx: bool
    launcher: CompiledLaunchCache = _launch_bwd
    # The weight-gradient kernel (`BackwardConfig.split_dw`), or None where the fused kernel
    # makes the weight gradient: its grid, integers, constexprs and launch options, and the
    # dz buffer ([F, B, H], `dz_dtype`) and row-stats buffer ([2, F, B] fp32) it reads.
    weight_grid: Optional[tuple] = None
    weight_ints: tuple = ()
    weight_meta: Optional[dict] = None
    weight_options: Optional[dict] = None
    dz_shape: tuple = ()
    dz_dtype: Optional[torch.dtype] = None
    stats_shape: Optional[tuple] = None
    reads_stats: bool = False  # the forward's stats go to the kernels (LOAD_STATS or LOAD_MASK)
    # The two-pass backward (`BackwardConfig.two_pass`): its first pass writes the row sums into
    # the dz buffer ([n_chunks, 2, F, B] fp32); the second (in the weight kernel's slot) takes the
    # first's arguments and writes dx and the partials.
    two_pass: bool = False
    weight_launcher: Optional[CompiledLaunchCache] = None  # None: `_launch_bwd_weight`, looked up per call
    bound: Optional[Callable] = None  # the compiled kernels, bound after the first launch
    bound_reduce: Optional[Callable] = None
    bound_weight: Optional[Callable] = None

    def __call__(self, grad_y, x, weight, bias, ln_weight, ln_bias, stats):
        # dx in x's own strides: when x is a view (a [B, F*D] buffer seen as [F, B, D]),
        # autograd's view backward hands the base's gradient over without a copy of x's size.
        dx = torch.empty_like(x)
        partial = x.new_empty(self.partial_shape, dtype=torch.float32)
        dz = partial
        if self.weight_meta is not None:
            dz = x.new_empty(self.dz_shape, dtype=self.dz_dtype)
            if stats is None and self.stats_shape is not None:
                stats = x.new_empty(self.stats_shape, dtype=torch.float32)  # the fused kernel writes it
        # A fresh tensor per gradient (a custom op's outputs may not alias each other), in the
        # parameter's dtype and contiguous shape: autograd takes it as .grad without a copy.
        # (`_empty_or_like` of each, written out: this runs on every backward.)
        contiguous = torch.contiguous_format
        gw = torch.empty_like(weight, memory_format=contiguous)
        gb = x.new_empty((0,)) if bias is None else torch.empty_like(bias, memory_format=contiguous)
        glw = x.new_empty((0,)) if ln_weight is None else torch.empty_like(ln_weight, memory_format=contiguous)
        glb = x.new_empty((0,)) if ln_bias is None else torch.empty_like(ln_bias, memory_format=contiguous)
        if self.partial_shape[0] == 0:  # F == 0 (F * P partial rows, P >= 1)
            for g in (gw, gb, glw, glb):
                g.zero_()
            return dx, gw, gb, glw, glb
        if _TRACE is not None:
            _TRACE.append(("backward", self.grid, self.meta, self.cfg))
        stats = stats if stats is not None else partial
        lnw = ln_weight if ln_weight is not None else weight
        lnb = ln_bias if ln_bias is not None else weight
        tensors = (grad_y, x, weight, bias if bias is not None else weight, lnw, lnb, dx, partial, stats, dz)
        reduce_tensors = (partial, gw, gb if bias is not None else gw, glw if ln_weight is not None else gw,
                          glb if ln_bias is not None else gw)
        split = self.weight_meta is not None
        weight_tensors = None
        if split:
            weight_tensors = tensors if self.two_pass else (x, dz, stats, lnw, lnb, partial, weight)
        if self.bound is not None and self.bound_reduce is not None and (self.bound_weight is not None or not split):
            self.bound(*tensors)
            if split:
                self.bound_weight(*weight_tensors)
            self.bound_reduce(*reduce_tensors)
        else:
            options = launch_options(self.cfg)
            self.launcher(self.grid, tensors + self.ints, self.meta, **options)
            if split:
                weight_launcher = self.weight_launcher or _launch_bwd_weight
                weight_launcher(self.weight_grid, weight_tensors + self.weight_ints, self.weight_meta,
                                **self.weight_options)
            _launch_partials_to_grads(self.reduce_grid, reduce_tensors + self.reduce_ints, self.reduce_meta)
            self.bound = self.launcher.bind(self.grid, tensors + self.ints, self.meta, len(tensors), **options)
            if split:
                self.bound_weight = weight_launcher.bind(self.weight_grid, weight_tensors + self.weight_ints,
                                                         self.weight_meta, len(weight_tensors),
                                                         **self.weight_options)
            self.bound_reduce = _launch_partials_to_grads.bind(
                self.reduce_grid, reduce_tensors + self.reduce_ints, self.reduce_meta, len(reduce_tensors))
        if self.zero_dx:
            # LayerNorm over one element is constant in x: dx is exactly zero. Computed, it is an
            # ulp of rounding (the kernel's two uses of dxhat may round apart) times eps**-0.5.
            dx.zero_()
        return dx, gw, gb, glw, glb


def launch_options(cfg: configs.TileConfig) -> dict:
    """The launch options of a config's kernel (the backward's fused or first kernel): warps, the
    backward's pipelining depth (the forward takes Triton's default) and the register cap
    (`TileConfig.maxnreg`, left out at 0: the compiler's choice).

    Example:
        >>> launch_options(configs.heuristic_backward(256, 16, torch.float32, maxnreg=168))["maxnreg"]
        168
        >>> launch_options(configs.heuristic_forward(256, 1, torch.float32))
        {'num_warps': 1}
    """
    options = dict(num_warps=cfg.num_warps)
    if isinstance(cfg, configs.BackwardConfig):
        options["num_stages"] = cfg.num_stages
    if cfg.maxnreg:
        options["maxnreg"] = cfg.maxnreg
    return options


def _empty_or_like(p, x):
    return x.new_empty((0,)) if p is None else torch.empty_like(p, memory_format=torch.contiguous_format)


_BACKWARD_PLANS: dict = BoundedDict()
# Keyed by `_unfit_key` (D, H, dtype, weight rank, device type, chain): shapes whose backward kernel does not fit
# this device at all, and shapes that fit only with plain fp32 dots.
_BWD_UNFIT: set = set()
_BWD_PRECISION: dict = {}
_WARNED: set = set()


def backward_plan(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats=None,
                  chain=DEFAULT) -> Optional[BackwardPlan]:
    """The launch plan of a backward call, or None where the composite backward does the shape.

    Example:
        >>> import torch
        >>> x, w = torch.randn(3, 64, 256), torch.randn(1, 256)
        >>> plan = backward_plan(torch.randn(3, 64, 1), x, w, None, None, None, 1e-5, 0)
        >>> plan.meta["USE_DOT"], plan.grid[1]
        (False, 3)
    """
    if configs.override_active():
        return _build_backward_plan(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats, chain)
    key = (_tensor_signature(grad_y),) + signature(x, weight, bias, ln_weight, ln_bias, eps, feature_dim) + (
        stats_planes(stats), chain)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = _build_backward_plan(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats, chain)
        if plan is not None:
            _BACKWARD_PLANS[key] = plan
    return plan


def _build_backward_plan(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats, chain=DEFAULT,
                         cfg: Optional[configs.BackwardConfig] = None):
    F, B, D, H = _sizes(x, weight, feature_dim)
    dev = x.device
    cfg = cfg or configs.backward_config(D, H, x.dtype, _config_device(dev))
    unfit_key = _unfit_key(x, weight, chain)
    # The backward grids hold F on a second or third axis (at most 65535 programs on CUDA).
    if cfg is None or unfit_key in _BWD_UNFIT or F > _MAX_GRID_YZ:
        return None
    norm, act, out_act = chain_codes(chain)
    has_mask = out_act == ACTIVATIONS["relu"] and stats_planes(stats) > 2
    if cfg.gemm:
        if F == 0 or not gemm_backward.gemm_backward_eligible(grad_y, x, weight, (bias, ln_weight, ln_bias), norm,
                                                              out_act, has_mask, stats):
            # no stats or mask (a compiled backward, another chain), or mixed dtypes
            fused_cfg = configs.fused_backward_config(D, H, x.dtype)
            return None if fused_cfg is None else _build_backward_plan(
                grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats, chain, cfg=fused_cfg)
        return gemm_backward.build(
            cfg, grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, F, B, D, H, _num_sms(dev), _feature_major,
            _param_stride, norm, act, device_constexprs("backward", x.dtype, dev.type, chain)["FAST_TANH"],
            has_mask, F * B, _dot_args(x.dtype, dev.type), zero_dx=D == 1 and chain.norm == "layer_norm",
            tracer=_current_trace)
    # Two passes over column chunks need the forward's row stats and dz without z (its relu mask).
    two_pass = (cfg.use_dot and cfg.two_pass > 0 and not cfg.block_k and B > 0 and (has_mask or out_act == 0)
                and (norm == 0 or stats is not None))
    # The tl.dot path on two unmasked power-of-two parts of each row likewise needs them.
    rows2_dot = (cfg.use_dot and bool(cfg.row_parts) and not cfg.block_k and not cfg.two_pass and not cfg.split_dw
                 and configs.row_parts_dot_fits(D) and B > 0 and (has_mask or out_act == 0)
                 and (norm == 0 or stats is not None))
    if (cfg.two_pass and not two_pass) or (cfg.use_dot and cfg.row_parts and not rows2_dot):
        # No stats or mask (a compiled backward, another out-activation): the entry's tiles were
        # tuned on column chunks (or row parts), and whole rows of that many may not fit; the
        # fused kernels' heuristic config does (not the GEMM backward's: it needs them too).
        cfg = configs.fused_backward_config(D, H, x.dtype)
        if cfg is None:
            return None
    chunked = cfg.use_dot and 0 < cfg.block_k < cfg.block_d
    load_mask = cfg.use_dot and has_mask
    if two_pass or rows2_dot:
        load_stats = norm != 0
    elif cfg.use_dot and not chunked:
        # The whole-row tl.dot backward recomputes the row stats: reading them was slower at 5 of
        # 9 shapes measured on the H100 (bf16 D=64 H=64 1193 -> 1455 us, fp32 D=128 H=16 786 -> 1282).
        # The "dx 3e-3 off with saved stats" once seen there was a relu tie, not a bug: both
        # ways flip a z within rounding of 0 now and then (benchmarks/NOTES.md).
        stats = None if not load_mask else stats
        load_stats = False
    else:
        load_stats = stats is not None
    split = cfg.use_dot and not chunked and cfg.split_dw > 0 and not two_pass
    K = configs.partial_row_size(D, H)
    n_chunks = triton.cdiv(D, cfg.two_pass) if two_pass else 1
    P = configs.programs_per_feature(cfg, F, B, D, H, x.numel() * x.element_size(), _num_sms(dev),
                                     column_chunks=n_chunks) if B > 0 else 1
    # Both kernels of a split backward walk the same rows per program: a whole number of either's tiles.
    row_tile = max(cfg.block_b, cfg.dw_block_b) if split or two_pass else cfg.block_b
    rows_per_program = triton.cdiv(triton.cdiv(max(B, 1), P), row_tile) * row_tile
    P = triton.cdiv(max(B, 1), rows_per_program)
    sxf, sxb = _feature_major(x, feature_dim)
    sgf, sgb = _feature_major(grad_y, feature_dim)
    # dx = empty_like(x): x's strides when x is dense (non-overlapping and dense), else contiguous.
    dx_strides = torch.empty_like(x, device="meta").stride()
    sdf, sdb = (dx_strides[0], dx_strides[1]) if feature_dim == 0 else (dx_strides[1], dx_strides[0])
    swf, swh = _weight_strides(weight)
    # What a kernel with masked columns may state about D and the row strides (`column_alignment`).
    d_align = column_alignment(D, sxf, sxb, sdf, sdb, swf, swh, _param_stride(ln_weight, 2), _param_stride(ln_bias, 2))
    ints = (
        B, D, H, rows_per_program, F * B,
        sxf, sxb, x.stride(2),
        sgf, sgb, grad_y.stride(2),
        sdf, sdb, dx_strides[2],
        swf, swh,
        _param_stride(bias, 2), _param_stride(ln_weight, 2), _param_stride(ln_bias, 2),
        K,
        float(eps), 1.0 / D if D else 0.0,
    )
    # A shape whose dots did not fit this device takes plain fp32 FMA dots ("ieee", `backward`).
    fp32_dots = _BWD_PRECISION.get(unfit_key, cfg.fp32_dots)
    meta = dict(
        HAS_BIAS=bias is not None, HAS_LNW=ln_weight is not None, HAS_LNB=ln_bias is not None,
        NORM=norm, ACT=act, OUT_ACT=out_act,
        USE_DOT=cfg.use_dot, BWD_DOT_DTYPE=_bwd_dot_dtype(x.dtype, weight.dtype, fp32_dots),
        **device_constexprs("backward", x.dtype, dev.type, chain, fp32_dots),
        **_bwd_splits(x.dtype, fp32_dots, chain.out_activation),
        LOAD_STATS=load_stats,
        # The K-chunked kernel walks chunks up to D: its columns are all real when D is a whole
        # number of chunks.
        EVEN_D=D % cfg.block_k == 0 if chunked else D == cfg.block_d,
        EVEN_B=B > 0 and B % rows_per_program == 0, X_EVICT=cfg.x_evict,
        BLOCK_B=cfg.block_b, BLOCK_D=cfg.block_d, BLOCK_H=cfg.block_h,
    )
    if load_mask:
        meta["LOAD_MASK"] = True
    if chunked:
        meta["BLOCK_K"] = cfg.block_k
    elif cfg.prefetch and B > 0:
        meta["PREFETCH"] = True
    elif cfg.unroll_h and not cfg.use_dot and 2 <= cfg.block_h <= 8:
        meta["UNROLL_H"] = True
    if not chunked:
        if cfg.loop_stages > 0 and B > 0:
            meta["LOOP_STAGES"] = cfg.loop_stages
        if not cfg.use_dot and (cfg.block_h == 1 or meta.get("UNROLL_H")):
            if cfg.col_sums:
                meta["COL_SUMS"] = True
            elif 0 < cfg.row_slots < cfg.block_b:
                meta["ROW_SLOTS"] = cfg.row_slots
        elif cfg.use_dot and cfg.row_slots and not (two_pass or rows2_dot or cfg.split_ln):
            meta["ROW_SLOTS"] = cfg.row_slots
    per_feature = (weight.dim() == 3,
                   bias is not None and bias.dim() == 2,
                   ln_weight is not None and ln_weight.dim() == 2,
                   ln_bias is not None and ln_bias.dim() == 2)
    block_k = configs.REDUCE_BLOCK_K
    # One axis (`kernels.partials_to_grads`): feature 0's blocks (they also make every shared
    # parameter's sum), then each other feature's from the first block holding a per-feature column.
    segments = ((per_feature[0], 0), (per_feature[1], H * D), (per_feature[2], H * D + H),
                (per_feature[3], H * D + H + D))
    first_pf_block = min((start // block_k for on, start in segments if on), default=0)
    n_blocks = triton.cdiv(K, block_k)
    reduce_grid = (n_blocks + (max(F, 1) - 1) * (n_blocks - first_pf_block) if any(per_feature) else n_blocks,)
    reduce_meta = dict(
        HAS_BIAS=bias is not None, HAS_LNW=ln_weight is not None, HAS_LNB=ln_bias is not None,
        W_PER_F=per_feature[0], B_PER_F=per_feature[1], LNW_PER_F=per_feature[2],
        LNB_PER_F=per_feature[3], ANY_PER_F=any(per_feature), ANY_SHARED=not all(per_feature),
        BLOCK_J=configs.REDUCE_BLOCK_J, BLOCK_K=block_k,
    )
    launcher = _launch_bwd_chunked if chunked else _launch_bwd
    parts = configs.row_parts_of(D)
    if rows2_dot or (cfg.row_parts and parts and H == 1 and not cfg.use_dot and not meta.get("UNROLL_H")
                     and (load_stats or norm == 0)):
        # two unmasked power-of-two parts of each row (`kernels.ln_tanh_linear_relu_bwd_rows2`,
        # and `..._rows2_dot` on the tl.dot path)
        for name in ("PREFETCH", "UNROLL_H", "COL_SUMS", "ROW_SLOTS"):
            meta.pop(name, None)
        meta.update(BLOCK_D=parts[0], BLOCK_D2=parts[1], EVEN_D=True)
        launcher = _launch_bwd_rows2_dot if rows2_dot else _launch_bwd_rows2
    elif not meta["EVEN_D"]:
        meta.update(_aligned_columns(d_align))
    plan = BackwardPlan(cfg, (P, F), ints, meta, (F * P, K), reduce_grid, (F, P, K, H, D, first_pf_block), reduce_meta,
                        zero_dx=D == 1 and chain.norm == "layer_norm", launcher=launcher,
                        reads_stats=load_stats or load_mask)
    if split:
        _add_weight_kernel(plan, grad_y, x, weight, ln_weight, ln_bias, F, B, D, H, rows_per_program, sxf, sxb,
                           d_align)
    if two_pass:
        _make_two_pass(plan, F, B, D, P, d_align)
    return plan


def _make_two_pass(plan: BackwardPlan, F: int, B: int, D: int, P: int, d_align: int):
    """Make `plan` the two-pass backward (`BackwardConfig.two_pass`): the row-sums pass in the
    fused kernel's slot, the dx-and-partials pass in the weight kernel's, both
    `kernels.ln_tanh_linear_relu_bwd_two_pass` on a grid of (column chunks, row programs,
    features) and the fused kernel's arguments."""
    cfg, meta = plan.cfg, plan.meta
    n_chunks = triton.cdiv(D, cfg.two_pass)
    common = {k: meta[k] for k in ("HAS_BIAS", "HAS_LNW", "HAS_LNB", "NORM", "ACT", "OUT_ACT", "BWD_DOT_PRECISION",
                                   "BWD_DOT_DTYPE", "DOT_UPCAST", "SPLIT_DT", "SPLIT_DW", "FAST_TANH", "EVEN_B",
                                   "X_EVICT", "BLOCK_H")}
    common.update(EVEN_D=D % cfg.two_pass == 0, BLOCK_K=cfg.two_pass, DW_FIRST=bool(cfg.dw_first))
    if not common["EVEN_D"]:
        common.update(_aligned_columns(d_align))
    plan.meta = dict(common, BLOCK_B=cfg.block_b, DX_PASS=False, LOOP_STAGES=cfg.loop_stages or None)
    plan.launcher = _launch_bwd_two_pass
    plan.grid = (n_chunks, P, F)
    plan.two_pass = True
    plan.reads_stats = True
    plan.weight_launcher = _launch_bwd_two_pass
    plan.weight_grid = plan.grid
    plan.weight_ints = plan.ints
    plan.weight_meta = dict(common, BLOCK_B=cfg.dw_block_b, DX_PASS=True)
    plan.weight_options = dict(num_warps=cfg.dw_num_warps, num_stages=cfg.dw_num_stages)
    plan.dz_shape = (n_chunks, 2, F, B)  # the row sums
    plan.dz_dtype = torch.float32
    plan.stats_shape = None


def _add_weight_kernel(plan: BackwardPlan, grad_y, x, weight, ln_weight, ln_bias, F, B, D, H, rows_per_program,
                       sxf, sxb, d_align):
    """Make `plan` a split backward: the fused kernel writes dz (and the row stats) instead of the
    weight gradient, which `kernels.ln_tanh_linear_relu_bwd_weight` makes from them."""
    cfg, meta = plan.cfg, plan.meta
    meta["DZ_OUT"] = True
    # dz as the fused kernel has it: grad_y's own values where dz is grad_y masked by relu (or
    # grad_y itself) and grad_y is in the dots' operand dtype, else fp32 (`DZ_EXACT` there).
    exact = meta["OUT_ACT"] in (0, 3) and _TL_DTYPES.get(grad_y.dtype) == meta["BWD_DOT_DTYPE"]
    plan.dz_dtype = grad_y.dtype if exact else torch.float32
    plan.dz_shape = (F, B, H)
    # The fused kernel writes the row stats unless the forward's are passed (LOAD_STATS, LOAD_MASK).
    plan.stats_shape = (2, F, B) if meta["NORM"] != 0 and not plan.reads_stats else None
    block_k = min(cfg.split_dw, cfg.block_d)
    plan.weight_grid = (plan.grid[0], F, triton.cdiv(D, block_k))
    plan.weight_ints = (B, D, H, rows_per_program, F * B, sxf, sxb, x.stride(2),
                        _param_stride(ln_weight, 2), _param_stride(ln_bias, 2), plan.ints[-3],
                        *_weight_strides(weight))
    # The LayerNorm affine's gradients move too (`BackwardConfig.split_ln`): the fused kernel then
    # has no column sums in its row loop.
    ln_grads = bool(cfg.split_ln) and meta["NORM"] != 0 and (meta["HAS_LNW"] or meta["HAS_LNB"])
    plan.weight_meta = dict(
        HAS_LNW=meta["HAS_LNW"], HAS_LNB=meta["HAS_LNB"], NORM=meta["NORM"], ACT=meta["ACT"],
        FAST_TANH=meta["FAST_TANH"], BWD_DOT_PRECISION=meta["BWD_DOT_PRECISION"],
        BWD_DOT_DTYPE=meta["BWD_DOT_DTYPE"], DOT_UPCAST=meta["DOT_UPCAST"], SPLIT_DW=meta["SPLIT_DW"],
        EVEN_D=D % block_k == 0, EVEN_B=B > 0 and B % rows_per_program == 0, X_EVICT=cfg.x_evict,
        BLOCK_B=cfg.dw_block_b, BLOCK_K=block_k, BLOCK_H=cfg.block_h,
    )
    if not plan.weight_meta["EVEN_D"]:
        plan.weight_meta.update(_aligned_columns(d_align))
    if ln_grads:
        plan.weight_meta.update(LN_GRADS=True, SPLIT_DT=meta["SPLIT_DT"])
        meta["LN_IN_WEIGHT"] = True
    plan.weight_options = dict(num_warps=cfg.dw_num_warps, num_stages=cfg.dw_num_stages)


def backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats=None, key=None, chain=DEFAULT):
    """Gradients (dx, dweight, dbias, dln_weight, dln_bias); empty tensors for absent parameters.

    ``stats``: the [2, F, B] mean/rstd a ``forward(..., save_stats=True)`` returned, read
    instead of recomputed; None recomputes them from x.

    Two launches: the fused backward kernel (dx and per-program partial sums) and the
    fixed-order reduction of the partials that writes every parameter gradient in its final
    shape and dtype. ``key``: the forward call's `signature`, when the caller has it already.

    Example:
        >>> gx, gw, gb, glw, glb = backward(gy, x, w, None, None, None, 1e-5, 0)  # doctest: +SKIP
    """
    if key is not None and not configs.override_active():
        plan = _BACKWARD_PLANS.get((_tensor_signature(grad_y),) + key + (stats_planes(stats), chain))
        if plan is not None:
            try:
                return plan(grad_y, x, weight, bias, ln_weight, ln_bias, stats if plan.reads_stats else None)
            except OutOfResources:
                pass  # a plan built but never launched (`backward_plan` called on its own): handled below
    weight = _contiguous_rows(weight)
    bias, ln_weight, ln_bias = _contiguous_rows(bias), _contiguous_rows(ln_weight), _contiguous_rows(ln_bias)
    plan = backward_plan(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats, chain)
    D, H = x.shape[2], weight.shape[-2]
    unfit_key = _unfit_key(x, weight, chain)
    if plan is None:
        return _composite_backward_logged(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim,
                                          f"{x.shape[feature_dim]} features, more than a CUDA grid axis holds:"
                                          if x.shape[feature_dim] > _MAX_GRID_YZ else
                                          "the backward kernel does not cover", unfit_key, chain)
    try:
        return plan(grad_y, x, weight, bias, ln_weight, ln_bias, stats if plan.reads_stats else None)
    except OutOfResources as err:
        # Found at compile time, before anything ran: fp32 H=64 D=256 3xTF32 (320 KB) and bf16x6
        # (244 KB) tiles need more shared memory than an H100 has (weight parts in two layouts).
        # Plain fp32 FMA dots keep one copy; past that the composite does this shape.
        _BACKWARD_PLANS.clear()
        if _BWD_PRECISION.get(unfit_key) != "ieee":
            log.warning("recfuse: backward D=%d H=%d %s: %s; retrying with fp32 FMA dots", D, H, x.dtype, err)
            _BWD_PRECISION[unfit_key] = "ieee"
            return backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats, chain=chain)
        _BWD_UNFIT.add(unfit_key)
        return _composite_backward_logged(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim,
                                          f"the backward kernel ran out of resources ({err}) for", unfit_key, chain)


def _composite_backward_logged(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, why, key, chain):
    from .composite import composite_backward

    D, H = key[0], key[1]
    level = logging.DEBUG if key in _WARNED else logging.WARNING  # once per shape, not per step
    _WARNED.add(key)
    log.log(level, "recfuse: %s D=%d, H=%d, %s; using the torch composite backward", why, D, H, x.dtype)
    return composite_backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, chain)
