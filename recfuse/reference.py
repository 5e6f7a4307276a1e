"""Reference implementations of the fused chain: the oracle the fast paths are checked against.

Two forms of split -> LayerNorm -> tanh -> stack -> Linear -> relu live here, and the same two
of the general chain norm -> activation -> Linear -> out activation (`feature_mlp`,
`batched_feature_mlp`):

* `ln_tanh_linear_relu`: literally the per-slice path a model author writes (F slices, F
  layer_norm and tanh calls, a stack, a linear, a relu). It computes in the input's dtype, so
  called on float64 tensors it is the float64 oracle of the tests.
* `batched_ln_tanh_linear_relu`: the same maths on the whole [F, B, D] tensor at once (the
  puzzler's `combined` form), accumulating in float32 for low-precision inputs. The fused op uses
  it as its CPU implementation.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F_

from ._checks import check_chain_args, check_op_args
from .chain import DEFAULT, Chain, apply_activation, normalized_rows

__all__ = ["ln_tanh_linear_relu", "batched_ln_tanh_linear_relu", "feature_mlp", "batched_feature_mlp"]


def _feature_param(p: Optional[torch.Tensor], f: int, per_feature_ndim: int) -> Optional[torch.Tensor]:
    if p is None:
        return None
    return p[f] if p.dim() == per_feature_ndim else p


def ln_tanh_linear_relu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    ln_weight: Optional[torch.Tensor] = None,
    ln_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    feature_dim: int = 0,
) -> torch.Tensor:
    """Per-slice reference: split x into F slices, LayerNorm and tanh each, stack, Linear, relu.

    Same signature and result as `recfuse.ln_tanh_linear_relu`; this is the slow path a model
    author writes by hand, kept as the oracle the fused kernels are verified against.

    Example:
        >>> import torch, recfuse
        >>> x, w = torch.randn(4, 2, 8), torch.randn(3, 8)
        >>> recfuse.reference.ln_tanh_linear_relu(x, w).shape
        torch.Size([4, 2, 3])
    """
    return feature_mlp(x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps, feature_dim=feature_dim)


def batched_ln_tanh_linear_relu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ln_weight: Optional[torch.Tensor] = None,
    ln_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    feature_dim: int = 0,
) -> torch.Tensor:
    """Batched composite of the chain on the whole 3D tensor (the `combined` form).

    Five kernels instead of 2F+3: one layer_norm over all rows, per-feature affine by broadcast,
    tanh, a batched matmul (or one matmul for a shared weight), relu. Low-precision inputs are
    computed in float32 and the result cast back, matching the Triton kernels' accumulation.
    Arguments are not re-validated: callers go through `recfuse.ln_tanh_linear_relu`.

    Example:
        >>> import torch
        >>> batched_ln_tanh_linear_relu(torch.randn(4, 2, 8), torch.randn(3, 8)).shape
        torch.Size([4, 2, 3])
    """
    return batched_feature_mlp(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, DEFAULT)


def feature_mlp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    norm: Optional[str] = "layer_norm",
    ln_weight: Optional[torch.Tensor] = None,
    ln_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    activation: Optional[str] = "tanh",
    out_activation: Optional[str] = "relu",
    feature_dim: int = 0,
) -> torch.Tensor:
    """Per-slice reference of `recfuse.feature_mlp`: split, then per slice norm (with its affine),
    activation, Linear, out activation, then stack; in the input's dtype (float64 is the oracle).

    Example:
        >>> import torch, recfuse
        >>> x, w = torch.randn(4, 2, 8), torch.randn(3, 8)
        >>> recfuse.reference.feature_mlp(x, w, norm="rms_norm", activation="silu", out_activation=None).shape
        torch.Size([4, 2, 3])
    """
    s = check_op_args(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    chain = check_chain_args(norm, activation, out_activation, ln_weight, ln_bias)
    outs = []
    for f, sl in enumerate(x.unbind(feature_dim)):
        lw, lb = _feature_param(ln_weight, f, 2), _feature_param(ln_bias, f, 2)
        if chain.norm == "layer_norm":
            h = F_.layer_norm(sl, (s.D,), lw, lb, eps)
        elif chain.norm == "rms_norm":
            h = F_.rms_norm(sl, (s.D,), lw, eps)
            h = h if lb is None else h + lb
        else:
            h = sl
        h = apply_activation(h, chain.activation)
        h = F_.linear(h, _feature_param(weight, f, 3), _feature_param(bias, f, 2))
        outs.append(apply_activation(h, chain.out_activation))
    if not outs:
        return x.new_zeros(s.out_shape())
    return torch.stack(outs, dim=feature_dim)


def batched_feature_mlp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ln_weight: Optional[torch.Tensor] = None,
    ln_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    feature_dim: int = 0,
    chain: Chain = DEFAULT,
) -> torch.Tensor:
    """Batched composite of any chain on the whole 3D tensor, float32 for 16-bit inputs (the
    default chain's is `batched_ln_tanh_linear_relu`). Arguments are not re-validated.

    Example:
        >>> import torch
        >>> from recfuse.chain import Chain
        >>> batched_feature_mlp(torch.randn(4, 2, 8), torch.randn(3, 8), chain=Chain(None, "gelu", None)).shape
        torch.Size([4, 2, 3])
    """
    out_dtype = x.dtype
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype

    def up(t):
        return None if t is None else t.to(compute)

    def per_feature(t):  # [F, P] broadcasts over rows as [F, 1, P]
        return t.unsqueeze(1) if t.dim() == 2 else t

    xf = up(x)
    xf = xf if feature_dim == 0 else xf.transpose(0, 1)
    h, _ = normalized_rows(xf, chain.norm, eps)  # NaN rows where the norm's statistic overflowed
    lw, lb = up(ln_weight), up(ln_bias)
    if lw is not None:
        h = h * per_feature(lw)
    if lb is not None:
        h = h + per_feature(lb)
    h = apply_activation(h, chain.activation)
    w, b = up(weight), up(bias)
    y = torch.bmm(h, w.transpose(1, 2)) if w.dim() == 3 else torch.matmul(h, w.t())
    if b is not None:
        y = y + per_feature(b)
    y = apply_activation(y, chain.out_activation)
    y = y if feature_dim == 0 else y.transpose(0, 1)
    y = y.to(out_dtype).contiguous()
    # At B == 1 or F == 1 the transpose is contiguous already, and contiguous() returns the view:
    # the op's autograd.Function must not return a view (the caller's in-place op on it raises).
    return y.clone() if y._base is not None else y  # `_base`, not `_is_view()`: Dynamo traces it
