"""One tensorkv server as a worker's store sees it: :class:`ServerConn`, its channel and
stub, this worker's registration there, and the transport of each call, chosen here once
per call: the Session stream (with the values in shared memory, on the data channel or in
the messages) when the call fits it, else a plain RPC.

A ``part`` is the list [(position, Item)] of the values of one call that go to this server
(a key, or its slice); for a pull, [(position, key)]. ``outs`` are the caller's out arrays
by position: a pulled value goes straight into ``outs[position][0]`` where that is a NumPy
array of its dtype and shape.
"""
import logging
import os

import grpc
import numpy as np

from . import shm, states_wire
from .codec import CHUNK_BYTES, Item, Placement, StreamDecoder, aligned, encode_stream, following, key_fields, set_key
from .errors import InternalError
from .rpc import CHANNEL_OPTIONS, Session, Stub, error_from_code, error_from_rpc, status_code
from .v1 import kvstore_pb2, tensor_pb2

# Calls whose values (per server) take at most this many bytes use the Session stream.
SESSION_MAX_BYTES = CHUNK_BYTES
# With shared memory, values of at least this many bytes travel through the region.
SHM_MIN_BYTES = int(os.environ.get("TENSORKV_SHM_MIN_BYTES", 16 << 10))
# With a data channel, values of at least this many bytes travel on it.
DATACHAN_MIN_BYTES = int(os.environ.get("TENSORKV_DATACHAN_MIN_BYTES", 64 << 10))
_ONE_MESSAGE = 1 << 62
# The Session op of each kind of call that may travel on a Session stream.
_SESSION_OPS = {"init": kvstore_pb2.SESSION_OP_INIT, "push": kvstore_pb2.SESSION_OP_PUSH,
                "pull": kvstore_pb2.SESSION_OP_PULL, "pushpull": kvstore_pb2.SESSION_OP_PUSH_PULL}
log = logging.getLogger(__name__)


class ServerConn:
    """The server at ``address``, reached with ``security``; every call is bounded by
    ``timeout`` seconds. ``session``: whether small calls use a Session stream.
    ``lease_check()`` runs before every call (FailedPreconditionError once a lease is lost)."""

    def __init__(self, address, security, timeout, session=True):
        self.address = address
        self.timeout = timeout
        self.channel = security.channel(address, CHANNEL_OPTIONS)
        self.stub = Stub(self.channel)
        self.session = Session(self.channel, address, data_tls=security.data_channel_context()) if session else None
        self.rank = None
        self.incarnation = None  # of this worker's registration here; None while not registered
        self.lease_ttl = 0.0  # seconds; 0: a server without leases
        self.lease_check = lambda: None

    # ---- registration -----------------------------------------------------------------

    def info(self, timeout):
        return self._rpc("info", self.stub.Info, kvstore_pb2.InfoRequest(), timeout)

    def offer(self, info, transport):
        """Let calls use what the server offers (``info``) and ``transport`` allows: shared
        memory, then the data channel, tried lazily by the first call that moves enough bytes
        (the proof of the same host happens then: tensorkv.shm)."""
        if self.session is not None:
            self.session.shm_allowed = transport == "auto" and shm.available() and info.shared_memory
            self.session.data_port = info.data_port if transport != "grpc" else 0

    def register(self, rank, if_exists):
        """Join the job as ``rank`` (None: the server assigns one); the RegisterResponse."""
        request = kvstore_pb2.RegisterRequest(rank=rank, if_exists=if_exists)
        response = self._rpc("register", self.stub.Register, request)
        self.rank, self.incarnation = response.rank, response.incarnation
        self.lease_ttl = response.lease_ttl_ms / 1000
        return response

    def unregister(self, timeout):
        """Give the rank back (best effort: a server that is gone or slow to answer is left
        as it is)."""
        if self.incarnation is None:
            return
        try:
            self.stub.Unregister(kvstore_pb2.UnregisterRequest(**self._caller()), timeout=timeout)
        except grpc.RpcError as error:
            log.info("server %s: rank %d not given back: %s", self.address, self.rank, error.code())
        self.incarnation = None

    def _caller(self):
        """The fields that say who calls: this worker's rank and incarnation."""
        return dict(rank=self.rank, incarnation=self.incarnation)

    # ---- the data path ----------------------------------------------------------------

    def init(self, part, wait_only):
        if self._session("init", part, wait_only=wait_only) is None:
            items = [item for _, item in part]
            self._rpc("init", self.stub.init_raw, self._frames(kvstore_pb2.InitRequest, items, wait_only=wait_only))

    def push(self, part):
        if self._session("push", part) is None:
            items = [item for _, item in part]
            self._rpc("push", self.stub.push_raw, self._frames(kvstore_pb2.PushRequest, items))

    def pushpull(self, part, outs):
        """The items pulled back after pushing ``part``."""
        items = self._session("pushpull", part, outs=outs)
        if items is None:
            request = self._frames(kvstore_pb2.PushPullRequest, [item for _, item in part])
            items = self._rpc("pushpull", lambda r, timeout: decode(
                kvstore_pb2.PushPullResponse, self.stub.pushpull_raw(r, timeout=timeout), part, outs), request)
        return items

    def pull(self, part, outs, sizes):
        """The items of the keys of ``part``; ``sizes``: their bytes when all are known, else None."""
        keys = [key for _, key in part]
        items = self._session("pull", part, outs=outs, keys=keys, sizes=sizes)
        if items is None:
            request = kvstore_pb2.PullRequest(**self._caller())
            for key in keys:
                set_key(request.keys.add(), key)
            items = self._rpc("pull", lambda r, timeout: decode(
                kvstore_pb2.PullResponse, self.stub.pull_raw(r, timeout=timeout), part, outs), request)
        return items

    # ---- the rest ---------------------------------------------------------------------

    def set_updater(self, optimizer, key_states, kind):
        """Install ``optimizer`` with this server's ``key_states``; ``kind`` names the call in errors."""
        self._rpc(kind, self.stub.SetUpdater, states_wire.to_messages(kvstore_pb2.SetUpdaterRequest, optimizer,
                                                                       key_states))

    def set_learning_rate(self, learning_rate):
        self._rpc("set_learning_rate", self.stub.SetLearningRate,
                  kvstore_pb2.SetLearningRateRequest(learning_rate=learning_rate))

    def optimizer_states(self):
        """(optimizer or None, {key: (num_update, [Item])}) of this server."""
        return self._rpc("save_optimizer_states", lambda r, timeout: states_wire.from_messages(
            self.stub.GetOptimizerStates(r, timeout=timeout)), kvstore_pb2.GetOptimizerStatesRequest())

    def barrier(self):
        self._rpc("barrier", self.stub.Barrier, kvstore_pb2.BarrierRequest(**self._caller()))

    def close(self):
        if self.session is not None:
            self.session.close()
        self.channel.close()

    # ---- transports -------------------------------------------------------------------

    def _rpc(self, kind, method, request, timeout=None):
        """``method(request, timeout=...)``, with gRPC errors raised as KVStoreError; ``kind``
        names the call in them ('push', 'pull', ...: see rpc.transport_error)."""
        self.lease_check()
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as error:
            raise error_from_rpc(error, self.address, kind) from None

    def _frames(self, message_type, items, **fields):
        """The serialized request messages that carry ``items``."""
        return encode_stream(message_type, items, dict(self._caller(), **fields),
                             with_data=not fields.get("wait_only", False))

    def _session(self, kind, part, outs=None, keys=None, sizes=None, wait_only=False):
        """Make the ``kind`` call on the Session stream: the items (or keys) it returns; None
        when the call is not for a session (too large without shared memory, sessions off,
        or the session busy with another thread's call), for the caller to make a plain RPC.

        With shared memory, values of SHM_MIN_BYTES or more are written into the session's
        region and only their references travel; a pull names the region as its output area,
        and the values the server writes there are copied into ``outs`` (or new arrays).
        Without it, values of DATACHAN_MIN_BYTES or more travel on the session's data channel
        when there is one, pulled ones straight into ``outs`` where they fit."""
        session = self.session
        if session is None:
            return None
        self.lease_check()
        use_shm = session.shm_possible
        use_channel = not use_shm and session.channel_possible
        min_bytes = SHM_MIN_BYTES if use_shm else DATACHAN_MIN_BYTES
        offload = use_shm or use_channel  # large values leave the messages
        op = _SESSION_OPS[kind]
        pulls = op in (kvstore_pb2.SESSION_OP_PULL, kvstore_pb2.SESSION_OP_PUSH_PULL)
        in_bytes = out_bytes = 0
        if keys is None:
            items = [item for _, item in part]
            inline = 0
            for item in items:
                nbytes = item.array.nbytes
                if offload and not wait_only and nbytes >= min_bytes:
                    in_bytes += aligned(nbytes)
                elif not wait_only:
                    inline += nbytes
            if inline > SESSION_MAX_BYTES:
                return None
            if pulls and any(item.array.nbytes >= min_bytes for item in items):
                out_bytes = sum(aligned(item.array.nbytes) for item in items)
        else:
            if (sizes is None or sum(sizes) > SESSION_MAX_BYTES) and not offload:
                return None
            if sizes is None:
                out_bytes = shm.MIN_REGION_BYTES
            else:
                # Values that all travel inline need no output area (one copy on each side
                # either way, without a placement per value).
                out_bytes = sum(aligned(b) for b in sizes) if max(sizes, default=0) >= min_bytes else 0
        use_output = offload and pulls and out_bytes >= min_bytes
        shm_bytes = max(in_bytes, out_bytes if use_output else 0) if use_shm and (in_bytes or use_output) else 0

        def build(call_id, timeout_ms, region, channel):
            fields = dict(id=call_id, op=op, timeout_ms=timeout_ms, **self._caller())
            if wait_only:
                fields["wait_only"] = True
            if region is not None and use_output:
                fields["output"] = tensor_pb2.SharedMemoryRef(region_id=region.id, offset=shm.HEADER_BYTES,
                                                             length=region.capacity)
            if channel is not None and use_output:
                fields["data_channel_min_bytes"] = min_bytes
            if keys is not None:
                return kvstore_pb2.SessionRequest(**fields).SerializeToString() + key_fields(keys), ()
            sent, arrays = items, ()
            if region is not None and in_bytes:
                placement = Placement(region.buffer, region.id, shm.HEADER_BYTES)
                sent = [placement.put(item) or item if item.array.nbytes >= min_bytes else item for item in items]
            elif channel is not None and in_bytes:
                sent, arrays = following(items, min_bytes)
            return encode_stream(kvstore_pb2.SessionRequest, sent, fields, chunk_bytes=_ONE_MESSAGE,
                                 with_data=not wait_only)[0], arrays

        def decode_response(call_id, data, region, channel):
            decoder = _decoder(kvstore_pb2.SessionResponse, part, outs,
                               resolve=region.resolve if region is not None else None, channel=channel is not None)
            decoder.feed(data)
            response = decoder.first
            if response.code:
                raise error_from_code(status_code(response.code), response.message, response.error_class or None,
                                      self.address, kind)
            if response.id != call_id:
                raise InternalError(f"server {self.address} answered session call {response.id}, not {call_id}")
            items = decoder.finish()
            if decoder.frames.incoming:
                channel.receive(decoder.frames.incoming)
            decoder.remember()
            return items

        return session.call(build, self.timeout, decode_response, shm_bytes,
                            use_channel and (in_bytes > 0 or use_output), kind)


def decode(message_type, responses, part=None, outs=None):
    """The items of a stream of serialized responses. The values of ``part`` [(position,
    Item or key)] go straight into their ``outs[position][0]`` where that is a NumPy array
    of the right dtype and shape (the others are decoded into new arrays)."""
    decoder = _decoder(message_type, part, outs)
    for data in responses:
        decoder.feed(data)
    items = decoder.finish()
    decoder.remember()
    return items


def _decoder(message_type, part, outs, resolve=None, channel=False):
    destination = None
    if outs is not None:
        # (asked key, out array that may receive its value straight, or None) by entry index
        expected = []
        for position, asked in part:
            target = outs[position][0]
            receivable = type(target) is np.ndarray and target.flags.c_contiguous and target.flags.writeable
            expected.append((asked.key if isinstance(asked, Item) else asked, target if receivable else None))

        def destination(index, key, dtype, shape, slice):
            if index >= len(expected):
                return None
            asked, target = expected[index]
            if target is None or asked != key or target.dtype != dtype or target.shape != shape:
                return None
            return target if slice is None else target.reshape(-1)[slice[0]:slice[1]]
    return StreamDecoder(message_type, "frame", destination=destination, resolve=resolve, copy_refs=True,
                         channel=channel)
