"""The device plugin's I/O shell: the gRPC service the kubelet calls, registration with the
kubelet, re-registration after a kubelet restart, and the health watch.

Everything runs on one asyncio event loop (grpc.aio): the kubelet calls back into this process
while `Register` is in flight, so serving and registering must not block each other. The tasks
form one tree owned by `Plugin.run`; SIGTERM ends it, which stops the server and removes the
plugin's socket. The one exception is NVML: a driver call can hang (a GPU falling off the bus,
a wedged driver), so every NVML call after start-up runs on a thread of its own (`NvmlThread`)
and the loop only applies what it found. A hung call then stalls health checks, never
Allocate or ListAndWatch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import grpc

from .config import CdiNames, PluginConfig
from .injection import HostError, MissingHostFile, container_edits, prepare_host
from .inventory import PhysicalGpu, GpuUnavailable, InvalidRequest, Inventory
from .kubeapi import ApiServer
from .nvml import Nvml
from .podwatch import PodSettingsSync
from .tasks import run_until_first_exits
from .v1beta1 import API_VERSION, HEALTHY
from .v1beta1 import api_pb2 as api
from .v1beta1 import api_pb2_grpc as api_grpc

log = logging.getLogger(__name__)

INSTALLER = "nvshare-device-plugin"  # the command whose install-library puts libnvshare.so on the node
REGISTER_TIMEOUT_S = 10.0
SERVER_STOP_GRACE_S = 1.0
# A health check that takes this many health intervals (at least NVML_SLOW_MIN_S) is logged
# as NVML not answering.
NVML_SLOW_INTERVALS = 5
NVML_SLOW_MIN_S = 1.0
NVML_STOP_WAIT_S = 2.0  # at exit, for the NVML thread to finish its call

T = TypeVar("T")


class PluginError(RuntimeError):
    """The plugin cannot go on; the message is meant for the operator."""


class Changes:
    """Tells ListAndWatch streams that the device list changed."""

    def __init__(self) -> None:
        self._version = 0
        self._condition = asyncio.Condition()

    async def notify(self) -> None:
        async with self._condition:
            self._version += 1
            self._condition.notify_all()

    async def wait_newer(self, seen: int | None) -> int:
        """Returns at once for `seen=None`, else once the version is past `seen`."""
        async with self._condition:
            await self._condition.wait_for(lambda: seen is None or self._version != seen)
            return self._version


def container_response(config: PluginConfig, gpus: list[PhysicalGpu]) -> api.ContainerAllocateResponse:
    """What one container needs in order to run under nvshare on `gpus` (injection.py)."""
    edits = container_edits(config.injection, gpus, INSTALLER)
    return api.ContainerAllocateResponse(
        envs=edits.env,
        mounts=[api.Mount(container_path=mount.container_path, host_path=mount.host_path, read_only=mount.read_only)
                for mount in edits.mounts],
        devices=[api.DeviceSpec(container_path=node.container_path, host_path=node.host_path,
                                permissions=node.permissions) for node in edits.device_nodes],
        cdi_devices=cdi_devices(config, gpus))


def cdi_devices(config: PluginConfig, gpus: list[PhysicalGpu]) -> list[api.CDIDevice]:
    """The GPUs as fully qualified CDI device names, for runtimes that resolve them (see
    docs/kubernetes.md)."""
    if config.cdi is CdiNames.OFF:
        return []
    return [api.CDIDevice(name=f"{config.cdi_kind}={gpu.uuid if config.cdi is CdiNames.UUID else gpu.index}")
            for gpu in gpus]


class DevicePluginService(api_grpc.DevicePluginServicer):
    def __init__(self, config: PluginConfig, inventory: Inventory, changes: Changes):
        self.config = config
        self.inventory = inventory
        self.changes = changes

    async def GetDevicePluginOptions(self, request, context):
        return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request, context):
        log.info("the kubelet is watching the device list")
        seen = None
        while True:
            seen = await self.changes.wait_newer(seen)
            devices = self.inventory.devices()
            healthy = sum(health == HEALTHY for _, health in devices)
            log.info("sending the device list: %d of %d devices healthy", healthy, len(devices))
            yield api.ListAndWatchResponse(devices=[api.Device(ID=device_id, health=health)
                                                    for device_id, health in devices])

    async def GetPreferredAllocation(self, request, context):
        responses = []
        for container in request.container_requests:
            try:
                chosen = self.inventory.preferred(list(container.available_deviceIDs),
                                                  list(container.must_include_deviceIDs),
                                                  container.allocation_size, self.config.allocation)
            except InvalidRequest as error:
                log.warning("refused a preferred-allocation request: %s", error)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            responses.append(api.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return api.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request, context):
        # All containers or none: every answer is computed before anything is returned.
        try:
            if not request.container_requests:
                raise InvalidRequest("an Allocate request without containers")
            answers = []
            for container in request.container_requests:
                gpus = self.inventory.resolve(list(container.devices_ids))
                answers.append((container, gpus, container_response(self.config, gpus)))
        except InvalidRequest as error:
            log.warning("refused an allocation: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except (GpuUnavailable, MissingHostFile) as error:
            log.warning("refused an allocation: %s", error)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        for container, gpus, _ in answers:
            log.info("allocated %s to a container: GPU %s", ", ".join(container.devices_ids),
                     ", ".join(f"{gpu.index} ({gpu.uuid})" for gpu in gpus))
        return api.AllocateResponse(container_responses=[answer for _, _, answer in answers])

    async def PreStartContainer(self, request, context):
        return api.PreStartContainerResponse()


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Tells a recreated file from the old one (inode numbers alone may be reused)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


class NvmlThread:
    """One daemon thread that makes NVML calls in order; `call` awaits the result without
    blocking the loop. A call that never returns keeps the thread, and the calls queued behind
    it, but nothing else; being a daemon thread it does not keep the process from exiting."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_since: float | None = None  # monotonic start of the call in progress
        self._thread = threading.Thread(target=self._run, name="nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            function, loop, future = item
            self.busy_since = time.monotonic()
            try:
                result = function()
            except BaseException as error:  # handed to the awaiting task, which decides
                loop.call_soon_threadsafe(_settle, future, None, error)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)
            finally:
                self.busy_since = None

    async def call(self, function: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((function, loop, future))
        return await future

    def stop(self, timeout: float) -> bool:
        """Ends the thread after the calls queued before; False if it is still busy after
        `timeout` seconds (a hung call)."""
        self._calls.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Plugin:
    def __init__(self, config: PluginConfig, nvml: Nvml, inventory: Inventory,
                 pod_settings: PodSettingsSync | None = None):
        self.config = config
        self.nvml = nvml
        self.inventory = inventory
        self.changes = Changes()
        self.nvml_thread = NvmlThread()
        self.pod_settings = pod_settings
        self._socket_identity: tuple[int, int, int] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        await self.check_health()
        optional = [self.pod_settings.run()] if self.pod_settings is not None else []
        await run_until_first_exits(self._watch_health(), self._serve_and_register(), stop.wait(), *optional)

    # ---- health -------------------------------------------------------------------------

    def observe_gpus(self) -> tuple[list[tuple[str, int]], dict[str, str | None]]:
        """The NVML half of a health check (runs on the NVML thread): pending Xids, and each
        GPU's presence problem (None: present)."""
        xids = self.nvml.pending_xids()
        return xids, {gpu.uuid: self.nvml.presence_problem(gpu.uuid) for gpu in self.inventory.gpus}

    async def check_health(self) -> bool:
        """Drains NVML's Xid events and checks that every GPU is present. True when the health
        of some GPU flipped (the kubelet needs a new device list)."""
        call = asyncio.ensure_future(self.nvml_thread.call(self.observe_gpus))
        slow = max(NVML_SLOW_MIN_S, NVML_SLOW_INTERVALS * self.config.health_interval)
        done, _ = await asyncio.wait([call], timeout=slow)
        if not done:
            log.warning("NVML has not answered a health check for %.1f s; health checks wait for it, "
                        "allocations go on", slow)
        xids, presence = await call
        return self.apply_health(xids, presence)

    def apply_health(self, xids: list[tuple[str, int]], presence: dict[str, str | None]) -> bool:
        """The inventory half of a health check (on the loop). True when some GPU's health
        flipped."""
        before = {gpu.uuid: self.inventory.unhealthy_reason(gpu.uuid) for gpu in self.inventory.gpus}
        flipped = False
        for uuid, xid in xids:
            gpu = self.inventory.gpu(uuid)
            if xid in self.config.ignored_xids:
                log.info("GPU %d (%s) reported Xid %d, an application fault: the GPU stays healthy",
                         gpu.index, uuid, xid)
            else:
                log.error("GPU %d (%s) reported critical Xid %d", gpu.index, uuid, xid)
                flipped |= self.inventory.record_fatal_xid(uuid, xid)
        for gpu in self.inventory.gpus:
            flipped |= self.inventory.set_presence(gpu.uuid, presence[gpu.uuid])
        # The log says every change of reason, also between two that are both Unhealthy.
        for gpu in self.inventory.gpus:
            reason = self.inventory.unhealthy_reason(gpu.uuid)
            if reason == before[gpu.uuid]:
                continue
            if reason is None:
                log.warning("GPU %d (%s) answers again: its devices are Healthy", gpu.index, gpu.uuid)
            elif self.inventory.fatal_xid(gpu.uuid) is not None:
                log.error("GPU %d (%s): its devices are Unhealthy (%s) until the plugin restarts",
                          gpu.index, gpu.uuid, reason)
            else:
                log.error("GPU %d (%s) is gone: its devices are Unhealthy (%s)", gpu.index, gpu.uuid, reason)
        return flipped

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            if await self.check_health():
                await self.changes.notify()

    # ---- serving and registering ----------------------------------------------------------

    async def _serve_and_register(self) -> None:
        while True:
            server = await self._start_server()
            try:
                kubelet = await self._register()
                reason = await self._wait_for_reset(kubelet)
                log.warning("%s: serving and registering again", reason)
            finally:
                await server.stop(SERVER_STOP_GRACE_S)
                self._remove_own_socket()

    async def _start_server(self) -> grpc.aio.Server:
        path = self.config.plugin_socket
        if not path.parent.is_dir():
            # The kubelet creates it when it starts; a plugin that came up first waits for it.
            log.info("waiting for the device-plugin directory %s (the kubelet creates it)", path.parent)
            while not path.parent.is_dir():
                await asyncio.sleep(self.config.kubelet_watch_interval)
        self._remove_stale_socket(path)
        server = grpc.aio.server()
        api_grpc.add_DevicePluginServicer_to_server(
            DevicePluginService(self.config, self.inventory, self.changes), server)
        try:
            server.add_insecure_port(f"unix://{path}")
        except RuntimeError as error:
            raise PluginError(f"cannot listen on {path}: {error}") from None
        await server.start()
        self._socket_identity = _identity(path)
        log.info("serving the device plugin API on %s", path)
        return server

    @staticmethod
    def _remove_stale_socket(path: Path) -> None:
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
            else:
                raise PluginError(f"{path} exists and is not a socket; refusing to replace it")
        except FileNotFoundError:
            pass

    def _remove_own_socket(self) -> None:
        path = self.config.plugin_socket
        if self._socket_identity is not None and _identity(path) == self._socket_identity:
            path.unlink(missing_ok=True)
        self._socket_identity = None

    async def _register(self) -> tuple[int, int, int]:
        """Registers with the kubelet, waiting for it as long as it takes; returns the identity
        of the kubelet socket it registered through."""
        kubelet_socket = self.config.kubelet_socket
        request = api.RegisterRequest(
            version=API_VERSION, endpoint=self.config.endpoint, resource_name=self.config.resource_name,
            options=api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True))
        said_waiting = False
        while True:
            identity = _identity(kubelet_socket)
            if identity is not None:
                try:
                    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
                        await api_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT_S)
                except grpc.aio.AioRpcError as error:
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise PluginError(f"the kubelet refused to register {self.config.resource_name}: "
                                          f"{error.details()}") from None
                    if not said_waiting:
                        log.info("the kubelet does not answer on %s yet (%s); retrying", kubelet_socket, error.details())
                        said_waiting = True
                else:
                    gpus = len(self.inventory.gpus)
                    log.info("registered %s with the kubelet: %d GPU(s), %d devices", self.config.resource_name,
                             gpus, gpus * self.inventory.replicas)
                    return identity
            elif not said_waiting:
                log.info("waiting for the kubelet socket %s", kubelet_socket)
                said_waiting = True
            await asyncio.sleep(self.config.kubelet_watch_interval)

    async def _wait_for_reset(self, kubelet: tuple[int, int, int]) -> str:
        """Returns why the plugin must serve and register again: a kubelet restart recreates
        kubelet.sock and deletes every plugin socket."""
        while True:
            await asyncio.sleep(self.config.kubelet_watch_interval)
            if _identity(self.config.kubelet_socket) != kubelet:
                return f"{self.config.kubelet_socket} was recreated (kubelet restart)"
            if _identity(self.config.plugin_socket) != self._socket_identity:
                return f"{self.config.plugin_socket} was removed"


async def serve(config: PluginConfig) -> None:
    """Runs the plugin until SIGTERM or SIGINT."""
    nvml = Nvml()
    plugin = None
    try:
        gpus = nvml.discover()
        if not gpus:
            raise PluginError("NVML found no usable GPU on this node; nothing to advertise")
        log.info("NVIDIA driver %s; %d GPU(s), %d %s devices each:", nvml.driver_version, len(gpus),
                 config.replicas, config.resource_name)
        for gpu in gpus:
            log.info("  GPU %d: %s (%s, %.1f GiB)", gpu.index, gpu.uuid, gpu.name, gpu.memory / 2**30)
        try:
            prepare_host(config.injection)
        except HostError as error:
            raise PluginError(str(error)) from None
        nvml.watch_xids(gpus)
        plugin = Plugin(config, nvml, Inventory(gpus, config.replicas), pod_settings_sync(config))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, _request_stop, stop, signum)
        try:
            await plugin.run(stop)
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
    finally:
        if plugin is None or plugin.nvml_thread.stop(NVML_STOP_WAIT_S):
            nvml.close()
        else:
            # nvmlShutdown behind a hung call could hang as well; the process is about to exit.
            log.warning("an NVML call is still running: exiting without shutting NVML down")
    log.info("stopped")


def pod_settings_sync(config: PluginConfig) -> PodSettingsSync | None:
    """The pod watcher (nvshare.com/* annotations to the scheduler), where it can run; each
    reason it cannot is said once at start. Devices are served either way."""
    if not config.pod_settings:
        log.info("pod annotations are not applied (--no-pod-settings)")
        return None
    api = ApiServer.in_cluster()
    if api is None:
        log.info("pod annotations are not applied: not in a Kubernetes cluster (no KUBERNETES_SERVICE_HOST)")
        return None
    if not config.node_name:
        log.warning("pod annotations are not applied: the node's name is not set (NODE_NAME, from the "
                    "downward API's spec.nodeName)")
        return None
    return PodSettingsSync(api, config.node_name, config.socket_paths)


def _request_stop(stop: asyncio.Event, signum: int) -> None:
    log.info("%s received: stopping", signal.Signals(signum).name)
    stop.set()
