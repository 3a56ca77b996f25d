"""Admission through both cores on virtual time (tests/fixtures/client_core.py): the client core
(interceptor/client_core.c) asks before an allocation crosses its admitted total and lets the
blocked thread go on ADMITTED or fail it on REFUSED; the scheduler's core answers. The world
checks on every step that no process uses more than it was admitted."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fixtures.client_core import World, build_client_core, load
from nvshare_py.scheduler.admission import CHUNK_MIN, AdmissionConfig, headroom

MiB = 1 << 20
GiB = 1 << 30
TOTAL = 1 << 34  # what the fixture's devices report (16 GiB): the budget


def admitting_world(lib, spill=0, timeout=30.0, policy="fifo"):
    return World(lib, tq=1.0, grace=0.5, heartbeat=0.2, heartbeat_timeout=1.0, idle_release=10.0,
                 admission=AdmissionConfig(spill=spill, policy=policy, timeout=timeout))


def test_an_allocation_within_the_chunk_does_not_ask_again(client_core_lib):
    world = admitting_world(client_core_lib)
    a = world.spawn("a")
    world.allocate(a, 10 * MiB)  # the first asks: the process registered with nothing admitted
    assert a.devices[0].used == 10 * MiB and a.devices[0].blocked == []
    assert a.devices[0].admitted == 10 * MiB + headroom(10 * MiB)
    asked = a.devices[0].admitted
    for _ in range(5):
        world.allocate(a, 10 * MiB)
    assert a.devices[0].admitted == asked  # 60 MiB fit the 74 MiB admitted: no round trip


def test_a_blocked_allocation_resumes_when_another_process_frees(client_core_lib):
    world = admitting_world(client_core_lib)
    a, b = world.spawn("a"), world.spawn("b")
    world.allocate(a, TOTAL - 1 * GiB)
    world.allocate(b, 2 * GiB)  # 1 GiB short: b's thread blocks
    assert b.devices[0].blocked == [2 * GiB] and b.devices[0].used == 0
    world.advance(1.0)
    assert b.devices[0].blocked == [2 * GiB]  # still waiting, not failed
    world.free(a, 4 * GiB)
    world.advance(0.5)  # a's give-back goes out with its next report
    assert b.devices[0].blocked == [] and b.devices[0].used == 2 * GiB
    assert b.devices[0].allocations_resumed == 1 and b.devices[0].allocations_failed == 0


def test_more_than_the_whole_capacity_fails_at_once_and_the_process_goes_on(client_core_lib):
    world = admitting_world(client_core_lib, spill=1 * GiB)
    a = world.spawn("a")
    world.allocate(a, TOTAL + 2 * GiB)
    assert a.devices[0].allocations_failed == 1 and a.devices[0].used == 0
    assert any("too-large" in text for _, text in a.logs)
    world.allocate(a, 1 * GiB)  # the next, smaller allocation is admitted
    assert a.devices[0].used == 1 * GiB


def test_a_wait_past_the_timeout_fails_with_a_log_line(client_core_lib):
    world = admitting_world(client_core_lib, timeout=5.0)
    a, b = world.spawn("a"), world.spawn("b")
    world.allocate(a, TOTAL)
    world.allocate(b, 1 * GiB)
    world.advance(4.0)
    assert b.devices[0].blocked == [1 * GiB]
    world.advance(2.0)
    assert b.devices[0].blocked == [] and b.devices[0].allocations_failed == 1
    assert any("timeout" in text for _, text in b.logs)


def test_without_a_scheduler_nothing_waits(client_core_lib):
    world = admitting_world(client_core_lib)
    world.scheduler = None
    a = world.spawn("a", fail_open=True)
    world.advance(5.0)
    world.allocate(a, 2 * TOTAL)
    assert a.devices[0].used == 2 * TOTAL and a.devices[0].blocked == []


def test_losing_the_scheduler_lets_blocked_allocations_go_on(client_core_lib):
    world = admitting_world(client_core_lib)
    a, b = world.spawn("a", fail_open=True), world.spawn("b", fail_open=True)
    world.allocate(a, TOTAL)
    world.allocate(b, 1 * GiB)
    assert b.devices[0].blocked == [1 * GiB]
    world.scheduler = None
    world.processes[1].core.disconnected("the scheduler closed the connection", world.now)
    world.run(b)
    assert b.devices[0].blocked == [] and b.devices[0].used == 1 * GiB


def test_a_freed_process_gives_admission_back(client_core_lib):
    world = admitting_world(client_core_lib)
    a = world.spawn("a")
    world.allocate(a, 8 * GiB)
    world.free(a, 8 * GiB - 1 * MiB)
    world.advance(0.5)
    assert a.devices[0].admitted == 1 * MiB + CHUNK_MIN // 2
    assert world.scheduler.admission_reserved() == 1 * MiB + CHUNK_MIN // 2


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return load(build_client_core(tmp_path_factory.mktemp("client_core_admission")))


class Allocating(RuleBasedStateMachine):
    """Three processes allocate and free at random against a 16 GiB device and 4 GiB of spill.
    Nobody ever holds more than it was admitted, the node's total stays within its capacity, and
    every blocked allocation ends: resumed or failed (timeout, too-large), never lost."""

    lib = None
    CAPACITY = TOTAL + 4 * GiB

    def __init__(self) -> None:
        super().__init__()
        self.world = admitting_world(self.lib, spill=4 * GiB, timeout=3.0)
        self.processes = [self.world.spawn(name) for name in ("a", "b", "c")]
        self.allocations = 0

    @rule(pick=st.integers(0, 2), size=st.sampled_from([1 * MiB, 100 * MiB, 3 * GiB, 9 * GiB, 24 * GiB]))
    def allocate(self, pick, size):
        self.allocations += 1
        self.world.allocate(self.processes[pick], size)

    @rule(pick=st.integers(0, 2), fraction=st.sampled_from([0.25, 0.5, 1.0]))
    def free(self, pick, fraction):
        process = self.processes[pick]
        self.world.free(process, int(process.devices[0].used * fraction))

    @rule(seconds=st.sampled_from([0.05, 0.3, 1.0, 2.0]))
    def advance(self, seconds):
        self.world.advance(seconds)

    @invariant()
    def within_capacity(self):
        assert sum(p.devices[0].used for p in self.processes) <= self.CAPACITY

    def teardown(self):
        self.world.advance(4.0)  # past the timeout: every blocked allocation has ended
        devices = [p.devices[0] for p in self.processes]
        assert all(dev.blocked == [] for dev in devices)
        ended = sum(dev.allocations_made + dev.allocations_resumed + dev.allocations_failed for dev in devices)
        assert ended == self.allocations


def test_allocations_never_exceed_capacity_and_none_is_lost(lib):
    Allocating.lib = lib
    runner = Allocating.TestCase
    runner.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])
    runner().runTest()
