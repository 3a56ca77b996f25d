"""One name per GPU in every view: `GPU<n>`, and its UUID beside it where there is room.

The scheduler knows a GPU only by the UUID its clients announce (`GPU-5151ad00-…`). People know
it by the number `nvidia-smi` gives it. Every view (nvsharectl's status, events, timeline and
replies, the timeline's PNG, the notebook's notes) names a GPU through `DeviceNames`:

- `GPU<n>`, n being the GPU's NVML index on this machine, where NVML here knows every GPU
  named (as `nvidia-smi -i n` and `CUDA_VISIBLE_DEVICES` number them);
- else `GPU<n>`, n being its place among the known UUIDs in sorted order (a machine without
  the GPUs' driver, e.g. a laptop reading a JSON export, or the simulated driver's GPUs seen
  from a shell without it);
- `long()` adds the whole UUID: `GPU0 (GPU-5151ad00-0000-4000-8000-000000000000)`. A UUID is
  never cut short: two GPUs of one vendor batch can share their first dozen characters.

`resolve()` accepts what people type: `0`, `GPU0`, `gpu0`, or the UUID.
"""

from __future__ import annotations

import functools
import re
from typing import Iterable

_INDEX = re.compile(r"(?:gpu)?(\d+)", re.IGNORECASE)


@functools.lru_cache(maxsize=1)
def nvml_indices() -> dict[str, int]:
    """UUID -> NVML index of this machine's GPUs; empty where NVML cannot be loaded (no
    driver, or the GPUs are on another machine)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            indices = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
                indices[uuid.decode() if isinstance(uuid, bytes) else uuid] = index
            return indices
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError and its library-not-found kin: no indices, not a failure
        return {}


class DeviceNames:
    """Short names for a set of GPU UUIDs (see the module's docstring)."""

    def __init__(self, uuids: Iterable[str], indices: dict[str, int] | None = None) -> None:
        known = sorted({uuid for uuid in uuids if uuid})
        indices = nvml_indices() if indices is None else indices
        if not all(uuid in indices for uuid in known):
            indices = {uuid: place for place, uuid in enumerate(known)}
        self.by_uuid: dict[str, str] = {uuid: f"GPU{indices[uuid]}" for uuid in known}

    def short(self, uuid: str) -> str:
        """`GPU0`; a UUID it does not know, as given."""
        return self.by_uuid.get(uuid, uuid)

    def long(self, uuid: str) -> str:
        """`GPU0 (GPU-5151ad00-…-000000000000)`, the whole UUID; a UUID it does not know, as given."""
        short = self.by_uuid.get(uuid)
        return f"{short} ({uuid})" if short is not None else uuid

    def resolve(self, name: str) -> str | None:
        """The UUID meant by `name` (`0`, `GPU0`, `gpu0`, or a known UUID), or None."""
        if name in self.by_uuid:
            return name
        match = _INDEX.fullmatch(name.strip())
        if match is None:
            return None
        wanted = f"GPU{int(match.group(1))}"
        return next((uuid for uuid, short in self.by_uuid.items() if short == wanted), None)

    def shown(self) -> str:
        """`GPU0, GPU1` (or "none")."""
        return ", ".join(sorted(self.by_uuid.values(), key=_natural)) or "none"


def looks_like_index(name: str) -> bool:
    """Whether `name` is an index as people type it (`0`, `GPU0`), not a UUID."""
    return _INDEX.fullmatch(name.strip()) is not None


def nvml_uuid(name: str) -> str | None:
    """The UUID of this machine's GPU with the index `name` names (`1`, `GPU1`), through NVML;
    None where NVML does not know it. For a GPU no program has used yet."""
    match = _INDEX.fullmatch(name.strip())
    if match is None:
        return None
    index = int(match.group(1))
    return next((uuid for uuid, found in nvml_indices().items() if found == index), None)


def _natural(name: str) -> tuple[int, str]:
    digits = name[3:]
    return (int(digits), name) if digits.isdigit() else (1 << 30, name)
