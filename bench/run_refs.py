"""Runs every reference in bench/references.py and prints a table.

    python bench/run_refs.py [--json refs.json] [--png refs.png] [--quick]
"""

import argparse
import json
import sys

import references
from plot import plot_throughput, size_label
from progress import Progress

QUICK_SIZES = (64 << 10, references.MiB, 16 * references.MiB)
THROUGHPUT = ("tcp_echo", "grpc_unary_echo", "grpc_stream_echo")


def run_all(sizes=references.SIZES, repeats=references.REPEATS,
            small_repeats=references.SMALL_REPEATS):
    """Runs all references with a progress bar; returns {name: result}."""
    steps = [
        ("tcp_echo", lambda: references.tcp_echo(sizes, repeats)),
        ("grpc_unary_echo", lambda: references.grpc_unary_echo(sizes, repeats)),
        ("grpc_stream_echo",
         lambda: references.grpc_stream_echo(sizes, repeats)),
        ("tcp_small_rtt", lambda: references.tcp_small_rtt(small_repeats)),
        ("grpc_small_rtt", lambda: references.grpc_small_rtt(small_repeats)),
        ("memcpy", lambda: references.memcpy(repeats=repeats)),
    ]
    results = {}
    with Progress(len(steps), "references") as bar:
        for name, measure in steps:
            bar.show(f"{name} ...")
            results[name] = measure()
            bar.step(name)
    return results


def format_table(results):
    """Returns the results as a plain-text table."""
    series = [name for name in THROUGHPUT if name in results]
    sizes = sorted({n for name in series for n in results[name]})
    lines = ["push+pull round trip, GB/s counted both ways (2*N / RTT)",
             f"{'size':>10}" + "".join(f"{name:>18}" for name in series)]
    for n in sizes:
        cells = "".join(f"{results[name].get(n, float('nan')):>18.3f}"
                        for name in series)
        lines.append(f"{size_label(n):>10}{cells}")
    lines.append("")
    for name, value in results.items():
        if name not in series:
            lines.append(f"{name:>18}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in value.items()))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--png", help="also plot throughput vs size here")
    parser.add_argument("--quick", action="store_true",
                        help="three sizes, fewer repeats (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        results = run_all(QUICK_SIZES, repeats=3, small_repeats=200)
    else:
        results = run_all()
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.png:
        plot_throughput({name: results[name] for name in THROUGHPUT},
                        args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
