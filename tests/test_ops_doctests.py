"""The docstring examples of the op's config, launch-plan and argument-check modules run and hold."""
import doctest

import pytest

import recfuse._checks
import recfuse.chain
import recfuse.ops._compiled_launch
import recfuse.ops.autotune
import recfuse.ops.configs
import recfuse.ops.launch
import recfuse.ops.tuning


@pytest.mark.parametrize("module", [recfuse.ops.configs, recfuse.ops.launch, recfuse.ops._compiled_launch,
                                    recfuse.ops.tuning, recfuse.ops.autotune,
                                    recfuse._checks, recfuse.chain], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0
