"""The requesting side of the control socket and of the status socket (docs/protocol.md,
"Control socket", "Status socket").

`ControlConnection` turns every way a request can fail into a `ControlFailure` whose
`exit_code` is nvsharectl's documented exit status, so callers (nvsharectl, test fixtures,
scripts) can tell a refusal from a missing daemon from a permission problem. Root and the
scheduler's user use the control socket; everyone else may read (`status`, `events`) on the
status socket with `read_only_status` (nvsharectl reads there when the control socket is closed
to its user: ctl/reading.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import zmq

from .paths import SocketPaths, connect_error, not_a_directory
from .protocol import CONTROL_EVENTS_MAX, CONTROL_REPLY_MAX, CONTROL_REQUEST_MAX

EXIT_OK = 0
EXIT_REFUSED = 1  # the daemon refused the request
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3  # no socket, connection refused, or no answer in time
EXIT_PERMISSION = 4  # socket not accessible, or the daemon said "forbidden"

# ZeroMQ takes send and receive timeouts as a C int of milliseconds (about 24.8 days).
TIMEOUT_MAX = (2**31 - 1) // 1000


class ControlFailure(Exception):
    def __init__(self, exit_code: int, message: str, code: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.code = code  # the daemon's error code, when it answered


def probe(path: "os.PathLike[str]", read_only: bool = False) -> None:
    """A plain AF_UNIX connect, to tell 'not running' from 'not allowed' before ZeroMQ
    (which would silently retry either) gets involved."""
    error = connect_error(path)
    if error is None:
        return
    if isinstance(error, NotADirectoryError):
        raise ControlFailure(EXIT_USAGE, not_a_directory(Path(path).parents[1]) or f"cannot reach {path}: {error.strerror}")
    if isinstance(error, FileNotFoundError):
        kind = "status" if read_only else "control"
        raise ControlFailure(
            EXIT_NOT_RUNNING, f"no scheduler {kind} socket at {path} (is nvshare-scheduler running? check --socket-dir)"
        )
    if isinstance(error, ConnectionRefusedError):
        raise ControlFailure(EXIT_NOT_RUNNING, f"nvshare-scheduler is not running (nothing listens on {path})")
    if isinstance(error, PermissionError):
        advice = "" if read_only else ": run as root or as the scheduler's user"
        raise ControlFailure(EXIT_PERMISSION, f"permission denied on {path}{advice}")
    raise ControlFailure(EXIT_NOT_RUNNING, f"cannot reach {path}: {error.strerror or error}")


class ControlConnection:
    """One REQ connection to the control socket, or with `read_only` to the status socket
    (every local user may read there; nothing can be changed); use as a context manager."""

    def __init__(self, paths: SocketPaths, timeout: float = 5.0, read_only: bool = False) -> None:
        self.paths = paths
        self.timeout = timeout
        self.read_only = read_only
        self.path = paths.status_socket if read_only else paths.control_socket
        probe(self.path, read_only)
        self._context: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context()
        self._socket = self._context.socket(zmq.REQ)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, max(1, int(timeout * 1000)))
        self._socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        self._socket.setsockopt(zmq.MAXMSGSIZE, CONTROL_REPLY_MAX)
        self._socket.connect(paths.status_endpoint if read_only else paths.control_endpoint)

    def request(self, op: str, **fields: Any) -> Any:
        """Send one request and return its `result`; raises ControlFailure."""
        data = json.dumps({"v": 1, "op": op, **fields}).encode()
        if len(data) > CONTROL_REQUEST_MAX:
            raise ControlFailure(EXIT_USAGE, f"request of {len(data)} bytes is over the {CONTROL_REQUEST_MAX}-byte limit")
        try:
            self._socket.send(data)
            reply = json.loads(self._socket.recv())
        except zmq.Again:
            self.close()
            raise ControlFailure(
                EXIT_NOT_RUNNING, f"nvshare-scheduler did not answer within {self.timeout:g} s ({self.path})"
            ) from None
        except ValueError:
            raise ControlFailure(EXIT_REFUSED, "the scheduler's answer is not JSON") from None
        if not isinstance(reply, dict):
            raise ControlFailure(EXIT_REFUSED, "the scheduler's answer is not a JSON object")
        if reply.get("ok"):
            return reply.get("result")
        error = reply.get("error") or {}
        code = str(error.get("code", "unknown"))
        message = str(error.get("message", ""))
        exit_code = EXIT_PERMISSION if code == "forbidden" else EXIT_REFUSED
        raise ControlFailure(exit_code, f"the scheduler refused: {code}" + (f": {message}" if message else ""), code)

    def events_since(self, since: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Every stored lock event with a sequence number from `since` on, and the number to ask
        from next time (`events_pages`)."""
        return events_pages(self.request, since)

    def close(self) -> None:
        if self._context is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._context = None

    def __enter__(self) -> "ControlConnection":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def events_pages(request: Callable[..., Any], since: int) -> tuple[list[dict[str, Any]], int]:
    """The lock events from `since` on, asked of `request` (a connection's) page after page, and
    the sequence number to ask from next time. The daemon answers a bounded page and says
    `"more": true` while more are stored (docs/protocol.md, "Events"); an older daemon does not
    say it, and a page as long as asked for means "ask again". Stops after as many as the daemon
    keeps: what a flood makes meanwhile is for the next call, which a follower makes anyway."""
    events: list[dict[str, Any]] = []
    while True:
        answer = request("events", since=since, limit=CONTROL_EVENTS_MAX)
        page = answer["events"]
        events.extend(page)
        since = answer["next"]
        if not page or not answer.get("more", len(page) >= CONTROL_EVENTS_MAX) or len(events) >= CONTROL_EVENTS_MAX:
            return events, since


def request(paths: SocketPaths, op: str, *, timeout: float = 5.0, **fields: Any) -> Any:
    """One request on a fresh connection."""
    with ControlConnection(paths, timeout) as connection:
        return connection.request(op, **fields)


def read_only_status(paths: SocketPaths, op: str, *, timeout: float = 5.0, **fields: Any) -> Any:
    """One read request, `status` or `events` (with `since`, `limit`), on the status socket that
    every local user may reach: the answers show what an unprivileged user may see
    (docs/protocol.md, "Status socket"). Returns the answer's `result` as `request()` does and
    raises ControlFailure as it does (EXIT_NOT_RUNNING where no scheduler serves the socket).
    nvsharectl reads here when the control socket is closed to its user (ctl/reading.py)."""
    with ControlConnection(paths, timeout, read_only=True) as connection:
        return connection.request(op, **fields)
