"""The connection server's deadline for an unfinished frame (issue 31, *Loose ends*): a peer
that trickles a frame is closed after FRAME_TIMEOUT, one that streams whole messages back to
back never is, however its reads happen to fall between frames. The daemon's connection
server, in this process, on trio's virtual clock (`MockClock(autojump_threshold=0)`): a minute
of streaming takes the test a fraction of that, and the deadlines are the daemon's own."""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
from pathlib import Path

import trio
import trio.testing

from nvshare_py.scheduler import connections, zmtp
from nvshare_py.scheduler.connections import ByteBudget, ConnectionLimits, ConnectionServer, listen_unix
from nvshare_py.scheduler.fairness import Turns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import floodkit  # noqa: E402

STREAM_SECONDS = 60.0
# A valid ADMIT, as the client that was cut off sent them in a loop.
ADMIT = zmtp.frame(b"NVSHARE/1 ADMIT\ndevice=GPU-5151ad00-0000-4000-8000-000000000000\nrequest=7\nbytes=1048576")


class Server:
    """A ConnectionServer whose connections may stay idle (only the frame deadline judges
    them) and that counts the messages it was given and the connections it closed, with why."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "s.sock"
        self.messages = 0
        self.closed: list[str] = []
        self.server = ConnectionServer(
            "client", listen_unix(self.path, 0o600), ConnectionLimits.sharing(64, 8, 16), 64 * 1024,
            self._on_message, self._on_closed, turns=Turns(clock=lambda: 0.0), budget=ByteBudget(1 << 20, 1 << 24),
            idle_timeout=3600.0, stays_idle=lambda connection: True)

    def _on_message(self, connection: connections.Connection, frames: tuple[bytes, ...]) -> None:
        self.messages += 1

    def _on_closed(self, connection: connections.Connection) -> None:
        self.closed.append(connection.expiry)

    async def connect(self) -> trio.socket.SocketType:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.connect(str(self.path))
        await sock.send(floodkit.GREETING + floodkit.ready())
        handshake = b""
        while len(handshake) < len(zmtp.HANDSHAKE):
            chunk = await sock.recv(len(zmtp.HANDSHAKE) - len(handshake))
            assert chunk, f"closed during the handshake after {handshake!r}"
            handshake += chunk
        return sock


def run(test) -> None:
    directory = Path(tempfile.mkdtemp(prefix="nvs-deadline-", dir="/tmp"))  # short: a socket path
    server = Server(directory)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.server.serve)
            await test(server)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        server.server.listener.close()
        shutil.rmtree(directory)


async def closed_by_server(sock: trio.socket.SocketType) -> bool:
    """Whether the server has closed `sock` (it never writes to these peers)."""
    with trio.move_on_after(0.001):
        return await sock.recv(1) == b""
    return False


def test_a_peer_streaming_whole_messages_back_to_back_is_never_cut_off():
    # Was: the frame deadline was reset only when a read ended exactly between frames, so a
    # client sending valid messages in a loop, whose reads ended inside frames, was closed
    # for "a frame not finished in time" while every one of its messages completed.
    async def test(server: Server) -> None:
        sock = await server.connect()
        # Each send finishes one message and begins the next, so every read of the server's
        # ends inside a frame, as it does for a client sending in a loop.
        await sock.send(ADMIT[:5])
        sent_messages = 0
        start = trio.current_time()
        while trio.current_time() - start < STREAM_SECONDS:
            try:
                await sock.send(ADMIT[5:] + ADMIT[:5])
            except OSError as exc:
                raise AssertionError(f"cut off after {sent_messages} whole messages and "
                                     f"{trio.current_time() - start:.1f} s ({exc}): {server.closed}") from None
            sent_messages += 1
            await trio.sleep(0.05)  # each send its own read
        await sock.send(ADMIT[5:])
        sent_messages += 1
        await trio.sleep(1.0)
        assert server.closed == [], server.closed
        assert not await closed_by_server(sock)
        assert server.messages == sent_messages

    run(test)


async def trickle_until_closed(server: Server, sock) -> None:
    """Sends the rest of an ADMIT whose first 10 bytes went, a byte a second, until the server
    closes the connection; it must, for a frame not finished in time."""
    for byte in ADMIT[10:-1]:
        if await closed_by_server(sock):
            break
        await sock.send(bytes([byte]))
        await trio.sleep(1.0)
    assert await closed_by_server(sock), "the trickling peer was never closed"
    assert server.closed == ["a frame not finished in time"], server.closed


def test_a_peer_trickling_one_frame_is_closed_after_the_frame_deadline():
    async def test(server: Server) -> None:
        sock = await server.connect()
        await sock.send(ADMIT[:10])  # a header and the start of the body, then a byte a second
        await trickle_until_closed(server, sock)
        assert server.messages == 0

    run(test)


def test_a_peer_that_finishes_messages_but_then_trickles_one_is_closed():
    # Whole messages do not buy time for the one after them: its deadline runs from the read
    # in which the one before it was finished.
    async def test(server: Server) -> None:
        sock = await server.connect()
        await sock.send(ADMIT * 3 + ADMIT[:10])
        await trickle_until_closed(server, sock)
        assert server.messages == 3

    run(test)
