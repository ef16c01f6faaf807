#!/usr/bin/env bash
# deploy/compose/cluster-reshard.sh -- `make cluster-reshard`: a job moved from 2 servers to 3
# and then to 1 mid-training ends with the same bits as one that never moved, all from the image
# $TENSORKV_IMAGE (default tensorkv:dev, already built), in plain containers on a network of
# this run's own (nothing is published on the host), each reachable there by its short name:
#   moved:   servers a-0, a-1; two workers train examples/train.py STEPS rounds and stop;
#            `tensorkv reshard --from a-0,a-1 --to b-0,b-1,b-2` (servers started empty); the
#            workers start again on b-* with TENSORKV_IF_EXISTS=resume, train STEPS rounds and
#            stop; `tensorkv reshard --from b-0,b-1,b-2 --to c-0`; the workers start again on
#            c-0 and train STEPS rounds;
#   unmoved: servers r-0, r-1; two workers train 3*STEPS rounds;
# then rank 0's fingerprints (train.py --fingerprint: SHA-256 of the weights and of the
# optimizer states) must be equal. Both jobs train with Adam (per-key update counts and two
# states move) and TENSORKV_BIGARRAY_BOUND=4, so that the 8 weights are sliced over the servers
# and each move slices them again. The servers run as `make cluster`'s: dist_sync for 2
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
# `rm -f` would wait out the stop timeout for each worker. Signals are ignored meanwhile (by
# the engine's commands too): a second Ctrl-C would otherwise end it and leave the rest running.
cleanup() {
    trap '' INT TERM
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
# client NAME SERVERS COMMAND [OPTION...]: COMMAND (sh) with the CA, the workers' token and the
# bigarray bound, once every one of SERVERS answers the health check (120 tries, half a second apart)
client() {
    local name=$1 servers=$2 command=$3; shift 3
    start "$name" -v "$secrets/ca.crt:/tensorkv/secrets/ca.crt:ro" \
        -v "$secrets/worker-token:/tensorkv/secrets/worker-token:ro" \
        -e TENSORKV_SERVERS="$servers" -e TENSORKV_TLS_CA=secrets/ca.crt -e TENSORKV_BIGARRAY_BOUND=4 "$@" \
        --entrypoint sh "$image" -c \
        "for i in \$(seq 120); do tensorkv health >/dev/null 2>&1 && break; sleep 0.5; done; $command"
}
# worker NAME SERVERS RANK TRAIN-ARGS [OPTION...]: examples/train.py with Adam
worker() {
    local name=$1 servers=$2 rank=$3 args=$4; shift 4
    client "$name" "$servers" \
        "TENSORKV_TOKEN=\$(cat secrets/worker-token) exec python examples/train.py --optimizer adam $args" \
        -e TENSORKV_NUM_WORKERS=2 -e TENSORKV_RANK="$rank" "$@"
}
# reshard NAME FROM TO: `tensorkv reshard` in container NAME, waited for
reshard() {
    client "$1" "$3" "exec tensorkv reshard --from $2 --to $3 --token-file secrets/worker-token"
    finish "$1"
}
# resume NAME-PREFIX SERVERS TRAIN-ARGS: the two workers started again on SERVERS
resume() {
    local rank
    for rank in 0 1; do worker "$1-rank$rank" "$2" "$rank" "$3" -e TENSORKV_IF_EXISTS=resume; done
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
"$here/../secrets.sh" "$secrets" a-0 a-1 b-0 b-1 b-2 c-0 r-0 r-1
"$engine" network create "$run" >/dev/null
for name in a-0 a-1 b-0 b-1 b-2 c-0 r-0 r-1; do server "$name"; done
a=a-0:50051,a-1:50051 b=b-0:50051,b-1:50051,b-2:50051 c=c-0:50051 r=r-0:50051,r-1:50051
for rank in 0 1; do
    worker "a-rank$rank" "$a" "$rank" "--steps $steps"
    worker "r-rank$rank" "$r" "$rank" "--steps $((3 * steps)) --fingerprint"
done
finish a-rank0 a-rank1
reshard reshard-to-b "$a" "$b"
resume b "$b" "--steps $steps"
finish b-rank0 b-rank1
reshard reshard-to-c "$b" "$c"
resume c "$c" "--steps $steps --fingerprint"
finish c-rank0 c-rank1 r-rank0 r-rank1
moved=$(fingerprint c-rank0) unmoved=$(fingerprint r-rank0)
echo "== fingerprints of rank 0 (SHA-256), after $((SECONDS - started_at)) s"
echo "moved 2 -> 3 -> 1 servers: ${moved:-none}"
echo "never moved:               ${unmoved:-none}"
[[ -n $moved && $moved == "$unmoved" ]] || { echo "the moved run does not end with the unmoved run's bits"; exit 1; }
echo "the same bits"
