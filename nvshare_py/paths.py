"""Where the scheduler's sockets live. One setting, NVSHARE_SOCKET_DIR, locates both.

    <socket-dir>/client/scheduler.sock   clients (mounted into containers)
    <socket-dir>/control/control.sock    nvsharectl (never mounted into containers)
    <socket-dir>/control/scheduler.lock  held by the running daemon
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

ENV_SOCKET_DIR = "NVSHARE_SOCKET_DIR"

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def default_socket_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/run/nvshare")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "nvshare"
    return Path(f"/tmp/nvshare-{os.geteuid()}")


def check_socket_path(path: Path) -> None:
    """Raise ValueError, saying why, when `path` is too long to be a Unix socket's address
    (bind and connect would fail with a bare "AF_UNIX path too long")."""
    length = len(os.fsencode(path))
    if length > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {path} is {length} bytes; Unix socket paths are limited to {MAX_SOCKET_PATH} bytes")


def connect_error(path: os.PathLike, timeout: float = 2.0) -> OSError | None:
    """Why a plain AF_UNIX connect to `path` fails (FileNotFoundError, ConnectionRefusedError,
    PermissionError, ...), or None when something listens there. Cheaper and more telling than
    ZeroMQ, which retries silently."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(os.fspath(path))
    except OSError as error:
        return error
    finally:
        probe.close()
    return None


@dataclass(frozen=True)
class SocketPaths:
    root: Path

    @classmethod
    def resolve(cls, socket_dir: str | os.PathLike | None = None) -> "SocketPaths":
        """`socket_dir` if given, else $NVSHARE_SOCKET_DIR, else the per-user default."""
        chosen = socket_dir or os.environ.get(ENV_SOCKET_DIR) or default_socket_dir()
        return cls(Path(chosen).absolute())

    @property
    def client_dir(self) -> Path:
        return self.root / "client"

    @property
    def control_dir(self) -> Path:
        return self.root / "control"

    @property
    def client_socket(self) -> Path:
        return self.client_dir / "scheduler.sock"

    @property
    def control_socket(self) -> Path:
        return self.control_dir / "control.sock"

    @property
    def lock_file(self) -> Path:
        return self.control_dir / "scheduler.lock"

    @property
    def client_endpoint(self) -> str:
        return f"ipc://{self.client_socket}"

    @property
    def control_endpoint(self) -> str:
        return f"ipc://{self.control_socket}"
