"""The forward launched features first (`launch.features_first`, `configs.forward_features_first`,
`kernels._row_program`): where x is a [B, F*D] buffer (torchrec's layout, feature stride below
batch stride) the tl.dot forward on narrow rows launches on an (F, row programs) grid instead of
(row programs, F), so that the programs running at once read whole spans of rows instead of one
feature's D-wide pieces F*D apart. The numbers must not change: each tl.dot forward (one program
a tile, persistent, K-chunked) runs in the [B, F*D] view with several row programs per feature,
forward and autograd backward against float64 (the per-slice reference and the composite
backward), and reports the grid it launched on. The row path, wide rows and the [F, B, D] layout
keep the (row programs, F) grid, as does every backward.

Under the Triton interpreter (``make test-interpret``) and, where a GPU is present, on it with
many more rows.
"""
import pytest
import torch

import recfuse
from recfuse.ops import configs, launch
from op_cases import (INTERPRETER_AND_CUDA, TOLERANCE, Case, assert_backward_close, make_inputs, rel_err, run_op,
                      with_rows)
from recfuse.chain import DEFAULT as DEFAULT_CHAIN
from recfuse.ops.composite import composite_backward


def test_features_first_only_where_a_rows_features_are_side_by_side():
    F, B, D = 26, 4096, 64
    bfd = (D, F * D)  # (feature stride, batch stride) of a [B, F*D] buffer viewed as [B, F, D]
    fbd = (B * D, D)  # of an [F, B, D] tensor
    assert launch.features_first(*bfd, 100, F)
    assert not launch.features_first(*fbd, 100, F)
    assert not launch.features_first(*bfd, 100, 1)  # one feature: nothing to interleave
    # CUDA's grid takes at most 65535 on its second axis: more row programs keep the old grid
    assert launch.features_first(*bfd, 65535, F) and not launch.features_first(*bfd, 65536, F)
    assert launch.row_programs((F, 7), {"FEATURES_FIRST": True}) == 7
    assert launch.row_programs((7, F), {}) == 7


def test_the_rule_takes_the_narrow_tl_dot_forwards():
    fwd = configs.heuristic_forward
    assert configs.forward_features_first(fwd(32, 16, torch.bfloat16, use_dot=True), 2)
    assert configs.forward_features_first(fwd(256, 16, torch.bfloat16, use_dot=True), 2)  # 512 bytes
    assert not configs.forward_features_first(fwd(512, 16, torch.bfloat16, use_dot=True), 2)
    assert not configs.forward_features_first(fwd(256, 16, torch.float32, use_dot=True), 4)
    assert not configs.forward_features_first(fwd(32, 1, torch.bfloat16, use_dot=False), 2)  # the row path


_BWD = dict(use_dot=True, block_b=16, block_k=0, programs_per_sm=4, split_dw=0, two_pass=0, row_parts=0)

# (case, dtype, forward knobs, backward knobs, backward kernel): the tl.dot forwards, and the
# backward kernels that follow them
PATHS = [
    # the whole-row forward, one program a tile; the whole-row tl.dot backward
    (Case(3, 70, 32, 16, feature_dim=1, strided_view=True), torch.float32,
     dict(use_dot=True, block_b=16, persistent=0, block_k=0), dict(_BWD, prefetch=0), "bwd"),
    # the persistent forward; the prefetching tl.dot backward
    (Case(3, 67, 64, 16, feature_dim=1, strided_view=True, per_feature_weight=True), torch.bfloat16,
     dict(use_dot=True, block_b=16, persistent=4, tile_stages=2, block_k=0), dict(_BWD, prefetch=1), "bwd"),
    # the K-chunked forward and backward
    (Case(2, 50, 64, 16, feature_dim=1, strided_view=True, bias="per_feature"), torch.float32,
     dict(use_dot=True, block_b=16, persistent=0, block_k=32), dict(_BWD, block_k=32), "chunked"),
    # masked columns (D=40 in chunks of 16, the last masked); the two-part rows' tl.dot backward
    # (96 = 64 + 32) on the saved stats and relu mask
    (Case(2, 45, 40, 8, feature_dim=1, strided_view=True, ln="shared"), torch.bfloat16,
     dict(use_dot=True, block_b=16, persistent=0, block_k=16), dict(_BWD, prefetch=0), "bwd"),
    (Case(2, 40, 96, 8, feature_dim=1, strided_view=True), torch.float32,
     dict(use_dot=True, block_b=16, persistent=0, block_k=0), dict(_BWD, row_parts=1), "rows2_dot"),
]

_LAUNCHERS = {"bwd": "_launch_bwd", "chunked": "_launch_bwd_chunked", "rows2": "_launch_bwd_rows2",
              "rows2_dot": "_launch_bwd_rows2_dot"}


def _run(case, dtype, forward_knobs, backward_knobs, monkeypatch, device="cpu"):
    """y and the gradients of the op with the knobs forced (float64 master inputs rounded to dtype),
    the launches' (kind, grid, meta) and the backward launchers that ran."""
    ran = []
    for name in _LAUNCHERS.values():
        launcher = getattr(launch, name)
        monkeypatch.setattr(launcher, "bind", lambda *a, **k: None)  # every call through __call__
        monkeypatch.setattr(launch, name, _Recording(launcher, name, ran))
    forward = lambda D, H, dt, full_tiles: configs.heuristic_forward(D, H, dt, full_tiles, **forward_knobs)  # noqa: E731
    backward = lambda D, H, dt: configs.heuristic_backward(D, H, dt, **backward_knobs)  # noqa: E731
    inputs = make_inputs(case, device, generator=torch.Generator(device).manual_seed(5))
    tensors = _away_from_relu_ties(tuple(None if t is None else t.to(dtype).double() for t in inputs), case)
    with configs.override(forward=forward, backward=backward), launch.trace_launches() as seen:
        y, grads = run_op(recfuse.ln_tanh_linear_relu, tensors, dtype, case)
    return tensors, y, grads, [(kind, grid, meta) for kind, grid, meta, _ in seen], ran


class _Recording:
    """A launcher that records its name when it launches (binding refused: `_run`)."""

    def __init__(self, launcher, name, ran):
        self.launcher, self.name, self.ran = launcher, name, ran

    def __call__(self, *args, **kwargs):
        self.ran.append(self.name)
        return self.launcher(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self.launcher, attr)


def _away_from_relu_ties(tensors, case):
    """grad_y zeroed where the float64 z is within 1e-3 of the relu's kink (either side may round
    there)."""
    x, w, b, lw, lb, gy = tensors
    z = recfuse.reference.feature_mlp(x, w, b, ln_weight=lw, ln_bias=lb, eps=case.eps, feature_dim=case.feature_dim,
                                      out_activation=None)
    return x, w, b, lw, lb, gy.masked_fill(z.abs() < 1e-3, 0)


@pytest.mark.parametrize("device", INTERPRETER_AND_CUDA)
@pytest.mark.parametrize("case, dtype, forward_knobs, backward_knobs, kernel", PATHS, ids=str)
def test_features_first_grids_give_the_float64_numbers(case, dtype, forward_knobs, backward_knobs, kernel, device,
                                                        monkeypatch):
    if device == "cuda":
        case = with_rows(case, 3000)
    tensors, y, grads, seen, ran = _run(case, dtype, forward_knobs, backward_knobs, monkeypatch, device)
    assert [kind for kind, _, _ in seen] == ["forward", "backward"], seen
    assert ran == [_LAUNCHERS[kernel]], ran
    (_, fwd_grid, fwd_meta), (_, bwd_grid, bwd_meta) = seen
    assert fwd_meta.get("FEATURES_FIRST") and fwd_grid[0] == case.F, fwd_grid
    assert launch.row_programs(fwd_grid, fwd_meta) == fwd_grid[1] > 1, fwd_grid  # several row programs a feature
    assert not bwd_meta.get("FEATURES_FIRST") and bwd_grid[1] == case.F, bwd_grid
    x, w, b, lw, lb, gy = tensors
    y_ref, _ = run_op(recfuse.reference.ln_tanh_linear_relu, tensors, torch.float64, case, keep_view=False)
    assert rel_err(y, y_ref) < TOLERANCE[dtype]
    args = [None if t is None else t.to(dtype) for t in (x, w, b, lw, lb)]
    present = iter(grads[1:])
    full = [grads[0]] + [next(present) if a is not None else torch.empty(0) for a in args[1:]]
    baseline = composite_backward(gy.to(dtype), *args, case.eps, case.feature_dim, DEFAULT_CHAIN)
    assert_backward_close(full, baseline, gy.to(dtype), args, case, DEFAULT_CHAIN, dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("case, forward_knobs", [
    (Case(3, 70, 32, 16), dict(use_dot=True, block_b=16, persistent=0, block_k=0)),  # [F, B, D]
    (Case(3, 45, 48, 1, feature_dim=1, strided_view=True), dict(use_dot=False, block_b=16, persistent=0)),  # row path
    (Case(2, 40, 256, 16, feature_dim=1, strided_view=True), dict(use_dot=True, block_b=16, persistent=0, block_k=0)),
], ids=str)
def test_other_forwards_keep_their_grid(case, forward_knobs, monkeypatch):
    backward = dict(_BWD, prefetch=0) if case.H > 1 else dict(use_dot=False, block_b=8, programs_per_sm=4, row_parts=0)
    _, _, _, seen, _ = _run(case, torch.float32, forward_knobs, backward, monkeypatch)
    for kind, grid, meta in seen:
        assert not meta.get("FEATURES_FIRST") and grid[1] == case.F, (kind, grid)


@pytest.mark.interpret
def test_features_first_over_a_padded_row_buffer():
    # x's rows hold each feature's D values with 8 unused ones after them (a [B, F, D + 8] buffer
    # sliced to D): feature stride D + 8 below batch stride F * (D + 8), so features first, and
    # the kernel must take both strides as they are.
    F, B, D, H = 3, 70, 32, 16
    g = torch.Generator().manual_seed(11)
    buf = torch.randn(B, F, D + 8, generator=g, dtype=torch.float64)
    w = torch.randn(H, D, generator=g, dtype=torch.float64) / D ** 0.5
    b = 0.1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64)
    lw = 1 + 0.2 * torch.randn(F, D, generator=g, dtype=torch.float64)
    lb = 0.2 * torch.randn(F, D, generator=g, dtype=torch.float64)
    gy = torch.randn(B, F, H, generator=g, dtype=torch.float64)
    pre = recfuse.reference.feature_mlp(buf[..., :D], w, b, ln_weight=lw, ln_bias=lb, feature_dim=1, out_activation=None)
    gy = gy.masked_fill(pre.abs() < 1e-3, 0)
    leaves = [t.float().requires_grad_(True) for t in (buf, w, b, lw, lb)]
    x = leaves[0][..., :D]
    assert x.stride()[:2] == (F * (D + 8), D + 8)
    forward = lambda D_, H_, dt, full_tiles: configs.heuristic_forward(D_, H_, dt, full_tiles, use_dot=True,  # noqa: E731
                                                                      block_b=16, persistent=0, block_k=0)
    with configs.override(forward=forward), launch.trace_launches() as seen:
        y = recfuse.ln_tanh_linear_relu(x, *leaves[1:3], ln_weight=leaves[3], ln_bias=leaves[4], feature_dim=1)
        y.backward(gy.float())
    (_, fwd_grid, fwd_meta, _), = [launch for launch in seen if launch[0] == "forward"]
    assert fwd_meta.get("FEATURES_FIRST") and fwd_grid[0] == F and fwd_grid[1] > 1, fwd_grid
    ref_leaves = [t.clone().requires_grad_(True) for t in (buf, w, b, lw, lb)]
    y_ref = recfuse.reference.ln_tanh_linear_relu(ref_leaves[0][..., :D], *ref_leaves[1:3], ln_weight=ref_leaves[3],
                                                  ln_bias=ref_leaves[4], feature_dim=1)
    y_ref.backward(gy)
    assert rel_err(y, y_ref) < TOLERANCE[torch.float32]
    for name, leaf, ref in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), leaves, ref_leaves):
        assert rel_err(leaf.grad, ref.grad) < 1e-4, name
    assert leaves[0].grad[..., D:].abs().max() == 0  # the unused values get no gradient


def test_more_features_than_a_grid_axis_holds_launch_features_first():
    # CUDA's grid holds at most 65535 programs on its second axis: the forward takes F on the
    # first in either layout (a launch error on the (row programs, F) grid), and the backward,
    # whose grids hold F on a second or third axis, is the composite's.
    F, B, D, H = 65537, 1, 4, 1
    w = torch.randn(H, D)
    for x, feature_dim in ((torch.randn(B, F * D).view(B, F, D), 1), (torch.randn(F, B, D), 0)):
        plan = launch.forward_plan(x, w, None, None, None, 1e-5, feature_dim)
        assert plan.meta.get("FEATURES_FIRST") and plan.grid[0] == F and plan.grid[1] <= 65535, plan.grid
        gy = torch.randn((B, F, H) if feature_dim else (F, B, H))
        assert launch.backward_plan(gy, x, w, None, None, None, 1e-5, feature_dim) is None


@pytest.mark.interpret
@pytest.mark.parametrize("feature_dim", [0, 1])
def test_past_the_grid_limit_the_numbers_are_float64s(feature_dim, monkeypatch):
    # The limit lowered to 2 so that three features pass it under the interpreter: the forward
    # launches features first in either layout, the backward takes the composite.
    monkeypatch.setattr(launch, "_MAX_GRID_YZ", 2)
    case = Case(3, 40, 32, 16, feature_dim=feature_dim, strided_view=feature_dim == 1, ln="per_feature")
    tensors = _away_from_relu_ties(make_inputs(case, generator=torch.Generator().manual_seed(5)), case)
    with launch.trace_launches() as seen:
        y, grads = run_op(recfuse.ln_tanh_linear_relu, tensors, torch.float32, case)
    kinds = [s[0] for s in seen]
    assert kinds == ["forward"], kinds
    (_, fwd_grid, fwd_meta, _), = seen
    assert fwd_meta.get("FEATURES_FIRST") and fwd_grid[0] == case.F, fwd_grid
    y_ref, g_ref = run_op(recfuse.reference.ln_tanh_linear_relu, tensors, torch.float64, case, keep_view=False)
    assert rel_err(y, y_ref) < TOLERANCE[torch.float32]
    for g, r in zip(grads, g_ref):
        assert rel_err(g, r) < 1e-4
