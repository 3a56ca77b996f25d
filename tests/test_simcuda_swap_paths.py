"""The paths a swap engine takes through the simulated driver with residency modelled
(tests/simcuda/README.md, "Residency"): copies between device-resident managed memory and pinned
host memory over the link, discard and discard-and-prefetch, the cost of pinning host memory,
the link's copy engines (one per direction, shared by processes), and physical device memory
(cuMemAlloc, pools, VMM handles) holding room that managed memory must leave.

Costs are asserted as lower bounds only (the simulated time is slept, a busy machine can only
make it longer); where two processes must meet on the link, their copies last seconds so that
the order in which the processes start cannot matter."""

from __future__ import annotations

import subprocess

from nvshare_py.testing.residency import MIB, migrations, residency_env
from nvshare_py.testing.simcuda import parse_steps

SLACK = 1e-6  # the trace's 9 decimals


def run(simcuda, env, *steps):
    result = simcuda.run_simapp(*steps, env=env)
    assert result.returncode == 0, (result.steps, result.stderr)
    return result


def ops(lines, op, **filters):
    return [line for line in lines if line["op"] == op and all(line.get(k) == v for k, v in filters.items())]


def test_memory_copied_to_pinned_memory_discarded_and_copied_back_is_intact(simcuda, tmp_path):
    """Out: device-resident managed memory to pinned (allocated or registered) memory over the
    device-to-host link, then a discard gives the device pages up without moving them (the
    contents are gone: indeterminate, zero here). In: discard-and-prefetch makes the pages
    resident again without copying, the copy back brings every word back."""
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M", SIMCUDA_PINNED_US_PER_MIB="500",
                        SIMCUDA_DISCARD_PREFETCH_US_PER_MIB="300")
    app = run(simcuda, env, "alloc:managed:16M", "alloc:host:16M", "alloc:registered:16M",
              "fill:0:7", "dtoh:0:1", "dtoh:0:2", "discard:0", "sync", "check:0:0",
              "discard-prefetch:0", "htod:2:0", "sync", "check:0:7")
    pid = app.steps[0]["pid"]
    lines = simcuda.read_trace(trace)
    out, back = ops(lines, "memcpy", api="cuMemcpyDtoHAsync_v2"), ops(lines, "memcpy", api="cuMemcpyHtoDAsync_v2")
    assert [(c["link"], c["bytes"]) for c in out] == [("d2h", 16 * MIB)] * 2
    assert [(c["link"], c["bytes"]) for c in back] == [("h2d", 16 * MIB)]
    assert all(c["end"] - c["start"] >= 16 * 500e-6 - SLACK for c in out + back)
    [discard] = ops(lines, "discard")
    assert discard["released"] == 16 * MIB  # it was resident: the fill faulted it in
    [populate] = migrations(lines, cause="populate")
    assert (populate["direction"], populate["owner"], populate["bytes"]) == ("to_device", pid, 16 * MIB)
    assert populate["end"] - populate["start"] >= 16 * 300e-6 - SLACK
    # Nothing was migrated to the host: the only way out was the copy.
    assert migrations(lines, direction="to_host") == []


def test_pinning_host_memory_costs_time_per_mib(simcuda, tmp_path):
    """Allocating pinned memory, registering memory, and registering memory advised to
    transparent huge pages each cost their own rate (0.43, 0.29 and 0.19 s per GiB on an H200),
    and each pinning and its end are in the trace."""
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M", SIMCUDA_PIN_US_PER_MIB="4000",
                        SIMCUDA_REGISTER_US_PER_MIB="3000", SIMCUDA_REGISTER_HUGE_US_PER_MIB="2000")
    app = run(simcuda, env, "alloc:host:8M", "alloc:registered:8M", "alloc:registered-thp:8M", "alloc:managed:8M",
              "free:0", "free:1", "free:2")
    pinned, registered, huge, managed = (step["end"] - step["start"] for step in app.steps[:4])
    assert pinned >= 8 * 4000e-6 and registered >= 8 * 3000e-6 and huge >= 8 * 2000e-6
    assert managed < 8 * 2000e-6  # managed memory is not pinned (nothing is touched yet)
    lines = simcuda.read_trace(trace)
    assert [(p["how"], p["huge"], p["bytes"]) for p in ops(lines, "pin")] == [
        ("allocated", False, 8 * MIB), ("registered", False, 8 * MIB), ("registered", True, 8 * MIB)]
    assert [(p["how"], p["bytes"]) for p in ops(lines, "unpin")] == [
        ("allocated", 8 * MIB), ("registered", 8 * MIB), ("registered", 8 * MIB)]


def test_shared_memory_is_registered_in_each_process_that_maps_it_and_carries_bytes_between_them(simcuda, tmp_path):
    """nvshare's swap pool maps files MAP_SHARED in every process of a user and registers them
    in each (docs/interceptor.md, *Swapping*). The first process here maps a file whose pages do
    not exist yet: registering makes and locks them, at the registering rate. The second maps the
    same pages without touching them: they exist, but not in its page tables, so registering maps
    them and it pays the registering rate too (an H200: 0.15-0.21 s per GiB in a second process,
    0.04 for pages mapped first; nvshare's pool maps them first). Each copies through its own
    registration at the pinned rate, and the second reads back what the first wrote."""
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M", SIMCUDA_REGISTER_US_PER_MIB="3000",
                        SIMCUDA_REGISTER_HUGE_US_PER_MIB="3000", SIMCUDA_REGISTER_PRESENT_US_PER_MIB="10",
                        SIMAPP_SHARED_FILE=str(tmp_path / "segment-0"))
    first = run(simcuda, env, "alloc:registered-shared:8M", "alloc:managed:8M", "fill:1:7", "dtoh:1:0", "sync")
    second = run(simcuda, env, "alloc:registered-shared:8M", "alloc:managed:8M", "htod:0:1", "sync", "check:1:7",
                 "free:0")
    lines = simcuda.read_trace(trace)
    pids = first.steps[0]["pid"], second.steps[0]["pid"]
    assert [(p["pid"], p["how"], p["bytes"], p["present"]) for p in ops(lines, "pin")] == [
        (pids[0], "registered", 8 * MIB, 0), (pids[1], "registered", 8 * MIB, 0)]
    assert first.steps[0]["end"] - first.steps[0]["start"] >= 8 * 3000e-6  # made and locked
    copies = ops(lines, "memcpy")
    assert [(c["pid"], c["link"], c["pinned"]) for c in copies] == [
        (pids[0], "d2h", True), (pids[1], "h2d", True), (pids[1], "d2h", False)]  # the last: check's pageable read
    assert [(u["pid"], u["bytes"]) for u in ops(lines, "unpin")] == [(pids[1], 8 * MIB)]


def test_a_driver_that_refuses_to_register_memory_says_so_with_its_error(simcuda, tmp_path):
    """SIMCUDA_HOST_REGISTER_ERROR: every cuMemHostRegister fails with that error and pins
    nothing; allocating pinned memory still works."""
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M", SIMCUDA_HOST_REGISTER_ERROR="801")
    result = simcuda.run_simapp("alloc:host:2M", "alloc:registered:2M", "alloc:registered-thp:2M", env=env)
    assert [step.get("error") for step in result.steps] == [None, "CUDA_ERROR_NOT_SUPPORTED",
                                                          "CUDA_ERROR_NOT_SUPPORTED"], result.steps
    assert [p["how"] for p in ops(simcuda.read_trace(trace), "pin")] == ["allocated"]


def test_copies_over_a_pageable_buffer_cost_more_than_over_a_pinned_one(simcuda, tmp_path):
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M", SIMCUDA_PINNED_US_PER_MIB="10",
                        SIMCUDA_PAGEABLE_US_PER_MIB="3000")
    run(simcuda, env, "alloc:plain:8M", "fill:0:3", "check:0:3")  # check copies into pageable memory
    [copy] = ops(simcuda.read_trace(trace), "memcpy")
    assert copy["link"] == "d2h" and copy["end"] - copy["start"] >= 8 * 3000e-6 - SLACK


# A copy of 32 MiB at 0.1 s per MiB: 3.2 s of the link alone.
COPY_ALONE_S = 32 * 100000e-6


def copies_at_once(simcuda, tmp_path, family: str, kinds: tuple[str, ...]) -> list[dict]:
    """Processes that each copy 32 MiB between `family` device memory and pinned memory, the way
    of its kind ("d2h" or "h2d"), all started at once; their copies' trace lines, each with the
    kind of the process that made it (`kind`)."""
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="256M", SIMCUDA_PINNED_US_PER_MIB="100000",
                        SIMCUDA_PIN_US_PER_MIB="0")
    steps = {"d2h": [f"alloc:{family}:32M", "alloc:host:32M", "dtoh:0:1", "sync"],
             "h2d": [f"alloc:{family}:32M", "alloc:host:32M", "htod:1:0", "sync"]}
    processes = [subprocess.Popen(simcuda.simapp_argv(*steps[kind]), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for kind in kinds]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    kind_of = {parse_steps(out)[1]["pid"]: kind for (out, _), kind in zip(outputs, kinds)}
    return [{**c, "kind": kind_of[c["pid"]]} for c in ops(simcuda.read_trace(trace), "memcpy")]


def test_the_link_has_one_copy_engine_per_direction_that_processes_share(simcuda, tmp_path):
    """Three processes start a 32 MiB copy each at the same time, each 3.2 s of the link alone:
    the two device-to-host copies take turns on one copy engine (together they wait for about
    one of them), the host-to-device one has the other engine to itself."""
    copies = copies_at_once(simcuda, tmp_path, "plain", ("d2h", "d2h", "h2d"))
    assert sorted(c["link"] for c in copies) == ["d2h", "d2h", "h2d"]
    assert all(c["link"] == c["kind"] for c in copies)
    assert sum(c["link_wait"] for c in copies if c["link"] == "d2h") >= COPY_ALONE_S / 3
    [h2d] = [c for c in copies if c["link"] == "h2d"]
    assert h2d["link_wait"] < COPY_ALONE_S / 3  # nobody else copied that way


def test_copies_of_managed_memory_take_turns_whichever_way_they_go(simcuda, tmp_path):
    """On an H200 two processes' copies of managed memory the opposite ways ran at half the
    link each (24 GB/s), where cuMemAlloc memory's overlapped (51 and 50 GB/s): a handoff's
    swap-out and the next holder's swap-in do not add up. Two processes start a 32 MiB copy
    each, one out of managed memory, one into it, each 3.2 s of the link alone: they take
    turns, so together they wait about as long as one of them takes."""
    copies = copies_at_once(simcuda, tmp_path, "managed", ("d2h", "h2d"))
    assert sorted((c["link"], c["kind"]) for c in copies) == [("d2h", "d2h"), ("h2d", "h2d")], copies
    assert sum(c["link_wait"] for c in copies) >= COPY_ALONE_S / 3, copies


def test_physical_device_memory_holds_room_that_managed_memory_leaves(simcuda, tmp_path):
    """64 MiB device: process A has 16 MiB of managed memory resident and 40 MiB of cuMemAlloc
    memory. Process B's 16 MiB VMM handle takes its room from A's managed memory (8 MiB of it
    leaves), and then a pool allocation finds nothing but physical memory and A's last 8 MiB:
    refused, though B's own share of the device would allow it. B's free gives room back."""
    trace = tmp_path / "trace.jsonl"
    env = residency_env(simcuda, trace, tmp_path, memory="64M")
    a = subprocess.Popen(simcuda.simapp_argv("alloc:managed:16M", "kernel:0", "sync", "alloc:plain:40M",
                                             "sleep:60000"), env=env, stdout=subprocess.PIPE, text=True)
    try:
        for line in a.stdout:  # A holds its memory from here on (60 s, or until killed)
            if line.startswith('{"step": "alloc:plain:40M"'):
                assert parse_steps(line)[0]["rc"] == 0
                break
        b = simcuda.run_simapp("alloc:vmm:16M", "alloc:pool:16M", "free:0", "alloc:async:16M", env=env)
    finally:
        a.kill()
        a.wait()
    assert [step["rc"] for step in b.steps] == [0, 2, 0, 0], b.steps  # CUDA_ERROR_OUT_OF_MEMORY
    lines = simcuda.read_trace(trace)
    b_pid = b.steps[0]["pid"]
    assert [(x["event"], x["bytes"]) for x in ops(lines, "physical") if x["pid"] == b_pid] == [
        ("reserve", 16 * MIB), ("release", 16 * MIB), ("reserve", 16 * MIB)]
    assert sum(m["bytes"] for m in migrations(lines, pid=b_pid, cause="evict", owner=a.pid)) == 8 * MIB


def test_a_vmm_handle_is_retained_and_exported_as_the_real_driver_does(simcuda, tmp_path):
    app = simcuda.run_simapp("alloc:vmm:2M", "alloc:vmm-shareable:2M", "retain:0", "export:0", "export:1",
                             env=residency_env(simcuda, None, tmp_path, memory="64M"))
    retain, plain_export, shareable_export = app.steps[2:]
    assert retain["rc"] == 0 and retain["same"] is True
    assert plain_export["rc"] == 1  # not created exportable: CUDA_ERROR_INVALID_VALUE
    assert shareable_export["rc"] == 0 and shareable_export["fd"] >= 0
