"""Values between the network and a GPU, through pinned host memory.

Receive: a value larger than one message arrives in chunks. Each chunk is copied into a
pinned buffer of a small ring and from there to the value's device array by an
asynchronous copy on the staging stream, so the copy of one chunk runs while the next one
is received. The finished value is ordered before the engine's kernels by an event.

Send: a pulled value is copied from the device into pinned host memory with one
asynchronous copy (the full bandwidth of the bus, which pageable memory does not get) and
encoded from there.

Only a server whose values live on a GPU uses this (``tensorkv-server --device cuda``).
"""
import numpy as np

from tensorkv.backend import BFLOAT16, DeviceBFloat16
from tensorkv.wire import codec

# Pinned chunk buffers in the ring: a chunk waits for the copy of the one ``SLOTS`` before it.
SLOTS = 4


class Staging:
    """The pinned buffers and the CUDA stream of one server's transfers (``cupy``: the module)."""

    def __init__(self, cupy, slot_bytes=None, slots=SLOTS):
        import cupyx

        slot_bytes = slot_bytes or codec.CHUNK_BYTES

        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.slot_bytes = slot_bytes
        self._slots = [cupyx.empty_pinned(slot_bytes, np.uint8) for _ in range(slots)]
        self._copied = [None] * slots  # the event after each slot's last copy
        self._next = 0
        self._empty_pinned = cupyx.empty_pinned

    # ---- receive ----------------------------------------------------------------------

    def receiver(self, key, dtype, shape, nbytes):
        """A :class:`DeviceReceiver` for the value of ``key`` (the codec's ``staging`` hook)."""
        return DeviceReceiver(self, dtype, shape, nbytes)

    def upload(self, device_ptr, data):
        """Queue the copy of host bytes ``data`` (uint8) to ``device_ptr`` through the ring."""
        cupy = self.cupy
        for start in range(0, len(data), self.slot_bytes):
            piece = data[start:start + self.slot_bytes]
            index = self._next
            self._next = (index + 1) % len(self._slots)
            if self._copied[index] is not None:
                self._copied[index].synchronize()  # its previous chunk is still being copied
            slot = self._slots[index]
            slot[:len(piece)] = piece
            cupy.cuda.runtime.memcpyAsync(device_ptr + start, slot.ctypes.data, len(piece),
                                          cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
            self._copied[index] = self.stream.record()

    # ---- send -------------------------------------------------------------------------

    def download(self, value):
        """A host copy of the GPU ``value`` (CuPy or DeviceBFloat16) in pinned memory."""
        cupy = self.cupy
        bits = cupy.ascontiguousarray(getattr(value, "bits", value))
        host = self._empty_pinned(bits.shape, bits.dtype)
        # After the kernels that wrote the value, on whatever stream the engine uses.
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, bits.data.ptr, bits.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        self.stream.synchronize()
        return host.view(BFLOAT16) if isinstance(value, DeviceBFloat16) else host


class DeviceReceiver:
    """The device array of one incoming value, filled chunk by chunk through the ring.

    The codec writes ``receiver[start:end] = uint8 bytes`` in order, then takes the value
    with :meth:`view`.
    """

    def __init__(self, staging, dtype, shape, nbytes):
        cupy = staging.cupy
        self.staging = staging
        self.bits = cupy.empty(nbytes, np.uint8)
        # The memory may have been freed by kernels still queued on the engine's stream.
        staging.stream.wait_event(cupy.cuda.get_current_stream().record())
        self.shape = shape
        self.nbytes = nbytes

    def __setitem__(self, where, data):
        start = where.start or 0
        if where.stop - start != len(data) or where.stop > self.nbytes:
            raise ValueError(f"chunk [{start}, {where.stop}) does not fit a value of {self.nbytes} bytes")
        self.staging.upload(self.bits.data.ptr + start, data)

    def view(self, dtype):
        """The finished value (CuPy, or DeviceBFloat16), ordered before later work on the
        engine's stream."""
        cupy = self.staging.cupy
        cupy.cuda.get_current_stream().wait_event(self.staging.stream.record())
        if np.dtype(dtype) == BFLOAT16:
            return DeviceBFloat16(self.bits.view(np.uint16).reshape(self.shape))
        return self.bits.view(dtype).reshape(self.shape)
