"""What the device plugin asks NVML (through nvidia-ml-py): the GPUs, whether each is still
there, and critical Xid events."""

from __future__ import annotations

import ctypes
import logging

import pynvml

from .inventory import PhysicalGpu

log = logging.getLogger(__name__)


class NvmlUnavailable(RuntimeError):
    """NVML cannot be loaded or initialised: no driver, or no GPU visible to this container."""


def _describe(error: pynvml.NVMLError) -> str:
    return f"NVML: {error}"


def _minor_number(handle) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))
    except pynvml.NVMLError as error:  # e.g. NOT_SUPPORTED: no /dev/nvidia<n> to pass on
        log.warning("no minor number (device node) for a GPU: %s", _describe(error))
        return None


class Nvml:
    """An initialised NVML session. Every method runs on the caller's thread and returns fast:
    event waits use a zero timeout, so no thread is needed to watch for Xids."""

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            raise NvmlUnavailable(
                f"cannot initialise NVML ({error}); is the NVIDIA driver installed and "
                "libnvidia-ml.so.1 visible to this process?") from None
        self._event_set = None
        self._uuid_by_handle: dict[int, str] = {}
        try:
            self.driver_version = pynvml.nvmlSystemGetDriverVersion()
        except pynvml.NVMLError as error:
            self.driver_version = f"unknown ({error})"

    def discover(self) -> list[PhysicalGpu]:
        """Every GPU that answers, by index. A GPU that fails is logged and left out."""
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                gpus.append(PhysicalGpu(uuid=pynvml.nvmlDeviceGetUUID(handle), index=index,
                                name=pynvml.nvmlDeviceGetName(handle),
                                memory=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                                minor=_minor_number(handle)))
            except pynvml.NVMLError as error:
                log.warning("GPU %d does not answer and is not advertised: %s", index, _describe(error))
        return gpus

    def presence_problem(self, uuid: str) -> str | None:
        """None if the GPU is found by UUID and answers a query, else why not."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError_NotFound:
            return "not found by NVML"
        except pynvml.NVMLError as error:
            return _describe(error)
        return None

    def watch_xids(self, gpus: list[PhysicalGpu]) -> list[PhysicalGpu]:
        """Registers for critical Xid events; returns the GPUs that do not support them."""
        self._event_set = pynvml.nvmlEventSetCreate()
        unsupported = []
        for gpu in gpus:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._event_set)
            except pynvml.NVMLError as error:
                log.warning("GPU %s: no Xid events (%s); its health relies on presence checks",
                            gpu.uuid, _describe(error))
                unsupported.append(gpu)
                continue
            self._uuid_by_handle[ctypes.addressof(handle.contents)] = gpu.uuid
        return unsupported

    def pending_xids(self) -> list[tuple[str, int]]:
        """(GPU UUID, Xid) of every critical Xid event NVML has queued since the last call."""
        events: list[tuple[str, int]] = []
        while self._event_set is not None:
            try:
                data = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError_Timeout:
                break
            except pynvml.NVMLError as error:
                # A lost GPU can make the wait itself fail; the presence check reports it.
                log.warning("waiting for Xid events failed: %s", _describe(error))
                break
            if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
                continue
            uuid = self._uuid_by_handle.get(ctypes.addressof(data.device.contents))
            if uuid is None:
                log.warning("Xid %d on a GPU this plugin does not advertise", data.eventData)
                continue
            events.append((uuid, int(data.eventData)))
        return events

    def close(self) -> None:
        if self._event_set is not None:
            pynvml.nvmlEventSetFree(self._event_set)
            self._event_set = None
        pynvml.nvmlShutdown()
