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
# "i/n": this process runs the i-th of n round-robin shards of the selected tests (tools/run_tests.sh
# splits the interpreter suite over concurrent processes this way; every test lands in one shard).
SHARD = os.environ.get("RECFUSE_TEST_SHARD", "")


def interpreter_unusable() -> str:
    """Why Triton's interpreter cannot run these kernels with the installed packages, or "".

    Triton 3.6's interpreter turns runtime integer arguments (loop bounds such as H) into Python
    ints with ``int()`` of a one-element array, which numpy 2.4 refuses ("only 0-dimensional
    arrays can be converted to Python scalars"): every kernel fails there (the GPU image has
    triton 3.6; with numpy 2.3.5 its interpreter passes test_kernels.py). Triton 3.9 converts
    them itself."""
    import numpy as np
    import triton

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 8):
        return ""
    try:
        int(np.array([1]))
    except TypeError:
        return (f"triton {triton.__version__}'s interpreter cannot run with numpy {np.__version__} "
                "(int() of a one-element array): install numpy<2.4 or triton>=3.8")
    return ""


def pytest_collection_modifyitems(config, items):
    if INTERPRET:
        unusable = interpreter_unusable()
        if unusable:
            skip = pytest.mark.skip(reason=unusable)
            for item in items:
                if "interpret" in item.keywords:
                    item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (run `make test-interpret`)")
    for item in items:
        if "interpret" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class _Shard:
    """RECFUSE_TEST_SHARD="i/n": keep every n-th selected test from the i-th (0-based)."""

    def __init__(self, spec: str):
        try:
            self.index, self.count = (int(v) for v in spec.split("/"))
        except ValueError:
            raise pytest.UsageError(f"RECFUSE_TEST_SHARD must be 'i/n', got {spec!r}") from None
        if not 0 <= self.index < self.count:
            raise pytest.UsageError(f"RECFUSE_TEST_SHARD={spec!r}: need 0 <= i < n")

    @pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected: the shards split what runs
    def pytest_collection_modifyitems(self, config, items):
        dropped = [item for k, item in enumerate(items) if k % self.count != self.index]
        items[:] = items[self.index::self.count]
        if dropped:
            config.hook.pytest_deselected(items=dropped)


def pytest_configure(config):
    if SHARD:
        config.pluginmanager.register(_Shard(SHARD), "recfuse-test-shard")
