"""Masked columns (D not a power of two, no 16-column chunk): the kernels are told the power of two
that D and the row strides are multiples of (`launch.column_alignment`, `kernels._multiple_of`) so
that masked column loads vectorise. A claim that is not true would misalign vector accesses on a
GPU, so the value is checked against the strides here, and the kernels are compared with float64
on layouts whose alignment is 8, 4, 2 and 1 (a buffer with a padded row)."""
import pytest
import torch

import recfuse
from op_cases import INTERPRETER_AND_CUDA, Case, check_against_float64
from recfuse.ops import configs, launch
from recfuse.reference import batched_ln_tanh_linear_relu


@pytest.mark.parametrize("D,strides,expected", [
    (24, (24, 1536), 8),      # torchrec [B, F*D] view, F=64
    (24, (25, 1600), 1),      # rows padded to 25 columns
    (100, (100, 6400), 4),
    (160, (0, 10240), 16),    # a shared parameter's stride 0 says nothing
    (48, (48 * 300, 48), 16),  # [F, B, D]
    (20, (20, 60, 40), 4),
    (0, (), 16),
])
def test_column_alignment_divides_D_and_every_stride(D, strides, expected):
    align = launch.column_alignment(D, *strides)
    assert align == expected
    assert all(v % align == 0 for v in (D, *strides))


# The interpreter runs these in CI; on a GPU the same cases run compiled (vector accesses that a
# wrong alignment would misalign exist only there).
DEVICES = INTERPRETER_AND_CUDA


def _inputs(F, B, D, H, pad, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # x sliced after the cast and the move: either, of a non-dense slice, would come back contiguous
    x = torch.randn(B, F, D + pad, generator=g, dtype=torch.float64).to(dtype).to(device)[:, :, :D]
    assert x.stride() == (F * (D + pad), D + pad, 1)  # feature_dim=1
    w = torch.randn(F, H, D, generator=g, dtype=torch.float64) / D ** 0.5
    b = 0.1 + 0.1 * torch.randn(F, H, generator=g, dtype=torch.float64)
    lw = 1 + 0.2 * torch.randn(F, D, generator=g, dtype=torch.float64)
    lb = 0.2 * torch.randn(F, D, generator=g, dtype=torch.float64)
    return [x] + [t.to(dtype).to(device) for t in (w, b, lw, lb)]


def _assert_close_to_float64(y, gy, tensors, dtype):
    """y and every input's gradient (after ``y.backward(gy)``) against the float64 composite."""
    ref_in = [t.detach().double().requires_grad_() for t in tensors]
    ref = batched_ln_tanh_linear_relu(*ref_in, 1e-5, 1)
    ref.backward(gy)
    y_tol, g_tol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 3e-2)
    assert (y.double() - ref).abs().max().item() <= y_tol * ref.abs().max().item()
    for t, r in zip(tensors, ref_in):
        err = ((t.grad.double() - r.grad).norm() / r.grad.norm()).item()
        assert err <= g_tol, (t.shape, err)


def test_plans_state_the_alignment_of_masked_columns_only():
    x, w, b, lw, lb = _inputs(3, 20, 24, 8, 0, torch.float32)
    assert launch.forward_plan(x, w, b, lw, lb, 1e-5, 1, save_stats=False).meta["D_ALIGN"] == 8
    x, w, b, lw, lb = _inputs(3, 20, 24, 8, 1, torch.float32)
    assert launch.forward_plan(x, w, b, lw, lb, 1e-5, 1, save_stats=False).meta["D_ALIGN"] == 1
    x, w, b, lw, lb = _inputs(3, 20, 32, 8, 0, torch.float32)  # full rows: no masks to state it for
    assert "D_ALIGN" not in launch.forward_plan(x, w, b, lw, lb, 1e-5, 1, save_stats=False).meta
    # The whole-row backward over masked columns: D=24 is told 8; at D=48 (a multiple of 16, as
    # are its strides) Triton's own specialisation says it, and the kernel compiles as without it.
    whole_rows = dict(use_dot=True, block_b=16, block_k=0, prefetch=0, programs_per_sm=1)
    for D, expected in ((24, 8), (48, None)):
        x, w, b, lw, lb = _inputs(3, 20, D, 8, 0, torch.float32)
        with _forced_backward(whole_rows):
            plan = launch.backward_plan(torch.zeros(20, 3, 8), x, w, b, lw, lb, 1e-5, 1, torch.zeros(4, 3, 20))
        assert not plan.meta["EVEN_D"] and plan.meta.get("D_ALIGN") == expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,H,pad", [(24, 2, 0), (24, 8, 0), (24, 8, 1), (40, 16, 0), (100, 4, 0), (24, 32, 2)])
def test_masked_columns_match_float64(D, H, pad, dtype, device):
    """Forward and every gradient against the float64 composite, alignment 8/4/2/1 (pad 0/1/2)."""
    tensors = [t.requires_grad_() for t in _inputs(3, 37, D, H, pad, dtype, seed=D + H + pad, device=device)]
    assert tensors[0].stride(1) == D + pad
    y = recfuse.ln_tanh_linear_relu(tensors[0], tensors[1], tensors[2], ln_weight=tensors[3], ln_bias=tensors[4],
                                    feature_dim=1)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    y.backward(gy.to(dtype))
    _assert_close_to_float64(y, gy, tensors, dtype)


@pytest.mark.interpret
def test_torchrec_view_at_D24_matches_float64():
    check_against_float64(Case(3, 40, 24, 8, feature_dim=1, strided_view=True, ln="per_feature"), torch.float32)


# Column-chunked backwards with a masked last chunk (D not a whole number of chunks): the K-chunked
# kernel, the two-pass kernel (both passes) and the split weight-gradient kernel state D_ALIGN too.
CHUNKED_BACKWARDS = {
    "k_chunked": dict(use_dot=True, block_b=16, block_k=32, prefetch=0, programs_per_sm=1),
    "two_pass": dict(use_dot=True, block_b=16, block_k=0, prefetch=0, programs_per_sm=1, two_pass=32, dw_block_b=16),
    "split_dw": dict(use_dot=True, block_b=16, block_k=0, prefetch=0, programs_per_sm=1, split_dw=32, dw_block_b=16),
}


def _forced_backward(knobs):
    return configs.override(backward=lambda D, H, dt: configs.heuristic_backward(D, H, dt, **knobs))


@pytest.mark.parametrize("path", sorted(CHUNKED_BACKWARDS))
def test_chunked_backward_plans_state_the_alignment(path):
    x, w, b, lw, lb = _inputs(3, 20, 100, 16, 0, torch.float32)
    gy = torch.zeros(20, 3, 16)
    stats = torch.zeros(4, 3, 20)
    with _forced_backward(CHUNKED_BACKWARDS[path]):
        plan = launch.backward_plan(gy, x, w, b, lw, lb, 1e-5, 1, stats)
    metas = [plan.meta] + ([plan.weight_meta] if plan.weight_meta is not None else [])
    assert any(m.get("D_ALIGN") == 4 for m in metas)
    assert all(m.get("D_ALIGN") in (None, 4) for m in metas)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", sorted(CHUNKED_BACKWARDS))
@pytest.mark.parametrize("D,pad,dtype", [(100, 0, torch.float32), (72, 1, torch.bfloat16)])
def test_chunked_backward_with_a_masked_last_chunk_matches_float64(path, D, pad, dtype, device):
    H = 16
    tensors = [t.requires_grad_() for t in _inputs(3, 37, D, H, pad, dtype, seed=D + pad, device=device)]
    gy = torch.randn(37, 3, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    with _forced_backward(CHUNKED_BACKWARDS[path]), launch.trace_launches() as seen:
        y = recfuse.ln_tanh_linear_relu(tensors[0], tensors[1], tensors[2], ln_weight=tensors[3],
                                        ln_bias=tensors[4], feature_dim=1)
        y.backward(gy.to(dtype))
    # the forced path ran, told its alignment (8 at D=100 is 4; a padded row of 73 columns is 1)
    backward_metas = [m for kind, _, m, _ in seen if kind == "backward"]
    assert backward_metas and all(m.get("D_ALIGN", 1) == (4 if pad == 0 else 1) for m in backward_metas)
    if path == "two_pass":
        assert [m.get("DX_PASS") for m in backward_metas] == [False]
    if path == "k_chunked":
        assert backward_metas[0]["BLOCK_K"] == 32
    ref_in = [t.detach().double().requires_grad_() for t in tensors]
    batched_ln_tanh_linear_relu(*ref_in, 1e-5, 1).backward(gy)
    g_tol = 1e-4 if dtype == torch.float32 else 3e-2
    for t, r in zip(tensors, ref_in):
        err = ((t.grad.double() - r.grad).norm() / r.grad.norm()).item()
        assert err <= g_tol, (path, t.shape, err)


@pytest.mark.parametrize("D", [20, 24, 40, 63, 65, 100, 200, 300, 600, 1000, 1020])
@pytest.mark.parametrize("H", [2, 5, 16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_no_16_column_chunk_take_the_masked_chunk_loop(D, H, dtype):
    """Their whole padded rows were slower (H200 tuner: fp32 D=40 H=2 371 -> 211 us, bf16 D=300
    H=2 346 -> 196) and past 256 columns did not fit shared memory (bf16 D=1000 H=32: 452 KB at 64
    rows; Hopper has 227): the heuristic's forward is the chunk loop with a masked last chunk,
    within `DOT_STAGE_BYTES`, except where the tuner found another path as fast: D < 32 at small H
    (fp32 one output column at a time, 16-bit whole rows) and fp32 D < 256 at H < 5 (the row
    path)."""
    cfg = configs.heuristic_forward(D, H, dtype, full_tiles=False)  # masked columns: masked-tile config
    fp32 = dtype == torch.float32
    if (D < 32 and (H < configs.DOT_MIN_H if fp32 else H <= 16)) or (fp32 and 64 < D < 256 and H < configs.DOT_MIN_H):
        assert not cfg.block_k or not cfg.use_dot, cfg
        return
    assert cfg.use_dot and cfg.block_k and D % cfg.block_k, cfg
    assert bool(cfg.k_loop) == (D > 64), cfg  # a runtime loop past 4 chunks of 16
    assert configs.dot_stage_bytes(cfg, dtype) <= configs.DOT_STAGE_BYTES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D,H,dtype", [(1000, 32, torch.bfloat16), (600, 16, torch.bfloat16), (300, 16, torch.float32),
                                       (100, 8, torch.bfloat16), (40, 2, torch.float32), (24, 32, torch.bfloat16),
                                       (72, 16, torch.float16)])
def test_the_heuristics_masked_chunk_loop_matches_float64(D, H, dtype, device):
    """The heuristic's own masked-chunk tiles (`configs._masked_chunk_loop`: 16-column chunks
    unrolled up to 64 columns, a runtime loop of 16-64-column chunks past), forward and every
    gradient, with the kernel (not a fallback) taking MASK_K."""
    if device == "cpu" and D >= 512:
        pytest.skip("interpreter time; D=100 and the forced masked-chunk cases run there")
    F, B = (1, 20) if device == "cpu" else (2, 1000)  # the interpreter: one tile, masked
    cfg = configs.heuristic_forward(D, H, dtype, full_tiles=False)
    tensors = [t.requires_grad_() for t in _inputs(F, B, D, H, 0, dtype, seed=5, device=device)]
    with configs.override(use_tables=False), launch.trace_launches() as seen:
        y = recfuse.ln_tanh_linear_relu(tensors[0], tensors[1], tensors[2], ln_weight=tensors[3],
                                        ln_bias=tensors[4], feature_dim=1)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(device)
        y.backward(gy.to(dtype))
    forward_metas = [m for kind, _, m, _ in seen if kind == "forward"]
    assert forward_metas and forward_metas[0]["BLOCK_B"] == cfg.block_b and forward_metas[0]["MASK_K"]
    _assert_close_to_float64(y, gy, tensors, dtype)


def test_the_heuristics_forward_tiles_fit_the_stage_budget():
    """Over masked and full tiles, every D up to 1024 and H up to 64: the heuristic's tl.dot
    forward tiles (whole rows, or chunks where not even 16 whole rows fit) stay within
    `DOT_STAGE_BYTES`."""
    for dtype in (torch.float32, torch.bfloat16):
        for D in range(16, 1025, 4):
            for H in (5, 8, 16, 32, 64):
                for full in (True, False):
                    cfg = configs.heuristic_forward(D, H, dtype, full)
                    if cfg.use_dot and not cfg.persistent:
                        assert configs.dot_stage_bytes(cfg, dtype) <= configs.DOT_STAGE_BYTES, (D, H, dtype, full, cfg)


# The forward's chunk loop with a partial last chunk (`MASK_K`): the chunk's own count in the
# statistics, masked loads, t and the weight zero past D.
MASKED_CHUNKS = [
    # (D, H, dtype, knobs)
    (100, 16, torch.float32, dict(block_k=32, k_loop=0)),  # 3 whole chunks + 4 columns, unrolled
    (100, 16, torch.float32, dict(block_k=32, k_loop=1)),  # the same in the runtime loop
    (72, 32, torch.bfloat16, dict(block_k=64, k_loop=1)),  # one whole chunk + 8 columns
    (40, 8, torch.bfloat16, dict(block_k=32, k_loop=0)),
    (1000, 32, torch.float32, dict()),  # the heuristic's own (on a GPU: interpreter time)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D,H,dtype,knobs", MASKED_CHUNKS)
def test_forward_chunks_with_a_masked_last_chunk_match_float64(D, H, dtype, knobs, device):
    if device == "cpu" and D >= 512:
        pytest.skip("interpreter time; D = 40-100 run there")
    # D not a power of two: the masked-tile config; no knobs: the heuristic's own
    forced = dict(use_dot=True, block_b=16, num_warps=4, **knobs) if knobs else {}
    cfg = configs.heuristic_forward(D, H, dtype, False, **forced)
    assert cfg.block_k and D % cfg.block_k, cfg
    for ln in ("per_feature", "none"):
        case = Case(2, 37 if device == "cpu" else 1037, D, H, feature_dim=1, strided_view=True, ln=ln)
        with configs.override(forward=cfg), launch.trace_launches() as seen:
            check_against_float64(case, dtype, device=device)
        metas = [m for kind, _, m, _ in seen if kind == "forward"]
        assert metas and all(m["MASK_K"] and m["BLOCK_K"] == cfg.block_k
                             and m["K_CHUNKS"] == -(-D // cfg.block_k) for m in metas)


@pytest.mark.parametrize("device", DEVICES)
def test_masked_last_chunk_keeps_rms_norm_statistics(device):
    """RMSNorm over masked chunks: the mean square over D columns, not over the padded chunks."""
    from recfuse.chain import chain_of

    cfg = configs.heuristic_forward(100, 16, torch.float32, False, use_dot=True, block_b=16, num_warps=4, block_k=32,
                                    k_loop=1)
    case = Case(2, 37 if device == "cpu" else 1037, 100, 16, ln="none")
    with configs.override(forward=cfg):
        check_against_float64(case, torch.float32, device=device, chain=chain_of("rms_norm", "tanh", "relu"))
