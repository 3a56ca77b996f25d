"""What a container needs in order to run under nvshare on some GPUs, said once for both ways
Kubernetes hands GPUs out: the device plugin turns it into an Allocate response, the DRA driver
(nvshare_py/dra) into a CDI spec. Pure apart from checking that the node's files exist.

A container gets: the scheduler's client socket directory (read-only; never the control
socket), libnvshare.so (read-only) preloaded through LD_PRELOAD or an /etc/ld.so.preload
mount, NVIDIA_VISIBLE_DEVICES and NVSHARE_SOCKET_DIR, the operator's extra variables, and the
device nodes of its GPUs and the control nodes (nvidiactl, nvidia-uvm) present on the node.
"""

from __future__ import annotations

import enum
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nvshare_py.paths import SocketPaths

if TYPE_CHECKING:  # inventory.py imports config.py, which imports this module
    from .inventory import PhysicalGpu

log = logging.getLogger(__name__)

DEFAULT_LIBRARY = Path("/var/lib/nvshare/lib/libnvshare.so")
DEFAULT_CONTAINER_LIBRARY = Path("/usr/lib/nvshare/libnvshare.so")
DEFAULT_PRELOAD_FILE = Path("/var/lib/nvshare/ld.so.preload")
CONTAINER_PRELOAD_PATH = Path("/etc/ld.so.preload")
# The device nodes every CUDA container needs besides /dev/nvidia<minor>; passed on when present.
CONTROL_DEVICE_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
# Variables the plugin sets itself in every container; --container-env may not override them.
OWNED_CONTAINER_ENV = frozenset({"LD_PRELOAD", "NVIDIA_VISIBLE_DEVICES", "NVSHARE_SOCKET_DIR"})

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and why."""


class MissingHostFile(RuntimeError):
    """A file the containers need is not on the node."""


class Preload(str, enum.Enum):
    """How the interceptor is preloaded in containers."""

    ENV = "env"  # LD_PRELOAD in the container's environment
    FILE = "file"  # an /etc/ld.so.preload bind-mounted over the image's (reaches static setups too)


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


@dataclass(frozen=True)
class Injection:
    """The operator's choices about what goes into a container."""

    socket_paths: SocketPaths = field(default_factory=SocketPaths.resolve)
    library: Path = DEFAULT_LIBRARY
    container_library: Path = DEFAULT_CONTAINER_LIBRARY
    preload: Preload = Preload.ENV
    preload_file: Path = DEFAULT_PRELOAD_FILE
    container_env: dict[str, str] = field(default_factory=dict)
    device_specs: bool = True  # pass the device nodes on
    device_dir: Path = Path("/dev")  # where they are found (the host's /dev, or a copy of it)

    def __post_init__(self) -> None:
        for label, path in (("library", self.library), ("container library", self.container_library),
                            ("preload file", self.preload_file)):
            if not path.is_absolute():
                raise ConfigError(f"{label} path {path} must be absolute")
        if not self.device_dir.is_absolute():
            raise ConfigError(f"device directory {self.device_dir} must be absolute")


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    read_only: bool = True


@dataclass(frozen=True)
class DeviceNode:
    host_path: str
    container_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerEdits:
    env: dict[str, str]
    mounts: list[Mount]
    device_nodes: list[DeviceNode]


def _host_files(injection: Injection, installer: str) -> list[tuple[Path, str]]:
    """The node files every container mounts, each with what puts it there."""
    files = [(injection.library, f"`{installer} install-library` puts it there (its DaemonSet runs it as an "
                                 "init container)")]
    if injection.preload is Preload.FILE:
        files.append((injection.preload_file, "written at start; restart the plugin"))
    return files


def container_edits(injection: Injection, gpus: list[PhysicalGpu], installer: str) -> ContainerEdits:
    """What one container needs in order to run under nvshare on `gpus`. `installer` is the
    command that puts the library on the node (named in the error when it is missing)."""
    for path, remedy in _host_files(injection, installer):
        if not path.is_file():
            raise MissingHostFile(f"{path} is not on this node; {remedy}")
    client_dir = injection.socket_paths.client_dir
    if not client_dir.is_dir():
        raise MissingHostFile(f"the scheduler's client socket directory {client_dir} does not exist")
    env = dict(injection.container_env)
    env["NVIDIA_VISIBLE_DEVICES"] = ",".join(gpu.uuid for gpu in gpus)
    env["NVSHARE_SOCKET_DIR"] = str(injection.socket_paths.root)
    mounts = [
        # Only the client directory: the control socket must stay out of containers.
        Mount(host_path=str(client_dir), container_path=str(client_dir)),
        Mount(host_path=str(injection.library), container_path=str(injection.container_library)),
    ]
    if injection.preload is Preload.ENV:
        env["LD_PRELOAD"] = str(injection.container_library)
    else:
        mounts.append(Mount(host_path=str(injection.preload_file), container_path=str(CONTAINER_PRELOAD_PATH)))
    return ContainerEdits(env, mounts, device_nodes(injection, gpus))


def device_nodes(injection: Injection, gpus: list[PhysicalGpu]) -> list[DeviceNode]:
    """The GPUs' device nodes and the control nodes, those present under the device directory:
    every CRI runtime creates them in the container and allows them in its device cgroup, so
    the container reaches its GPUs (and only those) even where no NVIDIA hook runs, and keeps
    them when the kubelet updates its cgroup (the CPU manager does)."""
    if not injection.device_specs:
        return []
    names = [f"nvidia{gpu.minor}" for gpu in gpus if gpu.minor is not None] + list(CONTROL_DEVICE_NODES)
    return [DeviceNode(host_path=str(injection.device_dir / name), container_path=f"/dev/{name}")
            for name in names if (injection.device_dir / name).exists()]


def replace_file(target: Path, data: bytes, mode: int) -> None:
    """Writes `target` anew through one rename, so that containers already running keep the
    file they have (their mount or mapping holds the old one), and a reader never sees half
    of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        scratch.write_bytes(data)
        scratch.chmod(mode)
        scratch.replace(target)
    finally:
        scratch.unlink(missing_ok=True)  # only left when a step failed


class HostError(RuntimeError):
    """The node cannot be prepared; the message says what failed."""


def prepare_host(injection: Injection) -> None:
    """What must exist on the node before the first container: the client socket directory
    (the mount's source, even before the scheduler starts) and, with --preload=file, the
    preload file."""
    client_dir = injection.socket_paths.client_dir
    try:
        if not client_dir.is_dir():
            client_dir.mkdir(parents=True)
            client_dir.chmod(0o755)  # the protocol's mode
            log.info("created the client socket directory %s", client_dir)
        if injection.preload is Preload.FILE:
            replace_file(injection.preload_file, f"{injection.container_library}\n".encode(), 0o644)
            log.info("wrote %s (mounted at %s in containers)", injection.preload_file, CONTAINER_PRELOAD_PATH)
    except OSError as error:
        raise HostError(f"cannot prepare {error.filename} on the node: {error.strerror}") from None
