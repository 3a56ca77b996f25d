"""The interceptor's client core (interceptor/client_core.c), one rule per test, paired with
the scheduler's core on virtual time (tests/fixtures/client_core.py): every step checks that no
two processes run on one device, that a RELEASE follows a closed gate and a finished drain,
and that a REVOKE only hits work that was still running."""

from __future__ import annotations

import pytest

from nvshare_py import protocol_table as table
from nvshare_py.scheduler import events as ev

from fixtures.client_core import (
    ACT_CONNECT,
    ACT_GATE,
    ACT_LOG,
    ACT_SEND,
    RESULT_DRAINED,
    SIM_SOCKET,
    DRAINING,
    HOLDING,
    IDLE,
    JOB_DRAIN,
    JOB_NONE,
    JOB_PROBE,
    WAITING,
    ClientCore,
    SafetyViolation,
    World,
)
from test_client_core_swap import DEVICE as SCRIPTED_DEVICE
from test_client_core_swap import Script, granted

@pytest.fixture
def world(client_core_lib):
    return World(client_core_lib, tq=1.0, grace=0.5, heartbeat=0.2, heartbeat_timeout=1.0, idle_release=10.0)


@pytest.fixture
def idle_world(client_core_lib):
    return World(client_core_lib, tq=1.0, grace=0.5, heartbeat=0.2, heartbeat_timeout=1.0, idle_release=0.3)


def test_a_waiting_thread_gets_the_lock(world):
    a = world.spawn("a")
    world.want(a)
    assert a.core.state(0) == HOLDING and a.devices[0].gate
    assert world.holders() == ["a"]
    assert a.devices[0].in_flight == 1  # the waiting thread went through once the gate opened


def test_handoff_drains_before_release_and_the_next_holder_waits_for_it(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.want(b)
    assert b.core.state(0) == WAITING and not b.devices[0].gate
    world.advance(1.0)  # a's quantum is over (a pre-drain or a DROP): its gate closes
    assert not a.devices[0].gate and a.core.state(0) == DRAINING
    assert a.devices[0].job == JOB_DRAIN
    assert not b.devices[0].gate and a.releases == []  # a's kernel still runs: nothing released
    world.finish_work(a)
    world.settle()
    assert [r[2] for r in a.releases] in (["quantum"], ["drop"])
    assert b.devices[0].gate and world.holders() == ["b"]


def test_predrain_starts_before_the_quantum_ends(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    granted = world.now
    world.finish_work(a)
    world.want(b)
    world.advance(0.999)
    world.settle()
    assert a.releases and a.releases[0][2] == "quantum"  # drained ahead of the DROP
    assert world.now < granted + 1.0 and b.devices[0].gate


def test_no_predrain_when_turned_off(client_core_lib):
    world = World(client_core_lib, tq=1.0, idle_release=10.0, predrain=False)
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.finish_work(a)
    world.want(b)
    world.advance(0.9)
    assert a.core.state(0) == HOLDING and a.devices[0].gate
    world.advance(0.2)
    world.settle()
    assert a.releases[0][2] == "drop" and b.devices[0].gate


def test_work_still_running_at_the_grace_end_is_revoked_and_released_after_its_drain(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.want(b)
    world.advance(3.0)  # quantum, grace: REVOKE; a's work still runs
    assert world.revokes == [("a", 0, a.releases[0][1] if a.releases else world.revokes[0][2])]
    assert b.devices[0].gate and not a.devices[0].gate
    world.finish_work(a)
    world.settle()
    assert a.releases[-1][2] == "revoke" and a.core.state(0) == IDLE


def test_an_idle_holder_releases_early(idle_world):
    world = idle_world
    a = world.spawn("a")
    world.want(a)
    world.finish_work(a)
    world.advance(0.5)  # past the idle window (0.3 s): the worker probes, finds nothing running
    assert a.releases[0][2] == "idle" and a.core.state(0) == IDLE and not a.devices[0].gate


def test_an_idle_holder_lets_a_waiter_in_at_most_two_looks_after_its_window(client_core_lib):
    """Issue 29: a request waits behind an idle holder at most its idle window + 0.1 s. The
    holder is looked at every quarter window, but at most 25 ms apart: it releases at most two
    looks after its window (the look that saw its last work, the look that saw the window over;
    virtual time, its worker's probe done at once)."""
    world = World(client_core_lib, tq=30.0, idle_release=1.0)
    world.auto_worker = False  # the probe runs the moment it is asked for, as the worker thread does
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.finish_work(a)
    quiet_since = world.now
    world.want(b)
    while not a.releases:
        world.advance(0.005)
        world.settle()
    assert a.releases[0][2] == "idle"
    assert quiet_since + 1.0 <= world.now <= quiet_since + 1.0 + 2 * 0.025 + 0.005
    world.settle()
    assert b.devices[0].gate


def test_while_others_wait_a_holder_that_moves_nothing_releases_after_the_contended_window(client_core_lib):
    """Issue 29: a server asked every second never pauses for its 1 s idle window; while another
    waits and nothing of its memory would move, the scheduler's shorter window applies
    (CONTENDED idle_ms=, --idle-release-contended). Without waiters the usual window stays."""
    world = World(client_core_lib, tq=30.0, idle_release=1.0, idle_release_contended=0.1)
    world.auto_worker = False
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.finish_work(a)
    world.advance(0.5)
    world.settle()
    assert not a.releases  # alone: 0.5 s is no idle window
    world.want(b)
    quiet_since = world.now
    while not a.releases:
        world.advance(0.005)
        world.settle()
    assert a.releases[0][2] == "idle" and world.now <= quiet_since + 0.1 + 2 * 0.025 + 0.005
    assert b.devices[0].gate


def test_a_server_granted_while_others_wait_releases_within_its_short_window_after_its_request(client_core_lib):
    """Issue 29: three servers asked at once in mode on. The second one's grant comes with
    CONTENDED (the third waits), and its last pause away was long, so its window is a fiftieth of
    the contended one (residency.free_idle_ms: 2 ms). It looks at its idleness at that window's
    pace from the CONTENDED on: at its grant's pace (its 1 s window: 25 ms apart) the first look
    came after its 4 ms request and dated its idleness from there, and it released 35 ms after the
    request ended (an H200 saw 34 ms with a 10 ms window), not a few ms."""
    world = World(client_core_lib, tq=30.0, idle_release=1.0, idle_release_contended=0.1)
    world.auto_worker = False
    a, b, c = world.spawn("a"), world.spawn("b"), world.spawn("c")
    world.want(b)
    world.finish_work(b)
    while not b.releases:  # alone, its usual 1 s window
        world.advance(0.05)
        world.settle()
    world.advance(2.0)  # its pause between requests
    world.want(a)  # a request each, at once
    world.want(b)
    world.want(c)
    world.settle()
    assert world.holders() == ["a"]
    world.advance(0.004)
    world.finish_work(a)
    while len(b.releases) < 1 or not b.devices[0].gate:  # a's window (it never paused): 0.1 s
        world.advance(0.001)
        world.settle()
    world.advance(0.004)  # b's request
    world.finish_work(b)
    done = world.now
    while len(b.releases) < 2:
        world.advance(0.001)
        world.settle()
    assert b.releases[1][2] == "idle" and world.now - done <= 0.002 + 2 * 0.0005 + 0.003, world.now - done
    assert c.devices[0].gate


def test_an_idle_probe_that_meets_a_drop_ends_in_a_drain(idle_world):
    world = idle_world
    world.auto_worker = False
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.advance(0.5)  # a's kernel still runs, but nothing new entered: probe
    assert a.devices[0].job == JOB_PROBE
    world.want(b)
    world.advance(0.6)  # the quantum ends while the probe is out: DROP
    world.worker(a)     # the probe finds work: ACTIVE, and the DROP turns it into a drain
    assert a.devices[0].job == JOB_DRAIN and not a.devices[0].gate
    world.finish_work(a)
    world.settle()
    assert a.releases[-1][2] in ("drop", "quantum") and b.devices[0].gate


def test_a_holder_keeps_its_lock_across_a_scheduler_restart(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.restart_scheduler()
    assert a.devices[0].gate  # processes holding a lock keep running
    world.advance(0.2)  # both reconnect
    world.want(b)
    assert world.holders() == ["a"] and not b.devices[0].gate
    world.finish_work(a)
    world.advance(3.0)
    world.settle()
    assert b.devices[0].gate


def test_a_restart_during_a_drain_grants_nothing_until_the_drain_ends(world):
    """Issue 12: a draining device was announced as neither held nor wanted, and the restarted
    daemon granted it to a waiter while the drain still ran."""
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.want(b)
    world.advance(1.2)  # a drains a long queue
    assert a.core.state(0) == DRAINING and a.devices[0].in_flight
    world.restart_scheduler()  # b re-registers wanting the device, a claims it as held
    world.advance(2.0)  # past the recovery window; the claim's grace may run out: REVOKE
    assert world.holders() == ["a"] or world.revokes, "granted to b while a still drained"
    assert not b.devices[0].gate or world.revokes
    world.finish_work(a)
    world.settle()
    world.advance(0.1)
    assert b.devices[0].gate and a.core.state(0) == IDLE


def test_a_stopped_holder_that_lost_its_registration_does_not_submit_on_resume(world):
    """Issue 12: a SIGSTOPped holder resumed with its gate still open and ran beside the
    holder the scheduler had chosen meanwhile."""
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.finish_work(a)
    world.want(b)
    world.stop(a)
    world.advance(2.0)  # past the heartbeat timeout: the scheduler forgets a, grants b
    assert b.devices[0].gate
    world.resume(a)  # its application threads run before its client thread
    world.want(a)
    assert not a.devices[0].gate


def test_a_capture_defers_the_drain_and_its_launches_pass(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.finish_work(a)
    world.begin_capture(a)
    world.want(b)
    world.advance(1.2)  # quantum over: the gate closes, but no drain while the graph is captured
    assert not a.devices[0].gate and a.core.state(0) == DRAINING
    assert a.devices[0].job == JOB_NONE
    world.want(a)  # a launch into the capture passes the closed gate, submitting nothing
    assert a.devices[0].in_flight == 0 and a.devices[0].entered == 2
    world.end_capture(a)  # the drain runs at once
    assert b.devices[0].gate and a.releases


def test_a_capture_that_begins_during_a_drain_defers_it(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.finish_work(a)
    world.want(b)
    world.auto_worker = False
    world.advance(1.2)
    assert a.devices[0].job == JOB_DRAIN
    world.begin_capture(a)  # between the drain's start and its synchronise
    world.worker(a)         # the synchronise is skipped: DEFERRED
    assert a.releases == [] and a.devices[0].job == JOB_NONE
    world.end_capture(a)
    world.settle()
    assert a.releases and b.devices[0].gate and a.devices[0].captures == 0


def test_no_idle_probe_during_a_capture(idle_world):
    world = idle_world
    a = world.spawn("a")
    world.want(a)
    world.finish_work(a)
    world.begin_capture(a)
    world.advance(2.0)
    assert a.devices[0].job == JOB_NONE and a.core.state(0) == HOLDING
    world.end_capture(a)
    world.advance(0.5)
    assert a.releases[0][2] == "idle"


def test_a_clean_exit_says_bye_and_leaves_the_queue_at_once(world):
    a, b, c = world.spawn("a"), world.spawn("b"), world.spawn("c")
    world.want(a)
    world.want(b)
    world.want(c)
    world.exit_cleanly(b)  # BYE: b leaves the queue, c is next
    world.finish_work(a)
    world.advance(1.5)
    assert c.devices[0].gate and world.holders() == ["c"]


def test_a_holder_that_exits_sends_no_bye_while_its_kernels_may_run(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.want(b)
    a.core.exit(world.now)  # the atexit handler, while a's kernel still runs
    world.run(a)
    assert not b.devices[0].gate and world.holders() == ["a"]
    assert any("no BYE" in text for _, text in a.logs)
    world.kill(a)  # the process and its contexts are gone: the scheduler passes the lock
    assert b.devices[0].gate


def test_a_forked_child_starts_with_closed_gates_and_its_own_registration(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    child = world.fork(a, "child")
    assert not child.devices[0].gate and child.core.state(0) == IDLE
    world.want(child)
    assert child.core.state(0) == WAITING and world.holders() == ["a"]
    assert child.session != a.session
    world.finish_work(a)
    world.advance(1.5)  # a's quantum ends: the lock goes to the child, a process of its own
    assert child.devices[0].gate and world.holders() == ["child"]


def test_the_world_catches_two_open_gates(world):
    """The harness's exclusivity check itself can fail."""
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    b.devices[0].gate = True
    with pytest.raises(SafetyViolation):
        world.check_exclusive()


def test_a_short_stop_keeps_the_lock_once_the_scheduler_confirms_the_registration(world):
    a, b = world.spawn("a"), world.spawn("b")
    world.want(a)
    world.stop(a)
    world.advance(0.5)  # longer than the lease (one heartbeat interval), shorter than the timeout
    world.resume(a)     # the lease has lapsed: the next launch waits for the scheduler's answer
    world.want(a)
    assert a.devices[0].in_flight == 2 and a.devices[0].gate  # STATUS came back: carry on
    assert world.holders() == ["a"]
    assert any("still knows this process" in text for _, text in a.logs)


def test_a_scheduler_limit_becomes_an_action_once_per_change_and_a_new_registration_drops_it(world):
    """LIMIT (nvsharectl set-limit) reaches the shell as one LIMIT action per change of the
    figure; a registration with a restarted scheduler starts without it (that scheduler knows
    no limit, and sends one that applies again)."""
    a = world.spawn("a")
    world.want(a)
    cid = world.scheduler.client_id(a.conn)
    world._scheduler_event(lambda now: ev.SetLimit(now, 8 << 20, client=cid))
    world.run(a)
    assert a.devices[0].scheduler_limit == 8 << 20
    world._scheduler_event(lambda now: ev.SetLimit(now, 4 << 20))  # a default below: the client's own wins
    world.run(a)
    assert a.devices[0].scheduler_limit == 8 << 20
    world._scheduler_event(lambda now: ev.SetLimit(now, None, client=cid))
    world.run(a)
    assert a.devices[0].scheduler_limit == 4 << 20  # the default applies now
    world.restart_scheduler()
    world.advance(3.0)  # reconnected and registered again
    assert a.core.registered and a.devices[0].scheduler_limit == 0


# --- what a newer scheduler may send (docs/protocol.md, "Unknown words, unknown types") ----------

LOG_WARN, LOG_DEBUG = 1, 3


def _warnings(actions) -> list[str]:
    return [a.data.decode() for a in actions if a.kind == ACT_LOG and a.value == LOG_WARN]


def _script(lib):
    """One core, registered, holding grant 1 of its device (test_client_core_swap.Script)."""
    s = Script(lib, used=1 << 20)
    assert _gates(granted(s, grant=1)) == [1]
    return s, SCRIPTED_DEVICE


def _gates(actions) -> list[int]:
    return [a.value for a in actions if a.kind == ACT_GATE]


def _sent(actions) -> list[str]:
    return [a.data.decode() for a in actions if a.kind == ACT_SEND]


def test_a_revoke_closes_the_gate_and_releases_whatever_its_reason(client_core_lib):
    """Issue 20: `REVOKE reason=preempted` left the gate open."""
    s, device = _script(client_core_lib)
    actions = s.receive("REVOKE", device=device, grant=1, reason="preempted")
    assert _gates(actions) == [0] and s.core.state(0) == DRAINING
    assert [w for w in _warnings(actions) if "REVOKE reason=preempted" in w]
    [release] = [m for m in _sent(s.job_done(RESULT_DRAINED)) if "RELEASE" in m]
    assert release.splitlines()[1:] == [f"device={device}", "grant=1", "reason=revoke"]


def test_a_drop_drains_and_releases_whatever_its_reason(client_core_lib):
    s, device = _script(client_core_lib)
    actions = s.receive("DROP", device=device, grant=1, grace_ms=500, reason="rebalance")
    assert _gates(actions) == [0] and s.core.state(0) == DRAINING
    [release] = [m for m in _sent(s.job_done(RESULT_DRAINED)) if "RELEASE" in m]
    assert "reason=drop" in release and s.core.state(0) == IDLE


def test_a_grant_opens_the_gate_whatever_its_mode(client_core_lib):
    """Issue 20: `GRANT mode=fair` left the process waiting forever."""
    s = Script(client_core_lib, used=1 << 20)
    s.want()
    actions = s.receive("GRANT", device=SCRIPTED_DEVICE, grant=4, mode="fair", exclusive=0, quantum_ms=1000)
    assert _gates(actions) == [1] and s.core.state(0) == HOLDING
    assert [w for w in _warnings(actions) if "GRANT mode=fair" in w]


def test_each_field_with_an_unknown_word_is_warned_about_once(client_core_lib):
    s, device = _script(client_core_lib)
    first = s.receive("MODE", device=device, mode="fair", quantum_ms=1000)
    again = s.receive("MODE", device=device, mode="fairer", quantum_ms=1000)
    other = s.receive("ERROR", code="rate-limited", detail="slow down")
    assert len([w for w in _warnings(first) if "MODE mode=fair" in w]) == 1
    assert not [w for w in _warnings(again) if "mode=" in w]
    assert [a for a in again if a.kind == ACT_LOG and a.value == LOG_DEBUG and b"mode=fairer" in a.data]
    assert [w for w in _warnings(other) if "ERROR code=rate-limited" in w]
    assert [w for w in _warnings(other) if "rejected a message: rate-limited (slow down)" in w]
    assert s.core.state(0) == HOLDING  # notices, acted on as usual: nothing else changed


def test_a_message_type_it_does_not_know_is_ignored_and_said_at_most_once_a_minute(client_core_lib):
    s, device = _script(client_core_lib)
    actions = s.receive("TELEPORT", device=device, grant=1)
    assert [w for w in _warnings(actions) if "TELEPORT" in w]
    assert not _gates(actions) and not _sent(actions) and s.core.state(0) == HOLDING
    s.now += 30
    assert not _warnings(s.receive("TELEPORT"))
    s.now += 31
    assert [w for w in _warnings(s.receive("SWAPPED")) if "SWAPPED" in w]


@pytest.mark.parametrize("msg_type, field", [(m.type, f.name) for m in table.MESSAGES for f in m.fields
                                             if m.sender is table.Sender.SCHEDULER and f.kind is table.Kind.WORD])
def test_every_word_field_of_the_scheduler_is_open(client_core_lib, msg_type, field):
    """Whatever word field the table gives the scheduler's messages, the C core reads a word it
    does not know (and says so) instead of dropping the message."""
    s, device = _script(client_core_lib)
    values = {f.name: {table.Kind.DEVICE: device, table.Kind.UINT: 1, table.Kind.TEXT: "t", table.Kind.FLAG: 1,
                       table.Kind.WORD: "not-yet-invented"}[f.kind]
              for f in table.BY_TYPE[msg_type].fields if not f.optional}
    actions = s.receive(msg_type, **values)
    assert [w for w in _warnings(actions) if f"{msg_type} {field}=not-yet-invented" in w]


# --- what the process says about its connection ------------------------------------------------

WELCOME = b"NVSHARE/1 WELCOME\nclient=c1\nheartbeat_ms=1000\nidle_release_ms=1000\nversion=1"


def _connections(actions) -> list[str]:
    return [w for w in _warnings(actions) if w.startswith(("connected to the scheduler", "lost the scheduler"))]


def _connect(core: ClientCore, now: float) -> list:
    """The core asks for a connection (at its deadline), gets one and is welcomed."""
    now = max(now, core.next_deadline(now))
    core.tick(now)
    actions = core.pop(now)
    assert [a for a in actions if a.kind == ACT_CONNECT], actions
    core.connected(now)
    core.receive(WELCOME, now)
    return actions + core.pop(now)


@pytest.mark.parametrize("fail_open", [False, True])
def test_a_process_started_before_the_scheduler_says_connected_and_only_a_reconnection_says_again(
        client_core_lib, fail_open):
    """It warned that no scheduler was there (waiting, or running unscheduled); when one comes
    it says so, without calling its first connection a return. A connection lost and made
    again is said both ways."""
    core = ClientCore(client_core_lib, 4242, "00000000000000aa", fail_open=fail_open, socket_path=SIM_SOCKET)
    core.add_device(0, SCRIPTED_DEVICE)
    core.observe(0, 1, 0, 0, 0)  # a thread waits for the device
    core.tick(10.0)
    assert [a for a in core.pop(10.0) if a.kind == ACT_CONNECT]
    core.connect_failed(10.0)
    outage = _warnings(core.pop(10.0))
    assert [w for w in outage if "running unscheduled" in w or "waiting for the scheduler" in w], outage

    first = _connections(_connect(core, 12.0))
    assert first == ["connected to the scheduler at /sim/client/scheduler.sock"]

    core.disconnected("the scheduler closed the connection", 12.5)
    lost = _connections(core.pop(12.5))
    assert len(lost) == 1 and lost[0].startswith("lost the scheduler at /sim/client/scheduler.sock")
    assert _connections(_connect(core, 12.5)) == ["connected to the scheduler at /sim/client/scheduler.sock again"]


def test_a_process_the_scheduler_has_no_place_for_says_why_once_and_tries_again(client_core_lib):
    """Issue 31: a process beyond its user's places was closed at every attempt without a word.
    The scheduler says why (ERROR too-many-connections) before it closes: the process says it
    once, its waiting threads' warning names the reason, and it connects again until served."""
    refusal = b"NVSHARE/1 ERROR\ncode=too-many-connections\ndetail=uid 1000 has 64 connections open, the most one may"
    core = ClientCore(client_core_lib, 4242, "00000000000000aa", socket_path=SIM_SOCKET)
    core.add_device(0, SCRIPTED_DEVICE)
    core.observe(0, 1, 0, 0, 0)  # a thread waits for the device
    now, said, opened = 10.0, [], []
    while now < 35.0:  # attempts 0.1 s apart for the first 3 s, then a second apart
        now = max(now, core.next_deadline(now))
        core.tick(now)
        actions = core.pop(now)
        if [a for a in actions if a.kind == ACT_CONNECT]:
            core.connected(now)
            core.receive(refusal, now)
            core.disconnected("the scheduler closed the connection", now)
            actions += core.pop(now)
        said += _warnings(actions)
        opened += [gate for gate in _gates(actions) if gate]
    assert opened == []  # fail-closed: the waiting thread waits
    told = [w for w in said if "has no place for this process now" in w]
    assert len(told) == 1 and "64 connections open" in told[0] and "GPU work waits" in told[0], said
    waiting = [w for w in said if w.startswith("waiting for a place at the scheduler")]
    assert waiting and all("64 connections open" in w for w in waiting), said
    assert not [w for w in said if "rejected a message" in w or "lost the scheduler" in w], said
    assert _connections(_connect(core, now)) == ["connected to the scheduler at /sim/client/scheduler.sock"]


def test_a_first_connection_without_an_outage_is_not_announced(client_core_lib):
    core = ClientCore(client_core_lib, 4242, "00000000000000aa")
    core.add_device(0, SCRIPTED_DEVICE)
    assert _connections(_connect(core, 10.0)) == []


def test_a_quiet_process_sleeps_until_its_heartbeat_and_sends_it_then(client_core_lib):
    """The shell sleeps until the core's next deadline: for a registered process with nothing
    to do, half the heartbeat interval after what it last sent (WELCOME heartbeat_ms=1000)."""
    core = ClientCore(client_core_lib, 4242, "00000000000000aa")
    core.add_device(0, SCRIPTED_DEVICE)
    _connect(core, 10.0)
    core.tick(10.0)
    core.pop(10.0)  # DEVICE went out at 10.0
    assert core.next_deadline(10.0) == pytest.approx(10.5)
    core.tick(10.499)
    assert core.pop(10.499) == []
    core.tick(10.5)
    assert _sent(core.pop(10.5)) == ["NVSHARE/1 HEARTBEAT"]
    assert core.next_deadline(10.5) == pytest.approx(11.0)
