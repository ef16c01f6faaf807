"""What workers wait on: the sync round of each key and the barrier, each a :class:`Wait` for
every one of ``num_workers`` ranks, aborted with RoundAbortedError when it is not complete
``round_timeout`` seconds after it began.

These hold the state only; the :class:`~.rounds.Coordinator` decides who may push, pull or
enter, and when (see its module). Everything runs on the server's event loop.
"""
import asyncio
import logging
import time

from tensorkv.wire.codec import Item
from tensorkv.errors import RoundAbortedError, key_repr
from tensorkv.words import plural

from . import metrics

log = logging.getLogger(__name__)


class Wait:
    """Something workers wait on (one round of one key, or one barrier): the ranks that
    arrived, a future done when all have, and the timer that aborts it."""

    __slots__ = ("number", "ranks", "sequences", "total", "_done", "timer", "opened", "latest")

    def __init__(self, number):
        self.number = number
        self.ranks = set()
        self.sequences = {}  # a round's rank -> the sequence number of the push it merged
        self.total = None  # a round's running sum of pushes
        self._done = None  # created when first needed: most rounds of one worker never wait
        self.timer = None
        self.opened = self.latest = None  # time.monotonic() of a round's first and latest push

    @property
    def done(self):
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        return self._done


def fail(future, error):
    if not future.done():
        future.set_exception(error)
        future.exception()  # retrieved here: waiters, if any, get it from their own await


class _SharedTimer:
    """The one abort timer of the rounds that one push opened (one per key of a list, which
    would otherwise each arm a timer of their own): cancelled once every one of them has
    completed or aborted."""

    __slots__ = ("handle", "open")

    def __init__(self, handle, count):
        self.handle = handle
        self.open = count

    def cancel(self):
        """One of the rounds no longer waits."""
        self.open -= 1
        if self.open == 0:
            self.handle.cancel()


class _KeyRounds:
    """The sync rounds of one key: the current round, and the ranks whose pushes an aborted
    round discarded, with the error their next call on the key reports."""

    __slots__ = ("current", "aborted")

    def __init__(self):
        self.current = Wait(1)
        self.aborted = {}


class Rounds:
    """The sync rounds of every key, over ``engine`` (which sums the pushes), for
    ``num_workers`` ranks. ``absent(ranks)`` says where missing ranks went, for the errors
    (Membership.absent)."""

    def __init__(self, engine, num_workers, round_timeout, absent):
        self.engine = engine
        self.num_workers = num_workers
        self.round_timeout = round_timeout
        self._absent = absent
        self._keys = {}  # key -> _KeyRounds

    def clear(self):
        self._keys.clear()

    def number(self, key):
        """The number of ``key``'s current round."""
        return self._keys[key].current.number if key in self._keys else 1

    def restore(self, key, number):
        """Make round ``number`` the current round of ``key`` (from a snapshot)."""
        self._keys[key] = rounds = _KeyRounds()
        rounds.current = Wait(number)

    def waiting_for(self, rank):
        """The keys whose current round has pushes, but not ``rank``'s."""
        return [key for key, rounds in self._keys.items() if rounds.current.ranks and rank not in rounds.current.ranks]

    def forget_errors(self, rank=None):
        """Drop the errors of aborted rounds kept for ``rank`` (None: for every rank)."""
        for rounds in self._keys.values():
            if rank is None:
                rounds.aborted.clear()
            else:
                rounds.aborted.pop(rank, None)

    def open_sequences(self):
        """{rank: the sequence numbers of its pushes in rounds still open}: applied, but in
        no value yet."""
        numbers = {}
        for rounds in self._keys.values():
            for rank, sequence in rounds.current.sequences.items():
                numbers.setdefault(rank, set()).add(sequence)
        return numbers

    def add(self, rank, items, sequence):
        """Add ``rank``'s push of ``items`` (numbered ``sequence``) to each key's current round:
        [(key, round, its total as an Item)] of the rounds it completes, for the caller to apply
        the totals and then :meth:`complete` them. The rounds it opened share one abort timer."""
        completed = []
        opened = [opened for opened in (self._add(rank, item, sequence, completed) for item in items) if opened]
        if opened:
            handle = asyncio.get_running_loop().call_later(self.round_timeout, self._abort_opened, opened)
            timer = _SharedTimer(handle, len(opened))
            for _, round_ in opened:
                round_.timer = timer
        return completed

    def _add(self, rank, item, sequence, completed):
        """Add ``item`` to its key's current round; when that makes it complete, (key, round, its
        total as an Item) goes to ``completed``. (key, round) when this push opened the round."""
        rounds = self._keys.setdefault(item.key, _KeyRounds())
        current = rounds.current
        current.ranks.add(rank)
        current.sequences[rank] = sequence
        complete = len(current.ranks) == self.num_workers
        now = time.monotonic()
        if complete and current.total is None:
            # One worker's push completes the round: applied straight from the received value
            # (e.g. a view of the client's shared memory), without a copy into a total.
            total, owned = self.engine.merge([item.array]), item.owned
        else:
            current.total = total = self.engine.accumulate(current.total, item.array, item.owned, key=item.key)
            owned = True  # the receive buffer it took over, or a new array
        if complete:
            completed.append((item.key, current, Item(item.key, total, owned=owned)))
            return None
        current.latest = now
        if len(current.ranks) == 1:
            current.opened = now
            return item.key, current
        return None

    def complete(self, completed):
        """End the rounds of ``completed`` (from :meth:`add`), whose totals were applied: their
        waiters go on."""
        for key, round_, _ in completed:
            metrics.round_completed(round_.opened, round_.latest, time.monotonic())
            if round_.timer is not None:
                round_.timer.cancel()
            self._keys[key].current = Wait(round_.number + 1)
            if round_._done is not None:
                round_._done.set_result(None)

    def _abort_opened(self, opened):
        """Abort the rounds of ``opened`` [(key, round)] that are still waiting."""
        for key, round_ in opened:
            if key in self._keys and self._keys[key].current is round_:
                self._abort(key, round_)

    def abort(self, key, why, error_class):
        """Abort ``key``'s current round, if it has pushes, with ``error_class`` saying ``why``."""
        rounds = self._keys.get(key)
        if rounds is not None and rounds.current.ranks:
            self._abort(key, rounds.current, why, error_class)

    def abort_all(self, why, error_class):
        """:meth:`abort` every key's current round."""
        for key in self._keys:
            self.abort(key, why, error_class)

    def _abort(self, key, round_, why=None, error_class=RoundAbortedError):
        rounds = self._keys[key]
        missing = sorted(set(range(self.num_workers)) - round_.ranks)
        why = why or f"aborted after {self.round_timeout:g} s"
        error = error_class(
            f"key {key_repr(key)}: round {round_.number} {why}; missing ranks {missing} "
            f"(ranks {sorted(round_.ranks)} pushed; their pushes were discarded){self._absent(missing)}"
        )
        log.warning("%s", error, extra={"event": "round_aborted", "key": key, "round": round_.number})
        metrics.COUNTS.rounds_aborted += 1
        if round_.timer is not None:
            round_.timer.cancel()
        rounds.current = Wait(round_.number)
        for rank in round_.ranks:
            rounds.aborted[rank] = error
        fail(round_.done, error)

    async def settle(self, rank, keys, before_wait):
        """Report to ``rank`` the aborted rounds of ``keys`` it pushed to, and wait for the
        current round of each key it has pushed to; True if it waited. ``before_wait()`` runs
        before it waits, and may refuse the wait by raising."""
        errors, futures = [], {}
        for key in dict.fromkeys(keys):
            rounds = self._keys.get(key)
            if rounds is None:
                continue
            if rank in rounds.aborted:
                errors.append(rounds.aborted.pop(rank))
            elif rank in rounds.current.ranks:
                futures[key] = rounds.current.done
        if futures and not errors:
            before_wait()
            await asyncio.wait(futures.values())
            for key, future in futures.items():
                if future.exception() is not None:
                    errors.append(future.exception())
                    self._keys[key].aborted.pop(rank, None)
        if errors:
            more = f" (and {plural(len(errors) - 1, 'more key')})" if len(errors) > 1 else ""
            raise type(errors[0])(f"{errors[0]}{more}")
        return bool(futures)


class Barriers:
    """The barriers of ``num_workers`` ranks, one after another, each aborted after
    ``round_timeout`` seconds; ``absent`` as for :class:`Rounds`."""

    def __init__(self, num_workers, round_timeout, absent):
        self.num_workers = num_workers
        self.round_timeout = round_timeout
        self._absent = absent
        self.current = None  # the Wait of the barrier that ranks entered, or None
        self.done = 0  # how many barriers completed

    def waiting_for(self, rank):
        """Whether a barrier that ``rank`` has not entered is waiting."""
        return self.current is not None and rank not in self.current.ranks

    def enter(self, rank):
        """``rank`` enters the barrier: the future done once every rank has."""
        barrier = self.current
        if barrier is None:
            barrier = self.current = Wait(self.done + 1)
            loop = asyncio.get_running_loop()
            barrier.timer = loop.call_later(self.round_timeout, self.abort, barrier)
        barrier.ranks.add(rank)
        if len(barrier.ranks) == self.num_workers:
            barrier.timer.cancel()
            self.current = None
            self.done += 1
            barrier.done.set_result(None)
        return barrier.done

    def abort(self, barrier, why=None, error_class=RoundAbortedError):
        missing = sorted(set(range(self.num_workers)) - barrier.ranks)
        why = why or f"aborted after {self.round_timeout:g} s"
        error = error_class(f"barrier {barrier.number} {why}; missing ranks {missing}{self._absent(missing)}")
        log.warning("%s", error, extra={"event": "barrier_aborted", "round": barrier.number})
        barrier.timer.cancel()
        self.current = None
        fail(barrier.done, error)
