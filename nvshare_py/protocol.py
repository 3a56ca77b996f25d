"""Wire protocol v1 of the client socket: message types and their text codec.

See docs/protocol.md. Every message is one ZeroMQ frame of at most MAX_MESSAGE bytes:

    NVSHARE/1 TYPE
    key=value
    ...

`decode` raises ProtocolError (with one of the documented error codes) on anything it does not
accept, so the daemon can answer with an ERROR message instead of crashing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Callable, ClassVar

VERSION = 1
MAX_MESSAGE = 4096
# The control socket (JSON, docs/protocol.md): request and reply size limits.
CONTROL_REQUEST_MAX = 64 * 1024
CONTROL_REPLY_MAX = 8 * 1024 * 1024
# The daemon keeps this many lock events, and one `events` request returns at most this many.
CONTROL_EVENTS_MAX = 10_000
MAX_FIELDS = 32
MAX_VALUE = 1024
MAX_INT = 2**63 - 1
# Devices one registration may name (HELLO's held and wanted, DEVICE, MEMORY, ACQUIRE): bounds
# what one client makes the scheduler keep and work on (issue 12).
MAX_DEVICES = 64

MODES = ("on", "off", "auto")
RELEASE_REASONS = ("idle", "drop", "quantum", "revoke", "user")
DROP_REASONS = ("quantum", "mode", "memory", "conflict")
REVOKE_REASONS = ("grace-expired",)
ADMISSION_POLICIES = ("fifo", "best-fit", "recent", "random")
REFUSE_REASONS = ("timeout", "too-large", "limit")
ERROR_CODES = (
    "malformed",
    "too-large",
    "unsupported-version",
    "unknown-type",
    "bad-field",
    "not-registered",
    "already-registered",
)

_HEADER = re.compile(r"NVSHARE/([0-9]{1,4}) ([A-Z]{1,16})\Z")
_KEY = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
_DEVICE = re.compile(r"[A-Za-z0-9-]{1,96}\Z")
_SESSION = re.compile(r"[0-9a-f]{16}\Z")
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


class ProtocolError(ValueError):
    """A message that cannot be accepted; `code` is the ERROR code to answer with."""

    def __init__(self, code: str, detail: str, msg_type: str = "") -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.msg_type = msg_type


# Field kinds: how a dataclass field is written and parsed.
def _device(value: str) -> str:
    if not _DEVICE.match(value):
        raise ValueError("not a device id")
    return value


def _uint(value: str) -> int:
    # isascii: str.isdigit alone accepts other scripts' digits (int() reads "٣" as 3).
    if not (value.isascii() and value.isdigit()) or len(value) > 19:
        raise ValueError("not an unsigned integer")
    number = int(value)
    if number > MAX_INT:
        raise ValueError("integer too large")
    return number


def _text(value: str) -> str:
    return value


def _session(value: str) -> str:
    if not _SESSION.match(value):
        raise ValueError("session must be 16 lowercase hex digits")
    return value


def _devices(value: str) -> tuple[str, ...]:
    if value == "":
        return ()
    items = value.split(",")
    if len(items) > MAX_DEVICES:
        raise ValueError(f"more than {MAX_DEVICES} devices")
    return tuple(_device(item) for item in items)


def _choice(options: tuple[str, ...]):
    def parse(value: str) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value

    return parse


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return value == "1"


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def _json_object(value: str) -> str:
    try:
        document = json.loads(value)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    return value


def _meta(parse, required: bool = True, max_bytes: int = MAX_VALUE, omit: object = "") -> dict:
    """`omit`: an optional field holding this value is left out of the encoded message (the
    residency fields are written only when they say something, so a handoff whose memory fits
    reads exactly as before they existed)."""
    return {"parse": parse, "required": required, "max_bytes": max_bytes, "omit": omit}


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, Callable[[str], object], bool, object], ...]:
    """(name, parser, required, omitted value) of each field; computed once per message type
    because the codec is on the lock-handoff path."""
    return tuple((f.name, f.metadata["parse"], f.metadata["required"], f.metadata["omit"])
                 for f in dataclasses.fields(cls))


@functools.cache
def _longer_values(cls: type) -> dict[str, int]:
    """The fields of `cls` whose values may exceed MAX_VALUE, with their own limit."""
    return {f.name: f.metadata["max_bytes"] for f in dataclasses.fields(cls) if f.metadata["max_bytes"] != MAX_VALUE}


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""

    def encode(self) -> bytes:
        lines = [f"NVSHARE/{VERSION} {self.TYPE}"]
        longer = _longer_values(type(self))
        for name, _, required, omit in _schema(type(self)):
            value = getattr(self, name)
            if not required and (value == () or value == omit):
                continue
            text = _format(value)
            if _CONTROL_CHARS.search(text):
                raise ValueError(f"{self.TYPE}.{name} contains control characters")
            limit = longer.get(name, MAX_VALUE)
            if len(text.encode()) > limit:
                raise ValueError(f"{self.TYPE}.{name} is longer than {limit} bytes")
            lines.append(f"{name}={text}")
        data = "\n".join(lines).encode()
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"{self.TYPE} message is {len(data)} bytes, over {MAX_MESSAGE}")
        return data


# --- client -> scheduler -------------------------------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    TYPE: ClassVar[str] = "HELLO"
    pid: int = field(metadata=_meta(_uint))
    session: str = field(metadata=_meta(_session))
    host: str = field(default="", metadata=_meta(_text, False))
    container: str = field(default="", metadata=_meta(_text, False))
    pod: str = field(default="", metadata=_meta(_text, False))
    namespace: str = field(default="", metadata=_meta(_text, False))
    program: str = field(default="", metadata=_meta(_text, False))
    held: tuple[str, ...] = field(default=(), metadata=_meta(_devices, False))
    wanted: tuple[str, ...] = field(default=(), metadata=_meta(_devices, False))


@dataclass(frozen=True)
class Device(Message):
    TYPE: ClassVar[str] = "DEVICE"
    device: str = field(metadata=_meta(_device))
    total: int = field(metadata=_meta(_uint))
    name: str = field(default="", metadata=_meta(_text, False))


@dataclass(frozen=True)
class Memory(Message):
    """`resident` (optional): the client's converted bytes it believes are on the device; None
    (absent) from a client that does not take part in residency (docs/protocol.md, Residency).
    The swap engine's figures (optional, from a client that swaps): `engine` how it moves memory
    ("copy": pinned copies and discards at link speed, "migrate": the driver's prefetch; any
    other text is shown as it is), `area` the pinned bytes it has ready, `out_bps`/`in_bps` the
    bandwidths its last moves reached (bytes per second)."""

    TYPE: ClassVar[str] = "MEMORY"
    device: str = field(metadata=_meta(_device))
    used: int = field(metadata=_meta(_uint))
    resident: int | None = field(default=None, metadata=_meta(_uint, False, omit=None))
    engine: str = field(default="", metadata=_meta(_text, False))
    area: int | None = field(default=None, metadata=_meta(_uint, False, omit=None))
    out_bps: int = field(default=0, metadata=_meta(_uint, False, omit=0))
    in_bps: int = field(default=0, metadata=_meta(_uint, False, omit=0))


@dataclass(frozen=True)
class Acquire(Message):
    TYPE: ClassVar[str] = "ACQUIRE"
    device: str = field(metadata=_meta(_device))


@dataclass(frozen=True)
class Release(Message):
    TYPE: ClassVar[str] = "RELEASE"
    device: str = field(metadata=_meta(_device))
    grant: int = field(metadata=_meta(_uint))
    reason: str = field(default="user", metadata=_meta(_choice(RELEASE_REASONS), False))
    # After the eviction a DROP asked for: what stays on the device (as MEMORY.resident).
    resident: int | None = field(default=None, metadata=_meta(_uint, False, omit=None))


@dataclass(frozen=True)
class Evicted(Message):
    """The answer to EVICT: the client's converted bytes still on the device."""

    TYPE: ClassVar[str] = "EVICTED"
    device: str = field(metadata=_meta(_device))
    resident: int = field(metadata=_meta(_uint))


@dataclass(frozen=True)
class Admit(Message):
    """Before an allocation takes the process's total on the device past what was admitted:
    it wants the total to reach `bytes`, and waits for ADMITTED or REFUSED naming `request`.
    `request=0` gives admission back down to `bytes` (its use fell); it has no answer."""

    TYPE: ClassVar[str] = "ADMIT"
    device: str = field(metadata=_meta(_device))
    request: int = field(metadata=_meta(_uint))
    bytes: int = field(metadata=_meta(_uint))


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "HEARTBEAT"


@dataclass(frozen=True)
class Bye(Message):
    TYPE: ClassVar[str] = "BYE"


@dataclass(frozen=True)
class Query(Message):
    """What the scheduler knows of the asking process's registrations; allowed before HELLO and
    answered by STATUS. The connection that asks need not be registered (and is not by asking)."""

    TYPE: ClassVar[str] = "QUERY"


# --- scheduler -> client -------------------------------------------------------------------


@dataclass(frozen=True)
class Welcome(Message):
    TYPE: ClassVar[str] = "WELCOME"
    client: str = field(metadata=_meta(_text))
    heartbeat_ms: int = field(metadata=_meta(_uint))
    idle_release_ms: int = field(metadata=_meta(_uint))
    version: int = field(default=VERSION, metadata=_meta(_uint))
    # 1: this scheduler answers ADMIT (clients ask before crossing their admitted totals);
    # absent or 0: clients never ask.
    admission: bool = field(default=False, metadata=_meta(_flag, False, omit=False))


@dataclass(frozen=True)
class Grant(Message):
    TYPE: ClassVar[str] = "GRANT"
    device: str = field(metadata=_meta(_device))
    grant: int = field(metadata=_meta(_uint))
    mode: str = field(metadata=_meta(_choice(MODES)))
    exclusive: bool = field(metadata=_meta(_flag))
    quantum_ms: int = field(metadata=_meta(_uint))
    # Bytes of the grantee's evicted memory it may bring back in bulk as the gate opens.
    prefetch: int = field(default=0, metadata=_meta(_uint, False, omit=0))


@dataclass(frozen=True)
class Drop(Message):
    TYPE: ClassVar[str] = "DROP"
    device: str = field(metadata=_meta(_device))
    grant: int = field(metadata=_meta(_uint))
    grace_ms: int = field(metadata=_meta(_uint))
    reason: str = field(metadata=_meta(_choice(DROP_REASONS)))
    # Bytes of converted memory the holder moves to the host in bulk before its RELEASE.
    evict: int = field(default=0, metadata=_meta(_uint, False, omit=0))


@dataclass(frozen=True)
class Evict(Message):
    """To a client that does not hold the lock: move `bytes` of its converted memory to the
    host now, to make room for a grant, and answer EVICTED."""

    TYPE: ClassVar[str] = "EVICT"
    device: str = field(metadata=_meta(_device))
    bytes: int = field(metadata=_meta(_uint))


@dataclass(frozen=True)
class Contended(Message):
    """Others wait for the device while this grant's quantum runs: the holder may drain ahead
    of its end so that the lock changes hands on time. A notice: nothing must be done.
    `evict` (optional): the bytes its release will be asked to move to the host (a drain ahead of
    time moves them before its RELEASE); `idle_ms` (optional): while others wait, release early
    only after this long idle (what the handoff would cost in swapping)."""

    TYPE: ClassVar[str] = "CONTENDED"
    device: str = field(metadata=_meta(_device))
    grant: int = field(metadata=_meta(_uint))
    quantum_left_ms: int = field(metadata=_meta(_uint))
    evict: int = field(default=0, metadata=_meta(_uint, False, omit=0))
    idle_ms: int = field(default=0, metadata=_meta(_uint, False, omit=0))


@dataclass(frozen=True)
class Prepare(Message):
    """Swapping: keep a pinned swap area of `bytes` ready for this device (the most of its
    memory it may be asked to hold on the host at once); 0: none is needed any more."""

    TYPE: ClassVar[str] = "PREPARE"
    device: str = field(metadata=_meta(_device))
    bytes: int = field(metadata=_meta(_uint))


@dataclass(frozen=True)
class Prefetch(Message):
    """Swapping, to a waiter ahead of its GRANT: bring swapped-out memory back until `resident`
    bytes of it are on the device (room others have made). Its gate stays closed."""

    TYPE: ClassVar[str] = "PREFETCH"
    device: str = field(metadata=_meta(_device))
    resident: int = field(metadata=_meta(_uint))


@dataclass(frozen=True)
class Revoke(Message):
    TYPE: ClassVar[str] = "REVOKE"
    device: str = field(metadata=_meta(_device))
    grant: int = field(metadata=_meta(_uint))
    reason: str = field(metadata=_meta(_choice(REVOKE_REASONS)))


@dataclass(frozen=True)
class ModeNotice(Message):
    TYPE: ClassVar[str] = "MODE"
    device: str = field(metadata=_meta(_device))
    mode: str = field(metadata=_meta(_choice(MODES)))
    quantum_ms: int = field(metadata=_meta(_uint))


@dataclass(frozen=True)
class Admitted(Message):
    """The answer to ADMIT `request`: the process may hold up to `bytes` on the device (at
    least what it asked; more is a chunk given ahead so that it need not ask again soon)."""

    TYPE: ClassVar[str] = "ADMITTED"
    device: str = field(metadata=_meta(_device))
    request: int = field(metadata=_meta(_uint))
    bytes: int = field(metadata=_meta(_uint))


@dataclass(frozen=True)
class Limit(Message):
    """The memory limit the scheduler sets for this client on the device (nvsharectl
    set-limit); 0: none from the scheduler. It can only lower the process's own
    NVSHARE_MEMORY_LIMIT: the client applies the smaller of the two."""

    TYPE: ClassVar[str] = "LIMIT"
    device: str = field(metadata=_meta(_device))
    bytes: int = field(metadata=_meta(_uint))


@dataclass(frozen=True)
class Refused(Message):
    """The answer to ADMIT `request` when it will not be admitted: `too-large` (more than the
    whole capacity), `timeout` (waited past the admission timeout), `limit` (past a limit set
    for the client). The allocation fails with CUDA_ERROR_OUT_OF_MEMORY."""

    TYPE: ClassVar[str] = "REFUSED"
    device: str = field(metadata=_meta(_device))
    request: int = field(metadata=_meta(_uint))
    reason: str = field(metadata=_meta(_choice(REFUSE_REASONS)))


@dataclass(frozen=True)
class Error(Message):
    TYPE: ClassVar[str] = "ERROR"
    code: str = field(metadata=_meta(_choice(ERROR_CODES)))
    detail: str = field(default="", metadata=_meta(_text, False))
    type: str = field(default="", metadata=_meta(_text, False))


# "NVSHARE/1 STATUS\njson=": what the document may fill of the message.
STATUS_DOCUMENT_MAX = MAX_MESSAGE - len(f"NVSHARE/{VERSION} STATUS\njson=")


@dataclass(frozen=True)
class Status(Message):
    """The answer to QUERY: `json` is a compact JSON object (docs/protocol.md, Queries); the only
    value allowed to be longer than MAX_VALUE. Build it with `Status.of(document)`."""

    TYPE: ClassVar[str] = "STATUS"
    json: str = field(metadata=_meta(_json_object, max_bytes=STATUS_DOCUMENT_MAX))

    @classmethod
    def of(cls, document: dict) -> "Status":
        """Encode `document`, leaving out devices from the end of its "devices" list until it
        fits; "truncated" then says how many were left out."""
        devices = list(document.get("devices", ()))
        left_out = 0
        while True:
            shown = {**document, "devices": devices}
            if left_out:
                shown["truncated"] = left_out
            text = json.dumps(shown, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            if len(text.encode()) <= STATUS_DOCUMENT_MAX or not devices:
                return cls(json=text)
            devices.pop()
            left_out += 1

    def document(self) -> dict:
        return json.loads(self.json)


CLIENT_MESSAGES = {m.TYPE: m for m in (Hello, Device, Memory, Acquire, Admit, Release, Evicted, Heartbeat, Bye,
                                       Query)}
# What a registered client may receive. STATUS is not among them: only a connection that sent
# QUERY receives it, and it reads replies with QUERY_REPLIES.
SCHEDULER_MESSAGES = {m.TYPE: m for m in (Welcome, Grant, Drop, Evict, Contended, Revoke, ModeNotice, Limit, Admitted,
                                          Refused, Error, Prepare, Prefetch)}
QUERY_REPLIES = {m.TYPE: m for m in (Status, Error)}


def decode(data: bytes, catalogue: dict[str, type[Message]] = CLIENT_MESSAGES) -> Message:
    """Parse one frame; `catalogue` says which side's messages are acceptable."""
    if len(data) > MAX_MESSAGE:
        raise ProtocolError("too-large", f"{len(data)} bytes, limit {MAX_MESSAGE}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("malformed", "not UTF-8") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise ProtocolError("malformed", "empty message")
    header = _HEADER.match(lines[0])
    if header is None:
        raise ProtocolError("malformed", "first line must be 'NVSHARE/<version> <TYPE>'")
    version, msg_type = int(header.group(1)), header.group(2)
    if version != VERSION:
        raise ProtocolError("unsupported-version", f"version {version}; this side speaks {VERSION}", msg_type)
    cls = catalogue.get(msg_type)
    if cls is None:
        raise ProtocolError("unknown-type", f"unknown message type {msg_type}", msg_type)
    if len(lines) - 1 > MAX_FIELDS:
        raise ProtocolError("malformed", f"more than {MAX_FIELDS} fields", msg_type)
    raw: dict[str, str] = {}
    longer = _longer_values(cls)
    for line in lines[1:]:
        key, sep, value = line.partition("=")
        if not sep or not _KEY.match(key):
            raise ProtocolError("malformed", f"bad field line {line[:40]!r}", msg_type)
        if key in raw:
            raise ProtocolError("malformed", f"field {key} repeated", msg_type)
        if len(value.encode()) > longer.get(key, MAX_VALUE) or _CONTROL_CHARS.search(value):
            raise ProtocolError("bad-field", f"field {key} too long or has control characters", msg_type)
        raw[key] = value
    kwargs = {}
    for name, parse, required, _ in _schema(cls):
        if name not in raw:
            if required:
                raise ProtocolError("bad-field", f"missing field {name}", msg_type)
            continue
        try:
            kwargs[name] = parse(raw[name])
        except ValueError as exc:
            raise ProtocolError("bad-field", f"field {name}: {exc}", msg_type) from None
    return cls(**kwargs)
