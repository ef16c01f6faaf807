"""examples/node, a client written from protos/ alone, runs MXNet's tutorial against a real
server and prints the tutorial's transcript (docs/protocol.md)."""
import hashlib
import shutil
import subprocess

import pytest

from cluster import ROOT, WORKER_TIMEOUT, Cluster

NODE_DIR = ROOT / "examples" / "node"
# node_modules is installed by `npm ci` once per package-lock.json: the stamp holds its hash.
STAMP = NODE_DIR / "node_modules" / ".package-lock.sha256"

# One pytest-xdist worker runs this module (make test's --dist loadgroup): two would run `npm ci`
# into the same node_modules at once.
pytestmark = [pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")), reason="needs node and npm"),
              pytest.mark.xdist_group("test_node_client")]


@pytest.fixture(scope="module")
def node_modules():
    lock = hashlib.sha256((NODE_DIR / "package-lock.json").read_bytes()).hexdigest()
    if not STAMP.exists() or STAMP.read_text() != lock:
        subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                       check=True, capture_output=True, timeout=300)
        STAMP.write_text(lock)


def expected_transcript():
    """MXNet's transcript without its "update on key" lines: the updater runs on the server."""
    lines = (ROOT / "tests" / "data" / "tutorial_expected.txt").read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("update on key"))


def run_tutorial(cluster):
    return subprocess.run(["node", str(NODE_DIR / "tutorial.js")], env=cluster.env, capture_output=True,
                          text=True, timeout=WORKER_TIMEOUT)


def test_node_tutorial_prints_mxnets_transcript(node_modules, tmp_path):
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        result = run_tutorial(cluster)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_transcript()


def test_node_tutorial_with_values_in_several_messages(node_modules, tmp_path, monkeypatch):
    """With 8-byte chunks on both sides, every 24-byte value travels in TensorFrame.more
    continuations, from the client (init, push) and from the server (pull)."""
    monkeypatch.setenv("TENSORKV_CHUNK_BYTES", "8")
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        result = run_tutorial(cluster)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_transcript()


def test_node_client_reports_the_error_class(node_modules, tmp_path):
    """A second worker on a one-worker server: FAILED_PRECONDITION, and the class name from
    the tensorkv-error trailing metadata."""
    with Cluster(num_workers=1, tmp_path=tmp_path) as cluster:
        script = ("const { Client } = require('./tensorkv');"
                  "(async () => { const a = new Client(process.env.TENSORKV_SERVERS); await a.register();"
                  "  try { await new Client(process.env.TENSORKV_SERVERS).register(); }"
                  "  catch (e) { console.log(`${e.code} ${e.name}: ${e.message}`); } await a.close(); })();")
        result = subprocess.run(["node", "-e", script], cwd=NODE_DIR, env=cluster.env, capture_output=True,
                                text=True, timeout=WORKER_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("9 FailedPreconditionError: every rank is taken: this server expects 1 worker "
                                    "(rank 0); their leases hold them: rank 0 by incarnation "), result.stdout
