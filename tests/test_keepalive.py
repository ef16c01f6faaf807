"""Keepalive: a worker keeps its connection through a long wait in a call and a long gap
between calls, for as long as the documented timeouts allow (the server's --round-timeout,
the client's ``timeout``): the client's pings and the server's ping policy agree. Before they
did, the server ignored its misspelled minimum ping interval, kept gRPC's 5 minutes, counted
every ping of the client (one per 30 s) as a strike and cut the connection after six, at
about 3 minutes: ServerUnavailableError "Too many pings"."""
import json
import subprocess
import sys

import grpc
import pytest

from tensorkv.wire.grpc_options import CHANNEL_OPTIONS
from tensorkv.transport.rpc import Stub
from tensorkv.transport.session import RawSession as Session
from tensorkv.wire.status import status_code
from tensorkv.v1 import kvstore_pb2, tensor_pb2

from cluster import CALL, WORKERS, Cluster, check_workers, free_port, stop
from workers.fast_pings_server import faster

# Seconds the sped-up test waits: longer than the misnamed policy, sped up as much, took to
# cut a connection (7 to 8 s).
GAP = 12.0


def _pull_unknown_key(session, incarnation):
    """The status code of a Session pull by rank 0 of a key nobody initialized (NOT_FOUND
    when the stream answers)."""
    def build(call_id, timeout_ms, region, channel):
        return kvstore_pb2.SessionRequest(id=call_id, rank=0, incarnation=incarnation, op=kvstore_pb2.SESSION_OP_PULL,
                                          timeout_ms=timeout_ms, keys=[tensor_pb2.Key(int_key=7)]).SerializeToString(), ()
    _, data = session.call(build, 5.0)
    return status_code(kvstore_pb2.SessionResponse.FromString(data).code)


def test_pings_through_a_long_wait_and_an_idle_stream_are_accepted(tmp_path):
    """The production policy sped up SPEEDUP times (tests/workers/fast_pings_server.py): a
    barrier that waits GAP seconds for a worker that never comes ends as the round timeout
    says (ABORTED), not with a cut connection (UNAVAILABLE), and the Session stream, idle
    meanwhile, still answers."""
    address = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "server.log", "w+") as log:
        server = subprocess.Popen(
            [sys.executable, str(WORKERS / "fast_pings_server.py"), "--port", address.rsplit(":", 1)[1],
             "--num-workers", "2", "--round-timeout", str(GAP), "--device", "cpu",
             "--lease-timeout", str(2 * GAP)],  # this raw client sends no heartbeats
            stdout=log, stderr=subprocess.STDOUT)
        try:
            Cluster._wait_serving(address, server)
            with grpc.insecure_channel(address, options=faster(CHANNEL_OPTIONS)) as channel:
                stub = Stub(channel)
                incarnation = stub.Register(kvstore_pb2.RegisterRequest(rank=0), timeout=CALL).incarnation
                session = Session(channel, address)
                try:
                    assert _pull_unknown_key(session, incarnation) == grpc.StatusCode.NOT_FOUND
                    with pytest.raises(grpc.RpcError) as waited:
                        stub.Barrier(kvstore_pb2.BarrierRequest(rank=0, incarnation=incarnation), timeout=GAP + 30)
                    assert waited.value.code() == grpc.StatusCode.ABORTED, waited.value.details()
                    assert _pull_unknown_key(session, incarnation) == grpc.StatusCode.NOT_FOUND
                finally:
                    session.close()
        finally:
            stop(server)


@pytest.mark.slow
def test_a_worker_waits_four_minutes_in_pull_while_another_computes(tmp_path):
    """The issue as it happened, at full scale: --round-timeout 400; rank 1 makes no call for
    240 s (its Session stream open) while rank 0 waits in pull() for its push; both pull the
    exact sum."""
    with Cluster(num_workers=2, round_timeout=400, tmp_path=tmp_path) as cluster:
        results = cluster.run_workers("long_wait", 240, timeout=400)
    pulled = sorted((json.loads(out) for out in check_workers(results)), key=lambda out: out["rank"])
    assert pulled == [{"rank": 0, "pulled": [3.0] * 4}, {"rank": 1, "pulled": [3.0] * 4}]
