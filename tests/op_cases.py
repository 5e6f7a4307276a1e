"""Builds inputs for the fused op and checks it against the float64 per-slice reference.

Used by the op tests (CPU composite) and the kernel tests (Triton interpreter, GPU): the same
matrix of cases runs on every path.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import pytest
import torch

import recfuse
from recfuse.chain import chain_of
from recfuse.ops import configs, launch

# ||out - ref|| / ||ref|| bounds from the design notes.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float64: 1e-12}


@dataclass(frozen=True)
class Case:
    F: int
    B: int
    D: int
    H: int
    feature_dim: int = 0
    per_feature_weight: bool = False
    bias: str = "shared"          # "none" | "shared" | "per_feature"
    ln: str = "per_feature"        # "none" | "shared" | "per_feature" (affine weight and bias)
    eps: float = 1e-5
    strided_view: bool = False     # x is a [B, F*D] buffer viewed as [B, F, D] (feature_dim=1)

    def __str__(self):
        return (f"F{self.F}B{self.B}D{self.D}H{self.H}fd{self.feature_dim}"
                f"{'-Wf' if self.per_feature_weight else ''}-b{self.bias}-ln{self.ln}-eps{self.eps}"
                f"{'-view' if self.strided_view else ''}")


def make_inputs(case: Case, device="cpu", generator=None):
    """float64 master copies of (x, weight, bias, ln_weight, ln_bias, grad_y)."""
    g = generator
    kw = dict(dtype=torch.float64, device=device, generator=g)
    F, B, D, H = case.F, case.B, case.D, case.H
    if case.strided_view:
        x = torch.randn(B, F * D, **kw).view(B, F, D)
    else:
        x = torch.randn((F, B, D) if case.feature_dim == 0 else (B, F, D), **kw)
    w = torch.randn((F, H, D) if case.per_feature_weight else (H, D), **kw) / D ** 0.5
    # A small positive bias keeps most relus open, so gradients are not trivially zero.
    b = {"none": None, "shared": 0.1 + 0.1 * torch.randn(H, **kw),
         "per_feature": 0.1 + 0.1 * torch.randn(F, H, **kw)}[case.bias]
    shape = {"none": None, "shared": (D,), "per_feature": (F, D)}[case.ln]
    lw = None if shape is None else 1 + 0.2 * torch.randn(shape, **kw)
    lb = None if shape is None else 0.2 * torch.randn(shape, **kw)
    gy = torch.randn((F, B, H) if case.feature_dim == 0 else (B, F, H), **kw)
    return x, w, b, lw, lb, gy


def _leaf(t, dtype):
    return None if t is None else t.detach().to(dtype).requires_grad_(True)


def run_op(fn, tensors, dtype, case: Case, keep_view=True):
    """Forward and backward of `fn` on leaves cast to dtype; returns (y, [grads of present args])."""
    x, w, b, lw, lb, gy = tensors
    if case.strided_view and keep_view:
        B, F, D = x.shape
        base = x.detach().reshape(B, F * D).to(dtype).requires_grad_(True)
        xin, xleaf = base.view(B, F, D), base
    else:
        xleaf = _leaf(x, dtype)
        xin = xleaf
    params = [_leaf(t, dtype) for t in (w, b, lw, lb)]
    y = fn(xin, params[0], params[1], ln_weight=params[2], ln_bias=params[3], eps=case.eps,
           feature_dim=case.feature_dim)
    y.backward(gy.to(dtype))
    grads = [xleaf.grad.reshape(x.shape)] + [p.grad for p in params if p is not None]
    return y.detach(), grads


def relu_mask_bits(stats: torch.Tensor, H: int) -> torch.Tensor:
    """The relu mask a training forward saved beside its row stats ([2 + words, F, B]), as a
    [F, B, H] bool tensor: bit h % 32 of word h // 32."""
    words = stats[2:].contiguous().view(torch.int32)  # [words, F, B]
    return torch.stack([(words[h // 32] >> (h % 32)) & 1 for h in range(H)], dim=-1).bool()


def check_training_forward_against_float64(case: Case, dtype) -> list:
    """The op's training forward (`launch.forward` with saved stats) against float64 on the same
    rounded inputs: y, the saved row mean and rstd, and the relu mask bits where it saves them (z
    farther than 1e-2 from 0): everything the backward reads from it, without running the backward
    (a forward-config test's backward is another test's subject, and in the interpreter it costs
    most of the time). Returns the forward launches (`launch.trace_launches`).

    Example:
        >>> import torch
        >>> [kind for kind, *_ in check_training_forward_against_float64(Case(2, 5, 8, 3), torch.float32)]
        ['forward']
    """
    x, w, b, lw, lb, _ = (None if t is None else t.to(dtype) for t in make_inputs(case))
    with launch.trace_launches() as seen:
        y, stats = launch.forward(x, w, b, lw, lb, case.eps, case.feature_dim, save_stats=True)
    x64, w64, b64, lw64, lb64 = (None if t is None else t.double() for t in (x, w, b, lw, lb))
    z64 = recfuse.reference.feature_mlp(x64, w64, b64, ln_weight=lw64, ln_bias=lb64, eps=case.eps,
                                        feature_dim=case.feature_dim, out_activation=None)
    assert rel_err(y, z64.clamp_min(0)) < TOLERANCE[dtype]
    mean64, rstd64 = x64.mean(-1), torch.rsqrt(x64.var(-1, unbiased=False) + case.eps)
    if case.feature_dim == 1:
        mean64, rstd64, z64 = mean64.T, rstd64.T, z64.transpose(0, 1)   # [F, B] as the stats
    assert (stats[0] - mean64).abs().max() <= 1e-6 * x64.abs().max()
    assert ((stats[1] - rstd64).abs() / rstd64).max() < 1e-5
    if stats.shape[0] > 2:
        decided = z64.abs() > 1e-2
        assert torch.equal(relu_mask_bits(stats, case.H)[decided], (z64 > 0)[decided])
    return seen


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    # The floor keeps gradients that are zero up to rounding (D=1 rows) from dividing by ~1e-15.
    denom = max(ref.norm().item(), 1e-6)
    return (out - ref).norm().item() / denom


def check_against_float64(case: Case, dtype, device="cpu", fn=None, chain=None, conditioned=False,
                          relu_tie: float = 0.0):
    """Assert fn (default: the fused op) matches the float64 per-slice reference, fwd and bwd.

    ``chain``: a `recfuse.chain.Chain`: the op is `recfuse.feature_mlp` with that chain (unless
    ``fn`` is given) and the reference `recfuse.reference.feature_mlp`.
    ``conditioned``: each bound is also at least twice the error of the per-slice reference run
    in ``dtype`` (PyTorch's own rounding), for drawn cases that may be ill-conditioned: a norm over
    3 elements leaves x.grad a one-dimensional projection that can cancel to ~0, where any fp32
    path is ~1e-5 off (CI's property test drew one: 1.9e-5).
    ``relu_tie``: grad_y is zeroed where the float64 pre-activation of a relu out-activation is
    within this of 0. There the forward's rounding decides the relu mask on any path, and one
    flipped mask moves a row of x.grad by its whole weight row (the H200 drew one at fp32 D=256
    H=64: x.grad 1.9e-3 off float64 with a z error of ~1e-6; see `test_op_cuda_property`).
    """
    reference = recfuse.reference.ln_tanh_linear_relu
    if chain is not None:
        kw = dict(norm=chain.norm, activation=chain.activation, out_activation=chain.out_activation)
        fn = fn or functools.partial(recfuse.feature_mlp, **kw)
        reference = functools.partial(recfuse.reference.feature_mlp, **kw)
    fn = fn or recfuse.ln_tanh_linear_relu
    # The reference sees the same dtype-rounded inputs, so only the op's own rounding is measured.
    tensors = tuple(None if t is None else t.to(dtype).double() for t in make_inputs(case, device))
    y_ref, g_ref = run_op(reference, tensors, torch.float64, case, keep_view=False)
    if y_ref.abs().sum() == 0:
        # Every relu closed (tiny cases): negating the linear layer opens them all.
        x, w, b, lw, lb, gy = tensors
        tensors = (x, -w, None if b is None else -b, lw, lb, gy)
        y_ref, g_ref = run_op(reference, tensors, torch.float64, case, keep_view=False)
    assert y_ref.abs().sum() > 0, f"{case}: degenerate case, reference output is all zero"
    out_activation = "relu" if chain is None else chain.out_activation
    if relu_tie and out_activation == "relu":
        x, w, b, lw, lb, gy = tensors
        norm, act = ("layer_norm", "tanh") if chain is None else (chain.norm, chain.activation)
        z = recfuse.reference.feature_mlp(x, w, b, ln_weight=lw, ln_bias=lb, eps=case.eps,
                                          feature_dim=case.feature_dim, norm=norm, activation=act,
                                          out_activation=None)
        tensors = (x, w, b, lw, lb, gy.masked_fill(z.abs() < relu_tie, 0.0))
        y_ref, g_ref = run_op(reference, tensors, torch.float64, case, keep_view=False)
    y, grads = run_op(fn, tensors, dtype, case)
    assert y.dtype == dtype and y.shape == y_ref.shape
    tol = TOLERANCE[dtype]
    own = [0.0] * 6
    if conditioned:
        y_own, g_own = run_op(reference, tensors, dtype, case, keep_view=False)
        own = [2 * rel_err(o, r) for o, r in zip([y_own] + g_own, [y_ref] + g_ref)]
    names = ["y", "x.grad", "weight.grad", "bias.grad", "ln_weight.grad", "ln_bias.grad"]
    present = [True, True, True, tensors[2] is not None, tensors[3] is not None, tensors[4] is not None]
    names = [n for n, p in zip(names, present) if p]
    for name, out, ref, bound in zip(names, [y] + grads, [y_ref] + g_ref, own):
        assert out.shape == ref.shape, f"{case} {name}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
        err = rel_err(out, ref)
        bound = max(tol, bound)
        assert err < bound, f"{case} {dtype} {name}: relative error {err:.2e} >= {bound:.1e}"


def check_nan_parity(shape=(3, 4, 8), const_row=(1, 2)):
    """A constant row with eps=0 has zero variance: PyTorch gives NaN there, and so must the op.

    Asserts NaN exactly where the per-slice reference has it and agreement elsewhere; returns y.
    """
    x = torch.randn(shape)
    x[const_row] = 2.0
    w = torch.randn(2, shape[-1])
    y = recfuse.ln_tanh_linear_relu(x, w, eps=0.0)
    y_ref = recfuse.reference.ln_tanh_linear_relu(x, w, eps=0.0)
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref))
    assert rel_err(y[~torch.isnan(y)], y_ref[~torch.isnan(y_ref)]) < 1e-5
    return y


def randomized_ln_affine(fp):
    """`fp` (a `recfuse.FusedFeatureProcessor`) with a non-trivial LayerNorm affine, drawn from the
    global RNG, so that a wrong feature -> parameter mapping shows."""
    with torch.no_grad():
        for name, p in fp.named_parameters():
            if name.startswith("ln_"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "weight" in name else 0.0))
    return fp


def forced_backward(gy, args, case, stats, chain, **knobs):
    """`launch.backward` with the heuristic config and `knobs` forced: (gradients, its launch meta)."""
    forced = lambda D, H, dt: configs.heuristic_backward(D, H, dt, **knobs)  # noqa: E731
    with configs.override(backward=forced), launch.trace_launches() as seen:
        grads = launch.backward(gy, *args, case.eps, case.feature_dim, stats, chain=chain)
    return grads, [m for kind, _, m, _ in seen if kind == "backward"][0]


def count_launches(monkeypatch, names) -> list:
    """Patch each `launch` launcher in `names` to record its name on every launch; the list of
    names, in launch order, fills as the plans launch. Binding is refused (`bind` returns None),
    so a kept plan's later calls launch through the recording wrapper too."""
    calls = []

    class Counted:
        def __init__(self, name):
            self.name, self.real = name, getattr(launch, name)

        def __call__(self, *a, **k):
            calls.append(self.name)
            return self.real(*a, **k)

        def bind(self, *a, **k):
            return None

    for name in names:
        monkeypatch.setattr(launch, name, Counted(name))
    return calls


BACKWARD_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def chain_backward_inputs(case: Case, dtype, chain, seed: int, device: str = "cpu"):
    """(args, grad_y) for a backward-kernel comparison: the case's x and parameters in `dtype` on
    `device` (no LayerNorm bias for RMSNorm), grad_y zeroed where the float64 z is within 1e-3 of a
    relu kink (there rounding decides the mask on any path)."""
    x, w, b, lw, lb, gy = [None if t is None else t.to(device)
                           for t in make_inputs(case, generator=torch.Generator().manual_seed(seed))]
    if chain.norm == "rms_norm":
        lb = None
    args = [None if t is None else t.to(dtype) for t in (x, w, b, lw, lb)]
    gy = gy.to(dtype)
    x64, w64, b64, lw64, lb64 = (None if t is None else t.double() for t in args)
    if chain.out_activation == "relu":
        z = recfuse.reference.feature_mlp(x64, w64, b64, ln_weight=lw64, ln_bias=lb64, eps=case.eps,
                                          feature_dim=case.feature_dim, norm=chain.norm,
                                          activation=chain.activation, out_activation=None)
        gy = gy.masked_fill(z.abs() < 1e-3, 0)
    return args, gy


def assert_backward_close(grads, baseline, gy, args, case: Case, chain, dtype, same_bits: bool = False) -> None:
    """`grads` against float64 (the composite backward): fp32 within `BACKWARD_TOLERANCE`, 16-bit no
    worse than `baseline` (another kernel path's gradients) by more than a rounding's worth; with
    `same_bits`, every gradient but the weight's equal to the baseline's."""
    from recfuse.ops.composite import composite_backward

    reference = composite_backward(gy.double(), *[None if t is None else t.double() for t in args], case.eps,
                                   case.feature_dim, chain)
    tol = BACKWARD_TOLERANCE[dtype]
    for name, g, gb, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), grads, baseline, reference):
        if r is None or not g.numel():
            continue
        assert g.shape == r.shape and g.dtype == gb.dtype and g.device == gb.device, name
        scale = r.norm().clamp_min(1e-12)
        err = ((g.double() - r).norm() / scale).item()
        bound = tol if dtype == torch.float32 else max(tol, 1.5 * ((gb.double() - r).norm() / scale).item())
        assert err < bound, f"{name}: {err:.2e} >= {bound:.1e}"
        if dtype == torch.float32:
            assert ((g.double() - gb.double()).norm() / scale).item() < 1e-5, name
        if same_bits and name != "weight":
            assert torch.equal(g, gb), name


def assert_step_matches_float64(y, leaves, inputs64, gy64, eps: float, feature_dim: int, tol: float = 1e-5) -> None:
    """A float32 training step's y and its leaves' (x, weight, bias, ln_weight, ln_bias) gradients
    against the float64 per-slice reference on ``inputs64`` with the same grad_y, each relative in
    norm below ``tol``."""
    ref = [t.detach().double().requires_grad_(True) for t in inputs64]
    y_ref = recfuse.reference.ln_tanh_linear_relu(ref[0], ref[1], ref[2], ln_weight=ref[3], ln_bias=ref[4],
                                                 eps=eps, feature_dim=feature_dim)
    y_ref.backward(gy64)
    assert ((y.double() - y_ref).norm() / y_ref.norm()).item() < tol
    for name, g, r in zip(("x", "weight", "bias", "ln_weight", "ln_bias"), [t.grad for t in leaves], ref):
        err = ((g.double() - r.grad).norm() / r.grad.norm()).item()
        assert err < tol, f"{name}: {err:.2e}"


def with_rows(case: Case, rows: int) -> Case:
    """`case` with `rows` more rows (a GPU run: many row tiles per program, padded last tiles)."""
    return dataclasses.replace(case, B=case.B + rows)


# The device parameter of tests that run a kernel path under the interpreter and on a GPU.
INTERPRETER_AND_CUDA = [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.interpret),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]

BACKWARD_PATH_CASES = [
    # (case, dtype, chain) for the backward's kernel paths: masked D and rows, several row tiles per
    # program, fp32 split-bf16 and 16-bit dots, fp16's fp32 operands, other chains.
    (Case(1, 64, 64, 16, ln="per_feature", bias="per_feature"), torch.float32, None),
    (Case(2, 37, 48, 8, feature_dim=1, strided_view=True, per_feature_weight=True, ln="shared"), torch.float32, None),
    (Case(2, 40, 40, 5, ln="none", bias="none", eps=0.0), torch.bfloat16, None),
    (Case(2, 33, 32, 20, ln="per_feature"), torch.float16, None),
    (Case(2, 24, 64, 6, feature_dim=1, ln="per_feature"), torch.float32, chain_of("layer_norm", "gelu", "tanh")),
    (Case(1, 48, 32, 12, ln="none"), torch.float32, chain_of("rms_norm", "silu", None)),
    (Case(2, 20, 32, 6, ln="none"), torch.bfloat16, chain_of(None, "sigmoid", "relu")),
]
