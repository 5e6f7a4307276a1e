"""`transform` traces the per-feature leaves with the original's parameters (issue 16: not copying
the 10,000 LayerNorms fusion prunes). The original must stay bit-identical whatever the model's
forward does to those parameters while it is traced, and the result must own every tensor it
keeps."""
import copy

import pytest
import torch
from torch import nn

import recfuse
from recfuse.fx import capture as cap


def fingerprint(model: nn.Module) -> list:
    """Everything of the model's tensors a trace could change: bits, layout, storage, version,
    autograd flags, gradient, hooks."""
    out = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out.append((name, t.detach().contiguous().view(torch.uint8).clone(), t.dtype, tuple(t.shape), t.stride(),
                    t.storage_offset(), t.data_ptr(), t._version, t.requires_grad, t.grad,
                    t._backward_hooks, type(t)))
    return out


def assert_untouched(model, before, deep):
    after = fingerprint(model)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert a[0] == b[0]
        assert torch.equal(a[1], b[1]), f"{a[0]} changed"
        assert a[2:6] == b[2:6] and a[6] == b[6] and a[7] == b[7] and a[8] == b[8], f"{a[0]} metadata changed"
        assert a[9] is b[9] and a[10] is b[10] and a[11] is b[11], f"{a[0]} grad/hooks/type changed"
    for (k, v), (k2, v2) in zip(model.state_dict().items(), deep.state_dict().items()):
        assert k == k2 and torch.equal(v.view(torch.uint8), v2.view(torch.uint8))
    for m, d in zip(model.modules(), deep.modules()):
        assert m.training == d.training and type(m) is type(d)
        assert len(m._forward_hooks) == len(d._forward_hooks)
        assert len(m._forward_pre_hooks) == len(d._forward_pre_hooks)


def assert_owns_its_tensors(gm, model):
    originals = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        assert t.untyped_storage().data_ptr() not in originals, f"{name} shares storage with the original"


class Mutating(nn.Module):
    """Per-feature LayerNorms; forward changes a per-feature parameter in place (`how`)."""

    def __init__(self, how: str, features: int = 4, dim: int = 8):
        super().__init__()
        self.how, self.dim = how, dim
        self.lns = nn.ModuleList([nn.LayerNorm(dim) for _ in range(features)])
        self.out = nn.Linear(dim, 2)
        with torch.no_grad():
            for ln in self.lns:
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        if self.how == "data":  # through the graph: a get_attr node, `.data`, mul_
            self.lns[0].weight.data.mul_(1.5)
        elif self.how == "no_grad":  # through the graph: add_ under no_grad
            with torch.no_grad():
                self.lns[1].bias.add_(0.25)
        elif self.how == "parameters":  # around the graph: the real tensors, through .parameters()
            for p in self.lns[2].parameters():
                p.data.add_(0.1)
        elif self.how == "parameters_no_grad":  # around the graph, bumping the version counters
            with torch.no_grad():
                for p in self.lns[2].parameters():
                    p.mul_(1.1)
        elif self.how == "swap":  # around the graph: a new storage
            for p in self.lns[3].parameters():
                p.data = p.data * 2
        elif self.how == "requires_grad":  # around the graph: an autograd flag
            for p in self.lns[3].parameters():
                p.requires_grad_(False)
        ys = [torch.tanh(ln(t)) for ln, t in zip(self.lns, x.split(self.dim, 1))]
        return torch.relu(self.out(torch.stack(ys, 1)))


@pytest.mark.parametrize("how", ["data", "no_grad"])
def test_inplace_update_of_a_parameter_in_forward_leaves_the_original_bit_identical(how):
    torch.manual_seed(0)
    model = Mutating(how)
    deep = copy.deepcopy(model)  # made before: what the original must still be
    before = fingerprint(model)
    x = torch.randn(3, 32)
    gm = recfuse.transform(model, (x,))
    assert_untouched(model, before, deep)
    assert_owns_its_tensors(gm, model)
    # The result starts from the original's state (not from the state the trace left): both update
    # their parameter on each call and stay equal, call after call.
    for _ in range(3):
        with torch.no_grad():
            want, got = model(x), gm(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["parameters", "parameters_no_grad", "swap", "requires_grad"])
def test_update_around_the_graph_is_detected_restored_and_captured_on_a_copy(how):
    torch.manual_seed(0)
    model = Mutating(how)
    deep = copy.deepcopy(model)
    before = fingerprint(model)
    x = torch.randn(3, 32)
    gm, facts = cap.capture(model, (x,), share_leaves=True)
    assert facts["shared"] == []  # the guard saw the change: captured again on a full copy
    assert_untouched(model, before, deep)
    gm = recfuse.transform(model, (x,))
    assert_untouched(model, before, deep)
    assert_owns_its_tensors(gm, model)


def test_plain_model_shares_its_leaves_while_tracing_and_the_result_owns_its_tensors():
    torch.manual_seed(0)
    model = Mutating("none", features=6)
    deep, before = copy.deepcopy(model), fingerprint(model)
    x = torch.randn(3, 48)
    pending, facts = cap.capture(model, (x,), share_leaves=True)
    assert isinstance(pending, cap.PendingModule)
    assert len(facts["shared"]) == 14  # 6 LayerNorms and the Linear, two parameters each
    assert all(any(s is p for p in model.parameters()) for s in facts["shared"])
    assert pending.root.lns[0] is not model.lns[0] and pending.root.lns[0].weight is model.lns[0].weight
    gm = recfuse.transform(model, (x,))
    assert_untouched(model, before, deep)
    assert_owns_its_tensors(gm, model)
    assert len(gm.recfuse_report.groups) == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)
    # Training the result leaves the original alone.
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    gm(x).sum().backward()
    opt.step()
    assert_untouched(model, before, deep)


def test_unfused_leaves_the_result_keeps_are_copies():
    # One feature: nothing to fuse, the result keeps the LayerNorm and the Linear; their tensors
    # were the original's during the trace and must be copies in the result.
    model = nn.Sequential(nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))
    deep, before = copy.deepcopy(model), fingerprint(model)
    x = torch.randn(3, 8)
    gm = recfuse.transform(model, (x,))
    assert_untouched(model, before, deep)
    assert_owns_its_tensors(gm, model)
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    with torch.no_grad():
        for p in gm.parameters():
            p.add_(1.0)
    assert_untouched(model, before, deep)
    gm.get_submodule("0").register_forward_hook(lambda *a: None)
    assert not model[0]._forward_hooks


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(8) for _ in range(4)])
        self.head = nn.Linear(8, 8)  # shared while tracing too
        self.bil = nn.Bilinear(8, 8, 8)  # copied (no leaf class of ours)
        self.lns[1].weight = self.head.bias  # tied across two shared leaves
        self.lns[3].weight = self.bil.bias  # tied with a copied module
        self.register_buffer("view", self.lns[2].bias.detach()[:4])  # a buffer in a leaf's storage

    def forward(self, x):
        ys = [torch.tanh(ln(t)) for ln, t in zip(self.lns, x.split(8, 1))]
        return torch.stack(ys, 1) + self.view.sum() + self.head.weight.sum() + self.bil.weight.sum()


def report_text(gm):
    r = gm.recfuse_report
    return [(g.where, g.ops, g.mode, sorted(g.stacked_params), list(g.notes)) for g in r.groups], \
        [(m.where, m.reason) for m in r.near_misses]


def test_tied_and_storage_sharing_leaves_transform_as_with_a_full_copy(monkeypatch):
    torch.manual_seed(0)
    model = Tied()
    x = torch.randn(2, 32)
    deep, before = copy.deepcopy(model), fingerprint(model)
    _, facts = cap.capture(model, (x,), share_leaves=True)
    shared = {id(t) for t in facts["shared"]}
    assert id(model.lns[2].bias) not in shared  # its storage holds another tensor: copied as before
    assert id(model.lns[0].weight) in shared
    gm = recfuse.transform(model, (x,))
    assert_untouched(model, before, deep)
    assert_owns_its_tensors(gm, model)
    # ties stay ties in the result, as with a full copy
    assert gm.get_parameter("lns.1.weight") is gm.get_parameter("head.bias")
    assert gm.get_parameter("lns.3.weight") is gm.get_parameter("bil.bias")
    monkeypatch.setattr(cap, "_SHAREABLE_LEAVES", frozenset())  # the full copy of before
    full = recfuse.transform(model, (x,))
    assert report_text(gm) == report_text(full)
    assert sorted(gm.state_dict()) == sorted(full.state_dict())
    for (k, a), (_, b) in zip(sorted(gm.state_dict().items()), sorted(full.state_dict().items())):
        assert torch.equal(a, b), k
    with torch.no_grad():
        torch.testing.assert_close(gm(x), full(x), rtol=0, atol=0)
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_benchmark_model_transforms_as_with_a_full_copy(monkeypatch):
    torch.manual_seed(0)
    model = Mutating("none", features=16)
    x = torch.randn(4, 128)
    gm = recfuse.transform(model, (x,))
    monkeypatch.setattr(cap, "_SHAREABLE_LEAVES", frozenset())
    full = recfuse.transform(model, (x,))
    assert gm.code == full.code
    assert report_text(gm) == report_text(full)
    for (k, a), (k2, b) in zip(gm.state_dict().items(), full.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in full.named_parameters()]


def test_leaves_with_hooks_are_copied_and_their_hooks_run():
    model = Mutating("none")
    calls = []
    model.lns[0].register_forward_hook(lambda m, i, o: calls.append(m))
    model.lns[1].weight.register_hook(lambda g: g * 2)
    model.lns[3].register_forward_pre_hook(lambda m, i: None)
    x = torch.randn(3, 32)
    for _ in range(2):  # the second time, through the layout `_shallow_leaf` learnt for the class
        _, facts = cap.capture(model, (x,), share_leaves=True)
        shared = {id(t) for t in facts["shared"]}
        assert id(model.lns[0].weight) not in shared and id(model.lns[1].weight) not in shared
        assert id(model.lns[3].weight) not in shared and id(model.lns[3].bias) not in shared
        assert id(model.lns[2].weight) in shared
    calls.clear()
    gm = recfuse.transform(model, (x,))
    calls.clear()
    gm(x)
    assert len(calls) == 1 and calls[0] is not model.lns[0]


def test_guard_restores_values_storage_version_and_flags():
    p = nn.Parameter(torch.arange(6.0))
    q = nn.Parameter(torch.ones(2, 3))
    ptr, version, st = p.data_ptr(), p._version, p.untyped_storage()
    guard = cap._SharedGuard([p, q])
    assert not guard.changed()
    p.data = p.data * 3
    with torch.no_grad():
        q.add_(1)
    q.requires_grad_(False)
    assert guard.changed()
    guard.restore()
    assert not guard.changed()
    assert p.data_ptr() == ptr and p._version == version and torch.equal(p, torch.arange(6.0))
    assert p.untyped_storage().data_ptr() == st.data_ptr()
    assert torch.equal(q, torch.ones(2, 3)) and q.requires_grad and q._version == 0
