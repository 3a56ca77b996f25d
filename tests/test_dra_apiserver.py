"""The DRA driver against a real API server (Kubernetes 1.34: etcd and kube-apiserver built
from their published Go modules by k8s/dra/build.sh; skipped where they are not built), with
k8s/dra/'s RBAC, admission policy and DeviceClasses applied as an operator would:

- the DeviceClasses' CEL compiles and the driver's ResourceSlice passes the API server's
  validation, with consumable capacity where the cluster has it and share devices where the
  API server drops its fields;
- the driver's service account, with a token bound to its node, may write that node's slices
  and no other's, and read claims but not list them;
- a claim allocated as the scheduler records it (quantities as the API server writes them) is
  prepared by the driver.
"""

from __future__ import annotations

import json
import shutil
import ssl
import tempfile
from pathlib import Path

import httpx
import pytest

from dra_kubelet_standin import ClaimRef, DraKubeletStandin
from kube_cluster import ControlPlane, find_binaries
from nvshare_py.dra.quantity import parse_quantity
from nvshare_py.testing.scheduler import wait_for
from test_dra_driver import DRIVER, GiB, PATIENCE, DriverProcess, Node, uuid
from test_deviceplugin import simnvml_dir  # noqa: F401  (the fixture that builds the simulated NVML)

REPO = Path(__file__).resolve().parents[1]
BINARIES = find_binaries(names=("etcd", "kube-apiserver", "kubectl"))
pytestmark = [pytest.mark.skipif(BINARIES is None, reason="no Kubernetes binaries built (k8s/dra/build.sh)"),
              pytest.mark.slow]
NODE = "node-a"


@pytest.fixture(scope="module", params=[True, False], ids=["consumable-capacity", "without-it"])
def cluster(request):
    work = Path(tempfile.mkdtemp(prefix="nvs-k8s-", dir="/var/tmp"))
    control_plane = ControlPlane(work, BINARIES, {"DRAConsumableCapacity": request.param}, controllers=False)
    try:
        control_plane.start()
        for path in ("k8s/namespace.yaml", "k8s/dra/rbac.yaml", "k8s/dra/resourceslice-policy.yaml",
                     "k8s/dra/deviceclasses.yaml"):
            control_plane.kubectl("apply", "-f", str(REPO / path))
        for name in (NODE, "node-b"):
            control_plane.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        control_plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
        control_plane.consumable_capacity = request.param
        yield control_plane
    finally:
        control_plane.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def node():
    root = Path(tempfile.mkdtemp(prefix="nvs-dra-", dir="/tmp"))
    node = Node(root)
    node.library.parent.mkdir()
    node.library.write_bytes(b"\x7fELF stand-in for libnvshare.so")
    node.dev.mkdir()
    yield node
    shutil.rmtree(root)


class Credentials:
    """The driver's service account token, bound to node-a as a pod's on that node would be
    (it names the node), and the API server's CA: what the driver's pod has."""

    def __init__(self, cluster: ControlPlane, directory: Path):
        self.directory = directory
        directory.mkdir()
        (directory / "token").write_text(cluster.token("nvshare-system", "nvshare-dra-driver", "--bound-object-kind",
                                                       "Node", "--bound-object-name", NODE))
        shutil.copy(cluster.pki.ca_cert, directory / "ca.crt")
        self.url = cluster.url

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=ssl.create_default_context(cafile=str(self.directory / "ca.crt")),
                            trust_env=False,
                            headers={"Authorization": f"Bearer {(self.directory / 'token').read_text().strip()}"})


class RealApi:
    """What DriverProcess needs of an API server: its URL and a directory with token and CA."""

    def __init__(self, credentials: Credentials):
        self.url = credentials.url
        self.directory = credentials.directory


def slices(cluster: ControlPlane) -> list[dict]:
    return cluster.get("resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]


def test_the_driver_publishes_its_nodes_slice_which_the_api_server_accepts(cluster, node, simnvml_dir):
    credentials = Credentials(cluster, node.root / "credentials")
    driver = DriverProcess(node, RealApi(credentials), simnvml_dir, ["--shares", "3"])
    try:
        def published():
            found = slices(cluster)
            wanted = 2 if cluster.consumable_capacity else 8
            return len(found) == 1 and len(found[0]["spec"]["devices"]) == wanted and found[0]
        document = wait_for(published, PATIENCE, f"the driver's ResourceSlice; driver log: {driver.log_path}")
        spec = document["spec"]
        assert (spec["driver"], spec["pool"]["name"]) == (DRIVER, NODE)
        node_uid = cluster.get("node", NODE)["metadata"]["uid"]
        assert document["metadata"]["ownerReferences"][0] == {"apiVersion": "v1", "kind": "Node", "name": NODE,
                                                              "uid": node_uid, "controller": True}
        devices = {device["name"]: device for device in spec["devices"]}
        if cluster.consumable_capacity:
            assert devices["gpu-0"]["allowMultipleAllocations"] is True
            assert parse_quantity(devices["gpu-0"]["capacity"]["memory"]["requestPolicy"]["default"]) == 16 * GiB
        else:
            assert sorted(devices) == ["gpu-0", "gpu-0-share-0", "gpu-0-share-1", "gpu-0-share-2",
                                       "gpu-1", "gpu-1-share-0", "gpu-1-share-1", "gpu-1-share-2"]
            driver.wait_for_log("DRAConsumableCapacity is not enabled in this cluster")
        # The slice is left alone once it says what the driver wants (quantities compare as numbers).
        version = document["metadata"]["resourceVersion"]
        driver.wait_for_log("ResourceSlices of node")
        wait_for(lambda: driver.log().count("ResourceSlices of node") >= 1 and
                 slices(cluster)[0]["metadata"]["resourceVersion"] == version, PATIENCE, "a settled slice")
    finally:
        driver.stop()
        assert driver.process.returncode == 0, driver.log()


def test_the_driver_may_write_its_own_nodes_slices_only(cluster, node):
    credentials = Credentials(cluster, node.root / "credentials")
    slice_for = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                 "spec": {"driver": DRIVER, "pool": {"name": "node-b", "generation": 1, "resourceSliceCount": 1},
                          "nodeName": "node-b", "devices": []}}
    with credentials.client() as client:
        refused = client.post("/apis/resource.k8s.io/v1/resourceslices", json=dict(slice_for, metadata={"name": "b"}))
        assert refused.status_code == 403, refused.text
        assert "may write ResourceSlices of that node only" in refused.json()["message"]
        other_driver = json.loads(json.dumps(slice_for))
        other_driver["spec"].update(driver="other.example.com", nodeName=NODE, pool={"name": NODE, "generation": 1,
                                                                                     "resourceSliceCount": 1})
        refused = client.post("/apis/resource.k8s.io/v1/resourceslices", json=dict(other_driver, metadata={"name": "o"}))
        assert refused.status_code == 403 and "of driver gpu.nvshare.com only" in refused.json()["message"]
        own = json.loads(json.dumps(slice_for))
        own["spec"].update(nodeName=NODE, pool={"name": "probe", "generation": 1, "resourceSliceCount": 1})
        created = client.post("/apis/resource.k8s.io/v1/resourceslices", json=dict(own, metadata={"name": "own-probe"}))
        assert created.status_code == 201, created.text
        assert client.delete("/apis/resource.k8s.io/v1/resourceslices/own-probe").status_code == 200
        # Claims: read one by name, never list them; nothing else of the cluster.
        assert client.get("/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/absent").status_code == 404
        assert client.get("/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims").status_code == 403
        assert client.get("/api/v1/namespaces/nvshare-system/secrets").status_code == 403
        assert client.patch(f"/api/v1/nodes/{NODE}", json={}, headers={"Content-Type": "application/merge-patch+json"}
                            ).status_code == 403


def test_a_claim_as_the_api_server_keeps_it_is_prepared(cluster, node, simnvml_dir):
    credentials = Credentials(cluster, node.root / "credentials")
    request = {"name": "gpu", "exactly": {"deviceClassName": "share.gpu.nvshare.com"}}
    if cluster.consumable_capacity:
        request["exactly"]["capacity"] = {"requests": {"memory": "3Gi"}}
    cluster.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                   "metadata": {"name": "nb", "namespace": "team-a"},
                   "spec": {"devices": {"requests": [request], "config": [{"opaque": {
                       "driver": DRIVER, "parameters": {"apiVersion": "gpu.nvshare.com/v1alpha1", "kind": "GpuConfig",
                                                        "memoryLimit": "3Gi", "weight": 7}}}]}}})
    claim = cluster.get("resourceclaim", "nb", "-n", "team-a")
    # What kube-scheduler writes when it allocates: the results, and the class's and the claim's config.
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE,
              "device": "gpu-1" if cluster.consumable_capacity else "gpu-1-share-0"}
    if cluster.consumable_capacity:
        result.update(shareID="4f0c1c7e-8a0e-4a4c-9d3e-2b7a1a9d0e11", consumedCapacity={"memory": "3072Mi", "shares": "1"})
    class_config = cluster.get("deviceclass", "share.gpu.nvshare.com")["spec"]["config"][0]
    claim["status"] = {"allocation": {"devices": {
        "results": [result],
        "config": [dict(class_config, source="FromClass"),
                   dict(claim["spec"]["devices"]["config"][0], source="FromClaim")]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                                  "values": [NODE]}]}]}}}
    cluster.kubectl("replace", "--subresource", "status", "-f", "-", input=json.dumps(claim))
    kubelet = DraKubeletStandin(node.registry).start()
    driver = DriverProcess(node, RealApi(credentials), simnvml_dir, [])
    try:
        kubelet.wait_for_plugin(DRIVER)
        uid = claim["metadata"]["uid"]
        response = kubelet.prepare(DRIVER, [ClaimRef("team-a", uid, "nb")])
        assert response.claims[uid].error == "", response.claims[uid].error
        (device,) = response.claims[uid].devices
        assert device.device_name == result["device"]
        (spec_device,) = node.spec(uid)["devices"]
        env = dict(item.split("=", 1) for item in spec_device["containerEdits"]["env"])
        assert env["NVSHARE_MEMORY_LIMIT"] == f"{uuid(1)}={3 * GiB}"
        driver.wait_for_log(f"prepared claim team-a/nb ({uid}): {result['device']} ({uuid(1)}, limit {3 * GiB} bytes), weight 7")
    finally:
        driver.stop()
        kubelet.stop()
        cluster.kubectl("delete", "resourceclaim", "nb", "-n", "team-a")
