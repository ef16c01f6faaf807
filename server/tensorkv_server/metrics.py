"""The server's Prometheus metrics (the ``tensorkv_`` family) and their HTTP endpoint.

The state they describe is counted where it changes (rounds.py, service.py), with one call
or one addition here. The counts on the path of every call are plain numbers in
:data:`COUNTS`: the event loop is their only writer, an addition costs a tenth of a
prometheus_client Counter's locked increment, and the scrape (another thread) reads them.
No label takes a key name, so the series stay few however many keys are stored. Process
metrics (``process_``, ``python_``) come with prometheus-client's default registry, the
gRPC ones from :mod:`.grpc_metrics`.
"""
import collections
import io
import logging
import selectors
import socket
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import numpy as np
import prometheus_client
from prometheus_client import Gauge, Histogram
from prometheus_client.exposition import MetricsHandler
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from .grpc_metrics import MetricsInterceptor

log = logging.getLogger(__name__)

prometheus_client.disable_created_metrics()  # no _created series beside each counter

TRANSPORTS = ("grpc", "shm", "datachan")


class Counts:
    """What the server holds and has done, as numbers the event loop adds to."""

    def __init__(self):
        self.keys = 0
        self.stored_bytes = 0
        self.pushes = 0  # values pushed and accepted: one per key of each push
        self.pulls = 0  # values pulled: one per key of each pull
        self.rounds_completed = 0
        self.rounds_aborted = 0
        self.workers = 0  # ranks registered now
        self.expired_leases = 0
        self.snapshots_written = 0
        self.snapshots_failed = 0
        self.last_snapshot_time = 0.0  # Unix seconds of the last snapshot written (0: none)
        self.session_errors = {}  # status code name -> calls on Session streams answered with it
        self.bytes_in = dict.fromkeys(TRANSPORTS, 0)
        self.bytes_out = dict.fromkeys(TRANSPORTS, 0)


COUNTS = Counts()

# Up to --round-timeout's default (60 s): the slow rounds an operator looks for are in buckets
# of their own, not all in +Inf past Prometheus' default 10 s.
ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
ROUND_SECONDS = Histogram(
    "tensorkv_round_seconds", "From the first push of a round to its last, for rounds of several workers.",
    buckets=ROUND_BUCKETS)
LAST_WORKER_WAIT_SECONDS = Histogram(
    "tensorkv_round_last_worker_wait_seconds",
    "From the next-to-last push of a round to its last: how long a round waited for its last worker.",
    buckets=ROUND_BUCKETS)


def received(transport, nbytes):
    COUNTS.bytes_in[transport] += nbytes


def sent(transport, nbytes):
    COUNTS.bytes_out[transport] += nbytes


def counting_shm(resolve):
    """``resolve(region_id, offset, length)`` of a stream's regions, counting the bytes it
    hands out as values received in shared memory."""
    def counted(region_id, offset, length):
        COUNTS.bytes_in["shm"] += length
        return resolve(region_id, offset, length)
    return counted


def session_error(code):
    """Count a call on a Session stream answered with the status ``code`` (its name)."""
    COUNTS.session_errors[code] = COUNTS.session_errors.get(code, 0) + 1


def cleared():
    """Count every stored key as dropped (Reset, or a run that replaces them)."""
    COUNTS.keys = COUNTS.stored_bytes = 0


def stored(items):
    """Count the values of ``items`` (codec.Item) as new keys stored."""
    COUNTS.keys += len(items)
    COUNTS.stored_bytes += sum(item.array.nbytes for item in items)


def round_completed(opened, last_but_one, now):
    """A round of several workers completed at ``now``: its first push came at ``opened``, the
    one before the last at ``last_but_one`` (monotonic seconds)."""
    COUNTS.rounds_completed += 1
    ROUND_SECONDS.observe(now - opened)
    LAST_WORKER_WAIT_SECONDS.observe(now - last_but_one)


class _CountsCollector:
    """:data:`COUNTS` as Prometheus metrics, read at each scrape."""

    def collect(self):
        counts = COUNTS
        yield GaugeMetricFamily("tensorkv_keys", "Keys stored.", value=counts.keys)
        yield GaugeMetricFamily("tensorkv_stored_bytes", "Bytes of the values stored (of the slices this "
                                "server holds).", value=counts.stored_bytes)
        yield CounterMetricFamily("tensorkv_pushes", "Values pushed and accepted: one per key of each push.",
                                  value=counts.pushes)
        yield CounterMetricFamily("tensorkv_pulls", "Values pulled: one per key of each pull.", value=counts.pulls)
        rounds = CounterMetricFamily("tensorkv_rounds", "Sync rounds (of one key), by how they ended.",
                                     labels=["outcome"])
        rounds.add_metric(["completed"], counts.rounds_completed)
        rounds.add_metric(["aborted"], counts.rounds_aborted)
        yield rounds
        moved = CounterMetricFamily(
            "tensorkv_transport_bytes", "Bytes received (in) and sent (out): grpc counts the messages of Init, "
            "Push, Pull, PushPull and Session; shm the values that travel in shared memory; datachan the bytes on "
            "the data channel (values, and the Session calls and answers framed there).", labels=["direction", "transport"])
        for direction, by_transport in (("in", counts.bytes_in), ("out", counts.bytes_out)):
            for transport in TRANSPORTS:
                moved.add_metric([direction, transport], by_transport[transport])
        yield moved
        yield GaugeMetricFamily("tensorkv_registered_workers", "Ranks registered now.", value=counts.workers)
        yield CounterMetricFamily("tensorkv_expired_leases", "Leases that expired: a worker not heard from "
                                  "within --lease-timeout, whose rank was freed.", value=counts.expired_leases)
        snapshots = CounterMetricFamily("tensorkv_snapshots", "Snapshots of the server's state (--state-dir), by "
                                        "outcome; the log names each failure's error.", labels=["outcome"])
        snapshots.add_metric(["written"], counts.snapshots_written)
        snapshots.add_metric(["failed"], counts.snapshots_failed)
        yield snapshots
        yield GaugeMetricFamily("tensorkv_last_snapshot_timestamp_seconds", "When the state was last saved: a "
                                "snapshot written, or one due that found nothing changed since the newest (Unix time; "
                                "0: none since the server started).", value=counts.last_snapshot_time)
        errors = CounterMetricFamily(
            "tensorkv_session_errors", "Calls on Session streams (and on their data channels) answered with an "
            "error, by status code (grpc_code, as grpc_server_handled_total names it, where the errors of the other "
            "RPCs are).", labels=["grpc_code"])
        for code, count in sorted(counts.session_errors.items()):
            errors.add_metric([code], count)
        yield errors


REGISTRY.register(_CountsCollector())

SNAPSHOT_ROOM = Gauge(
    "tensorkv_snapshot_room_bytes",
    "Bytes the --state-dir volume has for snapshots: its free space and the snapshot files the server replaces in "
    "turn; two copies of the state (values and optimizer states) must fit, the newest snapshot being kept while the "
    "next is written (0: no --state-dir; NaN: the directory cannot be read).")

CERTIFICATE_EXPIRY = Gauge(
    "tensorkv_tls_certificate_expiry_timestamp_seconds",
    "When a TLS certificate file in use expires (--tls-cert: the first notAfter of its chain; --tls-client-ca: "
    "the last of its CAs), in Unix seconds: "
    "certificate=server for --tls-cert, client_ca for --tls-client-ca.", ["certificate"])


class Liveness:
    """Whether the server serves and its event loop runs, for ``GET /healthz`` on the metrics
    port (plain HTTP, which a Kubernetes httpGet probe speaks where the gRPC port is TLS). The
    loop sets ``tick`` every TICK seconds (server.serve); the check runs in the HTTP thread,
    so it still answers when the loop is stuck, and says so."""

    TICK = 1.0
    STALLED = 10.0  # seconds without a tick: the event loop is stuck (a long update is far shorter)

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.state = "starting"  # then "serving", then "stopping"
        self.tick = None

    def check(self):
        """(HTTP status, one line saying why)."""
        if self.state != "serving":
            return 503, self.state
        stalled = self.clock() - self.tick
        if stalled > self.STALLED:
            return 503, f"the event loop has not run for {stalled:.0f} s"
        return 200, "serving"


LIVENESS = Liveness()


class _Handler(MetricsHandler):
    """/healthz: LIVENESS; any other path: the metrics. One request per connection, whose head
    (``request``: (the socket, the bytes of the head)) was read by :class:`HttpPort`."""

    def setup(self):
        self.connection, head = self.request
        self.connection.settimeout(HttpPort.SEND_TIMEOUT)
        self.rfile = io.BytesIO(head)
        self.wfile = socketserver._SocketWriter(self.connection)

    def handle(self):
        self.handle_one_request()

    def do_GET(self):
        if urlparse(self.path).path != "/healthz":
            super().do_GET()
            return
        status, text = LIVENESS.check()
        body = (text + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class HttpPort:
    """The metrics port, whose connections cannot exhaust the server: one thread waits on all
    of them and reads each request's head as its bytes come; a request whose head is whole is
    answered by one of THREADS threads, then its connection is closed. At most CONNECTIONS are
    open, being answered or not: a new one closes the oldest that has not sent a whole head (so
    a probe always gets in; none left to close, the new one is), and one that has not within
    IDLE_TIMEOUT seconds is closed (a thread per connection, kept for ever, let idle
    connections take every thread the process may have)."""

    CONNECTIONS = 128
    THREADS = 4
    IDLE_TIMEOUT = 30.0
    HEAD_BYTES = 16 << 10  # a longer request head is refused (closed)
    SEND_TIMEOUT = 10.0  # seconds an answer may wait for the client to take it

    def __init__(self, host, port):
        bare = host[1:-1] if host.startswith("[") else host
        ipv6 = ":" in bare  # then both families, as the gRPC port serves them
        self._listener = socket.create_server((bare, port), family=socket.AF_INET6 if ipv6 else socket.AF_INET,
                                              dualstack_ipv6=ipv6 and socket.has_dualstack_ipv6())
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._waiting = collections.OrderedDict()  # socket -> (its peer, when it came, the head so far)
        self._answering = ThreadPoolExecutor(self.THREADS, thread_name_prefix="metrics-http")
        self._busy = 0  # connections handed to the threads and not yet closed
        self._busy_lock = threading.Lock()

    def serve_forever(self):
        while True:
            for selected, _ in self._selector.select(self.IDLE_TIMEOUT / 4):
                if selected.fileobj is self._listener:
                    self._accept()
                elif selected.fileobj in self._waiting:  # else closed by an _accept of this turn, to make room
                    self._read(selected.fileobj)
            self._close_idle()

    def _accept(self):
        try:
            conn, peer = self._listener.accept()
        except OSError as error:  # e.g. out of file descriptors
            log.warning("metrics port: accept failed: %s", error)
            time.sleep(0.1)
            return
        if len(self._waiting) + self._busy >= self.CONNECTIONS:
            if not self._waiting:
                conn.close()
                return
            self._close(next(iter(self._waiting)))
        conn.setblocking(False)
        self._waiting[conn] = peer, time.monotonic(), b""
        self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn):
        peer, came, head = self._waiting[conn]
        try:
            data = conn.recv(self.HEAD_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        head += data
        if not data or len(head) > self.HEAD_BYTES:
            self._close(conn)
        elif b"\r\n\r\n" in head or b"\n\n" in head:
            self._selector.unregister(conn)
            del self._waiting[conn]
            conn.setblocking(True)
            with self._busy_lock:
                self._busy += 1
            self._answering.submit(self._answer, conn, peer, head)
        else:
            self._waiting[conn] = peer, came, head

    def _answer(self, conn, peer, head):
        try:
            _Handler((conn, head), peer, self)
        except Exception as error:  # e.g. a client gone mid-answer: the others are served still
            log.debug("metrics port: answering %s failed: %s", peer, error)
        finally:
            conn.close()
            with self._busy_lock:
                self._busy -= 1

    def _close_idle(self):
        stale = time.monotonic() - self.IDLE_TIMEOUT
        while self._waiting:
            conn, (_, came, _) = next(iter(self._waiting.items()))
            if came > stale:
                break
            self._close(conn)

    def _close(self, conn):
        self._selector.unregister(conn)
        del self._waiting[conn]
        conn.close()


def start(port, host, engine):
    """Serve the metrics as Prometheus text on http://host:port/metrics, and the server's
    liveness on /healthz (Liveness), in a thread (HttpPort); the server interceptors that
    record the gRPC metrics. An ``engine`` on CuPy adds the memory of its device."""
    if engine.xp is not np:
        _watch_device_memory(engine)
    http = HttpPort(host, port)
    threading.Thread(target=http.serve_forever, name="metrics-http", daemon=True).start()
    return [MetricsInterceptor()]


def _watch_device_memory(engine):
    pool = engine.xp.get_default_memory_pool()
    memory = Gauge("tensorkv_device_memory_bytes", "Memory of the GPU the values live on: used by arrays, "
                   "and held by CuPy's pool (used and cached).", ["kind"])
    for kind, measure in (("used", pool.used_bytes), ("held", pool.total_bytes)):
        memory.labels(kind).set_function(lambda measure=measure: _on_device(engine, measure))


def _on_device(engine, measure):
    with engine.on_device():  # the pool counts per device, and this runs in the HTTP thread
        return measure()

INFLIGHT_BYTES = Gauge(
    "tensorkv_inflight_bytes",
    "Bytes of the server-wide budget for values in flight (--max-inflight-bytes) that calls hold now: values "
    "being received or waiting to be merged, answers being built or sent.")
