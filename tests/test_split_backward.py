"""The split backward (`BackwardConfig.split_dw`): the whole-row tl.dot kernel writes dz and the
rows' mean / rstd instead of the weight gradient, and `kernels.ln_tanh_linear_relu_bwd_weight`
makes the weight gradient from them, a chunk of columns at a time.

Each case runs under the Triton interpreter (``make test-interpret``) and, where a GPU is present,
on it at sizes with many row tiles per program. The reference is float64; the fused kernel (the
same products, summed in another order) is the second one.
"""
import pytest
import torch

from recfuse.chain import DEFAULT as DEFAULT_CHAIN, chain_of
from recfuse.ops import configs, launch
from recfuse.ops.composite import composite_backward
from op_cases import (BACKWARD_PATH_CASES, INTERPRETER_AND_CUDA, Case, assert_backward_close,
                      chain_backward_inputs, count_launches, forced_backward, make_inputs, with_rows)

DEVICES = INTERPRETER_AND_CUDA

CASES = BACKWARD_PATH_CASES + [
    # (case, dtype, chain): H = 17 past a 16-wide block; a non-relu out-activation (an fp32 dz buffer)
    (Case(2, 50, 64, 17, feature_dim=1, ln="per_feature", bias="per_feature"), torch.bfloat16, None),
    (Case(1, 64, 40, 16, ln="shared", per_feature_weight=True), torch.float32, chain_of("layer_norm", "tanh", "gelu")),
]


def _scaled(case: Case, device: str) -> Case:
    return case if device == "cpu" else with_rows(case, 1000)


def _inputs(case: Case, device: str, seed: int):
    return [None if t is None else t.to(device) for t in make_inputs(case, generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, dtype, chain", CASES, ids=str)
def test_split_weight_gradient_matches_float64_and_the_fused_kernel(case, dtype, chain, device):
    chain = chain or DEFAULT_CHAIN
    case = _scaled(case, device)
    args, gy = chain_backward_inputs(case, dtype, chain, seed=3, device=device)
    rows = 16 if device == "cpu" else 64
    knobs = dict(use_dot=True, block_b=16, programs_per_sm=1, block_k=0, prefetch=0)
    split, meta = forced_backward(gy, args, case, None, chain, split_dw=16, dw_block_b=rows, **knobs)
    fused, fused_meta = forced_backward(gy, args, case, None, chain, **knobs)
    assert meta["DZ_OUT"] and "DZ_OUT" not in fused_meta
    # In the interpreter dx, bias and LayerNorm-affine gradients come from the fused kernel's own
    # code: the same bits. Compiled, the two variants contract and order their arithmetic apart.
    assert_backward_close(split, fused, gy, args, case, chain, dtype, same_bits=device == "cpu")


# Cases with a norm and some LayerNorm affine: the ones whose affine gradients can move.
LN_CASES = [(case, dtype, chain) for case, dtype, chain in CASES
            if case.ln != "none" and (chain is None or chain.norm is not None)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, dtype, chain", LN_CASES, ids=str)
def test_layer_norm_affine_gradients_in_the_weight_kernel_match_float64_and_the_fused_kernel(case, dtype, chain,
                                                                                            device):
    # `BackwardConfig.split_ln`: the weight kernel makes the affine's column sums too (dt again
    # for its columns), the fused kernel none; dx and the bias gradient stay the fused kernel's.
    chain = chain or DEFAULT_CHAIN
    case = _scaled(case, device)
    args, gy = chain_backward_inputs(case, dtype, chain, seed=5, device=device)
    knobs = dict(use_dot=True, block_b=16, programs_per_sm=1, block_k=0, prefetch=0)
    split, meta = forced_backward(gy, args, case, None, chain, split_dw=16, dw_block_b=16, split_ln=1, **knobs)
    fused, _ = forced_backward(gy, args, case, None, chain, **knobs)
    assert meta["DZ_OUT"] and meta.get("LN_IN_WEIGHT")
    assert_backward_close(split, fused, gy, args, case, chain, dtype)
    for name, g, f in zip(("x", "bias"), (split[0], split[2]), (fused[0], fused[2])):
        if device == "cpu" and f.numel():  # the same code made them: the same bits
            assert torch.equal(g, f), name


@pytest.mark.parametrize("device", DEVICES)
def test_split_weight_gradient_is_bitwise_deterministic_and_launches_three_kernels(device, monkeypatch):
    case = _scaled(Case(2, 48, 64, 20, ln="per_feature"), device)
    x, w, b, lw, lb, gy = _inputs(case, device, seed=4)
    args = [t.float() for t in (gy, x, w, b, lw, lb)]
    forced = lambda D, H, dt: configs.heuristic_backward(D, H, dt, use_dot=True, block_b=16, block_k=0,  # noqa: E731
                                                         programs_per_sm=1, split_dw=32, dw_block_b=16)
    calls = count_launches(monkeypatch, ("_launch_bwd", "_launch_bwd_weight", "_launch_partials_to_grads"))
    with configs.override(backward=forced):
        first = launch.backward(*args, case.eps, case.feature_dim)
        second = launch.backward(*args, case.eps, case.feature_dim)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert calls == ["_launch_bwd", "_launch_bwd_weight", "_launch_partials_to_grads"] * 2


def test_split_weight_candidates_fit_and_name_their_kernel_path():
    from recfuse.ops import tuning

    for D, H, dtype in [(256, 16, torch.bfloat16), (64, 64, torch.float32), (160, 16, torch.bfloat16)]:
        cands = tuning.split_weight_candidates(D, H, dtype)
        assert cands and all(configs.backward_fits(c, D, H) for c in cands)
        assert all(tuning.kernel_path(c)[1 + tuning.PATH_FLAGS["backward"].index("split_dw")] for c in cands)
        entry = configs.config_to_entry(cands[0])
        assert configs.config_from_entry("backward", entry, D, H, dtype) == cands[0]
    # the chunked kernel has no split: a config asking for both does not fit
    both = configs.heuristic_backward(256, 16, torch.float32, use_dot=True, block_k=64, split_dw=64)
    assert not configs.backward_fits(both, 256, 16)


def test_an_entry_without_split_dw_keeps_the_fused_kernel_where_the_heuristic_splits():
    # An older table's entry (no split_dw key) was measured on the fused kernel: reading it must
    # not pick up the heuristic's split (bf16 H=64 at 128-256 columns).
    assert configs.fused_backward_config(256, 64, torch.bfloat16).split_dw == 128
    old_entry = {k: v for k, v in configs.config_to_entry(configs.heuristic_backward(
        256, 64, torch.bfloat16, use_dot=True, block_b=16, num_warps=4, programs_per_sm=8)).items()
        if not k.startswith(("split_dw", "dw_"))}
    cfg = configs.config_from_entry("backward", old_entry, 256, 64, torch.bfloat16)
    assert cfg is not None and cfg.split_dw == 0 and cfg.block_b == 16
    split = configs.config_from_entry("backward", dict(old_entry, split_dw=64, dw_num_warps=8), 256, 64,
                                      torch.bfloat16)
    assert (split.split_dw, split.dw_num_warps) == (64, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_backward_through_the_cached_plan_and_bound_launchers_on_cuda():
    # The fused kernels' heuristic splits bf16 H=64 at 128 columns (the H200 table takes the GEMM
    # backward there, so the fused config is forced): the second and third calls go through the
    # kept plan's bound launchers of all three kernels, and give the first call's bits; all within
    # the bf16 bound of float64.
    case = Case(4, 1000, 128, 64, ln="per_feature", bias="per_feature")
    x, w, b, lw, lb, gy = _inputs(case, "cuda", seed=5)
    args = [t.to(torch.bfloat16) for t in (gy, x, w, b, lw, lb)]
    with configs.override(backward=lambda D, H, dt: configs.heuristic_backward(D, H, dt, gemm=0)):
        plan = launch.backward_plan(*args, case.eps, case.feature_dim)
        assert plan.weight_meta is not None, plan.cfg
        runs = [launch.backward(*args, case.eps, case.feature_dim) for _ in range(3)]
        assert plan.bound_weight is not None or launch.backward_plan(*args, case.eps, case.feature_dim).bound_weight
    for later in runs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(runs[0], later))
    reference = composite_backward(*[t.double() for t in args], case.eps, case.feature_dim)
    for name, g, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), runs[0], reference):
        err = ((g.double() - r).norm() / r.norm().clamp_min(1e-12)).item()
        assert err < 2e-2, f"{name}: {err:.2e}"
