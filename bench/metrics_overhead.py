"""The metrics overhead rows of `make bench`: push+pull throughput with --metrics-port next to without.

Three real server processes on 127.0.0.1 ('dist_sync', one worker: this process), the same
but for ``--metrics-port`` on one of them, each with a store of its own on the default
(same-host) path. Every sample times the same operation on the three stores back to back,
the first store rotating, so drift of this shared machine falls on all alike; the second
server without metrics is a control, whose ratio to the first shows the noise of the figures.
Rows: one 4 MiB float32 key, a list of 1000 x 1 KiB keys, 16 floats (50 push+pulls a
sample: the per-call cost, where the gRPC interceptor and counters weigh most). The ratio is the
median throughput with metrics over the one without; the goal (issue 13) is >= 0.99. Every
pulled value is checked off the clock (a wrong one fails with exit status 2), and after the
run the metrics server's scrape must count the pushes. Writes
<out-dir>/metrics_overhead.{json,md} (metrics_overhead-quick.* with --quick: 5 samples a row
in place of 200).
"""
import contextlib
import os
import statistics
import sys
import tempfile
import time
import urllib.request

import numpy as np

import tensorkv

import common
from run import CheckError, KiB, LIST_FLOATS, LIST_KEYS, MiB, _check, _patterns, server

GOAL = 0.99  # throughput with metrics / without
SMALL_CALLS = 50  # 16-float push+pulls per sample
CONTROL = "metrics off, control"  # a second server without metrics: the noise floor of the ratio
STORES = ("metrics off", CONTROL, "metrics on")


class Row:
    """One row: keys and two value patterns, and a sample that pushes then pulls them all."""

    def __init__(self, name, keys, n_floats, calls=1):
        self.name, self.keys, self.calls = name, keys, calls
        self.values, self.expected = _patterns(n_floats)
        self.outs = {store: [np.zeros(n_floats, np.float32) for _ in keys] for store in STORES}
        self.nbytes = 4 * n_floats * len(keys) * calls

    def init(self, store, kv):
        kv.init(self.keys, [self.values[0]] * len(self.keys))

    def sample(self, store, kv, i):
        """Seconds of this row's push+pulls on ``kv``; the values pulled are checked after."""
        outs = self.outs[store]
        for out in outs:
            out.fill(-1.0)  # so a partial pull cannot pass for a full one
        values = [self.values[i % 2]] * len(self.keys)
        start = time.perf_counter()
        for _ in range(self.calls):
            kv.push(self.keys, values)
            kv.pull(self.keys, out=outs)
        seconds = time.perf_counter() - start
        for key, out in zip(self.keys, outs):
            _check(f"{self.name} on {store}, key {key!r} #{i}", out, self.expected[i % 2])
        return seconds


def rows():
    return [Row("4 MiB push+pull", ["big"], MiB),
            Row(f"{LIST_KEYS} x 1 KiB list push+pull", [f"list-{i}" for i in range(LIST_KEYS)], LIST_FLOATS),
            Row(f"16-float push+pull x {SMALL_CALLS}", ["small"], 16, SMALL_CALLS)]


def scraped_pushes(metrics_port):
    """tensorkv_pushes_total from the metrics server's scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("tensorkv_pushes_total "))


def measure(samples, logdir):
    """({row name: {store: median seconds}}, bytes per sample of each row, pushes scraped)."""
    metrics_port = common.free_port()
    server_args = {"metrics off": (), CONTROL: (), "metrics on": ("--metrics-port", str(metrics_port))}
    table = rows()
    times = {row.name: {store: [] for store in STORES} for row in table}
    with contextlib.ExitStack() as stack:
        stores = {}
        for store in STORES:
            address = stack.enter_context(server(1, dict(os.environ), logdir, server_args[store]))
            stores[store] = stack.enter_context(tensorkv.create(
                "dist_sync", servers=address, rank=0, num_workers=1))
        for row in table:
            for store, kv in stores.items():
                row.init(store, kv)
            for i in range(samples + 1):  # the first sample warms up
                order = STORES[i % 3:] + STORES[:i % 3]
                for store in order:
                    seconds = row.sample(store, stores[store], i)
                    if i:
                        times[row.name][store].append(seconds)
        pushes = scraped_pushes(metrics_port)
    medians = {name: {store: statistics.median(values) for store, values in by_store.items()}
               for name, by_store in times.items()}
    return medians, {row.name: row.nbytes for row in table}, pushes


def markdown(medians, nbytes, command):
    lines = [f"`{command}`: dist_sync, 1 worker, same-host path, two servers alike but for --metrics-port, "
             f"samples interleaved, medians; goal: with / without >= {GOAL}.", "",
             "| row | MB a sample | ms without | ms with | throughput with / without | control / without |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, by_store in medians.items():
        off, on, control = by_store["metrics off"], by_store["metrics on"], by_store[CONTROL]
        lines.append(f"| {name} | {nbytes[name] / 1e6:.3f} | {off * 1e3:.3f} | {on * 1e3:.3f} | **{off / on:.3f}** | "
                     f"{off / control:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = common.parse_args(__doc__, argv)
    command = "python bench/metrics_overhead.py" + (" --quick" if args.quick else "")
    samples = 5 if args.quick else 200
    try:
        with tempfile.TemporaryDirectory() as logdir:
            medians, nbytes, pushes = measure(samples, logdir)
    except CheckError as error:
        print(f"metrics overhead bench FAILED: {error}", file=sys.stderr)
        return 2
    if pushes <= 0:
        print("metrics overhead bench FAILED: the metrics server counted no pushes", file=sys.stderr)
        return 2
    ratios = {name: by_store["metrics off"] / by_store["metrics on"] for name, by_store in medians.items()}
    control = {name: by_store["metrics off"] / by_store[CONTROL] for name, by_store in medians.items()}
    common.write_results(args, "metrics_overhead", markdown(medians, nbytes, command), {
        "command": command, "samples": samples, "pushes_scraped": pushes, "goal": GOAL,
        "ms": {name: {store: s * 1e3 for store, s in by_store.items()} for name, by_store in medians.items()},
        "ratio": ratios, "control_ratio": control, "goal_met": all(ratio >= GOAL for ratio in ratios.values())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
