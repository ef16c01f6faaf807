"""A snapshot interrupted by kill -9 (issue 11's robustness suite): the server is frozen with
SIGSTOP while it writes a snapshot (its ``.part`` file exists, a seeded share of it written),
then killed with -9. Restarted on the same state dir it must load the snapshot before, whole
and exact, never the torn one, and go on taking and restoring snapshots."""
import os
import random
import signal
import time

import grpc
import numpy as np

import tensorkv
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

from cluster import WAIT, Cluster

ATTEMPTS = 5  # snapshots started until one is caught before its rename


def _stub(cluster):
    return kvstore_pb2_grpc.KVStoreServiceStub(grpc.insecure_channel(cluster.addresses[0]))


def _values(rng, sizes, base):
    """Integer-valued float32 arrays, distinct for each ``base``."""
    return {key: (base + rng.integers(-1000, 1000, size)).astype(np.float32) for key, size in sizes.items()}


def _store(cluster, values):
    """Assign ``values`` through a worker (one-worker sync rounds), then let it go."""
    with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, if_exists="resume") as kv:
        keys = sorted(values)
        kv.push(keys, [values[key] for key in keys])
        kv.pull(keys, out=[np.empty_like(values[key]) for key in keys])


def _pulled(cluster, values):
    with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0, if_exists="resume") as kv:
        outs = {key: np.empty_like(value) for key, value in values.items()}
        kv.pull(sorted(outs), out=[outs[key] for key in sorted(outs)])
        return outs


def _freeze_mid_write(cluster, state, name, nbytes, share):
    """Ask for a snapshot and SIGSTOP the server once ``name.part`` holds ``share`` of about
    ``nbytes``; True if it was frozen before the rename (else it is let go, the snapshot whole)."""
    pid, part = cluster.processes[0].pid, state / f"{name}.part"
    reply = _stub(cluster).Snapshot.future(kvstore_pb2.SnapshotRequest(), timeout=120)
    deadline = time.monotonic() + WAIT
    while not reply.done() and not (part.exists() and part.stat().st_size >= share * nbytes):
        assert time.monotonic() < deadline, f"{part} did not hold {share:.0%} of {nbytes} bytes within {WAIT} s"
        time.sleep(0.0005)  # the window between the last write and the rename can be short
    os.kill(pid, signal.SIGSTOP)
    if part.exists() and not (state / name).exists():
        return True
    os.kill(pid, signal.SIGCONT)
    assert reply.result().file_name == name
    return False


def test_a_snapshot_torn_by_kill_9_is_never_loaded_and_the_one_before_is(seed, tmp_path):
    rng = np.random.default_rng(seed)
    share = random.Random(seed).uniform(0, 0.9)  # of the file written when the server is frozen
    sizes = {"big": int(rng.integers(6, 12)) << 20, "small": int(rng.integers(1, 64))}
    nbytes = 4 * sum(sizes.values())
    state = tmp_path / "state"
    with Cluster(tmp_path=tmp_path, server_args=["--state-dir", str(state), "--snapshot-interval", "0"]) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses, rank=0) as kv:
            kv.init(sorted(sizes), [np.zeros(size, np.float32) for _, size in sorted(sizes.items())])
        before = _values(rng, sizes, 0)
        _store(cluster, before)
        first = _stub(cluster).Snapshot(kvstore_pb2.SnapshotRequest(), timeout=120).file_name
        number = int(first[len("snapshot-"):-len(".tkv")])
        for attempt in range(1, ATTEMPTS + 1):
            stored = _values(rng, sizes, 10000 * attempt)
            _store(cluster, stored)
            name = f"snapshot-{number + attempt:012d}.tkv"
            if _freeze_mid_write(cluster, state, name, nbytes, share):
                break
            before, first = stored, name  # written whole: the one a restart loads
        else:
            raise AssertionError(f"no snapshot was caught before its rename in {ATTEMPTS} attempts")
        cluster.restart()  # SIGKILL of the stopped server, then a new one on the same state dir
        info = _stub(cluster).Info(kvstore_pb2.InfoRequest(), timeout=10)
        assert info.restored_from == first
        restored = _pulled(cluster, before)
        for key in sizes:
            np.testing.assert_array_equal(restored[key], before[key], err_msg=key)
        # the torn file does not stop the next snapshot, which a later restart loads
        after = _values(rng, sizes, -50000)
        _store(cluster, after)
        latest = _stub(cluster).Snapshot(kvstore_pb2.SnapshotRequest(), timeout=120).file_name
        cluster.restart()
        assert _stub(cluster).Info(kvstore_pb2.InfoRequest(), timeout=10).restored_from == latest
        restored = _pulled(cluster, after)
        for key in sizes:
            np.testing.assert_array_equal(restored[key], after[key], err_msg=key)
