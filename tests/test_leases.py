"""Worker leases (issue 11 item 1): a worker that dies or goes silent loses its rank within
--lease-timeout, a replacement takes it and the job goes on with exact sums; a worker
paused past its lease is refused when it wakes up; a live worker keeps its rank while it
is idle and while it waits in a sync pull. Real server and worker processes on 127.0.0.1
(tests/workers/driven.py, one command per stdin line); each worker pushes rank + 1, so the
value after round n is exactly 3 n."""
import os
import signal
import sys
import threading
import time

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc
from tensorkv_server.__main__ import parse_args

from cluster import CALL, STOP_TIMEOUT, WAIT, Cluster, DrivenWorker as Worker, free_port, stop, wait_until
from faultproxy import FaultProxy
from test_metrics import scrape

def _info(cluster):
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL)


def _holders(cluster):
    """{rank: incarnation} of the registered ranks."""
    return {worker.rank: worker.incarnation for worker in _info(cluster).workers}


def _round(workers, number):
    """Each worker pushes its rank + 1, then pulls: the value after round ``number``."""
    for rank, worker in enumerate(workers):
        worker.call(f"push {rank + 1}", "pushed")
    for worker in workers:
        assert worker.call("pull") == f"value {3 * number}"


def _pause_and_replace(cluster, workers, paused):
    """SIGSTOP ``paused``, rank 1's worker, until its lease expires, and start a replacement
    (added to ``workers``): (the paused one's incarnation, the replacement, its incarnation)."""
    old = _holders(cluster)[1]
    os.kill(paused.process.pid, signal.SIGSTOP)
    wait_until(lambda: 1 not in _holders(cluster), "rank 1 freed")
    workers.append(Worker(cluster, 1))
    return old, workers[-1], _holders(cluster)[1]


def _push_on_waking(worker, then=lambda answer: None):
    """Send 'push 100' to the paused ``worker`` and wake it: the FailedPreconditionError line
    that its push, or its next pull, answers (a push sent without waiting for its answer
    raises the refusal in the next call); ``then(the push's answer)`` runs in between."""
    worker.send("push 100")
    os.kill(worker.process.pid, signal.SIGCONT)
    refusal = worker.expect()
    then(refusal)
    if refusal == "pushed":
        refusal = worker.call("pull")
    assert refusal.startswith("error FailedPreconditionError: "), refusal
    return refusal


def _assert(condition, message):
    assert condition, message


@pytest.fixture
def workers():
    started = []
    yield started
    for worker in started:
        worker.stop()


@pytest.mark.parametrize("pushed", [False, True], ids=["before-its-push", "after-its-push"])
def test_a_killed_workers_rank_is_freed_and_its_replacement_completes_the_round(tmp_path, workers, pushed):
    lease = 2.0
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--lease-timeout", str(lease))) as cluster:
        workers += [Worker(cluster, 0), Worker(cluster, 1)]
        survivor, lost = workers
        _round(workers, 1)
        _round(workers, 2)
        if pushed:  # round 3 holds rank 1's push: its replacement must not push into it again
            lost.call("push 2", "pushed")
        else:  # the survivor waits in round 3 for rank 1
            survivor.call("push 1", "pushed")
            survivor.send("pull")
        old = _holders(cluster)[1]
        os.kill(lost.process.pid, signal.SIGKILL)
        lost.process.wait(STOP_TIMEOUT)
        wait_until(lambda: 1 not in _holders(cluster), "rank 1 freed", timeout=lease + WAIT)
        info = _info(cluster)
        assert list(info.registered_ranks) == [0] and info.expired_leases == 1 and info.lease_ttl_ms == 2000
        with open(tmp_path / "server0.log") as log:
            assert f"lease of rank 1 (incarnation {old}) expired after 2 s: rank freed" in log.read()

        workers.append(Worker(cluster, 1))
        replacement = workers[-1]
        assert _holders(cluster)[1] > old
        if pushed:
            replacement.send("push 2")  # waits for round 3, then joins round 4
            survivor.call("push 1", "pushed")
            assert survivor.call("pull") == "value 9"
            replacement.expect("pushed")
            survivor.call("push 1", "pushed")
            assert survivor.call("pull") == replacement.call("pull") == "value 12"
        else:
            replacement.call("push 2", "pushed")  # completes round 3
            assert survivor.expect() == "value 9"
            assert replacement.call("pull") == "value 9"
            _round([survivor, replacement], 4)
        assert survivor.close() == 0 and replacement.close() == 0


def test_a_worker_paused_past_its_lease_is_refused_when_it_wakes(tmp_path, workers):
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--lease-timeout", "1")) as cluster:
        workers += [Worker(cluster, 0), Worker(cluster, 1)]
        survivor, zombie = workers
        _round(workers, 1)
        old, replacement, new = _pause_and_replace(cluster, workers, zombie)
        refusal = _push_on_waking(zombie)
        assert f"incarnation {old} expired" in refusal and f"held by incarnation {new}" in refusal, refusal
        assert "create the store again" in refusal, refusal

        _round([survivor, replacement], 2)  # 6: the zombie's 100 merged nowhere
        assert zombie.call("pull").startswith("error FailedPreconditionError: ")
        assert zombie.close() == 0  # its Unregister is refused: the replacement keeps the rank
        assert _holders(cluster) == {0: _holders(cluster)[0], 1: new}
        _round([survivor, replacement], 3)
        assert survivor.close() == 0 and replacement.close() == 0


def test_a_worker_that_slept_through_its_lease_and_its_replacements_stays_out(tmp_path, workers):
    """Issue 31: rank 1's worker slept past its lease, a replacement took the rank, ran rounds and
    was killed -9, its lease expired too; the sleeper woke on a broken connection, registered
    again naming its incarnation (no longer the rank's last expired one) and got the rank
    afresh: its push, computed on old weights, was merged. Every incarnation older than the
    rank's last is refused."""
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--lease-timeout", "1")) as cluster, \
            FaultProxy(cluster.addresses[0]) as proxy:
        survivor = Worker(cluster, 0)
        workers.append(survivor)
        workers.append(Worker(cluster, 1, env={"TENSORKV_SERVERS": proxy.address}))
        sleeper = workers[-1]
        _round([survivor, sleeper], 1)
        old, replacement, new = _pause_and_replace(cluster, workers, sleeper)
        _round([survivor, replacement], 2)
        _round([survivor, replacement], 3)
        os.kill(replacement.process.pid, signal.SIGKILL)
        replacement.process.wait(STOP_TIMEOUT)
        wait_until(lambda: 1 not in _holders(cluster), "the replacement's rank 1 freed")
        proxy.reset()  # the sleeper's stream is gone when it wakes: it connects and registers again
        refusal = _push_on_waking(sleeper, lambda answer: _assert(
            1 not in _holders(cluster), f"the sleeper registered rank 1 again ({answer})"))
        assert f"rank 1: this call's incarnation {old} is over: incarnation {new} registered the rank after it " \
               "and left" in refusal, refusal
        assert "create the store again to register as a new worker" in refusal, refusal
        assert sleeper.call("pull").startswith("error FailedPreconditionError: ")
        assert 1 not in _holders(cluster)

        workers.append(Worker(cluster, 1))  # a new worker takes rank 1: nothing of the sleeper's was merged
        _round([survivor, workers[-1]], 4)
        assert sleeper.close() == 0
        assert survivor.close() == 0 and workers[-1].close() == 0


def test_a_live_worker_keeps_its_rank_while_idle_and_while_it_waits(tmp_path, workers):
    lease = 1.0
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--lease-timeout", str(lease))) as cluster:
        workers += [Worker(cluster, 0), Worker(cluster, 1)]
        first, second = workers
        holders = _holders(cluster)
        _round(workers, 1)
        time.sleep(3 * lease)  # both idle between calls
        assert _holders(cluster) == holders
        first.call("push 1", "pushed")
        first.send("pull")  # waits for rank 1's push
        time.sleep(3 * lease)
        assert _holders(cluster) == holders
        second.call("push 2", "pushed")
        assert first.expect() == "value 6"
        assert second.call("pull") == "value 6"
        info = _info(cluster)
        assert info.expired_leases == 0
        assert all(worker.ms_since_renewal < 1000 * lease for worker in info.workers)
        assert first.close() == 0 and second.close() == 0
        assert list(_info(cluster).registered_ranks) == []


def test_workers_keep_their_ranks_when_the_server_was_paused_longer_than_the_lease(tmp_path, workers):
    lease = 1.0
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--lease-timeout", str(lease))) as cluster:
        workers += [Worker(cluster, 0), Worker(cluster, 1)]
        holders = _holders(cluster)
        _round(workers, 1)
        server = cluster.processes[0]
        os.kill(server.pid, signal.SIGSTOP)  # as a host that pauses: no heartbeat is read meanwhile
        try:
            time.sleep(3 * lease)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        time.sleep(lease)  # the renewals sent meanwhile, and the next ones, reach it
        assert _holders(cluster) == holders and _info(cluster).expired_leases == 0
        _round(workers, 2)
        assert workers[0].close() == 0 and workers[1].close() == 0


def test_when_every_rank_lost_its_lease_the_run_ends(tmp_path, workers):
    port = free_port()
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--lease-timeout", "1", "--metrics-port", str(port))) \
            as cluster:
        workers += [Worker(cluster, 0), Worker(cluster, 1)]
        workers[0].call("push 1", "pushed")  # a round that only rank 0 pushed to
        for worker in workers:
            os.kill(worker.process.pid, signal.SIGKILL)
            worker.process.wait(STOP_TIMEOUT)
        wait_until(lambda: not _holders(cluster), "every rank freed")
        assert _info(cluster).expired_leases == 2
        assert scrape(port)[1][("tensorkv_expired_leases_total", ())] == 2
        with open(tmp_path / "server0.log") as log:
            text = log.read()
        assert "run 1 ended: every rank left or lost its lease" in text
        assert "key 'w': round 1 aborted: every rank of run 1 left or lost its lease" in text

        resume = {"TENSORKV_IF_EXISTS": "resume"}
        workers += [Worker(cluster, 0, resume), Worker(cluster, 1, resume)]
        assert _info(cluster).run == 2
        _round(workers[2:], 1)  # 3: the pending push of run 1 was discarded with its round
        assert workers[2].close() == 0 and workers[3].close() == 0


def _heartbeats():
    return [thread for thread in threading.enumerate() if thread.name == "tensorkv-heartbeat"]


def test_one_heartbeat_thread_per_store_over_every_server_ended_by_close(tmp_path):
    with Cluster(servers=2, num_workers=1, tmp_path=tmp_path, server_args=("--lease-timeout", "1")) as cluster:
        before = len(_heartbeats())
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0) as kv:
            assert len(_heartbeats()) == before + 1
            kv.init("w", np.zeros(4, np.float32))
            time.sleep(2.0)  # two leases of idleness, on both servers
            kv.push("w", np.ones(4, np.float32))
            np.testing.assert_array_equal(kv.pull("w"), np.ones(4, np.float32))
        assert len(_heartbeats()) == before


@pytest.mark.parametrize("seconds", ["0", "-1", "1e9"])
def test_lease_timeout_out_of_range_is_refused(seconds, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--lease-timeout", seconds])
    assert "--lease-timeout must be positive" in capsys.readouterr().err
