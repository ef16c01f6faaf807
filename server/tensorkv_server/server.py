"""Wiring of the grpc.aio server: the KVStoreService, the MaintenanceService, health,
reflection, and a clean stop on SIGTERM/SIGINT."""
import asyncio
import dataclasses
import errno
import logging
import signal
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tensorkv.wire.grpc_options import SERVER_OPTIONS
from tensorkv.v1 import kvstore_pb2, maintenance_pb2
from tensorkv.words import plural

from . import metrics
from .datachan import DataPort, bare_host
from .maintenance import MaintenanceService
from .limits import Limits, max_call_bytes
from .service import KVStoreService, add_to_server
from .security import ServerSecurity

log = logging.getLogger(__name__)

# gRPC binds with SO_REUSEPORT by default, so a second server on a port in use would start
# and the kernel would split the workers' connections between the two.
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name
MAINTENANCE = maintenance_pb2.DESCRIPTOR.services_by_name["MaintenanceService"]


class ListenError(Exception):
    """A port this server cannot listen on (in use by another process, or not allowed)."""


def _listen_error(flag, host, port, error):
    if error.errno == errno.EADDRINUSE:
        return ListenError(f"{flag} {port}: port {port} on {host} is in use by another process "
                           "(another tensorkv-server?)")
    return ListenError(f"{flag} {port}: cannot listen on {host}:{port}: {error.strerror}")


def check_free(host, port, flag):
    """Raise ListenError naming ``flag`` unless this process may listen on host:``port`` (0:
    any free port), tried the way gRPC and DataPort bind: gRPC's own bind failure says why
    only in its log, and a server that cannot start should say so before it loads anything."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(bare_host(host), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ListenError(f"--host {host}: cannot listen there: {error.strerror}") from None
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as error:
                raise _listen_error(flag, host, port, error) from None


_GRPC_MAX = (1 << 31) - 1  # the longest message gRPC takes
# Calls open at once on one connection (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS; gRPC's own
# default sets no bound): a client's further calls wait until one ends. A worker holds its
# Session stream and a call or two per thread that uses the store.
MAX_CONCURRENT_STREAMS = 100


def _options(limits):
    """The gRPC server's options: a message longer than a call may be is refused unread
    (RESOURCE_EXHAUSTED; gRPC takes at most 2 GiB - 1), and MAX_CONCURRENT_STREAMS calls per
    connection. A call without a valid token is refused before its request is read
    (security.TokenInterceptor)."""
    longest = min(max_call_bytes(limits) or _GRPC_MAX, _GRPC_MAX)
    return [option for option in SERVER_OPTIONS if option[0] != "grpc.max_receive_message_length"] + \
        [("grpc.max_receive_message_length", longest), ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS)] + \
        EXCLUSIVE_PORT


class SnapshotFailed(Exception):
    """The snapshot at stop could not be written: what changed since the last one is lost."""


async def _tick(liveness):
    """Tell ``liveness`` (metrics.Liveness) that the event loop runs, every TICK seconds."""
    while True:
        liveness.tick = liveness.clock()
        await asyncio.sleep(liveness.TICK)


async def _every(seconds, take):
    """Call ``take`` every ``seconds`` for ever; after a failure (which ``take`` logs and
    counts), the next one is tried."""
    while True:
        await asyncio.sleep(seconds)
        try:
            await take()
        except OSError:
            pass


@dataclasses.dataclass
class ServerConfig:
    """How :func:`serve` serves: the tensorkv-server flags it takes, each field named after its
    flag (``python -m tensorkv_server --help``)."""

    host: str = "127.0.0.1"
    port: int = 50051
    grace: float = 5.0  # seconds calls in flight get to finish on SIGTERM/SIGINT
    device: str = "cpu"  # where values live, as backend.select names it (Info and the log say it)
    shared_memory: bool = True  # whether Session streams may register shared-memory regions
    data_port: int | None = 0  # the data channel's port (0: any free one); None: no data channel
    advertised_data_port: int = 0  # the data port Info names, when not the one listened on (0)
    limits: Limits = dataclasses.field(default_factory=Limits)  # what one request may carry
    security: ServerSecurity = dataclasses.field(default_factory=ServerSecurity)  # TLS and tokens
    snapshot_interval: float = 0.0  # seconds between snapshots (0: only at stop and on a Snapshot call)


async def serve(coordinator, config, snapshots=None, interceptors=()):
    """Serve ``coordinator`` as ``config`` (a ServerConfig) says until SIGTERM or SIGINT, then
    stop: waits in progress fail with UNAVAILABLE, other calls get ``config.grace`` seconds to
    finish; the Session streams still open then end with UNAVAILABLE at their next call's
    boundary (streams.OpenStreams), before gRPC stops. The gRPC port and the data channel take
    ``config.security``; ``interceptors``: more grpc.aio server interceptors, which run before
    the token check (so that refused calls are counted too). ``snapshots``: a
    snapshot.Snapshots, taken every ``config.snapshot_interval`` seconds and once more after the
    calls in flight at stop have finished."""
    server = grpc.aio.server(options=_options(config.limits),
                             interceptors=[*interceptors, *config.security.interceptors()])
    data_port = _listen(server, config)
    servicer = KVStoreService(coordinator, config.shared_memory, data_port, config.limits, snapshots, config.device)
    health_servicer = await _start(server, servicer, coordinator, data_port)
    # before the line that says so: a SIGTERM right after it stops the server cleanly
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("serving %s on %s:%s: %s, %s mode, values on %s, round timeout %g s, lease timeout %g s, "
             "shared memory %s, data channel %s, %s", SERVICE_NAME, config.host, config.port,
             plural(coordinator.num_workers, "worker"), coordinator.mode, config.device, coordinator.round_timeout,
             coordinator.members.lease_timeout, "on" if servicer.shared_memory else "off",
             f"on port {data_port.port}" if data_port else "off", config.security.describe(),
             extra={"event": "server_started"})
    await _until(stop, snapshots, config.snapshot_interval)
    log.info("stopping: waits in progress fail with UNAVAILABLE, other calls have %g s to finish", config.grace,
             extra={"event": "server_stopping"})
    await health_servicer.enter_graceful_shutdown()
    coordinator.shutdown()
    if data_port is not None:
        data_port.close()  # no new channels; the streams' own close as they end
    stopping_since = loop.time()
    await servicer.streams.end(config.grace)
    await server.stop(max(0.0, config.grace - (loop.time() - stopping_since)))
    await _last_snapshot(snapshots)


def _listen(server, config):
    """Make ``server`` listen on config's host and port, and open its data port: the
    datachan.DataPort, or None without a data channel."""
    host, port, security = config.host, config.port, config.security
    address = f"{host}:{port}"
    try:
        bound = security.add_port(server, address)
    except RuntimeError:  # gRPC raises for a port taken since check_free looked
        bound = 0
    if bound == 0:
        check_free(host, port, "--port")  # says why (e.g. taken since it last looked), where it can
        raise ListenError(f"--port {port}: cannot listen on {address}")
    if config.data_port is None:
        return None
    try:  # after the gRPC port: a data port 0 must not take --port
        return DataPort(host, config.data_port, security.data_channel_context, config.advertised_data_port,
                        config.limits.progress_timeout)
    except OSError as error:
        raise _listen_error("--data-port", host, config.data_port, error) from None


async def _start(server, servicer, coordinator, data_port):
    """Add the services to ``server``, start it and ``data_port`` (or None), and say SERVING:
    the health servicer."""
    add_to_server(servicer, server)
    add_to_server(MaintenanceService(coordinator, servicer.limits.max_key_bytes, servicer.snapshots), server, MAINTENANCE)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, MAINTENANCE.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    await server.start()
    if data_port is not None:
        data_port.start()
    for service in ("", SERVICE_NAME, MAINTENANCE.full_name):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return health_servicer


async def _until(stop, snapshots, snapshot_interval):
    """Serve until ``stop`` is set: snapshots every ``snapshot_interval`` seconds (0: none), and
    the liveness ticks."""
    periodic = asyncio.create_task(_every(snapshot_interval, snapshots.take)) \
        if snapshots and snapshot_interval > 0 else None
    metrics.LIVENESS.state = "serving"
    ticking = asyncio.create_task(_tick(metrics.LIVENESS))
    await stop.wait()
    metrics.LIVENESS.state = "stopping"
    ticking.cancel()
    if periodic is not None:
        periodic.cancel()


async def _last_snapshot(snapshots):
    """Take the snapshot at stop (``snapshots``: None, none) and say the server stopped;
    SnapshotFailed if it could not be written."""
    failed = None
    if snapshots is not None:
        try:
            await snapshots.take()
        except OSError as error:  # logged by take; the process then ends with status 1
            failed = error
    log.info("stopped", extra={"event": "server_stopped"})
    if failed is not None:
        raise SnapshotFailed(f"the last snapshot failed: {failed}")
