"""Two real Jupyter kernels, started from the installed "Python 3 (nvshare)" kernelspec through
jupyter_client, share one (simulated) GPU: a kernel that goes idle hands the GPU to the one
that waits, %nvshare tells each which it is, a cell that waited gets a note naming the holder,
and a kernel that dies in the middle of a cell frees the GPU."""

from __future__ import annotations

import json
import os
import queue
import shutil
import sys
import time

import pytest

from nvshare_py.scheduler.views import user_name
from nvshare_py.testing.notebook import SETUP, Kernel
from nvshare_py.testing.scheduler import PATIENCE, child_env, run_child, wait_for

GPU0 = "GPU-5151ad00-0000-4000-8000-000000000000"
IDLE_RELEASE = 1.0  # the scheduler's idle window, seconds


@pytest.fixture
def notebooks(libnvshare, simcuda, scheduler_factory, tmp_path, monkeypatch):
    """start(env, ...) -> one ready kernel per environment, from the installed kernelspec (or
    `kernel_name=` another in the same directory); their GPU is simcuda's, their scheduler
    `start.scheduler` (TQ and grace so long that only idleness or an exit can move the lock)."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))  # connection files
    scheduler = scheduler_factory(tq=600, grace=600, idle_release=IDLE_RELEASE)
    prefix = tmp_path / "jupyter"
    installed = run_child([sys.executable, "-m", "nvshare_py.jupyter", "install", "--prefix", str(prefix)],
                          child_env(scheduler.socket_dir, {"NVSHARE_LIBRARY": str(libnvshare)}))
    assert installed.returncode == 0, installed.stderr
    trace = tmp_path / "trace.jsonl"
    kernels: list[Kernel] = []
    spec_dir = prefix / "share" / "jupyter" / "kernels"

    def start(*envs: dict[str, str], kernel_name: str = "nvshare") -> list[Kernel]:
        for extra in envs:
            env = simcuda.env(trace=trace, **{"NVSHARE_SOCKET_DIR": str(scheduler.socket_dir), "NVSHARE_LOG": "info",
                                              **extra})
            kernels.append(Kernel(str(spec_dir), kernel_name, env))
        started = kernels[-len(envs):]
        for kernel in started:
            kernel.client.wait_for_ready(timeout=120)
        return started

    start.scheduler = scheduler
    start.spec_dir = spec_dir
    start.trace = trace
    start.simcuda = simcuda
    yield start
    for kernel in kernels:
        kernel.shutdown()


def pair_state(scheduler, kernel: Kernel) -> dict | None:
    """The kernel's (client, GPU0) entry in the scheduler's own status document."""
    for client in scheduler.status()["clients"]:
        if client["host_pid"] == kernel.pid and GPU0 in client["devices"]:
            return client["devices"][GPU0]
    return None


def test_an_idle_notebook_hands_the_gpu_to_the_waiting_one(notebooks):
    scheduler = notebooks.scheduler
    # B keeps the lock once it has it (NVSHARE_IDLE_RELEASE_MS=0), so its status is stable.
    a, b = notebooks({}, {"NVSHARE_IDLE_RELEASE_MS": "0"})
    a.run(SETUP)
    b.run(SETUP)

    # Queued at once: A holds the GPU while it runs, long enough for the kernel round trips
    # below on a busy machine (each can take a second or more there) to see it holding.
    a.run("gpu.launch_sleep(6_000_000)")
    mine = a.status()["devices"][0]
    assert mine["state"] == "holding" and mine["device"] == GPU0 and mine["used"] == 64 << 20
    a.client_id = mine["client"]
    assert "holds the GPU lock" in a.run("%nvshare").displays[0]

    # B's GPU work waits, on a thread, so that B can still run %nvshare meanwhile.
    b.run("import threading\n"
          "def work():\n    gpu.context(0)\n    gpu.launch_sleep(1000)\n    gpu.synchronize()\n"
          "worker = threading.Thread(target=work)\nworker.start()")
    waiting = wait_for(lambda: (d := b.status()["devices"][0])["state"] == "waiting" and d, what="kernel B waiting")
    assert waiting["position"] == 1 and waiting["waiting_for"] >= 0
    assert [h["client"] for h in waiting["holders"]] == [a.client_id]
    shown = b.run("%nvshare").displays[0]
    assert "waiting for the GPU, 1st in line" in shown and f"held by    {a.client_id} (" in shown
    assert a.status()["devices"][0]["waiters"] == 1

    assert b.run("worker.join(60)\nprint(worker.is_alive())").stdout.strip() == "False"
    held = b.status()["devices"][0]
    assert held["state"] == "holding" and held["last_wait"]["held_by"][0]["client"] == a.client_id
    assert "holds the GPU lock" in b.run("%nvshare").displays[0]
    assert a.status()["devices"][0]["state"] == "idle"
    assert a.manager.is_alive()  # A gave the GPU back by going idle, not by leaving

    events = scheduler.events()
    release = next(e for e in events if e["kind"] == "release" and e["client"] == a.client_id)
    assert release["detail"] == "idle"
    b_grant = next(e for e in events if e["kind"] == "grant" and e["client"] == held["client"])
    assert b_grant["seq"] > release["seq"]
    # On the GPU itself: B's first kernel starts after A's last one ends, within the idle
    # window plus a margin for a busy machine (a quantum of 600 s could not have moved the lock).
    ops = notebooks.simcuda.read_trace(notebooks.trace)
    a_end = max(op["end"] for op in ops if op["pid"] == a.pid and op["op"] == "kernel")
    b_start = min(op["start"] for op in ops if op["pid"] == b.pid and op["op"] == "kernel")
    assert a_end <= b_start < a_end + IDLE_RELEASE + PATIENCE


def test_a_kernel_that_dies_mid_cell_frees_the_gpu_and_the_waiter_is_told_who_held_it(notebooks):
    scheduler = notebooks.scheduler
    crashing, waiting = notebooks({"NVSHARE_IDLE_RELEASE_MS": "0"}, {})
    crashing.run(SETUP)
    waiting.run(SETUP)
    crashing.run("gpu.launch_sleep(1000)\ngpu.synchronize()")  # holds the GPU from now on
    holder_id = crashing.status()["devices"][0]["client"]
    assert "every cell that waited at least 0.5 s" in waiting.run("%nvshare note 0.5").stdout

    blocked = waiting.submit("gpu.launch_sleep(1000)\ngpu.synchronize()\nprint('ran')")
    wait_for(lambda: (s := pair_state(scheduler, waiting)) and s["state"] == "waiting" and s["wait_total"] >= 0.8,
             what="the second kernel waiting for 0.8 s")
    crashing.submit("import os\ngpu.launch_sleep(5_000_000)\nos.kill(os.getpid(), 9)")

    cell = waiting.collect(blocked)
    assert not cell.error and cell.stdout.strip() == "ran"
    (note,) = cell.notes
    assert f"for the GPU held by {holder_id} (" in note
    assert float(note.split("waited ")[1].split(" s")[0]) >= 0.8
    wait_for(lambda: not crashing.manager.is_alive(), what="the crashed kernel gone")
    lost = [e for e in scheduler.events() if e["client"] == holder_id and e["kind"] == "lost"]
    # The kernel's death reaches the daemon twice, through its pidfd and through its closed
    # connection; whichever comes first names the loss.
    assert lost and lost[0]["detail"] in ("exited", "disconnected")

    again = waiting.run("gpu.launch_sleep(1000)\ngpu.synchronize()")  # holds it: no wait, no note
    assert again.notes == []
    text = waiting.run("%nvshare").displays[0]
    assert "holds the GPU lock" in text and f"behind {holder_id} (" in text


def test_first_cell_says_when_no_scheduler_runs_and_when_nvshare_is_missing(notebooks, tmp_path):
    # A kernelspec whose library has gone since it was installed (a broken installation), and
    # that does not load the extension: it is loaded by hand, in a cell.
    broken = notebooks.spec_dir / "broken"
    shutil.copytree(notebooks.spec_dir / "nvshare", broken)
    spec = json.loads((broken / "kernel.json").read_text())
    spec["env"]["NVSHARE_LIBRARY"] = str(tmp_path / "removed.so")
    spec["argv"].remove("--ext=nvshare_py")
    (broken / "kernel.json").write_text(json.dumps(spec))
    (no_library,) = notebooks({}, kernel_name="broken")
    (no_scheduler,) = notebooks({"NVSHARE_SOCKET_DIR": str(tmp_path / "elsewhere")})

    # Loaded when the kernel started: the first cell says what is wrong, once.
    first = no_scheduler.run("1 + 1")
    assert first.result == "2"
    assert f"No nvshare scheduler at {tmp_path / 'elsewhere'}/client/scheduler.sock" in first.stderr
    assert "GPU calls wait" in first.stderr
    assert no_scheduler.run("2 + 2").stderr == ""
    assert "does not exist" in no_scheduler.run("%nvshare").displays[0]

    # Loaded in a cell: that cell says it.
    assert "libnvshare" not in no_library.run("import os\nprint(os.environ.get('LD_PRELOAD', ''))").stdout
    loaded = no_library.run("%load_ext nvshare_py")
    assert "libnvshare.so is not loaded in this kernel" in loaded.stderr
    assert no_library.run("3 + 3").stderr == ""
    assert "libnvshare.so is not loaded" in no_library.run("%nvshare").displays[0]


def test_a_cell_waiting_for_a_missing_scheduler_says_so_in_the_cell(notebooks, tmp_path):
    (kernel,) = notebooks({"NVSHARE_SOCKET_DIR": str(tmp_path / "elsewhere")})
    kernel.run("1 + 1")  # the first cell's notice about the missing scheduler, out of the way
    waiting = kernel.submit(SETUP + "gpu.launch_sleep(1000)\ngpu.synchronize()\n")  # waits for a scheduler
    seen = ""
    deadline = time.monotonic() + 120  # the note comes after 10 s; generous for a loaded machine
    while "none answers" not in seen:
        try:
            msg = kernel.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"the waiting cell said nothing about the missing scheduler; it printed: {seen!r}")
        if msg["parent_header"].get("msg_id") == waiting and msg["msg_type"] == "stream":
            seen += msg["content"]["text"]
    assert "its GPU calls wait for a scheduler" in seen
    assert f"{tmp_path / 'elsewhere'}/client/scheduler.sock" in seen


def test_a_cell_waiting_behind_another_kernel_says_so_while_it_waits(notebooks):
    """The note says for whom the cell waits (the other kernel's client, user and notebook), for
    how long so far, and its place in line; it is updated while the wait lasts and emptied
    before the cell's own output; the note after the cell remains."""
    holder, waiter = notebooks({"NVSHARE_IDLE_RELEASE_MS": "0", "JPY_SESSION_NAME": "/home/alice/analysis.ipynb"}, {})
    holder.run(SETUP)
    waiter.run(SETUP)
    holder.run("gpu.launch_sleep(1000)\ngpu.synchronize()")  # holds the GPU from now on
    holder_id = holder.status()["devices"][0]["client"]

    blocked = waiter.submit("gpu.launch_sleep(1000)\ngpu.synchronize()\nprint('ran')")
    cell = waiter.collect(blocked, until=lambda cell: len(cell.displays) + len(cell.updates) >= 3)
    (first,) = cell.displays
    user = user_name(os.geteuid())
    assert first.startswith("nvshare: this cell waits for GPU0, ") and first.endswith("\n"), first
    assert f"held by {holder_id} ({user}, analysis.ipynb)" in first and "1st in line of 1" in first
    assert cell.updates[-1].startswith("nvshare: this cell waits for GPU0, ")
    assert cell.stdout == ""  # still waiting

    holder.shutdown()  # its GPU goes to the waiting cell
    cell = waiter.collect(blocked, cell=cell)
    assert cell.stdout.strip() == "ran" and not cell.error
    assert cell.updates[-1] == ""  # the note is gone
    (after,) = cell.notes
    assert f"for the GPU held by {holder_id} ({user}, analysis.ipynb)" in after
