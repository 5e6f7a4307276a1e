"""The H = 1 backward over two unmasked power-of-two parts of each row (`BackwardConfig.row_parts`,
`kernels.ln_tanh_linear_relu_bwd_rows2`): D = 48 = 32 + 16, 96 = 64 + 32, 160 = 128 + 32, against
float64 and the whole-row kernel (whose tile pads D to the next power of two), under the Triton
interpreter and, where there is one, on the GPU.
"""
import pytest
import torch

from recfuse.chain import DEFAULT as DEFAULT_CHAIN, chain_of
from recfuse.ops import configs, launch
from op_cases import (INTERPRETER_AND_CUDA, Case, assert_backward_close, chain_backward_inputs, forced_backward,
                      make_inputs, with_rows)

DEVICES = INTERPRETER_AND_CUDA

CASES = [
    (Case(2, 37, 160, 1, ln="per_feature", bias="per_feature"), torch.float32, None),
    (Case(2, 40, 48, 1, feature_dim=1, strided_view=True, per_feature_weight=True, ln="shared"), torch.float32, None),
    (Case(3, 33, 96, 1, ln="none", bias="none", eps=0.0), torch.bfloat16, None),
    (Case(2, 24, 48, 1, feature_dim=1, ln="per_feature"), torch.float16, None),
    (Case(2, 24, 160, 1, ln="per_feature"), torch.float32, chain_of("layer_norm", "gelu", "tanh")),
    (Case(1, 48, 48, 1, ln="none"), torch.float32, chain_of("rms_norm", "silu", None)),
    (Case(2, 20, 96, 1, ln="none"), torch.bfloat16, chain_of(None, "sigmoid", "relu")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, dtype, chain", CASES, ids=str)
def test_two_part_rows_match_float64_and_the_whole_row_kernel(case, dtype, chain, device):
    chain = chain or DEFAULT_CHAIN
    if device == "cuda":
        case = with_rows(case, 1000)
    args, gy = chain_backward_inputs(case, dtype, chain, seed=6, device=device)
    stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)[1]
    knobs = dict(use_dot=False, block_b=8, num_warps=2, programs_per_sm=1, unroll_h=0)
    parts, meta = forced_backward(gy, args, case, stats, chain, row_parts=1, loop_stages=2, **knobs)
    whole, whole_meta = forced_backward(gy, args, case, stats, chain, **knobs)
    assert (meta["BLOCK_D"], meta["BLOCK_D2"]) == configs.row_parts_of(case.D) and "BLOCK_D2" not in whole_meta
    assert_backward_close(parts, whole, gy, args, case, chain, dtype)


@pytest.mark.interpret
def test_row_parts_need_the_forwards_stats_and_two_powers_of_two():
    case = Case(2, 16, 160, 1, ln="per_feature")
    x, w, b, lw, lb, gy = make_inputs(case, generator=torch.Generator().manual_seed(7))
    args = [t.float() for t in (x, w, b, lw, lb)]
    knobs = dict(use_dot=False, block_b=8, num_warps=2, unroll_h=0, row_parts=1)
    # without the forward's row stats (and a norm) the whole-row kernel runs
    _, meta = forced_backward(gy.float(), args, case, None, DEFAULT_CHAIN, **knobs)
    assert "BLOCK_D2" not in meta
    assert configs.row_parts_of(200) is None and configs.row_parts_of(256) is None


def test_a_two_part_plan_gives_every_kernel_parameter_a_value():
    # The direct launch passes every parameter in signature order: the plan's constexprs must
    # name exactly the two-part kernel's (no PREFETCH / UNROLL_H / COL_SUMS, which it lacks).
    F, B, D = 3, 64, 160
    x, w = torch.randn(F, B, D), torch.randn(1, D)
    gy, stats = torch.randn(F, B, 1), torch.randn(2, F, B)
    cfg = configs.heuristic_backward(D, 1, torch.float32)
    assert cfg.row_parts == 1
    with configs.override(backward=cfg):
        plan = launch.backward_plan(gy, x, w, None, None, None, 1e-5, 0, stats)
    assert plan.launcher is launch._launch_bwd_rows2
    n = 10 + len(plan.ints)  # grad_y, x, the 4 parameters, dx, partials, stats, dz; the integers
    trailing = plan.launcher.trailing_args(range(n), plan.meta)
    assert trailing is not None and n + len(trailing) == len(plan.launcher.arg_names)
