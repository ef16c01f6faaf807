"""`make bench`: tensorkv next to its references, measured in one run on 127.0.0.1.

    python bench/run.py [--quick] [--out-dir bench-results] [--mxnet-python PYTHON]

tensorkv is measured through its public API only (tensorkv.create, init, push,
pull, pushpull).  Rows, all medians, for one float32 key unless said:

  * push+pull round trip at 4 MiB and 64 MiB, GB/s = 2*N / round trip (the
    payload counted both ways, as bench/references.py counts it), on
    'dist_sync' with one worker: a real server process
    (`python -m tensorkv_server`) and this process as the worker;
  * a 16-float key: push+pull round trip in µs (and fused pushpull);
  * 1000 keys x 1 KiB: one list push then one list pull, in ms;
  * two worker processes on one 4 MiB key in dist_sync, measuring on command:
    aggregate GB/s (2 x 2*N / the slower worker's median round trip, as
    bench/mxnet_ref.py);
  * the embedded 'local' store at 4 MiB, GB/s.

Every dist row is run once per transport path in PATHS (the same-host default,
a TCP-only path, a gRPC-only path, and the TCP-only and gRPC-only paths over
TLS: the gRPC port and the data channel both TLS, with a certificate made for
the run), each on a fresh server; each TLS row is printed next to its
plaintext row with the ratio TLS / plaintext.  The references are measured in
this run: a raw loopback TCP echo and a plain gRPC-Python echo (unary, and
1 MiB-chunked streaming) from bench/references.py, and a NumPy copy; the
4 MiB and large rows' TCP echo takes turns with the row (as MXNet does), and the
two-worker row's reference is a raw TCP sum of two clients' 4 MiB
(references.tcp_sum), taking turns with the row.  A missed goal on a GB/s row says so when it asks
more than that raw reference moved.  MXNet
1.9.1 is measured in this run too, given --mxnet-python (the interpreter of the
venv `make bench-mxnet` makes; `make bench` passes it): a ps-lite cluster of one
worker and one of two stay up for the run (bench/mxnet_ref.py, workers that
measure on command), and each row MXNet has takes TURNS turns with MXNet's same
round trips, tensorkv first, then MXNet twice, then tensorkv, ... (an idle
process of one side waits while the other measures): both meet the same moments
of a shared machine, whose speed drifts by tens of percent over minutes.  Each
row's MXNet column is the median of its own turns.  Ratios are "how many times
better tensorkv is": tensorkv/reference for throughput, reference/tensorkv for
times, so > 1 always favours tensorkv.

Each timed round trip pushes one of two distinct patterns, alternately, and
checks every element pulled back after the clock stops: a stale, partial,
reordered or wrong value fails the bench (exit status 2).  Any other failure
(a server that does not start, a worker that does not finish in time) exits 1.
Results go to <out-dir>/bench.json (all numbers), <out-dir>/bench.md (the
table as Markdown) and the throughput plot to <out-dir>/throughput.png
(bench-quick.* / throughput-quick.png with
--quick, a fast smoke run with 16 MiB in place of 64 MiB and fewer repeats).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import common
import references
from plot import plot_throughput, size_label
from progress import Progress

MiB = 1 << 20
KiB = 1 << 10
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Transport paths of the dist rows: a name -> the options given to
# tensorkv.create() and the environment set for the server and the workers.
# The same-host default path takes whatever the client negotiates; the TCP-only
# path asks for no shared memory (transport='tcp': the server's raw-TCP data
# channel, what a client on another host gets).  The transport option is only passed when
# this client's create() accepts it (see _path_options); until then both paths
# run the same (TCP) code, and the bench says so.
PATHS = {
    "same-host": {"options": {}, "env": {}},
    "tcp-only": {"options": {"transport": "tcp"}, "env": {}},
    "tls-tcp": {"options": {"transport": "tcp"}, "env": {}, "tls": True},
    "grpc-only": {"options": {"transport": "grpc"}, "env": {}},
    "tls-grpc": {"options": {"transport": "grpc"}, "env": {}, "tls": True},
}
# Each TLS path -> the plaintext path it is compared with.
TLS_PAIRS = {"tls-tcp": "tcp-only", "tls-grpc": "grpc-only"}

FULL = dict(sizes=(64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB),
            big=64 * MiB, repeats=15, big_repeats=7, small_repeats=2000,
            list_repeats=15, pair_repeats=30, ref_repeats=7,
            ref_small_repeats=2000)
QUICK = dict(sizes=(64 * KiB, MiB, 4 * MiB, 16 * MiB),
             big=16 * MiB, repeats=3, big_repeats=3, small_repeats=200,
             list_repeats=3, pair_repeats=3, ref_repeats=3,
             ref_small_repeats=200)

SMALL_FLOATS = 16
LIST_KEYS = 1000
LIST_FLOATS = 256  # 1 KiB per key
SERVER_START_TIMEOUT = 30.0  # seconds for the server to accept connections
WORKERS_TIMEOUT = 300.0  # seconds for the two-worker run
STEP_TIMEOUT = 600.0  # seconds for any one in-process step (SIGALRM)
TURNS = 3  # turns of each row and of MXNet's (bench/mxnet_ref.py), when MXNet is measured

# The issues' goals (4, and 15 for both transports): (text, row, path, reference,
# how many times better than the reference).
GOALS = [
    *((f"{text} ({path})", row, path, ref, need)
      for path in ("same-host", "tcp-only")
      for text, row, ref, need in [
          ("4 MiB push+pull >= 1.5x MXNet", "4MiB", "MXNet", 1.5),
          ("{big} push+pull >= 0.8x a raw TCP round trip", "big", "TCP echo", 0.8),
          ("16-float push+pull >= 1.3x MXNet, median", "16f", "MXNet", 1.3),
          ("16-float push+pull >= 1.3x MXNet, p99", "16f_p99", "MXNet", 1.3),
          ("1000 x 1 KiB list push+pull >= 6x MXNet", "list", "MXNet", 6.0),
          ("2 workers, 4 MiB, aggregate >= 1.5x MXNet", "pair", "MXNet", 1.5)]),
    ("{big} push+pull >= 1.5x MXNet (same-host)", "big", "same-host", "MXNet", 1.5),
    ("'local' 4 MiB >= 1.0x MXNet 'local'", "local", None, "MXNet", 1.0),
]
# Issue 12: TLS rows against the same rows in plaintext on the same path, same run.
TLS_GOALS = [
    ("4 MiB push+pull over TLS >= 0.7x plaintext (TCP-only)", "4MiB", "tls-tcp", 0.7),
    ("{big} push+pull over TLS >= 0.7x plaintext (TCP-only)", "big", "tls-tcp", 0.7),
    ("4 MiB push+pull over TLS >= 0.7x plaintext (gRPC-only)", "4MiB", "tls-grpc", 0.7),
    ("{big} push+pull over TLS >= 0.7x plaintext (gRPC-only)", "big", "tls-grpc", 0.7),
]


class CheckError(Exception):
    """A value pulled back was not the one expected."""


# ---- value patterns and checks -------------------------------------------------------


def _patterns(n_floats, scale=1.0):
    """Two distinct float32 patterns of n_floats (exact in float32, also when
    summed over two workers), and what a pull must return for each."""
    base = (np.arange(n_floats, dtype=np.int64) % 65521).astype(np.float32)
    a, b = base + 1.0, base + 0.5
    return [a, b], [a * scale, b * scale]


def _check(what, got, expected):
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise CheckError(f"{what}: pulled {got.dtype}{list(got.shape)}, "
                         f"expected {expected.dtype}{list(expected.shape)}")
    if not np.array_equal(got, expected):
        bad = np.flatnonzero(got != expected)
        raise CheckError(
            f"{what}: {bad.size} of {got.size} values wrong, first at "
            f"[{bad[0]}]: {got[bad[0]]!r} where {expected[bad[0]]!r} expected")


class RoundTrips:
    """Timed round trips of one kind, a number at a time (:meth:`seconds`), so that a row can
    take turns with MXNet's: ``prepare(i)`` runs before and ``check(i)`` after round trip
    ``i`` (counted on across calls), off the clock; the first call makes ``warmup``
    untimed round trips first. ``batched``: all of a call's round trips are prepared first
    and checked after the last, so that nothing runs between two of them (each call then
    makes at least one untimed round trip first)."""

    def __init__(self, prepare, op, check, warmup=2, batched=False):
        self._prepare, self._op, self._check = prepare, op, check
        self._warmup, self._done, self._batched = warmup, 0, batched

    def seconds(self, count):
        # Batched, each call starts with an untimed round trip too: a worker's clock then
        # starts with both workers past their prepares.
        first, self._warmup = max(self._warmup, int(self._batched)), 0
        trips = range(self._done, self._done + first + count)
        self._done += first + count
        times = []
        for batch in ([trips] if self._batched else [[i] for i in trips]):
            for i in batch:
                self._prepare(i)
            for i in batch:
                start = time.perf_counter()
                self._op(i)
                times.append(time.perf_counter() - start)
            for i in batch:
                self._check(i)
        return times[first:]


def take_turns(sides, repeats, turns=TURNS):
    """Each of ``sides``' seconds of ``repeats`` round trips (None for a side that is None):
    ``side(count)`` gives one list of seconds per worker. With more than one side, the round
    trips go in ``turns`` turns each, in the order A, B, B, A, A, B (with three sides A, B, C,
    C, B, A, ...): all sides meet the same moments of a noisy machine."""
    present = [index for index, side in enumerate(sides) if side is not None]
    counts = [repeats // turns + (i < repeats % turns) for i in range(turns)] if len(present) > 1 else [repeats]
    seconds = [None] * len(sides)
    for turn, count in enumerate(counts):
        for index in (present if turn % 2 == 0 else present[::-1]):
            got = sides[index](count)
            seconds[index] = got if seconds[index] is None else [a + b for a, b in zip(seconds[index], got)]
    return seconds


# ---- one-key and list round trips on a store -----------------------------------------


def key_round_trips(kv, key, n_floats, fused=False, scale=1.0, warmup=2, batched=False):
    """RoundTrips of push+pull (or pushpull) of one float32 key, initialized here; ``batched``
    (the two-worker row): each round trip of a call pulls into its own buffer, all checked
    after the last, so that one worker's checks do not stretch the other's clock (a round
    waits for both pushes), and its workers run round trip after round trip as MXNet's do."""
    values, expected = _patterns(n_floats, scale)
    out = None if batched else np.zeros(n_floats, np.float32)
    outs = {}  # batched: round trip -> its buffer (a fresh one, not in the cache as a reused one may be), until checked
    kv.init(key, values[0])

    def prepare(i):
        if batched:
            outs[i] = np.full(n_floats, -1.0, np.float32)
        else:
            out.fill(-1.0)  # so a partial pull cannot pass for a full one

    def op(i):
        target = outs[i] if batched else out
        if fused:
            kv.pushpull(key, values[i % 2], out=target)
        else:
            kv.push(key, values[i % 2])
            kv.pull(key, out=target)

    def check(i):
        verb = "pushpull" if fused else "push+pull"
        _check(f"key {key!r} ({n_floats * 4} bytes) {verb} #{i}", outs.pop(i) if batched else out,
               expected[i % 2])

    return RoundTrips(prepare, op, check, warmup, batched)


def list_round_trips(kv, first_key=100000, warmup=2):
    """RoundTrips of one list push then one list pull of 1000 x 1 KiB, initialized here."""
    keys = list(range(first_key, first_key + LIST_KEYS))
    base = np.arange(LIST_FLOATS, dtype=np.float32)
    values = [[base + 256.0 * j + 1.0 for j in range(LIST_KEYS)],
              [base + 256.0 * j + 0.5 for j in range(LIST_KEYS)]]
    outs = [np.zeros(LIST_FLOATS, np.float32) for _ in keys]
    kv.init(keys, values[0])

    def prepare(i):
        for out in outs:
            out.fill(-1.0)

    def op(i):
        kv.push(keys, values[i % 2])
        kv.pull(keys, out=outs)

    def check(i):
        for key, out, want in zip(keys, outs, values[i % 2]):
            _check(f"list push+pull #{i}, key {key}", out, want)

    return RoundTrips(prepare, op, check, warmup)


# ---- server and worker processes -----------------------------------------------------





def _spawn(cmd, env, log_path):
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)


@contextlib.contextmanager
def server(num_workers, env, logdir, args=(), host="127.0.0.1"):
    """Runs `python -m tensorkv_server` in sync mode on a free port of `host`
    (a loopback address; with `args` added); yields "HOST:PORT" once it
    accepts connections."""
    port = common.free_port()
    log = os.path.join(logdir, f"server-{port}.log")
    proc = _spawn([sys.executable, "-m", "tensorkv_server", "--host",
                   host, "--port", str(port), "--num-workers",
                   str(num_workers), "--mode", "sync", *args], env, log)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tensorkv server (pid {proc.pid}) exited "
                                   f"with {proc.returncode}\n{common.tail(log)}")
            with contextlib.suppress(OSError):
                socket.create_connection((host, port), 1.0).close()
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensorkv server (pid {proc.pid}) did not accept "
                    f"connections on port {port} within "
                    f"{SERVER_START_TIMEOUT:.0f}s\n{common.tail(log)}")
            time.sleep(0.05)
        yield f"{host}:{port}"
    finally:
        common.stop(proc)


def _env(extra):
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _path_setup(path, logdir):
    """(the environment, the server's extra arguments) of `path`: a TLS path
    gets a CA and a server certificate made for this run (trustme), the CA in
    TENSORKV_TLS_CA for the workers."""
    env = dict(PATHS[path]["env"])
    if not PATHS[path].get("tls"):
        return env, []
    import trustme
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    files = {name: os.path.join(logdir, f"{path}-{name}.pem")
             for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(files["ca"])
    leaf.cert_chain_pems[0].write_to_path(files["cert"])
    leaf.private_key_pem.write_to_path(files["key"])
    env["TENSORKV_TLS_CA"] = files["ca"]
    return env, ["--tls-cert", files["cert"], "--tls-key", files["key"]]


@contextlib.contextmanager
def pair_workers(path, options, logdir):
    """Two worker processes on a fresh server in dist_sync, each measuring push+pull of one
    4 MiB key (summed over both) on command: yields a function of ``count``, each worker's
    seconds of ``count`` round trips (:func:`worker_main`)."""
    extra, args = _path_setup(path, logdir)
    env = _env(extra)
    with server(2, env, logdir, args) as address:
        procs = []
        try:
            for rank in range(2):
                procs.append(common.spawn_on_command(
                    [sys.executable, os.path.join(HERE, "run.py"), "--worker",
                     "--servers", address, "--options", json.dumps(options)], env,
                    os.path.join(logdir, f"pair-{path}-{rank}.log")))
            common.wait_ready(procs, WORKERS_TIMEOUT)

            def seconds(count):
                answers = common.ask(procs, {"count": count}, WORKERS_TIMEOUT)
                for proc, answer in zip(procs, answers):
                    if "check_failed" in answer:
                        raise CheckError(f"worker (pid {proc.pid}): {answer['check_failed']}")
                return [answer["seconds"] for answer in answers]

            yield seconds
        finally:
            common.stop_on_command(procs)


def worker_main(args):
    """A worker process of the two-worker row: dist_sync, one 4 MiB key,
    pushes summed over both workers, measured on command."""
    import tensorkv
    options = json.loads(args.options)
    with contextlib.ExitStack() as stack:
        def start():
            kv = stack.enter_context(tensorkv.create("dist_sync", servers=args.servers, **options))
            if kv.num_workers != 2:
                raise RuntimeError(f"num_workers is {kv.num_workers}, not 2")
            round_trips = key_round_trips(kv, 0, 4 * MiB // 4, scale=2.0, batched=True)

            def answer(command):
                try:
                    return {"seconds": round_trips.seconds(command["count"])}
                except CheckError as err:
                    return {"check_failed": str(err)}

            return answer

        common.serve_commands(start)
    return 0


# Keys are ints throughout (a store holds int or str keys, never both):
# 0 the 2-worker and 'local' key, 1 and 2 the 16-float keys, 3 the fused
# 4 MiB key, 10 + n.bit_length() the key of size n, 100000.. the list keys.


# ---- the dist paths ------------------------------------------------------------------


def _path_options(path):
    """The create() options of `path` that this client's DistStore takes,
    and a note for each one dropped.  Judged from its signature, so that no
    probe connection registers as an extra worker: a named parameter or
    **kwargs passes the option through (an unknown one then fails loudly)."""
    import inspect

    from tensorkv.stores.dist import DistStore
    params = inspect.signature(DistStore.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    options, notes = {}, []
    for name, value in PATHS[path]["options"].items():
        if name in params or takes_any:
            options[name] = value
        else:
            notes.append(f"create() takes no {name}= yet, so this path is "
                         "the client's default transport (TCP)")
    return options, notes


def dist_available():
    return (importlib.util.find_spec("tensorkv_server") is not None
            and importlib.util.find_spec("tensorkv.stores.dist") is not None)


# ---- the run -------------------------------------------------------------------------


class Run:
    """Collects the steps of one bench run and their results. With ``mxnet_python`` (the
    .venv-mxnet interpreter), every row compared with MXNet takes turns (:func:`take_turns`)
    with MXNet's same round trips on clusters of bench/mxnet_ref.py kept up for the run."""

    def __init__(self, cfg, logdir, mxnet_python=None):
        self.cfg = cfg
        self.logdir = logdir
        self.mxnet_python = mxnet_python
        self.results = {"refs": {}, "local": {}, "paths": {}, "mxnet_version": None}
        self.notes = []
        self.stack = contextlib.ExitStack()
        self._mxnet = {}  # workers (1 or 2) -> mxnet_ref.Cluster

    def steps(self):
        cfg, steps = self.cfg, []
        refs = self.results["refs"]
        sizes = cfg["sizes"]

        def ref(name, fn):
            steps.append((f"ref {name}", lambda: refs.__setitem__(name, fn())))

        ref("tcp_echo", lambda: references.tcp_echo(sizes, cfg["ref_repeats"]))
        ref("grpc_unary_echo",
            lambda: references.grpc_unary_echo(sizes, cfg["ref_repeats"]))
        ref("grpc_stream_echo",
            lambda: references.grpc_stream_echo(sizes, cfg["ref_repeats"]))
        ref("tcp_small_rtt",
            lambda: references.tcp_small_rtt(cfg["ref_small_repeats"]))
        ref("grpc_small_rtt",
            lambda: references.grpc_small_rtt(cfg["ref_small_repeats"]))
        ref("memcpy_4MiB",
            lambda: references.memcpy(4 * MiB, cfg["ref_repeats"]))
        ref("memcpy_64MiB",
            lambda: references.memcpy(64 * MiB, cfg["ref_repeats"]))
        if self.mxnet_python:
            steps.append(("MXNet: start clusters", self.start_mxnet))
        steps.append(("local 4 MiB", self.local))
        if not dist_available():
            self.notes.append("dist rows not measured: tensorkv_server or "
                              "tensorkv.stores.dist is not installed in this tree")
            return steps
        for path in PATHS:
            steps.append((f"{path}: start server",
                          lambda path=path: self.open_path(path)))
            for n in sizes:
                steps.append((f"{path}: {size_label(n)}",
                              lambda path=path, n=n: self.size(path, n)))
            steps.append((f"{path}: 16 floats",
                          lambda path=path: self.small(path)))
            steps.append((f"{path}: 1000 x 1 KiB",
                          lambda path=path: self.list(path)))
            steps.append((f"{path}: stop server",
                          lambda path=path: self.close_path(path)))
            steps.append((f"{path}: 2 workers",
                          lambda path=path: self.pair(path)))
        return steps

    def start_mxnet(self):
        import mxnet_ref
        self.results["mxnet_version"] = subprocess.run(
            [self.mxnet_python, "-c", "import mxnet; print(mxnet.__version__)"],
            capture_output=True, text=True, check=True, timeout=120).stdout.strip()
        for workers in (1, 2):
            self._mxnet[workers] = self.stack.enter_context(
                mxnet_ref.Cluster(self.mxnet_python, workers, self.cfg["big"], self.logdir))

    def _turns(self, round_trips, mxnet_row, repeats, workers=1, others=()):
        """[tensorkv's seconds, MXNet's seconds or None, then each of ``others``' seconds] of
        ``repeats`` round trips each, taking turns: ``round_trips`` is a RoundTrips, or for 2
        workers a function giving both workers' seconds, as each of ``others`` (references
        measured in the same turns) does; MXNet's are its ``mxnet_row`` (None: none) with as
        many workers."""
        ours = round_trips if workers == 2 else lambda count: [round_trips.seconds(count)]
        cluster = self._mxnet.get(workers)
        theirs = None if cluster is None or mxnet_row is None else lambda count: cluster.seconds(mxnet_row, count)
        return take_turns([ours, theirs, *others], repeats)

    def local(self):
        import tensorkv
        with tensorkv.create("local") as kv:
            ours, theirs = self._turns(key_round_trips(kv, 0, 4 * MiB // 4), "local", self.cfg["repeats"])
        self.results["local"] = {"4MiB_gbps": common.gbps(4 * MiB, statistics.median(ours[0])), "mxnet": {}}
        if theirs is not None:
            self.results["local"]["mxnet"]["4MiB_gbps"] = common.gbps(4 * MiB, statistics.median(theirs[0]))

    def open_path(self, path):
        import tensorkv
        path_stack = contextlib.ExitStack()
        self.stack.enter_context(path_stack)
        env, args = _path_setup(path, self.logdir)
        for name, value in env.items():  # the worker is this process
            path_stack.callback(
                lambda n=name, v=os.environ.get(name): (
                    os.environ.__setitem__(n, v) if v is not None
                    else os.environ.pop(n, None)))
            os.environ[name] = value
        options, notes = _path_options(path)
        address = path_stack.enter_context(
            server(1, _env(env), self.logdir, args))
        kv = path_stack.enter_context(
            tensorkv.create("dist_sync", servers=address, **options))
        self.results["paths"][path] = {
            "options": options, "env": env, "notes": notes,
            "throughput_gbps": {}, "tcp_echo_gbps": {}, "mxnet": {}}
        self._path_stack, self._kv = path_stack, kv

    def close_path(self, path):
        self._path_stack.close()
        self._kv = None

    def size(self, path, n):
        r = self.results["paths"][path]
        big = n >= self.cfg["big"]
        repeats = self.cfg["big_repeats"] if big else self.cfg["repeats"]
        mxnet_row = {4 * MiB: "4MiB", self.cfg["big"]: "big"}.get(n)  # its number: "<row>_gbps"
        # The rows that goals name (those MXNet has) take turns with a raw TCP echo too.
        with references.tcp_echo_turns(n) if mxnet_row else contextlib.nullcontext() as echo:
            ours, theirs, echoed = self._turns(key_round_trips(self._kv, 10 + n.bit_length(), n // 4), mxnet_row,
                                               repeats, others=[echo])
        r["throughput_gbps"][n] = common.gbps(n, statistics.median(ours[0]))
        if theirs is not None:
            r["mxnet"][f"{mxnet_row}_gbps"] = common.gbps(n, statistics.median(theirs[0]))
        if echoed is not None:
            r["tcp_echo_gbps"][n] = common.gbps(n, statistics.median(echoed[0]))
        if n == 4 * MiB:
            ours, theirs = self._turns(key_round_trips(self._kv, 3, n // 4, fused=True), "4MiB_pushpull", repeats)
            r["4MiB_pushpull_gbps"] = common.gbps(n, statistics.median(ours[0]))
            if theirs is not None:
                r["mxnet"]["4MiB_pushpull_gbps"] = common.gbps(n, statistics.median(theirs[0]))

    def small(self, path):
        r = self.results["paths"][path]
        reps = self.cfg["small_repeats"]
        ours, theirs = self._turns(key_round_trips(self._kv, 1, SMALL_FLOATS), "16f", reps)
        r["16f_rtt_us"] = statistics.median(ours[0]) * 1e6
        r["16f_p99_us"] = common.p99(ours[0]) * 1e6
        if theirs is not None:
            r["mxnet"].update({"16f_rtt_us": statistics.median(theirs[0]) * 1e6,
                               "16f_p99_us": common.p99(theirs[0]) * 1e6})
        ours, theirs = self._turns(key_round_trips(self._kv, 2, SMALL_FLOATS, fused=True), "16f_pushpull", reps)
        r["16f_pushpull_us"] = statistics.median(ours[0]) * 1e6
        if theirs is not None:
            r["mxnet"]["16f_pushpull_us"] = statistics.median(theirs[0]) * 1e6

    def list(self, path):
        r = self.results["paths"][path]
        ours, theirs = self._turns(list_round_trips(self._kv), "list", self.cfg["list_repeats"])
        r["1000x1KiB_ms"] = statistics.median(ours[0]) * 1e3
        if theirs is not None:
            r["mxnet"]["1000x1KiB_ms"] = statistics.median(theirs[0]) * 1e3

    def pair(self, path):
        r = self.results["paths"][path]
        with pair_workers(path, r["options"], self.logdir) as seconds, references.tcp_sum(4 * MiB) as raw:
            ours, theirs, raw_sum = self._turns(seconds, "4MiB", self.cfg["pair_repeats"], workers=2, others=[raw])

        def aggregate(times):  # both workers' bytes over the slower one's median round trip (as MXNet's)
            return 2 * common.gbps(4 * MiB, max(map(statistics.median, times)))

        r["2workers_4MiB_gbps"] = aggregate(ours)
        r["2workers_rtt_s"] = [statistics.median(times) for times in ours]
        r["2workers_tcp_sum_gbps"] = aggregate(raw_sum)
        if theirs is not None:
            r["mxnet"]["2workers_4MiB_gbps"] = aggregate(theirs)


@contextlib.contextmanager
def _alarm(seconds, what):
    """Bounds one in-process step: SIGALRM raises TimeoutError."""
    def fire(signum, frame):
        raise TimeoutError(f"{what} took longer than {seconds:.0f}s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_steps(run):
    steps = run.steps()
    with run.stack, Progress(len(steps), "bench") as bar:
        for label, fn in steps:
            bar.show(f"{label} ...")
            with _alarm(STEP_TIMEOUT, label):
                fn()
            bar.step(label)


# ---- the report ----------------------------------------------------------------------


def rows(results, cfg):
    """The table: one entry per (row, path) with tensorkv's value and each
    reference (value, ratio); ratios > 1 favour tensorkv. MXNet's numbers are
    the path's own, measured taking turns with its rows."""
    refs, big = results["refs"], cfg["big"]

    def get(d, *keys):
        for key in keys:
            if not isinstance(d, dict):
                return None
            d = d[key] if key in d else d.get(str(key))
        return d

    def mxnet(name):
        return lambda p: get(p, "mxnet", name)

    def same(*keys):  # a reference measured once for every path
        return lambda p: get(refs, *keys)

    echoes = [("TCP echo", lambda p: get(p, "tcp_echo_gbps", 4 * MiB)),  # in the 4 MiB row's turns
              ("gRPC unary", same("grpc_unary_echo", 4 * MiB)),
              ("gRPC stream", same("grpc_stream_echo", 4 * MiB))]
    small_echoes = [("TCP echo", same("tcp_small_rtt", "rtt_us")),
                    ("gRPC unary", same("grpc_small_rtt", "rtt_us"))]
    specs = [
        # id, label, unit, higher is better, tensorkv getter, references
        ("4MiB", "push+pull 4 MiB", "GB/s", True,
         lambda p: get(p, "throughput_gbps", 4 * MiB), [("MXNet", mxnet("4MiB_gbps")), *echoes]),
        ("4MiB_fused", "pushpull 4 MiB", "GB/s", True,
         lambda p: get(p, "4MiB_pushpull_gbps"), [("MXNet", mxnet("4MiB_pushpull_gbps")), *echoes]),
        ("big", f"push+pull {size_label(big)}", "GB/s", True,
         lambda p: get(p, "throughput_gbps", big),
         [("MXNet", mxnet("big_gbps")),
          ("TCP echo", lambda p: get(p, "tcp_echo_gbps", big)),
          ("gRPC unary", same("grpc_unary_echo", big)),
          ("gRPC stream", same("grpc_stream_echo", big))]),
        ("16f", "push+pull 16 floats", "µs", False,
         lambda p: get(p, "16f_rtt_us"), [("MXNet", mxnet("16f_rtt_us")), *small_echoes]),
        ("16f_p99", "push+pull 16 floats p99", "µs", False,
         lambda p: get(p, "16f_p99_us"), [("MXNet", mxnet("16f_p99_us"))]),
        ("16f_fused", "pushpull 16 floats", "µs", False,
         lambda p: get(p, "16f_pushpull_us"), [("MXNet", mxnet("16f_pushpull_us")), *small_echoes]),
        ("list", "1000 x 1 KiB list", "ms", False,
         lambda p: get(p, "1000x1KiB_ms"), [("MXNet", mxnet("1000x1KiB_ms"))]),
        ("pair", "2 workers 4 MiB aggr.", "GB/s", True,
         lambda p: get(p, "2workers_4MiB_gbps"),
         [("MXNet", mxnet("2workers_4MiB_gbps")), ("TCP sum", lambda p: get(p, "2workers_tcp_sum_gbps"))]),
    ]
    table = []
    for rid, label, unit, higher, value, refs_ in specs:
        for path in PATHS:
            p = results["paths"].get(path)
            table.append(_row(rid, label, unit, higher, path, value(p) if p else None,
                              [(name, ref(p) if p else None) for name, ref in refs_]))
    table.append(_row(
        "local", "'local' 4 MiB", "GB/s", True, "embedded",
        get(results, "local", "4MiB_gbps"),
        [("MXNet", get(results, "local", "mxnet", "4MiB_gbps")),
         ("NumPy copy", get(refs, "memcpy_4MiB", "gbps"))]))
    return table


def _row(rid, label, unit, higher, path, value, refs_):
    cells = []
    for name, ref in refs_:
        ratio = None
        if value is not None and ref is not None:
            ratio = value / ref if higher else ref / value
        cells.append({"ref": name, "value": ref, "ratio": ratio})
    return {"id": rid, "row": label, "unit": unit, "path": path,
            "tensorkv": value, "refs": cells}


def goals(table, cfg):
    """Each goal of the issue: met, missed or not evaluated, with its ratio ({big} in a goal's
    text: the large size of this run)."""
    by = {(r["id"], r["path"]): r for r in table}
    out = []
    for text, rid, path, ref, need in GOALS:
        row = by.get((rid, path or "embedded"))
        ratio = None
        if row is not None:
            ratio = next((c["ratio"] for c in row["refs"]
                          if c["ref"] == ref), None)
        if row is None or row["tensorkv"] is None:
            status = "not measured"
        elif ref == "MXNet" and ratio is None:
            status = "not evaluated (MXNet not measured: make bench-mxnet)"
        elif ratio is None:
            status = f"not evaluated (no {ref} number for this row)"
        else:
            status = "met" if ratio >= need else "missed" + _beyond_raw(row, ref, need)
        out.append({"goal": text.replace("{big}", size_label(cfg["big"])), "ratio": ratio, "needed": need,
                    "status": status})
    for text, rid, path, need in TLS_GOALS:
        ratio = tls_ratio(by.get((rid, path)), by.get((rid, TLS_PAIRS[path])))
        status = "not measured" if ratio is None else "met" if ratio >= need else "missed"
        out.append({"goal": text.replace("{big}", size_label(cfg["big"])), "ratio": ratio, "needed": need,
                    "status": status})
    return out


def _beyond_raw(row, ref, need):
    """For a missed goal of ``need`` x ``ref`` on a GB/s row of a path whose values cross TCP
    (not shared memory): what the goal asks, in units of the row's raw TCP reference of the
    same run, when that is more than raw sockets moved ('' when not)."""
    raw = _cells(row).get("TCP echo")
    if (row["unit"] != "GB/s" or PATHS.get(row["path"], {}).get("options", {}).get("transport") is None
            or raw is None or raw["value"] is None):
        return ""
    asked = need * next(c["value"] for c in row["refs"] if c["ref"] == ref)
    if asked <= raw["value"]:
        return ""
    return f" (it asks {asked:.2f} GB/s, {asked / raw['value']:.2f}x the raw {raw['ref']} of this run)"


def tls_ratio(tls, plain):
    """How many times better the TLS row is than its plaintext row (< 1: slower), or None."""
    if not (tls and plain and tls["tensorkv"] and plain["tensorkv"]):
        return None
    return (tls["tensorkv"] / plain["tensorkv"] if tls["unit"] == "GB/s"
            else plain["tensorkv"] / tls["tensorkv"])


def tls_table(table):
    """(row, TLS path, plaintext value, TLS value, ratio) for every TLS row of the table."""
    by = {(r["id"], r["path"]): r for r in table}
    out = []
    for r in table:
        plain = by.get((r["id"], TLS_PAIRS.get(r["path"])))
        ratio = tls_ratio(r, plain)
        if ratio is not None:
            out.append((f"{r['row']} ({r['unit']})", r["path"], plain["tensorkv"], r["tensorkv"], ratio))
    return out


def _fmt(value, unit=""):
    if value is None:
        return "—"
    if unit in ("µs", "ms"):
        return f"{value:.1f}" if value < 1000 else f"{value:.0f}"
    return f"{value:.3f}" if value < 10 else f"{value:.2f}"


COLUMNS = ["MXNet", "TCP echo", "gRPC unary", "gRPC stream"]
# Raw references of the rows that no echo fits, shown in the TCP echo column.
RAW_REFERENCES = {"NumPy copy": "TCP echo", "TCP sum": "TCP echo"}
RAW_WORDS = ("The TCP echo column of the 4 MiB and large rows takes turns with the push+pull row (the pushpull "
             "row shows the push+pull row's); of the 'local' row, it is a NumPy copy of 4 MiB (bytes copied / s); "
             "of the '2 workers' row, a raw TCP sum taking turns with the row: two client processes each send "
             "4 MiB of float32 to a raw server (a thread per client) that sends the sum back to both.")


def _cells(row):
    """A table row's reference cells by column."""
    return {RAW_REFERENCES.get(c["ref"], c["ref"]): c for c in row["refs"]}


def format_report(table, goal_list, results, notes):
    lines = ["Medians on 127.0.0.1. GB/s = 2 x payload / round trip. "
             "Ratios (x) = how many times better tensorkv is "
             "(tensorkv/ref for GB/s, ref/tensorkv for times).", ""]
    head = f"{'row':<24}{'unit':<6}{'path':<11}{'tensorkv':>10}"
    for name in COLUMNS:
        head += f"{name:>12}{'x':>7}"
    lines += [head, "-" * len(head)]
    for r in table:
        line = (f"{r['row']:<24}{r['unit']:<6}{r['path']:<11}"
                f"{_fmt(r['tensorkv'], r['unit']):>10}")
        cells = _cells(r)
        for name in COLUMNS:
            c = cells.get(name)
            if c is None:
                line += f"{'':>12}{'':>7}"
                continue
            ratio = "—" if c["ratio"] is None else f"{c['ratio']:.2f}x"
            line += f"{_fmt(c['value'], r['unit']):>12}{ratio:>7}"
        lines.append(line)
    lines.append("")
    lines.append(RAW_WORDS)
    lines.append(mxnet_words(results))
    for path, p in results["paths"].items():
        opts = ", ".join(f"{k}={v!r}" for k, v in p["options"].items())
        lines.append(f"path {path}: create(..., {opts or 'no options'})"
                     + (f"; env {p['env']}" if p["env"] else "")
                     + "".join(f"; {n}" for n in p["notes"]))
    lines += notes
    lines += ["", "TLS against plaintext on the same path, same run (x = TLS / plaintext; "
              "for times plaintext / TLS):",
              f"{'row':<32}{'path':<10}{'plaintext':>11}{'TLS':>10}{'x':>7}"]
    lines += [f"{row:<32}{path:<10}{_fmt(plain):>11}{_fmt(tls):>10}{ratio:>6.2f}x"
              for row, path, plain, tls, ratio in tls_table(table)]
    lines += ["", "Goals (issues 4, 12 and 15):"]
    for g in goal_list:
        ratio = "" if g["ratio"] is None else f" ({g['ratio']:.2f}x)"
        lines.append(f"  [{g['status']}] {g['goal']}{ratio}")
    return "\n".join(lines)


def mxnet_words(results):
    version = results.get("mxnet_version")
    if version is None:
        return "MXNet not measured: run make bench-mxnet (once), then make bench."
    return (f"MXNet {version} (ps-lite dist_sync on 127.0.0.1, 1 server) measured in this run: each row that "
            f"MXNet has takes {TURNS} turns with MXNet's same round trips (tensorkv, MXNet, MXNet, tensorkv, ...), "
            "so that both meet the same moments of the machine; a row's MXNet column is its own turns' median.")


def format_markdown(table, goal_list, report):
    """The table and the goals as Markdown, for the README."""
    m = report["machine"]
    lines = [f"`{report['command']}` on {m['cpus']} CPUs, {m['platform']}, "
             f"Python {m['python']}, grpcio {m['grpcio']}, NumPy {m['numpy']}; "
             "127.0.0.1, medians. " + mxnet_words(report["results"]), "",
             "| row | unit | path | tensorkv | " + " | ".join(
                 f"{n} | x" for n in COLUMNS) + " |",
             "| --- | --- | --- | ---: | " + " | ".join(
                 "---: | ---:" for _ in COLUMNS) + " |"]
    for r in table:
        cells = _cells(r)
        line = (f"| {r['row']} | {r['unit']} | {r['path']} | "
                f"{_fmt(r['tensorkv'], r['unit'])} |")
        for name in COLUMNS:
            c = cells.get(name)
            if c is None:
                line += " | |"
            else:
                ratio = "—" if c["ratio"] is None else f"{c['ratio']:.2f}x"
                line += f" {_fmt(c['value'], r['unit'])} | {ratio} |"
        lines.append(line)
    lines += ["", "x: how many times better tensorkv is (tensorkv/reference "
              "for GB/s, reference/tensorkv for times). " + RAW_WORDS, "",
              "| row | TLS path | plaintext | TLS | x TLS / plaintext |", "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {row} | {path} | {_fmt(plain)} | {_fmt(tls)} | {ratio:.2f}x |"
              for row, path, plain, tls, ratio in tls_table(table)]
    lines += ["", "| goal (issues 4, 12 and 15) | ratio | status |", "| --- | ---: | --- |"]
    for g in goal_list:
        ratio = "—" if g["ratio"] is None else f"{g['ratio']:.2f}x"
        lines.append(f"| {g['goal']} | {ratio} | {g['status']} |")
    return "\n".join(lines) + "\n"


def machine():
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__,
            "grpcio": _version("grpc")}


def _version(module):
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


def plot(results, path, cfg):
    series = {}
    for name, p in results["paths"].items():
        if p["throughput_gbps"]:
            series[f"tensorkv dist_sync ({name})"] = p["throughput_gbps"]
    labels = {"tcp_echo": "raw TCP echo", "grpc_unary_echo": "gRPC unary echo",
              "grpc_stream_echo": "gRPC 1 MiB stream echo"}
    for name, label in labels.items():
        if name in results["refs"]:
            series[label] = results["refs"][name]
    measured = results["paths"].get("tcp-only", {}).get("mxnet", {})  # taking turns with the tcp-only rows
    points = {n: measured.get(name) for n, name in ((4 * MiB, "4MiB_gbps"), (cfg["big"], "big_gbps"))}
    points = {n: v for n, v in points.items() if v is not None}
    if points:
        series[f"MXNet {results['mxnet_version']} dist_sync"] = points
    return plot_throughput(series, path)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--quick", action="store_true",
                        help="a fast smoke run: fewer sizes and repeats, "
                             "16 MiB in place of 64 MiB")
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "bench-results"))
    parser.add_argument("--mxnet-python", default=None,
                        help="the interpreter of .venv-mxnet (make bench-mxnet): MXNet's "
                             "rows, measured taking turns with tensorkv's")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--servers", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)

    cfg = QUICK if args.quick else FULL
    os.makedirs(args.out_dir, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    json_path = os.path.join(args.out_dir, f"bench{suffix}.json")
    png_path = os.path.join(args.out_dir, f"throughput{suffix}.png")
    command = "python " + " ".join(shlex.quote(a) for a in
                                   [os.path.relpath(sys.argv[0], ROOT)]
                                   + sys.argv[1:])
    report = {"command": command, "quick": args.quick, "machine": machine(),
              "config": cfg, "paths": PATHS,
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    status, error = 0, None
    with tempfile.TemporaryDirectory(prefix="tensorkv-bench-") as logdir:
        run = Run(cfg, logdir, args.mxnet_python)
        try:
            run_steps(run)
        except CheckError as err:
            status, error = 2, f"value check failed: {err}"
        except Exception as err:  # noqa: BLE001 - reported, then exit 1
            status, error = 1, f"{type(err).__name__}: {err}"
    if error and len(error) > 2000:
        error = error[:2000] + " ..."
    results = run.results
    if args.quick:
        run.notes.append(f"--quick: {cfg['repeats']} round trips a row; the goals' statuses below say little")
    table = rows(results, cfg)
    goal_list = goals(table, cfg)
    report.update(results=results, table=table, goals=goal_list,
                  notes=run.notes, failed=status != 0, error=error)
    print(format_report(table, goal_list, results, run.notes))
    with open(json_path, "w") as f:
        json.dump(_jsonable(report), f, indent=2)
        f.write("\n")
    md_path = os.path.join(args.out_dir, f"bench{suffix}.md")
    with open(md_path, "w") as f:
        f.write(format_markdown(table, goal_list, report))
    print(f"\nresults: {os.path.relpath(json_path)}, {os.path.relpath(md_path)}")
    if plot(results, png_path, cfg):
        print(f"plot: {os.path.relpath(png_path)}")
    if error:
        print(f"\nbench FAILED: {error}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
