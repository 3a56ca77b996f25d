"""What the daemon needs from the machine before it serves: its socket directories (and the
checks that nobody else can swap the sockets in them), the lock file that keeps a second
daemon off the same directory, and the descriptor limit that sizes how many connections it
serves (docs/scheduler.md, *Sockets, files and the security model*)."""

from __future__ import annotations

import fcntl
import os
import resource
import stat

from ..paths import SocketPaths


class StartupError(Exception):
    """The daemon refuses to start; the message tells the operator why and what to do."""


class CoreFailure(Exception):
    """The lock core raised on an event: the daemon stops (see Daemon._feed)."""


# Descriptors the daemon needs besides its connections: stdio, the lock file, the listening
# sockets (client, control, status, metrics), Trio's epoll and wake-up socket, and files it
# opens for a moment (/proc/<pid>/cgroup and ns/pid, the passwd database).
FIXED_DESCRIPTORS = 32
# Client connections served at most, whatever the descriptor limit: about 14 KiB of memory
# each when registered (docs/scheduler.md, *What a registration costs*).
CLIENT_CONNECTIONS_MAX = 4096


def client_connections(nofile: int, others: int) -> int:
    """How many client connections `nofile` descriptors allow when `others` are kept for the
    other sockets' connections (control, status, metrics): each client connection may cost
    two, its socket and a pidfd."""
    return max(8, min(CLIENT_CONNECTIONS_MAX, (nofile - FIXED_DESCRIPTORS - others) // 2))


def raise_descriptor_limit() -> int:
    """Each client costs a connection and a pidfd: lift the soft limit on open files (often
    1024) to the hard limit the administrator allows. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. an unlimited hard limit above the kernel's nr_open
            pass
    return soft


def descriptor_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def prepare_directories(paths: SocketPaths, uid: int) -> None:
    """Create the socket directories with their modes, refusing any that someone other than
    root or `uid` (the daemon's) could swap."""
    paths.root.mkdir(mode=0o755, parents=True, exist_ok=True)
    # Whoever owns the directory can rename the socket directories in it and put its own
    # in their place (e.g. by creating the /tmp default of another user first).
    info = paths.root.stat()
    owner = info.st_uid
    if owner not in (0, uid):
        raise StartupError(
            f"{paths.root} belongs to uid {owner}, neither this daemon's uid {uid} nor root, "
            "so that user could replace the sockets in it: choose another --socket-dir"
        )
    # The same holds for anyone who may write to it, unless the sticky bit stops them
    # renaming what they do not own (as in /tmp).
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise StartupError(
            f"{paths.root} is writable by {'others' if info.st_mode & stat.S_IWOTH else 'its group'} "
            f"(mode {stat.S_IMODE(info.st_mode):o}) without the sticky bit, so they could replace the "
            "sockets in it: remove that permission (chmod go-w) or choose another --socket-dir"
        )
    for directory, mode in ((paths.client_dir, 0o755), (paths.control_dir, 0o700), (paths.status_dir, 0o755)):
        try:
            directory.mkdir(mode=mode)
        except FileExistsError:
            pass
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode):
            raise StartupError(f"{directory} is not a directory (symbolic links are refused)")
        if info.st_uid != uid:
            raise StartupError(
                f"{directory} belongs to uid {info.st_uid}, not to this daemon's uid {uid}: "
                "remove it or choose another --socket-dir"
            )
        os.chmod(directory, mode)


def take_lock(paths: SocketPaths) -> int:
    """The exclusive flock that keeps a second daemon off the directory; returns its
    descriptor (the lock lasts as long as it is open). Raises StartupError when held."""
    lock_file = paths.lock_file
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(
            f"another nvshare-scheduler (pid {holder}) is already serving {paths.root} "
            f"(it holds {lock_file})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def previous_daemon_left_clients(paths: SocketPaths) -> bool:
    """A client socket file left by an earlier daemon means its clients may reconnect."""
    try:
        info = os.lstat(paths.client_socket)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(info.st_mode):
        raise StartupError(f"{paths.client_socket} exists and is not a socket; remove it")
    return True


def pid_namespace(pid: int | str = "self") -> tuple[int, int]:
    """The identity of a process's pid namespace (raises OSError when it cannot be read)."""
    info = os.stat(f"/proc/{pid}/ns/pid")
    return info.st_dev, info.st_ino
