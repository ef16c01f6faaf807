"""Learning-rate schedules: each one's rates against MXNet 1.9's formulas written out here
(warmup included), SGD driven by them on a real dist_sync server and on the 'local' store,
kv.set_learning_rate keeping states and counts, and schedules kept by the states file."""
import json
import math
import subprocess
import sys

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv import lr_scheduler
from tensorkv.wire import states_file, states_wire
from tensorkv.optimizer import SGD, Adam, Updater
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import CALL, WORKER_TIMEOUT, WORKERS, Cluster, check_workers, one_worker_store

ROUNDS = 14


def factor_lr(n):
    if n < 4:
        return 0.1 + (0.4 - 0.1) * n / 4
    return max(0.4 * 0.5 ** ((n - 1) // 3), 0.03)


def multifactor_lr(n):
    if n < 2:
        return 0.2  # constant warmup
    return 0.4 * 0.5 ** sum(n > s for s in (3, 6, 9))


def poly_lr(n):
    if n < 2:
        return 0.0 + (0.4 - 0.0) * n / 2
    return 0.01 + (0.4 - 0.01) * (1 - (min(n, 10) - 2) / 8) ** 2


def cosine_lr(n):
    if n < 3:
        return 0.1 + (0.4 - 0.1) * n / 3
    return 0.01 + (0.4 - 0.01) * (1 + math.cos(math.pi * (min(n, 10) - 3) / 7)) / 2


SCHEDULES = {
    "factor": ({"step": 3, "factor": 0.5, "stop_factor_lr": 0.03, "base_lr": 0.4, "warmup_steps": 4,
                "warmup_begin_lr": 0.1, "warmup_mode": "linear"}, factor_lr),
    "multifactor": ({"step": [3, 6, 9], "factor": 0.5, "base_lr": 0.4, "warmup_steps": 2, "warmup_begin_lr": 0.2,
                     "warmup_mode": "constant"}, multifactor_lr),
    "poly": ({"max_update": 10, "base_lr": 0.4, "pwr": 2, "final_lr": 0.01, "warmup_steps": 2}, poly_lr),
    "cosine": ({"max_update": 10, "base_lr": 0.4, "final_lr": 0.01, "warmup_steps": 3, "warmup_begin_lr": 0.1},
               cosine_lr),
}


def schedule(name):
    return lr_scheduler.create(name, **SCHEDULES[name][0])


@pytest.mark.parametrize("name", SCHEDULES)
def test_rates_follow_mxnet_formulas_with_warmup(name):
    formula = SCHEDULES[name][1]
    assert [schedule(name)(n) for n in range(ROUNDS + 1)] == pytest.approx(
        [formula(n) for n in range(ROUNDS + 1)], rel=1e-12, abs=0)


def test_classes_take_mxnet_arguments():
    assert lr_scheduler.FactorScheduler(step=3, factor=0.5, stop_factor_lr=0.03, base_lr=0.4, warmup_steps=4,
                                        warmup_begin_lr=0.1, warmup_mode="linear") == schedule("factor")
    assert lr_scheduler.MultiFactorScheduler([3, 6, 9], 0.5, 0.4, 2, 0.2, "constant") == schedule("multifactor")
    assert lr_scheduler.PolyScheduler(10, 0.4, 2, 0.01, 2) == schedule("poly")
    assert lr_scheduler.CosineScheduler(10, 0.4, 0.01, 3, 0.1) == schedule("cosine")


def test_optimizer_learning_rate_replaces_base_lr_as_in_mxnet():
    # Factor and MultiFactor decay from the optimizer's learning_rate; warmup still ends at the
    # schedule's base_lr; Poly and Cosine keep their own; no learning_rate takes the schedule's.
    adam = Adam(learning_rate=0.8, lr_scheduler=schedule("factor"))
    assert [adam.learning_rate_at(n) for n in (3, 4, 7)] == [factor_lr(3), 0.4, 0.2]
    assert SGD(lr_scheduler=schedule("poly")).learning_rate == 0.4
    assert SGD(learning_rate=5.0, lr_scheduler=schedule("poly")).learning_rate_at(6) == schedule("poly")(6)


@pytest.mark.parametrize("kind", ["local", "dist_sync"])
def test_the_optimizer_sets_the_schedules_base_lr_as_mxnet_does(kind, tmp_path):
    """MXNet's Optimizer.__init__ sets lr_scheduler.base_lr = learning_rate: the schedule then
    gives the optimizer's rates when called, and messages show them (they showed the 0.01 it
    was made with). Warmup still ends at, and Poly starts from, the base_lr given (MXNet's
    warmup_final_lr and base_lr_orig), which params keep, so a server rebuilds the same."""
    sched = lr_scheduler.FactorScheduler(step=2, factor=0.5)
    sgd = SGD(learning_rate=0.4, lr_scheduler=sched)
    assert sched.base_lr == 0.4 and [sched(n) for n in (1, 3, 5)] == [0.4, 0.2, 0.1]
    assert sched.params["base_lr"] == 0.01 and "0.01" not in repr(sgd)
    with one_worker_store(kind, tmp_path) as kv:
        kv.set_optimizer(sgd)
        with pytest.raises(tensorkv.FailedPreconditionError) as caught:
            kv.set_learning_rate(1.0)
    assert "base_lr=0.4" in str(caught.value) and "0.01" not in str(caught.value)
    poly = schedule("poly")
    SGD(learning_rate=5.0, lr_scheduler=poly)
    assert (poly.base_lr, poly.warmup_final_lr, poly.base_lr_orig) == (5.0, 0.4, 0.4)
    assert [poly(n) for n in range(ROUNDS)] == [poly_lr(n) for n in range(ROUNDS)]
    assert "base_lr=5.0" in repr(poly) and "warmup_final_lr=0.4" in repr(poly)


@pytest.mark.parametrize("bad, match", [
    (lambda: lr_scheduler.FactorScheduler(step=0), "step=0"),
    (lambda: lr_scheduler.FactorScheduler(step=2, factor=1.5), "factor=1.5"),
    (lambda: lr_scheduler.MultiFactorScheduler(step=[5, 3]), "increasing"),
    (lambda: lr_scheduler.PolyScheduler(max_update=5, warmup_steps=5), "max_update=5"),
    (lambda: lr_scheduler.CosineScheduler(max_update=5, warmup_begin_lr=1.0), "warmup_begin_lr=1"),
    (lambda: lr_scheduler.CosineScheduler(max_update=5, warmup_mode="cubic"), "warmup_mode='cubic'"),
    (lambda: lr_scheduler.create("step", step=2), "unknown lr_scheduler 'step'"),
    (lambda: lr_scheduler.create("poly", max_update=5, power=2), "no parameter power"),
    (lambda: SGD(lr_scheduler="cosine"), "lr_scheduler must be"),
])
def test_bad_schedules_are_refused(bad, match):
    with pytest.raises(tensorkv.InvalidArgumentError, match=match):
        bad()


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_travels_as_data(name):
    message = kvstore_pb2.Optimizer()
    states_wire.set_optimizer(message, SGD(momentum=0.5, lr_scheduler=schedule(name)))
    assert message.lr_scheduler.name == name and "pickle" not in str(message)
    back = states_wire.get_optimizer(kvstore_pb2.Optimizer.FromString(message.SerializeToString()))
    assert back == SGD(momentum=0.5, lr_scheduler=schedule(name))


def sgd_by_hand(name, workers):
    """The values of 'w' and 'b' after each round of tests/workers/lr_schedule_rounds.py:
    MXNet's sgd_mom_update at the rate of the schedule's formula at num_update = the round
    (the largest update count of any key: 'b', updated every second round, uses it too)."""
    rate = SCHEDULES[name][1]
    w, b, mom_w, mom_b, values = np.array([1.0, -2.0, 0.5]), np.array([4.0]), 0.0, 0.0, []
    for t in range(1, ROUNDS + 1):
        mom_w = 0.5 * mom_w - rate(t) * np.array([1.0, 0.5, -2.0]) * sum(rank + t for rank in range(workers))
        w = w + mom_w
        if t % 2 == 0:
            mom_b = 0.5 * mom_b - rate(t) * np.array([sum(1.0 + rank for rank in range(workers))])
            b = b + mom_b
        values.append([w.tolist(), b.tolist()])
    return values


def _args(name):
    return ROUNDS, json.dumps({"name": name, "params": SCHEDULES[name][0]})


def assert_rounds_match(out, expected):
    values = json.loads(out)
    assert len(values) == len(expected) == ROUNDS
    for (w, b), (w_expected, b_expected) in zip(values, expected):
        np.testing.assert_allclose(w, w_expected, rtol=1e-12)
        np.testing.assert_allclose(b, b_expected, rtol=1e-12)


@pytest.mark.parametrize("name", SCHEDULES)
def test_sgd_follows_the_schedule_on_a_server(name, tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        outs = check_workers(cluster.run_workers("lr_schedule_rounds", "dist_sync", *_args(name)))
    for out in outs:
        assert_rounds_match(out, sgd_by_hand(name, 2))


@pytest.mark.parametrize("name", SCHEDULES)
def test_sgd_follows_the_schedule_on_local(name):
    result = subprocess.run([sys.executable, str(WORKERS / "lr_schedule_rounds.py"), "local", *map(str, _args(name))],
                            capture_output=True, text=True, timeout=WORKER_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert_rounds_match(result.stdout, sgd_by_hand(name, 1))


@pytest.fixture(params=["local", "dist_sync"])
def kv(request, tmp_path):
    """A 'local' store, or a dist_sync store whose 4-element keys are sliced over 2 real servers."""
    with one_worker_store(request.param, tmp_path, servers=2, bigarray_bound=2) as store:
        yield store


W0 = np.array([1.0, -2.0, 0.5, 3.0])


def grad(t):
    return np.array([1.0, 0.5, -2.0, 0.25]) * t


def sgd_momentum(rates, weight=W0, momentum=0.5):
    """(weight, mom) after MXNet's sgd_mom_update with grad(t) at rates[t - 1], t = 1, 2, ..."""
    mom = np.zeros_like(weight)
    for t, rate in enumerate(rates, 1):
        mom = momentum * mom - rate * grad(t)
        weight = weight + mom
    return weight, mom


def test_set_learning_rate_keeps_momentum_and_counts(kv, tmp_path):
    kv.init("w", W0)
    kv.set_optimizer(SGD(learning_rate=0.5, momentum=0.5))
    for t in range(1, 4):
        kv.push("w", grad(t))
    kv.set_learning_rate(0.25)
    for t in range(4, 7):
        kv.push("w", grad(t))
    weight, mom = sgd_momentum([0.5] * 3 + [0.25] * 3)
    np.testing.assert_array_equal(kv.pull("w"), weight)
    kv.save_optimizer_states(tmp_path / "states")
    optimizer, states = states_file.load(tmp_path / "states")
    assert optimizer == SGD(learning_rate=0.25, momentum=0.5)
    num_update, (saved_mom,) = states["w"]
    assert num_update == 6
    np.testing.assert_array_equal(saved_mom, mom)


def test_set_optimizer_starts_fresh_states(kv):
    kv.init("w", W0)
    kv.set_optimizer(SGD(learning_rate=0.5, momentum=0.5))
    kv.push("w", grad(1))
    kv.set_optimizer(SGD(learning_rate=0.25, momentum=0.5))
    kv.push("w", grad(2))
    after_one, _ = sgd_momentum([0.5])
    mom = -0.25 * grad(2)  # momentum from zero again
    np.testing.assert_array_equal(kv.pull("w"), after_one + mom)


def test_set_learning_rate_is_refused_with_a_schedule_and_before_an_optimizer(kv):
    kv.init("w", W0)
    with pytest.raises(tensorkv.FailedPreconditionError, match="optimizer"):
        kv.set_learning_rate(0.1)
    kv.set_optimizer(SGD(momentum=0.5, lr_scheduler=schedule("factor")))
    kv.push("w", grad(1))
    with pytest.raises(tensorkv.FailedPreconditionError, match="lr_scheduler"):
        kv.set_learning_rate(0.1)
    kv.push("w", grad(2))  # still on the schedule, momentum kept
    np.testing.assert_array_equal(kv.pull("w"), sgd_momentum([factor_lr(1), factor_lr(2)])[0])


def test_set_learning_rate_refuses_a_rate_that_is_not_finite(kv):
    kv.init("w", W0)
    kv.set_optimizer(SGD(learning_rate=0.5, momentum=0.5))
    kv.push("w", grad(1))
    with pytest.raises(tensorkv.InvalidArgumentError, match="learning_rate=nan"):
        kv.set_learning_rate(float("nan"))
    kv.push("w", grad(2))
    np.testing.assert_array_equal(kv.pull("w"), sgd_momentum([0.5, 0.5])[0])


def test_states_file_keeps_the_schedule_and_its_count(kv, tmp_path):
    kv.init("w", W0)
    kv.set_optimizer(SGD(momentum=0.5, lr_scheduler=schedule("factor")))
    for t in range(1, 6):
        kv.push("w", grad(t))
    kv.save_optimizer_states(tmp_path / "states")
    optimizer, states = states_file.load(tmp_path / "states")
    assert optimizer.lr_scheduler == schedule("factor") and states["w"][0] == 5
    kv.set_optimizer(SGD(learning_rate=0.3))
    kv.load_optimizer_states(tmp_path / "states")
    for t in range(6, 11):
        kv.push("w", grad(t))
    np.testing.assert_array_equal(kv.pull("w"), sgd_momentum([factor_lr(t) for t in range(1, 11)])[0])


def test_updater_counts_num_update_as_the_largest_key_count():
    updater = Updater(SGD(lr_scheduler=schedule("multifactor")))
    weights = {key: np.zeros(1) for key in "abc"}
    for key in "aaab":
        updater(key, np.ones(1), weights[key])
    assert updater.num_update == 3
    updater.set_states({"c": (7, [])})
    assert updater.num_update == 7


def test_set_learning_rate_rpc_without_optimizer_is_failed_precondition(tmp_path):
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                stub.SetLearningRate(kvstore_pb2.SetLearningRateRequest(learning_rate=0.1), timeout=CALL)
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            bad = kvstore_pb2.SetUpdaterRequest()
            states_wire.set_optimizer(bad.optimizer, SGD(lr_scheduler=schedule("poly")))
            bad.optimizer.lr_scheduler.params["max_update"] = 1.5
            with pytest.raises(grpc.RpcError) as error:
                stub.SetUpdater(iter([bad]), timeout=CALL)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_update=1.5" in error.value.details()
