"""The forward's relu mask, saved for the backward (`launch._relu_mask_words`): a training forward
(relu out-activation, rows `configs.relu_mask_min_d` wide or more, a backward on its tl.dot paths) writes z > 0 as bits after the row
stats ([2 + words, F, B]); the backward reads them instead of recomputing z with a dot
(`kernels._load_relu_mask`). A 16-bit forward takes the mask from z to ~fp32 accuracy (t's rounding
error multiplied too, `kernels._lo_part_product`), its y unchanged.

References: the bits against float64's z > 0 (and y > 0 of the same fp32 forward); y against a
forward that saves no mask; the gradients against float64 and against the same backward path
recomputing z (same bits under the interpreter). Each case runs under the
Triton interpreter and, where a GPU is present, on it at sizes with many row tiles per program.
"""
import dataclasses

import pytest
import torch

import recfuse
from recfuse.chain import DEFAULT as DEFAULT_CHAIN, chain_of
from recfuse.ops import configs, launch
from recfuse.reference import feature_mlp as reference_feature_mlp
from op_cases import (INTERPRETER_AND_CUDA, Case, assert_backward_close, chain_backward_inputs, forced_backward,
                      relu_mask_bits,
                      with_rows)

DEVICES = INTERPRETER_AND_CUDA

CASES = [
    # (case, dtype): H = 16 (one word), 40 (two words, padded columns), 64 (two full words); padded
    # row tiles, the [B, F*D] view, per-feature weights and biases; D at least
    # `configs.relu_mask_min_d` of the dtype, 80 and 160 not powers of two.
    (Case(2, 37, 64, 16, ln="per_feature", bias="per_feature"), torch.float32),
    (Case(2, 24, 64, 40, feature_dim=1, strided_view=True, per_feature_weight=True, ln="shared"), torch.float32),
    (Case(1, 48, 80, 64, ln="none", bias="none"), torch.float32),
    (Case(1, 21, 160, 16, feature_dim=1, bias="per_feature"), torch.bfloat16),
]

# Backward paths that take the mask: the whole-row tl.dot kernel (with and without a prefetched
# next tile), the K-chunked kernel, the split weight gradient.
BACKWARD_KNOBS = {
    "whole_row": dict(use_dot=True, block_b=16, programs_per_sm=1, block_k=0, prefetch=0),
    "prefetch": dict(use_dot=True, block_b=16, programs_per_sm=1, block_k=0, prefetch=1),
    "chunked": dict(use_dot=True, block_b=16, programs_per_sm=1, block_k=32, prefetch=0),
    "split_dw": dict(use_dot=True, block_b=16, programs_per_sm=1, block_k=0, prefetch=0, split_dw=16, dw_block_b=16),
}

FORWARD_KNOBS = {
    "whole_row": dict(use_dot=True, block_b=16, block_k=0, persistent=0),
    "chunked": dict(use_dot=True, block_b=16, block_k=32, persistent=0),
    "chunk_loop": dict(use_dot=True, block_b=16, block_k=16, persistent=0, k_loop=2),
}


def _scaled(case: Case, device: str) -> Case:
    return case if device == "cpu" else with_rows(case, 1000)


def _forced_forward(**knobs):
    return lambda D, H, dt, full: configs.heuristic_forward(D, H, dt, full, **knobs)


def _training_forward(args, case, chain=DEFAULT_CHAIN, **knobs):
    with configs.override(forward=_forced_forward(**knobs)), launch.trace_launches() as seen:
        y, stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)
    return y, stats, [m for kind, _, m, _ in seen if kind == "forward"][0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fwd", sorted(FORWARD_KNOBS))
@pytest.mark.parametrize("case, dtype", CASES, ids=str)
def test_training_forward_saves_z_positive_as_bits_after_the_row_stats(case, fwd, dtype, device):
    case = _scaled(case, device)
    args, _ = chain_backward_inputs(case, dtype, DEFAULT_CHAIN, seed=1, device=device)
    y, stats, meta = _training_forward(args, case, **FORWARD_KNOBS[fwd])
    words = 1 if case.H <= 32 else 2
    F, B = (case.F, case.B)
    assert meta.get("SAVE_MASK") and stats.shape == (2 + words, F, B) and stats.dtype == torch.float32
    bits = relu_mask_bits(stats, case.H)
    to_fbh = (lambda t: t) if case.feature_dim == 0 else (lambda t: t.transpose(0, 1))
    z64 = to_fbh(reference_feature_mlp(*[None if t is None else t.double() for t in args[:3]],
                                       ln_weight=None if args[3] is None else args[3].double(),
                                       ln_bias=None if args[4] is None else args[4].double(), eps=case.eps,
                                       feature_dim=case.feature_dim, out_activation=None))
    clear = z64.abs() > 1e-3  # away from the kink: any accurate z has its sign
    assert torch.equal(bits[clear], (z64 > 0)[clear])
    if dtype == torch.float32:
        assert torch.equal(bits, to_fbh(y) > 0)  # relu: y > 0 exactly where this z > 0
    # The mean / rstd planes are those of a forward that saves no mask (a no-relu chain takes the
    # same statistics path), and y that of a forward without saved stats (as one without grad runs).
    _, plain, plain_meta = _training_forward(args, case, chain_of("layer_norm", "tanh", None), **FORWARD_KNOBS[fwd])
    assert not plain_meta.get("SAVE_MASK") and plain.shape == (2, F, B)
    assert torch.equal(stats[:2], plain)
    with configs.override(forward=_forced_forward(**FORWARD_KNOBS[fwd])):
        y_no_grad = launch.forward(*args, case.eps, case.feature_dim)
    if device == "cpu":
        assert torch.equal(y, y_no_grad)
    else:  # two compiled variants may contract the bias add apart: one rounding of y at most
        assert ((y.double() - y_no_grad.double()).abs() <= 2 ** -7 * y_no_grad.double().abs()).all()


@pytest.mark.parametrize("device", [d for d in DEVICES if d.values[0] != "cpu"])
@pytest.mark.parametrize("fwd", ["whole_row", "chunked"])
def test_a_16_bit_mask_without_its_lo_part_is_that_of_the_16_bit_z(fwd, device):
    """``MASK_LO_PART=False`` (benchmarks/ab_relu_mask.py's A/B, not a shipped config): the mask is
    that of the forward's own 16-bit z, so it equals y > 0 of the same call, bit for bit; the row
    stats and y are those of the default forward. CUDA only: the interpreter's forward multiplies
    fp32 operands (numpy has no bf16 matmul), so it has no lo part to leave out."""
    case, dtype = CASES[-1]
    case = _scaled(case, device)
    args, _ = chain_backward_inputs(case, dtype, DEFAULT_CHAIN, seed=3, device=device)
    with configs.override(forward=_forced_forward(**FORWARD_KNOBS[fwd])):
        plan = launch.forward_plan(*args, case.eps, case.feature_dim, save_stats=True)
    assert plan.meta.get("SAVE_MASK")
    hi_plan = dataclasses.replace(plan, meta=dict(plan.meta, MASK_LO_PART=False), bound=None)
    y, stats = plan(*args)
    y_hi, stats_hi = hi_plan(*args)
    to_fbh = (lambda t: t) if case.feature_dim == 0 else (lambda t: t.transpose(0, 1))
    assert torch.equal(relu_mask_bits(stats_hi, case.H), to_fbh(y_hi) > 0)
    assert torch.equal(stats_hi[:2], stats[:2])
    # the variants compile apart: one rounding of y at most
    assert ((y_hi.double() - y.double()).abs() <= 2 ** -7 * y.double().abs()).all()


# Under the interpreter each case runs two of the four paths (each path twice over the cases: CI
# time); on a GPU every pair.
INTERPRETER_PATHS = [("whole_row", "split_dw"), ("prefetch", "chunked"), ("chunked", "whole_row"),
                     ("split_dw", "prefetch")]


def _backward_params():
    params = []
    for device in DEVICES:
        for (case, dtype), subset in zip(CASES, INTERPRETER_PATHS):
            for path in sorted(BACKWARD_KNOBS):
                if device.values[0] == "cpu" and path not in subset:
                    continue
                params.append(pytest.param(case, dtype, path, device.values[0], marks=device.marks,
                                           id=f"{case}-{str(dtype).split('.')[-1]}-{path}-{device.id}"))
    return params


@pytest.mark.parametrize("case, dtype, path, device", _backward_params())
def test_backward_with_the_forward_mask_matches_float64_and_the_recomputed_z(case, path, dtype, device):
    case = _scaled(case, device)
    chain = DEFAULT_CHAIN
    args, gy = chain_backward_inputs(case, dtype, chain, seed=2, device=device)
    knobs = BACKWARD_KNOBS[path]
    forced = lambda D, H, dt: configs.heuristic_backward(D, H, dt, **knobs)  # noqa: E731
    with configs.override(backward=forced):  # the forward asks the backward's config (tl.dot?)
        _, stats, _ = _training_forward(args, case, **FORWARD_KNOBS["chunked"])
    assert stats.shape[0] > 2
    masked, meta = forced_backward(gy, args, case, stats, chain, **knobs)
    recomputed, meta_z = forced_backward(gy, args, case, stats[:2].contiguous(), chain, **knobs)
    assert meta["LOAD_MASK"] and "LOAD_MASK" not in meta_z
    assert meta.get("DZ_OUT", False) == (path == "split_dw") and ("BLOCK_K" in meta) == (path == "chunked")
    # grad_y is zero where float64 z is within 1e-3 of 0, so both masks agree on every row that
    # counts: under the interpreter the same arithmetic follows, bit for bit.
    assert_backward_close(masked, recomputed, gy, args, case, chain, dtype, same_bits=device == "cpu")


@pytest.mark.interpret
def test_backward_plans_are_kept_apart_by_what_the_stats_hold():
    case = Case(2, 32, 64, 16)
    args, gy = chain_backward_inputs(case, torch.float32, DEFAULT_CHAIN, seed=3)
    y, stats = launch.forward(*args, case.eps, 0, save_stats=True)
    assert stats.shape[0] == 3, "the heuristic backward of fp32 D=64 H=16 is on tl.dot: the mask is saved"
    with_mask = launch.backward_plan(gy, *args, case.eps, 0, stats)
    without = launch.backward_plan(gy, *args, case.eps, 0, stats[:2].contiguous())
    none = launch.backward_plan(gy, *args, case.eps, 0, None)
    assert with_mask.meta.get("LOAD_MASK") and with_mask.reads_stats
    assert not without.meta.get("LOAD_MASK") and not none.meta.get("LOAD_MASK")
    assert len({id(with_mask), id(without), id(none)}) == 3
    # Each plan with the stats it was made for gives the float64 gradients.
    for stats_arg in (stats, stats[:2].contiguous(), None):
        grads = launch.backward(gy, *args, case.eps, 0, stats_arg, key=None)
        assert_backward_close(grads, grads, gy, args, case, DEFAULT_CHAIN, torch.float32)


@pytest.mark.interpret
@pytest.mark.parametrize("D, dtype, chain, saves", [
    (64, torch.float32, DEFAULT_CHAIN, True),
    # Narrow rows (`configs.relu_mask_min_d`): a short z dot costs less than the mask saved for it.
    (32, torch.float32, DEFAULT_CHAIN, False),
    (160, torch.bfloat16, DEFAULT_CHAIN, True),
    (128, torch.bfloat16, DEFAULT_CHAIN, False),
    (256, torch.float16, DEFAULT_CHAIN, False),  # not measured on a GPU
    # No relu (nothing to mask), no norm (no stats buffer).
    (64, torch.float32, chain_of("layer_norm", "tanh", "gelu"), False),
    (64, torch.float32, chain_of(None, "tanh", "relu"), False),
])
def test_which_training_forwards_save_the_mask(D, dtype, chain, saves):
    case = Case(2, 16, D, 16, ln="per_feature" if chain.norm else "none")
    args, _ = chain_backward_inputs(case, dtype, chain, seed=4)
    with launch.trace_launches() as seen:
        _, stats = launch.forward(*args, case.eps, 0, save_stats=True, chain=chain)
    meta = [m for kind, _, m, _ in seen if kind == "forward"][0]
    assert bool(meta.get("SAVE_MASK")) == saves
    assert (stats is None) == (chain.norm is None)
    if stats is not None:
        assert stats.shape[0] == (3 if saves else 2)


@pytest.mark.interpret
def test_an_autograd_training_step_reads_the_mask_and_matches_float64():
    case = Case(3, 24, 64, 16, feature_dim=1, strided_view=True, bias="per_feature")
    (x, w, b, lw, lb), gy = chain_backward_inputs(case, torch.float64, DEFAULT_CHAIN, seed=5)
    leaves = [t.detach().float().requires_grad_(True) for t in (x, w, b, lw, lb)]
    with launch.trace_launches() as seen:
        y = recfuse.ln_tanh_linear_relu(leaves[0], leaves[1], leaves[2], ln_weight=leaves[3], ln_bias=leaves[4],
                                        eps=case.eps, feature_dim=1)
        y.backward(gy.float())
    backward_meta = [m for kind, _, m, _ in seen if kind == "backward"]
    assert backward_meta and backward_meta[0].get("LOAD_MASK")
    grads = [t.grad for t in leaves]
    ref = [t.detach().double().requires_grad_(True) for t in (x, w, b, lw, lb)]
    y_ref = recfuse.reference.ln_tanh_linear_relu(ref[0], ref[1], ref[2], ln_weight=ref[3], ln_bias=ref[4],
                                                 eps=case.eps, feature_dim=1)
    y_ref.backward(gy)
    assert ((y.double() - y_ref).norm() / y_ref.norm()).item() < 1e-5
    for name, g, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), grads, ref):
        err = ((g.double() - r.grad).norm() / r.grad.norm()).item()
        assert err < 1e-5, f"{name}: {err:.2e}"
