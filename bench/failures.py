"""The failure rows of `make bench` (issue 11): how long the server takes to free the rank of
a worker killed with -9, next to its --lease-timeout; and how long a server takes to write a
snapshot of SIZE bytes of values (1 GiB; 128 MiB with --quick), then, killed with -9, to
start again on its state dir and answer with every value restored (checked exactly after the
clock stops), next to reading the snapshot file with plain Python in the same run (it is in
the page cache by then: a reference for the decoding, not for a disk). And push+pull
throughput of a 4 MiB and a 64 MiB key (16 MiB with --quick) on the TCP-only path against a
server that writes a snapshot every SNAPSHOT_INTERVAL s while it holds BALLAST bytes of other
values (so that each snapshot takes real time), next to a server without --state-dir, samples
interleaved; throughput is bytes over the samples' total seconds (not a median: the samples a
snapshot slows count), every pulled value checked after the clock stops (goal: >= 80% of the
throughput without snapshots). Writes <out-dir>/failures.{json,md}.
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
BALLAST = 512 << 20  # bytes of other values the throughput rows' servers hold (128 MiB with --quick)
THROUGHPUT_GOAL = 0.8  # throughput while snapshots are written / without
WAIT = 60.0  # seconds any wait of this script may take
# A worker that registers as rank 1 and waits to be killed.
IDLE_WORKER = "import time, tensorkv; kv = tensorkv.create('dist_sync', rank=1); print('ready', flush=True); time.sleep(600)"


# A channel that failed to connect waits out gRPC's backoff (1 s, then 1.6 times more each
# time) before it tries again: a short one, so that a server that starts is seen at once.
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


def throughput(sizes, duration, ballast, logdir):
    """({size: {"with"/"without": (samples, seconds)}}, snapshots written): push+pull samples of
    a key of each size against a server writing snapshots and one without, alternating, until
    each has run ``duration`` seconds of them."""
    state = tempfile.mkdtemp(dir=logdir)
    args = {"with": ("--state-dir", state, "--snapshot-interval", str(SNAPSHOT_INTERVAL)), "without": ()}
    servers, stores, results = {}, {}, {}
    try:
        for which, extra in args.items():
            port = common.free_port()
            servers[which] = start_server(port, logdir, "--num-workers", "1", *extra)
            stores[which] = kv = tensorkv.create("dist_sync", servers=f"127.0.0.1:{port}", transport="tcp")
            ballast_keys = [f"ballast{i}" for i in range(ballast // KEY_BYTES)]
            kv.init(ballast_keys, [np.ones(KEY_BYTES // 4, np.float32)] * len(ballast_keys))
            kv.init([f"{size}B" for size in sizes], [np.zeros(size // 4, np.float32) for size in sizes])
        first = _snapshots(state)
        for size in sizes:
            results[size] = _alternate(stores, f"{size}B", size, duration)
        written = _snapshots(state) - first
    finally:
        for kv in stores.values():
            kv.close()
        for proc in servers.values():
            common.stop(proc)
    return results, written


def _alternate(stores, key, size, duration):
    """{store name: (samples, seconds)} of push+pull of ``key`` on each store in turn."""
    values = [np.arange(size // 4, dtype=np.float32) + i for i in range(2)]
    out = np.empty(size // 4, np.float32)
    totals = {which: [0, 0.0] for which in stores}
    i = 0
    while min(seconds for _, seconds in totals.values()) < duration:
        for which in sorted(stores, reverse=i % 2 == 1):
            start = time.perf_counter()
            stores[which].push(key, values[i % 2])
            stores[which].pull(key, out=out)
            if i:  # the first sample of each store warms up
                totals[which][0] += 1
                totals[which][1] += time.perf_counter() - start
            if not np.array_equal(out, values[i % 2]):
                raise RuntimeError(f"push+pull #{i} of {key} ({which} snapshots) pulled a wrong value")
        i += 1
    return {which: tuple(total) for which, total in totals.items()}


def _snapshots(state):
    """The sequence number of the newest snapshot in ``state`` (snapshot-NNNNNNNNNNNN.tkv)."""
    return max((int(name[9:21]) for name in os.listdir(state) if name.endswith(".tkv")), default=0)


def main(argv):
    args = common.parse_args(__doc__, argv)
    size = (128 << 20) if args.quick else (1 << 30)
    with tempfile.TemporaryDirectory() as logdir:
        detected = detection_seconds(3 if args.quick else KILLS, logdir)
        write, restart, read = restart_seconds(size, logdir)
        sizes = (4 << 20, 16 << 20) if args.quick else (4 << 20, 64 << 20)
        ballast = (128 << 20) if args.quick else BALLAST
        samples, written = throughput(sizes, 3 * SNAPSHOT_INTERVAL if args.quick else 8 * SNAPSHOT_INTERVAL,
                                      ballast, logdir)
    rates = {size: {which: count * 2 * size / s / 1e9 for which, (count, s) in by.items()}
             for size, by in samples.items()}
    numbers = {"lease_timeout_s": LEASE, "detection_s": detected, "snapshot_bytes": size, "snapshot_write_s": write,
               "restart_s": restart, "file_read_s": read, "snapshot_interval_s": SNAPSHOT_INTERVAL,
               "ballast_bytes": ballast, "samples": samples, "push_pull_gbps": rates, "snapshots_written": written}
    text = "\n".join([
        "| failure row | seconds | reference |",
        "|---|---:|---|",
        f"| a worker killed with -9: rank freed (median of {len(detected)}, max {max(detected):.2f}) "
        f"| {statistics.median(detected):.2f} | --lease-timeout {LEASE:g} (goal <= lease + 1 s) |",
        f"| snapshot of {size >> 20} MiB written | {write:.2f} | |",
        f"| server killed with -9, restarted on its state dir, answering with it restored | {restart:.2f} "
        f"| the file read with plain Python: {read:.2f} s |",
        "",
        f"| push+pull, TCP-only, while a snapshot of {(ballast >> 20) + sum(sizes) // (1 << 20)} MiB is written "
        f"every {SNAPSHOT_INTERVAL:g} s | GB/s | without snapshots | ratio (goal >= {THROUGHPUT_GOAL}) |",
        "|---|---:|---:|---:|",
        *(f"| {size >> 20} MiB ({samples[size]['with'][0]} / {samples[size]['without'][0]} samples) "
          f"| {rate['with']:.2f} | {rate['without']:.2f} "
          f"| {rate['with'] / rate['without']:.2f} |" for size, rate in rates.items()),
        "",
        f"{written} snapshots were written during the throughput rows.",
        ""])
    common.write_results(args, "failures", text, numbers)


if __name__ == "__main__":
    main(sys.argv[1:])
