"""The CUDA-graph replay rule (`recfuse.cuda_graph`), run on CPU with a stand-in recorder.

There is no GPU in CI, so `rerun_recorder` stands in for a captured graph with the same memory
semantics: the "graph" reads the tensors it was captured with at replay time and writes into the
outputs of the capture. Every result is checked against a direct call of the function, which is
what a replay must reproduce; the GPU run (benchmarks/split_stack_vs_combined.py) times the real
graphs and checks them against float64.
"""
import copy

import pytest
import torch
from torch.utils._pytree import tree_flatten

import recfuse
import recfuse.fx.replay
import recfuse.module
from recfuse.cuda_graph import CudaGraphCache, replay_applies
from recfuse.puzzler import SplitStack


def rerun_recorder(fn, args):
    out = fn(*args)
    leaves = tree_flatten(out)[0]

    def replay():
        for o, new in zip(leaves, tree_flatten(fn(*args))[0]):
            o.copy_(new)

    return replay, out


def affine_relu(x, scale, w):
    return torch.relu(x * scale + w)


@pytest.fixture
def cache():
    return CudaGraphCache(max_graphs=8, recorder=rerun_recorder)


def test_inputs_are_read_in_place_until_they_move_then_copied_in(cache):
    w = torch.randn(6)
    buf = torch.randn(4, 6)
    torch.testing.assert_close(cache.run(affine_relu, (buf, 2.0, w), [w]), affine_relu(buf, 2.0, w))
    buf.copy_(torch.randn(4, 6))  # the same buffer, refilled: the graph reads it where it is
    torch.testing.assert_close(cache.run(affine_relu, (buf, 2.0, w), [w]), affine_relu(buf, 2.0, w))
    assert cache.captures == 1 and cache.eager_calls == 0
    kept = buf.clone()
    other = torch.randn(4, 6)  # same signature, another address: copy-in from now on
    torch.testing.assert_close(cache.run(affine_relu, (other, 2.0, w), [w]), affine_relu(other, 2.0, w))
    assert cache.captures == 2
    torch.testing.assert_close(buf, kept)  # the caller's first buffer was never written
    for x in (buf, other, torch.randn(4, 6)):
        torch.testing.assert_close(cache.run(affine_relu, (x, 2.0, w), [w]), affine_relu(x, 2.0, w))
    assert cache.captures == 2 and len(cache) == 1


def test_results_still_held_are_never_overwritten(cache):
    w = torch.randn(6)
    buf = torch.empty(4, 6)
    inputs = [torch.randn(4, 6) for _ in range(4)]
    expected = [affine_relu(x, 3.0, w) for x in inputs]

    def call(i):
        buf.copy_(inputs[i])
        return cache.run(affine_relu, (buf, 3.0, w), [w])

    y0 = call(0)
    y1 = call(1)  # y0 still held: the second graph of the signature
    assert cache.captures == 2
    view1 = y1.view(-1)  # a view keeps y1's memory in use after y1 itself is dropped
    del y1
    y2 = call(2)  # both graphs' results held: computed without a graph
    assert cache.eager_calls == 1 and cache.captures == 2
    torch.testing.assert_close(y0, expected[0])
    torch.testing.assert_close(view1.view(4, 6), expected[1])
    torch.testing.assert_close(y2, expected[2])
    del y0, view1
    torch.testing.assert_close(call(3), expected[3])  # a graph is free again: replayed
    assert cache.captures == 2 and cache.eager_calls == 1


def test_the_usual_loop_alternates_two_graphs_without_copies(cache):
    w = torch.randn(6)
    buf = torch.empty(4, 6)
    y = None
    for i in range(6):
        x = torch.randn(4, 6)
        buf.copy_(x)
        y = cache.run(affine_relu, (buf, 1.0, w), [w])  # the previous y is held during the call
        torch.testing.assert_close(y, affine_relu(x, 1.0, w))
    assert cache.captures == 2 and cache.eager_calls == 0


def test_signature_changes_and_parameter_updates(cache):
    w = torch.randn(6)
    x = torch.randn(4, 6)
    cache.run(affine_relu, (x, 1.0, w), [w])
    with torch.no_grad():
        w.add_(0.5)  # an optimizer step: same graph, new values
    torch.testing.assert_close(cache.run(affine_relu, (x, 1.0, w), [w]), affine_relu(x, 1.0, w))
    assert cache.captures == 1
    cache.run(affine_relu, (x[:3], 1.0, w), [w])  # another batch size
    cache.run(affine_relu, (x, 2.0, w), [w])  # another scalar argument
    w2 = w.clone()  # a replaced parameter: new address
    torch.testing.assert_close(cache.run(affine_relu, (x, 1.0, w2), [w2]), affine_relu(x, 1.0, w2))
    assert cache.captures == 4
    from_list = lambda x, scales, w: affine_relu(x, scales[0], w)  # noqa: E731
    torch.testing.assert_close(cache.run(from_list, (x, [1.0], w), [w]), affine_relu(x, 1.0, w))
    # a list cannot be baked into a graph: a direct call
    assert cache.eager_calls == 1 and cache.captures == 4


def test_least_recently_used_graphs_are_dropped():
    cache = CudaGraphCache(max_graphs=2, recorder=rerun_recorder)
    w = torch.randn(6)
    xs = [torch.randn(b, 6) for b in (1, 2, 3)]
    for x in xs:
        cache.run(affine_relu, (x, 1.0, w), [w])
    assert len(cache) == 2 and cache.captures == 3
    cache.run(affine_relu, (xs[2], 1.0, w), [w])  # kept
    assert cache.captures == 3
    torch.testing.assert_close(cache.run(affine_relu, (xs[0], 1.0, w), [w]), affine_relu(xs[0], 1.0, w))
    assert cache.captures == 4  # dropped earlier: captured again
    with pytest.raises(ValueError, match="max_graphs must be >= 1"):
        CudaGraphCache(max_graphs=0)


def test_replay_applies_only_to_plain_inference_on_cuda():
    x = torch.randn(2, 3)
    assert not replay_applies([x], [])
    assert not replay_applies([], [])


def _replay_on_cpu(monkeypatch):
    """CPU tensors replay (the real `replay_applies`, the device type aside), so the integrations run here."""
    monkeypatch.setattr(recfuse.cuda_graph, "_DEVICE_TYPE", "cpu")


def _replaying_transform(monkeypatch, B, F, D, H):
    """SplitStack, its transform with cuda_graph=True replayed on CPU, and an input buffer."""
    _replay_on_cpu(monkeypatch)
    model = SplitStack(D, H)
    x = torch.randn(B * F * D)
    fused = recfuse.transform(model, (x, B, D), cuda_graph=True)
    fused.cuda_graphs.recorder = rerun_recorder
    return model, fused, x


def test_transform_with_cuda_graph_replays_inference_and_trains_as_usual(monkeypatch):
    B, F, D = 5, 3, 8
    model, fused, x = _replaying_transform(monkeypatch, B, F, D, 2)
    assert sorted(fused.state_dict()) == sorted(model.state_dict())
    with torch.no_grad():
        y = None
        for _ in range(3):
            x.copy_(torch.randn(B * F * D))
            y = fused(x, B, D)  # the previous y is still held during the call
            torch.testing.assert_close(y, model(x, B, D), rtol=1e-5, atol=1e-6)
        fused.linear.weight.mul_(-1.0)  # in-place update, seen by the replay
        model.linear.weight.mul_(-1.0)
        torch.testing.assert_close(fused(x, B, D), model(x, B, D), rtol=1e-5, atol=1e-6)
    assert fused.cuda_graphs.captures == 2  # the loop alternates two graphs, reading x in place
    # Training: no graph, gradients as the original's.
    xg = x.clone().requires_grad_(True)
    fused(xg, B, D).sum().backward()
    ref_x = x.clone().requires_grad_(True)
    model(ref_x, B, D).sum().backward()
    torch.testing.assert_close(xg.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    assert fused.cuda_graphs.captures == 2
    clone = copy.deepcopy(fused)  # copies start without graphs (CUDA graphs cannot be copied)
    assert len(clone.cuda_graphs) == 0
    with pytest.raises(TypeError, match="cuda_graph must be a bool"):
        recfuse.transform(model, (x, B, D), cuda_graph="yes")


def test_fused_feature_processor_cuda_graph_rule(monkeypatch):
    _replay_on_cpu(monkeypatch)
    fp = recfuse.FusedFeatureProcessor(["a", "b", "c"], 8, out_features=2, cuda_graph=True)
    fp._cuda_graphs.recorder = rerun_recorder
    with torch.no_grad():
        for p in fp.parameters():
            p.copy_(torch.randn_like(p))
    buf = torch.randn(4, 24)
    with torch.no_grad():
        y1 = fp(buf)
        buf2 = torch.randn(4, 24)
        y2 = fp(buf2)  # moved input: copy-in graph; y1 still held and unchanged
        torch.testing.assert_close(y1, fp.forward_reference(buf), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y2, fp.forward_reference(buf2), rtol=1e-5, atol=1e-6)
        x3 = torch.randn(3, 5, 8)
        torch.testing.assert_close(fp(x3, feature_dim=0), fp.forward_reference(x3, feature_dim=0),
                                   rtol=1e-5, atol=1e-6)
    assert fp._cuda_graphs.captures == 3
    y = fp(buf)  # parameters require grad and grad mode is on: the normal path
    assert y.requires_grad and fp._cuda_graphs.captures == 3


def test_module_tensors_follow_replaced_parameters_buffers_and_removed_modules():
    from recfuse.cuda_graph import ModuleTensors

    m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    m.register_buffer("scale", torch.ones(3))
    tensors = ModuleTensors(m)
    assert [t.shape for t in tensors()] == [(3, 2), (3,), (1, 3), (1,), (3,)]
    m[0].weight = torch.nn.Parameter(torch.zeros(3, 2))  # replaced, not updated in place
    m.scale = torch.full((3,), 2.0)
    now = tensors()
    assert now[0] is m[0].weight and now[-1] is m.scale
    del m[1]  # a name that no longer resolves: the names are read again
    assert [t.shape for t in tensors()] == [(3, 2), (3,), (3,)]


def test_transform_replay_sees_a_replaced_parameter(monkeypatch):
    B, F, D = 4, 2, 8
    model, fused, x = _replaying_transform(monkeypatch, B, F, D, 1)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, B, D), model(x, B, D), rtol=1e-5, atol=1e-6)
        new_weight = torch.nn.Parameter(torch.randn(1, D))
        fused.linear.weight = new_weight
        model.linear.weight = new_weight
        torch.testing.assert_close(fused(x, B, D), model(x, B, D), rtol=1e-5, atol=1e-6)
    assert fused.cuda_graphs.captures == 2


# --- the last signature's fast path (CudaGraphCache.call / _replay_last) ---------------------


class Scale(torch.nn.Module):
    """A parameter and a buffer, read by the graph where they are, as a module's are."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6))
        self.register_buffer("shift", torch.randn(6))

    def forward(self, x, scale):
        return torch.relu(x * scale * self.weight.to(x.dtype) + self.shift.to(x.dtype))


def counting_recorder(counts):
    """`rerun_recorder`, counting replays: a call served by a graph adds one."""

    def recorder(fn, args):
        replay, out = rerun_recorder(fn, args)

        def counted():
            counts["replays"] += 1
            replay()

        return counted, out

    return recorder


class _Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _move(t):
    t.set_(torch.randn(4, 6))  # the same tensor object, now at another address


def _restride(t):
    t.as_strided_((4, 6), (1, 4))  # the same object and address, other strides


# change(m, buf) -> the call's args (after changing what the case changes); the expected outcome:
# "replay" (the warm graph), "capture" (a new graph) or "direct" (no graph: fn called).
FAST_PATH_CASES = {
    "same call": (lambda m, buf: (buf, 2.0), "replay"),
    "input refilled in place": (lambda m, buf: (buf.copy_(torch.randn(4, 6)), 2.0), "replay"),
    "parameter updated in place": (lambda m, buf: (m.weight.mul_(-2.0) is None or buf, 2.0), "replay"),
    "input at another address": (lambda m, buf: (torch.randn(4, 6), 2.0), "capture"),
    "input object moved (set_)": (lambda m, buf: (_move(buf) or buf, 2.0), "capture"),
    "input restrided in place": (lambda m, buf: (_restride(buf) or buf, 2.0), "capture"),
    "another shape": (lambda m, buf: (buf[:3], 2.0), "capture"),
    "other strides": (lambda m, buf: (torch.randn(6, 4).t(), 2.0), "capture"),
    "another dtype": (lambda m, buf: (buf.double(), 2.0), "capture"),
    "another scalar value": (lambda m, buf: (buf, 3.0), "capture"),
    "a scalar of another type": (lambda m, buf: (buf, 2), "capture"),
    "parameter .data replaced": (lambda m, buf: (setattr(m.weight, "data", torch.randn(6)) or buf, 2.0), "capture"),
    "parameter replaced": (
        lambda m, buf: (setattr(m, "weight", torch.nn.Parameter(torch.randn(6))) or buf, 2.0), "capture"),
    "buffer replaced": (lambda m, buf: (setattr(m, "shift", torch.randn(6)) or buf, 2.0), "capture"),
    "grad mode on, parameter requires grad": (lambda m, buf: (buf, 2.0), "direct"),
    "grad mode on, input requires grad": (
        lambda m, buf: (m.requires_grad_(False) and buf.clone().requires_grad_(), 2.0), "direct"),
    "grad mode on, nothing requires grad": (lambda m, buf: (m.requires_grad_(False) and buf, 2.0), "replay"),
    "autocast": (lambda m, buf: (buf, 2.0), "direct"),
    "dispatch mode": (lambda m, buf: (buf, 2.0), "direct"),
    "torch.compile tracing": (lambda m, buf: (buf, 2.0), "direct"),
}


@pytest.mark.parametrize("case", list(FAST_PATH_CASES))
def test_fast_path_replays_only_what_the_full_rule_would(monkeypatch, case):
    _replay_on_cpu(monkeypatch)
    signatures = []
    full_signature = recfuse.cuda_graph._signature
    monkeypatch.setattr(recfuse.cuda_graph, "_signature", lambda *a: signatures.append(1) or full_signature(*a))
    counts = {"replays": 0}
    cache = CudaGraphCache(recorder=counting_recorder(counts))
    m = Scale()
    tensors_of = recfuse.cuda_graph.ModuleTensors(m)
    buf = torch.randn(4, 6)
    with torch.no_grad():
        for _ in range(3):  # captured, then replayed from the fast path: no signature built
            torch.testing.assert_close(cache.call(m, (buf, 2.0), tensors_of()), m(buf, 2.0))
        assert (cache.captures, counts["replays"], len(signatures)) == (1, 3, 1)
        change, expected = FAST_PATH_CASES[case]
        context = {
            "autocast": torch.autocast("cpu", dtype=torch.bfloat16),
            "dispatch mode": _Passthrough(),
        }.get(case, torch.enable_grad() if case.startswith("grad mode on") else torch.no_grad())
        if case == "torch.compile tracing":
            monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
        args = change(m, buf)
        with context:
            y = cache.call(m, args, tensors_of())
            direct = m(*args)
    torch.testing.assert_close(y, direct)
    outcome = {(1, 4): "replay", (2, 4): "capture", (1, 3): "direct"}[(cache.captures, counts["replays"])]
    assert outcome == expected
    if case == "grad mode on, parameter requires grad":
        assert y.requires_grad


def test_fast_path_keeps_the_least_recently_used_order():
    counts = {"replays": 0}
    cache = CudaGraphCache(max_graphs=2, recorder=counting_recorder(counts))
    w = torch.randn(6)
    a, b, c = torch.randn(1, 6), torch.randn(2, 6), torch.randn(3, 6)
    with torch.no_grad():
        cache.run(affine_relu, (a, 1.0, w), [w])
        cache.run(affine_relu, (b, 1.0, w), [w])
        for _ in range(3):  # a again: the full path once, then the fast path; a is the newest
            cache.run(affine_relu, (a, 1.0, w), [w])
        cache.run(affine_relu, (c, 1.0, w), [w])  # drops b, the least recently used
        assert cache.captures == 3
        torch.testing.assert_close(cache.run(affine_relu, (a, 1.0, w), [w]), affine_relu(a, 1.0, w))
        assert cache.captures == 3  # a was kept
        torch.testing.assert_close(cache.run(affine_relu, (b, 1.0, w), [w]), affine_relu(b, 1.0, w))
        assert cache.captures == 4


def test_fast_path_never_overwrites_held_results_and_alternates(monkeypatch):
    _replay_on_cpu(monkeypatch)
    cache = CudaGraphCache(recorder=rerun_recorder)
    m = Scale()
    buf = torch.empty(4, 6)
    inputs = [torch.randn(4, 6) for _ in range(5)]
    with torch.no_grad():
        held = []
        for x in inputs[:3]:
            buf.copy_(x)
            held.append(cache.call(m, (buf, 1.0), list(m.parameters()) + [m.shift]))
        assert cache.captures == 2 and cache.eager_calls == 1  # the third: both graphs held
        for x, y in zip(inputs, held):
            torch.testing.assert_close(y, m(x, 1.0))
        del held
        y = None
        for x in inputs:  # the usual loop: the two graphs alternate from the fast path
            buf.copy_(x)
            y = cache.call(m, (buf, 1.0), list(m.parameters()) + [m.shift])
            torch.testing.assert_close(y, m(x, 1.0))
        assert cache.captures == 2 and cache.eager_calls == 1


def test_call_runs_directly_under_vmap_and_on_cpu(monkeypatch):
    cache = CudaGraphCache(recorder=rerun_recorder)
    m = Scale()
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(cache.call(m, (x, 2.0), list(m.parameters())), m(x, 2.0))  # CPU: direct
        assert cache.captures == 0
        _replay_on_cpu(monkeypatch)
        cache.call(m, (x, 2.0), list(m.parameters()))
        assert cache.captures == 1
        batched = torch.randn(3, 4, 6)
        out = torch.vmap(lambda xb: cache.call(m, (xb, 2.0), list(m.parameters())))(batched)
        torch.testing.assert_close(out, torch.stack([m(b, 2.0) for b in batched]))
        assert cache.captures == 1


def test_replay_applies_checks_the_call_state(monkeypatch):
    _replay_on_cpu(monkeypatch)
    x, w = torch.randn(2, 3), torch.nn.Parameter(torch.randn(3))
    with torch.no_grad():
        assert replay_applies([x], [w])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not replay_applies([x], [w])
        with _Passthrough():
            assert not replay_applies([x], [w])
        assert not replay_applies([w], [])  # a Parameter (a tensor subclass) as an input
    assert not replay_applies([x], [w])  # grad mode on, w requires grad
    assert replay_applies([x], [w.detach()])
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert not replay_applies([x], [])


def test_module_tensors_follow_slots_set_from_none_and_new_names():
    import pickle

    from recfuse.cuda_graph import ModuleTensors

    m = torch.nn.Linear(2, 3, bias=False)
    tensors = ModuleTensors(m)
    assert [t.shape for t in tensors()] == [(3, 2)]
    m.bias = torch.nn.Parameter(torch.zeros(3))  # was None: now part of the key
    assert [t.shape for t in tensors()] == [(3, 2), (3,)]
    m.register_parameter("extra", torch.nn.Parameter(torch.ones(4)))  # a new name in a watched dict
    assert [t.shape for t in tensors()] == [(3, 2), (3,), (4,)]
    m.bias = None
    assert [t.shape for t in tensors()] == [(3, 2), (4,)]
    copy_ = pickle.loads(pickle.dumps(tensors))  # the compiled reader is made again
    assert [t.shape for t in copy_()] == [(3, 2), (4,)]


def test_transform_replay_sees_parameter_data_replaced_and_reports_eager_errors(monkeypatch):
    B, F, D = 4, 2, 8
    model, fused, x = _replaying_transform(monkeypatch, B, F, D, 1)
    assert type(fused).__call__ is recfuse.fx.replay.CudaGraphReplayModule._replay_call
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fused(x, B, D), model(x, B, D), rtol=1e-5, atol=1e-6)
        assert fused.cuda_graphs.captures == 1
        new = torch.randn(1, D)
        fused.linear.weight.data = new.clone()  # the same Parameter object at a new address
        model.linear.weight.data = new.clone()
        torch.testing.assert_close(fused(x, B, D), model(x, B, D), rtol=1e-5, atol=1e-6)
        assert fused.cuda_graphs.captures == 2
        torch.testing.assert_close(fused(input_data=x), model(x, B, D), rtol=1e-5, atol=1e-6)
        assert fused.cuda_graphs.captures == 2  # keyword arguments: run as usual
        with pytest.raises(RuntimeError):
            fused(x[:-1], B, D)  # the graph's own error, through GraphModule's wrapped call


def test_fused_feature_processor_sees_parameter_data_replaced(monkeypatch):
    _replay_on_cpu(monkeypatch)
    fp = recfuse.FusedFeatureProcessor(["a", "b"], 8, out_features=2, cuda_graph=True)
    fp._cuda_graphs.recorder = rerun_recorder
    buf = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(fp(buf), fp.forward_reference(buf), rtol=1e-5, atol=1e-6)
        assert fp._cuda_graphs.captures == 1
        fp.weight.data = torch.randn_like(fp.weight)
        torch.testing.assert_close(fp(buf), fp.forward_reference(buf), rtol=1e-5, atol=1e-6)
        assert fp._cuda_graphs.captures == 2
        with pytest.raises(ValueError, match=r"must be \[B, 16\]"):
            fp(torch.randn(4, 12))


def test_a_signature_used_after_another_ran_eagerly_is_still_the_newest():
    cache = CudaGraphCache(max_graphs=3, recorder=rerun_recorder)
    w = torch.randn(6)
    j, k, l_ = torch.randn(1, 6), torch.randn(2, 6), torch.randn(3, 6)
    with torch.no_grad():
        cache.run(affine_relu, (j, 1.0, w), [w])
        held = [cache.run(affine_relu, (k, 1.0, w), [w]) for _ in range(2)]  # k: two graphs, both held
        cache.run(affine_relu, (j, 1.0, w), [w])
        cache.run(affine_relu, (k, 1.0, w), [w])  # both of k's results held: run directly
        assert cache.captures == 3 and cache.eager_calls == 1
        cache.run(affine_relu, (j, 1.0, w), [w])  # j is now the most recently used signature
        cache.run(affine_relu, (l_, 1.0, w), [w])  # room for l: one of k's graphs goes, not j's
        assert cache.captures == 4
        torch.testing.assert_close(cache.run(affine_relu, (j, 1.0, w), [w]), affine_relu(j, 1.0, w))
        assert cache.captures == 4
        for y in held:
            torch.testing.assert_close(y, affine_relu(k, 1.0, w))
