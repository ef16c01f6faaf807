"""deploy/kubernetes: every manifest, and the kustomization as rendered, is valid against the
Kubernetes 1.31 schemas (kubernetes-validate bundles them: no cluster, no network), and the
manifests agree with each other and with the server's flags."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.kustomize import render

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.31.0"


def _documents(name):
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


@pytest.mark.parametrize("document", [doc for name in ("server.yaml", "workers.yaml") for doc in _documents(name)]
                         + render(DEPLOY), ids=lambda doc: f"{doc['kind']}/{doc['metadata']['name']}")
def test_manifests_are_valid_against_the_kubernetes_schemas(document):
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_a_misspelled_field_is_refused():
    """The validation is strict: an unknown field fails (it is not silently dropped)."""
    statefulset = next(doc for doc in _documents("server.yaml") if doc["kind"] == "StatefulSet")
    statefulset["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module")
def rendered():
    by_kind = {doc["kind"]: doc for doc in render(DEPLOY)}
    assert sorted(by_kind) == ["Job", "PodDisruptionBudget", "Service", "StatefulSet"]
    return by_kind


def _env(container):
    return {var["name"]: var for var in container["env"]}


def _option(args, flag):
    return args[args.index(flag) + 1]


def test_service_selects_the_servers_and_names_their_ports(rendered):
    service, statefulset = rendered["Service"], rendered["StatefulSet"]
    pod = statefulset["spec"]["template"]
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # The worker pods carry other labels: the Service does not select them.
    worker_labels = rendered["Job"]["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= worker_labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(container_ports)
    # The ports the image's entrypoint gives the server (Dockerfile) are the container's.
    entrypoint = next(line for line in (DEPLOY.parent.parent / "Dockerfile").read_text().splitlines()
                      if line.startswith("ENTRYPOINT"))
    assert container_ports == {"grpc": 50051, "data": 50052, "metrics": 50053}
    for flag, name in (("--port", "grpc"), ("--data-port", "data"), ("--metrics-port", "metrics")):
        assert f'"{flag}", "{container_ports[name]}"' in entrypoint
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(container_ports["metrics"])


def test_no_voluntary_eviction_takes_a_server(rendered):
    """A node drain must not take a server of a running job without an operator: the budget
    selects exactly the servers' pods and allows none of them to be evicted (its comment says
    how to drain: a snapshot, then the pod deleted)."""
    budget, statefulset = rendered["PodDisruptionBudget"], rendered["StatefulSet"]
    assert budget["spec"]["selector"] == statefulset["spec"]["selector"]
    assert budget["spec"]["selector"]["matchLabels"] == statefulset["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["maxUnavailable"] == 0 and "minAvailable" not in budget["spec"]
    workers = rendered["Job"]["spec"]["template"]["metadata"]["labels"]
    assert not budget["spec"]["selector"]["matchLabels"].items() <= workers.items()
    assert "tensorkv snapshot save" in (DEPLOY / "server.yaml").read_text()


def test_servers_and_workers_agree_on_the_counts(rendered):
    statefulset, job = rendered["StatefulSet"], rendered["Job"]
    name, service = statefulset["metadata"]["name"], rendered["Service"]["metadata"]["name"]
    servers = statefulset["spec"]["replicas"]
    worker = job["spec"]["template"]["spec"]["containers"][0]
    env = _env(worker)
    assert env["TENSORKV_SERVERS"]["value"].split(",") == [f"{name}-{i}.{service}:50051" for i in range(servers)]
    workers = job["spec"]["completions"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["parallelism"] == workers
    assert env["TENSORKV_NUM_WORKERS"]["value"] == str(workers)
    assert env["TENSORKV_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # the job: one for every pod of this Job, its retries included (a label the Job controller sets)
    assert env["TENSORKV_JOB"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/controller-uid']"
    server_args = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _option(server_args, "--num-workers") == str(workers)
    (wait,) = job["spec"]["template"]["spec"]["initContainers"]  # until every server answers
    assert _env(wait)["TENSORKV_SERVERS"] == env["TENSORKV_SERVERS"]
    assert "tensorkv health" in wait["command"][-1]


def test_scaling_the_servers_in_the_kustomization_reaches_every_place_that_names_them(tmp_path):
    """Three servers where the kustomization says the count appears (replicas, and each
    TENSORKV_SERVERS it sets): the workers' wait-for-servers init container still waited for
    the two of workers.yaml."""
    for name in ("server.yaml", "workers.yaml"):
        shutil.copy(DEPLOY / name, tmp_path / name)
    two, three = (",".join(f"tensorkv-{i}.tensorkv:50051" for i in range(count)) for count in (2, 3))
    kustomization = (DEPLOY / "kustomization.yaml").read_text()
    assert kustomization.count(two) >= 1
    (tmp_path / "kustomization.yaml").write_text(kustomization.replace("  count: 2", "  count: 3").replace(two, three))
    rendered = {doc["kind"]: doc for doc in render(tmp_path)}
    pod = rendered["Job"]["spec"]["template"]["spec"]
    assert rendered["StatefulSet"]["spec"]["replicas"] == 3
    for container in (*pod["initContainers"], *pod["containers"]):
        assert _env(container)["TENSORKV_SERVERS"]["value"] == three, container["name"]


def test_next_servers_make_a_second_set_for_a_move(rendered, tmp_path):
    """deploy/kubernetes/next-servers.sh (docs/operations.md, "On Kubernetes"): three servers
    beside the first two, under other names and selected apart from them, and a Job whose
    workers, and their wait, name the new ones and resume the moved run."""
    subprocess.run(["sh", str(DEPLOY / "next-servers.sh"), "tensorkv-b", "3", str(tmp_path)], check=True, timeout=30)
    documents = render(tmp_path)
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    by_kind = {doc["kind"]: doc for doc in documents}
    statefulset, service, job = by_kind["StatefulSet"], by_kind["Service"], by_kind["Job"]
    assert (statefulset["metadata"]["name"], statefulset["spec"]["serviceName"], service["metadata"]["name"],
            statefulset["spec"]["replicas"]) == ("tensorkv-b", "tensorkv-b", "tensorkv-b", 3)
    new_pods = statefulset["spec"]["template"]["metadata"]["labels"]
    old_pods = rendered["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    for selector in (service["spec"]["selector"], statefulset["spec"]["selector"]["matchLabels"],
                     by_kind["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= new_pods.items() and not selector.items() <= old_pods.items()
    servers = ",".join(f"tensorkv-b-{i}.tensorkv-b:50051" for i in range(3))
    pod = job["spec"]["template"]["spec"]
    for container in (*pod["initContainers"], *pod["containers"]):
        assert _env(container)["TENSORKV_SERVERS"]["value"] == servers, container["name"]
    assert _env(pod["containers"][0])["TENSORKV_IF_EXISTS"]["value"] == "resume"


def test_probes_ask_healthz_and_the_last_snapshot_has_time(rendered):
    """A TCP probe passed while the server was frozen; /healthz (metrics.Liveness) does not.
    The default 30 s grace was most of what a snapshot at --max-memory takes to write."""
    pod = rendered["StatefulSet"]["spec"]["template"]["spec"]
    server = pod["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in server["ports"]}
    assert "--metrics-port" not in server["args"] and ports["metrics"] == 50053  # the image sets it
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    assert pod["terminationGracePeriodSeconds"] >= 60


def test_the_server_arguments_parse_and_name_the_mounted_files(rendered):
    pod = rendered["StatefulSet"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    usage = subprocess.run([sys.executable, "-m", "tensorkv_server", "--help"], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    known = set(re.findall(r"--[a-z-]+", usage))
    # --state-dir arrives with snapshots (API.md names it); every other flag is the server's now.
    assert {arg for arg in args if arg.startswith("--")} - known <= {"--state-dir"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert _option(args, "--state-dir") == mounts["state"]
    assert [t["metadata"]["name"] for t in rendered["StatefulSet"]["spec"]["volumeClaimTemplates"]] == ["state"]
    secrets = {"--tls-cert": ("tls", "tensorkv-tls", "tls.crt"), "--tls-key": ("tls", "tensorkv-tls", "tls.key"),
               "--token-file": ("tokens", "tensorkv-tokens", "tokens")}
    for flag, (volume, secret, key) in secrets.items():
        assert _option(args, flag) == f"{mounts[volume]}/{key}"
        assert volumes[volume]["secret"]["secretName"] == secret
    worker = rendered["Job"]["spec"]["template"]["spec"]
    worker_mounts = {m["name"]: m["mountPath"] for m in worker["containers"][0]["volumeMounts"]}
    worker_env = _env(worker["containers"][0])
    worker_secret = {v["name"]: v for v in worker["volumes"]}["worker-secrets"]["secret"]["secretName"]
    assert worker_env["TENSORKV_TLS_CA"]["value"] == worker_mounts["worker-secrets"] + "/ca.crt"
    assert worker_env["TENSORKV_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": worker_secret, "key": "token"}


def test_pods_run_unprivileged(rendered):
    for kind in ("StatefulSet", "Job"):
        pod = rendered[kind]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                               "capabilities": {"drop": ["ALL"]}}
        for container in pod["containers"]:
            assert container["resources"]["requests"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its kustomize) is not installed")
def test_kubectl_kustomize_renders_the_same():
    """tests/kustomize.py renders as kustomize does (kubectl's built-in one, offline)."""
    output = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    assert sorted(render(DEPLOY), key=_kind_and_name) == sorted(yaml.safe_load_all(output), key=_kind_and_name)


def _kind_and_name(document):
    return document["kind"], document["metadata"]["name"]


def test_the_servers_memory_limits_fit_its_container(rendered):
    """What the server may hold at once fits the container's memory limit (docs/reference.md,
    "Sizing a server's memory"): every worker's push in flight, up to 2 GiB of kept receive
    buffers and glibc heap, 256 MiB for the process itself (60 MiB idle, measured), and what
    it stores twice (a snapshot copies it while it writes)."""
    container = rendered["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    held = (int(_option(args, "--num-workers")) * int(_option(args, "--max-inflight-bytes")) + (2 << 30) + (256 << 20)
            + 2 * int(_option(args, "--max-memory")))
    assert held <= int(limit[:-2]) << 30
