"""nvshare on a real NVIDIA GPU: frameworks compute the same results under the interceptor,
every device allocation becomes managed, and the lock serialises two processes (or lets them
run side by side with the scheduler off). Memory stays far below the card's free memory."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from gpuutil import WORKLOADS, run_workload

pytestmark = pytest.mark.gpu


def needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here")


@pytest.fixture
def shared(gpu_env, libnvshare, scheduler_factory):
    """(native environment, environment under nvshare with a running scheduler, scheduler)."""
    scheduler = scheduler_factory(tq=2, grace=2, idle_release=0.5)
    env = dict(gpu_env, **{k: v for k, v in scheduler.env.items() if k.startswith("NVSHARE")})
    env["LD_PRELOAD"] = str(libnvshare)
    env["NVSHARE_LOG"] = "info"
    return gpu_env, env, scheduler


WORKLOAD_CASES = [
    ("torch", "torch_train.py", ["--mode", "eager"]),
    ("torch", "torch_train.py", ["--mode", "graph"]),
    ("torch", "torch_train.py", ["--mode", "compile"]),
    ("cupy", "cupy_work.py", []),
    ("jax", "jax_work.py", []),
]


@pytest.mark.parametrize("module, script, args", WORKLOAD_CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_frameworks_compute_the_same_under_nvshare_with_managed_memory(module, script, args, shared, record):
    needs(module)
    native_env, nvshare_env, scheduler = shared
    native = run_workload(script, native_env, *args)
    shared_run = run_workload(script, nvshare_env, *args)
    # The check of managed memory can fail: natively, framework memory is not managed.
    assert native["managed"]["unmanaged"], f"native run reported only managed memory: {native['managed']}"
    assert shared_run["managed"]["checked"] > 0
    assert shared_run["managed"]["unmanaged"] == [], shared_run["managed"]
    for key in ("losses", "checksum", "norms", "loss"):
        if key in native:
            assert shared_run[key] == native[key], f"{key} differs under nvshare"
    # The process really went through the scheduler.
    assert any(e["kind"] == "grant" for e in scheduler.events())
    record(f"frameworks/{script} {' '.join(args)}".strip(), managed_checked=shared_run["managed"]["checked"],
           identical=True)


def hold_intervals(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """client -> [(granted, given back)] from the scheduler's event log."""
    open_grants: dict[tuple[str, str], float] = {}
    intervals: dict[str, list[tuple[float, float]]] = {}
    for event in events:
        key = (event["client"], event["device"])
        if event["kind"] == "grant":
            open_grants[key] = event["t"]
        elif event["kind"] in ("release", "revoke", "lost", "unregister") and key in open_grants:
            intervals.setdefault(event["client"], []).append((open_grants.pop(key), event["t"]))
    return intervals


def run_two_bursty_programs(env: dict[str, str]) -> list[list[dict]]:
    argv = [sys.executable, str(WORKLOADS / "burst.py"), "--bursts", "3", "--burst-seconds", "1.0", "--pause-seconds", "0.4"]
    procs = [subprocess.Popen(argv + ["--name", name], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return outputs


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def test_two_processes_are_serialised_by_the_lock(shared, record):
    _, env, scheduler = shared
    started = len(scheduler.events())
    bursts = run_two_bursty_programs(env)
    intervals = hold_intervals(scheduler.events()[started:])
    assert len(intervals) == 2, intervals
    first, second = intervals.values()
    assert overlap_seconds(first, second) == 0.0, intervals
    handoffs = len(first) + len(second)
    record("sharing/serialised", holds=handoffs, bursts=[len(b) for b in bursts],
           elapsed=max(b[-1]["end"] for b in bursts) - min(b[0]["start"] for b in bursts))


def test_with_the_scheduler_off_two_processes_run_side_by_side(shared, record):
    _, env, scheduler = shared
    scheduler.request("set-mode", mode="off")
    started = len(scheduler.events())
    bursts = run_two_bursty_programs(env)
    intervals = hold_intervals(scheduler.events()[started:])
    assert len(intervals) == 2, intervals
    first, second = intervals.values()
    together = overlap_seconds(first, second)
    assert together > 0.5, intervals
    record("sharing/off", seconds_side_by_side=together,
           elapsed=max(b[-1]["end"] for b in bursts) - min(b[0]["start"] for b in bursts))


TWO_GPUS = r"""
import json, sys, time, torch
assert torch.cuda.device_count() >= 2
sums = []
for _ in range(int(sys.argv[1])):
    for device in (0, 1):
        x = torch.randn(4096, 4096, device=f"cuda:{device}", generator=None)
        for _ in range(200):
            y = x @ x
        torch.cuda.synchronize(device)
        sums.append(float(y[0, :4].sum()))
    time.sleep(0.2)
print(json.dumps({"sums": sums}))
"""


def two_gpu_count(env: dict[str, str]) -> int:
    count = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=env,
                           capture_output=True, text=True, timeout=300)
    return int(count.stdout.strip() or 0)


def test_processes_using_two_gpus_hold_one_lock_per_gpu(shared, record):
    needs("torch")
    _, env, scheduler = shared
    if two_gpu_count(env) < 2:
        pytest.skip("needs a machine with two GPUs")
    procs = [subprocess.Popen([sys.executable, "-c", TWO_GPUS, "3"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
    events = scheduler.events()
    grants = [e for e in events if e["kind"] == "grant"]
    devices = sorted({e["device"] for e in grants})
    assert len(devices) == 2, grants
    # Each process held a lock on each GPU ...
    assert {(e["client"], e["device"]) for e in grants} == {(c, d) for c in {e["client"] for e in grants} for d in devices}
    # ... and on each GPU the two processes never held it at the same time.
    for device in devices:
        intervals = hold_intervals([e for e in events if e["device"] == device])
        assert len(intervals) == 2, intervals
        first, second = intervals.values()
        assert overlap_seconds(first, second) == 0.0, (device, intervals)
    record("multi-gpu/two-processes-two-gpus", devices=devices, grants=len(grants))
