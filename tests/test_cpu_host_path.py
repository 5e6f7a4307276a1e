"""The CPU host path's shortcuts give the numbers of the paths they shortcut.

* `_cpu_compiled`'s direct calls: once Dynamo has run a call, later calls with the same signature
  call the compiled graph without Dynamo. Each call (Dynamo's and the direct ones, forward,
  backward, inference) is compared with the float64 per-slice reference, and the direct calls with
  the Dynamo call bit for bit.
* A transformed module's lean ``__call__`` (forward directly when nn.Module.__call__ would do
  nothing else): outputs against the untouched original, hooks still run, errors of the generated
  code still propagate.
* FusedFeatureProcessor's [B, F*D] view (``view`` instead of ``unflatten``): against its per-feature
  reference on contiguous, strided and empty buffers.
"""
import os
import contextlib

import pytest
import torch

import recfuse
from recfuse.ops import _cpu_compiled
from recfuse.puzzler import SplitStack

from op_cases import rel_err, TOLERANCE
from fx_cases import reloaded

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                                reason="CPU tensors run the Triton interpreter under TRITON_INTERPRET=1")


def _float64_chain(x, w, b, feature_dim):
    """relu(Linear(tanh(LayerNorm(x)))) in float64, LayerNorm without affine (eps 1e-5)."""
    h = torch.tanh(torch.nn.functional.layer_norm(x.double(), (x.shape[-1],), eps=1e-5))
    return torch.relu(h @ w.double().t() + b.double())


def _direct_entries(kind: str) -> int:
    return sum(1 for sig in _cpu_compiled._DIRECT.calls if sig[0] == kind)


LAYOUTS = {
    # [B, F, D] batch-major, feature_dim=1 (FusedFeatureProcessor's and torchrec's layout)
    "batch_major": lambda buf, B, F, D: (buf.view(B, F, D), 1),
    # [F, B, D] movedim view of the [B, F*D] buffer, feature_dim=0 (what transform's graphs pass;
    # the compiled path runs it transposed)
    "features_first_view": lambda buf, B, F, D: (buf.view(B, F, D).movedim(1, 0), 0),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_calls_match_dynamo_and_float64(layout, dtype):
    B, F, D, H = 37, 5, 16, 2
    g = torch.Generator().manual_seed(0)
    buf64 = torch.randn(B, F * D, generator=g, dtype=torch.float64)
    w64 = torch.randn(H, D, generator=g, dtype=torch.float64) / D ** 0.5
    b64 = 0.1 + 0.1 * torch.randn(H, generator=g, dtype=torch.float64)
    gy64 = torch.randn(*(LAYOUTS[layout](buf64, B, F, D)[0].shape[:2]), H, generator=g, dtype=torch.float64)
    results = []
    with recfuse.ops.cpu_backend("compiled"):
        _cpu_compiled.clear_cache()
        for call in range(3):
            buf = buf64.to(dtype).requires_grad_(True)
            w = w64.to(dtype).requires_grad_(True)
            b = b64.to(dtype).requires_grad_(True)
            x, feature_dim = LAYOUTS[layout](buf, B, F, D)
            y = recfuse.ln_tanh_linear_relu(x, w, b, eps=1e-5, feature_dim=feature_dim)
            y.backward(gy64.to(dtype))
            with torch.no_grad():
                y_inference = recfuse.ln_tanh_linear_relu(x, w, b, eps=1e-5, feature_dim=feature_dim)
            results.append((y.detach(), y_inference, buf.grad, w.grad, b.grad))
        # the second and third calls of each kind went around Dynamo
        assert _direct_entries("fwd") == 2 and _direct_entries("bwd") == 1

    # the reference, on the same dtype-rounded inputs
    buf_r = buf64.to(dtype).double().requires_grad_(True)
    w_r = w64.to(dtype).double().requires_grad_(True)
    b_r = b64.to(dtype).double().requires_grad_(True)
    x_r, feature_dim = LAYOUTS[layout](buf_r, B, F, D)
    y_r = _float64_chain(x_r, w_r, b_r, feature_dim)
    y_r.backward(gy64.to(dtype).double())
    reference = (y_r.detach(), y_r.detach(), buf_r.grad, w_r.grad, b_r.grad)

    first = results[0]
    for call, outs in enumerate(results):
        for name, out, ref, dynamo in zip(("y", "y (no_grad)", "x.grad", "weight.grad", "bias.grad"),
                                          outs, reference, first):
            assert out.dtype == dtype and out.shape == ref.shape, name
            assert rel_err(out, ref) < TOLERANCE[dtype], f"call {call} {name}: {rel_err(out, ref):.2e}"
            # same graph, same inputs: the same bits, and the same layout
            assert torch.equal(out, dynamo) and out.stride() == dynamo.stride(), f"call {call} {name}"
    # y and x.grad in the layouts the eager composite gives
    with recfuse.ops.cpu_backend("eager"):
        buf = buf64.to(dtype).requires_grad_(True)
        x, feature_dim = LAYOUTS[layout](buf, B, F, D)
        y_e = recfuse.ln_tanh_linear_relu(x, w64.to(dtype), b64.to(dtype), eps=1e-5, feature_dim=feature_dim)
        y_e.backward(gy64.to(dtype))
    assert results[-1][0].stride() == y_e.stride() and results[-1][2].stride() == buf.grad.stride()


def test_direct_call_is_per_signature():
    """A new batch size (another signature) goes through Dynamo again and gets its own entry; each
    result matches float64."""
    D, H, F = 16, 1, 4
    w, b = torch.randn(H, D, dtype=torch.float64), torch.randn(H, dtype=torch.float64)
    with recfuse.ops.cpu_backend("compiled"), torch.no_grad():
        _cpu_compiled.clear_cache()
        for B in (9, 9, 23, 23, 9):
            x = torch.randn(B, F, D, dtype=torch.float64)
            y = recfuse.ln_tanh_linear_relu(x.float(), w.float(), b.float(), eps=1e-5, feature_dim=1)
            assert rel_err(y, _float64_chain(x.float().double(), w.float(), b.float(), 1)) < TOLERANCE[torch.float32]
        assert _direct_entries("fwd") == 2


def test_direct_call_failure_goes_back_to_dynamo(monkeypatch):
    """A learned call that raises is forgotten and the call runs through Dynamo, with the same y."""
    x, w = torch.randn(11, 3, 16), torch.randn(1, 16)
    with recfuse.ops.cpu_backend("compiled"), torch.no_grad():
        _cpu_compiled.clear_cache()
        y0 = recfuse.ln_tanh_linear_relu(x, w, eps=1e-5, feature_dim=1)
        (signature, call), = _cpu_compiled._DIRECT.calls.items()

        def broken(args):
            raise RuntimeError("broken")

        monkeypatch.setattr(_cpu_compiled._DirectCall, "__call__", lambda self, args: broken(args))
        y1 = recfuse.ln_tanh_linear_relu(x, w, eps=1e-5, feature_dim=1)
        monkeypatch.undo()
    assert torch.equal(y0, y1)


# ---------------------------------------------------------------------------------------------
# transform's lean __call__


def _split_stack_pair(F=6, B=10, D=8):
    torch.manual_seed(0)
    model = SplitStack(D, 2)
    x = torch.randn(B * F * D)
    return model, recfuse.transform(model, (x, B, D)), x, B, D


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_lean_call_matches_original(backend):
    model, fused, x, B, D = _split_stack_pair()
    assert type(fused).__call__ is recfuse.fx.graph_module._lean_call
    with recfuse.ops.cpu_backend(backend):
        for train in (False, True):
            xs = [x.clone().requires_grad_(train) for _ in range(2)]
            with contextlib.nullcontext() if train else torch.no_grad():
                for _ in range(2):  # the second call takes the direct path on "compiled"
                    y, y_ref = fused(xs[0], B, D), model(xs[1], B, D)
                    assert rel_err(y, y_ref) < 1e-5
            if train:
                y.sum().backward()
                y_ref.sum().backward()
                assert rel_err(xs[0].grad, xs[1].grad) < 1e-5


def test_lean_call_runs_hooks():
    model, fused, x, B, D = _split_stack_pair()
    seen = []
    pre = fused.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    post = fused.register_forward_hook(lambda m, args, out: out * 2)
    y = fused(x, B, D)
    assert seen == ["pre"] and rel_err(y, 2 * model(x, B, D)) < 1e-5
    pre.remove(), post.remove()
    called = []
    global_hook = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: called.append(m))
    try:
        assert rel_err(fused(x, B, D), model(x, B, D)) < 1e-5
    finally:
        global_hook.remove()
    assert any(m is fused for m in called)
    assert rel_err(fused(x, B, D), model(x, B, D)) < 1e-5


def test_lean_call_reports_guard_errors_and_survives_copies():
    import copy

    model, fused, x, B, D = _split_stack_pair()
    with pytest.raises(AssertionError, match="batch_size has been specialized"):
        fused(x, B + 1, D)
    for other in (copy.deepcopy(fused), reloaded(fused)):
        assert type(other).__call__ is recfuse.fx.graph_module._lean_call
        assert rel_err(other(x, B, D), model(x, B, D)) < 1e-5



def test_lean_call_inside_torch_compile():
    """Dynamo traces the transformed module (the lean call defers to GraphModule's under it)."""
    model, fused, x, B, D = _split_stack_pair()
    compiled = torch.compile(fused, backend="eager")
    assert rel_err(compiled(x, B, D), model(x, B, D)) < 1e-5


# ---------------------------------------------------------------------------------------------
# FusedFeatureProcessor's buffer view


@pytest.mark.parametrize("buffer", ["contiguous", "strided_rows", "column_stride_2", "empty_batch", "window"])
def test_ffp_buffer_view_matches_reference(buffer):
    F, D, B = 4, 8, 6
    names = [f"f{i}" for i in range(F)]
    fp = recfuse.FusedFeatureProcessor(names, D, out_features=3, dtype=torch.float64)
    wide = torch.randn(B, 3 * F * D, dtype=torch.float64)
    values = {"contiguous": torch.randn(B, F * D, dtype=torch.float64),
              "strided_rows": wide[:, :F * D],
              "column_stride_2": wide[:, : 2 * F * D : 2],
              "empty_batch": torch.randn(0, F * D, dtype=torch.float64),
              "window": wide[:, 5:5 + F * D]}[buffer]
    y = fp(values)
    assert y.shape == (values.shape[0], F * 3)
    assert torch.allclose(y, fp.forward_reference(values), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# transformed graphs' helpers


@pytest.mark.parametrize("source", ["contiguous", "transposed", "column_stride_2", "window", "empty"])
def test_slices_view_matches_stacked_split(source):
    from recfuse.fx.runtime import slices_view

    wide = torch.randn(40, 7)
    src = {"contiguous": torch.randn(7, 24), "transposed": torch.randn(24, 7).t(),
           "column_stride_2": torch.randn(7, 48)[:, ::2], "window": wide.t()[:, 3:27],
           "empty": torch.randn(0, 24)}[source]
    start, count, length = (0, 4, 6) if source != "window" else (6, 3, 4)
    expected = torch.stack(src.narrow(1, start, count * length).split(length, 1), 1)
    out = slices_view(src, 1, start, count, length)
    assert out.shape == expected.shape and torch.equal(out, expected)


def test_helpers_record_nodes_for_proxies():
    """With a Proxy (directly or inside check_specialized's tuple) the helpers record a node."""
    from recfuse.fx.runtime import check_specialized, slices_view

    def f(x):
        check_specialized((x, "split", 4, 1), "pieces", 3, "len(split)", "here")
        return slices_view(x, 1, 0, 3, 4)

    gm = torch.fx.symbolic_trace(f)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [check_specialized, slices_view]
    x = torch.randn(2, 12)
    assert torch.equal(gm(x), x.view(2, 3, 4))
    with pytest.raises(recfuse.errors.RecfuseError, match="specialised len"):
        gm(torch.randn(2, 16))


# ---------------------------------------------------------------------------------------------
# transformed graphs' attribute reads (`graph_module.read_attr`)


class _PerFeature(torch.nn.Module):
    def __init__(self, F_=3, D=8, H=2):
        super().__init__()
        self.D = D
        self.lns = torch.nn.ModuleList(torch.nn.LayerNorm(D) for _ in range(F_))
        self.linear = torch.nn.Linear(D, H)

    def forward(self, x):
        ts = [torch.tanh(ln(s)) for ln, s in zip(self.lns, x.split(self.D, 1))]
        return torch.relu(self.linear(torch.stack(ts, 1)))


def _per_feature_pair():
    torch.manual_seed(0)
    model = _PerFeature()
    x = torch.randn(5, 24)
    return model, recfuse.transform(model, (x,)), x


def test_graph_reads_parameters_through_read_attr_and_sees_replacements():
    model, fused, x = _per_feature_pair()
    # consecutive reads are one `read_attrs` call over their lines (`graph_module._group_reads`)
    assert "recfuse_fx_graph_module_read_attrs(self, (('linear', 'weight'),\n" in fused.code
    assert rel_err(fused(x), model(x)) < 1e-5
    new_w = torch.nn.Parameter(torch.randn(2, 8))
    fused.linear.weight = new_w  # replaced by the user
    model.linear.weight = torch.nn.Parameter(new_w.detach().clone())
    assert rel_err(fused(x), model(x)) < 1e-5
    with torch.no_grad():
        fused.linear.weight.data = torch.randn(8, 2).t()  # other strides, in place
        model.linear.weight.data = fused.linear.weight.data.clone()
    assert rel_err(fused(x), model(x)) < 1e-5
    params = {k: torch.randn_like(v) for k, v in fused.named_parameters()}
    want = torch.func.functional_call(fused, params, (x,))  # swaps the parameters in _parameters
    ln_w = params["recfuse_g0_ln_weight"]
    assert not torch.allclose(want, fused(x))
    with torch.no_grad():
        for k, v in params.items():
            fused.get_parameter(k).copy_(v)
    assert rel_err(fused(x), want) < 1e-5 and ln_w.shape[0] == 3


def test_read_attr_follows_parametrizations_class_attributes_and_custom_getattr():
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    model, fused, x = _per_feature_pair()
    parametrize.register_parametrization(fused.linear, "weight", Double())  # a property on a new class
    parametrize.register_parametrization(model.linear, "weight", Double())
    assert rel_err(fused(x), model(x)) < 1e-5
    del fused.linear.bias  # gone: nn.Module's own AttributeError
    with pytest.raises(AttributeError, match="bias"):
        fused(x)
    assert recfuse.fx.graph_module.read_attr(fused, ("training",)) is True
    with pytest.raises(AttributeError):
        recfuse.fx.graph_module.read_attr(fused, ("missing",))

    class Custom(torch.nn.Module):
        def __getattr__(self, name):
            return "custom" if name == "special" else super().__getattr__(name)

    m = Custom()
    m.lin = torch.nn.Linear(2, 2)
    assert recfuse.fx.graph_module.read_attr(m, ("special",)) == "custom"
    assert recfuse.fx.graph_module.read_attr(m, ("lin", "weight")) is m.lin.weight


def test_read_attr_graphs_survive_copies_pickles_and_compile():
    import copy

    model, fused, x = _per_feature_pair()
    for other in (copy.deepcopy(fused), reloaded(fused), torch.compile(fused, backend="eager")):
        assert rel_err(other(x), model(x)) < 1e-5
    again = reloaded(fused)
    assert "recfuse_fx_graph_module_read_attr" in again.code
    assert [n.target for n in again.graph.nodes if n.op == "get_attr"] == \
        [n.target for n in fused.graph.nodes if n.op == "get_attr"]
