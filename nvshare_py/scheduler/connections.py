"""The daemon's connection server: accept, read, write and close the connections of one
listening Unix socket, speaking ZMTP through zmtp.py's parser. The client socket and the
control socket each have one.

Each connection gets a number of the daemon's own (nothing the peer sends chooses it), the
peer's kernel-verified credentials (SO_PEERCRED) at accept time, and a task that reads it;
what the peer sends reaches the owner as whole messages through `on_message`, and the end of
the connection through `on_closed`. Nothing here knows what the messages mean.
"""

from __future__ import annotations

import collections
import errno
import itertools
import math
import socket
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import trio

from . import zmtp
from .logs import RateLimit, note
from .runtime import ConnectionLimits

# Messages handled before a connection's task lets the others run (fairness under a flood).
PUMP_BATCH = 64
READ_SIZE = 64 * 1024
# A peer that has not finished the ZMTP handshake after this many seconds is disconnected.
HANDSHAKE_TIMEOUT = 10.0
# Bytes of messages a peer has not read yet before it is disconnected as one that does not read.
OUTGOING_MAX = 1024 * 1024
# Seconds to wait before accepting again after running out of descriptors (or memory).
ACCEPT_RETRY = 0.1
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True)
class PeerCredentials:
    """The kernel-verified identity of a Unix socket peer (SO_PEERCRED). `pid` is 0 when the
    peer's process is not visible in our pid namespace; `uid` is None when the kernel gave no
    credentials."""

    uid: int | None
    gid: int | None
    pid: int


class Connection:
    """One connection. `key` is the daemon's own number for it (the core's ClientKey):
    nothing the peer sends chooses or changes it."""

    __slots__ = ("key", "sock", "credentials", "outgoing", "writable", "scope", "closing")

    def __init__(self, key: int, sock: socket.socket, credentials: PeerCredentials) -> None:
        self.key = key
        self.sock = sock
        self.credentials = credentials
        self.outgoing = bytearray()
        self.writable = trio.Event()
        self.scope: trio.CancelScope | None = None
        self.closing = False


class ConnectionServer:
    """Serves one listening socket (`serve`, a task of the daemon's nursery). `on_message`
    gets each whole message (its frames) and may `write` answers; `on_closed` runs once
    when a connection has ended, whoever ended it."""

    def __init__(
        self,
        name: str,
        listener: socket.socket,
        limits: ConnectionLimits,
        max_message: int,
        on_message: Callable[[Connection, tuple[bytes, ...]], None],
        on_closed: Callable[[Connection], None],
        outgoing_max: int = OUTGOING_MAX,
    ) -> None:
        self.name = name  # "client", "control": for log lines
        self.listener = listener
        self.limits = limits
        self.max_message = max_message
        self.outgoing_max = outgoing_max
        self.on_message = on_message
        self.on_closed = on_closed
        self.connections: dict[int, Connection] = {}
        self._numbers = itertools.count(1)
        self._per_uid: collections.Counter[int | None] = collections.Counter()
        self._bad_input_log = RateLimit()
        self._resource_log = RateLimit()

    async def serve(self) -> None:
        """Accept connections, each served by its own task. Running out of descriptors is
        not fatal: the connections wait in the listen backlog meanwhile."""
        listener = self.listener
        async with trio.open_nursery() as connections:
            while True:
                await trio.lowlevel.wait_readable(listener)
                try:
                    sock, _ = listener.accept()
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno not in _OUT_OF_RESOURCES:
                        raise
                    note(f"cannot accept a {self.name} connection", self._resource_log, error=exc.strerror)
                    await trio.sleep(ACCEPT_RETRY)
                    continue
                sock.setblocking(False)
                credentials = peer_credentials(sock)
                refusal = self._admission_refusal(credentials)
                if refusal is not None:
                    sock.close()
                    note(f"{self.name} connection refused", self._resource_log, reason=refusal,
                         uid=credentials.uid, pid=credentials.pid)
                    continue
                key = next(self._numbers)
                connection = Connection(key, sock, credentials)
                self.connections[key] = connection
                self._per_uid[credentials.uid] += 1
                connections.start_soon(self._serve_connection, connection)

    def _admission_refusal(self, credentials: PeerCredentials) -> str | None:
        if len(self.connections) >= self.limits.total:
            return f"{self.limits.total} connections open, the most this daemon serves"
        if self._per_uid[credentials.uid] >= self.limits.per_uid:
            return f"uid {credentials.uid} has {self.limits.per_uid} connections open, the most one uid may"
        return None

    async def _serve_connection(self, connection: Connection) -> None:
        parser = zmtp.Parser(self.max_message)
        sock = connection.sock
        try:
            with trio.CancelScope() as scope:
                connection.scope = scope
                # A peer must finish its handshake in time: it holds a descriptor meanwhile.
                scope.deadline = trio.current_time() + HANDSHAKE_TIMEOUT
                self.write(connection, zmtp.HANDSHAKE)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._flush, connection)
                    await self._read(connection, parser, scope)
                    nursery.cancel_scope.cancel()
        finally:
            del self.connections[connection.key]
            self._per_uid[connection.credentials.uid] -= 1
            if not self._per_uid[connection.credentials.uid]:
                del self._per_uid[connection.credentials.uid]
            trio.lowlevel.notify_closing(sock)
            sock.close()
            self.on_closed(connection)

    async def _read(self, connection: Connection, parser: zmtp.Parser, scope: trio.CancelScope) -> None:
        sock = connection.sock
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                data = sock.recv(READ_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                return  # reset by the peer
            if not data:
                return
            try:
                items = parser.feed(data)
            except zmtp.Violation as exc:
                note(f"{self.name} connection closed", self._bad_input_log, reason=str(exc))
                return
            for handled, item in enumerate(items, 1):
                if type(item) is zmtp.Message:
                    self.on_message(connection, item.frames)
                elif type(item) is zmtp.Ping:
                    self.write(connection, zmtp.pong(item.context))
                else:  # Ready
                    scope.deadline = math.inf
                if connection.closing:
                    return
                if handled % PUMP_BATCH == 0:
                    await trio.lowlevel.checkpoint()  # fairness under a flood

    def send(self, key: int, data: bytes) -> None:
        """`write` to the connection numbered `key`, if it is still open."""
        connection = self.connections.get(key)
        if connection is not None:
            self.write(connection, data)

    def write(self, connection: Connection, data: bytes) -> None:
        """Queue `data` and send what the socket takes now. A peer that lets more than
        `outgoing_max` bytes pile up does not read: it is disconnected."""
        if connection.closing:
            return
        out = connection.outgoing
        out += data
        if len(out) > self.outgoing_max:
            note(f"{self.name} connection closed", self._resource_log, reason="it does not read its messages")
            self.close(connection)
            return
        try:
            sent = connection.sock.send(out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close(connection)
            return
        del out[:sent]
        if out:
            connection.writable.set()

    async def _flush(self, connection: Connection) -> None:
        while True:
            await connection.writable.wait()
            connection.writable = trio.Event()
            while connection.outgoing:
                await trio.lowlevel.wait_writable(connection.sock)
                try:
                    sent = connection.sock.send(connection.outgoing)
                except BlockingIOError:
                    continue
                except OSError:
                    self.close(connection)
                    return
                del connection.outgoing[:sent]

    def close(self, connection: Connection) -> None:
        connection.closing = True
        connection.outgoing.clear()
        if connection.scope is not None:
            connection.scope.cancel()


_PEER_CREDENTIALS = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The kernel's word on who connected (SO_PEERCRED): pid (0 when the peer's process is not
    visible in our pid namespace), uid, gid."""
    try:
        pid, uid, gid = _PEER_CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size))
    except OSError:
        return PeerCredentials(None, None, 0)
    return PeerCredentials(uid, gid, pid)


def listen_unix(path: Path, mode: int, backlog: int = 256) -> socket.socket:
    """A non-blocking socket listening on `path` with file mode `mode` (set before listening,
    so no client can connect while the mode is still the umask's). An existing file at `path`
    is replaced; the file stays when the socket is closed, so that the next daemon knows
    clients may come back."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.fspath(path))
        os.chmod(path, mode)
        listener.listen(backlog)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener
