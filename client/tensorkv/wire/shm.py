"""Shared-memory regions as both ends lay them out (the worker's regions are
``tensorkv.transport.shm``, the server's checks ``tensorkv_server.shm``): a memory file sealed
against shrinking and growing, a random token in its first HEADER_BYTES, values after it at
aligned offsets, and references (region id, offset, length) that are bounds-checked before
any byte is read or written.
"""
import os

import numpy as np

from ..backend import to_host
from ..errors import InvalidTensorError
from .codec import Item, numpy_dtype, wire_dtype

# The name a region's file shows in /proc/PID/maps and /proc/PID/fd (for people and tests:
# nothing opens it by name).
PREFIX = "tensorkv_"
TOKEN_BYTES = 32
# Offsets of values in a region are multiples of this (cache lines; every dtype's alignment).
SHM_ALIGN = 64
# The token's area at the start of a region. Values go only after it: the server replaces the
# token there with random bytes that must stay unknown to anyone who cannot read the file
# (see tensorkv_server.shm).
HEADER_BYTES = SHM_ALIGN
try:  # the seals of a region: its size is fixed for good
    import fcntl
    SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
except (ImportError, AttributeError):  # not Linux: no sealed memory files, values travel over TCP
    SEALS = 0


def available():
    """Whether this platform has sealed memory files (Linux)."""
    return SEALS != 0 and hasattr(os, "memfd_create")


def aligned(nbytes):
    """``nbytes`` rounded up to SHM_ALIGN."""
    return -(-nbytes // SHM_ALIGN) * SHM_ALIGN


def check_ref(size, offset, length, what="reference"):
    """InvalidTensorError unless [offset, offset + length) lies inside a region of ``size`` bytes."""
    if offset < 0 or length < 0 or offset + length > size:
        raise InvalidTensorError(
            f"shared-memory {what} [{offset}, {offset + length}) is outside its region of {size} bytes")


class Placement:
    """Writes values into [start, end) of a shared-memory region (``buffer``, a uint8 array of
    the whole region), one after the other at aligned offsets: :meth:`put` returns the item
    that references them, or None when the value does not fit."""

    def __init__(self, buffer, region_id, start=0, end=None):
        end = len(buffer) if end is None else end
        check_ref(len(buffer), start, end - start, "area")
        self.buffer, self.region_id, self.next, self.end = buffer, region_id, start, end

    def put(self, item):
        array = item.array
        nbytes = array.nbytes
        offset = self.next
        if offset + nbytes > self.end:
            return None
        if type(array) is not np.ndarray:
            array = to_host(array)
        dtype = numpy_dtype(wire_dtype(array.dtype, item.key))  # little-endian, as on the wire
        np.copyto(self.buffer[offset:offset + nbytes].view(dtype).reshape(array.shape), array, casting="equiv")
        self.next = offset + aligned(nbytes)
        return Item(item.key, array, item.shape, item.slice, ref=(self.region_id, offset, nbytes), two_bit=item.two_bit)

    def place(self, items):
        """``items`` with those that fit moved into the region (the others, and those already
        in shared memory, unchanged)."""
        return [item if item.ref is not None else self.put(item) or item for item in items]
