"""The server's state: init, sync rounds, barriers and the optimizer, over one
:class:`tensorkv.update.engine.Engine`, which stays the only place values change, for the workers
of a :class:`~.membership.Membership`; the rounds and barriers themselves, what workers wait
on, are :mod:`.waits`'s.

Everything runs on the server's event loop, so there are no locks: each method validates
its whole input, then changes state without awaiting in between, so a call that fails
changes nothing. A call that awaited checks its caller's registration again before it
changes anything: the rank may have been given back meanwhile. Waits (for a round, a
barrier, an init by rank 0) are bounded by ``round_timeout``; one that does not complete
is aborted with RoundAbortedError.

A rank that leaves during a run (given back, or its lease expired) leaves its pushes in
the rounds it pushed to, and its next holder (a replacement worker) takes its place in
each key's current round: where the old holder had pushed, the round keeps that push and
the replacement's first push of the key waits for the round and joins the next one (never
counted twice); where it had not, the replacement's push completes the round the others
wait in. So every round sums exactly one push per rank, each from the holder of the rank
at the time. A round still waits at most ``round_timeout`` for the rank to be taken again
and push; then it aborts as any other.

Init, push and pushpull apply each of a rank's sequence numbers at most once (see
:mod:`.membership`): a call whose number was applied is acknowledged again without being
applied, and the check is made again right where a call changes state, so that a call
sent again while the first is still waiting on the server is applied by one of them only.
A call (pulls numbered apart) that failed with RoundAbortedError fails with it again when
it is sent again: the aborted round is reported to a rank once, and that answer may be
what a broken connection lost.
"""
import asyncio
import logging

import numpy as np

from tensorkv.update import compression
from tensorkv import optimizer as optimizers
from tensorkv.backend import to_host
from tensorkv.wire.codec import Item
from tensorkv.update.engine import layout_mismatch
from tensorkv.update.rowsparse import check_row_ids
from tensorkv.errors import (
    FailedPreconditionError, InvalidArgumentError, KeyExistsError, KeyTypeError, ResourceExhaustedError,
    RoundAbortedError, ServerUnavailableError, ShapeMismatchError, key_repr, keys_repr,
)
from tensorkv.words import plural

from . import budget, metrics
from .membership import FAIL, REPLACE, Membership, Registration
from .waits import Barriers, Rounds, fail

log = logging.getLogger(__name__)
_IF_EXISTS_HINT = " (a script that does not pass it: set TENSORKV_IF_EXISTS)"

SYNC, ASYNC = "sync", "async"


def _host_copy(array):
    """A NumPy copy of a NumPy or CuPy array, which later updates cannot change."""
    return array.copy() if isinstance(array, np.ndarray) else to_host(array)


class Coordinator:
    """The state of one server for ``num_workers`` workers in ``mode`` 'sync' or 'async', which
    holds at most ``max_memory`` bytes of values and optimizer states (None: no limit)."""

    def __init__(self, engine, num_workers, mode, round_timeout, lease_timeout=10.0, max_memory=None):
        self.engine = engine
        self.max_memory = max_memory
        self.num_workers = num_workers
        self.mode = mode
        self.round_timeout = round_timeout
        self.members = Membership(num_workers, lease_timeout, on_expired=self._lease_expired)
        self._rounds = Rounds(engine, num_workers, round_timeout, self.members.absent)
        self._barriers = Barriers(num_workers, round_timeout, self.members.absent)
        self.optimizer = None
        self.optimizer_run = 0  # the number of the run that installed it (0: none was going on)
        self._updates = {}  # key -> updates applied to it (sync rounds, async pushes)
        self._initialized_in = {}  # key -> the number of the run that initialized it
        self._initialized = {}  # key -> ranks that have called init on it
        self._init_waiters = {}  # key -> future done when rank 0 has stored it
        self._split_apart = {}  # key -> the error of a worker that splits it otherwise (until the run ends)
        self._closing = False
        self.move = None  # the moves.Move this server's run is part of (tensorkv reshard), or None

    # ---- membership -------------------------------------------------------------------

    def register(self, rank=None, asked=Registration()):
        """(rank, incarnation) of a new registration of ``rank`` (None: the lowest free one) by
        a worker that asks for ``asked`` (a membership.Registration): see
        :meth:`Membership.register` and :meth:`Membership.check_bound`. The first registration
        of a run with if_exists 'replace' drops what earlier runs left. Refused once the server
        is shutting down: its open streams are still served then, but a new worker would only
        be in its last snapshot."""
        self._check_open()
        if self.move is not None:
            self.move.check_register(self.members.run)
        self.members.check_bound(asked.bound)
        rank, incarnation, started = self.members.register(rank, asked.if_exists, asked.previous, asked.request_id,
                                                           asked.job, asked.earlier)
        self.members.run.bigarray_bound = self.members.run.bigarray_bound or asked.bound
        if started and asked.if_exists == REPLACE:
            log.info("run %d replaces %d keys, the optimizer and its states", self.members.run.number,
                     len(self.engine))
            self._drop_state()
        metrics.COUNTS.workers = len(self.members.ranks)
        return rank, incarnation

    def unregister(self, rank, incarnation):
        """Give ``rank`` back: see :meth:`_forget`."""
        self._forget(rank, self.members.unregister(rank, incarnation), "its worker closed its store")

    def _lease_expired(self, rank, ended):
        metrics.COUNTS.expired_leases += 1
        self._forget(rank, ended, f"its lease expired: no heartbeat for {self.members.lease_timeout:g} s")

    def _forget(self, rank, ended, how):
        """After ``rank`` was given back or lost its lease: its next holder may init its keys
        again (stored values are kept) and does not get the errors of rounds that were
        aborted before; it takes the rank's place in the current rounds (see the module's
        docstring). The last rank of a run to leave (``ended``) ends it: nobody can complete
        its incomplete rounds any more, so their pushes are discarded."""
        metrics.COUNTS.workers = len(self.members.ranks)
        for ranks in self._initialized.values():
            ranks.discard(rank)
        self._rounds.forget_errors(rank)
        if ended:
            self._abort_waits(f"aborted: every rank of run {self.members.run.number} left or lost its lease",
                              RoundAbortedError)
            self._rounds.forget_errors()  # of the ranks that left
            self._split_apart.clear()
        else:
            self._say_who_waits_for(rank, how)

    def _say_who_waits_for(self, rank, how):
        """Log at once the rounds and the barrier that wait for ``rank``, which just left: they
        abort after --round-timeout unless a worker takes the rank again (when they abort, their
        errors say how it left: Membership.absent)."""
        keys = self._rounds.waiting_for(rank)
        barrier = self._barriers.waiting_for(rank)
        if not keys and not barrier:
            return
        waits = [f"the rounds of {plural(len(keys), 'key')} {keys_repr(keys)}" if keys else "",
                 f"barrier {self._barriers.current.number}" if barrier else ""]
        log.warning("rank %d left (%s) while %s waited for it: they abort %g s after they began (--round-timeout) "
                    "unless a worker takes rank %d again and joins them", rank, how, " and ".join(filter(None, waits)),
                    self.round_timeout, rank)

    def reset(self, force=False):
        """Drop every key, the optimizer and its states, the rounds and the key type, when
        no run is registered, and (unless ``force``) no run restored from a snapshot can come
        back; the number of keys dropped."""
        run = self.members.run
        if self.members.running:
            raise FailedPreconditionError(
                f"cannot reset while run {run.number} is registered (ranks {self.members.ranks}): "
                "reset once every worker has closed its store")
        if self.members.run_going_on and not force:
            job = f" (job {run.job!r})" if run.job else ""
            raise FailedPreconditionError(
                f"cannot reset: run {run.number}{job} was going on in the snapshot this server restored, and its "
                "workers may still register again and go on with its keys, which a reset would drop: reset once "
                "that job is over, or force it (`tensorkv reset --force`, tensorkv.reset(force=True))")
        if self.move is not None and not self.move.done and not force:
            raise FailedPreconditionError(
                f"cannot reset: the run on this server is {self.move.words()} by `tensorkv reshard`: run that command "
                "again to complete the move, or force the reset (`tensorkv reset --force`), which drops it here")
        count = len(self.engine)
        self._drop_state()
        self.move = None
        self.members.end_restored_run()
        log.info("reset: %d keys, the optimizer and its states dropped", count)
        return count

    def _drop_state(self):
        """Forget every key, the optimizer and its states, the rounds and the key type, as a
        server that just started. Only while no rank is registered: no wait is in progress."""
        self.engine.clear()
        metrics.cleared()
        self.optimizer = None
        self._rounds.clear()
        self._updates.clear()
        self._initialized_in.clear()
        self._initialized.clear()
        self._split_apart.clear()
        self._barriers.done = 0

    # ---- init -------------------------------------------------------------------------

    async def init(self, rank, incarnation, items, wait_only, sequence=0):
        """Rank 0 stores ``items``; every other rank (or a wait_only call) waits until the keys
        exist, then checks its dtypes and shapes against them."""
        self.members.check(rank, incarnation)
        if self.members.applied(rank, sequence):
            return
        for item in items:
            if item.two_bit is not None:
                raise InvalidArgumentError(f"key {key_repr(item.key)}: an init carries 2-bit compressed codes; "
                                           "only pushes may")
        try:
            keys = self._check_distinct(items, "init")
        except KeyTypeError as error:
            if self._left_by_earlier_runs(self.engine.keys()):  # which fixed the key type
                raise KeyTypeError(f"{error}: the keys on this server are those an earlier run left; "
                                   f"pass if_exists='replace' to start afresh{_IF_EXISTS_HINT}") from None
            raise
        if self.members.run.if_exists == FAIL:
            self._check_not_left_by_earlier_runs(keys)
            self._check_optimizer_not_left()
        for key in keys:
            if rank in self._initialized.get(key, ()):
                raise KeyExistsError(
                    f"key {key_repr(key)} is already initialized (rank {rank} called init on it before)")
        if rank == 0 and not wait_only:
            # Keys already stored are those of a rank 0 that registered again, or those an
            # earlier run left for this one to resume: kept.
            stored = [item for item in items if item.key in self.engine]
            for item in stored:
                self._check_initialized(item)
            new = [item for item in items if item.key not in self.engine]
            self.check_memory(new, self.optimizer)
            self.engine.init(new)
            self._initialized_in.update((item.key, self.members.run.number) for item in new)
            metrics.stored(new)
            for key in keys:
                waiter = self._init_waiters.pop(key, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
        else:
            await self._wait_for_keys(keys)
            self.members.check(rank, incarnation)
            for item in items:
                self._check_initialized(item)
            if self.members.applied(rank, sequence):
                return
        self.members.record(rank, sequence)
        for key in keys:
            self._initialized.setdefault(key, set()).add(rank)

    def _check_initialized(self, item):
        """Check an init's ``item`` against the stored value. One split over the servers otherwise
        (another TENSORKV_BIGARRAY_BOUND) makes the key fail for every worker until the run ends:
        the round waiting for the worker told is aborted, and the others' next calls on it fail,
        rather than wait for it a round timeout."""
        stored = self.engine.get(item.key)
        shape = tuple(item.array.shape if item.shape is None else item.shape)
        if shape == stored.shape and item.slice != stored.slice:
            error = ShapeMismatchError(layout_mismatch(item.key, "initialized", shape, item.slice, stored.slice))
            self._split_apart[item.key] = error
            self._rounds.abort(item.key, f"aborted: {error}", ShapeMismatchError)
            raise error
        self.engine.check_value(item.key, item.array, item.shape, item.slice, verb="initialized")

    def _check_not_split_apart(self, keys):
        for key in keys:
            if key in self._split_apart:
                raise ShapeMismatchError(f"{self._split_apart[key]} (told to a worker's init: every call on the "
                                         "key fails until the run ends)")

    def _left_by_earlier_runs(self, keys):
        """The keys of ``keys`` that an earlier run initialized."""
        run = self.members.run.number
        return [key for key in keys if self._initialized_in.get(key, run) < run]

    def _check_not_left_by_earlier_runs(self, keys):
        earlier = self._left_by_earlier_runs(keys)
        if earlier:
            updates = self._updates.get(earlier[0], 0)
            more = f" (and {len(earlier) - 1} more keys)" if len(earlier) > 1 else ""
            raise KeyExistsError(
                f"key {earlier[0]!r}{more} holds what an earlier run left on this server ({updates} "
                f"round{'' if updates == 1 else 's'} applied to it): pass if_exists='resume' to continue from "
                f"it, or if_exists='replace' to start afresh{_IF_EXISTS_HINT}")

    def _check_optimizer_not_left(self):
        """With if_exists 'fail', a run does not train with the optimizer an earlier run installed."""
        if self.optimizer is not None and self.optimizer_run < self.members.run.number:
            raise KeyExistsError(
                f"this server holds the optimizer {self.optimizer.name!r} that an earlier run installed, which would "
                f"update this run's keys: pass if_exists='resume' to train with it, or "
                f"if_exists='replace' to start afresh{_IF_EXISTS_HINT}")

    async def _wait_for_keys(self, keys):
        loop = asyncio.get_running_loop()
        missing = [key for key in keys if key not in self.engine]
        if not missing:
            return
        self._check_open()
        waiters = [self._init_waiters.setdefault(key, loop.create_future()) for key in missing]
        budget.before_wait()
        done, pending = await asyncio.wait(waiters, timeout=self.round_timeout)
        for future in done:
            if future.exception() is not None:
                raise future.exception()
        if pending:
            still = [key for key in missing if key not in self.engine]
            raise RoundAbortedError(
                f"init of keys {keys_repr(still)} aborted after {self.round_timeout:g} s: "
                "rank 0 has not initialized them (missing rank: [0])"
            )

    # ---- push and pull ----------------------------------------------------------------

    async def push(self, rank, incarnation, items, sequence=0):
        """Merge ``items`` (codec.Item) into their keys: in async mode at once, in sync mode
        into each key's current round, applied when all workers have pushed."""
        if self.engine.xp is np and not compression.host_reader_ready() and \
                any(item.two_bit is not None for item in items):
            await asyncio.to_thread(compression.load_host_reader)  # the other calls go on meanwhile
        self.members.check(rank, incarnation)
        if self.members.applied(rank, sequence):
            return
        self._check_distinct(items, "push")
        if any(item.two_bit is not None for item in items):
            with self.engine.on_device():  # 2-bit codes become the values they stand for, on the engine's device
                items = [compression.decompressed(item, self.engine.xp) for item in items]
        check_updater = getattr(self.engine.updater, "check", None)
        self._check_not_split_apart(item.key for item in items)
        for item in items:
            stored = self.engine.check_value(item.key, item.array, item.shape, item.slice)
            if check_updater is not None:
                check_updater(item.key, stored.array)
        if self.mode == ASYNC or self.num_workers == 1:
            # Applied at once: in async mode every push is; in sync mode, every round of one worker
            # is complete with its push, as Rounds.add would find (it never waits, so it is
            # never aborted).
            self.members.record(rank, sequence)
            self.engine.apply_each(items)
            self._count_updates(item.key for item in items)
            metrics.COUNTS.pushes += len(items)
            if self.mode != ASYNC:
                metrics.COUNTS.rounds_completed += len(items)
            return
        # A rank that already pushed a key in its current round joins the next round.
        while await self._settled(rank, [item.key for item in items], ("push", sequence)):
            pass
        self.members.check(rank, incarnation)
        if self.members.applied(rank, sequence):
            return
        self.members.record(rank, sequence)
        metrics.COUNTS.pushes += len(items)
        completed = self._rounds.add(rank, items, sequence)
        if completed:
            # Applied together, then completed: should the update fail, the rounds stay open
            # and their abort timers report it to every rank that waits.
            self.engine.apply_each([total for _, _, total in completed])
            self._count_updates(key for key, _, _ in completed)
            self._rounds.complete(completed)

    async def pull(self, rank, incarnation, keys, pull_sequence=0):
        """The values of ``keys`` (:class:`Item` over the stored arrays, not copies: valid
        until the caller next awaits), after the current round of each key this rank has
        pushed to (sync mode). ``pull_sequence``: see PullRequest.pull_sequence."""
        return await self._pull(rank, incarnation, keys, ("pull", pull_sequence))

    async def _pull(self, rank, incarnation, keys, call):
        self.members.check(rank, incarnation)
        keys = self.engine.check_keys(keys)
        for key in keys:
            self.engine.get(key)
        self._check_not_split_apart(keys)
        if self.mode == SYNC and await self._settled(rank, keys, call):
            self.members.check(rank, incarnation)
        metrics.COUNTS.pulls += len(keys)
        return [self._snapshot(key) for key in keys]

    async def pull_rows(self, rank, incarnation, requests, pull_sequence=0, before_build=None):
        """[(full shape, new array of the rows)] of ``requests`` [(key, row ids)], after the
        current round of each key this rank has pushed to (sync mode); every id is checked
        before anything is waited for. ``await before_build()``, if given, once that round is
        over and before the rows are copied (the caller reserves room for them then)."""
        self.members.check(rank, incarnation)
        keys = self.engine.check_keys([key for key, _ in requests])
        for key, (_, ids) in zip(keys, requests):
            shape = self.engine.get(key).shape
            check_row_ids(key, ids, shape[0] if shape else 0)
        if self.mode == SYNC and await self._settled(rank, keys, ("pull", pull_sequence)):
            self.members.check(rank, incarnation)
        if before_build is not None:
            await before_build()
            self.members.check(rank, incarnation)
        metrics.COUNTS.pulls += len(keys)
        return [self.engine.pull_rows(key, ids) for key, (_, ids) in zip(keys, requests)]

    async def pushpull(self, rank, incarnation, items, sequence=0):
        await self.push(rank, incarnation, items, sequence)
        return await self._pull(rank, incarnation, [item.key for item in items], ("pushpull", sequence))

    def open_sequences(self):
        """{rank: the sequence numbers of its pushes in rounds still open}: applied, but in
        no value yet."""
        return self._rounds.open_sequences()

    def _count_updates(self, keys):
        updates = self._updates
        for key in keys:
            updates[key] = updates.get(key, 0) + 1

    async def _settled(self, rank, keys, call):
        """:meth:`Rounds.settle` for ``rank``'s call ``call`` ((kind, sequence number)): the error
        that the call, sent before, failed with is raised again (Membership.failure)."""
        error = self.members.failure(rank, call)
        if error is not None:
            raise type(error)(str(error))
        try:
            return await self._rounds.settle(rank, keys, self._before_wait)
        except RoundAbortedError as error:
            self.members.failed(rank, call, error)
            raise

    def _snapshot(self, key):
        stored = self.engine.get(key)
        return Item(key, stored.array, stored.shape, stored.slice)

    def _check_distinct(self, items, verb):
        keys = self.engine.check_keys([item.key for item in items])
        if len(set(keys)) != len(keys):
            twice = sorted({k for k in keys if keys.count(k) > 1}, key=repr)
            raise InvalidArgumentError(f"keys {keys_repr(twice)} appear more than once in one {verb}")
        return keys

    # ---- barrier ----------------------------------------------------------------------

    async def barrier(self, rank, incarnation):
        """Return once every rank has entered the barrier."""
        self.members.check(rank, incarnation)
        self._check_open()
        done = self._barriers.enter(rank)
        budget.before_wait()
        await asyncio.shield(done)

    # ---- optimizer --------------------------------------------------------------------

    def set_optimizer(self, optimizer, states):
        """Install ``optimizer`` with ``states`` {key: (num_update, [Item])}.

        Every worker sends the same optimizer: one equal to the installed one, without
        states, keeps the installed one and its states.
        """
        if not states and optimizer == self.optimizer:
            return
        self.check_memory((), optimizer)
        updater = optimizers.Updater(optimizer)
        checked = {}
        for key, (num_update, items) in states.items():
            stored = self.engine.get(key)
            for item in items:
                if item.shape != stored.shape or item.slice != stored.slice:
                    raise ShapeMismatchError(
                        f"key {key_repr(key)}: optimizer state for shape {item.shape} (slice {item.slice}) does "
                        f"not match the stored shape {stored.shape} (slice {stored.slice})")
            checked[key] = (num_update, updater.check_states(key, stored.array, [item.array for item in items]))
        updater.set_states(checked)
        self.engine.updater = updater
        self.engine.changes += 1
        # SetUpdater names no rank: the optimizer is the current run's, or the last one's.
        self.optimizer, self.optimizer_run = optimizer, self.members.run.number if self.members.run else 0
        log.info("optimizer %s %s installed with states for %s", optimizer.name, optimizer.params,
                 plural(len(states), "key"), extra={"event": "optimizer_installed"})

    def check_memory(self, items, optimizer):
        """ResourceExhaustedError unless the values stored, those of ``items`` (codec.Item of new
        keys) and the states that ``optimizer`` (None: none) keeps for all of them fit in
        max_memory."""
        if self.max_memory is None:
            return
        states = len(optimizer.state_names()) if optimizer is not None else 0
        held = self.engine.value_bytes + states * self.engine.state_array_bytes
        if optimizer is not None and optimizer.multi_precision:
            held += self.engine.master_bytes
        for item in items:
            per_value = optimizer.states_per_value(item.array.dtype) if optimizer is not None else 0
            state_bytes = per_value * optimizers.state_array_bytes(item.array)
            held += item.array.nbytes + state_bytes
            if held > self.max_memory:
                needs = " and the optimizer states it needs" if state_bytes else ""
                raise ResourceExhaustedError(f"key {key_repr(item.key)}: its value{needs} would bring what this "
                                             f"server holds to {held} bytes; {self._memory_limit()}")
        if held > self.max_memory:  # what is stored fits (it was checked): the optimizer's states do not
            copies = " and a float32 copy of each float16 or bfloat16 one (multi_precision)" \
                if optimizer.multi_precision else ""
            raise ResourceExhaustedError(
                f"optimizer {optimizer.name!r} keeps {plural(states, 'state array')} per value{copies}: with those "
                f"of the {plural(len(self.engine), 'key')} stored this server would hold {held} bytes; "
                f"{self._memory_limit()}")

    def _memory_limit(self):
        return f"this server's limit is {self.max_memory} bytes (--max-memory: stored values and optimizer states)"

    def set_learning_rate(self, learning_rate):
        """Change the installed optimizer's learning rate; its states and counts stay."""
        if self.optimizer is None:
            raise FailedPreconditionError("no optimizer is installed: SetUpdater first")
        self.engine.updater.set_learning_rate(learning_rate)
        self.optimizer = self.engine.updater.optimizer
        log.info("learning rate of optimizer %s set to %g", self.optimizer.name, self.optimizer.learning_rate)

    def optimizer_state_bytes(self):
        """The bytes of the optimizer states that :meth:`optimizer_states` copies."""
        if self.optimizer is None:
            return 0
        return sum(array.nbytes for _, arrays in self.engine.updater.get_states().values() for array in arrays)

    def optimizer_states(self):
        """(optimizer or None, {key: (num_update, [Item])}) with copies of the states."""
        if self.optimizer is None:
            return None, {}
        states = {}
        for key, (num_update, arrays) in self.engine.updater.get_states().items():
            stored = self.engine.get(key)
            states[key] = (num_update, [Item(key, _host_copy(a), stored.shape, stored.slice) for a in arrays])
        return self.optimizer, states

    # ---- snapshots --------------------------------------------------------------------

    def snapshot_state(self, keys=True):
        """What a snapshot keeps of the rounds besides the values, the optimizer and its states
        (:meth:`optimizer_states`), as plain numbers: {"barriers_done", "next_incarnation",
        and with ``keys`` "keys": {key: {"round", "updates", "initialized_in"}} of every stored
        key, in the engine's order}."""
        state = {"barriers_done": self._barriers.done, "next_incarnation": self.members.next_incarnation}
        if keys:
            state["keys"] = {key: {"round": self._rounds.number(key),
                                   "updates": self._updates.get(key, 0),
                                   "initialized_in": self._initialized_in.get(key, 0)} for key in self.engine.keys()}
        return state

    def restore_state(self, state):
        """Take a :meth:`snapshot_state` back, on a server that has just put the keys of
        ``state["keys"]`` into its engine and serves nothing yet."""
        for key, entry in state["keys"].items():
            self._rounds.restore(key, entry["round"])
            self._updates[key] = entry["updates"]
            self._initialized_in[key] = entry["initialized_in"]
        self._barriers.done = state["barriers_done"]
        self.members.restore_next_incarnation(state["next_incarnation"])

    # ---- life cycle -------------------------------------------------------------------

    def info(self):
        run = self.members.run
        return {
            "mode": self.mode, "num_workers": self.num_workers, "registered_ranks": self.members.ranks,
            "num_keys": len(self.engine),
            "optimizer": self.optimizer.name if self.optimizer else "",
            "run": run.number if run else 0, "if_exists": run.if_exists if run else None,
            "job": run.job if run else "",
            "lease_timeout": self.members.lease_timeout, "leases": self.members.leases(),
            "expired_leases": self.members.expired_leases,
        }

    def describe_keys(self):
        """(key, Stored, updates applied) of every key, in the order the keys were stored."""
        return [(key, self.engine.get(key), self._updates.get(key, 0)) for key in self.engine.keys()]

    def read(self, key):
        """A host copy of ``key``'s value as stored now, as an Item; no round is waited for."""
        key = self.engine.check_keys([key])[0]
        stored = self.engine.get(key)
        return Item(key, _host_copy(stored.array), stored.shape, stored.slice)

    def _check_open(self):
        if self._closing:
            raise ServerUnavailableError("the server is shutting down")

    def _before_wait(self):
        """Before a call waits for other ranks: refused once the server is shutting down."""
        self._check_open()
        budget.before_wait()

    def shutdown(self):
        """Fail every wait in progress, and every later one, with ServerUnavailableError."""
        self._closing = True
        self._abort_waits("aborted: the server is shutting down", ServerUnavailableError)

    def _abort_waits(self, why, error_class):
        """Fail every wait in progress with ``error_class`` saying ``why``: the rounds (their
        pushes are discarded), the barrier, the inits waiting for rank 0."""
        self._rounds.abort_all(why, error_class)
        if self._barriers.current is not None:
            self._barriers.abort(self._barriers.current, why, error_class)
        for waiter in self._init_waiters.values():
            fail(waiter, error_class(f"init {why}"))
        self._init_waiters.clear()
