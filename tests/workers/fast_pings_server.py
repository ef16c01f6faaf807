"""``python -m tensorkv_server`` (same arguments) with tensorkv's keepalive policy sped up
SPEEDUP times: the option lists of tensorkv.wire.grpc_options as they are (names, strikes, timeouts), their
ping periods divided, so that a test sees in seconds what a worker sees in minutes."""
import sys

from tensorkv.wire import grpc_options

SPEEDUP = 30
PING_PERIODS = ("grpc.keepalive_time_ms", "grpc.http2.min_ping_interval_without_data_ms")


def faster(options):
    """``options`` with the values of PING_PERIODS divided by SPEEDUP."""
    return [(name, value // SPEEDUP if name in PING_PERIODS else value) for name, value in options]


if __name__ == "__main__":
    grpc_options.SERVER_OPTIONS[:] = faster(grpc_options.SERVER_OPTIONS)
    from tensorkv_server.__main__ import main
    main(sys.argv[1:])
