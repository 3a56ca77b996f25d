"""Weights and scheduler-set memory limits end to end: the real daemon, nvsharectl, and CUDA
programs under libnvshare.so on the simulated driver."""

from __future__ import annotations

import time

import pytest

from nvshare_py.testing.scheduler import wait_for

MiB = 1 << 20
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
GPU = "GPU-5151ad00-0000-4000-8000-000000000000"


def client_of(scheduler, pid: int, device: str = GPU) -> str:
    """The id of the registration of process `pid` once it has told the scheduler of `device`."""
    def found():
        for client in scheduler.status()["clients"]:
            if client["host_pid"] == pid and device in client["devices"]:
                return client["client"]
        return None
    return wait_for(found, what=f"the registration of pid {pid} on {device}")


def test_a_limit_set_with_nvsharectl_reaches_a_running_program(scheduler, cuda_app):
    env = scheduler.env
    app = cuda_app(env, "init", f"alloc:plain:{48 * MiB}", "wait", f"try-alloc:plain:{32 * MiB}", "meminfo",
                   f"try-alloc:plain:{8 * MiB}", "wait", f"try-alloc:plain:{32 * MiB}")
    app.expect("waiting")
    cid = client_of(scheduler, app.pid)

    result = scheduler.ctl("set-limit", "64M", "--client", cid, "--device", "GPU0")
    assert result.returncode == 0, result.stderr
    assert "64.0 MiB" in result.stdout
    wait_for(lambda: any("memory limit 67108864 bytes" in line for line in app.stderr_lines),
             what="the interceptor applying the scheduler's limit")
    assert scheduler.status()["clients"][0]["devices"][GPU]["limit"] == 64 * MiB

    app.continue_()
    assert app.expect("alloc-result").split()[1] == str(OUT_OF_MEMORY)  # 48 + 32 > 64, at once
    assert app.expect("meminfo").split()[1:3] == [f"free={16 * MiB}", f"total={64 * MiB}"]
    assert app.expect("alloc-result").split()[1] == "0"  # 48 + 8 fits: the program went on
    # The refusal's line goes to stderr, read apart from stdout: it may come in after alloc-result.
    wait_for(lambda: any("refused" in line and "set-limit" in line for line in app.stderr_lines),
             what="the refusal's line naming set-limit on the program's stderr")

    # Lifted again: the environment (no NVSHARE_MEMORY_LIMIT) rules.
    assert scheduler.ctl("set-limit", "none", "--client", cid, "--device", "GPU0").returncode == 0
    wait_for(lambda: any("memory limit lifted" in line for line in app.stderr_lines), what="the limit lifted")
    app.continue_()
    assert app.expect("alloc-result").split()[1] == "0"
    assert app.wait() == 0


def test_a_scheduler_limit_never_raises_the_environments(scheduler, cuda_app):
    env = scheduler.env
    app = cuda_app(env, "init", f"alloc:plain:{MiB}", "wait", f"try-alloc:plain:{48 * MiB}", "meminfo",
                   env={"NVSHARE_MEMORY_LIMIT": "32M"})
    app.expect("waiting")
    cid = client_of(scheduler, app.pid)
    assert scheduler.ctl("set-limit", "1G", "--client", cid).returncode == 0
    wait_for(lambda: scheduler.status()["clients"][0]["devices"][GPU]["limit"] == 1 << 30, what="the setting")
    app.continue_()
    assert app.expect("alloc-result").split()[1] == str(OUT_OF_MEMORY)
    assert app.expect("meminfo").split()[2] == f"total={32 * MiB}"
    assert app.wait() == 0


@pytest.mark.scheduler_options(tq=0.8, min_quantum=0.1, idle_release=0.0)
def test_weights_change_the_split_of_lock_time(scheduler, cuda_app):
    """Two programs that keep the GPU busy; one has weight 4. Its quanta are four times as long,
    so it holds the lock for clearly longer in all (drains and handoffs, slow on a loaded
    machine, count for both alike: the ratio is asserted loosely)."""
    env = scheduler.env
    light = cuda_app(env, "init", "kernel:1000", "sync", "wait", "loop:6:20000")
    heavy = cuda_app(env, "init", "kernel:1000", "sync", "wait", "loop:6:20000")
    light.expect("waiting")
    heavy.expect("waiting")
    light_id, heavy_id = client_of(scheduler, light.pid), client_of(scheduler, heavy.pid)
    result = scheduler.ctl("set-weight", "4", "--client", heavy_id)
    assert result.returncode == 0 and "weight of client" in result.stdout, result.stderr

    status = scheduler.ctl("status")
    assert "Shares" in status.stdout, status.stdout
    # Until now one of them held the GPU alone (nobody waited): only the contention counts.
    start = time.time()
    light.continue_()
    heavy.continue_()
    assert light.wait() == 0 and heavy.wait() == 0

    held = {light_id: 0.0, heavy_id: 0.0}
    grants = {light_id: 0, heavy_id: 0}
    since = {}
    for event in scheduler.events():
        if event["kind"] == "grant" and event["client"] in held:
            since[event["grant"]] = max(start, event["t"])
            grants[event["client"]] += 1
        elif event["kind"] in ("release", "revoke", "lost", "unregister") and event.get("grant") in since:
            held[event["client"]] += max(0.0, event["t"] - since.pop(event["grant"]))
    assert min(grants.values()) >= 3, (grants, held)  # they did take turns
    assert held[heavy_id] > 1.5 * held[light_id], (grants, held)


@pytest.mark.scheduler_options(tq=600, min_quantum=0.3, idle_release=0.0)
def test_a_higher_class_gets_the_gpu_from_a_busy_holder_within_its_quantum(scheduler, cuda_app):
    """With a 10-minute quantum, a newcomer would wait for the whole 30 s loop of the holder;
    of a higher class, it is served once the holder's quantum is cut to --min-quantum."""
    env = scheduler.env
    holder = cuda_app(env, "init", "kernel:1000", "sync", "wait", "loop:30:20000")
    holder.expect("waiting")
    holder_id = client_of(scheduler, holder.pid)
    assert scheduler.ctl("set-priority", "0", "--client", holder_id).returncode == 0
    assert scheduler.ctl("set-priority", "5").returncode == 0  # the default: every newcomer
    holder.continue_()
    wait_for(lambda: holder_id in scheduler.holders(GPU), what="the holder's loop holding the GPU")
    urgent = cuda_app(env, "init", "kernel:1000", "sync")
    urgent.expect("synced")
    assert not any(line.startswith("looped") for line in holder.lines)  # the holder's loop still runs
    assert urgent.wait() == 0
    drops = [e for e in scheduler.events() if e["kind"] == "drop" and e["client"] == holder_id]
    assert drops and drops[0]["detail"] == "quantum"


def test_nvsharectl_settings_refuse_what_they_cannot_do(scheduler):
    for argv, status, words in [
        (("set-weight", "0"), 2, "from 1 to 1000"),
        (("set-priority", "8"), 2, "from 0 to 7"),
        (("set-limit", "lots"), 2, "not a size"),
        (("set-weight", "2", "--client", "c1", "--pod-uid", "u"), 2, "not both"),
        (("set-weight", "2", "--client", "c99"), 1, "unknown-client"),
    ]:
        result = scheduler.ctl(*argv)
        assert result.returncode == status and words in result.stderr, (argv, result.returncode, result.stderr)
    assert scheduler.ctl("set-priority", "3", "--pod-uid", "0f6c-pod").returncode == 0
    assert scheduler.ctl("set-limit", "2G").returncode == 0
    settings = scheduler.status()["scheduler"]["settings"]
    assert settings["priority"]["pods"] == {"0f6c-pod": 3} and settings["limit"]["*"]["default"] == 2 << 30
