"""Call plans: which op calls a validated input takes, on which views, with which parameter rows.

A plan is built once per input signature (see `PlanCache`) and checks what the op will be given
with the op's own `check_op_args`, so that the first call of a signature raises the op's clear
message, before any view or parameter reordering could fail less clearly. A plan's `run` then
only slices, calls the op and reassembles.

A [B, sum(D)] buffer (a tensor or a KeyedTensor's values) takes one op call per dim group, on a
strided [B, n, D] view of the buffer's columns; a 3D tensor one call on itself; a dict one call per
dim group on its tensors stacked (a copy: separate tensors cannot be viewed as one).

Example:
    >>> import torch
    >>> from recfuse.module.features import FeatureLayout
    >>> layout = FeatureLayout.build(("a", "b", "c"), (4, 2, 4))
    >>> params = ((torch.randn(3, 4), None, None, None), (torch.randn(3, 2), None, None, None))
    >>> plan = BufferPlan.build(layout, ("c", "b", "a"), (4, 2, 4), torch.zeros(5, 10), params, 1e-5)
    >>> [(run.group, run.positions) for run in plan.runs]
    [(0, (0, 2)), (1, (1,))]
    >>> plan.run(torch.randn(5, 10), params, 1e-5).shape
    torch.Size([5, 9])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from .._checks import check_op_args
from ..chain import DEFAULT, Chain
from ..ops import feature_mlp, ln_tanh_linear_relu
from .features import FeatureLayout
from .parameters import PER_FEATURE_NDIM

__all__ = ["call_op", "resolve_eps", "GroupRun", "BufferPlan", "StackedPlan", "DictPlan", "PlanCache", "BoundCalls", "parameters_signature"]

GroupParams = Sequence[Optional[torch.Tensor]]  # (weight, bias, ln_weight, ln_bias) of one dim group


def resolve_eps(eps: Optional[float], x: torch.Tensor) -> float:
    """The norm's eps for input x: `eps`, or for None (an RMSNorm built with eps=None) what
    `F.rms_norm` uses then: float32's machine epsilon, float64's for float64 inputs.

    Example:
        >>> import torch
        >>> resolve_eps(None, torch.zeros(1, dtype=torch.bfloat16)) == torch.finfo(torch.float32).eps
        True
    """
    if eps is not None:
        return eps
    return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps


def prepare_params(params: GroupParams, rows: Optional[torch.Tensor], dtype: torch.dtype) -> list:
    """A dim group's parameters as the op is given them: per-feature rows reordered to the view's
    features (`rows`, None when the view holds them in stored order), each cast to `dtype`.

    Example:
        >>> import torch
        >>> w = torch.arange(4.).view(2, 1, 2)
        >>> prepare_params((w, None, None, None), torch.tensor([1, 0]), torch.float64)[0].flatten().tolist()
        [2.0, 3.0, 0.0, 1.0]
    """
    prepared = []
    for ndim, p in zip(PER_FEATURE_NDIM, params):
        if p is not None:
            if rows is not None and p.dim() == ndim:
                p = p.index_select(0, rows)
            if p.dtype != dtype:
                p = p.to(dtype)
        prepared.append(p)
    return prepared


def call_op(
    x3: torch.Tensor, params: GroupParams, rows: Optional[torch.Tensor], eps: Optional[float], feature_dim: int,
    chain: Chain = DEFAULT,
) -> torch.Tensor:
    """`recfuse.ln_tanh_linear_relu` (or `recfuse.feature_mlp` for another `chain`) on a 3D view
    with one dim group's parameters.

    Per-feature parameters are reordered to the view's features (`rows`, None when the view
    holds them in stored order) and every parameter is cast to x's dtype, as autocast would:
    gradients flow back through the cast into the parameters' own dtype.

    Example:
        >>> import torch
        >>> w = torch.randn(2, 3, 8)                       # per feature: [F, H, D]
        >>> call_op(torch.randn(5, 2, 8), (w, None, None, None), torch.tensor([1, 0]), 1e-5, 1).shape
        torch.Size([5, 2, 3])
    """
    weight, bias, ln_weight, ln_bias = prepare_params(params, rows, x3.dtype)
    if chain == DEFAULT:
        return ln_tanh_linear_relu(x3, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=eps,
                                   feature_dim=feature_dim)
    return feature_mlp(x3, weight, bias, norm=chain.norm, ln_weight=ln_weight, ln_bias=ln_bias,
                       eps=resolve_eps(eps, x3), activation=chain.activation, out_activation=chain.out_activation,
                       feature_dim=feature_dim)


def _check_call(x3: torch.Tensor, params: GroupParams, eps: Optional[float], feature_dim: int) -> None:
    """The op's own checks of one call, on the parameters as `call_op` will pass them.

    Rows are not reordered first: a permutation changes no shape, and a per-feature parameter
    of the wrong length must be named by the op's message, not fail inside index_select.
    """
    dtype = x3.dtype
    cast = [p if p is None or p.dtype == dtype else p.to(dtype) for p in params]
    check_op_args(x3, *cast, resolve_eps(eps, x3), feature_dim)


def _rows_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Dynamo cannot trace is_inference_mode_enabled; a traced plan is not kept anyway.
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        # A kept plan outlives this inference_mode block, and an inference tensor cannot be
        # saved for the backward of a later training call's index_select.
        with torch.inference_mode(False):
            return torch.tensor(rows, device=device)
    return torch.tensor(rows, device=device)


def _columns_view(offsets: tuple[int, ...], dim: int, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`view(values)`: [B, n, dim] of the features starting at `offsets` in a [B, width] buffer.

    Evenly spaced features (the only case with a single embedding dim) are a view: contiguous
    ones by unflatten, spaced ones (other dims interleaved) by unfold. Unevenly spaced features
    cannot be one strided view, so they are gathered with a copy.
    """
    n, first = len(offsets), offsets[0]
    if n == 1:
        return lambda values: values.narrow(1, first, dim).unsqueeze(1)
    step = offsets[1] - offsets[0]
    if any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return lambda values: torch.stack([values.narrow(1, o, dim) for o in offsets], dim=1)
    span = (n - 1) * step + dim
    # No narrow when the window is the whole buffer: narrow's backward zero-fills and copies a
    # gradient of the buffer's size (measured: +1 GB and 2 kernels per H100 training step).
    # view(B, n, dim), not unflatten(1, (n, dim)): the same aten view, without Tensor.unflatten's
    # Python wrapper (~2 us of a ~40 us small-shape CPU call).
    if first == 0 and span == width:
        if step == dim:
            return lambda values: values.view(values.shape[0], n, dim)
        return lambda values: values.unfold(1, dim, step)
    if step == dim:
        return lambda values: values.narrow(1, first, span).view(values.shape[0], n, dim)
    return lambda values: values.narrow(1, first, span).unfold(1, dim, step)


@dataclass(frozen=True)
class GroupRun:
    """One op call over a [B, sum(D)] buffer: the columns it reads and the parameter rows it uses.

    Example:
        >>> import torch
        >>> run = GroupRun(group=0, positions=(0, 1), view=_columns_view((0, 4), 4, 8), rows=None)
        >>> run.view(torch.zeros(3, 8)).shape
        torch.Size([3, 2, 4])
    """

    group: int
    positions: tuple[int, ...]  # position of each of its features in the input's key order
    view: Callable[[torch.Tensor], torch.Tensor]  # [B, sum(D)] -> [B, n, D]
    rows: Optional[torch.Tensor]  # rows of per-feature params for the view's features; None = stored order


@dataclass(frozen=True)
class BufferPlan:
    """The op calls over a [B, sum(D)] buffer holding features `names` of dims `dims`, in that order.

    Example:
        >>> import torch
        >>> layout = FeatureLayout.build(("a", "b"), (4, 4))
        >>> params = ((torch.randn(1, 4), None, None, None),)
        >>> BufferPlan.build(layout, layout.names, layout.dims, torch.zeros(2, 8), params, 0.0).output_is_view
        True
    """

    runs: tuple[GroupRun, ...]
    # One run reading every feature in input order: its [B, F, H] output viewed as [B, F*H] is the
    # answer, no reassembly.
    output_is_view: bool

    @classmethod
    def build(
        cls, layout: FeatureLayout, names: Sequence[str], dims: Sequence[int], values: torch.Tensor,
        params: Sequence[GroupParams], eps: float,
    ) -> "BufferPlan":
        """Plan checked names and dims over `values`, and check each op call it makes."""
        offsets = [0]
        for d in dims[:-1]:
            offsets.append(offsets[-1] + d)
        members: dict[int, list[tuple[int, int, int]]] = {}  # group -> [(position, offset, row)]
        for pos, name in enumerate(names):
            g, row = layout.slot[name]
            members.setdefault(g, []).append((pos, offsets[pos], row))
        width = sum(dims)
        runs = []
        for g in sorted(members):
            positions, offs, rows = zip(*members[g])
            view = _columns_view(offs, layout.groups[g].dim, width)
            _check_call(view(values), params[g], eps, 1)
            index = None if rows == tuple(range(len(rows))) else _rows_index(rows, values.device)
            runs.append(GroupRun(g, positions, view, index))
        output_is_view = len(runs) == 1 and runs[0].positions == tuple(range(len(names)))
        return cls(tuple(runs), output_is_view)

    def run(self, values: torch.Tensor, params: Sequence[GroupParams], eps: Optional[float],
            chain: Chain = DEFAULT) -> torch.Tensor:
        """[B, sum(D)] -> [B, F*H], features in the buffer's order."""
        ys = [call_op(r.view(values), params[r.group], r.rows, eps, 1, chain) for r in self.runs]
        if self.output_is_view:
            return ys[0].flatten(1)
        pieces: list = [None] * sum(len(r.positions) for r in self.runs)
        for run, y in zip(self.runs, ys):
            for j, pos in enumerate(run.positions):
                pieces[pos] = y[:, j]
        return torch.cat(pieces, dim=1)


@dataclass(frozen=True)
class StackedPlan:
    """One op call on a checked 3D tensor ([B, F, D] or [F, B, D]) in the module's feature order.

    Example:
        >>> import torch
        >>> params = ((torch.randn(3, 8), None, None, None),)
        >>> x = torch.randn(2, 5, 8)
        >>> StackedPlan.build(x, params, 1e-5, feature_dim=0).run(x, params, 1e-5).shape
        torch.Size([2, 5, 3])
    """

    feature_dim: int

    @classmethod
    def build(cls, x: torch.Tensor, params: Sequence[GroupParams], eps: float, feature_dim: int) -> "StackedPlan":
        _check_call(x, params[0], eps, feature_dim)
        return cls(feature_dim)

    def run(self, x: torch.Tensor, params: Sequence[GroupParams], eps: Optional[float],
            chain: Chain = DEFAULT) -> torch.Tensor:
        return call_op(x, params[0], None, eps, self.feature_dim, chain)


@dataclass(frozen=True)
class DictPlan:
    """One op call per dim group on a checked dict name -> [B, D], stacked in parameter order.

    Example:
        >>> import torch
        >>> layout = FeatureLayout.build(("a", "b"), (4, 4))
        >>> params = ((torch.randn(2, 4), None, None, None),)
        >>> x = {"b": torch.randn(3, 4), "a": torch.randn(3, 4)}
        >>> out = DictPlan.build(layout, x, params, 1e-5).run(x, params, 1e-5)
        >>> list(out), out["a"].shape
        (['b', 'a'], torch.Size([3, 2]))
    """

    layout: FeatureLayout

    @classmethod
    def build(cls, layout: FeatureLayout, x: Mapping[str, torch.Tensor], params: Sequence[GroupParams],
              eps: float) -> "DictPlan":
        for g, grp in enumerate(layout.groups):
            first = x[grp.names[0]]
            # The stacked shape without stacking: checking needs shapes, dtype and device only.
            _check_call(first.unsqueeze(1).expand(-1, len(grp.names), -1), params[g], eps, 1)
        return cls(layout)

    def run(self, x: Mapping[str, torch.Tensor], params: Sequence[GroupParams], eps: Optional[float],
            chain: Chain = DEFAULT) -> dict:
        outs = {}
        for g, grp in enumerate(self.layout.groups):
            y = call_op(torch.stack([x[n] for n in grp.names], dim=1), params[g], None, eps, 1, chain)
            outs.update({n: y[:, j] for j, n in enumerate(grp.names)})
        return {name: outs[name] for name in x}


def parameters_signature(params: Sequence[GroupParams]) -> tuple:
    """What a plan depends on in the parameters: each one's presence, shape, dtype and device.

    Identity is left out on purpose: ``module.to(dtype)`` and ``param.data = ...`` change a
    parameter without replacing the object, and a replaced one of the same shape, dtype and
    device plans the same (plans read the parameters at call time).

    Example:
        >>> import torch
        >>> parameters_signature(((torch.zeros(2, 4), None, None, None),))
        ((torch.Size([2, 4]), torch.float32, device(type='cpu')), None, None, None)
    """
    return tuple([None if p is None else (p.shape, p.dtype, p.device) for group in params for p in group])


def _evict_oldest(entries: dict, limit: int) -> None:
    """Drop `entries`' oldest until there is room for one more under `limit`.

    Threads calling one module share its caches: another thread may drop the entry this one
    picked, or change the dict between ``iter`` and ``next`` (``del entries[next(iter(entries))]``
    raised KeyError or RuntimeError out of a valid call once two threads filled the cache).
    """
    while len(entries) >= limit and entries:
        try:
            del entries[next(iter(entries))]
        except (KeyError, RuntimeError, StopIteration):
            pass  # another thread changed it first: look again


class PlanCache:
    """Plans by call signature: a call whose signature was planned (so validated) before skips both.

    At most `max_plans` are kept; the oldest is dropped first. A training loop sees one or two
    signatures (the last batch may be smaller); insertion order is enough, and a hit costs no
    reordering. Copies and pickles start empty: a plan holds index tensors on one device and
    closures, and is cheap to rebuild.

    Example:
        >>> cache = PlanCache(max_plans=2)
        >>> cache.get("sig", lambda: "plan"), cache.get("sig", lambda: "other"), cache.validations
        ('plan', 'plan', 1)
    """

    def __init__(self, max_plans: int = 32):
        self.max_plans = max_plans
        self._plans: dict = {}
        self.validations = 0  # plans built: each one validated its call

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, signature, build: Callable[[], object]):
        """The plan of `signature`, built by `build()` the first time (None: never cached)."""
        if signature is not None:
            plan = self._plans.get(signature)
            if plan is not None:
                return plan
        plan = build()
        self.validations += 1
        if signature is not None:
            _evict_oldest(self._plans, self.max_plans)
            self._plans[signature] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __getstate__(self) -> dict:
        return {"max_plans": self.max_plans, "_plans": {}, "validations": 0}

    def __deepcopy__(self, memo) -> "PlanCache":
        return PlanCache(self.max_plans)


class BoundCalls:
    """`recfuse.module.bound.BoundCall` by call key (`recfuse.module.bound.call_key`), at most
    `max_calls`, the oldest dropped first. Nothing is validated here: a bound call is made from a
    plan that `PlanCache` built (and so validated). Copies and pickles start empty, as `PlanCache`.

    Example:
        >>> calls = BoundCalls(max_calls=1)
        >>> calls.put("a", 1); calls.put("b", 2); calls.get("a"), calls.get("b"), len(calls)
        (None, 2, 1)
    """

    def __init__(self, max_calls: int = 64):
        self.max_calls = max_calls
        self._calls: dict = {}

    def __len__(self) -> int:
        return len(self._calls)

    def get(self, key):
        return self._calls.get(key)

    def put(self, key, bound) -> None:
        calls = self._calls
        _evict_oldest(calls, self.max_calls)
        calls[key] = bound

    def clear(self) -> None:
        self._calls.clear()

    def __getstate__(self) -> dict:
        return {"max_calls": self.max_calls, "_calls": {}}

    def __deepcopy__(self, memo) -> "BoundCalls":
        return BoundCalls(self.max_calls)
