"""Nsight Compute profiles of the op's kernels at chosen grid points: where each kernel's time goes.

Issue 14 asks that every grid point short of its target be named with its profile. This tool runs
each point in a child process under ``ncu`` (clocks left alone: ``--clock-control none``, profiling
only between ``cudaProfilerStart`` and ``Stop``) and keeps, for every kernel of one no-grad forward
and one training step (forward + backward, grads None first) of that point:

* duration, grid and block size, registers a thread, and the kernel's spilled bytes and shared
  memory as Triton compiled it;
* theoretical and achieved occupancy, DRAM and SM throughput (% of peak), the share of cycles a
  scheduler issued, eligible warps per scheduler;
* the top warp-stall reasons, as warps stalled per issued instruction (ncu's WarpStateStats).

Points are ``dtype:layout:affine:D:H`` (``--points``), or the lowest of a grid result in the
targets' scope (``--from-grid FILE --worst N``: per dtype the N lowest training % of floor and the
N lowest forward %). A point is built as ``grid.py`` builds it (F = ``--features``, x about
``--x-mb`` MB, the default chain). ``--dry-run`` prints the points and the ncu command lines;
``--child`` (what ncu runs) also runs on the CPU, without ncu, as a smoke test.

Outputs: a progress bar, a summary table, and with ``--save DIR`` ``profile_points_<gpu>.json``
and ``.txt``.

Example:
    $ python benchmarks/profile_points.py --from-grid benchmarks/results/grid_h100.json --worst 2 \\
          --save benchmarks/results
    $ python benchmarks/profile_points.py --points bf16:BFD:per_feature:512:64 fp32:BFD:none:256:16
    $ python benchmarks/profile_points.py --from-grid benchmarks/results/grid_h100.json --worst 1 --dry-run
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from _common import command_line, device_slug, environment, json_safe
from grid import DTYPES, EPS, make_inputs

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats")
KERNEL_LINE = "PROFILE_POINT_KERNELS "
# ncu raw-page metric -> this tool's name (units from --print-units base: ns, %, registers, count);
# where ncu versions name a metric apart, each of the names in turn (Hopper, ncu 2025.3: the gpu__ ones).
METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__registers_per_thread": "registers",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "smsp__warps_eligible.avg.per_cycle_active": "eligible_warps",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


# ------------------------------------------------------------------------------------------ points
def parse_point(text: str, features: int, x_mb: float) -> dict:
    """``"bf16:BFD:per_feature:512:64"`` -> a grid point dict (as grid.py's, default chain).

    Example:
        >>> p = parse_point("fp32:BFD:none:256:16", 64, 256)
        >>> p["dtype"], p["layout"], p["affine"], p["D"], p["H"], p["F"], p["B"]
        ('fp32', 'BFD', 'none', 256, 16, 64, 4096)
    """
    parts = text.split(":")
    if len(parts) != 5 or parts[0] not in DTYPES or parts[1] not in ("BFD", "FBD") \
            or parts[2] not in ("per_feature", "none"):
        raise argparse.ArgumentTypeError(f"a point is dtype:layout:affine:D:H (e.g. bf16:BFD:per_feature:512:64), "
                                         f"got {text!r}")
    D, H = int(parts[3]), int(parts[4])
    elem = DTYPES[parts[0]].itemsize
    B = max(64, round(x_mb * 2**20 / (features * D * elem) / 64) * 64)
    return {"dtype": parts[0], "layout": parts[1], "affine": parts[2], "D": D, "H": H, "F": features, "B": B,
            "x_MB": features * B * D * elem / 2**20, "index": 0, "chain": "layer_norm,tanh,relu"}


def point_name(p: dict) -> str:
    return f"{p['dtype']}:{p['layout']}:{p['affine']}:{p['D']}:{p['H']}"


def worst_points(grid: list[dict], n: int) -> list[str]:
    """Per dtype, the in-scope points (x >= 64 MB; H <= 16 fp32, <= 64 16-bit; the default chain)
    with the lowest training % of floor at `n` distinct (D, H), then the lowest forward % likewise
    (the two layouts of a shape profile alike: one point a shape).

    Example:
        >>> g = [dict(dtype="fp32", layout="BFD", affine="none", D=d, H=16, x_MB=256, train_pct_floor=d / 10,
        ...           fwd_pct_floor=100 - d / 10) for d in (64, 128, 256, 512)]
        >>> worst_points(g, 1)
        ['fp32:BFD:none:64:16', 'fp32:BFD:none:512:16']
    """
    scope = [p for p in grid if p.get("x_MB", 0) >= 64 and p["H"] <= (16 if p["dtype"] == "fp32" else 64)
             and p.get("chain", "layer_norm,tanh,relu") == "layer_norm,tanh,relu"]
    names = []
    for dt in dict.fromkeys(p["dtype"] for p in scope):
        for key in ("train_pct_floor", "fwd_pct_floor"):
            got = sorted((p for p in scope if p["dtype"] == dt and key in p), key=lambda p: p[key])
            lowest = {}
            for p in got:
                if len(lowest) < n:
                    lowest.setdefault((p["D"], p["H"]), p)
            names += [point_name(p) for p in lowest.values()]
    return list(dict.fromkeys(names))


# ------------------------------------------------------------------------------------- child side
def compiled_kernels() -> list[dict]:
    """Registers, spilled bytes and shared memory of every kernel the op's launch caches compiled."""
    from recfuse.ops import launch
    from recfuse.ops._compiled_launch import CompiledLaunchCache
    out = []
    for name, cache in vars(launch).items():
        if not isinstance(cache, CompiledLaunchCache):
            continue
        for key, compiled in list(cache.kernels.items()):
            meta = dict(key[1])
            out.append({"cache": name, "kernel": cache.jit_fn.fn.__name__,
                        "registers": getattr(compiled, "n_regs", None), "spilled_bytes": getattr(compiled, "n_spills", None),
                        "shared_bytes": getattr(getattr(compiled, "metadata", None), "shared", None),
                        "num_warps": dict(key[2]).get("num_warps"),
                        "meta": {k: v for k, v in meta.items() if k.startswith("BLOCK") or k in (
                            "USE_DOT", "LOAD_MASK", "SAVE_MASK", "SAVE_STATS", "PERSISTENT", "TILE_STAGES", "PREFETCH",
                            "LOOP_STAGES", "DZ_OUT", "K_CHUNKS")}})
    return out


def run_child(p: dict, device: str) -> dict:
    """Warm the point's kernels (compile), then one no-grad forward and one training step between
    cudaProfilerStart and Stop; returns what was compiled."""
    buf, x, fdim, (w, b, lw, lb), gy = make_inputs(p, device)
    params = [t.requires_grad_(True) for t in (w, b, lw, lb) if t is not None]
    xg = buf.detach().clone().requires_grad_(True)
    view = (lambda t: t.view(p["B"], p["F"], p["D"])) if p["layout"] == "BFD" else (lambda t: t)

    def op(xx):
        return recfuse_op(xx, w, b, lw, lb, fdim)

    def step():
        for t in [xg] + params:
            t.grad = None
        op(view(xg)).backward(gy)

    def forward():
        with torch.no_grad():
            op(x)

    for _ in range(2):
        forward()
        step()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    forward()
    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return {"point": point_name(p), "B": p["B"], "kernels": compiled_kernels() if cuda else []}


def recfuse_op(xx, w, b, lw, lb, fdim):
    import recfuse
    return recfuse.ln_tanh_linear_relu(xx, w, b, ln_weight=lw, ln_bias=lb, eps=EPS, feature_dim=fdim)


# ------------------------------------------------------------------------------------ parent side
def ncu_command(ncu: str, report: str, p: dict, args) -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--export", report, "--force-overwrite"]
    for s in SECTIONS:
        cmd += ["--section", s]
    return cmd + [sys.executable, os.path.abspath(__file__), "--child", point_name(p), "--features",
                  str(args.features), "--x-mb", str(args.x_mb)]


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's ``--page raw --csv --print-units base`` output -> one dict per kernel: its name, this
    tool's METRICS, and the five largest warp-stall reasons.

    Example:
        >>> text = ('"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread",'
        ...         '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
        ...         '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"\\n'
        ...         '"","","nsecond","register/thread","ratio","ratio"\\n'
        ...         '"0","ln_tanh_linear_relu_fwd","1,234","168","2.5","0.25"\\n')
        >>> k = parse_raw_csv(text)[0]
        >>> k["kernel"], k["duration_ns"], k["registers"], k["stalls"]
        ('ln_tanh_linear_relu_fwd', 1234.0, 168.0, [['long_scoreboard', 2.5], ['barrier', 0.25]])
    """
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]  # ncu's own ==PROF== lines go
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return []
    header, body = rows[0], rows[2:]
    out = []
    for row in body:
        raw = dict(zip(header, row))
        k = {"kernel": raw.get("Kernel Name", "?")}
        for metric, name in METRICS.items():
            if k.get(name) is None:
                k[name] = _number(raw.get(metric))
        stalls = [(m.group(1), _number(v)) for h, v in raw.items() if (m := STALL.match(h))]
        stalls = [[r, v] for r, v in stalls if v is not None and not r.endswith("not_issued")]
        k["stalls"] = sorted(stalls, key=lambda rv: -rv[1])[:5]
        out.append(k)
    return out


def _number(v):
    if v is None or v == "" or v == "n/a":
        return None
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def profile_point(p: dict, args, tmp: str) -> dict:
    """Run the point's child under ncu and read its report back."""
    report = os.path.join(tmp, point_name(p).replace(":", "_"))
    t0 = time.perf_counter()
    res = subprocess.run(ncu_command(args.ncu, report, p, args), capture_output=True, text=True,
                         timeout=args.timeout)
    out = {"point": point_name(p), "F": p["F"], "B": p["B"], "seconds": time.perf_counter() - t0}
    child = [json.loads(ln[len(KERNEL_LINE):]) for ln in res.stdout.splitlines() if ln.startswith(KERNEL_LINE)]
    if res.returncode != 0 or not child:
        out["error"] = f"ncu exit {res.returncode}: {(res.stderr or res.stdout)[-800:]}"
        return out
    out["compiled"] = child[0]["kernels"]
    raw = subprocess.run([args.ncu, "--import", report + ".ncu-rep", "--csv", "--page", "raw", "--print-units",
                          "base"], capture_output=True, text=True, timeout=args.timeout)
    kernels = parse_raw_csv(raw.stdout)
    if not kernels:
        out["error"] = f"no kernels in the report: {(raw.stderr or raw.stdout)[-800:]}"
        return out
    # The first kernel is the no-grad forward; the rest are the training step's.
    for i, k in enumerate(kernels):
        k["call"] = "forward" if i == 0 else "step"
    out["kernels"] = kernels
    out["forward_us"] = kernels[0]["duration_ns"] / 1e3 if kernels[0]["duration_ns"] else None
    out["step_us"] = sum((k["duration_ns"] or 0) for k in kernels[1:]) / 1e3
    return out


def table(results: list[dict]) -> str:
    head = (f"{'point':30s} {'call':7s} {'kernel':34s} {'us':>8s} {'regs':>4s} {'spill':>5s} {'occ t/a %':>9s} "
            f"{'dram%':>5s} {'sm%':>4s} {'issue%':>6s} {'elig':>4s} | top stalls (warps per issue)")
    lines = [head]
    for r in results:
        if "error" in r:
            lines.append(f"{r['point']:30s} error: {r['error'][:200]}")
            continue
        spills = {}
        for c in r.get("compiled", []):
            spills.setdefault(c["kernel"], c["spilled_bytes"])
        for k in r["kernels"]:
            f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
            occ = f"{f(k['theoretical_occupancy_pct'], '.0f')}/{f(k['achieved_occupancy_pct'], '.0f')}"
            stalls = ", ".join(f"{n} {v:.2f}" for n, v in k["stalls"][:3])
            name = k["kernel"][:34]
            lines.append(f"{r['point']:30s} {k['call']:7s} {name:34s} {f(k['duration_ns'] and k['duration_ns'] / 1e3, '8.1f'):>8s} "
                         f"{f(k['registers'], '.0f'):>4s} {str(spills.get(k['kernel'], '-')):>5s} {occ:>9s} "
                         f"{f(k['dram_pct'], '.0f'):>5s} {f(k['sm_pct'], '.0f'):>4s} {f(k['issue_active_pct'], '.0f'):>6s} "
                         f"{f(k['eligible_warps'], '.2f'):>4s} | {stalls}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", default=[], help="dtype:layout:affine:D:H, e.g. bf16:BFD:per_feature:512:64")
    ap.add_argument("--from-grid", help="a grid_<gpu>.json: profile its lowest in-scope points (--worst)")
    ap.add_argument("--worst", type=int, default=2, help="with --from-grid: per dtype, the N lowest training and "
                                                         "the N lowest forward points")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--x-mb", type=float, default=256.0)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="the ncu binary")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per point")
    ap.add_argument("--save", default=None, help="directory for profile_points_<gpu>.json/.txt")
    ap.add_argument("--dry-run", action="store_true", help="print the points and ncu command lines; run nothing")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="the child's device (cpu: a smoke run of --child without ncu)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        p = parse_point(args.child, args.features, args.x_mb)
        print(KERNEL_LINE + json.dumps(json_safe(run_child(p, args.device))), flush=True)
        return 0
    names = list(args.points)
    if args.from_grid:
        with open(args.from_grid) as f:
            names += worst_points(json.load(f)["points"], args.worst)
    points = [parse_point(n, args.features, args.x_mb) for n in dict.fromkeys(names)]
    if not points:
        print("profile_points: no points (give --points or --from-grid)", file=sys.stderr)
        return 2
    if args.dry_run:
        for p in points:
            print(" ".join(ncu_command(args.ncu, "/tmp/" + point_name(p).replace(":", "_"), p, args)))
        return 0
    if args.device != "cuda" or shutil.which(args.ncu) is None:
        print(f"profile_points: needs a CUDA device and ncu ({args.ncu}); --dry-run shows the commands",
              file=sys.stderr)
        return 2
    from tqdm import tqdm
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in tqdm(points, desc="ncu", unit="point", file=sys.stderr):
            try:
                results.append(profile_point(p, args, tmp))
            except subprocess.TimeoutExpired:
                results.append({"point": point_name(p), "error": f"timed out after {args.timeout:.0f} s"})
    env = environment("cuda")
    ncu_version = subprocess.run([args.ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    text = (f"recfuse kernel profiles on {env['device_name']}, torch {env['torch']}, triton {env['triton']}, "
            f"{ncu_version[-1] if ncu_version else 'ncu'}, {env['date']}; F={args.features}, x ~{args.x_mb:g} MB; "
            f"clocks not locked (--clock-control none), so durations run a little long of do_bench's\n"
            f"regs: registers a thread (ncu); spill: bytes Triton spilled; occ t/a: theoretical / achieved "
            f"occupancy; issue%: cycles a scheduler issued; elig: eligible warps per scheduler a cycle\n"
            + table(results))
    print(text)
    if args.save:
        stem = os.path.join(args.save, f"profile_points_{device_slug('cuda')}")
        with open(stem + ".json", "w") as f:
            json.dump(json_safe({"env": env, "command": command_line(argv), "points": results}), f, indent=1)
        with open(stem + ".txt", "w") as f:
            f.write(text + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
