"""Shared-memory regions on the server: the segments that clients on this host registered on
their Session streams (the client's half is ``tensorkv.shm``).

A client proves that it created a segment, and that it runs on this host, by sending over
its own stream the random token it wrote at offset 0 of the segment. The server attaches
(maps) the segment only when it reads the same token there, zeroes the token (no replay)
and unlinks the name. A region is known only to the stream that registered it, by an id of
64 random bits, and is unmapped when that stream ends however it ends (close, error, the
client killed). Every reference is bounds-checked against the mapped size, so a client can
make the server read or write only memory that it could read and write itself.
"""
import hmac
import logging
import mmap
import os
import re
import secrets
import stat

import numpy as np

from tensorkv.codec import Placement, check_ref
from tensorkv.errors import FailedPreconditionError, InvalidArgumentError, InvalidTensorError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"tensorkv_[0-9a-f]{32}\Z")
TOKEN_BYTES = 32
# The most regions one stream may hold, and the largest region.
MAX_REGIONS = 16
MAX_REGION_BYTES = 1 << 40


def available():
    """Whether this host has POSIX shared memory under /dev/shm."""
    return os.path.isdir(SHM_DIR)


class _Attached:
    """One mapped segment: ``readable`` (read-only view, for pushed values) and ``writable``
    (for the values the server returns into it)."""

    def __init__(self, name, mapping, size):
        self.name, self.mapping, self.size = name, mapping, size
        self.writable = np.frombuffer(mapping, np.uint8)
        self.readable = self.writable.view()
        self.readable.flags.writeable = False

    def close(self):
        self.writable = self.readable = None
        try:
            self.mapping.close()
        except BufferError:  # a view is still alive (a call in flight): unmapped when it goes
            pass


def attach(name, size, token):
    """Map the segment ``name`` of ``size`` bytes if its first bytes are ``token``; then zero
    them and unlink the name. FailedPreconditionError when it cannot be attached."""
    if not _NAME.match(name):
        raise InvalidArgumentError(f"shared-memory segment name {name!r} is not 'tensorkv_' and 32 hex digits")
    if len(token) != TOKEN_BYTES:
        raise InvalidArgumentError(f"shared-memory token has {len(token)} bytes, not {TOKEN_BYTES}")
    if not TOKEN_BYTES <= size <= MAX_REGION_BYTES:
        raise InvalidArgumentError(f"shared-memory region of {size} bytes is outside [{TOKEN_BYTES}, "
                                   f"{MAX_REGION_BYTES}]")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise FailedPreconditionError(f"cannot open shared-memory segment {name} on the server's host "
                                      f"({error.strerror}): not the same host, or not the same user") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise FailedPreconditionError(f"shared-memory segment {name} is not a segment of {size} bytes")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if not hmac.compare_digest(mapping[:TOKEN_BYTES], token):
        mapping.close()
        raise FailedPreconditionError(f"shared-memory segment {name}: the token does not match; the caller "
                                      "did not prove that it created the segment")
    mapping[:TOKEN_BYTES] = bytes(TOKEN_BYTES)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return _Attached(name, mapping, size)


class Regions:
    """The regions of one Session stream, by id."""

    def __init__(self, peer):
        self.peer = peer
        self._by_id = {}

    def register(self, region):
        """Attach ``region`` (a SharedMemoryRegion message); its new id."""
        if len(self._by_id) >= MAX_REGIONS:
            raise FailedPreconditionError(f"a stream may register at most {MAX_REGIONS} shared-memory regions")
        attached = attach(region.name, region.size, region.token)
        region_id = secrets.randbits(64) or 1
        self._by_id[region_id] = attached
        log.info("shared-memory region %s (%d bytes) attached for %s", attached.name, attached.size, self.peer)
        return region_id

    def unregister(self, region_id):
        self._get(region_id).close()
        del self._by_id[region_id]

    def _get(self, region_id):
        try:
            return self._by_id[region_id]
        except KeyError:
            raise InvalidTensorError(f"shared-memory region {region_id} is not registered on this stream") from None

    def resolve(self, region_id, offset, length):
        """The read-only bytes that a pushed entry references, bounds-checked."""
        region = self._get(region_id)
        check_ref(region.size, offset, length)
        return region.readable[offset:offset + length]

    def placement(self, ref):
        """A codec.Placement over the output area ``ref`` (a SharedMemoryRef message)."""
        region = self._get(ref.region_id)
        check_ref(region.size, ref.offset, ref.length, "output area")
        return Placement(region.writable, ref.region_id, ref.offset, ref.offset + ref.length)

    def close(self):
        """Unmap every region of the stream."""
        for region in self._by_id.values():
            region.close()
        if self._by_id:
            log.info("released %d shared-memory region(s) of %s", len(self._by_id), self.peer)
        self._by_id.clear()
