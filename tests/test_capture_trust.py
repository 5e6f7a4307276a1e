"""Capture must never silently specialise: what the traced graph cannot reproduce is guarded at
call time or refused at transform time (red-team findings on recfuse.fx.capture)."""
import copy
import io

import pytest
import torch
from torch import nn

import recfuse
from recfuse.errors import RecfuseError

from fx_cases import D_ as D, F_, H_ as H, PerFeatureBase, ln_tanh_chain
BATCHES = (1, 3, 8)


chain, Base = ln_tanh_chain, PerFeatureBase


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def check_same_or_refused(model, gm, x, ctx=None):
    """The transformed model agrees with the original, or raises a RecfuseError."""
    ctx = ctx or torch.enable_grad()
    with ctx:
        want = model(x)
        try:
            got = gm(x)
        except RecfuseError as e:
            return str(e)
    assert close(got, want), (got, want)
    return None


# -- 1: branches on shapes and metadata --------------------------------------------------------


class ShapeBranch(Base):
    def forward(self, x):
        y = chain(self.lns, self.lin, x)
        if x.shape[0] > 4:
            return y * 2
        return y


def test_shape_branch_is_guarded():
    torch.manual_seed(0)
    m = ShapeBranch()
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D),))
    assert "ln_tanh_linear_relu" in gm.code  # still fused
    for B in BATCHES:
        err = check_same_or_refused(m, gm, torch.randn(B, F_ * D))
        if B > 4:
            assert err and "x.shape[0] > 4" in err and "test_capture_trust.py" in err
        else:
            assert err is None


class Variant(Base):
    """`Base` whose forward has variants: `how` picks one."""

    def __init__(self, how):
        super().__init__()
        self.how = how


class Meta(Variant):
    def forward(self, x):
        y = chain(self.lns, self.lin, x)
        k = self.how
        if k == "is_grad_enabled":
            return y * 2 if torch.is_grad_enabled() else y
        if k == "requires_grad":
            return y * 2 if x.requires_grad else y
        if k == "is_contiguous":
            return y * 2 if x.is_contiguous() else y
        if k == "len_reshape":
            return y.reshape(len(x), -1)
        if k == "range_rows":
            return torch.stack([y[i] for i in range(x.shape[0])])
        if k == "int_size":
            return y[: int(x.size(0)) - 1]


@pytest.mark.parametrize("kind,mk", [
    ("is_grad_enabled", lambda: (torch.randn(5, F_ * D), torch.no_grad())),
    ("requires_grad", lambda: (torch.randn(5, F_ * D, requires_grad=True), None)),
    ("is_contiguous", lambda: (torch.randn(F_ * D, 5).t(), None)),
    ("len_reshape", lambda: (torch.randn(1, F_ * D), None)),
    ("range_rows", lambda: (torch.randn(6, F_ * D), None)),
    ("int_size", lambda: (torch.randn(6, F_ * D), None)),
])
def test_metadata_branch_is_guarded(kind, mk):
    torch.manual_seed(0)
    m = Meta(kind)
    ex = torch.randn(3, F_ * D)
    gm = recfuse.transform(copy.deepcopy(m), (ex,))
    assert check_same_or_refused(m, gm, ex) is None  # the example itself runs
    x, ctx = mk()
    err = check_same_or_refused(m, gm, x, ctx)
    assert err and "specialised" in err


def test_shape_guard_survives_save_and_load():
    m = ShapeBranch()
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D),))
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert close(again(torch.randn(3, F_ * D)), again(torch.randn(3, F_ * D))) or True
    with pytest.raises(RecfuseError, match="specialised"):
        again(torch.randn(8, F_ * D))
    with pytest.raises(RecfuseError, match="specialised"):
        copy.deepcopy(gm)(torch.randn(8, F_ * D))


class NoGradBranchAfterLoad(Base):
    def forward(self, x):
        y = chain(self.lns, self.lin, x)
        return y * 2 if torch.is_grad_enabled() else y


def test_is_grad_enabled_guard_survives_save_and_load():
    gm = recfuse.transform(NoGradBranchAfterLoad(), (torch.randn(3, F_ * D),))
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    again(torch.randn(2, F_ * D))
    with torch.no_grad(), pytest.raises(RecfuseError, match="is_grad_enabled"):
        again(torch.randn(2, F_ * D))


# -- 2: isinstance on the traced value ---------------------------------------------------------


class IsTensor(Base):
    def __init__(self, check):
        super().__init__()
        self.check = check

    def forward(self, x):
        ok = isinstance(x, torch.Tensor) if self.check == "isinstance" else torch.is_tensor(x)
        if not ok:
            x = x * 0.0 + 1.0
        return chain(self.lns, self.lin, x)


@pytest.mark.parametrize("check", ["isinstance", "torch.is_tensor"])
def test_isinstance_takes_the_tensor_branch(check):
    torch.manual_seed(0)
    m = IsTensor(check)
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D),))
    for B in BATCHES:
        assert check_same_or_refused(m, gm, torch.randn(B, F_ * D)) is None


# -- 3: None arguments --------------------------------------------------------------------------


class OptionalWeights(Base):
    def forward(self, x, weights=None):
        y = chain(self.lns, self.lin, x)
        if weights is not None:
            y = y * weights[None, :, None]
        return y


@pytest.mark.parametrize("n_example", [1, 2])
def test_none_argument_is_guarded(n_example):
    m = OptionalWeights()
    ex = (torch.randn(3, F_ * D),) + ((None,) if n_example == 2 else ())
    gm = recfuse.transform(copy.deepcopy(m), ex)
    for B in BATCHES:
        x = torch.randn(B, F_ * D)
        assert close(gm(x), m(x))
        with pytest.raises(RecfuseError, match="`weights` was None"):
            gm(x, torch.rand(F_))


# -- 4: grad-mode regions ------------------------------------------------------------------------


class NoGradRegion(Base):
    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.head = nn.Linear(F_ * H, 1)

    def forward(self, x):
        v = self.variant
        if v in ("no_grad", "set_grad_enabled"):
            ctx = torch.no_grad() if v == "no_grad" else torch.set_grad_enabled(False)
            with ctx:
                y = chain(self.lns, self.lin, x)
            return self.head(y.flatten(1))
        if v == "ln_only":  # the region splits each chain: must not be fused across it
            hs = []
            for n, t in zip(self.lns, x.split(D, 1)):
                with torch.no_grad():
                    h = n(t)
                hs.append(torch.tanh(h))
            return self.head(torch.relu(self.lin(torch.stack(hs, 1))).flatten(1))
        if v == "linear_only":
            s = torch.stack([torch.tanh(n(t)) for n, t in zip(self.lns, x.split(D, 1))], 1)
            with torch.no_grad():
                y = torch.relu(self.lin(s))
            return self.head(y.flatten(1))


@pytest.mark.parametrize("variant", ["no_grad", "set_grad_enabled", "ln_only", "linear_only"])
def test_grad_mode_regions_are_kept(variant):
    torch.manual_seed(0)
    m = NoGradRegion(variant)
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D),))
    ref = copy.deepcopy(m)
    for B in BATCHES:
        x = torch.randn(B, F_ * D, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        ref.zero_grad(set_to_none=True)
        gm.zero_grad(set_to_none=True)
        a, b = ref(x), gm(x2)
        assert close(a, b)
        a.sum().backward()
        b.sum().backward()
        assert (x.grad is None) == (x2.grad is None)
        if x.grad is not None:
            assert close(x.grad, x2.grad)
        for name in ("lin.weight", "head.weight"):
            ga, gb = ref.get_parameter(name).grad, gm.get_parameter(name).grad
            assert (ga is None) == (gb is None), name
            if ga is not None:
                assert close(ga, gb)
        assert torch.is_grad_enabled()
        with torch.no_grad():
            assert not gm(x).requires_grad and torch.is_grad_enabled() is False
        assert torch.is_grad_enabled()


# -- 5: autocast -----------------------------------------------------------------------------------


class Autocast(Base):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return chain(self.lns, self.lin, x)


def test_autocast_in_forward_is_refused():
    with pytest.raises(RecfuseError, match=r"torch.autocast.*test_capture_trust.py"):
        recfuse.transform(Autocast(), (torch.randn(3, F_ * D),))
    # the global state is left as it was
    assert not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()


# -- 6: data-dependent branches ----------------------------------------------------------------


class DataBranch(Variant):
    def forward(self, x):
        y = chain(self.lns, self.lin, x)
        if self.how == "item":
            if x.sum().item() > 0:
                return y * 2
            return y
        if self.how == "int":
            return y[: int(x[0, 0] > 0) + 1]
        if self.how == "range":
            return torch.stack([y[0] for _ in range(int(x.abs().sum().item()))])


@pytest.mark.parametrize("how", ["item", "int", "range"])
def test_data_dependent_branch_is_refused(how):
    with pytest.raises(RecfuseError, match="data-dependent"):
        recfuse.transform(DataBranch(how), (torch.randn(3, F_ * D),))


class ItemAsNumber(Base):
    def forward(self, x):
        return chain(self.lns, self.lin, x) * x.mean().item()  # a value, not control flow: kept


def test_item_as_a_number_stays_in_the_graph():
    m = ItemAsNumber()
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D),))
    for B in BATCHES:
        x = torch.randn(B, F_ * D)
        assert close(gm(x), m(x))


# -- 7: autograd flags in forward ---------------------------------------------------------------


class AutogradFlags(Variant):
    def forward(self, x):
        outs = []
        for ln, t in zip(self.lns, x.split(D, 1)):
            h = ln(t)
            if self.how == "requires_grad_":
                h.requires_grad_()
            elif self.how == "retain_grad":
                h.retain_grad()
            else:
                h.requires_grad = True
            outs.append(torch.tanh(h))
        return torch.relu(self.lin(torch.stack(outs, 1)))


@pytest.mark.parametrize("how", ["requires_grad_", "retain_grad", "requires_grad="])
def test_autograd_flag_changes_are_refused(how):
    with pytest.raises(RecfuseError, match=r"test_capture_trust.py"):
        recfuse.transform(AutogradFlags(how), (torch.randn(3, F_ * D),))


# -- 8: buffer rebinding ---------------------------------------------------------------------------


class BufferCounter(Base):
    def __init__(self, inplace):
        super().__init__()
        self.inplace = inplace
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        if self.inplace:
            self.n.add_(1)
        else:
            self.n = self.n + 1
        return chain(self.lns, self.lin, x)


def test_buffer_rebinding_is_refused_and_inplace_kept():
    with pytest.raises(RecfuseError, match=r"buffer `n`.*add_"):
        recfuse.transform(BufferCounter(False), (torch.randn(3, F_ * D),))
    m = BufferCounter(True)
    gm = recfuse.transform(copy.deepcopy(m), (torch.randn(3, F_ * D),))
    for B in BATCHES:
        x = torch.randn(B, F_ * D)
        assert close(gm(x), m(x))
    assert float(gm.n) == float(m.n) == len(BATCHES)
    torch.save(gm, io.BytesIO())


def test_grad_mode_restored_when_forward_raises_inside_no_grad():
    class LinearInNoGrad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            with torch.no_grad():
                h = self.lin(x)
            return torch.relu(h) + x[:, :2]

    m = LinearInNoGrad()
    gm = recfuse.transform(m, (torch.randn(3, 4),))
    x = torch.randn(3, 4)
    torch.testing.assert_close(gm(x), m(x))
    with pytest.raises(RuntimeError):
        gm(torch.randn(3, 1))  # the Linear's shape error, raised inside the no_grad region
    assert torch.is_grad_enabled(), "the caller's grad mode must be restored after the error"
