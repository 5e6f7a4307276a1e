"""The `split_stack` vs `combined` puzzler: the two seed functions recfuse exists to fix.

Both compute relu(Linear(tanh(LayerNorm(x_f)))) for every D-wide feature slice x_f of a pooled
embedding buffer (LayerNorm without affine and with eps=0.0, Linear(D, H) shared by all features)
and return [F, B, H]. `split_stack` does it per slice (2F+3 kernel launches), `combined` on one
[B, F, D] view (5 launches). The Linear is passed in so that both use the same parameters.

Example:
    >>> import torch
    >>> from recfuse.puzzler import split_stack, combined
    >>> lin = torch.nn.Linear(8, 1)
    >>> x = torch.randn(4 * 3 * 8)                       # 1D, as the puzzler feeds it
    >>> torch.allclose(split_stack(x, 4, 8, lin), combined(x, 4, 8, lin), atol=1e-6)
    True
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["split_stack", "combined", "SplitStack", "Combined"]


def split_stack(input_data: torch.Tensor, batch_size: int, input_dim: int, linear: torch.nn.Module) -> torch.Tensor:
    """Per-slice form: split into F slices, LayerNorm and tanh each, stack, Linear, relu."""
    x = input_data.view(batch_size, -1)
    slices = torch.split(x, input_dim, dim=1)
    outs = [torch.tanh(F.layer_norm(s, (input_dim,), eps=0.0)) for s in slices]
    return F.relu(linear(torch.stack(outs)))


def combined(input_data: torch.Tensor, batch_size: int, input_dim: int, linear: torch.nn.Module) -> torch.Tensor:
    """Batched form: one LayerNorm and tanh over a [B, F, D] view, then Linear and relu."""
    x = input_data.view(batch_size, -1, input_dim)
    y = torch.tanh(F.layer_norm(x, (input_dim,), eps=0.0))
    return F.relu(linear(y.transpose(0, 1)))


class SplitStack(torch.nn.Module):
    """`split_stack` as a module owning its Linear(D, H), the form `recfuse.transform` takes.

    Example:
        >>> import torch
        >>> m = SplitStack(8, 1)
        >>> m(torch.randn(4 * 3 * 8), 4, 8).shape
        torch.Size([3, 4, 1])
    """

    def __init__(self, input_dim: int, out_features: int = 1):
        super().__init__()
        self.linear = torch.nn.Linear(input_dim, out_features)

    def forward(self, input_data: torch.Tensor, batch_size: int, input_dim: int) -> torch.Tensor:
        return split_stack(input_data, batch_size, input_dim, self.linear)


class Combined(SplitStack):
    """`combined` as a module with the same parameters as `SplitStack`.

    Example:
        >>> import torch
        >>> Combined(8, 1)(torch.randn(4 * 3 * 8), 4, 8).shape
        torch.Size([3, 4, 1])
    """

    def forward(self, input_data: torch.Tensor, batch_size: int, input_dim: int) -> torch.Tensor:
        return combined(input_data, batch_size, input_dim, self.linear)
