"""A dependency-free text progress bar written to stderr: redrawn in place on a terminal, one
line per finished step otherwise (a log file gets no carriage returns)."""

import sys
import time


class Progress:
    """Counts finished steps out of `total`: redraws one stderr line on a terminal, else writes
    a line per finished step.

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
        self._tty = self.stream.isatty()
        self.show("")

    def show(self, note):
        """Redraws the bar with `note` after it, without counting a step (on a terminal only)."""
        if self._tty:
            self._write("\r" + self._line(note).ljust(100))  # padded over a longer previous note

    def step(self, note=""):
        """Marks one more step finished; `note` is shown after the bar."""
        self.done = min(self.total, self.done + 1)
        if self._tty:
            self.show(note)
        else:
            self._write(self._line(note).rstrip() + "\n")

    def close(self):
        """Ends the bar's line."""
        if self._tty:
            self._write("\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _line(self, note):
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self.start
        return f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note}"

    def _write(self, text):
        self.stream.write(text)
        self.stream.flush()
