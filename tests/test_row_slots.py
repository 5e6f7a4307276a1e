"""The no-tl.dot backward's column sums folded into row slots (`BackwardConfig.row_slots`): each row
tile's rows r go into slot r % n of the weight- and LayerNorm-gradient accumulators instead of
one slot a tile row, reduced once after the row loop; on the whole-row tl.dot path, the LayerNorm
affine's sums, instead of one cross-warp sum a tile.

Each case runs under the Triton interpreter (``make test-interpret``) and, where a GPU is present,
on it with many row tiles per program. References: float64 (the composite backward) and the same
config with one slot a tile row (dx has the same bits: only the order of column sums changes).
"""
import pytest
import torch

from recfuse.chain import DEFAULT as DEFAULT_CHAIN, chain_of
from recfuse.ops import configs, launch
from op_cases import INTERPRETER_AND_CUDA, Case, assert_backward_close, chain_backward_inputs, forced_backward, with_rows

CASES = [
    # (case, dtype, chain, path knobs): H = 1 rows and the per-column product (H = 4, and H = 7:
    # 8 columns, one padded); masked columns (D = 40, 48) and rows, the [B, F*D] view, per-feature
    # and shared parameters, no LayerNorm affine, another chain.
    (Case(2, 37, 64, 1, ln="per_feature", bias="per_feature"), torch.float32, None, dict(unroll_h=0)),
    (Case(2, 45, 48, 1, feature_dim=1, strided_view=True, ln="shared"), torch.bfloat16, None, dict(unroll_h=0)),
    (Case(2, 29, 40, 4, per_feature_weight=True, ln="per_feature"), torch.float32, None, dict(unroll_h=1)),
    (Case(1, 27, 32, 7, ln="none", bias="per_feature"), torch.bfloat16, None, dict(unroll_h=1)),
    (Case(2, 30, 32, 1, ln="none", bias="none"), torch.float32, chain_of("rms_norm", "silu", "tanh"),
     dict(unroll_h=0)),
]


@pytest.mark.parametrize("device", INTERPRETER_AND_CUDA)
@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize("case, dtype, chain, path", CASES, ids=str)
def test_folded_column_sums_match_float64_and_the_row_slot_loop(case, dtype, chain, path, slots, device):
    chain = chain or DEFAULT_CHAIN
    case = case if device == "cpu" else with_rows(case, 3000)
    args, gy = chain_backward_inputs(case, dtype, chain, seed=3, device=device)
    stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)[1]
    knobs = dict(path, use_dot=False, block_b=8, num_warps=2, programs_per_sm=1, block_k=0, prefetch=0,
                 loop_stages=3 if slots == 4 else 0, col_sums=0)
    assert configs.backward_fits(configs.heuristic_backward(case.D, case.H, dtype, **knobs, row_slots=slots),
                                 case.D, case.H)
    baseline, base_meta = forced_backward(gy, args, case, stats, chain, **knobs)
    grads, meta = forced_backward(gy, args, case, stats, chain, **knobs, row_slots=slots)
    assert "ROW_SLOTS" not in base_meta and meta["ROW_SLOTS"] == slots and not meta["USE_DOT"]
    assert_backward_close(grads, baseline, gy, args, case, chain, dtype)
    assert torch.equal(grads[0], baseline[0])  # dx: the fold changes column sums only
    again, _ = forced_backward(gy, args, case, stats, chain, **knobs, row_slots=slots)
    for g, h in zip(grads, again):
        assert g is None or torch.equal(g, h)  # deterministic: fixed-order sums


DOT_CASES = [
    # (case, dtype, path knobs): the whole-row tl.dot backward's LayerNorm-affine sums in row slots;
    # masked columns and rows, the [B, F*D] view, per-feature and shared affines, a prefetched and a
    # pipelined row loop, the weight gradient in a kernel of its own (split_dw: dz out)
    (Case(2, 37, 48, 16, ln="per_feature", bias="per_feature"), torch.float32, dict(loop_stages=3)),
    (Case(2, 45, 64, 24, feature_dim=1, strided_view=True, ln="shared"), torch.bfloat16, dict(prefetch=1)),
    (Case(3, 29, 32, 40, per_feature_weight=True, ln="per_feature"), torch.bfloat16,
     dict(split_dw=16, dw_block_b=16)),
]


@pytest.mark.parametrize("device", INTERPRETER_AND_CUDA)
@pytest.mark.parametrize("slots", [2, 16])
@pytest.mark.parametrize("case, dtype, path", DOT_CASES, ids=str)
def test_dot_path_affine_sums_in_row_slots_match_float64_and_the_per_tile_sums(case, dtype, path, slots, device):
    case = case if device == "cpu" else with_rows(case, 3000)
    args, gy = chain_backward_inputs(case, dtype, DEFAULT_CHAIN, seed=4, device=device)
    stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True)[1]
    knobs = dict(path, use_dot=True, gemm=0, block_b=16, num_warps=2, programs_per_sm=1, block_k=0, two_pass=0,
                 row_parts=0)
    assert configs.backward_fits(configs.heuristic_backward(case.D, case.H, dtype, **knobs, row_slots=slots),
                                 case.D, case.H)
    baseline, base_meta = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **knobs)
    grads, meta = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **knobs, row_slots=slots)
    assert "ROW_SLOTS" not in base_meta and meta["ROW_SLOTS"] == slots and meta["USE_DOT"]
    assert_backward_close(grads, baseline, gy, args, case, DEFAULT_CHAIN, dtype)
    for name, g, h in zip(("x", "weight", "bias"), grads, baseline):
        assert torch.equal(g, h), name  # only the LayerNorm affine's column sums change order


def test_row_slots_outside_their_path_do_not_fit():
    # one slot per tile row or more is no fold, one slot is col_sums; per-tile column sums have
    # none; on the tl.dot path only the whole-row kernel has them (not chunks, passes or parts)
    base = dict(use_dot=False, block_b=8, num_warps=2, block_k=0)
    for knobs in (dict(base, row_slots=8), dict(base, row_slots=3), dict(base, row_slots=2, col_sums=1),
                  dict(base, row_slots=1)):  # one slot is col_sums
        assert not configs.backward_fits(configs.heuristic_backward(256, 1, torch.float32, **knobs), 256, 1), knobs
    dot = dict(use_dot=True, gemm=0, block_b=16, block_k=0, two_pass=0, row_parts=0, split_dw=0)
    assert configs.backward_fits(configs.heuristic_backward(256, 16, torch.bfloat16, **dot, row_slots=4), 256, 16)
    for knobs in (dict(dot, row_slots=3), dict(dot, row_slots=32), dict(dot, row_slots=2, block_k=64),
                  dict(dot, row_slots=2, two_pass=64, dw_block_b=16),
                  dict(dot, row_slots=2, split_dw=64, dw_block_b=16, split_ln=1)):
        cfg = configs.heuristic_backward(256, 16, torch.bfloat16, **knobs)
        assert cfg.use_dot and not configs.backward_fits(cfg, 256, 16), knobs
    entry = configs.config_to_entry(configs.heuristic_backward(256, 1, torch.float32, **base, row_slots=2))
    assert configs.config_from_entry("backward", entry, 256, 1, torch.float32).row_slots == 2


def test_the_heuristic_sums_wide_dot_rows_in_twice_the_layout_span():
    # `configs.DOT_ROW_SLOTS_MIN_D`: the heuristic's own whole-row tl.dot config from 128 columns;
    # narrower rows, other tl.dot kernels and configs that name their knobs keep sums per tile.
    for D, H, dtype in ((128, 16, torch.float32), (256, 16, torch.bfloat16), (128, 16, torch.bfloat16)):
        cfg = configs.heuristic_backward(D, H, dtype)
        assert cfg.use_dot and not (cfg.block_k or cfg.two_pass or cfg.row_parts or cfg.gemm), (D, H, dtype)
        span = configs.layout_row_span(cfg.block_b, cfg.block_d, cfg.num_warps, dtype.itemsize)
        assert cfg.row_slots == min(cfg.block_b, 2 * span) > 1 and configs.backward_fits(cfg, D, H)
    assert configs.heuristic_backward(64, 16, torch.bfloat16).row_slots == 0
    assert configs.heuristic_backward(128, 16, torch.float32, block_b=16).row_slots == 0
    assert configs.heuristic_backward(1024, 64, torch.float32, gemm=0).row_slots == 0  # K-chunked


@pytest.mark.interpret
def test_the_heuristics_row_slots_match_float64_and_the_per_tile_sums():
    # the shipped lookup on the interpreter (no table: the heuristic's own config, with its slots)
    case, dtype = Case(2, 41, 128, 16, feature_dim=1, strided_view=True, ln="per_feature"), torch.float32
    args, gy = chain_backward_inputs(case, dtype, DEFAULT_CHAIN, seed=5)
    stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True)[1]
    with launch.trace_launches() as seen:
        grads = launch.backward(gy, *args, case.eps, case.feature_dim, stats, chain=DEFAULT_CHAIN)
    meta = [m for kind, _, m, _ in seen if kind == "backward"][0]
    cfg = configs.heuristic_backward(case.D, case.H, dtype)
    assert meta["USE_DOT"] and meta["ROW_SLOTS"] == cfg.row_slots > 1
    baseline, base_meta = forced_backward(gy, args, case, stats, DEFAULT_CHAIN,
                                          **dict(configs.config_to_entry(cfg), row_slots=0))
    assert "ROW_SLOTS" not in base_meta
    assert_backward_close(grads, baseline, gy, args, case, DEFAULT_CHAIN, dtype)
