"""The examples in the docstrings of recfuse.fx run, and can fail."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import recfuse.fx

MODULES = ["recfuse.fx"] + sorted(m.name for m in pkgutil.walk_packages(recfuse.fx.__path__, "recfuse.fx."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
