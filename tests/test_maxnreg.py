"""The register cap (`TileConfig.maxnreg`): ptxas holds the forward kernel, or the fused (or first)
backward kernel, to n registers a thread, so that more programs fit an SM, spilling the rest to
local memory.

A cap changes where values live, not the arithmetic: each case runs the capped config and the same
config uncapped, under the Triton interpreter (which has no registers: the launch options and the
config's plumbing only) and on a GPU, where the compiled kernel must hold at most n registers.
References: float64 (the composite) and the uncapped kernel (y and dx bitwise).
"""
import pytest
import torch

from recfuse.chain import DEFAULT as DEFAULT_CHAIN
from recfuse.ops import configs, launch, tuning
import recfuse
from op_cases import (INTERPRETER_AND_CUDA, TOLERANCE, Case, assert_backward_close, chain_backward_inputs,
                      forced_backward, rel_err, with_rows)

CASES = [
    # (case, dtype, path knobs): the tl.dot whole-row backward (fp32 operands split into bf16 parts,
    # bf16 with the forward's relu mask, the prefetched loop), the per-column product and H = 1
    # rows; masked columns and rows, the [B, F*D] view.
    (Case(2, 45, 64, 16, ln="per_feature", bias="per_feature"), torch.float32,
     dict(use_dot=True, block_b=16, num_warps=4, block_k=0, prefetch=1)),
    (Case(2, 37, 48, 16, feature_dim=1, strided_view=True, ln="shared"), torch.bfloat16,
     dict(use_dot=True, block_b=16, num_warps=4, block_k=0, prefetch=0, loop_stages=2)),
    (Case(2, 29, 40, 4, per_feature_weight=True, ln="per_feature"), torch.float32,
     dict(use_dot=False, block_b=8, num_warps=2, block_k=0, unroll_h=1)),
    (Case(1, 27, 64, 1, ln="none", bias="per_feature"), torch.bfloat16,
     dict(use_dot=False, block_b=8, num_warps=2, block_k=0, unroll_h=0)),
]


@pytest.mark.parametrize("device", INTERPRETER_AND_CUDA)
@pytest.mark.parametrize("case, dtype, path", CASES, ids=str)
def test_capped_registers_match_float64_and_the_uncapped_kernel(case, dtype, path, device):
    cap = 96
    chain = DEFAULT_CHAIN
    case = case if device == "cpu" else with_rows(case, 3000)
    args, gy = chain_backward_inputs(case, dtype, chain, seed=5, device=device)
    stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)[1]
    knobs = dict(path, programs_per_sm=1)
    capped_cfg = configs.heuristic_backward(case.D, case.H, dtype, **knobs, maxnreg=cap)
    assert configs.backward_fits(capped_cfg, case.D, case.H)
    assert launch.launch_options(capped_cfg)["maxnreg"] == cap
    baseline, _ = forced_backward(gy, args, case, stats, chain, **knobs)
    with configs.override(backward=lambda D, H, dt: capped_cfg), launch.trace_launches() as seen:
        grads = launch.backward(gy, *args, case.eps, case.feature_dim, stats, chain=chain)
    assert [c.maxnreg for kind, _, _, c in seen if kind == "backward"] == [cap]
    assert_backward_close(grads, baseline, gy, args, case, chain, dtype)
    assert torch.equal(grads[0], baseline[0])  # dx: the same instructions, other registers
    if device == "cuda":
        # the kernel this config launched was compiled under the cap (and is cached apart from the
        # uncapped one: the options are part of the launch cache's key)
        compiled = [k for key, k in launch._launch_bwd.kernels.items()
                    if dict(key[2]).get("maxnreg") == cap and dict(key[2])["num_warps"] == capped_cfg.num_warps]
        assert compiled, "no capped backward kernel in the launch cache"
        for kernel in compiled:
            kernel._init_handles()
            assert 0 < kernel.n_regs <= cap, kernel.n_regs


def test_register_caps_outside_the_allocation_rule_do_not_fit():
    base = configs.heuristic_backward(256, 16, torch.float32)
    for cap in (60, 130, 252, 256):  # below 64, not a multiple of 8, above 248
        assert not configs.backward_fits(configs.heuristic_backward(256, 16, torch.float32, maxnreg=cap), 256, 16)
        assert not configs.forward_fits(configs.heuristic_forward(256, 16, torch.float32, maxnreg=cap), 256, 16)
    for cap in (0, 64, 128, 168, 248):
        assert configs.backward_fits(configs.heuristic_backward(256, 16, torch.float32, maxnreg=cap), 256, 16)
        assert configs.forward_fits(configs.heuristic_forward(256, 16, torch.float32, maxnreg=cap), 256, 16)
    fwd_entry = configs.config_to_entry(configs.heuristic_forward(256, 16, torch.float32, maxnreg=96))
    assert configs.config_from_entry("forward", fwd_entry, 256, 16, torch.float32).maxnreg == 96
    entry = configs.config_to_entry(configs.heuristic_backward(256, 16, torch.float32, maxnreg=168))
    assert configs.config_from_entry("backward", entry, 256, 16, torch.float32).maxnreg == 168
    del entry["maxnreg"]  # an older table's entry: no cap
    assert configs.config_from_entry("backward", entry, 256, 16, torch.float32).maxnreg == 0
    assert "maxnreg" not in launch.launch_options(base)


@pytest.mark.parametrize("warps, expected", [(2, {200, 168, 144}), (4, {168, 128}), (8, {128})])
def test_maxnreg_neighbours_fit_one_to_three_more_programs_an_sm(warps, expected):
    base = configs.heuristic_backward(256, 16, torch.float32, num_warps=warps, programs_per_sm=2)
    got = tuning.maxnreg_neighbours(base, 256, 16, torch.float32)
    assert {c.maxnreg for c in got} == expected
    threads = 32 * warps
    uncapped = configs.REGISTERS_PER_SM // (256 * threads)
    for c in got:
        programs = configs.REGISTERS_PER_SM // (c.maxnreg * threads)
        assert uncapped < programs <= uncapped + 3
        # the programs a wave holds are at least those the cap lets in, in one of the variants
        assert c.programs_per_sm in (2, max(2, programs))
        assert dict(configs.config_to_entry(c), maxnreg=0, programs_per_sm=2) == configs.config_to_entry(base)
    assert tuning.maxnreg_neighbours(got[0], 256, 16, torch.float32) == []  # already capped


FORWARD_CASES = [
    # (case, dtype, path knobs): the tl.dot forward (whole rows; 32-column chunks of a masked D)
    # and the row reduction of H = 1.
    (Case(2, 45, 64, 16, ln="per_feature", bias="per_feature"), torch.float32, dict(use_dot=True, block_b=16)),
    (Case(2, 37, 48, 16, feature_dim=1, strided_view=True, ln="shared"), torch.bfloat16,
     dict(use_dot=True, block_b=16, block_k=16)),
    (Case(1, 27, 64, 1, ln="none", bias="per_feature"), torch.float32, dict(use_dot=False, block_b=16)),
]


@pytest.mark.parametrize("device", INTERPRETER_AND_CUDA)
@pytest.mark.parametrize("case, dtype, path", FORWARD_CASES, ids=str)
def test_capped_forward_matches_float64_and_the_uncapped_kernel(case, dtype, path, device):
    cap = 64
    case = case if device == "cpu" else with_rows(case, 3000)
    args, _ = chain_backward_inputs(case, dtype, DEFAULT_CHAIN, seed=6, device=device)
    full = case.D & (case.D - 1) == 0
    base_cfg = configs.heuristic_forward(case.D, case.H, dtype, full, **path)
    capped_cfg = configs.heuristic_forward(case.D, case.H, dtype, full, **path, maxnreg=cap)
    assert configs.forward_fits(capped_cfg, case.D, case.H) and launch.launch_options(capped_cfg)["maxnreg"] == cap
    outs = []
    for cfg in (base_cfg, capped_cfg):
        with configs.override(forward=lambda D, H, dt, full_tiles=True, c=cfg: c), launch.trace_launches() as seen:
            outs.append(launch.forward(*args, case.eps, case.feature_dim))
        assert [kind for kind, *_ in seen] == ["forward"]
    assert torch.equal(outs[0], outs[1])  # the same instructions, other registers
    x, w, b, lw, lb = [None if t is None else t.double() for t in args]
    y64 = recfuse.reference.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, eps=case.eps,
                                                feature_dim=case.feature_dim)
    assert rel_err(outs[1], y64) < TOLERANCE[dtype]
    if device == "cuda":
        compiled = [k for cache in (launch._launch_fwd, launch._launch_fwd_y_strided)
                    for key, k in cache.kernels.items() if dict(key[2]).get("maxnreg") == cap]
        assert compiled, "no capped forward kernel in the launch cache"
        for kernel in compiled:
            kernel._init_handles()
            assert 0 < kernel.n_regs <= cap, kernel.n_regs
