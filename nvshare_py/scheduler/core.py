"""The scheduler's lock logic as a pure state machine (sans-I/O).

The daemon feeds `SchedulerCore.handle` the events of nvshare_py.scheduler.events (each carries
`now`, seconds on a monotonic clock) and carries out the actions it returns; it sends
`Tick(now)` once `next_deadline()` is reached. Nothing here reads a clock, touches a socket or
logs, so every rule of docs/protocol.md ("Scheduling rules", "Lock state") can be tested with
plain function calls.

Words used below:
- a *pair* is one (client, device) relation: the client's memory use on the device, its place
  in the device's queue, its current grant and its statistics;
- an *active holder* holds a grant in state `holding` or `draining` (after a DROP); active
  holders are what the mode rules count;
- a grant revoked after its grace ran out but not yet released is *overdue*: it is listed in
  the status so the operator sees it, but it no longer counts for granting. (For mode `on`,
  "draining and overdue holders count" means holders past their quantum, which are still
  active; a revoked grant never blocks the lock, or one hung client would stop a device.)

Time comparisons use `>=` throughout: a deadline is due at the very tick `next_deadline()`
announced, so after `handle(Tick(now))` the next deadline always lies after `now`.

The module is long because it is one state machine: every rule reads and changes the same lock
state (holds, queues, turns), and split across files the rules would no longer be read
together. What stands on its own lives beside it: admission.py, residency.py, fairshare.py,
gangs.py.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator, TypeVar

from .. import protocol
from ..vocabulary import GPU_UUID, MODE
from . import eviction, gangs, residency
from .admission import AdmissionConfig, Waiter
from .admitting import Admissions
from .core_config import CoreConfig, check_seconds, ms
from . import fairshare
from .queue_order import next_waiter, rank
from .records import Client, Device, Hold, Pair
from .registry import Registry
from .swapping import Swapping, end_eviction_wait
from .turns import GangTurns, live_pairs
from .events import (
    AcquireRequest,
    Action,
    AdmitRequest,
    ClaimsLeft,
    ClientKey,
    ClientMessage,
    ControlError,
    DeviceInfo,
    DeviceMeasured,
    Event,
    Forget,
    FromClient,
    Alive,
    HandleClaims,
    LockEvent,
    Log,
    MemoryReport,
    Mode,
    Register,
    ReleaseReport,
    Send,
    SetAdmission,
    SetBudget,
    SetLimit,
    SetMode,
    SetPriority,
    SetQuantum,
    SetWeight,
    Tick,
    Unregister,
    register_detail,
)

__all__ = ["CoreConfig", "ControlError", "SchedulerCore"]

# How many of those ahead of a waiter, when its wait began, a pair remembers (for QUERY's
# `last_wait`, nvshare_py/scheduler/views.py): a bound, so that a long queue costs no more.
AHEAD_REMEMBERED = 4
# Claims of one HELLO handled per step: a process rarely holds more devices than this, and one
# HELLO claiming many (invented) devices is handled in pieces (HandleClaims) between other
# users' messages instead of in one step of a few milliseconds (benchmarks/bench_floods.py).
CLAIMS_PER_STEP = 8


# The client message behind each event that may name a new device (for ERROR's `type`).
_MESSAGE_TYPES = {Register: "HELLO", HandleClaims: "HELLO", DeviceInfo: "DEVICE", MemoryReport: "MEMORY", AcquireRequest: "ACQUIRE",
                  AdmitRequest: "ADMIT"}


def _shown(value: int | None) -> str:
    return "unset" if value is None else str(value)


_ClientHandler = Callable[[Client, Any, list[Action]], None]
_M = TypeVar("_M", bound=protocol.Message)


def _message_row(kind: type[_M], handle: Callable[[Client, float, _M, list[Action]], None],
                 ) -> tuple[type[protocol.Message], _ClientHandler]:
    """The row of `_client_handlers` for a message that comes as a ClientMessage: `handle` gets
    the time it arrived and the message, of the class it is registered for."""
    return kind, lambda client, event, out: handle(client, event.now, event.message, out)


# --- the core ------------------------------------------------------------------------------


class SchedulerCore:
    """Events in, actions out. Not thread-safe: the daemon calls it from one task."""

    def __init__(self, config: CoreConfig, now: float) -> None:
        self.config = config
        self._registry = Registry(config.mode, config.tq)
        self.settings = self._registry.settings
        # Earliest pending drop/quantum deadline per device; refreshed after every change.
        self._deadlines: dict[Device, float] = {}
        self._grant_numbers = 0
        self._queue_numbers = 0
        self._recovery_end: float | None = now + config.recovery if config.recovery > 0 else None
        self._admissions = Admissions(config.admission)
        self._swapping = Swapping(config, self._registry, self._admissions)
        self._turns = GangTurns(self, config, self._registry, self._swapping)
        # Devices to settle (see _settle): a gang's grant or drop on one device changes others.
        self._unsettled: dict[Device, None] = {}
        self._settling = False
        # A client's events by their class, and its ClientMessages by the class of the message
        # they carry (events.from_client): a message of the client's with neither is ignored.
        self._client_handlers: dict[type[FromClient] | type[protocol.Message], _ClientHandler] = {
            DeviceInfo: self._device_info,
            MemoryReport: self._memory,
            AcquireRequest: self._acquire,
            AdmitRequest: self._admit,
            ReleaseReport: self._release,
            Alive: self._heartbeat,
            Unregister: self._unregister,
        }
        self._client_handlers.update([
            _message_row(protocol.Evicted, self._evicted),
            _message_row(protocol.Fenced, self._turns.fenced),
        ])
        self._other_handlers: dict[type[Event], Callable[[Any, list[Action]], None]] = {
            Register: self._register,
            HandleClaims: self._handle_claims,
            DeviceMeasured: self._device_measured,
            Tick: self._tick,
            SetMode: self._set_mode,
            SetQuantum: self._set_quantum,
            SetBudget: self._set_budget,
            SetAdmission: self._set_admission,
            SetWeight: self._set_weight,
            SetPriority: self._set_priority,
            SetLimit: self._set_limit,
        }

    # --- public API ----------------------------------------------------------------------

    def handle(self, event: Event) -> list[Action]:
        """Apply one event. Raises ControlError only for control requests (SetMode, SetQuantum,
        SetBudget) it refuses, before changing anything."""
        out: list[Action] = []
        if isinstance(event, FromClient):
            kind = type(event.message) if isinstance(event, ClientMessage) else type(event)
            client = self._registry.clients.get(event.client)
            if client is None:
                out.append(Log("debug", "from-unregistered", {"client": repr(event.client), "type": kind.__name__}))
                return out
            self._registry.heard(client, event.now)
            client_handler = self._client_handlers.get(kind)
            if client_handler is None:  # a message this scheduler has no use for: its liveness is all
                out.append(Log("debug", "unhandled-message", {"client": client.cid, "type": kind.__name__}))
                return out
            client_handler(client, event, out)
            return out
        try:
            handler = self._other_handlers[type(event)]
        except KeyError:
            raise TypeError(f"not a scheduler event: {event!r}") from None
        handler(event, out)
        return out

    def next_deadline(self) -> float | None:
        """When `Tick` is due next: grace and quantum ends that matter, heartbeat timeouts and
        the end of the recovery window. None when nothing is pending."""
        best = self._recovery_end
        client = self._registry.most_silent()
        if client is not None:
            timeout = client.last_seen + self.config.heartbeat_timeout
            if best is None or timeout < best:
                best = timeout
        if self._deadlines:
            earliest = min(self._deadlines.values())
            if best is None or earliest < best:
                best = earliest
        admission_due = self._admissions.book.next_deadline()
        if admission_due is not None and (best is None or admission_due < best):
            best = admission_due
        gang_due = self._turns.next_deadline()
        if gang_due is not None and (best is None or gang_due < best):
            best = gang_due
        shrink_due = self._swapping.next_deadline()
        if shrink_due is not None and (best is None or shrink_due < best):
            best = shrink_due
        return best

    @property
    def default_mode(self) -> Mode:
        """The mode of devices without a setting of their own (SetMode without a device)."""
        return self._registry.default_mode

    @property
    def default_tq(self) -> float:
        """The time quantum of devices without a setting of their own."""
        return self._registry.default_tq

    def weight(self, client: Client) -> int:
        return self._registry.weight(client)

    def priority(self, client: Client) -> int:
        return self._registry.priority(client)

    def limit(self, pair: Pair) -> int | None:
        return self._registry.limit(pair)

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
        heaviest = max((self.weight(other.client) for other in contenders), default=1)
        length = fairshare.quantum(dev.tq, self.weight(pair.client), heaviest, self.config.min_quantum)
        best = next_waiter(dev, self.config.ageing)
        if self.config.swapping and best is not None and best is not pair:
            # Over a budget the handoff swaps: the quantum is long enough that this takes at
            # most a tenth of it (residency.py), beyond the TQ if need be.
            length = max(length, residency.quantum_floor(dev, pair, best))
        # The holder ages as if it still waited: one that queued before a waiter of its own
        # class has aged at least as much, so ageing never makes equals cut each other's quanta
        # (it only lifts a lower class past a higher one).
        holder_rank = fairshare.effective_class(hold.klass, dev.grants_made - hold.aged_from, self.config.ageing)
        if best is not None and rank(best, self.config.ageing) > holder_rank:
            length = min(length, self.config.min_quantum, dev.tq)
        return length

    def client_id(self, key: ClientKey) -> str | None:
        client = self._registry.clients.get(key)
        return None if client is None else client.cid

    def devices(self) -> list[Device]:
        """The devices by id, for views.py to read (never to change)."""
        devices = self._registry.devices
        return [devices[device_id] for device_id in sorted(devices)]

    def clients(self) -> list[Client]:
        """The registrations in registration order (c1, c2, ...), for views.py to read."""
        return list(self._registry.clients.values())

    def gang_units(self) -> list[gangs.Gang]:
        """The named gangs and the processes that are gangs of one (several devices), in the
        order they formed, for views.py to read."""
        return self._turns.units()

    def live_grants(self, turn: gangs.Turn) -> list[Pair]:
        """The pairs whose current grant belongs to `turn` (views.py)."""
        return live_pairs(turn)

    def pool_sizes(self) -> dict[Hashable, int]:
        """The swap pools' sizes by principal, for views.py."""
        return self._swapping.pool_sizes()

    # --- registration --------------------------------------------------------------------

    def _register(self, ev: Register, out: list[Action]) -> None:
        if ev.client in self._registry.clients:
            out.append(Log("debug", "second-registration", {"client": self._registry.clients[ev.client].cid}))
            return
        now = ev.now
        if len(set(ev.held) | set(ev.wanted)) > protocol.MAX_DEVICES:
            out.append(Send(ev.client, protocol.Error(code="bad-field", type="HELLO",
                                                      detail=f"a client may use at most {protocol.MAX_DEVICES} devices")))
            return
        client, predecessors = self._registry.register(ev.client, ev.info, now)
        # Its memory limits come before WELCOME: a process's first allocation and its first
        # cuMemGetInfo wait for the registration, which then includes them (docs/protocol.md).
        self._sync_limits(client, out)
        config = self.config
        out.append(Send(client.key, protocol.Welcome(
            client=client.cid,
            heartbeat_ms=ms(config.heartbeat_interval),
            idle_release_ms=ms(config.idle_release),
            admission=True,
        )))
        out.append(LockEvent(now, "register", client=client.cid, detail=register_detail(ev.info)))
        out.append(Log("info", "registered", {"client": client.cid, "pid": ev.info.pid, "host_pid": ev.info.host_pid,
                                           "program": ev.info.program}))
        self._turns.join(client, ev, out)

        held = dict.fromkeys(ev.held)
        wanted = dict.fromkeys(ev.wanted)
        touched: dict[Device, None] = {}
        for old in predecessors:
            self._take_over(old, client, held, wanted, now, out, touched)
        client.claims_left = list(held)
        client.claims_believed = self._recovering(now)
        self._claim_some(client, ev, out, touched)
        for device_id in wanted:
            pair = self._pair(client, device_id, ev, out)
            if pair is None:
                continue
            touched[pair.device] = None
            if client.gang.ganged:
                self._turns.acquire(pair, now, out)
            else:
                self.enqueue(pair, now, out)
        gang = client.gang
        self._turns.check_formed(gang, now, out)
        if gang.ganged and self._turns.request_of(gang) is not None:
            # The gang asked for a turn before the reconnection: it still asks for all its
            # devices, also those the process did not ask for itself (it does not list them).
            self._turns.request_turn(gang, now, out)
        for pair in gang.pairs():  # a place its predecessor gave up may let its gang run
            if pair.gang_queued:
                touched[pair.device] = None
        for dev in touched:
            self.settle(dev, now, out)

    def _take_over(self, old: Client, new: Client, held: dict[str, None], wanted: dict[str, None], now: float,
                   out: list[Action], touched: dict[Device, None]) -> None:
        """`new` is `old` reconnected: it inherits the holds it still claims (same grant) and the
        queue places it still wants; everything else of `old` is given up."""
        self._turns.take_over(old, new)
        for device_id, pair in old.pairs.items():
            dev = pair.device
            touched[dev] = None
            if device_id in new.pairs:  # two stale registrations of one process: keep the first
                self._discard_pair(pair, now)
                continue
            self._forget_overdue(pair)
            if pair.hold is not None and device_id not in held:
                out.append(LockEvent(now, "release", dev.id, old.cid, pair.hold.grant, "replaced"))
                self._end_hold(pair, now)
            if pair.waiting_since is not None and device_id not in wanted:
                self.leave_queue(pair, now)
            pair.client = new
            new.pairs[device_id] = pair
            self._admissions.book.reset(pair)  # the new connection's client asks afresh
            if pair.hold is not None:
                hold = pair.hold
                out.append(Send(new.key, self._grant_message(dev, hold.grant)))
                if hold.state == "draining":  # the DROP may have been lost with the old connection
                    out.append(Send(new.key, protocol.Drop(device=dev.id, grant=hold.grant, reason=hold.reason,
                                                           grace_ms=max(0, ms(hold.deadline - now)),
                                                           evict=self._swapping.evict_on_drop(pair))))
                hold.contended = False  # a CONTENDED may have been lost too: _settle tells it again
                out.append(Log("info", "grant-passes", {"client": new.cid, "device": dev.id, "grant": hold.grant,
                                                   "predecessor": old.cid}))
        old.pairs = {}
        self._unlink_client(old, park=False)  # its settings passed to `new` (_register)
        out.append(Forget(old.key, "replaced"))
        out.append(LockEvent(now, "unregister", client=old.cid, detail="replaced"))
        out.append(Log("info", "replaced", {"client": old.cid, "successor": new.cid}))

    def _claim_some(self, client: Client, ev: Register | HandleClaims, out: list[Action],
                    touched: dict[Device, None]) -> None:
        """Handle the next CLAIMS_PER_STEP claims of the client's HELLO; ClaimsLeft when more
        are left. A HELLO's claims are independent of each other and of the client's other
        messages (which name grants the claims have not made yet), so handling the rest in later
        steps, between other clients' events, decides nothing differently."""
        piece, client.claims_left = client.claims_left[:CLAIMS_PER_STEP], client.claims_left[CLAIMS_PER_STEP:]
        for device_id in piece:
            pair = self._pair(client, device_id, ev, out)
            if pair is None:
                continue
            touched[pair.device] = None
            if pair.hold is None:
                self._claim(pair, client.claims_believed, ev.now, out)
        if client.claims_left:
            out.append(ClaimsLeft(client.key))

    def _handle_claims(self, ev: HandleClaims, out: list[Action]) -> None:
        client = self._registry.clients.get(ev.client)
        if client is None:  # gone meanwhile: its claims went with it
            return
        touched: dict[Device, None] = {}
        self._claim_some(client, ev, out, touched)
        for dev in touched:
            self.settle(dev, ev.now, out)

    def _claim(self, pair: Pair, believed: bool, now: float, out: list[Action]) -> None:
        """A registering client says its gate is open on this device, and it is not the same
        process taking over its own registration's hold (that is _take_over).

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
            out.append(Send(pair.client.key, self._grant_message(dev, hold.grant)))
            out.append(LockEvent(now, "grant", dev.id, pair.client.cid, hold.grant, "claimed"))
            out.append(Log("info", "claim-kept", {"client": pair.client.cid, "device": dev.id, "grant": hold.grant}))
            return
        out.append(LockEvent(now, "grant", dev.id, pair.client.cid, hold.grant, "claimed"))
        out.append(Log("warning", "claim-refused", {"client": pair.client.cid, "device": dev.id, "grant": hold.grant}))
        self.drop(pair, now, "conflict", out, grace=self.config.grace if believed else 0.0)

    # --- client events -------------------------------------------------------------------

    def _device_info(self, client: Client, ev: DeviceInfo, out: list[Action]) -> None:
        """A client uses the device. Its `total` is not used: a device is sized only by the
        daemon's own measurement and the operator's budget, which no client can change."""
        pair = self._pair(client, ev.device, ev, out)
        if pair is not None and ev.name and not pair.device.name:
            pair.device.name = ev.name
        if pair is not None and client.gang.ganged:
            self._turns.announced(pair, ev.now, out)

    def _device_measured(self, ev: DeviceMeasured, out: list[Action]) -> None:
        dev = self._registry.device(ev.device)
        if ev.name:
            dev.name = ev.name
        if ev.total == dev.total:
            return
        before = dev.budget
        dev.total = ev.total
        out.append(Log("info", "device-measured", {"device": dev.id, "total": ev.total}))
        self._budget_changed(dev, before, ev.now, out)

    def _memory(self, client: Client, ev: MemoryReport, out: list[Action]) -> None:
        pair = self._pair(client, ev.device, ev, out)
        if pair is None:
            return
        dev = pair.device
        # A report is the client's measurement of itself, and no client has more of a device
        # than the device has: a larger figure counts as the device's size.
        used = min(ev.used, dev.total) if dev.total else ev.used
        freed = max(0, pair.used - used)
        dev.used += used - pair.used
        pair.used = used
        self._admissions.report(pair, used)
        in_flight = pair.swap.allowed
        if ev.resident is not None:
            residency.report(pair, min(ev.resident, used), freed)
            if pair.hold is not None and in_flight and not pair.swap.allowed:
                # A grant's memory is all back: its gate has opened (the handoff's stall ends).
                out.append(LockEvent(ev.now, "restored", dev.id, client.cid, pair.hold.grant,
                                     f"resident={ev.resident}"))
        residency.report_engine(pair, ev.engine, ev.area, ev.out_bps, ev.in_bps, ev.pool)
        # Swapping: a report may be a move's progress (the next waiter may bring its memory in
        # behind it), or change what a handoff costs (the quanta and contention notices).
        # Or it may be pressure: the holder grew past the budget beside idle tenants, which
        # are moved out now rather than paged out by the driver (eviction.py).
        if dev.mode == "auto" or dev.evict_awaited or (self.config.swapping and (
                dev.queue or ev.resident is not None or eviction.under_pressure(dev))):
            self.settle(dev, ev.now, out)
        self._swapping.size_swap_space(ev.now, out)
        self._admissions.settle(ev.now, out)

    def _acquire(self, client: Client, ev: AcquireRequest, out: list[Action]) -> None:
        pair = self._pair(client, ev.device, ev, out)
        if pair is None:
            return
        if client.gang.ganged:
            self._turns.acquire(pair, ev.now, out)
        elif self.enqueue(pair, ev.now, out):
            self.settle(pair.device, ev.now, out)

    def _release(self, client: Client, ev: ReleaseReport, out: list[Action]) -> None:
        pair = client.pairs.get(ev.device)
        fields = {"client": client.cid, "device": ev.device, "grant": ev.grant}
        if pair is not None and ev.resident is not None:
            residency.report(pair, ev.resident)
        if pair is not None and pair.hold is not None and pair.hold.grant == ev.grant:
            dev = pair.device
            out.append(LockEvent(ev.now, "release", dev.id, client.cid, ev.grant, ev.reason))
            out.append(Log("debug", "released", dict(fields, reason=ev.reason)))
            turn = pair.hold.turn
            if turn is not None and ev.reason == "idle":
                turn.idle.add(ev.grant)  # it pauses within its gang's turn (turns.py, check_turn)
            reason = pair.hold.reason
            self._end_hold(pair, ev.now)
            if turn is not None and ev.reason == "idle" and turn.fence.pop(ev.grant, 0) is None:
                # Its idle release crossed the fenced DROP: it paused where it was, which may be
                # behind the others' collectives. It is fenced like a member paused before.
                self._turns.fence_paused(turn, pair, ev.now, out, reason)
            self.settle(dev, ev.now, out)
        elif pair is not None and ev.grant in pair.overdue:
            del pair.overdue[ev.grant]
            del pair.device.overdue[ev.grant]
            out.append(Log("debug", "released-revoked", fields))
        else:
            out.append(Log("debug", "released-stale", fields))

    def _evicted(self, client: Client, now: float, evicted: protocol.Evicted, out: list[Action]) -> None:
        """EVICTED: the client's answer to EVICT, with its converted bytes still on the device."""
        pair = client.pairs.get(evicted.device)
        if pair is None:
            out.append(Log("debug", "evicted-stale", {"client": client.cid, "device": evicted.device}))
            return
        dev = pair.device
        residency.report(pair, evicted.resident)
        pair.swap.leaving = 0  # the answer: whatever it did not move stays
        out.append(LockEvent(now, "evicted", dev.id, client.cid, detail=f"resident={evicted.resident}"))
        if pair in dev.evict_awaited:
            del dev.evict_awaited[pair]
        self.settle(dev, now, out)

    def _heartbeat(self, client: Client, ev: Alive, out: list[Action]) -> None:
        pass  # liveness was refreshed in handle()

    def _unregister(self, client: Client, ev: Unregister, out: list[Action]) -> None:
        self._remove_client(client, ev.reason, ev.now, out)

    def _remove_client(self, client: Client, reason: str, now: float, out: list[Action]) -> None:
        self._settle_after_removal(self._unlink_removed(client, reason, now, out), now, out)

    def _unlink_removed(self, client: Client, reason: str, now: float, out: list[Action]) -> list[Device]:
        """Removes the client and everything it had; returns its devices, which the caller
        settles again (even without a hold or a place in the queue, its leaving may change a
        device's agreed size: auto mode's budget)."""
        per_device_kind = "unregister" if reason == "bye" else "lost"
        devices = [pair.device for pair in client.pairs.values()]
        gang = client.gang
        for pair in client.pairs.values():
            dev = pair.device
            if pair.hold is not None or pair.waiting_since is not None or pair.overdue:
                grant = pair.hold.grant if pair.hold is not None else 0
                out.append(LockEvent(now, per_device_kind, dev.id, client.cid, grant, reason))
            self._discard_pair(pair, now)
        client.pairs = {}
        # A process that exited is gone for good; any other may register again, and keeps its
        # settings then (Settings.park).
        self._unlink_client(client, park=reason != "exited")
        # Its gang may have waited for its devices too: the rest may be granted now.
        devices += [pair.device for pair in gang.pairs() if pair.gang_queued]
        out.append(Forget(client.key, reason))
        out.append(LockEvent(now, "unregister", client=client.cid, detail=reason))
        if reason == "heartbeat-timeout":
            out.append(Log("warning", "silent-removed", {"client": client.cid, "pid": client.info.pid,
                                               "timeout": self.config.heartbeat_timeout}))
        else:
            out.append(Log("info", "unregistered", {"client": client.cid, "reason": reason}))
        return devices

    def _settle_after_removal(self, devices: list[Device], now: float, out: list[Action]) -> None:
        for dev in dict.fromkeys(devices):
            self.settle(dev, now, out)
            self.forget_if_unused(dev)
        self._swapping.size_swap_space(now, out)
        self._admissions.settle(now, out)

    # --- time ----------------------------------------------------------------------------

    def _tick(self, ev: Tick, out: list[Action]) -> None:
        now = ev.now
        recovered = self._recovery_end is not None and now >= self._recovery_end
        if recovered:
            self._recovery_end = None
            out.append(Log("info", "recovered"))
        timeout = self.config.heartbeat_timeout
        # Every client that fell silent goes before any device is settled: a lock freed by one
        # must not pass to another that is being removed in the same tick (it would be granted,
        # or make the holder contended, for a client that is already gone).
        silent_devices: list[Device] = []
        while (client := self._registry.most_silent()) is not None and client.last_seen + timeout <= now:
            silent_devices += self._unlink_removed(client, "heartbeat-timeout", now, out)
        if silent_devices:
            self._settle_after_removal(silent_devices, now, out)
        self._turns.tick(now, out)
        if recovered:
            due = list(self._registry.devices.values())
        else:
            due = [dev for dev, deadline in self._deadlines.items() if deadline <= now]
        for dev in due:
            self.settle(dev, now, out)
        self._swapping.size_swap_space(now, out)
        self._admissions.settle(now, out)

    # --- control requests ----------------------------------------------------------------

    def _targets(self, device_id: str | None) -> list[Device]:
        """The devices a setting is for: all known ones (None), or the one named. An operator
        may configure a GPU before any client has announced it (a budget set at boot applies to
        the first program), so an unknown device is made when named by its UUID; anything else
        unknown is refused, so that a typo does not configure a device that never comes."""
        if device_id is None:
            return list(self._registry.devices.values())
        dev = self._registry.devices.get(device_id)
        if dev is None:
            # A GPU as the interceptor names it: the only name under which a device nobody has
            # announced yet may be configured.
            if not GPU_UUID.match(device_id):
                raise ControlError("unknown-device", f"no client has announced device {device_id}, and it is not "
                                                     f"a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
            dev = self._registry.device(device_id)
        return [dev]

    def _set_mode(self, ev: SetMode, out: list[Action]) -> None:
        if ev.mode not in MODE:
            raise ControlError("bad-request", f"mode must be {MODE.describe()}, not {ev.mode!r}")
        targets = self._targets(ev.device)
        if ev.device is None:
            self._registry.default_mode = ev.mode
        out.append(Log("info", "mode-set", {"device": ev.device or "", "mode": ev.mode}))
        for dev in targets:
            if dev.mode == ev.mode:
                continue
            dev.mode = ev.mode
            out.append(LockEvent(ev.now, "mode", dev.id, detail=ev.mode))
            self._notify_settings(dev, out)
            self.settle(dev, ev.now, out)
        if ev.device is not None:
            self.forget_if_unused(targets[0])  # set back to the defaults on a device nobody uses

    def _set_quantum(self, ev: SetQuantum, out: list[Action]) -> None:
        try:
            check_seconds("tq", ev.seconds, allow_zero=False)
        except ValueError as exc:
            raise ControlError("bad-request", str(exc)) from None
        targets = self._targets(ev.device)
        if ev.device is None:
            self._registry.default_tq = ev.seconds
        out.append(Log("info", "tq-set", {"device": ev.device or "", "seconds": ev.seconds}))
        for dev in targets:
            if dev.tq == ev.seconds:
                continue
            dev.tq = ev.seconds
            out.append(LockEvent(ev.now, "tq", dev.id, detail=f"{ev.seconds:g}"))
            self._notify_settings(dev, out)
            for pair in dev.holders.values():
                pair.held.contended = False  # the quantum left changed: tell it again
            self.settle(dev, ev.now, out)
        if ev.device is not None:
            self.forget_if_unused(targets[0])

    def _set_budget(self, ev: SetBudget, out: list[Action]) -> None:
        budget = ev.budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ControlError("bad-request", f"budget must be a positive number of bytes or null, not {budget!r}")
        (dev,) = self._targets(ev.device)
        before = dev.budget
        dev.budget_override = budget
        detail = "total" if budget is None else str(budget)
        out.append(LockEvent(ev.now, "budget", dev.id, detail=detail))
        out.append(Log("info", "budget-set", {"device": dev.id, "budget": detail}))
        self._budget_changed(dev, before, ev.now, out)
        self.forget_if_unused(dev)

    # --- per-client settings (fairshare.py) -----------------------------------------------

    def _target(self, client: str | None, pod_uid: str | None) -> fairshare.Target:
        """Whom a setting is for; a client must be registered now (its id dies with it)."""
        try:
            target = fairshare.Target(client, pod_uid)
        except ValueError as exc:
            raise ControlError("bad-request", str(exc)) from None
        if client is not None and not any(c.cid == client for c in self._registry.clients.values()):
            raise ControlError("unknown-client", f"no client {client} is registered")
        if pod_uid is not None and (not isinstance(pod_uid, str) or not pod_uid):
            raise ControlError("bad-request", "pod_uid must be a pod's UID")
        return target

    def _set_weight(self, ev: SetWeight, out: list[Action]) -> None:
        try:
            weight = fairshare.check_weight(ev.weight)
        except ValueError as exc:
            raise ControlError("bad-request", str(exc)) from None
        target = self._target(ev.client, ev.pod_uid)
        self.settings.weight.set(target, weight, fairshare.DEFAULT_WEIGHT)
        out.append(Log("info", "weight-set", {"target": target.describe(), "weight": _shown(weight)}))
        for dev in list(self._registry.devices.values()):
            self.settle(dev, ev.now, out)  # quanta follow the weights at once

    def _set_priority(self, ev: SetPriority, out: list[Action]) -> None:
        try:
            priority = fairshare.check_priority(ev.priority)
        except ValueError as exc:
            raise ControlError("bad-request", str(exc)) from None
        target = self._target(ev.client, ev.pod_uid)
        self.settings.priority.set(target, priority, fairshare.DEFAULT_PRIORITY)
        out.append(Log("info", "priority-set", {"target": target.describe(), "priority": _shown(priority)}))
        for dev in list(self._registry.devices.values()):
            moved = set()
            for pair in dev.queue:
                klass = self._turns.queue_class(pair.client.gang) if pair.gang_queued else self.priority(pair.client)
                if klass != pair.queued_class:
                    del dev.classes[pair.queued_class][pair]
                    moved.add(klass)
                    pair.queued_class = klass
                    dev.classes[klass][pair] = None
            for klass in moved:  # back into ACQUIRE order
                dev.classes[klass] = OrderedDict.fromkeys(sorted(dev.classes[klass], key=lambda p: p.queued_seq))
            self.settle(dev, ev.now, out)

    def _set_limit(self, ev: SetLimit, out: list[Action]) -> None:
        try:
            limit = fairshare.check_limit(ev.limit, protocol.MAX_INT)
        except ValueError as exc:
            raise ControlError("bad-request", str(exc)) from None
        target = self._target(ev.client, ev.pod_uid)
        self.settings.set_limit(target, ev.device, limit)
        out.append(Log("info", "limit-set", {"target": target.describe(), "device": ev.device or "",
                                             "bytes": _shown(limit)}))
        for client in self._registry.clients.values():
            self._sync_limits(client, out)

    def _sync_limits(self, client: Client, out: list[Action]) -> None:
        """LIMIT to the client for every resolved limit it was not told: the one for every
        device (no `device`), then each device whose own differs from what the client applies
        to it. So a client knows its limits on devices it has not named yet (docs/protocol.md)."""
        cid, pod_uid = client.cid, client.info.pod_uid
        every = self.settings.limit_every(cid, pod_uid) or 0
        if every != client.told_every:
            client.told_every = every
            out.append(Send(client.key, protocol.Limit(bytes=every)))
            out.append(Log("info", "limit-sent", {"client": cid, "device": "", "bytes": every}))
        for device in sorted(set(self.settings.limit_devices()) | set(client.told)):
            limit = self.settings.limit(cid, pod_uid, device) or 0
            if limit != client.told.get(device, client.told_every):
                client.told[device] = limit
                out.append(Send(client.key, protocol.Limit(bytes=limit, device=device)))
                out.append(Log("info", "limit-sent", {"client": cid, "device": device, "bytes": limit}))

    def _notify_settings(self, dev: Device, out: list[Action]) -> None:
        notice = protocol.ModeNotice(device=dev.id, mode=dev.mode, quantum_ms=ms(dev.tq))
        out.extend(Send(pair.client.key, notice) for pair in dev.pairs)

    # --- the lock rules ------------------------------------------------------------------

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
                self._turns.check_turn(dev.reserved, now, out)
            dropped = self._enforce_exclusion(dev, now, out)
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

    def _recovering(self, now: float) -> bool:
        return self._recovery_end is not None and now < self._recovery_end

    def _grant_waiters(self, dev: Device, now: float, out: list[Action]) -> None:
        if self._recovering(now):
            return  # only claims of reconnecting holders are granted until recovery ends
        while dev.queue:
            pair = dev.evict_for or next_waiter(dev, self.config.ageing)  # room is being made for the former
            assert pair is not None  # the queue is not empty
            if pair.hold is not None:
                break  # a draining holder that asked again waits for its own release
            if pair.gang_queued:
                if not self._turns.start_turn(pair.client.gang, now, out):
                    break  # the gang reserves the device until it has all of its devices
                continue
            if self.blocked(dev, pair):
                break  # FCFS within the class: nobody overtakes the next one
            if not self._swapping.room_made(dev, pair, now, out):
                break  # the next one waits for EVICTED answers; FCFS again
            self.grant(pair, now, out)

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

    # --- gangs (gangs.py says what they are) ----------------------------------------------

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

    # --- admission (nvshare_py/scheduler/admission.py decides) ----------------------------

    @property
    def admission(self) -> AdmissionConfig:
        return self._admissions.book.config

    def admission_capacity(self) -> int:
        """What the clients may hold on this node: the devices' budgets (the daemon's
        measurements and the operator's settings, never a client's word) plus the host spill."""
        return self._admissions.book.capacity

    def admission_reserved(self) -> int:
        return self._admissions.book.reserved

    def admission_of(self, pair: Pair) -> tuple[int, Waiter[Pair] | None]:
        """A pair's admitted total and its unanswered question, for views.py."""
        book = self._admissions.book
        return book.admitted(pair), book.waiters.get(pair)

    def admission_reservation(self, pair: Pair) -> int:
        return self._admissions.book.reservation(pair)

    def admission_waiters(self) -> list[Waiter[Pair]]:
        return list(self._admissions.book.waiters.values())

    def _budget_changed(self, dev: Device, before: int, now: float, out: list[Action]) -> None:
        """A device's budget changed from `before`: the capacity follows, and what depends on
        the budget is settled again (auto mode, room for a grant, swap areas, admission)."""
        self._admissions.budget_changed(dev, before)
        self.settle(dev, now, out)
        self._swapping.size_swap_space(now, out)
        self._admissions.settle(now, out)

    def _admit(self, client: Client, ev: AdmitRequest, out: list[Action]) -> None:
        pair = self._pair(client, ev.device, ev, out)
        if pair is None:
            return
        self._admissions.ask(pair, ev, self.limit(pair), out)

    def _set_admission(self, ev: SetAdmission, out: list[Action]) -> None:
        old = self._admissions.book.config
        spill = old.spill if ev.keep_spill else ev.spill
        if spill == "auto":
            if self.config.auto_spill is None:
                raise ControlError("bad-request", "this scheduler did not measure the host: give the spill in bytes")
            spill = self.config.auto_spill
        policy = old.policy if ev.policy is None else ev.policy
        timeout = old.timeout if ev.timeout is None else ev.timeout
        share = old.share if ev.share is None else ev.share
        try:
            new = AdmissionConfig(spill=spill, policy=policy, timeout=timeout, share=share, seed=old.seed)
        except ValueError as exc:
            raise ControlError("bad-request", str(exc)) from None
        self._admissions.reconfigure(new)
        shown = "off" if spill is None else spill
        out.append(LockEvent(ev.now, "admission", detail=f"spill={shown} policy={policy} timeout={timeout:g} "
                                                         f"share={share:g}"))
        out.append(Log("info", "admission-set", {"spill": shown, "policy": policy, "timeout": timeout,
                                                "share": share}))
        self._admissions.settle(ev.now, out)

    # --- state changes -------------------------------------------------------------------

    def _new_hold(self, pair: Pair, now: float) -> Hold:
        """Every grant is made here: a fresh id, the pair's hold, the device's holders."""
        self._grant_numbers += 1
        dev = pair.device
        if pair.waiting_since is not None:
            hold = Hold(self._grant_numbers, now, pair.queued_class, pair.queued_grants)
        else:
            hold = Hold(self._grant_numbers, now, self.priority(pair.client), dev.grants_made)
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
        out.append(Send(pair.client.key, self._grant_message(dev, hold.grant, prefetch)))
        out.append(LockEvent(now, "grant", dev.id, cid, hold.grant, detail))
        out.append(Log("debug", "granted", {"client": cid, "device": dev.id, "grant": hold.grant, "prefetch": prefetch,
                                            "over_budget": over}))

    def _grant_message(self, dev: Device, grant: int, prefetch: int = 0) -> protocol.Grant:
        return protocol.Grant(device=dev.id, grant=grant, mode=dev.mode, exclusive=dev.mode == "on",
                              quantum_ms=ms(dev.tq), prefetch=prefetch)

    def drop(self, pair: Pair, now: float, reason: str, out: list[Action], grace: float | None = None) -> None:
        dev = pair.device
        hold = pair.held
        grace = self.config.grace if grace is None else grace
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
            self._turns.end_turn(hold.turn, "quantum" if reason == "quantum" else "gang", now, out)

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
        pair.waiting_since = now
        dev.queue[pair] = None
        if seq is None:
            seq = self.new_queue_place()
        pair.queued_seq = seq
        pair.queued_grants = dev.grants_made
        pair.queued_class = self.priority(pair.client) if klass is None else klass
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

    def _end_hold(self, pair: Pair, now: float) -> None:
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

    def _forget_overdue(self, pair: Pair) -> None:
        for grant in pair.overdue:
            del pair.device.overdue[grant]
        pair.overdue.clear()

    def _discard_pair(self, pair: Pair, now: float) -> None:
        """The client is gone from this device: nothing of it may block anyone."""
        dev = pair.device
        if pair.hold is not None:
            self._end_hold(pair, now)
        if pair.waiting_since is not None:
            self.leave_queue(pair, now)
        self._forget_overdue(pair)
        dev.evict_asked.pop(pair, None)
        dev.evict_awaited.pop(pair, None)
        if dev.evict_for is pair:
            end_eviction_wait(dev)
        self._admissions.book.forget(pair)
        dev.used -= pair.used
        del dev.pairs[pair]

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

    def _unlink_client(self, client: Client, *, park: bool) -> None:
        self._registry.unlink(client, park=park)
        self._turns.leave(client)

    def _pair(self, client: Client, device_id: str, ev: Event, out: list[Action]) -> Pair | None:
        """The client's pair of the device, made on first use; None (and ERROR to the client)
        when the client already uses protocol.MAX_DEVICES devices."""
        pair = client.pairs.get(device_id)
        if pair is None:
            if len(client.pairs) >= protocol.MAX_DEVICES:
                out.append(Send(client.key, protocol.Error(
                    code="bad-field", type=_MESSAGE_TYPES[type(ev)],
                    detail=f"a client may use at most {protocol.MAX_DEVICES} devices")))
                return None
            dev = self._registry.device(device_id)
            pair = client.pairs[device_id] = Pair(client, dev)
            dev.pairs[pair] = None
        return pair
