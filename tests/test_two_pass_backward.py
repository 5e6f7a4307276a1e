"""The two-pass backward (`BackwardConfig.two_pass`): `kernels.ln_tanh_linear_relu_bwd_two_pass`
launched twice, first writing each column chunk's share of dx's two row sums, then adding them in
chunk order and writing dx and every parameter's partial gradient, both on a grid of (column
chunks, row programs, features), from the forward's row stats and relu mask.

Each case runs under the Triton interpreter (``make test-interpret``) and, where a GPU is present,
on it at sizes with many row tiles per program. References: float64 (the composite backward) and
the whole-row tl.dot kernel on the same inputs and stats.
"""
import pytest
import torch

import recfuse
from recfuse.chain import DEFAULT as DEFAULT_CHAIN, chain_of
from recfuse.ops import configs, launch, tuning
from op_cases import (INTERPRETER_AND_CUDA, Case, assert_backward_close, assert_step_matches_float64,
                      chain_backward_inputs, count_launches, forced_backward, with_rows)

DEVICES = INTERPRETER_AND_CUDA

CASES = [
    # (case, dtype, chain, chunk): padded rows, D not a whole number of chunks (80 = 2.5 x 32), H
    # past a 32-bit mask word (40) and two full words (64), the [B, F*D] view, per-feature and
    # shared parameters, a bf16 row of five chunks, no LayerNorm affine, and chains without relu
    # (dz is grad_y) and with RMSNorm.
    (Case(2, 37, 64, 16, ln="per_feature", bias="per_feature"), torch.float32, None, 32),
    (Case(2, 24, 80, 40, feature_dim=1, strided_view=True, per_feature_weight=True, ln="shared"), torch.float32,
     None, 32),
    (Case(1, 21, 160, 16, feature_dim=1, bias="per_feature"), torch.bfloat16, None, 32),
    (Case(1, 48, 64, 64, ln="none", bias="none"), torch.bfloat16, None, 16),
    (Case(2, 30, 48, 16, ln="per_feature"), torch.float32, chain_of("layer_norm", "tanh", None), 16),
    (Case(2, 30, 48, 12, ln="none"), torch.float32, chain_of("rms_norm", "silu", None), 32),
]

KNOBS = dict(use_dot=True, block_b=16, programs_per_sm=1, block_k=0, prefetch=0)


def _scaled(case: Case, device: str) -> Case:
    return case if device == "cpu" else with_rows(case, 1000)


def _forced(**knobs):
    return lambda D, H, dt: configs.heuristic_backward(D, H, dt, **knobs)


def _training_stats(args, case, chain, backward_knobs):
    """The row stats a training forward saves when the backward runs `backward_knobs` (it asks
    the backward's config whether to save the relu mask)."""
    forward = lambda D, H, dt, full: configs.heuristic_forward(D, H, dt, full, use_dot=True, block_b=16,  # noqa: E731
                                                                block_k=0, persistent=0)
    with configs.override(forward=forward, backward=_forced(**backward_knobs)):
        return launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)[1]


def _two_pass_inputs(case, dtype, chain, chunk, device, seed):
    """(case scaled to the device, chain, args, grad_y, two-pass knobs, the training forward's stats)."""
    chain = chain or DEFAULT_CHAIN
    case = _scaled(case, device)
    args, gy = chain_backward_inputs(case, dtype, chain, seed=seed, device=device)
    rows = 16 if device == "cpu" else 64
    two_pass = dict(KNOBS, two_pass=chunk, dw_block_b=rows, block_b=rows)
    return case, chain, args, gy, two_pass, _training_stats(args, case, chain, two_pass)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, dtype, chain, chunk", CASES, ids=str)
def test_two_pass_gradients_match_float64_and_the_whole_row_kernel(case, dtype, chain, chunk, device):
    case, chain, args, gy, two_pass, stats = _two_pass_inputs(case, dtype, chain, chunk, device, seed=2)
    if chain.out_activation == "relu":
        assert stats.shape[0] > 2, "a two-pass backward needs the relu mask at any D"
    grads, meta = forced_backward(gy, args, case, stats, chain, **two_pass)
    whole, whole_meta = forced_backward(gy, args, case, stats, chain, **KNOBS)
    assert meta["BLOCK_K"] == chunk and "BLOCK_D" not in meta and "BLOCK_D" in whole_meta
    assert_backward_close(grads, whole, gy, args, case, chain, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_two_pass_is_bitwise_deterministic_and_launches_three_kernels(device, monkeypatch):
    case = _scaled(Case(2, 48, 96, 20, ln="per_feature", bias="per_feature"), device)
    args, gy = chain_backward_inputs(case, torch.float32, DEFAULT_CHAIN, seed=4, device=device)
    knobs = dict(KNOBS, two_pass=32, dw_block_b=16)
    stats = _training_stats(args, case, DEFAULT_CHAIN, knobs)
    calls = count_launches(monkeypatch, ("_launch_bwd_two_pass", "_launch_partials_to_grads"))
    with configs.override(backward=_forced(**knobs)), launch.trace_launches() as seen:
        first = launch.backward(gy, *args, case.eps, case.feature_dim, stats)
        second = launch.backward(gy, *args, case.eps, case.feature_dim, stats)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert calls == ["_launch_bwd_two_pass", "_launch_bwd_two_pass", "_launch_partials_to_grads"] * 2
    assert [m["DX_PASS"] for kind, _, m, _ in seen if kind == "backward"] == [False, False]
    assert_backward_close(first, first, gy, args, case, DEFAULT_CHAIN, torch.float32)


@pytest.mark.interpret
def test_without_the_relu_mask_the_two_pass_config_runs_the_whole_row_kernel():
    # Stats without the mask (a forward made under another backward config), or none: z must be
    # recomputed from whole rows, so the plan is the whole-row kernel's, and right.
    case = Case(2, 20, 64, 16)
    args, gy = chain_backward_inputs(case, torch.float32, DEFAULT_CHAIN, seed=6)
    knobs = dict(KNOBS, two_pass=32, dw_block_b=16)
    stats = _training_stats(args, case, DEFAULT_CHAIN, knobs)
    for stats_arg in (stats[:2].contiguous(), None):
        grads, meta = forced_backward(gy, args, case, stats_arg, DEFAULT_CHAIN, **knobs)
        assert "BLOCK_D" in meta and not meta.get("LOAD_MASK")
        assert_backward_close(grads, grads, gy, args, case, DEFAULT_CHAIN, torch.float32)


@pytest.mark.interpret
def test_the_mask_is_saved_below_its_width_threshold_for_a_two_pass_backward():
    # bf16 rows narrower than `configs.relu_mask_min_d` save no mask for the whole-row kernel
    # (it recomputes z); a two-pass backward has no whole row, so its forward saves it.
    case = Case(2, 16, 64, 16)
    args, _ = chain_backward_inputs(case, torch.bfloat16, DEFAULT_CHAIN, seed=7)
    assert 64 < configs.relu_mask_min_d(torch.bfloat16)
    assert _training_stats(args, case, DEFAULT_CHAIN, KNOBS).shape[0] == 2
    assert _training_stats(args, case, DEFAULT_CHAIN, dict(KNOBS, two_pass=32)).shape[0] == 3


@pytest.mark.interpret
def test_an_autograd_training_step_on_the_two_pass_backward_matches_float64():
    case = Case(3, 24, 64, 16, feature_dim=1, strided_view=True, bias="per_feature")
    (x, w, b, lw, lb), gy = chain_backward_inputs(case, torch.float64, DEFAULT_CHAIN, seed=5)
    leaves = [t.detach().float().requires_grad_(True) for t in (x, w, b, lw, lb)]
    with configs.override(backward=_forced(**dict(KNOBS, two_pass=16, dw_block_b=16))), \
            launch.trace_launches() as seen:
        y = recfuse.ln_tanh_linear_relu(leaves[0], leaves[1], leaves[2], ln_weight=leaves[3], ln_bias=leaves[4],
                                        eps=case.eps, feature_dim=1)
        y.backward(gy.float())
    backward_meta = [m for kind, _, m, _ in seen if kind == "backward"]
    assert backward_meta and backward_meta[0]["BLOCK_K"] == 16 and "BLOCK_D" not in backward_meta[0]
    assert_step_matches_float64(y, leaves, (x, w, b, lw, lb), gy, case.eps, 1)


def test_two_pass_configs_fit_round_trip_their_entries_and_name_their_path():
    for D, H, dtype in [(512, 64, torch.bfloat16), (160, 16, torch.float32), (32, 16, torch.bfloat16)]:
        cands = tuning.two_pass_candidates(D, H, dtype)
        assert cands and all(configs.backward_fits(c, D, H) for c in cands)
        flag = 1 + tuning.PATH_FLAGS["backward"].index("two_pass")
        assert all(tuning.kernel_path(c)[flag] for c in cands)
        for cfg in cands[:3]:
            assert configs.config_from_entry("backward", configs.config_to_entry(cfg), D, H, dtype) == cfg
        # fp32 keeps its accurate split-bf16 dots: the whole-row rule for 512-wide rows does not apply
        assert all(c.fp32_dots == "bf16x6" for c in cands)
    # chunks are powers of two no wider than the row; not with the K-chunked or split kernels
    for bad in (dict(two_pass=48), dict(two_pass=1024), dict(two_pass=32, block_k=64), dict(two_pass=32, split_dw=64),
                dict(two_pass=32, dw_block_b=24)):
        cfg = configs.heuristic_backward(512, 16, torch.float32, use_dot=True, **dict(dict(block_k=0), **bad))
        assert not configs.backward_fits(cfg, 512, 16), bad


@pytest.mark.interpret
def test_no_features_give_zero_gradients_on_the_two_pass_plan():
    # F = 0 with rows: the two-pass grid is (chunks, P, 0); no kernel runs, every gradient is zero.
    case = Case(0, 8, 64, 16)
    args, gy = chain_backward_inputs(case, torch.float32, DEFAULT_CHAIN, seed=9)
    knobs = dict(KNOBS, two_pass=32, dw_block_b=16)
    stats = torch.zeros(3, 0, case.B)
    with configs.override(backward=_forced(**knobs)):
        plan = launch.backward_plan(gy, *args, case.eps, case.feature_dim, stats)
        grads = launch.backward(gy, *args, case.eps, case.feature_dim, stats)
    assert plan.two_pass and plan.grid == (2, 1, 0)
    assert grads[0].shape == args[0].shape
    for g, p in zip(grads[1:], args[1:]):
        if p is not None:
            assert g.shape == p.shape and not g.any()


@pytest.mark.interpret
@pytest.mark.parametrize("chain, with_stats", [(DEFAULT_CHAIN, False), (chain_of("layer_norm", "tanh", "tanh"), True)],
                         ids=["relu-no-stats", "tanh-out"])
def test_a_two_pass_entry_without_its_inputs_takes_the_heuristic_whole_row_config(chain, with_stats):
    # A compiled backward passes no stats, and an out-activation other than relu has no mask: the
    # whole-row kernel runs then, with the heuristic's tiles, not the entry's (tuned on chunks:
    # 64-row tiles of 512 columns would not fit a whole-row program).
    case = Case(2, 40, 64, 16)
    args, gy = chain_backward_inputs(case, torch.float32, chain, seed=10)
    knobs = dict(KNOBS, two_pass=32, block_b=64, num_warps=2, dw_block_b=16)
    stats = _training_stats(args, case, chain, knobs) if with_stats else None
    with configs.override(backward=_forced(**knobs)):
        plan = launch.backward_plan(gy, *args, case.eps, case.feature_dim, stats, chain=chain)
        grads = launch.backward(gy, *args, case.eps, case.feature_dim, stats, chain=chain)
    assert not plan.two_pass and "BLOCK_D" in plan.meta
    assert plan.cfg == configs.heuristic_backward(64, 16, torch.float32)
    assert_backward_close(grads, grads, gy, args, case, chain, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, dtype, chain, chunk", [CASES[1], CASES[3]], ids=str)
def test_the_weight_gradient_in_the_first_pass_matches_float64_and_the_second_pass_one(case, dtype, chain, chunk,
                                                                                          device):
    # `BackwardConfig.dw_first`: dz^T @ t beside the row sums instead of beside dx; the same
    # products in the same row order, so under the interpreter every gradient has the same bits.
    case, chain, args, gy, two_pass, stats = _two_pass_inputs(case, dtype, chain, chunk, device, seed=11)
    first, meta = forced_backward(gy, args, case, stats, chain, **two_pass, dw_first=1)
    second, meta_second = forced_backward(gy, args, case, stats, chain, **two_pass)
    assert meta["DW_FIRST"] and not meta_second["DW_FIRST"]
    assert_backward_close(first, second, gy, args, case, chain, dtype, same_bits=device == "cpu")
    if device == "cpu":
        assert torch.equal(first[1], second[1])
