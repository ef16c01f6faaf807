"""What the bench scripts share: loopback ports, stopping processes, workers that measure on
command, medians, GB/s, and the command line and result files of the scripts `make bench`
runs after run.py."""
import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time

STOP_TIMEOUT = 5.0  # seconds to wait after terminate, then after kill


def free_port():
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(proc):
    """Stop one process by its PID: terminate, then kill after a timeout."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_TIMEOUT)


def tail(path, lines=30):
    """The last lines of a log file, or '' if it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def spawn_on_command(cmd, env, log_path):
    """A process of ``cmd`` that measures on command (:func:`ask`, :func:`serve_commands`),
    its stderr in ``log_path``."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0)
    proc.log = log_path
    return proc


def ask(procs, command, timeout):
    """Send ``command`` (a dict) to each of ``procs`` (:func:`spawn_on_command`) at once, then
    each one's answer (a dict, one line), all waited for together until ``timeout`` seconds
    from now. RuntimeError, with the process's log, for one that exited, did not answer in
    time or answered something else."""
    line = (json.dumps(command) + "\n").encode()
    for proc in procs:
        try:
            proc.stdin.write(line)
        except BrokenPipeError:
            raise _failed(proc, "exited before answering", command) from None
    deadline = time.monotonic() + timeout
    received = {proc: b"" for proc in procs}
    waiting = list(procs)
    while waiting:
        ready, _, _ = select.select([proc.stdout for proc in waiting], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            exited = [proc for proc in waiting if proc.poll() is not None]  # the cause, when one of them is gone
            raise _failed((exited or waiting)[0], "exited before answering" if exited else
                          f"did not answer within {timeout:.0f}s", command)
        for proc in [proc for proc in waiting if proc.stdout in ready]:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise _failed(proc, "exited before answering", command)
            received[proc] += chunk
            if chunk.endswith(b"\n"):
                waiting.remove(proc)
    answers = []
    for proc in procs:
        try:
            answers.append(json.loads(received[proc]))
        except ValueError:
            raise _failed(proc, f"answered {received[proc][:200]!r}, not one JSON line,", command) from None
    return answers


def _failed(proc, what, command):
    return RuntimeError(f"{' '.join(map(str, proc.args[:3]))} ... (pid {proc.pid}) {what} {command}\n"
                        f"{tail(proc.log)}")


def wait_ready(procs, timeout):
    """Wait until each of ``procs`` (:func:`spawn_on_command`) has started: it answers ``{}``."""
    ask(procs, {}, timeout)


def serve_commands(start):
    """In a process of :func:`spawn_on_command`: ``start()`` gives ``answer``; then
    ``answer(command)`` (a dict) for each command read on stdin, written back as one line,
    until stdin closes; ``{}`` is answered ``{}`` once ``start`` returned (:func:`wait_ready`).
    Whatever else writes to stdout (a library's messages, from ``start`` on) goes to stderr."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    answer = start()
    for line in sys.stdin:
        command = json.loads(line)
        replies.write(json.dumps(answer(command) if command else {}) + "\n")  # {}: ready?
        replies.flush()


def stop_on_command(procs):
    """Close the stdin of each of ``procs`` (its last command) and stop it by its PID."""
    for proc in procs:
        try:
            proc.stdin.close()
        except OSError:
            pass
        proc.stdout.close()
    deadline = time.monotonic() + STOP_TIMEOUT
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        stop(proc)


def median_time(fn, repeats, warmup=1):
    """Call fn warmup+repeats times; the median seconds per call."""
    return statistics.median(times(fn, repeats, warmup))


def times(fn, repeats, warmup=1):
    """Call fn warmup+repeats times; the seconds of each timed call."""
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def p99(seconds):
    """The 99th percentile of ``seconds`` (the nearest rank)."""
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def gbps(nbytes, seconds):
    """GB/s of a round trip that moves nbytes each way."""
    return 2 * nbytes / seconds / 1e9


def parse_args(doc, argv):
    """``--quick`` and ``--out-dir`` (default <repository>/bench-results) of a bench script
    whose module docstring is ``doc``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats in place of 10")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                          "bench-results"))
    return parser.parse_args(argv)


def write_results(args, name, text, numbers):
    """Print the Markdown ``text``; write it to <out-dir>/<name>.md and ``numbers`` to
    <out-dir>/<name>.json (<name>-quick.* with --quick)."""
    print(text)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, name + ("-quick" if args.quick else ""))
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(numbers, f, indent=2)


def run_ratio_bench(doc, argv, name, measure, repeats, failure, markdown, ratio, goal, met):
    """The main of a bench script that times rows against a reference row: ``measure(repeats,
    logdir)`` -> ({row: median seconds}, values checked ok) (``repeats[0]`` with --quick, else
    ``repeats[1]``); exit status 2 after printing ``failure`` when a value was wrong; else the
    results written (:func:`write_results`) with ``markdown(medians, command)`` and
    ``ratio(medians)``, which ``met(ratio)`` compares with ``goal``. Exit status 0."""
    args = parse_args(doc, argv)
    command = f"python bench/{name}.py" + (" --quick" if args.quick else "")
    with tempfile.TemporaryDirectory() as logdir:
        medians, ok = measure(repeats[0] if args.quick else repeats[1], logdir)
    if not ok:
        print(f"{name} bench FAILED: {failure}", file=sys.stderr)
        return 2
    value = ratio(medians)
    write_results(args, name, markdown(medians, command), {
        "command": command, "ms": {n: s * 1e3 for n, s in medians.items()}, "ratio": value, "goal": goal,
        "goal_met": met(value)})
    return 0
