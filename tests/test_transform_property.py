"""Property test: random per-feature models transform into graphs with the same results and
gradients as the original (run in float64), and the expected fusion happens."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

import recfuse

from fx_cases import PerFeature, assert_equivalent, count_layer_norm, count_recfuse

SOURCES = ["split_int", "split_list", "chunk", "tensor_split", "index", "narrow", "unbind", "rows", "dict"]


@st.composite
def models(draw):
    F_ = draw(st.integers(2, 5))
    D = draw(st.sampled_from([3, 4, 8]))  # D <= 2: LayerNorm output is constant, its gradient ~0
    H = draw(st.integers(1, 3))
    tail = draw(st.sampled_from(["none", "after", "per_slice", "shared_in_chain"]))
    stack_dim = draw(st.sampled_from([0, 1] if tail == "after" else [0, 1, 2, -1]))
    order = draw(st.permutations(list(range(F_)))) if draw(st.booleans()) else list(range(F_))
    return dict(
        F_=F_, D=D, H=H, tail=tail, stack_dim=stack_dim, order=order,
        source=draw(st.sampled_from(SOURCES)),
        ln=draw(st.sampled_from(["per_slice", "shared", "functional", "dict"])),
        affine=draw(st.booleans()),
        eps=draw(st.sampled_from([1e-5, 0.1, 1e-3])),
        sink="cat_view" if (tail == "after" and stack_dim == 1 and draw(st.booleans())) else "stack",
        act=draw(st.sampled_from(["tanh", "method"])),
    ), draw(st.integers(1, 4)), draw(st.integers(1, 6))


# derandomize + a seed per example: the same models and tensors on every run. Unseeded, one run
# in ~8 drew a D=3 row whose variance was near zero: fp32 LayerNorm of such a row is off by more
# than 1e-5 relative from float64 (any fp32 implementation is), and hypothesis could not replay it.
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_random_per_feature_models_are_equivalent(case):
    torch.manual_seed(0)
    kwargs, B, B_fresh = case
    m = PerFeature(**kwargs)
    gm = recfuse.transform(m, m.example(B=B))
    vertical = kwargs["tail"] != "none"
    assert count_recfuse(gm) == (1 if vertical else 0), gm.code
    assert count_layer_norm(gm) == (0 if vertical else 1), gm.code
    assert_equivalent(m, gm, m.example(B=B_fresh))
