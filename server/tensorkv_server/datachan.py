"""The data channel on the server: a second TCP port whose connections each carry the bytes
of large values for one Session stream (the client's half is ``tensorkv.transport.datachan``).

A stream asks for a channel and gets a one-time random token; a connection to the data
port that sends that token first is bound to that stream, acknowledged with one byte, and
the token is gone. A connection with an unknown (or already used) token, or none within
HANDSHAKE_TIMEOUT, is closed; at most MAX_PENDING connections wait to present one (a new one
closes the oldest of them, so a worker gets in however many idle ones come). Refusals are
logged at most once per REFUSAL_LOG_INTERVAL for each reason, with a count. A stream's
channel is closed when the stream ends, however it ends, when a call that uses it fails,
when the peer moves none of a call's bytes (its request's or its answer's) for the progress
timeout (progress.py: the call's bytes in flight are given back, and a WARNING says so, as
rarely as the refusals), and when the server stops. With TLS on the gRPC port, the data port
speaks TLS too (same certificate; mutual TLS when the gRPC port has it), before the token is read.
"""
import asyncio
import collections
import logging
import secrets
import socket
import traceback

import numpy as np

from tensorkv.errors import (
    DeadlineExceededError, FailedPreconditionError, KVStoreError, ResourceExhaustedError, ServerUnavailableError,
)
from tensorkv.wire.datachan import ACK, FRAME_HEADER
from tensorkv.wire.status import error_status
from tensorkv.v1 import kvstore_pb2

from . import datalink, metrics
from .budget import hold, own_slot, release_held
from .deadline import within
from .logs import ThrottledLog
from .progress import TIMEOUT as PROGRESS_TIMEOUT, stalled

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection gets for the TLS handshake and its token
MAX_PENDING = 64  # connections that may wait for their handshake and token at once
REFUSAL_LOG_INTERVAL = 60.0  # seconds between two log lines of refused connections for one reason
# Requests of at most this many bytes are first taken as they came, in one copy-free recv.
QUICK_BYTES = 1 << 16


def bare_host(host):
    """``host`` without the brackets of an IPv6 address."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class DataPort:
    """The listening socket on ``host``:``port`` (0: any free port) and the tokens handed out;
    ``tls_context()`` (None: plaintext) gives the ssl.SSLContext for each new connection.
    ``advertised``: the port clients are told to connect to (0: ``port``). ``progress_timeout``:
    seconds a call's bytes may stop moving before its channel is closed (None: no limit)."""

    def __init__(self, host, port=0, tls_context=None, advertised=0, progress_timeout=PROGRESS_TIMEOUT):
        ipv6 = ":" in host  # then both families, as gRPC serves them
        self._listener = socket.create_server((bare_host(host), port), family=socket.AF_INET6 if ipv6 else socket.AF_INET,
                                              dualstack_ipv6=ipv6 and socket.has_dualstack_ipv6())
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.advertised = advertised or self.port
        self._tls_context = tls_context
        self._pending = {}  # token -> (future of the bound link, the peer of the stream it binds to)
        self._tasks = set()
        self._waiting = collections.OrderedDict()  # task -> its peer, of connections yet to present a token
        self._refusals = ThrottledLog(log, "data channel connection from %s refused: %s", REFUSAL_LOG_INTERVAL)
        self.progress_timeout = progress_timeout
        self.stalls = ThrottledLog(log, "data channel of %s closed: %s", REFUSAL_LOG_INTERVAL)
        self._accepting = None

    def start(self):
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self):
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self._listener)
            except OSError as error:  # e.g. out of file descriptors: keep serving the others
                log.warning("data port: accept failed: %s", error)
                await asyncio.sleep(0.1)
                continue
            if len(self._waiting) >= MAX_PENDING:
                oldest, oldest_peer = self._waiting.popitem(last=False)
                oldest.cancel()
                self._refusals.note(oldest_peer, f"closed: {MAX_PENDING} newer connections came before its token")
            task = loop.create_task(self._bind(conn, peer))
            self._tasks.add(task)
            self._waiting[task] = peer
            task.add_done_callback(self._done)

    def _done(self, task):
        self._tasks.discard(task)
        self._waiting.pop(task, None)

    async def _bind(self, conn, peer):
        try:
            link, token = await asyncio.wait_for(self._handshake(conn), HANDSHAKE_TIMEOUT)
            self._waiting.pop(asyncio.current_task(), None)  # no longer one to close for a newer one
            waiter, stream = self._pending.pop(token, (None, None))
            if waiter is None or waiter.done():
                raise ConnectionRefusedError("unknown or used token")
            waiter.set_result(link)  # bound before the client hears so and sends its next call
            await link.sendall(ACK)
            log.info("data channel from %s:%d bound to the stream of %s", *peer[:2], stream)
        except (OSError, EOFError, asyncio.TimeoutError) as error:  # ssl.SSLError is an OSError
            reason = f"no token within {HANDSHAKE_TIMEOUT:g} s" if isinstance(error, asyncio.TimeoutError) else error
            self._refusals.note(peer, str(reason))
            conn.close()
        except asyncio.CancelledError:  # the server is stopping, or a newer connection took its place
            conn.close()
            raise

    async def _handshake(self, conn):
        """(the connection's link, the token it presents)."""
        link = await datalink.accept(conn, self._tls_context() if self._tls_context else None)
        token = bytearray(TOKEN_BYTES)
        await link.read_into(memoryview(token))
        return link, bytes(token)

    def offer(self, stream):
        """(a new token, the future of the socket that presents it) for the stream of peer
        ``stream`` (its log lines name the channel by it)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        waiter = asyncio.get_running_loop().create_future()
        self._pending[token] = waiter, stream
        return token, waiter

    def withdraw(self, token):
        self._pending.pop(token, None)

    def close(self):
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._listener.close()


class StreamChannel:
    """The data channel of one Session stream: none, offered (a token is out), or bound; and,
    where the client asked for it, the task that serves the stream's calls on it, whose wait
    for the next call ``streams`` (streams.OpenStreams) ends when the server stops."""

    def __init__(self, port, peer, streams):
        self._port, self.peer, self._streams = port, peer, streams
        self._token = self._waiter = None
        self._calls = None  # the task of serve_calls

    def open(self):
        """A token for a new channel (the previous one is closed)."""
        self.close()
        self._token, self._waiter = self._port.offer(self.peer)
        return self._token

    @property
    def takes_calls(self):
        """Whether this stream's calls come on the channel (serve_calls)."""
        return self._calls is not None

    def serve_calls(self, handle, send_after, max_bytes, budget):
        """Once the channel is bound, serve the calls framed on it (SessionResponse.calls_on_channel):
        ``await handle(request bytes)`` gives (the serialized SessionResponse, None or the values
        that follow it (with a ``release()`` for when they are not sent), whether to close the
        channel after it); ``await send_after(values)`` sends those. A request longer than
        ``max_bytes`` is refused unread (RESOURCE_EXHAUSTED) and closes the channel; so does
        the end of the connection, and a request that finds no room in ``budget`` (budget.Budget)
        before it is read, which it waits for: back pressure on the sender."""
        self._calls = asyncio.get_running_loop().create_task(
            self._serve_calls(self._waiter, handle, send_after, max_bytes, budget))
        self._calls.add_done_callback(_log_failure)

    async def _serve_calls(self, waiter, handle, send_after, max_bytes, budget):
        own_slot()  # beside its Session stream's calls, which hold bytes of their own
        header = bytearray(FRAME_HEADER)
        try:
            link = await self._streams.next_call(lambda: waiter)
            while True:
                await self._streams.next_call(lambda: link.read_into(memoryview(header)))
                size = int.from_bytes(header, "little")
                if size > max_bytes:  # refused unread (its id unknown: 0), and the bytes that follow it unknown
                    log.warning("data channel of %s closed: a call of %d bytes (at most %d)", self.peer, size,
                                max_bytes)
                    refusal = _refusal(ResourceExhaustedError(
                        f"a call of {size} bytes on the data channel; this server takes at most {max_bytes} "
                        f"(--max-inflight-bytes, with room for the keys of --max-keys-per-call)"))
                    metrics.session_error("RESOURCE_EXHAUSTED")
                    await link.sendall(len(refusal).to_bytes(FRAME_HEADER, "little") + refusal)
                    return
                try:
                    hold(await budget.reserve(min(size, budget.total or size), None,
                                              f"a call of {size} bytes on the data channel"))
                except ResourceExhaustedError as error:  # its bytes stay unread: the channel closes
                    log.warning("data channel of %s closed: %s", self.peer, error)
                    metrics.session_error("RESOURCE_EXHAUSTED")
                    refusal = _refusal(error)
                    await link.sendall(len(refusal).to_bytes(FRAME_HEADER, "little") + refusal)
                    return
                try:
                    response, outgoing, close = await handle(await self._request(link, size))
                    try:
                        await self._answer(link, len(response).to_bytes(FRAME_HEADER, "little") + response)
                    except BaseException:
                        if outgoing is not None:
                            outgoing.release()
                        raise
                    if outgoing is not None:
                        await send_after(outgoing)
                finally:
                    release_held()  # the request's bytes, or the answer's
                if close or not self.bound:
                    return
        except datalink.Stalled:
            self._port.stalls.note(self.peer, str(stalled("a call on the data channel", self._port.progress_timeout)))
        except (OSError, EOFError, KVStoreError) as error:  # the connection is gone, or failed a send
            log.info("data channel of %s: %s", self.peer, error)
        finally:
            if self._waiter is waiter:
                self.close()

    async def _request(self, link, size):
        """The ``size`` bytes of a call's request: those that came already (a small request
        has, with its header), the rest as long as they keep moving."""
        ready = link.received(size) if size <= QUICK_BYTES else b""
        if len(ready) == size:
            return ready
        rest = await self._moving(link, link.read_bytes(size - len(ready)))
        return ready + rest if ready else rest

    async def _answer(self, link, frame):
        """Send ``frame``: what the socket takes now, the rest as long as it keeps moving."""
        sent = link.send_now(frame)
        if sent < len(frame):
            await self._moving(link, link.sendall(memoryview(frame)[sent:]))

    async def _moving(self, link, work):
        """``await work``, which reads or writes ``link``: datalink.Stalled once its bytes stop
        moving for the progress timeout."""
        async with link.moving(self._port.progress_timeout):
            return await work

    async def calls_ended(self):
        """Wait until the task serving calls on the channel, if any, has ended."""
        if self._calls is not None:
            await asyncio.wait([self._calls])

    @property
    def bound(self):
        """Whether a connection presented this stream's token (and is not closed)."""
        waiter = self._waiter
        return waiter is not None and waiter.done() and not waiter.cancelled()

    def _link(self):
        if not self.bound:
            raise FailedPreconditionError("this stream has no connected data channel: ask for one first")
        return self._waiter.result()

    async def receive(self, buffers, timeout):
        """Fill the uint8 arrays ``buffers`` from the channel, in order, within ``timeout`` s."""
        link = self._link()
        await self._io(link, self._receive(link, buffers), timeout)

    @staticmethod
    async def _receive(link, buffers):
        for buffer in buffers:
            await link.read_into(memoryview(buffer))

    async def send(self, arrays, timeout):
        """Write the bytes of the host arrays ``arrays`` (C-contiguous) on the channel, in order,
        within ``timeout`` s."""
        link = self._link()
        await self._io(link, self._send(link, arrays), timeout)

    @staticmethod
    async def _send(link, arrays):
        for array in arrays:
            await link.sendall(memoryview(array.reshape(-1).view(np.uint8)))

    async def _io(self, link, work, timeout):
        """``await work``, the reads or writes of a call's values on ``link``, within ``timeout``
        s; a failure closes the channel. A stall (the progress timeout) is logged here, at most
        once a minute (DataPort.stalls)."""
        try:
            await self._moving(link, within(work, timeout))
        except datalink.Stalled:
            self.close()
            error = stalled("a call on the data channel", self._port.progress_timeout)
            self._port.stalls.note(self.peer, str(error))
            raise error from None
        except (asyncio.TimeoutError, OSError, EOFError) as error:
            self.close()
            raise _io_error(error, timeout) from None

    def close(self):
        calls, self._calls = self._calls, None
        if calls is not None and calls is not asyncio.current_task():
            calls.cancel()
        if self._token is not None:
            self._port.withdraw(self._token)
        waiter = self._waiter
        if waiter is not None:
            if waiter.done() and not waiter.cancelled():
                waiter.result().close()
                log.info("data channel of %s closed", self.peer)
            else:
                waiter.cancel()
        self._token = self._waiter = None


def _io_error(error, timeout):
    """The KVStoreError of a data-channel read or write that failed with ``error``: its
    deadline passed (DeadlineExceededError), or the connection broke (ServerUnavailableError),
    which a socket's own timeout is too: TCP keepalive's ETIMEDOUT is a TimeoutError, as
    asyncio's is from Python 3.11, but with an errno."""
    if isinstance(error, asyncio.TimeoutError) and getattr(error, "errno", None) is None:
        return DeadlineExceededError(f"the data channel did not move the bytes within {timeout:g} s")
    # The failed read's (or write's) asyncio future holds this error, whose traceback holds
    # the frames that awaited it: reference cycles that would keep the frames' buffers (a
    # whole value) until the cyclic GC runs. Their locals go now.
    traceback.clear_frames(error.__traceback__)
    return ServerUnavailableError(f"the data channel broke: {error}")


def _refusal(error):
    """The serialized SessionResponse (id 0) that refuses a call with ``error``."""
    code, message, error_class = error_status(error)
    return kvstore_pb2.SessionResponse(code=code, message=message, error_class=error_class).SerializeToString()


def _log_failure(task):
    if not task.cancelled() and task.exception() is not None:
        log.error("serving calls on a data channel failed", exc_info=task.exception())
