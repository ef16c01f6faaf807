"""The ``tensorkv-server`` command as a user runs it: ports it may not share, its help and
version, and what it logs."""
import subprocess
import sys

import numpy as np
import pytest

import tensorkv

from cluster import Cluster

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
        assert f"{flag} {port}: port {port} on 127.0.0.1 is in use" in second.stderr
        assert "Traceback" not in second.stderr
        with tensorkv.create("dist_sync", servers=cluster.addresses) as kv:  # the first one still serves
            kv.init("w", np.zeros(2))
            kv.push("w", np.ones(2))
            assert kv.pull("w").tolist() == [1, 1]
