"""The op's per-signature records (issue 15, host path): a validated signature keeps the launch
plans its calls ran (`recfuse._checks.SignatureRecord`), and a later call of that signature goes
straight to them, past `_forward_impl` / `launch.forward` / `launch.backward`. Whatever a plan
depends on is in the signature, so each test changes one thing (shape, stride, dtype, grad_y's
layout, a parameter replaced, a plan cache cleared, a `configs.override` block) and checks that the
call is planned again (or reads the new tensor) and matches the float64 reference, forward and
gradients.
"""
import dataclasses
import importlib

import pytest
import torch
from torch import nn

import recfuse
from recfuse.ops import configs, launch

op_module = importlib.import_module("recfuse.ops.ln_tanh_linear_relu")

pytestmark = pytest.mark.interpret  # plans belong to the Triton path (the interpreter on CPU)

TOL = 1e-5


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def reference(x, w, b, lw, lb, feature_dim):
    args = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, b, lw, lb)]
    y = recfuse.reference.ln_tanh_linear_relu(args[0], args[1], args[2], ln_weight=args[3], ln_bias=args[4],
                                              feature_dim=feature_dim)
    return y, args


def record_of(x, w, b=None, lw=None, lb=None, feature_dim=1):
    return op_module._VALIDATED.known.get(recfuse._checks.call_signature(x, w, b, lw, lb, 1e-5, feature_dim))


class CountForward:
    """Counts `launch.forward` / `launch.backward` calls (the path a call without a kept plan takes)."""

    def __init__(self, monkeypatch):
        self.forward = self.backward = 0
        real_fwd, real_bwd = launch.forward, launch.backward

        def fwd(*a, **k):
            self.forward += 1
            return real_fwd(*a, **k)

        def bwd(*a, **k):
            self.backward += 1
            return real_bwd(*a, **k)

        monkeypatch.setattr(launch, "forward", fwd)
        monkeypatch.setattr(launch, "backward", bwd)


def inputs(F=3, B=6, D=16, H=2, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, F * D, generator=g).view(B, F, D).to(dtype)
    w = (torch.randn(H, D, generator=g) * D ** -0.5).to(dtype)
    b = (0.1 * torch.randn(H, generator=g)).to(dtype)
    lw = (1 + 0.2 * torch.randn(F, D, generator=g)).to(dtype)
    lb = (0.2 * torch.randn(F, D, generator=g)).to(dtype)
    for t in (w, b, lw, lb):
        t.requires_grad_(requires_grad)
    return x, w, b, lw, lb


def call(x, w, b, lw, lb, feature_dim=1):
    return recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=feature_dim)


def check_forward(x, w, b, lw, lb, feature_dim=1, tol=TOL):
    with torch.no_grad():
        y = call(x, w, b, lw, lb, feature_dim)
    ref, _ = reference(x, w, b, lw, lb, feature_dim)
    assert rel_err(y, ref) < tol


def test_a_kept_forward_plan_serves_its_signature_only(monkeypatch):
    x, w, b, lw, lb = inputs()
    check_forward(x, w, b, lw, lb)
    record = record_of(x, w, b, lw, lb)
    assert record is not None and record.fwd is launch._FORWARD_PLANS[record.key + (False, recfuse.chain.DEFAULT)]
    counts = CountForward(monkeypatch)
    x2 = torch.randn_like(x) * 3  # same signature, new values: the kept plan, new numbers
    check_forward(x2, w, b, lw, lb)
    assert counts.forward == 0
    # new shape (B), new strides (a contiguous [B, F, D] of another row stride), new dtype: each
    # goes through launch.forward once, then its own record's plan
    g = torch.Generator().manual_seed(5)
    for new in (torch.randn(7, 3, 16, generator=g),
                torch.randn(6, 3, 32, generator=g)[..., ::2],
                torch.randn(3, 6, 16, generator=g).transpose(0, 1)):
        before = counts.forward
        check_forward(new, w, b, lw, lb)
        check_forward(new, w, b, lw, lb)
        assert counts.forward == before + 1
        assert record_of(new, w, b, lw, lb).fwd is not None
    xb, wb, bb, lwb, lbb = (t.bfloat16() for t in (x, w, b, lw, lb))
    before = counts.forward
    check_forward(xb, wb, bb, lwb, lbb, tol=2e-2)
    check_forward(xb, wb, bb, lwb, lbb, tol=2e-2)
    assert counts.forward == before + 1


def test_a_parameter_replaced_after_the_plan_is_kept_is_read_or_revalidated():
    x, w, b, lw, lb = inputs(seed=1)
    check_forward(x, w, b, lw, lb)
    check_forward(x, w, b, lw, lb)
    g = torch.Generator().manual_seed(11)
    check_forward(x, torch.randn(2, 16, generator=g), b, lw, lb)          # same signature, other tensor
    check_forward(x, torch.randn(3, 2, 16, generator=g), b, lw, lb)       # per-feature weight: new signature
    check_forward(x, w, b, torch.randn(16, generator=g), None)            # shared LN weight, no LN bias
    # a bad parameter after good calls of the same x: the first call's clear errors
    with pytest.raises(ValueError, match=r"weight must be \[H, D=16\]"):
        call(x, torch.randn(2, 15), b, lw, lb)
    with pytest.raises(TypeError, match="bias has dtype torch.float64"):
        call(x, w, b.double(), lw, lb)
    with pytest.raises(ValueError, match=r"ln_bias must be \[D=16\] or \[F=3, D=16\]"):
        call(x, w, b, lw, lb[:2])


def training_step(x, w, b, lw, lb, g=None, feature_dim=1):
    for t in (w, b, lw, lb):
        t.grad = None
    y = call(x, w, b, lw, lb, feature_dim)
    (y.sum() if g is None else (y * g).sum()).backward()
    return y, [t.grad for t in (w, b, lw, lb)]


def check_training(x, w, b, lw, lb, g=None, tol=TOL):
    y, grads = training_step(x, w, b, lw, lb, g)
    ref, args = reference(x, w, b, lw, lb, 1)
    (ref.sum() if g is None else (ref * g.double()).sum()).backward()
    assert rel_err(y, ref) < tol
    for got, want in zip(grads, args[1:]):
        assert rel_err(got, want.grad) < tol


def test_kept_backward_plans_follow_grad_y_and_the_parameters(monkeypatch):
    x, w, b, lw, lb = inputs(seed=2, requires_grad=True)
    check_training(x, w, b, lw, lb)
    check_training(x, w, b, lw, lb)
    record = record_of(x, w, b, lw, lb)
    assert record.fwd_stats is not None and record.bwd is not None
    counts = CountForward(monkeypatch)
    check_training(x, w, b, lw, lb)
    assert (counts.forward, counts.backward) == (0, 0)  # forward and backward from the record
    # grad_y of another layout (y.sum() gives an expanded one; this one is dense): its own plan
    gy = torch.randn(6, 3, 2)
    check_training(x, w, b, lw, lb, gy)
    check_training(x, w, b, lw, lb, gy)
    assert counts.backward == 1 and counts.forward == 0
    check_training(x, w, b, lw, lb)  # and back to the first grad_y's layout
    # parameters replaced by the user: same signature (read), another shape (a new signature)
    w2 = torch.randn(2, 16, requires_grad=True)
    check_training(x, w2, b, lw, lb)
    w3 = torch.randn(3, 2, 16, requires_grad=True)
    check_training(x, w3, b, lw, lb)
    check_training(x, w3, b, lw, lb)
    # x requiring grad too (dx from the same kept plans)
    xg = x.detach().clone().requires_grad_(True)
    y, _ = training_step(xg, w3, b, lw, lb)
    ref, args = reference(xg, w3, b, lw, lb, 1)
    ref.sum().backward()
    assert rel_err(xg.grad, args[0].grad) < TOL


def test_clearing_the_launch_caches_drops_the_kept_plans():
    x, w, b, lw, lb = inputs(seed=3)
    check_forward(x, w, b, lw, lb)
    check_forward(x, w, b, lw, lb)
    record = record_of(x, w, b, lw, lb)
    assert record.fwd is not None
    launch._FORWARD_PLANS.clear()
    assert record.fwd is None
    check_forward(x, w, b, lw, lb)  # planned again, into the launch cache
    assert record.fwd is launch._FORWARD_PLANS[record.key + (False, recfuse.chain.DEFAULT)]
    xg, wg, bg, lwg, lbg = inputs(seed=3, requires_grad=True)
    check_training(xg, wg, bg, lwg, lbg)
    check_training(xg, wg, bg, lwg, lbg)
    record = record_of(xg, wg, bg, lwg, lbg)
    assert record.bwd is not None
    launch._BACKWARD_PLANS.clear()
    assert record.bwd is None and record.fwd_stats is None
    check_training(xg, wg, bg, lwg, lbg)
    assert record.bwd is not None


def test_an_override_block_is_not_served_a_kept_plan():
    x, w, b, lw, lb = inputs(seed=4)
    check_forward(x, w, b, lw, lb)
    check_forward(x, w, b, lw, lb)
    kept = record_of(x, w, b, lw, lb).fwd
    forced = dataclasses.replace(configs.heuristic_forward(16, 2, torch.float32, False), block_b=2)
    assert kept.meta["BLOCK_B"] != 2
    with configs.override(forward=lambda D, H, dtype, full_tiles: forced):
        with launch.trace_launches() as seen:
            check_forward(x, w, b, lw, lb)
    assert seen and seen[0][2]["BLOCK_B"] == 2
    with launch.trace_launches() as seen:
        check_forward(x, w, b, lw, lb)
    assert seen[0][2] is kept.meta  # outside the block: the kept plan again


def test_ffp_and_transform_read_replaced_parameters_through_kept_plans():
    torch.manual_seed(0)
    F, D, H, B = 3, 16, 2, 6
    ffp = recfuse.FusedFeatureProcessor([f"f{i}" for i in range(F)], D, H)
    x = torch.randn(B, F * D)

    def ffp_reference():
        ref, args = reference(x.view(B, F, D), ffp.weight, ffp.bias, ffp.ln_weight, ffp.ln_bias, 1)
        return ref.reshape(B, F * H), args

    for _ in range(3):
        ffp.zero_grad(set_to_none=True)
        ffp(x).sum().backward()
        ref, args = ffp_reference()
        ref.sum().backward()
        assert rel_err(ffp.weight.grad, args[1].grad) < TOL
    ffp.weight = nn.Parameter(torch.randn_like(ffp.weight))  # replaced, same signature
    ffp.zero_grad(set_to_none=True)
    y = ffp(x)
    y.sum().backward()
    ref, args = ffp_reference()
    ref.sum().backward()
    assert rel_err(y, ref) < TOL and rel_err(ffp.weight.grad, args[1].grad) < TOL

    class PerSlice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(F)])
            self.linear = nn.Linear(D, H)

        def forward(self, x):
            outs = [torch.tanh(ln(s)) for ln, s in zip(self.lns, torch.split(x, D, dim=1))]
            return torch.relu(self.linear(torch.stack(outs, dim=1)))

    fused = recfuse.transform(PerSlice(), (x,))
    for _ in range(2):
        with torch.no_grad():
            fused(x)
    new_w = torch.randn(H, D)
    fused.linear.weight = nn.Parameter(new_w.clone())  # replaced: read by the graph's read_attr
    params = dict(fused.named_parameters())
    ref, _ = reference(x.view(B, F, D), new_w, params["linear.bias"], params["recfuse_g0_ln_weight"],
                       params["recfuse_g0_ln_bias"], 1)
    with torch.no_grad():
        assert rel_err(fused(x), ref) < TOL
    # a parametrization swaps the module's class: the read goes through getattr and sees it
    torch.nn.utils.parametrize.register_parametrization(fused.linear, "weight", _Doubled())
    ref, _ = reference(x.view(B, F, D), 2 * new_w, params["linear.bias"], params["recfuse_g0_ln_weight"],
                       params["recfuse_g0_ln_bias"], 1)
    with torch.no_grad():
        assert rel_err(fused(x), ref) < TOL


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def test_a_bound_ffp_call_holds_its_record_and_a_clear_still_reaches_it(monkeypatch):
    torch.manual_seed(1)
    F, D, H, B = 3, 16, 2, 5
    ffp = recfuse.FusedFeatureProcessor([f"f{i}" for i in range(F)], D, H)
    x = torch.randn(B, F * D)

    def check():
        with torch.no_grad():
            y = ffp(x)
        ref, _ = reference(x.view(B, F, D), ffp.weight, ffp.bias, ffp.ln_weight, ffp.ln_bias, 1)
        assert rel_err(y, ref.reshape(B, F * H)) < TOL

    check()
    check()
    (bound,) = ffp._bound._calls.values()
    record = bound.record
    assert record is not None and record.fwd is not None
    # the op's records overflow (its `known` starts over): the bound call keeps its record, and
    # a clear of the launch caches still drops its plan
    monkeypatch.setattr(op_module._VALIDATED, "limit", 1)
    call(torch.randn(2, 3, 16), torch.randn(2, 16), None, None, None)
    call(torch.randn(3, 3, 16), torch.randn(2, 16), None, None, None)
    assert all(r is not record for r in op_module._VALIDATED.known.values())
    launch._FORWARD_PLANS.clear()
    assert record.fwd is None
    check()
    assert record.fwd is launch._FORWARD_PLANS[record.key + (False, recfuse.chain.DEFAULT)]
    with torch.no_grad():
        ffp.weight.copy_(torch.randn_like(ffp.weight))  # new values in place: read
    check()
