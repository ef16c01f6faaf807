"""Snapshots in --state-dir: taken by the Snapshot RPC, on SIGTERM and every
--snapshot-interval; restored at start from the newest whole one. One server for one
dist_sync worker (tests/workers/sgd_run.py: SGD with momentum over three int keys)."""
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys

import grpc
import numpy as np
import pytest

import tensorkv
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import STOP_TIMEOUT, Cluster, DrivenWorker, check_workers, free_port, rank_1_after_a_round, wait_until
from test_ctl import ctl
from test_metrics import scrape

ROUNDS = 3
BASE = np.array([1, -1, 2, 0.5])


def _sgd(rounds, lr=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5):
    """sgd_run.py's three keys after rounds t of ``rounds`` of one worker: MXNet's
    sgd_mom_update on (i + 1) * BASE * t, from fresh states."""
    weights = []
    for i in range(3):
        weight, mom = np.arange(4.0) + 10 * i, 0.0
        for t in rounds:
            mom = momentum * mom - lr * (rescale_grad * (i + 1) * BASE * t + wd * weight)
            weight = weight + mom
        weights.append(weight)
    return np.array(weights)


def _run(cluster, if_exists=None):
    env = {"TENSORKV_IF_EXISTS": if_exists} if if_exists else None
    return json.loads(check_workers(cluster.run_workers("sgd_run", "int", ROUNDS, env=env))[0])


def _stub(cluster):
    return kvstore_pb2_grpc.KVStoreServiceStub(grpc.insecure_channel(cluster.addresses[0]))


def _info(cluster):
    return _stub(cluster).Info(kvstore_pb2.InfoRequest(), timeout=5)


def _snapshot(cluster):
    return _stub(cluster).Snapshot(kvstore_pb2.SnapshotRequest(), timeout=10)


def _incarnation(cluster):
    """The incarnation a registration gets now (it starts a run of its own)."""
    with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, if_exists="resume"):
        return _info(cluster).workers[0].incarnation


def _cluster(tmp_path, *args):
    return Cluster(tmp_path=tmp_path, server_args=["--state-dir", str(tmp_path / "state"), *args])


def _log(cluster):
    cluster.logs[0].flush()
    return open(cluster.logs[0].name).read()


def test_a_snapshot_survives_kill_9_and_a_resumed_run_goes_on_exactly(tmp_path):
    with _cluster(tmp_path, "--snapshot-interval", "0") as cluster:
        np.testing.assert_allclose(_run(cluster)["weights"], _sgd(range(1, 4)), rtol=1e-5)
        before_info = _info(cluster)
        reply = _snapshot(cluster)
        assert (reply.file_name, reply.num_keys, reply.run) == ("snapshot-000000000001.tkv", 3, 1)
        incarnation = _incarnation(cluster)  # run 2, after the snapshot: not saved
        cluster.restart()  # SIGKILL
        info = _info(cluster)
        assert (info.restored_from, info.num_keys, info.optimizer, info.run) == (reply.file_name, 3, "sgd", 1)
        assert info.server_id != before_info.server_id
        assert f"restored 3 keys, run 1, from {tmp_path / 'state' / reply.file_name}" in _log(cluster)
        # the update counts and the key type came back: a run with if_exists='fail' is told
        refused = _run(cluster)
        assert refused["error"] == "KeyExistsError"
        assert "(3 rounds applied to it)" in refused["message"]
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, if_exists="resume") as kv:
            assert _info(cluster).workers[0].incarnation > incarnation
            with pytest.raises(tensorkv.KeyTypeError):
                kv.init("w", np.zeros(4, np.float32))
        # the values, the optimizer and its momentum go on as if there had been no restart
        weights = _run(cluster, if_exists="resume")["weights"]
        assert _info(cluster).run == 4  # 1 restored, then fail, the store above, resume
    np.testing.assert_allclose(weights, _sgd([*range(1, 4), *range(1, 4)]), rtol=1e-5)


def test_a_run_going_on_at_a_snapshot_goes_on_after_a_restart(tmp_path):
    """A server restarted from its snapshot keeps the run it had (API.md): a worker of the run
    goes on in it, and a replacement for a worker that left joins it, so its init with
    if_exists='fail' is not refused as a new run's (it once started run 2 at the first
    registration after the restart)."""
    with Cluster(num_workers=2, tmp_path=tmp_path,
                 server_args=["--state-dir", str(tmp_path / "state"), "--snapshot-interval", "0"]) as cluster:
        address = cluster.addresses[0]
        kv1 = rank_1_after_a_round(address)
        try:
            assert _snapshot(cluster).run == 1  # rank 1 is registered: run 1 is going on
            cluster.restart()  # SIGKILL
            np.testing.assert_array_equal(kv1.pull("w"), [3.0] * 4)  # registers again, naming its incarnation
            with tensorkv.create("dist_sync", servers=address, rank=0) as kv0:  # if_exists='fail'
                kv0.init("w", np.full(4, 9.0, np.float32))  # joins run 1: the stored value stays
                for kv in (kv0, kv1):
                    kv.push("w", np.full(4, 10.0 * (kv.rank + 1), np.float32))
                np.testing.assert_array_equal(kv0.pull("w"), [30.0] * 4)
                info = _info(cluster)
                assert (info.run, sorted(info.registered_ranks)) == (1, [0, 1])
        finally:
            kv1.close()
        assert "run 1 goes on after this server's restart" in _log(cluster)
        assert "run 2 starts" not in _log(cluster)


def test_a_restored_run_goes_on_through_a_second_restart_and_with_replace(tmp_path):
    """Restarted twice, the second snapshot taken before its worker came back, a run started
    with if_exists='replace' still goes on: its worker comes back (asking for 'resume', so
    that nothing restored is dropped) and is not refused as a worker of another run."""
    with _cluster(tmp_path, "--snapshot-interval", "0") as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="replace") as kv:
            kv.init("w", np.zeros(4, np.float32))
            kv.push("w", np.ones(4, np.float32))
            assert _snapshot(cluster).run == 1
            cluster.restart()  # SIGKILL
            assert _snapshot(cluster).run == 1  # its worker is not back yet: run 1 is still going on
            cluster.restart()
            kv.push("w", np.full(4, 2.0, np.float32))
            np.testing.assert_array_equal(kv.pull("w"), [2.0] * 4)
            assert _info(cluster).run == 1
        assert "run 1 goes on after this server's restart" in _log(cluster)
        assert "run 2 starts" not in _log(cluster)


def test_a_job_started_again_with_resume_right_after_a_restart_is_a_new_run(tmp_path):
    """A worker that registers within a lease of the restart asking for another if_exists than
    the restored run's (the job started again with 'resume', as bench/failures.py does) starts
    a new run; it was refused as a worker of the restored run."""
    with _cluster(tmp_path, "--snapshot-interval", "0") as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:  # if_exists='fail'
            kv.init("w", np.full(4, 3.0, np.float32))
            assert _snapshot(cluster).run == 1  # taken while run 1 is going on
        cluster.restart()  # SIGKILL
        with tensorkv.create("dist_sync", servers=cluster.addresses, if_exists="resume") as kv:
            np.testing.assert_array_equal(kv.pull("w"), [3.0] * 4)
            assert _info(cluster).run == 2


def test_workers_a_push_apart_line_up_after_a_restart_from_an_older_snapshot(tmp_path):
    """Rank 0 has its next push in (waiting for rank 1), rank 1 saw the round before complete,
    and the snapshot is older than both: after a kill -9, both send again their pushes of the
    round they saw complete (summed again: nothing is lost), and rank 0 its next, which rank
    1's next joins. Before, each sent only its last push, which summed rank 1's step with
    rank 0's next, and the workers stayed a push apart for the rest of the job (a durability
    probe: 7 runs of 10 with workers of unequal speed)."""
    workers = []
    try:
        with _cluster(tmp_path, "--snapshot-interval", "0", "--num-workers", "2") as cluster:
            workers += [DrivenWorker(cluster, 0), DrivenWorker(cluster, 1)]
            fast, slow = workers
            for worker in workers:  # round 1 (SGD(learning_rate=-1) adds each round's sum to w)
                worker.call("push 1", "pushed")
            assert fast.call("pull") == slow.call("pull") == "value 2"
            _snapshot(cluster)  # holds round 1
            for worker in workers:  # round 2: lost with the server
                worker.call("push 10", "pushed")
            assert fast.call("pull") == slow.call("pull") == "value 22"
            fast.call("push 100", "pushed")  # round 3: rank 0's push is in, rank 1 is elsewhere
            fast.send("pull")
            cluster.restart()  # SIGKILL, then the snapshot of round 1
            slow.call("push 100", "pushed")
            assert fast.expect() == slow.call("pull") == "value 222"  # 2 + 20 + 200: the rounds line up
            for worker in workers:
                worker.call("push 1000", "pushed")
            assert fast.call("pull") == slow.call("pull") == "value 2222"
    finally:
        for worker in workers:
            worker.stop()


def test_sigterm_writes_a_snapshot_that_a_restart_loads(tmp_path):
    with _cluster(tmp_path, "--snapshot-interval", "0") as cluster:
        first = _run(cluster)["weights"]
        cluster.processes[0].send_signal(signal.SIGTERM)
        assert cluster.processes[0].wait(STOP_TIMEOUT) == 0
        assert "snapshot snapshot-000000000001.tkv written: 3 keys, run 1" in _log(cluster)
        cluster.restart()
        assert _info(cluster).restored_from == "snapshot-000000000001.tkv"
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, if_exists="resume") as kv:
            np.testing.assert_array_equal(kv.pull([0, 1, 2]), np.array(first, np.float32))


def test_a_snapshot_is_the_documented_npz_and_one_that_np_savez_wrote_loads(tmp_path):
    with _cluster(tmp_path, "--snapshot-interval", "0") as cluster:
        weights = np.array(_run(cluster)["weights"], np.float32)
        written = tmp_path / "state" / _snapshot(cluster).file_name
        line, _, payload = written.read_bytes().partition(b"\n")
        assert line == b"tensorkv-snapshot 1 " + hashlib.sha256(payload).hexdigest().encode()
        with np.load(io.BytesIO(payload), allow_pickle=False) as archive:  # what another reader does
            arrays = {name: archive[name] for name in archive.files}
        header = json.loads(bytes(arrays["header"]).decode())
        assert [entry["key"] for entry in header["keys"]] == [0, 1, 2]
        np.testing.assert_array_equal([arrays[f"value_{i}"] for i in range(3)], weights)
        assert sorted(arrays) == ["header", "state_0", "state_1", "state_2", "value_0", "value_1", "value_2"]
        rewritten = io.BytesIO()  # as np.savez writes it: sizes before the data, no zip64 fields
        np.savez(rewritten, **arrays)
        newer = written.with_name("snapshot-000000000002.tkv")
        newer.write_bytes(b"tensorkv-snapshot 1 " + hashlib.sha256(rewritten.getvalue()).hexdigest().encode() + b"\n"
                          + rewritten.getvalue())
        cluster.restart()
        assert _info(cluster).restored_from == newer.name
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, if_exists="resume") as kv:
            np.testing.assert_array_equal(kv.pull([0, 1, 2]), weights)


@pytest.mark.parametrize("damage", ["flip", "truncate", "unparsable"])
def test_a_damaged_newest_snapshot_is_skipped_for_the_one_before(tmp_path, damage):
    with _cluster(tmp_path, "--snapshot-interval", "0") as cluster:
        _run(cluster)
        older = _snapshot(cluster).file_name
        _run(cluster, if_exists="resume")
        newest = tmp_path / "state" / _snapshot(cluster).file_name
        data = bytearray(newest.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        elif damage == "truncate":
            del data[len(data) // 2:]
        else:  # a right checksum over a payload that is not an archive
            data = b"tensorkv-snapshot 1 " + hashlib.sha256(b"junk").hexdigest().encode() + b"\njunk"
        newest.write_bytes(bytes(data))
        (tmp_path / "state" / "snapshot-000000000099.tkv.part").write_bytes(b"half a snapshot")
        cluster.restart()
        info = _info(cluster)
        assert (info.restored_from, info.run) == (older, 1)
        skipped = [line for line in _log(cluster).splitlines() if "skipped" in line]
        assert len(skipped) == 1 and str(newest) in skipped[0], skipped
        assert ("unreadable payload" if damage == "unparsable" else "checksum mismatch") in skipped[0]


def test_snapshots_are_written_every_interval_and_the_two_newest_kept(tmp_path):
    """Every interval while the state changes; the two newest are kept. An idle server writes
    nothing and logs nothing (it logged a snapshot line every interval, for ever), and keeps
    its two snapshots of other states."""
    with _cluster(tmp_path, "--snapshot-interval", "0.2") as cluster:
        state = tmp_path / "state"

        def files():
            return sorted(path.name for path in state.glob("*.tkv"))

        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("w", np.zeros(4, np.float32))

            def pushed_until_a_third():
                kv.push("w", np.ones(4, np.float32))
                return files() and files()[-1] >= "snapshot-000000000003.tkv"

            wait_until(pushed_until_a_third, "a third periodic snapshot")
        # idle now: once the snapshot of the run's end is written, the periodic ones find
        # nothing changed (Info's time of the last snapshot moves, its file does not)
        seen = []

        def idle_for(checks):
            info = _info(cluster)
            if not seen or seen[-1][0] != info.last_snapshot:
                seen[:] = [(info.last_snapshot, info.last_snapshot_unix_ms)]
            elif seen[-1][1] != info.last_snapshot_unix_ms:
                seen.append((info.last_snapshot, info.last_snapshot_unix_ms))
            return len(seen) > checks

        wait_until(lambda: idle_for(1), "a periodic snapshot that found nothing changed")
        newest, written = files(), _log(cluster).count(" written: ")
        assert len(newest) == 2 and newest[-1] == seen[-1][0]
        assert not os.path.samefile(state / newest[0], state / newest[1])
        wait_until(lambda: idle_for(4), "three more periodic snapshots of an idle server")
        assert files() == newest and _log(cluster).count(" written: ") == written


def test_without_a_state_dir_the_server_warns_and_refuses_snapshots(tmp_path):
    with Cluster(tmp_path=tmp_path) as cluster:
        with pytest.raises(grpc.RpcError) as raised:
            _snapshot(cluster)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no --state-dir: nothing survives a restart" in _log(cluster)
        assert _info(cluster).restored_from == ""


def test_a_server_of_another_worker_count_refuses_the_snapshot(tmp_path):
    with _cluster(tmp_path, "--snapshot-interval", "0") as cluster:  # its stop writes snapshot 1
        command = [*cluster.commands[0], "--num-workers", "2"]  # the later flag wins
    refused = subprocess.run(command, capture_output=True, text=True, timeout=STOP_TIMEOUT)
    assert refused.returncode == 1
    assert refused.stderr.strip().endswith(
        f"--state-dir {tmp_path / 'state'}: snapshot-000000000001.tkv: taken by a server with --mode sync --num-workers 1, "
        "not --mode sync --num-workers 2")


def test_snapshots_take_turns_and_a_cancelled_one_finishes_its_file_first(tmp_path, monkeypatch):
    """Each snapshot holds a copy of every value until its file is written: a second one asked
    for meanwhile (a Snapshot call) copies nothing until the first file is done, and the
    periodic one cancelled at SIGTERM keeps its turn until its file is written, so that the
    last snapshot's copy is never held next to another."""
    import asyncio
    import threading

    from tensorkv.wire.codec import Item
    from tensorkv.update.engine import Engine
    from tensorkv_server import snapshot
    from tensorkv_server.rounds import Coordinator

    coordinator = Coordinator(Engine(np), 1, "sync", 60.0)
    coordinator.engine.init([Item("a", np.ones(4, np.float32))])
    snapshots = snapshot.Snapshots(coordinator, str(tmp_path))
    events, release = [], threading.Event()
    capture, write = snapshot.capture, snapshots._write

    def recorded_capture(*args):
        events.append("copy")
        return capture(*args)

    def held_write(*args):
        events.append("write starts")
        release.wait(STOP_TIMEOUT)
        write(*args)
        events.append("write ends")

    monkeypatch.setattr(snapshot, "capture", recorded_capture)
    snapshots._write = held_write

    async def scenario():
        first = asyncio.create_task(snapshots.take())
        for _ in range(500):
            if "write starts" in events:
                break
            await asyncio.sleep(0.01)
        coordinator.engine.init([Item("b", np.ones(4, np.float32))])  # a change: the second one is written
        second = asyncio.create_task(snapshots.take())
        await asyncio.sleep(0.2)
        first.cancel()
        await asyncio.sleep(0.2)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(first, STOP_TIMEOUT)
        return await asyncio.wait_for(second, STOP_TIMEOUT)

    name, num_keys, _ = asyncio.run(scenario())
    assert events == ["copy", "write starts", "write ends", "copy", "write starts", "write ends"]
    assert (name, num_keys) == ("snapshot-000000000002.tkv", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock", "snapshot-000000000001.tkv",
                                                          "snapshot-000000000002.tkv"]


def test_a_failing_state_dir_shows_in_info_metrics_status_and_the_exit_status(tmp_path):
    """Snapshots that fail (here: the state directory replaced by a file) are logged, counted,
    and shown by Info and `tensorkv status` (exit 1) until one is written again; the Snapshot
    RPC says why without the path; a last snapshot that fails at SIGTERM ends the server with
    status 1 and one line, after its log says it stopped."""
    port, state = free_port(), tmp_path / "state"
    with _cluster(tmp_path, "--snapshot-interval", "0.2", "--metrics-port", str(port)) as cluster:
        wait_until(lambda: _info(cluster).last_snapshot, "a periodic snapshot")
        state.rename(tmp_path / "moved")
        state.write_text("a file where the state directory was")
        wait_until(lambda: _info(cluster).snapshot_error == "Not a directory", "a periodic snapshot that failed")
        info = _info(cluster)
        assert info.snapshot_error == "Not a directory" and info.last_snapshot.startswith("snapshot-")
        code, out, err = ctl("status", servers=cluster.addresses)
        assert code == 1 and "FAILING: Not a directory" in out
        assert f"server {cluster.addresses[0]}: its last snapshot failed: Not a directory (" in err
        with pytest.raises(grpc.RpcError) as raised:
            _snapshot(cluster)
        assert raised.value.code() == grpc.StatusCode.INTERNAL
        assert raised.value.details() == \
            "the snapshot could not be written: Not a directory (the server's log names the file)"
        _, samples = scrape(port)
        assert samples[("tensorkv_snapshots_total", (("outcome", "failed"),))] >= 2
        assert samples[("tensorkv_snapshots_total", (("outcome", "written"),))] >= 1
        assert samples[("tensorkv_last_snapshot_timestamp_seconds", ())] == \
            pytest.approx(info.last_snapshot_unix_ms / 1000, abs=0.002)
        assert f"failed: [Errno 20] Not a directory: '{state}/snapshot-" in _log(cluster)
        assert "unexpected error" not in _log(cluster)

        state.unlink()
        (tmp_path / "moved").rename(state)
        wait_until(lambda: not _info(cluster).snapshot_error, "a snapshot written again")
        assert ctl("status", servers=cluster.addresses)[0] == 0

        state.rename(tmp_path / "moved-again")
        state.write_text("a file where the state directory was")
        cluster.processes[0].send_signal(signal.SIGTERM)
        assert cluster.processes[0].wait(STOP_TIMEOUT) == 1
        lines = _log(cluster).splitlines()
        assert lines[-1].startswith("tensorkv-server: the last snapshot failed: [Errno 20] Not a directory")
        assert lines[-2].endswith("INFO tensorkv_server.server: stopped")
        assert not any("Traceback" in line for line in lines)


def test_a_state_dir_is_one_servers_and_a_directory(tmp_path):
    state, plain = tmp_path / "state", tmp_path / "plain"
    plain.write_text("")

    def refusal(directory):
        done = subprocess.run([sys.executable, "-m", "tensorkv_server", "--port", str(free_port()), "--device", "cpu",
                               "--state-dir", str(directory)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stderr
        return done.stderr.splitlines()[-1]

    with _cluster(tmp_path) as cluster:
        assert refusal(state) == (f"tensorkv-server: --state-dir {state}: another tensorkv-server (pid "
                                  f"{cluster.processes[0].pid} on {socket.gethostname()}) uses this state directory; "
                                  "give each server a --state-dir of its own")
    assert refusal(plain) == f"tensorkv-server: --state-dir {plain}: not a directory"


@pytest.fixture
def small_volume(tmp_path):
    """A 20 MiB tmpfs mounted on tmp_path/volume (as root; skipped where mount is not permitted),
    unmounted after the test."""
    volume = tmp_path / "volume"
    volume.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(volume)], capture_output=True,
                             text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(volume)], timeout=30, check=True)


STATE_ELEMENTS = 2 << 20  # float32: an 8 MiB state


def test_a_volume_with_room_for_two_copies_takes_every_snapshot_and_is_checked_at_start(tmp_path, small_volume):
    """8 MiB of state on a 20 MiB volume: the older snapshot is removed before the next is
    written, so every one is written (the third failed, and every one after, when both were
    kept until the next was on disk). At start the server says when the volume cannot hold
    two copies of its state, or of what --max-memory lets it hold."""
    state, port = small_volume / "state", free_port()
    args = ["--state-dir", str(state), "--snapshot-interval", "0", "--metrics-port", str(port)]
    with Cluster(tmp_path=tmp_path, server_args=[*args, "--max-memory", str(9 << 20)]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            kv.init("w", np.zeros(STATE_ELEMENTS, np.float32))
            for number in range(1, 6):
                kv.push("w", np.full(STATE_ELEMENTS, number, np.float32))
                kv.pull("w")
                assert _snapshot(cluster).file_name == f"snapshot-{number:012d}.tkv"
        _, samples = scrape(port)
        assert 16 << 20 < samples[("tensorkv_snapshot_room_bytes", ())] <= 20 << 20
        assert "has room for" not in _log(cluster)
    assert sorted(path.name for path in state.iterdir()) == [
        "lock", "snapshot-000000000005.tkv", "snapshot-000000000006.tkv"]  # the run's end, at stop
    with Cluster(tmp_path=tmp_path, server_args=[*args, "--max-memory", str(16 << 20)]) as cluster:
        assert _info(cluster).restored_from == "snapshot-000000000006.tkv"
        assert f"--state-dir {state} has room for " in _log(cluster)
        assert "less than two copies of what --max-memory 16 MiB lets this server hold: snapshots fail once the " \
               "state passes " in _log(cluster)
    (state / "snapshot-000000000005.tkv").unlink()
    (small_volume / "other").write_bytes(bytes(6 << 20))  # something else takes room on the volume
    with Cluster(tmp_path=tmp_path, server_args=[*args, "--max-memory", str(9 << 20)]) as cluster:
        assert "less than two copies of the current state (8 MiB each): the next snapshot will fail; give it " \
               "at least 16 MiB" in _log(cluster)


def _damage_every_snapshot(state):
    """Flip one byte in the middle of each snapshot file in ``state``; {name: damaged bytes}."""
    damaged = {}
    for path in state.glob("snapshot-*.tkv"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.unlink()  # another file than any hard link to it
        path.write_bytes(bytes(data))
        damaged[path.name] = bytes(data)
    return damaged


def test_a_state_dir_whose_snapshots_all_fail_to_load_stops_the_server_unless_told_to_start_empty(tmp_path):
    """One flipped byte in each kept snapshot: the server started empty, and its rotation later
    removed the damaged files. Now it refuses to start (exit status 2, like a refused option),
    naming them; with --start-empty-if-damaged it starts empty and keeps them, set aside."""
    state = tmp_path / "state"
    with _cluster(tmp_path, "--snapshot-interval", "0") as cluster:
        _run(cluster)
        _snapshot(cluster)
        _run(cluster, if_exists="resume")
        _snapshot(cluster)
    damaged = _damage_every_snapshot(state)
    assert len(damaged) >= 2, damaged
    command = [*cluster.commands[0]]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    last = refused.stderr.splitlines()[-1]
    assert last.startswith(f"tensorkv-server: --state-dir {state}: no snapshot loads (")
    for name in damaged:
        assert f"{name}: checksum mismatch (truncated or corrupt)" in last
    assert "--start-empty-if-damaged" in last
    assert sorted(path.name for path in state.glob("snapshot-*")) == sorted(damaged)  # nothing changed

    with _cluster(tmp_path, "--snapshot-interval", "0", "--start-empty-if-damaged") as cluster:
        assert (_info(cluster).restored_from, _info(cluster).num_keys) == ("", 0)
        for _ in range(3):
            _run(cluster, if_exists="resume")
            _snapshot(cluster)
        assert "no snapshot loads in " in _log(cluster)
    for name, data in damaged.items():
        assert (state / (name + ".damaged")).read_bytes() == data
    assert len(list(state.glob("snapshot-*.tkv"))) == 2
