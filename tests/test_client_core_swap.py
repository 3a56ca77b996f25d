"""Swapping in the client core (interceptor/client_core.c; docs/protocol.md "Residency",
docs/interceptor.md "Swapping"): a DROP with evict= moves memory out between the drain and the
RELEASE, a GRANT after swapping opens the gate only once its prefetch is done, an EVICT makes a
process that does not hold the device move memory out and answer EVICTED; RELEASE and MEMORY
say what stays resident. When nothing was swapped, nothing changes: no job, the same messages.

The scheduler's residency rules are not in its core yet: the world (tests/fixtures/client_core.py,
World(swap=True)) adds evict=/prefetch= to the DROPs and GRANTs the scheduler core sends, and the
tests send EVICT themselves."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from nvshare_py.client_core import NO_LIMIT
from fixtures.client_core import (ACT_GATE, ACT_JOB, ACT_POOL, ACT_POOL_NEED, ACT_SEND, ACT_SWAP_AREA, ACT_SWAP_OUT_CUT, HOLDING, IDLE,
                                  JOB_DRAIN, JOB_PREFETCH, JOB_PREFETCH_AHEAD, JOB_PROBE, JOB_SWAP_OUT,
                                  RESULT_DEFERRED, RESULT_DRAINED, RESULT_MOVED, ClientCore, World,
                                  build_client_core, load)
from test_client_core_stateful import DEVICES, Sharing

GIB = 1 << 30
DEVICE = "GPU-00000000-0000-0000-0000-000000000000"


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return load(build_client_core(tmp_path_factory.mktemp("client_core_swap")))


# --- one core, driven message by message --------------------------------------------------


class Script:
    """A registered core holding nothing yet, with `used` bytes allocated on device 0."""

    def __init__(self, lib, used: int, converted: bool = True, idle_release_ms: int = 0) -> None:
        self.core = ClientCore(lib, 4242, "00000000000000aa")
        self.core.add_device(0, DEVICE)
        self.used, self.swapped, self.captures, self.waiters = used, 0, 0, 0
        self.converted = used if converted else 0
        self.now = 10.0
        self.observe()
        self.core.tick(self.now)       # CONNECT
        self.core.connected(self.now)  # HELLO
        self.registration = self.receive("WELCOME", client="c1", heartbeat_ms=1000,
                                        idle_release_ms=idle_release_ms, version=1)

    def observe(self) -> None:
        self.core.observe(0, self.waiters, self.captures, 0, self.used, self.converted, self.swapped)

    def receive(self, kind: str, **fields) -> list:
        self.observe()
        text = f"NVSHARE/1 {kind}" + "".join(f"\n{k}={v}" for k, v in fields.items())
        self.core.receive(text.encode(), self.now)
        return self.actions()

    def job_done(self, result: int) -> list:
        self.observe()
        self.core.job_done(0, result, self.now)
        return self.actions()

    def actions(self) -> list:
        return self.core.pop(self.now)

    def want(self) -> list:
        self.waiters = 1
        self.observe()
        self.core.tick(self.now)
        return self.actions()


def sent(actions) -> list[str]:
    return [a.data.decode() for a in actions if a.kind == ACT_SEND]


def jobs(actions) -> list[tuple[int, int]]:
    return [(a.value, a.bytes) for a in actions if a.kind == ACT_JOB]


def gates(actions) -> list[int]:
    return [a.value for a in actions if a.kind == ACT_GATE]


def granted(script: Script, grant: int = 1, **extra) -> list:
    script.want()
    actions = script.receive("GRANT", device=DEVICE, grant=grant, mode="on", exclusive=1, quantum_ms=1000, **extra)
    script.waiters = 0  # the thread passes once the gate opens
    return actions


def test_a_drop_with_evict_moves_memory_out_after_the_drain_and_before_the_release(lib):
    s = Script(lib, used=8 * GIB)
    assert gates(granted(s)) == [1]
    actions = s.receive("DROP", device=DEVICE, grant=1, grace_ms=500, reason="quantum", evict=6 * GIB)
    assert gates(actions) == [0] and jobs(actions) == [(JOB_DRAIN, 0)]
    actions = s.job_done(RESULT_DRAINED)
    assert jobs(actions) == [(JOB_SWAP_OUT, 6 * GIB)] and not sent(actions)  # no RELEASE before the move
    s.swapped = 6 * GIB
    [release] = [m for m in sent(s.job_done(RESULT_MOVED)) if "RELEASE" in m]
    assert release.splitlines()[1:] == [f"device={DEVICE}", "grant=1", "reason=drop", f"resident={2 * GIB}"]
    assert s.core.state(0) == IDLE


def test_a_swap_out_waits_for_a_capture_to_end(lib):
    s = Script(lib, used=GIB)
    granted(s)
    s.receive("DROP", device=DEVICE, grant=1, grace_ms=500, reason="quantum", evict=GIB)
    assert jobs(s.job_done(RESULT_DRAINED)) == [(JOB_SWAP_OUT, GIB)]
    s.captures = 1  # a capture began before the worker could move anything
    assert not sent(s.job_done(RESULT_DEFERRED))
    s.core.tick(s.now)
    assert jobs(s.actions()) == []  # not while the capture runs
    s.captures = 0
    s.observe()
    s.core.tick(s.now)
    assert jobs(s.actions()) == [(JOB_SWAP_OUT, GIB)]
    s.swapped = GIB
    assert any(m.endswith("resident=0") for m in sent(s.job_done(RESULT_MOVED)))


def test_a_drop_without_evict_releases_as_before(lib):
    s = Script(lib, used=GIB)
    granted(s)
    s.receive("DROP", device=DEVICE, grant=1, grace_ms=500, reason="quantum")
    actions = s.job_done(RESULT_DRAINED)
    assert jobs(actions) == []
    [release] = sent(actions)
    assert "resident" not in release


def test_a_grant_after_swapping_opens_the_gate_after_its_prefetch(lib):
    s = Script(lib, used=8 * GIB)
    s.swapped = 8 * GIB
    actions = granted(s, prefetch=4 * GIB)
    assert jobs(actions) == [(JOB_PREFETCH, 4 * GIB)] and gates(actions) == []
    assert s.core.state(0) == HOLDING and not s.core.gate(0)
    s.swapped = 0
    actions = s.job_done(RESULT_MOVED)
    assert gates(actions) == [1]
    memory = [m for m in sent(actions) if "MEMORY" in m]
    assert memory == [f"NVSHARE/1 MEMORY\ndevice={DEVICE}\nused={8 * GIB}\nresident={8 * GIB}"]  # all back, at once


def test_a_grant_opens_the_gate_at_once_when_nothing_was_swapped(lib):
    s = Script(lib, used=8 * GIB)
    actions = granted(s, prefetch=8 * GIB)
    assert jobs(actions) == [] and gates(actions) == [1]


def test_a_grant_during_a_capture_still_brings_memory_back_before_the_gate_opens(lib):
    """The swap area's bytes are nowhere else: a capture does not skip the grant's PREFETCH. What
    it must leave for the capture's end (VMM memory, DEFERRED) keeps the gate closed until then."""
    s = Script(lib, used=GIB)
    s.swapped = GIB
    s.captures = 1
    assert jobs(granted(s, prefetch=GIB)) == [(JOB_PREFETCH, GIB)]
    actions = s.job_done(RESULT_DEFERRED)
    assert gates(actions) == [] and jobs(actions) == []
    s.core.tick(s.now)
    assert jobs(s.actions()) == []  # not while the capture runs
    s.captures = 0
    s.observe()
    s.core.tick(s.now)
    assert jobs(s.actions()) == [(JOB_PREFETCH, GIB)]
    s.swapped = 0
    assert gates(s.job_done(RESULT_MOVED)) == [1]


def test_a_drop_during_the_prefetch_drains_after_it(lib):
    s = Script(lib, used=GIB)
    s.swapped = GIB
    granted(s, prefetch=GIB)
    actions = s.receive("DROP", device=DEVICE, grant=1, grace_ms=500, reason="quantum", evict=GIB)
    assert jobs(actions) == []  # the worker is busy with the prefetch
    s.swapped = 0
    actions = s.job_done(RESULT_MOVED)
    assert gates(actions) == [] and jobs(actions) == [(JOB_DRAIN, 0)]


def test_a_grant_named_again_during_an_idle_probe_that_releases_starts_no_prefetch(lib):
    """A re-registered holder hears its GRANT again while an idle probe runs; the probe finds it
    idle and releases: the grant's swap work ends with it, no prefetch for a device not held."""
    s = Script(lib, used=GIB, idle_release_ms=100)
    granted(s)
    s.now += 1.0
    s.core.tick(s.now)
    assert [job for job, _ in jobs(s.actions())] == [JOB_PROBE]
    assert jobs(s.receive("GRANT", device=DEVICE, grant=1, mode="on", exclusive=1, quantum_ms=1000)) == []
    s.swapped = GIB  # as if a capture had made an earlier grant skip its prefetch
    actions = s.job_done(RESULT_DRAINED)
    assert any("reason=idle" in m for m in sent(actions))
    assert jobs(actions) == [] and s.core.state(0) == IDLE


def test_evict_makes_a_waiting_process_move_memory_and_answer(lib):
    s = Script(lib, used=4 * GIB)
    s.want()
    actions = s.receive("EVICT", device=DEVICE, bytes=3 * GIB)
    assert jobs(actions) == [(JOB_SWAP_OUT, 3 * GIB)]
    s.swapped = 3 * GIB
    assert sent(s.job_done(RESULT_MOVED)) == [f"NVSHARE/1 EVICTED\ndevice={DEVICE}\nresident={GIB}"]


def test_a_prefetch_during_an_evicts_move_cuts_it_and_brings_back_what_left(lib):
    """The scheduler takes an EVICT back with a PREFETCH (the process asked for the device while
    its memory moved out): the running move is cut, EVICTED says what stayed, and what left
    before the cut comes back ahead of the grant."""
    s = Script(lib, used=4 * GIB)
    assert jobs(s.receive("EVICT", device=DEVICE, bytes=4 * GIB)) == [(JOB_SWAP_OUT, 4 * GIB)]
    s.want()
    actions = s.receive("PREFETCH", device=DEVICE, resident=4 * GIB)
    assert [(a.kind, a.device) for a in actions if a.kind == ACT_SWAP_OUT_CUT] == [(ACT_SWAP_OUT_CUT, 0)]
    assert jobs(actions) == [] and sent(actions) == []  # the move ends first, then it answers
    s.swapped = GIB  # what had left when the cut took effect
    actions = s.job_done(RESULT_MOVED)
    assert f"NVSHARE/1 EVICTED\ndevice={DEVICE}\nresident={3 * GIB}" in sent(actions)
    assert jobs(actions) == [(JOB_PREFETCH_AHEAD, GIB)]


def test_an_application_that_allocates_while_its_memory_moves_out_asks_for_the_device(lib):
    """On an H200 a tenant's request came while its memory moved out for an EVICT, and its
    first GPU call came 1.1-5.3 s later: its own eviction held the process's memory map and the
    driver, so the ACQUIRE that takes the EVICT back waited for the move. The request's first
    allocations come before that: the process asks for the device at the first one, with no
    thread at the gate yet. Without an allocation (the move itself allocates nothing) it asks for
    nothing."""
    s = Script(lib, used=4 * GIB)
    assert jobs(s.receive("EVICT", device=DEVICE, bytes=4 * GIB)) == [(JOB_SWAP_OUT, 4 * GIB)]
    s.swapped = GIB
    s.observe()
    s.core.tick(s.now)
    assert not [m for m in sent(s.actions()) if "ACQUIRE" in m]  # moving out is no asking
    s.used += 2 << 20  # the request's first tensor
    s.observe()
    s.core.tick(s.now)
    assert [m for m in sent(s.actions()) if "ACQUIRE" in m] == [f"NVSHARE/1 ACQUIRE\ndevice={DEVICE}"]
    actions = s.receive("PREFETCH", device=DEVICE, resident=s.used)  # the scheduler takes the EVICT back
    assert [(a.kind, a.device) for a in actions if a.kind == ACT_SWAP_OUT_CUT] == [(ACT_SWAP_OUT_CUT, 0)]
    s.used -= 2 << 20
    s.want()  # its kernel reaches the gate: no second ACQUIRE
    assert not [m for m in sent(s.actions()) if "ACQUIRE" in m]


def test_a_prefetch_before_an_evicts_move_began_answers_it_and_nothing_moves(lib):
    """The move waited for a capture's end when the EVICT was taken back: it is answered at once
    with everything still there, and the capture's end moves nothing."""
    s = Script(lib, used=4 * GIB)
    s.want()
    s.captures = 1
    assert jobs(s.receive("EVICT", device=DEVICE, bytes=GIB)) == []  # after the capture
    actions = s.receive("PREFETCH", device=DEVICE, resident=4 * GIB)
    assert sent(actions) == [f"NVSHARE/1 EVICTED\ndevice={DEVICE}\nresident={4 * GIB}"]
    assert not [a for a in actions if a.kind == ACT_SWAP_OUT_CUT]
    s.captures = 0
    s.observe()
    s.core.tick(s.now)
    assert jobs(s.actions()) == []


def test_a_prefetch_with_no_move_under_way_cuts_nothing(lib):
    s = Script(lib, used=4 * GIB)
    s.want()
    actions = s.receive("PREFETCH", device=DEVICE, resident=4 * GIB)
    assert not [a for a in actions if a.kind == ACT_SWAP_OUT_CUT]


def test_evict_of_a_held_device_is_answered_at_once(lib):
    s = Script(lib, used=4 * GIB)
    granted(s)
    actions = s.receive("EVICT", device=DEVICE, bytes=GIB)
    assert jobs(actions) == []
    assert sent(actions) == [f"NVSHARE/1 EVICTED\ndevice={DEVICE}\nresident={4 * GIB}"]


def test_a_grant_during_an_evict_waits_for_the_swap_out_then_prefetches(lib):
    s = Script(lib, used=4 * GIB)
    s.want()
    s.receive("EVICT", device=DEVICE, bytes=4 * GIB)
    actions = s.receive("GRANT", device=DEVICE, grant=1, mode="on", exclusive=1, quantum_ms=1000, prefetch=4 * GIB)
    assert gates(actions) == [] and jobs(actions) == []
    s.swapped = 4 * GIB
    actions = s.job_done(RESULT_MOVED)
    assert any("EVICTED" in m for m in sent(actions))
    assert jobs(actions) == [(JOB_PREFETCH, 4 * GIB)] and gates(actions) == []
    s.swapped = 0
    assert gates(s.job_done(RESULT_MOVED)) == [1]


def test_a_grant_while_a_capture_holds_back_an_evict_answers_it_and_never_moves_under_the_gate(lib):
    """An EVICT whose swap-out waits for a capture's end, then a GRANT (the scheduler's evict
    wait ran out, or a gang's turn): the holder answers EVICTED with what stays and opens the
    gate; the capture's end moves nothing under the open gate."""
    s = Script(lib, used=4 * GIB)
    s.want()
    s.captures = 1
    assert jobs(s.receive("EVICT", device=DEVICE, bytes=GIB)) == []  # after the capture
    actions = s.receive("GRANT", device=DEVICE, grant=1, mode="on", exclusive=1, quantum_ms=1000)
    assert sent(actions) == [f"NVSHARE/1 EVICTED\ndevice={DEVICE}\nresident={4 * GIB}"]
    assert gates(actions) == [1]
    s.captures = 0
    s.observe()
    s.core.tick(s.now)
    assert jobs(s.actions()) == []


def test_memory_reports_say_what_is_resident_once_memory_is_converted(lib):
    s = Script(lib, used=GIB)
    [memory] = [m for m in sent(s.registration + s.want()) if "MEMORY" in m]
    assert memory == f"NVSHARE/1 MEMORY\ndevice={DEVICE}\nused={GIB}\nresident={GIB}"


def test_a_process_without_converted_memory_sends_memory_as_before(lib):
    s = Script(lib, used=GIB, converted=False)  # NVSHARE_MANAGED=0: nothing it has can be swapped
    [memory] = [m for m in sent(s.registration + s.want()) if "MEMORY" in m]
    assert memory == f"NVSHARE/1 MEMORY\ndevice={DEVICE}\nused={GIB}"


# --- pipelined handoffs (issue 18) ------------------------------------------------------------


def test_prepare_asks_the_shell_for_a_swap_area(lib):
    s = Script(lib, used=8 * GIB)
    s.want()  # announced
    actions = s.receive("PREPARE", device=DEVICE, bytes=6 * GIB)
    assert [(a.device, a.bytes) for a in actions if a.kind == ACT_SWAP_AREA] == [(0, 6 * GIB)]


def test_pool_asks_the_shell_to_size_the_shared_swap_pool_for_the_whole_process(lib):
    """POOL names no device: the shell sizes its user's pool (docs/interceptor.md, *Swapping*),
    whichever devices the process uses, also before it announced any; POOL 0 says none is needed."""
    s = Script(lib, used=8 * GIB)
    actions = s.receive("POOL", bytes=12 * GIB)
    assert [(a.device, a.bytes) for a in actions if a.kind == ACT_POOL] == [(-1, 12 * GIB)]
    assert not [a for a in actions if a.kind == ACT_SWAP_AREA]
    assert [(a.device, a.bytes) for a in s.receive("POOL", bytes=0) if a.kind == ACT_POOL] == [(-1, 0)]


def test_pool_need_caps_what_the_shell_registers_of_others_segments(lib):
    """POOL need= (issue 29): registering another member's segment holds up the process's GPU
    calls, so a tenant late in eviction order (asked every second) registers segments only for
    what it may be asked to move out soon. A scheduler that says nothing leaves no cap (all the
    process has), as before need= existed."""
    s = Script(lib, used=8 * GIB)
    actions = s.receive("POOL", bytes=12 * GIB, need=2 * GIB)
    assert [(a.kind, a.device, a.bytes) for a in actions if a.kind in (ACT_POOL, ACT_POOL_NEED)] == [
        (ACT_POOL, -1, 12 * GIB), (ACT_POOL_NEED, -1, 2 * GIB)]
    actions = s.receive("POOL", bytes=12 * GIB, need=0)
    assert [a.bytes for a in actions if a.kind == ACT_POOL_NEED] == [0]
    actions = s.receive("POOL", bytes=12 * GIB)  # an older scheduler
    assert [a.bytes for a in actions if a.kind == ACT_POOL_NEED] == [NO_LIMIT]


def test_memory_reports_say_what_the_swap_engine_is_and_has_ready(lib):
    s = Script(lib, used=GIB)
    assert "engine" not in [m for m in sent(s.registration) if "MEMORY" in m][-1]  # nothing known yet
    s.core.observe_swap(engine=1, area=512 << 20, out_bps=52 * 10**9, in_bps=51 * 10**9)
    [memory] = [m for m in sent(s.want()) if "MEMORY" in m]  # the engine is known: reported
    assert memory.splitlines()[1:] == [f"device={DEVICE}", f"used={GIB}", f"resident={GIB}", "engine=copy",
                                       f"area={512 << 20}", f"out_bps={52 * 10**9}", f"in_bps={51 * 10**9}"]


def test_a_waiter_told_to_prefetch_brings_memory_back_with_its_gate_closed(lib):
    s = Script(lib, used=8 * GIB)
    s.swapped = 6 * GIB
    s.want()
    actions = s.receive("PREFETCH", device=DEVICE, resident=5 * GIB)
    assert jobs(actions) == [(JOB_PREFETCH_AHEAD, 3 * GIB)] and gates(actions) == []
    s.swapped = 4 * GIB
    # its progress is reported as it goes, without waiting for the reports' period
    s.observe()
    s.core.tick(s.now)
    assert [m for m in sent(s.actions()) if f"resident={4 * GIB}" in m]
    s.swapped = 3 * GIB
    assert gates(s.job_done(RESULT_MOVED)) == [] and s.core.state(0) != HOLDING
    # more room: asked again
    assert jobs(s.receive("PREFETCH", device=DEVICE, resident=8 * GIB)) == [(JOB_PREFETCH_AHEAD, 3 * GIB)]


def test_the_last_piece_of_a_move_is_reported_when_the_job_ends_not_at_the_next_report_period(lib):
    """The scheduler grants a waiter once its memory is back: the MEMORY that says so goes when
    the move ends. Before, a report sent while the job ran put the last one off by the report
    period (0.1 s), and on an H200 cold requests waited that long between their memory's return
    and their grant."""
    s = Script(lib, used=8 * GIB)
    s.swapped = 6 * GIB
    s.want()
    assert jobs(s.receive("PREFETCH", device=DEVICE, resident=8 * GIB)) == [(JOB_PREFETCH_AHEAD, 6 * GIB)]
    s.swapped = GIB
    s.observe()
    s.core.tick(s.now)
    assert [m for m in sent(s.actions()) if f"resident={7 * GIB}" in m]  # progress, as it goes
    s.swapped = 0  # the last piece lands as the job ends, in the same instant
    assert [m for m in sent(s.job_done(RESULT_MOVED)) if f"resident={8 * GIB}" in m]


def test_prefetches_told_while_a_prefetch_ahead_runs_are_filled_when_it_ends(lib):
    """The old holder's swap-out reports its progress every piece, and each report lets the
    waiter bring in more: PREFETCHes come faster than the worker's jobs end. What they allowed
    while a job ran is brought in next, not forgotten until the grant."""
    s = Script(lib, used=8 * GIB)
    s.swapped = 6 * GIB
    s.want()
    assert jobs(s.receive("PREFETCH", device=DEVICE, resident=3 * GIB)) == [(JOB_PREFETCH_AHEAD, GIB)]
    assert jobs(s.receive("PREFETCH", device=DEVICE, resident=4 * GIB)) == []  # the worker is busy
    assert jobs(s.receive("PREFETCH", device=DEVICE, resident=6 * GIB)) == []
    s.swapped = 5 * GIB
    assert jobs(s.job_done(RESULT_MOVED)) == [(JOB_PREFETCH_AHEAD, 3 * GIB)]
    s.swapped = 2 * GIB
    # nothing more was allowed meanwhile: done until a PREFETCH says more
    assert jobs(s.job_done(RESULT_MOVED)) == []
    assert jobs(s.receive("PREFETCH", device=DEVICE, resident=7 * GIB)) == [(JOB_PREFETCH_AHEAD, GIB)]


def test_a_prefetch_ahead_that_could_not_fill_its_room_is_not_started_again(lib):
    s = Script(lib, used=8 * GIB)
    s.swapped = 6 * GIB
    s.want()
    assert jobs(s.receive("PREFETCH", device=DEVICE, resident=3 * GIB)) == [(JOB_PREFETCH_AHEAD, GIB)]
    s.swapped = 5 * GIB + 1024  # the last block did not fit the room
    assert jobs(s.job_done(RESULT_MOVED)) == []
    s.core.tick(s.now + 1)
    assert jobs(s.actions()) == []


def test_a_holder_ignores_prefetch(lib):
    s = Script(lib, used=8 * GIB)
    granted(s)
    s.swapped = GIB
    assert jobs(s.receive("PREFETCH", device=DEVICE, resident=8 * GIB)) == []


def test_a_pre_drain_moves_out_what_contended_announced_before_its_release(lib):
    """CONTENDED evict=: the drain ahead of the quantum's end moves that much out before the
    RELEASE (which says what stays), and starts early enough to cover the move at the measured
    bandwidth."""
    s = Script(lib, used=8 * GIB)
    s.core.observe_swap(engine=1, out_bps=4 * GIB, in_bps=4 * GIB)  # 1.5 s for 6 GiB
    s.want()
    s.receive("GRANT", device=DEVICE, grant=1, mode="on", exclusive=1, quantum_ms=30_000)
    s.waiters = 0
    s.receive("CONTENDED", device=DEVICE, grant=1, quantum_left_ms=10_000, evict=6 * GIB)
    s.now += 10.0 - 1.2 * 1.5 - 0.02 - 0.01
    s.core.tick(s.now)
    assert jobs(s.actions()) == []  # not yet: the move's lead is 1.2 x 1.5 s + 20 ms
    s.now += 0.02
    s.core.tick(s.now)
    actions = s.actions()
    assert gates(actions) == [0] and jobs(actions) == [(JOB_DRAIN, 0)]
    assert jobs(s.job_done(RESULT_DRAINED)) == [(JOB_SWAP_OUT, 6 * GIB)]
    s.swapped = 6 * GIB
    [release] = [m for m in sent(s.job_done(RESULT_MOVED)) if "RELEASE" in m]
    assert release.splitlines()[1:] == [f"device={DEVICE}", "grant=1", "reason=quantum", f"resident={2 * GIB}"]


def test_while_others_wait_an_idle_pause_shorter_than_the_handoff_keeps_the_lock(lib):
    """CONTENDED idle_ms= (what the handoff would cost) lengthens the idle window: a pause of 1 s
    releases nothing when the handoff costs 3 s."""
    s = Script(lib, used=8 * GIB, idle_release_ms=500)
    granted(s)
    s.receive("CONTENDED", device=DEVICE, grant=1, quantum_left_ms=600_000, idle_ms=3000)
    for _ in range(10):  # 2.5 s without a submission
        s.now += 0.25
        s.core.tick(s.now)
        assert [job for job, _ in jobs(s.actions())] == []
    for _ in range(4):
        s.now += 0.25
        s.core.tick(s.now)
        if [job for job, _ in jobs(s.actions())] == [JOB_PROBE]:
            break
    else:
        raise AssertionError("no idle probe after the handoff's cost")


def seconds_to_idle_probe(s: Script, step: float = 0.05, limit: float = 5.0) -> float:
    """Ticks a holder that submits nothing until the core starts an idle probe; how long it took."""
    start = s.now
    while s.now - start < limit:
        s.now += step
        s.core.tick(s.now)
        if [job for job, _ in jobs(s.actions())] == [JOB_PROBE]:
            return s.now - start
    raise AssertionError(f"no idle probe within {limit} s")


def test_a_holder_whose_pauses_outlast_the_handoff_releases_after_the_short_window(lib):
    """The idle window while others wait is the handoff's cost until a pause of this holder has
    lasted that long; then the process's own window, until a pause is shorter again."""
    s = Script(lib, used=8 * GIB, idle_release_ms=100)

    def turn(grant: int, pause: float) -> float:
        """A grant (asked for when the last pause ended), contended; the holder pauses for
        `pause` s from now. How long it held the idle GPU before its release."""
        assert any("ACQUIRE" in m for m in sent(s.want()))
        granted(s, grant=grant)
        s.receive("CONTENDED", device=DEVICE, grant=grant, quantum_left_ms=600_000, idle_ms=400)
        waited = seconds_to_idle_probe(s)
        assert any("reason=idle" in m for m in sent(s.job_done(RESULT_DRAINED)))
        s.waiters = 0
        s.now += pause - waited  # the pause goes on after the release
        return waited

    assert turn(1, pause=1.0) >= 0.4   # nothing known: the handoff's cost
    assert turn(2, pause=0.2) < 0.4    # the last pause (1 s) outlasted it: the process's window
    assert turn(3, pause=1.0) >= 0.4   # the last one (0.2 s) did not: the cost again


def test_a_drop_with_evict_that_crossed_an_idle_release_moves_the_room_out_and_says_evicted(lib):
    """The probe's result was seen before the DROP was read (client.c observes, then receives):
    the idle RELEASE went out without a swap-out, so the room the DROP asked for moves out after
    it, answered as an EVICT is."""
    s = Script(lib, used=4 * GIB, idle_release_ms=100)
    granted(s)
    seconds_to_idle_probe(s)
    assert any("reason=idle" in m for m in sent(s.job_done(RESULT_DRAINED)))
    actions = s.receive("DROP", device=DEVICE, grant=1, grace_ms=500, reason="quantum", evict=3 * GIB)
    assert jobs(actions) == [(JOB_SWAP_OUT, 3 * GIB)] and gates(actions) == []
    s.swapped = 3 * GIB
    assert f"NVSHARE/1 EVICTED\ndevice={DEVICE}\nresident={GIB}" in sent(s.job_done(RESULT_MOVED))


def test_a_drop_that_crossed_a_release_after_its_own_drain_moves_nothing_more(lib):
    """Only an idle release leaves the room undone: a quantum's RELEASE moved what CONTENDED
    said, and a DROP that crossed it is stale."""
    s = Script(lib, used=4 * GIB)
    granted(s)
    s.receive("CONTENDED", device=DEVICE, grant=1, quantum_left_ms=0, evict=GIB)
    s.job_done(RESULT_DRAINED)
    s.swapped = GIB
    assert any("reason=quantum" in m for m in sent(s.job_done(RESULT_MOVED)))
    actions = s.receive("DROP", device=DEVICE, grant=1, grace_ms=500, reason="quantum", evict=GIB)
    assert jobs(actions) == [] and sent(actions) == []


def test_in_the_world_a_drop_read_after_the_idle_probe_ended_is_answered_with_evicted(lib):
    """The crossing as the shell meets it: the worker's probe ended (the holder was idle) and
    the scheduler's DROP evict= waits unread; the client thread sees the probe's result first."""
    world = World(lib, tq=0.5, swap=True, idle_release=0.3, heartbeat_timeout=5.0)
    a, b = world.spawn("a"), world.spawn("b")
    world.allocate(a, 2 * GIB)
    world.want(a)
    world.finish_work(a)
    world.auto_worker = False  # the probe waits for the worker
    for _ in range(40):
        world.advance(0.05)
        if a.devices[0].job == JOB_PROBE:
            break
    assert a.devices[0].job == JOB_PROBE, world.describe()
    world.want(b)  # CONTENDED, read while the probe runs
    world.stop(a)  # so that the DROP stays unread
    for _ in range(40):
        world.advance(0.05)
        if any(m.startswith(b"NVSHARE/1 DROP") for m in a.inbox):
            break
    assert any(m.startswith(b"NVSHARE/1 DROP") for m in a.inbox), (a.inbox, world.describe())
    a.stopped = False
    world.auto_worker = True
    assert world.worker(a, 0)  # the probe's result, then the client thread reads the DROP
    assert a.releases == [(0, 1, "idle")]
    assert a.evicts.get(a.conn) == {0} and a.evicted.get(a.conn) == {0}, (a.evicts, a.evicted)
    assert a.devices[0].swapped == 2 * GIB


# --- the paired world: swapping with the scheduler core, explored ---------------------------


def test_handoffs_in_the_world_swap_out_before_each_release_and_prefetch_before_each_gate(lib):
    world = World(lib, tq=0.5, swap=True)
    a, b = world.spawn("a"), world.spawn("b")
    world.allocate(a, 3 * GIB)
    world.allocate(b, 2 * GIB)
    for _ in range(6):
        world.want(a)
        world.want(b)
        world.advance(0.3)
        for p in (a, b):
            world.finish_work(p)
        world.advance(0.3)
    # Each RELEASE after a DROP said what stayed resident (nothing: the DROP asked for all of it).
    releases = [r for p in (a, b) for r in p.residents if r[0] == "RELEASE"]
    assert releases and all(resident == 0 for _, _, resident in releases)
    assert sum(len(p.releases) for p in (a, b)) >= 4


class SwappingSharing(Sharing):
    """The sharing state machine with swapping: processes allocate, every DROP asks for all
    of the holder's memory and every GRANT allows all of it back, and the scheduler sends EVICT
    to anyone. The world checks that swap jobs run with the gate closed and nothing in flight,
    that each such RELEASE follows a swap-out and says resident=, and that a grant's gate waits
    for its prefetch; the teardown that every EVICT was answered."""

    def __init__(self) -> None:
        super().__init__()
        self.world.swap = True

    @rule(pick=st.integers(0, 7), device=st.integers(0, DEVICES - 1), gib=st.integers(1, 4))
    def allocate(self, pick, device, gib):
        live = self.world.live()
        if live:
            self.world.allocate(live[pick % len(live)], gib * GIB, device)

    @rule(pick=st.integers(0, 7), device=st.integers(0, DEVICES - 1), gib=st.integers(0, 4))
    def evict(self, pick, device, gib):
        live = self.world.live()
        if live:
            self.world.evict(live[pick % len(live)], device, gib * GIB)

    @invariant()
    def residents_are_within_what_is_allocated(self):
        for process in self.world.processes:
            for _, index, resident in process.residents:
                assert 0 <= resident <= process.devices[index].used

    def teardown(self):
        super().teardown()
        for process in self.world.live():
            if process.conn is not None and process.core.registered:
                asked = process.evicts.get(process.conn, set())
                assert asked <= process.evicted.get(process.conn, set()), (process.name, asked, process.evicted)


def test_an_evict_held_back_by_a_capture_dies_with_a_lost_registration(lib):
    """Found by the machine: an EVICT waits for a capture's end, the process is stopped past the
    heartbeat timeout and the scheduler forgets it (and the EVICT); on resuming it registers
    again on the same connection. Nobody waits for that EVICTED any more, and none comes."""
    SwappingSharing.lib = lib
    state = SwappingSharing()
    state.begin_capture(device=0, pick=0)
    state.advance(seconds=0.15)
    state.evict(device=0, gib=2, pick=0)
    state.spawn(gang="")
    state.stop(pick=0)
    state.advance(seconds=1.8)
    state.teardown()


def test_swapping_state_machine(lib):
    SwappingSharing.lib = lib
    run = SwappingSharing.TestCase
    run.settings = settings(max_examples=100, stateful_step_count=30, deadline=None, derandomize=True,
                            suppress_health_check=[HealthCheck.too_slow])
    run().runTest()


def test_over_the_budget_the_scheduler_core_makes_the_client_core_swap(lib):
    """No stand-in: two processes of 12 GiB on a 16 GiB device, paired with the scheduler's own
    residency rules. Each handoff evicts the holder (RELEASE says what stays) and lets the
    grantee prefetch; the gates are never open together and work goes on."""
    world = World(lib, tq=0.5)
    a, b = world.spawn("a"), world.spawn("b")
    for p in (a, b):
        world.allocate(p, 12 * GIB)
    for _ in range(6):
        world.want(a)
        world.want(b)
        world.advance(0.3)
        for p in (a, b):
            world.finish_work(p)
        world.advance(0.3)
    releases = [(p.name, resident) for p in (a, b) for kind, _, resident in p.residents if kind == "RELEASE"]
    assert len(releases) >= 3, (releases, world.describe())
    assert all(resident <= 4 * GIB for _, resident in releases)  # room made for the other's 12 GiB
    assert {name for name, _ in releases} == {"a", "b"}
