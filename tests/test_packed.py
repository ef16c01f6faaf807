"""Lists of keys moved packed in one buffer (tensorkv.wire.packed, SessionRequest.layout_id): real
servers and workers on 127.0.0.1; exact values across workers and servers, the errors of a
packed call, a packed push whose answer was lost, and the wire rules of layouts."""
import grpc
import ml_dtypes
import numpy as np
import pytest

import tensorkv
from cluster import Cluster, check_workers, wait_until
from tensorkv import config
from tensorkv.stores import fusion
from tensorkv.wire import packed
from tensorkv.wire.codec import set_key
from tensorkv.transport.server_conn import ServerConn
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc, tensor_pb2
from test_channel_calls import _pushes, proxied_data_port

TIMEOUT = 20.0
COUNT = 20  # keys in a list: more than ClientConfig.pack_min_values


def _list(count=COUNT, prefix="k"):
    return [f"{prefix}{i}" for i in range(count)]


@pytest.mark.parametrize("transport,call", [("tcp", "push"), ("auto", "pushpull")])
def test_lists_move_packed_and_exact_across_workers_and_servers(tmp_path, transport, call):
    """Two workers, two servers, 40 keys of two shapes: every round's values exact under SGD
    with momentum, and each worker's session to each server holds the list's layout."""
    with Cluster(servers=2, num_workers=2, tmp_path=tmp_path) as cluster:
        outs = check_workers(cluster.run_workers("packed_rounds", 5, 40, transport, call))
    for out in outs:
        counts = [int(n) for n in out.split("layouts", 1)[1].split()]
        assert len(counts) == 2 and all(n >= 1 for n in counts), out
        assert out.startswith("fused" if call == "push" else "not fused"), out


def test_a_packed_push_that_the_server_refuses_changes_nothing(tmp_path):
    """A worker that has not seen the keys (a run resumed) cannot check its push itself: the
    server refuses it, naming the key, the shapes or the dtypes, and no value changes."""
    keys = _list()
    initial = [np.full(5, i, np.float32) for i in range(COUNT)]
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            kv.init(keys, initial)
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp",
                             if_exists="resume") as kv:
            wrong_shape = [np.ones(6 if i == 7 else 5, np.float32) for i in range(COUNT)]
            with pytest.raises(tensorkv.ShapeMismatchError, match=r"key 'k7': pushed shape \(6,\) does not match "
                                                                  r"the stored shape \(5,\)"):
                kv.push(keys, wrong_shape)
            assert len(kv._sessions[0].layout_ids) == 1  # it went packed
            with pytest.raises(tensorkv.DtypeMismatchError, match="key 'k0': pushed dtype float64 does not match"):
                kv.push(keys, [np.ones(5) for _ in keys])
            with pytest.raises(tensorkv.KeyNotFoundError, match="key 'extra' has not been initialized"):
                kv.push(keys + ["extra"], [np.ones(5, np.float32)] * (COUNT + 1))
            for got, want in zip(kv.pull(keys), initial):
                np.testing.assert_array_equal(got, want)
            kv.push(keys, [np.full(5, -i, np.float32) for i in range(COUNT)])
            outs = [np.empty(5, np.float32) for _ in keys]
            kv.pull(keys, out=outs)
            for i, out in enumerate(outs):
                np.testing.assert_array_equal(out, np.full(5, -i, np.float32))


def test_rounds_aborted_under_packed_pushes_change_nothing(tmp_path):
    """Rank 0's packed pushes return at once; rank 1 never pushes in round 1, which aborts:
    rank 0's next call raises it, nothing is applied, and the next round is exact."""
    keys, zeros = _list(), [np.zeros(4, np.float32)] * COUNT
    with Cluster(num_workers=2, round_timeout=1.0, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, timeout=TIMEOUT, transport="tcp") as kv0, \
                tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, timeout=TIMEOUT, transport="tcp") as kv1:
            kv0.init(keys, zeros)
            kv1.init(keys, zeros)
            kv0.push(keys, [np.ones(4, np.float32)] * COUNT)  # round 1 of every key: aborts after 1 s
            kv0.push(keys, [np.ones(4, np.float32)] * COUNT)  # waits for round 1, then opens round 2
            with pytest.raises(tensorkv.RoundAbortedError, match="round 1 aborted"):
                kv0.pull(keys)
            for value in kv1.pull(keys):
                np.testing.assert_array_equal(value, np.zeros(4, np.float32))
            kv0.push(keys, [np.full(4, i, np.float32) for i in range(COUNT)])
            kv1.push(keys, [np.full(4, 10 * i, np.float32) for i in range(COUNT)])
            for kv in (kv0, kv1):
                for i, value in enumerate(kv.pull(keys)):
                    np.testing.assert_array_equal(value, np.full(4, 11 * i, np.float32))
            assert kv0._sessions[0].layout_ids and kv1._sessions[0].layout_ids


@pytest.mark.parametrize("fault", ["answer held", "push stalled"])
def test_a_packed_push_sent_without_waiting_is_applied_once_whatever_the_reset_lost(tmp_path, fault):
    """A TCP proxy in front of the data port holds the answer of a packed push (the server
    applied it) or stalls the push itself (the server never read it), then resets the
    connection: the next call sends the push again with the values it was made with (the
    caller's arrays changed since), and the server applies it once (SGD, learning rate 1:
    the value is -gradient)."""
    keys = _list()
    with proxied_data_port(tmp_path) as (cluster, data_proxy, port):
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
            kv.init(keys, [np.zeros(3, np.float32)] * COUNT)
            kv.pull(keys)
            if fault == "answer held":
                data_proxy.hold_replies()
            else:
                data_proxy.stall(60)
            gradients = [np.full(3, -i, np.float32) for i in range(COUNT)]
            assert kv._lists.get(keys) is not None  # learnt by the pull: the push is fused
            kv.push(keys, gradients)  # returns at once
            for gradient in gradients:
                gradient[:] = 99
            if fault == "answer held":
                wait_until(lambda: _pushes(port) == COUNT, "the push applied")
            else:
                assert _pushes(port) == 0
            data_proxy.reset()
            data_proxy.hold_replies(False)
            data_proxy.stall(0)
            for i, value in enumerate(kv.pull(keys)):
                np.testing.assert_array_equal(value, np.full(3, i, np.float32))
            assert data_proxy.connections >= 2 and _pushes(port) == COUNT


def test_more_lists_than_a_stream_holds_layouts_stay_exact(tmp_path):
    """Past packed.MAX_LAYOUTS lists on one stream, the others travel as entries."""
    lists = [_list(16, prefix=f"l{j}-") for j in range(packed.MAX_LAYOUTS + 6)]
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            for j, keys in enumerate(lists):
                kv.init(keys, [np.zeros(2, np.int64)] * 16)
                kv.push(keys, [np.full(2, j * 100 + i, np.int64) for i in range(16)])
            for j, keys in enumerate(lists):
                for i, value in enumerate(kv.pull(keys)):
                    np.testing.assert_array_equal(value, np.full(2, j * 100 + i, np.int64))
            assert len(kv._sessions[0].layout_ids) == packed.MAX_LAYOUTS


def test_a_layout_the_server_refuses_leaves_its_calls_to_entries(tmp_path):
    """A server whose --max-keys-per-call is below a list refuses its layout: that list's calls
    go as entries and fail as they did before layouts; a shorter list still packs."""
    with Cluster(tmp_path=tmp_path, server_args=("--max-keys-per-call", "18")) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            kv.init(_list(18), [np.zeros(2, np.float32)] * 18)
            with pytest.raises(tensorkv.ResourceExhaustedError, match="key 'k18' is key 19 of this call"):
                kv.push(_list(), [np.ones(2, np.float32)] * COUNT)
            with pytest.raises(tensorkv.ResourceExhaustedError, match="key 'k18' is key 19 of this call"):
                kv.push(_list(), [np.ones(2, np.float32)] * COUNT)
            assert len(kv._sessions[0].refused_layouts) == 1 and not kv._sessions[0].layout_ids
            kv.push(_list(18), [np.full(2, i, np.float32) for i in range(18)])
            for i, value in enumerate(kv.pull(_list(18))):
                np.testing.assert_array_equal(value, np.full(2, i, np.float32))
            # (a refused call closes the data channel: a call that raced its closing was made
            # again on a new session, which registered the list again)
            assert len(kv._sessions[0].layout_ids) == 1


def test_a_list_called_again_is_fused_and_checked_as_a_whole(tmp_path, monkeypatch):
    """After a list's first push and pull, its calls move one buffer per server without the
    per-key work (tensorkv.stores.fusion). A call that does not fit it (a shape, a dtype, a key's
    type, arrays per device, arrays that are not contiguous, an out of another shape) goes the
    general way: the same errors, and nothing changes."""
    keys = list(range(40))  # spread over both servers
    packed_calls = []
    for name in ("push_packed", "pull_packed"):
        original = getattr(ServerConn, name)
        monkeypatch.setattr(ServerConn, name, lambda self, *args, original=original, name=name: (
            packed_calls.append(name), original(self, *args))[1])

    def values(scale):
        return [np.full(4, scale * i, np.float32) for i in keys]

    with Cluster(servers=2, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            kv.init(keys, values(0))
            outs = [np.empty(4, np.float32) for _ in keys]
            kv.push(keys, values(1))  # the general way: it learns the list
            assert not packed_calls
            fused = kv._lists.get(keys)
            assert fused is not None and sorted(index for index, _, _ in fused.parts) == [0, 1]
            kv.pull(keys, out=outs)
            assert packed_calls == ["pull_packed"] * 2
            del packed_calls[:]
            for scale in (2, 3):
                kv.push(keys, values(scale))
                kv.pull(keys, out=outs)
                for out, want in zip(outs, values(scale)):
                    np.testing.assert_array_equal(out, want)
            assert packed_calls == ["push_packed", "push_packed", "pull_packed", "pull_packed"] * 2
            del packed_calls[:]

            wrong = values(4)
            wrong[7] = np.ones(5, np.float32)
            with pytest.raises(tensorkv.ShapeMismatchError, match=r"key 7: pushed shape \(5,\) does not match "
                                                                  r"the stored shape \(4,\)"):
                kv.push(keys, wrong)
            wrong[7] = np.ones(4)
            with pytest.raises(tensorkv.DtypeMismatchError, match="key 7: pushed dtype float64"):
                kv.push(keys, wrong)
            with pytest.raises(tensorkv.KeyTypeError, match="has type float"):
                kv.push([float(key) for key in keys], values(4))
            sentinel = [np.full(4, -1, np.float32) for _ in keys]
            sentinel[5] = np.full(3, -1, np.float32)
            with pytest.raises(tensorkv.ShapeMismatchError, match=r"key 5: out array of shape \(3,\)"):
                kv.pull(keys, out=sentinel)
            assert all((out == -1).all() for out in sentinel)
            sentinel[5] = np.full(4, -1, np.float32)
            sentinel[5].flags.writeable = False
            with pytest.raises(tensorkv.InvalidArgumentError, match="key 5: the out array is read-only"):
                kv.pull(keys, out=sentinel)
            assert all((out == -1).all() for out in sentinel)
            kv.pull(keys, out=outs)
            for out, want in zip(outs, values(3)):
                np.testing.assert_array_equal(out, want)
            assert packed_calls == ["pull_packed"] * 2  # the refused calls went the general way
            del packed_calls[:]

            per_device = values(5)
            per_device[3] = [np.ones(4, np.float32), np.full(4, 2, np.float32)]
            kv.push(keys, per_device)
            strided = [np.full((4, 2), 6 * i, np.float32)[:, 0] for i in keys]
            strided_outs = [np.empty((4, 2), np.float32)[:, 1] for _ in keys]
            assert not packed_calls
            kv.pull(keys, out=strided_outs)
            assert [out[3] for out in strided_outs] == [5 * i if i != 3 else 3 for i in keys]
            kv.push(keys, strided)
            kv.pull(keys, out=outs)
            for out, want in zip(outs, values(6)):
                np.testing.assert_array_equal(out, want)
            assert packed_calls == ["pull_packed", "pull_packed"]


def _rounds_of(kv, keys, dtype, rounds=3):
    """Init ``keys`` (2 elements each), then push and pull them ``rounds`` times into arrays of
    their own, each value exact."""
    kv.init(keys, [np.zeros(2, dtype)] * len(keys))
    outs = [np.empty(2, dtype) for _ in keys]
    for step in range(rounds):
        kv.push(keys, [np.full(2, step + i, dtype) for i in range(len(keys))])
        kv.pull(keys, out=outs)
        assert [out.tolist() for out in outs] == [[step + i] * 2 for i in range(len(keys))]
    return outs


def test_bfloat16_lists_and_numpy_integer_keys(tmp_path):
    """bfloat16, a dtype NumPy gives no buffer format, packs, fuses and is pulled straight into
    its out arrays; NumPy integer keys, which the general way turns into ints (hashed to
    another server than their NumPy type), never fuse, and stay exact over two servers."""
    bf16 = [f"bf{i}" for i in range(40)]  # 20 per server
    numpy_keys = list(np.arange(40))
    with Cluster(servers=2, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            _rounds_of(kv, bf16, ml_dtypes.bfloat16)
            values = [np.full(2, -i, ml_dtypes.bfloat16) for i in range(40)]
            kv.pushpull(bf16, values)  # pulled back into values
            assert [value.tolist() for value in values] == [[-i] * 2 for i in range(40)]
            assert kv._lists.get(bf16) is not None

        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp",
                             if_exists="replace") as kv:
            outs = _rounds_of(kv, numpy_keys, np.float32)
            assert kv._lists.get(numpy_keys) is None
            plain = [int(key) for key in numpy_keys]
            kv.pull(plain, out=outs)
            kv.push(plain, [np.full(2, 7 * i, np.float32) for i in range(40)])
            kv.pull(plain, out=outs)
            assert kv._lists.get(plain) is not None
            assert [out.tolist() for out in outs] == [[7 * i] * 2 for i in range(40)]


def test_a_store_keeps_the_newest_lists():
    """Past fusion.MAX_LISTS lists, the one learnt first makes room; lists of NumPy integer
    keys, or of fewer keys than pack, are not kept at all."""
    size = config.default("pack_min_values")
    lists = fusion.FusedLists(size)
    made = [_list(size, prefix=f"l{j}-") for j in range(fusion.MAX_LISTS + 1)]
    for keys in made:
        lists.learn(keys, lambda keys: fusion.FusedList(str, [(1,)] * len(keys), np.float32, []))
    assert lists.get(made[0]) is None and all(lists.get(keys) is not None for keys in made[1:])
    lists.learn(list(np.arange(size)), pytest.fail)
    lists.learn(_list(size - 1), pytest.fail)


def test_a_fused_list_that_its_stream_has_no_room_for_moves_as_entries(tmp_path):
    """A stream that holds packed.MAX_LAYOUTS layouts already refuses a fused list's: its
    calls then travel as entries, exact."""
    keys = _list(16, prefix="late-")
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            for j in range(packed.MAX_LAYOUTS):  # pushpull: never fused, each list packed
                other = _list(16, prefix=f"l{j}-")
                kv.init(other, [np.zeros(2, np.int64)] * 16)
                kv.pushpull(other, [np.ones(2, np.int64)] * 16)
            kv.init(keys, [np.zeros(2, np.int64)] * 16)
            outs = [np.empty(2, np.int64) for _ in keys]
            for step in range(3):
                kv.push(keys, [np.full(2, step * 100 + i, np.int64) for i in range(16)])
                kv.pull(keys, out=outs)
                for i, out in enumerate(outs):
                    np.testing.assert_array_equal(out, np.full(2, step * 100 + i, np.int64))
            assert kv._lists.get(keys) is not None
            assert len(kv._sessions[0].layout_ids) == packed.MAX_LAYOUTS


# ---- the wire rules, on a plain Session stream ---------------------------------------


def _layout_message(keys, dtype=tensor_pb2.DTYPE_FLOAT32, shape=(4,)):
    message = kvstore_pb2.PackedLayout(dtype=dtype)
    for key in keys:
        set_key(message.values.add(shape=shape).key, key)
    return message


def _session(address, requests):
    """The SessionResponses to ``requests``, sent in order on one Session stream."""
    with grpc.insecure_channel(address) as channel:
        return list(kvstore_pb2_grpc.KVStoreServiceStub(channel).Session(iter(requests), timeout=TIMEOUT))


def _register(layout, call_id=1):
    return kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_REGISTER_LAYOUT, layout=layout)


def test_layouts_are_checked_when_registered_and_counted_per_stream(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        address = cluster.addresses[0]
        first, twice, empty, bad_dtype = _session(address, [
            _register(_layout_message(["a", "b"])),
            _register(_layout_message(["a", "a"]), 2),
            _register(kvstore_pb2.PackedLayout(), 3),
            _register(_layout_message(["a"], dtype=tensor_pb2.DTYPE_UNSPECIFIED), 4)])
        assert (first.code, first.layout_id) == (0, 1)
        assert twice.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "key 'a' appears twice in a packed layout" in twice.message
        assert empty.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "no values" in empty.message
        assert bad_dtype.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "DTYPE_UNSPECIFIED" in bad_dtype.message
        answers = _session(address, [_register(_layout_message([f"k{i}"]), i + 1)
                                     for i in range(packed.MAX_LAYOUTS + 1)])
        assert [a.layout_id for a in answers[:-1]] == list(range(1, packed.MAX_LAYOUTS + 1))
        assert answers[-1].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def test_a_call_naming_a_layout_of_no_one_is_refused(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        (answer,) = _session(cluster.addresses[0], [kvstore_pb2.SessionRequest(
            id=1, op=kvstore_pb2.SESSION_OP_PULL, layout_id=1)])
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "packed layout 1 is not registered on this stream" in answer.message
        registered, init_packed = _session(cluster.addresses[0], [
            _register(_layout_message(["a"])),
            kvstore_pb2.SessionRequest(id=2, op=kvstore_pb2.SESSION_OP_INIT, layout_id=1)])
        assert registered.layout_id == 1
        assert init_packed.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "SESSION_OP_INIT takes no packed layout" in init_packed.message


def test_a_server_without_a_data_channel_takes_no_layout(tmp_path):
    with Cluster(tmp_path=tmp_path, server_args=("--no-data-channel",)) as cluster:
        (answer,) = _session(cluster.addresses[0], [_register(_layout_message(["a"]))])
        assert answer.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "--no-data-channel" in answer.message
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            kv.init(_list(), [np.zeros(2, np.float32)] * COUNT)
            kv.push(_list(), [np.ones(2, np.float32)] * COUNT)
            for value in kv.pull(_list()):
                np.testing.assert_array_equal(value, np.ones(2, np.float32))
            assert not kv._sessions[0].layout_ids
