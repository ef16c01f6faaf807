"""The server-wide budget of bytes in flight (--max-inflight-bytes): values being received
and answers being built and sent, of all calls together.

A call reserves its bytes before it reads them from a data channel (so a full budget stops
reading: back pressure) and before it builds an answer; a gRPC message is read before any
handler runs, so its bytes are counted as they arrive (:meth:`Budget.charge`), and a stream of them
(Init, Push, PushPull) reads its next message once there is room (:meth:`Budget.paced`). A reservation
that does not fit waits, first come first served, at most WAIT seconds or the call's
deadline, then fails with RESOURCE_EXHAUSTED; one larger than the whole budget fails at once.
A stream whose next message does not come within the progress timeout (progress.py) ends, its
bytes given back: a stalled stream holds them, and the turn of the oldest, no longer.

A call holds one reservation at a time (:func:`hold`), and gives it back before it waits for
another rank (:func:`before_wait`, which the coordinator calls): a push that waits for its
rank's earlier round must not keep the others' pushes, which complete that round, out of
the budget. The bytes of such a waiting call are then not counted.
"""
import asyncio
import collections
import contextvars

from tensorkv.errors import ResourceExhaustedError
from tensorkv.words import size

from . import metrics
from .progress import TIMEOUT as PROGRESS_TIMEOUT, next_message

WAIT = 30.0  # seconds a reservation waits for room at most (less when the call's deadline is sooner)
FLAG = "--max-inflight-bytes"

# [the Reservation the current call holds, or None]: a list, so that a task the call starts
# (asyncio.wait_for's, before Python 3.11) holds and gives back in the same place.
_HELD = contextvars.ContextVar("tensorkv_budget_held", default=None)


class Reservation:
    """Bytes of a :class:`Budget` that a call holds until :meth:`release` (which may be called again)."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget, nbytes):
        self._budget, self.nbytes = budget, nbytes

    def add(self, nbytes):
        """Count ``nbytes`` more that are already in memory (Budget.charge)."""
        self._budget._take(nbytes)
        self.nbytes += nbytes

    def release(self):
        self._budget.done_reading(self)
        nbytes, self.nbytes = self.nbytes, 0
        if nbytes:
            self._budget.give_back(nbytes)


class Budget:
    """``total`` bytes in flight for the whole server (None: no limit); the messages of a paced
    stream come within ``progress_timeout`` seconds each (None: no limit)."""

    def __init__(self, total, progress_timeout=PROGRESS_TIMEOUT):
        self.total = total
        self.progress_timeout = progress_timeout
        self.used = 0
        self._waiters = collections.deque()  # [bytes, future] of the reservations that wait, oldest first
        self._streams = {}  # the Reservations of the gRPC streams being read (paced), oldest first
        self._room = None  # a future done when bytes are given back or a stream is read, for paced streams

    def charge(self, nbytes):
        """A Reservation of ``nbytes`` that are already in memory: counted at once, even past the total."""
        self._take(nbytes)
        return Reservation(self, nbytes)

    def charge_within(self, nbytes, what):
        """:meth:`charge` of the ``nbytes`` of ``what``, a request read whole already, or
        ResourceExhaustedError when they are more than the whole budget."""
        self._check_whole(nbytes, what)
        return self.charge(nbytes)

    def _check_whole(self, nbytes, what):
        if self.total is not None and nbytes > self.total:
            raise ResourceExhaustedError(
                f"{what} needs {nbytes} bytes in flight ({size(nbytes)}), more than this server's whole budget for "
                f"bytes in flight of {self.total} bytes ({size(self.total)}, {FLAG})")

    async def reserve(self, nbytes, timeout=None, what="this call"):
        """A Reservation of ``nbytes``, once they fit in the budget: at once (without giving the
        event loop a turn) when they fit now and nobody waits before them; else after a wait of
        at most WAIT seconds, or ``timeout`` when it is sooner. ResourceExhaustedError naming
        ``what`` when they do not fit by then, or would not fit in the whole budget."""
        if self.total is None or nbytes <= 0:
            return Reservation(self, 0)
        self._check_whole(nbytes, what)
        if not self._waiters and self.used + nbytes <= self.total:
            self._take(nbytes)
            return Reservation(self, nbytes)
        waiter = [nbytes, asyncio.get_running_loop().create_future()]
        self._waiters.append(waiter)
        wait = WAIT if timeout is None else max(0.0, min(WAIT, timeout))
        try:
            await asyncio.wait((waiter[1],), timeout=wait)
        except BaseException:
            self._abandon(waiter)
            raise
        if not waiter[1].done():
            self._abandon(waiter)
            raise ResourceExhaustedError(
                f"{what} needs {nbytes} bytes in flight ({size(nbytes)}); this server's budget for bytes in flight, "
                f"{self.total} bytes ({size(self.total)}, {FLAG}), stayed full for {wait:g} s ({size(self.used)} "
                f"held by other calls): try again, or give the server a larger {FLAG}")
        return Reservation(self, nbytes)

    async def reserve_whole(self, nbytes, timeout=None, what="this call"):
        """:meth:`reserve` of ``nbytes`` for an answer that cannot be split, which may be more
        than the whole budget: then it waits for the whole budget and is counted past it, so
        that no other call gets room until it is given back."""
        if self.total is None or nbytes <= self.total:
            return await self.reserve(nbytes, timeout, what)
        reservation = await self.reserve(self.total, timeout, what)
        reservation.add(nbytes - self.total)
        return reservation

    async def paced(self, messages, reservation, peer):
        """The messages (bytes) of a gRPC stream from ``peer``, each counted in ``reservation``
        as it arrives; the next one is read only once the budget has room, or once this stream
        is the oldest being read (which always goes on: the streams are read one after the
        other, never all stopped half way), for at most WAIT seconds, then
        ResourceExhaustedError; once read, it must come within the progress timeout, else
        progress.StalledError."""
        messages = aiter(messages)
        while True:
            await self._room_for(reservation)
            try:
                message = await next_message(messages, self.progress_timeout, peer, "a stream of values")
            except StopAsyncIteration:
                self.done_reading(reservation)
                return
            reservation.add(len(message))
            yield message

    async def _room_for(self, reservation):
        if self.total is None:
            return
        self._streams.setdefault(reservation)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while self.used >= self.total and next(iter(self._streams)) is not reservation:
            if loop.time() >= deadline:
                self.done_reading(reservation)
                raise ResourceExhaustedError(
                    f"a stream of values holding {reservation.nbytes} bytes waited {WAIT:g} s for room to receive "
                    f"more; this server's budget for bytes in flight, {self.total} bytes ({size(self.total)}, "
                    f"{FLAG}), stayed full ({size(self.used)} held): try again, or give the server a larger {FLAG}")
            if self._room is None:
                self._room = loop.create_future()
            await asyncio.wait((self._room,), timeout=deadline - loop.time())

    def done_reading(self, reservation):
        """The stream of ``reservation`` is no longer read: those behind it may go on."""
        if self._streams.pop(reservation, 0) is None:
            self._say_room()

    def _say_room(self):
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def give_back(self, nbytes):
        self.used -= nbytes
        self._wake()
        self._say_room()

    def _take(self, nbytes):
        self.used += nbytes
        metrics.INFLIGHT_BYTES.set(self.used)

    def _wake(self):
        """Grant the reservations that wait, oldest first, while they fit."""
        while self._waiters and self.used + self._waiters[0][0] <= self.total:
            nbytes, future = self._waiters.popleft()
            self._take(nbytes)
            future.set_result(None)
        metrics.INFLIGHT_BYTES.set(self.used)

    def _abandon(self, waiter):
        """A waiting reservation gives up (timed out, or its call was cancelled)."""
        nbytes, future = waiter
        if future.done():  # granted meanwhile
            self.give_back(nbytes)
            return
        future.cancel()
        self._waiters.remove(waiter)
        self._wake()  # those behind it may fit now
        self._say_room()


def hold(reservation):
    """Make ``reservation`` the one the current call holds (the one it held is given back)."""
    slot = _HELD.get()
    if slot is None:
        slot = [None]
        _HELD.set(slot)
    release_held()
    slot[0] = reservation
    return reservation


def own_slot():
    """Give the current task a slot of its own: for a task that runs beside the call that
    started it (a data channel's calls beside its Session stream's), whose holds and releases
    would otherwise give back the other's bytes (the slot is shared with the task's copy of
    the context)."""
    _HELD.set([None])


def release_held():
    """Give back the reservation the current call holds, if any."""
    slot = _HELD.get()
    if slot is not None and slot[0] is not None:
        slot[0].release()
        slot[0] = None


def before_wait():
    """The current call is about to wait for other ranks: it gives back what it holds."""
    release_held()
