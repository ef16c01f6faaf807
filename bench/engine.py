"""The update engine's rows of `make bench`: a GPU through CuPy when one is present, else NumPy.

What the 'device' store does to one 64 MiB float32 key, through the public API, next to a
plain copy of 64 MiB on the same array namespace measured in the same run:

  * push of a list of 2 and of 4 arrays (summed, then assigned);
  * one optimizer step per push: SGD with momentum, and Adam.

GB/s counts the bytes pushed per second (the copy: bytes copied per second); x is the rate
against the copy. Pushed arrays live where the values live (CuPy arrays on a GPU). Every
timed push is checked afterwards against the same arithmetic in NumPy float64: a wrong
value fails the bench with exit status 2. Writes <out-dir>/engine.{json,md}.
"""
import statistics
import sys
import time

import numpy as np

import tensorkv
from tensorkv.backend import select

import common

SIZE = 64 << 20


def _timer(xp):
    """A clock that waits for the device's queued work before it reads the time."""
    if xp is np:
        return time.perf_counter

    def clock():
        xp.cuda.Device().synchronize()
        return time.perf_counter()
    return clock


def _median(clock, fn, repeats):
    fn()  # warm-up: allocations, kernel compilation
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


class CheckError(Exception):
    pass


def _check(name, got, want):
    got = np.asarray(got, np.float64)
    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        worst = int(np.argmax(np.abs(got - want)))
        raise CheckError(f"{name}: element {worst} is {got[worst]}, expected {want[worst]}")


def measure(repeats, size=SIZE):
    xp, device = select("auto")
    clock = _timer(xp)
    n = size // 4
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(n, dtype=np.float32) for _ in range(4)]
    pushed = [xp.asarray(a) for a in host]
    rows = []

    target = xp.empty_like(pushed[0])
    copy = _median(clock, lambda: target.__setitem__(Ellipsis, pushed[0]), repeats)
    rows.append(("copy 64 MiB", size / copy / 1e9))

    for count in (2, 4):
        with tensorkv.create("device") as kv:
            kv.init(0, xp.zeros(n, xp.float32))
            seconds = _median(clock, lambda: kv.push(0, pushed[:count]), repeats)
            _check(f"sum of {count} pushes", kv.pull(0), np.sum([a.astype(np.float64) for a in host[:count]], axis=0))
        rows.append((f"push of {count} x 64 MiB (sum, assign)", count * size / seconds / 1e9))

    steps = [("SGD momentum step 64 MiB", tensorkv.optimizer.SGD(learning_rate=0.01, momentum=0.9)),
             ("Adam step 64 MiB", tensorkv.optimizer.Adam(learning_rate=0.001))]
    for name, optimizer in steps:
        with tensorkv.create("device") as kv:
            kv.set_optimizer(optimizer)
            kv.init(0, xp.asarray(host[1]))
            seconds = _median(clock, lambda: kv.push(0, pushed[0]), repeats)
            got = kv.pull(0)
        with tensorkv.create("local") as reference:  # the same steps on the CPU engine
            reference.set_optimizer(tensorkv.optimizer.create(optimizer.name, **optimizer.params))
            reference.init(0, host[1])
            for _ in range(repeats + 1):
                reference.push(0, host[0])
            _check(name, got, reference.pull(0).astype(np.float64))
        rows.append((name, size / seconds / 1e9))
    return device, [(name, rate, rate / rows[0][1]) for name, rate in rows]


def markdown(device, rows, command):
    lines = [f"`{command}`: 'device' store on {device}, medians; GB/s of bytes pushed (copy: copied).", "",
             "| row | GB/s | x copy |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {rate:.2f} | {ratio:.2f}x |" for name, rate, ratio in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = common.parse_args(__doc__, argv)
    command = "python bench/engine.py" + (" --quick" if args.quick else "")
    try:
        device, rows = measure(3 if args.quick else 10)
    except CheckError as error:
        print(f"engine bench FAILED: value check failed: {error}", file=sys.stderr)
        return 2
    common.write_results(args, "engine", markdown(device, rows, command), {
        "command": command, "device": device, "rows": [{"row": n, "gbps": r, "x_copy": x} for n, r, x in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
