#!/usr/bin/env bash
# deploy/compose/cluster.sh -- `make cluster`: compose.yaml's two servers and two workers from
# the image $TENSORKV_IMAGE (default tensorkv:dev, already built), with secrets made for this
# run by deploy/secrets.sh; prints each worker's output and exit status, then the servers'
# `tensorkv status`, and tears it all down (volumes and the network too). Exit status 1 when a
# worker failed, did not finish within $TENSORKV_CLUSTER_TIMEOUT seconds (default 300), or
# status failed.
# ENGINE (default podman) and COMPOSE (default podman-compose; `docker compose` works too).
set -euo pipefail
engine=${ENGINE:-podman}
compose=${COMPOSE:-podman-compose}
here=$(cd "$(dirname "$0")" && pwd)
export TENSORKV_IMAGE=${TENSORKV_IMAGE:-tensorkv:dev}
TENSORKV_SECRETS=$(mktemp -d); export TENSORKV_SECRETS
timeout=${TENSORKV_CLUSTER_TIMEOUT:-300}
project=tensorkv-cluster
in_compose() { $compose -p "$project" -f "$here/compose.yaml" "$@"; }
# The workers' containers go first, with the anonymous volumes of the image's VOLUME, and the
# project's network last (podman-compose 1.0.3's `down -v` leaves both behind; docker compose's
# removes the network, and the rm then finds none).
cleanup() {
    "$engine" rm -f -v tensorkv-worker-0 tensorkv-worker-1 >/dev/null 2>&1 || true
    in_compose down -v -t 10 >/dev/null 2>&1 || true
    "$engine" network rm "${project}_default" >/dev/null 2>&1 || true
    rm -rf "$TENSORKV_SECRETS"
}
trap cleanup EXIT

"$here/../secrets.sh" "$TENSORKV_SECRETS" server-0 server-1
in_compose up -d >"$TENSORKV_SECRETS/up.log" 2>&1 || { cat "$TENSORKV_SECRETS/up.log"; exit 1; }
failed=0
for worker in worker-0 worker-1; do
    status=$(timeout "$timeout" "$engine" wait "tensorkv-$worker") || status="none (still running after ${timeout} s)"
    echo "== $worker"
    "$engine" logs "tensorkv-$worker" 2>&1 | tail -n 3
    echo "$worker exit status: $status"
    [[ $status == 0 ]] || failed=1
done
echo "== tensorkv status"
"$engine" exec -e TENSORKV_SERVERS=server-0:50051,server-1:50051 -e TENSORKV_TLS_CA=secrets/ca.crt tensorkv-server-0 \
    sh -c 'TENSORKV_TOKEN=$(cat secrets/worker-token) exec tensorkv status' || failed=1
exit $failed
