"""Requests over what a server should hold, with real server processes on 127.0.0.1 and raw
generated stubs: refused calls leave no memory behind, keys are bounded by --max-key-bytes,
values that cannot be allocated are RESOURCE_EXHAUSTED, and messages shorten long keys."""
import resource

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.rpc import CHANNEL_OPTIONS, Session
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc, tensor_pb2

from cluster import Cluster, rss

TIMEOUT = 20.0  # seconds for one call


def _entry(key, shape, data=b"", dtype=tensor_pb2.DTYPE_FLOAT32):
    return tensor_pb2.Entry(key=tensor_pb2.Key(str_key=key), tensor=tensor_pb2.Tensor(
        dtype=dtype, shape=shape, data=data))


class _Raw:
    """A server's KVStoreService through the generated stub, and a Session stream of its own,
    for a worker registered with ``ranks`` (given back on close)."""

    def __init__(self, address, ranks=(0,)):
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = kvstore_pb2_grpc.KVStoreServiceStub(self.channel)
        self.session = Session(self.channel, address)
        self.incarnations = {rank: self.stub.Register(kvstore_pb2.RegisterRequest(rank=rank), timeout=TIMEOUT)
                             .incarnation for rank in ranks}

    def push(self, entries, rank=0):
        """The grpc.StatusCode and details of a Push RPC carrying ``entries``."""
        return self._status(lambda: self.stub.Push(iter([kvstore_pb2.PushRequest(
            rank=rank, incarnation=self.incarnations[rank], frame=tensor_pb2.TensorFrame(entries=entries))]),
            timeout=TIMEOUT))

    def init(self, entries, rank=0, wait_only=False):
        return self._status(lambda: self.stub.Init(iter([kvstore_pb2.InitRequest(
            rank=rank, incarnation=self.incarnations[rank], wait_only=wait_only,
            frame=tensor_pb2.TensorFrame(entries=entries))]), timeout=TIMEOUT))

    def pull(self, keys, rank=0):
        request = kvstore_pb2.PullRequest(rank=rank, incarnation=self.incarnations[rank],
                                          keys=[tensor_pb2.Key(str_key=key) for key in keys])
        return self._status(lambda: list(self.stub.Pull(request, timeout=TIMEOUT)))

    @staticmethod
    def _status(call):
        try:
            call()
        except grpc.RpcError as error:
            return error.code(), error.details()
        return grpc.StatusCode.OK, ""

    def session_call(self, op, entries=(), keys=(), rank=0, wait_only=False):
        """The grpc.StatusCode and message of a Session call."""
        def build(call_id, timeout_ms, region, channel):
            request = kvstore_pb2.SessionRequest(
                id=call_id, rank=rank, incarnation=self.incarnations[rank], op=op, timeout_ms=timeout_ms,
                wait_only=wait_only,
                frame=tensor_pb2.TensorFrame(entries=entries), keys=[tensor_pb2.Key(str_key=key) for key in keys])
            return request.SerializeToString(), ()
        _, data = self.session.call(build, TIMEOUT)
        response = kvstore_pb2.SessionResponse.FromString(data)
        return grpc.StatusCode.OK if response.code == 0 else _CODES[response.code], response.message

    def close(self):
        for rank, incarnation in self.incarnations.items():
            self.stub.Unregister(kvstore_pb2.UnregisterRequest(rank=rank, incarnation=incarnation), timeout=TIMEOUT)
        self.session.close()
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_CODES = {code.value[0]: code for code in grpc.StatusCode}


# ---- refused requests keep nothing ----------------------------------------------------------

def test_refused_pushes_of_long_keys_leave_no_memory_behind(tmp_path):
    """Pushes of distinct unknown 1 MiB keys, each refused with NOT_FOUND, on the Session stream
    and on the Push RPC (the two ways a request is decoded): the server keeps nothing of them
    (before the fix its codec cached every key it read, ~3 MiB each)."""
    key_chars, count = 1 << 20, 150
    with Cluster(tmp_path=tmp_path, server_args=["--max-key-bytes", str(2 * key_chars)]) as cluster:
        pid = cluster.processes[0].pid
        with _Raw(cluster.addresses[0]) as raw:
            assert raw.init([_entry("w", [2], np.ones(2, np.float32).tobytes())])[0] == grpc.StatusCode.OK
            value = np.zeros(2, np.float32).tobytes()

            def refuse(i):
                key = f"{i:07d}".ljust(key_chars, "k")
                code, message = raw.session_call(kvstore_pb2.SESSION_OP_PUSH, [_entry(key + "s", [2], value)])
                assert (code, f"({key_chars + 1} characters) has not been initialized" in message) \
                    == (grpc.StatusCode.NOT_FOUND, True), message[:300]
                code, details = raw.push([_entry(key + "p", [2], value)])
                assert code == grpc.StatusCode.NOT_FOUND, details[:300]
            for i in range(count):  # gRPC's buffers and malloc's free lists settle (~170 MiB here)
                refuse(i)
            before = rss(pid)
            for i in range(count, 2 * count):
                refuse(i)
            grown = rss(pid) - before
        # Each key cost ~3.8 MiB before the fix: ~1.1 GiB here.
        assert grown < 100 << 20, f"the server grew by {grown >> 20} MiB for {2 * count} refused 1 MiB keys"
        assert cluster.processes[0].poll() is None


# ---- --max-key-bytes ----------------------------------------------------------------------

@pytest.mark.parametrize("flag, limit, keys", [
    ([], 4096, ["k" * 4096, "k" * 4097, "é" * 2048, "é" * 2049]),  # é: 2 bytes of UTF-8
    (["--max-key-bytes", "100"], 100, ["k" * 100, "k" * 101]),
])
def test_keys_over_the_limit_are_refused_wherever_they_come(tmp_path, flag, limit, keys):
    value = np.ones(2, np.float32)
    with Cluster(tmp_path=tmp_path, server_args=flag) as cluster:
        with _Raw(cluster.addresses[0]) as raw:
            for key in keys:
                size = len(key.encode())
                answers = {
                    "Init": raw.init([_entry(key, [2], value.tobytes())]),
                    "Push": raw.push([_entry(key, [2], value.tobytes())]),
                    "Pull": raw.pull([key]),
                    "Session push": raw.session_call(kvstore_pb2.SESSION_OP_PUSH, [_entry(key, [2], value.tobytes())]),
                    "Session pull": raw.session_call(kvstore_pb2.SESSION_OP_PULL, keys=[key]),
                }
                for call, (code, message) in answers.items():
                    if size <= limit:
                        assert code == grpc.StatusCode.OK, (call, message)
                        continue
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, (call, code, message)
                    assert f"takes {size} bytes of UTF-8; this server's limit is {limit} bytes (--max-key-bytes)" \
                        in message, (call, message)
                    assert len(message) < 500, (call, message)
        fitting = [key for key in keys if len(key.encode()) <= limit]
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            for key in keys:
                if key in fitting:
                    np.testing.assert_array_equal(kv.pull(key), value)
                else:
                    with pytest.raises(tensorkv.InvalidArgumentError, match="--max-key-bytes"):
                        kv.init(key, value)
            assert kv._stubs[0].Info(kvstore_pb2.InfoRequest(), timeout=TIMEOUT).num_keys == len(fitting)


# ---- values that cannot be allocated ------------------------------------------------------

TIB_OF_FLOAT32 = [1 << 38]


def _cap_address_space(pid, headroom):
    """Let process ``pid`` map at most ``headroom`` bytes more than it has now (RLIMIT_AS), so that
    a large allocation fails there whatever the kernel's overcommit policy."""
    with open(f"/proc/{pid}/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.prlimit(pid, resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))


def test_a_wait_only_init_allocates_nothing(tmp_path):
    """A wait-only init carries shapes, not data: one of 1 TiB is checked against the stored
    shape (INVALID_ARGUMENT), never allocated (before the fix: INTERNAL MemoryError)."""
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        _cap_address_space(cluster.processes[0].pid, 1 << 30)
        with _Raw(cluster.addresses[0], ranks=(0, 1)) as raw:
            assert raw.init([_entry("w", [2], np.ones(2, np.float32).tobytes())])[0] == grpc.StatusCode.OK
            answers = [raw.init([_entry("w", TIB_OF_FLOAT32)], rank=1, wait_only=True),
                       raw.session_call(kvstore_pb2.SESSION_OP_INIT, [_entry("w", TIB_OF_FLOAT32)], rank=1,
                                        wait_only=True)]
            for code, message in answers:
                assert (code, message) == (grpc.StatusCode.INVALID_ARGUMENT, "key 'w': initialized shape "
                                           f"({1 << 38},) does not match the stored shape (2,)")
            assert raw.init([_entry("w", [2])], rank=1, wait_only=True)[0] == grpc.StatusCode.OK


def test_a_value_too_large_to_allocate_is_resource_exhausted(tmp_path):
    """A push that declares 1 TiB (its bytes to follow) and an init the server cannot copy are
    refused with RESOURCE_EXHAUSTED naming key, shape, dtype and bytes; nothing is stored and
    the server goes on serving (before the fix: INTERNAL MemoryError)."""
    with Cluster(tmp_path=tmp_path) as cluster:
        _cap_address_space(cluster.processes[0].pid, 256 << 20)
        with _Raw(cluster.addresses[0]) as raw:
            assert raw.init([_entry("w", [2], np.ones(2, np.float32).tobytes())])[0] == grpc.StatusCode.OK
            declared = [_entry("w", TIB_OF_FLOAT32, b"\0" * 8)]  # the rest would follow in more frames
            words = f"key 'w': not enough memory for a value of shape ({1 << 38},) and dtype float32 (1099511627776 bytes)"
            assert raw.push(declared) == (grpc.StatusCode.RESOURCE_EXHAUSTED, words)
            assert raw.session_call(kvstore_pb2.SESSION_OP_PUSH, declared) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                                words)
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc", session=False) as kv:
            big = np.ones(160 << 20 >> 2, np.float32)  # received in 160 MiB, then copied into as many
            with pytest.raises(tensorkv.ResourceExhaustedError,
                               match=r"key 'big': not enough memory for a value of shape \(41943040,\) and dtype "
                                     r"float32 \(167772160 bytes\)"):
                kv.init(["big", "small"], [big, np.ones(2, np.float32)])
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("small")  # all or none
            kv.init("small", np.ones(2, np.float32))
            np.testing.assert_array_equal(kv.pull("small"), np.ones(2, np.float32))


# ---- long keys in messages ----------------------------------------------------------------

def test_errors_about_a_long_key_show_it_shortened(tmp_path):
    """A 20,000-character key (over gRPC's 16 KiB of status metadata, within a raised
    --max-key-bytes): its errors reach the client as their own class, the key cut to 100
    characters (before the fix a plain RPC's status with the whole key was undeliverable)."""
    key = "k" * 20_000
    shown = f"'{'k' * 100}'... (20000 characters)"
    with Cluster(tmp_path=tmp_path, server_args=["--max-key-bytes", "65536"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, session=False) as kv:
            kv.init(key, np.ones(2, np.float32))
            with pytest.raises(tensorkv.KeyNotFoundError) as raised:
                kv.pull(key + "x")  # the Pull RPC
            assert str(raised.value) == f"key '{'k' * 100}'... (20001 characters) has not been initialized"
            with pytest.raises(tensorkv.ShapeMismatchError) as raised:
                kv.push(key, np.ones(3, np.float32))  # checked by the client, which knows the shape
            assert str(raised.value) == f"key {shown}: pushed shape (3,) does not match the stored shape (2,)"
        with _Raw(cluster.addresses[0]) as raw:
            mismatch = [_entry(key, [3], np.ones(3, np.float32).tobytes())]
            expected = (grpc.StatusCode.INVALID_ARGUMENT,
                        f"key {shown}: pushed shape (3,) does not match the stored shape (2,)")
            assert raw.push(mismatch) == expected
            assert raw.session_call(kvstore_pb2.SESSION_OP_PUSH, mismatch) == expected
