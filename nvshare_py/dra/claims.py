"""A ResourceClaim's allocation as what the driver prepares: the devices of this driver on this
node, the GPUs behind them, and the claim's settings for the scheduler. Pure: the claim comes
in as the API server's JSON, a `PreparedClaim` (or a `ClaimError` that says why not) goes out.

Settings come from opaque configuration for this driver, in the DeviceClass (the operator's)
and in the claim (the user's), as the allocation recorded it (`status.allocation.devices.config`):

    opaque:
      driver: gpu.nvshare.com
      parameters:
        apiVersion: gpu.nvshare.com/v1alpha1
        kind: GpuConfig
        weight: 2            # 1..1000: share of lock time while several wait
        priority: 4          # 0..7: higher classes get the GPU first
        memoryLimit: 8Gi     # a Kubernetes quantity: what each process may allocate on the GPU
        mode: auto           # on, off or auto: the scheduling mode of each GPU of the claim

An entry applies to the requests it names (all when it names none); entries from the class
come first and the claim's override them, later ones earlier ones. Unknown keys are ignored
(a newer configuration's fields); a known key with a value that cannot be applied refuses the
claim. With consumable capacity, what the allocation consumed of `memory` is the memory limit
(a claim that asked for none consumed a whole card's worth: no limit), and `memoryLimit` can
only lower it.

A mode is the GPU's, not the claim's: every claim prepared on a GPU that asks for one must ask
for the same (`check_modes`), while the claims that ask for none take the GPU as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Iterable

from nvshare_py.deviceplugin.podsettings import PRIORITY_RANGE, WEIGHT_RANGE
from nvshare_py.vocabulary import MODE

from .devices import MEMORY, DeviceSet, UnknownDevice
from .quantity import parse_quantity

CONFIG_GROUP = "gpu.nvshare.com"
CONFIG_KIND = "GpuConfig"
CONFIG_VERSION = "v1alpha1"
FROM_CLASS = "FromClass"
FROM_CLAIM = "FromClaim"


class ClaimError(ValueError):
    """The claim cannot be prepared; the message (shown in the pod's events) says why."""


@dataclass(frozen=True)
class Settings:
    weight: int | None = None
    priority: int | None = None
    memory_limit: int | None = None  # bytes
    mode: str | None = None  # a word of MODE

    def over(self, base: "Settings") -> "Settings":
        """These settings where they say something, `base`'s elsewhere."""
        return replace(base, **{setting.name: getattr(self, setting.name) for setting in fields(self)
                                if getattr(self, setting.name) is not None})


@dataclass(frozen=True)
class ClaimDevice:
    """One allocated device of the claim and what it means on this node."""

    requests: tuple[str, ...]  # the claim's requests it serves (main request names)
    pool: str
    device: str
    gpu_uuid: str
    share_id: str | None = None
    memory_limit: int | None = None  # bytes; None: the whole card
    mode: str | None = None  # the GPU's scheduling mode it asks for; None: any


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[ClaimDevice, ...]
    weight: int | None = None  # the highest any of its devices' configuration asks
    priority: int | None = None
    cdi_devices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # device name -> CDI IDs

    @property
    def gpu_limits(self) -> dict[str, int | None]:
        """GPU UUID -> the memory limit there (None: none)."""
        return merge_limits((device.gpu_uuid, device.memory_limit) for device in self.devices)

    @property
    def gpu_modes(self) -> dict[str, str]:
        """GPU UUID -> the mode the claim asks for there (GPUs where it asks for none are not in it)."""
        return {device.gpu_uuid: device.mode for device in self.devices if device.mode is not None}

    def describe(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name}"

    def to_json(self) -> dict:
        return {"uid": self.uid, "namespace": self.namespace, "name": self.name, "weight": self.weight,
                "priority": self.priority,
                "devices": [{"requests": list(d.requests), "pool": d.pool, "device": d.device, "gpu": d.gpu_uuid,
                             "shareID": d.share_id, "memoryLimit": d.memory_limit, "mode": d.mode}
                            for d in self.devices],
                "cdiDevices": {name: list(ids) for name, ids in self.cdi_devices.items()}}

    @classmethod
    def from_json(cls, document: dict) -> "PreparedClaim":
        return cls(document["uid"], document["namespace"], document["name"],
                   tuple(ClaimDevice(tuple(d["requests"]), d["pool"], d["device"], d["gpu"], d.get("shareID"),
                                     d.get("memoryLimit"), d.get("mode")) for d in document["devices"]),
                   document.get("weight"), document.get("priority"),
                   {name: tuple(ids) for name, ids in (document.get("cdiDevices") or {}).items()})


def merge_limits(limits: Iterable[tuple[str, int | None]]) -> dict[str, int | None]:
    """Several memory limits on GPUs as one per GPU: the largest, and none where one of them
    is none (each allows a process that much)."""
    merged: dict[str, int | None] = {}
    for uuid, limit in limits:
        if uuid not in merged:
            merged[uuid] = limit
        else:
            before = merged[uuid]
            merged[uuid] = None if before is None or limit is None else max(before, limit)
    return merged


def wanted_modes(claims: Iterable[PreparedClaim]) -> dict[str, str]:
    """GPU UUID -> the mode the prepared `claims` ask for there (they agree: `check_modes`)."""
    return {uuid: mode for claim in claims for uuid, mode in claim.gpu_modes.items()}


def check_modes(claim: PreparedClaim, prepared: Iterable[PreparedClaim]) -> None:
    """ClaimError when `claim` asks a GPU for a mode other than the one prepared claims set
    there: its pods would run under a mode they did not ask for, or change the others' mode."""
    others = [other for other in prepared if other.uid != claim.uid]
    for uuid, mode in claim.gpu_modes.items():
        setters = [other for other in others if other.gpu_modes.get(uuid, mode) != mode]
        if setters:
            in_force = setters[0].gpu_modes[uuid]
            names = ", ".join(other.describe() for other in setters if other.gpu_modes[uuid] == in_force)
            raise ClaimError(f"GPU {uuid} is in mode {in_force}, set by {names}; {claim.describe()} asks for mode "
                             f"{mode} there and can be prepared once no claim prepared there asks for another mode")


def _integer(parameters: dict, key: str, low: int, high: int) -> int | None:
    value = parameters.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ClaimError(f"{key} must be an integer from {low} to {high}, not {value!r}")
    return value


def read_config(parameters: object, source: str) -> Settings:
    """One opaque configuration's parameters as settings; ClaimError if a value is unusable."""
    if not isinstance(parameters, dict):
        raise ClaimError(f"the {CONFIG_GROUP} configuration is not an object: {parameters!r}")
    api_version = parameters.get("apiVersion")
    if api_version is not None and (not isinstance(api_version, str) or api_version.split("/")[0] != CONFIG_GROUP):
        raise ClaimError(f"the {CONFIG_GROUP} configuration has apiVersion {api_version!r}, not "
                         f"{CONFIG_GROUP}/{CONFIG_VERSION}")
    mode = parameters.get("mode")
    if mode is not None and (not isinstance(mode, str) or mode not in MODE):
        raise ClaimError(f"mode must be {MODE.describe()}, not {mode!r}")
    memory = parameters.get("memoryLimit")
    if memory is not None:
        try:
            memory = parse_quantity(memory)
        except ValueError as error:
            raise ClaimError(f"memoryLimit: {error}") from None
        if memory <= 0:
            raise ClaimError(f"memoryLimit must be more than 0, not {parameters.get('memoryLimit')!r}")
    return Settings(_integer(parameters, "weight", *WEIGHT_RANGE), _integer(parameters, "priority", *PRIORITY_RANGE),
                    memory, mode)


def _applies(config_requests: list, request: str) -> bool:
    """Whether a configuration naming `config_requests` applies to the result of `request`
    ("main" or "main/subrequest")."""
    return not config_requests or request in config_requests or request.split("/")[0] in config_requests


def read_claim(claim: dict, driver: str, pool: str, devices: DeviceSet) -> PreparedClaim:
    """The claim's allocation on this node; ClaimError when it cannot be prepared here."""
    metadata = claim.get("metadata") or {}
    allocation = (claim.get("status") or {}).get("allocation")
    where = f"ResourceClaim {metadata.get('namespace')}/{metadata.get('name')}"
    if not allocation:
        raise ClaimError(f"{where} is not allocated")
    allocated = allocation.get("devices") or {}
    configs = sorted((entry for entry in allocated.get("config") or []
                      if (entry.get("opaque") or {}).get("driver") == driver),
                     key=lambda entry: entry.get("source") != FROM_CLASS)  # the class's first
    prepared: list[ClaimDevice] = []
    weights, priorities = [], []
    for result in allocated.get("results") or []:
        if result.get("driver") != driver:
            continue
        request = str(result.get("request", ""))
        if result.get("pool") != pool:
            raise ClaimError(f"{where}: device {result.get('device')} is from pool {result.get('pool')!r}, "
                             f"not this node's ({pool!r})")
        try:
            device = devices.device(str(result.get("device")))
        except UnknownDevice as error:
            raise ClaimError(f"{where}: {error}") from None
        settings = Settings()
        for entry in configs:
            if _applies(entry.get("requests") or [], request):
                settings = read_config(entry["opaque"].get("parameters"), entry.get("source", "")).over(settings)
        limit = _memory_limit(result, settings, devices.card_memory(device.gpu), where)
        if settings.mode is not None:
            for other in prepared:
                if other.gpu_uuid == device.gpu.uuid and other.mode not in (None, settings.mode):
                    raise ClaimError(f"{where} asks for modes {other.mode} and {settings.mode} on GPU {device.gpu.uuid}")
        prepared.append(ClaimDevice((request.split("/")[0],), pool, device.name, device.gpu.uuid,
                                    result.get("shareID"), limit, settings.mode))
        weights.append(settings.weight)
        priorities.append(settings.priority)
    return PreparedClaim(str(metadata.get("uid", "")), str(metadata.get("namespace", "")), str(metadata.get("name", "")),
                         tuple(prepared), max((w for w in weights if w is not None), default=None),
                         max((p for p in priorities if p is not None), default=None))


def _memory_limit(result: dict, settings: Settings, whole_card: int, where: str) -> int | None:
    """The limit of one allocated device, the smaller of what it consumed of `memory`
    (consumable capacity) and `memoryLimit`. A whole card's worth consumed, what a claim that
    asks for no memory consumes, is no limit."""
    limits = [settings.memory_limit] if settings.memory_limit is not None else []
    consumed = (result.get("consumedCapacity") or {}).get(MEMORY)
    if consumed is not None:
        try:
            consumed = parse_quantity(consumed)
        except ValueError as error:
            raise ClaimError(f"{where}: consumed memory: {error}") from None
        if consumed != whole_card:
            limits.append(consumed)
    return min(limits, default=None)
