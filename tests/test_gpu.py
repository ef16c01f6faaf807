"""The GPU path: values on a CUDA device through CuPy, in the 'device' store and in a server
started with ``--device cuda``; CuPy arrays and torch CUDA tensors handed to every store type.

``make test-gpu`` runs this file on a machine with a CUDA device and CuPy; everywhere else
its GPU tests are skipped, and only the check that asking for a GPU without one fails
clearly runs. The GPU tests compare against the NumPy engine that the CPU suite covers.
"""
import json
import os
import re
import subprocess
import sys

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv import backend
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import CALL, Cluster, check_workers, wait_until

cupy = backend.cupy_or_none()
BF16 = backend.BFLOAT16
requires_gpu = pytest.mark.skipif(cupy is None, reason="CuPy sees no CUDA device")

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"]
OPTIMIZERS = [
    ("sgd", dict(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5)),
    ("sgd", dict(learning_rate=0.1, clip_gradient=0.3)),
    ("adam", dict(learning_rate=0.01, wd=0.001)),
    ("adagrad", dict(learning_rate=0.1, wd=0.01)),
    ("rmsprop", dict(learning_rate=0.01, centered=True, clip_weights=2.0)),
    ("signum", dict(learning_rate=0.01, wd_lh=0.01)),
    ("sgd", dict(learning_rate=0.1, momentum=0.9, multi_precision=True)),  # a float32 copy on the GPU
    ("adam", dict(learning_rate=0.01, multi_precision=True)),
    ("nag", dict(learning_rate=0.1, momentum=0.9, wd=0.01)),
    ("adadelta", dict(wd=0.01)),
    ("adamax", dict(wd=0.01)),
    ("nadam", dict(wd=0.01)),
    ("ftrl", dict(lamda1=0.1)),
    ("ftml", dict(learning_rate=0.01)),
    ("lamb", dict(learning_rate=0.01, wd=0.01)),  # two passes and a norm (kernels.l2_norm) on the GPU
    ("lamb", dict(learning_rate=0.01, multi_precision=True)),
    ("dcasgd", dict(learning_rate=0.1, momentum=0.9, wd=0.01)),
    ("lars", dict(learning_rate=0.1, momentum=0.9, eta=0.01, wd=0.01)),  # norms (kernels.l2_norm) before SGD's kernel
    ("lars", dict(learning_rate=0.1, eta=0.01, multi_precision=True)),
]


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


def _server_device(address):
    with grpc.insecure_channel(address) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL).device


def _server_exit(device):
    return subprocess.run([sys.executable, "-m", "tensorkv_server", "--port", "0", "--device", device],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(cupy is not None, reason="a CUDA device is present")
def test_asking_for_a_gpu_without_one_fails_clearly():
    result = _server_exit("cuda")
    assert result.returncode != 0
    assert "--device cuda: device 'cuda' asked for, but CuPy sees no CUDA device" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:1", "cpu:", "auto:", "cuda:", "cuda:\u00b2"])
def test_a_malformed_device_name_is_refused(device):
    result = _server_exit(device)
    assert result.returncode != 0
    assert f"device {device!r} is not one of cpu, cuda, cuda:N, auto" in result.stderr
    assert "Traceback" not in result.stderr


# ---- the embedded 'device' store --------------------------------------------------------

@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_store_sums_cupy_arrays_on_the_gpu(dtype):
    with tensorkv.create("device") as kv:
        assert kv.device.startswith("cuda")
        kv.init(3, cupy.ones((2, 3), dtype=dtype))
        assert isinstance(kv._engine.get(3).array, cupy.ndarray)
        kv.push(3, [cupy.full((2, 3), 2, dtype=dtype)] * 3)
        out = cupy.zeros((2, 3), dtype=dtype)
        kv.pull(3, out=out)
        assert isinstance(out, cupy.ndarray) and out.dtype == np.dtype(dtype)
        cupy.testing.assert_array_equal(out, cupy.full((2, 3), 6, dtype=dtype))
        host = kv.pull(3)
        assert isinstance(host, np.ndarray)
        np.testing.assert_array_equal(host, np.full((2, 3), 6, dtype=dtype))


@pytest.mark.gpu
@requires_gpu
def test_device_store_mixes_numpy_and_cupy():
    with tensorkv.create("device") as kv:
        kv.init(["a", "b"], [np.arange(4, dtype=np.float32), cupy.arange(4, dtype=cupy.float32)])
        kv.push(["a", "b"], [[np.ones(4, np.float32), cupy.ones(4, cupy.float32)], cupy.ones(4, cupy.float32)])
        outs = [np.zeros(4, np.float32), cupy.zeros(4, cupy.float32)]
        kv.pull(["a", "b"], out=outs)
        np.testing.assert_array_equal(outs[0], [2, 2, 2, 2])
        cupy.testing.assert_array_equal(outs[1], cupy.ones(4, cupy.float32))


@pytest.mark.gpu
@pytest.mark.skipif(cupy is None or cupy.cuda.runtime.getDeviceCount() < 2, reason="needs two CUDA devices")
def test_device_store_sums_arrays_from_two_devices():
    values = []
    for index in (0, 1):
        with cupy.cuda.Device(index):
            values.append(cupy.full(8, index + 1, cupy.float32))
    with tensorkv.create("device") as kv:
        kv.init(0, cupy.zeros(8, cupy.float32))
        kv.push(0, values)
        with cupy.cuda.Device(1):
            out = cupy.zeros(8, cupy.float32)
        kv.pull(0, out=out)
        assert out.device.id == 1
        cupy.testing.assert_array_equal(out, cupy.full(8, 3, cupy.float32))


@pytest.mark.gpu
@requires_gpu
def test_bfloat16_lives_on_the_gpu_and_is_summed_in_float32():
    with tensorkv.create("device") as kv:
        kv.init("w", np.zeros(4, BF16))
        stored = kv._engine.get("w").array
        assert isinstance(stored, backend.DeviceBFloat16) and isinstance(stored.bits, cupy.ndarray)
        # four half-ulps of 1 survive only a float32 sum
        kv.push("w", [np.ones(4, BF16)] + [np.full(4, 2.0 ** -8, BF16)] * 4)
        host = kv.pull("w")
        assert host.dtype == BF16
        np.testing.assert_array_equal(host.astype(np.float64), 1 + 2.0 ** -6)


@pytest.mark.gpu
@requires_gpu
def test_a_python_updater_sees_bfloat16_values_on_the_gpu_as_float32():
    seen = []

    def updater(key, pushed, stored):
        seen.append((type(pushed), pushed.dtype, type(stored), stored.dtype))
        stored += 2 * pushed

    with tensorkv.create("device") as kv:
        kv.init(0, np.ones(3, BF16))
        kv.set_updater(updater)
        kv.push(0, np.full(3, 0.25, BF16))
        assert seen == [(cupy.ndarray, np.float32, cupy.ndarray, np.float32)]
        np.testing.assert_array_equal(kv.pull(0).astype(np.float32), 1.5)


@pytest.mark.gpu
@requires_gpu
def test_every_kernel_on_the_gpu_matches_numpy():
    """Each fused kernel as cupy.ElementwiseKernel against its NumPy evaluation, in every
    dtype the product runs it in (tests/test_kernels.py checks the same text on the host)."""
    from test_kernels import _cases

    for label, kernel, arrays, scalars, compute in _cases():
        expected = {name: array.copy() for name, array in arrays.items()}
        with np.errstate(all="ignore"):
            kernel(expected, scalars, compute)
        on_gpu = {name: backend.to_namespace(array, cupy) for name, array in arrays.items()}
        kernel(on_gpu, scalars, compute)
        for name in kernel.outputs:
            got = backend.to_host(on_gpu[name]).astype(np.float64)
            want = expected[name].astype(np.float64)
            if compute.kind in "iu":
                np.testing.assert_array_equal(got, want, err_msg=label)
            else:  # the GPU contracts a * b + c into one rounding (FMA)
                tolerance = 1e-12 if compute == np.float64 else 1e-5
                low = arrays[name].dtype in (np.float16, BF16)
                np.testing.assert_allclose(got, want, rtol=1e-2 if low else tolerance,
                                           atol=1e-2 if low else tolerance, equal_nan=True, err_msg=label)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("name, params", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_optimizers_on_the_gpu_match_the_cpu(name, params, dtype):
    rng = np.random.default_rng(7)
    dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    weight = rng.standard_normal(1000).astype(dtype)
    grads = [rng.standard_normal(1000).astype(dtype) for _ in range(5)]
    results = {}
    for store in ("local", "device"):
        with tensorkv.create(store) as kv:
            kv.set_optimizer(tensorkv.optimizer.create(name, **params))
            kv.init(0, weight)
            for grad in grads:
                # CuPy has no bfloat16: those pushes reach the GPU from NumPy
                kv.push(0, grad if store == "local" or dtype == "bfloat16" else cupy.asarray(grad))
            results[store] = kv.pull(0)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(results["device"].astype(np.float64), results["local"].astype(np.float64),
                               **tolerance)


# ---- torch tensors ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("store", ["local", "device"])
def test_torch_cuda_tensors_in_the_embedded_stores(store):
    torch = _torch_cuda()
    with tensorkv.create(store) as kv:
        kv.init("w", torch.zeros(4, device="cuda"))
        kv.push("w", [torch.ones(4, device="cuda"), torch.full((4,), 2.0, device="cuda")])
        out = torch.empty(4, device="cuda")
        kv.pull("w", out=out)
        assert out.is_cuda
        assert torch.equal(out.cpu(), torch.full((4,), 3.0))


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["local", "device"])
def test_torch_bfloat16_cuda_tensors_in_the_embedded_stores(store):
    torch = _torch_cuda()
    with tensorkv.create(store) as kv:
        kv.init("w", torch.zeros(8, device="cuda", dtype=torch.bfloat16))
        kv.push("w", [torch.ones(8, device="cuda", dtype=torch.bfloat16)] * 3)
        out = torch.empty(8, device="cuda", dtype=torch.bfloat16)
        kv.pull("w", out=out)
        assert out.is_cuda and out.dtype == torch.bfloat16
        assert torch.equal(out.float().cpu(), torch.full((8,), 3.0))


@pytest.mark.gpu
@requires_gpu
def test_dist_clients_sum_lists_of_gpu_arrays_on_the_gpu():
    from tensorkv.stores import dist
    torch = _torch_cuda()
    arrays = [cupy.ones(4, cupy.float32), torch.ones(4, device="cuda")]
    engine = dist._merge_engine(arrays)
    assert engine.xp is cupy
    total = engine.sum(arrays)
    assert isinstance(total, cupy.ndarray)
    cupy.testing.assert_array_equal(total, cupy.full(4, 2, cupy.float32))


# ---- a server on the GPU ------------------------------------------------------------------

@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("transport", ["auto", "tcp", "grpc"])
def test_server_on_the_gpu_with_cupy_and_numpy_arrays(tmp_path, transport):
    with Cluster(servers=2, tmp_path=tmp_path, server_args=("--device", "cuda:0")) as cluster:
        assert [_server_device(a) for a in cluster.addresses] == ["cuda:0", "cuda:0"]
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport) as kv:
            big = np.arange(3_000_000, dtype=np.float32)
            kv.init(["small", "big"], [cupy.ones(16, cupy.float32), big])
            kv.push(["small", "big"], [[cupy.ones(16, cupy.float32)] * 2, cupy.asarray(big) * 2])
            small_out, big_out = cupy.zeros(16, cupy.float32), np.zeros_like(big)
            kv.pull(["small", "big"], out=[small_out, big_out])
            cupy.testing.assert_array_equal(small_out, cupy.full(16, 2, cupy.float32))
            np.testing.assert_array_equal(big_out, big * 2)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32"])
def test_a_gpu_server_receives_chunked_values_of_every_width(tmp_path, dtype):
    """Values of several messages each (through the pinned ring) in plain gRPC messages."""
    dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    value = (np.arange(3_000_001) % 251).astype(dtype)
    with Cluster(servers=1, tmp_path=tmp_path, server_args=("--device", "cuda:0")) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc") as kv:
            kv.init("v", value)
            kv.push("v", [value, value])
            got = kv.pull("v")
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.astype(np.float64), (value.astype(np.float64) * 2).astype(dtype).astype(np.float64))


@pytest.mark.gpu
@requires_gpu
def test_sync_rounds_with_an_optimizer_on_gpu_servers_match_cpu_servers(tmp_path):
    weights = {}
    for device in ("cpu", "cuda:0"):
        with Cluster(servers=2, num_workers=2, tmp_path=tmp_path, server_args=("--device", device)) as cluster:
            assert [_server_device(a) for a in cluster.addresses] == [device] * 2
            # a bound of 2 elements slices the 4-element weight over both servers
            outs = check_workers(cluster.run_workers("sgd_rounds", 4, tmp_path / f"states-{device}.npz",
                                                     env={"TENSORKV_BIGARRAY_BOUND": "2"}))
        weights[device] = [json.loads(out) for out in outs]
    np.testing.assert_allclose(weights["cuda:0"], weights["cpu"], rtol=1e-6)


# ---- GPU values to GPU servers on this host: CUDA IPC, pinned shared memory, TCP ------------

# A key of each size and dtype: in the messages; through the route; sliced over both servers.
ROUTE_SHAPES = {"small": (16,), "whole": (20_000,), "big": (300_000,)}
ROUTE_BOUND = 100_000  # the stores' bigarray_bound
ROUTE_DTYPES = ("float32", "float16", "bfloat16")
# WorkerLease.route of each route's worker (the NumPy reference takes plain shared memory)
INFO_ROUTES = {"cuda-ipc": "cuda-ipc", "pinned-shm": "pinned-shm", "tcp": "data-channel", "numpy": "shm"}
NOBODY = 65534  # the uid and gid of a caller of another user


class _Values:
    """Worker values of one kind made from host arrays: NumPy arrays, CuPy arrays (bfloat16
    stays NumPy: CuPy has none) or torch CUDA tensors."""

    def __init__(self, kind):
        self.kind = kind
        self.torch = _torch_cuda() if kind == "torch" else None

    def make(self, host):
        if self.kind == "cupy" and host.dtype != BF16:
            return cupy.asarray(host)
        if self.kind == "torch":
            torch = self.torch
            if host.dtype == BF16:
                return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16).cuda()
            return torch.from_numpy(host.copy()).cuda()
        return host.copy()


def _route_store(cluster, route):
    """The one worker's store on ``cluster`` that takes ``route`` for GPU values (an earlier
    store's keys dropped)."""
    kv = tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp" if route == "tcp" else "auto",
                         if_exists="replace", bigarray_bound=ROUTE_BOUND, timeout=CALL)
    if route == "pinned-shm":
        for session in kv._sessions:
            session.ipc_refused = True
    return kv


def _rounds(kv, values):
    """Every value pulled by a fixed sequence of calls: init, pushes of two values per key
    (summed on the worker), pulls into out arrays and into new arrays, push-pulls of every key
    and of one key at a time; as host arrays."""
    rng = np.random.default_rng(34)
    hosts = [rng.standard_normal(shape).astype(BF16 if dtype == "bfloat16" else np.dtype(dtype))
             for dtype in ROUTE_DTYPES for shape in ROUTE_SHAPES.values()]
    keys = [f"{dtype}-{name}" for dtype in ROUTE_DTYPES for name in ROUTE_SHAPES]
    kv.init(keys, [values.make(host) for host in hosts])
    pulled = []

    def taken(arrays):
        pulled.append([np.array(backend.to_host(array), copy=True) for array in arrays])

    for _ in range(2):
        grads = [rng.standard_normal(host.shape).astype(host.dtype) for host in hosts]
        kv.push(keys, [[values.make(grad), values.make(grad)] for grad in grads])
        outs = [values.make(np.full(host.shape, 7, host.dtype)) for host in hosts]
        kv.pull(keys, out=outs)
        taken(outs)
        kv.pushpull(keys, [values.make(rng.standard_normal(host.shape).astype(host.dtype)) for host in hosts],
                    out=outs)
        taken(outs)
        taken(kv.pull(keys))
        for key, host, out in zip(keys, hosts, outs):
            kv.pushpull(key, values.make(rng.standard_normal(host.shape).astype(host.dtype)), out=out)
        taken(outs)
    return pulled


def _assert_same_bits(pulled, reference):
    """Each value of ``pulled`` (of :func:`_rounds`) is bit for bit that of ``reference``."""
    assert len(pulled) == len(reference)
    keys = [f"{dtype}-{name}" for dtype in ROUTE_DTYPES for name in ROUTE_SHAPES]
    for step, (got, want) in enumerate(zip(pulled, reference)):
        for key, a, b in zip(keys, got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, (step, key)
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"pull {step}, key {key}: not bit for bit"


def _info_routes(cluster):
    """WorkerLease.route of each server's workers."""
    routes = []
    for address in cluster.addresses:
        with grpc.insecure_channel(address) as channel:
            info = kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL)
        routes += [lease.route for lease in info.workers]
    return routes


@pytest.fixture(scope="module")
def gpu_servers(tmp_path_factory):
    if cupy is None:
        pytest.skip("CuPy sees no CUDA device")
    tmp = tmp_path_factory.mktemp("gpu-routes")
    with Cluster(servers=2, tmp_path=tmp, server_args=("--device", "cuda:0")) as cluster:
        yield cluster, tmp


@pytest.fixture(scope="module")
def numpy_rounds(gpu_servers):
    """The values the NumPy route pulls (plain shared memory), to compare each route with."""
    cluster, _ = gpu_servers
    with _route_store(cluster, "numpy") as kv:
        pulled = _rounds(kv, _Values("numpy"))
        assert _info_routes(cluster) == [INFO_ROUTES["numpy"]] * 2
    return pulled


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("route", ["cuda-ipc", "pinned-shm", "tcp"])
def test_gpu_values_over_each_route_match_the_numpy_route_bit_for_bit(gpu_servers, numpy_rounds, route, kind):
    cluster, tmp = gpu_servers
    values = _Values(kind)
    with _route_store(cluster, route) as kv:
        pulled = _rounds(kv, values)
        sessions = kv._sessions
        if route == "cuda-ipc":
            assert all(session.cuda_buffers for session in sessions)
        elif route == "pinned-shm":
            assert all(session.region is not None and session.region.pinned and not session.cuda_buffers
                       for session in sessions)
        else:
            assert all(session.region is None for session in sessions)
        assert _info_routes(cluster) == [INFO_ROUTES[route]] * 2
    _assert_same_bits(pulled, numpy_rounds)
    if route == "cuda-ipc":  # each server closed the worker's CUDA IPC buffers as its stream ended
        logs = [tmp / f"server{index}.log" for index in range(2)]
        released = re.compile(r"and [1-9][0-9]* CUDA IPC buffer\(s\) of")
        wait_until(lambda: all(released.search(log.read_text()) for log in logs), "the CUDA IPC buffers released")
        assert all("large values travel by CUDA IPC (device to device)" in log.read_text() for log in logs)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_gpu_values_to_a_cpu_server_on_this_host_match_numpy_values(tmp_path, kind):
    """A CPU server pins no region: GPU values are copied into the worker's pinned buffer, and
    from there into plain shared memory (once those copies are done)."""
    with Cluster(servers=2, tmp_path=tmp_path, server_args=("--device", "cpu")) as cluster:
        with _route_store(cluster, "numpy") as kv:
            reference = _rounds(kv, _Values("numpy"))
        with _route_store(cluster, "shm") as kv:
            pulled = _rounds(kv, _Values(kind))
            assert all(session.region is not None and not session.region.pinned and not session.cuda_buffers
                       for session in kv._sessions)
        assert _info_routes(cluster) == [INFO_ROUTES["numpy"]] * 2
    _assert_same_bits(pulled, reference)


def _keep_busy(stream, cycles=200_000_000):
    """Queue a kernel that spins for ``cycles`` GPU clock cycles (about 0.1 s) on ``stream``."""
    spin = cupy.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }""", "spin")
    with stream:
        spin((1,), (1,), (np.int64(cycles),))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("written_by", ["cpu", "gpu"])
def test_a_pulled_value_still_on_its_way_into_a_busy_stream_is_not_overwritten_by_the_next_call(
        gpu_servers, written_by):
    """Pinned shared memory: a pulled value's copy from the region into its out array waits on
    the out array's stream (a non-blocking one, kept busy); the next call writes the same place
    of the region, by the CPU (a NumPy value pushed beside CuPy ones) or by a copy out of the GPU
    on another stream, only once that copy read it."""
    cluster, _ = gpu_servers
    n = 4 * ROUTE_BOUND  # sliced over both servers: each pulls into, then pushes from, the same area
    with _route_store(cluster, "pinned-shm") as kv:
        kv.init(["w", "g"], [cupy.arange(n, dtype=cupy.float32), cupy.zeros(n, cupy.float32)])
        out, busy = cupy.zeros(n, cupy.float32), cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.Device().synchronize()
        _keep_busy(busy)
        with busy:
            kv.pull("w", out=out)
        if written_by == "cpu":
            kv.push(["w", "g"], [np.full(n, -1, np.float32), cupy.ones(n, cupy.float32)])
        else:
            kv.push("w", cupy.full(n, -1, cupy.float32))
        busy.synchronize()
        cupy.testing.assert_array_equal(out, cupy.arange(n, dtype=cupy.float32))
        cupy.testing.assert_array_equal(kv.pull("w"), np.full(n, -1, np.float32))
        assert all(session.region.pinned for session in kv._sessions)


# Registers a shared-memory region of its own on a raw Session stream to argv[1] as uid and gid
# argv[2], then asks the server to open a CUDA IPC buffer (a handle of zeros: it must be
# refused before the driver sees it), and prints the answer's code and message. It imports
# what it needs and makes its channel as root (gRPC connects at the first call, as that user).
_FOREIGN_CUDA_BUFFER = """
import os, sys, grpc
from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.transport.session import RawSession as Session
from tensorkv.v1 import kvstore_pb2
address, nobody = sys.argv[1], int(sys.argv[2])
session = Session(grpc.insecure_channel(address, options=CHANNEL_OPTIONS), address, shm_allowed=True)
os.setgroups([])
os.setresgid(nobody, nobody, nobody)
os.setresuid(nobody, nobody, nobody)
def build(call_id, timeout_ms, region, channel):
    buffer = kvstore_pb2.CudaIpcBuffer(handle=bytes(64), size=1 << 20, pci_bus_id="0000:00:00.0")
    return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_REGISTER_CUDA_BUFFER,
                                      cuda_buffer=buffer).SerializeToString(), ()
answer = kvstore_pb2.SessionResponse.FromString(session.call(build, 30.0, shm_bytes=1 << 20)[1])
assert session.region is not None and session.region.id, "its own region was not attached"
print(answer.code, answer.message)
session.close()
"""


@pytest.mark.gpu
@requires_gpu
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root, to run a caller as nobody")
def test_cuda_ipc_is_refused_to_a_caller_of_another_user(tmp_path):
    """A caller of another user proves its host with a region of its own, and still gets no
    CUDA IPC buffer opened: a handle alone does not say whose memory it is."""
    with Cluster(tmp_path=tmp_path, server_args=("--device", "cuda:0")) as cluster:
        done = subprocess.run([sys.executable, "-c", _FOREIGN_CUDA_BUFFER, cluster.addresses[0], str(NOBODY)],
                              capture_output=True, text=True, timeout=90)
        log = (tmp_path / "server0.log").read_text()
    assert done.returncode == 0, done.stderr
    code, message = done.stdout.strip().split(" ", 1)
    assert int(code) == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert message == (f"CUDA IPC is for callers of the server's own user (uid 0) or root; this one is uid {NOBODY}")
    assert f"this one is uid {NOBODY}" in log
