"""The stacked parameters of a `FusedFeatureProcessor` and `from_modules`' reading of a loop's modules.

Each dim group owns four parameter slots, ``weight``, ``bias``, ``ln_weight``, ``ln_bias`` (with
the group's ``_d{dim}`` suffix when the module has several dims), stacked over the group's
features ([n, ...]) or shared ([...]); absent ones are registered as None so that state_dict keys
and ``module.bias is None`` read as for ``nn.Linear``.

Example:
    >>> import torch
    >>> from recfuse.module.features import FeatureLayout
    >>> layout = FeatureLayout.build(("a", "b"), (4, 4))
    >>> parameter_shapes(layout.groups[0], out_features=3, shared_linear=True,
    ...                  shared_layer_norm=False, ln_affine=True, bias=False)
    {'weight': (3, 4), 'bias': None, 'ln_weight': (2, 4), 'ln_bias': (2, 4)}
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .features import DimGroup

__all__ = [
    "PARAM_KINDS", "PER_FEATURE_NDIM", "parameter_shapes", "reset_group", "feature_view",
    "ModulesSpec", "read_modules",
]

PARAM_KINDS = ("weight", "bias", "ln_weight", "ln_bias")
# Number of dims of each parameter kind when it is stored per feature ([n, ...]), in PARAM_KINDS order.
PER_FEATURE_NDIM = (3, 2, 2, 2)


def parameter_shapes(
    group: DimGroup, out_features: int, *, shared_linear: bool, shared_layer_norm: bool,
    ln_affine: bool, bias: bool, ln_bias: bool = True,
) -> dict[str, Optional[tuple[int, ...]]]:
    """kind -> shape of one dim group's parameter, None where the configuration has none.

    `ln_bias`: whether the norm's affine has a bias (LayerNorm's does, RMSNorm's does not).

    Example:
        >>> parameter_shapes(DimGroup(8, ("a", "b", "c"), ""), 2, shared_linear=False,
        ...                  shared_layer_norm=True, ln_affine=False, bias=True)["weight"]
        (3, 2, 8)
    """
    n, D, H = len(group.names), group.dim, out_features
    return {
        "weight": (H, D) if shared_linear else (n, H, D),
        "bias": ((H,) if shared_linear else (n, H)) if bias else None,
        "ln_weight": ((D,) if shared_layer_norm else (n, D)) if ln_affine else None,
        "ln_bias": ((D,) if shared_layer_norm else (n, D)) if ln_affine and ln_bias else None,
    }


def reset_group(dim: int, weight, bias, ln_weight, ln_bias) -> None:
    """Initialise one group's parameters in place as nn.Linear and nn.LayerNorm do.

    Linear weight and bias uniform in +-1/sqrt(D) (what ``kaiming_uniform_(a=sqrt(5))`` gives
    for fan_in D), LayerNorm weight 1 and bias 0. Call it under ``torch.no_grad()``.

    Example:
        >>> import torch
        >>> w, lw, lb = torch.empty(2, 4), torch.empty(4), torch.empty(4)
        >>> reset_group(4, w, None, lw, lb); bool(w.abs().max() <= 0.5), lw.tolist(), lb.tolist()
        (True, [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    """
    bound = 1.0 / math.sqrt(dim)
    weight.uniform_(-bound, bound)
    if bias is not None:
        bias.uniform_(-bound, bound)
    if ln_weight is not None:
        ln_weight.fill_(1.0)
    if ln_bias is not None:
        ln_bias.zero_()


def feature_view(params: Sequence[Optional[torch.Tensor]], row: int) -> dict[str, Optional[torch.Tensor]]:
    """One feature's parameters, by kind, from its group's (weight, bias, ln_weight, ln_bias).

    Per-feature parameters give row `row` (a view); shared ones are returned whole.

    Example:
        >>> import torch
        >>> view = feature_view((torch.zeros(3, 2, 8), None, torch.ones(8), torch.zeros(8)), 1)
        >>> view["weight"].shape, view["bias"], view["ln_weight"].shape
        (torch.Size([2, 8]), None, torch.Size([8]))
    """
    return {
        kind: p[row] if p is not None and p.dim() == ndim else p
        for kind, ndim, p in zip(PARAM_KINDS, PER_FEATURE_NDIM, params)
    }


# ---------------------------------------------------------------------------------------------
# from_modules: what a per-feature loop's LayerNorms and Linears say about the fused module


@dataclass(frozen=True)
class ModulesSpec:
    """A loop's modules, checked: the constructor arguments and each feature's source modules.

    Example:
        >>> from torch import nn
        >>> spec = read_modules(nn.ModuleList([nn.LayerNorm(4)] * 2), nn.Linear(4, 1), None)
        >>> spec.kwargs["feature_names"], spec.kwargs["embedding_dims"], spec.kwargs["shared_linear"]
        (('0', '1'), (4, 4), True)
    """

    kwargs: dict  # FusedFeatureProcessor(**kwargs)
    layer_norm_of: Callable[[str], nn.Module]  # nn.LayerNorm or nn.RMSNorm
    linear_of: Callable[[str], nn.Linear]

    def sources(self, name: str) -> dict[str, Optional[torch.Tensor]]:
        """Feature `name`'s tensors in the loop, by parameter kind.

        Example:
            >>> from torch import nn
            >>> spec = read_modules({"a": nn.LayerNorm(4)}, nn.Linear(4, 2, bias=False), None)
            >>> spec.sources("a")["weight"].shape, spec.sources("a")["bias"]
            (torch.Size([2, 4]), None)
        """
        ln, lin = self.layer_norm_of(name), self.linear_of(name)
        return {"weight": lin.weight, "bias": lin.bias, "ln_weight": ln.weight, "ln_bias": getattr(ln, "bias", None)}


_TORCH_FORWARD = {nn.LayerNorm: nn.LayerNorm.forward, nn.RMSNorm: nn.RMSNorm.forward, nn.Linear: nn.Linear.forward}


def _check_plain(label: str, mod: nn.Module) -> None:
    """Raise unless `mod` computes what its torch base class does: only weight and bias are
    copied, so an overridden or patched forward (a scaled norm, LoRA) or a hook would be lost."""
    base = next((b for b in _TORCH_FORWARD if isinstance(mod, b)), None)
    if base is None:
        return  # the type check names it
    why = None
    if "forward" in mod.__dict__:
        why = "has a forward assigned on the instance"
    elif type(mod).forward is not _TORCH_FORWARD[base] or base.forward is not _TORCH_FORWARD[base]:
        why = f"overrides nn.{base.__name__}.forward"
    elif mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or getattr(mod, "_backward_pre_hooks", None):
        why = "has hooks"
    elif torch.nn.utils.parametrize.is_parametrized(mod):
        why = (f"has a parametrization of {sorted(mod.parametrizations.keys())} (weight norm, spectral norm, ...), "
               f"which a copied plain tensor would not train through")
    if why is not None:
        raise ValueError(
            f"{label} is a {type(mod).__qualname__} that {why}; from_modules copies only weight and bias "
            f"and computes plain nn.{base.__name__}, so the result would differ. Pass plain modules.")


def read_modules(layer_norms, linear, feature_names: Optional[Sequence[str]]) -> ModulesSpec:
    """Check a per-feature loop's modules (see `FusedFeatureProcessor.from_modules`).

    All norms must be of one type (nn.LayerNorm or nn.RMSNorm), share eps and elementwise_affine
    and normalise the last dim only; all Linears share out_features and whether they have a bias,
    and take their norm's D.

    Example:
        >>> from torch import nn
        >>> read_modules({"a": nn.LayerNorm(8), "b": nn.LayerNorm(4)}, nn.Linear(8, 2), None)
        Traceback (most recent call last):
        ...
        ValueError: linear for feature 'b' has in_features=8 but its LayerNorm normalizes D=4
    """
    names = _names_from_modules(layer_norms, linear, feature_names)
    if not names:
        raise ValueError("from_modules needs at least one feature; layer_norms and linear are empty")
    ln_of = _per_feature_lookup("layer_norms", layer_norms, names, (nn.LayerNorm, nn.RMSNorm))
    lin_of = _per_feature_lookup("linear", linear, names, nn.Linear)

    dims = []
    for name in names:
        ln = ln_of(name)
        _check_plain(f"layer_norms[{name!r}]", ln)
        _check_plain(f"linear for feature {name!r}", lin_of(name))
        if len(ln.normalized_shape) != 1:
            raise ValueError(
                f"layer_norms[{name!r}] normalizes over {tuple(ln.normalized_shape)}; only "
                f"LayerNorm over the last dim (normalized_shape=(D,)) can be fused"
            )
        if type(ln) is not type(ln_of(names[0])):
            raise ValueError(
                f"layer_norms[{name!r}] is an nn.{type(ln).__name__} but layer_norms[{names[0]!r}] an "
                f"nn.{type(ln_of(names[0])).__name__}; one module runs one norm"
            )
        if isinstance(ln, nn.LayerNorm) and ln.elementwise_affine and ln.bias is None:
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
    kwargs = dict(
        feature_names=names,
        embedding_dims=tuple(dims),
        out_features=first_lin.out_features,
        shared_linear=isinstance(linear, nn.Linear) or _one_for_all("linear", names, lin_of, ("weight", "bias")),
        shared_layer_norm=isinstance(layer_norms, (nn.LayerNorm, nn.RMSNorm))
        or _one_for_all("layer_norms", names, ln_of, ("weight", "bias")),
        norm="rms_norm" if isinstance(first_ln, nn.RMSNorm) else "layer_norm",
        ln_affine=first_ln.elementwise_affine,
        bias=first_lin.bias is not None,
        eps=first_ln.eps,
        device=first_lin.weight.device,
        dtype=first_lin.weight.dtype,
    )
    return ModulesSpec(kwargs, ln_of, lin_of)


def _one_for_all(what: str, names, module_of, kinds) -> bool:
    """Whether every feature's module holds the same tensors (one module listed for every feature):
    the fused module then shares one copy, which trains as the loop's one module does. Raises when
    some features share a tensor and others do not (a module listed twice, a tied weight): one row
    per feature would untie them, so training would differ from the loop."""
    rows = [[getattr(module_of(n), k, None) for k in kinds] for n in names]
    if len(names) > 1 and any(t is not None for t in rows[0]) and all(
            all(a is b for a, b in zip(r, rows[0])) for r in rows[1:]):
        return True
    owner: dict = {}
    for name, row in zip(names, rows):
        for kind, t in zip(kinds, row):
            if t is None:
                continue
            first = owner.setdefault(id(t), name)
            if first != name:
                raise ValueError(
                    f"{what} for features {first!r} and {name!r} share one {kind} tensor (the same module listed "
                    f"twice, or a tied parameter), but not every feature does; the fused module holds one copy per "
                    f"feature (or one for all), so training would untie what the loop shares. Pass one module per "
                    f"feature, or one shared by all")
    return False


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
    # A list pairs with the features by position. Beside a dict whose key order is not the
    # feature order, that position is ambiguous: a loop ``zip(lns.items(), lins)`` pairs the list
    # with the dict's order, not with feature_names' (a Linear silently given to another feature).
    for (what, m), (other, d) in ((("layer_norms", layer_norms), ("linear", linear)),
                                  (("linear", linear), ("layer_norms", layer_norms))):
        if (isinstance(m, (list, tuple, nn.ModuleList)) and _is_mapping(d)
                and tuple(d.keys()) != names):
            raise ValueError(
                f"{what} is a list (paired with the features by position) but {other} is a dict whose key "
                f"order {list(d.keys())} is not the feature order {list(names)}; which order the list follows "
                f"is ambiguous: pass {what} as a dict keyed by feature name, or feature_names in the key order of "
                f"{other}")
    return names


def _per_feature_lookup(what: str, modules, names, module_type):
    """name -> module for a shared module, a dict/ModuleDict or a list/ModuleList of them.

    `module_type`: a module class or a tuple of them."""
    types = module_type if isinstance(module_type, tuple) else (module_type,)
    type_text = " or ".join(f"nn.{t.__name__}" for t in types)
    if isinstance(modules, types):
        lookup = {n: modules for n in names}
    elif _is_mapping(modules):
        lookup = {n: modules[n] for n in names}
    elif isinstance(modules, (list, tuple, nn.ModuleList)):
        lookup = dict(zip(names, modules))
    else:
        raise TypeError(
            f"{what} must be an {type_text}, a dict/ModuleDict or a list/ModuleList "
            f"of them, got {type(modules).__name__}"
        )
    for n, m in lookup.items():
        if not isinstance(m, types):
            raise TypeError(f"{what}[{n!r}] must be an {type_text}, got {type(m).__name__}")
    return lookup.__getitem__
