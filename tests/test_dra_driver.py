"""The DRA driver as a real process, against the kubelet's side of DRA (tests/dra_kubelet_standin.py,
from the same protos) and the API server stand-in (tests/dra_apiserver_standin.py), over real
gRPC sockets and real HTTPS, with GPUs from the simulated NVML and, for the pods' settings, the
real scheduler daemon. Against a real API server: tests/test_dra_apiserver.py; end to end with a
real kubelet: k8s/dra/e2e.sh."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from dra_apiserver_standin import DraApiServerStandin
from dra_kubelet_standin import ClaimRef, DraKubeletStandin
from nvshare_py.dra.kubeletapi import DRA_V1BETA1_SERVICE, DRA_V1_SERVICE
from nvshare_py.testing.scheduler import child_env, wait_for
from test_deviceplugin import simnvml_dir  # noqa: F401  (the fixture that builds the simulated NVML)

DRIVER = "gpu.nvshare.com"
NODE = "node-a"
GiB = 1 << 30
PATIENCE = 60.0


def uuid(index: int) -> str:
    return f"GPU-5151ad00-0000-4000-8000-{index:012x}"


@dataclass
class Node:
    """The host paths of one simulated node."""

    root: Path

    registry = property(lambda self: self.root / "reg")
    plugins = property(lambda self: self.root / "plugins")
    cdi = property(lambda self: self.root / "cdi")
    run = property(lambda self: self.root / "run")
    library = property(lambda self: self.root / "lib" / "libnvshare.so")
    dev = property(lambda self: self.root / "dev")
    checkpoint = property(lambda self: self.plugins / DRIVER / "checkpoint.json")

    def spec(self, claim_uid: str) -> dict:
        return json.loads((self.cdi / f"{DRIVER}-claim_{claim_uid}.json").read_text())

    def specs(self) -> list[str]:
        return sorted(path.name for path in self.cdi.iterdir()) if self.cdi.exists() else []


@pytest.fixture
def node():
    root = Path(tempfile.mkdtemp(prefix="nvs-dra-", dir="/tmp"))
    node = Node(root)
    node.library.parent.mkdir()
    node.library.write_bytes(b"\x7fELF stand-in for libnvshare.so")
    node.dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (node.dev / name).write_text("")
    yield node
    shutil.rmtree(root)


@pytest.fixture
def apiserver(node):
    (node.root / "api").mkdir()
    standin = DraApiServerStandin(node.root / "api")  # its token and ca.crt are the driver's credentials
    standin.start()
    standin.node_uid = standin.put_node(NODE)
    yield standin
    standin.stop()


@pytest.fixture
def kubelet(node):
    standin = DraKubeletStandin(node.registry).start()
    yield standin
    standin.stop()


class DriverProcess:
    def __init__(self, node: Node, apiserver: DraApiServerStandin, nvml_dir: Path, args: list[str],
                 socket_dir: Path | None = None):
        self.node = node
        self.log_path = node.root / f"driver-{time.monotonic_ns()}.log"
        # PYTHONFAULTHANDLER: a driver that does not end in time is sent SIGABRT (`wait`), and
        # the log then shows where each of its threads was.
        env = child_env(extra={"LD_LIBRARY_PATH": str(nvml_dir), "SIMCUDA_DEVICES": "2", "SIMCUDA_MEMORY": "16G",
                               "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
        command = [sys.executable, "-m", "nvshare_py.dra", "serve", "--node-name", NODE,
                   "--api-server", apiserver.url, "--api-credentials", str(apiserver.directory),
                   "--registry-dir", str(node.registry), "--plugins-dir", str(node.plugins), "--cdi-dir", str(node.cdi),
                   "--socket-dir", str(socket_dir or node.run), "--library", str(node.library),
                   "--device-dir", str(node.dev), "--slice-interval", "0.2", "--watch-interval", "0.1", *args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_log(self, text: str) -> None:
        wait_for(lambda: text in self.log() or self.process.poll() is not None, PATIENCE, f"{text!r} in the log")
        assert text in self.log(), self.log()

    def wait(self) -> int:
        """Its exit status; a driver still running after PATIENCE is aborted and fails the test
        with its log (and its threads' stacks)."""
        try:
            return self.process.wait(PATIENCE)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGABRT)
            self.process.wait(PATIENCE)
            raise AssertionError(f"the driver did not end within {PATIENCE:g} s; its log:\n{self.log()}") from None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.wait()


@pytest.fixture
def start_driver(node, apiserver, simnvml_dir):
    started = []

    @contextmanager
    def start(*args: str, socket_dir: Path | None = None):
        driver = DriverProcess(node, apiserver, simnvml_dir, list(args), socket_dir)
        started.append(driver)
        try:
            yield driver
        finally:
            driver.stop()

    yield start
    for driver in started:
        driver.stop(signal.SIGKILL)


# ---- claims as the API server has them --------------------------------------------------------


def allocated(name: str, uid: str, results: list[dict], config: list[dict] = (), namespace: str = "team-a") -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"allocation": {"devices": {"results": results, "config": list(config)}}}}


def share(device: str = "gpu-0", memory: str | None = "4Gi", request: str = "gpu", pool: str = NODE) -> dict:
    entry = {"request": request, "driver": DRIVER, "pool": pool, "device": device}
    if memory is not None:
        entry["consumedCapacity"] = {"memory": memory, "shares": "1"}
        entry["shareID"] = f"share-of-{device}"
    return entry


def gpu_config(source: str = "FromClass", **parameters) -> dict:
    return {"source": source, "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.nvshare.com/v1alpha1", "kind": "GpuConfig", **parameters}}}


def ref(document: dict) -> ClaimRef:
    metadata = document["metadata"]
    return ClaimRef(metadata["namespace"], metadata["uid"], metadata["name"])


def cdi_ids(response, uid: str) -> list[list[str]]:
    return [list(device.cdi_device_ids) for device in response.claims[uid].devices]


# ---- registration and slices -----------------------------------------------------------------------


def test_the_driver_registers_with_the_kubelet_and_publishes_the_nodes_gpus(node, apiserver, kubelet, start_driver):
    with start_driver() as driver:
        plugin = kubelet.wait_for_plugin(DRIVER)
        assert plugin.service == DRA_V1_SERVICE and plugin.offered == [DRA_V1_SERVICE, DRA_V1BETA1_SERVICE]
        assert plugin.endpoint == str(node.plugins / DRIVER / "dra.sock")
        driver.wait_for_log(f"registered {DRIVER} with the kubelet")
        (published,) = wait_for(apiserver.slice_list, PATIENCE, "a ResourceSlice")
        spec = published["spec"]
        assert (spec["driver"], spec["nodeName"], spec["pool"]["name"]) == (DRIVER, NODE, NODE)
        assert published["metadata"]["ownerReferences"][0]["uid"] == apiserver.node_uid
        devices = {device["name"]: device for device in spec["devices"]}
        assert sorted(devices) == ["gpu-0", "gpu-1"]
        assert devices["gpu-1"]["attributes"]["uuid"] == {"string": uuid(1)}
        assert devices["gpu-1"]["allowMultipleAllocations"] is True
        assert devices["gpu-1"]["capacity"]["memory"]["value"] == str(16 * GiB)
        # Checked every --slice-interval: nothing is written while the slice says the same...
        driver.wait_for_log("ResourceSlices of node")
        writes = apiserver.slice_writes

        def lists() -> int:
            return sum(1 for request in list(apiserver.requests)
                       if request["method"] == "GET" and request["path"].endswith("/resourceslices"))
        checked = lists()
        wait_for(lambda: lists() >= checked + 3, PATIENCE, "three more checks of the slices")
        assert apiserver.slice_writes == writes
        # ...and a slice someone deleted is written again.
        apiserver.delete_slices()
        wait_for(apiserver.slice_list, PATIENCE, "the ResourceSlice written again")


def test_without_consumable_capacity_in_the_cluster_the_driver_publishes_share_devices(apiserver, start_driver):
    apiserver.consumable_capacity = False
    with start_driver("--shares", "3") as driver:
        def replicas():
            found = apiserver.slice_list()
            return found and len(found[0]["spec"]["devices"]) == 8 and found
        (published,) = wait_for(replicas, PATIENCE, "the share devices published")
        assert {device["name"] for device in published["spec"]["devices"]} == {
            "gpu-0", "gpu-0-share-0", "gpu-0-share-1", "gpu-0-share-2",
            "gpu-1", "gpu-1-share-0", "gpu-1-share-1", "gpu-1-share-2"}
        assert published["spec"]["pool"]["generation"] == 2
        driver.wait_for_log("DRAConsumableCapacity is not enabled in this cluster; publishing 3 share devices per GPU")


def test_a_kubelet_that_knows_only_v1beta1_gets_it(node, apiserver, start_driver):
    kubelet = DraKubeletStandin(node.registry, services=(DRA_V1BETA1_SERVICE,)).start()
    try:
        claim = allocated("nb", "u-beta", [share()])
        apiserver.put_claim(claim)
        with start_driver():
            assert kubelet.wait_for_plugin(DRIVER).service == DRA_V1BETA1_SERVICE
            response = kubelet.prepare(DRIVER, [ref(claim)])
            assert response.claims["u-beta"].error == ""
            assert cdi_ids(response, "u-beta") == [[f"{DRIVER}/claim=u-beta-{uuid(0)}"]]
    finally:
        kubelet.stop()


def test_a_kubelet_that_refuses_the_driver_ends_it(node, apiserver, start_driver):
    kubelet = DraKubeletStandin(node.registry, services=("v2.DRAPlugin",)).start()
    try:
        with start_driver() as driver:
            kubelet.wait_until(lambda: kubelet.refusals, what="the kubelet's refusal")
            assert driver.wait() == 1, kubelet.refusals
            assert f"the kubelet refused to register {DRIVER}: none of services supported by the plugin" in driver.log()
            assert not (node.registry / f"{DRIVER}-reg.sock").exists()
    finally:
        kubelet.stop()


# ---- preparing and unpreparing ----------------------------------------------------------------------


def test_preparing_a_share_writes_its_cdi_spec_and_the_answer_names_it(node, apiserver, kubelet, start_driver):
    claim = allocated("nb", "u1", [share("gpu-1", "4Gi")], [gpu_config(weight=2)])
    apiserver.put_claim(claim)
    with start_driver() as driver:
        kubelet.wait_for_plugin(DRIVER)
        response = kubelet.prepare(DRIVER, [ref(claim)])
        (device,) = response.claims["u1"].devices
        assert (device.pool_name, device.device_name, list(device.request_names)) == (NODE, "gpu-1", ["gpu"])
        assert list(device.cdi_device_ids) == [f"{DRIVER}/claim=u1-{uuid(1)}"] and device.share_id == "share-of-gpu-1"
        (spec_device,) = node.spec("u1")["devices"]
        assert spec_device["name"] == f"u1-{uuid(1)}"
        env = dict(item.split("=", 1) for item in spec_device["containerEdits"]["env"])
        assert env["NVSHARE_MEMORY_LIMIT"] == f"{uuid(1)}={4 * GiB}" and env["NVIDIA_VISIBLE_DEVICES"] == uuid(1)
        assert env["LD_PRELOAD"] == "/usr/lib/nvshare/libnvshare.so" and env["NVSHARE_SOCKET_DIR"] == str(node.run)
        assert [n["hostPath"] for n in spec_device["containerEdits"]["deviceNodes"]] == [
            str(node.dev / "nvidia1"), str(node.dev / "nvidiactl"), str(node.dev / "nvidia-uvm")]
        driver.wait_for_log(f"prepared claim team-a/nb (u1): gpu-1 ({uuid(1)}, limit {4 * GiB} bytes), weight 2")
        # The scheduler's client socket directory is there before any scheduler (the mount's source).
        assert (node.run / "client").is_dir()


def test_prepare_and_unprepare_are_idempotent(node, apiserver, kubelet, start_driver):
    claim = allocated("nb", "u1", [share()])
    apiserver.put_claim(claim)
    with start_driver():
        kubelet.wait_for_plugin(DRIVER)
        first = kubelet.prepare(DRIVER, [ref(claim)])
        reads = sum(1 for request in apiserver.requests if request["path"].endswith("/resourceclaims/nb"))
        again = kubelet.prepare(DRIVER, [ref(claim)])
        assert again == first and node.specs() == [f"{DRIVER}-claim_u1.json"]
        # The second answer came from what the driver prepared, not from the API server.
        assert sum(1 for request in apiserver.requests if request["path"].endswith("/resourceclaims/nb")) == reads
        # A spec that went missing is written again.
        (node.cdi / f"{DRIVER}-claim_u1.json").unlink()
        assert kubelet.prepare(DRIVER, [ref(claim)]) == first and node.specs() == [f"{DRIVER}-claim_u1.json"]
        for _ in range(2):
            response = kubelet.unprepare(DRIVER, [ref(claim)])
            assert dict(response.claims).keys() == {"u1"} and response.claims["u1"].error == ""
            assert node.specs() == []
        never = ClaimRef("team-a", "u-never", "never")
        assert kubelet.unprepare(DRIVER, [never]).claims["u-never"].error == ""


def test_two_calls_that_prepare_one_claim_at_once_read_it_once(node, apiserver, kubelet, start_driver):
    claim = allocated("shared", "u-shared", [share()])
    apiserver.put_claim(claim)
    apiserver.claim_gate = threading.Event()  # the first call's read waits until the second call is in
    with start_driver("--log-level", "debug") as driver, ThreadPoolExecutor(2) as pool:
        kubelet.wait_for_plugin(DRIVER)
        first = pool.submit(kubelet.prepare, DRIVER, [ref(claim)])
        wait_for(lambda: any(r["path"].endswith("/resourceclaims/shared") for r in list(apiserver.requests)),
                 PATIENCE, "the first call reading the claim")
        second = pool.submit(kubelet.prepare, DRIVER, [ref(claim)])
        driver.wait_for_log("claim team-a/shared is being prepared by another call")
        apiserver.claim_gate.set()
        assert first.result(PATIENCE) == second.result(PATIENCE)
        assert first.result().claims["u-shared"].error == ""
        assert sum(1 for r in apiserver.requests if r["path"].endswith("/resourceclaims/shared")) == 1
        assert driver.log().count("prepared claim team-a/shared ") == 1


def test_prepared_claims_survive_a_restart_of_the_driver(node, apiserver, kubelet, start_driver):
    claim = allocated("nb", "u1", [share("gpu-0", "2Gi")], [gpu_config(priority=3)])
    apiserver.put_claim(claim)
    with start_driver() as driver:
        kubelet.wait_for_plugin(DRIVER)
        before = kubelet.prepare(DRIVER, [ref(claim)])
        driver.stop(signal.SIGKILL)
    apiserver.delete_claim("team-a", "nb")  # what the kubelet asks again now comes from the checkpoint
    with start_driver() as driver:
        kubelet.wait_for_plugin(DRIVER, registrations=2)
        assert kubelet.prepare(DRIVER, [ref(claim)]) == before
        assert kubelet.unprepare(DRIVER, [ref(claim)]).claims["u1"].error == ""
        assert node.specs() == [] and json.loads(node.checkpoint.read_text())["claims"] == []


def test_a_spec_left_by_a_driver_that_stopped_before_recording_it_is_removed(node, apiserver, kubelet, start_driver):
    node.cdi.mkdir()
    (node.cdi / f"{DRIVER}-claim_u-lost.json").write_text("{}")
    (node.cdi / "vendor.example.com-other.json").write_text("{}")  # another driver's: left alone
    with start_driver() as driver:
        driver.wait_for_log(f"removing {node.cdi / f'{DRIVER}-claim_u-lost.json'}")
        assert node.specs() == ["vendor.example.com-other.json"]


def test_a_damaged_checkpoint_stops_the_driver_saying_so(node, apiserver, start_driver):
    node.checkpoint.parent.mkdir(parents=True)
    node.checkpoint.write_text("{not json")
    with start_driver() as driver:
        assert driver.wait() == 1
        assert f"the checkpoint {node.checkpoint} is damaged" in driver.log()


def test_claims_that_cannot_be_prepared_get_their_reason_and_nothing_else(node, apiserver, kubelet, start_driver):
    good = allocated("good", "u-good", [share()])
    cases = {
        "u-elsewhere": (allocated("elsewhere", "u-elsewhere", [share(pool="node-b")]), "from pool 'node-b'"),
        "u-weight": (allocated("heavy", "u-weight", [share()], [gpu_config("FromClaim", weight=5000)]),
                     "weight must be an integer from 1 to 1000"),
        "u-pending": ({"metadata": {"name": "pending", "namespace": "team-a", "uid": "u-pending"}, "status": {}},
                      "is not allocated"),
        "u-old": (dict(allocated("replaced", "u-new", [share()])), "is now another claim (UID u-new, not u-old)"),
    }
    for document, _ in cases.values():
        apiserver.put_claim(document)
    apiserver.put_claim(good)
    refs = [ref(good), ClaimRef("team-a", "u-absent", "absent")]
    refs += [ClaimRef("team-a", uid, document["metadata"]["name"]) for uid, (document, _) in cases.items()]
    with start_driver():
        kubelet.wait_for_plugin(DRIVER)
        response = kubelet.prepare(DRIVER, refs)
        assert set(response.claims) == {r.uid for r in refs}
        assert response.claims["u-good"].error == "" and len(response.claims["u-good"].devices) == 1
        assert "ResourceClaim team-a/absent: not found" in response.claims["u-absent"].error
        for uid, (_, reason) in cases.items():
            assert reason in response.claims[uid].error and not response.claims[uid].devices, uid
        assert node.specs() == [f"{DRIVER}-claim_u-good.json"]
        # Requests that name no claim properly are refused as a whole.
        for claims in ([], [ClaimRef("team-a", "", "nameless")], [ClaimRef("", "u", "x")]):
            with pytest.raises(grpc.RpcError) as refused:
                kubelet.prepare(DRIVER, claims)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as refused:
                kubelet.unprepare(DRIVER, claims)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_claim_is_refused_while_the_library_is_missing_from_the_node(node, apiserver, kubelet, start_driver):
    claim = allocated("nb", "u1", [share()])
    apiserver.put_claim(claim)
    node.library.unlink()
    with start_driver():
        kubelet.wait_for_plugin(DRIVER)
        error = kubelet.prepare(DRIVER, [ref(claim)]).claims["u1"].error
        assert str(node.library) in error and "nvshare-dra-driver install-library" in error
        assert node.specs() == []


def test_a_socket_that_is_removed_is_served_again(node, apiserver, kubelet, start_driver):
    with start_driver() as driver:
        kubelet.wait_for_plugin(DRIVER)
        (node.registry / f"{DRIVER}-reg.sock").unlink()
        driver.wait_for_log("was removed: serving again")
        kubelet.wait_for_plugin(DRIVER, registrations=2)


# ---- the pods' settings in the scheduler -----------------------------------------------------------


def pod_settings(status: dict) -> dict:
    """{(setting, pod_uid, device): value} of the per-pod settings in the scheduler's status."""
    settings = status.get("settings") or status["scheduler"].get("settings") or {}
    found = {}
    for name in ("weight", "priority"):
        for uid, value in settings.get(name, {}).get("pods", {}).items():
            found[name, uid, None] = value
    for device, limits in settings.get("limit", {}).items():
        for uid, value in limits.get("pods", {}).items():
            found["limit", uid, device or None] = value
    return found


def add_pod(apiserver: DraApiServerStandin, name: str, namespace: str, claims: list[str] = (),
            templated: list[str] = ()) -> str:
    uid = apiserver.add_pod(name, NODE, namespace=namespace)
    with apiserver._changed:
        pod = apiserver._pods[namespace, name]
    pod = json.loads(json.dumps(pod))
    pod["spec"]["resourceClaims"] = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)] + \
        [{"name": f"t{i}", "resourceClaimTemplateName": "tmpl"} for i, _ in enumerate(templated)]
    pod["status"]["resourceClaimStatuses"] = [{"name": f"t{i}", "resourceClaimName": c} for i, c in enumerate(templated)]
    apiserver._change("MODIFIED", pod)
    return uid


def test_pods_that_use_a_claim_get_its_settings_in_the_scheduler(node, apiserver, kubelet, start_driver, scheduler):
    shared = allocated("shared", "u-shared", [share("gpu-0", "4Gi")], [gpu_config(weight=3), gpu_config("FromClaim", priority=2)])
    notebook = allocated("nb-gpu-x1", "u-nb", [share("gpu-1", "6Gi")], [gpu_config(weight=5)], namespace="team-b")
    for document in (shared, notebook):
        apiserver.put_claim(document)
    first = add_pod(apiserver, "train-0", "team-a", claims=["shared"])
    other = add_pod(apiserver, "nb", "team-b", templated=["nb-gpu-x1"])
    with start_driver(socket_dir=scheduler.socket_dir) as driver:
        kubelet.wait_for_plugin(DRIVER)
        driver.wait_for_log("following the 2 pods on node")
        assert pod_settings(scheduler.status()) == {}  # nothing before the claims are prepared
        kubelet.prepare(DRIVER, [ref(shared), ref(notebook)])
        expected = {("weight", first, None): 3, ("priority", first, None): 2, ("limit", first, uuid(0)): 4 * GiB,
                    ("weight", other, None): 5, ("limit", other, uuid(1)): 6 * GiB}
        wait_for(lambda: pod_settings(scheduler.status()) == expected, PATIENCE, "the claims' settings per pod")
        # A second pod joins the shared claim after it was prepared (the kubelet prepares a claim once).
        second = add_pod(apiserver, "train-1", "team-a", claims=["shared"])
        expected.update({("weight", second, None): 3, ("priority", second, None): 2, ("limit", second, uuid(0)): 4 * GiB})
        wait_for(lambda: pod_settings(scheduler.status()) == expected, PATIENCE, "the second pod's settings")
        # A restarted scheduler gets them all again, at the next change of the pods (or within
        # the driver's 30 s resync on a quiet node: schedulerlink.py, tested in test_pod_watch.py).
        scheduler.restart()
        add_pod(apiserver, "idle", "team-a")
        wait_for(lambda: pod_settings(scheduler.status()) == expected, PATIENCE, "the settings after a scheduler restart")
        # Unprepared, the claim's pods have no settings left.
        kubelet.unprepare(DRIVER, [ref(shared)])
        wait_for(lambda: pod_settings(scheduler.status()) == {key: value for key, value in expected.items()
                                                                if key[1] == other},
                 PATIENCE, "the shared claim's settings removed")
        apiserver.delete_pod("nb", "team-b")
        wait_for(lambda: pod_settings(scheduler.status()) == {}, PATIENCE, "the deleted pod's settings removed")


def test_a_claims_mode_is_its_gpus_while_it_is_prepared_and_a_claim_asking_another_waits(
        node, apiserver, kubelet, start_driver, scheduler):
    auto = allocated("auto-a", "u-auto-a", [share("gpu-0", "4Gi")], [gpu_config("FromClaim", mode="auto")])
    also_auto = allocated("auto-b", "u-auto-b", [share("gpu-0", "2Gi")], [gpu_config(mode="auto")])  # the class's
    plain = allocated("plain", "u-plain", [share("gpu-0", "2Gi")])
    serial = allocated("serial", "u-off", [share("gpu-0", "2Gi")], [gpu_config("FromClaim", mode="off")])
    for document in (auto, also_auto, plain, serial):
        apiserver.put_claim(document)

    def mode(index: int) -> str:
        """The GPU's mode in the scheduler: its own, or the default where it has none."""
        status = scheduler.status()
        found = next((device for device in status["devices"] if device["device"] == uuid(index)), None)
        return found["mode"] if found else status["scheduler"]["defaults"]["mode"]

    def refusal(claim: dict) -> str:
        return kubelet.prepare(DRIVER, [ref(claim)]).claims[claim["metadata"]["uid"]].error

    assert mode(0) == "on"  # the scheduler's default (tests' DEFAULT_OPTIONS)
    with start_driver(socket_dir=scheduler.socket_dir) as driver:
        kubelet.wait_for_plugin(DRIVER)
        response = kubelet.prepare(DRIVER, [ref(auto), ref(plain)])
        assert response.claims["u-auto-a"].error == "" and response.claims["u-plain"].error == ""
        wait_for(lambda: mode(0) == "auto", PATIENCE, "GPU 0 in the claim's mode")
        # Another mode on that GPU: refused, naming the GPU, its mode and the claim that set it.
        error = refusal(serial)
        assert f"GPU {uuid(0)} is in mode auto, set by ResourceClaim team-a/auto-a; ResourceClaim team-a/serial " \
               "asks for mode off there" in error, error
        assert f"{DRIVER}-claim_u-off.json" not in node.specs()
        assert refusal(also_auto) == ""  # the same mode
        # A restarted scheduler gets the mode again (at the next change of the pods, or the 30 s resync).
        scheduler.restart()
        add_pod(apiserver, "idle", "team-a")
        wait_for(lambda: mode(0) == "auto", PATIENCE, "GPU 0's mode after a scheduler restart")
        driver.stop(signal.SIGKILL)
    scheduler.request("set-mode", mode="auto", device=uuid(1))  # the operator's, on a GPU no claim asks a mode of
    # A restarted driver knows from its checkpoint which claims asked for which mode.
    with start_driver(socket_dir=scheduler.socket_dir) as driver:
        kubelet.wait_for_plugin(DRIVER, registrations=2)
        assert kubelet.unprepare(DRIVER, [ref(auto)]).claims["u-auto-a"].error == ""
        assert "is in mode auto, set by ResourceClaim team-a/auto-b" in refusal(serial)  # auto-b still asks
        assert mode(0) == "auto"
        kubelet.unprepare(DRIVER, [ref(also_auto)])
        wait_for(lambda: mode(0) == "on", PATIENCE, "GPU 0 given back to the scheduler's default")
        # The claim that waited is prepared now (the kubelet asks again until it is).
        assert refusal(serial) == ""
        wait_for(lambda: mode(0) == "off", PATIENCE, "GPU 0 in the waiting claim's mode")
        kubelet.unprepare(DRIVER, [ref(serial), ref(plain)])
        wait_for(lambda: mode(0) == "on", PATIENCE, "GPU 0 given back again")
        driver.wait_for_log(f"GPU {uuid(0)}: mode on (the scheduler's default")
        assert mode(1) == "auto"  # a mode the driver did not set is not undone
        assert json.loads(node.checkpoint.read_text())["modesSet"] == []


# ---- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, reason", [
    (["--node-name", ""], "the node's name is not set"),
    (["--shares", "0"], "shares per GPU must be from 1 to 64"),
    (["--memory-oversubscription", "0.5"], "the memory oversubscription factor must be at least 1"),
    (["--driver-name", "GPU_nvshare"], "must be a DNS subdomain"),
    (["--container-env", "LD_PRELOAD=/x.so"], "set by the plugin itself"),
    (["--library", "relative/libnvshare.so"], "must be absolute"),
])
def test_settings_that_cannot_work_are_usage_errors(node, apiserver, args, reason):
    command = [sys.executable, "-m", "nvshare_py.dra", "serve", "--node-name", NODE, "--api-server", apiserver.url,
               "--api-credentials", str(apiserver.directory), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=PATIENCE)
    assert result.returncode == 2 and reason in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_outside_a_cluster_without_an_api_server_is_a_usage_error(node):
    env = {key: value for key, value in child_env().items() if not key.startswith("KUBERNETES_")}
    result = subprocess.run([sys.executable, "-m", "nvshare_py.dra", "serve", "--node-name", NODE],
                            capture_output=True, text=True, env=env, timeout=PATIENCE)
    assert result.returncode == 2 and "no API server: not in a Kubernetes cluster" in result.stderr


def test_without_the_k8s_extra_the_driver_says_how_to_install_it(tmp_path):
    from test_cli_conventions import blocked, one_line_without_traceback, tool

    env = blocked(tmp_path, "grpc", "httpx")
    assert tool("nvshare_py.dra", "serve", "--help", env=env).returncode == 0
    for command in (["serve", "--node-name", NODE], ["install-library", "--to", str(tmp_path)]):
        result = tool("nvshare_py.dra", *command, env=env)
        line = one_line_without_traceback(result)
        assert result.returncode == 1 and "nvshare-dra-driver: needs the 'k8s' extra" in line, command
