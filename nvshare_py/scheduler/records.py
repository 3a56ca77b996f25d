"""The lock core's records: what the scheduler keeps of each grant, client, device and (client,
device) pair. The core changes them (core.py, the lock in lock.py and the modules beside them);
the pure rules (queue_order.py, residency.py, eviction.py) and what the daemon shows (views.py)
read them. Plain records with no rules of their own, so that every module that reads them can
import them without importing the core.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

from . import fairshare, gangs
from .events import ClientInfo, ClientKey, Mode


@dataclass
class SwapState:
    """A pair's swap engine as its client reported it, and what the scheduler told it."""

    engine: str = ""     # "copy" (pinned copies at link speed), "migrate" (the driver's prefetch), "" unknown
    area: int = 0        # pinned bytes it has ready
    out_bps: int = 0     # its last moves to the host and back, bytes per second (0: not measured)
    in_bps: int = 0
    prepared: int = 0    # the last PREPARE's bytes
    allowed: int = 0     # the last PREFETCH's resident= in the current wait (0: none)
    leaving: int = 0     # bytes an EVICT asked it to move out that it has not been seen moving yet
    # An EVICT under way makes room for the waiter granted next (swapping.room_made), whose grant
    # waits for it: not taken back when this pair asks (swapping.take_back_eviction).
    for_grant: bool = False
    pool: bool = False   # its area is its user's swap pool (POOL), not memory of its own
    # While it is the next waiter and brings its memory back ahead of its grant, when it is
    # granted whatever it still has out (swapping.restores_first; None: not yet asked).
    restore_by: float | None = None


class Hold:
    """One grant. `state` is holding, draining (DROP sent for `reason`, `deadline` is when the
    grace ends) or overdue (revoked, RELEASE not seen yet). `contended`: CONTENDED was sent in
    the device's current contention episode, announcing the quantum end `told_end`. `klass`
    and `aged_from`: the holder's priority class and the device's grant count when it began to
    wait (when granted, if it did not wait), so that it ages on as a waiter would: a waiter of a
    higher effective class cuts its quantum short (lock.Lock.quantum_end)."""

    __slots__ = ("grant", "since", "state", "deadline", "reason", "contended", "told_end", "klass", "aged_from",
                 "told_swap", "turn", "ahead_of", "used_at_grant")

    def __init__(self, grant: int, since: float, klass: int, aged_from: int, used_at_grant: int) -> None:
        self.grant = grant
        self.since = since
        self.state = "holding"
        self.deadline = 0.0
        self.reason = ""
        self.contended = False
        self.told_end = 0.0  # the quantum end CONTENDED announced
        self.klass = klass
        self.aged_from = aged_from
        self.told_swap = (0, 0)  # CONTENDED's evict= and idle_ms= as last told (residency.py)
        self.turn: gangs.Turn | None = None  # the gang's turn it was granted in (gangs.py)
        # The waiter this grant was made ahead of while that one brought its memory back: the
        # grant is dropped once that waiter is ready (lock.py, Lock._lend).
        self.ahead_of: Pair | None = None
        # The holder's allocated bytes when granted: one that allocated since is building up (a
        # load), not a server between requests (residency.free_idle_ms).
        self.used_at_grant = used_at_grant


class Client:
    __slots__ = ("key", "cid", "info", "connected", "last_seen", "pairs", "told_every", "told", "gang", "claims_left",
                 "claims_believed", "told_pool", "told_pool_need")

    def __init__(self, key: ClientKey, cid: str, info: ClientInfo, now: float) -> None:
        self.key = key
        self.cid = cid
        self.info = info
        self.connected = now
        self.last_seen = now
        self.pairs: dict[str, Pair] = {}  # by device id
        # The memory limits this registration was told (LIMIT, 0: none): for every device,
        # and for the devices it was told of one by one (those override the former).
        self.told_every = 0
        self.told: dict[str, int] = {}
        self.gang = gangs.Gang(("solo", key), "", cid, 0)  # its unit: itself until it joins a named gang
        self.gang.members[self] = None
        # The devices its HELLO claims that are not handled yet (CLAIMS_PER_STEP), and whether
        # the HELLO came inside the recovery window (its claims are judged as of then).
        self.claims_left: list[str] = []
        self.claims_believed = False
        self.told_pool = 0  # the swap pool's size it was told (POOL; eviction.py)
        self.told_pool_need: int | None = None  # and POOL's need= (eviction.exposure; None: not said)

    @property
    def process(self) -> Hashable | None:
        """The process's kernel-verified identity (None where the daemon cannot see it)."""
        info = self.info
        return (info.uid, info.host_pid, info.host_start) if info.host_pid else None

    @property
    def principal(self) -> Hashable:
        """Whom its admission quota and swap pool are for (admission.py, eviction.py): its pod,
        else its user, both as the kernel shows them; a client whose uid the daemon cannot see
        is its own."""
        info = self.info
        if info.pod_uid:
            return ("pod", info.pod_uid)
        if info.uid is not None:
            return ("uid", info.uid)
        return ("client", self.key)


class Device:
    __slots__ = ("id", "name", "total", "budget_override", "mode", "tq", "holders", "overdue", "queue",
                 "pairs", "used", "evict_asked", "evict_awaited", "evict_deadline", "evict_for", "classes",
                 "grants_made", "reserved", "gang_waiters", "moved_out", "moved_in", "headroom")

    def __init__(self, device_id: str, mode: Mode, tq: float) -> None:
        self.id = device_id
        self.name = ""
        # The device's size as the daemon measured it (DeviceMeasured): 0 while unknown. A
        # client's DEVICE report never sizes it (docs/scheduler.md, security model).
        self.total = 0
        self.budget_override: int | None = None
        self.mode: Mode = mode
        self.tq = tq
        self.holders: dict[int, Pair] = {}  # active grants by grant id; insertion = grant order
        self.overdue: dict[int, Pair] = {}  # revoked grants awaiting their RELEASE
        self.queue: OrderedDict[Pair, None] = OrderedDict()  # every waiter in ACQUIRE order
        # The waiters once more, by the priority class they queued in (each in ACQUIRE order):
        # the next one served is the head of one of them (fairshare.py).
        self.classes: list[OrderedDict[Pair, None]] = [
            OrderedDict() for _ in range(fairshare.PRIORITY_MAX + 1)]
        self.grants_made = 0  # grants ever made on the device: waiters age by them
        # The gang turn that has the device until all of the gang has released (gangs.py), and
        # how many of the waiters queued as part of a gang.
        self.reserved: gangs.Turn | None = None
        self.gang_waiters = 0
        self.pairs: dict[Pair, None] = {}  # every client that knows the device (MODE notices)
        self.used = 0  # sum of the pairs' used bytes
        # The current wait for room (residency.py): who was sent EVICT in it and for how many
        # bytes, whose EVICTED is still awaited, when the head is granted regardless, and the
        # head it is for: its turn has begun, so it is granted next even if a waiter that
        # outranks it comes meanwhile (else that one, maybe the very client that is moving its
        # memory out, would be granted while memory moves for nobody).
        self.evict_asked: dict[Pair, int] = {}
        self.evict_awaited: dict[Pair, None] = {}
        self.evict_deadline: float | None = None
        self.evict_for: Pair | None = None
        # Bytes its clients were seen moving to the host and back (residency.report), for the
        # metrics; and the headroom it keeps now (eviction.py).
        self.moved_out = 0
        self.moved_in = 0
        self.headroom = 0

    @property
    def budget(self) -> int:
        """0 means unknown, which auto mode treats as "nothing fits beside a holder"."""
        return self.total if self.budget_override is None else self.budget_override

    @property
    def size(self) -> int:
        """The most of the device a client's use counts as for admission: its measured size,
        else the operator's budget; 0 while the daemon knows neither, so that a report on a
        device nobody sized fills no share (it adds nothing to the capacity either)."""
        return self.total or self.budget

    def held_used(self) -> int:
        return sum(pair.used for pair in self.holders.values())


class Pair:
    __slots__ = ("client", "device", "used", "hold", "overdue", "waiting_since", "wait_total", "hold_total",
                 "grants", "blocked_by", "last_wait", "resident", "swapped", "last_held", "held_before", "away", "queued_seq",
                 "queued_grants",
                 "queued_class", "recent", "swap", "gang_queued")

    def __init__(self, client: Client, device: Device) -> None:
        self.client = client  # changes when a reconnecting process takes its pairs over
        self.device = device
        self.used = 0
        self.hold: Hold | None = None  # the current grant, holding or draining
        self.overdue: dict[int, Hold] = {}
        self.waiting_since: float | None = None
        self.wait_total = 0.0
        self.hold_total = 0.0
        self.grants = 0
        # Who was ahead when the current wait began (holders, then waiters), for QUERY; and
        # the last finished wait: (seconds, who was ahead).
        self.blocked_by: tuple[Client, ...] = ()
        self.last_wait: tuple[float, tuple[Client, ...]] | None = None
        # Residency (residency.py): the converted bytes the client last said are on the device
        # (None: it does not report residency), the bytes seen moved to the host, and when its
        # last grant and the one before it ended (-inf: never), which order EVICTs (eviction.py).
        self.resident: int | None = None
        self.swapped = 0
        self.last_held = -math.inf
        self.held_before = -math.inf
        # How long it stayed away between its last grant's end and its latest ACQUIRE (0: it
        # asked while it still held, or had never held): how long its pauses last, as far as
        # the scheduler sees them (residency.free_idle_ms).
        self.away = 0.0
        self.swap = SwapState()  # its swap engine, and what it was told to prepare and prefetch
        # While waiting: its place in ACQUIRE order, the device's grants_made then, and the
        # priority class it waits in.
        self.queued_seq = 0
        self.queued_grants = 0
        self.queued_class = 0
        self.gang_queued = False  # it waits as part of its gang's request for a turn
        self.recent = fairshare.new_recent()  # finished holds (since, until) in the share window

    @property
    def held(self) -> Hold:
        """The current grant of a pair known to hold one (a holder of its device)."""
        assert self.hold is not None, "not a holder"
        return self.hold
