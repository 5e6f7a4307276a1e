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


# -- feature_dim and eps of other types ----------------------------------------------------------


def test_a_float_feature_dim_is_refused_by_name():
    """Before: TypeError: tuple indices must be integers or slices, not float (1.0 == 1 passed the
    check, then indexed x.shape)."""
    x, w = torch.randn(B, F_, D), torch.randn(H, D)
    with pytest.raises(ValueError, match=r"feature_dim must be 0 .* got 1\.0"):
        recfuse.ln_tanh_linear_relu(x, w, feature_dim=1.0)
    fp = recfuse.FusedFeatureProcessor(["a", "b", "c"], D, H)
    with pytest.raises(ValueError, match=r"feature_dim must be 0 .* got 1\.0"):
        fp(x, feature_dim=1.0)


@pytest.mark.parametrize("fn", [recfuse.ln_tanh_linear_relu, recfuse.feature_mlp])
@pytest.mark.parametrize("bad", [True, 1.0])
def test_a_validated_call_does_not_let_an_equal_bad_feature_dim_through(fn, bad):
    """Before: after a call with feature_dim=1, the same call with feature_dim=True (or 1.0) ran
    (True == 1 hit the validated signature), where on its own it is refused."""
    x, w = torch.randn(B, F_, D), torch.randn(H, D)
    fn(x, w, feature_dim=1)
    with pytest.raises(ValueError, match="feature_dim must be 0"):
        fn(x, w, feature_dim=bad)


def test_a_validated_call_does_not_let_an_equal_bad_eps_through():
    """Before: after a call with eps=1, eps=True ran as 1.0 (True == 1 hit the validated
    signature); on its own a bool eps is refused."""
    x, w = torch.randn(F_, B, D), torch.randn(H, D)
    recfuse.ln_tanh_linear_relu(x, w, eps=1)
    with pytest.raises(ValueError, match="eps must be a float >= 0, got True"):
        recfuse.ln_tanh_linear_relu(x, w, eps=True)


# -- sparse and nested tensors -----------------------------------------------------------------


@pytest.mark.parametrize("which", ["x_sparse", "x_nested", "weight_sparse", "ln_weight_sparse"])
def test_sparse_and_nested_tensors_are_refused_by_name(which):
    """Before: RuntimeError: unsupported memory format option Contiguous (sparse x, deep in the
    compiled path), Internal error: NestedTensorImpl doesn't support sizes (nested x), and for a
    sparse weight an error from inside the composite."""
    x, w, b, lw, lb = _inputs()
    if which == "x_sparse":
        x = x.to_sparse()
    elif which == "x_nested":
        x = torch.nested.nested_tensor(list(x))
    elif which == "weight_sparse":
        w = w.to_sparse()
    else:
        lw = lw.to_sparse()
    name = which.rsplit("_", 1)[0]
    with pytest.raises(TypeError, match=rf"^{name} must be a dense \(strided\) tensor"):
        recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb)


def test_state_dict_without_metadata_in_another_feature_order_is_refused():
    # dict(sd) (or a tensor-only format) drops `_metadata`; the feature order travels as a key too.
    saver = recfuse.FusedFeatureProcessor(["a", "b", "c"], 4, 2)
    with torch.no_grad():
        for p in saver.parameters():
            p.copy_(torch.randn_like(p))
    plain = dict(saver.state_dict())
    assert not hasattr(plain, "_metadata")
    with pytest.raises(RuntimeError, match=r"features in the order \['a', 'b', 'c'\]"):
        recfuse.FusedFeatureProcessor(["c", "a", "b"], 4, 2).load_state_dict(plain)
    # the same order loads, and a state_dict saved before the names were a key still loads strictly
    same = recfuse.FusedFeatureProcessor(["a", "b", "c"], 4, 2)
    same.load_state_dict(plain)
    old = recfuse.FusedFeatureProcessor(["a", "b", "c"], 4, 2)
    old.load_state_dict({k: v for k, v in plain.items() if k != "_extra_state"})
    x = torch.randn(5, 12)
    torch.testing.assert_close(same(x), saver(x), rtol=0, atol=0)
    torch.testing.assert_close(old(x), saver(x), rtol=0, atol=0)
