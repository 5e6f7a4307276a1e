"""Small helpers the red-team test files share: comparisons against the original, parameters drawn
far from their initial values, a torch.save / torch.load round trip."""
import io

import torch
from torch import nn


def close(a, b, tol=1e-5):
    """assert_close with one absolute and relative tolerance."""
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def max_rel_err(a, b) -> float:
    """max |a - b| / max(max |b|, 1), in float64 (0 for empty tensors)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item() if b.numel() else 0.0


def assert_same_jvp(module, reference, x, tx, grad: bool) -> None:
    """``module`` and ``reference`` called on the forward-mode dual of (x, tx) with grad mode
    ``grad``: the same output (1e-5) and the same tangent (1e-4), which must exist."""
    import torch.autograd.forward_ad as fwAD

    got = []
    for m in (module, reference):
        with torch.set_grad_enabled(grad), fwAD.dual_level():
            y = fwAD.unpack_dual(m(fwAD.make_dual(x, tx)))
            got.append((y.primal.detach(), y.tangent))
    (y, t), (y_ref, t_ref) = got
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert t is not None, "no tangent"
    torch.testing.assert_close(t, t_ref, atol=1e-4, rtol=1e-4)


def randomized(m: nn.Module) -> nn.Module:
    """`m` with every parameter drawn from N(0, 1) in place (LayerNorm's ones and zeros would hide
    a swapped or dropped affine), returned."""
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


def reloaded(obj):
    """`obj` after torch.save and torch.load (whole objects, weights_only=False)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
