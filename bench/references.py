"""Reference numbers for tensorkv's benchmark, measured on 127.0.0.1 in this run.

A push+pull round trip of N payload bytes moves 2*N bytes, so throughput is
2*N / (median round-trip time), in GB/s (1e9 bytes per second).  Each echo
server runs in its own spawned process, so the client's GIL does not slow it,
and is stopped by its PID (terminate, then kill) when the function returns.
"""

import contextlib
import functools
import multiprocessing
import socket
import statistics
import struct
import threading
from concurrent import futures

import grpc
import numpy as np

import common

MiB = 1 << 20
SIZES = (4 << 10, 64 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
SMALL = 64  # 16 float32 values
CHUNK = MiB  # message size of the streaming gRPC variant
REPEATS = 7
SMALL_REPEATS = 2000
START_TIMEOUT = 30.0  # seconds for a server process to report its port
CALL_TIMEOUT = 60.0  # seconds for one socket operation or one RPC
STOP_TIMEOUT = 5.0  # seconds to wait after terminate, then after kill

_HEADER = struct.Struct("!QQ")  # payload size, number of round trips
_SERVICE = "tensorkv.bench.Echo"
_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]


def tcp_echo(sizes=SIZES, repeats=REPEATS):
    """Raw loopback TCP echo: returns {payload bytes: GB/s both ways}."""
    with _tcp_connection() as sock:
        return {n: common.gbps(n, _tcp_rtt(sock, n, repeats)) for n in sizes}


@contextlib.contextmanager
def tcp_echo_turns(nbytes):
    """Raw loopback TCP echo of ``nbytes`` that takes turns with a row: yields a function of
    ``count``, [the seconds of each of ``count`` round trips] (one worker's)."""
    with _tcp_connection() as sock:
        seconds = _echo_round_trips(sock, nbytes)
        yield lambda count: [seconds(count)]


def tcp_small_rtt(repeats=SMALL_REPEATS):
    """Raw loopback TCP echo of 64 bytes: returns {"rtt_us": median}."""
    with _tcp_connection() as sock:
        return {"rtt_us": _tcp_rtt(sock, SMALL, repeats) * 1e6}


def grpc_unary_echo(sizes=SIZES, repeats=REPEATS):
    """Plain gRPC-Python unary bytes echo: returns {payload bytes: GB/s}."""
    with _grpc_channel() as channel:
        echo = channel.unary_unary(f"/{_SERVICE}/Echo")
        return {n: common.gbps(n, common.median_time(functools.partial(
            echo, bytes(n), timeout=CALL_TIMEOUT), repeats)) for n in sizes}


def grpc_stream_echo(sizes=SIZES, repeats=REPEATS):
    """Plain gRPC-Python in 1 MiB chunks: a client-streaming push, then a
    server-streaming pull of the same bytes.  Returns {payload bytes: GB/s}."""
    with _grpc_channel() as channel:
        push = channel.stream_unary(f"/{_SERVICE}/Push")
        pull = channel.unary_stream(f"/{_SERVICE}/Pull")

        def round_trip(payload):
            push(_chunks(payload), timeout=CALL_TIMEOUT)
            return b"".join(pull(b"", timeout=CALL_TIMEOUT))

        return {n: common.gbps(n, common.median_time(functools.partial(
            round_trip, bytes(n)), repeats)) for n in sizes}


def grpc_small_rtt(repeats=SMALL_REPEATS):
    """Plain gRPC-Python unary echo of 64 bytes: returns {"rtt_us": median}."""
    with _grpc_channel() as channel:
        echo = channel.unary_unary(f"/{_SERVICE}/Echo")
        payload = bytes(SMALL)
        rtt = common.median_time(lambda: echo(payload, timeout=CALL_TIMEOUT), repeats)
        return {"rtt_us": rtt * 1e6}


@contextlib.contextmanager
def tcp_sum(nbytes, clients=2):
    """Raw loopback TCP carrying a synchronous round of ``clients`` (2 or more) workers, as the
    two-worker row does: each client process sends ``nbytes`` of float32 and gets back the sum
    of all clients' values from a server with a thread per client (NumPy's add, the GIL
    released in the socket calls). Yields a function of ``count``: each client's seconds of
    ``count`` round trips (after one warm-up round). Its sockets time out after CALL_TIMEOUT
    seconds idle, longer than any turn of a row."""
    if clients < 2:
        raise ValueError(f"a sum of {clients} client(s): tcp_sum takes 2 or more")
    ctx = multiprocessing.get_context("spawn")
    with _server_process(functools.partial(_sum_server, nbytes, clients)) as port:
        pipes, procs = [], []
        try:
            for rank in range(clients):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_sum_client, args=(child, port, nbytes, rank, clients), daemon=True,
                                   name=f"tcp-sum-client-{rank}")
                proc.start()
                child.close()
                pipes.append(parent)
                procs.append(proc)

            def seconds(count):
                for pipe, proc in zip(pipes, procs):
                    try:
                        pipe.send(count)
                    except OSError:
                        raise _client_gone(proc) from None
                return [_answer(pipe, proc) for pipe, proc in zip(pipes, procs)]

            yield seconds
        finally:
            for pipe in pipes:
                pipe.close()
            for proc in procs:
                _stop(proc)


def memcpy(nbytes=64 * MiB, repeats=REPEATS):
    """NumPy copy of `nbytes` in memory: returns {"gbps": bytes copied / s}."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    seconds = common.median_time(lambda: np.copyto(dst, src), repeats)
    return {"gbps": nbytes / seconds / 1e9}




def _chunks(payload):
    for start in range(0, len(payload), CHUNK):
        yield payload[start:start + CHUNK]


@contextlib.contextmanager
def _server_process(target):
    """Runs target(conn) in a spawned process; yields the port it sends."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(START_TIMEOUT):
            raise RuntimeError(f"{getattr(target, 'func', target).__name__} (pid {proc.pid}) did not "
                               f"start within {START_TIMEOUT:.0f}s")
        yield parent.recv()
    finally:
        parent.close()
        _stop(proc)


def _stop(proc):
    """Stops one process by its PID: terminate, then kill after a timeout."""
    proc.terminate()
    proc.join(STOP_TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join(STOP_TIMEOUT)


@contextlib.contextmanager
def _tcp_connection():
    with _server_process(_tcp_server) as port:
        with socket.create_connection(("127.0.0.1", port),
                                      timeout=CALL_TIMEOUT) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            yield sock


def _tcp_rtt(sock, nbytes, repeats):
    """Median seconds to send `nbytes` and receive them back."""
    return statistics.median(_echo_round_trips(sock, nbytes)(repeats))


def _echo_round_trips(sock, nbytes):
    """A function of ``count``: the seconds of each of ``count`` echoes of ``nbytes`` on
    ``sock`` (the first call makes one untimed echo first)."""
    payload = bytes(nbytes)
    back = memoryview(bytearray(nbytes))
    warmup = [1]

    def round_trip():
        sock.sendall(payload)
        _recv_into(sock, back)

    def seconds(count):
        first, warmup[0] = warmup[0], 0
        sock.sendall(_HEADER.pack(nbytes, first + count))
        return common.times(round_trip, count, warmup=first)

    return seconds


def _recv_into(sock, view):
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _tcp_server(conn):
    """Echo server: after each (size, count) header, echoes `count` messages
    of `size` bytes, each read whole before it is written back."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(START_TIMEOUT)
        conn.send(listener.getsockname()[1])
        sock, _ = listener.accept()
    with sock:
        sock.settimeout(CALL_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = memoryview(bytearray(_HEADER.size))
        while True:
            try:
                _recv_into(sock, header)
            except ConnectionError:
                return
            nbytes, count = _HEADER.unpack(header)
            buf = memoryview(bytearray(nbytes))
            for _ in range(count):
                _recv_into(sock, buf)
                sock.sendall(buf)


def _sum_server(nbytes, clients, conn):
    """Sums one ``nbytes`` float32 message of each of ``clients`` connections and sends the sum
    back to each, round after round, until a client closes."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(START_TIMEOUT)
        conn.send(listener.getsockname()[1])
        socks = [listener.accept()[0] for _ in range(clients)]
    received = [np.empty(nbytes // 4, np.float32) for _ in socks]
    total = np.empty_like(received[0])

    def add():
        np.add(received[0], received[1], out=total)
        for more in received[2:]:
            np.add(total, more, out=total)

    summed = threading.Barrier(clients, action=add)

    def serve(sock, values):
        with sock:
            sock.settimeout(CALL_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while True:
                    _recv_into(sock, memoryview(values).cast("B"))
                    summed.wait(CALL_TIMEOUT)
                    sock.sendall(total)  # the next add waits for every thread's next message
            except (OSError, threading.BrokenBarrierError):
                summed.abort()

    threads = [threading.Thread(target=serve, args=pair) for pair in zip(socks, received)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _sum_client(conn, port, nbytes, rank, clients):
    """One client of :func:`tcp_sum`: times ``count`` round trips for each ``count`` received on
    ``conn``, sends back the seconds (or what was wrong with the sum) until ``conn`` closes."""
    values = np.full(nbytes // 4, rank + 1.0, np.float32)
    back = np.empty_like(values)
    expected = np.full_like(values, clients * (clients + 1) / 2)
    with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def round_trip():
            sock.sendall(values)
            _recv_into(sock, memoryview(back).cast("B"))

        round_trip()
        while True:
            try:
                count = conn.recv()
            except EOFError:
                return
            seconds = common.times(round_trip, count, warmup=0)
            if not np.array_equal(back, expected):  # the last round trip's, off the clock
                wrong = np.flatnonzero(back != expected)
                conn.send(f"{wrong.size} values of the sum wrong, first [{wrong[0]}] = {back[wrong[0]]}, "
                          f"not {expected[0]}")
                return
            conn.send(seconds)


def _client_gone(proc):
    proc.join(STOP_TIMEOUT)
    return RuntimeError(f"TCP sum client (pid {proc.pid}) exited with {proc.exitcode}")


def _answer(pipe, proc):
    """What :func:`_sum_client` ``proc`` answered: its seconds (RuntimeError for anything else)."""
    try:
        if not pipe.poll(CALL_TIMEOUT):
            raise RuntimeError(f"TCP sum client (pid {proc.pid}) did not answer within {CALL_TIMEOUT:.0f}s")
        answer = pipe.recv()
    except (EOFError, OSError):
        raise _client_gone(proc) from None
    if isinstance(answer, str):
        raise RuntimeError(f"TCP sum client (pid {proc.pid}): {answer}")
    return answer


@contextlib.contextmanager
def _grpc_channel():
    with _server_process(_grpc_server) as port:
        with grpc.insecure_channel(f"127.0.0.1:{port}",
                                   options=_GRPC_OPTIONS) as channel:
            grpc.channel_ready_future(channel).result(timeout=START_TIMEOUT)
            yield channel


def _grpc_server(conn):
    """Sync gRPC server with identity (bytes) serializers: unary Echo, and a
    streaming Push / Pull pair that keeps the last pushed payload."""
    stored = [b""]

    def push(chunks, context):
        stored[0] = b"".join(chunks)
        return b""

    def pull(request, context):
        yield from _chunks(stored[0])

    handler = grpc.method_handlers_generic_handler(_SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
        "Push": grpc.stream_unary_rpc_method_handler(push),
        "Pull": grpc.unary_stream_rpc_method_handler(pull),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         handlers=(handler,), options=_GRPC_OPTIONS)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    server.wait_for_termination()
