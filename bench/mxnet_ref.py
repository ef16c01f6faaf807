"""MXNet 1.9.1's KVStore, the reference of `make bench`: dist_sync over ps-lite on 127.0.0.1.

bench/run.py, in tensorkv's venv, starts a :class:`Cluster` of the .venv-mxnet interpreter:
a ps-lite scheduler, one server and the workers, processes of their own with the DMLC_*
variables set, whose workers stay up and measure the round trips asked of them (over
stdin/stdout lines, bench/common.py), so that its rows take turns with MXNet's. A push+pull
round trip of N bytes counts 2*N bytes.

Run in the .venv-mxnet venv (`make bench-mxnet`), it measures MXNet's plain and 2-bit
pushes of 4 MiB on a cluster of one worker, what bench/compression.py prints under its rows:

    python bench/mxnet_ref.py [--json out.json] [--quick]

Every process started is waited for with a deadline and stopped by its PID (terminate,
then kill).
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import common

MiB = 1 << 20
CLUSTER_TIMEOUT = 300.0  # seconds for a cluster to start, or for one command
LIST_KEYS = 1000
LIST_FLOATS = 256  # 1 KiB per key
COMPRESSION_REPEATS = 30  # pushes timed, plain and 2-bit (bench/compression.py's count)


class Cluster:
    """An MXNet dist_sync cluster on 127.0.0.1 of ``workers`` workers, processes of
    ``python`` (the .venv-mxnet interpreter), whose workers measure on command. Logs go to
    ``logdir``."""

    def __init__(self, python, workers, big, logdir):
        self.python, self.workers, self.big, self.logdir = python, workers, big, logdir
        self._roles, self._workers = [], []

    def __enter__(self):
        env = _cluster_env(self.workers)
        try:
            # With DMLC_ROLE set to scheduler or server, `import mxnet` runs that role until the
            # workers finish.
            for role in ("scheduler", "server"):
                self._roles.append(self._spawn([self.python, "-c", "import mxnet"], env, role, None))
            for i in range(self.workers):
                self._workers.append(self._spawn(
                    [self.python, os.path.abspath(__file__), "--on-command", "--big", str(self.big)], env,
                    "worker", i))
            common.wait_ready(self._workers, CLUSTER_TIMEOUT)  # no start-up beside the first turns
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _spawn(self, cmd, env, role, index):
        log = os.path.join(self.logdir, f"mxnet-{self.workers}-{role}{'' if index is None else index}-"
                                        f"{time.monotonic_ns()}.log")
        env = dict(env, DMLC_ROLE=role)
        if role == "worker":
            return common.spawn_on_command(cmd, env, log)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        proc.log = log
        return proc

    def seconds(self, row, count):
        """Each worker's seconds of ``count`` timed round trips of ``row`` (a key of
        :func:`_round_trip_makers`); a row's first command initializes its key(s) and makes one
        untimed round trip."""
        return [answer["seconds"] for answer in self.ask({"row": row, "count": count})]

    def ask(self, command):
        return common.ask(self._workers, command, CLUSTER_TIMEOUT)

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


# ---- in a worker of a Cluster ----------------------------------------------------------------


def _on_command(big):
    """A worker of :class:`Cluster`: answers each command with the seconds of the round trips
    it asks for ({"row": ..., "count": n}), or with the plain and 2-bit push times
    ({"compression": repeats}, after which every push of the store is compressed)."""
    def start():
        import mxnet as mx
        kv = mx.kv.create("dist_sync")
        makers, rows = _round_trip_makers(mx, kv, big), {}

        def answer(command):
            if "compression" in command:
                return _push_times(mx, kv, command["compression"])
            row = command["row"]
            if row not in rows:
                rows[row] = makers[row]()
            return {"seconds": rows[row](command["count"])}

        return answer

    common.serve_commands(start)


def _round_trip_makers(mx, kv, big):
    """{row: a function that initializes its key(s) and gives a function of ``count``}."""
    return {"4MiB": lambda: _round_trips(mx, kv, 0, 4 * MiB),
            "4MiB_pushpull": lambda: _round_trips(mx, kv, 1, 4 * MiB, fused=True),
            "big": lambda: _round_trips(mx, kv, 2, big),
            "16f": lambda: _round_trips(mx, kv, 3, 64),
            "16f_pushpull": lambda: _round_trips(mx, kv, 4, 64, fused=True),
            "list": lambda: _list_round_trips(mx, kv),
            "local": lambda: _round_trips(mx, mx.kv.create("local"), 0, 4 * MiB)}


def _round_trips(mx, kv, key, nbytes, fused=False):
    """A function of ``count``: the seconds of each of ``count`` round trips of one float32
    key of ``nbytes``, initialized here, with one untimed round trip: kv.push then kv.pull,
    or one kv.pushpull when ``fused``."""
    value = mx.nd.ones(nbytes // 4)
    out = mx.nd.zeros(nbytes // 4)
    kv.init(key, value)

    def round_trip():
        if fused:
            kv.pushpull(key, value, out=out)
        else:
            kv.push(key, value)
            kv.pull(key, out=out)
        out.wait_to_read()

    round_trip()
    return lambda count: common.times(round_trip, count, warmup=0)


def _list_round_trips(mx, kv):
    """As :func:`_round_trips`, for one list push then pull of 1000 keys of 1 KiB."""
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


def _push_times(mx, kv, repeats):
    """Median seconds of a push of one 4 MiB float32 key (two gradients in turn), waited for
    (``mx.nd.waitall``: the server's answer); first plain, then with MXNet's 2-bit gradient
    compression (threshold 0.5) on a second key: what bench/compression.py measures on
    tensorkv. MXNet cannot turn compression off again, hence plain first, not alternately."""
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

    plain = median_push(100)
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    return {"push_4MiB_s": plain, "push_4MiB_2bit_s": median_push(101)}


# ---- `make bench-mxnet` ----------------------------------------------------------------------


def compression_reference(repeats):
    """MXNet's version and its plain and 2-bit push of 4 MiB (medians, in ms), on a cluster
    of one worker."""
    import mxnet
    with tempfile.TemporaryDirectory(prefix="mxnet-ref-") as logdir, \
            Cluster(sys.executable, 1, 4 * MiB, logdir) as cluster:
        times, = cluster.ask({"compression": repeats})
    return {"mxnet_version": mxnet.__version__, "python": sys.version.split()[0],
            "dist_sync_push_4MiB_ms": times["push_4MiB_s"] * 1e3,
            "dist_sync_push_4MiB_2bit_ms": times["push_4MiB_2bit_s"] * 1e3}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true", help="5 pushes of each kind, not 30")
    parser.add_argument("--on-command", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--big", type=int, default=64 * MiB, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.on_command:
        _on_command(args.big)
        return 0
    results = compression_reference(5 if args.quick else COMPRESSION_REPEATS)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
