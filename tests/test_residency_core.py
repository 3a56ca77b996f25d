"""The residency rules of the lock core (nvshare_py/scheduler/residency.py, docs/scheduler.md
"Budgets and swapping"): what a DROP asks the holder to evict, whom EVICT asks for room, what a
GRANT lets the grantee prefetch, and that memory that fits never moves.

Example tests first, then a Hypothesis state machine: simulated swapping clients (each knows
how much of its converted memory is on the device and reports it truthfully) against one
device whose budget is below their sum or above it."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nvshare_py import protocol
from nvshare_py.scheduler import views
from nvshare_py.scheduler.core import CoreConfig, SchedulerCore
from nvshare_py.scheduler.events import (
    AcquireRequest,
    ClientInfo,
    DeviceInfo,
    DeviceMeasured,
    EvictedReport,
    Log,
    MemoryReport,
    Register,
    ReleaseReport,
    Send,
    SetBudget,
    SetPriority,
    Tick,
)

GiB = 1 << 30
DEV = "GPU-5151ad00-0000-4000-8000-00000000000a"
TOTAL = 16 * GiB


class Cluster:
    """One core, one device, clients named by key; `sent(type)` lists what the last event sent."""

    def __init__(self, mode: str = "on", budget: int | None = None, grace: float = 2.0, tq: float = 1.0) -> None:
        self.now = 0.0
        self.core = SchedulerCore(CoreConfig(mode=mode, tq=tq, grace=grace, heartbeat_timeout=1e6,
                                             heartbeat_interval=1e5), self.now)
        self.actions: list = []
        self.budget = budget

    def feed(self, event) -> list:
        self.actions = self.core.handle(event)
        return self.actions

    def join(self, key: str, used: int, resident: int | None) -> None:
        self.feed(Register(self.now, key, ClientInfo(pid=len(key) + 100, session=f"{abs(hash(key)):016x}"[:16])))
        self.feed(DeviceMeasured(self.now, DEV, TOTAL))
        self.feed(DeviceInfo(self.now, key, DEV, TOTAL))
        if self.budget is not None:
            self.core.handle(SetBudget(self.now, DEV, self.budget))
        self.feed(MemoryReport(self.now, key, DEV, used, resident))

    def sent(self, kind: type, to: str | None = None) -> list:
        return [a.message for a in self.actions
                if isinstance(a, Send) and isinstance(a.message, kind) and (to is None or a.client == to)]

    def grant_of(self, key: str) -> protocol.Grant:
        (grant,) = self.sent(protocol.Grant, key)
        return grant

    def advance(self, seconds: float) -> list:
        self.now += seconds
        return self.feed(Tick(self.now))


def two_swappers(used: int = 12 * GiB, budget: int = 16 * GiB) -> Cluster:
    """a holds the device with all of `used` resident; b waits; the budget holds one of them."""
    c = Cluster(budget=budget)
    c.join("a", used, 0)
    c.feed(AcquireRequest(c.now, "a", DEV))
    grant = c.grant_of("a")
    c.feed(MemoryReport(c.now, "a", DEV, used, used))  # its first kernels faulted it all in
    c.join("b", used, 0)
    c.feed(AcquireRequest(c.now, "b", DEV))
    c.a_grant = grant.grant
    return c


def test_memory_that_fits_moves_nothing_and_the_wire_reads_as_before():
    c = Cluster()
    c.join("a", 6 * GiB, 0)
    c.feed(AcquireRequest(c.now, "a", DEV))
    grant = c.grant_of("a")
    c.feed(MemoryReport(c.now, "a", DEV, 6 * GiB, 6 * GiB))
    c.join("b", 6 * GiB, 0)
    c.feed(AcquireRequest(c.now, "b", DEV))
    c.advance(1.0)
    (drop,) = c.sent(protocol.Drop, "a")
    assert drop.evict == 0 and b"evict" not in drop.encode()
    c.feed(ReleaseReport(c.now, "a", DEV, grant.grant, "drop", 6 * GiB))
    granted = c.grant_of("b")
    assert granted.prefetch == 0 and b"prefetch" not in granted.encode()
    assert not c.sent(protocol.Evict)


def test_drop_asks_the_holder_to_evict_exactly_what_the_grantee_lacks():
    c = two_swappers()
    c.advance(1.0)  # a's quantum ends while b waits
    (drop,) = c.sent(protocol.Drop, "a")
    # b wants its 12 GiB back; a's 12 GiB leave only 4 of the 16: a moves 8, keeps 4.
    assert drop.evict == 8 * GiB


def test_holder_that_evicted_as_asked_lets_the_grantee_in_at_once_and_is_paid_back_later():
    c = two_swappers()
    c.advance(1.0)
    c.feed(ReleaseReport(c.now, "a", DEV, c.a_grant, "drop", 4 * GiB))
    grant_b = c.grant_of("b")
    assert grant_b.prefetch == 0  # b never was evicted: nothing of it to bring back
    assert not c.sent(protocol.Evict)
    c.feed(MemoryReport(c.now, "b", DEV, 12 * GiB, 12 * GiB))
    c.feed(AcquireRequest(c.now, "a", DEV))
    c.advance(1.0)
    (drop,) = c.sent(protocol.Drop, "b")
    assert drop.evict == 8 * GiB
    c.feed(ReleaseReport(c.now, "b", DEV, grant_b.grant, "drop", 4 * GiB))
    # a's 8 GiB evicted earlier now fit (b keeps 4 of 16): it may prefetch them all.
    assert c.grant_of("a").prefetch == 8 * GiB


def test_a_holder_that_did_not_evict_is_asked_again_and_the_grant_waits_for_its_answer():
    c = two_swappers()
    c.advance(1.0)
    c.feed(ReleaseReport(c.now, "a", DEV, c.a_grant, "drop", 12 * GiB))  # ignored the eviction
    assert not c.sent(protocol.Grant)
    (evict,) = c.sent(protocol.Evict, "a")
    assert evict.bytes == 8 * GiB
    c.feed(EvictedReport(c.now, "a", DEV, 4 * GiB))
    assert c.grant_of("b").prefetch == 0


def test_idle_clients_are_asked_least_recently_held_first():
    c = Cluster(budget=16 * GiB)
    for key in ("a", "b"):
        c.join(key, 6 * GiB, 0)
    c.join("c", 0, 0)  # it allocates later: allocated memory counts in full, touched or not
    for key in ("a", "b"):  # a holds first, then b: a is the least recently held
        c.feed(AcquireRequest(c.now, key, DEV))
        grant = c.grant_of(key)
        c.feed(MemoryReport(c.now, key, DEV, 6 * GiB, 6 * GiB))
        c.now += 1.0
        c.feed(ReleaseReport(c.now, key, DEV, grant.grant, "idle", 6 * GiB))
    c.feed(MemoryReport(c.now, "c", DEV, 6 * GiB, 0))
    c.feed(AcquireRequest(c.now, "c", DEV))  # 6 + 6 resident + 6 wanted = 18 > 16
    assert [(m.bytes,) for m in c.sent(protocol.Evict, "a")] == [(2 * GiB,)]
    assert not c.sent(protocol.Evict, "b") and not c.sent(protocol.Grant)


def test_unanswered_evict_delays_the_grant_by_the_grace_at_most_and_says_so():
    c = two_swappers()
    c.advance(1.0)
    c.feed(ReleaseReport(c.now, "a", DEV, c.a_grant, "drop", 12 * GiB))
    assert c.sent(protocol.Evict, "a") and c.core.next_deadline() == c.now + 2.0
    c.advance(2.0)
    assert c.grant_of("b")
    assert [a for a in c.actions if isinstance(a, Log) and a.what == "evict-timeout"]


def test_clients_that_do_not_report_residency_are_never_asked_to_move():
    c = Cluster(budget=16 * GiB)
    c.join("a", 12 * GiB, None)
    c.feed(AcquireRequest(c.now, "a", DEV))
    grant = c.grant_of("a")
    c.join("b", 12 * GiB, None)
    c.feed(AcquireRequest(c.now, "b", DEV))
    c.advance(1.0)
    assert c.sent(protocol.Drop, "a")[0].evict == 0
    c.feed(ReleaseReport(c.now, "a", DEV, grant.grant, "drop"))
    assert c.grant_of("b").prefetch == 0 and not c.sent(protocol.Evict)


def test_a_free_is_not_mistaken_for_an_eviction():
    c = Cluster(budget=16 * GiB)
    c.join("a", 12 * GiB, 12 * GiB)
    c.feed(MemoryReport(c.now, "a", DEV, 4 * GiB, 4 * GiB))
    (client,) = views.status(c.core, c.now, lambda t: t)["clients"]
    assert client["devices"][DEV]["resident"] == 4 * GiB and client["devices"][DEV]["swapped"] == 0


def test_status_shows_resident_and_swapped_out_bytes():
    c = two_swappers()
    c.advance(1.0)
    c.feed(ReleaseReport(c.now, "a", DEV, c.a_grant, "drop", 4 * GiB))
    shown = {cl["client"]: cl["devices"][DEV] for cl in views.status(c.core, c.now, lambda t: t)["clients"]}
    assert (shown["c1"]["resident"], shown["c1"]["swapped"]) == (4 * GiB, 8 * GiB)
    assert (shown["c2"]["resident"], shown["c2"]["swapped"]) == (12 * GiB, 0)


def test_a_handoff_to_oneself_moves_no_memory():
    # Issue 20: under priority, a holder was swapped out and granted the lock again itself every
    # ~0.75 s: it released (ahead of its quantum's end), was sent EVICT to make room for the
    # waiter, asked again, and, outranking the waiter, was granted while its memory moved out
    # for nobody (GRANT without prefetch: it faulted it all back in). The waiter room is being
    # made for keeps its turn: the memory moves for it, and it is granted.
    c = Cluster(budget=16 * GiB)
    c.join("a", 12 * GiB, 0)
    c.feed(SetPriority(c.now, 5, client="c1"))
    c.feed(AcquireRequest(c.now, "a", DEV))
    grant = c.grant_of("a")
    c.feed(MemoryReport(c.now, "a", DEV, 12 * GiB, 12 * GiB))
    c.join("b", 12 * GiB, 0)
    c.feed(AcquireRequest(c.now, "b", DEV))
    c.advance(0.9)
    c.feed(ReleaseReport(c.now, "a", DEV, grant.grant, "quantum", 12 * GiB))  # a pre-drain: no evict asked
    (evict,) = c.sent(protocol.Evict, "a")  # room for b
    assert evict.bytes == 8 * GiB
    c.feed(AcquireRequest(c.now, "a", DEV))  # a has more work; its class is above b's
    assert not c.sent(protocol.Grant)
    c.feed(EvictedReport(c.now, "a", DEV, 4 * GiB))
    assert c.grant_of("b").prefetch == 0 and not c.sent(protocol.Grant, "a")
    # b's turn ends; a, granted now, brings its memory back in bulk
    b_grant = c.grant_of("b").grant
    c.feed(MemoryReport(c.now, "b", DEV, 12 * GiB, 12 * GiB))
    c.advance(1.0)
    assert c.sent(protocol.Drop, "b")[0].evict == 8 * GiB
    c.feed(ReleaseReport(c.now, "b", DEV, b_grant, "drop", 4 * GiB))
    assert c.grant_of("a").prefetch == 8 * GiB


# --- the state machine ---------------------------------------------------------------------

@dataclass(eq=False)
class Swapper:
    """A simulated swapping client: `on_device` is the truth, which it reports."""

    key: str
    used: int
    on_device: int = 0
    grant: int | None = None
    dropped_evict: int | None = None  # DROP received: bytes to move before releasing
    evict_asked: int | None = None  # EVICT received, not answered yet
    waiting: bool = False
    held_once: bool = False
    moved_out: int = 0  # bytes it moved to the host and has not brought back

    def move_out(self, amount: int) -> None:
        amount = min(amount, self.on_device)
        self.on_device -= amount
        self.moved_out += amount

    def bring_in(self, to: int) -> None:
        self.moved_out = max(0, self.moved_out - max(0, to - self.on_device))
        self.on_device = to


class ResidencyMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["on", "on", "auto"]), fits=st.booleans(), grace=st.sampled_from([0.5, 2.0]),
                sizes=st.lists(st.integers(1, 10), min_size=2, max_size=4))
    def start(self, mode, fits, grace, sizes):
        self.grace = grace
        self.c = Cluster(mode=mode, grace=grace)
        self.budget = max(sum(sizes), 12) * GiB if fits else 12 * GiB
        self.fits = fits
        self.c.budget = self.budget
        self.clients = [Swapper(f"k{i}", size * GiB) for i, size in enumerate(sizes)]
        for client in self.clients:
            self.c.join(client.key, client.used, 0)
            self.observe()
        self.queue: list[Swapper] = []
        self.head_blocked_since: float | None = None

    def by_key(self, key) -> Swapper:
        return next(client for client in self.clients if client.key == key)

    def observe(self) -> None:
        """Check the last actions and play them onto the simulated clients (a grantee's
        report of what it brought in is fed in turn)."""
        timed_out = any(isinstance(a, Log) and a.what == "evict-timeout" for a in self.c.actions)
        follow_ups = []
        for action in self.c.actions:
            if not isinstance(action, Send):
                continue
            client, message = self.by_key(action.client), action.message
            if self.fits:
                assert not isinstance(message, protocol.Evict), "memory that fits never moves"
                assert getattr(message, "evict", 0) == 0 and getattr(message, "prefetch", 0) == 0
            if isinstance(message, protocol.Grant):
                assert self.queue and self.queue[0] is client, "FCFS: the head is granted"
                self.queue.pop(0)
                others = sum(other.on_device for other in self.clients if other is not client)
                if not timed_out:
                    assert others + min(client.used, self.budget) <= self.budget, \
                        "a grant is made only once the others' resident memory leaves room"
                if client.held_once:
                    assert message.prefetch <= client.used - client.on_device
                client.grant, client.waiting, client.held_once = message.grant, False, True
                # The grantee runs: what it prefetched and what it faults in is all of it, as
                # far as the budget lets it.
                client.bring_in(min(client.used, max(client.on_device, self.budget - others)))
                follow_ups.append(MemoryReport(self.c.now, client.key, DEV, client.used, client.on_device))
            elif isinstance(message, protocol.Drop):
                client.dropped_evict = message.evict
            elif isinstance(message, protocol.Revoke):  # it kept the lock past the grace
                client.grant, client.dropped_evict = None, None
            elif isinstance(message, protocol.Evict):
                assert client.grant is None, "EVICT goes to clients that do not hold the lock"
                assert 0 < message.bytes <= client.on_device
                client.evict_asked = message.bytes
        for event in follow_ups:
            self.c.feed(event)
            self.observe()

    @rule(i=st.integers(0, 3))
    def acquire(self, i):
        client = self.clients[i % len(self.clients)]
        if client.waiting or client.grant is not None:
            return
        client.waiting = True
        self.queue.append(client)
        self.c.feed(AcquireRequest(self.c.now, client.key, DEV))
        self.observe()

    @rule(i=st.integers(0, 3), comply=st.booleans())
    def release(self, i, comply):
        """A holder releases: after a DROP, having moved what it was asked to (or not); or of
        its own accord (idle), keeping its memory."""
        client = self.clients[i % len(self.clients)]
        if client.grant is None:
            return
        if client.dropped_evict and comply:
            client.move_out(client.dropped_evict)
        grant, client.grant, client.dropped_evict = client.grant, None, None
        self.c.feed(ReleaseReport(self.c.now, client.key, DEV, grant, "drop", client.on_device))
        self.observe()

    @rule(i=st.integers(0, 3))
    def answer_evict(self, i):
        client = self.clients[i % len(self.clients)]
        if client.evict_asked is None:
            return
        client.move_out(client.evict_asked)
        client.evict_asked = None
        self.c.feed(EvictedReport(self.c.now, client.key, DEV, client.on_device))
        self.observe()

    @rule()
    def tick(self):
        deadline = self.c.core.next_deadline()
        if deadline is None or deadline > self.c.now + 100:
            return  # only the heartbeat timeout, which these clients never reach
        self.c.now = max(self.c.now, deadline)
        self.c.feed(Tick(self.c.now))
        self.observe()

    @invariant()
    def reports_match_the_truth(self):
        if not hasattr(self, "c"):
            return
        shown = {cl["client"]: cl["devices"][DEV] for cl in views.status(self.c.core, self.c.now, lambda t: t)["clients"]}
        for number, client in enumerate(self.clients, 1):
            # Never less than the truth: allocations not touched yet count in full.
            assert shown[f"c{number}"]["resident"] >= client.on_device
            assert shown[f"c{number}"]["swapped"] == client.moved_out

    @invariant()
    def the_lock_never_sits_idle_longer_than_the_grace(self):
        if not hasattr(self, "c"):
            return
        (dev,) = self.c.core.devices()
        if dev.queue and not dev.holders:
            assert dev.evict_awaited, "a waiter without a holder waits only for EVICTED answers"
            assert self.c.core.next_deadline() <= dev.evict_deadline <= self.c.now + self.grace

    @invariant()
    def every_evict_is_awaited_only_while_someone_waits(self):
        if not hasattr(self, "c"):
            return
        (dev,) = self.c.core.devices()
        assert not dev.evict_awaited or dev.queue


TestResidency = ResidencyMachine.TestCase
TestResidency.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_with_swapping_off_a_handoff_over_budget_moves_nothing():
    c = Cluster(budget=16 * GiB)
    c.core = SchedulerCore(CoreConfig(tq=1.0, grace=2.0, heartbeat_timeout=1e6, heartbeat_interval=1e5,
                                      swapping=False), c.now)
    c.join("a", 12 * GiB, 0)
    c.feed(AcquireRequest(c.now, "a", DEV))
    grant = c.grant_of("a")
    c.feed(MemoryReport(c.now, "a", DEV, 12 * GiB, 12 * GiB))
    c.join("b", 12 * GiB, 0)
    c.feed(AcquireRequest(c.now, "b", DEV))
    c.advance(1.0)
    assert c.sent(protocol.Drop, "a")[0].evict == 0
    c.feed(ReleaseReport(c.now, "a", DEV, grant.grant, "drop", 12 * GiB))
    assert c.grant_of("b").prefetch == 0 and not c.sent(protocol.Evict)
