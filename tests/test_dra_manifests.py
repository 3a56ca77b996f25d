"""k8s/dra/: every manifest is valid against the Kubernetes schemas of 1.34 (the first with
resource.k8s.io/v1) and the newest, and the manifests agree with the driver they run (its
command, flags, variables and paths; the attributes its devices have; the configuration it
reads). That the API server takes them (CEL included) and the admission policy works:
tests/test_dra_apiserver.py, against a real one; that pods get GPUs through them: k8s/dra/e2e.sh."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import typer.main
import yaml

from nvshare_py.deviceplugin.inventory import PhysicalGpu
from nvshare_py.dra import cli
from nvshare_py.dra.cdi import DEFAULT_CDI_DIR
from nvshare_py.dra.claims import read_config
from nvshare_py.dra.config import DEFAULT_DRIVER_NAME
from nvshare_py.dra.devices import DeviceSet, Sharing
from nvshare_py.dra.kubeletapi import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from nvshare_py.dra.quantity import parse_quantity
from nvshare_py.paths import SocketPaths

K8S = Path(__file__).resolve().parents[1] / "k8s"
DRA = K8S / "dra"
VERSIONS = ["1.34.0", kubernetes_validate.utils.latest_version()]
MANIFESTS = sorted(DRA.rglob("*.yaml"))
RESOURCES = [(path, document) for path in MANIFESTS for document in yaml.safe_load_all(path.read_text()) if document]


def find(kind: str, name: str, namespace: str | None = None) -> dict:
    (found,) = [doc for _, doc in RESOURCES if doc["kind"] == kind and doc["metadata"]["name"] == name
                and (namespace is None or doc["metadata"].get("namespace") == namespace)]
    return found


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in RESOURCES if doc["kind"] == kind]


def driver_daemonset() -> tuple[dict, dict]:
    spec = find("DaemonSet", "nvshare-dra-driver")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def host_mounts(spec: dict, container: dict) -> dict[str, str]:
    host_paths = {volume["name"]: volume["hostPath"]["path"] for volume in spec["volumes"] if "hostPath" in volume}
    return {mount["mountPath"]: host_paths[mount["name"]] for mount in container.get("volumeMounts", [])
            if mount["name"] in host_paths}


def test_there_are_manifests():
    names = {path.relative_to(DRA).as_posix() for path in MANIFESTS}
    assert {"kustomization.yaml", "rbac.yaml", "resourceslice-policy.yaml", "deviceclasses.yaml", "driver.yaml",
            "examples/notebook.yaml", "examples/shared-claim.yaml", "examples/two-namespaces.yaml",
            "examples/whole-gpu.yaml"} <= names
    (kustomization,) = yaml.safe_load_all((DRA / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(names - {"kustomization.yaml"} - {
        name for name in names if name.startswith("examples/")})


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path, document", [pytest.param(path, doc, id=f"{path.name}:{doc['kind']}/{doc['metadata']['name']}")
                                            for path, doc in RESOURCES if doc["kind"] != "Kustomization"])
def test_manifest_is_valid_kubernetes(path, document, version):
    kubernetes_validate.validate(document, version, strict=True)


def test_the_daemonset_mounts_where_the_driver_serves_and_writes():
    spec, container = driver_daemonset()
    assert container["command"] == ["nvshare-dra-driver", "serve"]
    assert spec["hostPID"] is True  # the scheduler answers control requests from its own pid namespace
    mounts = host_mounts(spec, container)
    assert all(inside == host for inside, host in mounts.items())  # the driver hands host paths on
    env = {item["name"]: item.get("value") for item in container["env"]}
    driver = env.get("NVSHARE_DRA_DRIVER_NAME", DEFAULT_DRIVER_NAME)
    assert DEFAULT_REGISTRY_DIR in mounts and f"{DEFAULT_PLUGINS_DIR}/{driver}" in mounts
    assert str(DEFAULT_CDI_DIR) in mounts
    paths = SocketPaths.resolve(env["NVSHARE_SOCKET_DIR"])
    assert str(paths.client_dir) in mounts and str(paths.control_dir) in mounts and str(paths.root) not in mounts
    (install,) = spec["initContainers"]
    assert install["command"][:2] == ["nvshare-dra-driver", "install-library"]
    target = Path(install["command"][install["command"].index("--to") + 1])
    assert any(target.is_relative_to(path) for path in host_mounts(spec, install))
    assert any((target / "libnvshare.so").is_relative_to(path) for path in mounts)
    (node_name,) = [item for item in container["env"] if item["name"] == "NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_the_daemonsets_settings_are_ones_the_driver_reads():
    commands = typer.main.get_command(cli.app).commands
    known = {envvar for param in commands["serve"].params
             for envvar in ([param.envvar] if isinstance(param.envvar, str) else param.envvar or [])}
    _, container = driver_daemonset()
    for item in container["env"]:
        if item["name"].startswith("NVSHARE_") or item["name"] == "NODE_NAME":
            assert item["name"] in known, f"{item['name']} is not read by nvshare-dra-driver serve"


def test_the_driver_may_read_claims_and_its_nodes_pods_and_write_slices_and_nothing_else():
    spec, _ = driver_daemonset()
    account = find("ServiceAccount", spec["serviceAccountName"])
    subject = {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": account["metadata"]["namespace"]}
    bindings = [doc for doc in of_kind("ClusterRoleBinding") + of_kind("RoleBinding") if subject in doc["subjects"]]
    rules = [rule for binding in bindings for rule in find(binding["roleRef"]["kind"], binding["roleRef"]["name"])["rules"]]
    assert rules == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["get", "list", "create", "update", "delete"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    ]
    # The slices of its own node only: the admission policy, for this account, on every write.
    policy = find("ValidatingAdmissionPolicy", "nvshare-dra-resourceslices")
    (condition,) = policy["spec"]["matchConditions"]
    assert f'"system:serviceaccount:{subject["namespace"]}:{subject["name"]}"' in condition["expression"]
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"] and set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    binding = find("ValidatingAdmissionPolicyBinding", "nvshare-dra-resourceslices")
    assert binding["spec"] == {"policyName": "nvshare-dra-resourceslices", "validationActions": ["Deny"]}
    assert f'== "{DEFAULT_DRIVER_NAME}"' in policy["spec"]["validations"][-1]["expression"]


def published_attributes() -> set[str]:
    gpus = [PhysicalGpu("GPU-0", 0, "g", 1 << 34, minor=0)]
    return {name for sharing in Sharing for device in DeviceSet(gpus, sharing, 2, 1).documents()
            for name in device["attributes"]}


def test_the_device_classes_select_by_attributes_the_driver_publishes():
    classes = {doc["metadata"]["name"]: doc for doc in of_kind("DeviceClass")}
    assert set(classes) == {"gpu.nvshare.com", "share.gpu.nvshare.com"}
    attributes = published_attributes()
    for document in classes.values():
        for selector in document["spec"]["selectors"]:
            expression = selector["cel"]["expression"]
            assert f'device.driver == "{DEFAULT_DRIVER_NAME}"' in expression
            used = set(re.findall(r'device\.attributes\["gpu\.nvshare\.com"\]\.(\w+)', expression))
            assert used and used <= attributes, (used, attributes)
        for config in document["spec"].get("config", []):
            assert config["opaque"]["driver"] == DEFAULT_DRIVER_NAME
            read_config(config["opaque"]["parameters"], "FromClass")  # raises if the driver would refuse it


def claim_specs() -> list[tuple[str, dict]]:
    found = [(doc["metadata"]["name"], doc["spec"]) for doc in of_kind("ResourceClaim")]
    return found + [(doc["metadata"]["name"], doc["spec"]["spec"]) for doc in of_kind("ResourceClaimTemplate")]


def test_the_example_claims_ask_for_the_classes_and_say_what_the_driver_reads():
    classes = {doc["metadata"]["name"] for doc in of_kind("DeviceClass")}
    attributes = published_attributes()
    assert len(claim_specs()) >= 5
    for name, spec in claim_specs():
        limits = {}
        for config in spec["devices"].get("config", []):
            assert config["opaque"]["driver"] == DEFAULT_DRIVER_NAME
            settings = read_config(config["opaque"]["parameters"], "FromClaim")
            limits[name] = settings.memory_limit
        for request in spec["devices"]["requests"]:
            exactly = request["exactly"]
            assert exactly["deviceClassName"] in classes, name
            for selector in exactly.get("selectors", []):
                assert set(re.findall(r'\.attributes\["gpu\.nvshare\.com"\]\.(\w+)', selector["cel"]["expression"])) <= attributes
            memory = (exactly.get("capacity") or {}).get("requests", {}).get("memory")
            # A share states its memory both ways (capacity, and memoryLimit where capacity is dropped).
            assert (memory is None) == (limits.get(name) is None), name
            if memory is not None:
                assert parse_quantity(memory) == limits[name], name


def test_every_example_pod_uses_its_claims():
    specs = [doc["spec"] for doc in of_kind("Pod")] + [doc["spec"]["template"]["spec"] for doc in of_kind("Deployment")]
    assert len(specs) >= 4
    claims = {name for name, _ in claim_specs()}
    for spec in specs:
        names = {entry["name"]: entry.get("resourceClaimName") or entry.get("resourceClaimTemplateName")
                 for entry in spec["resourceClaims"]}
        assert set(names.values()) <= claims
        for container in spec["containers"]:
            assert {claim["name"] for claim in container["resources"]["claims"]} <= set(names)


def test_every_image_names_its_registry():
    spec, _ = driver_daemonset()
    pods = [doc["spec"] for doc in of_kind("Pod")] + [doc["spec"]["template"]["spec"]
                                                       for doc in of_kind("Deployment") + of_kind("DaemonSet")]
    for pod in pods:
        for container in pod["containers"] + pod.get("initContainers", []):
            first = container["image"].split("/", 1)[0]
            assert "/" in container["image"] and ("." in first or ":" in first), container["image"]
    assert spec["priorityClassName"] == "nvshare-node-critical"  # k8s/priorityclass.yaml
