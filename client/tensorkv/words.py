"""Counts in messages as a user writes them: "1 worker", "2 workers"."""


def plural(count, noun):
    """``count`` and ``noun``, the noun with an "s" unless there is exactly one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
