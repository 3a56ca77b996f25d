"""The simulated driver's residency model (tests/simcuda/README.md, "Residency"): managed memory
lives on a device of limited capacity shared by every process, kernels fault it in and evict
the least recently used chunks of any process, prefetches move it in bulk, and the trace shows
every migration. Then what it shows about nvshare: with memory that fits nothing moves twice;
over capacity, processes thrash without the scheduler and move each one's memory at most once
per turn with it."""

from __future__ import annotations

import pytest

from nvshare_py.testing.residency import MIB, handoffs, migrations, moved, residency_env, turns
from nvshare_py.testing.scheduler import wait_for

def run(simcuda, env, *steps, timeout=60):
    result = simcuda.run_simapp(*steps, env=env, timeout=timeout)
    assert result.returncode == 0, (result.steps, result.stderr)
    return result


def test_memory_is_faulted_in_once_then_stays(simcuda, tmp_path):
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M")
    app = run(simcuda, env, "alloc:managed:24M", "repeat:5:kernel:1000", "sync")
    lines = simcuda.read_trace(trace)
    pid = app.steps[0]["pid"]
    [fault] = migrations(lines)
    assert (fault["cause"], fault["direction"], fault["owner"], fault["bytes"]) == ("fault", "to_device", pid, 24 * MIB)
    first_kernel = min(line["start"] for line in lines if line["op"] == "kernel")
    assert fault["start"] >= first_kernel  # the first kernel paid for it


def test_costs_follow_the_configured_rates(simcuda, tmp_path):
    """A fault pays SIMCUDA_FAULT_US_PER_MIB, a prefetch to the device SIMCUDA_PREFETCH_US_PER_MIB;
    to the host SIMCUDA_FIRST_EVICTION_US_PER_MIB the first time (the host pages are made then),
    SIMCUDA_PREFETCH_TO_HOST_US_PER_MIB afterwards (lower bounds: the simulated time is slept)."""
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M", SIMCUDA_FAULT_US_PER_MIB="2000",
                        SIMCUDA_PREFETCH_US_PER_MIB="400", SIMCUDA_FIRST_EVICTION_US_PER_MIB="1500",
                        SIMCUDA_PREFETCH_TO_HOST_US_PER_MIB="800")
    run(simcuda, env, "alloc:managed:16M", "alloc:managed:16M", "kernel:0", "prefetch:1:host", "prefetch:1",
        "prefetch:1:host", "sync")
    lines = simcuda.read_trace(trace)
    fault = migrations(lines, cause="fault")
    prefetch = migrations(lines, cause="prefetch")
    assert [(m["direction"], m["bytes"]) for m in fault] == [("to_device", 32 * MIB)]
    assert [(m["direction"], m["bytes"]) for m in prefetch] == [("to_host", 16 * MIB), ("to_device", 16 * MIB),
                                                                ("to_host", 16 * MIB)]
    slack = 1e-6  # the trace's 9 decimals
    assert fault[0]["end"] - fault[0]["start"] >= 32 * 2000e-6 - slack
    first_out, back_in, later_out = (m["end"] - m["start"] for m in prefetch)
    assert first_out >= 16 * 1500e-6 - slack
    assert back_in >= 16 * 400e-6 - slack
    assert later_out >= 16 * 800e-6 - slack


def test_the_least_recently_used_chunks_go_first(simcuda, tmp_path):
    """64 MiB device: buffers 0 and 1 (24 MiB each) fit; filling buffer 2 (24 MiB) evicts 8 MiB
    of buffer 0, the least recently used, so buffer 1 stays and buffer 0 faults 8 MiB back."""
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M")
    run(simcuda, env, "alloc:managed:24M", "alloc:managed:24M", "alloc:managed:24M",
        "tag:first", "fill:0:1", "fill:1:1", "sync",
        "tag:third", "fill:2:1", "sync",
        "tag:again-1", "fill:1:2", "sync",
        "tag:again-0", "fill:0:2", "sync")
    lines = simcuda.read_trace(trace)

    def moved_during(tag, **filters):
        [kernel] = [line for line in lines if line.get("tag") == tag and line["op"] == "kernel"]
        return sum(m["bytes"] for m in migrations(lines, **filters) if kernel["start"] <= m["start"] <= kernel["end"])

    assert moved_during("third", direction="to_device") == 24 * MIB
    assert moved_during("third", cause="evict") == 8 * MIB
    assert moved_during("again-1", direction="to_device") == 0
    assert moved_during("again-0", direction="to_device") == 8 * MIB


def test_the_memory_of_an_exited_process_is_reclaimed_without_eviction(simcuda, tmp_path):
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M")
    first = run(simcuda, env, "alloc:managed:40M", "kernel:0", "sync", "exit:0")
    # The first process has exited: its chunks are reclaimed without an eviction.
    second = run(simcuda, env, "alloc:managed:40M", "kernel:0", "sync", "prefetch:0:host", "sync")
    lines = simcuda.read_trace(trace)
    assert migrations(lines, cause="evict") == []
    assert moved(lines, owner=second.steps[0]["pid"], direction="to_host") == 40 * MIB
    assert moved(lines, owner=first.steps[0]["pid"]) == 40 * MIB


def test_processes_over_capacity_evict_each_other(simcuda, cuda_app, tmp_path):
    """Process A keeps its 40 MiB resident while it waits; B's kernel over 40 MiB on a 64 MiB
    device must evict 16 MiB of A's, which A's next kernel faults back."""
    env = residency_env(simcuda, None, tmp_path, memory="64M")
    a = cuda_app(env, "init", "alloc:managed:41943040", "kernel:0", "sync", "wait", "kernel:0", "sync", preload=False)
    a.expect("waiting")
    b = run(simcuda, {**env, "SIMCUDA_TRACE": str(cuda_app.trace)}, "alloc:managed:40M", "kernel:0", "sync")
    a.continue_()
    assert a.wait() == 0, a.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    assert moved(lines, pid=b.steps[0]["pid"], cause="evict", owner=a.pid) == 16 * MIB
    assert moved(lines, owner=a.pid, direction="to_device") == 56 * MIB


def test_a_process_that_dies_on_the_gpu_does_not_block_it(simcuda, cuda_app, tmp_path):
    """Killed in the middle of a kernel that holds the simulated GPU (its time slice is longer
    than the kernel), a process leaves the GPU to the next one."""
    env = residency_env(simcuda, None, tmp_path, memory="64M", SIMCUDA_TIMESLICE_US="1000000000")
    dead = cuda_app(env, "init", "alloc:managed:8388608", "kernel:600000000", "wait", preload=False)
    dead.expect("waiting")
    # The kernel faulted its memory in: it holds the GPU for its whole 600 s slice.
    wait_for(lambda: moved(simcuda.read_trace(cuda_app.trace), owner=dead.pid) == 8 * MIB, timeout=60,
             what="the doomed kernel to start")
    dead.kill()
    alive = run(simcuda, {**env, "SIMCUDA_TRACE": str(cuda_app.trace)}, "alloc:managed:8M", "kernel:1000", "sync")
    lines = simcuda.read_trace(cuda_app.trace)
    assert [line["pid"] for line in lines if line["op"] == "kernel"] == [alive.steps[0]["pid"]]
    assert migrations(lines, cause="evict") == []  # the dead process's chunks were free for the taking


@pytest.mark.parametrize("setting", ["SIMCUDA_FAULT_US_PER_MIB=fast", "SIMCUDA_TIMESLICE_US=0",
                                     "SIMCUDA_RESIDENCY_DIR=/nonexistent/simcuda"])
def test_a_setting_that_cannot_be_used_fails_cuinit(simcuda, tmp_path, setting):
    name, value = setting.split("=")
    result = simcuda.run_simapp("meminfo", env={**residency_env(simcuda, None, tmp_path), name: value})
    assert result.returncode != 0
    assert name in result.stderr


# --- nvshare on the simulated residency: the paper's claim, counted in migrations -------------

FITS = 24 * MIB       # two of these fit the 64 MiB device
OVER = 40 * MIB       # two of these do not


# Work of 5 ms kernels over all of a process's memory: queued at once (the GPU's queue decides who
# runs), or one after the other for some seconds (each kernel waits for the previous one, so
# the holder's drain at the end of its quantum is short and the lock changes hands).
QUEUED = ("kernel:5000:200", "sync")
LOOP = ("loop:2.0:5000",)


def start_pair(cuda_app, scheduler, tmp_path, footprint, work):
    """Two processes under nvshare with `footprint` bytes each (cuMemAlloc, made managed) doing
    `work`, started together."""
    env = {**scheduler.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path)}
    apps = [cuda_app(env, "init", f"alloc:plain:{footprint}", "wait", *work) for _ in range(2)]
    for app in apps:
        assert "managed=1" in app.expect("ptr plain")  # the interceptor made it managed
        app.expect("waiting")
    for app in apps:  # both start their loops together
        app.continue_()
    for app in apps:
        assert app.wait() == 0, app.stderr
    return [app.pid for app in apps], cuda_app.trace


def test_without_the_scheduler_processes_over_capacity_thrash(scheduler_factory, cuda_app, simcuda, tmp_path):
    scheduler = scheduler_factory(mode="off")
    pids, trace = start_pair(cuda_app, scheduler, tmp_path, OVER, QUEUED)
    lines = simcuda.read_trace(trace)
    # Each kernel slice finds part of its memory taken by the other process: the memory moves
    # over and over, far more than the two footprints.
    assert moved(lines, direction="to_device") > 10 * 2 * OVER
    for pid in pids:
        assert moved(lines, cause="evict", owner=pid) > 5 * OVER


def test_with_the_scheduler_each_turn_moves_each_process_memory_at_most_once(scheduler_factory, cuda_app, simcuda,
                                                                               tmp_path):
    """Without swapping (the fault-driven baseline, --swapping off)."""
    scheduler = scheduler_factory(mode="on", tq=0.3, swapping="off")
    _, trace = start_pair(cuda_app, scheduler, tmp_path, OVER, LOOP)
    lines = simcuda.read_trace(trace)
    assert handoffs(lines) >= 2, turns(lines)
    for turn in turns(lines):
        # The holder's memory comes back by faults during its turn and the other process's is
        # evicted to make room: once each, never more.
        assert turn.brought_in.get(turn.pid, 0) <= OVER, turn
        assert set(turn.brought_in) <= {turn.pid}, turn
        assert all(bytes_ <= OVER for bytes_ in turn.sent_out.values()), turn
    assert moved(lines, cause="evict") > 0  # over capacity: turns did take each other's memory


@pytest.mark.parametrize("mode", ["on", "off"])
def test_memory_that_fits_moves_only_on_first_touch(scheduler_factory, cuda_app, simcuda, tmp_path, mode):
    scheduler = scheduler_factory(mode=mode, tq=0.3)
    pids, trace = start_pair(cuda_app, scheduler, tmp_path, FITS, LOOP if mode == "on" else QUEUED)
    lines = simcuda.read_trace(trace)
    if mode == "on":
        assert handoffs(lines) >= 2
    for pid in pids:
        assert moved(lines, owner=pid) == FITS
    assert migrations(lines, cause="evict") == []


# --- NVSHARE_ADVISE: converted memory advised onto its device ---------------------------------


@pytest.mark.parametrize("setting", ["1", None])
def test_converted_allocations_are_advised_onto_their_device_when_asked(scheduler, cuda_app, simcuda, setting):
    env = {"NVSHARE_ADVISE": setting} if setting else {}
    app = cuda_app(scheduler.env, "init:1", "alloc:plain:4194304", "alloc:async:1048576", "alloc:managed:2097152",
                   env={"SIMCUDA_DEVICES": "2", **env})
    assert app.wait() == 0, app.stderr
    converted = [int(line.split()[2], 16) for line in app.lines if line.startswith(("ptr plain", "ptr async"))]
    own = [int(line.split()[2], 16) for line in app.lines if line.startswith("ptr managed")]
    advice = [(line["advice"], line["location"], line["location_id"], line["ptr"], line["bytes"])
              for line in simcuda.read_trace(cuda_app.trace) if line["op"] == "advise"]
    if setting is None:
        assert advice == []
        return
    sizes = dict(zip(converted, (4 << 20, 1 << 20)))
    assert sorted(advice) == sorted((kind, "device", 1, ptr, size) for ptr, size in sizes.items()
                                    for kind in ("set_preferred_location", "set_accessed_by"))
    assert not any(ptr in own for *_, ptr, _ in advice)  # the application's own managed memory is its business


def test_with_swapping_each_handoff_moves_memory_once_each_way_in_bulk(scheduler_factory, cuda_app, simcuda,
                                                                     tmp_path):
    """Over capacity with the scheduler swapping: nothing faults after the first touch (which a
    grant's prefetch may even do instead) and the driver never has to evict; every move is in
    bulk (the swap engine's copies then discards, or prefetches where its pinned area does not
    reach), at most once out and once in per process and turn. The trace is read while
    both processes still live (after their loops): the memory of a process that has exited but
    is not yet reaped still counts as the simulated device's, which is not swapping's business."""
    scheduler = scheduler_factory(mode="on", tq=0.3, gpus=1, gpu_memory="64M")  # the budget: what NVML shows
    env = {**scheduler.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path)}
    apps = [cuda_app(env, "init", f"alloc:plain:{OVER}", "wait", *LOOP, "wait") for _ in range(2)]
    for app in apps:
        app.expect("waiting")
    for app in apps:
        app.continue_()
    for app in apps:
        app.expect("looped")
        app.expect("waiting")
    lines = simcuda.read_trace(cuda_app.trace)
    for app in apps:
        app.continue_()
        assert app.wait() == 0, app.stderr
    assert handoffs(lines) >= 2, turns(lines)
    for app in apps:
        assert moved(lines, owner=app.pid, cause="fault") <= OVER  # the first touch at most
        discarded = sum(line.get("released", 0) for line in lines if line["op"] == "discard" and line["pid"] == app.pid)
        assert moved(lines, owner=app.pid, cause="prefetch", direction="to_host") + discarded > 0
    assert migrations(lines, cause="evict") == []  # the scheduler made room before each turn
    for turn in turns(lines):
        assert set(turn.brought_in) <= {turn.pid}, turn
        assert turn.brought_in.get(turn.pid, 0) <= OVER, turn
        assert all(bytes_ <= OVER for bytes_ in turn.sent_out.values()), turn
