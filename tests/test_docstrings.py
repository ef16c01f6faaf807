"""The examples in the modules' docstrings run and print what they show."""
import doctest

import pytest

import tensorkv
from tensorkv.update import compression, engine, kernels, rowsparse
from tensorkv import config, env, lr_scheduler, optimizer
from tensorkv.stores import kvstore, local, trainer
from tensorkv.wire import states_file
from tensorkv.optimizer import adagrad, adam, dcasgd, ftrl, registry, rmsprop, sgd, updater
from tensorkv.optimizer import optimizer as optimizer_base


MODULES = [tensorkv, kvstore, compression, config, engine, env, kernels, local, lr_scheduler, optimizer, optimizer_base, sgd, adam, adagrad, rmsprop,
           ftrl, dcasgd, registry, updater, rowsparse, states_file, trainer]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
