"""Red-team round 9: "never a silent wrong answer" for the public ops called directly
(`recfuse.ln_tanh_linear_relu`, `recfuse.feature_mlp`) under torch.jit.trace, torch.compile and
with numpy / tensor arguments. Each test compares with the float64 reference (`recfuse.reference`)
or checks the error that refuses the case. Each docstring says what the case did before its fix.

(The transform spellings probed this round, KeyedTensor.to_dict / regroup / from_tensor_list,
features of different widths, subsets, two chains on one input, Linear followed by sigmoid /
dropout / Linear, residuals, ModuleDict orders, stack(dim=2) / einsum / bmm / F.linear of a
transposed view, buffers and BatchNorm statistics, train/eval switches, cat in another order and
side outputs, all matched the original model; they need no test of their own here.)"""
import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import recfuse
from fx_cases import PerFeatureChain, randomized
from recfuse import reference as R
from recfuse.ops.ln_tanh_linear_relu import uses_triton

F_, B_, D_, H_ = 3, 4, 5, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _check_against_float64(fn, ref_fn, *tensors, tol=1e-5):
    """fn(*tensors) and its gradients (of a fixed random weighting of y) against ref_fn in float64."""
    got_in = _leaves(*tensors)
    y = fn(*got_in)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
    y.backward(g)
    want_in = [t.detach().double().requires_grad_(True) for t in tensors]
    y_ref = ref_fn(*want_in)
    y_ref.backward(g.double())
    torch.testing.assert_close(y.double(), y_ref.detach(), atol=tol, rtol=tol)
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=10 * tol, rtol=10 * tol)


# -- torch.jit.trace of the op ---------------------------------------------------------------------


def _trace_cases():
    torch.manual_seed(0)
    w = torch.randn(H_, D_)
    lb = torch.randn(F_, D_)
    chain = dict(norm="rms_norm", activation="silu", out_activation="sigmoid")
    return {
        "ln_tanh_linear_relu": (
            lambda x, w, lb: recfuse.ln_tanh_linear_relu(x, w, ln_bias=lb, feature_dim=1),
            lambda x, w, lb: R.ln_tanh_linear_relu(x, w, ln_bias=lb, feature_dim=1), (w, lb)),
        "feature_mlp": (
            lambda x, w, lb: recfuse.feature_mlp(x, w, ln_bias=lb, feature_dim=1, **chain),
            lambda x, w, lb: R.feature_mlp(x, w, ln_bias=lb, feature_dim=1, **chain), (w, lb)),
    }


def _traced_op_nodes(traced):
    return [n.kind() for n in traced.graph.nodes() if n.kind().startswith("recfuse::")]


def _jit_trace_records_the_op(case, requires_grad):
    fn, ref_fn, params = _trace_cases()[case]
    params = [p.clone().requires_grad_(requires_grad) for p in params]
    traced = torch.jit.trace(fn, (torch.randn(B_, F_, D_), *params), check_trace=False)
    # one recfuse node: the trace replays the op (its kernels on CUDA), never a fixed buffer
    assert _traced_op_nodes(traced) == [f"recfuse::{case}"], traced.graph
    x = torch.randn(7, F_, D_)  # another batch size and other values than traced
    _check_against_float64(traced, ref_fn, x, *params)


@pytest.mark.parametrize("case", ["ln_tanh_linear_relu", "feature_mlp"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
def test_jit_trace_of_the_op_records_one_op_node(case, requires_grad):
    """On the CPU path, before: torch.jit.trace recorded the composite's aten ops (no grad) or an
    opaque prim::PythonOp of the autograd.Function (grad), never the op; on the Triton path it
    crashed (next test). Now one `recfuse::` node, matching float64 at another batch size,
    forward and gradients."""
    _jit_trace_records_the_op(case, requires_grad)


@pytest.mark.interpret
@pytest.mark.skipif(not uses_triton(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", ["ln_tanh_linear_relu", "feature_mlp"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
def test_jit_trace_of_the_op_on_the_triton_path(case, requires_grad):
    """Before: torch.jit.trace of a function calling the op launched the Triton kernel with the
    tracer active: under TRITON_INTERPRET=1 it crashed inside the kernel ("InterpreterError:
    'torch.dtype' object has no attribute 'is_ptr'"); on CUDA the launch is invisible to the trace,
    which would have kept only the `torch.empty` of y (a silent wrong answer on every traced call).
    Now the traced call goes through the custom op: one `recfuse::` node that runs the kernels."""
    _jit_trace_records_the_op(case, requires_grad)


@pytest.mark.interpret
@pytest.mark.skipif(not uses_triton(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("what", ["transformed", "fused_feature_processor"])
def test_jit_trace_of_a_transformed_model_and_the_module_on_the_triton_path(what):
    """Before: the same crash in the kernel for `torch.jit.trace(recfuse.transform(model, ...))` and
    for a `FusedFeatureProcessor` (both call the op). Now they trace to the op node and match
    the untouched original (transformed) or the float64 reference (module), gradients included."""
    x = torch.randn(B_, F_ * D_)
    if what == "transformed":
        ref = randomized(PerFeatureChain(F_, D_, H_))
        model = recfuse.transform(copy.deepcopy(ref), (x,))
    else:
        model = randomized(recfuse.FusedFeatureProcessor(["a", "b", "c"], embedding_dims=D_, out_features=H_))
        p = dict(model.named_parameters())
        ref = None
    traced = torch.jit.trace(model, (x,), check_trace=False)
    assert any(k.startswith("recfuse::") for k in (n.kind() for n in traced.graph.nodes())), traced.graph
    x2 = torch.randn(6, F_ * D_)
    if ref is not None:
        a, b = _leaves(x2, x2)
        ya, yb = traced(a), ref(b)
        (ya ** 2).sum().backward()
        (yb ** 2).sum().backward()
        torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)
    else:
        want = R.ln_tanh_linear_relu(x2.double().view(6, F_, D_), p["weight"].double(), p["bias"].double(),
                                     ln_weight=p["ln_weight"].double(), ln_bias=p["ln_bias"].double(),
                                     feature_dim=1).flatten(1)
        torch.testing.assert_close(traced(x2).double(), want, atol=1e-5, rtol=1e-5)


# -- eps given as a numpy scalar or a tensor --------------------------------------------------------


@pytest.mark.parametrize("op", ["ln_tanh_linear_relu", "feature_mlp"])
@pytest.mark.parametrize("eps", [np.float32(0.5), np.float64(0.25), np.int64(0)], ids=str)
def test_a_numpy_eps_is_taken_as_f_layer_norm_takes_it(op, eps):
    """Before: eps=np.float32(0.5) (read from a numpy config; F.layer_norm takes it) was refused with
    the self-contradicting "eps must be a float >= 0, got np.float32(0.5)". Now any real number
    is taken, and the result matches float64 with eps=float(eps)."""
    x, w, b = torch.randn(F_, B_, D_), torch.randn(H_, D_), torch.randn(H_)
    if op == "ln_tanh_linear_relu":
        fn = lambda x, w, b: recfuse.ln_tanh_linear_relu(x, w, b, eps=eps)  # noqa: E731
        ref = lambda x, w, b: R.ln_tanh_linear_relu(x, w, b, eps=float(eps))  # noqa: E731
    else:
        fn = lambda x, w, b: recfuse.feature_mlp(x, w, b, eps=eps, norm="rms_norm")  # noqa: E731
        ref = lambda x, w, b: R.feature_mlp(x, w, b, eps=float(eps), norm="rms_norm")  # noqa: E731
    _check_against_float64(fn, ref, x, w, b)


@pytest.mark.parametrize("op", [recfuse.ln_tanh_linear_relu, recfuse.feature_mlp])
def test_a_tensor_eps_is_refused_by_name(op):
    """Before: "eps must be a float >= 0, got tensor(0.5000)", which reads as if 0.5 were negative.
    Now the message says a tensor was given and how to pass it; bad numbers still say why."""
    x, w = torch.randn(F_, B_, D_), torch.randn(H_, D_)
    with pytest.raises(ValueError, match=r"eps must be a float >= 0, got a tensor .*eps=float\(eps\)"):
        op(x, w, eps=torch.tensor(0.5))
    for bad in (np.float32(-1.0), np.float32("nan"), "0.5", None):
        with pytest.raises(ValueError, match="eps must be a float >= 0, got"):
            op(x, w, eps=bad)


# -- the first feature_mlp call of a process under torch.compile ------------------------------------


_FIRST_CALL_UNDER_COMPILE = r"""
import torch, recfuse
from recfuse import reference as R
torch.manual_seed(0)
kw = dict(norm="rms_norm", activation="silu", out_activation="sigmoid", feature_dim=1)
w = torch.randn(3, 2, 5, requires_grad=True)
f = torch.compile(lambda x, w: recfuse.feature_mlp(x, w, **kw), dynamic=True)
for b in (4, 6):
    x = torch.randn(b, 3, 5)
    w.grad = None
    f(x, w).pow(2).sum().backward()
    wd = w.detach().double().requires_grad_(True)
    y = R.feature_mlp(x.double(), wd, **kw)
    y.pow(2).sum().backward()
    torch.testing.assert_close(f(x, w).double(), y.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), wd.grad, atol=1e-4, rtol=1e-4)
print("MATCHED")
"""


def test_the_first_feature_mlp_call_of_a_process_may_be_compiled():
    """Before: when the first `feature_mlp` call of a chain in a process was inside
    torch.compile(dynamic=True) with a tensor requiring grad, compilation failed with
    "torch._dynamo...SpeculationLogDivergence" (the chain validation cached the new chain in a
    module dict while Dynamo traced it; Dynamo's restart found it cached and took the other
    branch). Calling the op eagerly once first hid it. Now every valid chain is cached at import
    and the lookup only reads. A fresh process, so that no earlier test has used the chain."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", _FIRST_CALL_UNDER_COMPILE], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0 and "MATCHED" in out.stdout, out.stderr[-3000:]


def test_chain_validation_never_grows_its_cache():
    """Every spelling of every valid chain is cached at import (so validating under a trace only
    reads); equal chains are one object, the default chain is `recfuse.chain.DEFAULT`, and a bad
    chain is still refused by name."""
    from recfuse import chain as C

    n = len(C._VALID)
    assert C.chain_of("layer_norm", "tanh", "relu") is C.DEFAULT
    assert C.chain_of("none", "silu", None) is C.chain_of(None, "silu", "none")
    with pytest.raises(ValueError, match="activation must be one of"):
        C.chain_of("rms_norm", "swish", None)
    assert len(C._VALID) == n
