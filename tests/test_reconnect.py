"""Reconnect and exactly-once pushes (issue 11 items 2 and 3): a worker whose connection is
reset mid-call, or whose acknowledgement is lost, reconnects, registers again and sends the
call again, and the server applies it once; a server killed with -9 and restarted on its
state dir is rejoined without an error; a server that stays down fails the call once its
timeout has passed. Real servers on 127.0.0.1, connections broken by tests/faultproxy.py;
integer-valued data, so every sum is exact."""
import contextlib
import json
import threading
import time

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.wire.codec import Item, encode_stream, get_key
from tensorkv.tools.ctl import Server
from tensorkv.transport.security import Security
from tensorkv.v1 import kvstore_pb2

from cluster import Cluster, check_workers, free_port, stop, wait_until
from faultproxy import FaultProxy
from test_metrics import scrape

TIMEOUT = 20.0  # seconds every call of these stores may take, reconnecting included


def _pushes(port):
    """The server's count of values pushed and accepted (tensorkv_pushes)."""
    return scrape(port)[1][("tensorkv_pushes_total", ())]


def _pushpull(kv, value):
    """The value of "w" after pushing ``value`` (pulled back into it, as in MXNet)."""
    value = np.full(4, value, np.int32)
    kv.pushpull("w", value)
    return value


def _in_thread(call):
    """Start ``call()`` in a thread; a function that joins it and returns its result or raises its error."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result():
        thread.join(TIMEOUT + 10)
        assert not thread.is_alive(), "the call did not return"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
    return result


@pytest.fixture
def metered(tmp_path):
    """start(num_workers): (metrics port, a dist_sync Cluster of one server with that port)."""
    def start(num_workers):
        port = free_port()
        return port, Cluster(num_workers=num_workers, tmp_path=tmp_path, server_args=("--metrics-port", str(port)))
    return start


def test_a_connection_reset_while_a_pushpull_waits_applies_the_push_once(metered):
    port, cluster = metered(2)
    with cluster, FaultProxy(cluster.addresses[0]) as proxy:
        # transport='grpc': every call of rank 0 goes through the proxy (the data channel would not)
        with tensorkv.create("dist_sync", servers=proxy.address, rank=0, timeout=TIMEOUT, transport="grpc") as kv0, \
                tensorkv.create("dist_sync", servers=cluster.addresses[0], rank=1, timeout=TIMEOUT) as kv1:
            kv0.init("w", np.zeros(4, np.int32))
            kv1.init("w", np.zeros(4, np.int32))
            result = _in_thread(lambda: _pushpull(kv0, 1))
            wait_until(lambda: _pushes(port) == 1, "rank 0's push in the round")  # it waits for rank 1 now
            proxy.reset()
            np.testing.assert_array_equal(_pushpull(kv1, 2), [3] * 4)
            np.testing.assert_array_equal(result(), [3] * 4)  # rank 0's push counted once
            assert proxy.connections >= 2  # it did connect again
            assert _pushes(port) == 2
            # the next round lines up: one push of each rank (no optimizer: a round stores its sum)
            result = _in_thread(lambda: _pushpull(kv0, 10))
            np.testing.assert_array_equal(_pushpull(kv1, 20), [30] * 4)
            np.testing.assert_array_equal(result(), [30] * 4)


@pytest.mark.parametrize("method, message", [("Init", "InitRequest"), ("Push", "PushRequest"),
                                             ("PushPull", "PushPullRequest")])
def test_a_request_stream_cut_short_changes_nothing(tmp_path, method, message):
    """gRPC ends a request stream whose client's connection broke as if the client had
    finished it (a grpc.aio server sees no error). Such a push, of a large value and then
    small ones, cut after the large value's last chunk, once applied the large value alone,
    and the push sent again was then skipped as applied: the small values were lost. A
    stream now says how many messages it has, and one that ends short changes nothing."""
    big, small = np.arange(600_000, dtype=np.float32), np.full(4, 7.0, np.float32)  # 2.4 MB: 3 chunks
    keys = ["new_big", "new_small"] if method == "Init" else ["big", "small"]
    with Cluster(tmp_path=tmp_path) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, transport="grpc") as kv:
        kv.init(["big", "small"], [np.zeros_like(big), np.zeros_like(small)])
        conn = kv._conns[0]
        messages = encode_stream(getattr(kvstore_pb2, message), [Item(keys[0], big), Item(keys[1], small)],
                                 dict(conn._caller(), sequence=next(conn._sequences)))
        assert len(messages) == 5 and getattr(kvstore_pb2, message).FromString(messages[0]).messages == 5
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            path = f"/tensorkv.v1.KVStoreService/{method}"
            send = channel.stream_stream(path) if method == "PushPull" else channel.stream_unary(path)

            def call(stream):
                answer = send(iter(stream), timeout=20)
                return list(answer) if method == "PushPull" else answer

            with pytest.raises(grpc.RpcError) as cut:
                call(messages[:-1])  # ends after the large value: the small one's message is missing
            assert cut.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert cut.value.details() == "the stream ended after 4 messages of the 5 its first one announced: " \
                                          "it was cut short"
            if method == "Init":
                with pytest.raises(tensorkv.KeyNotFoundError):
                    kv.pull("new_big")
            else:
                np.testing.assert_array_equal(kv.pull("big"), np.zeros_like(big))
            call(messages)  # sent again whole, with the same sequence number: applied
        if method == "Init":
            np.testing.assert_array_equal(kv.pull("new_small"), small)
        else:
            np.testing.assert_array_equal(kv.pull("big"), big)
            np.testing.assert_array_equal(kv.pull("small"), small)


def test_a_push_whose_acknowledgement_was_lost_is_not_applied_twice(metered):
    port, cluster = metered(1)
    with cluster, FaultProxy(cluster.addresses[0]) as proxy:
        # transport='grpc': the push goes through the proxy (tests/test_channel_calls.py holds the
        # answers of the data channel's calls back)
        with tensorkv.create("dist_sync", servers=proxy.address, timeout=TIMEOUT, transport="grpc") as kv:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))  # each push adds -gradient
            kv.init("w", np.zeros(4, np.float32))
            proxy.hold_replies()
            result = _in_thread(lambda: kv.push("w", np.full(4, -5, np.float32)))
            wait_until(lambda: _pushes(port) == 1, "the push applied")  # its answer never arrives
            proxy.reset()
            proxy.hold_replies(False)
            result()
            np.testing.assert_array_equal(kv.pull("w"), [5] * 4)
            assert _pushes(port) == 1
            kv.push("w", np.full(4, -1, np.float32))
            np.testing.assert_array_equal(kv.pull("w"), [6] * 4)


def _aborted(port):
    """The server's count of aborted rounds."""
    return scrape(port)[1][("tensorkv_rounds_total", (("outcome", "aborted"),))]


@pytest.mark.parametrize("call", ["pull", "pushpull"])
def test_an_aborted_round_whose_answer_was_lost_is_reported_when_the_call_is_sent_again(tmp_path, call):
    """Rank 0 waits in a round that rank 1 never joins; the server's RoundAbortedError answer
    is lost with the connection. The call sent again gets the same error, not the stale value."""
    port = free_port()
    with Cluster(num_workers=2, round_timeout=1.0, tmp_path=tmp_path, server_args=("--metrics-port", str(port))) \
            as cluster, FaultProxy(cluster.addresses[0]) as proxy:
        # transport='grpc': every call of rank 0 goes through the proxy (the data channel would not)
        with tensorkv.create("dist_sync", servers=proxy.address, rank=0, timeout=TIMEOUT, transport="grpc") as kv0, \
                tensorkv.create("dist_sync", servers=cluster.addresses[0], rank=1, timeout=TIMEOUT) as kv1:
            kv0.init("w", np.zeros(4, np.int32))
            kv1.init("w", np.zeros(4, np.int32))
            if call == "pull":
                kv0.push("w", np.ones(4, np.int32))
            proxy.hold_replies()
            result = _in_thread(lambda: kv0.pull("w") if call == "pull" else _pushpull(kv0, 1))
            wait_until(lambda: _aborted(port) == 1, "the round aborted")  # and its answer swallowed
            proxy.reset()
            proxy.hold_replies(False)
            with pytest.raises(tensorkv.RoundAbortedError, match="key 'w': round 1 aborted after 1 s; missing ranks \\[1\\]"):
                result()
            assert proxy.connections >= 2  # it was sent again
            np.testing.assert_array_equal(kv0.pull("w"), [0] * 4)  # a new pull: the round was discarded
            np.testing.assert_array_equal(kv1.pull("w"), [0] * 4)


@pytest.mark.parametrize("restarts", [1, 2])
def test_a_push_in_a_snapshot_is_not_applied_again_by_the_restarted_server(tmp_path, restarts):
    """A push's answer is lost; the server, which applied it, writes a snapshot and is killed
    with -9. Restarted on its state dir, it gets the push again with its sequence number: the
    numbers applied came back with the snapshot, so it is acknowledged, not applied twice.
    With 2 restarts the restored server writes a snapshot and is killed again before the
    worker gets through (the proxy stalled): that snapshot keeps the numbers too."""
    state = str(tmp_path / "state")
    with Cluster(tmp_path=tmp_path, server_args=("--state-dir", state, "--snapshot-interval", "0")) as cluster, \
            FaultProxy(cluster.addresses[0]) as proxy:
        server = Server(cluster.addresses[0], Security(), 10.0)
        with tensorkv.create("dist_sync", servers=proxy.address, timeout=TIMEOUT) as kv:
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))  # each push adds -gradient
            kv.init("w", np.zeros(4, np.float32))
            proxy.hold_replies()
            result = _in_thread(lambda: kv.push("w", np.full(4, -5, np.float32)))
            wait_until(lambda: server.keys()[0].updates == 1, "the push applied")  # its answer never arrives
            proxy.stall(60)  # nothing of the worker's reaches a server until the last restart
            for _ in range(restarts):
                server.kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
                cluster.restart()  # SIGKILL, then a new server on the state dir
            proxy.stall(0)
            proxy.reset()
            proxy.hold_replies(False)
            result()
            np.testing.assert_array_equal(kv.pull("w"), [5] * 4)
            kv.push("w", np.full(4, -1, np.float32))
            np.testing.assert_array_equal(kv.pull("w"), [6] * 4)


def test_a_worker_that_reconnected_after_the_snapshot_is_matched_to_the_numbers_it_saved(tmp_path):
    """Both ranks push and pull round 1; the server writes a snapshot; rank 0 pushes again and
    its pull waits for rank 1 when its connection is reset: it registers again, a new
    incarnation in the place of the one the snapshot saved. The server is killed with -9 and
    restarted from the snapshot. Rank 0 names the incarnations it held, so it gets back the
    numbers the snapshot saved: its push of round 1, sent again, is not applied twice (before:
    it was, as round 2's, with rank 1's push of step 2, and the rounds were a push apart)."""
    with _sgd_pair_through_proxy(tmp_path) as (cluster, server, proxy, kv0, kv1, port):
        kv0.push("w", np.full(4, 1, np.float32))
        kv1.push("w", np.full(4, 2, np.float32))
        np.testing.assert_array_equal(kv0.pull("w"), [-3] * 4)
        np.testing.assert_array_equal(kv1.pull("w"), [-3] * 4)
        server.kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
        before = kv0._conns[0].incarnation
        kv0.push("w", np.full(4, 10, np.float32))
        pulled = _in_thread(lambda: kv0.pull("w"))  # waits for rank 1's push of step 2
        wait_until(lambda: _pushes(port) == 3, "rank 0's push of step 2 in an open round")
        proxy.reset()
        wait_until(lambda: kv0._conns[0].incarnation != before, "rank 0 registered again in its own place")
        cluster.restart()
        kv1.push("w", np.full(4, 20, np.float32))
        np.testing.assert_array_equal(kv1.pull("w"), [-33] * 4)
        np.testing.assert_array_equal(pulled(), [-33] * 4)
        assert server.keys()[0].updates == 2
        kv0.push("w", np.full(4, 100, np.float32))
        kv1.push("w", np.full(4, 200, np.float32))
        np.testing.assert_array_equal(kv0.pull("w"), [-333] * 4)


def test_a_push_of_a_round_open_at_the_snapshot_is_applied_by_the_restarted_server(tmp_path):
    """As above, with 2 workers: rank 0's push waits in an open round when the snapshot is
    taken, so the snapshot holds neither it nor its number, and the push sent again counts."""
    state, port = str(tmp_path / "state"), free_port()
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--state-dir", state, "--snapshot-interval", "0",
                                                                "--metrics-port", str(port))) \
            as cluster, FaultProxy(cluster.addresses[0]) as proxy:
        server = Server(cluster.addresses[0], Security(), 10.0)
        with tensorkv.create("dist_sync", servers=proxy.address, rank=0, timeout=TIMEOUT) as kv0, \
                tensorkv.create("dist_sync", servers=cluster.addresses[0], rank=1, timeout=TIMEOUT) as kv1:
            kv0.init("w", np.zeros(4, np.int32))
            kv1.init("w", np.zeros(4, np.int32))
            proxy.hold_replies()
            result = _in_thread(lambda: kv0.push("w", np.full(4, 1, np.int32)))
            wait_until(lambda: _pushes(port) == 1, "rank 0's push in an open round")
            server.kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
            cluster.restart()
            proxy.reset()
            proxy.hold_replies(False)
            result()
            # A push sent without waiting (on the data channel) is sent again by rank 0's next call
            pulled = _in_thread(lambda: kv0.pull("w"))
            kv1.push("w", np.full(4, 2, np.int32))
            np.testing.assert_array_equal(kv1.pull("w"), [3] * 4)
            np.testing.assert_array_equal(pulled(), [3] * 4)


def test_a_row_sparse_push_of_a_round_open_at_a_restart_is_sent_again(tmp_path):
    """Rank 0's row-sparse push waits in an open round when the server is killed with -9 and
    restarted on its state dir, whose snapshot holds the round without that push: rank 0 sends
    it again, as it would a dense push, so that the round completes with rank 1's push and both
    pull the same exact value (SGD, learning rate 1: each row gets -gradient)."""
    state = str(tmp_path / "state")
    with Cluster(num_workers=2, round_timeout=5.0, tmp_path=tmp_path,
                 server_args=("--state-dir", state, "--snapshot-interval", "0")) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, timeout=TIMEOUT) as kv0, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, timeout=TIMEOUT) as kv1:
        for kv in (kv0, kv1):
            kv.init("w", np.zeros((4, 2), np.float32))
            kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
        kv0.push("w", tensorkv.row_sparse(np.full((1, 2), -1, np.float32), [1], (4, 2)))  # waits for rank 1
        Server(cluster.addresses[0], Security(), 10.0).kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
        cluster.restart()
        kv1.push("w", tensorkv.row_sparse(np.full((1, 2), -2, np.float32), [2], (4, 2)))
        expected = [[0, 0], [1, 1], [2, 2], [0, 0]]
        np.testing.assert_array_equal(kv0.pull("w"), expected)
        np.testing.assert_array_equal(kv1.row_sparse_pull("w", row_ids=[2, 1]), [[2, 2], [1, 1]])


@contextlib.contextmanager
def _sgd_pair(tmp_path):
    """(cluster, Server, rank 0's store, rank 1's store) of one server with a state dir (snapshots
    on request), SGD with learning rate 1 (each round adds -(sum of gradients)) and "w" = 0."""
    state = str(tmp_path / "state")
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=("--state-dir", state, "--snapshot-interval", "0")) \
            as cluster, _sgd_stores(cluster.addresses[0], cluster.addresses[0]) as (kv0, kv1):
        yield cluster, Server(cluster.addresses[0], Security(), 10.0), kv0, kv1


@contextlib.contextmanager
def _sgd_pair_through_proxy(tmp_path):
    """As :func:`_sgd_pair`, with rank 0 reaching the server through a FaultProxy and a metrics
    port: (cluster, Server, proxy, rank 0's store, rank 1's store, the metrics port)."""
    state, port = str(tmp_path / "state"), free_port()
    server_args = ("--state-dir", state, "--snapshot-interval", "0", "--metrics-port", str(port))
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=server_args) as cluster, \
            FaultProxy(cluster.addresses[0]) as proxy, \
            _sgd_stores(proxy.address, cluster.addresses[0]) as (kv0, kv1):
        yield cluster, Server(cluster.addresses[0], Security(), 10.0), proxy, kv0, kv1, port


@contextlib.contextmanager
def _sgd_stores(rank_0_address, rank_1_address):
    """Rank 0's and rank 1's stores, reaching the server at those addresses: SGD with learning
    rate 1 and "w" = 0."""
    with tensorkv.create("dist_sync", servers=rank_0_address, rank=0, timeout=TIMEOUT) as kv0, \
            tensorkv.create("dist_sync", servers=rank_1_address, rank=1, timeout=TIMEOUT) as kv1:
        kv0.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
        kv0.init("w", np.zeros(4, np.float32))
        kv1.init("w", np.zeros(4, np.float32))
        yield kv0, kv1


def test_a_round_in_the_snapshot_is_not_applied_again_when_the_workers_line_up(tmp_path):
    """Both ranks push and the round completes; the server writes a snapshot and is killed
    with -9 before either pulls. Restarted, it gets each rank's last push again, with its
    sequence number: the round is in the snapshot, so it is not applied a second time."""
    with _sgd_pair(tmp_path) as (cluster, server, kv0, kv1):
        kv0.push("w", np.full(4, 1, np.float32))
        kv1.push("w", np.full(4, 2, np.float32))
        wait_until(lambda: server.keys()[0].updates == 1, "the round applied")
        server.kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
        cluster.restart()
        pulled = _in_thread(lambda: kv0.pull("w"))
        np.testing.assert_array_equal(kv1.pull("w"), [-3] * 4)
        np.testing.assert_array_equal(pulled(), [-3] * 4)
        assert server.keys()[0].updates == 1
        # and the rounds go on in step
        kv0.push("w", np.full(4, 1, np.float32))
        kv1.push("w", np.full(4, 1, np.float32))
        np.testing.assert_array_equal(kv0.pull("w"), [-5] * 4)


def test_a_worker_that_saw_the_round_complete_lines_up_too_after_a_restart(tmp_path):
    """A snapshot; then both ranks push, the round completes and rank 0 pulls it, rank 1 not
    yet; the server is killed with -9 and restarted from the snapshot, which holds no round.
    Both ranks send their last push again with its number, so the round is done again and
    the next one lines up (before: rank 0, having seen its round complete, sent nothing, and
    its next push joined rank 1's old one)."""
    with _sgd_pair(tmp_path) as (cluster, server, kv0, kv1):
        server.kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
        kv0.push("w", np.full(4, 1, np.float32))
        kv1.push("w", np.full(4, 2, np.float32))
        np.testing.assert_array_equal(kv0.pull("w"), [-3] * 4)
        cluster.restart()
        pulled = _in_thread(lambda: kv1.pull("w"))
        kv0.push("w", np.full(4, 10, np.float32))
        np.testing.assert_array_equal(pulled(), [-3] * 4)
        kv1.push("w", np.full(4, 20, np.float32))
        np.testing.assert_array_equal(kv0.pull("w"), [-33] * 4)
        np.testing.assert_array_equal(kv1.pull("w"), [-33] * 4)


def test_a_connection_reset_while_create_asks_for_info_is_tried_again_within_connect_timeout(tmp_path):
    """The first connection is reset before the server's answer comes (the proxy swallows the
    HTTP/2 handshake): create connects again and joins, where a refused connection fails at
    once (tests/test_addresses.py)."""
    with Cluster(tmp_path=tmp_path) as cluster, FaultProxy(cluster.addresses[0]) as proxy:
        proxy.hold_replies()
        result = _in_thread(lambda: tensorkv.create("dist_sync", servers=proxy.address, connect_timeout=TIMEOUT))
        wait_until(lambda: proxy.connections >= 1, "create's first connection")
        time.sleep(0.2)
        proxy.reset()
        proxy.hold_replies(False)
        with result() as kv:
            kv.init("w", np.ones(4, np.int32))
            np.testing.assert_array_equal(kv.pull("w"), [1] * 4)
        assert proxy.connections >= 2


def test_a_set_optimizer_whose_answer_was_lost_is_sent_again_whole(tmp_path):
    """SetUpdater is a stream of messages: the call sent again after the reset carries all of
    them again (before, the messages were a generator that the first attempt had used up, and
    the server refused the empty stream: "SetUpdater names no optimizer")."""
    with Cluster(tmp_path=tmp_path) as cluster, FaultProxy(cluster.addresses[0]) as proxy:
        server = Server(cluster.addresses[0], Security(), 10.0)
        with tensorkv.create("dist_sync", servers=proxy.address, timeout=TIMEOUT) as kv:
            kv.init("w", np.zeros(4, np.float32))
            proxy.hold_replies()
            result = _in_thread(lambda: kv.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0)))
            wait_until(lambda: server.info().optimizer == "sgd", "the optimizer installed")  # its answer never arrives
            proxy.reset()
            proxy.hold_replies(False)
            result()
            kv.push("w", np.full(4, -5, np.float32))
            np.testing.assert_array_equal(kv.pull("w"), [5] * 4)


def test_a_call_to_a_server_that_stays_down_fails_once_its_timeout_has_passed(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses[0], timeout=3) as kv:
            kv.init("w", np.zeros(4, np.int32))
            cluster.kill(0)
            started = time.monotonic()
            with pytest.raises(tensorkv.ServerUnavailableError) as raised:
                kv.push("w", np.ones(4, np.int32))
            assert time.monotonic() - started < 3 + 5  # the timeout, plus a last attempt
            assert str(raised.value).startswith(f"server {cluster.addresses[0]} closed the connection during the push")
            assert f"reconnecting for 3 s (the push's timeout) failed: cannot connect to server {cluster.addresses[0]}: " \
                   "the connection was refused" in str(raised.value)


ROUNDS = 30
KEYS = {"a": 4, "b": 4, **{f"p{i}": 2 for i in range(12)}, "big": 16}  # as tests/workers/robust_rounds.py


def test_workers_go_on_through_a_server_kill_9_and_restart_on_its_state_dir(tmp_path):
    """2 servers x 3 workers, SGD (learning rate 1, every gradient 1): server 1 is killed with
    -9 mid-run and restarted on its state dir. No worker raises; each logs one warning naming
    the server; each value is 1000 - 3 x the rounds its server reports applied to it.

    The kill comes once every worker has seen round 10 complete, while they compute (some
    may have pushed round 11 already): not in the instant between a round's completion and
    its last answer, which the README names as the case a restart cannot line up."""
    server_args = ("--state-dir", str(tmp_path / "state{index}"), "--snapshot-interval", "0.2")
    with Cluster(servers=2, num_workers=3, tmp_path=tmp_path, server_args=server_args) as cluster:
        workers = [cluster.start_worker("robust_rounds", ROUNDS, "nocheck", 0.2) for _ in range(3)]
        try:
            for worker in workers:
                for line in worker.stdout:
                    if line == "round 10\n":  # a few snapshots written
                        break
            cluster.restart(1)  # kill -9, then the same command on the same port and state dir
            results = []
            for worker in workers:
                out, err = worker.communicate(timeout=120)
                results.append((worker.returncode, out, err))
        finally:
            for worker in workers:
                stop(worker)
        outs = check_workers(results)
        servers = [Server(address, Security(), 10.0) for address in cluster.addresses]
        restarted = servers[1].info()
        assert restarted.restored_from and restarted.restored_round >= 1, restarted
        updates = [{get_key(key.key): key.updates for key in server.keys()} for server in servers]
    for _, _, err in results:
        warnings = [line for line in err.splitlines() if "restarted and restored round" in line]
        assert len(warnings) == 1 and cluster.addresses[1] in warnings[0], err
    weights = [json.loads(out.splitlines()[-1])["weights"] for out in outs]
    assert weights[0] == weights[1] == weights[2]
    for (key, size), value in zip(KEYS.items(), weights[0]):
        if key == "big":  # a slice on each server
            expected = [1000 - 3 * updates[0][key]] * (size // 2) + [1000 - 3 * updates[1][key]] * (size // 2)
        else:
            expected = [1000 - 3 * next(counts[key] for counts in updates if key in counts)] * size
        assert value == expected, (key, updates)


@pytest.mark.parametrize("snapshots", [False, True], ids=["no-state-dir", "state-dir"])
def test_a_worker_keeps_copies_of_its_pushes_only_for_a_server_that_writes_snapshots(tmp_path, snapshots):
    """The copies are for lining the pushes up in the rounds a restart restores (Info.snapshots):
    without a state dir a restart restores nothing, and a push costs no copy of its bytes."""
    server_args = ("--state-dir", str(tmp_path / "state")) if snapshots else ()
    with Cluster(num_workers=2, tmp_path=tmp_path, server_args=server_args) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, timeout=TIMEOUT) as kv0, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, timeout=TIMEOUT) as kv1:
        assert Server(cluster.addresses[0], Security(), 10.0).info().snapshots == snapshots
        for kv in (kv0, kv1):
            kv.init("w", np.zeros(4, np.int32))
        kv0.push("w", np.ones(4, np.int32))  # its round waits for rank 1
        assert ("w" in kv0._conns[0]._pushes_kept) == snapshots
        kv1.push("w", np.ones(4, np.int32))
        np.testing.assert_array_equal(kv0.pull("w"), [2] * 4)


def test_a_push_of_an_aborted_round_is_not_sent_again_after_a_restart(tmp_path):
    """Rank 0's lone push is discarded with its aborted round; the server then restarts: the
    push is not sent again (it was, and the restored server applied it: a review's repro)."""
    state = str(tmp_path / "state")
    with Cluster(num_workers=2, round_timeout=1.0, tmp_path=tmp_path,
                 server_args=("--state-dir", state, "--snapshot-interval", "0")) as cluster, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, timeout=TIMEOUT) as kv0, \
            tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, timeout=TIMEOUT) as kv1:
        kv0.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
        for kv in (kv0, kv1):
            kv.init("w", np.zeros(4, np.float32))
        for kv, value in ((kv0, 1), (kv1, 10)):
            kv.push("w", np.full(4, value, np.float32))
        np.testing.assert_array_equal(kv0.pull("w"), [-11] * 4)
        np.testing.assert_array_equal(kv1.pull("w"), [-11] * 4)
        Server(cluster.addresses[0], Security(), 10.0).kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
        kv0.push("w", np.full(4, 2, np.float32))  # rank 1 does not push: the round aborts
        with pytest.raises(tensorkv.RoundAbortedError, match="their pushes were discarded"):
            kv0.pull("w")
        cluster.restart()  # SIGKILL; the snapshot holds round 1
        pulled = _in_thread(lambda: kv0.pull("w"))  # reconnects first, without rank 0's discarded push
        kv1.push("w", np.full(4, 30, np.float32))
        np.testing.assert_array_equal(pulled(), [-11] * 4)  # before rank 0's next push can join it
        kv0.push("w", np.full(4, 3, np.float32))
        np.testing.assert_array_equal(kv0.pull("w"), [-44] * 4)
        np.testing.assert_array_equal(kv1.pull("w"), [-44] * 4)


def test_a_sliced_row_sparse_key_lines_up_after_a_restart_whatever_rows_each_worker_pulls(tmp_path, monkeypatch):
    """Rank 1 pulls only rows of slice 0; slice 1's server restarts from an older snapshot: its
    rounds still line up. Before, rank 1's pulls never reached that server, which then got more
    of rank 1's pushes again than of rank 0's (a review's repro: rows summed across steps, then
    an aborted round)."""
    monkeypatch.setenv("TENSORKV_BIGARRAY_BOUND", "8")
    state = [str(tmp_path / f"state{i}") for i in range(2)]
    with Cluster(servers=2, num_workers=2, tmp_path=tmp_path, server_args=("--snapshot-interval", "0")) as cluster:
        for index, directory in enumerate(state):
            cluster.commands[index] += ["--state-dir", directory]
            cluster.restart(index)
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, timeout=TIMEOUT) as kv0, \
                tensorkv.create("dist_sync", servers=cluster.addresses, rank=1, timeout=TIMEOUT) as kv1:
            kv0.set_optimizer(tensorkv.optimizer.SGD(learning_rate=1.0))
            for kv in (kv0, kv1):
                kv.init("e", np.zeros((8, 2), np.float32))  # rows 0-3 on one server, rows 4-7 on the other

            def step(value):
                """Each worker pushes rows 0 and 4 (a row-sparse push waits for its round), then pulls."""
                def worker(kv, rows):
                    kv.push("e", tensorkv.row_sparse(np.full((2, 2), value * (kv.rank + 1), np.float32), [0, 4], (8, 2)))
                    return kv.row_sparse_pull("e", row_ids=rows)
                results = [_in_thread(lambda kv=kv, rows=rows: worker(kv, rows)) for kv, rows in ((kv0, [0, 4]), (kv1, [0]))]
                return [result() for result in results]

            step(1)
            Server(cluster.addresses[1], Security(), 10.0).kv.Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)
            step(10)
            step(100)
            cluster.restart(1)  # SIGKILL: rows 4-7 go back to the snapshot after step 1
            rows0, rows1 = step(1000)
        # row 4: step 10 lost, step 100 (the round both saw complete) summed again from their copies
        np.testing.assert_array_equal(rows0, [[-3333] * 2, [-3303] * 2])
        np.testing.assert_array_equal(rows1, [[-3333] * 2])


def test_each_new_channel_a_store_or_a_reconnect_makes_connects_on_its_own(tmp_path):
    """gRPC shares one connection, with its failures and their backoff, among the channels of
    a process to one address with the same options, unless told not to: a reconnect's new
    channel, or a new store's, then failed at once with another channel's last failed attempt
    ("cannot connect ...: the connection was refused", or "reset") for up to the backoff (2 s),
    however long the server had been up again (issue 32: under load a restart outlasts that
    backoff, and a store made just after it was refused). Each channel connects on its own:
    a second store through the proxy is a second connection there."""
    with Cluster(num_workers=2, tmp_path=tmp_path) as cluster, FaultProxy(cluster.addresses[0]) as proxy:
        with tensorkv.create("dist_sync", servers=proxy.address, rank=0, timeout=TIMEOUT) as kv0:
            kv0.init("w", np.zeros(4, np.int32))
            before = proxy.connections
            with tensorkv.create("dist_sync", servers=proxy.address, rank=1, timeout=TIMEOUT) as kv1:
                assert proxy.connections > before  # kv1 connected on its own
                kv1.init("w", np.zeros(4, np.int32))
                rounds = [_in_thread(lambda kv=kv: _pushpull(kv, 1)) for kv in (kv0, kv1)]
                for result in rounds:
                    np.testing.assert_array_equal(result(), [2] * 4)
