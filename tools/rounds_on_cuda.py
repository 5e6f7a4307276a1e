"""pytest plugin: run the interpreter-marked red-team rounds 25, 26 and 28 on CUDA.

Those tests build their inputs on the CPU for Triton's interpreter (`test_trust_round25._inputs`),
and tests/conftest.py skips every ``interpret`` test outside ``TRITON_INTERPRET=1``. On a GPU this
plugin makes ``_inputs`` return CUDA tensors and drops that skip, so the same checks run the
compiled kernels: the interpreter converts bf16 by truncation, and the twenty-eighth session found
a silent wrong gradient only the GPU's rounding shows (tests/test_trust_round27.py).

Round 27's own CUDA tests need no plugin. Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=$PWD:$PWD/tools:$PWD/tests pytest -p rounds_on_cuda tests/test_trust_round25.py tests/test_trust_round26.py \
        tests/test_trust_round28.py
"""
import sys

import pytest

_MODULES = ("test_trust_round25", "test_trust_round26", "test_trust_round28")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    base = sys.modules["test_trust_round25"]._inputs
    if not getattr(base, "on_cuda", False):
        def cuda_inputs(*args, **kwargs):
            return [t.cuda() for t in base(*args, **kwargs)]

        cuda_inputs.on_cuda = True
        for name in _MODULES:
            if name in sys.modules:
                sys.modules[name]._inputs = cuda_inputs
    for item in items:
        if item.module.__name__ in _MODULES:
            item.own_markers = [m for m in item.own_markers if m.name != "skip"]
