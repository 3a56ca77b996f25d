"""A cooperating program's side of the client protocol (docs/protocol.md).

(Some 700 lines, most of them the public API with what its user must know, the identity HELLO
gives, and the threads' hand-over of the reader role; the protocol's rules are not here but in
the C client core, and the connection is nvshare_py/client_link.py.)

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

One state machine. The protocol's rules (registration and reconnection, heartbeats and the
lease, memory reports, when to ACQUIRE and RELEASE, what a DROP, REVOKE, EVICT or lost
registration asks) are the C client core's (interceptor/client_core.c, driven through ctypes:
nvshare_py/client_core.py), the same code libnvshare.so runs in CUDA programs. This module is
its I/O shell: it feeds the core what happens (messages, connection events, the program's
calls and the time) and carries out what the core asks (send, connect, disconnect, log, and
the worker's jobs). The program's calls are the interceptor's threads: a thread in acquire()
is an application thread waiting at the closed gate, the gate opening is its grant; the
drain of a DROP is the program's (on_drop, then release()), that of its own release() or of
a void grant is done at once; the program converts no memory, so a swap job moves nothing.
What only the program sees (a grant's mode and quantum, the callbacks' arguments, the client
id) is read from the decoded messages.

Threads. The core, the connection and the lock state are shared under `_cond`; nothing blocks
under it (the socket is non-blocking). Sending needs nothing else: API methods feed the core
themselves and send what it asks, without waking another thread. Receiving is a role, the
*reader* (`_reader`, a try-lock): its holder sleeps in poll() on the socket and feeds what
arrives. A background I/O thread holds the role by default, runs the core's timers and the
callbacks; but a thread blocked in acquire() takes the role while it waits, so the GRANT wakes
it directly rather than waking the I/O thread that would then wake it (one thread switch and
one GIL hand-over less on the lock handoff path). The connection is nvshare_py/client_link.py:
ZMTP over the Unix socket, as the interceptor speaks it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
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

from . import client_core, protocol, vocabulary
from .client_core import ClientCore
from .client_link import Link, LinkLost
from .paths import SocketPaths

log = logging.getLogger("nvshare.client")

# How long close() lets the BYE reach the scheduler (seconds).
CLOSE_LINGER = 1.0
# While an acquire() reads in its place, the I/O thread still looks at its timers and queued
# callbacks this often (seconds).
READER_SLICE = 0.05
_LOG_LEVELS = {client_core.LOG_ERROR: logging.ERROR, client_core.LOG_WARN: logging.WARNING,
               client_core.LOG_INFO: logging.INFO, client_core.LOG_DEBUG: logging.DEBUG}


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
class _Device:
    """What the shell keeps of a device beside the core's state: the core's number for it,
    what the program does with it, and the terms of its grant."""

    index: int
    acquirers: int = 0  # threads blocked in acquire(): the core's waiters at the gate
    asked: bool = False  # an acquire() asked for the lock and no grant answered it yet
    used: int = 0  # the program's last memory figure
    offered: Grant | None = None  # the terms of the device's last GRANT
    grant: Grant | None = None  # the grant the program holds (the gate opened for it)
    draining: bool = False  # a DROP's drain is the program's: it ends with its release()


_live_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _disown_after_fork() -> None:
    for client in list(_live_clients):
        client._inherited = True
        # A lock that another of the parent's threads (the I/O thread, many times a second)
        # held at the fork stays held for ever in the child: fresh ones let every method reach
        # its RuntimeError instead of hanging.
        client._cond = threading.Condition()
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
        self.heartbeat_interval = 1.0  # from WELCOME, seconds
        self.idle_release = 1.0
        # The program says itself when it is done (release()): no idle detection, no pre-drain
        # (on_contended lets the program drain early).
        named = self.identity.get
        self._core = ClientCore(client_core.default_library(), os.getpid(), self.session, idle_release_ms=0,
                                predrain=False, host=named("host", ""), container=named("container", ""),
                                pod=named("pod", ""), namespace=named("namespace", ""), program=named("program", ""),
                                socket_path=os.fspath(self.paths.client_socket))

        self._cond = threading.Condition()  # guards the core, the connection and the state below
        self._devices: dict[str, _Device] = {}
        self._by_index: list[_Device] = []
        self._incoming: protocol.Message | None = None  # the message the core is reading
        self._refused: str | None = None  # why the scheduler rejected our HELLO
        self._no_place: str | None = None  # why it last had no place for our connection
        self._failure: str | None = None  # why the I/O thread stopped on its own
        self._closing = False
        self._bye_sent = False
        self._closed = False
        self._inherited = False  # set in a forked child (register_at_fork)
        self._next_due = 0.0  # when the core's timers are due next; 0: at once

        self._link: Link | None = None  # the connection the core asked for
        self._reader = threading.Lock()  # the receiving role (see the module docstring)
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
        self._thread = threading.Thread(target=self._io_main, name="nvshare-client-io", daemon=True)
        self._thread.start()  # its first tick: the core asks to connect
        deadline = time.monotonic() + self.connect_timeout
        with self._cond:
            while not self._core.registered and self._refused is None and self._failure is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            refused, registered = self._refused or self._failure, self._core.registered
        if not registered:
            self._shutdown(send_bye=False)
            if refused is not None:
                raise SchedulerUnavailable(f"the scheduler at {self.paths.client_socket} refused this client: {refused}")
            if self._no_place is not None:
                raise SchedulerUnavailable(f"the scheduler at {self.paths.client_socket} had no place for this client "
                                           f"within {self.connect_timeout:g} s: {self._no_place}")
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
            value = self._core.limit(device)
        return value or None

    def _probe_socket(self) -> None:
        """Tell 'no scheduler' from 'no permission' at once, with what to do."""
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
            self._closing = True
            if send_bye and self._thread is not None and self._failure is None:
                # What the program holds goes back first: the core says BYE only when nothing
                # is held (a process that exits holding has its lock passed on by its exit).
                for dev in self._by_index:
                    self._step(functools.partial(self._give_back, dev, "user"))
                self._bye_sent = self._core.registered
                self._step(self._core.exit)
            self._cond.notify_all()
        if self._thread is not None:
            self._wake_all()
            if self._thread is not threading.current_thread():
                self._thread.join()
        with self._cond:
            self._closed = True
            for dev in self._devices.values():
                dev.grant = None
                dev.draining = False
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
        protocol.DeviceAnnouncement(device=device, total=total, name=name).encode()  # bad values fail here
        with self._cond:
            self._check_usable()
            dev = self._device(device)
            self._core.add_device(dev.index, device, total, name)
            self._core.use_device(dev.index)
            self._step(self._core.tick)

    def report_memory(self, device: str, used: int) -> None:
        """Bytes this program has allocated on the device (MEMORY, coalesced)."""
        protocol.Memory(device=device, used=used).encode()
        with self._cond:
            self._check_usable()
            self._device(device).used = used
            self._step(self._core.tick)

    def acquire(self, device: str, timeout: float | None = None) -> Grant:
        """Block until this program holds the device's lock. On timeout the request stays
        queued at the scheduler until a later acquire() takes the grant; a grant nobody waits
        for any more is released at once."""
        protocol.Acquire(device=device).encode()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_usable()
            dev = self._device(device)
            if dev.grant is not None:
                return dev.grant
            dev.acquirers += 1
            dev.asked = True
            self._step(self._core.tick)  # the latest memory figure, then ACQUIRE
        try:
            while True:
                with self._cond:
                    self._check_usable()
                    if dev.grant is not None:
                        return dev.grant
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"no grant for {device} within {timeout:g} s")
                if self._reader.acquire(blocking=False):
                    try:
                        self._read_while_waiting(dev, deadline)
                    finally:
                        # Handing the role back wakes the I/O thread without an eventfd
                        # write, which would give the GIL away just before we return.
                        self._reader.release()
                    if self._callbacks:
                        self._wake_io()
                else:
                    # The I/O thread (or another acquire()) is reading; it will notify us.
                    with self._cond:
                        if dev.grant is None and not self._closing:
                            remaining = deadline - time.monotonic()
                            self._cond.wait(None if remaining == math.inf else max(0.0, remaining))
        finally:
            with self._cond:
                dev.acquirers -= 1

    def release(self, device: str, reason: str = "user") -> bool:
        """Give the device's lock back; False when this program did not hold it. `reason`:
        "user", or "quantum" when answering on_contended; after a DROP the release answers it."""
        if not vocabulary.is_release_reason(reason):
            raise ValueError(f"{reason!r} is not a release reason ({', '.join(vocabulary.RELEASE_REASON.words)})")
        with self._cond:
            if self._inherited:
                self._check_usable()
            dev = self._devices.get(device)
            if dev is None or dev.grant is None or self._closed:
                return False
            # The drain of a DROP says "drop" whatever the program calls it; otherwise the
            # program either hands over early (quantum) or is done (user).
            self._step(functools.partial(self._give_back, dev, "quantum" if reason == "quantum" else "user"))
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
            dev = self._devices.get(device)
            return None if dev is None else dev.grant

    # --- the core (everything here runs with _cond held) ------------------------------------

    def _device(self, device: str) -> _Device:
        """The device's record, the device made known to the core on first use."""
        dev = self._devices.get(device)
        if dev is None:
            if len(self._by_index) == client_core.MAX_DEVICES:
                raise ValueError(f"a client uses at most {client_core.MAX_DEVICES} devices")
            dev = _Device(len(self._by_index))
            self._core.add_device(dev.index, device, 0, "")
            self._devices[device] = dev
            self._by_index.append(dev)
        return dev

    def _give_back(self, dev: _Device, reason: str, now: float) -> None:
        """The program releases: a DROP's drain ends; else the core starts the release."""
        if dev.grant is None:
            return
        dev.grant = None
        if dev.draining:
            dev.draining = False
            self._core.job_done(dev.index, client_core.RESULT_DRAINED, now)
        else:
            self._core.release(dev.index, reason, now)

    def _step(self, event: Callable[[float], None], message: protocol.Message | None = None) -> None:
        """Feed one event to the core (what it observes first), then carry out what it asks."""
        now = time.monotonic()
        core = self._core
        for dev in self._by_index:
            core.observe(dev.index, dev.acquirers, 0, 0, dev.used)
        registered = core.registered
        self._incoming = message
        try:
            event(now)
            if message is not None:
                self._read(message, registered, now)
            self._carry_out(now)
        finally:
            self._incoming = None
        due, self._next_due = self._next_due, core.next_deadline(now)
        if self._next_due < due:
            self._wake_io()
        self._cond.notify_all()

    def _carry_out(self, now: float) -> None:
        core = self._core
        while (action := core.pop_one(now)) is not None:
            kind = action.kind
            if kind == client_core.ACT_SEND:
                self._send(action.data, now)
            elif kind == client_core.ACT_GATE:
                self._gate(self._by_index[action.device], bool(action.value), now)
            elif kind == client_core.ACT_JOB:
                self._job(self._by_index[action.device], action.value, now)
            elif kind == client_core.ACT_LOG:
                log.log(_LOG_LEVELS.get(action.value, logging.DEBUG), "%s", action.data.decode(errors="replace"))
            elif kind == client_core.ACT_CONNECT:
                self._open(now)
            elif kind == client_core.ACT_DISCONNECT:
                self._hang_up()
            # ADMISSION, LIMIT, SETTLED, SWAP_AREA, POOL are for an allocator: this library allocates
            # nothing (limit() reads the core's limits for the program).

    def _gate(self, dev: _Device, open_: bool, now: float) -> None:
        """The gate opens for a grant (a GRANT, or one confirming a held lock after a restart)."""
        if not open_ or self._closing or dev.offered is None:
            return
        asked, dev.asked = dev.asked, False
        if dev.grant is None and dev.acquirers == 0 and asked:
            # Nobody wants it any more (an acquire() that timed out): hand it straight back.
            # A grant nobody asked for is the turn of this program's gang (several devices,
            # granted together, docs/protocol.md "Gangs"): kept, like the interceptor keeps it.
            self._core.release(dev.index, "user", now)
            return
        dev.grant = dev.offered

    def _job(self, dev: _Device, job: int, now: float) -> None:
        """The worker's part. A drain after a DROP is the program's; any other ends at once: the
        program's own release has nothing left to drain, a void grant is given up, and this
        library converts no memory, so a swap job moves nothing."""
        core = self._core
        if job == client_core.JOB_DRAIN:
            message = self._incoming
            if dev.grant is not None and isinstance(message, protocol.Drop):
                dev.draining = True
                if self.on_drop is None:
                    self._give_back(dev, "user", now)
                else:
                    self._callback(self.on_drop, message.device, dev.grant)
                return
            voided, dev.grant = dev.grant, None
            core.job_done(dev.index, client_core.RESULT_DRAINED, now)
            if voided is not None:
                self._voided(voided, message.reason if isinstance(message, protocol.Revoke) else "lost")
        elif job == client_core.JOB_PROBE:
            core.job_done(dev.index, client_core.RESULT_ACTIVE, now)
        else:
            core.job_done(dev.index, client_core.RESULT_MOVED, now)

    def _voided(self, grant: Grant, reason: str) -> None:
        if self.on_revoke is not None:
            self._callback(self.on_revoke, grant.device, grant, reason)

    def _read(self, message: protocol.Message, registered: bool, now: float) -> None:
        """What the program learns from a message the core has just read."""
        if isinstance(message, protocol.Welcome):
            self.client_id = message.client
            self.heartbeat_interval = message.heartbeat_ms / 1000
            self.idle_release = message.idle_release_ms / 1000
        elif isinstance(message, protocol.Grant):
            # A mode this library does not know counts as exclusive: the program may use the
            # device as if it were alone on it, as in mode on.
            exclusive = message.exclusive or message.mode not in vocabulary.MODE
            dev = self._devices.get(message.device)
            if dev is not None:
                dev.offered = Grant(message.device, message.grant, message.mode, exclusive, message.quantum_ms / 1000)
        elif isinstance(message, protocol.Revoke):
            dev = self._devices.get(message.device)
            if dev is not None and dev.draining and dev.grant is not None and dev.grant.id == message.grant:
                # The program did not finish its drain in time: the grant is void (the core
                # sends the RELEASE once the drain it waited for is given up).
                voided, dev.grant, dev.draining = dev.grant, None, False
                self._core.job_done(dev.index, client_core.RESULT_DRAINED, now)
                self._voided(voided, message.reason)
        elif isinstance(message, protocol.Contended):
            dev = self._devices.get(message.device)
            grant = dev.grant if dev is not None else None
            if self.on_contended is not None and grant is not None and grant.id == message.grant:
                self._callback(self.on_contended, message.device, grant, message.quantum_left_ms / 1000)
        elif isinstance(message, protocol.ModeNotice):
            if self.on_mode is not None:
                self._callback(self.on_mode, message.device, message.mode, message.quantum_ms / 1000)
        elif isinstance(message, protocol.Error):
            if message.code == "too-many-connections":
                self._no_place = message.detail  # it connects again; connect() says why, if it gives up
            elif message.type == "HELLO" and message.code != "already-registered":
                self._refused = f"{message.code}: {message.detail}"
            elif registered and not self._core.registered:
                # The scheduler lost this registration: drains the program still owes are void.
                for dev in self._by_index:
                    if dev.draining and dev.grant is not None:
                        voided, dev.grant, dev.draining = dev.grant, None, False
                        self._core.job_done(dev.index, client_core.RESULT_DRAINED, now)
                        self._voided(voided, "lost")

    def _callback(self, function: Callable, *args) -> None:
        """Run a user callback on the I/O thread, after the step that called for it."""
        self._callbacks.append((function, args))
        if threading.current_thread() is not self._thread:
            self._wake_io()

    def _run_callbacks(self) -> None:
        while self._callbacks:
            function, args = self._callbacks.popleft()
            try:
                function(*args)
            except Exception:
                log.exception("nvshare client callback %r failed", function)

    # --- the connection (with _cond held) ---------------------------------------------------

    def _open(self, now: float) -> None:
        """The core asks for a connection."""
        try:
            self._link = Link(os.fspath(self.paths.client_socket))
        except OSError as exc:
            self._core.connect_failed(now, exc.errno or client_core.ECONNREFUSED)
            return
        self._core.connected(now)  # HELLO, sent after the scheduler's READY
        self._wake_all()  # readers poll the new connection

    def _hang_up(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
            self._wake_all()

    def _lost(self, why: str, now: float) -> None:
        """The connection failed under us: the core hears of it, and asks again later."""
        self._hang_up()
        self._core.disconnected(why, now)

    def _send(self, data: bytes, now: float) -> None:
        if self._link is None:
            return  # the core counts the connection as closed already
        try:
            self._link.send(data)
        except LinkLost as lost:
            self._lost(str(lost), now)
            return
        if self._link.wants_to_write:
            self._wake_all()  # readers poll for room

    def _flush(self, now: float) -> None:
        if self._link is not None:
            try:
                self._link.flush()
            except LinkLost as lost:
                self._lost(str(lost), now)

    def _pump(self) -> None:
        """Take what arrived on the connection and feed it to the core (the reader's work)."""
        with self._cond:
            link = self._link
            if link is None:
                return
            try:
                messages = link.receive()
            except LinkLost as lost:
                self._step(functools.partial(self._lost, str(lost)))
                return
            for frames in messages:
                if link is not self._link:
                    return  # the core hung up while reading what came before
                self._on_frames(frames)

    def _on_frames(self, frames: tuple[bytes, ...]) -> None:
        if len(frames) != 1:
            log.warning("nvshare scheduler sent a %d-frame message; ignored", len(frames))
            return
        data = frames[0]
        try:
            message: protocol.Message | None = protocol.decode(data, protocol.SCHEDULER_MESSAGES)
        except protocol.ProtocolError:
            message = None  # the core says what it cannot read
        self._step(lambda now: self._core.receive(data, now), message)

    # --- threads -------------------------------------------------------------------------

    def _wake_io(self) -> None:
        if self._io_wake_fd >= 0:
            os.eventfd_write(self._io_wake_fd, 1)

    def _wake_all(self) -> None:
        if self._io_wake_fd >= 0:
            os.eventfd_write(self._io_wake_fd, 1)
            os.eventfd_write(self._reader_wake_fd, 1)

    def _sleep(self, wake_fd: int, until: float) -> None:
        """poll() on the connection (and for room to write when output waits) until `until`."""
        sleeper = select.poll()
        sleeper.register(wake_fd, select.POLLIN)
        link = self._link
        if link is not None and link.fileno() >= 0:  # else closed meanwhile: a wake-up is on its way
            sleeper.register(link.fileno(), select.POLLIN | (select.POLLOUT if link.wants_to_write else 0))
        timeout = until - time.monotonic()
        sleeper.poll(None if timeout == math.inf else max(0, math.ceil(timeout * 1000)))
        _drain_eventfd(wake_fd)

    def _read_while_waiting(self, dev: _Device, deadline: float) -> None:
        """acquire()'s thread as the reader, until its grant (or a reason to stop) arrives."""
        while True:
            self._pump()
            with self._cond:
                if dev.grant is not None or self._closing or self._failure is not None:
                    return
            if time.monotonic() >= deadline:
                return
            self._sleep(self._reader_wake_fd, deadline)  # the timers are the I/O thread's

    def _io_main(self) -> None:
        try:
            while True:
                # Waiting on the lock (not spinning) while an acquire() holds the role; the
                # slice bounds how late timers and queued callbacks can run meanwhile.
                now = time.monotonic()
                reading = self._reader.acquire(timeout=max(0.001, min(READER_SLICE, self._next_due - now)))
                if reading:
                    try:
                        self._pump()
                    finally:
                        self._reader.release()
                self._run_callbacks()
                if self._closing:
                    break
                if time.monotonic() >= self._next_due:
                    with self._cond:
                        self._step(self._core.tick)
                    self._run_callbacks()
                if reading:
                    self._sleep(self._io_wake_fd, self._next_due)
        except Exception as exc:
            log.exception("nvshare client I/O thread failed")
            with self._cond:
                self._failure = f"the client I/O thread failed: {exc!r}"
                self._cond.notify_all()
            self._wake_all()
        finally:
            self._linger()

    def _linger(self) -> None:
        """Let what is still to be sent (the BYE) reach the scheduler, then hang up."""
        give_up = time.monotonic() + CLOSE_LINGER
        with self._reader:
            while True:
                with self._cond:
                    if self._link is None or not self._link.wants_to_write or not self._bye_sent:
                        self._hang_up()
                        return
                    self._step(self._flush)
                    link = self._link
                if time.monotonic() >= give_up:
                    with self._cond:
                        self._hang_up()
                    return
                if link is not None:
                    select.select([], [link], [], max(0.0, give_up - time.monotonic()))
