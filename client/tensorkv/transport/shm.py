"""Shared-memory regions of a client on its server's host (the client's half of the
shared-memory path; the server's is ``tensorkv_server.shm``, the layout both keep
``tensorkv.wire.shm``).

A :class:`Region` is a memory file (``memfd_create``) that this process creates, sizes,
and seals against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``)
before anything maps it: its size can never change again, so no process's mapping of it
can fault (SIGBUS) past its end, whatever any process does to the file. Its first
HEADER_BYTES hold a 32-byte random token; values go after them. The client registers it on
its Session stream with its pid and the descriptor's number: a server that can open
``/proc/<pid>/fd/<fd>`` (the same host, user and pid namespace) and reads the same token
there has proved that it shares this host, and maps the file. The file has no name in any
directory: the memory goes when the last descriptor and mapping of it do, whichever
process holds them and however it ends.
"""
import logging
import mmap
import os
import secrets
import weakref

import numpy as np

from ..errors import InvalidTensorError
# available: whether this process can make regions (server_conn asks before it offers them)
from ..wire.shm import HEADER_BYTES, PREFIX, SEALS, TOKEN_BYTES, available, check_ref  # noqa: F401

log = logging.getLogger(__name__)

try:
    import fcntl
except ImportError:  # not POSIX: no regions are made here (tensorkv.wire.shm.available())
    pass
# Smallest area for values made; larger ones are powers of two, so that growth is rare.
MIN_REGION_BYTES = 1 << 20


def capacity_for(nbytes):
    """The area for values to make for ``nbytes``: a power of two, at least MIN_REGION_BYTES."""
    return max(MIN_REGION_BYTES, 1 << max(0, nbytes - 1).bit_length())


def _release(fd, mapping, state):
    unpin = state.pop("unpin", None)
    if unpin is not None:
        try:
            unpin()
        except Exception as error:  # noqa: BLE001 (CUDA is shutting down: the mapping goes anyway)
            log.debug("a region's pinned memory was not unregistered: %s", error)
    state["buffer"] = None  # the array over the mapping goes first, so that it can be unmapped
    try:
        mapping.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with it
        pass
    os.close(fd)


class Region:
    """A sealed memory file with ``capacity`` bytes for values after its header, created by
    this process: ``size`` bytes in all, ``fd`` its descriptor here, ``buffer`` a uint8 array
    over all of it, ``id`` the region id once a server registered it; ``pinned`` once both
    this process and the server registered it as pinned memory (:meth:`pin`)."""

    def __init__(self, capacity):
        self.name = PREFIX + secrets.token_hex(16)
        self.size = HEADER_BYTES + capacity
        self.id = None
        self.pinned = False
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            os.pwrite(self.fd, self.token, 0)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            mapping = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self._state = {"buffer": np.frombuffer(mapping, np.uint8)}
        self._finalizer = weakref.finalize(self, _release, self.fd, mapping, self._state)

    @property
    def buffer(self):
        """A uint8 array over the whole region (None once closed)."""
        return self._state["buffer"]

    @property
    def capacity(self):
        """Bytes for values, from HEADER_BYTES on."""
        return self.size - HEADER_BYTES

    def pin(self, register):
        """Register the mapping as pinned memory with ``register(buffer)``, which returns the
        function that unregisters it: called as the region closes, before it is unmapped."""
        self._state["unpin"] = register(self.buffer)

    def unpin(self):
        """Unregister what :meth:`pin` registered."""
        unpin = self._state.pop("unpin", None)
        if unpin is not None:
            unpin()
        self.pinned = False

    def resolve(self, region_id, offset, length):
        """The uint8 array of bytes [offset, offset + length) that a response references;
        InvalidTensorError for another region or outside this one."""
        if region_id != self.id:
            raise InvalidTensorError(f"the server referenced shared-memory region {region_id}, not {self.id}")
        check_ref(self.size, offset, length)
        return self.buffer[offset:offset + length]

    def close(self):
        """Unmap the region and close its descriptor (the memory goes once the server's
        mapping does too)."""
        self._finalizer()
