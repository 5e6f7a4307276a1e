"""The Examples in the module package's docstrings run, and can fail.

pytest is not run with --doctest-modules here, so each file's examples are collected and run by
this test; a file whose docstrings hold no example fails too. recfuse/torchrec.py marks its
examples ``+SKIP`` because torchrec is optional; where torchrec is installed they run here.
"""
import doctest
import importlib
import importlib.util

import pytest

MODULES = [
    "recfuse.module",
    "recfuse.module.features",
    "recfuse.module.inputs",
    "recfuse.module.parameters",
    "recfuse.module.plan",
    "recfuse.module.bound",
    "recfuse.module.processor",
    "recfuse.torchrec",
    "recfuse._checks",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(module) if t.examples]
    assert tests, f"{name} has no docstring examples"
    if name == "recfuse.torchrec" and importlib.util.find_spec("torchrec") is not None:
        for test in tests:
            for example in test.examples:
                example.options.pop(doctest.SKIP, None)
    for test in tests:
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples failed in {name}"
