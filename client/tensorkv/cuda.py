"""The CUDA side of a worker's Session routes (tensorkv.transport.routes and gpu_routes): its
shared-memory region registered as pinned memory (:func:`pin`), copies between pinned host
memory and GPU values queued on the values' own streams (:class:`Copies`), a session's small
pinned buffer and the copies still running out of it (:class:`Gpu`), and the CUDA IPC handles
of the process's device allocations (:class:`Exports`).

Only where CuPy sees a CUDA device (:func:`cupy_module`). Every CUDA call goes through CuPy's
runtime module, except the lookup of the allocation a pointer lies in, which asks the driver
(cuPointerGetAttribute, through ctypes): CuPy's memory pool and torch's caching allocator
hand out pieces of larger allocations, and CUDA IPC shares whole allocations.
"""
import collections
import ctypes
import functools
import logging
import mmap
import threading

import numpy as np

from . import backend
from .wire.shm import aligned

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming
# CUpointer_attribute values of cuPointerGetAttribute
BUFFER_ID, RANGE_START_ADDR, RANGE_SIZE = 7, 11, 12
IPC_HANDLE_BYTES = 64  # a cudaIpcMemHandle_t
# The allocations whose IPC handles the process keeps (the oldest is forgotten first).
MAX_EXPORTS = 4096
# The CUDA events a session keeps (one per stream its copies ran on) before it reuses the oldest.
MAX_EVENTS = 64
# The smallest staging buffer a session makes; larger ones are powers of two.
MIN_STAGING_BYTES = 64 << 10


@functools.cache
def cupy_module():
    """The cupy module where it sees a CUDA device, else None (asked once)."""
    return backend.cupy_or_none()


def pin(cupy, buffer):
    """Register the host memory of ``buffer`` (a uint8 array over a mapping, which covers
    whole pages) as pinned memory; the function that unregisters it. CUDARuntimeError when the
    driver refuses (e.g. a locked-memory limit)."""
    ptr = buffer.ctypes.data
    size = -(-buffer.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    cupy.cuda.runtime.hostRegister(ptr, size, HOST_REGISTER_PORTABLE)
    return functools.partial(cupy.cuda.runtime.hostUnregister, ptr)


@functools.cache
def _pointer_get_attribute():
    function = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
    function.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)
    function.restype = ctypes.c_int
    return function


def pointer_attribute(ptr, attribute):
    """The driver's ``attribute`` (a CUpointer_attribute) of device pointer ``ptr``, or None
    when the driver does not tell (its error code)."""
    value = ctypes.c_uint64(0)  # every attribute asked here fits, little-endian, in 8 zeroed bytes
    if _pointer_get_attribute()(ctypes.byref(value), attribute, ptr):
        return None
    return value.value


def device_bytes(cupy, memory, owner):
    """A CuPy uint8 array over ``memory`` (a DeviceMemory), which ``owner`` keeps alive."""
    unowned = cupy.cuda.UnownedMemory(memory.ptr, memory.nbytes, owner, memory.device)
    return cupy.ndarray((memory.nbytes,), np.uint8, cupy.cuda.MemoryPointer(unowned, 0))


class Copies:
    """The copies of one call between pinned host memory and GPU values, each queued on its
    value's stream (DeviceMemory.stream), after the work that wrote it and before the work
    that reads it; ``streams`` {(stream, device)} also holds those of GPU values that the
    server reads or writes itself (CUDA IPC), which the call must wait for before it goes.
    A stream is named with its device: each device's default stream is 0."""

    def __init__(self, gpu):
        self.gpu = gpu
        self.streams = set()

    def to_host(self, memory, ptr):
        """Copy the GPU bytes ``memory`` (a DeviceMemory) to pinned host memory at ``ptr``,
        after the pending copies of earlier calls, which may still read it (Gpu.after_pending)."""
        self._copy(memory, ptr, memory.ptr, self.gpu.cupy.cuda.runtime.memcpyDeviceToHost)

    def to_device(self, ptr, memory):
        """Copy ``memory.nbytes`` bytes of pinned host memory at ``ptr`` into ``memory``."""
        self._copy(memory, memory.ptr, ptr, self.gpu.cupy.cuda.runtime.memcpyHostToDevice)

    def order(self, memory):
        """Have the call wait for the work queued on ``memory`` before it goes."""
        self.streams.add((memory.stream, memory.device))

    def _copy(self, memory, dst, src, kind):
        runtime, stream = self.gpu.cupy.cuda.runtime, (memory.stream, memory.device)
        with self.gpu.cupy.cuda.Device(memory.device):
            if kind == runtime.memcpyDeviceToHost:
                self.gpu.after_pending(stream)
            runtime.memcpyAsync(dst, src, memory.nbytes, kind, memory.stream)
        self.streams.add(stream)


class Gpu:
    """A session's CUDA state: a pinned host buffer for the GPU values that travel through
    the host (small ones, and every one where no region is pinned), reused call after call,
    and the copies of the last call still running out of it or out of the region into the
    caller's GPU arrays (``pending``: an event recorded after them on each (stream, device),
    made once per stream). Each call waits once at most: :meth:`wait` before its request goes.
    Until then, a copy that writes the buffer or the region waits on the GPU for the pending
    ones on other streams (:meth:`after_pending`); the CPU waits for them (:meth:`settle`)
    before it writes there."""

    def __init__(self, cupy):
        self.cupy = cupy
        self._buffer = None  # the pinned uint8 array
        self._next = 0  # the first free byte of it in this call
        self._events = {}  # (stream, device) -> its cudaEvent_t, reused (MAX_EVENTS at most, about)
        self.pending = set()  # (stream, device) of copies recorded and not waited for

    def copies(self):
        return Copies(self)

    def reserve(self, nbytes):
        """Start a call that stages up to ``nbytes`` (with alignment) in the buffer, grown to
        fit (once the copies still reading the buffer it replaces are done)."""
        self._next = 0
        if nbytes and (self._buffer is None or len(self._buffer) < nbytes):
            self.settle()
            import cupyx
            self._buffer = cupyx.empty_pinned(max(MIN_STAGING_BYTES, 1 << max(0, nbytes - 1).bit_length()), np.uint8)

    def take(self, nbytes):
        """(a uint8 view of the next ``nbytes`` of the buffer, its address), within what
        :meth:`reserve` made room for."""
        start = self._next
        self._next = start + aligned(nbytes)
        view = self._buffer[start:start + nbytes]
        return view, view.ctypes.data

    def after_pending(self, stream):
        """Have ``stream`` ((stream, device), with that device current) run its next work
        after the pending copies on other streams, which may read the host memory it writes."""
        for other in self.pending:
            if other != stream:
                self.cupy.cuda.runtime.streamWaitEvent(stream[0], self._events[other], 0)

    def wait(self, copies):
        """Wait for the streams of ``copies`` (one synchronize each: they are usually one),
        then for what is still pending on other streams."""
        runtime = self.cupy.cuda.runtime
        for stream, device in copies.streams:
            with self.cupy.cuda.Device(device):
                runtime.streamSynchronize(stream)
            self.pending.discard((stream, device))
        copies.streams.clear()
        self.settle()

    def settle(self):
        """Wait for the copies of earlier calls that still read the buffer or the region."""
        for stream, device in self.pending:
            with self.cupy.cuda.Device(device):
                self.cupy.cuda.runtime.eventSynchronize(self._events[stream, device])
        self.pending.clear()

    def record(self, copies):
        """Let the copies of ``copies`` run on after the call returns: an event after them on
        each stream, waited for before the buffer or region is written again."""
        runtime = self.cupy.cuda.runtime
        for stream, device in copies.streams:
            with self.cupy.cuda.Device(device):
                event = self._events.pop((stream, device), None) or self._spare_event(device) \
                    or runtime.eventCreateWithFlags(EVENT_DISABLE_TIMING)
                self._events[stream, device] = event  # the last used last
                runtime.eventRecord(event, stream)
            self.pending.add((stream, device))
        copies.streams.clear()

    def _spare_event(self, device):
        """Past MAX_EVENTS, the event of the stream on ``device`` used least recently and not
        pending (taken from it): a job that makes a stream per step does not make an event per step."""
        if len(self._events) < MAX_EVENTS:
            return None
        for key in self._events:
            if key[1] == device and key not in self.pending:
                return self._events.pop(key)
        return None


class Export:
    """A device allocation shared through CUDA IPC: ``key`` (the driver's buffer id), its
    ``base`` address and ``size``, the IPC ``handle`` of its base, and the PCI bus id of its
    GPU."""

    __slots__ = ("key", "base", "size", "handle", "pci_bus_id")

    def __init__(self, key, base, size, handle, pci_bus_id):
        self.key, self.base, self.size, self.handle, self.pci_bus_id = key, base, size, handle, pci_bus_id


class Exports:
    """The CUDA IPC exports of this process's device allocations, by the driver's buffer id
    of each (CU_POINTER_ATTRIBUTE_BUFFER_ID: an address may be allocated again after a free,
    a buffer id never), None for one that cannot be exported (e.g. from a stream-ordered
    memory pool, or torch's expandable segments). Shared by the process's sessions."""

    def __init__(self, cupy):
        self.cupy = cupy
        self._lock = threading.Lock()
        self._by_key = collections.OrderedDict()

    def find(self, memory):
        """The Export of the allocation that holds ``memory`` (a DeviceMemory), or None."""
        with self.cupy.cuda.Device(memory.device):
            key = pointer_attribute(memory.ptr, BUFFER_ID)
            if key is None:  # no context on this thread yet: cudaFree(0) makes the device's current
                self.cupy.cuda.runtime.free(0)
                key = pointer_attribute(memory.ptr, BUFFER_ID)
        if key is None:
            return None
        with self._lock:
            if key in self._by_key:
                self._by_key.move_to_end(key)
                return self._by_key[key]
        export = self._export(key, memory)
        with self._lock:
            self._by_key[key] = export
            if len(self._by_key) > MAX_EXPORTS:
                self._by_key.popitem(last=False)
        return export

    def _export(self, key, memory):
        runtime = self.cupy.cuda.runtime
        with self.cupy.cuda.Device(memory.device):
            base, size = pointer_attribute(memory.ptr, RANGE_START_ADDR), pointer_attribute(memory.ptr, RANGE_SIZE)
        if not base or not size or not base <= memory.ptr <= memory.ptr + memory.nbytes <= base + size:
            return None
        try:
            with self.cupy.cuda.Device(memory.device):
                handle = runtime.ipcGetMemHandle(base)
                pci_bus_id = runtime.deviceGetPCIBusId(memory.device)
        except runtime.CUDARuntimeError as error:
            log.info("a device allocation of %d bytes cannot be shared through CUDA IPC (%s): its values travel "
                     "through the host", size, error)
            return None
        return Export(key, base, size, handle, pci_bus_id)


@functools.cache
def exports():
    """The process's :class:`Exports` (where CuPy sees a CUDA device)."""
    return Exports(cupy_module())
