"""The GPU lock of every device as a pure state machine (sans-I/O): who holds it, who waits for
it, and the rules that grant, drop and revoke it (docs/protocol.md, "Scheduling rules" and "Lock
state"). The core (core.py) turns events into calls of `Lock`; every rule that decides a grant
lives here, and `settle` applies them all after anything about a device changed.

Words used below:
- a *pair* is one (client, device) relation: the client's memory use on the device, its place
  in the device's queue, its current grant and its statistics (records.py);
- an *active holder* holds a grant in state `holding` or `draining` (after a DROP); active
  holders are what the mode rules count;
- a *lent* grant is made to a waiter that has nothing to move while the next waiter cannot run
  yet for its memory (room is being made for it, or it brings its memory back ahead of its
  grant); it is dropped as soon as that waiter is ready (_lend, _recall_loans);
- a grant revoked after its grace ran out but not yet released is *overdue*: it is listed in
  the status so the operator sees it, but it no longer counts for granting. (For mode `on`,
  "draining and overdue holders count" means holders past their quantum, which are still
  active; a revoked grant never blocks the lock, or one hung client would stop a device.)

Time comparisons use `>=` throughout: a deadline is due at the very tick `next_deadline()`
announced, so after a Tick at `now` the next deadline always lies after `now`.

Beside it, and called at the moments of its rules: the order of service (queue_order.py), the
swapping (swapping.py: room before a grant, what a handoff moves) and a gang's turns (turns.py,
which changes devices through the lock in return). No clock, no I/O.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator

from .. import protocol
from . import fairshare, gangs, residency
from .core_config import CoreConfig, ms
from .events import Action, LockEvent, Log, Send
from .queue_order import next_waiter, rank, service_order
from .records import Device, Hold, Pair
from .registry import Registry
from .swapping import Swapping, end_eviction_wait
from .turns import GangTurns, live_pairs

# How many of those ahead of a waiter, when its wait began, a pair remembers (for QUERY's
# `last_wait`, nvshare_py/scheduler/views.py): a bound, so that a long queue costs no more.
AHEAD_REMEMBERED = 4


def grant_message(dev: Device, grant: int, prefetch: int = 0) -> protocol.Grant:
    """GRANT of `grant`, with the device's mode and quantum as they are now."""
    return protocol.Grant(device=dev.id, grant=grant, mode=dev.mode, exclusive=dev.mode == "on",
                          quantum_ms=ms(dev.tq), prefetch=prefetch)


class Lock:
    """The lock state of the registry's devices (their holders and queues live in their
    records): the grant and queue numbers, the devices' next deadlines, the recovery window.
    `turns` (turns.py) is asked where a gang's waiter is next or a gang's grant ends, and acts
    through the lock in return."""

    def __init__(self, config: CoreConfig, registry: Registry, swapping: Swapping, now: float) -> None:
        self._config = config
        self._registry = registry
        self._swapping = swapping
        self.turns = GangTurns(self, config, registry, swapping)
        # Earliest pending drop/quantum deadline per device; refreshed after every change.
        self._deadlines: dict[Device, float] = {}
        self._grant_numbers = 0
        self._queue_numbers = 0
        self._recovery_end: float | None = now + config.recovery if config.recovery > 0 else None
        # Devices to settle (see settle): a gang's grant or drop on one device changes others.
        self._unsettled: dict[Device, None] = {}
        self._settling = False

    # --- time -----------------------------------------------------------------------------

    def recovering(self, now: float) -> bool:
        """Whether `now` is inside the recovery window after a restart, in which only the claims
        of reconnecting holders are granted (claim)."""
        return self._recovery_end is not None and now < self._recovery_end

    def end_recovery(self, now: float, out: list[Action]) -> bool:
        """Whether the recovery window ends at `now` (then every device is settled again)."""
        if self._recovery_end is None or now < self._recovery_end:
            return False
        self._recovery_end = None
        out.append(Log("info", "recovered"))
        return True

    def next_deadline(self) -> float | None:
        """The end of the recovery window, or the earliest grace or quantum end that matters."""
        whens = list(self._deadlines.values())
        if self._recovery_end is not None:
            whens.append(self._recovery_end)
        return min(whens, default=None)

    def due(self, now: float) -> list[Device]:
        """The devices with a timer that is due at `now`."""
        return [dev for dev, deadline in self._deadlines.items() if deadline <= now]

    # --- quanta ---------------------------------------------------------------------------

    def quantum_end(self, pair: Pair) -> float:
        """When the quantum of the pair's current grant ends (it matters only while others
        wait): its weighted quantum, cut to the floor while a waiter outranks it. A gang's
        grants share one quantum (gangs.py): from the turn's start, the shortest of its
        members' on their devices."""
        turn = pair.held.turn
        if turn is not None:
            return turn.since + min(self._quantum_length(member) for member in live_pairs(turn))
        return pair.held.since + self._quantum_length(pair)

    def _quantum_length(self, pair: Pair) -> float:
        dev = pair.device
        hold = pair.held
        contenders = itertools.chain(dev.holders.values(), dev.queue)
        heaviest = max((self._registry.weight(other.client) for other in contenders), default=1)
        length = fairshare.quantum(dev.tq, self._registry.weight(pair.client), heaviest, self._config.min_quantum)
        best = next_waiter(dev, self._config.ageing)
        if self._config.swapping and best is not None and best is not pair:
            # Over a budget the handoff swaps: the quantum is long enough that this takes at
            # most a tenth of it (residency.py), beyond the TQ if need be.
            length = max(length, residency.quantum_floor(dev, pair, best))
        # The holder ages as if it still waited: one that queued before a waiter of its own
        # class has aged at least as much, so ageing never makes equals cut each other's quanta
        # (it only lifts a lower class past a higher one).
        holder_rank = fairshare.effective_class(hold.klass, dev.grants_made - hold.aged_from, self._config.ageing)
        if best is not None and rank(best, self._config.ageing) > holder_rank:
            length = min(length, self._config.min_quantum, dev.tq)
        return length

    # --- the lock rules -------------------------------------------------------------------

    def settle(self, dev: Device, now: float, out: list[Action]) -> None:
        """Bring the device in line with the rules after anything about it changed. A gang's
        grant, drop or end on one device changes its others: those are settled too, in the
        same call (a device is queued here while another is being settled)."""
        self._unsettled[dev] = None
        if self._settling:
            return
        self._settling = True
        try:
            while self._unsettled:
                next_dev = next(iter(self._unsettled))
                del self._unsettled[next_dev]
                self._settle_device(next_dev, now, out)
        finally:
            self._settling = False

    def _settle_device(self, dev: Device, now: float, out: list[Action]) -> None:
        """Revoke holders whose grace ran out, end a gang's turn that lost a member, drop
        holders that may no longer run together, grant what the queue allows, drop holders
        whose quantum ended while someone waits."""
        while True:
            self._revoke_due(dev, now, out)
            if dev.reserved is not None:
                self.turns.check_turn(dev.reserved, now, out)
            dropped = self._enforce_exclusion(dev, now, out)
            dropped |= self._recall_loans(dev, now, out)
            self._grant_waiters(dev, now, out)
            dropped |= self._drop_expired(dev, now, out)
            # A DROP with grace 0 is due at once: go round again so it is revoked (and the
            # lock passed on) now, not at a tick that next_deadline() would put at `now`.
            if not dropped or not self._revocations_due(dev, now):
                break
        if dev.evict_deadline is not None and (not dev.queue or now >= dev.evict_deadline):
            end_eviction_wait(dev)  # nobody waits for the room any more, or not longer
        self._swapping.relieve_pressure(dev, now, out)
        self._swapping.prefetch_ahead(dev, now, out)
        self._notify_contention(dev, now, out)
        self._refresh_deadline(dev)
        turn = dev.reserved
        if turn is not None and not turn.ending:
            # Contention on one device of a turn moves the quantum of all: tell them all.
            live = live_pairs(turn)
            told = (self._turn_contended(turn), self.quantum_end(live[0]) if live else 0.0)
            if told != turn.told:
                turn.told = told
                for other in turn.devices:
                    if other is not dev:
                        self.settle(other, now, out)

    def _timers(self, dev: Device) -> Iterator[tuple[float, Pair, str]]:
        """(when, pair, what) for each holder's timer that matters now: a DROP'd grant is
        revoked when its grace ends; while others wait (outside mode off), a holding grant is
        dropped when its quantum ends. The one source of what a Tick does and of
        next_deadline()."""
        for pair in dev.holders.values():
            hold = pair.held
            if hold.state == "draining":
                yield hold.deadline, pair, "revoke"
            elif self._holder_contended(pair):
                yield self.quantum_end(pair), pair, "drop"
        for pair in dev.queue:
            when = pair.swap.restore_by
            if when is not None and math.isfinite(when):
                yield when, pair, "restore"  # granted then, whatever it still has out

    def _revocations_due(self, dev: Device, now: float) -> list[Pair]:
        return [pair for when, pair, what in self._timers(dev) if what == "revoke" and now >= when]

    def _revoke_due(self, dev: Device, now: float, out: list[Action]) -> None:
        for pair in self._revocations_due(dev, now):
            hold = pair.held
            cid = pair.client.cid
            del dev.holders[hold.grant]
            self._hold_over(pair, now)
            hold.state = "overdue"
            pair.overdue[hold.grant] = hold
            dev.overdue[hold.grant] = pair
            out.append(Send(pair.client.key, protocol.Revoke(device=dev.id, grant=hold.grant, reason="grace-expired")))
            out.append(LockEvent(now, "revoke", dev.id, cid, hold.grant, "grace-expired"))
            out.append(Log("warning", "revoked", {"client": cid, "device": dev.id, "grant": hold.grant,
                                        "pid": pair.client.info.pid, "reason": hold.reason}))

    def _enforce_exclusion(self, dev: Device, now: float, out: list[Action]) -> bool:
        """Mode on allows one active holder; auto allows several while their memory fits the
        budget. Otherwise every holder but the one granted first is dropped."""
        if len(dev.holders) < 2 or dev.mode == "off":
            return False
        if dev.mode == "auto":
            budget = dev.budget
            if budget > 0 and dev.held_used() <= budget:
                return False
            reason = "memory"
        else:
            reason = "mode"
        first, *rest = dev.holders.values()
        # A gang's members on one device hold it together, as one holder.
        later = [pair for pair in rest if pair.held.state == "holding"
                 and (first.held.turn is None or pair.held.turn is not first.held.turn)]
        for pair in later:
            if pair.held.state == "holding":  # not dropped meanwhile with the rest of its gang
                self.drop(pair, now, reason, out)
        return bool(later)

    def _grant_waiters(self, dev: Device, now: float, out: list[Action]) -> None:
        if self.recovering(now):
            return  # only claims of reconnecting holders are granted until recovery ends
        while dev.queue:
            pair = dev.evict_for or next_waiter(dev, self._config.ageing)  # room is being made for the former
            assert pair is not None  # the queue is not empty
            if pair.hold is not None:
                break  # a draining holder that asked again waits for its own release
            if pair.gang_queued:
                if not self.turns.start_turn(pair.client.gang, now, out):
                    break  # the gang reserves the device until it has all of its devices
                continue
            if self.blocked(dev, pair):
                break  # FCFS within the class: nobody overtakes the next one
            if not self._swapping.room_made(dev, pair, now, out) or self._swapping.restores_first(pair, now):
                # The next one waits for EVICTED answers, or for its memory to come back: the
                # lock is lent meanwhile, and it is served first once it is ready.
                self._lend(dev, pair, now, out)
                break
            self.grant(pair, now, out)

    def _lend(self, dev: Device, head: Pair, now: float, out: list[Action]) -> None:
        """While `head`, the next waiter, cannot run yet for its memory (room is being made for it,
        or it brings it back ahead of its grant: swapping.restores_first), the waiters behind it
        that are ready (nothing of theirs to move: swapping.ready) are granted in service order,
        as far as the mode lets them run; each such grant is *lent*: it ends (DROP quantum) as
        soon as `head` is ready (_recall_loans). So the lock is not idle for a swap-in, and a
        waiter is held up by one that overtook it for at most that one's drain."""
        for pair in service_order(dev, self._config.ageing):
            if pair is head or pair.hold is not None or pair.gang_queued or not self._swapping.ready(dev, pair):
                continue
            if self.blocked(dev, pair):
                if dev.mode == "on":
                    return  # one holder at a time: nobody else fits beside it
                continue  # auto: a smaller one may fit
            self.grant(pair, now, out)
            pair.held.ahead_of = head
            out.append(Log("debug", "lent", {"client": pair.client.cid, "device": dev.id, "ahead_of": head.client.cid}))

    def _recall_loans(self, dev: Device, now: float, out: list[Action]) -> bool:
        """Lent grants (_lend) whose waiter is ready now, or whose time to bring its memory back
        ran out, are dropped if that waiter may not run beside them (in mode auto it may, where
        their memory fits); one whose waiter left the queue or was granted, or may run beside
        it, is an ordinary grant from then on. Returns whether it dropped any."""
        recalled = False
        for pair in list(dev.holders.values()):
            hold = pair.held
            head = hold.ahead_of
            if head is None or hold.state != "holding":
                continue
            if head.waiting_since is None:
                hold.ahead_of = None
            elif self._swapping.room_ready(dev, now) and not self._swapping.restores_first(head, now):
                hold.ahead_of = None
                if self.blocked(dev, head):
                    self.drop(pair, now, "quantum", out)
                    recalled = True
        return recalled

    @staticmethod
    def _contended(dev: Device) -> bool:
        """Someone waits for the device in a mode where quanta count: holders' quanta end."""
        return bool(dev.queue) and dev.mode != "off"

    def _drop_expired(self, dev: Device, now: float, out: list[Action]) -> bool:
        expired = [pair for when, pair, what in self._timers(dev) if what == "drop" and now >= when]
        for pair in expired:
            if pair.held.state == "holding":  # not dropped meanwhile with the rest of its gang
                self.drop(pair, now, "quantum", out)
        return bool(expired)

    def _refresh_deadline(self, dev: Device) -> None:
        whens = [when for when, _, _ in self._timers(dev)]
        if dev.evict_deadline is not None:
            whens.append(dev.evict_deadline)
        best = min(whens, default=None)
        if best is None:
            self._deadlines.pop(dev, None)
        else:
            self._deadlines[dev] = best

    def _notify_contention(self, dev: Device, now: float, out: list[Action]) -> None:
        """CONTENDED to each holder whose quantum still runs, once per contention episode
        (from the first waiter until the queue is empty again), so that it can drain ahead of
        the quantum's end. Holders whose quantum has run out were dropped instead."""
        for pair in dev.holders.values():
            hold = pair.held
            if not self._holder_contended(pair):
                hold.contended = False
                continue
            if hold.state != "holding":
                continue
            swap = self._swapping.contended_swap(pair)
            if (not hold.contended or self.quantum_end(pair) != hold.told_end
                    or residency.swap_notice_changed(hold.told_swap, swap)):
                # Again when the quantum's end moved (a heavier or higher-class waiter came), or
                # what the handoff will move or cost did.
                hold.contended = True
                hold.told_end = self.quantum_end(pair)
                hold.told_swap = swap
                left = ms(hold.told_end - now)
                out.append(Send(pair.client.key, protocol.Contended(device=dev.id, grant=hold.grant,
                                                                    quantum_left_ms=left, evict=swap[0],
                                                                    idle_ms=swap[1])))
                out.append(Log("debug", "contended", {"client": pair.client.cid, "device": dev.id, "grant": hold.grant,
                                            "quantum_left_ms": left, "evict": swap[0], "idle_ms": swap[1]}))

    def _serialised_against(self, dev: Device, pair: Pair) -> bool:
        """Whether `pair` may not run beside the device's current (non-empty) holders."""
        if dev.mode == "on":
            return True
        if dev.mode == "off":
            return False
        budget = dev.budget
        return budget <= 0 or dev.held_used() + pair.used > budget

    def blocked(self, dev: Device, pair: Pair) -> bool:
        """Whether `pair` may not be granted now beside the device's holders of other units
        and a turn of another gang that reserves the device (a reservation counts as a holder
        with nothing resident: in mode on it blocks, in auto it blocks only what does not fit)."""
        if dev.mode == "off":
            return False
        unit = pair.client.gang
        others = [holder for holder in dev.holders.values() if holder.client.gang is not unit]
        reserved = dev.reserved is not None and dev.reserved.unit is not unit
        if not others and not reserved:
            return False
        if dev.mode == "on":
            return True
        budget = dev.budget
        return budget <= 0 or sum(holder.used for holder in others) + pair.used > budget

    def _turn_contended(self, turn: gangs.Turn) -> bool:
        return any(self._contended(dev) for dev in turn.devices)

    def _holder_contended(self, pair: Pair) -> bool:
        """Whether the holder's quantum counts: someone waits for its device, or, for a
        gang's grant, for any device of the gang's turn."""
        turn = pair.held.turn
        return self._contended(pair.device) if turn is None else self._turn_contended(turn)

    def claim(self, pair: Pair, believed: bool, now: float, out: list[Action]) -> None:
        """A registering client says its gate is open on this device, and it is not the same
        process taking over its own registration's hold (that is the core's _take_over).

        Inside the recovery window after a restart nobody holds anything yet, so the claim is
        believed: the first claimant keeps the lock (no grant is made to others until it
        releases, dies or is revoked), and a claim that may not run beside it is dropped at once
        with the usual grace, because both processes may really be running. `believed` says
        whether the HELLO came inside the window (its later claims are handled a little later).

        Outside the window the daemon knows every hold, and this is none of them: the claim is
        refused by a grant that is dropped and revoked at once (DROP conflict with grace 0, then
        REVOKE), which closes the claimant's gate without making anyone wait. A client that
        reconnects again and again with `held=` thus never blocks a grant (issue 12)."""
        dev = pair.device
        conflict = bool(dev.holders) and self._serialised_against(dev, pair)
        hold = self._new_hold(pair, now)
        if believed and not conflict:
            out.append(Send(pair.client.key, grant_message(dev, hold.grant)))
            out.append(LockEvent(now, "grant", dev.id, pair.client.cid, hold.grant, "claimed"))
            out.append(Log("info", "claim-kept", {"client": pair.client.cid, "device": dev.id, "grant": hold.grant}))
            return
        out.append(LockEvent(now, "grant", dev.id, pair.client.cid, hold.grant, "claimed"))
        out.append(Log("warning", "claim-refused", {"client": pair.client.cid, "device": dev.id, "grant": hold.grant}))
        self.drop(pair, now, "conflict", out, grace=self._config.grace if believed else 0.0)

    # --- state changes --------------------------------------------------------------------

    def _new_hold(self, pair: Pair, now: float) -> Hold:
        """Every grant is made here: a fresh id, the pair's hold, the device's holders."""
        self._grant_numbers += 1
        dev = pair.device
        # A waiter keeps the class and the place it waited in; a hold made without waiting (a claim)
        # takes its class now.
        klass, aged_from = ((pair.queued_class, pair.queued_grants) if pair.waiting_since is not None
                            else (self._registry.priority(pair.client), dev.grants_made))
        hold = Hold(self._grant_numbers, now, klass, aged_from, pair.used)
        dev.grants_made += 1
        pair.hold = hold
        pair.grants += 1
        dev.holders[hold.grant] = pair
        return hold

    def grant(self, pair: Pair, now: float, out: list[Action]) -> None:
        dev = pair.device
        hold = self._new_hold(pair, now)
        if pair.waiting_since is not None:
            self.leave_queue(pair, now)
        cid = pair.client.cid
        prefetch, swapped, over = self._swapping.granted(pair)
        detail = " ".join(part for part in (f"prefetch={prefetch}" if prefetch else "",
                                            f"swapped={swapped}" if swapped else "",
                                            f"over_budget={over}" if over else "") if part)
        out.append(Send(pair.client.key, grant_message(dev, hold.grant, prefetch)))
        out.append(LockEvent(now, "grant", dev.id, cid, hold.grant, detail))
        out.append(Log("debug", "granted", {"client": cid, "device": dev.id, "grant": hold.grant, "prefetch": prefetch,
                                            "over_budget": over}))

    def drop(self, pair: Pair, now: float, reason: str, out: list[Action], grace: float | None = None) -> None:
        dev = pair.device
        hold = pair.held
        grace = self._config.grace if grace is None else grace
        hold.state = "draining"
        hold.deadline = now + grace
        hold.reason = reason
        cid = pair.client.cid
        evict = self._swapping.evict_on_drop(pair)
        if hold.turn is not None:  # a gang's members stop after the same collective (turns.py, fenced)
            hold.turn.fence[hold.grant] = None
        out.append(Send(pair.client.key, protocol.Drop(device=dev.id, grant=hold.grant,
                                                       grace_ms=ms(grace), reason=reason, evict=evict,
                                                       fence=hold.turn is not None)))
        out.append(LockEvent(now, "drop", dev.id, cid, hold.grant, reason))
        out.append(Log("info", "dropped", {"client": cid, "device": dev.id, "grant": hold.grant, "reason": reason,
                                           "evict": evict}))
        if hold.turn is not None and not hold.turn.ending:
            self.turns.end_turn(hold.turn, "quantum" if reason == "quantum" else "gang", now, out)

    def enqueue(self, pair: Pair, now: float, out: list[Action], seq: int | None = None,
                klass: int | None = None) -> bool:
        """ACQUIRE: idempotent while waiting or holding; a draining holder is queued behind
        the others for a fresh grant after its release. Returns whether it queued. `seq` and
        `klass`: it queues as part of its gang's request for a turn, whose every pair has the
        same place in ACQUIRE order and the same class (gangs.py)."""
        if pair.waiting_since is not None or (pair.hold is not None and pair.hold.state == "holding"):
            return False
        dev = pair.device
        ahead = (other.client for other in itertools.chain(dev.holders.values(), dev.queue) if other is not pair)
        pair.blocked_by = tuple(itertools.islice(ahead, AHEAD_REMEMBERED))
        pair.away = now - pair.last_held if pair.hold is None and pair.last_held > -math.inf else 0.0
        pair.waiting_since = now
        dev.queue[pair] = None
        if seq is None:
            seq = self.new_queue_place()
        pair.queued_seq = seq
        pair.queued_grants = dev.grants_made
        pair.queued_class = self._registry.priority(pair.client) if klass is None else klass
        pair.gang_queued = klass is not None
        dev.gang_waiters += pair.gang_queued
        dev.classes[pair.queued_class][pair] = None
        out.append(LockEvent(now, "acquire", dev.id, pair.client.cid))
        return True

    def new_queue_place(self) -> int:
        """A place in ACQUIRE order behind every waiter of every device."""
        self._queue_numbers += 1
        return self._queue_numbers

    def leave_queue(self, pair: Pair, now: float) -> None:
        pair.swap.allowed = 0
        pair.swap.restore_by = None
        pair.device.gang_waiters -= pair.gang_queued
        pair.gang_queued = False
        del pair.device.queue[pair]
        del pair.device.classes[pair.queued_class][pair]
        assert pair.waiting_since is not None  # a waiter
        waited = now - pair.waiting_since
        pair.wait_total += waited
        pair.last_wait = (waited, pair.blocked_by)
        pair.blocked_by = ()
        pair.waiting_since = None

    def end_hold(self, pair: Pair, now: float) -> None:
        del pair.device.holders[pair.held.grant]
        self._hold_over(pair, now)

    @staticmethod
    def _hold_over(pair: Pair, now: float) -> None:
        """The pair's grant ends (released or revoked): its time and when it ran are kept."""
        hold = pair.held
        pair.hold_total += now - hold.since
        fairshare.remember_hold(pair.recent, hold.since, now, now)
        pair.hold = None
        pair.held_before, pair.last_held = pair.last_held, now

    def forget_overdue(self, pair: Pair) -> None:
        for grant in pair.overdue:
            del pair.device.overdue[grant]
        pair.overdue.clear()

    def forget_if_unused(self, dev: Device) -> None:
        """A device nobody uses and nobody configured is forgotten: clients cannot grow the
        table by naming devices and leaving (issue 12). It comes back when named again."""
        registry = self._registry
        if (registry.devices.get(dev.id) is dev  # not forgotten already (a gang's turn ended)
                and not dev.pairs and not dev.holders and not dev.overdue and not dev.queue and dev.reserved is None
                and dev.budget_override is None
                and not dev.total and dev.mode == registry.default_mode and dev.tq == registry.default_tq):
            del registry.devices[dev.id]
            self._deadlines.pop(dev, None)
