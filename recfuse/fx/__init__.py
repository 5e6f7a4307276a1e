"""The graph pass: capture a per-feature model, batch its per-slice chains, fuse them.

Layering (one direction): `capture` (value-carrying torch.fx tracing, Dynamo fallback) ->
`patterns` (normal forms of ops, slices and sinks) -> `fusions` (analysis and the fusion
registry) -> `transform` (the public entry points) -> `report`.

Example:
    >>> import torch, recfuse
    >>> from recfuse.puzzler import split_stack
    >>> lin = torch.nn.Linear(8, 1)
    >>> fused = recfuse.transform(split_stack, (torch.randn(96), 4, 8, lin))
    >>> sum(n.target is recfuse.ops.ln_tanh_linear_relu for n in fused.graph.nodes)
    1
"""
from .fusions import FUSIONS, Fusion, register_fusion
from .report import FusionReport
from .transform import (RecfusePreGradPass, backend, explain, fuse_graph, make_backend, pre_grad_pass,
                        transform, verify)

__all__ = ["transform", "explain", "verify", "FusionReport", "fuse_graph", "Fusion", "FUSIONS",
           "register_fusion", "RecfusePreGradPass", "pre_grad_pass", "backend", "make_backend"]
