"""The client core (interceptor/client_core.c) through ctypes: the one client state machine.

libnvshare.so runs the core inside CUDA programs; nvshare_py.client drives the same core from
Python, and the tests (tests/fixtures/client_core.py) pair it with the scheduler's core. The
core is built alone as libnvshare_core.so (interceptor/Makefile, `make core`: no threads, no
I/O, no constructors) and found as nvshare_py.library.core_path() says.

The C signatures are declared once, in SIGNATURES; the constants mirror client_core.h's enums.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

from . import library, protocol

# enum nvs_lock_state
IDLE, WAITING, HOLDING, DRAINING, UNSCHEDULED = range(5)
STATE_NAMES = ("idle", "waiting", "holding", "draining", "unscheduled")
# enum nvs_job, enum nvs_job_result
JOB_NONE, JOB_DRAIN, JOB_PROBE, JOB_SWAP_OUT, JOB_PREFETCH, JOB_PREFETCH_AHEAD = range(6)
RESULT_DRAINED, RESULT_ACTIVE, RESULT_DEFERRED, RESULT_MOVED = 1, 2, 3, 4
# enum nvs_action_kind
(ACT_SEND, ACT_GATE, ACT_JOB, ACT_LOG, ACT_CONNECT, ACT_DISCONNECT, ACT_ADMISSION, ACT_LIMIT, ACT_SETTLED, ACT_SWAP_AREA,
 ACT_POOL, ACT_COLLECTIVES, ACT_SWAP_OUT_CUT, ACT_POOL_NEED) = range(1, 15)
NO_LIMIT = 2**64 - 1  # NVS_CORE_NO_LIMIT (of ACT_COLLECTIVES)
# Levels of ACT_LOG (0 error .. 3 debug).
LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG = range(4)
UNADMITTED = 2**64 - 1  # NVS_CORE_UNADMITTED
MAX_DEVICES = 64  # NVS_CORE_MAX_DEVICES
ECONNREFUSED = 111


class _Config(ctypes.Structure):
    """struct nvs_core_config."""

    _fields_ = [
        ("fail_open", ctypes.c_int),
        ("idle_release_ms", ctypes.c_long),
        ("predrain", ctypes.c_int),
        ("log_level", ctypes.c_int),
        ("pid", ctypes.c_long),
        ("session", ctypes.c_char * 17),
        ("host", ctypes.c_char * 256),
        ("container", ctypes.c_char * 80),
        ("pod", ctypes.c_char * 256),
        ("pod_namespace", ctypes.c_char * 256),
        ("program", ctypes.c_char * 128),
        ("socket_path", ctypes.c_char * 256),
        ("gang", ctypes.c_char * 128),
        ("gang_size", ctypes.c_uint64),
        ("counts_collectives", ctypes.c_int),
    ]


class _Action(ctypes.Structure):
    """struct nvs_action."""

    _fields_ = [("kind", ctypes.c_int), ("device", ctypes.c_int), ("value", ctypes.c_int), ("len", ctypes.c_size_t),
                ("bytes", ctypes.c_uint64)]


class _Swap(ctypes.Structure):
    """struct nvs_core_swap: the process's swap engine (1 copy, 2 migrate), its area, bandwidths,
    whether the area is its user's pool."""

    _fields_ = [("engine", ctypes.c_int), ("area", ctypes.c_uint64), ("out_bps", ctypes.c_uint64),
                ("in_bps", ctypes.c_uint64), ("pool", ctypes.c_int)]


_d, _u64, _p, _int, _str = ctypes.c_double, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
# Every function of client_core.h used from Python: name -> (argument types, result type).
SIGNATURES: dict[str, tuple[list, object]] = {
    "nvs_core_size": ([], ctypes.c_size_t),
    "nvs_core_init": ([_p, ctypes.POINTER(_Config)], None),
    "nvs_core_forked": ([_p, ctypes.c_long, _str], None),
    "nvs_core_add_device": ([_p, _int, _str, _str, _u64], _int),
    "nvs_core_use_device": ([_p, _int], None),
    "nvs_core_observe": ([_p, _int, _int, _int, _u64, _u64], None),
    "nvs_core_observe_admission": ([_p, _int, _u64], None),
    "nvs_core_observe_residency": ([_p, _int, _u64, _u64], None),
    "nvs_core_observe_swap": ([_p, ctypes.POINTER(_Swap)], None),
    "nvs_core_observe_collectives": ([_p, _int, _u64], None),
    "nvs_core_collectives_limited": ([_p, _int, _u64, _d], None),
    "nvs_core_connected": ([_p, _d], None),
    "nvs_core_connect_failed": ([_p, _int, _int, _d], None),
    "nvs_core_disconnected": ([_p, _str, _d], None),
    "nvs_core_receive": ([_p, _str, ctypes.c_size_t, _d], None),
    "nvs_core_job_done": ([_p, _int, _int, _d], None),
    "nvs_core_release": ([_p, _int, _str, _d], _int),
    "nvs_core_tick": ([_p, _d], None),
    "nvs_core_exit": ([_p, _d], None),
    "nvs_core_next_deadline": ([_p, _d], _d),
    "nvs_core_pop": ([_p, ctypes.POINTER(_Action), _str, ctypes.c_size_t, _d], _int),
    "nvs_core_state": ([_p, _int], _int),
    "nvs_core_gate": ([_p, _int], _int),
    "nvs_core_registered": ([_p], _int),
    "nvs_core_lease_until": ([_p], _d),
    "nvs_core_admitted": ([_p, _int], _u64),
    "nvs_core_limit": ([_p, _str], _u64),
}


def load(path: str | Path) -> ctypes.CDLL:
    """The core library at `path`, its functions typed."""
    lib = ctypes.CDLL(str(path))
    for name, (args, result) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = args
        function.restype = result
    return lib


@functools.cache
def default_library() -> ctypes.CDLL:
    """The installed core (or the one NVSHARE_CORE_LIBRARY names), loaded once per process."""
    return load(library.core_path())


@dataclass
class Action:
    """One popped nvs_action: `data` is a SEND's encoded message or a LOG's text."""

    kind: int
    device: int
    value: int
    data: bytes = b""
    bytes: int = 0  # JOB: what a swap job moves; LIMIT: the limit; SWAP_AREA, POOL: their sizes; COLLECTIVES: the limit


def _text(value: str, size: int) -> bytes:
    """A text for a char[size] field of the config: UTF-8, cut to fit with its NUL."""
    return value.encode(errors="replace")[: size - 1]


class ClientCore:
    """One struct nvs_core: a thin, typed wrapper over the C functions. Not thread-safe: its
    owner serialises every call."""

    def __init__(self, lib: ctypes.CDLL, pid: int, session: str, *, fail_open: bool = False,
                 idle_release_ms: int = -1, predrain: bool = True, log_level: int = LOG_DEBUG, host: str = "",
                 container: str = "", pod: str = "", namespace: str = "", program: str = "",
                 socket_path: str = "", gang: str = "", gang_size: int = 0, counts_collectives: bool = False) -> None:
        """`gang`, `gang_size`: the multi-GPU job this process is a rank of, for HELLO (what the
        interceptor's gang discovery finds, interceptor/gang.c); "" for none. `counts_collectives`:
        the owner counts the collectives launched and carries out ACT_COLLECTIVES (the
        interceptor does; a Python program launches none)."""
        self.lib = lib
        self.buf = ctypes.create_string_buffer(lib.nvs_core_size())
        config = _Config(fail_open=int(fail_open), idle_release_ms=idle_release_ms, predrain=int(predrain),
                         log_level=log_level, pid=pid, session=session.encode(), host=_text(host, 256),
                         container=_text(container, 80), pod=_text(pod, 256), pod_namespace=_text(namespace, 256),
                         program=_text(program, 128), socket_path=_text(socket_path, 256),
                         gang=_text(gang, 128), gang_size=gang_size, counts_collectives=int(counts_collectives))
        lib.nvs_core_init(self.buf, ctypes.byref(config))
        self._action = _Action()
        self._data = ctypes.create_string_buffer(protocol.MAX_MESSAGE + 1)

    def copy(self) -> "ClientCore":
        """An independent core in the same state (struct nvs_core holds no pointer of its own),
        to try what an event would do without doing it."""
        twin = object.__new__(ClientCore)
        twin.lib = self.lib
        twin.buf = ctypes.create_string_buffer(len(self.buf))
        ctypes.memmove(twin.buf, self.buf, len(self.buf))
        twin._action = _Action()
        twin._data = ctypes.create_string_buffer(len(self._data))
        return twin

    def add_device(self, index: int, uuid: str, total: int = 1 << 34, name: str = "Sim GPU") -> None:
        if self.lib.nvs_core_add_device(self.buf, index, uuid.encode(), name.encode(), total) != 0:
            raise ValueError(f"device {index} cannot be {uuid!r}")

    def use_device(self, index: int) -> None:
        """The program uses the device (it is announced before any memory or lock message)."""
        self.lib.nvs_core_use_device(self.buf, index)

    def observe(self, index: int, waiters: int, captures: int, entered: int, used: int, converted: int = 0,
                swapped: int = 0) -> None:
        """`converted`: of `used`, what nvshare made managed (what a swap can move)."""
        self.lib.nvs_core_observe(self.buf, index, waiters, captures, entered, used)
        self.lib.nvs_core_observe_residency(self.buf, index, converted, swapped)

    def observe_swap(self, engine: int = 1, area: int = 0, out_bps: int = 0, in_bps: int = 0, pool: bool = False) -> None:
        self.lib.nvs_core_observe_swap(self.buf, ctypes.byref(_Swap(engine, area, out_bps, in_bps, int(pool))))

    def observe_collectives(self, index: int, launched: int) -> None:
        self.lib.nvs_core_observe_collectives(self.buf, index, launched)

    def collectives_limited(self, index: int, launched: int, now: float) -> None:
        """The owner carried out the device's last ACT_COLLECTIVES; `launched` then."""
        self.lib.nvs_core_collectives_limited(self.buf, index, launched, now)

    def observe_admission(self, index: int, wanted: int) -> None:
        self.lib.nvs_core_observe_admission(self.buf, index, wanted)

    def admitted(self, index: int) -> int | None:
        """The admitted total, None while admission is not in force (nothing waits)."""
        total = self.lib.nvs_core_admitted(self.buf, index)
        return None if total == UNADMITTED else total

    def limit(self, uuid: str) -> int:
        """The scheduler's memory limit of the device in bytes, 0: none."""
        return self.lib.nvs_core_limit(self.buf, uuid.encode())

    def connected(self, now: float) -> None:
        self.lib.nvs_core_connected(self.buf, now)

    def connect_failed(self, now: float, errno: int = ECONNREFUSED) -> None:
        self.lib.nvs_core_connect_failed(self.buf, errno, 0, now)

    def disconnected(self, why: str, now: float) -> None:
        self.lib.nvs_core_disconnected(self.buf, why.encode(), now)

    def receive(self, data: bytes, now: float) -> None:
        self.lib.nvs_core_receive(self.buf, data, len(data), now)

    def job_done(self, index: int, result: int, now: float) -> None:
        self.lib.nvs_core_job_done(self.buf, index, result, now)

    def release(self, index: int, reason: str, now: float) -> None:
        """The program gives the device back itself ("user" or "quantum")."""
        if self.lib.nvs_core_release(self.buf, index, reason.encode(), now) != 0:
            raise ValueError(f"cannot release device {index} with reason {reason!r}")

    def tick(self, now: float) -> None:
        self.lib.nvs_core_tick(self.buf, now)

    def exit(self, now: float) -> None:
        self.lib.nvs_core_exit(self.buf, now)

    def forked(self, pid: int, session: str) -> None:
        self.lib.nvs_core_forked(self.buf, pid, session.encode())

    def next_deadline(self, now: float) -> float:
        return self.lib.nvs_core_next_deadline(self.buf, now)

    def state(self, index: int) -> int:
        return self.lib.nvs_core_state(self.buf, index)

    def gate(self, index: int) -> bool:
        return bool(self.lib.nvs_core_gate(self.buf, index))

    def lease_until(self) -> float:
        return self.lib.nvs_core_lease_until(self.buf)

    @property
    def registered(self) -> bool:
        return bool(self.lib.nvs_core_registered(self.buf))

    def pop_one(self, now: float) -> Action | None:
        """The oldest action, None when none is left."""
        action, data = self._action, self._data
        if not self.lib.nvs_core_pop(self.buf, ctypes.byref(action), data, len(data), now):
            return None
        return Action(action.kind, action.device, action.value, data.raw[: action.len], action.bytes)

    def pop(self, now: float) -> list[Action]:
        """Every action queued, oldest first."""
        out = []
        while (action := self.pop_one(now)) is not None:
            out.append(action)
        return out
