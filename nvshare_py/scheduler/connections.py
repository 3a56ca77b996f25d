"""The daemon's connection server: accept, read, write and close the connections of one
listening Unix socket, speaking ZMTP through zmtp.py's parser. The client, control and
status sockets each have one.

Each connection gets a number of the daemon's own (nothing the peer sends chooses it), the
peer's kernel-verified credentials (SO_PEERCRED) at accept time, its *principal* (the uid, and
within it the Kubernetes pod the process runs in, from its cgroup), and a task that reads it;
what the peer sends reaches the owner as whole messages through `on_message`, and the end of
the connection through `on_closed`. Nothing here knows what the messages mean.

What one peer, or one principal, can cost is bounded here (docs/scheduler.md, *Security
model*):

- places: `ConnectionLimits` (per principal, per uid, a reserve for uid 0 and one for
  principals with few connections), checked before a connection is served;
- bytes: a message's size (zmtp.Parser, frames counted too), what a connection has buffered
  and queued, and what all connections of one principal hold together (`ByteBudget`);
- time: the handshake, a started frame and an unregistered connection's silence each have
  a deadline;
- the daemon's thread: every read and its messages run in a fair turn of the connection's
  principal (fairness.py), and so do setting the connection up and ending it; accepting runs
  in turns of the socket's `Door`; a connection whose peer does not read its answers is not
  read either until it does.

Why one file of some 600 lines: every bound above is checked at a step of the same connection's
life (accept, read, write, close), so what one peer can cost is read in one place; its parser
(zmtp.py) and its turns (fairness.py) already live apart.
"""

from __future__ import annotations

import collections
import errno
import itertools
import math
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import trio

from . import zmtp
from .fairness import Turn, Turns
from .logs import RateLimit, note
from .podcgroup import pod_uid_of_process
from .refusals import Refusals

# Frames handled in one turn before the others get theirs (fairness.py), and the bytes of
# answers after which a turn hands the rest of what it read to the principal's next turn: an
# `events` page (up to 128 KiB, eventring.py) or a status is one turn's work, however many a
# peer asks for at once.
FRAMES_PER_TURN = 16
TURN_OUTPUT = 64 * 1024
READ_SIZE = 16 * 1024
# A peer that has not finished the ZMTP handshake after this many seconds is disconnected;
# so is one that began a frame (or a message of several) and has not finished it.
HANDSHAKE_TIMEOUT = 10.0
FRAME_TIMEOUT = 10.0
# Bytes of messages a peer has not read yet before it is disconnected as one that does not
# read; its messages are not read while more than READ_PAUSE bytes wait for it.
OUTGOING_MAX = 256 * 1024
READ_PAUSE = 16 * 1024
# Connections accepted in one turn of the door, and the thread time after which the turn ends
# sooner; the listen backlog holds the rest (the kernel caps it at net.core.somaxconn).
ACCEPT_BATCH = 16
ACCEPT_TURN = 0.001
LISTEN_BACKLOG = 4096
# Seconds to wait before accepting again after running out of descriptors (or memory).
ACCEPT_RETRY = 0.1
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

# Who is limited together: a uid and the Kubernetes pod ("" outside one) of the process.
Principal = tuple[int | None, str]


@dataclass(frozen=True)
class Door:
    """The principal whose turns (fairness.py) the accept loop of one listening socket takes:
    accepting runs before anyone knows whose connection it is."""

    server: str


@dataclass(frozen=True)
class PeerCredentials:
    """The kernel-verified identity of a Unix socket peer (SO_PEERCRED). `pid` is 0 when the
    peer's process is not visible in our pid namespace; `uid` is None when the kernel gave no
    credentials."""

    uid: int | None
    gid: int | None
    pid: int


@dataclass(frozen=True)
class ConnectionLimits:
    """How many connections a server serves at once: in all; per principal (a uid's
    processes in one pod, or outside pods); per non-root uid over all its pods. `root_reserve`
    places are only for uid 0 (root on the host, and pods, which mostly run as root), and the
    last `newcomer_reserve` places of what is left only for principals holding fewer than
    `newcomer_quota` connections: so however many connections a few users open, root and a
    user new to the daemon can still connect."""

    total: int
    per_principal: int
    per_uid: int
    root_reserve: int = 0
    newcomer_reserve: int = 0
    newcomer_quota: int = 4

    @classmethod
    def sharing(cls, total: int, per_principal: int, per_uid: int) -> "ConnectionLimits":
        """Limits for `total` places: at most an eighth of them per principal and a quarter
        per uid (so that it takes more than a few users to fill them), a quarter reserved
        for root and an eighth for newcomers."""
        return cls(total, max(1, min(per_principal, total // 8)), max(1, min(per_uid, total // 4)),
                   total // 4, total // 8)

    def refusal(self, principal: Principal, counts: "ConnectionCounts") -> str | None:
        """Why one more connection of `principal` is not served (None: it is)."""
        uid = principal[0]
        held = counts.principals[principal]
        if held >= self.per_principal:
            return f"{self._name(principal)} has {held} connections open, the most one may"
        if uid == 0:
            used, size = counts.total, self.total
        else:
            if counts.uids[uid] >= self.per_uid:
                return f"uid {uid} has {counts.uids[uid]} connections open, the most one uid may"
            used, size = counts.total - counts.uids[0], self.total - self.root_reserve
        if used >= size:
            return f"{used} connections open, the most this daemon serves{'' if uid == 0 else ' to users other than root'}"
        if held >= self.newcomer_quota and used >= size - self.newcomer_reserve:
            return "the places left are reserved for users with few connections"
        return None

    @staticmethod
    def _name(principal: Principal) -> str:
        uid, pod = principal
        return f"uid {uid} in pod {pod}" if pod else f"uid {uid}"


class ConnectionCounts:
    """Open connections, in all, per principal and per uid (shared by nothing: per server)."""

    def __init__(self) -> None:
        self.total = 0
        self.principals: collections.Counter[Principal] = collections.Counter()
        self.uids: collections.Counter[int | None] = collections.Counter()

    def add(self, principal: Principal, change: int) -> None:
        self.total += change
        _count(self.principals, principal, change)
        _count(self.uids, principal[0], change)


def _count(counter: "collections.Counter[Any]", key: Any, change: int) -> None:
    counter[key] += change
    if not counter[key]:
        del counter[key]


class ByteBudget:
    """Bytes a principal's connections may hold together (received and not handled yet,
    queued and not sent yet), and all connections together."""

    def __init__(self, per_principal: int, total: int) -> None:
        self.per_principal = per_principal
        self.total = total
        self.used = 0
        self.by_principal: collections.Counter[Principal] = collections.Counter()

    def charge(self, principal: Principal, change: int) -> str | None:
        """Account `change` bytes (negative: freed); why that is too much, or None."""
        if not change:
            return None
        self.used += change
        _count(self.by_principal, principal, change)
        held = self.by_principal[principal]
        if change > 0:
            if held > self.per_principal:
                return f"its user's connections hold {held} bytes, over {self.per_principal}"
            if self.used > self.total:
                return f"all connections hold {self.used} bytes, over {self.total}"
        return None


class Connection:
    """One connection. `key` is the daemon's own number for it (the core's ClientKey):
    nothing the peer sends chooses or changes it."""

    __slots__ = ("key", "sock", "credentials", "principal", "outgoing", "flushing", "drained", "scope",
                 "closing", "charged", "ready", "accepted", "last_message", "partial_since", "expiry", "written",
                 "unhandled")

    def __init__(self, key: int, sock: socket.socket, credentials: PeerCredentials, principal: Principal,
                 now: float) -> None:
        self.key = key
        self.sock = sock
        self.credentials = credentials
        self.principal = principal
        self.outgoing = bytearray()
        # The task sending what `outgoing` holds once the socket takes it, while there is any
        # (most connections never need one): its cancel scope.
        self.flushing: trio.CancelScope | None = None
        self.drained: trio.Event | None = None  # set when `outgoing` falls to READ_PAUSE
        self.scope: trio.CancelScope | None = None
        self.closing = False
        self.charged = 0  # bytes charged to the ByteBudget for it
        self.ready = False  # handshake done
        self.accepted = now
        self.last_message = now
        self.partial_since: float | None = None
        self.expiry = ""  # why its deadline is what it is (for the log)
        self.written = 0  # bytes of answers written in its current turn (TURN_OUTPUT)
        self.unhandled: list[zmtp.Message | zmtp.Ping | zmtp.Ready] = []  # read, left for its next turn


class ConnectionServer:
    """Serves one listening socket (`serve`, a task of the daemon's nursery). `on_message`
    gets each whole message (its frames) and may `write` answers; `on_closed` runs once
    when a connection has ended, whoever ended it. A connection for which `stays_idle`
    says False (an unregistered client connection, a control connection) is closed after
    `idle_timeout` seconds without a message. A connection refused for want of places is
    remembered in `refusals` and, where `refused_message` is given, sent what it returns for
    the refusal's reason before it is closed."""

    def __init__(
        self,
        name: str,
        listener: socket.socket,
        limits: ConnectionLimits,
        max_message: int,
        on_message: Callable[[Connection, tuple[bytes, ...]], None],
        on_closed: Callable[[Connection], None],
        *,
        turns: Turns,
        budget: ByteBudget,
        idle_timeout: float,
        stays_idle: Callable[[Connection], bool] = lambda connection: False,
        outgoing_max: int = OUTGOING_MAX,
        refused_message: Callable[[str], bytes] | None = None,
    ) -> None:
        self.name = name  # "client", "control", "status": for log lines
        self.listener = listener
        self.limits = limits
        self.max_message = max_message
        self.on_message = on_message
        self.on_closed = on_closed
        self.turns = turns
        self.budget = budget
        self.idle_timeout = idle_timeout
        self.stays_idle = stays_idle
        self.outgoing_max = outgoing_max
        self.refused_message = refused_message
        self.refusals = Refusals()
        self.connections: dict[int, Connection] = {}
        self.counts = ConnectionCounts()
        self._numbers = itertools.count(1)
        self._bad_input_log = RateLimit()
        self._resource_log = RateLimit()
        self._nursery: trio.Nursery | None = None  # the connections' tasks

    async def serve(self) -> None:
        """Accept connections, each served by its own task, in turns of the socket's door
        (fairness.py): however fast connections come, accepting them takes no more of the
        thread than one principal may, and a message of a connection already served waits
        for one batch at most. Running out of descriptors is not fatal: the connections wait
        in the listen backlog meanwhile."""
        listener = self.listener
        door = Door(self.name)
        self.turns.join(door)
        async with trio.open_nursery() as connections:
            self._nursery = connections
            while True:
                await trio.lowlevel.wait_readable(listener)
                turn = await self.turns.take(door)
                try:
                    exhausted = self._accept_batch(turn, connections)
                finally:
                    turn.release()
                if exhausted:
                    await trio.sleep(ACCEPT_RETRY)
                await trio.lowlevel.checkpoint()

    def _accept_batch(self, turn: Turn, connections: trio.Nursery) -> bool:
        """Accept up to ACCEPT_BATCH connections, or what ACCEPT_TURN allows; True when out of
        descriptors (or memory)."""
        # Whose each peer is, looked up once a batch per process: a flood comes from a few
        # processes, and reading a process's cgroup costs more than accepting. (The pid may
        # have been reused by the time its cgroup is read, one batch later at most instead of
        # at once: the same race, no longer.)
        seen: dict[PeerCredentials, Principal] = {}
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                note(f"cannot accept a {self.name} connection", self._resource_log, error=exc.strerror)
                return True
            connection = self._admit(sock, seen)
            if connection is not None:
                connections.start_soon(self._serve_connection, connection)
            if turn.spent() > ACCEPT_TURN:
                break
        return False

    def _admit(self, sock: socket.socket, seen: dict[PeerCredentials, Principal]) -> Connection | None:
        """Serve or refuse a connection just accepted (`seen`: the principals of the peers
        seen in this batch); the time it took is its principal's (fairness.py), so that a
        user opening connections in a loop pays for them."""
        started = self.turns.clock()
        credentials = peer_credentials(sock)
        who = seen.get(credentials)
        if who is None:
            who = seen[credentials] = principal(credentials)
        refusal = self.limits.refusal(who, self.counts)
        if refusal is not None:
            self.refusals.note(who, credentials.pid, refusal, trio.current_time())
            if self.refused_message is not None:
                _tell_refused(sock, self.refused_message(refusal))
            sock.close()
            note(f"{self.name} connection refused", self._resource_log, reason=refusal,
                 uid=credentials.uid, pid=credentials.pid)
            self.turns.charge(who, self.turns.clock() - started)  # its meter, if it has connections
            return None
        sock.setblocking(False)
        connection = Connection(next(self._numbers), sock, credentials, who, trio.current_time())
        self.connections[connection.key] = connection
        self.counts.add(who, 1)
        self.turns.join(who)
        self.turns.charge(who, self.turns.clock() - started)
        return connection

    async def _serve_connection(self, connection: Connection) -> None:
        self.turns.own(trio.lowlevel.current_task(), connection.principal)
        parser = zmtp.Parser(self.max_message)
        try:
            with trio.CancelScope() as scope:
                connection.scope = scope
                self._set_deadline(connection, parser)
                # Setting up is its principal's work, done in its turn: a user opening
                # connections in a loop waits for its share like one sending frames.
                turn = await self.turns.take(connection.principal)
                try:
                    self.write(connection, zmtp.HANDSHAKE)
                finally:
                    turn.release()
                await self._read(connection, parser)
            if scope.cancelled_caught and not connection.closing:
                note(f"{self.name} connection closed", self._bad_input_log, reason=connection.expiry,
                     uid=connection.credentials.uid)
        finally:
            await self._end(connection)

    async def _end(self, connection: Connection) -> None:
        """Free the connection's bytes and socket at once; what its end costs the owner
        (`on_closed`: for a registered client, the core's Unregister) is its principal's work,
        done in its turn. Its place stays taken until then: what the owner keeps for it (a
        registration, a pidfd) counts against its principal's limits until it is let go. When
        the daemon stops (the wait for a turn is cancelled) the owner is told all the same."""
        del self.connections[connection.key]
        if connection.flushing is not None:
            connection.flushing.cancel()
        self.budget.charge(connection.principal, -connection.charged)
        connection.charged = 0
        connection.outgoing = bytearray()
        trio.lowlevel.notify_closing(connection.sock)
        connection.sock.close()
        turn = None
        try:
            turn = await self.turns.take(connection.principal)
        finally:
            try:
                self.on_closed(connection)
            finally:
                if turn is not None:
                    turn.release()
                self.counts.add(connection.principal, -1)
                self.turns.disown(trio.lowlevel.current_task())
                self.turns.leave(connection.principal)

    async def _read(self, connection: Connection, parser: zmtp.Parser) -> None:
        sock = connection.sock
        while True:
            if len(connection.outgoing) > READ_PAUSE:
                # Its peer does not read what it asked for: handle no more of it meanwhile.
                connection.drained = trio.Event()
                await connection.drained.wait()
            # Frames left from the last turn (it stopped for the peer's unread answers, or for
            # TURN_OUTPUT) come first: the peer may be waiting for their answers and send
            # nothing more.
            left = parser.stopped or bool(connection.unhandled)
            if not left:
                await trio.lowlevel.wait_readable(sock)
            turn = await self.turns.take(connection.principal)
            connection.written = 0
            try:
                if not left:
                    try:
                        data = sock.recv(READ_SIZE)
                    except BlockingIOError:
                        continue
                    except OSError:
                        return  # reset by the peer
                    if not data:
                        return
                    parser.receive(data)
                while True:
                    items, connection.unhandled = connection.unhandled, []
                    try:
                        items = items or parser.parse(FRAMES_PER_TURN)
                    except zmtp.Violation as exc:
                        note(f"{self.name} connection closed", self._bad_input_log, reason=str(exc),
                             uid=connection.credentials.uid)
                        return
                    if not self._handle(connection, items):
                        return
                    if not (parser.stopped or connection.unhandled) or len(connection.outgoing) > READ_PAUSE:
                        break
                    await turn.pause()
                    connection.written = 0
                refusal = self._account(connection, parser)
                if refusal is not None:
                    note(f"{self.name} connection closed", self._resource_log, reason=refusal,
                         uid=connection.credentials.uid)
                    return
                self._set_deadline(connection, parser)
            finally:
                turn.release()

    def _handle(self, connection: Connection, items: list[zmtp.Message | zmtp.Ping | zmtp.Ready]) -> bool:
        """Hand on what was parsed, until the turn's answers reach TURN_OUTPUT (the rest waits
        in `unhandled`); False when the connection is to be closed."""
        for number, item in enumerate(items):
            if connection.written >= TURN_OUTPUT:
                connection.unhandled = items[number:]
                return True
            if type(item) is zmtp.Message:
                connection.last_message = trio.current_time()
                connection.partial_since = None  # what is left unfinished began after it
                self.on_message(connection, item.frames)
            elif type(item) is zmtp.Ping:
                self.write(connection, zmtp.pong(item.context))
            else:  # Ready
                connection.ready = True
                connection.partial_since = None
            if connection.closing:
                return False
        return True

    def _account(self, connection: Connection, parser: zmtp.Parser) -> str | None:
        held = parser.buffered + len(connection.outgoing) + sum(
            len(frame) for item in connection.unhandled if type(item) is zmtp.Message for frame in item.frames)
        change, connection.charged = held - connection.charged, held
        return self.budget.charge(connection.principal, change)

    def _set_deadline(self, connection: Connection, parser: zmtp.Parser) -> None:
        """The earliest of: the handshake's end, a started frame's end, the end of the
        silence allowed to a connection that may not stay idle. A frame (or message) counts
        as started at the read in which the last one before it was finished (`_handle`
        forgets `partial_since` then), so a peer streaming messages back to back, whose reads
        end inside frames, has each message judged on its own; a peer that finishes none is
        judged from the read that began the unfinished one."""
        scope = connection.scope
        if scope is None:
            return
        now = trio.current_time()
        deadline, why = math.inf, ""
        if not connection.ready:
            deadline, why = connection.accepted + HANDSHAKE_TIMEOUT, "no handshake in time"
        if parser.partial:
            if connection.partial_since is None:
                connection.partial_since = now
            if connection.partial_since + FRAME_TIMEOUT < deadline:
                deadline, why = connection.partial_since + FRAME_TIMEOUT, "a frame not finished in time"
        else:
            connection.partial_since = None
        if connection.ready and not self.stays_idle(connection):
            idle_end = connection.last_message + self.idle_timeout
            if idle_end < deadline:
                deadline, why = idle_end, "idle for too long"
        scope.deadline = deadline
        connection.expiry = why

    def restart_idle(self, key: int) -> None:
        """The connection numbered `key` may no longer stay idle from now on (its
        registration ended): its silence counts from now."""
        connection = self.connections.get(key)
        if connection is not None and connection.scope is not None and connection.ready:
            connection.last_message = trio.current_time()
            end = connection.last_message + self.idle_timeout
            if end < connection.scope.deadline:
                connection.scope.deadline = end
                connection.expiry = "idle for too long"

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
        connection.written += len(data)
        out = connection.outgoing
        out += data
        if len(out) > self.outgoing_max:
            note(f"{self.name} connection closed", self._resource_log, reason="it does not read its messages",
                 uid=connection.credentials.uid)
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
        if out and connection.flushing is None and self._nursery is not None:
            connection.flushing = trio.CancelScope()
            self._nursery.start_soon(self._flush, connection, connection.flushing)

    async def _flush(self, connection: Connection, scope: trio.CancelScope) -> None:
        """Send what `write` could not, as the socket takes it; ends when all is sent or the
        connection ends (`_end` cancels it). A task of the server's, started only for
        connections whose peer reads slower than the daemon writes."""
        with scope:
            out = connection.outgoing
            while out:
                await trio.lowlevel.wait_writable(connection.sock)
                try:
                    sent = connection.sock.send(out)
                except BlockingIOError:
                    continue
                except OSError:
                    self.close(connection)
                    break
                del out[:sent]
                if connection.drained is not None and len(out) <= READ_PAUSE:
                    connection.drained.set()
                    connection.drained = None
        connection.flushing = None

    def close(self, connection: Connection) -> None:
        connection.closing = True
        connection.outgoing.clear()
        if connection.drained is not None:
            connection.drained.set()
        if connection.scope is not None:
            connection.scope.cancel()


def _tell_refused(sock: socket.socket, data: bytes) -> None:
    """Write `data` to a connection about to be closed, as far as its socket takes it at once
    (a new connection's buffer takes a short message whole); never waits."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass  # gone already, or no room: it is closed all the same


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


def principal(credentials: PeerCredentials) -> Principal:
    """Whom a connection counts against: its uid, and the pod its process runs in (from the
    cgroup of the kernel-verified pid; "" outside a pod or when the process is not visible),
    so that pods running as root do not share root's limits."""
    return credentials.uid, pod_uid_of_process(credentials.pid)


def listen_unix(path: Path, mode: int) -> socket.socket:
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
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener

