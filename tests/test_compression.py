"""2-bit gradient compression (kv.set_gradient_compression) and kv.is_capable, as MXNet 1.9's.

The expected values come from MXNet's quantize_2bit written out here element by element:
each worker sums its arrays, adds the sum to its residual, sends +t where the residual is
>= t, -t where it is <= -t, 0 elsewhere, and takes what it sent off the residual; the
server sums the workers' values (and assigns the sum: no optimizer)."""
import json

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.update import compression
from tensorkv.wire.codec import set_key
from tensorkv.transport.rpc import Stub
from tensorkv.v1 import kvstore_pb2, tensor_pb2

from cluster import Cluster, check_workers
from workers.compressed_rounds import gradients

ROUNDS = 7


def quantize_by_hand(value, residual, threshold):
    """MXNet's quantize_2bit, one element at a time: the values sent; ``residual`` updated."""
    sent = np.zeros_like(value)
    for i in range(value.size):
        residual[i] += value[i]
        if residual[i] >= threshold:
            sent[i] = threshold
            residual[i] -= threshold
        elif residual[i] <= -threshold:
            sent[i] = -threshold
            residual[i] -= -threshold
    return sent


def pack_by_hand(sent, threshold):
    """The bytes MXNet's quantize_2bit writes for ``sent``: element i at bits 7-6, 5-4, 3-2, 1-0
    of byte i // 4 for i % 4 = 0..3; 0b11 for +threshold, 0b10 for -threshold."""
    packed = np.zeros(-(-sent.size // 4), np.uint8)
    for i, value in enumerate(sent):
        code = 0b11 if value == threshold else 0b10 if value == -threshold else 0
        packed[i // 4] |= code << (6 - 2 * (i % 4))
    return packed


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 16, 33])
def test_codes_and_packing_are_mxnets(size):
    rng = np.random.default_rng(size)
    residual = (rng.integers(-6, 7, size) * 0.25).astype(np.float32)
    expected_residual = residual.copy()
    for _ in range(3):
        value = (rng.integers(-6, 7, size) * 0.25).astype(np.float32)
        sent = quantize_by_hand(value, expected_residual, np.float32(0.5))
        packed = compression.pack(compression.quantize(value, residual, 0.5))
        assert packed.tolist() == pack_by_hand(sent, 0.5).tolist()
        assert np.array_equal(residual, expected_residual)
        assert np.array_equal(compression.dequantize(packed, size, 0.5), sent)


def test_a_compressor_quantizes_values_of_any_layout_over_rounds():
    """Fortran-ordered and strided pushes are quantized element by element as C-ordered ones,
    with the residual carried over the rounds."""
    rng = np.random.default_rng(7)
    compressor = compression.Compressor(0.5)
    expected_residual = np.zeros(12, np.float32)
    for round_ in range(4):
        value = (rng.integers(-6, 7, (3, 8)) * 0.25).astype(np.float32)[:, ::2]  # strided
        pushed = np.asfortranarray(value) if round_ % 2 == 0 else value
        sent = quantize_by_hand(value.reshape(-1), expected_residual, np.float32(0.5))
        (packed,), residual = compressor.codes("w", pushed)
        compressor.keep({"w": residual})
        assert np.array_equal(compressor.values(packed, value.shape).reshape(-1), sent)
        assert np.array_equal(residual.reshape(-1), expected_residual)


@pytest.mark.parametrize("size, ranges", [(0, [None]), (1, [None]), (7, [None]), (1 << 16, [None]),
                                          (1003, [(0, 501), (501, 1003)]), (10, [(0, 3), (3, 6), (6, 10)])])
def test_the_compiled_host_pass_is_quantize_then_pack(size, ranges):
    """A worker's host values take one compiled pass (numba); CuPy values take quantize and
    pack: both give the same bytes and residuals, over rounds, for values that round."""
    rng = np.random.default_rng(size)
    compressor, residual = compression.Compressor(0.3), np.zeros(size, np.float32)
    for _ in range(4):
        value = rng.standard_normal(size).astype(np.float32)
        codes = compression.quantize(value, residual, 0.3)
        packed, kept = compressor.codes("w", value, ranges)
        compressor.keep({"w": kept})
        assert [part.tolist() for part in packed] == [
            compression.pack(codes if where is None else codes[where[0]:where[1]]).tolist() for where in ranges]
        assert kept.tolist() == residual.tolist()


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 33, 1 << 16])
def test_the_compiled_host_pass_reads_codes_as_dequantize(size):
    """A server's host codes take one compiled pass (numba); CuPy codes take dequantize: both
    give the same values, bit for bit, for every byte, from read-only bytes too (as they come
    off the wire)."""
    rng = np.random.default_rng(size)
    packed = rng.integers(0, 256, -(-size // 4), dtype=np.uint8)
    for threshold in (0.5, 0.3, 1e-3):
        expected = compression.dequantize(packed, size, threshold)
        for codes in (packed, np.frombuffer(packed.tobytes(), np.uint8)):
            got = compression.Compressor(threshold).values(codes, (size,))
            assert got.dtype == np.float32 and got.shape == (size,)
            assert got.view(np.uint32).tolist() == expected.view(np.uint32).tolist()


def expected_rounds(num_workers, size, key, threshold):
    """The value pulled after each round: the sum over workers of what each sent."""
    residuals = [np.zeros(size, np.float32) for _ in range(num_workers)]
    rounds = []
    for t in range(1, ROUNDS + 1):
        total = np.zeros(size, np.float32)
        for rank in range(num_workers):
            first, second = gradients(rank, key, size, t)
            total += quantize_by_hand(first + second, residuals[rank], np.float32(threshold))
        rounds.append(total.tolist())
    return rounds


@pytest.mark.parametrize("servers", [1, 2])
def test_two_workers_push_two_devices_compressed_exactly_over_rounds(servers, tmp_path):
    big, threshold = 50, 1.5
    with Cluster(servers=servers, num_workers=2, tmp_path=tmp_path) as cluster:
        outs = check_workers(cluster.run_workers("compressed_rounds", ROUNDS, threshold, big,
                                                 env={"TENSORKV_BIGARRAY_BOUND": "20"}))
    expected_w, expected_big = expected_rounds(2, 15, "w", threshold), expected_rounds(2, big, "big", threshold)
    assert any(v != 0 for round_ in expected_w for v in round_)  # the residuals carry over rounds
    for out in outs:
        pulled = json.loads(out)["pulled"]
        assert [w for w, _ in pulled] == expected_w
        assert [b for _, b in pulled] == expected_big


@pytest.fixture
def dist(tmp_path):
    """A dist_sync store of one worker on 2 servers, keys of more than 8 elements sliced."""
    with Cluster(servers=2, num_workers=1, tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, bigarray_bound=8) as kv:
        yield kv


@pytest.mark.parametrize("params, words", [
    ({"type": "1bit", "threshold": 0.5}, "unknown type for gradient compression '1bit'"),
    ({"type": "2bit", "threshold": 0}, "must be greater than 0"),
    ({"type": "2bit", "threshold": -1.0}, "must be greater than 0"),
    ({"type": "2bit", "threshold": float("nan")}, "must be greater than 0"),
    ({"type": "2bit", "threshold": "half"}, "is a number, not 'half'"),
    ({"threshold": 0.5}, "has no 'type'"),
    ({"type": "2bit", "treshold": 0.5}, "takes 'threshold' only, not 'treshold'"),
    ("2bit", "is a dict"),
])
def test_bad_compression_params_are_refused_and_pushes_stay_exact(dist, params, words):
    dist.init("w", np.zeros(4, np.float32))
    with pytest.raises(tensorkv.InvalidArgumentError, match=words) as refused:
        dist.set_gradient_compression(params)
    assert isinstance(refused.value, ValueError)
    dist.push("w", np.full(4, 0.3, np.float32))
    assert dist.pull("w").tolist() == np.full(4, 0.3, np.float32).tolist()


def test_threshold_defaults_to_mxnets_and_a_new_threshold_keeps_the_residuals(dist):
    dist.init("w", np.zeros(10, np.float32))
    dist.set_gradient_compression({"type": "2bit"})
    residual, value = np.zeros(10, np.float32), np.full(10, 0.75, np.float32)
    dist.push("w", value)
    assert dist.pull("w").tolist() == quantize_by_hand(value, residual, np.float32(0.5)).tolist()
    dist.set_gradient_compression({"type": "2bit", "threshold": 0.25})
    dist.push("w", value)
    assert dist.pull("w").tolist() == quantize_by_hand(value, residual, np.float32(0.25)).tolist()


def test_a_refused_push_changes_neither_the_value_nor_the_residual(dist):
    dist.init(["w", "d"], [np.zeros(10, np.float32), np.ones(10)])
    dist.set_gradient_compression({"type": "2bit", "threshold": 1.0})
    with pytest.raises(tensorkv.InvalidArgumentError, match="key 'd': gradient compression is only for float32"):
        dist.push(["w", "d"], [np.full(10, 0.75, np.float32), np.ones(10)])
    with pytest.raises(tensorkv.KeyNotFoundError):
        dist.push(["w", "never"], [np.full(10, 0.75, np.float32), np.ones(10, np.float32)])
    assert dist.pull("w").tolist() == [0.0] * 10 and dist.pull("d").tolist() == [1.0] * 10
    dist.push("w", np.full(10, 0.75, np.float32))  # a residual of 0.75 still: nothing sent
    assert dist.pull("w").tolist() == [0.0] * 10
    dist.push("w", np.full(10, 0.75, np.float32))
    assert dist.pull("w").tolist() == [1.0] * 10


def test_a_push_sent_without_waiting_that_fails_puts_its_residual_back(tmp_path):
    """A compressed push of known keys is sent without waiting for its answer; refused by the
    server (4 keys over --max-keys-per-call 3), it changes neither the values nor the residuals.
    Before: a compressed push waited for its answer, one round trip more."""
    keys = ["k0", "k1", "k2", "k3"]
    with Cluster(tmp_path=tmp_path, server_args=["--max-keys-per-call", "3"]) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
        kv.init(keys[:3], [np.zeros(4, np.float32)] * 3)
        kv.init(keys[3], np.zeros(4, np.float32))
        kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
        kv.push("k0", np.full(4, 0.75, np.float32))  # residual 0.75: nothing sent
        kv.push(keys, [np.full(4, 0.75, np.float32)] * 4)  # would send 1.0 and leave 0.5
        with pytest.raises(tensorkv.ResourceExhaustedError,
                           match="an earlier push of 4 keys .* failed and changed nothing: .*--max-keys-per-call"):
            kv.pull("k0")
        kv.push("k0", np.full(4, 0.25, np.float32))  # 0.75 + 0.25 reaches the threshold
        assert [kv.pull(key).tolist() for key in keys] == [[1.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 4]


def test_a_push_that_fails_on_one_server_puts_back_only_that_servers_residuals(tmp_path):
    """Of a compressed push sent without waiting to 2 servers, server 0 refuses its part (4
    keys and a slice of 'big': over --max-keys-per-call 4) and server 1 applies its own ('a4',
    the other slice of 'big'): the residuals of server 0's keys and slice are put back, those
    of server 1's move on. Threshold 1: a push of 0.75 on a residual of 0.75 sends 1."""
    small = ["a0", "a1", "a2", "a3"]  # 4 elements each, on server 0; "a4" on server 1 (tensorkv.stores.spread.home)
    keys = small + ["a4", "big"]  # "big": 10 elements, sliced 5 and 5 over the servers
    values = {key: np.zeros(10 if key == "big" else 4, np.float32) for key in keys}

    def full(value, key_list):
        return [np.full_like(values[key], value) for key in key_list]

    with Cluster(servers=2, tmp_path=tmp_path, server_args=["--max-keys-per-call", "4"]) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, bigarray_bound=8) as kv:
        kv.init(small, full(0, small))
        kv.init(["a4", "big"], full(0, ["a4", "big"]))
        kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
        kv.push(["a0", "a4", "big"], full(0.75, ["a0", "a4", "big"]))  # residuals 0.75: nothing sent
        kv.push(keys, full(0.75, keys))  # sends 1 for a0, a4 and big
        with pytest.raises(tensorkv.ResourceExhaustedError, match="an earlier push of 5 keys .* failed and changed "
                                                                  "nothing: .*--max-keys-per-call"):
            kv.pull("a0")
        assert [kv.pull(key).tolist() for key in keys] == [[0.0] * 4] * 4 + [[1.0] * 4, [0.0] * 5 + [1.0] * 5]
        kv.push(["a0", "a4", "big"], full(0.25, ["a0", "a4", "big"]))
        # a0 and big's first half: 0.75 + 0.25 sends 1; a4 and big's second half: 0.5 + 0.25 sends 0
        assert [kv.pull(key).tolist() for key in ["a0", "a4", "big"]] == \
            [[1.0] * 4, [0.0] * 4, [1.0] * 5 + [0.0] * 5]


def test_a_local_store_refuses_compression_as_mxnet_does():
    with tensorkv.create("local") as kv:
        with pytest.raises(tensorkv.FailedPreconditionError, match="not supported for a 'local' KVStore"):
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})


def test_a_device_store_compresses_each_device_array_as_mxnet_does():
    """MXNet 1.9.1's 'device' store quantizes each device's array with a residual of its own,
    then sums what they stand for (for [0.3, 0.6, -0.7, 0.2, 1.5] on two devices, threshold
    0.5, it pulls [0, 1, -1, 0, 1], then [1, 1, -1, 0, 1], then [0, 1, -1, 1, 1])."""
    threshold = np.float32(0.5)
    with tensorkv.create("device") as kv:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init(["w", "d"], [np.zeros(5, np.float32), np.zeros(5)])
        residuals = [np.zeros(5, np.float32), np.zeros(5, np.float32)]
        for t in range(1, 5):
            arrays = [np.array([0.3, 0.6, -0.7, 0.2, 1.5], np.float32) * t, np.full(5, 0.25 * t, np.float32)]
            expected = sum(quantize_by_hand(a, r, threshold) for a, r in zip(arrays, residuals))
            out = np.zeros(5, np.float32)
            if t % 2:
                kv.push("w", arrays)
                kv.pull("w", out=out)
            else:
                kv.pushpull("w", arrays, out=out)
            assert out.tolist() == expected.tolist()
            with pytest.raises(tensorkv.InvalidArgumentError, match="key 'd': gradient compression is only for float32"):
                kv.push(["w", "d"], [arrays, np.ones(5)])
            assert kv.pull("w").tolist() == expected.tolist()  # neither the value nor the residuals changed


def test_is_capable_names_the_optimizer_only(dist):
    with tensorkv.create("local") as local:
        for kv in (local, dist):
            assert kv.is_capable(tensorkv.KVStore.OPTIMIZER) is True
            assert kv.is_capable("Optimizer") is True
            with pytest.raises(tensorkv.InvalidArgumentError, match="Unknown capability: 'sparse'") as refused:
                kv.is_capable("sparse")
            assert isinstance(refused.value, ValueError)


def _entry(key, codes, dtype=tensor_pb2.DTYPE_FLOAT32, shape=(8,), threshold=0.5):
    entry = tensor_pb2.Entry(tensor=tensor_pb2.Tensor(dtype=dtype, shape=shape, data=codes),
                             two_bit=tensor_pb2.TwoBitCodes(threshold=threshold))
    set_key(entry.key, key)
    return entry


@pytest.mark.parametrize("entry, words", [
    (_entry("w", b"\xff\xff\xff"), "needs 2 bytes, got 3"),
    (_entry("w", b"\xff\xff", dtype=tensor_pb2.DTYPE_FLOAT64), "2-bit codes stand for float32 values"),
    (_entry("w", b"\xff\xff", threshold=0.0), "threshold 0.0 is not > 0"),
    (_entry("d", b"\xff\xff"), "pushed dtype float32"),
])
def test_a_server_refuses_malformed_codes_and_codes_outside_pushes(tmp_path, entry, words):
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster, grpc.insecure_channel(cluster.addresses[0]) as channel, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=0) as kv:
        kv.init(["w", "d"], [np.zeros(8, np.float32), np.zeros(8)])
        registered = Stub(channel).Register(kvstore_pb2.RegisterRequest(rank=1), timeout=10)
        caller = dict(rank=1, incarnation=registered.incarnation)
        path = "/tensorkv.v1.KVStoreService/"
        push = channel.stream_unary(path + "Push")
        init = channel.stream_unary(path + "Init")
        with pytest.raises(grpc.RpcError) as refused:
            push(iter([kvstore_pb2.PushRequest(frame=tensor_pb2.TensorFrame(entries=[entry]), **caller)
                       .SerializeToString()]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
        good = _entry("x", b"\xff\xff")
        with pytest.raises(grpc.RpcError) as refused:
            init(iter([kvstore_pb2.InitRequest(frame=tensor_pb2.TensorFrame(entries=[good]), **caller)
                       .SerializeToString()]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2-bit" in refused.value.details()
        assert kv.pull("w").tolist() == [0.0] * 8 and kv.pull("d").tolist() == [0.0] * 8
