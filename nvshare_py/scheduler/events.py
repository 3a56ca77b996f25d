"""Inputs and outputs of the sans-I/O lock core (nvshare_py.scheduler.core).

The core never reads a clock, touches a socket or logs: the daemon feeds it events (each
carrying `now`, seconds on a monotonic clock) and carries out the actions it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Literal

from .. import protocol

ClientKey = Hashable  # opaque to the core: the daemon's own number for the connection
Mode = Literal["on", "off", "auto"]


@dataclass(frozen=True)
class ClientInfo:
    """Who a client is. `pid` is what the client reports (its own pid namespace);
    `host_pid`/`uid` come from the kernel (SO_PEERCRED) and are 0/None when not visible.
    `pod_uid` is the Kubernetes pod the daemon found the process in (its cgroup, read through
    the kernel-verified host pid), "" outside a pod: unlike `pod`/`namespace`, which the client
    says about itself, a client cannot choose it, so settings given per pod are matched on it."""

    pid: int
    session: str
    host_pid: int = 0
    uid: int | None = None
    host: str = ""
    container: str = ""
    pod: str = ""
    namespace: str = ""
    program: str = ""
    pod_uid: str = ""


# --- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Register:
    now: float
    client: ClientKey
    info: ClientInfo
    held: tuple[str, ...] = ()
    wanted: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeviceInfo:
    now: float
    client: ClientKey
    device: str
    total: int
    name: str = ""


@dataclass(frozen=True)
class MemoryReport:
    now: float
    client: ClientKey
    device: str
    used: int
    resident: int | None = None  # None: the client does not report residency
    # Its swap engine, as MEMORY says (residency.py): "" when it says nothing.
    engine: str = ""
    area: int | None = None
    out_bps: int = 0
    in_bps: int = 0


@dataclass(frozen=True)
class AcquireRequest:
    now: float
    client: ClientKey
    device: str


@dataclass(frozen=True)
class ReleaseReport:
    now: float
    client: ClientKey
    device: str
    grant: int
    reason: str = "user"
    resident: int | None = None


@dataclass(frozen=True)
class EvictedReport:
    """EVICTED: the client's answer to EVICT, with its converted bytes still on the device."""

    now: float
    client: ClientKey
    device: str
    resident: int


@dataclass(frozen=True)
class AdmitRequest:
    """ADMIT: the client wants its total on the device to reach `bytes` (request 0: it gives
    admission back down to `bytes`, no answer)."""

    now: float
    client: ClientKey
    device: str
    request: int
    bytes: int


@dataclass(frozen=True)
class Alive:
    """Any message from a registered client counts as one; the daemon sends this event for
    HEARTBEAT messages and the core refreshes liveness on every other client event too."""

    now: float
    client: ClientKey


@dataclass(frozen=True)
class Unregister:
    """The client is gone: BYE, its process exited (pidfd), its connection closed, ..."""

    now: float
    client: ClientKey
    reason: str  # "bye", "exited", "disconnected", ...


@dataclass(frozen=True)
class Tick:
    """Time passed; sent when `next_deadline()` is reached (and harmless at any other time)."""

    now: float


@dataclass(frozen=True)
class SetMode:
    now: float
    mode: Mode
    device: str | None = None  # None: the default and every device


@dataclass(frozen=True)
class SetQuantum:
    now: float
    seconds: float
    device: str | None = None


@dataclass(frozen=True)
class SetBudget:
    now: float
    device: str
    budget: int | None  # None: back to the device's total memory


@dataclass(frozen=True)
class SetAdmission:
    """The admission settings (nvshare_py/scheduler/admission.py); None: leave as it is, except
    `spill`, where `keep_spill` says whether None means "unchanged" or "admission off"."""

    now: float
    spill: int | None = None
    keep_spill: bool = True
    policy: str | None = None
    timeout: float | None = None


@dataclass(frozen=True)
class SetWeight:
    """A weight (fairshare.WEIGHT_MIN..WEIGHT_MAX) for one registration (`client`, its display
    id), every client of a pod (`pod_uid`), or the default (neither). None removes a client or
    pod setting (the default goes back to fairshare.DEFAULT_WEIGHT)."""

    now: float
    weight: int | None
    client: str | None = None
    pod_uid: str | None = None


@dataclass(frozen=True)
class SetPriority:
    """A priority class (0..7, higher served first); targets and None as in SetWeight."""

    now: float
    priority: int | None
    client: str | None = None
    pod_uid: str | None = None


@dataclass(frozen=True)
class SetLimit:
    """A memory limit in bytes on `device` (None: every device); targets as in SetWeight.
    None removes a client or pod setting, or the default limit."""

    now: float
    limit: int | None
    device: str | None = None
    client: str | None = None
    pod_uid: str | None = None



Event = (
    Register | DeviceInfo | MemoryReport | AcquireRequest | AdmitRequest | ReleaseReport | EvictedReport | Alive | Unregister
    | Tick | SetMode | SetQuantum | SetBudget | SetAdmission | SetWeight | SetPriority | SetLimit
)


# --- actions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    client: ClientKey
    message: protocol.Message


@dataclass(frozen=True)
class Forget:
    """The registration is gone (after Unregister or a heartbeat timeout): drop per-client
    resources such as pidfd watchers. No message is sent to the client."""

    client: ClientKey
    reason: str


@dataclass(frozen=True)
class Log:
    """Something worth a log line: `what` names it (views.WORDING words it), `fields` are its
    facts."""

    level: Literal["debug", "info", "warning"]
    what: str
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LockEvent:
    """One entry of the timeline (docs/protocol.md, Events). `now` is monotonic; the daemon
    converts it to wall-clock time and gives it a sequence number."""

    now: float
    kind: str
    device: str = ""
    client: str = ""  # the client's display id ("c12")
    grant: int = 0
    detail: str = ""


Action = Send | Forget | Log | LockEvent


class ControlError(ValueError):
    """A control request refused, by the daemon (malformed request) or the core (unknown
    device, bad value), before anything changed; `code` is the control-protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
