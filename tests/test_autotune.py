"""Tuning on first use (`recfuse.ops.autotune`) and the on-disk cache `configs` reads.

The tuning itself runs here on CPU under the Triton interpreter (`interpret` tests: tiny shapes,
2-3 candidates, a fake timer); when the automatic trigger tunes (`on_lookup`, CUDA only) is
checked with the tuning function replaced by a recorder and the CUDA predicate patched."""
import dataclasses
import itertools
import json
import os
import threading
import time
import types

import pytest
import torch

from op_cases import Case, check_against_float64
from recfuse.ops import autotune, configs, launch

F32 = torch.float32
# tiny: x is 2 x 64 x 16 fp32 (8 KB); the masked check 2 x 40 rows; the finalists' second size
# off (`test_finalists_are_ranked_at_both_sizes` turns it on)
TINY = dict(features=2, batch=64, masked_features=2, masked_batch=40, confirm_scale=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh tuning cache folder, tuning off, nothing tried yet in this process."""
    monkeypatch.setenv(configs.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    monkeypatch.delenv(autotune.AUTOTUNE_ENV, raising=False)
    monkeypatch.setattr(autotune, "_TRIED", {})
    configs.cache_written()
    yield tmp_path
    configs.cache_written()


def _falling_times(start=100.0):
    """A timer that finds every config faster than the one before: the last passing one wins."""
    times = itertools.count(start, -1)
    return lambda fn: float(next(times))


def _files(folder):
    return sorted(p.name for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


# ---------------------------------------------------------------------------------------------
# the tuning function (interpreter)


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_a_tuned_entry_is_written_and_then_looked_up(cache, kind):
    lookup = configs.forward_config if kind == "forward" else configs.backward_config
    heuristic = lookup(16, 1, F32, "cpu")  # cached in this process before the file exists
    cands = autotune.candidates(kind, 16, 1, F32, "cpu", limit=2)
    assert len(cands) == 3 and cands[0] == heuristic
    rng = torch.get_rng_state()
    entry = autotune.tune_shape(kind, 16, 1, F32, "cpu", cands=cands, bench=_falling_times(), **TINY)
    assert torch.equal(torch.get_rng_state(), rng), "tuning changed the caller's RNG state"
    assert entry is not None and entry["candidates"] == 3 and entry["rejected"] == 0
    winner = configs.config_from_entry(kind, entry["config"], 16, 1, F32, True)
    assert winner == cands[-1] != heuristic
    # the file: the shipped tables' schema, at the documented path
    path = configs.cache_path("cpu")
    assert os.path.dirname(path) == str(cache / "tuned")
    with open(path) as f:
        table = json.load(f)
    assert {"gpu", "triton", "forward", "backward"} <= set(table)
    assert configs.table_entries(table) == {(kind, 16, 1, "float32", True): entry["config"]}
    # this process re-reads the cache it wrote: the lookup now returns the winner
    assert lookup(16, 1, F32, "cpu") == winner
    # a new process (caches cleared), tuning off: the cache file is still used
    configs.cache_written()
    assert lookup(16, 1, F32, "cpu") == winner
    # another shape keeps its heuristic
    assert configs.forward_config(32, 1, F32, "cpu") == configs.heuristic_forward(32, 1, F32)


@pytest.mark.interpret
def test_entries_are_merged_with_the_file(cache):
    """What the file holds (here another process's entry of the same kind) is kept."""
    other = dict(D=32, H=1, dtype="float32", full_tiles=True, us=1.0,
                 config=configs.config_to_entry(configs.heuristic_forward(32, 1, F32, num_warps=8)))
    autotune.write_entry(configs.cache_path("cpu"), "forward", other, {"gpu": "cpu"})
    a = autotune.tune_shape("forward", 16, 1, F32, "cpu", cands=autotune.candidates("forward", 16, 1, F32, "cpu", 1),
                            bench=_falling_times(), **TINY)
    b = autotune.tune_shape("backward", 16, 1, F32, "cpu",
                            cands=autotune.candidates("backward", 16, 1, F32, "cpu", 1), bench=_falling_times(),
                            **TINY)
    with open(configs.cache_path("cpu")) as f:
        entries = configs.table_entries(json.load(f))
    assert entries == {("forward", 32, 1, "float32", True): other["config"],
                       ("forward", 16, 1, "float32", True): a["config"],
                       ("backward", 16, 1, "float32", True): b["config"]}
    assert _files(cache) == [os.path.basename(configs.cache_path("cpu"))]  # no temp file left


@pytest.mark.interpret
def test_wrong_or_failing_candidates_are_never_written(cache, monkeypatch):
    """The fastest candidate computes y 1% off at the tuned batch (a miscompiled tile), the next
    is right there and wrong at the masked batch, one does not compile: the slowest right one wins."""
    heuristic = configs.heuristic_forward(16, 1, F32)
    wrong = dataclasses.replace(heuristic, block_b=16)
    wrong_masked = dataclasses.replace(heuristic, block_b=32)
    broken = dataclasses.replace(heuristic, block_b=3)  # arange of 3: does not compile
    times = {heuristic: 50.0, wrong: 1.0, wrong_masked: 2.0, broken: 0.5}
    call = autotune._call

    def corrupting_call(kind, t, cfg, stats, train=False):
        fn = call(kind, t, cfg, stats, train)
        masked = t["x"].shape[0] == TINY["masked_batch"]
        if (cfg == wrong and not masked) or (cfg == wrong_masked and masked):
            return lambda: [y * 1.01 for y in fn()]
        timed = lambda: fn()  # noqa: E731
        timed.cfg = cfg
        return timed

    monkeypatch.setattr(autotune, "_call", corrupting_call)
    bench = lambda fn: getattr(fn, "cfg", None) and times[fn.cfg] or 10.0  # noqa: E731 - the copy: 10
    entry = autotune.tune_shape("forward", 16, 1, F32, "cpu", cands=[heuristic, wrong, wrong_masked, broken],
                                bench=bench, **TINY)
    assert entry["rejected"] == 3 and entry["heuristic_us"] == 50.0
    assert configs.config_from_entry("forward", entry["config"], 16, 1, F32) == heuristic
    with open(configs.cache_path("cpu")) as f:
        written = [e["config"] for e in json.load(f)["forward"]]
    assert written == [configs.config_to_entry(heuristic)]

    # every candidate wrong: nothing is written
    os.remove(configs.cache_path("cpu"))
    assert autotune.tune_shape("forward", 16, 1, F32, "cpu", cands=[wrong], bench=bench, **TINY) is None
    assert not os.path.exists(configs.cache_path("cpu"))


@pytest.mark.interpret
def test_finalists_are_ranked_at_both_sizes(cache, monkeypatch):
    """The fastest at the tuned batch collapses at 4x the batch (as 16 programs per SM did on the
    H100): the one best at both sizes is written, with its time there; past the finalists nothing
    is timed again, and a finalist that fails at the larger size counts as infinitely slow."""
    heuristic = configs.heuristic_forward(16, 1, F32)
    fast_small = dataclasses.replace(heuristic, block_b=16)
    steady = dataclasses.replace(heuristic, block_b=8)
    fails_large = dataclasses.replace(heuristic, block_b=32)
    slow = dataclasses.replace(heuristic, block_b=2)
    B = TINY["batch"]
    times = {(heuristic, B): 50.0, (fast_small, B): 1.0, (steady, B): 1.1, (fails_large, B): 0.9,
             (slow, B): 60.0, (heuristic, 4 * B): 200.0, (fast_small, 4 * B): 9.0, (steady, 4 * B): 4.0}
    call = autotune._call
    timed_at, affine_at_4x = [], []

    def tagged_call(kind, t, cfg, stats, train=False):
        batch = t["x"].shape[0]
        if cfg == fails_large and batch == 4 * B:
            raise RuntimeError("out of resources")
        fn = call(kind, t, cfg, stats, train)
        tagged = lambda: fn()  # noqa: E731
        tagged.key = (cfg, batch, train)
        affine_at_4x.append((batch == 4 * B, t["lw"] is not None, t["lb"] is not None))
        return tagged

    def bench(fn):  # a training step's forward (train=True) takes as long as the inference call
        key = getattr(fn, "key", None)
        if key is None:
            return 10.0  # the copy
        timed_at.append(key)
        return times[key[:2]]

    monkeypatch.setattr(autotune, "_call", tagged_call)
    cands = [heuristic, fast_small, steady, fails_large, slow]
    entry = autotune.tune_shape("forward", 16, 1, F32, "cpu", cands=cands, bench=bench,
                                **dict(TINY, confirm_scale=4), finalists=4)
    assert configs.config_from_entry("forward", entry["config"], 16, 1, F32) == steady
    # us: the inference call; train_us the training forward's share; confirm_us: both calls at 4x
    # with the per-feature LayerNorm affine and without one, summed
    assert entry["us"] == 1.1 and entry["train_us"] == 1.1 and entry["confirm_us"] == 16.0
    assert entry["confirm_scale"] == 4
    # the 4 fastest at the tuned batch, and only they, timed at 4x (slow is not a finalist), both
    # calls in both affine modes (fails_large raises before its calls are timed)
    at_4x = [k for k in timed_at if k[1] == 4 * B]
    assert len(at_4x) == 12 and {c for c, _, _ in at_4x} == {fast_small, steady, heuristic}, timed_at
    assert {train for _, _, train in at_4x} == {False, True}
    modes = [(lw, lb) for large, lw, lb in affine_at_4x if large]
    assert modes.count((True, True)) == modes.count((False, False)) > 0 and len(set(modes)) == 2
    assert {(lw, lb) for large, lw, lb in affine_at_4x if not large} == {(True, True)}  # the tuned batch: one mode
    # off: the tuned batch alone decides (fails_large, fastest there, is written)
    os.remove(configs.cache_path("cpu"))
    entry = autotune.tune_shape("forward", 16, 1, F32, "cpu", cands=cands[:4], bench=bench, **TINY)
    assert configs.config_from_entry("forward", entry["config"], 16, 1, F32) == fails_large
    assert "confirm_us" not in entry


@pytest.mark.interpret
def test_a_forward_is_ranked_by_its_inference_and_training_calls(cache, monkeypatch):
    """One forward config serves inference and a training step's forward (stats and relu mask
    saved): a candidate fastest at inference that a training step's forward makes slow loses to one
    fast at both (the chunk loop's forwards on the H100 and H200: faster alone, slower in training)."""
    heuristic = configs.heuristic_forward(16, 1, F32)
    fast_alone = dataclasses.replace(heuristic, block_b=16)
    even = dataclasses.replace(heuristic, block_b=8)
    times = {(heuristic, False): 50.0, (heuristic, True): 50.0, (fast_alone, False): 1.0, (fast_alone, True): 5.0,
             (even, False): 1.5, (even, True): 1.5}
    call = autotune._call

    def tagged_call(kind, t, cfg, stats, train=False):
        fn = call(kind, t, cfg, stats, train)
        tagged = lambda: fn()  # noqa: E731
        tagged.key = (cfg, train)
        return tagged

    monkeypatch.setattr(autotune, "_call", tagged_call)
    bench = lambda fn: times[fn.key] if hasattr(fn, "key") else 10.0  # noqa: E731 - the copy: 10
    entry = autotune.tune_shape("forward", 16, 1, F32, "cpu", cands=[heuristic, fast_alone, even], bench=bench,
                                **TINY)
    assert configs.config_from_entry("forward", entry["config"], 16, 1, F32) == even
    assert (entry["us"], entry["train_us"], entry["heuristic_us"]) == (1.5, 1.5, 50.0)


@pytest.mark.interpret
def test_the_op_with_cached_configs_matches_float64(cache):
    """The op, looking its configs up from a cache this process wrote, against the float64 reference;
    the launches show that the cached configs ran (not the heuristic)."""
    case = Case(2, 64, 16, 1, feature_dim=1, strided_view=True)
    won = {}
    for kind in ("forward", "backward"):
        cands = autotune.candidates(kind, 16, 1, F32, "cpu", limit=2)
        entry = autotune.tune_shape(kind, 16, 1, F32, "cpu", cands=cands, bench=_falling_times(), **TINY)
        won[kind] = configs.config_from_entry(kind, entry["config"], 16, 1, F32)
    assert won["forward"] != configs.heuristic_forward(16, 1, F32)
    assert won["backward"] != configs.heuristic_backward(16, 1, F32)
    launch._FORWARD_PLANS.clear()
    launch._BACKWARD_PLANS.clear()
    with launch.trace_launches() as launches:
        check_against_float64(case, F32)
    fwd = [meta for kind, _, meta, _ in launches if kind == "forward"]
    bwd = [cfg for kind, _, _, cfg in launches if kind == "backward"]
    assert fwd and all(meta["BLOCK_B"] == won["forward"].block_b for meta in fwd)
    assert bwd == [won["backward"]]


# ---------------------------------------------------------------------------------------------
# when the automatic trigger tunes (no kernels run: the tuning function is a recorder)


@pytest.fixture
def fake_gpu(cache, monkeypatch):
    """Device 0 is a CUDA GPU without a table of its own; tuning records what it is asked."""
    monkeypatch.setattr(configs, "device_slug", lambda device: "cpu" if device == "cpu" else "some-gpu")
    props = types.SimpleNamespace(major=7, minor=5, multi_processor_count=40)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(autotune, "_on_cuda", lambda device: device != "cpu")
    monkeypatch.setattr(autotune, "_capturing", lambda device: False)
    monkeypatch.setattr(autotune, "_compiling", lambda: False)
    calls = []

    def record(kind, D, H, dtype, device):
        calls.append((kind, D, H, dtype, device))
        return {"config": {}}

    monkeypatch.setattr(autotune, "tune_shape", record)
    return calls


def test_unset_means_no_tuning_and_no_file(fake_gpu, cache, monkeypatch):
    configs.forward_config(64, 1, F32, 0)
    configs.backward_config(64, 1, F32, 0)
    assert fake_gpu == [] and _files(cache) == []
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")  # the control: on, the same lookups tune
    configs.forward_config(64, 1, F32, 0)
    configs.backward_config(64, 1, F32, 0)
    assert fake_gpu == [("forward", 64, 1, F32, 0), ("backward", 64, 1, F32, 0)]


@pytest.mark.parametrize("block", ["override", "capture", "compiling", "cpu", "forced table", "tuning"])
def test_no_tuning_where_it_is_blocked(fake_gpu, monkeypatch, block):
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    device = "cpu" if block == "cpu" else 0
    with monkeypatch.context() as m:
        if block == "capture":
            m.setattr(autotune, "_capturing", lambda device: True)
        elif block == "compiling":
            m.setattr(autotune, "_compiling", lambda: True)
        elif block == "forced table":
            m.setenv(configs.TABLE_ENV, "none")
        elif block == "tuning":
            m.setattr(autotune._LOCAL, "busy", True, raising=False)
        if block == "override":  # a forward lookup inside a block that forces only the backward
            with configs.override(backward=configs.heuristic_backward(64, 1, F32)):
                configs.forward_config(64, 1, F32, device)
        else:
            configs.forward_config(64, 1, F32, device)
    assert fake_gpu == []
    # a blocked lookup is not remembered: the next one, unblocked, tunes (on a GPU)
    configs.forward_config(64, 1, F32, device)
    assert fake_gpu == ([] if block == "cpu" else [("forward", 64, 1, F32, 0)])


@pytest.mark.parametrize("outcome", ["raises", "no candidate passed"])
def test_a_shape_that_failed_is_not_tried_again(fake_gpu, monkeypatch, outcome):
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    calls = []

    def failing(kind, D, H, dtype, device):
        calls.append(D)
        if outcome == "raises":
            raise RuntimeError("out of memory")
        return None

    monkeypatch.setattr(autotune, "tune_shape", failing)
    for _ in range(3):
        assert configs.backward_config(64, 4, F32, 0) == configs.heuristic_backward(64, 4, F32)
    assert calls == [64]
    assert autotune._TRIED[(configs.cache_path(0), "backward", 64, 4, "float32", True)].startswith("failed")
    configs.backward_config(32, 4, F32, 0)  # another shape is tried
    assert calls == [64, 32]


def test_a_cached_or_shipped_shape_is_not_tuned(fake_gpu, cache, monkeypatch):
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    entry = dict(D=64, H=1, dtype="float32", full_tiles=True, us=1.0,
                 config=configs.config_to_entry(configs.heuristic_forward(64, 1, F32, num_warps=8)))
    autotune.write_entry(configs.cache_path(0), "forward", entry, {"gpu": "some gpu"})
    assert configs.forward_config(64, 1, F32, 0).num_warps == 8
    # an entry this version cannot read (a knob missing) is tuned again
    autotune.write_entry(configs.cache_path(0), "forward", dict(entry, H=2, config={"block_b": 4}), {})
    configs.forward_config(64, 2, F32, 0)
    assert fake_gpu == [("forward", 64, 2, F32, 0)]
    fake_gpu.clear()
    monkeypatch.setattr(configs, "device_slug", lambda device: "h100-80gb-hbm3")  # a shipped table's shape
    configs.backward_config(64, 16, torch.bfloat16, 0)
    assert fake_gpu == []
    configs.backward_config(64, 16, torch.float16, 0)  # not in the table: tuned
    assert fake_gpu == [("backward", 64, 16, torch.float16, 0)]


def test_concurrent_first_lookups_tune_once(fake_gpu, monkeypatch):
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    calls = []

    def slow(kind, D, H, dtype, device):
        calls.append(threading.get_ident())
        time.sleep(0.2)
        return {"config": {}}

    monkeypatch.setattr(autotune, "tune_shape", slow)
    threads = [threading.Thread(target=configs.forward_config, args=(64, 1, F32, 0)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------
# on a GPU: the automatic trigger end to end


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tuning_on_first_use_on_cuda_writes_the_cache_and_matches_float64(cache, monkeypatch, dtype):
    """RECFUSE_AUTOTUNE=1 on a shape no shipped table holds (D=96 H=2): the op's first call tunes
    both kinds on the real GPU, writes the cache, and its forward and gradients (computed with
    the tuned configs) match the float64 reference; a second lookup reads the cache."""
    D, H = 96, 2
    dtype_name = str(dtype).replace("torch.", "")
    assert not any(k[1:4] == (D, H, dtype_name) for k in configs.load_table(configs.device_slug(0)))
    monkeypatch.setenv(autotune.AUTOTUNE_ENV, "1")
    configs._cached_forward_config.cache_clear()
    configs._cached_backward_config.cache_clear()
    launch._FORWARD_PLANS.clear()
    launch._BACKWARD_PLANS.clear()
    try:
        check_against_float64(Case(5, 1000, D, H, feature_dim=1, strided_view=True, ln="per_feature"), dtype,
                              device="cuda")
        written = [json.loads(p.read_text()) for p in cache.rglob("*.json")]
        assert len(written) == 1
        for kind in ("forward", "backward"):
            entries = [e for e in written[0][kind] if (e["D"], e["H"], e["dtype"]) == (D, H, dtype_name)]
            assert entries and all(e["us"] > 0 for e in entries)
            for entry in entries:
                full = entry.get("full_tiles", True)
                cfg = configs.config_from_entry(kind, entry["config"], D, H, dtype, full)
                looked_up = (configs.forward_config(D, H, dtype, 0, full) if kind == "forward"
                             else configs.backward_config(D, H, dtype, 0))
                assert looked_up == cfg
    finally:
        configs._cached_forward_config.cache_clear()
        configs._cached_backward_config.cache_clear()
        launch._FORWARD_PLANS.clear()
        launch._BACKWARD_PLANS.clear()
