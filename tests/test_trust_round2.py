"""Red-team round 2: "never a silent wrong answer". Each test compares the transformed model (or
FusedFeatureProcessor) with the untouched original, or checks the error that refuses the case."""
import copy

import pytest
import torch
from torch import nn

import recfuse
from recfuse.errors import RecfuseError

F_, D, H = 4, 8, 3


def chain(lns, lin, x):
    return torch.relu(lin(torch.stack([torch.tanh(n(t)) for n, t in zip(lns, x.split(D, 1))], 1)))


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(F_)])
        self.lin = nn.Linear(D, H)


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
