"""The words the scheduler, its clients and nvsharectl share, each defined once.

A *vocabulary* is the list of words one setting or one protocol field takes: the scheduling
modes, the reasons of RELEASE, DROP, REVOKE and REFUSED, the admission policies, the error
codes of the client socket. Everything else derives from these definitions: the wire codecs
(nvshare_py/protocol_table.py generates the C one's word lists), the scheduler's checks of
control requests, nvsharectl's and nvshare-scheduler's commands and help, the metrics' labels
and the tables of docs/protocol.md.

A vocabulary is closed for a sender (it sends only its words) and open for a receiver: a word
it does not know is kept as text and the receiver does what the field's message requires
whatever the word (docs/protocol.md, "Unknown words"). So a newer peer may add a word without a
new protocol version.

Device ids are named here too: what the protocol accepts as one, and the canonical form of a
GPU's UUID.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal, Mapping, TypeGuard, get_args

# Words on the wire and in settings: a lower-case letter, then lower-case letters, digits or
# '-', at most WORD_MAX characters. Receivers accept any word of this form (an unknown one
# is kept as it came); anything else in a word field is malformed.
WORD_MAX: Final = 32
WORD_FORM: Final = re.compile(rf"[a-z][a-z0-9-]{{0,{WORD_MAX - 1}}}\Z")


@dataclass(frozen=True)
class Vocabulary:
    """The words of one concept, in a stable order (the C codec numbers them from 1 in this
    order; 0 is its `UNKNOWN`), each with what it means (docs and help texts)."""

    name: str  # lower_snake: the C names derive from it (enum nvs_<name>, NVS_<NAME>_<WORD>)
    meanings: Mapping[str, str]

    def __post_init__(self) -> None:
        for word in self.meanings:
            if not WORD_FORM.match(word):
                raise ValueError(f"vocabulary {self.name}: {word!r} is not a word")

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(self.meanings)

    def __contains__(self, word: object) -> bool:
        return word in self.meanings

    def describe(self) -> str:
        """`a, b or c`: for help texts and error messages."""
        words = self.words
        return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"

    def explain(self) -> str:
        """`a: what a means; b: what b means`: for help texts."""
        return "; ".join(f"{word}: {meaning}" for word, meaning in self.meanings.items())


def _vocabulary(name: str, literal: object, meanings: Mapping[str, str]) -> Vocabulary:
    """A vocabulary whose words are exactly those of `literal` (the type that code checks)."""
    if tuple(meanings) != get_args(literal):
        raise ValueError(f"vocabulary {name}: meanings for {tuple(meanings)}, words {get_args(literal)}")
    return Vocabulary(name, meanings)


# --- scheduling modes ----------------------------------------------------------------------

Mode = Literal["on", "off", "auto"]
MODE: Final = _vocabulary("mode", Mode, {
    "on": "serialise: one process holds a GPU at a time",
    "off": "stop scheduling: every process runs at once",
    "auto": "run processes side by side while their memory fits the device's budget",
})
MODES: Final[tuple[Mode, ...]] = get_args(Mode)

# --- why a lock changes hands --------------------------------------------------------------

ReleaseReason = Literal["idle", "drop", "quantum", "revoke", "user"]
RELEASE_REASON: Final = _vocabulary("release_reason", ReleaseReason, {
    "idle": "the holder had no GPU work for its idle window and gave the lock back early",
    "drop": "the answer to a DROP",
    "quantum": "drained ahead of the quantum's end after CONTENDED",
    "revoke": "the late answer to a REVOKE",
    "user": "the program gave the lock back itself",
})



def is_release_reason(word: str) -> TypeGuard[ReleaseReason]:
    return word in RELEASE_REASON


DropReason = Literal["quantum", "mode", "memory", "conflict", "gang"]
DROP_REASON: Final = _vocabulary("drop_reason", DropReason, {
    "quantum": "the holder's quantum ran out while others wait",
    "mode": "the device's mode changed so that holders no longer run side by side",
    "memory": "in mode auto, the holders' memory no longer fits the budget",
    "conflict": "a claim (HELLO held=) that is not honoured",
    "gang": "another member of the holder's gang ended the gang's hold (it released, left or died)",
})

RevokeReason = Literal["grace-expired"]
REVOKE_REASON: Final = _vocabulary("revoke_reason", RevokeReason, {
    "grace-expired": "no RELEASE came within the grace after a DROP",
})

RefuseReason = Literal["timeout", "too-large", "limit"]
REFUSE_REASON: Final = _vocabulary("refuse_reason", RefuseReason, {
    "timeout": "the allocation waited past the admission timeout",
    "too-large": "more than the node's whole capacity",
    "limit": "past a memory limit set for the client",
})

# --- admission -----------------------------------------------------------------------------

AdmissionPolicy = Literal["fifo", "best-fit", "recent", "random"]
ADMISSION_POLICY: Final = _vocabulary("admission_policy", AdmissionPolicy, {
    "fifo": "in the order of the questions; nobody overtakes the head",
    "best-fit": "the waiter whose need comes closest to the free memory without passing it",
    "recent": "the last to ask",
    "random": "a seeded random choice",
})

# --- the client socket's error codes -------------------------------------------------------

ErrorCode = Literal["malformed", "too-large", "unsupported-version", "unknown-type", "bad-field",
                    "not-registered", "already-registered", "too-many-connections"]
ERROR_CODE: Final = _vocabulary("error_code", ErrorCode, {
    "malformed": "not a message of the protocol's form",
    "too-large": "over the message size limit, or more than one frame",
    "unsupported-version": "a major version this scheduler does not speak",
    "unknown-type": "a message type this scheduler does not know",
    "bad-field": "a required field is missing or a value has the wrong form",
    "not-registered": "a message that needs HELLO first",
    "already-registered": "a second HELLO on one connection",
    "too-many-connections": "the scheduler serves no more connections of this user or pod now (or none at all; "
                            "`detail` says which limit): sent instead of serving a new connection, which it then "
                            "closes; the client connects again later",
})

VOCABULARIES: Final = (MODE, RELEASE_REASON, DROP_REASON, REVOKE_REASON, REFUSE_REASON, ADMISSION_POLICY,
                       ERROR_CODE)

# --- device ids ----------------------------------------------------------------------------

# What the protocol accepts as a device id: CUDA's UUID strings (GPU-…, MIG-…) and anything of
# the same alphabet, at most DEVICE_ID_MAX characters.
DEVICE_ID_MAX: Final = 96
DEVICE_ID: Final = re.compile(rf"[A-Za-z0-9-]{{1,{DEVICE_ID_MAX}}}\Z")
# How the driver (and so the interceptor and NVML) writes a GPU's UUID; a control request may
# name a device no client has announced yet only in this form.
GPU_UUID: Final = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


def gpu_uuid(raw: bytes) -> str:
    """The canonical text of a 16-byte CUDA UUID (cuDeviceGetUuid): GPU-xxxxxxxx-xxxx-…"""
    digits = raw.hex()
    return f"GPU-{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:32]}"
