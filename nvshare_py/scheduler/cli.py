"""`nvshare-scheduler`: the daemon's command line (docs/scheduler.md explains each option)."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import trio
import typer

from ..clikit import APP_SETTINGS, TQ_MAX, TQ_MIN, VERSION_OPTION, number_between, whole_number
from ..paths import ENV_SOCKET_DIR, not_a_directory, system_scheduler_serves, system_socket_dir, user_socket_dir
from . import admission
from .daemon import CoreFailure, Daemon, DaemonConfig, StartupError

# sysexits.h EX_SOFTWARE: the lock core failed (docs/scheduler.md, Restarts); a supervisor
# restarts the daemon, which recovers the lock table from the clients.
EXIT_CORE_FAILURE = 70


AdmissionPolicy = enum.Enum("AdmissionPolicy", {name.replace("-", "_"): name for name in admission.POLICIES}, type=str)


def _spill(text: str) -> int | str | None:
    if text in ("auto", "off"):
        return None if text == "off" else text
    if not (text.isascii() and text.isdigit()):
        raise typer.BadParameter(f"{text!r}: give a number of bytes, auto or off")
    return int(text)


class Mode(str, enum.Enum):
    on = "on"
    off = "off"
    auto = "auto"


class Swapping(str, enum.Enum):
    on = "on"
    off = "off"


class LogLevel(str, enum.Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


HOUR, DAY = 3600.0, 86400.0

app = typer.Typer(**APP_SETTINGS, help="Grant each GPU's lock to one process at a time, for a time quantum.")


def choose_socket_dir(socket_dir: Path | None, private: bool) -> Path:
    """The directory this scheduler serves, or typer.Exit with the reason. One scheduler per
    machine: without --socket-dir, a user's scheduler refuses to start beside the system one
    (its programs would run kernels at the same time as the system scheduler's), unless
    --private says that is meant."""
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
    if os.path.abspath(chosen) != os.path.abspath(system) and system_scheduler_serves():
        typer.echo(
            f"nvshare-scheduler: warning: a system scheduler serves {system}; programs of this scheduler "
            f"({chosen}) and of that one are not kept apart on GPUs they share",
            err=True,
        )
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
    mode: Mode = typer.Option(Mode.on, help="on: one process per GPU at a time; off: no scheduling; auto: share while the holders' memory fits"),
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
    swapping: Swapping = typer.Option(
        Swapping.on, help="on: a handoff over a device's memory budget moves memory in bulk (DROP evict=, EVICT, "
        "GRANT prefetch=); off: nothing is asked to move, the driver's page faults do it (docs/scheduler.md)"),
    min_quantum: float = typer.Option(1.0, parser=number_between(0.01, TQ_MAX),
                                      help="Shortest quantum in seconds: of a light holder under weights, and of a holder a higher priority class waits behind"),
    ageing: int = typer.Option(4, parser=whole_number(0, 1_000_000),
                               help="A waiter rises one priority class per this many grants made while it waits (0: never)"),
    log_level: LogLevel = typer.Option(LogLevel.info, help="Log verbosity"),
    metrics: Optional[str] = typer.Option(None, metavar="ADDRESS", help="Serve Prometheus metrics on HOST:PORT or :PORT (every interface), e.g. 127.0.0.1:9400 (docs/metrics.md) [default: off]"),
    admission_spill: str = typer.Option(
        "auto", metavar="BYTES|auto|off", parser=_spill,
        help="Admission: host memory in bytes the node's clients may hold beyond the devices' budgets; "
        f"auto: {admission.DEFAULT_SPILL_FRACTION:g} of MemAvailable at start; off: no admission (docs/scheduler.md)",
    ),
    admission_policy: AdmissionPolicy = typer.Option(AdmissionPolicy.fifo, help="Who of the allocations waiting for admission goes first"),
    admission_timeout: float = typer.Option(admission.DEFAULT_TIMEOUT, parser=number_between(0.001, DAY),
                                            help="Seconds an allocation waits for admission before it fails with out-of-memory"),
    version: bool = VERSION_OPTION,
) -> None:
    try:
        config = DaemonConfig(
            socket_dir=socket_dir,
            mode=mode.value,
            tq=tq,
            grace=grace,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            idle_release=idle_release,
            recovery=recovery,
            swapping=swapping is Swapping.on,
            min_quantum=min_quantum,
            ageing=ageing,
            metrics=metrics,
            admission_spill=admission_spill,
            admission_policy=admission_policy.value,
            admission_timeout=admission_timeout,
        )
    except ValueError as exc:  # what the parsers let through: e.g. a heartbeat timeout not longer than the interval
        raise typer.BadParameter(str(exc)) from None
    config = dataclasses.replace(config, socket_dir=choose_socket_dir(socket_dir, private))
    logging.basicConfig(
        stream=sys.stderr,
        level=log_level.value.upper(),
        format="%(asctime)s.%(msecs)03d %(levelname)s %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
    daemon = Daemon(config)
    try:
        daemon.open()
    except StartupError as exc:
        typer.echo(f"nvshare-scheduler: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        trio.run(daemon.serve)
    except CoreFailure:
        raise typer.Exit(EXIT_CORE_FAILURE) from None  # logged (CRITICAL, with the traceback) already
    finally:
        daemon.close()


def main() -> None:
    app(prog_name="nvshare-scheduler")
