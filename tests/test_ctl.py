"""The operator CLI, ``tensorkv``, as a process against real servers: two servers holding
the keys of a two-worker dist_sync job (one key sliced over both), while the job runs and
after; then one server killed; then TLS and tokens."""
import json
import subprocess
import sys

import numpy as np
import pytest

import tensorkv
from tensorkv.transport.security import Security

from cluster import WORKER_TIMEOUT, Cluster, check_workers, wait_until
from test_security import READ_ONLY_TOKEN, TOKEN, Pki

# One pytest-xdist worker runs this module (make test's --dist loadgroup): its tests share one
# job, which the last of them ends by killing a server, and which another worker would start again.
pytestmark = pytest.mark.xdist_group("test_ctl")

LEASE_MS = 10_000  # the servers' --lease-timeout
# The values the job leaves, as its pushes (no optimizer: the sum of the last round's pushes).
WEIGHT = (np.arange(3000, dtype=np.float32).reshape(60, 50) * 1 / 7 - 2) + \
         (np.arange(3000, dtype=np.float32).reshape(60, 50) * 2 / 7 - 2)
BIAS = np.array([-1.5, 0.0, 2.0, 4.0]) * 2 + np.array([-1.5, 0.0, 2.0, 4.0]) * 3


def ctl(*args, servers, env=None):
    """(exit status, stdout, stderr) of ``tensorkv --servers SERVERS args...``."""
    done = subprocess.run([sys.executable, "-m", "tensorkv.tools.ctl", "--servers", ",".join(servers), *args],
                          capture_output=True, text=True, timeout=60, env=env)
    return done.returncode, done.stdout, done.stderr


def ctl_json(*args, servers, env=None):
    code, out, err = ctl("-o", "json", *args, servers=servers, env=env)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Two servers, and a two-worker job that pushed its rounds and is still registered."""
    tmp_path = tmp_path_factory.mktemp("ctl")
    stop_file = tmp_path / "stop"
    with Cluster(servers=2, num_workers=2, tmp_path=tmp_path, server_args=["--lease-timeout", str(LEASE_MS / 1000)]) \
            as cluster:
        workers = [cluster.start_worker("ctl_job", tmp_path, stop_file, env={"TENSORKV_BIGARRAY_BOUND": "1000"})
                   for _ in range(2)]
        try:
            wait_until(lambda: all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)), "both workers ready",
                       timeout=WORKER_TIMEOUT)
            yield cluster, workers, stop_file
        finally:
            stop_file.touch()
            for worker in workers:
                worker.communicate(timeout=WORKER_TIMEOUT)


def test_status_shows_every_server(job):
    cluster, _, _ = job
    code, out, err = ctl("status", servers=cluster.addresses)
    assert code == 0 and err == ""
    header, *rows = out.splitlines()
    assert header.split() == ["server", "mode", "workers", "ranks", "keys", "run", "job", "optimizer", "version",
                              "lease_ttl_ms", "expired_leases", "server_id", "restored_from", "snapshot", "routes"]
    # the job's values are small: its calls go on the data channel, which each rank's session opened
    assert [row.split()[:4] + row.split()[5:8] + row.split()[9:11] + row.split()[12:] for row in rows] == [
        [address, "sync", "2/2", "0,1", "1", "-", "-", str(LEASE_MS), "0", "off", "0:data-channel,1:data-channel"]
        for address in cluster.addresses]
    assert sorted(int(row.split()[4]) for row in rows) == [1, 2]  # weight on both, bias on one
    infos = ctl_json("status", servers=cluster.addresses)
    assert [info["server"] for info in infos] == cluster.addresses
    assert [info["registered_ranks"] for info in infos] == [[0, 1], [0, 1]]
    assert [info["mode"] for info in infos] == ["MODE_SYNC", "MODE_SYNC"]
    assert sum(int(info["num_keys"]) for info in infos) == 3  # weight on both, bias on one


def test_keys_lists_shapes_slices_and_updates(job):
    cluster, _, _ = job
    rows = ctl_json("keys", servers=cluster.addresses)
    weight = sorted((row for row in rows if row["key"] == "weight"), key=lambda row: row["slice"])
    assert [(row["dtype"], row["shape"], row["updates"]) for row in weight] == [("float32", [60, 50], 2)] * 2
    assert [row["slice"] for row in weight] == ["0:1500", "1500:3000"]
    assert {row["server"] for row in weight} == set(cluster.addresses)
    [bias] = [row for row in rows if row["key"] == "bias"]
    assert (bias["dtype"], bias["shape"], bias["slice"], bias["updates"]) == ("float64", [4], "-", 2)
    code, out, _ = ctl("keys", servers=cluster.addresses)
    assert code == 0 and out.splitlines()[0].split() == ["server", "key", "dtype", "shape", "slice", "updates"]
    assert f"{bias['server']}  bias    float64  4      -          2" in out


def test_get_stats_of_a_sliced_key(job):
    cluster, _, _ = job
    [row] = ctl_json("get", "weight", "--stats", servers=cluster.addresses)
    values = WEIGHT.astype(np.float64)
    assert (row["shape"], row["dtype"], sorted(row["servers"])) == ([60, 50], "float32", sorted(cluster.addresses))
    expected = (values.min(), values.max(), values.mean())
    assert (row["min"], row["max"], row["mean"]) == pytest.approx(expected, rel=1e-12)
    assert row["l2_norm"] == pytest.approx(np.linalg.norm(values), rel=1e-12)
    assert "values" not in row
    code, out, _ = ctl("get", "weight", "--stats", servers=cluster.addresses)
    assert code == 0 and out.splitlines()[0].split() == ["key", "dtype", "shape", "servers", "updates", "min", "max",
                                                         "mean", "l2_norm"]
    assert f"{values.max():.6g}" in out.splitlines()[1]


def test_get_values_only_when_asked(job):
    cluster, _, _ = job
    [row] = ctl_json("get", "bias", servers=cluster.addresses)
    assert "values" not in row and "min" not in row
    [row] = ctl_json("get", "bias", "--values", servers=cluster.addresses)
    assert row["values"] == BIAS.tolist()
    code, out, _ = ctl("get", "weight", "--values", servers=cluster.addresses)  # 60 x 50: one row of the table
    header, row = out.splitlines()
    assert code == 0 and row.split()[-1] == "]]" and header.split()[-1] == "values", out
    code, _, err = ctl("get", "nothing", servers=cluster.addresses)
    assert code == 1 and err == "tensorkv: no server that answered holds key 'nothing'\n"


def test_options_go_before_or_after_the_command(job):
    cluster, _, _ = job
    servers = ",".join(cluster.addresses)
    after = subprocess.run([sys.executable, "-m", "tensorkv.tools.ctl", "get", "bias", "--values", "--servers", servers,
                            "-o", "json"], capture_output=True, text=True, timeout=60)
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout) == ctl_json("get", "bias", "--values", servers=cluster.addresses)
    code, out, _ = ctl("get", "bias", "--values", servers=cluster.addresses)  # the values on the row's line
    assert code == 0 and len(out.splitlines()) == 2 and out.rstrip().endswith("[-7.5  0.  10.  20. ]")


def test_health_and_workers(job):
    cluster, _, _ = job
    assert ctl_json("health", servers=cluster.addresses) == [
        {"server": address, "status": "SERVING"} for address in cluster.addresses]
    rows = ctl_json("workers", servers=cluster.addresses)
    assert [(row["server"], row["run"], row["rank"]) for row in rows] == [
        (address, 1, rank) for address in cluster.addresses for rank in (0, 1)]
    for row in rows:  # the lease fields of Info.workers, as plain numbers
        assert row["incarnation"] > 0 and 0 <= row["ms_since_renewal"] < LEASE_MS
    assert {row["route"] for row in rows} == {"data-channel"}
    code, out, _ = ctl("workers", servers=cluster.addresses)
    assert code == 0 and out.splitlines()[0].split() == ["server", "run", "rank", "incarnation", "ms_since_renewal",
                                                         "route"]


def test_reset_is_refused_while_the_job_runs(job):
    cluster, _, _ = job
    code, out, err = ctl("reset", servers=cluster.addresses)
    assert code == 1 and out == ""
    assert err.splitlines() == [f"tensorkv: server {address}: cannot reset while run 1 is registered (ranks [0, 1]): "
                                "reset once every worker has closed its store" for address in cluster.addresses]
    assert sum(int(info["num_keys"]) for info in ctl_json("status", servers=cluster.addresses)) == 3


def test_a_killed_server_is_named_and_the_other_still_reported(job):
    """Runs last of the module's tests on the job: the job ends, then server 1 is killed."""
    cluster, workers, stop_file = job
    stop_file.touch()
    check_workers([(worker.wait(WORKER_TIMEOUT), "", "") for worker in workers])
    cluster.processes[1].kill()
    cluster.processes[1].wait(10)
    code, out, err = ctl("status", servers=cluster.addresses)
    assert code == 1
    assert [line.split()[0] for line in out.splitlines()[1:]] == [cluster.addresses[0]]
    assert err == (f"tensorkv: cannot connect to server {cluster.addresses[1]}: the connection was refused "
                   f"(nothing listens on that port); is tensorkv-server running on {cluster.addresses[1]}?\n")
    refused = (f"cannot connect to server {cluster.addresses[1]}: the connection was refused (nothing listens on "
               f"that port); is tensorkv-server running on {cluster.addresses[1]}?")
    code, out, err = ctl("-o", "json", "health", servers=cluster.addresses)
    assert code == 1 and json.loads(out) == [{"server": cluster.addresses[0], "status": "SERVING"},
                                             {"server": cluster.addresses[1], "error": refused}]
    code, out, err = ctl("-o", "json", "status", servers=cluster.addresses[::-1])  # in the order asked
    assert code == 1 and [row["server"] for row in json.loads(out)] == cluster.addresses[::-1]
    assert json.loads(out)[0] == {"server": cluster.addresses[1], "error": refused}
    code, out, err = ctl("snapshot", "save", servers=cluster.addresses[:1])
    assert code == 1 and err == (f"tensorkv: server {cluster.addresses[0]}: this server has no --state-dir: "
                                 "it cannot take snapshots\n")
    dropped = ctl_json("reset", servers=cluster.addresses[:1])  # the job is over: allowed
    assert dropped[0]["keys_dropped"] in (1, 2)
    assert ctl_json("keys", servers=cluster.addresses[:1]) == []
    assert ctl("keys", servers=cluster.addresses[:1])[:2] == (0, "(no keys)\n")
    assert ctl("workers", servers=cluster.addresses[:1])[:2] == (0, "(no workers)\n")


def test_usage_errors_exit_2(monkeypatch):
    monkeypatch.delenv("TENSORKV_SERVERS", raising=False)
    done = subprocess.run([sys.executable, "-m", "tensorkv.tools.ctl", "status"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no servers: pass --servers HOST:PORT,... or set TENSORKV_SERVERS" in done.stderr
    code, _, err = ctl("frobnicate", servers=["127.0.0.1:1"])
    assert code == 2 and "invalid choice: 'frobnicate'" in err
    code, out, _ = ctl("--help", servers=["127.0.0.1:1"])
    assert code == 0 and "exit status:" in out and "1  a server could not be reached" in out
    code, _, err = ctl("status", servers=["127.0.0.1"])
    assert code == 2 and "'127.0.0.1' is not a server address host:port: no port: write e.g. '127.0.0.1:50051'" in err
    code, _, err = ctl("--timeout", "0", "status", servers=["127.0.0.1:1"])
    assert code == 2 and "--timeout must be positive, not 0" in err


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`tensorkv keys | head`: the rest of a listing longer than the pipe holds finds the pipe
    closed, which ends the command quietly (it ended in a BrokenPipeError traceback)."""
    with Cluster(tmp_path=tmp_path) as cluster:
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:
            keys = [f"layer_{i:04d}_" + "w" * 100 for i in range(2000)]
            kv.init(keys, [np.zeros(1, np.float32)] * len(keys))
        done = subprocess.run(f"{sys.executable} -m tensorkv.tools.ctl --servers {cluster.addresses[0]} keys | head -c 1",
                              shell=True, capture_output=True, text=True, timeout=60)
    assert done.stdout == "s" and done.stderr == ""  # the first letter of the header, "server"


def test_tls_and_tokens(tmp_path):
    pki = Pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n{READ_ONLY_TOKEN} ro\n")
    with Cluster(tmp_path=tmp_path, server_args=[*pki.server_args(), "--token-file", str(tokens)],
                 security=Security(pki.ca_file)) as cluster:
        tls = ["--tls-ca", pki.ca_file]
        read_only = tmp_path / "read-only-token"
        read_only.write_text(f"{READ_ONLY_TOKEN}\n")
        assert ctl_json(*tls, "--token-file", str(read_only), "keys", servers=cluster.addresses) == []
        assert ctl_json(*tls, "health", servers=cluster.addresses)[0]["status"] == "SERVING"  # needs no token
        code, _, err = ctl(*tls, "status", servers=cluster.addresses)
        assert code == 1 and "this server requires a token" in err
        code, _, err = ctl(*tls, "--token-file", str(read_only), "reset", servers=cluster.addresses)
        assert code == 1 and "a read-only token may call only Info, Pull, GetOptimizerStates, ListKeys and ReadKey, " \
                             "not Reset" in err
        # a token on the command line would be in the process list for every local user
        code, _, err = ctl(*tls, "--token", TOKEN, "status", servers=cluster.addresses)
        assert code == 2 and "--token would show the token to every user of this host (in the process list): put " \
                             "it in a file only you can read and pass --token-file FILE, or set TENSORKV_TOKEN" in err
        code, _, err = ctl(*tls, "--token-file", str(tmp_path / "absent"), "status", servers=cluster.addresses)
        assert code == 2 and f"--token-file {tmp_path / 'absent'}: cannot read it" in err
        env = {**cluster.env, "TENSORKV_TLS_CA": pki.ca_file, "TENSORKV_TOKEN": TOKEN}
        assert ctl_json("reset", servers=cluster.addresses, env=env) == [
            {"server": cluster.addresses[0], "keys_dropped": 0}]
        code, _, err = ctl("status", servers=cluster.addresses)  # plaintext to a TLS port
        assert code == 1 and f"server {cluster.addresses[0]} uses TLS and this client does not: pass tls_ca= " \
                             "(TENSORKV_TLS_CA; the CLI: --tls-ca)" in err
