"""A TCP proxy that relays bytes no faster than a link of a fixed rate carries them, so that
a bench on one host can time calls as over a link between hosts (bench/compression.py).

``PacedProxy(host, routes, rate)`` listens on ``host`` at each port of ``routes`` {port:
(target host, target port)} and relays each connection to its target, each direction in a
thread, the bytes through a pipe (splice(2): no copy through Python). The proxy is one
full-duplex link: every connection's bytes towards the targets share one :class:`Link`,
the bytes back share another. A chunk read from a socket (at most CHUNK bytes) is sent on
once the link has had the time to carry it: bytes * 8 / rate seconds after the link
finished the chunk before, or after the chunk was there to send when that is later (when
it was read, or for bytes waiting in the socket already, when the chunk before was read:
the earliest they can have come, so the pacing errs towards a faster link). So the pacing
holds a call's last byte until a link of that rate, with no propagation delay, would
deliver it, and the link never carries more than ``rate`` over time; the relay's own cost
(and the time a sleep oversleeps) come on top. A rate of None relays as fast as the proxy
can, which measures that cost. :attr:`Link.bytes` counts what each direction carried.
"""
import fcntl
import os
import select
import socket
import threading
import time

CHUNK = 1 << 18  # bytes read at a time: 0.2 ms at 10 Gbit/s, 2 ms at 1 Gbit/s


class Link:
    """One direction of the link: ``rate`` bits per second (None: unpaced)."""

    def __init__(self, rate):
        self.rate = rate
        self.bytes = 0
        self._free_at = 0.0  # time.monotonic() when the link has carried everything given to it
        self._lock = threading.Lock()

    def carry(self, nbytes, ready):
        """Wait until the link has carried ``nbytes`` more, which were there to send from
        time.monotonic() ``ready`` on."""
        with self._lock:
            self.bytes += nbytes
            if self.rate is None:
                return
            now = time.monotonic()
            self._free_at = done = max(ready, self._free_at) + nbytes * 8 / self.rate
        if done > now:
            time.sleep(done - now)


class PacedProxy:
    def __init__(self, host, routes, rate):
        self.to_targets, self.from_targets = Link(rate), Link(rate)
        self._sockets = []
        self._lock = threading.Lock()
        for port, target in routes.items():
            listener = socket.create_server((host, port))
            self._sockets.append(listener)
            threading.Thread(target=self._accept, args=(listener, target), name="paced-accept", daemon=True).start()

    def _accept(self, listener, target):
        while True:
            try:
                client, _ = listener.accept()
                server = socket.create_connection(target)
            except OSError:  # closed, or the target is gone
                return
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=_pump, args=(client, server, self.to_targets), daemon=True).start()
            threading.Thread(target=_pump, args=(server, client, self.from_targets), daemon=True).start()

    def close(self):
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pump(source, sink, link):
    """Relay ``source`` to ``sink`` over ``link`` until either ends; an end of ``source`` is
    passed on."""
    pipe_out, pipe_in = os.pipe()
    fcntl.fcntl(pipe_in, fcntl.F_SETPIPE_SZ, CHUNK)
    last_read = 0.0
    try:
        while True:
            # bytes waiting already are taken to have been there at the read before
            if select.select([source], [], [], 0)[0]:
                ready = last_read
            else:
                select.select([source], [], [])
                ready = time.monotonic()
            count = os.splice(source.fileno(), pipe_in, CHUNK)
            last_read = time.monotonic()
            if not count:
                sink.shutdown(socket.SHUT_WR)
                return
            link.carry(count, ready)
            while count:
                count -= os.splice(pipe_out, sink.fileno(), count)
    except (OSError, ValueError):  # reset, or closed
        return
    finally:
        os.close(pipe_out)
        os.close(pipe_in)
