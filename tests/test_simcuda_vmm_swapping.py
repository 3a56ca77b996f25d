"""VMM memory swapped by the interceptor, end to end (issue 31): programs that allocate the way
PyTorch's expandable segments do (nvshare_py/testing/segments.py: one reserved range, many small
handles mapped side by side, one cuMemSetAccess over each run, handles unmapped and released one
by one) share the simulated GPU under the real scheduler with a memory budget that holds one of
them, so that every handoff moves the other one's handles out (unmapped and released: the
simulated driver gives their values out again, as the real one does) and back.

The simulated driver models what this depends on, as measured on an H200 (tests/simcuda/README.md):
released handle values come back from cuMemCreate, ranges of several mappings (with gaps) are
taken by cuMemUnmap and cuMemSetAccess, kernels and copies span mappings side by side, and a copy
of memory that is not mapped or has no access is refused, a kernel touching it faults."""

from __future__ import annotations

import pytest

from nvshare_py.testing.residency import MIB
from nvshare_py.testing.scheduler import wait_for
from nvshare_py.testing.scripted import ScriptedScheduler

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"
HANDLES, ROUNDS = 24, 4  # 48 MiB each at first, up to 70 MiB (segments.py: 2-4 handles more a round)
SWAPPED_OUT = 20 * MIB  # more handles out than cuMemCreate's old "aside" loop could step over (8)


def reported(scheduler, pid: int) -> dict:
    """What `pid` last reported of its memory on the device ({} before it did)."""
    for client in scheduler.status()["clients"]:
        if client["pid"] == pid and GPU in client["devices"]:
            return client["devices"][GPU]
    return {}


@pytest.fixture
def scripted():
    scheduler = ScriptedScheduler()
    yield scheduler
    scheduler.close()


def swapped(scheduler, pid: int) -> int:
    """The bytes of `pid`'s memory swapped out, as it last reported them."""
    return reported(scheduler, pid).get("swapped", 0)


def area(scheduler, pid: int) -> int:
    """The bytes of `pid`'s pinned swap area, as it last reported them."""
    return (reported(scheduler, pid).get("swap") or {}).get("area", 0)


def test_expandable_segments_swap_out_and_back_intact_round_after_round(scheduler_factory, cuda_app, simcuda,
                                                                        tmp_path):
    """Two programs, each in turn: while its handles are swapped out and the other holds the GPU,
    it maps new handles (created, mapped and given access before its grant) and fills them
    (which waits for the grant, and the grant brings the rest back), then reads every handle's
    value back, and every other round unmaps and releases a run. The default NVSHARE_VMM swaps.
    Every handle keeps its value in every round, and the swapped-out handles' physical memory
    is given back to the device (the simulated driver's trace)."""
    scheduler = scheduler_factory(tq=60)
    scheduler.request("set-budget", device=GPU, bytes=80 * MIB)
    env = {**scheduler.env, "SIMCUDA_MEMORY": "256M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_REGISTER_HUGE_US_PER_MIB": "20", "NVSHARE_LOG": "debug"}
    apps = [cuda_app(env, "--handles", str(HANDLES), "--rounds", str(ROUNDS), "--step", "--tag", str(tag),
                     module="nvshare_py.testing.segments") for tag in (1, 2)]
    for app in apps:
        app.expect("ready", timeout=60)
        # VMM memory moves only through the pinned swap area (pinned in the background after the
        # scheduler's PREPARE): an eviction before it is ready would move none of it.
        wait_for(lambda: area(scheduler, app.pid) >= SWAPPED_OUT, what=f"pid {app.pid}'s swap area pinned")
    for round_ in range(ROUNDS):
        for app in apps:
            # Its memory went out when the other one's last work was granted (from the second round
            # on: before, the other one may have found room without it).
            if round_ > 0:
                wait_for(lambda: swapped(scheduler, app.pid) >= SWAPPED_OUT,
                         what=f"round {round_}: pid {app.pid} swapped out by {SWAPPED_OUT} bytes")
            app.continue_()
            line = app.expect(f"round {round_} ", timeout=60)
            assert "intact=1" in line, (line, app.stderr[-6000:])
    for app in apps:
        app.expect("done", timeout=60)
        assert app.wait() == 0, app.stderr[-6000:]
        # Complaints, not debug lines: at exit a context the program already destroyed is dropped
        # with a debug line ("push failed"), which says nothing about the swaps.
        complaints = [line for line in app.stderr.splitlines()
                      if ("failed" in line or "warning" in line) and ": debug: " not in line]
        assert complaints == [], app.stderr[-6000:]
    lines = simcuda.read_trace(cuda_app.trace)
    for app in apps:
        released = sum(p["bytes"] for p in lines if p["op"] == "physical" and p["event"] == "release"
                       and p["pid"] == app.pid)
        assert released >= ROUNDS * SWAPPED_OUT, released  # the device got the room back each time
    kinds = [event["kind"] for event in scheduler.events()]
    assert kinds.count("evicted") + kinds.count("release") >= 2 * ROUNDS, kinds


def test_every_hook_that_takes_or_returns_a_vmm_handle_translates_it(scheduler, cuda_app):
    """cuMemCreate gives the application a value of nvshare's (never the driver's, whose values
    come back after a release); each hook that takes one hands the driver the handle it stands
    for (the simulated driver checks it: arrays and multicast then answer NOT_SUPPORTED, 801), and
    cuMemRetainAllocationHandle answers it. A handle from cuMemImportFromShareableHandle is the
    driver's and passes through. Once released, the value is refused (INVALID_VALUE, 1) by every
    hook without reaching the driver (which would dereference it: the simulated one says so on
    stderr). The debug log names every call."""
    app = cuda_app(scheduler.env, "init", "vmm-calls", env={"NVSHARE_LOG": "debug"})
    assert app.wait() == 0, app.stderr
    calls = {line.split()[1]: line.split()[2:-1] for line in app.lines if line.startswith("vmm-call")}
    handle = int(calls["cuMemCreate"][1].split("=")[1], 16)
    assert handle >> 40 == 0x4E5653, hex(handle)  # "NVS": not a driver address
    assert calls["cuMemGetAllocationPropertiesFromHandle"] == ["0", "device=0", "types=1"]
    assert calls["cuMemRetainAllocationHandle"] == ["0", "same=1"]
    assert calls["cuMemExportToShareableHandle"] == ["0", "fd=1"]
    assert calls["cuMemImportFromShareableHandle"] == ["0", "same-bytes=1"]
    for name in ("cuMemMapArrayAsync", "cuMemMapArrayAsync_ptsz", "cuMulticastBindMem", "cuMulticastBindMem_v2",
                 "cuMulticastBindAddr", "cuMulticastBindAddr_v2"):
        assert calls[name] == ["801"], (name, calls[name])  # the driver got a live handle or mapping
    assert calls["cuMemRelease"] == ["0"]
    for name in ("cuMemRelease-again", "cuMemMap-released", "cuMemGetAllocationPropertiesFromHandle-released",
                 "cuMemMapArrayAsync-released"):
        assert calls[name] == ["1"], (name, calls[name])
    assert "simcuda:" not in app.stderr, app.stderr  # no released value reached the driver
    logged = {line.split("vmm: ", 1)[1].split("(")[0] for line in app.stderr.splitlines() if " vmm: " in line}
    assert {"cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemRetainAllocationHandle",
            "cuMemExportToShareableHandle", "cuMemGetAllocationPropertiesFromHandle", "cuMemMapArrayAsync",
            "cuMemMapArrayAsync_ptsz", "cuMulticastBindMem", "cuMulticastBindMem_v2", "cuMulticastBindAddr",
            "cuMulticastBindAddr_v2"} <= logged, logged


def test_nccl_buffers_keep_every_device_access_and_free_while_swapped_out(scripted, cuda_app, simcuda, tmp_path):
    """NCCL gives each device access to its buffers in a cuMemSetAccess call of its own: a buffer
    swapped out and brought back keeps the access of every call (kept as the last call only, the
    device that allocated it lost its access and its reads were refused). A buffer exported to
    other processes never moves: its physical memory stays while the other goes. And NCCL frees a
    buffer (retain, release, address range, unmap, release) while it is swapped out."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_DEVICES": "2", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_REGISTER_HUGE_US_PER_MIB": "20"}
    app = cuda_app(env, "init", f"vmm-buffer:{2 * MIB}:0,1", f"vmm-buffer:{2 * MIB}:0:export",
                   f"vmm-buffer:{4 * MIB}:0,1", f"pattern:plain:{4 * MIB}", "sync", "wait", "vmm-nccl-free:2", "wait",
                   "verify", "unpattern")
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("PREPARE", device=scripted.device, bytes=32 * MIB)
    while int(scripted.expect("MEMORY").get("area", 0)) < 32 * MIB:
        pass
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum", evict=16 * MIB)
    assert scripted.expect("RELEASE")["resident"] == "0"  # the exported buffer is not counted as movable
    physical = [(p["event"], p["bytes"]) for p in simcuda.read_trace(cuda_app.trace) if p["op"] == "physical"]
    assert sorted(physical) == [("release", 2 * MIB), ("release", 4 * MIB), ("reserve", 2 * MIB),
                                ("reserve", 2 * MIB), ("reserve", 4 * MIB)], physical
    app.continue_()
    assert app.expect("nccl-freed").split()[1:3] == ["0,0,0,0,0,0", f"size={4 * MIB}"]
    app.continue_()
    grant(scripted, 2, prefetch=16 * MIB)
    app.expect("verified 3")  # read and written from device 0 after the swap-in
    assert app.wait() == 0, app.stderr
    assert "warning" not in app.stderr, app.stderr
    physical = [(p["event"], p["bytes"]) for p in simcuda.read_trace(cuda_app.trace) if p["op"] == "physical"]
    assert ("reserve", 4 * MIB) not in physical[5:], physical  # the freed buffer did not come back


def grant(scheduler, number: int, **extra) -> None:
    scheduler.expect("ACQUIRE")
    scheduler.send("GRANT", device=scheduler.device, grant=number, mode="on", exclusive=1, quantum_ms=60_000, **extra)
