"""The gradient compression rows of `make bench`: a 2-bit compressed push next to a plain one.

One float32 key of 4 MiB (1,048,576 floats) on 'dist_sync' with one worker (this process),
over the TCP-only path (transport='tcp', as a client on another host), each store on a real
server process of its own: one store plain, one with
``kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})``. Pushes of the two
stores alternate in the same run; rows are median ms per push and the effective rate,
4 MiB / push time (the compressed push moves 256 KiB of codes, plus the worker's
quantization and the server's dequantization). The goal (issue 18): the compressed push's
effective rate >= 3x the plain one's. After the clock stops, the compressed store's value is
checked against the quantization formula (a residual replayed here, push by push): a
mismatch fails the bench with exit status 2. Writes <out-dir>/compression.{json,md}
(compression-quick.* with --quick: 5 repeats in place of 30).
"""
import contextlib
import os
import statistics
import sys
import time

import numpy as np

import tensorkv
from tensorkv import compression

import common
from run import server

GOAL = 3.0  # compressed effective rate / plain effective rate
SIZE = 1 << 20  # float32 elements: 4 MiB
THRESHOLD = 0.5


def measure(repeats, logdir):
    """({row: median seconds per push}, whether the compressed value checked out)."""
    rng = np.random.default_rng(0)
    gradients = [rng.standard_normal(SIZE, dtype=np.float32) for _ in range(2)]
    with contextlib.ExitStack() as stack:
        stores = {}
        for name in ("plain push", "2-bit push"):
            address = stack.enter_context(server(1, dict(os.environ), logdir))
            kv = stores[name] = stack.enter_context(tensorkv.create(
                "dist_sync", servers=address, rank=0, num_workers=1, transport="tcp"))
            kv.init("g", np.zeros(SIZE, np.float32))
        stores["2-bit push"].set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
        residual = np.zeros(SIZE, np.float32)
        times = {name: [] for name in stores}
        for i in range(repeats + 1):  # the first round warms up
            gradient = gradients[i % 2]
            for name, kv in stores.items():
                start = time.perf_counter()
                kv.push("g", gradient)
                times[name].append(time.perf_counter() - start)
            codes = compression.quantize(gradient, residual, THRESHOLD)
        expected = compression.dequantize(compression.pack(codes), SIZE, THRESHOLD)
        ok = np.array_equal(stores["2-bit push"].pull("g"), expected) and \
            np.array_equal(stores["plain push"].pull("g"), gradient)
    return {name: statistics.median(values[1:]) for name, values in times.items()}, ok


def speedup(medians):
    """The 2-bit push's effective rate over the plain push's."""
    return medians["plain push"] / medians["2-bit push"]


def markdown(medians, command):
    ratio = speedup(medians)
    lines = [f"`{command}`: one 4 MiB float32 key, dist_sync over TCP (transport='tcp'), 1 worker, medians; "
             f"goal: 2-bit effective rate >= {GOAL:.0f}x plain.", "",
             "| row | ms | effective GB/s |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {seconds * 1e3:.2f} | {SIZE * 4 / seconds / 1e9:.2f} |" for name, seconds in medians.items()]
    lines += ["", f"2-bit / plain effective rate: **{ratio:.2f}x** (goal {GOAL:.0f}x)"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    return common.run_ratio_bench(
        __doc__, argv, "compression", measure, (5, 30), "a pulled value differs from the quantization formula",
        markdown, speedup, GOAL, lambda ratio: ratio >= GOAL)


if __name__ == "__main__":
    sys.exit(main())
