"""Execute notebooks/puzzler.ipynb top to bottom on the CPU, in a kernel running this venv's python.

Any cell error fails the test, with one temporary exception: while recfuse has no `transform` /
`explain` yet, errors in the cells tagged `needs-transform` (and only there) turn the test into an
xfail that lists them. Once both exist, the notebook is executed with errors not allowed at all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import recfuse

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "puzzler.ipynb"
BUILDER = ROOT / "notebooks" / "build_puzzler.py"
NEEDS_TRANSFORM = "needs-transform"
HAS_TRANSFORM = hasattr(recfuse, "transform") and hasattr(recfuse, "explain")


@pytest.fixture
def venv_kernel(tmp_path, monkeypatch) -> str:
    """A `python3` kernelspec that runs sys.executable, placed first on JUPYTER_PATH so that no
    system-wide python3 kernel (another interpreter, without recfuse) is picked instead."""
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (recfuse venv)", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    paths = [str(tmp_path)] + [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(paths))
    return "python3"


def _error_cells(nb) -> list[tuple[int, nbformat.NotebookNode]]:
    return [(i, cell) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and any(out.get("output_type") == "error" for out in cell.get("outputs", []))]


def _describe(i: int, cell) -> str:
    err = next(out for out in cell.outputs if out.get("output_type") == "error")
    return f"cell {i} ({cell.source.splitlines()[0]!r}): {err.ename}: {err.evalue}"


def test_notebook_runs_top_to_bottom(venv_kernel):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=180, kernel_name=venv_kernel, allow_errors=not HAS_TRANSFORM,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()   # with allow_errors=False a failing cell raises CellExecutionError here
    failed = _error_cells(nb)
    unexpected = [(i, c) for i, c in failed if NEEDS_TRANSFORM not in c.metadata.get("tags", [])]
    assert not unexpected, "\n".join(_describe(i, c) for i, c in unexpected)
    if failed:
        pytest.xfail("recfuse.transform/explain not written yet: "
                     + "; ".join(_describe(i, c) for i, c in failed))


def test_notebook_is_built_from_its_builder():
    proc = subprocess.run([sys.executable, str(BUILDER), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
