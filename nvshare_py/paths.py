"""Where the scheduler's sockets live. One setting, NVSHARE_SOCKET_DIR, locates both.

Without it every user of a machine reaches the same scheduler: the system one (root's, in
/var/run/nvshare, or $NVSHARE_SYSTEM_SOCKET_DIR) whenever it serves; a per-user directory only
when it does not (a single user without root). interceptor/config.c applies the same rule.

    <socket-dir>/client/scheduler.sock   clients (mounted into containers)
    <socket-dir>/control/control.sock    nvsharectl (never mounted into containers)
    <socket-dir>/status/status.sock      read-only status for every local user (never mounted)
    <socket-dir>/control/scheduler.lock  held by the running daemon
"""

from __future__ import annotations

import glob
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

ENV_SOCKET_DIR = "NVSHARE_SOCKET_DIR"
# Where root's (the machine's) scheduler serves. Settable so that a distribution can use /run,
# and so that tests can stand up a "system" scheduler without touching the real one.
ENV_SYSTEM_SOCKET_DIR = "NVSHARE_SYSTEM_SOCKET_DIR"
SYSTEM_SOCKET_DIR = Path("/var/run/nvshare")
CLIENT_SOCKET = Path("client") / "scheduler.sock"

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def system_socket_dir() -> Path:
    return Path(os.environ.get(ENV_SYSTEM_SOCKET_DIR) or SYSTEM_SOCKET_DIR)


def user_socket_dir() -> Path:
    """The directory a scheduler of this user serves when there is no system one: the system
    directory for root, else $XDG_RUNTIME_DIR/nvshare, else /tmp/nvshare-<uid>."""
    if os.geteuid() == 0:
        return system_socket_dir()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "nvshare"
    return Path(f"/tmp/nvshare-{os.geteuid()}")


def system_scheduler_serves() -> bool:
    """Whether a scheduler listens on the system directory's client socket."""
    return connect_error(system_socket_dir() / CLIENT_SOCKET) is None


# Where users' own schedulers serve (user_socket_dir): $XDG_RUNTIME_DIR is /run/user/<uid>
# under systemd-logind.
USER_SOCKET_DIR_PATTERNS = ("/run/user/*/nvshare", "/tmp/nvshare-*")


def serving_user_schedulers() -> list[Path]:
    """The socket directories of users' own schedulers that serve now (their client socket
    answers a connect), other than the system directory."""
    system = os.path.realpath(system_socket_dir())
    found = []
    for pattern in USER_SOCKET_DIR_PATTERNS:
        for directory in sorted(glob.glob(pattern)):
            if os.path.realpath(directory) != system and connect_error(Path(directory) / CLIENT_SOCKET, 0.5) is None:
                found.append(Path(directory))
    return found


def is_system_socket_dir(root: os.PathLike) -> bool:
    return os.path.realpath(root) == os.path.realpath(system_socket_dir())


def system_beside(root: os.PathLike) -> str:
    """What a user's scheduler (of `root`) says while the system scheduler serves beside it."""
    system = system_socket_dir()
    return (f"a system scheduler serves {system} beside this one ({root}): programs started from now on use it, "
            f"while this scheduler's keep running here, and the two do not keep their programs apart on the GPUs "
            f"they share. Stop this scheduler and restart its programs, so that all use {system}.")


def split_brain_warning(root: os.PathLike) -> str | None:
    """What to say when another scheduler serves beside the one of `root`: the system
    scheduler beside a user's, or users' schedulers beside the system one. Programs of two
    schedulers are not kept apart: they run on a GPU they share at the same time. None when
    `root`'s scheduler is alone."""
    system = system_socket_dir()
    if not is_system_socket_dir(root):
        return system_beside(root) if system_scheduler_serves() else None
    others = serving_user_schedulers()
    if not others:
        return None
    owners = []
    for directory in others:
        try:
            owners.append(f"{directory} (uid {directory.stat().st_uid})")
        except OSError:
            owners.append(str(directory))
    return (f"users' own schedulers serve beside this system scheduler ({system}): {', '.join(owners)}. Their "
            "programs and this scheduler's are not kept apart on the GPUs they share; ask those users to stop "
            "their schedulers and restart their programs, which then use this one.")


def not_a_directory(root: os.PathLike) -> str | None:
    """The one-line complaint about a socket directory (or one of its parents) that is not a
    directory, or None."""
    path = Path(root)
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            if candidate.is_dir():
                return None
            return (f"the socket directory {path} cannot be used: {candidate} is a file, not a directory; "
                    f"remove it or choose another directory with --socket-dir or {ENV_SOCKET_DIR}")
    return None


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
    # How root was chosen, for people asking "which scheduler does this program use?"
    origin: str = field(default="set explicitly", compare=False)

    @classmethod
    def resolve(cls, socket_dir: str | os.PathLike | None = None) -> "SocketPaths":
        """`socket_dir` if given, else $NVSHARE_SOCKET_DIR, else the system scheduler's
        directory (always for root) when it serves, else this user's (user_socket_dir).
        `origin` says which."""
        if socket_dir:
            return cls(Path(socket_dir).absolute(), "set explicitly")
        if os.environ.get(ENV_SOCKET_DIR):
            return cls(Path(os.environ[ENV_SOCKET_DIR]).absolute(), ENV_SOCKET_DIR)
        system = system_socket_dir()
        if os.geteuid() == 0:
            return cls(system.absolute(), "system directory")
        if system_scheduler_serves():
            return cls(system.absolute(), "system scheduler")
        return cls(user_socket_dir().absolute(), f"per-user; no system scheduler serves {system}")

    def describe(self) -> str:
        """E.g. "/var/run/nvshare (system scheduler)"."""
        return f"{self.root} ({self.origin})"

    @property
    def client_dir(self) -> Path:
        return self.root / "client"

    @property
    def control_dir(self) -> Path:
        return self.root / "control"

    @property
    def client_socket(self) -> Path:
        return self.root / CLIENT_SOCKET

    @property
    def control_socket(self) -> Path:
        return self.control_dir / "control.sock"

    @property
    def status_dir(self) -> Path:
        return self.root / "status"

    @property
    def status_socket(self) -> Path:
        return self.status_dir / "status.sock"

    @property
    def lock_file(self) -> Path:
        return self.control_dir / "scheduler.lock"

    @property
    def client_endpoint(self) -> str:
        return f"ipc://{self.client_socket}"

    @property
    def control_endpoint(self) -> str:
        return f"ipc://{self.control_socket}"

    @property
    def status_endpoint(self) -> str:
        return f"ipc://{self.status_socket}"
