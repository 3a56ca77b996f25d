"""Swapping by the interceptor on the simulated driver with residency modelled
(docs/interceptor.md "Swapping"): a process told to evict moves its converted memory to the host
in bulk, at prefetch cost, before it releases; a grant that allows a prefetch brings it back in
bulk before the process's kernels run, so they fault nothing; an EVICT to a process that does
not hold the device moves the least recently used, largest allocations first and is answered
with what stays resident.

The scheduler here is a script (a pyzmq ROUTER speaking docs/protocol.md) so that each message
of the residency protocol is sent exactly when the test wants it; the scheduler's own rules for
when to send them are tested with its core."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal

import pytest

from nvshare_py.testing.residency import MIB, migrations, moved
from nvshare_py.testing.scripted import ScriptedScheduler


@pytest.fixture
def scripted():
    scheduler = ScriptedScheduler()
    yield scheduler
    scheduler.close()


def grant(scheduler: ScriptedScheduler, number: int, **extra) -> None:
    scheduler.expect("ACQUIRE")
    scheduler.send("GRANT", device=scheduler.device, grant=number, mode="on", exclusive=1, quantum_ms=60_000, **extra)


@pytest.mark.parametrize("advise", ["0", "1"])
def test_evict_on_release_and_prefetch_on_grant_move_memory_in_bulk(scripted, cuda_app, simcuda, tmp_path, advise):
    """The same with NVSHARE_ADVISE=1: advice (preferred location: the device) does not keep a
    prefetch to the host from moving the pages, and stays on the allocations."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path), "NVSHARE_ADVISE": advise}
    app = cuda_app(env, "init", "alloc:plain:16777216", "alloc:plain:8388608", "kernel:1000", "sync",
                   "wait", "kernel:1000", "sync")
    grant(scripted, 1)
    app.expect("waiting")  # its first kernel faulted its 24 MiB in
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum", evict=24 * MIB)
    release = scripted.expect("RELEASE")
    assert (release["grant"], release["reason"], release["resident"]) == ("1", "drop", "0")
    # The swap-out's stream was synchronised before the RELEASE: its migrations are in the trace.
    out = migrations(simcuda.read_trace(cuda_app.trace), direction="to_host", owner=app.pid)
    assert [(m["cause"], m["bytes"]) for m in out] == [("prefetch", 16 * MIB), ("prefetch", 8 * MIB)]

    app.continue_()
    grant(scripted, 2, prefetch=24 * MIB)
    assert app.wait() == 0, app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    assert moved(lines, owner=app.pid, cause="prefetch", direction="to_device") == 24 * MIB
    assert moved(lines, owner=app.pid, cause="fault") == 24 * MIB  # the first touch only
    last_kernel = max((line for line in lines if line["op"] == "kernel"), key=lambda line: line["start"])
    brought_in = [m for m in migrations(lines, direction="to_device", cause="prefetch")]
    assert all(m["end"] <= last_kernel["start"] + 1e-6 for m in brought_in)  # before the kernel ran
    memory = [text for text in scripted.seen if text.startswith("NVSHARE/1 MEMORY") and "resident=0" in text]
    assert memory, scripted.seen  # the scheduler heard that nothing stayed resident
    advice = [line for line in lines if line["op"] == "advise"]
    assert len(advice) == (4 if advise == "1" else 0)  # given once per allocation, never taken back


def test_a_drop_without_evict_moves_nothing(scripted, cuda_app, simcuda, tmp_path):
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path)}
    app = cuda_app(env, "init", "alloc:plain:16777216", "kernel:1000", "sync", "wait", "kernel:1000", "sync")
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum")
    assert "resident" not in scripted.expect("RELEASE")
    app.continue_()
    grant(scripted, 2, prefetch=16 * MIB)  # nothing was swapped: nothing to bring back
    assert app.wait() == 0, app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    assert migrations(lines, cause="prefetch") == []
    assert moved(lines, owner=app.pid) == 16 * MIB  # the first touch, nothing else


def test_evict_moves_the_largest_of_the_oldest_allocations_first(scripted, cuda_app, simcuda, tmp_path):
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path)}
    app = cuda_app(env, "init", "alloc:plain:8388608", "alloc:plain:16777216", "kernel:1000", "sync", "wait")
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum")
    scripted.expect("RELEASE")
    scripted.send("EVICT", device=scripted.device, bytes=4 * MIB)  # it holds nothing now
    assert scripted.expect("EVICTED")["resident"] == str(8 * MIB)
    app.continue_()
    assert app.wait() == 0, app.stderr
    out = migrations(simcuda.read_trace(cuda_app.trace), direction="to_host", owner=app.pid)
    assert [(m["cause"], m["bytes"]) for m in out] == [("prefetch", 16 * MIB)]


def moving_out(scripted, cuda_app, tmp_path, us_per_mib: int, *after: str):
    """A process of 16 allocations of 8 MiB that ran once, released the device, has a swap area
    for all of it and is moving all of it out for an EVICT, over a link of `us_per_mib`; `after`:
    its steps once it is let go on from its first `wait`. Returns (app, total, the MEMORY report
    that showed the move under way)."""
    blocks = 16
    total = blocks * 8 * MIB
    env = {**scripted.env, "SIMCUDA_MEMORY": "256M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_PINNED_US_PER_MIB": str(us_per_mib), "SIMCUDA_REGISTER_HUGE_US_PER_MIB": "0",
           "SIMCUDA_REGISTER_US_PER_MIB": "0", "SIMCUDA_PIN_US_PER_MIB": "0"}
    app = cuda_app(env, "init", *[f"alloc:plain:{8 * MIB}"] * blocks, "kernel:1000", "sync", "wait", *after)
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum")
    scripted.expect("RELEASE")
    scripted.send("PREPARE", device=scripted.device, bytes=total)
    memory_until(scripted, lambda fields: int(fields.get("area", 0)) >= total)
    scripted.send("EVICT", device=scripted.device, bytes=total)
    left = memory_until(scripted, lambda fields: int(fields.get("resident", total)) < total)  # under way
    return app, total, left


def test_a_prefetch_while_an_evict_moves_memory_out_takes_the_evict_back(scripted, cuda_app, simcuda, tmp_path):
    """The process asks for the device while its memory moves out for an EVICT (its ACQUIRE
    crossed it: it was idle when the scheduler chose it): the scheduler's PREFETCH takes the EVICT
    back. The move stops after the pieces in flight, EVICTED says what stayed, and what had left
    comes back ahead of the grant."""
    # A slow link (20 ms per MiB: 2.6 s for the whole move), so that the PREFETCH comes early in it.
    app, total, left = moving_out(scripted, cuda_app, tmp_path, 20000, "kernel:1000", "sync")
    app.continue_()  # its next kernel waits at the closed gate: it asks
    scripted.expect("ACQUIRE")
    scripted.send("PREFETCH", device=scripted.device, resident=total)
    stayed = int(scripted.expect("EVICTED")["resident"])
    assert 0 < stayed <= int(left["resident"]), (stayed, left)
    memory_until(scripted, lambda fields: int(fields.get("resident", 0)) == total)  # back before any grant
    scripted.send("GRANT", device=scripted.device, grant=2, mode="on", exclusive=1, quantum_ms=60_000)  # its ACQUIRE above
    assert app.wait() == 0, app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    out = sum(c["bytes"] for c in lines if c["op"] == "memcpy" and c.get("link") == "d2h" and c["pid"] == app.pid)
    back = sum(c["bytes"] for c in lines if c["op"] == "memcpy" and c.get("link") == "h2d" and c["pid"] == app.pid)
    assert out == back == total - stayed  # what left came back, and no more left after the cut
    assert migrations(lines, direction="to_host") == []


def test_an_application_that_allocates_while_its_memory_moves_out_asks_before_its_kernel(
        scripted, cuda_app, simcuda, tmp_path):
    """A request's first allocations come before its first kernel: a process whose memory moves
    out for an EVICT asks for the device (ACQUIRE) when its application allocates, with no kernel
    at the gate yet, so that the scheduler can take the EVICT back before the move is over (on an
    H200 the kernel came 1.1-5.3 s after such a request, the move holding the process back)."""
    # A slow link (60 ms per MiB: 7.7 s for the whole move), so that the allocation comes early in
    # it even on a busy machine.
    app, total, _ = moving_out(scripted, cuda_app, tmp_path, 60000, f"alloc:plain:{2 * MIB}", "wait",
                               "kernel:1000", "sync")
    app.continue_()  # it allocates, then stops before its kernel
    scripted.expect("ACQUIRE")
    app.expect("waiting")
    everything = total + 2 * MIB  # with the new allocation
    scripted.send("PREFETCH", device=scripted.device, resident=everything)  # the EVICT taken back
    stayed = int(scripted.expect("EVICTED")["resident"])
    assert stayed < everything, stayed
    memory_until(scripted, lambda fields: int(fields.get("resident", 0)) == everything)
    scripted.send("GRANT", device=scripted.device, grant=2, mode="on", exclusive=1, quantum_ms=60_000)
    app.continue_()
    assert app.wait() == 0, app.stderr


# --- the swap engine: a pinned swap area, copies at link speed, discard (issue 18) --------------

FAMILIES = [("plain", 4 * MIB), ("pitch", MIB), ("async", 2 * MIB), ("pool", 2 * MIB), ("vmm", 2 * MIB)]
CONVERTED = 4 * MIB + 3 * MIB + 2 * MIB + 2 * MIB  # the pitched one is 3 rows of 1 MiB
EVERYTHING = CONVERTED + 2 * MIB


def memory_until(scheduler: ScriptedScheduler, ready) -> dict[str, str]:
    """The MEMORY reports until one satisfies `ready`."""
    while not ready(fields := scheduler.expect("MEMORY")):
        pass
    return fields


def patterned_app(cuda_app, env):
    steps = ["init"] + [f"pattern:{family}:{size}" for family, size in FAMILIES] + ["sync", "wait", "verify",
                                                                                   "unpattern"]
    return cuda_app(env, *steps)


def test_a_pinned_area_makes_swapping_copies_and_every_access_path_finds_the_data_back(scripted, cuda_app, simcuda,
                                                                                       tmp_path):
    """PREPARE: the process pins a swap area (in the background). DROP evict=: every converted
    allocation (plain, pitched, async, pool) is copied to it over the device-to-host link and
    discarded, the VMM memory copied and its physical handle released; nothing migrates. GRANT:
    the pages are made resident again without copying, the bytes copied back over the other
    link, the VMM handle re-made at the same address, all before the gate opens: a copy, an
    async copy, a memset, a kernel, a graph and a host function all find the data."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_REGISTER_HUGE_US_PER_MIB": "20"}
    app = patterned_app(cuda_app, env)
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("PREPARE", device=scripted.device, bytes=32 * MIB)
    ready = memory_until(scripted, lambda fields: int(fields.get("area", 0)) >= 32 * MIB)
    assert ready["engine"] == "copy"
    before = len(scripted.seen)
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum", evict=EVERYTHING)
    release = scripted.expect("RELEASE")
    assert release["resident"] == "0"
    # The move said how far it got as it went: resident falling, step by step, before the RELEASE.
    progress = [int(text.split("resident=")[1].split("\n")[0]) for text in scripted.seen[before:-1]
                if text.startswith("NVSHARE/1 MEMORY") and "resident=" in text]
    assert len(progress) >= 3 and progress == sorted(progress, reverse=True), progress
    lines = simcuda.read_trace(cuda_app.trace)
    out = [c for c in lines if c["op"] == "memcpy" and c.get("link") == "d2h" and c["pid"] == app.pid]
    assert sum(c["bytes"] for c in out) == EVERYTHING
    assert sum(d["bytes"] for d in lines if d["op"] == "discard") == CONVERTED
    assert [(p["event"], p["bytes"]) for p in lines if p["op"] == "physical"] == [("reserve", 2 * MIB),
                                                                                  ("release", 2 * MIB)]
    assert migrations(lines, direction="to_host") == []  # nothing went the slow way

    app.continue_()
    grant(scripted, 2, prefetch=EVERYTHING)
    app.expect("verified 5")
    assert app.wait() == 0, app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    back = [c for c in lines if c["op"] == "memcpy" and c.get("link") == "h2d" and c["pid"] == app.pid]
    assert sum(c["bytes"] for c in back) == EVERYTHING
    assert moved(lines, owner=app.pid, cause="populate") == CONVERTED
    # The VMM memory was made again at its address, and the application's own handle frees it.
    assert [(p["event"], p["bytes"]) for p in lines if p["op"] == "physical"][-2:] == [("reserve", 2 * MIB),
                                                                                        ("release", 2 * MIB)]


def test_vmm_memory_stays_when_the_process_says_allow(scripted, cuda_app, simcuda, tmp_path):
    """NVSHARE_VMM=allow: VMM memory is counted as memory that cannot move; a DROP that asks for
    everything moves the converted allocations and leaves the VMM handle mapped."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_REGISTER_HUGE_US_PER_MIB": "20", "NVSHARE_VMM": "allow"}
    app = patterned_app(cuda_app, env)
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("PREPARE", device=scripted.device, bytes=32 * MIB)
    memory_until(scripted, lambda fields: int(fields.get("area", 0)) >= 32 * MIB)
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum", evict=EVERYTHING)
    assert scripted.expect("RELEASE")["resident"] == "0"  # of what can move: the VMM memory is not part of it
    lines = simcuda.read_trace(cuda_app.trace)
    assert [p["event"] for p in lines if p["op"] == "physical"] == ["reserve"]  # never released
    app.continue_()
    grant(scripted, 2, prefetch=EVERYTHING)
    app.expect("verified 5")
    assert app.wait() == 0, app.stderr


def test_a_driver_without_discard_swaps_by_prefetch_and_says_so(scripted, cuda_app, simcuda, tmp_path):
    """A CUDA 12.8 driver has no cuMemDiscardBatchAsync: the engine says "migrate", converted
    memory moves by cuMemPrefetchAsync (the old path), VMM memory stays, and the data is there
    after the grant all the same."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_DRIVER_VERSION": "12080"}
    app = patterned_app(cuda_app, env)
    grant(scripted, 1)
    app.expect("waiting")
    report = memory_until(scripted, lambda fields: "engine" in fields)
    assert report["engine"] == "migrate"
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum", evict=EVERYTHING)
    assert scripted.expect("RELEASE")["resident"] == str(2 * MIB)  # the VMM memory could not move
    lines = simcuda.read_trace(cuda_app.trace)
    assert moved(lines, owner=app.pid, cause="prefetch", direction="to_host") == CONVERTED
    assert not [line for line in lines if line["op"] == "discard"]
    app.continue_()
    grant(scripted, 2, prefetch=EVERYTHING)
    app.expect("verified 5")
    assert app.wait() == 0, app.stderr


def test_a_swap_discards_a_batch_of_blocks_in_one_call_and_makes_them_anew_in_one_call(scripted, cuda_app, simcuda, tmp_path):
    """A real driver pays for each call: the engine gives up the pages of a batch of blocks in
    one cuMemDiscardBatchAsync call, and makes them anew in one cuMemDiscardAndPrefetchBatchAsync
    before copying them back, not one call a block. Every byte comes back before the gate opens,
    and the data is intact."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_REGISTER_HUGE_US_PER_MIB": "20"}
    app = cuda_app(env, "init", *[f"pattern:plain:{MIB}"] * 16, "sync", "wait", "verify", "unpattern")
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("PREPARE", device=scripted.device, bytes=16 * MIB)
    memory_until(scripted, lambda fields: int(fields.get("area", 0)) >= 16 * MIB)
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum", evict=16 * MIB)
    assert scripted.expect("RELEASE")["resident"] == "0"
    lines = simcuda.read_trace(cuda_app.trace)
    discards = [d for d in lines if d["op"] == "discard" and d["pid"] == app.pid]
    # a job moves in batches of an eighth of itself here: 2 blocks of 1 MiB each
    calls = [d for d in discards if d["range"] == 0]
    assert sum(d["bytes"] for d in discards) == 16 * MIB and len(calls) == 8, discards

    app.continue_()
    grant(scripted, 2, prefetch=16 * MIB)
    app.expect("verified 16")
    assert app.wait() == 0, app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    back = [c for c in lines if c["op"] == "memcpy" and c.get("link") == "h2d" and c["pid"] == app.pid]
    made = [p for p in lines if p["op"] == "prefetch" and p["api"] == "cuMemDiscardAndPrefetchBatchAsync"
            and p["pid"] == app.pid]
    assert sum(c["bytes"] for c in back) == 16 * MIB
    assert sum(p["bytes"] for p in made) == 16 * MIB and len([p for p in made if p["range"] == 0]) == 8, made


# --- how the swap area is pinned (area.c) ------------------------------------------------------

AREA = 128 * MIB  # two chunks of 64 MiB
HUGE_PAGE = 2 * MIB


def mapped_ranges(pid: int) -> list[tuple[int, int]]:
    """The address ranges mapped in process `pid` (/proc/<pid>/maps)."""
    ranges = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            low, high = line.split()[0].split("-")
            ranges.append((int(low, 16), int(high, 16)))
    return ranges


def overlapping(pins: list[dict], mapped: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The pinned ranges (trace lines) that overlap one of the mapped ranges: (ptr, low, high)."""
    return [(pin["ptr"], low, high) for pin in pins for low, high in mapped
            if low < pin["ptr"] + pin["bytes"] and pin["ptr"] < high]


def kernel_populates() -> bool:
    """Whether this kernel makes pages present on madvise(MADV_POPULATE_WRITE) (Linux 5.14)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    region = libc.mmap(None, page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    try:
        return libc.madvise(region, page, 23) == 0  # MADV_POPULATE_WRITE
    finally:
        libc.munmap(region, page)


@pytest.mark.parametrize("refused", [False, True], ids=["registered", "registering-refused"])
def test_the_swap_area_is_registered_huge_page_memory_given_back_unpinned_and_unmapped(scripted, cuda_app, simcuda,
                                                                                      tmp_path, refused):
    """The area's chunks are anonymous memory aligned to 2 MiB and advised to transparent huge
    pages, registered with cuMemHostRegister (0.19 s per GiB on an H200, where cuMemHostAlloc
    costs 0.43). Where the driver refuses to register (SIMCUDA_HOST_REGISTER_ERROR), the process
    warns once, naming the error, and pins its chunks with cuMemHostAlloc instead. Either way the
    data goes out through the area at link speed and comes back intact, and the chunks the area
    gives back (PREPARE bytes=0) are unpinned the way they were pinned and no longer mapped. A
    child forked meanwhile does not get the registered chunks (MADV_DONTFORK: nothing pinned is
    copied for it)."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path)}
    if refused:
        env["SIMCUDA_HOST_REGISTER_ERROR"] = "801"  # CUDA_ERROR_NOT_SUPPORTED
    app = cuda_app(env, "init", *[f"pattern:{family}:{size}" for family, size in FAMILIES], "sync", "wait", "fork:60",
                   "verify", "wait", "unpattern")
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("PREPARE", device=scripted.device, bytes=AREA)
    assert memory_until(scripted, lambda fields: int(fields.get("area", 0)) >= AREA)["engine"] == "copy"
    pins = [line for line in simcuda.read_trace(cuda_app.trace) if line["op"] == "pin" and line["pid"] == app.pid]
    how = "allocated" if refused else "registered"
    assert [(pin["how"], pin["bytes"]) for pin in pins] == [(how, 64 * MIB)] * 2, pins
    if not refused:
        assert all(pin["huge"] and pin["ptr"] % HUGE_PAGE == 0 for pin in pins), pins
        if kernel_populates():  # made present first (most of what registering costs), then registered
            assert all(pin["present"] == pin["bytes"] for pin in pins), pins

    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum", evict=EVERYTHING)
    assert scripted.expect("RELEASE")["resident"] == "0"
    moved_out = [c for c in simcuda.read_trace(cuda_app.trace)
                 if c["op"] == "memcpy" and c.get("link") == "d2h" and c["pid"] == app.pid]
    assert sum(c["bytes"] for c in moved_out) == EVERYTHING, moved_out  # into the area, over the link
    app.continue_()
    child = int(app.expect("child").split()[1])
    try:
        if not refused:
            assert not overlapping(pins, mapped_ranges(child))
    finally:
        os.kill(child, signal.SIGKILL)  # it would sleep on, holding the app's output open
    grant(scripted, 2, prefetch=EVERYTHING)
    app.expect("verified 5")  # every family's pattern came back through the area
    app.expect("waiting")
    lines = simcuda.read_trace(cuda_app.trace)
    moved_in = [c for c in lines if c["op"] == "memcpy" and c.get("link") == "h2d" and c["pid"] == app.pid]
    assert sum(c["bytes"] for c in moved_in) == EVERYTHING, moved_in
    assert migrations(lines, direction="to_host") == []  # nothing went the slow way

    scripted.send("PREPARE", device=scripted.device, bytes=0)
    memory_until(scripted, lambda fields: fields.get("area") == "0")
    unpins = [line for line in simcuda.read_trace(cuda_app.trace) if line["op"] == "unpin" and line["pid"] == app.pid]
    assert sorted((u["how"], u["ptr"], u["bytes"]) for u in unpins) == sorted((p["how"], p["ptr"], p["bytes"])
                                                                              for p in pins)
    assert not overlapping(pins, mapped_ranges(app.pid))  # no chunk is mapped any more
    app.continue_()
    assert app.wait() == 0, app.stderr
    warnings = [line for line in app.stderr.splitlines() if "registering host memory for the swap area" in line]
    if refused:
        assert len(warnings) == 1 and "CUDA_ERROR_NOT_SUPPORTED" in warnings[0], app.stderr
    else:
        assert warnings == [], app.stderr


def test_a_holder_waiting_for_its_queued_work_still_gets_its_swap_area_pinned(scripted, cuda_app, simcuda, tmp_path):
    """The area is pinned by a thread of its own. A holder whose program waits in a synchronise
    for seconds of queued work keeps the worker in an idle probe that waits for the same work;
    pinned between the worker's jobs, its area grew only once the work was done, and its
    handoffs stayed priced at the slow path's cost meanwhile (on an H200, a whole first
    quantum). Here the area is ready while the program still waits."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_REGISTER_HUGE_US_PER_MIB": "1000", "SIMCUDA_REGISTER_US_PER_MIB": "1000",
           "NVSHARE_IDLE_RELEASE_MS": "20"}
    app = cuda_app(env, "init", f"alloc:plain:{16 * MIB}", "kernel:8000000", "sync", "wait")
    grant(scripted, 1)
    app.expect("launched")
    scripted.send("PREPARE", device=scripted.device, bytes=256 * MIB)
    memory_until(scripted, lambda fields: int(fields.get("area", 0)) >= 256 * MIB)
    ready = scripted.received
    synced = float(app.expect("synced").split("t=")[1].split()[0])
    assert ready < synced, (ready, synced, scripted.seen[-3:])
    app.continue_()
    assert app.wait() == 0, app.stderr
