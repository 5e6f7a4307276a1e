"""The tl.dot backward over two unmasked power-of-two parts of each row (`BackwardConfig.row_parts`
with `use_dot`, `kernels.ln_tanh_linear_relu_bwd_rows2_dot`): D = 96 = 64 + 32 and
160 = 128 + 32, against float64 and the whole-row tl.dot kernel (whose tile pads D to the next
power of two), under the Triton interpreter and, where there is one, on the GPU.
"""
import pytest
import torch

from recfuse.chain import DEFAULT as DEFAULT_CHAIN, chain_of
from recfuse.ops import configs, launch
from op_cases import (INTERPRETER_AND_CUDA, Case, assert_backward_close, chain_backward_inputs, forced_backward,
                      with_rows)

DEVICES = INTERPRETER_AND_CUDA

# Knobs both kernels take: 16-row tiles (so B = 37 leaves a padded last tile), one program a
# feature under the interpreter.
DOT = dict(use_dot=True, block_b=16, num_warps=4, num_stages=1, programs_per_sm=1, block_k=0, prefetch=0,
           split_dw=0, two_pass=0)

CASES = [
    # relu (the forward's mask), per-feature LayerNorm affine and bias, a padded last row tile
    (Case(2, 37, 160, 16, ln="per_feature", bias="per_feature"), torch.float32, None),
    # H padded to the MMA's 16 columns, a strided [B, F*D] view, a per-feature weight, shared affine
    (Case(2, 40, 96, 4, feature_dim=1, strided_view=True, per_feature_weight=True, ln="shared"), torch.float32,
     None),
    (Case(3, 33, 96, 16, ln="none", bias="none", eps=0.0), torch.bfloat16, None),
    (Case(1, 20, 96, 64, ln="per_feature"), torch.bfloat16, None),
    # no out-activation: dz is grad_y (fp16 multiplies fp32 operands)
    (Case(2, 17, 160, 16, feature_dim=1, ln="per_feature"), torch.float16, chain_of("layer_norm", "tanh", None)),
    (Case(1, 48, 96, 8, ln="none"), torch.float32, chain_of("rms_norm", "silu", None)),
]


def _forward_stats(args, case, chain, knobs):
    """The training forward's saved row stats (and relu mask) as it saves them for a backward
    that runs with ``knobs``."""
    forced = lambda D, H, dt: configs.heuristic_backward(D, H, dt, **knobs)  # noqa: E731
    with configs.override(backward=forced):
        return launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, dtype, chain", CASES, ids=str)
def test_two_part_dot_rows_match_float64_and_the_whole_row_kernel(case, dtype, chain, device):
    chain = chain or DEFAULT_CHAIN
    if device == "cuda":
        case = with_rows(case, 1000)
    args, gy = chain_backward_inputs(case, dtype, chain, seed=9, device=device)
    stats = _forward_stats(args, case, chain, dict(DOT, row_parts=1, loop_stages=2))
    parts, meta = forced_backward(gy, args, case, stats, chain, row_parts=1, loop_stages=2, **DOT)
    whole, whole_meta = forced_backward(gy, args, case, stats, chain, **DOT)
    assert (meta["BLOCK_D"], meta["BLOCK_D2"]) == configs.row_parts_of(case.D) and "BLOCK_D2" not in whole_meta
    assert meta["USE_DOT"] and meta.get("LOAD_MASK", False) == (chain.out_activation == "relu")
    assert_backward_close(parts, whole, gy, args, case, chain, dtype)


@pytest.mark.interpret
def test_two_part_dot_rows_fall_back_without_the_forwards_stats_or_mask():
    case = Case(2, 16, 96, 16, ln="per_feature")
    args, gy = chain_backward_inputs(case, torch.float32, DEFAULT_CHAIN, seed=3)
    knobs = dict(DOT, row_parts=1)
    # no row stats (a compiled backward): the heuristic's whole-row or chunked kernel instead
    grads, meta = forced_backward(gy, args, case, None, DEFAULT_CHAIN, **knobs)
    assert "BLOCK_D2" not in meta
    # a norm-free chain saves no stats, so no relu mask: the two-part kernel cannot make dz
    chain, plain = chain_of(None, "sigmoid", "relu"), Case(2, 16, 96, 16, ln="none")
    args2, gy2 = chain_backward_inputs(plain, torch.float32, chain, seed=3)
    _, meta2 = forced_backward(gy2, args2, plain, _forward_stats(args2, plain, chain, knobs), chain, **knobs)
    assert "BLOCK_D2" not in meta2
    # what ran is still right
    stats = _forward_stats(args, case, DEFAULT_CHAIN, dict(DOT))
    baseline, _ = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **DOT)
    assert_backward_close(grads, baseline, gy, args, case, DEFAULT_CHAIN, torch.float32)


def test_the_forward_saves_the_relu_mask_for_two_part_dot_rows_at_any_width():
    # bf16 D = 96 is below the width from which the whole-row backward reads a mask (it recomputes
    # z there); the two-part kernel has no z, so the forward must save the mask for it.
    dev = torch.device("cpu")
    knobs = dict(DOT, row_parts=1)
    forced = lambda D, H, dt: configs.heuristic_backward(D, H, dt, **knobs)  # noqa: E731
    with configs.override(backward=forced):
        assert launch._relu_mask_words(96, 16, torch.bfloat16, dev, DEFAULT_CHAIN, 16) == 1
    whole = lambda D, H, dt: configs.heuristic_backward(D, H, dt, **DOT)  # noqa: E731
    with configs.override(backward=whole):
        assert launch._relu_mask_words(96, 16, torch.bfloat16, dev, DEFAULT_CHAIN, 16) == 0


@pytest.mark.interpret
def test_two_part_dot_rows_are_not_taken_below_the_validated_second_part():
    # D = 48 = 32 + 16: the kernel faulted on the H200 at H = 64 (`configs.ROW_PARTS_DOT_MIN`); a
    # config asking for it runs the heuristic's kernel instead, with the same numbers.
    case = Case(2, 24, 48, 16, ln="per_feature")
    args, gy = chain_backward_inputs(case, torch.float32, DEFAULT_CHAIN, seed=4)
    knobs = dict(DOT, row_parts=1)
    grads, meta = forced_backward(gy, args, case, _forward_stats(args, case, DEFAULT_CHAIN, knobs), DEFAULT_CHAIN,
                                  **knobs)
    assert "BLOCK_D2" not in meta and not configs.row_parts_dot_fits(48)
    stats = _forward_stats(args, case, DEFAULT_CHAIN, DOT)
    baseline, _ = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **DOT)
    assert_backward_close(grads, baseline, gy, args, case, DEFAULT_CHAIN, torch.float32)


def test_a_two_part_dot_plan_gives_every_kernel_parameter_a_value():
    # The direct launch passes every parameter in signature order: the plan's constexprs must
    # name exactly the two-part dot kernel's.
    F, B, D, H = 3, 64, 160, 16
    x, w = torch.randn(F, B, D), torch.randn(H, D)
    gy, stats = torch.randn(F, B, H), torch.randn(3, F, B)
    cfg = configs.heuristic_backward(D, H, torch.float32, **dict(DOT, row_parts=1))
    with configs.override(backward=cfg):
        plan = launch.backward_plan(gy, x, w, None, None, None, 1e-5, 0, stats)
    assert plan.launcher is launch._launch_bwd_rows2_dot
    n = 10 + len(plan.ints)  # grad_y, x, the 4 parameters, dx, partials, stats, dz; the integers
    trailing = plan.launcher.trailing_args(range(n), plan.meta)
    assert trailing is not None and n + len(trailing) == len(plan.launcher.arg_names)


@pytest.mark.parametrize("D,H", [(192, 8), (192, 32), (384, 8), (384, 32), (160, 16)])
def test_fp32_rows_of_two_parts_take_the_two_part_dot_kernel(D, H):
    """The heuristic's fp32 backward where D is two power-of-two parts of 256-512 padded columns:
    the two-part tl.dot rows (H200 tuner, twenty-fourth session), not K-chunks or, at H=8, the
    per-column product; a tuner's candidate keeps the path its knobs name."""
    # (gemm=0: the fused kernels' own heuristic, which D = 384 at H = 32-64 leaves to the GEMM backward)
    cfg = configs.heuristic_backward(D, H, torch.float32, gemm=0)
    assert cfg.use_dot and cfg.row_parts and not cfg.block_k and not cfg.unroll_h and not cfg.two_pass
    assert configs.backward_fits(cfg, D, H)
    assert not configs.heuristic_backward(D, H, torch.float32, block_k=32).row_parts
    # where whole rows would not fit beside the weight (the fallback without stats), K-chunks
    assert configs.heuristic_backward(384, 64, torch.float32, gemm=0).block_k
    # bf16 above H=8 (pipelined); at H=8 its prefetched whole rows were as fast
    assert configs.heuristic_backward(D, 32, torch.bfloat16).row_parts
    assert not configs.heuristic_backward(D, 8, torch.bfloat16).row_parts
    # one power of two, or parts below the validated width: as before
    assert not configs.heuristic_backward(256, 8, torch.float32).row_parts
    assert not configs.heuristic_backward(200, 16, torch.float32).row_parts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D,H", [(192, 8), (384, 32)])
def test_the_heuristics_fp32_two_part_rows_match_float64(D, H, device):
    if device == "cpu" and D > 256:
        pytest.skip("interpreter time (20 s); D=192 runs there")
    case = Case(2, 37, D, H, ln="per_feature", bias="per_feature")
    if device == "cuda":
        case = with_rows(case, 1000)
    knobs = {k: getattr(configs.heuristic_backward(D, H, torch.float32), k)
             for k in ("use_dot", "block_b", "num_warps", "row_parts", "loop_stages", "fp32_dots")}
    knobs.update(programs_per_sm=1 if device == "cpu" else 16)
    args, gy = chain_backward_inputs(case, torch.float32, DEFAULT_CHAIN, seed=4, device=device)
    stats = _forward_stats(args, case, DEFAULT_CHAIN, knobs)
    parts, meta = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **knobs)
    assert (meta["BLOCK_D"], meta["BLOCK_D2"]) == configs.row_parts_of(D)
    whole, _ = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **dict(knobs, row_parts=0))
    assert_backward_close(parts, whole, gy, args, case, DEFAULT_CHAIN, torch.float32)
