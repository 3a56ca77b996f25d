"""Co-located jobs under nvshare: the nvshare paper's experiments (seeds: Table 2, Figure 3), side by side.

    python benchmarks/bench_colocation.py --quick          # simulated driver, well under 3 minutes
    python benchmarks/bench_colocation.py                  # simulated driver, 2 and 4 jobs, full TQ sweep
    python benchmarks/bench_colocation.py --gpu [--quick]  # real GPU (PyTorch), see "Regimes" below;
                                                           # --quick keeps it to a few minutes

Jobs (each a separate process, all started together):
- `matrix`: a loop of GPU work over all of the job's memory and nothing else, like the paper's
  pytorch-add (GPU share 100 %);
- `training`: steps of a GPU burst over all of its memory followed by a CPU phase (data loading),
  the CPU phase taking `--cpu-share` of the step (default 0.5: the paper's "balanced" variants;
  0.1 is its "intense").

Regimes:
- `fits`: the jobs' memory together fits the device (each gets 80 % / jobs of it);
- `oversubscribed`: each job uses 65 % of the device, so any two exceed it.
  On the simulated driver the device is SIMCUDA_MEMORY with residency modelled
  (tests/simcuda/README.md, "Residency": 2 MiB chunks, LRU eviction across processes, fault and
  prefetch costs of an H200), and the scheduler's budget is the device's size. On a real GPU the
  card is never physically oversubscribed (safety rule): the regime is a scheduler memory budget
  (`nvsharectl set-budget`) below the jobs' sum, which swapping enforces (docs/scheduler.md,
  "Budgets and swapping"). The JSON says which mechanism each regime used.

Modes: `sequential` (the baseline: the jobs one after the other, without nvshare), and the
scheduler's `off`, `on` (fault-driven: `--swapping off`, the behaviour before issue 8 and the
original nvshare's), `swap` (mode on with `--swapping on`: over budget a handoff evicts the
holder's memory and prefetches the grantee's in bulk) and `auto` (swapping on), all jobs at
once under libnvshare.so. A TQ sweep repeats `on` and `swap` oversubscribed for several time
quanta (the paper's Figure 3). Swapping needs the interceptor's side (it reports `resident=`,
evicts on DROP/EVICT and prefetches on GRANT); with an interceptor that does not, `swap` runs
exactly as `on`, and the simulated runs show it: their `prefetched_mib` stays 0.

Makespan: from the first job's first step to the last job's end (simulated driver: simapp's
CLOCK_MONOTONIC step times; real GPU: the jobs' own monotonic stamps). The simulated driver also
reports the bytes migrated (from its trace).

With `--working-set --gpu`, $NVSHARE_BENCH_LOGS names a folder that keeps every job's stderr
(its nvshare log, at the caller's NVSHARE_LOG; default `error`), a subfolder per run: at
NVSHARE_LOG=debug each swap job's line gives its time on the scheduler events' clock.

Prints one JSON document on stdout (`summary`: per regime, job set and mode the makespan and its
ratio to sequential; `results`: everything measured; `paper`: the paper's ratios); writes colocation-<date>[-quick|-gpu].json and .png (ratios
per regime and mode beside the paper's, and the TQ sweep) into --out (benchmarks/results); a
text table of ratios vs sequential goes to stderr.

(Some 850 lines: two experiments, the paper's above and issue 18's `--working-set` cases (jobs
that touch their whole working set every step), each with its own main and document. They share
this file because they run their jobs the same way: simapp or PyTorch jobs started together, one
scheduler per mode and TQ, the lock history read from its events.)

Why one file of some 850 lines: a benchmark a user runs as one script; the job programs, the
regimes and the report are its parts, each short, and splitting it would scatter one
measurement's definition over modules nobody imports elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import build_interceptor  # noqa: E402
from nvshare_py.testing.residency import handoffs, moved  # noqa: E402
from nvshare_py.testing.scheduler import DEFAULT_OPTIONS, SchedulerProcess, child_env, short_socket_dir  # noqa: E402
from nvshare_py.testing.simcuda import build_simcuda, parse_steps  # noqa: E402
from nvshare_py.timeline import detail_fields  # noqa: E402

MIB = 1 << 20
MODES = ("sequential", "off", "on", "swap", "auto")
SIM_DEVICE = "GPU-5151ad00-0000-4000-8000-000000000000"  # the simulated GPU (tests/simcuda)
# The scheduler's options behind each mode (sequential runs without nvshare).
SCHEDULER_MODES = {"off": ("off", "off"), "on": ("on", "off"), "swap": ("on", "on"), "auto": ("auto", "on")}
SWEEP_MODES = ("on", "swap")
REGIMES = ("fits", "oversubscribed")
FITS_SHARE = 0.8           # of the device, split between the jobs
SYNC_EVERY = 5             # kernels of a simulated burst between synchronisations
# The simulated GPU's time slice between processes (SIMCUDA_TIMESLICE_US). A real GPU switches
# contexts in tens of microseconds; on the simulated driver a switch is a process wake-up, which
# on a busy development machine can take milliseconds, so slices are one kernel (10 ms) long.
SIM_TIMESLICE_US = 10000
OVERSUBSCRIBED_SHARE = 0.65  # of the device, per job

# The paper (Table 2, P100 16 GB, two TensorFlow ResNet152v2 jobs; "balanced" is 50 % GPU,
# "intense" 90 %; light 7 GB each, heavy 15 GB each): completion time / sequential.
PAPER_SEQUENTIAL = {"light_balanced": 2636, "light_intense": 1384, "heavy_balanced": 2766, "heavy_intense": 1438}
PAPER_TCT = {
    "off": {"light_balanced": 1772, "light_intense": 1128, "heavy_balanced": 11757, "heavy_intense": 11434},
    "on (TQ 1000 s)": {"light_balanced": 2053, "light_intense": 1361, "heavy_balanced": 2043, "heavy_intense": 1380},
    "on (TQ 100 s)": {"light_balanced": 2010, "light_intense": 1351, "heavy_balanced": 2100, "heavy_intense": 1435},
    "on (TQ 30 s)": {"light_balanced": 2017, "light_intense": 1366, "heavy_balanced": 2170, "heavy_intense": 1521},
}
# Figure 3 (heavy_balanced, TQ sweep) as far as Table 2 gives it.
PAPER_TQ_SWEEP = {1000: 2043, 100: 2100, 60: 2122, 30: 2170}


def paper_ratios() -> dict[str, dict[str, float]]:
    return {mode: {variant: round(tct / PAPER_SEQUENTIAL[variant], 3) for variant, tct in row.items()}
            for mode, row in PAPER_TCT.items()}


def paper_variant(regime: str, cpu_share: float) -> str:
    return ("light" if regime == "fits" else "heavy") + ("_balanced" if cpu_share >= 0.3 else "_intense")


# --- the simulated driver ----------------------------------------------------------------


class Simulated:
    """Jobs are simapp processes; the device has `capacity` bytes with residency modelled."""

    mechanism = {"fits": "simulated device capacity (SIMCUDA_MEMORY), residency modelled",
                 "oversubscribed": "simulated device capacity (SIMCUDA_MEMORY), residency modelled: "
                                   "fault-driven paging and LRU eviction at H200 costs"}

    def __init__(self, work: Path, capacity: int, steps: int, burst_s: float, idle_release: float,
                 kernel_us: int) -> None:
        self.work = work
        self.idle_release = idle_release
        self.capacity = capacity
        self.steps = steps
        self.burst_s = burst_s
        self.kernel_us = kernel_us
        self.simcuda = build_simcuda(REPO, work / "sim")
        self.library = build_interceptor(REPO, work / "lib")
        self.schedulers = Schedulers()
        self.run_number = 0

    def job_steps(self, footprint: int, cpu_share: float) -> list[str]:
        return simapp_job(footprint, cpu_share, self.steps, self.burst_s, self.kernel_us)

    def run(self, footprints: list[int], cpu_share: float, mode: str, tq: float, timeout: float) -> dict[str, Any]:
        self.run_number += 1
        state = self.work / f"run{self.run_number}"
        state.mkdir()
        trace = state / "trace.jsonl"
        env = self.simcuda.env(trace=trace, memory=str(self.capacity), SIMCUDA_RESIDENCY_DIR=str(state),
                               SIMCUDA_TIMESLICE_US=str(SIM_TIMESLICE_US))
        if mode != "sequential":
            scheduler = self.schedulers.get(mode, tq, idle_release=self.idle_release)
            env = {**env, **scheduler.env, "LD_PRELOAD": str(self.library),
                   "NVSHARE_LOG": os.environ.get("NVSHARE_LOG", "error")}
            # The daemon sizes devices only by its own NVML measurement (none of a simulated
            # GPU here) and the operator's budget: the budget is the simulated device's size.
            scheduler.request("set-budget", device=SIM_DEVICE, bytes=self.capacity)
        argv = [self.simcuda.simapp_argv(*self.job_steps(f, cpu_share)) for f in footprints]
        if mode == "sequential":
            spans, finished = [], True
            for one in argv:
                result = run_jobs([one], env, timeout)
                spans.append(result["makespan_s"])
                finished &= result["finished"]
            outcome = {"makespan_s": round(sum(spans), 4), "finished": finished}
        else:
            outcome = run_jobs(argv, env, timeout)
        lines = self.simcuda.read_trace(trace)
        outcome["migrated_to_device_mib"] = round(moved(lines, direction="to_device") / MIB, 1)
        outcome["evicted_mib"] = round(moved(lines, cause="evict") / MIB, 1)
        # Bulk moves (cuMemPrefetchAsync): what swapping did, both ways.
        outcome["prefetched_mib"] = round(moved(lines, cause="prefetch", direction="to_device") / MIB, 1)
        outcome["swapped_out_mib"] = round(moved(lines, cause="prefetch", direction="to_host") / MIB, 1)
        if outcome["finished"]:  # a killed job's last kernel has no trace line to count turns by
            outcome["handoffs"] = handoffs(lines)
        shutil.rmtree(state, ignore_errors=True)
        return outcome


class Schedulers:
    """One daemon per (mode, TQ), started when first needed and kept for the later runs."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, float], SchedulerProcess] = {}

    def get(self, mode: str, tq: float, idle_release: float) -> SchedulerProcess:
        """`mode`: one of MODES but sequential."""
        if (mode, tq) not in self.running:
            scheduling, swapping = SCHEDULER_MODES[mode]
            options = {**DEFAULT_OPTIONS, "log_level": "warning", "mode": scheduling, "swapping": swapping, "tq": tq,
                       "idle_release": idle_release}
            self.running[mode, tq] = SchedulerProcess(short_socket_dir(), options).start()
        return self.running[mode, tq]

    def close(self) -> None:
        for scheduler in self.running.values():
            scheduler.stop()
            shutil.rmtree(scheduler.socket_dir, ignore_errors=True)


def run_jobs(argvs: list[list[str]], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Starts simapp jobs together; makespan from their own step times. Jobs still running after
    `timeout` are killed and the makespan is reported as at least that long."""
    started = time.monotonic()
    processes = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for argv in argvs]
    outputs, finished = [], True
    for process in processes:
        try:
            out, err = process.communicate(timeout=max(1.0, started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            finished = False
        else:
            if process.returncode != 0:
                raise RuntimeError(f"job failed ({process.returncode}): {err[-2000:]}")
        outputs.append(parse_steps(out))
    if not finished:
        return {"makespan_s": round(timeout, 4), "finished": False}
    first = min(step["start"] for steps in outputs for step in steps if step["step"] != "init")
    last = max(step["end"] for steps in outputs for step in steps)
    return {"makespan_s": round(last - first, 4), "finished": True}


def simapp_job(footprint: int, cpu_share: float, steps: int, burst_s: float, kernel_us: int) -> list[str]:
    """simapp's steps for a job: `steps` bursts of kernels over all its memory (each simulated
    kernel touches the process's whole working set), each followed by its CPU phase."""
    kernels = max(1, round(burst_s * 1e6 / kernel_us))
    # A sync every few kernels, as a training loop's .item() would: the queue stays short,
    # so a holder told to drain at its quantum's end hands over soon.
    work = [f"kernel:{kernel_us}" + (",sync" if (i + 1) % SYNC_EVERY == 0 else "") for i in range(kernels)]
    burst = ",".join(work + ([] if kernels % SYNC_EVERY == 0 else ["sync"]))
    if cpu_share > 0:
        cpu_ms = burst_s * cpu_share / (1 - cpu_share) * 1e3
        burst += f",sleep:{cpu_ms:.3f}"
    return [f"alloc:plain:{footprint}", f"repeat:{steps}:{burst}"]


# --- a real GPU ----------------------------------------------------------------------------

GPU_JOB = r"""
import sys, time, torch
footprint, steps, iters, cpu_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
n = footprint // 4 // 2
a = torch.ones(n, device="cuda"); b = torch.ones(n, device="cuda")
torch.cuda.synchronize()
start = time.monotonic()
for _ in range(steps):
    for _ in range(iters):
        a.add_(b)             # pytorch-add: every byte of the job's memory each iteration
    torch.cuda.synchronize()
    if cpu_s:
        time.sleep(cpu_s)     # the CPU phase (data loading)
print(start, time.monotonic(), flush=True)
"""


def gpu_uuid(env: dict[str, str] | None = None) -> str:
    """The UUID of the GPU the jobs use, as nvshare names devices (nvidia-smi's GPU-... form):
    a budget may be set for it before any job has started."""
    code = "import torch; print(torch.cuda.get_device_properties(0).uuid)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return "GPU-" + out.split()[-1]


class RealGpu:
    """Jobs are PyTorch processes with small allocations; the device is a scheduler budget."""

    mechanism = {"fits": "real GPU, memory fits the budget",
                 "oversubscribed": "real GPU under a scheduler memory budget (nvsharectl set-budget) below the "
                                   "jobs' sum: mode swap moves memory in bulk at handoffs to keep within it; "
                                   "on/auto without swapping leave the pages on the card (only the scheduling "
                                   "reacts to the budget)"}

    def __init__(self, work: Path, capacity: int, steps: int, burst_s: float, idle_release: float,
                 library: Path) -> None:
        self.work = work
        self.idle_release = idle_release
        self.capacity = capacity
        self.steps = steps
        self.burst_s = burst_s
        self.library = library
        self.schedulers = Schedulers()
        self.device = gpu_uuid()
        self.iters = self.calibrate()

    def calibrate(self) -> int:
        """Iterations of a.add_(b) over a fits-regime footprint that take `burst_s` alone."""
        code = ("import time, torch\nn = %d\na = torch.ones(n, device='cuda'); b = torch.ones(n, device='cuda')\n"
                "for _ in range(20): a.add_(b)\ntorch.cuda.synchronize(); t = time.monotonic()\n"
                "for _ in range(200): a.add_(b)\ntorch.cuda.synchronize(); print((time.monotonic() - t) / 200)\n"
                % (int(self.capacity * OVERSUBSCRIBED_SHARE) // 8))
        per_iter = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                         .stdout.split()[-1])
        return max(1, round(self.burst_s / per_iter))

    def run(self, footprints: list[int], cpu_share: float, mode: str, tq: float, timeout: float,
            budget: int | None = None) -> dict[str, Any]:
        cpu_s = self.burst_s * cpu_share / (1 - cpu_share) if cpu_share > 0 else 0.0
        env = child_env()
        if mode != "sequential":
            scheduler = self.schedulers.get(mode, tq, idle_release=self.idle_release)
            env = {**env, **scheduler.env, "LD_PRELOAD": str(self.library),
                   "NVSHARE_LOG": os.environ.get("NVSHARE_LOG", "error")}
            scheduler.request("set-budget", device=self.device, bytes=budget)  # None: the card's size
        argvs = [[sys.executable, "-c", GPU_JOB, str(f), str(self.steps), str(self.iters), str(cpu_s)]
                 for f in footprints]
        if mode == "sequential":
            total = 0.0
            for argv in argvs:
                total += gpu_jobs([argv], env, timeout)
            return {"makespan_s": round(total, 4), "finished": True}
        since = scheduler.events_since(0)[1]
        makespan = gpu_jobs(argvs, env, timeout)
        return {"makespan_s": round(makespan, 4), "finished": True,
                **lock_history(scheduler.events(since))}


def lock_history(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the scheduler did during a run (its event timeline): how often the lock changed
    hands, how much memory grants brought back and evictions asked for, and the events
    themselves (seconds from the first, client, kind, detail) to read a surprising makespan by."""
    if not events:
        return {"grants": 0, "events": []}
    first = events[0]["t"]
    grants = [e for e in events if e["kind"] == "grant"]
    return {
        "grants": len(grants),
        "prefetch_granted_mib": sum(int(detail_fields(e["detail"]).get("prefetch", 0)) for e in grants) // MIB,
        "evict_requests": sum(1 for e in events if e["kind"] == "evict"),
        "events": [[round(e["t"] - first, 3), e["client"], e["kind"], e["detail"]] for e in events
                   if e["kind"] not in ("register", "unregister")],
    }


def gpu_jobs(argvs: list[list[str]], env: dict[str, str], timeout: float, logs: Path | None = None) -> float:
    """Runs the jobs at once; the span from the first one's start to the last one's end. Each
    job's stderr (its nvshare log) goes to a file, not a pipe nobody reads meanwhile (at
    NVSHARE_LOG=debug it outgrows one): with `logs`, logs/job<i>.log, which stays."""
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    errs = [open(logs / f"job{i}.log", "w+") if logs is not None else tempfile.TemporaryFile("w+")
            for i in range(len(argvs))]
    processes = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
                 for argv, err in zip(argvs, errs)]
    spans = []
    deadline = time.monotonic() + timeout
    try:
        for process, err in zip(processes, errs):
            out, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"GPU job failed ({process.returncode}): {err.read()[-2000:]}")
            spans.append([float(x) for x in out.split()[-2:]])
    except subprocess.TimeoutExpired as expired:
        raise RuntimeError(f"GPU jobs still running after {timeout} s: killed") from expired
    finally:
        for process in processes:  # none outlives its run (a failure or a timeout leaves others)
            if process.poll() is None:
                process.kill()
                process.wait()
        for err in errs:
            err.close()
    return max(end for _, end in spans) - min(start for start, _ in spans)


# --- the working set touched every step (issue 18) ----------------------------------------
#
# Jobs like training loops that touch all their memory each step: `hold.add_(1)` over the
# footprint, about `--ws-burst` seconds of matrix products, then a third of that on the CPU.
# Modes: `sequential` and `together` (all at once, the card big enough) without nvshare, the
# yardsticks; `on` (nvshare, no budget: nothing moves); `swap` (mode on with the case's budget,
# swapping) and `auto` (mode auto, same budget). On the simulated driver the sizes are divided by
# SIM_WS_DIVISOR (a GiB becomes 8 MiB on a 1 GiB device) and its costs multiplied by
# SIM_WS_COST_SCALE, so that a handoff weighs against a step about as on an H100.

GIB = 1 << 30
WS_MODES = ("sequential", "together", "on", "swap", "auto")
# name: (jobs, footprint per job, budget, modes run by default)
WS_CASES = {"pair": (2, 24 * GIB, 32 * GIB, WS_MODES),
            "four": (4, 12 * GIB, 24 * GIB, ("sequential", "together", "swap"))}
SIM_WS_DIVISOR = 128
SIM_WS_COST_SCALE = 64
WS_CPU_SHARE = 1 / 3  # of a step: 1 s of CPU after 2 s of GPU work

WS_GPU_JOB = r"""
import sys, time, torch
footprint, steps, iters, cpu_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
hold = torch.zeros((footprint - 3 * a.nbytes) // 4, device="cuda")
torch.cuda.synchronize()
start = time.monotonic()
for _ in range(steps):
    hold.add_(1)              # the whole working set, every step
    for _ in range(iters):
        c = a @ b             # the step's compute
    torch.cuda.synchronize()
    time.sleep(cpu_s)         # the CPU phase
end = time.monotonic()
assert int(hold.min().item()) == steps == int(hold.max().item()), "memory lost"
print(start, end, flush=True)
"""


def matmul_iterations(burst_s: float) -> int:
    """8192x8192 bf16 products that take `burst_s` on this GPU alone."""
    code = ("import time, torch\na = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)\n"
            "for _ in range(20): c = a @ b\ntorch.cuda.synchronize(); t = time.monotonic()\n"
            "for _ in range(200): c = a @ b\ntorch.cuda.synchronize(); print((time.monotonic() - t) / 200)\n")
    per = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])
    return max(1, round(burst_s / per))


class WorkingSet:
    """Runs a case's jobs in one mode, on a real GPU (PyTorch) or the simulated driver (simapp)."""

    def __init__(self, work: Path, gpu: bool, steps: int, burst_s: float, tq: float, idle_release: float,
                 library: Path | None) -> None:
        self.work, self.gpu, self.steps, self.burst_s, self.tq = work, gpu, steps, burst_s, tq
        self.cpu_s = burst_s * WS_CPU_SHARE / (1 - WS_CPU_SHARE)
        self.idle_release = idle_release
        self.library = library or build_interceptor(REPO, work / "lib")
        self.schedulers = Schedulers()
        self.run_number = 0
        if gpu:
            self.device = gpu_uuid()
            self.iters = matmul_iterations(burst_s)
            # The link as this card's pinned copies move it (--link-gbps, from
            # bench_swap_bandwidth.py in the same run), for the stall bound; None: not known.
            self.link_bps: float | None = None
        else:
            self.simcuda = build_simcuda(REPO, work / "sim")
            probe = "from nvshare_py.driver import Driver; print(Driver().devices()[0].uuid)"
            self.device = subprocess.run([sys.executable, "-c", probe], env=self.simcuda.env(), capture_output=True,
                                         text=True, check=True).stdout.split()[-1]
            self.link_bps = MIB / (19.07e-6 * SIM_WS_COST_SCALE)  # SIMCUDA_PINNED_US_PER_MIB's default, scaled

    def size(self, nbytes: int) -> int:
        return nbytes if self.gpu else nbytes // SIM_WS_DIVISOR

    def run(self, jobs: int, footprint: int, mode: str, budget: int, timeout: float) -> dict[str, Any]:
        footprint, budget = self.size(footprint), self.size(budget)
        self.run_number += 1
        state = self.work / f"ws{self.run_number}"
        state.mkdir()
        trace = state / "trace.jsonl"
        if self.gpu:
            env = child_env()
            argv = [sys.executable, "-c", WS_GPU_JOB, str(footprint), str(self.steps), str(self.iters), str(self.cpu_s)]
        else:
            env = self.simcuda.env(trace=trace, memory=str(GIB), SIMCUDA_RESIDENCY_DIR=str(state),
                                   SIMCUDA_TIMESLICE_US=str(SIM_TIMESLICE_US), SIMCUDA_COST_SCALE=str(SIM_WS_COST_SCALE))
            argv = self.simcuda.simapp_argv(*simapp_job(footprint, WS_CPU_SHARE, self.steps, self.burst_s, 10000))
        scheduler = None
        if mode not in ("sequential", "together"):
            scheduler = self.schedulers.get(mode, self.tq, idle_release=self.idle_release)
            env = {**env, **scheduler.env, "LD_PRELOAD": str(self.library),
                   "NVSHARE_LOG": os.environ.get("NVSHARE_LOG", "error")}
            scheduler.request("set-budget", device=self.device, bytes=None if mode == "on" else budget)
            since = scheduler.events_since(0)[1]
        if mode == "sequential":
            makespan = sum(self._jobs([argv], env, timeout, self.logs(f"ws{self.run_number}-{mode}-{i}"))
                           for i in range(jobs))
        else:
            makespan = self._jobs([argv] * jobs, env, timeout, self.logs(f"ws{self.run_number}-{mode}"))
        outcome: dict[str, Any] = {"makespan_s": round(makespan, 3), "jobs": jobs, "footprint_mib": footprint // MIB,
                                   "budget_mib": budget // MIB if mode in ("swap", "auto") else None}
        if scheduler is not None:
            events = scheduler.events(since)
            outcome.update(lock_history(events))
            outcome["stalls"] = handoff_stalls(events, self.link_bps)
        if not self.gpu:
            outcome["link_mib"] = link_traffic(self.simcuda.read_trace(trace))
        shutil.rmtree(state, ignore_errors=True)
        return outcome

    def logs(self, run: str) -> Path | None:
        """$NVSHARE_BENCH_LOGS: a folder to keep the GPU jobs' logs in, a subfolder a run."""
        folder = os.environ.get("NVSHARE_BENCH_LOGS")
        return Path(folder) / run if folder and self.gpu else None

    def _jobs(self, argvs: list[list[str]], env: dict[str, str], timeout: float, logs: Path | None) -> float:
        if self.gpu:
            return gpu_jobs(argvs, env, timeout, logs)
        result = run_jobs(argvs, env, timeout)
        if not result["finished"]:
            raise RuntimeError(f"simulated jobs did not finish within {timeout} s")
        return result["makespan_s"]


def handoff_stalls(events: list[dict[str, Any]], link_bps: float | None) -> dict[str, Any]:
    """Per handoff to a client that had memory to bring back, how long it stalled:
    - a grant that still had memory to bring back (detail swapped=S): until the grantee reported
      all of it back (event `restored` of that grant, its gate open), against issue 18's bound
      S / (0.8 x link) + 50 ms;
    - memory brought back ahead of the grant (`restored` with grant 0 before the grant): from when
      the lock was let go (the last release, revoke or loss before the grant, or the client's own
      ACQUIRE if later) to the grant, at which its gate opens. The events do not say S there: no
      bound."""
    stalls = []
    for index, event in enumerate(events):
        if event["kind"] != "grant":
            continue
        swapped = int(detail_fields(event["detail"]).get("swapped", 0))
        earlier = events[:index]
        if swapped:
            back = next((later for later in events[index + 1:] if later["kind"] == "restored"
                         and later["client"] == event["client"] and later["grant"] == event["grant"]), None)
            stall = round(back["t"] - event["t"], 4) if back else None
            bound = round(swapped / (0.8 * link_bps) + 0.05, 4) if link_bps else None
            stalls.append({"client": event["client"], "swapped_mib": swapped // MIB, "stall_s": stall, "bound_s": bound})
            continue
        asked = next((e for e in reversed(earlier) if e["kind"] == "acquire" and e["client"] == event["client"]), None)
        ahead = next((e for e in reversed(earlier) if e["kind"] == "restored" and e["client"] == event["client"]
                      and not e["grant"] and (asked is None or e["t"] >= asked["t"])), None)
        if ahead is None:
            continue
        freed = next((e["t"] for e in reversed(earlier) if e["kind"] in ("release", "revoke", "lost")), None)
        since = [t for t in (freed, asked["t"] if asked else None) if t is not None]
        start = max(since, default=event["t"])
        stall = round(event["t"] - start, 4) if start <= ahead["t"] else 0.0  # back before the lock was let go
        stalls.append({"client": event["client"], "swapped_mib": None, "stall_s": stall, "bound_s": None})
    measured = [s for s in stalls if s["stall_s"] is not None]
    return {"handoffs_with_memory_to_bring_back": len(stalls),
            "max_stall_s": max((s["stall_s"] for s in measured), default=None),
            "within_bound": sum(1 for s in measured if s["bound_s"] is not None and s["stall_s"] <= s["bound_s"]),
            "each": stalls}


def link_traffic(lines: list[dict[str, Any]]) -> dict[str, float]:
    """What crossed the simulated link (MiB): the swap engine's copies each way, the pages it
    discarded, and what the driver migrated by itself (faults, evictions) or by prefetch."""
    def mib(n: int) -> float:
        return round(n / MIB, 1)
    return {"copied_out": mib(sum(line["bytes"] for line in lines if line.get("link") == "d2h")),
            "copied_in": mib(sum(line["bytes"] for line in lines if line.get("link") == "h2d")),
            "discarded": mib(sum(line.get("released", 0) for line in lines if line.get("op") == "discard")),
            "faulted_in": mib(moved(lines, cause="fault", direction="to_device")),
            "driver_evicted": mib(moved(lines, cause="evict")),
            "prefetched_out": mib(moved(lines, cause="prefetch", direction="to_host"))}


def working_set(args: argparse.Namespace, runs: WorkingSet, save) -> dict[str, Any]:
    """Every case in every mode; a run that fails is recorded with its error and the next one
    runs. `save(cases)` after each run: what was measured survives a later failure."""
    cases: dict[str, Any] = {}
    for name in args.working_set:
        jobs, footprint, budget, modes = WS_CASES[name]
        modes = tuple(args.ws_modes or modes)
        case: dict[str, Any] = {"jobs": jobs, "footprint_gib": footprint / GIB, "budget_gib": budget / GIB,
                                "modes": {}}
        cases[name] = case
        for mode in modes:
            try:
                outcome = runs.run(jobs, footprint, mode, budget, args.timeout)
            except (RuntimeError, subprocess.SubprocessError) as failure:
                case.setdefault("failed", {})[mode] = str(failure)[-3000:]
                print(f"  {name} {mode:10} FAILED: {str(failure)[-500:]}", file=sys.stderr, flush=True)
                continue
            case["modes"][mode] = outcome
            print(f"  {name} {mode:10} {outcome['makespan_s']} s, grants {outcome.get('grants')}", file=sys.stderr,
                  flush=True)
            spans = {mode: outcome["makespan_s"] for mode, outcome in case["modes"].items()}
            for done, outcome in case["modes"].items():
                for yardstick in ("sequential", "together", "on"):
                    if yardstick in spans and done != yardstick:
                        outcome[f"ratio_to_{yardstick}"] = round(outcome["makespan_s"] / spans[yardstick], 3)
            save(cases)
    return cases


def working_set_table(cases: dict[str, Any]) -> str:
    lines = [f"{'case':6}{'mode':12}{'makespan':>10}{'/seq':>8}{'/together':>10}{'/on':>8}{'grants':>8}{'max stall':>11}"]
    for name, case in cases.items():
        for mode, o in case["modes"].items():
            stall = (o.get("stalls") or {}).get("max_stall_s")
            nan = float("nan")
            lines.append(f"{name:6}{mode:12}{o['makespan_s']:>10.2f}{o.get('ratio_to_sequential', nan):>8.2f}"
                         f"{o.get('ratio_to_together', nan):>10.2f}{o.get('ratio_to_on', nan):>8.2f}{o.get('grants', 0):>8}"
                         f"{'' if stall is None else format(stall, '.3f'):>11}")
    return "\n".join(lines)


# --- the experiments -----------------------------------------------------------------------


def footprints(regime: str, jobs: int, capacity: int) -> list[int]:
    share = FITS_SHARE / jobs if regime == "fits" else OVERSUBSCRIBED_SHARE
    return [int(capacity * share) // (2 * MIB) * (2 * MIB)] * jobs


def experiments(args: argparse.Namespace, backend) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    kinds = {kind: share for kind, share in (("matrix", 0.0), ("training", args.cpu_share)) if kind in args.kinds}
    for jobs in args.jobs:
        for kind, cpu_share in kinds.items():
            for regime in REGIMES:
                sizes = footprints(regime, jobs, args.capacity)
                row = {"jobs": jobs, "kind": kind, "cpu_share": cpu_share, "regime": regime,
                       "footprint_mib": sizes[0] // MIB, "mechanism": backend.mechanism[regime],
                       "paper_variant": paper_variant(regime, cpu_share), "modes": {}}
                for mode in MODES:
                    extra = {}
                    if isinstance(backend, RealGpu) and regime == "oversubscribed" and mode != "sequential":
                        extra["budget"] = int(sum(sizes) / 1.5)
                    outcome = backend.run(sizes, cpu_share, mode, args.tq, args.timeout, **extra)
                    row["modes"][mode] = outcome
                    print(f"  {jobs} {kind:8} {regime:14} {mode:10} {outcome}", file=sys.stderr, flush=True)
                sequential = row["modes"]["sequential"]["makespan_s"]
                for outcome in row["modes"].values():
                    outcome["ratio_to_sequential"] = round(outcome["makespan_s"] / sequential, 3)
                results.append(row)
    if not args.tq_sweep:
        return {"results": results}
    sweep_sizes = footprints("oversubscribed", args.jobs[0], args.capacity)
    sweep = {"jobs": args.jobs[0], "kind": "training", "cpu_share": args.cpu_share, "regime": "oversubscribed", "points": []}
    baseline = next(r for r in results if r["kind"] == "training" and r["regime"] == "oversubscribed"
                    and r["jobs"] == args.jobs[0])
    sweep["sequential_s"] = baseline["modes"]["sequential"]["makespan_s"]
    for tq in args.tq_sweep:
        extra = {"budget": int(sum(sweep_sizes) / 1.5)} if isinstance(backend, RealGpu) else {}
        for mode in SWEEP_MODES:
            outcome = backend.run(sweep_sizes, args.cpu_share, mode, tq, args.timeout, **extra)
            outcome["tq_s"] = tq
            outcome["mode"] = mode
            outcome["ratio_to_sequential"] = round(outcome["makespan_s"] / sweep["sequential_s"], 3)
            sweep["points"].append(outcome)
            print(f"  TQ {tq} {mode}: {outcome}", file=sys.stderr, flush=True)
    return {"results": results, "tq_sweep": sweep}


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """{regime: {"<jobs>x <kind>": {mode: {makespan_s, ratio_to_sequential, finished}}}}"""
    out: dict[str, Any] = {regime: {} for regime in REGIMES}
    for row in results:
        out[row["regime"]][f"{row['jobs']}x {row['kind']}"] = {
            mode: {key: outcome[key] for key in ("makespan_s", "ratio_to_sequential", "finished")}
            for mode, outcome in row["modes"].items()}
    return out


def table(document: dict[str, Any]) -> str:
    paper = document["paper"]["ratio_to_sequential"]
    lines = [f"{'jobs':>4} {'kind':9} {'regime':15} " + " ".join(f"{m:>10}" for m in MODES)
             + "   paper (variant: off / on TQ 1000 / on TQ 30)"]
    for row in document["results"]:
        cells = []
        for mode in MODES:
            outcome = row["modes"][mode]
            cells.append(f"{('>' if not outcome['finished'] else '') + format(outcome['ratio_to_sequential'], '.2f'):>10}")
        variant = row["paper_variant"]
        lines.append(f"{row['jobs']:>4} {row['kind']:9} {row['regime']:15} " + " ".join(cells)
                     + f"   {variant}: {paper['off'][variant]:.2f} / {paper['on (TQ 1000 s)'][variant]:.2f}"
                       f" / {paper['on (TQ 30 s)'][variant]:.2f}")
    sweep = document.get("tq_sweep")
    if sweep is None:
        return "\n".join(lines)
    lines.append(f"TQ sweep ({sweep['jobs']} training jobs, oversubscribed, on / swap): " + ", ".join(
        f"TQ {tq:g}s: " + " / ".join(f"{p['ratio_to_sequential']:.2f}" for p in sweep["points"] if p["tq_s"] == tq)
        for tq in dict.fromkeys(p["tq_s"] for p in sweep["points"]))
        + "; paper heavy_balanced: " + ", ".join(
        f"TQ {tq}s: {tct / PAPER_SEQUENTIAL['heavy_balanced']:.2f}" for tq, tct in PAPER_TQ_SWEEP.items()))
    return "\n".join(lines)


def plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["results"]
    sweep = document.get("tq_sweep")
    if sweep is None:
        figure, bars = plt.subplots(1, 1, figsize=(10, 5))
    else:
        figure, (bars, sweep_axes) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [2, 1]})
    paper = document["paper"]["ratio_to_sequential"]
    labels = [f"{r['jobs']}x {r['kind']}\n{r['regime']}" for r in rows] + ["paper\nlight_balanced",
                                                                            "paper\nheavy_balanced"]
    width = 0.8 / len(MODES)
    for index, mode in enumerate(MODES):
        values = [r["modes"][mode]["ratio_to_sequential"] for r in rows]
        paper_mode = {"off": "off", "on": "on (TQ 1000 s)"}.get(mode)
        values += [paper[paper_mode]["light_balanced"] if paper_mode else 0,
                   paper[paper_mode]["heavy_balanced"] if paper_mode else 0]
        if mode == "sequential":
            values[-2:] = [1.0, 1.0]
        positions = [i + (index - (len(MODES) - 1) / 2) * width for i in range(len(labels))]
        bars.bar(positions, values, width, label=mode)
        for position, row in zip(positions, rows):
            if not row["modes"][mode]["finished"]:  # killed at the timeout: a lower bound
                bars.annotate("killed at\ntimeout", (position, row["modes"][mode]["ratio_to_sequential"]),
                              ha="center", va="bottom", fontsize=6)
    bars.axhline(1.0, color="black", linewidth=0.8)
    bars.set_xticks(range(len(labels)), labels, fontsize=7)
    bars.set_ylabel("makespan / sequential (lower is better)")
    bars.set_yscale("log")
    bars.set_title(f"co-located jobs ({document['backend']})")
    bars.legend()
    if sweep is not None:
        for mode in SWEEP_MODES:
            points = [p for p in sweep["points"] if p["mode"] == mode]
            sweep_axes.plot([p["tq_s"] for p in points], [p["makespan_s"] for p in points], "o-",
                            label=f"nvshare {mode}")
        sweep_axes.axhline(sweep["sequential_s"], color="grey", linestyle="--", label="sequential")
        sweep_axes.set_xscale("log")
        sweep_axes.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        sweep_axes.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        sweep_axes.set_xlabel("time quantum (s)")
        sweep_axes.set_ylabel("makespan (s)")
        sweep_axes.set_title(f"{sweep['jobs']} training jobs, oversubscribed (paper: Figure 3)")
        sweep_axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def machine_load() -> dict[str, Any]:
    load1, load5, load15 = os.getloadavg()
    return {"cpus": os.cpu_count(), "loadavg": [round(load1, 2), round(load5, 2), round(load15, 2)]}


def main_working_set(args: argparse.Namespace) -> None:
    """--working-set: issue 18's cases; defaults: the issue's steps (2 s of matrix products and
    1 s of CPU) and TQ 10 s; 5 steps a job on a GPU, 4 simulated."""
    args.working_set = args.working_set or list(WS_CASES)
    steps, burst_s, tq, timeout = (5, 2.0, 10.0, 300.0) if args.gpu else (4, 2.0, 10.0, 180.0)
    args.steps, args.burst_s, args.tq = args.steps or steps, args.burst or burst_s, args.tq or tq
    args.timeout = args.timeout or timeout
    # A short idle window, so that a job's CPU phase hands the GPU over; simulated, the tests'
    # 0.3 s: on a busy small machine a simulated job can stall for a tenth of a second mid-burst.
    args.idle_release = (0.1 if args.gpu else 0.3) if args.idle_release is None else args.idle_release
    work = Path(tempfile.mkdtemp(prefix="nvs-ws-", dir="/tmp"))
    started = time.monotonic()
    try:
        runs = WorkingSet(work, args.gpu, args.steps, args.burst_s, args.tq, args.idle_release, args.library)
        if args.gpu:  # asked in a child: this process keeps no CUDA context during the runs
            code = "import torch; print(torch.cuda.get_device_name(), '(torch', torch.__version__ + ')')"
            backend = "real GPU " + subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                   check=True).stdout.strip()
            runs.link_bps = args.link_gbps * 1e9 if args.link_gbps else None
        else:
            backend = (f"simulated driver (tests/simcuda, residency modelled, H200 costs x {SIM_WS_COST_SCALE}, sizes / "
                       f"{SIM_WS_DIVISOR})")
        document: dict[str, Any] = {
            "benchmark": "colocation-working-set",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "backend": backend, "simulated": not args.gpu,
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "load_before": machine_load()},
            "settings": {"steps": args.steps, "gpu_burst_s": args.burst_s, "cpu_s": runs.cpu_s, "tq_s": args.tq,
                         "idle_release_s": args.idle_release, "timeout_s": args.timeout,
                         "link_GBps": runs.link_bps / 1e9 if runs.link_bps else None,
                         "matmuls_per_step": getattr(runs, "iters", None)},
            "targets": {"pair": "swap <= 0.80 x sequential and <= 1.10 x on (no budget); stretch <= 1.05 x together",
                        "four": "swap <= 0.80 x sequential"},
        }
        some = "" if set(args.working_set) == set(WS_CASES) else "-" + "-".join(args.working_set)
        out = args.out / (f"colocation-ws-{datetime.date.today().isoformat()}" + ("-gpu" if args.gpu else "-sim")
                          + some + ".json")
        out.parent.mkdir(parents=True, exist_ok=True)

        def save(cases: dict[str, Any]) -> None:
            out.write_text(json.dumps({**document, "cases": cases, "partial": True}, indent=1) + "\n")

        try:
            document["cases"] = working_set(args, runs, save)
        finally:
            runs.schedulers.close()
        document["machine"]["load_after"] = machine_load()
        document["elapsed_s"] = round(time.monotonic() - started, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(working_set_table(document["cases"]), file=sys.stderr)
    print(json.dumps(document, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 jobs, short steps, 3-point TQ sweep")
    parser.add_argument("--gpu", action="store_true", help="a real GPU with PyTorch instead of the simulated driver")
    parser.add_argument("--cpu-share", type=float, default=0.5, help="share of a training step spent on the CPU")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--library", type=Path, help="libnvshare.so for --gpu (default: built from this tree)")
    parser.add_argument("--jobs", type=int, nargs="+", help="co-located job counts (default: 2 with --quick, else 2 4)")
    parser.add_argument("--timeout", type=float, help="seconds after which a run's jobs are killed (thrashing)")
    parser.add_argument("--kinds", nargs="+", choices=("matrix", "training"), default=("matrix", "training"))
    parser.add_argument("--steps", type=int, help="steps per job (default: 3 with --quick, else 5)")
    parser.add_argument("--burst", type=float, help="GPU seconds per step (default: 0.3 with --quick, else 0.5)")
    parser.add_argument("--tq", type=float, help="the time quantum of the modes (default: 2 with --quick, else 5)")
    parser.add_argument("--tq-sweep", type=float, nargs="*",
                        help="time quanta of the sweep; none: no sweep (default: 0.2 0.6 2 with --quick, "
                             "else 0.2 0.5 1 2 5 10)")
    parser.add_argument("--idle-release", type=float,
                        help="the scheduler's --idle-release (default: half a burst, at most the scheduler's own "
                             "default; on the simulated driver at most the tests' 0.3 s)")
    parser.add_argument("--working-set", nargs="*", choices=tuple(WS_CASES),
                        help="instead of the paper's experiments, issue 18's: jobs that touch their whole working "
                             "set every step (no case named: all of them; see WS_CASES)")
    parser.add_argument("--ws-modes", nargs="+", choices=WS_MODES, help="modes of the working-set cases "
                        "(default: each case's own)")
    parser.add_argument("--link-gbps", type=float, help="--working-set --gpu: the link's pinned bandwidth (GB/s) "
                        "measured in the same run (bench_swap_bandwidth.py), for the handoff stall bound")
    args = parser.parse_args()
    if args.working_set is not None:
        main_working_set(args)
        return
    if args.quick:
        jobs, steps, burst_s, tq, tq_sweep, timeout = (2,), 3, 0.3, 2.0, (0.2, 0.6, 2.0), 10.0
    else:
        jobs, steps, burst_s, tq, tq_sweep, timeout = (2, 4), 5, 0.5, 5.0, (0.2, 0.5, 1, 2, 5, 10), 60.0
    args.jobs = tuple(args.jobs or jobs)
    args.steps = args.steps or steps
    args.burst_s = args.burst or burst_s
    args.tq = args.tq or tq
    args.tq_sweep = tuple(tq_sweep if args.tq_sweep is None else args.tq_sweep)
    args.timeout = args.timeout or timeout
    if args.idle_release is None:
        args.idle_release = min(1.0 if args.gpu else DEFAULT_OPTIONS["idle_release"], args.burst_s / 2)
    work = Path(tempfile.mkdtemp(prefix="nvs-coloc-", dir="/tmp"))
    started = time.monotonic()
    load_before = machine_load()
    try:
        if args.gpu:
            import torch  # noqa: F401  (fails early, clearly, without PyTorch)

            free, total = torch.cuda.mem_get_info()
            # A small "device": the jobs together stay far below the card's free memory.
            args.capacity = min(4 << 30, free // 8)
            library = args.library or build_interceptor(REPO, work / "lib")
            backend = RealGpu(work, args.capacity, args.steps, args.burst_s, args.idle_release, library)
            name = f"real GPU {torch.cuda.get_device_name()} (torch {torch.__version__})"
        else:
            args.capacity = 1 << 30
            backend = Simulated(work, args.capacity, args.steps, args.burst_s, args.idle_release, kernel_us=10000)
            name = "simulated driver (tests/simcuda, residency modelled, H200 costs)"
        document: dict[str, Any] = {
            "benchmark": "colocation",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "backend": name,
            "simulated": not args.gpu,
            "machine": {"platform": platform.platform(), "python": platform.python_version(), "load_before": load_before},
            "settings": {"quick": args.quick, "capacity_mib": args.capacity // MIB, "steps": args.steps,
                         "gpu_burst_s": args.burst_s, "cpu_share": args.cpu_share, "tq_s": args.tq,
                         "idle_release_s": args.idle_release, "kinds": list(args.kinds), "tq_sweep_s": list(args.tq_sweep),
                         "timeout_s": args.timeout, "fits_share": FITS_SHARE,
                         "oversubscribed_share_per_job": OVERSUBSCRIBED_SHARE},
            "paper": {"ratio_to_sequential": paper_ratios(), "tq_sweep_heavy_balanced_s": PAPER_TQ_SWEEP,
                      "sequential_s": PAPER_SEQUENTIAL},
        }
        try:
            document.update(experiments(args, backend))
        finally:
            backend.schedulers.close()
        document["summary"] = summary(document["results"])
        document["machine"]["load_after"] = machine_load()
        document["elapsed_s"] = round(time.monotonic() - started, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stem = f"colocation-{datetime.date.today().isoformat()}" + ("-gpu" if args.gpu else "") + ("-quick" if args.quick else "")
    if args.jobs != jobs:
        stem += "-jobs" + "-".join(map(str, args.jobs))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(document, indent=1) + "\n")
    try:
        plot(document, args.out / f"{stem}.png")
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
    print(table(document), file=sys.stderr)
    print(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
