"""torchrec EmbeddingBagCollection -> FusedFeatureProcessor -> over-arch, trained against the loop.

The reference model is what a user writes without recfuse: one LayerNorm and Linear per feature,
applied to ``kt[name]`` in a Python loop. The fused model is built from it with
`FusedFeatureProcessor.from_modules`, so both start from the same weights; SGD steps on the same
batches must then give the same losses, step by step, and the same embedding tables at the end.

The models here are also used by tests/test_distributed.py.
"""
import copy

import pytest
import torch
from torch import nn

torchrec = pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedTensor  # noqa: E402

from recfuse import FusedFeatureProcessor  # noqa: E402

LOSS_TOL = 1e-5  # relative, float32
NAMES = ["user", "item", "ctx", "geo"]
ROWS = 40  # embedding rows per table
H = 2


def make_ebc(dims: dict, device="cpu") -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dims[n], num_embeddings=ROWS, feature_names=[n])
        for n in NAMES
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device(device))


def make_batch(batch_size: int, generator: torch.Generator, max_ids: int = 3):
    """Sparse ids (0..max_ids per sample and feature, empty bags included) and 0/1 labels."""
    lengths = torch.randint(0, max_ids + 1, (len(NAMES) * batch_size,), generator=generator)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=NAMES, values=values, lengths=lengths)
    labels = torch.randint(0, 2, (batch_size, 1), generator=generator).float()
    return kjt, labels


def batch_slice(kjt: KeyedJaggedTensor, labels: torch.Tensor, start: int, stop: int):
    """Samples start:stop of a batch (for splitting one global batch over ranks)."""
    per_feature = kjt.to_dict()
    lengths, values = [], []
    for n in NAMES:
        jt = per_feature[n]
        offsets = jt.offsets()
        lengths.append(jt.lengths()[start:stop])
        values.append(jt.values()[offsets[start]:offsets[stop]])
    sliced = KeyedJaggedTensor.from_lengths_sync(keys=NAMES, values=torch.cat(values), lengths=torch.cat(lengths))
    return sliced, labels[start:stop]


class PerFeatureDense(nn.Module):
    """The unfused reference: a LayerNorm and a Linear per feature, looked up by name in a loop."""

    def __init__(self, dims: dict, shared_linear: bool):
        super().__init__()
        self.ln = nn.ModuleDict({n: nn.LayerNorm(dims[n]) for n in NAMES})
        if shared_linear:
            self.linear = nn.Linear(dims[NAMES[0]], H)
        else:
            self.linear = nn.ModuleDict({n: nn.Linear(dims[n], H) for n in NAMES})
        with torch.no_grad():  # non-trivial affine, so a feature->parameter mix-up shows
            for ln in self.ln.values():
                ln.weight.normal_(1.0, 0.3)
                ln.bias.normal_(0.0, 0.3)

    def forward(self, kt: KeyedTensor) -> torch.Tensor:
        outs = []
        for n in NAMES:
            linear = self.linear if isinstance(self.linear, nn.Linear) else self.linear[n]
            outs.append(torch.relu(linear(torch.tanh(self.ln[n](kt[n])))))
        return torch.cat(outs, dim=1)


class FusedDense(nn.Module):
    """FusedFeatureProcessor on the KeyedTensor, outputs put in NAMES order for the over-arch."""

    def __init__(self, features: FusedFeatureProcessor):
        super().__init__()
        self.features = features

    def forward(self, kt: KeyedTensor) -> torch.Tensor:
        y = self.features(kt)
        if y.keys() == NAMES:  # unsharded EBC: already in order, no copy
            return y.values()
        return torch.cat([y[n] for n in NAMES], dim=1)  # a sharded EBC's key order


class Ranker(nn.Module):
    def __init__(self, ebc: nn.Module, dense: nn.Module):
        super().__init__()
        self.ebc = ebc
        self.dense = dense
        self.over = nn.Sequential(nn.Linear(len(NAMES) * H, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.dense(self.ebc(kjt)))


def make_model_pair(dims: dict, shared_linear: bool, seed: int = 0):
    """(reference Ranker with the per-feature loop, fused Ranker with identical weights)."""
    torch.manual_seed(seed)
    reference = Ranker(make_ebc(dims), PerFeatureDense(dims, shared_linear))
    fused = copy.deepcopy(reference)
    fused.dense = FusedDense(FusedFeatureProcessor.from_modules(reference.dense.ln, reference.dense.linear))
    return reference, fused


def train(model: nn.Module, batches, lr: float = 0.5) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for kjt, labels in batches:
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(kjt), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "dims,shared_linear",
    [
        ({"user": 8, "item": 8, "ctx": 8, "geo": 8}, True),
        ({"user": 8, "item": 8, "ctx": 8, "geo": 8}, False),
        ({"user": 8, "item": 4, "ctx": 16, "geo": 8}, False),
    ],
)
def test_training_matches_the_per_feature_loop_step_by_step(dims, shared_linear):
    reference, fused = make_model_pair(dims, shared_linear)
    g = torch.Generator().manual_seed(1)
    batches = [make_batch(16, g) for _ in range(6)]
    ref_losses = train(reference, batches)
    fused_losses = train(fused, batches)
    assert len(set(round(v, 4) for v in ref_losses)) > 1  # training moves the loss
    for step, (a, b) in enumerate(zip(fused_losses, ref_losses)):
        assert abs(a - b) <= LOSS_TOL * abs(b), f"step {step}: fused {a} vs reference {b}"
    for n in NAMES:  # the embedding tables received the same gradients through the module
        w_ref = reference.ebc.embedding_bags[f"t_{n}"].weight
        w_fused = fused.ebc.embedding_bags[f"t_{n}"].weight
        torch.testing.assert_close(w_fused, w_ref, rtol=1e-5, atol=1e-6)


def test_ebc_output_is_read_in_place_and_keys_preserved():
    dims = {"user": 8, "item": 8, "ctx": 8, "geo": 8}
    reference, fused = make_model_pair(dims, shared_linear=False)
    kjt, _ = make_batch(5, torch.Generator().manual_seed(2))
    kt = fused.ebc(kjt)
    y = fused.dense.features(kt)
    assert isinstance(y, KeyedTensor) and y.keys() == kt.keys() and y.length_per_key() == [H] * 4
    torch.testing.assert_close(y.values(), reference.dense(kt), rtol=1e-5, atol=1e-6)


def test_torch_compile_fullgraph_with_keyed_tensor():
    torch._dynamo.reset()
    dims = {"user": 8, "item": 4, "ctx": 8, "geo": 4}
    features = FusedFeatureProcessor(NAMES, [dims[n] for n in NAMES], out_features=H, shared_linear=False)
    order = ["geo", "ctx", "user", "item"]  # a sharded EBC's order: parameters are reordered
    kt = KeyedTensor(order, [dims[n] for n in order], torch.randn(6, 24))

    def dense(kt):
        return features(kt).values()

    compiled = torch.compile(dense, fullgraph=True, backend="aot_eager")
    ref = copy.deepcopy(features).double().forward_reference(
        KeyedTensor(order, kt.length_per_key(), kt.values().double())
    )
    y = compiled(kt)
    assert ((y - ref.values()).norm() / ref.values().norm()).item() < 1e-5


@pytest.mark.parametrize("use_torchrec", [True, False])
def test_dlrm_example_trains_like_its_per_feature_loop(use_torchrec):
    """examples/dlrm_synthetic.py: the fused DLRM's losses equal the loop's, and it learns."""
    import argparse
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dlrm_synthetic.py"
    spec = importlib.util.spec_from_file_location("dlrm_synthetic", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = argparse.Namespace(seed=0, rows=50, dim=8, hidden=2, num_dense=4)
    fused, loop = example.build_models(args, use_torchrec)
    g = torch.Generator().manual_seed(1)
    batches = [example.synthetic_batch(64, args.num_dense, args.rows, use_torchrec, g) for _ in range(4)]
    batches = batches * 3  # revisit the same batches: the loss on them must go down
    fused_losses, loop_losses = example.train(fused, batches, 0.5), example.train(loop, batches, 0.5)
    for step, (a, b) in enumerate(zip(fused_losses, loop_losses)):
        assert abs(a - b) <= LOSS_TOL * abs(b), f"step {step}: fused {a} vs loop {b}"
    assert sum(fused_losses[-4:]) < sum(fused_losses[:4])
