"""Renders a kustomization with the few features deploy/kubernetes uses (kustomize itself is
not installed here): ``resources`` (files of YAML documents), ``replicas`` and ``patches``
that are JSON 6902 operations ('replace' and 'add') on a target named by kind and name. Any
other field is an error, so that a kustomization using more fails its test instead of being
rendered wrongly."""
from pathlib import Path

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "replicas", "patches"}
# The kinds whose replicas kustomize's `replicas` field sets.
SCALED_KINDS = ("Deployment", "ReplicaSet", "ReplicationController", "StatefulSet")


def render(directory):
    """The resources of ``directory``/kustomization.yaml, as dicts, after its replicas and patches."""
    directory = Path(directory)
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"tests/kustomize.py does not render {sorted(unknown)}")
    resources = [doc for name in kustomization["resources"]
                 for doc in yaml.safe_load_all((directory / name).read_text()) if doc]
    for replicas in kustomization.get("replicas", []):
        _find(resources, SCALED_KINDS, replicas["name"])["spec"]["replicas"] = replicas["count"]
    for patch in kustomization.get("patches", []):
        target = _find(resources, (patch["target"]["kind"],), patch["target"]["name"])
        for operation in yaml.safe_load(patch["patch"]):
            _apply(target, operation)
    return resources


def _find(resources, kinds, name):
    found = [r for r in resources if r["metadata"]["name"] == name and r["kind"] in kinds]
    if len(found) != 1:
        raise ValueError(f"{len(found)} resources of kind {'/'.join(kinds)} are named {name}")
    return found[0]


def _apply(document, operation):
    if operation["op"] not in ("replace", "add"):
        raise ValueError(f"tests/kustomize.py does not apply op {operation['op']}")
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    for part in parents:
        document = document[int(part) if isinstance(document, list) else part]
    if isinstance(document, list):
        index = len(document) if last == "-" else int(last)
        if operation["op"] == "add":
            document.insert(index, operation["value"])
        else:
            document[index] = operation["value"]
    elif operation["op"] == "replace" and last not in document:
        raise ValueError(f"replace of {operation['path']}, which does not exist")
    else:
        document[last] = operation["value"]
