"""torch tensors on the host in every store: pulls into Parameters that require grad, and
no torch warnings. Skipped where torch is not installed (`make test` installs none)."""
import json

import numpy as np
import pytest

import tensorkv

from cluster import Cluster, check_workers, one_worker_store

torch = pytest.importorskip("torch")


@pytest.fixture(params=["local", "dist_sync"])
def kv(request, tmp_path):
    with one_worker_store(request.param, tmp_path) as store:
        yield store


def test_pull_pushpull_and_broadcast_write_into_a_parameter_that_requires_grad(kv):
    kv.init("w", np.arange(4, dtype=np.float32))
    weight = torch.nn.Parameter(torch.zeros(4))
    kv.pull("w", out=weight)
    assert weight.tolist() == [0, 1, 2, 3] and weight.requires_grad and weight.is_leaf
    kv.pushpull("w", torch.ones(4), out=weight)
    assert weight.tolist() == [1, 1, 1, 1]
    bias = torch.nn.Parameter(torch.zeros(2))
    kv.broadcast("b", np.full(2, 5, np.float32), out=bias)
    assert bias.tolist() == [5, 5]
    (weight * weight).sum().backward()  # still a parameter autograd trains
    assert weight.grad.tolist() == [2, 2, 2, 2]


def test_a_pull_between_forward_and_backward_is_seen_by_autograd(kv):
    kv.init("w", np.ones(4, np.float32))
    weight = torch.nn.Parameter(torch.zeros(4))
    loss = (weight * weight).sum()  # saves weight for backward
    kv.pull("w", out=weight)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_float64_tensor_into_a_float32_key_says_how_to_cast(kv):
    kv.init("w", torch.zeros(4))
    with pytest.raises(tensorkv.DtypeMismatchError, match=r"cast it with value.astype\(numpy.float32\) "
                                                          r"\(a torch tensor: value.to\(torch.float32\)\)$"):
        kv.push("w", torch.ones(4, dtype=torch.float64))
    assert kv.pull("w").tolist() == [0, 0, 0, 0]


def test_a_dist_pull_into_torch_tensors_gives_no_torch_warning(tmp_path):
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        (code, out, err), = cluster.run_workers("torch_pull")  # its own process: torch warns once per process
    check_workers([(code, out, err)])
    assert json.loads(out) == [[0, 1, 2, 3], [0, 1, 2, 3], True]
    assert err == ""
