"""tensorkv servers and workers as real processes on 127.0.0.1 (see cluster.py)."""
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import tensorkv
from tensorkv.wire import states_file
from tensorkv.update.engine import Engine
from tensorkv.transport.server_conn import ServerConn
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc, tensor_pb2

from cluster import (
    CALL, ROOT, STOP_TIMEOUT, WORKER_TIMEOUT, Cluster, check_workers, free_port, health, rank_1_after_a_round, stop,
    wait_until,
)
from tensorkv.wire.allocator import SERVER_TUNABLES
from tensorkv_server.rounds import Coordinator

SERVICE = "tensorkv.v1.KVStoreService"


@pytest.mark.parametrize("workers", [2, 3])
def test_sync_rounds(workers, tmp_path):
    with Cluster(num_workers=workers, tmp_path=tmp_path) as cluster:
        outs = check_workers(cluster.run_workers("sync_rounds", 4))
    assert sorted(outs) == [f"ok {rank}\n" for rank in range(workers)]


def _sgd_momentum(rounds, workers, weight, lr=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5):
    """MXNet's sgd_mom_update, once per round on the sum of the workers' gradients."""
    weight, mom, history = np.array(weight, np.float64), 0.0, []
    base = np.array([1, -1, 2, 0.5])
    for t in range(1, rounds + 1):
        grad = sum(base * (rank + t) for rank in range(workers))
        mom = momentum * mom - lr * (rescale_grad * grad + wd * weight)
        weight = weight + mom
        history.append(weight)
    return history, mom


def test_optimizer_one_step_per_round_on_sliced_keys(tmp_path):
    path = tmp_path / "states.npz"
    with Cluster(servers=2, num_workers=2, tmp_path=tmp_path) as cluster:
        cluster_env = {"TENSORKV_BIGARRAY_BOUND": "2"}  # the 4-element weight is split over both servers
        workers = [cluster.start_worker("sgd_rounds", 3, path, env=cluster_env) for _ in range(2)]
        outs = [w.communicate(timeout=90) for w in workers]
        for worker, (out, err) in zip(workers, outs):
            assert worker.returncode == 0, err
        expected, mom = _sgd_momentum(3, 2, [1, 2, 3, 4])
        for out, _ in outs:
            np.testing.assert_allclose(json.loads(out), expected, rtol=1e-5)
        for address in cluster.addresses:
            with grpc.insecure_channel(address) as channel:
                info = kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL)
                assert info.optimizer == "sgd" and info.num_keys == 1
    optimizer, states = states_file.load(path)
    assert optimizer == tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5)
    num_update, (saved_mom,) = states["w"]
    assert num_update == 3
    np.testing.assert_allclose(saved_mom, mom, rtol=1e-5)


def test_async_applies_each_push(tmp_path):
    with Cluster(num_workers=2, mode="async", tmp_path=tmp_path) as cluster:
        outs = check_workers(cluster.run_workers("async_pushes"))
    assert sorted(outs) == ["ok 0\n", "ok 1\n"]


def test_two_servers_many_keys_and_a_sliced_array(tmp_path):
    with Cluster(servers=2, num_workers=2, tmp_path=tmp_path) as cluster:
        check_workers(cluster.run_workers("big"))
        counts = []
        for address in cluster.addresses:
            with grpc.insecure_channel(address) as channel:
                counts.append(kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(
                    kvstore_pb2.InfoRequest(), timeout=CALL).num_keys)
    # The 200 small keys are spread over both servers; the big one is on each (a slice).
    assert sum(counts) == 202 and min(counts) > 1


def test_a_worker_that_never_pushes_aborts_the_round(tmp_path):
    # abort.py leaves without closing its store: its ranks stay registered for a lease, long here
    with Cluster(num_workers=2, round_timeout=2, tmp_path=tmp_path, server_args=("--lease-timeout", "60")) as cluster:
        results = cluster.run_workers("abort")
        outs = check_workers(results)
        assert health(cluster.addresses[0]) == "SERVING"
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            info = kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL)
            assert info.num_keys == 1 and list(info.registered_ranks) == [0, 1]
    rank0 = next(out for out in outs if out.endswith("ok 0\n"))
    assert "aborted: key 'x': round 1 aborted after 2 s; missing ranks [1]" in rank0
    assert "barrier: barrier 1 aborted after 2 s; missing ranks [1]" in rank0


def test_an_aborted_round_says_where_its_missing_rank_went(tmp_path):
    """A round that waits for a rank whose worker closed its store (a clean exit) says so
    when it aborts, as a barrier does."""
    with Cluster(num_workers=2, round_timeout=1, tmp_path=tmp_path) as cluster:
        with rank_1_after_a_round(cluster.addresses[0]) as kv1:  # rank 0 left after round 1
            with pytest.raises(tensorkv.RoundAbortedError) as aborted:
                kv1.pushpull("w", np.ones(4, np.float32))
            with pytest.raises(tensorkv.RoundAbortedError) as barrier:
                kv1.barrier()
    assert re.fullmatch(r"key 'w': round 2 aborted after 1 s; missing ranks \[0\] \(ranks \[1\] pushed; their "
                        r"pushes were discarded\); rank 0 left \d+\.\d s before \(its worker closed its store\)",
                        str(aborted.value)), aborted.value
    assert re.fullmatch(r"barrier 1 aborted after 1 s; missing ranks \[0\]; rank 0 left \d+\.\d s before \(its "
                        r"worker closed its store\)", str(barrier.value)), barrier.value


@pytest.mark.parametrize("session", [True, False])
def test_a_barrier_waits_for_every_worker(tmp_path, monkeypatch, session):
    """Rank 0's barrier returns only once rank 1 entered it too: on the Session stream
    (SESSION_OP_BARRIER, no Barrier RPC), or as a Barrier RPC with sessions off."""
    rpcs = []
    original = ServerConn._rpc
    monkeypatch.setattr(ServerConn, "_rpc", lambda self, kind, *args: (rpcs.append(kind), original(
        self, kind, *args))[1])
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, session=session) as kv0, \
                tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, session=session) as kv1, \
                ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(kv0.barrier)
            with pytest.raises(TimeoutError):
                waiting.result(timeout=0.5)  # rank 1 has not entered yet
            kv1.barrier()
            waiting.result(timeout=WORKER_TIMEOUT)
    assert ("barrier" in rpcs) == (not session)


def test_a_list_push_whose_rounds_partly_complete(tmp_path):
    """The rounds one list push opens share one abort timer: those the other worker joins
    complete, the others abort, each naming its key, and later rounds are left alone."""
    with Cluster(num_workers=2, round_timeout=2, tmp_path=tmp_path) as cluster:
        outs = check_workers(cluster.run_workers("list_abort"))
    rank0 = next(out for out in outs if out.endswith("ok 0\n"))
    assert "aborted: key 'b': round 1 aborted after 2 s; missing ranks [1]" in rank0
    assert "(and 1 more key)" in rank0


def test_health_and_reflection(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        assert health(address) == "SERVING"
        assert health(address, service="") == "SERVING"
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            reply = next(stub.ServerReflectionInfo(iter([request]), timeout=CALL))
            names = [service.name for service in reply.list_services_response.service]
            assert SERVICE in names and "grpc.health.v1.Health" in names
            request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)
            reply = next(stub.ServerReflectionInfo(iter([request]), timeout=CALL))
            assert reply.file_descriptor_response.file_descriptor_proto


# ---- malformed requests from any client: the raw generated stub -------------------------------

def _push(stub, entries, rank=0):
    frame = tensor_pb2.TensorFrame(entries=entries)
    return stub.Push(iter([kvstore_pb2.PushRequest(rank=rank, incarnation=stub.incarnation, frame=frame)]),
                     timeout=CALL)


def _entry(key, data, dtype=tensor_pb2.DTYPE_FLOAT32, shape=(2,)):
    entry = tensor_pb2.Entry(tensor=tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data))
    if isinstance(key, str):
        entry.key.str_key = key
    elif key is not None:
        entry.key.int_key = key
    return entry


def _pull(stub, key):
    request = kvstore_pb2.PullRequest(rank=0, incarnation=stub.incarnation, keys=[tensor_pb2.Key(int_key=key)])
    frames = [reply.frame for reply in stub.Pull(request, timeout=CALL)]
    return np.frombuffer(b"".join(f.entries[0].tensor.data for f in frames[:1]), np.float32)


@pytest.fixture
def raw_stub(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster, grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        stub.incarnation = stub.Register(kvstore_pb2.RegisterRequest(rank=0), timeout=CALL).incarnation
        frame = tensor_pb2.TensorFrame(entries=[_entry(1, np.ones(2, np.float32).tobytes())])
        stub.Init(iter([kvstore_pb2.InitRequest(rank=0, incarnation=stub.incarnation, frame=frame)]), timeout=CALL)
        yield stub
        assert stub.Info(kvstore_pb2.InfoRequest(), timeout=CALL).num_keys == 1  # nothing was created
        assert _pull(stub, 1).tolist() == [1, 1]  # nor changed


@pytest.mark.parametrize("entries, code, error, words", [
    ([_entry(1, b"\0" * 7)], "INVALID_ARGUMENT", "InvalidTensorError", "key 1: stream ended after 7 of 8 bytes"),
    ([_entry(1, b"\0" * 9)], "INVALID_ARGUMENT", "InvalidTensorError", "needs 8 bytes, got 9"),
    ([_entry(1, b"\0" * 8, dtype=99)], "INVALID_ARGUMENT", "InvalidTensorError", "unknown wire dtype 99"),
    ([_entry(1, b"\0" * 8, dtype=tensor_pb2.DTYPE_FLOAT64, shape=(1,))], "INVALID_ARGUMENT",
     "DtypeMismatchError", "pushed dtype float64 does not match the stored dtype float32"),
    ([_entry(1, b"\0" * 12, shape=(3,))], "INVALID_ARGUMENT", "ShapeMismatchError", "shape (3,)"),
    ([_entry(42, b"\0" * 8)], "NOT_FOUND", "KeyNotFoundError", "key 42 has not been initialized"),
    ([_entry(1, b"\0" * 8), _entry("w", b"\0" * 8)], "INVALID_ARGUMENT", "KeyTypeError",
     "int and str keys cannot be mixed"),
    ([_entry(1, b"\0" * 8), _entry(42, b"\0" * 8)], "NOT_FOUND", "KeyNotFoundError", "key 42"),
    ([_entry(None, b"\0" * 8)], "INVALID_ARGUMENT", "KeyTypeError", "neither int_key nor str_key"),
    ([_entry(1, b"\0" * 8, shape=(-2,))], "INVALID_ARGUMENT", "InvalidTensorError", "negative dimension"),
])
def test_malformed_push_is_rejected_and_changes_nothing(raw_stub, entries, code, error, words):
    with pytest.raises(grpc.RpcError) as caught:
        _push(raw_stub, entries)
    assert caught.value.code().name == code
    assert words in caught.value.details()
    assert dict(caught.value.trailing_metadata())["tensorkv-error"] == error


def test_malformed_calls_of_other_kinds(raw_stub):
    cases = [
        (lambda: _pull(raw_stub, 42), "NOT_FOUND", "key 42 has not been initialized"),
        (lambda: _push(raw_stub, [_entry(1, b"\0" * 8)], rank=5), "FAILED_PRECONDITION", "rank 5 is out of range"),
        (lambda: raw_stub.SetUpdater(iter([kvstore_pb2.SetUpdaterRequest(
            optimizer=kvstore_pb2.Optimizer(name="sgld"))]), timeout=CALL), "INVALID_ARGUMENT", "unknown optimizer"),
        (lambda: raw_stub.SetUpdater(iter([kvstore_pb2.SetUpdaterRequest(
            optimizer=kvstore_pb2.Optimizer(name="sgd", params={"lr": 1}))]), timeout=CALL),
         "INVALID_ARGUMENT", "has no parameter lr"),
        (lambda: raw_stub.SetUpdater(iter([kvstore_pb2.SetUpdaterRequest(
            optimizer=kvstore_pb2.Optimizer(name="adam", params={"beta1": 1.0}))]), timeout=CALL),
         "INVALID_ARGUMENT", "beta1=1 is outside its range [0, 1)"),
        (lambda: raw_stub.SetUpdater(iter([kvstore_pb2.SetUpdaterRequest(
            optimizer=kvstore_pb2.Optimizer(name="sgd", params={"momentum": 5.0}))]), timeout=CALL),
         "INVALID_ARGUMENT", "momentum=5 is outside its range [0, 1)"),
        (lambda: raw_stub.Push(iter([
            kvstore_pb2.PushRequest(frame=tensor_pb2.TensorFrame(entries=[_entry(1, b"\0" * 4)])),
            kvstore_pb2.PushRequest(frame=tensor_pb2.TensorFrame(more=b"\0" * 8))]), timeout=CALL),
         "INVALID_ARGUMENT", "12 bytes sent for a tensor of 8 bytes"),
        (lambda: raw_stub.Unregister(kvstore_pb2.UnregisterRequest(rank=-1), timeout=CALL),
         "FAILED_PRECONDITION", "rank -1 is out of range"),
        (lambda: raw_stub.Unregister(kvstore_pb2.UnregisterRequest(rank=0), timeout=CALL),
         "FAILED_PRECONDITION", "this call carries no incarnation: every call of a registered worker must send "
                                "the RegisterResponse.incarnation of its registration"),
    ]
    for call, code, words in cases:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert (caught.value.code().name, words in caught.value.details()) == (code, True), caught.value.details()
    assert raw_stub.Info(kvstore_pb2.InfoRequest(), timeout=CALL).optimizer == ""


# ---- the client against servers in this process's view ----------------------------------------

def test_unreachable_server_is_named(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        kv = tensorkv.create("dist_sync", servers=address, timeout=10)
        kv.init(1, np.ones(2))
        cluster.stop()
        with pytest.raises(tensorkv.ServerUnavailableError, match=address):
            kv.pull(1)
        kv.close()
    with pytest.raises(tensorkv.ServerUnavailableError, match=f"cannot connect to server {address}"):
        tensorkv.create("dist_sync", servers=[address], connect_timeout=1)


def test_init_twice_and_other_client_errors(tmp_path):
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_device_sync", servers=cluster.addresses) as kv:  # MXNet's name of it
            assert (kv.type, kv.rank, kv.num_workers) == ("dist_device_sync", 0, 1)
        with tensorkv.create("dist_sync", servers=cluster.addresses, num_workers=1) as kv:
            assert (kv.type, kv.rank, kv.num_workers) == ("dist_sync", 0, 1)
            kv.init("a", np.ones(2))
            with pytest.raises(tensorkv.KeyExistsError, match="key 'a' is already initialized"):
                kv.init("a", np.ones(2))
            with pytest.raises(tensorkv.KeyExistsError, match="key 'b' appears twice in one init"):  # as 'local'
                kv.init(["b", "c", "b"], [np.ones(2)] * 3)
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("c")
            with pytest.raises(tensorkv.KeyTypeError):
                kv.push(3, np.ones(2))
            with pytest.raises(tensorkv.FailedPreconditionError, match="set_optimizer"):
                kv.set_updater(lambda key, grad, weight: None)
            with pytest.raises(tensorkv.FailedPreconditionError, match="no optimizer"):
                kv.save_optimizer_states(str(tmp_path / "none"))
            assert kv.pull("a").tolist() == [1, 1]
            with pytest.raises(tensorkv.FailedPreconditionError,
                               match=r"every rank is taken: this server expects 1 worker \(rank 0\)"):
                tensorkv.create("dist_sync", servers=cluster.addresses)
            with pytest.raises(tensorkv.FailedPreconditionError, match="rank 0 is already taken"):
                tensorkv.create("dist_sync", servers=cluster.addresses, rank=0)
        with pytest.raises(tensorkv.FailedPreconditionError, match="runs in sync mode; a 'dist_async' store needs a "
                                                                   "server started with --mode async"):
            tensorkv.create("dist_async", servers=cluster.addresses)


def test_a_closed_store_gives_its_rank_back_and_the_next_continues_the_job(tmp_path):
    big = np.arange(3_000_000, dtype=np.float32)  # sliced over both servers
    with Cluster(servers=2, num_workers=1, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.5))
            kv.init(["w", "big"], [np.ones(4, np.float32), big])
            kv.push(["w", "big"], [np.ones(4, np.float32), np.ones_like(big)])
        # the only worker left: a new run, which resumes the keys of the first
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, if_exists="resume") as kv:
            assert kv.rank == 0
            with pytest.raises(tensorkv.ShapeMismatchError, match="key 'w'"):
                kv.init("w", np.zeros(5, np.float32))
            kv.init(["w", "big"], [np.zeros(4, np.float32), np.zeros_like(big)])  # the stored values stay
            np.testing.assert_array_equal(kv.pull("w"), [0.5] * 4)
            np.testing.assert_array_equal(kv.pull("big"), big - 0.5)
            with pytest.raises(tensorkv.KeyExistsError, match="key 'w' is already initialized"):
                kv.init("w", np.zeros(4, np.float32))
            kv.push("w", np.ones(4, np.float32))  # the servers' optimizer is still there
            np.testing.assert_array_equal(kv.pull("w"), [0.0] * 4)
        for address in cluster.addresses:
            with grpc.insecure_channel(address) as channel:
                info = kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL)
            assert list(info.registered_ranks) == []


def test_close_after_the_server_is_gone_does_not_raise(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses)
        kv.init("w", np.zeros(2))
        cluster.processes[0].kill()
        cluster.processes[0].wait(WORKER_TIMEOUT)
        kv.close()  # the rank cannot be given back: logged, not raised
        with pytest.raises(tensorkv.FailedPreconditionError, match="closed"):
            kv.pull("w")


def test_a_worker_process_that_leaves_is_replaced_by_a_new_one_with_its_rank(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=0) as kv:
        kv.init("w", np.zeros(4, np.float32))
        for expected in (3.0, 2.0):  # rank 1 is a new process each round
            worker = cluster.start_worker("one_round", 1)
            kv.push("w", np.full(4, expected - 1, np.float32))
            np.testing.assert_array_equal(kv.pull("w"), [expected] * 4)
            out, err = worker.communicate(timeout=WORKER_TIMEOUT)
            assert worker.returncode == 0, err
            assert json.loads(out) == [expected] * 4


def test_sigterm_stops_cleanly_and_fails_waits_with_unavailable(tmp_path):
    cluster = Cluster(num_workers=2, tmp_path=tmp_path)
    try:
        worker = cluster.start_worker("wait_in_pull")
        assert worker.stdout.readline() == "pushed\n"
        cluster.processes[0].send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=60)
        assert cluster.processes[0].wait(timeout=30) == 0
        assert worker.returncode == 0, err
        assert out.startswith(f"unavailable: server {cluster.addresses[0]} is unavailable"), out
        # then the pull reconnected until its timeout
        assert "reconnecting for 5 s (the pull's timeout) failed: cannot connect to server" in out, out
    finally:
        stop(worker)
        cluster.stop()
    log = (tmp_path / "server0.log").read_text()
    assert "stopped" in log and "Traceback" not in log


def test_sigterm_ends_open_sessions_before_grpc_stops(tmp_path):
    """Two workers with open Session streams, one with its calls on the data channel, one on
    gRPC only: a SIGTERM ends both streams itself (UNAVAILABLE), so that gRPC has none to
    abort: its "Aborting method ... due to server stop" per stream, or its traceback of a
    cancelled one, was in the log of every such stop."""
    cluster = Cluster(num_workers=2, tmp_path=tmp_path)
    stores = []
    try:
        stores = [tensorkv.create("dist_sync", servers=cluster.addresses, rank=rank, transport=transport)
                  for rank, transport in enumerate(("auto", "grpc"))]

        def step(kv):
            kv.init("w", np.zeros(1 << 16, np.float32))
            kv.push("w", np.ones(1 << 16, np.float32))
            return kv.pull("w")

        with ThreadPoolExecutor(2) as pool:
            for value in pool.map(step, stores):
                np.testing.assert_array_equal(value, np.full(1 << 16, 2, np.float32))
        os.kill(cluster.processes[0].pid, signal.SIGTERM)
        assert cluster.processes[0].wait(timeout=STOP_TIMEOUT) == 0
    finally:
        for kv in stores:
            kv.close()
        cluster.stop()
    log = (tmp_path / "server0.log").read_text()
    assert "stopped" in log
    assert "Aborting method" not in log and "grpc._cython" not in log and "Traceback" not in log, log


def test_a_server_that_stops_takes_no_new_registration():
    async def register_after_shutdown():
        coordinator = Coordinator(Engine(np), 2, "sync", 60.0)
        coordinator.register(0)
        coordinator.shutdown()
        coordinator.register(1)

    with pytest.raises(tensorkv.ServerUnavailableError, match="the server is shutting down"):
        asyncio.run(register_after_shutdown())


def test_tutorial_against_a_server(tmp_path):
    expected = (ROOT / "tests" / "data" / "tutorial_expected.txt").read_text().splitlines(keepends=True)
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        result = subprocess.run([sys.executable, str(ROOT / "examples" / "tutorial_dist.py")], env=cluster.env,
                                capture_output=True, text=True, timeout=WORKER_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(line for line in expected if not line.startswith("update on key"))


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("env, expected", [
    ({}, SERVER_TUNABLES),
    ({"TENSORKV_NO_MALLOC_TUNING": "1"}, None),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, "glibc.malloc.arena_max=4"),
])
def test_server_process_runs_with_malloc_tunables(env, expected):
    """The server re-execs itself once, keeping its PID, with GLIBC_TUNABLES set, unless told not to."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "TENSORKV_NO_MALLOC_TUNING")}
    process = subprocess.Popen([sys.executable, "-m", "tensorkv_server", "--port", str(port), "--device", "cpu",
                                "--log-level", "DEBUG"], env={**base, **env}, stderr=subprocess.PIPE, text=True)
    pid = process.pid
    try:
        Cluster._wait_serving(f"127.0.0.1:{port}", process)
        assert process.pid == pid
    finally:
        assert stop(process) == 0
    log = process.stderr.read()
    assert f"GLIBC_TUNABLES={expected or '(unset)'}\n" in log


@pytest.mark.parametrize("session", [True, False])
def test_session_and_plain_calls_agree_on_values_errors_and_deadlines(tmp_path, session):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, num_workers=2, timeout=1.0,
                             session=session)
        other = tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, num_workers=2, session=session)
        assert (kv._sessions is not None) == session
        kv.init(["a", "b"], [np.zeros(4, np.float32), np.zeros(3, np.int64)])
        other.init(["a", "b"], [np.zeros(4, np.float32), np.zeros(3, np.int64)])
        with pytest.raises(tensorkv.KeyNotFoundError, match="'zz'"):
            kv.pull("zz", out=np.zeros(1))
        with pytest.raises(tensorkv.DtypeMismatchError, match="float64"):
            kv.push("a", np.ones(4))
        # rank 1 never pushes: rank 0's pull waits for the round past its 1 s timeout
        kv.push("a", np.ones(4, np.float32))
        with pytest.raises(tensorkv.DeadlineExceededError):
            kv.pull("a", out=np.zeros(4, np.float32))
        other.push("a", np.full(4, 2, np.float32))
        out = np.zeros(4, np.float32)
        kv.pull("a", out=out)
        np.testing.assert_array_equal(out, 3)
        other.push("b", np.full(3, 5, np.int64))  # first: kv's pushpull must not wait past its 1 s for it
        kv.pushpull("b", np.full(3, 5, np.int64))
        for store in (kv, other):
            np.testing.assert_array_equal(store.pull("b"), 10)
        kv.close()
        other.close()


def test_sigterm_before_the_server_serves_stops_it_at_once_and_cleanly(tmp_path):
    """A SIGTERM while the server starts (here: blocked opening a --token-file that is a FIFO
    nobody writes yet) ends it with status 0 and one line: as PID 1 in a container, a signal
    with no handler was dropped and the pod waited for SIGKILL (an ops probe, exit 137)."""
    fifo = tmp_path / "tokens"
    os.mkfifo(fifo)
    process = subprocess.Popen([sys.executable, "-m", "tensorkv_server", "--port", str(free_port()),
                                "--token-file", str(fifo)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _blocked_in_open(process.pid), "the server opening the FIFO")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=STOP_TIMEOUT)
    finally:
        stop(process)
    assert process.returncode == 0, output
    assert output.splitlines()[-1] == "tensorkv-server: stopped by SIGTERM before serving; nothing was changed"


def _blocked_in_open(pid):
    """Whether process ``pid`` waits in the open() of a FIFO for a writer (Linux's
    wait_for_partner)."""
    try:
        return open(f"/proc/{pid}/wchan").read() == "wait_for_partner"
    except OSError:
        return False
