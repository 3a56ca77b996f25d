"""The scheduler's lock core as a pure state machine (sans-I/O): `SchedulerCore`, its one entry
point.

The daemon feeds `SchedulerCore.handle` the events of nvshare_py.scheduler.events (each carries
`now`, seconds on a monotonic clock) and carries out the actions it returns; it sends
`Tick(now)` once `next_deadline()` is reached (a deadline is due at the very tick it announced:
after `handle(Tick(now))` the next one lies after `now`). Nothing here or in the modules it uses
reads a clock, touches a socket or logs, so every rule of docs/protocol.md ("Scheduling rules",
"Lock state") can be tested with plain function calls.

This module is the core's glue: which event goes where, what a registration, a reconnection, a
client's messages and its leaving change, what a tick does, and what views.py may read. The lock
itself, who holds and who waits on each device and the rules that grant, drop and revoke (the
words *pair*, *active holder*, *overdue* are defined there), is lock.py. Beside them, each
asked at its moments and pure like them:
- registry.py: the registrations, devices and per-client settings (bookkeeping);
- queue_order.py: the order waiters are served in (priority classes, ageing, ACQUIRE order);
- turns.py: a gang's turns on all its devices (gangs.py: what a gang is);
- swapping.py: room before a grant, pressure, PREFETCH, POOL and PREPARE (residency.py and
  eviction.py: the rules it applies);
- admitting.py: ADMIT and its answers (admission.py: the rules);
- control_requests.py: the operator's set-* requests and the clients' LIMITs (fairshare.py:
  weights, priorities, limits);
- core_config.py: CoreConfig; records.py: the records every one of them reads.
Their imports point one way (docs/architecture.md): core.py on top, then control_requests.py,
lock.py, turns.py, swapping.py, admitting.py, registry.py and queue_order.py.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar

from .. import protocol
from . import eviction, gangs, residency
from .admission import AdmissionConfig, Waiter
from .admitting import Admissions
from .control_requests import ControlRequests
from .core_config import CoreConfig, ms
from .events import (
    AcquireRequest,
    Action,
    AdmitRequest,
    Alive,
    ClaimsLeft,
    ClientKey,
    ClientMessage,
    ControlError,
    DeviceInfo,
    DeviceMeasured,
    Event,
    Forget,
    FromClient,
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
from .lock import Lock, grant_message
from .records import Client, Device, Pair
from .registry import Registry
from .swapping import Swapping, end_eviction_wait
from .turns import live_pairs

__all__ = ["CoreConfig", "ControlError", "SchedulerCore"]

# Claims of one HELLO handled per step: a process rarely holds more devices than this, and one
# HELLO claiming many (invented) devices is handled in pieces (HandleClaims) between other
# users' messages instead of in one step of a few milliseconds (benchmarks/bench_floods.py).
CLAIMS_PER_STEP = 8


# The client message behind each event that may name a new device (for ERROR's `type`).
_MESSAGE_TYPES = {Register: "HELLO", HandleClaims: "HELLO", DeviceInfo: "DEVICE", MemoryReport: "MEMORY", AcquireRequest: "ACQUIRE",
                  AdmitRequest: "ADMIT"}


_ClientHandler = Callable[[Client, Any, list[Action]], None]
_M = TypeVar("_M", bound=protocol.Message)


def _message_row(kind: type[_M], handle: Callable[[Client, float, _M, list[Action]], None],
                 ) -> tuple[type[protocol.Message], _ClientHandler]:
    """The row of `_client_handlers` for a message that comes as a ClientMessage: `handle` gets
    the time it arrived and the message, of the class it is registered for."""
    return kind, lambda client, event, out: handle(client, event.now, event.message, out)


class SchedulerCore:
    """Events in, actions out. Not thread-safe: the daemon calls it from one task."""

    def __init__(self, config: CoreConfig, now: float) -> None:
        self.config = config
        self._registry = Registry(config.mode, config.tq)
        self.settings = self._registry.settings
        self._admissions = Admissions(config.admission)
        self._swapping = Swapping(config, self._registry, self._admissions)
        self._lock = Lock(config, self._registry, self._swapping, now)
        self._turns = self._lock.turns
        self._controls = ControlRequests(config, self._registry, self._lock, self._turns, self._admissions,
                                         self._budget_changed)
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
            SetMode: self._controls.set_mode,
            SetQuantum: self._controls.set_quantum,
            SetBudget: self._controls.set_budget,
            SetAdmission: self._controls.set_admission,
            SetWeight: self._controls.set_weight,
            SetPriority: self._controls.set_priority,
            SetLimit: self._controls.set_limit,
        }

    # --- public API -----------------------------------------------------------------------

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
        best = self._lock.next_deadline()
        client = self._registry.most_silent()
        if client is not None:
            timeout = client.last_seen + self.config.heartbeat_timeout
            if best is None or timeout < best:
                best = timeout
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
        """When the quantum of the pair's current grant ends (lock.Lock.quantum_end)."""
        return self._lock.quantum_end(pair)

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

    @property
    def admission(self) -> AdmissionConfig:
        return self._admissions.book.config

    def admission_capacity(self) -> int:
        """What the clients may hold on this node: the devices' budgets (the daemon's
        measurements and the operator's settings, never a client's word) plus the host spill."""
        return self._admissions.book.capacity

    def admission_reserved(self) -> int:
        return self._admissions.book.reserved

    def admission_reservation(self, pair: Pair) -> int:
        return self._admissions.book.reservation(pair)

    def admission_waiters(self) -> list[Waiter[Pair]]:
        return list(self._admissions.book.waiters.values())

    # --- registration ---------------------------------------------------------------------

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
        self._controls.sync_limits(client, out)
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
        client.claims_believed = self._lock.recovering(now)
        self._claim_some(client, ev, out, touched)
        for device_id in wanted:
            pair = self._pair(client, device_id, ev, out)
            if pair is None:
                continue
            touched[pair.device] = None
            if client.gang.ganged:
                self._turns.acquire(pair, now, out)
            else:
                self._lock.enqueue(pair, now, out)
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
            self._lock.settle(dev, now, out)

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
            self._lock.forget_overdue(pair)
            if pair.hold is not None and device_id not in held:
                out.append(LockEvent(now, "release", dev.id, old.cid, pair.hold.grant, "replaced"))
                self._lock.end_hold(pair, now)
            if pair.waiting_since is not None and device_id not in wanted:
                self._lock.leave_queue(pair, now)
            pair.client = new
            new.pairs[device_id] = pair
            self._admissions.book.reset(pair)  # the new connection's client asks afresh
            if pair.hold is not None:
                hold = pair.hold
                out.append(Send(new.key, grant_message(dev, hold.grant)))
                if hold.state == "draining":  # the DROP may have been lost with the old connection
                    out.append(Send(new.key, protocol.Drop(device=dev.id, grant=hold.grant, reason=hold.reason,
                                                           grace_ms=max(0, ms(hold.deadline - now)),
                                                           evict=self._swapping.evict_on_drop(pair))))
                hold.contended = False  # a CONTENDED may have been lost too: settling tells it again
                out.append(Log("info", "grant-passes", {"client": new.cid, "device": dev.id, "grant": hold.grant,
                                                   "predecessor": old.cid}))
        old.pairs = {}
        self._unlink_client(old, park=False)  # its settings passed to `new` (Registry.register)
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
                self._lock.claim(pair, client.claims_believed, ev.now, out)
        if client.claims_left:
            out.append(ClaimsLeft(client.key))

    def _handle_claims(self, ev: HandleClaims, out: list[Action]) -> None:
        client = self._registry.clients.get(ev.client)
        if client is None:  # gone meanwhile: its claims went with it
            return
        touched: dict[Device, None] = {}
        self._claim_some(client, ev, out, touched)
        for dev in touched:
            self._lock.settle(dev, ev.now, out)

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

    # --- client events --------------------------------------------------------------------

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

    def _budget_changed(self, dev: Device, before: int, now: float, out: list[Action]) -> None:
        """A device's budget changed from `before`: the capacity follows, and what depends on
        the budget is settled again (auto mode, room for a grant, swap areas, admission)."""
        self._admissions.budget_changed(dev, before)
        self._lock.settle(dev, now, out)
        self._swapping.size_swap_space(now, out)
        self._admissions.settle(now, out)

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
            elif pair.waiting_since is not None and in_flight and not pair.swap.allowed and not pair.swapped:
                # A waiter's memory is all back ahead of its grant (grant 0): its gate opens at it.
                out.append(LockEvent(ev.now, "restored", dev.id, client.cid, 0, f"resident={ev.resident} ahead"))
        residency.report_engine(pair, ev.engine, ev.area, ev.out_bps, ev.in_bps, ev.pool)
        # Swapping: a report may be a move's progress (the next waiter may bring its memory in
        # behind it), or change what a handoff costs (the quanta and contention notices).
        # Or it may be pressure: the holder grew past the budget beside idle tenants, which
        # are moved out now rather than paged out by the driver (eviction.py). And a holder that
        # grows while others wait is loading: its contention notice changes (free_idle_ms).
        if dev.mode == "auto" or dev.evict_awaited or (pair.hold is not None and dev.queue) or (self.config.swapping and (
                dev.queue or ev.resident is not None or eviction.under_pressure(dev))):
            self._lock.settle(dev, ev.now, out)
        self._swapping.size_swap_space(ev.now, out)
        self._admissions.settle(ev.now, out)

    def _acquire(self, client: Client, ev: AcquireRequest, out: list[Action]) -> None:
        pair = self._pair(client, ev.device, ev, out)
        if pair is None:
            return
        if client.gang.ganged:
            self._turns.acquire(pair, ev.now, out)
        elif self._lock.enqueue(pair, ev.now, out):
            self._swapping.take_back_eviction(pair, ev.now, out)
            self._lock.settle(pair.device, ev.now, out)

    def _admit(self, client: Client, ev: AdmitRequest, out: list[Action]) -> None:
        pair = self._pair(client, ev.device, ev, out)
        if pair is None:
            return
        self._admissions.ask(pair, ev, self.limit(pair), out)

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
            self._lock.end_hold(pair, ev.now)
            if turn is not None and ev.reason == "idle" and turn.fence.pop(ev.grant, 0) is None:
                # Its idle release crossed the fenced DROP: it paused where it was, which may be
                # behind the others' collectives. It is fenced like a member paused before.
                self._turns.fence_paused(turn, pair, ev.now, out, reason)
            self._lock.settle(dev, ev.now, out)
            self._swapping.size_swap_space(ev.now, out)  # eviction order moved: POOL need= (eviction.exposure)
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
        pair.swap.for_grant = False
        out.append(LockEvent(now, "evicted", dev.id, client.cid, detail=f"resident={evicted.resident}"))
        if pair in dev.evict_awaited:
            del dev.evict_awaited[pair]
        self._lock.settle(dev, now, out)
        self._swapping.size_swap_space(now, out)  # what leaves next moved: POOL need= (eviction.exposure)

    def _heartbeat(self, client: Client, ev: Alive, out: list[Action]) -> None:
        pass  # liveness was refreshed in handle()

    def _unregister(self, client: Client, ev: Unregister, out: list[Action]) -> None:
        self._remove_client(client, ev.reason, ev.now, out)

    # --- a client leaves ------------------------------------------------------------------

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
            self._lock.settle(dev, now, out)
            self._lock.forget_if_unused(dev)
        self._swapping.size_swap_space(now, out)
        self._admissions.settle(now, out)

    def _discard_pair(self, pair: Pair, now: float) -> None:
        """The client is gone from this device: nothing of it may block anyone."""
        dev = pair.device
        if pair.hold is not None:
            self._lock.end_hold(pair, now)
        if pair.waiting_since is not None:
            self._lock.leave_queue(pair, now)
        self._lock.forget_overdue(pair)
        dev.evict_asked.pop(pair, None)
        dev.evict_awaited.pop(pair, None)
        if dev.evict_for is pair:
            end_eviction_wait(dev)
        self._admissions.book.forget(pair)
        dev.used -= pair.used
        del dev.pairs[pair]

    def _unlink_client(self, client: Client, *, park: bool) -> None:
        self._registry.unlink(client, park=park)
        self._turns.leave(client)

    # --- time -----------------------------------------------------------------------------

    def _tick(self, ev: Tick, out: list[Action]) -> None:
        now = ev.now
        recovered = self._lock.end_recovery(now, out)
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
            due = self._lock.due(now)
        for dev in due:
            self._lock.settle(dev, now, out)
        self._swapping.size_swap_space(now, out)
        self._admissions.settle(now, out)
