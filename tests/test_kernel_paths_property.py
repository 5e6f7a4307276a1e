"""Property tests of three kernel paths, each forced with `configs.override` on drawn shapes, layouts,
parameter forms, chains, dtypes and knobs, through the op (forward, autograd backward) against float64:

* the split backward (`BackwardConfig.split_dw`): the whole-row tl.dot kernel writes dz and the row
  stats (DZ_OUT), `kernels.ln_tanh_linear_relu_bwd_weight` makes the weight gradient in column chunks;
* the forward's row path (no tl.dot, H <= 4) in whole chunks of D (`ForwardConfig.block_k` without
  use_dot: `kernels._chunked_norm_act_linear`, USE_DOT False), its saved row stats read by the
  backward that follows;
* the H = 1 backward over two unmasked power-of-two parts of each row (`BackwardConfig.row_parts`,
  `kernels.ln_tanh_linear_relu_bwd_rows2`), on the forward's saved row stats;
* its tl.dot path (`row_parts` with `use_dot`, `kernels.ln_tanh_linear_relu_bwd_rows2_dot`) at H >= 2,
  on the forward's saved row stats and relu mask, where D's second part is 32+ columns
  (`configs.row_parts_dot_fits`), and the fallback elsewhere.

Each example asserts the forced path ran (`launch.trace_launches` meta), y within `TOLERANCE` of
the float64 per-slice reference, and every gradient within `BACKWARD_TOLERANCE` of the float64
composite backward (16-bit: or no worse than 1.5x the composite backward run in that dtype,
`op_cases.assert_backward_close`); grad_y is zeroed where z is within 1e-3 of a relu kink.

Interpreter only (``make test-interpret``). Few derandomized examples a path by default, sizes
drawn within a budget of row tiles (the interpreter's cost is per program and per tile), plus
explicit examples of the largest shapes: 40-70 s for the file on 2 cores.
``RECFUSE_PATH_PROPERTY_EXAMPLES=N`` draws N a path (200 a path: ~8 minutes).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
import triton
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import recfuse
from recfuse.chain import DEFAULT as DEFAULT_CHAIN, Chain, chain_of
from recfuse.ops import configs, launch
from recfuse.ops.composite import composite_backward
from op_cases import TOLERANCE, Case, assert_backward_close, make_inputs, rel_err, run_op

pytestmark = pytest.mark.interpret

EXAMPLES = int(os.environ.get("RECFUSE_PATH_PROPERTY_EXAMPLES", "0"))


def _settings(default: int):
    # derandomize: the same examples on every run; each example draws its own tensor seed, so a
    # failing example replays with the same tensors.
    return settings(max_examples=EXAMPLES or default, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _wide_reduction_blocks():
    # The reduction of the backward's partial rows (`kernels.partials_to_grads`, the same for every
    # path here) in 256 columns a program instead of `configs.REDUCE_BLOCK_K`: the interpreter
    # pays per program, and at H=40 D=160 F=3 its 1269 programs were 29 of an example's 34 s.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(configs, "REDUCE_BLOCK_K", 256)
        yield


CHAINS = [DEFAULT_CHAIN, DEFAULT_CHAIN, chain_of("rms_norm", "silu", None), chain_of(None, "sigmoid", "relu"),
          chain_of("layer_norm", "gelu", "tanh"), chain_of("rms_norm", "relu", "gelu_tanh")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RELU_TIE = 1e-3


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One drawn problem: the case's shapes and parameter forms, the chain, the dtype, the seed of
    its tensors, and with ``d_outer`` x read through strides with D outermost (a [D, ...] buffer
    permuted: stride_x_d != 1)."""

    case: Case
    chain: Chain
    dtype: torch.dtype
    seed: int
    d_outer: bool = False


@st.composite
def cases(draw, D, H):
    """`Inputs`: F 1-3, B 1-70 (1 and tile remainders), the given D and H strategies, either
    layout (feature_dim 1 with or without a [B, F*D] view; D innermost or outermost), per-feature
    or shared weight, bias and norm affine, or none, eps 0 or 1e-5, fp32 / bf16 / fp16, a chain."""
    chain = draw(st.sampled_from(CHAINS))
    feature_dim = draw(st.sampled_from([0, 1]))
    case = Case(
        F=draw(st.integers(1, 3)),
        B=draw(st.integers(1, 70)),
        D=draw(D),
        H=draw(H),
        feature_dim=feature_dim,
        per_feature_weight=draw(st.booleans()),
        bias=draw(st.sampled_from(["none", "shared", "per_feature"])),
        ln="none" if chain.norm is None else draw(st.sampled_from(["none", "shared", "per_feature"])),
        eps=draw(st.sampled_from([0.0, 1e-5])),
        strided_view=feature_dim == 1 and draw(st.booleans()),
    )
    dtype = draw(st.sampled_from(DTYPES))
    d_outer = not case.strided_view and draw(st.sampled_from([False, False, True]))
    return Inputs(case, chain, dtype, draw(st.integers(0, 2 ** 16)), d_outer)


def path_inputs(inp: Inputs):
    """(args in dtype: x, weight, bias, ln_weight, ln_bias; grad_y in dtype). RMSNorm has no
    affine bias; all-closed relus (tiny cases) are opened by negating the linear layer; grad_y is
    zeroed where the float64 z (of the dtype-rounded inputs) is within `RELU_TIE` of the kink."""
    case, chain, dtype = inp.case, inp.chain, inp.dtype
    x, w, b, lw, lb, gy = make_inputs(case, generator=torch.Generator().manual_seed(inp.seed))
    if inp.d_outer:
        x = x.permute(2, 0, 1).contiguous().permute(1, 2, 0)  # casts and leaves keep these strides
    if chain.norm == "rms_norm":
        lb = None
    args = [None if t is None else t.to(dtype) for t in (x, w, b, lw, lb)]
    gy = gy.to(dtype)
    if chain.out_activation == "relu":
        z = _reference(args, case, chain._replace(out_activation=None))
        if not (z > 0).any():
            args[1] = -args[1]
            args[2] = None if args[2] is None else -args[2]
            z = -z
        gy = gy.masked_fill(z.abs() < RELU_TIE, 0)
    return args, gy


def _reference(args, case: Case, chain):
    x, w, b, lw, lb = (None if t is None else t.double() for t in args)
    return recfuse.reference.feature_mlp(x, w, b, ln_weight=lw, ln_bias=lb, eps=case.eps, feature_dim=case.feature_dim,
                                         norm=chain.norm, activation=chain.activation,
                                         out_activation=chain.out_activation)


def check_forced(inp: Inputs, forward=None, backward=None):
    """The op's forward and backward with `forward` / `backward` forced, against float64; returns
    the forward's and the backward's launch meta."""
    case, chain, dtype = inp.case, inp.chain, inp.dtype
    args, gy = path_inputs(inp)
    assert (args[0].stride(2) != 1) == (inp.d_outer and case.B * case.F > 1)
    tensors = tuple(None if t is None else t.double() for t in args) + (gy.double(),)
    op = functools.partial(recfuse.feature_mlp, norm=chain.norm, activation=chain.activation,
                           out_activation=chain.out_activation)
    with configs.override(forward=forward, backward=backward), launch.trace_launches() as seen:
        y, grads = run_op(op, tensors, dtype, case)
    assert [kind for kind, *_ in seen] == ["forward", "backward"]  # no composite fallback
    metas = {kind: meta for kind, _, meta, _ in seen}
    y_ref = _reference(args, case, chain)
    assert y.dtype == dtype and y.shape == y_ref.shape
    err = rel_err(y, y_ref)
    assert err < TOLERANCE[dtype], f"y: {err:.2e} >= {TOLERANCE[dtype]:.0e}"
    # run_op's gradients of the present arguments, in the five slots (empty for an absent one)
    present = iter(grads[1:])
    full = [grads[0]] + [next(present) if a is not None else torch.empty(0) for a in args[1:]]
    baseline = composite_backward(gy, *args, case.eps, case.feature_dim, chain)
    assert_backward_close(full, baseline, gy, args, case, chain, dtype)
    return metas["forward"], metas["backward"]


def _describe(inp: Inputs, knobs):
    return f"{inp.case}{'-d_outer' if inp.d_outer else ''} {inp.dtype} {inp.chain.describe()} {knobs}"


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


# ---------------------------------------------------------------------------------------------
# 1. the split weight-gradient backward (whole-row tl.dot, DZ_OUT)

SPLIT_D = st.sampled_from([16, 24, 32, 40, 48, 64, 80, 96, 128, 160])


@st.composite
def split_draws(draw):
    inp = draw(cases(SPLIT_D, st.integers(8, 40)))
    case, dtype = inp.case, inp.dtype
    block_d = triton.next_power_of_2(case.D)
    knobs = dict(
        use_dot=True, block_k=0,
        block_b=draw(st.sampled_from([16, 32, 64])),
        num_warps=draw(st.sampled_from([2, 4, 8])),
        programs_per_sm=draw(st.sampled_from([1, 2, 4])),
        prefetch=draw(st.sampled_from([0, 1])),
        loop_stages=draw(st.sampled_from([0, 2, 3])),
        # widths and tiles that are not powers of two too: a config that fits must run
        split_dw=draw(st.sampled_from([w for w in (16, 24, 32, 48, 64, 96, 128, 256) if w <= block_d])),
        dw_block_b=draw(st.sampled_from([16, 24, 32, 48, 64, 128])),
        dw_num_warps=draw(st.sampled_from([1, 2, 4, 8])),
        dw_num_stages=draw(st.sampled_from([1, 2, 3])),
    )
    if dtype == torch.float32:
        knobs["fp32_dots"] = draw(st.sampled_from(["bf16x6", "bf16x6z3", "ieee"]))
    return inp, knobs


_SPLIT = dict(use_dot=True, block_k=0, block_b=16, num_warps=4, programs_per_sm=2, prefetch=0, loop_stages=0,
              split_dw=32, dw_block_b=16, dw_num_warps=4, dw_num_stages=3)


@_settings(10)
@given(draw=split_draws())
# the largest shapes, several row tiles a program, a masked column chunk (160 = 5 x 32 of 256)
@example(draw=(Inputs(Case(3, 70, 160, 40, feature_dim=1, strided_view=True, per_feature_weight=True,
                           bias="per_feature", ln="per_feature"), DEFAULT_CHAIN, torch.bfloat16, 1),
               dict(_SPLIT, prefetch=1)))
@example(draw=(Inputs(Case(2, 63, 96, 33, ln="shared", eps=0.0), chain_of("layer_norm", "gelu", "tanh"), torch.float16,
                      2, d_outer=True), dict(_SPLIT, split_dw=64, dw_block_b=32, loop_stages=3)))
@example(draw=(Inputs(Case(3, 1, 40, 8, feature_dim=1, ln="none", bias="none"), chain_of("rms_norm", "silu", None),
                      torch.float32, 3), dict(_SPLIT, split_dw=16, dw_block_b=64, programs_per_sm=1)))
# widths that are not powers of two: `configs.backward_fits` accepted them, and the weight-gradient
# kernel could not be built (tl.arange of 48 columns / 24 rows)
@example(draw=(Inputs(Case(2, 37, 96, 16), DEFAULT_CHAIN, torch.float32, 4), dict(_SPLIT, split_dw=48, dw_block_b=24)))
def test_split_weight_gradient_backward(draw):
    inp, knobs = draw
    case, dtype = inp.case, inp.dtype
    cfg = configs.heuristic_backward(case.D, case.H, dtype, **knobs)
    if not configs.backward_fits(cfg, case.D, case.H):
        # Only widths and tiles that are not powers of two: refused, and so is a table entry of
        # them. The nearest power of two below runs.
        assert _pow2_floor(cfg.split_dw) != cfg.split_dw or _pow2_floor(cfg.dw_block_b) != cfg.dw_block_b, cfg
        assert configs.config_from_entry("backward", configs.config_to_entry(cfg), case.D, case.H, dtype) is None
        knobs = dict(knobs, split_dw=_pow2_floor(cfg.split_dw), dw_block_b=_pow2_floor(cfg.dw_block_b))
        cfg = configs.heuristic_backward(case.D, case.H, dtype, **knobs)
        assert configs.backward_fits(cfg, case.D, case.H), cfg
    what = _describe(inp, knobs)
    _, meta = check_forced(inp, backward=cfg)
    assert meta["USE_DOT"] and meta.get("DZ_OUT") and "BLOCK_K" not in meta and "BLOCK_D2" not in meta, what
    assert meta["BLOCK_B"] == cfg.block_b and meta["BLOCK_H"] == configs.dot_block_h(case.H), what


# ---------------------------------------------------------------------------------------------
# 2. the forward's row path (no tl.dot, H <= 4) in whole chunks of D

CHUNKED_D = st.sampled_from([16, 24, 32, 40, 48, 64, 80, 96, 128, 160])
# (row tiles x features x chunks) of one forward: the interpreter's cost (~3 ms each)
TILE_CHUNK_BUDGET = 240


@st.composite
def chunked_forward_draws(draw):
    inp = draw(cases(CHUNKED_D, st.integers(1, 4)))
    case = inp.case
    block_d = triton.next_power_of_2(case.D)
    # power-of-two chunk widths that divide D (a whole number of chunks), narrower than the
    # padded row, at most 20 chunks (the interpreter unrolls them)
    block_k = draw(st.sampled_from([k for k in (4, 8, 16, 32, 64)
                                    if case.D % k == 0 and k < block_d and case.D // k <= 20]))
    tiles = [b for b in (1, 2, 4, 8, 16, 32)
             if triton.cdiv(case.B, b) * case.F * (case.D // block_k) <= TILE_CHUNK_BUDGET]
    persistent = draw(st.sampled_from([0, 0, 1, 2]))
    knobs = dict(
        use_dot=False, unroll_h=0, block_h=min(4, triton.next_power_of_2(case.H)), block_k=block_k,
        block_b=draw(st.sampled_from(tiles)),
        num_warps=draw(st.sampled_from([1, 2, 4])),
        persistent=persistent,
        tile_stages=draw(st.sampled_from([1, 2, 3])) if persistent else 1,
    )
    return inp, knobs


_CHUNKED = dict(use_dot=False, unroll_h=0, num_warps=2, persistent=0, tile_stages=1)


@_settings(6)
@given(draw=chunked_forward_draws())
@example(draw=(Inputs(Case(3, 70, 160, 1, feature_dim=1, strided_view=True, per_feature_weight=True,
                           bias="per_feature", ln="per_feature"), DEFAULT_CHAIN, torch.bfloat16, 1),
               dict(_CHUNKED, block_h=1, block_k=32, block_b=16, persistent=2, tile_stages=3)))
@example(draw=(Inputs(Case(2, 61, 24, 3, ln="shared", eps=0.0), chain_of("rms_norm", "silu", None), torch.float16, 2,
                      d_outer=True), dict(_CHUNKED, block_h=4, block_k=8, block_b=8)))
@example(draw=(Inputs(Case(2, 1, 48, 2, feature_dim=1, ln="none"), chain_of(None, "sigmoid", "relu"), torch.float32,
                      3), dict(_CHUNKED, block_h=2, block_k=16, block_b=4, persistent=1, tile_stages=2)))
def test_chunked_row_forward(draw):
    inp, knobs = draw
    case, chain, dtype = inp.case, inp.chain, inp.dtype
    cfg = configs.heuristic_forward(case.D, case.H, dtype, False, **knobs)
    assert configs.forward_fits(cfg, case.D, case.H), cfg
    what = _describe(inp, knobs)
    # the backward: the heuristic's own config, on the chunked forward's saved row stats
    meta, bmeta = check_forced(inp, forward=cfg)
    assert not meta["USE_DOT"] and meta["BLOCK_K"] == cfg.block_k and meta["K_CHUNKS"] == case.D // cfg.block_k, what
    assert meta["SAVE_STATS"] == (chain.norm is not None), what
    assert meta["PERSISTENT"] == (cfg.persistent > 0), what
    if not bmeta["USE_DOT"]:
        assert bmeta["LOAD_STATS"] == (chain.norm is not None), what


# ---------------------------------------------------------------------------------------------
# 3. the H = 1 backward over two unmasked power-of-two parts of each row

# 2^a + 2^b (24 = 16 + 8, ..., 160 = 128 + 32, 192 = 128 + 64) and, as a control, D that is not
# (powers of two, 56 = 32 + 16 + 8): those take the whole-row kernel
ROW_PARTS_D = st.sampled_from([24, 40, 48, 72, 80, 96, 136, 160, 192, 16, 56, 64])
# row tiles x features of one backward
ROW_TILE_BUDGET = 120


@st.composite
def row_parts_draws(draw):
    inp = draw(cases(ROW_PARTS_D, st.just(1)))
    case = inp.case
    knobs = dict(
        use_dot=False, unroll_h=0, row_parts=1,
        block_b=draw(st.sampled_from([b for b in (1, 2, 4, 8, 16, 32)
                                      if triton.cdiv(case.B, b) * case.F <= ROW_TILE_BUDGET])),
        num_warps=draw(st.sampled_from([1, 2, 4])),
        programs_per_sm=draw(st.sampled_from([1, 2, 4])),
        loop_stages=draw(st.sampled_from([0, 2, 3])),
        # knobs of the whole-row kernel the two-part one has not: the plan drops them
        prefetch=draw(st.sampled_from([0, 1])),
        col_sums=draw(st.sampled_from([0, 1])),
    )
    # the forward whose stats it reads: the heuristic's (chunked rows where D allows) or whole rows
    whole_row_forward = draw(st.booleans())
    return inp, knobs, whole_row_forward


_PARTS = dict(use_dot=False, unroll_h=0, row_parts=1, num_warps=1, programs_per_sm=2, loop_stages=3, prefetch=0,
              col_sums=0)


@_settings(10)
@given(draw=row_parts_draws())
@example(draw=(Inputs(Case(3, 70, 160, 1, feature_dim=1, strided_view=True, per_feature_weight=True,
                           bias="per_feature", ln="per_feature"), DEFAULT_CHAIN, torch.float32, 1),
               dict(_PARTS, block_b=4), False))
@example(draw=(Inputs(Case(2, 45, 24, 1, ln="shared", eps=0.0), chain_of("rms_norm", "silu", None), torch.bfloat16, 2,
                      d_outer=True), dict(_PARTS, block_b=8, prefetch=1, col_sums=1), True))
@example(draw=(Inputs(Case(2, 1, 48, 1, feature_dim=1, ln="none", bias="none"), chain_of(None, "sigmoid", "relu"),
                      torch.float16, 3), dict(_PARTS, block_b=16), False))
def test_two_part_row_backward(draw):
    inp, knobs, whole_row_forward = draw
    case, chain, dtype = inp.case, inp.chain, inp.dtype
    cfg = configs.heuristic_backward(case.D, 1, dtype, **knobs)
    assert configs.backward_fits(cfg, case.D, 1), cfg
    forward = None
    if whole_row_forward:
        forward = lambda D, H, dt, full_tiles: configs.heuristic_forward(D, H, dt, full_tiles, block_k=0)  # noqa: E731
    what = _describe(inp, dict(knobs, whole_row_forward=whole_row_forward))
    fmeta, meta = check_forced(inp, forward=forward, backward=cfg)
    assert fmeta["SAVE_STATS"] == (chain.norm is not None), what
    assert (fmeta["BLOCK_K"] == fmeta["BLOCK_D"]) == (whole_row_forward or not configs.chunk_width(case.D, 32)
                                                      or case.D == fmeta["BLOCK_D"]), what
    parts = configs.row_parts_of(case.D)
    assert not meta["USE_DOT"] and meta["LOAD_STATS"] == (chain.norm is not None), what
    if parts:
        assert (meta["BLOCK_D"], meta["BLOCK_D2"]) == parts and meta["EVEN_D"], what
        assert not {"PREFETCH", "UNROLL_H", "COL_SUMS"} & set(meta), what
    else:
        assert "BLOCK_D2" not in meta and meta["BLOCK_D"] == triton.next_power_of_2(case.D), what


# 2^a + 2^b with a second part of 32+ columns, and controls that fall back (48 = 32 + 16, 64)
ROW_PARTS_DOT_D = st.sampled_from([96, 160, 192, 48, 64])
_DOT_PARTS = dict(use_dot=True, row_parts=1, block_k=0, prefetch=0, split_dw=0, two_pass=0, num_warps=4,
                  programs_per_sm=1, loop_stages=2, block_b=16)


@st.composite
def row_parts_dot_draws(draw):
    inp = draw(cases(ROW_PARTS_DOT_D, st.sampled_from([2, 4, 16, 33, 64])))
    case = inp.case
    knobs = dict(_DOT_PARTS,
                 block_b=draw(st.sampled_from([b for b in (16, 32) if triton.cdiv(case.B, b) * case.F <= ROW_TILE_BUDGET])),
                 programs_per_sm=draw(st.sampled_from([1, 2])),
                 loop_stages=draw(st.sampled_from([0, 2])))
    return inp, knobs


@_settings(4)
@given(draw=row_parts_dot_draws())
@example(draw=(Inputs(Case(3, 40, 160, 16, feature_dim=1, strided_view=True, per_feature_weight=True,
                           bias="per_feature", ln="per_feature"), DEFAULT_CHAIN, torch.float32, 4), _DOT_PARTS))
@example(draw=(Inputs(Case(2, 33, 96, 64, ln="shared", eps=0.0), DEFAULT_CHAIN, torch.bfloat16, 5, d_outer=True),
               dict(_DOT_PARTS, block_b=32)))
def test_two_part_dot_row_backward(draw):
    inp, knobs = draw
    case, chain, dtype = inp.case, inp.chain, inp.dtype
    cfg = configs.heuristic_backward(case.D, case.H, dtype, **knobs)
    what = _describe(inp, knobs)
    _, meta = check_forced(inp, backward=cfg)
    # z is not recomputed here: dz needs grad_y alone or the forward's relu mask, which a training
    # forward with a norm saves (fp16 saves none)
    dz_known = chain.out_activation is None or (chain.out_activation == "relu" and chain.norm is not None
                                                and dtype != torch.float16)
    if configs.row_parts_dot_fits(case.D) and dz_known:
        assert (meta["BLOCK_D"], meta["BLOCK_D2"]) == configs.row_parts_of(case.D) and meta["USE_DOT"], what
        assert meta["LOAD_STATS"] == (chain.norm is not None), what
        assert meta.get("LOAD_MASK", False) == (chain.out_activation == "relu"), what
    else:
        assert "BLOCK_D2" not in meta, what

