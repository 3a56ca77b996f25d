"""Continuously busy clients against the lock core on virtual time (no processes, no clock).

Each client acquires a device, holds it until the scheduler DROPs it, releases after a drain of
`drain` seconds and asks again at once: the workload whose lock-time split weighted quanta
govern. `run_until(t)` advances time the way the daemon does (a Tick at every deadline the core
announces, client replies at their own moments), and `holds` records who held the device when,
from the core's own GRANT and RELEASE/REVOKE timeline entries.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from nvshare_py import protocol
from nvshare_py.scheduler.core import CoreConfig, SchedulerCore
from nvshare_py.scheduler.events import (
    AcquireRequest, ClientInfo, DeviceInfo, DeviceMeasured, LockEvent, Register, ReleaseReport, Send, SetPriority, SetWeight, Tick,
)

GPU = "GPU-5151ad00-0000-4000-8000-0000000000f5"


@dataclass
class Busy:
    key: str
    cid: str = ""
    grant: int | None = None
    busy: bool = True
    limits: dict = field(default_factory=dict)  # device -> bytes, from LIMIT


class World:
    def __init__(self, *, tq: float = 1.0, min_quantum: float = 0.1, ageing: int = 4, drain: float = 0.005,
                 heartbeat_timeout: float = 1e9) -> None:
        self.config = CoreConfig(tq=tq, min_quantum=min_quantum, ageing=ageing, grace=5.0, heartbeat_interval=1.0,
                                 heartbeat_timeout=heartbeat_timeout, idle_release=0.0)
        self.now = 0.0
        self.core = SchedulerCore(self.config, 0.0)
        self.drain = drain
        self.clients: dict[str, Busy] = {}
        self.pending: list = []  # (when, seq, callable)
        self.seq = itertools.count()
        self.holds: list[tuple[str, float, float]] = []  # (cid, since, until)
        self.open_holds: dict[int, tuple[str, float]] = {}
        self.grants: list[str] = []  # cids in grant order
        self.acquired: list[tuple[float, str]] = []
        self.sent: list[tuple[str, protocol.Message]] = []

    # --- driving -----------------------------------------------------------------------------

    def feed(self, event) -> list:
        actions = self.core.handle(event)
        for action in actions:
            if isinstance(action, LockEvent):
                self._record(action)
        for action in actions:  # a registration's LIMITs come before its WELCOME: name it first
            if isinstance(action, Send) and isinstance(action.message, protocol.Welcome):
                self.clients[action.client].cid = action.message.client
        for action in actions:
            if isinstance(action, Send):
                self._deliver(action.client, action.message)
        return actions

    def add(self, name: str, *, weight: int | None = None, priority: int | None = None, pod_uid: str = "",
            busy: bool = True) -> Busy:
        client = self.clients[name] = Busy(name, busy=busy)
        info = ClientInfo(pid=1000 + len(self.clients), session=f"{len(self.clients):016x}", pod_uid=pod_uid)
        self.feed(Register(self.now, name, info))
        self.feed(DeviceMeasured(self.now, GPU, 16 << 30))
        self.feed(DeviceInfo(self.now, name, GPU, 16 << 30))
        if weight is not None:
            self.feed(SetWeight(self.now, weight, client=client.cid))
        if priority is not None:
            self.feed(SetPriority(self.now, priority, client=client.cid))
        if busy:
            self.acquire(name)
        return client

    def acquire(self, name: str) -> None:
        self.acquired.append((self.now, self.clients[name].cid))
        self.feed(AcquireRequest(self.now, name, GPU))

    def later(self, delay: float, fn) -> None:
        heapq.heappush(self.pending, (self.now + delay, next(self.seq), fn))

    def run_until(self, end: float) -> None:
        while True:
            due = self.core.next_deadline()
            when = min(t for t in (due, self.pending[0][0] if self.pending else None, end) if t is not None)
            self.now = when
            if self.pending and self.pending[0][0] <= when:
                _, _, fn = heapq.heappop(self.pending)
                fn()
                continue
            if due is not None and due <= when:
                self.feed(Tick(when))
                continue
            return

    # --- the clients' side ---------------------------------------------------------------------

    def _deliver(self, key, message) -> None:
        client = self.clients[key]
        self.sent.append((client.cid or key, message))
        if isinstance(message, protocol.Grant):
            client.grant = message.grant
        elif isinstance(message, protocol.Drop) and message.grant == client.grant:
            grant = client.grant
            self.later(self.drain, lambda: self._release(client, grant))
        elif isinstance(message, protocol.Limit):
            client.limits[message.device] = message.bytes

    def _release(self, client: Busy, grant: int) -> None:
        if client.grant != grant:
            return
        client.grant = None
        self.feed(ReleaseReport(self.now, client.key, GPU, grant, "drop"))
        if client.busy:
            self.acquire(client.key)

    def _record(self, event: LockEvent) -> None:
        if event.kind == "grant":
            self.open_holds[event.grant] = (event.client, event.now)
            self.grants.append(event.client)
        elif event.kind in ("release", "revoke", "unregister", "lost") and event.grant in self.open_holds:
            cid, since = self.open_holds.pop(event.grant)
            self.holds.append((cid, since, event.now))

    # --- measuring ---------------------------------------------------------------------------

    def held(self, cid: str, start: float, end: float) -> float:
        """Seconds `cid` held the device within [start, end]."""
        spans = [(since, until) for who, since, until in self.holds if who == cid]
        spans += [(since, self.now) for who, since in self.open_holds.values() if who == cid]
        return sum(max(0.0, min(until, end) - max(since, start)) for since, until in spans)
