"""Red-team round 5: "never a silent wrong answer". Each test compares the transformed model with
the untouched original, or checks the error that refuses the case. Each docstring says what the
case did before its fix."""
import copy

import pytest
import torch
from torch import nn

import recfuse
from recfuse.errors import RecfuseError

from fx_cases import PerFeatureBase, assert_same_forward_backward, count_recfuse, randomized, reloaded

F_, D, H = 4, 8, 3


def per_feature(forward):
    """`fx_cases.PerFeatureBase` (lns: 4 LayerNorms of 8, lin: Linear(8, 3)) with this forward and
    randomized parameters."""
    cls = type("M", (PerFeatureBase,), {"forward": forward})
    return randomized(cls())



def chain(m, x):
    """Each feature's tanh(LayerNorm(slice))."""
    return [torch.tanh(n(t)) for n, t in zip(m.lns, x.split(D, 1))]


def assert_same_at(m, example_batch, batches):
    ref = copy.deepcopy(m)
    g = recfuse.transform(m, (torch.randn(example_batch, F_ * D),))
    for b in batches:
        assert_same_forward_backward(g, ref, torch.randn(b, F_ * D))
    return g


# -- The layout a view gives was read from the example's shape ------------------------------------
# `cat(..., 0).view(-1, F, D)` is [B, F, D] (rows of features mixed), but when the example's batch
# equals F its shape is that of the stack [F, B, D], and the view was replaced by the stack.

CAT_VIEWS = {
    "cat0_view_-1_F_D": lambda m, x: torch.relu(m.lin(torch.cat(chain(m, x), 0).view(-1, F_, D))),
    "cat1_view_F_-1_D": lambda m, x: torch.relu(m.lin(torch.cat(chain(m, x), 1).view(F_, -1, D))),
}


@pytest.mark.parametrize("spelling", sorted(CAT_VIEWS))
def test_a_view_of_a_cat_shaped_like_the_stack_only_at_the_example(spelling):
    """Before: transformed with B == F == 4, a call with B == 3 returned [4, 3, 3] where the
    original returns [3, 4, 3] (and other values)."""
    assert_same_at(per_feature(CAT_VIEWS[spelling]), F_, [3, 5, F_])


@pytest.mark.parametrize("spelling", ["view", "reshape"])
def test_a_view_of_a_cat_into_the_stack_layout_is_still_fused(spelling):
    def forward(m, x):
        y = torch.cat(chain(m, x), 1)
        y = y.view(x.shape[0], F_, D) if spelling == "view" else y.reshape(-1, F_, D)
        return torch.relu(m.lin(y))
    g = assert_same_at(per_feature(forward), F_, [3, 1])
    assert count_recfuse(g) == 1


UNIT_VIEWS = {
    "cat0_of_view_-1_1_D": lambda m, x: torch.relu(m.lin(torch.cat([h.view(-1, 1, D) for h in chain(m, x)], 0))),
    "cat1_of_reshape_1_-1_D": lambda m, x: torch.relu(m.lin(torch.cat([h.reshape(1, -1, D) for h in chain(m, x)], 1))),
}


@pytest.mark.parametrize("spelling", sorted(UNIT_VIEWS))
def test_per_slice_views_that_add_a_unit_dim_only_at_batch_one(spelling):
    """Before: transformed with B == 1, where `h.view(-1, 1, D)` looks like `h.unsqueeze(0)`, the
    cat was replaced by a stack: a call with B == 3 returned [4, 3, 3] for the original's [12, 1, 3]."""
    assert_same_at(per_feature(UNIT_VIEWS[spelling]), 1, [3, 1])


SQUEEZES = {
    "after_chain": lambda m, x: torch.relu(m.lin(torch.stack([h.squeeze() for h in chain(m, x)], 0))),
    "before_chain": lambda m, x: torch.relu(m.lin(torch.stack(
        [torch.tanh(n(t.squeeze())) for n, t in zip(m.lns, x.split(D, 1))], 0))),
    "inside_chain": lambda m, x: torch.relu(m.lin(torch.stack(
        [torch.tanh(n(t).squeeze()) for n, t in zip(m.lns, x.split(D, 1))], 0))),
    "reshape_H_-1": lambda m, x: torch.stack(
        [torch.relu(m.lin(h)).reshape(H, -1) for h in chain(m, x)], 0).sum(1),
}


@pytest.mark.parametrize("spelling", sorted(SQUEEZES))
def test_per_slice_views_that_keep_the_shape_only_at_the_example(spelling):
    """Before: `h.squeeze()` keeps [B, D] when the example's B is 3 and was dropped as a no-op: a
    call with B == 1 returned [4, 1, 3] where the original's squeeze gives [4, 3] (or crashed in
    the fused op, 'x must be 3D'). `h.reshape(H, -1)` of [B, H] with B == H == 3 is a transpose of
    sorts, not a no-op: calls with B == 5 returned other numbers and a [4, 3] for the original's [4, 5]."""
    assert_same_at(per_feature(SQUEEZES[spelling]), 3, [1, 5, 3])


# -- A per-slice value served as a strided view of the batched result -------------------------------

VIEWED = {
    "side_use": lambda m, x: (lambda hs: (torch.relu(m.lin(torch.stack(hs, 1))), hs[1].view(-1)))(chain(m, x)),
    "post_view": lambda m, x: torch.relu(m.lin(torch.stack([h.view(-1) for h in chain(m, x)], 1).view(-1, F_, D))),
}


@pytest.mark.parametrize("spelling", sorted(VIEWED))
def test_a_per_slice_value_read_through_view(spelling):
    """Before: each slice's value was a select of the batched [B, F, D] result, not contiguous like
    the per-slice op's result: the model's `h.view(-1)` raised 'view size is not compatible with
    input tensor's size and stride' where the original runs."""
    m = per_feature(VIEWED[spelling])
    ref = copy.deepcopy(m)
    g = recfuse.transform(m, (torch.randn(3, F_ * D),))
    for b in (3, 5):
        x = torch.randn(b, F_ * D)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        outs = [g(xs[0]), ref(xs[1])]
        outs = [o if isinstance(o, tuple) else (o,) for o in outs]
        for a, r in zip(*outs):
            torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
        sum((o ** 2).sum() for o in outs[0]).backward()
        sum((o ** 2).sum() for o in outs[1]).backward()
        torch.testing.assert_close(xs[0].grad, xs[1].grad, atol=1e-4, rtol=1e-4)


# -- A normalized_shape computed from the slice's shape ------------------------------------------


@pytest.mark.parametrize("shape", ["t.shape", "t.shape[-2:]"])
def test_a_layer_norm_over_the_batch_too_keeps_following_the_batch(shape):
    """Before: `F.layer_norm(t, t.shape)` (normalized over B and D, each slice as a whole) was
    batched with the example's [3, 8] as its normalized_shape: a call with B == 5 raised 'Given
    normalized_shape=[3, 8], expected input with shape [*, 3, 8]' where the original runs."""
    def forward(m, x):
        ts = x.split(D, 1)
        hs = [torch.tanh(torch.nn.functional.layer_norm(t, t.shape if shape == "t.shape" else t.shape[-2:]))
              for t in ts]
        return torch.relu(m.lin(torch.stack(hs, 1)))
    assert_same_at(per_feature(forward), 3, [5, 1, 3])


# -- Slices counted from the end -------------------------------------------------------------------
# Rows of a [F*B, D] input taken with negative indices follow the input's size on every call; they
# were resolved to offsets from the start at the example's size.

ROW_SLICES = {
    "from_the_end": lambda x: [x[-(F_ - i) * 3:(-(F_ - i - 1) * 3) or None] for i in range(F_)],
    "narrow_from_the_end": lambda x: [x.narrow(0, -(F_ - i) * 3, 3) for i in range(F_)],
    "mixed": lambda x: [x[0:3], x[3:6], x[-6:-3], x[-3:]],
    "select_from_the_end": lambda x: [x.view(-1, 3, D)[i - F_] for i in range(F_)],
}


@pytest.mark.parametrize("spelling", sorted(ROW_SLICES))
def test_slices_counted_from_the_end_of_a_growing_dim(spelling):
    """Before: `x[-12:-9], ..., x[-3:]` of the example's [12, 8] became the zero-copy view of rows
    0..12; a call with a [24, 8] input read rows 0..12 where the original reads rows 12..24
    (max abs diff 1.4), silently."""
    def forward(m, x):
        hs = [torch.tanh(n(t)) for n, t in zip(m.lns, ROW_SLICES[spelling](x))]
        return torch.relu(m.lin(torch.stack(hs, 0)))
    m = per_feature(forward)
    ref = copy.deepcopy(m)
    g = recfuse.transform(m, (torch.randn(F_ * 3, D),))
    for rows in (24, 12, 15):
        assert_same_forward_backward(g, ref, torch.randn(rows, D))


def test_a_slice_to_the_end_of_a_growing_dim_is_guarded():
    """Before: rows `x[0:3], x[3:6], x[6:9], x[9:]` of the example's [12, 8], each normalized and
    concatenated, were batched as four slices of 3: a call with a [20, 8] input returned [12, 3]
    where the original's last slice has 11 rows and its result is [20, 3], silently."""
    def forward(m, x):
        hs = [torch.tanh(n(t)) for n, t in zip(m.lns, [x[0:3], x[3:6], x[6:9], x[9:]])]
        return torch.relu(m.lin(torch.cat(hs, 0)))
    m = per_feature(forward)
    ref = copy.deepcopy(m)
    g = recfuse.transform(m, (torch.randn(12, D),))
    assert g.recfuse_report.groups
    assert_same_forward_backward(g, ref, torch.randn(12, D))
    for h in (g, reloaded(g)):
        with pytest.raises(RecfuseError, match=r"x\[9:\] along dim 0.*size 12.*this call's size is 20"):
            h(torch.randn(20, D))


def test_columns_to_the_end_stay_a_zero_copy_view():
    def forward(m, x):
        ts = [x[:, 0:8], x[:, 8:16], x[:, 16:24], x[:, 24:]]
        return torch.relu(m.lin(torch.stack([torch.tanh(n(t)) for n, t in zip(m.lns, ts)], 1)))
    g = assert_same_at(per_feature(forward), 3, [5, 1])
    assert count_recfuse(g) == 1 and "zero-copy view" in str(g.recfuse_report)
