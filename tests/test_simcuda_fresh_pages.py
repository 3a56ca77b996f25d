"""A holder's fresh converted allocation is made on the device at once (interceptor/memory.c,
`make_pages`; docs/interceptor.md "Swapping"), on the simulated driver with residency modelled:
a model's weights loaded into converted memory are then not populated fault by fault by the first
copies and kernels. A process that does not hold the device leaves its new memory where it is:
making it would evict the holder's. And the making is work: a holder whose allocation takes
longer than its idle window, while others wait, is not released in the middle of it."""

from __future__ import annotations

import pytest

from nvshare_py.testing.residency import MIB, migrations
from nvshare_py.testing.scripted import ScriptedScheduler


@pytest.fixture
def scripted():
    scheduler = ScriptedScheduler()
    yield scheduler
    scheduler.close()


def grant(scheduler: ScriptedScheduler, number: int) -> None:
    scheduler.expect("ACQUIRE")
    scheduler.send("GRANT", device=scheduler.device, grant=number, mode="on", exclusive=1, quantum_ms=60_000)


def test_a_holders_new_allocation_is_made_on_the_device_and_a_waiters_is_not(scripted, cuda_app, simcuda, tmp_path):
    env = {**scripted.env, "SIMCUDA_MEMORY": "256M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path)}
    app = cuda_app(env, "init", "alloc:plain:8388608", "kernel:1000", "sync", "mark:holding",
                   "alloc:plain:16777216", "kernel:1000", "sync", "wait")
    grant(scripted, 1)
    app.expect("mark holding")
    app.expect("waiting")
    lines = simcuda.read_trace(cuda_app.trace)
    into_device = [(m["cause"], m["bytes"]) for m in migrations(lines, owner=app.pid, direction="to_device")]
    # The first allocation came before the grant: its pages came with the first kernel's faults.
    # The second came while the process held the device: made at once, so its kernel faulted nothing.
    assert into_device == [("fault", 8 * MIB), ("prefetch", 16 * MIB)], into_device


@pytest.mark.parametrize("in_call", ["0", "1"], ids=["migrated-by-the-stream", "migrated-inside-the-call"])
def test_a_holder_making_its_pages_past_its_idle_window_is_not_released(scripted, cuda_app, simcuda, tmp_path,
                                                                         in_call):
    """Others wait (CONTENDED, idle window 0.1 s) while the holder allocates 32 MiB whose making
    takes 0.64 s: the holder keeps its grant through the allocation and runs its next kernel
    under it, asking for no second grant. Also where the driver migrates inside the prefetch
    call (SIMCUDA_PREFETCH_IN_CALL), so that a synchronise finds no work in the meantime."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "256M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_PREFETCH_US_PER_MIB": "20000", "SIMCUDA_PREFETCH_IN_CALL": in_call,
           "NVSHARE_IDLE_RELEASE_MS": "1000"}  # early release on (the scripted scheduler's default is off)
    app = cuda_app(env, "init", "kernel:1000", "sync", "mark:allocating", "alloc:plain:33554432",
                   "kernel:1000", "sync", "wait")
    grant(scripted, 1)
    app.expect("mark allocating")
    scripted.send("CONTENDED", device=scripted.device, grant=1, quantum_left_ms=50_000, idle_ms=100)
    app.expect("waiting")  # a release in the allocation would have left its kernel waiting for a grant
    lines = simcuda.read_trace(cuda_app.trace)
    [made] = migrations(lines, owner=app.pid, direction="to_device")
    assert (made["cause"], made["bytes"]) == ("prefetch", 32 * MIB)
    assert made["end"] - made["start"] >= 32 * 20000e-6 - 1e-6  # longer than the idle window, several times
    kernels = [line for line in lines if line["op"] == "kernel" and line["pid"] == app.pid]
    assert len(kernels) == 2 and kernels[1]["start"] >= made["end"] - 1e-6
