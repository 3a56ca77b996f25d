"""nvshare_py.client's connection to the scheduler: ZMTP 3.1 over a non-blocking Unix socket,
the DEALER side of nvshare_py/scheduler/zmtp.py, as the interceptor's transport.c speaks it.

Nothing here blocks, and nothing is thread-safe: the client calls it under its lock, and a
reader polls `fileno()` (for writing too while `wants_to_write`) before `receive()`.
"""

from __future__ import annotations

import socket

from . import protocol
from .scheduler import zmtp

# Bytes the scheduler may leave unread before the connection is given up as hung.
OUTGOING_MAX = 4 << 20
# What one receive() takes from the socket at most (bytes).
READ_CHUNK = 1 << 16


class LinkLost(Exception):
    """The connection failed (its text says how): close it; the client core decides when to
    connect again."""


class Link:
    """One connection. Raises OSError when the socket cannot be connected."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        self._parser = zmtp.Parser(protocol.MAX_MESSAGE + zmtp.FRAME_COST, peer_types=zmtp.SERVER_TYPES)
        self._outgoing = bytearray(zmtp.CLIENT_HANDSHAKE)
        # Messages wait for the scheduler's READY: libzmq drops a connection whose first
        # message arrives with the handshake.
        self._held = bytearray()
        self._handshaken = False
        self._lost: LinkLost | None = None  # a failed write, raised once what came before it is read

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def wants_to_write(self) -> bool:
        """Bytes wait for room in the socket."""
        return bool(self._outgoing)

    def send(self, message: bytes) -> None:
        """Queue one message and write what the socket takes now."""
        if not self._handshaken:
            self._held += zmtp.frame(message)
            return
        self._outgoing += zmtp.frame(message)
        self.flush()

    def flush(self) -> None:
        outgoing = self._outgoing
        try:
            while outgoing:
                del outgoing[: self._sock.send(outgoing)]
        except BlockingIOError:
            if len(outgoing) > OUTGOING_MAX:
                raise LinkLost("the scheduler does not read") from None
        except OSError as exc:
            raise LinkLost(exc.strerror or str(exc)) from None

    def receive(self) -> list[tuple[bytes, ...]]:
        """The messages (their frames) that arrived; answers PING and sends what waited for
        the handshake. A write that failed is raised once what had arrived is read: a scheduler
        without a place for the connection says why (ERROR too-many-connections), then closes."""
        if self._lost is None and self._outgoing:
            self._lost = self._try_flush()
        try:
            data = self._sock.recv(READ_CHUNK)
        except BlockingIOError:
            if self._lost is not None:
                raise self._lost from None
            return []
        except OSError as exc:
            raise LinkLost(exc.strerror or str(exc)) from None
        if not data:
            raise self._lost or LinkLost("closed by the scheduler")
        try:
            items = self._parser.feed(data)
        except zmtp.Violation as exc:
            raise LinkLost(f"ZMTP: {exc}") from None
        messages = []
        for item in items:
            if isinstance(item, zmtp.Message):
                messages.append(item.frames)
            elif isinstance(item, zmtp.Ready):
                self._handshaken = True
                self._outgoing += self._held
                self._held.clear()
            elif isinstance(item, zmtp.Ping):
                self._outgoing += zmtp.pong(item.context)
        if self._lost is None and self._outgoing:
            self._lost = self._try_flush()
        if self._lost is not None and not messages:
            raise self._lost
        return messages

    def _try_flush(self) -> LinkLost | None:
        try:
            self.flush()
        except LinkLost as lost:
            return lost
        return None

    def close(self) -> None:
        self._sock.close()
