"""Stateful property test of priority classes, ageing and weights in the lock core.

Hypothesis drives up to MAX_PROCS clients on one device in mode on: they register, acquire,
release, leave; the operator changes weights and priority classes (per client, per pod, the
default) at any moment; time advances to the core's deadlines or by random amounts. A model that
knows only what was sent and received checks after every step:

1. Priorities and FCFS: every GRANT goes to the waiter of the highest effective class
   (fairshare.effective_class: its class plus one per `ageing` grants made while it waited), the
   earliest ACQUIRE among equals. With equal classes that is plain FCFS.
2. No starvation: a waiter is granted before more than 7 * ageing + MAX_PROCS - 1 grants went
   to others: by then it has effective class 7 and only those that queued before it are ahead.
3. Quanta: while someone waits, a holding grant is dropped at the latest when its quantum ends
   (weighted, never longer than tq), and no earlier than the floor min(min_quantum, tq).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nvshare_py import protocol
from nvshare_py.scheduler import fairshare
from nvshare_py.scheduler.core import CoreConfig, SchedulerCore
from nvshare_py.scheduler.events import (
    AcquireRequest, ClientInfo, DeviceInfo, DeviceMeasured, Register, ReleaseReport, Send, SetPriority, SetWeight, Tick, Unregister,
)

GPU = "GPU-5151ad00-0000-4000-8000-0000000000aa"
MAX_PROCS = 5
AGEING = 2
TQ = 4.0
MIN_QUANTUM = 0.5
PODS = ("pod-a", "pod-b")
EPS = 1e-9


@dataclass(eq=False)
class Proc:
    key: str
    pod: str
    cid: str = ""
    grant: int | None = None
    granted_at: float = 0.0
    dropped: bool = False
    waiting: bool = False
    seq: int = 0
    grants_seen: int = 0  # grants to others since it queued


@dataclass
class Settings:
    weight: dict = field(default_factory=dict)  # ("client"|"pod"|"default", key) -> value
    priority: dict = field(default_factory=dict)


class FairshareMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        config = CoreConfig(tq=TQ, min_quantum=MIN_QUANTUM, ageing=AGEING, grace=1.0, heartbeat_interval=1.0,
                            heartbeat_timeout=1e6, idle_release=0.0)
        self.core = SchedulerCore(config, 0.0)
        self.procs: list[Proc] = []
        self.by_key: dict[str, Proc] = {}
        self.numbers = 0
        self.seq = 0
        self.priority = {"default": 0, "pod": {}, "client": {}}
        self.weight = {"default": 1, "pod": {}, "client": {}}

    # --- model helpers -----------------------------------------------------------------------

    def resolve(self, table: dict, proc: Proc) -> int:
        if proc.cid in table["client"]:
            return table["client"][proc.cid]
        if proc.pod in table["pod"]:
            return table["pod"][proc.pod]
        return table["default"]

    def rank(self, proc: Proc) -> int:
        return fairshare.effective_class(self.resolve(self.priority, proc), proc.grants_seen, AGEING)

    def expected_next(self) -> Proc | None:
        waiters = [p for p in self.procs if p.waiting]
        if not waiters:
            return None
        return max(waiters, key=lambda p: (self.rank(p), -p.seq))

    def holder(self) -> Proc | None:
        return next((p for p in self.procs if p.grant is not None), None)

    def feed(self, event) -> None:
        for action in self.core.handle(event):
            if type(action) is Send:
                self.deliver(self.by_key[action.client], action.message)

    def deliver(self, proc: Proc, message) -> None:
        if isinstance(message, protocol.Welcome):
            proc.cid = message.client
        elif isinstance(message, protocol.Grant):
            expected = self.expected_next()
            assert proc is expected, (
                f"GRANT to {proc.cid} (rank {self.rank(proc)}, seq {proc.seq}), expected {expected and expected.cid}: "
                + str([(p.cid, self.rank(p), p.seq) for p in self.procs if p.waiting]))
            assert self.holder() is None, "a second grant while one is outstanding"
            for other in self.procs:
                if other.waiting and other is not proc:
                    other.grants_seen += 1
            proc.waiting = False
            proc.grant = message.grant
            proc.granted_at = self.now
            proc.dropped = False
        elif isinstance(message, protocol.Drop):
            assert proc.grant == message.grant
            held = self.now - proc.granted_at
            assert held >= min(MIN_QUANTUM, TQ) - EPS or message.reason != "quantum", (held, message)
            proc.dropped = True
        elif isinstance(message, protocol.Revoke):
            proc.grant = None

    # --- rules -------------------------------------------------------------------------------

    @precondition(lambda self: len(self.procs) < MAX_PROCS)
    @rule(pod=st.sampled_from(PODS + ("",)), busy=st.booleans())
    def register(self, pod: str, busy: bool) -> None:
        self.numbers += 1
        proc = Proc(key=f"k{self.numbers}", pod=pod)
        self.procs.append(proc)
        self.by_key[proc.key] = proc
        info = ClientInfo(pid=self.numbers, session=f"{self.numbers:016x}", pod_uid=pod)
        self.feed(Register(self.now, proc.key, info))
        self.feed(DeviceMeasured(self.now, GPU, 1 << 34))
        self.feed(DeviceInfo(self.now, proc.key, GPU, 1 << 34))
        if busy:
            self._acquire(proc)

    @precondition(lambda self: any(not p.waiting and p.grant is None for p in self.procs))
    @rule(pick=st.integers(0, 100))
    def acquire(self, pick: int) -> None:
        idle = [p for p in self.procs if not p.waiting and p.grant is None]
        self._acquire(idle[pick % len(idle)])

    def _acquire(self, proc: Proc) -> None:
        self.seq += 1
        proc.waiting, proc.seq, proc.grants_seen = True, self.seq, 0
        self.feed(AcquireRequest(self.now, proc.key, GPU))

    @precondition(lambda self: self.holder() is not None)
    @rule(again=st.booleans())
    def release(self, again: bool) -> None:
        """The holder gives the lock back (after a DROP or not); a busy one asks again at once."""
        proc = self.holder()
        grant, proc.grant = proc.grant, None
        self.feed(ReleaseReport(self.now, proc.key, GPU, grant, "drop"))
        if again:
            self._acquire(proc)

    @precondition(lambda self: bool(self.procs))
    @rule(pick=st.integers(0, 100))
    def leave(self, pick: int) -> None:
        proc = self.procs.pop(pick % len(self.procs))
        self.feed(Unregister(self.now, proc.key, "bye"))
        for table in (self.priority, self.weight):
            table["client"].pop(proc.cid, None)

    @rule(value=st.one_of(st.none(), st.integers(fairshare.PRIORITY_MIN, fairshare.PRIORITY_MAX)),
          whom=st.sampled_from(("default", "pod", "client")), pick=st.integers(0, 100))
    def set_priority(self, value, whom: str, pick: int) -> None:
        self._set(self.priority, SetPriority, fairshare.DEFAULT_PRIORITY, value, whom, pick)

    @rule(value=st.one_of(st.none(), st.integers(fairshare.WEIGHT_MIN, 8)),
          whom=st.sampled_from(("default", "pod", "client")), pick=st.integers(0, 100))
    def set_weight(self, value, whom: str, pick: int) -> None:
        self._set(self.weight, SetWeight, fairshare.DEFAULT_WEIGHT, value, whom, pick)

    def _set(self, table: dict, event_type, fallback: int, value, whom: str, pick: int) -> None:
        if whom == "client":
            if not self.procs:
                return
            cid = self.procs[pick % len(self.procs)].cid
            _store(table["client"], cid, value)
            self.feed(event_type(self.now, value, client=cid))
        elif whom == "pod":
            pod = PODS[pick % len(PODS)]
            _store(table["pod"], pod, value)
            self.feed(event_type(self.now, value, pod_uid=pod))
        else:
            table["default"] = fallback if value is None else value
            self.feed(event_type(self.now, value))

    @rule(step=st.sampled_from((0.1, 0.4, 1.0, 3.0)))
    def advance(self, step: float) -> None:
        self._advance_to(self.now + step)

    @precondition(lambda self: self.core.next_deadline() is not None)
    @rule()
    def to_deadline(self) -> None:
        # Bounded: the heartbeat timeout (a deadline too) is far beyond any run's end.
        self._advance_to(min(self.core.next_deadline(), self.now + 2 * TQ))

    def _advance_to(self, end: float) -> None:
        while (due := self.core.next_deadline()) is not None and due <= end:
            self.now = due
            self.feed(Tick(due))
            self.quantum_never_outlasts_tq()
        self.now = end

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def nobody_starves(self) -> None:
        for proc in self.procs:
            if proc.waiting:
                assert proc.grants_seen <= 7 * AGEING + MAX_PROCS - 1, (proc.cid, proc.grants_seen)

    @invariant()
    def the_lock_is_not_idle_while_someone_waits(self) -> None:
        if any(p.waiting for p in self.procs):
            assert self.holder() is not None, "waiters but no holder"

    @invariant()
    def quantum_never_outlasts_tq(self) -> None:
        """While someone waits, a holding grant is dropped by the end of its quantum (<= tq)."""
        holder = self.holder()
        if holder is not None and not holder.dropped and any(p.waiting for p in self.procs):
            assert self.now - holder.granted_at < TQ + EPS, (holder.cid, holder.granted_at, self.now)


def _store(table: dict, key: str, value) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


FairshareMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_fairshare_rules = FairshareMachine.TestCase
