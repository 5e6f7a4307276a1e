"""The analytic backward of the chain on whole tensors, in torch ops: the CPU path's backward (and
the fallback where the Triton backward does not fit). Apart from the custom op so that `launch`
and `_cpu_compiled` import it without going through the op's module."""
from __future__ import annotations

import torch

from ..chain import DEFAULT, activation_grad, apply_activation, normalized_rows


def _empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,))


def composite_backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, chain=DEFAULT):
    """Analytic backward of a chain on whole tensors (CPU path), float32 for low precision.

    Recomputes the normalised rows, the activation and the pre-activation z from x (nothing but
    the inputs is kept from forward), the same algorithm the Triton backward kernel runs per row
    tile. Analytic rather than autograd: it runs inside the custom op, below autograd.
    """
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype

    def fm(t):  # features first: [F, B, ...]
        t = t.to(compute)
        return t if feature_dim == 0 else t.transpose(0, 1)

    xf, gy = fm(x), fm(grad_y)
    # NaN where the norm's statistic overflowed, as the kernels give (not rstd = 0 and a finite dx).
    xhat, rstd = normalized_rows(xf, chain.norm, eps)
    lw = None if ln_weight is None else ln_weight.to(compute)
    lw_b = None if lw is None else (lw.unsqueeze(1) if lw.dim() == 2 else lw)
    a = xhat if lw_b is None else xhat * lw_b
    if ln_bias is not None:
        lb = ln_bias.to(compute)
        a = a + (lb.unsqueeze(1) if lb.dim() == 2 else lb)
    t = apply_activation(a, chain.activation)
    w = weight.to(compute)
    z = torch.bmm(t, w.transpose(1, 2)) if w.dim() == 3 else torch.matmul(t, w.t())
    if bias is not None:
        b = bias.to(compute)
        z = z + (b.unsqueeze(1) if b.dim() == 2 else b)
    if chain.out_activation == "relu":
        dz = torch.where(z <= 0, torch.zeros((), dtype=compute), gy)  # NaN z keeps gy, as torch's relu
    else:
        dz = gy * activation_grad(z, apply_activation(z, chain.out_activation), chain.out_activation)
    if w.dim() == 3:
        dt = torch.bmm(dz, w)
        gw = torch.bmm(dz.transpose(1, 2), t)
    else:
        dt = torch.matmul(dz, w)
        gw = torch.einsum("fbh,fbd->hd", dz, t)
    da = dt * activation_grad(a, t, chain.activation)

    def reduce_param(g_fbk, p):  # sum over B, and over F when the parameter is shared
        if p is None:
            return _empty(x)
        g = g_fbk.sum(1)
        return (g if p.dim() == 2 else g.sum(0)).to(p.dtype)

    gb = reduce_param(dz, bias)
    glw = reduce_param(da * xhat, ln_weight)
    glb = reduce_param(da, ln_bias)
    dxhat = da if lw_b is None else da * lw_b
    if chain.norm == "layer_norm":
        gx = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    elif chain.norm == "rms_norm":
        gx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    else:
        gx = dxhat
    gx = gx if feature_dim == 0 else gx.transpose(0, 1)
    # In x's strides, like the kernel's dx (and the fake impl).
    return torch.empty_like(x).copy_(gx), gw.to(weight.dtype), gb, glw, glb

