"""Red-team round 6: "never a silent wrong answer", on the op's CPU compiled path, its argument
checks and FusedFeatureProcessor. Each test compares with the eager / float64 composite, or checks
the error that refuses the case. Each docstring says what the case did before its fix."""
import pytest
import torch

import recfuse
from recfuse.ops import cpu_backend

F_, B, D, H = 3, 5, 8, 4


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(F_, B, D, generator=g)
    w = torch.randn(H, D, generator=g) / D ** 0.5
    b = 0.5 + 0.1 * torch.randn(H, generator=g)  # most relus open
    lw = 1 + 0.2 * torch.randn(D, generator=g)
    lb = 0.2 * torch.randn(D, generator=g)
    return x, w, b, lw, lb


def _forward_backward(backend, dtype, eps, fn=recfuse.ln_tanh_linear_relu, **kw):
    x, w, b, lw, lb = (t.to(dtype).requires_grad_(True) for t in _inputs())
    with cpu_backend(backend):
        y = fn(x, w, b, ln_weight=lw, ln_bias=lb, eps=eps, **kw)
        y.backward(torch.ones_like(y))
    return [y.detach()] + [t.grad for t in (x, w, b, lw, lb)]


# -- eps=inf on the compiled CPU backward ------------------------------------------------------


@pytest.mark.parametrize("eps", [float("inf"), 1e39])
def test_compiled_backward_with_an_infinite_eps_matches_the_reference(eps):
    """Before: dx and ln_weight's gradient all NaN (96 and 8 NaNs) on the compiled path, where the
    eager composite and float64 give 0: the backward took rstd == 0 for an overflowed variance
    (eps=inf, or an eps past float32's range, gives rstd = 0 on finite rows)."""
    got = _forward_backward("compiled", torch.float32, eps)
    eager = _forward_backward("eager", torch.float32, eps)
    want = _forward_backward("eager", torch.float64, eps)
    for name, g, e, r in zip(["y", "dx", "dw", "db", "dln_w", "dln_b"], got, eager, want):
        assert not g.isnan().any(), name
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5, msg=name)


def test_compiled_backward_keeps_nan_for_an_overflowed_variance():
    """The NaN the removed check stood for still comes: a row near 1e20 overflows the float32
    variance, and the forward saves rstd = NaN for it."""
    x, w, b, lw, lb = (t.requires_grad_(True) for t in _inputs())
    with torch.no_grad():
        x[0, 1] = 1e20 * torch.linspace(-1, 1, D)
    grads = {}
    for backend in ("compiled", "eager"):
        for t in (x, w, b, lw, lb):
            t.grad = None
        with cpu_backend(backend):
            recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb).sum().backward()
        grads[backend] = x.grad.clone()
    assert grads["compiled"][0, 1].isnan().all()
    assert torch.equal(grads["compiled"].isnan(), grads["eager"].isnan())


# -- meta tensors ------------------------------------------------------------------------------


@pytest.mark.parametrize("chain", [{}, {"activation": "relu"}])
def test_meta_tensors_give_the_shape(chain):
    """Before: RuntimeError: unknown device type for autocast in
    get_autocast_dispatch_key_from_device_type (the entry asked autocast about "meta"), for the
    op, feature_mlp and a FusedFeatureProcessor built with device="meta"."""
    x = torch.empty(F_, B, D, device="meta", requires_grad=True)
    w = torch.empty(H, D, device="meta", requires_grad=True)
    y = recfuse.feature_mlp(x, w, ln_weight=torch.ones(D, device="meta"), **chain)
    assert y.shape == (F_, B, H) and y.device.type == "meta"
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    fp = recfuse.FusedFeatureProcessor(["a", "b", "c"], D, H, device="meta", **chain)
    assert fp(torch.empty(B, F_ * D, device="meta")).shape == (B, F_ * H)
    with pytest.raises(ValueError, match="weight is on cpu but x is on meta"):
        recfuse.ln_tanh_linear_relu(x, torch.randn(H, D))
