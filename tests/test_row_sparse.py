"""Row-sparse values (issue 18 item 3): row_sparse_pull and row-sparse pushes with MXNet's
lazy updates, on the embedded stores and on real server processes (1 and 2 servers, a
value sliced over both, 2 workers in dist_sync); bad row ids refused with nothing changed."""
import signal

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.wire.codec import Item, StreamDecoder, encode_stream
from tensorkv.wire.rowsparse_wire import set_row_ids, set_value
from tensorkv.transport.rpc import Stub
from tensorkv.v1 import kvstore_pb2
from cluster import Cluster, check_workers
from workers import row_sparse_rounds

OPTIMIZERS = ["none", "sgd", "adam"]
# Slices [0, 31) and [31, 63) of row_sparse_rounds.SHAPE on 2 servers: row 4 is cut.
SLICED = {"TENSORKV_BIGARRAY_BOUND": "20"}


@pytest.mark.parametrize("store", ["local", "device"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_embedded_store(store, name):
    with tensorkv.create(store) as kv:
        row_sparse_rounds.run(kv, name)


@pytest.mark.parametrize("servers, workers", [(1, 1), (2, 2)])
def test_servers_with_rounds_of_row_sparse_pushes(tmp_path, servers, workers):
    """Lazy SGD with momentum and Adam, and no optimizer, exact against the formulas; on 2
    servers 'w' is sliced over both and the 2 workers' rows are summed per row."""
    with Cluster(servers=servers, num_workers=workers, tmp_path=tmp_path) as cluster:
        for name in OPTIMIZERS:
            results = cluster.run_workers("row_sparse_rounds", "dist_sync", name, env=SLICED)
            assert sorted(check_workers(results)) == [f"ok {rank}\n" for rank in range(workers)]
            tensorkv.reset(cluster.addresses)


def test_each_server_is_asked_only_for_the_rows_in_its_slice(tmp_path, monkeypatch):
    """With the server of the other slice stopped (SIGSTOP), rows of one slice still come
    back: nothing was asked of the stopped one. A row cut by the boundary needs both."""
    monkeypatch.setenv("TENSORKV_BIGARRAY_BOUND", "20")
    value = np.arange(63, dtype=np.float32).reshape(9, 7)  # slices [0, 31) and [31, 63): row 4 is cut
    with Cluster(servers=2, tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, timeout=2) as kv:
        kv.init("w", value)
        for stopped, rows in ((1, [0, 3, 0]), (0, [8, 5])):
            cluster.processes[stopped].send_signal(signal.SIGSTOP)
            try:
                np.testing.assert_array_equal(kv.row_sparse_pull("w", row_ids=rows), value[rows])
                with pytest.raises(tensorkv.DeadlineExceededError):
                    kv.row_sparse_pull("w", row_ids=[4])
            finally:
                cluster.processes[stopped].send_signal(signal.SIGCONT)
        np.testing.assert_array_equal(kv.row_sparse_pull("w", row_ids=[4, 3, 5]), value[[4, 3, 5]])


def test_bad_row_ids_sent_by_a_raw_stub_are_refused_and_change_nothing(tmp_path):
    value = np.arange(70, dtype=np.float32).reshape(10, 7)
    with Cluster(tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses) as kv, \
            grpc.insecure_channel(cluster.addresses[0]) as channel:
        kv.init("w", value)
        caller = dict(rank=kv.rank, incarnation=kv._registered[0])
        stub = Stub(channel)
        for ids in ([3, 10], [-2]):
            push = kvstore_pb2.RowSparsePushRequest(**caller)
            set_value(push.values.add(), "w", (10, 7), ids, np.ones((len(ids), 7), np.float32))
            with pytest.raises(grpc.RpcError) as refused:
                stub.RowSparsePush(push, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"key 'w': row id {ids[-1]} is out of range for a value of 10 rows" in refused.value.details()
            pull = kvstore_pb2.RowSparsePullRequest(**caller)
            set_row_ids(pull.keys.add(), "w", ids)
            with pytest.raises(grpc.RpcError) as refused:
                stub.RowSparsePull(pull, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"row id {ids[-1]}" in refused.value.details()
        short = kvstore_pb2.RowSparsePushRequest(**caller)
        set_value(short.values.add(), "w", (10, 7), [1, 2], np.ones((1, 7), np.float32))
        with pytest.raises(grpc.RpcError) as refused:
            stub.RowSparsePush(short, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        np.testing.assert_array_equal(kv.pull("w"), value)


def test_a_row_sparse_push_over_the_budget_is_refused_and_changes_nothing(tmp_path):
    """A RowSparsePush is one message, read whole by gRPC before the server's code runs: its
    bytes are counted in --max-inflight-bytes while it is merged, and one of more than the
    whole budget is refused with RESOURCE_EXHAUSTED naming the flag, the value unchanged, as a
    Push of as many bytes is. Before: not counted, and merged whatever its size."""
    value = np.arange(2048 * 64, dtype=np.float32).reshape(2048, 64)  # 512 KiB, rows of 256 bytes
    with Cluster(tmp_path=tmp_path, server_args=["--max-inflight-bytes", str(1 << 20)]) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses) as kv, \
            grpc.insecure_channel(cluster.addresses[0]) as channel:
        kv.init("w", value)
        caller = dict(rank=kv.rank, incarnation=kv._registered[0])
        stub = Stub(channel)
        big = kvstore_pb2.RowSparsePushRequest(**caller)
        ids = np.tile(np.arange(2048), 3)  # 1.5 MiB of rows
        set_value(big.values.add(), "w", value.shape, ids, np.ones((ids.size, 64), np.float32))
        with pytest.raises(grpc.RpcError) as refused:
            stub.RowSparsePush(big, timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"a row-sparse push needs {big.ByteSize()} bytes in flight (1.5 MiB), more than this server's whole " \
               "budget for bytes in flight of 1048576 bytes (1 MiB, --max-inflight-bytes)" in refused.value.details()
        np.testing.assert_array_equal(kv.pull("w"), value)
        small = kvstore_pb2.RowSparsePushRequest(**caller)
        set_value(small.values.add(), "w", value.shape, [3], np.ones((1, 64), np.float32))
        stub.RowSparsePush(small, timeout=10)


def test_row_sparse_pulls_on_a_raw_session_stream(tmp_path):
    """SESSION_OP_ROW_SPARSE_PULL answers the rows in the order asked (many rows on the data
    channel); a bad row id, or an entry that is a slice, is answered with INVALID_ARGUMENT
    naming the key (and the id)."""
    value = np.arange(70, dtype=np.float32).reshape(10, 7)
    with Cluster(tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, transport="tcp") as kv, \
            grpc.insecure_channel(cluster.addresses[0]) as channel:
        kv.init("w", value)
        fields = dict(op=kvstore_pb2.SESSION_OP_ROW_SPARSE_PULL, rank=kv.rank, incarnation=kv._registered[0])
        entries = [Item("w", np.array([4, 0, 4])), Item("w", np.array([3, 10])), Item("w", np.arange(1), (9,), (0, 1))]
        stream = channel.stream_stream("/tensorkv.v1.KVStoreService/Session")
        answers = list(stream(iter([encode_stream(kvstore_pb2.SessionRequest, [entry], dict(id=i, **fields),
                                                  chunk_bytes=1 << 62)[0] for i, entry in enumerate(entries)]),
                              timeout=10))
        decoder = StreamDecoder(kvstore_pb2.SessionResponse, "frame")
        decoder.feed(answers[0])
        np.testing.assert_array_equal(decoder.finish()[0].array, value[[4, 0, 4]])
        refused = [kvstore_pb2.SessionResponse.FromString(answer) for answer in answers[1:]]
        assert [answer.code for answer in refused] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 2
        assert "key 'w': row id 10 is out of range for a value of 10 rows" in refused[0].message
        assert "key 'w': a row-sparse pull's entry carries row ids, not a slice" in refused[1].message
        ids = np.random.default_rng(0).integers(0, 10, 5000)  # 140 KB of rows: on the data channel
        out = np.zeros((5000, 7), np.float32)
        kv.row_sparse_pull("w", out=out, row_ids=ids)
        np.testing.assert_array_equal(out, value[ids])


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_a_row_sparse_pull_over_the_per_call_limit_is_refused(tmp_path, transport):
    """Ids may repeat: a pull of a few bytes could ask for any number of rows (one of 60 KB
    once answered 937 MiB). An answer whose rows, with their ids, the answer message and its bytes
    (3 copies of 36 bytes a row here) would pass --max-inflight-bytes is refused, on either path."""
    value = np.arange(70, dtype=np.float32).reshape(10, 7)  # rows of 28 bytes
    with Cluster(tmp_path=tmp_path, server_args=["--max-inflight-bytes", "108000"]) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport) as kv:
        kv.init("w", value)
        np.testing.assert_array_equal(kv.row_sparse_pull("w", row_ids=np.zeros(1000, np.int64)), value[[0] * 1000])
        with pytest.raises(tensorkv.ResourceExhaustedError) as refused:
            kv.row_sparse_pull("w", row_ids=np.zeros(1001, np.int64))
        assert "a row-sparse pull of 1001 rows would answer 27.4 KiB of values, which with their row ids hold " \
               "105.6 KiB in flight while the answer is built and sent; this server's budget for bytes in flight " \
               "is 105.5 KiB (--max-inflight-bytes)" in str(refused.value)


@pytest.mark.parametrize("store", ["local", "dist_sync"])
def test_call_forms_and_misuse(tmp_path, store):
    with Cluster(tmp_path=tmp_path) if store != "local" else _nothing() as cluster, \
            tensorkv.create(store, **({"servers": cluster.addresses} if cluster else {})) as kv:
        kv.init("w", tensorkv.row_sparse(np.ones((1, 2), np.float32), [2], (4, 2)))
        np.testing.assert_array_equal(kv.pull("w"), [[0, 0], [0, 0], [1, 1], [0, 0]])
        with pytest.raises(tensorkv.InvalidArgumentError, match="row_sparse_pull needs row_ids"):
            kv.row_sparse_pull("w", out=np.zeros((4, 2), np.float32))
        with pytest.raises(tensorkv.ShapeMismatchError, match="holds neither the 1 rows asked"):
            kv.row_sparse_pull("w", out=np.zeros((2, 2), np.float32), row_ids=[1])
        with pytest.raises(tensorkv.DtypeMismatchError):
            kv.row_sparse_pull("w", out=np.zeros((1, 2)), row_ids=[1])
        with pytest.raises(tensorkv.InvalidArgumentError, match="cannot be mixed"):
            kv.push(["w", "w"], [tensorkv.row_sparse(np.ones((1, 2), np.float32), [0], (4, 2)),
                                 np.ones((4, 2), np.float32)])
        with pytest.raises(tensorkv.InvalidArgumentError, match="pushpull takes dense values"):
            kv.pushpull("w", tensorkv.row_sparse(np.ones((1, 2), np.float32), [0], (4, 2)))
        with pytest.raises(tensorkv.InvalidArgumentError, match=r"row_sparse: row id 4 is out of range"):
            tensorkv.row_sparse(np.ones((1, 2), np.float32), [4], (4, 2))
        with pytest.raises(tensorkv.KeyNotFoundError):
            kv.row_sparse_pull("nope", row_ids=[0])
        np.testing.assert_array_equal(kv.pull("w"), [[0, 0], [0, 0], [1, 1], [0, 0]])


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
