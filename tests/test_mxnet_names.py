"""MXNet 1.9.1 names a script uses, on the 'local' store and on real servers: set_optimizer
given a name instead of an optimizer, SGD's and Adam's lazy_update, optimizer.get_updater,
Optimizer.num_update and the store type 'dist'."""
import numpy as np
import pytest

import tensorkv
from tensorkv import optimizer
from tensorkv.rowsparse import RowSparse

from cluster import Cluster, one_worker_store


@pytest.fixture(params=["local", "dist_sync"])
def kv(request, tmp_path):
    with one_worker_store(request.param, tmp_path) as store:
        yield store


@pytest.mark.parametrize("given, words", [
    ("sgd", "set_optimizer takes an optimizer object, not the name 'sgd': pass "
            "tensorkv.optimizer.create('sgd', learning_rate=...) (as MXNet's mx.optimizer.create) or "
            "tensorkv.optimizer.SGD(...)"),
    ("Adam", "tensorkv.optimizer.create('Adam', learning_rate=...) (as MXNet's mx.optimizer.create) or "
             "tensorkv.optimizer.Adam(...)"),
    ("lbsgd", "not a name, and 'lbsgd' names no optimizer: pass tensorkv.optimizer.create(name, "
              "learning_rate=...) with a name of sgd, nag, adam"),
    ({"learning_rate": 0.1}, "set_optimizer takes a tensorkv.optimizer.Optimizer, got builtins.dict: make one with "
                             "tensorkv.optimizer.create(name, learning_rate=...)"),
])
def test_set_optimizer_given_a_name_says_how_to_make_an_optimizer(kv, given, words):
    """MXNet needs an Optimizer object; a name raised AttributeError on a dist store. The
    store is left as it was: a push still assigns."""
    kv.init("w", np.ones(3, np.float32))
    with pytest.raises(tensorkv.InvalidArgumentError) as caught:
        kv.set_optimizer(given)
    assert words in str(caught.value)
    kv.push("w", np.full(3, 5, np.float32))
    np.testing.assert_array_equal(kv.pull("w"), np.full(3, 5, np.float32))
