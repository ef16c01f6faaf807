"""deploy/compose (`make cluster` and `make cluster-reshard`, run where podman is: see
.ci/run): the compose file's servers and workers, and cluster-reshard.sh's, agree with each
other, with the server's flags and with the names the certificate is made for, without a
container engine."""
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "compose"
SERVICES = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
SERVERS = {name: s for name, s in SERVICES.items() if name.startswith("server-")}
WORKERS = {name: s for name, s in SERVICES.items() if name.startswith("worker-")}


def _flag(service, flag):
    command = service["command"]
    return command[command.index(flag) + 1]


def test_two_servers_and_two_workers_with_distinct_ranks():
    assert len(SERVERS) == 2 and len(WORKERS) == 2
    assert sorted(int(w["environment"]["TENSORKV_RANK"]) for w in WORKERS.values()) == [0, 1]
    for worker in WORKERS.values():
        assert worker["environment"]["TENSORKV_NUM_WORKERS"] == str(len(WORKERS))
        assert worker["environment"]["TENSORKV_SERVERS"] == ",".join(f"{name}:50051" for name in sorted(SERVERS))
    assert {_flag(s, "--num-workers") for s in SERVERS.values()} == {str(len(WORKERS))}


def test_servers_use_tls_and_a_token_and_keep_state_on_volumes_of_their_own():
    for server in SERVERS.values():
        assert "--insecure" not in server["command"]
        assert {_flag(server, f) for f in ("--tls-cert", "--tls-key", "--token-file")} == {
            "secrets/server.crt", "secrets/server.key", "secrets/tokens"}
    state_volumes = [v.split(":")[0] for s in SERVERS.values() for v in s["volumes"] if v.endswith(":/var/lib/tensorkv")]
    assert len(set(state_volumes)) == len(SERVERS)


def test_the_certificate_names_every_server():
    secrets_call = re.search(r'secrets\.sh" "\$TENSORKV_SECRETS" (.*)', (DEPLOY / "cluster.sh").read_text())
    assert set(secrets_call.group(1).split()) == set(SERVERS)


def test_the_reshard_certificate_names_every_server_it_starts():
    """cluster-reshard.sh (`make cluster-reshard`): the servers it starts are the names of the
    certificate and those its workers and `tensorkv reshard` are given."""
    script = (DEPLOY / "cluster-reshard.sh").read_text()
    named = set(re.search(r'secrets\.sh" "\$secrets" (.*)', script).group(1).split())
    started = {name for names in re.findall(r'for name in ([\w -]+); do server "\$name"', script)
               for name in names.split()}
    lists = re.search(r"^a=(\S+) b=(\S+) c=(\S+) r=(\S+)$", script, re.MULTILINE).groups()
    addressed = {address.removesuffix(":50051") for servers in lists for address in servers.split(",")}
    assert named == started == addressed and len(named) == 8
