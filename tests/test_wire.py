"""Requests that no tensorkv client sends, from raw gRPC calls to a real server: malformed
protobuf on every method, and data-channel output asked for on a stream without a bound
data channel. Each is refused with its status, changes nothing, and the server serves on."""
import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.wire.codec import Item, encode_stream
from tensorkv.transport.rpc import Stub
from tensorkv.wire.status import status_code
from tensorkv.v1 import kvstore_pb2, tensor_pb2

from cluster import CALL, Cluster

_SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"]
# Bytes that are no protobuf message: garbage (a varint that never ends), a varint field cut
# short, a length past the end, a lone tag of field number 0, wire types 6 and 7 (there are
# none such), an end-group that no start-group opened.
MALFORMED = [b"\xff\xff\xff", b"\x08", b"\x08\xff", b"\x0a\x05ab", b"\x00", b"\x0e", b"\x0f", b"\x0c"]


def _call(channel, method, data):
    """Send ``data`` as the one request message of ``method`` (a MethodDescriptor), bytes as
    they are, and read the whole answer."""
    path = f"/{_SERVICE.full_name}/{method.name}"
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary}[method.client_streaming, method.server_streaming]
    answer = kind(path)(iter([data]) if method.client_streaming else data, timeout=10)
    return list(answer) if method.server_streaming else answer


def test_malformed_messages_are_refused_with_invalid_argument_and_one_log_line(tmp_path):
    methods = [m for m in _SERVICE.methods if not (m.client_streaming and m.server_streaming)]  # Session answers in-band
    with Cluster(tmp_path=tmp_path) as cluster, grpc.insecure_channel(cluster.addresses[0]) as channel:
        log = tmp_path / "server0.log"
        logged = len(log.read_text().splitlines())
        for method in methods:
            for data in MALFORMED:
                with pytest.raises(grpc.RpcError) as refused:
                    _call(channel, method, data)
                error = refused.value
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method.name, data, error.details())
                assert f"malformed {method.input_type.name}" in error.details(), (method.name, data)
        lines = log.read_text().splitlines()[logged:]  # each logged before its answer went
        assert Stub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL).num_workers == 1
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("w", np.ones(3))
            kv.push("w", np.full(3, 2.0))
            assert kv.pull("w").tolist() == [2.0] * 3
    assert len(lines) <= len(methods) * len(MALFORMED)
    assert all(" WARNING " in line and " refused: malformed " in line for line in lines), lines
    assert any(" Register from ipv4:127.0.0.1:" in line for line in lines)


def test_a_malformed_message_later_in_a_setupdater_stream_is_refused(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster, grpc.insecure_channel(cluster.addresses[0]) as channel:
        first = kvstore_pb2.SetUpdaterRequest(optimizer=kvstore_pb2.Optimizer(name="sgd")).SerializeToString()
        set_updater = channel.stream_unary(f"/{_SERVICE.full_name}/SetUpdater")
        with pytest.raises(grpc.RpcError) as refused:
            set_updater(iter([first, b"\x0a\x05ab"]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert Stub(channel).Info(kvstore_pb2.InfoRequest(), timeout=CALL).optimizer == ""  # nothing installed


def _session(channel, requests):
    """The SessionResponses to ``requests`` (SessionRequest messages or serialized ones) sent
    on one raw Session stream."""
    stream = channel.stream_stream(f"/{_SERVICE.full_name}/Session")
    data = [r if isinstance(r, bytes) else r.SerializeToString() for r in requests]
    return [kvstore_pb2.SessionResponse.FromString(answer) for answer in stream(iter(data), timeout=10)]


def _asking_for_the_channel(call_id):
    """A Pull and a PushPull of 'w' that ask for their values on the data channel."""
    fields = dict(rank=0, timeout_ms=5000, data_channel_min_bytes=1)
    pull = kvstore_pb2.SessionRequest(id=call_id, op=kvstore_pb2.SESSION_OP_PULL,
                                      keys=[tensor_pb2.Key(str_key="w")], **fields)
    pushpull = encode_stream(kvstore_pb2.SessionRequest, [Item("w", np.full(3, 5.0))],
                             dict(id=call_id + 1, op=kvstore_pb2.SESSION_OP_PUSH_PULL, **fields),
                             chunk_bytes=1 << 62)[0]
    return [pull, pushpull]


@pytest.mark.parametrize("server_args, open_first", [
    ((), False),                      # no channel asked for
    ((), True),                       # a token handed out, never presented
    (("--no-data-channel",), False),  # a server without a data channel
])
def test_output_on_no_bound_data_channel_is_refused_before_any_change(tmp_path, server_args, open_first):
    with Cluster(tmp_path=tmp_path, server_args=server_args) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc") as kv, \
            grpc.insecure_channel(cluster.addresses[0]) as channel:
        kv.init("w", np.ones(3))
        opening = [kvstore_pb2.SessionRequest(id=1, op=kvstore_pb2.SESSION_OP_OPEN_DATA_CHANNEL)] if open_first else []
        answers = _session(channel, opening + _asking_for_the_channel(2))
        if open_first:
            assert answers.pop(0).data_token
        for answer in answers:
            assert status_code(answer.code) == grpc.StatusCode.FAILED_PRECONDITION, answer
            assert "no data channel is bound to this stream" in answer.message
            assert answer.error_class == "FailedPreconditionError"
        assert kv.pull("w").tolist() == [1.0] * 3  # the PushPull changed nothing
