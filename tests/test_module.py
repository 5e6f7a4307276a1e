"""FusedFeatureProcessor: every input kind against the per-slice path and a float64 oracle.

The oracle is `forward_reference` on a float64 copy of the module: it looks each feature up by
name and runs `recfuse.reference` on that one [B, D] slice with that feature's own parameters, so
it shares none of the fused path's grouping, strided views, parameter reordering or reassembly.
"""
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import recfuse
from recfuse import FusedFeatureProcessor

from op_cases import randomized_ln_affine

FP32_TOL = 1e-5  # DESIGN.md: ||out - ref|| / ||ref|| for float32
BF16_TOL = 1e-2

NAMES = ["user", "item", "ctx", "hour", "geo"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class OpRecorder(TorchDispatchMode):
    """Records every call of the fused op (its forward), with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.recfuse.ln_tanh_linear_relu.default:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# input kinds: build, convert to another dtype with fresh leaves, flatten the output


def make_input(kind: str, fp: FusedFeatureProcessor, B: int, order=None):
    """An input of `kind` for `fp` with random values; `order` permutes dict/KeyedTensor keys."""
    names = list(fp.feature_names)
    dims = dict(zip(names, fp.embedding_dims))
    order = names if order is None else order
    if kind == "buffer":
        return torch.randn(B, sum(fp.embedding_dims))
    if kind == "BFD":
        return torch.randn(B, len(names), fp.embedding_dims[0])
    if kind == "FBD":
        return torch.randn(len(names), B, fp.embedding_dims[0])
    if kind == "dict":
        return {n: torch.randn(B, dims[n]) for n in order}
    if kind == "keyed":
        from torchrec.sparse.jagged_tensor import KeyedTensor

        return KeyedTensor(list(order), [dims[n] for n in order], torch.randn(B, sum(dims[n] for n in order)))
    raise AssertionError(kind)


def with_leaves(x, dtype):
    """Same input in `dtype`, every tensor a fresh leaf requiring grad; returns (input, leaves)."""
    if isinstance(x, torch.Tensor):
        leaf = x.detach().to(dtype).requires_grad_()
        return leaf, [leaf]
    if isinstance(x, dict):
        out = {k: v.detach().to(dtype).requires_grad_() for k, v in x.items()}
        return out, list(out.values())
    from torchrec.sparse.jagged_tensor import KeyedTensor

    leaf = x.values().detach().to(dtype).requires_grad_()
    return KeyedTensor(x.keys(), x.length_per_key(), leaf), [leaf]


def flat(y) -> torch.Tensor:
    if isinstance(y, torch.Tensor):
        return y
    if isinstance(y, dict):
        return torch.cat([y[k] for k in sorted(y)], dim=1)
    return y.values()


def call(fp, x, kind, reference=False):
    fd = {"FBD": 0}.get(kind, 1)
    return (fp.forward_reference if reference else fp)(x, feature_dim=fd)


def check_against_float64(fp, x, kind, tol=FP32_TOL, grad_tol=FP32_TOL):
    """Fused forward+backward of `fp` vs forward_reference of a float64 copy: out, dx, dparams."""
    fp.zero_grad(set_to_none=True)
    fp64 = copy.deepcopy(fp).double()
    x_in, leaves = with_leaves(x, x.dtype if isinstance(x, torch.Tensor) else torch.float32)
    x64, leaves64 = with_leaves(x, torch.float64)
    y, y64 = call(fp, x_in, kind), call(fp64, x64, kind, reference=True)
    assert type(y) is type(y64)
    if isinstance(y, dict):
        assert list(y) == list(x_in)  # same keys, same order as the input
    if hasattr(y, "keys") and not isinstance(y, dict):
        assert y.keys() == x_in.keys() and y.length_per_key() == [fp.out_features] * len(y.keys())
    assert flat(y).dtype == leaves[0].dtype
    assert flat(y).shape == flat(y64).shape
    assert rel_err(flat(y), flat(y64)) < tol

    g = torch.randn_like(flat(y64))
    (flat(y) * g.to(flat(y).dtype)).sum().backward()
    (flat(y64) * g).sum().backward()
    for leaf, leaf64 in zip(leaves, leaves64):
        assert rel_err(leaf.grad, leaf64.grad) < grad_tol
    params64 = dict(fp64.named_parameters())
    for name, p in fp.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == p.dtype
        assert rel_err(p.grad, params64[name].grad) < grad_tol, name
    return y


# ---------------------------------------------------------------------------------------------
# numerics per input kind and configuration


@pytest.mark.parametrize("kind", ["buffer", "BFD", "FBD", "dict"])
@pytest.mark.parametrize("shared_linear", [True, False])
@pytest.mark.parametrize("shared_layer_norm,ln_affine", [(False, True), (True, True), (False, False)])
def test_single_dim_matches_float64(kind, shared_linear, shared_layer_norm, ln_affine):
    fp = randomized_ln_affine(
        FusedFeatureProcessor(
            NAMES, 16, out_features=3, shared_linear=shared_linear,
            shared_layer_norm=shared_layer_norm, ln_affine=ln_affine,
        )
    )
    check_against_float64(fp, make_input(kind, fp, B=7, order=NAMES[::-1]), kind)


def test_without_linear_bias_matches_float64():
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, 8, out_features=2, bias=False))
    assert fp.bias is None
    check_against_float64(fp, make_input("buffer", fp, B=6), "buffer")


@pytest.mark.parametrize("shared_linear", [True, False])
@pytest.mark.parametrize(
    "dims",
    [
        [8, 4, 8, 4, 8],  # interleaved, evenly spaced per dim: strided views, no copy
        [8, 8, 4, 8, 16],  # unevenly spaced 8s: gathered; a single-feature group of 16
    ],
)
def test_mixed_dims_match_float64(dims, shared_linear):
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, dims, out_features=2, shared_linear=shared_linear))
    for kind in ("buffer", "dict"):
        check_against_float64(fp, make_input(kind, fp, B=5, order=NAMES[::-1]), kind)


def test_shared_means_shared_within_a_dim_group():
    fp = FusedFeatureProcessor(NAMES, [8, 4, 8, 4, 8], out_features=2, shared_layer_norm=True)
    shapes = {n: tuple(p.shape) for n, p in fp.named_parameters()}
    assert shapes == {
        "weight_d8": (2, 8), "bias_d8": (2,), "ln_weight_d8": (8,), "ln_bias_d8": (8,),
        "weight_d4": (2, 4), "bias_d4": (2,), "ln_weight_d4": (4,), "ln_bias_d4": (4,),
    }


def test_bf16_input_with_fp32_params():
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, 32, out_features=4, shared_linear=False))
    x = torch.randn(64, 5 * 32).bfloat16()
    y = check_against_float64(fp, x, "buffer", tol=BF16_TOL, grad_tol=BF16_TOL)
    assert y.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in fp.parameters())


def test_fused_equals_per_slice_path_in_float32():
    """forward vs forward_reference in the same dtype (the documented verification pair)."""
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, [8, 4, 8, 4, 8], out_features=3, shared_linear=False))
    x = make_input("buffer", fp, B=9)
    assert rel_err(fp(x), fp.forward_reference(x)) < FP32_TOL


# ---------------------------------------------------------------------------------------------
# KeyedTensor (torchrec): name lookup in any key order


@pytest.mark.parametrize("dims", [16, [8, 4, 8, 4, 8]])
def test_keyed_tensor_in_any_key_order(dims):
    pytest.importorskip("torchrec")
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, dims, out_features=2, shared_linear=False))
    order = ["geo", "user", "hour", "item", "ctx"]
    kt = make_input("keyed", fp, B=6, order=order)
    y = check_against_float64(fp, kt, "keyed")
    # The same features in the module's own order give the same per-feature outputs.
    as_dict = kt.to_dict()
    y_dict = fp({n: as_dict[n] for n in NAMES})
    for n in NAMES:
        torch.testing.assert_close(y[n], y_dict[n], rtol=1e-6, atol=1e-6)


def test_keyed_tensor_values_are_read_in_place():
    pytest.importorskip("torchrec")
    fp = FusedFeatureProcessor(NAMES, 16, out_features=2)
    kt = make_input("keyed", fp, B=4, order=["item", "user", "geo", "ctx", "hour"])
    with OpRecorder() as rec:
        fp(kt)
    (x_arg, *_), = rec.calls
    assert x_arg.data_ptr() == kt.values().data_ptr()
    assert tuple(x_arg.shape) == (4, 5, 16) and x_arg.stride() == (80, 16, 1)


# ---------------------------------------------------------------------------------------------
# launches and copies


def test_buffer_is_viewed_not_copied():
    fp = FusedFeatureProcessor(NAMES, 16, out_features=3)
    base = torch.randn(4, 100)
    x = base[:, 10:90]  # a strided [B, F*D] window of a wider buffer
    with OpRecorder() as rec:
        y = fp(x)
    assert len(rec.calls) == 1
    x_arg, feature_dim = rec.calls[0][0], rec.calls[0][-1]
    assert feature_dim == 1 and tuple(x_arg.shape) == (4, 5, 16)
    assert x_arg.data_ptr() == x.data_ptr() and x_arg.stride() == (100, 16, 1)
    assert rel_err(y, fp.forward_reference(x)) < FP32_TOL


@pytest.mark.parametrize(
    "dims,expected_calls",
    [(16, 1), ([8, 4, 8, 4, 8], 2), ([8, 8, 4, 8, 16], 3), ([4, 5, 6, 7, 8], 5)],
)
def test_one_op_call_per_distinct_dim(dims, expected_calls):
    fp = FusedFeatureProcessor(NAMES, dims, out_features=2)
    x = make_input("buffer", fp, B=3)
    with OpRecorder() as rec:
        y = fp(x)
    assert len(rec.calls) == expected_calls
    assert rel_err(y, fp.forward_reference(x)) < FP32_TOL


def test_interleaved_dims_are_strided_views():
    fp = FusedFeatureProcessor(NAMES, [8, 4, 8, 4, 8], out_features=2)
    x = make_input("buffer", fp, B=3)
    with OpRecorder() as rec:
        fp(x)
    views = {tuple(args[0].shape): args[0] for args in rec.calls}
    assert views[(3, 3, 8)].data_ptr() == x.data_ptr() and views[(3, 3, 8)].stride() == (32, 12, 1)
    assert views[(3, 2, 4)].data_ptr() == x[:, 8:].data_ptr() and views[(3, 2, 4)].stride() == (32, 12, 1)


# ---------------------------------------------------------------------------------------------
# from_modules: swap a per-feature loop for the module and keep its results


class PerFeatureLoop(nn.Module):
    def __init__(self, names, dims, H, shared_linear):
        super().__init__()
        self.names = names
        self.ln = nn.ModuleDict({n: nn.LayerNorm(d) for n, d in zip(names, dims)})
        if shared_linear:
            self.linear = nn.Linear(dims[0], H)
        else:
            self.linear = nn.ModuleDict({n: nn.Linear(d, H) for n, d in zip(names, dims)})
        with torch.no_grad():
            for ln in self.ln.values():
                ln.weight.normal_(1.0, 0.3)
                ln.bias.normal_(0.0, 0.3)

    def forward(self, emb: dict):
        out = []
        for n in self.names:
            lin = self.linear if isinstance(self.linear, nn.Linear) else self.linear[n]
            out.append(torch.relu(lin(torch.tanh(self.ln[n](emb[n])))))
        return torch.cat(out, dim=1)


@pytest.mark.parametrize("shared_linear,dims", [(True, [8] * 5), (False, [8] * 5), (False, [8, 4, 8, 6, 4])])
def test_from_modules_matches_the_loop_in_float64(shared_linear, dims):
    loop = PerFeatureLoop(NAMES, dims, 3, shared_linear).double()
    fp = FusedFeatureProcessor.from_modules(loop.ln, loop.linear)
    assert fp.feature_names == tuple(NAMES)
    assert all(p.dtype == torch.float64 for p in fp.parameters())
    emb = {n: torch.randn(6, d, dtype=torch.float64) for n, d in zip(NAMES, dims)}
    y = fp(torch.cat([emb[n] for n in NAMES], dim=1))
    assert rel_err(y, loop(emb)) < 1e-12


def test_from_modules_lists_and_a_shared_layer_norm():
    lns = nn.ModuleList([nn.LayerNorm(8, eps=1e-3) for _ in range(3)])
    linears = [nn.Linear(8, 2) for _ in range(3)]
    fp = FusedFeatureProcessor.from_modules(lns, linears)
    assert fp.feature_names == ("0", "1", "2") and fp.eps == 1e-3 and not fp.shared_linear
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    ref = torch.stack([torch.relu(linears[f].double()(torch.tanh(lns[f].double()(x[:, f])))) for f in range(3)], 1)
    assert rel_err(fp.double()(x), ref) < 1e-12

    shared_ln, lin = nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 1, bias=False)
    fp = FusedFeatureProcessor.from_modules(shared_ln, lin, feature_names=["a", "b"])
    assert fp.ln_weight is None and fp.bias is None
    x = torch.randn(4, 16)
    ref = torch.cat([torch.relu(lin(torch.tanh(shared_ln(x[:, i * 8:(i + 1) * 8])))) for i in range(2)], 1)
    assert rel_err(fp(x), ref) < FP32_TOL


def test_from_modules_errors():
    with pytest.raises(ValueError, match="linear for feature 'b' has in_features=8 but its LayerNorm normalizes D=4"):
        FusedFeatureProcessor.from_modules({"a": nn.LayerNorm(8), "b": nn.LayerNorm(4)}, nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"layer_norms\['b'\] has eps=0.1"):
        FusedFeatureProcessor.from_modules({"a": nn.LayerNorm(8), "b": nn.LayerNorm(8, eps=0.1)}, nn.Linear(8, 2))
    with pytest.raises(ValueError, match="feature_names is required"):
        FusedFeatureProcessor.from_modules(nn.LayerNorm(8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"linear has keys \['a', 'c'\] but the features are \['a', 'b'\]"):
        FusedFeatureProcessor.from_modules(
            {"a": nn.LayerNorm(8), "b": nn.LayerNorm(8)}, {"a": nn.Linear(8, 2), "c": nn.Linear(8, 2)}
        )


# ---------------------------------------------------------------------------------------------
# errors name the feature, the argument and the shape


def test_input_errors_name_the_feature():
    fp = FusedFeatureProcessor(["a", "b", "c"], [8, 4, 8])
    x = {"a": torch.randn(2, 8), "b": torch.randn(2, 4), "c": torch.randn(2, 8)}
    with pytest.raises(ValueError, match=r"input dict has feature\(s\) \['zz'\] unknown"):
        fp({**x, "zz": torch.randn(2, 8)})
    with pytest.raises(ValueError, match=r"input dict is missing feature\(s\) \['b'\]"):
        fp({"a": x["a"], "c": x["c"]})
    with pytest.raises(ValueError, match=r"feature 'c': input dict has embedding dim 6 .* = 8"):
        fp({**x, "c": torch.randn(2, 6)})
    with pytest.raises(ValueError, match=r"feature 'b': batch size 3 differs from feature 'a'"):
        fp({**x, "b": torch.randn(3, 4)})
    with pytest.raises(ValueError, match=r"feature 'b': input dict value must be a \[B, D\] tensor, got \[2, 1, 4\]"):
        fp({**x, "b": torch.randn(2, 1, 4)})
    with pytest.raises(ValueError, match=r"input must be \[B, 20\] \(features a:8, b:4, c:8 side by side\), got shape \[2, 24\]"):
        fp(torch.randn(2, 24))
    with pytest.raises(ValueError, match=r"2D \[B, sum\(D\)\] or 3D .* got shape \[2, 2, 2, 20\] \(4D\)"):
        fp(torch.randn(2, 2, 2, 20))
    with pytest.raises(ValueError, match="3D input needs every feature to have one embedding dim"):
        fp(torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match="got list"):
        fp([torch.randn(2, 8)])


def test_stacked_input_errors_suggest_feature_dim():
    fp = FusedFeatureProcessor(["a", "b", "c"], 8)
    with pytest.raises(ValueError, match=r"must be \[B, F, D\] with F=3 .* got shape \[3, 5, 8\]; if it is \[F, B, D\], pass feature_dim=0"):
        fp(torch.randn(3, 5, 8))
    with pytest.raises(ValueError, match=r"D=8 last, got shape \[5, 3, 4\]"):
        fp(torch.randn(5, 3, 4))
    with pytest.raises(ValueError, match="feature_dim must be 0"):
        fp(torch.randn(5, 3, 8), feature_dim=2)


def test_keyed_tensor_errors_name_the_feature():
    pytest.importorskip("torchrec")
    from torchrec.sparse.jagged_tensor import KeyedTensor

    fp = FusedFeatureProcessor(["a", "b"], 8)
    with pytest.raises(ValueError, match=r"feature 'b': KeyedTensor has embedding dim 4"):
        fp(KeyedTensor(["b", "a"], [4, 8], torch.randn(2, 12)))
    with pytest.raises(ValueError, match=r"KeyedTensor has feature\(s\) \['c'\] unknown"):
        fp(KeyedTensor(["a", "b", "c"], [8, 8, 8], torch.randn(2, 24)))
    with pytest.raises(ValueError, match=r"KeyedTensor is missing feature\(s\) \['a'\]"):
        fp(KeyedTensor(["b"], [8], torch.randn(2, 8)))
    fp(KeyedTensor(["b", "a"], [8, 8], torch.randn(2, 16)))  # cache this layout, then break it
    with pytest.raises(ValueError, match=r"KeyedTensor must be \[B, 16\]"):
        fp(KeyedTensor(["b", "a"], [8, 8], torch.randn(2, 15)))


def test_config_errors():
    with pytest.raises(ValueError, match="embedding_dims has 2 entries but feature_names has 3"):
        FusedFeatureProcessor(["a", "b", "c"], [8, 8])
    with pytest.raises(ValueError, match=r"feature 'b': embedding dim must be an int >= 1, got 0"):
        FusedFeatureProcessor(["a", "b"], [8, 0])
    with pytest.raises(ValueError, match=r"duplicates \['a'\]"):
        FusedFeatureProcessor(["a", "b", "a"], 8)
    with pytest.raises(ValueError, match="out_features must be an int >= 1"):
        FusedFeatureProcessor(["a"], 8, out_features=0)
    with pytest.raises(TypeError, match="feature_names must be a list of str"):
        FusedFeatureProcessor("abc", 8)


# ---------------------------------------------------------------------------------------------
# parameters, state_dict, meta-device materialisation


def test_reset_parameters_initialises_every_parameter():
    torch.manual_seed(1)
    fp = FusedFeatureProcessor([f"f{i}" for i in range(64)], [64] * 64, out_features=8, shared_linear=False, device="meta")
    assert all(p.is_meta for p in fp.parameters())
    fp = fp.to_empty(device="cpu")
    with torch.no_grad():
        for p in fp.parameters():
            p.fill_(float("nan"))
    fp.reset_parameters()
    bound = 1 / 64 ** 0.5
    assert torch.equal(fp.ln_weight, torch.ones(64, 64)) and torch.equal(fp.ln_bias, torch.zeros(64, 64))
    for p in (fp.weight, fp.bias):  # uniform(-bound, bound): std bound/sqrt(3)
        assert p.abs().max() <= bound
        assert abs(p.std().item() - bound / 3 ** 0.5) < 0.05 * bound
    assert not torch.equal(fp.weight[0], fp.weight[1])  # features are initialised independently


@pytest.mark.parametrize("dims", [8, [8, 4, 8, 4, 8]])
def test_state_dict_round_trip(dims):
    a = randomized_ln_affine(FusedFeatureProcessor(NAMES, dims, out_features=2, shared_linear=False))
    b = FusedFeatureProcessor(NAMES, dims, out_features=2, shared_linear=False)
    x = make_input("buffer", a, B=4)
    assert rel_err(b(x), a(x)) > 1e-3  # different before loading
    b.load_state_dict(a.state_dict())
    assert torch.equal(b(x), a(x))
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        FusedFeatureProcessor(NAMES, 8, out_features=3, shared_linear=False).load_state_dict(
            FusedFeatureProcessor(NAMES, 8, out_features=2, shared_linear=False).state_dict()
        )


def test_feature_parameters_are_views_of_the_stacked_ones():
    fp = FusedFeatureProcessor(NAMES, [8, 4, 8, 4, 8], out_features=2, shared_linear=False)
    p = fp.feature_parameters("ctx")  # third feature, second of the dim-8 group
    assert p["weight"].data_ptr() == fp.weight_d8[1].data_ptr()
    assert p["ln_bias"].data_ptr() == fp.ln_bias_d8[1].data_ptr()
    with pytest.raises(KeyError, match="unknown feature 'zz'"):
        fp.feature_parameters("zz")


# ---------------------------------------------------------------------------------------------
# torch.compile and torch.export over a model containing the module


class TinyRanker(nn.Module):
    def __init__(self, names, dims, H):
        super().__init__()
        self.features = FusedFeatureProcessor(names, dims, out_features=H, shared_linear=False)
        self.over = nn.Linear(len(names) * H, 1)

    def forward(self, emb):
        return self.over(self.features(emb))

    def forward_reference(self, emb):
        return self.over(self.features.forward_reference(emb))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    model = TinyRanker(NAMES, [8, 4, 8, 4, 8], 2)
    randomized_ln_affine(model.features)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ref64 = copy.deepcopy(model).double()
    x = torch.randn(6, 32)
    y = compiled(x)
    y64 = ref64.forward_reference(x.double())
    assert rel_err(y, y64) < FP32_TOL
    y.sum().backward()
    y64.sum().backward()
    params64 = dict(ref64.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(p.grad, params64[name].grad) < FP32_TOL, name


def test_torch_compile_inductor_fullgraph():
    torch._dynamo.reset()
    model = TinyRanker(NAMES, 16, 2)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(6, 80)
    assert rel_err(compiled(x), model.double().forward_reference(x.double())) < FP32_TOL


def test_torch_export_keeps_one_fused_op_node():
    model = TinyRanker(NAMES, 16, 2)
    randomized_ln_affine(model.features)
    x = torch.randn(6, 80)
    ep = torch.export.export(model, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.recfuse.ln_tanh_linear_relu.default) == 1
    x2 = torch.randn(6, 80)
    assert rel_err(ep.module()(x2), copy.deepcopy(model).double().forward_reference(x2.double())) < FP32_TOL


# ---------------------------------------------------------------------------------------------
# cuda_graph=True (issue 7): no GPU here, so the argument handling and the CPU fallback; the
# replay rule with the module is in tests/test_cuda_graph.py.


def test_cuda_graph_flag_handling_and_cpu_fallback():
    with pytest.raises(TypeError, match="cuda_graph must be a bool, got 1"):
        FusedFeatureProcessor(NAMES, 8, cuda_graph=1)
    fp = randomized_ln_affine(FusedFeatureProcessor(NAMES, [8, 4, 8, 4, 8], out_features=2, cuda_graph=True))
    assert "cuda_graph=True" in repr(fp)
    x = make_input("buffer", fp, B=4)
    with torch.no_grad():
        y = fp(x)
    assert len(fp._cuda_graphs) == 0  # CPU input: the normal path
    assert rel_err(y, copy.deepcopy(fp).double().forward_reference(x.double())) < FP32_TOL
