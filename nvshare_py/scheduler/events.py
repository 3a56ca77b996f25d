"""Inputs and outputs of the sans-I/O lock core (nvshare_py.scheduler.core).

The core never reads a clock, touches a socket or logs: the daemon feeds it events (each
carrying `now`, seconds on a monotonic clock) and carries out the actions it returns.

`from_client` at the end is the one translation of the client socket's messages into events:
the messages with a `FROM_CLIENT` row become their own events, every other one a `ClientMessage`
that carries the decoded message to the core's handler for its class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Hashable, Literal, Mapping, TypeVar

from .. import protocol
from ..vocabulary import Mode, ReleaseReason, is_release_reason

__all__ = ["Mode"]  # with everything defined here

ClientKey = Hashable  # opaque to the core: the daemon's own number for the connection


@dataclass(frozen=True)
class ClientInfo:
    """Who a client is. `pid` is what the client reports (its own pid namespace);
    `host_pid`/`uid` come from the kernel (SO_PEERCRED) and are 0/None when not visible.
    `pod_uid` is the Kubernetes pod the daemon found the process in (its cgroup, read through
    the kernel-verified host pid), "" outside a pod: unlike `pod`/`namespace`, which the client
    says about itself, a client cannot choose it, so settings given per pod are matched on it.
    `user` is the name of `uid` on the daemon's host (the uid's number where it has none),
    looked up by the daemon when the client registers; "" when the uid is not visible.

    `host_start` is when the host pid's process started (/proc/<pid>/stat, clock ticks since
    boot; 0: unknown): with uid and host pid it names one process for its whole life, also
    after it registered afresh (per-client settings follow it, fairshare.Settings.park)."""

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
    user: str = ""
    host_start: int = 0


def key_values(fields: dict[str, object]) -> str:
    """`key=value` pairs, values with spaces, quotes or '=' (or empty ones) JSON-quoted: the
    form of log fields and of lock-event details that carry several facts."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\n\t'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def register_detail(info: ClientInfo) -> str:
    """The detail of a `register` lock event: who registered (pid, user, program, and the pod as
    namespace/pod when it names one), so that the timeline still names a client after it left.
    nvshare_py/timeline.py reads it back."""
    fields: dict[str, object] = {"pid": info.pid}
    if info.user:
        fields["user"] = info.user
    if info.program:
        fields["program"] = info.program
    if info.pod or info.namespace:
        fields["pod"] = f"{info.namespace}/{info.pod}"
    return key_values(fields)


# --- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Register:
    now: float
    client: ClientKey
    info: ClientInfo
    held: tuple[str, ...] = ()
    wanted: tuple[str, ...] = ()
    # The multi-GPU job the process belongs to (HELLO gang=, gang_size=; gangs.py): "" none.
    gang: str = ""
    gang_size: int = 0


@dataclass(frozen=True)
class HandleClaims:
    """Handle the next claims of `client`'s HELLO (the daemon feeds it after ClaimsLeft, in the
    turn of the client's principal): a HELLO's claims are handled a bounded number per step, so
    that one HELLO with many never holds up other users' messages for long."""

    now: float
    client: ClientKey


@dataclass(frozen=True)
class DeviceInfo:
    now: float
    client: ClientKey
    device: str
    total: int
    name: str = ""


@dataclass(frozen=True)
class DeviceMeasured:
    """The daemon measured a device itself (NVML, nvshare_py/scheduler/measure.py): its memory
    in bytes. Only this and the operator's budget size a device: a client's DEVICE is not
    trusted for it (docs/scheduler.md, security model)."""

    now: float
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
    pool: bool = False  # its area is its user's swap pool


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
    reason: ReleaseReason = "user"
    resident: int | None = None


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
class ClientMessage:
    """A registered client's message that needs no event of its own: the core's handler for its
    class (SchedulerCore._client_handlers) reads the message as decoded. Every message of the
    client without a FROM_CLIENT row comes as one; one of a class the core has no handler for
    is ignored (a receiver accepts what it does not know), though it counts as a sign of life."""

    now: float
    client: ClientKey
    message: protocol.Message

    @property
    def device(self) -> str | None:
        """The device the message names, None if it names none: the daemon checks the client's
        quota against it (quotas.py) as for any event of a client that names a device."""
        device = getattr(self.message, "device", None)
        return device if isinstance(device, str) else None


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
    spill: int | Literal["auto"] | None = None  # "auto": CoreConfig.auto_spill
    keep_spill: bool = True
    policy: str | None = None
    timeout: float | None = None
    share: float | None = None


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


# The events of a registered client's connection (from_client's, and Unregister when it goes):
# the core finds their client first.
FromClient = (
    DeviceInfo | MemoryReport | AcquireRequest | AdmitRequest | ReleaseReport | ClientMessage | Alive | Unregister
)

Event = (
    Register | HandleClaims | DeviceMeasured | FromClient
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


# Every kind of log line the core writes; views.WORDING has a sentence for each (a test checks
# that the two agree, and mypy that nothing else is logged).
LogKind = Literal[
    "admission-refused",
    "admission-set",
    "admission-waits",
    "budget-set",
    "claim-kept",
    "claim-refused",
    "contended",
    "device-measured",
    "dropped",
    "evict-asked",
    "evict-taken-back",
    "evict-timeout",
    "evicted-stale",
    "fenced-stale",
    "from-unregistered",
    "gang-incomplete",
    "gang-joined",
    "gang-refused",
    "gang-size-differs",
    "gang-waits",
    "grant-passes",
    "granted",
    "lent",
    "limit-sent",
    "limit-set",
    "mode-set",
    "prefetch-ahead",
    "pool",
    "prepare",
    "priority-set",
    "recovered",
    "registered",
    "released",
    "released-revoked",
    "released-stale",
    "replaced",
    "revoked",
    "second-registration",
    "silent-removed",
    "tq-set",
    "turn-granted",
    "unhandled-message",
    "unregistered",
    "weight-set",
]


@dataclass(frozen=True)
class Log:
    """Something worth a log line: `what` names it (views.WORDING words it), `fields` are its
    facts."""

    level: Literal["debug", "info", "warning"]
    what: LogKind
    fields: dict[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True)
class ClaimsLeft:
    """The registration's HELLO claims devices the core has not handled yet: feed
    HandleClaims(now, client) when its principal's next turn comes."""

    client: ClientKey


Action = Send | Forget | Log | LockEvent | ClaimsLeft


class ControlError(ValueError):
    """A control request refused, by the daemon (malformed request) or the core (unknown
    device, bad value), before anything changed; `code` is the control-protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# --- the client socket's messages as events ------------------------------------------------
# HELLO and QUERY are not here: the daemon registers a HELLO with what the kernel says about
# the peer, and answers a QUERY itself. A new message of the client needs no row here: without
# one it reaches the core as a ClientMessage, so adding it takes its table row, its sender and
# its handler. A row is for a message the core wants as something other than the wire says
# (RELEASE with its reason checked, BYE as the Unregister a lost connection makes too) or one
# that the core's tests and simulations feed as an event of its own (ACQUIRE, MEMORY, ...).

_M = TypeVar("_M", bound=protocol.Message)
Translation = Callable[[float, ClientKey, Any], FromClient]


def _row(kind: type[_M], translate: Callable[[float, ClientKey, _M], FromClient]) -> tuple[type[protocol.Message], Translation]:
    return kind, translate


def _release(now: float, client: ClientKey, message: protocol.Release) -> ReleaseReport:
    # A reason this scheduler does not know (a newer client's) counts as `user`: the lock is
    # given back all the same.
    reason: ReleaseReason = message.reason if is_release_reason(message.reason) else "user"
    return ReleaseReport(now, client, message.device, message.grant, reason, message.resident)


# message class -> its event, given the time it arrived and the connection's key.
FROM_CLIENT: Final[Mapping[type[protocol.Message], Translation]] = dict([
    _row(protocol.DeviceAnnouncement, lambda now, client, m: DeviceInfo(now, client, m.device, m.total, m.name)),
    _row(protocol.Memory, lambda now, client, m: MemoryReport(now, client, m.device, m.used, m.resident, m.engine,
                                                               m.area, m.out_bps, m.in_bps, m.pool)),
    _row(protocol.Acquire, lambda now, client, m: AcquireRequest(now, client, m.device)),
    _row(protocol.Admit, lambda now, client, m: AdmitRequest(now, client, m.device, m.request, m.bytes)),
    _row(protocol.Release, _release),
    _row(protocol.Heartbeat, lambda now, client, m: Alive(now, client)),
    _row(protocol.Bye, lambda now, client, m: Unregister(now, client, "bye")),
])


def from_client(now: float, client: ClientKey, message: protocol.Message) -> FromClient:
    """The event of a registered client's `message`, arrived at `now` on connection `client`."""
    translate = FROM_CLIENT.get(type(message))
    return translate(now, client, message) if translate is not None else ClientMessage(now, client, message)
