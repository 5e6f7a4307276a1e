"""`recfuse::feature_mlp`: the op family norm -> activation -> Linear -> out activation per feature.

The same machinery as `ln_tanh_linear_relu` (layouts, dtypes, shared or per-feature parameters,
fp32 accumulation, deterministic fused backward, fake impl, autocast, vmap, double backward); the
chain (`recfuse.chain.Chain`) travels as three string arguments of the custom op and becomes three
constexprs of the one kernel family in `kernels.py`. The default chain (LayerNorm -> tanh -> relu)
is `recfuse.ln_tanh_linear_relu` itself: `feature_mlp` calls it, so a graph, a compiled model or
an exported program of the default chain holds the same `recfuse::ln_tanh_linear_relu` node.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .._checks import ValidatedSignatures, check_chain_args, check_op_args
from ..chain import DEFAULT, from_schema, to_schema
from ..reference import batched_feature_mlp
from .ln_tanh_linear_relu import (
    _EagerLnTanhLinearRelu, _any_requires_grad, _autocast_call, _autocast_enabled_for, _backward, _backward_impl,
    _bwd_fake, _forward_impl, _functorch_active, _fwd_fake, _is_plain_eager, _op_schemas, _setup_context, _vmap_rule,
    ln_tanh_linear_relu, register_forward_ad,
)

__all__ = ["feature_mlp"]


_FWD_SCHEMA, _BWD_SCHEMA = _op_schemas("str norm", "str activation", "str out_activation")


@torch.library.custom_op("recfuse::feature_mlp", mutates_args=(), schema=_FWD_SCHEMA)
def _fwd_op(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, norm, activation, out_activation):
    return _forward_impl(x, weight, bias, ln_weight, ln_bias, eps, feature_dim,
                         chain=from_schema(norm, activation, out_activation))


_fwd_op.register_fake(_fwd_fake)


@torch.library.custom_op("recfuse::feature_mlp_backward", mutates_args=(), schema=_BWD_SCHEMA)
def _bwd_op(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, norm, activation, out_activation):
    return _backward_impl(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim,
                          chain=from_schema(norm, activation, out_activation))


_bwd_op.register_fake(_bwd_fake)


def _setup_chain_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output, from_schema(*inputs[7:10]))


def _chain_backward(ctx, grad_y):
    names = to_schema(ctx.chain)
    return _backward(ctx, grad_y, backward_fn=lambda *args: _bwd_op(*args, *names), n_nontensor=5)


_fwd_op.register_autograd(_chain_backward, setup_context=_setup_chain_context)
register_forward_ad(_fwd_op, lambda *args: batched_feature_mlp(*args[:7], from_schema(*args[7:10])))


def _op_positional(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, norm, activation, out_activation):
    return torch.ops.recfuse.feature_mlp(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, norm, activation,
                                         out_activation)


def _public_positional(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, norm, activation, out_activation):
    return feature_mlp(x, weight, bias, norm=norm, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps,
                       activation=activation, out_activation=out_activation, feature_dim=feature_dim)


_AUTOCAST_LIB = torch.library.Library("recfuse", "IMPL")
for _device_type, _key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
    _AUTOCAST_LIB.impl("feature_mlp", functools.partial(_autocast_call, _op_positional, _device_type), _key)

torch.library.register_vmap("recfuse::feature_mlp", functools.partial(_vmap_rule, op=_op_positional))

_VALIDATED = ValidatedSignatures()


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
    """out_activation(Linear(activation(norm(x_f)))) for every feature slice f, in one op.

    Args:
        x: [F, B, D] (``feature_dim=0``) or [B, F, D] (``feature_dim=1``), float32/bfloat16/float16
            (float64 runs the exact torch composite), any strides (a [B, F*D] buffer viewed as
            [B, F, D] is read in place).
        weight: [H, D] shared by all features, or [F, H, D] one per feature.
        bias: None, [H] or [F, H].
        norm: ``"layer_norm"``, ``"rms_norm"`` (x * rsqrt(mean(x^2) + eps), as
            ``torch.nn.RMSNorm``) or None.
        ln_weight, ln_bias: the norm's affine, None, [D] or [F, D]; must be None without a norm.
        eps: the norm's epsilon (>= 0).
        activation, out_activation: after the norm and after the Linear: ``"tanh"``,
            ``"sigmoid"``, ``"relu"``, ``"gelu"`` (erf), ``"gelu_tanh"`` (tanh approximation),
            ``"silu"`` or None.
        feature_dim: which dim of x indexes features.

    Returns:
        x's layout with D replaced by H, in x's dtype (the autocast dtype under autocast);
        float32 accumulation for every dtype; differentiable in every tensor argument, with a
        fused deterministic backward. The default chain is exactly `recfuse.ln_tanh_linear_relu`.

    Example:
        >>> import torch, recfuse
        >>> x = torch.randn(32, 16, 64)                        # [B, F, D]
        >>> w = torch.randn(16, 8, 64, requires_grad=True)     # a Linear(64, 8) per feature
        >>> y = recfuse.feature_mlp(x, w, norm="rms_norm", activation="silu", out_activation=None,
        ...                         feature_dim=1)
        >>> ref = recfuse.reference.feature_mlp(x, w, norm="rms_norm", activation="silu",
        ...                                     out_activation=None, feature_dim=1)
        >>> y.shape, torch.allclose(y, ref, atol=1e-4)
        (torch.Size([32, 16, 8]), True)
        >>> y.sum().backward()
    """
    chain = check_chain_args(norm, activation, out_activation, ln_weight, ln_bias)
    if chain == DEFAULT:
        return ln_tanh_linear_relu(x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps,
                                   feature_dim=feature_dim)
    names = to_schema(chain)
    if isinstance(x, torch.fx.Proxy) and getattr(x.tracer, "record_public_ops", False):
        # torch.load re-tracing a transformed module's code: keep the call of this function (see
        # ln_tanh_linear_relu: its torch.func path)
        return x.tracer.create_proxy("call_function", feature_mlp, (x, weight, bias), dict(
            norm=norm, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps, activation=activation,
            out_activation=out_activation, feature_dim=feature_dim))
    if isinstance(x, torch.fx.Proxy):
        # eps may be a node too: an RMSNorm's eps=None is the dtype's epsilon, read at run time
        eps = eps if isinstance(eps, torch.fx.Proxy) else float(eps)
        return torch.ops.recfuse.feature_mlp(x, weight, bias, ln_weight, ln_bias, eps, int(feature_dim), *names)
    if isinstance(x, torch.Tensor) and _autocast_enabled_for(x):
        return _autocast_call(_public_positional, "cuda" if x.is_cuda else x.device.type,
                              x, weight, bias, ln_weight, ln_bias, eps, feature_dim, *chain)
    if _is_plain_eager(x) and not _functorch_active():
        key = _VALIDATED.check(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
        eps, feature_dim = float(eps), int(feature_dim)
        if not (torch.is_grad_enabled() and _any_requires_grad(x, weight, bias, ln_weight, ln_bias)):
            return _forward_impl(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, eager_entry=True, key=key,
                                 chain=chain)
        return _EagerLnTanhLinearRelu.apply(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, key, chain, None)
    check_op_args(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    if _is_plain_eager(x) or _functorch_active():  # torch.func transforms, eager or compiled
        return batched_feature_mlp(x, weight, bias, ln_weight, ln_bias, float(eps), int(feature_dim), chain)
    return torch.ops.recfuse.feature_mlp(x, weight, bias, ln_weight, ln_bias, float(eps), int(feature_dim), *names)
