"""Argument checks shared by the fused op, its reference and the module.

Every message names the argument, what was expected and what arrived, because a recommender model
has dozens of features and "shape mismatch" alone sends the user hunting.
"""
from __future__ import annotations

import numbers
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class OpShape:
    """Sizes of one `ln_tanh_linear_relu` call: F features, B rows each, D in, H out."""

    F: int
    B: int
    D: int
    H: int
    feature_dim: int
    per_feature_weight: bool

    def out_shape(self) -> tuple[int, int, int]:
        return (self.F, self.B, self.H) if self.feature_dim == 0 else (self.B, self.F, self.H)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _shape_is(t: torch.Tensor, *shapes: tuple) -> bool:
    """Whether t's shape is one of `shapes`, compared size by size with ``==``.

    Not ``tuple(t.shape) in shapes``: under torch.compile(dynamic=True) sizes are SymInts, and
    each size must be compared (and guarded) on its own, by rank first.
    """
    dims = t.dim()
    for shape in shapes:
        if dims == len(shape) and all(bool(a == b) for a, b in zip(t.shape, shape)):
            return True
    return False


def _check_strided(name: str, t: torch.Tensor) -> None:
    """Raise unless t is a dense (strided) tensor: a sparse or nested one has no shape and strides
    the op could read (it failed deep inside with "unsupported memory format" / "NestedTensorImpl
    doesn't support sizes")."""
    if t.is_nested or t.layout != torch.strided:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {kind} tensor; convert it first "
                        f"(.to_dense(), or torch.stack of a nested tensor's components)")


def check_not_negated(name: str, t: torch.Tensor) -> None:
    """Raise if t has its negative bit set (a lazily negated view: ``torch._neg_view``, the
    ``.imag`` of a conjugated complex tensor, or a copy of one by ``.contiguous()`` /
    ``nn.Parameter``): the flag lives outside the memory, which the compiled CPU path and the
    kernels read as it is (they gave the un-negated numbers)."""
    # Not while Dynamo traces (it cannot trace ``is_neg``, and the traced op runs the eager composite).
    if not torch.compiler.is_compiling() and t.is_neg():
        raise ValueError(f"{name} has its negative bit set (a lazily negated view, e.g. from torch._neg_view or "
                         f"the .imag of a conjugated complex tensor); materialize it first with "
                         f"{name}.resolve_neg()")


def _check_tensor(name: str, t, x: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_strided(name, t)
    check_not_negated(name, t)
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor (float32, bfloat16, float16, float64), got {t.dtype}")
    if t.dtype != x.dtype:
        raise TypeError(
            f"{name} has dtype {t.dtype} but x has dtype {x.dtype}; cast it with .to({x.dtype})"
        )
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; move it with .to(x.device)")


def check_feature_dim(feature_dim) -> None:
    """Raise unless `feature_dim` says which dim of a 3D tensor indexes features (0 or 1).

    Example:
        >>> check_feature_dim(2)
        Traceback (most recent call last):
        ...
        ValueError: feature_dim must be 0 ([F, B, D]) or 1 ([B, F, D]), got 2
    """
    # An integer (int, numpy or 0-dim integer tensor) 0 or 1: not a bool, and not 1.0, which
    # compares equal to 1 but cannot index a shape.
    integral = not isinstance(feature_dim, (bool, float)) and hasattr(type(feature_dim), "__index__")
    if not integral or feature_dim not in (0, 1):
        raise ValueError(f"feature_dim must be 0 ([F, B, D]) or 1 ([B, F, D]), got {feature_dim!r}")


def check_eps(eps, *, finite: bool = False) -> None:
    """Raise unless `eps` is a LayerNorm epsilon: an int or float >= 0 (NaN and bools refused).

    Example:
        >>> check_eps(-1.0)
        Traceback (most recent call last):
        ...
        ValueError: eps must be a float >= 0, got -1.0
    """
    # Any real number, as F.layer_norm takes: numpy scalars too (np.float32(1e-5), read from a
    # config, was refused as "eps must be a float >= 0, got np.float32(1e-05)"). A tensor is
    # refused by name: the op takes eps as a constant, and float() of a tensor would sync a GPU
    # (and break a compiled graph) on every call.
    if isinstance(eps, torch.Tensor):
        raise ValueError(f"eps must be a float >= 0, got a tensor ({eps!r}); pass a Python number, "
                         f"e.g. eps=float(eps)")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or eps != eps or eps < 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    if finite and eps == float("inf"):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


def check_op_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    ln_weight: Optional[torch.Tensor],
    ln_bias: Optional[torch.Tensor],
    eps: float,
    feature_dim: int,
) -> OpShape:
    """Validate the arguments of `ln_tanh_linear_relu` and return its sizes.

    Example:
        >>> import torch
        >>> check_op_args(torch.randn(3, 5, 8), torch.randn(2, 8), None, None, None, 1e-5, 0).H
        2
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_strided("x", x)
    check_not_negated("x", x)
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating tensor (float32, bfloat16, float16, float64), got {x.dtype}")
    check_feature_dim(feature_dim)
    if x.dim() != 3:
        layout = "[F, B, D]" if feature_dim == 0 else "[B, F, D]"
        hint = " (view a [B, F*D] tensor as x.view(B, F, D) and pass feature_dim=1)" if x.dim() == 2 else ""
        raise ValueError(f"x must be 3D {layout}, got shape {_shape(x)}{hint}")
    check_eps(eps)
    F = x.shape[feature_dim]
    B = x.shape[1 - feature_dim]
    D = x.shape[2]
    if D < 1:
        raise ValueError(f"x must have a feature size D >= 1 in its last dim, got shape {_shape(x)}")
    _check_tensor("weight", weight, x)
    if weight.dim() == 2:
        per_feature = False
        H = weight.shape[0]
        if weight.shape[1] != D:
            raise ValueError(f"weight must be [H, D={D}] (or [F={F}, H, D={D}]), got shape {_shape(weight)}")
    elif weight.dim() == 3:
        per_feature = True
        H = weight.shape[1]
        if weight.shape[0] != F or weight.shape[2] != D:
            raise ValueError(
                f"weight must be [F={F}, H, D={D}] (or [H, D={D}]), got shape {_shape(weight)}; "
                f"x {_shape(x)} has F={F} features (feature_dim={feature_dim}) of size D={D}"
            )
    else:
        raise ValueError(f"weight must be 2D [H, D] or 3D [F, H, D], got shape {_shape(weight)}")
    if H < 1:
        raise ValueError(f"weight must have at least one output row (H >= 1), got shape {_shape(weight)}")
    if bias is not None:
        _check_tensor("bias", bias, x)
        if not _shape_is(bias, (H,), (F, H)):
            raise ValueError(f"bias must be [H={H}] or [F={F}, H={H}], got shape {_shape(bias)}")
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is not None:
            _check_tensor(name, t, x)
            if not _shape_is(t, (D,), (F, D)):
                raise ValueError(f"{name} must be [D={D}] or [F={F}, D={D}], got shape {_shape(t)}")
    return OpShape(F=F, B=B, D=D, H=H, feature_dim=feature_dim, per_feature_weight=per_feature)


def check_chain_args(norm, activation, out_activation, ln_weight, ln_bias):
    """Validate a `feature_mlp` chain and its norm affine; returns the `Chain`.

    Example:
        >>> import torch
        >>> check_chain_args(None, "relu", None, torch.ones(8), None)
        Traceback (most recent call last):
        ...
        ValueError: ln_weight is given but norm=None: a norm's affine needs a norm ('layer_norm' or 'rms_norm')
    """
    from .chain import chain_of

    chain = chain_of(norm, activation, out_activation)
    if chain.norm is None:
        for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
            if t is not None:
                raise ValueError(f"{name} is given but norm=None: a norm's affine needs a norm "
                                 f"('layer_norm' or 'rms_norm')")
    return chain


def tensor_signature(t: Optional[torch.Tensor]):
    """What a kernel launch depends on in a tensor besides its data: shape, strides, dtype, device
    and the 16-byte alignment of its data pointer (Triton specialises pointers on it)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15


def stats_planes(stats) -> int:
    """What a training forward saved for its backward, as the backward plan's key: 0 (nothing), the
    planes of its row-stats tensor (2: mean and rstd; 2 + words with the relu mask, see
    `launch._relu_mask_words`), or -1 for the CPU compiled path's saved tensors (no launch plan
    reads them)."""
    if stats is None:
        return 0
    return stats.shape[0] if isinstance(stats, torch.Tensor) else -1


def call_signature(x, weight, bias, ln_weight, ln_bias, eps, feature_dim) -> tuple:
    """The key under which a call's validation and launch plan are cached: two calls with equal
    signatures differ only in their data. Real tensors only (fake tensors have no data pointer).

    Example:
        >>> import torch
        >>> x = torch.randn(2, 4, 8)
        >>> a = call_signature(x, torch.randn(1, 8), None, None, None, 1e-5, 0)
        >>> a == call_signature(x + 1, torch.randn(1, 8), None, None, None, 1e-5, 0)
        True
        >>> a == call_signature(x[:, :3], torch.randn(1, 8), None, None, None, 1e-5, 0)
        False
    """
    # The types too: True == 1 and 1.0 == 1 (same hash), but the checks refuse them where they
    # accept 1, so a call with feature_dim=True must not pass as one validated with 1.
    # `tensor_signature` of each tensor, written out: this runs on every call of the op, and five
    # calls of it were ~0.4 us of its ~2 us.
    # Each tensor's negative bit last (after the alignment, which `bound` reads at [4]): it lives
    # outside shape, strides and memory, and a neg-bit tensor must not pass as one validated
    # without it (`check_op_args` refuses it; the compiled path and kernels read raw memory).
    return ((x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, x.is_neg()),
            (weight.shape, weight.stride(), weight.dtype, weight.device, weight.data_ptr() & 15, weight.is_neg()),
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device, bias.data_ptr() & 15,
                                       bias.is_neg()),
            None if ln_weight is None else (ln_weight.shape, ln_weight.stride(), ln_weight.dtype, ln_weight.device,
                                            ln_weight.data_ptr() & 15, ln_weight.is_neg()),
            None if ln_bias is None else (ln_bias.shape, ln_bias.stride(), ln_bias.dtype, ln_bias.device,
                                          ln_bias.data_ptr() & 15, ln_bias.is_neg()),
            eps, type(eps), feature_dim, type(feature_dim))


class BoundedDict(dict):
    """A per-signature cache that starts over past `limit` entries: a server seeing every batch
    size from 1 to 100k keeps at most `limit` launch plans, not one per size ever seen. Lookups
    are plain dict lookups.

    Example:
        >>> cache = BoundedDict(limit=2)
        >>> cache[1], cache[2] = "a", "b"
        >>> cache[3] = "c"
        >>> sorted(cache)
        [3]
    """

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit
        # Called after every clear (an overflow's too): caches that hold this one's values (the
        # op's per-signature records hold launch plans) drop them with it.
        self.on_clear: list = []

    def __setitem__(self, key, value):
        if key not in self and len(self) >= self.limit:
            self.clear()
        super().__setitem__(key, value)

    def clear(self):
        super().clear()
        for hook in self.on_clear:
            hook()


class SignatureRecord:
    """What the op keeps per validated call signature: the signature, and the launch plans its
    calls took (None until a call of the signature has run one; dropped whenever the launch
    module's plan caches are cleared): ``fwd`` without saved stats, ``fwd_stats`` with them,
    ``bwd`` a ((grad_y signature, stats given), backward plan) pair, one attribute so that two
    threads never pair one's plan with the other's grad_y."""

    __slots__ = ("key", "fwd", "fwd_stats", "bwd", "__weakref__")

    def __init__(self, key: tuple):
        self.key = key
        self.fwd = self.fwd_stats = self.bwd = None

    def drop_plans(self) -> None:
        self.fwd = self.fwd_stats = self.bwd = None


class ValidatedSignatures:
    """Signatures whose arguments passed `check_op_args`: a call with a known signature skips the
    checks (they depend on nothing else), any other call is checked, with the same errors.
    Bounded: past `limit` signatures the set starts over. ``known`` maps each signature to its
    `SignatureRecord`.

    Example:
        >>> import torch
        >>> seen = ValidatedSignatures()
        >>> x, w = torch.randn(2, 4, 8), torch.randn(1, 8)
        >>> seen.check(x, w, None, None, None, 1e-5, 0) == seen.check(x, w, None, None, None, 1e-5, 0)
        True
        >>> seen.check(x, torch.randn(1, 7), None, None, None, 1e-5, 0)
        Traceback (most recent call last):
        ...
        ValueError: weight must be [H, D=8] (or [F=2, H, D=8]), got shape [1, 7]
    """

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.known: dict = {}
        # Every record alive, also those an overflow dropped from `known` while a caller holds
        # them (a module's bound call, an autograd node): `drop_plans` reaches them all.
        self.alive = weakref.WeakSet()

    def check(self, x, weight, bias, ln_weight, ln_bias, eps, feature_dim) -> Optional[tuple]:
        """The call's signature after validating it once (None if it has none: not all tensors)."""
        record = self.record(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
        return None if record is None else record.key

    def record(self, x, weight, bias, ln_weight, ln_bias, eps, feature_dim) -> Optional[SignatureRecord]:
        """The call's `SignatureRecord` after validating it once (None if it has no signature)."""
        try:
            key = call_signature(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
            record = self.known.get(key)
            if record is not None:
                return record
        except (AttributeError, TypeError, RuntimeError):  # not tensors: the checks say what is wrong
            key = None
        check_op_args(x, weight, bias, ln_weight, ln_bias, eps, feature_dim)
        return None if key is None else self.add(key)

    def add(self, key: tuple) -> SignatureRecord:
        """The record of `key`, a signature its caller has validated (`check_op_args`)."""
        record = self.known.get(key)
        if record is None:
            if len(self.known) >= self.limit:
                self.known.clear()
            record = self.known[key] = SignatureRecord(key)
            self.alive.add(record)
        return record

    def drop_plans(self) -> None:
        """Forget every record's launch plans (the launch module's plan caches were cleared)."""
        for record in list(self.alive):  # a copy: another thread may add one meanwhile
            record.drop_plans()
