"""Shared helpers of the graph-pass tests: a configurable per-feature model and an equivalence check
against the untransformed model run in float64."""
from __future__ import annotations

import copy
import inspect
import io

import torch
import torch.nn.functional as F
from torch import nn

import recfuse
from recfuse.ops import ln_tanh_linear_relu as op_fn


def reloaded(module):
    """``module`` after a torch.save / torch.load round trip (weights_only=False: a whole module)."""
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def count_recfuse(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and (
        n.target is op_fn or n.target is torch.ops.recfuse.ln_tanh_linear_relu.default
        or n.target is torch.ops.recfuse.ln_tanh_linear_relu))


def count_layer_norm(gm) -> int:
    k = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (F.layer_norm, torch.layer_norm):
            k += 1
        elif n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.LayerNorm):
            k += 1
    return k


class PerFeature(nn.Module):
    """A per-feature model whose spelling is chosen by arguments (used by corpus and hypothesis).

    source: 'split_int' | 'split_list' | 'chunk' | 'tensor_split' | 'index' | 'narrow' (x [B, F*D]),
            'unbind' (x [B, F, D]), 'rows' (x [F*B, D] split on dim 0), 'dict' ({name: [B, D]}).
    ln: 'per_slice' (ModuleList), 'shared' (one module), 'functional' (F.layer_norm), 'dict' (ModuleDict).
    tail: 'none', 'after' (stack -> Linear -> relu), 'per_slice' (Linear per slice + relu before stack),
          'shared_in_chain' (one Linear applied per slice + relu).
    sink: 'stack' or 'cat_view' (cat on dim 1 then view to [B, F, D]).
    """

    def __init__(self, F_=3, D=8, H=2, source="split_int", ln="per_slice", affine=True, eps=1e-5,
                 tail="after", stack_dim=0, order=None, sink="stack", act="tanh"):
        super().__init__()
        self.F, self.D, self.H = F_, D, H
        self.source, self.ln_kind, self.tail, self.stack_dim, self.sink = source, ln, tail, stack_dim, sink
        self.order = list(order) if order is not None else list(range(F_))
        self.eps = eps
        self.names = [f"f{i}" for i in range(F_)]
        self.act = act
        if ln == "per_slice":
            self.lns = nn.ModuleList([nn.LayerNorm(D, eps=eps, elementwise_affine=affine) for _ in range(F_)])
        elif ln == "dict":
            self.lns = nn.ModuleDict({n: nn.LayerNorm(D, eps=eps, elementwise_affine=affine) for n in self.names})
        elif ln == "shared":
            self.ln = nn.LayerNorm(D, eps=eps, elementwise_affine=affine)
        if tail == "per_slice":
            self.lins = nn.ModuleList([nn.Linear(D, H) for _ in range(F_)])
        elif tail in ("after", "shared_in_chain"):
            self.lin = nn.Linear(D, H)
        for m in self.modules():  # non-trivial affine parameters
            if isinstance(m, nn.LayerNorm) and m.weight is not None:
                with torch.no_grad():
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)

    def _slices(self, x):
        Fn, D = self.F, self.D
        s = self.source
        if s == "split_int":
            parts = torch.split(x, D, dim=1)
        elif s == "split_list":
            parts = x.split([D] * Fn, 1)
        elif s == "chunk":
            parts = x.chunk(Fn, dim=1)
        elif s == "tensor_split":
            parts = torch.tensor_split(x, Fn, dim=1)
        elif s == "index":
            parts = [x[:, i * D:(i + 1) * D] for i in range(Fn)]
        elif s == "narrow":
            parts = [x.narrow(1, i * D, D) for i in range(Fn)]
        elif s == "unbind":
            parts = x.unbind(1)
        elif s == "rows":
            parts = torch.split(x, x.shape[0] // Fn, dim=0)
        elif s == "dict":
            parts = [x[n] for n in self.names]
        else:
            raise ValueError(s)
        return parts

    def _ln(self, i, s):
        if self.ln_kind == "per_slice":
            return self.lns[i](s)
        if self.ln_kind == "dict":
            return self.lns[self.names[i]](s)
        if self.ln_kind == "shared":
            return self.ln(s)
        return F.layer_norm(s, (self.D,), eps=self.eps)

    def forward(self, x):
        parts = self._slices(x)
        outs = []
        for i in self.order:
            h = self._ln(i, parts[i])
            h = torch.tanh(h) if self.act == "tanh" else h.tanh()
            if self.tail == "per_slice":
                h = F.relu(self.lins[i](h))
            elif self.tail == "shared_in_chain":
                h = torch.relu(self.lin(h))
            outs.append(h)
        if self.sink == "stack":
            y = torch.stack(outs, dim=self.stack_dim)
        else:
            y = torch.cat(outs, dim=1)
            y = y.view(y.shape[0], len(outs), -1)
        if self.tail == "after":
            y = F.relu(self.lin(y))
        return y

    def example(self, B=3, dtype=torch.float32):
        Fn, D = self.F, self.D
        if self.source == "unbind":
            return (torch.randn(B, Fn, D, dtype=dtype),)
        if self.source == "rows":
            return (torch.randn(Fn * B, D, dtype=dtype),)
        if self.source == "dict":
            return ({n: torch.randn(B, D, dtype=dtype) for n in self.names},)
        return (torch.randn(B, Fn * D, dtype=dtype),)


def _leaves(args, dtype):
    def conv(v):
        if isinstance(v, torch.Tensor):
            return v.detach().to(dtype).requires_grad_(True)
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, nn.Module):
            return copy.deepcopy(v).to(dtype)
        return v
    return tuple(conv(v) for v in args)


def _tensors(args):
    out = []
    for v in args:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out.extend(v.values())
    return out


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def assert_equivalent(model, gm, fresh_args, tol=1e-5):
    """Outputs, input gradients and parameter gradients of `gm` (fp32) match `model` run in float64."""
    if isinstance(model, nn.Module):
        ref = copy.deepcopy(model).double()
        ref_args = _leaves(fresh_args, torch.float64)
        ref_params = dict(ref.named_parameters())
    else:
        ref = model
        ref_args = _leaves(fresh_args, torch.float64)
        names = list(inspect.signature(model).parameters)
        ref_params = {f"{n}.{k}": p for n, v in zip(names, ref_args) if isinstance(v, nn.Module)
                      for k, p in v.named_parameters()}
    args = _leaves(fresh_args, torch.float32)
    # gm owns copies of module arguments and refuses other modules: pass none.
    args = tuple(None if isinstance(v, nn.Module) else v for v in args)
    y_ref = ref(*ref_args)
    y = gm(*args)
    assert _rel(y, y_ref) < tol
    cot = torch.randn(y.shape, dtype=torch.float64)
    params = dict(gm.named_parameters())
    stacked = getattr(gm, "_recfuse_stacked", {})
    g_ref = torch.autograd.grad(y_ref, _tensors(ref_args) + list(ref_params.values()), cot, allow_unused=True)
    g = torch.autograd.grad(y, _tensors(args) + list(params.values()), cot.float(), allow_unused=True)
    n_in = len(_tensors(args))
    for a, b in zip(g[:n_in], g_ref[:n_in]):
        assert _rel(a, b) < tol
    grads_ref = dict(zip(ref_params, g_ref[n_in:]))
    checked = 0
    for name, gr in zip(params, g[n_in:]):
        if name in stacked:
            want = torch.stack([grads_ref[o] for o in stacked[name]])
        else:
            want = grads_ref[name]
        assert gr is not None, name
        assert _rel(gr, want) < tol, name
        checked += 1
    assert checked == len(params)
    assert set(ref_params) == {o for olds in stacked.values() for o in olds} | (set(params) - set(stacked))


def randomized(m: nn.Module) -> nn.Module:
    """`m` with every parameter moved by 0.3 * randn (seed 1): LayerNorm's ones and zeros would hide
    a feature that reads another feature's parameters."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def assert_same_tensor(got, want, tol=1e-5):
    """Same shape and dtype, and values within `tol` (absolute and relative)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def forward_backward(model, x):
    """Output and d(sum(y^2))/dx of `model` on a fresh leaf copy of `x`."""
    x = x.detach().clone().requires_grad_()
    y = model(x)
    (y.float() ** 2).sum().backward()
    return y.detach(), x.grad


def assert_same_forward_backward(g, ref, x):
    """The transformed `g` and the untouched `ref`: the same output and input gradient on `x`."""
    yg, gg = forward_backward(g, x)
    yr, gr = forward_backward(ref, x)
    assert_same_tensor(yg, yr)
    assert_same_tensor(gg, gr, 1e-4)


def train_side_by_side(fused, ref_fn, ref_params, width, steps=2, lr=0.3):
    """`steps` SGD steps (loss sum(y^2)) of `fused` and of `ref_fn` (x -> y, trained through
    `ref_params`) on the same random [4, width] batches; then both agree on a fresh [5, width] one."""
    opt_f = torch.optim.SGD([p for p in fused.parameters() if p.requires_grad], lr=lr)
    opt_r = torch.optim.SGD([p for p in ref_params if p.requires_grad], lr=lr)
    for _ in range(steps):
        x = torch.randn(4, width)
        opt_f.zero_grad()
        opt_r.zero_grad()
        (fused(x) ** 2).sum().backward()
        (ref_fn(x) ** 2).sum().backward()
        opt_f.step()
        opt_r.step()
    x = torch.randn(5, width)
    with torch.no_grad():
        assert_same_tensor(fused(x), ref_fn(x), 1e-4)


# The small per-feature model the trust tests subclass: F_ features of width D_ (4 x 8), one
# LayerNorm each, a shared Linear to H_ (3) outputs; `ln_tanh_chain` is its plain forward.
F_, D_, H_ = 4, 8, 3


def ln_tanh_chain(lns, lin, x, D=D_):
    return torch.relu(lin(torch.stack([torch.tanh(n(t)) for n, t in zip(lns, x.split(D, 1))], 1)))


class PerFeatureBase(nn.Module):
    """`F` LayerNorms of width `D` (``lns``) and a Linear(D, H) shared by all features (``lin``), or
    with ``per_feature_linear`` one Linear(D, H) a feature (``lins``); subclasses add the forward."""

    def __init__(self, F=F_, D=D_, H=H_, per_feature_linear=False):
        super().__init__()
        self.lns = nn.ModuleList([nn.LayerNorm(D) for _ in range(F)])
        if per_feature_linear:
            self.lins = nn.ModuleList([nn.Linear(D, H) for _ in range(F)])
        else:
            self.lin = nn.Linear(D, H)


class PerFeatureChain(PerFeatureBase):
    """`PerFeatureBase` computing `ln_tanh_chain`: slices -> LayerNorm -> tanh -> stack -> Linear -> relu."""

    def forward(self, x):
        return ln_tanh_chain(self.lns, self.lin, x, self.lin.in_features)


class RandomizedPerFeatureChain(PerFeatureChain):
    """`PerFeatureChain` with every parameter moved off its default (0.3 * randn added)."""

    def __init__(self, F=F_, D=D_, H=H_):
        super().__init__(F, D, H)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.3 * torch.randn_like(p))


class GradReverse(torch.autograd.Function):
    """Identity forward, negated gradient (a DANN-style gradient-reversal layer)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g
