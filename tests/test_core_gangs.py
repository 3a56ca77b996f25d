"""Scenario tests of the lock core's gangs (docs/scheduler.md, *Gangs*): one test per rule."""

from __future__ import annotations

from typing import Any

from nvshare_py import protocol
from nvshare_py.scheduler.events import ClientMessage, Log

from test_core import GPU0, GPU1, Harness



def quiet(**config) -> Harness:
    """A core whose clients never time out (these tests send no heartbeats)."""
    return Harness(heartbeat_timeout=1000.0, **config)


def member(h: Harness, key: str, device: str, gang: str = "job", size: int = 2, **kwargs) -> None:
    """A rank of a data-parallel job: registers in the gang and announces its device."""
    h.register(key, gang=gang, gang_size=size, **kwargs)
    h.device(key, device)


def drops(h: Harness) -> list[tuple[str, str, str]]:
    return sorted((to, m.device, m.reason) for to, m in h.sent(protocol.Drop))


def granted(h: Harness) -> list[tuple[str, str]]:
    return sorted((to, m.device) for to, m in h.sent(protocol.Grant))


def grant_on(h: Harness, device: str) -> int:
    (holder,) = [d for d in h.status()["devices"] if d["device"] == device][0]["holders"]
    return holder["grant"]


def two_rank_job(h: Harness, prefix: str = "r", gang: str = "job") -> None:
    member(h, f"{prefix}0", GPU0, gang)
    member(h, f"{prefix}1", GPU1, gang)


def gang_holding_while_a_single_waits(device: str = GPU0, at: float = 1, **options: Any) -> Harness:
    """A two-rank job holds both GPUs (TQ 10 s, the core's `options` besides); single-GPU
    client `s` asked for `device` at t=`at`."""
    h = quiet(tq=10.0, **options)
    two_rank_job(h)
    h.acquire("r0", GPU0)
    h.register("s")
    h.device("s", device)
    h.at(at).acquire("s", device)
    return h


def test_a_gang_gets_all_its_devices_at_once_and_the_member_that_did_not_ask_is_granted_too():
    h = quiet()
    two_rank_job(h)
    h.acquire("r0", GPU0)
    assert granted(h) == [("r0", GPU0), ("r1", GPU1)]
    h.acquire("r1", GPU1)  # idempotent: it holds already
    assert h.grants() == []


def test_a_gang_waits_for_all_its_devices_instead_of_holding_one_while_waiting():
    h = quiet(tq=10.0)
    h.register("s")
    h.device("s", GPU1)
    h.acquire("s", GPU1)
    two_rank_job(h)
    h.at(1).acquire("r0", GPU0)
    assert h.grants() == []  # GPU0 is free, but GPU1 is not: nothing is granted
    assert h.holders(GPU0) == []
    h.at(10).tick()  # the single's quantum ends: others wait
    assert drops(h) == [("s", GPU1, "quantum")]
    h.release("s", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("r0", GPU0), ("r1", GPU1)]


def test_a_gang_at_the_head_reserves_its_devices_in_order():
    """A single that asks after the gang waits behind it even on a device that is free."""
    h = quiet(tq=10.0)
    h.register("s0")
    h.device("s0", GPU0)
    h.acquire("s0", GPU0)
    two_rank_job(h)
    h.at(1).acquire("r1", GPU1)
    h.register("s1")
    h.device("s1", GPU1)
    h.at(2).acquire("s1", GPU1)
    assert h.grants() == []  # GPU1 is free, but the gang asked first
    h.at(10).tick()
    h.release("s0", grant_on(h, GPU0), GPU0, "drop")
    assert granted(h) == [("r0", GPU0), ("r1", GPU1)]


def test_a_single_beside_a_gang_still_gets_its_turns():
    h = gang_holding_while_a_single_waits(grace=2.0)
    assert h.grants() == []
    # The gang's quantum ends: both members are dropped together...
    h.at(10).tick()
    assert drops(h) == [("r0", GPU0, "quantum"), ("r1", GPU1, "quantum")]
    # ...and the single runs once both released, not before.
    h.release("r0", grant_on(h, GPU0), GPU0, "drop")
    assert h.grants() == []
    h.release("r1", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("s", GPU0)]


def test_both_members_are_told_of_contention_on_one_device_with_the_gangs_quantum():
    h = gang_holding_while_a_single_waits(GPU1, at=4)
    told = sorted((to, m.device, m.quantum_left_ms) for to, m in h.sent(protocol.Contended))
    assert told == [("r0", GPU0, 6000), ("r1", GPU1, 6000)]


def test_a_member_that_releases_ends_the_gangs_hold_and_its_device_waits_for_the_others():
    h = gang_holding_while_a_single_waits()
    h.at(2).release("r0", grant_on(h, GPU0), GPU0, "user")
    assert drops(h) == [("r1", GPU1, "gang")]
    assert h.grants() == []  # GPU0 is free, but r1 may still run a collective with it
    h.release("r1", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("s", GPU0)]


def test_a_member_that_dies_ends_the_gangs_hold():
    h = quiet(tq=10.0)
    two_rank_job(h)
    h.acquire("r0", GPU0)
    h.at(1).bye("r1", "exited")
    assert drops(h) == [("r0", GPU0, "gang")]


def test_a_gang_that_does_not_release_is_revoked_together():
    h = gang_holding_while_a_single_waits(GPU1, grace=2.0)
    h.at(10).tick()
    h.release("r1", grant_on(h, GPU1), GPU1, "drop")  # r1 answers, r0 hangs
    assert h.grants() == []  # GPU1 stays with the gang while r0 may still run
    h.at(12).tick()
    assert sorted((to, m.device) for to, m in h.sent(protocol.Revoke)) == [("r0", GPU0)]
    assert granted(h) == [("s", GPU1)]


def test_two_gangs_on_the_same_devices_take_turns_without_deadlock():
    """Today's deadlock: each job's rank on one GPU holds it while its partner waits for the
    other GPU. With gangs each job gets both GPUs or none."""
    h = quiet(tq=5.0, grace=1.0)
    two_rank_job(h, "a", "job-a")
    two_rank_job(h, "b", "job-b")
    h.acquire("a0", GPU0)
    assert granted(h) == [("a0", GPU0), ("a1", GPU1)]
    h.at(1).acquire("b1", GPU1)  # the other job asks from the other end
    assert h.grants() == []
    h.at(5).tick()
    assert drops(h) == [("a0", GPU0, "quantum"), ("a1", GPU1, "quantum")]
    h.release("a0", grant_on(h, GPU0), GPU0, "drop")
    h.acquire("a0", GPU0)  # job a wants another turn
    h.release("a1", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("b0", GPU0), ("b1", GPU1)]
    h.at(10).tick()
    assert drops(h) == [("b0", GPU0, "quantum"), ("b1", GPU1, "quantum")]
    h.release("b0", grant_on(h, GPU0), GPU0, "drop")
    h.release("b1", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("a0", GPU0), ("a1", GPU1)]


def test_a_process_on_several_devices_is_a_gang_of_one():
    h = quiet()
    h.register("p")
    h.device("p", GPU0)
    h.device("p", GPU1)
    h.acquire("p", GPU0)
    assert granted(h) == [("p", GPU0), ("p", GPU1)]


def test_a_process_that_holds_one_device_and_asks_for_another_busy_one_lets_the_first_go():
    h = quiet(tq=10.0)
    h.register("s")
    h.device("s", GPU1)
    h.acquire("s", GPU1)
    h.register("p")
    h.device("p", GPU0)
    h.acquire("p", GPU0)
    first = h.grant_of("p")
    h.device("p", GPU1)  # it begins to use a second device, which s holds
    h.acquire("p", GPU1)
    assert drops(h) == [("p", GPU0, "gang")]  # no hold-and-wait
    h.release("p", first, GPU0, "drop")
    h.at(10).tick()
    h.release("s", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("p", GPU0), ("p", GPU1)]


def test_a_gang_waits_for_its_missing_members_up_to_the_bound_then_runs_and_says_so():
    h = quiet(gang_wait=30.0)
    member(h, "r0", GPU0, size=3)
    member(h, "r1", GPU1, size=3)
    h.at(1).acquire("r0", GPU0)
    assert h.grants() == []
    assert h.core.next_deadline() == 31.0
    h.at(31).tick()
    assert granted(h) == [("r0", GPU0), ("r1", GPU1)]
    (warning,) = [log for log in h.logs("warning") if log.what == "gang-incomplete"]
    assert (warning.fields["members"], warning.fields["size"]) == (2, 3)
    (event,) = h.events("gang-incomplete")
    assert event.detail == "gang=g1 members=2 size=3 name=job"


def test_the_last_member_to_come_starts_the_gangs_turn():
    h = quiet()
    member(h, "r0", GPU0)
    h.acquire("r0", GPU0)
    assert h.grants() == []
    h.at(1).register("r1", gang="job", gang_size=2)
    assert h.grants() == []  # a member counts once it says which device it uses
    h.device("r1", GPU1)
    assert granted(h) == [("r0", GPU0), ("r1", GPU1)]


def test_a_device_announced_during_the_turn_joins_it_when_free():
    h = quiet()
    member(h, "r0", GPU0, size=0)
    h.acquire("r0", GPU0)
    assert granted(h) == [("r0", GPU0)]
    member(h, "r1", GPU1, size=0)  # it came after the turn began; nobody uses GPU1
    assert granted(h) == [("r1", GPU1)]


def test_a_late_member_whose_device_is_busy_ends_the_turn_and_the_gang_asks_again():
    h = quiet(tq=10.0)
    h.register("s")
    h.device("s", GPU1)
    h.acquire("s", GPU1)
    member(h, "r0", GPU0, gang="job", size=0)
    h.acquire("r0", GPU0)
    assert granted(h) == [("r0", GPU0)]
    member(h, "r1", GPU1, gang="job", size=0)
    assert h.grants() == []
    h.acquire("r1", GPU1)
    assert drops(h) == [("r0", GPU0, "gang")]
    h.release("r0", grant_on(h, GPU0), GPU0, "drop")
    h.at(10).tick()
    h.release("s", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("r0", GPU0), ("r1", GPU1)]


def test_members_on_one_device_are_granted_it_together_and_the_asker_is_one_of_them():
    """A previous attempt granted a turn's device to a member that had only announced it,
    not to the one that asked."""
    h = quiet()
    member(h, "k2", GPU0)
    member(h, "k3", GPU0)
    h.acquire("k3", GPU0)
    assert granted(h) == [("k2", GPU0), ("k3", GPU0)]
    assert h.holders(GPU0) == [("c1", "holding"), ("c2", "holding")]


def test_the_same_gang_name_from_another_user_is_another_gang():
    h = quiet()
    member(h, "mine", GPU0, uid=1000)
    member(h, "theirs", GPU1, uid=1001)
    h.acquire("mine", GPU0)
    assert h.grants() == []  # size 2: still waiting for its own second member
    gangs = {g["gang"]: g["members"] for g in h.status()["gangs"]}
    assert sorted(gangs.values()) == [["c1"], ["c2"]]


def test_a_gang_name_beyond_the_bound_registers_the_process_without_a_gang():
    h = quiet()
    h.register("p", gang="x" * 200, gang_size=2)
    assert [log.what for log in h.logs("warning")] == ["gang-refused"]
    assert h.grants() == [] and h.core.client_id("p") == "c1"
    h.device("p", GPU0)
    h.acquire("p", GPU0)
    assert granted(h) == [("p", GPU0)]


def test_status_shows_the_gang_its_members_devices_and_quantum():
    h = quiet(tq=10.0)
    two_rank_job(h)
    h.acquire("r0", GPU0)
    h.at(3)
    (gang,) = h.status()["gangs"]
    assert gang["gang"] == "g1" and gang["name"] == "job"
    assert (gang["members"], gang["size"], gang["state"]) == (["c1", "c2"], 2, "holding")
    assert gang["devices"] == sorted([GPU0, GPU1])
    assert gang["quantum_left"] == 7.0
    clients = {c["client"]: c["gang"] for c in h.status()["clients"]}
    assert clients == {"c1": "g1", "c2": "g1"}


def test_every_log_line_of_gangs_has_its_words():
    from nvshare_py.scheduler import views
    h = quiet(gang_wait=1.0)
    member(h, "r0", GPU0, size=3)
    h.register("bad", gang="y" * 300)
    h.register("r1", gang="job", gang_size=4)
    h.acquire("r0", GPU0)
    seen = [a for a in h.actions if isinstance(a, Log)]
    h.at(2).tick()
    seen += [a for a in h.actions if isinstance(a, Log)]
    for log in seen:
        assert views.describe(log)


def test_a_gang_of_one_that_reconnects_keeps_its_turn():
    h = quiet(tq=10.0)
    h.register("p1", host_pid=42)
    h.device("p1", GPU0)
    h.device("p1", GPU1)
    h.acquire("p1", GPU0)
    grants = {m.device: m.grant for m in h.grants()}
    h.at(1).register("p2", session=h.sessions["p1"], host_pid=42, held=[GPU0, GPU1])
    assert {m.device: m.grant for m in h.grants("p2")} == grants  # confirmed, same grants
    h.register("s")
    h.device("s", GPU1)
    h.at(2).acquire("s", GPU1)
    h.at(10).tick()
    assert drops(h) == [("p2", GPU0, "quantum"), ("p2", GPU1, "quantum")]
    (gang,) = h.status()["gangs"]
    assert (gang["gang"], gang["members"], gang["state"]) == ("c2", ["c2"], "draining")


def test_a_rank_that_reconnects_stays_in_its_gang_and_keeps_its_grant():
    h = quiet(tq=10.0)
    two_rank_job(h)
    h.acquire("r0", GPU0)
    grant = grant_on(h, GPU1)
    h.at(1).register("r1b", session=h.sessions["r1"], host_pid=102, held=[GPU1], gang="job", gang_size=2)
    assert [m.grant for m in h.grants("r1b")] == [grant]
    assert drops(h) == []  # a reconnection is no member leaving
    (gang,) = h.status()["gangs"]
    assert (gang["members"], gang["state"]) == (["c1", "c3"], "holding")


def test_in_mode_off_a_member_is_granted_at_once_with_its_gang():
    h = quiet(mode="off")
    h.register("s")
    h.device("s", GPU0)
    h.acquire("s", GPU0)
    two_rank_job(h)
    h.acquire("r1", GPU1)
    assert granted(h) == [("r0", GPU0), ("r1", GPU1)]


def test_in_mode_auto_a_gang_runs_beside_others_while_memory_fits_but_only_with_all_its_devices():
    h = quiet(mode="auto")
    h.register("s")
    h.device("s", GPU1)
    h.memory("s", 12 * (1 << 30), GPU1)
    h.acquire("s", GPU1)
    member(h, "r0", GPU0)
    member(h, "r1", GPU1)
    h.memory("r0", 2 * (1 << 30), GPU0)
    h.memory("r1", 8 * (1 << 30), GPU1)  # 12 + 8 GiB do not fit GPU1's 16 GiB
    h.acquire("r0", GPU0)
    assert h.grants() == []
    h.release("s", grant_on(h, GPU1), GPU1, "user")
    assert granted(h) == [("r0", GPU0), ("r1", GPU1)]
    h.acquire("s", GPU1)  # 8 + 12 GiB: waits for the gang
    assert h.grants() == []


def test_a_device_that_joins_a_running_turn_goes_to_the_asker_and_every_member_that_announced_it():
    """A previous attempt granted a device joining a turn to a member that had only announced
    it, and not to the member that asked."""
    h = quiet(tq=10.0)
    h.register("s")
    h.device("s", GPU1)
    h.acquire("s", GPU1)
    member(h, "k1", GPU0, size=0)
    h.acquire("k1", GPU0)
    member(h, "k2", GPU1, size=0)  # GPU1 is busy: k2 is not granted it yet
    member(h, "k3", GPU1, size=0)
    assert h.grants() == []
    h.at(1).release("s", grant_on(h, GPU1), GPU1, "user")
    h.acquire("k3", GPU1)  # GPU1 is free now: it joins the turn
    assert granted(h) == [("k2", GPU1), ("k3", GPU1)]


def test_a_member_idle_for_a_while_pauses_within_the_turn_and_gets_its_device_back_at_once():
    """Its partners may be waiting in a collective for it: dropping them could not drain."""
    h = gang_holding_while_a_single_waits()
    h.at(2).release("r0", grant_on(h, GPU0), GPU0, "idle")
    assert h.sent(protocol.Drop) == [] and h.grants() == []  # GPU0 stays with the gang
    h.at(3).acquire("r0", GPU0)
    assert granted(h) == [("r0", GPU0)]
    h.at(10).tick()  # the gang's one quantum, from its turn's start
    assert drops(h) == [("r0", GPU0, "quantum"), ("r1", GPU1, "quantum")]


def test_a_turn_whose_members_all_went_idle_ends_and_its_devices_pass_on():
    h = gang_holding_while_a_single_waits(GPU1)
    h.at(2).release("r0", grant_on(h, GPU0), GPU0, "idle")
    h.release("r1", grant_on(h, GPU1), GPU1, "idle")
    assert granted(h) == [("s", GPU1)]
    assert [e.detail for e in h.events("gang-end")] == ["gang=g1 turn=1"]


def test_a_member_that_leaves_while_its_gang_waits_lets_the_rest_of_the_gang_run():
    h = quiet(tq=10.0)
    h.register("s")
    h.device("s", GPU1)
    h.acquire("s", GPU1)
    two_rank_job(h)
    h.acquire("r0", GPU0)
    assert h.grants() == []  # GPU1 is busy
    h.at(1).bye("r1", "exited")  # the rank on GPU1 is gone: r0 needs GPU0 only
    assert granted(h) == [("r0", GPU0)]


# --- the fence: every member stops after the same collective (issue 31) -------------------------


def fenced(h: Harness, key: str, device: str, collectives: int) -> None:
    h.feed(ClientMessage(h.now, key, protocol.Fenced(device=device, grant=grant_on(h, device),
                                                    collectives=collectives)))


def fences(h: Harness) -> list[tuple[str, str, int]]:
    return sorted((to, m.device, m.collectives) for to, m in h.sent(protocol.Fence))


def test_a_dropped_gang_is_told_to_stop_after_the_collective_the_furthest_member_launched():
    # Was: the members' gates closed wherever the DROP found them; a rank that had launched
    # step k's all-reduce while its partner had not could not drain, and was revoked.
    h = gang_holding_while_a_single_waits(grace=2.0)
    h.at(10).tick()
    assert [(to, m.fence) for to, m in sorted(h.sent(protocol.Drop), key=lambda sent: sent[0])] == [
        ("r0", True), ("r1", True)]
    fenced(h, "r0", GPU0, 41)
    assert fences(h) == []  # it waits for every member
    fenced(h, "r1", GPU1, 40)
    assert fences(h) == [("r0", GPU0, 41), ("r1", GPU1, 41)]
    (event,) = h.events("gang-fence")
    assert event.detail == "gang=g1 turn=1 collectives=41 behind=1"
    h.release("r0", grant_on(h, GPU0), GPU0, "drop")
    h.release("r1", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("s", GPU0)]


def test_a_member_that_does_not_count_collectives_is_not_waited_for():
    h = gang_holding_while_a_single_waits(grace=2.0)
    h.at(10).tick()
    fenced(h, "r0", GPU0, 7)
    h.release("r1", grant_on(h, GPU1), GPU1, "drop")  # an older client: it just releases
    assert fences(h) == [("r0", GPU0, 7)]


def test_a_drop_outside_a_gang_has_no_fence():
    h = quiet(tq=10.0)
    h.register("s")
    h.device("s", GPU0)
    h.acquire("s", GPU0)
    h.register("t")
    h.device("t", GPU0)
    h.at(1).acquire("t", GPU0)
    h.at(10).tick()
    assert [(to, m.fence) for to, m in h.sent(protocol.Drop)] == [("s", False)]
    h.feed(ClientMessage(h.now, "s", protocol.Fenced(device=GPU0, grant=grant_on(h, GPU0), collectives=3)))
    assert fences(h) == [] and [log for log in h.logs("debug") if log.what == "fenced-stale"]


def test_a_member_paused_at_the_turns_end_is_granted_again_and_fenced_with_the_others():
    # Was: only the members holding were dropped; one paused for idleness (a long CPU phase)
    # was left behind the others' collectives, and the partner that had launched the next one
    # spun until it was revoked.
    h = gang_holding_while_a_single_waits(grace=2.0)
    h.at(2).release("r0", grant_on(h, GPU0), GPU0, "idle")
    h.at(10).tick()
    assert granted(h) == [("r0", GPU0)]  # its device again, for the fence
    assert drops(h) == [("r0", GPU0, "quantum"), ("r1", GPU1, "quantum")]
    fenced(h, "r1", GPU1, 12)
    fenced(h, "r0", GPU0, 11)
    assert fences(h) == [("r0", GPU0, 12), ("r1", GPU1, 12)]
    h.release("r0", grant_on(h, GPU0), GPU0, "drop")
    h.release("r1", grant_on(h, GPU1), GPU1, "drop")
    assert granted(h) == [("s", GPU0)]
