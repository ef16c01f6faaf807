"""The GPU path: values on a CUDA device through CuPy, in the 'device' store and in a server
started with ``--device cuda``; CuPy arrays and torch CUDA tensors handed to every store type.

``make test-gpu`` runs this file on a machine with a CUDA device and CuPy; everywhere else
its GPU tests are skipped, and only the check that asking for a GPU without one fails
clearly runs. The GPU tests compare against the NumPy engine that the CPU suite covers.
"""
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv import backend
from tensorkv.errors import InvalidTensorError
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import Cluster, check_workers

cupy = backend.cupy_or_none()
requires_gpu = pytest.mark.skipif(cupy is None, reason="CuPy sees no CUDA device")

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"]
OPTIMIZERS = [
    ("sgd", dict(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5)),
    ("sgd", dict(learning_rate=0.1, clip_gradient=0.3)),
    ("adam", dict(learning_rate=0.01, wd=0.001)),
    ("adagrad", dict(learning_rate=0.1, wd=0.01)),
    ("rmsprop", dict(learning_rate=0.01, centered=True, clip_weights=2.0)),
    ("signum", dict(learning_rate=0.01, wd_lh=0.01)),
]


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


def _server_device(address):
    with grpc.insecure_channel(address) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=5).device


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
def test_bfloat16_on_the_device_store_is_refused_with_the_key_named():
    import ml_dtypes
    with tensorkv.create("device") as kv, pytest.raises(InvalidTensorError, match="key 'w'.*bfloat16"):
        kv.init("w", np.zeros(4, ml_dtypes.bfloat16))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("name, params", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_optimizers_on_the_gpu_match_the_cpu(name, params, dtype):
    rng = np.random.default_rng(7)
    weight = rng.standard_normal(1000).astype(dtype)
    grads = [rng.standard_normal(1000).astype(dtype) for _ in range(5)]
    results = {}
    for store in ("local", "device"):
        with tensorkv.create(store) as kv:
            kv.set_optimizer(tensorkv.optimizer.create(name, **params))
            kv.init(0, weight)
            for grad in grads:
                kv.push(0, grad if store == "local" else cupy.asarray(grad))
            results[store] = kv.pull(0)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2e-3, atol=2e-3)
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
