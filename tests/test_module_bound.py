"""FusedFeatureProcessor's bound calls (recfuse/module/bound.py): a tensor input's call of a known
key skips the module's planning and the op's own checks, so whatever the key leaves out would be
served stale. Each test changes one thing between calls (shape, stride, alignment, dtype, a
parameter replaced or changed in place, requires_grad, grad mode, train/eval, eps) and checks that
the call gets a key of its own, is validated where its signature is new, and matches
`forward_reference` (values and gradients).
"""
import copy
import pickle

import pytest
import torch
from torch import nn

from recfuse import FusedFeatureProcessor
from recfuse.module.bound import BoundCall

NAMES = ["a", "b", "c", "d"]
F, D, H = 4, 8, 3
TOL = 1e-5


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(**kwargs) -> FusedFeatureProcessor:
    torch.manual_seed(0)
    fp = FusedFeatureProcessor(NAMES, kwargs.pop("dims", D), out_features=H, **kwargs)
    with torch.no_grad():
        for name, p in fp.named_parameters():
            if name.startswith("ln_"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "weight" in name else 0.0))
    return fp


def check(fp, x, tol=TOL, **kwargs):
    """fp(x) against forward_reference, twice (the second call is a bound call's)."""
    for _ in range(2):
        y = fp(x, **kwargs)
        ref = fp.forward_reference(x, **kwargs)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert rel_err(y, ref) < tol
    return y


def grads(fp, x, fn):
    for p in fp.parameters():
        p.grad = None
    if x.requires_grad:
        x.grad = None
    fn(x).square().sum().backward()
    return [None if t.grad is None else t.grad.clone() for t in [x, *fp.parameters()]]


def test_a_repeated_call_is_bound_once_and_validated_once():
    fp = make()
    x = torch.randn(5, F * D)
    check(fp, x)
    check(fp, torch.randn(5, F * D))  # other data, same key
    assert len(fp._bound) == 1 and fp._plans.validations == 1
    assert isinstance(next(iter(fp._bound._calls.values())), BoundCall)


@pytest.mark.parametrize("change", ["batch", "stride", "3d", "3d_fd0", "alignment", "bf16", "float64"])
def test_a_new_shape_stride_alignment_or_dtype_gets_its_own_bound_call(change):
    fp = make()
    check(fp, torch.randn(5, F * D))
    bound = len(fp._bound)
    if change == "batch":
        x = torch.randn(7, F * D)
    elif change == "stride":
        x = torch.randn(5, F * D + 3)[:, :F * D]  # a wider buffer's columns
    elif change == "3d":
        x = torch.randn(5, F, D)
    elif change == "3d_fd0":
        x = torch.randn(F, 5, D)
    elif change == "alignment":
        x = torch.randn(5 * F * D + 1)[1:].view(5, F * D)  # data pointer 4 bytes past 16
        assert x.data_ptr() % 16
    elif change == "bf16":
        x = torch.randn(5, F * D).bfloat16()
    else:
        x = torch.randn(5, F * D, dtype=torch.float64)
    kwargs = {"feature_dim": 0} if change == "3d_fd0" else {}
    check(fp, x, tol=1e-2 if change == "bf16" else TOL, **kwargs)
    assert len(fp._bound) == bound + 1
    if change != "alignment":  # a plan's signature has no alignment: same plan, new launch key
        assert fp._plans.validations == 2


def test_a_replaced_parameter_is_used_and_one_of_another_shape_is_validated():
    fp = make()
    x = torch.randn(5, F * D)
    check(fp, x)
    fp.weight = nn.Parameter(torch.randn(H, D))  # same shape: the same bound call, the new values
    check(fp, x)
    assert len(fp._bound) == 1
    fp.weight = nn.Parameter(torch.randn(F, H, D))  # per feature now: a new key, validated
    check(fp, x)
    assert len(fp._bound) == 2 and fp._plans.validations == 2
    fp.weight = nn.Parameter(torch.randn(F + 1, H, D))  # wrong: the op's message on this call
    with pytest.raises(ValueError, match="weight"):
        fp(x)
    fp.bias = None  # a parameter removed
    fp.weight = nn.Parameter(torch.randn(H, D))
    check(fp, x)


def test_a_parameter_changed_in_place_gets_a_new_key():
    fp = make()
    x = torch.randn(5, F * D)
    check(fp, x)
    with torch.no_grad():
        fp.ln_weight.data = torch.randn(F, D, dtype=torch.float64)  # .data swapped: dtype changes
    check(fp, x)  # cast to x's dtype per call (rows made per call)
    fp.ln_bias.data = torch.randn(D, F).t()  # the same shape with other strides
    check(fp, x)
    fp.double()  # module.to(dtype) changes the parameters in place
    check(fp, x)
    check(fp, x.double())
    assert len(fp._bound) == 5


def test_a_misaligned_parameter_gets_its_own_launch_key():
    fp = make()
    x = torch.randn(5, F * D)
    check(fp, x)
    fp.ln_weight.data = torch.randn(F * D + 1)[1:].view(F, D)
    assert fp.ln_weight.data_ptr() % 16
    check(fp, x)
    assert len(fp._bound) == 2


def test_requires_grad_flips_and_grad_mode_give_their_own_bound_calls():
    fp = make()
    x = torch.randn(5, F * D)
    with torch.no_grad():
        y = check(fp, x)
    assert not y.requires_grad
    y = check(fp, x)  # grad mode on, parameters require grad: an autograd call
    assert y.requires_grad
    xg = x.clone().requires_grad_(True)
    got = grads(fp, xg, fp)
    want = grads(fp, xg, fp.forward_reference)
    assert all(rel_err(g, w) < TOL for g, w in zip(got, want))
    fp.weight.requires_grad_(False)
    got = grads(fp, xg, fp)
    want = grads(fp, xg, fp.forward_reference)
    assert got[1] is None and want[1] is None
    assert all(g is None and w is None or rel_err(g, w) < TOL for g, w in zip(got, want))
    for p in fp.parameters():
        p.requires_grad_(False)
    y = check(fp, x)  # nothing requires grad: no autograd node
    assert not y.requires_grad
    assert len(fp._bound) == 5
    with torch.inference_mode():
        check(fp, x)
    assert fp._plans.validations == 1


def test_train_eval_and_eps_are_part_of_the_key():
    fp = make()
    x = torch.randn(5, F * D)
    check(fp, x)
    fp.eval()
    check(fp, x)
    fp.train()
    check(fp, x)
    assert len(fp._bound) == 2
    fp.eps = 0.5  # read at call time, as before
    y = check(fp, x)
    assert len(fp._bound) == 3
    fp.eps = 1e-5
    assert rel_err(fp(x), y) > 1e-3


@pytest.mark.parametrize("kwargs", [
    {"dims": [8, 4, 8, 4]},  # two dim groups: two op calls and a cat
    {"dims": [8, 8, 4, 8]},  # features of dim 8 unevenly spaced: a gather
    {"norm": "rms_norm", "activation": "silu", "out_activation": None, "eps": None},
    {"shared_linear": False, "shared_layer_norm": True, "bias": False},
])
def test_bound_calls_of_other_layouts_and_chains_match_the_reference(kwargs):
    fp = make(**kwargs)
    total = sum(fp.embedding_dims)
    for x in (torch.randn(5, total), torch.randn(6, total + 2)[:, 1:total + 1]):
        check(fp, x)
        xg = x.clone().requires_grad_(True)
        got, want = grads(fp, xg, fp), grads(fp, xg, fp.forward_reference)
        assert all(rel_err(g, w) < TOL for g, w in zip(got, want))
    bf = x.bfloat16()  # float32 parameters cast per call
    check(fp, bf, tol=2e-2)


def test_a_module_with_wrong_input_raises_every_time():
    fp = make()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"must be \[B, 32\]"):
            fp(torch.randn(5, 31))
    assert len(fp._bound) == 0


def test_bound_calls_start_empty_in_copies_and_pickles_and_old_pickles_load():
    fp = make()
    x = torch.randn(5, F * D)
    check(fp, x)
    for other in (copy.deepcopy(fp), pickle.loads(pickle.dumps(fp))):
        assert len(other._bound) == 0
        check(other, x)
    state = fp.__dict__.copy()
    del state["_bound"]  # as pickled by a version without bound calls
    old = FusedFeatureProcessor.__new__(FusedFeatureProcessor)
    old.__setstate__(state)
    check(old, x)


def test_hooks_still_run_and_autocast_takes_the_ops_path():
    fp = make()
    x = torch.randn(5, F * D)
    seen = []
    handle = fp.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    check(fp, x)
    assert seen == [torch.Size([5, F * H])] * 2
    handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp(x)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, fp.forward_reference(x)) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels' launch keys)")
@pytest.mark.parametrize("kwargs", [{}, {"dims": [16, 8, 16, 8]}, {"shared_linear": False},
                                    {"norm": "rms_norm", "activation": "silu", "out_activation": None, "eps": None}])
def test_bound_calls_on_cuda_match_the_reference(kwargs):
    kwargs.setdefault("dims", 16)
    fp = make(**kwargs).cuda()
    total = sum(fp.embedding_dims)
    for batch in (64, 33):
        for x in (torch.randn(batch, total, device="cuda"),
                  torch.randn(batch, total + 4, device="cuda")[:, 1:total + 1],  # misaligned, strided
                  torch.randn(batch, total, device="cuda").bfloat16()):
            tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-4
            check(fp, x, tol=tol)
            xg = x.clone().requires_grad_(True)
            for _ in range(2):
                got, want = grads(fp, xg, fp), grads(fp, xg, fp.forward_reference)
                assert all(rel_err(g, w) < 10 * tol for g, w in zip(got, want))
    with torch.no_grad():
        fp.eval()
        check(fp, x, tol=2e-2)


def test_keyed_tensor_inputs_are_bound_by_keys_and_lengths():
    KeyedTensor = pytest.importorskip("torchrec.sparse.jagged_tensor").KeyedTensor
    fp = make(dims=[8, 4, 8, 4])

    def kt(keys, lengths, values):
        return KeyedTensor(keys=list(keys), length_per_key=list(lengths), values=values)

    dims = dict(zip(NAMES, fp.embedding_dims))
    for keys in (NAMES, ["d", "a", "c", "b"]):  # module order, then another order
        lengths = [dims[k] for k in keys]
        for values in (torch.randn(5, 24), torch.randn(5, 26)[:, 1:25]):
            for _ in range(2):
                x = kt(keys, lengths, values)
                y, ref = fp(x), fp.forward_reference(x)
                assert y.keys() == list(keys) and y.length_per_key() == [H] * 4
                assert rel_err(y.values(), ref.values()) < TOL
            vg = values.clone().requires_grad_(True)
            got = grads(fp, vg, lambda v: fp(kt(keys, lengths, v)).values())
            want = grads(fp, vg, lambda v: fp.forward_reference(kt(keys, lengths, v)).values())
            assert all(rel_err(g, w) < TOL for g, w in zip(got, want))
    bound = len(fp._bound)
    assert bound >= 4 and fp._plans.validations >= 4
    # the same values under other lengths: a new key, validated, with the checks' message
    with pytest.raises(ValueError, match="embedding dim"):
        fp(kt(["d", "a", "c", "b"], [8, 4, 8, 4], torch.randn(5, 24)))
    with pytest.raises(ValueError):
        fp(kt(["a", "b", "c"], [8, 4, 8], torch.randn(5, 20)))
    assert len(fp._bound) == bound


@pytest.mark.interpret
def test_inference_on_a_buffer_writes_the_flat_output_directly_and_matches_the_reference():
    # No grad, one view of the buffer from its first element: the kept forward plan reads the
    # [B, F*D] buffer and writes y as [B, F*H] (no view, no flatten). Calls whose parameters are
    # made per call (cast, reordered) keep the general path.
    KeyedTensor = pytest.importorskip("torchrec.sparse.jagged_tensor").KeyedTensor
    from recfuse.ops import launch

    fp = make()
    wide = torch.randn(6, F * D + 5)
    cases = [
        ("contiguous", torch.randn(6, F * D), True),
        ("strided columns", wide[:, :F * D], True),
        ("bf16", torch.randn(6, F * D).bfloat16(), False),  # fp32 parameters cast per call: the general path
        ("keyed", KeyedTensor(keys=NAMES, length_per_key=[D] * F, values=wide[:, 5:]), True),
        # another key order: the per-feature LayerNorm rows are reordered per call, the general path
        ("keyed, reordered", KeyedTensor(keys=NAMES[::-1], length_per_key=[D] * F, values=wide[:, 5:]), False),
    ]
    with torch.no_grad():
        for label, x, flat in cases:
            ys, before = [], set(fp._bound._calls)
            with launch.trace_launches() as launches:
                for _ in range(3):  # the first call plans and keeps the forward plan, later ones take it
                    ys.append(fp(x))
            assert [kind for kind, *_ in launches] == ["forward"] * 3, label
            (bound,) = [b for k, b in fp._bound._calls.items() if k not in before]
            assert (bound.flat_y is not None) == flat, label
            ref = fp.forward_reference(x)
            tol = 2e-2 if label == "bf16" else TOL
            for y in ys:
                got, want = (y.values(), ref.values()) if label.startswith("keyed") else (y, ref)
                assert got.shape == want.shape and got.dtype == want.dtype, label
                assert rel_err(got, want) < tol, label
            if flat and not label.startswith("keyed"):
                assert ys[-1]._base is None and ys[-1].is_contiguous(), label  # written as [B, F*H]
    xg = cases[0][1].clone().requires_grad_(True)  # autograd calls keep the op's own path
    got, want = grads(fp, xg, fp), grads(fp, xg, fp.forward_reference)
    assert all(rel_err(g, w) < TOL for g, w in zip(got, want))
