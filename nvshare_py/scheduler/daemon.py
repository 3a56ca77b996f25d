"""nvshare-scheduler: the Trio shell around the sans-I/O lock core (core.py).

One nursery holds every task:

- the acceptor takes connections on the client socket (after checking that there is room for
  them, docs/scheduler.md) and starts one task per connection, which speaks ZMTP (zmtp.py)
  and turns each message into a core event;
- the timer sends the core `Tick` when its next deadline comes;
- the control task owns the control ROUTER (libzmq: only root and the daemon's user reach it)
  and answers nvsharectl;
- one pid watcher per registered client whose process is visible: it sleeps on a pidfd and
  reports the process's exit, so a crashed holder's lock moves on at once;
- the signal task turns SIGTERM/SIGINT into a clean shutdown;
- with --metrics, the metrics task answers Prometheus scrapes (metrics.py); `_carry_out` hands
  the metrics observer every event and its actions.

All of them feed the core through one function, `_feed`, which carries out the actions the
core returns (sends, timeline entries, logs, forgetting clients) and moves the timer: the one
place to observe what the scheduler does. It never awaits, so events are applied one at a
time. Nothing here blocks and there are no threads (libzmq's own I/O thread aside).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import itertools
import json
import logging
import math
import os
import resource
import signal
import socket
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any

import trio
import zmq

from .. import __version__, protocol
from ..paths import SocketPaths, check_socket_path
from . import events as ev
from . import views, zmtp
from . import admission
from .admission import AdmissionConfig
from .core import CoreConfig, SchedulerCore
from .metrics import SchedulerMetrics, bind_metrics, parse_address, serve_metrics
from .podcgroup import pod_uid_of_process
from .zmqtrio import PeerCredentials, bind_router, listen_unix, peer_credentials, recv_nowait, wait_readable

log = logging.getLogger("nvshare.scheduler")

EVENTS_DEFAULT_LIMIT = 1000
# A client connection is closed when one message (all its frames) is larger than this; between
# the protocol's limit and this, a message is answered (ERROR too-large). libzmq drops control
# connections the same way above CONTROL_WIRE_MAX.
CLIENT_WIRE_MAX = 64 * 1024
CONTROL_WIRE_MAX = 1024 * 1024
# Messages handled before a connection's task lets the others run (fairness under a flood).
PUMP_BATCH = 64
READ_SIZE = 64 * 1024
# A peer that has not finished the ZMTP handshake after this many seconds is disconnected.
HANDSHAKE_TIMEOUT = 10.0
# Bytes of messages a client has not read yet before it is disconnected as one that does not read.
OUTGOING_MAX = 1024 * 1024
# Seconds to wait before accepting again after running out of descriptors (or memory).
ACCEPT_RETRY = 0.1
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# Descriptors kept back from clients: the control socket and its connections, the lock file,
# libzmq's and Trio's own, the log.
RESERVED_DESCRIPTORS = 64


class StartupError(Exception):
    """The daemon refuses to start; the message tells the operator why and what to do."""


@dataclass(frozen=True)
class DaemonConfig:
    socket_dir: str | os.PathLike | None = None  # None: $NVSHARE_SOCKET_DIR or the default
    mode: ev.Mode = "on"
    tq: float = 30.0
    grace: float = 5.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    idle_release: float = 1.0
    recovery: float = 2.0  # only used when a previous daemon's client socket is found
    swapping: bool = True  # budgets move memory at handoffs (docs/scheduler.md, "Budgets and swapping")
    min_quantum: float = 1.0  # the shortest quantum of a light or outranked holder (fairshare.py)
    ageing: int = 4  # grants waited per priority class a waiter rises; 0: no ageing
    metrics: str | None = None  # HOST:PORT or :PORT to serve Prometheus metrics on; None: off
    # Admission (docs/scheduler.md): host bytes allowed beyond the devices' budgets; "auto":
    # admission.DEFAULT_SPILL_FRACTION of the host's MemAvailable when the daemon starts; None: off.
    admission_spill: int | str | None = "auto"
    admission_policy: str = "fifo"
    admission_timeout: float = admission.DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        # Refuse values the lock core does not accept now, before any directory or socket is
        # touched (a socket left behind would make the next daemon believe it restarted).
        self.core_config(restarted=True)
        if self.metrics is not None:
            parse_address(self.metrics)

    def core_config(self, restarted: bool) -> CoreConfig:
        """The lock core's settings; raises ValueError for a value it does not accept."""
        return CoreConfig(
            mode=self.mode,
            tq=self.tq,
            grace=self.grace,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout,
            idle_release=self.idle_release,
            recovery=self.recovery if restarted else 0.0,
            swapping=self.swapping,
            admission=AdmissionConfig(
                spill=host_spill() if self.admission_spill == "auto" else self.admission_spill,
                policy=self.admission_policy,
                timeout=self.admission_timeout,
            ),
            min_quantum=self.min_quantum,
            ageing=self.ageing,
        )


def host_spill(meminfo: str = "/proc/meminfo") -> int:
    """The default host spill: a fraction of the memory the kernel says is available for new
    work without swapping (MemAvailable). 0 when it cannot be read: admission then holds the
    clients to the devices' budgets, which is safe, and the log says so."""
    try:
        with open(meminfo, encoding="ascii") as file:
            for line in file:
                name, _, rest = line.partition(":")
                if name == "MemAvailable":
                    return int(int(rest.split()[0]) * 1024 * admission.DEFAULT_SPILL_FRACTION)
    except (OSError, ValueError, IndexError):
        pass
    log.warning("cannot read MemAvailable from %s: admission spill 0 (set --admission-spill)", meminfo)
    return 0


def format_fields(fields: dict[str, Any]) -> str:
    """`key=value` pairs; values with spaces, quotes or '=' are JSON-quoted."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\n\t'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def emit(level: int, text: str, **fields: Any) -> None:
    """One operator-readable log line: the event, then its fields."""
    if not log.isEnabledFor(level):
        return
    if fields:
        log.log(level, "%s %s", text, format_fields(fields))
    else:
        log.log(level, "%s", text)


class RateLimit:
    """A token bucket for log lines that a peer can provoke: at most `burst` lines at once,
    `rate` per second after that. It counts what it suppressed so the next line can say so."""

    def __init__(self, rate: float = 2.0, burst: float = 20.0) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()
        self.suppressed = 0

    def take(self) -> int | None:
        """None: stay silent. Otherwise the number of lines suppressed since the last one."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            self.suppressed += 1
            return None
        self.tokens -= 1.0
        suppressed, self.suppressed = self.suppressed, 0
        return suppressed


class CoreFailure(Exception):
    """The lock core raised on an event: the daemon stops (see Daemon._feed)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """How many client connections the daemon serves at once, in all and per uid. Each
    costs a descriptor, and a registered one a pidfd too."""

    total: int
    per_uid: int

    @classmethod
    def for_descriptors(cls, nofile: int) -> "ConnectionLimits":
        total = max(8, (nofile - RESERVED_DESCRIPTORS) // 2)
        # One user cannot take every place: three quarters at most.
        return cls(total, max(4, total * 3 // 4))


class _Connection:
    """One client connection. `key` is the daemon's own number for it (the core's ClientKey):
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


_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_INTERNAL_ERROR = "the scheduler failed on this request; see its log"


class Daemon:
    """Use: `daemon.open()` (synchronous; raises StartupError), `trio.run(daemon.serve)`,
    then `daemon.close()`."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.paths = SocketPaths.resolve(config.socket_dir)
        self.restarted = False  # a previous daemon's client socket was found: clients may come back
        self.core: SchedulerCore | None = None
        self._lock_fd: int | None = None
        self._context: zmq.Context | None = None
        self._listener: socket.socket | None = None
        self._control: zmq.Socket | None = None
        self._nursery: trio.Nursery | None = None
        self._timer: trio.CancelScope | None = None
        self._stopping = False
        self.limits = ConnectionLimits.for_descriptors(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self._connections: dict[int, _Connection] = {}
        self._connection_numbers = itertools.count(1)
        self._per_uid: collections.Counter[int | None] = collections.Counter()
        self._watchers: dict[ev.ClientKey, trio.CancelScope] = {}
        self._events: collections.deque[dict] = collections.deque(maxlen=protocol.CONTROL_EVENTS_MAX)
        self._next_seq = 1
        self._started = 0.0
        self._wall_offset = 0.0
        self._uid = os.geteuid()
        own_ns = os.stat("/proc/self/ns/pid")
        self._pid_namespace = (own_ns.st_dev, own_ns.st_ino)
        self._bad_input_log = RateLimit()
        self._forbidden_log = RateLimit()
        self._resource_log = RateLimit()
        self._query_fail_log = RateLimit()
        self._metrics: SchedulerMetrics | None = None
        self._metrics_sockets: list = []
        # The core's lines: most are caused by clients (registrations, drops, ...).
        self._core_log = RateLimit(rate=20.0, burst=200.0)

    # --- setup and teardown ----------------------------------------------------------------

    def open(self) -> None:
        paths = self.paths
        for path in (paths.client_socket, paths.control_socket):
            try:
                check_socket_path(path)
            except ValueError as exc:
                raise StartupError(f"{exc}: choose a shorter --socket-dir") from None
        self.limits = ConnectionLimits.for_descriptors(_raise_descriptor_limit())
        if self.config.metrics is not None:
            try:
                self._metrics_sockets = bind_metrics(self.config.metrics)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics on {self.config.metrics}: {exc.strerror or exc}") from None
        try:
            self._prepare_directories()
            self._lock_fd = self._take_lock()
            self.restarted = self._previous_daemon_left_clients()
            self._context = zmq.Context()
            self._listener = socket.socket(fileno=listen_unix(paths.client_socket, 0o666))
            self._listener.setblocking(False)
            self._control = bind_router(self._context, paths.control_socket, 0o600, max_message=CONTROL_WIRE_MAX)
        except OSError as exc:
            self.close()
            raise StartupError(f"cannot set up {paths.root}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the sockets (their files stay, see zmqtrio) and release the lock file."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._control is not None:
            self._control.close(linger=0)
            self._control = None
        for sock in self._metrics_sockets:
            sock.close()
        self._metrics_sockets = []
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _prepare_directories(self) -> None:
        paths = self.paths
        paths.root.mkdir(mode=0o755, parents=True, exist_ok=True)
        # Whoever owns the directory can rename the socket directories in it and put its own
        # in their place (e.g. by creating the /tmp default of another user first).
        info = paths.root.stat()
        owner = info.st_uid
        if owner not in (0, self._uid):
            raise StartupError(
                f"{paths.root} belongs to uid {owner}, neither this daemon's uid {self._uid} nor root, "
                "so that user could replace the sockets in it: choose another --socket-dir"
            )
        # The same holds for anyone who may write to it, unless the sticky bit stops them
        # renaming what they do not own (as in /tmp).
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            raise StartupError(
                f"{paths.root} is writable by {'others' if info.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {stat.S_IMODE(info.st_mode):o}) without the sticky bit, so they could replace the "
                "sockets in it: remove that permission (chmod go-w) or choose another --socket-dir"
            )
        for directory, mode in ((paths.client_dir, 0o755), (paths.control_dir, 0o700)):
            try:
                directory.mkdir(mode=mode)
            except FileExistsError:
                pass
            info = os.lstat(directory)
            if not stat.S_ISDIR(info.st_mode):
                raise StartupError(f"{directory} is not a directory (symbolic links are refused)")
            if info.st_uid != self._uid:
                raise StartupError(
                    f"{directory} belongs to uid {info.st_uid}, not to this daemon's uid {self._uid}: "
                    "remove it or choose another --socket-dir"
                )
            os.chmod(directory, mode)

    def _take_lock(self) -> int:
        lock_file = self.paths.lock_file
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StartupError(
                f"another nvshare-scheduler (pid {holder}) is already serving {self.paths.root} "
                f"(it holds {lock_file})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _previous_daemon_left_clients(self) -> bool:
        """A client socket file left by an earlier daemon means its clients may reconnect."""
        try:
            info = os.lstat(self.paths.client_socket)
        except FileNotFoundError:
            return False
        if not stat.S_ISSOCK(info.st_mode):
            raise StartupError(f"{self.paths.client_socket} exists and is not a socket; remove it")
        return True

    # --- the Trio part ---------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until SIGTERM/SIGINT. Raises CoreFailure when the lock core failed on an
        event (see `_feed`)."""
        config = self.config
        self.core = SchedulerCore(config.core_config(self.restarted), trio.current_time())
        self._started = time.time()
        # One offset for the daemon's life: converting each time with a fresh time.time() would
        # let two events of one instant come out in the wrong order.
        self._wall_offset = self._started - trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self._stop_on_signal, nursery.cancel_scope)
                nursery.start_soon(self._run_timer)
                nursery.start_soon(self._accept_clients)
                nursery.start_soon(self._serve_control)
                if self._metrics_sockets:
                    self._metrics = SchedulerMetrics(restarted=self.restarted, started=self._started)
                    nursery.start_soon(serve_metrics, self._metrics_sockets,
                                       lambda: self._metrics.render_in_steps(self.status()))
                emit(
                    logging.INFO,
                    "ready",
                    socket_dir=self.paths.root,
                    pid=os.getpid(),
                    mode=config.mode,
                    tq=config.tq,
                    grace=config.grace,
                    heartbeat_timeout=config.heartbeat_timeout,
                    recovery=self.core.config.recovery,
                    max_connections=self.limits.total,
                    max_connections_per_uid=self.limits.per_uid,
                )
                task_status.started()
        except BaseExceptionGroup as group:
            failure, rest = group.split(CoreFailure)
            if failure is None:
                raise
            if rest is not None:
                raise rest from None
            raise _first(failure) from None
        finally:
            self._stopping = True
        emit(logging.INFO, "stopped")

    async def _stop_on_signal(self, scope: trio.CancelScope, *, task_status: trio.TaskStatus) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                emit(logging.INFO, "stopping", signal=signal.Signals(signum).name)
                self._stopping = True
                scope.cancel()
                return

    def _wall(self, monotonic: float) -> float:
        return monotonic + self._wall_offset

    # --- the pump: the one place where the core is fed and its actions carried out ---------

    def _feed(self, event: ev.Event) -> None:
        """Give the core one event and carry out its actions (every task calls this; it never
        awaits, so events are applied one at a time).

        A core that raised may have left its lock table half-updated; serving on could grant
        one device twice. So the daemon stops (CoreFailure, exit status 70) and leaves its
        socket files in place: the next daemon (systemd or the DaemonSet restarts it) runs
        restart recovery and rebuilds the table from the clients' re-HELLOs. A control
        request the core refuses (ControlError) changes nothing and is not a failure."""
        try:
            actions = self.core.handle(event)
        except ev.ControlError:
            raise
        except Exception as exc:
            log.critical("the lock core failed on %r; exiting so that restart recovery rebuilds the "
                         "lock table", event, exc_info=True)
            raise CoreFailure(f"the lock core failed on {type(event).__name__}") from exc
        self._carry_out(event, actions)
        if self._timer is not None:
            self._timer.deadline = self._next_tick()

    def _next_tick(self) -> float:
        deadline = self.core.next_deadline()
        return math.inf if deadline is None else deadline

    async def _run_timer(self) -> None:
        """Sends Tick when the core's next deadline comes (`_feed` moves the deadline)."""
        while True:
            with trio.CancelScope(deadline=self._next_tick()) as scope:
                self._timer = scope
                await trio.sleep_forever()
            self._timer = None
            self._feed(ev.Tick(trio.current_time()))

    def _carry_out(self, event: ev.Event, actions: list[ev.Action]) -> None:
        # Messages first: a GRANT is on the waiter's handoff path, the bookkeeping is not.
        for action in actions:
            if type(action) is ev.Send:
                self._send(action.client, action.message)
        if self._metrics is not None:
            self._metrics.observe(event, actions)
        for action in actions:
            kind = type(action)
            if kind is ev.LockEvent:
                self._record(action)
            elif kind is ev.Log:
                # Nearly every line the core writes is caused by some client: rate-limited.
                level = _LOG_LEVELS.get(action.level, logging.INFO)
                if not log.isEnabledFor(level):
                    continue
                suppressed = self._core_log.take()
                if suppressed is not None:
                    fields = dict(action.fields, suppressed=suppressed) if suppressed else action.fields
                    emit(level, views.describe(action), **fields)
            elif kind is ev.Forget:
                self._forget(action.client)

    def _send(self, key: ev.ClientKey, message: protocol.Message) -> None:
        connection = self._connections.get(key)
        if connection is None:
            return  # gone; its Unregister is on its way or done
        try:
            data = message.encode()
        except ValueError as exc:
            log.error("cannot encode %s for a client: %s", message.TYPE, exc)
            return
        self._write(connection, zmtp.frame(data))

    def _record(self, event: ev.LockEvent) -> None:
        """Timeline entry for `nvsharectl events`. Not logged: the core's Log actions already
        describe each of these in words."""
        self._events.append({
            "seq": self._next_seq,
            "t": self._wall(event.now),
            "device": event.device,
            "client": event.client,
            "kind": event.kind,
            "grant": event.grant,
            "detail": event.detail,
        })
        self._next_seq += 1

    # --- client connections ----------------------------------------------------------------

    async def _accept_clients(self) -> None:
        """Accept connections on the client socket, each served by its own task. Running out
        of descriptors is not fatal: the connections wait in the listen backlog meanwhile."""
        listener = self._listener
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
                    self._note("cannot accept a client connection", self._resource_log, error=exc.strerror)
                    await trio.sleep(ACCEPT_RETRY)
                    continue
                sock.setblocking(False)
                credentials = _peer_credentials(sock)
                refusal = self._admission_refusal(credentials)
                if refusal is not None:
                    sock.close()
                    self._note("client connection refused", self._resource_log, reason=refusal,
                               uid=credentials.uid, pid=credentials.pid)
                    continue
                key = next(self._connection_numbers)
                connection = _Connection(key, sock, credentials)
                self._connections[key] = connection
                self._per_uid[credentials.uid] += 1
                connections.start_soon(self._serve_connection, connection)

    def _admission_refusal(self, credentials: PeerCredentials) -> str | None:
        if len(self._connections) >= self.limits.total:
            return f"{self.limits.total} connections open, the most this daemon serves"
        if self._per_uid[credentials.uid] >= self.limits.per_uid:
            return f"uid {credentials.uid} has {self.limits.per_uid} connections open, the most one uid may"
        return None

    async def _serve_connection(self, connection: _Connection) -> None:
        parser = zmtp.Parser(CLIENT_WIRE_MAX)
        sock = connection.sock
        try:
            with trio.CancelScope() as scope:
                connection.scope = scope
                # A peer must finish its handshake in time: it holds a descriptor meanwhile.
                scope.deadline = trio.current_time() + HANDSHAKE_TIMEOUT
                self._write(connection, zmtp.HANDSHAKE)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._flush, connection)
                    await self._read(connection, parser, scope)
                    nursery.cancel_scope.cancel()
        finally:
            del self._connections[connection.key]
            self._per_uid[connection.credentials.uid] -= 1
            if not self._per_uid[connection.credentials.uid]:
                del self._per_uid[connection.credentials.uid]
            trio.lowlevel.notify_closing(sock)
            sock.close()
            if not self._stopping and self.core.client_id(connection.key) is not None:
                self._feed(ev.Unregister(trio.current_time(), connection.key, "disconnected"))

    async def _read(self, connection: _Connection, parser: zmtp.Parser, scope: trio.CancelScope) -> None:
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
                self._note("client connection closed", self._bad_input_log, reason=str(exc))
                return
            for handled, item in enumerate(items, 1):
                if type(item) is zmtp.Message:
                    self._on_client_message(connection, item.frames)
                elif type(item) is zmtp.Ping:
                    self._write(connection, zmtp.pong(item.context))
                else:  # Ready
                    scope.deadline = math.inf
                if connection.closing:
                    return
                if handled % PUMP_BATCH == 0:
                    await trio.lowlevel.checkpoint()  # fairness under a flood

    def _write(self, connection: _Connection, data: bytes) -> None:
        """Queue `data` and send what the socket takes now. A peer that lets more than
        OUTGOING_MAX bytes pile up does not read: it is disconnected."""
        if connection.closing:
            return
        out = connection.outgoing
        out += data
        if len(out) > OUTGOING_MAX:
            self._note("client connection closed", self._resource_log, reason="it does not read its messages")
            self._close(connection)
            return
        try:
            sent = connection.sock.send(out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(connection)
            return
        del out[:sent]
        if out:
            connection.writable.set()

    async def _flush(self, connection: _Connection) -> None:
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
                    self._close(connection)
                    return
                del connection.outgoing[:sent]

    def _close(self, connection: _Connection) -> None:
        connection.closing = True
        connection.outgoing.clear()
        if connection.scope is not None:
            connection.scope.cancel()

    def _note(self, text: str, limit: RateLimit, **fields: Any) -> None:
        """A log line that a peer can provoke at will: rate-limited."""
        suppressed = limit.take()
        if suppressed is not None:
            emit(logging.INFO, text, **fields, suppressed=suppressed)

    def _on_client_message(self, connection: _Connection, frames: tuple[bytes, ...]) -> None:
        key = connection.key
        if len(frames) != 1:
            self._reject(key, "malformed", f"{len(frames)} frames; a message is one frame")
            return
        try:
            message = protocol.decode(frames[0])
        except protocol.ProtocolError as exc:
            self._reject(key, exc.code, exc.detail, exc.msg_type)
            return
        now = trio.current_time()
        kind = type(message)
        if kind is protocol.Query:
            self._answer_query(connection, now)
            return
        registered = self.core.client_id(key) is not None
        if kind is protocol.Hello:
            if registered:
                self._reject(key, "already-registered", "this connection is registered already", "HELLO")
            else:
                self._register(now, connection, message)
            return
        if not registered:
            self._reject(key, "not-registered", "send HELLO first", message.TYPE)
            return
        if kind is protocol.Acquire:
            event = ev.AcquireRequest(now, key, message.device)
        elif kind is protocol.Release:
            event = ev.ReleaseReport(now, key, message.device, message.grant, message.reason, message.resident)
        elif kind is protocol.Heartbeat:
            event = ev.Alive(now, key)
        elif kind is protocol.Admit:
            event = ev.AdmitRequest(now, key, message.device, message.request, message.bytes)
        elif kind is protocol.Memory:
            event = ev.MemoryReport(now, key, message.device, message.used, message.resident, message.engine,
                                    message.area, message.out_bps, message.in_bps)
        elif kind is protocol.Evicted:
            event = ev.EvictedReport(now, key, message.device, message.resident)
        elif kind is protocol.Device:
            event = ev.DeviceInfo(now, key, message.device, message.total, message.name)
        elif kind is protocol.Bye:
            event = ev.Unregister(now, key, "bye")
        else:  # the codec only returns client messages
            raise AssertionError(f"unexpected message {kind.__name__}")
        self._feed(event)

    def _answer_query(self, connection: _Connection, now: float) -> None:
        # Matched by the kernel-verified pid, never by anything the peer says. A read: a
        # failure is logged (rate-limited) and the daemon serves on.
        try:
            answer = protocol.Status.of(views.query(self.core, connection.credentials.pid, now))
        except Exception:
            if self._query_fail_log.take() is not None:
                log.exception("cannot answer a QUERY")
            return
        self._send(connection.key, answer)

    def _reject(self, key: ev.ClientKey, code: str, detail: str, msg_type: str = "") -> None:
        if self._metrics is not None:
            self._metrics.rejected_message(code)
        self._note("rejected client message", self._bad_input_log, code=code, detail=detail, type=msg_type)
        # Keep the answer encodable whatever the peer sent (no control characters).
        detail = "".join(c if c.isprintable() else "?" for c in detail)[:200]
        msg_type = msg_type if msg_type.isalpha() else ""
        self._send(key, protocol.Error(code=code, detail=detail, type=msg_type))

    def _register(self, now: float, connection: _Connection, hello: protocol.Hello) -> None:
        peer = connection.credentials
        info = ev.ClientInfo(
            pid=hello.pid,
            session=hello.session,
            host_pid=peer.pid,
            uid=peer.uid,
            host=hello.host,
            container=hello.container,
            pod=hello.pod,
            namespace=hello.namespace,
            program=hello.program,
            # The kernel's pid, never the pod the client names: per-pod settings match on this.
            pod_uid=pod_uid_of_process(peer.pid),
        )
        key = connection.key
        self._feed(ev.Register(now, key, info, hello.held, hello.wanted))
        if peer.pid and self.core.client_id(key) is not None:
            self._watch_process(key, peer.pid)

    # --- process exit through pidfds --------------------------------------------------------

    def _watch_process(self, key: ev.ClientKey, pid: int) -> None:
        """One pidfd per registration, closed when the registration ends (Forget), which at
        the latest is when its connection closes: a descriptor per open connection."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            # Gone between its HELLO and now.
            self._feed(ev.Unregister(trio.current_time(), key, "exited"))
            return
        except OSError as exc:
            self._note("cannot watch client process; relying on heartbeats", self._resource_log,
                       pid=pid, error=exc.strerror)
            return
        scope = trio.CancelScope()
        self._watchers[key] = scope
        self._nursery.start_soon(self._watch_pidfd, key, pidfd, scope)

    async def _watch_pidfd(self, key: ev.ClientKey, pidfd: int, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await trio.lowlevel.wait_readable(pidfd)
                self._watchers.pop(key, None)
                self._feed(ev.Unregister(trio.current_time(), key, "exited"))
        finally:
            os.close(pidfd)

    def _forget(self, key: ev.ClientKey) -> None:
        scope = self._watchers.pop(key, None)
        if scope is not None:
            scope.cancel()

    # --- the control socket ----------------------------------------------------------------

    async def _serve_control(self) -> None:
        sock = self._control
        while True:
            await wait_readable(sock)
            while (frames := recv_nowait(sock)) is not None:
                envelope, body = _split_envelope(frames)
                reply = await self._answer(body)
                data = _fitted(reply)
                try:
                    sock.send_multipart([*envelope, data], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the requester left before its answer; nothing to tell anyone

    async def _answer(self, body: list[zmq.Frame]) -> dict:
        if len(body) != 1:
            return _failure("bad-request", "a request is one frame of JSON")
        frame = body[0]
        refusal = self._authorisation_failure(frame)
        if refusal is not None:
            suppressed = self._forbidden_log.take()
            if suppressed is not None:
                emit(logging.WARNING, "control request refused", reason=refusal, suppressed=suppressed)
            return _failure("forbidden", refusal)
        if len(frame) > protocol.CONTROL_REQUEST_MAX:
            return _failure("too-large", f"request of {len(frame)} bytes, limit {protocol.CONTROL_REQUEST_MAX}")
        try:
            request = json.loads(frame.bytes)
        except ValueError:
            return _failure("bad-request", "not JSON")
        try:
            if not isinstance(request, dict) or request.get("v") != 1:
                raise ev.ControlError("bad-request", 'a request is a JSON object with "v": 1')
            result = await self._control_op(request)
        except ev.ControlError as exc:
            return _failure(exc.code, str(exc))
        except Exception:
            # E.g. the core failing on `status`: answered, and the daemon serves on.
            log.exception("control request %r failed", request.get("op"))
            return _failure("internal", _INTERNAL_ERROR)
        return {"v": 1, "ok": True, "result": result}

    def _authorisation_failure(self, frame: zmq.Frame) -> str | None:
        peer = peer_credentials(frame)
        if peer.uid is None:
            return "the peer's credentials are unknown"
        if peer.uid not in (0, self._uid):
            return f"uid {peer.uid} may not control this scheduler"
        if peer.pid == 0:
            return "the peer's process is not visible in the scheduler's pid namespace"
        try:
            info = os.stat(f"/proc/{peer.pid}/ns/pid")
        except OSError:
            return "the peer's pid namespace cannot be read"
        if (info.st_dev, info.st_ino) != self._pid_namespace:
            return "the peer runs in another pid namespace"
        return None

    async def _control_op(self, request: dict) -> Any:
        op = request.get("op")
        if op == "status":
            return self.status()
        if op == "events":
            since = _integer(request, "since", 0, minimum=0)
            limit = _integer(request, "limit", EVENTS_DEFAULT_LIMIT, minimum=1, maximum=protocol.CONTROL_EVENTS_MAX)
            return self.events(since, limit)
        # The core judges the values of settings (ControlError bad-request) before changing anything.
        if op == "set-tq":
            seconds = _number(request, "seconds")
            device = _device(request, required=False)
            self._apply(lambda now: ev.SetQuantum(now, seconds, device))
            return {"device": device, "tq": seconds}
        if op == "set-mode":
            mode = request.get("mode")
            device = _device(request, required=False)
            self._apply(lambda now: ev.SetMode(now, mode, device))
            return {"device": device, "mode": mode}
        if op == "set-budget":
            budget = request.get("bytes")
            if budget is not None and (
                isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= protocol.MAX_INT
            ):
                raise ev.ControlError("bad-request", "bytes must be an integer > 0, or null for the device's total")
            device = _device(request, required=True)
            self._apply(lambda now: ev.SetBudget(now, device, budget))
            return {"device": device, "budget": budget}
        if op == "set-admission":
            return self._set_admission(request)
        # Per-client settings (docs/scheduler.md, "Weights and priorities"): the core judges
        # the value and whether the client exists.
        if op == "set-weight":
            client, pod_uid = _setting_target(request)
            weight = request.get("weight")
            self._apply(lambda now: ev.SetWeight(now, weight, client, pod_uid))
            return {"client": client, "pod_uid": pod_uid, "weight": weight}
        if op == "set-priority":
            client, pod_uid = _setting_target(request)
            priority = request.get("priority")
            self._apply(lambda now: ev.SetPriority(now, priority, client, pod_uid))
            return {"client": client, "pod_uid": pod_uid, "priority": priority}
        if op == "set-limit":
            client, pod_uid = _setting_target(request)
            limit = request.get("bytes")
            device = _device(request, required=False)
            self._apply(lambda now: ev.SetLimit(now, limit, device, client, pod_uid))
            return {"client": client, "pod_uid": pod_uid, "device": device, "bytes": limit}
        raise ev.ControlError("unknown-op", f"unknown op {op!r}")

    def _set_admission(self, request: dict) -> dict:
        """`spill` (bytes, or null: admission off), `policy`, `timeout` (seconds); each optional.
        The core judges the values."""
        keep_spill = "spill" not in request
        spill = request.get("spill")
        if spill is not None and (isinstance(spill, bool) or not isinstance(spill, int)
                                  or not 0 <= spill <= protocol.MAX_INT):
            raise ev.ControlError("bad-request", "spill must be an integer >= 0, or null to turn admission off")
        timeout = _number(request, "timeout") if "timeout" in request else None
        policy = request.get("policy")
        self._apply(lambda now: ev.SetAdmission(now, spill=spill, keep_spill=keep_spill, policy=policy,
                                                timeout=timeout))
        config = self.core.admission
        return {"spill": config.spill, "policy": config.policy, "timeout": config.timeout}

    def _apply(self, make_event) -> None:
        self._feed(make_event(trio.current_time()))

    def status(self) -> dict:
        document = {
            "scheduler": {
                "version": __version__,
                "pid": os.getpid(),
                "started": self._started,
                "socket_dir": str(self.paths.root),
                "defaults": {
                    "mode": self.core.default_mode,
                    "tq": self.core.default_tq,
                    "grace": self.config.grace,
                    "heartbeat_interval": self.config.heartbeat_interval,
                    "heartbeat_timeout": self.config.heartbeat_timeout,
                    "idle_release": self.config.idle_release,
                    "swapping": self.config.swapping,
                    "min_quantum": self.config.min_quantum,
                    "ageing": self.config.ageing,
                },
                "settings": self.core.settings.document(),
                "restarted": self.restarted,
            }
        }
        now = trio.current_time()
        document.update(views.status(self.core, now, self._wall))
        document["admission"] = views.admission_status(self.core, now, self._wall)
        return document

    def events(self, since: int, limit: int) -> dict:
        first = self._next_seq - len(self._events)
        start = max(since, first) - first
        chosen = list(itertools.islice(self._events, start, start + limit))
        following = chosen[-1]["seq"] + 1 if chosen else max(since, first)
        return {"events": chosen, "next": following}


def _raise_descriptor_limit() -> int:
    """Each client costs a connection and a pidfd: lift the soft limit on open files (often
    1024) to the hard limit the administrator allows. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. an unlimited hard limit above the kernel's nr_open
            pass
    return soft


_PEER_CREDENTIALS = struct.Struct("3i")


def _peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The kernel's word on who connected (SO_PEERCRED): pid (0 when the peer's process is not
    visible in our pid namespace), uid, gid."""
    try:
        pid, uid, gid = _PEER_CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size))
    except OSError:
        return PeerCredentials(None, None, 0)
    return PeerCredentials(uid, gid, pid)


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def _fitted(reply: dict) -> bytes:
    """The reply as JSON within CONTROL_REPLY_MAX. A status too large for it (many clients)
    keeps the first devices and clients and says in "truncated" how many it left out, so that
    status always answers; anything else too large is answered too-large."""
    data = json.dumps(reply, separators=(",", ":")).encode()
    if len(data) <= protocol.CONTROL_REPLY_MAX:
        return data
    result = reply.get("result")
    if isinstance(result, dict) and "devices" in result and "clients" in result:
        devices, clients = result["devices"], result["clients"]
        shown = len(devices) + len(clients)
        while shown > 0:
            shown = shown * 3 // 4
            kept_devices = devices[:shown]
            kept_clients = clients[:shown]
            cut = dict(result, devices=kept_devices, clients=kept_clients,
                       truncated={"devices": len(devices) - len(kept_devices),
                                  "clients": len(clients) - len(kept_clients)})
            data = json.dumps(dict(reply, result=cut), separators=(",", ":")).encode()
            if len(data) <= protocol.CONTROL_REPLY_MAX:
                return data
    return json.dumps(_failure("too-large", f"reply of {len(data)} bytes")).encode()


def _failure(code: str, message: str) -> dict:
    return {"v": 1, "ok": False, "error": {"code": code, "message": message}}


def _split_envelope(frames: list[zmq.Frame]) -> tuple[list[bytes], list[zmq.Frame]]:
    """ROUTER framing: routing id, then (from REQ peers) an empty delimiter, then the body."""
    envelope = [frames[0].bytes]
    rest = frames[1:]
    if rest and len(rest[0]) == 0:
        envelope.append(b"")
        rest = rest[1:]
    return envelope, rest


def _number(request: dict, key: str) -> float:
    value = request.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ev.ControlError("bad-request", f"{key} must be a number")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ev.ControlError("bad-request", f"{key} is too large") from None


def _integer(request: dict, key: str, default: int, *, minimum: int, maximum: int = protocol.MAX_INT) -> int:
    value = request.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ev.ControlError("bad-request", f"{key} must be an integer from {minimum} to {maximum}")
    return value


def _setting_target(request: dict) -> tuple[str | None, str | None]:
    """The optional `client` or `pod_uid` a setting is for (neither: the default)."""
    client, pod_uid = request.get("client"), request.get("pod_uid")
    for key, value in (("client", client), ("pod_uid", pod_uid)):
        if value is not None and (not isinstance(value, str) or not value or len(value) > protocol.MAX_VALUE):
            raise ev.ControlError("bad-request", f"{key} must be a non-empty string")
    if client is not None and pod_uid is not None:
        raise ev.ControlError("bad-request", "give client or pod_uid, not both")
    return client, pod_uid


def _device(request: dict, *, required: bool) -> str | None:
    device = request.get("device")
    if device is None and not required:
        return None
    if not isinstance(device, str) or not device:
        raise ev.ControlError("bad-request", "device must be a device id")
    return device
