#!/usr/bin/env bash
# deploy/compose/cluster-reshard.sh -- `make cluster-reshard`: a job moved from 2 servers to 3
# mid-training ends with the same bits as one that never moved, all from the image
# $TENSORKV_IMAGE (default tensorkv:dev, already built), in plain containers on a network of
# this run's own (nothing is published on the host), each reachable there by its short name:
#   moved:   servers a-0, a-1; two workers train examples/train.py STEPS rounds and stop; the
#            new servers b-0, b-1, b-2 start empty; `tensorkv reshard --from a-0,a-1 --to
#            b-0,b-1,b-2`; the workers start again on b-* with TENSORKV_IF_EXISTS=resume and
#            train STEPS more rounds;
#   unmoved: servers r-0, r-1; two workers train 2*STEPS rounds;
# then rank 0's fingerprints (train.py --fingerprint: SHA-256 of the weights and of the
# optimizer states) must be equal. The servers run as `make cluster`'s: dist_sync for 2
# workers, TLS and a token made for this run by deploy/secrets.sh, a state dir each.
# Every container, its volumes and the network are removed at the end, failed or not.
# Exit status 1 when a step failed, a container was still running after
# $TENSORKV_CLUSTER_TIMEOUT seconds (default 300), or the fingerprints differ.
# ENGINE (default podman; docker works too), TENSORKV_RESHARD_STEPS (STEPS, default 50).
set -euo pipefail
engine=${ENGINE:-podman}
image=${TENSORKV_IMAGE:-tensorkv:dev}
steps=${TENSORKV_RESHARD_STEPS:-50}
timeout=${TENSORKV_CLUSTER_TIMEOUT:-300}
here=$(cd "$(dirname "$0")" && pwd)
run=tensorkv-reshard-$$  # the network, and the prefix of the containers' names
work=$(mktemp -d) && secrets=$work/secrets
started=()
# Killed, not stopped: a shell or python that is a container's PID 1 ignores SIGTERM, and
# `rm -f` would wait out the stop timeout for each worker.
cleanup() {
    for name in "${started[@]}"; do
        "$engine" kill "$name" >/dev/null 2>&1 || true
        "$engine" rm -f -v "$name" >/dev/null 2>&1 || true
    done
    "$engine" network rm "$run" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# start NAME OPTION... IMAGE ARG...: a container in the background, NAME on the network. Its
# errors go to a file: the network's DNS server, which podman starts with the first container,
# keeps the stderr it was given (noise, and a pipe that would stay open after this script).
start() {
    local name=$1; shift
    started+=("$run-$name")
    "$engine" run -d --name "$run-$name" --network "$run" --network-alias "$name" "$@" >/dev/null \
        2>"$work/start.err" || { cat "$work/start.err" >&2; return 1; }
}
server() {
    start "$1" -v "$secrets:/tensorkv/secrets:ro" "$image" --tls-cert secrets/server.crt --tls-key secrets/server.key \
        --token-file secrets/tokens --num-workers 2 --mode sync
}
# client NAME SERVERS COMMAND [OPTION...]: COMMAND (sh) with the CA and the workers' token, once
# every one of SERVERS answers the health check (120 tries, half a second apart)
client() {
    local name=$1 servers=$2 command=$3; shift 3
    start "$name" -v "$secrets/ca.crt:/tensorkv/secrets/ca.crt:ro" \
        -v "$secrets/worker-token:/tensorkv/secrets/worker-token:ro" \
        -e TENSORKV_SERVERS="$servers" -e TENSORKV_TLS_CA=secrets/ca.crt "$@" --entrypoint sh "$image" -c \
        "for i in \$(seq 120); do tensorkv health >/dev/null 2>&1 && break; sleep 0.5; done; $command"
}
# worker NAME SERVERS RANK TRAIN-ARGS [OPTION...]
worker() {
    local name=$1 servers=$2 rank=$3 args=$4; shift 4
    client "$name" "$servers" "TENSORKV_TOKEN=\$(cat secrets/worker-token) exec python examples/train.py $args" \
        -e TENSORKV_NUM_WORKERS=2 -e TENSORKV_RANK="$rank" "$@"
}
# finish NAME...: waits for each container to end and shows its output; fails unless all exited 0
finish() {
    local name status failed=0
    for name in "$@"; do
        status=$(timeout "$timeout" "$engine" wait "$run-$name") || status="none (still running after ${timeout} s)"
        echo "== $name"
        "$engine" logs "$run-$name" 2>&1 | tail -n 8
        [[ $status == 0 ]] || { echo "$name exit status: $status"; failed=1; }
    done
    return $failed
}
fingerprint() {
    "$engine" logs "$run-$1" 2>&1 | sed -n 's/^rank 0 fingerprint: //p'
}

started_at=$SECONDS
"$here/../secrets.sh" "$secrets" a-0 a-1 b-0 b-1 b-2 r-0 r-1
"$engine" network create "$run" >/dev/null
for name in a-0 a-1 r-0 r-1; do server "$name"; done
a=a-0:50051,a-1:50051 b=b-0:50051,b-1:50051,b-2:50051 r=r-0:50051,r-1:50051
for rank in 0 1; do
    worker "a-rank$rank" "$a" "$rank" "--steps $steps"
    worker "r-rank$rank" "$r" "$rank" "--steps $((2 * steps)) --fingerprint"
done
finish a-rank0 a-rank1
for name in b-0 b-1 b-2; do server "$name"; done
client reshard "$b" "exec tensorkv reshard --from $a --to $b --token-file secrets/worker-token"
finish reshard
for rank in 0 1; do
    worker "b-rank$rank" "$b" "$rank" "--steps $steps --fingerprint" -e TENSORKV_IF_EXISTS=resume
done
finish b-rank0 b-rank1 r-rank0 r-rank1
moved=$(fingerprint b-rank0) unmoved=$(fingerprint r-rank0)
echo "== fingerprints of rank 0 (SHA-256), after $((SECONDS - started_at)) s"
echo "moved 2 -> 3 servers: ${moved:-none}"
echo "never moved:          ${unmoved:-none}"
[[ -n $moved && $moved == "$unmoved" ]] || { echo "the moved run does not end with the unmoved run's bits"; exit 1; }
echo "the same bits"
