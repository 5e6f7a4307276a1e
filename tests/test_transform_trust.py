"""The pass never gives a silent wrong answer: each case below was a wrong result, a crash or an
unclear error found by trying models nobody here wrote (issue "Never a silent wrong answer").

Every check compares the transformed model with the untouched original (a deep copy taken before
`transform`), or asserts a clear refusal.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from recfuse.errors import RecfuseError

from fx_cases import PerFeatureBase, count_recfuse, reloaded

B, NF, D, H = 5, 3, 8, 2
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max().clamp_min(1e-12))


def x_of(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def chain_slices(lns, x, d=D):
    return torch.stack([torch.tanh(ln(p)) for ln, p in zip(lns, x.split(d, 1))], 1)


def nontrivial_affine(m: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.copy_(torch.rand(mod.weight.shape, generator=g) + 0.5)
                mod.bias.copy_(torch.rand(mod.bias.shape, generator=g) - 0.5)
    return m


class PerFeatureLinear(PerFeatureBase):
    def __init__(self):
        super().__init__(NF, D, H, per_feature_linear=True)
        nontrivial_affine(self)

    def forward(self, x):
        return torch.stack([torch.relu(l(torch.tanh(ln(p)))) for ln, l, p in zip(self.lns, self.lins, x.split(D, 1))], 1)


def transform_changing_no_state(m: nn.Module, **options) -> nn.Module:
    """`recfuse.transform(m, (x,), **options)`, checked to change neither m's state (BatchNorm
    statistics, counters) nor the global RNG, and to give the fused model m's state values."""
    before = copy.deepcopy(m.state_dict())
    rng = torch.get_rng_state()
    fused = recfuse.transform(m, (x_of(B, NF * D),), **options)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in fused.state_dict().items():
        if k in before:
            assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    return fused


def assert_same_training(orig: nn.Module, fused: nn.Module, x: torch.Tensor, steps: int = 2) -> None:
    """Outputs, input gradients and the outputs after SGD steps agree (each model its own optimizer)."""
    opt_o = torch.optim.SGD([p for p in orig.parameters() if p.requires_grad], lr=0.5)
    opt_f = torch.optim.SGD([p for p in fused.parameters() if p.requires_grad], lr=0.5)
    for _ in range(steps):
        xo, xf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        yo, yf = orig(xo), fused(xf)
        assert rel(yf, yo) < TOL
        cot = x_of(*yo.shape, seed=3)
        (yo * cot).sum().backward()
        (yf * cot).sum().backward()
        assert rel(xf.grad, xo.grad) < 1e-4
        opt_o.step(); opt_f.step(); opt_o.zero_grad(); opt_f.zero_grad()
    assert rel(fused(x), orig(x)) < 1e-4


# -- 2: in-place ops whose return value is unused ------------------------------------------------


class InplaceAfterStack(PerFeatureBase):
    def __init__(self, spelling):
        super().__init__(NF, D, H)
        self.spelling = spelling
        nontrivial_affine(self)

    def forward(self, x):
        hs = []
        for ln, p in zip(self.lns, x.split(D, 1)):
            h = ln(p)
            if self.spelling == "tanh_":
                h.tanh_()
                hs.append(h)
            else:
                hs.append(torch.tanh(h))
        y = self.lin(torch.stack(hs, 1))
        if self.spelling == "relu_":
            torch.relu_(y)
        elif self.spelling == "clamp_":
            y.clamp_(min=0.0, max=0.3)
        elif self.spelling == "add_":
            y.add_(1.0)
        elif self.spelling == "chain":
            y.add_(1.0)
            y.mul_(3.0)
            torch.relu_(y)
        return y * 2


@pytest.mark.parametrize("spelling", ["relu_", "tanh_", "clamp_", "add_", "chain"])
def test_inplace_ops_with_unused_results_are_kept(spelling):
    m = InplaceAfterStack(spelling)
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    assert fused.recfuse_report.groups, fused.recfuse_report.summary()
    assert_same_training(copy.deepcopy(m), fused, x)


def test_inplace_on_an_input_is_kept_and_the_graph_left_unfused():
    class MutatesInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(NF)])

        def forward(self, x):
            x.mul_(2.0)
            return chain_slices(self.lns, x)

    m = MutatesInput()
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x.clone(),))
    assert not fused.recfuse_report.groups and "in-place" in fused.recfuse_report.reason
    x1, x2 = x.clone(), x.clone()
    assert rel(fused(x1), m(x2)) < TOL
    assert torch.equal(x1, x2)  # the caller's tensor is changed the same way


# -- 3: transform leaves the model's state alone -------------------------------------------------


class WithBatchNorm(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(NF)])
        self.lin = nn.Linear(D, H)
        self.bn = nn.BatchNorm1d(NF, momentum=momentum)
        nontrivial_affine(self)

    def forward(self, x):
        return self.bn(torch.relu(self.lin(chain_slices(self.lns, x))).sum(-1))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_transform_in_train_mode_changes_no_state(momentum):
    m = WithBatchNorm(momentum).train()
    fused = transform_changing_no_state(m)
    x = x_of(B, NF * D, seed=5)
    assert rel(fused(x), m(x)) < TOL  # train mode: updates the statistics the same way
    assert torch.equal(fused.state_dict()["bn.running_mean"], m.state_dict()["bn.running_mean"])
    fused.eval(); m.eval()
    assert rel(fused(x), m(x)) < TOL


# -- 4: frozen per-feature parameters stay frozen -------------------------------------------------


@pytest.mark.parametrize("frozen", ["lns.1.weight", "lins.0.weight", "lins.2.bias"])
def test_a_frozen_feature_parameter_stays_frozen(frozen):
    m = PerFeatureLinear()
    m.get_parameter(frozen).requires_grad_(False)
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    assert count_recfuse(fused) == 1
    names = {n for n, p in fused.named_parameters() if not p.requires_grad}
    assert names == {frozen}
    value = m.get_parameter(frozen).detach().clone()
    assert_same_training(copy.deepcopy(m), fused, x)
    assert torch.equal(fused.get_parameter(frozen), value)
    assert torch.equal(fused.state_dict()[frozen], value)


def test_all_frozen_rows_stack_into_a_frozen_parameter():
    m = PerFeatureLinear()
    for ln in m.lns:
        ln.weight.requires_grad_(False)
    fused = recfuse.transform(m, (x_of(B, NF * D),))
    stacked = [n for n, olds in fused._recfuse_stacked.items() if olds[0] == "lns.0.weight"]
    assert stacked and not fused.get_parameter(stacked[0]).requires_grad


# -- 5: train/eval mode after transform ----------------------------------------------------------


class FunctionalDropout(nn.Module):
    def __init__(self, module_dropout: bool):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(NF)])
        self.lin = nn.Linear(D, H)
        self.drop = nn.Dropout(0.5) if module_dropout else None

    def forward(self, x):
        y = torch.relu(self.lin(chain_slices(self.lns, x)))
        return self.drop(y) if self.drop is not None else F.dropout(y, 0.5, training=self.training)


@pytest.mark.parametrize("module_dropout", [False, True])
@pytest.mark.parametrize("transform_mode", ["train", "eval"])
def test_train_and_eval_switch_after_transform(module_dropout, transform_mode):
    m = FunctionalDropout(module_dropout)
    getattr(m, transform_mode)()
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    assert count_recfuse(fused) == 1
    fused.eval(); m.eval()
    assert rel(fused(x), m(x)) < TOL
    fused.train(); m.train()
    torch.manual_seed(0); yf = fused(x)
    torch.manual_seed(0); yo = m(x)
    assert rel(yf, yo) < TOL  # the same dropout mask: the same op on the same RNG stream
    assert (yf == 0).sum() > (fused.eval()(x) == 0).sum()


class BranchesOnTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(NF)])

    def forward(self, x):
        y = chain_slices(self.lns, x)
        if self.training:
            y = y * 2
        return y


def test_a_branch_on_training_is_guarded():
    m = BranchesOnTraining().train()
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    assert rel(fused(x), m(x)) < TOL
    fused.eval()
    with pytest.raises(RecfuseError, match="transformed in train mode.*self.training"):
        fused(x)


def test_dynamo_capture_keeps_state_dict_and_refuses_the_other_mode():
    class NeedsDynamo(PerFeatureBase):
        """`torch._check` in forward: torch.fx fails on it, so capture falls back to Dynamo."""

        def __init__(self):
            super().__init__(NF, D, H)
            self.bn = nn.BatchNorm1d(NF)

        def forward(self, x):
            parts = x.split(D, 1)
            for p in parts:
                torch._check(p.shape[1] == D)
            y = torch.relu(self.lin(torch.stack([torch.tanh(ln(p)) for ln, p in zip(self.lns, parts)], 1)))
            return self.bn(y.sum(-1))

    m = NeedsDynamo().train()
    x = x_of(B, NF * D)
    before = copy.deepcopy(m.state_dict())
    fused = recfuse.transform(m, (x,))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    fused.load_state_dict(m.state_dict(), strict=True)
    assert "bn.num_batches_tracked" in fused.state_dict()
    assert rel(fused(x), m(x)) < TOL
    if fused.recfuse_report.capture.startswith("torch._dynamo"):
        fused.eval()
        with pytest.raises(RecfuseError, match="train mode"):
            fused(x)


# -- 6 is an op-level item (tests/test_op_trust.py) --------------------------------------------
# -- 7: dict inputs iterated in a different order ------------------------------------------------


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleDict({k: nn.LayerNorm(D) for k in "abc"})
        self.lin = nn.Linear(D, H)

    def forward(self, d):
        return torch.relu(self.lin(torch.stack([torch.tanh(self.lns[k](v)) for k, v in d.items()], 1)))


def test_dict_input_in_another_key_order_is_refused_not_reordered():
    m = DictModel()
    d = {k: x_of(B, D, seed=i) for i, k in enumerate("abc")}
    fused = recfuse.transform(m, (d,))
    assert count_recfuse(fused) == 1
    assert rel(fused(d), m(d)) < TOL
    assert rel(fused(dict(d)), m(dict(d))) < TOL
    with pytest.raises(RecfuseError, match=r"order \['c', 'a', 'b'\]"):
        fused({k: d[k] for k in "cab"})


def test_dict_input_read_by_name_accepts_any_order():
    class ByName(DictModel):
        def forward(self, d):
            return torch.relu(self.lin(torch.stack([torch.tanh(self.lns[k](d[k])) for k in "abc"], 1)))

    m = ByName()
    d = {k: x_of(B, D, seed=i) for i, k in enumerate("abc")}
    fused = recfuse.transform(m, (d,))
    shuffled = {k: d[k] for k in "cab"}
    assert rel(fused(shuffled), m(shuffled)) < TOL


# -- 8: buffers read in forward ------------------------------------------------------------------


def test_a_buffer_read_in_forward():
    class Scaled(PerFeatureBase):
        def __init__(self):
            super().__init__(NF, D, H)
            self.register_buffer("scale", torch.tensor([2.0, -1.0]))

        def forward(self, x):
            return torch.relu(self.lin(chain_slices(self.lns, x))) * self.scale

    m = Scaled()
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    assert count_recfuse(fused) == 1
    assert_same_training(copy.deepcopy(m), fused, x)
    fused.load_state_dict(m.state_dict(), strict=True)


# -- 9 and 12: save/load and deepcopy ------------------------------------------------------------



@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("how", ["save_load", "deepcopy"])
def test_saved_and_copied_modules_keep_results_report_and_state_dict_mapping(how, cuda_graph):
    m = PerFeatureLinear()
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,), cuda_graph=cuda_graph)
    other = reloaded(fused) if how == "save_load" else copy.deepcopy(fused)
    assert type(other).__mro__[1] is type(fused).__mro__[1]
    assert rel(other(x), m(x)) < TOL
    assert other.recfuse_report.groups[0].ops == fused.recfuse_report.groups[0].ops
    fresh = PerFeatureLinear()
    other.load_state_dict(fresh.state_dict(), strict=True)  # original keys -> stacked rows
    assert rel(other(x), fresh(x)) < TOL
    assert_same_training(copy.deepcopy(fresh), other, x)


def test_save_load_of_a_transformed_function_with_a_module_argument():
    from recfuse.puzzler import split_stack

    lin = nn.Linear(D, 1)
    x = x_of(B * NF * D)
    fused = recfuse.transform(split_stack, (x, B, D, lin))
    again = reloaded(fused)
    assert rel(again(x), split_stack(x, B, D, lin)) < TOL


# -- 10: plain functions calling global modules --------------------------------------------------

GLOBAL_LINEAR = nn.Linear(D, 1)


def puzzler_with_a_global(input_data, batch_size, input_dim):
    x = input_data.view(batch_size, -1)
    slices = torch.split(x, input_dim, dim=1)
    stacked = torch.stack([torch.tanh(F.layer_norm(s, (input_dim,), eps=0.0)) for s in slices])
    return torch.relu(GLOBAL_LINEAR(stacked))


def test_a_function_calling_a_global_module_is_fused_and_owns_a_copy():
    x = x_of(B * NF * D)
    before = copy.deepcopy(GLOBAL_LINEAR.state_dict())
    fused = recfuse.transform(puzzler_with_a_global, (x, B, D))
    assert count_recfuse(fused) == 1
    assert rel(fused(x), puzzler_with_a_global(x, B, D)) < TOL
    fused(x).sum().backward()
    torch.optim.SGD(fused.parameters(), lr=1.0).step()
    for k, v in GLOBAL_LINEAR.state_dict().items():
        assert torch.equal(v, before[k])


def test_a_function_constructing_a_module_inside_is_refused_clearly():
    def constructs(x):
        return nn.Linear(D, 1)(x)

    with pytest.raises(RecfuseError, match="constructed inside forward.*new on every call"):
        recfuse.transform(constructs, (x_of(B, D),))


# -- 13: transform of a transformed module -------------------------------------------------------


def test_transform_of_a_transformed_module():
    m = PerFeatureLinear()
    x = x_of(B, NF * D)
    twice = recfuse.transform(recfuse.transform(m, (x,)), (x,))
    assert rel(twice(x), m(x)) < TOL
    assert_same_training(copy.deepcopy(m), twice, x)


# -- 14: Parameter, ParameterList and ParameterDict attributes ----------------------------------


class ParameterAttributes(nn.Module):
    def __init__(self, iterate: bool):
        super().__init__()
        self.iterate = iterate
        self.w = nn.Parameter(x_of(H, D, seed=7))
        self.ln_weights = nn.ParameterList([nn.Parameter(torch.rand(D) + 0.5) for _ in range(NF)])
        self.extra = nn.ParameterDict({"bias": nn.Parameter(torch.full((H,), 0.1))})

    def forward(self, x):
        ws = list(self.ln_weights) if self.iterate else [self.ln_weights[i] for i in range(NF)]
        st = torch.stack([torch.tanh(F.layer_norm(p, (D,), w)) for w, p in zip(ws, x.split(D, 1))], 1)
        return torch.relu(F.linear(st, self.w, self.extra["bias"]))


@pytest.mark.parametrize("iterate", [False, True])
def test_parameter_attributes(iterate):
    m = ParameterAttributes(iterate)
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    assert count_recfuse(fused) == 1
    assert_same_training(copy.deepcopy(m), fused, x)


# -- 15: unclear errors ---------------------------------------------------------------------------


def test_a_bare_tensor_as_example_inputs_says_pass_a_tuple():
    with pytest.raises(TypeError, match=r"tuple.*pass \(x,\)"):
        recfuse.transform(PerFeatureLinear(), x_of(B, NF * D))


def test_embedding_dims_of_the_wrong_type():
    with pytest.raises(TypeError, match="embedding_dims must be an int.*got True"):
        recfuse.FusedFeatureProcessor(["a", "b"], embedding_dims=True, out_features=1)


# -- 16: mixed embedding dims --------------------------------------------------------------------


@pytest.mark.parametrize("dims", [[8, 8, 4, 4], [8, 4, 8, 4], [8, 8, 8, 4]])
def test_mixed_dims_fuse_each_equal_dim_group_vertically(dims):
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lns = nn.ModuleList([nn.LayerNorm(d) for d in dims])
            self.lins = nn.ModuleList([nn.Linear(d, H) for d in dims])
            nontrivial_affine(self)

        def forward(self, x):
            return torch.stack([torch.relu(l(torch.tanh(ln(p)))) for ln, l, p in zip(self.lns, self.lins, x.split(dims, 1))], 1)

    m = Mixed()
    x = x_of(B, sum(dims))
    fused = recfuse.transform(m, (x,))
    groups = [d for d in dims if dims.count(d) >= 2]
    assert count_recfuse(fused) == len(set(groups))
    assert "also used by" not in str(fused.recfuse_report)
    assert_same_training(copy.deepcopy(m), fused, x)


# -- verify itself changes nothing -----------------------------------------------------------------


def test_verify_in_train_mode_with_dropout_and_batchnorm_changes_no_state():
    class DropBN(WithBatchNorm):
        def forward(self, x):
            return F.dropout(super().forward(x), 0.3, training=self.training)

    m = DropBN().train()
    transform_changing_no_state(m, verify=True)


def test_keyed_jagged_tensor_model_with_parameter_attributes():
    torchrec = pytest.importorskip("torchrec")
    names = ["a", "b", "c"]

    class Ranker(nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = torchrec.EmbeddingBagCollection(tables=[
                torchrec.EmbeddingBagConfig(name=f"t_{n}", embedding_dim=D, num_embeddings=10, feature_names=[n])
                for n in names], device=torch.device("cpu"))
            self.ln_weights = nn.ParameterList([nn.Parameter(torch.rand(D) + 0.5) for _ in names])
            self.w = nn.Parameter(x_of(H, D, seed=8))

        def forward(self, kjt):
            d = self.ebc(kjt).to_dict()
            st = torch.stack([torch.tanh(F.layer_norm(d[n], (D,), self.ln_weights[i])) for i, n in enumerate(names)], 1)
            return torch.relu(F.linear(st, self.w))

    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=names, values=torch.randint(0, 10, (9,), generator=torch.Generator().manual_seed(0)),
        lengths=torch.tensor([1, 2, 0, 1, 1, 1, 2, 0, 1]))
    m = Ranker()
    fused = recfuse.transform(m, (kjt,))
    assert count_recfuse(fused) == 1
    assert rel(fused(kjt), m(kjt)) < TOL
    ref = copy.deepcopy(m)
    fused(kjt).sum().backward()
    ref(kjt).sum().backward()
    for name, p in ref.named_parameters():
        if name in dict(fused.named_parameters()):
            assert rel(dict(fused.named_parameters())[name].grad, p.grad) < 1e-4, name


def test_transformed_model_under_bf16_autocast_matches_the_original_dtype():
    m = PerFeatureLinear()
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yo, yf = m(x), fused(x)
    assert yf.dtype == yo.dtype == torch.bfloat16
    assert rel(yf.float(), yo.float()) < 2e-2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused(x).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in fused.parameters())


# -- hooks: a fused module would not run them, a new parameter would not get their gradients --------


def test_forward_hooks_on_a_per_feature_module_keep_it_unfused():
    m = PerFeatureLinear()
    seen = []
    m.lns[1].register_forward_hook(lambda mod, inp, out: seen.append(out.detach().clone()))
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    ref = copy.deepcopy(m)
    seen.clear()
    y = fused(x)
    assert len(seen) == 1 and rel(seen[0], ref.lns[1](x[:, D:2 * D])) < TOL
    assert rel(y, ref(x)) < TOL


def test_gradient_hooks_on_per_feature_parameters_keep_firing():
    m = PerFeatureLinear()
    ref = copy.deepcopy(m)  # deepcopy drops tensor hooks: register them on both
    for model in (m, ref):
        for lin in model.lins:
            lin.weight.register_hook(lambda g: g * 0.5)  # e.g. a scaled or clipped gradient
        model.lns[0].bias.register_hook(lambda g: g * 3.0)
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    assert count_recfuse(fused) == 1
    fused(x).sum().backward()
    m(x).sum().backward()
    for name in ("lins.0.weight", "lins.2.weight", "lns.0.bias"):
        assert rel(fused.get_parameter(name).grad, m.get_parameter(name).grad) < 1e-5, name
    for p in list(fused.parameters()) + list(m.parameters()):
        p.grad = None
    assert_same_training(ref, fused, x)


def test_forward_hooks_on_the_model_run_on_the_result():
    m = PerFeatureLinear()
    calls = []
    m.register_forward_hook(lambda mod, inp, out: calls.append(out.shape))
    x = x_of(B, NF * D)
    fused = recfuse.transform(m, (x,))
    calls.clear()
    fused(x)
    assert calls == [torch.Size([B, NF, H])]


def test_save_load_of_a_model_with_string_annotations():
    from recfuse.puzzler import SplitStack  # its module uses `from __future__ import annotations`

    m = SplitStack(D, 1)
    x = x_of(B * NF * D)
    again = reloaded(recfuse.transform(m, (x, B, D)))
    assert rel(again(x, B, D), m(x, B, D)) < TOL


class ManyFeatures(nn.Module):
    """The benchmark's per-feature model (benchmarks/transform_time.py) at a size the fast paths
    of capture (the model copy, the tracer's argument lowering) are exercised at scale."""

    def __init__(self, features: int, d: int = 4, h: int = 2):
        super().__init__()
        self.d = d
        self.lns = nn.ModuleList([nn.LayerNorm(d) for _ in range(features)])
        self.linear = nn.Linear(d, h)
        nontrivial_affine(self)

    def forward(self, x):
        return F.relu(self.linear(torch.stack([torch.tanh(ln(s)) for ln, s in zip(self.lns, x.split(self.d, 1))], 1)))


def test_a_model_of_many_features_matches_the_untouched_original():
    model = ManyFeatures(600)
    untouched = copy.deepcopy(model)
    x = x_of(3, 600 * 4)
    fused = recfuse.transform(model, (x,))
    assert len(fused.recfuse_report.groups) == 1
    for (name, p), (_, q) in zip(model.state_dict(keep_vars=True).items(), untouched.state_dict().items()):
        assert torch.equal(p, q), name
    assert not {id(p) for p in fused.parameters()} & {id(p) for p in model.parameters()}
    x2 = x_of(4, 600 * 4, seed=1)
    assert rel(fused(x2), untouched(x2)) < TOL
    fused.load_state_dict(untouched.state_dict())
    assert rel(fused(x2), untouched(x2)) < TOL


def test_the_fast_model_copy_equals_copy_deepcopy():
    from recfuse.fx.capture import deepcopy_module

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.items, self.t, self.lin = [1, 2], torch.ones(3), nn.Linear(2, 2)
            self.alias = self.lin
            self.register_buffer("b", torch.zeros(2), persistent=False)
            self.lin.register_forward_hook(lambda *a: None)

    def describe(m):
        out = []
        for name, mod in m.named_modules(remove_duplicate=False):
            d = {}
            for k, v in mod.__dict__.items():
                if k in ("_parameters", "_buffers"):
                    d[k] = {n: None if t is None else (type(t), t.requires_grad, t.tolist()) for n, t in v.items()}
                elif k == "_modules":
                    d[k] = list(v)
                elif isinstance(v, torch.Tensor):
                    d[k] = v.tolist()
                elif isinstance(v, (dict, set)):
                    d[k] = (type(v), len(v))
                else:
                    d[k] = v if not callable(v) else type(v)
            out.append((name, type(mod), d))
        return out

    seq = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(), nn.Embedding(5, 3),
                        nn.ModuleDict({"a": nn.LayerNorm(3)}))
    seq[0].weight.requires_grad_(False)
    seq[4]["a"].weight = seq[3].weight  # tied across modules
    for m in (seq, Odd(), nn.TransformerEncoderLayer(8, 2)):
        a, b = copy.deepcopy(m), deepcopy_module(m)
        assert describe(a) == describe(b)
        assert not {id(t) for t in m.parameters()} & {id(t) for t in b.parameters()}
    b = deepcopy_module(seq)
    assert b[4]["a"].weight is b[3].weight
