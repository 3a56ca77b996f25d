"""Wire protocol v1 of the client socket: the message classes and their text codec.

See docs/protocol.md. Every message is one ZeroMQ frame of at most MAX_MESSAGE bytes:

    NVSHARE/1 TYPE
    key=value
    ...

The messages are declared once, in nvshare_py/protocol_table.py: the classes at the end of this
module are generated from it (`python -m nvshare_py.protocol_gen`; the docstring of
protocol_table.py says how to add a message or a field), and the codec below reads its
schemas from it. Never edit the generated classes (about half of this module's length: the
hand-written codec is some 300 lines).

Porting a message or field written as a hand-made dataclass here (before the table): give it a
row in protocol_table.MESSAGES with one `required(name, KIND)` per field that had
`_meta(parse)` and one `optional(name, KIND, default)` per field that had
`_meta(parse, False, omit=...)` (its `omit` value, or its dataclass default, becomes the
default: a sender leaves the field out while it holds it). Kinds: `_device` DEVICE, `_uint`
UINT, `_text` TEXT, `_session` SESSION, `_devices` DEVICES, `_flag` FLAG, `_json_object` JSON,
`_choice(X)` WORD with `words=` X's vocabulary in nvshare_py/vocabulary.py (a new list of
choices becomes a new Vocabulary there). A text the C client reads needs `c_size`. Run the
generator, then drop the hand-written C for it: message.c parses and builds every message of
the table (client_core.c reads `m.<field>`; a word's text is `m.<field>_text`, its number
`m.<vocabulary>`; a client message is built from `struct nvs_out`).

`decode` raises ProtocolError (with one of the documented error codes) on anything it does not
accept, so the daemon can answer with an ERROR message instead of crashing. It accepts keys it
does not know (and ignores them) and words it does not know (kept as text: `unknown_words` names
them); the receiver acts on what the message requires whatever the word (docs/protocol.md,
"Unknown words"). `encode` writes only words of the field's vocabulary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Final, Mapping

from . import vocabulary
from .protocol_table import BY_TYPE, Field, Kind, Sender
# The protocol's limits, for this module's users (defined with the table).
from .protocol_table import MAX_DEVICES as MAX_DEVICES
from .protocol_table import MAX_FIELDS as MAX_FIELDS
from .protocol_table import MAX_INT as MAX_INT
from .protocol_table import MAX_MESSAGE as MAX_MESSAGE
from .protocol_table import MAX_VALUE as MAX_VALUE
from .protocol_table import STATUS_DOCUMENT_MAX as STATUS_DOCUMENT_MAX
from .protocol_table import VERSION as VERSION

# The control socket (JSON, docs/protocol.md): request and reply size limits.
CONTROL_REQUEST_MAX = 64 * 1024
CONTROL_REPLY_MAX = 8 * 1024 * 1024
# The daemon keeps this many lock events, and one `events` request returns at most this many.
CONTROL_EVENTS_MAX = 10_000

_HEADER = re.compile(r"NVSHARE/([0-9]{1,4}) ([A-Z]{1,16})\Z")
_PREFIX = f"NVSHARE/{VERSION} "
_KEY = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
_SESSION = re.compile(r"[0-9a-f]{16}\Z")
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_CHARS_BUT_NEWLINE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")


class ProtocolError(ValueError):
    """A message that cannot be accepted; `code` is the ERROR code to answer with."""

    def __init__(self, code: vocabulary.ErrorCode, detail: str, msg_type: str = "") -> None:
        super().__init__(f"{code}: {detail}")
        self.code: vocabulary.ErrorCode = code
        self.detail = detail
        self.msg_type = msg_type


# --- values: how each Kind of field is read and written ------------------------------------


def _device(value: str) -> str:
    if not vocabulary.DEVICE_ID.match(value):
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


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError("must be 0 or 1")
    return value == "1"


def _word(value: str) -> str:
    # Open: any word is read; the receiver decides what one it does not know means.
    if not vocabulary.WORD_FORM.match(value):
        raise ValueError("not a word ([a-z][a-z0-9-]*, at most 32 characters)")
    return value


def _json_object(value: str) -> str:
    try:
        document = json.loads(value)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    return value


_PARSE: Final[dict[Kind, Callable[[str], object]]] = {
    Kind.DEVICE: _device, Kind.UINT: _uint, Kind.TEXT: _text, Kind.SESSION: _session, Kind.DEVICES: _devices,
    Kind.FLAG: _flag, Kind.WORD: _word, Kind.JSON: _json_object,
}


def _formatter(message_type: str, f: Field) -> Callable[[Any], str]:
    """What `encode` writes for the value of `f`: checked as the decoder would check it (a
    sender writes only what its receivers accept, and only words of the field's vocabulary)."""
    where = f"{message_type}.{f.name}"

    def checked(parse: Callable[[str], object], text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return text

    if f.kind is Kind.UINT:
        def uint(value: int) -> str:
            if value.__class__ is not int or not 0 <= value <= MAX_INT:
                raise ValueError(f"{where}: {value!r} is not an integer in 0..2^63-1")
            return str(value)
        return uint
    if f.kind is Kind.FLAG:
        return lambda value: "1" if value else "0"
    if f.kind is Kind.WORD:
        words = f.words
        assert words is not None

        def word(value: str) -> str:
            if value not in words:
                raise ValueError(f"{where}: {value!r} is not one of {words.describe()}")
            return value
        return word
    if f.kind is Kind.DEVICE:
        return lambda value: checked(_device, value)
    if f.kind is Kind.SESSION:
        return lambda value: checked(_session, value)
    if f.kind is Kind.DEVICES:
        return lambda value: checked(_devices, ",".join(value))
    return lambda value: value  # TEXT, JSON: their length and characters are checked in encode


@dataclass(frozen=True)
class _Schema:
    """One message type's fields as the codec walks them; built once per type at import
    because the codec is on the lock-handoff path."""

    header: str
    # decode: (name, parse, required, default) in the table's order
    fields: tuple[tuple[str, Callable[[str], object], bool, object], ...]
    # encode: (name, format, optional, default, free text, byte limit)
    writers: tuple[tuple[str, Callable[[Any], str], bool, object, bool, int], ...]
    known: frozenset[str]  # its keys
    limits: Mapping[str, int]  # the keys whose values may exceed MAX_VALUE, with their own limit
    words: tuple[tuple[str, vocabulary.Vocabulary], ...]  # the word fields and their vocabularies


def _schema(message_type: str) -> _Schema:
    spec = BY_TYPE[message_type]
    return _Schema(
        header=f"NVSHARE/{VERSION} {message_type}",
        fields=tuple((f.name, _PARSE[f.kind], not f.optional, f.default) for f in spec.fields),
        writers=tuple((f.name, _formatter(message_type, f), f.optional, f.default,
                       f.kind in (Kind.TEXT, Kind.JSON, Kind.DEVICES), f.max_bytes) for f in spec.fields),
        known=frozenset(f.name for f in spec.fields),
        limits={f.name: f.max_bytes for f in spec.fields if f.max_bytes != MAX_VALUE},
        words=tuple((f.name, f.words) for f in spec.fields if f.words is not None),
    )


class Message:
    """A message of the client socket; its subclasses are generated from protocol_table.py."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""
    _SCHEMA: ClassVar[_Schema]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            cls._SCHEMA = _schema(cls.TYPE)

    def encode(self) -> bytes:
        schema = self._SCHEMA
        lines = [schema.header]
        for name, write, optional, default, free, limit in schema.writers:
            value = getattr(self, name)
            if optional and value == default:
                continue  # absent reads as the default
            text = write(value)
            if free:
                if _CONTROL_CHARS.search(text):
                    raise ValueError(f"{self.TYPE}.{name} contains control characters")
                if len(text) * 4 > limit and len(text.encode()) > limit:
                    raise ValueError(f"{self.TYPE}.{name} is longer than {limit} bytes")
            lines.append(f"{name}={text}")
        data = "\n".join(lines).encode()
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"{self.TYPE} message is {len(data)} bytes, over {MAX_MESSAGE}")
        return data


def unknown_words(message: Message) -> list[tuple[str, str]]:
    """(field, word) of each word field whose word is not in its vocabulary: the receiver acts
    on the message all the same (docs/protocol.md, "Unknown words") and may say what it could
    not read."""
    return [(name, getattr(message, name)) for name, words in message._SCHEMA.words
            if getattr(message, name) not in words]


class _StatusDocument(Message):
    """STATUS carries a JSON document: `Status.of` builds the message, `document` reads it."""

    __slots__ = ()
    json: str

    @classmethod
    def of(cls, document: Mapping[str, Any]) -> Status:
        """Encode `document`, leaving out devices from the end of its "devices" list until it
        fits; "truncated" then says how many were left out."""
        devices = list(document.get("devices", ()))
        left_out = 0
        while True:
            shown = {**document, "devices": devices}
            if left_out:
                shown["truncated"] = left_out
            # JSON escapes the other control characters but may leave DEL as it is, which no field
            # may carry; it can only stand inside a string, where its escape means the same.
            text = json.dumps(shown, separators=(",", ":"), ensure_ascii=False, allow_nan=False).replace("\x7f", "\\u007f")
            if len(text.encode()) <= STATUS_DOCUMENT_MAX or not devices:
                return Status(json=text)
            devices.pop()
            left_out += 1

    def document(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.json)
        return document


def decode(data: bytes, catalogue: Mapping[str, type[Message]] | None = None) -> Message:
    """Parse one frame; `catalogue` says which side's messages are acceptable (by default the
    client's: what the scheduler reads)."""
    if catalogue is None:
        catalogue = CLIENT_MESSAGES
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
    first = lines[0]
    # The usual header needs no regex: every type of a catalogue has the header's form.
    cls = catalogue.get(first[len(_PREFIX):]) if first.startswith(_PREFIX) else None
    if cls is None:
        header = _HEADER.match(first)
        if header is None:
            raise ProtocolError("malformed", "first line must be 'NVSHARE/<version> <TYPE>'")
        version, msg_type = int(header.group(1)), header.group(2)
        if version != VERSION:
            raise ProtocolError("unsupported-version", f"version {version}; this side speaks {VERSION}", msg_type)
        cls = catalogue.get(msg_type)
        if cls is None:
            raise ProtocolError("unknown-type", f"unknown message type {msg_type}", msg_type)
    msg_type = cls.TYPE
    if len(lines) - 1 > MAX_FIELDS:
        raise ProtocolError("malformed", f"more than {MAX_FIELDS} fields", msg_type)
    schema = cls._SCHEMA
    known, limits = schema.known, schema.limits
    # Both checks of every value at once where they cannot fail: no control character in the
    # whole text, no value longer than the whole message's bytes.
    clean = _CONTROL_CHARS_BUT_NEWLINE.search(text) is None
    short = len(data) <= MAX_VALUE
    raw: dict[str, str] = {}
    for line in lines[1:]:
        key, sep, value = line.partition("=")
        if not sep or key not in known and not _KEY.match(key):
            raise ProtocolError("malformed", f"bad field line {line[:40]!r}", msg_type)
        if key in raw:
            raise ProtocolError("malformed", f"field {key} repeated", msg_type)
        if not short and len(value.encode()) > limits.get(key, MAX_VALUE) or not clean and _CONTROL_CHARS.search(value):
            raise ProtocolError("bad-field", f"field {key} too long or has control characters", msg_type)
        raw[key] = value
    values: list[object] = []
    for name, parse, required, default in schema.fields:
        text_value = raw.get(name)
        if text_value is None:
            if required:
                raise ProtocolError("bad-field", f"missing field {name}", msg_type)
            values.append(default)
            continue
        try:
            values.append(parse(text_value))
        except ValueError as exc:
            raise ProtocolError("bad-field", f"field {name}: {exc}", msg_type) from None
    return cls(*values)


# --- the messages --------------------------------------------------------------------------
# generated: messages (python -m nvshare_py.protocol_gen writes what follows, up to "end")


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Register this connection. `held`/`wanted` are sent after a reconnection: devices whose lock
    the client still holds (its gate is open, or it is still draining its work) and devices it is
    waiting for. Answered by `WELCOME`. At most 64 devices in each list and together (`ERROR
    code=bad-field`, the connection stays unregistered)."""

    TYPE: ClassVar[str] = "HELLO"
    pid: int  # the client's pid in its own namespace
    session: str  # random per process lifetime
    host: str = ""
    container: str = ""
    pod: str = ""
    namespace: str = ""
    program: str = ""
    held: tuple[str, ...] = ()
    wanted: tuple[str, ...] = ()
    # the multi-GPU job this process belongs to (docs/scheduler.md, *Gangs*): its members are granted their devices together; "": none
    gang: str = ""
    # how many processes the gang has (0: not said; the scheduler waits for the members it has been told of)
    gang_size: int = 0


@dataclass(frozen=True, slots=True)
class DeviceAnnouncement(Message):
    """Announce a device this client uses: sent once per device and registration, as soon as the
    client uses the device: allocates on it, waits for it or holds it, not when it merely resolves
    it (frameworks resolve every device at start-up, and a gang is granted every device its members
    announced). Before any other message naming it. `total` is the client's measurement (`0`: none);
    it is informational only. A device's size is what the daemon measures itself (NVML) or the
    operator sets (`set-budget`), never a client's figure (docs/scheduler.md, *Security model*).
    `name` is shown while the daemon has no name of its own."""

    TYPE: ClassVar[str] = "DEVICE"
    device: str
    total: int  # bytes
    name: str = ""


@dataclass(frozen=True, slots=True)
class Memory(Message):
    """Bytes this client has allocated on the device (managed + unconverted); a figure above the
    device's measured size counts as that size (for admission, the size of a device the daemon did
    not measure is its budget, and a report on a device with neither counts as 0; docs/protocol.md,
    *Admission*). Sent when it changes, at most every 100 ms, but at once just before an `ACQUIRE`,
    while a swap job moves memory (its progress), and when a move in ends (a waiter is granted once
    its memory is back). `resident`, from a client that swaps (see *Residency*): its converted bytes
    it believes are on the device (all of them once it ran after a grant, less after it evicted).
    Absent: the client takes no part in residency, and all of `used` counts as resident. `engine`,
    `area`, `out_bps`, `in_bps`, from a client that swaps: its swap engine (docs/interceptor.md,
    *Swapping*), shown in `nvsharectl status` and used to price a handoff."""

    TYPE: ClassVar[str] = "MEMORY"
    device: str
    used: int  # bytes
    resident: int | None = None  # bytes
    # how its swap engine moves memory: copy (pinned copies and discards) or migrate (the driver's prefetch)
    engine: str = ""
    # the pinned bytes its swap area has ready, for the whole process: what it pinned, what it holds of its user's swap pool and the pool's free segments registered in it (what it moved out through the area included)
    area: int | None = None
    out_bps: int = 0  # bytes per second its last move out reached
    in_bps: int = 0  # bytes per second its last move in reached
    # 1: its area is its user's swap pool (POOL), which other processes share; 0: memory it pinned for itself (PREPARE)
    pool: bool = False


@dataclass(frozen=True, slots=True)
class Acquire(Message):
    """Ask for the device's lock. Idempotent while waiting or holding."""

    TYPE: ClassVar[str] = "ACQUIRE"
    device: str


@dataclass(frozen=True, slots=True)
class Admit(Message):
    """Admission (see *Admission*): this process wants its total of memory on the device (what
    `MEMORY` reports) to reach `bytes`, and its allocating thread waits for `ADMITTED` or `REFUSED`
    naming `request` (> 0). Sent only to a scheduler whose `WELCOME` said `admission=1`, and only
    when an allocation would take the total past what was admitted. One question per device at a
    time (a second replaces the first and goes to the end of the queue). `request=0` gives admission
    back: the admitted total becomes `bytes` if that is below it, and nothing is answered."""

    TYPE: ClassVar[str] = "ADMIT"
    device: str
    request: int  # the client's number for the question
    bytes: int  # the total wanted


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Give the lock of grant `grant` back. The client sends it only after its GPU work on that
    device has drained. `quantum`: drained ahead of the quantum's end after `CONTENDED` (a `DROP`
    that came during that drain changes nothing). A `RELEASE` for a grant that is not current is
    ignored (logged at debug level): it is normal after a `REVOKE`. A reason the scheduler does not
    know counts as `user`."""

    TYPE: ClassVar[str] = "RELEASE"
    device: str
    grant: int
    reason: str = "user"  # a word of vocabulary.RELEASE_REASON
    resident: int | None = None  # bytes that stay on the device after a DROP with evict


@dataclass(frozen=True, slots=True)
class Evicted(Message):
    """The answer to `EVICT`: what of its converted memory is still on the device. Also sent,
    unasked, after a `DROP` with `evict` that crossed an idle `RELEASE` of its grant: the room moved
    out after that `RELEASE`."""

    TYPE: ClassVar[str] = "EVICTED"
    device: str
    resident: int  # bytes


@dataclass(frozen=True, slots=True)
class Fenced(Message):
    """The answer to a `DROP` with `fence=1` from a client that counts its collectives (NCCL's
    kernels, by name; docs/interceptor.md, *Gangs*): its gate is closed and no collective is
    launched any more; it waits for `FENCE` before it drains."""

    TYPE: ClassVar[str] = "FENCED"
    device: str
    grant: int
    collectives: int  # collectives launched on the device since the process began


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Liveness. Sent every `heartbeat_ms` (from `WELCOME`) when nothing else was sent."""

    TYPE: ClassVar[str] = "HEARTBEAT"


@dataclass(frozen=True, slots=True)
class Bye(Message):
    """Clean exit: all locks of this client are released, its registration removed."""

    TYPE: ClassVar[str] = "BYE"


@dataclass(frozen=True, slots=True)
class Query(Message):
    """Ask what the scheduler knows of this *process*; answered by `STATUS`. Allowed before `HELLO`
    and after it; it registers nothing (see *Queries*)."""

    TYPE: ClassVar[str] = "QUERY"


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """Registration accepted. `idle_release_ms` is the operator's default idle window; a client's
    `NVSHARE_IDLE_RELEASE_MS` overrides it. `admission=1`: this scheduler answers `ADMIT` (absent or
    `0`: the client never asks). The client's admitted total then starts at what it had already
    allocated."""

    TYPE: ClassVar[str] = "WELCOME"
    client: str  # the id shown in status, e.g. c12
    heartbeat_ms: int
    idle_release_ms: int
    version: int = 1
    admission: bool = False


@dataclass(frozen=True, slots=True)
class Grant(Message):
    """The lock is yours. Open the gate. `prefetch`: bring up to this many bytes of your evicted
    memory back to the device in bulk (most recently used first) before the gate opens. Memory held
    in the pinned swap area comes back whatever `prefetch` says (it is nowhere else); what moved by
    the driver's prefetch beyond `prefetch` faults in as touched. A client that does not know the
    `mode` acts as in mode `on`."""

    TYPE: ClassVar[str] = "GRANT"
    device: str
    grant: int  # id, unique per daemon run
    mode: str  # a word of vocabulary.MODE
    exclusive: bool  # 1 in mode on, where the holder is alone by rule; 0 where others may be granted beside it
    quantum_ms: int
    prefetch: int = 0  # bytes


@dataclass(frozen=True, slots=True)
class Drop(Message):
    """Stop submitting, drain, send `RELEASE` with this `grant` (whatever the reason). If the
    `RELEASE` has not arrived after `grace_ms`, the grant is revoked. A `conflict` DROP answers a
    `held=` claim that is not honoured: its `grant` id was never sent in a `GRANT`, and is the one
    to release. Inside the recovery window after a restart it carries the usual grace (a claim that
    may not run beside the first claimant); outside it, `grace_ms=0` and the `REVOKE` follows at
    once (see *Scheduling rules*). `evict`: after the drain and before the `RELEASE`, move at least
    this many bytes of converted memory to host memory in bulk, and say in the `RELEASE` what stays
    resident. `fence=1` (to each member of a gang, whose devices are dropped together; see *Gangs*):
    a client that counts the collectives it launches answers `FENCED` and drains only after `FENCE`,
    so that every member stops after the same collective; one that does not (or an older one) drains
    and releases as for any `DROP`."""

    TYPE: ClassVar[str] = "DROP"
    device: str
    grant: int
    grace_ms: int
    reason: str  # a word of vocabulary.DROP_REASON
    evict: int = 0  # bytes
    # to a gang's members: stop after the collective the gang agrees on (FENCED, FENCE) before draining
    fence: bool = False


@dataclass(frozen=True, slots=True)
class Fence(Message):
    """The answer to the `FENCED` of every member of a dropped gang turn (see *Gangs*): launch
    collectives on the device until this many have been launched (the gate open meanwhile), then
    stop submitting, drain and send the `RELEASE` of the `DROP`. Every member then stops after the
    same collective, so no member's last collective waits for a partner that stopped before it."""

    TYPE: ClassVar[str] = "FENCE"
    device: str
    grant: int
    collectives: int  # the most any member said in FENCED


@dataclass(frozen=True, slots=True)
class Evict(Message):
    """To a client that does not hold the lock: move `bytes` of your converted memory to host memory
    now (room for someone else's grant) and answer `EVICTED`. A `PREFETCH` that comes before the
    answer takes the `EVICT` back (the client asked for the device meanwhile): stop after the pieces
    in flight, or do not begin, and answer `EVICTED` with what stayed."""

    TYPE: ClassVar[str] = "EVICT"
    device: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Contended(Message):
    """A notice: others wait for the device, and this grant's quantum ends in `quantum_left_ms`
    (then `DROP` follows). A holder with a long queue of GPU work may drain it ahead of time and
    release with reason `quantum`, so that the lock changes hands when the quantum ends instead of a
    drain later (docs/interceptor.md). `evict`: what the `DROP` will ask to move out (see
    *Residency*): a holder that drains ahead of time moves it before its `RELEASE`, starting early
    enough for the move too. `idle_ms`: while others wait, the holder's idle window: more than its
    usual window, what the release would cost it in swapping (its memory out now and back at its
    next turn), so that it does not release for a shorter pause; less, its release moves none of its
    memory and it should give the lock back after this long idle (`--idle-release-contended`). Sent
    again when either figure changes noticeably. Ignoring it is correct."""

    TYPE: ClassVar[str] = "CONTENDED"
    device: str
    grant: int
    quantum_left_ms: int
    evict: int = 0  # bytes its release will be asked to move to the host
    idle_ms: int = 0  # while others wait, the idle window to use instead of the usual one (0: the usual one)


@dataclass(frozen=True, slots=True)
class Prepare(Message):
    """Swapping (see *Residency*): keep a pinned host swap area of `bytes` ready for this device
    (the most of your memory on it that you may be asked to hold on the host at once). Grow or
    shrink it between handoffs, never on one; `MEMORY area=` says what is ready. Sent when it
    changes by at least 64 MiB or an eighth (or to or from 0)."""

    TYPE: ClassVar[str] = "PREPARE"
    device: str
    bytes: int  # 0: none is needed any more


@dataclass(frozen=True, slots=True)
class Pool(Message):
    """Swapping (see *Residency*): the node's pinned swap pool that this process shares with the
    other processes of its user (of its pod, in Kubernetes) should hold `bytes`, about what they
    have moved out or will be asked to. Keep that much of it mapped and registered in this process
    ahead of need, never on a handoff's path; every device's swap area takes its room from it, so
    that any process can move all of its memory at the link's speed while the pinned total follows
    what is out. Register segments other processes made only for up to `need` bytes (without it, for
    all of its memory on its devices): registering holds up the process's own GPU calls, and the
    driver's, for every process. A process that cannot use the pool (docs/interceptor.md,
    *Swapping*) keeps a private area as `PREPARE` says. Sent to every process of the user when it
    changes by at least 512 MiB or an eighth (or to or from 0), and to a process whose `need`
    changed by as much."""

    TYPE: ClassVar[str] = "POOL"
    bytes: int  # 0: none is needed any more
    # bytes of this process's memory it may be asked to move out soon (it moves out now, or stands early in eviction order)
    need: int | None = None


@dataclass(frozen=True, slots=True)
class Prefetch(Message):
    """Swapping, to the waiter that will be granted next: bring swapped-out memory back, keeping the
    gate closed, until `resident` bytes of your swappable memory are on the device (room the
    holder's swap-out has made, reported piece by piece). Sent again as the room grows. Memory in
    flight counts against the budget from this moment. Also sent, with what is on the device, to a
    client whose `ACQUIRE` crossed an `EVICT`: it takes the `EVICT` back."""

    TYPE: ClassVar[str] = "PREFETCH"
    device: str
    resident: int  # bytes


@dataclass(frozen=True, slots=True)
class Revoke(Message):
    """The grant is void (whatever the reason); the lock may already belong to someone else. Close
    the gate at once, drain, and send `RELEASE` (ignored, but it keeps both sides' state in step).
    Ask again with `ACQUIRE` if you still need the device."""

    TYPE: ClassVar[str] = "REVOKE"
    device: str
    grant: int
    reason: str  # a word of vocabulary.REVOKE_REASON


@dataclass(frozen=True, slots=True)
class ModeNotice(Message):
    """The device's mode or time quantum changed (sent to every client that announced the device)."""

    TYPE: ClassVar[str] = "MODE"
    device: str
    mode: str  # a word of vocabulary.MODE
    quantum_ms: int


@dataclass(frozen=True, slots=True)
class Admitted(Message):
    """The answer to `ADMIT` `request`: the process may hold up to `bytes` on the device, at least
    what it asked (more is a chunk ahead, see *Admission*). The waiting allocation goes on."""

    TYPE: ClassVar[str] = "ADMITTED"
    device: str
    request: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Refused(Message):
    """The answer to `ADMIT` `request` when it is not admitted: `too-large` at once when `bytes`
    exceeds the node's whole capacity, `limit` at once when `bytes` is past the memory limit set for
    the client on the device (`set-limit`) or more than its user or pod may ever hold (the admission
    *share*), `timeout` after the admission timeout. The waiting allocation fails with
    `CUDA_ERROR_OUT_OF_MEMORY` (whatever the reason); nothing is allocated."""

    TYPE: ClassVar[str] = "REFUSED"
    device: str
    request: int
    reason: str  # a word of vocabulary.REFUSE_REASON


@dataclass(frozen=True, slots=True)
class Limit(Message):
    """The memory limit the operator set for this client (`set-limit` below) on `device`, or,
    without `device`, on every device the client was not told a limit of its own for. A
    registration's limits are sent right after its `HELLO`, before its `WELCOME`: the one for every
    device, then each device whose own limit differs from it (also devices the client has not named
    yet), so the client knows them before its first memory call; then again whenever one changes.
    The client applies the smaller of it and its own `NVSHARE_MEMORY_LIMIT`: a scheduler limit can
    lower what the environment allows, never raise it. A registration (`HELLO`) starts without the
    previous one's limits."""

    TYPE: ClassVar[str] = "LIMIT"
    bytes: int  # 0: none from the scheduler
    device: str = ""  # absent: every device the client was not told a limit of its own for


@dataclass(frozen=True, slots=True)
class Error(Message):
    """The message was rejected; the connection stays usable. Except `too-many-connections`: the
    scheduler had no place for a new connection, says so right after its handshake, and closes it
    (see *Client socket*)."""

    TYPE: ClassVar[str] = "ERROR"
    code: str  # a word of vocabulary.ERROR_CODE
    detail: str = ""
    type: str = ""  # the offending message type, when known


@dataclass(frozen=True, slots=True)
class Status(_StatusDocument):
    """The answer to `QUERY`; sent to no one else."""

    TYPE: ClassVar[str] = "STATUS"
    json: str  # compact, up to the 4096-byte message limit


MESSAGE_CLASSES: Final[tuple[type[Message], ...]] = (Hello, DeviceAnnouncement, Memory, Acquire, Admit, Release,
                                                    Evicted, Fenced, Heartbeat, Bye, Query, Welcome, Grant, Drop,
                                                    Fence, Evict, Contended, Prepare, Pool, Prefetch, Revoke,
                                                    ModeNotice, Admitted, Refused, Limit, Error, Status)


# end of generated: messages


def _catalogue(*, sender: Sender, replies_to: str = "") -> dict[str, type[Message]]:
    return {cls.TYPE: cls for cls in MESSAGE_CLASSES
            if BY_TYPE[cls.TYPE].sender is sender and BY_TYPE[cls.TYPE].reply_to == replies_to}


CLIENT_MESSAGES: Final = _catalogue(sender=Sender.CLIENT)
# What a registered client may receive. STATUS is not among them: only a connection that sent
# QUERY receives it, and it reads replies with QUERY_REPLIES (ERROR included: any message may be
# refused).
SCHEDULER_MESSAGES: Final = _catalogue(sender=Sender.SCHEDULER)
QUERY_REPLIES: Final = {**_catalogue(sender=Sender.SCHEDULER, replies_to="QUERY"), Error.TYPE: Error}
