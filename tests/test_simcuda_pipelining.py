"""Pipelined handoffs end to end (issue 18): two processes under the interceptor on the simulated
driver (residency modelled, a slow link so that moves take long enough to be seen), the real
scheduler with a memory budget that holds one of them. Each handoff moves the holder's memory
out through its pinned swap area (copies, discards: nothing migrates, nothing is evicted by the
driver) while the next holder brings its own back, told piece by piece how much room there is
(PREFETCH). The two share the link (copies of managed memory take turns, as on an H200)."""

from __future__ import annotations

from nvshare_py.testing.residency import MIB, migrations
from nvshare_py.testing.scheduler import wait_for

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"


def test_handoffs_over_a_budget_overlap_the_swap_out_and_the_swap_in(scheduler_factory, cuda_app, simcuda, tmp_path):
    # 32 MiB must move at each handoff, at 10 ms per MiB: 0.32 s each way, long next to a message.
    scheduler = scheduler_factory(tq=1.0, grace=60, idle_release=0)
    scheduler.request("set-budget", device=GPU, bytes=96 * MIB)
    env = {**scheduler.env, "SIMCUDA_MEMORY": "128M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path),
           "SIMCUDA_PINNED_US_PER_MIB": "10000", "SIMCUDA_REGISTER_HUGE_US_PER_MIB": "0",
           "SIMCUDA_REGISTER_US_PER_MIB": "0", "SIMCUDA_PIN_US_PER_MIB": "0", "NVSHARE_LOG": "warn"}
    # 64 MiB each, in blocks a swap moves one by one (8 MiB buffers).
    apps = [cuda_app(env, "init", *[f"alloc:plain:{8 * MIB}"] * 8, "loop:12:20000") for _ in range(2)]
    for app in apps:
        assert app.wait(timeout=180) == 0, app.stderr
    events = scheduler.events()
    grants = [e for e in events if e["kind"] == "grant"]
    assert len(grants) >= 3, events  # at least two handoffs
    assert [e for e in events if e["kind"] == "prefetch"], events  # waiters told to bring memory back early

    lines = simcuda.read_trace(cuda_app.trace)
    pids = {app.pid for app in apps}
    # Every move went through the swap area at link speed: no migration to the host, and the budget
    # kept the driver from ever evicting anyone's memory.
    assert migrations(lines, direction="to_host") == [] and migrations(lines, cause="evict") == []
    out = sorted((c for c in lines if c["op"] == "memcpy" and c.get("link") == "d2h" and c["pid"] in pids),
                 key=lambda c: c["start"])
    back = sorted((c for c in lines if c["op"] == "memcpy" and c.get("link") == "h2d" and c["pid"] in pids),
                  key=lambda c: c["start"])
    assert out and back
    # The pipeline: some handoff's copies in began while the other process's copies out still ran.
    overlapping = [(o, b) for o in out for b in back if o["pid"] != b["pid"] and b["start"] < o["end"]
                   and o["start"] < b["end"]]
    assert overlapping, (out, back)
