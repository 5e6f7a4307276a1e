#!/usr/bin/env python
"""Turn a results JSON of split_stack_vs_combined.py into a chart and a markdown table.

Prints the markdown table (one per case, with the machine, versions, date and command above it,
and the puzzler's published A100 figures beside the seed shape). Writes a PNG with one panel per
case (shape, dtype, mode), one log-scale bar per row, and the copy floor as a dashed line.
Edits the README only when asked with --update-readme, and only between the markers
`<!-- results:start -->` and `<!-- results:end -->`.

Without a path it reads the current result of one GPU model by its stable name,
`benchmarks/results/split_stack_vs_combined_<gpu>.json` (`--gpu`, default h100: the GPU the
README quotes).

Examples:
    python benchmarks/render_results.py --update-readme README.md     # results/split_stack_vs_combined_h100.json
    python benchmarks/render_results.py --gpu h200 --plot /tmp/h200.png
    python benchmarks/render_results.py RESULTS.json --plot RESULTS.png
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

START_MARKER = "<!-- results:start -->"
END_MARKER = "<!-- results:end -->"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
BENCHMARK = "split_stack_vs_combined"
README_GPU = "h100"  # the GPU model whose current result the README shows

# The puzzler's published A100 numbers (forward, fp32, F=16 B=1024 D=256 H=1, wall per call).
PUZZLER_SHAPE = {"F": 16, "B": 1024, "D": 256, "H": 1, "dtype": "float32", "mode": "forward"}
PUZZLER_A100 = {
    "split_stack": "1613 us",
    "combined": "8.4x",
    "compile_split_stack": "2.5x",
    "compile_combined": "10.3x",
}


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def is_benchmark_results(path: Path) -> bool:
    """Whether `path` is a JSON written by split_stack_vs_combined.py (the folder holds others)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("benchmark") == BENCHMARK and "cases" in data


def results_path(gpu: str = README_GPU, directory: Path = RESULTS_DIR) -> Path:
    """The current split_stack_vs_combined result of one GPU model (h100, h200, cpu): its stable name."""
    return Path(directory) / f"{BENCHMARK}_{gpu}.json"


def newest_results(directory: Path = RESULTS_DIR) -> Optional[Path]:
    """Of the current results in `directory` (one per GPU model, split_stack_vs_combined_<gpu>.json),
    the one run last (by its recorded date); None if there is none."""
    files = [p for p in sorted(Path(directory).glob(f"{BENCHMARK}_*.json")) if is_benchmark_results(p)]
    if not files:
        return None
    return max(files, key=lambda p: (load(p)["env"].get("date", ""), p.name))


def case_title(case: dict) -> str:
    return f"F={case['F']} B={case['B']} D={case['D']} H={case['H']} {case['dtype']} {case['mode']}"


def _is_puzzler_case(case: dict) -> bool:
    return all(case.get(k) == v for k, v in PUZZLER_SHAPE.items())


def _num(value, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, str)):
        return "n/a" if value is None else value
    return f"{value:{spec}}{suffix}"


def row_cells(row: dict) -> list[str]:
    if "wall_us" not in row:
        reason = row.get("reason", "").replace("|", "/")
        return [row["label"], f"{row['status']} ({reason})"] + [""] * 7
    peak = row.get("extra_peak_bytes")
    err = _num(row.get("max_rel_err"), ".1e") + (" (above tolerance)" if row["status"] == "inaccurate" else "")
    kernels = row.get("kernels_per_call")
    return [
        row["label"],
        _num(row["wall_us"], ",.1f"),
        _num(row.get("gpu_us"), ",.1f"),
        _num(kernels, ".0f" if kernels is None or float(kernels).is_integer() else ".1f"),
        _num(row.get("speedup_wall"), ".2f", "x"),
        _num(row.get("speedup_gpu"), ".2f", "x"),
        _num(row.get("pct_copy_bw"), ".1f", "%"),
        _num(None if peak is None else peak / 2**20, ",.0f"),
        err,
    ]


def markdown(results: dict) -> str:
    """Markdown for the README: a header line, then one table per case."""
    env = results["env"]
    gpu = env["device"].startswith("cuda")
    lines = [
        f"Measured on **{env['device_name']}** ({env['device']}), torch {env['torch']}, "
        f"triton {env['triton']}, {env['date'][:10]}, with "
        f"`python benchmarks/{results['command']}`.",
        "",
        "Times are per call: *wall* is launch to host synchronisation (as the puzzler measures), "
        "*GPU* the do_bench median. Speedups are over eager `split_stack` in the same run; "
        "*% copy* compares the bytes each row must move with a device copy timed in the same run. "
        + ("" if gpu else "On CPU, *kernels* counts top-level aten ops. "),
    ]
    header = ["row", "wall us", "GPU us", "kernels" if gpu else "aten ops", "speedup (wall)",
              "speedup (GPU)", "% copy BW", "extra peak MiB", "max rel err vs fp64"]
    for case in results["cases"]:
        puzzler = _is_puzzler_case(case) and gpu
        copy_stats = case["copy"]
        lines += ["", f"**{case_title(case)}** (copy of x+y: {copy_stats['time_us']:,.1f} us, "
                      f"{copy_stats['GBps']:,.0f} GB/s)", ""]
        cols = header + (["puzzler on A100 (published, wall)"] if puzzler else [])
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|")
        for row in case["rows"]:
            cells = row_cells(row)
            if puzzler:
                cells.append(PUZZLER_A100.get(row["key"], ""))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, table: str) -> None:
    """Replace what lies between the results markers; nothing else in the file changes."""
    text = readme.read_text()
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise SystemExit(f"{readme}: needs the markers {START_MARKER} and {END_MARKER} (in that order)")
    head = text[: start + len(START_MARKER)]
    readme.write_text(head + "\n" + table + text[end:])


def _row_time(row: dict, metric: str) -> Optional[float]:
    value = row.get("gpu_us") if metric == "gpu" else row.get("wall_us")
    return value if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def plot_results(results: dict, path: Path) -> None:
    """One panel per case; bars are GPU time when measured, else wall time; log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    ncols = min(2, len(cases)) or 1
    nrows = math.ceil(len(cases) / ncols) or 1
    bars = max(len(c["rows"]) for c in cases) if cases else 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, (0.35 * bars + 1.4) * nrows + 0.6),
                             squeeze=False)
    for ax, case in zip(axes.flat, cases):
        # GPU time where the case has it (device work, what bandwidth is about), else wall.
        metric = "gpu" if any(r.get("gpu_us") for r in case["rows"]) else "wall"
        labels = [r["label"] for r in case["rows"]]
        times = [_row_time(r, metric) for r in case["rows"]]
        ys = range(len(labels))
        colors = ["#999999" if r["key"] in ("split_stack", "combined") else
                  "#d62728" if r["key"].startswith("recfuse") or r["key"] == "fused_feature_processor"
                  else "#1f77b4" for r in case["rows"]]
        ax.barh(list(ys), [t or 0 for t in times], color=colors)
        ax.set_xscale("log")
        ax.set_yticks(list(ys), labels)
        ax.invert_yaxis()
        ax.set_title(case_title(case), fontsize=10)
        ax.set_xlabel(f"{'GPU' if metric == 'gpu' else 'wall'} time per call (us, log scale)")
        floor = case["bytes_moved"] / (case["copy"]["GBps"] * 1e9) * 1e6
        ax.axvline(floor, color="k", linestyle="--", linewidth=1, label=f"copy floor {floor:,.0f} us")
        present = [t for t in times if t]
        if present:
            ax.set_xlim(min(present + [floor]) / 2, max(present) * 4)
        for y, t, row in zip(ys, times, case["rows"]):
            text = f"{t:,.0f}" if t else row["status"]
            if t and row.get("speedup_gpu" if metric == "gpu" else "speedup_wall"):
                text += f"  ({row['speedup_gpu' if metric == 'gpu' else 'speedup_wall']:.1f}x)"
            ax.text(t * 1.05 if t else ax.get_xlim()[0] * 1.1, y, text, va="center", fontsize=8)
        ax.legend(loc="lower right", fontsize=8)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    env = results["env"]
    fig.suptitle(f"split_stack vs combined vs recfuse on {env['device_name']} "
                 f"(torch {env['torch']}, triton {env['triton']}, {env['date'][:10]})", fontsize=11)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", type=Path, default=None,
                   help="results JSON (default: benchmarks/results/split_stack_vs_combined_<--gpu>.json)")
    p.add_argument("--gpu", default=README_GPU,
                   help=f"without a path: the GPU model whose current result to read (default {README_GPU})")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH.png", help="write the chart here")
    p.add_argument("--update-readme", type=Path, default=None, metavar="README.md",
                   help="replace the table between the results markers of this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    path = args.results or results_path(args.gpu)
    if not path.is_file():
        print(f"no results JSON at {path}", file=sys.stderr)
        return 1
    results = load(path)
    table = markdown(results)
    print(table)
    if args.plot:
        plot_results(results, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.update_readme:
        update_readme(args.update_readme, table)
        print(f"updated {args.update_readme} between {START_MARKER} and {END_MARKER}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
