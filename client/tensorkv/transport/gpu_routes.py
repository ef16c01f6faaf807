"""The routes of GPU values: through the session's region pinned on both ends
(:class:`PinnedSharedMemory`) or device to device through CUDA IPC (:class:`CudaIpc`), with
tensorkv.cuda's copies and exports. Both are subclasses of routes.SharedMemory, which
:func:`tensorkv.transport.routes.choose` picks for a call that moves GPU values where the
session may have them."""
from ..backend import DeviceBytes, device_memory, on_gpu, shape_dtype
from ..errors import InternalError, InvalidTensorError
from ..v1 import tensor_pb2
from ..wire.codec import Item
from ..wire.shm import Placement, aligned
from .. import cuda
from . import shm
from .routes import SharedMemory


class PinnedSharedMemory(SharedMemory):
    """GPU values through the session's region registered as pinned memory on both ends
    (Session.pinned_possible): a pushed one of ``min_bytes`` or more is copied device to host
    straight into the region, and the server copies it host to device straight onto its GPU;
    a pulled one for a GPU out array gets an area of its own there (SessionRequest.outputs),
    which the server fills device to host, and this worker copies it host to device into the
    out array (on the array's stream: the next call waits for it before the region is written
    again). Where the region is not pinned after all (the server could not pin it), as
    SharedMemory."""

    pinned = True

    def __init__(self, session, call, limits):
        super().__init__(session.address, call, limits.session_max_bytes, limits.shm_min_bytes, session.gpu)
        self.session = session
        # (region or CUDA IPC buffer id, offset) -> (part index, the area's host address, or
        # None where the server writes the out array itself) of the areas named for pulled values
        self.landings = {}
        self.arrived = []  # the part indexes whose values came through their areas

    def _direct(self, index, memory, region):
        return region is not None and region.pinned and memory.nbytes >= self.min_bytes

    def _land(self, index, target, region):
        return self.use_output and region is not None and region.pinned

    def _offload(self, region, channel):
        if region is None or not region.pinned:
            return super()._offload(region, channel)
        placement, sent = Placement(region.buffer, region.id, shm.HEADER_BYTES), []
        for index, item in enumerate(self.items):
            if item.array.nbytes < self.min_bytes:
                sent.append(item)
            elif on_gpu(item.array):
                sent.append(self._device_value(index, item, placement, region))
            else:
                self.gpu.settle()  # copies of earlier calls may still read where the CPU writes
                sent.append(placement.put(item) or item)
        return sent, ()

    def _device_value(self, index, item, placement, region):
        """The item that carries the GPU value ``item`` (``self.items[index]``): copied device to
        host into the next place of ``placement``; where it does not fit (a region smaller than
        asked), the item itself, which the encoder copies to the host."""
        memory, offset = device_memory(item.array), placement.next
        if memory is None or offset + memory.nbytes > placement.end:
            return item
        placement.next = offset + aligned(memory.nbytes)
        self.copies.to_host(memory, region.buffer.ctypes.data + offset)
        host = region.buffer[offset:offset + memory.nbytes].view(shape_dtype(item.array)[1]).reshape(item.array.shape)
        return Item(item.key, host, item.shape, item.slice, ref=(region.id, offset, memory.nbytes),
                    two_bit=item.two_bit)

    def _device_area(self, index, memory):
        """(id, offset, None) of where the server writes the pulled value of part index
        ``index`` straight into its out array (``memory``); None: an area of the region."""
        return None

    def _output(self, fields, region, channel):
        if region is None:
            return
        outputs, offset = [], shm.HEADER_BYTES
        for index in range(len(self.call.part)):
            target, area = self.targets.get(index), None
            if target is not None and index not in self.proxies:
                area = self._device_area(index, target[0])
                if area is None and region.pinned and offset + target[0].nbytes <= region.size:
                    area = (region.id, offset, region.buffer.ctypes.data + offset)
                    offset += aligned(target[0].nbytes)
            if area is None:
                outputs.append(tensor_pb2.SharedMemoryRef())
                continue
            self.landings[area[:2]] = (index, area[2])
            outputs.append(tensor_pb2.SharedMemoryRef(region_id=area[0], offset=area[1], length=target[0].nbytes))
        if self.landings:
            fields["outputs"] = outputs
        if offset < region.size:  # the other values, one after the other
            fields["output"] = tensor_pb2.SharedMemoryRef(region_id=region.id, offset=offset,
                                                         length=region.size - offset)

    def _resolve(self, region):
        host = super()._resolve(region)
        if not self.landings:
            return host

        def resolve(region_id, offset, length):
            landing = self.landings.get((region_id, offset))
            if landing is None:
                if host is None:
                    raise InvalidTensorError(f"the server referenced shared-memory region {region_id}, which this "
                                             "call did not name")
                return host(region_id, offset, length)
            index, ptr = landing
            memory, out = self.targets[index][:2]
            if length != memory.nbytes:
                raise InvalidTensorError(f"the server wrote {length} bytes into an area of {memory.nbytes} for the "
                                         f"value at position {index}")
            if ptr is not None:
                self.copies.to_device(ptr, memory)
            self.arrived.append(index)
            return DeviceBytes(cuda.device_bytes(self.gpu.cupy, memory, out))
        return resolve

    def _deliver(self, items):
        for index in self.arrived:
            asked = self.call.part[index][1]
            if index >= len(items) or items[index].key != (asked.key if isinstance(asked, Item) else asked):
                raise InternalError(f"server {self.address} wrote the value at position {index} of the answer into "
                                    "the out array of another key")
            items[index].array = self.targets[index][1]
        super()._deliver(items)


class CudaIpc(PinnedSharedMemory):
    """GPU values device to device through CUDA IPC (Session.ipc_possible): a pushed one of
    ``min_bytes`` or more is referenced where it lies, in a device allocation of this process
    that the session opened on the server first (``exports``), and the server reads it from
    there; a pulled one for a GPU out array is written by the server straight into the out
    array. The call waits once for the work queued on those arrays before it goes, and the
    server has done with them when it answers. A value whose allocation cannot be shared
    (gpu.Exports) takes the pinned region, which the session has anyway: it proves the
    server's host and user."""

    def __init__(self, session, call, limits):
        super().__init__(session, call, limits)
        exports, by_key = cuda.exports(), {}
        # part index -> (gpu.Export, offset in its allocation) of the pushed values and of the
        # pulled values' out arrays that the server reaches through CUDA IPC
        self.pushed, self.pulled_into = {}, {}
        in_bytes = out_bytes = 0
        for index, item in enumerate(self.items if self.items is not None and not call.wait_only else ()):
            memory = device_memory(item.array) if item.array.nbytes >= self.min_bytes else None
            export = exports.find(memory) if memory is not None else None
            if export is not None:
                self.pushed[index] = (export, memory.ptr - export.base)
                by_key[export.key] = export
                in_bytes += aligned(memory.nbytes)
        for index, target in self.targets.items() if self.use_output else ():
            export = exports.find(target[0])
            if export is not None:
                self.pulled_into[index] = (export, target[0].ptr - export.base)
                by_key[export.key] = export
                out_bytes += aligned(target[0].nbytes)
        self.exports = list(by_key.values())
        self.shm_bytes = max(shm.MIN_REGION_BYTES, self.in_bytes - in_bytes,
                             self.out_bytes - out_bytes if self.use_output else 0)

    def _direct(self, index, memory, region):
        return index in self.pushed or super()._direct(index, memory, region)

    def _land(self, index, target, region):
        return self.use_output and index in self.pulled_into or super()._land(index, target, region)

    def _offload(self, region, channel):
        if region is None or not region.pinned:  # the pushed values of self.pushed are still on the GPU
            placement = Placement(region.buffer, region.id, shm.HEADER_BYTES) if region is not None else None
            if placement is not None:
                self._copied()  # GPU values staged in the pinned buffer are read from there
            sent = [self._device_value(index, item, placement, region) if index in self.pushed else
                    (placement.put(item) or item) if placement is not None and item.array.nbytes >= self.min_bytes
                    else item for index, item in enumerate(self.items)]
            return sent, ()
        return super()._offload(region, channel)

    def _device_value(self, index, item, placement, region):
        shared = self.pushed.get(index)
        buffer_id = self.session.cuda_buffers.get(shared[0].key) if shared is not None else None
        if buffer_id is None:
            if placement is None or not region.pinned:
                return item  # copied to the host by the encoder: the session did not open its allocation
            return super()._device_value(index, item, placement, region)
        self.copies.order(device_memory(item.array))
        return Item(item.key, item.array, item.shape, item.slice, ref=(buffer_id, shared[1], item.array.nbytes),
                    two_bit=item.two_bit)

    def _device_area(self, index, memory):
        shared = self.pulled_into.get(index)
        buffer_id = self.session.cuda_buffers.get(shared[0].key) if shared is not None else None
        if buffer_id is None:
            return None
        self.copies.order(memory)  # the server writes the out array: the work queued on it goes first
        return buffer_id, shared[1], None
