"""The one place where tensorkv errors meet gRPC statuses, on both sides of the wire.

A server handler raises a :class:`~tensorkv.errors.KVStoreError`; :func:`translate_errors`,
which wraps every handler as it is registered, sends its ``code`` as the status, its message
as the details and its class name in the trailing metadata entry ``tensorkv-error``. A
client turns a ``grpc.RpcError`` back into the same class with :func:`error_from_rpc`.
"""
import collections
import functools
import inspect
import itertools
import logging
import os
import queue
import threading
import time

import grpc

from .errors import (
    ERROR_METADATA_KEY, DeadlineExceededError, InternalError, KVStoreError, ResourceExhaustedError,
    ServerUnavailableError, error_from_status,
)
from . import datachan, packed, shm
from .v1 import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

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


# ---- server side ----------------------------------------------------------------------

def _as_kvstore_error(error, where):
    """``error`` as the KVStoreError a client gets: a MemoryError is RESOURCE_EXHAUSTED, anything
    else but a KVStoreError is INTERNAL (and logged with its traceback; the file an OSError
    names is left out of the message)."""
    if isinstance(error, KVStoreError):
        return error
    if isinstance(error, MemoryError):
        log.warning("out of memory in %s: %s", where, error)
        return ResourceExhaustedError(f"the server ran out of memory: {type(error).__name__}: {error}")
    log.exception("unexpected error in %s", where)
    if isinstance(error, OSError) and error.filename is not None:  # a place on the server: for its log only
        return InternalError(f"{type(error).__name__}: {error.strerror} (the server's log names the file)")
    return InternalError(f"{type(error).__name__}: {error}")


async def _abort(context, error, method):
    error = _as_kvstore_error(error, method)
    await context.abort(
        grpc.StatusCode[error.code], str(error),
        trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),),
    )


def translate_errors(handler, parse=None):
    """``handler`` (an async function or async generator function of (request, context), e.g.
    a bound servicer method) as a gRPC handler whose errors reach the client as statuses: a
    KVStoreError as its own code, a MemoryError as RESOURCE_EXHAUSTED, anything else
    as INTERNAL (and logged with its traceback).
    ``parse(request, context)``, when given, turns the request as gRPC delivers it (bytes, or
    an async iterator of them) into what ``handler`` receives, within that translation: a
    malformed request fails with its own status."""
    parse = parse or (lambda request, context: request)
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream(request, context):
            try:
                async for response in handler(parse(request, context), context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await _abort(context, error, handler.__name__)
        return stream

    @functools.wraps(handler)
    async def unary(request, context):
        try:
            return await handler(parse(request, context), context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await _abort(context, error, handler.__name__)
    return unary


# ---- client side ----------------------------------------------------------------------

def error_from_rpc(error, address, kind):
    """The KVStoreError to raise for the ``grpc.RpcError`` that a ``kind`` call ('push',
    'pull', ...) to ``address`` raised."""
    class_name = dict(error.trailing_metadata() or ()).get(ERROR_METADATA_KEY)
    return error_from_code(error.code(), error.details(), class_name, address, kind)


def error_from_code(code, details, class_name, address, kind):
    """The KVStoreError for status ``code`` (a grpc.StatusCode) with ``details`` and the
    error class name the server sent (None if none) that a ``kind`` call got."""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        if class_name is None:  # made by the transport, not sent by a server
            return transport_error(details, address, kind)
        return ServerUnavailableError(f"server {address} is unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"server {address} did not answer within the deadline: {details}")
    return error_from_status(code.name, details, class_name)


# Calls that change nothing on a server: any other whose connection broke may have taken effect.
READ_ONLY_CALLS = frozenset({"info", "pull", "barrier", "save_optimizer_states"})

# The transport's words for a connection it could not make, and what they mean.
_CONNECT_FAILURES = (
    ("Connection refused", "the connection was refused (nothing listens on that port)"),
    ("Connection reset by peer", "the connection was reset (by the server, or by something between)"),
    ("HTTP/2", "something else answers there: not a tensorkv (gRPC) server"),
    ("http1", "something else answers there: an HTTP/1 server, not a tensorkv (gRPC) server"),
    ("Socket closed", "the peer closed the connection before answering: not a tensorkv (gRPC) server, "
                      "or one that is stopping"),
)


def transport_error(details, address, kind):
    """The ServerUnavailableError for a ``kind`` call whose connection to ``address`` could
    not be made or broke, in words instead of the transport's ``details``."""
    hint = f"is tensorkv-server running on {address}?"
    if "resolving" in details or "DNS resolution failed" in details:
        host = address.rsplit(":", 1)[0]
        return ServerUnavailableError(f"cannot reach server {address}: host {host} is unknown "
                                      f"(its name does not resolve); {hint}")
    if "failed to connect" in details:  # no connection: the call was not sent
        cause = next((words for text, words in _CONNECT_FAILURES if text in details),
                     details.rsplit(": ", 1)[-1].lower())  # the system's reason, e.g. "no route to host"
        return ServerUnavailableError(f"cannot connect to server {address}: {cause}; {hint}")
    effect = f"the {kind} changed nothing" if kind in READ_ONLY_CALLS else f"the {kind} may have been applied"
    return ServerUnavailableError(f"server {address} closed the connection during the {kind} "
                                  f"(it may have crashed or been killed); {effect}")


def connection_lost(error):
    """Whether the ``grpc.RpcError`` ``error`` is a connection that was made, then reset or
    closed by the peer (a server, or something between, accepted it and tore it down, before
    or after the HTTP/2 handshake), not refused (ECONNREFUSED: nothing listens). Both arrive
    as UNAVAILABLE; only the transport's words tell them apart. A reset may read as either
    ("Connection reset by peer", or "Socket closed" when it meets a write); a peer that closes
    may also be one that refuses this client's credentials (Security.diagnose tells)."""
    details = error.details() or ""
    return error.code() == grpc.StatusCode.UNAVAILABLE and (
        "Connection reset by peer" in details or "Socket closed" in details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number):
    """The grpc.StatusCode of a status number (UNKNOWN for one it does not know)."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


def error_status(error):
    """(status number, message, class name) that a server sends for ``error`` (see
    :func:`_as_kvstore_error`)."""
    error = _as_kvstore_error(error, "a session call")
    return grpc.StatusCode[error.code].value[0], str(error), type(error).__name__


class Stub(kvstore_pb2_grpc.KVStoreServiceStub):
    """The generated stub, plus the tensor streams with bytes in and out (encoded and decoded
    by :mod:`tensorkv.codec`): ``init``, ``push`` and ``pushpull`` take the list of serialized
    request messages and make a unary call when there is only one, which is the same on the
    wire as a stream of one message and saves the thread that feeds a request stream."""

    _PATH = "/" + kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name + "/"

    def __init__(self, channel):
        super().__init__(channel)
        path = self._PATH
        self._init = (channel.unary_unary(path + "Init", response_deserializer=kvstore_pb2.InitResponse.FromString),
                      channel.stream_unary(path + "Init", response_deserializer=kvstore_pb2.InitResponse.FromString))
        self._push = (channel.unary_unary(path + "Push", response_deserializer=kvstore_pb2.PushResponse.FromString),
                      channel.stream_unary(path + "Push", response_deserializer=kvstore_pb2.PushResponse.FromString))
        self._pushpull = (channel.unary_stream(path + "PushPull"), channel.stream_stream(path + "PushPull"))
        self.pull_raw = channel.unary_stream(path + "Pull", request_serializer=kvstore_pb2.PullRequest.SerializeToString)

    @staticmethod
    def _send(calls, messages, timeout):
        if len(messages) == 1:
            return calls[0](messages[0], timeout=timeout)
        return calls[1](iter(messages), timeout=timeout)

    def init_raw(self, messages, timeout):
        return self._send(self._init, messages, timeout)

    def push_raw(self, messages, timeout):
        return self._send(self._push, messages, timeout)

    def pushpull_raw(self, messages, timeout):
        """The serialized PushPullResponse messages, as an iterator."""
        return self._send(self._pushpull, messages, timeout)


# Seconds past a session call's own timeout (which the server enforces) after which the
# client gives up on a server that does not answer at all.
SESSION_GRACE = 2.0


class Session:
    """One long-lived Session stream to a server, for small calls: a call sends one
    serialized SessionRequest and reads its SessionResponse, saving the setup of an RPC.

    One call at a time: :meth:`call` returns None when another thread is using the session
    (the caller then makes a plain RPC). A broken stream is reopened on the next call; a
    call on it fails as the plain RPC would (UNAVAILABLE: ServerUnavailableError). A
    watchdog thread cancels a call that outlives its timeout by SESSION_GRACE (a server
    that does not answer at all): DeadlineExceededError.

    Shared memory: when :attr:`shm_allowed` (the server is willing, the transport is
    'auto'), a call that asks for ``shm_bytes`` gets a :class:`tensorkv.shm.Region` of at
    least that size registered on the stream (created, proved and grown here, under the
    call's lock). A server that cannot attach it (another host, shared memory off) turns
    shared memory off for this session: calls then carry their bytes in the messages. The
    region lives as long as the stream: a reset stream drops it, and the server releases
    its side when the stream ends.

    Data channel: when :attr:`data_port` is set (the server offers one, the transport allows
    it), a call that asks for it gets a :class:`tensorkv.datachan.Channel` bound to the
    stream (negotiated here, under the call's lock). A failed negotiation turns the channel
    off for this session. A channel that broke, or that a failed call used (the server
    closes it then), is dropped; the next call negotiates a new one. It lives no longer
    than the stream. ``data_tls``: the ssl.SSLContext of the data channel of a TLS server.

    Packed layouts (tensorkv.packed): a call made with a ``layout`` on a channel that takes
    calls has the layout registered on the stream first, once per stream (its id is then
    ``layout_ids[layout]``, keyed by the object: its ServerConn hands out one per list). A
    layout the server refuses is not asked for again on this stream; its calls go as entries.
    """

    def __init__(self, channel, address, shm_allowed=False, data_port=0, data_tls=None):
        self._method = channel.stream_stream(Stub._PATH + "Session")
        self._address = address
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._queue = self._call = None
        self._deadline = None
        self._expired = False
        self._stop = threading.Event()
        self._watchdog = None
        self.shm_allowed = shm_allowed
        self.region = None
        self.data_port = data_port
        self.data_tls = data_tls
        self.data_channel = None
        # Whether calls go framed on the data channel once one is bound (every call then
        # negotiates one), and the deferred calls sent there whose answers are not read yet.
        self.calls_on_channel = False
        self._unread = collections.deque()  # Deferred
        self.layout_ids = {}  # packed.Layout -> its id on this stream
        self.refused_layouts = set()  # of this stream

    def call(self, build, timeout, decode=None, shm_bytes=0, data_channel=False, kind="call", defer=None,
             read_only=False, layout=None, answer_bytes=datachan.MAX_ANSWER_BYTES):
        """``decode(id, serialized SessionResponse, region, channel)`` (default: (id, response))
        for the request that ``build(id, timeout_ms, region, channel)`` returns with the arrays
        whose bytes follow on the data channel, as (serialized SessionRequest, arrays); both
        run under the session's lock. ``region`` is the shared-memory Region for a call with
        ``shm_bytes`` > 0, ``channel`` the data channel for a call with ``data_channel`` (each
        None when there is none); ``decode`` receives what the response says follows on the
        channel. ``kind`` names the call in errors ('push', 'pull', ...). None when the session
        is busy or closed.

        On a channel that takes calls (:attr:`calls_on_channel`), a call with ``defer`` (a
        :class:`Deferred`) is sent and not waited for: it returns ``defer``, whose answer a later
        call reads. A later call first reads those answers, except one that is ``read_only``,
        which is sent before them; the first deferred call that failed then raises its error
        (``Deferred.failed``), after every answer sent for was read.

        With a ``layout`` (a packed.Layout), None also when the call cannot move its values packed:
        its calls do not go on a channel, or the server refused the layout (or this stream holds
        packed.MAX_LAYOUTS).

        ``answer_bytes``: the longest answer the call can have (its serialized SessionResponse);
        a server that announces a longer one on the data channel fails the call (InternalError)
        before anything is allocated for it."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._stop.is_set():
                return None
            if self._call is None:
                self._open()
            region = self._ensure_region(shm_bytes, timeout, kind) if shm_bytes > 0 else None
            channel = self._calls_channel(timeout, kind)
            if layout is not None and (channel is None or not self._register(layout, timeout, kind)):
                return None
            if channel is None:
                channel = self._ensure_channel(timeout, kind) if data_channel and region is None else None
                return self._grpc_call(build, timeout, decode, region, channel, kind)
            if not read_only:
                self._read_unread()
            bytes_channel = channel if data_channel and region is None else None
            return self._channel_call(channel, build, timeout, decode, region, bytes_channel, kind, defer,
                                      answer_bytes)
        finally:
            self._lock.release()

    def settle(self):
        """Read the answers of the deferred calls; the error of the first that failed (see :meth:`call`)."""
        with self._lock:
            self._read_unread()

    @property
    def unread(self):
        return bool(self._unread)

    def _grpc_call(self, build, timeout, decode, region, channel, kind):
        call_id = next(self._ids)
        if channel is not None:
            channel.deadline = time.monotonic() + timeout
        request, arrays = build(call_id, max(1, int(timeout * 1000)), region, channel)
        failed = []
        try:
            data = self._roundtrip(request, timeout, kind,
                                   lambda: self._send(channel, arrays, failed) if arrays else None)
        except BaseException:  # e.g. interrupted mid-send: this call's answer must not be the next's
            self._reset()
            raise
        try:
            result = (decode or _id_and_answer)(call_id, data, region, channel)
            if failed:  # a value did not reach the server: the call cannot have succeeded
                raise failed[0]
            return result
        except BaseException:
            if channel is not None:  # the server closes it on failing a call that uses it
                channel.close()
            raise
        finally:
            if self._expired:  # the watchdog fired just as the answer came: start afresh
                self._reset()
            elif self.data_channel is not None and self.data_channel.closed:
                self.data_channel = None

    def _channel_call(self, channel, build, timeout, decode, region, bytes_channel, kind, defer, answer_bytes):
        """The call framed on ``channel``; earlier deferred answers read after it is sent. The
        channel stays after an error the server answered (it read every byte the call
        announced); anything else resets the session."""
        call_id = next(self._ids)
        channel.deadline = time.monotonic() + timeout + SESSION_GRACE
        request, arrays = build(call_id, max(1, int(timeout * 1000)), region, bytes_channel)
        decode = decode or _id_and_answer
        try:
            refused = channel.send_call(request, arrays)
            if refused is not None:  # the answer says why the server did not take the bytes
                decode(call_id, refused, region, None)
                raise datachan.lost(ServerUnavailableError(
                    f"server {self._address}: the data channel closed during the {kind}"))
            if defer is not None:
                defer.answer = (call_id, decode, region, kind, timeout, answer_bytes)
                defer.sent(request)
                self._unread.append(defer)
                return defer
            earlier = None
            if self._unread:  # a read-only call, sent before their answers are read
                try:
                    self._read_unread()
                except KVStoreError as error:
                    if self.data_channel is None:  # the session was reset: this call's answer is lost too
                        raise
                    earlier = error
            channel.deadline = time.monotonic() + timeout + SESSION_GRACE
            try:
                result = decode(call_id, channel.read_answer(answer_bytes), region, bytes_channel)
            except BaseException as error:
                if earlier is None:
                    raise
                if not _answered(error):
                    self._reset()
                raise earlier from error
            if earlier is not None:
                raise earlier
            return result
        except BaseException as error:
            if _answered(error) or self.data_channel is None:  # the server's answer, or already reset
                raise
            self._reset()
            raise _as_connection_lost(error, self._address, kind) from None
        finally:
            if self.data_channel is not None and self.data_channel.closed:
                self.data_channel = None

    def _read_unread(self):
        """Read the answers of the deferred calls. Once all are read, the first that failed
        raises its error (Deferred.failed); one answered UNAVAILABLE (the server stops) is not
        failed: its ServerUnavailableError has the caller connect again and send it again. A
        channel lost meanwhile resets the session (the first failure is still raised)."""
        first = unavailable = None
        channel, kind = self.data_channel, "call"
        try:
            while self._unread:
                deferred = self._unread[0]
                call_id, decode, region, kind, timeout, answer_bytes = deferred.answer
                channel.deadline = time.monotonic() + timeout + SESSION_GRACE  # the server bounds the call itself
                try:
                    decode(call_id, channel.read_answer(answer_bytes), region, None)
                except KVStoreError as error:
                    if not _answered(error):
                        raise
                    if isinstance(error, ServerUnavailableError):
                        unavailable = unavailable or error
                    elif first is None:
                        first = deferred.failed(error)
                        first.answered = True
                else:
                    deferred.answered()
                self._unread.popleft()
        except BaseException as error:
            self._reset()
            if first is not None:
                raise first from None
            raise _as_connection_lost(error, self._address, kind) from None
        if first is not None:
            raise first
        if unavailable is not None:
            raise unavailable

    def _calls_channel(self, timeout, kind):
        """The data channel that takes this session's calls (negotiated if needed); None when
        calls go on the stream."""
        if not self.calls_on_channel:
            return None
        channel = self.data_channel
        if channel is not None and not self._unread and channel.peer_closed():  # after a call it could not read
            self.data_channel = channel = None
        if channel is None:
            channel = self._ensure_channel(timeout, kind)
        return channel if channel is not None and channel.takes_calls else None

    @staticmethod
    def _send(channel, arrays, failed):
        """Write ``arrays`` on the data channel; a failure is kept in ``failed``, to raise once
        the response says why (a server that refused the call closes the channel)."""
        try:
            channel.send(arrays)
        except KVStoreError as error:
            failed.append(error)

    def _roundtrip(self, request, timeout, kind, then=None):
        """Send one serialized request of a ``kind`` call on the stream, run ``then()`` and
        return the serialized response."""
        self._expired = False
        self._deadline = time.monotonic() + timeout + SESSION_GRACE
        self._queue.put(request)
        try:
            if then is not None:
                then()
            return next(self._call)
        except grpc.RpcError as error:
            expired = self._expired
            self._reset()
            if expired:
                raise DeadlineExceededError(
                    f"server {self._address} did not answer within {timeout:g} s") from None
            raise error_from_rpc(error, self._address, kind) from None
        except StopIteration:
            self._reset()
            raise transport_error("", self._address, kind) from None  # the server ended the stream
        finally:
            self._deadline = None

    @property
    def shm_possible(self):
        """Whether calls may use shared memory (a region exists or may be negotiated)."""
        return self.shm_allowed or self.region is not None

    def _ensure_region(self, nbytes, timeout, kind):
        """The registered region, grown to ``nbytes`` if the server agrees; None or a smaller
        region when it does not (the call then carries what does not fit inline)."""
        region = self.region
        if (region is not None and region.capacity >= nbytes) or not self.shm_allowed:
            return region
        try:
            new = shm.Region(shm.capacity_for(nbytes))
        except OSError as error:
            log.info("no shared memory for server %s (%s): values travel over gRPC", self._address, error)
            self.shm_allowed = False
            return region
        try:
            request = kvstore_pb2.SessionRequest(
                id=next(self._ids), op=kvstore_pb2.SESSION_OP_REGISTER_REGION,
                timeout_ms=max(1, int(timeout * 1000)),
                region=kvstore_pb2.SharedMemoryRegion(pid=os.getpid(), fd=new.fd, size=new.size, token=new.token))
            response = kvstore_pb2.SessionResponse.FromString(
                self._roundtrip(request.SerializeToString(), timeout, kind))
        except BaseException:
            new.close()
            raise
        if response.code or not response.region_id:
            new.close()
            self.shm_allowed = False
            log.info("server %s did not attach a shared-memory region (%s): values travel over gRPC",
                     self._address, response.message)
            return region
        new.id = response.region_id
        self.region = new
        if region is not None:
            region.close()
            release = kvstore_pb2.SessionRequest(id=next(self._ids), op=kvstore_pb2.SESSION_OP_UNREGISTER_REGION,
                                                 region_id=region.id)
            self._roundtrip(release.SerializeToString(), timeout, kind)
        return new

    def _register(self, layout, timeout, kind):
        """Whether ``layout`` is registered on this stream (registered now if need be)."""
        if layout in self.layout_ids:
            return True
        if layout in self.refused_layouts or len(self.layout_ids) >= packed.MAX_LAYOUTS:
            return False
        request = kvstore_pb2.SessionRequest(id=next(self._ids), op=kvstore_pb2.SESSION_OP_REGISTER_LAYOUT,
                                             timeout_ms=max(1, int(timeout * 1000)), layout=layout.message())
        response = kvstore_pb2.SessionResponse.FromString(self._roundtrip(request.SerializeToString(), timeout, kind))
        if response.code or not response.layout_id:
            self.refused_layouts.add(layout)
            log.info("server %s did not take a packed list of %d keys (%s): it travels as entries", self._address,
                     len(layout.keys), response.message)
            return False
        self.layout_ids[layout] = response.layout_id
        return True

    @property
    def channel_possible(self):
        """Whether calls may use a data channel (one exists or may be negotiated)."""
        return self.data_port > 0 or self.data_channel is not None

    def _ensure_channel(self, timeout, kind):
        """The data channel, negotiated if needed; None when the server does not bind one
        (this session then stays on the gRPC messages)."""
        if self.data_channel is not None or not self.data_port:
            return self.data_channel
        request = kvstore_pb2.SessionRequest(id=next(self._ids), op=kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL,
                                             timeout_ms=max(1, int(timeout * 1000)),
                                             calls_on_channel=self.calls_on_channel)
        response = kvstore_pb2.SessionResponse.FromString(self._roundtrip(request.SerializeToString(), timeout, kind))
        try:
            if response.code:
                raise ConnectionRefusedError(response.message)
            self.data_channel = datachan.Channel(self._address, self.data_port, response.data_token, timeout,
                                                 self.data_tls)
            self.data_channel.takes_calls = response.calls_on_channel
        except OSError as error:
            self.data_port = 0
            log.info("no data channel to server %s (%s): values travel in the gRPC messages", self._address, error)
        return self.data_channel

    def _open(self):
        requests = queue.SimpleQueue()

        def stream():
            while True:
                request = requests.get()
                if request is None:
                    return
                yield request

        self._queue, self._call = requests, self._method(stream())
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="tensorkv-session-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self):
        while not self._stop.wait(0.25):
            deadline, call = self._deadline, self._call
            if deadline is not None and call is not None and time.monotonic() > deadline:
                self._expired = True
                call.cancel()

    def _reset(self):
        self._unread.clear()  # their answers are lost with the channel: Deferred.answered never runs
        self.layout_ids.clear()  # the server forgets them with the stream
        self.refused_layouts.clear()
        if self._call is not None:
            self._queue.put(None)
            self._call.cancel()
        self._queue = self._call = None
        if self.region is not None:  # the server releases its side as the stream ends
            self.region.close()
            self.region = None
        if self.data_channel is not None:
            self.data_channel.close()
            self.data_channel = None

    def close(self):
        self._stop.set()
        with self._lock:
            self._reset()
        if self._watchdog is not None:
            self._watchdog.join(1.0)


def _id_and_answer(call_id, data, region, channel):
    """What Session.call returns without a ``decode``: (id, serialized SessionResponse)."""
    return call_id, data


def _as_connection_lost(error, address, kind):
    """``error``; or, where it says the data channel broke, the error a broken Session stream
    gives a ``kind`` call (the session is reset either way)."""
    if isinstance(error, ServerUnavailableError) and datachan.is_lost(error):
        return datachan.lost(transport_error("", address, kind))
    return error


def _answered(error):
    """Whether ``error`` is what a server answered (marked so by the caller's decode)."""
    return getattr(error, "answered", False)


class Deferred:
    """A call sent on a Session's data channel without waiting for its answer (Session.call's
    ``defer``). Under the session's lock: ``sent(request)`` runs once it is sent (with its
    serialized request), before anyone can read its answer; ``answered()`` when its answer
    says it succeeded; ``failed(error)`` gives the error to raise when it says it failed."""

    answer = None  # what reading its answer needs: set by Session

    def __init__(self, sent, answered, failed):
        self.sent, self.answered, self.failed = sent, answered, failed
