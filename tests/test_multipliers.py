"""Per-key learning-rate and weight-decay multipliers (MXNet's Optimizer.set_lr_mult and
set_wd_mult): MXNet 1.9.1's numbers on the embedded store and on real servers (a key sliced
over two), and the multipliers kept wherever the optimizer travels: the wire, the states
file, a server's snapshot, kv.set_learning_rate."""
import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv import optimizer
from tensorkv.wire import states_file, states_wire
from tensorkv.tools.ctl import Server
from tensorkv.optimizer import SGD, Adam, Updater
from tensorkv.transport.security import Security
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import Cluster, one_worker_store

# MXNet 1.9.1, mx.kv.create('local'): SGD(learning_rate=0.1, momentum=0.9, wd=0.01) with
# set_lr_mult({k0: 0.5, k2: 0.0}) and set_wd_mult({k0: 0.0, k1: 2.0}); each key starts at 2 and
# gets 3 pushes of [0.5, -1.25, 3.0] * step + i (step 1..3, i its position), float32. The same
# bits for int keys (3, 5, 7) and str keys ('a', 'b', 'c').
SGD_EXPECTED = [
    ["0x1.c322d2p+0", "0x1.4c147cp+1", "0x1.25a1c8p-1"],
    ["0x1.e2a168p-1", "0x1.4d6cp+1", "-0x1.6e9524p+0"],
    ["0x1p+1", "0x1p+1", "0x1p+1"],  # lr_mult 0: frozen
]
# Adam(learning_rate=0.01, wd=0.1), set_lr_mult({1: 3.0}), set_wd_mult({2: 0.0}); keys 1 and 2
# start at 1 and get 4 pushes of [0.25 * step, -1] (step 1..4).
ADAM_EXPECTED = {1: ["0x1.c39f34p-1", "0x1.1eb6dcp+0"], 2: ["0x1.ec1daap-1", "0x1.0a3d78p+0"]}


def _floats(hexes):
    return np.array([float.fromhex(h) for h in hexes], np.float32)


def _sgd(keys):
    opt = SGD(learning_rate=0.1, momentum=0.9, wd=0.01)
    opt.set_lr_mult({keys[0]: 0.5, keys[2]: 0.0})
    opt.set_wd_mult({keys[0]: 0.0, keys[1]: 2.0})
    return opt


def _train_sgd(kv, keys):
    kv.set_optimizer(_sgd(keys))
    kv.init(keys, [np.full(3, 2, np.float32)] * 3)
    for step in range(1, 4):  # one list push: the updates of the three keys run together
        kv.push(keys, [(np.array([0.5, -1.25, 3.0]) * step + i).astype(np.float32) for i in range(3)])
    return [kv.pull(key) for key in keys]


@pytest.fixture(params=["local", "dist_sync"])
def kv(request, tmp_path):
    """A 'local' store, or a dist_sync store whose 3-element keys are sliced over 2 real servers."""
    with one_worker_store(request.param, tmp_path, servers=2, bigarray_bound=2) as store:
        yield store


@pytest.mark.parametrize("keys", [[3, 5, 7], ["a", "b", "c"]], ids=["int-keys", "str-keys"])
def test_sgd_with_multipliers_gives_mxnets_numbers(kv, keys):
    for value, expected in zip(_train_sgd(kv, keys), SGD_EXPECTED):
        np.testing.assert_array_equal(value, _floats(expected))


def test_adam_with_multipliers_gives_mxnets_numbers(kv):
    opt = Adam(learning_rate=0.01, wd=0.1)
    opt.set_lr_mult({1: 3.0})
    opt.set_wd_mult({2: 0.0})
    kv.set_optimizer(opt)
    for key in (1, 2):
        kv.init(key, np.ones(2, np.float32))
    for step in range(1, 5):
        for key in (1, 2):
            kv.push(key, np.array([0.25 * step, -1.0], np.float32))
    for key, expected in ADAM_EXPECTED.items():
        np.testing.assert_array_equal(kv.pull(key), _floats(expected))


def test_multipliers_survive_set_learning_rate_and_the_states_file(kv, tmp_path):
    keys = ["a", "b", "c"]
    kv.set_optimizer(_sgd(keys))
    kv.init(keys, [np.full(3, 2, np.float32)] * 3)
    kv.set_learning_rate(0.2)
    kv.push(keys, [np.ones(3, np.float32)] * 3)
    np.testing.assert_array_equal(kv.pull("c"), np.full(3, 2, np.float32))  # still frozen
    np.testing.assert_array_equal(kv.pull("a"), np.full(3, 2 - 0.2 * 0.5, np.float32))
    kv.save_optimizer_states(tmp_path / "states")
    optimizer, _ = states_file.load(tmp_path / "states")
    assert optimizer.lr_mult == {"a": 0.5, "c": 0.0} and optimizer.wd_mult == {"a": 0.0, "b": 2.0}
    kv.set_optimizer(SGD(learning_rate=0.2, momentum=0.9, wd=0.01))  # no multipliers
    kv.load_optimizer_states(tmp_path / "states")  # they come back with the file's optimizer
    kv.push("c", np.ones(3, np.float32))
    np.testing.assert_array_equal(kv.pull("c"), np.full(3, 2, np.float32))


def test_a_server_restarted_from_its_snapshot_keeps_the_multipliers(tmp_path):
    keys = [3, 5, 7]
    server_args = ("--state-dir", str(tmp_path / "state"), "--snapshot-interval", "0")
    with Cluster(num_workers=1, tmp_path=tmp_path, server_args=server_args) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
        kv.set_optimizer(_sgd(keys))
        kv.init(keys, [np.full(3, 2, np.float32)] * 3)
        kv.push(keys, [(np.array([0.5, -1.25, 3.0]) + i).astype(np.float32) for i in range(3)])
        kv.pull(keys[0])
        Server(cluster.addresses[0], Security(), 10.0).kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
        cluster.restart()  # SIGKILL; the server starts again from the snapshot
        for step in (2, 3):
            kv.push(keys, [(np.array([0.5, -1.25, 3.0]) * step + i).astype(np.float32) for i in range(3)])
        for key, expected in zip(keys, SGD_EXPECTED):
            np.testing.assert_array_equal(kv.pull(key), _floats(expected))


def test_multipliers_travel_as_data():
    message = kvstore_pb2.Optimizer()
    states_wire.set_optimizer(message, _sgd([3, "b", -1]))
    back = states_wire.get_optimizer(kvstore_pb2.Optimizer.FromString(message.SerializeToString()))
    assert back == _sgd([3, "b", -1]) and back.lr_mult == {3: 0.5, -1: 0.0} and back.wd_mult == {3: 0.0, "b": 2.0}
    assert back != SGD(learning_rate=0.1, momentum=0.9, wd=0.01)


def test_a_server_says_how_many_multipliers_it_installed(tmp_path):
    """SetUpdaterResponse.multipliers: a client reads it to tell a server from before them (which
    installs the optimizer without them and answers 0; the client then raises
    FailedPreconditionError, as it did against the server of 5554f97, run by hand)."""
    message = kvstore_pb2.SetUpdaterRequest()
    states_wire.set_optimizer(message.optimizer, _sgd(["a", "b", "c"]))
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            response = kvstore_pb2_grpc.KVStoreServiceStub(channel).SetUpdater(iter([message]), timeout=10)
    assert response.multipliers == 4


def test_a_key_twice_among_the_multipliers_on_the_wire_is_invalid_argument(tmp_path):
    message = kvstore_pb2.SetUpdaterRequest()
    states_wire.set_optimizer(message.optimizer, SGD(learning_rate=0.1))
    for _ in range(2):
        message.optimizer.lr_mult.add(multiplier=2.0).key.str_key = "w"
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            call = channel.stream_unary("/tensorkv.v1.KVStoreService/SetUpdater",
                                        request_serializer=kvstore_pb2.SetUpdaterRequest.SerializeToString,
                                        response_deserializer=kvstore_pb2.SetUpdaterResponse.FromString)
            with pytest.raises(grpc.RpcError) as raised:
                call(iter([message]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "key 'w' appears twice in the optimizer's lr_mult" in raised.value.details()


@pytest.mark.parametrize("call, error, match", [
    (lambda opt: opt.set_lr_mult({"w": float("nan")}), tensorkv.InvalidArgumentError,
     "lr_mult of key 'w'=nan is not finite"),
    (lambda opt: opt.set_wd_mult({"w": "0"}), tensorkv.InvalidArgumentError, "wd_mult of key 'w'='0' is not a number"),
    (lambda opt: opt.set_lr_mult({1.5: 1.0}), tensorkv.KeyTypeError, "key 1.5 has type float"),
    (lambda opt: opt.set_wd_mult([("w", 0.0)]), tensorkv.InvalidArgumentError, "wd_mult must be a dict"),
])
def test_bad_multipliers_are_refused_and_leave_the_old_ones(call, error, match):
    opt = _sgd(["a", "b", "c"])
    with pytest.raises(error, match=match):
        call(opt)
    assert opt.lr_mult == {"a": 0.5, "c": 0.0} and opt.wd_mult == {"a": 0.0, "b": 2.0}


def test_an_updater_reads_the_multipliers_at_each_update_as_mxnets_local_store_does():
    opt = SGD(learning_rate=0.5)
    updater, weight = Updater(opt), np.zeros(2, np.float32)
    updater("w", np.ones(2, np.float32), weight)
    opt.set_lr_mult({"w": 0.0})
    updater("w", np.ones(2, np.float32), weight)
    np.testing.assert_array_equal(weight, [-0.5, -0.5])


@pytest.mark.parametrize("name", sorted(optimizer.OPTIMIZERS))
def test_every_optimizer_takes_a_keys_multipliers_as_its_own_rate_and_decay(name):
    """A key with lr_mult 2 and wd_mult 0 is updated as by the same optimizer at twice the rate
    and no weight decay, bit for bit; a key without multipliers as by the optimizer itself."""
    opt = optimizer.create(name, learning_rate=0.01, wd=0.1)
    opt.set_lr_mult({"scaled": 2.0})
    opt.set_wd_mult({"scaled": 0.0})
    reference = {"scaled": optimizer.create(name, learning_rate=0.02, wd=0.0),
                 "plain": optimizer.create(name, learning_rate=0.01, wd=0.1)}
    updater = Updater(opt)
    references = {key: Updater(reference[key]) for key in reference}
    weights = {key: np.linspace(-1, 1, 8, dtype=np.float32) for key in reference}
    expected = {key: weight.copy() for key, weight in weights.items()}
    for step in range(1, 4):
        grads = {key: np.linspace(0.5, -0.25, 8, dtype=np.float32) * step for key in reference}
        updater.update_each([(key, grads[key], weights[key]) for key in reference])
        for key in reference:
            references[key](key, grads[key], expected[key])
    for key in reference:
        np.testing.assert_array_equal(weights[key], expected[key])
