"""Any chain of recognised ops over F slices -> the same ops once on the batched tensor.

Shared parameters are used as they are; per-slice ones are stacked and applied per feature
(`runtime.feature_affine`, `runtime.feature_linear`). Uses of per-slice intermediates outside
the chain get views of the batched intermediates.

Example:
    >>> import torch, recfuse
    >>> def f(x):
    ...     return torch.stack([torch.sigmoid(s) for s in x.split(4, 1)], 1)
    >>> recfuse.explain(f, (torch.randn(2, 8),)).groups[0].fusion
    'horizontal_chain'
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import runtime
from ..plan import GroupPlan
from ..registry import Claim, Fusion

__all__ = ["HorizontalChain"]

# Each activation kind's function; its attrs (gelu's approximate, leaky_relu's negative_slope, ...)
# are passed as keyword arguments.
_ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid, "silu": F.silu, "gelu": F.gelu,
                "leaky_relu": F.leaky_relu, "softplus": F.softplus, "elu": F.elu}


class HorizontalChain(Fusion):
    """Claims every planned group: each op of the chain runs once on the batched tensor.

    Example:
        >>> HorizontalChain().match(None, None)
        Claim(takes=(), detail=None)
    """

    name = "horizontal_chain"
    title = "horizontal fusion"
    mode = "horizontal"

    def match(self, plan, analysis):
        return Claim()

    def fuse(self, plan: GroupPlan, claim: Claim, rw) -> str:
        layout = plan.layout
        x = rw.batched_input(layout)
        intermediates = []
        for j, op in enumerate(plan.chains[0].ops):
            specs = plan.params[j]
            if op.kind in ("layer_norm", "rms_norm"):
                x = self._norm(rw, x, op, specs, j, layout)
            elif op.kind == "linear":
                x = self._linear(rw, plan, x, specs, j, layout)
            else:
                x = rw.fn(_ACTIVATIONS[op.kind], [x], dict(op.attrs))
            intermediates.append(x)
        rw.finish(x, intermediates)
        return f"batched {plan.ops_text()} on one [F={plan.size}, ...] tensor (input: {plan.source.describe()})"

    @staticmethod
    def _norm(rw, x, op, specs, j, layout):
        """LayerNorm or RMSNorm (weight only; its eps may be None, resolved by F.rms_norm at run
        time from the dtype, as the per-slice call did)."""
        ws, bs = specs.get("weight"), specs.get("bias")
        ns = list(op.attr("shape"))
        if op.attr("computed_shape"):
            # the per-slice calls computed it from sizes; one may be the batch (t.shape[1:] of a
            # column slice of x.T): read it per call, as they did (the plan checked that it is
            # the slices' trailing dims, which are the batched tensor's)
            ns = rw.fn(runtime.trailing_shape, [x, len(ns)])
        eps = op.attr("eps")
        if all(s is None or s.shared for s in (ws, bs)):
            if op.kind == "rms_norm":
                return rw.fn(F.rms_norm, [x, ns, rw.param(ws, f"{j}_ln_weight"), eps])
            return rw.fn(F.layer_norm, [x, ns, rw.param(ws, f"{j}_ln_weight"), rw.param(bs, f"{j}_ln_bias"), eps])
        if op.kind == "rms_norm":
            x = rw.fn(F.rms_norm, [x, ns, None, eps])
        else:
            x = rw.fn(F.layer_norm, [x, ns, None, None, eps])
        per_feature = (ws is not None and not ws.shared, bs is not None and not bs.shared)
        return rw.fn(runtime.feature_affine, [x, rw.param(ws, f"{j}_ln_weight"), rw.param(bs, f"{j}_ln_bias"),
                                              layout, per_feature])

    @staticmethod
    def _linear(rw, plan, x, specs, j, layout):
        ws, bs = specs.get("weight"), specs.get("bias")
        if ws.shared and (bs is None or bs.shared):
            return rw.fn(F.linear, [x, rw.param(ws, f"{j}_weight"), rw.param(bs, f"{j}_bias")])
        bn = rw.param(bs, f"{j}_bias")
        if bs is not None and bs.shared:
            bn = rw.fn(torch.Tensor.expand, [bn, plan.size, -1])
        return rw.fn(runtime.feature_linear, [x, rw.param(ws, f"{j}_weight"), bn, layout])
