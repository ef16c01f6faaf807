"""One accepted data-channel connection on the event loop, plaintext or TLS: fill a buffer
exactly, send a buffer whole; and, around a call's reads and writes, :meth:`PlainLink.moving`,
which ends them when the peer moves no bytes for a number of seconds.

TLS runs through an ``ssl.SSLObject`` on memory buffers over the same non-blocking socket
calls as plaintext, so a value is decrypted straight into its destination buffer.
"""
import asyncio
import socket
import ssl

from tensorkv.wire.datachan import keep_alive

RECV_BYTES = 1 << 20  # encrypted bytes read from the socket at most at a time (what it holds)
# Bytes of a call's request (read_bytes) taken in at most at a time: the memory a request holds
# grows with the bytes that came, not with the size its header announced.
REQUEST_PIECE = 1 << 20
WRITE_BYTES = 1 << 18  # plaintext bytes encrypted at a time: smaller, the peer starts decrypting sooner


class Stalled(Exception):
    """The peer moved no bytes of a call for the seconds :meth:`PlainLink.moving` allows."""


class PlainLink:
    def __init__(self, sock):
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self.moved = self._loop.time()  # when bytes last came in or went out

    def moving(self, seconds):
        """``async with link.moving(seconds):`` the reads and writes inside, in the current task,
        end with :class:`Stalled` once no bytes come in or go out for ``seconds`` (None: never)."""
        return _Moving(self, seconds)

    async def read_into(self, view):
        filled = 0
        while filled < len(view):
            count = await self._loop.sock_recv_into(self.sock, view[filled:])
            if count == 0:
                raise EOFError("the client closed the data channel")
            self.moved = self._loop.time()
            filled += count

    async def read_bytes(self, size):
        """The next ``size`` bytes: as the socket gives them when they came in one piece (no
        copy out of a buffer), which a small message does; else gathered REQUEST_PIECE at most
        at a time."""
        first = await self._piece(min(size, REQUEST_PIECE))
        if len(first) == size:
            return first
        gathered = bytearray(first)
        while len(gathered) < size:
            gathered += await self._piece(min(size - len(gathered), REQUEST_PIECE))
        return bytes(gathered)

    async def _piece(self, most):
        """Up to ``most`` bytes, as they come (some)."""
        piece = await self._loop.sock_recv(self.sock, most)
        if not piece:
            raise EOFError("the client closed the data channel")
        self.moved = self._loop.time()
        return piece

    async def sendall(self, data):
        """As loop.sock_sendall, noting each time bytes go out (moved)."""
        view, sent = memoryview(data), 0
        while sent < len(view):
            try:
                sent += self.sock.send(view[sent:])
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            self.moved = self._loop.time()

    async def _writable(self):
        fd, ready = self.sock.fileno(), self._loop.create_future()  # fd: the socket may be closed meanwhile
        self._loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self._loop.remove_writer(fd)

    def close(self):
        self.sock.close()


class TlsLink(PlainLink):
    """A TLS server connection; :meth:`handshake` first."""

    def __init__(self, sock, context):
        super().__init__(sock)
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._received = memoryview(bytearray(RECV_BYTES))  # the socket's bytes, on their way in

    async def handshake(self):
        await self._complete(self._tls.do_handshake)

    async def read_into(self, view):
        filled = 0
        while filled < len(view):
            try:  # one TLS record per read: no coroutine per record unless bytes must come in
                count = self._tls.read(len(view) - filled, view[filled:])
            except ssl.SSLWantReadError:
                await self._flush()
                await self._receive()
                continue
            if count == 0:
                raise EOFError("the client closed the data channel")
            filled += count

    async def _piece(self, most):
        piece = bytearray(most)
        await self.read_into(memoryview(piece))
        return bytes(piece)

    async def sendall(self, view):
        for start in range(0, len(view), WRITE_BYTES):
            await self._complete(self._tls.write, view[start:start + WRITE_BYTES])

    async def _complete(self, operation, *args):
        """``operation(*args)`` on the SSLObject, feeding it the socket's bytes until it has
        enough, and sending what it produced."""
        while True:
            try:
                result = operation(*args)
            except ssl.SSLWantReadError:
                await self._flush()
                await self._receive()
                continue
            await self._flush()
            return result

    async def _receive(self):
        count = await self._loop.sock_recv_into(self.sock, self._received)
        if count == 0:
            raise EOFError("the client closed the data channel")
        self.moved = self._loop.time()
        self._incoming.write(self._received[:count])

    async def _flush(self):
        data = self._outgoing.read()
        if data:
            await self._loop.sock_sendall(self.sock, data)
            self.moved = self._loop.time()


class _Moving:
    """PlainLink.moving: one timer, moved on only when it fires (not on every read or write),
    cancels the task once the link's bytes stopped moving; as asyncio.timeout does, the
    cancellation ends as :class:`Stalled` at the end of the ``async with``."""

    def __init__(self, link, seconds):
        self._link, self._seconds = link, seconds
        self._loop = self._task = self._timer = None
        self._cancelling = 0
        self._stalled = False

    async def __aenter__(self):
        if self._seconds is not None:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            self._cancelling = self._task.cancelling()
            self._link.moved = self._loop.time()
            self._arm()
        return self

    def _arm(self):
        self._timer = self._loop.call_at(self._link.moved + self._seconds, self._check)

    def _check(self):
        if self._loop.time() < self._link.moved + self._seconds:
            self._arm()
        else:
            self._stalled = True
            self._task.cancel()

    async def __aexit__(self, kind, error, traceback):
        if self._timer is not None:
            self._timer.cancel()
        if self._stalled and self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise Stalled(f"no bytes moved for {self._seconds:g} s") from None


async def accept(sock, tls_context):
    """The link of a new connection ``sock``: TLS (handshake done) with ``tls_context``, else plaintext."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    keep_alive(sock)
    if tls_context is None:
        return PlainLink(sock)
    link = TlsLink(sock, tls_context)
    await link.handshake()
    return link
