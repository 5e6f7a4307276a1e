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


def _cpu_replay_applies(tensors, params):
    """`replay_applies` without the CUDA requirement, so the integrations run here."""
    return bool(tensors) and not (torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *params)))


def _replaying_transform(monkeypatch, B, F, D, H):
    """SplitStack, its transform with cuda_graph=True replayed on CPU, and an input buffer."""
    monkeypatch.setattr(recfuse.fx.replay, "replay_applies", _cpu_replay_applies)
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
    monkeypatch.setattr(recfuse.module, "replay_applies", _cpu_replay_applies)
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
