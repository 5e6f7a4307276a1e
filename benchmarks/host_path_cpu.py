"""What `recfuse.transform` and `FusedFeatureProcessor` add over the op call they make, on the host.

Issue 15's measure without a GPU: each wrapper against a direct `recfuse.ln_tanh_linear_relu`
call with the same arguments (the module's own parameters and the input viewed as it views it),
on a tiny shape, so that the difference is Python on the host. Per case (forward without grad,
forward recording autograd, training step with grads set to None first) and per round, each of the
four calls is timed as the median of 5 chunks of calls, interleaved; the table shows the minimum
over rounds and the median over rounds of the per-round difference (the machine may be loaded).
Python function calls per call come from cProfile (10 calls).

Example:
    $ python benchmarks/host_path_cpu.py                       # F=4 B=8 D=8 H=1, 7 rounds
    $ python benchmarks/host_path_cpu.py --rounds 2 --calls 200
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import recfuse
from _common import (PerSlice, add_shape_args, host_us_per_call, no_grad_call, op_inputs, python_calls_per_call,
                     training_step_call)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, F=4, B=8, D=8, H=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000, help="calls per round and wrapper (5 chunks)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    F_, B, D, H = args.F, args.B, args.D, args.H
    print(f"recfuse {recfuse.__file__}, torch {torch.__version__}, F={F_} B={B} D={D} H={H} fp32 CPU")

    buf = op_inputs(F_, B, D, H, torch.float32, "cpu", layout="BFD", ln="per_feature").buf
    torch.manual_seed(0)
    fused = recfuse.transform(PerSlice(F_, D, H), (buf,))
    ffp = recfuse.FusedFeatureProcessor([f"f{i}" for i in range(F_)], D, H)
    x3 = buf.view(B, F_, D)
    fp = dict(ffp.named_parameters())
    tp = dict(fused.named_parameters())

    def op_as_ffp():
        return recfuse.ln_tanh_linear_relu(x3, fp["weight"], fp["bias"], ln_weight=fp["ln_weight"],
                                           ln_bias=fp["ln_bias"], eps=1e-5, feature_dim=1)

    def op_as_transform():
        return recfuse.ln_tanh_linear_relu(x3, tp["linear.weight"], tp["linear.bias"],
                                           ln_weight=tp["recfuse_g0_ln_weight"], ln_bias=tp["recfuse_g0_ln_bias"],
                                           eps=1e-5, feature_dim=1)

    with torch.no_grad():  # the same op calls: the wrappers add only host work
        assert torch.equal(ffp(buf).view(B, F_, H), op_as_ffp())
        assert torch.equal(fused(buf), op_as_transform())
    ffp_params, tr_params = list(ffp.parameters()), list(fused.parameters())
    cases = {
        "forward, no grad": [no_grad_call(f) for f in (op_as_ffp, lambda: ffp(buf), op_as_transform, lambda: fused(buf))],
        "forward, autograd": [op_as_ffp, lambda: ffp(buf), op_as_transform, lambda: fused(buf)],
        "training step": [training_step_call(op_as_ffp, ffp_params), training_step_call(lambda: ffp(buf), ffp_params),
                          training_step_call(op_as_transform, tr_params), training_step_call(lambda: fused(buf), tr_params)],
    }
    for fns in cases.values():
        for fn in fns:
            for _ in range(200):
                fn()
    print(f"{'case':18s} {'op us':>7s} {'FFP us':>7s} {'FFP-op':>7s} {'(median)':>8s} {'op us':>7s} "
          f"{'tr us':>7s} {'tr-op':>7s} {'(median)':>8s}   Python calls: op, FFP, transform")
    for case, fns in cases.items():
        best = [float("inf")] * 4
        deltas: tuple[list, list] = ([], [])
        for _ in range(args.rounds):
            meds = [statistics.median(host_us_per_call(fn, max(1, args.calls // 5)) for _ in range(5)) for fn in fns]
            best = [min(a, b) for a, b in zip(best, meds)]
            deltas[0].append(meds[1] - meds[0])
            deltas[1].append(meds[3] - meds[2])
        calls = [python_calls_per_call(fn, 10) for fn in fns]
        print(f"{case:18s} {best[0]:7.1f} {best[1]:7.1f} {best[1] - best[0]:+7.1f} {statistics.median(deltas[0]):+8.1f} "
              f"{best[2]:7.1f} {best[3]:7.1f} {best[3] - best[2]:+7.1f} {statistics.median(deltas[1]):+8.1f}   "
              f"{calls[0]:.0f}, {calls[1]:.0f}, {calls[3]:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
