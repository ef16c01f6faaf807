"""row_sparse_pull's row of `make bench`: 1% of the rows of a 64 MiB table next to a full pull.

One float32 table of 65,536 rows x 256 columns (64 MiB, 1 KiB a row) on 'dist_sync' with
one worker (this process) and a real server process, over the TCP-only path
(transport='tcp', as a client on another host). Rows, medians in ms, measured in the same
run on the same store, in rounds of: a full pull, then BLOCK row-sparse pulls in a row, a
full pull again, then BLOCK pulls of 16 floats in a row:

  * full pull: ``kv.pull(key, out=table)``;
  * row_sparse_pull of 1% of the rows (655 distinct ids, drawn at random, another set for
    each call of a block, as batches of an embedding differ):
    ``kv.row_sparse_pull(key, out=rows, row_ids=ids)`` into a (655, 256) array, the median
    of every call of the blocks (the cost of the call itself);
  * the same, the first call of each block only: right after a full pull, whose 64 MiB
    went through both processes' caches on this one host (a cost that the full pull
    leaves, not the row-sparse pull's own);
  * for scale, a pull of a 16-float key, in blocks and first after a full pull: the least
    any call costs.

The goal (issue 18): the row-sparse pull takes at most 5% of the full pull's time. After
the clock stops, the rows pulled are checked against the table: a mismatch fails the bench
with exit status 2. Writes <out-dir>/row_sparse.{json,md} (row_sparse-quick.* with --quick:
3 repeats in place of 10).
"""
import itertools
import os
import statistics
import sys
import time

import numpy as np

import tensorkv

import common
from run import server

GOAL = 0.05  # row_sparse_pull of 1% of the rows / full pull
SHAPE = (65_536, 256)
BLOCK = 20  # calls in a row after each full pull
AFTER = ", first after a full pull"


def measure(repeats, logdir):
    """{row: median seconds} and whether the pulled rows checked out."""
    rng = np.random.default_rng(0)
    value = rng.standard_normal(SHAPE, dtype=np.float32)
    # a batch's ids differ from the last one's: BLOCK sets, drawn once, one per call of a block
    id_sets = [np.sort(rng.choice(SHAPE[0], SHAPE[0] // 100, replace=False)) for _ in range(BLOCK)]
    table, rows = np.empty_like(value), np.empty((len(id_sets[0]), SHAPE[1]), np.float32)
    batches = itertools.cycle(id_sets)  # a block's calls take them in turn: it ends on the last
    with server(1, dict(os.environ), logdir) as address, \
            tensorkv.create("dist_sync", servers=address, rank=0, num_workers=1, transport="tcp") as kv:
        kv.init("table", value)
        kv.init("small", np.zeros(16, np.float32))
        full = lambda: kv.pull("table", out=table)
        blocks = {"row_sparse_pull 1%": lambda: kv.row_sparse_pull("table", out=rows, row_ids=next(batches)),
                  "pull of 16 floats": lambda: kv.pull("small")}
        times = {name: [] for name in ("full pull", *(f"{n}{suffix}" for n in blocks for suffix in ("", AFTER)))}
        for repeat in range(repeats + 1):  # the first round warms up
            for name, op in blocks.items():
                seconds = [_timed(full)] + [_timed(op) for _ in range(BLOCK)]
                if repeat:
                    times["full pull"].append(seconds[0])
                    times[name] += seconds[1:]
                    times[name + AFTER].append(seconds[1])
    ok = np.array_equal(table, value) and np.array_equal(rows, value[id_sets[-1]])  # the last call's
    return {name: statistics.median(values) for name, values in times.items()}, ok


def _timed(op):
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def markdown(medians, command):
    full = medians["full pull"]
    lines = [f"`{command}`: float32 table {SHAPE[0]} x {SHAPE[1]} (64 MiB), 1% = {SHAPE[0] // 100} rows, "
             f"dist_sync over TCP, 1 worker, medians; goal: row_sparse_pull <= {GOAL:.0%} of a full pull.", "",
             "| row | ms | x full pull |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {seconds * 1e3:.2f} | {seconds / full:.4f} |" for name, seconds in medians.items()]
    return "\n".join(lines) + "\n"


def main(argv=None):
    return common.run_ratio_bench(
        __doc__, argv, "row_sparse", measure, (3, 10), "the rows pulled differ from the table", markdown,
        lambda medians: medians["row_sparse_pull 1%"] / medians["full pull"], GOAL, lambda ratio: ratio <= GOAL)


if __name__ == "__main__":
    sys.exit(main())
