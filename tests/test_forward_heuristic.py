"""The 16-bit tl.dot forward's heuristic configs (a GPU without a table entry for the shape; the
interpreter always): one program per 64+-row tile, whole rows at H <= 16 for power-of-two D and
chunks of half the row at H = 64 and for masked rows (`configs._heuristic_forward`). Each shape
runs the op as a caller does, on a batch that fills the tiles (the full-tile config: forward and
backward) and one that does not (the masked-tile config: its forward, with the row stats and relu
mask it saves for the backward, which would otherwise take most of the interpreter's time here),
against float64."""
import pytest
import torch

import recfuse
from op_cases import TOLERANCE, Case, check_against_float64, make_inputs, rel_err
from recfuse.ops import configs, launch

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
    """The op's training forward (`launch.forward` with saved stats) on a [B, F*D] buffer viewed as
    [B, F, D], with ``cfg``'s tiles, against float64 on the same rounded inputs: y, the saved row
    mean and rstd, and the relu mask bits where it saves them (z farther than 1e-2 from 0) - all
    the backward reads from it, without running the backward."""
    x, w, b, lw, lb, _ = (None if t is None else t.to(dtype) for t in make_inputs(case))
    B, F, D = x.shape
    view = x.reshape(B, F * D).view(B, F, D)
    with launch.trace_launches() as seen:
        y, stats = launch.forward(view, w, b, lw, lb, case.eps, 1, save_stats=True)
    (_, _, meta, *_), = seen
    assert (meta["BLOCK_B"], meta["BLOCK_D"]) == (cfg.block_b, cfg.block_d), meta
    x64, w64, b64, lw64, lb64 = (t.double() for t in (x, w, b, lw, lb))
    z64 = recfuse.reference.feature_mlp(x64, w64, b64, ln_weight=lw64, ln_bias=lb64, eps=case.eps, feature_dim=1,
                                        out_activation=None)
    assert rel_err(y, z64.clamp_min(0)) < TOLERANCE[dtype]
    mean64 = x64.mean(-1).T
    rstd64 = torch.rsqrt(x64.var(-1, unbiased=False) + case.eps).T
    assert (stats[0] - mean64).abs().max() < 1e-6 * x64.abs().max()
    assert ((stats[1] - rstd64).abs() / rstd64).max() < 1e-5
    if stats.shape[0] > 2:
        words = stats[2:].contiguous().view(torch.int32).long()  # [words, F, B]
        hs = torch.arange(case.H)
        bits = (words[hs // 32].permute(2, 1, 0) >> (hs % 32)) & 1  # [B, F, H]
        decided = z64.abs() > 1e-2
        assert torch.equal(bits.bool()[decided], (z64 > 0)[decided])


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
