"""The Session stream: one long-lived stream per server that carries a worker's small calls,
with the shared-memory region and the data channel bound to it."""
import collections
import functools
import itertools
import logging
import os
import queue
import threading
import time

import grpc

from ..errors import DeadlineExceededError, KVStoreError, ServerUnavailableError
from ..v1 import kvstore_pb2
from ..wire import packed
from ..wire.status import READ_ONLY_CALLS, error_from_rpc, transport_error
from .. import cuda
from . import datachan, shm
from .routes import Call, Thresholds
from .rpc import Stub

log = logging.getLogger(__name__)


# Seconds past a session call's own timeout (which the server enforces) after which the
# client gives up on a server that does not answer at all.
SESSION_GRACE = 2.0
# The CUDA IPC buffers a stream keeps open on its server (the least recently used is closed
# first): a server keeps an allocation that this process freed as long as it is open.
MAX_CUDA_BUFFERS = 1024


class Session:
    """One long-lived Session stream to a server, for small calls: a call sends one
    serialized SessionRequest and reads its SessionResponse, saving the setup of an RPC.

    One call at a time: :meth:`call` returns None when another thread is using the session
    (the caller then makes a plain RPC). A broken stream is reopened on the next call; a
    call on it fails as the plain RPC would (UNAVAILABLE: ServerUnavailableError). A
    watchdog thread cancels a call that outlives its timeout by SESSION_GRACE (a server
    that does not answer at all): DeadlineExceededError.

    Shared memory: when :attr:`shm_allowed` (the server is willing, the transport is
    'auto'), a call whose route asks for ``shm_bytes`` gets a :class:`tensorkv.transport.shm.Region` of at
    least that size registered on the stream (created, proved and grown here, under the
    call's lock). A server that cannot attach it (another host, shared memory off) turns
    shared memory off for this session: calls then carry their bytes in the messages. The
    region lives as long as the stream: a reset stream drops it, and the server releases
    its side when the stream ends.

    Data channel: when :attr:`data_port` is set (the server offers one, the transport allows
    it), a call whose route asks for it gets a :class:`tensorkv.transport.datachan.Channel` bound to the
    stream (negotiated here, under the call's lock). A failed negotiation turns the channel
    off for this session. A channel that broke, or that a failed call used (the server
    closes it then), is dropped; the next call negotiates a new one. It lives no longer
    than the stream. ``data_tls``: the ssl.SSLContext of the data channel of a TLS server.

    Packed layouts (tensorkv.wire.packed): a call whose route has a ``layout``, on a channel that takes
    calls has the layout registered on the stream first, once per stream (its id is then
    ``layout_ids[layout]``, keyed by the object: its ServerConn hands out one per list). A
    layout the server refuses is not asked for again on this stream; its calls go as entries.

    GPU values (tensorkv.cuda, where CuPy sees a CUDA device): :attr:`gpu` is the
    session's pinned buffer and copies. With a server whose values live on a GPU
    (:attr:`gpu_server`), a route that wants its region ``pinned`` gets one registered as pinned
    memory on both ends; where either end cannot pin it, pinning is off for this session
    (:attr:`pinned_possible`), logged once. A route's ``exports`` (device allocations of this
    process) are opened on the server through CUDA IPC before its call, once per stream
    (``cuda_buffers``: export key -> id); a server that refuses one turns CUDA IPC off for this
    session (:attr:`ipc_possible`), logged once, and the call goes as a plain RPC.
    """

    def __init__(self, channel, address, shm_allowed=False, data_port=0, data_tls=None, thresholds=None):
        self._method = channel.stream_stream(Stub._PATH + "Session")
        self.address = address
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
        self.thresholds = thresholds or Thresholds()  # by which routes.choose picks a call's route
        # Whether calls go framed on the data channel once one is bound (every call then
        # negotiates one), and the deferred calls sent there whose answers are not read yet.
        self.calls_on_channel = False
        self._unread = collections.deque()  # (call id, route, call, timeout, region)
        self.layout_ids = {}  # packed.Layout -> its id on this stream
        self.refused_layouts = set()  # of this stream
        self.gpu_server = False  # the server's values live on a GPU (its Info.device)
        self._gpu = None
        self.pin_refused = self.ipc_refused = False
        self.cuda_buffers = collections.OrderedDict()  # gpu.Export.key -> its id on this stream
        self._caller = {}  # rank and incarnation of the call in progress (for the requests it makes)

    def call(self, route, call, timeout):
        """What ``route`` (tensorkv.transport.routes) reads in the answer to the request it builds for
        ``call`` (a routes.Call), both under the session's lock: the region is set up first
        for a route with ``shm_bytes`` > 0, the data channel for one with ``data_channel``.
        ``call.kind`` names it in errors ('push', 'pull', ...). None when the session is busy
        or closed.

        On a channel that takes calls (:attr:`calls_on_channel`), a push with a ``call.log``
        (a replay.PushLog) whose route keeps what sends it again (``route.kept``) is sent and
        not waited for: it returns [] (the log holds it until its answer), and a later call
        reads its answer. A later call first reads those answers, except a read-only one
        (status.READ_ONLY_CALLS), which is sent before them; the first deferred call that
        failed then raises its error (PushLog.failed), after every answer sent for was read.

        With a ``route.layout`` (a packed.Layout), None also when the call cannot move its
        values packed: its calls do not go on a channel, or the server refused the layout (or
        this stream holds packed.MAX_LAYOUTS).

        ``route.answer_bytes``: the longest answer the call can have (its serialized
        SessionResponse); a server that announces a longer one on the data channel fails the
        call (InternalError) before anything is allocated for it."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._stop.is_set():
                return None
            if self._call is None:
                self._open()
            kind = call.kind
            self._caller = call.caller or {}
            region = self._ensure_region(route.shm_bytes, timeout, kind, route.pinned) if route.shm_bytes > 0 else None
            if route.exports and not self._open_cuda_buffers(route.exports, timeout, kind):
                return None
            if self._gpu is not None and route.gpu is None:  # it does not wait for the copies still running
                self._gpu.settle()
            channel = self._calls_channel(timeout, kind)
            if route.layout is not None and (channel is None or not self._register(route.layout, timeout, kind)):
                return None
            if channel is None:
                channel = self._ensure_channel(timeout, kind) if route.data_channel and region is None else None
                return self._grpc_call(route, call, timeout, region, channel)
            if kind not in READ_ONLY_CALLS:
                self._read_unread()
            return self._channel_call(channel, route, call, timeout, region)
        finally:
            self._lock.release()

    def settle(self):
        """Read the answers of the deferred calls; the error of the first that failed (see :meth:`call`)."""
        with self._lock:
            self._read_unread()

    @property
    def unread(self):
        return bool(self._unread)

    def _grpc_call(self, route, call, timeout, region, channel):
        call_id = next(self._ids)
        if channel is not None:
            channel.deadline = time.monotonic() + timeout
        request, arrays = route.request(call_id, max(1, int(timeout * 1000)), region, channel)
        failed = []
        try:
            data = self._roundtrip(request, timeout, call.kind,
                                   lambda: self._send(channel, arrays, failed) if arrays else None)
        except BaseException:  # e.g. interrupted mid-send: this call's answer must not be the next's
            self._reset()
            raise
        try:
            result = route.answer(call_id, data, region, channel)
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

    def _channel_call(self, channel, route, call, timeout, region):
        """The call framed on ``channel``; earlier deferred answers read after it is sent. The
        channel stays after an error the server answered (it read every byte the call
        announced); anything else resets the session."""
        kind = call.kind
        bytes_channel = channel if route.data_channel and region is None else None
        call_id = next(self._ids)
        channel.deadline = time.monotonic() + timeout + SESSION_GRACE
        request, arrays = route.request(call_id, max(1, int(timeout * 1000)), region, bytes_channel)
        try:
            refused = channel.send_call(request, arrays)
            if refused is not None:  # the answer says why the server did not take the bytes
                route.answer(call_id, refused, region, None)
                raise datachan.lost(ServerUnavailableError(
                    f"server {self.address}: the data channel closed during the {kind}"))
            kept = route.kept(request) if call.log is not None else None
            if kept is not None:  # sent without waiting: a later call reads its answer
                call.log.sent(call.sequence, kept, call.undo)
                self._unread.append((call_id, route, call, timeout, region))
                return []
            return self._answer(channel, (call_id, route, call, timeout, region), bytes_channel)
        except BaseException as error:
            if _answered(error) or self.data_channel is None:  # the server's answer, or already reset
                raise
            self._reset()
            raise _as_connection_lost(error, self.address, kind) from None
        finally:
            if self.data_channel is not None and self.data_channel.closed:
                self.data_channel = None

    def _answer(self, channel, sent, bytes_channel):
        """What the route of the call ``sent`` (call id, route, call, timeout, region) reads in its
        answer on ``channel``, read after those of earlier deferred calls if a read-only call
        overtook them (whose first error is raised then)."""
        call_id, route, _, timeout, region = sent
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
            result = route.answer(call_id, channel.read_answer(route.answer_bytes), region, bytes_channel)
        except BaseException as error:
            if earlier is None:
                raise
            if not _answered(error):
                self._reset()
            raise earlier from error
        if earlier is not None:
            raise earlier
        return result

    def _read_unread(self):
        """Read the answers of the deferred calls. Once all are read, the first that failed
        raises its error (PushLog.failed); one answered UNAVAILABLE (the server stops) is not
        failed: its ServerUnavailableError has the caller connect again and send it again. A
        channel lost meanwhile resets the session (the first failure is still raised)."""
        first = unavailable = None
        channel, kind = self.data_channel, "call"
        try:
            while self._unread:
                call_id, route, call, timeout, region = self._unread[0]
                kind = call.kind
                channel.deadline = time.monotonic() + timeout + SESSION_GRACE  # the server bounds the call itself
                try:
                    route.answer(call_id, channel.read_answer(route.answer_bytes), region, None)
                except KVStoreError as error:
                    if not _answered(error):
                        raise
                    if isinstance(error, ServerUnavailableError):
                        unavailable = unavailable or error
                    elif first is None:
                        first = call.log.failed(call.sequence, route.keys(), error)
                        first.answered = True
                else:
                    call.log.answered(call.sequence)
                self._unread.popleft()
        except BaseException as error:
            self._reset()
            if first is not None:
                raise first from None
            raise _as_connection_lost(error, self.address, kind) from None
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
                    f"server {self.address} did not answer within {timeout:g} s") from None
            raise error_from_rpc(error, self.address, kind) from None
        except StopIteration:
            self._reset()
            raise transport_error("", self.address, kind) from None  # the server ended the stream
        finally:
            self._deadline = None

    @property
    def shm_possible(self):
        """Whether calls may use shared memory (a region exists or may be negotiated)."""
        return self.shm_allowed or self.region is not None

    @property
    def gpu(self):
        """The session's gpu.Gpu where CuPy sees a CUDA device (made by the first call), else None."""
        if self._gpu is None and cuda.cupy_module() is not None:
            self._gpu = cuda.Gpu(cuda.cupy_module())
        return self._gpu

    @property
    def pinned_possible(self):
        """Whether calls may use a region pinned on both ends (one exists or may be negotiated)."""
        if self.region is not None and self.region.pinned:
            return True
        return self.shm_allowed and self.gpu_server and not self.pin_refused and self.gpu is not None

    @property
    def ipc_possible(self):
        """Whether calls may share GPU values with the server through CUDA IPC."""
        return self.shm_allowed and self.gpu_server and not self.ipc_refused and self.gpu is not None

    def _ensure_region(self, nbytes, timeout, kind, pinned=False):
        """The registered region, grown to ``nbytes`` (and pinned on both ends, with ``pinned``,
        where they can) if the server agrees; None or a smaller region when it does not (the
        call then carries what does not fit inline)."""
        region = self.region
        pin = pinned and self.pinned_possible
        if (region is not None and region.capacity >= nbytes and (region.pinned or not pin)) or not self.shm_allowed:
            return region
        try:
            new = shm.Region(shm.capacity_for(max(nbytes, region.capacity if region is not None else 0)))
        except OSError as error:
            log.info("no shared memory for server %s (%s): values travel over gRPC", self.address, error)
            self.shm_allowed = False
            return region
        try:
            pin = pin and self._pin(new)
            request = kvstore_pb2.SessionRequest(
                id=next(self._ids), op=kvstore_pb2.SESSION_OP_REGISTER_REGION,
                timeout_ms=max(1, int(timeout * 1000)), **self._caller,
                region=kvstore_pb2.SharedMemoryRegion(pid=os.getpid(), fd=new.fd, size=new.size, token=new.token,
                                                      cuda=pin))
            response = kvstore_pb2.SessionResponse.FromString(
                self._roundtrip(request.SerializeToString(), timeout, kind))
        except BaseException:
            new.close()
            raise
        if response.code or not response.region_id:
            new.close()
            self.shm_allowed = False
            log.info("server %s did not attach a shared-memory region (%s): values travel over gRPC",
                     self.address, response.message)
            return region
        new.id = response.region_id
        if pin and not response.region_pinned:
            new.unpin()
            self.pin_refused = True
            log.info("server %s did not pin its side of the shared-memory region (its log says why): GPU values "
                     "travel through pageable memory there", self.address)
        new.pinned = pin and response.region_pinned
        self.region = new
        if region is not None:
            if self._gpu is not None:
                self._gpu.settle()  # copies out of the old region may still run
            region.close()
            release = kvstore_pb2.SessionRequest(id=next(self._ids), op=kvstore_pb2.SESSION_OP_UNREGISTER_REGION,
                                                 region_id=region.id)
            self._roundtrip(release.SerializeToString(), timeout, kind)
        return new

    def _pin(self, region):
        """Whether ``region`` is now registered as pinned memory here; where the driver refuses,
        pinning is off for this session (logged once)."""
        cupy = self.gpu.cupy
        try:
            region.pin(functools.partial(cuda.pin, cupy))
        except cupy.cuda.runtime.CUDARuntimeError as error:
            self.pin_refused = True
            log.info("the shared-memory region for server %s could not be pinned (%s): GPU values travel through "
                     "pageable memory", self.address, error)
            return False
        return True

    def _open_cuda_buffers(self, exports, timeout, kind):
        """Whether every allocation of ``exports`` (gpu.Export) is open on the server (opened now
        if need be); where the server refuses one, CUDA IPC is off for this session (logged once)."""
        for export in exports:
            if export.key in self.cuda_buffers:
                self.cuda_buffers.move_to_end(export.key)
                continue
            request = kvstore_pb2.SessionRequest(
                id=next(self._ids), op=kvstore_pb2.SESSION_OP_REGISTER_CUDA_BUFFER,
                timeout_ms=max(1, int(timeout * 1000)), **self._caller,
                cuda_buffer=kvstore_pb2.CudaIpcBuffer(handle=export.handle, size=export.size,
                                                      pci_bus_id=export.pci_bus_id))
            response = kvstore_pb2.SessionResponse.FromString(
                self._roundtrip(request.SerializeToString(), timeout, kind))
            if response.code or not response.region_id:
                self.ipc_refused = True
                log.info("server %s did not open a CUDA IPC buffer (%s): GPU values travel through %s", self.address,
                         response.message, "pinned shared memory" if self.pinned_possible else "the host")
                return False
            self.cuda_buffers[export.key] = response.region_id
            if len(self.cuda_buffers) > MAX_CUDA_BUFFERS:
                _, oldest = self.cuda_buffers.popitem(last=False)
                release = kvstore_pb2.SessionRequest(id=next(self._ids), op=kvstore_pb2.SESSION_OP_UNREGISTER_REGION,
                                                     region_id=oldest)
                self._roundtrip(release.SerializeToString(), timeout, kind)
        return True

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
            log.info("server %s did not take a packed list of %d keys (%s): it travels as entries", self.address,
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
                                             calls_on_channel=self.calls_on_channel, **self._caller)
        response = kvstore_pb2.SessionResponse.FromString(self._roundtrip(request.SerializeToString(), timeout, kind))
        try:
            if response.code:
                raise ConnectionRefusedError(response.message)
            self.data_channel = datachan.Channel(self.address, self.data_port, response.data_token, timeout,
                                                 self.data_tls)
            self.data_channel.takes_calls = response.calls_on_channel
        except OSError as error:
            self.data_port = 0
            log.info("no data channel to server %s (%s): values travel in the gRPC messages", self.address, error)
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
        self._unread.clear()  # their answers are lost with the channel: the PushLog sends them again
        self.layout_ids.clear()  # the server forgets them with the stream
        self.refused_layouts.clear()
        if self._call is not None:
            self._queue.put(None)
            self._call.cancel()
        self._queue = self._call = None
        self.cuda_buffers.clear()  # the server closes them as the stream ends
        if self._gpu is not None:
            self._gpu.settle()  # no copy may still run out of the region or the pinned buffer
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


def _as_connection_lost(error, address, kind):
    """``error``; or, where it says the data channel broke, the error a broken Session stream
    gives a ``kind`` call (the session is reset either way)."""
    if isinstance(error, ServerUnavailableError) and datachan.is_lost(error):
        return datachan.lost(transport_error("", address, kind))
    return error


def _answered(error):
    """Whether ``error`` is what a server answered (marked so by its route's answer: routes.check_answer)."""
    return getattr(error, "answered", False)


class RawSession(Session):
    """A Session whose requests are built by hand (tests and probes of the protocol): :meth:`call`
    takes ``build(id, timeout_ms, region, channel)``, which returns (serialized SessionRequest,
    arrays that follow it on the data channel), and returns (id, serialized SessionResponse)."""

    def call(self, build, timeout, shm_bytes=0):
        return super().call(_Raw(build, shm_bytes), Call("call"), timeout)


class _Raw:
    """The route of a request built by hand: its answer as it came."""

    data_channel = False
    layout = None
    pinned = False
    exports = ()
    gpu = None
    answer_bytes = datachan.MAX_ANSWER_BYTES

    def __init__(self, build, shm_bytes):
        self.request, self.shm_bytes = build, shm_bytes

    @staticmethod
    def answer(call_id, data, region, channel):
        return call_id, data

    @staticmethod
    def kept(request):
        return None
