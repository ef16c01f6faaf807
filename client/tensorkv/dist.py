"""The remote store (``dist_sync``, ``dist_async``): a client of one or more tensorkv servers.

Keys are spread over the servers by a stable hash of the key; a value of more than
``bigarray_bound`` elements is split into contiguous slices, one per server, and put
back together on pull. A call over a list of keys makes one RPC per server involved, to
all of them at once, each with a deadline.
"""
import ipaddress
import logging
import math
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from . import allocator, compression, rowsparse_wire, states_file, states_wire
from .backend import on_gpu, shape_dtype, to_host
from . import shm
from .codec import (
    CHUNK_BYTES, Item, Placement, StreamDecoder, aligned, encode_stream, following, key_fields, set_key,
)
from .engine import Engine, dtype_mismatch
from .errors import (
    DeadlineExceededError, FailedPreconditionError, InternalError, InvalidArgumentError,
    ServerUnavailableError, ShapeMismatchError, key_repr,
)
from .kvstore import KVStore
from .rowsparse import RowSparse, check_row_ids, merge as merge_rows, place, touching
from .lease import Heartbeat
from .security import Security
from .rpc import CHANNEL_OPTIONS, Session, Stub, error_from_code, error_from_rpc, status_code
from .v1 import kvstore_pb2, tensor_pb2
from .words import plural

DEFAULT_TIMEOUT = 120.0
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_BIGARRAY_BOUND = 1_000_000
UNREGISTER_TIMEOUT = 5.0  # seconds close() waits for the servers to take the rank back
# Calls whose values (per server) take at most this many bytes use the Session stream.
SESSION_MAX_BYTES = CHUNK_BYTES
# With shared memory, values of at least this many bytes travel through the region.
SHM_MIN_BYTES = int(os.environ.get("TENSORKV_SHM_MIN_BYTES", 16 << 10))
# With a data channel, values of at least this many bytes travel on it.
DATACHAN_MIN_BYTES = int(os.environ.get("TENSORKV_DATACHAN_MIN_BYTES", 64 << 10))
TRANSPORTS = ("auto", "tcp", "grpc")
_ONE_MESSAGE = 1 << 62
_MODES = {"dist_sync": kvstore_pb2.MODE_SYNC, "dist_async": kvstore_pb2.MODE_ASYNC}
# What a new run does with the keys earlier runs left on a server (RegisterRequest.if_exists).
IF_EXISTS = {"fail": kvstore_pb2.IF_EXISTS_FAIL, "resume": kvstore_pb2.IF_EXISTS_RESUME,
             "replace": kvstore_pb2.IF_EXISTS_REPLACE}
# The Session op of each kind of call that may travel on a Session stream.
_SESSION_OPS = {"init": kvstore_pb2.SESSION_OP_INIT, "push": kvstore_pb2.SESSION_OP_PUSH,
                "pull": kvstore_pb2.SESSION_OP_PULL, "pushpull": kvstore_pb2.SESSION_OP_PUSH_PULL}
# Merges the list of arrays pushed for one key (one per device) as the server merges workers.
_MERGE = Engine()
_GPU_MERGE = {}  # CUDA device id -> Engine that merges lists of GPU arrays there
log = logging.getLogger(__name__)


def _merge_engine(arrays):
    """The engine that sums ``arrays``: on the GPU of the first when all are on GPUs (the sum
    then crosses to the host once, slice by slice as it is sent), else on the host."""
    if len(arrays) == 1 or not all(on_gpu(array) for array in arrays):
        return _MERGE
    import cupy
    device = arrays[0].device
    index = device.index if hasattr(device, "index") else device.id  # torch or CuPy
    engine = _GPU_MERGE.get(index)
    if engine is None:
        with cupy.cuda.Device(index):
            engine = _GPU_MERGE[index] = Engine(cupy)
    return engine


def parse_servers(servers):
    """A list of 'host:port' from a comma-separated string, a list, or TENSORKV_SERVERS, each
    checked (InvalidArgumentError naming the entry) before any connection is tried."""
    source = "servers"
    if servers is None:
        servers, source = os.environ.get("TENSORKV_SERVERS", ""), "TENSORKV_SERVERS"
    if isinstance(servers, str):
        servers = servers.split(",")
    servers = [str(s).strip() for s in servers if str(s).strip()]
    if not servers:
        raise InvalidArgumentError("no servers given: pass servers='host:port,...' or set TENSORKV_SERVERS")
    for entry in servers:
        why = _address_problem(entry)
        if why:
            raise InvalidArgumentError(f"{source}: {entry!r} is not a server address host:port: {why}")
    return servers


def reset(servers=None, timeout=DEFAULT_CONNECT_TIMEOUT):
    """Reset each server, one after the other: see :func:`tensorkv.reset`."""
    dropped = 0
    for address in parse_servers(servers):
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            try:
                dropped += Stub(channel).Reset(kvstore_pb2.ResetRequest(), timeout=timeout).num_keys
            except grpc.RpcError as error:
                raise error_from_rpc(error, address, "reset") from None
    return dropped


_HOST_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _address_problem(entry):
    """What is wrong with ``entry`` as 'host:port' or '[IPv6 address]:port'; '' if nothing."""
    _, has_scheme, rest = entry.partition("://")
    if has_scheme:
        return f"drop the scheme: write {rest!r}"
    if entry.startswith("["):
        address, bracket, port = entry[1:].partition("]")
        if not bracket:
            return "no ']' after the IPv6 address"
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            return f"{address!r} is not an IPv6 address"
        if not port.startswith(":"):
            return f"no port: write e.g. '[{address}]:50051'"
        port = port[1:]
    else:
        host, colon, port = entry.rpartition(":")
        if not colon:
            return f"no port: write e.g. '{entry}:50051'"
        if ":" in host:
            return f"an IPv6 address goes in brackets: write '[{host}]:{port}'"
        if not host:
            return "no host before the port"
        if not _HOST_NAME.fullmatch(host):
            return f"{host!r} is not a host name or address"
    if not (port.isascii() and port.isdigit()):
        return f"port {port!r} is not a number"
    if not 1 <= int(port) <= 65535:
        return f"port {port} is not in 1..65535"
    return ""


def home(key, num_servers):
    """The server index of ``key``: a hash that is the same in every process and run."""
    if num_servers == 1:
        return 0
    return zlib.crc32(f"{type(key).__name__}:{key}".encode()) % num_servers


def _env_int(name, value):
    if value is not None:
        return int(value)
    text = os.environ.get(name)
    return int(text) if text else None


def _receivable(target, dtype, shape):
    """Whether the pulled value of ``dtype`` and full ``shape`` may be decoded straight into
    ``target``, the caller's out array."""
    return type(target) is np.ndarray and target.dtype == dtype and target.shape == tuple(shape) \
        and target.flags.c_contiguous and target.flags.writeable


def _pulled_nbytes(item):
    """The bytes of the value that a pushpull of ``item`` pulls back: its array's, or for 2-bit
    codes those of the float32 elements they stand for."""
    if item.two_bit is None:
        return item.array.nbytes
    return 4 * (math.prod(item.shape) if item.slice is None else item.slice[1] - item.slice[0])


class DistStore(KVStore):
    """A client of tensorkv servers; see :func:`tensorkv.create`.

    ``timeout`` bounds every call (seconds; a sync pull waits for the other workers within
    it), ``connect_timeout`` the first answer of each server (a refused connection or an
    unknown host fails at once). ``transport`` 'auto' (the
    default, or ``TENSORKV_TRANSPORT``) passes values through shared memory to a server that
    proves it is on this host and on the server's raw-TCP data channel otherwise; 'tcp'
    uses the data channel only; 'grpc' always sends them in the gRPC messages.
    ``if_exists`` (or ``TENSORKV_IF_EXISTS``) is what a new run does with the keys that an
    earlier run left on a server: 'fail' (the default), 'resume' or 'replace'.
    ``tls_ca``, ``tls_cert``, ``tls_key`` and ``token`` are the credentials
    (:class:`tensorkv.security.Security`).
    """

    _compressor = None  # compression.Compressor once set_gradient_compression was called

    def __init__(self, name, servers=None, rank=None, num_workers=None, timeout=DEFAULT_TIMEOUT,
                 connect_timeout=DEFAULT_CONNECT_TIMEOUT, bigarray_bound=None, session=None, transport=None,
                 if_exists=None, tls_ca=None, tls_cert=None, tls_key=None, token=None):
        super().__init__(name)
        transport = transport or os.environ.get("TENSORKV_TRANSPORT") or "auto"
        if transport not in TRANSPORTS:
            raise InvalidArgumentError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
        if_exists = if_exists or os.environ.get("TENSORKV_IF_EXISTS") or "fail"
        if if_exists not in IF_EXISTS:
            raise InvalidArgumentError(
                f"unknown if_exists {if_exists!r}; use one of {', '.join(map(repr, IF_EXISTS))}")
        self.transport = transport
        self._addresses = parse_servers(servers)
        allocator.tune_this_process()
        self._timeout = timeout
        self._bound = _env_int("TENSORKV_BIGARRAY_BOUND", bigarray_bound) or DEFAULT_BIGARRAY_BOUND
        self._security = Security.from_options(tls_ca, tls_cert, tls_key, token)
        self._channels = [self._security.channel(a, CHANNEL_OPTIONS) for a in self._addresses]
        self._stubs = [Stub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(len(self._stubs)) if len(self._stubs) > 1 else None
        # Small calls go over one long-lived Session stream per server (off with session=False
        # or TENSORKV_NO_SESSION=1).
        if session is None:
            session = os.environ.get("TENSORKV_NO_SESSION", "") in ("", "0")
        data_tls = self._security.data_channel_context()
        self._sessions = [Session(c, a, data_tls=data_tls) for c, a in zip(self._channels, self._addresses)] \
            if session else None
        self._meta = {}  # key -> (full shape, dtype), from init, push and pull
        self._registered = {}  # server index -> the incarnation of this worker's registration there
        self._heartbeat = None  # renews the registrations' leases
        try:
            infos = self._register(_env_int("TENSORKV_RANK", rank), _env_int("TENSORKV_NUM_WORKERS", num_workers),
                                   connect_timeout, IF_EXISTS[if_exists])
            # Shared memory, then the data channel, are tried (lazily, by the first call that
            # moves enough bytes) with servers that offer them; the proof of the same host
            # happens then (tensorkv.shm).
            for session, info in zip(self._sessions or (), infos):
                session.shm_allowed = transport == "auto" and shm.available() and info.shared_memory
                session.data_port = info.data_port if transport != "grpc" else 0
        except BaseException:
            self.close()
            raise

    @property
    def rank(self):
        return self._rank

    @property
    def num_workers(self):
        return self._num_workers

    def _register(self, rank, num_workers, connect_timeout, if_exists):
        """Check every server's mode and size, then join them: the first assigns the rank
        when none is given. The servers' InfoResponses."""
        infos = []
        for index, address in enumerate(self._addresses):
            try:
                info = self._call(index, lambda stub: stub.Info(kvstore_pb2.InfoRequest(), timeout=connect_timeout),
                                  "info")
            except DeadlineExceededError:  # connected, or still connecting, but no answer
                raise ServerUnavailableError(
                    f"server {address} is unreachable: no answer within {connect_timeout:g} s; "
                    f"is tensorkv-server running on {address}?") from None
            except ServerUnavailableError as error:  # no connection: a TLS mismatch is named as such
                raise self._security.diagnose(address) or error from None
            if info.mode != _MODES[self.type]:
                mode = kvstore_pb2.Mode.Name(info.mode).removeprefix("MODE_").lower()
                raise FailedPreconditionError(
                    f"server {address} runs in {mode} mode; a '{self.type}' store needs a server started with "
                    f"--mode {self.type.removeprefix('dist_')} (for this one, create a 'dist_{mode}' store)")
            if num_workers is not None and info.num_workers != num_workers:
                raise FailedPreconditionError(
                    f"server {address} expects {plural(info.num_workers, 'worker')}, "
                    f"this worker was told {num_workers}")
            num_workers = info.num_workers
            infos.append(info)
        leases = {}  # server index -> (incarnation, lease seconds)
        for index in range(len(self._addresses)):
            request = kvstore_pb2.RegisterRequest(rank=rank, if_exists=if_exists)
            response = self._call(index, lambda stub: stub.Register(request, timeout=self._timeout), "register")
            rank = self._rank = response.rank
            self._registered[index] = response.incarnation
            if response.lease_ttl_ms:  # 0: a server without leases
                leases[index] = (response.incarnation, response.lease_ttl_ms / 1000)
        if leases:
            self._heartbeat = Heartbeat(self._stubs, self._addresses, rank, leases)
        self._num_workers = num_workers
        return infos

    def _unregister(self):
        """Give the rank back to every server that gave it (best effort: a server that is
        gone or slow to answer is left as it is)."""
        if not self._registered:
            return
        timeout = min(self._timeout, UNREGISTER_TIMEOUT)
        calls = {index: self._stubs[index].Unregister.future(
            kvstore_pb2.UnregisterRequest(**self._caller(index)), timeout=timeout) for index in self._registered}
        for index, call in calls.items():  # all servers at once
            try:
                call.result()
            except grpc.RpcError as error:
                log.info("server %s: rank %d not given back: %s", self._addresses[index], self._rank, error.code())
        self._registered = {}

    def _caller(self, index):
        """The fields that say who calls server ``index``: this worker's rank and incarnation."""
        return dict(rank=self._rank, incarnation=self._registered[index])

    # ---- RPC plumbing -----------------------------------------------------------------

    def _call(self, index, call, kind):
        """``call(stub)`` on server ``index``, with gRPC errors raised as KVStoreError; ``kind``
        names the call in them ('push', 'pull', ...: see rpc.transport_error).
        FailedPreconditionError once this worker has lost its lease on a server."""
        if self._heartbeat is not None:
            self._heartbeat.check()
        try:
            return call(self._stubs[index])
        except grpc.RpcError as error:
            raise error_from_rpc(error, self._addresses[index], kind) from None

    def _each(self, calls, kind):
        """Run {server index: call(stub)} (``kind`` calls) on all those servers at once;
        {index: result}."""
        if len(calls) <= 1 or self._pool is None:
            return {index: self._call(index, call, kind) for index, call in calls.items()}
        futures = {index: self._pool.submit(self._call, index, call, kind) for index, call in calls.items()}
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if errors:
            raise errors[0]
        return {index: f.result() for index, f in futures.items()}

    def _session(self, index, kind, part, outs=None, keys=None, wait_only=False):
        """Make the ``kind`` call on server ``index``'s Session stream: the items (or keys) it
        returns; None when the call is not for a session (too large without shared memory,
        sessions off, or the session busy with another thread's call), for the caller to make
        a plain RPC.

        With shared memory, values of SHM_MIN_BYTES or more are written into the session's
        region and only their references travel; a pull names the region as its output area,
        and the values the server writes there are copied into ``outs`` (or new arrays).
        Without it, values of DATACHAN_MIN_BYTES or more travel on the session's data channel
        when there is one, pulled ones straight into ``outs`` where they fit."""
        if self._sessions is None:
            return None
        session = self._sessions[index]
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
            if pulls and any(_pulled_nbytes(item) >= min_bytes for item in items):
                out_bytes = sum(aligned(_pulled_nbytes(item)) for item in items)
        else:
            sizes = self._known_sizes(keys)
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
            fields = dict(id=call_id, op=op, timeout_ms=timeout_ms, **self._caller(index))
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

        def decode(call_id, data, region, channel):
            decoder = self._decoder(kvstore_pb2.SessionResponse, part, outs,
                                    resolve=region.resolve if region is not None else None,
                                    channel=channel is not None)
            decoder.feed(data)
            response = decoder.first
            if response.code:
                raise error_from_code(status_code(response.code), response.message, response.error_class or None,
                                      self._addresses[index], kind)
            if response.id != call_id:
                raise InternalError(f"server {self._addresses[index]} answered session call {response.id}, "
                                    f"not {call_id}")
            items = decoder.finish()
            if decoder.frames.incoming:
                channel.receive(decoder.frames.incoming)
            decoder.remember()
            return items

        return session.call(build, self._timeout, decode, shm_bytes, use_channel and (in_bytes > 0 or use_output),
                            kind)

    def _frames(self, index, message_type, items, **fields):
        """The serialized request messages to server ``index`` that carry ``items``."""
        return encode_stream(message_type, items, dict(self._caller(index), **fields),
                             with_data=not fields.get("wait_only", False))

    @staticmethod
    def _decode(message_type, responses, part=None, outs=None):
        """The items of a stream of serialized responses. The values of ``part`` [(position,
        Item or key)] go straight into their ``outs[position][0]`` where that is a NumPy array
        of the right dtype and shape (the others are decoded into new arrays)."""
        decoder = DistStore._decoder(message_type, part, outs)
        for data in responses:
            decoder.feed(data)
        items = decoder.finish()
        decoder.remember()
        return items

    @staticmethod
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

    # ---- layout -----------------------------------------------------------------------

    def _placement(self, key, size):
        """[(server index, slice or None)] of a value of ``size`` elements."""
        count = len(self._stubs)
        if count == 1 or size <= self._bound:
            return [(home(key, count), None)]
        bounds = [size * i // count for i in range(count + 1)]
        return [(i, (bounds[i], bounds[i + 1])) for i in range(count)]

    def _split(self, key, array, shape=None):
        """[(server index, Item)] that carry ``array`` (a whole value, or its shape with no data)."""
        shape = tuple(array.shape) if shape is None else shape
        flat = array.reshape(-1)
        return [(index, Item(key, array if where is None else flat[where[0]:where[1]], shape, where))
                for index, where in self._placement(key, flat.size)]

    def _check_known(self, key, shape, dtype, verb):
        """Check against what this worker knows of ``key``, so that a call spread over several
        servers fails before any of them changes."""
        known = self._meta.get(key)
        if known is None:
            return
        if dtype != known[1]:
            raise dtype_mismatch(key, verb, dtype, known[1])
        if shape != known[0]:
            raise ShapeMismatchError(
                f"key {key_repr(key)}: {verb} shape {shape} does not match the stored shape {known[0]}")

    def _merged(self, pairs):
        """{key: one array}: the arrays pushed for each key, summed (a repeated key too); GPU
        arrays are summed on their GPU."""
        grouped = {}
        for key, arrays in pairs:
            grouped.setdefault(key, []).extend(arrays)
        _MERGE.check_keys(list(grouped))
        merged = {}
        for key, arrays in grouped.items():
            first = arrays[0]
            shape, dtype = (first.shape, first.dtype) if type(first) is np.ndarray else shape_dtype(first)
            self._check_known(key, shape, dtype, "pushed")
            merged[key] = _merge_engine(arrays).sum(arrays)
        return merged

    def _plan(self, entries):
        """{server index: [(position, Item)]} that carry each (position, key, array) of
        ``entries``: a value on its key's server, or in slices over all servers."""
        if len(self._stubs) == 1:
            return {0: [(position, Item(key, array)) for position, key, array in entries]}
        plan = {}
        for position, key, array in entries:
            for index, item in self._split(key, array):
                plan.setdefault(index, []).append((position, item))
        return plan

    def _assemble(self, values, plan, results, outs=None):
        """Fill ``values`` (by position) from each server's answer, in the order of ``plan``.
        A value that was decoded straight into its out array (see :meth:`_decode`) is that
        array."""
        for index, answered in results.items():
            for (position, _), item in zip(plan[index], answered):
                if outs is not None and (item.array is outs[position][0] or (
                        _receivable(outs[position][0], item.array.dtype, item.shape)
                        and np.may_share_memory(outs[position][0], item.array))):
                    values[position] = outs[position][0]
                    continue
                if item.slice is None:
                    values[position] = item.array
                    continue
                if values[position] is None:
                    values[position] = np.empty(item.shape, item.array.dtype)
                values[position].reshape(-1)[item.slice[0]:item.slice[1]] = item.array
        return values

    @staticmethod
    def _owned(values, fresh):
        """With ``fresh``, values the caller may write to (decoded ones are read-only views)."""
        return [v if not fresh or v.flags.writeable else v.copy() for v in values]

    # ---- the store --------------------------------------------------------------------

    def _init(self, items):
        _MERGE.check_keys([item.key for item in items])
        wait_only = self._rank != 0
        plan = self._plan((position, item.key, to_host(item.array)) for position, item in enumerate(items))
        self._each({index: lambda stub, index=index, part=part: self._session(
            index, "init", part, wait_only=wait_only) is not None or stub.init_raw(
            self._frames(index, kvstore_pb2.InitRequest, [item for _, item in part], wait_only=wait_only),
            timeout=self._timeout) for index, part in plan.items()}, "init")
        for item in items:
            self._meta[item.key] = shape_dtype(item.array)

    def _push_plan(self, entries):
        """(:meth:`_plan` of the pushed ``entries``, {key: residual} to keep once the push
        succeeded). With gradient compression (set_gradient_compression), the items carry the
        values' packed 2-bit codes, quantized with each key's residual."""
        if self._compressor is None:
            return self._plan(entries), {}
        coded, residuals = [], {}
        for position, key, value in entries:
            codes, residuals[key] = self._compressor.codes(key, value)
            coded.append((position, key, codes))
        plan = self._plan(coded)
        return {index: [(position, self._compressor.item(item)) for position, item in part]
                for index, part in plan.items()}, residuals

    def _set_gradient_compression(self, compression_params):
        threshold = compression.parse(compression_params)
        if self._compressor is None:
            self._compressor = compression.Compressor(threshold)
        else:  # the residuals stay, as in MXNet
            self._compressor.threshold = threshold

    def _push(self, pairs):
        merged = self._merged(pairs)
        plan, residuals = self._push_plan((key, key, value) for key, value in merged.items())
        self._each({index: lambda stub, index=index, part=part: self._session(
            index, "push", part) is not None or stub.push_raw(
            self._frames(index, kvstore_pb2.PushRequest, [item for _, item in part]), timeout=self._timeout)
            for index, part in plan.items()}, "push")
        if residuals:
            self._compressor.keep(residuals)
        self._meta.update((key, (value.shape, value.dtype)) for key, value in merged.items())

    def _pushpull(self, pairs, fresh, outs=None):
        merged = self._merged(pairs)
        order = list(merged)
        # A key pushed twice in one call is pulled once, into the first out of its first pair.
        first_outs = None
        if outs is not None:
            by_key = {}
            for (key, _), targets in zip(pairs, outs):
                by_key.setdefault(key, targets)
            first_outs = [by_key[key] for key in order]
        plan, residuals = self._push_plan((position, key, merged[key]) for position, key in enumerate(order))
        results = self._each({index: lambda stub, index=index, part=part: self._or(self._session(
            index, "pushpull", part, outs=first_outs), lambda: self._decode(
            kvstore_pb2.PushPullResponse,
            stub.pushpull_raw(self._frames(index, kvstore_pb2.PushPullRequest, [item for _, item in part]),
                              timeout=self._timeout), part, first_outs))
            for index, part in plan.items()}, "pushpull")
        if residuals:
            self._compressor.keep(residuals)
        self._meta.update((key, (value.shape, value.dtype)) for key, value in merged.items())
        values = dict(zip(order, self._owned(self._assemble([None] * len(order), plan, results, first_outs), fresh)))
        return [values[key] for key, _ in pairs]

    def _pull(self, keys, fresh, outs=None):
        _MERGE.check_keys(keys)
        if outs is not None and not self._outs_fit(keys, outs):
            outs = None  # decoded into new arrays: the mismatch is raised before any out is written
        count, meta = len(self._stubs), self._meta
        # A key this worker has not seen yet is asked of its home server; when that answers
        # with one slice of a large value, the other slices are asked of the other servers.
        plan, unknown = {}, []
        for position, key in enumerate(keys):
            known = meta.get(key)
            if known is None:
                unknown.append(position)
                indexes = (home(key, count),)
            elif count == 1:
                indexes = (0,)
            else:
                indexes = [i for i, _ in self._placement(key, math.prod(known[0]))]
            for index in indexes:
                plan.setdefault(index, []).append((position, key))
        values = self._pull_into([None] * len(keys), plan, outs)
        rest = {}
        for position in unknown:
            key = keys[position]
            if len(self._placement(key, values[position].size)) > 1:
                for index in range(count):
                    if index != home(key, count):
                        rest.setdefault(index, []).append((position, key))
        if rest:
            values = self._pull_into(values, rest, outs)
        return self._owned(values, fresh)

    def _pull_into(self, values, plan, outs=None):
        """Pull the keys of ``plan`` {server index: [(position, key)]} into ``values``."""
        results = self._each({index: lambda stub, index=index, part=part: self._or(
            self._session(index, "pull", part, outs=outs, keys=[key for _, key in part]),
            lambda: self._decode(kvstore_pb2.PullResponse, stub.pull_raw(
                self._pull_request(index, (key for _, key in part)), timeout=self._timeout), part, outs))
            for index, part in plan.items()}, "pull")
        for items in results.values():
            self._meta.update((item.key, (item.shape, item.array.dtype)) for item in items)
        return self._assemble(values, plan, results, outs)

    def _outs_fit(self, keys, outs):
        """Whether every out array of ``keys`` has the known dtype and shape of its key (all
        keys known), so that values may be decoded straight into them: a pull then never
        writes some outs and fails on another."""
        meta = self._meta
        for key, targets in zip(keys, outs):
            known = meta.get(key)
            if known is None:
                return False
            shape, dtype = known
            for target in targets:
                if type(target) is np.ndarray:
                    if target.shape != shape or target.dtype != dtype:
                        return False
                elif shape_dtype(target) != (shape, dtype):
                    return False
        return True

    @staticmethod
    def _or(result, otherwise):
        return otherwise() if result is None else result

    def _known_sizes(self, keys):
        """The bytes of the whole values of ``keys`` (an upper bound for slices); None when one
        of them is not known yet."""
        sizes, meta = [], self._meta
        for key in keys:
            known = meta.get(key)
            if known is None:
                return None
            sizes.append(math.prod(known[0]) * known[1].itemsize)
        return sizes

    def _pull_request(self, index, keys):
        request = kvstore_pb2.PullRequest(**self._caller(index))
        for key in keys:
            set_key(request.keys.add(), key)
        return request

    # ---- row-sparse values: plain messages, only the rows travel ----------------------

    def _push_rows(self, pairs):
        """RowSparsePush of each key's merged rows to every server holding it (a slice's server
        gets the rows that touch its slice, or none, so that its round counts this push)."""
        grouped = {}
        for key, values in pairs:
            grouped.setdefault(key, []).extend(values)
        _MERGE.check_keys(list(grouped))
        requests = {}
        for key, values in grouped.items():
            value = merge_rows(key, [RowSparse(to_host(v.data), v.indices, v.shape) for v in values])
            data = value.data.astype(values[0].dtype, copy=False)
            self._check_known(key, value.shape, data.dtype, "pushed")
            width = math.prod(value.shape[1:])
            for index, where in self._placement(key, math.prod(value.shape)):
                sent = slice(None) if where is None else touching(value.indices, width, where)
                if index not in requests:
                    requests[index] = kvstore_pb2.RowSparsePushRequest(**self._caller(index))
                rowsparse_wire.set_value(requests[index].values.add(), key, value.shape, value.indices[sent],
                                         data[sent])
        self._each({index: lambda stub, request=request: stub.RowSparsePush(request, timeout=self._timeout)
                    for index, request in requests.items()}, "push")

    def _row_sparse_pull(self, requests):
        """[(full shape, rows)] of ``requests`` [(key, row ids)]: each server is asked for the
        distinct rows that touch what it holds, all servers at once."""
        _MERGE.check_keys([key for key, _ in requests])
        self._learn_shapes({key for key, _ in requests if key not in self._meta})
        plan, results = {}, []
        for position, (key, ids) in enumerate(requests):
            shape, dtype = self._meta[key]
            if not shape:
                raise InvalidArgumentError(f"key {key_repr(key)}: a scalar value has no rows to pull")
            unique, inverse = np.unique(check_row_ids(key, ids, shape[0]), return_inverse=True)
            results.append((shape, np.empty((len(unique),) + shape[1:], dtype), inverse))
            for index, where in self._placement(key, math.prod(shape)):
                mask = np.ones(len(unique), bool) if where is None else touching(unique, math.prod(shape[1:]), where)
                if mask.any():
                    plan.setdefault(index, []).append((position, where, np.flatnonzero(mask), unique[mask]))
        answers = self._each({index: lambda stub, index=index, part=part: stub.RowSparsePull(
            self._rows_request(index, [(requests[position][0], ids) for position, _, _, ids in part]),
            timeout=self._timeout) for index, part in plan.items()}, "row_sparse_pull")
        for index, answer in answers.items():
            for (position, where, positions, ids), value in zip(plan[index], answer.values):
                rows = rowsparse_wire.get_value(value)[3]
                shape, _, inverse = results[position]
                if where is None and len(ids) == len(inverse) and bool((ids == requests[position][1]).all()):
                    results[position] = (shape, rows, None)  # distinct ascending ids from one server: as received
                else:
                    place(results[position][1], positions, ids, rows, where)
        return [(shape, rows if inverse is None else rows[inverse]) for shape, rows, inverse in results]

    def _learn_shapes(self, keys):
        """Ask each key's home server for none of its rows, which tells its shape and dtype."""
        homes = {}
        for key in keys:
            homes.setdefault(home(key, len(self._stubs)), []).append((key, ()))
        answers = self._each({index: lambda stub, index=index, part=part: stub.RowSparsePull(
            self._rows_request(index, part), timeout=self._timeout) for index, part in homes.items()},
            "row_sparse_pull")
        for answer in answers.values():
            for value in answer.values:
                key, shape, _, rows = rowsparse_wire.get_value(value)
                self._meta[key] = (shape, rows.dtype)

    def _rows_request(self, index, part):
        request = kvstore_pb2.RowSparsePullRequest(**self._caller(index))
        for key, ids in part:
            rowsparse_wire.set_row_ids(request.keys.add(), key, ids)
        return request

    # ---- optimizer --------------------------------------------------------------------

    def _set_updater(self, updater):
        raise FailedPreconditionError(
            f"a Python updater cannot run on a tensorkv server ('{self.type}'): code does not travel. "
            "Use kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=..., momentum=...)) or another "
            "declarative optimizer of tensorkv.optimizer, which runs on the servers")

    def _set_optimizer(self, optimizer):
        self._send_optimizer(optimizer, {}, "set_optimizer")

    def _send_optimizer(self, optimizer, by_server, kind):
        """SetUpdater on every server, with that server's states {index: {key: (n, [Item])}}."""
        self._each({index: lambda stub, index=index: stub.SetUpdater(states_wire.to_messages(
            kvstore_pb2.SetUpdaterRequest, optimizer, by_server.get(index, {})), timeout=self._timeout)
            for index in range(len(self._stubs))}, kind)

    def _set_learning_rate(self, learning_rate):
        request = kvstore_pb2.SetLearningRateRequest(learning_rate=learning_rate)
        self._each({index: lambda stub: stub.SetLearningRate(request, timeout=self._timeout)
                    for index in range(len(self._stubs))}, "set_learning_rate")

    def _save_optimizer_states(self, fname):
        results = self._each({index: lambda stub: states_wire.from_messages(stub.GetOptimizerStates(
            kvstore_pb2.GetOptimizerStatesRequest(), timeout=self._timeout)) for index in range(len(self._stubs))},
            "save_optimizer_states")
        optimizer, merged = None, {}
        for index in sorted(results):
            server_optimizer, key_states = results[index]
            optimizer = server_optimizer or optimizer
            for key, (num_update, items) in key_states.items():
                arrays = merged.setdefault(key, (num_update, [None] * len(items)))[1]
                self._assemble(arrays, {0: list(enumerate(items))}, {0: items})
        if optimizer is None:
            raise FailedPreconditionError("no optimizer is set on the servers: call kv.set_optimizer(...) first")
        states_file.save(fname, optimizer, merged)

    def _load_optimizer_states(self, fname):
        optimizer, key_states = states_file.load(fname)
        by_server = {}
        for key, (num_update, arrays) in key_states.items():
            parts = [self._split(key, array) for array in arrays]
            for j, split in enumerate(parts):
                for index, item in split:
                    entry = by_server.setdefault(index, {}).setdefault(key, (num_update, [None] * len(arrays)))
                    entry[1][j] = item
        self._send_optimizer(optimizer, by_server, "load_optimizer_states")

    # ---- the rest ---------------------------------------------------------------------

    def _barrier(self):
        self._each({0: lambda stub: stub.Barrier(kvstore_pb2.BarrierRequest(**self._caller(0)), timeout=self._timeout)},
                   "barrier")

    def close(self):
        if not self._closed:
            if self._heartbeat is not None:
                self._heartbeat.close()
            self._unregister()
            for session in self._sessions or ():
                session.close()
            for channel in self._channels:
                channel.close()
            if self._pool is not None:
                self._pool.shutdown()
        super().close()
