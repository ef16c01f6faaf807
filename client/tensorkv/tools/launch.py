"""``tensorkv-launch``: start a job's servers and workers together, as MXNet's ``tools/launch.py``.

``tensorkv-launch -n 2 -s 2 python train.py`` starts 2 ``tensorkv-server`` processes on free
loopback ports, waits until each answers its health check, then runs ``python train.py``
twice with ``TENSORKV_SERVERS``, ``TENSORKV_RANK``, ``TENSORKV_NUM_WORKERS`` and
``TENSORKV_JOB`` set, so that ``tensorkv.create('dist_sync')`` needs no arguments. Every
line a process prints comes out prefixed with its role and rank (``[worker 1] ...``).

The launcher exits with the first non-zero exit code of a worker (128 + N for a worker
killed by signal N), or of a server that dies (1 if it exited 0); then, on Ctrl-C
(SIGINT) or SIGTERM, and once every worker has exited 0 (exit code 0), it stops every
process it started: SIGTERM to each one's process group, SIGKILL to the groups after
``--grace`` seconds.

``--launcher ssh -H hostfile`` runs the same processes through ``ssh`` on the hosts of the
file (one ``host`` or ``host:ssh_port`` a line, as dmlc-core's tracker reads it): servers
first, then workers, host after host in turn, server i listening on ``--port`` + i of its
host; each remote command ``cd``s to this directory and runs with the variables above.

Servers given TLS or tokens in ``--server-args`` are health-checked with the credentials the
workers get, ``TENSORKV_TLS_CA``, ``TENSORKV_TLS_CERT``, ``TENSORKV_TLS_KEY`` and
``TENSORKV_TOKEN`` (:class:`tensorkv.transport.security.Security`).
"""
import argparse
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import namedtuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..errors import KVStoreError
from ..transport.security import Security
from ..v1 import kvstore_pb2
from ..words import plural

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name
POLL = 0.05  # seconds between looks at the processes
# One process to start: its role ('server' or 'worker'), rank, argv and full environment.
Launch = namedtuple("Launch", "role rank argv env")


class Stop(Exception):
    """SIGINT or SIGTERM reached the launcher."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Failed(Exception):
    """A process of the job failed; ``code`` is the launcher's exit code."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="tensorkv-launch", description="Start tensorkv servers and workers together (MXNet's tools/launch.py).")
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers to run")
    parser.add_argument("-s", "--num-servers", type=int,
                        help="number of servers to start (default: as many as workers, as MXNet's)")
    parser.add_argument("--mode", choices=("sync", "async"), default="sync",
                        help="the servers' mode: dist_sync or dist_async (default %(default)s)")
    parser.add_argument("--launcher", choices=("local", "ssh"), default="local",
                        help="local: every process on this machine; ssh: on the hosts of -H (default %(default)s)")
    parser.add_argument("-H", "--hostfile", help="the ssh launcher's hosts, one 'host' or 'host:ssh_port' a line")
    parser.add_argument("--port", type=int, default=50051,
                        help="ssh launcher: server i listens on this port + i of its host (default %(default)s)")
    parser.add_argument("--server-args", default="",
                        help='more tensorkv-server flags, one string: --server-args "--round-timeout 120"')
    parser.add_argument("--job", help="the job's name, TENSORKV_JOB of every process (default: a random one)")
    parser.add_argument("--start-timeout", type=float, default=60.0,
                        help="seconds each server gets to answer its health check (default %(default)s)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds processes get to exit after SIGTERM before SIGKILL (default %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the worker's command line")
    args = parser.parse_args(_joined_server_args(sys.argv[1:] if argv is None else argv))
    if args.num_servers is None:
        args.num_servers = args.num_workers
    if args.num_workers < 1 or args.num_servers < 1:
        parser.error("-n and -s must be at least 1")
    if not args.command:
        parser.error("no command to run: tensorkv-launch -n 2 python train.py")
    if args.launcher == "ssh" and not args.hostfile:
        parser.error("--launcher ssh needs -H HOSTFILE")
    args.job = args.job or f"tensorkv-{secrets.token_hex(4)}"
    return args


def _joined_server_args(argv):
    """``argv`` with ``--server-args VALUE`` as ``--server-args=VALUE``, before the worker's
    command: argparse takes a VALUE that starts with '-' ("--no-shared-memory") for a flag.
    Every option of tensorkv-launch but -h takes a value."""
    joined, index = list(argv), 0
    while index < len(joined) and joined[index].startswith("-"):
        arg = joined[index]
        if arg == "--server-args" and index + 1 < len(joined):
            joined[index:index + 2] = [f"--server-args={joined[index + 1]}"]
        elif arg in ("-h", "--help") or "=" in arg or (not arg.startswith("--") and len(arg) > 2):
            index += 1  # no value, or one attached (--mode=sync, -n2)
        else:
            index += 2
    return joined


def free_port():
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_hostfile(path):
    """[(host, ssh port)] from a hostfile: one 'host' or 'host:port' a line, blank lines skipped."""
    hosts = []
    with open(path) as file:
        for line in file:
            host, _, port = line.strip().partition(":")
            if host:
                hosts.append((host, port or "22"))
    if not hosts:
        raise SystemExit(f"tensorkv-launch: {path} names no host")
    return hosts


def server_flags(args, host, port):
    return ["--host", host, "--port", str(port), "--num-workers", str(args.num_workers), "--mode", args.mode,
            *shlex.split(args.server_args)]


def worker_env(args, addresses, rank):
    return {"TENSORKV_SERVERS": ",".join(addresses), "TENSORKV_RANK": str(rank),
            "TENSORKV_NUM_WORKERS": str(args.num_workers), "TENSORKV_JOB": args.job}


def local_plan(args):
    """(server addresses, [Launch]) for every process on this machine, servers first."""
    ports = [free_port() for _ in range(args.num_servers)]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    servers = [Launch("server", i, [sys.executable, "-m", "tensorkv_server", *server_flags(args, "127.0.0.1", port)],
                      {**env, "TENSORKV_JOB": args.job}) for i, port in enumerate(ports)]
    workers = [Launch("worker", rank, list(args.command), {**env, **worker_env(args, addresses, rank)})
               for rank in range(args.num_workers)]
    return addresses, servers + workers


def ssh_plan(args, hosts, cwd):
    """(server addresses, [Launch]) running every process through ssh on ``hosts``."""
    placed = [hosts[i % len(hosts)] for i in range(args.num_servers + args.num_workers)]
    addresses = [f"{host}:{args.port + i}" for i, (host, _) in enumerate(placed[:args.num_servers])]
    launches = []
    for i, (host, ssh_port) in enumerate(placed):
        if i < args.num_servers:
            role, rank = "server", i
            command, env = ["tensorkv-server", *server_flags(args, host, args.port + i)], {"TENSORKV_JOB": args.job}
        else:
            role, rank = "worker", i - args.num_servers
            command, env = list(args.command), worker_env(args, addresses, rank)
        remote = (f"cd {shlex.quote(cwd)} && exec env PYTHONUNBUFFERED=1 "
                  + " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items()) + " "
                  + shlex.join(command))
        # -tt: the remote process gets SIGHUP when this ssh client is stopped, so stopping
        # the local process stops the remote one.
        argv = ["ssh", "-tt", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-p", ssh_port, host, remote]
        launches.append(Launch(role, rank, argv, None))
    return addresses, launches


class Job:
    """The processes of one job, each in its own process group, their output prefixed."""

    def __init__(self, grace, security):
        self.grace, self.security = grace, security
        self.processes = []  # [(Launch, Popen)]
        self._readers = []
        self._out_lock = threading.Lock()
        self._signum = None  # the SIGINT or SIGTERM received

    def catch_signals(self):
        """Record SIGINT and SIGTERM, for :meth:`check` to act on: raising from a handler could
        leave a process started and not recorded."""
        def record(signum, frame):
            self._signum = signum
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, record)

    def check(self):
        """Raise Stop once SIGINT or SIGTERM was received."""
        if self._signum is not None:
            raise Stop(self._signum)

    def start(self, launch):
        self.check()
        try:
            process = subprocess.Popen(launch.argv, env=launch.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as error:  # e.g. no such command
            self.say(f"{launch.role} {launch.rank}: cannot start {shlex.join(launch.argv)}: {error.strerror}")
            raise Failed(127 if isinstance(error, FileNotFoundError) else 126) from None
        self.processes.append((launch, process))
        self.say(f"{launch.role} {launch.rank}: pid {process.pid}: {shlex.join(launch.argv)}")
        reader = threading.Thread(target=self._relay, args=(f"[{launch.role} {launch.rank}] ", process.stdout),
                                  daemon=True)
        reader.start()
        self._readers.append(reader)
        return process

    def say(self, text):
        self._write(f"[launch] {text}\n".encode())

    def _write(self, data):
        with self._out_lock:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    def _relay(self, prefix, pipe):
        prefix = prefix.encode()
        for line in iter(pipe.readline, b""):
            self._write(prefix + line.rstrip(b"\r\n") + b"\n")
        pipe.close()

    def wait_serving(self, launch, process, address, timeout):
        """Return once the server at ``address`` answers SERVING; Failed if it exits or does
        not within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            channel = self.security.channel(address, ())
        except KVStoreError as error:  # e.g. a token that would cross the network in plaintext
            self.say(f"server {launch.rank} at {address}: {error}")
            raise Failed(1) from None
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if process.poll() is not None:
                    self.say(f"server {launch.rank} {ended(process.returncode)} before serving")
                    raise Failed(exit_code(process.returncode) or 1)
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                self.check()
                if time.monotonic() > deadline:
                    why = self.security.diagnose(address)  # a TLS mismatch is named as such
                    self.say(f"server {launch.rank} at {address} did not answer its health check within {timeout:g} s"
                             + (f": {why}" if why else ""))
                    raise Failed(1)
                time.sleep(POLL)

    def wait_workers(self):
        """0 once every worker has exited 0; else the first failure's exit code."""
        while True:
            running = False
            for launch, process in self.processes:
                code = process.poll()
                if launch.role == "server" and code is not None:
                    self.say(f"server {launch.rank} {ended(code)} while workers run: stopping the job")
                    return exit_code(code) or 1
                if launch.role == "worker" and code is None:
                    running = True
                elif launch.role == "worker" and code != 0:
                    self.say(f"worker {launch.rank} {ended(code)}: stopping the job")
                    return exit_code(code)
            if not running:
                self.say("every worker exited 0: stopping the servers")
                return 0
            self.check()
            time.sleep(POLL)

    def stop(self):
        """SIGTERM to every process group, SIGKILL to them all after ``grace`` seconds; reap."""
        self._signal_groups(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for _, process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Also the groups whose leader exited: a worker's own children are in its group.
        self._signal_groups(signal.SIGKILL)
        for _, process in self.processes:
            process.kill()  # by its PID too, in case it left its group
            process.wait()
        for reader in self._readers:
            reader.join(timeout=self.grace)

    def _signal_groups(self, signum):
        for _, process in self.processes:
            try:
                os.killpg(process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone (PermissionError: macOS says so for a group of zombies)


def ended(returncode):
    """How a process ended, in words: 'exited with 3', 'was killed by SIGKILL'."""
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with {returncode}"


def exit_code(returncode):
    """The shell's exit code for a Popen return code: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run(args):
    """Run the job of ``args``; its exit code."""
    if args.launcher == "ssh":
        addresses, launches = ssh_plan(args, read_hostfile(args.hostfile), os.getcwd())
    else:
        addresses, launches = local_plan(args)
    try:
        security = Security.from_options()  # the workers' TENSORKV_TLS_* and TENSORKV_TOKEN
    except KVStoreError as error:
        raise SystemExit(f"tensorkv-launch: {error}") from None
    job = Job(args.grace, security)
    job.catch_signals()
    try:
        servers = [launch for launch in launches if launch.role == "server"]
        for launch in servers:
            job.start(launch)
        for (launch, process), address in zip(list(job.processes), addresses):
            job.wait_serving(launch, process, address, args.start_timeout)
        job.say(f"job {args.job}: {plural(len(servers), 'server')} serving at {','.join(addresses)}")
        for launch in launches[len(servers):]:
            job.start(launch)
        return job.wait_workers()
    except Failed as failure:
        return failure.code
    except Stop as stop:
        job.say(f"{stop}: stopping the job")
        return 128 + stop.signum
    finally:
        job.stop()


def main(argv=None):
    sys.exit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
