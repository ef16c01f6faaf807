"""Counts in messages as a user writes them: "1 worker", "2 workers", "16 GiB"."""


def plural(count, noun):
    """``count`` and ``noun``, the noun with an "s" unless there is exactly one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def size(nbytes):
    """``nbytes`` in the largest binary unit it fills, to a tenth: "512 bytes", "64 KiB", "12.8 GiB"."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        tenths = f"{nbytes / (1 << shift):.1f}"
        if float(tenths) >= 1:  # 1048535 bytes: "1 MiB", not "1024 KiB"
            return tenths.removesuffix(".0") + f" {unit}"
    return plural(nbytes, "byte")
