"""The swap pool (issue 29; docs/interceptor.md, "Swapping", *The pool*) on the simulated driver:
the processes of one user share pinned segments of shared memory for swapping, sized by the
scheduler's POOL. Each process registers, ahead of need, free segments until they would take
all the memory on its device (none another process holds), and claims whole segments while it
moves memory out; a segment that is free again goes back to the pool at once, so
another process can move more than an even share of the pool through it. A member that dies
frees what it held; the pool shrinks when POOL falls; the last member removes it; a directory
that is not safely ours is refused, and the process swaps through an area of its own.

Each process has a scripted scheduler of its own (nvshare_py/testing/scripted.py), so that each
message goes exactly when the test wants it; the processes share the simulated device
(SIMCUDA_RESIDENCY_DIR) and the pool (NVSHARE_POOL_DIR, a fresh directory of /dev/shm). Segments
are 8 MiB here (NVSHARE_POOL_SEGMENT) so that the tests stay small."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nvshare_py.testing.residency import MIB, migrations
from nvshare_py.testing.scripted import ScriptedScheduler
from test_simcuda_swapping import EVERYTHING, grant, memory_until, patterned_app

SEGMENT = 8 * MIB
PATIENCE_S = 60.0


@pytest.fixture
def schedulers():
    made: list[ScriptedScheduler] = []

    def make() -> ScriptedScheduler:
        made.append(ScriptedScheduler())
        return made[-1]

    yield make
    for scheduler in made:
        scheduler.close()


@pytest.fixture
def shm():
    """A fresh directory of shared memory for NVSHARE_POOL_DIR (the pool lies in
    <it>/nvshare-pool-<euid>)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    parent = Path(tempfile.mkdtemp(prefix="nvs-pool-", dir="/dev/shm"))
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


def pool_of(shm: Path) -> Path:
    return shm / f"nvshare-pool-{os.geteuid()}"


def segments(shm: Path) -> dict[str, int]:
    """The pool's segment files and their sizes. A segment that retires between the listing
    and its stat (the members remove it while the test looks) is not there."""
    found: dict[str, int] = {}
    for path in pool_of(shm).glob("segment-*"):
        try:
            found[path.name] = path.stat().st_size
        except FileNotFoundError:
            continue
    return found


def eventually(what: str, check, seen=lambda: None):
    """Waits (60 s at most) until check() is true; else fails saying what it saw."""
    deadline = time.monotonic() + PATIENCE_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {PATIENCE_S:g} s: {what}; saw {seen()}")
        time.sleep(0.02)


def pool_env(scheduler: ScriptedScheduler, tmp_path: Path, shm: Path, **extra: str) -> dict[str, str]:
    return {**scheduler.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
            "NVSHARE_POOL_DIR": str(shm), "NVSHARE_POOL_SEGMENT": str(SEGMENT), "NVSHARE_LOG": "debug", **extra}


def area_at_least(scheduler: ScriptedScheduler, nbytes: int) -> dict[str, str]:
    return memory_until(scheduler, lambda fields: int(fields.get("area", 0)) >= nbytes)


def words_in_segments(shm: Path, name: str = "segment-*") -> set[int]:
    """The 32-bit words at the start of every 64 KiB page of the segment files (area.c hands out
    pages of 64 KiB, each run starting with its block's first word); `name`: of those files."""
    found = set()
    for path in pool_of(shm).glob(name):
        data = path.read_bytes()
        found |= {struct.unpack_from("<I", data, at)[0] for at in range(0, len(data), 64 << 10)}
    return found


def moved_out(scheduler: ScriptedScheduler) -> None:
    """A DROP of grant 1 that asks for both 8 MiB allocations out; the RELEASE says nothing of
    them is left on the device."""
    scheduler.send("DROP", device=scheduler.device, grant=1, grace_ms=60_000, reason="quantum", evict=2 * SEGMENT)
    assert scheduler.expect("RELEASE")["resident"] == "0"


def segments_holding(shm: Path, word: int) -> set[str]:
    """The segment files holding a patterned process's words (`word`, `word + 1`)."""
    return {name for name in segments(shm) if {word, word + 1} & words_in_segments(shm, name)}


def segment_pins(simcuda, cuda_app, pid: int) -> list[dict]:
    """Process `pid`'s registrations of whole segments, in the simulated driver's trace."""
    return [p for p in simcuda.read_trace(cuda_app.trace)
            if p["op"] == "pin" and p["bytes"] == SEGMENT and p["pid"] == pid]


def logged_segments(app, step: str) -> list[str]:
    """The segments a member's debug log says it took `step` on ("made", "registered")."""
    return [line.split(f"swap pool: {step} ", 1)[1].split()[0] for line in app.stderr.splitlines()
            if f"swap pool: {step} segment-" in line]


def pinned_copies(lines: list[dict], pid: int, link: str) -> list[dict]:
    return [c for c in lines if c["op"] == "memcpy" and c.get("link") == link and c["pid"] == pid]


def assert_moved_out_through_the_pool(simcuda, cuda_app, pid: int, nbytes: int) -> None:
    """Process `pid` copied `nbytes` out to pinned memory and moved nothing the driver's slow way
    (a migration to the host)."""
    lines = simcuda.read_trace(cuda_app.trace)
    out = pinned_copies(lines, pid, "d2h")
    assert sum(c["bytes"] for c in out if c["pinned"]) == nbytes, out
    assert migrations(lines, direction="to_host", owner=pid) == []


def patterned(cuda_app, env, word: int, *extra: str):
    """A process with two 8 MiB allocations filled with `word` and `word + 1`, which waits, checks
    them through every access path after its grant, and waits again before it ends."""
    return cuda_app(env, "init", f"pattern:plain:{SEGMENT}:{word:#x}", f"pattern:plain:{SEGMENT}:{word + 1:#x}",
                    "sync", "wait", "verify", *extra)


def pool_member(cuda_app, scheduler: ScriptedScheduler, tmp_path: Path, shm: Path, word: int, pool: int, area: int,
                *extra: str, env: dict[str, str] | None = None):
    """A patterned process (`patterned`; `env`: more of its environment) granted its device and
    told POOL `pool` bytes, once its swap area holds `area` bytes."""
    app = patterned(cuda_app, pool_env(scheduler, tmp_path, shm, **(env or {})), word, *extra)
    grant(scheduler, 1)
    app.expect("waiting")
    scheduler.send("POOL", bytes=pool)
    area_at_least(scheduler, area)
    return app


def test_two_processes_of_a_user_move_their_memory_through_the_same_segments(schedulers, cuda_app, simcuda, tmp_path,
                                                                              shm):
    """POOL 16 MiB (two segments) to both processes. A moves its 16 MiB out through two segments
    (its words are in the files), and back; then B moves its 16 MiB out at the pinned rate, more
    than it made of the pool, partly through a segment A made (its words are in it).
    Neither moves anything the slow way, the pool's files are never more than POOL's size plus a
    segment for each member (each member's part may end in a segment it fills in part), and both
    find their data back."""
    sched_a, sched_b = schedulers(), schedulers()
    a = pool_member(cuda_app, sched_a, tmp_path, shm, 0xA0000000, 2 * SEGMENT, 2 * SEGMENT, "wait")
    b = patterned(cuda_app, pool_env(sched_b, tmp_path, shm), 0xB0000000, "wait")
    grant(sched_b, 1)
    b.expect("waiting")
    sched_b.send("POOL", bytes=2 * SEGMENT)
    area_at_least(sched_b, 2 * SEGMENT)  # B registered the segments A made
    sizes = [segments(shm)]

    moved_out(sched_a)
    sizes.append(segments(shm))
    assert {0xA0000000, 0xA0000001} <= words_in_segments(shm)
    a.continue_()
    grant(sched_a, 2, prefetch=2 * SEGMENT)
    a.expect("verified 2")
    sizes.append(segments(shm))

    moved_out(sched_b)
    sizes.append(segments(shm))
    assert {0xB0000000, 0xB0000001} <= words_in_segments(shm)
    made_by_a = set(logged_segments(a, "made"))
    assert segments_holding(shm, 0xB0000000) & made_by_a, (made_by_a, segments(shm))
    b.continue_()
    grant(sched_b, 2, prefetch=2 * SEGMENT)
    b.expect("verified 2")

    lines = simcuda.read_trace(cuda_app.trace)
    for app in (a, b):
        out, back = pinned_copies(lines, app.pid, "d2h"), pinned_copies(lines, app.pid, "h2d")
        assert sum(c["bytes"] for c in out if c["pinned"]) == 2 * SEGMENT, out
        assert sum(c["bytes"] for c in back if c["pinned"]) >= 2 * SEGMENT, back
        assert migrations(lines, direction="to_host", owner=app.pid) == []  # nothing went the slow way
    assert all(len(s) <= 4 and sum(s.values()) <= 4 * SEGMENT for s in sizes), sizes
    assert len(sizes[0]) >= 2, sizes
    # Each registers every segment with its pages mapped first (made by one, mapped by the other):
    # registering maps nothing inside the driver, where the process's copies would wait for it.
    pins = [p for p in lines if p["op"] == "pin" and p["bytes"] == SEGMENT]
    assert {p["pid"] for p in pins} == {a.pid, b.pid} and all(p["present"] == SEGMENT for p in pins), pins
    for app in (a, b):
        app.continue_()
        assert app.wait() == 0, app.stderr


def test_the_maker_of_a_segment_registers_pages_it_made_present_first(schedulers, cuda_app, simcuda, tmp_path, shm):
    """Registering absent pages holds the driver for their making (0.40 s per GiB on an H200's
    /dev/shm, against 0.04 for present ones), and the process's own copies queue behind it: the
    maker makes a segment's pages present (from several threads) before it registers them. The
    simulated driver counts what was present at each registration (mincore)."""
    scheduler = schedulers()
    app = pool_member(cuda_app, scheduler, tmp_path, shm, 0xC0000000, 2 * SEGMENT, 2 * SEGMENT)
    app.continue_()
    app.expect("verified 2")
    app.continue_()
    assert app.wait() == 0, app.stderr
    made = [line for line in app.stderr.splitlines() if "swap pool: made segment-" in line]
    pins = [p for p in simcuda.read_trace(cuda_app.trace) if p["op"] == "pin" and p["bytes"] == SEGMENT]
    assert len(made) >= 2 and len(pins) >= 2, (made, pins)
    assert all(p["how"] == "registered" and p["present"] == SEGMENT for p in pins), pins


def test_a_member_registers_free_segments_for_what_it_could_move_out_and_none_another_member_holds(
        schedulers, cuda_app, simcuda, tmp_path, shm):
    """Registering takes its time (0.05-0.2 s per 512 MiB on an H200) and holds up the process's
    other calls meanwhile: when six tenants of 12 GiB loaded at once, each registered every
    segment of a pool of 36 GiB in turn, most of them already full of another's memory, while
    the first requests waited for room. A holds two of a pool of six; B, joining with 16 MiB on
    its device, registers free segments until they would take its 16 MiB, and none of A's; then
    it moves its 16 MiB out through them, none the driver's slow way."""
    sched_a, sched_b = schedulers(), schedulers()
    a = pool_member(cuda_app, sched_a, tmp_path, shm, 0xA0000000, 6 * SEGMENT, 6 * SEGMENT)
    moved_out(sched_a)
    held_by_a = segments_holding(shm, 0xA0000000)
    assert len(held_by_a) == 2 and len(set(segments(shm)) - held_by_a) >= 4, segments(shm)

    b = patterned(cuda_app, pool_env(sched_b, tmp_path, shm), 0xB0000000)
    grant(sched_b, 1)
    b.expect("waiting")
    sched_b.send("POOL", bytes=6 * SEGMENT)
    area_at_least(sched_b, 2 * SEGMENT)  # registered or made: room for its 16 MiB
    moved_out(sched_b)
    assert_moved_out_through_the_pool(simcuda, cuda_app, b.pid, 2 * SEGMENT)
    b.continue_()
    grant(sched_b, 2, prefetch=2 * SEGMENT)
    b.expect("verified 2")
    assert b.wait() == 0, b.stderr
    registered = logged_segments(b, "registered")
    assert len(registered) <= 2 and not set(registered) & held_by_a, (registered, held_by_a, b.stderr)
    a.continue_()
    grant(sched_a, 2, prefetch=2 * SEGMENT)
    a.expect("verified 2")
    assert a.wait() == 0, a.stderr


def test_a_member_registers_others_segments_only_for_what_the_scheduler_says_it_may_move_out_soon(
        schedulers, cuda_app, simcuda, tmp_path, shm):
    """POOL need= (issue 29): on an H200 hot tenants, last in eviction order, registered the
    segments cold tenants freed while they served, and their requests waited for the
    registrations. A made a pool of six segments and holds two; B joins (making its own spare
    segment, as every member does) and, told it may be asked for nothing soon, registers none of
    the four free ones A made, and says why; told 16 MiB, it registers one more, and moves all
    16 MiB out through the two, none on the swap's path and none the driver's slow way."""
    sched_a, sched_b = schedulers(), schedulers()
    a = pool_member(cuda_app, sched_a, tmp_path, shm, 0xA0000000, 6 * SEGMENT, 6 * SEGMENT)
    moved_out(sched_a)
    b = patterned(cuda_app, pool_env(sched_b, tmp_path, shm), 0xB0000000)
    grant(sched_b, 1)
    b.expect("waiting")
    sched_b.send("POOL", bytes=6 * SEGMENT, need=0)
    eventually("B says it registers no more", lambda: "registers no more segments others made" in b.stderr,
               lambda: b.stderr[-2000:])
    assert logged_segments(b, "registered") == [], b.stderr
    sched_b.send("POOL", bytes=6 * SEGMENT, need=2 * SEGMENT)
    area_at_least(sched_b, 2 * SEGMENT)
    moved_out(sched_b)
    assert_moved_out_through_the_pool(simcuda, cuda_app, b.pid, 2 * SEGMENT)
    assert len(logged_segments(b, "registered")) == 1, b.stderr
    assert "on a swap's path" not in b.stderr, b.stderr
    b.continue_()
    grant(sched_b, 2, prefetch=2 * SEGMENT)
    b.expect("verified 2")
    assert b.wait() == 0, b.stderr
    a.continue_()
    grant(sched_a, 2, prefetch=2 * SEGMENT)
    a.expect("verified 2")
    assert a.wait() == 0, a.stderr


def test_a_member_takes_no_pinning_step_while_it_moves_memory(schedulers, cuda_app, simcuda, tmp_path, shm):
    """A registration holds up the process's other calls for its whole length (the simulated
    driver models it as the H200 showed: the swap engine's moves ran at 7 GB/s beside a thread
    that registered segments, 46 GB/s alone). A made the pool's first segments; B's POOL makes
    it grow by twelve, and both make them (0.32 s to register each here); A is told to move its
    16 MiB out meanwhile. While A's swap-out copies run, A's pinner starts no step (B's goes on:
    the pool was still growing), and A's memory goes out through segments it had."""
    sched_a, sched_b = schedulers(), schedulers()
    slow = {"SIMCUDA_REGISTER_PRESENT_US_PER_MIB": "40000", "SIMCUDA_PINNED_US_PER_MIB": "40000"}
    a = pool_member(cuda_app, sched_a, tmp_path, shm, 0xA0000000, 2 * SEGMENT, 2 * SEGMENT, "wait", env=slow)
    b = patterned(cuda_app, pool_env(sched_b, tmp_path, shm, **slow), 0xB0000000, "wait")
    grant(sched_b, 1)
    b.expect("waiting")
    sched_b.send("POOL", bytes=14 * SEGMENT)

    def pins_by(pid: int) -> list[dict]:
        return segment_pins(simcuda, cuda_app, pid)

    before = len(pins_by(a.pid))
    eventually("A makes a segment of B's growth", lambda: len(pins_by(a.pid)) > before, lambda: pins_by(a.pid))
    moved_out(sched_a)
    lines = simcuda.read_trace(cuda_app.trace)
    out = pinned_copies(lines, a.pid, "d2h")
    assert sum(c["bytes"] for c in out if c["pinned"]) == 2 * SEGMENT, out
    first, last = min(c["start"] for c in out), max(c["end"] for c in out)
    assert [p for p in pins_by(a.pid) if first <= p["start"] < last] == [], (first, last, pins_by(a.pid))
    assert [p for p in pins_by(b.pid) if first <= p["start"] < last], (first, last, pins_by(b.pid))
    a.continue_()
    grant(sched_a, 2, prefetch=2 * SEGMENT)
    a.expect("verified 2")
    b.continue_()  # B still holds its grant
    b.expect("verified 2")
    for app in (a, b):
        app.continue_()
        assert app.wait() == 0, app.stderr


def test_a_member_takes_no_pinning_step_while_its_application_asks_for_the_gpu_or_has_just_got_it(
        schedulers, cuda_app, simcuda, tmp_path, shm):
    """A registration holds up the application's calls too: a request to a tenant whose pinner
    registers the pool's segments (0.2 s each here) would wait for them. A, with 56 MiB on its
    device, joins B's pool of twelve segments while it does not hold its device, and registers
    seven of them one by one (room for its 56 MiB); then its application launches a kernel of
    0.6 s. From its ACQUIRE to the kernel's end (within the pinning grace of its asking and of its
    grant: 3 s here, so that a busy machine's delays stay inside it) A's pinner starts no
    registration but the one it may have been about to start when A asked; it registers the rest
    after."""
    sched_a, sched_b = schedulers(), schedulers()
    device = {"SIMCUDA_MEMORY": "128M"}
    b = patterned(cuda_app, pool_env(sched_b, tmp_path, shm, **device), 0xB0000000, "wait")
    grant(sched_b, 1)
    b.expect("waiting")
    sched_b.send("POOL", bytes=12 * SEGMENT)
    area_at_least(sched_b, 12 * SEGMENT)
    slow = {"SIMCUDA_REGISTER_PRESENT_US_PER_MIB": "25000", "NVSHARE_PINNING_GRACE_MS": "3000", **device}
    a = cuda_app(pool_env(sched_a, tmp_path, shm, **slow), "init",
                 *[f"pattern:plain:{SEGMENT}:{0xA0000000 + k:#x}" for k in range(7)], "sync", "wait",
                 "kernel:600000", "sync", "wait")
    grant(sched_a, 1)
    a.expect("waiting")
    sched_a.send("DROP", device=sched_a.device, grant=1, grace_ms=60_000, reason="quantum")
    sched_a.expect("RELEASE")
    sched_a.send("POOL", bytes=12 * SEGMENT)

    def pins_by_a() -> list[dict]:
        return segment_pins(simcuda, cuda_app, a.pid)

    eventually("A registers a segment of the pool", lambda: len(pins_by_a()) >= 1, pins_by_a)
    a.continue_()
    sched_a.expect("ACQUIRE")
    asked = sched_a.received
    sched_a.send("GRANT", device=sched_a.device, grant=2, mode="on", exclusive=1, quantum_ms=60_000)
    a.expect("waiting")
    [kernel] = [k for k in simcuda.read_trace(cuda_app.trace)
                if k["op"] == "kernel" and k["pid"] == a.pid and k["end"] - k["start"] >= 0.5]
    eventually("A registers room for its 56 MiB", lambda: len(pins_by_a()) >= 7, pins_by_a)
    started = [p for p in pins_by_a() if asked <= p["start"] <= kernel["end"]]
    assert len(started) <= 1, (asked, kernel, pins_by_a())
    assert [p for p in pins_by_a() if p["start"] > kernel["end"]], (kernel, pins_by_a())
    b.continue_()  # B still holds its grant
    b.expect("verified 2")
    for app in (a, b):
        app.continue_()
        assert app.wait() == 0, app.stderr


def test_a_member_takes_no_pinning_step_between_its_memory_coming_back_ahead_and_its_grant(
        schedulers, cuda_app, simcuda, tmp_path, shm):
    """On an H200 a tenant's pinner began making a segment as the tenant's swap-in ahead of its
    grant ended (the end of a swap job wakes the pinner), and the request's last 128 MiB and
    first calls waited 0.8 s for it. A's memory is out in the pool and the pool is to grow; A
    asks, and once the pinning grace of its asking has passed (its pinner grows the pool, a
    segment every 0.32 s), the scheduler tells it to bring its memory back (PREFETCH) and grants
    it half a second after it is back: in between A's pinner starts no step, and it goes on
    growing the pool once granted."""
    sched = schedulers()
    # A grace of 3 s (the pinner's pause after the grant's ending swap-in) against the 0.5 s the
    # test waits before granting: a busy machine's delays stay inside it.
    slow = {"SIMCUDA_REGISTER_PRESENT_US_PER_MIB": "40000", "NVSHARE_PINNING_GRACE_MS": "3000"}
    a = pool_member(cuda_app, sched, tmp_path, shm, 0xA0000000, 2 * SEGMENT, 2 * SEGMENT, "wait", env=slow)
    moved_out(sched)
    sched.send("POOL", bytes=24 * SEGMENT)  # growth for about seven seconds
    a.continue_()  # verify: its first call waits at the closed gate
    sched.expect("ACQUIRE")
    asked = sched.received

    def pins_by_a() -> list[dict]:
        return segment_pins(simcuda, cuda_app, a.pid)

    eventually("A's pinner grows the pool while A waits, once its asking's grace has passed",
               lambda: any(p["start"] > asked + 3.0 for p in pins_by_a()), pins_by_a)
    sched.send("PREFETCH", device=sched.device, resident=3 * SEGMENT)  # all of it (and the 4 KiB no swap moves)
    while int(sched.expect("MEMORY").get("resident", 0)) < 2 * SEGMENT:
        pass
    back = sched.received
    time.sleep(0.5)
    granted = sched.send("GRANT", device=sched.device, grant=2, mode="on", exclusive=1, quantum_ms=60_000)
    a.expect("verified 2")
    eventually("A's pinner goes on growing the pool once granted",
               lambda: any(p["start"] > granted for p in pins_by_a()), pins_by_a)
    assert [p for p in pins_by_a() if back < p["start"] < granted] == [], (back, granted, pins_by_a())
    a.continue_()
    assert a.wait() == 0, a.stderr


def test_a_swap_out_registers_free_segments_another_member_made_rather_than_go_the_slow_way(schedulers, cuda_app,
                                                                                           simcuda, tmp_path, shm):
    """B made the pool (eight segments, each registered in B only); A joins and is told at once
    to move its 32 MiB out, before its pinner (registering slowly here: 1.2 s a segment) has
    caught up, and the pinner takes no step while A's swap-out runs. The swap-out claims free
    segments A has not registered yet and registers them on its way: all 32 MiB go out through
    the pool, none the driver's slow way (a migration to the host), and A finds its data back."""
    sched_a, sched_b = schedulers(), schedulers()
    b = pool_member(cuda_app, sched_b, tmp_path, shm, 0xB0000000, 8 * SEGMENT, 8 * SEGMENT, "wait")
    words = [0xA0000000 + k for k in range(4)]
    slow = {"SIMCUDA_REGISTER_US_PER_MIB": "150000", "SIMCUDA_REGISTER_PRESENT_US_PER_MIB": "150000"}
    a = cuda_app(pool_env(sched_a, tmp_path, shm, **slow),
                 "init", *[f"pattern:plain:{SEGMENT}:{w:#x}" for w in words], "sync", "wait", "verify", "wait")
    grant(sched_a, 1)
    a.expect("waiting")
    sched_a.send("POOL", bytes=8 * SEGMENT)
    memory_until(sched_a, lambda fields: fields.get("pool") == "1")  # A joined
    sched_a.send("DROP", device=sched_a.device, grant=1, grace_ms=60_000, reason="quantum", evict=4 * SEGMENT)
    assert sched_a.expect("RELEASE")["resident"] == "0"

    assert_moved_out_through_the_pool(simcuda, cuda_app, a.pid, 4 * SEGMENT)
    a.continue_()
    grant(sched_a, 2, prefetch=4 * SEGMENT)
    a.expect("verified 4")
    b.continue_()
    b.expect("verified 2")
    for app in (a, b):
        app.continue_()
        assert app.wait() == 0, app.stderr
    assert "registered and claimed segment-" in a.stderr, a.stderr


def test_the_segments_of_a_member_killed_while_it_held_them_are_claimed_by_another(schedulers, cuda_app, simcuda,
                                                                                   tmp_path, shm):
    """A moves its memory out into two segments of the pool and is killed (SIGKILL: no exit
    handler runs). Its member lock went with it: the pool, now B's alone, shrinks to what B's
    POOL and B need (two segments), the free ones retiring first, so the two A held are what is
    left; B finds A gone and moves its own memory out through those, at the pinned rate, without
    a new segment being made."""
    sched_a, sched_b = schedulers(), schedulers()
    a = pool_member(cuda_app, sched_a, tmp_path, shm, 0xA0000000, 2 * SEGMENT, 2 * SEGMENT)
    b = pool_member(cuda_app, sched_b, tmp_path, shm, 0xB0000000, SEGMENT, 2 * SEGMENT, "wait")
    moved_out(sched_a)
    held_by_a = segments_holding(shm, 0xA0000000)
    assert len(held_by_a) == 2, segments(shm)
    a.process.send_signal(signal.SIGKILL)
    a.process.wait(PATIENCE_S)
    eventually("the pool shrinks to A's two segments", lambda: set(segments(shm)) == held_by_a,
               lambda: segments(shm))

    moved_out(sched_b)
    words = words_in_segments(shm)
    assert {0xB0000000, 0xB0000001} <= words and not {0xA0000000, 0xA0000001} & words
    assert set(segments(shm)) == held_by_a  # the same two files: reclaimed, not made anew
    assert_moved_out_through_the_pool(simcuda, cuda_app, b.pid, 2 * SEGMENT)
    b.continue_()
    grant(sched_b, 2, prefetch=2 * SEGMENT)
    b.expect("verified 2")
    b.continue_()
    assert b.wait() == 0, b.stderr


def test_a_pool_shrinks_when_pool_falls_and_what_a_member_still_holds_retires_once_it_is_back(schedulers, cuda_app,
                                                                                              simcuda, tmp_path, shm):
    """POOL 24 MiB: three segments, and one for the one member. A moves 16 MiB out (it holds two).
    POOL 8 MiB: two segments; the free ones retire (unregistered, unmapped, their files removed),
    the two A holds stay. Once its memory is back they are what the pool keeps. POOL 0: none is
    left, and the pinned memory the process has (MEMORY area=) is 0."""
    sched = schedulers()
    a = pool_member(cuda_app, sched, tmp_path, shm, 0xA0000000, 3 * SEGMENT, 3 * SEGMENT, "wait")
    eventually("the pool holds four segments", lambda: len(segments(shm)) == 4, lambda: segments(shm))
    moved_out(sched)

    sched.send("POOL", bytes=SEGMENT)
    eventually("the free segments retire", lambda: len(segments(shm)) == 2, lambda: segments(shm))
    a.continue_()
    grant(sched, 2, prefetch=2 * SEGMENT)
    a.expect("verified 2")
    eventually("the pool holds two segments", lambda: len(segments(shm)) == 2, lambda: segments(shm))
    memory_until(sched, lambda fields: fields.get("area") == str(2 * SEGMENT))

    sched.send("POOL", bytes=0)
    eventually("the pool holds no segment", lambda: not segments(shm), lambda: segments(shm))
    memory_until(sched, lambda fields: fields.get("area") == "0")
    lines = simcuda.read_trace(cuda_app.trace)
    pins = [(p["ptr"], p["bytes"]) for p in lines if p["op"] == "pin" and p["pid"] == a.pid]
    unpins = [(p["ptr"], p["bytes"]) for p in lines if p["op"] == "unpin" and p["pid"] == a.pid]
    assert len(pins) == 4 and sorted(unpins) == sorted(pins)  # every segment let go of, as it was pinned
    a.continue_()
    assert a.wait() == 0, a.stderr
    assert "swap pool: segment-2 retires" in a.stderr and "swap pool: removed segment-2" in a.stderr


def test_the_last_member_to_exit_removes_the_pool_and_the_next_process_starts_anew_after_a_crash(
        schedulers, cuda_app, tmp_path, shm):
    """A and B share a pool (POOL's two segments and one for each of them). When A exits, the
    pool stays, B's size (three); when B exits, the directory is gone. Then C joins and is
    killed: nobody is left to remove its pool. D finds it with no member alive, removes what it
    held and starts it anew."""
    def member(segments_wanted: int, pool_segments: int):
        """A member told POOL `segments_wanted` segments, once the pool holds `pool_segments`
        (it registers no more than its 1 MiB needs: it waits for the pool, not for its area)."""
        sched = schedulers()
        app = cuda_app(pool_env(sched, tmp_path, shm), "init", f"pattern:plain:{MIB}", "wait")
        grant(sched, 1)
        app.expect("waiting")
        sched.send("POOL", bytes=segments_wanted * SEGMENT)
        memory_until(sched, lambda fields: fields.get("pool") == "1")  # joined
        eventually(f"the pool holds {pool_segments} segments", lambda: len(segments(shm)) == pool_segments,
                   lambda: segments(shm))
        return app

    a, b = member(2, 3), member(2, 4)
    a.continue_()
    assert a.wait() == 0, a.stderr
    eventually("the pool is B's size", lambda: len(segments(shm)) == 3, lambda: segments(shm))
    assert (pool_of(shm) / "pool-1.map").exists()
    b.continue_()
    assert b.wait() == 0, b.stderr
    assert not pool_of(shm).exists()

    c = member(3, 4)
    c.process.send_signal(signal.SIGKILL)
    c.process.wait(PATIENCE_S)
    assert len(segments(shm)) == 4  # left behind

    d = member(1, 2)
    assert sorted(segments(shm)) == ["segment-0", "segment-1"]
    d.continue_()
    assert d.wait() == 0, d.stderr
    assert "had no member left (they crashed): removed its 4 segments and started it anew" in d.stderr
    assert not pool_of(shm).exists()


REFUSALS = {  # case: (the reason the warning gives, whether making the case needs root)
    "open-to-others": ("it is open to group or others (mode 777)", False),
    "a-symbolic-link": ("it is a symbolic link", False),
    "another-owner": ("it belongs to uid 12345", True),
    "a-file-of-another-owner": ("it holds stray, which is not ours", True),
}


def swap_out_and_back_told_both(sched: ScriptedScheduler, app) -> None:
    """The scheduler tells a patterned process both POOL and PREPARE of two segments, has all of
    its memory swapped out at a DROP and back at the next grant; the process finds every word
    right and exits 0."""
    grant(sched, 1)
    app.expect("waiting")
    sched.send("POOL", bytes=2 * SEGMENT)
    sched.send("PREPARE", device=sched.device, bytes=2 * SEGMENT)
    area_at_least(sched, 2 * SEGMENT)
    moved_out(sched)
    app.continue_()
    grant(sched, 2, prefetch=2 * SEGMENT)
    app.expect("verified 2")
    assert app.wait() == 0, app.stderr


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_pool_directory_that_is_not_safely_ours_is_refused_and_the_process_swaps_through_its_own_area(
        schedulers, cuda_app, simcuda, tmp_path, shm, case):
    """The pool's directory must be ours alone: a process that finds it open to others, a
    symbolic link, owned by another user, or holding a file of another user maps and pins
    nothing there, says why once, and swaps through a private area as PREPARE says."""
    reason, needs_root = REFUSALS[case]
    if needs_root and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    pool = pool_of(shm)
    if case == "a-symbolic-link":
        (shm / "elsewhere").mkdir(mode=0o700)
        pool.symlink_to(shm / "elsewhere")
    else:
        pool.mkdir(mode=0o700)
    if case == "open-to-others":
        pool.chmod(0o777)
    elif case == "another-owner":
        os.chown(pool, 12345, 12345)
    elif case == "a-file-of-another-owner":
        (pool / "stray").write_bytes(b"")
        os.chown(pool / "stray", 12345, 12345)
    before = sorted(p.name for p in pool.iterdir())
    sched = schedulers()
    app = patterned(cuda_app, pool_env(sched, tmp_path, shm), 0xA0000000)
    swap_out_and_back_told_both(sched, app)
    assert sorted(p.name for p in pool.iterdir()) == before  # nothing was made there
    warnings = [line for line in app.stderr.splitlines() if "swap pool" in line and "warn" in line]
    assert len(warnings) == 1 and f"is not used ({reason})" in warnings[0], app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    assert [(p["how"], p["bytes"]) for p in lines if p["op"] == "pin"] == [("registered", 64 * MIB)]  # its own
    out = pinned_copies(lines, app.pid, "d2h")
    assert sum(c["bytes"] for c in out if c["pinned"]) == 2 * SEGMENT, out


def test_with_the_pool_turned_off_pool_is_ignored_and_prepare_pins_an_area_of_its_own(schedulers, cuda_app, simcuda,
                                                                                      tmp_path, shm):
    """NVSHARE_POOL=0: the process swaps as before the pool: POOL changes nothing, PREPARE pins a
    private area, no directory is made in shared memory."""
    sched = schedulers()
    app = patterned(cuda_app, pool_env(sched, tmp_path, shm, NVSHARE_POOL="0"), 0xA0000000)
    swap_out_and_back_told_both(sched, app)
    assert list(shm.iterdir()) == [] and "swap pool" not in app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    assert [(p["how"], p["bytes"]) for p in lines if p["op"] == "pin"] == [("registered", 64 * MIB)]


def test_every_family_comes_back_intact_through_every_access_path_after_a_swap_through_the_pool(
        schedulers, cuda_app, simcuda, tmp_path, shm):
    """tests/test_simcuda_swapping.py's family test with the pool: plain, pitched, async, pool
    and VMM memory go out through pool segments and come back before the gate opens; a copy, an
    async copy, a memset, a kernel, a graph and a host function all find the data. A PREPARE
    beside the POOL pins nothing of the process's own: a member's room is the pool's."""
    sched = schedulers()
    app = patterned_app(cuda_app, pool_env(sched, tmp_path, shm, NVSHARE_VMM="swap"))
    grant(sched, 1)
    app.expect("waiting")
    sched.send("POOL", bytes=2 * SEGMENT)
    sched.send("PREPARE", device=sched.device, bytes=EVERYTHING)
    area_at_least(sched, 2 * SEGMENT)
    sched.send("DROP", device=sched.device, grant=1, grace_ms=60_000, reason="quantum", evict=EVERYTHING)
    assert sched.expect("RELEASE")["resident"] == "0"
    lines = simcuda.read_trace(cuda_app.trace)
    out = pinned_copies(lines, app.pid, "d2h")
    assert sum(c["bytes"] for c in out if c["pinned"]) == EVERYTHING, out
    assert migrations(lines, direction="to_host") == []
    app.continue_()
    grant(sched, 2, prefetch=EVERYTHING)
    app.expect("verified 5")
    assert app.wait() == 0, app.stderr
    pins = [(p["how"], p["bytes"]) for p in simcuda.read_trace(cuda_app.trace) if p["op"] == "pin"]
    assert pins == [("registered", SEGMENT)] * 3  # the pool's two segments and its member's one, nothing else


PROBE_POOL = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "probe_pool_pinning.py"


def test_the_pool_pinning_probe_registers_absent_and_present_pages_as_it_says(simcuda, shm, tmp_path):
    """benchmarks/gpu/probe_pool_pinning.py (what growing the pool costs on a GPU host), run on the
    simulated driver: every step is measured, and the first process's registrations find their
    pages absent where a variant only fallocated them and present where it mapped or made them
    from four threads first, as the variants say; the second process registers pages the first
    one made without mapping them first. The simulated driver records what was present (mapped)
    at each registration."""
    trace = tmp_path / "trace.jsonl"
    run = subprocess.run([sys.executable, str(PROBE_POOL), "--gib", "0", "--segment-mib", "8", str(shm)],
                         env=simcuda.env(trace=str(trace), SIMCUDA_RESIDENCY_DIR=str(tmp_path)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)[str(shm)]
    assert "error" not in result and "error" not in result["second_process"], result
    steps = ("fallocate", "fallocate_4_threads", "register", "register_4_threads", "map_present_4_threads",
             "register_mapped", "populate_4_threads", "register_populated")
    assert all(result[f"{step}_s_per_gib"] >= 0 for step in steps), result
    assert "error" not in result["copies"] and result["copies"]["alone_GBps"] > 0, result
    pins = [p for p in simcuda.read_trace(trace) if p["op"] == "pin"]
    by_process: dict[int, list[int]] = {}
    for pin in pins:
        assert pin["how"] == "registered" and pin["bytes"] == 8 * MIB, pin
        by_process.setdefault(pin["pid"], []).append(pin["present"])
    first, second = sorted(by_process.values(), key=len, reverse=True)
    # the steps: 4 + 4 absent, 4 + 4 present; the copies beside growth: 4 + 4 absent (fallocated), 4 present
    assert sorted(first) == [0] * 16 + [8 * MIB] * 12, by_process
    assert second == [0] * 4, by_process  # another's pages, not mapped here: registering maps them
