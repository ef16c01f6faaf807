"""Shared-memory segments of a client on its server's host (the client's half of the
shared-memory path; the server's is ``tensorkv_server.shm``).

A :class:`Region` is a POSIX shared-memory segment (``multiprocessing.shared_memory``) that
this process creates with an unguessable name (``tensorkv_`` + 128 random bits, mode 0600)
and a 32-byte random token at offset 0. The client registers it on its Session stream; a
server that reads the same token there has proved that it shares this host and may use the
segment, and it unlinks the name at once (the client does too), so nothing stays in
/dev/shm after that point whatever happens to either process: the memory goes when both
mappings do. Until then ``close()``, garbage collection and ``atexit`` (a
``weakref.finalize``) unlink it, and Python's resource tracker does if this process is
killed.
"""
import os
import secrets
import weakref
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from .codec import check_ref
from .errors import InvalidTensorError

PREFIX = "tensorkv_"
TOKEN_BYTES = 32
# Smallest segment made; larger ones are powers of two, so that growth is rare.
MIN_REGION_BYTES = 1 << 20


def available():
    """Whether this platform has POSIX shared memory that a server could attach by name."""
    return os.path.isdir("/dev/shm")


def region_size(nbytes):
    """The segment size for ``nbytes``: a power of two, at least MIN_REGION_BYTES."""
    return max(MIN_REGION_BYTES, 1 << max(0, nbytes - 1).bit_length())


def _release(shm, state):
    state["buffer"] = None  # the array over the mapping goes first, so that it can be unmapped
    try:
        shm.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with it
        pass
    if state["linked"]:
        state["linked"] = False
        try:
            shm.unlink()
        except FileNotFoundError:
            resource_tracker.unregister(shm._name, "shared_memory")


class Region:
    """A segment of ``size`` bytes created by this process; ``buffer`` is a uint8 array over
    it, ``id`` the region id once a server registered it."""

    def __init__(self, size):
        self.name = PREFIX + secrets.token_hex(16)
        self.size = size
        self.id = None
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=size)
        self._state = {"linked": True, "buffer": np.frombuffer(self._shm.buf, np.uint8)}
        self._finalizer = weakref.finalize(self, _release, self._shm, self._state)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.buffer[:TOKEN_BYTES] = np.frombuffer(self.token, np.uint8)

    @property
    def buffer(self):
        """A uint8 array over the whole segment (None once closed)."""
        return self._state["buffer"]

    def unlink(self):
        """Remove the segment's name (the server has attached it, or will not): the mapping
        stays valid."""
        if self._state["linked"]:
            self._state["linked"] = False
            try:
                self._shm.unlink()
            except FileNotFoundError:  # the server unlinked it first
                resource_tracker.unregister(self._shm._name, "shared_memory")

    def resolve(self, region_id, offset, length):
        """The uint8 array of bytes [offset, offset + length) that a response references;
        InvalidTensorError for another region or outside this one."""
        if region_id != self.id:
            raise InvalidTensorError(f"the server referenced shared-memory region {region_id}, not {self.id}")
        check_ref(self.size, offset, length)
        return self.buffer[offset:offset + length]

    def close(self):
        """Unmap the segment (and unlink it if still named)."""
        self._finalizer()
