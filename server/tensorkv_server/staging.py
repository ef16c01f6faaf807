"""Values between the network and a GPU, through pinned host memory.

Receive: values that come on the data channel are received into pinned host memory and
copied from there to the device, one copy each (:meth:`Staging.received`). A value larger
than one message of a gRPC stream arrives in chunks. Each chunk is copied into a
pinned buffer of a small ring and from there to the value's device array by an
asynchronous copy on the staging stream, so the copy of one chunk runs while the next one
is received. The finished value is ordered before the engine's kernels by an event.

Send: the values of a pull are copied from the device into pinned host memory (CuPy's pool
of it) with one asynchronous copy each (the full bandwidth of the bus, which pageable memory
does not get) and one wait for them all, and encoded from there.

Shared memory and CUDA IPC (tensorkv_server.shm): a worker's region that both ends
registered as pinned memory is copied from and into straight, on the staging stream, and a
worker's CUDA IPC buffer device to device. Every such copy is complete once :meth:`Staging.settle`
returns, which the server calls before it answers the call: the worker may then change the
memory again.

Only a server whose values live on a GPU uses this (``tensorkv-server --device cuda``).
"""
import numpy as np

from tensorkv.backend import BFLOAT16, DeviceBFloat16
from tensorkv import cuda
from tensorkv.wire import codec

# Pinned chunk buffers in the ring: a chunk waits for the copy of the one ``SLOTS`` before it.
SLOTS = 4


class Staging:
    """The pinned buffers and the CUDA stream of one server's transfers (``cupy``: the module)."""

    def __init__(self, cupy, slot_bytes=None, slots=SLOTS):
        import cupyx

        slot_bytes = slot_bytes or codec.CHUNK_BYTES

        self.cupy = cupy
        self.device = cupy.cuda.Device().id  # the engine's
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._copying = False  # copies into or out of a worker's memory queued since the last settle
        self._held = []  # host buffers that copies queued since then read
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

    def empty_pinned(self, nbytes):
        """``nbytes`` of pinned host memory (a uint8 array from CuPy's pool): where values that
        come on the data channel are received, so that :meth:`received` copies them on at the
        speed of the bus (cupy.asarray of a host array copies it into pinned memory first)."""
        return self._empty_pinned(nbytes, np.uint8)

    def received(self, items, buffers):
        """``items`` with the values that lie in ``buffers`` (the host arrays they were received
        into, pinned: :meth:`empty_pinned`) copied to the device, one asynchronous copy each
        on the staging stream, ordered before the engine's next work; the buffers are kept
        until :meth:`settle` (their memory goes back to the pool, for the next call to
        receive into, only once the copies have read it). 2-bit codes stay on the host."""
        spans = [(buffer.ctypes.data, buffer.ctypes.data + buffer.nbytes) for buffer in buffers]
        cupy, moved, copied = self.cupy, [], False
        for item in items:
            array = item.array
            start = array.ctypes.data if isinstance(array, np.ndarray) and array.nbytes else None
            if start is None or item.two_bit or not any(low <= start < high for low, high in spans):
                moved.append(item)
                continue
            if not copied:
                self._after_engine()  # the device memory may have been freed by kernels still queued
                copied = True
            value = _typed(self._upload_bits(start, array.nbytes), array.dtype, array.shape)
            moved.append(codec.Item(item.key, value, item.shape, item.slice))
        if copied:
            cupy.cuda.get_current_stream().wait_event(self.stream.record())
            self._copying = True
            self._held.extend(buffers)
        return moved

    # ---- send -------------------------------------------------------------------------

    def download(self, values):
        """Host copies of the GPU ``values`` (CuPy or DeviceBFloat16) in pinned memory: one
        asynchronous copy each, after the engine's kernels that wrote them, and one wait for
        them all (a pull of many keys waits once, not once per key)."""
        cupy = self.cupy
        # After the kernels that wrote the values, on whatever stream the engine uses.
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        copied = []  # (device bits, kept until the copies are done, and their pinned host copy)
        for value in values:
            bits = cupy.ascontiguousarray(getattr(value, "bits", value))
            host = self._empty_pinned(bits.shape, bits.dtype)
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data, bits.data.ptr, bits.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
            copied.append((bits, host))
        self.stream.synchronize()
        return [host.view(BFLOAT16) if isinstance(value, DeviceBFloat16) else host
                for value, (_, host) in zip(values, copied)]

    # ---- a worker's memory: pinned regions and CUDA IPC buffers ------------------------

    def pin(self, buffer):
        """Register the host memory of ``buffer`` (a uint8 array over a mapping) as pinned;
        the function that unregisters it."""
        return cuda.pin(self.cupy, buffer)

    def from_host(self, ptr, nbytes):
        """A new device array (uint8) of the ``nbytes`` bytes of pinned host memory at ``ptr``,
        copied straight on the staging stream and ordered before the engine's next work."""
        self._after_engine()  # the memory may have been freed by kernels still queued
        bits = self._upload_bits(ptr, nbytes)
        self.cupy.cuda.get_current_stream().wait_event(self.stream.record())
        self._copying = True
        return bits

    def _upload_bits(self, ptr, nbytes):
        """A new device array (uint8) that a copy of the ``nbytes`` bytes of host memory at
        ``ptr``, queued on the staging stream, fills."""
        cupy = self.cupy
        bits = cupy.empty(nbytes, np.uint8)
        cupy.cuda.runtime.memcpyAsync(bits.data.ptr, ptr, nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                      self.stream.ptr)
        return bits

    def to_host(self, value, ptr):
        """Copy the GPU ``value`` (CuPy or DeviceBFloat16) into pinned host memory at ``ptr``,
        after the engine's work that wrote it."""
        self._out_of(value, ptr, self.cupy.cuda.runtime.memcpyDeviceToHost)

    def to_device(self, value, ptr):
        """Copy the GPU ``value`` to device memory at ``ptr`` (a worker's CUDA IPC buffer)."""
        self._out_of(value, ptr, self.cupy.cuda.runtime.memcpyDeviceToDevice)

    def _out_of(self, value, ptr, kind):
        cupy = self.cupy
        bits = cupy.ascontiguousarray(getattr(value, "bits", value))
        self._after_engine()
        cupy.cuda.runtime.memcpyAsync(ptr, bits.data.ptr, bits.nbytes, kind, self.stream.ptr)
        # ``bits`` may be a copy that goes once this returns: its memory must not be used
        # again before the copy read it.
        cupy.cuda.get_current_stream().wait_event(self.stream.record())
        self._copying = True

    def _after_engine(self):
        self.stream.wait_event(self.cupy.cuda.get_current_stream().record())

    def settle(self, reading=False):
        """Wait until every copy into or out of a worker's memory has completed, and with
        ``reading`` (the caller's call referenced a worker's device memory, a CUDA IPC buffer,
        which the engine's kernels read as they come to it) every kernel queued so far."""
        if reading:
            self.cupy.cuda.get_current_stream().synchronize()
        if self._copying:
            self.stream.synchronize()
            self._copying = False
            self._held.clear()


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
        return _typed(self.bits, dtype, self.shape)


def _typed(bits, dtype, shape):
    """The device bytes ``bits`` (CuPy uint8) as a value of ``dtype`` and ``shape`` (a
    DeviceBFloat16 for bfloat16, which CuPy does not have)."""
    if np.dtype(dtype) == BFLOAT16:
        return DeviceBFloat16(bits.view(np.uint16).reshape(shape))
    return bits.view(dtype).reshape(shape)
