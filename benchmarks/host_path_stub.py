"""Python cost per call of the op's CUDA launch path, measured without a GPU.

Issue 15's host rows on a machine with no GPU: with ``TRITON_INTERPRET=1`` CPU tensors take the
op's Triton path (`uses_triton`: `launch.forward` / `launch.backward`, their per-signature plans),
the one CUDA tensors take. This tool replaces the kernel launch by a no-op *inside this process
only* (the library is not changed):

* `CompiledLaunchCache.__call__` (a plan's first launch, `JITFunction.run` on CUDA) does nothing;
* `CompiledLaunchCache.bind` returns what it returns on CUDA after a first launch: the library's
  closure over the compiled kernel's launcher (or its runner) and the fixed arguments
  (`CompiledLaunchCache.bound_launch`; `bind` itself refuses CPU tensors), over a kernel whose
  launcher and runner are no-op Python functions and whose stream lookup returns 0. So a plan binds after its first call, as on CUDA, and later
  calls go through `plan.bound(*tensors)`.

What stays different from CUDA: allocations are CPU `torch.empty` (the CUDA caching allocator
costs more), Triton's own launcher Python (`CompiledKernel.run`, its launch metadata) is not
counted, the backward runs in the calling thread (CUDA: the autograd engine's device thread),
and `_autocast_enabled_for` takes its CPU branch.

Rows: op forward no-grad, op forward recording autograd, op training step (grads set to None,
``y.sum().backward()``), transform and FFP forward (no grad and autograd) on the same parameters;
per row the median of 5 chunks of calls, minimum over rounds, and Python function calls per call
(cProfile, 20 calls).

Example:
    $ python benchmarks/host_path_stub.py --rounds 5
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton and recfuse are imported

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import recfuse  # noqa: E402
from recfuse.ops import _compiled_launch, launch  # noqa: E402
from _common import (PerSlice, add_shape_args, host_us_per_call, no_grad_call, op_inputs, profile_calls,  # noqa: E402
                     python_calls_per_call, training_step_call)

_LAUNCHES = [0]


def _noop_runner(*args, stream=None):
    _LAUNCHES[0] += 1


def _noop_run(*args):
    _LAUNCHES[0] += 1


class _FakeCompiled:
    """A compiled kernel whose runner and C launcher (`run`) do nothing."""

    run, function, packed_metadata = staticmethod(_noop_run), 0, None

    def __getitem__(self, grid):
        return _noop_runner


def _stub_call(self, grid, args, meta, **options):
    """The first launch of a plan: nothing runs (CUDA: `JITFunction.run` compiles and launches)."""
    _LAUNCHES[0] += 1


def _stub_bind(self, grid, args, meta, n_tensors, **options):
    """`CompiledLaunchCache.bind` as it runs for a CUDA tensor whose kernel is compiled: the
    library's own launcher (`bound_launch`: the direct call of the C launcher with data pointers
    where Triton's runner makes the call it knows), over a kernel whose launcher and runner do
    nothing."""
    if not self.enabled:
        return None
    return self.bound_launch(_FakeCompiled(), grid, args, meta, n_tensors, 0, _stub_stream, options)


def _stub_stream(index):
    return 0


def install_stub():
    _compiled_launch.CompiledLaunchCache.__call__ = _stub_call
    _compiled_launch.CompiledLaunchCache.bind = _stub_bind


def build(F_: int, B: int, D: int, H: int):
    buf = op_inputs(F_, B, D, H, torch.float32, "cpu", layout="BFD", ln="per_feature").buf
    torch.manual_seed(0)
    fused = recfuse.transform(PerSlice(F_, D, H), (buf,))
    ffp = recfuse.FusedFeatureProcessor([f"f{i}" for i in range(F_)], D, H)
    x3 = buf.view(B, F_, D)
    fp = dict(ffp.named_parameters())

    def op():
        return recfuse.ln_tanh_linear_relu(x3, fp["weight"], fp["bias"], ln_weight=fp["ln_weight"],
                                           ln_bias=fp["ln_bias"], eps=1e-5, feature_dim=1)

    ffp_params, tr_params = list(ffp.parameters()), list(fused.parameters())
    rows = {
        "op forward, no grad": no_grad_call(op),
        "op forward, autograd": op,
        "op training step": training_step_call(op, ffp_params),
        "transform forward, no grad": no_grad_call(lambda: fused(buf)),
        "FFP forward, no grad": no_grad_call(lambda: ffp(buf)),
        "transform forward, autograd": lambda: fused(buf),
        "FFP forward, autograd": lambda: ffp(buf),
        "transform training step": training_step_call(lambda: fused(buf), tr_params),
        "FFP training step": training_step_call(lambda: ffp(buf), ffp_params),
    }
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, F=4, B=8, D=8, H=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000, help="calls per round and row (5 chunks)")
    ap.add_argument("--profile", default=None, help="print a cProfile of this row (a prefix of its name)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    install_stub()
    print(f"recfuse {recfuse.__file__}, torch {torch.__version__}, F={args.F} B={args.B} D={args.D} H={args.H} "
          f"fp32 CPU, TRITON_INTERPRET=1, kernel launches stubbed")
    rows = build(args.F, args.B, args.D, args.H)
    for fn in rows.values():
        for _ in range(200):
            fn()
    # Every row must have run through bound plans (CUDA's path), not the composite.
    fwd = [p for p in launch._FORWARD_PLANS.values()]
    bwd = [p for p in launch._BACKWARD_PLANS.values()]
    assert fwd and all(p.bound is not None for p in fwd), "a forward plan did not bind"
    assert bwd and all(p.bound is not None for p in bwd), "a backward plan did not bind"
    if args.profile:
        name = next(n for n in rows if n.startswith(args.profile))
        print(f"== {name}")
        profile_calls(rows[name], 200).sort_stats("tottime").print_stats(25)
        return 0
    best = {n: float("inf") for n in rows}
    for _ in range(args.rounds):
        for name, fn in rows.items():  # interleaved: each round runs every row once
            med = statistics.median(host_us_per_call(fn, max(1, args.calls // 5)) for _ in range(5))
            best[name] = min(best[name], med)
    out = {}
    print(f"{'row':30s} {'us/call':>8s} {'Py calls':>9s}")
    for name, fn in rows.items():
        before = _LAUNCHES[0]
        calls = python_calls_per_call(fn, 20)
        launches = (_LAUNCHES[0] - before) / 21
        out[name] = {"us": round(best[name], 2), "calls": calls, "launches": launches}
        print(f"{name:30s} {best[name]:8.1f} {calls:9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
