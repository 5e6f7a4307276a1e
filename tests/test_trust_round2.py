"""Red-team round 2: "never a silent wrong answer". Each test compares the transformed model (or
FusedFeatureProcessor) with the untouched original, or checks the error that refuses the case."""
import copy

import pytest
import torch
from torch import nn

import recfuse
from recfuse.errors import RecfuseError

from fx_cases import D_ as D, F_, H_ as H, PerFeatureBase, ln_tanh_chain


chain, Base = ln_tanh_chain, PerFeatureBase


def assert_close(got, want, tol=1e-5):
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# -- type(x) checks in forward see the example value's type ----------------------------------


def is_plain_tensor(x):
    return type(x) == torch.Tensor  # a helper of the model's module: its `type` is patched too


class TypeCheck(Base):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def kind(self, x):
        return type(x) in (torch.Tensor,)

    def forward(self, x):
        if self.how == "is":
            plain = type(x) is torch.Tensor
        elif self.how == "helper":
            plain = is_plain_tensor(x)
        elif self.how == "method":
            plain = self.kind(x)
        else:
            plain = x.__class__ is torch.Tensor
        y = chain(self.lns, self.lin, x)
        return y * 2.0 if plain else y  # after the LayerNorm: a scale of x would be normalised away


@pytest.mark.parametrize("how", ["is", "helper", "method", "class"])
def test_type_check_takes_the_real_tensors_branch(how):
    torch.manual_seed(0)
    m = TypeCheck(how)
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D),))
    assert "ln_tanh_linear_relu" in gm.code
    x = torch.randn(5, F_ * D)
    assert_close(gm(x), m(x))


def plain_fn(x, lns, lin):
    y = chain(lns, lin, x)
    return y * 2.0 if type(x) is torch.Tensor else y


def test_type_check_in_a_function():
    torch.manual_seed(0)
    m = Base()
    gm = recfuse.transform(plain_fn, (torch.randn(3, F_ * D), m.lns, m.lin))
    x = torch.randn(5, F_ * D)
    assert_close(gm(x, m.lns, m.lin), plain_fn(x, m.lns, m.lin))


class IndexedTypeCheck(Base):
    # traceable without example values (no iteration over a proxy): the symbolic path
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        plain = {"isinstance": lambda: isinstance(x, torch.Tensor), "is_tensor": lambda: torch.is_tensor(x),
                 "type": lambda: type(x) is torch.Tensor, "class": lambda: x.__class__ is torch.Tensor}[self.how]()
        xs = x.split(D, 1)
        y = torch.relu(self.lin(torch.stack([torch.tanh(self.lns[i](xs[i])) for i in range(F_)], 1)))
        return y * 2.0 if plain else y


@pytest.mark.parametrize("how", ["isinstance", "is_tensor", "type", "class"])
def test_type_check_without_example_inputs_is_refused(how):
    with pytest.raises(RecfuseError, match="without example_inputs"):
        recfuse.transform(IndexedTypeCheck(how))
    # with example values the same model is captured and right
    torch.manual_seed(0)
    m = IndexedTypeCheck(how)
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D),))
    x = torch.randn(5, F_ * D)
    assert_close(gm(x), m(x))


def test_type_is_restored_after_capture():
    recfuse.transform(TypeCheck("helper"), (torch.randn(3, F_ * D),))
    assert "type" not in globals()
    assert is_plain_tensor(torch.randn(2)) and not is_plain_tensor(nn.Parameter(torch.randn(2)))


# -- the Dynamo capture path is guarded like Dynamo guards its own graphs -----------------------


class NeedsDynamo(Base):
    """`torch._check` in forward defeats torch.fx: captured by torch._dynamo.export."""

    def forward(self, x, n, extra=None):
        torch._check(x.shape[-1] % D == 0)
        y = chain(self.lns, self.lin, x)
        if x.shape[0] > 4:  # Dynamo follows the example's branch and records a condition
            y = y * 2
        if torch.is_grad_enabled():
            y = y + 1
        y = y * n
        return y if extra is None else y + extra


@pytest.fixture(scope="module")
def dynamo_captured():
    torch.manual_seed(0)
    m = NeedsDynamo()
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D), 2, None))
    assert gm.recfuse_report.capture.startswith("torch._dynamo")
    assert "ln_tanh_linear_relu" in gm.code
    return m, gm


def test_dynamo_capture_runs_other_batch_sizes_within_its_conditions(dynamo_captured):
    m, gm = dynamo_captured
    for b in (2, 3, 4):  # x.shape[0] > 4 stays False: the graph holds this code
        x = torch.randn(b, F_ * D)
        assert_close(gm(x, 2, None), m(x, 2))


@pytest.mark.parametrize("case", ["batch_8", "batch_1", "3d", "float64", "non_contiguous", "no_grad", "n", "extra"])
def test_dynamo_capture_refuses_calls_outside_its_conditions(dynamo_captured, case):
    m, gm = dynamo_captured
    x, n, extra = torch.randn(3, F_ * D), 2, None
    ctx = torch.enable_grad()
    if case == "batch_8":
        x = torch.randn(8, F_ * D)
    elif case == "batch_1":
        x = torch.randn(1, F_ * D)
    elif case == "3d":
        x = torch.randn(2, 3, F_ * D)
    elif case == "float64":
        x = x.double()
    elif case == "non_contiguous":
        x = torch.randn(F_ * D, 3).t()
    elif case == "no_grad":
        ctx = torch.no_grad()
    elif case == "n":
        n = 3
    else:
        extra = torch.ones(1)
    with ctx:
        try:
            got = gm(x, n, extra)
        except RecfuseError as e:
            assert "torch._dynamo.export" in str(e) and "condition" in str(e)
            return
        want = (m.double() if case == "float64" else m)(x, n, extra)
    # only reached where the captured graph is valid for the call
    assert case in ("non_contiguous",), f"{case}: not refused"
    assert_close(got, want)


def test_dynamo_capture_guard_survives_save_and_load(dynamo_captured):
    import io

    m, gm = dynamo_captured
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(4, F_ * D)
    assert_close(loaded(x, 2, None), m(x, 2))
    with pytest.raises(RecfuseError, match="torch._dynamo.export"):
        loaded(torch.randn(8, F_ * D), 2, None)


# -- tensors sharing storage (`param.detach()` buffers, views) stay shared ----------------------


class SharedStorage(Base):
    def __init__(self, how):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(H))
        if how == "detach":
            self.register_buffer("seen", self.scale.detach())
        elif how == "view":
            self.register_buffer("seen", self.scale.detach()[1:])
        else:  # a view of a per-feature LayerNorm weight, which fusion would stack
            self.register_buffer("seen", self.lns[0].weight.detach()[:H])
        self.register_buffer("unused_seen", self.lin.weight.detach())  # forward never reads it

    def forward(self, x):
        y = chain(self.lns, self.lin, x)
        return y * self.scale + (y[..., : self.seen.shape[0]] * self.seen).sum(-1, keepdim=True)


def sgd_step(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("how", ["detach", "view", "ln_weight"])
def test_storage_shared_with_a_parameter_follows_its_updates(how):
    torch.manual_seed(0)
    m = SharedStorage(how)
    gm = recfuse.transform(m, (torch.randn(3, F_ * D),))  # the model itself: deepcopy would separate them
    x = torch.randn(5, F_ * D)
    sgd_step(m, x)
    sgd_step(gm, x)
    x = torch.randn(5, F_ * D)
    assert_close(gm(x), m(x), tol=1e-4)  # after a step: a separated copy is off by 3-20
    sd = gm.state_dict()
    for name in ("seen", "unused_seen"):
        assert_close(sd[name], m.state_dict()[name])
