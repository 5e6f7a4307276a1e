"""The CLI tuner's confirmation at a larger batch (benchmarks/tune_kernels.py `_ScaledInputs`) times
each finalist with the per-feature LayerNorm affine and without one (``--confirm-affine``): a table
entry serves both calls, and one mode's winner has lost the other's by 5-10% on the H200.

Under the Triton interpreter, a tiny shape: the calls timed are the ones asked for (each mode's
outputs match the float64 composite of that mode) and their times are summed.
"""
import os
import sys

import pytest
import torch

from recfuse.ops import configs
from recfuse.ops.composite import composite_backward
from recfuse.reference import batched_ln_tanh_linear_relu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import tune_kernels  # noqa: E402

pytestmark = pytest.mark.interpret

SHAPE = dict(F=2, B=24, D=16, H=3, dtype="fp32")


def _recording_bench(outputs: list):
    def bench(fn):
        outputs.append(fn())
        return 1.5
    return bench


@pytest.mark.parametrize("modes", [("per_feature", "none"), ("per_feature",), ("none",)])
def test_confirm_times_each_affine_mode_and_sums_them(modes):
    outputs = []
    scaled = tune_kernels._ScaledInputs(SHAPE, 2, _recording_bench(outputs), modes)
    fwd = configs.config_to_entry(configs.heuristic_forward(16, 3, torch.float32))
    assert scaled.time("forward", fwd) == 1.5 * 2 * len(modes)  # inference and training calls per mode
    bwd = configs.config_to_entry(configs.heuristic_backward(16, 3, torch.float32))
    assert scaled.time("backward", bwd) == 1.5 * len(modes)
    forwards, backwards = outputs[:2 * len(modes)], outputs[2 * len(modes):]
    for i, mode in enumerate(modes):
        t, _ = scaled.inputs[mode]
        assert t["x"].shape[0] == 2 * SHAPE["B"]  # the confirmation's batch
        assert (t["lw"] is None) == (mode == "none") and (t["lb"] is None) == (mode == "none")
        d = {k: None if v is None else v.double() for k, v in t.items()}
        y64 = batched_ln_tanh_linear_relu(d["x"], d["w"], d["b"], d["lw"], d["lb"], 1e-5, 1)
        for y, stats in (forwards[2 * i], forwards[2 * i + 1]):  # the inference call, the training call
            assert ((y.double() - y64).norm() / y64.norm()).item() < 1e-5, mode
        assert forwards[2 * i][1] is None and forwards[2 * i + 1][1] is not None  # only training saves stats
        g64 = composite_backward(d["gy"], d["x"], d["w"], d["b"], d["lw"], d["lb"], 1e-5, 1)
        for g, r in zip(backwards[i], g64):
            if r is not None and g.numel():
                assert ((g.double() - r).norm() / r.norm().clamp_min(1e-12)).item() < 1e-4, mode


@pytest.mark.parametrize("D,H,dtype", [(24, 8, "bf16"), (100, 16, "fp32"), (384, 2, "bf16")])
def test_a_spread_run_times_a_short_list_over_every_backward_path(D, H, dtype):
    """``--only spread``: the heuristic's config first, then at most SPREAD_LIMIT others, every
    kernel path of the full list among them (the off-grid shapes' full backward lists are long)."""
    from recfuse.ops import tuning

    p = dict(F=2, B=24, D=D, H=H, dtype=dtype)
    full = tune_kernels.shape_candidates("backward", p, "all", {})
    short = tune_kernels.shape_candidates("backward", p, "spread", {})
    assert short[0] == configs.heuristic_backward(D, H, tune_kernels.DTYPES[dtype])
    assert len(short) <= 1 + tune_kernels.SPREAD_LIMIT and set(short) <= set(full)
    paths = {tuning.kernel_path(c) for c in full}
    assert {tuning.kernel_path(c) for c in short} == paths or len(short) == 1 + tune_kernels.SPREAD_LIMIT
