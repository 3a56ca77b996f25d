"""What one user's connection churn may cost everyone else (issue 23, *Fairness*): the
connection server of the daemon, in this process, with a user whose connections are made
expensive on purpose. Costs are charged on a clock of the test's own (fairness.Turns takes
it), so the share a user gets is decided by what it was charged, never by how fast this
machine is; the assertions are about order: what the server did for the flooding user before
it answered the other one."""

from __future__ import annotations

import collections
import os
import select
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import trio

from nvshare_py.scheduler import connections, zmtp
from nvshare_py.scheduler.connections import ByteBudget, ConnectionLimits, ConnectionServer, listen_unix
from nvshare_py.scheduler.fairness import Turns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import floodkit  # noqa: E402

FLOOD, INNOCENT = (1001, ""), (1002, "")
# What each costs on the test's clock, against a share of 1 % and a burst of 50 ms: one of
# them puts its user 95 s (of real time) into debt.
COST = 1.0
PATIENCE = 30.0  # every wait for the server ends after this, saying what it saw


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A ConnectionServer on a socket in `directory`. Connections are given principals in the
    order they are made (accept takes them in that order); the flooding user's connections
    cost COST to end (its registration's Unregister, say) and, with `costly_arrival`, to
    accept (its credentials and pod looked up). The innocent's messages are answered `pong`,
    and each answer records how many of the flood's connections had ended by then."""

    def __init__(self, directory: Path, costly_arrival: bool = False) -> None:
        self.path = directory / "s.sock"
        self.clock = Clock()
        self.costly_arrival = costly_arrival
        self.turns = Turns(share=0.01, burst=0.05, clock=self.clock)
        self.arriving: collections.deque[tuple[int, str]] = collections.deque()
        self.pids = 0
        self.principals: dict[int, tuple[int, str]] = {}
        self.flood_ended = 0
        self.ended_at_answers: list[int] = []
        self.server = ConnectionServer(
            "client", listen_unix(self.path, 0o600), ConnectionLimits.sharing(1000, 64, 256), 64 * 1024,
            self._on_message, self._on_closed, turns=self.turns, budget=ByteBudget(1 << 20, 1 << 26),
            idle_timeout=600.0, stays_idle=lambda connection: True)

    def peer_credentials(self, sock: socket.socket) -> connections.PeerCredentials:
        """Credentials of the test's own: every connection here comes from this process, so
        each is given a pid of its own, through which `principal` finds whose it is."""
        self.pids += 1
        self.principals[self.pids] = self.arriving.popleft()
        return connections.PeerCredentials(self.principals[self.pids][0], 0, self.pids)

    def principal(self, credentials: connections.PeerCredentials) -> tuple[int, str]:
        who = self.principals[credentials.pid]
        if who == FLOOD and self.costly_arrival:
            self.clock.now += COST
        return who

    def _on_message(self, connection: connections.Connection, frames: tuple[bytes, ...]) -> None:
        self.ended_at_answers.append(self.flood_ended)
        self.server.write(connection, zmtp.frame(b"pong"))

    def _on_closed(self, connection: connections.Connection) -> None:
        if connection.principal == FLOOD:
            self.flood_ended += 1
            self.clock.now += COST

    async def connect(self, who: tuple[int, str], greet: bool = True) -> trio.socket.SocketType:
        """A connection of `who` that sent its greeting; with `greet`, once the server's came."""
        self.arriving.append(who)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.connect(str(self.path))
        await sock.send(floodkit.GREETING + floodkit.ready())
        if greet:
            await read_exactly(sock, len(zmtp.HANDSHAKE), "the server's greeting")
        return sock

    async def ping(self, sock: trio.socket.SocketType) -> None:
        await sock.send(floodkit.frame(b"ping"))
        answer = await read_exactly(sock, len(zmtp.frame(b"pong")), "the answer to a ping")
        assert answer == zmtp.frame(b"pong"), answer


async def read_exactly(sock: trio.socket.SocketType, size: int, what: str) -> bytes:
    data = b""
    with trio.move_on_after(PATIENCE):
        while len(data) < size:
            chunk = await sock.recv(size - len(data))
            assert chunk, f"closed by the server after {data!r}, waiting for {what}"
            data += chunk
        return data
    raise AssertionError(f"no {what} within {PATIENCE} s; got {data!r}")


def greeted(sock: trio.socket.SocketType) -> bool:
    """Whether the server's greeting has reached `sock` (the server writes it when it sets the
    connection up; on one host it is in our buffer as soon as it is written)."""
    readable, _, _ = select.select([sock.fileno()], [], [], 0)
    return bool(readable)


def run(monkeypatch, test, costly_arrival: bool = False) -> None:
    """`test(harness)` against a server that serves meanwhile."""
    directory = Path(tempfile.mkdtemp(prefix="nvs-turns-", dir="/tmp"))  # short: a socket path
    harness = Harness(directory, costly_arrival)
    monkeypatch.setattr(connections, "peer_credentials", harness.peer_credentials)
    monkeypatch.setattr(connections, "principal", harness.principal)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(harness.server.serve)
            await test(harness)
            nursery.cancel_scope.cancel()  # the flood's throttled work would wait for minutes

    try:
        trio.run(main)
    finally:
        harness.server.listener.close()
        shutil.rmtree(directory)


def test_one_users_ending_connections_wait_for_its_share_while_another_user_is_answered(monkeypatch):
    # Was: the end of a connection (for a registered client, the core's Unregister) ran
    # outside any turn and was never charged, so a user closing many connections at once had
    # all of them handled before another user's message, however much they cost.
    async def test(harness: Harness) -> None:
        innocent = await harness.connect(INNOCENT)
        await harness.ping(innocent)
        flood = [await harness.connect(FLOOD) for _ in range(20)]
        for sock in flood:
            sock.close()
        for _ in range(3):
            await harness.ping(innocent)
        # The first end spent the flood's burst and more: the others wait for its share,
        # and the innocent's three pings were answered meanwhile.
        assert max(harness.ended_at_answers) <= 1, harness.ended_at_answers

    run(monkeypatch, test)


def test_a_users_debt_outlives_its_connections(monkeypatch):
    # Was: a user's meter went with its last connection, so closing everything and
    # connecting again started it afresh with a full burst, whatever it had spent.
    async def test(harness: Harness) -> None:
        innocent = await harness.connect(INNOCENT)
        first = await harness.connect(FLOOD)
        first.close()
        for _ in range(1000):
            if harness.flood_ended:  # its end cost it COST: it is in debt
                break
            await harness.ping(innocent)
        assert harness.flood_ended, "the server did not see the connection end"
        again = [await harness.connect(FLOOD, greet=False) for _ in range(5)]
        for _ in range(3):
            await harness.ping(innocent)
        # Setting its new connections up is its own work too: it waits for its share.
        assert not any(greeted(sock) for sock in again)

    run(monkeypatch, test)


def test_a_flood_of_connections_takes_one_share_of_accepting(monkeypatch):
    # Was: the accept loop took every connection as fast as it came (sixteen at a time), so
    # a user connecting in a loop had the daemon spend as much time on its arrivals as it
    # liked, before the daemon even knew whose they were.
    async def test(harness: Harness) -> None:
        innocent = await harness.connect(INNOCENT)
        await harness.ping(innocent)
        flood = [await harness.connect(FLOOD, greet=False) for _ in range(40)]
        for _ in range(3):
            await harness.ping(innocent)
        # One arrival spent the door's share (ACCEPT_TURN ended its turn after it): the rest
        # wait in the backlog, and the innocent's pings were answered meanwhile.
        served = [connection for connection in harness.server.connections.values() if connection.principal == FLOOD]
        assert len(served) == 1, len(served)
        assert not any(greeted(sock) for sock in flood)

    run(monkeypatch, test, costly_arrival=True)


def test_what_a_connection_costs_outside_its_turns_is_its_users_too(monkeypatch):
    # Was: only the turns were charged, while starting a connection's task, its cancel scopes
    # and its end cost the daemon several times what the turns did; a user connecting in a
    # loop had that much of the thread uncounted. Here setting the flood's connections'
    # deadlines (outside any turn) is what costs.
    async def test(harness: Harness) -> None:
        set_deadline = ConnectionServer._set_deadline
        seen: set[int] = set()

        def costly_set_deadline(server, connection, parser) -> None:
            if connection.principal == FLOOD and connection.key not in seen:
                seen.add(connection.key)
                harness.clock.now += COST
            set_deadline(server, connection, parser)

        monkeypatch.setattr(ConnectionServer, "_set_deadline", costly_set_deadline)
        innocent = await harness.connect(INNOCENT)
        await harness.ping(innocent)
        flood = [await harness.connect(FLOOD, greet=False) for _ in range(10)]
        for _ in range(3):
            await harness.ping(innocent)
        # The first connection's task spent the flood's burst and more (charged when its step
        # ended, after its turn): the others' setting up waits for the flood's share.
        assert sum(greeted(sock) for sock in flood) == 1

    run(monkeypatch, test)


PAGE = 100 * 1024  # an `events` page's size, about (eventring.PAGE_BYTES is 128 KiB)


class Pages(Harness):
    """The flood's messages are answered with PAGE bytes each, as `events` requests are; the
    innocent's with `pong`. When the first page is answered the innocent sends a ping: the
    server is then in the middle of the flood's burst. `order` is what was answered when."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.order: list[str] = []
        self.innocent: trio.socket.SocketType | None = None
        served = self.server  # as the control socket's server: replies of megabytes may queue
        self.server = ConnectionServer(
            "control", served.listener, served.limits, served.max_message, self._on_message, self._on_closed,
            turns=self.turns, budget=served.budget, idle_timeout=600.0, outgoing_max=8 << 20)

    def _on_message(self, connection: connections.Connection, frames: tuple[bytes, ...]) -> None:
        if connection.principal == FLOOD:
            self.order.append("page")
            if self.order.count("page") == 1:
                assert self.innocent is not None  # a plain write: this runs inside the server's turn
                os.write(self.innocent.fileno(), floodkit.frame(b"ping"))
            self.server.write(connection, zmtp.frame(bytes(PAGE)))
        else:
            self.order.append("ping")
            self.server.write(connection, zmtp.frame(b"pong"))


def test_a_burst_of_large_answers_to_one_user_leaves_turns_to_another(monkeypatch):
    # Issue 31: a reader asking for many `events` pages at once (a DEALER sends them without
    # waiting) had all of them answered in one turn, a step of 16 pages, while another user's
    # message waited. Now a turn stops once it has written TURN_OUTPUT of answers, and the rest
    # of what it read waits for its principal's next turn, after the other user's.
    async def test(harness: Pages) -> None:
        innocent = await harness.connect(INNOCENT)
        await harness.ping(innocent)
        harness.order.clear()
        harness.innocent = innocent
        flood = await harness.connect(FLOOD)
        pages = 8

        async def read_pages() -> None:  # the reader reads what it asked for, as it comes
            wanted, got = pages * len(zmtp.frame(bytes(PAGE))), 0
            with trio.move_on_after(PATIENCE):
                while got < wanted:
                    chunk = await flood.recv(1 << 16)
                    assert chunk, f"closed by the server after {got} of {wanted} bytes"
                    got += len(chunk)
            assert got == wanted, f"{got} of {wanted} bytes of pages within {PATIENCE} s"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_pages)
            await flood.send(floodkit.frame(b"events") * pages)  # one write: one read of the server's
            pong = await read_exactly(innocent, len(zmtp.frame(b"pong")), "the answer to the ping")
            assert pong == zmtp.frame(b"pong")
        assert harness.order.count("page") == pages, harness.order
        # Answered before the burst was through: at most two pages went first.
        assert "ping" in harness.order[:3], harness.order

    directory = Path(tempfile.mkdtemp(prefix="nvs-turns-", dir="/tmp"))
    harness = Pages(directory)
    monkeypatch.setattr(connections, "peer_credentials", harness.peer_credentials)
    monkeypatch.setattr(connections, "principal", harness.principal)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(harness.server.serve)
            await test(harness)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        harness.server.listener.close()
        shutil.rmtree(directory)
