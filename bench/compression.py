"""The gradient compression rows of `make bench`: a 2-bit compressed push next to a plain one,
on loopback and through links of 10 Gbit/s and 1 Gbit/s.

One float32 key of 4 MiB (1,048,576 floats) on 'dist_sync' with one worker (this process),
over the TCP-only path (transport='tcp', as a client on another host), each store on a real
server process of its own (on 127.0.0.2): one store plain, one with
``kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})``. Each link gets a pair
of stores whose pushes alternate in the same run:

  * loopback: the stores connect to the servers straight over the loopback device (faster
    than the links 2-bit compression is for);
  * proxy, unpaced: through bench/paced_proxy.py relaying as fast as it can (the proxy's
    own cost, part of the paced rows too);
  * 10 Gbit/s and 1 Gbit/s: through the proxy pacing both directions to that rate (a link
    between hosts, without its propagation delay).

Each store makes 4 pushes of the key in a row, then kv.barrier(), which returns once the
servers answered every push (a compressed push is sent without waiting for its answer, so
its time alone would leave out the server's work). Rows are the median over the rounds of
that time / 4: ms per push, the effective rate (4 MiB / push time) and, through the proxy,
the bytes it carried per push (both directions: the compressed push moves 256 KiB of codes,
plus the worker's quantization and the server's dequantization). The goal (issue 18): the
compressed push's effective rate >= 3x the plain one's, reported for each link. After the
clock stops, each compressed store's value is checked against the quantization formula (a
residual replayed here, push by push): a mismatch fails the bench with exit status 2.
Where `make bench-mxnet` wrote <out-dir>/mxnet.json (`make bench` runs it first), MXNet
1.9.1's own plain and 2-bit pushes of the same key over loopback are printed below the rows,
with the time the file was written, for reference.
Writes <out-dir>/compression.{json,md} (compression-quick.* with --quick: 5 repeats in
place of 30).
"""
import contextlib
import json
import os
import statistics
import sys
import time

import numpy as np

import tensorkv
from tensorkv.update import compression

import common
from paced_proxy import PacedProxy
from run import server

GOAL = 3.0  # compressed effective rate / plain effective rate
SIZE = 1 << 20  # float32 elements: 4 MiB
THRESHOLD = 0.5
SERVER_HOST, PROXY_HOST = "127.0.0.2", "127.0.0.3"
LINKS = {"loopback": None, "proxy, unpaced": "unpaced", "10 Gbit/s": 10e9, "1 Gbit/s": 1e9}  # None: no proxy
MODES = ("plain push", "2-bit push")
BURST = 4  # pushes timed together, up to the barrier that waits for all their answers
CARRIED = {}  # row -> median bytes through the proxy per push, of the last measure()
MXNET_LINES = []  # what mxnet_lines() found for this run


def measure(repeats, logdir):
    """({row: median seconds per push}, whether every compressed value checked out); rows are
    '<mode>, <link>'. Fills CARRIED."""
    rng = np.random.default_rng(0)
    gradients = [rng.standard_normal(SIZE, dtype=np.float32) for _ in range(BURST)]
    medians, ok = {}, True
    CARRIED.clear()
    with contextlib.ExitStack() as stack:
        servers = {}  # mode -> (address, data port)
        for mode in MODES:
            data_port = common.free_port()
            address = stack.enter_context(server(1, dict(os.environ), logdir, ("--data-port", str(data_port)),
                                                 host=SERVER_HOST))
            servers[mode] = address, data_port
        for link, rate in LINKS.items():
            times, carried, link_ok = _measure_link(link, rate, servers, gradients, repeats)
            ok = ok and link_ok
            for mode in MODES:
                medians[f"{mode}, {link}"] = statistics.median(times[mode][1:])
                if rate is not None:
                    CARRIED[f"{mode}, {link}"] = statistics.median(carried[mode][1:])
    return medians, ok


def _measure_link(link, rate, servers, gradients, repeats):
    """({mode: [seconds per push]}, {mode: [bytes through the proxy per push]}, values ok) of
    one link: a fresh pair of stores on key ``link``, through a proxy unless ``rate`` is None."""
    with contextlib.ExitStack() as stack:
        proxy, addresses = None, {mode: address for mode, (address, _) in servers.items()}
        if rate is not None:
            routes = {}
            for mode, (address, data_port) in servers.items():
                port = common.free_port()
                routes[port] = (SERVER_HOST, int(address.rsplit(":", 1)[1]))
                routes[data_port] = (SERVER_HOST, data_port)  # the port the server's Info names
                addresses[mode] = f"{PROXY_HOST}:{port}"
            proxy = stack.enter_context(PacedProxy(PROXY_HOST, routes, None if rate == "unpaced" else rate))
        stores = {}
        for mode in MODES:
            kv = stores[mode] = stack.enter_context(tensorkv.create(
                "dist_sync", servers=addresses[mode], rank=0, num_workers=1, transport="tcp"))
            kv.init(link, np.zeros(SIZE, np.float32))
        stores["2-bit push"].set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
        residual = np.zeros(SIZE, np.float32)
        times, carried = {mode: [] for mode in MODES}, {mode: [] for mode in MODES}
        for _ in range(repeats + 1):  # the first round warms up
            for mode, kv in stores.items():
                before = _carried(proxy)
                start = time.perf_counter()
                for gradient in gradients:
                    kv.push(link, gradient)
                kv.barrier()  # every push answered: applied on the server
                times[mode].append((time.perf_counter() - start) / len(gradients))
                carried[mode].append((_carried(proxy) - before) / len(gradients))
            for gradient in gradients:
                codes = compression.quantize(gradient, residual, THRESHOLD)
        gradient = gradients[-1]
        expected = compression.dequantize(compression.pack(codes), SIZE, THRESHOLD)
        ok = np.array_equal(stores["2-bit push"].pull(link), expected) and \
            np.array_equal(stores["plain push"].pull(link), gradient)
    return times, carried, ok


def _carried(proxy):
    return 0 if proxy is None else proxy.to_targets.bytes + proxy.from_targets.bytes


def speedups(medians):
    """{link: the 2-bit push's effective rate over the plain push's}."""
    return {link: medians[f"plain push, {link}"] / medians[f"2-bit push, {link}"] for link in LINKS}


def markdown(medians, command):
    ratios = speedups(medians)
    lines = [f"`{command}`: one 4 MiB float32 key, dist_sync over TCP (transport='tcp'), 1 worker, medians; "
             f"goal: 2-bit effective rate >= {GOAL:.0f}x plain. 'loopback' rows connect straight over the loopback "
             "device; the others go through bench/paced_proxy.py, unpaced or paced to 10 or 1 Gbit/s each way.", "",
             "| row | ms | effective GB/s | MB through the proxy per push |", "| --- | ---: | ---: | ---: |"]
    for row, seconds in medians.items():
        carried = CARRIED.get(row)
        lines.append(f"| {row} | {seconds * 1e3:.2f} | {SIZE * 4 / seconds / 1e9:.2f} | "
                     f"{'-' if carried is None else f'{carried / 1e6:.3f}'} |")
    lines += ["", "2-bit / plain effective rate: " + ", ".join(
        f"{link} **{ratio:.2f}x**" for link, ratio in ratios.items()) + f" (goal {GOAL:.0f}x)"] + MXNET_LINES
    return "\n".join(lines) + "\n"


def mxnet_lines(out_dir):
    """MXNet 1.9.1's own plain and 2-bit push of 4 MiB on loopback, from <out-dir>/mxnet.json
    (`make bench-mxnet`, which `make bench` runs first), with the time it was written, as
    Markdown lines; none without it."""
    path = os.path.join(out_dir, "mxnet.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        mxnet = json.load(f)
    plain, two_bit = mxnet.get("dist_sync_push_4MiB_ms"), mxnet.get("dist_sync_push_4MiB_2bit_ms")
    if plain is None or two_bit is None:
        return []
    measured = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(path)))
    return ["", f"MXNet {mxnet.get('mxnet_version', '?')} over loopback ({path}, written {measured} by `make "
                f"bench-mxnet`: ps-lite dist_sync, 1 worker, plain pushes then 2-bit ones): plain {plain:.2f} ms, "
                f"2-bit {two_bit:.2f} ms: 2-bit / plain effective rate **{plain / two_bit:.2f}x**"]


def main(argv=None):
    MXNET_LINES[:] = mxnet_lines(common.parse_args(__doc__, argv).out_dir)
    return common.run_ratio_bench(
        __doc__, argv, "compression", measure, (5, 30), "a pulled value differs from the quantization formula",
        markdown, speedups, GOAL, lambda ratios: {link: ratio >= GOAL for link, ratio in ratios.items()})


if __name__ == "__main__":
    sys.exit(main())
