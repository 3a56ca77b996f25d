"""Where nvsharectl reads from, and what `--since` means.

Status and events come from the scheduler's control socket where it is open to the caller
(root and the scheduler's own user), else from its read-only status socket, which every local
user reaches (docs/scheduler.md, security model): `Reader` tries the one, then the other.
Settings only ever go to the control socket.

`--since` has one meaning in every command that reads events (`events`, `timeline`): a
duration with its unit (`30s`, `5m`, `1.5h`, `2d`) is that long before now; a whole number is
an event sequence number (the first column of `nvsharectl events`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import typer

from nvshare_py import control
from nvshare_py.control import EXIT_NOT_RUNNING, EXIT_PERMISSION, ControlConnection, ControlFailure
from nvshare_py.paths import SocketPaths


@dataclass
class Settings:
    paths: SocketPaths
    timeout: float

    def connect(self) -> ControlConnection:
        return ControlConnection(self.paths, self.timeout)


class Reader:
    """Read requests (`status`, `events`) on the control socket, or, where that is closed to
    this user (permission denied, or the scheduler answered `forbidden`), on the read-only
    status socket. `read_only` says which one answers. Use as a context manager."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.read_only = False
        self._denied: ControlFailure | None = None
        self._connection: ControlConnection | None = None
        try:
            self._connection = settings.connect()
        except ControlFailure as failure:
            if failure.exit_code != EXIT_PERMISSION:
                raise
            self._read_only_from(failure)

    def _read_only_from(self, failure: ControlFailure) -> None:
        self.read_only = True
        self._denied = failure
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def request(self, op: str, **fields: Any) -> Any:
        if self._connection is not None:
            try:
                return self._connection.request(op, **fields)
            except ControlFailure as failure:
                if failure.exit_code != EXIT_PERMISSION:
                    raise
                self._read_only_from(failure)
        try:
            return control.read_only_status(self.settings.paths, op, timeout=self.settings.timeout, **fields)
        except ControlFailure as failure:
            if failure.exit_code == EXIT_NOT_RUNNING and self._denied is not None:
                # A scheduler without the read-only socket: the permission problem is the news.
                raise ControlFailure(self._denied.exit_code, f"{self._denied} (and {failure})") from None
            raise

    def events_since(self, since: int = 0) -> tuple[list[dict], int]:
        """Every stored lock event with a sequence number from `since` on, and the number to ask
        from next time (control.events_pages)."""
        return control.events_pages(self.request, since)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- --since -------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d)")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class Since:
    """`--since`: a sequence number, or seconds before now."""

    seq: int | None = None
    seconds: float | None = None

    def start_time(self, events: list[dict], now: float) -> float:
        """The wall-clock time it starts at, given the events (a sequence number starts at its
        event's time; one past the last event, now)."""
        if self.seconds is not None:
            return now - self.seconds
        chosen = [e["t"] for e in events if e["seq"] >= (self.seq or 0)]
        return min(chosen) if chosen else now

    def select(self, events: list[dict], now: float) -> list[dict]:
        if self.seq is not None:
            return [e for e in events if e["seq"] >= self.seq]
        start = self.start_time(events, now)
        return [e for e in events if e["t"] >= start]


def parse_since(text: str) -> Since:
    """A typer `parser` for --since: `30s`, `5m`, `1.5h`, `2d`, or a sequence number."""
    text = text.strip()
    if text.isascii() and text.isdigit():
        return Since(seq=int(text))
    match = _DURATION.fullmatch(text.lower())
    if match is None:
        raise typer.BadParameter(f"{text!r} is neither a duration (30s, 5m, 1.5h, 2d) nor an event sequence "
                                 "number (a whole number, as the first column of nvsharectl events)")
    return Since(seconds=float(match.group(1)) * _UNITS[match.group(2)])
