"""The daemon's bounds on what one user can cost it (issue 23), without sockets: connection
places, fair turns, device quotas, metric label places, the ZMTP parser's frame accounting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from nvshare_py.scheduler import zmtp
from nvshare_py.scheduler.connections import ConnectionCounts, ConnectionLimits
from nvshare_py.scheduler.fairness import Turns
from nvshare_py.scheduler.labels import Places
from nvshare_py.scheduler.public import public_status
from nvshare_py.scheduler.quotas import DeviceQuota
from nvshare_py.scheduler.refusals import REFUSED_MEMORY, REFUSED_PIDS, REFUSED_PRINCIPALS, Refusals

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import floodkit  # noqa: E402


# --- connection places ---------------------------------------------------------------------------


def fill(limits: ConnectionLimits, counts: ConnectionCounts, principal: tuple[int, str], wanted: int) -> int:
    taken = 0
    while taken < wanted and limits.refusal(principal, counts) is None:
        counts.add(principal, 1)
        taken += 1
    return taken


def test_a_few_users_cannot_fill_the_table_and_root_and_a_newcomer_always_get_a_place():
    # Was: one uid could take three quarters of the table, so two filled it and root was refused.
    limits = ConnectionLimits.sharing(1000, per_principal=64, per_uid=256)
    counts = ConnectionCounts()
    for uid in range(1001, 1005):  # four users, each as many as it can get
        assert fill(limits, counts, (uid, ""), 10_000) == limits.per_principal
    assert limits.refusal((0, ""), counts) is None
    assert limits.refusal((2000, ""), counts) is None


def test_pods_of_one_uid_are_limited_apart_and_together():
    limits = ConnectionLimits.sharing(1000, per_principal=64, per_uid=256)
    counts = ConnectionCounts()
    taken = [fill(limits, counts, (1000, f"pod-{n}"), 10_000) for n in range(8)]
    assert taken[0] == limits.per_principal and sum(taken) == limits.per_uid
    # Root's pods (most pods run as root) are limited per pod, not per uid.
    assert sum(fill(limits, counts, (0, f"pod-{n}"), 10_000) for n in range(8)) == 8 * limits.per_principal


def test_the_last_places_go_to_principals_with_few_connections():
    limits = ConnectionLimits.sharing(80, per_principal=64, per_uid=256)
    counts = ConnectionCounts()
    uid = 1000
    while counts.total - counts.uids[0] < limits.total - limits.root_reserve - limits.newcomer_reserve:
        fill(limits, counts, (uid, ""), 10_000)
        uid += 1
    # The non-root places left are only for principals with fewer than newcomer_quota.
    assert limits.refusal((1000, ""), counts) is not None
    assert fill(limits, counts, (99_999, ""), 10_000) == limits.newcomer_quota


# --- fair turns ----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_refused_connections_are_remembered_briefly_and_within_bounds():
    # What status shows of refused processes (issue 31) costs a bounded amount of memory,
    # whatever refused peers do, and goes once they stop trying.
    refusals = Refusals()
    for n in range(REFUSED_PRINCIPALS + 5):
        for pid in range(REFUSED_PIDS + 3):
            refusals.note((1000 + n, ""), pid, "full", 0.0)
    current = refusals.current(0.0)
    assert len(current) == REFUSED_PRINCIPALS and all(len(entry.pids) == REFUSED_PIDS for entry in current)
    assert current[0].uid == 1000 + REFUSED_PRINCIPALS + 4  # the most recently refused first
    assert current[0].count == REFUSED_PIDS + 3
    refusals.note((2000, ""), 7, "full", 100.0)
    refusals.note((2000, ""), 8, "full", 100.0 + REFUSED_MEMORY)
    (entry,) = refusals.current(100.5 + REFUSED_MEMORY)
    assert entry.uid == 2000 and list(entry.pids) == [8]  # pid 7 stopped trying: forgotten
    assert refusals.current(200.0) == []


def test_every_user_sees_whose_processes_wait_for_a_place_but_only_its_own_pods():
    document = {"refused": [{"uid": 1000, "pod_uid": "pod-a", "refused": 3, "pids": [11], "reason": "full"},
                            {"uid": 2000, "pod_uid": "pod-b", "refused": 1, "pids": [22], "reason": "full"}]}
    mine, theirs = public_status(document, 1000)["refused"]
    assert mine == document["refused"][0]
    assert theirs == {"uid": 2000, "refused": 1, "pids": [22], "reason": "full"}


def test_turns_go_round_robin_by_principal_not_by_connection():
    # Was: every connection's task read its batch in turn, so twenty busy connections of one
    # user put twenty batches before another user's message.
    order: list[str] = []

    async def main() -> None:
        turns = Turns(clock=FakeClock())
        for principal in ("flood", "innocent"):
            turns.join(principal)

        async def work(principal: str, name: str, batches: int) -> None:
            for _ in range(batches):
                turn = await turns.take(principal)
                order.append(name)
                await trio.sleep(0)  # other tasks become ready meanwhile
                turn.release()
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(work, "flood", f"f{n}", 3)
            await trio.sleep(0)
            nursery.start_soon(work, "innocent", "innocent", 3)

    trio.run(main)
    firsts = [order.index("innocent")]
    positions = [n for n, name in enumerate(order) if name == "innocent"]
    gaps = [b - a for a, b in zip(positions, positions[1:])]
    assert firsts[0] <= 3, order[:10]
    # The flood's 20 connections get one or two batches (one while the innocent was not waiting
    # yet) between two of the innocent's, never twenty.
    assert max(gaps) <= 3, order


def test_a_principal_over_its_share_waits_and_others_do_not():
    async def main() -> None:
        clock = FakeClock()
        throttled: list[str] = []
        turns = Turns(share=0.5, burst=0.1, clock=clock, on_throttled=throttled.append)
        turns.join("busy")
        turns.join("light")
        turn = await turns.take("busy")
        clock.now += 0.3  # a batch of 0.3 s, well over a burst of 0.1
        turn.release()
        light = await turns.take("light")
        light.release()
        assert throttled == []
        with trio.move_on_after(0.05):  # the busy one waits for its share to come back
            await turns.take("busy")
            raise AssertionError("a principal over its share was served at once")
        assert throttled == ["busy"] and turns.throttled("busy") == 1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_debt_is_kept_after_the_last_connection_until_it_is_repaid():
    async def main() -> None:
        clock = FakeClock()
        turns = Turns(share=0.5, burst=0.1, clock=clock)
        turns.join("busy")
        turn = await turns.take("busy")
        clock.now += 1.0  # far over its share
        turn.release()
        turns.leave("busy")  # its last connection
        turns.join("busy")  # and a new one at once: the debt is still there
        with trio.move_on_after(0.05):
            await turns.take("busy")
            raise AssertionError("a principal that reconnected was served with its debt unpaid")
        turns.leave("busy")
        clock.now += 10.0  # time enough to repay it
        turns.join("busy")
        (await turns.take("busy")).release()  # served at once
        assert turns.throttled("busy") == 0  # a fresh meter: the old one was let go

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_principals_tasks_that_waited_for_its_share_take_turns_within_it():
    # Was: each task checked the share once, before it waited; a user's 64 connections that
    # all found it in debt slept together and then all ran, however much each cost.
    async def main() -> None:
        mock = trio.lowlevel.current_clock()
        assert isinstance(mock, trio.testing.MockClock)
        turns = Turns(share=0.5, burst=0.1, clock=trio.current_time)
        turns.join("busy")
        first = await turns.take("busy")
        mock.jump(0.3)  # over its burst: in debt
        first.release()
        ran: list[float] = []

        async def work() -> None:
            turn = await turns.take("busy")
            ran.append(trio.current_time())
            mock.jump(0.3)  # each turn costs more than the share gives back at once
            turn.release()

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(work)
        # (virtual time: MockClock) each waited for what the one before it spent
        gaps = [later - earlier for earlier, later in zip(ran, ran[1:])]
        assert len(ran) == 3 and all(gap >= 0.3 / 0.5 for gap in gaps), gaps

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_principal_whose_connections_are_gone_still_gets_a_turn():
    # Was: KeyError in the daemon (it exited): a watched process's exit, seen after its user's
    # last connection had ended and its meter was let go, asked for a turn of that user.
    async def main() -> None:
        turns = Turns(share=0.5, burst=0.1, clock=trio.current_time)
        turns.join("gone")
        turns.leave("gone")  # not in debt: its meter is let go
        turn = await turns.take("gone")
        assert turn.held
        turn.release()
        other = await turns.take("gone")  # the round goes on
        other.release()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# --- quotas --------------------------------------------------------------------------------------


def test_one_users_registrations_are_held_to_a_device_and_pair_quota():
    # Was: each registration could name 64 invented devices, so one user at its connection
    # limit made the daemon hold about 2.5 GB.
    quota = DeviceQuota(pairs=100, devices=64)
    assert quota.admit("r1", 1000, [f"D{n}" for n in range(64)]) is None
    assert "at most 64 devices" in quota.admit("r2", 1000, ["other"])
    assert quota.admit("r2", 1000, ["D1", "D2"]) is None  # devices it already uses are fine
    assert "pairs" in quota.admit("r3", 1000, [f"D{n}" for n in range(40)])
    assert quota.admit("r3", 2000, ["other"]) is None  # another user has its own quota
    quota.forget("r1")
    assert quota.held(1000) == (2, 2)
    assert quota.admit("r4", 1000, ["other"]) is None


# --- metric label places -------------------------------------------------------------------------


def test_places_evict_the_least_recently_used_key_nobody_uses():
    places = Places(total=3, per_owner=2)
    assert places.take("a", "u1", "c1") == (True, [])
    assert places.take("b", "u1", "c2") == (True, [])
    assert places.take("c", "u1", "c3") == (False, [])  # u1's share is taken and in use
    places.release("c1")
    assert places.take("c", "u1", "c3") == (True, ["a"])
    assert places.take("d", "u2", "c4") == (True, [])
    assert places.take("e", "u2", "c5") == (False, [])  # the table is full and all in use
    assert sorted(places) == ["b", "c", "d"]


# --- the parser ----------------------------------------------------------------------------------


def test_empty_more_frames_count_against_the_message_limit():
    # Was: zero-length MORE frames cost nothing against the 64 KiB limit and were kept for ever.
    parser = zmtp.Parser(max_message=16 * 1024)
    parser.feed(floodkit.GREETING + floodkit.ready())
    with pytest.raises(zmtp.Violation):
        for _ in range(1000):
            parser.feed(floodkit.frame(b"", more=True) * 10)


def test_one_parse_does_a_bounded_amount_of_work():
    parser = zmtp.Parser(max_message=1024)
    parser.feed(floodkit.GREETING + floodkit.ready())
    parser.receive(floodkit.frame(b"\x01X", command=True) * 500 + floodkit.frame(b"last"))
    rounds = 0
    found = []
    while True:
        rounds += 1
        found += parser.parse(64)
        if not parser.stopped:
            break
    assert found == [zmtp.Message((b"last",))] and rounds == 8
