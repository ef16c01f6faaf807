#!/usr/bin/env bash
# deploy/image-smoke.sh ENGINE IMAGE PYTHON -- `make image-smoke`: the image's server as its
# documented command runs it (all addresses, TLS and a token from read-only mounted secrets,
# made here by deploy/secrets.sh), on free ports of the host network; then, with PYTHON's
# tensorkv: the health check (no token), MXNet's tutorial and `tensorkv status` over TLS with
# the token, a metrics scrape, and a SIGTERM stop that must end the server with status 0.
set -euo pipefail
engine=$1 image=$2 py=$3
bin=$(dirname "$py")
secrets=$(mktemp -d)
read -r port data_port metrics_port < <("$py" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
name=tensorkv-smoke-$port
cleanup() { "$engine" rm -f -v "$name" >/dev/null 2>&1 || true; rm -rf "$secrets"; }  # -v: the VOLUME's
trap cleanup EXIT

"$(dirname "$0")/secrets.sh" "$secrets"
"$engine" run -d --name "$name" --network=host -v "$secrets:/tensorkv/secrets:ro" "$image" \
    --port "$port" --data-port "$data_port" --metrics-port "$metrics_port" \
    --tls-cert secrets/server.crt --tls-key secrets/server.key --token-file secrets/tokens \
    --num-workers 1 --mode sync >/dev/null

export TENSORKV_SERVERS=127.0.0.1:$port TENSORKV_TLS_CA=$secrets/ca.crt
for _ in $(seq 60); do "$bin/tensorkv" health >/dev/null 2>&1 && break; sleep 0.5; done
echo "== tensorkv health (no token)"
"$bin/tensorkv" health || { "$engine" logs "$name"; exit 1; }
export TENSORKV_TOKEN; TENSORKV_TOKEN=$(cat "$secrets/worker-token")
echo "== examples/tutorial_dist.py over TLS with the token"
"$py" examples/tutorial_dist.py
echo "== tensorkv status"
"$bin/tensorkv" status
echo "== http://127.0.0.1:$metrics_port/metrics (tensorkv_ and grpc_server_handled_total lines)"
curl -fsS "http://127.0.0.1:$metrics_port/metrics" | grep -E '^(tensorkv_(keys|pushes_total|pulls_total|rounds_total)|grpc_server_handled_total)' \
    | grep -E 'tensorkv_|grpc_method="(Push|Pull|Info)"'
echo "== $engine stop"
"$engine" stop -t 10 "$name" >/dev/null
status=$("$engine" inspect --format '{{.State.ExitCode}}' "$name")
echo "server exited with status $status"
[[ $status == 0 ]]
