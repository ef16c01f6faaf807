"""The client's half of the data channel: a raw TCP connection beside a Session stream that
carries the bytes of large values (the server's half is ``tensorkv_server.datachan``; the
acknowledgement, framing and keepalive both speak are ``tensorkv.wire.datachan``).

The Session stream asks for a one-time token (SESSION_OP_OPEN_DATA_CHANNEL); a
:class:`Channel` connects to the server's data port, sends the token and waits for the
server's one-byte acknowledgement: the connection is then bound to that stream only. Bytes
go out with ``sendall`` straight from the arrays and come in with ``recvmsg_into`` straight
into their destinations, many at a time (the kernel's copies only). Every read and write is
bounded by the call's deadline; any failure closes the socket (the Session negotiates a new
channel on a later call) and raises ServerUnavailableError, or DeadlineExceededError on
time-out. With a TLS server the connection is TLS, checked as the gRPC channel is, before
the token is sent.
"""
import socket
import ssl
import time

from ..errors import DeadlineExceededError, InternalError, KVStoreError, ServerUnavailableError
from ..wire.addresses import split_host_port
from ..wire.datachan import ACK, FRAME_HEADER, keep_alive

# Seconds to connect and be bound at most: a port that a firewall drops must not hold the
# call that negotiates for its whole timeout.
CONNECT_TIMEOUT = 10.0
TLS_WRITE_BYTES = 1 << 18  # plaintext bytes encrypted at a time: smaller, the peer starts decrypting sooner
TLS_RECV_BYTES = 1 << 20  # encrypted bytes read from the socket at most at a time (what it holds)
IOV_MAX = 1024  # buffers one recvmsg_into fills at most (Linux's UIO_MAXIOV, macOS's IOV_MAX)
# The longest answer framed on the channel that a call takes unless it says less (Session.call's
# answer_bytes): the longest gRPC message, what its answer could be on the stream. A longer
# announcement is refused before anything is read.
MAX_ANSWER_BYTES = (1 << 31) - 1
ANSWER_ROOM = 1 << 20  # the longest answer that carries no values: its id, status and message
# Bytes of an answer taken in at most at a time: the memory an answer holds grows with the
# bytes that came, not with the length the server announced.
ANSWER_PIECE = 1 << 20


def lost(error):
    """``error`` (a KVStoreError), marked as one that says the data channel broke or timed out."""
    error.channel_lost = True
    return error


def is_lost(error):
    """Whether ``error`` says the data channel broke or timed out (not what a server answered)."""
    return getattr(error, "channel_lost", False)


class Channel:
    """A data channel to server ``address`` (its gRPC address) on ``port``, bound with ``token``
    within ``timeout`` seconds (CONNECT_TIMEOUT at most), over TLS with the ssl.SSLContext
    ``tls`` unless it is None; OSError when the server refuses or cannot be reached."""

    takes_calls = False  # whether the server takes the session's calls on this channel (SessionResponse.calls_on_channel)

    def __init__(self, address, port, token, timeout, tls=None):
        self.address = address
        self.deadline = None  # of the call in progress (time.monotonic())
        host = split_host_port(address)[0]
        self._sock = socket.create_connection((host, port), min(timeout, CONNECT_TIMEOUT))
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(self._sock)
            if tls is not None:
                self._sock = TlsSocket(self._sock, tls, host)
            self._sock.sendall(token)
            if self._sock.recv(1) != ACK:
                raise ConnectionRefusedError(f"server {address} refused the data-channel token")
        except BaseException:
            self._sock.close()
            raise

    @property
    def closed(self):
        return self._sock is None

    def send_call(self, request, arrays):
        """Write one call framed on the channel (SessionResponse.calls_on_channel): the length of
        the serialized SessionRequest ``request``, ``request``, then the bytes of ``arrays``.
        None; or, when the server closed the channel before it took every byte (it refused the
        call without reading them), the answer it sent before closing (the channel is closed)."""
        self._check_open()
        try:
            self._sock.settimeout(self._remaining())
            self._sock.sendall(len(request).to_bytes(FRAME_HEADER, "little") + request)
            self._write(arrays)
        except OSError as error:
            try:
                answer = self.read_answer(ANSWER_ROOM) if arrays else None
            except KVStoreError:
                answer = None
            if answer is None:
                raise self._broken(error) from None
            self.close()
            return answer
        return None

    def read_answer(self, max_bytes=MAX_ANSWER_BYTES):
        """The serialized SessionResponse framed next on the channel (the bytes its entries
        announce follow it: :meth:`receive`). InternalError, the channel closed, when the server
        announces more than ``max_bytes`` (what the call's answer can carry)."""
        header = bytearray(FRAME_HEADER)
        self.receive([header])
        size = int.from_bytes(header, "little")
        if size > max_bytes:
            self.close()  # the bytes that follow are out of step
            raise InternalError(f"server {self.address} announced an answer of {size} bytes on the data channel, "
                                f"more than the {max_bytes} this call's answer can carry; the channel is closed")
        try:  # in one piece as a rule: bytes from the socket, not copied out of a buffer
            self._sock.settimeout(self._remaining())
            answer = self._sock.recv(min(size, ANSWER_PIECE))
        except OSError as error:
            raise self._broken(error) from None
        if len(answer) == size:
            return answer
        if not answer:
            raise self._broken(ConnectionResetError("the server closed the data channel"))
        pieces, left = [answer], size - len(answer)
        while left:
            pieces.append(bytearray(min(left, ANSWER_PIECE)))
            self.receive(pieces[-1:])
            left -= len(pieces[-1])
        return b"".join(pieces)

    def peer_closed(self):
        """Whether the server closed the channel (it does after a call it could not read); the
        channel is then closed here too. Bytes waiting unasked break it."""
        if self._sock is None:
            return True
        tls = isinstance(self._sock, TlsSocket)
        raw = self._sock.raw if tls else self._sock
        try:
            raw.settimeout(0)  # a socket with a timeout would wait for bytes first
            waiting = raw.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            waiting = b""
        if waiting:
            if tls:  # e.g. a TLS 1.3 session ticket, which the next read takes in
                return False
            raise self._broken(ConnectionError("the server sent bytes that no call asked for"))
        self.close()
        return True

    def send(self, arrays):
        """Write the bytes of ``arrays`` (C-contiguous, little-endian), in order."""
        self._check_open()
        try:
            self._write(arrays)
        except OSError as error:
            raise self._broken(error) from None

    def _write(self, arrays):
        for array in arrays:
            self._sock.settimeout(self._remaining())
            self._sock.sendall(memoryview(array.reshape(-1).view("u1")))

    def receive(self, buffers):
        """Fill ``buffers`` (writable C-contiguous arrays of any dtype, or bytearrays), in order:
        on a plain socket up to IOV_MAX of them per system call (recvmsg_into)."""
        self._check_open()
        try:
            if isinstance(self._sock, TlsSocket) or not hasattr(self._sock, "recvmsg_into"):  # (Windows has none)
                for buffer in buffers:
                    self._fill(_bytes(buffer).cast("B"))
            else:
                self._scatter(buffers)
        except OSError as error:
            raise self._broken(error) from None

    def _fill(self, view):
        filled = 0
        while filled < len(view):
            self._sock.settimeout(self._remaining())
            count = self._sock.recv_into(view[filled:])
            if count == 0:
                raise ConnectionResetError("the server closed the data channel")
            filled += count

    def _scatter(self, buffers):
        pending = [view for view in map(_bytes, buffers) if view.nbytes]
        while pending:
            self._sock.settimeout(self._remaining())
            count = self._sock.recvmsg_into(pending[:IOV_MAX])[0]
            if count == 0:
                raise ConnectionResetError("the server closed the data channel")
            done = 0
            while done < len(pending) and pending[done].nbytes <= count:
                count -= pending[done].nbytes
                done += 1
            del pending[:done]
            if count:  # the first one is filled in part
                pending[0] = pending[0].cast("B")[count:]

    def _check_open(self):
        if self._sock is None:
            raise ServerUnavailableError(f"server {self.address} closed the data channel")

    def _remaining(self):
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the call's deadline passed")
        return remaining

    def _broken(self, error):
        """Close the channel; the error to raise for ``error``, marked ``channel_lost`` (what a
        server answered is never so marked)."""
        self.close()
        if isinstance(error, socket.timeout):
            return lost(DeadlineExceededError(f"server {self.address}: the data channel timed out"))
        return lost(ServerUnavailableError(f"server {self.address}: the data channel broke ({error})"))

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _bytes(buffer):
    """A memoryview of ``buffer``, an array of any dtype or a bytearray."""
    try:
        return memoryview(buffer)
    except ValueError:  # a dtype with no buffer format (ml_dtypes' bfloat16): its bytes
        return memoryview(buffer.reshape(-1).view("u1"))


class TlsSocket:
    """A connected blocking socket with TLS as a client, for what :class:`Channel` calls.

    TLS runs through an ``ssl.SSLObject`` on memory buffers, so that each system call moves
    up to TLS_WRITE_BYTES or TLS_RECV_BYTES (an ``ssl.SSLSocket`` makes one or two per 16 KiB
    record)."""

    def __init__(self, sock, context, host):
        self.raw = self._sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)
        self._received = memoryview(bytearray(TLS_RECV_BYTES))  # the socket's bytes, on their way in
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ConnectionResetError("the server closed the connection in the TLS handshake") from None
        self._flush()

    def settimeout(self, timeout):
        self._sock.settimeout(timeout)

    def sendall(self, data):
        view = memoryview(data)
        for start in range(0, len(view), TLS_WRITE_BYTES):
            self._tls.write(view[start:start + TLS_WRITE_BYTES])
            self._flush()

    def recv_into(self, view):
        """Decrypt into ``view`` every record already received that fits (one record a call of
        the TLS object), reading the socket only when none is; 0 at the connection's end."""
        filled = 0
        while filled < len(view):
            try:
                count = self._tls.read(len(view) - filled, view[filled:])
            except ssl.SSLWantReadError:
                if filled or not self._fill():
                    break
                continue
            except ssl.SSLZeroReturnError:
                break
            if count == 0:
                break
            filled += count
        return filled

    def recv(self, size):
        buffer = bytearray(size)
        return bytes(buffer[:self.recv_into(memoryview(buffer))])

    def _flush(self):
        data = self._outgoing.read()
        if data:
            self._sock.sendall(data)

    def _fill(self):
        """Read what the socket has (up to TLS_RECV_BYTES) into the TLS object; False at its end."""
        count = self._sock.recv_into(self._received)
        self._incoming.write(self._received[:count])
        return count > 0

    def close(self):
        self._sock.close()
