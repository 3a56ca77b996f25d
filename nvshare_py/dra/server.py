"""The DRA driver's I/O shell: registration with the kubelet, the DRA service it calls, the
node's ResourceSlices, and the pods' settings in the scheduler.

Everything runs on one asyncio event loop (grpc.aio, httpx), in one task tree owned by
`Driver.run`; SIGTERM ends it, which stops the servers and removes the driver's sockets (the
ResourceSlices stay: a driver that comes back, after an update say, finds them as it left
them, and the kubelet removes them once a driver stays away).

- Registration: a `pluginregistration.Registration` service on `<registry>/<driver>-reg.sock`;
  the kubelet finds the socket, asks `GetInfo` (the DRA socket, the DRA API versions offered)
  and reports with `NotifyRegistrationStatus`. A refusal ends the driver (exit status 1).
- DRA: `NodePrepareResources` / `NodeUnprepareResources` of v1 and v1beta1 on
  `<plugins>/<driver>/dra.sock`. Preparing reads the claim from the API server, writes its CDI
  spec and records it in the checkpoint; a claim prepared before is answered from the
  checkpoint (the same devices again, its spec rewritten if it went missing); unpreparing a
  claim the driver does not know is done already. A request without a claim's UID, name or
  namespace is INVALID_ARGUMENT; a claim that cannot be prepared gets its reason as the
  claim's error, which the kubelet shows in the pod's events.
- ResourceSlices: written at start and checked every `slice_interval`; in `auto` sharing, a
  slice whose consumable-capacity fields the API server dropped (the feature is off there)
  is written again with replicas.
- Settings: the pod watcher (nvshare_py/deviceplugin/podwatch.py) follows the node's pods and
  gives each the settings of the prepared claims it uses (podclaims.py); its scheduler link
  also gives each GPU the mode its prepared claims ask for, and the default back once none
  does (gpumodes.py). A claim that asks a GPU for another mode than prepared claims there is
  refused (claims.check_modes).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import stat
from pathlib import Path
from typing import Any

import grpc
import httpx

from nvshare_py.deviceplugin.injection import HostError, MissingHostFile, prepare_host
from nvshare_py.deviceplugin.inventory import PhysicalGpu
from nvshare_py.deviceplugin.kubeapi import ApiError
from nvshare_py.deviceplugin.nvml import Nvml
from nvshare_py.deviceplugin.podwatch import PodSettingsSync
from nvshare_py.deviceplugin.tasks import run_until_first_exits

from . import cdi, checkpoint, kubeapi, podclaims, slices
from .claims import ClaimError, PreparedClaim, check_modes, read_claim, wanted_modes
from .config import DriverConfig, SharingChoice
from .devices import DeviceSet, Sharing
from .gpumodes import GpuModes
from .kubeletapi import PLUGIN_TYPE, SUPPORTED_SERVICES
from .kubeletapi import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from .kubeletapi import registration_pb2, registration_pb2_grpc

log = logging.getLogger(__name__)

SERVER_STOP_GRACE_S = 1.0
CLAIM_READ_TIMEOUT_S = 20.0  # the kubelet gives a call 45 s


class DriverError(RuntimeError):
    """The driver cannot go on; the message is meant for the operator."""


class InvalidRequest(ValueError):
    """The kubelet sent a request that names no claim properly."""


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Tells a recreated file from the old one (inode numbers alone may be reused)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


class Driver:
    def __init__(self, config: DriverConfig, gpus: list[PhysicalGpu]):
        self.config = config
        self.gpus = {gpu.uuid: gpu for gpu in gpus}
        initial = Sharing.REPLICAS if config.sharing is SharingChoice.REPLICAS else Sharing.CAPACITY
        self.devices = DeviceSet(gpus, initial, config.shares, config.memory_oversubscription)
        try:
            kept = checkpoint.load(config.checkpoint)
        except checkpoint.CheckpointError as error:
            raise DriverError(str(error)) from None
        self.prepared: dict[str, PreparedClaim] = dict(kept.claims)
        # Without the pods' settings the driver tells the scheduler nothing, modes included:
        # then it neither sets a mode nor gives one back (the checkpoint keeps what it had set).
        self.modes = GpuModes(kept.modes_set, given_back=self._modes_given_back)
        self.pods = (PodSettingsSync(config.api, config.node_name, config.injection.socket_paths,
                                     reader=podclaims.reader(self._prepared_by_name),
                                     what="nvshare ResourceClaims", other_settings=[self.modes])
                     if config.pod_settings else None)
        if self.pods is not None:
            self.modes.want(wanted_modes(self.prepared.values()))
        self._preparing: dict[str, asyncio.Future[PreparedClaim | str]] = {}  # claim UID -> its preparation
        self._refused = asyncio.Event()  # the kubelet refused the registration
        self._refusal = ""
        self._identities: dict[Path, tuple[int, int, int] | None] = {}

    def _prepared_by_name(self) -> dict[tuple[str, str], PreparedClaim]:
        return {(claim.namespace, claim.name): claim for claim in self.prepared.values()}

    async def run(self, stop: asyncio.Event) -> None:
        self._sweep_specs()
        optional = [self.pods.run()] if self.pods is not None else []
        await run_until_first_exits(self._serve(), self._publish(), self._wait_refused(), stop.wait(), *optional)

    async def _wait_refused(self) -> None:
        await self._refused.wait()
        raise DriverError(f"the kubelet refused to register {self.config.driver_name}: {self._refusal}")

    # ---- preparing -------------------------------------------------------------------------

    def _sweep_specs(self) -> None:
        """CDI specs of claims the checkpoint does not know: left by a driver that stopped
        between writing a spec and recording it (the kubelet prepares such a claim again)."""
        if not self.config.cdi_dir.is_dir():
            return
        for path in self.config.cdi_dir.iterdir():
            uid = cdi.claim_of_spec(path, self.config.driver_name)
            if uid is not None and uid not in self.prepared:
                log.info("removing %s: its claim is not prepared", path)
                path.unlink(missing_ok=True)

    def _spec_path(self, uid: str) -> Path:
        return cdi.spec_path(self.config.cdi_dir, self.config.driver_name, uid)

    def _write_spec(self, claim: PreparedClaim) -> None:
        cdi.write(self._spec_path(claim.uid), cdi.spec(claim, self.config.driver_name, self.config.injection, self.gpus))

    async def prepare(self, claims: list[Any]) -> dict[str, PreparedClaim | str]:
        """Claim UID -> the prepared claim, or why it cannot be prepared. A claim that another
        call is preparing (the kubelet prepares a claim shared by two pods for both at once) is
        answered with that call's outcome: one read, one spec."""
        _check_claims(claims)
        answers: dict[str, PreparedClaim | str] = {}
        for request in claims:
            task = self._preparing.get(request.uid)
            if task is not None:
                log.debug("claim %s/%s is being prepared by another call: its outcome is this one's too",
                          request.namespace, request.name)
            else:
                task = asyncio.ensure_future(self._prepare(request))
                self._preparing[request.uid] = task
                task.add_done_callback(functools.partial(self._prepared_one, request.uid))
            answers[request.uid] = await asyncio.shield(task)
        return answers

    def _prepared_one(self, uid: str, task: asyncio.Future) -> None:
        self._preparing.pop(uid, None)

    async def _prepare(self, request: Any) -> PreparedClaim | str:
        """One claim. (One event loop: the prepared claims change only between two awaits, so
        no lock is needed.)"""
        where = f"ResourceClaim {request.namespace}/{request.name}"
        known = self.prepared.get(request.uid)
        try:
            if known is not None:
                if not self._spec_path(known.uid).exists():
                    self._write_spec(known)
                    log.info("claim %s/%s: its CDI spec was missing and is written again", known.namespace, known.name)
                return known
            claim = await self._read(request)
            # No await from here on until the claim is recorded: no other is recorded in between.
            check_modes(claim, self.prepared.values())
            self._write_spec(claim)
        except (ClaimError, ApiError, MissingHostFile) as error:
            reason = str(error)
        except httpx.HTTPError as error:
            reason = f"cannot read {where}: {error}"
        except OSError as error:
            reason = f"cannot write the CDI spec of {where}: {error}"
        else:
            self.prepared[claim.uid] = claim
            self._save()
            log.info("prepared claim %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, _describe(claim))
            return claim
        log.warning("cannot prepare claim %s/%s (%s): %s", request.namespace, request.name, request.uid, reason)
        return reason

    async def _read(self, request: Any) -> PreparedClaim:
        async with self.config.api.client() as client:
            document = await asyncio.wait_for(kubeapi.get_claim(client, request.namespace, request.name),
                                              CLAIM_READ_TIMEOUT_S)
        uid = (document.get("metadata") or {}).get("uid")
        if uid != request.uid:
            raise ClaimError(f"ResourceClaim {request.namespace}/{request.name} is now another claim (UID {uid}, "
                             f"not {request.uid})")
        claim = read_claim(document, self.config.driver_name, self.config.node_name, self.devices)
        ids = cdi.cdi_ids(claim, self.config.driver_name, self.gpus, self.config.nvidia_cdi, self.config.nvidia_cdi_kind)
        return PreparedClaim(claim.uid, claim.namespace, claim.name, claim.devices, claim.weight, claim.priority, ids)

    async def unprepare(self, claims: list[Any]) -> dict[str, str]:
        """Claim UID -> "" (done, also for a claim never prepared here) or why not."""
        _check_claims(claims)
        answers = {}
        for request in claims:
            try:
                self._spec_path(request.uid).unlink(missing_ok=True)
            except OSError as error:
                answers[request.uid] = (f"cannot remove the CDI spec of ResourceClaim {request.namespace}/"
                                        f"{request.name}: {error}")
                continue
            answers[request.uid] = ""
            claim = self.prepared.pop(request.uid, None)
            if claim is not None:
                log.info("unprepared claim %s/%s (%s)", claim.namespace, claim.name, claim.uid)
        self._save()
        return answers

    def _save(self) -> None:
        if self.pods is not None:
            self.modes.want(wanted_modes(self.prepared.values()))  # before the checkpoint: what it owns grows
        self._write_checkpoint()
        if self.pods is not None:
            self.pods.refresh()

    def _write_checkpoint(self) -> None:
        checkpoint.save(self.config.checkpoint, checkpoint.Checkpoint(self.prepared, self.modes.owned))

    def _modes_given_back(self) -> None:
        """A GPU went back to the scheduler's default mode: the checkpoint no longer lists it."""
        try:
            self._write_checkpoint()
        except OSError as error:  # the checkpoint still lists it: a restarted driver sets the default again
            log.warning("cannot write the checkpoint %s: %s", self.config.checkpoint, error)

    # ---- the kubelet's side ----------------------------------------------------------------

    async def _serve(self) -> None:
        """Serves registration and DRA, again whenever a socket of the driver was removed."""
        while True:
            await self._wait_for_directory(self.config.registry_dir)
            self.config.plugin_dir.mkdir(parents=True, exist_ok=True)
            servers: list[grpc.aio.Server] = []
            try:
                await self._start(self.config.dra_socket, self._add_dra_services, servers)
                await self._start(self.config.registration_socket, self._add_registration, servers)
                log.info("serving DRA (%s) on %s, registration on %s", ", ".join(SUPPORTED_SERVICES),
                         self.config.dra_socket, self.config.registration_socket)
                reason = await self._wait_for_reset()
                log.warning("%s: serving again", reason)
            finally:
                for server in servers:
                    await server.stop(SERVER_STOP_GRACE_S)
                for path in (self.config.registration_socket, self.config.dra_socket):
                    if self._identities.get(path) is not None and _identity(path) == self._identities[path]:
                        path.unlink(missing_ok=True)
                self._identities.clear()

    async def _wait_for_directory(self, path: Path) -> None:
        if not path.is_dir():
            log.info("waiting for the kubelet's plugin registry %s (the kubelet creates it)", path)
            while not path.is_dir():
                await asyncio.sleep(self.config.watch_interval)

    def _add_dra_services(self, server: grpc.aio.Server) -> None:
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DraService(self, dra_v1_pb2), server)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DraService(self, dra_v1beta1_pb2), server)

    def _add_registration(self, server: grpc.aio.Server) -> None:
        registration_pb2_grpc.add_RegistrationServicer_to_server(RegistrationService(self), server)

    async def _start(self, path: Path, add_services, servers: list[grpc.aio.Server]) -> None:
        """A server listening on `path`, added to `servers` before it starts: the kubelet may
        answer the registration (and a refusal end the driver) while it starts, and a server
        that was listening must be stopped all the same."""
        _remove_stale_socket(path)
        server = grpc.aio.server()
        add_services(server)
        try:
            server.add_insecure_port(f"unix://{path}")
        except RuntimeError as error:
            raise DriverError(f"cannot listen on {path}: {error}") from None
        self._identities[path] = _identity(path)
        servers.append(server)
        await server.start()

    async def _wait_for_reset(self) -> str:
        while True:
            await asyncio.sleep(self.config.watch_interval)
            for path, identity in self._identities.items():
                if _identity(path) != identity:
                    return f"{path} was removed"

    def registered(self, status: Any) -> None:
        if status.plugin_registered:
            log.info("registered %s with the kubelet", self.config.driver_name)
        else:
            self._refusal = status.error
            self._refused.set()

    # ---- ResourceSlices --------------------------------------------------------------------

    async def _publish(self) -> None:
        node_uid: str | None = None
        failing = False
        while True:
            try:
                async with self.config.api.client() as client:
                    if node_uid is None:
                        node_uid = await self._node_uid(client)
                    await self._reconcile(client, node_uid)
                if failing:
                    log.info("the ResourceSlices are written again")
                failing = False
            except (ApiError, httpx.HTTPError) as error:
                if not failing:
                    log.warning("cannot write the ResourceSlices of node %s (retrying every %g s): %s",
                                self.config.node_name, self.config.slice_interval, error)
                failing = True
            await asyncio.sleep(self.config.slice_interval)

    async def _node_uid(self, client: httpx.AsyncClient) -> str:
        """The Node's UID, which makes the slices the node's (deleted with it)."""
        node = await kubeapi.get_node(client, self.config.node_name)
        return str(node["metadata"]["uid"])

    async def _reconcile(self, client: httpx.AsyncClient, node_uid: str) -> None:
        config = self.config
        existing = await kubeapi.list_slices(client, config.driver_name, config.node_name)
        desired = slices.desired_specs(self.devices, config.driver_name, config.node_name)
        plan = slices.plan(existing, desired, config.node_name, node_uid)
        if plan.empty:
            return
        written = []
        for document in plan.replace:
            written.append((document, await kubeapi.replace_slice(client, document)))
        for document in plan.create:
            written.append((document, await kubeapi.create_slice(client, document)))
        for name in plan.delete:
            await kubeapi.delete_slice(client, name)
        log.info("ResourceSlices of node %s: %d written (%d devices, %s), %d deleted", config.node_name, len(written),
                 len(self.devices.devices), self.devices.sharing.value, len(plan.delete))
        dropped = sorted({name for sent, stored in written for name in slices.dropped_fields(sent, stored)})
        if dropped and config.sharing is SharingChoice.AUTO and self.devices.sharing is Sharing.CAPACITY:
            log.warning("the API server dropped %s: DRAConsumableCapacity is not enabled in this cluster; "
                        "publishing %d share devices per GPU instead", ", ".join(dropped), config.shares)
            self.devices = self.devices.with_sharing(Sharing.REPLICAS)
            await self._reconcile(client, node_uid)
        elif dropped:
            log.error("the API server dropped %s of the ResourceSlices: --sharing=capacity needs the "
                      "DRAConsumableCapacity feature (API server, scheduler, kubelet)", ", ".join(dropped))


def _check_claims(claims: list[Any]) -> None:
    if not claims:
        raise InvalidRequest("a request without claims")
    for claim in claims:
        if not (claim.uid and claim.name and claim.namespace):
            raise InvalidRequest(f"a claim without its UID, name or namespace: uid={claim.uid!r} "
                                 f"name={claim.name!r} namespace={claim.namespace!r}")


def _describe(claim: PreparedClaim) -> str:
    devices = ", ".join(f"{device.device} ({device.gpu_uuid}"
                        + (f", limit {device.memory_limit} bytes" if device.memory_limit is not None else "")
                        + (f", mode {device.mode}" if device.mode is not None else "") + ")"
                        for device in claim.devices) or "no devices of this driver"
    settings = "".join(f", {name} {value}" for name, value in (("weight", claim.weight), ("priority", claim.priority))
                       if value is not None)
    return devices + settings


def _remove_stale_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
        else:
            raise DriverError(f"{path} exists and is not a socket; refusing to replace it")
    except FileNotFoundError:
        pass


class DraService:
    """NodePrepareResources / NodeUnprepareResources of one API version (`pb`: its messages)."""

    def __init__(self, driver: Driver, pb: Any):
        self.driver = driver
        self.pb = pb

    async def NodePrepareResources(self, request, context):
        try:
            answers = await self.driver.prepare(list(request.claims))
        except InvalidRequest as error:
            log.warning("refused a prepare request: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        response = self.pb.NodePrepareResourcesResponse()
        for uid, answer in answers.items():
            if isinstance(answer, str):
                response.claims[uid].error = answer
            else:
                response.claims[uid].devices.extend(self._device(device, answer) for device in answer.devices)
        return response

    def _device(self, device, claim: PreparedClaim):
        message = self.pb.Device(request_names=list(device.requests), pool_name=device.pool, device_name=device.device,
                                 cdi_device_ids=list(claim.cdi_devices.get(device.device, ())))
        if device.share_id is not None and "share_id" in self.pb.Device.DESCRIPTOR.fields_by_name:
            message.share_id = device.share_id
        return message

    async def NodeUnprepareResources(self, request, context):
        try:
            answers = await self.driver.unprepare(list(request.claims))
        except InvalidRequest as error:
            log.warning("refused an unprepare request: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        response = self.pb.NodeUnprepareResourcesResponse()
        for uid, answer in answers.items():
            response.claims[uid].error = answer
        return response


class RegistrationService(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, driver: Driver):
        self.driver = driver

    async def GetInfo(self, request, context):
        config = self.driver.config
        return registration_pb2.PluginInfo(type=PLUGIN_TYPE, name=config.driver_name, endpoint=str(config.dra_socket),
                                           supported_versions=list(SUPPORTED_SERVICES))

    async def NotifyRegistrationStatus(self, request, context):
        self.driver.registered(request)
        return registration_pb2.RegistrationStatusResponse()


async def serve(config: DriverConfig) -> None:
    """Runs the driver until SIGTERM or SIGINT."""
    nvml = Nvml()
    try:
        gpus = nvml.discover()
        if not gpus:
            raise DriverError("NVML found no usable GPU on this node; nothing to publish")
        log.info("NVIDIA driver %s; %d GPU(s):", nvml.driver_version, len(gpus))
        for gpu in gpus:
            log.info("  GPU %d: %s (%s, %.1f GiB)", gpu.index, gpu.uuid, gpu.name, gpu.memory / 2**30)
        try:
            prepare_host(config.injection)
        except HostError as error:
            raise DriverError(str(error)) from None
        driver = Driver(config, gpus)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, _request_stop, stop, signum)
        try:
            await driver.run(stop)
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
    finally:
        nvml.close()
    log.info("stopped")


def _request_stop(stop: asyncio.Event, signum: int) -> None:
    log.info("%s received: stopping", signal.Signals(signum).name)
    stop.set()
