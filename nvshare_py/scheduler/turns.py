"""A gang's turns as the lock core runs them (issue 19; gangs.py says what a gang and a turn are;
docs/scheduler.md, *Gangs*, is the user's account): joining a named gang and waiting for its
members, a unit's request for a turn queued on all its devices at one place, the turn granted
everywhere at once or not at all, a member's ACQUIRE or new device within a running turn, the
turn's end (DROP to all) and the fence that stops every member after the same collective.

The lock (lock.py) asks here where its rules meet a gang (a gang's waiter is next, a gang's grant
is dropped, a device a turn reserves is settled), and a turn changes its devices through the
lock's own operations: GangTurns is given the lock as LockRules, what it needs of it, so that
this module imports nothing above it.
"""

from __future__ import annotations

from typing import Hashable, Protocol

from .. import protocol
from . import gangs
from .core_config import CoreConfig
from .events import Action, LockEvent, Log, Register, Send, key_values
from .queue_order import next_waiter
from .records import Client, Device, Pair
from .registry import Registry
from .swapping import Swapping


class LockRules(Protocol):
    """What a turn does through the lock (lock.Lock), on each of its devices."""

    def settle(self, dev: Device, now: float, out: list[Action]) -> None: ...

    def grant(self, pair: Pair, now: float, out: list[Action]) -> None: ...

    def drop(self, pair: Pair, now: float, reason: str, out: list[Action], grace: float | None = None) -> None: ...

    def enqueue(self, pair: Pair, now: float, out: list[Action], seq: int | None = None,
                klass: int | None = None) -> bool: ...

    def leave_queue(self, pair: Pair, now: float) -> None: ...

    def new_queue_place(self) -> int: ...

    def blocked(self, dev: Device, pair: Pair) -> bool: ...

    def forget_if_unused(self, dev: Device) -> None: ...


def live_pairs(turn: gangs.Turn) -> list[Pair]:
    """The pairs whose current grant belongs to `turn`."""
    return [pair for grant, pair in turn.grants.items() if pair.hold is not None and pair.hold.grant == grant]


class GangTurns:
    """The named gangs by gangs.key (a gang lives while it has members), their display numbers,
    the turn numbers, and when each gang that waits for members stops waiting."""

    def __init__(self, lock: LockRules, config: CoreConfig, registry: Registry, swapping: Swapping) -> None:
        self._lock = lock
        self._config = config
        self._registry = registry
        self._swapping = swapping
        self._gangs: dict[Hashable, gangs.Gang] = {}
        self._gang_numbers = 0
        self._turn_numbers = 0
        self._deadlines: dict[gangs.Gang, float] = {}

    def next_deadline(self) -> float | None:
        """When the first gang that waits for its members stops waiting."""
        return min(self._deadlines.values(), default=None)

    def tick(self, now: float, out: list[Action]) -> None:
        """The gangs whose wait for their members ran out by `now` run with those they have."""
        for gang, wait_end in list(self._deadlines.items()):
            if wait_end <= now:
                self._waited_out(gang, now, out)

    def units(self) -> list[gangs.Gang]:
        """The named gangs and the processes that are gangs of one (several devices), in the
        order they formed."""
        solo = [client.gang for client in self._registry.clients.values() if client.gang.solo and client.gang.ganged]
        return list(self._gangs.values()) + solo

    def take_over(self, old: Client, new: Client) -> None:
        """`new` is `old` reconnected: the process's own unit goes on, with its turn."""
        if old.gang.solo and new.gang.solo:
            del new.gang.members[new]
            new.gang = old.gang
            del old.gang.members[old]
            new.gang.members[new] = None
            new.gang.display = new.cid

    def leave(self, client: Client) -> None:
        """The client's registration ends: it leaves its gang, which ends with its last member."""
        gang = client.gang
        gang.members.pop(client, None)
        if not gang.solo and not gang.members:
            del self._gangs[gang.key]
            self._deadlines.pop(gang, None)

    def join(self, client: Client, ev: Register, out: list[Action]) -> None:
        """The registration's HELLO named a gang: it joins it (made on its first member)."""
        if not ev.gang:
            return
        why = gangs.refusal(ev.gang, ev.gang_size, client.info)
        if why is not None:
            out.append(Log("warning", "gang-refused", {"client": client.cid, "gang": ev.gang[:gangs.GANG_NAME_MAX],
                                                      "why": why}))
            return
        key = gangs.key(ev.gang, client.info)
        gang = self._gangs.get(key)
        if gang is None:
            self._gang_numbers += 1
            gang = self._gangs[key] = gangs.Gang(key, ev.gang, f"g{self._gang_numbers}", ev.gang_size)
        elif ev.gang_size != gang.size:
            out.append(Log("warning", "gang-size-differs", {"client": client.cid, "gang": gang.display,
                                                           "size": ev.gang_size, "kept": gang.size}))
        del client.gang.members[client]
        client.gang = gang
        gang.members[client] = None
        out.append(LockEvent(ev.now, "gang-join", client=client.cid, detail=key_values(
            {"gang": gang.display, "name": gang.name, "members": len(gang.members), "size": gang.size})))
        out.append(Log("info", "gang-joined", {"client": client.cid, "gang": gang.display, "name": gang.name,
                                               "members": len(gang.members), "size": gang.size}))

    def check_formed(self, gang: gangs.Gang, now: float, out: list[Action]) -> None:
        """A gang that has all its members stops waiting for them; if one asked meanwhile, the
        gang asks for its turn now."""
        if gang.formed or not gang.complete():
            return
        gang.formed = True
        self._deadlines.pop(gang, None)
        if gang.asked_at is not None:
            gang.asked_at = None
            self.request_turn(gang, now, out)

    def _waited_out(self, gang: gangs.Gang, now: float, out: list[Action]) -> None:
        """The wait for missing members ran out (--gang-wait): the gang runs with those it has."""
        del self._deadlines[gang]
        gang.formed = True
        gang.asked_at = None
        out.append(LockEvent(now, "gang-incomplete", detail=key_values(
            {"gang": gang.display, "members": gang.present(), "size": gang.size, "name": gang.name})))
        out.append(Log("warning", "gang-incomplete", {"gang": gang.display, "name": gang.name,
                                                      "members": gang.present(), "size": gang.size,
                                                      "waited": self._config.gang_wait}))
        self.request_turn(gang, now, out)

    def acquire(self, pair: Pair, now: float, out: list[Action]) -> None:
        """ACQUIRE from a member of a ganged unit. Within a running turn it is granted at once
        on a device the turn reserves, or on one nobody holds, reserves or waits for (which
        joins the turn); on any other device the turn ends (DROP `gang`), since holding some of
        a gang's devices while waiting for another is how gangs deadlock. Otherwise the whole
        gang asks for its next turn (after its members came, or the wait for them ran out)."""
        gang = pair.client.gang
        self.check_formed(gang, now, out)
        if pair.waiting_since is not None or (pair.hold is not None and pair.hold.state == "holding"):
            return
        turn = gang.turn
        if turn is not None and not turn.ending:
            if self._joins_turn(turn, pair):
                self._join_turn(turn, pair, now, out)
                return
            self.end_turn(turn, "gang", now, out)
        if not gang.complete():
            if gang.asked_at is None:
                gang.asked_at = now
                self._deadlines[gang] = now + self._config.gang_wait
                out.append(Log("info", "gang-waits", {"gang": gang.display, "client": pair.client.cid,
                                                      "members": gang.present(), "size": gang.size}))
            return
        self.request_turn(gang, now, out)

    def announced(self, pair: Pair, now: float, out: list[Action]) -> None:
        """A member of a ganged unit uses a new device (a member that came late, or a process
        that began to use another device). While the gang asks for a turn, the device joins
        the request; while its turn runs, the device joins the turn if nobody holds, reserves
        or waits for it (the member is granted it unasked). Otherwise it waits for the
        member's ACQUIRE (GangTurns.acquire)."""
        gang = pair.client.gang
        self.check_formed(gang, now, out)  # the member is present now (gangs.Gang.present)
        if pair.waiting_since is not None or pair.hold is not None:
            return
        turn = gang.turn
        if turn is not None and not turn.ending:
            if self._joins_turn(turn, pair):
                self._join_turn(turn, pair, now, out)
            return
        request = self.request_of(gang)
        if request is not None and self._lock.enqueue(pair, now, out, request.queued_seq, request.queued_class):
            self._lock.settle(pair.device, now, out)

    def _joins_turn(self, turn: gangs.Turn, pair: Pair) -> bool:
        dev = pair.device
        return dev in turn.devices or (dev.reserved is None and not dev.queue and not self._lock.blocked(dev, pair))

    def queue_class(self, gang: gangs.Gang) -> int:
        """The priority class a gang's waiters queue in: its members' highest, one for all of
        them, so that the gang ranks alike on every device."""
        return max(self._registry.priority(member) for member in gang.members)

    def request_of(self, gang: gangs.Gang) -> Pair | None:
        """A pair of the gang's pending request for a turn (its place and class), if any."""
        return next((pair for pair in gang.pairs() if pair.gang_queued), None)

    def request_turn(self, gang: gangs.Gang, now: float, out: list[Action]) -> None:
        """Queue every pair of every member with one place in ACQUIRE order, so that the gang
        is ahead of or behind any other waiter alike on all its devices: the earliest place
        one of its pairs already has (a process that began to use a second device keeps the
        place it had on its first), else a new one. A member that holds a device outside a
        turn (a claim after a restart, or a process that began to use a second device) may
        not hold it while the gang waits: it is dropped and queues too."""
        pairs = gang.pairs()
        waiting = [pair for pair in pairs if pair.waiting_since is not None]
        if waiting:
            first = min(waiting, key=lambda pair: pair.queued_seq)
            seq, klass = first.queued_seq, first.queued_class
        else:
            seq, klass = self._lock.new_queue_place(), self.queue_class(gang)
        touched: dict[Device, None] = {}
        for pair in waiting:
            if not pair.gang_queued:  # it waited on its own: it waits with its gang now
                self._lock.leave_queue(pair, now)
        for pair in pairs:
            if self._lock.enqueue(pair, now, out, seq, klass):
                touched[pair.device] = None
        for dev in touched:  # only once every pair waits: a turn never starts with a part
            self._lock.settle(dev, now, out)
        if gang.turn is None:  # it could not start at once (start_turn takes such holds in)
            for pair in pairs:
                if pair.hold is not None and pair.hold.turn is None and pair.hold.state == "holding":
                    self._lock.drop(pair, now, "gang", out)
                    self._lock.enqueue(pair, now, out, seq, klass)
                    self._lock.settle(pair.device, now, out)

    def start_turn(self, gang: gangs.Gang, now: float, out: list[Action]) -> bool:
        """Grant the gang every device it asked for at once, or nothing: each of its waiting
        pairs must be the next waiter of its device and not blocked there, and room must be
        made for each (residency). Returns whether the turn began."""
        if gang.turn is not None:
            return False  # the last one has not ended (members still drain)
        queued = [pair for pair in gang.pairs() if pair.gang_queued]
        for pair in queued:
            dev = pair.device
            head = dev.evict_for or next_waiter(dev, self._config.ageing)
            if pair.hold is not None or head is None or head.client.gang is not gang or self._lock.blocked(dev, pair):
                return False
        if not all(self._swapping.room_made(pair.device, pair, now, out) for pair in queued):
            return False
        self._turn_numbers += 1
        turn = gang.turn = gangs.Turn(gang, self._turn_numbers, now)
        gang.turns += 1
        for pair in queued:
            self._grant_in_turn(turn, pair, now, out)
        for pair in gang.pairs():  # a hold made outside a turn joins it (a claim, a first device)
            hold = pair.hold
            if hold is not None and hold.turn is None and hold.state == "holding":
                hold.turn = turn
                turn.grants[hold.grant] = pair
                turn.devices[pair.device] = None
                pair.device.reserved = turn
        out.append(LockEvent(now, "gang-turn", detail=key_values(
            {"gang": gang.display, "turn": turn.number, "members": ",".join(m.cid for m in gang.members),
             "devices": len(turn.devices)})))
        out.append(Log("info", "turn-granted", {"gang": gang.display, "turn": turn.number,
                                                "members": len(gang.members), "devices": len(turn.devices)}))
        return True

    def _join_turn(self, turn: gangs.Turn, pair: Pair, now: float, out: list[Action]) -> None:
        """`pair` (the member that asked or announced) is granted its device within the running
        turn; a device new to the turn goes also to every other member that announced it."""
        new = pair.device not in turn.devices
        self._grant_in_turn(turn, pair, now, out)
        for other in turn.unit.pairs() if new else ():
            if other.device is pair.device and other.hold is None and other.waiting_since is None:
                self._grant_in_turn(turn, other, now, out)

    def _grant_in_turn(self, turn: gangs.Turn, pair: Pair, now: float, out: list[Action]) -> None:
        self._lock.grant(pair, now, out)
        pair.held.turn = turn
        turn.grants[pair.held.grant] = pair
        dev = pair.device
        if dev not in turn.devices:
            turn.devices[dev] = None
            dev.reserved = turn
        self._lock.settle(dev, now, out)

    def end_turn(self, turn: gangs.Turn, reason: str, now: float, out: list[Action]) -> None:
        """The gang's hold ends: DROP to every member still holding (a DROP reaches them all).
        A member that paused for idleness (in mode `on`, where its device waited for it) is
        granted its device again and dropped with the others: the fence (_settle_fence) may
        find it behind their collectives, and it must then launch up to theirs."""
        turn.ending = True
        for pair in dict.fromkeys(pair for grant, pair in turn.grants.items() if grant in turn.idle):
            self.fence_paused(turn, pair, now, out)
        for pair in live_pairs(turn):
            if pair.held.state == "holding":
                self._lock.drop(pair, now, reason, out)
        for dev in turn.devices:
            self._lock.settle(dev, now, out)

    def fence_paused(self, turn: gangs.Turn, pair: Pair, now: float, out: list[Action],
                     reason: str | None = None) -> None:
        """A member paused for idleness while its gang's turn ends (in mode `on`, where its
        device waited for it) is granted its device again, to be dropped with the fence: the
        others may have launched collectives it has not, and it must launch up to theirs.
        `reason`: drop it now, with that reason (else end_turn drops it with the others). Not
        once no other member holds: their collectives all completed, so none waits for it."""
        if (pair.hold is None and pair.waiting_since is None and pair.device in turn.devices
                and pair.device.mode == "on" and pair.client.pairs.get(pair.device.id) is pair
                and live_pairs(turn)):
            self._grant_in_turn(turn, pair, now, out)
            if reason is not None and pair.hold is not None and pair.hold.state == "holding":
                self._lock.drop(pair, now, reason, out)

    def fenced(self, client: Client, now: float, fenced: protocol.Fenced, out: list[Action]) -> None:
        """FENCED: a dropped member of a gang's turn stopped launching collectives after
        `collectives` of them (its gate is closed) and waits for FENCE."""
        pair = client.pairs.get(fenced.device)
        hold = pair.hold if pair is not None else None
        turn = hold.turn if hold is not None and hold.grant == fenced.grant else None
        if turn is None or turn.fence.get(fenced.grant, 0) is not None:
            out.append(Log("debug", "fenced-stale", {"client": client.cid, "device": fenced.device,
                                                     "grant": fenced.grant}))
            return
        turn.fence[fenced.grant] = fenced.collectives
        self._settle_fence(turn, now, out)

    def _settle_fence(self, turn: gangs.Turn, now: float, out: list[Action]) -> None:
        """Once every dropped member still holding has said where it stopped (members that
        released, left, were revoked or do not count collectives are not waited for), tell them
        all the most any said: each launches collectives up to it, so all stop after the same
        one, and none of them waits in a collective for a partner that stopped before it."""
        if turn.fence_target is not None or not turn.fence:
            return
        live = {pair.held.grant: pair for pair in live_pairs(turn)}
        if any(turn.fence.get(grant) is None for grant in live):  # (a grant not dropped yet will be)
            return
        said = [(grant, count) for grant, count in turn.fence.items() if count is not None and grant in live]
        if not said:
            return
        target = turn.fence_target = max(count for _, count in said)
        for grant, _ in said:
            pair = live[grant]
            out.append(Send(pair.client.key, protocol.Fence(device=pair.device.id, grant=grant, collectives=target)))
        out.append(LockEvent(now, "gang-fence", detail=key_values(
            {"gang": turn.unit.display, "turn": turn.number, "collectives": target,
             "behind": sum(1 for _, count in said if count < target)})))

    def check_turn(self, turn: gangs.Turn, now: float, out: list[Action]) -> None:
        """A member released (other than for idleness), left or died, or was revoked: the
        gang's hold ends (DROP `gang` to the others); once none of its grants is left, its
        devices are free together. A member that released for idleness only pauses: its
        device stays with the turn, and it is granted it again at once when it asks (its
        partners may wait in a collective for it); the turn ends with its quantum, or when
        every member has released."""
        live = live_pairs(turn)
        ended = len(turn.grants) - len(live) - len(turn.idle)
        if live and ended > 0 and not turn.ending:
            self.end_turn(turn, "gang", now, out)
        if live:
            self._settle_fence(turn, now, out)  # a member it waited for has gone
            return
        gang = turn.unit
        if gang.turn is turn:
            gang.turn = None
        for dev in turn.devices:
            if dev.reserved is turn:
                dev.reserved = None
            self._lock.settle(dev, now, out)
        for pair in gang.pairs():  # its next request may now start
            if pair.gang_queued:
                self._lock.settle(pair.device, now, out)
        out.append(LockEvent(now, "gang-end", detail=key_values({"gang": gang.display, "turn": turn.number})))
        for dev in turn.devices:
            self._lock.forget_if_unused(dev)
