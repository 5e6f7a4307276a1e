"""Small helpers the red-team test files share: comparisons against the original, parameters drawn
far from their initial values, a torch.save / torch.load round trip."""
import io

import torch
from torch import nn


def close(a, b, tol=1e-5):
    """assert_close with one absolute and relative tolerance."""
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


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
