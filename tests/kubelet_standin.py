"""A stand-in for the kubelet's device manager, built from the same v1beta1 proto as the plugin.

It does what the kubelet does with a device plugin, in the same order:
- serves `Registration` on `<dir>/kubelet.sock`; `Register` checks the API version and that the
  resource is a valid extended resource name, dials `<dir>/<endpoint>` and calls
  `GetDevicePluginOptions` before it answers, then starts consuming `ListAndWatch`;
- a second registration of one resource replaces the first plugin connection;
- `allocate` / `preferred_allocation` call the plugin as the kubelet does at pod admission;
- `restart()` is a kubelet restart: the old server goes away, every socket in the directory
  (the plugins' too) is deleted, and a new `kubelet.sock` is created.

It is a test double for what the kubelet checks and calls, not for its scheduling decisions.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from nvshare_py.deviceplugin.v1beta1 import API_VERSION, KUBELET_SOCKET
from nvshare_py.deviceplugin.v1beta1 import api_pb2 as api
from nvshare_py.deviceplugin.v1beta1 import api_pb2_grpc as api_grpc

DIAL_TIMEOUT_S = 30.0  # upper guards only, generous for a busy machine
WAIT_TIMEOUT_S = 60.0
_QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's rule: domain-prefixed, not in kubernetes.io, and `requests.<name>` must be
    a qualified name (optional DNS-subdomain prefix, then a name part of at most 63)."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, part = f"requests.{name}".rpartition("/")
    return (0 < len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.match(prefix))
            and 0 < len(part) <= 63 and bool(_QUALIFIED_NAME_PART.match(part)))


@dataclass
class PluginConnection:
    """The kubelet's side of one registered plugin."""

    resource: str
    endpoint: Path
    channel: grpc.Channel
    stub: api_grpc.DevicePluginStub
    options: api.DevicePluginOptions
    device_lists: list[dict[str, str]] = field(default_factory=list)  # every ListAndWatch message
    stream_error: grpc.RpcError | None = None
    stream_ended: bool = False

    @property
    def devices(self) -> dict[str, str]:
        """The latest device list: ID -> health."""
        return self.device_lists[-1] if self.device_lists else {}


class _RegistrationService(api_grpc.RegistrationServicer):
    def __init__(self, kubelet: "KubeletStandin"):
        self.kubelet = kubelet

    def Register(self, request, context):
        return self.kubelet._register(request, context)


class KubeletStandin:
    def __init__(self, plugin_dir: Path, supported_versions: tuple[str, ...] = (API_VERSION,)):
        self.plugin_dir = Path(plugin_dir)
        self.supported_versions = supported_versions
        self.registrations: list[api.RegisterRequest] = []  # accepted ones, in order
        self.refusals: list[str] = []
        self._plugins: dict[str, PluginConnection] = {}
        self._changed = threading.Condition()
        self._server: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet"))
        api_grpc.add_RegistrationServicer_to_server(_RegistrationService(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        """The kubelet process goes away: its server and its plugin connections close."""
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        with self._changed:
            plugins = list(self._plugins.values())
            self._plugins.clear()
            self._changed.notify_all()
        for plugin in plugins:
            plugin.channel.close()
        self.socket.unlink(missing_ok=True)

    def restart(self) -> None:
        """What a kubelet restart looks like to plugins."""
        self.stop()
        for entry in self.plugin_dir.iterdir():
            if entry.is_socket():
                entry.unlink(missing_ok=True)  # a plugin may remove its own meanwhile
        self.start()

    # ---- the kubelet's Register handler ----------------------------------------------------

    def _refuse(self, context, message: str):
        with self._changed:
            self.refusals.append(message)
            self._changed.notify_all()
        # The kubelet answers with a plain Go error, which gRPC sends as UNKNOWN.
        context.abort(grpc.StatusCode.UNKNOWN, message)

    def _register(self, request: api.RegisterRequest, context) -> api.Empty:
        if request.version not in self.supported_versions:
            self._refuse(context, f"requested device plugin API version {request.version!r} is not "
                                  f"supported by kubelet; supported versions are {list(self.supported_versions)}")
        if not is_extended_resource_name(request.resource_name):
            self._refuse(context, f"invalid resource name {request.resource_name!r}: not an extended resource")
        if not request.endpoint or "/" in request.endpoint:
            self._refuse(context, f"invalid endpoint {request.endpoint!r}")
        endpoint = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{endpoint}")
        stub = api_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(api.Empty(), timeout=DIAL_TIMEOUT_S, wait_for_ready=True)
        except grpc.RpcError as error:
            channel.close()
            self._refuse(context, f"failed to dial device plugin at {endpoint}: {error.details()}")
        plugin = PluginConnection(request.resource_name, endpoint, channel, stub, options)
        with self._changed:
            previous = self._plugins.get(request.resource_name)
            self._plugins[request.resource_name] = plugin
            self.registrations.append(request)
            self._changed.notify_all()
        if previous is not None:
            previous.channel.close()
        threading.Thread(target=self._consume_list_and_watch, args=(plugin,), daemon=True,
                         name=f"list-and-watch {request.resource_name}").start()
        return api.Empty()

    def _consume_list_and_watch(self, plugin: PluginConnection) -> None:
        try:
            for response in plugin.stub.ListAndWatch(api.Empty()):
                with self._changed:
                    plugin.device_lists.append({device.ID: device.health for device in response.devices})
                    self._changed.notify_all()
        except grpc.RpcError as error:
            plugin.stream_error = error
        finally:
            with self._changed:
                plugin.stream_ended = True
                self._changed.notify_all()

    # ---- what tests use -------------------------------------------------------------------

    def wait_until(self, predicate, timeout: float = WAIT_TIMEOUT_S, what: str = "condition"):
        """Waits for `predicate()` to return something true, re-checked on every change."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = predicate()
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kubelet stand-in: no {what} within {timeout} s; last saw {result!r}, "
                                       f"device lists {self._device_lists()}")
                self._changed.wait(min(left, 0.5))

    def _device_lists(self) -> dict[str, dict[str, str]]:
        """What each registered plugin advertised last (for messages); under `_changed`."""
        return {resource: dict(plugin.devices) for resource, plugin in self._plugins.items()}

    def plugin(self, resource: str) -> PluginConnection | None:
        with self._changed:
            return self._plugins.get(resource)

    def wait_for_devices(self, resource: str, predicate=lambda devices: bool(devices),
                         timeout: float = WAIT_TIMEOUT_S) -> dict[str, str]:
        """The latest device list of `resource` once it satisfies `predicate`."""
        def check():
            plugin = self._plugins.get(resource)
            return plugin is not None and predicate(plugin.devices) and dict(plugin.devices)
        return self.wait_until(check, timeout, f"device list of {resource} as expected")

    def allocate(self, resource: str, containers: list[list[str]]) -> api.AllocateResponse:
        plugin = self._connected(resource)
        request = api.AllocateRequest(container_requests=[
            api.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        return plugin.stub.Allocate(request, timeout=DIAL_TIMEOUT_S)

    def preferred_allocation(self, resource: str, available: list[str], must_include: list[str],
                             size: int) -> list[str]:
        plugin = self._connected(resource)
        if not plugin.options.get_preferred_allocation_available:
            raise AssertionError(f"{resource} did not offer GetPreferredAllocation")
        request = api.PreferredAllocationRequest(container_requests=[api.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size)])
        response = plugin.stub.GetPreferredAllocation(request, timeout=DIAL_TIMEOUT_S)
        return list(response.container_responses[0].deviceIDs)

    def _connected(self, resource: str) -> PluginConnection:
        plugin = self.plugin(resource)
        if plugin is None:
            raise AssertionError(f"no device plugin registered for {resource}")
        return plugin
