"""bench/progress.py: a bar redrawn in place on a terminal, plain lines in a log."""
import io
import os
import pty
import re

from bench.progress import Progress


def run_bar(stream):
    with Progress(2, "refs", stream=stream) as bar:
        bar.show("first")
        bar.step("first done")
        bar.show("second")
        bar.step()


def test_off_a_terminal_each_finished_step_is_one_line():
    log = io.StringIO()
    run_bar(log)
    lines = log.getvalue().split("\n")
    assert "\r" not in log.getvalue() and lines[-1] == ""
    assert [re.sub(r" +\d+\.\ds", " _s", line) for line in lines[:-1]] == [
        "refs [###############---------------] 1/2 _s first done",
        "refs [##############################] 2/2 _s",
    ]


def _read_all(controller):
    """What the closed terminal of pty ``controller`` received: one read may return only part
    of it (the full suite's load splits it), so read until Linux says EIO (nothing left)."""
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_on_a_terminal_the_bar_is_redrawn_in_place():
    controller, terminal = pty.openpty()
    try:
        with open(terminal, "w") as stream:
            run_bar(stream)
        shown = _read_all(controller)
    finally:
        os.close(controller)
    assert shown.count("\rrefs [") == 5  # the start, two notes, two steps
    assert shown.endswith("\r\n")  # closed: the pty writes "\n" as "\r\n"
