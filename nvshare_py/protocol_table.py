"""The client socket's messages, declared once: types, fields, field kinds, who sends them.

Everything else about the messages derives from `MESSAGES` below, by
`python -m nvshare_py.protocol_gen` (tests/test_protocol.py fails, naming that command, while a
derived part is stale):

- the message classes of nvshare_py/protocol.py (typed, frozen dataclasses) and its codec's
  schemas (the codec reads `MESSAGES` at import);
- interceptor/protocol_table.h, the C codec's lists (interceptor/message.c expands them into its
  parser and builder tables; message.h into `enum nvs_msg_type`, `struct nvs_msg`, the word
  enums and `struct nvs_out`);
- the message tables of docs/protocol.md (between the `generated:` markers);
- the codec tests, which are parametrised over `MESSAGES` (tests/test_protocol.py, tests/test_wire.py).

Adding a field: append a `required(...)` or `optional(...)` to its message's fields (a new
field of an existing message is optional, with the default an older peer implies by leaving
it out: receivers ignore keys they do not know, so nothing else changes for them), run the
generator, then write the code that acts on it (for a scheduler message: the scheduler core
that sends it, interceptor/client_core.c that reads `m.<field>`; for a client message: the C
core that fills `struct nvs_out`, and the scheduler event it becomes in
nvshare_py/scheduler/events.py). A new kind of value is a new `Kind`, handled in protocol.py's
parsers and message.c's.

Adding a message: a `Message(...)` below, then the same. A word of an existing field (a new
DROP reason, a mode): nvshare_py/vocabulary.py; receivers that do not know it keep it as text
(docs/protocol.md, "Unknown words").

Names: `type` is the wire's; `python_name` the class in nvshare_py.protocol (it differs from the
type where the type would clash: MODE is `ModeNotice`, DEVICE `DeviceAnnouncement`); a field's
C member is its key unless `c_name` says otherwise.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final

from . import vocabulary
from .vocabulary import Vocabulary

VERSION: Final = 1
MAX_MESSAGE: Final = 4096  # bytes in one frame
MAX_VALUE: Final = 1024  # bytes of one value (except fields with a max_bytes of their own)
MAX_FIELDS: Final = 32
MAX_INT: Final = 2**63 - 1
# Devices one registration may name (HELLO's held and wanted, DEVICE, MEMORY, ACQUIRE): bounds
# what one client makes the scheduler keep and work on (issue 12).
MAX_DEVICES: Final = 64
SESSION_DIGITS: Final = 16

TYPE_FORM: Final = re.compile(r"[A-Z]{1,16}\Z")
KEY_FORM: Final = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")


class Kind(enum.Enum):
    """How a field's value is written; `value` is its name in docs/protocol.md."""

    DEVICE = "device id"  # vocabulary.DEVICE_ID
    UINT = "integer"  # unsigned decimal below 2^63, at most 19 digits
    TEXT = "text"  # any value: UTF-8 without control characters
    SESSION = "16 lower-case hex digits"  # SESSION_DIGITS of them
    DEVICES = "device list"  # comma-separated device ids, at most MAX_DEVICES, "" for none
    FLAG = "flag"  # 0 or 1
    WORD = "word"  # a word of the field's vocabulary; a receiver keeps one it does not know
    JSON = "JSON object"


class Sender(enum.Enum):
    CLIENT = "client"
    SCHEDULER = "scheduler"


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Final = _NoDefault()
FieldValue = int | str | bool | tuple[str, ...] | None


@dataclass(frozen=True)
class Field:
    """One key of a message.

    `default`: for an optional field, the value it has when absent (and a sender leaves it out
    while it holds that value); None makes it nullable (absent means "not said"). A required
    field is always written; its `default` (if any) only spares Python callers from giving it.
    `c_size`: for a text the C client reads, the bytes it keeps (NUL included; a longer value
    is cut at a character boundary)."""

    name: str
    kind: Kind
    doc: str
    optional: bool
    default: FieldValue | _NoDefault = NO_DEFAULT
    words: Vocabulary | None = None
    max_bytes: int = MAX_VALUE
    c_name: str = ""
    c_size: int = 0

    @property
    def c_member(self) -> str:
        return self.c_name or self.name

    @property
    def nullable(self) -> bool:
        return self.optional and self.default is None


def required(name: str, kind: Kind, doc: str = "", *, words: Vocabulary | None = None,
             default: FieldValue | _NoDefault = NO_DEFAULT, max_bytes: int = MAX_VALUE, c_name: str = "",
             c_size: int = 0) -> Field:
    return Field(name, kind, doc, False, default, words, max_bytes, c_name, c_size)


def optional(name: str, kind: Kind, default: FieldValue, doc: str = "", *, words: Vocabulary | None = None,
             c_name: str = "", c_size: int = 0) -> Field:
    return Field(name, kind, doc, True, default, words, MAX_VALUE, c_name, c_size)


@dataclass(frozen=True)
class Message:
    """`doc`: what it means, for docs/protocol.md and the class's docstring. `reply_to`: the
    message it answers, when it is sent only as that answer (then it is not among what a
    registered client receives)."""

    type: str
    python_name: str
    sender: Sender
    fields: tuple[Field, ...]
    doc: str
    reply_to: str = ""


CLIENT, SCHEDULER = Sender.CLIENT, Sender.SCHEDULER
DEVICE, UINT, TEXT, SESSION, DEVICES, FLAG, WORD, JSON = (
    Kind.DEVICE, Kind.UINT, Kind.TEXT, Kind.SESSION, Kind.DEVICES, Kind.FLAG, Kind.WORD, Kind.JSON)

# "NVSHARE/1 STATUS\njson=": what the STATUS document may fill of a message.
STATUS_DOCUMENT_MAX: Final = MAX_MESSAGE - len(f"NVSHARE/{VERSION} STATUS\njson=")

MESSAGES: Final[tuple[Message, ...]] = (
    # --- client -> scheduler -------------------------------------------------------------------
    Message("HELLO", "Hello", CLIENT, (
        required("pid", UINT, "the client's pid in its own namespace"),
        required("session", SESSION, "random per process lifetime"),
        optional("host", TEXT, ""),
        optional("container", TEXT, ""),
        optional("pod", TEXT, ""),
        optional("namespace", TEXT, "", c_name="namespace_"),
        optional("program", TEXT, ""),
        optional("held", DEVICES, ()),
        optional("wanted", DEVICES, ()),
        optional("gang", TEXT, "", "the multi-GPU job this process belongs to (docs/scheduler.md, *Gangs*): "
                 "its members are granted their devices together; `\"\"`: none"),
        optional("gang_size", UINT, 0, "how many processes the gang has (`0`: not said; the scheduler "
                 "waits for the members it has been told of)"),
    ), "Register this connection. `held`/`wanted` are sent after a reconnection: devices whose lock "
       "the client still holds (its gate is open, or it is still draining its work) and devices it "
       "is waiting for. Answered by `WELCOME`. At most 64 devices in each list and together "
       "(`ERROR code=bad-field`, the connection stays unregistered)."),
    Message("DEVICE", "DeviceAnnouncement", CLIENT, (
        required("device", DEVICE),
        required("total", UINT, "bytes"),
        optional("name", TEXT, ""),
    ), "Announce a device this client uses: sent once per device and registration, as soon as the "
       "client uses the device: allocates on it, waits for it or holds it, not when it merely "
       "resolves it (frameworks resolve every device at start-up, and a gang is granted every "
       "device its members announced). Before any other message naming it. `total` is the "
       "client's measurement (`0`: none); it is informational only. A device's size is what the "
       "daemon measures itself (NVML) or the operator sets (`set-budget`), never a client's figure "
       "(docs/scheduler.md, *Security model*). `name` is shown while the daemon has no name of its "
       "own."),
    Message("MEMORY", "Memory", CLIENT, (
        required("device", DEVICE),
        required("used", UINT, "bytes"),
        optional("resident", UINT, None, "bytes"),
        optional("engine", TEXT, "", "how its swap engine moves memory: `copy` (pinned copies and discards) or `migrate` (the driver's prefetch)"),
        optional("area", UINT, None, "the pinned bytes its swap area has ready, for the whole process: what "
                 "it pinned, what it holds of its user's swap pool and the pool's free segments registered in "
                 "it (what it moved out through the area included)"),
        optional("out_bps", UINT, 0, "bytes per second its last move out reached"),
        optional("in_bps", UINT, 0, "bytes per second its last move in reached"),
        optional("pool", FLAG, False, "`1`: its area is its user's swap pool (`POOL`), which other processes "
                 "share; `0`: memory it pinned for itself (`PREPARE`)"),
    ), "Bytes this client has allocated on the device (managed + unconverted); a figure above the "
       "device's measured size counts as that size (for admission, the size of a device the daemon did not measure is its budget, and a report on a device with neither counts as 0; docs/protocol.md, *Admission*). Sent when it changes, at most every 100 ms, but at once just before an `ACQUIRE`, while a swap job moves memory (its progress), and when a move in ends (a waiter is granted once its memory is back). `resident`, from a client "
       "that swaps (see *Residency*): its converted bytes it believes are on the device (all of "
       "them once it ran after a grant, less after it evicted). Absent: the client takes no part "
       "in residency, and all of `used` counts as resident. `engine`, `area`, `out_bps`, `in_bps`, "
       "from a client that swaps: its swap engine (docs/interceptor.md, *Swapping*), shown in "
       "`nvsharectl status` and used to price a handoff."),
    Message("ACQUIRE", "Acquire", CLIENT, (
        required("device", DEVICE),
    ), "Ask for the device's lock. Idempotent while waiting or holding."),
    Message("ADMIT", "Admit", CLIENT, (
        required("device", DEVICE),
        required("request", UINT, "the client's number for the question"),
        required("bytes", UINT, "the total wanted"),
    ), "Admission (see *Admission*): this process wants its total of memory on the device (what "
       "`MEMORY` reports) to reach `bytes`, and its allocating thread waits for `ADMITTED` or "
       "`REFUSED` naming `request` (> 0). Sent only to a scheduler whose `WELCOME` said "
       "`admission=1`, and only when an allocation would take the total past what was admitted. "
       "One question per device at a time (a second replaces the first and goes to the end of the "
       "queue). `request=0` gives admission back: the admitted total becomes `bytes` if that is "
       "below it, and nothing is answered."),
    Message("RELEASE", "Release", CLIENT, (
        required("device", DEVICE),
        required("grant", UINT),
        optional("reason", WORD, "user", words=vocabulary.RELEASE_REASON),
        optional("resident", UINT, None, "bytes that stay on the device after a `DROP` with `evict`"),
    ), "Give the lock of grant `grant` back. The client sends it only after its GPU work on that "
       "device has drained. `quantum`: drained ahead of the quantum's end after `CONTENDED` (a "
       "`DROP` that came during that drain changes nothing). A `RELEASE` for a grant that is not "
       "current is ignored (logged at debug level): it is normal after a `REVOKE`. A reason the "
       "scheduler does not know counts as `user`."),
    Message("EVICTED", "Evicted", CLIENT, (
        required("device", DEVICE),
        required("resident", UINT, "bytes"),
    ), "The answer to `EVICT`: what of its converted memory is still on the device. Also sent, "
       "unasked, after a `DROP` with `evict` that crossed an idle `RELEASE` of its grant: the room "
       "moved out after that `RELEASE`."),
    Message("FENCED", "Fenced", CLIENT, (
        required("device", DEVICE),
        required("grant", UINT),
        required("collectives", UINT, "collectives launched on the device since the process began"),
    ), "The answer to a `DROP` with `fence=1` from a client that counts its collectives (NCCL's "
       "kernels, by name; docs/interceptor.md, *Gangs*): its gate is closed and no collective is "
       "launched any more; it waits for `FENCE` before it drains."),
    Message("HEARTBEAT", "Heartbeat", CLIENT, (),
            "Liveness. Sent every `heartbeat_ms` (from `WELCOME`) when nothing else was sent."),
    Message("BYE", "Bye", CLIENT, (),
            "Clean exit: all locks of this client are released, its registration removed."),
    Message("QUERY", "Query", CLIENT, (),
            "Ask what the scheduler knows of this *process*; answered by `STATUS`. Allowed before "
            "`HELLO` and after it; it registers nothing (see *Queries*)."),
    # --- scheduler -> client -------------------------------------------------------------------
    Message("WELCOME", "Welcome", SCHEDULER, (
        required("client", TEXT, "the id shown in status, e.g. `c12`", c_size=64),
        required("heartbeat_ms", UINT),
        required("idle_release_ms", UINT),
        required("version", UINT, default=VERSION),
        optional("admission", FLAG, False),
    ), "Registration accepted. `idle_release_ms` is the operator's default idle window; a "
       "client's `NVSHARE_IDLE_RELEASE_MS` overrides it. `admission=1`: this scheduler answers "
       "`ADMIT` (absent or `0`: the client never asks). The client's admitted total then starts "
       "at what it had already allocated."),
    Message("GRANT", "Grant", SCHEDULER, (
        required("device", DEVICE),
        required("grant", UINT, "id, unique per daemon run"),
        required("mode", WORD, words=vocabulary.MODE),
        required("exclusive", FLAG, "`1` in mode `on`, where the holder is alone by rule; `0` where "
                                    "others may be granted beside it"),
        required("quantum_ms", UINT),
        optional("prefetch", UINT, 0, "bytes"),
    ), "The lock is yours. Open the gate. `prefetch`: bring up to this many bytes of your evicted "
       "memory back to the device in bulk (most recently used first) before the gate opens. Memory "
       "held in the pinned swap area comes back whatever `prefetch` says (it is nowhere else); "
       "what moved by the driver's prefetch beyond `prefetch` faults in as touched. A client that "
       "does not know the `mode` acts as in mode `on`."),
    Message("DROP", "Drop", SCHEDULER, (
        required("device", DEVICE),
        required("grant", UINT),
        required("grace_ms", UINT),
        required("reason", WORD, words=vocabulary.DROP_REASON),
        optional("evict", UINT, 0, "bytes"),
        optional("fence", FLAG, False, "to a gang's members: stop after the collective the gang agrees on "
                 "(`FENCED`, `FENCE`) before draining"),
    ), "Stop submitting, drain, send `RELEASE` with this `grant` (whatever the reason). If the "
       "`RELEASE` has not arrived after `grace_ms`, the grant is revoked. A `conflict` DROP answers "
       "a `held=` claim that is not honoured: its `grant` id was never sent in a `GRANT`, and is the "
       "one to release. Inside the recovery window after a restart it carries the usual grace (a "
       "claim that may not run beside the first claimant); outside it, `grace_ms=0` and the "
       "`REVOKE` follows at once (see *Scheduling rules*). `evict`: after the drain and before the "
       "`RELEASE`, move at least this many bytes of converted memory to host memory in bulk, and "
       "say in the `RELEASE` what stays resident. `fence=1` (to each member of a gang, whose devices "
       "are dropped together; see *Gangs*): a client that counts the collectives it launches "
       "answers `FENCED` and drains only after `FENCE`, so that every member stops after the same "
       "collective; one that does not (or an older one) drains and releases as for any `DROP`."),
    Message("FENCE", "Fence", SCHEDULER, (
        required("device", DEVICE),
        required("grant", UINT),
        required("collectives", UINT, "the most any member said in `FENCED`"),
    ), "The answer to the `FENCED` of every member of a dropped gang turn (see *Gangs*): launch "
       "collectives on the device until this many have been launched (the gate open meanwhile), "
       "then stop submitting, drain and send the `RELEASE` of the `DROP`. Every member then stops "
       "after the same collective, so no member's last collective waits for a partner that stopped "
       "before it."),
    Message("EVICT", "Evict", SCHEDULER, (
        required("device", DEVICE),
        required("bytes", UINT),
    ), "To a client that does not hold the lock: move `bytes` of your converted memory to host "
       "memory now (room for someone else's grant) and answer `EVICTED`. A `PREFETCH` that comes "
       "before the answer takes the `EVICT` back (the client asked for the device meanwhile): "
       "stop after the pieces in flight, or do not begin, and answer `EVICTED` with what stayed."),
    Message("CONTENDED", "Contended", SCHEDULER, (
        required("device", DEVICE),
        required("grant", UINT),
        required("quantum_left_ms", UINT),
        optional("evict", UINT, 0, "bytes its release will be asked to move to the host"),
        optional("idle_ms", UINT, 0, "while others wait, the idle window to use instead of the usual one (`0`: the usual one)"),
    ), "A notice: others wait for the device, and this grant's quantum ends in `quantum_left_ms` "
       "(then `DROP` follows). A holder with a long queue of GPU work may drain it ahead of time "
       "and release with reason `quantum`, so that the lock changes hands when the quantum ends "
       "instead of a drain later (docs/interceptor.md). `evict`: what the `DROP` will ask to move out "
       "(see *Residency*): a holder that drains ahead of time moves it before its `RELEASE`, "
       "starting early enough for the move too. `idle_ms`: while others wait, the holder's idle window: "
       "more than its usual window, what the release would cost it in swapping (its memory out now "
       "and back at its next turn), so that it does not release for a shorter pause; less, its "
       "release moves none of its memory and it should give the lock back after this long idle "
       "(`--idle-release-contended`). Sent again when either figure changes noticeably. Ignoring it "
       "is correct."),
    Message("PREPARE", "Prepare", SCHEDULER, (
        required("device", DEVICE),
        required("bytes", UINT, "`0`: none is needed any more"),
    ), "Swapping (see *Residency*): keep a pinned host swap area of `bytes` ready for this device "
       "(the most of your memory on it that you may be asked to hold on the host at once). Grow or "
       "shrink it between handoffs, never on one; `MEMORY area=` says what is ready. Sent when it "
       "changes by at least 64 MiB or an eighth (or to or from 0)."),
    Message("POOL", "Pool", SCHEDULER, (
        required("bytes", UINT, "`0`: none is needed any more"),
        optional("need", UINT, None, "bytes of this process's memory it may be asked to move out soon "
                 "(it moves out now, or stands early in eviction order)"),
    ), "Swapping (see *Residency*): the node's pinned swap pool that this process shares with the "
       "other processes of its user (of its pod, in Kubernetes) should hold `bytes`, about what they "
       "have moved out or will be asked to. Keep that much of it mapped and registered in this process "
       "ahead of need, never on a handoff's path; every device's swap area takes its room from it, so "
       "that any process can move all of its memory at the link's speed while the pinned total follows "
       "what is out. Register segments other processes made only for up to `need` bytes (without it, for "
       "all of its memory on its devices): registering "
       "holds up the process's own GPU calls, and the driver's, for every process. A process that "
       "cannot use the pool (docs/interceptor.md, *Swapping*) keeps a private area as `PREPARE` says. "
       "Sent to every process of the user when it changes by at least 512 MiB or an eighth (or to or "
       "from 0), and to a process whose `need` changed by as much."),
    Message("PREFETCH", "Prefetch", SCHEDULER, (
        required("device", DEVICE),
        required("resident", UINT, "bytes"),
    ), "Swapping, to the waiter that will be granted next: bring swapped-out memory back, keeping "
       "the gate closed, until `resident` bytes of your swappable memory are on the device (room "
       "the holder's swap-out has made, reported piece by piece). Sent again as the room grows. "
       "Memory in flight counts against the budget from this moment. Also sent, with what is on "
       "the device, to a client whose `ACQUIRE` crossed an `EVICT`: it takes the `EVICT` back."),
    Message("REVOKE", "Revoke", SCHEDULER, (
        required("device", DEVICE),
        required("grant", UINT),
        required("reason", WORD, words=vocabulary.REVOKE_REASON),
    ), "The grant is void (whatever the reason); the lock may already belong to someone else. "
       "Close the gate at once, drain, and send `RELEASE` (ignored, but it keeps both sides' state "
       "in step). Ask again with `ACQUIRE` if you still need the device."),
    Message("MODE", "ModeNotice", SCHEDULER, (
        required("device", DEVICE),
        required("mode", WORD, words=vocabulary.MODE),
        required("quantum_ms", UINT),
    ), "The device's mode or time quantum changed (sent to every client that announced the device)."),
    Message("ADMITTED", "Admitted", SCHEDULER, (
        required("device", DEVICE),
        required("request", UINT),
        required("bytes", UINT),
    ), "The answer to `ADMIT` `request`: the process may hold up to `bytes` on the device, at least "
       "what it asked (more is a chunk ahead, see *Admission*). The waiting allocation goes on."),
    Message("REFUSED", "Refused", SCHEDULER, (
        required("device", DEVICE),
        required("request", UINT),
        required("reason", WORD, words=vocabulary.REFUSE_REASON),
    ), "The answer to `ADMIT` `request` when it is not admitted: `too-large` at once when `bytes` "
       "exceeds the node's whole capacity, `limit` at once when `bytes` is past the memory limit "
       "set for the client on the device (`set-limit`) or more than its user or pod may ever hold "
       "(the admission *share*), `timeout` after the admission timeout. The waiting allocation "
       "fails with `CUDA_ERROR_OUT_OF_MEMORY` (whatever the reason); nothing is allocated."),
    Message("LIMIT", "Limit", SCHEDULER, (
        required("bytes", UINT, "`0`: none from the scheduler"),
        optional("device", DEVICE, "", "absent: every device the client was not told a limit of its own for"),
    ), "The memory limit the operator set for this client (`set-limit` below) on `device`, or, "
       "without `device`, on every device the client was not told a limit of its own for. A "
       "registration's limits are sent right after its `HELLO`, before its `WELCOME`: the one for "
       "every device, then each device whose own limit differs from it (also devices the client "
       "has not named yet), so the client knows them before its first memory call; then again "
       "whenever one changes. The client applies the smaller of it and its own "
       "`NVSHARE_MEMORY_LIMIT`: a scheduler limit can lower what the environment allows, never "
       "raise it. A registration (`HELLO`) starts without the previous one's limits."),
    Message("ERROR", "Error", SCHEDULER, (
        required("code", WORD, words=vocabulary.ERROR_CODE),
        optional("detail", TEXT, "", c_size=256),
        optional("type", TEXT, "", "the offending message type, when known", c_name="error_type", c_size=32),
    ), "The message was rejected; the connection stays usable. Except `too-many-connections`: the "
       "scheduler had no place for a new connection, says so right after its handshake, and closes it "
       "(see *Client socket*)."),
    Message("STATUS", "Status", SCHEDULER, (
        required("json", JSON, "compact, up to the 4096-byte message limit",
                 max_bytes=STATUS_DOCUMENT_MAX),
    ), "The answer to `QUERY`; sent to no one else.", reply_to="QUERY"),
)

BY_TYPE: Final = {message.type: message for message in MESSAGES}


def _check(messages: tuple[Message, ...]) -> None:
    """The rules every entry keeps, so that each derived part can rely on them."""
    python_names: set[str] = set()
    for message in messages:
        if not TYPE_FORM.match(message.type):
            raise ValueError(f"{message.type}: a type is [A-Z]{{1,16}}")
        if message.python_name in python_names or not message.python_name.isidentifier():
            raise ValueError(f"{message.type}: python_name {message.python_name!r} is not a new identifier")
        python_names.add(message.python_name)
        if message.reply_to and message.reply_to not in {m.type for m in messages}:
            raise ValueError(f"{message.type}: reply_to names no message")
        names: set[str] = set()
        defaults_began = False
        for f in message.fields:
            where = f"{message.type}.{f.name}"
            if not KEY_FORM.match(f.name) or f.name in names:
                raise ValueError(f"{where}: a key is [a-z][a-z0-9_]{{0,31}} and appears once")
            names.add(f.name)
            if (f.kind is Kind.WORD) != (f.words is not None):
                raise ValueError(f"{where}: a word field, and only one, names its vocabulary")
            has_default = f.default is not NO_DEFAULT
            if f.optional and not has_default:
                raise ValueError(f"{where}: an optional field has a default")
            if defaults_began and not has_default:
                raise ValueError(f"{where}: fields without a default come before those with one")
            defaults_began = defaults_began or has_default
            if f.kind is Kind.WORD and f.optional and f.words is not None and f.default not in f.words:
                raise ValueError(f"{where}: the default is not a word of {f.words.name}")
            if f.max_bytes != MAX_VALUE and f.kind is not Kind.JSON:
                raise ValueError(f"{where}: only a JSON value may be longer than MAX_VALUE")
            if message.sender is Sender.SCHEDULER and f.kind is Kind.TEXT and f.c_size <= 0:
                raise ValueError(f"{where}: a text the C client reads needs its c_size")
            if message.sender is Sender.SCHEDULER and f.kind in (Kind.SESSION, Kind.DEVICES):
                raise ValueError(f"{where}: the C client reads no {f.kind.value} (message.c would need a parser)")
            if message.sender is Sender.CLIENT and f.kind is Kind.JSON:
                raise ValueError(f"{where}: the C client writes no JSON (message.c would need a builder)")


_check(MESSAGES)
