"""Shared test set-up: interpreter-marked tests run only in a process started with
TRITON_INTERPRET=1 (`make test-interpret`), because Triton reads that variable when it compiles.

The suite runs the op's CPU path on the eager composite (the library's default, `compiled`, would
compile each parameter variant with Inductor for seconds per test); tests/test_cpu_compiled.py switches the compiled path on
with `recfuse.ops.cpu_backend("compiled")`. Set RECFUSE_CPU_BACKEND=compiled to run everything
compiled (subprocesses the tests start inherit the variable)."""
import os
import tempfile

os.environ.setdefault("RECFUSE_CPU_BACKEND", "eager")
# A tuning cache of the developer's (~/.cache/recfuse) must not change the configs the tests run.
os.environ.setdefault("RECFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="recfuse-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

import recfuse  # noqa: E402

recfuse.ops.set_cpu_backend(os.environ["RECFUSE_CPU_BACKEND"])

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def pytest_collection_modifyitems(config, items):
    if INTERPRET:
        return
    skip = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (run `make test-interpret`)")
    for item in items:
        if "interpret" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
