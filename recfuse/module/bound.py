"""Bound calls: a tensor input's validated plan with everything about its op calls worked out, so
that a call of a known signature only reads the parameters, keys the call and runs the op.

`FusedFeatureProcessor.forward` keys a tensor input's call (a KeyedTensor's by its values, with
its keys and lengths in feature_dim's place) by `call_key` (the input's shape,
strides, dtype, device, data-pointer alignment and requires_grad, ``feature_dim``, the grad mode,
train/eval, eps and chain, and each parameter's presence, shape, strides, dtype, device, alignment
and requires_grad). The first call of a key goes through the module's planning (`PlanCache`, which
validates it with the clear messages of the checks) and binds the plan (`bind`); later calls of
that key run the `BoundCall`, which calls the op's validated entry (`call_validated`) with each op
call's launch key worked out at bind time: the op's own per-call checks and signature are not
repeated. Anything that changes what was checked or keyed (a new batch size, layout, stride,
dtype, a parameter replaced by one of another shape or dtype, requires_grad flipped, the grad
mode, .train()/.eval(), eps) gives another key, and so another validated first call.

Example:
    >>> import torch
    >>> from recfuse.module.processor import FusedFeatureProcessor
    >>> fp = FusedFeatureProcessor(["a", "b"], 4, out_features=2)
    >>> x = torch.randn(3, 8)
    >>> y = fp(x); y2 = fp(x.clone())                     # the second call runs the bound call
    >>> len(fp._bound), fp._plans.validations
    (1, 1)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._checks import call_signature, check_not_negated
from ..chain import DEFAULT, Chain
from ..ops.ln_tanh_linear_relu import _override_state, call_recorded, call_validated, signature_record
from .parameters import PER_FEATURE_NDIM
from .plan import BufferPlan, GroupParams, StackedPlan, prepare_params, resolve_eps

__all__ = ["call_key", "bind", "BoundCall"]


def call_key(x: torch.Tensor, feature_dim, flat_params: Sequence[Optional[torch.Tensor]], grad_enabled: bool,
             training: bool, eps, chain: Chain) -> tuple:
    """The key of a tensor input's call: everything its validation, its plan and its op calls'
    launch keys depend on (see the module docstring). Raises (AttributeError, TypeError,
    RuntimeError) for what is not a plain tensor (a data pointer it cannot give)."""
    key = [x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, x.requires_grad, x.is_neg(), feature_dim,
           type(feature_dim), grad_enabled, training, eps, chain]
    for p in flat_params:  # one tuple per parameter, inline: this runs on every call
        key.append(None if p is None else (p.shape, p.stride(), p.dtype, p.device, p.data_ptr() & 15,
                                           p.requires_grad, p.is_neg()))
    return tuple(key)


class _Run:
    """One op call of a bound call: the view of the input it reads, its parameter group, and its
    launch key (`call_signature` of its arguments), computed once.

    A run whose parameters are made per call (rows reordered, cast to the input's dtype) gets
    new tensors each time: their shapes and strides are those seen at bind time, but the key
    also holds each one's data-pointer alignment, which is compared per call (`fresh`), and the
    key recomputed where it differs."""

    __slots__ = ("view", "group", "rows", "dtype", "key", "fresh", "eps", "feature_dim")

    def __init__(self, view, group: int, rows, x3: torch.Tensor, params: GroupParams, eps: float,
                 feature_dim: int):
        self.view, self.group, self.rows, self.eps, self.feature_dim = view, group, rows, eps, feature_dim
        dtype = x3.dtype
        self.dtype = dtype if any(p is not None and (p.dtype != dtype or (rows is not None and p.dim() == n))
                                  for n, p in zip(PER_FEATURE_NDIM, params)) else None
        prepared = prepare_params(params, rows, dtype) if self.dtype is not None else list(params)
        # The plan that validated this call was cached without the negative bit (`call_key` has
        # it, so a neg-bit input or parameter binds anew and is refused here, as the op does).
        for name, t in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), (x3, *prepared)):
            if t is not None:
                check_not_negated(name, t)
        self.key = call_signature(x3, *prepared, eps, feature_dim)
        # (position among the five tensors, alignment at bind time) of each tensor made per call
        self.fresh = tuple((i + 1, self.key[i + 1][4]) for i, (p, q) in enumerate(zip(params, prepared))
                           if q is not None and q is not p)

    def __call__(self, values: torch.Tensor, params: GroupParams, needs_grad: bool, chain: Chain):
        x3 = values if self.view is None else self.view(values)
        if self.dtype is None:
            weight, bias, ln_weight, ln_bias = params
            key = self.key
        else:
            prepared = prepare_params(params, self.rows, self.dtype)
            weight, bias, ln_weight, ln_bias = prepared
            key = self.key
            args = (x3, *prepared)
            if any(args[i].data_ptr() & 15 != align for i, align in self.fresh):
                key = call_signature(*args, self.eps, self.feature_dim)
        return call_validated(x3, weight, bias, ln_weight, ln_bias, self.eps, self.feature_dim, key, needs_grad,
                              chain)


class BoundCall:
    """A tensor input's call of one `call_key`: its op calls and how their outputs answer.

    Called as ``bound(x, params)`` with the module's parameters of this call (per dim group,
    read from the module at call time); returns what `FusedFeatureProcessor.forward` returns.
    """

    __slots__ = ("runs", "positions", "output", "needs_grad", "chain", "single", "out_lengths", "record", "flat_y")

    def __init__(self, plan, values: torch.Tensor, params: Sequence[GroupParams], eps: Optional[float],
                 chain: Chain, needs_grad: bool):
        # The op's default chain is the object `DEFAULT` (its compiled CPU path tests identity).
        self.chain = DEFAULT if chain == DEFAULT else chain
        self.needs_grad = needs_grad
        self.out_lengths = None  # a KeyedTensor's call: each key's output width (the module sets it)
        if isinstance(plan, StackedPlan):
            runs = [(None, 0, None, plan.feature_dim)]
            self.output, self.positions = "as_is", ()
        elif isinstance(plan, BufferPlan):
            runs = [(r.view, r.group, r.rows, 1) for r in plan.runs]
            self.output = "flatten" if plan.output_is_view else "cat"
            self.positions = tuple(r.positions for r in plan.runs)
        else:
            raise TypeError(f"cannot bind a {type(plan).__name__}")
        bound = []
        for view, group, rows, fd in runs:
            x3 = values if view is None else view(values)
            run_eps = eps if self.chain is DEFAULT else resolve_eps(eps, x3)
            bound.append(_Run(view, group, rows, x3, params[group], run_eps, fd))
        self.runs = tuple(bound)
        # One op call on parameters used as they are: what `call_flat` runs without the general
        # path's loops (a single dim group; its parameters need no reordering or cast).
        run = self.runs[0]
        self.single = run if len(self.runs) == 1 and run.dtype is None and self.output != "cat" else None
        # The op's record of the single run's signature (default chain): its launch plans, found
        # without a lookup by key per call.
        self.record = signature_record(run.key) if self.single is not None and self.chain is DEFAULT else None
        # An inference call of a [B, F*D] buffer whose features are one view of it from its first
        # element: the kept forward plan takes the buffer and writes y as [B, F*H] (`ForwardPlan`'s
        # y_shape), without the view and the flatten (two ATen calls, ~1 us each). Fixed per key:
        # the view's offset, the dtype and y's shape follow from the shapes and strides keyed.
        self.flat_y = None
        if self.record is not None and not needs_grad and self.output == "flatten" and run.view is not None:
            x3 = run.view(values)
            if x3.data_ptr() == values.data_ptr():
                self.flat_y = (x3.shape[0], x3.shape[1] * params[run.group][0].shape[-2])

    def call_flat(self, values: torch.Tensor, flat: Sequence[Optional[torch.Tensor]]):
        """The call, with the module's parameters as one flat list (each group's four in turn)."""
        run = self.single
        if run is None:
            return self(values, tuple(tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)))
        weight, bias, ln_weight, ln_bias = flat
        if self.flat_y is not None:
            plan = self.record.fwd
            if plan is not None and _override_state() is None:
                return plan(values, weight, bias, ln_weight, ln_bias, self.flat_y)[0]
        x3 = values if run.view is None else run.view(values)
        if self.record is not None:
            y = call_recorded(x3, weight, bias, ln_weight, ln_bias, run.eps, run.feature_dim, self.record,
                              self.needs_grad)
        else:
            y = call_validated(x3, weight, bias, ln_weight, ln_bias, run.eps, run.feature_dim, run.key,
                               self.needs_grad, self.chain)
        return y.flatten(1) if self.output == "flatten" else y

    def __call__(self, values: torch.Tensor, params: Sequence[GroupParams]):
        needs_grad, chain = self.needs_grad, self.chain
        if len(self.runs) == 1:
            run = self.runs[0]
            y = run(values, params[run.group], needs_grad, chain)
            if self.output == "flatten":
                return y.flatten(1)
            if self.output == "as_is":
                return y
            ys = (y,)
        else:
            ys = [run(values, params[run.group], needs_grad, chain) for run in self.runs]
        pieces: list = [None] * sum(len(p) for p in self.positions)
        for positions, y in zip(self.positions, ys):
            for j, pos in enumerate(positions):
                pieces[pos] = y[:, j]
        return torch.cat(pieces, dim=1)


def bind(plan, values: torch.Tensor, params: Sequence[GroupParams], eps: Optional[float], chain: Chain,
         needs_grad: bool) -> BoundCall:
    """The `BoundCall` of a validated tensor input's plan (`BufferPlan` or `StackedPlan`)."""
    return BoundCall(plan, values, params, eps, chain, needs_grad)
