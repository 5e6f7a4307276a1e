"""The graph pass: capture a per-feature model, batch its per-slice chains, fuse them.

Layering (one direction): `values` (shapes and dtypes of traced values) -> `capture`
(value-carrying torch.fx tracing, Dynamo fallback) -> `patterns` (normal forms of ops, slices and
sinks) -> `plan` / `analysis` (candidate groups as `GroupPlan`s, kept current across rewrites) ->
`registry` + `rules/` (one class per fusion: its `match` and its `fuse`, with `rewrite.Rewriter`)
-> `fuse` (the claim-and-rewrite loop) -> `transform` (the public entry points) -> `report`.

Example:
    >>> import torch, recfuse
    >>> from recfuse.puzzler import split_stack
    >>> lin = torch.nn.Linear(8, 1)
    >>> fused = recfuse.transform(split_stack, (torch.randn(96), 4, 8, lin))
    >>> sum(n.target is recfuse.ops.ln_tanh_linear_relu for n in fused.graph.nodes)
    1
"""
from . import rules  # registers the built-in fusions
from .fuse import fuse_graph
from .plan import GroupPlan
from .registry import FUSIONS, Claim, Decline, Fusion, register_fusion, select_fusions, unregister_fusion
from .report import FusionReport
from .rewrite import Rewriter
from .transform import (RecfusePreGradPass, backend, explain, make_backend, pre_grad_pass, transform, verify)

__all__ = ["transform", "explain", "verify", "FusionReport", "fuse_graph", "Fusion", "Claim", "Decline", "FUSIONS",
           "register_fusion", "unregister_fusion", "select_fusions", "GroupPlan", "Rewriter", "RecfusePreGradPass",
           "pre_grad_pass", "backend", "make_backend"]
