"""One tensorkv server as a worker's store sees it: :class:`ServerConn`, its channel and
stub, this worker's registration there, reconnecting after a broken connection or a restart,
and one thin method per call: on the Session stream by the route tensorkv.transport.routes chooses
(the values in shared memory, on the data channel, packed or in the messages) when the call
fits it, else a plain RPC.

A ``part`` is the list [(position, Item)] of the values of one call that go to this server
(a key, or its slice); for a pull, [(position, key)]. ``outs`` are the caller's out arrays
by position: a pulled value goes straight into ``outs[position][0]`` where that is a NumPy
array of its dtype and shape.
"""
import collections
import itertools
import logging
import math
import secrets
import threading
import time

import grpc
import numpy as np
from google.protobuf import message

from ..errors import (
    DeadlineExceededError, FailedPreconditionError, InvalidArgumentError, KVStoreError, RoundAbortedError,
    ServerUnavailableError, ShapeMismatchError, key_repr,
)
from ..v1 import kvstore_pb2
from ..wire import rowsparse_wire, states_wire
from ..wire.codec import Item, encode_stream, set_key
from ..wire.grpc_options import CHANNEL_OPTIONS
from ..wire.status import connection_lost, error_from_rpc
from . import routes, shm
from .replay import PushLog, pushed_items
from .routes import Call, Thresholds
from .rpc import Stub
from .session import Session

# Earlier incarnations a registration names (RegisterRequest.earlier_incarnations): as many as a server reads.
MAX_EARLIER_INCARNATIONS = 16
# A push of at most this many bytes (per server) may be sent without waiting for its answer (its
# request, which holds the values, is kept until the answer comes: replay.PushLog).
DEFER_MAX_BYTES = 1 << 20
# Seconds before a call is made again after a broken connection: doubled each time, up to RETRY_MAX.
RETRY_FIRST = 0.05
RETRY_MAX = 1.0
log = logging.getLogger(__name__)


class ServerConn:
    """The server at ``address``, reached with ``security``, with the settings of ``config`` (a
    resolved tensorkv.ClientConfig): every call is bounded by its ``timeout`` seconds,
    reconnecting included; its ``session`` says whether small calls use a Session stream.

    A call whose connection breaks, or that the server answers UNAVAILABLE, is made again
    on a new connection after this worker registered again (:meth:`_reconnect`), with a
    backoff from RETRY_FIRST to RETRY_MAX seconds, until its timeout has passed; then it
    raises ServerUnavailableError saying what happened to the call first and why
    reconnecting failed. Every call that changes values carries a sequence number that
    stays the same when it is sent again, so the server applies it once (PushRequest.sequence);
    every pull carries one too, so that a round's abort is not lost with the answer that
    reported it (PullRequest.pull_sequence).

    A server that restarted (its Info.server_id changed) lost this worker's registration and
    the rounds since its snapshot: this worker registers afresh, logs one warning, and, where
    the server writes snapshots (Info.snapshots), sends again, each with the sequence number
    it had, its last push (dense or row-sparse) of every key whose round it saw complete (a
    pull of the key answered after it) and the pushes to it since: the restored server skips
    those its snapshot holds and applies the others. So the workers' pushes line up in its
    rounds: one whose next push was in (waiting for the others) sends the last completed one
    and that one, and one that saw the same round complete sends that round's, into the same
    round. (Where it realigns, a worker keeps copies of those pushes: one per key, two while
    a push waits for its pull.) Still a push apart: a kill in the moment a round completes,
    when one worker has its answer while another's was lost with the server, and the snapshot
    does not hold the round before it (KNOWN GAP: what closes it is the round of each push on
    the wire, so that the server can place every push sent again)."""

    def __init__(self, address, config, security):
        self.address = address
        self.timeout = config.timeout
        self.job = config.job  # RegisterRequest.job of every registration
        self.bigarray_bound = config.bigarray_bound  # RegisterRequest.bigarray_bound of every registration
        self._security = security
        self._uses_session = config.session
        self._thresholds = Thresholds.of(config)  # read once, for the calls: they pick a call's route
        self._chunk_bytes = config.chunk_bytes
        self._connect()
        self.rank = None
        self.incarnation = None  # of this worker's registration here; None while not registered
        # The incarnations it held here before, oldest first (RegisterRequest.earlier_incarnations).
        self._earlier = collections.deque(maxlen=MAX_EARLIER_INCARNATIONS)
        self.lease_ttl = 0.0  # seconds; 0: a server without leases
        self.lease_lost = None  # why the server no longer renews the lease (set by lease.Heartbeat)
        self.server_id = None  # Info.server_id when this worker registered
        self._if_exists = kvstore_pb2.IF_EXISTS_FAIL
        self._request_id = _request_id()  # of the next registration, kept while it is sent again
        self._transport = "auto"
        self._sequences = itertools.count(1)
        self._issued = 0  # the last sequence number given to a call
        self._pull_sequences = itertools.count(1)  # numbered apart: see PullRequest.pull_sequence
        self._lock = threading.Lock()  # one reconnect at a time
        self._log = PushLog(address)  # the pushes to send again (see the class docstring)
        self._pushes_kept = self._log.kept  # the same dict, of the copies kept per key
        self._layouts = routes.Layouts(config.pack_min_values, self._thresholds.datachan_min_bytes)

    def _connect(self):
        """A new channel, stub and Session stream (its shared-memory region and data channel
        are negotiated again by the first call that needs them)."""
        self.channel = self._security.channel(self.address, CHANNEL_OPTIONS)
        self.stub = Stub(self.channel)
        self.session = Session(self.channel, self.address, data_tls=self._security.data_channel_context(),
                               thresholds=self._thresholds) if self._uses_session else None

    # ---- registration -----------------------------------------------------------------

    def info(self, timeout):
        """The InfoResponse, asked again while the connection is reset, until ``timeout`` has
        passed; a refused connection fails at once (:meth:`_through_resets`)."""
        return self._through_resets("info", self.stub.Info, kvstore_pb2.InfoRequest(), timeout)

    def offer(self, info, transport):
        """Let calls use what the server offers (``info``) and ``transport`` allows: shared
        memory, then the data channel, tried lazily by the first call that moves enough bytes
        (the proof of the same host happens then: tensorkv.transport.shm)."""
        self._transport = transport
        self._session_barrier = True  # until the server says it has no SESSION_OP_BARRIER
        # A copy of each push is kept for a restart only where one can restore rounds to line up.
        self._log.realign = info.mode == kvstore_pb2.MODE_SYNC and info.num_workers > 1 and info.snapshots
        if self.session is not None:
            self.session.shm_allowed = transport == "auto" and shm.available() and info.shared_memory
            self.session.gpu_server = info.device.startswith("cuda")
            self.session.data_port = info.data_port if transport != "grpc" else 0
            self.session.calls_on_channel = self.session.data_port > 0

    def register(self, rank, if_exists, server_id, previous=None, timeout=None):
        """Join the job as ``rank`` (None: the server assigns one) on the server whose Info
        said ``server_id``, in the place of the registration ``previous`` (see
        RegisterRequest.previous_incarnation); the RegisterResponse. A connection reset is
        tried again (:meth:`_through_resets`), with the same RegisterRequest.request_id until
        the registration is answered, so that the server makes it once."""
        request = kvstore_pb2.RegisterRequest(rank=rank, if_exists=if_exists, previous_incarnation=previous,
                                              request_id=self._request_id, job=self.job,
                                              bigarray_bound=self.bigarray_bound,
                                              earlier_incarnations=self._earlier if previous is not None else ())
        response = self._through_resets("register", self.stub.Register, request,
                                        self.timeout if timeout is None else timeout)
        self._request_id = _request_id()
        if previous is None:
            self._earlier.clear()
        elif response.incarnation != previous:
            self._earlier.append(previous)
        self.rank, self.incarnation = response.rank, response.incarnation
        self.lease_ttl = response.lease_ttl_ms / 1000
        self.lease_lost = None
        self.server_id, self._if_exists = server_id, if_exists
        return response

    def unregister(self, timeout):
        """Give the rank back (best effort: a server that is gone or slow to answer is left
        as it is)."""
        if self.incarnation is None:
            return
        try:
            self.settle()
        except KVStoreError as error:  # the store is closing: nothing is left to raise it
            log.warning("server %s: %s", self.address, error)
        try:
            self.stub.Unregister(kvstore_pb2.UnregisterRequest(**self._caller()), timeout=timeout)
        except grpc.RpcError as error:
            log.info("server %s: rank %d not given back: %s", self.address, self.rank, error.code())
        self.incarnation = None

    def _caller(self):
        """The fields that say who calls: this worker's rank and incarnation."""
        return dict(rank=self.rank, incarnation=self.incarnation)

    # ---- reconnecting -----------------------------------------------------------------

    def _call(self, kind, attempt, *args):
        """``attempt(seconds left, *args)`` of a ``kind`` call, made again on a new connection
        while it fails with ServerUnavailableError, or with FailedPreconditionError from a
        server that restarted, until this call's timeout has passed. The error raised then
        says what happened to the call first, and why reconnecting failed."""
        deadline = time.monotonic() + self.timeout
        delay, reconnect, first = RETRY_FIRST, False, None
        while True:
            try:
                if reconnect:
                    self._reconnect(deadline)
                if self.lease_lost is not None:
                    raise FailedPreconditionError(self.lease_lost)
                if self._log.unacked and not (self.session is not None and self.session.unread):
                    self._push_again(deadline, restarted=False)  # their answers were lost with a session reset
                return attempt(_left(deadline), *args)
            except ServerUnavailableError as error:
                first = first or error
                if time.monotonic() + delay >= deadline:
                    if error is first:
                        raise
                    raise ServerUnavailableError(f"{first}; reconnecting for {self.timeout:g} s (the {kind}'s "
                                                 f"timeout) failed: {error}") from None
                log.info("server %s: %s; connecting again in %g s", self.address, error, delay)
                time.sleep(delay)
                delay, reconnect = min(2 * delay, RETRY_MAX), True
            except FailedPreconditionError:
                if reconnect or self.info(_left(deadline)).server_id == self.server_id:
                    raise
                reconnect = True

    @property
    def realigns(self):
        """Whether this worker keeps copies of its pushes to send again after this server
        restarts (sync mode, several workers, snapshots): then a pull of a key must reach
        every server of its slices, to tell each that its rounds ended (PushLog.seen_complete)."""
        return self._log.realign

    def _reconnect(self, deadline):
        """Open a new connection and register again under this worker's rank: in the place of
        its registration when the server still holds it, else afresh (the server restarted)."""
        with self._lock:
            old_channel, old_session = self.channel, self.session
            self._connect()
            if old_session is not None:
                old_session.close()
            old_channel.close()
            info = self.info(_left(deadline))
            restarted = info.server_id != self.server_id
            if_exists = self._if_exists
            if restarted and if_exists == kvstore_pb2.IF_EXISTS_REPLACE:
                if_exists = kvstore_pb2.IF_EXISTS_RESUME  # what it restored is this run's
            try:
                self.register(self.rank, if_exists, info.server_id, self.incarnation, _left(deadline))
            except FailedPreconditionError as error:
                why = "it restarted" if restarted else "the connection broke"
                raise FailedPreconditionError(
                    f"server {self.address}: registering rank {self.rank} again ({why}) was refused: {error}") from None
            self.offer(info, self._transport)
            if restarted:
                if info.restored_from:
                    log.warning("server %s restarted and restored round %d from %s: rank %d registered again and "
                                "goes on from there (what was applied after that snapshot, if anything, is lost)",
                                self.address, info.restored_round, info.restored_from, self.rank)
                else:
                    log.warning("server %s restarted without a snapshot (no --state-dir, or none written yet): "
                                "rank %d registered again; every key it held is lost", self.address, self.rank)
            self._push_again(deadline, restarted)

    def _push_again(self, deadline, restarted):
        """Send again the pushes sent without waiting whose answers did not come, and after a
        restart the pushes kept of each key (PushLog.keep), each with the sequence number it
        had: the server skips a push it applied (after a restart, one its snapshot holds:
        RegisterRequest.previous_incarnation) and applies the others."""
        for sequence, values in self._log.to_send_again(restarted):
            try:
                if isinstance(values[0], Item):
                    self._push_once(_left(deadline), Call("push", list(enumerate(values)), sequence=sequence))
                else:
                    self._row_sparse_push_once(_left(deadline), values, sequence)
            except (ServerUnavailableError, DeadlineExceededError):
                raise  # still to send again, by the next attempt or call
            except KVStoreError as error:
                if not self._log.waits_for(sequence):
                    raise
                raise self._log.failed(sequence, [item.key for item in values], error) from None
            self._log.answered(sequence)

    # ---- the data path ----------------------------------------------------------------

    def init(self, part, wait_only):
        self._call("init", self._init_once, Call("init", part, wait_only=wait_only, sequence=self._next_sequence()))

    def _init_once(self, timeout, call):
        if self._session(call, timeout) is None:
            items = [item for _, item in call.part]
            self._rpc("init", self.stub.init_raw, self._frames(kvstore_pb2.InitRequest, items, wait_only=call.wait_only,
                                                               sequence=call.sequence), timeout)

    def push(self, part, defer=False, undo=None):
        """Push ``part``. With ``defer`` (the caller checked every key against what it knows of it),
        a push of DEFER_MAX_BYTES at most whose values travel in its request, or are its own
        (``Item.owned``: 2-bit codes), on a session whose calls go on the data channel is sent
        without waiting for the server's answer (one round trip less for a push then a pull): an
        error that only the server can see (a round aborted, a lease lost) is then raised by the
        next call to this server, naming the push, and the push changed nothing; ``undo`` is run
        first, to put back what the caller changed for it. Until the answer comes, the request
        (or the push's own Items) is kept to send again on a new connection (replay.PushLog)."""
        call = Call("push", part, sequence=self._next_sequence(), undo=undo)
        if defer and sum(item.array.nbytes for _, item in part) <= DEFER_MAX_BYTES:
            call.log = self._log
        self._call("push", self._push_once, call)
        self._log.keep(self._log.copies(part), call.sequence)

    def _next_sequence(self):
        self._issued = next(self._sequences)
        return self._issued

    def _pull_call(self, keys, kind, attempt, *args):
        """``self._call(kind, attempt, *args)`` of a pull of ``keys``, whose answer says how the
        rounds of this worker's pushes to them ended: complete (PushLog.seen_complete), or
        aborted (RoundAbortedError: the server discarded the last of them)."""
        issued = self._issued
        try:
            result = self._call(kind, attempt, *args)
        except RoundAbortedError:
            self._log.discarded(keys, issued)
            raise
        self._log.seen_complete(keys, issued)
        return result

    def settle(self):
        """Wait for the answers of the pushes sent without waiting; raise the first one's error."""
        if self._log.unacked and self.session is not None:
            self._call("push", lambda timeout: self.session.settle())

    def _push_once(self, timeout, call):
        if self._session(call, timeout) is None:
            items = [item for _, item in call.part]
            self._rpc("push", self.stub.push_raw, self._frames(kvstore_pb2.PushRequest, items, sequence=call.sequence),
                      timeout)

    def pushpull(self, part, outs):
        """The items pulled back after pushing ``part``."""
        call = Call("pushpull", part, outs=outs, sequence=self._next_sequence())
        copies = self._log.copies(part)  # before the pull writes into arrays that may be the pushed ones
        items = self._call("pushpull", self._pushpull_once, call)
        self._log.keep(copies, call.sequence)
        self._log.seen_complete([key for key, _ in copies], call.sequence)
        return items

    def _pushpull_once(self, timeout, call):
        items = self._session(call, timeout)
        if items is None:
            part, outs = call.part, call.outs
            request = self._frames(kvstore_pb2.PushPullRequest, [item for _, item in part], sequence=call.sequence)
            items = self._rpc("pushpull", lambda r, timeout: decode(
                kvstore_pb2.PushPullResponse, self.stub.pushpull_raw(r, timeout=timeout), part, outs), request, timeout)
        return items

    def pull(self, part, outs, sizes, shapes=None, pulled=None):
        """The items of the keys of ``part``; ``sizes``: their bytes when all are known, else None;
        ``shapes``: [(shape, dtype)] of their values when each is known and whole on this server;
        ``pulled``: [(full shape, dtype, slice or None)] of what this server holds of each, when
        all are known."""
        keys = [key for _, key in part]
        call = Call("pull", part, outs=outs, keys=keys, sizes=sizes, shapes=shapes, pulled=pulled,
                    pull_sequence=next(self._pull_sequences))
        return self._pull_call(keys, "pull", self._pull_once, call)

    def _pull_once(self, timeout, call):
        items = self._session(call, timeout)
        if items is None:
            part, outs = call.part, call.outs
            request = kvstore_pb2.PullRequest(pull_sequence=call.pull_sequence, **self._caller())
            for key in call.keys:
                set_key(request.keys.add(), key)
            items = self._rpc("pull", lambda r, timeout: decode(
                kvstore_pb2.PullResponse, self.stub.pull_raw(r, timeout=timeout), part, outs), request, timeout)
        return items

    def push_packed(self, layout, values):
        """Push the values of ``layout``, packed in ``values`` (bytes), of keys the caller knows
        (a fused list, tensorkv.stores.fusion): sent without waiting as :meth:`push` is, when it has
        DEFER_MAX_BYTES at most."""
        call = Call("push", values=values, sequence=self._next_sequence())
        if layout.nbytes <= DEFER_MAX_BYTES:
            call.log = self._log
        self._call("push", self._push_packed_once, layout, call)
        if self._log.realign:  # views of ``values``, which nothing changes
            self._log.keep([(item.key, item) for item in pushed_items((layout, values))], call.sequence)

    def _push_packed_once(self, timeout, layout, call):
        if self._session(call, timeout, layout) is None:
            self._push_once(timeout, Call("push", list(enumerate(pushed_items((layout, call.values)))),
                                          sequence=call.sequence, log=call.log))

    def pull_packed(self, layout, targets):
        """Pull the values of ``layout`` into ``targets``, writable C-contiguous NumPy arrays of its
        shapes and dtype, in its order (a fused list, tensorkv.stores.fusion)."""
        call = Call("pull", targets=targets, pull_sequence=next(self._pull_sequences))
        self._pull_call(layout.keys, "pull", self._pull_packed_once, layout, call)

    def _pull_packed_once(self, timeout, layout, call):
        if self._session(call, timeout, layout) is not None:
            return
        targets = call.targets
        sizes = [math.prod(shape) * layout.dtype.itemsize for shape in layout.shapes]
        items = self._pull_once(timeout, Call(
            "pull", list(enumerate(layout.keys)), outs=[[target] for target in targets], keys=list(layout.keys),
            sizes=sizes, shapes=[(shape, layout.dtype) for shape in layout.shapes], pull_sequence=call.pull_sequence))
        for item, target in zip(items, targets):
            if item.array is target:
                continue
            if item.array.shape != target.shape or item.array.dtype != target.dtype:
                raise ShapeMismatchError(
                    f"key {key_repr(item.key)}: server {self.address} holds shape {tuple(item.array.shape)} and dtype "
                    f"{item.array.dtype}, where this worker knew {target.shape} and {target.dtype}")
            np.copyto(target, item.array)

    def row_sparse_push(self, values):
        """RowSparsePush of ``values`` [(key, full shape, row ids, rows)] (rows only, in plain messages)."""
        sequence = self._next_sequence()
        self._call("push", self._row_sparse_push_once, values, sequence)
        if self._log.realign:
            self._log.keep([(key, (key, shape, row_ids.copy(), rows.copy())) for key, shape, row_ids, rows in values],
                       sequence)

    def _row_sparse_push_once(self, timeout, values, sequence):
        request = kvstore_pb2.RowSparsePushRequest(sequence=sequence, **self._caller())
        for key, shape, row_ids, rows in values:
            rowsparse_wire.set_value(request.values.add(), key, shape, row_ids, rows)
        self._rpc("push", self.stub.RowSparsePush, request, timeout)

    def row_sparse_pull(self, part, sizes, outs):
        """The rows (NumPy arrays) of each (key, row ids) of ``part``, in order; ``sizes``: their
        bytes; ``outs``: as for :meth:`pull`, by index into ``part``. On the Session stream
        (large rows on its data channel) when the call fits it, else a RowSparsePull."""
        return self._pull_call([key for key, _ in part], "row_sparse_pull", self._row_sparse_pull_once, part, sizes,
                               outs, next(self._pull_sequences))

    def _row_sparse_pull_once(self, timeout, part, sizes, outs, pull_sequence):
        items = [(position, Item(key, row_ids)) for position, (key, row_ids) in enumerate(part)]
        pulled = self._session(Call("row_sparse_pull", items, outs=outs, sizes=sizes, pull_sequence=pull_sequence),
                               timeout)
        if pulled is not None:
            return [item.array for item in pulled]
        values = self._row_sparse_values(timeout, part, pull_sequence).values
        return [rowsparse_wire.get_value(value)[3] for value in values]

    def row_sparse_shapes(self, keys):
        """{key: (full shape, dtype)} of ``keys``, from a RowSparsePull of none of their rows."""
        response = self._call("row_sparse_pull", self._row_sparse_values, [(key, ()) for key in keys])
        return {key: (shape, rows.dtype) for key, shape, _, rows in map(rowsparse_wire.get_value, response.values)}

    def _row_sparse_values(self, timeout, part, pull_sequence=0):
        request = kvstore_pb2.RowSparsePullRequest(pull_sequence=pull_sequence, **self._caller())
        for key, row_ids in part:
            rowsparse_wire.set_row_ids(request.keys.add(), key, row_ids)
        return self._rpc("row_sparse_pull", self.stub.RowSparsePull, request, timeout)

    # ---- the rest ---------------------------------------------------------------------

    def set_updater(self, optimizer, key_states, kind):
        """Install ``optimizer`` with this server's ``key_states``; ``kind`` names the call in errors."""
        messages = states_wire.to_messages(kvstore_pb2.SetUpdaterRequest, optimizer, key_states, self._chunk_bytes)
        response = self._call(kind, self._unary_once, kind, "SetUpdater", list(messages))
        sent = len(optimizer.lr_mult) + len(optimizer.wd_mult)
        if response.multipliers != sent:
            raise FailedPreconditionError(
                f"server {self.address} installed {optimizer.name!r} with {response.multipliers} of its {sent} per-key "
                "multipliers (set_lr_mult, set_wd_mult): it is older than them; upgrade it, or set the optimizer "
                "without multipliers")

    def set_learning_rate(self, learning_rate):
        request = kvstore_pb2.SetLearningRateRequest(learning_rate=learning_rate)
        self._call("set_learning_rate", self._unary_once, "set_learning_rate", "SetLearningRate", request)

    def optimizer_states(self):
        """(optimizer or None, {key: (num_update, [Item])}) of this server."""
        return states_wire.from_messages(self._call("save_optimizer_states", self._unary_once, "save_optimizer_states",
                                                    "GetOptimizerStates", kvstore_pb2.GetOptimizerStatesRequest()))

    def barrier(self):
        self._call("barrier", self._barrier_once)

    def _barrier_once(self, timeout):
        if self._session_barrier:
            try:
                if self._session(Call("barrier"), timeout) is not None:
                    return
            except InvalidArgumentError as error:
                if "unknown session op" not in str(error):
                    raise
                self._session_barrier = False  # a server from before SESSION_OP_BARRIER: it entered nothing
        self._rpc("barrier", self.stub.Barrier, kvstore_pb2.BarrierRequest(**self._caller()), timeout)

    def _unary_once(self, timeout, kind, method, request):
        """The answer of the stub's ``method`` to ``request`` (a list of messages for a stream
        of them, sent whole by each attempt); a stream of answers as a list."""
        if isinstance(request, list):
            request = iter(request)
        return self._rpc(kind, lambda r, timeout: _whole(getattr(self.stub, method)(r, timeout=timeout)), request,
                         timeout)

    def close(self):
        if self.session is not None:
            self.session.close()
        self.channel.close()

    # ---- transports -------------------------------------------------------------------

    def _rpc(self, kind, method, request, timeout=None):
        """``method(request, timeout=...)``, with gRPC errors raised as KVStoreError; ``kind``
        names the call in them ('push', 'pull', ...: see status.transport_error). The answers of
        pushes sent without waiting are read first: the RPC must not overtake them."""
        if self.session is not None and self.session.unread:
            self.session.settle()
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as error:
            raise error_from_rpc(error, self.address, kind) from None

    def _through_resets(self, kind, method, request, timeout):
        """:meth:`_rpc`, made again after RETRY_FIRST to RETRY_MAX seconds while its connection
        is reset (the server, or something between, accepted it and tore it down:
        status.connection_lost, where the server does not refuse this client's credentials) until
        ``timeout`` has passed; a refused connection (nothing listens) and every other error
        are raised at once. Only for calls that may be made twice."""
        deadline = time.monotonic() + timeout
        delay = RETRY_FIRST
        while True:
            try:
                return method(request, timeout=_left(deadline))
            except grpc.RpcError as error:
                again = time.monotonic() + delay < deadline and connection_lost(error)
                if not again or self._security.diagnose(self.address) is not None:
                    raise error_from_rpc(error, self.address, kind) from None
                log.info("server %s: the connection was reset during the %s; trying again in %g s",
                         self.address, kind, delay)
            time.sleep(delay)
            delay = min(2 * delay, RETRY_MAX)

    def _frames(self, message_type, items, **fields):
        """The serialized request messages that carry ``items``."""
        return encode_stream(message_type, items, dict(self._caller(), **fields), self._chunk_bytes,
                             with_data=not fields.get("wait_only", False))

    def _session(self, call, timeout, layout=None):
        """Make ``call`` (a routes.Call) on the Session stream, by the route routes.choose picks:
        what its answer gives (the items pulled); None when it is not for a session (too large
        without shared memory or a data channel, sessions off, or the session busy with another
        thread's call), for the caller to make a plain RPC. A list that packs (pack_min_values;
        a pull's ``call.shapes``; or a fused list's ``layout``) moves as one buffer, when the
        stream takes it."""
        session = self.session
        if session is None:
            return None
        call.caller = self._caller()
        if layout is None and call.kind in routes.PACKED_KINDS:
            layout = self._layouts.of_call(session, call)
        route = routes.choose(session, call, layout)
        result = None if route is None else session.call(route, call, timeout)
        if result is None and layout is not None and call.part:  # not packed on this stream: as entries
            route = routes.choose(session, call)
            result = None if route is None else session.call(route, call, timeout)
        return result

    def packed_layout(self, keys, shapes):
        """The packed.Layout of ``keys`` whose whole values have ``shapes`` [(shape, dtype)] when
        they pack on this server's session (routes.Layouts.of); else None."""
        return self._layouts.of(self.session, keys, shapes)


def _request_id():
    """A new RegisterRequest.request_id: random, never 0."""
    return secrets.randbits(63) + 1


def _left(deadline):
    """The seconds until ``deadline`` (time.monotonic()), at least a millisecond."""
    return max(deadline - time.monotonic(), 0.001)


def _whole(answer):
    """``answer``, or the list of the answers of a stream."""
    return answer if isinstance(answer, message.Message) else list(answer)


def decode(message_type, responses, part=None, outs=None):
    """The items of a stream of serialized responses. The values of ``part`` [(position,
    Item or key)] go straight into their ``outs[position][0]`` where that is a NumPy array
    of the right dtype and shape (the others are decoded into new arrays)."""
    decoder = routes.make_decoder(message_type, part, outs)
    for data in responses:
        decoder.feed(data)
    items = decoder.finish()
    decoder.remember()
    return items
