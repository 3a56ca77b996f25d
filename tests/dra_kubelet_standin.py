"""A stand-in for the kubelet's side of a DRA driver, built from the same protos as the driver
(nvshare_py/dra/kubeletapi), doing what a 1.34 kubelet does (pkg/kubelet/pluginmanager and
pkg/kubelet/cm/dra/plugin of k8s.io/kubernetes v1.34):

- it watches the plugin registry directory; for every new socket it dials it, asks `GetInfo`,
  refuses a plugin that is not a `DRAPlugin` or offers none of the DRA services it knows
  (`NotifyRegistrationStatus(false, why)`), else takes the first service of the plugin's list
  that it knows and says `NotifyRegistrationStatus(true)`; a socket that goes away
  unregisters the plugin; a registration that failed (no answer to `GetInfo`, a refusal, a
  status it could not deliver) is tried again after a back-off, doubling from 0.5 s, as the
  kubelet's reconciler does with a plugin its actual state of the world lacks;
- `prepare` / `unprepare` call NodePrepareResources / NodeUnprepareResources of the chosen
  service on the endpoint the plugin named, as the kubelet does before a pod's containers
  start and after they are gone, with the 45 s the kubelet gives a call.

It is a test double for what the kubelet checks and calls, not for its bookkeeping of claims.
"""

from __future__ import annotations

import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from nvshare_py.dra.kubeletapi import DRA_V1_SERVICE, DRA_V1BETA1_SERVICE, PLUGIN_TYPE
from nvshare_py.dra.kubeletapi import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from nvshare_py.dra.kubeletapi import registration_pb2, registration_pb2_grpc

CALL_TIMEOUT_S = 45.0  # the kubelet's for a DRA call
WAIT_TIMEOUT_S = 60.0
POLL_S = 0.05
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 122.0  # the kubelet's exponential back-off of a failed operation
STUBS = {DRA_V1_SERVICE: (dra_v1_pb2, dra_v1_pb2_grpc), DRA_V1BETA1_SERVICE: (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)}


@dataclass
class Registered:
    socket: Path
    name: str
    endpoint: str
    service: str  # the chosen one, e.g. "v1.DRAPlugin"
    offered: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


class DraKubeletStandin:
    def __init__(self, registry_dir: Path, services: tuple[str, ...] = (DRA_V1_SERVICE, DRA_V1BETA1_SERVICE)):
        self.registry_dir = Path(registry_dir)
        self.services = services  # what this kubelet knows
        self.plugins: dict[str, Registered] = {}  # by driver name
        self.refusals: list[str] = []
        self.registrations = 0
        self._seen: dict[Path, tuple[int, int]] = {}
        # A socket whose registration failed: (its identity, when to try again, the back-off).
        self._retry: dict[Path, tuple[tuple[int, int], float, float]] = {}
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dra-kubelet", daemon=True)

    def start(self) -> "DraKubeletStandin":
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    # ---- the plugin watcher ---------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            present = {}
            for entry in self.registry_dir.iterdir():
                # A restarting plugin removes its socket and makes it again, maybe between the
                # listing and the stat: gone now, it is looked at again on the next round.
                try:
                    info = entry.lstat()
                except FileNotFoundError:
                    continue
                if stat.S_ISSOCK(info.st_mode):
                    present[entry] = (info.st_ino, info.st_ctime_ns)
            for path, identity in present.items():
                retry = self._retry.get(path)  # a new socket at that path starts without a back-off
                when, backoff = (retry[1], retry[2]) if retry and retry[0] == identity else (0.0, RETRY_FIRST_S / 2)
                if self._seen.get(path) != identity and time.monotonic() >= when:
                    self._seen[path] = identity
                    if self._register(path):
                        self._retry.pop(path, None)
                    else:  # the same socket is looked at again after the back-off
                        del self._seen[path]
                        backoff = min(2 * backoff, RETRY_MAX_S)
                        self._retry[path] = (identity, time.monotonic() + backoff, backoff)
            for path in set(self._retry) - set(present):
                del self._retry[path]
            for path in set(self._seen) - set(present):
                del self._seen[path]
                with self._changed:
                    for name, plugin in list(self.plugins.items()):
                        if plugin.socket == path:
                            del self.plugins[name]
                    self._changed.notify_all()

    def _register(self, path: Path) -> bool:
        """Whether the plugin at `path` was registered."""
        with grpc.insecure_channel(f"unix://{path}") as channel:
            stub = registration_pb2_grpc.RegistrationStub(channel)
            try:
                info = stub.GetInfo(registration_pb2.InfoRequest(), timeout=10, wait_for_ready=True)
            except grpc.RpcError as error:
                self._refused(f"GetInfo at {path} failed: {error.details()}")
                return False
            why = None
            chosen = next((service for service in info.supported_versions if service in self.services), None)
            if info.type != PLUGIN_TYPE:
                why = f"no handler registered for plugin type: {info.type} at socket {path}"
            elif not info.supported_versions:
                why = "empty list of supported gRPC services (aka supported versions)"
            elif chosen is None:
                why = (f"none of services supported by the plugin ({list(info.supported_versions)}) are "
                       f"supported by the kubelet ({list(self.services)})")
            if why is not None:
                self._refused(why)
                try:
                    stub.NotifyRegistrationStatus(registration_pb2.RegistrationStatus(plugin_registered=False, error=why),
                                                  timeout=5)
                except grpc.RpcError:
                    pass  # a plugin answers a refusal with an error of its own
                return False
            try:
                stub.NotifyRegistrationStatus(registration_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
            except grpc.RpcError:
                # The plugin went away meanwhile (a driver that stops or restarts): not registered,
                # and the watcher goes on (its thread died here once, in CI under load).
                return False
        with self._changed:
            self.plugins[info.name] = Registered(path, info.name, info.endpoint or str(path), chosen,
                                                 list(info.supported_versions))
            self.registrations += 1
            self._changed.notify_all()
        return True

    def _refused(self, why: str) -> None:
        with self._changed:
            self.refusals.append(why)
            self._changed.notify_all()

    # ---- what tests use -------------------------------------------------------------------

    def wait_until(self, predicate, timeout: float = WAIT_TIMEOUT_S, what: str = "condition"):
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = predicate()
                if result:
                    return result
                if time.monotonic() > deadline:
                    raise TimeoutError(f"DRA kubelet stand-in: no {what} within {timeout} s; last saw {result!r}; "
                                       f"plugins {self.plugins}, refusals {self.refusals}")
                self._changed.wait(0.2)

    def wait_for_plugin(self, name: str, registrations: int = 1) -> Registered:
        return self.wait_until(lambda: self.registrations >= registrations and self.plugins.get(name),
                               what=f"registration of {name}")

    def _call(self, driver: str, method: str, request_name: str, claims: list[ClaimRef]):
        plugin = self.plugins[driver]
        pb, pb_grpc = STUBS[plugin.service]
        request = getattr(pb, request_name)(claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name)
                                                    for c in claims])
        with grpc.insecure_channel(f"unix://{plugin.endpoint}") as channel:
            return getattr(pb_grpc.DRAPluginStub(channel), method)(request, timeout=CALL_TIMEOUT_S)

    def prepare(self, driver: str, claims: list[ClaimRef]):
        return self._call(driver, "NodePrepareResources", "NodePrepareResourcesRequest", claims)

    def unprepare(self, driver: str, claims: list[ClaimRef]):
        return self._call(driver, "NodeUnprepareResources", "NodeUnprepareResourcesRequest", claims)
