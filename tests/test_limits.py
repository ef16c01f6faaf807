"""Requests over what a server should hold, with real server processes on 127.0.0.1 and raw
generated stubs: refused calls leave no memory behind, keys are bounded by --max-key-bytes,
values that cannot be allocated are RESOURCE_EXHAUSTED, messages shorten long keys, and
--max-value-bytes, --max-keys-per-call, --max-inflight-bytes and --max-memory refuse what is
over them whole (RESOURCE_EXHAUSTED naming the limit and its flag), before anything is
allocated; data connections without a token are closed; a peer that stops moving a call's
bytes gives them back after --progress-timeout."""
import contextlib
import re
import resource
import socket
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.transport.session import RawSession as Session
from tensorkv.wire import shm
from tensorkv.wire.codec import Item, encode_stream
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.wire.rowsparse_wire import set_row_ids
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc, tensor_pb2
from tensorkv_server.datachan import HANDSHAKE_TIMEOUT, TOKEN_BYTES
from tensorkv_server.service import ROW_ANSWER_COPIES, STATE_ANSWER_COPIES

from cluster import STOP_TIMEOUT, Cluster, check_workers, free_port, rss, wait_until
from test_datachan import progress_server, stalled_channel_call
from test_metrics import scrape

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
    # A raw client sends no heartbeats: a lease longer than 300 slow calls on a loaded machine.
    server_args = ["--max-key-bytes", str(2 * key_chars), "--lease-timeout", "600"]
    with Cluster(tmp_path=tmp_path, server_args=server_args) as cluster:
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
# Limits high enough for a value of 1 TiB, for the tests of what happens when it cannot be allocated.
NO_VALUE_LIMITS = ["--max-value-bytes", str(1 << 41), "--max-inflight-bytes", str(1 << 41)]


def _cap_address_space(pid, headroom):
    """Let process ``pid`` map at most ``headroom`` bytes more than it has now (RLIMIT_AS), so that
    a large allocation fails there whatever the kernel's overcommit policy."""
    with open(f"/proc/{pid}/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.prlimit(pid, resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))


def test_a_wait_only_init_allocates_nothing(tmp_path):
    """A wait-only init carries shapes, not data: one of 1 TiB is checked against the stored
    shape (INVALID_ARGUMENT), never allocated (before the fix: INTERNAL MemoryError)."""
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=NO_VALUE_LIMITS) as cluster:
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
    """A push that declares 1 TiB (its bytes to follow) and an init the server cannot receive are
    refused with RESOURCE_EXHAUSTED naming key, shape, dtype and bytes; nothing is stored and
    the server goes on serving (before the fix: INTERNAL MemoryError)."""
    with Cluster(tmp_path=tmp_path, server_args=NO_VALUE_LIMITS) as cluster:
        _cap_address_space(cluster.processes[0].pid, 256 << 20)
        with _Raw(cluster.addresses[0]) as raw:
            assert raw.init([_entry("w", [2], np.ones(2, np.float32).tobytes())])[0] == grpc.StatusCode.OK
            declared = [_entry("w", TIB_OF_FLOAT32, b"\0" * 8)]  # the rest would follow in more frames
            words = f"key 'w': not enough memory for a value of shape ({1 << 38},) and dtype float32 (1099511627776 bytes)"
            assert raw.push(declared) == (grpc.StatusCode.RESOURCE_EXHAUSTED, words)
            assert raw.session_call(kvstore_pb2.SESSION_OP_PUSH, declared) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                                words)
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc", session=False) as kv:
            big = np.ones(320 << 20 >> 2, np.float32)  # more than the server may map to receive it
            with pytest.raises(tensorkv.ResourceExhaustedError,
                               match=r"key 'big': not enough memory for a value of shape \(83886080,\) and dtype "
                                     r"float32 \(335544320 bytes\)"):
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


# ---- --max-value-bytes, --max-keys-per-call, --max-inflight-bytes, --max-memory --------------

def _floats(count, start=0):
    """``count`` float32 integers from ``start``: exact whatever was added, for comparisons."""
    return np.arange(start, start + count, dtype=np.float32)


def _refused_everywhere(raw, entries, words, keys=None):
    """Init, Push, Session push (and with ``keys``, Pull and Session pull) of ``entries`` are
    each refused with RESOURCE_EXHAUSTED and the message ``words``."""
    answers = {"Init": raw.init(entries), "Push": raw.push(entries),
               "Session push": raw.session_call(kvstore_pb2.SESSION_OP_PUSH, entries)}
    if keys is not None:
        answers.update({"Pull": raw.pull(keys), "Session pull": raw.session_call(kvstore_pb2.SESSION_OP_PULL,
                                                                                 keys=keys)})
    for call, answer in answers.items():
        assert answer == (grpc.StatusCode.RESOURCE_EXHAUSTED, words), call


def test_a_value_over_max_value_bytes_is_refused_and_changes_nothing(tmp_path):
    """Before: any value up to 1 TiB was received (an init of 1028 bytes was stored)."""
    with Cluster(tmp_path=tmp_path, server_args=["--max-value-bytes", "1024"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                    "key 'big': a value of shape (257,) and dtype float32 takes 1028 bytes; this server's limit is "
                    "1024 bytes per value (--max-value-bytes)")):
                kv.init(["w", "big"], [_floats(256), _floats(257)])
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("w")  # all or none
            kv.init("w", _floats(256))  # at the limit
        with _Raw(cluster.addresses[0]) as raw:
            declared = [_entry("w", [257], b"\0" * 8)]  # the rest would follow in more messages
            _refused_everywhere(raw, declared, "key 'w': a value of shape (257,) and dtype float32 takes 1028 bytes; "
                                               "this server's limit is 1024 bytes per value (--max-value-bytes)")
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="resume") as kv:
            np.testing.assert_array_equal(kv.pull("w"), _floats(256))


def test_a_declared_shape_of_2_to_the_40_elements_allocates_nothing(tmp_path):
    """Entries that declare 2**40 uint8 elements (1 TiB) with 8 bytes of them, on Init, Push and
    the Session stream, under the default limits: each refused at once with RESOURCE_EXHAUSTED,
    and the server's memory stays flat. Before: each was answered "not enough memory" after an
    attempt to allocate 1 TiB (or, where the kernel allows it, with a mapping of 1 TiB)."""
    words = (f"key 'w': a value of shape ({1 << 40},) and dtype uint8 takes {1 << 40} bytes; this server's limit "
             f"is {16 << 30} bytes per value (--max-value-bytes)")
    with Cluster(tmp_path=tmp_path) as cluster:
        pid = cluster.processes[0].pid
        with _Raw(cluster.addresses[0]) as raw:
            assert raw.init([_entry("w", [2], b"\1\2", tensor_pb2.DTYPE_UINT8)])[0] == grpc.StatusCode.OK
            huge = [_entry("w", [1 << 40], b"\0" * 8, tensor_pb2.DTYPE_UINT8)]
            for _ in range(20):  # gRPC's buffers settle
                _refused_everywhere(raw, huge, words)
            before = rss(pid)
            for _ in range(100):
                _refused_everywhere(raw, huge, words)
            grown = rss(pid) - before
            assert grown < 50 << 20, f"the server grew by {grown >> 20} MiB for 300 refused declarations of 1 TiB"
            assert raw.pull(["w"])[0] == grpc.StatusCode.OK
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="resume") as kv:
            np.testing.assert_array_equal(kv.pull("w"), np.array([1, 2], np.uint8))


def test_more_keys_than_max_keys_per_call_are_refused_and_change_nothing(tmp_path):
    """Before: any number of keys was accepted (the 4-key init was stored)."""
    keys = ["k0", "k1", "k2", "k3"]
    words = "key 'k3' is key 4 of this call; this server's limit is 3 keys per call (--max-keys-per-call)"
    with Cluster(tmp_path=tmp_path, server_args=["--max-keys-per-call", "3"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(words)):
                kv.init(keys, [_floats(2, 10 * i) for i in range(4)])
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("k0")  # all or none
            kv.init(keys[:3], [_floats(2, 10 * i) for i in range(3)])
            kv.init(keys[3], _floats(2, 30))
            # every key is known here: the push is sent without waiting, and the server's refusal,
            # which only it can see, is raised by the next call, naming the push
            kv.push(keys, [np.ones(2, np.float32)] * 4)
            with pytest.raises(tensorkv.ResourceExhaustedError,
                               match=re.escape(f"an earlier push of 4 keys ('k0', 'k1', 'k2', 'k3') to server "
                                               f"{cluster.addresses[0]}, sent without waiting for its answer, failed "
                                               "and changed nothing: ") + ".*"
                               + re.escape(words)):
                kv.pull("k0")
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(words)):
                kv.pull(keys)
        with _Raw(cluster.addresses[0]) as raw:
            _refused_everywhere(raw, [_entry(key, [2], np.ones(2, np.float32).tobytes()) for key in keys], words,
                                keys=keys)
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="resume") as kv:
            for i, key in enumerate(keys):
                np.testing.assert_array_equal(kv.pull(key), _floats(2, 10 * i))


def test_a_call_over_max_inflight_bytes_is_refused_and_changes_nothing(tmp_path):
    """A call whose values add up to more than --max-inflight-bytes, each within the value limit,
    and a value that declares more and would follow in later messages: refused before the
    rest is received. Before: both were received (the 2-key push was applied)."""
    words = ("key 'b': its value brings the values received in this call to 6000 bytes; this server's limit is "
             "4096 bytes per call (--max-inflight-bytes)")
    with Cluster(tmp_path=tmp_path, server_args=["--max-inflight-bytes", "4096"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc") as kv:
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(words)):
                kv.init(["a", "b"], [_floats(750), _floats(750, 1000)])
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("a")  # all or none
            kv.init("a", _floats(750))
            kv.init("b", _floats(750, 1000))
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(words)):
                kv.push(["a", "b"], [np.ones(750, np.float32)] * 2)
        with _Raw(cluster.addresses[0]) as raw:
            _refused_everywhere(raw, [_entry("a", [750], np.ones(750, np.float32).tobytes()),
                                      _entry("b", [750], b"\0" * 8)], words)
            _refused_everywhere(raw, [_entry("b", [1 << 20], b"\0" * 8)],
                                "key 'b': its value brings the values received in this call to 4194304 bytes; "
                                "this server's limit is 4096 bytes per call (--max-inflight-bytes)")
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="resume") as kv:
            np.testing.assert_array_equal(kv.pull("a"), _floats(750))
            np.testing.assert_array_equal(kv.pull("b"), _floats(750, 1000))


def test_a_large_value_over_max_inflight_bytes_is_refused_on_every_transport_but_shared_memory(tmp_path):
    """A 4 MiB value against a limit of 1 MiB: refused on its first message on the Push stream,
    the Session stream and the data channel, and the next call on the same store works; in
    shared memory it is not received by the server, so not counted. Before: accepted."""
    words = ("key 'big': its value brings the values received in this call to 4194304 bytes; this server's limit is "
             "1048576 bytes per call (--max-inflight-bytes)")
    with Cluster(tmp_path=tmp_path, server_args=["--max-inflight-bytes", str(1 << 20)]) as cluster:
        for transport, session in (("grpc", False), ("grpc", True), ("tcp", True)):
            with tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport, session=session,
                                 if_exists="replace") as kv:
                with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(words)):
                    kv.init("big", np.ones(1 << 20, np.float32))
                kv.init("small", _floats(4))
                np.testing.assert_array_equal(kv.pull("small"), _floats(4))
        if shm.available():
            with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="replace") as kv:
                kv.init("big", _floats(1 << 20))
                np.testing.assert_array_equal(kv.pull("big"), _floats(1 << 20))


MEMORY_LIMIT = "this server's limit is 4096 bytes (--max-memory: stored values and optimizer states)"


def test_max_memory_counts_values_and_optimizer_states_and_changes_nothing(tmp_path):
    """Inits and optimizers that would hold more than --max-memory are refused; nothing changes.
    Before: nothing was counted (every init and optimizer below was accepted)."""
    with Cluster(tmp_path=tmp_path, server_args=["--max-memory", "4096"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("a", _floats(510))  # 2040 bytes
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                    f"key 'c': its value would bring what this server holds to 4100 bytes; {MEMORY_LIMIT}")):
                kv.init(["b", "c"], [_floats(511), _floats(4)])
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("b")  # all or none
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                    "optimizer 'adam' keeps 2 state arrays per value: with those of the 1 key stored this server "
                    f"would hold 6120 bytes; {MEMORY_LIMIT}")):
                kv.set_optimizer(tensorkv.optimizer.Adam())
            kv.push("a", np.ones(510, np.float32))  # no optimizer: assigned
            np.testing.assert_array_equal(kv.pull("a"), np.ones(510, np.float32))
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0, momentum=0.5))  # 2040 + 2040 bytes
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                    "key 'd': its value and the optimizer states it needs would bring what this server holds to "
                    f"4104 bytes; {MEMORY_LIMIT}")):
                kv.init("d", np.ones(3, np.float32))
            kv.init("n", np.ones(16, np.uint8))  # no optimizer states for int values: 4096 bytes
            kv.push("a", np.ones(510, np.float32))
            np.testing.assert_array_equal(kv.pull("a"), np.zeros(510, np.float32))


def test_max_memory_counts_the_float32_copies_of_multi_precision(tmp_path):
    with Cluster(tmp_path=tmp_path, server_args=["--max-memory", "4096"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("h", np.ones(500, np.float16))  # 1000 bytes, and a 2000-byte float32 copy
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.5))
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                    "optimizer 'sgd' keeps 1 state array per value and a float32 copy of each float16 or bfloat16 "
                    f"one (multi_precision): with those of the 1 key stored this server would hold 5000 bytes; "
                    f"{MEMORY_LIMIT}")):
                kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.5, momentum=0.9, multi_precision=True))
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=0.5, multi_precision=True))  # 3000 bytes
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                    "key 'g': its value and the optimizer states it needs would bring what this server holds to "
                    f"5400 bytes; {MEMORY_LIMIT}")):
                kv.init("g", np.ones(400, np.float16))
            kv.init("f", np.ones(274, np.float32))  # float32 keeps no copy: 4096 bytes
            kv.push("h", np.ones(500, np.float16))
            np.testing.assert_array_equal(kv.pull("h"), np.full(500, 0.5, np.float16))


def test_max_memory_counts_what_a_reset_or_a_replacing_run_frees(tmp_path):
    """Before: nothing was counted (the 4100 bytes below were stored)."""
    with Cluster(tmp_path=tmp_path, server_args=["--max-memory", "4096"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("a", _floats(1024))  # 4096 bytes: all there is
            with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                    f"key 'b': its value would bring what this server holds to 4100 bytes; {MEMORY_LIMIT}")):
                kv.init("b", _floats(1))
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="replace") as kv:
            kv.init("b", _floats(1024, 7))  # "a" dropped by the new run
            with pytest.raises(tensorkv.ResourceExhaustedError, match="--max-memory"):
                kv.init("c", _floats(1))
        assert tensorkv.reset(cluster.addresses) == 1
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("c", _floats(1024, 3))
            np.testing.assert_array_equal(kv.pull("c"), _floats(1024, 3))
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("b")


# ---- connections on the data port ---------------------------------------------------------

def test_a_data_connection_without_a_token_is_closed_within_the_handshake_timeout(tmp_path):
    """A plaintext connection that sends nothing, and one that sends half a token, are closed
    by the server within HANDSHAKE_TIMEOUT (+ 5 s)."""
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            port = kv._sessions[0].data_port
        with socket.create_connection(("127.0.0.1", port), 5) as idle, \
                socket.create_connection(("127.0.0.1", port), 5) as half:
            half.sendall(bytes(TOKEN_BYTES // 2))
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT + 5
            for sock in (idle, half):
                sock.settimeout(max(deadline - time.monotonic(), 0.1))
                assert sock.recv(1) == b"", "the server kept a connection that presented no token"
    # one line: the second refusal of the reason within a minute is counted for the next (logs.ThrottledLog)
    assert (tmp_path / "server0.log").read_text().count(f"refused: no token within {HANDSHAKE_TIMEOUT:g} s") == 1


def test_a_snapshot_over_max_memory_stops_the_server_naming_the_file(tmp_path):
    """Before: the snapshot was restored whatever --max-memory said (the flag did not exist)."""
    state = tmp_path / "state"
    with Cluster(tmp_path=tmp_path, server_args=["--state-dir", str(state), "--snapshot-interval", "0"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("a", _floats(1024))  # 4096 bytes; the server's stop writes snapshot 1
        command = [*cluster.commands[0], "--max-memory", "4095"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=STOP_TIMEOUT)
    assert refused.returncode == 1
    assert refused.stderr.strip().endswith(
        f"--state-dir {state}: snapshot-000000000001.tkv: key 'a': its value would bring what this server holds "
        "to 4096 bytes; this server's limit is 4095 bytes (--max-memory: stored values and optimizer states). With "
        "--state-dir and the values in host memory, --max-memory defaults to 40% of the memory (80% before "
        "2026-11-26), since a snapshot holds a copy of every value while it is written: pass a --max-memory that "
        "fits this snapshot, with as much again free")


def test_the_limits_log_line_reads_in_units_and_names_each_flag():
    from tensorkv.words import size
    from tensorkv_server import limits
    line = limits.describe(limits.Limits(max_inflight_bytes=(6 << 30) + (1 << 29)), 13743895347)
    assert line == ("limits: 16 GiB per value (--max-value-bytes), 65536 keys per call (--max-keys-per-call), "
                    "6.5 GiB in flight (--max-inflight-bytes), 12.8 GiB stored (--max-memory), "
                    "60 s without progress (--progress-timeout)")
    assert [size(n) for n in (0, 1, 512, 1024, 1536, 64 << 20, 1 << 40, 1048535, (1 << 30) - 1, 900)] == [
        "0 bytes", "1 byte", "512 bytes", "1 KiB", "1.5 KiB", "64 MiB", "1 TiB", "1 MiB", "1 GiB", "900 bytes"]


def test_a_started_server_logs_its_progress_timeout_with_its_other_limits(tmp_path):
    """The limits line of a server's log names --progress-timeout as it was given (it named
    the other limits only)."""
    with Cluster(tmp_path=tmp_path, server_args=["--progress-timeout", "7.5"]):
        log = (tmp_path / "server0.log").read_text()
    assert re.search(r"limits: .* \(--max-inflight-bytes\), .* \(--max-memory\), 7\.5 s without progress "
                     r"\(--progress-timeout\)", log), log


def test_with_a_state_dir_the_default_memory_leaves_room_for_a_snapshots_copy(tmp_path):
    """A snapshot holds a host copy of every stored value and state while it is written (the
    server's peak RSS doubles): with --state-dir, the default --max-memory is half the share,
    and an explicit one that leaves no room for the copy is warned about."""
    from tensorkv_server import limits
    from tensorkv_server.__main__ import parse_args

    def memory(*argv):
        args = parse_args(["--num-workers", "1", *argv])
        return args, limits.from_args(args, np)[1]

    host = limits.usable_memory()
    args, plain = memory()
    assert plain == int(host * limits.MEMORY_SHARE) and limits.snapshot_room(args, np, plain) is None
    args, durable = memory("--state-dir", str(tmp_path))
    assert durable == int(host * limits.MEMORY_SHARE / 2) and limits.snapshot_room(args, np, durable) is None
    args, crowded = memory("--state-dir", str(tmp_path), "--max-memory", str(limits.host_memory() // 2 + 1))
    assert re.fullmatch(r"--max-memory .* leaves no room for a snapshot's copy: a full server holds up to .* of host "
                        r"memory while one is written, more than the .* this server has; give at most .*",
                        limits.snapshot_room(args, np, crowded))


def test_a_message_longer_than_a_call_may_be_is_refused_before_the_token_check(tmp_path):
    """With no bound on messages, an unauthenticated peer made the server hold three times
    whatever it sent (512 MiB: 1.5 GiB). A message longer than --max-inflight-bytes allows a
    call (with room for its keys) is now refused unread; calls within it go on as before. A
    call without a token is refused unread whatever its length (test_security)."""
    token = "rw-token-0123456789abcdef"
    (tmp_path / "tokens").write_text(f"{token}\n")
    limit = 1_000_000
    with Cluster(tmp_path=tmp_path, server_args=["--max-inflight-bytes", str(limit), "--max-keys-per-call", "4",
                                                 "--token-file", str(tmp_path / "tokens")]) as cluster:
        before = rss(cluster.processes[0].pid)
        with grpc.insecure_channel(cluster.addresses[0], options=CHANNEL_OPTIONS) as channel:
            info = channel.unary_unary("/tensorkv.v1.KVStoreService/Info")
            with pytest.raises(grpc.RpcError) as refused:
                info(b"\x00" * (64 << 20), timeout=20, metadata=(("authorization", f"Bearer {token}"),))  # 64 MiB
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                info(b"\x00" * (64 << 20), timeout=20)  # no token: refused before it is read
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                info(b"", timeout=20)  # a small one gets as far as the token check
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert rss(cluster.processes[0].pid) - before < 32 << 20
        with tensorkv.create("dist_sync", servers=cluster.addresses, token=token, transport="grpc") as kv:
            value = np.arange(limit // 4 - 64, dtype=np.float32)  # a call just within the limit
            kv.init("w", np.zeros_like(value))
            kv.push("w", value)
            np.testing.assert_array_equal(kv.pull("w"), value)


# ---- --max-inflight-bytes: one budget for the whole server ---------------------------------

MIB = 1 << 20


def _peak_rss(pid):
    """The peak resident memory of process ``pid`` so far, in bytes (VmHWM)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


@pytest.mark.parametrize("transport, memory", [("tcp", 128 * MIB), ("grpc", 384 * MIB)])
def test_eight_workers_pushing_at_once_wait_for_the_budget_and_the_server_stays_within_it(tmp_path, transport, memory):
    """8 workers push 64 MiB each at once to a server whose budget holds 2 such pushes: on the
    data channel each call waits for room before its bytes are read, on gRPC a Push stream
    reads its next message once there is room (back pressure, not failure); every round
    completes with exact values, and the server's peak RSS stays within --max-memory + the
    budget + 300 MB (the stored value and the round's total take 128 MiB; on gRPC, whose copies
    in and out of messages are not all counted, --max-memory leaves room for 256 MiB more:
    peaks of 540-610 MB measured, 700 MB once under load). Before: the budget bounded each
    call only; peaks of 685-689 MB on the data channel and 1310-1350 MB on gRPC."""
    budget = 2 * 64 * MIB + MIB
    with Cluster(num_workers=8, tmp_path=tmp_path, round_timeout=300.0,
                 server_args=["--max-memory", str(memory), "--max-inflight-bytes", str(budget)]) as cluster:
        results = cluster.run_workers("budget_rounds", 64, 3, timeout=600.0, env={"TENSORKV_TRANSPORT": transport})
        assert sorted(check_workers(results)) == sorted(f"ok {rank}\n" for rank in range(8))
        peak = _peak_rss(cluster.processes[0].pid)
    assert peak <= memory + budget + 300_000_000, f"server peak RSS {peak} bytes"


def test_a_row_sparse_pull_whose_answer_would_pass_the_budget_is_refused_before_it_is_built(tmp_path):
    """1.5 M repeated row ids (a request of a few MB) ask for 96 MB of rows: with their ids, the
    answer message and its bytes, more than the budget of 128 MiB; refused with
    RESOURCE_EXHAUSTED before anything is built, and the server's peak RSS does not grow by the
    answer's size. Before: the rows alone were checked against the budget, and the answer was
    built (three copies of it)."""
    value = np.arange(160, dtype=np.float32).reshape(10, 16)  # rows of 64 bytes
    ids = np.zeros(1_500_000, np.int64)
    with Cluster(tmp_path=tmp_path, server_args=["--max-inflight-bytes", str(128 * MIB)]) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc", timeout=120) as kv:
        kv.init("w", value)
        np.testing.assert_array_equal(kv.row_sparse_pull("w", row_ids=ids[:1000]), value[[0] * 1000])
        before = _peak_rss(cluster.processes[0].pid)
        with pytest.raises(tensorkv.ResourceExhaustedError) as refused:
            kv.row_sparse_pull("w", row_ids=ids)
        grown = _peak_rss(cluster.processes[0].pid) - before
        np.testing.assert_array_equal(kv.row_sparse_pull("w", row_ids=ids[:10]), value[[0] * 10])
    assert "a row-sparse pull of 1500000 rows would answer 91.6 MiB of values" in str(refused.value)
    assert "this server's budget for bytes in flight is 128 MiB (--max-inflight-bytes)" in str(refused.value)
    assert grown < ids.size * 64, f"the server's peak RSS grew by {grown} bytes"


@pytest.mark.skipif(not shm.available(), reason="the value is stored through shared memory, which is not counted")
def test_an_answer_larger_than_the_whole_budget_is_refused_at_once(tmp_path):
    """A 2 MiB value stored through shared memory (not counted), pulled over gRPC and the data
    channel from a server whose budget is 1 MiB: refused at once with RESOURCE_EXHAUSTED naming
    the bytes, the budget and its flag; the store goes on. Before: answered whatever its size."""
    with Cluster(tmp_path=tmp_path, server_args=["--max-inflight-bytes", str(MIB)]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init(["big", "small"], [_floats(MIB // 2), _floats(4)])
            np.testing.assert_array_equal(kv.pull("big"), _floats(MIB // 2))  # into shared memory
        for transport in ("grpc", "tcp"):
            with tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport,
                                 if_exists="resume") as kv:
                with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                        "needs 2097152 bytes in flight (2 MiB), more than this server's whole budget for bytes in "
                        "flight of 1048576 bytes (1 MiB, --max-inflight-bytes)")):
                    kv.pull("big")
                np.testing.assert_array_equal(kv.pull("small"), _floats(4))


def test_the_budget_grants_in_turn_refuses_after_its_wait_and_takes_back_what_a_cancelled_call_was_given():
    """budget.Budget on its own: reservations that do not fit wait, first come first served;
    one that finds no room by its deadline is refused naming the bytes, the budget and the
    flag; one larger than the whole budget is refused at once; a waiter cancelled after it
    was granted gives its bytes back."""
    import asyncio

    from tensorkv_server.budget import Budget

    async def scenario():
        budget = Budget(100)
        first = await budget.reserve(60)
        second = asyncio.ensure_future(budget.reserve(50))
        third = asyncio.ensure_future(budget.reserve(10))  # fits now, but waits behind the second
        await asyncio.sleep(0)
        assert not second.done() and not third.done() and budget.used == 60
        with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                "a pull needs 101 bytes in flight (101 bytes), more than this server's whole budget for bytes in "
                "flight of 100 bytes (100 bytes, --max-inflight-bytes)")):
            await budget.reserve(101, what="a pull")
        first.release()
        first.release()  # once only
        granted = await asyncio.wait_for(second, 60)
        assert (await asyncio.wait_for(third, 60)).nbytes == 10 and budget.used == 60
        with pytest.raises(tensorkv.ResourceExhaustedError, match=re.escape(
                "a push needs 50 bytes in flight (50 bytes); this server's budget for bytes in flight, 100 bytes "
                "(100 bytes, --max-inflight-bytes), stayed full for 0.01 s")):
            await budget.reserve(50, timeout=0.01, what="a push")
        assert budget.used == 60
        waiting = asyncio.ensure_future(budget.reserve(50))
        await asyncio.sleep(0)
        granted.release()  # grants the waiter; then its call is cancelled before it runs
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert budget.used == 10

    asyncio.run(scenario())


def test_a_push_pull_whose_push_was_applied_is_answered_past_the_budget(tmp_path):
    """A raw data-channel call announces 3.5 MiB and sends 1 byte: it holds them of a 4 MiB
    budget. A push-pull of 1 MiB over gRPC then has room for its push, which is merged, but
    not for its answer: it waited the budget's 30 s and failed RESOURCE_EXHAUSTED ("try
    again") after the value had changed, so a worker that tried again pushed twice. The answer of a push that was applied is counted past the budget: answered."""
    with Cluster(tmp_path=tmp_path, server_args=["--max-inflight-bytes", str(4 * MIB)]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            port = kv._sessions[0].data_port
        with stalled_channel_call(cluster.addresses[0], port, 7 * MIB // 2):
            with tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc", if_exists="replace") as kv:
                kv.init("w", np.zeros(MIB // 4, np.float32))
                out = np.empty(MIB // 4, np.float32)
                kv.pushpull("w", _floats(MIB // 4), out=out)
                np.testing.assert_array_equal(out, _floats(MIB // 4))


# ---- --progress-timeout: a peer that stops moving a call's bytes gives them back -----------

def _stall_logged(tmp_path, what):
    wait_until(lambda: re.search(rf"call from ipv4:127\.0\.0\.1:\d+ ended: {what}: no bytes moved for 2 s "
                                 r"\(--progress-timeout\)", (tmp_path / "server0.log").read_text()),
               "the stall's log line")


def test_a_push_stream_that_stops_sending_gives_back_its_bytes_and_its_turn(tmp_path):
    """A Push stream sends all but the last message of an 8 MiB value, then nothing: it holds
    about 7 MiB of an 8 MiB budget, and as the oldest stream being read it is the one that goes
    on when the budget is full. Another worker's Push of 4 MiB waited behind it the budget's
    30 s and was refused, for as long as the stalled stream's connection lived. With
    --progress-timeout 2 the stalled stream ends with DEADLINE_EXCEEDED, its bytes and its
    turn given back (a WARNING names the peer); the push goes through."""
    cluster, inflight = progress_server(tmp_path, 8 * MIB)
    resume = threading.Event()
    with cluster, tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc", session=False,
                                  timeout=60) as kv, \
            grpc.insecure_channel(cluster.addresses[0], options=CHANNEL_OPTIONS) as channel:
        kv.init("w", np.zeros(MIB, np.float32))
        messages = encode_stream(kvstore_pb2.PushRequest, [Item("big", _floats(2 * MIB))], {"rank": 0})
        sent = threading.Event()

        def stalling():
            yield from messages[:-1]
            sent.set()
            resume.wait(60)

        try:
            stalled = channel.stream_unary("/tensorkv.v1.KVStoreService/Push").future(stalling())
            assert sent.wait(TIMEOUT)
            kv.push("w", _floats(MIB))
            np.testing.assert_array_equal(kv.pull("w"), _floats(MIB))
            error = stalled.exception(timeout=TIMEOUT)
        finally:
            resume.set()
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "a stream of values: no bytes moved for 2 s (--progress-timeout)" in error.details()
        _stall_logged(tmp_path, "a stream of values")
        assert inflight() == 0


@contextlib.contextmanager
def _pulls_of(tmp_path, budget, value):
    """A server (progress_server, 2 workers) that holds ``value`` as 'w', stored by rank 0 of a
    store on gRPC streams; yields (that store, a raw stub, rank 1's PullRequest of 'w', the
    function that reads tensorkv_inflight_bytes). The stub's channel has no
    SingleThreadedUnaryStream (CHANNEL_OPTIONS): a Pull starts at once, and its answer's
    messages are read only as its iterator asks for them."""
    cluster, inflight = progress_server(tmp_path, budget, num_workers=2)
    with cluster, tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc", session=False,
                                  timeout=60) as kv, grpc.insecure_channel(cluster.addresses[0]) as channel:
        kv.init("w", value)
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        incarnation = stub.Register(kvstore_pb2.RegisterRequest(rank=1), timeout=TIMEOUT).incarnation
        yield kv, stub, kvstore_pb2.PullRequest(rank=1, incarnation=incarnation, keys=[tensor_pb2.Key(str_key="w")]), \
            inflight


def test_a_pull_whose_answer_is_not_read_gives_back_its_bytes(tmp_path):
    """Rank 1 asks for a 16 MiB Pull over gRPC and never reads the answer: it held 32 MiB of a
    48 MiB budget (the answer's messages and gRPC's copy) for as long as its connection lived,
    so rank 0's pull of the same value waited the budget's 30 s and was refused. With
    --progress-timeout 2 the server stops writing once the peer takes nothing, gives the bytes
    back and logs it; rank 0's pull goes through, and rank 1, reading at last, gets the
    messages written before the stall, then DEADLINE_EXCEEDED."""
    value = _floats(4 * MIB)
    with _pulls_of(tmp_path, 48 * MIB, value) as (kv, stub, request, inflight):
        unread = stub.Pull(request, timeout=120)
        np.testing.assert_array_equal(kv.pull("w"), value)
        _stall_logged(tmp_path, "the answer of a pull")
        assert inflight() == 0
        with pytest.raises(grpc.RpcError) as ended:
            for _ in unread:
                pass
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "the answer of a pull: no bytes moved for 2 s (--progress-timeout)" in ended.value.details()


def test_a_pull_cancelled_or_past_its_deadline_mid_answer_ends_quietly(tmp_path):
    """A Pull's client cancels it after one message; another's deadline passes after one. The
    server's write under the ended call ends as a cancellation, as gRPC's own writes do: no
    "unexpected error in Pull" with a traceback in the log (once the Pull wrote its own answer,
    to bound each write by --progress-timeout, 1 to 2 of 3 such calls logged one), and the
    answers' bytes are given back."""
    value = _floats(4 * MIB)
    with _pulls_of(tmp_path, 256 * MIB, value) as (kv, stub, request, inflight):
        cancelled = stub.Pull(request, timeout=TIMEOUT)
        next(cancelled)
        cancelled.cancel()
        late = stub.Pull(request, timeout=1.0)
        with contextlib.suppress(grpc.RpcError):  # its deadline may pass before its first message
            next(late)
        wait_until(lambda: inflight() == 0, "the answers' bytes given back")
        np.testing.assert_array_equal(kv.pull("w"), value)
    log = (tmp_path / "server0.log").read_text()
    assert "Traceback" not in log and "unexpected error" not in log, log


UNREAD_TIMEOUT = 5  # --progress-timeout (s) of _unread_answers: the time to see an unread answer counted


@contextlib.contextmanager
def _unread_answers(tmp_path, budget, mode="sync"):
    """A server in ``mode`` for 2 workers with a budget for bytes in flight of ``budget`` bytes, a progress
    timeout of UNREAD_TIMEOUT s and a metrics port; yields (rank 0's store on gRPC streams, a
    raw channel, the incarnation of rank 1 registered on it, the function that reads
    tensorkv_inflight_bytes). As _pulls_of's, the channel reads the messages of an answer
    stream only as its iterator asks for them; it takes messages of any length."""
    metrics_port = free_port()
    with Cluster(num_workers=2, mode=mode, tmp_path=tmp_path, server_args=(
            "--metrics-port", str(metrics_port), "--max-inflight-bytes", str(budget),
            "--progress-timeout", str(UNREAD_TIMEOUT))) as cluster, \
            tensorkv.create(f"dist_{mode}", servers=cluster.addresses, transport="grpc", session=False,
                            timeout=60) as kv, \
            grpc.insecure_channel(cluster.addresses[0], options=[("grpc.max_receive_message_length", -1)]) as channel:
        incarnation = kvstore_pb2_grpc.KVStoreServiceStub(channel).Register(
            kvstore_pb2.RegisterRequest(rank=1), timeout=TIMEOUT).incarnation
        yield kv, channel, incarnation, lambda: scrape(metrics_port)[1][("tensorkv_inflight_bytes", ())]


def _ended_stalled(tmp_path, answer, what):
    """Check that the call of ``answer`` (a response stream not read so far) was ended by the
    progress timeout already: logged, and DEADLINE_EXCEEDED once read."""
    assert re.search(rf"call from ipv4:127\.0\.0\.1:\d+ ended: {what}: no bytes moved for {UNREAD_TIMEOUT} s "
                     r"\(--progress-timeout\)", (tmp_path / "server0.log").read_text())
    with pytest.raises(grpc.RpcError) as ended:
        for _ in answer:
            pass
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"{what}: no bytes moved for {UNREAD_TIMEOUT} s (--progress-timeout)" in ended.value.details()


def test_a_row_sparse_pulls_answer_stays_counted_while_it_is_written(tmp_path):
    """Rank 1 asks for 16 MiB of rows and reads none of the answer (a RowSparsePull read as a
    stream of one message, as it is on the wire): the bytes reserved for it (the rows, the
    message and its serialized copy) stay counted while the server writes it, so that rank 0's
    pull of the value waits for room until --progress-timeout ends that call (DEADLINE_EXCEEDED,
    logged) and gives them back. Before: given back once the answer was built, before gRPC sent
    it; the pull went on at once, and the answer that was not read stayed in the server
    uncounted for as long as the connection lived."""
    rows, width = 16384, 256  # rows of 1 KiB
    value = _floats(rows * width).reshape(rows, width)
    with _unread_answers(tmp_path, 64 * MIB) as (kv, channel, incarnation, inflight):
        kv.init("w", value)
        request = kvstore_pb2.RowSparsePullRequest(rank=1, incarnation=incarnation)
        set_row_ids(request.keys.add(), "w", np.arange(rows))
        row_sparse_pull = channel.unary_stream("/tensorkv.v1.KVStoreService/RowSparsePull",
                                               request_serializer=kvstore_pb2.RowSparsePullRequest.SerializeToString,
                                               response_deserializer=kvstore_pb2.RowSparsePullResponse.FromString)
        unread = row_sparse_pull(request, timeout=120)
        held = ROW_ANSWER_COPIES * (value.nbytes + rows * 8)
        wait_until(lambda: inflight() == held, "the answer's bytes counted")
        np.testing.assert_array_equal(kv.pull("w"), value)  # needs 32 MiB: the room the unread answer holds
        _ended_stalled(tmp_path, unread, "the answer of a row-sparse pull")
        assert inflight() == 0


def test_the_optimizer_states_answer_is_counted_while_it_is_written(tmp_path):
    """Rank 1 asks for the optimizer states (Adam's 2 states of an 8 MiB value) and reads none
    of the answer: its bytes (the host copies of the states, our messages of them) are counted
    while the server writes it, so that rank 0's pull waits for room until --progress-timeout
    ends that call (DEADLINE_EXCEEDED, logged) and gives them back. Before: not counted, nor
    bounded by the progress timeout."""
    value = _floats(2 * MIB)
    with _unread_answers(tmp_path, 40 * MIB, mode="async") as (kv, channel, _, inflight):
        kv.init("w", np.zeros_like(value))
        kv.set_optimizer(tensorkv.optimizer.Adam(learning_rate=0.1))
        kv.push("w", value)  # the states exist once the key was updated
        pulled = kv.pull("w")
        unread = kvstore_pb2_grpc.KVStoreServiceStub(channel).GetOptimizerStates(
            kvstore_pb2.GetOptimizerStatesRequest(), timeout=120)
        wait_until(lambda: inflight() == STATE_ANSWER_COPIES * 2 * value.nbytes, "the answer's bytes counted")
        np.testing.assert_array_equal(kv.pull("w"), pulled)  # needs 16 MiB: the room the unread answer holds
        _ended_stalled(tmp_path, unread, "the answer of GetOptimizerStates")
        assert inflight() == 0


def test_an_answer_that_cannot_be_split_may_take_more_than_the_whole_budget():
    """budget.Budget.reserve_whole: an answer over the whole budget (all the optimizer states)
    waits until the whole budget is free, then is counted past it; calls behind it wait until
    it is given back. One within the budget is reserved as any other."""
    import asyncio

    from tensorkv_server.budget import Budget

    async def scenario():
        budget = Budget(100)
        first = await budget.reserve(10)
        whole = asyncio.ensure_future(budget.reserve_whole(250))
        await asyncio.sleep(0)
        assert not whole.done() and budget.used == 10
        first.release()
        granted = await asyncio.wait_for(whole, 60)
        assert granted.nbytes == 250 and budget.used == 250
        behind = asyncio.ensure_future(budget.reserve(1))
        await asyncio.sleep(0)
        assert not behind.done()
        granted.release()
        assert (await asyncio.wait_for(behind, 60)).nbytes == 1 and budget.used == 1
        assert (await budget.reserve_whole(99)).nbytes == 99 and budget.used == 100

    asyncio.run(scenario())
