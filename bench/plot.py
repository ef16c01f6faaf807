"""Plots throughput against tensor size; matplotlib is optional."""

import sys


def plot_throughput(series, path, title="push+pull throughput on 127.0.0.1"):
    """Writes a PNG at `path` with one line per named series.

    `series` maps a name to {payload bytes: GB/s}; keys may be strings, as
    after a JSON round trip.  Returns False, after printing a note, when
    matplotlib is not installed, else True.
    """
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping the plot",
              file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in series.items():
        sizes = sorted(int(n) for n in points)
        values = [points[n] if n in points else points[str(n)] for n in sizes]
        ax.plot(sizes, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda n, _: size_label(n)))
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("GB/s (2 x size / round trip)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def size_label(nbytes):
    """Returns a byte count as text in binary units, e.g. "4 MiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes:g} B"
