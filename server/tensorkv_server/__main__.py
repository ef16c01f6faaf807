"""``tensorkv-server`` (also ``python -m tensorkv_server``): one parameter server."""
import argparse
import asyncio
import logging
import os
import platform
import sys

from tensorkv.backend import select
from tensorkv.engine import Engine

from .rounds import ASYNC, SYNC, Coordinator
from .server import serve


# glibc's malloc, tuned for the large, short-lived buffers of tensor streams: allocations up
# to 32 MiB (the most glibc allows) come from the heap instead of a fresh mmap each time,
# freed memory is not returned to the kernel below 1 GiB, and two arenas keep it in few
# places. Without it every 1 MiB message is a new mapping whose pages fault in and get
# zeroed: see docs/transport.md for the measurements.
MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:"
                   "glibc.malloc.arena_max=2")


def tune_malloc():
    """Re-exec this process once with GLIBC_TUNABLES=MALLOC_TUNABLES (same PID, same command
    line), unless the user set GLIBC_TUNABLES or TENSORKV_NO_MALLOC_TUNING=1, or this is not
    glibc's Linux. glibc reads its tunables only at start, hence the re-exec."""
    if os.environ.get("GLIBC_TUNABLES") is not None or os.environ.get("TENSORKV_NO_MALLOC_TUNING", "") not in ("", "0"):
        return
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc" or not sys.executable:
        return
    env = dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="tensorkv-server", description="tensorkv parameter server (MXNet's KVStore over gRPC).")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (default %(default)s)")
    parser.add_argument("--num-workers", type=int, default=1, help="number of workers (default %(default)s)")
    parser.add_argument("--mode", choices=(SYNC, ASYNC), default=SYNC,
                        help="sync: merge the pushes of all workers per round; async: apply each push")
    parser.add_argument("--round-timeout", type=float, default=60.0,
                        help="seconds a sync round, barrier or init waits for every worker before it is "
                             "aborted (default %(default)s)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds calls in flight get to finish on SIGTERM/SIGINT (default %(default)s)")
    parser.add_argument("--device", default="auto",
                        help="where values live: cpu, cuda, cuda:N or auto (GPU when CuPy sees one)")
    parser.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                        help="refuse shared-memory regions: clients on this host use the plain gRPC path")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error("--num-workers must be at least 1")
    if args.round_timeout <= 0:
        parser.error("--round-timeout must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    if argv is None:  # a process of its own, not a call from Python
        tune_malloc()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).info("GLIBC_TUNABLES=%s", os.environ.get("GLIBC_TUNABLES", "(unset)"))
    try:
        xp, device = select(args.device)
    except (RuntimeError, ValueError) as error:  # a device this machine does not have
        raise SystemExit(f"tensorkv-server: --device {args.device}: {error}") from None
    coordinator = Coordinator(Engine(xp), args.num_workers, args.mode, args.round_timeout, device)
    asyncio.run(serve(coordinator, args.host, args.port, args.grace, args.shared_memory))


if __name__ == "__main__":
    main()
