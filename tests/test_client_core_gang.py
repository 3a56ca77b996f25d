"""The client core's side of gangs (issue 19; interceptor/client_core.c): a device is announced
when the process first uses it, not when it merely resolves it; HELLO says the gang; a GRANT the
process did not ask for (its gang's turn) opens the gate and is given back when idle; a DROP
with reason gang drains and releases every device it names. Scripted: each scheduler message is
sent by hand, the core's answers read back through ctypes."""

from __future__ import annotations

import pytest

from fixtures.client_core import (ACT_GATE, ACT_JOB, ACT_LIMIT, ACT_SEND, HOLDING, IDLE, JOB_DRAIN, JOB_PROBE, World,
                                  RESULT_DRAINED, ClientCore)
from nvshare_py.client_core import ACT_COLLECTIVES, NO_LIMIT
from nvshare_py import protocol

DEVICES = ["GPU-00000000-0000-0000-0000-000000000000", "GPU-00000001-0000-0000-0000-000000000000"]


class Rank:
    """A registered core that knows two devices (resolved: PyTorch's start-up) and uses none yet."""

    def __init__(self, lib, gang: str = "", gang_size: int = 0, before_welcome: tuple[str, ...] = (),
                 counts_collectives: bool = False) -> None:
        self.core = ClientCore(lib, 4242, "00000000000000aa", gang=gang, gang_size=gang_size,
                               counts_collectives=counts_collectives)
        for index, uuid in enumerate(DEVICES):
            self.core.add_device(index, uuid)
        self.used = [0, 0]
        self.waiters = [0, 0]
        self.entered = [0, 0]
        self.now = 10.0
        self.observe()
        self.core.tick(self.now)       # CONNECT
        self.core.connected(self.now)  # HELLO
        self.hello = [protocol.decode(a.data) for a in self.core.pop(self.now) if a.kind == ACT_SEND]
        for text in before_welcome:
            self.core.receive(text.encode(), self.now)
        self.registration = self.receive("WELCOME", client="c1", heartbeat_ms=1000, idle_release_ms=300, version=1)

    def observe(self) -> None:
        for index in range(2):
            self.core.observe(index, self.waiters[index], 0, self.entered[index], self.used[index])

    def receive(self, kind: str, **fields) -> list:
        self.observe()
        text = f"NVSHARE/1 {kind}" + "".join(f"\n{k}={v}" for k, v in fields.items())
        self.core.receive(text.encode(), self.now)
        return self.core.pop(self.now)

    def tick(self, seconds: float = 0.0) -> list:
        self.now += seconds
        self.observe()
        self.core.tick(self.now)
        return self.core.pop(self.now)

    def job_done(self, index: int, result: int) -> list:
        self.observe()
        self.core.job_done(index, result, self.now)
        return self.core.pop(self.now)


def messages(actions) -> list[protocol.Message]:
    return [protocol.decode(a.data) for a in actions if a.kind == ACT_SEND]


def kinds(actions) -> list[str]:
    return [m.TYPE for m in messages(actions) if m.TYPE != "HEARTBEAT"]


def rank_running_on_grant_3(client_core_lib, counts_collectives: bool = False) -> Rank:
    """A rank of gang `job` (2 ranks) that asked for device 0, was granted it (grant 3) and has
    work running on it."""
    rank = Rank(client_core_lib, gang="job", gang_size=2, counts_collectives=counts_collectives)
    rank.used[0] = 1 << 20
    rank.waiters[0] = 1
    rank.tick(0.2)
    rank.receive("GRANT", device=DEVICES[0], grant=3, mode="on", exclusive=1, quantum_ms=1000)
    rank.waiters[0], rank.entered[0] = 0, 1
    return rank


def test_hello_says_the_gang(client_core_lib):
    hello = Rank(client_core_lib, gang="torch:127.0.0.1:29500", gang_size=2).hello[0]
    assert (hello.gang, hello.gang_size) == ("torch:127.0.0.1:29500", 2)
    assert Rank(client_core_lib).hello[0].gang == ""


def test_a_device_is_announced_when_first_used_not_when_resolved(client_core_lib):
    rank = Rank(client_core_lib)
    assert "DEVICE" not in kinds(rank.registration + rank.tick(0.5))  # resolved both, used none
    rank.used[1] = 1 << 20  # allocates on device 1
    first = messages(rank.tick(0.2))
    assert [(m.TYPE, m.device) for m in first if m.TYPE in ("DEVICE", "MEMORY")] == [
        ("DEVICE", DEVICES[1]), ("MEMORY", DEVICES[1])]
    rank.waiters[0] = 1  # a launch waits at device 0's gate
    second = messages(rank.tick())
    assert [(m.TYPE, m.device) for m in second if m.TYPE in ("DEVICE", "ACQUIRE")] == [
        ("DEVICE", DEVICES[0]), ("ACQUIRE", DEVICES[0])]


def test_limits_pushed_at_registration_apply_to_devices_not_announced_yet(client_core_lib):
    """Issue 20's rule holds with late announcements: the LIMIT before WELCOME applies from the
    first allocation on, whichever device it comes on."""
    limit = f"NVSHARE/1 LIMIT\nbytes={64 << 20}\ndevice={DEVICES[1]}"
    rank = Rank(client_core_lib, before_welcome=(limit,))
    assert [(a.device, a.bytes) for a in rank.registration if a.kind == ACT_LIMIT] == [(1, 64 << 20)]
    assert "DEVICE" not in kinds(rank.registration)


def test_a_grant_not_asked_for_opens_the_gate_and_goes_back_when_idle(client_core_lib):
    """A gang's turn grants a member every device it announced; one it does not use now is
    released after the idle window, as any idle holder's."""
    rank = Rank(client_core_lib, gang="job", gang_size=2)
    rank.used[1] = 1 << 20
    rank.tick(0.2)  # announced device 1; never asked for it
    granted = rank.receive("GRANT", device=DEVICES[1], grant=7, mode="on", exclusive=1, quantum_ms=1000)
    assert [(a.device, a.value) for a in granted if a.kind == ACT_GATE] == [(1, 1)]
    assert rank.core.state(1) == HOLDING
    probe = []
    for _ in range(20):  # the idle window (300 ms) passes without a submission
        probe += [a for a in rank.tick(0.05) if a.kind == ACT_JOB]
    assert [(a.device, a.value) for a in probe] == [(1, JOB_PROBE)]
    released = messages(rank.job_done(1, RESULT_DRAINED))
    assert [(m.TYPE, m.grant, m.reason) for m in released if m.TYPE == "RELEASE"] == [("RELEASE", 7, "idle")]
    assert rank.core.state(1) == IDLE


def test_a_gang_drop_drains_and_releases_each_held_device(client_core_lib):
    rank = Rank(client_core_lib, gang="job", gang_size=2)
    rank.used = [1 << 20, 1 << 20]
    rank.waiters = [1, 0]
    rank.tick(0.2)
    for index, grant in ((0, 3), (1, 4)):  # the turn: both, one of them not asked for
        rank.receive("GRANT", device=DEVICES[index], grant=grant, mode="on", exclusive=1, quantum_ms=1000)
    rank.waiters = [0, 0]
    rank.entered = [1, 0]
    drops = []
    for index, grant in ((0, 3), (1, 4)):
        drops += rank.receive("DROP", device=DEVICES[index], grant=grant, grace_ms=500, reason="gang")
    assert sorted((a.device, a.value) for a in drops if a.kind == ACT_JOB) == [(0, JOB_DRAIN), (1, JOB_DRAIN)]
    assert sorted((a.device, a.value) for a in drops if a.kind == ACT_GATE) == [(0, 0), (1, 0)]
    released = messages(rank.job_done(0, RESULT_DRAINED) + rank.job_done(1, RESULT_DRAINED))
    assert sorted((m.device, m.grant, m.reason) for m in released if m.TYPE == "RELEASE") == [
        (DEVICES[0], 3, "drop"), (DEVICES[1], 4, "drop")]


@pytest.mark.parametrize("gang", ["", "job"])
def test_a_holder_that_resolved_a_device_it_never_used_claims_only_what_it_used(client_core_lib, gang):
    """After a reconnection HELLO claims the devices held; an unused device is neither
    announced nor claimed (a gang would otherwise be granted it)."""
    rank = Rank(client_core_lib, gang=gang, gang_size=2 if gang else 0)
    rank.used[0] = 1 << 20
    rank.waiters[0] = 1
    rank.tick(0.2)
    rank.receive("GRANT", device=DEVICES[0], grant=1, mode="on", exclusive=1, quantum_ms=1000)
    rank.waiters[0] = 0
    rank.core.disconnected("the scheduler closed the connection", rank.now)
    rank.core.pop(rank.now)
    rank.tick(0.2)  # CONNECT
    rank.core.connected(rank.now)
    hello = messages(rank.core.pop(rank.now))[0]
    assert hello.held == (DEVICES[0],) and hello.gang == gang


@pytest.mark.parametrize("gang, devices", [("job", 1), ("", 2), ("", 1)])
def test_gang_members_and_holders_of_several_devices_drain_at_the_drop_not_ahead(client_core_lib, gang, devices):
    """A pre-drain starts at a lead learnt per device: the devices of a gang would stop one by
    one, and a collective on one would spin for a partner that cannot launch. A process alone
    on one device still pre-drains."""
    rank = Rank(client_core_lib, gang=gang, gang_size=2 if gang else 0)
    rank.used = [1 << 20] * devices + [0] * (2 - devices)
    rank.waiters = [1] * devices + [0] * (2 - devices)
    rank.tick(0.2)
    for index in range(devices):
        rank.receive("GRANT", device=DEVICES[index], grant=index + 1, mode="on", exclusive=1, quantum_ms=1000)
    rank.waiters = [0, 0]
    rank.entered = [1] * devices + [0] * (2 - devices)
    rank.receive("CONTENDED", device=DEVICES[0], grant=1, quantum_left_ms=100)
    drains = [a for a in rank.tick(0.2) if a.kind == ACT_JOB and a.value == JOB_DRAIN]
    assert len(drains) == (1 if not gang and devices == 1 else 0)


def test_a_revoked_grant_granted_again_before_its_drain_ends_is_answered_and_the_new_one_taken(client_core_lib):
    """A rank's drain can wait for its gang's next turn: its all-reduce spins until a partner,
    whose gate closed first, launches the matching one. The scheduler revokes it, and grants
    the device again in the gang's next turn; the client answers the revoked grant and takes
    the new one, and its gate opens as soon as the old work is done (not after a RELEASE)."""
    rank = rank_running_on_grant_3(client_core_lib)
    drop = rank.receive("DROP", device=DEVICES[0], grant=3, grace_ms=500, reason="quantum")
    assert [(a.device, a.value) for a in drop if a.kind == ACT_JOB] == [(0, JOB_DRAIN)]  # it spins: no result yet
    rank.receive("REVOKE", device=DEVICES[0], grant=3, reason="grace-expired")
    again = rank.receive("GRANT", device=DEVICES[0], grant=9, mode="on", exclusive=1, quantum_ms=1000)
    assert [(m.TYPE, m.grant, m.reason) for m in messages(again)] == [("RELEASE", 3, "revoke")]
    assert [a for a in again if a.kind == ACT_GATE] == []  # the old work still runs
    assert rank.core.state(0) == HOLDING
    drained = rank.job_done(0, RESULT_DRAINED)  # the partner launched: the all-reduce completed
    assert [(a.device, a.value) for a in drained if a.kind == ACT_GATE] == [(0, 1)]
    assert "RELEASE" not in kinds(drained) and rank.core.state(0) == HOLDING
    later = rank.receive("DROP", device=DEVICES[0], grant=9, grace_ms=500, reason="quantum")
    released = messages(rank.job_done(0, RESULT_DRAINED)) if any(a.kind == ACT_JOB for a in later) else []
    assert [(m.grant, m.reason) for m in released if m.TYPE == "RELEASE"] == [(9, "drop")]


def test_a_grant_of_the_new_registration_while_a_lost_registrations_drain_runs_is_taken(client_core_lib):
    """The scheduler dropped the rank (silent past its heartbeat timeout) while it held a device:
    its gate closed and its work drains, with no RELEASE owed (that grant died with the
    registration). The gang's next turn grants the device to the new registration before the
    drain ends: the grant is taken, its gate opening when the drain is done. Ignored, the
    scheduler would count the rank as the holder while the rank's threads waited for ever."""
    rank = rank_running_on_grant_3(client_core_lib)
    lost = rank.receive("ERROR", code="not-registered", detail="send HELLO first", type="HEARTBEAT")
    assert [(a.device, a.value) for a in lost if a.kind == ACT_JOB] == [(0, JOB_DRAIN)]
    assert [m.TYPE for m in messages(lost)] == ["HELLO"]
    rank.receive("WELCOME", client="c2", heartbeat_ms=1000, idle_release_ms=300, version=1)
    rank.waiters[0] = 1  # a thread waits at the closed gate
    again = rank.receive("GRANT", device=DEVICES[0], grant=9, mode="on", exclusive=1, quantum_ms=1000)
    assert "RELEASE" not in kinds(again) and [a for a in again if a.kind == ACT_GATE] == []
    assert rank.core.state(0) == HOLDING
    drained = rank.job_done(0, RESULT_DRAINED)
    assert [(a.device, a.value) for a in drained if a.kind == ACT_GATE] == [(0, 1)]
    assert "RELEASE" not in kinds(drained) and "ACQUIRE" not in kinds(drained)


def test_with_the_scheduler_core_a_gang_turn_grants_a_member_a_device_it_did_not_ask_for(client_core_lib):
    """Both cores together (tests/fixtures/client_core.py's world): rank a used GPUs 0 and 1,
    rank b GPU 1. When a asks for GPU 0 alone, the gang's turn grants every device the two
    announced: a gets GPU 1 unasked, and gives it back after the idle window while it works on
    GPU 0; nothing of the other GPUs' gates is ever open in two processes at once."""
    world = World(client_core_lib, devices=2, tq=5.0, grace=0.5, idle_release=0.3, gang_wait=2.0)
    a = world.spawn("a", gang="job", gang_size=2)
    b = world.spawn("b", gang="job", gang_size=2)
    for process, index in ((a, 0), (a, 1), (b, 1)):
        world.want(process, index)
    world.advance(0.1)
    assert a.core.state(0) == a.core.state(1) == b.core.state(1) == HOLDING
    for process, index in ((a, 0), (a, 1), (b, 1)):
        world.finish_work(process, index)
    world.advance(2.0)  # idle: everything given back
    assert [a.core.state(0), a.core.state(1), b.core.state(1)] == [IDLE, IDLE, IDLE]
    world.want(a, 0)
    world.advance(0.05)
    assert a.core.state(0) == HOLDING and a.devices[0].in_flight == 1
    assert a.core.state(1) == HOLDING and a.devices[1].waiters == 0  # granted, never asked for
    assert b.core.state(1) == HOLDING
    releases = len(a.releases)
    for _ in range(20):  # a keeps GPU 0 busy; GPU 1 stays idle
        world.want(a, 0)
        world.advance(0.05)
    assert any(device == 1 and reason == "idle" for device, _, reason in a.releases[releases:]), a.releases


# --- the fence: every member stops after the same collective (issue 31) -------------------------


def limits(actions) -> list[tuple[int, int]]:
    return [(a.device, a.bytes) for a in actions if a.kind == ACT_COLLECTIVES]


def gates(actions) -> list[int]:
    return [a.value for a in actions if a.kind == ACT_GATE]


def drains(actions) -> list[int]:
    return [a.device for a in actions if a.kind == ACT_JOB and a.value == JOB_DRAIN]


def fenced_drop(rank: Rank) -> list:
    return rank.receive("DROP", device=DEVICES[0], grant=3, grace_ms=1000, reason="quantum", fence=1)


def test_a_rank_behind_its_gang_launches_up_to_the_gangs_collective_before_it_drains(client_core_lib):
    # Was: the gate closed at the DROP wherever the rank was in its step; its partner, which had
    # launched the step's all-reduce already, could not drain and was revoked.
    rank = rank_running_on_grant_3(client_core_lib, counts_collectives=True)
    drop = fenced_drop(rank)
    assert gates(drop) == [0] and limits(drop) == [(0, 0)] and drains(drop) == []  # no collective, no drain yet
    rank.core.collectives_limited(0, 40, rank.now)  # the shell froze them: 40 launched
    (said,) = messages(rank.core.pop(rank.now))
    assert (said.TYPE, said.grant, said.collectives) == ("FENCED", 3, 40)
    assert drains(rank.job_done(0, RESULT_DRAINED)) == []  # an idle probe's result releases nothing now
    fence = rank.receive("FENCE", device=DEVICES[0], grant=3, collectives=41)  # its partner launched one more
    assert limits(fence) == [(0, 41)] and gates(fence) == [1] and drains(fence) == []
    rank.core.observe_collectives(0, 41)  # it launched the step's all-reduce
    caught_up = rank.tick()
    assert gates(caught_up) == [0] and drains(caught_up) == [0]
    assert kinds(rank.job_done(0, RESULT_DRAINED)) == ["RELEASE"]
    regrant = rank.receive("GRANT", device=DEVICES[0], grant=5, mode="on", exclusive=1, quantum_ms=1000)
    assert limits(regrant) == [(0, NO_LIMIT)] and gates(regrant) == [1]  # the next turn launches freely


def test_the_rank_that_went_furthest_drains_at_its_fence(client_core_lib):
    rank = rank_running_on_grant_3(client_core_lib, counts_collectives=True)
    fenced_drop(rank)
    rank.core.collectives_limited(0, 41, rank.now)
    rank.core.pop(rank.now)
    fence = rank.receive("FENCE", device=DEVICES[0], grant=3, collectives=41)
    assert gates(fence) == [] and drains(fence) == [0]


def test_a_revoke_during_the_fence_drains_at_once(client_core_lib):
    rank = rank_running_on_grant_3(client_core_lib, counts_collectives=True)
    fenced_drop(rank)
    rank.core.collectives_limited(0, 40, rank.now)
    rank.core.pop(rank.now)
    revoked = rank.receive("REVOKE", device=DEVICES[0], grant=3, reason="grace-expired")
    assert drains(revoked) == [0]


def test_a_process_that_does_not_count_collectives_drains_at_a_fenced_drop(client_core_lib):
    """nvshare_py.client launches no collective: it answers no fence, and the scheduler does not
    wait for it."""
    rank = rank_running_on_grant_3(client_core_lib)
    drop = fenced_drop(rank)
    assert limits(drop) == [] and drains(drop) == [0] and "FENCED" not in kinds(drop)
