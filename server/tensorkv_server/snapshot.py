"""Snapshots of a server's state in ``--state-dir``, and their restore at start.

A snapshot is taken on the event loop between two calls, so it is consistent: every value,
each key's round number and update count, the optimizer with its per-key states and update
counts, the key type, the run (number and if_exists) and the incarnation counter.
Registrations are not saved (workers register again), nor the pushes of sync rounds still
open (they are lost, as a crash loses them). The arrays are copied on the loop, into
buffers whose pages a thread has touched first (faulting in fresh pages costs this machine
many times the copy, and would hold up every call); the file is written in a thread, in one
pass: ``NAME.part``, fsync, renamed over ``NAME``, fsync of the directory. The two newest
snapshots are kept. The format is in docs/snapshot.md.
"""
import asyncio
import hashlib
import io
import json
import logging
import math
import os
import re
import zipfile

import numpy as np

from tensorkv import states_file
from tensorkv.backend import BFLOAT16, to_host
from tensorkv.codec import Item, check_key
from tensorkv.errors import KVStoreError, ResourceExhaustedError
from tensorkv.words import plural

from .membership import Run
from .rounds import _KeyRounds, _Wait

log = logging.getLogger(__name__)

FORMAT = "tensorkv-snapshot"
VERSION = 1
KEEP = 2
_LINE_MAX = 128  # bytes the first line may take
_LOCAL_HEADER = 30  # bytes of a zip member's local header before its name and extra field
_NAME = re.compile(r"snapshot-(\d{12})\.tkv")


class BadSnapshot(Exception):
    """A snapshot file that cannot be loaded whole."""


class WrongServer(Exception):
    """A snapshot of a server with another mode or worker count, or of more than this server's
    --max-memory: this server refuses to start."""


def capture(coordinator, buffers):
    """(header, {name: NumPy array}) of ``coordinator``'s state, with copies of the arrays:
    into ``buffers[key]`` where it has the value's shape and dtype."""
    engine, arrays, keys = coordinator.engine, {}, []
    for key in engine.keys():
        stored = engine.get(key)
        value, buffer = to_host(stored.array), buffers.get(key)
        if buffer is not None and (buffer.shape, buffer.dtype) == (value.shape, value.dtype):
            np.copyto(buffer, value)
            value = buffer
        else:
            value = value.copy()
        keys.append({"key": key, "shape": list(stored.shape), "slice": stored.slice and list(stored.slice),
                     "dtype": str(value.dtype),
                     "round": coordinator._rounds[key].current.number if key in coordinator._rounds else 1,
                     "updates": coordinator._updates.get(key, 0),
                     "initialized_in": coordinator._initialized_in.get(key, 0)})
        arrays[f"value_{len(keys) - 1}"] = value
    optimizer, states = coordinator.optimizer_states()
    state_keys, count = [], 0
    for key, (num_update, items) in states.items():
        state_keys.append({"key": key, "num_update": num_update, "num_states": len(items)})
        for item in items:
            arrays[f"state_{count}"] = item.array
            count += 1
    run = coordinator.members.run
    header = {"format": FORMAT, "version": VERSION, "mode": coordinator.mode, "num_workers": coordinator.num_workers,
              "key_type": engine._key_type and engine._key_type.__name__, "keys": keys,
              "optimizer": optimizer and states_file.optimizer_header(optimizer), "states": state_keys,
              "run": run and {"number": run.number, "if_exists": run.if_exists},
              "next_incarnation": coordinator.members._next_incarnation,
              "sequences": coordinator.members.saved_sequences(coordinator.open_sequences()),
              "barriers_done": coordinator._barriers_done}
    return header, arrays


def _buffers(values):
    """{key: an array of the shape and dtype of the NumPy array ``values[key]``, with every
    page faulted in}."""
    buffers = {}
    for key, value in values.items():
        if isinstance(value, np.ndarray):
            buffers[key] = np.empty(value.shape, value.dtype)
            buffers[key].view(np.uint8).fill(0)  # NumPy lets other threads (the loop) run meanwhile
    return buffers


class _Hashing:
    """A write-only file that hashes what goes through it. Having no tell(), it makes
    zipfile write the archive in one pass, with no seek back over hashed bytes."""

    def __init__(self, file):
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data):
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self):
        self.file.flush()


def _line(digest):
    return f"{FORMAT} {VERSION} {digest}\n".encode()


def encode_into(file, header, arrays):
    """Write a snapshot file to ``file`` (seekable, at its start): one ASCII line
    ``tensorkv-snapshot 1 SHA256\\n``, then the payload, a NumPy .npz archive whose "header"
    is the UTF-8 JSON ``header``. The line is written last, once the payload is hashed."""
    file.write(_line("0" * 64))
    payload = _Hashing(file)
    members = {"header": np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays}
    with zipfile.ZipFile(payload, "w", allowZip64=True) as archive:  # what np.savez writes
        for name, array in members.items():
            with archive.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, _portable(array), allow_pickle=False)
    file.seek(0)
    file.write(_line(payload.sha256.hexdigest()))


def _portable(array):
    """bfloat16 travels as its uint16 bits (the header's dtype says so): .npz has no bfloat16."""
    return array.view(np.uint16) if array.dtype == BFLOAT16 else array


def read(path):
    """(header, {name: array}) of the snapshot file at ``path``, read into one buffer whose
    views the arrays are; BadSnapshot if it is not whole."""
    with open(path, "rb") as file:
        data = np.empty(os.fstat(file.fileno()).st_size, np.uint8)
        if file.readinto(memoryview(data)) != data.size:
            raise BadSnapshot("the file changed while it was read")
    return decode(data)


def decode(data):
    """(header, {name: array}) of a snapshot file's bytes (a uint8 array: the arrays are views
    of it); BadSnapshot if it is not whole."""
    newline = bytes(data[:_LINE_MAX]).find(b"\n")
    fields = bytes(data[:max(newline, 0)]).split(b" ")
    if newline < 0 or len(fields) != 3 or fields[0] != FORMAT.encode() or fields[1] != str(VERSION).encode():
        raise BadSnapshot(f"not a {FORMAT} file of version {VERSION}")
    payload = data[newline + 1:]
    if hashlib.sha256(memoryview(payload)).hexdigest().encode() != fields[2]:
        raise BadSnapshot("checksum mismatch (truncated or corrupt)")
    try:
        arrays = _members(payload)
        header = json.loads(bytes(arrays.pop("header")).decode())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise BadSnapshot(f"unreadable payload ({error})") from None
    if not isinstance(header, dict):
        raise BadSnapshot("malformed header (not a JSON object)")
    return header, arrays


def _members(payload):
    """{name: array} of the .npy members of the .npz archive ``payload`` (uint8), views of it:
    np.load would copy each member out, through zipfile's reads."""
    arrays = {}
    with zipfile.ZipFile(_Reader(payload)) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                raise ValueError(f"member {info.filename!r} is not a stored .npy file")
            local = bytes(payload[info.header_offset:info.header_offset + _LOCAL_HEADER])
            if len(local) != _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
                raise ValueError(f"member {info.filename!r} has no local header")
            name_bytes, extra_bytes = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
            start = info.header_offset + _LOCAL_HEADER + name_bytes + extra_bytes
            member = payload[start:start + info.file_size]
            npy = _Reader(member)
            version = np.lib.format.read_magic(npy)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ValueError(f"member {info.filename!r}: .npy version {version}")
            shape, fortran_order, dtype = read_header[version](npy)
            if dtype.hasobject:
                raise ValueError(f"member {info.filename!r} holds Python objects")
            body = member[npy.tell():]
            nbytes = math.prod(shape) * dtype.itemsize
            if body.size != nbytes:
                raise ValueError(f"member {info.filename!r}: {body.size} bytes for shape {shape} of {dtype}")
            arrays[info.filename[:-4]] = body.view(dtype).reshape(shape, order="F" if fortran_order else "C")
    return arrays


class _Reader:
    """A read-only, seekable file over a uint8 array, without copying it (io.BytesIO would)."""

    def __init__(self, data):
        self._data, self._pos = data, 0

    def read(self, size=-1):
        end = self._data.size if size is None or size < 0 else min(self._pos + size, self._data.size)
        chunk = bytes(self._data[self._pos:end])
        self._pos = end
        return chunk

    def seek(self, offset, whence=io.SEEK_SET):
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._data.size}[whence] + offset
        return self._pos

    def tell(self):
        return self._pos

    def seekable(self):
        return True


def restore(coordinator, header, arrays):
    """Put the state of a decoded snapshot into a new ``coordinator``: all of it, or nothing
    with BadSnapshot for a header that does not describe the arrays."""
    if (header.get("mode"), header.get("num_workers")) != (coordinator.mode, coordinator.num_workers):
        raise WrongServer(f"taken by a server with --mode {header.get('mode')} "
                          f"--num-workers {header.get('num_workers')}, "
                          f"not --mode {coordinator.mode} --num-workers {coordinator.num_workers}")
    try:
        items, optimizer, states = _parse(header, arrays)
        coordinator.engine.check_new(items)
    except (KeyError, TypeError, ValueError, AttributeError, KVStoreError) as error:
        raise BadSnapshot(f"malformed header ({error!r})") from None
    try:
        coordinator.check_memory(items, optimizer)
    except ResourceExhaustedError as error:
        raise WrongServer(str(error)) from None
    coordinator.engine.init(items)
    for item, entry in zip(items, header["keys"]):
        coordinator._rounds[item.key] = rounds = _KeyRounds()
        rounds.current = _Wait(entry["round"])
        coordinator._updates[item.key] = entry["updates"]
        coordinator._initialized_in[item.key] = entry["initialized_in"]
    if optimizer is not None:
        coordinator.set_optimizer(optimizer, states)
    members = coordinator.members
    if header["run"] is not None:
        members.run = Run(header["run"]["number"], header["run"]["if_exists"])
    members._next_incarnation = max(members._next_incarnation, header["next_incarnation"])
    members.restore_sequences(header.get("sequences", []))
    coordinator._barriers_done = header["barriers_done"]


def _parse(header, arrays):
    """([Item] of the values, optimizer or None, {key: (num_update, [Item])}) of a snapshot;
    KeyError, TypeError or ValueError if the header does not describe the arrays."""
    items = []
    for index, entry in enumerate(header["keys"]):
        array = arrays[f"value_{index}"]
        if array.dtype == np.uint16 and entry["dtype"] == "bfloat16":
            array = array.view(BFLOAT16)
        items.append(Item(check_key(entry["key"]), array, entry["shape"], entry["slice"] and tuple(entry["slice"])))
        for field in ("round", "updates", "initialized_in"):
            int(entry[field])
    for field in ("next_incarnation", "barriers_done"):
        int(header[field])
    for entry in header.get("sequences", []):
        int(entry["rank"]), int(entry["incarnation"]), int(entry["through"]), [int(number) for number in entry["beyond"]]
    if header["run"] is not None:
        int(header["run"]["number"]), header["run"]["if_exists"]
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


class Snapshots:
    """The snapshots of ``coordinator`` in ``directory``: :meth:`take` writes one,
    :meth:`load` restores the newest whole one."""

    def __init__(self, coordinator, directory):
        self.coordinator = coordinator
        self.directory = directory
        self.restored_from = ""
        self.restored_round = 0  # the highest round of any key in it
        os.makedirs(directory, exist_ok=True)
        self._sequence = max((number for number, _ in self._files()), default=0)
        self._lock = asyncio.Lock()

    def _files(self):
        """[(sequence number, file name)] of the snapshots in the directory, newest first."""
        names = (_NAME.fullmatch(name) for name in os.listdir(self.directory))
        return sorted(((int(match.group(1)), match.group(0)) for match in names if match), reverse=True)

    def load(self):
        """Restore the newest snapshot that is whole, skipping the others with a warning."""
        for _, name in self._files():
            path = os.path.join(self.directory, name)
            try:
                header, arrays = read(path)
                restore(self.coordinator, header, arrays)
            except WrongServer as error:
                raise WrongServer(f"{name}: {error}") from None
            except (OSError, BadSnapshot) as error:
                log.warning("snapshot %s skipped: %s", path, error, extra={"event": "snapshot_skipped"})
                continue
            self.restored_from = name
            self.restored_round = max((entry["round"] - 1 for entry in header["keys"]), default=0)
            run = self.coordinator.members.run
            log.info("restored %s, run %d, from %s", plural(len(header["keys"]), "key"), run.number if run else 0,
                     path, extra={"event": "snapshot_restored"})
            return

    async def take(self):
        """(file name, number of keys, run number) of a new snapshot of the current state."""
        engine = self.coordinator.engine
        buffers = await asyncio.to_thread(_buffers, {key: engine.get(key).array for key in engine.keys()})
        header, arrays = capture(self.coordinator, buffers)  # keys added or changed meanwhile are copied anew
        self._sequence += 1
        name = f"snapshot-{self._sequence:012d}.tkv"
        async with self._lock:
            await asyncio.to_thread(self._write, name, header, arrays)
        run = header["run"]["number"] if header["run"] else 0
        log.info("snapshot %s written: %s, run %d", name, plural(len(header["keys"]), "key"), run,
                 extra={"event": "snapshot_written"})
        return name, len(header["keys"]), run

    def _write(self, name, header, arrays):
        path = os.path.join(self.directory, name)
        with open(path + ".part", "wb") as file:
            encode_into(file, header, arrays)
            file.flush()
            os.fsync(file.fileno())
        os.replace(path + ".part", path)
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        for _, old in self._files()[KEEP:]:
            os.remove(os.path.join(self.directory, old))
