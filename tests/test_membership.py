"""Membership: a call counts only when it comes from the registration it names (rank and
incarnation). Real server processes on 127.0.0.1; the callers that must be refused use
the raw generated stub and a raw Session stream, as an old worker would keep calling."""
import re

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.transport.session import RawSession as Session
from tensorkv.wire.status import status_code
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc, tensor_pb2

from cluster import CALL, Cluster, wait_until

REFUSED = 100.0  # what every refused push carries: a round that merged one would show it


def _entry(key, value):
    return tensor_pb2.Entry(key=tensor_pb2.Key(str_key=key), tensor=tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT32, shape=value.shape, data=value.tobytes()))


def _session_call(session, **fields):
    """The SessionResponse to one SessionRequest with ``fields`` on a raw Session stream."""
    def build(call_id, timeout_ms, region, channel):
        return kvstore_pb2.SessionRequest(id=call_id, timeout_ms=timeout_ms, **fields).SerializeToString(), ()
    _, data = session.call(build, CALL)
    return kvstore_pb2.SessionResponse.FromString(data)


def _calls(address, rank, incarnation):
    """{name: call} for every call that names a rank, made as ``rank`` with ``incarnation``
    on the raw stub and on a raw Session stream; and the channel and session to close."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub, session = kvstore_pb2_grpc.KVStoreServiceStub(channel), Session(channel, address)
    who = dict(rank=rank, incarnation=incarnation)
    frame = tensor_pb2.TensorFrame(entries=[_entry("w", np.full(4, REFUSED, np.float32))])
    keys = [tensor_pb2.Key(str_key="w")]
    calls = {
        "Init": lambda: stub.Init(iter([kvstore_pb2.InitRequest(frame=frame, **who)]), timeout=CALL),
        "Push": lambda: stub.Push(iter([kvstore_pb2.PushRequest(frame=frame, **who)]), timeout=CALL),
        "Pull": lambda: list(stub.Pull(kvstore_pb2.PullRequest(keys=keys, **who), timeout=CALL)),
        "PushPull": lambda: list(stub.PushPull(iter([kvstore_pb2.PushPullRequest(frame=frame, **who)]), timeout=CALL)),
        "Barrier": lambda: stub.Barrier(kvstore_pb2.BarrierRequest(**who), timeout=CALL),
        "Unregister": lambda: stub.Unregister(kvstore_pb2.UnregisterRequest(**who), timeout=CALL),
    }
    for op in ("PUSH", "PULL", "PUSH_PULL", "INIT"):
        calls[f"Session {op}"] = lambda op=op: _session_call(
            session, op=kvstore_pb2.SessionOp.Value(f"SESSION_OP_{op}"), frame=frame,
            keys=keys if op == "PULL" else (), **who)
    return calls, channel, session


def _refusal(call):
    """(status code name, message, error class) of ``call``, which must fail."""
    try:
        answer = call()
    except grpc.RpcError as error:
        return error.code().name, error.details(), dict(error.trailing_metadata()).get("tensorkv-error")
    assert isinstance(answer, kvstore_pb2.SessionResponse) and answer.code, f"not refused: {answer}"
    return status_code(answer.code).name, answer.message, answer.error_class


def _assert_all_refused(address, rank, incarnation, words):
    calls, channel, session = _calls(address, rank, incarnation)
    try:
        for name, call in calls.items():
            code, message, error_class = _refusal(call)
            assert (code, error_class) == ("FAILED_PRECONDITION", "FailedPreconditionError"), (name, message)
            assert words in message, (name, message)
    finally:
        session.close()
        channel.close()


def _info(address):
    with grpc.insecure_channel(address) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL)


def _round(stores, key="w"):
    """Each store pushes rank + 1 into ``key`` (one sync round); the value after it."""
    for kv in stores:
        kv.push(key, np.full(4, kv.rank + 1.0, np.float32))
    return [kv.pull(key) for kv in stores]


def test_calls_from_a_rank_that_never_registered_are_refused(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        with tensorkv.create("dist_sync", servers=address, rank=0) as kv0:
            kv0.init("w", np.zeros(4, np.float32))
            _assert_all_refused(address, 1, 0, "rank 1 is not registered on this server (it restarted, or the "
                                               "rank was given back): create the store again to register")
            _assert_all_refused(address, 0, 0, "rank 0: this call carries no incarnation: every call of a registered "
                                               "worker must send the RegisterResponse.incarnation of its registration")
            assert list(_info(address).registered_ranks) == [0]
            with tensorkv.create("dist_sync", servers=address, rank=1) as kv1:
                kv1.init("w", np.zeros(4, np.float32))
                for value in _round([kv0, kv1]):
                    np.testing.assert_array_equal(value, [3.0] * 4)  # 1 + 2: no refused push merged


def test_a_stale_incarnation_is_refused_and_cannot_give_the_rank_back(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        with grpc.insecure_channel(address) as channel:
            stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
            old = stub.Register(kvstore_pb2.RegisterRequest(rank=1), timeout=CALL).incarnation
            stub.Unregister(kvstore_pb2.UnregisterRequest(rank=1, incarnation=old), timeout=CALL)
        with tensorkv.create("dist_sync", servers=address, rank=0) as kv0, \
                tensorkv.create("dist_sync", servers=address, rank=1) as kv1:
            current = kv1._registered[0]
            assert current > old
            kv0.init("w", np.zeros(4, np.float32))
            kv1.init("w", np.zeros(4, np.float32))
            _assert_all_refused(address, 1, old, f"rank 1 is held by incarnation {current}, "
                                                 f"not by this call's incarnation {old}")
            assert list(_info(address).registered_ranks) == [0, 1]  # the stale Unregister freed nothing
            for value in _round([kv0, kv1]):
                np.testing.assert_array_equal(value, [3.0] * 4)


def test_after_a_server_restart_an_old_workers_push_is_refused(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        old = tensorkv.create("dist_sync", servers=address, rank=0, timeout=10)
        try:
            old.init("w", np.zeros(4, np.float32))
            cluster.restart()
            with tensorkv.create("dist_sync", servers=address, rank=0) as kv0, \
                    tensorkv.create("dist_sync", servers=address, rank=1) as kv1:
                kv0.init("w", np.zeros(4, np.float32))
                kv1.init("w", np.zeros(4, np.float32))
                refusals = []

                def old_push_refused():  # the old worker's connection comes back after the restart
                    try:
                        old.push("w", np.full(4, REFUSED, np.float32))
                    except tensorkv.ServerUnavailableError:
                        return False
                    except tensorkv.FailedPreconditionError as error:
                        refusals.append(str(error))
                        return True
                    raise AssertionError("the old worker's push was accepted")
                wait_until(old_push_refused, "the old worker's push refused")
                # from the push itself, or from a heartbeat that reached the new server before kv0 registered
                # or from registering again after seeing the server restart (tensorkv.transport.server_conn)
                assert f"rank 0 is held by incarnation {kv0._registered[0]}" in refusals[0] \
                    or "rank 0 is not registered on this server (it restarted" in refusals[0] \
                    or "registering rank 0 again (it restarted) was refused: rank 0 is already taken" in refusals[0], \
                    refusals[0]
                for value in _round([kv0, kv1]):
                    np.testing.assert_array_equal(value, [3.0] * 4)  # only the new workers' gradients
                old.close()  # its Unregister is refused: the new rank 0 keeps its rank
                assert list(_info(address).registered_ranks) == [0, 1]
        finally:
            old.close()


def test_a_register_sent_again_with_its_request_id_gets_the_same_registration(tmp_path):
    """A Register whose answer a reset lost is sent again with the same request_id (as
    tensorkv.transport.server_conn does): the server answers the registration it made, not "rank taken",
    and a rank it assigned is not assigned twice; another request_id is refused as before."""
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster, \
            grpc.insecure_channel(cluster.addresses[0], options=CHANNEL_OPTIONS) as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)

        def register(**fields):
            return stub.Register(kvstore_pb2.RegisterRequest(**fields), timeout=CALL)
        first = register(rank=1, request_id=7)
        again = register(rank=1, request_id=7)
        assert (again.rank, again.incarnation) == (first.rank, first.incarnation)
        assigned = register(request_id=8)  # the server picks rank 0
        assert assigned.rank == 0
        again = register(request_id=8)
        assert (again.rank, again.incarnation) == (0, assigned.incarnation)
        with pytest.raises(grpc.RpcError) as refused:
            register(rank=1, request_id=9)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert re.fullmatch(r"rank 1 is already taken by another worker \(incarnation \d+, last heard from \d+\.\d s "
                            r"ago\): if it is gone, its lease expires 10 s after it was last heard from "
                            r"\(--lease-timeout\), and the rank is free then", refused.value.details())
        assert list(_info(cluster.addresses[0]).registered_ranks) == [0, 1]


def test_a_restored_run_goes_on_with_its_workers_and_within_a_lease_with_new_ones(monkeypatch):
    """The run a snapshot was taken in goes on after a restart (Membership.restore_run): with
    a worker naming its previous incarnation at any time; with a new worker within a lease of
    the restart, and after that only once one of its workers is back."""
    import asyncio
    import types

    from tensorkv_server import membership

    now = [100.0]
    monkeypatch.setattr(membership, "time", types.SimpleNamespace(monotonic=lambda: now[0], time_ns=lambda: 0))

    def restored():
        members = membership.Membership(num_workers=2, lease_timeout=10.0)
        members.restore_run(membership.Run(7, membership.FAIL), going=True)
        members.restore_sequences([{"rank": 1, "incarnation": 55, "through": 3, "beyond": []}])
        return members

    async def registrations():
        members = restored()
        now[0] += 9.0  # within a lease: a new worker joins run 7
        assert members.register(0)[2] is False and members.run.number == 7
        members = restored()
        now[0] += 11.0  # past it: a new worker starts run 8 ...
        assert members.register(0)[2] is True and members.run.number == 8
        members = restored()
        now[0] += 60.0  # ... but a worker of run 7 naming its incarnation goes on in it
        assert members.register(1, previous=55)[2] is False and members.run.number == 7
        assert members.register(0)[2] is False and members.run.number == 7
        members = restored()  # a worker of the run is back, whatever it asks for now (replace comes back as resume)
        assert members.register(1, if_exists=membership.RESUME, previous=55)[2] is False and members.run.number == 7
        members = restored()  # a new worker asking for another if_exists: a job started again, a new run
        assert members.register(0, if_exists=membership.RESUME)[2] is True and members.run.number == 8
        members = membership.Membership(num_workers=2, lease_timeout=10.0)  # a 'replace' run ...
        members.restore_run(membership.Run(7, membership.REPLACE), going=True)
        # ... is not joined by a new worker asking for 'replace' too: a job that starts over (its init
        # would have kept the dead job's values, a helper's probe saw)
        assert members.register(0, if_exists=membership.REPLACE)[2] is True and members.run.number == 8
        members = membership.Membership(num_workers=2)
        members.restore_run(membership.Run(7, membership.FAIL), going=True)
        members.restore_sequences([{"rank": 0, "incarnation": 44, "through": 1, "beyond": []}])
        assert members.run_going_on and not members.running  # a snapshot now saves it as going on
        assert members.register()[0] == 1  # a new worker without a rank: not one whose worker may come back
        unfinished = membership.Membership(num_workers=2)
        unfinished.restore_run(membership.Run(7, membership.FAIL), going=False)  # no rank was registered
        assert unfinished.register(0)[2] is True and unfinished.run.number == 8

    asyncio.run(registrations())


def test_a_job_named_by_its_workers_decides_who_joins_a_run(monkeypatch):
    """Where the run and the registration both name a job (RegisterRequest.job), the job decides
    instead of if_exists: a worker of the run's job joins the restored run whatever it asks for
    ('replace' included: a worker process restarted with the server); one of another job is
    refused while the run has ranks, and otherwise starts a new run; one without a job (or a run
    without one) follows if_exists as before."""
    import asyncio
    import types

    from tensorkv_server import membership

    now = [100.0]
    monkeypatch.setattr(membership, "time", types.SimpleNamespace(monotonic=lambda: now[0], time_ns=lambda: 0))

    def restored(job="train-7"):
        members = membership.Membership(num_workers=2, lease_timeout=10.0)
        members.restore_run(membership.Run(7, membership.REPLACE, job), going=True)
        return members

    async def registrations():
        members = restored()
        assert members.register(0, if_exists=membership.REPLACE, job="train-7")[2] is False
        assert members.run.number == 7 and members.run.job == "train-7"
        with pytest.raises(tensorkv.FailedPreconditionError,
                           match=r"this worker is of job 'other', but run 7 on this server \(ranks \[0\] registered\) "
                                 r"belongs to job 'train-7': a server serves one job at a time; wait until that job "
                                 r"ends \(`tensorkv workers` lists its ranks\), use other servers, or, if this worker "
                                 r"is meant to be of job 'train-7', set TENSORKV_JOB \(or job=\) to it"):
            members.register(1, if_exists=membership.REPLACE, job="other")
        assert members.register(1, if_exists=membership.FAIL, job="train-7")[2] is False  # the job, not if_exists
        members = restored()
        started = members.register(0, if_exists=membership.RESUME, job="other")
        assert started[2] is True and members.run.number == 8 and members.run.job == "other"
        members = restored()
        now[0] += 600.0  # long past a lease of the restart: the job's worker still joins its run
        assert members.register(0, if_exists=membership.REPLACE, job="train-7")[2] is False
        members = restored()
        assert members.register(0, if_exists=membership.REPLACE)[2] is True  # no job named: as before
        members = restored(job="")
        assert members.register(0, if_exists=membership.REPLACE, job="train-7")[2] is True  # nor by the run
        # Once another run replaced the restored one, a worker of the restored run that comes back
        # is not given the numbers saved for it (they would skip its pushes to the new run's keys)
        members = restored()
        members.restore_sequences([{"rank": 1, "incarnation": 55, "through": 5, "beyond": []}])
        assert members.register(0, if_exists=membership.REPLACE, job="another")[2] is True
        members.unregister(0, members.incarnations[0])
        assert members.register(1, if_exists=membership.RESUME, previous=55, job="another")[2] is True
        assert 5 not in members._applied.get(1, ())

    asyncio.run(registrations())
