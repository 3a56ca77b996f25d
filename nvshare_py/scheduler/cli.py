"""`nvshare-scheduler`: the daemon's command line (docs/scheduler.md explains each option).

Besides the daemon (daemon.py) it runs one task of its own: the watch for a second scheduler
serving the same machine (a user's own beside the system one, or the system one coming back
beside a user's), which it reports loudly in the log (paths.split_brain_warning).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, cast

import trio
import typer

from ..clikit import (
    APP_SETTINGS, LOG_LEVELS, TQ_MAX, TQ_MIN, VERSION_OPTION, number_between, one_of, setup_logging, whole_number,
)
from ..paths import (
    ENV_SOCKET_DIR, not_a_directory, split_brain_warning, system_scheduler_serves, system_socket_dir, user_socket_dir,
)
from ..sizes import parse_size
from . import admission
from .daemon import Daemon, DaemonConfig, StartupError
from .events import Mode

log = logging.getLogger("nvshare.scheduler")

MODES = ("on", "off", "auto")
SWAPPING = ("on", "off")
# How often the scheduler looks for a second scheduler beside it, and how often it repeats the
# warning while one serves.
SPLIT_BRAIN_CHECK = 2.0
SPLIT_BRAIN_REPEAT = 600.0
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


HOUR, DAY = 3600.0, 86400.0

app = typer.Typer(**APP_SETTINGS, help="Grant each GPU's lock to one process at a time, for a time quantum.")


def choose_socket_dir(socket_dir: Path | None, private: bool) -> Path:
    """The directory this scheduler serves, or typer.Exit with the reason. One scheduler per
    machine: without --socket-dir, a user's scheduler refuses to start beside the system one
    (its programs would run kernels at the same time as the system scheduler's), unless
    --private says that is meant (the log then warns, see watch_for_split_brain)."""
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
    mode: str = typer.Option("on", metavar="on|off|auto", parser=one_of(MODES, "a mode"),
                             help="on: one process per GPU at a time; off: no scheduling; auto: share while the holders' memory fits"),
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
    recovery: float = typer.Option(2.0, parser=number_between(0, DAY), help="After a restart over a previous daemon's sockets: seconds to wait for holders to reclaim their locks"),
    swapping: str = typer.Option(
        "on", metavar="on|off", parser=one_of(SWAPPING, "on or off"), help="on: a handoff over a device's memory budget moves memory in bulk (DROP evict=, EVICT, "
        "GRANT prefetch=); off: nothing is asked to move, the driver's page faults do it (docs/scheduler.md)"),
    min_quantum: float = typer.Option(1.0, parser=number_between(0.01, TQ_MAX),
                                      help="Shortest quantum in seconds: of a light holder under weights, and of a holder a higher priority class waits behind"),
    ageing: int = typer.Option(4, parser=whole_number(0, 1_000_000),
                               help="A waiter rises one priority class per this many grants made while it waits (0: never)"),
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
    version: bool = VERSION_OPTION,
) -> None:
    if print_systemd_unit or print_tmpfiles:
        print_service_files(print_systemd_unit, print_tmpfiles)
        return
    try:
        config = DaemonConfig(
            socket_dir=socket_dir,
            mode=cast(Mode, mode),  # one of MODES: its parser saw to it
            tq=tq,
            grace=grace,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            idle_release=idle_release,
            recovery=recovery,
            swapping=swapping == "on",
            min_quantum=min_quantum,
            ageing=ageing,
            metrics=metrics,
            admission_spill=admission_spill,
            admission_policy=admission_policy,
            admission_timeout=admission_timeout,
        )
    except ValueError as exc:  # what the parsers let through: e.g. a heartbeat timeout not longer than the interval
        raise typer.BadParameter(str(exc)) from None
    config = dataclasses.replace(config, socket_dir=choose_socket_dir(socket_dir, private))
    setup_logging(log_level)
    daemon = Daemon(config)
    try:
        daemon.open()
    except StartupError as exc:
        typer.echo(f"nvshare-scheduler: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        trio.run(serve_and_watch, daemon, daemon.paths.root)
    finally:
        daemon.close()


async def serve_and_watch(daemon: Daemon, root: Path) -> None:
    """The daemon, and beside it the watch for a second scheduler; the daemon's own failure
    (its CoreFailure) comes out as the daemon raised it."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_for_split_brain, root)
            await daemon.serve()
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        failure: BaseException = group
        while isinstance(failure, BaseExceptionGroup) and len(failure.exceptions) == 1:
            failure = failure.exceptions[0]
        raise failure from None


async def watch_for_split_brain(root: Path, interval: float = SPLIT_BRAIN_CHECK) -> None:
    """Warn in the log when a second scheduler starts serving beside this one (a user's own
    beside the system one, or the system one coming back beside a user's), every
    SPLIT_BRAIN_REPEAT seconds while it lasts, and say when it is over: their programs would
    run on the GPUs they share at the same time."""
    said: str | None = None
    said_at = 0.0
    while True:
        # A connect to each candidate socket: in a thread, so that the daemon's loop never waits.
        warning = await trio.to_thread.run_sync(split_brain_warning, root)
        now = trio.current_time()
        if warning is not None and (warning != said or now - said_at >= SPLIT_BRAIN_REPEAT):
            log.warning("%s", warning)
            said, said_at = warning, now
        elif warning is None and said is not None:
            log.warning("no other scheduler serves beside this one any more (%s)", root)
            said = None
        await trio.sleep(interval)


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
