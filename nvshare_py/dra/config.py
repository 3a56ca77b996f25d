"""Settings of the DRA driver, checked once at start so that a wrong flag fails loudly."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nvshare_py.deviceplugin.config import DEFAULT_CDI_KIND, CdiNames
from nvshare_py.deviceplugin.injection import ConfigError, Injection
from nvshare_py.paths import check_socket_path

from .cdi import DEFAULT_CDI_DIR
from .devices import MAX_SHARES
from .kubeletapi import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR

if TYPE_CHECKING:  # httpx, of the k8s extra: the command's --help works without it
    from nvshare_py.deviceplugin.kubeapi import ApiServer

DEFAULT_DRIVER_NAME = "gpu.nvshare.com"
DEFAULT_SHARES = 10
DRA_SOCKET = "dra.sock"
CHECKPOINT = "checkpoint.json"

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class SharingChoice(str, enum.Enum):
    """How the node's GPUs are published (devices.py)."""

    AUTO = "auto"  # capacity where the API server keeps its fields, else replicas
    CAPACITY = "capacity"
    REPLICAS = "replicas"


@dataclass(frozen=True)
class DriverConfig:
    node_name: str
    api: ApiServer
    driver_name: str = DEFAULT_DRIVER_NAME
    registry_dir: Path = Path(DEFAULT_REGISTRY_DIR)
    plugins_dir: Path = Path(DEFAULT_PLUGINS_DIR)
    cdi_dir: Path = DEFAULT_CDI_DIR
    injection: Injection = field(default_factory=Injection)
    sharing: SharingChoice = SharingChoice.AUTO
    shares: int = DEFAULT_SHARES
    memory_oversubscription: float = 1.0
    nvidia_cdi: CdiNames = CdiNames.OFF
    nvidia_cdi_kind: str = DEFAULT_CDI_KIND
    pod_settings: bool = True
    slice_interval: float = 30.0  # seconds between checks of the ResourceSlices
    watch_interval: float = 1.0  # seconds between checks of the driver's sockets

    def __post_init__(self) -> None:
        if len(self.driver_name) > 63 or not _DNS_SUBDOMAIN.match(self.driver_name):
            raise ConfigError(f"driver name {self.driver_name!r} must be a DNS subdomain of at most 63 characters")
        if not self.node_name:
            raise ConfigError("the node's name is not set (NODE_NAME, from the downward API's spec.nodeName)")
        if not 1 <= self.shares <= MAX_SHARES:
            raise ConfigError(f"shares per GPU must be from 1 to {MAX_SHARES}, not {self.shares}")
        if not self.memory_oversubscription >= 1:
            raise ConfigError(f"the memory oversubscription factor must be at least 1, not {self.memory_oversubscription}")
        for label, path in (("registry directory", self.registry_dir), ("plugins directory", self.plugins_dir),
                            ("CDI directory", self.cdi_dir)):
            if not path.is_absolute():
                raise ConfigError(f"{label} {path} must be absolute")
        if self.slice_interval <= 0 or self.watch_interval <= 0:
            raise ConfigError("intervals must be positive")
        for socket in (self.dra_socket, self.registration_socket):
            try:
                check_socket_path(socket)
            except ValueError as too_long:
                raise ConfigError(str(too_long)) from None

    @property
    def plugin_dir(self) -> Path:
        """The driver's own directory: its DRA socket and its checkpoint."""
        return self.plugins_dir / self.driver_name

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / DRA_SOCKET

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{self.driver_name}-reg.sock"

    @property
    def checkpoint(self) -> Path:
        return self.plugin_dir / CHECKPOINT
