"""A quick transport benchmark for developing the wire path (not `make bench`).

Starts one server on a free loopback port (sync, 1 worker), then times, as medians:
push+pull (two calls, pull into `out`) and pushpull of one float32 key at several sizes,
a 16-float key, 1000 keys x 1 KiB as one list call, and the 'local' store at 4 MiB.
GB/s counts payload both ways.  Usage: .venv/bin/python tools/wirebench.py [--quick]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from cluster import Cluster  # noqa: E402

import tensorkv  # noqa: E402


def timed(fn, reps, warm=3):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default="4,64")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    scale = 0.3 if args.quick else 1.0
    rows = []
    with Cluster(servers=1, num_workers=1) as cluster:
        kv = tensorkv.create("dist_sync", servers=cluster.addresses[0])
        for mib in [float(s) for s in args.sizes.split(",") if s]:
            n = int(mib * (1 << 20)) // 4
            key = f"big{mib}"
            value = np.ones(n, np.float32)
            out = np.empty_like(value)
            kv.init(key, np.zeros(n, np.float32))
            reps = max(5, int((40 if mib <= 4 else 10) * scale))
            t = timed(lambda: (kv.push(key, value), kv.pull(key, out=out)), reps)
            assert out[0] == 1 and out[-1] == 1
            rows.append((f"push+pull {mib:g} MiB", f"{2 * n * 4 / t / 1e9:.2f} GB/s", f"{t * 1e3:.1f} ms"))
            t = timed(lambda: kv.pushpull(key, value, out=out), reps)
            rows.append((f"pushpull  {mib:g} MiB", f"{2 * n * 4 / t / 1e9:.2f} GB/s", f"{t * 1e3:.1f} ms"))
            print(*rows[-2], sep="  ", flush=True)
            print(*rows[-1], sep="  ", flush=True)
        small = np.ones(16, np.float32)
        sout = np.empty_like(small)
        kv.init("s16", small)
        reps = int(2000 * scale)
        t = timed(lambda: (kv.push("s16", small), kv.pull("s16", out=sout)), reps, 50)
        rows.append(("push+pull 16 floats", f"{t * 1e6:.0f} us", ""))
        t = timed(lambda: kv.pushpull("s16", small, out=sout), reps, 50)
        rows.append(("pushpull  16 floats", f"{t * 1e6:.0f} us", ""))
        print(*rows[-2], sep="  ", flush=True)
        print(*rows[-1], sep="  ", flush=True)
        keys = [f"k{i}" for i in range(1000)]
        vals = [np.ones(256, np.float32) for _ in keys]
        outs = [np.empty(256, np.float32) for _ in keys]
        kv.init(keys, vals)
        reps = max(5, int(50 * scale))
        t = timed(lambda: (kv.push(keys, vals), kv.pull(keys, out=outs)), reps)
        rows.append(("push+pull 1000x1KiB", f"{t * 1e3:.2f} ms", ""))
        t = timed(lambda: kv.pushpull(keys, vals, out=outs), reps)
        rows.append(("pushpull  1000x1KiB", f"{t * 1e3:.2f} ms", ""))
        print(*rows[-2], sep="  ", flush=True)
        print(*rows[-1], sep="  ", flush=True)
        kv.close()
    with tensorkv.create("local") as kv:
        n = (4 << 20) // 4
        value, out = np.ones(n, np.float32), np.empty(n, np.float32)
        kv.init(0, value)
        t = timed(lambda: (kv.push(0, value), kv.pull(0, out=out)), int(200 * scale))
        rows.append(("local push+pull 4 MiB", f"{2 * n * 4 / t / 1e9:.2f} GB/s", f"{t * 1e3:.2f} ms"))
        print(*rows[-1], sep="  ", flush=True)


if __name__ == "__main__":
    main()
