"""Shared test set-up: interpreter-marked tests run only in a process started with
TRITON_INTERPRET=1 (`make test-interpret`), because Triton reads that variable when it compiles."""
import os

import pytest
import torch

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
