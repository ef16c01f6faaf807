"""The failure rows of `make bench` (issue 11): how long the server takes to free the rank of
a worker killed with -9, next to its --lease-timeout; how long a server takes to write a
snapshot of SIZE bytes of values (1 GiB; 128 MiB with --quick), then, killed with -9, to
start again on its state dir and answer with every value restored (checked exactly after the
clock stops), next to reading the snapshot file with plain Python in the same run (it is in
the page cache by then: a reference for the decoding, not for a disk); and the push+pull
throughput of one worker (4 MiB and 64 MiB values; 16 MiB with --quick) with a server that
writes a snapshot every SNAPSHOT_INTERVAL seconds (of BALLAST bytes of other values too, so
that each one takes real time) over that with a server without snapshots, round trips to
the two interleaved, in seconds in all (not medians: the round trips a snapshot slows
count), for at least so many round trips and until SNAPSHOTS snapshots were written
meanwhile, every pulled value checked (goal: >= 0.8). Writes <out-dir>/failures.{json,md}.
"""
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

import tensorkv
from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc

import common

LEASE = 2.0  # --lease-timeout of the detection rows
KILLS = 5  # workers killed per run (3 with --quick)
KEY_BYTES = 64 << 20  # each key of the snapshot rows
SNAPSHOT_INTERVAL = 1.0  # --snapshot-interval of the throughput rows
BALLAST = 384 << 20  # bytes of other values the snapshots of the throughput rows hold (64 MiB with --quick)
SNAPSHOTS = 3  # snapshots written during each push+pull row, at least (1 with --quick)
GOAL = 0.8  # throughput while snapshots are written / without
WAIT = 60.0  # seconds any wait of this script may take
# A worker that registers as rank 1 and waits to be killed.
IDLE_WORKER = "import time, tensorkv; kv = tensorkv.create('dist_sync', rank=1); print('ready', flush=True); time.sleep(600)"


FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                  ("grpc.max_reconnect_backoff_ms", 50)]


def start_server(port, logdir, *args):
    """A `tensorkv-server` on 127.0.0.1:``port``; the process once it answers Info."""
    log = open(os.path.join(logdir, f"server-{port}.log"), "a")
    proc = subprocess.Popen([sys.executable, "-m", "tensorkv_server", "--port", str(port), "--device", "cpu", *args],
                            stdout=log, stderr=subprocess.STDOUT)
    info(f"127.0.0.1:{port}", proc)
    return proc


def info(address, proc):
    """The server's InfoResponse, waiting (bounded) until it answers."""
    deadline = time.monotonic() + WAIT
    # A channel that failed to connect waits out gRPC's backoff (1 s, then 1.6 times more
    # each time) before it tries again: a short one, so that a server that starts is seen at once.
    with grpc.insecure_channel(address, options=FAST_RECONNECT) as channel:
        stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
        while True:
            try:
                return stub.Info(kvstore_pb2.InfoRequest(), timeout=1.0)
            except grpc.RpcError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server {address} exited or did not answer within {WAIT:g} s") from None
                time.sleep(0.005)


def detection_seconds(kills, logdir):
    """Seconds from each SIGKILL of rank 1 to the server's Info without it."""
    port = common.free_port()
    address = f"127.0.0.1:{port}"
    server = start_server(port, logdir, "--num-workers", "2", "--lease-timeout", str(LEASE))
    env = dict(os.environ, TENSORKV_SERVERS=address)
    seconds = []
    try:
        with tensorkv.create("dist_sync", servers=address, rank=0):
            for _ in range(kills):
                worker = subprocess.Popen([sys.executable, "-c", IDLE_WORKER], env=env, stdout=subprocess.PIPE, text=True)
                try:
                    worker.stdout.readline()
                    os.kill(worker.pid, signal.SIGKILL)
                    killed = time.monotonic()
                    while 1 in info(address, server).registered_ranks:
                        if time.monotonic() - killed > WAIT:
                            raise RuntimeError(f"rank 1 not freed within {WAIT:g} s")
                        time.sleep(0.005)
                    seconds.append(time.monotonic() - killed)
                finally:
                    common.stop(worker)
    finally:
        common.stop(server)
    return seconds


def restart_seconds(size, logdir):
    """(seconds to write the snapshot, to restart from it, to read its file) of ``size`` bytes of values."""
    port = common.free_port()
    address = f"127.0.0.1:{port}"
    state = tempfile.mkdtemp(dir=logdir)
    args = ("--num-workers", "1", "--state-dir", state, "--snapshot-interval", "0")
    keys = [f"k{i}" for i in range(max(1, size // KEY_BYTES))]
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 1 << 20, KEY_BYTES // 4, dtype=np.int32) for _ in keys]
    server = start_server(port, logdir, *args)
    try:
        with tensorkv.create("dist_sync", servers=address, transport="grpc") as kv:
            kv.init(keys, values)
            with grpc.insecure_channel(address) as channel:
                start = time.perf_counter()
                name = kvstore_pb2_grpc.KVStoreServiceStub(channel).Snapshot(kvstore_pb2.SnapshotRequest(),
                                                                              timeout=WAIT).file_name
                write = time.perf_counter() - start
        server.kill()
        server.wait()
        start = time.perf_counter()
        server = start_server(port, logdir, *args)
        restart = time.perf_counter() - start
        if not info(address, server).restored_from:
            raise RuntimeError("the restarted server restored no snapshot")
        with tensorkv.create("dist_sync", servers=address, transport="grpc", if_exists="resume") as kv:
            for key, value in zip(keys, values):
                if not np.array_equal(kv.pull(key), value):
                    raise RuntimeError(f"key {key!r} was not restored exactly")
    finally:
        common.stop(server)
    start = time.perf_counter()
    with open(os.path.join(state, name), "rb") as f:
        while f.read(64 << 20):
            pass
    return write, restart, time.perf_counter() - start


def throughput_seconds(sizes, samples, snapshots, ballast, logdir):
    """{size: {"with": seconds, "without": seconds, "round_trips": n, "snapshots": written}} of
    push+pull round trips of a value of ``size`` bytes with a server writing snapshots and
    one without: at least ``samples[size]`` of each, until ``snapshots`` were written."""
    state = tempfile.mkdtemp(dir=logdir)
    server_args = {"with": ("--state-dir", state, "--snapshot-interval", str(SNAPSHOT_INTERVAL)), "without": ()}
    rng = np.random.default_rng(1)
    patterns = {size: [rng.integers(0, 1 << 20, size // 4, dtype=np.int32) for _ in range(2)] for size in sizes}
    ballast_keys = [f"ballast{i}" for i in range(ballast // KEY_BYTES)]
    rows, servers, stores = {}, [], {}
    try:
        for which, args in server_args.items():
            port = common.free_port()
            servers.append(start_server(port, logdir, "--num-workers", "1", *args))
            stores[which] = kv = tensorkv.create("dist_sync", servers=f"127.0.0.1:{port}", rank=0)
            kv.init(ballast_keys, [np.ones(KEY_BYTES // 4, np.int32)] * len(ballast_keys))
            kv.init([f"v{size}" for size in sizes], [patterns[size][0] for size in sizes])
        for size in sizes:
            rows[size] = row = dict.fromkeys(server_args, 0.0)
            out, first, deadline = np.empty(size // 4, np.int32), _newest(state), time.monotonic() + WAIT
            i = 0
            while i <= samples[size] or _newest(state) - first < snapshots:  # round trip 0 warms up
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{_newest(state) - first} snapshots written in {WAIT:g} s, not {snapshots}")
                for which in ("with", "without") if i % 2 else ("without", "with"):
                    out.fill(-1)
                    start = time.perf_counter()
                    stores[which].push(f"v{size}", patterns[size][i % 2])
                    stores[which].pull(f"v{size}", out=out)
                    if i:
                        row[which] += time.perf_counter() - start
                    if not np.array_equal(out, patterns[size][i % 2]):
                        raise RuntimeError(f"{size >> 20} MiB push+pull #{i} ({which} snapshots): other values pulled")
                i += 1
            row.update(round_trips=i - 1, snapshots=_newest(state) - first)
    finally:
        for kv in stores.values():
            kv.close()
        for server in servers:
            common.stop(server)
    return rows


def _newest(state):
    """The sequence number of the newest snapshot in ``state`` (snapshot-NNNNNNNNNNNN.tkv)."""
    return max((int(name[9:21]) for name in os.listdir(state) if name.endswith(".tkv")), default=0)


def main(argv):
    args = common.parse_args(__doc__, argv)
    size = (128 << 20) if args.quick else (1 << 30)
    sizes = [4 << 20, (16 if args.quick else 64) << 20]
    samples = dict(zip(sizes, (40, 10) if args.quick else (200, 40)))
    with tempfile.TemporaryDirectory() as logdir:
        detected = detection_seconds(3 if args.quick else KILLS, logdir)
        write, restart, read = restart_seconds(size, logdir)
        rows = throughput_seconds(sizes, samples, 1 if args.quick else SNAPSHOTS, (64 << 20) if args.quick else BALLAST,
                                  logdir)
    ratios = {size: rows[size]["without"] / rows[size]["with"] for size in sizes}
    numbers = {"lease_timeout_s": LEASE, "detection_s": detected, "snapshot_bytes": size, "snapshot_write_s": write,
               "restart_s": restart, "file_read_s": read, "snapshot_interval_s": SNAPSHOT_INTERVAL,
               "throughput": {str(n): rows[n] for n in sizes}, "throughput_ratio": {str(n): ratios[n] for n in sizes},
               "throughput_goal": GOAL, "throughput_goal_met": all(ratio >= GOAL for ratio in ratios.values())}
    text = "\n".join([
        "| failure row | result | reference |",
        "|---|---:|---|",
        f"| a worker killed with -9: rank freed (median of {len(detected)}, max {max(detected):.2f}) "
        f"| {statistics.median(detected):.2f} s | --lease-timeout {LEASE:g} (goal <= lease + 1 s) |",
        f"| snapshot of {size >> 20} MiB written | {write:.2f} s | |",
        f"| server killed with -9, restarted on its state dir, answering with it restored | {restart:.2f} s "
        f"| the file read with plain Python: {read:.2f} s |",
        *(f"| {n >> 20} MiB push+pull while snapshots are written every {SNAPSHOT_INTERVAL:g} s "
          f"({rows[n]['snapshots']} in {rows[n]['round_trips']} round trips), over without | {ratios[n]:.2f} "
          f"| {common.gbps(n, rows[n]['with'] / rows[n]['round_trips']):.2f} GB/s with, "
          f"{common.gbps(n, rows[n]['without'] / rows[n]['round_trips']):.2f} without (goal >= {GOAL}) |"
          for n in sizes),
        ""])
    common.write_results(args, "failures", text, numbers)


if __name__ == "__main__":
    main(sys.argv[1:])
