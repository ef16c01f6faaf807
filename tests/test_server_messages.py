"""What the server says when a worker is refused or a round cannot complete: the rank, the run,
the lease, the setting to fix (issue 32, from a new user's first week)."""
import subprocess
import sys

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import WORKER_TIMEOUT, Cluster, free_port, stop, wait_until
from test_metrics import scrape


def _log(cluster):
    cluster.logs[0].flush()
    return open(cluster.logs[0].name).read()


def test_an_aborted_round_blames_no_worker_of_an_earlier_run(tmp_path):
    """Rank 1 of run 1 closed its store; in run 2 it never registered: the abort said 'rank 1
    left N s before (its worker closed its store)', about run 1's worker."""
    with Cluster(num_workers=2, round_timeout=2, tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        with tensorkv.create("dist_sync", servers=address, rank=0) as kv0, \
                tensorkv.create("dist_sync", servers=address, rank=1) as kv1:
            for kv in (kv0, kv1):
                kv.init("w", np.zeros(4, np.float32))
        with tensorkv.create("dist_sync", servers=address, rank=0, if_exists="resume") as kv0:  # run 2
            with pytest.raises(tensorkv.RoundAbortedError) as aborted:
                kv0.pushpull("w", np.ones(4, np.float32))
            with pytest.raises(tensorkv.RoundAbortedError) as barrier:
                kv0.barrier()
    for error in (aborted.value, barrier.value):
        assert str(error).endswith("missing ranks [1] (ranks [0] pushed; their pushes were discarded); rank 1 has "
                                   "not registered in run 2") or str(error).endswith(
            "missing ranks [1]; rank 1 has not registered in run 2"), error
        assert "left" not in str(error)


def test_every_rank_taken_says_which_lease_holds_it_and_when_it_expires(tmp_path):
    """A script that ends without closing its store (as MXNet scripts do), run again at once:
    the second was told 'every rank is taken', with no word of the first one's lease."""
    with Cluster(tmp_path=tmp_path, server_args=["--lease-timeout", "30"]) as cluster:
        ended = subprocess.run(
            [sys.executable, "-c", "import os, tensorkv; tensorkv.create('dist_sync'); os._exit(0)"],
            env=cluster.env, capture_output=True, text=True, timeout=WORKER_TIMEOUT)
        assert ended.returncode == 0, ended.stderr
        with pytest.raises(tensorkv.FailedPreconditionError) as refused:
            tensorkv.create("dist_sync", servers=cluster.addresses)
    message = str(refused.value)
    assert "every rank is taken: this server expects 1 worker (rank 0); their leases hold them: rank 0 by " \
           "incarnation " in message
    assert "its lease expires in " in message and "--lease-timeout 30 s after it was last heard from" in message
    assert "an MXNet script does not" in message


def test_a_worker_that_closes_its_store_mid_round_is_logged_at_once(tmp_path):
    """Rank 1 pushed; rank 0 closes its store without pushing: the server logged nothing until
    the round aborted, a whole --round-timeout later."""
    port = free_port()
    with Cluster(num_workers=2, round_timeout=60, tmp_path=tmp_path,
                 server_args=["--metrics-port", str(port)]) as cluster:
        address = cluster.addresses[0]
        kv1 = tensorkv.create("dist_sync", servers=address, rank=1)
        try:
            with tensorkv.create("dist_sync", servers=address, rank=0) as kv0:
                for kv in (kv0, kv1):
                    kv.init("w", np.zeros(4, np.float32))
                kv1.push("w", np.ones(4, np.float32))
                wait_until(lambda: scrape(port)[1][("tensorkv_pushes_total", ())] == 1, "rank 1's push on the server")
            wait_until(lambda: "rank 0 left (its worker closed its store) while the rounds of 1 key ['w'] waited "
                               "for it: they abort 60 s after they began (--round-timeout) unless a worker takes "
                               "rank 0 again" in _log(cluster), "the log line of rank 0's leaving")
        finally:
            kv1.close()


def test_a_call_without_an_incarnation_is_told_to_send_it(tmp_path):
    """A client written from the protos before incarnations sends none (0): it was told that 'the
    rank was registered again since this caller registered'."""
    with Cluster(tmp_path=tmp_path) as cluster, grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        registered = stub.Register(kvstore_pb2.RegisterRequest(), timeout=10)
        assert registered.incarnation
        with pytest.raises(grpc.RpcError) as refused:
            stub.Barrier(kvstore_pb2.BarrierRequest(rank=registered.rank), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == (
        "rank 0: this call carries no incarnation: every call of a registered worker must send the "
        "RegisterResponse.incarnation of its registration")


@pytest.mark.parametrize("bounds", [(None, 10), (10, None)], ids=["second-splits", "first-splits"])
def test_a_worker_that_splits_values_otherwise_than_the_run_is_refused_at_once_naming_the_setting(tmp_path, bounds):
    """Workers with different TENSORKV_BIGARRAY_BOUND: one split a 40-element value over the two
    servers and the other kept it whole; one was told 'initialized shape (40,) does not match the
    stored shape (40,)' and the other waited a round timeout (or, the other way round, the
    splitting one did). The second worker's registration is now refused, naming the setting
    and both bounds, before it calls anything."""
    first, second = bounds
    with Cluster(servers=2, num_workers=2, round_timeout=300, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, bigarray_bound=first) as kv:
            with pytest.raises(tensorkv.FailedPreconditionError) as refused:
                tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, bigarray_bound=second)
            kv.init("w", np.zeros(40, np.float32))  # the run goes on for its own worker
    theirs, ours = first or 1_000_000, second or 1_000_000
    assert f"this worker slices values of more than {ours} elements over the servers, but the workers of run 1 " \
           f"(ranks [0] registered) slice those of more than {theirs}: give every worker of a job the same " \
           "TENSORKV_BIGARRAY_BOUND (bigarray_bound=)" in str(refused.value), str(refused.value)

