"""--metrics-port: a real server's Prometheus text after real workers' calls, with exact
counts of the gRPC and tensorkv_ metrics."""
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tensorkv
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc
from cluster import WAIT, Cluster, check_workers, free_port, health, wait_until
from tensorkv_server import metrics
from tensorkv_server.metrics import HttpPort

KVSTORE = "tensorkv.v1.KVStoreService"


def scrape(port):
    """(the text of http://127.0.0.1:port/metrics, {(sample name, sorted label items): value})."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    return text, samples


def grpc_labels(method, kind, code=None):
    labels = {"grpc_method": method, "grpc_service": KVSTORE, "grpc_type": kind}
    if code is not None:
        labels["grpc_code"] = code
    return tuple(sorted(labels.items()))


def metrics_cluster(tmp_path, **options):
    port = free_port()
    return port, Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port)), **options)


def test_counts_of_plain_rpcs(tmp_path):
    """One worker, the plain RPCs: 3 pushes and pulls, a pull of a missing key (NOT_FOUND)."""
    port, cluster = metrics_cluster(tmp_path)
    with cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses, session=False, transport="grpc")
        kv.init("secret_layer_weight", np.ones((2, 3), np.float32))
        for _ in range(3):
            kv.push("secret_layer_weight", np.ones((2, 3), np.float32))
            kv.pull("secret_layer_weight")
        with pytest.raises(tensorkv.KeyNotFoundError):
            kv.pull("another_secret_key")
        _, during = scrape(port)
        kv.close()
        text, samples = scrape(port)
    assert "secret" not in text
    assert samples[("grpc_server_started_total", grpc_labels("Push", "client_stream"))] == 3
    assert samples[("grpc_server_handled_total", grpc_labels("Push", "client_stream", "OK"))] == 3
    assert samples[("grpc_server_handled_total", grpc_labels("Pull", "server_stream", "OK"))] == 3
    assert samples[("grpc_server_handled_total", grpc_labels("Pull", "server_stream", "NOT_FOUND"))] == 1
    assert samples[("grpc_server_handling_seconds_count", grpc_labels("Pull", "server_stream"))] == 4
    assert samples[("grpc_server_handled_total", grpc_labels("Unregister", "unary", "OK"))] == 1
    assert samples[("tensorkv_keys", ())] == 1
    assert samples[("tensorkv_stored_bytes", ())] == 24
    assert samples[("tensorkv_pushes_total", ())] == 3
    assert samples[("tensorkv_pulls_total", ())] == 3
    assert samples[("tensorkv_rounds_total", (("outcome", "completed"),))] == 3
    assert samples[("tensorkv_rounds_total", (("outcome", "aborted"),))] == 0
    assert during[("tensorkv_registered_workers", ())] == 1
    assert samples[("tensorkv_registered_workers", ())] == 0
    # Init, 3 pushes: at least their 4 x 24 bytes of values in; 3 pulls: 3 x 24 out.
    assert samples[("tensorkv_transport_bytes_total", (("direction", "in"), ("transport", "grpc")))] > 4 * 24
    assert samples[("tensorkv_transport_bytes_total", (("direction", "out"), ("transport", "grpc")))] > 3 * 24


def test_refused_calls_are_counted_and_each_call_is_checked(tmp_path):
    """With tokens, each call's own token decides it, whatever the calls before it got, and
    refusals are counted with their codes (the metrics interceptor runs before the check)."""
    token, read_only = "rw-token-0123456789abcdef", "ro-token-0123456789abcdef"
    (tmp_path / "tokens").write_text(f"{token}\n{read_only} ro\n")
    port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port), "--token-file",
                                                 str(tmp_path / "tokens"))) as cluster, \
            grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        codes = []
        for metadata in ([("authorization", f"Bearer {token}")], [], [("authorization", f"Bearer {read_only}")],
                         [("authorization", f"Bearer {token}")]):
            try:
                stub.Reset(kvstore_pb2.ResetRequest(), metadata=metadata, timeout=10)
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(error.code().name)
        _, samples = scrape(port)
    assert codes == ["OK", "UNAUTHENTICATED", "PERMISSION_DENIED", "OK"]
    for code, count in (("OK", 2), ("UNAUTHENTICATED", 1), ("PERMISSION_DENIED", 1)):
        assert samples[("grpc_server_handled_total", grpc_labels("Reset", "unary", code))] == count


@pytest.mark.parametrize("transport, counted", [("auto", "shm"), ("tcp", "datachan")])
def test_bytes_by_transport(tmp_path, transport, counted):
    """A 4 MiB init, push and pull by a worker on the server's host: 8 MiB in and 4 MiB out
    in shared memory, or on the data channel with transport='tcp' (with the calls, which go
    framed on the channel: a few hundred bytes)."""
    port, cluster = metrics_cluster(tmp_path)
    with cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport)
        kv.init(1, np.ones(1 << 20, np.float32))
        kv.push(1, np.ones(1 << 20, np.float32))
        kv.pull(1)
        kv.close()
        _, samples = scrape(port)
    moved = {labels: value for (name, labels), value in samples.items() if name == "tensorkv_transport_bytes_total"}
    calls = 1024 if counted == "datachan" else 1
    assert 8 << 20 <= moved[("direction", "in"), ("transport", counted)] < (8 << 20) + calls
    assert 4 << 20 <= moved[("direction", "out"), ("transport", counted)] < (4 << 20) + calls
    assert sum(moved.values()) < (12 << 20) + 1024  # the rest: a few small gRPC messages


def test_rounds_of_two_workers(tmp_path):
    """Two workers, 3 iterations of tests/workers/sync_rounds.py: 4 keys a round, 12 rounds,
    each timed; the Session stream's bytes are counted as gRPC's."""
    port, cluster = metrics_cluster(tmp_path, num_workers=2)
    with cluster:
        check_workers(cluster.run_workers("sync_rounds", 3))
        _, samples = scrape(port)
    assert samples[("tensorkv_rounds_total", (("outcome", "completed"),))] == 12
    assert samples[("tensorkv_round_seconds_count", ())] == 12
    assert samples[("tensorkv_round_last_worker_wait_seconds_count", ())] == 12
    for bound in ("10.0", "20.0", "30.0", "60.0"):  # slow rounds up to --round-timeout's default have buckets
        assert samples[("tensorkv_round_seconds_bucket", (("le", bound),))] == 12
    assert samples[("tensorkv_pushes_total", ())] == 2 * 3 * 4
    assert samples[("tensorkv_keys", ())] == 4
    assert samples[("tensorkv_transport_bytes_total", (("direction", "in"), ("transport", "grpc")))] > 0
    assert samples[("grpc_server_started_total", grpc_labels("Session", "bidi_stream"))] == 2


def test_aborted_round(tmp_path):
    """A round that one of two workers never joins is aborted after --round-timeout."""
    port, cluster = metrics_cluster(tmp_path, num_workers=2, round_timeout=1)
    with cluster:
        check_workers(cluster.run_workers("abort"))
        _, samples = scrape(port)
    assert samples[("tensorkv_rounds_total", (("outcome", "aborted"),))] == 1
    assert samples[("tensorkv_rounds_total", (("outcome", "completed"),))] == 0


def test_restored_keys_and_the_errors_of_session_calls_are_counted(tmp_path):
    port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port), "--state-dir", str(tmp_path / "state"),
                                                  "--snapshot-interval", "0")) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:  # calls on its Session stream
            kv.init(["a", "b"], [np.ones(3, np.float32), np.ones((2, 2), np.float64)])
            with pytest.raises(tensorkv.KeyNotFoundError):  # the server's answer: the client knows no such key
                kv.pull("missing")
        _, before = scrape(port)
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            kvstore_pb2_grpc.KVStoreServiceStub(channel).Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
        cluster.restart()  # SIGKILL
        _, after = scrape(port)
    assert {labels: value for (name, labels), value in before.items() if name == "tensorkv_session_errors_total"} \
        == {(("grpc_code", "NOT_FOUND"),): 1}
    assert (after[("tensorkv_keys", ())], after[("tensorkv_stored_bytes", ())]) == (2, 3 * 4 + 4 * 8)
    assert after[("tensorkv_snapshots_total", (("outcome", "written"),))] == 0  # this process wrote none yet


def test_metrics_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "tensorkv_server", "--port", str(free_port()),
                                 "--device", "cpu", "--metrics-port", str(port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"tensorkv-server: --metrics-port {port}: port {port} on 127.0.0.1 is in "
                                          "use by another process (another tensorkv-server?)"]  # before it starts


@pytest.mark.parametrize("ports", [["--port", "47001", "--metrics-port", "47001"],
                                   ["--data-port", "47002", "--metrics-port", "47002"]])
def test_metrics_port_must_differ_from_the_servers_own_ports(ports, capsys):
    """It was taken for another process's port (the server's own metrics endpoint held it)."""
    from tensorkv_server.__main__ import parse_args
    with pytest.raises(SystemExit) as exit_:
        parse_args(ports)
    assert exit_.value.code == 2
    assert "--metrics-port must differ from --port and --data-port" in capsys.readouterr().err


def _healthz(port, host="127.0.0.1"):
    """(HTTP status, body) of http://host:port/healthz."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_healthz_says_serving_then_stopping(tmp_path):
    """/healthz on the metrics port, for a Kubernetes httpGet probe (the gRPC port speaks only
    TLS there, and a TCP probe passed while the server was frozen: an ops probe)."""
    port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port), "--grace", "30")) as cluster:
        assert _healthz(port) == (200, "serving\n")
        assert health(cluster.addresses[0], "tensorkv.v1.MaintenanceService") == "SERVING"
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("w", np.zeros(2))  # its Session stream stays open: the server waits out --grace for it
            cluster.processes[0].send_signal(signal.SIGTERM)
            wait_until(lambda: _healthz(port) == (503, "stopping\n"), "/healthz saying stopping")
            kv.close()


def test_liveness_sees_a_stuck_event_loop():
    now = [100.0]
    liveness = metrics.Liveness(clock=lambda: now[0])
    assert liveness.check() == (503, "starting")
    liveness.state, liveness.tick = "serving", now[0]
    now[0] += metrics.Liveness.STALLED
    assert liveness.check() == (200, "serving")
    now[0] += 2.5
    assert liveness.check() == (503, "the event loop has not run for 12 s")


def _threads(pid):
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def test_idle_connections_to_the_metrics_port_take_no_threads(tmp_path):
    """Idle connections to the metrics port hold no thread, and past HttpPort.CONNECTIONS the
    oldest are closed: /healthz still answers (a thread per connection, for ever, once made
    Snapshot fail and /healthz answer nothing under a pids limit)."""
    port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port))) as cluster:
        pid = cluster.processes[0].pid
        assert _healthz(port) == (200, "serving\n")
        before = _threads(pid)
        idle = []
        try:
            for _ in range(HttpPort.CONNECTIONS + 172):
                idle.append(socket.create_connection(("127.0.0.1", port), WAIT))
            assert _healthz(port) == (200, "serving\n")
            assert _threads(pid) <= before + HttpPort.THREADS + 8, (before, _threads(pid))  # 8: gRPC's own, if any
            idle[0].settimeout(WAIT)
            assert idle[0].recv(1) == b""  # closed to make room
            scraped, _ = scrape(port)
            assert "tensorkv_keys 0.0" in scraped
        finally:
            for sock in idle:
                sock.close()


def _accept_queue(port):
    """Connections to 127.0.0.1:``port`` that the kernel holds for its listener, not yet
    accepted (the rx_queue of the listening row of /proc/net/tcp)."""
    with open("/proc/net/tcp") as table:
        for row in table.read().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
                return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on port {port}")


def test_a_connection_closed_to_make_room_while_its_bytes_wait_is_not_read(tmp_path):
    """The metrics port full, a new connection and bytes on the oldest waiting one come in one
    turn of its loop (the server SIGSTOPped meanwhile): the oldest is closed to make room, and
    its bytes are not read. Reading them raised KeyError, which ended the port's only thread:
    /healthz never answered again (the kubelet restarts the server), found by a review."""
    port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port))) as cluster:
        process = cluster.processes[0]
        assert _healthz(port) == (200, "serving\n")
        idle = []
        try:
            for _ in range(HttpPort.CONNECTIONS):
                idle.append(socket.create_connection(("127.0.0.1", port), WAIT))
            # Counted as the listener's queue, not as the server's sockets: those come and go.
            wait_until(lambda: _accept_queue(port) == 0, "the metrics port accepting every connection", 120)
            process.send_signal(signal.SIGSTOP)
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), WAIT))  # in the listen backlog
                for sock in idle[:-1]:
                    sock.sendall(b"G")  # a head begun, on every waiting one: the oldest among them
            finally:
                process.send_signal(signal.SIGCONT)
            assert _healthz(port) == (200, "serving\n")
        finally:
            for sock in idle:
                sock.close()


def test_the_metrics_port_listens_on_metrics_host(tmp_path):
    port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port), "--metrics-host", "127.0.0.2")):
        assert _healthz(port, "127.0.0.2") == (200, "serving\n")
        with pytest.raises(urllib.error.URLError):
            _healthz(port)
