"""Session calls framed on the data channel (SessionResponse.calls_on_channel) and pushes sent
without waiting for their answers (ServerConn.push): real servers and workers on 127.0.0.1,
faults made by TCP proxies in front of the gRPC port and of the data port (the server
advertises the proxy's port with --advertise-data-port)."""
import contextlib
import threading
import time

import numpy as np
import pytest

import tensorkv
from cluster import Cluster, free_port, wait_until
from faultproxy import FaultProxy
from test_metrics import scrape

TIMEOUT = 20.0


def _moved(port, direction, transport):
    """The server's tensorkv_transport_bytes for ``direction`` ('in', 'out') and ``transport``."""
    return scrape(port)[1][("tensorkv_transport_bytes_total", (("direction", direction), ("transport", transport)))]


def _pushes(port):
    return scrape(port)[1][("tensorkv_pushes_total", ())]


@contextlib.contextmanager
def proxied_data_port(tmp_path):
    """(a one-server Cluster whose data port is reached through a FaultProxy, that proxy, the
    server's metrics port)."""
    port, data_port = free_port(), free_port()
    with FaultProxy(f"127.0.0.1:{data_port}") as data_proxy, \
            Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port), "--data-port", str(data_port),
                                                    "--advertise-data-port", str(data_proxy.port))) as cluster:
        yield cluster, data_proxy, port


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_small_calls_travel_on_the_data_channel_not_the_stream(tmp_path, transport):
    """Before: every call was a message on the Session stream (a gRPC-Python round trip each)."""
    port = free_port()
    with Cluster(tmp_path=tmp_path, server_args=("--metrics-port", str(port))) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, transport=transport, timeout=TIMEOUT) as kv:
            kv.init([1, 2], [np.zeros(16, np.float32), np.zeros(4, np.int64)])
            grpc_in = _moved(port, "in", "grpc")
            out = np.empty(16, np.float32)
            for step in range(1, 51):
                kv.push([1, 2], [np.full(16, step, np.float32), np.full(4, -step, np.int64)])
                kv.pull(1, out=out)
                np.testing.assert_array_equal(out, np.full(16, step, np.float32))
                np.testing.assert_array_equal(kv.pull(2), np.full(4, -step, np.int64))
            assert kv._sessions[0].data_channel.takes_calls
            assert _moved(port, "in", "grpc") == grpc_in  # not one message on the stream
            assert _moved(port, "in", "datachan") > 150 * 16  # 150 calls' requests at least


def test_rounds_aborted_under_pushes_sent_without_waiting_change_nothing(tmp_path):
    """A round that only the server can see fail (rank 1 never pushes): rank 0's pushes return
    at once; the abort is raised by rank 0's next call, nothing is applied, and the next round
    is exact."""
    with Cluster(num_workers=2, round_timeout=1.0, tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, timeout=TIMEOUT, transport="tcp") as kv0, \
                tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, timeout=TIMEOUT, transport="tcp") as kv1:
            kv0.init("w", np.zeros(4, np.float32))
            kv1.init("w", np.zeros(4, np.float32))
            kv0.push("w", np.ones(4, np.float32))  # round 1: rank 1 never joins, it aborts after 1 s
            kv0.push("w", np.ones(4, np.float32))  # waits for round 1 on the server, then opens round 2
            with pytest.raises(tensorkv.RoundAbortedError, match="round 1 aborted"):
                kv0.pull("w")
            np.testing.assert_array_equal(kv1.pull("w"), np.zeros(4, np.float32))  # nothing applied
            kv0.push("w", np.full(4, 2, np.float32))
            kv1.push("w", np.full(4, 3, np.float32))
            np.testing.assert_array_equal(kv0.pull("w"), np.full(4, 5, np.float32))
            np.testing.assert_array_equal(kv1.pull("w"), np.full(4, 5, np.float32))


@pytest.mark.parametrize("reset", ["data channel", "both"])
def test_a_push_whose_answer_was_lost_on_the_channel_is_applied_once(tmp_path, reset):
    """The push's answer never reaches the worker and the connections are reset: the worker's
    next call connects again and sends the push again with its sequence number, which the
    server had applied: once, not twice (SGD, learning rate 1: the value is -gradient)."""
    with proxied_data_port(tmp_path) as (cluster, data_proxy, port), FaultProxy(cluster.addresses[0]) as proxy:
        with tensorkv.create("dist_sync", servers=proxy.address, timeout=TIMEOUT, transport="tcp") as kv:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
            kv.init("w", np.zeros(4, np.float32))
            np.testing.assert_array_equal(kv.pull("w"), np.zeros(4, np.float32))
            assert data_proxy.connections == 1
            data_proxy.hold_replies()
            kv.push("w", np.full(4, -5, np.float32))  # returns at once
            wait_until(lambda: _pushes(port) == 1, "the push applied")  # its answer is held
            data_proxy.reset()
            if reset == "both":
                proxy.reset()
            data_proxy.hold_replies(False)
            np.testing.assert_array_equal(kv.pull("w"), np.full(4, 5, np.float32))
            assert data_proxy.connections >= 2 and _pushes(port) == 1
            kv.push("w", np.full(4, -1, np.float32))
            np.testing.assert_array_equal(kv.pull("w"), np.full(4, 6, np.float32))
            assert _pushes(port) == 2


def test_a_compressed_push_whose_answer_was_lost_is_applied_once(tmp_path):
    """As above for a push with 2-bit compression, whose codes (64 KiB) follow its request on
    the channel: the worker keeps them to send again (SGD, learning rate 1, threshold 1: each
    push of -1.5 sends -1 and leaves its rest in the residual)."""
    size = 1 << 18
    with proxied_data_port(tmp_path) as (cluster, data_proxy, port):
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
            kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
            kv.init("w", np.zeros(size, np.float32))
            kv.pull("w")
            data_proxy.hold_replies()
            kv.push("w", np.full(size, -1.5, np.float32))  # returns at once
            wait_until(lambda: _pushes(port) == 1, "the push applied")  # its answer is held
            data_proxy.reset()
            data_proxy.hold_replies(False)
            assert kv.pull("w").tolist() == [1.0] * size
            assert _pushes(port) == 1
            kv.push("w", np.full(size, -1.5, np.float32))  # residual -0.5 - 1.5: sends -1 again
            assert kv.pull("w").tolist() == [2.0] * size


def test_a_push_lost_before_the_server_read_it_is_sent_again(tmp_path):
    """The proxy stalls the worker's bytes: the push never reaches the server before the reset;
    the worker's next call sends it again, and it is applied once."""
    with proxied_data_port(tmp_path) as (cluster, data_proxy, port):
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
            kv.init("w", np.zeros(4, np.float32))
            kv.pull("w")
            data_proxy.stall(60)
            kv.push("w", np.full(4, -2, np.float32))
            assert _pushes(port) == 0
            data_proxy.reset()
            data_proxy.stall(0)
            np.testing.assert_array_equal(kv.pull("w"), np.full(4, 2, np.float32))
            assert _pushes(port) == 1


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_a_value_changed_while_its_pull_is_on_the_wire_arrives_whole(tmp_path, optimizer):
    """The server sends a pulled value on the data channel from the stored array itself (no
    copy): pushes applied meanwhile (assigned, or updated in place by an optimizer) must not
    reach the bytes in flight. Rank 1 pushes uniform values as fast as it can while rank 0 pulls
    32 MiB: every pulled value is uniform, one of the values stored, never a mix."""
    size = 8 << 20  # float32: 32 MiB
    with Cluster(num_workers=2, mode="async", tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_async", servers=cluster.addresses, rank=0, timeout=TIMEOUT, transport="tcp") as kv0, \
                tensorkv.create("dist_async", servers=cluster.addresses, rank=1, timeout=TIMEOUT, transport="tcp") as kv1:
            if optimizer:
                kv0.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))  # each push adds -gradient
            kv0.init("w", np.zeros(size, np.float32))
            kv1.init("w", np.zeros(size, np.float32))
            stop, pushed = threading.Event(), []

            def push():
                step = 0
                while not stop.is_set():
                    step += 1
                    kv1.push("w", np.full(size, -1.0 if optimizer else step, np.float32))
                    kv1.pull("w", out=np.empty(size, np.float32))  # waits for the push's answer too
                    pushed.append(step)
            pusher = threading.Thread(target=push, daemon=True)
            pusher.start()
            out = np.empty(size, np.float32)
            pulls, deadline = 0, time.monotonic() + TIMEOUT
            try:
                while (pulls < 20 or len(pushed) < 3) and time.monotonic() < deadline:
                    kv0.pull("w", out=out)
                    assert out.min() == out.max(), (out.min(), out.max())
                    pulls += 1
            finally:
                stop.set()
                pusher.join(TIMEOUT)
            assert not pusher.is_alive() and len(pushed) >= 3
            kv0.pull("w", out=out)
            np.testing.assert_array_equal(out, np.full(size, pushed[-1], np.float32))


def test_a_call_longer_than_the_channel_takes_is_refused_with_resource_exhausted(tmp_path):
    """A call whose request is longer than the channel reads (--max-inflight-bytes plus room
    for the keys) is answered RESOURCE_EXHAUSTED before the channel closes; the next call
    negotiates a new channel. Before: closed unanswered, the call failed after its timeout as
    if the server had gone (ServerUnavailableError)."""
    limits = ("--max-inflight-bytes", "4096", "--max-keys-per-call", "1", "--max-key-bytes", "16")
    with Cluster(tmp_path=tmp_path, server_args=limits) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, timeout=TIMEOUT, transport="tcp") as kv:
            kv.init("a", np.arange(4, dtype=np.float32))  # the channel is bound
            with pytest.raises(tensorkv.ResourceExhaustedError, match="a call of .* bytes on the data channel"):
                kv.init("b", np.zeros(4096, np.float32))  # 16 KiB in the request
            with pytest.raises(tensorkv.KeyNotFoundError):
                kv.pull("b")
            np.testing.assert_array_equal(kv.pull("a"), np.arange(4, dtype=np.float32))
            kv.init("c", np.ones(1000, np.float32))  # 4000 bytes: within the limit
            np.testing.assert_array_equal(kv.pull("c"), np.ones(1000, np.float32))
