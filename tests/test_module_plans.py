"""FusedFeatureProcessor validates a call once per signature, and sees what changes the signature.

A call's plan (recfuse/module/plan.py) is built, and the call validated, the first time its
signature is seen: the input's kind, shapes, strides, dtype and device, and each parameter's
presence, shape, dtype and device. `fp._plans.validations` counts plans built. Every result is
compared with `forward_reference` of a float64 copy, which shares no plan.
"""
import copy
import pickle

import pytest
import torch
from torch import nn

from recfuse import FusedFeatureProcessor

from op_cases import randomized_ln_affine

NAMES = ["user", "item", "ctx", "hour", "geo"]
FP32_TOL = 1e-5
BF16_TOL = 1e-2


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def flat(y):
    if isinstance(y, dict):
        return torch.cat([y[k] for k in sorted(y)], dim=1)
    return y if isinstance(y, torch.Tensor) else y.values()


def to64(x):
    if isinstance(x, torch.Tensor):
        return x.double()
    if isinstance(x, dict):
        return {k: v.double() for k, v in x.items()}
    from torchrec.sparse.jagged_tensor import KeyedTensor

    return KeyedTensor(x.keys(), x.length_per_key(), x.values().double())


def assert_matches_float64(fp, x, tol=FP32_TOL, **kwargs):
    y = fp(x, **kwargs)
    y64 = copy.deepcopy(fp).double().forward_reference(to64(x), **kwargs)
    assert rel_err(flat(y), flat(y64)) < tol
    return y


def test_a_repeated_signature_is_validated_once():
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, 8, out_features=3))
    for _ in range(3):
        assert_matches_float64(fp, torch.randn(4, 40))
    assert fp._plans.validations == 1  # the float64 copies have their own (empty) caches
    fp.forward_reference(torch.randn(4, 40))  # the same validation serves the reference path
    assert fp._plans.validations == 1


@pytest.mark.parametrize(
    "first,second",
    [
        (torch.randn(4, 40), torch.randn(6, 40)),  # a new batch size
        (torch.randn(4, 40), torch.randn(4, 60)[:, 10:50]),  # same shape, other strides
        (torch.randn(4, 40), torch.randn(4, 40).bfloat16()),  # another dtype
        (torch.randn(4, 5, 8), torch.randn(5, 4, 8).transpose(0, 1)),  # a permuted 3D tensor
    ],
    ids=["shape", "stride", "dtype", "3d-stride"],
)
def test_a_new_shape_stride_or_dtype_is_validated_again(first, second):
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, 8, out_features=2, shared_linear=False))
    assert_matches_float64(fp, first)
    assert fp._plans.validations == 1
    tol = BF16_TOL if second.dtype == torch.bfloat16 else FP32_TOL
    y = assert_matches_float64(fp, second, tol=tol)
    assert y.dtype == second.dtype
    assert fp._plans.validations == 2
    assert_matches_float64(fp, first)  # both signatures stay planned
    assert_matches_float64(fp, second, tol=tol)
    assert fp._plans.validations == 2


def test_a_new_device_is_validated_again_with_the_ops_message():
    # CPU and meta are the devices here; the op itself does not run on meta, so the meta calls
    # are the first bad calls of their signatures, and must raise the op's message.
    fp = FusedFeatureProcessor(NAMES, 8, out_features=2)
    fp(torch.randn(4, 40))
    with pytest.raises(ValueError, match=r"weight is on cpu but x is on meta; move it with \.to\(x\.device\)"):
        fp(torch.randn(4, 40, device="meta"))
    assert_matches_float64(fp, torch.randn(4, 40))  # a failed validation leaves no plan behind
    assert fp._plans.validations == 1
    fp.to("meta")  # the same Parameter objects, moved: their device is in the signature
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu"):
        fp(torch.randn(4, 40))
    fp.to_empty(device="cpu")
    fp.reset_parameters()
    assert_matches_float64(fp, torch.randn(4, 40))
    assert fp._plans.validations == 1  # back on the CPU: the first plan applies again


def test_errors_of_a_new_signature_are_raised_on_its_first_call():
    fp = FusedFeatureProcessor(["a", "b", "c"], 8)
    fp(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"must be \[B, F, D\] with F=3 .* got shape \[2, 4, 8\]"):
        fp(torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match=r"D=8 last, got shape \[2, 3, 6\]"):
        fp(torch.randn(2, 3, 6))
    fp(torch.randn(2, 24))
    with pytest.raises(ValueError, match=r"input must be \[B, 24\] \(features a:8, b:8, c:8 side by side\), got shape \[2, 23\]"):
        fp(torch.randn(2, 23))
    good = {n: torch.randn(2, 8) for n in "abc"}
    fp(good)
    with pytest.raises(ValueError, match=r"feature 'c': batch size 3 differs from feature 'a'"):
        fp({**good, "c": torch.randn(3, 8)})
    with pytest.raises(ValueError, match=r"feature 'c': input dict value must be a \[B, D\] tensor, got list"):
        fp({**good, "c": [1.0] * 8})
    with pytest.raises(TypeError, match=r"x must be a floating tensor"):
        fp(torch.ones(2, 24, dtype=torch.int64))
    with pytest.raises(ValueError, match="feature_dim must be 0"):
        fp(torch.randn(2, 3, 8), feature_dim=[1])  # not hashable: validated, never cached


def test_a_replaced_parameter_is_used():
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, 8, out_features=2))
    x = torch.randn(4, 40)
    before = fp(x)
    fp.weight = nn.Parameter(torch.randn(2, 8))  # same shape: the plan holds, the call reads it
    after = assert_matches_float64(fp, x)
    assert rel_err(after, before) > 1e-3
    assert fp._plans.validations == 1
    fp.weight.data = torch.randn(2, 8)  # the same Parameter object, new data
    assert_matches_float64(fp, x)


def test_a_replaced_parameter_of_another_shape_is_validated_again():
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, 8, out_features=2))
    x = torch.randn(4, 40)
    fp(x)
    fp.weight = nn.Parameter(torch.randn(5, 3, 8))  # shared -> one Linear per feature, H 2 -> 3
    fp.bias = nn.Parameter(torch.randn(3))
    y = assert_matches_float64(fp, x)
    assert tuple(y.shape) == (4, 15) and fp._plans.validations == 2
    fp.bias = None  # a parameter removed: its presence is in the signature
    assert_matches_float64(fp, x)
    assert fp._plans.validations == 3
    fp.bias = nn.Parameter(torch.randn(5, 3))  # back, now one per feature
    assert_matches_float64(fp, x)
    assert fp._plans.validations == 4
    fp.weight = nn.Parameter(torch.randn(4, 3, 8))
    with pytest.raises(ValueError, match=r"weight must be \[F=5, H, D=8\] \(or \[H, D=8\]\), got shape \[4, 3, 8\]"):
        fp(x)
    fp.double()  # the same Parameter objects, converted in place: a new dtype
    fp.weight = nn.Parameter(torch.randn(5, 3, 8, dtype=torch.float64))
    assert fp(x.double()).dtype == torch.float64


def test_a_reordered_keyed_tensor_with_a_bad_parameter_gets_the_ops_message():
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import KeyedTensor

    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, 16, out_features=2, shared_linear=False))
    order = ["geo", "user", "hour", "item", "ctx"]  # per-feature rows are reordered to this
    kt = KeyedTensor(order, [16] * 5, torch.randn(6, 80))
    assert_matches_float64(fp, kt)
    fp.weight = nn.Parameter(torch.randn(4, 2, 16))
    # Named by the op's check, before index_select could fail on the missing row.
    with pytest.raises(ValueError, match=r"weight must be \[F=5, H, D=16\]"):
        fp(kt)


def test_a_plan_made_in_inference_mode_serves_a_training_call():
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import KeyedTensor

    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, 8, out_features=2, shared_linear=False))
    kt = KeyedTensor(NAMES[::-1], [8] * 5, torch.randn(3, 40))
    with torch.inference_mode():
        fp(kt)
    leaf = kt.values().clone().requires_grad_()
    y = fp(KeyedTensor(NAMES[::-1], [8] * 5, leaf))  # the kept plan's row index is saved for backward
    y.values().sum().backward()
    assert fp._plans.validations == 1
    fp64 = copy.deepcopy(fp).double()
    leaf64 = kt.values().double().requires_grad_()
    fp64.forward_reference(KeyedTensor(NAMES[::-1], [8] * 5, leaf64)).values().sum().backward()
    assert rel_err(leaf.grad, leaf64.grad) < FP32_TOL
    assert rel_err(fp.weight.grad, fp64.weight.grad) < FP32_TOL


@pytest.mark.parametrize("kind", ["buffer", "BFD", "FBD", "dict"])
def test_every_input_kind_is_planned_once_and_matches_float64(kind):
    dims = 8 if kind in ("BFD", "FBD") else [8, 4, 8, 8, 4]
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, dims, out_features=3, shared_linear=False))
    B = 5
    x = {
        "buffer": lambda: torch.randn(B, sum(fp.embedding_dims)),
        "BFD": lambda: torch.randn(B, 5, 8),
        "FBD": lambda: torch.randn(5, B, 8),
        "dict": lambda: {n: torch.randn(B, d) for n, d in reversed(list(zip(NAMES, fp.embedding_dims)))},
    }[kind]
    kwargs = {"feature_dim": 0} if kind == "FBD" else {}
    for _ in range(2):
        y = assert_matches_float64(fp, x(), **kwargs)
    assert fp._plans.validations == 1
    if kind == "dict":
        assert list(y) == NAMES[::-1]


def test_plans_are_bounded_and_start_empty_in_copies():
    fp = FusedFeatureProcessor(NAMES, 8, out_features=2)
    for B in range(1, 2 * fp._plans.max_plans):
        fp(torch.randn(B, 40))
    assert len(fp._plans) == fp._plans.max_plans
    clone = copy.deepcopy(fp)
    assert len(clone._plans) == 0
    restored = pickle.loads(pickle.dumps(fp))  # plans hold closures: they are not pickled
    assert len(restored._plans) == 0
    x = torch.randn(3, 40)
    assert torch.equal(restored(x), fp(x)) and torch.equal(clone(x), fp(x))
