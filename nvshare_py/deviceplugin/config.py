"""Settings of the device plugin, checked once at start so that a wrong flag fails loudly."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path

from nvshare_py.paths import SocketPaths, check_socket_path

from .injection import (DEFAULT_CONTAINER_LIBRARY, DEFAULT_LIBRARY, DEFAULT_PRELOAD_FILE, ConfigError, Injection,
                        Preload, parse_container_env)
from .v1beta1 import DEFAULT_DEVICE_PLUGIN_DIR, KUBELET_SOCKET

__all__ = ["DEFAULT_CONTAINER_LIBRARY", "DEFAULT_LIBRARY", "DEFAULT_PRELOAD_FILE", "ConfigError", "Preload",
           "parse_container_env", "AllocationPolicy", "CdiNames", "PluginConfig", "check_resource_name", "parse_xids"]

DEFAULT_RESOURCE_NAME = "nvshare.com/gpu"
DEFAULT_ENDPOINT = "nvshare.sock"
DEFAULT_REPLICAS = 10
# Xids that report a fault of one application (bad address, illegal instruction, a killed
# context, ...) rather than of the GPU: the GPU stays usable by everyone else.
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
DEFAULT_CDI_KIND = "nvidia.com/gpu"

_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class CdiNames(str, enum.Enum):
    """Whether and how Allocate names the container's GPUs as CDI devices (`<kind>=<name>`),
    which must match the node's CDI specification (`nvidia-ctk cdi generate`)."""

    OFF = "off"
    UUID = "uuid"  # nvidia.com/gpu=GPU-...: nvidia-ctk --device-name-strategy=uuid
    INDEX = "index"  # nvidia.com/gpu=0: nvidia-ctk's default strategy


class AllocationPolicy(str, enum.Enum):
    """Which GPU GetPreferredAllocation suggests for the next container."""

    SPREAD = "spread"  # the GPU with the most free virtual devices: fewer co-tenants per GPU
    PACK = "pack"  # the GPU with the fewest free virtual devices: keeps other GPUs whole


def check_resource_name(name: str) -> None:
    """Rejects names the kubelet would refuse as an extended resource ("<domain>/<name>")."""
    prefix, slash, suffix = name.partition("/")
    if not slash or not prefix or not suffix:
        raise ConfigError(f"resource name {name!r} must be <domain>/<name>, e.g. nvshare.com/gpu")
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        raise ConfigError(f"resource name {name!r} may not use the kubernetes.io domain")
    if len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix):
        raise ConfigError(f"resource name {name!r}: {prefix!r} is not a DNS subdomain")
    if len(suffix) > 63 or not _NAME_PART.match(suffix):
        raise ConfigError(f"resource name {name!r}: {suffix!r} is not a valid name part")


def parse_xids(text: str) -> frozenset[int]:
    """A comma-separated list of Xid numbers ("" for none)."""
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{text!r} is not a comma-separated list of Xid numbers") from None


@dataclass(frozen=True)
class PluginConfig:
    resource_name: str = DEFAULT_RESOURCE_NAME
    replicas: int = DEFAULT_REPLICAS
    device_plugin_dir: Path = Path(DEFAULT_DEVICE_PLUGIN_DIR)
    endpoint: str = DEFAULT_ENDPOINT
    socket_paths: SocketPaths = field(default_factory=SocketPaths.resolve)
    library: Path = DEFAULT_LIBRARY
    container_library: Path = DEFAULT_CONTAINER_LIBRARY
    preload: Preload = Preload.ENV
    preload_file: Path = DEFAULT_PRELOAD_FILE
    allocation: AllocationPolicy = AllocationPolicy.SPREAD
    container_env: dict[str, str] = field(default_factory=dict)
    health_interval: float = 2.0
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    kubelet_watch_interval: float = 1.0
    device_specs: bool = True
    device_dir: Path = Path("/dev")
    cdi: CdiNames = CdiNames.OFF
    cdi_kind: str = DEFAULT_CDI_KIND
    pod_settings: bool = True  # apply the nvshare.com/* annotations of the node's pods
    node_name: str = ""

    def __post_init__(self) -> None:
        check_resource_name(self.resource_name)
        if not 1 <= self.replicas <= 999:
            raise ConfigError(f"replicas must be from 1 to 999, not {self.replicas}")
        if "/" in self.endpoint or not self.endpoint or self.endpoint == KUBELET_SOCKET:
            raise ConfigError(f"endpoint {self.endpoint!r} must be a file name other than {KUBELET_SOCKET}")
        self.injection  # checks the paths
        if self.cdi is not CdiNames.OFF:
            vendor, _, kind_class = self.cdi_kind.partition("/")
            if not _DNS_SUBDOMAIN.match(vendor) or not _NAME_PART.match(kind_class or "-"):
                raise ConfigError(f"CDI kind {self.cdi_kind!r} is not vendor.com/class")
        if self.health_interval <= 0 or self.kubelet_watch_interval <= 0:
            raise ConfigError("intervals must be positive")
        try:
            check_socket_path(self.plugin_socket)
        except ValueError as too_long:
            raise ConfigError(str(too_long)) from None

    @property
    def injection(self) -> Injection:
        return Injection(socket_paths=self.socket_paths, library=self.library, container_library=self.container_library,
                         preload=self.preload, preload_file=self.preload_file, container_env=self.container_env,
                         device_specs=self.device_specs, device_dir=self.device_dir)

    @property
    def plugin_socket(self) -> Path:
        return self.device_plugin_dir / self.endpoint

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / KUBELET_SOCKET
