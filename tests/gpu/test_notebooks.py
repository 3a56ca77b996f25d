"""Two Jupyter notebooks share a real GPU: kernels started through jupyter_client from the
installed "Python 3 (nvshare)" kernelspec take turns on the card. While one runs a GPU cell the
other's GPU cell waits; when the first goes idle the lock passes within the idle window, and the
waiting cell's output says how long it waited and for whom. Each kernel uses 64 MiB.

Recorded (record fixture): per handoff, the time from the end of the holder's cell to the
moment the waiter's first kernel launch passed the gate, and the wait the note reported."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from nvshare_py.testing.scheduler import child_env, run_child, wait_for

pytest.importorskip("jupyter_client", reason="jupyter_client is not installed here")
pytest.importorskip("ipykernel", reason="ipykernel is not installed here")

from nvshare_py.testing.notebook import Kernel  # noqa: E402  (needs jupyter_client)

pytestmark = pytest.mark.gpu

IDLE_RELEASE = 1.0
ROUNDS = 4
SETUP = """
import json, time
from nvshare_py.driver import Driver
gpu = Driver()
gpu.context(0)
buffer = gpu.alloc(64 << 20)
gpu.fill(buffer, 7, (64 << 20) // 4)
gpu.synchronize()
print(json.dumps({"managed": gpu.is_managed(buffer), "device": gpu.devices()[0].name}))
"""
# A notebook's heavy cell: 2 s of GPU work in 100 ms kernels, then the time it ended.
BUSY = """
for _ in range(20):
    gpu.launch_sleep(100_000)
    gpu.synchronize()
print(time.time())
"""
# A cell that needs the GPU for a moment: when its launch got through the gate.
BRIEF = """
gpu.launch_sleep(1000)
granted = time.time()
gpu.synchronize()
print(granted)
"""


def state(scheduler, kernel: Kernel) -> str | None:
    for client in scheduler.status()["clients"]:
        if client["host_pid"] == kernel.pid:
            return next(iter(client["devices"].values()), {}).get("state")
    return None


def test_two_notebooks_take_turns_on_a_real_gpu(gpu_env, libnvshare, scheduler_factory, tmp_path, monkeypatch, record):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    scheduler = scheduler_factory(tq=600, grace=600, idle_release=IDLE_RELEASE)
    prefix = tmp_path / "jupyter"
    installed = run_child([sys.executable, "-m", "nvshare_py.jupyter", "install", "--prefix", str(prefix)],
                          child_env(scheduler.socket_dir, {"NVSHARE_LIBRARY": str(libnvshare)}))
    assert installed.returncode == 0, installed.stderr
    env = dict(gpu_env, NVSHARE_SOCKET_DIR=str(scheduler.socket_dir), NVSHARE_LOG="info")
    kernels = [Kernel(str(prefix / "share" / "jupyter" / "kernels"), "nvshare", dict(env)) for _ in range(2)]
    try:
        for kernel in kernels:
            kernel.client.wait_for_ready(timeout=120)
        for kernel in kernels:
            facts = json.loads(kernel.run(SETUP, timeout=120).stdout.strip().splitlines()[-1])
            assert facts["managed"], "the kernel's allocation was not made managed: not under nvshare?"
            assert "every cell that waited at least 0.5 s" in kernel.run("%nvshare note 0.5").stdout
            device = facts["device"]

        rounds = []
        for turn in range(ROUNDS):
            holder, waiter = kernels[turn % 2], kernels[(turn + 1) % 2]
            busy = holder.submit(BUSY)
            wait_for(lambda: state(scheduler, holder) == "holding", timeout=60, what="the holder's cell on the GPU")
            brief = waiter.submit(BRIEF)
            wait_for(lambda: state(scheduler, waiter) == "waiting", timeout=60, what="the other cell waiting")
            busy_cell = holder.collect(busy, timeout=120)
            brief_cell = waiter.collect(brief, timeout=120)
            assert not busy_cell.error and not brief_cell.error, (busy_cell, brief_cell)
            holder_done = float(busy_cell.stdout.split()[-1])
            granted = float(brief_cell.stdout.split()[-1])
            (note,) = brief_cell.notes
            assert f"held by {holder.status()['clients'][0]} (" in note
            rounds.append({"handoff_after_idle_s": round(granted - holder_done, 4),
                           "note_wait_s": float(note.split("waited ")[1].split(" s")[0])})
            # The lock moved because the holder went idle: it released with reason idle and
            # is still alive; the waiter's launch passed the gate only after the busy cell.
            assert granted >= holder_done
            assert granted - holder_done < IDLE_RELEASE + 10.0
            assert holder.manager.is_alive()

        releases = [e["detail"] for e in scheduler.events() if e["kind"] == "release"]
        assert releases.count("idle") >= ROUNDS
        handoffs = [r["handoff_after_idle_s"] for r in rounds]
        record("notebooks/idle handoff between two kernels", device=device, idle_release_s=IDLE_RELEASE,
               rounds=rounds, handoff_p50_s=statistics.median(handoffs), handoff_max_s=max(handoffs))
    finally:
        for kernel in kernels:
            kernel.shutdown()
