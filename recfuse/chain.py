"""Which chain a `feature_mlp` call runs: norm -> activation -> Linear -> out activation.

A `Chain` names the three choices; `chain_of` validates them (errors name the argument) and
`codes` turns them into the integers the kernels take as compile-time constants, so one kernel
family covers every combination. The torch spellings of each choice (`apply_norm`,
`apply_activation`) are what the reference and the composite paths run.

Example:
    >>> c = chain_of("rms_norm", "silu", None)
    >>> c.describe()
    'rms_norm -> silu -> linear'
    >>> codes(c)
    (2, 6, 0)
    >>> chain_of("layer_norm", "tanh", "relu") is DEFAULT or chain_of("layer_norm", "tanh", "relu") == DEFAULT
    True
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F_

__all__ = ["Chain", "DEFAULT", "NORMS", "ACTIVATIONS", "chain_of", "codes", "apply_norm", "normalized_rows", "apply_activation",
           "to_schema", "from_schema", "activation_grad"]

# Kernel codes (constexprs). 0 is "none" for both.
NORMS = {None: 0, "layer_norm": 1, "rms_norm": 2}
ACTIVATIONS = {None: 0, "tanh": 1, "sigmoid": 2, "relu": 3, "gelu": 4, "gelu_tanh": 5, "silu": 6}


class Chain(NamedTuple):
    """norm, activation (after the norm) and out_activation (after the Linear); None = absent.

    A tuple, so that it hashes in C: it is part of every launch plan's key.
    """

    norm: Optional[str] = "layer_norm"
    activation: Optional[str] = "tanh"
    out_activation: Optional[str] = "relu"

    def describe(self) -> str:
        """The chain as text, e.g. ``'layer_norm -> tanh -> linear -> relu'``."""
        parts = [p for p in (self.norm, self.activation) if p is not None] + ["linear"]
        if self.out_activation is not None:
            parts.append(self.out_activation)
        return " -> ".join(parts)


DEFAULT = Chain()


def _choices(table: dict) -> str:
    names = [repr(k) for k in table if k is not None]
    return ", ".join(names) + " or None"


def chain_of(norm, activation, out_activation) -> Chain:
    """A validated `Chain` (``"none"`` is accepted for None, as the op's schema spells it).

    Example:
        >>> chain_of("batch_norm", "tanh", "relu")
        Traceback (most recent call last):
        ...
        ValueError: norm must be one of 'layer_norm', 'rms_norm' or None, got 'batch_norm'
    """
    try:
        return _VALID[norm, activation, out_activation]  # the op's hot path: one lookup once seen
    except (KeyError, TypeError):  # TypeError: an unhashable argument, refused below
        pass
    key = (norm, activation, out_activation)
    norm, activation, out_activation = (None if v == "none" else v for v in (norm, activation, out_activation))
    if not isinstance(norm, (str, type(None))) or norm not in NORMS:
        raise ValueError(f"norm must be one of {_choices(NORMS)}, got {norm!r}")
    for name, v in (("activation", activation), ("out_activation", out_activation)):
        if not isinstance(v, (str, type(None))) or v not in ACTIVATIONS:
            raise ValueError(f"{name} must be one of {_choices(ACTIVATIONS)}, got {v!r}")
    chain = _VALID[key] = Chain(norm, activation, out_activation)
    return chain


# Validated chains by their arguments as given: (3 + 1) * (7 + 1)^2 entries ("none" or None),
# all filled here, at import. Filled lazily, the first call of a chain under torch.compile made
# Dynamo trace the insertion into this module-level dict; when Dynamo restarted its analysis (a
# first `feature_mlp` call in a compiled function with dynamic=True and a tensor requiring grad)
# the dict already held the key, the replay took the other branch, and compilation failed with
# "SpeculationLogDivergence". Filled once, the lookup is a pure read.
_VALID: dict = {}


def _fill_valid() -> None:
    chains: dict = {tuple(DEFAULT): DEFAULT}
    for spelled in ((n, a, o) for n in (*NORMS, "none") for a in (*ACTIVATIONS, "none")
                    for o in (*ACTIVATIONS, "none")):
        canon = tuple(None if v == "none" else v for v in spelled)
        _VALID[spelled] = chains.setdefault(canon, Chain(*canon))


_fill_valid()


def codes(chain: Chain) -> tuple[int, int, int]:
    """(NORM, ACT, OUT_ACT): the kernels' compile-time constants for `chain`."""
    return NORMS[chain.norm], ACTIVATIONS[chain.activation], ACTIVATIONS[chain.out_activation]


def to_schema(chain: Chain) -> tuple[str, str, str]:
    """The chain as the custom op's three string arguments (None -> ``"none"``)."""
    return tuple("none" if v is None else v for v in chain)


def from_schema(norm: str, activation: str, out_activation: str) -> Chain:
    """Inverse of `to_schema`; validated."""
    return chain_of(norm, activation, out_activation)


def apply_norm(x: torch.Tensor, norm: Optional[str], eps: float) -> torch.Tensor:
    """The norm over the last dim, without affine, in torch ops."""
    if norm == "layer_norm":
        return F_.layer_norm(x, (x.shape[-1],), None, None, eps)
    if norm == "rms_norm":
        return F_.rms_norm(x, (x.shape[-1],), None, eps)
    return x


def normalized_rows(x: torch.Tensor, norm: Optional[str], eps: float):
    """(xhat, rstd): the norm over the last dim without affine, and its per-row rstd (None without
    a norm), NaN on the rows whose statistic (LayerNorm's variance, RMSNorm's mean square)
    overflowed in x's dtype, as the kernels give. `apply_norm`'s F.layer_norm / F.rms_norm take
    rstd = 0 there and return a finite row far from float64's; the batched composite forward and
    the analytic backward both normalise through this.

    Example:
        >>> xhat, rstd = normalized_rows(torch.tensor([[1.0, 3.0], [0.0, 1e20]]), "layer_norm", 1e-5)
        >>> xhat[0].tolist(), bool(xhat[1].isnan().all())
        ([-0.9999949932098389, 0.9999949932098389], True)
    """
    if norm == "layer_norm":
        var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
        rstd = torch.rsqrt(var + eps) + (var - var)
        return (x - mean) * rstd, rstd
    if norm == "rms_norm":
        ms = (x * x).mean(-1, keepdim=True)
        rstd = torch.rsqrt(ms + eps) + (ms - ms)
        return x * rstd, rstd
    return x, None


def apply_activation(t: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """The activation in torch ops (the spelling an eager model uses)."""
    if activation == "tanh":
        return torch.tanh(t)
    if activation == "sigmoid":
        return torch.sigmoid(t)
    if activation == "relu":
        return torch.relu(t)
    if activation == "gelu":
        return F_.gelu(t)
    if activation == "gelu_tanh":
        return F_.gelu(t, approximate="tanh")
    if activation == "silu":
        return F_.silu(t)
    return t


def activation_grad(a: torch.Tensor, t: torch.Tensor, activation: Optional[str]):
    """d activation / da at `a`, given ``t = activation(a)``: the formulas the backward kernel
    uses, in torch ops (the composite backward's). relu's is 0 where a <= 0, else 1 (NaN too).

    Example:
        >>> a = torch.tensor([-1.0, 0.5])
        >>> activation_grad(a, torch.tanh(a), "tanh").tolist() == (1 - torch.tanh(a) ** 2).tolist()
        True
    """
    if activation == "tanh":
        return 1 - t * t
    if activation == "sigmoid":
        return t * (1 - t)
    if activation == "relu":
        return (~(a <= 0)).to(a.dtype)  # 1 at NaN, as torch's relu backward keeps grad there
    if activation == "gelu":
        return 0.5 * (1 + torch.erf(a * 0.7071067811865476)) + a * 0.3989422804014327 * torch.exp(-0.5 * a * a)
    if activation == "gelu_tanh":
        th = torch.tanh(0.7978845608028654 * (a + 0.044715 * a ** 3))
        return 0.5 * (1 + th) + 0.5 * a * (1 - th * th) * 0.7978845608028654 * (1 + 3 * 0.044715 * a * a)
    if activation == "silu":
        s = torch.sigmoid(a)
        return s * (1 + a * (1 - s))
    return torch.ones_like(a)
