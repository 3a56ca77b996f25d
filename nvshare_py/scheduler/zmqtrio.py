"""Serving pyzmq sockets from Trio, and the listening Unix sockets behind them.

Trio has no ZeroMQ support. A ZeroMQ socket exposes one file descriptor (`zmq.FD`) that
becomes readable when the socket's internal mailbox has commands; reading `zmq.EVENTS`
processes them and says whether a message can be received. The descriptor behaves as an edge:
any send, receive or EVENTS read may consume it. So the owner of a socket must re-read EVENTS
after every send or receive and only sleep on the descriptor when EVENTS says nothing is
ready (`wait_readable` below).

The listening sockets are created here rather than by libzmq (`zmq.USE_FD`) because libzmq's
own ipc bind unlinks whatever file is at the path and unlinks the socket again on close: we
want the file's mode set before anyone can connect, and the file left in place on exit so that
the next daemon knows clients may come back.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import trio
import zmq

# Plain ints: pyzmq's enum constants build a new flag object on every `&` (the pump checks
# EVENTS after every message).
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def has_message(sock: zmq.Socket) -> bool:
    """Whether a message can be received now (reading EVENTS also re-arms the descriptor)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


async def wait_readable(sock: zmq.Socket) -> None:
    """Return once `sock` has a message to receive (checks EVENTS before sleeping)."""
    while not has_message(sock):
        await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))


def recv_nowait(sock: zmq.Socket) -> list[zmq.Frame] | None:
    """One whole multipart message, or None when nothing is waiting."""
    try:
        return sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None


@dataclass(frozen=True)
class PeerCredentials:
    """The kernel-verified identity of an ipc peer (SO_PEERCRED, as libzmq reports it).
    `pid` is 0 when the peer's process is not visible in our pid namespace; `uid` is None
    when libzmq gave no credentials."""

    uid: int | None
    gid: int | None
    pid: int


UNKNOWN_PEER = PeerCredentials(None, None, 0)


def peer_credentials(frame: zmq.Frame) -> PeerCredentials:
    """Read a received frame's `Peer-Address` property, formatted `...:<uid>:<gid>:<pid>`
    by libzmq for ipc peers."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return UNKNOWN_PEER
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return UNKNOWN_PEER
    return PeerCredentials(int(parts[1]), int(parts[2]), int(parts[3]))


def listen_unix(path: Path, mode: int, backlog: int = 256) -> int:
    """Bind and listen on `path` with file mode `mode` (set before listening, so no client
    can connect while the mode is still the umask's). Returns the descriptor, whose
    ownership passes to the caller. An existing file at `path` is replaced."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.fspath(path))
        os.chmod(path, mode)
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener.detach()


def bind_router(context: zmq.Context, path: Path, mode: int, *, max_message: int) -> zmq.Socket:
    """A ROUTER serving the Unix socket `path`. libzmq takes over the listening descriptor
    (and closes it, but does not unlink the file, when the ROUTER closes). A peer that sends a
    message larger than `max_message` bytes is disconnected by libzmq."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # Report unroutable replies (peer gone) instead of dropping them silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message)
    try:
        listener = listen_unix(path, mode)
    except BaseException:
        sock.close()
        raise
    try:
        sock.setsockopt(zmq.USE_FD, listener)
        sock.bind(f"ipc://{path}")
    except BaseException:
        os.close(listener)  # libzmq only owns it once bound
        sock.close()
        raise
    return sock
