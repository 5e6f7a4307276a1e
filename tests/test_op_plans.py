"""The op's per-signature caches (validated arguments, launch plans) never serve a call they do
not fit: a new shape, stride, dtype or parameter is checked and planned again, and new values in
the same tensors are read. Compared with the float64 per-slice reference."""
import pytest
import torch

import recfuse
from recfuse.ops import launch
from op_cases import rel_err

pytestmark = pytest.mark.interpret  # the plans belong to the Triton path (interpreter on CPU)


def _reference(x, w, b, lw, lb, feature_dim):
    args = [None if t is None else t.double() for t in (x, w, b, lw, lb)]
    return recfuse.reference.ln_tanh_linear_relu(args[0], args[1], args[2], ln_weight=args[3], ln_bias=args[4],
                                                 feature_dim=feature_dim)


def _check(x, w, b=None, lw=None, lb=None, feature_dim=1, tol=1e-5):
    y = recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=feature_dim)
    ref = _reference(x, w, b, lw, lb, feature_dim)
    err = ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    assert err < tol, err


def test_same_signature_new_values_and_a_replaced_parameter_are_read():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 16, generator=g)
    w = torch.randn(2, 16, generator=g)
    _check(x, w)
    x.copy_(torch.randn(6, 3, 16, generator=g) * 3)  # same tensor, new values
    _check(x, w)
    w = torch.randn(2, 16, generator=g)  # a parameter replaced by one of the same signature
    _check(x, w, torch.randn(2, generator=g))


def test_new_shape_stride_and_dtype_are_planned_again():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 16, generator=g)
    _check(torch.randn(6, 3, 16, generator=g), w)
    _check(torch.randn(7, 3, 16, generator=g), w)                                  # new B
    base = torch.randn(3, 6, 16, generator=g)
    _check(base.transpose(0, 1), w)                                                # new strides
    with launch.trace_launches() as seen:
        _check(torch.randn(6, 3, 16, generator=g).bfloat16(), w.bfloat16(), tol=2e-2)  # new dtype
    assert seen and seen[0][0] == "forward"


def test_a_bad_call_after_a_good_one_still_raises_the_clear_error():
    x = torch.randn(6, 3, 16)
    recfuse.ln_tanh_linear_relu(x, torch.randn(2, 16), feature_dim=1)
    with pytest.raises(ValueError, match=r"weight must be \[H, D=16\]"):
        recfuse.ln_tanh_linear_relu(x, torch.randn(2, 15), feature_dim=1)
    with pytest.raises(ValueError, match=r"ln_weight must be \[D=16\] or \[F=3, D=16\]"):
        recfuse.ln_tanh_linear_relu(x, torch.randn(2, 16), ln_weight=torch.randn(4, 16), feature_dim=1)
    with pytest.raises(TypeError, match="weight has dtype torch.float64"):
        recfuse.ln_tanh_linear_relu(x, torch.randn(2, 16, dtype=torch.float64), feature_dim=1)


def _forward_out_of_resources_at_width(monkeypatch, D):
    """Forward launches of rows D wide raise OutOfResources, as Triton does where a kernel needs
    more shared memory than the device has (the interpreter never runs out)."""
    from triton.runtime.errors import OutOfResources

    real_call = launch.ForwardPlan.__call__

    def launch_or_out_of_resources(plan, x, *args):
        if x.shape[2] == D:
            raise OutOfResources(401408, 232448, "shared memory")
        return real_call(plan, x, *args)

    monkeypatch.setattr(launch.ForwardPlan, "__call__", launch_or_out_of_resources)


def test_a_forward_that_does_not_fit_the_device_falls_back_to_the_composite(monkeypatch, caplog):
    # On the H100, fp32 H >= 40 with 512-1024-wide masked rows needed 401-659 KB of shared memory
    # and raised OutOfResources from the forward (found by tests/test_op_cuda_property.py). The
    # interpreter never runs out, so the launch of one shape is made to raise as Triton does.
    _forward_out_of_resources_at_width(monkeypatch, 24)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 24, generator=g, requires_grad=True)
    w = torch.randn(6, 24, generator=g, requires_grad=True)
    lw = torch.randn(3, 24, generator=g, requires_grad=True)
    with caplog.at_level("WARNING", logger="recfuse"):
        y = recfuse.ln_tanh_linear_relu(x, w, ln_weight=lw, feature_dim=1)
        y.backward(torch.ones_like(y))
    assert any("composite forward" in r.getMessage() and "D=24" in r.getMessage() for r in caplog.records)
    x64, w64, lw64 = (t.detach().double().requires_grad_(True) for t in (x, w, lw))
    ref = recfuse.reference.ln_tanh_linear_relu(x64, w64, ln_weight=lw64, feature_dim=1)
    ref.backward(torch.ones_like(ref))
    for out, r in ((y, ref), (x.grad, x64.grad), (w.grad, w64.grad), (lw.grad, lw64.grad)):
        assert ((out.double() - r).norm() / r.norm()).item() < 1e-5
    caplog.clear()
    with caplog.at_level("WARNING", logger="recfuse"):
        y2 = recfuse.ln_tanh_linear_relu(x.detach(), w.detach(), ln_weight=lw.detach(), feature_dim=1)
    assert torch.equal(y2, y.detach()) and not caplog.records  # warned once per shape
    with launch.trace_launches() as seen:  # another shape still runs the kernel
        _check(torch.randn(5, 3, 16, generator=g), torch.randn(6, 16, generator=g))
    assert seen and seen[0][0] == "forward"


def test_an_unfit_forward_keeps_falling_back_on_every_later_call_of_its_signature(monkeypatch):
    # The second call of an unfit signature planned it again; the third found that plan in the
    # per-signature cache and launched it: the OutOfResources reached the caller.
    _forward_out_of_resources_at_width(monkeypatch, 40)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 3, 40, generator=g), torch.randn(6, 40, generator=g)
    for _ in range(4):
        _check(x, w)


def test_the_plan_caches_stay_bounded_over_many_batch_sizes(monkeypatch):
    """Every batch size is a signature of its own: a server seeing B = 1..100k kept one forward
    and one backward plan per size ever seen (the dicts grew without bound). They start over
    past their limit (4096; 3 here), and every call still matches float64."""
    monkeypatch.setattr(launch._FORWARD_PLANS, "limit", 3)
    monkeypatch.setattr(launch._BACKWARD_PLANS, "limit", 3)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(2, 16, generator=g, requires_grad=True)
    for B in range(1, 8):
        x = torch.randn(B, 3, 16, generator=g, requires_grad=True)
        _check(x, w)
        y = recfuse.ln_tanh_linear_relu(x, w, feature_dim=1)
        y.backward(torch.ones_like(y))
        x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
        _reference(x64, w64, None, None, None, 1).backward(torch.ones(B, 3, 2, dtype=torch.float64))
        assert rel_err(x.grad, x64.grad) < 1e-4
        assert len(launch._FORWARD_PLANS) <= 3 and len(launch._BACKWARD_PLANS) <= 3
        w.grad = None
