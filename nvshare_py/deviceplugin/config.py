"""Settings of the device plugin, checked once at start so that a wrong flag fails loudly."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path

from nvshare_py.paths import SocketPaths, check_socket_path

from .v1beta1 import DEFAULT_DEVICE_PLUGIN_DIR, KUBELET_SOCKET

DEFAULT_RESOURCE_NAME = "nvshare.com/gpu"
DEFAULT_ENDPOINT = "nvshare.sock"
DEFAULT_REPLICAS = 10
DEFAULT_LIBRARY = Path("/var/lib/nvshare/lib/libnvshare.so")
DEFAULT_CONTAINER_LIBRARY = Path("/usr/lib/nvshare/libnvshare.so")
DEFAULT_PRELOAD_FILE = Path("/var/lib/nvshare/ld.so.preload")
CONTAINER_PRELOAD_PATH = Path("/etc/ld.so.preload")
# Xids that report a fault of one application (bad address, illegal instruction, a killed
# context, ...) rather than of the GPU: the GPU stays usable by everyone else.
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
DEFAULT_CDI_KIND = "nvidia.com/gpu"
# The device nodes every CUDA container needs besides /dev/nvidia<minor>; passed on when present.
CONTROL_DEVICE_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")

# Variables the plugin sets itself in every container; --container-env may not override them.
OWNED_CONTAINER_ENV = frozenset({"LD_PRELOAD", "NVIDIA_VISIBLE_DEVICES", "NVSHARE_SOCKET_DIR"})

_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and why."""


class Preload(str, enum.Enum):
    """How the interceptor is preloaded in containers."""

    ENV = "env"  # LD_PRELOAD in the container's environment
    FILE = "file"  # an /etc/ld.so.preload bind-mounted over the image's (reaches static setups too)


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


def parse_container_env(items: list[str]) -> dict[str, str]:
    """`NAME=VALUE` items into a dict; the names the plugin sets itself are refused."""
    env: dict[str, str] = {}
    for item in items:
        name, equals, value = item.partition("=")
        if not equals or not _ENV_NAME.match(name):
            raise ConfigError(f"container env {item!r} is not NAME=VALUE")
        if name in OWNED_CONTAINER_ENV:
            raise ConfigError(f"container env {name} is set by the plugin itself")
        if name in env:
            raise ConfigError(f"container env {name} is given twice")
        env[name] = value
    return env


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
        for label, path in (("library", self.library), ("container library", self.container_library),
                            ("preload file", self.preload_file)):
            if not path.is_absolute():
                raise ConfigError(f"{label} path {path} must be absolute")
        if not self.device_dir.is_absolute():
            raise ConfigError(f"device directory {self.device_dir} must be absolute")
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
    def plugin_socket(self) -> Path:
        return self.device_plugin_dir / self.endpoint

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / KUBELET_SOCKET
