"""The shared-memory path (a client on its server's host), with real server processes:
values, negotiation and fallback to TCP, cleanup on every exit path, and isolation."""
import os
import signal
import subprocess
import sys

import grpc
import ml_dtypes
import numpy as np
import pytest

import tensorkv
from tensorkv import shm
from tensorkv.rpc import CHANNEL_OPTIONS, Session, Stub
from tensorkv.v1 import kvstore_pb2, tensor_pb2

from cluster import WAIT, WORKERS, Cluster, stop, wait_until

pytestmark = pytest.mark.skipif(not shm.available(), reason="no POSIX shared memory (/dev/shm)")


def leftovers():
    """Names of tensorkv segments in /dev/shm."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(shm.PREFIX))


def mapped(pid, name):
    """Whether process ``pid`` maps the segment ``name``."""
    with open(f"/proc/{pid}/maps") as maps:
        return name in maps.read()


def regions(kv):
    return [session.region for session in kv._sessions]


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.int64, np.uint8]


def _value(size, dtype, scale):
    return ((np.arange(size) % 50) * scale).astype(dtype)


@pytest.fixture(autouse=True)
def no_leftovers():
    before = leftovers()
    yield
    wait_until(lambda: [n for n in leftovers() if n not in before] == [], "no new segment in /dev/shm")


def test_values_over_shared_memory_two_servers(tmp_path):
    sizes = [3, 5000, 70_000]  # inline, and through the region (16 KiB and more)
    with Cluster(servers=2, tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
        keys = [f"{np.dtype(d).name}-{n}" for d in DTYPES for n in sizes]
        values = [_value(n, d, 1) for d in DTYPES for n in sizes]
        big = np.arange(2_000_000, dtype=np.float32)  # one slice on each server
        kv.init(keys + ["big"], values + [big])
        # init was the first call: the regions were negotiated by it, on both servers
        assert all(r is not None and r.id for r in regions(kv))
        assert leftovers() == []  # names are unlinked as soon as the server attached them
        for key, value in zip(keys + ["big"], kv.pull(keys + ["big"])):
            want = big if key == "big" else values[keys.index(key)]
            assert value.dtype == want.dtype and np.array_equal(value, want), key
        for t in (2, 3):
            kv.push(keys + ["big"], [_value(v.size, v.dtype, t) for v in values] + [big * t])
            outs = [np.zeros_like(v) for v in values] + [np.zeros_like(big)]
            kv.pull(keys + ["big"], out=outs)
            for key, out, value in zip(keys + ["big"], outs, values + [big]):
                assert np.array_equal(out, _value(value.size, value.dtype, t) if key != "big" else big * t), key
        for key, value in zip(keys, values):
            pushed = _value(value.size, value.dtype, 4).reshape(value.shape)
            assert np.array_equal(kv.pushpull(key, pushed) or pushed, _value(value.size, value.dtype, 4)), key
        # a sliced pushpull into out, a pull that returns a new array, a list of arrays summed
        out = np.zeros_like(big)
        kv.pushpull("big", big * 5, out=out)
        assert np.array_equal(out, big * 5)
        fresh = kv.pull("big")
        assert np.array_equal(fresh, big * 5) and fresh.flags.writeable
        kv.push("big", [big, big * 2])
        assert np.array_equal(kv.pull("big"), big * 3)
        # a 2-D value and an out of another layout (not C-contiguous) get the same values
        kv.init("m", np.ones((300, 200), np.float32))
        kv.push("m", np.full((300, 200), 7, np.float32))
        fortran = np.zeros((300, 200), np.float32, order="F")
        kv.pull("m", out=fortran)
        assert (fortran == 7).all()
        # errors are the same as over TCP, and change nothing
        with pytest.raises(tensorkv.ShapeMismatchError):
            kv.push("big", np.zeros(1_999_999, np.float32))
        assert np.array_equal(kv.pull("big"), big * 3)


def test_two_workers_and_a_sliced_array_over_shared_memory(tmp_path):
    with Cluster(servers=2, num_workers=2, tmp_path=tmp_path) as cluster:
        for code, out, err in cluster.run_workers("big"):
            assert code == 0, err
        logs = [(tmp_path / f"server{i}.log").read_text() for i in range(2)]
    assert all(log.count("shared-memory region") >= 2 for log in logs)  # attached, for each worker


def _push_pull(kv):
    value = np.arange(100_000, dtype=np.float64)
    kv.init("w", value)
    kv.push("w", value * 3)
    return kv.pull("w")


@pytest.mark.parametrize("how", ["server flag", "transport=tcp", "transport=grpc", "TENSORKV_TRANSPORT=tcp",
                                 "TENSORKV_TRANSPORT=grpc", "sessions off"])
def test_tcp_when_shared_memory_is_off(tmp_path, monkeypatch, how):
    server_args = ["--no-shared-memory"] if how == "server flag" else []
    options = {"transport": how.split("=")[1]} if how.startswith("transport") else \
        {"session": False} if how == "sessions off" else {}
    if how.startswith("TENSORKV_TRANSPORT"):
        monkeypatch.setenv("TENSORKV_TRANSPORT", how.split("=")[1])
    with Cluster(tmp_path=tmp_path, server_args=server_args) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, **options) as kv:
            assert np.array_equal(_push_pull(kv), np.arange(100_000) * 3.0)
            assert kv._sessions is None or regions(kv) == [None]
            assert kv.transport == ("auto" if how in ("server flag", "sessions off") else how.split("=")[1])
            # 'grpc' sends values in the messages; the others use the data channel off shared memory
            assert kv._sessions is None or (kv._sessions[0].data_channel is None) == how.endswith("grpc")
    assert "attached" not in (tmp_path / "server0.log").read_text()
    with pytest.raises(tensorkv.InvalidArgumentError, match="unknown transport 'udp'"):
        tensorkv.create("dist_sync", servers=cluster.addresses, transport="udp")


class _WrongToken(shm.Region):
    """A segment whose token is not the one written in it: as a server on another host (or
    in another /dev/shm) sees it, the proof fails."""

    def __init__(self, size):
        super().__init__(size)
        self.token = bytes(len(self.token))


def test_failed_proof_falls_back_to_tcp_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(shm, "Region", _WrongToken)
    caplog.set_level("INFO", logger="tensorkv.rpc")
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            assert np.array_equal(_push_pull(kv), np.arange(100_000) * 3.0)
            assert regions(kv) == [None] and not kv._sessions[0].shm_allowed  # not tried again
            assert leftovers() == []
    assert "the token does not match" in caplog.text


def test_killed_worker_segments_are_released(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        server = cluster.processes[0]
        worker = subprocess.Popen([sys.executable, str(WORKERS / "shm_hold.py")], env=cluster.env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            name = worker.stdout.readline().strip()
            assert name.startswith(shm.PREFIX), worker.stderr.read() if worker.poll() is not None else name
            assert mapped(server.pid, name) and mapped(worker.pid, name)
            assert name not in leftovers()  # unlinked once attached: nothing to leak from here on
            worker.send_signal(signal.SIGKILL)
            worker.wait(WAIT)
            wait_until(lambda: not mapped(server.pid, name), "the server unmapping the killed worker's segment")
        finally:
            stop(worker)
        assert server.poll() is None
    assert "released 1 shared-memory region(s)" in (tmp_path / "server0.log").read_text()


@pytest.mark.parametrize("mode", ["exit", "wait"])
def test_unregistered_segments_are_unlinked_on_exit_and_on_kill(mode):
    process = subprocess.Popen([sys.executable, str(WORKERS / "shm_orphan.py"), mode], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        name = process.stdout.readline().strip()
        assert name.startswith(shm.PREFIX)
        if mode == "wait":
            assert name in leftovers()
            process.send_signal(signal.SIGKILL)  # the resource tracker outlives it and unlinks
        process.wait(WAIT)
    finally:
        stop(process)
    wait_until(lambda: name not in leftovers(), f"{name} unlinked")


def test_close_and_garbage_collection_release_segments(tmp_path):
    region = shm.Region(1 << 20)
    name = region.name
    assert name in leftovers()
    del region  # never registered: the finalizer unlinks it
    wait_until(lambda: name not in leftovers(), "the segment unlinked by garbage collection")
    with Cluster(tmp_path=tmp_path) as cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses)
        _push_pull(kv)
        name = regions(kv)[0].name
        assert mapped(os.getpid(), name) and mapped(cluster.processes[0].pid, name)
        kv.close()
        assert not mapped(os.getpid(), name)
        wait_until(lambda: not mapped(cluster.processes[0].pid, name), "the server unmapping a closed client's segment")


def _raw_session(address):
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return channel, Session(channel, address, shm_allowed=True)


def _ask(session, shm_bytes=0, **fields):
    """The SessionResponse to a SessionRequest with ``fields``, and the session's region."""
    def build(call_id, timeout_ms, region, channel):
        entries = fields.pop("entries", [])
        request = kvstore_pb2.SessionRequest(id=call_id, **fields)
        request.frame.entries.extend(entries(region) if callable(entries) else entries)
        return request.SerializeToString(), ()
    call_id, data = session.call(build, 5.0, shm_bytes=shm_bytes)
    return kvstore_pb2.SessionResponse.FromString(data)


def _entry(key, n, ref):
    return tensor_pb2.Entry(key=tensor_pb2.Key(str_key=key), tensor=tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT64, shape=[n]), shm=tensor_pb2.SharedMemoryRef(
            region_id=ref[0], offset=ref[1], length=ref[2]))


def test_a_client_cannot_use_another_clients_memory(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        a = tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, num_workers=2, timeout=10)
        channel, session = _raw_session(address)
        try:
            value = np.arange(100_000, dtype=np.float64)
            a.init("w", value)
            region = regions(a)[0]
            assert region is not None
            n, push = 100_000, kvstore_pb2.SESSION_OP_PUSH
            # the other client names a's region id: unknown on its stream
            answer = _ask(session, rank=1, op=push, entries=[_entry("w", n, (region.id, 0, n * 8))])
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "not registered on this stream" in answer.message
            # ... as an output area too
            answer = _ask(session, rank=1, op=kvstore_pb2.SESSION_OP_PULL, keys=[tensor_pb2.Key(str_key="w")],
                          output=tensor_pb2.SharedMemoryRef(region_id=region.id, offset=0, length=n * 8))
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            # it cannot attach a's segment by name: the name is gone, and the token unknown
            answer = _ask(session, op=kvstore_pb2.SESSION_OP_REGISTER_REGION, region=kvstore_pb2.SharedMemoryRegion(
                name=region.name, size=region.size, token=region.token))
            assert answer.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and not answer.region_id
            # names that are not tensorkv segment names are refused before anything is opened
            answer = _ask(session, op=kvstore_pb2.SESSION_OP_REGISTER_REGION, region=kvstore_pb2.SharedMemoryRegion(
                name="../../etc/passwd", size=4096, token=bytes(32)))
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            # with a region of its own, references outside it are refused
            incarnation = Stub(channel).Register(kvstore_pb2.RegisterRequest(rank=1), timeout=5).incarnation
            own = _ask(session, shm_bytes=1 << 20, op=kvstore_pb2.SESSION_OP_PULL, rank=1, incarnation=incarnation,
                       keys=[tensor_pb2.Key(str_key="w")])
            mine = session.region
            assert own.code == 0 and mine is not None and mine.id != region.id
            for ref in [(mine.id, mine.size - 8, n * 8), (mine.id, 1 << 62, n * 8)]:
                answer = _ask(session, rank=1, op=push, entries=[_entry("w", n, ref)])
                assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], ref
                assert "outside its region" in answer.message
            answer = _ask(session, rank=1, op=kvstore_pb2.SESSION_OP_PULL, keys=[tensor_pb2.Key(str_key="w")],
                          output=tensor_pb2.SharedMemoryRef(region_id=mine.id, offset=8, length=mine.size))
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            # references are refused outside a Session stream
            stub = Stub(channel)
            request = kvstore_pb2.PushRequest(rank=1)
            request.frame.entries.append(_entry("w", n, (mine.id, 0, n * 8)))
            with pytest.raises(grpc.RpcError) as caught:
                stub.Push(iter([request]), timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "only valid on the Session stream" in caught.value.details()
            # nothing changed: a's value is intact and no round started
            assert np.array_equal(a.pull("w"), value)
        finally:
            session.close()
            channel.close()
            a.close()
