"""FusedFeatureProcessor under data parallelism: DDP and torchrec DistributedModelParallel.

Two processes on gloo (CPU), started with torch.multiprocessing spawn on a free port. Each rank
takes half of one global batch; the workers write what they measured to files, and the parent
compares them with a single-process run on the whole global batch:

* DDP: averaged gradients of every parameter equal the single-process gradients.
* DMP: a sharded EmbeddingBagCollection (table-wise on each rank, row-wise, data-parallel) whose
  KeyedTensor comes back in another key order than the unsharded one, FusedFeatureProcessor as
  the data-parallel dense part; losses equal the unsharded per-feature-loop model's step by step,
  and the state_dict saved through DMP reloads into a fresh DMP with identical outputs.
"""
import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from recfuse import FusedFeatureProcessor

WORLD_SIZE = 2
GLOBAL_BATCH = 16
TOL = 1e-5  # relative, float32


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two ranks on a small shared machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))


# A rank that waits longer than this for the other one fails (gloo's default is 30 minutes,
# which would hang CI); the whole spawn gets SPAWN_TIMEOUT_S.
RANK_TIMEOUT_S = 120
SPAWN_TIMEOUT_S = 150  # a run takes ~10-30 s here; a hang (rare, cause unknown) is retried sooner


def spawn(worker, *args) -> None:
    """Run `worker(rank, port, *args)` on WORLD_SIZE processes; fail (never hang) past the deadline.

    Twice in ~8 runs of the suite on the 2-core CI-like machine, the two ranks never met (one
    spawned process left, waiting); the cause was not found. A run past the deadline is
    killed and retried once on a new port, with a warning; a second overrun fails the test.
    """
    for attempt in range(2):
        ctx = mp.start_processes(worker, args=(free_port(), *args), nprocs=WORLD_SIZE, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not ctx.join(timeout=5):  # raises if a rank failed
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    p.kill()
                if attempt:
                    pytest.fail(f"ranks {alive} still running after {SPAWN_TIMEOUT_S} s, twice")
                import warnings
                warnings.warn(f"ranks {alive} still running after {SPAWN_TIMEOUT_S} s; retrying once")
                break
        else:
            return


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# DDP


NAMES = ["user", "item", "ctx", "geo", "hour"]
DIMS = [8, 4, 8, 4, 8]


class DenseRanker(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = FusedFeatureProcessor(NAMES, DIMS, out_features=3, shared_linear=False)
        self.over = nn.Linear(len(NAMES) * 3, 1)
        with torch.no_grad():
            self.features.ln_weight_d8.normal_(1.0, 0.3)
            self.features.ln_bias_d4.normal_(0.0, 0.3)

    def forward(self, x):
        return self.over(self.features(x))


def ddp_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(GLOBAL_BATCH, sum(DIMS), generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, port)
    try:
        torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        model = DenseRanker()
        ddp = nn.parallel.DistributedDataParallel(model)
        x, target = ddp_data()
        local = slice(rank * GLOBAL_BATCH // WORLD_SIZE, (rank + 1) * GLOBAL_BATCH // WORLD_SIZE)
        nn.functional.mse_loss(ddp(x[local]), target[local]).backward()  # DDP averages grads
        torch.save({n: p.grad for n, p in model.named_parameters()}, os.path.join(out_dir, f"ddp{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_equal_single_process(tmp_path):
    spawn(_ddp_worker, str(tmp_path))
    torch.manual_seed(0)
    model = DenseRanker()
    x, target = ddp_data()
    nn.functional.mse_loss(model(x), target).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    for rank in range(WORLD_SIZE):
        got = torch.load(tmp_path / f"ddp{rank}.pt")
        assert set(got) == set(expected)
        for name, grad in expected.items():
            assert rel_err(got[name], grad) < TOL, f"rank {rank}, {name}"


# ---------------------------------------------------------------------------------------------
# torchrec DistributedModelParallel: sharded EBC, FusedFeatureProcessor as the dense part


DMP_DIMS = {"user": 8, "item": 4, "ctx": 16, "geo": 8}
DMP_STEPS = 4
LR = 0.5


def dmp_batches():
    from test_torchrec_integration import make_batch

    g = torch.Generator().manual_seed(1)
    return [make_batch(GLOBAL_BATCH, g) for _ in range(DMP_STEPS + 1)]  # the last one for eval


def shard_model(model: nn.Module):
    """DMP over `model` with a plan that mixes sharding types and so reorders the EBC's keys."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    # Dense compute kernels: the CPU build of fbgemm-gpu; table-wise on each rank, row-wise and
    # data-parallel are the sharding types this test found to work on CPU/gloo.
    ebc_plan = construct_module_sharding_plan(
        model.ebc,
        {"t_user": table_wise(rank=1), "t_item": table_wise(rank=0), "t_ctx": row_wise(), "t_geo": data_parallel()},
        local_size=WORLD_SIZE,
        world_size=WORLD_SIZE,
        device_type="cpu",
    )
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": ebc_plan}),
        sharders=[EmbeddingBagCollectionSharder()],
    )


def local_table_shards(state_dict) -> dict:
    """table name -> [(row offset, local rows)] of this rank's part of each embedding table."""
    out = {}
    for key, value in state_dict.items():
        if not key.startswith("ebc."):
            continue
        if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
            out[key] = [(0, value.detach().clone())]  # data-parallel: a full replica
        else:
            out[key] = [(s.metadata.shard_offsets[0], s.tensor.detach().clone()) for s in value.local_shards()]
    return out


def copy_tables_into_shards(dmp, full_tables: dict) -> None:
    """Give the sharded tables the unsharded model's weights.

    Sharding re-initialises the embedding tables (each shard draws its own random rows), so
    without this the DMP model would start from other embeddings than the reference.
    """
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if key not in full_tables:
                continue
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    row0, col0 = shard.metadata.shard_offsets
                    rows, cols = shard.metadata.shard_sizes
                    shard.tensor.copy_(full_tables[key][row0:row0 + rows, col0:col0 + cols])
            else:
                value.copy_(full_tables[key])


def _dmp_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, port)
    try:
        from test_torchrec_integration import Ranker, batch_slice, make_ebc, make_model_pair
        from torchrec.optim.keyed import KeyedOptimizerWrapper
        from torchrec.distributed.types import Awaitable

        _, fused = make_model_pair(DMP_DIMS, shared_linear=False)  # same seed -> same weights
        tables = {k: v.detach().clone() for k, v in fused.state_dict().items() if k.startswith("ebc.")}
        dmp = shard_model(fused)
        copy_tables_into_shards(dmp, tables)
        opt = KeyedOptimizerWrapper(dict(dmp.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=LR))
        local = (rank * GLOBAL_BATCH // WORLD_SIZE, (rank + 1) * GLOBAL_BATCH // WORLD_SIZE)
        batches = dmp_batches()

        kt = dmp.module.ebc(batch_slice(*batches[0], *local)[0])
        kt = kt.wait() if isinstance(kt, Awaitable) else kt
        ebc_keys = list(kt.keys())

        losses = []
        for kjt, labels in batches[:DMP_STEPS]:
            local_kjt, local_labels = batch_slice(kjt, labels, *local)
            opt.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(dmp(local_kjt), local_labels)
            loss.backward()
            opt.step()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)  # mean over ranks of per-rank means = global-batch mean
            losses.append(global_loss.item() / WORLD_SIZE)

        eval_kjt = batch_slice(*batches[-1], *local)[0]
        with torch.no_grad():
            eval_out = dmp(eval_kjt)

        # Save through DMP (each rank writes its shards), reload into a fresh DMP with other weights.
        state_path = os.path.join(out_dir, f"dmp_state{rank}.pt")
        torch.save(dmp.state_dict(), state_path)
        _, other = make_model_pair(DMP_DIMS, shared_linear=False, seed=123)
        fresh = shard_model(other)
        with torch.no_grad():
            before_load = fresh(eval_kjt)
        fresh.load_state_dict(torch.load(state_path, weights_only=False))
        with torch.no_grad():
            after_load = fresh(eval_kjt)

        # Meta-device model: DMP materialises it, calling FusedFeatureProcessor.reset_parameters.
        meta = Ranker(make_ebc(DMP_DIMS, device="meta"), FusedFeatureProcessor(
            list(DMP_DIMS), list(DMP_DIMS.values()), out_features=2, shared_linear=False, device="meta"
        ))
        meta_dmp = shard_model(meta)
        meta_params = {n: p.detach().clone() for n, p in meta_dmp.module.dense.named_parameters()}

        state = dmp.state_dict()
        torch.save(
            {
                "ebc_keys": ebc_keys,
                "losses": losses,
                "dense": {k: v.detach().clone() for k, v in state.items() if k.startswith("dense.")},
                "tables": local_table_shards(state),
                "state_keys": list(state),
                "eval_out": eval_out,
                "before_load": before_load,
                "after_load": after_load,
                "meta_params": meta_params,
            },
            os.path.join(out_dir, f"dmp{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_dmp_sharded_ebc_trains_like_the_unsharded_loop_and_reloads(tmp_path):
    pytest.importorskip("torchrec")
    from test_torchrec_integration import NAMES as EBC_NAMES
    from test_torchrec_integration import make_model_pair, train

    spawn(_dmp_worker, str(tmp_path))
    reference, fused = make_model_pair(DMP_DIMS, shared_linear=False)
    batches = dmp_batches()
    ref_losses = train(reference, batches[:DMP_STEPS], lr=LR)
    train(fused, batches[:DMP_STEPS], lr=LR)  # single-process fused: the dense parameters to expect
    with torch.no_grad():
        ref_eval = reference(batches[-1][0])
    half = GLOBAL_BATCH // WORLD_SIZE

    results = [torch.load(tmp_path / f"dmp{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
    for rank, res in enumerate(results):
        # The plan really reorders the EBC's keys: the module must look features up by name.
        assert sorted(res["ebc_keys"]) == sorted(EBC_NAMES) and res["ebc_keys"] != EBC_NAMES
        for step, (a, b) in enumerate(zip(res["losses"], ref_losses)):
            assert abs(a - b) <= TOL * abs(b), f"rank {rank} step {step}: DMP {a} vs unsharded loop {b}"
        for name, p in fused.dense.features.named_parameters():
            assert rel_err(res["dense"][f"dense.features.{name}"], p) < TOL, f"rank {rank}, {name}"
        for key, shards in res["tables"].items():
            table = dict(reference.named_parameters())[key]
            for row0, rows in shards:
                assert rel_err(rows, table[row0:row0 + rows.shape[0]]) < TOL, f"rank {rank}, {key}"
        local_ref = ref_eval[rank * half:(rank + 1) * half]
        assert rel_err(res["eval_out"], local_ref) < TOL
        assert rel_err(res["before_load"], local_ref) > 1e-2  # the fresh model really differed
        assert torch.equal(res["after_load"], res["eval_out"])
        assert any(k.startswith("dense.features.ln_weight") for k in res["state_keys"])

    # Meta-device materialisation: reset_parameters ran (LayerNorm 1/0, Linear in +-1/sqrt(D))
    # and DDP made the ranks agree.
    meta0, meta1 = results[0]["meta_params"], results[1]["meta_params"]
    for name, p in meta0.items():
        assert torch.equal(p, meta1[name]), name
        dim = int(name.rsplit("_d", 1)[1])
        if name.startswith("ln_weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.startswith("ln_bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert p.abs().max() <= dim ** -0.5 and p.std() > 0.1 * dim ** -0.5, name
