#!/usr/bin/env python
"""The split_stack vs combined puzzler, side by side with recfuse, in one process.

For every case (shape F,B,D,H x dtype x mode) this runs each row below on the same random input
and the same Linear(D, H) weights, checks it against a float64 run of the seed `split_stack`
(before any timing), then measures it:

rows (select with --rows, shell-style patterns on the keys):
    split_stack             the seed's per-slice function, eager (2F+3 launches)
    combined                the seed's batched function, eager (5 launches)
    compile_split_stack     torch.compile(split_stack)
    compile_combined        torch.compile(combined)
    inductor_batch_fusion   torch.compile(split_stack) with Inductor's pre-grad batch fusion
                            passes on (its own horizontal fusion)
    cudagraph_combined      `combined` captured once in a CUDA graph, then replayed (GPU only)
    recfuse_transform       recfuse.transform(SplitStack) (the fx pass)
    transform_cuda_graph    recfuse.transform(SplitStack, cuda_graph=True): opt-in replay of captured
                            graphs for fixed shapes (inference only, GPU only)
    fused_feature_processor recfuse.FusedFeatureProcessor on the [B, F*D] buffer
    ffp_cuda_graph          the same module with cuda_graph=True (opt-in replay of a captured
                            launch for fixed shapes; inference only, GPU only)
    recfuse_op              the bare op recfuse.ln_tanh_linear_relu on a [B, F, D] view

columns:
    wall      median time of one call measured start to finish with host synchronisation after
              every call, as the puzzler measures it (launch overhead included)
    GPU       triton.testing.do_bench median (CUDA events, L2 flushed between calls); CPU: n/a
    kernels   device kernels per call from torch.profiler (GPU: every kernel, memcpy and memset
              on the device; CPU: top-level aten/recfuse ops, which does not see the C++ loops
              Inductor generates)
    speedup   eager split_stack's time / the row's time, wall and GPU
    x cc      torch.compile(combined)'s wall time / the row's (the CPU target: recfuse rows >= 1)
    %copy     the row's effective bandwidth as a percentage of a device-to-device copy timed in
              the same run: forward moves bytes(x) + bytes(y), forward+backward
              3 bytes(x) + 3 bytes(y) (backward re-reads x and y, reads grad_y, writes grad_x).
              100% means "as fast as copying the data it must touch". Uses GPU time, else wall.
    +peak     extra peak memory of one call over what was allocated before it
              (torch.cuda.max_memory_allocated delta; a CUDA graph's private pool is added);
              CPU: n/a
    rel err   largest ||out - ref|| / ||ref|| against float64 over y (and, with --backward, the
              gradients of x, weight and bias); tolerance 1e-5 fp32, 1e-2 bf16, 5e-3 fp16

On a CPU (`make bench` without a GPU) the defaults are the issue's CPU shapes (16,256,64 /
32,2048,64 / 64,4096,64, H=1) in fp32 and bf16, forward and training step (--no-backward: forward
only), rows CPU_DEFAULT_ROWS (torch.compile(split_stack) and Inductor batch fusion compile for
minutes at F=64; --rows adds them). Each case's rows are timed interleaved: `repeats` rounds of one
call per row (median per row), so the load of a shared machine falls on all rows alike. Before
the cases, recfuse's first calls (compiling a CPU variant) are timed in fresh processes with an
empty and with a warm Inductor cache (--no-first-call skips it). The progress bar is on stderr and
closed before the table; the profiler's C-level output is silenced. --save also writes the table
as split_stack_vs_combined_cpu.txt.

A row whose feature is missing (recfuse.transform not written yet, no GPU for CUDA graphs) is
shown as "n/a (reason)"; a row that raises is shown as "error (reason)"; both are logged and the
run goes on. torch.compile rows compile during the check; their compile time is logged and kept
in the JSON, never timed.

Examples:
    python benchmarks/split_stack_vs_combined.py                      # defaults for the device
    python benchmarks/split_stack_vs_combined.py --device cpu --shapes 16,256,64 --rows 'split*' combined
    python benchmarks/split_stack_vs_combined.py --backward --save benchmarks/results
    python benchmarks/split_stack_vs_combined.py --backward --json /tmp/r.json --plot /tmp/r.png
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

import recfuse
from _common import (TOLERANCE, Shape, command_line, copy_bandwidth, do_bench_us, environment, gpu_slug, json_safe,
                     kernels_per_call, relative_error, wall_us)
from _common import extra_peak_bytes as _extra_peak_bytes
from recfuse.puzzler import SplitStack, combined, split_stack

log = logging.getLogger("bench")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
# Inductor's own horizontal fusion, exactly the options the issue names.
INDUCTOR_BATCH_FUSION = {
    "normalization_pass": {}, "batch_layernorm": {}, "batch_tanh": {}, "batch_linear": {},
    "batch_relu": {}, "split_cat_pass": {}, "unbind_stack_pass": {},
}

ROW_LABELS = {
    "split_stack": "split_stack (eager)",
    "combined": "combined (eager)",
    "compile_split_stack": "torch.compile(split_stack)",
    "compile_combined": "torch.compile(combined)",
    "inductor_batch_fusion": "Inductor batch fusion",
    "cudagraph_combined": "CUDA graph (combined)",
    "recfuse_transform": "recfuse.transform",
    "transform_cuda_graph": "transform cuda_graph=True",
    "fused_feature_processor": "FusedFeatureProcessor",
    "ffp_cuda_graph": "FFP cuda_graph=True",
    "recfuse_op": "recfuse op",
}
BASELINE_ROW = "split_stack"
PEER_ROW = "compile_combined"      # the CPU target: recfuse rows at least as fast as this one
CPU_DEFAULT_ROWS = ["split_stack", "combined", "compile_combined", "recfuse_transform", "fused_feature_processor",
                    "recfuse_op"]
BENCHMARK = "split_stack_vs_combined"   # tags our JSON among other results in benchmarks/results/


# ---------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class Case(Shape):
    """One measured configuration: x is a 1D buffer of B*F*D values, as the puzzler feeds it."""

    dtype: torch.dtype
    backward: bool

    @property
    def mode(self) -> str:
        return "forward+backward" if self.backward else "forward"

    def bytes_x(self) -> int:
        return self.numel_x() * self.dtype.itemsize

    def bytes_y(self) -> int:
        return self.numel_y() * self.dtype.itemsize

    def bytes_moved(self) -> int:
        """Bytes a perfect implementation must move (see the module docstring)."""
        once = self.bytes_x() + self.bytes_y()
        return 3 * once if self.backward else once

    def title(self) -> str:
        return f"F={self.F} B={self.B} D={self.D} H={self.H} {dtype_name(self.dtype)} {self.mode}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """'F,B,D' or 'F,B,D,H' -> (F, B, D, H), H defaulting to the seed's 1."""
    parts = [int(p) for p in text.replace("x", ",").split(",") if p]
    if len(parts) not in (3, 4) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"shape must be F,B,D or F,B,D,H with positive sizes, got {text!r}")
    return tuple(parts) if len(parts) == 4 else (*parts, 1)


def default_cases(device: torch.device) -> list[tuple[tuple[int, int, int, int], torch.dtype]]:
    """The issue's defaults: on a GPU the seed shape, a large one, bf16 and H=16; on a CPU shapes
    small enough for the whole run (compiles included) to finish in about a minute on 2 cores."""
    fp32, bf16 = torch.float32, torch.bfloat16
    if device.type == "cuda":
        return [((16, 1024, 256, 1), fp32), ((128, 8192, 256, 1), fp32),
                ((128, 8192, 256, 1), bf16), ((128, 8192, 256, 16), fp32)]
    # The issue's CPU shapes, fp32 and bf16. torch.compile(split_stack) traces F slices (its
    # backward at F=64 compiles for about a minute here), so its rows are not in the CPU default
    # (CPU_DEFAULT_ROWS); --rows brings them back.
    shapes = [(16, 256, 64, 1), (32, 2048, 64, 1), (64, 4096, 64, 1)]
    return [(s, dt) for s in shapes for dt in (fp32, bf16)]


def build_cases(args, device) -> list[Case]:
    if args.shapes is None and args.dtype is None:
        pairs = default_cases(device)
    else:
        # --dtype alone: every default shape in each dtype asked for.
        shapes = args.shapes or list(dict.fromkeys(s for s, _ in default_cases(device)))
        dtypes = [DTYPES[d] for d in (args.dtype or ["fp32"])]
        pairs = [(s, dt) for s in shapes for dt in dtypes]
    modes = [False, True] if args.backward else [False]
    return [Case(*shape, dtype=dt, backward=bwd) for shape, dt in pairs for bwd in modes]


# ---------------------------------------------------------------------------------------------
# rows: each builder returns a Row or raises RowUnavailable


class RowUnavailable(Exception):
    """The row's feature does not exist here (not written yet, or needs a GPU)."""


@dataclass
class Inputs:
    """What every row of one case shares: the same x, Linear and output gradient."""

    x: torch.Tensor            # [B*F*D] in the case's dtype
    linear: torch.nn.Linear    # Linear(D, H) in the case's dtype
    grad_y: torch.Tensor       # [F, B, H], random (a training step with a random upstream grad)


@dataclass
class Row:
    """One runnable row: `forward()` returns the row's output in its own layout."""

    forward: Callable[[], torch.Tensor]
    to_fbh: Callable[[torch.Tensor], torch.Tensor]   # the row's output -> [F, B, H]
    grad_y: torch.Tensor                             # grad_y in the row's output layout
    x: torch.Tensor                                  # leaf whose .grad is x's gradient
    weight: Optional[torch.Tensor]                   # the row's Linear weight and bias (for grads)
    bias: Optional[torch.Tensor]
    replay: Optional[Callable[[], torch.Tensor]] = None   # a captured whole step (CUDA graph)
    static_extra_bytes: int = 0                      # memory held by the row itself (graph pool)
    module: Optional[torch.nn.Module] = None         # a module of someone else's layout

    def params(self) -> list[torch.Tensor]:
        return [p for p in (self.x, self.weight, self.bias) if p is not None]


def _row_leaves(inputs: Inputs, case: Case) -> tuple[torch.Tensor, torch.nn.Linear]:
    """A private copy of x and of the Linear, so that rows never share gradients."""
    x = inputs.x.detach().clone().requires_grad_(case.backward)
    lin = copy.deepcopy(inputs.linear).requires_grad_(case.backward)
    return x, lin


def _fbh(y):
    return y


def _seed_row(fn):
    def build(inputs: Inputs, case: Case, device) -> Row:
        x, lin = _row_leaves(inputs, case)
        return Row(lambda: fn(x, case.B, case.D, lin), _fbh, inputs.grad_y, x, lin.weight, lin.bias)
    return build


def _compiled_row(fn, fusion_options: Optional[dict]):
    def build(inputs: Inputs, case: Case, device) -> Row:
        x, lin = _row_leaves(inputs, case)
        # Dynamo caches compiled code on the function's code object, and Inductor options are not
        # part of its guards: without a reset the batch-fusion row would reuse plain compile's code.
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=False)
        options = fusion_options if fusion_options is not None else {}
        compiled_once = []

        def forward():
            if compiled_once:
                return compiled(x, case.B, case.D, lin)
            # Compilation happens on the first call, so the options must be on while it runs;
            # later calls skip the config patch, which would otherwise be timed with every call.
            with torch._inductor.config.patch(pre_grad_fusion_options=options):
                y = compiled(x, case.B, case.D, lin)
            compiled_once.append(True)
            return y

        return Row(forward, _fbh, inputs.grad_y, x, lin.weight, lin.bias)
    return build


def build_cudagraph_combined(inputs: Inputs, case: Case, device) -> Row:
    if device.type != "cuda":
        raise RowUnavailable("CUDA graphs need a GPU")
    x, lin = _row_leaves(inputs, case)
    grad_y = inputs.grad_y

    def eager_step():
        with _grad_mode(case):
            y = combined(x, case.B, case.D, lin)
            if case.backward:
                y.backward(grad_y)
        return y

    # Warm up on a side stream (cuBLAS workspaces, allocator) before capture, as torch docs ask.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _clear_grads([x, lin.weight, lin.bias])
            eager_step()
    torch.cuda.current_stream().wait_stream(side)
    _clear_grads([x, lin.weight, lin.bias])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    # The whole step is captured, backward included; grads are None here, so they are allocated
    # from the graph's pool and every replay rewrites them in place.
    with torch.cuda.graph(graph):
        static_y = eager_step()
    torch.cuda.synchronize()
    pool = torch.cuda.memory_allocated() - before

    def replay():
        graph.replay()
        return static_y

    return Row(replay, _fbh, grad_y, x, lin.weight, lin.bias, replay=replay,
               static_extra_bytes=max(pool, 0))


def _recfuse_feature(name: str, case: Case, device, cuda_graph: bool):
    """recfuse.<name>, or RowUnavailable when it is missing or its cuda_graph mode cannot run here."""
    feature = getattr(recfuse, name, None)
    if feature is None:
        raise RowUnavailable(f"recfuse.{name} is not in this recfuse build yet")
    if cuda_graph and device.type != "cuda":
        raise RowUnavailable("CUDA graphs need a GPU")
    if cuda_graph and case.backward:
        raise RowUnavailable("cuda_graph=True replays inference calls only")
    return feature


def build_recfuse_transform(inputs: Inputs, case: Case, device, cuda_graph: bool = False) -> Row:
    transform = _recfuse_feature("transform", case, device, cuda_graph)
    x, lin = _row_leaves(inputs, case)
    model = SplitStack(case.D, case.H).to(device=device, dtype=case.dtype)
    model.linear = lin
    fused = transform(model, (x, case.B, case.D), **({"cuda_graph": True} if cuda_graph else {}))
    weight, bias = find_linear_params(fused, case.H, case.D)
    return Row(lambda: fused(x, case.B, case.D), _fbh, inputs.grad_y, x, weight, bias, module=fused)


def build_fused_feature_processor(inputs: Inputs, case: Case, device, cuda_graph: bool = False) -> Row:
    cls = _recfuse_feature("FusedFeatureProcessor", case, device, cuda_graph)
    x, _ = _row_leaves(inputs, case)
    F, B, D, H = case.F, case.B, case.D, case.H
    # The puzzler's configuration: LayerNorm without affine, eps=0.0, one shared Linear(D, H).
    fp = cls([f"f{i}" for i in range(F)], [D] * F, out_features=H, shared_linear=True,
             shared_layer_norm=False, ln_affine=False, eps=0.0, device=device, dtype=case.dtype,
             cuda_graph=cuda_graph)
    weight, bias = find_linear_params(fp, H, D)
    if weight is None:
        raise RuntimeError("cannot find FusedFeatureProcessor's Linear weight to load the shared one")
    with torch.no_grad():  # same weights as every other row, so one float64 reference serves all
        weight.copy_(inputs.linear.weight.reshape(weight.shape))
        if bias is not None:
            bias.copy_(inputs.linear.bias.reshape(bias.shape))
    fp.requires_grad_(case.backward)
    grad_y = inputs.grad_y.transpose(0, 1).reshape(B, F * H)   # [B, F*H], contiguous
    return Row(lambda: fp(x.view(B, F * D)), lambda y: y.view(B, F, H).transpose(0, 1), grad_y,
               x, weight, bias, module=fp)


def build_recfuse_op(inputs: Inputs, case: Case, device) -> Row:
    x, lin = _row_leaves(inputs, case)
    B, F, D = case.B, case.F, case.D
    # Contiguous up front: a strided grad_y would add a copy kernel inside the timed step.
    grad_y = inputs.grad_y.transpose(0, 1).contiguous()

    def forward():
        return recfuse.ln_tanh_linear_relu(x.view(B, F, D), lin.weight, lin.bias, eps=0.0, feature_dim=1)

    return Row(forward, lambda y: y.transpose(0, 1), grad_y, x, lin.weight, lin.bias)


ROW_BUILDERS: dict[str, Callable[[Inputs, Case, torch.device], Row]] = {
    "split_stack": _seed_row(split_stack),
    "combined": _seed_row(combined),
    "compile_split_stack": _compiled_row(split_stack, None),
    "compile_combined": _compiled_row(combined, None),
    "inductor_batch_fusion": _compiled_row(split_stack, INDUCTOR_BATCH_FUSION),
    "cudagraph_combined": build_cudagraph_combined,
    "recfuse_transform": build_recfuse_transform,
    "transform_cuda_graph": lambda inputs, case, device: build_recfuse_transform(inputs, case, device, cuda_graph=True),
    "fused_feature_processor": build_fused_feature_processor,
    "ffp_cuda_graph": lambda inputs, case, device: build_fused_feature_processor(inputs, case, device, cuda_graph=True),
    "recfuse_op": build_recfuse_op,
}
COMPILED_ROWS = {"compile_split_stack", "compile_combined", "inductor_batch_fusion"}


def find_linear_params(module: torch.nn.Module, H: int, D: int, with_grad: bool = False):
    """(weight, bias) of the shared Linear(D, H) inside a module whose layout we do not own.

    Tries a `linear` submodule first, then the unique parameters holding H*D and H values
    (only those that received a gradient, with `with_grad`). Returns None for what cannot be
    told apart; then that gradient is not checked.
    """
    lin = getattr(module, "linear", None)
    if isinstance(lin, torch.nn.Linear) and not with_grad:
        return lin.weight, lin.bias
    params = [p for p in module.parameters() if p.grad is not None or not with_grad]

    def squeezed(p):
        return tuple(s for s in p.shape if s != 1) or (1,)

    weights = [p for p in params if p.numel() == H * D and squeezed(p) == squeezed(torch.empty(H, D))]
    biases = [p for p in params if p.numel() == H and squeezed(p) == squeezed(torch.empty(H))
              and all(p is not w for w in weights)]
    weight = weights[0] if len(weights) == 1 else None
    bias = biases[0] if len(biases) == 1 else None
    return weight, bias


# ---------------------------------------------------------------------------------------------
# running one step, checking it


def _grad_mode(case: Case):
    return contextlib.nullcontext() if case.backward else torch.no_grad()


def _clear_grads(tensors) -> None:
    for t in tensors:
        if t is not None:
            t.grad = None


def make_step(row: Row, case: Case) -> Callable[[], torch.Tensor]:
    """One call of the row: forward, or a training step (grads reset, forward, backward)."""
    if row.replay is not None:
        return row.replay
    params = row.params()
    if not case.backward:
        def step():
            with torch.no_grad():
                return row.forward()
        return step

    def train_step():
        _clear_grads(params)   # set_to_none, as optimizers do: no zeroing kernel
        y = row.forward()
        y.backward(row.grad_y)
        return y
    return train_step


@dataclass
class Reference:
    """float64 results of the seed `split_stack` on the case's inputs."""

    y: torch.Tensor
    grads: dict


def float64_reference(inputs: Inputs, case: Case) -> Reference:
    x = inputs.x.detach().double().requires_grad_(case.backward)
    lin = copy.deepcopy(inputs.linear).double().requires_grad_(case.backward)
    with _grad_mode(case):
        y = split_stack(x, case.B, case.D, lin)
    grads = {}
    if case.backward:
        y.backward(inputs.grad_y.double())
        grads = {"x.grad": x.grad, "weight.grad": lin.weight.grad, "bias.grad": lin.bias.grad}
    return Reference(y.detach(), grads)


def check_row(row: Row, step, case: Case, ref: Reference) -> dict:
    y = step()
    errors = {"y": relative_error(row.to_fbh(y), ref.y)}
    if case.backward:
        errors["x.grad"] = relative_error(row.x.grad, ref.grads["x.grad"])
        weight, bias = row.weight, row.bias
        if row.module is not None and any(p is not None and p.grad is None for p in (weight, bias)):
            # The parameter found before the call is not the one used (a rewrite may keep the
            # original `linear` around but compute with a copy): look again among those with grads.
            found_w, found_b = find_linear_params(row.module, case.H, case.D, with_grad=True)
            # Nothing better found: keep the first ones, whose missing grad then counts as wrong.
            weight = found_w if found_w is not None else weight
            bias = found_b if found_b is not None else bias
        # Parameters found by shape may be stacked or reshaped; compare their values, not layout.
        for name, p in (("weight.grad", weight), ("bias.grad", bias)):
            if p is not None:
                errors[name] = relative_error(p.grad, ref.grads[name])
    return errors


# ---------------------------------------------------------------------------------------------
# measuring


def wall_per_call_us(step, device, repeats: int) -> float:
    """Median of `repeats` calls, each timed from launch to host synchronisation."""
    return wall_us(step, device, repeats, warmup=0)


def gpu_time_us(step, device) -> Optional[float]:
    """Median device time per call: triton's do_bench (CUDA events, L2 flushed between calls)."""
    return do_bench_us(step, warmup_ms=50, rep_ms=200) if device.type == "cuda" else None


def extra_peak_bytes(step, row: Row, device) -> Optional[int]:
    if device.type != "cuda":
        return None
    _clear_grads(row.params() if row.replay is None else [])
    return _extra_peak_bytes(step, device) + row.static_extra_bytes


def copy_time(case: Case, device, repeats: int) -> dict:
    """A device-to-device copy of bytes(x) + bytes(y): the bandwidth every row is compared with."""
    if device.type == "cuda":
        stats = copy_bandwidth(case.bytes_x() + case.bytes_y(), device, lambda fn: gpu_time_us(fn, device))
    else:
        # A floor should be the best the memory system does: the fastest of the calls, because
        # on a shared CPU the median copy can be slower than the rows it is meant to bound.
        stats = copy_bandwidth(case.bytes_x() + case.bytes_y(), device,
                               lambda fn: min(wall_per_call_us(fn, device, 1) for _ in range(repeats)))
    return {**stats, "timed_with": "gpu" if device.type == "cuda" else "wall"}


# ---------------------------------------------------------------------------------------------
# one case


def make_inputs(case: Case, device, seed: int) -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(case.B * case.F * case.D, generator=g)
    torch.manual_seed(seed)
    linear = torch.nn.Linear(case.D, case.H)
    grad_y = torch.randn(case.F, case.B, case.H, generator=g)
    x, linear = x.to(device, case.dtype), linear.to(device, case.dtype)
    grad_y = grad_y.to(device) * ~_relu_ties(x, linear, case).to(device)
    return Inputs(x, linear, grad_y.to(case.dtype))


EPS = 0.0  # the seed's LayerNorm eps


def _relu_ties(x: torch.Tensor, linear: torch.nn.Linear, case: Case) -> torch.Tensor:
    """[F, B, H] mask of the pre-relu values within rounding distance of zero.

    relu has no derivative at 0, and where float64 z is within a float32 (or bf16) rounding of
    0 an exact implementation may take either side: measured on the H100 at F=128 B=8192 H=16,
    one or two such flips put ~5e-4 into every gradient of every fp32 implementation, torch's
    included. The upstream gradient is zero there, so the comparison measures arithmetic, not
    the side a tie fell on.
    """
    F, B, D = case.F, case.B, case.D
    with torch.no_grad():
        xf = x.detach().double().view(B, F, D).transpose(0, 1)
        t = torch.tanh(torch.nn.functional.layer_norm(xf, (D,), eps=EPS))
        z = torch.nn.functional.linear(t, linear.weight.double(), linear.bias.double())
        band = (1e-3 if case.dtype != torch.float32 else 1e-5) * z.abs().max()
        return z.abs() <= band


def run_row(key: str, inputs: Inputs, ref: Reference, case: Case, device, args) -> dict:
    result = {"key": key, "label": ROW_LABELS[key], "status": "ok"}
    counters_before = _inductor_batch_counters()
    try:
        row = ROW_BUILDERS[key](inputs, case, device)
        step = make_step(row, case)
        start = time.perf_counter()
        errors = check_row(row, step, case, ref)   # first call: compiles the torch.compile rows
        first_call_s = time.perf_counter() - start
    except RowUnavailable as e:
        log.info("%s: n/a (%s)", key, e)
        return {**result, "status": "n/a", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - one broken row must not stop the others
        log.warning("%s: error (%s: %s)", key, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return {**result, "status": "error", "reason": f"{type(e).__name__}: {_first_line(e)}"}
    tolerance = TOLERANCE[case.dtype]
    result["errors"] = errors
    result["max_rel_err"] = max(errors.values())
    result["tolerance"] = tolerance
    result["first_call_s"] = first_call_s     # recfuse rows: includes compiling a new CPU variant
    if key in COMPILED_ROWS:
        result["compile_s"] = first_call_s
        log.info("%s: compiled in %.1f s", key, first_call_s)
    if key == "inductor_batch_fusion":
        after = _inductor_batch_counters()
        result["fusion_counters"] = {k: v - counters_before.get(k, 0) for k, v in after.items()
                                     if v != counters_before.get(k, 0)}
        log.info("%s: Inductor applied %s", key, result["fusion_counters"] or "no batch fusion")
    if not result["max_rel_err"] <= tolerance:
        result["status"] = "inaccurate"
        log.warning("%s: error %.2e above tolerance %.0e (%s); timed anyway", key,
                    result["max_rel_err"], tolerance, errors)
    if device.type == "cpu":
        # Timed later, interleaved with the case's other rows (`time_rows_interleaved`).
        result["_step"] = step
        for _ in range(args.warmup):
            step()
        return result
    try:
        for _ in range(args.warmup):
            step()
        result["wall_us"] = wall_per_call_us(step, device, args.repeats)
        result["gpu_us"] = gpu_time_us(step, device)
        result["kernels_per_call"] = kernels_per_call(step, device, calls=3)
        result["kernels_counted"] = "device kernels" if device.type == "cuda" else "aten ops"
        result["extra_peak_bytes"] = extra_peak_bytes(step, row, device)
    except Exception as e:  # noqa: BLE001
        log.warning("%s: error while timing (%s: %s)", key, type(e).__name__, e)
        return {**result, "status": "error", "reason": f"timing: {type(e).__name__}: {_first_line(e)}"}
    return result


def time_rows_interleaved(rows: list[dict], repeats: int) -> None:
    """CPU: `repeats` rounds, each timing one call of every row in turn; a row's wall_us is the
    median of its calls. Interleaving spreads whatever else the machine runs (a shared 2-core
    host) over all rows alike, instead of charging it to whichever row ran at the time. Then
    the ops per call, from the profiler with its C-level output silenced."""
    live = [r for r in rows if "_step" in r]
    times = {id(r): [] for r in live}
    for _ in range(repeats):
        for r in live:
            t0 = time.perf_counter()
            r["_step"]()
            times[id(r)].append(time.perf_counter() - t0)
    for r in live:
        step = r.pop("_step")
        r["wall_us"] = statistics.median(times[id(r)]) * 1e6
        r["wall_us_min"] = min(times[id(r)]) * 1e6
        r["gpu_us"] = None
        r["extra_peak_bytes"] = None
        try:
            r["kernels_per_call"] = kernels_per_call(step, "cpu", calls=3)
            r["kernels_counted"] = "aten ops"
        except Exception as e:  # noqa: BLE001
            log.warning("%s: profiler failed (%s: %s)", r["key"], type(e).__name__, e)
            r["kernels_per_call"] = None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:160]


def _inductor_batch_counters() -> dict:
    """Which batch fusions Inductor reports having applied (evidence the options took effect)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {k: v for k, v in counters.get("inductor", {}).items() if "batch" in k or "split_cat" in k
            or "unbind" in k or "normalization" in k}


def add_ratios(rows: list[dict], case: Case, copy: dict) -> None:
    """Speedups over eager split_stack and % of copy bandwidth, from numbers of this run only."""
    base = next((r for r in rows if r["key"] == BASELINE_ROW and "wall_us" in r), None)
    peer = next((r for r in rows if r["key"] == PEER_ROW and "wall_us" in r), None)
    floor_us = case.bytes_moved() / (copy["GBps"] * 1e9) * 1e6
    for r in rows:
        if "wall_us" not in r:
            continue
        r["speedup_wall"] = base["wall_us"] / r["wall_us"] if base else None
        # > 1: faster than torch.compile(combined) (the CPU target of DESIGN.md is >= 1)
        r["vs_compile_combined"] = peer["wall_us"] / r["wall_us"] if peer else None
        r["speedup_gpu"] = (base["gpu_us"] / r["gpu_us"]) if base and r.get("gpu_us") and base.get("gpu_us") else None
        t = r["gpu_us"] if r.get("gpu_us") is not None else r["wall_us"]
        r["pct_copy_bw"] = 100.0 * floor_us / t


def run_case(case: Case, keys: list[str], device, args, progress) -> dict:
    inputs = make_inputs(case, device, args.seed)
    ref = float64_reference(inputs, case)
    copy_stats = copy_time(case, device, args.repeats)
    log.info("%s: copy of %.1f MB in %.1f us (%.1f GB/s)", case.title(), copy_stats["bytes"] / 1e6,
             copy_stats["time_us"], copy_stats["GBps"])
    rows = []
    for key in keys:
        progress.set_postfix_str(f"{case.F},{case.B},{case.D},{case.H} {dtype_name(case.dtype)} "
                                 f"{'fwd+bwd' if case.backward else 'fwd'} {key}")
        rows.append(run_row(key, inputs, ref, case, device, args))
        progress.update()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cpu":
        time_rows_interleaved(rows, args.repeats)
    torch._dynamo.reset()
    add_ratios(rows, case, copy_stats)
    return {"F": case.F, "B": case.B, "D": case.D, "H": case.H, "dtype": dtype_name(case.dtype),
            "mode": case.mode, "bytes_x": case.bytes_x(), "bytes_y": case.bytes_y(),
            "bytes_moved": case.bytes_moved(), "copy": copy_stats, "rows": rows}


# ---------------------------------------------------------------------------------------------
# output


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


COLUMNS = ["row", "wall us", "GPU us", "kernels", "x wall", "x GPU", "x cc", "%copy", "+peak MiB", "rel err"]


def table_lines(results: dict) -> list[str]:
    """Plain-text summary: one block per case."""
    lines = []
    for c in results["cases"]:
        copy_stats = c["copy"]
        lines.append("")
        lines.append(f"== F={c['F']} B={c['B']} D={c['D']} H={c['H']} {c['dtype']} {c['mode']} on "
                     f"{results['env']['device_name']} | copy of x+y: {copy_stats['time_us']:.1f} us "
                     f"({copy_stats['GBps']:.1f} GB/s) ==")
        widths = [28, 10, 10, 9, 7, 7, 7, 7, 10, 9]
        header = [("aten ops" if h == "kernels" and results["env"]["device"] == "cpu" else h) for h in COLUMNS]
        lines.append("".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
        for r in c["rows"]:
            if "wall_us" not in r:
                lines.append(r["label"].ljust(widths[0]) + f"{r['status']} ({r.get('reason', '')})")
                continue
            kernels = r.get("kernels_per_call")
            peak = r.get("extra_peak_bytes")
            err = _fmt(r.get("max_rel_err"), ".1e") + ("!" if r["status"] == "inaccurate" else "")
            cells = [r["label"], _fmt(r["wall_us"], ".1f"), _fmt(r.get("gpu_us"), ".1f"),
                     _fmt(kernels, ".0f" if kernels is None or kernels == int(kernels) else ".1f"),
                     _fmt(r.get("speedup_wall"), ".2f"), _fmt(r.get("speedup_gpu"), ".2f"),
                     _fmt(r.get("vs_compile_combined"), ".2f"),
                     _fmt(r.get("pct_copy_bw"), ".1f", "%"), _fmt(None if peak is None else peak / 2**20, ".1f"),
                     err]
            lines.append("".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(cells, widths))))
    kinds = {r.get("kernels_counted") for c in results["cases"] for r in c["rows"]} - {None}
    if "aten ops" in kinds:
        lines.append("\naten ops = top-level aten/recfuse ops per call (Inductor's C++ loops are not aten ops)")
    lines.append("x wall / x GPU: speedup over eager split_stack in this run; x cc: torch.compile(combined)'s wall "
                 "time / the row's (>= 1: at least as fast); '!' = error above tolerance")
    env = results["env"]
    if env.get("loadavg_start") is not None:
        lines.append(f"machine load average (1, 5, 15 min) at start {tuple(round(v, 2) for v in env['loadavg_start'])}, "
                     f"end {tuple(round(v, 2) for v in env.get('loadavg_end') or ())} on {env.get('cpu_threads')} "
                     f"threads; recfuse CPU backend: {results.get('cpu_backend')}")
    first = results.get("first_call")
    if first:
        lines.append("")
        lines.append("recfuse CPU first calls (fresh process, " + first.get("shape", "") + "): " + ", ".join(
            f"{k} {v:.2f} s" for k, v in first.items() if isinstance(v, float)))
    return lines


def select_rows(patterns: Optional[list[str]], device) -> list[str]:
    keys = list(ROW_BUILDERS) if torch.device(device).type == "cuda" or patterns else list(CPU_DEFAULT_ROWS)
    if patterns:
        wanted = [p for arg in patterns for p in arg.split(",") if p]
        unknown = [p for p in wanted if not fnmatch.filter(keys, p)]
        if unknown:
            raise SystemExit(f"--rows: {unknown} match no row; rows are {', '.join(keys)}")
        keys = [k for k in keys if any(fnmatch.fnmatch(k, p) for p in wanted)]
    if BASELINE_ROW not in keys:
        log.info("--rows leaves out %s: speedups will be n/a", BASELINE_ROW)
    return keys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="rows: " + ", ".join(ROW_BUILDERS))
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=None,
                   help="dtypes to run every shape in (default: the device's default cases)")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=None, metavar="F,B,D[,H]",
                   help="shapes to run (H defaults to 1)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None,
                   help="also run forward+backward (a training step) for every case (default: on for the "
                        "CPU, off for a GPU)")
    p.add_argument("--first-call", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: time recfuse's first calls (compiling a CPU variant) in fresh processes, "
                        "with an empty and with the warm Inductor cache (default: on with the default cases)")
    p.add_argument("--rows", nargs="+", default=None, metavar="PATTERN",
                   help="only rows whose key matches one of these shell patterns (comma lists too)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per row for the wall clock (default: 100 on GPU, 20 on CPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per row after the check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write all numbers here")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH.png", help="write a bar chart here")
    p.add_argument("--save", type=Path, default=None, metavar="DIR",
                   help="write JSON and chart to DIR under the conventional name "
                        "split_stack_vs_combined_<gpu>.{json,png}, e.g. _h100, replacing the current one "
                        "(see benchmarks/results/README.md)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks of failing rows")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU")
    args.repeats = args.repeats or (100 if device.type == "cuda" else 20)
    if args.backward is None:
        args.backward = device.type == "cpu"   # CPU: training steps measured by default too
    cases = build_cases(args, device)
    keys = select_rows(args.rows, device)
    env = environment(device)
    log.info("%s | torch %s | triton %s | %d cases x %d rows", env["device_name"], env["torch"],
             env["triton"], len(cases), len(keys))

    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    results = {"benchmark": BENCHMARK, "schema": 1, "env": env, "command": command_line(argv),
               "settings": {"repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
                            "rows": keys, "tolerance": {dtype_name(k): v for k, v in TOLERANCE.items()}},
               "cases": []}
    if args.first_call is None:
        args.first_call = device.type == "cpu" and args.shapes is None and args.dtype is None
    if args.first_call and device.type == "cpu":
        results["first_call"] = measure_first_calls((cases[0].F, cases[0].B, cases[0].D, cases[0].H))
    results["cpu_backend"] = recfuse.ops.get_cpu_backend() if device.type == "cpu" else None
    if hasattr(os, "getloadavg"):
        # A shared machine: other processes' load skews CPU timings (interleaving spreads it over
        # the rows); kept so that a reader can tell a quiet run from a busy one.
        results["env"]["loadavg_start"] = os.getloadavg()
    with logging_redirect_tqdm(), tqdm(total=len(cases) * len(keys), unit="row", file=sys.stderr) as progress:
        for case in cases:
            results["cases"].append(run_case(case, keys, device, args, progress))
    sys.stderr.flush()   # the progress bar is done before the table starts
    if hasattr(os, "getloadavg"):
        results["env"]["loadavg_end"] = os.getloadavg()

    print("\n".join(table_lines(results)))
    if args.save:
        stem = conventional_stem(args.save, env)
        args.json = args.json or stem.with_suffix(".json")
        args.plot = args.plot or stem.with_suffix(".png")
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".txt").write_text("\n".join(table_lines(results)).lstrip("\n") + "\n")
        log.info("wrote %s", stem.with_suffix(".txt"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_safe(results), indent=1, allow_nan=False) + "\n")
        log.info("wrote %s", args.json)
    if args.plot:
        import render_results

        render_results.plot_results(results, args.plot)
        log.info("wrote %s", args.plot)
    return 0


_FIRST_CALL_SCRIPT = r"""
import json, sys, time
import torch, recfuse
F, B, D, H = (int(v) for v in sys.argv[1].split(","))
x = torch.randn(B, F * D).view(B, F, D).requires_grad_(True)
lin = torch.nn.Linear(D, H)
out = {}
def call(x):
    return recfuse.ln_tanh_linear_relu(x, lin.weight, lin.bias, eps=0.0, feature_dim=1)
t0 = time.perf_counter(); y = call(x); out["training forward"] = time.perf_counter() - t0
t0 = time.perf_counter(); y.sum().backward(); out["backward"] = time.perf_counter() - t0
with torch.no_grad():
    t0 = time.perf_counter(); call(x); out["inference forward"] = time.perf_counter() - t0
x2 = torch.randn(B + 100, (F + 3) * D).view(B + 100, F + 3, D).requires_grad_(True)
t0 = time.perf_counter(); call(x2).sum().backward(); out["new shape training step"] = time.perf_counter() - t0
out["backend"] = recfuse.ops.get_cpu_backend()
print("FIRST_CALL " + json.dumps(out))
"""


def measure_first_calls(shape: tuple[int, int, int, int]) -> dict:
    """recfuse's first calls on the CPU in fresh processes (the op on the puzzler's layout, fp32):
    "cold" with an empty Inductor cache directory, "warm" a second process on the same directory
    (what a later run of a program pays). Each includes the process's first use of Dynamo and
    Inductor, as a program's first call does."""
    F, B, D, H = shape
    result = {"shape": f"F={F} B={B} D={D} H={H} fp32"}
    with tempfile.TemporaryDirectory(prefix="recfuse_inductor_") as cache:
        repo = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "RECFUSE_CPU_BACKEND": "compiled", "PYTHONPATH": path}
        for label in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-c", _FIRST_CALL_SCRIPT, f"{F},{B},{D},{H}"], env=env,
                                  capture_output=True, text=True, timeout=600)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST_CALL ")), None)
            if proc.returncode != 0 or line is None:
                log.warning("first-call run (%s) failed: %s", label, proc.stderr.strip().splitlines()[-1:])
                continue
            times = json.loads(line[len("FIRST_CALL "):])
            result.update({f"{label} {k}": v for k, v in times.items() if isinstance(v, float)})
            log.info("first calls (%s cache): %s", label, ", ".join(f"{k} {v:.2f} s" for k, v in times.items()
                                                                   if isinstance(v, float)))
    return result


def conventional_stem(directory: Path, env: dict) -> Path:
    """directory/split_stack_vs_combined_<gpu>: one current result per device model (h100, h200,
    cpu), replaced by a re-run; git keeps the history (see benchmarks/results/README.md)."""
    slug = "cpu" if env["device"] == "cpu" else gpu_slug(env["device_name"])
    return directory / f"{BENCHMARK}_{slug}"


if __name__ == "__main__":
    sys.exit(main())
