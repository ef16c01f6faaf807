"""Messages as a user reads them: counts with the right plural, and how to fix a dtype."""
import ml_dtypes
import numpy as np
import pytest

import tensorkv
from tensorkv.wire import states_file

from cluster import Cluster


@pytest.mark.parametrize("stored, pushed, cast", [
    (np.float32, np.float64, "numpy.float32"),
    (ml_dtypes.bfloat16, np.float32, "ml_dtypes.bfloat16"),
])
def test_a_dtype_mismatch_says_how_to_cast_on_every_store(tmp_path, stored, pushed, cast):
    expected = (f"key 'w': pushed dtype {np.dtype(pushed)} does not match the stored dtype {np.dtype(stored)}; "
                f"cast it with value.astype({cast}) (a torch tensor: value.to(torch.{np.dtype(stored)}))")
    with tensorkv.create("local") as kv:
        kv.init("w", np.zeros(3, stored))
        with pytest.raises(tensorkv.DtypeMismatchError) as caught:
            kv.push("w", np.ones(3, pushed))
        assert str(caught.value) == expected
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=0) as first, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=1) as second:
        first.init("w", np.zeros(3, stored))
        with pytest.raises(tensorkv.DtypeMismatchError) as caught:  # checked by this worker
            first.push("w", np.ones(3, pushed))
        assert str(caught.value) == expected
        with pytest.raises(tensorkv.DtypeMismatchError) as caught:  # knows nothing of 'w': checked by the server
            second.push("w", np.ones(3, pushed))
        assert str(caught.value) == expected
        assert first.pull("w").tolist() == [0, 0, 0]


def test_one_worker_is_one_worker(tmp_path):
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        with pytest.raises(tensorkv.FailedPreconditionError,
                           match=r"rank 3 is out of range: this server expects 1 worker \(rank 0\)$"):
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=3)
        with pytest.raises(tensorkv.FailedPreconditionError, match=r"expects 1 worker, this worker was told 2$"):
            tensorkv.create("dist_sync", servers=cluster.addresses, num_workers=2)


def test_one_state_array_is_one_state_array(tmp_path):
    fname = str(tmp_path / "states")
    sgd = tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9)  # keeps one state array per key
    states_file.save(fname, sgd, {"w": (1, [np.zeros(3, np.float32)] * 2)})
    with tensorkv.create("local") as kv:
        kv.init("w", np.zeros(3, np.float32))
        with pytest.raises(tensorkv.InvalidArgumentError, match="optimizer 'sgd' keeps 1 state array, got 2$"):
            kv.load_optimizer_states(fname)
