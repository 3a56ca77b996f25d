"""k8s/: every manifest is valid against the Kubernetes schemas, and the manifests agree with
the programs they run (commands, flags, environment variables, paths)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import typer.main
import yaml

from nvshare_py.deviceplugin import cli, config
from nvshare_py.paths import SocketPaths
from nvshare_py.testing.scheduler import nvsharectl_command, run_child

K8S = Path(__file__).resolve().parents[1] / "k8s"
# The oldest Kubernetes these manifests promise to work with, and the newest the schemas know.
VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version()]
NOT_KUBERNETES_KINDS = {"Kustomization", "ServiceMonitor"}  # CRDs: not in the schemas


def load(path: Path) -> list[dict]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


# k8s/dra/ (Kubernetes 1.34 and newer) has tests of its own: tests/test_dra_manifests.py.
MANIFESTS = sorted(path for path in K8S.rglob("*.yaml") if path.relative_to(K8S).parts[0] != "dra")
RESOURCES = [(path, document) for path in MANIFESTS for document in load(path)]


def find(kind: str, name: str) -> dict:
    (found,) = [doc for _, doc in RESOURCES if doc["kind"] == kind and doc["metadata"]["name"] == name]
    return found


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def host_mounts(spec: dict, container: dict) -> dict[str, str]:
    """mountPath -> hostPath of a container's hostPath volumes."""
    host_paths = {volume["name"]: volume["hostPath"]["path"] for volume in spec["volumes"] if "hostPath" in volume}
    return {mount["mountPath"]: host_paths[mount["name"]] for mount in container.get("volumeMounts", [])
            if mount["name"] in host_paths}


def test_there_are_manifests():
    names = {path.relative_to(K8S).as_posix() for path in MANIFESTS}
    assert {"namespace.yaml", "scheduler.yaml", "device-plugin.yaml", "kustomization.yaml", "rbac.yaml",
            "examples/notebook.yaml", "examples/training-job.yaml", "priorityclass.yaml",
            "monitoring/service-monitor.yaml", "monitoring/kustomization.yaml"} <= names


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path, document", [pytest.param(path, doc, id=f"{path.name}:{doc['kind']}/{doc['metadata']['name']}")
                                            for path, doc in RESOURCES if doc["kind"] not in NOT_KUBERNETES_KINDS])
def test_manifest_is_valid_kubernetes(path, document, version):
    kubernetes_validate.validate(document, version, strict=True)


def test_kustomization_installs_the_node_components():
    (kustomization,) = load(K8S / "kustomization.yaml")
    assert kustomization["resources"] == ["namespace.yaml", "priorityclass.yaml", "scheduler.yaml", "rbac.yaml",
                                          "device-plugin.yaml"]
    images = {image["name"] for image in kustomization["images"]}
    used = {container["image"].rsplit(":", 1)[0]
            for path in ("scheduler.yaml", "device-plugin.yaml") for doc in load(K8S / path)
            for container in pod_spec(doc)["containers"] + pod_spec(doc).get("initContainers", [])}
    assert images == used


def test_node_components_share_the_namespace():
    namespace = find("Namespace", "nvshare-system")["metadata"]["name"]
    for name in ("nvshare-scheduler", "nvshare-device-plugin"):
        assert find("DaemonSet", name)["metadata"]["namespace"] == namespace


def test_scheduler_sees_host_pids_and_owns_the_host_socket_directory():
    spec = pod_spec(find("DaemonSet", "nvshare-scheduler"))
    assert spec["hostPID"] is True
    (container,) = spec["containers"]
    socket_dir = str(SocketPaths.resolve("/var/run/nvshare").root)
    assert container["command"][:3] == ["nvshare-scheduler", "--socket-dir", socket_dir]
    assert host_mounts(spec, container) == {socket_dir: socket_dir}


def test_device_plugin_mounts_what_it_serves_and_injects():
    spec = pod_spec(find("DaemonSet", "nvshare-device-plugin"))
    # The scheduler answers control requests only from its own pid namespace, the host's.
    assert spec["hostPID"] is True
    (install,) = spec["initContainers"]
    (plugin,) = spec["containers"]
    env = {item["name"]: item["value"] for item in plugin["env"] if "value" in item}
    socket_paths = SocketPaths.resolve(env["NVSHARE_SOCKET_DIR"])
    mounts = host_mounts(spec, plugin)
    # Same paths inside as on the host: the plugin hands host paths to the kubelet.
    assert all(inside == host for inside, host in mounts.items())
    assert "/var/lib/kubelet/device-plugins" in mounts
    # The plugin itself reaches the control socket (per-pod settings); the containers it
    # serves get only the client directory (container_response, tests/test_deviceplugin.py).
    assert str(socket_paths.client_dir) in mounts and str(socket_paths.control_dir) in mounts
    assert str(socket_paths.root) not in mounts
    library = config.DEFAULT_LIBRARY
    assert any(library.is_relative_to(path) for path in mounts)
    # The init container puts the library where the plugin looks for it.
    assert install["command"][:2] == ["nvshare-device-plugin", "install-library"]
    target = Path(install["command"][install["command"].index("--to") + 1])
    assert target / library.name == library
    assert any(target.is_relative_to(path) for path in host_mounts(spec, install))
    assert plugin["command"] == ["nvshare-device-plugin", "serve"]


def test_device_plugin_settings_are_ones_the_plugin_reads():
    commands = typer.main.get_command(cli.app).commands
    known = {envvar for param in commands["serve"].params for envvar in ([param.envvar] if isinstance(param.envvar, str) else param.envvar or [])}
    (plugin,) = pod_spec(find("DaemonSet", "nvshare-device-plugin"))["containers"]
    for item in plugin["env"]:
        if item["name"].startswith("NVSHARE_") or item["name"] == "NODE_NAME":
            assert item["name"] in known, f"{item['name']} is not read by nvshare-device-plugin serve"
    assert {"serve", "install-library"} <= set(commands)


@pytest.mark.parametrize("kind, name", [("Pod", "notebook"), ("Job", "nvshare-training")])
def test_examples_ask_for_nvshare_gpus(kind, name):
    workload = find(kind, name)
    spec = workload["spec"] if kind == "Pod" else pod_spec(workload)
    for container in spec["containers"]:
        assert container["resources"]["limits"][config.DEFAULT_RESOURCE_NAME] == 1


def test_the_device_plugin_may_read_pods_and_record_events_and_nothing_else():
    spec = pod_spec(find("DaemonSet", "nvshare-device-plugin"))
    account = find("ServiceAccount", spec["serviceAccountName"])
    assert account["metadata"]["namespace"] == find("DaemonSet", "nvshare-device-plugin")["metadata"]["namespace"]
    bindings = [doc for _, doc in RESOURCES if doc["kind"] in ("ClusterRoleBinding", "RoleBinding")
                and {"kind": "ServiceAccount", "name": account["metadata"]["name"],
                     "namespace": account["metadata"]["namespace"]} in doc["subjects"]]
    rules = [rule for binding in bindings for rule in find(binding["roleRef"]["kind"], binding["roleRef"]["name"])["rules"]]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                     {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    # It asks only for the pods of its own node, whose name the downward API gives it.
    (plugin,) = spec["containers"]
    (node_name,) = [item for item in plugin["env"] if item["name"] == "NODE_NAME"]
    assert node_name["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_example_annotations_are_settings_the_plugin_applies():
    from nvshare_py.deviceplugin.podsettings import ANNOTATIONS, read_pod

    annotated = 0
    for name, spec_holder in [("notebook", find("Pod", "notebook")),
                              ("nvshare-training", find("Job", "nvshare-training")["spec"]["template"])]:
        metadata = dict(spec_holder["metadata"], uid="example", namespace="nvshare-examples", name=name)
        pod = read_pod({"metadata": metadata})
        assert pod.problems == ()
        ours = {key for key in metadata.get("annotations", {}) if key.startswith("nvshare.com/")}
        assert ours == set(pod.values) and ours <= set(ANNOTATIONS)
        annotated += len(ours)
    assert annotated >= len(ANNOTATIONS)


def all_pod_specs() -> list[tuple[str, dict]]:
    specs = []
    for _, doc in RESOURCES:
        if doc["kind"] in ("DaemonSet", "Deployment", "Job"):
            specs.append((doc["metadata"]["name"], pod_spec(doc)))
        elif doc["kind"] == "Pod":
            specs.append((doc["metadata"]["name"], doc["spec"]))
    return specs


def test_every_image_names_its_registry():
    # An unqualified name is Docker Hub to containerd, and CRI-O refuses it in enforcing mode.
    for name, spec in all_pod_specs():
        for container in spec["containers"] + spec.get("initContainers", []):
            first = container["image"].split("/", 1)[0]
            assert "/" in container["image"] and ("." in first or ":" in first or first == "localhost"), \
                f"{name}: image {container['image']} has no registry"


def test_node_components_have_a_priority_that_needs_no_quota_and_only_the_plugin_a_token():
    quotas = [doc for _, doc in RESOURCES if doc["kind"] == "ResourceQuota"]
    classes = {doc["metadata"]["name"]: doc for _, doc in RESOURCES if doc["kind"] == "PriorityClass"}
    assert pod_spec(find("DaemonSet", "nvshare-scheduler"))["automountServiceAccountToken"] is False
    assert pod_spec(find("DaemonSet", "nvshare-device-plugin"))["automountServiceAccountToken"] is True
    for name in ("nvshare-scheduler", "nvshare-device-plugin"):
        spec = pod_spec(find("DaemonSet", name))
        priority = spec["priorityClassName"]
        if priority.startswith("system-"):
            # Outside kube-system the API server admits these classes only under a matching quota.
            assert any(priority in str(quota["spec"].get("scopeSelector")) for quota in quotas)
        else:
            assert priority in classes and classes[priority]["value"] <= 1_000_000_000


def test_scheduler_serves_metrics_where_the_pod_says():
    workload = find("DaemonSet", "nvshare-scheduler")
    (container,) = pod_spec(workload)["containers"]
    address = container["command"][container["command"].index("--metrics") + 1]
    port = int(address.rsplit(":", 1)[1])
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    # docs/metrics.md tells the same: the pod network, this port, and not dcgm-exporter's 9400.
    assert not pod_spec(workload).get("hostNetwork")
    documented = (K8S.parent / "docs" / "metrics.md").read_text()
    assert f"`--metrics :{port}`" in documented and "(its DaemonSet has no `hostNetwork`)" in documented
    assert port != 9400


def readiness_command(socket_dir: Path) -> list[str]:
    (container,) = pod_spec(find("DaemonSet", "nvshare-scheduler"))["containers"]
    command = list(container["readinessProbe"]["exec"]["command"])
    assert command[0] == "nvsharectl"
    command[command.index("--socket-dir") + 1] = str(socket_dir)
    return [*nvsharectl_command(), *command[1:]]


def test_readiness_probe_asks_the_daemon_and_fails_once_it_is_gone(scheduler):
    probe = readiness_command(scheduler.socket_dir)
    assert run_child(probe, scheduler.env).returncode == 0
    scheduler.stop()
    assert scheduler.paths.client_socket.exists()  # the socket files stay, on purpose
    result = run_child(probe, scheduler.env)
    assert result.returncode != 0, result.stdout


def test_the_service_monitor_finds_the_scheduler_pods_metrics_port():
    service = find("Service", "nvshare-scheduler-metrics")
    monitor = find("ServiceMonitor", "nvshare-scheduler")
    scheduler = find("DaemonSet", "nvshare-scheduler")
    labels = scheduler["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (container,) = pod_spec(scheduler)["containers"]
    assert service["spec"]["ports"][0]["targetPort"] in [port["name"] for port in container["ports"]]
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    (kustomization,) = load(K8S / "monitoring" / "kustomization.yaml")
    assert (K8S / "monitoring" / kustomization["configMapGenerator"][0]["files"][0]).is_file()
