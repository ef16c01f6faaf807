"""Every dtype of the contract through a real server: init, push of a per-device list
(summed), pull into `out` and with `out=None`, with int and with str keys."""
import grpc
import ml_dtypes
import numpy as np
import pytest

import tensorkv
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import Cluster

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
          np.int8, np.int16, np.int32, np.int64, np.uint8]


@pytest.mark.parametrize("key_type", [int, str])
def test_every_dtype_round_trips_through_a_server(key_type, tmp_path):
    keys = [key_type(i) for i in range(len(DTYPES))]
    values = [np.arange(6).reshape(2, 3).astype(dtype) for dtype in DTYPES]
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init(keys, values)
            kv.push(keys, [[v, v] for v in values])
            outs = [np.zeros_like(v) for v in values]
            kv.pull(keys, out=outs)
            fresh = kv.pull(keys)
    for value, out, new in zip(values, outs, fresh):
        expected = (value.astype(np.float64) * 2).astype(value.dtype)
        assert out.dtype == value.dtype and new.dtype == value.dtype
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(new, expected)


@pytest.mark.parametrize("transport", ["auto", "tcp", "grpc"])
def test_a_dtype_outside_the_contract_is_refused_naming_its_key(transport, tmp_path):
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport) as kv:
            for key, value in (("u", np.zeros(4, np.uint16)), ("big", np.zeros(1 << 16, np.complex64))):
                with pytest.raises(tensorkv.InvalidTensorError,
                                   match=f"^key '{key}': dtype {value.dtype} is not supported; use one of "):
                    kv.init(key, value)
            with pytest.raises(tensorkv.KeyNotFoundError):  # nothing was stored
                kv.pull("u")


def test_multi_precision_on_a_server_survives_a_restart_and_moves_to_a_local_store(tmp_path):
    """A float16 key with SGD(multi_precision=True) on a server: its float32 master copy is an
    optimizer state, so it is in the snapshot a killed server restores and in the states file
    an embedded store loads, and the weight goes on as one uninterrupted run (MXNet 1.9.1: 20
    steps of 1e-4 from 1.7636 give 1.76171875; without the copy, 1.763671875)."""
    sgd = tensorkv.optimizer.SGD(learning_rate=0.1, multi_precision=True)
    step = np.full(4, 1e-3, np.float16)
    with Cluster(num_workers=1, tmp_path=tmp_path, server_args=["--state-dir", str(tmp_path / "state")]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("w", np.full(4, 1.7636, np.float16))
            kv.set_optimizer(sgd)
            for _ in range(10):
                kv.push("w", step)
        kvstore_pb2_grpc.KVStoreServiceStub(grpc.insecure_channel(cluster.addresses[0])).Snapshot(
            kvstore_pb2.SnapshotRequest(), timeout=10)
        cluster.restart()  # SIGKILL, then the snapshot
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="resume") as kv:
            for _ in range(5):
                kv.push("w", step)
            kv.save_optimizer_states(str(tmp_path / "states"))
            weight = kv.pull("w")
    with tensorkv.create("local") as kv:
        kv.init("w", weight)
        kv.load_optimizer_states(str(tmp_path / "states"))
        for _ in range(5):
            kv.push("w", step)
        assert kv.pull("w").tolist() == [1.76171875] * 4
