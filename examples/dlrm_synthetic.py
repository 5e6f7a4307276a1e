"""A DLRM-style model with `recfuse.FusedFeatureProcessor` in place of a per-feature loop.

    dense features --bottom MLP--------------------------------------------\\
    sparse ids --EmbeddingBag per feature--> [B, F*D] --FusedFeatureProcessor--> [B, F*H] --cat--> top MLP --> logit

The per-feature loop it replaces (F LayerNorms and a shared Linear, 2F+3 kernel launches)::

    out = [relu(linear(tanh(ln[name](emb[name])))) for name in feature_names]

Trains a few SGD steps on synthetic click data and prints the loss. With torchrec installed the
sparse arch is a torchrec EmbeddingBagCollection and the module takes its KeyedTensor; without it,
one nn.EmbeddingBag per feature writes into a [B, F*D] buffer. ``--compare-loop`` also trains the
per-feature loop from the same initial weights and prints both losses side by side.

Example:
    python examples/dlrm_synthetic.py --steps 10
    python examples/dlrm_synthetic.py --steps 5 --compare-loop --no-torchrec
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import recfuse

FEATURES = ["user_id", "item_id", "category", "city", "device", "hour"]


def has_torchrec() -> bool:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return False
    return True


class PlainSparseArch(nn.Module):
    """One nn.EmbeddingBag (sum pooling) per feature, pooled into one [B, F*D] buffer."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.bags = nn.ModuleDict({n: nn.EmbeddingBag(rows, dim, mode="sum") for n in FEATURES})

    def forward(self, ids: dict) -> torch.Tensor:
        return torch.cat([self.bags[n](*ids[n]) for n in FEATURES], dim=1)


class TorchrecSparseArch(nn.Module):
    """A torchrec EmbeddingBagCollection: returns a KeyedTensor keyed by feature name."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        tables = [
            EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=rows, feature_names=[n])
            for n in FEATURES
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))

    def forward(self, kjt):
        return self.ebc(kjt)


class PerFeatureLoop(nn.Module):
    """The unfused preprocessing recfuse replaces: a LayerNorm per feature and a shared Linear."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.ln = nn.ModuleDict({n: nn.LayerNorm(dim) for n in FEATURES})
        self.linear = nn.Linear(dim, hidden)
        self.dim = dim

    def forward(self, pooled) -> torch.Tensor:
        if isinstance(pooled, torch.Tensor):  # [B, F*D] in FEATURES order
            per_feature = dict(zip(FEATURES, pooled.split(self.dim, dim=1)))
        else:  # KeyedTensor
            per_feature = {n: pooled[n] for n in FEATURES}
        outs = [torch.relu(self.linear(torch.tanh(self.ln[n](per_feature[n])))) for n in FEATURES]
        return torch.cat(outs, dim=1)


class FusedPreprocessing(nn.Module):
    """FusedFeatureProcessor, returning a [B, F*H] tensor in FEATURES order for the top MLP."""

    def __init__(self, features: recfuse.FusedFeatureProcessor):
        super().__init__()
        self.features = features

    def forward(self, pooled) -> torch.Tensor:
        out = self.features(pooled)
        if isinstance(out, torch.Tensor):
            return out
        if out.keys() == FEATURES:  # an unsharded EBC keeps the config order: no copy
            return out.values()
        return torch.cat([out[n] for n in FEATURES], dim=1)  # e.g. a sharded EBC's key order


class DLRM(nn.Module):
    def __init__(self, sparse: nn.Module, preprocessing: nn.Module, num_dense: int, hidden: int):
        super().__init__()
        self.sparse = sparse
        self.preprocessing = preprocessing
        self.bottom = nn.Sequential(nn.Linear(num_dense, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(16 + len(FEATURES) * hidden, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        features = self.preprocessing(self.sparse(sparse))
        return self.top(torch.cat([self.bottom(dense), features], dim=1))


def synthetic_batch(batch_size: int, num_dense: int, rows: int, use_torchrec: bool, g: torch.Generator):
    """Dense features, 1-3 ids per sparse feature, and labels from a hidden linear rule."""
    dense = torch.randn(batch_size, num_dense, generator=g)
    lengths = torch.randint(1, 4, (len(FEATURES), batch_size), generator=g)
    ids = [torch.randint(0, rows, (int(lengths[f].sum()),), generator=g) for f in range(len(FEATURES))]
    # Clicks depend on the dense features and on whether the first item id is even.
    first_item = ids[1][torch.cumsum(lengths[1], 0) - lengths[1]]
    logits = dense[:, 0] - dense[:, 1] + (first_item % 2 == 0).float() * 2 - 1
    labels = (torch.rand(batch_size, generator=g) < torch.sigmoid(logits)).float().unsqueeze(1)
    if use_torchrec:
        from torchrec import KeyedJaggedTensor

        sparse = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=torch.cat(ids), lengths=lengths.flatten())
    else:
        offsets = [torch.cumsum(lengths[f], 0) - lengths[f] for f in range(len(FEATURES))]
        sparse = {n: (ids[f], offsets[f]) for f, n in enumerate(FEATURES)}
    return dense, sparse, labels


def build_models(args, use_torchrec: bool):
    """(fused model, per-feature-loop model) with identical initial weights."""
    torch.manual_seed(args.seed)
    sparse = (TorchrecSparseArch if use_torchrec else PlainSparseArch)(args.rows, args.dim)
    loop = DLRM(sparse, PerFeatureLoop(args.dim, args.hidden), args.num_dense, args.hidden)
    fused = copy.deepcopy(loop)
    fused.preprocessing = FusedPreprocessing(
        recfuse.FusedFeatureProcessor.from_modules(loop.preprocessing.ln, loop.preprocessing.linear)
    )
    return fused, loop


def train(model: nn.Module, batches, lr: float) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for dense, sparse, labels in batches:
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16, help="embedding dim D")
    parser.add_argument("--hidden", type=int, default=4, help="out_features H per feature")
    parser.add_argument("--rows", type=int, default=1000, help="rows per embedding table")
    parser.add_argument("--num-dense", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-torchrec", action="store_true", help="use nn.EmbeddingBag even if torchrec is installed")
    parser.add_argument("--compare-loop", action="store_true", help="also train the per-feature loop and compare")
    args = parser.parse_args(argv)

    use_torchrec = has_torchrec() and not args.no_torchrec
    fused, loop = build_models(args, use_torchrec)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [synthetic_batch(args.batch_size, args.num_dense, args.rows, use_torchrec, g) for _ in range(args.steps)]
    print(f"sparse arch: {'torchrec EmbeddingBagCollection' if use_torchrec else 'nn.EmbeddingBag'}; "
          f"{fused.preprocessing.features}")

    start = time.perf_counter()
    fused_losses = train(fused, batches, args.lr)
    elapsed = time.perf_counter() - start
    loop_losses = train(loop, batches, args.lr) if args.compare_loop else None

    for step, loss in enumerate(fused_losses):
        line = f"step {step:3d}  loss {loss:.6f}"
        if loop_losses is not None:
            line += f"  per-feature loop {loop_losses[step]:.6f}  |diff| {abs(loss - loop_losses[step]):.2e}"
        print(line)
    # Wall time on CPU is dominated by Python and the embedding bags; it is not a benchmark of
    # the fused op (benchmarks/ measures that on a GPU).
    print(f"trained {args.steps} steps in {elapsed:.2f} s")


if __name__ == "__main__":
    main()
