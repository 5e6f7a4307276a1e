"""`FusedFeatureProcessor`: the drop-in module for per-feature LayerNorm -> tanh -> Linear -> relu.

A recommender model usually writes this as a loop over features (one LayerNorm per feature, a
shared Linear); the module owns the same parameters stacked as [F, ...] tensors and runs every
feature of one embedding dim in a single `recfuse.ln_tanh_linear_relu` call on a strided view of
the pooled embeddings, so a torchrec KeyedTensor's [B, F*D] buffer is never copied.

Layering: input parsing and validation (by feature NAME) -> a cached `_BufferPlan` saying which
columns of the buffer each op call reads -> one op call per distinct embedding dim -> the output
reassembled in the input's kind and feature order.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from . import reference
from .cuda_graph import CudaGraphCache, ModuleTensors
from .ops import ln_tanh_linear_relu
from .torchrec import is_keyed_tensor, keyed_tensor_parts, make_keyed_tensor, wait_if_lazy_awaitable

__all__ = ["FusedFeatureProcessor"]

logger = logging.getLogger("recfuse")

_PARAM_KINDS = ("weight", "bias", "ln_weight", "ln_bias")
# Number of dims of each parameter kind when it is stored per feature ([n, ...]).
_PER_FEATURE_NDIM = {"weight": 3, "bias": 2, "ln_weight": 2, "ln_bias": 2}


@dataclass(frozen=True)
class _DimGroup:
    """The features sharing one embedding dim: they share one op call and one set of parameters."""

    dim: int
    names: tuple[str, ...]  # in the module's configured order = row order of the stacked params
    suffix: str  # "" when the module has a single dim, else "_d{dim}" (parameter name suffix)


@dataclass(frozen=True)
class _GroupRun:
    """One op call over a [B, sum(D)] buffer: the columns it reads and the parameter rows it uses."""

    group: int
    dim: int
    offsets: tuple[int, ...]  # column offset of each feature in the buffer, increasing
    positions: tuple[int, ...]  # position of each feature in the input's key order
    param_index: Optional[tuple[int, ...]]  # rows of per-feature params; None = in stored order


@dataclass(frozen=True)
class _BufferPlan:
    runs: tuple[_GroupRun, ...]
    # One run reading every feature in input order: its [B, F, H] output viewed as [B, F*H] is
    # the answer, no reassembly.
    output_is_view: bool
    width: int  # sum(D): the buffer's expected second dim


def _strided_group_view(values: torch.Tensor, offsets: Sequence[int], dim: int) -> torch.Tensor:
    """[B, n, dim] view of the features starting at `offsets` in a [B, sum(D)] buffer.

    Evenly spaced features (the only case with a single embedding dim) are a view: contiguous
    ones by unflatten, spaced ones (other dims interleaved) by unfold. Unevenly spaced features
    cannot be one strided view, so they are gathered with a copy.
    """
    n = len(offsets)
    if n == 1:
        return values.narrow(1, offsets[0], dim).unsqueeze(1)
    step = offsets[1] - offsets[0]
    if all(b - a == step for a, b in zip(offsets, offsets[1:])):
        width = (n - 1) * step + dim
        # No narrow when the window is the whole buffer: narrow's backward zero-fills and copies
        # a gradient of the buffer's size (measured: +1 GB and 2 kernels per H100 training step).
        window = values if offsets[0] == 0 and width == values.shape[1] else values.narrow(1, offsets[0], width)
        return window.unflatten(1, (n, dim)) if step == dim else window.unfold(1, dim, step)
    return torch.stack([values.narrow(1, o, dim) for o in offsets], dim=1)


def _as_dtype(p: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return p if p is None or p.dtype == dtype else p.to(dtype)


class FusedFeatureProcessor(nn.Module):
    """relu(Linear(tanh(LayerNorm_f(x_f)))) for every feature f, fused; looked up by feature name.

    Replaces the per-feature loop::

        out = [relu(linear(tanh(layer_norm[name](emb[name])))) for name in feature_names]

    Args:
        feature_names: unique names of the F features. They fix the feature order of a
            [B, F*D] / [B, F, D] / [F, B, D] tensor input; KeyedTensor and dict inputs are matched
            by name, in any order.
        embedding_dims: one int for all features, or one int per feature (mixed dims).
        out_features: H, the Linear's output size per feature.
        shared_linear: one Linear shared by all features (True) or one per feature (False).
        shared_layer_norm: one LayerNorm affine shared by all features (True) or one per feature.
        ln_affine: LayerNorm has a learnable weight and bias (``elementwise_affine``).
        bias: the Linear has a bias.
        eps: LayerNorm epsilon (>= 0).
        cuda_graph: opt-in, for inference on fixed shapes: a CUDA tensor input ([B, sum(D)] or
            3D) run without autograd (``torch.no_grad()``/``inference_mode()``, or nothing
            requiring grad) replays a captured CUDA graph, cutting per-call launch overhead.
            Graphs are per input shape/strides/dtype/feature_dim and parameter addresses; x is
            read in place while its address repeats (copied in once it moves), and a result you
            still hold is never overwritten: the rule is in `recfuse.cuda_graph`. KeyedTensor and
            dict inputs, CPU tensors, training, ``torch.compile``, autocast and vmap take the
            normal path.
        device, dtype: of the parameters.

    Parameters are owned directly, stacked over features: ``weight`` [H, D] or [F, H, D],
    ``bias`` [H] or [F, H], ``ln_weight``/``ln_bias`` [D] or [F, D]. With mixed embedding dims
    the features are grouped by dim and each group has its own parameters, named with a
    ``_d{dim}`` suffix (``weight_d16``, ...); "shared" then means shared within a dim group,
    since one Linear cannot take inputs of two sizes.

    Kernel launches: one ``recfuse.ln_tanh_linear_relu`` call per distinct embedding dim (not yet
    one jagged launch for mixed dims), plus for mixed dims one ``cat`` to put the outputs back in
    input order, and a gather copy for a dim group whose features are not evenly spaced in the
    input buffer. A single-dim [B, F*D] buffer or KeyedTensor is read in place, never copied;
    a dict input is stacked (one copy per dim group), as its tensors are separate.

    Dtypes: the op computes in the input's dtype (accumulating in float32). Parameters of another
    dtype (e.g. float32 master weights with bfloat16 embeddings) are cast to the input's dtype on
    each call, as autocast would; gradients flow back through the cast into the parameters' own
    dtype. The output has the input's dtype.

    Example:
        >>> import torch, recfuse
        >>> fp = recfuse.FusedFeatureProcessor(["user", "item", "ctx"], 8, out_features=2)
        >>> emb = torch.randn(4, 3 * 8)                     # [B, F*D], e.g. KeyedTensor.values()
        >>> fp(emb).shape                                   # [B, F*H]
        torch.Size([4, 6])
        >>> out = fp({"item": torch.randn(4, 8), "user": torch.randn(4, 8), "ctx": torch.randn(4, 8)})
        >>> sorted(out), out["user"].shape
        (['ctx', 'item', 'user'], torch.Size([4, 2]))
    """

    def __init__(
        self,
        feature_names: Sequence[str],
        embedding_dims: Union[int, Sequence[int]],
        out_features: int = 1,
        *,
        shared_linear: bool = True,
        shared_layer_norm: bool = False,
        ln_affine: bool = True,
        bias: bool = True,
        eps: float = 1e-5,
        cuda_graph: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        names, dims = _check_config(feature_names, embedding_dims, out_features, eps)
        self.feature_names: tuple[str, ...] = names
        self.embedding_dims: tuple[int, ...] = dims
        self.out_features = int(out_features)
        self.shared_linear = bool(shared_linear)
        self.shared_layer_norm = bool(shared_layer_norm)
        self.ln_affine = bool(ln_affine)
        self.has_bias = bool(bias)
        self.eps = float(eps)
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool, got {cuda_graph!r}")
        self.cuda_graph = cuda_graph
        self._cuda_graphs = CudaGraphCache()
        self._module_tensors = ModuleTensors(self)

        distinct_dims = list(dict.fromkeys(dims))  # first-appearance order
        self._groups: tuple[_DimGroup, ...] = tuple(
            _DimGroup(
                dim=d,
                names=tuple(n for n, nd in zip(names, dims) if nd == d),
                suffix="" if len(distinct_dims) == 1 else f"_d{d}",
            )
            for d in distinct_dims
        )
        # name -> (group index, row within the group's stacked parameters)
        self._slot: dict[str, tuple[int, int]] = {
            n: (g, j) for g, grp in enumerate(self._groups) for j, n in enumerate(grp.names)
        }
        self._dim_of: dict[str, int] = dict(zip(names, dims))
        self._total_dim = sum(dims)  # a [B, sum(D)] buffer's second dim
        self._plans: dict[tuple[tuple[str, ...], tuple[int, ...]], _BufferPlan] = {}

        factory = {"device": device, "dtype": dtype}
        H = self.out_features
        for grp in self._groups:
            n, D = len(grp.names), grp.dim
            shapes = {
                "weight": (H, D) if self.shared_linear else (n, H, D),
                "bias": ((H,) if self.shared_linear else (n, H)) if self.has_bias else None,
                "ln_weight": ((D,) if self.shared_layer_norm else (n, D)) if self.ln_affine else None,
                "ln_bias": ((D,) if self.shared_layer_norm else (n, D)) if self.ln_affine else None,
            }
            for kind, shape in shapes.items():
                param = None if shape is None else nn.Parameter(torch.empty(shape, **factory))
                self.register_parameter(kind + grp.suffix, param)
        self.reset_parameters()
        logger.debug(
            "FusedFeatureProcessor: %d features, dim groups %s, H=%d",
            len(names), {g.dim: len(g.names) for g in self._groups}, H,
        )

    # -----------------------------------------------------------------------------------------
    # parameters

    def reset_parameters(self) -> None:
        """Initialise every parameter as nn.LayerNorm and nn.Linear do, per feature.

        LayerNorm weight 1, bias 0; Linear weight and bias uniform in +-1/sqrt(D) (what
        ``kaiming_uniform_(a=sqrt(5))`` gives for fan_in D). torchrec's DistributedModelParallel
        calls this to materialise a module built on the meta device.

        Example:
            >>> fp = FusedFeatureProcessor(["a", "b"], 4, device="meta")
            >>> fp = fp.to_empty(device="cpu"); fp.reset_parameters()
            >>> fp.ln_weight.tolist()
            [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
        """
        with torch.no_grad():
            for g, grp in enumerate(self._groups):
                weight, bias, ln_weight, ln_bias = self._group_params(g)
                bound = 1.0 / math.sqrt(grp.dim)
                weight.uniform_(-bound, bound)
                if bias is not None:
                    bias.uniform_(-bound, bound)
                if ln_weight is not None:
                    ln_weight.fill_(1.0)
                    ln_bias.zero_()

    def _group_params(self, g: int) -> tuple[Optional[torch.Tensor], ...]:
        suffix = self._groups[g].suffix
        return tuple(getattr(self, kind + suffix) for kind in _PARAM_KINDS)

    def feature_parameters(self, name: str) -> dict[str, Optional[torch.Tensor]]:
        """One feature's parameters as views: weight [H, D], bias [H], ln_weight/ln_bias [D].

        Absent ones (``bias=False``, ``ln_affine=False``) are None.

        Example:
            >>> fp = FusedFeatureProcessor(["a", "b"], [4, 6], out_features=3, shared_linear=False)
            >>> fp.feature_parameters("b")["weight"].shape
            torch.Size([3, 6])
        """
        if name not in self._slot:
            raise KeyError(f"unknown feature {name!r}; this module has features {list(self.feature_names)}")
        g, j = self._slot[name]
        out = {}
        for kind, p in zip(_PARAM_KINDS, self._group_params(g)):
            per_feature = p is not None and p.dim() == _PER_FEATURE_NDIM[kind]
            out[kind] = p[j] if per_feature else p
        return out

    @classmethod
    def from_modules(cls, layer_norms, linear, feature_names: Optional[Sequence[str]] = None):
        """Build from an existing per-feature loop's modules, copying their weights.

        Args:
            layer_norms: ``nn.ModuleDict`` / dict name -> ``nn.LayerNorm``, ``nn.ModuleList`` /
                list of ``nn.LayerNorm`` (one per feature), or one ``nn.LayerNorm`` shared by all.
            linear: one ``nn.Linear`` shared by all features, or a dict / list with one per
                feature (same conventions as `layer_norms`).
            feature_names: the feature order (of a [B, F*D] input). Defaults to the dict's key
                order; for lists to ``"0", "1", ...`` (the ModuleList's own keys).

        All LayerNorms must share eps and elementwise_affine; all Linears share out_features and
        whether they have a bias. The new module is on the device and dtype of the Linear.

        Example:
            >>> from torch import nn
            >>> lns = nn.ModuleDict({"a": nn.LayerNorm(8), "b": nn.LayerNorm(8)})
            >>> fp = FusedFeatureProcessor.from_modules(lns, nn.Linear(8, 2))
            >>> fp.feature_names, fp.weight.shape, fp.ln_weight.shape
            (('a', 'b'), torch.Size([2, 8]), torch.Size([2, 8]))
        """
        names = _names_from_modules(layer_norms, linear, feature_names)
        ln_of = _per_feature_lookup("layer_norms", layer_norms, names, nn.LayerNorm)
        lin_of = _per_feature_lookup("linear", linear, names, nn.Linear)

        dims = []
        for name in names:
            ln = ln_of(name)
            if len(ln.normalized_shape) != 1:
                raise ValueError(
                    f"layer_norms[{name!r}] normalizes over {tuple(ln.normalized_shape)}; only "
                    f"LayerNorm over the last dim (normalized_shape=(D,)) can be fused"
                )
            if ln.elementwise_affine and ln.bias is None:
                raise ValueError(
                    f"layer_norms[{name!r}] has a weight but no bias (bias=False); the fused "
                    f"module's affine LayerNorm has both"
                )
            dims.append(int(ln.normalized_shape[0]))
        first_ln, first_lin = ln_of(names[0]), lin_of(names[0])
        for name, D in zip(names, dims):
            ln, lin = ln_of(name), lin_of(name)
            if ln.eps != first_ln.eps or ln.elementwise_affine != first_ln.elementwise_affine:
                raise ValueError(
                    f"layer_norms[{name!r}] has eps={ln.eps}, elementwise_affine="
                    f"{ln.elementwise_affine} but layer_norms[{names[0]!r}] has eps={first_ln.eps}, "
                    f"elementwise_affine={first_ln.elementwise_affine}; one module needs them equal"
                )
            if lin.in_features != D:
                raise ValueError(
                    f"linear for feature {name!r} has in_features={lin.in_features} but its "
                    f"LayerNorm normalizes D={D}"
                )
            if lin.out_features != first_lin.out_features or (lin.bias is None) != (first_lin.bias is None):
                raise ValueError(
                    f"linear for feature {name!r} has out_features={lin.out_features}, "
                    f"bias={lin.bias is not None} but the one for {names[0]!r} has out_features="
                    f"{first_lin.out_features}, bias={first_lin.bias is not None}"
                )

        fp = cls(
            names,
            dims,
            first_lin.out_features,
            shared_linear=isinstance(linear, nn.Linear),
            shared_layer_norm=isinstance(layer_norms, nn.LayerNorm),
            ln_affine=first_ln.elementwise_affine,
            bias=first_lin.bias is not None,
            eps=first_ln.eps,
            device=first_lin.weight.device,
            dtype=first_lin.weight.dtype,
        )
        with torch.no_grad():
            for name in names:
                sources = {
                    "weight": lin_of(name).weight,
                    "bias": lin_of(name).bias,
                    "ln_weight": ln_of(name).weight,
                    "ln_bias": ln_of(name).bias,
                }
                for kind, dst in fp.feature_parameters(name).items():
                    if dst is not None:
                        dst.copy_(sources[kind])
        return fp

    # -----------------------------------------------------------------------------------------
    # forward

    def forward(self, x, *, feature_dim: int = 1):
        """Run the fused chain on every feature; returns the same kind of input with D -> H.

        Args:
            x: one of
                * a torchrec ``KeyedTensor`` of pooled embeddings (keys in any order, matched by
                  name), or the ``LazyAwaitable`` of one that a sharded EBC returns -> a
                  KeyedTensor with the same keys, ``out_features`` per key;
                * a [B, sum(D)] tensor, features in ``feature_names`` order -> [B, F*H];
                * a 3D tensor, [B, F, D] by default or [F, B, D] with ``feature_dim=0``
                  (single embedding dim only) -> [B, F, H] or [F, B, H];
                * a dict name -> [B, D] (any key order) -> a dict name -> [B, H], same key order.
            feature_dim: for a 3D tensor, which dim indexes features: 1 ([B, F, D], batch-first
                like torchrec's buffers) or 0 ([F, B, D]). Ignored for other kinds.

        Example:
            >>> import torch
            >>> fp = FusedFeatureProcessor(["a", "b"], 4, out_features=3)
            >>> fp(torch.randn(5, 2, 4)).shape, fp(torch.randn(2, 5, 4), feature_dim=0).shape
            (torch.Size([5, 2, 3]), torch.Size([2, 5, 3]))
        """
        if isinstance(x, torch.Tensor):
            ndim = x.dim()
            if ndim == 3:
                self._check_stacked(x, feature_dim)
            elif ndim != 2:
                raise self._rank_error(x)
            elif x.shape[1] != self._total_dim:  # the [B, sum(D)] check of _check_buffer, inline
                self._check_buffer(x, self.feature_names, self.embedding_dims, "input")  # raises
            if self.cuda_graph:  # replayed where the rule allows, else _fused_tensor called
                return self._cuda_graphs.call(self._fused_tensor, (x, feature_dim), self._module_tensors())
            return self._fused_tensor(x, feature_dim)
        if isinstance(x, Mapping):
            return self._fused_dict(x)
        x = wait_if_lazy_awaitable(x)  # a sharded EBC's output
        if is_keyed_tensor(x):
            keys, lengths, values = keyed_tensor_parts(x)
            y = self._fused_buffer(values, tuple(keys), tuple(lengths), "KeyedTensor")
            return make_keyed_tensor(keys, [self.out_features] * len(keys), y)
        raise self._kind_error(x)

    def forward_reference(self, x, *, feature_dim: int = 1):
        """Same inputs and result as `forward`, computed feature by feature (the oracle).

        Each feature's [B, D] slice, found by name, goes through
        `recfuse.reference.ln_tanh_linear_relu` with that feature's own parameters: no stacking,
        no strided views, no op. Slow; for verification.

        Example:
            >>> import torch
            >>> fp = FusedFeatureProcessor(["a", "b"], 4)
            >>> x = torch.randn(3, 8)
            >>> torch.allclose(fp(x), fp.forward_reference(x), atol=1e-6)
            True
        """
        if isinstance(x, torch.Tensor):
            if x.dim() == 2:
                self._check_buffer(x, self.feature_names, self.embedding_dims, "input")
                return self._reference_buffer(x, self.feature_names, self.embedding_dims)
            if x.dim() == 3:
                self._check_stacked(x, feature_dim)
                outs = [
                    self._reference_feature(name, x.select(feature_dim, f))
                    for f, name in enumerate(self.feature_names)
                ]
                return torch.stack(outs, dim=feature_dim)
            raise self._rank_error(x)
        if isinstance(x, Mapping):
            self._check_dict(x)
            return {name: self._reference_feature(name, t) for name, t in x.items()}
        x = wait_if_lazy_awaitable(x)
        if is_keyed_tensor(x):
            keys, lengths, values = keyed_tensor_parts(x)
            self._check_buffer(values, keys, lengths, "KeyedTensor")
            y = self._reference_buffer(values, keys, lengths)
            return make_keyed_tensor(keys, [self.out_features] * len(keys), y)
        raise self._kind_error(x)

    # -- fused paths --------------------------------------------------------------------------

    def _fused_tensor(self, x: torch.Tensor, feature_dim: int) -> torch.Tensor:
        """A validated [B, sum(D)] or 3D tensor input."""
        if x.dim() == 2:
            return self._fused_buffer(x, self.feature_names, self.embedding_dims, "input")
        return self._run_group(x, 0, None, feature_dim)

    def _run_group(
        self, x3: torch.Tensor, g: int, param_index: Optional[tuple[int, ...]], feature_dim: int
    ) -> torch.Tensor:
        """One op call for dim group `g` on a 3D view; params reordered to the view's features."""
        params = []
        for kind, p in zip(_PARAM_KINDS, self._group_params(g)):
            if p is not None and param_index is not None and p.dim() == _PER_FEATURE_NDIM[kind]:
                p = p.index_select(0, torch.tensor(param_index, device=p.device))
            params.append(_as_dtype(p, x3.dtype))
        weight, bias, ln_weight, ln_bias = params
        return ln_tanh_linear_relu(
            x3, weight, bias, ln_weight=ln_weight, ln_bias=ln_bias, eps=self.eps, feature_dim=feature_dim
        )

    def _fused_buffer(
        self, values: torch.Tensor, names: tuple[str, ...], dims: tuple[int, ...], what: str
    ) -> torch.Tensor:
        """[B, sum(D)] with features `names` of dims `dims` in that order -> [B, F*H], same order."""
        plan = self._plan(names, dims, what)
        if values.dim() != 2 or values.shape[1] != plan.width:
            self._check_buffer(values, names, dims, what)  # raises, naming the layout
        ys = [
            self._run_group(_strided_group_view(values, r.offsets, r.dim), r.group, r.param_index, 1)
            for r in plan.runs
        ]
        if plan.output_is_view:
            return ys[0].flatten(1)
        pieces: list = [None] * len(names)
        for run, y in zip(plan.runs, ys):
            for j, pos in enumerate(run.positions):
                pieces[pos] = y[:, j]
        return torch.cat(pieces, dim=1)

    def _fused_dict(self, x: Mapping) -> dict:
        self._check_dict(x)
        outs = {}
        for g, grp in enumerate(self._groups):
            # Separate tensors cannot be viewed as one: stack them (a copy) in parameter order.
            y = self._run_group(torch.stack([x[n] for n in grp.names], dim=1), g, None, 1)
            outs.update({n: y[:, j] for j, n in enumerate(grp.names)})
        return {name: outs[name] for name in x}

    def _plan(self, names: tuple[str, ...], dims: tuple[int, ...], what: str) -> _BufferPlan:
        """Which buffer columns and parameter rows each op call uses, for a key layout.

        Validated and built once per (names, dims): a training loop sees one or two layouts, and
        checking F names on every call would cost more host time than the op on small shapes.
        """
        plan = self._plans.get((names, dims))
        if plan is not None:
            return plan
        if names is not self.feature_names:
            self._check_names(names, what)
            self._check_dims(names, dims, what)
        offsets = [0]
        for d in dims[:-1]:
            offsets.append(offsets[-1] + d)
        members: dict[int, list[tuple[int, int, int]]] = {}  # group -> [(position, offset, row)]
        for pos, name in enumerate(names):
            g, row = self._slot[name]
            members.setdefault(g, []).append((pos, offsets[pos], row))
        runs = []
        for g in sorted(members):
            positions, offs, rows = zip(*members[g])
            identity = rows == tuple(range(len(rows)))
            runs.append(_GroupRun(g, self._groups[g].dim, offs, positions, None if identity else rows))
        output_is_view = len(runs) == 1 and runs[0].positions == tuple(range(len(names)))
        plan = _BufferPlan(tuple(runs), output_is_view, sum(dims))
        self._plans[(names, dims)] = plan
        return plan

    # -- reference path -----------------------------------------------------------------------

    def _reference_feature(self, name: str, x2: torch.Tensor) -> torch.Tensor:
        p = {k: _as_dtype(v, x2.dtype) for k, v in self.feature_parameters(name).items()}
        y = reference.ln_tanh_linear_relu(
            x2.unsqueeze(0), p["weight"], p["bias"],
            ln_weight=p["ln_weight"], ln_bias=p["ln_bias"], eps=self.eps, feature_dim=0,
        )
        return y[0]

    def _reference_buffer(self, values, names, dims) -> torch.Tensor:
        outs, offset = [], 0
        for name, d in zip(names, dims):
            outs.append(self._reference_feature(name, values.narrow(1, offset, d)))
            offset += d
        return torch.cat(outs, dim=1)

    # -- validation ---------------------------------------------------------------------------

    def _check_names(self, names: Sequence[str], what: str) -> None:
        seen, duplicates = set(), []
        for n in names:
            if n in seen:
                duplicates.append(n)
            seen.add(n)
        if duplicates:
            raise ValueError(f"{what} has duplicate feature(s) {duplicates}")
        unknown = [n for n in names if n not in self._slot]
        if unknown:
            raise ValueError(
                f"{what} has feature(s) {unknown} unknown to this FusedFeatureProcessor, which was "
                f"built for {list(self.feature_names)}"
            )
        missing = [n for n in self.feature_names if n not in seen]
        if missing:
            raise ValueError(
                f"{what} is missing feature(s) {missing} that this FusedFeatureProcessor was built for"
            )

    def _check_dims(self, names: Sequence[str], dims: Sequence[int], what: str) -> None:
        for name, d in zip(names, dims):
            expected = self._dim_of[name]
            if d != expected:
                raise ValueError(
                    f"feature {name!r}: {what} has embedding dim {d} but the module was built "
                    f"with embedding_dims[{name!r}] = {expected}"
                )

    def _check_buffer(self, values: torch.Tensor, names, dims, what: str) -> None:
        """A [B, sum(D)] buffer holding `names` with lengths `dims`, in that order."""
        if names is not self.feature_names:
            self._check_names(names, what)
            self._check_dims(names, dims, what)
        total = sum(dims)
        if values.dim() != 2 or values.shape[1] != total:
            layout = ", ".join(f"{n}:{d}" for n, d in zip(names, dims))
            raise ValueError(
                f"{what} must be [B, {total}] (features {layout} side by side), got shape "
                f"{list(values.shape)}"
            )

    def _check_dict(self, x: Mapping) -> None:
        self._check_names(list(x), "input dict")
        batch = None
        for name, t in x.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"feature {name!r}: input dict value must be a [B, D] tensor, got {got}")
            self._check_dims([name], [t.shape[1]], "input dict")
            if batch is None:
                batch = (name, t.shape[0])
            elif t.shape[0] != batch[1]:
                raise ValueError(
                    f"feature {name!r}: batch size {t.shape[0]} differs from feature "
                    f"{batch[0]!r}'s batch size {batch[1]}"
                )

    def _check_stacked(self, x: torch.Tensor, feature_dim: int) -> None:
        if len(self._groups) != 1:
            raise ValueError(
                f"a 3D input needs every feature to have one embedding dim, but this module has "
                f"dims {dict(zip(self.feature_names, self.embedding_dims))}; pass a [B, sum(D)] "
                f"tensor, a KeyedTensor or a dict"
            )
        if feature_dim not in (0, 1):
            raise ValueError(f"feature_dim must be 0 ([F, B, D]) or 1 ([B, F, D]), got {feature_dim!r}")
        F, D = len(self.feature_names), self._groups[0].dim
        layout = "[F, B, D]" if feature_dim == 0 else "[B, F, D]"
        if x.shape[feature_dim] != F:
            hint = ""
            if x.shape[1 - feature_dim] == F:
                hint = f"; if it is {'[B, F, D]' if feature_dim == 0 else '[F, B, D]'}, pass feature_dim={1 - feature_dim}"
            raise ValueError(
                f"3D input with feature_dim={feature_dim} must be {layout} with F={F} features "
                f"{list(self.feature_names)}, got shape {list(x.shape)}{hint}"
            )
        if x.shape[2] != D:
            raise ValueError(
                f"3D input must have the features' embedding dim D={D} last, got shape {list(x.shape)}"
            )

    def _rank_error(self, x: torch.Tensor) -> ValueError:
        return ValueError(
            f"input tensor must be 2D [B, sum(D)] or 3D [B, F, D] / [F, B, D], got shape "
            f"{list(x.shape)} ({x.dim()}D)"
        )

    @staticmethod
    def _kind_error(x) -> TypeError:
        return TypeError(
            f"input must be a torchrec KeyedTensor, a 2D/3D torch.Tensor or a dict name -> [B, D] "
            f"tensor, got {type(x).__name__}"
        )

    def extra_repr(self) -> str:
        dims = self.embedding_dims[0] if len(self._groups) == 1 else list(self.embedding_dims)
        return (
            f"features={len(self.feature_names)}, embedding_dims={dims}, out_features="
            f"{self.out_features}, shared_linear={self.shared_linear}, shared_layer_norm="
            f"{self.shared_layer_norm}, ln_affine={self.ln_affine}, bias={self.has_bias}, eps={self.eps}"
            + (", cuda_graph=True" if self.cuda_graph else "")
        )


# ---------------------------------------------------------------------------------------------
# argument helpers


def _check_config(feature_names, embedding_dims, out_features, eps) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if isinstance(feature_names, str) or not isinstance(feature_names, Sequence):
        raise TypeError(f"feature_names must be a list of str, got {type(feature_names).__name__}")
    names = tuple(feature_names)
    if not names:
        raise ValueError("feature_names must name at least one feature")
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"feature_names must be str, got {n!r} ({type(n).__name__})")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"feature_names has duplicates {duplicates}")
    if isinstance(embedding_dims, int) and not isinstance(embedding_dims, bool):
        dims = (embedding_dims,) * len(names)
    elif isinstance(embedding_dims, (bool, str)) or not isinstance(embedding_dims, Sequence):
        raise TypeError(
            f"embedding_dims must be an int (one dim for all features) or a sequence of ints (one per "
            f"feature), got {embedding_dims!r} ({type(embedding_dims).__name__})")
    else:
        dims = tuple(embedding_dims)
        if len(dims) != len(names):
            raise ValueError(
                f"embedding_dims has {len(dims)} entries but feature_names has {len(names)}; give "
                f"one int for all or one per feature"
            )
    for n, d in zip(names, dims):
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"feature {n!r}: embedding dim must be an int >= 1, got {d!r}")
    if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"out_features must be an int >= 1, got {out_features!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps != eps or eps < 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    return names, dims


def _is_mapping(m) -> bool:
    return isinstance(m, (Mapping, nn.ModuleDict))


def _names_from_modules(layer_norms, linear, feature_names) -> tuple[str, ...]:
    keyed = [m for m in (layer_norms, linear) if _is_mapping(m)]
    listed = [m for m in (layer_norms, linear) if isinstance(m, (list, tuple, nn.ModuleList))]
    if feature_names is not None:
        names = tuple(feature_names)
    elif keyed:
        names = tuple(keyed[0].keys())
    elif listed:
        names = tuple(str(i) for i in range(len(listed[0])))
    else:
        raise ValueError(
            "feature_names is required when both layer_norms and linear are single shared modules"
        )
    for what, m in (("layer_norms", layer_norms), ("linear", linear)):
        if _is_mapping(m) and set(m.keys()) != set(names):
            raise ValueError(
                f"{what} has keys {sorted(m.keys())} but the features are {sorted(names)}"
            )
        if isinstance(m, (list, tuple, nn.ModuleList)) and len(m) != len(names):
            raise ValueError(f"{what} has {len(m)} modules but there are {len(names)} features {list(names)}")
    return names


def _per_feature_lookup(what: str, modules, names, module_type):
    """name -> module for a shared module, a dict/ModuleDict or a list/ModuleList of them."""
    if isinstance(modules, module_type):
        lookup = {n: modules for n in names}
    elif _is_mapping(modules):
        lookup = {n: modules[n] for n in names}
    elif isinstance(modules, (list, tuple, nn.ModuleList)):
        lookup = dict(zip(names, modules))
    else:
        raise TypeError(
            f"{what} must be an nn.{module_type.__name__}, a dict/ModuleDict or a list/ModuleList "
            f"of them, got {type(modules).__name__}"
        )
    for n, m in lookup.items():
        if not isinstance(m, module_type):
            raise TypeError(f"{what}[{n!r}] must be an nn.{module_type.__name__}, got {type(m).__name__}")
    return lookup.__getitem__
