"""Snapshots of a server's state in ``--state-dir``, and their restore at start.

A snapshot is taken on the event loop between two calls, so it is consistent: every value,
each key's round number and update count, the optimizer with its per-key states and update
counts, the key type, the run (number and if_exists) and the incarnation counter.
Registrations are not saved (workers register again), nor the pushes of sync rounds still
open (they are lost, as a crash loses them). The arrays are copied on the loop, into
buffers whose pages a thread has touched first (faulting in fresh pages costs this VM many
times the copy, and would hold up every call); the file is written in a thread, in one
pass from those buffers: ``NAME.part``, fsync, renamed over ``NAME``, fsync of the
directory. The two newest snapshots are kept, and the older of them is removed before the next
is written: the volume needs room for two copies of the state, and the newest whole snapshot
survives a write that fails. A snapshot of a state that did not change is not written. A
restore reads the file straight into the arrays the server keeps; a file that does not load
is set aside (renamed NAME.damaged), never removed, and when every snapshot fails to load the
server does not start unless told to start empty. The format is in docs/snapshot.md (the
file's encoding: snapshot_file).
"""
import asyncio
import contextlib
import fcntl
import logging
import os
import re
import socket
import time

import numpy as np

from tensorkv.wire import states_file
from tensorkv.backend import BFLOAT16, shape_dtype, to_host
from tensorkv.wire.codec import Item, check_key
from tensorkv.errors import KVStoreError, ResourceExhaustedError
from tensorkv.words import plural, size

from . import metrics
from .membership import Run
from .moves import Move
from . import snapshot_file
from .snapshot_file import FORMAT, VERSION, BadSnapshot

log = logging.getLogger(__name__)

_NAME = re.compile(r"snapshot-(\d{12})\.tkv")
_ASIDE = re.compile(r"snapshot-(\d{12})\.tkv\.damaged(-\d+)?")  # files that did not load, set aside
DAMAGED = ".damaged"


class NoSnapshotLoads(Exception):
    """Every snapshot in the state directory failed to load (the message names them): the
    server does not start, unless told to start empty."""


class WrongServer(Exception):
    """A snapshot of a server with another mode or worker count, or of more than this server's
    --max-memory: this server refuses to start."""


def describe(coordinator):
    """(header, [value arrays], [state arrays]) of ``coordinator``'s state: the header of a
    snapshot of it, and the stored arrays themselves (not copies) that its ``value_i`` and
    ``state_j`` would hold."""
    engine, keys, values = coordinator.engine, [], []
    state = coordinator.snapshot_state()
    for key, counters in state["keys"].items():
        stored = engine.get(key)
        keys.append({"key": key, "shape": list(stored.shape), "slice": stored.slice and list(stored.slice),
                     "dtype": str(shape_dtype(stored.array)[1]), **counters})
        values.append(stored.array)
    optimizer, state_keys, states = coordinator.optimizer, [], []
    if optimizer is not None:
        for key, (num_update, arrays) in engine.updater.get_states().items():
            state_keys.append({"key": key, "num_update": num_update, "num_states": len(arrays),
                               "dtypes": [str(shape_dtype(array)[1]) for array in arrays]})
            states.extend(arrays)
    run, move = coordinator.members.run, coordinator.move
    header = {"format": FORMAT, "version": VERSION, "mode": coordinator.mode, "num_workers": coordinator.num_workers,
              "key_type": engine.key_type and engine.key_type.__name__, "keys": keys,
              "optimizer": optimizer and states_file.optimizer_header(optimizer), "states": state_keys,
              "run": run and {"number": run.number, "if_exists": run.if_exists, "job": run.job,
                              "going": coordinator.members.run_going_on, "bigarray_bound": run.bigarray_bound},
              "next_incarnation": state["next_incarnation"],
              "sequences": coordinator.members.saved_sequences(coordinator.open_sequences()),
              "barriers_done": state["barriers_done"], "moved": move and move.to_header()}
    return header, values, states


def capture(coordinator, buffers):
    """(header, {name: NumPy array}) of ``coordinator``'s state, with copies of the arrays:
    into ``buffers[key]`` where it has the value's shape and dtype."""
    header, values, states = describe(coordinator)
    arrays = {f"value_{index}": _host_copy(value, buffers.get(entry["key"]))
              for index, (entry, value) in enumerate(zip(header["keys"], values))}
    arrays.update((f"state_{index}", _host_copy(state, None)) for index, state in enumerate(states))
    return header, arrays


def _stamp(coordinator):
    """What changes whenever the state a snapshot holds changes (compared, not written): the
    engine's count of changes to values, keys and the optimizer, and the rest of the header."""
    members, optimizer = coordinator.members, coordinator.engine.updater
    run, state = members.run, coordinator.snapshot_state(keys=False)
    return (coordinator.engine.changes, repr(getattr(optimizer, "optimizer", optimizer)),
            run and (run.number, run.if_exists), members.run_going_on, state["next_incarnation"],
            state["barriers_done"], repr(members.saved_sequences(coordinator.open_sequences())), repr(coordinator.move))


def _summary(header):
    """(number of keys, run number) of a snapshot's header."""
    return len(header["keys"]), header["run"]["number"] if header["run"] else 0


def _host_copy(value, buffer):
    """A NumPy copy of ``value``: ``buffer`` holding it when they match, else a new array."""
    if not isinstance(value, np.ndarray):
        return to_host(value)  # a copy from the GPU
    if buffer is None or (buffer.shape, buffer.dtype) != (value.shape, value.dtype):
        return value.copy()
    np.copyto(buffer, value)
    return buffer


def _buffers(values):
    """{key: an array of the shape and dtype of the NumPy array ``values[key]``, with every
    page faulted in}."""
    buffers = {}
    for key, value in values.items():
        if isinstance(value, np.ndarray):
            buffers[key] = np.empty(value.shape, value.dtype)
            buffers[key].view(np.uint8).fill(0)  # NumPy lets other threads (the loop) run meanwhile
    return buffers


def newest(directory):
    """(open file, header, index) of the newest snapshot in ``directory`` that is whole (see
    :func:`.snapshot_file.index`; the caller closes the file); NoSnapshotLoads naming each
    file that is not, or saying there is none."""
    failed = []
    for _, name in files(directory):
        path = os.path.join(directory, name)
        file = open(path, "rb")
        try:
            return file, *snapshot_file.index(file)
        except (OSError, BadSnapshot) as error:
            file.close()
            failed.append(f"{name}: {getattr(error, 'strerror', None) or error}")
    raise NoSnapshotLoads("; ".join(failed) if failed else f"no snapshot in {directory}")


def files(directory):
    """[(sequence number, file name)] of the snapshots in ``directory``, newest first."""
    names = (_NAME.fullmatch(name) for name in os.listdir(directory))
    return sorted(((int(match.group(1)), match.group(0)) for match in names if match), reverse=True)


def restore(coordinator, header, arrays):
    """Put the state of a decoded snapshot into a new ``coordinator``: all of it, or nothing
    with BadSnapshot for a header that does not describe the arrays."""
    if (header.get("mode"), header.get("num_workers")) != (coordinator.mode, coordinator.num_workers):
        raise WrongServer(f"taken by a server with --mode {header.get('mode')} "
                          f"--num-workers {header.get('num_workers')}, "
                          f"not --mode {coordinator.mode} --num-workers {coordinator.num_workers}")
    try:
        items, optimizer, states = _parse(header, arrays)
        move = Move.from_header(header.get("moved"))
        coordinator.engine.check_new(items)
    except (KeyError, TypeError, ValueError, AttributeError, KVStoreError) as error:
        raise BadSnapshot(f"malformed header ({error!r})") from None
    try:
        coordinator.check_memory(items, optimizer)
    except ResourceExhaustedError as error:
        raise WrongServer(f"{error}. With --state-dir and the values in host memory, --max-memory defaults to 40% "
                          f"of the memory (80% before 2026-11-26), since a snapshot holds a copy of every value "
                          f"while it is written: pass a --max-memory that fits this snapshot, with as much again "
                          f"free") from None
    coordinator.engine.init(items)
    metrics.stored(items)
    coordinator.restore_state({
        "keys": {item.key: {field: entry[field] for field in ("round", "updates", "initialized_in")}
                 for item, entry in zip(items, header["keys"])},
        "barriers_done": header["barriers_done"], "next_incarnation": header["next_incarnation"]})
    if optimizer is not None:
        coordinator.set_optimizer(optimizer, states)
    members = coordinator.members
    run = header["run"]
    if run is not None:
        # Snapshots written before "going" was saved: going on if a rank's sequence numbers were saved.
        members.restore_run(Run(run["number"], run["if_exists"], run.get("job", "")),
                            run.get("going", bool(header.get("sequences"))))
        members.run.bigarray_bound = run.get("bigarray_bound", 0)
        coordinator.optimizer_run = run["number"]  # the last run's, or an earlier one's: not a later run's
    members.restore_sequences(header.get("sequences", []))
    coordinator.move = move


def _parse(header, arrays):
    """([Item] of the values, optimizer or None, {key: (num_update, [Item])}) of a snapshot;
    KeyError, TypeError or ValueError if the header does not describe the arrays."""
    items = []
    for index, entry in enumerate(header["keys"]):
        array = arrays[f"value_{index}"]
        if array.dtype == np.uint16 and entry["dtype"] == "bfloat16":
            array = array.view(BFLOAT16)
        items.append(Item(check_key(entry["key"]), array, entry["shape"], entry["slice"] and tuple(entry["slice"]),
                          owned=True))  # read for the engine to keep
        for field in ("round", "updates", "initialized_in"):
            int(entry[field])
    for field in ("next_incarnation", "barriers_done"):
        int(header[field])
    for entry in header.get("sequences", []):
        int(entry["rank"]), int(entry["incarnation"]), int(entry["through"]), [int(number) for number in entry["beyond"]]
    if header["run"] is not None:
        int(header["run"]["number"]), header["run"]["if_exists"], int(header["run"].get("bigarray_bound", 0))
        if not isinstance(header["run"].get("going", False), bool):
            raise ValueError(f"run.going is {header['run']['going']!r}, not true or false")
    if header["optimizer"] is None:
        return items, None, {}
    by_key, states, index = {item.key: item for item in items}, {}, 0
    for entry in header["states"]:
        stored = by_key[check_key(entry["key"])]
        states[stored.key] = (int(entry["num_update"]), [
            Item(stored.key, arrays[f"state_{index + i}"], stored.shape, stored.slice)
            for i in range(entry["num_states"])])
        index += entry["num_states"]
    return items, states_file.optimizer_from_header(header["optimizer"]), states


class StateDirInUse(Exception):
    """Another server process holds the state directory."""


LOCK_FILE = "lock"  # in the state directory: the pid of the server that holds it


class Snapshots:
    """The snapshots of ``coordinator`` in ``directory``, which this process holds (a lock on
    its file LOCK_FILE, StateDirInUse when another process holds it): :meth:`take` writes one,
    :meth:`load` restores the newest whole one. ``start_empty_if_damaged``: when every snapshot
    fails to load, start empty (the files are set aside) rather than raise NoSnapshotLoads."""

    def __init__(self, coordinator, directory, start_empty_if_damaged=False):
        self.coordinator = coordinator
        self.directory = directory
        self.start_empty_if_damaged = start_empty_if_damaged
        self.restored_from = ""
        self.restored_round = 0  # the highest round of any key in it
        self.last_written = ""  # the file of the last snapshot written, and its time (Unix seconds)
        self.last_written_time = 0.0
        self.failures = 0  # since the server started
        self.last_error = ""  # of the last snapshot, when it failed
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError("not a directory")
        os.makedirs(directory, exist_ok=True)
        self._hold(directory)
        names = (_NAME.fullmatch(name) or _ASIDE.fullmatch(name) for name in os.listdir(directory))
        self._sequence = max((int(match.group(1)) for match in names if match), default=0)
        self._lock = asyncio.Lock()
        self._written_stamp = None  # _stamp of the state the newest snapshot holds (written or restored)
        self._summary = None  # (keys, run number) of that snapshot
        self._kept = set()  # files that did not load and could not be set aside: never removed
        metrics.SNAPSHOT_ROOM.set_function(self._room_or_nan)

    def _hold(self, directory):
        """Lock the directory for this process (for as long as it lives): two servers that
        wrote snapshots of the same numbers into one directory would replace each other's."""
        self._held = open(os.path.join(directory, LOCK_FILE), "a+")
        try:
            fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._held.seek(0)
            holder = self._held.read().strip() or "whose pid is unknown"
            self._held.close()
            raise StateDirInUse(f"another tensorkv-server ({holder}) uses this state directory; give each "
                                "server a --state-dir of its own") from None
        except OSError as error:  # a file system without locks (some NFS and FUSE mounts)
            log.warning("--state-dir %s cannot be locked (%s): no other server may use it", directory, error.strerror)
            return
        self._held.seek(0)
        self._held.truncate()
        self._held.write(f"pid {os.getpid()} on {socket.gethostname()}\n")  # pids repeat across containers
        self._held.flush()

    def load(self):
        """Restore the newest snapshot that is whole, skipping the others with a warning and
        setting aside those newer than it. NoSnapshotLoads when there are snapshots and none
        loads, unless ``start_empty_if_damaged``. Unfinished files (``.part``, of a server
        that stopped while it wrote one) are removed: they would take the room of a copy."""
        self._remove_unfinished()
        failed = []
        for _, name in files(self.directory):
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as file:
                    header, arrays = snapshot_file.read(file)
                restore(self.coordinator, header, arrays)
            except WrongServer as error:
                raise WrongServer(f"{name}: {error}") from None
            except (OSError, BadSnapshot) as error:
                failed.append((name, getattr(error, "strerror", None) or str(error)))
                continue
            self._set_aside(failed)
            self.restored_from = name
            self.restored_round = max((entry["round"] - 1 for entry in header["keys"]), default=0)
            self._written_stamp, self._summary = _stamp(self.coordinator), _summary(header)
            run = self.coordinator.members.run
            log.info("restored %s, run %d, from %s", plural(len(header["keys"]), "key"), run.number if run else 0,
                     path, extra={"event": "snapshot_restored"})
            return
        if not failed:
            log.info("no snapshot to restore in %s: the server starts empty", self.directory)
            return
        named = "; ".join(f"{name}: {why}" for name, why in failed)
        if not self.start_empty_if_damaged:
            raise NoSnapshotLoads(f"no snapshot loads ({named}); nothing was changed: move them out of the directory "
                                  "to keep them, or pass --start-empty-if-damaged to start empty (they are kept, "
                                  f"renamed NAME{DAMAGED})")
        self._set_aside(failed)
        log.warning("no snapshot loads in %s (%s): the server starts empty (--start-empty-if-damaged)",
                    self.directory, named, extra={"event": "snapshot_skipped"})

    def _remove_unfinished(self):
        for name in os.listdir(self.directory):
            if name.endswith(".part") and _NAME.fullmatch(name[:-len(".part")]):
                try:
                    os.remove(os.path.join(self.directory, name))
                except OSError as error:
                    log.warning("unfinished snapshot %s not removed: %s", name, error)
                else:
                    log.info("unfinished snapshot %s removed (its server stopped while it wrote it)", name)

    def _set_aside(self, failed):
        """Rename the snapshots ``failed`` ([(file name, why)]) that did not load to NAME.damaged
        (-N when taken): kept for a look, never loaded, counted or removed."""
        for name, why in failed:
            path = os.path.join(self.directory, name)
            aside, count = path + DAMAGED, 1
            while os.path.lexists(aside):
                count += 1
                aside = f"{path}{DAMAGED}-{count}"
            try:
                os.rename(path, aside)
            except OSError as error:
                self._kept.add(name)
                log.warning("snapshot %s skipped: %s; not set aside (%s), it is kept as it is", path, why,
                            error.strerror, extra={"event": "snapshot_skipped"})
            else:
                log.warning("snapshot %s skipped: %s; set aside as %s", path, why, os.path.basename(aside),
                            extra={"event": "snapshot_skipped"})

    def room(self):
        """Bytes the directory's volume has for snapshots: its free space and the snapshot
        files that the server replaces in turn."""
        status = os.statvfs(self.directory)
        rotated = sum(os.stat(os.path.join(self.directory, name)).st_size for _, name in files(self.directory)
                      if name not in self._kept)
        return status.f_bavail * status.f_frsize + rotated

    def _room_or_nan(self):
        try:
            return self.room()
        except OSError:  # the directory is gone, or is not one (the snapshots' failures say it)
            return float("nan")

    def room_warning(self, max_memory):
        """A warning, or None: whether the volume holds two copies (the newest snapshot, kept
        while the next is written) of the current state, and of as large a state as
        ``max_memory`` (--max-memory) lets this server hold."""
        try:
            room = self.room()
        except OSError as error:
            return f"--state-dir {self.directory}: its free space is unknown ({error.strerror})"
        newest = self.restored_from and os.path.join(self.directory, self.restored_from)
        state = os.path.getsize(newest) if newest else 0
        if 2 * state > room:
            return (f"--state-dir {self.directory} has room for {size(room)} of snapshots, less than two copies of "
                    f"the current state ({size(state)} each): the next snapshot will fail; give it at least "
                    f"{size(2 * state)}")
        if max_memory is not None and 2 * max_memory > room:
            return (f"--state-dir {self.directory} has room for {size(room)} of snapshots, less than two copies of "
                    f"what --max-memory {size(max_memory)} lets this server hold: snapshots fail once the state "
                    f"passes {size(room // 2)}; give the volume {size(2 * max_memory)}, or pass a smaller "
                    f"--max-memory")
        return None

    async def take(self):
        """(file name, number of keys, run number) of a new snapshot of the current state.
        One snapshot at a time, each holding a copy of every value until its file is written:
        one asked for meanwhile (a Snapshot call, the last one at SIGTERM) waits, and one
        cancelled while its file is written keeps its turn until the file is done. A failure
        is logged and counted here, then raised. When nothing changed since the newest
        snapshot (still in the directory, and none failed since), nothing is written or
        logged: that one's name is returned (an idle server wrote its whole state, then a
        line, every interval)."""
        async with self._lock:
            stamp = _stamp(self.coordinator)
            newest = self.last_written or self.restored_from
            if stamp == self._written_stamp and not self.last_error \
                    and os.path.isfile(os.path.join(self.directory, newest)):
                self.last_written_time = time.time()  # the newest snapshot holds the state of now
                metrics.COUNTS.last_snapshot_time = self.last_written_time
                return newest, *self._summary
            name = None
            try:
                self._sequence += 1
                name = f"snapshot-{self._sequence:012d}.tkv"
                engine = self.coordinator.engine
                buffers = await asyncio.to_thread(_buffers, {key: engine.get(key).array for key in engine.keys()})
                header, arrays = capture(self.coordinator, buffers)  # keys added or changed meanwhile: copied anew
                summary = _summary(header)
                write = asyncio.ensure_future(asyncio.to_thread(self._write, name, header, arrays, newest))
                try:
                    await asyncio.shield(write)
                except asyncio.CancelledError:
                    await asyncio.wait([write])
                    if write.exception() is not None:
                        self._failed(name, write.exception())
                    else:
                        self._written(name, stamp, summary)
                    raise
            except Exception as error:
                self._failed(name, error)
                raise
            self._written(name, stamp, summary)
        return name, *summary

    def _written(self, name, stamp, summary):
        self.last_written, self.last_written_time, self.last_error = name, time.time(), ""
        # The stamp from before the copy: a change made during it is written next time.
        self._written_stamp, self._summary = stamp, summary
        metrics.COUNTS.snapshots_written += 1
        metrics.COUNTS.last_snapshot_time = self.last_written_time
        log.info("snapshot %s written: %s, run %d", name, plural(summary[0], "key"), summary[1],
                 extra={"event": "snapshot_written"})

    def _failed(self, name, error):
        self.failures += 1
        # No path: Info shows it to any token.
        self.last_error = getattr(error, "strerror", None) or f"{type(error).__name__}: {error}"
        metrics.COUNTS.snapshots_failed += 1
        log.error("snapshot %s failed: %s; the last one written is %s", name or "(not begun)", error,
                  self.last_written or "none since the server started", extra={"event": "snapshot_failed"})

    def _write(self, name, header, arrays, newest):
        """Write snapshot ``name``, once the snapshots older than ``newest`` (the newest whole
        one, kept) are removed: room for two copies is enough."""
        self._remove_older(keep=newest)
        path = os.path.join(self.directory, name)
        try:
            with open(path + ".part", "wb") as file:
                snapshot_file.encode_into(file, header, arrays)
                file.flush()
                os.fsync(file.fileno())
            os.replace(path + ".part", path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(path + ".part")
            raise
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def _remove_older(self, keep):
        """Remove the snapshot files other than ``keep`` and those that did not load."""
        try:
            for _, old in files(self.directory):
                if old != keep and old not in self._kept:
                    os.remove(os.path.join(self.directory, old))
        except OSError as error:
            log.warning("an older snapshot was not removed: %s", error)
