"""tensorkv-launch with real processes: servers and workers started, their output prefixed,
a worker's failure propagated, everything stopped on Ctrl-C (checked by PID), and the
command lines of the ssh launcher."""
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tensorkv.tools import launch

from cluster import WORKERS, free_port, stop, wait_until
from test_security import TOKEN, Pki

LAUNCH = Path(sys.executable).with_name("tensorkv-launch")  # the console script pip installed
TIMEOUT = 90.0


class Launcher:
    """tensorkv-launch ARGS... as a real process, its output read as it comes."""

    def __init__(self, *args, env=None, cwd=None):
        self.process = subprocess.Popen([str(LAUNCH), "--grace", "5", *map(str, args)], env=env, cwd=cwd,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.lines = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def pids(self, role):
        """The PIDs of the ``role`` processes it reported starting so far."""
        return [int(pid) for pid in re.findall(rf"^\[launch\] {role} \d+: pid (\d+):", self.output, re.MULTILINE)]

    @property
    def output(self):
        return "".join(self.lines)

    def finish(self):
        """(exit code, output), the launcher stopped by its PID if it overruns."""
        try:
            self.process.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            stop(self.process)
            pytest.fail(f"tensorkv-launch still running after {TIMEOUT} s:\n{self.output}")
        finally:
            self._reader.join(TIMEOUT)
        return self.process.returncode, self.output


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def started_pids(launcher, tmp_path):
    """The PIDs of every process the launcher started (it prints them) and of the workers' children."""
    pids = set(launcher.pids("server") + launcher.pids("worker"))
    for pid_file in tmp_path.glob("worker*.pids"):
        pids.update(int(pid) for pid in pid_file.read_text().split())
    return pids


def test_runs_sync_rounds_to_the_end_with_prefixed_output():
    launcher = Launcher("-n", 2, "-s", 2, sys.executable, WORKERS / "sync_rounds.py", 5)
    code, out = launcher.finish()
    assert code == 0, out
    assert "[worker 0] ok 0" in out.splitlines() and "[worker 1] ok 1" in out.splitlines(), out
    assert re.search(r"^\[server 0\] .*serving tensorkv", out, re.MULTILINE), out
    serving = out.index("[launch] job tensorkv-")  # printed once every server answered its health check
    assert serving < out.index("[launch] worker 0: pid") and serving < out.index("[launch] worker 1: pid"), out
    assert re.search(r"^\[server 1\] .*stopped$", out, re.MULTILINE), out
    assert not [pid for pid in started_pids(launcher, Path("/nonexistent")) if alive(pid)]


def test_a_failing_worker_stops_the_job_with_its_exit_code(tmp_path):
    launcher = Launcher("-n", 2, "-s", 1, sys.executable, WORKERS / "launched.py", tmp_path, "fail")
    code, out = launcher.finish()
    assert code == 3, out
    assert "[launch] worker 1 exited with 3: stopping the job" in out, out
    pids = started_pids(launcher, tmp_path)
    assert len(pids) == 1 + 2 * 2, out  # the server, each worker and its child
    assert [pid for pid in pids if alive(pid)] == [], out


def test_a_server_that_cannot_start_fails_the_job_before_any_worker():
    launcher = Launcher("-n", 1, "--server-args", "--num-workers 0", sys.executable, "-c", "print('never')")
    code, out = launcher.finish()
    assert code == 2, out  # argparse's exit code for the bad flag
    assert "[launch] server 0 exited with 2 before serving" in out and "[launch] worker" not in out, out


def test_server_args_may_be_one_flag_and_a_missing_command_is_said_in_one_line():
    launcher = Launcher("-n", 1, "--server-args", "--log-format=json", "./no-such-worker.py")
    code, out = launcher.finish()
    assert code == 127, out  # the shell's code for a command not found
    assert re.search(r'^\[server 0\] \{"time"', out, re.MULTILINE), out  # its flag reached the server
    assert "[launch] worker 0: cannot start ./no-such-worker.py: No such file or directory" in out, out
    assert "Traceback" not in out and not [pid for pid in launcher.pids("server") if alive(pid)], out
    assert launch.parse_args(["-n", "1", "--server-args", "--no-shared-memory", "python", "--server-args", "x"]) \
        .server_args == "--no-shared-memory"


def test_servers_with_tls_and_tokens_are_health_checked_with_the_workers_credentials(tmp_path):
    """The health check opened a plaintext channel: a server given --tls-cert never answered
    it, and the job failed after --start-timeout."""
    pki = Pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    server_args = shlex.join([*pki.server_args(mutual=True), "--token-file", str(tokens)])
    env = {**os.environ, **pki.env(), "TENSORKV_TOKEN": TOKEN}
    launcher = Launcher("-n", 2, "-s", 2, "--start-timeout", 60, "--server-args", server_args,
                        sys.executable, WORKERS / "sync_rounds.py", 3, env=env)
    code, out = launcher.finish()
    assert code == 0, out
    assert "[worker 0] ok 0" in out.splitlines() and "[worker 1] ok 1" in out.splitlines(), out
    assert re.search(r"^\[server 0\] .*mutual TLS, tokens", out, re.MULTILINE), out


def running_job(tmp_path, *args):
    """A launcher of 2 servers and 2 sleeping tests/workers/launched.py workers, once both workers run."""
    launcher = Launcher("-n", 2, "-s", 2, *args, sys.executable, WORKERS / "launched.py", tmp_path, "sleep")
    try:
        wait_until(lambda: len(list(tmp_path.glob("worker*.pids"))) == 2 or launcher.process.poll() is not None,
                   "both workers running", timeout=60)
    except BaseException:
        stop(launcher.process)
        raise
    return launcher


def test_ctrl_c_leaves_no_process_behind(tmp_path):
    launcher = running_job(tmp_path, "--job", "ctrl-c")
    launcher.process.send_signal(signal.SIGINT)
    code, out = launcher.finish()
    assert code == 128 + signal.SIGINT, out
    assert "[worker 0] started 0 ctrl-c" in out and "[worker 1] started 1 ctrl-c" in out, out
    pids = started_pids(launcher, tmp_path)
    assert len(pids) == 2 + 2 * 2, out
    assert [pid for pid in pids if alive(pid)] == [], out


def test_a_dying_server_stops_the_job(tmp_path):
    launcher = running_job(tmp_path)
    os.kill(launcher.pids("server")[1], signal.SIGKILL)
    code, out = launcher.finish()
    assert code == 128 + signal.SIGKILL, out
    assert "[launch] server 1 was killed by SIGKILL while workers run: stopping the job" in out, out
    assert [pid for pid in started_pids(launcher, tmp_path) if alive(pid)] == [], out


def test_ssh_command_lines_for_a_hostfile(tmp_path):
    # No ssh hosts here: this checks the command lines the ssh launcher would run.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1\n\nnode2:2222\n")
    args = launch.parse_args(["--launcher", "ssh", "-H", str(hostfile), "-n", "2", "-s", "1", "--mode", "async",
                              "--port", "9000", "--job", "j1", "--server-args", "--round-timeout 5",
                              "python", "train.py", "--epochs", "2"])
    addresses, launches = launch.ssh_plan(args, launch.read_hostfile(hostfile), "/home/me/run dir")
    assert addresses == ["node1:9000"]
    ssh = ["ssh", "-tt", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-p"]
    assert [(l.role, l.rank, l.argv[:-1]) for l in launches] == [
        ("server", 0, ssh + ["22", "node1"]),
        ("worker", 0, ssh + ["2222", "node2"]),
        ("worker", 1, ssh + ["22", "node1"]),
    ]
    env = "exec env PYTHONUNBUFFERED=1"
    assert [l.argv[-1] for l in launches] == [
        f"cd '/home/me/run dir' && {env} TENSORKV_JOB=j1 tensorkv-server --host node1 --port 9000 "
        "--num-workers 2 --mode async --round-timeout 5",
        f"cd '/home/me/run dir' && {env} TENSORKV_SERVERS=node1:9000 TENSORKV_RANK=0 TENSORKV_NUM_WORKERS=2 "
        "TENSORKV_JOB=j1 python train.py --epochs 2",
        f"cd '/home/me/run dir' && {env} TENSORKV_SERVERS=node1:9000 TENSORKV_RANK=1 TENSORKV_NUM_WORKERS=2 "
        "TENSORKV_JOB=j1 python train.py --epochs 2",
    ]
    assert shlex.split(launches[1].argv[-1])[-4:] == ["python", "train.py", "--epochs", "2"]


def test_local_plan_sets_the_worker_environment():
    args = launch.parse_args(["-n", "2", "--job", "j2", "python", "train.py"])
    addresses, launches = launch.local_plan(args)
    assert len(addresses) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)  # -s defaults to -n
    workers = [l for l in launches if l.role == "worker"]
    assert [(l.env["TENSORKV_SERVERS"], l.env["TENSORKV_RANK"], l.env["TENSORKV_NUM_WORKERS"], l.env["TENSORKV_JOB"])
            for l in workers] == [(",".join(addresses), "0", "2", "j2"), (",".join(addresses), "1", "2", "j2")]
    assert all(l.argv == ["python", "train.py"] for l in workers)


def test_ssh_launcher_runs_its_command_lines(tmp_path):
    # A stand-in `ssh` that runs the remote command with sh on this machine, so the command
    # lines the ssh launcher builds are run for real (quoting, cd, environment, health check).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text('#!/bin/sh\nfor last; do :; done\nexec /bin/sh -c "$last"\n')
    (bin_dir / "ssh").chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    code, out = Launcher("--launcher", "ssh", "-H", hostfile, "--port", free_port(), "-n", 2, "-s", 1,
                         sys.executable, WORKERS / "sync_rounds.py", 3, env=env, cwd=tmp_path).finish()
    assert code == 0, out
    assert "[worker 0] ok 0" in out.splitlines() and "[worker 1] ok 1" in out.splitlines(), out
