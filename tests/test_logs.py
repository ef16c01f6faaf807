"""--log-format json: every line a server writes is a JSON object with the fixed fields, and
its lifecycle events carry their rank, key, round and peer."""
import json

from cluster import Cluster, check_workers

FIELDS = {"time", "level", "event", "rank", "key", "round", "peer", "logger", "message"}


def test_json_lines_of_a_register_and_an_aborted_round(tmp_path):
    """tests/workers/abort.py on a 2-worker sync server: rank 0 pushes "x", rank 1 never
    does, so round 1 of "x" is aborted after --round-timeout 1."""
    with Cluster(num_workers=2, round_timeout=1, tmp_path=tmp_path, server_args=("--log-format", "json")) as cluster:
        check_workers(cluster.run_workers("abort"))
    lines = (tmp_path / "server0.log").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for record in records:
        assert FIELDS <= record.keys(), record
    events = [record for record in records if record["event"]]
    names = [record["event"] for record in events]
    assert names[0] == "server_started" and names[-2:] == ["server_stopping", "server_stopped"], names

    registered = [record for record in events if record["event"] == "worker_registered"]
    assert sorted(record["rank"] for record in registered) == [0, 1]
    for record in registered:
        assert record["level"] == "INFO" and record["peer"].startswith("ipv4:127.0.0.1:"), record
    [aborted] = [record for record in events if record["event"] == "round_aborted"]
    assert (aborted["level"], aborted["key"], aborted["round"], aborted["rank"]) == ("WARNING", "x", 1, None)
    assert "missing ranks [1]" in aborted["message"]


def test_text_lines_by_default(tmp_path):
    with Cluster(tmp_path=tmp_path):
        pass
    lines = (tmp_path / "server0.log").read_text().splitlines()
    assert lines and not any(line.startswith("{") for line in lines)
    assert any(" INFO " in line and ": serving tensorkv.v1.KVStoreService on 127.0.0.1:" in line for line in lines)
