"""A cooperating program's side of the client protocol (docs/protocol.md).

    from nvshare_py.client import Client

    with Client() as client:                      # HELLO/WELCOME; SchedulerUnavailable if none
        client.announce("GPU-…", total=80 << 30)  # DEVICE
        with client.hold("GPU-…") as grant:       # ACQUIRE ... GRANT ... RELEASE
            run_gpu_work()

What the program is told:
- `on_drop(device, grant)`: the scheduler wants the lock back (time quantum over, mode or
  memory change). Drain your GPU work and call `release(device)` within the grace period. The
  default releases at once.
- `on_revoke(device, grant, reason)`: the grant is void (grace expired, a conflict, or the
  scheduler lost this client's registration: reason `lost`). The library already considers
  the device released; call `acquire` again if you still need it.
- `on_contended(device, grant, quantum_left)`: others wait for the device; the quantum of
  this grant ends in `quantum_left` seconds, then a DROP follows. A program that keeps a long
  queue of GPU work may drain it ahead of time and `release(device, reason="quantum")`, so
  that the lock changes hands when the quantum ends instead of a drain later. The default
  does nothing.
- `on_mode(device, mode, quantum)`: the device's mode or time quantum changed.
Callbacks run on the client's I/O thread: keep them short, and never wait in them for the
scheduler (no acquire()).

When the scheduler restarts, the connection comes back by itself and the client registers
again with `held` (devices whose grant it still has) and `wanted` (devices it waits for), then
repeats its DEVICE and MEMORY reports: a holder keeps its lock, a waiter its place.

After `os.fork()` the child must not touch the parent's connection: every Client that exists
at the fork is unusable in the child (RuntimeError); create a new one there.

Threads. ZeroMQ sockets are not thread-safe, so every call on the DEALER socket is made under
`_io_lock`, which nobody holds while blocking. Sending needs nothing else: API methods send
their ACQUIRE/RELEASE themselves, without waking another thread. Receiving is a role, the
*reader* (`_reader`, a try-lock): its holder drains the monitor and the socket and dispatches
what arrived. A background I/O thread holds the role by default, sends heartbeats and memory
reports and runs callbacks; but a thread blocked in acquire() takes the role while it waits,
so the GRANT wakes it directly rather than waking the I/O thread that would then wake it
(one thread switch and one GIL hand-over less on the lock handoff path). The lock state is
shared under `_cond`; when both are needed, `_cond` is taken before `_io_lock`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import re
import select
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import protocol, vocabulary
from .paths import SocketPaths

log = logging.getLogger("nvshare.client")

# docs/protocol.md: MEMORY reports are coalesced to at most one per device every 100 ms.
MEMORY_REPORT_INTERVAL = 0.1
# How long close() lets the BYE reach the scheduler.
CLOSE_LINGER_MS = 1000
# While an acquire() reads in its place, the I/O thread still looks at its timers and queued
# callbacks this often (seconds).
READER_SLICE = 0.05


class SchedulerUnavailable(ConnectionError):
    """No scheduler answered, or it refused this client's registration."""


@dataclass(frozen=True)
class Grant:
    device: str
    id: int
    mode: str
    exclusive: bool
    quantum: float  # seconds


@dataclass
class _DeviceState:
    grant: Grant | None = None  # valid grant the program holds
    waiting: bool = False  # an ACQUIRE is outstanding
    acquirers: int = 0  # threads blocked in acquire(); 0 while waiting = abandoned request
    total: int | None = None
    name: str = ""
    used: int | None = None
    used_dirty: bool = False
    used_sent_at: float = 0.0
    # The current grant's DROP asked for an eviction: the RELEASE says what stays resident.
    evict_asked: bool = False


_live_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _disown_after_fork() -> None:
    for client in list(_live_clients):
        client._inherited = True
        # A lock that another of the parent's threads (the I/O thread, many times a second)
        # held at the fork stays held for ever in the child: fresh ones let every method reach
        # its RuntimeError instead of hanging.
        client._cond = threading.Condition()
        client._io_lock = threading.Lock()
        client._reader = threading.Lock()


os.register_at_fork(after_in_child=_disown_after_fork)


# The identity a client gives in HELLO, defined once for both clients: interceptor/client.c
# (the C library) reads the same sources with the same rules.
_CONTAINER_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
CGROUP_READ_MAX = 4095  # what the C library reads of /proc/self/cgroup


def container_id(cgroup: str) -> str:
    """The container id in the text of /proc/self/cgroup: its last run of exactly 64 lower-case
    hex digits (docker, containerd, CRI-O and podman all name the container's cgroup after it),
    else ""."""
    found = _CONTAINER_ID.findall(cgroup)
    return found[-1] if found else ""


def program_name() -> str:
    """$NVSHARE_PROGRAM (launchers name notebooks so), else the process's name as the kernel
    keeps it (/proc/self/comm: at most 15 characters, "python3" for a Python program)."""
    named = os.environ.get("NVSHARE_PROGRAM")
    if named:
        return named
    try:
        with open("/proc/self/comm") as comm:
            return comm.read().strip()
    except OSError:
        return Path(sys.executable).name


def default_identity() -> dict[str, str]:
    """The identity fields of HELLO for this process (shown in `nvsharectl status`)."""
    try:
        with open("/proc/self/cgroup") as cgroup:
            container = container_id(cgroup.read(CGROUP_READ_MAX))
    except OSError:
        container = ""
    return {
        "host": socket.gethostname(),
        "program": program_name(),
        "pod": os.environ.get("NVSHARE_POD_NAME", ""),
        "namespace": os.environ.get("NVSHARE_POD_NAMESPACE", ""),
        "container": container,
    }


def _drain_eventfd(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


class Client:
    def __init__(
        self,
        socket_dir: str | os.PathLike | None = None,
        *,
        on_drop: Callable[[str, Grant], None] | None = None,
        on_mode: Callable[[str, str, float], None] | None = None,
        on_revoke: Callable[[str, Grant, str], None] | None = None,
        on_contended: Callable[[str, Grant, float], None] | None = None,
        info: dict[str, str] | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        self.paths = SocketPaths.resolve(socket_dir)
        self.on_drop = on_drop
        self.on_mode = on_mode
        self.on_revoke = on_revoke
        self.on_contended = on_contended
        self.identity = {**default_identity(), **(info or {})}
        self.connect_timeout = connect_timeout
        self.session = os.urandom(8).hex()
        self.client_id: str | None = None  # "c12", from WELCOME
        # Memory limits the scheduler set for this registration (LIMIT; docs/protocol.md): on
        # every device (0: none), and devices' own. This library allocates nothing itself: it
        # keeps them for its user to read (limit()).
        self._limit_every = 0
        self._device_limits: dict[str, int] = {}
        self.heartbeat_interval = 1.0
        self.idle_release = 1.0
        # What a newer scheduler sends that this library cannot read is said once (docs/protocol.md,
        # "Unknown words, unknown types").
        self._unknown_said = protocol.WarnOnce()

        self._cond = threading.Condition()  # guards the lock state and the flags below
        self._devices: dict[str, _DeviceState] = {}
        self._registered = False
        self._connected = False
        self._refused: str | None = None  # why the scheduler rejected our HELLO
        self._failure: str | None = None  # why the I/O thread stopped on its own
        self._closing = False
        self._bye_sent = False
        self._closed = False
        self._inherited = False  # set in a forked child (register_at_fork)
        # When the I/O thread next has housekeeping to do; 0 makes it look at once.
        self._next_due = 0.0

        self._io_lock = threading.Lock()  # guards every call on _sock, and _last_sent
        self._context: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._last_sent = 0.0
        self._reader = threading.Lock()  # the receiving role (see the module docstring)
        self._monitor: zmq.Socket | None = None  # used by the reader only
        self._wait_fds: tuple[int, int] = (-1, -1)  # the descriptors of _sock and _monitor
        self._callbacks: collections.deque[tuple[Callable, tuple]] = collections.deque()
        # Two eventfds: one wakes the I/O thread, one wakes a thread reading in acquire().
        self._io_wake_fd = -1
        self._reader_wake_fd = -1
        self._thread: threading.Thread | None = None
        _live_clients.add(self)

    # --- life cycle ------------------------------------------------------------------------

    def connect(self) -> "Client":
        """Register with the scheduler; raises SchedulerUnavailable when there is none."""
        self._check_usable(connected=False)
        if self._thread is not None:
            raise RuntimeError("connect() was already called")
        self._probe_socket()
        self._io_wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._reader_wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Any thread may still write a wake-up after close(): the descriptors live as long
        # as this object, so such a late write can never reach a reused descriptor number.
        weakref.finalize(self, os.close, self._io_wake_fd)
        weakref.finalize(self, os.close, self._reader_wake_fd)
        self._context = zmq.Context()
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._wait_fds = (sock.getsockopt(zmq.FD), self._monitor.getsockopt(zmq.FD))
        sock.connect(self.paths.client_endpoint)
        with self._io_lock:
            self._sock = sock
        self._thread = threading.Thread(target=self._io_main, name="nvshare-client-io", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.connect_timeout
        with self._cond:
            while not self._registered and self._refused is None and self._failure is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            refused, registered = self._refused or self._failure, self._registered
        if not registered:
            self._shutdown(send_bye=False)
            if refused is not None:
                raise SchedulerUnavailable(f"the scheduler at {self.paths.client_socket} refused this client: {refused}")
            raise SchedulerUnavailable(
                f"the scheduler at {self.paths.client_socket} did not answer within {self.connect_timeout:g} s"
            )
        return self

    def close(self) -> None:
        """Release everything (BYE) and stop the I/O thread. Idempotent."""
        if self._inherited or self._closed:
            return
        self._shutdown(send_bye=True)

    def __enter__(self) -> "Client":
        return self if self._thread is not None else self.connect()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def limit(self, device: str) -> int | None:
        """The memory limit the scheduler set for this client on `device` in bytes (None: none):
        the device's own, else the one for every device (nvsharectl set-limit)."""
        with self._cond:
            value = self._device_limits.get(device, self._limit_every)
        return value or None

    def _probe_socket(self) -> None:
        """Tell 'no scheduler' from 'no permission' before ZeroMQ starts retrying silently."""
        path = self.paths.client_socket
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.fspath(path))
        except FileNotFoundError:
            raise SchedulerUnavailable(
                f"no scheduler socket at {path}: is nvshare-scheduler running, and is NVSHARE_SOCKET_DIR right?"
            ) from None
        except ConnectionRefusedError:
            raise SchedulerUnavailable(f"nvshare-scheduler is not running (nothing listens on {path})") from None
        except PermissionError:
            raise SchedulerUnavailable(f"permission denied on {path}") from None
        except OSError as exc:
            raise SchedulerUnavailable(f"cannot reach {path}: {exc.strerror}") from None
        finally:
            probe.close()

    def _shutdown(self, *, send_bye: bool) -> None:
        with self._cond:
            if self._closing:
                return
            if send_bye and self._registered and self._connected:
                self._transmit(protocol.Bye())
                self._bye_sent = True
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._wake_all()
            if self._thread is not threading.current_thread():
                self._thread.join()
        with self._cond:
            self._closed = True
            self._registered = False
            for state in self._devices.values():
                state.grant = None
                state.waiting = False
            self._cond.notify_all()

    def _check_usable(self, *, connected: bool = True) -> None:
        if self._inherited:
            raise RuntimeError(
                "this nvshare Client belongs to the parent process; create a new Client after fork()"
            )
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self._closing or self._closed:
            raise RuntimeError("the nvshare Client is closed")
        if connected and self._thread is None:
            raise RuntimeError("call connect() first")

    # --- the API ---------------------------------------------------------------------------

    def announce(self, device: str, total: int, name: str = "") -> None:
        """Tell the scheduler a device's memory size (DEVICE)."""
        message = protocol.DeviceAnnouncement(device=device, total=total, name=name)
        message.encode()  # reject bad values here, not on the I/O thread
        with self._cond:
            self._check_usable()
            state = self._state(device)
            state.total, state.name = total, name
            self._transmit(message)

    def report_memory(self, device: str, used: int) -> None:
        """Bytes this program has allocated on the device (MEMORY, coalesced)."""
        protocol.Memory(device=device, used=used).encode()
        with self._cond:
            self._check_usable()
            state = self._state(device)
            if state.used != used:
                state.used, state.used_dirty = used, True
                self._next_due = 0.0
        self._wake_io()  # the I/O thread sends it when due

    def acquire(self, device: str, timeout: float | None = None) -> Grant:
        """Block until this program holds the device's lock. On timeout the request stays
        queued at the scheduler until a later acquire() takes the grant; a grant nobody waits
        for any more is released at once."""
        request = protocol.Acquire(device=device)
        request.encode()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_usable()
            state = self._state(device)
            if state.grant is not None:
                return state.grant
            if not state.waiting:
                state.waiting = True
                # The latest memory figure goes just before the ACQUIRE.
                self._transmit(*self._memory_reports(time.monotonic(), device), request)
            state.acquirers += 1
        try:
            while True:
                with self._cond:
                    self._check_usable()
                    if state.grant is not None:
                        return state.grant
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"no grant for {device} within {timeout:g} s")
                if self._reader.acquire(blocking=False):
                    try:
                        unread = self._read_while_waiting(state, deadline)
                    finally:
                        # Handing the role back wakes the I/O thread without an eventfd
                        # write, which would give the GIL away just before we return.
                        self._reader.release()
                    if unread:
                        self._wake_io()
                else:
                    # The I/O thread (or another acquire()) is reading; it will notify us.
                    with self._cond:
                        if state.grant is None and not self._closing:
                            remaining = deadline - time.monotonic()
                            self._cond.wait(None if remaining == math.inf else max(0.0, remaining))
        finally:
            with self._cond:
                state.acquirers -= 1

    def release(self, device: str, reason: str = "user") -> bool:
        """Give the device's lock back; False when this program did not hold it."""
        with self._cond:
            if self._inherited:
                self._check_usable()
            state = self._devices.get(device)
            if state is None or state.grant is None or self._closed:
                return False
            grant, state.grant = state.grant, None
            # This client converts no memory (docs/protocol.md, Residency): nothing of it is
            # ever resident in the scheduler's sense, so it has nothing to move and says so.
            resident = 0 if state.evict_asked else None
            state.evict_asked = False
            self._transmit(protocol.Release(device=device, grant=grant.id, reason=reason, resident=resident))
            return True

    @contextlib.contextmanager
    def hold(self, device: str, timeout: float | None = None) -> Iterator[Grant]:
        grant = self.acquire(device, timeout)
        try:
            yield grant
        finally:
            self.release(device)

    def grant(self, device: str) -> Grant | None:
        """The grant this program holds on `device` now, if any."""
        with self._cond:
            state = self._devices.get(device)
            return None if state is None else state.grant

    # --- sending (any thread) --------------------------------------------------------------

    def _state(self, device: str) -> _DeviceState:
        state = self._devices.get(device)
        if state is None:
            state = self._devices[device] = _DeviceState()
        return state

    def _transmit(self, *messages: protocol.Message) -> None:
        """Send now, from whichever thread (call with `_cond` held, so that the order on the
        wire is the order of the state changes). While disconnected nothing is sent: HELLO
        carries the state on reconnection."""
        if not self._connected:
            return
        with self._io_lock:
            sock = self._sock
            if sock is None:
                return
            for message in messages:
                try:
                    sock.send(message.encode(), flags=zmq.NOBLOCK)
                except zmq.Again:
                    log.warning("nvshare scheduler is not reading; %s dropped", message.TYPE)
            self._last_sent = time.monotonic()
            # The send may have used up the descriptor's signal that the reader sleeps on.
            incoming = sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
        if incoming:
            self._wake_all()

    def _wake_io(self) -> None:
        os.eventfd_write(self._io_wake_fd, 1)

    def _wake_all(self) -> None:
        os.eventfd_write(self._io_wake_fd, 1)
        os.eventfd_write(self._reader_wake_fd, 1)

    def _memory_reports(self, now: float, device: str | None) -> list[protocol.Memory]:
        """MEMORY for `device` if its figure changed, or (None) for every device whose
        changed figure is due. Called with `_cond` held."""
        if device is not None:
            state = self._devices.get(device)
            candidates = [(device, state)] if state is not None and state.used_dirty else []
        else:
            candidates = [
                (name, state)
                for name, state in self._devices.items()
                if state.used_dirty and now - state.used_sent_at >= MEMORY_REPORT_INTERVAL
            ]
        reports = []
        for name, state in candidates:
            reports.append(protocol.Memory(device=name, used=state.used))
            state.used_dirty, state.used_sent_at = False, now
        return reports

    # --- receiving (the holder of _reader) --------------------------------------------------

    def _pump(self) -> bool:
        """Dispatch everything that arrived; True if more is waiting already."""
        monitor, sock = self._monitor, self._sock
        # Connection events first: a re-HELLO must be on its way before we judge any
        # 'not-registered' answer to what was sent before a restart.
        while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._on_connection_event(recv_monitor_message(monitor, flags=zmq.NOBLOCK)["event"])
        with self._io_lock:
            received = []
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                received.append(sock.recv_multipart(flags=zmq.NOBLOCK))
        for frames in received:
            self._on_frames(frames)
        # Their descriptors signal changes, not readiness: sleep only when nothing is left.
        with self._io_lock:
            pending = sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
        return bool(pending or monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _read_while_waiting(self, state: _DeviceState, deadline: float) -> bool:
        """acquire()'s thread as the reader, until its grant (or a reason to stop) arrives.
        Returns whether messages are left for the I/O thread."""
        if self._sock is None:
            return False  # the I/O thread has closed it (the client is closing or failed)
        sleeper = select.poll()
        for fd in (*self._wait_fds, self._reader_wake_fd):
            sleeper.register(fd, select.POLLIN)
        while True:
            more = self._pump()
            with self._cond:
                if state.grant is not None or self._closing or self._failure is not None:
                    return more
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return more
            if not more:
                sleeper.poll(None if remaining == math.inf else max(1, math.ceil(remaining * 1000)))
                _drain_eventfd(self._reader_wake_fd)

    def _io_main(self) -> None:
        sock, monitor = self._sock, self._monitor
        sleeper = select.poll()
        for fd in (*self._wait_fds, self._io_wake_fd):
            sleeper.register(fd, select.POLLIN)
        linger = 0
        try:
            while True:
                # Waiting on the lock (not spinning) while an acquire() holds the role; the
                # slice bounds how late housekeeping and queued callbacks can run meanwhile.
                now = time.monotonic()
                reading = self._reader.acquire(timeout=max(0.001, min(READER_SLICE, self._next_due - now)))
                more = False
                if reading:
                    try:
                        more = self._pump()
                    finally:
                        self._reader.release()
                while self._callbacks:
                    function, args = self._callbacks.popleft()
                    self._run_callback(function, args)
                if self._closing:
                    if self._bye_sent:
                        linger = CLOSE_LINGER_MS  # let the BYE reach the scheduler
                    break
                now = time.monotonic()
                if now >= self._next_due:
                    self._send_due(now)
                if reading and not more:
                    timeout = self._next_due - now
                    sleeper.poll(None if timeout == math.inf else max(1, math.ceil(timeout * 1000)))
                    _drain_eventfd(self._io_wake_fd)
        except Exception as exc:
            log.exception("nvshare client I/O thread failed")
            with self._cond:
                self._failure = f"the client I/O thread failed: {exc!r}"
                self._cond.notify_all()
            self._wake_all()
        finally:
            with self._reader:
                sock.disable_monitor()
                monitor.close(linger=0)
                with self._io_lock:
                    self._sock = None
                    sock.close(linger=linger)
            self._context.term()

    def _send_due(self, now: float) -> None:
        """Memory reports whose time has come and a heartbeat when nothing else was sent;
        then when to look again (`_next_due`)."""
        with self._cond:
            if not self._registered:
                self._next_due = math.inf  # until WELCOME
                return
            outgoing: list[protocol.Message] = self._memory_reports(now, None)
            if not outgoing and now - self._last_sent >= self.heartbeat_interval:
                outgoing.append(protocol.Heartbeat())
            if outgoing:
                self._transmit(*outgoing)
            due = self._last_sent + self.heartbeat_interval
            for state in self._devices.values():
                if state.used_dirty:
                    due = min(due, state.used_sent_at + MEMORY_REPORT_INTERVAL)
            self._next_due = due

    def _on_connection_event(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            with self._cond:
                self._connected = False
                self._registered = False
            log.info("nvshare scheduler connection lost; reconnecting")
        elif event == zmq.EVENT_CONNECTED:
            self._register()

    def _register(self) -> None:
        """(Re)send HELLO with the devices held and wanted, then the DEVICE and MEMORY reports."""
        with self._cond:
            self._connected = True
            self._registered = False
            # A new registration: its limits come before its WELCOME.
            self._limit_every = 0
            self._device_limits.clear()
            held = tuple(d for d, s in self._devices.items() if s.grant is not None)
            wanted = tuple(d for d, s in self._devices.items() if s.waiting)
            outgoing: list[protocol.Message] = [
                protocol.Hello(pid=os.getpid(), session=self.session, held=held, wanted=wanted, **self.identity)
            ]
            now = time.monotonic()
            for device, state in self._devices.items():
                if state.total is not None:
                    outgoing.append(protocol.DeviceAnnouncement(device=device, total=state.total, name=state.name))
                if state.used is not None:
                    outgoing.append(protocol.Memory(device=device, used=state.used))
                    state.used_dirty, state.used_sent_at = False, now
            self._transmit(*outgoing)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            log.warning("nvshare scheduler sent a %d-frame message; ignored", len(frames))
            return
        try:
            message = protocol.decode(frames[0], protocol.SCHEDULER_MESSAGES)
        except protocol.ProtocolError as exc:
            if exc.code != "unknown-type":
                log.warning("nvshare scheduler sent an unreadable message: %s", exc)
            elif self._unknown_said.first(exc.msg_type):
                log.warning("nvshare scheduler sent a %s message, a type this nvshare_py does not know: ignored",
                            exc.msg_type)
            return
        for key, word in protocol.unknown_words(message):
            # Acted on all the same: each handler does what the message requires whatever the word.
            if self._unknown_said.first((message.TYPE, key, word)):
                log.warning("nvshare scheduler sent %s %s=%s, a word this nvshare_py does not know: acting on the "
                            "%s as usual", message.TYPE, key, word, message.TYPE)
        handler = self._handlers.get(type(message))
        if handler is not None:  # none: a message for clients that take part in what it is about (ADMITTED)
            handler(self, message)

    def _on_welcome(self, message: protocol.Welcome) -> None:
        with self._cond:
            self.client_id = message.client
            self.heartbeat_interval = message.heartbeat_ms / 1000
            self.idle_release = message.idle_release_ms / 1000
            self._registered = True
            self._next_due = 0.0
            self._cond.notify_all()
        self._wake_io()  # heartbeats start now

    def _on_grant(self, message: protocol.Grant) -> None:
        # A mode this library does not know counts as exclusive: the program may use the device
        # as if it were alone on it, as in mode on.
        exclusive = message.exclusive or message.mode not in vocabulary.MODE
        grant = Grant(message.device, message.grant, message.mode, exclusive, message.quantum_ms / 1000)
        with self._cond:
            state = self._state(message.device)
            if state.grant is not None or (state.waiting and state.acquirers):
                # A new grant, or the scheduler confirming a held one after a restart.
                state.grant, state.waiting = grant, False
                self._cond.notify_all()
                return
            # Nobody wants it (an acquire() that timed out): hand it straight back.
            state.waiting = False
            self._transmit(protocol.Release(device=message.device, grant=message.grant, reason="user"))

    def _on_drop(self, message: protocol.Drop) -> None:
        with self._cond:
            state = self._devices.get(message.device)
            grant = state.grant if state is not None else None
            if grant is not None and grant.id == message.grant and message.evict:
                state.evict_asked = True
        if grant is None or grant.id != message.grant:
            return
        if self.on_drop is None:
            self.release(message.device, reason="drop")
        else:
            self._callback(self.on_drop, message.device, grant)

    def _on_evict(self, message: protocol.Evict) -> None:
        """Answered at once: with no converted memory there is nothing to move, and a grant
        to another client waits for this answer."""
        with self._cond:
            self._transmit(protocol.Evicted(device=message.device, resident=0))

    def _on_contended(self, message: protocol.Contended) -> None:
        if self.on_contended is None:
            return
        with self._cond:
            state = self._devices.get(message.device)
            grant = state.grant if state is not None else None
        if grant is not None and grant.id == message.grant:
            self._callback(self.on_contended, message.device, grant, message.quantum_left_ms / 1000)

    def _on_revoke(self, message: protocol.Revoke) -> None:
        with self._cond:
            state = self._devices.get(message.device)
            grant = state.grant if state is not None else None
            if grant is None or grant.id != message.grant:
                return
            state.grant = None
            # Ignored by the scheduler, but it keeps both sides' state in step.
            self._transmit(protocol.Release(device=message.device, grant=message.grant, reason="revoke"))
        if self.on_revoke is not None:
            self._callback(self.on_revoke, message.device, grant, message.reason)

    def _on_mode(self, message: protocol.ModeNotice) -> None:
        if self.on_mode is not None:
            self._callback(self.on_mode, message.device, message.mode, message.quantum_ms / 1000)

    def _on_limit(self, message: protocol.Limit) -> None:
        with self._cond:
            if message.device:
                self._device_limits[message.device] = message.bytes
            else:
                self._limit_every = message.bytes
        log.info("nvshare scheduler set the memory limit on %s to %s", message.device or "every device",
                 f"{message.bytes} bytes" if message.bytes else "none")

    def _on_error(self, message: protocol.Error) -> None:
        if message.type == "HELLO" and message.code != "already-registered":
            with self._cond:
                self._refused = f"{message.code}: {message.detail}"
                self._cond.notify_all()
            log.error("nvshare scheduler refused registration: %s %s", message.code, message.detail)
            return
        if message.code != "not-registered":
            log.warning("nvshare scheduler rejected %s: %s %s", message.type or "a message", message.code, message.detail)
            return
        with self._cond:
            if not self._registered:
                return  # an answer to something sent before our HELLO; WELCOME follows
            # The scheduler dropped our registration while we stayed connected (we were
            # silent past its heartbeat timeout): our grants are void. Register again.
            lost = [s.grant for s in self._devices.values() if s.grant is not None]
            for state in self._devices.values():
                state.grant = None
        log.warning("nvshare scheduler dropped this client's registration; registering again")
        self._register()
        if self.on_revoke is not None:
            for grant in lost:
                self._callback(self.on_revoke, grant.device, grant, "lost")

    def _callback(self, function: Callable, *args) -> None:
        """Run a user callback on the I/O thread (now, or soon when another thread reads)."""
        if threading.current_thread() is self._thread:
            self._run_callback(function, args)
        else:
            self._callbacks.append((function, args))
            self._wake_io()

    @staticmethod
    def _run_callback(function: Callable, args: tuple) -> None:
        try:
            function(*args)
        except Exception:
            log.exception("nvshare client callback %r failed", function)

    _handlers = {
        protocol.Welcome: _on_welcome,
        protocol.Grant: _on_grant,
        protocol.Drop: _on_drop,
        protocol.Evict: _on_evict,
        protocol.Contended: _on_contended,
        protocol.Revoke: _on_revoke,
        protocol.ModeNotice: _on_mode,
        protocol.Limit: _on_limit,
        protocol.Error: _on_error,
    }
