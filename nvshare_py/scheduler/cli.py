"""`nvshare-scheduler`: the daemon's command line (docs/scheduler.md explains each option).

Two schedulers serving one machine do not keep their programs apart (paths.split_brain_warning).
At its start every scheduler says so when another serves; a user's own scheduler also runs,
beside the daemon (daemon.py), a watch for the system scheduler coming back while it serves.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Optional, cast

import trio

if sys.version_info < (3, 11):  # the builtin arrived in 3.11; trio brings the backport before
    from exceptiongroup import BaseExceptionGroup
import typer

from ..clikit import (
    APP_SETTINGS, LOG_LEVELS, TQ_MAX, TQ_MIN, VERSION_OPTION, number_between, one_of, setup_logging, whole_number,
)
from ..paths import (
    CLIENT_SOCKET, ENV_SOCKET_DIR, is_system_socket_dir, not_a_directory, split_brain_warning, system_beside,
    system_scheduler_serves, system_socket_dir, user_socket_dir,
)
from ..sizes import parse_size
from ..vocabulary import MODE
from . import admission, eviction
from .config import MAX_CLIENTS_PER_USER
from .daemon import CoreFailure, Daemon, DaemonConfig, StartupError
from .events import Mode

# sysexits.h EX_SOFTWARE: the lock core failed (docs/scheduler.md, Restarts); a supervisor
# restarts the daemon, which recovers the lock table from the clients.
EXIT_CORE_FAILURE = 70

log = logging.getLogger("nvshare.scheduler")

SWAPPING = ("on", "off")
# While the system scheduler serves beside a user's: how often the user's looks whether that is
# over, and how often it repeats its warning. After something was made in the system socket
# directory, it looks again after these pauses (a socket file appears just before it listens).
SPLIT_BRAIN_CHECK = 2.0
SPLIT_BRAIN_REPEAT = 600.0
SPLIT_BRAIN_RECHECKS = (0.0, 0.1, 0.5, 2.0)
# The systemd unit and tmpfiles.d entry shipped with the package.
SYSTEMD_DIR = Path(__file__).resolve().parent.parent / "systemd"


def _spill(text: str) -> int | str | None:
    """--admission-spill: a size (8G, 0, bytes), auto or off."""
    if text in ("auto", "off"):
        return None if text == "off" else text
    if text.isascii() and text.isdigit() and int(text) == 0:
        return 0
    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{exc}; or auto, or off") from None


def _headroom(text: str) -> int | None:
    """--headroom: a size (30G, 0, bytes) or auto (None)."""
    if text == "auto":
        return None
    if text.isascii() and text.isdigit() and int(text) == 0:
        return 0
    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{exc}; or auto") from None


HOUR, DAY = 3600.0, 86400.0

app = typer.Typer(**APP_SETTINGS, help="Grant each GPU's lock to one process at a time, for a time quantum.")


def choose_socket_dir(socket_dir: Path | None, private: bool) -> Path:
    """The directory this scheduler serves, or typer.Exit with the reason. One scheduler per
    machine: without --socket-dir, a user's scheduler refuses to start beside the system one
    (its programs would run kernels at the same time as the system scheduler's), unless
    --private says that is meant (it then warns, see serve)."""
    system = system_socket_dir()
    if socket_dir is None and not private and os.geteuid() != 0 and system_scheduler_serves():
        typer.echo(
            f"nvshare-scheduler: a system scheduler already serves {system}, and every user's programs "
            f"use it by default (nvshare-run, Jupyter kernels): there is nothing to start. To run a private "
            f"scheduler anyway (its programs are not kept apart from the system scheduler's on shared GPUs), "
            f"pass --private.",
            err=True,
        )
        raise typer.Exit(1)
    chosen = socket_dir if socket_dir is not None else user_socket_dir()
    problem = not_a_directory(chosen)
    if problem is not None:
        typer.echo(f"nvshare-scheduler: {problem}", err=True)
        raise typer.Exit(1)
    return chosen


@app.command()
def serve(
    socket_dir: Optional[Path] = typer.Option(
        None, envvar=ENV_SOCKET_DIR, readable=False,
        help=f"Directory of the client and control sockets [default: {system_socket_dir()} as root; for other users "
        "$XDG_RUNTIME_DIR/nvshare or /tmp/nvshare-<uid>, refused while a system scheduler serves]",
    ),
    private: bool = typer.Option(
        False, "--private", help="Start a per-user scheduler even though a system scheduler serves (see --socket-dir)"
    ),
    mode: str = typer.Option("on", metavar="|".join(MODE.words), parser=one_of(MODE.words, "a mode"),
                             help=MODE.explain()),
    tq: float = typer.Option(30.0, parser=number_between(TQ_MIN, TQ_MAX),
                             help=f"Time quantum in seconds ({TQ_MIN:g} to {TQ_MAX:g}): how long a holder keeps the lock while others wait"),
    grace: float = typer.Option(5.0, parser=number_between(0, DAY),
                                help="Seconds a dropped holder has to drain and release before its grant is revoked"),
    heartbeat_interval: float = typer.Option(1.0, parser=number_between(0.01, HOUR),
                                             help="Seconds between client heartbeats (told to clients)"),
    heartbeat_timeout: float = typer.Option(5.0, parser=number_between(0.01, DAY),
                                            help="A client silent for this many seconds is considered gone"),
    idle_release: float = typer.Option(
        1.0, parser=number_between(0, DAY),
        help="Default idle window in seconds after which a holder gives the lock back (told to clients); 0 turns early release off",
    ),
    idle_release_contended: float = typer.Option(
        0.1, parser=number_between(0, DAY),
        help="While others wait, the idle window of a holder whose release would move none of its memory, so that "
        "a tenant asked every second does not keep the GPU from the others for a quantum (a tenth of it for a holder whose "
        "last pause away lasted twice this: a server between requests); 0: its usual window"),
    recovery: float = typer.Option(2.0, parser=number_between(0, DAY), help="After a restart over a previous daemon's sockets: seconds to wait for holders to reclaim their locks"),
    swapping: str = typer.Option(
        "on", metavar="on|off", parser=one_of(SWAPPING, "on or off"), help="on: a handoff over a device's memory budget moves memory in bulk (DROP evict=, EVICT, "
        "GRANT prefetch=); off: nothing is asked to move, the driver's page faults do it (docs/scheduler.md)"),
    headroom: str = typer.Option(
        "auto", metavar="BYTES|auto", parser=_headroom,
        help="Memory kept free on a device over its budget while nobody waits, so that a sleeping tenant's next "
        "request brings its memory back without evicting on its way (30G, 0); auto: room for the tenant with "
        "most memory out, at most a quarter of the budget (docs/scheduler.md, Many tenants)"),
    eviction_order: str = typer.Option(
        "lru2", metavar="|".join(eviction.ORDERS), parser=one_of(eviction.ORDERS, "an eviction order"),
        help="Which idle tenants leave first under memory pressure, within a priority class: lru2, the least "
        "recently used by the use before their last (a tenant asked once a minute goes before one asked every "
        "second, also just after its request); lru, by their last use"),
    min_quantum: float = typer.Option(1.0, parser=number_between(0.01, TQ_MAX),
                                      help="Shortest quantum in seconds: of a light holder under weights, and of a holder a higher priority class waits behind"),
    ageing: int = typer.Option(4, parser=whole_number(0, 1_000_000),
                               help="A waiter rises one priority class per this many grants made while it waits (0: never)"),
    gang_wait: float = typer.Option(30.0, parser=number_between(0, DAY),
                                    help="Seconds a gang (a multi-GPU job) that said its size waits for missing members "
                                    "once one asks, before it runs with those present (docs/scheduler.md, Gangs)"),
    max_clients_per_user: int = typer.Option(
        DaemonConfig.max_clients_per_user, parser=whole_number(1, MAX_CLIENTS_PER_USER),
        help="Client processes one user may have connected at once outside pods, and one pod; a process beyond it "
             "is told why and connects again later (at most an eighth of the connections the daemon serves)"),
    log_level: str = typer.Option("info", metavar="|".join(LOG_LEVELS), parser=one_of(LOG_LEVELS, "a log level"),
                                  help="Log verbosity"),
    metrics: Optional[str] = typer.Option(None, metavar="ADDRESS", help="Serve Prometheus metrics on HOST:PORT or :PORT (every interface), e.g. 127.0.0.1:9415 (docs/metrics.md) [default: off]"),
    admission_spill: str = typer.Option(
        "auto", metavar="BYTES|auto|off", parser=_spill,
        help="Admission: host memory the node's clients may hold beyond the devices' budgets (64G, 0); "
        f"auto: {admission.DEFAULT_SPILL_FRACTION:g} of MemAvailable at start; off: no admission (docs/scheduler.md)",
    ),
    admission_policy: str = typer.Option("fifo", metavar="|".join(admission.POLICIES),
                                         parser=one_of(admission.POLICIES, "an admission policy"),
                                         help="Who of the allocations waiting for admission goes first"),
    admission_timeout: float = typer.Option(admission.DEFAULT_TIMEOUT, parser=number_between(0.001, DAY),
                                            help="Seconds an allocation waits for admission before it fails with out-of-memory"),
    print_systemd_unit: bool = typer.Option(
        False, "--print-systemd-unit", help="Print a systemd unit that runs this nvshare-scheduler as the machine's "
        "scheduler, and exit (docs/scheduler.md, As a service)"),
    print_tmpfiles: bool = typer.Option(
        False, "--print-tmpfiles", help="Print the tmpfiles.d entry that makes its socket directory at boot, and exit"),
    admission_share: float = typer.Option(admission.DEFAULT_SHARE, parser=number_between(0.01, 1.0),
                                          help="The part of the admission capacity one user (uid) or pod may hold (1: no bound)"),
    version: bool = VERSION_OPTION,
) -> None:
    if print_systemd_unit or print_tmpfiles:
        print_service_files(print_systemd_unit, print_tmpfiles)
        return
    try:
        config = DaemonConfig(
            socket_dir=socket_dir,
            mode=cast(Mode, mode),  # one of MODE.words: its parser saw to it
            tq=tq,
            grace=grace,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            idle_release=idle_release,
            idle_release_contended=idle_release_contended,
            recovery=recovery,
            swapping=swapping == "on",
            headroom=cast("int | None", headroom),  # _headroom's parser made it one
            eviction_order=eviction_order,
            min_quantum=min_quantum,
            ageing=ageing,
            gang_wait=gang_wait,
            max_clients_per_user=max_clients_per_user,
            metrics=metrics,
            admission_spill=admission_spill,
            admission_policy=admission_policy,
            admission_timeout=admission_timeout,
            admission_share=admission_share,
        )
    except ValueError as exc:  # what the parsers let through: e.g. a heartbeat timeout not longer than the interval
        raise typer.BadParameter(str(exc)) from None
    chosen = choose_socket_dir(socket_dir, private)
    config = dataclasses.replace(config, socket_dir=chosen)
    setup_logging(log_level)
    beside = split_brain_warning(chosen)
    if beside is not None:
        typer.echo(f"nvshare-scheduler: warning: {beside}", err=True)
    daemon = Daemon(config)
    try:
        daemon.open()
    except StartupError as exc:
        typer.echo(f"nvshare-scheduler: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        trio.run(serve_and_watch, daemon, daemon.paths.root, beside)
    except CoreFailure:
        raise typer.Exit(EXIT_CORE_FAILURE) from None  # logged (CRITICAL, with the traceback) already
    finally:
        daemon.close()


async def serve_and_watch(daemon: Daemon, root: Path, beside: str | None) -> None:
    """The daemon, and beside a user's scheduler the watch for the system one (`beside`: what
    was said at the start); the daemon's own failure (its CoreFailure) comes out as the daemon
    raised it."""
    try:
        async with trio.open_nursery() as nursery:
            if not is_system_socket_dir(root):
                nursery.start_soon(watch_for_the_system_scheduler, root, beside)
            await daemon.serve()
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        failure: BaseException = group
        while isinstance(failure, BaseExceptionGroup) and len(failure.exceptions) == 1:
            failure = failure.exceptions[0]
        raise failure from None


async def watch_for_the_system_scheduler(root: Path, said: str | None) -> None:
    """A user's scheduler (of `root`) says in its log when the system scheduler starts serving
    beside it, repeats it every SPLIT_BRAIN_REPEAT seconds while that lasts, and says when it
    is over. The kernel wakes it (inotify) when something is made in the system socket
    directory's client/ (or in the deepest part of that path that exists): while it is alone
    nothing else does, so an idle scheduler stays idle. The system scheduler does not watch
    users' directories (/tmp would wake it at every file made there): it looks at its start."""
    socket_path = system_socket_dir() / CLIENT_SOCKET
    said_at = trio.current_time()
    try:
        watch = DirectoryWatch()
    except OSError as error:
        log.info("cannot watch for the system scheduler coming back (inotify: %s)", error.strerror or error)
        return
    with watch:
        while True:
            watch.watch(next(path for path in (*socket_path.parents, Path("/")) if _is_directory(path)))
            serving: bool | None = False
            for pause in (SPLIT_BRAIN_RECHECKS if said is None else (0.0,)):
                await trio.sleep(pause)
                serving = await serves(socket_path)
                if serving is None:  # no descriptor to look with: nothing new is known
                    serving = said is not None
                if serving:
                    break
            now = trio.current_time()
            if serving and (said is None or now - said_at >= SPLIT_BRAIN_REPEAT):
                said, said_at = system_beside(root), now
                log.warning("%s", said)
            elif not serving and said is not None:
                log.warning("no other scheduler serves beside this one any more (%s)", root)
                said = None
            if said is None:
                await watch.changed()
            else:
                with trio.move_on_after(SPLIT_BRAIN_CHECK):
                    await watch.changed()


def _is_directory(path: Path) -> bool:
    """Whether `path` is a directory this process may look at (a parent it may not read is not)."""
    try:
        return path.is_dir()
    except OSError:
        return False


async def serves(path: Path) -> bool | None:
    """Whether something listens on the Unix socket `path` (a connect that does not block);
    None when no socket can be made to look (out of descriptors: the daemon serves on)."""
    try:
        probe = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None
    with probe:
        with trio.move_on_after(SPLIT_BRAIN_CHECK):
            try:
                await probe.connect(os.fspath(path))
                return True
            except OSError:
                return False
    return False


class DirectoryWatch:
    """The kernel's word (inotify) that an entry of one directory was made, renamed into it or
    changed its mode, or that the directory itself went. libc's inotify calls through ctypes:
    the standard library has none."""

    _MASK = 0x100 | 0x80 | 0x4 | 0x400 | 0x800  # IN_CREATE, IN_MOVED_TO, IN_ATTRIB, IN_DELETE_SELF, IN_MOVE_SELF

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        self._watched: int | None = None

    def watch(self, directory: Path) -> None:
        """Watch `directory` (instead of the one watched before)."""
        if self._watched is not None:
            self._libc.inotify_rm_watch(self._fd, self._watched)  # fails harmlessly for one that went
        watched = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), self._MASK)
        self._watched = watched if watched >= 0 else None

    async def changed(self) -> None:
        """Until the kernel reports a change (or forever, where nothing is watched)."""
        await trio.lowlevel.wait_readable(self._fd)
        while True:
            try:
                if not os.read(self._fd, 65536):
                    return
            except BlockingIOError:
                return

    def __enter__(self) -> "DirectoryWatch":
        return self

    def __exit__(self, *exc_info: object) -> None:
        trio.lowlevel.notify_closing(self._fd)
        os.close(self._fd)


def print_service_files(unit: bool, tmpfiles: bool) -> None:
    """The packaged systemd unit, its ExecStart set to this nvshare-scheduler, and the
    tmpfiles.d entry of the socket directory."""
    if unit:
        scheduler = shutil.which("nvshare-scheduler") or f"{sys.executable} -m nvshare_py.scheduler"
        text = (SYSTEMD_DIR / "nvshare-scheduler.service").read_text()
        typer.echo(text.replace("@SCHEDULER@", scheduler), nl=False)
    if tmpfiles:
        typer.echo((SYSTEMD_DIR / "nvshare.conf").read_text(), nl=False)


def main() -> None:
    app(prog_name="nvshare-scheduler")
