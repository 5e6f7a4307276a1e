#!/usr/bin/env python
"""Build notebooks/puzzler.ipynb from the cells below, so the notebook is reviewed as code.

The notebook is written without outputs (small diffs; CI executes it, see tests/test_notebook.py).
Cells tagged `needs-transform` use `recfuse.transform` / `recfuse.explain`; the notebook test
tolerates errors in those cells only while recfuse does not have them yet.

Examples:
    python notebooks/build_puzzler.py             # rewrite notebooks/puzzler.ipynb
    python notebooks/build_puzzler.py --check     # exit 1 if the committed notebook is stale
    python notebooks/build_puzzler.py --execute   # also run it and keep the outputs (not for commits)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOK = Path(__file__).resolve().parent / "puzzler.ipynb"
NEEDS_TRANSFORM = "needs-transform"

CELLS: list[tuple[str, str] | tuple[str, str, list[str]]] = [
    ("md", """\
# The `split_stack` vs `combined` puzzler

Recommendation models look up many embedding tables and then run the same small dense chain on
every feature's pooled embedding: **LayerNorm -> tanh -> Linear(D, H) -> relu**. The puzzler asks
why one way of writing it is ~8x slower than another on a GPU, and this notebook walks through the
answer and what recfuse does about it:

1. the two functions, and that they compute the same thing;
2. how many ops (kernels on a GPU) each launches per call;
3. horizontal fusion (one op per step for all features) versus vertical fusion (one kernel for
   the whole chain);
4. `recfuse.explain` and `recfuse.transform` on the per-slice module, with `verify=True`;
5. the GPU results committed under `benchmarks/results/`.

It runs on a CPU with small sizes in a few seconds; the GPU numbers come from
`benchmarks/split_stack_vs_combined.py`."""),
    ("code", """\
import copy
import inspect
import sys
from pathlib import Path

import torch

import recfuse
from recfuse.puzzler import SplitStack, combined, split_stack

torch.manual_seed(0)
F, B, D, H = 16, 64, 32, 1           # features, batch, embedding dim, Linear outputs (the seed's H=1)
x = torch.randn(B * F * D)           # 1D, as the puzzler feeds it (random: never benchmark zeros)
linear = torch.nn.Linear(D, H)       # one Linear shared by every feature
print(f"torch {torch.__version__}, recfuse {recfuse.__version__}, x: {tuple(x.shape)}")"""),
    ("md", """\
## 1. The two functions

`split_stack` slices the [B, F*D] buffer into F slices of [B, D], normalises and squashes each one
on its own, stacks them back and applies the shared Linear. `combined` views the same buffer as
[B, F, D] and does each step once for all features. Both return [F, B, H]."""),
    ("code", """\
print(inspect.getsource(split_stack))
print(inspect.getsource(combined))"""),
    ("md", """\
They agree with each other and with a float64 run of `split_stack` (the oracle the benchmark and
the tests use), measured as relative error ||out - ref|| / ||ref||. Note `eps=0.0` in the
LayerNorm: the seed uses it, and recfuse keeps it exact."""),
    ("code", """\
def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()

ref = split_stack(x.double(), B, D, copy.deepcopy(linear).double()).detach()
with torch.no_grad():
    y_split = split_stack(x, B, D, linear)
    y_comb = combined(x, B, D, linear)
print("output shape:", tuple(y_split.shape))
print(f"split_stack vs float64: {rel_err(y_split, ref):.1e}")
print(f"combined    vs float64: {rel_err(y_comb, ref):.1e}")"""),
    ("md", """\
## 2. Counting ops with `torch.profiler`

On a GPU every op below is (at least) one kernel launch of roughly 5-10 us of host work, and at
the seed's shape the GPU finishes each kernel faster than Python can launch the next one: the time
is launch overhead. On a CPU the profiler cannot show device kernels, so we count the top-level
aten ops a call dispatches (views are ops but launch no kernel on a GPU)."""),
    ("code", """\
from torch.profiler import ProfilerActivity, profile

def top_level_ops(fn):
    \"\"\"Names of the aten/recfuse ops `fn` dispatches itself (not those nested inside other ops).\"\"\"
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    def is_op(e):
        return e.name.startswith(("aten::", "recfuse::"))
    def top(e):
        p = e.cpu_parent
        while p is not None:
            if is_op(p):
                return False
            p = p.cpu_parent
        return True
    return [e.name for e in prof.events() if is_op(e) and top(e)]

ops = top_level_ops(lambda: split_stack(x, B, D, linear))
print(f"split_stack, F={F}: {len(ops)} ops:", ", ".join(dict.fromkeys(ops)))
ops = top_level_ops(lambda: combined(x, B, D, linear))
print(f"combined,    F={F}: {len(ops)} ops:", ", ".join(ops))"""),
    ("md", """\
The per-slice form grows with the number of features (2 ops per feature plus a constant); the
batched form does not:"""),
    ("code", """\
print(f"{'F':>4} {'split_stack':>12} {'combined':>9}")
for f in (4, 8, 16, 32, 64):
    xf = torch.randn(B * f * D)
    n_split = len(top_level_ops(lambda: split_stack(xf, B, D, linear)))
    n_comb = len(top_level_ops(lambda: combined(xf, B, D, linear)))
    print(f"{f:>4} {n_split:>12} {n_comb:>9}")"""),
    ("md", """\
## 3. Horizontal versus vertical fusion

* **Horizontal fusion** turns F identical per-slice ops into one op over all slices: F LayerNorms
  become one LayerNorm on a [B, F, D] view. That is what `combined` is, and what Inductor's
  `batch_layernorm` / `batch_tanh` pre-grad passes do to `split_stack`. It removes the launches
  but every step still writes its intermediate to memory and the next step reads it back.
* **Vertical fusion** merges the *chain* LayerNorm -> tanh -> Linear -> relu into one kernel that
  reads each row of x once, keeps the intermediates in registers and writes only y. On large
  shapes the chain is memory-bound, so bytes moved is what sets the time.

A rough count of the bytes each form moves at the benchmark's large shape (fp32, H=1), in units of
bytes(x); this is arithmetic, not a measurement:"""),
    ("code", """\
Fl, Bl, Dl, Hl = 128, 8192, 256, 1
X = Fl * Bl * Dl * 4                  # bytes of x
Y = Fl * Bl * Hl * 4                  # bytes of y
forms = {
    # LN: read x, write h | tanh: read h, write t | stack: read t, write s | linear: read s, write y | relu: y
    "split_stack (per slice)":   2 * X + 2 * X + 2 * X + (X + Y) + 2 * Y,
    "combined (horizontal)":     2 * X + 2 * X + (X + Y) + 2 * Y,
    "fused kernel (vertical)":   X + Y,
}
for name, nbytes in forms.items():
    print(f"{name:<26} {nbytes / 2**20:>8,.0f} MiB  = {nbytes / X:4.1f} x bytes(x)")"""),
    ("md", """\
recfuse's op is that vertical fusion: `recfuse.ln_tanh_linear_relu` reads the [B, F*D] buffer in
place as [B, F, D], with no copy, and on a GPU runs the whole chain as one Triton kernel. A CPU has
no launch overhead worth fusing away, so there it runs the batched composite (the `combined` form):
the ops listed below are that composite's, not the GPU kernel's."""),
    ("code", """\
with torch.no_grad():
    y_op = recfuse.ln_tanh_linear_relu(x.view(B, F, D), linear.weight, linear.bias,
                                       eps=0.0, feature_dim=1)          # [B, F, H]
print(f"recfuse op vs float64: {rel_err(y_op.transpose(0, 1), ref):.1e}")
ops = top_level_ops(lambda: recfuse.ln_tanh_linear_relu(
    x.view(B, F, D), linear.weight, linear.bias, eps=0.0, feature_dim=1))
print(f"CPU ops: {len(ops)}:", ", ".join(ops))"""),
    ("md", """\
## 4. `recfuse.explain` and `recfuse.transform`

Nobody wants to rewrite their model by hand. `recfuse.explain` captures a module's graph and says
which split -> per-slice chain -> stack patterns it found and how it would rewrite them;
`recfuse.transform` does the rewrite and returns a `GraphModule` with the same parameters (the
original state-dict keys still load). We give both the puzzler's per-slice module, `SplitStack`,
and example inputs to trace with."""),
    ("code", """\
model = SplitStack(D, H)
model.linear.load_state_dict(linear.state_dict())     # the same weights as above
example_inputs = (x, B, D)
report = recfuse.explain(model, example_inputs)
print(report)""", [NEEDS_TRANSFORM]),
    ("md", """\
`verify=True` runs the original module and the rewritten one on the example inputs and raises
`recfuse.RecfuseError` if they disagree, so a wrong rewrite never leaves `transform`."""),
    ("code", """\
fused = recfuse.transform(model, example_inputs, verify=True)
with torch.no_grad():
    y_fused = fused(x, B, D)
print(f"transform(SplitStack) vs float64: {rel_err(y_fused, ref):.1e}")
print(f"ops per call: split_stack {len(top_level_ops(lambda: model(x, B, D)))}, "
      f"transformed {len(top_level_ops(lambda: fused(x, B, D)))}")
print(getattr(fused, "code", fused))""", [NEEDS_TRANSFORM]),
    ("md", """\
## 5. Results on a GPU

The benchmark runs every form side by side in one process (eager, `torch.compile`, Inductor's
batch fusion, CUDA-graph replay, `recfuse.transform`, `FusedFeatureProcessor`, the bare op) and
writes a JSON; `benchmarks/render_results.py` turns it into the chart and the README table. The
newest committed results, if any:"""),
    ("code", """\
import tempfile

from IPython.display import Image, Markdown, display

# The repository root: the notebook runs from notebooks/ (Jupyter, the test) or from the root.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "benchmarks" / "render_results.py").is_file()), None)
latest = None
if ROOT is not None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import render_results
    latest = render_results.newest_results(ROOT / "benchmarks" / "results")
if latest is None:
    print("No committed GPU results yet. Produce them with:\\n"
          "  python benchmarks/split_stack_vs_combined.py --backward "
          "--json benchmarks/results/<gpu>_<date>.json --plot benchmarks/results/<gpu>_<date>.png")
else:
    results = render_results.load(latest)
    print(f"{latest.relative_to(ROOT)}")
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "results.png"
        render_results.plot_results(results, chart)
        display(Image(filename=str(chart)))
    display(Markdown(render_results.markdown(results)))"""),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, spec in enumerate(CELLS):
        kind, source, tags = (*spec, []) if len(spec) == 2 else spec
        cell = new_markdown_cell(source) if kind == "md" else new_code_cell(source)
        cell.id = f"cell-{i:02d}"   # stable ids: rebuilding an unchanged notebook changes nothing
        if tags:
            cell.metadata["tags"] = list(tags)
        nb.cells.append(cell)
    return nb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the notebook on disk is stale")
    p.add_argument("--execute", action="store_true", help="execute and keep outputs")
    p.add_argument("--out", type=Path, default=NOTEBOOK)
    args = p.parse_args(argv)
    nb = build()
    text = nbformat.writes(nb) + "\n"
    if args.check:
        stale = not args.out.exists() or args.out.read_text() != text
        print(f"{args.out} is {'stale: run python notebooks/build_puzzler.py' if stale else 'up to date'}")
        return 1 if stale else 0
    if args.execute:
        from nbclient import NotebookClient

        # Errors are kept as outputs (so a reader sees them) and listed here, not raised.
        NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(args.out.parent)}}).execute()
        for i, cell in enumerate(nb.cells):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    print(f"cell {i}: {out['ename']}: {out['evalue']}", file=sys.stderr)
        text = nbformat.writes(nb) + "\n"
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
