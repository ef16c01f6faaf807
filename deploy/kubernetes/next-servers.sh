#!/bin/sh
# deploy/kubernetes/next-servers.sh NAME COUNT DIR -- for a move of the job to COUNT new servers
# (tensorkv reshard; docs/operations.md, "On Kubernetes"): a copy of deploy/kubernetes in DIR
# whose servers are the StatefulSet NAME of COUNT replicas behind the Service NAME (server i is
# NAME-i.NAME:50051, told apart from the first servers by the label app.kubernetes.io/instance:
# NAME), and whose Job's workers, and their wait-for-servers init container, name those
# servers, the workers with TENSORKV_IF_EXISTS=resume to go on with the run moved there.
set -eu
name=$1 count=$2 dir=$3
here=$(dirname "$0")
mkdir -p "$dir"
cp "$here/workers.yaml" "$dir/"
sed -e "s/^  name: tensorkv\$/  name: $name/" -e "s/^  serviceName: tensorkv\$/  serviceName: $name/" \
    -e "s|app.kubernetes.io/component: server}|app.kubernetes.io/component: server, app.kubernetes.io/instance: $name}|" \
    "$here/server.yaml" >"$dir/server.yaml"
servers=$(i=0; while [ "$i" -lt "$count" ]; do
    [ "$i" -eq 0 ] || printf ,
    printf '%s-%d.%s:50051' "$name" "$i" "$name"
    i=$((i + 1))
done)
sed -e "s/^- name: tensorkv\$/- name: $name/" -e "s/^  count: [0-9]*\$/  count: $count/" \
    -e "s/{kind: StatefulSet, name: tensorkv}/{kind: StatefulSet, name: $name}/" \
    -e "s/value: \"tensorkv-[0-9]*\.tensorkv:50051[^\"]*\"}/value: \"$servers\"}/" \
    "$here/kustomization.yaml" >"$dir/kustomization.yaml"
# the Job's patch is the last: one more operation in it
echo "    - {op: add, path: /spec/template/spec/containers/0/env/-, value: {name: TENSORKV_IF_EXISTS, value: resume}}" \
    >>"$dir/kustomization.yaml"
