"""The device plugin as a real process, talking to a kubelet stand-in over real gRPC sockets,
with GPUs from the simulated NVML (tests/simcuda/nvml.c)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kubelet_standin import KubeletStandin, is_extended_resource_name
from nvshare_py.deviceplugin.v1beta1 import HEALTHY, UNHEALTHY
from nvshare_py.deviceplugin.v1beta1 import api_pb2 as api
from nvshare_py.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc

REPO = Path(__file__).resolve().parents[1]
RESOURCE = "nvshare.com/gpu"
CONTAINER_LIBRARY = "/usr/lib/nvshare/libnvshare.so"
TIMEOUT = 60.0  # an upper guard only: what the tests wait for comes sooner unless it is broken


def uuid(index: int) -> str:
    return f"GPU-5151ad00-0000-4000-8000-{index:012x}"


def device(gpu: int, replica: int) -> str:
    return f"{uuid(gpu)}::{replica}"


@pytest.fixture(scope="session")
def simnvml_dir():
    build = Path(tempfile.mkdtemp(prefix="nvs-nvml-", dir="/tmp"))
    subprocess.run(["make", "-s", "-C", str(REPO / "tests" / "simcuda"), f"BUILD={build}",
                    f"{build}/libnvidia-ml.so.1"], check=True)
    yield build
    shutil.rmtree(build)


@dataclass
class Node:
    """The host paths of one simulated node."""

    root: Path

    @property
    def plugin_dir(self) -> Path:
        return self.root / "dp"

    @property
    def socket_dir(self) -> Path:
        return self.root / "run"

    @property
    def library(self) -> Path:
        return self.root / "lib" / "libnvshare.so"

    @property
    def preload_file(self) -> Path:
        return self.root / "lib" / "ld.so.preload"

    @property
    def device_dir(self) -> Path:
        """The node's /dev as the plugin sees it: empty unless a test puts device nodes there."""
        return self.root / "dev"

    @property
    def state_file(self) -> Path:
        return self.root / "nvml-state"

    def set_gpu_states(self, text: str) -> None:
        scratch = self.root / "nvml-state.new"
        scratch.write_text(text)
        scratch.replace(self.state_file)  # the plugin never reads half a file


@contextmanager
def make_node():
    node = Node(Path(tempfile.mkdtemp(prefix="nvs-", dir="/tmp")))
    node.library.parent.mkdir()
    node.library.write_bytes(b"\x7fELF stand-in for libnvshare.so")
    node.device_dir.mkdir()
    try:
        yield node
    finally:
        shutil.rmtree(node.root)


class PluginProcess:
    def __init__(self, node: Node, nvml_dir: Path, gpus: int, args: list[str]):
        self.node = node
        self.log_path = node.root / f"plugin-{time.monotonic_ns()}.log"
        env = dict(os.environ, LD_LIBRARY_PATH=str(nvml_dir), SIMCUDA_DEVICES=str(gpus),
                   SIMCUDA_MEMORY="8G", SIMNVML_STATE=str(node.state_file), PYTHONUNBUFFERED="1")
        command = [sys.executable, "-m", "nvshare_py.deviceplugin", "serve",
                   "--device-plugin-dir", str(node.plugin_dir), "--socket-dir", str(node.socket_dir),
                   "--library", str(node.library), "--preload-file", str(node.preload_file),
                   "--device-dir", str(node.device_dir),
                   "--health-interval", "0.1", "--kubelet-watch-interval", "0.1", *args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_log(self, text: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{text!r} not in the plugin log:\n{self.log()}")
            time.sleep(0.05)

    def wait(self, timeout: float = TIMEOUT) -> int:
        return self.process.wait(timeout)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


@contextmanager
def running_plugin(node: Node, nvml_dir: Path, gpus: int = 2, args: list[str] = ()):
    plugin = PluginProcess(node, nvml_dir, gpus, list(args))
    try:
        yield plugin
    finally:
        plugin.stop()


@contextmanager
def running_kubelet(node: Node, **options):
    kubelet = KubeletStandin(node.plugin_dir, **options)
    kubelet.start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


@pytest.fixture
def node():
    with make_node() as made:
        yield made


@pytest.fixture
def kubelet(node):
    with running_kubelet(node) as standin:
        yield standin


def all_devices(gpus: int, replicas: int, health: str = HEALTHY) -> dict[str, str]:
    return {device(gpu, replica): health for gpu in range(gpus) for replica in range(replicas)}


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


# ---- one plugin shared by the tests that do not change its state ------------------------------

@dataclass
class Shared:
    node: Node
    kubelet: KubeletStandin
    plugin: PluginProcess


@pytest.fixture(scope="module")
def shared(simnvml_dir):
    with make_node() as node, running_kubelet(node) as kubelet, running_plugin(
            node, simnvml_dir, gpus=2, args=["--replicas", "3", "--container-env", "NVSHARE_FAIL_MODE=closed",
                                             "--container-env", "NVSHARE_LOG=debug"]) as plugin:
        kubelet.wait_for_devices(RESOURCE)
        yield Shared(node, kubelet, plugin)


def test_registers_with_the_kubelet_and_advertises_every_gpu(shared):
    (registration,) = shared.kubelet.registrations
    assert registration.version == "v1beta1"
    assert registration.resource_name == RESOURCE
    assert registration.endpoint == "nvshare.sock"
    assert registration.options.get_preferred_allocation_available
    # The stand-in fetched the options from the plugin's socket inside Register, so the plugin
    # was serving before it registered.
    assert shared.kubelet.plugin(RESOURCE).options.get_preferred_allocation_available
    assert shared.kubelet.wait_for_devices(RESOURCE) == all_devices(gpus=2, replicas=3)
    # The plugin logs its registration after Register returned, so the line may still be coming.
    shared.plugin.wait_for_log("registered nvshare.com/gpu")
    log = shared.plugin.log()
    assert uuid(0) in log and uuid(1) in log


def test_allocate_injects_the_interceptor_the_client_sockets_and_the_gpu(shared):
    response = shared.kubelet.allocate(RESOURCE, [[device(1, 2)]])
    (container,) = response.container_responses
    client_dir = str(shared.node.socket_dir / "client")
    assert dict(container.envs) == {
        "NVIDIA_VISIBLE_DEVICES": uuid(1),
        "LD_PRELOAD": CONTAINER_LIBRARY,
        "NVSHARE_SOCKET_DIR": str(shared.node.socket_dir),
        "NVSHARE_FAIL_MODE": "closed",
        "NVSHARE_LOG": "debug",
    }
    assert {(m.container_path, m.host_path, m.read_only) for m in container.mounts} == {
        (client_dir, client_dir, True),
        (CONTAINER_LIBRARY, str(shared.node.library), True),
    }
    assert not any("control" in m.host_path for m in container.mounts)
    assert not container.devices and not container.cdi_devices
    assert (shared.node.socket_dir / "client").is_dir()  # the mount source exists before the scheduler runs
    assert f"allocated {device(1, 2)} to a container: GPU 1 ({uuid(1)})" in shared.plugin.log()


def test_allocate_for_several_containers_and_several_gpus(shared):
    response = shared.kubelet.allocate(RESOURCE, [[device(1, 0), device(0, 0)], [device(0, 1)]])
    both, one = response.container_responses
    assert both.envs["NVIDIA_VISIBLE_DEVICES"] == f"{uuid(0)},{uuid(1)}"
    assert one.envs["NVIDIA_VISIBLE_DEVICES"] == uuid(0)


def test_two_devices_of_one_gpu_in_one_container_are_refused(shared):
    error = rpc_error(lambda: shared.kubelet.allocate(RESOURCE, [[device(0, 0), device(0, 1)]]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "distinct GPUs" in error.details() and uuid(0) in error.details()


@pytest.mark.parametrize("containers", [
    [[device(0, 0)], ["GPU-00000000-dead-beef-0000-000000000000::0"]],  # a GPU this node lacks
    [[device(1, 3)]],  # a replica beyond --replicas
    [[uuid(0)]],  # a physical UUID is not a device ID
    [[]],
    [],
])
def test_bad_allocate_requests_are_refused_and_nothing_is_injected(shared, containers):
    error = rpc_error(lambda: shared.kubelet.allocate(RESOURCE, containers))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    for ids in containers:
        for device_id in ids:
            if device_id != device(0, 0):
                assert device_id in error.details()


def test_preferred_allocation_gives_a_container_distinct_gpus(shared):
    everything = list(all_devices(gpus=2, replicas=3))
    two = shared.kubelet.preferred_allocation(RESOURCE, everything, [], 2)
    assert sorted(d.split("::")[0] for d in two) == [uuid(0), uuid(1)]
    kept = shared.kubelet.preferred_allocation(RESOURCE, everything, [device(1, 2)], 2)
    assert kept[0] == device(1, 2) and kept[1].startswith(uuid(0))
    # Three GPUs' worth on a two-GPU node: only what can be distinct is suggested.
    assert len(shared.kubelet.preferred_allocation(RESOURCE, everything, [], 3)) == 2


def test_spread_policy_suggests_the_least_shared_gpu(shared):
    available = [device(0, 1), device(0, 2), device(1, 0), device(1, 1), device(1, 2)]
    assert shared.kubelet.preferred_allocation(RESOURCE, available, [], 1) == [device(1, 0)]


def test_preferred_allocation_with_unknown_ids_is_refused(shared):
    error = rpc_error(lambda: shared.kubelet.preferred_allocation(RESOURCE, ["GPU-x::0"], [], 1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "GPU-x::0" in error.details()


# ---- tests with a plugin of their own ----------------------------------------------------------

def test_pack_policy_fills_one_gpu_before_the_next(node, kubelet, simnvml_dir):
    with running_plugin(node, simnvml_dir, args=["--replicas", "3", "--allocation", "pack"]):
        kubelet.wait_for_devices(RESOURCE)
        available = [device(0, 1), device(0, 2), device(1, 0), device(1, 1), device(1, 2)]
        assert kubelet.preferred_allocation(RESOURCE, available, [], 1) == [device(0, 1)]


def test_reregisters_after_a_kubelet_restart(node, kubelet, simnvml_dir):
    with running_plugin(node, simnvml_dir, args=["--replicas", "2"]) as plugin:
        kubelet.wait_for_devices(RESOURCE)
        kubelet.restart()
        # At least two: the plugin may notice the restart while the stand-in is still deleting
        # plugin sockets, lose the socket it has just made, and register a third time; a check
        # for exactly two can miss that moment on a busy machine and wait forever.
        kubelet.wait_until(lambda: len(kubelet.registrations) >= 2, TIMEOUT, "second registration")
        assert kubelet.wait_for_devices(RESOURCE) == all_devices(gpus=2, replicas=2)
        response = kubelet.allocate(RESOURCE, [[device(0, 1)]])
        assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == uuid(0)
        assert "kubelet restart" in plugin.log() or "was removed" in plugin.log()


def test_a_gpu_that_disappears_becomes_unhealthy_and_recovers(node, kubelet, simnvml_dir):
    with running_plugin(node, simnvml_dir, args=["--replicas", "2"]) as plugin:
        kubelet.wait_for_devices(RESOURCE)
        node.set_gpu_states("1 gone\n")
        expected = {**all_devices(1, 2), device(1, 0): UNHEALTHY, device(1, 1): UNHEALTHY}
        kubelet.wait_for_devices(RESOURCE, lambda devices: devices == expected)
        error = rpc_error(lambda: kubelet.allocate(RESOURCE, [[device(1, 0)]]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and uuid(1) in error.details()
        assert kubelet.preferred_allocation(RESOURCE, list(expected), [], 1) == [device(0, 0)]
        assert f"GPU 1 ({uuid(1)}) is gone" in plugin.log()

        node.set_gpu_states("1 ok\n")
        kubelet.wait_for_devices(RESOURCE, lambda devices: devices == all_devices(2, 2))


def test_a_critical_xid_makes_a_gpu_unhealthy_until_restart(node, kubelet, simnvml_dir):
    with running_plugin(node, simnvml_dir, args=["--replicas", "2"]) as plugin:
        kubelet.wait_for_devices(RESOURCE)
        node.set_gpu_states("0 xid:13\n")  # an application fault: the GPU stays healthy
        plugin.wait_for_log("reported Xid 13, an application fault")
        assert kubelet.plugin(RESOURCE).devices == all_devices(2, 2)

        node.set_gpu_states("0 xid:79\n")
        unhealthy_0 = {**all_devices(2, 2), device(0, 0): UNHEALTHY, device(0, 1): UNHEALTHY}
        kubelet.wait_for_devices(RESOURCE, lambda devices: devices == unhealthy_0)
        assert "critical Xid 79" in plugin.log()

        # The GPU answers again, but a fatal Xid is sticky: when GPU 1 then goes, GPU 0 is
        # still reported unhealthy in the same list.
        node.set_gpu_states("0 ok\n1 gone\n")
        kubelet.wait_for_devices(RESOURCE, lambda devices: devices == all_devices(2, 2, UNHEALTHY))


def test_preload_file_mode_mounts_an_ld_so_preload(node, kubelet, simnvml_dir):
    with running_plugin(node, simnvml_dir, gpus=1, args=["--preload", "file"]):
        kubelet.wait_for_devices(RESOURCE)
        assert node.preload_file.read_text() == f"{CONTAINER_LIBRARY}\n"
        (container,) = kubelet.allocate(RESOURCE, [[device(0, 4)]]).container_responses
        assert "LD_PRELOAD" not in container.envs
        mounts = {m.container_path: (m.host_path, m.read_only) for m in container.mounts}
        assert mounts["/etc/ld.so.preload"] == (str(node.preload_file), True)
        assert mounts[CONTAINER_LIBRARY] == (str(node.library), True)


def test_a_missing_library_fails_the_allocation(node, kubelet, simnvml_dir):
    with running_plugin(node, simnvml_dir, gpus=1):
        kubelet.wait_for_devices(RESOURCE)
        node.library.unlink()
        error = rpc_error(lambda: kubelet.allocate(RESOURCE, [[device(0, 0)]]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert str(node.library) in error.details() and "install-library" in error.details()


def test_sigterm_stops_the_plugin_cleanly(node, kubelet, simnvml_dir):
    plugin = PluginProcess(node, simnvml_dir, 1, [])
    try:
        kubelet.wait_for_devices(RESOURCE)
        connection = kubelet.plugin(RESOURCE)
    finally:
        assert plugin.stop() == 0
    assert not (node.plugin_dir / "nvshare.sock").exists()
    assert "SIGTERM received" in plugin.log() and plugin.log().rstrip().endswith("stopped")
    kubelet.wait_until(lambda: connection.stream_ended, TIMEOUT, "end of ListAndWatch")


def test_a_kubelet_refusal_stops_the_plugin_with_the_reason(node, simnvml_dir):
    with running_kubelet(node, supported_versions=("v1beta2",)) as kubelet, \
            running_plugin(node, simnvml_dir, gpus=1) as plugin:
        assert plugin.wait() == 1
        assert kubelet.refusals and "kubelet refused to register" in plugin.log()
        assert "'v1beta1' is not supported" in plugin.log()
        assert not kubelet.registrations


def test_a_node_without_gpus_is_an_error(node, kubelet, simnvml_dir):
    with running_plugin(node, simnvml_dir, gpus=0) as plugin:
        assert plugin.wait() == 1
        assert "no usable GPU" in plugin.log()


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "replicas must be from 1 to 999"),
    (["--container-env", "LD_PRELOAD=/x.so"], "set by the plugin itself"),
    (["--resource-name", "gpu"], "must be <domain>/<name>"),
    (["--ignored-xids", "13,x"], "not a comma-separated list"),
    (["--cdi", "uuid", "--cdi-kind", "gpu"], "is not vendor.com/class"),
])
def test_invalid_settings_fail_before_anything_starts(node, simnvml_dir, args, message):
    with running_plugin(node, simnvml_dir, args=args) as plugin:
        assert plugin.wait() == 2  # a usage error, as every nvshare tool's
        assert message in plugin.log()
    assert not node.plugin_dir.exists() or not any(node.plugin_dir.iterdir())


def test_the_standin_refuses_what_the_kubelet_refuses(node, kubelet):
    with grpc.insecure_channel(f"unix://{kubelet.socket}") as channel:
        register = api_grpc.RegistrationStub(channel).Register
        for request in (api.RegisterRequest(version="v1alpha", endpoint="x.sock", resource_name=RESOURCE),
                        api.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="gpu"),
                        api.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="kubernetes.io/gpu")):
            error = rpc_error(lambda: register(request, timeout=TIMEOUT))
            assert error.code() == grpc.StatusCode.UNKNOWN
    assert len(kubelet.refusals) == 3 and not kubelet.registrations
    assert is_extended_resource_name(RESOURCE) and not is_extended_resource_name("nvshare.com/-gpu")


def test_install_library_replaces_the_node_copy(tmp_path):
    source = tmp_path / "built.so"
    source.write_bytes(b"new library")
    target_dir = tmp_path / "node" / "lib"
    target_dir.mkdir(parents=True)
    (target_dir / "libnvshare.so").write_bytes(b"old library")
    held_open = open(target_dir / "libnvshare.so", "rb")  # a running container's mapping
    command = [sys.executable, "-m", "nvshare_py.deviceplugin", "install-library", "--to", str(target_dir)]
    done = subprocess.run([*command, "--from", str(source)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (target_dir / "libnvshare.so").read_bytes() == b"new library"
    assert (target_dir / "libnvshare.so").stat().st_mode & 0o777 == 0o755
    assert held_open.read() == b"old library"
    held_open.close()
    assert sorted(p.name for p in target_dir.iterdir()) == ["libnvshare.so"]

    missing = subprocess.run([*command, "--from", str(tmp_path / "absent.so")], cwd=REPO,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "absent.so does not exist" in missing.stderr


def test_install_library_failures_are_reported_and_leave_nothing_behind(tmp_path):
    source = tmp_path / "built.so"
    source.write_bytes(b"new library")
    target_dir = tmp_path / "lib"
    (target_dir / "libnvshare.so").mkdir(parents=True)  # in the way of the rename
    done = subprocess.run([sys.executable, "-m", "nvshare_py.deviceplugin", "install-library", "--to", str(target_dir),
                           "--from", str(source)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 1
    assert f"cannot install {source} as {target_dir / 'libnvshare.so'}" in done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in target_dir.iterdir()) == ["libnvshare.so"]  # no scratch copy left


def test_a_node_file_that_cannot_be_written_stops_the_plugin_with_the_reason(node, simnvml_dir):
    blocker = node.root / "a-file"
    blocker.write_text("")
    with running_plugin(node, simnvml_dir, gpus=1,
                        args=["--preload", "file", "--preload-file", str(blocker / "ld.so.preload")]) as plugin:
        assert plugin.wait() == 1
        assert f"cannot prepare {blocker} on the node" in plugin.log()
        assert "Traceback" not in plugin.log()


def real_gpu_uuids() -> list[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.split() if done.returncode == 0 else []


@pytest.mark.gpu
def test_advertises_the_real_gpus_through_the_real_nvml(node, kubelet):
    uuids = real_gpu_uuids()
    if not uuids:
        pytest.skip("no NVIDIA GPU here")
    command = [sys.executable, "-m", "nvshare_py.deviceplugin", "serve", "--replicas", "2",
               "--device-plugin-dir", str(node.plugin_dir), "--socket-dir", str(node.socket_dir),
               "--library", str(node.library), "--health-interval", "0.2"]
    log_path = node.root / "plugin.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        devices = kubelet.wait_for_devices(RESOURCE)
        assert devices == {f"{gpu}::{n}": HEALTHY for gpu in uuids for n in range(2)}
        (container,) = kubelet.allocate(RESOURCE, [[f"{uuids[-1]}::1"]]).container_responses
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == uuids[-1]
        time.sleep(2)  # ten health checks against the real driver
        assert kubelet.plugin(RESOURCE).devices == devices
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0, log_path.read_text()
    print(log_path.read_text())


def test_a_hung_nvml_call_stalls_neither_allocate_nor_list_and_watch(node, kubelet, simnvml_dir):
    with running_plugin(node, simnvml_dir, args=["--replicas", "2"]) as plugin:
        kubelet.wait_for_devices(RESOURCE)
        node.set_gpu_states("0 hang\n")
        plugin.wait_for_log("simnvml: GPU 0: nvmlDeviceGetHandleByUUID hangs")
        # The health check is stuck inside NVML from here on; the kubelet is still served.
        (container,) = kubelet.allocate(RESOURCE, [[device(1, 0)]]).container_responses
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == uuid(1)
        kubelet.restart()  # a new registration and a new ListAndWatch stream
        kubelet.wait_until(lambda: len(kubelet.registrations) == 2, TIMEOUT, "second registration")
        assert kubelet.wait_for_devices(RESOURCE) == all_devices(gpus=2, replicas=2)
        plugin.wait_for_log("NVML has not answered a health check")

        # Once NVML answers again, health checks go on.
        node.set_gpu_states("1 gone\n")
        expected = {**all_devices(1, 2), device(1, 0): UNHEALTHY, device(1, 1): UNHEALTHY}
        kubelet.wait_for_devices(RESOURCE, lambda devices: devices == expected)


def test_the_plugin_waits_for_the_device_plugin_directory(node, simnvml_dir):
    with running_plugin(node, simnvml_dir, gpus=1) as plugin:
        plugin.wait_for_log("waiting for the device-plugin directory")
        assert plugin.process.poll() is None
        with running_kubelet(node) as kubelet:  # creates the directory, as a starting kubelet does
            assert kubelet.wait_for_devices(RESOURCE) == all_devices(gpus=1, replicas=10)


def test_device_nodes_on_the_node_are_passed_as_device_specs(node, kubelet, simnvml_dir):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):  # no nvidia-uvm-tools here
        (node.device_dir / name).touch()
    with running_plugin(node, simnvml_dir, gpus=2):
        kubelet.wait_for_devices(RESOURCE)
        (container,) = kubelet.allocate(RESOURCE, [[device(1, 0)]]).container_responses
        assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
            ("/dev/nvidia1", str(node.device_dir / "nvidia1"), "rw"),
            ("/dev/nvidiactl", str(node.device_dir / "nvidiactl"), "rw"),
            ("/dev/nvidia-uvm", str(node.device_dir / "nvidia-uvm"), "rw"),
        ]
        assert not container.cdi_devices


def test_no_device_specs_when_turned_off(node, kubelet, simnvml_dir):
    (node.device_dir / "nvidia0").touch()
    with running_plugin(node, simnvml_dir, gpus=1, args=["--no-device-specs"]):
        kubelet.wait_for_devices(RESOURCE)
        (container,) = kubelet.allocate(RESOURCE, [[device(0, 0)]]).container_responses
        assert not container.devices


@pytest.mark.parametrize("names, expected", [("uuid", [f"nvidia.com/gpu={uuid(0)}", f"nvidia.com/gpu={uuid(1)}"]),
                                             ("index", ["nvidia.com/gpu=0", "nvidia.com/gpu=1"])])
def test_cdi_names_the_containers_gpus(node, kubelet, simnvml_dir, names, expected):
    with running_plugin(node, simnvml_dir, gpus=2, args=["--cdi", names]):
        kubelet.wait_for_devices(RESOURCE)
        (container,) = kubelet.allocate(RESOURCE, [[device(1, 0), device(0, 2)]]).container_responses
        assert [d.name for d in container.cdi_devices] == expected
        assert container.envs["NVIDIA_VISIBLE_DEVICES"] == f"{uuid(0)},{uuid(1)}"
