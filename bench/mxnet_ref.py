"""MXNet 1.9.1 KVStore reference: dist_sync over ps-lite on 127.0.0.1, and 'local'.

Runs in the .venv-mxnet venv (`make bench-mxnet`):

    python bench/mxnet_ref.py [--json out.json] [--quick]

The launcher starts a ps-lite scheduler, one server and the workers as
separate processes of this interpreter with the DMLC_* variables set, waits
for each with a deadline, and stops any still running by its PID (terminate,
then kill).  A push+pull round trip of N bytes counts 2*N bytes.

bench/run.py, in tensorkv's venv, uses :class:`OnCommand` instead: a cluster
of the .venv-mxnet interpreter whose workers stay up and measure the round
trips it asks for, so that its rows take turns with MXNet's.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import common
from progress import Progress

MiB = 1 << 20
REPEATS = 7
SMALL_REPEATS = 500
CLUSTER_TIMEOUT = 300.0  # seconds for one scheduler+server+workers run
LIST_KEYS = 1000
LIST_FLOATS = 256  # 1 KiB per key
COMPRESSION_REPEATS = 30  # pushes timed, plain and 2-bit (bench/compression.py's count)


def run_all(repeats=REPEATS, small_repeats=SMALL_REPEATS, big=64 * MiB):
    """Runs every MXNet measurement with a progress bar; returns a flat dict
    of medians whose keys carry their units."""
    results = {"mxnet_version": _mxnet_version(),
               "python": sys.version.split()[0]}
    with Progress(4, "mxnet") as bar:
        bar.show("dist_sync, 1 worker ...")
        single, = run_cluster("single", 1, repeats, small_repeats, big)
        results.update({
            "dist_sync_4MiB_gbps": common.gbps(4 * MiB, single["rtt_4MiB_s"]),
            f"dist_sync_{big // MiB}MiB_gbps": common.gbps(big, single["rtt_big_s"]),
            "dist_sync_16f_rtt_us": single["rtt_16f_s"][0] * 1e6,
            "dist_sync_16f_p99_us": single["rtt_16f_s"][1] * 1e6,
            "dist_sync_1000x1KiB_ms": single["rtt_list_s"] * 1e3,
        })
        bar.step("dist_sync, 1 worker")
        bar.show("dist_sync, 2 workers ...")
        pair = run_cluster("pair", 2, repeats, small_repeats, big)
        slowest = max(w["rtt_4MiB_s"] for w in pair)
        results["dist_sync_2workers_4MiB_gbps"] = 2 * common.gbps(4 * MiB, slowest)
        bar.step("dist_sync, 2 workers")
        bar.show("dist_sync, 2-bit compression ...")
        compressed, = run_cluster("compression", 1, COMPRESSION_REPEATS, small_repeats, big)
        results["dist_sync_push_4MiB_ms"] = compressed["push_4MiB_s"] * 1e3
        results["dist_sync_push_4MiB_2bit_ms"] = compressed["push_4MiB_2bit_s"] * 1e3
        bar.step("dist_sync, 2-bit compression")
        bar.show("local ...")
        results["local_4MiB_gbps"] = common.gbps(4 * MiB, _local_rtt(repeats))
        bar.step("local")
    return results


def run_cluster(test, workers, repeats, small_repeats, big):
    """Starts scheduler, server and `workers` workers on 127.0.0.1; returns
    the list of what each worker measured for `test`."""
    env = _cluster_env(workers)
    with tempfile.TemporaryDirectory(prefix="mxnet-ref-") as tmp:
        procs = []
        try:
            procs += _start_roles(sys.executable, env, tmp)
            outs = [os.path.join(tmp, f"worker{i}.json")
                    for i in range(workers)]
            worker_procs = [_spawn(
                [sys.executable, __file__, "--worker", test, "--out", out,
                 "--repeats", str(repeats), "--small-repeats",
                 str(small_repeats), "--big", str(big)], env, "worker", tmp)
                for out in outs]
            procs += worker_procs
            deadline = time.monotonic() + CLUSTER_TIMEOUT
            for proc in worker_procs + procs[:2]:
                _wait(proc, deadline)
            return [_read_json(out) for out in outs]
        finally:
            for proc in procs:
                common.stop(proc)


class OnCommand:
    """An MXNet dist_sync cluster on 127.0.0.1 (a scheduler, a server and ``workers``
    workers, processes of ``python``: the .venv-mxnet interpreter) whose workers measure
    on command, for bench/run.py, which runs in tensorkv's venv, to take turns with
    tensorkv's round trips. Logs go to ``logdir``."""

    def __init__(self, python, workers, big, logdir):
        self.python, self.workers, self.big, self.logdir = python, workers, big, logdir
        self._roles, self._workers = [], []

    def __enter__(self):
        env = _cluster_env(self.workers)
        try:
            self._roles = _start_roles(self.python, env, self.logdir)
            self._workers = [common.spawn_on_command(
                [self.python, os.path.abspath(__file__), "--on-command", "--big", str(self.big)],
                dict(env, DMLC_ROLE="worker"),
                os.path.join(self.logdir, f"mxnet-{self.workers}-worker{i}-{time.monotonic_ns()}.log"))
                for i in range(self.workers)]
            common.wait_ready(self._workers, CLUSTER_TIMEOUT)  # no start-up beside the first turns
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def seconds(self, row, count):
        """Each worker's seconds of ``count`` timed round trips of ``row``: 'single' (4 MiB),
        'big', '16f', 'list' or 'local' (4 MiB on MXNet's 'local' store in the worker);
        the first command of a row initializes its key(s) and makes one untimed round trip."""
        answers = common.ask(self._workers, {"row": row, "count": count}, CLUSTER_TIMEOUT)
        return [answer["seconds"] for answer in answers]

    def __exit__(self, *exc):
        common.stop_on_command(self._workers)  # a worker that ends lets the scheduler and server end
        for proc in self._roles:
            common.stop(proc)


def _cluster_env(workers):
    return dict(os.environ,
                DMLC_PS_ROOT_URI="127.0.0.1",
                DMLC_PS_ROOT_PORT=str(common.free_port()),
                DMLC_NODE_HOST="127.0.0.1",
                DMLC_INTERFACE="lo",
                DMLC_NUM_SERVER="1",
                DMLC_NUM_WORKER=str(workers))


def _start_roles(python, env, logdir):
    """The scheduler and the server: with DMLC_ROLE set to either, `import mxnet` runs that
    role until the workers finish."""
    return [_spawn([python, "-c", "import mxnet"], env, role, logdir)
            for role in ("scheduler", "server")]


def _spawn(cmd, env, role, logdir):
    log = open(os.path.join(logdir, f"{role}-{time.monotonic_ns()}.log"), "w")
    with log:
        proc = subprocess.Popen(cmd, env=dict(env, DMLC_ROLE=role),
                                stdout=log, stderr=subprocess.STDOUT)
    proc.role, proc.log = role, log.name
    return proc


def _wait(proc, deadline):
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"MXNet {proc.role} (pid {proc.pid}) did not finish "
                           f"within {CLUSTER_TIMEOUT:.0f}s\n{common.tail(proc.log)}")
    if proc.returncode != 0:
        raise RuntimeError(f"MXNet {proc.role} (pid {proc.pid}) exited with "
                           f"{proc.returncode}\n{common.tail(proc.log)}")




def _read_json(path):
    with open(path) as f:
        return json.load(f)





def _mxnet_version():
    import mxnet as mx
    return mx.__version__


def _kv_rtt(kv, key, nbytes, repeats, p99=False):
    """Median seconds for kv.push then kv.pull of one float32 key (and the 99th percentile
    with ``p99``)."""
    seconds = _round_trips(kv, key, nbytes)(repeats)
    return (statistics.median(seconds), common.p99(seconds)) if p99 else statistics.median(seconds)


def _round_trips(kv, key, nbytes):
    """A function of ``count``: the seconds of each of ``count`` push+pull round trips of one
    float32 key of ``nbytes``, initialized here, with one untimed round trip."""
    import mxnet as mx
    value = mx.nd.ones(nbytes // 4)
    out = mx.nd.zeros(nbytes // 4)
    kv.init(key, value)

    def round_trip():
        kv.push(key, value)
        kv.pull(key, out=out)
        out.wait_to_read()

    round_trip()
    return lambda count: common.times(round_trip, count, warmup=0)


def _list_rtt(kv, repeats):
    """Median seconds for one list push then pull of 1000 keys of 1 KiB."""
    return statistics.median(_list_round_trips(kv)(repeats))


def _list_round_trips(kv):
    """As :func:`_round_trips`, for one list push then pull of 1000 keys of 1 KiB."""
    import mxnet as mx
    keys = list(range(1000, 1000 + LIST_KEYS))
    values = [mx.nd.ones(LIST_FLOATS) for _ in keys]
    outs = [mx.nd.zeros(LIST_FLOATS) for _ in keys]
    kv.init(keys, values)

    def round_trip():
        kv.push(keys, values)
        kv.pull(keys, out=outs)
        mx.nd.waitall()

    round_trip()
    return lambda count: common.times(round_trip, count, warmup=0)


def _push_times(kv, repeats):
    """Median seconds of a push of one 4 MiB float32 key (two gradients in turn), waited for
    (``mx.nd.waitall``: the server's answer); first plain, then with MXNet's 2-bit gradient
    compression (threshold 0.5) on a second key: what bench/compression.py measures on
    tensorkv. MXNet cannot turn compression off again, hence plain first, not alternately."""
    import mxnet as mx
    import numpy as np
    rng = np.random.default_rng(0)
    gradients = [mx.nd.array(rng.standard_normal(MiB, dtype=np.float32)) for _ in range(2)]

    def median_push(key):
        kv.init(key, mx.nd.zeros(MiB))
        turns = itertools.cycle(gradients)

        def push():
            kv.push(key, next(turns))
            mx.nd.waitall()

        return common.median_time(push, repeats)

    plain = median_push(0)
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    return {"push_4MiB_s": plain, "push_4MiB_2bit_s": median_push(1)}


def _local_rtt(repeats):
    """Median seconds for a 4 MiB push+pull on MXNet's in-process store."""
    import mxnet as mx
    return _kv_rtt(mx.kv.create("local"), 0, 4 * MiB, repeats)


def _on_command(big):
    """A worker of :class:`OnCommand`: the seconds of the round trips each command asks for."""
    def start():
        import mxnet as mx
        kv = mx.kv.create("dist_sync")
        makers = {"single": lambda: _round_trips(kv, 0, 4 * MiB),
                  "big": lambda: _round_trips(kv, 1, big),
                  "16f": lambda: _round_trips(kv, 2, 64),
                  "list": lambda: _list_round_trips(kv),
                  "local": lambda: _round_trips(mx.kv.create("local"), 0, 4 * MiB)}
        rows = {}

        def answer(command):
            row = command["row"]
            if row not in rows:
                rows[row] = makers[row]()
            return {"seconds": rows[row](command["count"])}

        return answer

    common.serve_commands(start)


def _worker(test, repeats, small_repeats, big):
    """Runs in a worker process: measures `test` on a dist_sync store."""
    import mxnet as mx
    kv = mx.kv.create("dist_sync")
    if test == "pair":
        return {"rtt_4MiB_s": _kv_rtt(kv, 0, 4 * MiB, repeats)}
    if test == "compression":
        return _push_times(kv, repeats)
    return {"rtt_4MiB_s": _kv_rtt(kv, 0, 4 * MiB, repeats),
            "rtt_big_s": _kv_rtt(kv, 1, big, repeats),
            "rtt_16f_s": _kv_rtt(kv, 2, 64, small_repeats, p99=True),
            "rtt_list_s": _list_rtt(kv, repeats)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true",
                        help="16 MiB instead of 64 MiB, fewer repeats")
    parser.add_argument("--worker", choices=("single", "pair", "compression"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--on-command", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=argparse.SUPPRESS)
    parser.add_argument("--small-repeats", type=int, default=SMALL_REPEATS,
                        help=argparse.SUPPRESS)
    parser.add_argument("--big", type=int, default=64 * MiB,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.on_command:
        _on_command(args.big)
        return 0
    if args.worker:
        result = _worker(args.worker, args.repeats, args.small_repeats,
                         args.big)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    if args.quick:
        results = run_all(repeats=3, small_repeats=100, big=16 * MiB)
    else:
        results = run_all()
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
