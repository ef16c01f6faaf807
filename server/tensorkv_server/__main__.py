"""``tensorkv-server`` (also ``python -m tensorkv_server``): one parameter server."""
import argparse
import asyncio
import logging
import os
import signal
import sys

# gRPC's C core writes its own lines to stderr (a client's failed TLS handshake at INFO): only its
# errors, and none with JSON logs, whose every line must parse, unless the user chose a
# verbosity. gRPC reads it when it is imported, below: the arguments are not parsed yet.
if "GRPC_VERBOSITY" not in os.environ:
    _JSON = "--log-format=json" in sys.argv or ("--log-format", "json") in zip(sys.argv, sys.argv[1:])
    os.environ["GRPC_VERBOSITY"] = "NONE" if _JSON else "ERROR"

from tensorkv import __version__, env
from tensorkv.wire import allocator, codec
from tensorkv.backend import select
from tensorkv.update.engine import Engine

from . import limits, logs, metrics, security
from .rounds import ASYNC, SYNC, Coordinator
from .server import ListenError, ServerConfig, SnapshotFailed, check_free, serve
from .snapshot import NoSnapshotLoads, Snapshots, StateDirInUse, WrongServer

# Named, not __name__: under `python -m tensorkv_server` that is "__main__", outside the
# tensorkv_server logger hierarchy the other modules log in.
log = logging.getLogger("tensorkv_server.main")

MAX_LEASE_TIMEOUT = 86400.0  # a day: lease_ttl_ms is a uint32 of milliseconds


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="tensorkv-server", description="tensorkv parameter server (MXNet's KVStore over gRPC).")
    _add_job_arguments(parser)
    _add_transport_arguments(parser)
    limits.add_arguments(parser)
    _add_state_arguments(parser)
    security.add_arguments(parser)
    _add_log_arguments(parser)
    args = parser.parse_args(argv)
    _check(args, parser)
    return args


def _add_job_arguments(parser):
    """Where the server listens, for which job, and how long it waits."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (default %(default)s)")
    parser.add_argument("--num-workers", type=int, default=1, help="number of workers (default %(default)s)")
    parser.add_argument("--mode", choices=(SYNC, ASYNC), default=SYNC,
                        help="sync: merge the pushes of all workers per round; async: apply each push "
                             "(default %(default)s)")
    parser.add_argument("--round-timeout", type=float, default=60.0,
                        help="seconds a sync round, barrier or init waits for every worker before it is "
                             "aborted (default %(default)s)")
    parser.add_argument("--lease-timeout", type=float, default=10.0,
                        help="seconds a worker's registration lasts without a heartbeat: a worker that dies "
                             "or goes silent for longer loses its rank, which a replacement may then take "
                             "(default %(default)s)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds calls in flight get to finish on SIGTERM/SIGINT (default %(default)s)")
    parser.add_argument("--device", default="auto",
                        help="where values live: cpu, cuda, cuda:N or auto, the GPU when CuPy sees one "
                             "(default %(default)s)")


def _add_transport_arguments(parser):
    """How values travel besides the gRPC messages: shared memory, the data channel."""
    parser.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                        help="refuse shared-memory regions: clients on this host use the plain gRPC path "
                             "(default: shared memory on)")
    parser.add_argument("--data-port", type=int, default=0,
                        help="port of the raw-TCP data channel for large values (default: any free one; "
                             "fix it to publish it from a container)")
    parser.add_argument("--advertise-data-port", type=int, default=0, metavar="PORT",
                        help="the data port that clients are told to connect to, where something between maps it "
                             "to --data-port (a container's published port, a proxy) (default: the port the data "
                             "channel listens on)")
    parser.add_argument("--no-data-channel", dest="data_channel", action="store_false",
                        help="no raw-TCP data channel: clients on other hosts send values in the gRPC messages "
                             "(default: data channel on)")


def _add_state_arguments(parser):
    """Snapshots, and the metrics that describe the server's state."""
    parser.add_argument("--state-dir", metavar="DIR",
                        help="directory of snapshots of the server's state (values, rounds, optimizer and states, "
                             "run): the newest whole one is restored at start, and new ones are written there; "
                             "one server per directory (default: none, nothing survives a restart)")
    parser.add_argument("--start-empty-if-damaged", action="store_true",
                        help="when every snapshot in --state-dir fails to load, start empty, the state they held "
                             "lost (they are kept, renamed NAME.damaged); this weakens durability: without it such a "
                             "server does not start (exit status 2), naming the files (default: off)")
    parser.add_argument("--snapshot-interval", type=float, default=60.0, metavar="S",
                        help="seconds between snapshots to --state-dir (a snapshot of an unchanged state is not "
                             "written); 0: only on SIGTERM/SIGINT and on a Snapshot call "
                             "(default %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (default 0: off)")
    parser.add_argument("--metrics-host", metavar="HOST",
                        help="address the metrics port listens on (default: --host's); it answers anyone who "
                             "reaches it, without TLS or a token (counts only, no values)")


def _add_log_arguments(parser):
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="least severe log messages written to stderr (default %(default)s)")
    parser.add_argument("--log-format", default="text", choices=logs.FORMATS,
                        help="text, or json: one object a line with fixed fields (default %(default)s)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def _check(args, parser):
    """End the process with a usage error (exit status 2) for arguments that do not go together;
    ``args.security`` becomes the ServerSecurity they describe."""
    if args.num_workers < 1:
        parser.error("--num-workers must be at least 1")
    if args.round_timeout <= 0:
        parser.error("--round-timeout must be positive")
    if not 0 < args.lease_timeout <= MAX_LEASE_TIMEOUT:
        parser.error(f"--lease-timeout must be positive and at most {MAX_LEASE_TIMEOUT:g} s")
    if args.data_channel and args.data_port == args.port != 0:
        parser.error("--data-port must differ from --port")
    if args.metrics_port and args.metrics_port in (args.port, args.data_port if args.data_channel else 0):
        parser.error("--metrics-port must differ from --port and --data-port")
    limits.check(args, parser)
    try:
        args.security = security.ServerSecurity.from_args(args)
    except ValueError as error:
        parser.exit(2, f"tensorkv-server: {error}\n")
    refusal = args.security.refusal(args.host)
    if refusal:
        parser.exit(2, f"tensorkv-server: {refusal}\n")
    if args.snapshot_interval < 0:
        parser.error("--snapshot-interval must be 0 (off) or positive")
    if not 0 <= args.metrics_port <= 65535:
        parser.error("--metrics-port must be 0 (off) or a port number up to 65535")
    args.metrics_host = args.metrics_host or args.host


class StartFailed(Exception):
    """The server cannot start; the message says why, in one line."""


class Refused(StartFailed):
    """The server does not start for what it was given (exit status 2, as for a refused option)."""


class StoppedBeforeServing(Exception):
    """SIGTERM or SIGINT came before the server served (while it starts, or restores a snapshot)."""


def _stop_before_serving(signum, frame):
    raise StoppedBeforeServing(signal.Signals(signum).name)


def main(argv=None):
    # Until serve() takes them over: as PID 1 in a container, a signal without a handler is
    # dropped, and a pod deleted while its server restores a snapshot would wait for SIGKILL.
    if argv is None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _stop_before_serving)
    args = None
    try:
        args = parse_args(argv)
        _serve(args, reexec=argv is None)
    except StoppedBeforeServing as signum:
        _exit_line(args, f"stopped by {signum} before serving; nothing was changed", status=0)
    except (ListenError, SnapshotFailed, StartFailed) as error:  # one line, no traceback
        _exit_line(args, str(error), status=2 if isinstance(error, Refused) else 1)


def _exit_line(args, message, status=1):
    """End the process with ``message`` as its last line on stderr: ``tensorkv-server:
    message``, or with --log-format json a JSON log line like the others."""
    if args is not None and args.log_format == "json" and logging.getLogger().handlers:
        (log.info if status == 0 else log.error)("%s", message, extra={"event": "server_stopped"})
        raise SystemExit(status)
    print(f"tensorkv-server: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def _serve(args, reexec):
    logs.configure(args.log_format, args.log_level)  # first: a refusal below is a log line (JSON too)
    # The bytes of data per message it sends, as its workers' ClientConfig.chunk_bytes.
    codec.CHUNK_BYTES = env.integer("TENSORKV_CHUNK_BYTES", codec.CHUNK_BYTES, low=1)
    check_free(args.host, args.port, "--port")  # before the re-exec and the device: a port in use ends it at once
    if args.data_channel:
        check_free(args.host, args.data_port, "--data-port")
    if args.metrics_port:
        check_free(args.metrics_host, args.metrics_port, "--metrics-port")
    if reexec:  # a process of its own, not a call from Python
        allocator.reexec_with_tunables()
    log.debug("GLIBC_TUNABLES=%s", os.environ.get("GLIBC_TUNABLES", "(unset)"))
    try:
        xp, device = select(args.device)
    except (RuntimeError, ValueError) as error:  # a device this machine does not have
        raise StartFailed(f"--device {args.device}: {error}") from None
    request_limits, max_memory = limits.from_args(args, xp)
    log.info("%s", limits.describe(request_limits, max_memory))
    for warning in args.security.warnings:
        log.warning("%s", warning)
    crowded = limits.snapshot_room(args, xp, max_memory)
    if crowded:
        log.warning("%s", crowded)
    coordinator = Coordinator(Engine(xp), args.num_workers, args.mode, args.round_timeout, args.lease_timeout,
                              max_memory)
    snapshots = None
    if args.state_dir is None:
        log.warning("no --state-dir: nothing survives a restart")
    else:
        try:
            snapshots = Snapshots(coordinator, args.state_dir, args.start_empty_if_damaged)
            snapshots.load()
        except NoSnapshotLoads as error:
            raise Refused(f"--state-dir {args.state_dir}: {error}") from None
        except (OSError, WrongServer, StateDirInUse) as error:
            raise StartFailed(f"--state-dir {args.state_dir}: {error}") from None
        crowded = snapshots.room_warning(max_memory)
        if crowded:
            log.warning("%s", crowded)
    try:
        interceptors = metrics.start(args.metrics_port, args.metrics_host, coordinator.engine) if args.metrics_port else []
    except OSError as error:
        raise StartFailed(f"--metrics-port {args.metrics_port}: {error}") from None
    config = ServerConfig(host=args.host, port=args.port, grace=args.grace, device=device,
                          shared_memory=args.shared_memory, data_port=args.data_port if args.data_channel else None,
                          advertised_data_port=args.advertise_data_port, limits=request_limits,
                          security=args.security, snapshot_interval=args.snapshot_interval)
    asyncio.run(serve(coordinator, config, snapshots, interceptors))


if __name__ == "__main__":
    main()
