"""The 16-bit tl.dot forward's heuristic configs (a GPU without a table entry for the shape; the
interpreter always): one program per 64+-row tile, whole rows at H <= 16 for power-of-two D and
chunks of half the row at H = 64 and for masked rows (`configs._heuristic_forward`). Each shape
runs the op as a caller does, on a batch that fills the tiles (the full-tile config: forward and
backward) and one that does not (the masked-tile config: its forward, with the row stats and relu
mask it saves for the backward, which would otherwise take most of the interpreter's time here),
against float64."""
import pytest
import torch

from op_cases import Case, check_against_float64, check_training_forward_against_float64
from recfuse.ops import configs

pytestmark = pytest.mark.interpret

SHAPES = [(32, 16), (64, 16), (128, 16), (48, 16), (32, 64), (48, 64), (64, 64)]


@pytest.mark.parametrize("D,H", SHAPES)
def test_16bit_heuristic_forward_tiles_match_float64(D, H):
    full = configs.heuristic_forward(D, H, torch.bfloat16)
    masked = configs.heuristic_forward(D, H, torch.bfloat16, False)
    assert full.use_dot and not full.persistent and not masked.persistent
    if D == full.block_d:
        assert full.block_k == (0 if H <= 16 else D // 2)
    # B = the full-tile config's rows (its tiles all full where D is a power of two), then B + 8
    check_against_float64(Case(2, full.block_b, D, H, feature_dim=1, strided_view=True, ln="per_feature"),
                          torch.bfloat16)
    forward_matches_float64(Case(2, full.block_b + 8, D, H, feature_dim=1, strided_view=True, ln="per_feature"),
                            torch.bfloat16, masked)


def forward_matches_float64(case, dtype, cfg):
    """`check_training_forward_against_float64`, and the launch took ``cfg``'s tiles."""
    (_, _, meta, *_), = check_training_forward_against_float64(case, dtype)
    assert (meta["BLOCK_B"], meta["BLOCK_D"]) == (cfg.block_b, cfg.block_d), meta


# Shapes off the tuned grid (twenty-third session, H200 tuner): masked rows that were 1.4-2.5x
# slower with the rules before, each run against float64 with the config the heuristic gives.
OFF_GRID = [
    # (D, H, dtype, what the masked-tile config must be)
    (96, 32, torch.bfloat16, dict(use_dot=True, persistent=0, block_k=32)),
    (384, 32, torch.bfloat16, dict(use_dot=True, persistent=0, block_k=64, k_loop=1)),
    (384, 2, torch.bfloat16, dict(use_dot=True, block_k=64, k_loop=1)),
    (384, 2, torch.float32, dict(use_dot=False, block_k=64)),
    (24, 2, torch.float32, dict(use_dot=False, unroll_h=1, block_k=0)),
    (24, 2, torch.bfloat16, dict(use_dot=True, block_b=128, block_k=0)),
    (24, 8, torch.bfloat16, dict(use_dot=True, block_b=128, num_warps=4)),
    # rows of no 16-column chunk: chunks with a masked last one (H200 tuner, twenty-fifth
    # session: fp32 D=24 H=8 286 -> 243 us, bf16 D=24 H=32 477 -> 299, fp32 D=40 H=2 371 -> 211,
    # bf16 D=100 H=2 289 -> 222; twenty-fourth session's A/B: fp32 D=100 H=16 518 -> 233)
    (24, 8, torch.float32, dict(use_dot=True, block_b=64, num_warps=4, block_k=16, k_loop=0)),
    (24, 32, torch.bfloat16, dict(use_dot=True, block_b=128, num_warps=4, block_k=16, k_loop=0)),
    (40, 2, torch.float32, dict(use_dot=True, block_b=64, num_warps=4, block_k=16, k_loop=0)),
    (100, 16, torch.bfloat16, dict(use_dot=True, block_b=128, num_warps=4, block_k=16, k_loop=1)),
    (100, 16, torch.float32, dict(use_dot=True, block_b=64, num_warps=4, block_k=32, k_loop=1)),
]


@pytest.mark.parametrize("D,H,dtype,knobs", OFF_GRID)
def test_off_grid_masked_configs_match_float64(D, H, dtype, knobs):
    cfg = configs.heuristic_forward(D, H, dtype, False)
    assert {k: getattr(cfg, k) for k in knobs} == knobs
    forward_matches_float64(Case(2, cfg.block_b + 3, D, H, feature_dim=1, strided_view=True, ln="per_feature"),
                            dtype, cfg)
