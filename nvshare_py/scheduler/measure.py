"""The daemon's own measurement of the node's GPUs (NVML, through nvidia-ml-py).

A device's size sets its default budget, and the budgets make the node's admission capacity.
Clients report sizes too (DEVICE), but any local user may be a client: only what the daemon
measures itself, and what the operator sets (`set-budget`), may size a device (docs/scheduler.md,
security model). Where NVML is not available to the daemon (no driver in its container, no
nvidia-ml-py), or does not show a device (a MIG instance is named by its own UUID), the device's
size stays unknown: its budget is the operator's or none (mode auto serialises it, nothing is
swapped for it, and it adds nothing to the admission capacity).

Read once when the daemon starts: GPUs do not come and go under a running driver.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeasuredDevice:
    uuid: str
    total: int  # bytes
    name: str


def measure_devices() -> tuple[list[MeasuredDevice], str | None]:
    """The GPUs NVML shows, and why it could not be asked (None when it answered)."""
    try:
        import pynvml  # untyped (nvidia-ml-py ships no type information): pyproject.toml's [tool.mypy]
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return [], f"NVML cannot be initialised ({error})"
    devices = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                devices.append(MeasuredDevice(uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                                              total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                                              name=_text(pynvml.nvmlDeviceGetName(handle))))
            except pynvml.NVMLError:
                continue  # a lost GPU: no figure for it, as for one NVML does not show
    except pynvml.NVMLError as error:
        return devices, f"NVML did not list the GPUs ({error})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return devices, None


def _text(value: str | bytes) -> str:
    """nvidia-ml-py returns str, older releases bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
