"""glibc's malloc, tuned for the large, short-lived buffers of tensor streams.

Every message of a stream (1 MiB chunks) is a fresh buffer in gRPC and in Python. With
glibc's defaults such a buffer is a new mmap whose pages fault in and are zeroed, then
unmapped: the kernel's page clearing, not the copies, bounds large transfers (see
docs/transport.md). Tuned, allocations up to 32 MiB (the most glibc allows) come from the
heap and freed memory stays mapped up to a bound instead of going back to the kernel.

Past 32 MiB every allocation is a fresh mapping all the same: a server receiving values of
that size call after call takes its receive buffers from :class:`Buffers`, which hands a
buffer out again once nothing refers to it.

The server owns its process: it re-execs itself once with ``GLIBC_TUNABLES`` (glibc reads
tunables only at start), which also caps its arenas. A client cannot restart its user's
process, so a dist store sets the two thresholds with ``mallopt(3)`` when it is created,
with a smaller bound on retained memory (per malloc arena). Both leave alone a ``GLIBC_TUNABLES`` the user
set, and ``TENSORKV_NO_MALLOC_TUNING=1`` turns both off.
"""
import ctypes
import logging
import os
import platform
import sys

from .. import env

MMAP_THRESHOLD = 32 << 20
REUSE_MIN_BYTES = MMAP_THRESHOLD  # Buffers keeps those of this size or more
SERVER_TRIM_THRESHOLD = 1 << 30
CLIENT_TRIM_THRESHOLD = 256 << 20  # enough to keep a 64 MiB tensor's buffers (measured)
SERVER_TUNABLES = (f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:"
                   f"glibc.malloc.trim_threshold={SERVER_TRIM_THRESHOLD}:glibc.malloc.arena_max=2")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
_tuned = False
log = logging.getLogger(__name__)


def wanted():
    """Whether to tune: glibc's Linux, no GLIBC_TUNABLES of the user's, and not turned off."""
    if os.environ.get("GLIBC_TUNABLES") is not None:
        return False
    if env.flag("TENSORKV_NO_MALLOC_TUNING"):
        return False
    return _on_glibc()


def _on_glibc():
    return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def reexec_with_tunables():
    """Re-exec this process once with GLIBC_TUNABLES=SERVER_TUNABLES (same PID, same command
    line), when :func:`wanted`. For a server's ``main``, before anything else."""
    if not wanted() or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(os.environ, GLIBC_TUNABLES=SERVER_TUNABLES))


def tune_this_process(enabled=None):
    """Set glibc's mmap and trim thresholds in this running process (once), when ``enabled`` (a
    worker's ClientConfig.malloc_tuning, which reads the variables; None: :func:`wanted`) and
    on glibc's Linux."""
    global _tuned
    if _tuned or not (wanted() if enabled is None else enabled and _on_glibc()):
        return
    _tuned = True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, CLIENT_TRIM_THRESHOLD):
        log.debug("malloc tuned: mmap_threshold=%d trim_threshold=%d", MMAP_THRESHOLD, CLIENT_TRIM_THRESHOLD)


class Buffers:
    """Receive buffers (uint8 arrays) of REUSE_MIN_BYTES or more, kept once made and handed
    out again once nothing refers to them: no array, view or memoryview of one is alive
    (CPython's reference count says so), so a stored value, a value being sent or written to
    a snapshot keeps its buffer from being handed out. The buffers kept, in use or idle,
    take ``max_bytes`` at most: idle ones, the first made first, make room for a new one,
    and a buffer there is no room for is not kept (it is freed once released). Smaller
    buffers are new ones. Each is made by ``allocate`` (``np.empty`` by default; a GPU
    server's are pinned). For one thread (a server's event loop).

    >>> buffers = Buffers(1 << 30)
    >>> first = buffers.empty(REUSE_MIN_BYTES)
    >>> held = first[:10]            # a view keeps it
    >>> buffers.empty(REUSE_MIN_BYTES) is first
    False
    >>> del first, held
    >>> len(buffers._kept), buffers.empty(REUSE_MIN_BYTES) is buffers._kept[0]
    (2, True)
    """

    def __init__(self, max_bytes, allocate=None):
        self.max_bytes = max_bytes
        self._allocate = allocate  # nbytes -> a new uint8 array (None: np.empty), e.g. pinned memory
        self._kept = []

    def _new(self, nbytes):
        if self._allocate is not None:
            return self._allocate(nbytes)
        import numpy as np  # not at the top: a server re-execs itself before it needs NumPy
        return np.empty(nbytes, np.uint8)

    def empty(self, nbytes):
        """A uint8 array of ``nbytes`` bytes, its contents undefined."""
        if nbytes < REUSE_MIN_BYTES:
            return self._new(nbytes)
        kept = self._kept
        # Idle: the list's reference and getrefcount's argument are the only ones.
        idle = [i for i in range(len(kept)) if sys.getrefcount(kept[i]) == 2]
        for i in idle:
            if kept[i].nbytes == nbytes:
                return kept[i]
        total = sum(buffer.nbytes for buffer in kept) + nbytes
        dropped = set()
        for i in idle:  # the first made go first
            if total <= self.max_bytes:
                break
            total -= kept[i].nbytes
            dropped.add(i)
        self._kept = [kept[i] for i in range(len(kept)) if i not in dropped]
        buffer = self._new(nbytes)
        if total <= self.max_bytes:
            self._kept.append(buffer)
        return buffer
