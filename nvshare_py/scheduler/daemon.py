"""nvshare-scheduler: the Trio shell around the sans-I/O lock core (core.py).

The daemon's rooms (docs/architecture.md):

- config.py: the daemon's settings;
- runtime.py: the socket directories, their checks, the lock file, the descriptor limit;
- logs.py: log lines and their rate limits;
- connections.py: the connection server (accept, read, write, close over zmtp.py's parser),
  with fairness.py (turns and a CPU share per principal);
- control.py: the control protocol, an op table, on the control and status sockets (public.py:
  what every user may see);
- quotas.py: what one principal's registrations may make the core keep;
- eventring.py: the lock timeline, served in pages to `events` requests;
- metrics.py, labels.py, metrics_http.py: Prometheus metrics;
- this module: the pump, the translation of client messages into core events, and the wiring.

One nursery holds every task:

- the client connection server takes connections on the client socket (after checking that
  there is room for them, docs/scheduler.md) and hands each message to `_on_client_message`,
  which turns it into a core event;
- the timer sends the core `Tick` when its next deadline comes;
- the control server answers nvsharectl on the control socket (control.py; only root and the
  daemon's user reach it), and the status server every local user's read-only `status` and
  `events` on the status socket (public.py says what they see), over the same connection
  server;
- one pid watcher per client that holds or waits (for a lock or for admission) and whose
  process is visible: it sleeps on a pidfd and reports the process's exit, so a crashed
  holder's lock moves on at once even when a forked child keeps its connection open;
- a claims task for each HELLO with more claims than the core handles in one step
  (core.CLAIMS_PER_STEP): it feeds the next piece in a turn of the client's principal;
- the signal task turns SIGTERM/SIGINT into a clean shutdown;
- with --metrics, the metrics server answers Prometheus scrapes from a snapshot
  (metrics_http.py); `_carry_out` hands the metrics observer (metrics.py) every event and its
  actions.

All of them feed the core through one function, `_feed`, which carries out the actions the
core returns (sends, timeline entries, logs, forgetting clients) and moves the timer: the one
place to observe what the scheduler does. It never awaits, so events are applied one at a
time. Nothing here blocks and there are no threads; the daemon does not use libzmq at all.

About 650 lines: the pump and the translation table are one room on purpose (every event and
every action passes `_feed` and `_carry_out`), and the pid watchers are a few lines each beside
the registrations they follow.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Hashable

import trio

if sys.version_info < (3, 11):  # the builtin arrived in 3.11; trio brings the backport before
    from exceptiongroup import BaseExceptionGroup

from .. import __version__, protocol
from ..paths import SocketPaths, check_socket_path
from . import runtime, views, zmtp
from . import events as ev
from .config import DaemonConfig
from .connections import ByteBudget, Connection, ConnectionLimits, ConnectionServer, Door, listen_unix
from . import control
from .control import ControlProtocol, JsonObject
from .core import SchedulerCore
from .eventring import EventRing
from .measure import measure_devices
from .podcgroup import process_start_time
from .logs import LOG_LEVELS, RateLimit, emit, log, note
from .metrics import SchedulerMetrics
from .metrics_http import CONNECTIONS_MAX as METRICS_CONNECTIONS
from .metrics_http import MetricsServer, Snapshot, bind_metrics
from .fairness import Turns
from .quotas import DeviceQuota
from .runtime import CoreFailure, StartupError

# DaemonConfig, CoreFailure and StartupError are the daemon's interface (cli.py, tests).
__all__ = ["CoreFailure", "Daemon", "DaemonConfig", "StartupError"]

# A client connection is closed when one message (all its frames) is larger than this; between
# the protocol's limit and this, a message is answered (ERROR too-large).
CLIENT_WIRE_MAX = 4 * protocol.MAX_MESSAGE
# Client connections of one uid over all its pods, at least (a principal's, a uid's processes in
# one pod or outside pods, are `--max-clients-per-user`); connections.ConnectionLimits.sharing
# caps them at an eighth and a quarter of all places.
CLIENT_CONNECTIONS_PER_UID = 256
# Bytes the client connections of one principal may hold (unparsed input, unsent output), and
# all of them together.
CLIENT_BYTES_PER_PRINCIPAL = 1024 * 1024
CLIENT_BYTES = 64 * 1024 * 1024
# A client connection without a registration (before HELLO, after BYE or a heartbeat timeout,
# or one that only sends QUERY) is closed after this long without a message.
CLIENT_IDLE_TIMEOUT = 120.0
# Lock events after which a client's process is watched through a pidfd: it holds or waits.
_WATCHED_FROM = frozenset({"acquire", "grant", "admit-wait"})


def _connection(client: ev.ClientKey) -> int:
    """The connection of a registration: the key the daemon gives the core for each client is
    its connection's number (opaque to the core)."""
    assert isinstance(client, int), client
    return client


def client_limits(nofile: int, per_principal: int) -> ConnectionLimits:
    """The client socket's limits under the descriptor limit `nofile`, after what the other
    sockets' connections may need, with `per_principal` client processes per user or pod."""
    others = control.CONTROL_LIMITS.total + control.STATUS_LIMITS.total + METRICS_CONNECTIONS
    total = runtime.client_connections(nofile, others)
    return ConnectionLimits.sharing(total, per_principal, max(per_principal, CLIENT_CONNECTIONS_PER_UID))


@functools.lru_cache(maxsize=64)
def refused_client_message(reason: str) -> bytes:
    """What a client connection refused for want of places is told before it is closed: the
    handshake, then `ERROR code=too-many-connections` with the reason (a refused peer connects
    again and again: the few reasons are encoded once)."""
    error = protocol.Error(code="too-many-connections", detail=reason[:200])
    return zmtp.HANDSHAKE + zmtp.frame(error.encode())


class Daemon:
    """Use: `daemon.open()` (synchronous; raises StartupError), `trio.run(daemon.serve)`,
    then `daemon.close()`."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.paths = SocketPaths.resolve(config.socket_dir)
        self.restarted = False  # a previous daemon's client socket was found: clients may come back
        self.core: SchedulerCore  # made by serve(), which everything below runs in
        self._lock_fd: int | None = None
        self._listener: socket.socket | None = None
        self._control_listener: socket.socket | None = None
        self._status_listener: socket.socket | None = None
        self._nursery: trio.Nursery  # serve()'s
        self._timer: trio.CancelScope | None = None
        self._stopping = False
        self.limits = client_limits(runtime.descriptor_limit(), config.max_clients_per_user)
        self._clients: ConnectionServer  # made by serve()
        self._turns = Turns(on_throttled=self._throttled)
        self._quota = DeviceQuota()
        self._keys: dict[str, ev.ClientKey] = {}  # display id of each registration -> its connection
        self._cids: dict[ev.ClientKey, str] = {}  # and back
        self._watchers: dict[ev.ClientKey, _Watch] = {}
        self._timeline = EventRing()
        self._started = 0.0
        self._wall_offset = 0.0
        self._uid = os.geteuid()
        self._pid_namespace = runtime.pid_namespace()
        self._bad_input_log = RateLimit()
        self._resource_log = RateLimit()
        self._query_fail_log = RateLimit()
        self._throttle_log = RateLimit()
        self._metrics: SchedulerMetrics | None = None
        self._metrics_sockets: list[socket.socket] = []
        # The core's lines: most are caused by clients (registrations, drops, ...).
        self._core_log = RateLimit(rate=20.0, burst=200.0)

    # --- setup and teardown ----------------------------------------------------------------

    def open(self) -> None:
        paths = self.paths
        for path in (paths.client_socket, paths.control_socket, paths.status_socket):
            try:
                check_socket_path(path)
            except ValueError as exc:
                raise StartupError(f"{exc}: choose a shorter --socket-dir") from None
        self.limits = client_limits(runtime.raise_descriptor_limit(), self.config.max_clients_per_user)
        asked = self.config.max_clients_per_user
        if asked != DaemonConfig.max_clients_per_user and self.limits.per_principal < asked:
            emit(logging.WARNING, "fewer client processes per user or pod than asked: an eighth of the connections "
                 "this daemon serves (raise its descriptor limit for more)", asked=asked,
                 serves=self.limits.per_principal, max_connections=self.limits.total)
        if self.config.metrics is not None:
            try:
                self._metrics_sockets = bind_metrics(self.config.metrics)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics on {self.config.metrics}: {exc.strerror or exc}") from None
        try:
            runtime.prepare_directories(paths, self._uid)
            self._lock_fd = runtime.take_lock(paths)
            self.restarted = runtime.previous_daemon_left_clients(paths)
            self._listener = listen_unix(paths.client_socket, 0o666)
            self._control_listener = listen_unix(paths.control_socket, 0o600)
            self._status_listener = listen_unix(paths.status_socket, 0o666)
        except OSError as exc:
            self.close()
            raise StartupError(f"cannot set up {paths.root}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the sockets (their files stay, see connections.listen_unix) and release the
        lock file."""
        for listener in (self._listener, self._control_listener, self._status_listener):
            if listener is not None:
                listener.close()
        self._listener = self._control_listener = self._status_listener = None
        for sock in self._metrics_sockets:
            sock.close()
        self._metrics_sockets = []
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- the Trio part ---------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until SIGTERM/SIGINT. Raises CoreFailure when the lock core failed on an
        event (see `_feed`)."""
        config = self.config
        listener, control_listener, status_listener = self._listener, self._control_listener, self._status_listener
        if listener is None or control_listener is None or status_listener is None:
            raise RuntimeError("serve() before open()")
        self.core = SchedulerCore(config.core_config(self.restarted), trio.current_time())
        self._feed_measurements()
        self._started = time.time()
        # One offset for the daemon's life: converting each time with a fresh time.time() would
        # let two events of one instant come out in the wrong order.
        self._wall_offset = self._started - trio.current_time()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self._stop_on_signal, nursery.cancel_scope)
                nursery.start_soon(self._run_timer)
                self._clients = ConnectionServer(
                    "client", listener, self.limits, CLIENT_WIRE_MAX, self._on_client_message,
                    self._on_client_closed, turns=self._turns,
                    budget=ByteBudget(CLIENT_BYTES_PER_PRINCIPAL, CLIENT_BYTES), idle_timeout=CLIENT_IDLE_TIMEOUT,
                    stays_idle=self._registered, refused_message=refused_client_message)
                nursery.start_soon(self._clients.serve)
                now = trio.current_time
                controlling = ControlProtocol(self, control.OPS, control.controller(self._uid, self._pid_namespace), now)
                nursery.start_soon(control.control_server(control_listener, controlling, self._turns).serve)
                reading = ControlProtocol(self, control.read_only_ops(control.StatusCache(self, now)),
                                          control.local_user(self._pid_namespace), now, "status request refused")
                nursery.start_soon(control.status_server(status_listener, reading, self._turns).serve)
                if self._metrics_sockets:
                    metrics = self._metrics = SchedulerMetrics(restarted=self.restarted, started=self._started)
                    snapshot = Snapshot(lambda: metrics.render_in_steps(self.status()))
                    nursery.start_soon(MetricsServer(self._metrics_sockets, snapshot).serve)
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
                    max_connections_per_principal=self.limits.per_principal,
                    max_connections_per_uid=self.limits.per_uid,
                )
                # What exists now (modules, classes, the metrics registry) lives as long as the
                # daemon: out of the cyclic collector's sight, a full collection walks only what
                # serving made, a millisecond or two instead of the 20-40 ms that stalled every
                # client under a flood of HELLOs (benchmarks/profile_reclaim.py).
                gc.freeze()
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

    def _feed_measurements(self) -> None:
        """The node's GPUs as the daemon measures them (measure.py): with the operator's
        budgets, the only figures that size a device."""
        devices, unavailable = measure_devices()
        if unavailable is not None:
            emit(logging.WARNING, "cannot measure the GPUs: their sizes are unknown until set-budget sets them",
                 reason=unavailable)
        for device in devices:
            self._feed(ev.DeviceMeasured(trio.current_time(), device.uuid, device.total, device.name))

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
        request the core refuses (ControlError) changes nothing and is not a failure. Whoever
        fed the event (a client message, a control request, the timer, a pid watcher) lets
        CoreFailure through, so it ends the nursery and `serve`."""
        try:
            actions = self.core.handle(event)
        except ev.ControlError:
            raise
        except Exception as exc:
            log.critical("the lock core failed on %r; exiting so that restart recovery rebuilds the "
                         "lock table", event, exc_info=True)
            self._stopping = True  # nothing more is fed to it, not even the closing connections
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
        # Messages first: a GRANT is on the waiter's handoff path, the bookkeeping is not. Each
        # connection's messages go out in one write (a HELLO claiming 64 devices is answered
        # with over a hundred).
        outgoing: dict[ev.ClientKey, list[bytes]] = {}
        for action in actions:
            if type(action) is ev.Send:
                data = self._encode(action.client, action.message)
                if data is not None:
                    outgoing.setdefault(action.client, []).append(zmtp.frame(data))
        for key, frames in outgoing.items():
            self._write(key, b"".join(frames))
        if self._metrics is not None:
            self._metrics.observe(event, actions)
        for action in actions:
            if isinstance(action, ev.LockEvent):
                self._record(action)
                if action.kind in _WATCHED_FROM:
                    self._watch(action.client)
            elif isinstance(action, ev.Log):
                # Nearly every line the core writes is caused by some client: rate-limited.
                level = LOG_LEVELS.get(action.level, logging.INFO)
                if not log.isEnabledFor(level):
                    continue
                suppressed = self._core_log.take()
                if suppressed is not None:
                    fields = dict(action.fields, suppressed=suppressed) if suppressed else action.fields
                    emit(level, views.describe(action), **fields)
            elif isinstance(action, ev.Forget):
                self._forget(action.client)
            elif isinstance(action, ev.ClaimsLeft):
                self._nursery.start_soon(self._handle_claims, action.client)

    def _send(self, client: ev.ClientKey, message: protocol.Message) -> None:
        data = self._encode(client, message)
        if data is not None:
            self._write(client, zmtp.frame(data))

    def _write(self, client: ev.ClientKey, data: bytes) -> None:
        self._clients.send(_connection(client), data)

    def _encode(self, client: ev.ClientKey, message: protocol.Message) -> bytes | None:
        """`message` for the registration `client`; None when its connection is gone (its
        Unregister is on its way or done) or the message cannot be encoded."""
        if _connection(client) not in self._clients.connections:
            return None
        try:
            return message.encode()
        except ValueError as exc:
            log.error("cannot encode %s for a client: %s", message.TYPE, exc)
            return None

    def _record(self, event: ev.LockEvent) -> None:
        """Timeline entry for `nvsharectl events`. Not logged: the core's Log actions already
        describe each of these in words."""
        self._timeline.record(self._wall(event.now), event.device, event.client, event.kind, event.grant, event.detail)

    # --- client messages ----------------------------------------------------------------------

    def _throttled(self, principal: Hashable) -> None:
        if isinstance(principal, Door):
            note("accepting connections slowed down: over its share of the daemon's time", self._throttle_log,
                 socket=principal.server)
            return
        uid, pod = principal if isinstance(principal, tuple) else (principal, "")
        note("connections slowed down: over their share of the daemon's time", self._throttle_log, uid=uid,
             **({"pod_uid": pod} if pod else {}))

    def _registered(self, connection: Connection) -> bool:
        return self.core.client_id(connection.key) is not None

    def _on_client_closed(self, connection: Connection) -> None:
        if not self._stopping and self.core.client_id(connection.key) is not None:
            self._feed(ev.Unregister(trio.current_time(), connection.key, "disconnected"))

    def _feed_client(self, connection: Connection, event: ev.Event) -> None:
        """Feed an event of a registered client, unless the devices it names would take its
        principal past its quota (quotas.py): then it is answered ERROR and not fed."""
        device = getattr(event, "device", None)
        if device is not None:
            refusal = self._quota.admit(connection.key, connection.principal, (device,))
            if refusal is not None:
                self._reject(connection.key, "bad-field", refusal)
                return
        self._feed(event)

    def _on_client_message(self, connection: Connection, frames: tuple[bytes, ...]) -> None:
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
        if isinstance(message, protocol.Query):
            self._answer_query(connection, now)
            return
        registered = self.core.client_id(key) is not None
        if isinstance(message, protocol.Hello):
            if registered:
                self._reject(key, "already-registered", "this connection is registered already", "HELLO")
            else:
                self._register(now, connection, message)
            return
        if not registered:
            self._reject(key, "not-registered", "send HELLO first", message.TYPE)
            return
        # A newer client's word is acted on all the same (events.from_client says how).
        for key_name, word in protocol.unknown_words(message):
            note("client message with a word this scheduler does not know", self._bad_input_log,
                 type=message.TYPE, key=key_name, word=word)
        self._feed_client(connection, ev.from_client(now, key, message))

    async def _handle_claims(self, key: ev.ClientKey) -> None:
        """Feed the core the next piece of a HELLO's claims (core.CLAIMS_PER_STEP) in a turn of
        the connection's principal: other users' messages go between the pieces, and the
        pieces are charged to the user who sent the claims."""
        connection = self._clients.connections.get(_connection(key))
        if connection is None:
            return  # closed: its registration's claims end with it
        task = trio.lowlevel.current_task()
        self._turns.own(task, connection.principal)
        try:
            turn = await self._turns.take(connection.principal)
            try:
                if not self._stopping and _connection(key) in self._clients.connections:
                    self._feed(ev.HandleClaims(trio.current_time(), key))
            finally:
                turn.release()
        finally:
            self._turns.disown(task)

    def _answer_query(self, connection: Connection, now: float) -> None:
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
        note("rejected client message", self._bad_input_log, code=code, detail=detail, type=msg_type)
        # Keep the answer encodable whatever the peer sent (no control characters).
        detail = "".join(c if c.isprintable() else "?" for c in detail)[:200]
        msg_type = msg_type if msg_type.isalpha() else ""
        self._send(key, protocol.Error(code=code, detail=detail, type=msg_type))

    def _register(self, now: float, connection: Connection, hello: protocol.Hello) -> None:
        peer = connection.credentials
        info = ev.ClientInfo(
            pid=hello.pid,
            session=hello.session,
            host_pid=peer.pid,
            uid=peer.uid,
            user=views.user_name(peer.uid),
            host=hello.host,
            container=hello.container,
            pod=hello.pod,
            namespace=hello.namespace,
            program=hello.program,
            # The kernel's pid, never the pod the client names: per-pod settings match on this.
            pod_uid=connection.principal[1],
            host_start=process_start_time(peer.pid),
        )
        key = connection.key
        refusal = self._quota.admit(key, connection.principal, {*hello.held, *hello.wanted})
        if refusal is not None:
            self._reject(key, "bad-field", refusal, "HELLO")
            return
        self._feed(ev.Register(now, key, info, hello.held, hello.wanted, hello.gang, hello.gang_size))
        cid = self.core.client_id(key)
        if cid is None:
            self._quota.forget(key)  # refused
        else:
            self._keys[cid] = key
            self._cids[key] = cid

    # --- process exit through pidfds --------------------------------------------------------

    def _watch(self, cid: str) -> None:
        """Watch the process of registration `cid` through a pidfd, from the first time it
        holds or waits (a process that only registered costs no descriptor) until the
        registration ends (Forget), which at the latest is when its connection closes."""
        key = self._keys.get(cid)
        if key is None or key in self._watchers:
            return
        connection = self._clients.connections.get(_connection(key))
        if connection is None or not connection.credentials.pid:
            return  # gone (its Unregister is on its way), or not visible: heartbeats tell
        pid = connection.credentials.pid
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            # Gone between its message and now.
            self._feed(ev.Unregister(trio.current_time(), key, "exited"))
            return
        except OSError as exc:
            note("cannot watch client process; relying on heartbeats", self._resource_log,
                 pid=pid, error=exc.strerror)
            return
        watch = self._watchers[key] = _Watch(pidfd, connection.principal)
        self._nursery.start_soon(self._watch_pidfd, key, watch)

    async def _watch_pidfd(self, key: ev.ClientKey, watch: "_Watch") -> None:
        if watch.closed:
            return  # the registration ended before this task first ran: its number may be reused
        try:
            await trio.lowlevel.wait_readable(watch.pidfd)
        except trio.ClosedResourceError:
            return  # the registration ended first (_forget closed it)
        # Its user's work, as when its connection closes: in its turn (which its user gets also
        # when its last connection ended meanwhile).
        turn = await self._turns.take(watch.principal)
        try:
            if watch.closed:
                return  # its connection's end came first
            self._forget_pidfd(key)
            self._feed(ev.Unregister(trio.current_time(), key, "exited"))
        finally:
            turn.release()

    def _forget(self, key: ev.ClientKey) -> None:
        """A registration ended: its pidfd is closed now, its quota freed, and its connection,
        if still open, may stay silent no longer."""
        self._forget_pidfd(key)
        self._quota.forget(key)
        cid = self._cids.pop(key, None)
        if cid is not None:
            del self._keys[cid]
        if not self._stopping:
            self._clients.restart_idle(_connection(key))

    def _forget_pidfd(self, key: ev.ClientKey) -> None:
        watch = self._watchers.pop(key, None)
        if watch is not None:
            watch.closed = True
            trio.lowlevel.notify_closing(watch.pidfd)
            os.close(watch.pidfd)

    # --- what the control protocol asks of the daemon (control.Host) ------------------------

    def apply(self, event: ev.Event) -> None:
        self._feed(event)

    def admission_settings(self) -> JsonObject:
        config = self.core.admission
        return {"spill": config.spill, "policy": config.policy, "timeout": config.timeout, "share": config.share}

    def status(self) -> JsonObject:
        document: JsonObject = {
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
        document["refused"] = views.refused_status(self._clients.refusals.current(now), self._wall)
        return document

    def events(self, since: int, limit: int) -> control.Encoded:
        return control.Encoded(self._timeline.page(since, limit).json())


class _Watch:
    """A pidfd being watched, for a connection of `principal`; `closed` once the daemon closed
    it (its task must not wait on the number then, which a new descriptor may have taken)."""

    __slots__ = ("pidfd", "principal", "closed")

    def __init__(self, pidfd: int, principal: Hashable) -> None:
        self.pidfd = pidfd
        self.principal = principal
        self.closed = False


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group
