"""The gRPC options of both ends: no message size limit, and the keepalive policy of a
worker's channels (CHANNEL_OPTIONS) and of a server (SERVER_OPTIONS), which must agree."""

# Large tensors travel as chunked streams, so no message limit is needed.
_COMMON_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]

# Keepalive. A call may wait without a byte moving for as long as a sync round, barrier or
# init waits (the server's --round-timeout, which the client's `timeout` must exceed), and a
# worker's Session stream stays open between calls, however long it computes. The client
# pings every _KEEPALIVE_TIME_MS while a call or stream is open, to find a dead server or a
# cut connection within _KEEPALIVE_TIME_MS + _KEEPALIVE_TIMEOUT_MS; the server must accept
# those pings for as long as they go on, or it closes the connection ("too many pings").
# gRPC core reads these options by their exact names (include/grpc/impl/channel_arg_names.h)
# and silently ignores any other name: a server then allows one ping per 5 minutes.
_KEEPALIVE_TIME_MS = 30_000
_KEEPALIVE_TIMEOUT_MS = 10_000
CHANNEL_OPTIONS = _COMMON_OPTIONS + [
    # unary-stream calls (Pull, and PushPull of one message) without a thread per call
    ("SingleThreadedUnaryStream", 1),
    ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
    # no pings with no call open: nothing waits on the connection then (and a server allows
    # one ping per 2 hours on a connection without calls)
    ("grpc.keepalive_permit_without_calls", 0),
    # pings for as long as a wait lasts, with no data in between
    ("grpc.http2.max_pings_without_data", 0),
    # A broken connection is tried again about every 2 s at most (gRPC's default backoff grows
    # to 120 s): a lease's heartbeat, every third of the lease, must find the server again
    # well within the lease after a few resets in a row. The cost: each worker tries a server
    # that is down every 2 s or so.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Each channel connects on its own. gRPC otherwise shares one connection, and its state,
    # among the channels of a process to the same address with the same options: a new channel
    # (a reconnect, a new store) then fails at once with the error of an earlier channel's
    # failed attempt ("connection refused", "reset") until that one's backoff ends, however long
    # the server has been up again.
    ("grpc.use_local_subchannel_pool", 1),
]
SERVER_OPTIONS = _COMMON_OPTIONS + [
    # the server's own pings find the connections of dead workers, and end their streams
    ("grpc.keepalive_time_ms", 2 * _KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
    # a client ping sooner than this after the previous one, with no data sent in between, is
    # a strike; below the client's period so that late timers never make one
    ("grpc.http2.min_ping_interval_without_data_ms", 2 * _KEEPALIVE_TIME_MS // 3),
    # early pings tolerated before the server closes the connection (gRPC's default is 2); the
    # count restarts whenever the server sends data
    ("grpc.http2.max_ping_strikes", 5),
]
