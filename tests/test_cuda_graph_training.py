"""CUDA graphs in training: a transformed model and FusedFeatureProcessor under
`torch.compile(mode="reduce-overhead")` and `torch.cuda.make_graphed_callables` give the eager
training step's outputs and gradients (GPU only)."""
import copy

import pytest
import torch

import recfuse
from fx_cases import PerFeatureChain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

F, B, D, H = 8, 64, 32, 4


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def models():
    torch.manual_seed(0)
    x = torch.randn(B, F * D, device="cuda")
    per_feature = PerFeatureChain(F, D, H).cuda()
    with torch.no_grad():
        for ln in per_feature.lns:
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
    ffp = recfuse.FusedFeatureProcessor([f"f{i}" for i in range(F)], D, H, device="cuda")
    return x, {"transform": recfuse.transform(per_feature, (x,)), "ffp": ffp}


def training_steps(call, model, xs, gys):
    """Outputs, dx and parameter grads of one step per input, running `call` (the model or a
    graphed/compiled wrapper of it)."""
    out = []
    for x, gy in zip(xs, gys):
        for p in model.parameters():
            p.grad = None
        x = x.clone().requires_grad_(True)
        y = call(x)
        (y * gy).sum().backward()
        out.append((y.detach().clone(), x.grad.clone(), [p.grad.clone() for p in model.parameters()]))
    return out


def assert_same_steps(name, got, want):
    for step, ((y0, dx0, g0), (y1, dx1, g1)) in enumerate(zip(want, got)):
        assert rel(y1, y0) < 1e-5, (name, step, "y")
        assert rel(dx1, dx0) < 1e-4, (name, step, "dx")
        for a, b in zip(g1, g0):
            assert rel(a, b) < 1e-4, (name, step, "param grad")


def inputs(x, n=4):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(x.shape, device="cuda", generator=g) for _ in range(n)]


def case(which):
    """(model, an example input, inputs and output gradients of 4 steps, the eager steps' results)."""
    x, ms = models()
    model = ms[which]
    xs = inputs(x)
    with torch.no_grad():
        shape = model(x).shape
    g = torch.Generator(device="cuda").manual_seed(2)
    gys = [torch.randn(shape, device="cuda", generator=g) for _ in xs]
    ref = copy.deepcopy(model)
    return model, x, xs, gys, training_steps(ref, ref, xs, gys)


@pytest.mark.parametrize("which", ["transform", "ffp"])
def test_compile_reduce_overhead_training_matches_eager(which):
    model, _, xs, gys, want = case(which)
    compiled = torch.compile(model, mode="reduce-overhead")
    assert_same_steps(which, training_steps(compiled, model, xs, gys), want)


@pytest.mark.parametrize("which", ["transform", "ffp"])
def test_make_graphed_callables_training_matches_eager(which):
    model, x, xs, gys, want = case(which)
    graphed = torch.cuda.make_graphed_callables(model, (x.clone().requires_grad_(True),))
    assert_same_steps(which, training_steps(graphed, model, xs, gys), want)
