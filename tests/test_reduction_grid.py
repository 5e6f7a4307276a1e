"""The reduction of the backward's partial rows (`kernels.partials_to_grads`) on its one-axis grid:
feature 0's programs for every column block, then each other feature's from the first block with a
per-feature column, so that a shared weight beside per-feature LayerNorm affine launches no
programs with nothing to sum. Every mix of shared / per-feature weight and absent / shared /
per-feature bias and LayerNorm affine, against float64 (the composite backward), under the
Triton interpreter.
"""
import itertools

import pytest
import torch
import triton

from recfuse.chain import DEFAULT as DEFAULT_CHAIN
from recfuse.ops import configs, launch
from op_cases import Case, assert_backward_close, chain_backward_inputs

MIXES = list(itertools.product((False, True), ("none", "shared", "per_feature"), ("none", "shared", "per_feature")))


@pytest.mark.interpret
@pytest.mark.parametrize("per_feature_weight, bias, ln", MIXES, ids=lambda v: str(v))
def test_every_parameter_mix_sums_to_float64_on_the_one_axis_grid(per_feature_weight, bias, ln):
    case = Case(3, 37, 40, 20, per_feature_weight=per_feature_weight, bias=bias, ln=ln)
    args, gy = chain_backward_inputs(case, torch.float32, DEFAULT_CHAIN, seed=8)
    plan = launch.backward_plan(gy, *args, case.eps, case.feature_dim)
    grads = launch.backward(gy, *args, case.eps, case.feature_dim)
    assert_backward_close(grads, grads, gy, args, case, DEFAULT_CHAIN, torch.float32)
    F, P, K, H, D, first_block = plan.reduce_ints
    n_blocks = triton.cdiv(K, configs.REDUCE_BLOCK_K)
    per_feature = {"weight": per_feature_weight, "bias": bias == "per_feature", "ln": ln == "per_feature"}
    if not any(per_feature.values()):
        assert plan.reduce_grid == (n_blocks,)
        return
    # the first per-feature column: the weight's (0), else the bias's (H*D), else the affine's
    first_column = 0 if per_feature_weight else H * D if bias == "per_feature" else H * D + H
    assert first_block == first_column // configs.REDUCE_BLOCK_K
    assert plan.reduce_grid == (n_blocks + (F - 1) * (n_blocks - first_block),)
    if not per_feature_weight:
        assert plan.reduce_grid[0] < F * n_blocks  # the shared weight's blocks run once, not F times
