"""A dependency-free text progress bar written to stderr."""

import sys
import time


class Progress:
    """Counts finished steps out of `total` and redraws one stderr line.

    Use as a context manager, or call close() when done::

        with Progress(len(names), "refs") as bar:
            for name in names:
                bar.show(name)  # what is running now
                run(name)
                bar.step()
    """

    def __init__(self, total, label="", width=30, stream=None):
        self.total = max(1, int(total))
        self.label = label
        self.width = width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self._draw("")

    def show(self, note):
        """Redraws the bar with `note` after it, without counting a step."""
        self._draw(note)

    def step(self, note=""):
        """Marks one more step finished; `note` is shown after the bar."""
        self.done = min(self.total, self.done + 1)
        self._draw(note)

    def close(self):
        """Ends the bar's line."""
        self.stream.write("\n")
        self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _draw(self, note):
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self.start
        line = (f"\r{self.label} [{bar}] {self.done}/{self.total} "
                f"{elapsed:5.1f}s {note}")
        # Pad so a shorter note fully overwrites a longer previous one.
        self.stream.write(line.ljust(100))
        self.stream.flush()
