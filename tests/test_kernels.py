"""The Triton kernels themselves, run under the Triton interpreter on CPU (TRITON_INTERPRET=1).

`make test-interpret` runs these; on a CUDA machine the cuda-parametrised tests of test_op_trust.py,
test_cuda_graph_training.py and test_feature_mlp.py check the kernels at realistic sizes. Grids
stay small here: the interpreter runs numpy per program.
"""
import pytest
import torch
import triton
import triton.language as tl

import recfuse
from recfuse.ops import configs, launch
from op_cases import (BACKWARD_PATH_CASES, Case, assert_backward_close, chain_backward_inputs, check_against_float64, check_nan_parity,
                      check_training_forward_against_float64,
                      forced_backward, make_inputs, rel_err, run_op)
from recfuse.chain import DEFAULT as DEFAULT_CHAIN, chain_of
from recfuse.ops.composite import composite_backward

pytestmark = pytest.mark.interpret

CASES = [
    Case(3, 5, 7, 1),
    Case(2, 3, 7, 3, feature_dim=1, per_feature_weight=True, bias="per_feature"),
    Case(1, 1, 1, 1, ln="shared"),
    Case(2, 4, 100, 2, ln="shared", eps=0.0),
    Case(2, 17, 20, 16, feature_dim=1, strided_view=True, ln="none", bias="none"),
    Case(3, 2, 9, 6, per_feature_weight=True, ln="per_feature", eps=0.0),
    Case(4, 3, 33, 1, feature_dim=1, strided_view=True, eps=0.0, ln="none"),
    Case(1, 2, 300, 20, bias="per_feature"),
    Case(2, 2, 1000, 1, ln="per_feature"),
    # Full tiles (D == BLOCK_D, B a multiple of the row tile): the maskless EVEN_D/EVEN_B kernels.
    EVEN_ROW_CASE := Case(2, 128, 16, 1, ln="per_feature", bias="per_feature"),
    EVEN_DOT_CASE := Case(2, 128, 16, 16, ln="shared", eps=0.0),  # B: a whole 128-row backward tile
    # Default configs of the tl.dot forward with full tiles (the interpreter counts 2 SMs):
    # 16-bit H in (16, 32]: persistent whole rows, 3 tiles of 64 rows in one program;
    # 16-bit H > 32: one program per 64-row tile, K-chunked (64 of 128 columns: half the row);
    # fp32: one program per 64-row tile, K-chunked (32 of 64 columns).
    PERSISTENT_16BIT_CASE := Case(2, 192, 16, 20, ln="shared"),
    CHUNKED_16BIT_CASE := Case(1, 192, 128, 40, feature_dim=1, per_feature_weight=True, bias="per_feature"),
    CHUNKED_FP32_CASE := Case(2, 64, 64, 16, ln="per_feature", eps=0.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_float64_reference(case, dtype):
    check_against_float64(case, dtype)


@pytest.mark.parametrize("case, even", [(EVEN_ROW_CASE, True), (EVEN_DOT_CASE, True), (CASES[0], False)], ids=str)
def test_full_tiles_take_the_maskless_kernels(case, even):
    # The cases above check the numbers; this checks that they cover both specialisations.
    with launch.trace_launches() as launches:
        run_op(recfuse.ln_tanh_linear_relu, make_inputs(case), torch.float32, case)
    seen = [(meta["EVEN_D"], meta["EVEN_B"]) for _, _, meta, _ in launches]
    assert len(seen) == 2 and all(flags == (even, even) for flags in seen), seen


@pytest.mark.parametrize("case, dtype, programs, block_k, persistent", [
    (PERSISTENT_16BIT_CASE, torch.bfloat16, 1, 16, True), (CHUNKED_16BIT_CASE, torch.bfloat16, 3, 64, False),
    (CHUNKED_FP32_CASE, torch.float32, 1, 32, False)], ids=str)
def test_dot_forward_defaults_take_the_persistent_and_chunked_paths(case, dtype, programs, block_k, persistent):
    # The float64 comparison above checks the numbers; this checks which paths those cases take:
    # the grid (several tiles per persistent program, else one program a tile) and the columns
    # per chunk. The persistent K-chunked forward runs forced in CHUNKED_CASES below.
    with launch.trace_launches() as launches:
        run_op(recfuse.ln_tanh_linear_relu, make_inputs(case), dtype, case)
    seen = [(grid, meta, meta["PERSISTENT"], meta["BLOCK_B"], meta["BLOCK_K"])
            for kind, grid, meta, _ in launches if kind == "forward"]
    (grid, meta, is_persistent, block_b, k), = seen
    n_programs = launch.row_programs(grid, meta)
    assert n_programs == programs and k == block_k and is_persistent == persistent, seen
    tiles = case.B // block_b
    assert tiles == (3 if is_persistent else n_programs), seen  # persistent: 3 tiles in its one program


# Small H and narrow rows (defaults from the H100 tuner): the forward of H=2-4 on the 16-wide
# tl.dot, in whole 32-column chunks of D=160; the backward per output column (`unroll_h`) in tiles
# of ~16 elements a thread (64 rows of 32 columns, 4 warps).
SMALL_H_CASES = [
    (Case(2, 40, 160, 4, feature_dim=1, ln="per_feature"), torch.float32, 32, (False, None)),
    (Case(2, 256, 32, 3, ln="shared", bias="per_feature"), torch.bfloat16, 32, (False, 64)),
]


@pytest.mark.parametrize("case, dtype, block_k, backward", SMALL_H_CASES, ids=str)
def test_small_h_defaults_take_the_dot_path_in_chunks_and_long_row_tiles(case, dtype, block_k, backward):
    with launch.trace_launches() as launches:
        check_against_float64(case, dtype)
    seen = {kind: (meta["USE_DOT"], meta.get("BLOCK_K", 0), meta["BLOCK_B"]) for kind, _, meta, _ in launches}
    assert seen["forward"][:2] == (True, block_k), seen
    use_dot, rows = backward
    assert seen["backward"][0] == use_dot and rows in (None, seen["backward"][2]), seen
    assert [meta.get("UNROLL_H", False) for kind, _, meta, _ in launches if kind == "backward"] == [True]


@pytest.mark.parametrize("feature_dim, strided_copy", [(0, True), (1, False)])
def test_contiguous_y_rows_with_saved_stats_take_the_unspecialised_kernel(feature_dim, strided_copy):
    # H=1 in [F, B, D] layout with a backward to follow: y rows are contiguous (stride 1), which
    # Triton would specialise on (a slow kernel on the H100); the copy compiled without it runs.
    case = Case(2, 16, 8, 1, feature_dim=feature_dim)
    with launch.trace_launches() as launches:
        check_against_float64(case, torch.float32)
    seen = ["_launch_fwd" if specialised else "_launch_fwd_y_strided"
            for kind, _, _, specialised in launches if kind == "forward"]
    assert seen == ["_launch_fwd_y_strided" if strided_copy else "_launch_fwd"], seen


CHUNKED_CASES = [  # (case, forced config changes): the K-chunked forward, 16 columns at a time
    (Case(2, 32, 64, 16, ln="per_feature"), dict(block_b=16)),
    (Case(3, 20, 32, 24, feature_dim=1, per_feature_weight=True, bias="per_feature", ln="shared", eps=0.0),
     dict(block_b=16)),
    (Case(2, 48, 32, 40, feature_dim=1, strided_view=True, ln="none"), dict(block_b=16, persistent=1, tile_stages=2)),
    # D not a power of two, a whole number of chunks: 3 and 5 chunks, no padded columns
    (Case(2, 24, 48, 16, ln="per_feature", bias="per_feature"), dict(block_b=16)),
    (Case(1, 40, 80, 8, feature_dim=1, ln="shared"), dict(block_b=16, persistent=1, tile_stages=2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case, changes", CHUNKED_CASES, ids=str)
def test_k_chunked_forward_matches_float64(case, changes, dtype):
    # Chunk by chunk statistics (Chan's combination) and dots: y and the row stats and relu mask
    # the backward reads (the backward is the usual kernel, tested on its own).
    def chunked(D, H, dt, full_tiles=True):
        return configs.heuristic_forward(D, H, dt, full_tiles, block_k=16, **changes)

    with configs.override(forward=chunked):
        launches = check_training_forward_against_float64(case, dtype)
    seen = [(meta["BLOCK_K"], meta["K_CHUNKS"]) for kind, _, meta, _ in launches if kind == "forward"]
    assert seen == [(16, case.D // 16)], seen


# Each case in one dtype, alternating (the unrolled chunks above run both): the loop's code is
# the same for either, and interpreter time is CI's budget.
CHUNK_LOOP_CASES = [(case, changes, (torch.float32, torch.bfloat16)[i % 2])
                    for i, (case, changes) in enumerate(CHUNKED_CASES)]


@pytest.mark.parametrize("case, changes, dtype", CHUNK_LOOP_CASES, ids=str)
def test_chunk_loop_forward_matches_float64(case, changes, dtype):
    # The same chunks walked by a runtime loop (`ForwardConfig.k_loop`), 1 or 2 deep: the
    # statistics' combination weights are computed at run time instead of compile time.
    k_loop = 2 if case.D in (48, 64) else 1  # each depth runs, with 2, 3, 4 and 5 chunks

    def chunk_loop(D, H, dt, full_tiles=True):
        return configs.heuristic_forward(D, H, dt, full_tiles, block_k=16, k_loop=k_loop, **changes)

    with configs.override(forward=chunk_loop):
        launches = check_training_forward_against_float64(case, dtype)
    seen = [(meta["BLOCK_K"], meta["K_CHUNKS"], meta["K_LOOP"]) for kind, _, meta, _ in launches if kind == "forward"]
    assert seen == [(16, case.D // 16, k_loop)], seen


PERSISTENT_ROW_CASES = [  # (case, block_h): the row path (no tl.dot) with persistent programs
    (Case(2, 37, 32, 1, ln="per_feature"), 1),
    (Case(3, 29, 48, 1, feature_dim=1, strided_view=True, ln="shared", bias="per_feature"), 1),
    (Case(2, 45, 40, 3, per_feature_weight=True, ln="per_feature"), 4),
    (Case(1, 64, 16, 4, ln="none", eps=0.0), 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case, block_h", PERSISTENT_ROW_CASES, ids=str)
def test_persistent_row_forward_matches_float64(case, block_h, dtype):
    # Few programs (one per SM: the interpreter counts 2), each walking several row tiles of its
    # feature with `tl.range(num_stages=3)`; masked columns (D=40, 48) and a last tile partly past B.
    def persistent_rows(D, H, dt, full_tiles=True):
        return configs.ForwardConfig(8, triton.next_power_of_2(D), block_h, False, 1, persistent=1, tile_stages=3)

    with configs.override(forward=persistent_rows):
        launches = check_training_forward_against_float64(case, dtype)
    seen = [(grid, meta["PERSISTENT"], meta["USE_DOT"]) for kind, grid, meta, _ in launches if kind == "forward"]
    assert len(seen) == 1 and seen[0][1:] == (True, False) and seen[0][0][0] < triton.cdiv(case.B, 8), seen


@pytest.mark.parametrize("D, H, dtype", [(48, 16, torch.float32), (160, 8, torch.float32), (96, 64, torch.bfloat16),
                                         (64, 16, torch.float32)])
def test_masked_tiles_take_the_chunked_forward_by_default(D, H, dtype):
    # No forced config, masked rows (B=20): the heuristic chunks D where it divides into chunks
    # (no padded columns at D=48, 96, 160), and fp32 takes chunks for masked rows at any D.
    case = Case(2, 20, D, H, feature_dim=1, ln="per_feature")
    launches = check_training_forward_against_float64(case, dtype)
    seen = [(meta["BLOCK_K"], meta["K_CHUNKS"], meta["EVEN_D"], meta["EVEN_B"])
            for kind, _, meta, _ in launches if kind == "forward"]
    width = configs.chunk_width(D, 32 if dtype == torch.float32 and H <= 16 else 64)
    assert seen == [(width, D // width, D == triton.next_power_of_2(D), False)], seen


@pytest.mark.parametrize("D, H, dtype, k_loop, B", [(256, 16, torch.bfloat16, 1, 32), (160, 40, torch.bfloat16, 1, 64),
                                                     (512, 16, torch.float32, 1, 32), (256, 16, torch.float32, 0, 32),
                                                     (256, 4, torch.bfloat16, 1, 32)])
def test_wide_chunked_rows_take_the_chunk_loop_by_default(D, H, dtype, k_loop, B):
    # No forced config: 16-bit rows of 4+ chunks and fp32 rows of 16+ walk them in a runtime loop
    # (whole row tiles: B a multiple of the tile, the heuristic's 32 or 64 rows); bf16 at H = 4
    # as a 16-wide tl.dot too (the row path before).
    case = Case(1, B, D, H, ln="per_feature")
    launches = check_training_forward_against_float64(case, dtype)
    seen = [meta["K_LOOP"] for kind, _, meta, _ in launches if kind == "forward"]
    assert seen == [k_loop], seen


def test_float16_dot_path():
    check_against_float64(Case(2, 16, 16, 16, per_feature_weight=True), torch.float16)


def test_kernels_are_what_runs(monkeypatch):
    calls = []
    for name in ("forward", "backward"):
        original = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    x = torch.randn(2, 3, 8, requires_grad=True)
    recfuse.ln_tanh_linear_relu(x, torch.randn(1, 8)).sum().backward()
    assert calls == ["forward", "backward"]


def test_saved_row_stats_give_the_recomputed_gradients():
    # Eager autograd keeps the forward's mean/rstd for the backward; the custom op (compile,
    # export) recomputes them. Both must give the same gradients.
    case = Case(3, 40, 24, 3, per_feature_weight=True, ln="per_feature", bias="per_feature")
    tensors = make_inputs(case)
    x, w, b, lw, lb, gy = tensors
    stats_saved = launch.forward(x, w, b, lw, lb, case.eps, case.feature_dim, save_stats=True)[1]
    via_stats = launch.backward(gy, x, w, b, lw, lb, case.eps, case.feature_dim, stats_saved)
    recomputed = launch.backward(gy, x, w, b, lw, lb, case.eps, case.feature_dim)
    for a, r in zip(via_stats, recomputed):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)
    mean = x.mean(-1)
    rstd = torch.rsqrt(x.var(-1, unbiased=False) + case.eps)
    torch.testing.assert_close(stats_saved, torch.stack([mean, rstd]).float(), rtol=1e-5, atol=1e-6)


def test_backward_is_bitwise_deterministic():
    case = Case(3, 40, 24, 8, per_feature_weight=False, ln="shared")
    tensors = make_inputs(case)
    first = run_op(recfuse.ln_tanh_linear_relu, tensors, torch.float32, case)
    second = run_op(recfuse.ln_tanh_linear_relu, tensors, torch.float32, case)
    for a, b in zip([first[0]] + first[1], [second[0]] + second[1]):
        assert torch.equal(a, b)


def test_nan_exactly_where_pytorch_gives_nan():
    check_nan_parity((2, 3, 8), (1, 2))


def test_empty_batch_and_zero_grad_parameters():
    x = torch.randn(0, 3, 8, requires_grad=True)
    w = torch.randn(3, 2, 8, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    y = recfuse.ln_tanh_linear_relu(x, w, b, feature_dim=1)
    assert y.shape == (0, 3, 2)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_wide_rows_take_the_k_chunked_backward():
    # H * D past the whole-row kernel's register tile (it fell back to the composite before the
    # K-chunked kernel existed): 32 columns at a time in fp32 at H > 16 (64 spilled on the H100).
    # D=256 runs the same kernel as D=1024 in a quarter of the interpreter's time (CI); its default is
    # the GEMM backward (`BackwardConfig.gemm`), so the fused kernels' own config is forced here.
    assert configs.backward_config(1024, 64, torch.float32, "cpu").block_k == 32
    fused = lambda D, H, dt: configs.heuristic_backward(D, H, dt, gemm=0)  # noqa: E731
    for D in (256, 1024):
        cfg = fused(D, 64, torch.float32)
        assert cfg.use_dot and cfg.block_k == 32, D
    with configs.override(backward=fused), launch.trace_launches() as seen:
        check_against_float64(Case(1, 2, 256, 64, ln="none"), torch.float32)
    assert [(m["BLOCK_K"], m["EVEN_D"]) for kind, _, m, _ in seen if kind == "backward"] == [(32, True)]


def test_wide_bf16_rows_take_the_whole_row_backward():
    # A [64, 512] bf16 weight tile still fits the whole-row kernel (16-row tiles; 1.4x faster than
    # chunks on the H100); D=480 pads to 512. The heuristic's default there is the GEMM backward
    # (`configs.GEMM_REGIONS`), so the fused kernels' own config is forced.
    assert configs.backward_config(480, 60, torch.bfloat16, "cpu").gemm
    fused = lambda D, H, dt: configs.heuristic_backward(D, H, dt, gemm=0)  # noqa: E731
    cfg = fused(480, 60, torch.bfloat16)
    assert cfg.use_dot and not cfg.block_k and cfg.block_b == 16
    with configs.override(backward=fused), launch.trace_launches() as seen:
        check_against_float64(Case(1, 6, 480, 60, ln="per_feature"), torch.bfloat16)
    assert [("BLOCK_K" in m, m["EVEN_D"]) for kind, _, m, _ in seen if kind == "backward"] == [(False, False)]


def test_backward_falls_back_beyond_kernel_tile():
    # The row path's [rows, H, D] product past its tile: the composite backward takes over.
    assert configs.backward_config(16384, 2, torch.float32, "cpu") is None


@pytest.mark.parametrize("case, chain", [
    (Case(2, 64, 64, 16, ln="per_feature", bias="per_feature"), DEFAULT_CHAIN),
    (Case(2, 33, 40, 20, feature_dim=1, strided_view=True, per_feature_weight=True, ln="shared"), DEFAULT_CHAIN),
    # dz = grad_y * sigmoid'(z) is not a bf16 value: its lo part is multiplied too.
    (Case(2, 48, 32, 16, ln="per_feature"), chain_of("rms_norm", "silu", "sigmoid")),
], ids=str)
def test_bf16_backward_dots_on_bf16_operands(case, chain, monkeypatch):
    # bf16 inputs take the backward's bf16 tensor-core path (t, and dz where it is not a bf16
    # value, split into hi + lo bf16 parts; the interpreter multiplies the same bf16 values in
    # fp32). It must agree with the fp32-operand path it replaces, and with float64 within the
    # 16-bit contract.
    x, w, b, lw, lb, gy = [None if t is None else t.to(torch.bfloat16) for t in make_inputs(case)]
    if chain.norm == "rms_norm":
        lb = None
    args = (gy, x, w, b, lw, lb, case.eps, case.feature_dim)
    with launch.trace_launches() as seen:
        bf16_ops = launch.backward(*args, chain=chain)
    assert seen[-1][2]["BWD_DOT_DTYPE"] == tl.bfloat16 and seen[-1][2]["USE_DOT"]
    monkeypatch.setattr(launch, "_bwd_dot_dtype", lambda *a: tl.float32)
    launch._BACKWARD_PLANS.clear()
    fp32_ops = launch.backward(*args, chain=chain)
    launch._BACKWARD_PLANS.clear()
    reference = composite_backward(*[None if t is None else t.double() for t in args[:6]], case.eps,
                                   case.feature_dim, chain)
    for name, a, f, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), bf16_ops, fp32_ops, reference):
        if r is None or not f.numel():
            continue
        scale = r.norm().clamp_min(1e-12)
        # dx, bias and LayerNorm grads come out equal (without the lo part of a sigmoid's dz,
        # 5e-3 apart); the weight's takes t rounded to bf16, 2e-3 to 4e-3 apart.
        apart = ((a.double() - f.double()).norm() / scale).item()
        assert apart < (6e-3 if name == "weight" else 1e-3), name
        assert ((a.double() - r).norm() / scale).item() < 1e-2, name


@pytest.mark.parametrize("fp32_dots, tol", [("bf16x3", 1e-4), ("bf16x6", 1e-5), ("bf16x6z3", 1e-5)])
@pytest.mark.parametrize("case", [
    Case(2, 48, 40, 64, ln="per_feature", bias="per_feature", per_feature_weight=True),  # D not a power of 2
    Case(2, 32, 64, 16, feature_dim=1, ln="none", eps=0.0),
    Case(1, 40, 160, 4, ln="shared"),  # H=4 on the tl.dot path (forced below)
], ids=str)
def test_fp32_backward_dots_on_split_bf16_operands(case, fp32_dots, tol):
    # fp32 inputs on bf16 tensor cores: every fp32 operand (t, dz and the weight) split into 2
    # (bf16x3) or 3 (bf16x6) bf16 parts; the interpreter multiplies the same bf16 values in fp32.
    # Every gradient within the fp32 contract of float64: bf16x3 the tuner's 1e-4, bf16x6 (and
    # bf16x6z3, z in bf16x3) the tests' 1e-5. grad_y is zeroed at relu ties (|z64| < 1e-4, as benchmarks/tune_kernels.py
    # does): there rounding decides the mask on any path.
    x, w, b, lw, lb, gy = make_inputs(case, generator=torch.Generator().manual_seed(0))
    fm = (lambda t: t) if case.feature_dim == 0 else (lambda t: t.transpose(0, 1))
    xc = fm(x) - fm(x).mean(-1, keepdim=True)
    a = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + case.eps)
    per_f = lambda p: p[:, None] if p.dim() == 2 else p  # noqa: E731  [F, n] over [F, B, n]
    if lw is not None:
        a = a * per_f(lw) + per_f(lb)
    z = torch.tanh(a) @ w.transpose(-1, -2) + per_f(b)
    gy = gy.masked_fill(fm(z).abs() < 1e-4, 0)
    args = [None if t is None else t.float() for t in (gy, x, w, b, lw, lb)]
    forced = lambda D, H, dtype: configs.heuristic_backward(D, H, dtype, use_dot=True, fp32_dots=fp32_dots)  # noqa: E731
    with configs.override(backward=forced), launch.trace_launches() as seen:
        grads = launch.backward(*args, case.eps, case.feature_dim)
    meta = seen[-1][2]
    assert meta["USE_DOT"] and meta["BWD_DOT_DTYPE"] == tl.bfloat16 and meta["DOT_UPCAST"]
    assert (meta["SPLIT_Z"], meta["SPLIT_DT"], meta["SPLIT_DW"]) == launch._FP32_SPLITS[fp32_dots]
    reference = composite_backward(gy, x, w, b, lw, lb, case.eps, case.feature_dim)
    for name, g, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), grads, reference):
        if r is None or not g.numel():
            continue
        err = ((g.double() - r).norm() / r.norm().clamp_min(1e-12)).item()
        assert err < tol, f"{name}: {err:.2e}"


CHUNKED_BWD_CASES = BACKWARD_PATH_CASES


@pytest.mark.parametrize("saved_stats", [True, False], ids=["saved-stats", "recomputed-stats"])
@pytest.mark.parametrize("case, dtype, chain", CHUNKED_BWD_CASES, ids=str)
def test_k_chunked_backward_matches_float64_and_the_whole_row_kernel(case, dtype, chain, saved_stats):
    # `ln_tanh_linear_relu_bwd_chunked`: 16 columns at a time, 16-row tiles, one program per SM
    # (the interpreter counts 2), so programs walk several tiles. Against float64 (the contract)
    # and the whole-row kernel (same numbers up to summation order), with the forward's row
    # statistics and with its own.
    chain = chain or DEFAULT_CHAIN
    args, gy = chain_backward_inputs(case, dtype, chain, seed=1)
    stats = None
    if saved_stats:
        stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)[1]

    def run(block_k):
        return forced_backward(gy, args, case, stats, chain, use_dot=True, block_b=16, programs_per_sm=1,
                               block_k=block_k)

    chunked, meta = run(16)
    whole, whole_meta = run(0)
    assert meta["BLOCK_K"] == 16 and "BLOCK_K" not in whole_meta
    assert meta["LOAD_STATS"] == (saved_stats and chain.norm is not None)
    assert_backward_close(chunked, whole, gy, args, case, chain, dtype)


@pytest.mark.parametrize("case, dtype, block_k, persistent", [
    (Case(2, 37, 160, 1, feature_dim=1, ln="per_feature", bias="per_feature"), torch.float32, 32, 0),
    (Case(2, 40, 48, 3, ln="shared"), torch.bfloat16, 16, 0),
    (Case(3, 33, 96, 2, feature_dim=1, strided_view=True, ln="none", eps=0.0), torch.float32, 32, 2),
    (Case(1, 64, 160, 1, ln="per_feature"), torch.bfloat16, 32, 2),
], ids=str)
def test_k_chunked_row_forward_matches_float64(case, dtype, block_k, persistent):
    # The row path (no tl.dot, H <= 4) in whole chunks of a D that is not a power of two:
    # `_chunked_norm_act_linear` with a row reduction (H = 1) or a broadcast sum per chunk, masked
    # rows, persistent programs walking several tiles.
    block_h = min(4, triton.next_power_of_2(case.H))
    forced = configs.heuristic_forward(case.D, case.H, dtype, False, use_dot=False, block_b=8, num_warps=2,
                                       unroll_h=0, block_h=block_h, block_k=block_k, persistent=persistent,
                                       tile_stages=3 if persistent else 1)
    assert configs.forward_fits(forced, case.D, case.H)
    with configs.override(forward=forced):
        launches = check_training_forward_against_float64(case, dtype)
    meta = [m for kind, _, m, _ in launches if kind == "forward"][0]
    assert not meta["USE_DOT"] and meta["BLOCK_K"] == block_k and meta["K_CHUNKS"] == case.D // block_k


def test_k_chunked_backward_is_bitwise_deterministic():
    case = Case(1, 64, 48, 8, ln="per_feature")
    x, w, b, lw, lb, gy = make_inputs(case, generator=torch.Generator().manual_seed(2))
    args = [t.float() for t in (gy, x, w, b, lw, lb)]
    forced = lambda D, H, dt: configs.heuristic_backward(D, H, dt, use_dot=True, block_b=16,  # noqa: E731
                                                         programs_per_sm=1, block_k=16)
    with configs.override(backward=forced):
        first = launch.backward(*args, case.eps, case.feature_dim)
        second = launch.backward(*args, case.eps, case.feature_dim)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_fp32_default_backward_keeps_relu_masks_of_near_ties():
    # z decides the relu mask where the backward recomputes it (no mask saved by the forward). With
    # z from 3 bf16 products (the former default, "bf16x6z3") the ~1e-5 of |z| within its error of
    # 0 flipped masks, as the H100 showed in test_feature_mlp's CUDA case. Here one row's z is
    # +-1e-5 for every output: "bf16x6z3" and "bf16x3" gave x.grad 0.17 off float64 (all
    # gradients 0.16-0.17), the default (z in bf16x6) 1.5e-7.
    cfg = configs.backward_config(256, 64, torch.float32, "cpu")
    assert cfg.fp32_dots == "bf16x6" and launch._bwd_splits(torch.float32, cfg.fp32_dots, "relu")["SPLIT_Z"] == 3
    case = Case(F=1, B=16, D=256, H=64, feature_dim=0, ln="shared")
    x, w, b, lw, lb, gy = make_inputs(case, generator=torch.Generator().manual_seed(0))
    z = recfuse.reference.feature_mlp(x, w, b, ln_weight=lw, ln_bias=lb, eps=case.eps, feature_dim=0,
                                      norm="layer_norm", activation="tanh", out_activation=None)
    b = b - z[0, 3] + 1e-5 * (1 - 2 * (torch.arange(case.H) % 2))  # row 3: z = +-1e-5
    args = [t.float() for t in (gy, x, w, b, lw, lb)]
    with launch.trace_launches() as seen:
        grads = launch.backward(*args, case.eps, case.feature_dim)
    assert seen[-1][2]["SPLIT_Z"] == 3 and not seen[-1][2].get("LOAD_MASK")
    reference = composite_backward(*[t.double() for t in args], case.eps, case.feature_dim, DEFAULT_CHAIN)
    for name, g, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), grads, reference):
        assert rel_err(g, r) < 1e-5, name


def backward_inputs(case, dtype, chain, saved_stats, seed):
    """Inputs of a forced-config backward test: (args in ``dtype``, grad_y zeroed at relu ties,
    the forward's saved row stats or None, the float64 composite's gradients)."""
    x, w, b, lw, lb, gy = make_inputs(case, generator=torch.Generator().manual_seed(seed))
    if chain.norm != "layer_norm":
        lb = None
    args = [None if t is None else t.to(dtype) for t in (x, w, b, lw, lb)]
    gy = gy.to(dtype)
    x64, w64, b64, lw64, lb64 = (None if t is None else t.double() for t in args)
    if chain.out_activation == "relu":  # relu ties: rounding decides the mask on any path
        z = recfuse.reference.feature_mlp(x64, w64, b64, ln_weight=lw64, ln_bias=lb64, eps=case.eps,
                                          feature_dim=case.feature_dim, norm=chain.norm,
                                          activation=chain.activation, out_activation=None)
        gy = gy.masked_fill(z.abs() < 1e-3, 0)
    stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)[1] if saved_stats else None
    reference = composite_backward(gy.double(), x64, w64, b64, lw64, lb64, case.eps, case.feature_dim, chain)
    return args, gy, stats, reference


PREFETCH_CASES = [
    # (case, dtype, chain, use_dot): the row reduction (H=1), the broadcast sum (H=3), the tl.dot
    # path; masked columns (D=40, 48) and rows (B not a multiple of the tile), saved stats or not.
    (Case(2, 37, 32, 1, ln="per_feature"), torch.float32, None, False),
    (Case(2, 29, 40, 3, feature_dim=1, strided_view=True, ln="shared"), torch.float32, None, False),
    (Case(2, 45, 48, 16, ln="per_feature", bias="per_feature", per_feature_weight=True), torch.float32, None, True),
    (Case(1, 64, 64, 4, ln="none", eps=0.0), torch.bfloat16, None, True),
    (Case(2, 33, 32, 6, feature_dim=1, ln="per_feature"), torch.float32, chain_of("layer_norm", "gelu", "tanh"), True),
    (Case(2, 40, 32, 5, ln="none"), torch.float32, chain_of("rms_norm", "silu", None), True),
    (Case(1, 36, 16, 2, ln="none", bias="none"), torch.float32, chain_of(None, "sigmoid", "relu"), False),
]


@pytest.mark.parametrize("saved_stats", [True, False], ids=["saved-stats", "recomputed-stats"])
@pytest.mark.parametrize("case, dtype, chain, use_dot", PREFETCH_CASES, ids=str)
def test_prefetching_backward_matches_float64_and_the_plain_loop(case, dtype, chain, use_dot, saved_stats):
    # `prefetch=1`: the next row tile is loaded before this one is computed, and rows past a
    # program's last one re-read it (no row masks on the loads). 8-row tiles and one program per
    # SM (the interpreter counts 2), so programs walk several tiles, the last one partly padded.
    chain = chain or DEFAULT_CHAIN
    args, gy, stats, reference = backward_inputs(case, dtype, chain, saved_stats, seed=3)

    def run(prefetch):
        # (unroll_h=0: the prefetching loop and the plain one both take the broadcast sum)
        return forced_backward(gy, args, case, stats, chain, use_dot=use_dot, block_b=16 if use_dot else 8,
                               programs_per_sm=1, block_k=0, prefetch=prefetch, unroll_h=0)

    fetched, meta = run(1)
    plain, plain_meta = run(0)
    assert meta.get("PREFETCH") and not plain_meta.get("PREFETCH") and meta["USE_DOT"] == use_dot
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for name, g, gp, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), fetched, plain, reference):
        if r is None or not g.numel():
            continue
        assert g.shape == r.shape
        err = ((g.double() - r).norm() / r.norm().clamp_min(1e-12)).item()
        assert err < tol, f"{name}: {err:.2e}"
        # the same arithmetic on the same values: padded rows add exact zeros either way
        assert torch.equal(g, gp), name


@pytest.mark.parametrize("D, B, H", [(48, 40, 2), (40, 24, 16), (100, 56, 1)])
def test_masked_tile_config_decides_its_own_row_masks(D, B, H):
    """A D that is not a power of two takes the masked-tile config, whose row tiles may be longer
    than the full-tile config's: EVEN_B must be that config's. It was the full-tile config's, and
    on the H100 (fp32 D=160 H=2-4 B=1000: 8-row full tiles divide 1000, the masked config's 64 do
    not) the forward read and wrote past row B unmasked: y and every gradient wrong."""
    def forced(D, H, dtype, full_tiles):
        return configs.heuristic_forward(D, H, dtype, full_tiles, block_b=8 if full_tiles else 16)

    case = Case(F=2, B=B, D=D, H=H, feature_dim=1, strided_view=True, ln="per_feature")
    with configs.override(forward=forced), launch.trace_launches() as seen:
        check_against_float64(case, torch.float32)
    forward_meta = [m for kind, _, m, _ in seen if kind == "forward"]
    assert forward_meta and all(m["BLOCK_B"] == 16 and m["EVEN_B"] == (B % 16 == 0) for m in forward_meta)


UNROLL_H_CASES = [
    # (case, dtype, chain): H = 2, 3 (a padded fourth column), 4; masked columns (D=20, 33) and
    # rows (B not a multiple of the tile); every bias / LayerNorm-affine / weight sharing; the
    # other out-activations (none: no z at all; sigmoid, tanh) and norms.
    (Case(2, 37, 32, 4, ln="per_feature"), torch.float32, None),
    (Case(2, 29, 20, 3, feature_dim=1, strided_view=True, ln="shared", bias="per_feature"), torch.float32, None),
    (Case(3, 21, 33, 2, per_feature_weight=True, ln="none", bias="none", eps=0.0), torch.float32, None),
    (Case(2, 40, 16, 4, ln="per_feature", bias="per_feature", per_feature_weight=True), torch.bfloat16, None),
    (Case(2, 24, 32, 3, feature_dim=1, ln="per_feature"), torch.float32, chain_of("layer_norm", "gelu", "tanh")),
    (Case(1, 40, 32, 4, ln="none"), torch.float32, chain_of("rms_norm", "silu", None)),
    (Case(1, 36, 16, 2, ln="none", bias="none"), torch.bfloat16, chain_of(None, "sigmoid", "relu")),
    # BLOCK_H = 8: H = 6 (two padded columns) and 8
    (Case(2, 27, 24, 6, ln="per_feature", bias="per_feature", per_feature_weight=True), torch.float32, None),
    (Case(1, 40, 32, 8, feature_dim=1, ln="shared"), torch.bfloat16, None),
    # fp16 takes it by default too (its broadcast sum was the default before)
    (Case(2, 33, 48, 3, ln="per_feature", bias="per_feature"), torch.float16, None),
]


@pytest.mark.parametrize("saved_stats", [True, False], ids=["saved-stats", "recomputed-stats"])
@pytest.mark.parametrize("case, dtype, chain", UNROLL_H_CASES, ids=str)
def test_unrolled_small_h_backward_matches_float64_and_the_broadcast_sum(case, dtype, chain, saved_stats):
    # `unroll_h=1`: each output column a row reduction and 2D tiles, instead of the broadcast
    # sum's [rows, H, D] products (or, H > 4, the tl.dot path). 8- and 16-row tiles, one program
    # per SM (the interpreter counts 2), so programs walk several tiles, the last one partly
    # padded. Against float64 (the contract) and the broadcast sum (the same sums in another order).
    chain = chain or DEFAULT_CHAIN
    args, gy, stats, reference = backward_inputs(case, dtype, chain, saved_stats, seed=5)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}[dtype]
    runs = {}
    for unroll_h, block_b in ((1, 8), (1, 16), (0, 8)):
        grads, meta = forced_backward(gy, args, case, stats, chain, use_dot=False, block_b=block_b,
                                      programs_per_sm=1, block_k=0, unroll_h=unroll_h)
        assert bool(meta.get("UNROLL_H")) == bool(unroll_h) and not meta["USE_DOT"] and meta["BLOCK_B"] == block_b
        runs[unroll_h, block_b] = grads
        for name, g, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), grads, reference):
            if r is None or not g.numel():
                continue
            assert g.shape == r.shape and g.dtype == args[1 if name == "weight" else 0].dtype or name != "x"
            err = ((g.double() - r).norm() / r.norm().clamp_min(1e-12)).item()
            assert err < tol, f"unroll_h={unroll_h} block_b={block_b} {name}: {err:.2e}"
    for g1, g0 in zip(runs[1, 8], runs[0, 8]):
        if g1.numel():
            assert ((g1.double() - g0.double()).norm() / g0.double().norm().clamp_min(1e-12)).item() < tol


PIPELINED_CASES = [
    # (case, dtype, chain, path knobs): H=1 rows (with and without per-tile column sums), the
    # per-column H=4 and H=7 (8 columns, one padded) products, the tl.dot path; masked columns (D=40, 48) and rows (B not a
    # multiple of the tile), per-feature parameters, other chains.
    (Case(2, 37, 32, 1, ln="per_feature"), torch.float32, None, dict(use_dot=False)),
    (Case(2, 45, 48, 1, feature_dim=1, strided_view=True, ln="shared", bias="per_feature"), torch.bfloat16, None,
     dict(use_dot=False)),
    (Case(1, 40, 16, 1, ln="none", bias="none", eps=0.0), torch.float32, chain_of("rms_norm", "silu", "tanh"),
     dict(use_dot=False)),
    (Case(2, 29, 40, 4, per_feature_weight=True, ln="per_feature"), torch.float32, None,
     dict(use_dot=False, unroll_h=1)),
    (Case(1, 27, 24, 7, ln="shared", bias="per_feature"), torch.bfloat16, None, dict(use_dot=False, unroll_h=1)),
    (Case(2, 33, 32, 16, ln="per_feature", bias="per_feature"), torch.bfloat16, None, dict(use_dot=True)),
    (Case(1, 36, 32, 6, ln="none"), torch.float32, chain_of(None, "sigmoid", "relu"), dict(use_dot=True)),
]


@pytest.mark.parametrize("saved_stats", [True, False], ids=["saved-stats", "recomputed-stats"])
@pytest.mark.parametrize("case, dtype, chain, path", PIPELINED_CASES, ids=str)
def test_pipelined_row_loop_and_column_sums_match_float64_and_the_plain_loop(case, dtype, chain, path, saved_stats):
    # `loop_stages=3`: the row loop as `tl.range(num_stages=3)` (the interpreter runs it as a plain
    # loop: this checks the kernel's indexing and every path through it, not the pipelining), and
    # `col_sums=1` (H = 1 and the per-column product): gradient columns summed per tile instead of
    # per row slot; `row_slots=2/4`: a tile's rows folded into that many slots. 8- or
    # 16-row tiles, one program per SM (the interpreter counts 2), so programs walk several tiles,
    # the last partly padded. Against float64 (the contract) and the plain loop (same sums, and
    # for row slots the same order: bitwise).
    chain = chain or DEFAULT_CHAIN
    args, gy, stats, reference = backward_inputs(case, dtype, chain, saved_stats, seed=7)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    knobs = dict(path, block_b=16 if path["use_dot"] else 8, programs_per_sm=1, block_k=0, prefetch=0, loop_stages=0,
                 col_sums=0)
    plain, plain_meta = forced_backward(gy, args, case, stats, chain, **knobs)
    assert "LOOP_STAGES" not in plain_meta
    sums_per_tile = case.H == 1 or path.get("unroll_h")
    variants = [dict(loop_stages=3)] + ([dict(loop_stages=3, col_sums=1), dict(col_sums=1), dict(row_slots=2),
                                         dict(loop_stages=3, row_slots=4)] if sums_per_tile else [])
    for extra in variants:
        grads, meta = forced_backward(gy, args, case, stats, chain, **dict(knobs, **extra))
        assert meta.get("LOOP_STAGES") == extra.get("loop_stages") and bool(meta.get("COL_SUMS")) == bool(
            extra.get("col_sums")) and meta["USE_DOT"] == path["use_dot"]
        assert meta.get("ROW_SLOTS") == extra.get("row_slots")
        for name, g, gp, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), grads, plain, reference):
            if r is None or not g.numel():
                continue
            assert g.shape == r.shape
            err = ((g.double() - r).norm() / r.norm().clamp_min(1e-12)).item()
            assert err < tol, f"{extra} {name}: {err:.2e}"
            if not (extra.get("col_sums") or extra.get("row_slots")):
                assert torch.equal(g, gp), f"{extra} {name}"
            elif name == "x":  # the fold changes the order of column sums, never dx
                assert torch.equal(g, gp), f"{extra} {name}"


@pytest.mark.parametrize("H", [1, 3, 16])
def test_constant_huge_rows_are_exact_or_nan_never_another_finite_row(H):
    # A constant row v has variance 0, but its fp32 sum D * v rounds and a GPU's fp32 `/` is
    # approximate: its mean came out an ulp off v, and that ulp (~1e23 at 1e30) squared overflowed
    # float32, a NaN row where float64 is finite (H100). fp32 statistics are now taken about each
    # row's first value (red-team 13a), which makes such a row exact; the test keeps "float64's
    # value or NaN, never another finite row", a row whose variance really overflows is NaN, and
    # the other rows are float64's (y and dx).
    F, B, D = 2, 6, 7
    g = torch.Generator().manual_seed(2)
    x = torch.randn(F, B, D, generator=g)
    x[1, 1, :] = torch.tensor(1e30).nextafter(torch.tensor(float("inf")))  # mean an ulp off under numpy too
    x[0, 4, :] = -1.0009006647830791e30
    x[1, 5, :D - 1] = 1.0143029675350543e30
    x[1, 5, D - 1] = -1e30  # a real overflow
    w = torch.randn(H, D, generator=g) / D ** 0.5
    b = torch.rand(H, generator=g)
    lb = torch.randn(D, generator=g) * 0.5
    xg = x.clone().requires_grad_(True)
    forced = lambda D_, H_, dt, full=True: configs.heuristic_forward(D_, H_, dt, full, block_k=0)  # noqa: E731
    with configs.override(forward=forced):
        y = recfuse.ln_tanh_linear_relu(xg, w, b, ln_bias=lb)
        (dx,) = torch.autograd.grad(y, xg, torch.ones_like(y))
    x64 = x.double().requires_grad_(True)
    y64 = recfuse.reference.ln_tanh_linear_relu(x64, w.double(), b.double(), ln_bias=lb.double())
    (dx64,) = torch.autograd.grad(y64, x64, torch.ones_like(y64))
    assert torch.isnan(y[1, 5]).all()
    for f, r in ((1, 1), (0, 4)):
        assert torch.isnan(y[f, r]).all() or torch.allclose(y[f, r].double(), y64[f, r], rtol=1e-5, atol=1e-6), (
            y[f, r], y64[f, r])
    ordinary = torch.ones(F, B, dtype=torch.bool)
    ordinary[1, 1] = ordinary[0, 4] = ordinary[1, 5] = False
    assert ((y[ordinary].double() - y64[ordinary]).norm() / y64[ordinary].norm()).item() < 1e-5
    assert ((dx[ordinary].double() - dx64[ordinary]).norm() / dx64[ordinary].norm()).item() < 1e-4


@pytest.mark.parametrize("case, dtype, chain", [
    (Case(2, 37, 32, 4, ln="per_feature"), torch.float32, None),
    (Case(2, 29, 20, 3, feature_dim=1, strided_view=True, ln="shared", bias="per_feature"), torch.bfloat16, None),
    (Case(1, 24, 16, 16, per_feature_weight=True, ln="none", bias="none"), torch.float32, None),
    (Case(2, 20, 24, 6, ln="none"), torch.float32, chain_of("rms_norm", "silu", "tanh")),
], ids=str)
def test_per_column_forward_matches_float64(case, dtype, chain):
    # `ForwardConfig(unroll_h=1)`: one output column at a time (BLOCK_H = 1, a row reduction
    # each), not blocks of 4 columns as broadcast sums or a tl.dot; masked rows and columns.
    forced = lambda D, H, dt, full=True: configs.heuristic_forward(  # noqa: E731
        D, H, dt, full, use_dot=False, unroll_h=1, block_b=8, num_warps=2, persistent=0, tile_stages=1, block_k=0)
    with configs.override(forward=forced), launch.trace_launches() as launches:
        check_against_float64(case, dtype, chain=chain)
    metas = [meta for kind, _, meta, _ in launches if kind == "forward"]
    assert metas and all(m["BLOCK_H"] == 1 and not m["USE_DOT"] for m in metas), metas


def test_a_forced_backward_config_holds_on_autograd_s_own_thread(caplog):
    # On CUDA autograd runs the backward on a device thread of its own, which the context variable
    # of `configs.override` did not reach: the backward of a call made inside the block silently
    # took the table's config (the CUDA tests that force a backward config tested the table's;
    # found in session 10). The op's autograd node now carries the block. Here the backward runs
    # on another thread, as there, after the block has closed; the forced "no kernel" (None) sends
    # it to the composite backward, which logs why.
    import logging
    import threading

    case = Case(2, 37, 32, 4, ln="per_feature")
    x, w, b, lw, lb, gy = (t.float() for t in make_inputs(case, generator=torch.Generator().manual_seed(8)))
    xg = x.detach().clone().requires_grad_(True)
    with configs.override(backward=lambda D, H, dt: None):
        y = recfuse.ln_tanh_linear_relu(xg, w, b, ln_weight=lw, ln_bias=lb)
    out = {}
    caplog.set_level(logging.DEBUG, logger="recfuse")
    worker = threading.Thread(target=lambda: out.update(dx=torch.autograd.grad(y, xg, gy)[0]))
    worker.start()
    worker.join()
    assert any("backward kernel does not cover" in r.getMessage() for r in caplog.records), caplog.text
    x64 = x.double().requires_grad_(True)
    y64 = recfuse.reference.ln_tanh_linear_relu(x64, w.double(), b.double(), ln_weight=lw.double(),
                                                ln_bias=lb.double())
    (dx64,) = torch.autograd.grad(y64, x64, gy.double())
    assert ((out["dx"].double() - dx64).norm() / dx64.norm()).item() < 1e-5
