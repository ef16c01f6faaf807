"""MXNet 1.9.1 names a script uses, on the 'local' store and on real servers: set_optimizer
given a name instead of an optimizer, SGD's and Adam's lazy_update, optimizer.get_updater,
Optimizer.num_update and the store type 'dist'."""
import numpy as np
import pytest

import tensorkv
from tensorkv import optimizer
from tensorkv.update.rowsparse import RowSparse

from cluster import Cluster, one_worker_store


@pytest.fixture(params=["local", "dist_sync"])
def kv(request, tmp_path):
    with one_worker_store(request.param, tmp_path) as store:
        yield store


@pytest.mark.parametrize("given, words", [
    ("sgd", "set_optimizer takes an Optimizer object, not the name 'sgd': pass "
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


ROWS = RowSparse(np.ones((1, 3), np.float32), np.array([1]), (2, 3))
DENSE = np.array([[0, 0, 0], [1, 1, 1]], np.float32)


def _pushed(kv, opt, gradient, key):
    kv.set_optimizer(opt)
    kv.init(key, np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    for _ in range(2):
        kv.push(key, gradient)
    return kv.pull(key)


@pytest.mark.parametrize("make", [
    lambda lazy: optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.1, lazy_update=lazy),
    lambda lazy: optimizer.Adam(learning_rate=0.1, wd=0.1, lazy_update=lazy),
    lambda lazy: optimizer.create("sgd", learning_rate=0.1, wd=0.1, lazy_update=lazy),
], ids=["SGD", "Adam", "create"])
def test_lazy_update_false_updates_every_row_on_a_row_sparse_push(kv, make):
    """MXNet's SGD(lazy_update=False) and Adam's: a row-sparse push is the dense gradient it
    stands for (weight decay and momentum reach the rows not pushed); True, the default,
    updates the pushed rows only. The flag travels to a server."""
    lazy, eager, dense = _pushed(kv, make(True), ROWS, "lazy"), _pushed(kv, make(False), ROWS, "eager"), \
        _pushed(kv, make(False), DENSE, "dense")
    np.testing.assert_array_equal(lazy[0], [1, 2, 3])
    np.testing.assert_array_equal(eager, dense)
    assert not np.array_equal(eager[0], [1, 2, 3])
    assert make(False).params["lazy_update"] == 0.0 and "lazy_update" not in make(True).params


def test_lazy_update_leaves_the_other_arguments_where_they_were():
    """lazy_update came after SGD's and Adam's other arguments: SGD(0.1, 0.9, 1e-4) has wd
    1e-4 as before (it took 1e-4 for lazy_update, a true value, and dropped the weight decay)."""
    sgd = optimizer.SGD(0.1, 0.9, 1e-4, 0.5)
    assert (sgd.learning_rate, sgd.momentum, sgd.wd, sgd.rescale_grad, sgd.lazy_update) == (0.1, 0.9, 1e-4, 0.5, True)
    adam = optimizer.Adam(0.01, 0.8, 0.99, 1e-6, 1e-4)
    assert (adam.epsilon, adam.wd, adam.lazy_update) == (1e-6, 1e-4, True)
    lars = optimizer.LARS(0.1, 0.9, False, 0.002)  # LARS has taken lazy_update third all along
    assert (lars.momentum, lars.lazy_update, lars.eta, lars.wd) == (0.9, False, 0.002, 0.0)
    assert optimizer.SGD(lazy_update=False).lazy_update is False


def test_nag_takes_no_lazy_update_as_in_mxnet():
    with pytest.raises(TypeError):
        optimizer.NAG(lazy_update=False)


def test_get_updater_updates_as_the_store_does_and_counts_in_num_update():
    """mx.optimizer.get_updater(opt): updater(key, grad, weight), or lists of each; the
    optimizer's num_update is the largest count of any key, as after a 'local' store's pushes."""
    sgd = optimizer.SGD(learning_rate=0.5, momentum=0.9)
    updater = optimizer.get_updater(sgd)
    w, b = np.ones(3, np.float32), np.ones(2, np.float32)
    updater(["w", "b"], [np.full(3, 2, np.float32), np.ones(2, np.float32)], [w, b])
    updater("w", np.full(3, 2, np.float32), w)
    assert sgd.num_update == 2
    stored = optimizer.SGD(learning_rate=0.5, momentum=0.9)
    with tensorkv.create("local") as kv:
        kv.set_optimizer(stored)
        kv.init(["w", "b"], [np.ones(3, np.float32), np.ones(2, np.float32)])
        kv.push(["w", "b"], [np.full(3, 2, np.float32), np.ones(2, np.float32)])
        kv.push("w", np.full(3, 2, np.float32))
        np.testing.assert_array_equal(kv.pull("w"), w)
        np.testing.assert_array_equal(kv.pull("b"), b)
    assert stored.num_update == 2


def test_an_updater_given_lists_of_other_lengths_updates_nothing():
    """updater(keys, grads, weights) with fewer gradients than keys updated the first keys and
    skipped the rest without a word (zip); MXNet's raises. Refused, nothing updated."""
    sgd = optimizer.SGD(learning_rate=0.5)
    updater = optimizer.get_updater(sgd)
    w, b = np.ones(3, np.float32), np.ones(2, np.float32)
    with pytest.raises(tensorkv.InvalidArgumentError, match="a list of 2 keys takes a list of as many gradients and "
                                                            "one of as many weights, got a list of 1 and a list of 2"):
        updater(["w", "b"], [np.ones(3, np.float32)], [w, b])
    with pytest.raises(tensorkv.InvalidArgumentError, match="got a list of 2 and a ndarray"):
        updater(["w", "b"], [np.ones(3, np.float32), np.ones(2, np.float32)], w)
    assert w.tolist() == [1, 1, 1] and b.tolist() == [1, 1] and sgd.num_update == 0


def test_num_update_of_an_optimizer_sent_to_a_server_stays_as_in_mxnet(tmp_path):
    """A dist store's server updates with its own copy (MXNet pickles it): the worker's object
    keeps num_update 0, and set_learning_rate keeps a local store's count."""
    sgd = optimizer.SGD(learning_rate=0.1)
    assert sgd.num_update == 0
    with one_worker_store("dist_sync", tmp_path) as kv:
        kv.set_optimizer(sgd)
        kv.init(0, np.ones(2, np.float32))
        kv.push(0, np.ones(2, np.float32))
    assert sgd.num_update == 0
    with tensorkv.create("local") as kv:
        kv.set_optimizer(sgd)
        kv.init(0, np.ones(2, np.float32))
        kv.push(0, np.ones(2, np.float32))
        kv.set_learning_rate(0.2)
        kv.push(0, np.ones(2, np.float32))
    assert sgd.num_update == 1  # the store updates with a copy at the new rate from then on


def test_dist_is_mxnets_name_of_dist_sync(tmp_path):
    """MXNet runs a store named 'dist' as dist_sync (async only with '_async' in the name)."""
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist", servers=cluster.addresses) as kv:
            assert (kv.type, kv.rank, kv.num_workers) == ("dist", 0, 1)
            kv.init("w", np.ones(2, np.float32))
            kv.push("w", [np.ones(2, np.float32)] * 2)
            np.testing.assert_array_equal(kv.pull("w"), [2, 2])
    (tmp_path / "async").mkdir()
    with Cluster(num_workers=1, mode="async", tmp_path=tmp_path / "async") as cluster:
        with pytest.raises(tensorkv.FailedPreconditionError, match="runs in async mode; a 'dist_sync' store"):
            tensorkv.create("dist", servers=cluster.addresses)
