"""nvshare-scheduler: the Trio + pyzmq shell around the sans-I/O lock core (core.py).

One nursery holds every task:

- the client pump owns the client ROUTER. It is the only place where events are fed to the
  core: it reads every waiting message, turns each into a core event, carries out the
  actions the core returns (sends, timeline entries, logs, forgetting clients) and sleeps until
  the next message or `core.next_deadline()`, whichever comes first;
- the control task owns the control ROUTER and answers nvsharectl. Requests that change the
  scheduler are handed to the pump through `_inbox` and the pump is woken by cancelling its
  wait; reads (status, events) need no hand-off because everything runs on one thread;
- one pid watcher per registered client whose process is visible: it sleeps on a pidfd and
  tells the pump when that process exits, so a crashed holder's lock moves on at once;
- the signal task turns SIGTERM/SIGINT into a clean shutdown.
- with --metrics, the metrics task answers Prometheus scrapes (metrics.py); the pump hands the
  metrics observer every event and its actions.

Nothing here blocks and there are no threads (libzmq's own I/O thread aside).
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import json
import logging
import math
import os
import resource
import signal
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable

import trio
import zmq

from .. import __version__, protocol
from ..paths import SocketPaths, check_socket_path
from . import events as ev
from .core import CoreConfig, SchedulerCore
from .metrics import SchedulerMetrics, bind_metrics, parse_address, serve_metrics
from .zmqtrio import bind_router, peer_credentials, recv_nowait, wait_readable

log = logging.getLogger("nvshare.scheduler")

EVENTS_DEFAULT_LIMIT = 1000
# libzmq drops the connection of a peer whose single message is larger than these. Between
# the protocol's limit and these, a message is answered (ERROR too-large / "too-large").
CLIENT_WIRE_MAX = 64 * 1024
CONTROL_WIRE_MAX = 1024 * 1024
# Messages handled before the pump lets the other tasks run (fairness under a flood).
PUMP_BATCH = 64
# Seconds before a Tick is given again for a deadline that the last one should have handled
# (the core failed on it): often enough to recover, rarely enough not to spin or flood the log.
FAILED_TICK_RETRY = 1.0


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
    metrics: str | None = None  # HOST:PORT or :PORT to serve Prometheus metrics on; None: off

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
        )


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


class ControlError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_INTERNAL_ERROR = "the scheduler failed on this request; see its log"


class _Pending:
    """A control request's event waiting for the pump: the core's answer comes back here."""

    __slots__ = ("make_event", "done", "error")

    def __init__(self, make_event: Callable[[float], ev.Event]) -> None:
        self.make_event = make_event
        self.done = trio.Event()
        self.error: ev.CoreError | None = None


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
        self._clients: zmq.Socket | None = None
        self._control: zmq.Socket | None = None
        self._nursery: trio.Nursery | None = None
        self._inbox: collections.deque[_Pending] = collections.deque()
        self._pump_wait: trio.CancelScope | None = None
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
        self._send_fail_log = RateLimit()
        self._metrics: SchedulerMetrics | None = None
        self._metrics_sockets: list = []

    # --- setup and teardown ----------------------------------------------------------------

    def open(self) -> None:
        paths = self.paths
        for path in (paths.client_socket, paths.control_socket):
            try:
                check_socket_path(path)
            except ValueError as exc:
                raise StartupError(f"{exc}: choose a shorter --socket-dir") from None
        _raise_descriptor_limit()
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
            self._clients = bind_router(self._context, paths.client_socket, 0o666, max_message=CLIENT_WIRE_MAX)
            self._control = bind_router(self._context, paths.control_socket, 0o600, max_message=CONTROL_WIRE_MAX)
        except OSError as exc:
            self.close()
            raise StartupError(f"cannot set up {paths.root}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the sockets (their files stay, see zmqtrio) and release the lock file."""
        for sock in (self._clients, self._control):
            if sock is not None:
                sock.close(linger=0)
        self._clients = self._control = None
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
        owner = paths.root.stat().st_uid
        if owner not in (0, self._uid):
            raise StartupError(
                f"{paths.root} belongs to uid {owner}, neither this daemon's uid {self._uid} nor root, "
                "so that user could replace the sockets in it: choose another --socket-dir"
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
        config = self.config
        self.core = SchedulerCore(config.core_config(self.restarted), trio.current_time())
        self._started = time.time()
        # One offset for the daemon's life: converting each time with a fresh time.time() would
        # let two events of one instant come out in the wrong order.
        self._wall_offset = self._started - trio.current_time()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self._stop_on_signal, nursery.cancel_scope)
            nursery.start_soon(self._serve_clients)
            nursery.start_soon(self._serve_control)
            if self._metrics_sockets:
                self._metrics = SchedulerMetrics(restarted=self.restarted, started=self._started)
                nursery.start_soon(serve_metrics, self._metrics_sockets, lambda: self._metrics.render_in_steps(self.status()))
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
            )
            task_status.started()
        emit(logging.INFO, "stopped")

    async def _stop_on_signal(self, scope: trio.CancelScope, *, task_status: trio.TaskStatus) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                emit(logging.INFO, "stopping", signal=signal.Signals(signum).name)
                scope.cancel()
                return

    def _wall(self, monotonic: float) -> float:
        return monotonic + self._wall_offset

    # --- the client pump -------------------------------------------------------------------

    async def _serve_clients(self) -> None:
        sock = self._clients
        core = self.core
        last_tick = -math.inf
        while True:
            handled = 0
            while handled < PUMP_BATCH:
                frames = recv_nowait(sock)
                if frames is None:
                    break
                self._on_client_message(frames)
                handled += 1
            while self._inbox:
                self._run_pending(self._inbox.popleft())
            now = trio.current_time()
            deadline = core.next_deadline()
            if deadline is not None and deadline <= now:
                # After Tick(t) the core's deadlines lie after t; one at or before t means it
                # failed on that Tick (logged by _feed).
                if deadline > last_tick or now >= last_tick + FAILED_TICK_RETRY:
                    last_tick = now
                    self._feed(ev.Tick(now))
                    continue
                deadline = last_tick + FAILED_TICK_RETRY
            if handled == PUMP_BATCH:
                await trio.lowlevel.checkpoint()
                continue
            # wait_readable looks at EVENTS before sleeping: a send may have consumed the
            # descriptor's edge.
            with trio.move_on_at(math.inf if deadline is None else deadline) as wait:
                self._pump_wait = wait
                await wait_readable(sock)
            self._pump_wait = None

    def _wake_pump(self) -> None:
        if self._pump_wait is not None:
            self._pump_wait.cancel()

    def _post(self, make_event: Callable[[float], ev.Event]) -> _Pending:
        """Hand an event to the pump (from another task); it is stamped when fed."""
        pending = _Pending(make_event)
        self._inbox.append(pending)
        self._wake_pump()
        return pending

    def _run_pending(self, pending: _Pending) -> None:
        """Feed a handed-over event; the core's refusal (or failure) goes back to the poster."""
        event = pending.make_event(trio.current_time())
        try:
            actions = self.core.handle(event)
        except ev.CoreError as exc:
            pending.error = exc
        except Exception:
            log.exception("core failed on %r", event)
            pending.error = ev.CoreError("internal", _INTERNAL_ERROR)
        else:
            self._carry_out(event, actions)
        pending.done.set()

    def _feed(self, event: ev.Event) -> None:
        """Give the core one event and carry out its actions. A failing core is logged, not
        fatal: one bad event must not take every client's scheduler down."""
        try:
            actions = self.core.handle(event)
        except Exception:
            log.exception("core failed on %r", event)
            return
        self._carry_out(event, actions)

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
                emit(_LOG_LEVELS.get(action.level, logging.INFO), action.text, **action.fields)
            elif kind is ev.Forget:
                self._forget(action.client)

    def _send(self, key: ev.ClientKey, message: protocol.Message) -> None:
        try:
            data = message.encode()
        except ValueError as exc:
            log.error("cannot encode %s for a client: %s", message.TYPE, exc)
            return
        try:
            self._clients.send_multipart((key, data), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the connection is gone (its owner's exit or timeout will follow);
            # EAGAIN: the peer does not read and its queue is full.
            suppressed = self._send_fail_log.take()
            if suppressed is not None:
                emit(logging.INFO, "send failed", type=message.TYPE, error=exc.strerror, suppressed=suppressed)

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

    def _on_client_message(self, frames: list[zmq.Frame]) -> None:
        key = frames[0].bytes
        if len(frames) != 2:
            self._reject(key, "malformed", f"{len(frames) - 1} frames; a message is one frame")
            return
        frame = frames[1]
        try:
            message = protocol.decode(frame.bytes)
        except protocol.ProtocolError as exc:
            self._reject(key, exc.code, exc.detail, exc.msg_type)
            return
        now = trio.current_time()
        kind = type(message)
        if kind is protocol.Query:
            self._answer_query(key, frame, now)
            return
        registered = self.core.client_id(key) is not None
        if kind is protocol.Hello:
            if registered:
                self._reject(key, "already-registered", "this connection is registered already", "HELLO")
            else:
                self._register(now, key, message, frame)
            return
        if not registered:
            self._reject(key, "not-registered", "send HELLO first", message.TYPE)
            return
        if kind is protocol.Acquire:
            event = ev.Acquire(now, key, message.device)
        elif kind is protocol.Release:
            event = ev.Release(now, key, message.device, message.grant, message.reason)
        elif kind is protocol.Heartbeat:
            event = ev.Heartbeat(now, key)
        elif kind is protocol.Memory:
            event = ev.MemoryReport(now, key, message.device, message.used)
        elif kind is protocol.Device:
            event = ev.DeviceInfo(now, key, message.device, message.total, message.name)
        elif kind is protocol.Bye:
            event = ev.Unregister(now, key, "bye")
        else:  # the codec only returns client messages
            raise AssertionError(f"unexpected message {kind.__name__}")
        self._feed(event)

    def _answer_query(self, key: bytes, frame: zmq.Frame, now: float) -> None:
        # Matched by the kernel-verified pid, never by anything the peer says. Any local user
        # may ask: a failure is logged, not fatal, as for events (see _feed).
        try:
            answer = protocol.Status.of(self.core.query(peer_credentials(frame).pid, now))
        except Exception:
            log.exception("cannot answer a QUERY")
            return
        self._send(key, answer)

    def _reject(self, key: bytes, code: str, detail: str, msg_type: str = "") -> None:
        if self._metrics is not None:
            self._metrics.rejected_message(code)
        suppressed = self._bad_input_log.take()
        if suppressed is not None:
            emit(logging.INFO, "rejected client message", code=code, detail=detail, type=msg_type, suppressed=suppressed)
        # Keep the answer encodable whatever the peer sent (no control characters).
        detail = "".join(c if c.isprintable() else "?" for c in detail)[:200]
        msg_type = msg_type if msg_type.isalpha() else ""
        self._send(key, protocol.Error(code=code, detail=detail, type=msg_type))

    def _register(self, now: float, key: bytes, hello: protocol.Hello, frame: zmq.Frame) -> None:
        peer = peer_credentials(frame)
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
        )
        self._feed(ev.Register(now, key, info, hello.held, hello.wanted))
        if peer.pid and self.core.client_id(key) is not None:
            self._watch_process(key, peer.pid)

    # --- process exit through pidfds --------------------------------------------------------

    def _watch_process(self, key: ev.ClientKey, pid: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            # Gone between its HELLO and now.
            self._feed(ev.Unregister(trio.current_time(), key, "exited"))
            return
        except OSError as exc:
            emit(logging.WARNING, "cannot watch client process; relying on heartbeats", pid=pid, error=exc.strerror)
            return
        scope = trio.CancelScope()
        self._watchers[key] = scope
        self._nursery.start_soon(self._watch_pidfd, key, pidfd, scope)

    async def _watch_pidfd(self, key: ev.ClientKey, pidfd: int, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await trio.lowlevel.wait_readable(pidfd)
                self._watchers.pop(key, None)
                self._post(lambda now: ev.Unregister(now, key, "exited"))
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
                data = json.dumps(reply, separators=(",", ":")).encode()
                if len(data) > protocol.CONTROL_REPLY_MAX:
                    data = json.dumps(_failure("too-large", f"reply of {len(data)} bytes")).encode()
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
                raise ControlError("bad-request", 'a request is a JSON object with "v": 1')
            result = await self._control_op(request)
        except (ControlError, ev.CoreError) as exc:
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
        # The core judges the values of settings (CoreError bad-request) before changing anything.
        if op == "set-tq":
            seconds = _number(request, "seconds")
            device = _device(request, required=False)
            await self._apply(lambda now: ev.SetQuantum(now, seconds, device))
            return {"device": device, "tq": seconds}
        if op == "set-mode":
            mode = request.get("mode")
            device = _device(request, required=False)
            await self._apply(lambda now: ev.SetMode(now, mode, device))
            return {"device": device, "mode": mode}
        if op == "set-budget":
            budget = request.get("bytes")
            if budget is not None and (
                isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= protocol.MAX_INT
            ):
                raise ControlError("bad-request", "bytes must be an integer > 0, or null for the device's total")
            device = _device(request, required=True)
            await self._apply(lambda now: ev.SetBudget(now, device, budget))
            return {"device": device, "budget": budget}
        raise ControlError("unknown-op", f"unknown op {op!r}")

    async def _apply(self, make_event: Callable[[float], ev.Event]) -> None:
        pending = self._post(make_event)
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error

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
                    "heartbeat_timeout": self.config.heartbeat_timeout,
                    "idle_release": self.config.idle_release,
                },
                "restarted": self.restarted,
            }
        }
        document.update(self.core.status(trio.current_time(), self._wall))
        return document

    def events(self, since: int, limit: int) -> dict:
        first = self._next_seq - len(self._events)
        start = max(since, first) - first
        chosen = list(itertools.islice(self._events, start, start + limit))
        following = chosen[-1]["seq"] + 1 if chosen else max(since, first)
        return {"events": chosen, "next": following}


def _raise_descriptor_limit() -> None:
    """Each client costs a connection and a pidfd: lift the soft limit on open files (often
    1024) to the hard limit the administrator allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


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
        raise ControlError("bad-request", f"{key} must be a number")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ControlError("bad-request", f"{key} is too large") from None


def _integer(request: dict, key: str, default: int, *, minimum: int, maximum: int = protocol.MAX_INT) -> int:
    value = request.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ControlError("bad-request", f"{key} must be an integer from {minimum} to {maximum}")
    return value


def _device(request: dict, *, required: bool) -> str | None:
    device = request.get("device")
    if device is None and not required:
        return None
    if not isinstance(device, str) or not device:
        raise ControlError("bad-request", "device must be a device id")
    return device
