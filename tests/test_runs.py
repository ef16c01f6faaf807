"""Runs on a long-lived server: what a new run does with the keys of an earlier one
(if_exists), Reset, and ranks that rejoin a run going on. One server per test; the runs'
workers are processes (tests/workers/sgd_run.py)."""
import json

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.tools.ctl import Server
from tensorkv.transport.security import Security
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import CALL, STOP_TIMEOUT, Cluster, check_workers, rank_1_after_a_round
from test_ctl import ctl, ctl_json

ROUNDS = 3
BASE = np.array([1, -1, 2, 0.5])


def _sgd(rounds, workers=2, lr=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5):
    """What sgd_run.py's keys hold after the rounds t of ``rounds``: MXNet's sgd_mom_update
    once per round on the sum of the workers' gradients, from fresh states."""
    weights = []
    for i in range(3):
        weight, mom = np.arange(4.0) + 10 * i, 0.0
        for t in rounds:
            grad = sum((i + 1) * BASE * (rank + t) for rank in range(workers))
            mom = momentum * mom - lr * (rescale_grad * grad + wd * weight)
            weight = weight + mom
        weights.append(weight)
    return weights


def _run(cluster, kind="int", if_exists=None):
    """A run of sgd_run.py on ``cluster``: each worker's printed result."""
    env = {"TENSORKV_IF_EXISTS": if_exists} if if_exists else None
    return [json.loads(out) for out in check_workers(cluster.run_workers("sgd_run", kind, ROUNDS, env=env))]


def _weights(results):
    """The weights every worker of a run printed (the same on all)."""
    assert all(result == results[0] for result in results), results
    return np.array(results[0]["weights"], np.float32)


def _info(cluster):
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL)


def _stored(cluster, keys):
    """The values of ``keys`` on the server, read by a run of its own that resumes them."""
    with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, if_exists="resume") as kv:
        return np.array(kv.pull(keys))


def test_fail_refuses_the_keys_of_an_earlier_run_and_changes_nothing(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        first = _weights(_run(cluster))
        np.testing.assert_allclose(first, _sgd(range(1, ROUNDS + 1)), rtol=1e-5)
        for result in _run(cluster):  # if_exists='fail' by default
            assert result["error"] == "KeyExistsError"
            assert result["message"] == (
                "key 0 (and 2 more keys) holds what an earlier run left on this server (3 rounds applied to it): "
                "pass if_exists='resume' to continue from it, or if_exists='replace' to start afresh (a script "
                "that does not pass it: set TENSORKV_IF_EXISTS)")
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0) as kv:
            with pytest.raises(tensorkv.KeyTypeError, match="the keys on this server are those an earlier run "
                                                            "left; pass if_exists='replace' to start afresh"):
                kv.init("w", np.zeros(4, np.float32))
        assert _info(cluster).num_keys == 3
        np.testing.assert_array_equal(_stored(cluster, [0, 1, 2]), first)


def test_fail_refuses_to_train_with_an_earlier_runs_optimizer(tmp_path):
    """A run with if_exists='fail' and keys of its own is not updated by the optimizer an
    earlier run installed (it once was, silently): its init is refused, and changes nothing,
    also when it sets the same optimizer first (the earlier run's schedule would go on)."""
    def sgd():  # the learning rate halves at every update after the first
        return tensorkv.optimizer.SGD(learning_rate=0.1,
                                      lr_scheduler=tensorkv.lr_scheduler.FactorScheduler(step=1, factor=0.5))

    def first_update(key, if_exists="fail", optimizer=None):
        """What ``key`` holds after a push of 5 in a run of its own."""
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists=if_exists) as kv:
            if optimizer is not None:
                kv.set_optimizer(optimizer)
            kv.init(key, np.zeros(3, np.float32))
            kv.push(key, np.full(3, 5.0, np.float32))
            return kv.pull(key)

    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("a", np.zeros(3, np.float32))
            kv.set_optimizer(sgd())
            for _ in range(3):
                kv.push("a", np.ones(3, np.float32))
        with pytest.raises(tensorkv.KeyExistsError) as refused:
            first_update("b")
        assert str(refused.value).endswith(
            "this server holds the optimizer 'sgd' that an earlier run installed, which would update this run's "
            "keys: pass if_exists='resume' to train with it, or if_exists='replace' to start afresh (a script that "
            "does not pass it: set TENSORKV_IF_EXISTS)")
        with pytest.raises(tensorkv.KeyExistsError, match="holds the optimizer 'sgd' that an earlier run installed"):
            first_update("c", optimizer=sgd())
        assert _info(cluster).num_keys == 1
        # resumed, the schedule goes on from a's three updates: a quarter of the rate
        np.testing.assert_allclose(first_update("d", "resume"), [-0.125] * 3)
        np.testing.assert_allclose(first_update("e", "replace"), [5.0] * 3)  # no optimizer: assigned


def test_resume_continues_from_the_values_and_states_of_the_earlier_run(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        _run(cluster, "str")
        weights = _weights(_run(cluster, "str", if_exists="resume"))
    # the momentum goes on too: six rounds in a row, from A's states
    np.testing.assert_allclose(weights, _sgd([*range(1, ROUNDS + 1), *range(1, ROUNDS + 1)]), rtol=1e-5)


@pytest.mark.parametrize("second_kind", ["int", "str"])
def test_replace_gives_exactly_a_fresh_servers_result(tmp_path, second_kind):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        fresh = _weights(_run(cluster, "int"))
        replaced = _weights(_run(cluster, second_kind, if_exists="replace"))
        assert _info(cluster).num_keys == 3  # the first run's keys are gone, whatever their type
    np.testing.assert_array_equal(replaced, fresh)


def test_reset_is_refused_during_a_run_and_exact_after(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        fresh = _weights(_run(cluster, "int"))
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, if_exists="resume"):
            with pytest.raises(tensorkv.FailedPreconditionError,
                               match=r"cannot reset while run 2 is registered \(ranks \[1\]\)"):
                tensorkv.reset(cluster.addresses)
            info = _info(cluster)
            assert (info.num_keys, info.optimizer, info.run, info.if_exists) == (
                3, "sgd", 2, kvstore_pb2.IF_EXISTS_RESUME)
        assert tensorkv.reset(cluster.addresses) == 3
        info = _info(cluster)
        assert (info.num_keys, info.optimizer, list(info.registered_ranks)) == (0, "", [])
        after = _weights(_run(cluster, "str"))  # the default 'fail', and str keys where int keys were
    np.testing.assert_array_equal(after, fresh)


def _killed_with_its_server(cluster, env):
    """A job's only worker (tests/workers/job_step.py, with ``env``) makes 'w' -1, the server
    (with --state-dir) takes a snapshot, and both are killed with -9 (a node that reboots); the
    server is started again, from the snapshot."""
    worker = cluster.start_worker("job_step", "hold", env=env)
    try:
        assert json.loads(worker.stdout.readline()) == [-1.0] * 4
        assert worker.stdout.readline() == "holding\n"
        Server(cluster.addresses[0], Security(), 10.0).kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
    finally:
        worker.kill()  # by its pid
        worker.wait(STOP_TIMEOUT)
    cluster.restart()


@pytest.mark.parametrize("forced_by", ["cli", "python"])
def test_reset_is_refused_while_a_restored_run_can_come_back(tmp_path, forced_by):
    """Issue 31: a server restored from a snapshot of a running job (no rank registered yet)
    accepted a reset, which dropped the job's keys: its worker then rejoined the run and found
    none. Refused, through the CLI and tensorkv.reset, unless forced."""
    server_args = ("--state-dir", str(tmp_path / "state"), "--snapshot-interval", "0")
    with Cluster(num_workers=1, tmp_path=tmp_path, server_args=server_args) as cluster:
        _killed_with_its_server(cluster, {"TENSORKV_JOB": "train-7"})  # run 1 of job 'train-7' can come back
        refusal = ("cannot reset: run 1 (job 'train-7') was going on in the snapshot this server restored, and its "
                   "workers may still register again and go on with its keys, which a reset would drop: reset once "
                   "that job is over, or force it (`tensorkv reset --force`, tensorkv.reset(force=True))")
        with pytest.raises(tensorkv.FailedPreconditionError) as refused:
            tensorkv.reset(cluster.addresses)
        assert str(refused.value) == refusal
        code, out, err = ctl("reset", servers=cluster.addresses)
        assert code != 0 and err == f"tensorkv: server {cluster.addresses[0]}: {refusal}\n", (code, out, err)
        [row] = ctl_json("get", "w", "--values", servers=cluster.addresses)
        assert row["values"] == [-1.0] * 4  # the job's key is intact
        if forced_by == "cli":
            assert ctl_json("reset", "--force", servers=cluster.addresses) == [
                {"server": cluster.addresses[0], "keys_dropped": 1}]
        else:
            assert tensorkv.reset(cluster.addresses, force=True) == 1
        assert _info(cluster).num_keys == 0
        assert tensorkv.reset(cluster.addresses) == 0  # the restored run is gone with its keys


def test_workers_of_one_run_ask_for_the_same_if_exists(tmp_path, monkeypatch):
    with pytest.raises(tensorkv.InvalidArgumentError, match="unknown if_exists 'keep'; use one of "
                                                            "'fail', 'resume', 'replace'"):
        tensorkv.create("dist_sync", servers="127.0.0.1:1", if_exists="keep")
    monkeypatch.setenv("TENSORKV_IF_EXISTS", "Replace")
    with pytest.raises(tensorkv.InvalidArgumentError, match="unknown TENSORKV_IF_EXISTS 'Replace'"):
        tensorkv.create("dist_sync", servers="127.0.0.1:1")
    monkeypatch.setenv("TENSORKV_IF_EXISTS", "replace")
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0):  # 'replace', from the environment
            with pytest.raises(tensorkv.FailedPreconditionError,
                               match=r"this worker asks for if_exists='resume', but run 1 on this server \(ranks "
                                     r"\[0\] registered\) started with if_exists='replace'"):
                tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="resume")
        assert list(_info(cluster).registered_ranks) == []


def test_a_rank_that_rejoins_a_run_going_on_is_not_a_new_run(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        kv1 = rank_1_after_a_round(address)
        try:
            with tensorkv.create("dist_sync", servers=address, rank=0) as kv0:  # rank 1 stayed: the same run
                kv0.init("w", np.full(4, 9, np.float32))  # the stored value stays
                np.testing.assert_array_equal(kv0.pull("w"), [3.0] * 4)
                assert _info(cluster).run == 1
                kv0.push("w", np.ones(4, np.float32))  # a round that rank 1 never completes
        finally:
            kv1.close()
        # every rank left: the next registration starts run 2, and the incomplete round's
        # push was discarded with the run that made it
        with tensorkv.create("dist_sync", servers=address, rank=0, if_exists="resume") as kv0, \
                tensorkv.create("dist_sync", servers=address, rank=1, if_exists="resume") as kv1:
            assert _info(cluster).run == 2
            for kv in (kv0, kv1):
                kv.push("w", np.full(4, 10.0 * (kv.rank + 1), np.float32))
            for kv in (kv0, kv1):
                np.testing.assert_array_equal(kv.pull("w"), [30.0] * 4)


@pytest.mark.parametrize("job, expected", [("train-7", [-2.0] * 4), ("another-job", [-1.0] * 4)],
                         ids=["same-job", "another-job"])
def test_a_worker_of_the_job_restarted_with_its_server_rejoins_the_restored_run(tmp_path, job, expected):
    """A 'replace' job's only worker and its server are killed with -9 together (a node that
    reboots); the server restarts from its snapshot. The job's worker, started again with
    'replace', rejoins the restored run (TENSORKV_JOB names the job) and goes on from the
    restored value; a worker of another job starts a new run that drops it, as 'replace' asks."""
    server_args = ("--state-dir", str(tmp_path / "state"), "--snapshot-interval", "0")
    env = {"TENSORKV_IF_EXISTS": "replace", "TENSORKV_JOB": "train-7"}
    with Cluster(num_workers=1, tmp_path=tmp_path, server_args=server_args) as cluster:
        _killed_with_its_server(cluster, env)
        [out] = check_workers(cluster.run_workers("job_step", env={**env, "TENSORKV_JOB": job}))
    assert json.loads(out) == expected



def test_a_worker_of_another_job_is_refused_naming_the_server_and_what_to_do(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, job="a"):
        with pytest.raises(tensorkv.FailedPreconditionError,
                           match=rf"^server {cluster.addresses[0]} refused this worker: this worker is of job 'b', "
                                 r"but run 1 on this server \(ranks \[0\] registered\) belongs to job 'a': a server "
                                 r"serves one job at a time; wait until that job ends"):
            tensorkv.create("dist_sync", servers=cluster.addresses, job="b")
