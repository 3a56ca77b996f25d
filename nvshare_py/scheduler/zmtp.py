"""ZMTP 3.1 (RFC 23/37, NULL mechanism) as a sans-I/O parser: the scheduler's side, and the
DEALER side of nvshare_py.client (`Parser(..., peer_types=SERVER_TYPES)`, CLIENT_HANDSHAKE).

Why the daemon speaks ZMTP itself on its sockets instead of using a libzmq ROUTER
(docs/scheduler.md, *Security model*): a ROUTER takes a connection's routing id from the
peer's READY (`Identity` property) and aborts the whole process when its own next automatic
id was taken that way; its listener aborts when accept() runs out of descriptors; and it says
nothing when a peer goes away. Here the daemon accepts every connection itself, names it with
a number of its own, learns the peer's credentials from the kernel (SO_PEERCRED) at accept
time, sees its end at once, and can refuse connections it has no room for.

Peers are DEALER sockets (pyzmq) or the interceptor's ZMTP client (interceptor/transport.c)
on the client socket, REQ or DEALER sockets (nvsharectl) on the control socket. Towards a REQ
peer the server behaves as a ROUTER does: the request arrives behind an empty delimiter frame,
and the reply must carry the same delimiter (`message`).
Wire facts:

    greeting  64 bytes: 0xFF, 8 padding bytes, 0x7F, version major/minor, mechanism name padded
              with NULs to 20 bytes, as-server, 31 filler bytes;
    frame     flags (bit 0 MORE, bit 1 LONG = 8-byte size, bit 2 COMMAND), size (1 byte, or
              8 bytes big-endian), body;
    command   body = name length (1 byte), name, data; READY data = properties: name length
              (1 byte), name, value length (4 bytes big-endian), value; PING data = TTL
              (2 bytes), context (0-16 bytes), answered by PONG with the context.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

GREETING_SIZE = 64
SERVER_GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + bytes(32)
_READY_PROPERTY = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"ROUTER"
SERVER_READY = bytes([0x04, 6 + len(_READY_PROPERTY)]) + b"\x05READY" + _READY_PROPERTY
HANDSHAKE = SERVER_GREETING + SERVER_READY
# A DEALER's greeting (as-server 0) and READY without Identity: the server names the connection.
_CLIENT_READY_PROPERTY = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
CLIENT_HANDSHAKE = (SERVER_GREETING[:32] + bytes(32) + bytes([0x04, 6 + len(_CLIENT_READY_PROPERTY)]) + b"\x05READY"
                    + _CLIENT_READY_PROPERTY)

_MORE, _LONG, _COMMAND, _RESERVED = 0x01, 0x02, 0x04, 0xF8
# Commands are small (READY with a few properties, PING); a larger one is a protocol violation.
COMMAND_MAX = 8192
# What a message frame costs the daemon beyond its bytes (the bytes object, its place in the
# message), counted against the message's limit.
FRAME_COST = 64
PING_CONTEXT_MAX = 16
CLIENT_TYPES = (b"DEALER", b"REQ")  # the peers a server serves
SERVER_TYPES = (b"ROUTER",)  # the peer a DEALER client talks to


class Violation(Exception):
    """The peer broke ZMTP (or a limit): the connection must be closed."""


@dataclass(frozen=True)
class Message:
    frames: tuple[bytes, ...]


@dataclass(frozen=True)
class Ping:
    context: bytes


@dataclass(frozen=True)
class Ready:
    socket_type: bytes


def frame(body: bytes) -> bytes:
    """A message of one frame (all the client protocol uses)."""
    return message([body])


def message(frames: list[bytes]) -> bytes:
    """A message of several frames (every frame but the last marked MORE)."""
    last = len(frames) - 1
    parts = []
    for number, body in enumerate(frames):
        more = _MORE if number < last else 0
        if len(body) < 256:
            parts.append(bytes([more, len(body)]) + body)
        else:
            parts.append(bytes([more | _LONG]) + struct.pack(">Q", len(body)) + body)
    return b"".join(parts)


def pong(context: bytes) -> bytes:
    body = b"\x04PONG" + context
    return bytes([_COMMAND, len(body)]) + body


class Parser:
    """Give it the bytes a peer sends (`receive`) and take what they contained (`parse`), in
    order: first `Ready` (after the greeting and READY were checked), then `Message`s and
    `Ping`s. Raises Violation for anything a server must not accept, including a message
    larger than `max_message`, before reading that message's body. A message's size counts
    its bytes plus FRAME_COST per frame, so that a stream of empty MORE frames is bounded too.

    `parse(limit)` reads at most `limit` frames (commands and frames that complete nothing
    included), so that a caller can bound the work one call costs whatever the peer sent."""

    def __init__(self, max_message: int, peer_types: tuple[bytes, ...] = CLIENT_TYPES) -> None:
        self.max_message = max_message
        self.peer_types = peer_types
        self._buffer = bytearray()
        self._greeted = False
        self._ready = False
        self._frames: list[bytes] = []
        self._pending = 0  # cost (bytes + FRAME_COST per frame) of the message being assembled
        self.stopped = False  # the last parse() stopped at its limit: frames may be left

    @property
    def buffered(self) -> int:
        """Bytes held for this peer: received and not parsed, and the frames of a message
        not complete yet."""
        return len(self._buffer) + self._pending

    @property
    def partial(self) -> bool:
        """Whether a greeting, frame or message has begun and is not complete."""
        return bool(self._buffer) or bool(self._frames)

    def feed(self, data: bytes) -> list[Message | Ping | Ready]:
        """`receive(data)`, then everything complete in what was received so far."""
        self.receive(data)
        return self.parse()

    def receive(self, data: bytes) -> None:
        self._buffer += data

    def parse(self, limit: int = sys.maxsize) -> list[Message | Ping | Ready]:
        buffer = self._buffer
        out: list[Message | Ping | Ready] = []
        self.stopped = False
        if not self._greeted:
            if not self._check_greeting():
                return out
            del buffer[:GREETING_SIZE]
            self._greeted = True
        offset = 0
        frames = 0
        while True:
            if frames == limit:
                self.stopped = True
                break
            header = self._frame_header(offset)
            if header is None:
                break
            flags, size, start = header
            if len(buffer) < start + size:
                break
            body = bytes(buffer[start:start + size])
            offset = start + size
            frames += 1
            if flags & _COMMAND:
                item = self._command(body)
                if item is not None:
                    out.append(item)
                continue
            if not self._ready:
                raise Violation("a message before READY")
            self._frames.append(body)
            self._pending += size + FRAME_COST
            if not flags & _MORE:
                out.append(Message(tuple(self._frames)))
                self._frames = []
                self._pending = 0
        del buffer[:offset]
        return out

    def _check_greeting(self) -> bool:
        """Check what has arrived of the greeting; True once all 64 bytes are there."""
        buffer = self._buffer
        if buffer[:1] and buffer[0] != 0xFF:
            raise Violation("not a ZMTP greeting")
        if len(buffer) >= 10 and not buffer[9] & 0x01:
            raise Violation("not a ZMTP greeting")
        if len(buffer) >= 11 and buffer[10] < 3:
            raise Violation(f"ZMTP version {buffer[10]}; 3.0 or later is needed")
        if len(buffer) < GREETING_SIZE:
            return False
        if bytes(buffer[12:32]).rstrip(b"\0") != b"NULL":
            raise Violation("only the NULL security mechanism is served")
        return True

    def _frame_header(self, offset: int) -> tuple[int, int, int] | None:
        buffer = self._buffer
        if len(buffer) < offset + 2:
            return None
        flags = buffer[offset]
        if flags & _RESERVED:
            raise Violation("reserved frame flags set")
        if flags & _LONG:
            if len(buffer) < offset + 9:
                return None
            (size,) = struct.unpack_from(">Q", buffer, offset + 1)
            start = offset + 9
        else:
            size = buffer[offset + 1]
            start = offset + 2
        if flags & _COMMAND:
            if flags & _MORE or size > COMMAND_MAX:
                raise Violation("command frame too large or marked MORE")
        elif size + FRAME_COST > self.max_message - self._pending:
            # Checked on the header, so that such a body is never waited for.
            raise Violation(f"message larger than {self.max_message} bytes")
        return flags, size, start

    def _command(self, body: bytes) -> Ping | Ready | None:
        if not body or len(body) < 1 + body[0]:
            raise Violation("malformed command")
        name = body[1:1 + body[0]]
        data = body[1 + body[0]:]
        if not self._ready:
            if name != b"READY":
                raise Violation("the first command must be READY")
            socket_type = _socket_type(data)
            if socket_type not in self.peer_types:
                raise Violation(f"socket type {socket_type!r} is not a peer of this side")
            self._ready = True
            return Ready(socket_type)
        if name == b"PING":
            if len(data) < 2:
                raise Violation("PING without TTL")
            return Ping(data[2:2 + PING_CONTEXT_MAX])
        return None  # PONG, and commands of later minor versions: nothing to do


def _socket_type(data: bytes) -> bytes:
    """The Socket-Type property of READY (names are case-insensitive); other properties,
    `Identity` included, are ignored: the daemon names connections itself."""
    offset = 0
    found = None
    while offset < len(data):
        name_len = data[offset]
        name = data[offset + 1:offset + 1 + name_len]
        offset += 1 + name_len
        if offset + 4 > len(data):
            raise Violation("malformed READY property")
        (value_len,) = struct.unpack_from(">I", data, offset)
        offset += 4
        if offset + value_len > len(data) or len(name) != name_len:
            raise Violation("malformed READY property")
        if name.lower() == b"socket-type":
            found = data[offset:offset + value_len]
        offset += value_len
    if found is None:
        raise Violation("READY without Socket-Type")
    return found
