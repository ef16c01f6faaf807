"""deploy/compose (`make cluster`, run where podman is: see .ci/run): the compose file's
servers and workers agree with each other, with the server's flags and with the names the
certificate is made for, without a container engine."""
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
