"""Host cost of a fused call, in bare Triton launches and `torch.tanh` calls measured in the same process.

At the puzzler shape (F=16 B=1024 D=256 H=1 fp32, torchrec layout: a [B, F*D] buffer viewed as
[B, F, D], per-feature LayerNorm affine) the GPU work of a call is ~15 us, so its wall time is the
host's: Python, argument checks, autograd bookkeeping and kernel launches. Each row is the mean wall
time per call of a loop of calls with one synchronisation at the end (the rate a training loop can
issue them), divided by the same for a bare launch of a one-line Triton kernel and for `torch.tanh`
on 1k elements; rows are measured in rounds (``--rounds``), each row's best round kept, so that a
host whose speed drifts slows all rows alike; "median" is the median over rounds of the row's ratio
to the bare launch of the same round (loops seconds apart). Kernels per call and the GPU busy time per call (the sum of their durations) come
from the profiler: a busy time near the wall time means the row is GPU-bound, not host-bound.

Rows: the op, `recfuse.transform` of a per-feature model and `FusedFeatureProcessor`, each as a
forward without grad, a forward recording autograd, and a training step (forward + backward,
parameter grads set to None before each step); the op called as transform and FFP are on a
[B, F*D] input (its view as [B, F, D] in, y flattened to [B, F*H] out); the eager batched composite (`combined`) forward
and training step as the peers; two floors: an nn.Module call of an empty module, and the
training step of a no-op autograd.Function with the op's tensor interface (what any Python
custom autograd op costs before it does anything) and its forward alone. On CUDA the op's
forward without grad is also timed in parts ("op part: ..."): its signature, y's allocation, its
bound kernel launch (beside the one-line kernel launched the same way), and the plan's call. The training steps are also timed with
`torch.autograd.set_multithreading_enabled(False)` (", single-threaded autograd"): on CUDA the
autograd engine runs backward nodes on a device thread of its own, and on a slow host the hand-overs
cost as much as recfuse's whole backward. With ``--profile`` the op's training step is also profiled with
cProfile (top functions by own time).

Example:
    $ python benchmarks/host_overhead.py --json benchmarks/results/host_overhead_h100.json
    $ python benchmarks/host_overhead.py --device cpu --F 4 --B 8 --D 16 --calls 20   # smoke run, no GPU
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import importlib
import io
import json
import logging
import pstats
import statistics

import torch

import recfuse
from _common import (PerSlice, add_shape_args, device_activity, environment, loop_us, no_grad_call, op_inputs,
                     sync, training_step_call)
from recfuse.reference import batched_ln_tanh_linear_relu

log = logging.getLogger("recfuse.bench")


def bare_triton_launches() -> dict:
    """A one-line Triton kernel launched through `JITFunction.run` (the calibration row every
    ratio is to), and the same kernel launched as recfuse launches its own: the compiled kernel
    bound once (`CompiledLaunchCache.bind`), called with its tensors."""
    import triton
    import triton.language as tl
    from recfuse.ops._compiled_launch import CompiledLaunchCache

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    a = torch.randn(1024, device="cuda")
    b = torch.empty_like(a)
    cache = CompiledLaunchCache(_copy)
    cache((1,), (a, b, 1024), {"BLOCK": 1024})
    bound = cache.bind((1,), (a, b, 1024), {"BLOCK": 1024}, n_tensors=2)
    return {"bare Triton launch": lambda: _copy[(1,)](a, b, 1024, BLOCK=1024),
            "bare Triton launch, bound compiled kernel": lambda: bound(a, b)}


class _NoOpAutogradOp(torch.autograd.Function):
    """The op's tensor interface with no work: saves its five inputs, returns empty tensors. Its
    training step is the floor of any Python custom autograd op (autograd.Function plus the
    engine's backward, which on CUDA runs on the engine's device thread), for the rows above it."""

    @staticmethod
    def forward(ctx, x, w, b, lw, lb):
        ctx.save_for_backward(x, w, b, lw, lb)
        return x.new_empty(x.shape[:2] + (w.shape[0],))

    @staticmethod
    def backward(ctx, gy):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


class _EmptyModule(torch.nn.Module):
    def forward(self, x):
        return x


def op_part_rows(x3, params, op) -> dict:
    """The op's forward without grad in its parts, each timed alone: the call's signature (the key
    of its validation record and launch plan), y's allocation, the plan's bound kernel launch on a
    preallocated y, and the plan's call (both). What the op adds beyond these is its entry's
    checks and lookups. Also the floor of a forward recording autograd: a no-op
    autograd.Function's forward."""
    from recfuse._checks import call_signature

    op_module = importlib.import_module("recfuse.ops.ln_tanh_linear_relu")  # the package exports the function

    w, b, lw, lb = params
    with torch.no_grad():
        op()  # the signature's record keeps the plan its call ran
    record = op_module._VALIDATED.known[call_signature(x3, w, b, lw, lb, 1e-5, 1)]
    plan = record.fwd
    if plan is None or plan.bound is None:
        log.warning("op parts: the op's record holds no bound forward plan; rows left out")
        return {}
    y = x3.new_empty(plan.y_shape)
    tensors = (x3, w, b, lw, lb, y, w)  # as `ForwardPlan.__call__` passes them without stats
    return {
        "op part: call_signature": lambda: call_signature(x3, w, b, lw, lb, 1e-5, 1),
        "op part: y allocation": lambda: x3.new_empty(plan.y_shape),
        "op part: bound kernel launch, y preallocated": lambda: plan.bound(*tensors),
        "op part: plan call (allocation + launch)": lambda: plan(x3, w, b, lw, lb),
        "floor: no-op autograd.Function forward": lambda: _NoOpAutogradOp.apply(x3, *params),
    }


def single_threaded_autograd(step):
    """`step` with `torch.autograd.set_multithreading_enabled(False)`: its backward runs on the
    calling thread."""
    def call():
        with torch.autograd.set_multithreading_enabled(False):
            step()
    return call


def build_rows(F_, B, D, H, dtype, dev="cuda"):
    inp = op_inputs(F_, B, D, H, dtype, dev, layout="BFD", ln="per_feature")
    buf, x3 = inp.buf, inp.x
    params = inp.params()
    for p in params:
        p.requires_grad_(True)
    w, b, lw, lb = params
    model = PerSlice(F_, D, H).to(dev, dtype)
    fused = recfuse.transform(model, (buf,))
    ffp = recfuse.FusedFeatureProcessor([f"f{i}" for i in range(F_)], D, H, device=dev, dtype=dtype)

    def op():
        return recfuse.ln_tanh_linear_relu(x3, w, b, ln_weight=lw, ln_bias=lb, feature_dim=1)

    def op_from_buffer():
        # what FFP and transform do for a [B, F*D] input: the view in, the op, the flatten out
        # (each recorded by autograd when it records)
        return recfuse.ln_tanh_linear_relu(buf.view(B, F_, D), w, b, ln_weight=lw, ln_bias=lb,
                                           feature_dim=1).flatten(1)

    def combined():
        return batched_ln_tanh_linear_relu(x3, w, b, lw, lb, 1e-5, 1)

    def graphed_rows():
        """Training steps replayed as CUDA graphs: torch.compile(mode="reduce-overhead") of the
        transformed model and of the batched composite, and make_graphed_callables."""
        # Own copies of the model and leaves: graph capture warms up on a side stream, and leaves
        # shared with the eager rows then sync their gradient accumulation on every eager step.
        xg = buf.clone().requires_grad_(True)
        fused_c, fused_g = copy.deepcopy(fused), copy.deepcopy(fused)
        own = [p.detach().clone().requires_grad_(True) for p in params]
        compiled_fused = torch.compile(fused_c, mode="reduce-overhead")
        compiled_combined = torch.compile(lambda t: batched_ln_tanh_linear_relu(t.view(B, F_, D), *own, 1e-5, 1),
                                          mode="reduce-overhead")
        graphed_fused = torch.cuda.make_graphed_callables(fused_g, (xg,))
        # xg among the leaves whose .grad is reset: autograd keeps the first dx as xg.grad without
        # a copy, and that tensor is a graph output the next replay overwrites.
        return {
            "transform training step, compile reduce-overhead":
                training_step_call(lambda: compiled_fused(xg), [xg, *fused_c.parameters()]),
            "transform training step, make_graphed_callables":
                training_step_call(lambda: graphed_fused(xg), [xg, *fused_g.parameters()]),
            "combined training step, compile reduce-overhead": training_step_call(lambda: compiled_combined(xg), [xg, *own]),
        }

    tanh_in = torch.randn(1024, device=dev)
    rows = {
        "torch.tanh 1k (calibration)": lambda: torch.tanh(tanh_in),
        **(bare_triton_launches() if dev == "cuda" else {}),
        "op forward, no grad": no_grad_call(op),
        "op forward, autograd": op,
        "op training step": training_step_call(op, params),
        "op forward from the [B, F*D] buffer, no grad": no_grad_call(op_from_buffer),
        "op forward from the [B, F*D] buffer, autograd": op_from_buffer,
        "transform forward, no grad": no_grad_call(lambda: fused(buf)),
        "transform forward, autograd": lambda: fused(buf),
        "transform training step": training_step_call(lambda: fused(buf), list(fused.parameters())),
        "FFP forward, no grad": no_grad_call(lambda: ffp(buf)),
        "FFP forward, autograd": lambda: ffp(buf),
        "FFP training step": training_step_call(lambda: ffp(buf), list(ffp.parameters())),
        "combined (eager) forward, no grad": no_grad_call(combined),
        "combined (eager) training step": training_step_call(combined, params),
        # Floors: what any nn.Module call and any Python autograd op cost on this host.
        "floor: nn.Module call, empty forward": lambda m=_EmptyModule(): m(buf),
        "floor: no-op autograd.Function training step": training_step_call(lambda: _NoOpAutogradOp.apply(x3, *params), params),
    }
    if dev == "cuda":
        try:
            rows.update(op_part_rows(x3, params, op))
        except Exception as e:  # reported, not fatal, as the CUDA-graph rows
            log.warning("op part rows failed: %s: %s", type(e).__name__, e)
    # The same steps with the autograd engine's device threads off: on CUDA the engine otherwise
    # runs every backward node on a thread of its own, and the hand-overs cost host time.
    for name in ("op training step", "transform training step", "combined (eager) training step",
                 "floor: no-op autograd.Function training step"):
        rows[f"{name}, single-threaded autograd"] = single_threaded_autograd(rows[name])
    try:
        if dev == "cuda":
            rows.update(graphed_rows())
    except Exception as e:  # reported, not fatal: the other rows still stand
        log.warning("CUDA-graph training rows failed: %s: %s", type(e).__name__, e)
    return rows, training_step_call(op, params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, F=16, B=1024, D=256, H=1)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds over all rows (one loop of --calls each); a row's figure is its best round")
    ap.add_argument("--profile", action="store_true", help="cProfile the op's training step")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: a smoke run (no Triton launch to compare with; use --calls 20 and a small shape)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        log.error("--device cuda: no CUDA device (host_overhead measures launch costs; --device cpu is a smoke run)")
        return 2
    rows, op_step = build_rows(args.F, args.B, args.D, args.H, torch.float32, dev)
    results = {}
    # Rounds over all rows, each row's best loop kept: a host whose speed drifts during the run
    # (the GPU hosts' rows moved 2x between runs) slows every row of a round alike, instead of
    # the rows measured in its slow minutes.
    for rnd in range(args.rounds):
        for name, fn in rows.items():
            if rnd and name not in results:
                continue  # failed in the first round
            try:
                us = loop_us(fn, args.calls, dev, warmup=min(50, args.calls) if rnd == 0 else 3, repeats=1)
                if rnd == 0:
                    kernels, gpu_us = device_activity(fn, dev, calls=5)
                    results[name] = {"us": us, "us_rounds": [us], "kernels": kernels, "gpu_busy_us": gpu_us}
                else:
                    results[name]["us"] = min(results[name]["us"], us)
                    results[name]["us_rounds"].append(us)
            except Exception as e:  # a row that cannot run is reported with its error
                log.warning("%s: %s: %s", name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                results.pop(name, None)
    tanh_us = results["torch.tanh 1k (calibration)"]["us"]
    launch_us = results["bare Triton launch"]["us"] if "bare Triton launch" in results else None
    # Best rounds of two rows may come from different minutes of a drifting host; the median over
    # rounds of the ratio within a round compares loops run seconds apart.
    launch_rounds = results["bare Triton launch"]["us_rounds"] if launch_us else None
    lines = [f"{'call':58s} {'us/call':>9s} {'launches':>9s} {'median':>7s} {'tanh':>7s} {'kernels':>8s} "
             f"{'GPU busy us':>12s}"]
    for name, r in results.items():
        r["bare_launches"] = r["us"] / launch_us if launch_us else None
        r["bare_launches_round_median"] = (statistics.median(u / b for u, b in zip(r["us_rounds"], launch_rounds))
                                           if launch_rounds and len(r["us_rounds"]) == len(launch_rounds) else None)
        r["tanh_calls"] = r["us"] / tanh_us
        launches = "n/a" if r["bare_launches"] is None else f"{r['bare_launches']:.2f}"
        median = "n/a" if r["bare_launches_round_median"] is None else f"{r['bare_launches_round_median']:.2f}"
        lines.append(f"{name:58s} {r['us']:9.1f} {launches:>9s} {median:>7s} {r['tanh_calls']:7.2f} {r['kernels']:8} "
                     f"{'n/a' if r['gpu_busy_us'] is None else format(r['gpu_busy_us'], '.1f'):>12s}")
    single = ", single-threaded autograd"
    ratios = {
        "transform train / combined train": results["transform training step"]["us"] / results["combined (eager) training step"]["us"],
        "transform train / combined train" + single: results["transform training step" + single]["us"]
        / results["combined (eager) training step" + single]["us"],
        "transform fwd / combined fwd (no grad)": results["transform forward, no grad"]["us"] / results["combined (eager) forward, no grad"]["us"],
    }
    lines += [f"{k}: {v:.2f}" for k, v in ratios.items()]
    if dev == "cpu":
        lines.append("(CPU: kernels = top-level aten ops; launches n/a without a GPU)")
    print("\n".join(lines))
    prof_text = ""
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            op_step()
        sync(dev)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        prof_text = s.getvalue()
        print(prof_text)
    if args.json:
        env = environment(dev)
        out = {"tool": "host_overhead", "date": env["date"][:10], "gpu": env["device_name"], "torch": env["torch"],
               "triton": env["triton"], "python": env["python"], "env": env,
               "shape": {"F": args.F, "B": args.B, "D": args.D, "H": args.H},
               "rounds": args.rounds, "rows": results, "ratios": ratios, "cprofile_op_training_step": prof_text}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
