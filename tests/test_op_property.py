"""Property tests: random shapes and parameter forms of the op against the float64 per-slice path.

The CPU composite runs a wide range; under TRITON_INTERPRET=1 the Triton kernels run a few tiny
draws (the interpreter is slow), covering both the row-reduction (H < 5) and tl.dot paths.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from op_cases import Case, check_against_float64


def cases(max_f: int, max_b: int, max_d: int, max_h: int):
    @st.composite
    def build(draw):
        feature_dim = draw(st.sampled_from([0, 1]))
        return Case(
            F=draw(st.integers(1, max_f)),
            B=draw(st.integers(1, max_b)),
            # D >= 3: at D <= 2 LayerNorm's x-gradient is ~0 and a relative error means nothing
            # (D=1 and D=2 have explicit cases in test_op.py).
            D=draw(st.integers(3, max_d)),
            H=draw(st.integers(1, max_h)),
            feature_dim=feature_dim,
            per_feature_weight=draw(st.booleans()),
            bias=draw(st.sampled_from(["none", "shared", "per_feature"])),
            ln=draw(st.sampled_from(["none", "shared", "per_feature"])),
            eps=draw(st.sampled_from([0.0, 1e-5, 1e-3])),
            strided_view=feature_dim == 1 and draw(st.booleans()),
        )
    return build()


# derandomize: the same examples on every run (CI stays reproducible); each example seeds torch
# itself, so a failing example replays with the same tensors.
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_f=6, max_b=9, max_d=70, max_h=20), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_composite_matches_float64_reference(case, dtype):
    torch.manual_seed(0)
    check_against_float64(case, dtype)


@pytest.mark.interpret
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_f=3, max_b=5, max_d=20, max_h=9), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_kernels_match_float64_reference(case, dtype):
    torch.manual_seed(0)
    check_against_float64(case, dtype)


@pytest.mark.interpret
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(max_f=3, max_b=40, max_d=40, max_h=8), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       block_b=st.sampled_from([1, 2, 4, 8]), stages=st.sampled_from([2, 3]), col_sums=st.booleans(),
       row_slots=st.sampled_from([0, 2, 4]))
def test_pipelined_row_paths_match_float64_reference(case, dtype, block_b, stages, col_sums, row_slots):
    """The row paths' pipelined variants forced on drawn shapes: the persistent forward (programs
    walking row tiles, `tile_stages` in flight) and the backward's pipelined row loop with the
    per-column product for H > 1 and per-tile column sums, row slots or rows folded into 2-4
    slots; tiles of 1-8 rows over
    batches of 1-40 (programs with no tile, one partial tile, several)."""
    import triton

    from recfuse.ops import configs

    def forward(D, H, dt, full_tiles=True):
        block_h = min(triton.next_power_of_2(H), 4)
        return configs.ForwardConfig(block_b, triton.next_power_of_2(D), block_h, False, 1, persistent=1,
                                     tile_stages=stages)

    def backward(D, H, dt):
        return configs.heuristic_backward(D, H, dt, use_dot=False, unroll_h=int(H > 1), block_b=block_b,
                                          num_warps=2, programs_per_sm=1, block_k=0, prefetch=0, loop_stages=stages,
                                          col_sums=int(col_sums),
                                          row_slots=row_slots if row_slots < block_b and not col_sums else 0)

    torch.manual_seed(0)
    with configs.override(forward=forward, backward=backward):
        check_against_float64(case, dtype)
