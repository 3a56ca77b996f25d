"""`nvshare-scheduler`: the daemon's command line (docs/scheduler.md explains each option)."""

from __future__ import annotations

import enum
import logging
import sys
from pathlib import Path
from typing import Optional

import trio
import typer

from ..paths import ENV_SOCKET_DIR
from .daemon import Daemon, DaemonConfig, StartupError


class Mode(str, enum.Enum):
    on = "on"
    off = "off"
    auto = "auto"


class LogLevel(str, enum.Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


app = typer.Typer(add_completion=False, help="Grant each GPU's lock to one process at a time, for a time quantum.")


def _positive(value: float) -> float:
    if not value > 0:
        raise typer.BadParameter("must be greater than 0")
    return value


def _not_negative(value: float) -> float:
    if value < 0:
        raise typer.BadParameter("must not be negative")
    return value


@app.command()
def serve(
    socket_dir: Optional[Path] = typer.Option(
        None, envvar=ENV_SOCKET_DIR, readable=False, help="Directory of the client and control sockets [default: /var/run/nvshare for root, else $XDG_RUNTIME_DIR/nvshare or /tmp/nvshare-<uid>]"
    ),
    mode: Mode = typer.Option(Mode.on, help="on: one process per GPU at a time; off: no scheduling; auto: share while the holders' memory fits"),
    tq: float = typer.Option(30.0, callback=_positive, help="Time quantum in seconds: how long a holder keeps the lock while others wait"),
    grace: float = typer.Option(5.0, callback=_not_negative, help="Seconds a dropped holder has to drain and release before its grant is revoked"),
    heartbeat_interval: float = typer.Option(1.0, callback=_positive, help="Seconds between client heartbeats (told to clients)"),
    heartbeat_timeout: float = typer.Option(5.0, callback=_positive, help="A client silent for this many seconds is considered gone"),
    idle_release: float = typer.Option(1.0, callback=_positive, help="Default idle window after which a holder gives the lock back (told to clients)"),
    recovery: float = typer.Option(2.0, callback=_not_negative, help="After a restart over a previous daemon's sockets: seconds to wait for holders to reclaim their locks"),
    log_level: LogLevel = typer.Option(LogLevel.info, help="Log verbosity"),
) -> None:
    if heartbeat_timeout <= heartbeat_interval:
        raise typer.BadParameter("must be longer than --heartbeat-interval", param_hint="--heartbeat-timeout")
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
        )
    except ValueError as exc:  # what the callbacks let through, e.g. "inf" or 1e300 seconds
        raise typer.BadParameter(str(exc)) from None
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
    finally:
        daemon.close()


def main() -> None:
    app(prog_name="nvshare-scheduler")
