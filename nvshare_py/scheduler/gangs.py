"""Gangs: the processes of one multi-GPU job, granted their devices together (issue 19).

The lock core runs the turns (turns.py); this module holds what a gang is and the small pure
decisions about it, which the core's records (records.py) refer to. docs/scheduler.md, *Gangs*, is the
user's account of the rules.

Words used here and in the core:
- a *unit* is what the scheduler grants as a whole: a named gang (HELLO `gang=`), or one
  process on its own (`Gang.solo`). A unit is *ganged* when it must be granted all its
  devices at once: a named gang always, a solo process once it uses several devices (a gang
  of one). A solo process on one device is scheduled exactly as before gangs existed.
- a *turn* is one grant of a ganged unit: every device of every member, granted at the same
  moment, with one quantum. While the turn lasts its devices are *reserved*: in mode `on`
  nobody outside the unit is granted them, even where the member on a device has already
  released, so that a GPU of the gang passes to someone else only when the whole gang has
  released (or been revoked).
"""

from __future__ import annotations

from typing import Any, Hashable

from .events import ClientInfo

# What a HELLO may say about its gang: longer names or larger sizes register the process
# without a gang (and say so in the log), so that nothing a client says grows the daemon's
# state beyond its registrations (docs/scheduler.md, *Bounded state*).
GANG_NAME_MAX = 128
GANG_SIZE_MAX = 256


def refusal(name: str, size: int, info: ClientInfo) -> str | None:
    """Why a HELLO's gang is not honoured (None: it is)."""
    if len(name) > GANG_NAME_MAX:
        return f"gang name longer than {GANG_NAME_MAX} characters"
    if size > GANG_SIZE_MAX:
        return f"gang size {size} above {GANG_SIZE_MAX}"
    if info.uid is None:
        # Members are matched by the kernel-verified uid: without it anyone could join.
        return "the process's uid is not visible to the scheduler"
    return None


def key(name: str, info: ClientInfo) -> Hashable:
    """Whose gang `name` is: the same name from another user, or from another pod, is
    another gang, so nobody can join or hijack a gang by naming it. The uid and the pod's UID
    are the kernel's; namespace and pod only separate further."""
    return ("gang", info.uid, info.pod_uid, info.namespace, info.pod, name)


class Turn:
    """One grant of a ganged unit. `grants`: every grant made in it (grant id -> pair), the
    first ones at the same moment, later ones to members that asked again (after an idle
    release) or joined while it ran; `devices`: what it reserves; `ending`: it was dropped (a
    member released, left or was dropped), so nothing more is granted in it; `told`:
    (contended, quantum end) as its devices were last settled, to settle them all again when
    that changes; `fence`: once dropped, the collectives each dropped grant said it launched
    (`FENCED`; None while awaited), and `fence_target` the count told back (`FENCE`)."""

    __slots__ = ("unit", "number", "since", "grants", "devices", "ending", "told", "idle", "fence", "fence_target")

    def __init__(self, unit: "Gang", number: int, since: float) -> None:
        self.unit = unit
        self.number = number
        self.since = since
        self.grants: dict[int, Any] = {}  # of records.Pair (records.py imports this module, not the reverse)
        self.devices: dict[Any, None] = {}  # of records.Device
        self.ending = False
        self.told: tuple[bool, float] = (False, 0.0)
        self.idle: set[int] = set()  # grants released for idleness: a pause, not the turn's end
        self.fence: dict[int, int | None] = {}
        self.fence_target: int | None = None


class Gang:
    """A unit (see the module's words). `size`: the members it waits for (0: not said, it waits
    for none), each present once it has named a device; `formed`: it has had them all, or the
    wait for them ran out (then it never waits again); `asked_at`: a member asked while it was
    not formed (the wait runs from there)."""

    __slots__ = ("key", "name", "display", "size", "members", "formed", "asked_at", "turn", "turns")

    def __init__(self, key: Hashable, name: str, display: str, size: int) -> None:
        self.key = key
        self.name = name
        self.display = display  # "g3" for a named gang, the client's id for a solo process
        self.size = size
        self.members: dict[Any, None] = {}  # records.Client -> None, in joining order
        self.formed = size <= 1
        self.asked_at: float | None = None
        self.turn: Turn | None = None
        self.turns = 0

    @property
    def solo(self) -> bool:
        return not self.name

    def pairs(self) -> list[Any]:
        return [pair for member in self.members for pair in member.pairs.values()]

    @property
    def ganged(self) -> bool:
        if not self.solo:
            return True
        return any(len(member.pairs) > 1 for member in self.members)

    def present(self) -> int:
        """Members that have said which device they use: a rank that registered has not yet
        (its DEVICE follows its HELLO), and a turn granted before would leave it out."""
        return sum(1 for member in self.members if member.pairs)

    def complete(self) -> bool:
        return self.formed or self.present() >= self.size

