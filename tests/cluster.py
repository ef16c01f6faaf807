"""Real processes on 127.0.0.1, the way ps-lite's ``tests/local.sh S W`` runs them: S
``python -m tensorkv_server`` processes on free ports and W worker processes, every wait
bounded, each process stopped by its own PID (SIGTERM, then SIGKILL)."""
import contextlib
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

import tensorkv
from tensorkv.tools.launch import ended
from tensorkv.transport.security import Security
from tensorkv.wire import allocator

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
# Seconds a server gets to start serving: generous, as a loaded machine needs (it imports
# NumPy and gRPC twice: tensorkv.wire.allocator re-execs it), and bounded.
START_TIMEOUT = 120.0
PROBE_TIMEOUT = 5.0  # seconds a health probe of a starting server gets (a refused one fails at once)
STOP_TIMEOUT = 15.0  # seconds a process gets to exit after SIGTERM
WORKER_TIMEOUT = 90.0  # seconds a worker gets to finish
WAIT = 20.0  # seconds a wait_until condition gets to hold
CALL = 30.0  # seconds a call that is to be answered gets (with a value or a refusal)
PORT_TRIES = 3  # servers started on a port taken since free_port() picked it


def wait_until(condition, what, timeout=WAIT):
    """Poll ``condition()`` until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {timeout} s")
        time.sleep(0.05)


def _ended_alone(returncode):
    """How a process that no test stopped ended, in words (tensorkv.tools.launch.ended)."""
    if returncode == -signal.SIGKILL:
        return "was killed by SIGKILL (not by this test: by another process, or the kernel's OOM killer)"
    return ended(returncode)


def _state(pid):
    """The state of process ``pid`` as /proc says it (R running, S sleeping, T stopped, ...)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError as error:
        return f"unknown ({error.strerror})"


def _tail(log, lines=20):
    """The last ``lines`` lines of the open log file ``log``, as a message suffix (saying so if none)."""
    if log is None:
        return "; its log is not kept"
    log.flush()
    # pread: the file's offset is the server's too (its stdout), which may still be writing
    written = os.pread(log.fileno(), os.fstat(log.fileno()).st_size, 0).decode(errors="replace")
    text = "".join(written.splitlines(keepends=True)[-lines:])
    return f"; its log ends:\n{text}" if text else "; its log is empty"


BAND_PORTS = 16384  # free_port() picks below the ephemeral range, from this many ports


def _port_band():
    """(first, stop): the ports this process's free_port() picks from: BAND_PORTS below the
    kernel's ephemeral range (ip_local_port_range), from which bind(0) and outgoing connections
    take theirs (a server's data port, any client's socket), split between pytest-xdist's
    workers (make test runs 4), so that no port picked here is taken by another test's process
    before the server it is for binds it. None where there is no room below that range."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if low - BAND_PORTS < 1024:
        return None
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = BAND_PORTS // workers
    first = low - BAND_PORTS + worker * size
    return first, first + size


def _candidates():
    """The ports free_port() tries in turn: its band's, from a random one (another suite run on
    this host at once starts elsewhere), wrapping around, once each; then any (port 0)."""
    band = _port_band()
    if band is not None:
        first, stop = band
        start = random.randrange(first, stop)
        yield from range(start, stop)
        yield from range(first, start)
    while True:
        yield 0


_given = set()
_ports = _candidates()


def free_port():
    """A port free on 127.0.0.1 now, never given before in this process (two picks for one
    server, its --port and --metrics-port, must differ), in this process's band (_port_band)."""
    for candidate in _ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:  # taken, or still held by a closed server's connections (TIME_WAIT)
                continue
            port = sock.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port


def server_env():
    """The environment a Cluster's servers start in: this one's, with GLIBC_TUNABLES set as a
    server sets it when it re-execs itself (allocator.reexec_with_tunables), so that it runs
    tuned without the re-exec, which imports NumPy, gRPC and tensorkv a second time: half of
    a server's start, most of the suite's CPU time. A server told how to tune (either
    variable set) is left to do so itself; test_server's malloc test starts ones that re-exec."""
    if "TENSORKV_NO_MALLOC_TUNING" in os.environ or not allocator.wanted():
        return dict(os.environ)
    return {**os.environ, "GLIBC_TUNABLES": allocator.SERVER_TUNABLES}


def rss(pid):
    """The resident memory of process ``pid``, in bytes (VmRSS)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def stop(process, timeout=STOP_TIMEOUT):
    """SIGTERM ``process`` (by its PID), SIGKILL it if still alive after ``timeout``; its return code."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
    return process.returncode


def health(address, service="tensorkv.v1.KVStoreService", timeout=5.0, security=Security()):
    """The health status name of ``service`` on ``address`` (reached with ``security``)."""
    with security.channel(address, ()) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class Cluster:
    """S servers for ``num_workers`` workers; ``addresses`` and ``env`` (TENSORKV_SERVERS) for
    workers. Use as a context manager, or call :meth:`stop`. ``security``: how the health
    probe reaches servers started with TLS. '{index}' in ``server_args`` is each server's index
    (e.g. its own --state-dir)."""

    def __init__(self, servers=1, num_workers=1, mode="sync", round_timeout=30.0, tmp_path=None, server_args=(),
                 security=Security()):
        self.num_workers = num_workers
        self.addresses, self.processes, self.logs, self.commands, self._envs = [], [], [], [], []
        self._held = []  # sockets that keep the ports of killed servers (see kill)
        self._server_args, self._security = server_args, security
        self._mode, self._round_timeout = mode, round_timeout
        log_dir = Path(tmp_path) if tmp_path else None
        try:
            for i in range(servers):
                # a file either way: a server that exits at start is reported with its log
                self.logs.append(open(log_dir / f"server{i}.log", "w+") if log_dir else tempfile.TemporaryFile("w+"))
                self.commands.append(None)
                self._envs.append(None)
                self.processes.append(None)
                self.addresses.append(None)
                self._start(i)
            for i in range(servers):
                self._wait_started(i)
        except BaseException:
            self.stop()
            raise

    def _start(self, index):
        """Start server ``index`` on a newly picked free port, its log emptied (of a start that failed)."""
        port = free_port()
        self.logs[index].seek(0)
        self.logs[index].truncate()
        self.commands[index] = [
            sys.executable, "-m", "tensorkv_server", "--port", str(port), "--num-workers", str(self.num_workers),
            "--mode", self._mode, "--round-timeout", str(self._round_timeout), "--device", "cpu", "--grace", "2",
            *(str(arg).replace("{index}", str(index)) for arg in self._server_args)]
        self._envs[index] = server_env()
        self.processes[index] = subprocess.Popen(self.commands[index], env=self._envs[index], stdout=self.logs[index],
                                                 stderr=subprocess.STDOUT)
        self.addresses[index] = f"127.0.0.1:{port}"

    def _wait_started(self, index, tries=PORT_TRIES):
        """Wait until server ``index`` serves. A free port can be taken between free_port() and
        the server's bind (by a process outside this test run): a server that could not listen
        on its --port is started again on another one; ``tries`` starts in all."""
        for _ in range(tries - 1):
            port = self.addresses[index].rsplit(":", 1)[1]
            try:
                self._wait_serving(self.addresses[index], self.processes[index], self._security, self.logs[index])
                return
            except RuntimeError as error:
                if f"--port {port}: " not in str(error):
                    raise
            self._start(index)
        self._wait_serving(self.addresses[index], self.processes[index], self._security, self.logs[index])

    @staticmethod
    def _wait_serving(address, process, security=Security(), log=None):
        """Wait until the server ``process`` at ``address`` serves, START_TIMEOUT s at most: one
        that exits meanwhile, or is still not serving then (it is stopped first), fails with
        how it ended and the end of its ``log``."""
        started = time.monotonic()
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server {address} {_ended_alone(process.returncode)} while starting, "
                                   f"{time.monotonic() - started:.1f} s after it was started{_tail(log)}")
            try:
                if health(address, timeout=PROBE_TIMEOUT, security=security) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > started + START_TIMEOUT:
                state = _state(process.pid)
                stop(process)
                raise TimeoutError(f"server {address} did not start serving within {START_TIMEOUT:g} s (its state "
                                   f"then: {state}); stopped (SIGTERM, SIGKILL {STOP_TIMEOUT:g} s later), it "
                                   f"{ended(process.returncode)}{_tail(log)}")
            time.sleep(0.05)

    def kill(self, index=0):
        """SIGKILL server ``index`` (by its PID) and keep its port bound, not listening, until
        stop(): connections to it are refused, and no other process on this host (another
        test's server) can take the port while a client still tries to reconnect to it."""
        self.processes[index].kill()
        self.processes[index].wait(STOP_TIMEOUT)
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", int(self.addresses[index].rsplit(":", 1)[1])))
        self._held.append(held)

    def restart(self, index=0):
        """Kill server ``index`` (SIGKILL, by its PID) and start it again on the same port."""
        self.processes[index].kill()
        self.processes[index].wait(STOP_TIMEOUT)
        self.processes[index] = subprocess.Popen(self.commands[index], env=self._envs[index], stdout=self.logs[index],
                                                 stderr=subprocess.STDOUT)
        self._wait_serving(self.addresses[index], self.processes[index], self._security, self.logs[index])

    @property
    def env(self):
        return {**os.environ, "TENSORKV_SERVERS": ",".join(self.addresses), "PYTHONUNBUFFERED": "1"}

    def start_worker(self, script, *args, env=None):
        """Start ``tests/workers/<script>.py args...`` as a worker process."""
        return subprocess.Popen([sys.executable, str(WORKERS / f"{script}.py"), *map(str, args)],
                                env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def run_workers(self, script, *args, count=None, timeout=WORKER_TIMEOUT, env=None):
        """Run ``count`` (default num_workers) workers at once, with ``env`` added to their
        environment; [(returncode, stdout, stderr)]."""
        workers = [self.start_worker(script, *args, env=env) for _ in range(count or self.num_workers)]
        deadline = time.monotonic() + timeout
        results = []
        for worker in workers:
            try:
                out, err = worker.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop(worker)
                out, err = worker.communicate()
                err += f"\n[worker killed after {timeout} s]"
            results.append((worker.returncode, out, err))
        return results

    def stop(self):
        """Stop every server; their return codes."""
        codes = [stop(process) for process in self.processes if process is not None]
        for held in self._held:
            held.close()
        for log in self.logs:
            log.close()
        return codes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def rank_1_after_a_round(address):
    """A dist_sync store of rank 1 on the two-worker server at ``address``, after one round
    with a rank 0 that then closed its store: key 'w' holds 3 (1 + 2). The caller closes it."""
    kv1 = tensorkv.create("dist_sync", servers=address, rank=1)
    try:
        with tensorkv.create("dist_sync", servers=address, rank=0) as kv0:
            for kv in (kv0, kv1):
                kv.init("w", np.zeros(4, np.float32))
                kv.push("w", np.full(4, kv.rank + 1.0, np.float32))
    except BaseException:
        kv1.close()
        raise
    return kv1


def check_workers(results):
    """Assert every worker exited 0, showing their output otherwise; their stdouts."""
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"worker {rank} exited {code}\nstdout:\n{out}\nstderr:\n{err}"
    return [out for _, out, _ in results]


ANSWER = 30.0  # seconds a worker gets to answer a command
ANSWERS = ("ready", "pushed", "value ", "error ")  # how driven.py's answers start


class DrivenWorker:
    """A worker process (tests/workers/driven.py) with rank ``rank``, driven line by line; its
    stdout lines through a queue."""

    def __init__(self, cluster, rank, env=None):
        self.process = subprocess.Popen(
            [sys.executable, str(WORKERS / "driven.py")],
            env={**cluster.env, "TENSORKV_RANK": str(rank), **(env or {})},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready")

    def _read(self):
        for line in self.process.stdout:
            if line.startswith(ANSWERS):  # not a log line
                self.lines.put(line.rstrip("\n"))

    def send(self, command):
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def expect(self, start=""):
        """The next line, which must start with ``start``."""
        try:
            line = self.lines.get(timeout=ANSWER)
        except queue.Empty:
            raise AssertionError(f"worker {self.process.pid}: no answer within {ANSWER} s") from None
        assert line.startswith(start), line
        return line

    def call(self, command, start=""):
        self.send(command)
        return self.expect(start)

    def close(self):
        """Close the store; the exit code."""
        self.send("close")
        self.process.stdin.close()
        return self.process.wait(STOP_TIMEOUT)

    def stop(self):
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a paused worker must run to exit on SIGTERM
        stop(self.process)


@contextlib.contextmanager
def one_worker_store(kind, tmp_path, servers=1, **options):
    """A 'local' store, or (``kind`` 'dist_sync') rank 0 of one worker on ``servers`` real
    servers, made with ``options``."""
    if kind == "local":
        with tensorkv.create("local") as store:
            yield store
        return
    with Cluster(servers=servers, num_workers=1, tmp_path=tmp_path) as cluster, \
            tensorkv.create(kind, servers=cluster.addresses, **options) as store:
        yield store
