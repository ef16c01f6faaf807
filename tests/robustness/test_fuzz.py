"""A bounded, seeded fuzzer of the wire: valid Init, Push, PushPull and Session requests,
mutated field by field (dtype, shape, data, slice, key, shared-memory and data-channel
references, 2-bit codes, rank, incarnation, Session op) or byte by byte (flips, cuts,
repeats), sent with raw gRPC calls to a real server. After every request the server is alive,
a refused request answered with a status a client can act on (never UNKNOWN or INTERNAL), and
a refused request changed no stored value (every key pulled before and after, compared
exactly). ``--seeds N`` runs N seeds of MUTATIONS requests each."""
import random

import grpc
import numpy as np

import tensorkv
from tensorkv.wire.codec import Item, encode_stream
from tensorkv.v1 import kvstore_pb2, tensor_pb2

from cluster import Cluster

MUTATIONS = 150  # requests per seed
STORED = {"w": np.arange(8, dtype=np.float32), "i": np.arange(4, dtype=np.int32), "m": np.ones((2, 3))}
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.ABORTED, grpc.StatusCode.UNIMPLEMENTED}
_SERVICE = "/tensorkv.v1.KVStoreService/"
_CALLS = {"Init": kvstore_pb2.InitRequest, "Push": kvstore_pb2.PushRequest, "PushPull": kvstore_pb2.PushPullRequest,
          "Session": kvstore_pb2.SessionRequest}


def _valid(method, rng, caller):
    """A valid serialized request of ``method`` carrying one or two stored keys' values."""
    keys = rng.sample(sorted(STORED), rng.randint(1, 2))
    items = [Item(key, (STORED[key] + rng.randint(1, 5)).astype(STORED[key].dtype)) for key in keys]
    fields = dict(caller)
    if method == "Session":
        fields.update(id=1, op=rng.choice([kvstore_pb2.SESSION_OP_PUSH, kvstore_pb2.SESSION_OP_PUSH_PULL,
                                           kvstore_pb2.SESSION_OP_INIT]), timeout_ms=5000)
    return encode_stream(_CALLS[method], items, fields, chunk_bytes=1 << 62)[0]


def _mutate_fields(message, rng):
    entries = message.frame.entries
    if not entries:
        return
    entry = rng.choice(entries)
    choice = rng.randrange(12)
    if choice == 0:
        entry.tensor.dtype = rng.randint(-3, 40)
    elif choice == 1:
        del entry.tensor.shape[:]
        entry.tensor.shape.extend(rng.choice([-1, 0, 1, 3, 8, 2**31, 2**40, 2**62]) for _ in range(rng.randint(0, 5)))
    elif choice == 2:
        entry.tensor.data = entry.tensor.data[:rng.randint(0, len(entry.tensor.data))]
    elif choice == 3:
        entry.tensor.data += bytes(rng.randint(1, 64))
    elif choice == 4:
        entry.slice.begin, entry.slice.end = rng.randint(-5, 20), rng.randint(-5, 20)
    elif choice == 5:
        entry.key.str_key = rng.choice(["", "nope", "w" * 5000, "\x00"])
    elif choice == 6:
        entry.key.int_key = rng.choice([-1, 0, 2**62])
    elif choice == 7:
        entry.shm.region_id, entry.shm.offset, entry.shm.length = rng.randint(0, 5), rng.randint(0, 2**40), 64
    elif choice == 8:
        entry.channel.length = rng.choice([0, 1, 2**40])
    elif choice == 9:
        entry.two_bit.threshold = rng.choice([0.5, 0.0, -1.0, float("nan"), float("inf")])
    elif choice == 10:
        message.rank = rng.choice([-1, 1, 7, 2**30])
    else:
        message.incarnation = rng.randint(0, 2**63)
    if hasattr(message, "op") and rng.random() < 0.2:
        message.op = rng.randint(-1, 9)


def _mutate_bytes(data, rng):
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(3)
        if kind == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data = data[:rng.randint(0, len(data))]
        elif data:
            start = rng.randrange(len(data))
            data[start:start] = data[start:start + rng.randint(1, 16)]
    return bytes(data)


def _send(channel, method, data):
    """Send the serialized request ``data``; None if accepted, else the RpcError."""
    try:
        if method in ("Init", "Push"):
            channel.stream_unary(_SERVICE + method)(iter([data]), timeout=10)
        elif method == "PushPull":
            list(channel.stream_stream(_SERVICE + method)(iter([data]), timeout=10))
        else:
            answers = list(channel.stream_stream(_SERVICE + method)(iter([data]), timeout=10))
            response = kvstore_pb2.SessionResponse.FromString(answers[0]) if answers else None
            if response is not None and response.code:
                return grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == response.code).value)
    except grpc.RpcError as error:
        return error.code()
    return None


def test_mutated_requests_never_crash_the_server_nor_change_state_when_refused(seed, tmp_path):
    rng = random.Random(seed)
    with Cluster(num_workers=1, mode="async", tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_async", servers=cluster.addresses, transport="grpc") as kv, \
            grpc.insecure_channel(cluster.addresses[0], options=[("grpc.max_receive_message_length", -1)]) as channel:
        kv.init(list(STORED), list(STORED.values()))
        conn = kv._conns[0]
        caller = dict(rank=conn.rank, incarnation=conn.incarnation)
        before = kv.pull(list(STORED))
        for n in range(MUTATIONS):
            method = rng.choice(sorted(_CALLS))
            data = _valid(method, rng, caller)
            if rng.random() < 0.6:
                message = _CALLS[method].FromString(data)
                for _ in range(rng.randint(1, 3)):
                    _mutate_fields(message, rng)
                data = message.SerializeToString()
            else:
                data = _mutate_bytes(data, rng)
            code = _send(channel, method, data)
            assert cluster.processes[0].poll() is None, f"seed {seed}, request {n} ({method}): the server died"
            after = kv.pull(list(STORED))
            if code is None:
                before = after
                continue
            assert code in REFUSALS, f"seed {seed}, request {n} ({method}): answered {code}"
            for key, old, new in zip(STORED, before, after):
                assert old.dtype == new.dtype and np.array_equal(old, new), \
                    f"seed {seed}, request {n} ({method}, refused with {code}) changed key {key!r}"
