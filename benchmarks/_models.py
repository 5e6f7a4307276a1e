"""Models shared by the benchmark tools: the per-feature form that `recfuse.transform` rewrites."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PerSlice(nn.Module):
    """F features of width D, each with its own LayerNorm, then a shared Linear and relu."""

    def __init__(self, features: int, dim: int, out: int):
        super().__init__()
        self.dim = dim
        self.lns = nn.ModuleList([nn.LayerNorm(dim) for _ in range(features)])
        self.linear = nn.Linear(dim, out)

    def forward(self, x):
        slices = torch.split(x, self.dim, dim=1)
        outs = [torch.tanh(ln(s)) for ln, s in zip(self.lns, slices)]
        return F.relu(self.linear(torch.stack(outs, dim=1)))
