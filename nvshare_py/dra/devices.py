"""The devices the driver publishes for the node's GPUs, in the ResourceSlice's terms. Pure:
GPUs and settings in, device documents and lookups out.

Two ways to share a GPU (docs/kubernetes.md, "DRA"):

- `capacity` (clusters with the DRAConsumableCapacity feature: alpha in 1.34, on from 1.36): one device per
  GPU, `gpu-<index>`, that many claims may be allocated at once (`allowMultipleAllocations`).
  Each allocation consumes capacity: `memory` (the card's memory times the oversubscription
  factor; a claim that asks for none takes a whole card's worth) and one of `shares` (at most
  that many allocations of the GPU). What a claim consumed of `memory` is its memory limit.
- `replicas` (every cluster): per GPU, `gpu-<index>` (the whole GPU, one claim at a time) and
  `gpu-<index>-share-<n>`, n < shares: each share device goes to one claim, like the device
  plugin's virtual devices. A share's memory limit comes from the claim's parameters
  (`memoryLimit`); the whole device and the shares of one GPU are not exclusive of each other.

Attributes (in the driver's domain, `device.attributes["gpu.nvshare.com"]` in CEL): `type`
("gpu" or "share"), `uuid`, `index`, `minor` (when NVML knows it), `productName`, `shareable`
(whether the share DeviceClass selects it), `share` (a share device's number), `sharing`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nvshare_py.deviceplugin.inventory import PhysicalGpu

MEMORY = "memory"  # capacity names, in the driver's domain
SHARES = "shares"
# A memory request is rounded up to whole MiB (and so is the limit it becomes).
MEMORY_STEP = 1 << 20
MAX_SHARES = 64


class Sharing(str, enum.Enum):
    CAPACITY = "capacity"
    REPLICAS = "replicas"


class UnknownDevice(LookupError):
    """A device name this driver never published (in this way of sharing)."""


@dataclass(frozen=True)
class Device:
    name: str
    gpu: PhysicalGpu
    share: int | None = None  # a share device's number (replicas); None for the GPU itself

    @property
    def type(self) -> str:
        return "gpu" if self.share is None else "share"


def device_name(gpu: PhysicalGpu, share: int | None = None) -> str:
    return f"gpu-{gpu.index}" if share is None else f"gpu-{gpu.index}-share-{share}"


class DeviceSet:
    """The published devices of one node."""

    def __init__(self, gpus: list[PhysicalGpu], sharing: Sharing, shares: int, oversubscription: float):
        if not gpus:
            raise ValueError("a device set needs at least one GPU")
        if not 1 <= shares <= MAX_SHARES:
            raise ValueError(f"shares per GPU must be from 1 to {MAX_SHARES}, not {shares}")
        if not oversubscription >= 1:
            raise ValueError(f"the memory oversubscription factor must be at least 1, not {oversubscription}")
        self.gpus = tuple(sorted(gpus, key=lambda gpu: gpu.index))
        self.sharing = sharing
        self.shares = shares
        self.oversubscription = oversubscription
        devices = []
        for gpu in self.gpus:
            devices.append(Device(device_name(gpu), gpu))
            if sharing is Sharing.REPLICAS:
                devices += [Device(device_name(gpu, share), gpu, share) for share in range(shares)]
        self.devices = tuple(devices)
        # Claims allocated while the other way of sharing was published (before the driver
        # restarted with another --sharing, or found the cluster without consumable capacity)
        # are still prepared: a device name of either way is known.
        self._by_name = {device.name: device for device in self.devices}
        for gpu in self.gpus:
            for share in range(shares):
                self._by_name.setdefault(device_name(gpu, share), Device(device_name(gpu, share), gpu, share))

    def device(self, name: str) -> Device:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownDevice(f"device {name!r} is not one this driver publishes on this node (it publishes "
                                f"{', '.join(device.name for device in self.devices)})") from None

    def with_sharing(self, sharing: Sharing) -> "DeviceSet":
        return DeviceSet(list(self.gpus), sharing, self.shares, self.oversubscription)

    @staticmethod
    def card_memory(gpu: PhysicalGpu) -> int:
        """The card's memory in whole MiB (capacity values and requests are counted in them)."""
        return max(MEMORY_STEP, gpu.memory - gpu.memory % MEMORY_STEP)

    def memory_capacity(self, gpu: PhysicalGpu) -> int:
        """What the claims of one GPU may consume of memory, together: the card times the
        oversubscription factor, in whole MiB."""
        total = int(self.card_memory(gpu) * self.oversubscription)
        return total - total % MEMORY_STEP

    def document(self, device: Device) -> dict:
        """The device as an entry of ResourceSlice.spec.devices (resource.k8s.io/v1)."""
        gpu = device.gpu
        attributes: dict[str, dict] = {
            "type": {"string": device.type},
            "uuid": {"string": gpu.uuid},
            "index": {"int": gpu.index},
            "productName": {"string": gpu.name},
            "sharing": {"string": self.sharing.value},
            "shareable": {"bool": self.sharing is Sharing.CAPACITY or device.share is not None},
        }
        if gpu.minor is not None:
            attributes["minor"] = {"int": gpu.minor}
        if device.share is not None:
            attributes["share"] = {"int": device.share}
        document: dict = {"name": device.name, "attributes": attributes}
        if self.sharing is Sharing.CAPACITY:
            step = str(MEMORY_STEP)
            document["allowMultipleAllocations"] = True
            document["capacity"] = {
                MEMORY: {"value": str(self.memory_capacity(gpu)),
                         "requestPolicy": {"default": str(self.card_memory(gpu)),
                                           "validRange": {"min": step, "step": step}}},
                SHARES: {"value": str(self.shares),
                         "requestPolicy": {"default": "1", "validValues": ["1"]}},
            }
        else:
            document["capacity"] = {MEMORY: {"value": str(self.card_memory(gpu))}}
        return document

    def documents(self) -> list[dict]:
        return [self.document(device) for device in self.devices]
