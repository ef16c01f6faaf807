"""The examples in the modules' docstrings run and print what they show."""
import doctest

import pytest

from tensorkv import compression, engine, env, kernels, local, lr_scheduler, optimizer, rowsparse, states_file, trainer


@pytest.mark.parametrize("module", [compression, engine, env, kernels, local, lr_scheduler, optimizer, rowsparse, states_file, trainer], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
