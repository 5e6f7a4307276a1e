"""`recfuse::ln_tanh_linear_relu`: schema, fake impl, autograd and device dispatch.

Layering: `kernels.py` holds the `@triton.jit` code, `launch.py` turns tensors into kernel launches,
this file registers the custom op that torch.fx, torch.compile and torch.export see as one node.

Dispatch:
* CUDA tensors -> Triton kernels (`launch.py`).
* CPU tensors  -> the batched torch composite (`reference.batched_ln_tanh_linear_relu`) and the
  analytic backward `_composite_backward`, compiled by Inductor (C++) per parameter variant on the
  public function's eager path (`_cpu_compiled`; ``RECFUSE_CPU_BACKEND=eager`` or
  `set_cpu_backend` / `cpu_backend` switch to the eager composite), except
  with ``TRITON_INTERPRET=1`` in the environment, where they run the Triton kernels under Triton's
  interpreter (how CI, which has no GPU, tests the kernels).
* float64 on any device -> the composite (the kernels compute in float32; float64 is exact).
* Under torch.func transforms (grad, vmap, jacrev, ...) the eager entry point runs the composite,
  which is plain differentiable torch code; a double backward (``create_graph=True``) recomputes
  the chain with the composite and differentiates it, instead of running the backward kernel.
* Under autocast the op computes in float32 and returns the autocast dtype, as an eager
  LayerNorm -> tanh -> Linear -> relu does (its Linear runs in the autocast dtype).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch
import torch.autograd.forward_ad as _fwAD

from torch.utils._python_dispatch import _get_current_dispatch_mode

from .._checks import ValidatedSignatures, call_signature, check_op_args, stats_planes
from . import _cpu_compiled, configs
from ..chain import DEFAULT
from ..reference import batched_feature_mlp, batched_ln_tanh_linear_relu
from .composite import _empty, composite_backward

__all__ = ["ln_tanh_linear_relu", "uses_triton"]


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on `device` run the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    Example:
        >>> import torch
        >>> uses_triton(torch.device("cuda"))
        True
    """
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _TRITON_INTERPRET


# Read once, as Triton does: an environ lookup per call was ~4 us of the op's host overhead.
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# `launch` (and Triton) imported on the first kernel call, so that recfuse imports where Triton
# does not (a CPU-only laptop); kept here after that, since `from . import launch` in a hot
# path costs an import-machinery call (~1 us) every time.
_LAUNCH = None


def _import_launch():
    global _LAUNCH
    from . import launch

    if _LAUNCH is None:
        # The op's per-signature records hold plans of these caches: they drop them with them
        # (an overflow, an OutOfResources retry, a test's clear).
        for cache in (launch._FORWARD_PLANS, launch._BACKWARD_PLANS):
            cache.on_clear.append(_VALIDATED.drop_plans)
    _LAUNCH = launch
    return launch


def _kept_forward_plan(key, save_stats: bool):
    """The forward plan the launch module keeps for this signature (`chain` DEFAULT), or None:
    none built (the composite ran, float64, CPU without the interpreter), a signature whose
    parameters needed a contiguous copy (their plan is kept under the copies' signature), a
    shape that does not fit the device, or a `configs.override` block (plans not kept)."""
    if _LAUNCH is None or _override_state() is not None:
        return None
    return _LAUNCH._FORWARD_PLANS.get(key + (save_stats, DEFAULT))


# ---------------------------------------------------------------------------------------------
# forward


# The schemas of both op families, written once: the forward takes the op's arguments (and
# `feature_mlp`'s three chain strings after them), the backward grad_y first and returns the five
# gradients. ``SymInt feature_dim``: what torch infers from an ``int`` annotation.
_OP_ARGS = "Tensor x, Tensor weight, Tensor? bias, Tensor? ln_weight, Tensor? ln_bias, float eps, SymInt feature_dim"


def _op_schemas(*extra_args: str) -> tuple[str, str]:
    """(forward, backward) schema strings of an op taking `_OP_ARGS`, then `extra_args`.

    Example:
        >>> _op_schemas("str norm")[0].endswith("SymInt feature_dim, str norm) -> Tensor")
        True
    """
    args = ", ".join((_OP_ARGS,) + extra_args)
    return f"({args}) -> Tensor", f"(Tensor grad_y, {args}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"


_FWD_SCHEMA, _BWD_SCHEMA = _op_schemas()


@torch.library.custom_op("recfuse::ln_tanh_linear_relu", mutates_args=(), schema=_FWD_SCHEMA)
def _fwd_op(x, weight, bias, ln_weight, ln_bias, eps, feature_dim):
    return _forward_impl(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)


def _forward_impl(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats=False, eager_entry=False,
                  key=None, chain=DEFAULT):
    """y, or with ``save_stats`` (y, per-row mean/rstd for the backward; None on the composite).

    ``chain``: which `feature_mlp` chain (`recfuse.chain.Chain`); the default is this op's.

    ``eager_entry``: called from the public function's real-tensor eager path, where CPU tensors
    may run the Inductor-compiled composite (`_cpu_compiled`); the custom op's impl never does.
    ``key``: the call's signature, which finds its launch plan without recomputing it.
    """
    if x.dtype is not torch.float64 and uses_triton(x.device):
        launch = _LAUNCH or _import_launch()
        return launch.forward(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats=save_stats, key=key,
                              chain=chain)
    if eager_entry and x.device.type == "cpu" and chain is DEFAULT:
        # (y, saved tensors) with save_stats, else y; None: run the eager composite.
        out = _cpu_compiled.forward(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save=save_stats,
                                    key=key)
        if out is not None:
            return out
    y = batched_feature_mlp(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, chain)
    return (y, None) if save_stats else y


@_fwd_op.register_fake
def _fwd_fake(x, weight, *args, **kwargs):
    # [F, B, H] or [B, F, H]: x's first two dims either way. The other arguments (`feature_mlp`'s
    # chain too: it registers this fake as well) change no shape.
    return x.new_empty((x.shape[0], x.shape[1], weight.shape[-2]))


# ---------------------------------------------------------------------------------------------
# backward: one op returning all five gradients (empty tensors for absent parameters)


@torch.library.custom_op("recfuse::ln_tanh_linear_relu_backward", mutates_args=(), schema=_BWD_SCHEMA)
def _bwd_op(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim):
    return _backward_impl(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim)


def _backward_impl(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats=None, eager_entry=False,
                   key=None, chain=DEFAULT):
    if x.dtype is not torch.float64 and uses_triton(x.device):
        launch = _LAUNCH or _import_launch()
        return launch.backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats, key=key,
                               chain=chain)
    if eager_entry and x.device.type == "cpu" and chain is DEFAULT:
        grads = _cpu_compiled.backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, stats,
                                       key=key)
        if grads is not None:
            return grads
    return composite_backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, chain)


@_bwd_op.register_fake
def _bwd_fake(grad_y, x, weight, bias, ln_weight, ln_bias, *args, **kwargs):
    """The five gradients' empty tensors (`feature_mlp`'s backward registers this fake too)."""

    def like(t):
        return _empty(x) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)

    return (
        torch.empty_like(x),  # x's strides (preserve_format), as both real impls return
        like(weight),
        like(bias),
        like(ln_weight),
        like(ln_bias),
    )


def _setup_context(ctx, inputs, output, chain=DEFAULT):
    x, weight, bias, ln_weight, ln_bias, eps, feature_dim = inputs[:7]
    # Only the inputs: the backward recomputes every activation (and the relu mask) from x.
    ctx.save_for_backward(x, weight, bias, ln_weight, ln_bias)
    ctx.eps = eps
    ctx.feature_dim = feature_dim
    ctx.chain = chain
    ctx.config_override = configs.current_override()


def _differentiable_backward(grad_y, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, chain=DEFAULT,
                             create_graph=True):
    """The five gradients as differentiable tensors, for a double backward (``create_graph=True``).

    Recomputes the chain with the batched torch composite under autograd and differentiates it
    with ``create_graph=True``, so that a gradient penalty (a gradient of x.grad) is exact; the
    fused backward kernel's outputs have no autograd history. With ``create_graph=False``: the
    same gradients in plain torch ops, for a grad_y the kernels cannot read (`_backward`).
    """
    with torch.enable_grad():
        # A view per argument, so that one tensor passed twice gets each position's gradient.
        args = [t.view_as(t) if t is not None and t.requires_grad else t
                for t in (x, weight, bias, ln_weight, ln_bias)]
        y = batched_feature_mlp(*args, eps, feature_dim, chain)
        wanted = [i for i, t in enumerate(args) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(y, [args[i] for i in wanted], grad_y, create_graph=create_graph,
                                    allow_unused=True)
    out = [None] * 5
    for i, g in zip(wanted, grads):
        out[i] = torch.zeros_like(args[i]) if g is None else g
    return tuple(out)


def _backward(ctx, grad_y, backward_fn=_bwd_op, n_nontensor=2, stats=None):
    """Gradients of the five tensor inputs, then None for the `n_nontensor` other inputs.

    ``backward_fn`` None: `_EagerLnTanhLinearRelu`'s backward (`_eager_backward`, with `stats`)."""
    if ctx.config_override is not _override_state():
        # The forward's `configs.override` block (or none), whatever is open where the backward
        # runs: autograd's CUDA device thread sees no block, a CPU backward sees the caller's. With
        # "reopen only where none is open" a CPU backward run inside another block (or after the
        # forward's closed and another opened) took that block's config, where CUDA took the
        # forward's (red-team round 14).
        with configs.reopened(ctx.config_override):
            return _backward(ctx, grad_y, backward_fn, n_nontensor, stats)
    x, weight, bias, ln_weight, ln_bias = ctx.saved_tensors
    create_graph = _grad_enabled() and _any_requires_grad(grad_y, x, weight, bias, ln_weight, ln_bias)
    if create_graph or _is_legacy_batched(grad_y):
        # create_graph=True (grad mode is off in a plain backward): the gradients must be
        # differentiable themselves. A legacy-vmap batched grad_y (``torch.autograd.grad(...,
        # is_grads_batched=True)``: torch.autograd.functional.jacobian / hessian with
        # ``vectorize=True``) has no storage for the kernels or the compiled path (they raised
        # "Cannot access data pointer of Tensor that doesn't have storage", red-team round 21):
        # autograd of the torch composite batches over it.
        grads = _differentiable_backward(grad_y, x, weight, bias, ln_weight, ln_bias, ctx.eps, ctx.feature_dim,
                                         ctx.chain, create_graph=create_graph)
        return grads + (None,) * n_nontensor
    if backward_fn is None:
        gx, gw, gb, glw, glb = _eager_backward(ctx, stats, grad_y, x, weight, bias, ln_weight, ln_bias)
    else:
        gx, gw, gb, glw, glb = backward_fn(grad_y, x, weight, bias, ln_weight, ln_bias, ctx.eps, ctx.feature_dim)
    return (
        gx,
        gw,
        gb if bias is not None else None,
        glw if ln_weight is not None else None,
        glb if ln_bias is not None else None,
    ) + (None,) * n_nontensor


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def register_forward_ad(op, composite) -> None:
    """Make the custom op `op` (its `register_autograd` done) compute through `composite`, the
    differentiable torch composite, where an argument carries a forward-mode AD tangent
    (``torch.autograd.forward_ad.make_dual``).

    torch.library's Autograd kernel has no jvp: with no argument requiring grad (or grad mode off)
    it ran the op below autograd and returned y without a tangent, silently (a transformed model
    through torch.export / torch.jit.trace / torch.fx.symbolic_trace, whose graphs call
    ``torch.ops.recfuse...``: tangent None where the original gives the jvp, red-team round 21),
    and with one it raised "You must implement the jvp function". The public functions route
    forward AD to the composite already (`_functorch_active`); this does it for the op itself.
    """
    import warnings

    try:  # torch.library's own Autograd kernel for `op` (private API: kept as it is where it differs)
        from torch._library.autograd import make_autograd_impl

        autograd_impl = make_autograd_impl(op._opoverload, op)
    except (ImportError, AttributeError, TypeError) as err:
        logging.getLogger(__name__).debug("forward-mode AD of %s left to torch.library: %s", op, err)
        return

    def impl(keyset, *args, **kwargs):
        if _fwAD._current_level >= 0 and any(isinstance(t, torch.Tensor) and _fwAD.unpack_dual(t).tangent is not None
                                             for t in args[:5]):
            return composite(*args, **kwargs)
        return autograd_impl(keyset, *args, **kwargs)

    # The per-backend keys, not the "Autograd" alias torch.library registered its kernel for: a
    # backend's own kernel takes precedence over the alias's, and torch < 2.13 refuses a second
    # Python kernel for the same key ("already a kernel registered from python"; on torch 2.11
    # that left the tangent dropped). The kernels run only on CPU and CUDA tensors.
    for key in ("AutogradCPU", "AutogradCUDA"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                op._lib.impl(op._name, impl, key, with_keyset=True)
        except (AttributeError, TypeError, RuntimeError) as err:
            logging.getLogger(__name__).warning("forward-mode AD of %s on %s left to torch.library (tangents "
                                                "dropped): %s", op, key[len("Autograd"):], err)


register_forward_ad(_fwd_op, batched_ln_tanh_linear_relu)


class _EagerLnTanhLinearRelu(torch.autograd.Function):
    """The same forward and backward without the custom-op dispatcher, for plain eager calls.

    torch.library's Python dispatch costs ~35 us a call on an H100 host (benchmarks/results/
    tune_h100_v1.json), as much as the Triton launch itself; eager callers need no schema or fake
    impl, so they take this path. Tracing, compiling and exporting still see the custom op.
    """

    # The ctx-in-forward style on purpose: with a separate setup_context, Function.apply binds
    # default arguments through inspect.signature on every call (~10 us).
    @staticmethod
    def forward(ctx, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, key, chain=DEFAULT, record=None):
        # The kernel keeps each row's mean and rstd (8 bytes a row) so that the backward skips
        # two of its five row reductions.
        plan = record.fwd_stats if record is not None else None
        if plan is not None and _override_state() is None:
            # A signature whose plan a call has run: straight to it (what `launch.forward` finds).
            y, ctx.stats = plan(x, weight, bias, ln_weight, ln_bias)
        else:
            y, ctx.stats = _forward_impl(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, save_stats=True,
                                         eager_entry=True, key=key, chain=chain)
            if record is not None:
                record.fwd_stats = _kept_forward_plan(key, True)
        ctx.key = key  # the saved tensors' signature: the backward's plan key starts with it
        ctx.record = record
        # `_setup_context`, written out (a call less per step)
        ctx.save_for_backward(x, weight, bias, ln_weight, ln_bias)
        ctx.eps = eps
        ctx.feature_dim = feature_dim
        ctx.chain = chain
        ctx.config_override = _override_state()
        return y

    @staticmethod
    def backward(ctx, grad_y):
        stats = ctx.stats
        ctx.stats = None
        return _backward(ctx, grad_y, backward_fn=None, n_nontensor=5, stats=stats)


def _eager_backward(ctx, stats, grad_y, x, weight, bias, ln_weight, ln_bias):
    """The five gradients of `_EagerLnTanhLinearRelu` (its saved stats and signature): the
    signature's kept backward plan when a step has run it for this grad_y's signature, else
    `_backward_impl` (which finds or builds the plan), whose plan is kept for the next step."""
    if grad_y.is_neg():  # a lazily negated grad_y: the compiled path and kernels read its raw memory
        grad_y = grad_y.resolve_neg()
    record = ctx.record
    if record is None or ctx.chain is not DEFAULT or _override_state() is not None:
        return _backward_impl(grad_y, x, weight, bias, ln_weight, ln_bias, ctx.eps, ctx.feature_dim, stats,
                              eager_entry=True, key=ctx.key, chain=ctx.chain)
    seen = ((grad_y.shape, grad_y.stride(), grad_y.dtype, grad_y.device, grad_y.data_ptr() & 15),
            stats_planes(stats))
    kept = record.bwd  # (what it was kept for, plan): one attribute, so threads never pair another's
    if kept is not None and kept[0] == seen:
        plan = kept[1]
        return plan(grad_y, x, weight, bias, ln_weight, ln_bias, stats if plan.reads_stats else None)
    grads = _backward_impl(grad_y, x, weight, bias, ln_weight, ln_bias, ctx.eps, ctx.feature_dim, stats,
                           eager_entry=True, key=ctx.key, chain=DEFAULT)
    if _LAUNCH is not None:
        # The plan `launch.backward` keeps for this grad_y and signature (None: the composite).
        plan = _LAUNCH._BACKWARD_PLANS.get((seen[0],) + ctx.key + (seen[1], DEFAULT))
        record.bwd = None if plan is None else (seen, plan)
    return grads


_VALIDATED = ValidatedSignatures()

# Bound once: each is looked up on every call.
_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack  # what `_get_current_dispatch_mode` reads
# `configs.current_override()` without its Python frame (a contextvar's get).
_override_state = getattr(getattr(configs, "_OVERRIDE", None), "get", None) or configs.current_override
# One C call that is False unless some device's autocast is on (then `_autocast_enabled_for`
# asks for x's device).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_unwrap_if_dead = getattr(torch._C._functorch, "unwrap_if_dead", None)
try:
    # torch.autograd.Function.apply's own call (``super().apply``), bound to the eager Function:
    # its Python wrapper (default-argument binding checks, a generator over the arguments for
    # dead torch.func wrappers) was ~1.5 us of an autograd call.
    _EAGER_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerLnTanhLinearRelu)
except (AttributeError, KeyError, TypeError):  # a torch without it: the public apply
    _EAGER_APPLY = None
if _unwrap_if_dead is None or _EagerLnTanhLinearRelu.setup_context is not torch.autograd.Function.setup_context:
    _EAGER_APPLY = None


def _apply_eager(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, key, chain=DEFAULT, record=None):
    """`_EagerLnTanhLinearRelu.apply(...)`, for callers that have checked that no torch.func
    transform is active (`_functorch_active`): what Function.apply then does (dead torch.func
    wrappers unwrapped, the C apply; the class has no setup_context to bind arguments for),
    without its Python frame."""
    if _EAGER_APPLY is None:
        return _EagerLnTanhLinearRelu.apply(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, key, chain,
                                            record)
    return _EAGER_APPLY(_unwrap_if_dead(x), _unwrap_if_dead(weight),
                        None if bias is None else _unwrap_if_dead(bias),
                        None if ln_weight is None else _unwrap_if_dead(ln_weight),
                        None if ln_bias is None else _unwrap_if_dead(ln_bias), eps, feature_dim, key, chain, record)


def _forward_recorded(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, record):
    """An inference call (no autograd node) of a validated signature's `record` (chain DEFAULT):
    its kept forward plan when a call has run one, else `_forward_impl`, whose plan is kept."""
    plan = record.fwd
    if plan is not None and _override_state() is None:
        return plan(x, weight, bias, ln_weight, ln_bias)[0]
    y = _forward_impl(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, eager_entry=True, key=record.key)
    record.fwd = _kept_forward_plan(record.key, False)
    return y

# torch.func transforms wrap tensors in ways the kernels and the ctx-in-forward autograd.Function
# cannot take. One C call; torch versions without it (none we support) fall back to "inactive".
_functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
# A legacy-vmap BatchedTensor (torch._vmap_internals, what ``is_grads_batched=True`` runs a backward under).
_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)


def _functorch_active() -> bool:
    """A torch.func transform, or forward-mode AD (inside `torch.autograd.forward_ad.dual_level`:
    inputs may carry tangents, which the kernels and the autograd.Function, having no jvp, would
    drop or refuse), is active: the composite computes then."""
    return _functorch_transforms_active() or _fwAD._current_level >= 0


# ---------------------------------------------------------------------------------------------
# autocast: an eager LayerNorm -> tanh -> Linear -> relu returns the autocast dtype (its Linear
# is autocast); the op computes in float32 (more accurate than a 16-bit Linear) and casts y.


def _autocast_call(fn, device_type, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, *chain_args):
    """fn(...) with autocast off for `device_type`, y cast to the autocast dtype.

    Parameters of mixed dtypes (bf16 x, fp32 LayerNorm weights: fine for an eager model under
    autocast) are all computed in float32; gradients reach each in its own dtype through the
    casts. float64 inputs are left alone, as autocast leaves float64 alone.
    """
    tensors = (x, weight, bias, ln_weight, ln_bias)
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor)}
    if torch.float64 in dtypes or not all(d.is_floating_point for d in dtypes):
        with torch.autocast(device_type, enabled=False):
            return fn(*tensors, eps, feature_dim, *chain_args)
    if len(dtypes) > 1:
        tensors = tuple(t if t is None else t.to(torch.float32) for t in tensors)
    with torch.autocast(device_type, enabled=False):
        y = fn(*tensors, eps, feature_dim, *chain_args)
    return y.to(torch.get_autocast_dtype(device_type))


def _op_positional(x, weight, bias, ln_weight, ln_bias, eps, feature_dim):
    return torch.ops.recfuse.ln_tanh_linear_relu(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)


def _public_positional(x, weight, bias, ln_weight, ln_bias, eps, feature_dim):
    return ln_tanh_linear_relu(x, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps,
                               feature_dim=feature_dim)


# Direct calls of the op (a transformed GraphModule calls torch.ops.recfuse...) under autocast.
# torch.library.register_autocast only casts inputs; the output must be cast too.
_AUTOCAST_LIB = torch.library.Library("recfuse", "IMPL")
for _device_type, _key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
    _AUTOCAST_LIB.impl("ln_tanh_linear_relu", functools.partial(_autocast_call, _op_positional, _device_type), _key)


# vmap over the op itself (torch.func.vmap of a transformed graph, which calls torch.ops.recfuse...):
# the vmapped dim N is folded into the feature dim, so one call of the op on N*F features (the
# kernels on CUDA) computes all N; unbatched per-feature parameters are repeated N times.
def _vmap_rule(info, in_dims, x, weight, bias, ln_weight, ln_bias, eps, feature_dim, *chain_args,
               op=_op_positional):
    """`op`: how to call the custom op on the folded tensors (``chain_args`` passed through)."""
    n = info.batch_size
    x_dim, w_dim, b_dim, lw_dim, lb_dim = in_dims[:5]

    def features_first(t, bdim, per_feature_ndim):
        """[N*F, ...] (per feature) or the unbatched shared parameter as it is."""
        if t is None:
            return None
        if bdim is None:
            if t.dim() != per_feature_ndim:
                return t  # shared and unbatched: stays shared
            return t.unsqueeze(0).expand(n, *t.shape).reshape(-1, *t.shape[1:])
        t = t.movedim(bdim, 0)
        if t.dim() - 1 != per_feature_ndim:  # batched shared parameter: one copy per feature
            t = t.unsqueeze(1).expand(n, F, *t.shape[1:])
        return t.reshape(n * F, *t.shape[2:])

    x = x.movedim(x_dim, 0) if x_dim is not None else x.unsqueeze(0).expand(n, *x.shape)
    F = x.shape[1 + feature_dim]
    if feature_dim == 0:
        xf = x.reshape(n * F, *x.shape[2:])                           # [N*F, B, D]
    else:
        xf = x.movedim(0, 1).reshape(x.shape[1], n * F, x.shape[3])   # [B, N*F, D]
    weight = features_first(weight, w_dim, 3)
    bias = features_first(bias, b_dim, 2)
    ln_weight = features_first(ln_weight, lw_dim, 2)
    ln_bias = features_first(ln_bias, lb_dim, 2)
    y = op(xf, weight, bias, ln_weight, ln_bias, eps, feature_dim, *chain_args)
    if feature_dim == 0:
        return y.view(n, F, *y.shape[1:]), 0
    return y.view(y.shape[0], n, F, y.shape[2]), 1


torch.library.register_vmap("recfuse::ln_tanh_linear_relu", _vmap_rule)


def _autocast_enabled_for(x: torch.Tensor) -> bool:
    """Whether autocast is on for x's device. A device without autocast (meta: shape inference,
    a module built with device="meta") has it off; `torch.is_autocast_enabled` raises for it."""
    if not _any_autocast():
        return False
    if x.is_cuda:
        return torch.is_autocast_enabled("cuda")
    device_type = x.device.type
    if device_type != "cpu" and not torch._C._is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def _any_requires_grad(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


_tracing_state = torch._C._get_tracing_state


def _is_plain_eager(x) -> bool:
    """True for a real tensor outside torch.compile/export tracing, torch.jit.trace and dispatch
    modes.

    torch.jit.trace records only the torch ops it sees: a Triton launch is invisible to it (the
    trace kept an ``aten::empty`` for y, and under TRITON_INTERPRET=1 the kernel crashed on the
    tracer's values), so a traced call goes through the custom op, which the trace records as one
    ``recfuse::...`` node that runs the op (and its autograd) when the trace is called.
    """
    return (
        type(x) is _Tensor
        and not _is_compiling()
        and not _dispatch_modes()  # `_get_current_dispatch_mode() is None`, without its frame
        and _tracing_state() is None
    )


def eager_ready(x) -> bool:
    """Whether a call on x may take `call_validated`: a real tensor outside torch.compile/export
    tracing, dispatch modes, torch.func transforms, forward-mode AD and autocast for x's device,
    each of which takes a path of its own in the public entry points.

    Example:
        >>> import torch
        >>> eager_ready(torch.zeros(1)), eager_ready(torch.nn.Parameter(torch.zeros(1)))
        (True, False)
    """
    # `_is_plain_eager(x) and not _functorch_active() and not _autocast_enabled_for(x)`, written
    # out (FFP asks on every call): C calls only unless some autocast is on.
    return (type(x) is _Tensor and not _is_compiling() and not _dispatch_modes() and _tracing_state() is None
            and not _functorch_transforms_active() and _fwAD._current_level < 0
            and not (_any_autocast() and _autocast_enabled_for(x)))


def call_validated(x, weight, bias, ln_weight, ln_bias, eps: float, feature_dim: int, key, needs_grad: bool,
                   chain=DEFAULT) -> torch.Tensor:
    """What `ln_tanh_linear_relu` (and `recfuse.feature_mlp` for another `chain`) run after their
    checks, for a caller that has checked the arguments itself (`check_op_args`) and made sure
    `eager_ready(x)` holds. ``key``: the arguments' `call_signature` (eps a float, feature_dim an
    int), which finds the call's launch plan; ``needs_grad``: grad mode is on and some tensor
    argument requires grad. `recfuse.FusedFeatureProcessor` calls this for the inputs it has
    validated, so the op's per-call checks and signature are not repeated.

    Example:
        >>> import torch
        >>> from recfuse._checks import call_signature
        >>> x, w = torch.randn(2, 3, 8), torch.randn(1, 8)
        >>> key = call_signature(x, w, None, None, None, 1e-5, 1)
        >>> torch.equal(call_validated(x, w, None, None, None, 1e-5, 1, key, False),
        ...             ln_tanh_linear_relu(x, w, eps=1e-5, feature_dim=1))
        True
    """
    record = None
    if chain is DEFAULT and key is not None:
        # The caller validated these arguments: the signature's record keeps its launch plans.
        record = _VALIDATED.known.get(key) or _VALIDATED.add(key)
    if needs_grad:
        return _apply_eager(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, key, chain, record)
    if record is not None:
        return _forward_recorded(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, record)
    return _forward_impl(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, eager_entry=True, key=key,
                         chain=chain)


def _eager_call(record, x, weight, bias, ln_weight, ln_bias, eps, feature_dim):
    """A validated plain eager call: without an autograd record where nothing needs one (inference:
    Function.apply alone is ~15 us a call), through the signature's `record` (its kept plans)."""
    eps, feature_dim = float(eps), int(feature_dim)
    if not (_grad_enabled() and (x.requires_grad or weight.requires_grad
                                 or (bias is not None and bias.requires_grad)
                                 or (ln_weight is not None and ln_weight.requires_grad)
                                 or (ln_bias is not None and ln_bias.requires_grad))):
        if record is None:
            return _forward_impl(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, eager_entry=True)
        return _forward_recorded(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, record)
    return _apply_eager(x, weight, bias, ln_weight, ln_bias, eps, feature_dim,
                        None if record is None else record.key, DEFAULT, record)


def call_recorded(x, weight, bias, ln_weight, ln_bias, eps: float, feature_dim: int, record, needs_grad: bool):
    """`call_validated` for the default chain with the signature's record in hand
    (`ValidatedSignatures.add` of the `call_signature` the caller validated): a caller that keeps
    the record (`recfuse.module.bound`) skips the record's lookup by key on every call.
    """
    if needs_grad:
        return _apply_eager(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, record.key, DEFAULT, record)
    plan = record.fwd
    if plan is not None and _override_state() is None:
        return plan(x, weight, bias, ln_weight, ln_bias)[0]
    return _forward_recorded(x, weight, bias, ln_weight, ln_bias, eps, feature_dim, record)


def signature_record(key):
    """The op's `SignatureRecord` of a validated signature `key` (made if new), for `call_recorded`."""
    return _VALIDATED.add(key)


# ---------------------------------------------------------------------------------------------
# public entry point


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
    """relu(Linear(tanh(LayerNorm(x_f)))) for every feature slice f of a 3D tensor, in one op.

    Args:
        x: [F, B, D] (``feature_dim=0``) or [B, F, D] (``feature_dim=1``), float32/bfloat16/float16
            (float64 runs the exact torch composite on every device).
            Any strides: a torchrec KeyedTensor's [B, F*D] values viewed as [B, F, D] is read
            in place, without a copy.
        weight: [H, D] shared by all features, or [F, H, D] one per feature.
        bias: None, [H] or [F, H].
        ln_weight, ln_bias: LayerNorm affine, None (``elementwise_affine=False``), [D] or [F, D].
        eps: LayerNorm epsilon, any value >= 0 (0.0 gives NaN on constant rows, as PyTorch does).
        feature_dim: which dim of x indexes features.

    Returns:
        [F, B, H] or [B, F, H] (the layout of x with D replaced by H), in x's dtype, or under
        autocast for x's device the autocast dtype (computed in float32, then cast), as the eager
        chain with an autocast Linear gives. Accumulation is float32 for every dtype.
        Differentiable in every tensor argument, twice (``create_graph=True``) and under
        ``torch.func`` transforms (both through the torch composite).

    Example:
        >>> import torch, recfuse
        >>> emb = torch.randn(32, 16 * 64)                        # [B, F*D] pooled embeddings
        >>> w = torch.randn(1, 64, requires_grad=True)
        >>> y = recfuse.ln_tanh_linear_relu(emb.view(32, 16, 64), w, feature_dim=1)
        >>> y.shape
        torch.Size([32, 16, 1])
        >>> y.sum().backward()
    """
    if (type(x) is _Tensor and not _any_autocast() and not _is_compiling() and not _dispatch_modes()
            and _tracing_state() is None and not _functorch_transforms_active() and _fwAD._current_level < 0):
        # The plain eager call (what the branches below test, written out: no Proxy, autocast off,
        # `_is_plain_eager`, no torch.func transform or forward-mode AD). Validated once per call
        # signature (`_VALIDATED.record`: the first call of a signature runs the checks, with
        # their messages); the signature's record then holds the launch plans its calls took.
        try:
            record = _VALIDATED.known.get(call_signature(x, weight, bias, ln_weight, ln_bias, eps, feature_dim))
        except (AttributeError, TypeError, RuntimeError):  # not tensors: `record` runs the checks
            record = None
        if record is None:
            record = _VALIDATED.record(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
        return _eager_call(record, x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    if isinstance(x, torch.fx.Proxy):
        if getattr(x.tracer, "record_public_ops", False):
            # torch.load re-tracing a transformed module's code: the node stays a call of this
            # function, as `transform` made it; as a torch.ops node the loaded model lost this
            # function's torch.func / forward-AD path (torch.func.grad raised "autograd.Function
            # ... must override the setup_context staticmethod") and its lean eager dispatch.
            return x.tracer.create_proxy("call_function", ln_tanh_linear_relu, (x, weight, bias),
                                         dict(ln_weight=ln_weight, ln_bias=ln_bias, eps=eps, feature_dim=feature_dim))
        # symbolic_trace: record one custom-op node; its fake impl sees the shapes later.
        return torch.ops.recfuse.ln_tanh_linear_relu(
            x, weight, bias, ln_weight, ln_bias, float(eps), int(feature_dim)
        )
    if isinstance(x, torch.Tensor) and _autocast_enabled_for(x):
        return _autocast_call(_public_positional, "cuda" if x.is_cuda else x.device.type,
                              x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    if _is_plain_eager(x) and not _functorch_active():
        # Validated once per call signature (`_VALIDATED.record`: the first call of a signature
        # runs the checks, with their messages); the signature's record then holds the launch
        # plans its calls took.
        record = _VALIDATED.record(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
        return _eager_call(record, x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    check_op_args(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
    if _is_plain_eager(x) or _functorch_active():
        # torch.func.grad / vmap / jacrev: the differentiable, batchable torch composite (also when
        # torch.compile traces them: its fake run of the custom op under a functorch transform
        # raised "autograd.Function ... must override the setup_context staticmethod").
        return batched_ln_tanh_linear_relu(x, weight, bias, ln_weight, ln_bias, float(eps), int(feature_dim))
    return torch.ops.recfuse.ln_tanh_linear_relu(
        x, weight, bias, ln_weight, ln_bias, float(eps), int(feature_dim)
    )
