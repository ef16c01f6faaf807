"""The data channel as both ends speak it (the worker's half is ``tensorkv.transport.datachan``,
the server's ``tensorkv_server.datachan``): the one-byte acknowledgement of a bound token,
the length header before each call and answer framed on the channel, and TCP keepalive.
"""
import socket

ACK = b"\x01"
FRAME_HEADER = 4  # bytes of the little-endian length before each call and answer framed on the channel
# TCP keepalive on both ends: a channel may sit idle through a long wait (a sync pull or a
# barrier waiting for the other workers), which gRPC's pings keep alive on the stream but
# not here. Probed after this many idle seconds, then every KEEPALIVE_INTERVAL, a
# connection stays known to the NATs and firewalls on its way, and a peer that vanished is
# found within about a minute (as gRPC's keepalive on the stream: grpc_options.py).
KEEPALIVE_IDLE = 30
KEEPALIVE_INTERVAL = 10
KEEPALIVE_PROBES = 3


def keep_alive(sock):
    """Turn on TCP keepalive for ``sock``, one end of a data channel (KEEPALIVE_*, where the
    platform has the options)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
