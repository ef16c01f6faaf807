"""A bounded, seeded fuzzer of the data channel's framing: raw sockets on the data port and
Session streams through the generated stub, against a real server.

Handshakes: garbage, truncated, wrong, replayed and superseded tokens, a token of another
stream or of an ended one, nothing at all, half a token then a stall. Bound channels: a
random sequence of pushes whose bytes come short (then a close, a reset, a stall or the
stream cancelled), exact, or with bytes beyond those announced; bytes that no call
announced; announcements that do not match the entry's shape and dtype, or the stored
key's, or that pass --max-inflight-bytes; values on calls that take none (region and
channel ops); pulls read whole, or stopped in the middle of a value (closed, or left
unread). The channel is modelled as the byte stream it is: a call consumes exactly the
bytes it announces, in entry order, whatever came before them, so every answer and every
stored value is predicted exactly.

After every case: the server is alive and answers Info; no answer is UNKNOWN or INTERNAL;
every key holds exactly what the accepted pushes wrote; the server holds no connection on
the data port but those the fuzzer keeps stalled, and at the end no more descriptors than
before the first case (/proc/<pid>/fd). ``--seeds N`` runs N seeds of CASES cases each."""
import contextlib
import itertools
import os
import queue
import random
import socket
import struct
import time

import grpc
import numpy as np
import tensorkv
from tensorkv.transport import shm
from tensorkv.wire import datachan
from tensorkv.wire.codec import Item, encode_stream, following, numpy_dtype, wire_dtype
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc
from tensorkv_server.datachan import HANDSHAKE_TIMEOUT, TOKEN_BYTES

from cluster import WAIT, Cluster, wait_until

CASES = 40  # per seed
STALL_MS = 300  # the timeout of a call whose bytes the fuzzer holds back
MAX_INFLIGHT = 32 << 20  # the server's --max-inflight-bytes: more than any push below but one that asks for more
SHAPES = {"big": ((1 << 21,), np.float32),  # 8 MiB: more than the sockets hold while the reader stalls
          "f": ((3000,), np.float32), "i": ((64, 16), np.int32), "d": ((500,), np.float64), "h": ((7, 9), np.float16)}
CODES = {code.value[0]: code for code in grpc.StatusCode}
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
_OPS_WITHOUT_VALUES = {kvstore_pb2.SESSION_OP_REGISTER_REGION, kvstore_pb2.SESSION_OP_UNREGISTER_REGION,
                       kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL}


def _value(key, rng):
    shape, dtype = SHAPES[key]
    return ((np.arange(np.prod(shape)) % 97) + rng.randint(1, 50)).astype(dtype).reshape(shape)


def same(a, b):
    """Bit for bit (garbage bytes read as floats make NaNs)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _code(answer):
    return CODES[answer.code]


class Stream:
    """A Session stream through the generated stub, one request at a time; every answer comes
    within the stream's deadline."""

    def __init__(self, grpc_channel, timeout=WAIT):
        self._requests = queue.Queue()
        self._answers = kvstore_pb2_grpc.KVStoreServiceStub(grpc_channel).Session(
            iter(self._requests.get, None), timeout=timeout)
        self._ids = itertools.count(1)

    def send(self, request):
        request.id = next(self._ids)
        self._requests.put(request)

    def answer(self):
        try:
            answer = next(self._answers)
        except grpc.RpcError as error:
            raise AssertionError(f"the Session stream failed: {error.code()} {error.details()}") from None
        assert _code(answer) not in NEVER, f"answered {_code(answer)}: {answer.message}"
        return answer

    def call(self, request):
        self.send(request)
        return self.answer()

    def token(self):
        answer = self.call(kvstore_pb2.SessionRequest(op=kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL))
        assert answer.code == 0 and len(answer.data_token) == TOKEN_BYTES, answer
        return answer.data_token

    def cancel(self):
        self._answers.cancel()
        self._requests.put(None)

    def close(self):
        """End the request stream; the server ends its side (bounded by the deadline)."""
        self._requests.put(None)
        try:
            for answer in self._answers:
                raise AssertionError(f"an answer to no request: {answer}")
        except grpc.RpcError as error:
            assert error.code() not in NEVER, f"the Session stream ended with {error.code()}: {error.details()}"


def connect(port, small_buffer=False):
    sock = socket.socket()
    if small_buffer:  # a reader that stops holds little of what the server sends
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    sock.settimeout(WAIT)
    sock.connect(("127.0.0.1", port))
    return sock


def present(port, token, small_buffer=False, pieces=1, then=b""):
    """A socket bound with ``token`` sent in ``pieces`` and directly followed by ``then`` (bytes
    of the channel), or None when the server closed the connection instead."""
    sock = connect(port, small_buffer)
    cuts = [len(token) * i // pieces for i in range(pieces)] + [len(token)]
    for start, end in zip(cuts, cuts[1:]):
        sock.sendall(token[start:end])
        time.sleep(0.01)  # the server reads each piece alone
    sock.sendall(then)
    if _next_byte(sock) == datachan.ACK:
        return sock
    sock.close()
    return None


def _next_byte(sock):
    """The next byte the server sends on ``sock`` (within WAIT); b"" once it closed it."""
    try:
        return sock.recv(1)
    except ConnectionResetError:
        return b""


def refused(sock):
    """Whether the server closes ``sock`` without a word."""
    return _next_byte(sock) == b""


def reset(sock):
    """Close ``sock`` with a TCP reset (SO_LINGER 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class Target:
    """The server under fuzz, a grpc-transport store that pulls every key to check it, and what
    each key must hold."""

    def __init__(self, cluster, kv, grpc_channel):
        self.process = cluster.processes[0]
        self.kv, self.grpc_channel = kv, grpc_channel
        self.stub = kvstore_pb2_grpc.KVStoreServiceStub(grpc_channel)
        info = self.stub.Info(kvstore_pb2.InfoRequest(), timeout=WAIT)
        self.data_port = info.data_port
        # The Session ops that take no values (unregistering needs a region registered).
        self.ops_without_values = [op for op in sorted(_OPS_WITHOUT_VALUES)
                                   if info.shared_memory or op != kvstore_pb2.SESSION_OP_UNREGISTER_REGION]
        self.caller = dict(rank=kv._conns[0].rank, incarnation=kv._conns[0].incarnation)
        self.expected = {key: _value(key, random.Random(0)) for key in SHAPES}
        kv.init(list(self.expected), list(self.expected.values()))
        self.stalled = []  # handshakes left silent: the server closes them after HANDSHAKE_TIMEOUT

    def check(self, what):
        assert self.process.poll() is None, f"{what}: the server died"
        self.stub.Info(kvstore_pb2.InfoRequest(), timeout=WAIT)
        for key, value in zip(self.expected, self.kv.pull(list(self.expected))):
            want = self.expected[key]
            assert same(value, want), f"{what}: key {key!r} changed"
        kept = {sock.getsockname()[1] for sock in self.stalled}
        wait_until(lambda: set(self.data_peers()) <= kept, f"{what}: the server closing its data-channel connections")

    def fds(self):
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def data_peers(self):
        """The client ports of the server's connections on the data port."""
        inodes = set()
        for fd in os.listdir(f"/proc/{self.process.pid}/fd"):
            try:
                link = os.readlink(f"/proc/{self.process.pid}/fd/{fd}")
            except FileNotFoundError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        peers = []
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{self.process.pid}/net/{table}") as lines:
                for line in list(lines)[1:]:
                    fields = line.split()
                    port, peer = (int(address.rsplit(":", 1)[1], 16) for address in fields[1:3])
                    if fields[9] in inodes and port == self.data_port and peer:  # peer 0: the listening socket
                        peers.append(peer)
        return peers

    def stream(self, timeout=WAIT):
        return Stream(self.grpc_channel, timeout)

    def request(self, op, timeout_ms=int(WAIT * 1000), **fields):
        return kvstore_pb2.SessionRequest(op=op, timeout_ms=timeout_ms, **self.caller, **fields)


# ---- handshakes ----------------------------------------------------------------------------

def _binds(target, token):
    """Assert that ``token`` binds a connection (a bad try before it consumed nothing)."""
    sock = present(target.data_port, token)
    assert sock is not None, "the stream's own token was refused after a bad try"
    sock.close()


def garbage_token(target, rng):
    stream = target.stream()
    token = stream.token()
    sock = connect(target.data_port)
    size = rng.choice([1, 16, 31, 32, 33, 64, 300])
    sock.sendall(rng.randbytes(size))
    if size < TOKEN_BYTES:
        sock.shutdown(socket.SHUT_WR)
    assert refused(sock)
    sock.close()
    _binds(target, token)
    stream.close()


def truncated_token(target, rng):
    stream = target.stream()
    token = stream.token()
    sock = connect(target.data_port)
    sock.sendall(token[:rng.randrange(1, len(token))])
    if rng.random() < 0.5:
        sock.shutdown(socket.SHUT_WR)
        assert refused(sock)
        sock.close()
    else:
        reset(sock)
    _binds(target, token)
    stream.close()


def wrong_token(target, rng):
    stream = target.stream()
    token = stream.token()
    bit = rng.randrange(len(token) * 8)
    wrong = bytearray(token)
    wrong[bit // 8] ^= 1 << bit % 8
    assert present(target.data_port, bytes(wrong)) is None
    _binds(target, token)
    stream.close()


def replayed_token(target, rng):
    stream = target.stream()
    token = stream.token()
    sock = present(target.data_port, token)
    assert sock is not None
    assert present(target.data_port, token) is None
    Bound(target, stream, sock, rng).push(with_extra=False)  # the first connection still is the channel
    sock.close()
    stream.close()


def superseded_token(target, rng):
    stream = target.stream()
    old = stream.token()
    if rng.random() < 0.5:  # a second token withdraws the first
        new = stream.token()
        assert present(target.data_port, old) is None
        _binds(target, new)
        stream.close()
    else:  # so does the end of the stream
        stream.close()
        assert present(target.data_port, old) is None


def another_streams_token(target, rng):
    mine, other = target.stream(), target.stream()
    mine.token()
    sock = present(target.data_port, other.token())
    assert sock is not None
    key = rng.choice(sorted(SHAPES))
    request, _ = _push_request(target, [Item(key, _value(key, rng))], min_bytes=1)
    answer = mine.call(request)  # its entries say their bytes follow on a channel it has not got
    assert _code(answer) == grpc.StatusCode.FAILED_PRECONDITION, answer
    Bound(target, other, sock, rng).push(with_extra=False)
    sock.close()
    mine.close()
    other.close()


def nothing(target, rng):
    sock = connect(target.data_port)
    if rng.random() < 0.5:
        sock.close()
    else:
        reset(sock)


def half_token_then_stall(target, rng):
    stream = target.stream()
    sock = connect(target.data_port)
    sock.sendall(stream.token()[:rng.randrange(0, TOKEN_BYTES)])
    target.stalled.append(sock)  # checked at the end: closed by the server
    stream.close()


# ---- bound channels ------------------------------------------------------------------------

def _push_request(target, items, min_bytes, timeout_ms=int(WAIT * 1000)):
    """A Session push (serialized by the codec, parsed by the generated class) of ``items``,
    those of ``min_bytes`` or more announced on the channel; and the bytes that follow."""
    items, arrays = following(items, min_bytes)
    fields = dict(op=kvstore_pb2.SESSION_OP_PUSH, timeout_ms=timeout_ms, **target.caller)
    data = encode_stream(kvstore_pb2.SessionRequest, items, fields, chunk_bytes=1 << 62)[0]
    return kvstore_pb2.SessionRequest.FromString(data), b"".join(array.tobytes() for array in arrays)


class Bound:
    """A stream with a channel bound to ``sock`` (None: closed on this side), and the bytes sent
    on it that no call consumed yet."""

    def __init__(self, target, stream, sock, rng):
        self.target, self.stream, self.sock, self.rng = target, stream, sock, rng
        self.unread = b""
        self.dead = False  # the server closed the channel (a call that used it failed)
        self.ended = False  # the stream was cancelled

    def _items(self):
        keys = self.rng.sample(sorted(SHAPES), self.rng.randint(1, 3))
        return [Item(key, _value(key, self.rng)) for key in keys]

    def _send(self, data):
        """Send ``data`` on the channel, unless the server closed it meanwhile."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _closed_by_server(self):
        assert refused(self.sock), "the server kept the channel of a failed call"
        self.close()
        self.dead = True

    def close(self):
        if self.sock is not None:
            reset(self.sock) if self.rng.random() < 0.5 else self.sock.close()
            self.sock = None

    def reopen(self):
        """A new token on the stream: the server closes the old channel; bind the new one."""
        old = self.sock
        token = self.stream.token()
        if old is not None:
            assert refused(old), "a new token left the old channel open"
            old.close()
        self.unread = self.rng.randbytes(self.rng.randint(1, 64)) if self.rng.random() < 0.2 else b""
        self.sock = present(self.target.data_port, token, small_buffer=self.rng.random() < 0.5,
                            pieces=self.rng.choice([1, 1, 2, 5]), then=self.unread)
        assert self.sock is not None
        self.dead = False

    def push(self, with_extra=None):
        """A push whose bytes come whole, then more (``with_extra``; None: at random), after the
        bytes left unread: each value takes the next bytes of the channel."""
        if with_extra is None:
            with_extra = self.rng.random() < 0.5
        extra = self.rng.randbytes(self.rng.randint(1, 4096)) if with_extra else b""
        request, announced = _push_request(self.target, self._items(), self.rng.choice([1, 4096]))
        self.stream.send(request)
        self._send(announced + extra)
        answer = self.stream.answer()
        assert answer.code == 0, answer
        channel_bytes = self.unread + announced + extra
        for entry in request.frame.entries:
            data = entry.tensor.data
            if entry.HasField("channel"):
                data, channel_bytes = channel_bytes[:entry.channel.length], channel_bytes[entry.channel.length:]
            value = np.frombuffer(data, numpy_dtype(entry.tensor.dtype)).reshape(tuple(entry.tensor.shape))
            self.target.expected[entry.key.str_key] = value.copy()
        self.unread = channel_bytes

    def unannounced(self):
        extra = self.rng.randbytes(self.rng.randint(1, 4096))
        self._send(extra)
        self.unread += extra

    def push_cut(self):
        """A push whose bytes stop in the middle of a value: then a close or a reset, or silence
        past the call's timeout. Refused; nothing stored; the server closes the channel."""
        close = self.rng.random() < 0.5
        # No timeout before a close: the server waits for the bytes until the connection ends.
        request, announced = _push_request(self.target, self._items(), 1, timeout_ms=0 if close else STALL_MS)
        needed = len(announced) - len(self.unread)
        if needed <= 0:
            return self.push()
        self.stream.send(request)
        self._send(announced[:self.rng.randrange(needed)])
        if close:
            self.close()
        answer = self.stream.answer()
        assert _code(answer) == (grpc.StatusCode.UNAVAILABLE if close else grpc.StatusCode.DEADLINE_EXCEEDED), answer
        if not close:
            self._closed_by_server()
        self.dead = True

    def push_misannounced(self):
        """A push whose announced length does not match its entry's shape and dtype: refused
        before any byte is read; the server closes the channel."""
        request, announced = _push_request(self.target, self._items(), 1)
        entry = self.rng.choice([entry for entry in request.frame.entries if entry.HasField("channel")])
        change = self.rng.randrange(4)
        if change == 0:
            entry.channel.length = self.rng.choice([0, 1, entry.channel.length - 1, entry.channel.length + 1,
                                                    entry.channel.length * 2, 1 << 40])
        elif change == 1:
            itemsize = numpy_dtype(entry.tensor.dtype).itemsize
            entry.tensor.dtype = wire_dtype(self.rng.choice([d for d in (np.int8, np.float16, np.float32, np.float64)
                                                             if np.dtype(d).itemsize != itemsize]))
        elif change == 2:
            entry.tensor.shape.append(self.rng.choice([0, 2, 3]))
        else:
            entry.tensor.shape[0] += self.rng.choice([-1, 1])
        self.stream.send(request)
        if self.rng.random() < 0.5:
            self._send(announced)
        answer = self.stream.answer()
        assert _code(answer) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), answer
        self._closed_by_server()

    def push_mismatched(self):
        """A push announced as its entry says, of a shape or dtype the stored key does not have:
        its bytes are read, then it is refused; nothing stored; the server closes the channel."""
        key = self.rng.choice(sorted(SHAPES))
        value = _value(key, self.rng)
        value = value.astype(np.float64 if value.dtype != np.float64 else np.float32) if self.rng.random() < 0.5 \
            else value.reshape(-1)[:-1]
        request, announced = _push_request(self.target, [Item(key, value)], 1)
        if len(announced) < len(self.unread):
            return self.push()
        self.stream.send(request)
        self._send(announced[len(self.unread):])
        answer = self.stream.answer()
        assert _code(answer) == grpc.StatusCode.INVALID_ARGUMENT, answer
        self._closed_by_server()

    def pull(self):
        """A pull whose values of ``min_bytes`` or more follow on the channel: read whole and
        compared, or stopped in the middle of a value (closed at once, or left unread past the
        call's timeout; then the stream's next call is answered)."""
        keys = self.rng.sample(sorted(SHAPES), self.rng.randint(1, 3))
        stop = self.rng.random() < 0.4
        request = self.target.request(kvstore_pb2.SESSION_OP_PULL, timeout_ms=STALL_MS if stop else int(WAIT * 1000),
                                      data_channel_min_bytes=self.rng.choice([1, 4096, 1 << 20]))
        for key in keys:
            request.keys.add(str_key=key)
        answer = self.stream.call(request)
        if stop and _code(answer) == grpc.StatusCode.DEADLINE_EXCEEDED:  # a server too busy to pull within STALL_MS
            return self._closed_by_server()
        assert answer.code == 0, answer
        following_bytes = sum(entry.channel.length for entry in answer.frame.entries if entry.HasField("channel"))
        if stop and following_bytes:
            self._read(self.rng.randrange(following_bytes))
            how = self.rng.randrange(3)
            if how == 1:  # the server gives up sending after the call's timeout; the stream answers on
                assert self.stream.call(self.target.request(kvstore_pb2.SESSION_OP_PULL, keys=request.keys)).code == 0
            elif how == 2:  # the stream ends while the server sends
                self.stream.cancel()
                self.ended = True
            self.close()
            return
        for entry in answer.frame.entries:
            data = self._read(entry.channel.length) if entry.HasField("channel") else entry.tensor.data
            value = np.frombuffer(data, numpy_dtype(entry.tensor.dtype)).reshape(tuple(entry.tensor.shape))
            assert same(value, self.target.expected[entry.key.str_key]), f"pulled {entry.key.str_key!r}"

    def _read(self, size):
        data = bytearray(size)
        view, filled = memoryview(data), 0
        while filled < size:
            count = self.sock.recv_into(view[filled:])
            assert count, "the server closed the channel in the middle of a pull"
            filled += count
        return bytes(data)

    def values_on_a_call_that_takes_none(self, op=None):
        """A request to register or unregister a shared-memory region or to open a channel
        (``op``; None: one at random) that carries entries announced on the channel: refused;
        the server closes the channel (else the bytes it did not read would be the next call's)."""
        region = shm.Region(shm.capacity_for(1))
        try:
            described = kvstore_pb2.SharedMemoryRegion(pid=os.getpid(), fd=region.fd, size=region.size,
                                                       token=region.token)
            request, announced = _push_request(self.target, self._items(), 1)
            request.op = op or self.rng.choice(self.target.ops_without_values)
            if request.op == kvstore_pb2.SESSION_OP_REGISTER_REGION:
                request.region.CopyFrom(described)
            elif request.op == kvstore_pb2.SESSION_OP_UNREGISTER_REGION:  # of a region that is registered
                registered = self.stream.call(self.target.request(kvstore_pb2.SESSION_OP_REGISTER_REGION,
                                                                  region=described))
                assert registered.code == 0, registered
                request.region_id = registered.region_id
            answer = self.stream.call(request)
            assert _code(answer) == grpc.StatusCode.INVALID_ARGUMENT, answer
            self._send(announced)  # after the answer: a server that does not read them would hold the sender
            self._closed_by_server()
        finally:
            region.close()

    def over_the_limit(self, op=None, wait_only=None):
        """A push, or an Init that only waits (its values unused), announcing more bytes on the
        channel than --max-inflight-bytes, in one to three entries: refused before a byte is
        read; the server closes the channel. ``op``, ``wait_only``: None for a random choice."""
        request, _ = _push_request(self.target, self._items(), 1, timeout_ms=2000)
        request.op = op or self.rng.choice([kvstore_pb2.SESSION_OP_PUSH, kvstore_pb2.SESSION_OP_PUSH_PULL,
                                            kvstore_pb2.SESSION_OP_INIT])
        request.wait_only = request.op == kvstore_pb2.SESSION_OP_INIT and (
            self.rng.random() < 0.7 if wait_only is None else wait_only)
        for entry in request.frame.entries:
            del entry.tensor.shape[:]
            entry.tensor.dtype = wire_dtype(np.float32)
            entry.tensor.shape.append(MAX_INFLIGHT // 4 // len(request.frame.entries) + 1)
            entry.channel.length = entry.tensor.shape[0] * 4
        answer = self.stream.call(request)
        assert _code(answer) == grpc.StatusCode.RESOURCE_EXHAUSTED, answer
        self._closed_by_server()

    def on_dead_channel(self):
        """A call that needs the channel after the server closed it: refused, nothing stored."""
        if self.rng.random() < 0.5:
            request, _ = _push_request(self.target, self._items(), 1)
        else:
            request = self.target.request(kvstore_pb2.SESSION_OP_PULL, data_channel_min_bytes=1)
            request.keys.add(str_key=self.rng.choice(sorted(SHAPES)))
        assert _code(self.stream.call(request)) == grpc.StatusCode.FAILED_PRECONDITION

    def cancel_mid_push(self):
        """The stream cancelled while the server waits for a push's bytes: nothing stored; the
        server closes the channel with the stream."""
        request, announced = _push_request(self.target, self._items(), 1)
        self.stream.send(request)
        self._send(announced[:self.rng.randrange(len(announced))])
        self.stream.cancel()
        self.ended = True
        self._closed_by_server()


STEPS = [Bound.push, Bound.unannounced, Bound.push_cut, Bound.push_misannounced, Bound.push_mismatched, Bound.pull,
         Bound.reopen, Bound.values_on_a_call_that_takes_none, Bound.over_the_limit]


def bound_channel(target, rng):
    """A random sequence of calls on a stream with a bound channel."""
    stream = target.stream()
    bound = Bound(target, stream, None, rng)
    bound.reopen()
    for _ in range(rng.randint(1, 6)):
        if bound.ended:
            return
        if bound.dead and rng.random() < 0.3:
            bound.on_dead_channel()
        if bound.sock is None:
            bound.reopen()
        rng.choice(STEPS)(bound)
    if rng.random() < 0.2 and bound.sock is not None and not bound.unread:
        bound.cancel_mid_push()
    else:
        bound.close()
        stream.close()


HANDSHAKES = [garbage_token, truncated_token, wrong_token, replayed_token, superseded_token, another_streams_token,
              nothing, half_token_then_stall]


@contextlib.contextmanager
def fuzzed(tmp_path):
    """The Target of a new server."""
    with Cluster(num_workers=1, mode="async", tmp_path=tmp_path,
                 server_args=["--max-inflight-bytes", MAX_INFLIGHT]) as cluster, \
            tensorkv.create("dist_async", servers=cluster.addresses, transport="grpc", timeout=WAIT) as kv, \
            grpc.insecure_channel(cluster.addresses[0], options=[("grpc.max_receive_message_length", -1)]) as channel:
        yield Target(cluster, kv, channel)


def test_data_channel_framing_never_crashes_leaks_or_changes_state_when_refused(seed, tmp_path):
    rng = random.Random(seed)
    with fuzzed(tmp_path) as target:
        target.check("start")
        descriptors = target.fds()
        for n in range(CASES):
            case = rng.choice(HANDSHAKES + [bound_channel] * len(HANDSHAKES))
            what = f"seed {seed}, case {n} ({case.__name__})"
            try:
                case(target, rng)
            except (AssertionError, OSError) as error:
                raise AssertionError(f"{what}: {error}") from error
            target.check(what)
        for sock in target.stalled:
            sock.settimeout(HANDSHAKE_TIMEOUT + 5)
            assert refused(sock), f"seed {seed}: a connection that sent half a token was not closed"
            sock.close()
        wait_until(lambda: target.fds() <= descriptors,
                   f"seed {seed}: the server's descriptors back to {descriptors} (now {target.fds()})")


def test_what_the_fuzzer_found(tmp_path):
    """The calls whose answers the fuzzer found wrong, each once. Before the fixes: a request
    to open a channel or to (un)register a region answered its entries' announcement with OK and
    left their bytes on the channel, where the next push read them as its own values; an Init
    that only waits counted no value against --max-inflight-bytes, so that the server
    allocated and read whatever its entries announced on the channel."""
    rng = random.Random(0)
    with fuzzed(tmp_path) as target:
        stream = target.stream()
        bound = Bound(target, stream, None, rng)
        for op in target.ops_without_values:
            bound.reopen()
            bound.values_on_a_call_that_takes_none(op)
            bound.reopen()
            bound.push()  # stores exactly its own bytes
        bound.reopen()
        bound.over_the_limit(kvstore_pb2.SESSION_OP_INIT, wait_only=True)
        bound.close()
        stream.close()
        target.check("the calls the fuzzer found")
