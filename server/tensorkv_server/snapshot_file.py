"""The snapshot file (docs/snapshot.md): one ASCII line (the format, its version and the
SHA-256 of the payload), then the payload, a NumPy .npz archive of the header (JSON) and the
arrays. Written in one pass (:func:`encode_into`), read whole (:func:`read`) or indexed for a
reader that reads it piece by piece (:func:`index`); BadSnapshot for a file that is not whole."""
import hashlib
import json
import os
import struct
import zipfile

import numpy as np

from tensorkv.backend import BFLOAT16

FORMAT = "tensorkv-snapshot"
VERSION = 1
CHUNK = 16 << 20  # bytes read at a time to hash a file that is not whole


class BadSnapshot(Exception):
    """A snapshot file that cannot be loaded whole."""


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
    with zipfile.ZipFile(payload, "w", allowZip64=True) as archive:  # the archive np.savez writes
        for name, array in members.items():
            array = np.ascontiguousarray(_portable(array))
            with archive.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, np.lib.format.header_data_from_array_1_0(array))
                member.write(array.reshape(-1).view(np.uint8))  # no copy, unlike np.lib.format.write_array
    file.seek(0)
    file.write(_line(payload.sha256.hexdigest()))


def _portable(array):
    """bfloat16 travels as its uint16 bits (the header's dtype says so): .npz has no bfloat16."""
    return array.view(np.uint16) if array.dtype == BFLOAT16 else array


def _first_line(file):
    """(the hex SHA-256 the first line of the snapshot file ``file`` gives, the offset of the payload)."""
    line = file.readline(len(_line("0" * 64)))
    fields = line.rstrip(b"\n").split(b" ")
    if not line.endswith(b"\n") or len(fields) != 3 or fields[:2] != [FORMAT.encode(), str(VERSION).encode()]:
        raise BadSnapshot(f"not a {FORMAT} file of version {VERSION}")
    return fields[2].decode(), len(line)


def _json_header(data):
    header = json.loads(bytes(data).decode())
    if not isinstance(header, dict):
        raise BadSnapshot("malformed header (not a JSON object)")
    return header


def read(file):
    """(header, {name: array}) of the snapshot file ``file`` (binary, at its start), each
    array read straight into memory of its own; BadSnapshot if the file is not whole."""
    expected, start = _first_line(file)
    try:
        digest, arrays = _read_payload(file, start)
        header = arrays.pop("header")
    except _UNREADABLE as error:
        if _digest(file, start) != expected:
            raise BadSnapshot("checksum mismatch (truncated or corrupt)") from None
        raise BadSnapshot(f"unreadable payload ({error!r})") from None
    if digest != expected:
        raise BadSnapshot("checksum mismatch (truncated or corrupt)")
    return _json_header(header), arrays


def index(file):
    """(header, {name: (offset, dtype, shape)}) of the snapshot file ``file`` (binary, at its
    start): where the bytes of each array lie, for a reader that reads them piece by piece.
    The checksum is checked first, in one pass of CHUNK bytes at a time; BadSnapshot if the
    file is not whole."""
    expected, start = _first_line(file)
    if _digest(file, start) != expected:
        raise BadSnapshot("checksum mismatch (truncated or corrupt)")
    try:
        members = {name: (offset, dtype, shape) for offset, _, name, shape, dtype, fortran_order in _members(file)
                   if not fortran_order or len(shape) < 2}
        offset, _, shape = members.pop("header")
        file.seek(offset)
        return _json_header(_read_exactly(file, int(np.prod(shape)))), members
    except _UNREADABLE as error:
        raise BadSnapshot(f"unreadable payload ({error!r})") from None


# What a payload that is not a whole archive of .npy files raises while it is read.
_UNREADABLE = (ValueError, KeyError, EOFError, struct.error, zipfile.BadZipFile)
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _read_payload(file, start):
    """(hex SHA-256 of the payload from offset ``start`` to the end, {name: array} of its
    .npy members): one pass over the file, every array read into its own memory."""
    members = sorted(_members(file))
    sha256, position = hashlib.sha256(), start
    file.seek(start)
    arrays = {}
    for offset, nbytes, name, shape, dtype, fortran_order in members:
        if offset < position:
            raise ValueError(f"member {name!r} overlaps the one before it")
        sha256.update(_read_exactly(file, offset - position))
        data = np.empty(nbytes, np.uint8)
        _read_into(file, data)
        sha256.update(data)
        arrays[name] = data.view(dtype).reshape(shape, order="F" if fortran_order else "C")
        position = offset + data.nbytes
    sha256.update(file.read())
    return sha256.hexdigest(), arrays


def _members(file):
    """[(offset and size of the array's bytes, name, shape, dtype, fortran_order)] of the .npy
    members of the zip archive in ``file``, each checked to fill its member exactly."""
    members, end = [], file.seek(0, os.SEEK_END)
    with zipfile.ZipFile(file) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy") or info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"member {info.filename!r} is not an uncompressed .npy file")
            file.seek(info.header_offset)
            local = _read_exactly(file, 30)  # a zip local file header, then its name and extra field
            if local[:4] != b"PK\x03\x04":
                raise ValueError(f"member {info.filename!r}: no local file header")
            data = info.header_offset + 30 + sum(struct.unpack_from("<HH", local, 26))
            file.seek(data)
            read_header = _NPY_HEADERS.get(np.lib.format.read_magic(file))
            if read_header is None:
                raise ValueError(f"member {info.filename!r}: an .npy version this server does not read")
            shape, fortran_order, dtype = read_header(file)
            offset, nbytes = file.tell(), int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if dtype.hasobject or offset + nbytes != data + info.file_size or data + info.file_size > end:
                raise ValueError(f"member {info.filename!r} does not hold an array of {shape} {dtype}")
            members.append((offset, nbytes, info.filename[:-4], shape, dtype, fortran_order))
    return members


def _read_exactly(file, size):
    data = file.read(size)
    if len(data) != size:
        raise EOFError(f"{size} bytes wanted, {len(data)} left")
    return data


def _read_into(file, array):
    view, done = memoryview(array), 0
    while done < len(view):
        count = file.readinto(view[done:])
        if not count:
            raise EOFError(f"{len(view)} bytes wanted, {done} left")
        done += count


def _digest(file, start):
    """The hex SHA-256 of ``file`` from offset ``start`` to its end."""
    sha256 = hashlib.sha256()
    file.seek(start)
    while chunk := file.read(CHUNK):
        sha256.update(chunk)
    return sha256.hexdigest()
