"""The kernel tuner: measure launch configs per (D, H, dtype) on this GPU and write its table.

For every shape of the sweep (the grid benchmark's D x H x dtype; torchrec layout, a [B, F*D]
buffer viewed as [B, F, D], shared [H, D] weight with an [H] bias, per-feature LayerNorm affine,
x about ``--x-mb`` MB) the tuner times candidate configs of the forward kernel (no grad) and of
the backward (fused kernel + reduction, reading the forward's saved row stats as a training step
does) with ``triton.testing.do_bench``, and keeps the fastest candidate whose outputs match the
torch composite in float64 (relative error in norm 1e-4 for float32, 2e-2 for bf16; a config that
compiles into wrong numbers is rejected, not kept). The winners go to
``recfuse/ops/tuned/<gpu>.json``, which `recfuse.ops.configs` reads; the heuristic's own time is
measured beside them so the table says what it gained.

Compiling dominates (a few seconds per candidate); candidates are compiled first by
``--workers`` processes in parallel (Triton's on-disk cache then serves the timing process),
then timed one by one in this process. The fastest few (``--finalists``) are then timed again at
``--confirm-scale`` times the batch, with and without the LayerNorm affine (``--confirm-affine``),
and the winner is the one best at both sizes: a config that won at x 256 MB can collapse at 1 GB
(benchmarks/NOTES.md, eleventh session), and one affine mode's winner can lose the other's calls.
Progress on stderr, a summary table at the end.

Example:
    $ python benchmarks/tune_kernels.py --save                 # whole sweep, writes the table
    $ python benchmarks/tune_kernels.py --dims 256 --hs 1 16 --dtypes bf16 --kinds backward
    $ python benchmarks/tune_kernels.py --device cpu --dims 32 --hs 1 --dtypes fp32   # smoke run (interpreter)
    $ python benchmarks/tune_kernels.py --kinds backward --only spread --dims 24 100 --hs 8 --merge --save DIR
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import subprocess
import sys
import time

from typing import Optional

import torch
import triton

from _common import GRID_DIMS, GRID_HS, copy_bandwidth, do_bench_us, environment, perf_counter_us
from recfuse.ops import autotune, configs, launch, tuning
from recfuse.ops.tuning import NARROW_TILE, backward_candidates, forward_candidates  # noqa: F401
from recfuse.ops.composite import composite_backward
from recfuse.chain import chain_of
from recfuse.reference import batched_feature_mlp, batched_ln_tanh_linear_relu

log = logging.getLogger("recfuse.tune")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error in norm (||out - ref|| / ||ref||): a relu mask that flips where z is within
# rounding of 0 moves single elements by O(1) (so a max-error test rejects correct kernels) but
# not the norm; a miscompiled tile does.
# The reference is float64 (the project's contract: fp32 gradients within 1e-4 of float64).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def shapes(args) -> list[dict]:
    out = []
    for dt, D, H in itertools.product(args.dtypes, args.dims, args.hs):
        dtype = DTYPES[dt]
        B = max(64, int(args.x_mb * 2 ** 20 / (args.features * D * dtype.itemsize)) // 64 * 64)
        out.append(dict(F=args.features, B=B, D=D, H=H, dtype=dt))
    return out


# Candidates besides the heuristic's in an ``--only spread`` run, per shape and kind.
SPREAD_LIMIT = 32


def shape_candidates(kind: str, p: dict, only: str, saved: dict) -> list:
    """The candidates `tune_shape` times for one shape: all of them, or (``only``) the heuristic's
    config and the candidates that set that knob (a run that tries one new kernel path against what
    runs now); either way with the incumbents: the saved table's entry for the shape, and on a GPU
    the config this GPU runs now (another table's beneath a partial own table,
    `configs.device_entries`). Without them a full run could file an entry slower than the config
    it replaces, and could not say how its winner compares with what runs now (the twenty-second
    session compared with the grid by hand: at fp32 D=32 H=16 the full list's best, 165 us, was no
    faster than the H100 entry the H200 ran, 164 at the same point; benchmarks/NOTES.md)."""
    D, H, dtype = p["D"], p["H"], DTYPES[p["dtype"]]
    full = D == triton.next_power_of_2(D)
    cands = forward_candidates(D, H, dtype) if kind == "forward" else backward_candidates(D, H, dtype)
    if not cands:
        return cands
    dtype_name = str(dtype).replace("torch.", "")
    incumbent = [configs.config_from_entry(kind, e["config"], D, H, dtype, full)
                 for e in saved.get(kind, [])
                 if (e["D"], e["H"], e["dtype"], e["full_tiles"]) == (D, H, dtype_name, full)]
    if torch.cuda.is_available():
        incumbent.append(configs.table_forward_config(D, H, dtype, 0, full) if kind == "forward"
                         else configs.table_backward_config(D, H, dtype, 0))
    incumbent = [c for c in incumbent if c is not None]
    if only == "all":
        return list(dict.fromkeys(cands + incumbent))
    if only == "row_slots" and kind == "backward":
        # the incumbents' own tiles and longer ones with folded column sums (`row_slots_neighbours`)
        knob = [n for c in incumbent for n in tuning.row_slots_neighbours(c, D, H, dtype)]
    elif only == "maxnreg":
        # the incumbents with their registers capped so that more programs fit an SM
        knob = [n for c in incumbent for n in tuning.maxnreg_neighbours(c, D, H, dtype)]
    elif only == "spread":
        # a short list over every kernel path (`tuning.spread`, as tuning on first use takes): for
        # shapes no table holds, where the full backward lists are 276-496 candidates a shape
        knob = tuning.spread(cands, SPREAD_LIMIT)
    else:
        knob = [c for c in cands if getattr(c, only, 0)]
    return list(dict.fromkeys([cands[0]] + incumbent + knob))


def make_inputs(p: dict, device: str, seed: int = 0):
    """The tuned shape's synthetic inputs (torchrec layout; `recfuse.ops.autotune.synthetic_inputs`,
    which tuning on first use measures on too)."""
    return autotune.synthetic_inputs(p["F"], p["B"], p["D"], p["H"], DTYPES[p["dtype"]], device, seed)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


# |z| below this (z ~ N(0, 1) here) is a relu tie: float32 rounding of z decides the mask there.
RELU_TIE = 1e-4


def references(t: dict) -> dict:
    """float64 composite forward and gradients (inputs upcast), the tuner's check.

    grad_y is zeroed in place where the float64 z is within `RELU_TIE` of 0 (~1e-4 of the
    elements): there the relu mask is decided by rounding, and one flipped element moves a
    gradient's norm by ~1/sqrt(B) (5e-4 at fp32 D=256 H=16, 3xTF32, on the H100), which rejected
    every correct config of that shape. A miscompiled tile still fails the check.
    """
    f32 = {k: v.double() for k, v in t.items()}
    z = batched_feature_mlp(f32["x"], f32["w"], f32["b"], f32["lw"], f32["lb"], 1e-5, 1,
                            chain_of("layer_norm", "tanh", None))
    t["gy"].masked_fill_(z.abs() < RELU_TIE, 0)
    f32["gy"] = t["gy"].double()
    y = batched_ln_tanh_linear_relu(f32["x"], f32["w"], f32["b"], f32["lw"], f32["lb"], 1e-5, 1)
    grads = composite_backward(f32["gy"], f32["x"], f32["w"], f32["b"], f32["lw"], f32["lb"], 1e-5, 1)
    return {"y": y, "grads": grads}


def forward_call(t: dict, cfg, stats: bool = False):
    with configs.override(forward=cfg):
        plan = launch.forward_plan(t["x"], t["w"], t["b"], t["lw"], t["lb"], 1e-5, 1, save_stats=stats)
    return lambda: plan(t["x"], t["w"], t["b"], t["lw"], t["lb"])


def backward_call(t: dict, cfg, stats):
    stats = autotune.candidate_stats(t, cfg, stats)  # a two-pass candidate's own, with the relu mask
    with configs.override(backward=cfg):
        plan = launch.backward_plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], 1e-5, 1, stats)
    load = stats if plan.reads_stats else None
    return lambda: plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], load)


def check(kind: str, out, ref: dict, dtype) -> float:
    if kind == "forward":
        return _rel_err(out[0], ref["y"])
    return max(_rel_err(g, r) for g, r in zip(out, ref["grads"]) if g.numel())


def compile_worker(plan_path: str, shard: int, n_shards: int) -> int:
    """Run every candidate of this shard once (compiling it into Triton's cache); errors are the
    timing process's to report."""
    with open(plan_path) as f:
        work = json.load(f)
    for i, item in enumerate(work):
        if i % n_shards != shard:
            continue
        p, kind = item["shape"], item["kind"]
        t = make_inputs(p, "cuda")
        stats = forward_call(t, configs.heuristic_forward(p["D"], p["H"], DTYPES[p["dtype"]]), True)()[1]
        for entry in item["candidates"]:
            try:
                cfg = _config(kind, p, entry)
                if kind == "forward":  # both variants the timing process runs (`tuning.rank_us`)
                    forward_call(t, cfg)()
                    forward_call(t, cfg, True)()
                else:
                    backward_call(t, cfg, stats)()
            except Exception:  # noqa: BLE001
                pass
        del t
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return 0


def _config(kind: str, p: dict, entry: dict):
    return configs.config_from_entry(kind, entry, p["D"], p["H"], DTYPES[p["dtype"]], p["D"] == triton.next_power_of_2(p["D"]))


def precompile(work: list, n_workers: int, out_dir: str) -> float:
    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tune_plan.json")
    with open(path, "w") as f:
        json.dump(work, f)
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-worker", path, str(i), str(n_workers)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(n_workers)]
    for pr in procs:
        pr.wait()
    return time.perf_counter() - t0


def masked_rows_ok(p: dict, kind: str, entry: dict) -> bool:
    """Whether the config of `entry` is right against float64 at F=3, B=1000 (padded row tiles)."""
    D, H, dtype = p["D"], p["H"], DTYPES[p["dtype"]]
    q = dict(p, F=3, B=1000 if torch.cuda.is_available() else 40)
    t = make_inputs(q, "cuda" if torch.cuda.is_available() else "cpu", seed=1)
    ref = references(t)
    cfg = _config(kind, p, entry)
    try:
        if kind == "forward":
            out = forward_call(t, cfg)()
        else:
            stats = forward_call(t, configs.heuristic_forward(D, H, dtype, False), True)()[1]
            out = backward_call(t, cfg, stats)()
        return check(kind, out, ref, dtype) <= TOLERANCE[dtype]
    except Exception:  # noqa: BLE001 - a config that fails there is not the winner
        return False


def confirms(confirm_scale: int, confirm_affine) -> bool:
    """Whether the finalists are timed again (`_ScaledInputs`): at a larger batch, or at the tuned
    one with each LayerNorm affine mode. Until session 31 ``--confirm-scale 1`` skipped both, and
    a GEMM backward that won bf16 D=48 H=64 with per-feature affine went into the H200 table while
    the same shape without affine ran 1.17-1.21x slower (benchmarks/NOTES.md).

    Example:
        >>> confirms(1, ("per_feature", "none")), confirms(1, ("per_feature",)), confirms(4, ("per_feature",))
        (True, False, True)
    """
    return confirm_scale > 1 or len(tuple(confirm_affine)) > 1


class _ScaledInputs:
    """The tuned shape with `scale` times its batch (inputs and the forward's stats made on first
    use), and the time of a config there: with ``affine_modes`` ("per_feature", "none") the sum of
    its times with the per-feature LayerNorm affine and without one, so that the finalists are
    ranked on both calls a table entry serves. One mode's winner can lose the other by 5-10% (H200:
    fp32 D=160 H=16's prefetched loop won per-feature and lost without affine, bf16 D=160 H=64's
    register cap the reverse; benchmarks/NOTES.md, nineteenth and twentieth sessions)."""

    def __init__(self, p: dict, scale: int, bench, affine_modes=autotune.CONFIRM_AFFINE):
        self.p, self.scale, self.bench, self.affine_modes = p, scale, bench, tuple(affine_modes)
        self.inputs = None  # per affine mode: (inputs, the heuristic forward's stats)

    def _make(self) -> dict:
        p = dict(self.p, B=self.p["B"] * self.scale)
        t = make_inputs(p, "cuda" if torch.cuda.is_available() else "cpu", seed=2)
        heuristic = configs.heuristic_forward(p["D"], p["H"], DTYPES[p["dtype"]], p["D"] == triton.next_power_of_2(p["D"]))
        return {mode: (tm, forward_call(tm, heuristic, True)()[1])
                for mode, tm in zip(self.affine_modes, autotune.per_affine_mode(t, self.affine_modes))}

    def time(self, kind: str, entry: dict) -> float:
        if self.inputs is None:
            self.inputs = self._make()
        cfg = _config(kind, self.p, entry)
        total = 0.0
        for t, stats in self.inputs.values():
            if kind == "forward":  # both calls a forward config serves, as `tuning.rank_us` ranks them
                infer, train = forward_call(t, cfg), forward_call(t, cfg, True)
                infer(), train()
                total += self.bench(infer) + self.bench(train)
            else:
                fn = backward_call(t, cfg, stats)
                fn()
                total += self.bench(fn)
        return total


def best_per_path(rows: list[dict]) -> dict:
    """Each kernel path's fastest timed candidate (`tuning.rank_us`, rounded: a forward's inference
    and training calls together), or why it has none: "slower" (every one was over 1.5x the best at
    one call, so never fully timed) or "rejected". A path that lost keeps its gap on record (not
    read by recfuse).

    Example:
        >>> rows = [{"path": ("forward", True, True, False, False, False), "us": 10.04},
        ...         {"path": ("forward", True, True, False, False, False), "us": 9.0},
        ...         {"path": ("forward", True, True, False, False, True), "slower": True},
        ...         {"path": ("forward", False, False, False, False, False), "rejected": "OutOfResources"}]
        >>> best_per_path(rows)
        {'dot+chunked': 9.0, 'dot+chunked+k_loop': 'slower', 'plain': 'rejected'}
    """
    out: dict = {}
    for r in rows:
        name = tuning.path_label(r["path"])
        if "us" in r:
            prev = out.get(name)
            out[name] = round(min(tuning.rank_us(r), prev if isinstance(prev, float) else float("inf")), 1)
        elif name not in out or out[name] == "rejected":
            out[name] = "slower" if r.get("slower") else "rejected"
    return out


def tune_shape(p: dict, kinds, bench, quick, copy_gbps: float, progress, only: str = "all",
               saved: Optional[dict] = None, confirm_scale: int = 4, finalists: int = 4,
               confirm_affine=autotune.CONFIRM_AFFINE) -> list[dict]:
    D, H, dtype = p["D"], p["H"], DTYPES[p["dtype"]]
    t = make_inputs(p, "cuda" if torch.cuda.is_available() else "cpu")
    ref = references(t)
    full = D == triton.next_power_of_2(D)
    base_fwd = configs.heuristic_forward(D, H, dtype, full)
    stats = forward_call(t, base_fwd, True)()[1]
    x_bytes, y_bytes = t["x"].numel() * t["x"].element_size(), t["gy"].numel() * t["gy"].element_size()
    floors = {"forward": (x_bytes + y_bytes) / copy_gbps / 1e3, "backward": (2 * x_bytes + y_bytes) / copy_gbps / 1e3}
    results = []
    scaled = _ScaledInputs(p, confirm_scale, bench, confirm_affine)
    for kind in kinds:
        cands = shape_candidates(kind, p, only, saved or {})
        if t["x"].device.type == "cpu":
            cands = cands[:3]
        rows = []
        best_us = float("inf")
        for cfg in cands:
            row = {"config": configs.config_to_entry(cfg), "path": tuning.kernel_path(cfg)}
            try:
                fn = forward_call(t, cfg) if kind == "forward" else backward_call(t, cfg, stats)
                # a forward config serves a training step's forward too (stats and relu mask saved)
                train_fn = forward_call(t, cfg, True) if kind == "forward" else None
                err = check(kind, fn(), ref, dtype)
                if train_fn is not None:
                    err = max(err, check(kind, train_fn(), ref, dtype))
                row["err"] = err
                if not err <= TOLERANCE[dtype]:
                    row["rejected"] = f"relative error {err:.1e}"
                elif rows and quick(fn) > 1.5 * best_us:
                    row["slower"] = True  # one timed call: clearly behind the best, not worth a full timing
                else:
                    row["us"] = bench(fn)
                    if train_fn is not None:
                        row["train_us"] = bench(train_fn)
                    best_us = min(best_us, row["us"])
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row
                row["rejected"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            rows.append(row)
            progress()
        timed = sorted((r for r in rows if "us" in r), key=tuning.rank_us)
        if confirms(confirm_scale, confirm_affine):
            timed = tuning.confirm_at_scale(timed, lambda row: scaled.time(kind, row["config"]), finalists)
        # The winner must also be right with padded rows (B = 1000, not a multiple of its tiles):
        # the timed shape's B is, and masked tiles compile to other code (a 32-row bf16 broadcast-sum
        # tile was right at full tiles and gave dx 3.0 off float64 at B = 1000 on the H100).
        while timed and not masked_rows_ok(p, kind, timed[0]["config"]):
            timed[0]["rejected"] = "wrong with padded rows (B=1000)"
            timed.pop(0)
        reasons = sorted({r["rejected"] for r in rows if "rejected" in r})
        if reasons:
            log.info("tune: %s D=%d H=%d %s: %d of %d candidates rejected: %s", kind, D, H, p["dtype"],
                     sum(1 for r in rows if "rejected" in r), len(rows), "; ".join(reasons[:3]))
        paths = best_per_path(rows)
        log.info("tune: %s D=%d H=%d %s, fastest of each kernel path: %s", kind, D, H, p["dtype"],
                 "; ".join(f"{k}: {v}" for k, v in paths.items()))
        if not timed:
            continue
        best = timed[0]
        base = rows[0]
        results.append(dict(kind=kind, D=D, H=H, dtype=str(dtype).replace("torch.", ""), full_tiles=full,
                            config=best["config"], us=best["us"], pct_floor=100 * floors[kind] / best["us"],
                            **({"train_us": best["train_us"]} if "train_us" in best else {}),
                            **({"confirm_us": best["confirm_us"], "confirm_scale": confirm_scale,
                                "confirm_affine": list(confirm_affine)} if "confirm_us" in best else {}),
                            heuristic_us=base.get("us"),
                            # the runners-up at both sizes: why the winner won (not read by recfuse)
                            finalists=[dict(config=r["config"], us=round(r["us"], 1),
                                            confirm_us=round(r["confirm_us"], 1))
                                       for r in timed[1:finalists] if "confirm_us" in r],
                            candidates=len(rows),
                            rejected=sum(1 for r in rows if "rejected" in r),
                            paths=paths))
    del t, ref, scaled
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=list(GRID_DIMS))
    ap.add_argument("--hs", type=int, nargs="+", default=list(GRID_HS))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--kinds", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--x-mb", type=float, default=256.0)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--rep", type=float, default=25.0, help="do_bench rep, ms")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--save", nargs="?", const=configs.TUNED_DIR, help="write <dir>/<gpu>.json (default: the package's table dir)")
    ap.add_argument("--merge", action="store_true", help="keep the saved table's entries for shapes not in this run")
    ap.add_argument("--resume", action="store_true", help="with --merge: skip shapes the saved table has")
    ap.add_argument("--only", default="all", choices=["all", "unroll_h", "loop_stages", "col_sums", "persistent", "split_dw", "block_k", "row_parts",
                             "k_loop", "split_ln", "two_pass", "dw_first", "row_slots", "prefetch", "maxnreg", "gemm",
                             "spread"],
                    help="time only the heuristic, the saved entry (with --merge) and the candidates that set "
                         "this knob (row_slots / maxnreg: the incumbents' neighbours with it, "
                         "`tuning.row_slots_neighbours` / `tuning.maxnreg_neighbours`; spread: %d "
                         "candidates over every kernel path, `tuning.spread`)" % SPREAD_LIMIT)
    ap.add_argument("--confirm-scale", type=int, default=4,
                    help="re-time the fastest --finalists at this many times the batch and pick the one best "
                         "at both sizes (1: the tuned batch, still with each --confirm-affine mode)")
    ap.add_argument("--finalists", type=int, default=4)
    ap.add_argument("--confirm-affine", nargs="+", choices=["per_feature", "none"], default=list(autotune.CONFIRM_AFFINE),
                    help="the LayerNorm affine modes the finalists are re-timed with at --confirm-scale (their "
                         "times summed): a table entry serves calls with and without the affine (one mode and "
                         "--confirm-scale 1: no re-timing)")
    ap.add_argument("--compile-worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_worker:
        return compile_worker(args.compile_worker[0], int(args.compile_worker[1]), int(args.compile_worker[2]))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cpu":  # a smoke run of the tuner itself under the interpreter: tiny, few configs
        args.x_mb, args.features = min(args.x_mb, 0.01), 2
    cuda = args.device == "cuda" and torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        log.error("tune_kernels: no CUDA device (use --device cpu for a smoke run under TRITON_INTERPRET=1)")
        return 2
    pts = shapes(args)
    slug = configs.gpu_slug(torch.cuda.get_device_name()) if cuda else "cpu"
    table_path = os.path.join(args.save, slug + ".json") if args.save else None
    saved = {}
    if table_path and args.merge and os.path.exists(table_path):
        with open(table_path) as f:
            saved = json.load(f)
    if args.resume and saved:
        done = {(e["D"], e["H"], e["dtype"]) for kind in args.kinds for e in saved.get(kind, [])}
        pts = [p for p in pts if (p["D"], p["H"], str(DTYPES[p["dtype"]]).replace("torch.", "")) not in done]
        log.info("tune: resuming, %d shapes left", len(pts))
    if cuda:
        def bench(fn):
            return do_bench_us(fn, warmup_ms=5, rep_ms=args.rep)

        def quick(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3

        copy_gbps = copy_bandwidth(256 << 20, "cuda", bench)["GBps"]
        work = []
        for p in pts:
            D, H, dtype = p["D"], p["H"], DTYPES[p["dtype"]]
            if "forward" in args.kinds:
                work.append({"shape": p, "kind": "forward",
                             "candidates": [configs.config_to_entry(c)
                                            for c in shape_candidates("forward", p, args.only, saved)]})
            if "backward" in args.kinds:
                work.append({"shape": p, "kind": "backward",
                             # one per compiled variant: programs per SM is a runtime argument
                             "candidates": list({json.dumps(dict(e, programs_per_sm=0), sort_keys=True): e for e in (
                                 configs.config_to_entry(c)
                                 for c in shape_candidates("backward", p, args.only, saved))}.values())})
        n_compile = sum(len(w["candidates"]) for w in work)
        log.info("tune: %d shapes, %d kernel variants to compile with %d workers", len(pts), n_compile, args.workers)
        out_dir = os.environ.get("OUT", "/tmp")
        log.info("tune: compiled in %.0f s", precompile(work, args.workers, out_dir))
    else:
        def bench(fn):
            return perf_counter_us(fn, warmup_ms=0, rep_ms=0, min_calls=3)

        quick = bench
        copy_gbps = 10.0
    def n_candidates(p, kind):
        n = len(shape_candidates(kind, p, args.only, saved))
        return n if cuda else min(n, 3)

    total = sum(n_candidates(p, kind) for p in pts for kind in args.kinds)
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, file=sys.stderr, desc="tune", unit="cfg")
        progress = lambda: bar.update(1)  # noqa: E731
    except ImportError:
        bar, progress = None, (lambda: None)
    t0 = time.perf_counter()
    entries = []
    for p in pts:
        entries += tune_shape(p, args.kinds, bench, quick, copy_gbps, progress, args.only, saved,
                              args.confirm_scale, args.finalists, args.confirm_affine)
        if table_path and cuda:  # after every shape: a run cut short keeps what it measured
            write_table(table_path, saved, entries, args)
    if bar is not None:
        bar.close()
    print(f"recfuse tuner on {environment(args.device if cuda else 'cpu')['device_name']}, torch {torch.__version__}, "
          f"triton {triton.__version__}; copy {copy_gbps:.0f} GB/s; {time.perf_counter() - t0:.0f} s timing")
    print(summary(entries))
    if table_path and cuda:
        log.info("tune: wrote %s", table_path)
    return 0


def summary(entries: list[dict]) -> str:
    lines = [f"{'kind':9s} {'dtype':9s} {'D':>4s} {'H':>3s} | {'best us':>9s} {'% floor':>7s} {'heur us':>9s} {'gain':>5s} "
             f"{'at n x B':>10s} | config"]
    for e in entries:
        if "us" not in e:  # a hand-written entry (its "source" says why): nothing timed to show
            continue
        gain = e["heuristic_us"] / e["us"] if e.get("heuristic_us") else float("nan")
        knobs = " ".join(f"{k}={v}" for k, v in e["config"].items())
        confirm = f"{e['confirm_us']:.0f} @{e['confirm_scale']}x" if "confirm_us" in e else "-"
        lines.append(f"{e['kind']:9s} {e['dtype']:9s} {e['D']:4d} {e['H']:3d} | {e['us']:9.1f} {e['pct_floor']:7.1f} "
                     f"{e.get('heuristic_us') or float('nan'):9.1f} {gain:5.2f} {confirm:>10s} | {knobs}")
    return "\n".join(lines)


def write_table(path: str, saved: dict, entries: list[dict], args) -> None:
    """The GPU's table: this run's entries, plus (with --merge) the saved ones for other shapes."""
    done = {(e["kind"], e["D"], e["H"], e["dtype"]) for e in entries}
    old = [dict(e, kind=kind) for kind in ("forward", "backward") for e in saved.get(kind, [])
           if (kind, e["D"], e["H"], e["dtype"]) not in done]
    # A saved entry's note (why a config was kept by hand) stays while this run keeps its config.
    notes = {(kind, e["D"], e["H"], e["dtype"]): e for kind in ("forward", "backward")
             for e in saved.get(kind, []) if "note" in e}
    for e in entries:
        kept = notes.get((e["kind"], e["D"], e["H"], e["dtype"]))
        if kept is None:
            continue
        cfg = configs.config_from_entry(e["kind"], kept["config"], e["D"], e["H"], getattr(torch, e["dtype"]),
                                        e["full_tiles"])
        if cfg is not None and configs.config_to_entry(cfg) == e["config"]:  # older entries lack new knobs
            e.setdefault("note", kept["note"])
    env = environment("cuda")
    props = torch.cuda.get_device_properties(0)
    # sm_count and compute_capability: a GPU without a table of its own takes a table of the same
    # architecture (`recfuse.ops.configs.table_slug`).
    table = {"gpu": env["device_name"], "sm_count": props.multi_processor_count,
             "compute_capability": [props.major, props.minor],
             "torch": env["torch"], "triton": env["triton"], "date": env["date"],
             "setup": f"BFD layout, F={args.features}, x ~{args.x_mb:g} MB, shared weight + bias, per-feature LN affine"}
    for kind in ("forward", "backward"):
        rows = sorted((e for e in old + entries if e["kind"] == kind), key=lambda e: (e["dtype"], e["D"], e["H"]))
        table[kind] = [{k: v for k, v in e.items() if k != "kind"} for e in rows]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    with open(path[:-len(".json")] + ".txt", "w") as f:
        f.write(summary([dict(e, kind=k) for k in ("forward", "backward") for e in table[k]]) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
