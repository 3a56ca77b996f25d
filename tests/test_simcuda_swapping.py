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

import pytest

from fixtures.residency import MIB, migrations, moved
from fixtures.scripted import ScriptedScheduler


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
