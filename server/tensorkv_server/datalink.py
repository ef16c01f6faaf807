"""One accepted data-channel connection on the event loop, plaintext or TLS: fill a buffer
exactly, send a buffer whole; and, around a call's reads and writes, :meth:`PlainLink.moving`,
which ends them when the peer moves no bytes for a number of seconds.

TLS runs through an ``ssl.SSLObject`` on memory buffers over the same non-blocking socket
calls as plaintext, so a value is decrypted straight into its destination buffer.
"""
import asyncio
import socket
import ssl
import weakref

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
        self.watch = _watch(self._loop)

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
        return self._came(await self._loop.sock_recv(self.sock, most))

    def received(self, most):
        """Up to ``most`` bytes that came already (b"" when none), without waiting."""
        try:
            return self._came(self.sock.recv(most))
        except (BlockingIOError, InterruptedError):
            return b""

    def _came(self, piece):
        if not piece:
            raise EOFError("the client closed the data channel")
        self.moved = self._loop.time()
        return piece

    def send_now(self, data):
        """How many bytes of ``data`` the socket took now, without waiting."""
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        self.moved = self._loop.time()
        return sent

    async def sendall(self, data):
        """As loop.sock_sendall, noting each time bytes go out (moved)."""
        view, sent = memoryview(data), 0
        while sent < len(view):
            count = self.send_now(view[sent:])
            if not count:
                await self._writable()
            sent += count

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

    def received(self, most):
        return b""  # bytes come in TLS records, read through the SSLObject

    def send_now(self, data):
        return 0

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
    """PlainLink.moving: while inside, the watch of the event loop (:class:`_Watch`) looks at
    the link now and then, and cancels the task once its bytes stopped moving; as
    asyncio.timeout does, the cancellation ends as :class:`Stalled` at the end of the
    ``async with``. No timer of its own: a small call's bytes move in well under a turn of
    the watch, and arming a timer for each of them cost more than the call's reads."""

    __slots__ = ("link", "seconds", "task", "_cancelling", "stalled")

    def __init__(self, link, seconds):
        self.link, self.seconds = link, seconds
        self.task = None
        self._cancelling = 0
        self.stalled = False

    async def __aenter__(self):
        if self.seconds is not None:
            self.task = asyncio.current_task()
            self._cancelling = self.task.cancelling()
            self.link.moved = self.link.watch.now()
            self.link.watch.add(self)
        return self

    async def __aexit__(self, kind, error, traceback):
        if self.task is not None:
            self.link.watch.discard(self)
        if self.stalled and self.task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise Stalled(f"no bytes moved for {self.seconds:g} s") from None


class _Watch:
    """The :class:`_Moving` of an event loop's links: every quarter of the shortest of their
    seconds it cancels the task of each whose link moved no bytes for its seconds (so a
    stall ends after its seconds, and at most a quarter more). Its one timer runs while
    some are watched."""

    def __init__(self, loop):
        self._loop = loop
        self._watched = set()
        self._timer = None

    def add(self, moving):
        self._watched.add(moving)
        if self._timer is None:
            self._timer = self._loop.call_later(moving.seconds / 4, self._look)

    def discard(self, moving):
        self._watched.discard(moving)

    def now(self):
        return self._loop.time()

    def _look(self):
        self._timer = None
        now = self._loop.time()
        for moving in [moving for moving in self._watched if now >= moving.link.moved + moving.seconds]:
            self._watched.discard(moving)
            moving.stalled = True
            moving.task.cancel()
        if self._watched:
            self._timer = self._loop.call_later(min(moving.seconds for moving in self._watched) / 4, self._look)


_watches = weakref.WeakKeyDictionary()  # event loop -> its _Watch


def _watch(loop):
    watch = _watches.get(loop)
    if watch is None:
        watch = _watches[loop] = _Watch(loop)
    return watch


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
