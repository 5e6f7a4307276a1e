"""Grid benchmark of `recfuse.ln_tanh_linear_relu` against its memory floor, over the DESIGN.md grid.

The targets in /work/shared/DESIGN.md hold over a grid of shapes, not one shape; this tool sweeps it:

* layout: ``BFD`` = a [B, F*D] buffer viewed as [B, F, D] (feature_dim=1, torchrec's KeyedTensor),
  ``FBD`` = a contiguous [F, B, D] tensor (feature_dim=0);
* D (embedding width), H (Linear out features, shared [H, D] weight with an [H] bias), dtype;
* LayerNorm affine: ``per_feature`` ([F, D] ln_weight and ln_bias) or ``none``;
* F is fixed (``--features``, 64) and B is chosen so that x is about ``--x-mb`` MB (a multiple of 64);
* the chain (``--chains``, `recfuse.feature_mlp`'s norm,activation,out_activation; default the one
  chain of `recfuse.ln_tanh_linear_relu`). A chain without a norm has no affine points. A run with
  other chains saves ``grid_chains_<gpu>.*`` beside the default chain's ``grid_<gpu>.*``.

Per point, on CUDA: the op's forward (no grad) as a ``triton.testing.do_bench`` median, and its
training step (forward + ``y.backward(gy)`` with x, weight, bias and the LayerNorm parameters
requiring grad, every ``.grad`` set to None first) as GPU time, the sum of its kernels' durations
(torch.profiler over 5 steps; the do_bench figure, which also counts the GPU waiting for the host,
is kept as ``train_wall_us``); their floors, the bytes a perfect kernel must move over the
device-copy bandwidth measured in this run (``dst.copy_(src)`` on a buffer of x's size, 2 x size
bytes moved): forward = x + y, training step = x + y + x again + grad_y + dx; the % of floor
(floor / measured); CUDA kernels per call (torch.profiler); the extra peak memory of one training
step; the max error of the forward against the float64 composite on the first ``--check-rows``
rows of the batch (recorded, not asserted); and on every ``--peer-every``-th point the peer,
``torch.compile`` of the batched composite (`recfuse.reference.batched_ln_tanh_linear_relu`),
forward and training step. Compiling the peer takes seconds per point (a fresh static compile per
shape) and dominates the run time when it is on; ``--peer-every 0`` turns it off.

Run time on an H100 (from a 16-point run, cold Triton and Inductor caches): a point costs ~0.2 s
of measurement (do_bench rep 40 ms) plus 1-5 s compiling the op's kernels for a new (D, H,
dtype, affine, layout) specialisation, ~2 s on average; a peer point adds 4-6 s of
torch.compile (11 s for the first). Full default grid, 224 points: ~5-8 min with
``--peer-every 0``, ~13 min with the default peer on 75 points; a second run with a warm Triton
cache measures the op in ~1-2 min.

Failures (an OOM, a kernel that does not compile, a peer that does not compile) are recorded in
the point's ``errors`` and shown in the table; the run goes on. ``--max-seconds`` stops between
points once the budget is spent and marks the rest as skipped; Ctrl-C does the same.

Outputs: a tqdm progress bar on stderr, a summary table at the end, and with ``--save DIR`` the
files ``grid_<gpu>.json`` (env + every point), ``grid_<gpu>.txt`` (the table) and
``grid_<gpu>.png`` (heatmaps of % of floor: one row of panels per affine mode, one panel per
layout x dtype x {fwd, train}, D down and H across). ``--device cpu`` is a smoke run
(``time.perf_counter`` medians instead of do_bench, kernels = 0, tiny x).

Example:
    $ python benchmarks/grid.py --save benchmarks/results
    $ python benchmarks/grid.py --dims 64 256 --hs 1 16 --dtypes bf16 --peer-every 0 --x-mb 128
    $ python benchmarks/grid.py --device cpu --x-mb 0.5 --dims 32 48 --hs 1 4 --dtypes fp32 --save /tmp/gridtest
    $ python benchmarks/grid.py --chains rms_norm,silu,none none,none,relu --dims 64 256 --hs 1 16
    $ python benchmarks/grid.py --off-grid --peer-every 4 --save benchmarks/results  # shapes the tables lack
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

import recfuse
from recfuse.chain import DEFAULT, Chain, chain_of
from recfuse.ops import configs
from recfuse.reference import batched_feature_mlp

from _common import (GRID_DIMS, GRID_HS, OFF_GRID_DIMS, OFF_GRID_HS, command_line, copy_bandwidth, device_activity,
                     device_slug, environment, extra_peak_bytes, floor_us, forward_bytes, kernels_per_call, make_bench,
                     op_inputs, training_bytes)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LAYOUTS = ("BFD", "FBD")
AFFINES = ("per_feature", "none")
EPS = 1e-5


# ------------------------------------------------------------------------------------------ points
def parse_chain(text: str) -> Chain:
    """``"rms_norm,silu,none"`` -> Chain('rms_norm', 'silu', None) (validated)."""
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"a chain is norm,activation,out_activation, got {text!r}")
    try:
        return chain_of(*parts)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def chain_text(chain: Chain) -> str:
    return ",".join("none" if v is None else v for v in chain)


def grid_points(args) -> list[dict]:
    points = []
    for chain, layout, dt, affine, D, H in itertools.product(args.chains, args.layouts, args.dtypes, args.affine,
                                                             args.dims, args.hs):
        if chain.norm is None and affine != "none":
            continue  # a norm's affine needs a norm
        elem = DTYPES[dt].itemsize
        F = args.features
        B = max(64, round(args.x_mb * 2**20 / (F * D * elem) / 64) * 64)
        points.append({"chain": chain_text(chain), "layout": layout, "dtype": dt, "affine": affine, "D": D, "H": H,
                       "F": F, "B": B, "x_MB": F * B * D * elem / 2**20})
    for i, p in enumerate(points):
        p["index"] = i
        p["peer"] = bool(args.peer_every) and i % args.peer_every == 0
    return points


def make_inputs(p: dict, device: str):
    """x (the 3D view the op reads), its leaf buffer, feature_dim, params [w, b, lw, lb], grad_y."""
    inp = op_inputs(p["F"], p["B"], p["D"], p["H"], DTYPES[p["dtype"]], device, layout=p["layout"],
                    ln="per_feature" if p["affine"] == "per_feature" else "none", seed=1000 + p["index"])
    return inp.buf, inp.x, inp.feature_dim, [inp.weight, inp.bias, inp.ln_weight, inp.ln_bias], inp.grad_y


def measure_point(p: dict, args, bench, copy_GBps: float, deadline: float) -> None:
    """Fill `p` with the measurements of one grid point; errors go to p["errors"][section]."""
    dev = args.device
    buf, x, fdim, (w, b, lw, lb), gy = make_inputs(p, dev)
    params = [t for t in (w, b, lw, lb) if t is not None]
    for t in params:
        t.requires_grad_(True)
    view = (lambda t: t.view(p["B"], p["F"], p["D"])) if p["layout"] == "BFD" else (lambda t: t)
    xg = buf.detach().clone().requires_grad_(True)
    leaves = [xg] + params
    p["floor_fwd_us"] = floor_us(forward_bytes(x, gy), copy_GBps)
    p["floor_train_us"] = floor_us(training_bytes(x, gy), copy_GBps)
    errors = p.setdefault("errors", {})
    chain = parse_chain(p.get("chain", chain_text(DEFAULT)))

    def op(xx):
        return recfuse.feature_mlp(xx, w, b, norm=chain.norm, ln_weight=lw, ln_bias=lb, eps=EPS,
                                   activation=chain.activation, out_activation=chain.out_activation, feature_dim=fdim)

    def fwd():
        with torch.no_grad():
            return op(x)

    def train_step(fn):
        def step():
            for t in leaves:
                t.grad = None
            fn(view(xg)).backward(gy)
        return step

    def run(section, body):
        try:
            body()
        except Exception as e:  # noqa: BLE001 - one failing point or peer must not end the grid
            errors[section] = f"{type(e).__name__}: {e}"[:400]
            if dev == "cuda":
                try:  # after a sticky CUDA error these raise too; the next points record it
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                except Exception:  # noqa: BLE001
                    pass

    def forward():
        y = fwd()  # first call: compiles the kernels (not timed)
        n = min(args.check_rows, p["B"])
        rows = (slice(0, n),) if fdim == 1 else (slice(None), slice(0, n))
        d = lambda t: None if t is None else t.detach().double()  # noqa: E731
        ref = batched_feature_mlp(x[rows].double(), d(w), d(b), d(lw), d(lb), EPS, fdim, chain)
        err = (y[rows].double() - ref).abs()
        p["max_rel_err"] = (err.max() / ref.abs().max().clamp_min(1e-30)).item()
        p["rel_err_l2"] = (err.norm() / ref.norm().clamp_min(1e-30)).item()
        del y, ref, err
        p["fwd_us"] = bench(fwd)
        p["fwd_pct_floor"] = 100 * p["floor_fwd_us"] / p["fwd_us"]
        p["fwd_kernels"] = kernels_per_call(fwd) if dev == "cuda" else 0

    def training():
        step = train_step(op)
        step()
        for t in leaves:
            t.grad = None
        peak = extra_peak_bytes(step, dev)
        p["train_extra_peak_MB"] = None if peak is None else peak / 2**20
        # GPU time is the sum of the step's kernel durations: do_bench's events also count the
        # gaps where the GPU waits for the host (a training step is ~40 bare launches of host
        # work; at H=1 that exceeded the ~0.4 ms of kernels and made the figure swing 2x from
        # run to run, benchmarks/NOTES.md). The events' figure stays as train_wall_us.
        p["train_wall_us"] = bench(step)
        if dev == "cuda":
            p["train_kernels"], p["train_us"] = device_activity(step, dev, calls=5)
        else:
            p["train_kernels"], p["train_us"] = 0, p["train_wall_us"]
        p["train_pct_floor"] = 100 * p["floor_train_us"] / p["train_us"]

    def peer():
        torch._dynamo.reset()  # a fresh static compile per point: no recompile limit, no dynamic shapes
        t0 = time.perf_counter()

        def composite(xx, w_, b_, lw_, lb_):
            return batched_feature_mlp(xx, w_, b_, lw_, lb_, EPS, fdim, chain)
        cfwd = torch.compile(composite, dynamic=False)
        ctrain = torch.compile(composite, dynamic=False)

        def peer_fwd():
            with torch.no_grad():
                return cfwd(x, w, b, lw, lb)
        peer_fwd()
        p["peer_fwd_us"] = bench(peer_fwd)
        step = train_step(lambda xx: ctrain(xx, w, b, lw, lb))
        step()
        p["peer_compile_s"] = time.perf_counter() - t0
        p["peer_train_wall_us"] = bench(step)
        p["peer_train_us"] = device_activity(step, dev, calls=3)[1] if dev == "cuda" else p["peer_train_wall_us"]
        p["peer_fwd_pct_floor"] = 100 * p["floor_fwd_us"] / p["peer_fwd_us"]
        p["peer_train_pct_floor"] = 100 * p["floor_train_us"] / p["peer_train_us"]
        p["train_speedup_vs_peer"] = peer_speedup(p)

    run("forward", forward)
    run("train", training)
    if p["peer"]:
        if time.perf_counter() < deadline:
            run("peer", peer)
        else:
            p["peer_skipped"] = "time budget spent"
    for t in leaves:
        t.grad = None


# ------------------------------------------------------------------------------------------ output
def _f(v, fmt, width):
    return f"{v:{width}{fmt}}" if isinstance(v, (int, float)) and v is not None and not math.isnan(v) else f"{'-':>{width}}"


def table(points: list[dict], env: dict) -> str:
    lines = [
        f"recfuse grid on {env['device_name']} ({env['device']}), torch {env['torch']}, triton {env['triton']}, "
        f"{env['date']}; copy {env['copy_GBps']:.0f} GB/s on {env['copy_bytes'] / 2**20:.4g} MB; "
        f"F={env['args']['features']}, x ~{env['args']['x_mb']} MB"
        + (f"; configs from table {env['config_table']}" if env.get("config_table") else ""),
        "% = floor / measured (forward floor: x + y bytes; training step: 3 x + 2 y bytes; over copy BW). "
        "train us = the step's kernel time (GPU time); peer = torch.compile(batched composite); "
        "peer x = peer train / op train (both GPU time, or both do_bench events for peers of older runs).",
        f"{'chain':>22} {'layout':>6} {'dtype':>5} {'affine':>11} {'D':>4} {'H':>3} {'B':>7} | {'fwd us':>8} {'fwd %':>5} | "
        f"{'train us':>8} {'trn %':>5} | {'kern f/t':>8} {'peak MB':>8} {'max err':>8} | "
        f"{'peer fwd':>8} {'peer trn':>8} {'peer x':>6} | note",
    ]
    for p in points:
        kern = f"{p.get('fwd_kernels', '-')}/{p.get('train_kernels', '-')}"
        note = "; ".join(f"{k}: {v}" for k, v in p.get("errors", {}).items())
        note = note or p.get("skipped", "") or p.get("peer_skipped", "")
        lines.append(
            f"{p.get('chain', chain_text(DEFAULT)):>22} {p['layout']:>6} {p['dtype']:>5} {p['affine']:>11} {p['D']:>4} {p['H']:>3} {p['B']:>7} | "
            f"{_f(p.get('fwd_us'), '.1f', 8)} {_f(p.get('fwd_pct_floor'), '.0f', 5)} | "
            f"{_f(p.get('train_us'), '.1f', 8)} {_f(p.get('train_pct_floor'), '.0f', 5)} | "
            f"{kern:>8} {_f(p.get('train_extra_peak_MB'), '.0f', 8)} {_f(p.get('max_rel_err'), '.1e', 8)} | "
            f"{_f(p.get('peer_fwd_us'), '.1f', 8)} {_f(p.get('peer_train_us'), '.1f', 8)} "
            f"{_f(p.get('train_speedup_vs_peer'), '.2f', 6)} | {note[:120]}")
    lines += ["", *targets_summary(points)]
    return "\n".join(lines)


def x_and_y_bytes(p: dict) -> int:
    """Bytes of x (so of x.grad) and of the output y at a grid point.

    Example:
        >>> x_and_y_bytes(dict(F=2, B=4, D=8, H=1, dtype="fp32"))
        288
    """
    itemsize = DTYPES[p["dtype"]].itemsize
    return p["F"] * p["B"] * (p["D"] + p["H"]) * itemsize


def targets_summary(points: list[dict]) -> list[str]:
    """DESIGN.md targets: fwd >= 90% and train >= 80% of floor (x >= 64 MB; H <= 16 fp32, <= 64 16-bit)."""
    scope = [p for p in points if p["x_MB"] >= 64 and p["H"] <= (16 if p["dtype"] == "fp32" else 64)]
    out = []
    for key, goal in (("fwd_pct_floor", 90), ("train_pct_floor", 80)):
        got = [p for p in scope if key in p]
        ok = [p for p in got if p[key] >= goal]
        worst = min(got, key=lambda p: p[key], default=None)
        w = (f"; worst {worst[key]:.0f}% at {worst['layout']} {worst['dtype']} {worst['affine']} "
             f"D={worst['D']} H={worst['H']}") if worst else ""
        out.append(f"target {key} >= {goal}%: {len(ok)}/{len(got)} measured points in scope "
                   f"(x >= 64 MB, H <= 16 fp32 / 64 16-bit){w}")
    for dt in dict.fromkeys(p["dtype"] for p in scope):
        got = [p for p in scope if p["dtype"] == dt and "train_pct_floor" in p and "fwd_pct_floor" in p]
        if got:
            med = lambda key: statistics.median(p[key] for p in got)  # noqa: E731
            out.append(f"in scope, {dt}: forward median {med('fwd_pct_floor'):.0f}% (worst "
                       f"{min(p['fwd_pct_floor'] for p in got):.0f}%), training median {med('train_pct_floor'):.0f}% "
                       f"(worst {min(p['train_pct_floor'] for p in got):.0f}%) of the floor, {len(got)} points")
    # Extra peak memory of a step <= bytes(x) + O(F*B): what the step allocates beyond x.grad and
    # the output y (the caller's grad_y is allocated before it), per (feature, row).
    beyond = [(p, (p["train_extra_peak_MB"] * 2**20 - x_and_y_bytes(p)) / (p["F"] * p["B"]))
              for p in points if p.get("train_extra_peak_MB") is not None]
    if beyond:
        p, most = max(beyond, key=lambda pb: pb[1])
        out.append(f"extra peak of a training step beyond x.grad and y: at most {most:.0f} bytes per "
                   f"(feature, row) over {len(beyond)} points (at {p['layout']} {p['dtype']} {p['affine']} "
                   f"D={p['D']} H={p['H']})")
    peers = [p for p in points if p.get("train_speedup_vs_peer")]
    if peers:
        ok = [p for p in peers if p["train_speedup_vs_peer"] >= 2]
        out.append(f"target train >= 2x torch.compile: {len(ok)}/{len(peers)} peer points")
    n_err = sum(1 for p in points if p.get("errors"))
    n_skip = sum(1 for p in points if p.get("skipped"))
    out.append(f"{len(points)} points: {n_err} with errors, {n_skip} skipped")
    return out


def panel_values(points: list[dict], chain_affine: tuple, layout: str, dtype: str, kind: str, dims: list,
                 hs: list):
    """One heatmap panel: % of floor of `kind` ("fwd" / "train") per (D, H), NaN where not measured.

    Example:
        >>> p = dict(chain="layer_norm,tanh,relu", layout="BFD", dtype="fp32", affine="none", D=64, H=4,
        ...          fwd_pct_floor=71.0)
        >>> panel_values([p], ("layer_norm,tanh,relu", "none"), "BFD", "fp32", "fwd", [32, 64], [4]).tolist()
        [[nan], [71.0]]
    """
    import numpy as np

    grid = np.full((len(dims), len(hs)), np.nan)
    for p in points:
        if ((p.get("chain", chain_text(DEFAULT)), p["affine"], p["layout"], p["dtype"]) == (*chain_affine, layout, dtype)
                and f"{kind}_pct_floor" in p):
            grid[dims.index(p["D"]), hs.index(p["H"])] = p[f"{kind}_pct_floor"]
    return grid


def heatmap_axes(points: list[dict]) -> tuple:
    """The heatmap's rows ((chain, affine) pairs), columns ((layout, dtype, kind)), Ds and Hs."""
    chains = list(dict.fromkeys(p.get("chain", chain_text(DEFAULT)) for p in points))
    affines = [(ch, a) for ch in chains for a in AFFINES
               if any(p["affine"] == a and p.get("chain", chain_text(DEFAULT)) == ch for p in points)]
    cols = [(lay, dt, kind) for lay in LAYOUTS for dt in DTYPES for kind in ("fwd", "train")
            if any(p["layout"] == lay and p["dtype"] == dt for p in points)]
    return affines, cols, sorted({p["D"] for p in points}), sorted({p["H"] for p in points})


def heatmap(points: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    affines, cols, dims, hs = heatmap_axes(points)
    fig, axes = plt.subplots(len(affines), len(cols), squeeze=False, sharey=True, layout="constrained",
                             figsize=(1.5 + max(1.6, 0.5 * len(hs)) * len(cols),
                                      1.0 + max(1.8, 0.35 * len(dims) + 0.6) * len(affines)))
    cmap = plt.get_cmap("RdYlGn").copy()
    cmap.set_bad("0.85")
    im = None
    for r, aff in enumerate(affines):
        for c, (lay, dt, kind) in enumerate(cols):
            ax = axes[r][c]
            grid = panel_values(points, aff, lay, dt, kind, dims, hs)
            im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=100, aspect="auto")
            for i, j in itertools.product(range(len(dims)), range(len(hs))):
                v = grid[i, j]
                ax.text(j, i, "x" if np.isnan(v) else f"{v:.0f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(hs)), [str(h) for h in hs], fontsize=7)
            ax.set_yticks(range(len(dims)), [str(d) for d in dims], fontsize=7)
            ax.tick_params(labelleft=c == 0)
            if r == len(affines) - 1:
                ax.set_xlabel("H", fontsize=8)
            if c == 0:
                chain_label = "" if aff[0] == chain_text(DEFAULT) else f"{aff[0]}\n"
                ax.set_ylabel(f"{chain_label}affine={aff[1]}\nD", fontsize=8)
            ax.set_title(f"{lay} {dt} {kind}", fontsize=8)
    fig.suptitle(title + "  (% of floor; grey x = not measured)", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8, label="% of floor")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def result_stem(save: str, slug: str, chains, off_grid: bool = False) -> str:
    """grid_<gpu> for the default chain alone, grid_chains_<gpu> when other chains are in the run,
    grid_offgrid_<gpu> for an ``--off-grid`` run (the default chain)."""
    if off_grid:
        return os.path.join(save, f"grid_offgrid_{slug}")
    return os.path.join(save, f"grid_{slug}" if list(chains) == [DEFAULT] else f"grid_chains_{slug}")


POINT_KEY = ("chain", "layout", "dtype", "affine", "D", "H")


def peer_speedup(p: dict):
    """peer training time / recfuse's, both of one kind: GPU (kernel) time where the peer has its
    events figure beside it (`peer_train_wall_us`: this tool's runs), else, for a peer saved by a
    run that timed it with do_bench's events, recfuse's events figure too.

    Example:
        >>> peer_speedup({"train_us": 400.0, "train_wall_us": 600.0, "peer_train_us": 1200.0})
        2.0
        >>> peer_speedup({"train_us": 400.0, "peer_train_us": 1200.0, "peer_train_wall_us": 1300.0})
        3.0
    """
    mine = p.get("train_us") if "peer_train_wall_us" in p else p.get("train_wall_us", p.get("train_us"))
    return p["peer_train_us"] / mine if mine and p.get("peer_train_us") else None


def merge_points(saved: list[dict], points: list[dict], date: str) -> list[dict]:
    """The saved points that ``points`` does not re-measure (each stamped with its run's date),
    then the new ones.

    Example:
        >>> old = [{"layout": "BFD", "dtype": "bf16", "affine": "none", "D": 64, "H": h} for h in (1, 4)]
        >>> new = [dict(old[1], chain=chain_text(DEFAULT), fwd_us=1.0)]
        >>> [(p["H"], "fwd_us" in p) for p in merge_points(old, new, "2026-01-01")]
        [(1, False), (4, True)]
    """
    def key(p):  # files from before chains were a grid axis have no "chain": the default's
        return (p.get("chain", chain_text(DEFAULT)),) + tuple(p.get(k) for k in POINT_KEY[1:])

    fresh = {key(p) for p in points if "skipped" not in p}
    saved_by_key = {key(p): p for p in saved}
    for p in points:
        # The peer (torch.compile of the composite) does not depend on recfuse's kernels: a point
        # re-measured without it keeps the saved peer figures, stamped with their own date.
        old = saved_by_key.get(key(p))
        if "skipped" in p or p.get("peer_train_us") or not (old and old.get("peer_train_us")):
            continue
        p.update({k: v for k, v in old.items() if k.startswith("peer_") or k == "peer"})
        p["peer_run_date"] = old.get("peer_run_date", old.get("run_date", date))
        p["train_speedup_vs_peer"] = peer_speedup(p)
    kept = [{**p, "run_date": p.get("run_date", date)} for p in saved if key(p) not in fresh]
    kept_keys = {key(p) for p in kept}
    return kept + [p for p in points if "skipped" not in p or key(p) not in kept_keys]


def write_outputs(save: str, slug: str, env: dict, points: list[dict], final: bool, merge: bool = False,
                  off_grid: bool = False) -> None:
    os.makedirs(save, exist_ok=True)
    stem = result_stem(save, slug, {parse_chain(p.get("chain", chain_text(DEFAULT))) for p in points}, off_grid)
    if merge and os.path.exists(stem + ".json"):
        with open(stem + ".json") as fh:
            saved = json.load(fh)
        env = {**env, "merged_from": saved["env"].get("merged_from", []) + [saved["env"].get("date", "")]}
        points = merge_points(saved["points"], points, saved["env"].get("date", "")[:10])
        if not final:
            return  # the saved file stays whole until the run has finished
    with open(stem + ".json", "w") as fh:
        json.dump({"env": env, "points": points}, fh, indent=1)
    if final:
        with open(stem + ".txt", "w") as fh:
            fh.write(table(points, env) + "\n")
        heatmap(points, stem + ".png", f"recfuse grid, {env['device_name']}, {env['date'][:10]}")


# -------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--off-grid", action="store_true",
                    help="shapes the tuned tables do not hold (D %s, H %s; BFD, per-feature affine unless "
                         "given), where configs come from nearest entries and the heuristic; saves "
                         "grid_offgrid_<gpu>.*" % (list(OFF_GRID_DIMS), list(OFF_GRID_HS)))
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=None, help="default: both (--off-grid: BFD)")
    ap.add_argument("--dims", nargs="+", type=int, default=None, help=f"default: {list(GRID_DIMS)}")
    ap.add_argument("--hs", nargs="+", type=int, default=None, help=f"default: {list(GRID_HS)}")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--affine", nargs="+", choices=AFFINES, default=None,
                    help="default: both (--off-grid: per_feature)")
    ap.add_argument("--chains", nargs="+", type=parse_chain, default=[DEFAULT],
                    help="norm,activation,out_activation per chain (e.g. rms_norm,silu,none); default "
                         "layer_norm,tanh,relu")
    ap.add_argument("--x-mb", type=float, default=256.0, help="size of x per point in MB (contract: 64-512)")
    ap.add_argument("--features", type=int, default=64, help="F, fixed; B follows from --x-mb")
    ap.add_argument("--warmup", type=float, default=10.0, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=float, default=40.0, help="do_bench rep, ms per measurement")
    ap.add_argument("--peer-every", type=int, default=3, help="torch.compile peer on every Nth point; 0 = never")
    ap.add_argument("--check-rows", type=int, default=256, help="batch rows checked against float64")
    ap.add_argument("--save", default=None, help="directory for grid_<gpu>.json/.txt/.png")
    ap.add_argument("--merge", action="store_true",
                    help="keep the saved file's points that this run does not measure (they keep their "
                         "'run_date'); the table and heatmap show the union")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop between points after this long")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    off = args.off_grid
    args.layouts = args.layouts or (["BFD"] if off else list(LAYOUTS))
    args.dims = args.dims or list(OFF_GRID_DIMS if off else GRID_DIMS)
    args.hs = args.hs or list(OFF_GRID_HS if off else GRID_HS)
    args.affine = args.affine or (["per_feature"] if off else list(AFFINES))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.max_seconds if args.max_seconds else float("inf")
    dev = args.device
    if dev == "cuda":
        assert torch.cuda.is_available(), "--device cuda needs a GPU (use --device cpu for a smoke run)"
    slug = device_slug(dev)
    bench = make_bench(dev, args.warmup, args.rep)
    copy_bench = make_bench(dev, args.warmup, max(args.rep, 100.0))

    def copy_stats() -> dict:
        c = copy_bandwidth(int(args.x_mb * 2**20), dev, copy_bench)
        return {"copy_bytes": c["bytes"], "copy_us": c["time_us"], "copy_GBps": c["GBps"]}

    bw = copy_stats()
    env = {**environment(dev), "command": command_line(argv), "args": vars(args), **bw}
    if dev == "cuda":
        # which tuned table the configs came from ("none": the heuristic alone)
        env["config_table"] = configs.table_slug(torch.cuda.current_device())
    name = env["device_name"]
    points = grid_points(args)
    print(f"{len(points)} points on {name}; copy {bw['copy_GBps']:.0f} GB/s; "
          f"peer on {sum(p['peer'] for p in points)} of them", file=sys.stderr)

    bar = tqdm(points, file=sys.stderr, unit="pt", dynamic_ncols=True)
    stop = None
    for p in bar:
        if stop is None and time.perf_counter() >= deadline:
            stop = f"skipped: --max-seconds {args.max_seconds:g} spent"
        if stop:
            p["skipped"] = stop
            continue
        bar.set_postfix_str(f"{p['chain']} {p['layout']} {p['dtype']} {p['affine']} D={p['D']} H={p['H']}")
        t0 = time.perf_counter()
        try:
            measure_point(p, args, bench, bw["copy_GBps"], deadline)
        except KeyboardInterrupt:
            stop = "skipped: interrupted"
            p["skipped"] = stop
        except Exception as e:  # noqa: BLE001 - e.g. OOM while building the inputs
            p.setdefault("errors", {})["point"] = f"{type(e).__name__}: {e}"[:400]
        p["point_s"] = time.perf_counter() - t0
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        if args.save and not args.merge:
            write_outputs(args.save, slug, env, points, final=False, off_grid=args.off_grid)
    bar.close()

    if dev == "cuda" and not stop:
        env["copy_GBps_end"] = copy_stats()["copy_GBps"]
    env["total_s"] = time.perf_counter() - t_start
    print(table(points, env))
    print(f"total {env['total_s']:.0f} s", file=sys.stderr)
    if args.save:
        write_outputs(args.save, slug, env, points, final=True, merge=args.merge, off_grid=args.off_grid)
        print(f"wrote {result_stem(args.save, slug, args.chains, args.off_grid)}.json/.txt/.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
