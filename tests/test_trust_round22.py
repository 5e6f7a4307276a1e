"""Red-team round 22: tensors with unusual properties passed as x, weight, bias, ln_weight,
ln_bias (and grad_y) to the op, `FusedFeatureProcessor` and a transformed model, on CPU, on both
CPU backends. Each test compares with the float64 reference (`recfuse.reference`, 1e-5 forward,
1e-4 gradients, relative to the max) or checks the error that refuses the case; each docstring
says what the case gave before its fix.

Found wrong (each a test below that fails before its fix):

1. A tensor with its negative bit set (``torch._neg_view``, the ``.imag`` of a conjugated complex
   tensor, or a ``.contiguous()`` / ``nn.Parameter`` of one, which keep the bit) as any of the
   five tensor arguments: the compiled CPU path (cold, through Dynamo/Inductor, and warm, through
   its direct calls) read the raw memory and answered the un-negated numbers (errors 0.5-1.9).
   Now refused by `check_op_args` naming the argument; the bit is part of `call_signature` and of
   the module's `call_key`, so a signature validated without it does not let it through.
2. The same for `FusedFeatureProcessor`'s input and parameters (its plans are cached without the
   bit): now refused when the call binds.
3. A neg-bit grad_y (``y.backward(torch._neg_view(g))``): the compiled backward gave gradients of
   the wrong sign. Now materialized (``resolve_neg``) in the backward.

Probed and found right (no test of their own): zero-stride expanded weights
(``w[:1].expand(H, D)``), overlapping ``as_strided`` x and weight, transposed weight views,
``torch.from_numpy`` (read-only arrays too), trivial ``torch.Tensor`` subclasses and
``nn.Parameter`` subclasses, inference-mode tensors in a later no-grad call (and with a
requires-grad weight: PyTorch's own "Inference tensors cannot be saved for backward" error), a
requires-grad strided view of a leaf as weight. The conjugate bit does not apply (complex dtypes
are refused as non-floating).
"""
import pytest
import torch

import recfuse
from recfuse import reference
from recfuse.ops import cpu_backend

F, B, D, H = 3, 5, 8, 4
BACKENDS = ("compiled", "eager")
NAMES = ("x", "weight", "bias", "ln_weight", "ln_bias")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _args():
    g = torch.Generator().manual_seed(22)
    return [torch.randn(F, B, D, generator=g), torch.randn(H, D, generator=g), torch.randn(H, generator=g),
            torch.randn(D, generator=g), torch.randn(D, generator=g)]


def _call(args):
    x, w, b, lw, lb = args
    return recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", range(5))
def test_neg_bit_argument_is_refused_even_after_a_plain_call(backend, which):
    """Before: the compiled backend answered the un-negated numbers (err 0.5-1.9), warm or cold."""
    args = _args()
    with cpu_backend(backend):
        y = _call(args)  # the signature is validated and warm
        assert _rel(y, reference.ln_tanh_linear_relu(*args[:3], ln_weight=args[3], ln_bias=args[4])) < 1e-5
        neg = list(args)
        neg[which] = torch._neg_view(-args[which])
        assert neg[which].is_neg()
        with pytest.raises(ValueError, match=rf"^{NAMES[which]} has its negative bit set.*resolve_neg"):
            _call(neg)
        neg[which] = neg[which].resolve_neg()
        assert _rel(_call(neg), y) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_bit_from_conj_imag_and_parameter_refused(backend):
    """Before: `z.conj().imag` as x and an nn.Parameter of a neg view as weight (both keep the bit)
    gave wrong numbers on the compiled backend."""
    x, w = _args()[:2]
    with cpu_backend(backend):
        x_imag = torch.complex(torch.randn(F, B, D), -x).conj().imag  # values equal x
        with pytest.raises(ValueError, match="^x has its negative bit"):
            recfuse.ln_tanh_linear_relu(x_imag, w)
        with pytest.raises(ValueError, match="^weight has its negative bit"):
            recfuse.ln_tanh_linear_relu(x, torch.nn.Parameter(torch._neg_view(-w)))
        with pytest.raises(ValueError, match="^x has its negative bit"):
            recfuse.feature_mlp(torch._neg_view(-x), w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_processor_refuses_neg_bit_input_and_parameter(backend):
    """Before: FusedFeatureProcessor (its plan cached without the bit) gave err ~1.0 on the compiled
    backend for a neg-bit input, and for a neg-bit parameter swapped in after a call."""
    with cpu_backend(backend):
        fp = recfuse.FusedFeatureProcessor(["a", "b", "c"], D, out_features=H)
        x = torch.randn(B, F, D)
        fp(x)
        with pytest.raises(ValueError, match="^x has its negative bit"):
            fp(torch._neg_view(-x))
        fp.weight = torch.nn.Parameter(torch._neg_view(-fp.weight.detach()))
        with pytest.raises(ValueError, match="^weight has its negative bit"):
            fp(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_bit_grad_y_gives_right_gradients(backend):
    """Before: the compiled backward read grad_y's raw memory: gradients of the wrong sign (err 2.0)."""
    x, w = _args()[:2]
    with cpu_backend(backend):
        for _ in range(2):  # cold, then the kept backward
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = recfuse.ln_tanh_linear_relu(xg, wg)
            g = torch.randn_like(y)
            gx, gw = torch.autograd.grad(y, (xg, wg), torch._neg_view(-g))
            x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
            rx, rw = torch.autograd.grad(reference.ln_tanh_linear_relu(x64, w64), (x64, w64), g.double())
            assert _rel(gx, rx) < 1e-4 and _rel(gw, rw) < 1e-4
