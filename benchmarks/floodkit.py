"""Raw ZMTP 3.1 client peers for flood tests and benchmarks (tests/test_daemon_floods.py,
benchmarks/bench_floods.py): they do by hand what no library client does, such as announcing a
routing id of their choosing (the READY `Identity` property) or sending oversized frames."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + bytes(32)
TIMEOUT = 30.0


def frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    if len(body) > 255:
        return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def ready(identity: bytes | None = None) -> bytes:
    data = _property(b"Socket-Type", b"DEALER")
    if identity is not None:
        data += _property(b"Identity", identity)
    return frame(b"\x05READY" + data, command=True)


def field(message: str, name: str) -> str:
    for line in message.split("\n")[1:]:
        key, _, value = line.partition("=")
        if key == name:
            return value
    raise KeyError(f"{name} not in {message!r}")


def with_nofile(limit: int, command: list[str]) -> list[str]:
    """`command` run under RLIMIT_NOFILE = limit (soft and hard)."""
    setup = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]),) * 2); "
             "os.execvp(sys.argv[2], sys.argv[2:])")
    return [sys.executable, "-c", setup, str(limit), *command]


class RawClient:
    def __init__(self, path, identity: bytes | None = None, handshake: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(str(path))
        self._buffer = b""
        if handshake:
            try:
                self.sock.sendall(GREETING + ready(identity))
            except BrokenPipeError:
                # A refused connection is answered and closed at once (its greeting unread): on
                # a busy machine that can come before we send. What it wrote is read all the
                # same, as libnvshare's transport does.
                pass
            self._read_exactly(64)
            self._next_frame()  # the server's READY

    def _read_exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed by the scheduler after {len(self._buffer)} of {n} bytes")
            self._buffer += chunk
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    def _next_frame(self) -> tuple[int, bytes]:
        flags, size = self._read_exactly(2)
        if flags & 0x02:
            size = struct.unpack(">Q", bytes([size]) + self._read_exactly(7))[0]
        return flags, self._read_exactly(size)

    def send_raw(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the scheduler closed the connection: what it does with such input

    def send(self, text: str) -> None:
        self.send_raw(frame(text.encode()))

    def hello(self, session: str, held: str = "", wanted: str = "") -> str:
        lines = ["NVSHARE/1 HELLO", "pid=1", f"session={session}"]
        if held:
            lines.append(f"held={held}")
        if wanted:
            lines.append(f"wanted={wanted}")
        self.send("\n".join(lines))
        return self.expect("WELCOME")

    def expect(self, msg_type: str, timeout: float = TIMEOUT) -> str:
        """The next message of `msg_type` (others before it are skipped; PINGs ignored)."""
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            flags, body = self._next_frame()
            if flags & 0x04:
                continue
            text = body.decode()
            if text.startswith(f"NVSHARE/1 {msg_type}"):
                return text
            seen.append(text.split("\n", 1)[0])
        raise AssertionError(f"no {msg_type} within {timeout} s; saw {seen}")

    def close(self) -> None:
        self.sock.close()


# --- attackers as processes (tests run them as other uids; bench_floods at full size) -----------


def hold(path: str, count: int, hello: bool) -> None:
    """Open up to `count` connections (handshake, and HELLO with `hello`), print how many the
    scheduler kept, and keep them until stdin closes."""
    kept = []
    for n in range(count):
        try:
            peer = RawClient(path)
            if hello:
                peer.hello(session=f"{os.getpid():08x}{n:08x}")
            kept.append(peer)
        except (OSError, ConnectionError, AssertionError):
            pass  # refused: the limits at work
    # Connections the scheduler refused after the handshake (closed at once) are not kept.
    alive = [peer for peer in kept if _open(peer.sock)]
    print(len(alive), flush=True)
    sys.stdin.read()
    for peer in kept:
        peer.close()


def _open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def flood(path: str, kind: str, connections: int, seconds: float) -> int:
    """`connections` connections sending `kind` traffic as fast as they can for `seconds`
    (valid: QUERY; commands: 3-byte unknown commands; empty-more: zero-length MORE frames).
    Returns the number of sends."""
    chunk = {
        "valid": frame(b"NVSHARE/1 QUERY") * 64,
        "commands": frame(b"\x01X", command=True) * 512,
        "empty-more": frame(b"", more=True) * 512,
    }[kind]
    peers = []
    for _ in range(connections):
        try:
            peers.append(RawClient(path))
        except (OSError, ConnectionError):
            pass
    for peer in peers:
        peer.sock.setblocking(False)
    end = time.monotonic() + seconds
    sends = 0
    while time.monotonic() < end and peers:
        for peer in list(peers):
            try:
                peer.sock.send(chunk)
                sends += 1
            except BlockingIOError:
                pass
            except OSError:
                peers.remove(peer)  # closed by the scheduler
            try:
                while peer.sock.recv(65536):  # read what comes back, so the flood is not paused
                    pass
            except (BlockingIOError, OSError):
                pass
    for peer in peers:
        peer.close()
    return sends


def main() -> None:
    command, path = sys.argv[1], sys.argv[2]
    if command == "hold":
        hold(path, int(sys.argv[3]), sys.argv[4:] == ["--hello"])
    elif command == "flood":
        print(flood(path, sys.argv[3], int(sys.argv[4]), float(sys.argv[5])), flush=True)
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main()
