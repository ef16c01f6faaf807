"""The raw-TCP data channel (a client on another host, or transport='tcp'), with real server
processes on 127.0.0.1: values equal those of plain gRPC, errors, negotiation and fallback,
and failures of either side."""
import asyncio
import contextlib
import errno
import os
import re
import signal
import socket
import struct
import threading
import time
import tracemalloc

import grpc
import ml_dtypes
import numpy as np
import pytest

import tensorkv
from tensorkv.wire import allocator
from tensorkv.transport.datachan import Channel
from tensorkv.wire import datachan
from tensorkv.wire.codec import Item, encode_stream, following
from tensorkv.errors import DeadlineExceededError, ServerUnavailableError
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.transport.rpc import Stub
from tensorkv.transport.session import RawSession as Session
from tensorkv.v1 import kvstore_pb2, tensor_pb2
from tensorkv_server.datachan import TOKEN_BYTES, _io_error

from cluster import WAIT, Cluster, free_port, rss, stop, wait_until
from test_metrics import scrape

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int16, np.int32, np.int64, np.uint8]
SIZES = [10, 100_000, 2_000_000, 3 << 20]  # inline, one value, sliced over 2 servers, multi-MiB


def channels(kv):
    return [session.data_channel for session in kv._sessions]


def _value(size, dtype, scale):
    return ((np.arange(size) % 50) * scale).astype(dtype)


def _round_trips(kv, prefix):
    """The values pulled back after push, pull, pushpull of every dtype and size."""
    got = []
    for dtype in DTYPES:
        for size in SIZES:
            key = f"{prefix}-{np.dtype(dtype).name}-{size}"
            kv.init(key, _value(size, dtype, 1))
            kv.push(key, _value(size, dtype, 2))
            out = np.empty(size, dtype)
            kv.pull(key, out=out)
            got.append(out)
            fused = np.empty(size, dtype)
            kv.pushpull(key, _value(size, dtype, 3), out=fused)
            got += [fused, kv.pull(key)]
    return got


def test_values_over_the_channel_equal_those_of_grpc(tmp_path):
    with Cluster(servers=2, tmp_path=tmp_path) as cluster:
        results = {}
        for transport in ("tcp", "grpc"):
            with tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport, timeout=60) as kv:
                results[transport] = _round_trips(kv, transport)
                bound = [channel is not None for channel in channels(kv)]
                assert bound == ([True, True] if transport == "tcp" else [False, False])
        logs = [(tmp_path / f"server{i}.log").read_text() for i in range(2)]
    expected = [_value(size, dtype, scale) for dtype in DTYPES for size in SIZES for scale in (2, 3, 3)]
    for tcp, grpc_value, value in zip(results["tcp"], results["grpc"], expected):
        assert tcp.dtype == grpc_value.dtype == value.dtype
        assert np.array_equal(tcp, grpc_value) and np.array_equal(tcp, value)
    assert all(log.count("data channel from") == 1 for log in logs)  # one channel per server, kept


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_large_values_in_reused_receive_buffers_stay_exact(tmp_path, transport):
    """Values of 32 MiB or more are received into buffers the server uses again once nothing
    refers to them (allocator.Buffers): two keys pushed in turn, assigned and then as SGD's
    gradients (buffers let go after each update), stay exact round after round."""
    size = (allocator.REUSE_MIN_BYTES >> 2) + 1000  # float32 elements
    keys = ["a", "b"]
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport, timeout=60) as kv:
            kv.init(keys, [np.zeros(size, np.float32)] * 2)
            out = np.empty(size, np.float32)
            for step in range(1, 4):
                for i, key in enumerate(keys):
                    kv.push(key, _value(size, np.float32, 10 * step + i))
                for i, key in enumerate(keys):
                    kv.pull(key, out=out)
                    assert np.array_equal(out, _value(size, np.float32, 10 * step + i)), (step, key)
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
            weights = [_value(size, np.float32, 30 + i) for i in range(2)]
            for step in range(1, 4):
                for i, key in enumerate(keys):
                    gradient = _value(size, np.float32, step + i)
                    kv.push(key, gradient)
                    weights[i] = weights[i] - gradient
                for i, key in enumerate(keys):
                    kv.pull(key, out=out)
                    assert np.array_equal(out, weights[i]), (step, key)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_a_value_is_copied_once_each_way_with_no_buffer_between(tmp_path, transport):
    """On the data channel ('tcp') and through shared memory ('auto'), a pushed NumPy value
    goes from its array to the socket or the region, and a pulled one from there into ``out``
    itself: no call allocates anything near the value's size (tracemalloc sees NumPy's
    buffers and Python's bytes), and the value pulled is the out array."""
    size = 1 << 20  # 4 MiB of float32
    out, fused_out = np.empty(size, np.float32), np.empty(size, np.float32)
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport) as kv:
            kv.init("w", _value(size, np.float32, 1))
            kv.pull("w", out=out)  # the region or the channel set up, the key's shape known
            assert (channels(kv) != [None]) if transport == "tcp" else kv._sessions[0].region is not None
            for step in (2, 3):
                pushed, fused = _value(size, np.float32, step), _value(size, np.float32, 10 * step)
                tracemalloc.start()
                try:
                    kv.push("w", pushed)
                    pulled = kv._pull(["w"], fresh=False, outs=[[out]])[0]
                    kv.pushpull("w", fused, out=fused_out)
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
                assert pulled is out and np.array_equal(out, pushed) and np.array_equal(fused_out, fused)
                assert peak < out.nbytes // 4, f"{peak} bytes allocated at most for a value of {out.nbytes}"


def _timers(port):
    """{(local port, remote port): the kernel's timer kind} of the established IPv4 TCP
    sockets with ``port`` at either end (/proc/net/tcp: 2 is keepalive's, 0 none)."""
    timers = {}
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            local, remote = (int(address.rsplit(":", 1)[1], 16) for address in fields[1:3])
            if fields[3] == "01" and port in (local, remote):
                timers[local, remote] = int(fields[5].split(":")[0], 16)
    return timers


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_both_ends_of_the_channel_keep_it_alive_while_idle(tmp_path):
    """TCP keepalive is on at the worker's end and the server's (datachan.keep_alive): an idle
    channel has its keepalive timer armed on both, with the idle time the module sets."""
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp", timeout=30) as kv:
            kv.init("w", np.zeros(1 << 17, np.float32))  # 512 KiB: on the data channel
            kv.pull("w")
            sock = channels(kv)[0]._sock
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == datachan.KEEPALIVE_IDLE
            data_port = kv._sessions[0].data_port
            ends = _timers(data_port)
            assert len(ends) == 2 and set(ends.values()) == {2}, ends  # the worker's end and the server's


def test_a_sockets_own_timeout_is_a_broken_channel_not_a_deadline():
    """TCP keepalive's ETIMEDOUT (the peer is gone) is a TimeoutError with an errno; the
    deadline of asyncio.timeout is a TimeoutError (from Python 3.11) without one."""
    gone = _io_error(TimeoutError(errno.ETIMEDOUT, "Connection timed out"), 30.0)
    late = _io_error(asyncio.TimeoutError(), 30.0)
    assert isinstance(gone, ServerUnavailableError) and "Connection timed out" in str(gone)
    assert isinstance(_io_error(TimeoutError(errno.ETIMEDOUT, "Connection timed out"), None), ServerUnavailableError)
    assert isinstance(late, DeadlineExceededError) and "within 30 s" in str(late)


def test_errors_over_the_channel_leave_values_and_the_channel_usable(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp", timeout=30) as kv:
            value = np.arange(1 << 20, dtype=np.float32)
            kv.init("w", value)
            kv.push("w", value * 2)
            assert channels(kv)[0] is not None
            kv._meta.clear()  # so that the server, not the client, finds the mismatches
            with pytest.raises(tensorkv.ShapeMismatchError):
                kv.push("w", np.ones(1 << 19, np.float32))
            with pytest.raises(tensorkv.DtypeMismatchError):
                kv.push("w", np.ones(1 << 20, np.float64))
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.push("nope", np.ones(1 << 20, np.float32))
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("nope")
            assert np.array_equal(kv.pull("w"), value * 2)  # unchanged, over a renegotiated channel
            assert channels(kv)[0] is not None
            kv.push("w", value * 3)
            out = np.empty_like(value)
            kv.pull("w", out=out)
            assert np.array_equal(out, value * 3)
        log = (tmp_path / "server0.log").read_text()
    # The calls go framed on the channel, and every byte of the failed ones was read: it stays
    assert log.count("data channel from") == 1


def test_a_bad_token_is_refused_and_the_call_falls_back(tmp_path, monkeypatch):
    connect = Channel.__init__

    def wrong_token(self, address, port, token, timeout, tls=None):
        connect(self, address, port, bytes(len(token)), timeout, tls)

    monkeypatch.setattr(Channel, "__init__", wrong_token)
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            value = np.arange(1 << 20, dtype=np.float64)
            kv.init("w", value)
            kv.push("w", value * 5)
            assert np.array_equal(kv.pull("w"), value * 5)
            assert channels(kv) == [None] and kv._sessions[0].data_port == 0  # off for this session
        log = (tmp_path / "server0.log").read_text()
    assert "refused: unknown or used token" in log and "data channel from" not in log


def _token(address, port):
    """A data-channel token of a new Session stream to ``address``, and the session."""
    session = Session(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), address, data_port=port)

    def build(call_id, timeout_ms, region, channel):
        return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL).SerializeToString(), ()
    _, data = session.call(build, 5.0)
    return kvstore_pb2.SessionResponse.FromString(data), session


def _present(port, token):
    """The server's answer (b"" when it closed the connection) to ``token`` on the data port."""
    with socket.create_connection(("127.0.0.1", port), WAIT) as sock:
        sock.settimeout(WAIT)
        sock.sendall(token)
        try:
            return sock.recv(1)
        except ConnectionResetError:
            return b""


def test_tokens_are_single_use_and_unguessable(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            port = kv._sessions[0].data_port
        assert port > 0
        response, session = _token(address, port)
        try:
            assert response.code == 0 and len(response.data_token) == 32
            assert _present(port, bytes(32)) == b""
            assert _present(port, response.data_token) == datachan.ACK
            assert _present(port, response.data_token) == b""  # replayed
        finally:
            session.close()


def test_a_fixed_data_port_is_the_one_offered(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with Cluster(tmp_path=tmp_path, server_args=["--data-port", str(port)]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            assert kv._sessions[0].data_port == port
            kv.init("w", np.arange(100_000, dtype=np.float32))
            kv.push("w", np.ones(100_000, np.float32))
            assert channels(kv)[0] is not None
            np.testing.assert_array_equal(kv.pull("w"), np.ones(100_000, np.float32))


def test_no_data_channel_falls_back_to_grpc(tmp_path):
    with Cluster(tmp_path=tmp_path, server_args=["--no-data-channel"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            assert kv._sessions[0].data_port == 0
            value = np.arange(1 << 20, dtype=np.float32)
            kv.init("w", value)
            kv.push("w", value * 2)
            assert np.array_equal(kv.pull("w"), value * 2)
            assert channels(kv) == [None]
        response, session = _token(cluster.addresses[0], 1)
        session.close()
        assert response.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "data channel off" in (tmp_path / "server0.log").read_text()


def test_a_killed_server_fails_the_call_in_flight(tmp_path):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, transport="tcp", timeout=5)
        try:  # the pull fails once it has tried to reconnect for its timeout
            value = np.arange(1 << 20, dtype=np.float32)
            kv.init("w", value)
            kv.push("w", value)  # the round waits for rank 1, so the pull below waits too
            errors = []

            def pull():
                try:
                    kv.pull("w")
                except tensorkv.KVStoreError as error:
                    errors.append(error)
            thread = threading.Thread(target=pull)
            thread.start()
            wait_until(lambda: channels(kv)[0] is not None, "the data channel")
            cluster.kill(0)
            thread.join(WAIT)
            assert not thread.is_alive(), "the pull did not fail within the bound"
            assert len(errors) == 1 and isinstance(errors[0], tensorkv.ServerUnavailableError)
            assert channels(kv) == [None]
        finally:
            kv.close()


def test_a_client_killed_mid_transfer_leaves_the_server_serving_others(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp", timeout=30) as kv:
            value = np.arange(4 << 20, dtype=np.float32)
            kv.init("w", value)
            port = kv._sessions[0].data_port
            half = cluster.start_worker("datachan_half_push", cluster.addresses[0], port, "w", value.size)
            try:
                assert half.stdout.readline().strip() == "sent"
                kv.push("w", value * 2)  # served while the other stream waits for its bytes
                assert np.array_equal(kv.pull("w"), value * 2)
                half.send_signal(signal.SIGKILL)
                half.wait(WAIT)
            finally:
                stop(half)
            log = tmp_path / "server0.log"
            wait_until(lambda: log.read_text().count("data channel of") >= 1, "the killed client's channel closed")
            kv.push("w", value * 3)
            assert np.array_equal(kv.pull("w"), value * 3)  # the half push was never applied
            assert channels(kv)[0] is not None


def _push_cut_by_a_reset(address, port, item, incarnation):
    """The status code a server answers to a data-channel push of ``item`` whose last byte never
    comes: the client resets the connection (SO_LINGER 0, then close) before it."""
    session = Session(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), address, data_port=port)
    try:
        session._open()
        channel = session._ensure_channel(WAIT, "push")
        channel.deadline = time.monotonic() + WAIT
        items, arrays = following([item], 1)
        session._queue.put(encode_stream(kvstore_pb2.SessionRequest, items, dict(
            id=99, rank=0, incarnation=incarnation, op=kvstore_pb2.SESSION_OP_PUSH, timeout_ms=int(WAIT * 1000)), chunk_bytes=1 << 62)[0])
        channel.send([arrays[0].reshape(-1).view(np.uint8)[:-1]])
        channel._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        channel.close()
        return kvstore_pb2.SessionResponse.FromString(next(session._call)).code
    finally:
        session.close()


def test_a_push_cut_by_a_reset_frees_its_buffer_at_once(tmp_path):
    """Pushes of 32 MiB on the data channel, each cut by a TCP reset: the calls fail, their
    receive buffers are freed as they fail (before the fix a reference cycle kept each until
    Python's cyclic GC ran: ~+20 MiB per cut), and the server serves on."""
    size, cuts = 32 << 20, 16
    with Cluster(tmp_path=tmp_path) as cluster:
        address, pid = cluster.addresses[0], cluster.processes[0].pid
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp", timeout=WAIT) as kv:
            value = np.arange(size // 4, dtype=np.float32)
            kv.init("w", value)
            port = kv._sessions[0].data_port
            cut = Item("w", value * 2)
            for _ in range(2):  # the server's buffers and malloc's free lists settle
                assert _push_cut_by_a_reset(address, port, cut, kv._registered[0]) == grpc.StatusCode.UNAVAILABLE.value[0]
            before = rss(pid)
            for _ in range(cuts):
                assert _push_cut_by_a_reset(address, port, cut, kv._registered[0]) == grpc.StatusCode.UNAVAILABLE.value[0]
            grown = rss(pid) - before
            assert grown < 3 * size, f"the server grew by {grown >> 20} MiB for {cuts} cut pushes of 32 MiB"
            kv.push("w", value * 3)
            np.testing.assert_array_equal(kv.pull("w"), value * 3)


def _closed_by_peer(sock):
    sock.settimeout(WAIT)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_channel_closes_with_its_session(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        log = tmp_path / "server0.log"
        value = np.arange(1 << 20, dtype=np.float32)
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            kv.init("w", value)
            kv.push("w", value)
        wait_until(lambda: "data channel of" in log.read_text(), "the server closing a closed client's channel")
        kv = tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp")
        try:
            kv.push("w", value)
            sock = channels(kv)[0]._sock
            cluster.stop()  # SIGTERM: the server ends its streams and their channels
            assert _closed_by_peer(sock)
        finally:
            kv.close()


def _following_entry(key, n):
    return tensor_pb2.Entry(key=tensor_pb2.Key(str_key=key), tensor=tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT32, shape=[n]), channel=tensor_pb2.DataChannelRef(length=n * 4))


def test_entries_on_the_channel_need_a_bound_channel(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            value = np.arange(1 << 18, dtype=np.float32)
            kv.init("w", value)
            entry = _following_entry("w", value.size)
            # a Session stream that did not bind a channel
            session = Session(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), address)

            def build(call_id, timeout_ms, region, channel):
                request = kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_PUSH, timeout_ms=5000)
                request.frame.entries.append(entry)
                return request.SerializeToString(), ()
            try:
                _, data = session.call(build, 5.0)
            finally:
                session.close()
            answer = kvstore_pb2.SessionResponse.FromString(data)
            assert answer.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            # any other RPC
            with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                push = kvstore_pb2.PushRequest(rank=0, frame=tensor_pb2.TensorFrame(entries=[entry]))
                with pytest.raises(grpc.RpcError) as raised:
                    Stub(channel).push_raw([push.SerializeToString()], timeout=5.0)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert np.array_equal(kv.pull("w"), value)


def test_a_call_announced_on_the_channel_holds_only_the_bytes_that_came(tmp_path):
    """A call's header announces its size; the server's memory grows with the bytes that came,
    not with that size (it took the whole announced size at once, zero-filled: a few bytes
    could make it hold --max-inflight-bytes per channel)."""
    with Cluster(tmp_path=tmp_path) as cluster:
        address, server = cluster.addresses[0], cluster.processes[0]
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            port = kv._sessions[0].data_port
        session = Session(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), address, data_port=port)
        try:
            def build(call_id, timeout_ms, region, channel):
                return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL,
                                                  calls_on_channel=True).SerializeToString(), ()
            token = kvstore_pb2.SessionResponse.FromString(session.call(build, 5.0)[1]).data_token
            before = rss(server.pid)
            with socket.create_connection(("127.0.0.1", port), WAIT) as sock:
                sock.sendall(token)
                assert sock.recv(1) == datachan.ACK
                sock.sendall((512 << 20).to_bytes(datachan.FRAME_HEADER, "little") + b"\x08")  # 1 of 512 MiB
                grown = 0
                for _ in range(20):  # two seconds for the server to take the byte in
                    time.sleep(0.1)
                    grown = max(grown, rss(server.pid) - before)
        finally:
            session.close()
    assert grown < 64 << 20, f"the server grew by {grown >> 20} MiB for a call of which 1 byte came"


def test_a_call_on_the_stream_gives_back_nothing_of_what_its_channel_holds(tmp_path):
    """The budget's bytes that a call on the data channel holds (reserved before its bytes are
    read) stay counted while a call on the same Session stream comes and goes: the channel's
    task shared the stream's slot of held bytes, so that call gave them back (the gauge fell
    to 0 while the channel's call still held them: the budget let others in past it)."""
    budget, announced = 64 << 20, 32 << 20
    metrics_port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(metrics_port),
                                                 "--max-inflight-bytes", str(budget))) as cluster:
        address = cluster.addresses[0]
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv:
            port = kv._sessions[0].data_port

        def inflight():
            return scrape(metrics_port)[1][("tensorkv_inflight_bytes", ())]

        with stalled_channel_call(address, port, announced) as session:
            wait_until(lambda: inflight() >= announced, "the channel's call reserving its bytes")

            def build_pull(call_id, timeout_ms, region, channel):  # on the stream: refused, no matter
                return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_PULL,
                                                  keys=[tensor_pb2.Key(str_key="nothing")]).SerializeToString(), ()
            session.call(build_pull, WAIT)
            assert inflight() >= announced


STALLED = r"data channel of ipv4:127\.0\.0\.1:\d+ closed: a call on the data channel: no bytes moved for 2 s " \
          r"\(--progress-timeout\)"


def progress_server(tmp_path, budget, num_workers=1):
    """A Cluster of one server with a budget for bytes in flight of ``budget`` bytes, a
    progress timeout of 2 s, and a metrics port; and a function that reads its
    tensorkv_inflight_bytes."""
    metrics_port = free_port()
    cluster = Cluster(num_workers=num_workers, tmp_path=tmp_path, server_args=(
        "--metrics-port", str(metrics_port), "--max-inflight-bytes", str(budget), "--progress-timeout", "2"))
    return cluster, lambda: scrape(metrics_port)[1][("tensorkv_inflight_bytes", ())]


def test_a_call_whose_bytes_stop_coming_gives_them_back_after_the_progress_timeout(tmp_path):
    """A call on the data channel announces 48 MiB and sends 1 byte: it holds 48 MiB of a
    64 MiB budget, and held them for as long as its connection lived, so a push of 32 MiB
    waited the budget's 30 s and was refused. With --progress-timeout 2 the server closes
    that connection, gives the bytes back and says so in a WARNING naming the peer; the
    push, which needs them, goes through."""
    value = _value(8 << 20, np.float32, 1)  # 32 MiB
    cluster, inflight = progress_server(tmp_path, 64 << 20)
    with cluster, tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp", timeout=60) as kv:
        kv.init("w", np.zeros_like(value))
        with stalled_channel_call(cluster.addresses[0], kv._sessions[0].data_port, 48 << 20):
            kv.push("w", value)
            np.testing.assert_array_equal(kv.pull("w"), value)
            wait_until(lambda: re.search(STALLED, (tmp_path / "server0.log").read_text()), "the stall's log line")
            assert inflight() == 0


def test_an_answer_the_peer_does_not_read_gives_its_bytes_back_after_the_progress_timeout(tmp_path):
    """Rank 1 asks for a pull of 40 MiB on the data channel and reads none of the answer: its
    bytes were held of the 64 MiB budget for as long as the connection lived, so rank 0's pull
    of them waited 30 s and was refused. With --progress-timeout 2 the server closes that
    connection once its writes stop moving, gives the bytes back and logs it; rank 0's pull
    goes through."""
    value = _value(10 << 20, np.float32, 1)  # 40 MiB
    cluster, inflight = progress_server(tmp_path, 64 << 20, num_workers=2)
    with cluster, tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp", timeout=60) as kv:
        kv.init("w", value)
        with unread_channel_pull(cluster.addresses[0], kv._sessions[0].data_port, "w", rank=1):
            np.testing.assert_array_equal(kv.pull("w"), value)
            wait_until(lambda: re.search(STALLED, (tmp_path / "server0.log").read_text()), "the stall's log line")
            assert inflight() == 0


@contextlib.contextmanager
def unread_channel_pull(address, port, key, rank):
    """A raw Session stream to the server at ``address``, registered as ``rank``, whose data
    channel (on ``port``, taking calls) has sent a pull of ``key`` with its values on the
    channel and reads nothing of the answer (a small receive buffer: the server's writes
    stop soon) while the context lasts."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    session = Session(channel, address, data_port=port)
    try:
        incarnation = Stub(channel).Register(kvstore_pb2.RegisterRequest(rank=rank), timeout=WAIT).incarnation

        def build_open(call_id, timeout_ms, region, data_channel):
            return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL,
                                              calls_on_channel=True).SerializeToString(), ()
        token = kvstore_pb2.SessionResponse.FromString(session.call(build_open, WAIT)[1]).data_token
        pull = kvstore_pb2.SessionRequest(id=1, op=kvstore_pb2.SESSION_OP_PULL, rank=rank, incarnation=incarnation,
                                          keys=[tensor_pb2.Key(str_key=key)], data_channel_min_bytes=1)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(WAIT)
            sock.connect(("127.0.0.1", port))
            sock.sendall(token)
            assert sock.recv(1) == datachan.ACK
            request = pull.SerializeToString()
            sock.sendall(len(request).to_bytes(datachan.FRAME_HEADER, "little") + request)
            yield
    finally:
        session.close()
        channel.close()


@contextlib.contextmanager
def stalled_channel_call(address, port, announced):
    """A raw Session stream to the server at ``address`` whose data channel (on ``port``) has
    sent a call framed as ``announced`` bytes long and 1 byte of them: the server holds the
    budget's bytes for it (reserved before they are read) while the context lasts. Yields the
    Session."""
    session = Session(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), address, data_port=port)
    try:
        def build_open(call_id, timeout_ms, region, channel):
            return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL,
                                              calls_on_channel=True).SerializeToString(), ()
        token = kvstore_pb2.SessionResponse.FromString(session.call(build_open, WAIT)[1]).data_token
        with socket.create_connection(("127.0.0.1", port), WAIT) as sock:
            sock.sendall(token)
            assert sock.recv(1) == datachan.ACK
            sock.sendall(announced.to_bytes(datachan.FRAME_HEADER, "little") + b"\x08")  # 1 byte of them
            yield session
    finally:
        session.close()


class _FakeDataPort:
    """A data port that binds any token and answers each call framed on it with a frame header
    announcing ``announce`` bytes and one byte, then nothing more (a broken or hostile server)."""

    def __init__(self, announce):
        self.announce = announce
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.calls = 0
        self._held = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            self._held.append(conn)
            try:
                conn.settimeout(WAIT)
                _recv_exactly(conn, TOKEN_BYTES)
                conn.sendall(datachan.ACK)
                size = int.from_bytes(_recv_exactly(conn, datachan.FRAME_HEADER), "little")
                _recv_exactly(conn, size)  # the call (a small one: no bytes follow it)
                self.calls += 1
                conn.sendall(self.announce.to_bytes(datachan.FRAME_HEADER, "little") + b"\x08")
            except OSError:
                pass

    def close(self):
        self.listener.close()
        for conn in self._held:
            conn.close()


def _recv_exactly(sock, size):
    data = b""
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            raise ConnectionResetError("closed")
        data += piece
    return data


@pytest.mark.parametrize("call, announce", [("init", 0xFFFFFFF0), ("init", 64 << 20), ("pull", 0xFFFFFFF0)])
def test_an_answer_longer_than_the_call_can_carry_fails_at_once(tmp_path, call, announce):
    """A data channel whose server announces an answer longer than the call can carry (an
    init's answer carries no values; no answer is longer than a gRPC message) fails the call
    at once, naming the server, and the worker takes nothing for it (it took the announced
    length, zero-filled: 4 GiB, and waited for the bytes until the call timed out)."""
    fake = _FakeDataPort(announce)
    try:
        with Cluster(tmp_path=tmp_path, server_args=["--advertise-data-port", fake.port]) as cluster:
            [(code, out, err)] = cluster.run_workers("answer_length", call, 1024)
            address = cluster.addresses[0]
    finally:
        fake.close()
    assert code == 0, err
    assert fake.calls >= 1, (out, err)
    assert out.startswith(f"InternalError server {address} announced an answer of {announce} bytes on the data "
                          "channel, more than the "), (out, err)
    grew = int(out.split("grew ")[1])
    assert grew < 256 << 20, f"the worker grew by {grew >> 20} MiB for an answer that never came"
