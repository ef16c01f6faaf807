"""What the bench scripts share: loopback ports, stopping processes, medians, GB/s."""
import socket
import statistics
import subprocess
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


def median_time(fn, repeats, warmup=1):
    """Call fn warmup+repeats times; the median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(nbytes, seconds):
    """GB/s of a round trip that moves nbytes each way."""
    return 2 * nbytes / seconds / 1e9
