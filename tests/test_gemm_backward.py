"""The GEMM backward (`BackwardConfig.gemm`, `recfuse.ops.gemm_backward`): dz masked from the
forward's relu mask, dt = dz @ w and the weight gradient as Triton tensor-core GEMMs over chunks of
features, one row kernel for the norm and activation backward between them, fixed-order sums for
the rest.

Each case runs under the Triton interpreter (``make test-interpret``) and, where a GPU is present,
on it with many row tiles a program. References: float64 (the composite backward), the fused
kernels on the same inputs and stats, and for 16-bit inputs PyTorch's own 16-bit composite.
"""
import pytest
import torch

import recfuse
from recfuse.chain import DEFAULT as DEFAULT_CHAIN, chain_of
from recfuse.ops import configs, gemm_backward, launch
from recfuse.ops.composite import composite_backward
from recfuse.reference import batched_feature_mlp
from op_cases import (INTERPRETER_AND_CUDA, Case, assert_backward_close, assert_step_matches_float64,
                      chain_backward_inputs, forced_backward, with_rows)

DEVICES = INTERPRETER_AND_CUDA

CASES = [
    # (case, chain, chunks): padded rows and masked columns (D = 48, 80), H across one and two
    # mask words (33, 40, 64), the [B, F*D] view, per-feature and shared weights, biases and
    # LayerNorm affines, none of them, several feature chunks (3 over 5 features: 2 + 2 + 1), and
    # chains without relu (dz is grad_y) and with RMSNorm and other activations.
    (Case(5, 37, 48, 33, ln="per_feature", bias="per_feature"), None, 1),
    (Case(5, 24, 80, 40, feature_dim=1, strided_view=True, per_feature_weight=True, ln="shared"), None, 3),
    (Case(3, 29, 64, 64, feature_dim=1, strided_view=True, ln="none", bias="none"), None, 2),
    (Case(2, 30, 32, 16, ln="per_feature"), chain_of("layer_norm", "tanh", None), 1),
    (Case(4, 21, 32, 12, ln="none"), chain_of("rms_norm", "silu", None), 3),
    (Case(2, 26, 40, 8, feature_dim=1, ln="per_feature"), chain_of("layer_norm", "gelu", "relu"), 2),
    (Case(3, 22, 48, 36, ln="none"), chain_of(None, "sigmoid", None), 2),
]

FORWARD = dict(use_dot=True, block_b=16, block_k=0, persistent=0)
FUSED = dict(use_dot=True, block_b=16, programs_per_sm=1, block_k=0, prefetch=0, gemm=0)


def _forced(**knobs):
    return lambda D, H, dt: configs.heuristic_backward(D, H, dt, **knobs)


def _gemm_knobs(chunks: int, device: str) -> dict:
    # several programs a feature and several row tiles a program on either device
    return dict(gemm=chunks, block_b=8 if device == "cpu" else 16, programs_per_sm=2 if device == "cpu" else 4)


def _training_stats(args, case, chain, backward_knobs):
    """The row stats (and relu mask) a training forward saves when the backward runs `backward_knobs`."""
    forward = lambda D, H, dt, full: configs.heuristic_forward(D, H, dt, full, **FORWARD)  # noqa: E731
    with configs.override(forward=forward, backward=_forced(**backward_knobs)):
        return launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)[1]


def _traced_backward(gy, args, case, stats, knobs, chain=DEFAULT_CHAIN):
    """`launch.backward` with `knobs` forced: (gradients, the configs of its backward launches)."""
    with launch.trace_launches() as seen, configs.override(backward=_forced(**knobs)):
        grads = launch.backward(gy, *args, case.eps, case.feature_dim, stats, chain=chain)
    return grads, [cfg for kind, _, _, cfg in seen if kind == "backward"], [g for kind, g, _, _ in seen
                                                                          if kind == "backward"]


def _inputs(case, chain, chunks, device, seed, dtype=torch.float32):
    chain = chain or DEFAULT_CHAIN
    case = case if device == "cpu" else with_rows(case, 1000)
    args, gy = chain_backward_inputs(case, dtype, chain, seed=seed, device=device)
    knobs = _gemm_knobs(chunks, device)
    return case, chain, args, gy, knobs, _training_stats(args, case, chain, knobs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, chain, chunks", CASES, ids=str)
def test_gemm_gradients_match_float64_and_the_fused_kernels(case, chain, chunks, device):
    case, chain, args, gy, knobs, stats = _inputs(case, chain, chunks, device, seed=3)
    if chain.out_activation == "relu":
        assert stats.shape[0] > 2, "the GEMM backward needs the forward's relu mask at any D"
    grads, cfgs, row_launches = _traced_backward(gy, args, case, stats, knobs, chain)
    assert cfgs and all(cfg.gemm for cfg in cfgs)
    F = case.F
    assert len(row_launches) == -(-F // -(-F // chunks)), "one row-kernel launch a chunk of features"
    assert sum(g[1] for g in row_launches) == F
    fused, _ = forced_backward(gy, args, case, stats, chain, **FUSED)
    assert_backward_close(grads, fused, gy, args, case, chain, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [dict(gemm_cols_major=0), dict(gemm_row_tiles=3, gemm_rows=16, gemm_cols=16),
                                   dict(dw_block_b=16, dw_num_stages=1, gemm_dw_per_sm=9),
                                   dict(fp32_dots="tf32x3"), dict(row_slots=1), dict(row_slots=4)], ids=str)
def test_the_gemm_tile_knobs_give_the_same_gradients(tiles, device):
    # [H, columns] partials, several dt row tiles a program (the last one past B), narrow column
    # tiles over masked D = 80, small row steps in many program slots, one 3xTF32 dot, the
    # LayerNorm affine's column sums per tile or in 4 row slots (default: the layout's row span)
    case, chain, args, gy, knobs, stats = _inputs(Case(3, 37, 80, 24, feature_dim=1, strided_view=True,
                                                       ln="per_feature", bias="per_feature"), None, 2, device, seed=8)
    grads, cfgs, _ = _traced_backward(gy, args, case, stats, dict(knobs, **tiles))
    assert cfgs and all(cfg.gemm for cfg in cfgs)
    fused, _ = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **FUSED)
    assert_backward_close(grads, fused, gy, args, case, DEFAULT_CHAIN, torch.float32)


def _torch_16bit_composite_grads(gy, args, case, chain):
    """PyTorch's own batched composite's gradients, run in the 16-bit dtype of ``args``."""
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in args]
    y = batched_feature_mlp(*leaves, case.eps, case.feature_dim, chain)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, present, gy))
    return [None if t is None else next(grads) for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize("case, chain, chunks", [CASES[0], CASES[1], CASES[5]], ids=str)
def test_16bit_gemm_gradients_are_no_worse_than_pytorchs_16bit_composite(case, chain, chunks, dtype, device):
    # The 16-bit contract: gradients no further from float64 than PyTorch's own 16-bit batched
    # composite's on the same inputs (by more than half again), and than the fused kernels'.
    case, chain, args, gy, knobs, stats = _inputs(case, chain, chunks, device, seed=7, dtype=dtype)
    grads, cfgs, _ = _traced_backward(gy, args, case, stats, knobs, chain)
    assert cfgs and all(cfg.gemm for cfg in cfgs)
    fused, _ = forced_backward(gy, args, case, stats, chain, **FUSED)
    assert_backward_close(grads, fused, gy, args, case, chain, dtype)
    torch16 = _torch_16bit_composite_grads(gy, args, case, chain)
    reference = composite_backward(gy.double(), *[None if t is None else t.double() for t in args], case.eps,
                                   case.feature_dim, chain)
    unit = torch.finfo(dtype).eps
    for name, g, c, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), grads, torch16, reference):
        if r is None:
            continue
        assert g.dtype == dtype and g.shape == r.shape, name
        scale = r.norm().clamp_min(1e-12)
        err, err16 = (((t.double() - r).norm() / scale).item() for t in (g, c))
        assert err <= max(1.5 * err16, unit), f"{name}: {err:.2e} against PyTorch 16-bit {err16:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_backward_is_bitwise_deterministic(device):
    case, chain, args, gy, knobs, stats = _inputs(Case(5, 40, 64, 40, ln="per_feature", bias="per_feature"),
                                                  None, 2, device, seed=4)
    with configs.override(backward=_forced(**knobs)):
        first = launch.backward(gy, *args, case.eps, case.feature_dim, stats)
        second = launch.backward(gy, *args, case.eps, case.feature_dim, stats)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.interpret
@pytest.mark.parametrize("dtype, stats_form", [(torch.float32, "no_mask"), (torch.float32, "none"),
                                               (torch.bfloat16, "bf16_grad"), (torch.float16, "full")], ids=str)
def test_calls_the_gemm_backward_cannot_take_run_the_fused_kernels(dtype, stats_form):
    # A compiled backward passes no stats; a forward made under another backward config saves no
    # relu mask (an fp16 forward never does: `configs.relu_mask_min_d`); a grad_y of another dtype
    # than x: the plan is the fused kernels' heuristic one, and right.
    case = Case(2, 20, 64, 40)
    args, gy = chain_backward_inputs(case, dtype, DEFAULT_CHAIN, seed=6)
    knobs = _gemm_knobs(1, "cpu")
    stats = _training_stats(args, case, DEFAULT_CHAIN, knobs)
    if stats_form == "bf16_grad":
        args = [None if t is None else t.float() for t in args]
        dtype = torch.float32
    stats = {"no_mask": stats[:2].contiguous(), "none": None}.get(stats_form, stats)
    grads, cfgs, _ = _traced_backward(gy, args, case, stats, knobs)
    assert cfgs and not any(cfg.gemm for cfg in cfgs)
    fused, _ = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **FUSED)
    assert_backward_close(grads, fused, gy, args, case, DEFAULT_CHAIN, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_an_autograd_training_step_on_the_gemm_backward_matches_float64(device):
    case = Case(3, 24 if device == "cpu" else 1024, 96, 48, feature_dim=1, strided_view=True, bias="per_feature")
    (x, w, b, lw, lb), gy = chain_backward_inputs(case, torch.float64, DEFAULT_CHAIN, seed=5, device=device)
    leaves = [t.detach().float().requires_grad_(True) for t in (x, w, b, lw, lb)]
    with configs.override(backward=_forced(**_gemm_knobs(2, device))), launch.trace_launches() as seen:
        y = recfuse.ln_tanh_linear_relu(leaves[0], leaves[1], leaves[2], ln_weight=leaves[3], ln_bias=leaves[4],
                                        eps=case.eps, feature_dim=1)
        y.backward(gy.float())
    assert [cfg.gemm for kind, _, _, cfg in seen if kind == "backward"] == [2, 2]
    assert_step_matches_float64(y, leaves, (x, w, b, lw, lb), gy, case.eps, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_tf32_on_for_fp32_matmuls_the_gemm_backward_keeps_fp32_accuracy():
    # Its GEMMs are Triton's split-bf16 dots (bf16x6), not cuBLAS: the process's TF32 setting
    # (~1e-3 off in a cuBLAS fp32 GEMM) does not reach them.
    case, chain, args, gy, knobs, stats = _inputs(Case(4, 64, 128, 64, ln="per_feature"), None, 1, "cuda", seed=9)
    previous = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        grads, cfgs, _ = _traced_backward(gy, args, case, stats, knobs)
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous
    assert cfgs and all(cfg.gemm for cfg in cfgs)
    fused, _ = forced_backward(gy, args, case, stats, chain, **FUSED)
    assert_backward_close(grads, fused, gy, args, case, chain, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_with_deterministic_algorithms_on_the_gemm_backward_runs_and_repeats_its_bits(device, monkeypatch):
    # No cuBLAS and no atomics: torch.use_deterministic_algorithms(True) without a deterministic
    # cuBLAS workspace (where torch refuses a CUDA GEMM) leaves the path as it is.
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    case, chain, args, gy, knobs, stats = _inputs(Case(3, 20, 64, 40, ln="per_feature"), None, 2, device, seed=12)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, cfgs, _ = _traced_backward(gy, args, case, stats, knobs)
        second, _, _ = _traced_backward(gy, args, case, stats, knobs)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert cfgs and all(cfg.gemm for cfg in cfgs)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    fused, _ = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **FUSED)
    assert_backward_close(first, fused, gy, args, case, DEFAULT_CHAIN, torch.float32)


def test_the_heuristic_takes_the_gemm_backward_for_h_16_to_64_and_wide_rows_or_bf16_h_above_32():
    for D, H, dtype, expected in ((512, 64, torch.float32, True), (256, 32, torch.float32, True),
                                  (300, 40, torch.float32, True), (160, 64, torch.float32, False),
                                  (128, 32, torch.float32, False), (512, 16, torch.float32, True),
                                  (256, 16, torch.float32, True), (512, 8, torch.float32, False),
                                  (1024, 64, torch.float32, False), (512, 65, torch.float32, False),
                                  (512, 64, torch.bfloat16, True), (512, 16, torch.bfloat16, True),
                                  (256, 64, torch.bfloat16, True), (48, 40, torch.bfloat16, True),
                                  (32, 64, torch.bfloat16, False), (256, 32, torch.bfloat16, False),
                                  (512, 64, torch.float16, False)):
        cfg = configs.heuristic_backward(D, H, dtype)
        assert bool(cfg is not None and cfg.gemm) is expected, (D, H, dtype)
        if expected:
            assert configs.backward_fits(cfg, D, H)
    # a shipped table's entries of neighbouring shapes do not replace it; a shape's own entry does
    # (the H200 table's fp32 D=384 H=32 two-part rows: 1110 us in the grid against 1169)
    for table in ("h200", "h100-80gb-hbm3"):
        assert configs.table_backward_config(512, 64, torch.float32, "cpu", table=table).gemm == 1
    assert configs.heuristic_backward(384, 32, torch.float32).gemm
    assert not configs.table_backward_config(384, 32, torch.float32, "cpu", table="h200").gemm
    # gemm=0 asks for the fused kernels' own config; an entry naming gemm=1 describes the row kernel
    assert configs.heuristic_backward(512, 64, torch.float32, gemm=0).gemm == 0
    entry = configs.config_to_entry(configs.gemm_backward_config(512, 64, block_b=4))
    assert configs.config_from_entry("backward", entry, 512, 64, torch.float32) == configs.gemm_backward_config(
        512, 64, block_b=4)


def test_gemm_configs_fit_only_as_the_row_kernel():
    base = configs.gemm_backward_config(256, 64)
    assert configs.backward_fits(base, 256, 64)
    for bad in (dict(two_pass=32), dict(block_k=64), dict(split_dw=64), dict(prefetch=1), dict(block_b=128),
                dict(block_b=12), dict(loop_stages=5), dict(row_slots=3), dict(block_b=8, row_slots=16)):
        assert not configs.backward_fits(configs.gemm_backward_config(256, 64, **bad), 256, 64), bad


@pytest.mark.interpret
def test_programs_per_sm_count_the_programs_of_each_chunks_launch():
    # 2 chunks of 3 and 2 features over B = 64 rows in 8-row tiles; the interpreter counts 2 SMs:
    # 2 x 4 programs an SM over a 3-feature chunk is 3 programs a feature (not 8 / 5 = 2 over all F)
    case, chain, args, gy, knobs, stats = _inputs(Case(5, 64, 32, 16, ln="per_feature"), None, 2, "cpu", seed=5)
    knobs = dict(knobs, programs_per_sm=4)
    grads, cfgs, row_launches = _traced_backward(gy, args, case, stats, knobs)
    assert [tuple(g) for g in row_launches] == [(3, 3), (3, 2)]
    fused, _ = forced_backward(gy, args, case, stats, DEFAULT_CHAIN, **FUSED)
    assert_backward_close(grads, fused, gy, args, case, DEFAULT_CHAIN, torch.float32)


def test_feature_chunks_bound_the_scratch_buffer():
    # x 256 MB fp32 at D=512: a quarter of x is 16 of 64 features; at least `min_chunks` chunks
    assert gemm_backward.chunk_features(64, 2048, 512, 256 << 20, 1) == 16
    assert gemm_backward.chunk_features(64, 2048, 512, 256 << 20, 8) == 8
    # a small x: the 32 MB floor holds every feature in one chunk
    assert gemm_backward.chunk_features(16, 1024, 256, 16 << 20, 1) == 16
    assert gemm_backward.chunk_features(5, 10, 8, 1000, 3) == 2


class _OpModule(torch.nn.Module):
    def __init__(self, F, D, H, generator):
        super().__init__()
        kw = dict(device="cuda", generator=generator)
        self.w = torch.nn.Parameter(torch.randn(H, D, **kw) * D ** -0.5)
        self.b = torch.nn.Parameter(torch.randn(H, **kw) * 0.1)
        self.lw = torch.nn.Parameter(1 + 0.1 * torch.randn(F, D, **kw))
        self.lb = torch.nn.Parameter(0.1 * torch.randn(F, D, **kw))

    def forward(self, x):
        return recfuse.ln_tanh_linear_relu(x, self.w, self.b, ln_weight=self.lw, ln_bias=self.lb, feature_dim=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_graphed_training_step_on_the_gemm_backward_equals_the_eager_step():
    # The shipped config (no override): fp32 D=256 H=32 takes the GEMM backward; its GEMMs, sums and
    # kernels replay from a captured graph with fresh inputs.
    F, B, D, H = 4, 256, 256, 32
    assert configs.heuristic_backward(D, H, torch.float32).gemm
    g = torch.Generator(device="cuda").manual_seed(0)
    eager, graphed_module = _OpModule(F, D, H, g), _OpModule(F, D, H, g)
    graphed_module.load_state_dict(eager.state_dict())
    sample = torch.randn(B, F, D, device="cuda", requires_grad=True)
    with launch.trace_launches() as seen:
        graphed = torch.cuda.make_graphed_callables(graphed_module, (sample,))
    assert any(cfg.gemm for kind, _, _, cfg in seen if kind == "backward")
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(B, F, D, device="cuda", generator=gen)
        gy = torch.randn(B, F, H, device="cuda", generator=gen)
        outs = []
        for fn, module in ((eager, eager), (graphed, graphed_module)):
            module.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_(True)
            fn(xx).backward(gy)
            outs.append([xx.grad] + [p.grad for p in module.parameters()])
        for a, b in zip(*outs):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


@pytest.mark.interpret
def test_the_tuner_times_gemm_candidates_on_the_gemm_backward():
    # A GEMM candidate runs on the stats a forward saves for it (with the relu mask at any D);
    # on stats without the mask its plan would be the fused kernels' and its time another path's.
    from recfuse.ops import autotune, tuning

    D, H = 48, 40
    cands = tuning.gemm_candidates(D, H, torch.float32)
    assert cands and all(c.gemm for c in cands) and tuning.path_label(tuning.kernel_path(cands[0])).endswith("gemm")
    assert set(cands) <= set(tuning.backward_candidates(D, H, torch.float32))
    t = autotune.synthetic_inputs(3, 24, D, H, torch.float32, "cpu", seed=1)
    stats = autotune._stats(t, D, H, torch.float32, True, backward=configs.heuristic_backward(D, H, torch.float32,
                                                                                             gemm=0))
    assert stats.shape[0] == 2  # fp32 D=48: the fused kernels recompute z, no mask saved
    assert autotune.candidate_stats(t, cands[0], stats).shape[0] > 2  # the mask's words
    with launch.trace_launches() as seen:
        grads = autotune._call("backward", t, cands[0], stats)()
    assert [cfg.gemm for kind, _, _, cfg in seen if kind == "backward"] == [1]
    fused = autotune._call("backward", t, configs.heuristic_backward(D, H, torch.float32, gemm=0), stats)()
    for g, f in zip(grads, fused):
        assert ((g - f).norm() / f.norm()).item() < 1e-5


def test_a_two_pass_entry_without_the_mask_falls_back_to_the_fused_kernels_not_the_gemm_backward():
    # The H200 table's own fp32 D=384 H=32 entry is two-pass; a call without the forward's stats (a
    # compiled backward) falls back to a heuristic config, which at this shape is the GEMM
    # backward's, which needs the stats too: the fallback must be the fused kernels' own.
    cfg = configs.table_backward_config(384, 32, torch.float32, "cpu", table="h200")
    assert cfg.two_pass and configs.heuristic_backward(384, 32, torch.float32).gemm
    F, B, D, H = 2, 40, 384, 32
    x, w, gy = torch.randn(F, B, D), torch.randn(H, D), torch.randn(F, B, H)
    with configs.override(backward=cfg):
        plan = launch.backward_plan(gy, x, w, None, None, None, 1e-5, 0, None)
    assert not plan.cfg.gemm and not plan.cfg.two_pass and plan.cfg == configs.fused_backward_config(D, H, x.dtype)
