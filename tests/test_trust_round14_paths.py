"""Red-team round 14: the paths this session added, under the Triton interpreter, each against the
float64 reference (`recfuse.reference`, `composite_backward` on float64) with an explicit tolerance
(fp32: y 1e-5, gradients 1e-4 relative in norm; bf16 1e-2; fp16 5e-3), together with the kernel
path or config that ran (`launch.trace_launches`).

Probed and found right (probe scripts, F=2, B=8-64; no test of their own unless below):
* the default configs (heuristic: per-column backward at H = 2-4) at D in {1, 3, 16, 32, 64, 100,
  1024} x H in {2, 3, 4} x fp32 / bf16 / fp16 x both layouts, per-feature bias and LayerNorm affine:
  y and every gradient within tolerance.
* the per-column backward (`unroll_h=1`, BLOCK_H 2 / 8) and the per-column forward (BLOCK_H = 1)
  forced together at H = 2, 5, 7, 8, D in {8, 16, 24, 32, 40, 64}, fp32 / bf16 / fp16, chains
  LayerNorm-tanh-relu, tanh-gelu, RMSNorm-gelu_tanh-silu, none-relu-sigmoid, LayerNorm-none-none,
  4- / 16- / heuristic-row tiles, full tiles (EVEN_B and EVEN_D: the unmasked loads of column 0),
  x_evict, num_stages, saved and recomputed statistics: all within tolerance.
* constant rows (c = -12345.678 / 1000.1; fp16 -1234.5) through the per-column forward and
  backward, prefetching or not, saved or recomputed statistics, fp32 / bf16 / fp16, H = 3, 6,
  D = 24, 40: y and every gradient within tolerance (the 48 combinations).
* saved vs recomputed statistics: the same bits wherever the forward's statistics are the
  whole-row kernel's (fp32 D=24 H=3, D=256 H=1; every bf16 shape probed). Not where the forward is
  the fp32 K-chunked one: see the xfail below.
* `configs.override` with a backward run after its block closed, twice with retain_graph, through
  `torch.ops.recfuse.ln_tanh_linear_relu`, `recfuse.feature_mlp` and `torch.ops.recfuse.feature_mlp`:
  the forced config runs. create_graph (double backward) runs the composite, no config involved.
* a table entry that sets both `unroll_h` and `prefetch` would take the prefetching broadcast sum
  (launch.py tests PREFETCH first) with the per-column path's longer row tiles; the tuner never
  writes one (it sets prefetch on tl.dot candidates only) and none of the shipped tables has one.

Found wrong (before -> after):
1. Nested `configs.override` blocks: an inner ``override(forward=...)`` replaced the whole state, so
   it dropped the outer block's forced backward (and use_tables=False): the backward of a call
   made in the inner block silently took the heuristic's per-column config (64-row tiles) instead
   of the forced 4-row broadcast sum. Fixed (`configs.override` keeps what an inner block does not
   force). `test_nested_override_keeps_the_outer_block_s_backward`.
2. The op's autograd node re-opened its forward's block only where no block was open. A CPU
   backward run inside another block (same thread) took that block's config; on CUDA (autograd's
   device thread sees no block) the same code took the forward's. Fixed (`_backward` always runs
   under the forward's block, or none). `test_backward_takes_the_forward_s_block_wherever_it_runs`.
3. Not fixed, pinned (xfail strict): a torch.compile'd call's backward looks its config up when
   it runs, so a backward after the block closed (and on CUDA any compiled backward: autograd's
   device thread) does not take the forced config. The backward graph has no place for the block;
   the eager paths carry it on their ctx. `test_compiled_backward_after_the_block_keeps_the_forced_config`.
4. Not fixed, pinned (xfail strict): saved and recomputed statistics give different bits where the
   fp32 forward is the K-chunked one (the default at fp32 D=64 / 96, H=2-4: Chan's chunk-wise
   mean and M2 about the pivot) and the backward reads them (the per-column backward): eager
   autograd (saved) and the custom op (torch.compile / export: recomputed) give gradients an ulp
   or so apart (x.grad 2e-7, weight.grad 1e-6-2e-6 absolute), both within 1e-6 of float64. Making
   them equal means dropping the chunked forward's stats (a backward cost not measurable here) or
   a third pass over the chunks in the forward. `test_chunked_forward_stats_give_the_recomputed_bits`.
"""
import logging

import pytest
import torch

import recfuse
from op_cases import Case, make_inputs
from recfuse.ops import configs, launch
from recfuse.ops.composite import composite_backward

interpret = pytest.mark.interpret

CASE = Case(2, 37, 32, 3, ln="per_feature")
NAMES = ("x", "weight", "bias", "ln_weight", "ln_bias")


def _inputs(case=CASE, seed=8):
    return tuple(t.float() for t in make_inputs(case, generator=torch.Generator().manual_seed(seed)))


def _forced_bwd(D, H, dtype):
    # the broadcast sum in 4-row tiles: far from the heuristic's per-column 64-row tiles
    return configs.heuristic_backward(D, H, dtype, unroll_h=0, block_b=4, programs_per_sm=1)


def _row_fwd(D, H, dtype, full_tiles=True):
    return configs.heuristic_forward(D, H, dtype, full_tiles, block_k=0)


def _bwd_cfgs(seen):
    return [(cfg.block_b, cfg.unroll_h) for kind, _, _, cfg in seen if kind == "backward"]


def _check_x_grad(dx, x, w, b, lw, lb, gy, tol=1e-4):
    x64 = x.double().requires_grad_(True)
    y64 = recfuse.reference.ln_tanh_linear_relu(x64, w.double(), b.double(), ln_weight=lw.double(),
                                                ln_bias=lb.double())
    (dx64,) = torch.autograd.grad(y64, x64, gy.double())
    assert ((dx.double() - dx64).norm() / dx64.norm()).item() < tol


@interpret
def test_nested_override_keeps_the_outer_block_s_backward():
    x, w, b, lw, lb, gy = _inputs()
    xg = x.clone().requires_grad_(True)
    with configs.override(backward=_forced_bwd):
        with configs.override(forward=_row_fwd), launch.trace_launches() as seen:
            y = recfuse.ln_tanh_linear_relu(xg, w, b, ln_weight=lw, ln_bias=lb)
            (dx,) = torch.autograd.grad(y, xg, gy)
    # before: [(64, 1)], the heuristic's per-column backward
    assert _bwd_cfgs(seen) == [(4, 0)]
    fwd = [m for kind, _, m, _ in seen if kind == "forward"]
    assert fwd and fwd[0]["BLOCK_K"] == fwd[0]["BLOCK_D"]  # the inner block's forward holds too
    _check_x_grad(dx, x, w, b, lw, lb, gy)
    # use_tables=False of the outer block is kept as well
    with configs.override(use_tables=False):
        with configs.override(forward=_row_fwd):
            assert configs.current_override()[2] is False


ENTRIES = {
    "public": lambda x, w, b, lw, lb: recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb),
    "torch.ops": lambda x, w, b, lw, lb: torch.ops.recfuse.ln_tanh_linear_relu(x, w, b, lw, lb, 1e-5, 0),
    "feature_mlp": lambda x, w, b, lw, lb: recfuse.feature_mlp(x, w, b, ln_weight=lw, ln_bias=lb),
}


@interpret
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_backward_takes_the_forward_s_block_wherever_it_runs(entry):
    fn = ENTRIES[entry]
    x, w, b, lw, lb, gy = _inputs()
    # forward in a block forcing the backward; backward in another block on the same thread
    xg = x.clone().requires_grad_(True)
    with configs.override(backward=_forced_bwd):
        y = fn(xg, w, b, lw, lb)
    with configs.override(forward=_row_fwd), launch.trace_launches() as seen:
        (dx,) = torch.autograd.grad(y, xg, gy, retain_graph=True)
    assert _bwd_cfgs(seen) == [(4, 0)]  # before: [(64, 1)], the other block's (the heuristic)
    _check_x_grad(dx, x, w, b, lw, lb, gy)
    # after every block closed, twice (retain_graph): still the forward's block
    with launch.trace_launches() as seen:
        (dx2,) = torch.autograd.grad(y, xg, gy)
    assert _bwd_cfgs(seen) == [(4, 0)]
    _check_x_grad(dx2, x, w, b, lw, lb, gy)
    # and a forward outside any block keeps the usual config, whatever block its backward runs in
    # (as autograd's CUDA device thread, which sees no block, always did)
    xg = x.clone().requires_grad_(True)
    y = fn(xg, w, b, lw, lb)
    with configs.override(backward=_forced_bwd), launch.trace_launches() as seen:
        (dx3,) = torch.autograd.grad(y, xg, gy)
    assert _bwd_cfgs(seen) == [(64, 1)]
    _check_x_grad(dx3, x, w, b, lw, lb, gy)


@interpret
@pytest.mark.xfail(strict=True, reason="a compiled backward looks its config up when it runs: the "
                   "forward's override block does not reach it (finding 3, not fixed)")
def test_compiled_backward_after_the_block_keeps_the_forced_config(caplog):
    x, w, b, lw, lb, gy = _inputs()
    xg = x.clone().requires_grad_(True)
    fn = torch.compile(lambda a: recfuse.ln_tanh_linear_relu(a, w, b, ln_weight=lw, ln_bias=lb),
                       backend="aot_eager", fullgraph=True)
    with configs.override(backward=_forced_bwd):
        y = fn(xg)
    with launch.trace_launches() as seen:
        (dx,) = torch.autograd.grad(y, xg, gy)
    _check_x_grad(dx, x, w, b, lw, lb, gy)  # the numbers are right either way
    assert _bwd_cfgs(seen) == [(4, 0)]  # the heuristic's (64, 1) runs


@interpret
@pytest.mark.xfail(strict=True, reason="the fp32 K-chunked forward's statistics (Chan) are not the "
                   "backward's recomputed ones bit for bit (finding 4, not fixed)")
def test_chunked_forward_stats_give_the_recomputed_bits():
    case = Case(2, 40, 64, 3, ln="per_feature")
    x, w, b, lw, lb, gy = _inputs(case, seed=1)
    with launch.trace_launches() as seen:
        _, stats = launch.forward(x, w, b, lw, lb, case.eps, 0, save_stats=True)
        saved = launch.backward(gy, x, w, b, lw, lb, case.eps, 0, stats)
        recomputed = launch.backward(gy, x, w, b, lw, lb, case.eps, 0)
    fwd = [m for kind, _, m, _ in seen if kind == "forward"][0]
    bwd = [m for kind, _, m, _ in seen if kind == "backward"]
    assert fwd["BLOCK_K"] < fwd["BLOCK_D"] and [m["LOAD_STATS"] for m in bwd] == [True, False]
    assert all(m.get("UNROLL_H") for m in bwd)
    x64, w64, b64, lw64, lb64 = (t.double() for t in (x, w, b, lw, lb))
    reference = composite_backward(gy.double(), x64, w64, b64, lw64, lb64, case.eps, 0)
    for name, s, r, ref in zip(NAMES, saved, recomputed, reference):
        for g in (s, r):
            assert ((g.double() - ref).norm() / ref.norm()).item() < 1e-4, name
    assert all(torch.equal(s, r) for s, r in zip(saved, recomputed))


PER_COLUMN_CASES = [
    # (case, dtype, chain): what tests/test_kernels.py's per-column cases leave out: fp16, H = 5 and
    # 7 (BLOCK_H = 8: a table entry lends the per-column backward to H = 5-8), full tiles (EVEN_B
    # and EVEN_D: column 0's unmasked loads), a gelu out-activation, no norm.
    (Case(2, 32, 16, 5, ln="per_feature", bias="per_feature"), torch.float16, ("layer_norm", "tanh", "relu")),
    (Case(2, 19, 24, 7, feature_dim=1, per_feature_weight=True, ln="shared"), torch.float32,
     ("layer_norm", "tanh", "gelu")),
    (Case(1, 32, 32, 2, ln="none", bias="none"), torch.bfloat16, (None, "silu", "relu")),
]


@interpret
@pytest.mark.parametrize("saved_stats", [True, False], ids=["saved-stats", "recomputed-stats"])
@pytest.mark.parametrize("case, dtype, chain", PER_COLUMN_CASES, ids=str)
def test_per_column_forward_and_backward_match_float64(case, dtype, chain, saved_stats):
    from recfuse.chain import chain_of

    chain = chain_of(*chain)
    x, w, b, lw, lb, gy = make_inputs(case, generator=torch.Generator().manual_seed(4))
    if chain.norm is None:
        lw = lb = None
    args = [None if t is None else t.to(dtype) for t in (x, w, b, lw, lb)]
    gy = gy.to(dtype)
    a64 = [None if t is None else t.double() for t in args]
    if chain.out_activation == "relu":  # relu ties: rounding decides the mask on any path
        z = recfuse.reference.feature_mlp(a64[0], a64[1], a64[2], ln_weight=a64[3], ln_bias=a64[4], eps=case.eps,
                                          feature_dim=case.feature_dim, norm=chain.norm,
                                          activation=chain.activation, out_activation=None)
        gy = gy.masked_fill(z.abs() < 1e-3, 0)
    fwd = lambda D, H, dt, ft=True: configs.heuristic_forward(  # noqa: E731
        D, H, dt, ft, use_dot=False, unroll_h=1, block_b=8, persistent=0, tile_stages=1, block_k=0)
    bwd = lambda D, H, dt: configs.heuristic_backward(  # noqa: E731
        D, H, dt, use_dot=False, unroll_h=1, block_b=8, programs_per_sm=1)
    with configs.override(forward=fwd, backward=bwd), launch.trace_launches() as seen:
        y, stats = launch.forward(*args, case.eps, case.feature_dim, save_stats=True, chain=chain)
        grads = launch.backward(gy, *args, case.eps, case.feature_dim, stats if saved_stats else None, chain=chain)
    fmeta = [m for kind, _, m, _ in seen if kind == "forward"]
    bmeta = [m for kind, _, m, _ in seen if kind == "backward"]
    assert fmeta[0]["BLOCK_H"] == 1 and not fmeta[0]["USE_DOT"]
    assert bmeta[0].get("UNROLL_H") and bmeta[0]["BLOCK_H"] in (2, 8) and bmeta[0]["LOAD_STATS"] == (
        saved_stats and chain.norm is not None)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}[dtype]
    y64 = recfuse.reference.feature_mlp(a64[0], a64[1], a64[2], ln_weight=a64[3], ln_bias=a64[4], eps=case.eps,
                                        feature_dim=case.feature_dim, norm=chain.norm, activation=chain.activation,
                                        out_activation=chain.out_activation)
    assert ((y.double() - y64).norm() / y64.norm()).item() < tol
    reference = composite_backward(gy.double(), *a64, case.eps, case.feature_dim, chain)
    gtol = 1e-4 if dtype == torch.float32 else tol
    for name, g, r in zip(NAMES, grads, reference):
        if r is None or not g.numel():
            continue
        assert g.shape == r.shape
        assert ((g.double() - r).norm() / r.norm().clamp_min(1e-12)).item() < gtol, name
