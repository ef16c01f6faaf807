"""Requests that no tensorkv client sends, from raw gRPC calls to a real server: malformed
protobuf on every method. Each is refused with its status, changes nothing, and the server
serves on."""
import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.rpc import Stub
from tensorkv.v1 import kvstore_pb2

from cluster import Cluster

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
        assert Stub(channel).Info(kvstore_pb2.InfoRequest(), timeout=5).num_workers == 1
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
        assert Stub(channel).Info(kvstore_pb2.InfoRequest(), timeout=5).optimizer == ""  # nothing installed

