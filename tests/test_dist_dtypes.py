"""Every dtype of the contract through a real server: init, push of a per-device list
(summed), pull into `out` and with `out=None`, with int and with str keys."""
import ml_dtypes
import numpy as np
import pytest

import tensorkv

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
