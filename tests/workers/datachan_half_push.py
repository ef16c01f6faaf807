"""A client killed mid-transfer on the data channel: on its Session stream to the server at
argv[1] (data port argv[2]) it sends a push of key argv[3] (float32, argv[4] elements) whose
bytes follow on the channel, writes half of them, says "sent" and waits to be killed."""
import sys
import time

import grpc
import numpy as np

from tensorkv.wire.codec import Item, encode_stream, following
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.transport.session import RawSession as Session
from tensorkv.v1 import kvstore_pb2

address, port, key, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
session = Session(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), address, data_port=port)
session._open()
channel = session._ensure_channel(30.0, "push")
assert channel is not None, "no data channel"
channel.deadline = time.monotonic() + 30.0
items, arrays = following([Item(key, np.full(size, 7.0, np.float32))], 1)
session._queue.put(encode_stream(kvstore_pb2.SessionRequest, items, dict(
    id=99, rank=0, op=kvstore_pb2.SESSION_OP_PUSH, timeout_ms=600_000), chunk_bytes=1 << 62)[0])
channel.send([arrays[0][:size // 2]])
print("sent", flush=True)
time.sleep(600)
