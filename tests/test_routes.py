"""How a call's route is chosen (tensorkv.transport.routes.choose) and where the CUDA routes
fall back, without a GPU: a worker without CUDA never asks for pinned memory or CUDA IPC; a
server that does not pin the region, or refuses a CUDA IPC buffer, leaves GPU values on plain
shared memory; the server writes each pulled value into the area named for it
(SessionRequest.outputs); a session's CUDA copies wait once per call. The CUDA halves themselves
run under `make test-gpu` (tests/test_gpu.py), against the NumPy route."""
import collections
import ctypes
import logging
import mmap
import os
import sys
import types

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.backend import DeviceBytes, DeviceMemory
from tensorkv.errors import FailedPreconditionError, InternalError, InvalidTensorError
from tensorkv import cuda
from tensorkv.transport import gpu_routes, routes, session as session_module, shm
from tensorkv.transport.routes import Call, Thresholds
from tensorkv.v1 import kvstore_pb2, tensor_pb2
from tensorkv.wire import codec, shm as wire_shm
from tensorkv_server import shm as server_shm

from cluster import Cluster

needs_shm = pytest.mark.skipif(not shm.available(), reason="no sealed memory files (memfd_create)")
MiB = 1 << 20


class FakeDeviceArray:
    """What routes.on_device takes for a CuPy array (by its module), with no GPU behind it."""

    __module__ = "cupy.fake"

    def __init__(self, n, dtype=np.float32):
        self.shape, self.dtype = (n,), np.dtype(dtype)
        self.nbytes = n * self.dtype.itemsize


def _session(**possible):
    fields = dict(address="server:1", thresholds=Thresholds(), shm_possible=True, channel_possible=True,
                  pinned_possible=True, ipc_possible=True, gpu=object(), cuda_buffers={})
    fields.update(possible)
    return types.SimpleNamespace(**fields)


def _push(*arrays):
    return Call("push", [(position, codec.Item(f"k{position}", array)) for position, array in enumerate(arrays)],
                caller={})


@pytest.fixture
def fake_exports(monkeypatch):
    """Device memory at made-up addresses, each array an allocation of its own that CUDA IPC
    shares unless its size is odd."""
    for module in (routes, gpu_routes):
        monkeypatch.setattr(module, "device_memory", lambda array: DeviceMemory(id(array), array.nbytes, 0, 0))

    class Exports:
        @staticmethod
        def find(memory):
            if memory.nbytes % 2:
                return None
            return cuda.Export(memory.ptr, memory.ptr, memory.nbytes, bytes(cuda.IPC_HANDLE_BYTES), "0000:00:00.0")

    monkeypatch.setattr(cuda, "exports", lambda: Exports())


def test_a_call_of_gpu_values_takes_the_fastest_route_the_session_may_use(fake_exports):
    big, small = FakeDeviceArray(MiB // 4), FakeDeviceArray(16)
    route = routes.choose(_session(), _push(big, small))
    assert type(route) is gpu_routes.CudaIpc and route.pinned
    assert [export.size for export in route.exports] == [MiB]  # the small value travels in the messages
    assert route.shm_bytes == shm.MIN_REGION_BYTES  # a region all the same: it proves the host and user
    odd = FakeDeviceArray(MiB + 1, np.uint8)  # an allocation CUDA IPC cannot share: through the region
    route = routes.choose(_session(), _push(big, odd))
    assert [export.size for export in route.exports] == [MiB] and route.shm_bytes == wire_shm.aligned(MiB + 1)
    route = routes.choose(_session(ipc_possible=False), _push(big, small))
    assert type(route) is gpu_routes.PinnedSharedMemory and route.pinned and not route.exports
    assert route.shm_bytes == MiB
    for possible, kind in [(dict(pinned_possible=False, ipc_possible=False), routes.SharedMemory),
                           (dict(pinned_possible=False, ipc_possible=False, shm_possible=False), routes.DataChannel),
                           (dict(pinned_possible=False, ipc_possible=False, shm_possible=False,
                                 channel_possible=False), routes.Inline)]:
        route = routes.choose(_session(**possible), _push(small))
        assert type(route) is kind and not route.pinned and not route.exports
        assert route.gpu is not None  # its GPU values go through the session's pinned buffer
    # a pull into a GPU out array is a call of GPU values too
    pull = Call("pull", [(0, "k")], outs=[[FakeDeviceArray(4)]], keys=["k"], sizes=[16], caller={})
    assert routes.on_device(pull) and not routes.on_device(_push(np.zeros(4)))


def test_a_call_without_gpu_values_or_cuda_takes_the_host_routes(fake_exports):
    # NumPy values: plain shared memory, whatever the session could do for GPU values
    route = routes.choose(_session(), _push(np.zeros(MiB // 4, np.float32)))
    assert type(route) is routes.SharedMemory and route.gpu is None and not route.pinned
    # GPU values where CuPy sees no device (no cuda.Gpu): the host routes, which copy them to the host
    route = routes.choose(_session(gpu=None), _push(FakeDeviceArray(MiB // 4)))
    assert type(route) is routes.SharedMemory and route.gpu is None and not route.pinned and not route.exports


class _Recorded(session_module.Session):
    """A Session that keeps the requests it makes for its regions and CUDA IPC buffers."""

    made = []

    def _roundtrip(self, request, timeout, kind, then=None):
        parsed = kvstore_pb2.SessionRequest.FromString(request)
        if parsed.op in (kvstore_pb2.SESSION_OP_REGISTER_REGION, kvstore_pb2.SESSION_OP_REGISTER_CUDA_BUFFER):
            self.made.append(parsed)
        return super()._roundtrip(request, timeout, kind, then)


@needs_shm
def test_a_worker_without_cuda_never_asks_for_pinned_memory_or_cuda_ipc(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda, "cupy_module", lambda: None)  # whatever this machine has
    monkeypatch.setattr(session_module, "Session", _Recorded)
    monkeypatch.setattr("tensorkv.transport.server_conn.Session", _Recorded)
    _Recorded.made = []
    with Cluster(tmp_path=tmp_path) as cluster, tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
        session = kv._sessions[0]
        session.gpu_server = True  # as if the server's values lived on a GPU
        value = np.arange(MiB, dtype=np.float32)
        kv.init("w", value)
        kv.push("w", value * 2)
        assert np.array_equal(kv.pull("w"), value * 2)
        assert session.gpu is None and not session.pinned_possible and not session.ipc_possible
        assert session.region is not None and not session.region.pinned
        assert [request.op for request in _Recorded.made] == [kvstore_pb2.SESSION_OP_REGISTER_REGION]
        assert not _Recorded.made[0].region.cuda
        assert _workers(cluster)[0].route == "shm"


def _workers(cluster):
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = session_module.Stub(channel)
        return list(stub.Info(kvstore_pb2.InfoRequest(), timeout=30).workers)


class FakeCupy:
    """The parts of CuPy that a session's pinning uses, recording what it is asked."""

    def __init__(self):
        self.calls = []
        calls = self.calls

        class Runtime:
            CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {})

            @staticmethod
            def hostRegister(ptr, size, flags):
                calls.append(("hostRegister", ptr, size, flags))

            @staticmethod
            def hostUnregister(ptr):
                calls.append(("hostUnregister", ptr))

        self.cuda = types.SimpleNamespace(runtime=Runtime)


@needs_shm
def test_gpu_values_fall_back_to_shared_memory_where_the_server_pins_nothing_and_opens_no_cuda_ipc(
        tmp_path, monkeypatch, caplog):
    """A CPU server answers a region asked pinned as not pinned, and refuses CUDA IPC buffers:
    the worker unpins its side, asks neither again, and its GPU values take plain shared
    memory; a call whose buffers the server refused goes as a plain RPC."""
    fake = FakeCupy()
    monkeypatch.setattr(cuda, "cupy_module", lambda: fake)
    caplog.set_level(logging.INFO, logger="tensorkv.transport.session")
    with Cluster(tmp_path=tmp_path) as cluster, tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
        session = kv._sessions[0]
        kv.init("w", np.arange(MiB, dtype=np.float32))  # opens the stream, with an unpinned region
        session.gpu_server = True  # as if the server's values lived on a GPU: it asks, and is refused
        assert session.pinned_possible and session.ipc_possible
        region = session._ensure_region(MiB, 30.0, "push", pinned=True)
        ptr = region.buffer.ctypes.data
        pages = -(-region.size // mmap.PAGESIZE) * mmap.PAGESIZE
        assert fake.calls == [("hostRegister", ptr, pages, cuda.HOST_REGISTER_PORTABLE), ("hostUnregister", ptr)]
        assert not region.pinned and session.pin_refused and not session.pinned_possible
        assert session._ensure_region(MiB, 30.0, "push", pinned=True) is region  # not asked again
        assert len(fake.calls) == 2
        assert routes.choose(session, _push(FakeDeviceArray(16))).__class__ is gpu_routes.CudaIpc
        export = cuda.Export(1, 1 << 40, MiB, bytes(cuda.IPC_HANDLE_BYTES), "0000:00:00.0")
        refused = types.SimpleNamespace(shm_bytes=MiB, pinned=True, exports=[export], layout=None, data_channel=False)
        assert session.call(refused, Call("push", caller=kv._conns[0]._caller()), 30.0) is None
        assert session.ipc_refused and not session.ipc_possible and not session.cuda_buffers
        route = routes.choose(session, _push(FakeDeviceArray(16)))
        assert type(route) is routes.SharedMemory and route.gpu is not None
        said = [r.getMessage() for r in caplog.records if r.name == "tensorkv.transport.session"]
        assert sum("did not pin its side" in line for line in said) == 1
        assert sum("did not open a CUDA IPC buffer" in line and "not on a GPU" in line for line in said) == 1
        log = (tmp_path / "server0.log").read_text()
        assert "CUDA IPC: this server's values are not on a GPU" in log


def test_cuda_ipc_buffers_only_for_a_proven_caller_of_the_servers_own_user():
    buffer = kvstore_pb2.CudaIpcBuffer(handle=bytes(cuda.IPC_HANDLE_BYTES), size=MiB, pci_bus_id="0000:00:00.0")
    with pytest.raises(FailedPreconditionError, match="not on a GPU"):
        server_shm.Regions("ipv4:127.0.0.1:1").open_cuda_buffer(buffer)
    regions = server_shm.Regions("ipv4:127.0.0.1:1", staging=object())  # no CUDA call is reached
    with pytest.raises(FailedPreconditionError, match="attached no shared-memory region"):
        regions.open_cuda_buffer(buffer)
    regions.proven_uid = os.getuid() + 1 if os.getuid() else 65534
    with pytest.raises(FailedPreconditionError, match=f"own user \\(uid {os.getuid()}\\) or root; this one is uid "
                                                      f"{regions.proven_uid}"):
        regions.open_cuda_buffer(buffer)


@needs_shm
def test_a_pull_writes_each_value_into_the_area_named_for_it(tmp_path):
    """SessionRequest.outputs: an area per value, of exactly its bytes, on a CPU server too; one
    of another length is not used (that value goes to the output area); one outside the
    region refuses the call before anything is read."""
    with Cluster(tmp_path=tmp_path) as cluster, tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
        a, b = np.arange(10_000, dtype=np.float32), np.arange(10, dtype=np.float64)
        kv.init(["a", "b"], [a, b])  # through the region: the session has one
        kv.push("a", a * 3)
        session, caller = kv._sessions[0], kv._conns[0]._caller()
        region = session.region
        assert region is not None
        start = shm.HEADER_BYTES + 4096

        def pull(outputs, output=None):
            def build(call_id, timeout_ms, region, channel):
                request = kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_PULL, **caller,
                                                     keys=[tensor_pb2.Key(str_key="a"), tensor_pb2.Key(str_key="b")],
                                                     outputs=[tensor_pb2.SharedMemoryRef(**ref) for ref in outputs])
                if output is not None:
                    request.output.CopyFrom(tensor_pb2.SharedMemoryRef(**output))
                return request.SerializeToString(), ()
            _, data = session.call(session_module._Raw(build, 0), Call("pull"), 30.0)
            return kvstore_pb2.SessionResponse.FromString(data)

        answer = pull([dict(region_id=region.id, offset=start, length=40_000)])
        assert answer.code == 0
        first, second = answer.frame.entries
        assert (first.shm.region_id, first.shm.offset, first.shm.length) == (region.id, start, 40_000)
        assert np.array_equal(region.buffer[start:start + 40_000].view(np.float32), a * 3)
        assert not second.HasField("shm") and np.array_equal(np.frombuffer(second.tensor.data), b)
        # an area of another length is not used: the value goes to the output area
        answer = pull([dict(region_id=region.id, offset=start, length=400), {}, dict(region_id=region.id, offset=0,
                                                                                    length=8)],
                      dict(region_id=region.id, offset=shm.HEADER_BYTES, length=MiB))
        assert answer.code == 0
        assert [(e.shm.offset, e.shm.length) for e in answer.frame.entries] == [
            (shm.HEADER_BYTES, 40_000), (shm.HEADER_BYTES + 40_000, 80)]
        answer = pull([dict(region_id=region.id, offset=region.size - 8, length=40_000)])
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "outside its region" in answer.message


def test_gpu_values_in_device_memory_are_decoded_where_they_lie():
    """A resolved reference that is DeviceBytes (on a GPU: a CuPy array over the bytes the
    server wrote, an out array's) becomes the item as it is, never copied to the host; and a
    Placement leaves items already in shared memory where they are."""
    lying = np.arange(16, dtype=np.uint8)
    destination = np.zeros(4, np.float32)
    decoder = codec.FrameDecoder(resolve=lambda region_id, offset, length: DeviceBytes(lying[offset:offset + length]),
                                 copy_refs=True, destination=lambda *args: destination)
    entry = tensor_pb2.Entry(key=tensor_pb2.Key(int_key=3), tensor=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32,
                                                                                     shape=[4]),
                             shm=tensor_pb2.SharedMemoryRef(region_id=1, offset=0, length=16))
    [item] = decoder.feed(tensor_pb2.TensorFrame(entries=[entry]))
    assert np.shares_memory(item.array, lying) and not destination.any()
    placed = codec.Item(1, np.ones(4), ref=(7, 64, 32))
    buffer = np.zeros(256, np.uint8)
    assert wire_shm.Placement(buffer, 7, 64).place([placed])[0] is placed and not buffer.any()


class FakeRuntime:
    """CuPy's runtime as a session's Gpu uses it, recording the calls."""

    memcpyDeviceToHost, memcpyHostToDevice = 2, 1

    def __init__(self):
        self.calls, self.events = [], 0

    def memcpyAsync(self, dst, src, nbytes, kind, stream):
        self.calls.append(("memcpyAsync", dst, src, nbytes, kind, stream))

    def streamSynchronize(self, stream):
        self.calls.append(("streamSynchronize", stream))

    def eventCreateWithFlags(self, flags):
        self.events += 1
        self.calls.append(("eventCreateWithFlags", flags))
        return 100 + self.events

    def eventRecord(self, event, stream):
        self.calls.append(("eventRecord", event, stream))

    def eventSynchronize(self, event):
        self.calls.append(("eventSynchronize", event))

    def streamWaitEvent(self, stream, event, flags):
        self.calls.append(("streamWaitEvent", stream, event, flags))

    def waits(self):
        return [call for call in self.calls if call[0] in ("streamSynchronize", "eventSynchronize")]


def test_a_session_waits_once_per_call_for_its_gpu_copies(monkeypatch):
    runtime = FakeRuntime()
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=lambda device: _NoContext()))
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda n, dtype: np.empty(n, dtype)))
    state = cuda.Gpu(cupy)
    value, out = DeviceMemory(1 << 30, 64, 0, 7), DeviceMemory(2 << 30, 64, 0, 7)

    def call(pushed=(), pulled=()):
        runtime.calls.clear()
        copies = state.copies()
        state.reserve(sum(wire_shm.aligned(m.nbytes) for m in (*pushed, *pulled)))
        for memory in pushed:
            copies.to_host(memory, state.take(memory.nbytes)[1])
        state.wait(copies)  # before the request goes
        for memory in pulled:  # once the answer came
            copies.to_device(state.take(memory.nbytes)[1], memory)
        state.record(copies)
        return runtime.waits()

    assert call(pushed=[value]) == [("streamSynchronize", 7)]
    assert call(pulled=[out]) == []  # its copy runs on after the pull returns ...
    assert ("eventRecord", 101, 7) in runtime.calls and runtime.events == 1
    assert call(pulled=[out]) == [("eventSynchronize", 101)]  # ... the next call waits for it once
    assert runtime.events == 1  # a stream's event is made once
    assert call(pushed=[value], pulled=[out]) == [("streamSynchronize", 7)]  # the same stream: one wait covers both
    other = DeviceMemory(3 << 30, 64, 1, 9)
    assert call(pushed=[other]) == [("streamSynchronize", 9), ("eventSynchronize", 101)]  # another stream: each
    copies = [c for c in runtime.calls if c[0] == "memcpyAsync"]
    assert [(c[3], c[4], c[5]) for c in copies] == [(64, runtime.memcpyDeviceToHost, 9)]
    state.reserve(200)
    first, second = state.take(100), state.take(100)
    assert len(first[0]) == 100 and second[1] - first[1] == wire_shm.aligned(100)  # aligned places, one buffer


def test_a_job_that_makes_a_stream_per_step_does_not_make_an_event_per_step(monkeypatch):
    """With CUDA faked: past cuda.MAX_EVENTS streams, the event of the stream used least
    recently (and waited for) is reused, on the same device."""
    runtime = FakeRuntime()
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=lambda device: _NoContext()))
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda n, dtype: np.empty(n, dtype)))
    state = cuda.Gpu(cupy)
    for step in range(3 * cuda.MAX_EVENTS):
        copies = state.copies()
        state.wait(copies)
        state.reserve(64)
        copies.to_device(state.take(64)[1], DeviceMemory(1 << 30, 64, step % 2, 1000 + step))
        state.record(copies)
    assert runtime.events <= cuda.MAX_EVENTS + 2
    recorded = [call for call in runtime.calls if call[0] == "eventRecord"]
    assert len(recorded) == 3 * cuda.MAX_EVENTS and recorded[-1][2] == 1000 + 3 * cuda.MAX_EVENTS - 1


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_cupy(runtime):
    """CuPy as the CUDA routes use it, over ``runtime`` (a FakeRuntime): device arrays are zeros."""
    return types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime, Device=lambda device: _NoContext(),
                                   UnownedMemory=lambda ptr, size, owner, device: (ptr, size),
                                   MemoryPointer=lambda memory, offset: memory),
        ndarray=lambda shape, dtype, memptr: np.zeros(shape, dtype))


@needs_shm
def test_the_cuda_routes_name_the_areas_of_gpu_values_and_wait_once(fake_exports, monkeypatch):
    """The requests and answers of CudaIpc and PinnedSharedMemory, with CUDA faked: a value
    whose allocation CUDA IPC shares is referenced where it lies, one it cannot share is copied
    device to host into the pinned region, a small one staged in the pinned buffer; each pulled
    value for a GPU out array is named an area (the out array itself, or the region's), arrives
    there, and its item is the out array; the call waits once before it goes."""
    runtime = FakeRuntime()
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda n, dtype: np.empty(n, dtype)))
    state = cuda.Gpu(_fake_cupy(runtime))
    region = shm.Region(MiB)
    region.id, region.pinned = 9, True
    big, odd, small = FakeDeviceArray(16_384), FakeDeviceArray(65_537, np.uint8), FakeDeviceArray(16)
    outs = [[FakeDeviceArray(16_384)], [FakeDeviceArray(65_537, np.uint8)], [FakeDeviceArray(16)]]
    call = Call("pushpull", [(i, codec.Item(f"k{i}", array)) for i, array in enumerate([big, odd, small])], outs=outs,
                caller={"rank": 0, "incarnation": 5})
    session = _session(gpu=state)
    route = routes.choose(session, call)
    assert type(route) is gpu_routes.CudaIpc
    # the pushed big value and the out arrays of the big and small values are shared
    assert [export.key for export in route.exports] == [id(big), id(outs[0][0]), id(outs[2][0])]
    session.cuda_buffers.update({export.key: 500 + i for i, export in enumerate(route.exports)})
    request = kvstore_pb2.SessionRequest.FromString(route.request(1, 1000, region, None)[0])
    refs = [(e.shm.region_id, e.shm.offset, e.shm.length) for e in request.frame.entries]
    assert refs == [(500, 0, 65_536), (9, shm.HEADER_BYTES, 65_537), (0, 0, 0)]
    assert len(request.frame.entries[2].tensor.data) == 64  # staged, in the message
    assert [(o.region_id, o.offset, o.length) for o in request.outputs] == [
        (501, 0, 65_536), (9, shm.HEADER_BYTES, 65_537), (502, 0, 64)]
    assert (request.output.region_id, request.output.offset) == (9, shm.HEADER_BYTES + wire_shm.aligned(65_537))
    to_host = [(c[2], c[3], c[4]) for c in runtime.calls if c[0] == "memcpyAsync"]
    assert to_host == [(id(small), 64, runtime.memcpyDeviceToHost),  # into the pinned buffer
                       (id(odd), 65_537, runtime.memcpyDeviceToHost)]  # into the region
    assert [c[1] for c in runtime.calls if c[0] == "memcpyAsync"][1] == region.buffer.ctypes.data + shm.HEADER_BYTES
    assert runtime.waits() == [("streamSynchronize", 0)]  # once, before the request goes
    runtime.calls.clear()
    response = kvstore_pb2.SessionResponse(id=1)
    for i, (region_id, offset, length) in enumerate([(501, 0, 65_536), (9, shm.HEADER_BYTES, 65_537), (502, 0, 64)]):
        response.frame.entries.add(key=tensor_pb2.Key(str_key=f"k{i}"), shm=tensor_pb2.SharedMemoryRef(
            region_id=region_id, offset=offset, length=length), tensor=tensor_pb2.Tensor(
            dtype=codec.wire_dtype(outs[i][0].dtype), shape=outs[i][0].shape))
    items = route.answer(1, response.SerializeToString(), region, None)
    assert [item.array for item in items] == [out[0] for out in outs]
    # only the value written into the region is copied on, host to device; then it runs on
    assert [(c[2], c[3], c[4]) for c in runtime.calls if c[0] == "memcpyAsync"] == [
        (region.buffer.ctypes.data + shm.HEADER_BYTES, 65_537, runtime.memcpyHostToDevice)]
    assert runtime.waits() == [] and [c[0] for c in runtime.calls][-1] == "eventRecord"
    # without CUDA IPC: the big value too is copied into the pinned region
    runtime.calls.clear()
    route = routes.choose(_session(gpu=state, ipc_possible=False), _push(big))
    assert type(route) is gpu_routes.PinnedSharedMemory
    request = kvstore_pb2.SessionRequest.FromString(route.request(2, 1000, region, None)[0])
    assert [(e.shm.region_id, e.shm.offset, e.shm.length) for e in request.frame.entries] == [
        (9, shm.HEADER_BYTES, 65_536)]
    region.close()


def test_a_call_that_referenced_a_cuda_ipc_buffer_waits_for_the_engines_kernels_before_its_answer():
    """The engine reads a pushed value in a worker's CUDA IPC buffer when it comes to it, which
    may be after the call waited for a round, and after another stream's call settled
    meanwhile: the call's own settle still waits for the engine's kernels."""
    settled = []
    staging = types.SimpleNamespace(settle=lambda reading=False: settled.append(reading))
    buffer = types.SimpleNamespace(device=True, size=MiB, read=lambda offset, length: DeviceBytes(bytes(length)))
    waiting, other = server_shm.Regions("ipv4:127.0.0.1:1", staging), server_shm.Regions("ipv4:127.0.0.1:2", staging)
    region_id = waiting._add(buffer)
    waiting.resolve(region_id, 0, 64)  # decoded; the call then waits for the key's round
    other.settle()  # another worker's call completes the round and is answered
    waiting.settle()  # its value is merged: the kernels that read the buffer come before the answer
    waiting.settle()  # its next call references no buffer
    assert settled == [False, True, False]
    with pytest.raises(InvalidTensorError, match="outside its region"):
        waiting.resolve(region_id, MiB - 8, 16)


def test_a_cuda_ipc_handle_is_opened_once_per_server_and_closed_with_its_last_stream(monkeypatch):
    """With CUDA faked: the driver opens a handle once per process, so streams that register the
    same allocation share the opening; a GPU the server cannot reach, an allocation smaller
    than the caller says, or one whose size the driver does not tell, is refused (and what was
    opened closed)."""
    from tensorkv_server import cuda_ipc

    calls = []

    class Runtime:
        CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {})

        @staticmethod
        def deviceGetByPCIBusId(bus):
            return {"0000:01:00.0": 0, "0000:02:00.0": 1}[bus]

        @staticmethod
        def deviceCanAccessPeer(device, peer):
            return 0

        @staticmethod
        def ipcOpenMemHandle(handle):
            calls.append(("open", handle[:1]))
            return 0x7000_0000 + handle[0]

        @staticmethod
        def ipcCloseMemHandle(ptr):
            calls.append(("close", ptr))

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=Runtime, Device=lambda device: _NoContext(), UnownedMemory=lambda *args: args))
    staging = types.SimpleNamespace(cupy=cupy, device=0, settle=lambda reading=False: calls.append(("settle", reading)))
    sizes = {0x7000_0001: MiB, 0x7000_0002: MiB // 2, 0x7000_0004: None}
    monkeypatch.setattr(cuda, "pointer_attribute", lambda ptr, attribute: sizes[ptr])

    def buffer(first, bus="0000:01:00.0", size=MiB):
        return kvstore_pb2.CudaIpcBuffer(handle=bytes([first]) * cuda.IPC_HANDLE_BYTES, size=size, pci_bus_id=bus)

    one, two = cuda_ipc.open_buffer(staging, buffer(1)), cuda_ipc.open_buffer(staging, buffer(1))
    assert one.ptr == two.ptr == 0x7000_0001 and one.size == MiB and calls == [("open", b"\x01")]
    one.close()
    assert ("close", 0x7000_0001) not in calls
    two.close()
    assert calls[-1] == ("close", 0x7000_0001) and not cuda_ipc._OPENED
    with pytest.raises(FailedPreconditionError, match="has no peer access to it"):
        cuda_ipc.open_buffer(staging, buffer(3, bus="0000:02:00.0"))
    with pytest.raises(FailedPreconditionError, match="the allocation opened has 524288 bytes"):
        cuda_ipc.open_buffer(staging, buffer(2))
    assert calls[-1] == ("close", 0x7000_0002) and not cuda_ipc._OPENED
    with pytest.raises(FailedPreconditionError, match="the allocation opened does not tell its size"):
        cuda_ipc.open_buffer(staging, buffer(4))
    assert calls[-1] == ("close", 0x7000_0004) and not cuda_ipc._OPENED


class LazyRuntime(FakeRuntime):
    """A FakeRuntime whose copies move bytes (host memory stands for device memory too) only
    when a wait reaches them, in each stream's order, a stream named with its device as CUDA
    names it: bytes read or overwritten before the call waits for their copy are seen."""

    def __init__(self):
        super().__init__()
        self.device = 0  # the current one
        self.queued = collections.defaultdict(list)  # (stream, device) -> steps not run yet
        self.marks = {}  # event -> (its stream's steps, the step it was recorded as)

    def Device(self, device):
        runtime = self

        class Current:
            def __enter__(self):
                self.before, runtime.device = runtime.device, device

            def __exit__(self, *exc):
                runtime.device = self.before

        return Current()

    def memcpyAsync(self, dst, src, nbytes, kind, stream):
        super().memcpyAsync(dst, src, nbytes, kind, stream)
        self.queued[stream, self.device].append(lambda: ctypes.memmove(dst, src, nbytes))

    @staticmethod
    def _run(steps, until=None):
        while steps and (until is None or until in steps):
            steps.pop(0)()

    def streamSynchronize(self, stream):
        super().streamSynchronize(stream)
        self._run(self.queued[stream, self.device])

    def eventRecord(self, event, stream):
        super().eventRecord(event, stream)
        steps = self.queued[stream, self.device]
        steps.append(lambda: None)
        self.marks[event] = (steps, steps[-1])

    def eventSynchronize(self, event):
        super().eventSynchronize(event)
        self._run(*self.marks[event])

    def streamWaitEvent(self, stream, event, flags):
        super().streamWaitEvent(stream, event, flags)
        steps, mark = self.marks[event]
        self.queued[stream, self.device].append(lambda: self._run(steps, mark))


class DeviceValue(FakeDeviceArray):
    """A FakeDeviceArray whose bytes are those of ``host``, on ``stream`` of ``device``."""

    __module__ = "cupy.fake"

    def __init__(self, host, stream=0, device=0):
        super().__init__(host.size, host.dtype)
        self.host, self.stream, self.device = host, stream, device


@pytest.fixture
def lazy_cuda(monkeypatch):
    """(a LazyRuntime, a session's cuda.Gpu over it) for DeviceValues, none of which CUDA IPC shares."""
    runtime = LazyRuntime()
    for module in (routes, gpu_routes):
        monkeypatch.setattr(module, "device_memory", lambda array: DeviceMemory(
            array.host.ctypes.data, array.nbytes, array.device, array.stream))
    monkeypatch.setattr(cuda, "exports", lambda: types.SimpleNamespace(find=lambda memory: None))
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(
        empty_pinned=lambda n, dtype: np.full(n, 0xEE, dtype)))  # not zeros: a copy not done shows
    cupy = _fake_cupy(runtime)
    cupy.cuda.Device = runtime.Device
    return runtime, cuda.Gpu(cupy)


@needs_shm
@pytest.mark.parametrize("ipc_possible", [False, True])
def test_gpu_values_staged_on_the_host_are_copied_before_the_region_is_written_from_them(lazy_cuda, ipc_possible):
    """A region that is not pinned: a pushed GPU value goes through the session's pinned buffer,
    and from there into the region once its copy out of the GPU is done (also for CudaIpc, for an
    allocation that CUDA IPC cannot share)."""
    runtime, state = lazy_cuda
    region = shm.Region(MiB)
    region.id = 9
    value = DeviceValue(np.arange(8192, dtype=np.float32), stream=7)
    route = routes.choose(_session(gpu=state, pinned_possible=False, ipc_possible=ipc_possible), _push(value))
    assert type(route) is (gpu_routes.CudaIpc if ipc_possible else routes.SharedMemory) and not route.exports
    request = kvstore_pb2.SessionRequest.FromString(route.request(1, 1000, region, None)[0])
    [entry] = request.frame.entries
    assert (entry.shm.region_id, entry.shm.offset, entry.shm.length) == (9, shm.HEADER_BYTES, value.nbytes)
    np.testing.assert_array_equal(region.buffer[shm.HEADER_BYTES:][:value.nbytes].view(np.float32), value.host)
    assert runtime.waits() == [("streamSynchronize", 7)]
    region.close()


def _pull_into(state, region, out, pulled, answered="k"):
    """Pull ``pulled`` (the value the server writes into the area named for it) into the GPU
    ``out`` through the pinned ``region`` (PinnedSharedMemory), answered as the value of key
    ``answered``; the items of the answer."""
    call = Call("pull", [(0, "k")], outs=[[out]], keys=["k"], sizes=[out.nbytes], shapes=[(out.shape, out.dtype)],
                caller={})
    route = routes.choose(_session(gpu=state, ipc_possible=False), call)
    request = kvstore_pb2.SessionRequest.FromString(route.request(1, 1000, region, None)[0])
    area = request.outputs[0]
    assert (area.region_id, area.offset, area.length) == (region.id, shm.HEADER_BYTES, out.nbytes)
    region.buffer[area.offset:area.offset + area.length] = pulled.view(np.uint8)
    response = kvstore_pb2.SessionResponse(id=1)
    response.frame.entries.add(key=tensor_pb2.Key(str_key=answered), shm=area, tensor=tensor_pb2.Tensor(
        dtype=codec.wire_dtype(pulled.dtype), shape=pulled.shape))
    return route.answer(1, response.SerializeToString(), region, None)


@needs_shm
@pytest.mark.parametrize("written_by", ["cpu", "gpu"])
def test_a_call_writes_the_region_once_the_last_calls_copies_out_of_it_are_done(lazy_cuda, written_by):
    """A pulled value's copy from the pinned region into its GPU out array runs on after the
    pull returns; the next call writes the same place of the region only after that copy read
    it, whether the CPU writes there (a host value pushed beside GPU values) or a copy out of
    the GPU on another stream; the copies of an answer that fails are waited for too."""
    runtime, state = lazy_cuda
    state.reserve(1)  # the session's pinned buffer, made by an earlier call
    region = shm.Region(MiB)
    region.id, region.pinned = 9, True
    out, pulled = DeviceValue(np.zeros(8192, np.float32), stream=7), np.arange(8192, dtype=np.float32)
    [item] = _pull_into(state, region, out, pulled)
    assert item.array is out and state.pending == {(7, 0)} and not out.host.any()  # still running
    pushed = np.full(8192, -1, np.float32)
    values = [pushed, DeviceValue(np.ones(16, np.float32), stream=9)] if written_by == "cpu" else [
        DeviceValue(pushed, stream=9)]
    route = routes.choose(_session(gpu=state, ipc_possible=False), _push(*values))
    assert type(route) is gpu_routes.PinnedSharedMemory
    request = kvstore_pb2.SessionRequest.FromString(route.request(2, 1000, region, None)[0])
    assert request.frame.entries[0].shm.offset == shm.HEADER_BYTES
    np.testing.assert_array_equal(out.host, pulled)
    np.testing.assert_array_equal(region.buffer[shm.HEADER_BYTES:][:pushed.nbytes].view(np.float32), pushed)
    assert not state.pending
    # an answer that fails once a copy into its out array is queued: that copy is waited for too
    with pytest.raises(InternalError, match="into the out array of another key"):
        _pull_into(state, region, out, pulled, answered="other")
    assert state.pending == {(7, 0)}
    region.close()


def test_the_default_streams_of_two_devices_are_two_streams(lazy_cuda):
    """Each device's default stream is 0: a call that copies values of two devices waits for
    the copies on both, and keeps an event of each device for the copies that run on."""
    runtime, state = lazy_cuda
    values = [DeviceValue(np.arange(16, dtype=np.float32) + device, device=device) for device in (0, 1)]
    route = routes.choose(_session(gpu=state, pinned_possible=False, ipc_possible=False, shm_possible=False,
                                   channel_possible=False), _push(*values))
    assert type(route) is routes.Inline
    request = kvstore_pb2.SessionRequest.FromString(route.request(1, 1000, None, None)[0])
    for entry, value in zip(request.frame.entries, values):
        np.testing.assert_array_equal(np.frombuffer(entry.tensor.data, np.float32), value.host)
    copies = state.copies()
    for value in values:
        copies.to_device(value.host.ctypes.data, DeviceMemory(value.host.ctypes.data, value.nbytes, value.device, 0))
    state.record(copies)
    assert state.pending == {(0, 0), (0, 1)} and runtime.events == 2


def test_exports_share_whole_allocations_and_remember_those_cuda_ipc_cannot_share(monkeypatch):
    """cuda.Exports with CUDA faked: the allocation a pointer lies in (asked of the driver, once a
    context is current on the thread) is exported whole, once, whichever piece of it a value is;
    one that cudaIpcGetMemHandle refuses (a stream-ordered pool's, torch's expandable segments)
    is None, asked once; memory the driver does not know is None."""
    allocations = {1: (0x10_0000, 0x1000), 2: (0x20_0000, 0x2000)}  # buffer id -> (base, size); 2: no handle
    calls, context = [], []

    def attribute(ptr, which):
        for key, (base, size) in allocations.items():
            if context and base <= ptr < base + size:
                return {cuda.BUFFER_ID: key, cuda.RANGE_START_ADDR: base, cuda.RANGE_SIZE: size}[which]
        return None

    class Runtime:
        CUDARuntimeError = type("CUDARuntimeError", (RuntimeError,), {})

        @staticmethod
        def free(ptr):  # cudaFree(0): the device's primary context made current
            calls.append(("free", ptr))
            context.append(True)

        @staticmethod
        def ipcGetMemHandle(ptr):
            calls.append(("ipcGetMemHandle", ptr))
            if ptr == allocations[2][0]:
                raise Runtime.CUDARuntimeError("cudaErrorInvalidValue")
            return bytes([ptr >> 20]) * cuda.IPC_HANDLE_BYTES

        @staticmethod
        def deviceGetPCIBusId(device):
            return f"0000:0{device + 1}:00.0"

    monkeypatch.setattr(cuda, "pointer_attribute", attribute)
    exports = cuda.Exports(types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=Runtime,
                                                                            Device=lambda device: _NoContext())))
    first = exports.find(DeviceMemory(0x10_0100, 256, 0, 0))
    assert calls == [("free", 0), ("ipcGetMemHandle", 0x10_0000)]
    assert (first.key, first.base, first.size, first.handle, first.pci_bus_id) == (
        1, 0x10_0000, 0x1000, b"\x01" * cuda.IPC_HANDLE_BYTES, "0000:01:00.0")
    assert exports.find(DeviceMemory(0x10_0800, 0x800, 0, 0)) is first  # another piece of the same allocation
    assert exports.find(DeviceMemory(0x20_0000, 64, 0, 0)) is None
    assert exports.find(DeviceMemory(0x20_1000, 64, 0, 0)) is None
    assert calls[2:] == [("ipcGetMemHandle", 0x20_0000)]  # refused once, remembered
    assert exports.find(DeviceMemory(0x30_0000, 64, 0, 0)) is None and calls[-1] == ("free", 0)


class _DevArray(np.ndarray):
    """Host memory standing for a CuPy array: its ``data.ptr`` is its address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


class _LazyStream:
    """A CUDA stream whose copies happen only when it is synchronized (a copy read too late, or
    a buffer reused too early, shows)."""

    def __init__(self, runtime):
        self.runtime, self.ptr = runtime, id(self)

    def record(self):
        return self

    def wait_event(self, event):
        pass

    def synchronize(self):
        for dst, src, nbytes in self.runtime.queued.pop(self.ptr, []):
            ctypes.memmove(dst, src, nbytes)


def test_values_that_come_on_the_data_channel_cross_once_to_a_gpu_server(monkeypatch):
    """With CUDA faked: a GPU server receives data-channel values into pinned host memory and
    copies each to the device with one asynchronous copy (not cupy.asarray, which copies a host
    array into pinned memory first), keeping the buffers until the copies are done; 2-bit codes
    and values elsewhere stay as they are."""
    from tensorkv.backend import BFLOAT16, DeviceBFloat16
    from tensorkv_server.staging import Staging

    runtime = types.SimpleNamespace(memcpyHostToDevice=1, queued=collections.defaultdict(list))
    runtime.memcpyAsync = lambda dst, src, nbytes, kind, stream: runtime.queued[stream].append((dst, src, nbytes))
    engine = _LazyStream(runtime)
    cupy = types.SimpleNamespace(
        empty=lambda n, dtype: np.zeros(n, dtype).view(_DevArray),
        cuda=types.SimpleNamespace(runtime=runtime, Device=lambda: types.SimpleNamespace(id=0),
                                   Stream=lambda non_blocking: _LazyStream(runtime), get_current_stream=lambda: engine))
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda n, dtype: np.empty(n, dtype)))
    staging = Staging(cupy, slot_bytes=64, slots=1)
    buffer = staging.empty_pinned(64)
    buffer[:16] = np.arange(4, dtype=np.float32).view(np.uint8)
    buffer[16:24] = np.array([1.5, -2, 3, 4], BFLOAT16).view(np.uint8)
    codes, elsewhere = buffer[24:28], np.ones(2, np.float32)
    items = [codec.Item("f", buffer[:16].view(np.float32).reshape(2, 2)), codec.Item("b", buffer[16:24].view(BFLOAT16)),
             codec.Item("c", codes, (16,), two_bit=0.5), codec.Item("e", elsewhere)]
    moved = staging.received(items, [buffer])
    assert [item.key for item in moved] == ["f", "b", "c", "e"]
    assert moved[2] is items[2] and moved[3] is items[3]
    assert isinstance(moved[0].array, _DevArray) and moved[0].array.shape == (2, 2)
    assert isinstance(moved[1].array, DeviceBFloat16)
    assert not moved[0].array.any()  # queued, not copied yet: the buffer is still needed ...
    assert staging._held == [buffer]
    staging.settle()  # ... until the copies are done
    assert staging._held == []
    np.testing.assert_array_equal(moved[0].array, np.arange(4, dtype=np.float32).reshape(2, 2))
    np.testing.assert_array_equal(moved[1].array.bits.view(BFLOAT16), np.array([1.5, -2, 3, 4], BFLOAT16))


def test_a_gpu_servers_receive_buffers_are_made_by_its_allocator():
    from tensorkv.wire import allocator

    made = []
    buffers = allocator.Buffers(1 << 30, allocate=lambda n: made.append(n) or np.empty(n, np.uint8))
    buffers.empty(100), buffers.empty(allocator.REUSE_MIN_BYTES)
    assert made == [100, allocator.REUSE_MIN_BYTES]
