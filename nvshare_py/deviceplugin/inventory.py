"""The virtual devices of the node's GPUs, their health, and the choice of devices.

Pure state, no I/O: the gRPC shell feeds it what NVML said and asks it what to answer.
A virtual device is `<GPU UUID>::<n>`, n from 0 to replicas-1; it always stands for exactly
that one physical GPU, and all virtual devices of a GPU share its health.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import AllocationPolicy
from .v1beta1 import HEALTHY, MAX_DEVICE_ID_LENGTH, UNHEALTHY

SEPARATOR = "::"


@dataclass(frozen=True)
class PhysicalGpu:
    """One GPU of the node as NVML reports it; the plugin offers `replicas` virtual devices of
    each (`<uuid>::<n>`)."""

    uuid: str
    index: int
    name: str
    memory: int
    minor: int | None = None  # /dev/nvidia<minor>; None when NVML does not say


class InvalidRequest(ValueError):
    """The kubelet asked for something this plugin never offered or cannot give."""


class GpuUnavailable(RuntimeError):
    """The request is well-formed but a GPU it names is unhealthy right now."""


@dataclass
class _Health:
    lost: str | None = None  # why the last presence check failed; None while the GPU answers
    fatal_xid: int | None = None  # sticky: a GPU that had a fatal Xid needs an operator

    @property
    def reason(self) -> str | None:
        if self.fatal_xid is not None:
            return f"critical Xid {self.fatal_xid}"
        return self.lost


class Inventory:
    def __init__(self, gpus: list[PhysicalGpu], replicas: int):
        if not gpus:
            raise ValueError("an inventory needs at least one GPU")
        self.gpus = tuple(sorted(gpus, key=lambda gpu: gpu.index))
        self.replicas = replicas
        self._gpu_by_uuid = {gpu.uuid: gpu for gpu in self.gpus}
        self._slot: dict[str, tuple[PhysicalGpu, int]] = {}
        for gpu in self.gpus:
            for replica in range(replicas):
                device_id = f"{gpu.uuid}{SEPARATOR}{replica}"
                if len(device_id) > MAX_DEVICE_ID_LENGTH:
                    raise ValueError(f"device ID {device_id} is longer than {MAX_DEVICE_ID_LENGTH} characters")
                self._slot[device_id] = (gpu, replica)
        self._health = {gpu.uuid: _Health() for gpu in self.gpus}

    # ---- health -------------------------------------------------------------------------

    def unhealthy_reason(self, uuid: str) -> str | None:
        return self._health[uuid].reason

    def fatal_xid(self, uuid: str) -> int | None:
        """The critical Xid that made the GPU unhealthy for good, if any."""
        return self._health[uuid].fatal_xid

    def set_presence(self, uuid: str, lost: str | None) -> bool:
        """Records a presence check (`lost` is None when the GPU answered). True if health flipped."""
        health = self._health[uuid]
        before = health.reason is None
        health.lost = lost
        return before != (health.reason is None)

    def record_fatal_xid(self, uuid: str, xid: int) -> bool:
        """Marks the GPU unhealthy for good (until the plugin restarts). True if health flipped."""
        health = self._health[uuid]
        before = health.reason is None
        if health.fatal_xid is None:
            health.fatal_xid = xid
        return before != (health.reason is None)

    def devices(self) -> list[tuple[str, str]]:
        """(device ID, Healthy|Unhealthy) for every virtual device, in a stable order."""
        return [(device_id, HEALTHY if self._health[gpu.uuid].reason is None else UNHEALTHY)
                for device_id, (gpu, _) in self._slot.items()]

    # ---- choosing devices ----------------------------------------------------------------

    def gpu(self, uuid: str) -> PhysicalGpu:
        return self._gpu_by_uuid[uuid]

    def gpu_of(self, device_id: str) -> PhysicalGpu:
        return self._slot[device_id][0]

    def _check_known(self, device_ids: list[str]) -> None:
        unknown = sorted({device_id for device_id in device_ids if device_id not in self._slot})
        if unknown:
            raise InvalidRequest(
                f"unknown device IDs {', '.join(unknown)}: this plugin advertises "
                f"<GPU UUID>{SEPARATOR}<0..{self.replicas - 1}> for GPUs "
                f"{', '.join(gpu.uuid for gpu in self.gpus)}")

    def preferred(self, available: list[str], must_include: list[str], size: int,
                  policy: AllocationPolicy) -> list[str]:
        """Devices to suggest: `must_include`, then one device from each further distinct GPU.

        May return fewer than `size` when there are not enough distinct healthy GPUs among the
        available devices; the kubelet then completes the choice itself and Allocate refuses a
        container that ends up with two devices of one GPU.
        """
        self._check_known([*available, *must_include])
        chosen = list(dict.fromkeys(must_include))
        if size < len(chosen):
            raise InvalidRequest(f"allocation size {size} is smaller than the {len(chosen)} devices that must be included")
        taken_gpus = {self.gpu_of(device_id).uuid for device_id in chosen}
        free: dict[str, list[str]] = {}
        for device_id in available:
            gpu = self.gpu_of(device_id)
            if device_id not in chosen and self._health[gpu.uuid].reason is None:
                free.setdefault(gpu.uuid, []).append(device_id)
        while len(chosen) < size:
            candidates = [uuid for uuid in free if uuid not in taken_gpus]
            if not candidates:
                break
            if policy is AllocationPolicy.SPREAD:
                uuid = min(candidates, key=lambda u: (-len(free[u]), self._gpu_by_uuid[u].index))
            else:
                uuid = min(candidates, key=lambda u: (len(free[u]), self._gpu_by_uuid[u].index))
            chosen.append(min(free[uuid], key=lambda device_id: self._slot[device_id][1]))
            taken_gpus.add(uuid)
        return chosen

    def resolve(self, device_ids: list[str]) -> list[PhysicalGpu]:
        """The GPUs behind one container's devices, by index; refuses what cannot be served."""
        if not device_ids:
            raise InvalidRequest("a container request without device IDs")
        self._check_known(device_ids)
        by_gpu: dict[str, list[str]] = {}
        for device_id in device_ids:
            by_gpu.setdefault(self.gpu_of(device_id).uuid, []).append(device_id)
        shared = {uuid: ids for uuid, ids in by_gpu.items() if len(ids) > 1}
        if shared:
            uuid, ids = next(iter(shared.items()))
            raise InvalidRequest(
                f"devices {', '.join(ids)} are all on GPU {uuid}: the devices of one container "
                f"must be on distinct GPUs, and this node has {len(self.gpus)}")
        for uuid in by_gpu:
            reason = self._health[uuid].reason
            if reason is not None:
                raise GpuUnavailable(f"GPU {uuid} is unhealthy ({reason})")
        return sorted((self._gpu_by_uuid[uuid] for uuid in by_gpu), key=lambda gpu: gpu.index)
