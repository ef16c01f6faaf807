"""The server's side of ``tensorkv reshard`` (MaintenanceService's DescribeRun, ReadRanges,
DigestRanges, ImportRun and MarkMove): a run moves in the encoding of a snapshot, its header
(:func:`.snapshot.describe`) then its arrays, and an import ends in :func:`.snapshot.restore`,
as a restart from a snapshot does.

Everything here runs on the event loop. A source is frozen (moves.Move) before it is read, so
every range read or hashed is of one state; a read or an import that sees its move replaced
meanwhile (a reset, another import, a mark given up) fails rather than mix two states.
"""
import asyncio
import hashlib
import json
import logging
import math

import numpy as np

from tensorkv.wire import codec
from tensorkv.backend import BFLOAT16, shape_dtype, to_host
from tensorkv.errors import FailedPreconditionError, InternalError, InvalidArgumentError, ResourceExhaustedError, \
    key_repr
from tensorkv.v1 import kvstore_pb2, maintenance_pb2
from tensorkv.words import plural, size

from . import snapshot
from .snapshot_file import BadSnapshot
from .moves import SOURCE, TARGET, Move

log = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # of the header per DescribeRunResponse, and of data per ReadRangesResponse
_ROLES = {SOURCE: kvstore_pb2.MOVE_ROLE_SOURCE, TARGET: kvstore_pb2.MOVE_ROLE_TARGET}
_ROLE_NAMES = {number: name for name, number in _ROLES.items()}


def move_message(move):
    """The RunMove of ``move`` (None: none)."""
    if move is None:
        return None
    return kvstore_pb2.RunMove(role=_ROLES[move.role], servers=move.servers, done=move.done)


def header_pieces(coordinator):
    """The bytes of the header of a snapshot of ``coordinator``'s state, in pieces."""
    data = json.dumps(snapshot.describe(coordinator)[0]).encode()
    return [data[start:start + PIECE_BYTES] for start in range(0, len(data), PIECE_BYTES)]


# ---- reading ------------------------------------------------------------------------

def _check_frozen(coordinator, move=None):
    """FailedPreconditionError unless ``coordinator``'s run is frozen for a move (by ``move``,
    when given: the one that was when the call began)."""
    current = coordinator.move
    if move is not None and current is not move:
        raise FailedPreconditionError("the server's move mark changed during this call (a reset, another import, or "
                                      "a move given up): what it read may be of two states; start again")
    if current is None or not current.frozen:
        raise FailedPreconditionError("ranges are read only while the run is frozen for a move (MarkMove: a source, "
                                      "or a target not yet committed), so that they are all of one state")


def _ranges(coordinator, ranges, max_key_bytes):
    """[(flat array, first, stop)] of the ElementRange messages ``ranges``: the elements
    first:stop of the flattened stored array (value or state) each names."""
    _check_frozen(coordinator)
    engine = coordinator.engine
    states = engine.updater.get_states() if coordinator.optimizer is not None else {}
    found = []
    for entry in ranges:
        key = codec.check_key(codec.get_key(entry.key))
        codec.check_key_bytes(key, max_key_bytes)
        stored = engine.get(key)
        arrays = [stored.array, *states.get(key, (0, []))[1]]
        if entry.array >= len(arrays):
            raise InvalidArgumentError(f"key {key_repr(key)}: no array {entry.array}: it has a value and "
                                       f"{plural(len(arrays) - 1, 'optimizer state')}")
        begin, end = stored.slice or (0, math.prod(stored.shape))
        if not begin <= entry.elements.begin <= entry.elements.end <= end:
            raise InvalidArgumentError(f"key {key_repr(key)}: elements [{entry.elements.begin}, {entry.elements.end}) "
                                       f"are not within [{begin}, {end}), which this server holds")
        found.append((arrays[entry.array].reshape(-1), entry.elements.begin - begin, entry.elements.end - begin))
    return found


def _pieces(flat, first, stop):
    """The bytes of ``flat[first:stop]`` on the host, PIECE_BYTES at most at a time (views of
    a NumPy array)."""
    step = max(1, PIECE_BYTES // shape_dtype(flat)[1].itemsize)
    for start in range(first, stop, step):
        yield to_host(flat[start:min(stop, start + step)]).view(np.uint8)


async def read_ranges(coordinator, request, max_key_bytes):
    """The ReadRangesResponse messages of ``request``."""
    found = _ranges(coordinator, request.ranges, max_key_bytes)
    move, engine = coordinator.move, coordinator.engine
    for flat, first, stop in found:
        pieces = _pieces(flat, first, stop)
        while True:
            with engine.on_device():  # not across a yield: other calls set the device meanwhile
                piece = next(pieces, None)
                data = None if piece is None else piece.tobytes()
            if data is None:
                break
            _check_frozen(coordinator, move)
            yield maintenance_pb2.ReadRangesResponse(data=data)


async def digest_ranges(coordinator, request, max_key_bytes):
    """The DigestRangesResponse of ``request``: hashed in a thread, the loop serving meanwhile
    (the run is frozen: nothing changes the arrays)."""
    found = _ranges(coordinator, request.ranges, max_key_bytes)
    move = coordinator.move
    digests = await asyncio.to_thread(_digests, coordinator.engine, found)
    _check_frozen(coordinator, move)
    return maintenance_pb2.DigestRangesResponse(sha256=digests)


def _digests(engine, found):
    with engine.on_device():
        digests = []
        for flat, first, stop in found:
            sha256 = hashlib.sha256()
            for piece in _pieces(flat, first, stop):
                sha256.update(piece)
            digests.append(sha256.digest())
        return digests


# ---- importing ----------------------------------------------------------------------

def begin_import(coordinator, sources, force):
    """Make ``coordinator`` an empty target of a move from ``sources``; refused while a rank is
    registered, and (unless ``force``) when it holds something other than an earlier import
    from the same sources."""
    members, move = coordinator.members, coordinator.move
    if members.running:
        raise FailedPreconditionError(_workers_hold_ranks(coordinator))
    again = move is not None and move.role == TARGET and not move.done and move.servers == sources
    if not again and not force:
        held = []
        if len(coordinator.engine):
            held.append(plural(len(coordinator.engine), "key"))
        if coordinator.optimizer is not None:
            held.append(f"optimizer {coordinator.optimizer.name!r}")
        if members.run_going_on:
            held.append(f"run {members.run.number}, whose workers may come back")
        if move is not None:
            held.append(f"a run {move.words()}")
        if held:
            raise FailedPreconditionError(
                f"this server holds {', '.join(held)}: a move goes to empty servers; pass --force to drop what it "
                "holds (`tensorkv reshard --force`)")
    coordinator.reset(force=True)
    coordinator.move = Move(TARGET, sources)
    log.info("import of a run from %s begins", ",".join(sources), extra={"event": "import_started"})


class _Receiver:
    """An ImportRun stream's bytes: the header, then the arrays it announces, one after the
    other, each written into an array of its own as its bytes come. ``begin(header, nbytes)``
    is called once the header is whole (``nbytes``: of the arrays it announces)."""

    def __init__(self, header_size, begin):
        self.header_size, self.begin = header_size, begin
        self.header_bytes, self.header = bytearray(), None
        self.arrays = {}
        self._layout = None  # iterator of (name, dtype, shape) of the arrays still to come
        self._current = None  # (uint8 view of the array being filled, bytes filled)

    def feed(self, data):
        view = memoryview(data)
        while view:
            if self.header is None:
                take = self.header_size - len(self.header_bytes)
                self.header_bytes += view[:take]
                view = view[take:]
                if len(self.header_bytes) == self.header_size:
                    self._start()
                continue
            if self._current is None and not self._next():
                raise InvalidArgumentError(f"the stream carries {len(view)} bytes more than the run its header "
                                           "announces")
            target, filled = self._current
            take = min(len(view), target.size - filled)
            target[filled:filled + take] = view[:take]
            view = view[take:]
            self._current = (target, filled + take) if filled + take < target.size else None

    def _start(self):
        try:
            header = json.loads(bytes(self.header_bytes).decode())
            layout = list(_layout(header))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise InvalidArgumentError(f"malformed header ({error!r})") from None
        self.begin(header, sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in layout))
        self.header, self._layout = header, iter(layout)

    def _next(self):
        """Begin the next array of a nonzero size (arrays of no elements are made on the way);
        False when there is none."""
        for name, dtype, shape in self._layout:
            array = self.arrays[name] = np.empty(shape, dtype)
            if array.size:
                self._current = (array.reshape(-1).view(np.uint8), 0)
                return True
        return False

    def finish(self):
        """(header, {name: array}) once every byte came; InvalidArgumentError if some did not."""
        if self.header is None:
            raise InvalidArgumentError(f"the stream ended within its header ({len(self.header_bytes)} of "
                                       f"{self.header_size} bytes)")
        if self._current is not None or self._next():
            raise InvalidArgumentError("the stream ended before the last array its header announces")
        return self.header, self.arrays


def _check_fits(coordinator, header, nbytes):
    """FailedPreconditionError for a run of another mode or worker count than ``coordinator``'s,
    ResourceExhaustedError for one of more than its --max-memory (``nbytes`` of arrays)."""
    if (header.get("mode"), header.get("num_workers")) != (coordinator.mode, coordinator.num_workers):
        raise FailedPreconditionError(
            f"the run comes from servers with --mode {header.get('mode')} --num-workers {header.get('num_workers')}; "
            f"this server has --mode {coordinator.mode} --num-workers {coordinator.num_workers}: start the new "
            "servers as the old ones")
    if coordinator.max_memory is not None and nbytes > coordinator.max_memory:
        raise ResourceExhaustedError(f"the run holds {size(nbytes)} of values and optimizer states; this server's "
                                     f"--max-memory is {size(coordinator.max_memory)}")


def _dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _layout(header):
    """(name, dtype, shape) of each array an import stream carries, in its order: key after
    key, the value (``value_i``), then its states (``state_j``, numbered in the order of the
    header's "states")."""
    first_state, position = {}, 0
    for entry in header["states"]:
        first_state[codec.check_key(entry["key"])] = (position, entry)
        position += int(entry["num_states"])
    for index, entry in enumerate(header["keys"]):
        shape = tuple(int(n) for n in entry["shape"])
        if entry["slice"] is not None:
            begin, end = (int(n) for n in entry["slice"])
            if not 0 <= begin <= end <= math.prod(shape):
                raise ValueError(f"key {key_repr(entry['key'])}: slice {entry['slice']} of shape {shape}")
            shape = (end - begin,)
        yield f"value_{index}", _dtype(entry["dtype"]), shape
        position, states = first_state.pop(codec.check_key(entry["key"]), (0, {"dtypes": []}))
        for offset, name in enumerate(states["dtypes"]):
            yield f"state_{position + offset}", _dtype(name), shape
    if first_state:
        raise ValueError(f"states of keys the header does not hold: {list(first_state)[:3]}")


async def import_run(coordinator, requests):
    """Import the run of the ImportRunRequest stream ``requests``; the ImportRunResponse. The
    server becomes a target once the header is whole and fits, and stays one should the stream
    end early."""
    first = await anext(requests, None)
    if first is None or not first.sources:
        raise InvalidArgumentError("an ImportRun stream begins with a message naming its sources")
    moves = []  # the move this import began

    def begin(header, nbytes):
        _check_fits(coordinator, header, nbytes)
        begin_import(coordinator, list(first.sources), first.force)
        moves.append(coordinator.move)

    receiver = _Receiver(first.header_size, begin)
    receiver.feed(first.data)
    async for request in requests:
        _check_ours(coordinator, moves)
        receiver.feed(request.data)
    header, arrays = receiver.finish()
    _check_ours(coordinator, moves)
    move = moves[0]
    header["moved"] = move.to_header()  # this import's, whatever the header says
    try:
        snapshot.restore(coordinator, header, arrays)
    except BadSnapshot as error:
        raise InvalidArgumentError(str(error)) from None
    except snapshot.WrongServer as error:
        raise FailedPreconditionError(str(error)) from None
    nbytes = sum(array.nbytes for array in arrays.values())
    log.info("imported %s (%s) from %s", plural(len(header["keys"]), "key"), size(nbytes), ",".join(move.servers),
             extra={"event": "import_done"})
    return maintenance_pb2.ImportRunResponse(num_keys=len(header["keys"]), num_bytes=nbytes)


def _check_ours(coordinator, moves):
    if moves and coordinator.move is not moves[0]:
        raise FailedPreconditionError("another import, or a reset, replaced this one")


# ---- marks --------------------------------------------------------------------------

def _workers_hold_ranks(coordinator):
    members = coordinator.members
    job = f" (job {members.run.job!r})" if members.run.job else ""
    return (f"workers hold ranks {members.ranks} of run {members.run.number}{job} here: stop the job's workers first "
            f"(close their stores, or end their processes; a worker that ended without closing its store holds "
            f"its rank until its lease expires, --lease-timeout {members.lease_timeout:g} s after it was last heard "
            "from); `tensorkv workers` lists them")


def mark(coordinator, role, servers, done, force):
    """Record the step of a move that MarkMoveRequest names (see maintenance.proto)."""
    move = coordinator.move
    same = move is not None and move.role == role and move.servers == servers
    if role is None:
        # A source whose move is done may have workers on the targets; a target not committed
        # holds part of a run: either, unmarked, would serve workers a state they must not see.
        if move is not None and not force and move.done == (move.role == SOURCE):
            why = "its workers may go on on those servers" if move.done else "this server holds part of it"
            raise FailedPreconditionError(f"this server's run is {move.words()} and {why}: its mark stays; a reset "
                                          "(`tensorkv reset --force`) drops it with the run here")
        coordinator.move = None
    elif role == SOURCE and not done:
        if coordinator.members.running:
            raise FailedPreconditionError(_workers_hold_ranks(coordinator))
        if not same and move is not None and move.frozen and not force:
            raise FailedPreconditionError(f"this server's run is {move.words()}, not to {','.join(servers)}: complete "
                                          "that move (run its `tensorkv reshard` again), or force this one")
        if not same:
            coordinator.move = Move(SOURCE, servers)
    elif done:
        if not same:
            now = move.words() if move is not None else "part of no move"
            raise FailedPreconditionError(f"this server's run is {now}, not {Move(role, servers).words()}")
        move.done = True
    else:
        raise InvalidArgumentError("ImportRun makes a server a target; MarkMove only commits it (done)")
    log.info("move mark: %s", coordinator.move.words() if coordinator.move else "none",
             extra={"event": "move_marked"})


async def mark_move(coordinator, snapshots, request):
    """The MarkMoveResponse of ``request``, once a snapshot holds the mark (with --state-dir)."""
    move = request.move
    mark(coordinator, _ROLE_NAMES.get(move.role), list(move.servers), move.done, request.force)
    if snapshots is None:
        return maintenance_pb2.MarkMoveResponse()
    try:
        name, _, _ = await snapshots.take()
    except OSError as error:
        raise InternalError(f"the mark is made, but the snapshot that would keep it across a restart failed: "
                            f"{error.strerror or error} (the server's log names the file)") from None
    return maintenance_pb2.MarkMoveResponse(snapshot=name)
