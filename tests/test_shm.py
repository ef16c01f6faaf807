"""The shared-memory path (a client on its server's host), with real server processes:
values, negotiation and fallback to TCP, cleanup on every exit path, isolation, and clients
that attack the server through their regions."""
import contextlib
import fcntl
import os
import secrets
import signal
import subprocess
import sys

import grpc
import ml_dtypes
import numpy as np
import pytest

import tensorkv
from tensorkv.transport import shm
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.transport.rpc import Stub
from tensorkv.transport.session import RawSession as Session
from tensorkv.v1 import kvstore_pb2, tensor_pb2

from cluster import CALL, WAIT, WORKERS, Cluster, stop, wait_until

pytestmark = pytest.mark.skipif(not shm.available(), reason="no sealed memory files (memfd_create)")


def fds_on(name, pid="self"):
    """The descriptors of process ``pid`` open on the region file ``name`` (its own, and
    those that its mappings keep)."""
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if name in os.readlink(f"/proc/{pid}/fd/{fd}"):
                fds.append(int(fd))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return fds


def holds(pid, name):
    """Whether process ``pid`` maps the region file ``name`` or has a descriptor open on it."""
    with open(f"/proc/{pid}/maps") as maps:
        return name in maps.read() or bool(fds_on(name, pid))


def sealed_memfd(fd):
    """Whether ``fd`` is a memory file with no name in any directory, sealed as regions are."""
    return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") and \
        fcntl.fcntl(fd, fcntl.F_GET_SEALS) == shm.SEALS


def regions(kv):
    return [session.region for session in kv._sessions]


DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.int64, np.uint8]


def _value(size, dtype, scale):
    return ((np.arange(size) % 50) * scale).astype(dtype)


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
        assert all(sealed_memfd(r.fd) for r in regions(kv))
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


@pytest.mark.parametrize("mode, optimizer", [("sync", None), ("sync", "sgd"), ("async", None)])
def test_the_server_keeps_nothing_of_a_region_once_it_answered(tmp_path, mode, optimizer):
    """The server reads a pushed value where the client's region holds it, with no copy first,
    but what it stores is its own: the client writing over its whole region once the push or
    pushpull returned (as its next call may) changes no stored value."""
    size = 1 << 20
    start, step_value = np.full(size, 100.0, np.float32), _value(size, np.float32, 1)
    with Cluster(tmp_path=tmp_path, mode=mode) as cluster, \
            tensorkv.create(f"dist_{mode}", servers=cluster.addresses) as kv:
        kv.init("w", start)
        if optimizer:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
        region = regions(kv)[0]
        expected = start - step_value if optimizer else step_value
        kv.push("w", step_value)
        region.buffer[shm.HEADER_BYTES:] = 0xFF  # NaNs, as float32
        assert np.array_equal(kv.pull("w"), expected)
        out = np.empty(size, np.float32)
        kv.pushpull("w", step_value * 2, out=out)
        expected = expected - step_value * 2 if optimizer else step_value * 2
        assert np.array_equal(out, expected)
        region.buffer[shm.HEADER_BYTES:] = 0xFF
        kv.pull("w", out=out)
        assert np.array_equal(out, expected)


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


class _Recorded(shm.Region):
    """Regions that a client makes, each kept in ``made``."""
    made = []

    def __init__(self, capacity):
        super().__init__(capacity)
        self.made.append(self)


class _WrongToken(_Recorded):
    """A region whose token is not the one written in it: as a server on another host sees
    it, the proof fails."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.token = bytes(len(self.token))


@pytest.mark.parametrize("how", ["wrong token", "unsealed"])
def test_refused_region_falls_back_to_tcp_and_leaves_nothing(tmp_path, monkeypatch, caplog, how):
    monkeypatch.setattr(shm, "Region", _WrongToken if how == "wrong token" else _Recorded)
    if how == "unsealed":  # a client that does not seal its file
        monkeypatch.setattr(shm, "available", lambda: True)
        monkeypatch.setattr(shm, "SEALS", 0)
    monkeypatch.setattr(_Recorded, "made", [])
    caplog.set_level("INFO", logger="tensorkv.transport.session")
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            assert np.array_equal(_push_pull(kv), np.arange(100_000) * 3.0)
            assert regions(kv) == [None] and not kv._sessions[0].shm_allowed  # not tried again
            [made] = _Recorded.made
            assert not holds(os.getpid(), made.name) and not holds(cluster.processes[0].pid, made.name)
    assert ("the token does not match" if how == "wrong token" else "is not sealed") in caplog.text


def test_killed_worker_regions_are_released(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        server = cluster.processes[0]
        worker = subprocess.Popen([sys.executable, str(WORKERS / "shm_hold.py")], env=cluster.env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            name = worker.stdout.readline().strip()
            assert name.startswith(shm.PREFIX), worker.stderr.read() if worker.poll() is not None else name
            assert holds(server.pid, name) and holds(worker.pid, name)
            worker.send_signal(signal.SIGKILL)
            worker.wait(WAIT)
            # the server's mapping was the last hold on the file: its memory is gone with it
            wait_until(lambda: not holds(server.pid, name), "the server releasing the killed worker's region")
        finally:
            stop(worker)
        assert server.poll() is None
    assert "released 1 shared-memory region(s)" in (tmp_path / "server0.log").read_text()


def test_close_and_garbage_collection_release_regions(tmp_path):
    region = shm.Region(1 << 20)
    name = region.name
    assert sealed_memfd(region.fd) and holds(os.getpid(), name)
    with pytest.raises(PermissionError):  # sealed: nobody can resize it, or change its seals
        os.ftruncate(region.fd, 0)
    with pytest.raises(PermissionError):
        fcntl.fcntl(region.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    del region  # never registered: the finalizer unmaps it and closes its descriptor
    wait_until(lambda: not holds(os.getpid(), name), "the region released by garbage collection")
    with Cluster(tmp_path=tmp_path) as cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses)
        _push_pull(kv)
        name = regions(kv)[0].name
        assert holds(os.getpid(), name) and holds(cluster.processes[0].pid, name)
        kv.close()
        assert not holds(os.getpid(), name)
        wait_until(lambda: not holds(cluster.processes[0].pid, name), "the server releasing a closed client's region")


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


def _register(session, pid, fd, size, token):
    """The SessionResponse to registering descriptor ``fd`` of process ``pid`` as a region."""
    return _ask(session, op=kvstore_pb2.SESSION_OP_REGISTER_REGION,
                region=kvstore_pb2.SharedMemoryRegion(pid=pid, fd=fd, size=size, token=token))


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
            # it cannot attach a's file, which stays open in a's process: the server replaced the
            # token with bytes of its own, so neither a's token nor zeros prove anything any more
            assert bytes(region.buffer[:shm.TOKEN_BYTES]) not in (region.token, bytes(shm.TOKEN_BYTES))
            for token in (region.token, bytes(shm.TOKEN_BYTES)):
                answer = _register(session, os.getpid(), region.fd, region.size, token)
                assert answer.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and not answer.region_id
                assert "the token does not match" in answer.message
            # with a region of its own, references outside it are refused
            incarnation = Stub(channel).Register(kvstore_pb2.RegisterRequest(rank=1), timeout=CALL).incarnation
            own = _ask(session, shm_bytes=1 << 20, op=kvstore_pb2.SESSION_OP_PULL, rank=1, incarnation=incarnation,
                       keys=[tensor_pb2.Key(str_key="w")])
            mine = session.region
            assert own.code == 0 and mine is not None and mine.id != region.id
            for ref in [(mine.id, mine.size - 8, n * 8), (mine.id, 1 << 62, n * 8)]:
                answer = _ask(session, rank=1, op=push, entries=[_entry("w", n, ref)])
                assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], ref
                assert "outside its region" in answer.message
            answer = _ask(session, rank=1, op=push, entries=[_entry("w", n, (mine.id, 4 + 64, n * 8))])
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "at offset 68, not a multiple of the 8 bytes of float64" in answer.message
            answer = _ask(session, rank=1, op=kvstore_pb2.SESSION_OP_PULL, keys=[tensor_pb2.Key(str_key="w")],
                          output=tensor_pb2.SharedMemoryRef(region_id=mine.id, offset=8, length=mine.size))
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            # references are refused outside a Session stream
            stub = Stub(channel)
            request = kvstore_pb2.PushRequest(rank=1)
            request.frame.entries.append(_entry("w", n, (mine.id, 0, n * 8)))
            with pytest.raises(grpc.RpcError) as caught:
                stub.Push(iter([request]), timeout=CALL)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "only valid on the Session stream" in caught.value.details()
            # nothing changed: a's value is intact and no round started
            assert np.array_equal(a.pull("w"), value)
        finally:
            session.close()
            channel.close()
            a.close()


@pytest.mark.parametrize("use", ["push", "pull into it"])
def test_a_client_that_shrinks_its_region_cannot_kill_the_server(tmp_path, use):
    # Issue 10: a client that shrank its segment after registering it, then sent one push from
    # it (or a pull into it), killed the server with SIGBUS.
    n, offset = 100_000, 64  # past the region's header
    value, pushed = np.arange(n, dtype=np.float64), np.arange(n, dtype=np.float64) * 7
    with Cluster(tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, timeout=10) as kv:
        server, key = cluster.processes[0], [tensor_pb2.Key(str_key="w")]
        kv.init("w", value)
        channel, session = _raw_session(cluster.addresses[0])
        try:
            # a region registered the documented way (the client's own code), filled, then shrunk
            caller = dict(rank=kv.rank, incarnation=kv._registered[0])
            assert _ask(session, shm_bytes=1 << 20, op=kvstore_pb2.SESSION_OP_PULL, keys=key, **caller).code == 0
            region = session.region
            region.buffer[offset:offset + n * 8] = pushed.view(np.uint8)
            fds = fds_on(region.name)
            assert fds
            for fd in fds:
                with contextlib.suppress(PermissionError):  # sealed: the kernel refuses (EPERM)
                    os.ftruncate(fd, 0)
            # the server stays up whatever the region's size: pushes from it and pulls into it
            ref = (region.id, offset, n * 8)
            if use == "push":
                answer = _ask(session, **caller, op=kvstore_pb2.SESSION_OP_PUSH, entries=[_entry("w", n, ref)])
            else:
                answer = _ask(session, **caller, op=kvstore_pb2.SESSION_OP_PULL, keys=key,
                              output=tensor_pb2.SharedMemoryRef(region_id=ref[0], offset=ref[1], length=ref[2]))
            assert answer.code == 0, answer.message
            want = pushed if use == "push" else value
            assert server.poll() is None
            assert np.array_equal(kv.pull("w"), want)
            assert all(os.fstat(fd).st_size == region.size for fd in fds)  # it never shrank
            assert np.array_equal(region.buffer[offset:offset + n * 8].view(np.float64), want)
        finally:
            session.close()
            channel.close()


# Files that a server must not map, with what its refusal says: any of them could shrink
# under a mapping (or, on hugetlbfs, lose a page that nothing can refill), or is no memory
# file at all. Each has ATTACK_BYTES (the size registered) unless said.
ATTACK_BYTES = 1 << 21
UNSAFE = {
    "a segment in /dev/shm": "is not a memfd",  # the earlier scheme: its creator may shrink it
    "a regular file": "is not a memfd",
    "a memfd left unsealed": "is not sealed",
    "a memfd that cannot be sealed": "is not sealed",
    "a memfd sealed against shrinking only": "is not sealed",
    "a sealed memfd of another size": f"has {ATTACK_BYTES + 1} bytes, not {ATTACK_BYTES}",
    "a sealed memfd on hugetlbfs": "is not a memfd",
}


def _unsafe_file(kind, marker, token, tmp_path):
    """A descriptor on a file of ``kind`` whose path or name holds ``marker``, with ``token``
    at offset 0; None where this host cannot make one."""
    if kind == "a segment in /dev/shm":
        path = f"/dev/shm/{marker}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.unlink(path)
    elif kind == "a regular file":
        fd = os.open(tmp_path / marker, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    elif kind == "a sealed memfd on hugetlbfs":
        try:
            fd = os.memfd_create(marker, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
            os.ftruncate(fd, ATTACK_BYTES)  # no token: a huge page may not be had to write it
        except OSError:
            return None
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm.SEALS)
        return fd
    else:
        sealing = 0 if kind == "a memfd that cannot be sealed" else os.MFD_ALLOW_SEALING
        fd = os.memfd_create(marker, os.MFD_CLOEXEC | sealing)
    os.ftruncate(fd, ATTACK_BYTES + (kind == "a sealed memfd of another size"))
    os.pwrite(fd, token, 0)
    seals = {"a memfd sealed against shrinking only": fcntl.F_SEAL_SHRINK,
             "a sealed memfd of another size": shm.SEALS}.get(kind)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_the_server_maps_only_sealed_memfds(tmp_path):
    value = np.arange(100_000, dtype=np.float64)
    with Cluster(tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, timeout=10) as kv:
        server = cluster.processes[0]
        kv.init("w", value)
        channel, session = _raw_session(cluster.addresses[0])
        fds = []
        try:
            for kind, reason in UNSAFE.items():
                marker, token = f"{shm.PREFIX}attack_{secrets.token_hex(8)}", secrets.token_bytes(shm.TOKEN_BYTES)
                fd = _unsafe_file(kind, marker, token, tmp_path)
                if fd is None:
                    continue
                fds.append(fd)
                answer = _register(session, os.getpid(), fd, ATTACK_BYTES, token)
                assert answer.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and not answer.region_id, kind
                assert reason in answer.message, (kind, answer.message)
                assert not holds(server.pid, marker), kind
            # descriptors that name no memory file: the server's own log, one not open, no process
            for pid, fd, reason in [(server.pid, 2, "is not a memfd"), (os.getpid(), 1 << 20, "cannot use"),
                                    ((1 << 32) - 1, 3, "cannot use")]:
                answer = _register(session, pid, fd, ATTACK_BYTES, bytes(shm.TOKEN_BYTES))
                assert answer.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and reason in answer.message
            assert server.poll() is None
            assert np.array_equal(kv.pull("w"), value)
        finally:
            for fd in fds:
                os.close(fd)
            session.close()
            channel.close()


NOBODY = 65534  # the uid and gid of the caller of another user
# Registers descriptor argv[2] of process argv[1] with a token of zeros on a raw Session
# stream to argv[3] as uid and gid argv[4], and prints the answer's code and message. It
# starts as root, imports what it needs and makes its channel (gRPC imports modules as it
# goes), then drops to that user (every uid and gid, no groups) before its first call
# connects: so it runs where only root can read the checkout and its .venv (a clone under a
# 0700 directory), and the server sees a caller of another user.
_FOREIGN_REGISTER = """
import os, sys, grpc
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.transport.session import RawSession as Session
from tensorkv.v1 import kvstore_pb2
pid, fd, address, nobody = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
session = Session(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), address, shm_allowed=True)  # not connected
os.setgroups([])
os.setresgid(nobody, nobody, nobody)
os.setresuid(nobody, nobody, nobody)
assert os.getresuid() == os.getresgid() == (nobody,) * 3 and not os.getgroups()
def build(call_id, timeout_ms, region, channel):
    return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_REGISTER_REGION,
        region=kvstore_pb2.SharedMemoryRegion(pid=pid, fd=fd, size=4096, token=bytes(32))).SerializeToString(), ()
answer = kvstore_pb2.SessionResponse.FromString(session.call(build, 30.0)[1])
print(answer.code, answer.message)
session.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a caller as nobody")
def test_the_server_maps_no_file_of_another_user_for_a_caller(tmp_path):
    """The server opens /proc/PID/fd/FD as its own user: a caller of another user, who cannot
    open a sealed memfd of the server's user, named it with the bytes it starts with (zeros),
    and the server mapped it, read it and wrote into it (a helper's security probe). Only a
    file of the caller's own user is taken (root may name any)."""
    victim = os.memfd_create("not-a-tensorkv-region", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(victim, 4096)
        os.pwrite(victim, b"a secret of the server's user", 64)
        fcntl.fcntl(victim, fcntl.F_ADD_SEALS, shm.SEALS)
        with Cluster(tmp_path=tmp_path) as cluster:
            done = subprocess.run([sys.executable, "-c", _FOREIGN_REGISTER, str(os.getpid()), str(victim),
                                   cluster.addresses[0], str(NOBODY)], capture_output=True, text=True, timeout=90)
            log = (tmp_path / "server0.log").read_text()
        assert done.returncode == 0, done.stderr
        code, message = done.stdout.split(" ", 1)
        assert int(code) == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert message.startswith(f"cannot use descriptor {victim} of process {os.getpid()}: the server takes only "
                                  "a sealed memfd of the caller's own user")
        assert f"it belongs to uid 0, the caller is uid {NOBODY}" in log
        assert os.pread(victim, 32, 0) == bytes(32)  # untouched: the server never mapped it
    finally:
        os.close(victim)
