"""The data channel on the server: a second TCP port whose connections each carry the bytes
of large values for one Session stream (the client's half is ``tensorkv.datachan``).

A stream asks for a channel and gets a one-time random token; a connection to the data
port that sends that token first is bound to that stream, acknowledged with one byte, and
the token is gone. A connection with an unknown (or already used) token, or none within
HANDSHAKE_TIMEOUT, is closed. A stream's channel is closed when the stream ends, however it
ends, when a call that uses it fails, and when the server stops.
"""
import asyncio
import logging
import secrets
import socket

import numpy as np

from tensorkv.errors import DeadlineExceededError, FailedPreconditionError, ServerUnavailableError

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
ACK = b"\x01"
HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection gets to send its token


def bare_host(host):
    """``host`` without the brackets of an IPv6 address."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class DataPort:
    """The listening socket on ``host``:``port`` (0: any free port) and the tokens handed out."""

    def __init__(self, host, port=0):
        ipv6 = ":" in host  # then both families, as gRPC serves them
        self._listener = socket.create_server((bare_host(host), port), family=socket.AF_INET6 if ipv6 else socket.AF_INET,
                                              dualstack_ipv6=ipv6 and socket.has_dualstack_ipv6())
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._pending = {}  # token -> future of the bound socket
        self._tasks = set()
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
            task = loop.create_task(self._bind(conn, peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _bind(self, conn, peer):
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        try:
            token = await asyncio.wait_for(_read_exactly(loop, conn, TOKEN_BYTES), HANDSHAKE_TIMEOUT)
            waiter = self._pending.pop(token, None)
            if waiter is None or waiter.done():
                raise ConnectionRefusedError("unknown or used token")
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            waiter.set_result(conn)  # bound before the client hears so and sends its next call
            await loop.sock_sendall(conn, ACK)
            log.info("data channel from %s bound", peer)
        except (OSError, EOFError, asyncio.TimeoutError) as error:
            log.warning("data channel connection from %s refused: %s", peer, error or type(error).__name__)
            conn.close()
        except asyncio.CancelledError:  # the server is stopping
            conn.close()
            raise

    def offer(self):
        """(a new token, the future of the socket that presents it)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        waiter = asyncio.get_running_loop().create_future()
        self._pending[token] = waiter
        return token, waiter

    def withdraw(self, token):
        self._pending.pop(token, None)

    def close(self):
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._listener.close()


async def _read_exactly(loop, conn, size):
    buffer = bytearray(size)
    await _read_into(loop, conn, memoryview(buffer))
    return bytes(buffer)


async def _read_into(loop, conn, view):
    filled = 0
    while filled < len(view):
        count = await loop.sock_recv_into(conn, view[filled:])
        if count == 0:
            raise EOFError("the client closed the data channel")
        filled += count


class StreamChannel:
    """The data channel of one Session stream: none, offered (a token is out), or bound."""

    def __init__(self, port, peer):
        self._port, self.peer = port, peer
        self._token = self._waiter = None

    def open(self):
        """A token for a new channel (the previous one is closed)."""
        self.close()
        self._token, self._waiter = self._port.offer()
        return self._token

    @property
    def bound(self):
        """Whether a connection presented this stream's token (and is not closed)."""
        waiter = self._waiter
        return waiter is not None and waiter.done() and not waiter.cancelled()

    def _socket(self):
        if not self.bound:
            raise FailedPreconditionError("this stream has no connected data channel: ask for one first")
        return self._waiter.result()

    async def receive(self, buffers, timeout):
        """Fill the uint8 arrays ``buffers`` from the channel, in order, within ``timeout`` s."""
        await self._io(self._receive(buffers), timeout)

    async def _receive(self, buffers):
        conn, loop = self._socket(), asyncio.get_running_loop()
        for buffer in buffers:
            await _read_into(loop, conn, memoryview(buffer))

    async def send(self, buffer, timeout):
        """Write the uint8 array ``buffer`` on the channel within ``timeout`` s."""
        await self._io(self._send(buffer), timeout)

    async def _send(self, buffer):
        conn = self._socket()
        await asyncio.get_running_loop().sock_sendall(conn, memoryview(buffer))

    async def _io(self, work, timeout):
        try:
            await asyncio.wait_for(work, timeout)
        except asyncio.TimeoutError:
            self.close()
            raise DeadlineExceededError(f"the data channel did not move the bytes within {timeout:g} s") from None
        except (OSError, EOFError) as error:
            self.close()
            raise ServerUnavailableError(f"the data channel broke: {error}") from None

    def close(self):
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


def snapshot(arrays):
    """One uint8 buffer holding the bytes of ``arrays`` (host, C-contiguous) one after the other:
    the values of this moment, whatever changes them while they are sent."""
    buffer = np.empty(sum(a.nbytes for a in arrays), np.uint8)
    offset = 0
    for array in arrays:
        buffer[offset:offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        offset += array.nbytes
    return buffer
