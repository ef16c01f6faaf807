"""Who may call a server: the ranks registered on it, each held by one registration, and
the run they make up.

Every registration gets a new *incarnation* number, unique on this server and across its
restarts: a counter that starts from the server's start time in microseconds and grows by
one per registration. Every call that names a rank carries the incarnation its caller
registered with, and :meth:`Membership.check` refuses a call from a rank that nobody holds
(the server restarted, or the rank was given back) or from an earlier holder of the rank,
so that such a call never merges into a round.

Every registration is a *lease* of ``lease_timeout`` seconds, renewed by the worker's
heartbeats (:meth:`Membership.renew`, the KeepAlive RPC). A lease that is not renewed in
time expires on the event loop: the rank is freed as if its holder had given it back, and
the expired incarnation is refused from then on, so a worker that was paused past its
lease cannot merge anything when it wakes up. Incarnations grow with time, so every one older
than the last that a rank was granted is refused too, and cannot register again in its own
place: a worker that slept through its lease and its replacement's stays out.

A worker whose connection broke registers again naming its *previous incarnation*: while
the rank is still held by it, the new registration takes its place (a new incarnation; the
old one is refused from then on) and keeps what the rank did, in the rounds and in the
*sequence numbers* it applied. Every call that changes values carries a sequence number,
and :meth:`Membership.applied` tells whether the rank's call of that number was applied
already, so that a call sent again after a broken connection is never applied twice. A
call that failed because a round it waited for was aborted is answered the same error when
it is sent again (:meth:`Membership.failure`): the answer that carried it may be what broke.

A *run* is the set of workers registered together: it starts with a registration while no
rank is registered, and ends when all of its ranks have been given back or have lost their
lease. Its first registration chooses its ``if_exists``, what it does with the keys that
earlier runs left (FAIL, RESUME or REPLACE), and the run's other registrations must ask for
the same. A server restarted from a snapshot taken while a run was going on keeps that run
(:meth:`Membership.restore_run`): its workers register again naming their previous
incarnations and go on in it, and a new worker that registers within a lease of the restart
joins it too, as it would have joined before the restart, unless it asks for 'replace'.

A run remembers the *job* of the registration that started it (RegisterRequest.job, e.g.
TENSORKV_JOB; empty: none). Where both a run and a registration name a job, the job decides
instead of ``if_exists``: a worker of the run's job joins the run going on, or the run restored
from a snapshot whenever it comes (a worker process of the job that was restarted with the
server, asking for 'replace', would otherwise start a new run that drops the keys the server
restored), and a worker of another job is refused while the run has ranks registered, or starts
a new run in place of the restored one.
"""
import asyncio
import dataclasses
import logging
import time

from tensorkv.errors import FailedPreconditionError
from tensorkv.words import plural

log = logging.getLogger(__name__)

FAIL, RESUME, REPLACE = "fail", "resume", "replace"
# The longest job name a registration may give (RegisterRequest.job), in UTF-8 bytes.
MAX_JOB_BYTES = 256
# How many of a worker's earlier incarnations a registration is matched against (the newest of
# RegisterRequest.earlier_incarnations); a worker sends as many.
MAX_EARLIER_INCARNATIONS = 16
# A number left out of a rank's sequence (a call refused before it changed anything) counts
# as applied once this many later numbers have been.
SEQUENCE_WINDOW = 256
# Errors of a rank's failed calls (a round they waited for was aborted) kept for the same
# call sent again after a broken connection: the last this many.
FAILURES_KEPT = 16


@dataclasses.dataclass(frozen=True)
class Registration:
    """What a registering worker asks for besides its rank (RegisterRequest's other fields):
    ``if_exists``, ``previous``, ``request_id``, ``job`` and ``earlier`` as
    :meth:`Membership.register` takes them, and its bigarray ``bound`` (0: none said;
    :meth:`Membership.check_bound`)."""

    if_exists: str = FAIL
    previous: int | None = None
    request_id: int = 0
    job: str = ""
    earlier: tuple = ()
    bound: int = 0


class Run:
    """One run: its number (1, 2, ... since the server started), its ``if_exists`` and the
    ``job`` of the registration that started it ("": none named), and the bigarray bound its
    workers slice values by (RegisterRequest.bigarray_bound; 0: none said yet)."""

    __slots__ = ("number", "if_exists", "job", "bigarray_bound")

    def __init__(self, number, if_exists, job=""):
        self.number = number
        self.if_exists = if_exists
        self.job = job
        self.bigarray_bound = 0


class _Lease:
    """The lease of one registration: when it was last renewed (event-loop time), and the
    timer that checks it then ``lease_timeout`` seconds later."""

    __slots__ = ("incarnation", "renewed", "timer")

    def __init__(self, incarnation, renewed):
        self.incarnation = incarnation
        self.renewed = renewed
        self.timer = None


class _Applied:
    """The sequence numbers of one rank's calls that were applied: every number up to
    ``through``, and those in ``beyond``."""

    __slots__ = ("through", "beyond")

    def __init__(self):
        self.through = 0
        self.beyond = set()

    def __contains__(self, sequence):
        return sequence <= self.through or sequence in self.beyond

    def saved(self, excluded):
        """(through, beyond) of these numbers without those in ``excluded``."""
        through = min([self.through, *(number - 1 for number in excluded)])
        beyond = (set(range(through + 1, self.through + 1)) | self.beyond) - set(excluded)
        return through, sorted(beyond)

    def add(self, sequence):
        self.beyond.add(sequence)
        if len(self.beyond) > SEQUENCE_WINDOW:
            self.through = min(self.beyond) - 1
        while self.through + 1 in self.beyond:
            self.through += 1
            self.beyond.discard(self.through)


class Membership:
    """The ranks 0 <= rank < ``num_workers`` registered on one server, their incarnations
    and leases. ``on_expired(rank, ended)`` runs when a lease expires, after the rank is
    freed; ``ended`` says whether that ended the run."""

    def __init__(self, num_workers, lease_timeout=10.0, on_expired=lambda rank, ended: None):
        self.num_workers = num_workers
        self.lease_timeout = lease_timeout
        self.incarnations = {}  # rank -> the incarnation of its registration
        self.run = None  # the current Run (the last one while no rank is registered)
        self.expired_leases = 0  # since the server started
        self._next_incarnation = time.time_ns() // 1000
        self._leases = {}  # rank -> _Lease of its registration
        self._expired = {}  # rank -> the incarnation whose lease expired last
        self._granted = {}  # rank -> the last incarnation it was granted (or restored from a snapshot)
        self._applied = {}  # rank -> _Applied sequence numbers of its registration (and those it took over)
        self._failures = {}  # rank -> {(kind, number): the error that call failed with}, the last FAILURES_KEPT
        self._restored = {}  # rank -> (incarnation, _Applied) saved in the snapshot this server restored
        self._request_ids = {}  # rank -> RegisterRequest.request_id of its registration
        self._left = {}  # rank -> (event-loop time, how) its last registration ended
        self._on_expired = on_expired
        # The run that was going on when the restored snapshot was taken, while it is the
        # current run and has not ended; and the time.monotonic() until which a worker that
        # names no previous incarnation joins it while none of its workers is back.
        self._restored_run, self._restored_until = None, None

    @property
    def ranks(self):
        """The registered ranks, ascending."""
        return sorted(self.incarnations)

    @property
    def running(self):
        """Whether a run is going on: some rank is registered."""
        return bool(self.incarnations)

    def register(self, rank=None, if_exists=FAIL, previous=None, request_id=0, job="", earlier=()):
        """(rank, incarnation, whether it started a new run) of a new registration of
        ``rank``, or of the lowest free rank, by a worker of ``job`` ("": none named);
        FailedPreconditionError if the rank is taken, or if ``if_exists`` is not that of the
        run going on (or, where both name one, its job is not). With ``previous``, the incarnation
        that held ``rank`` before the caller's connection broke: the new registration takes
        its place when it still holds the rank; FailedPreconditionError if its lease expired.
        A ``request_id`` (not 0) whose registration still holds its rank gets that
        registration again (RegisterRequest.request_id). ``earlier``: the incarnations the
        worker held here before ``previous`` (RegisterRequest.earlier_incarnations); on a server
        restored from a snapshot, the numbers it saved for any of them come back to the worker."""
        again = self._registered_again(rank, previous, request_id)
        if again is not None:
            return again
        held = {previous, *earlier} if previous is not None else set()
        going = self._joins_run(rank, if_exists, job, held)
        rank = self._free_rank(rank)
        if not going:
            self._start_run(if_exists, job)
        elif not self.running:
            log.info("run %d goes on after this server's restart", self.run.number, extra={"event": "run_resumed"})
        incarnation = self.incarnations[rank] = self._next_incarnation
        self._next_incarnation += 1
        self._grant(rank, incarnation)
        self._request_ids[rank] = request_id
        restored = self._restored.pop(rank, None)
        if restored is not None and restored[0] in held:
            self._applied[rank] = restored[1]  # the same worker, after this server restarted
        log.info("worker registered with rank %d, incarnation %d (%d of %d)",
                 rank, incarnation, len(self.incarnations), self.num_workers,
                 extra={"event": "worker_registered", "rank": rank})
        return rank, incarnation, not going

    def _registered_again(self, rank, previous, request_id):
        """(rank, incarnation, False) for a registration that is one already made (the same
        ``request_id``), or that takes the place of ``previous`` while it holds ``rank``; None
        for a new one. FailedPreconditionError when ``previous``'s lease expired or a later
        registration took the rank."""
        if request_id:
            made = next((held for held, made_by in self._request_ids.items() if made_by == request_id), None)
            if made is not None and rank in (None, made):
                return made, self.incarnations[made], False
        if previous is not None and rank is not None:
            if self.incarnations.get(rank) == previous:
                self._request_ids[rank] = request_id
                return rank, self._take_over(rank, previous), False
            if self._expired.get(rank) == previous or previous < self._granted.get(rank, previous):
                self.check(rank, previous)  # raises: that lease expired, or a later one took the rank
        return None

    def _joins_run(self, rank, if_exists, job, held):
        """Whether a new registration of ``rank`` (None: any) by a worker of ``job`` that held the
        incarnations ``held`` here goes on in the current run (else it starts one);
        FailedPreconditionError if it may do neither."""
        # A worker of the restored run, back: its if_exists was checked when it first registered.
        returning = self._restored_run is not None and self._restored.get(rank, (None,))[0] in held
        same_job = self._same_job(job)
        if self.running and same_job is False:
            raise FailedPreconditionError(
                f"this worker is of job {job!r}, but run {self.run.number} on this server (ranks {self.ranks} "
                f"registered) belongs to job {self.run.job!r}: a server serves one job at a time; wait until that "
                "job ends (`tensorkv workers` lists its ranks), use other servers, or, if this worker is meant to be "
                f"of job {self.run.job!r}, set TENSORKV_JOB (or job=) to it")
        if same_job is None:
            # A new worker joins the restored run, within a lease of the restart, if it asks for
            # what the run did; one that asks for another (a job started again with 'resume' or
            # 'replace') starts a new run, and so does one asking for 'replace' (a job that starts
            # over, whatever the run before asked for: joining, its init would keep the restored values).
            rejoins = self._restored_run_open() and if_exists == self.run.if_exists and if_exists != REPLACE
        else:  # where both name a job, the job decides, whenever its worker comes back
            rejoins = self._restored_run is not None and same_job
        going = self.running or returning or rejoins
        if going and not returning and not same_job and if_exists != self.run.if_exists:
            raise FailedPreconditionError(
                f"this worker asks for if_exists={if_exists!r}, but run {self.run.number} on this server "
                f"(ranks {self.ranks} registered) started with if_exists={self.run.if_exists!r}: every worker "
                "of a run must ask for the same")
        return going

    def _free_rank(self, rank):
        """``rank``, or the lowest free rank when None; FailedPreconditionError if it is taken."""
        if rank is None:
            free = [r for r in range(self.num_workers) if r not in self.incarnations]
            if not free:
                raise FailedPreconditionError(f"every rank is taken: this server expects {self._workers()}; "
                                              f"{self._held()}")
            if self._restored_run is not None:  # the ranks whose workers may still come back, last
                free.sort(key=lambda r: r in self._restored)
            rank = free[0]
        self._check_range(rank)
        if rank in self.incarnations:
            heard = asyncio.get_running_loop().time() - self._leases[rank].renewed
            raise FailedPreconditionError(
                f"rank {rank} is already taken by another worker (incarnation {self.incarnations[rank]}, last heard "
                f"from {heard:.1f} s ago): if it is gone, its lease expires {self.lease_timeout:g} s after it was last "
                "heard from (--lease-timeout), and the rank is free then")
        return rank

    def _start_run(self, if_exists, job):
        self.run = Run(self.run.number + 1 if self.run else 1, if_exists, job)
        self._left.clear()  # how workers of earlier runs left: none of this run's waits is theirs
        self.end_restored_run()
        log.info("run %d starts (if_exists=%r%s)", self.run.number, if_exists, f", job {job!r}" if job else "",
                 extra={"event": "run_started"})

    def check_bound(self, bound):
        """FailedPreconditionError when ``bound`` (a worker's RegisterRequest.bigarray_bound)
        is not the bound of the run whose workers are registered: their slices of a value
        would not meet, and rounds of the key would wait for pushes that never come."""
        run_bound = self.run.bigarray_bound if self.running else 0
        if bound and run_bound and bound != run_bound:
            raise FailedPreconditionError(
                f"this worker slices values of more than {bound} elements over the servers, but the workers of "
                f"run {self.run.number} (ranks {self.ranks} registered) slice those of more than {run_bound}: give "
                "every worker of a job the same TENSORKV_BIGARRAY_BOUND (bigarray_bound=)")

    def _same_job(self, job):
        """Whether ``job`` is the current run's job; None where either names none."""
        if not job or self.run is None or not self.run.job:
            return None
        return job == self.run.job

    def end_restored_run(self):
        """The restored run is over (ended, or dropped by a forced reset): none of its workers
        can come back to it, and the numbers saved for them are no one's."""
        self._restored_run = None
        self._restored.clear()

    def _restored_run_open(self):
        """Whether a new worker that registers may join the run restored from a snapshot: within
        a lease of the restart."""
        return self._restored_run is not None and time.monotonic() < self._restored_until

    @property
    def next_incarnation(self):
        """The incarnation the next registration gets (a snapshot keeps it: a restarted server
        grants none of the incarnations it granted before)."""
        return self._next_incarnation

    def restore_next_incarnation(self, number):
        """Grant no incarnation below ``number``, a snapshot's :attr:`next_incarnation`."""
        self._next_incarnation = max(self._next_incarnation, number)

    @property
    def run_going_on(self):
        """Whether a run is going on: some rank is registered, or the run restored from a
        snapshot has not ended (its workers may come back)."""
        return self.running or self._restored_run is not None

    def _take_over(self, rank, previous):
        """The incarnation of a new registration of ``rank`` in the place of ``previous``."""
        incarnation = self.incarnations[rank] = self._next_incarnation
        self._next_incarnation += 1
        self._leases.pop(rank).timer.cancel()
        self._grant(rank, incarnation)
        log.info("worker with rank %d registered again (incarnation %d in the place of %d)",
                 rank, incarnation, previous, extra={"event": "worker_reregistered", "rank": rank})
        return incarnation

    def applied(self, rank, sequence):
        """Whether the call of ``rank`` numbered ``sequence`` (0: not numbered) was applied."""
        return sequence > 0 and sequence in self._applied.get(rank, ())

    def record(self, rank, sequence):
        """Remember that the call of ``rank`` numbered ``sequence`` was applied."""
        if sequence > 0:
            self._applied.setdefault(rank, _Applied()).add(sequence)

    def saved_sequences(self, excluded):
        """The sequence numbers each registered rank applied, for a snapshot: without
        ``excluded`` {rank: numbers} (pushes of open rounds, which a snapshot does not hold);
        and those restored for a worker that has not registered again yet."""
        saved = []
        for rank, incarnation in sorted(self.incarnations.items()):
            if rank in self._applied:
                through, beyond = self._applied[rank].saved(excluded.get(rank, ()))
                saved.append({"rank": rank, "incarnation": incarnation, "through": through, "beyond": beyond})
        for rank, (incarnation, applied) in sorted(self._restored.items()):
            if rank not in self.incarnations:
                saved.append({"rank": rank, "incarnation": incarnation, "through": applied.through,
                              "beyond": sorted(applied.beyond)})
        return saved

    def restore_run(self, run, going):
        """Take ``run`` (a Run, or None) from a snapshot: the last run, going on when the
        snapshot was taken if ``going``."""
        self.run = run
        if run is not None and going:
            self._restored_run, self._restored_until = run, time.monotonic() + self.lease_timeout

    def restore_sequences(self, saved):
        """Keep the numbers of :meth:`saved_sequences` for each rank's worker, which gets them
        back when it registers again naming the incarnation it held (RegisterRequest.previous_incarnation)."""
        for entry in saved:
            applied = _Applied()
            applied.through, applied.beyond = int(entry["through"]), {int(number) for number in entry["beyond"]}
            self._restored[int(entry["rank"])] = (int(entry["incarnation"]), applied)
            self._granted[int(entry["rank"])] = int(entry["incarnation"])

    def failure(self, rank, call):
        """The error that ``rank``'s call ``call`` ((kind, number); number 0: not numbered)
        failed with, if it did lately; else None."""
        return self._failures.get(rank, {}).get(call) if call[1] else None

    def failed(self, rank, call, error):
        """Remember that ``rank``'s call ``call`` failed with ``error``."""
        if call[1]:
            failures = self._failures.setdefault(rank, {})
            failures[call] = error
            if len(failures) > FAILURES_KEPT:
                del failures[next(iter(failures))]

    def unregister(self, rank, incarnation):
        """Give ``rank`` back (only its current holder may); whether that ended the run."""
        self.check(rank, incarnation)
        log.info("worker with rank %d, incarnation %d unregistered", rank, incarnation,
                 extra={"event": "worker_unregistered", "rank": rank})
        return self._free(rank, "its worker closed its store")

    def renew(self, rank, incarnation):
        """Renew the lease of ``rank``'s registration (only its current holder may); the
        seconds it now has left."""
        self.check(rank, incarnation)
        self._leases[rank].renewed = asyncio.get_running_loop().time()
        return self.lease_timeout

    def leases(self):
        """[(rank, incarnation, seconds since its lease was renewed)], by rank."""
        now = asyncio.get_running_loop().time()
        return [(rank, lease.incarnation, now - lease.renewed) for rank, lease in sorted(self._leases.items())]

    def _grant(self, rank, incarnation):
        self._granted[rank] = incarnation
        loop = asyncio.get_running_loop()
        lease = self._leases[rank] = _Lease(incarnation, loop.time())
        self._look_at(rank, lease, lease.renewed + self.lease_timeout)

    def _look_at(self, rank, lease, when):
        lease.timer = asyncio.get_running_loop().call_at(when, self._expire, rank, lease, when)

    def _expire(self, rank, lease, when):
        """Free ``rank`` if ``lease`` was not renewed in time, else look again when it is due
        (one timer per lease, moved forward only when it fires, rather than one per renewal).

        A timer that fires more than a third of a lease after ``when`` shows that this server
        did not run meanwhile (its host paused, or its loop was busy): it could not hear the
        heartbeats, so the worker gets a whole lease from now to be heard again."""
        now = asyncio.get_running_loop().time()
        if now - when > self.lease_timeout / 3:
            self._look_at(rank, lease, now + self.lease_timeout)
            return
        due = lease.renewed + self.lease_timeout
        if now < due:
            self._look_at(rank, lease, due)
            return
        log.warning("lease of rank %d (incarnation %d) expired after %g s: rank freed",
                    rank, lease.incarnation, self.lease_timeout, extra={"event": "lease_expired", "rank": rank})
        self.expired_leases += 1
        self._expired[rank] = lease.incarnation
        self._on_expired(rank, self._free(rank, f"no heartbeat for {self.lease_timeout:g} s: its lease expired"))

    def _free(self, rank, how):
        """Forget ``rank``'s registration and its lease, which ended ``how`` (words); whether
        that ended the run."""
        del self.incarnations[rank]
        self._left[rank] = asyncio.get_running_loop().time(), how
        self._leases.pop(rank).timer.cancel()
        self._applied.pop(rank, None)
        self._request_ids.pop(rank, None)
        self._failures.pop(rank, None)
        log.info("rank %d freed (%d of %d ranks registered)", rank, len(self.incarnations), self.num_workers)
        if not self.running:
            self.end_restored_run()
            log.info("run %d ended: every rank left or lost its lease", self.run.number, extra={"event": "run_ended"})
        return not self.running

    def absent(self, ranks):
        """Where the unregistered ones of ``ranks`` went, as the end of a message that names
        them ('; rank 0 left ...'; '' when all are registered): for a round that waits for them."""
        now = asyncio.get_running_loop().time()
        words = []
        for rank in ranks:
            if rank in self.incarnations:
                continue
            if rank in self._left:
                when, how = self._left[rank]
                words.append(f"rank {rank} left {now - when:.1f} s before ({how})")
            else:
                words.append(f"rank {rank} has not registered in run {self.run.number}" if self.run else
                             f"rank {rank} has not registered")
        return "".join(f"; {said}" for said in words)

    def _held(self):
        """Which ranks the leases hold and when each expires, for a worker refused a rank."""
        now = asyncio.get_running_loop().time()
        held = ", ".join(f"rank {rank} by incarnation {lease.incarnation} (last heard from {now - lease.renewed:.1f} s "
                         f"ago: its lease expires in {max(0.0, lease.renewed + self.lease_timeout - now):.1f} s)"
                         for rank, lease in sorted(self._leases.items()))
        return (f"their leases hold them: {held}. A worker that ended without closing its store (an MXNet script "
                f"does not) holds its rank until its lease expires, --lease-timeout {self.lease_timeout:g} s after "
                "it was last heard from; a live worker's heartbeats keep it")

    def check(self, rank, incarnation):
        """FailedPreconditionError unless ``rank`` is registered with ``incarnation``."""
        self._check_range(rank)
        current = self.incarnations.get(rank)
        if incarnation != current and incarnation == self._expired.get(rank):
            now = "is free" if current is None else f"is held by incarnation {current}"
            raise FailedPreconditionError(
                f"rank {rank}: the lease of this call's incarnation {incarnation} expired (no heartbeat for "
                f"{self.lease_timeout:g} s, --lease-timeout) and the rank {now}: create the store again to register")
        last = self._granted.get(rank, incarnation)
        if current is None and incarnation < last:
            raise FailedPreconditionError(
                f"rank {rank}: this call's incarnation {incarnation} is over: incarnation {last} registered the rank "
                f"after it and {self._ended(rank)}; a registration that is over cannot come back (what its worker "
                "computed since is stale): create the store again to register as a new worker")
        if current is None:
            raise FailedPreconditionError(
                f"rank {rank} is not registered on this server (it restarted, or the rank was given back): "
                "create the store again to register")
        if incarnation != current and not incarnation:  # a client written from the protos before incarnations
            raise FailedPreconditionError(
                f"rank {rank}: this call carries no incarnation: every call of a registered worker must send the "
                "RegisterResponse.incarnation of its registration")
        if incarnation != current:
            raise FailedPreconditionError(
                f"rank {rank} is held by incarnation {current}, not by this call's incarnation {incarnation}: "
                "the rank was registered again since this caller registered (after it gave the rank back, "
                "or after a server restart)")

    def _ended(self, rank):
        """How the last registration of ``rank``, which no one holds, ended (words)."""
        if rank in self._left:
            when, how = self._left[rank]
            return f"left {asyncio.get_running_loop().time() - when:.1f} s ago ({how})"
        return "has not come back since this server restarted"

    def _check_range(self, rank):
        if not 0 <= rank < self.num_workers:
            raise FailedPreconditionError(
                f"rank {rank} is out of range: this server expects {self._workers()}")

    def _workers(self):
        """'1 worker (rank 0)' or 'N workers (ranks 0 to N-1)'."""
        ranks = "rank 0" if self.num_workers == 1 else f"ranks 0 to {self.num_workers - 1}"
        return f"{plural(self.num_workers, 'worker')} ({ranks})"
