"""CUDA IPC buffers on a server whose values live on a GPU: device allocations of a worker's
process on this host, opened through their IPC handles (cudaIpcOpenMemHandle) for the rest of
the Session stream that registered them (SESSION_OP_REGISTER_CUDA_BUFFER), and closed when it
ends (tensorkv_server.shm.Regions keeps them with the stream's regions, by the same ids).

Only on a stream that attached a shared-memory region first: that proves the caller's host,
user and pid namespace (tensorkv_server.shm), which a CUDA IPC handle alone does not. The
server reads a pushed value straight from the worker's memory (the engine's kernels, or a
device copy) and writes a pulled one into it on its staging stream; Staging.settle waits for
both before the call is answered. Every reference is bounds-checked against the size the
driver gives for the opened allocation (where it tells), not the one the worker says.

The driver opens a handle once per process: a handle that streams register again (a worker's
new stream, before its old one has ended; a second store in the same worker process) shares
the opening, which is closed with its last stream (``_OPENED``).
"""
import logging

import numpy as np

from tensorkv.backend import DeviceBytes
from tensorkv.errors import FailedPreconditionError, InvalidArgumentError
from tensorkv import cuda
from tensorkv.wire.codec import Item

log = logging.getLogger(__name__)

# handle -> [address on this server's device, size, the streams' Buffers that use it]
_OPENED = {}


class Buffer:
    """One opened allocation of ``size`` bytes at ``ptr`` on the server's device; ``what``
    names it in logs."""

    device = True  # device memory: a pushed value is read from it, a pulled one written into it, by the GPU

    def __init__(self, staging, handle, ptr, size, what):
        self.staging, self.handle, self.ptr, self.size, self.what = staging, handle, ptr, size, what
        cupy = staging.cupy
        self._memory = cupy.cuda.UnownedMemory(ptr, size, self, staging.device)

    def read(self, offset, length):
        """The DeviceBytes [offset, offset + length) (checked by the caller), read by the engine's kernels."""
        cupy = self.staging.cupy
        return DeviceBytes(cupy.ndarray((length,), np.uint8, cupy.cuda.MemoryPointer(self._memory, offset)))

    def write(self, offset, item, region_id):
        """Copy the GPU value of ``item`` to [offset, offset + its bytes) (checked by the
        caller); the item that references it."""
        self.staging.to_device(item.array, self.ptr + offset)
        return Item(item.key, item.array, item.shape, item.slice, ref=(region_id, offset, item.array.nbytes))

    def close(self):
        self.staging.settle(reading=True)
        opened = _OPENED[self.handle]
        opened[2] -= 1
        if not opened[2]:
            del _OPENED[self.handle]
            self.staging.cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)


def open_buffer(staging, message):
    """The Buffer of ``message`` (a CudaIpcBuffer) opened on the server's device;
    FailedPreconditionError, saying why, when it cannot be."""
    if len(message.handle) != cuda.IPC_HANDLE_BYTES or not message.size:
        raise InvalidArgumentError(f"a CUDA IPC buffer has a handle of {cuda.IPC_HANDLE_BYTES} bytes and a size; this "
                                   f"one has {len(message.handle)} bytes and size {message.size}")
    cupy, device, handle = staging.cupy, staging.device, bytes(message.handle)
    runtime = cupy.cuda.runtime
    what = f"CUDA IPC buffer of {message.size} bytes on the GPU at PCI bus id {message.pci_bus_id!r}"
    opened = _OPENED.get(handle)
    if opened is not None:
        if opened[1] < message.size:
            raise FailedPreconditionError(f"cannot use the {what}: the allocation opened has {opened[1]} bytes")
        opened[2] += 1
        return Buffer(staging, handle, opened[0], opened[1], what)
    try:
        theirs = runtime.deviceGetByPCIBusId(message.pci_bus_id)
    except (runtime.CUDARuntimeError, UnicodeError) as error:
        raise FailedPreconditionError(f"cannot use the {what}: this server does not see that GPU ({error})") from None
    if theirs != device and not runtime.deviceCanAccessPeer(device, theirs):
        raise FailedPreconditionError(f"cannot use the {what}: it is not this server's GPU ({device}), and this one "
                                      f"has no peer access to it")
    with cupy.cuda.Device(device):
        try:
            ptr = runtime.ipcOpenMemHandle(handle)
        except runtime.CUDARuntimeError as error:
            raise FailedPreconditionError(f"cannot use the {what}: the driver did not open its handle ({error}); "
                                          "another container, or MPS, does that") from None
        size = cuda.pointer_attribute(ptr, cuda.RANGE_SIZE)
    if size is None or size < message.size:  # unknown: every reference into it would be unchecked
        runtime.ipcCloseMemHandle(ptr)
        told = "does not tell its size" if size is None else f"has {size} bytes"
        raise FailedPreconditionError(f"cannot use the {what}: the allocation opened {told}")
    _OPENED[handle] = [ptr, size, 1]
    return Buffer(staging, handle, ptr, size, what)
