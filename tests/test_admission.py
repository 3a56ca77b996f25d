"""Admission in the scheduler core (nvshare_py/scheduler/admission.py through SchedulerCore):
allocations wait instead of failing while the node's capacity is reserved, in the policy's order,
and every wait ends in ADMITTED or REFUSED (timeout, too-large)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nvshare_py import protocol
from nvshare_py.scheduler import views
from nvshare_py.scheduler.admission import CHUNK_MIN, AdmissionBook, AdmissionConfig, headroom
from nvshare_py.scheduler.core import ControlError, CoreConfig, SchedulerCore
from nvshare_py.scheduler.events import (
    AdmitRequest,
    ClientInfo,
    DeviceInfo,
    DeviceMeasured,
    LockEvent,
    MemoryReport,
    Register,
    Send,
    SetAdmission,
    SetBudget,
    SetLimit,
    Tick,
    Unregister,
)

GPU0 = "GPU-5151ad00-0000-4000-8000-000000000000"
GPU1 = "GPU-5151ad00-0000-4000-8000-000000000001"
MiB = 1 << 20
GiB = 1 << 30


def answers(actions, kind=None):
    sent = [(a.client, a.message) for a in actions if isinstance(a, Send)
            and isinstance(a.message, (protocol.Admitted, protocol.Refused))]
    return [item for item in sent if kind is None or isinstance(item[1], kind)]


class Node:
    """A core with admission on: devices of `budget` bytes as the daemon measured them, a host
    spill. Clients are of one user (uid 1000) unless registered with another `uid`; `share`
    1 (no quota) unless given."""

    def __init__(self, spill=4 * GiB, policy="fifo", timeout=60.0, devices=(GPU0,), budget=8 * GiB, share=1.0):
        self.now = 0.0
        # Clients never time out here: the tests are about admission, not liveness.
        config = CoreConfig(heartbeat_timeout=1e6, admission=AdmissionConfig(spill=spill, policy=policy,
                                                                             timeout=timeout, share=share))
        self.core = SchedulerCore(config, 0.0)
        self.devices = devices
        self.budget = budget
        self.requests = 0
        for device in devices:
            self.feed(DeviceMeasured(0.0, device, budget, "sim"))

    def feed(self, event):
        return self.core.handle(event)

    def register(self, key, uid=1000, pod_uid=""):
        info = ClientInfo(pid=100 + key, session=f"{key:016x}", host_pid=100 + key, uid=uid, pod_uid=pod_uid)
        actions = self.feed(Register(self.now, key, info))
        for device in self.devices:
            self.feed(DeviceInfo(self.now, key, device, self.budget, "sim"))
        return actions

    def admit(self, key, total, device=GPU0, request=None):
        if request is None:
            self.requests += 1
            request = self.requests
        return self.feed(AdmitRequest(self.now, key, device, request, total))

    def memory(self, key, used, device=GPU0):
        return self.feed(MemoryReport(self.now, key, device, used))

    def at(self, t):
        self.now = t
        return self.feed(Tick(t))


def test_welcome_says_the_scheduler_answers_admit():
    node = Node()
    (welcome,) = [a.message for a in node.register(1) if isinstance(a, Send)]
    assert welcome.admission is True
    assert b"admission=1" in welcome.encode()


def test_an_admit_that_fits_is_answered_at_once_with_a_chunk():
    node = Node()
    node.register(1)
    ((client, message),) = answers(node.admit(1, 100 * MiB))
    assert client == 1 and isinstance(message, protocol.Admitted)
    assert message.bytes == 100 * MiB + headroom(100 * MiB)  # a chunk ahead, so it need not ask again soon


def test_the_chunk_never_takes_what_the_capacity_lacks():
    node = Node(spill=0, budget=1 * GiB)
    node.register(1)
    ((_, message),) = answers(node.admit(1, 1 * GiB - MiB))
    assert message.bytes == 1 * GiB - MiB // 2  # half of what stays free, not asked + 64 MiB


def test_an_admit_past_the_capacity_waits_until_another_client_frees():
    node = Node(spill=0, budget=1 * GiB)
    node.register(1)
    node.register(2)
    node.admit(1, 800 * MiB)
    node.memory(1, 800 * MiB)
    actions = node.admit(2, 300 * MiB)
    assert answers(actions) == []
    assert any(isinstance(a, LockEvent) and a.kind == "admit-wait" for a in actions)
    waiting = views.admission_status(node.core, node.now, lambda t: t)["waiters"]
    assert [(w["client"], w["bytes"]) for w in waiting] == [("c2", 300 * MiB)]
    # Client 1 frees, and gives its admission back: client 2 goes on.
    node.memory(1, 100 * MiB)
    actions = node.admit(1, 100 * MiB, request=0)
    ((client, message),) = answers(actions)
    assert client == 2 and isinstance(message, protocol.Admitted) and message.bytes >= 300 * MiB


def test_a_client_leaving_admits_the_waiters():
    node = Node(spill=0, budget=1 * GiB)
    node.register(1)
    node.register(2)
    node.admit(1, 900 * MiB)
    node.admit(2, 500 * MiB)
    ((client, message),) = answers(node.feed(Unregister(node.now, 1, "exited")))
    assert client == 2 and isinstance(message, protocol.Admitted)


def test_more_than_the_whole_capacity_is_refused_at_once():
    node = Node(spill=1 * GiB, budget=2 * GiB)
    node.register(1)
    ((_, message),) = answers(node.admit(1, 3 * GiB + 1))
    assert isinstance(message, protocol.Refused) and message.reason == "too-large"


def test_a_wait_past_the_timeout_is_refused_and_the_deadline_is_announced():
    node = Node(spill=0, budget=1 * GiB, timeout=30.0)
    node.register(1)
    node.register(2)
    node.admit(1, 1 * GiB)
    node.now = 5.0
    node.admit(2, 10 * MiB)
    assert node.core.next_deadline() <= 35.0
    assert answers(node.at(34.0)) == []
    ((client, message),) = answers(node.at(35.0))
    assert client == 2 and isinstance(message, protocol.Refused) and message.reason == "timeout"


def test_a_bigger_budget_admits_the_waiters():
    node = Node(spill=0, budget=1 * GiB)
    node.register(1)
    node.register(2)
    node.admit(1, 1 * GiB)
    node.admit(2, 512 * MiB)
    ((client, _),) = answers(node.feed(SetBudget(node.now, GPU0, 2 * GiB)))
    assert client == 2


def test_turning_admission_off_admits_every_waiter():
    node = Node(spill=0, budget=1 * GiB)
    node.register(1)
    node.register(2)
    node.admit(1, 1 * GiB)
    node.admit(2, 512 * MiB)
    ((client, _),) = answers(node.feed(SetAdmission(node.now, spill=None, keep_spill=False)))
    assert client == 2
    assert views.admission_status(node.core, node.now, lambda t: t)["enabled"] is False


def test_bad_admission_settings_are_refused_before_anything_changes():
    node = Node()
    for event in (SetAdmission(0.0, policy="lifo"), SetAdmission(0.0, timeout=0.0),
                  SetAdmission(0.0, spill=-1, keep_spill=False)):
        with pytest.raises(ControlError):
            node.feed(event)
    assert node.core.admission == AdmissionConfig(spill=4 * GiB, timeout=60.0, share=1.0)


def test_fifo_keeps_the_order_and_nobody_overtakes_the_head():
    node = Node(spill=0, budget=1 * GiB)
    for key in (1, 2, 3):
        node.register(key)
    node.admit(1, 1 * GiB)
    node.admit(2, 600 * MiB)  # first in line
    node.admit(3, 100 * MiB)  # would fit sooner, but waits behind client 2
    node.memory(1, 500 * MiB)
    assert answers(node.admit(1, 500 * MiB, request=0)) == []  # 524 MiB free: not enough for the head
    node.memory(1, 200 * MiB)
    sent = answers(node.admit(1, 200 * MiB, request=0))  # 824 MiB free: both, in order
    assert [client for client, _ in sent] == [2, 3]


def test_best_fit_serves_the_waiter_closest_to_the_free_memory():
    node = Node(spill=0, budget=1 * GiB, policy="best-fit")
    for key in (1, 2, 3, 4):
        node.register(key)
    node.admit(1, 1 * GiB)
    node.admit(2, 100 * MiB)
    node.admit(3, 500 * MiB)
    node.admit(4, 700 * MiB)
    node.memory(1, 400 * MiB)
    sent = answers(node.admit(1, 400 * MiB, request=0))  # 600 MiB free
    assert [client for client, _ in sent] == [3, 2]  # 500 fits best, then 100 fits the rest


def test_recent_serves_the_last_to_ask():
    node = Node(spill=0, budget=1 * GiB, policy="recent")
    for key in (1, 2, 3):
        node.register(key)
    node.admit(1, 1 * GiB)
    node.admit(2, 600 * MiB)
    node.admit(3, 600 * MiB)
    node.memory(1, 0)
    sent = answers(node.admit(1, 0, request=0))
    assert [client for client, _ in sent][0] == 3


class AdmissionMachine(RuleBasedStateMachine):
    """Several clients ask, allocate, free and leave at random. The node's capacity is never
    exceeded by what is admitted and allocated, and every question is answered exactly once:
    admitted (at least what was asked) or refused (timeout / too-large), never lost."""

    CLIENTS = (1, 2, 3, 4)

    @initialize(policy=st.sampled_from(["fifo", "best-fit", "recent", "random"]),
                spill=st.sampled_from([0, 256 * MiB, 1 * GiB]))
    def setup(self, policy, spill):
        self.node = Node(spill=spill, policy=policy, timeout=20.0, budget=1 * GiB)
        self.capacity = 1 * GiB + spill
        self.policy = policy
        self.admitted = {}  # client -> admitted total it was told
        self.used = {}  # client -> what it allocated (it never passes its admitted total)
        self.pending = {}  # client -> (request, bytes, since): unanswered questions, in order asked
        self.present = set()
        self.answered = 0
        self.asked = 0
        self.dropped = 0
        self.order = []  # FIFO: the clients admitted after waiting, in answer order

    def _take(self, actions):
        for client, message in answers(actions):
            assert client in self.pending, f"an answer nobody waits for: {message}"
            request, total, since = self.pending.pop(client)
            assert message.request == request
            self.answered += 1
            if isinstance(message, protocol.Admitted):
                assert message.bytes >= total
                self.admitted[client] = message.bytes
                if self.policy == "fifo":
                    self.order.append(since)
            else:
                assert message.reason in ("timeout", "too-large")
                if message.reason == "too-large":
                    assert total > self.capacity

    @rule(client=st.sampled_from(CLIENTS))
    def join(self, client):
        if client in self.present:
            return
        self.present.add(client)
        self.node.register(client)

    @rule(client=st.sampled_from(CLIENTS), size=st.integers(1, 1536).map(lambda m: m * MiB))
    def allocate(self, client, size):
        """An allocation: within what was admitted it is made at once; past it, the client asks."""
        if client not in self.present or client in self.pending:
            return
        want = self.used.get(client, 0) + size
        if want <= self.admitted.get(client, 0):
            self.used[client] = want
            self.node.memory(client, want)
            return
        self.asked += 1
        self.node.requests += 1
        self.pending[client] = (self.node.requests, want, self.node.now)
        self._take(self.node.admit(client, want, request=self.node.requests))

    @rule(client=st.sampled_from(CLIENTS), fraction=st.floats(0, 1))
    def free(self, client, fraction):
        if client not in self.present:
            return
        used = self.used.get(client, 0)
        now = int(used * (1 - fraction))
        self.used[client] = now
        self._take(self.node.memory(client, now))
        admitted = self.admitted.get(client, 0)
        if admitted > now + headroom(now) and client not in self.pending:
            self.admitted[client] = now + headroom(now) // 2  # the client's give-back rule
            self._take(self.node.admit(client, self.admitted[client], request=0))

    @rule(client=st.sampled_from(CLIENTS))
    def leave(self, client):
        if client not in self.present:
            return
        self.present.discard(client)
        if self.pending.pop(client, None) is not None:
            self.dropped += 1  # its question dies with it
        self.admitted.pop(client, None)
        self.used.pop(client, None)
        self._take(self.node.feed(Unregister(self.node.now, client, "exited")))

    @rule(dt=st.floats(0.1, 15.0))
    def wait(self, dt):
        self.node.now += dt
        self._take(self.node.feed(Tick(self.node.now)))

    @invariant()
    def capacity_kept(self):
        held = sum(max(self.admitted.get(c, 0), self.used.get(c, 0)) for c in self.present)
        assert held <= self.capacity

    @invariant()
    def fifo_order_kept(self):
        assert self.order == sorted(self.order)

    @invariant()
    def no_question_outlives_its_timeout(self):
        deadline = self.node.core.next_deadline()
        for _, _, since in self.pending.values():
            assert deadline is not None and deadline <= since + 20.0

    def teardown(self):
        # Every question ends: after the timeout all pending ones are answered.
        if hasattr(self, "node"):
            self.node.now += 21.0
            self._take(self.node.feed(Tick(self.node.now)))
            assert self.pending == {}
            assert self.answered + self.dropped == self.asked


AdmissionMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_admission_never_exceeds_capacity_and_answers_every_question = AdmissionMachine.TestCase


def test_a_reconnected_client_starts_admission_afresh():
    """The same process registering again (same session) takes its pairs over: what the old
    connection was admitted, and its unanswered question, are not the new connection's."""
    node = Node(spill=0, budget=1 * GiB)
    node.register(1)
    node.register(2)
    node.admit(1, 900 * MiB)
    node.admit(2, 500 * MiB)  # waits
    info = ClientInfo(pid=102, session=f"{2:016x}", host_pid=102, uid=1000)
    node.feed(Register(node.now, 3, info))  # client 2's process, reconnected
    assert views.admission_status(node.core, node.now, lambda t: t)["waiters"] == []
    node.feed(Unregister(node.now, 1, "exited"))
    assert node.core.admission_reserved() == 0


# --- what no client can inflate or jam (issue 20) --------------------------------------------

INNOCENT, HOSTILE = 1000, 2000  # uids


def test_the_capacity_is_the_daemons_measurements_and_the_operators_never_a_clients_word():
    # Issue 20: a client raised the node's capacity from 52.6 GB to 4.6e18 (its DEVICE totals)
    # and had 1 TiB admitted.
    node = Node(spill=1 * GiB, budget=8 * GiB)
    node.register(1, uid=HOSTILE)
    node.feed(DeviceInfo(node.now, 1, GPU0, 1 << 62, "sim"))
    node.feed(DeviceInfo(node.now, 1, GPU1, 1 << 62, "sim"))  # a device the daemon did not measure
    assert node.core.admission_capacity() == 9 * GiB
    ((_, answer),) = answers(node.admit(1, 1 << 40))
    assert isinstance(answer, protocol.Refused) and answer.reason == "too-large"
    node.feed(SetBudget(node.now, GPU1, 2 * GiB))  # the operator sizes what the daemon cannot measure
    assert node.core.admission_capacity() == 11 * GiB


def test_no_user_holds_more_than_its_share_whatever_it_reports_or_asks():
    # Lying about memory, or reserving, made innocents' ADMITs time out. A user's claims count
    # up to its quota (share x capacity); a report counts up to the device's size.
    node = Node(spill=0, budget=8 * GiB, share=0.75)
    node.register(1, uid=HOSTILE)
    node.register(2, uid=HOSTILE)
    node.memory(1, 1 << 62)  # more than the device has: counts as 8 GiB
    node.memory(1, 1 << 62, device="GPU-unmeasured")
    assert node.core.admission_reserved() == 6 * GiB
    ((_, answer),) = answers(node.admit(2, 7 * GiB))  # more than the user may ever hold
    assert isinstance(answer, protocol.Refused) and answer.reason == "limit"
    node.register(3, uid=INNOCENT)
    ((client, answer),) = answers(node.admit(3, 2 * GiB))
    assert client == 3 and isinstance(answer, protocol.Admitted)  # at once: it waited for nobody
    assert node.core.admission_capacity() == 8 * GiB


def test_a_report_on_a_device_nobody_sized_fills_no_share_until_it_is_sized():
    # Issue 31: a use reported on a device the daemon had not measured (and no budget sized)
    # counted without bound, so one process filled its user's share and the user's other
    # processes waited. It counts nothing until the device is sized, then up to its size.
    node = Node(spill=0, budget=8 * GiB, share=0.75)  # capacity 8 GiB, a user's quota 6 GiB
    node.register(1, uid=HOSTILE)
    node.register(2, uid=HOSTILE)
    node.memory(1, 1 << 62, device=GPU1)
    assert node.core.admission_reserved() == 0
    ((client, answer),) = answers(node.admit(2, 2 * GiB))
    assert client == 2 and isinstance(answer, protocol.Admitted)  # at once: its user's share is free
    reserved = node.core.admission_reserved()
    node.feed(SetBudget(node.now, GPU1, 1 * GiB))  # sized by the operator: the report counts as 1 GiB
    assert node.core.admission_reserved() == reserved + 1 * GiB
    node.feed(DeviceMeasured(node.now, GPU1, 4 * GiB, "sim"))  # measured: up to its 4 GiB
    assert node.core.admission_reserved() == reserved + 4 * GiB


def test_a_user_asking_for_more_than_is_free_does_not_hold_back_those_holding_less():
    node = Node(spill=0, budget=8 * GiB, share=0.75)
    node.register(1, uid=INNOCENT)
    node.register(2, uid=HOSTILE)
    node.register(3, uid=INNOCENT)
    node.admit(1, 3 * GiB)  # admitted 3.75 GiB (a chunk ahead)
    assert answers(node.admit(2, 5 * GiB)) == []  # 4.25 GiB free: waits; its user would hold 5 GiB
    ((client, _),) = answers(node.admit(3, 1 * GiB))  # its user would hold 4.75 GiB: it goes first
    assert client == 3
    # ... but waiters of its own user, and richer ones, stay behind it (no starvation of the head).
    node.register(4, uid=HOSTILE)
    assert answers(node.admit(4, 512 * MiB)) == []


def test_an_admit_past_the_clients_limit_is_refused():
    # docs/protocol.md: REFUSED reason=limit; issue 20: it was admitted.
    node = Node(spill=0, budget=8 * GiB)
    node.register(1)
    node.feed(SetLimit(node.now, 1 * GiB, client="c1"))
    ((_, answer),) = answers(node.admit(1, 2 * GiB))
    assert isinstance(answer, protocol.Refused) and answer.reason == "limit"
    ((_, answer),) = answers(node.admit(1, 512 * MiB))
    assert isinstance(answer, protocol.Admitted)


def test_with_many_pairs_a_memory_report_does_not_walk_the_queue(monkeypatch):
    # Issue 20: with 19,200 (client, device) pairs and a stream of memory reports, each admission
    # decision took about 10 ms (every report summed every pair). Totals are kept as they change,
    # and the queue is looked at only when memory was freed or capacity grew.
    node = Node(spill=0, budget=1 * GiB, devices=(GPU0,))
    for key in range(1, 301):
        node.register(key, uid=key)
        for n in range(64):
            node.memory(key, 1, device=f"GPU-other-{n}")
    node.admit(1, 1 * GiB - 1 * MiB)
    for key in range(2, 101):
        node.admit(key, 512 * MiB)  # 99 waiters
    walks = []
    walk = AdmissionBook._walk
    monkeypatch.setattr(AdmissionBook, "_walk", lambda book, lone: walks.append(1) or walk(book, lone))
    for used in range(2, 200):
        node.memory(200, used, device="GPU-other-0")  # a growing use frees nothing
    assert walks == []
    node.memory(1, 0)
    node.admit(1, 0, request=0)  # a give-back frees memory: now the queue is looked at
    assert walks


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["report", "ask", "give", "forget", "reset", "capacity", "settle"]),
                                st.integers(0, 5), st.integers(0, 2), st.integers(0, 4 * GiB)), max_size=60),
       share=st.sampled_from([0.5, 0.75, 1.0]))
def test_the_totals_kept_as_they_change_are_the_totals(steps, share):
    """AdmissionBook's incremental holdings and reserved total equal a count from scratch."""
    book: AdmissionBook[int] = AdmissionBook(AdmissionConfig(spill=0, share=share))
    book.set_capacity(8 * GiB)
    principal_of: dict[int, int] = {}
    now = 0.0
    for kind, pair, principal, amount in steps:
        now += 1.0
        principal = principal_of.setdefault(pair, principal)  # a pair's user does not change
        if kind == "report":
            book.report(pair, principal, amount)
        elif kind == "ask":
            book.ask(pair, principal, 1, amount, now)
        elif kind == "give":
            book.ask(pair, principal, 0, amount, now)
        elif kind == "forget":
            book.forget(pair)
            principal_of.pop(pair)
        elif kind == "reset":
            book.reset(pair)
        elif kind == "capacity":
            book.set_capacity(amount)
        else:
            book.settle(now)
        holdings: dict[int, int] = {}
        for known, user in principal_of.items():
            holdings[user] = holdings.get(user, 0) + book.reservation(known)
        assert book.reserved == sum(min(held, book.quota) for held in holdings.values())
        assert all(book.holding(user) == held for user, held in holdings.items())
