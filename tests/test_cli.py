"""The ``tensorkv-server`` command as a user runs it: ports it may not share, its help and
version, and what it logs."""
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorkv

from cluster import Cluster, stop, wait_until

EXIT_BOUND = 5.0  # seconds a server that cannot start gets to exit


def run_server(*args, timeout=EXIT_BOUND):
    """``python -m tensorkv_server args...`` run to its end (killed after ``timeout`` s)."""
    return subprocess.run([sys.executable, "-m", "tensorkv_server", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flag", ["--port", "--data-port"])
def test_a_port_in_use_stops_a_second_server_at_once(tmp_path, flag):
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        port = cluster.addresses[0].rsplit(":", 1)[1]
        if flag == "--port":
            second = run_server("--port", port)
        else:
            second = run_server("--port", "0", "--data-port", port)
        assert second.returncode != 0
        assert second.stderr.splitlines() == [
            f"tensorkv-server: {flag} {port}: port {port} on 127.0.0.1 is in use by another process "
            "(another tensorkv-server?)"]
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:  # the first one still serves
            kv.init("w", np.zeros(2))
            kv.push("w", np.ones(2))
            assert kv.pull("w").tolist() == [1, 1]


def test_the_data_port_cannot_be_the_grpc_port():
    result = run_server("--port", "50051", "--data-port", "50051")
    assert result.returncode == 2 and result.stderr.endswith("error: --data-port must differ from --port\n")


@pytest.mark.parametrize("flag", ["--max-key-bytes", "--max-value-bytes", "--max-keys-per-call",
                                  "--max-inflight-bytes", "--max-memory"])
def test_a_limit_must_be_positive(flag):
    result = run_server(flag, "0")
    assert result.returncode == 2 and result.stderr.endswith(f"error: {flag} must be at least 1\n"), result.stderr


def test_help_gives_every_flag_its_text_and_default():
    result = run_server("--help")
    assert result.returncode == 0, result.stderr
    options = result.stdout.split("\noptions:\n", 1)[1]
    entries = {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in re.split(r"\n  (?=-)", options)}
    assert set(entries) >= {"-h", "--host", "--port", "--num-workers", "--mode", "--round-timeout", "--grace",
                            "--device", "--no-shared-memory", "--data-port", "--no-data-channel", "--log-level",
                            "--version", "--max-key-bytes", "--max-value-bytes", "--max-keys-per-call",
                            "--max-inflight-bytes", "--max-memory", "--tls-cert", "--tls-key", "--tls-client-ca",
                            "--token-file", "--insecure"}
    for flag, entry in entries.items():
        if flag not in ("-h", "--version"):
            assert "(default" in entry, entry


def test_version_is_tensorkvs():
    result = run_server("--version")
    assert (result.returncode, result.stdout) == (0, f"tensorkv-server {tensorkv.__version__}\n")


CONSOLE_SCRIPT = Path(sys.executable).with_name("tensorkv-server")


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "tensorkv_server"],
    pytest.param([str(CONSOLE_SCRIPT)], marks=pytest.mark.skipif(not CONSOLE_SCRIPT.exists(),
                                                                 reason="tensorkv is not installed")),
], ids=["python -m", "console script"])
@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_start_up_logs_in_one_hierarchy_whatever_the_entry_point(tmp_path, command, level):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([*command, "--port", "0", "--device", "cpu", "--log-level", level],
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "serving" in log.read_text(), "the server's start")
    finally:
        assert stop(server) == 0
    records = [re.fullmatch(r"\S+ \S+ (\w+) (\S+): (.*)", line).groups() for line in log.read_text().splitlines()]
    names = {name for _, name, _ in records}
    # tensorkv_server.main warns at every level: "no --state-dir: nothing survives a restart"
    assert {name for name in names if "tensorkv" in name or "main" in name} == {"tensorkv_server.server",
                                                                               "tensorkv_server.main"}
    tunables = [(level_name, name) for level_name, name, message in records if message.startswith("GLIBC_TUNABLES=")]
    assert tunables == ([("DEBUG", "tensorkv_server.main")] if level == "DEBUG" else [])
    serving = next(message for _, _, message in records if message.startswith("serving"))
    assert ": 1 worker, sync mode," in serving
