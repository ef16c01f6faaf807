"""A small userspace TCP proxy for tests that break connections (this kernel has no netem).

``FaultProxy(target)`` listens on 127.0.0.1:``port`` and relays every connection to
``target`` ('host:port'), each direction in its own thread. On command it resets every open
connection (:meth:`reset`: the client sees ECONNRESET; the server sees its peer go; a reset
from either side is passed on to the other, as a router does) or swallows what the server
sends (:meth:`hold_replies`), so that a call reaches the server but its answer never reaches
the client, or stalls both directions for a while (:meth:`stall`). Every thread is a daemon
and :meth:`close` ends them.
"""
import socket
import struct
import threading

_CHUNK = 1 << 16


class FaultProxy:
    def __init__(self, target):
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._pairs = []  # [(client socket, server socket)] of the open connections
        self._holding = threading.Event()
        self._flowing = threading.Event()  # cleared while stalled
        self._flowing.set()
        self.connections = 0  # accepted so far
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self._target)
            except OSError:
                _abort(client)
                continue
            with self._lock:
                held = [self._holding.is_set()]  # this connection's replies are dropped while held[0]
                self._pairs.append((client, server, held))
                self.connections += 1
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, held), daemon=True).start()

    def _pump(self, source, sink, held):
        """Relay ``source`` to ``sink`` until either ends; an end of ``source`` is passed on.
        ``held``: for a server's replies, the connection's flag (dropped while ``held[0]``)."""
        while True:
            try:
                data = source.recv(_CHUNK)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                self._flowing.wait()
                if not (held and held[0]):
                    sink.sendall(data)
            except OSError:  # reset (passed on, as a router passes on an RST), or closed by reset()
                _abort(sink)
                return

    def hold_replies(self, holding=True):
        """From now on, drop (``holding``) or relay again what servers send to clients, on the
        open connections and on those made until the next :meth:`reset`."""
        with self._lock:
            if holding:
                self._holding.set()
            else:
                self._holding.clear()
            for _, _, held in self._pairs:
                held[0] = holding

    def stall(self, seconds):
        """Relay nothing, either way, for ``seconds`` (the connections stay open)."""
        self._flowing.clear()
        timer = threading.Timer(seconds, self._flowing.set)
        timer.daemon = True
        timer.start()

    def reset(self):
        """Reset every open connection: an RST to the client, the server's side closed. The
        connections made after it are not held: a client that connects again at once (before
        the test can call hold_replies(False)) must not lose the new connection's replies."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self._holding.clear()
        for client, server, _ in pairs:
            _abort(client)
            _abort(server)

    def close(self):
        self._flowing.set()
        self._listener.close()
        self.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _abort(sock):
    """Close ``sock`` with an RST rather than a FIN (SO_LINGER with a zero timeout); the
    shutdown first wakes a thread blocked reading it, which would keep it open. A socket
    closed already is left as it is."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    sock.close()
