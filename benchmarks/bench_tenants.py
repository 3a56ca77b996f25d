"""Many tenants on one GPU, asked in turn and in bursts (issue 29): model servers and notebooks
that each hold G GiB of weights and serve requests that read all of them.

    python benchmarks/bench_tenants.py --quick          # simulated driver, a few minutes
    python benchmarks/bench_tenants.py                  # simulated driver, the issue's run lengths
    python benchmarks/bench_tenants.py --gpu            # a real card (PyTorch), 6 x 30 GiB
    python benchmarks/bench_tenants.py --kernels ...    # tenants are nvshare-jupyter kernels
    ... --scenarios turns hot-cold --modes on --scheduler-option idle_release=0.5

Tenants are separate processes under libnvshare.so (LD_PRELOAD) with the real scheduler
(nvshare_py/testing/scheduler.py's SchedulerProcess, the daemon's own defaults: mode `on`, TQ
30 s, idle release 1 s, no budget, so the budget is the card as the daemon measures it through
NVML, the simulated one included). `--scheduler-option key=value` passes any daemon option
through (`--key value`), so that a new one can be tried without editing this file. With
`--kernels` the tenants are real Jupyter kernels of the nvshare kernelspec (nvshare-jupyter,
driven as a notebook drives them: nvshare_py/testing/notebook.py) whose cells load and serve;
their "no nvshare" runs use ipykernel's plain kernelspec with the same cells.

A tenant, as a process (`--tenant`, a line on stdin each) or as cells in a kernel:
- `load`: G GiB of weights in pieces (GPU: bf16 tensors of 1 GiB; simulated: 8 allocations),
  copied from a pinned host staging buffer of 1/30 of G (GPU: 1 GiB), as a loader streams a
  checkpoint through host memory. Why a copy from the host and not weights made on the card:
  the issue's load target compares with loading alone without nvshare, and a load that writes
  the card only would cost nothing there. On the simulated driver, copies do not migrate managed
  memory, so the load ends with a kernel over all of it (under nvshare the weights become
  resident then, as the copies make them on a real card).
- `request`: reads every weight once (GPU: a matrix-vector product per tensor, the issue's
  decode step, ~11 ms for 30 GiB on an H200; simulated: one `nvshare_sleep` kernel of
  `--request-ms`, which faults the process's whole managed working set in first), then replies.

The simulated driver (tests/simcuda/README.md, "Residency") models what this relies on: device
capacity, LRU eviction and faults, the link's pinned rate, pinning costs. Sizes are divided by
SIM_DIVISOR (30 GiB -> 256 MiB, the H200's 141 GiB -> 1203 MiB: the issue's proportions) and
its costs multiplied by SIMCUDA_COST_SCALE = SIM_DIVISOR, so that every modelled time is the
H200's (30 GiB over the pinned link 0.59 s, by faults 3.5 s) and the scheduler's times (TQ,
idle window, `--interval`) keep their meaning; the real copying of 256 MiB on the host is a
tenth of that. The link speed the scheduler assumes before it has measured one (25 GB/s) is not
scaled: on the simulated card (0.46 GB/s) its first handoffs look about 55 times cheaper to it
than they are (on an H200, twice as dear); once measured, its prices are right.

Scenarios (`--scenarios`, all by default; each with `--modes` on and auto; `--quick` shortens
each). One session per mode: a scheduler and the N tenants, which load at once, then the request
scenarios one after the other on the same tenants (servers stay up), so that each starts from
what the previous left resident. A scenario that fails (a wait that ran out, a tenant that died)
is recorded with its error; the session is started afresh for the next one.
- `load`: the session's start: every tenant loads at once. Target: all done within 1.3 x the
  sum of their load times each alone without nvshare (measured first, `baseline`, with one
  tenant alone under nvshare too: on either card a load into managed memory pays for making its
  pages, which no scheduling policy removes).
- `turns`: one request every `--interval`, each tenant every N x interval (`--rounds` rounds).
- `bursts`: `--burst-size` tenants asked at once, a burst every N x interval, rotating.
- `hot-cold`: 3 tenants asked every `--hot-every` (1 s), 3 every `--cold-every` (60 s): swap-ins
  of hot tenants after the warm-up (the first cold period) are counted (`hot_swap_ins`).
- `fits`: as many tenants as fit the card (floor(0.95 x card / G)), requests in turn, without
  nvshare and in each mode: the warm latency against no nvshare.
- Where all N tenants fit the card itself (a `--budget-gib` below it makes it play a smaller
  one), the request scenarios also run without nvshare first (mode `none`, `--native auto`), and
  each scenario's `warm_p99_ratio` is held against its own run without nvshare: in `hot-cold`
  three requests arrive at once, and natively they share the GPU too. Elsewhere the reference
  is `fits` without nvshare, else the baseline tenant alone.

Per request: when it was sent and answered (wall clock and CLOCK_MONOTONIC), its latency, its
tenant, warm or cold, S, and the scheduler's grant and restored times. How:
- cold: the tenant had memory out when asked: `swapped` of its (client, device) entry in the
  status document read just before sending, or the `swapped=` of the grant that served it (the
  first `grant` of its client after the request was sent and before its reply; none: it held
  the lock already). S = the larger of the two: what it had to bring back. Warm figures leave
  out each tenant's first request (its first kernel pays lazy initialisation, with or without
  nvshare: the issue's 222 ms) and report first requests apart.
- the bound of a cold request: S / (0.8 x pinned host-to-device bandwidth) + 0.2 s; stretch:
  1.05 x S / bandwidth. The bandwidth is measured in the same run on a GPU (pinned cudaMemcpy in
  a process of its own before the tenants start: bench_swap_bandwidth.py's ceiling) and derived
  from the modelled rate on the simulated driver (SIMCUDA_PINNED_US_PER_MIB x scale). A burst's
  k-th answer is held against the bytes of all k (`queue_bound_s`, `cold_over_queue_bound`):
  the one link brings them back one after another, so the issue's bound, met by a request
  asked alone, cannot be met by the third of three asked at once.
- idle_holder_wait: for a request that got a grant, for each `release` (or `revoke`, `lost`) of
  another client between the request's sending and its grant: from the later of the request's
  sending and the end of that holder's last piece of work (its load or its last request, as
  this benchmark saw its reply) to the release; raw, with the idle window beside it. A holder
  that still had a request in flight when it released is not idle and is not counted.
- pinned_bytes_max: sampled every `--sample` s: the swap areas of the status document
  (`swap` -> `area`, per client and device) plus the node-wide pool's files
  (nvshare_py/testing/scheduler.py's pinned_for_swapping); beside it the peak of swapped-out
  bytes (the device's `swapped`), and their ratio. On the simulated driver also exact, from the
  driver's pin and unpin lines (nvshare_py/testing/residency.py's pinned_peak, the tenants'
  staging buffers left out).
- bytes moved: out and in, from the sampled `swapped` of every client (increases and
  decreases), the sum of S over requests; on the simulated driver what crossed its link and
  what faults moved (its trace).

Safety on a GPU: refused unless N x G stays below the card plus half of the host's
MemAvailable; the `fits` runs without nvshare take only what fits the card's free memory. On a
card others share, `--budget-gib` (the scheduler's budget, set before any tenant starts) makes
it behave like a smaller one without oversubscribing its memory (managed memory beyond a card's
free memory can hang a shared GPU): `--gib 8 --budget-gib 37.6` keeps the issue's proportions
in 48 GiB. JAX is never imported. Every child's log goes to $NVSHARE_BENCH_LOGS or a temporary folder (said on
stderr and in the JSON); every wait is bounded (`--timeout` per request); children are killed at
the end.

Prints one JSON document on stdout, also written to --out (default
benchmarks/results/tenants-<date>[-quick|-gpu].json): `summary` (cold_p99_s, cold_bound_s,
warm_p99_ratio, idle_holder_wait_max_s, hot_swap_ins, pinned_bytes_max, ... and `targets`, each
figure beside whether it was met; the same per mode in `by_mode`), `scenarios` (per scenario and
mode: latencies p50/p99/max warm and cold, bytes, targets, and the scheduler's `timeline` of
the scenario: its grants, releases, evictions, ...) and `results` (every request); a short table
on stderr.

This file is over 600 lines because it is one program with three sides that must agree: the
tenant (run as a child and imported by kernel cells), the driver of the scenarios, and the
analysis of what the scheduler's timeline and status said.

Why one file of some 1,400 lines: one script a user runs (`--quick`, `--gpu`); the tenant
program, the scenarios, the no-nvshare and physical-bound baselines and the summary are each
short and only meaningful together, since the summary compares them within one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
GPU_BENCHMARKS = BENCHMARKS / "gpu"
sys.path.insert(0, str(REPO))  # this tree's nvshare_py, without installing

GIB, MIB = 1 << 30, 1 << 20
SHM = Path("/dev/shm")  # where a session's swap pool lies, where there is shared memory
SIM_DEVICE = "GPU-5151ad00-0000-4000-8000-000000000000"  # the simulated GPU (tests/simcuda)
SIM_DIVISOR = 120               # sizes on the simulated card: the issue's / this
SIM_PINNED_US_PER_MIB = 19.07   # SIMCUDA_PINNED_US_PER_MIB's default (H200: 55 GB/s)
SIM_PIECES = 8                  # allocations of a simulated tenant
GPU_PIECE = GIB                 # a GPU tenant's tensors
STAGING_SHARE = 30              # the staging buffer is 1/30 of the weights (1 GiB of 30)
ISSUE_CARD_GIB = 141            # the H200 of the issue, the simulated card's size before division
MODES = ("on", "auto")
SCENARIOS = ("load", "turns", "bursts", "hot-cold", "fits")
HOT = 3                          # tenants asked often in hot-cold (the rest: rarely)
# Targets of the issue.
COLD_LINK_SHARE, COLD_SLACK_S = 0.8, 0.2
STRETCH = 1.05
P99_MAX_S = 1.0
WARM_RATIO_MAX = 1.10
IDLE_SLACK_S = 0.1
LOAD_RATIO_MAX = 1.3
PINNED_RATIO_MAX = 1.2


# --- the tenant: a process of its own, or cells of a Jupyter kernel ------------------------------


class SimWeights:
    """Weights on the simulated driver (nvshare_py.driver); a request is one kernel over them."""

    def __init__(self, nbytes: int, request_us: int) -> None:
        sys.path.insert(0, str(GPU_BENCHMARKS))
        from bench_swap_paths import Api  # noqa: PLC0415 (its pinned copies, resolved as cudart does)

        from nvshare_py.driver import Driver

        self.cuda = Driver()
        self.cuda.context(0)
        self.api = Api()
        self.stream = self.cuda.create_stream()
        self.nbytes, self.request_us = nbytes, request_us
        self.pieces: list[int] = []

    def load(self) -> str:
        from ctypes import c_void_p

        piece = self.nbytes // SIM_PIECES // (2 * MIB) * (2 * MIB)
        staging_bytes = max(2 * MIB, self.nbytes // STAGING_SHARE // (2 * MIB) * (2 * MIB))
        staging = self.cuda.alloc(staging_bytes, "host")
        for _ in range(SIM_PIECES):
            ptr = self.cuda.alloc(piece)
            for offset in range(0, piece, staging_bytes):
                self.api.check("cuMemcpyHtoDAsync", ptr + offset, c_void_p(staging), min(staging_bytes, piece - offset),
                               c_void_p(self.stream))
            self.pieces.append(ptr)
        self.cuda.stream_synchronize(self.stream)
        self.cuda.launch_sleep(1)  # the weights on the card (a kernel touches every managed byte)
        self.cuda.synchronize()
        self.cuda.free(staging)
        return f"staging={staging}"

    def request(self) -> str:
        self.cuda.launch_sleep(self.request_us)
        self.cuda.synchronize()
        return ""


class TorchWeights:
    """bf16 weights in PyTorch on a real card; a request is a matrix-vector product per tensor."""

    def __init__(self, nbytes: int, request_us: int) -> None:
        import torch

        self.torch = torch
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the context: the tenant registers with the scheduler now
        self.nbytes = nbytes
        self.weights: list[Any] = []
        self.vector = None

    def load(self) -> str:
        torch = self.torch
        columns = 8192
        piece = min(GPU_PIECE, self.nbytes)
        staging = torch.empty((piece // 2 // columns, columns), dtype=torch.bfloat16, pin_memory=True).fill_(0.001)
        for _ in range(self.nbytes // piece):
            weight = torch.empty_like(staging, device="cuda")
            weight.copy_(staging, non_blocking=True)
            self.weights.append(weight)
        self.vector = torch.ones(columns, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        del staging  # and unpinned: PyTorch's host allocator would keep it for later copies
        getattr(torch._C, "_host_emptyCache", lambda: None)()
        return ""

    def request(self) -> str:
        outputs = [weight @ self.vector for weight in self.weights]
        total = float(self.torch.stack([output[0] for output in outputs]).float().sum())  # one sync, at the end
        return f"value={total:.3g}"


def make_weights(backend: str, nbytes: int, request_us: int) -> SimWeights | TorchWeights:
    return (SimWeights if backend == "sim" else TorchWeights)(nbytes, request_us)


def timed_step(weights, step: str) -> str:
    """Runs a step (`load` or `request`); what the tenant says of it: `<start> <end> <wall end> [what]`,
    start and end on its CLOCK_MONOTONIC."""
    start = time.monotonic()
    said = weights.load() if step == "load" else weights.request()
    return f"{start:.6f} {time.monotonic():.6f} {time.time():.6f} {said}".rstrip()


def tenant_main(backend: str, nbytes: int, request_us: int) -> None:
    """A tenant process: `ready` once its context exists, then a reply line per command line."""
    weights = make_weights(backend, nbytes, request_us)
    print(f"ready {os.getpid()}", flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        key = command[1] if command[0] == "request" else "load"
        print(f"done {key} {timed_step(weights, command[0])}", flush=True)


# --- the tenants as the benchmark drives them ------------------------------------------------------


@dataclass
class Reply:
    """A tenant's answer: when the benchmark read it, and the tenant's own stamps."""

    wall: float
    monotonic: float
    work_start: float      # the tenant's CLOCK_MONOTONIC when it began the step
    work_end: float
    said: str


class Tenant:
    """One tenant: `ask(key)` sends a step (`load`, or a request's key), `reply(key, timeout)` waits
    for its answer (None when it did not come in time)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = 0
        self.ready = threading.Event()
        self.failure = ""
        self._replies: dict[str, Reply] = {}
        self._changed = threading.Condition()

    def _answered(self, key: str, fields: list[str]) -> None:
        reply = Reply(time.time(), time.monotonic(), float(fields[0]), float(fields[1]), " ".join(fields[3:]))
        with self._changed:
            self._replies[key] = reply
            self._changed.notify_all()

    def _failed(self, why: str) -> None:
        with self._changed:
            self.failure = self.failure or why
            self._changed.notify_all()
        self.ready.set()

    def reply(self, key: str, timeout: float) -> Reply | None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while key not in self._replies and not self.failure:
                if not self._changed.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    break
            return self._replies.get(key)

    def ask(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ProcessTenant(Tenant):
    """A tenant process (`--tenant`), its stderr (the interceptor's log) in `log`."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        super().__init__(name)
        from nvshare_py.testing.scheduler import CHILD_CWD

        self._log = open(log, "w")
        self.process = subprocess.Popen(argv, env=env, cwd=CHILD_CWD, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, text=True, bufsize=1)
        self.pid = self.process.pid
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            words = line.split()
            if words[:1] == ["ready"]:
                self.ready.set()
            elif words[:1] == ["done"] and len(words) >= 5:
                self._answered(words[1], words[2:])
        self._failed(f"{self.name} (pid {self.pid}) exited with {self.process.wait()}")

    def ask(self, key: str) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write("load\n" if key == "load" else f"request {key}\n")
            self.process.stdin.flush()
        except OSError as error:
            self._failed(f"{self.name}: {error}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._log.close()


class KernelTenant(Tenant):
    """A Jupyter kernel whose cells load and serve (nvshare_py/testing/notebook.py); a thread of
    its own runs one cell after the other, as a notebook's queue does."""

    def __init__(self, name: str, spec_dir: Path, spec_name: str, env: dict[str, str], log: Path, setup: str,
                 timeout: float) -> None:
        """`timeout`: how long its start or any one cell may take before the tenant counts as gone."""
        super().__init__(name)
        from nvshare_py.testing.notebook import Kernel

        self._log = open(log, "w")
        self.kernel = Kernel(str(spec_dir), spec_name, env, log=self._log)
        self.pid = self.kernel.pid
        self._asked: queue.Queue[str | None] = queue.Queue()
        self._timeout = timeout
        threading.Thread(target=self._serve, args=(setup,), daemon=True).start()

    def _serve(self, setup: str) -> None:
        try:
            self.kernel.client.wait_for_ready(timeout=self._timeout)
            self.kernel.run(setup, timeout=self._timeout)
            self.ready.set()
            while (key := self._asked.get()) is not None:
                step = "load" if key == "load" else "request"
                cell = self.kernel.run(f"print('done', {key!r}, _bench.timed_step(_weights, {step!r}))",
                                       timeout=self._timeout)
                self._answered(key, cell.stdout.split()[2:])
        except Exception as failure:  # a cell that failed or did not end: the tenant is gone
            self._failed(f"{self.name} (kernel {self.pid}): {failure}")

    def ask(self, key: str) -> None:
        self._asked.put(key)

    def close(self) -> None:
        self._asked.put(None)
        self.kernel.shutdown()
        self._log.close()


# --- what the scheduler shows, sampled --------------------------------------------------------------


def pair_of(status: dict | None, pid: int, device: str | None) -> tuple[str | None, dict | None]:
    """The client id of the process `pid` and its entry for `device` (the first it uses if None)."""
    for client in (status or {}).get("clients", []):
        if pid in (client.get("host_pid"), client.get("pid")):
            pairs = client.get("devices", {})
            pair = pairs.get(device) if device else next(iter(pairs.values()), None)
            return client["client"], pair
    return None, None


class Watcher:
    """Samples the scheduler's status every `period` seconds and follows its timeline, on a thread
    of its own: pinned memory for swapping, swapped-out bytes and what moved between samples."""

    def __init__(self, scheduler, period: float, pool_dir: Path) -> None:
        from nvshare_py.testing.scheduler import pinned_for_swapping, swap_pool_bytes

        self._pinned = lambda status: pinned_for_swapping(status, swap_pool_bytes(shm=pool_dir))
        self.scheduler, self.period = scheduler, period
        self.events: list[dict] = []
        self._since = 0
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], int] = {}  # (client, device) -> swapped at the last sample
        self._figures = self._fresh()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _fresh() -> dict[str, Any]:
        return {"samples": 0, "pinned_bytes_max": 0, "swapped_bytes_max": 0, "swapped_out_bytes": 0,
                "swapped_in_bytes": 0, "status_failures": 0}

    def _run(self) -> None:
        next_events = 0.0
        while not self._stop.wait(self.period):
            self.sample()
            if time.monotonic() >= next_events:
                self.follow()
                next_events = time.monotonic() + 1.0

    def sample(self) -> None:
        try:
            status = self.scheduler.status()
        except Exception:  # a busy or restarting daemon: counted, the next sample tries again
            with self._lock:
                self._figures["status_failures"] += 1
            return
        pinned = self._pinned(status)
        swapped = sum(device.get("swapped", 0) for device in status.get("devices", []))
        with self._lock:
            figures = self._figures
            figures["samples"] += 1
            figures["pinned_bytes_max"] = max(figures["pinned_bytes_max"], pinned)
            figures["swapped_bytes_max"] = max(figures["swapped_bytes_max"], swapped)
            for client in status.get("clients", []):
                for device, pair in client.get("devices", {}).items():
                    key, now = (client["client"], device), int(pair.get("swapped", 0))
                    change = now - self._last.get(key, 0)
                    figures["swapped_out_bytes" if change > 0 else "swapped_in_bytes"] += abs(change)
                    self._last[key] = now

    def follow(self) -> list[dict]:
        """Reads the timeline's new entries; every entry so far."""
        try:
            new, self._since = self.scheduler.events_since(self._since)
        except Exception:
            return self.events
        with self._lock:
            self.events.extend(new)
            return list(self.events)

    def section(self) -> dict[str, Any]:
        """The figures since the previous call (a scenario's), and a fresh start."""
        with self._lock:
            figures, self._figures = self._figures, self._fresh()
        return figures

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.follow()


# --- sessions: a scheduler and its tenants ----------------------------------------------------------


class ScenarioFailed(RuntimeError):
    pass


class Bench:
    """What every session shares: the backend (simulated driver or GPU), libnvshare.so, sizes,
    the scheduler's options, the kernelspecs, the logs folder."""

    def __init__(self, args: argparse.Namespace, work: Path, logs: Path) -> None:
        from nvshare_py.scheduler.config import DaemonConfig
        from nvshare_py.testing.interceptor import benchmark_library

        self.args, self.work, self.logs = args, work, logs
        self.library = benchmark_library(REPO, work / "lib")
        self.options = {"log_level": "info", **args.scheduler_option}
        self.idle_window = float(self.options.get("idle_release", DaemonConfig.idle_release))
        self.nvml: dict[str, str] | None = None
        scale = 1 if args.gpu else SIM_DIVISOR
        self.budget = int(args.budget_gib * GIB / scale) // (2 * MIB) * (2 * MIB) if args.budget_gib else None
        if args.gpu:
            from bench_colocation import gpu_uuid
            from run_issue18 import gpu

            self.card = gpu()  # asked in a process of its own: this one keeps no CUDA context
            self.tenant_bytes = int(args.gib * GIB)
            # The card as nvshare names it, for a budget set before any tenant starts; else the
            # first device the tenants register.
            self.device: str | None = gpu_uuid() if self.budget else None
        else:
            from nvshare_py.testing.simcuda import build_simcuda

            self.simcuda = build_simcuda(REPO, work / "sim")
            self.tenant_bytes = int(args.gib * GIB / SIM_DIVISOR) // (2 * MIB) * (2 * MIB)
            total = int(args.card_gib * GIB / SIM_DIVISOR) // (2 * MIB) * (2 * MIB)
            self.card = {"name": "nvshare simulated GPU", "total": total, "free": total}
            self.device = SIM_DEVICE
            # The daemon measures the simulated card through the simulated NVML: no budget is set.
            self.nvml = {"LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(self.simcuda.lib_dir),
                                                                        os.environ.get("LD_LIBRARY_PATH", "")) if p),
                         "SIMCUDA_DEVICES": "1", "SIMCUDA_MEMORY": str(total)}
        self.spec_dir = install_kernelspecs(work, self.library) if args.kernels else None
        self.sessions = 0

    def base_env(self, state: Path) -> dict[str, str]:
        """The tenants' environment without nvshare; on the simulated driver a fresh machine (its
        residency state and trace in `state`). Their swap pool is the session's own (a directory
        of shared memory, `pool_dir`), so that another run of the same user on this machine
        neither shares it nor counts in it; on the simulated driver its segments are scaled as
        the sizes are."""
        from nvshare_py.testing.scheduler import child_env

        self.pool_dir = Path(tempfile.mkdtemp(prefix="nvs-tenants-pool-", dir=SHM if SHM.is_dir() else None))
        self.pool_env = {"NVSHARE_POOL_DIR": str(self.pool_dir)}
        if self.args.gpu:
            return child_env(extra=self.pool_env)
        segment = max(2 * MIB, (512 * MIB // int(self.args.sim_cost_scale)) // (2 * MIB) * (2 * MIB))
        self.pool_env["NVSHARE_POOL_SEGMENT"] = str(segment)
        return self.simcuda.env(trace=state / "trace.jsonl", memory=str(self.card["total"]),
                                SIMCUDA_RESIDENCY_DIR=str(state), SIMCUDA_COST_SCALE=str(self.args.sim_cost_scale),
                                SIMCUDA_TIMESLICE_US="10000", **self.pool_env)

    def tenant(self, index: int, env: dict[str, str], nvshare: bool, logs: Path) -> Tenant:
        backend = "torch" if self.args.gpu else "sim"
        request_us = int(self.args.request_ms * 1000)
        name = f"tenant{index}"
        if self.spec_dir is None:
            argv = [sys.executable, str(Path(__file__).resolve()), "--tenant", backend, str(self.tenant_bytes),
                    str(request_us)]
            return ProcessTenant(name, argv, env, logs / f"{name}.log")
        setup = (f"import sys\nsys.path[:0] = [{str(BENCHMARKS)!r}]\nimport bench_tenants as _bench\n"
                 f"_weights = _bench.make_weights({backend!r}, {self.tenant_bytes}, {request_us})")
        return KernelTenant(name, self.spec_dir, "nvshare" if nvshare else "plain",
                            {**env, "NVSHARE_PROGRAM": f"{name}.ipynb"}, logs / f"{name}.log", setup,
                            max(self.args.timeout, self.args.load_timeout))


def install_kernelspecs(work: Path, library: Path) -> Path:
    """The nvshare kernelspec (nvshare-jupyter, as a user installs it) and ipykernel's plain one
    (the runs without nvshare), under work/jupyter; the folder Jupyter finds them in."""
    from bench_notebook_cells import install

    from nvshare_py.testing.scheduler import child_env

    prefix = work / "jupyter"
    os.environ["JUPYTER_RUNTIME_DIR"] = str(work / "runtime")  # the kernels' connection files
    install(prefix, library)
    plain = subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", "plain"],
                           env=child_env(), capture_output=True, text=True)
    if plain.returncode != 0:
        raise SystemExit(f"ipykernel install failed:\n{plain.stderr}")
    return prefix / "share" / "jupyter" / "kernels"


class Session:
    """A scheduler in one mode (None: no nvshare) and `count` tenants, ready; `load()` loads them
    all at once, `ask()` sends requests, `collect()` waits for the replies."""

    def __init__(self, bench: Bench, mode: str | None, count: int, label: str) -> None:
        from nvshare_py.testing.scheduler import SchedulerProcess, short_socket_dir

        bench.sessions += 1
        self.bench, self.mode, self.label = bench, mode, label
        self.logs = bench.logs / f"{bench.sessions:02d}-{label}"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.state = bench.work / f"session{bench.sessions}"
        self.state.mkdir()
        self.scheduler = None
        self.watcher: Watcher | None = None
        self.tenants: list[Tenant] = []
        self.records: list[dict[str, Any]] = []  # every step asked (loads and requests)
        self._counter = 0
        env = bench.base_env(self.state)
        self.pool_dir = bench.pool_dir
        try:
            if mode is not None:
                self.scheduler = SchedulerProcess(short_socket_dir(), {**bench.options, "mode": mode},
                                                  nvml=bench.nvml).start()
                if bench.budget:
                    self.scheduler.request("set-budget", device=bench.device, bytes=bench.budget)
                self.watcher = Watcher(self.scheduler, bench.args.sample, bench.pool_dir)
                env = {**env, **self.scheduler.env, "LD_PRELOAD": str(bench.library),
                       "NVSHARE_LOG": os.environ.get("NVSHARE_LOG", "info"), **bench.pool_env}
            self.tenants = [bench.tenant(i, env, mode is not None, self.logs) for i in range(count)]
            for tenant in self.tenants:
                if not tenant.ready.wait(bench.args.timeout) or tenant.failure:
                    raise ScenarioFailed(f"{tenant.name} not ready within {bench.args.timeout:g} s: "
                                         f"{tenant.failure or 'no answer'} (log: {self.logs})")
        except BaseException:
            self.close()
            raise

    @property
    def broken(self) -> str:
        return next((tenant.failure for tenant in self.tenants if tenant.failure), "")

    def status(self) -> dict | None:
        if self.scheduler is None:
            return None
        try:
            return self.scheduler.status()
        except Exception:
            return None

    def ask(self, scenario: str, indices: list[int], offset: float) -> list[dict[str, Any]]:
        """Sends a step to each of `indices` at once (`load`, or a request), after one look at the
        status: what each tenant had swapped out when asked."""
        status = self.status() if scenario != "load" else None
        asked = []
        for index in indices:
            tenant = self.tenants[index]
            self._counter += 1
            key = "load" if scenario == "load" else f"{scenario}-{self._counter}"
            client, pair = pair_of(status, tenant.pid, self.bench.device)
            record = {"scenario": scenario, "mode": self.mode or "none", "tenant": index, "key": key,
                      "offset_s": round(offset, 3),
                      "first": scenario != "load" and not any(r["tenant"] == index and r["scenario"] != "load"
                                                              for r in self.records),
                      "client": client, "swapped_when_asked": int(pair["swapped"]) if pair else 0,
                      "state_when_asked": pair["state"] if pair else None,
                      "sent": time.time(), "sent_mono": time.monotonic()}
            tenant.ask(key)
            self.records.append(record)
            asked.append(record)
        return asked

    def collect(self, records: list[dict[str, Any]], timeout: float) -> None:
        """Waits for each record's reply, at most `timeout` from its sending."""
        for record in records:
            tenant = self.tenants[record["tenant"]]
            left = record["sent_mono"] + timeout - time.monotonic()
            reply = tenant.reply(record["key"], max(0.0, left))
            record["answered"] = reply is not None
            if reply is None:
                record["failure"] = tenant.failure or f"no reply within {timeout:g} s"
                continue
            record["reply"] = reply.wall
            record["reply_mono"] = reply.monotonic
            record["latency_s"] = round(reply.monotonic - record["sent_mono"], 6)
            record["service_s"] = round(reply.work_end - reply.work_start, 6)
            # The end of its work on the wall clock (the scheduler's timeline is in wall time).
            record["work_end"] = reply.wall - (reply.monotonic - reply.work_end)
            record["work_start_mono"], record["work_end_mono"] = reply.work_start, reply.work_end
            if reply.said:
                record["said"] = reply.said

    def load(self) -> dict[str, Any]:
        """Every tenant loads at once."""
        records = self.ask("load", list(range(len(self.tenants))), 0.0)
        self.collect(records, self.bench.args.load_timeout)
        done = [r for r in records if r["answered"]]
        summary = {"tenants": len(records), "loaded": len(done),
                   "load_s": [r.get("latency_s") for r in records],
                   "makespan_s": round(max(r["reply_mono"] for r in done) - min(r["sent_mono"] for r in records), 3)
                   if len(done) == len(records) else None}
        if len(done) < len(records):
            summary["failures"] = [r["failure"] for r in records if not r["answered"]]
        return summary

    def trace(self) -> list[dict[str, Any]]:
        return [] if self.bench.args.gpu else self.bench.simcuda.read_trace(self.state / "trace.jsonl")

    def events(self) -> list[dict]:
        return self.watcher.follow() if self.watcher is not None else []

    def close(self) -> None:
        """Ends every child of the session (tenants, then the scheduler); the logs stay."""
        for tenant in self.tenants:
            try:
                tenant.close()
            except Exception as failure:  # a kernel that would not shut down cleanly: killed
                print(f"  closing {tenant.name}: {failure}", file=sys.stderr)
        if self.watcher is not None:
            self.watcher.stop()
        if self.scheduler is not None:
            try:
                self.scheduler.stop()
            except AssertionError:  # it ignored SIGTERM, and stop() killed it
                pass
            shutil.copy(self.scheduler.log_path, self.logs / "scheduler.log")
            shutil.rmtree(self.scheduler.socket_dir, ignore_errors=True)
        shutil.rmtree(self.pool_dir, ignore_errors=True)  # its last member removed the segments; this is what is left


# --- what each request was: warm or cold, its grant, whom it waited for --------------------------


def annotate(session: Session, records: list[dict[str, Any]], events: list[dict], trace: list[dict[str, Any]],
             h2d_bps: float | None) -> None:
    """Adds to each answered request of `records` its grant and restored times, whether it was
    cold, S and its bound, and the idle holders it waited for (see the module's docstring)."""
    from nvshare_py.timeline import detail_fields, registered_pid

    pids = {tenant.pid: index for index, tenant in enumerate(session.tenants)}
    clients: dict[str, int] = {}  # client id -> tenant index, from the registrations
    for event in events:
        if event["kind"] == "register" and registered_pid(event) in pids:
            clients[event["client"]] = pids[registered_pid(event)]
    by_tenant: dict[int, list[str]] = {}
    for client, index in clients.items():
        by_tenant.setdefault(index, []).append(client)
    # Each tenant's work as the benchmark saw it (wall clock): loads and requests.
    work: dict[int, list[tuple[float, float | None]]] = {}
    for record in session.records:
        work.setdefault(record["tenant"], []).append((record["sent"], record.get("work_end")))
    faults = per_pid_moves(trace)
    for record in records:
        mine = set(by_tenant.get(record["tenant"], [])) | ({record["client"]} if record["client"] else set())
        end = record.get("reply", math.inf)
        grant = next((e for e in events if e["kind"] == "grant" and e["client"] in mine
                      and record["sent"] <= e["t"] <= end), None)
        grant_swapped = int(detail_fields(grant["detail"]).get("swapped", 0)) if grant else 0
        restored = next((e for e in events if grant and e["kind"] == "restored" and e["client"] == grant["client"]
                         and e["grant"] == grant["grant"] and e["t"] >= grant["t"]), None)
        if restored is None and grant:  # its memory back ahead of the grant (grant 0)
            restored = next((e for e in reversed(events) if e["kind"] == "restored" and e["client"] == grant["client"]
                             and not e["grant"] and record["sent"] <= e["t"] <= grant["t"]), None)
        size = max(record["swapped_when_asked"], grant_swapped)
        record.update({
            "grant": round(grant["t"], 6) if grant else None, "grant_swapped": grant_swapped,
            "restored": round(restored["t"], 6) if restored else None,
            "wait_for_grant_s": round(grant["t"] - record["sent"], 6) if grant else None,
            "cold": size > 0, "S": size,
        })
        if size and h2d_bps:
            record["bound_s"] = cold_bound(size, h2d_bps)
            record["stretch_bound_s"] = round(STRETCH * size / h2d_bps, 4)
        waits = []
        for event in events:
            if (grant is None or event["kind"] not in ("release", "revoke", "lost") or event["client"] in mine
                    or event["device"] != grant["device"] or not record["sent"] <= event["t"] <= grant["t"]):
                continue
            holder = clients.get(event["client"])
            if holder is None:
                continue
            spans = work.get(holder, [])
            if any(start <= event["t"] and (stop is None or stop > event["t"]) for start, stop in spans):
                continue  # it had work in flight: not an idle holder
            last = max((stop for start, stop in spans if stop is not None and stop <= event["t"]), default=None)
            idle_from = max(record["sent"], last) if last is not None else record["sent"]
            waits.append({"holder": holder, "kind": event["kind"], "detail": event["detail"],
                          "wait_s": round(event["t"] - idle_from, 4)})
        record["idle_holders"] = waits
        record["idle_holder_wait_s"] = max((w["wait_s"] for w in waits), default=None)
        if trace and record.get("answered"):
            moves = faults.get(session.tenants[record["tenant"]].pid, [])
            window = (record["sent_mono"], record["reply_mono"])
            for kind in ("faulted", "prefetched", "copied"):
                record[f"{kind}_in_bytes"] = sum(size for t, size, how in moves
                                                 if how == kind and window[0] <= t <= window[1])
    if h2d_bps:
        queue_bounds(records, h2d_bps)


def cold_bound(size: int, h2d_bps: float) -> float:
    """The issue's bound for bringing `size` bytes back: S / (0.8 x pinned h2d) + 0.2 s."""
    return round(size / (COLD_LINK_SHARE * h2d_bps) + COLD_SLACK_S, 4)


def queue_bounds(records: list[dict[str, Any]], h2d_bps: float) -> None:
    """Each cold request's bound with the requests asked at the same moment (a burst) that were
    answered no later than it: their S comes over the same link first, so the k-th of a burst
    can be no faster than the bytes of all k (`queue_bound_s`; a request asked alone: its own
    bound)."""
    asked_together: dict[float, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("cold") and record.get("answered"):
            asked_together.setdefault(record["offset_s"], []).append(record)
    for group in asked_together.values():
        group.sort(key=lambda r: r["reply"])
        ahead = 0
        for record in group:
            ahead += record["S"]
            record["queue_bound_s"] = cold_bound(ahead, h2d_bps)


# The timeline's kinds that say what happened to a request (a block keeps them, for reading).
TIMELINE_KINDS = ("acquire", "grant", "restored", "release", "drop", "revoke", "lost", "evict", "evicted", "prefetch")


def timeline(session: Session, start: float, end: float) -> dict[str, Any]:
    """The scheduler's events between `start` and `end` (wall clock) that concern requests, as
    [t, client, kind, grant, detail], and which tenant each client is."""
    from nvshare_py.timeline import registered_pid

    pids = {tenant.pid: index for index, tenant in enumerate(session.tenants)}
    events = session.events()
    return {"clients": {e["client"]: pids[registered_pid(e)] for e in events
                        if e["kind"] == "register" and registered_pid(e) in pids},
            "events": [[round(e["t"], 6), e["client"], e["kind"], e["grant"], e["detail"]] for e in events
                       if e["kind"] in TIMELINE_KINDS and start <= e["t"] <= end]}


def per_pid_moves(trace: list[dict[str, Any]]) -> dict[int, list[tuple[float, int, str]]]:
    """The simulated driver's moves into the card, by the process whose memory moved: [(start,
    bytes, how)], how: `faulted` and `prefetched` (the driver migrated it), `copied` (the swap
    engine's copies back from its pinned area)."""
    moves: dict[int, list[tuple[float, int, str]]] = {}
    for line in trace:
        if line.get("op") == "migrate" and line.get("direction") == "to_device" and line.get("cause") in (
                "fault", "prefetch"):
            how = "faulted" if line["cause"] == "fault" else "prefetched"
            moves.setdefault(line["owner"], []).append((line["start"], line["bytes"], how))
        elif line.get("link") == "h2d":
            moves.setdefault(line["pid"], []).append((line["start"], line["bytes"], "copied"))
    return moves


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def latency(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {"n": len(values), "p50_s": round(percentile(values, 0.5), 4), "p99_s": round(percentile(values, 0.99), 4),
            "max_s": round(max(values), 4)}


def target(value: float | int | None, limit: float, at_most: bool = True) -> dict[str, Any]:
    """A figure beside its limit and whether it was met (None: nothing to judge)."""
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"value": value, "limit": limit, "met": met}


def request_figures(records: list[dict[str, Any]], reference_p99: float | None, idle_window: float) -> dict[str, Any]:
    """Latencies warm / cold / first, the bound of the cold ones, idle holders, and the targets
    that requests have."""
    answered = [r for r in records if r.get("answered")]
    cold = [r for r in answered if r.get("cold")]
    warm = [r for r in answered if not r.get("cold") and not r["first"]]
    out: dict[str, Any] = {
        "requests": len(records), "answered": len(answered),
        "latency": latency([r["latency_s"] for r in answered]),
        "warm": latency([r["latency_s"] for r in warm]),
        "cold": latency([r["latency_s"] for r in cold]),
        "first": latency([r["latency_s"] for r in answered if r["first"]]),
        "cold_over_bound": sum(1 for r in cold if r.get("bound_s") is not None and r["latency_s"] > r["bound_s"]),
        "cold_over_stretch": sum(1 for r in cold if r.get("bound_s") is not None
                                 and r["latency_s"] > r["stretch_bound_s"]),
        "cold_over_queue_bound": sum(1 for r in cold if r.get("queue_bound_s") is not None
                                     and r["latency_s"] > r["queue_bound_s"]),
        "S_max_bytes": max((r["S"] for r in cold), default=0),
        "brought_back_bytes": sum(r["S"] for r in cold),
        "idle_holder_wait_max_s": max((r["idle_holder_wait_s"] for r in answered
                                       if r.get("idle_holder_wait_s") is not None), default=None),
    }
    if any("faulted_in_bytes" in r for r in answered):
        out["faulted_in_bytes"] = sum(r.get("faulted_in_bytes", 0) for r in answered)
        out["warm_but_faulted"] = sum(1 for r in answered if not r.get("cold") and r.get("faulted_in_bytes"))
    h2d_known = all(r.get("bound_s") is not None for r in cold)
    warm_p99 = out["warm"]["p99_s"] if out["warm"] else None
    ratio = round(warm_p99 / reference_p99, 3) if warm_p99 is not None and reference_p99 else None
    out["warm_p99_ratio"] = ratio
    out["targets"] = {
        "cold_over_bound": target(out["cold_over_bound"] if cold and h2d_known else None, 0),
        "p99_s": target(out["latency"]["p99_s"] if out["latency"] else None, P99_MAX_S),
        "warm_p99_ratio": target(ratio, WARM_RATIO_MAX),
        "idle_holder_wait_max_s": target(out["idle_holder_wait_max_s"], round(idle_window + IDLE_SLACK_S, 3)),
        "every_request_answered": target(len(records) - len(answered), 0),
        "stretch_cold_over_1.05x": target(out["cold_over_stretch"] if cold and h2d_known else None, 0),
    }
    return out


# --- the scenarios ------------------------------------------------------------------------------------

Plan = list[tuple[float, list[int]]]  # (seconds from the scenario's start, tenants asked then)


def plan_turns(count: int, rounds: int, interval: float) -> Plan:
    return [(k * interval, [k % count]) for k in range(rounds * count)]


def plan_bursts(count: int, bursts: int, size: int, interval: float) -> Plan:
    size = min(size, count)
    return [(b * count * interval, [(b * size + j) % count for j in range(size)]) for b in range(bursts)]


def plan_hot_cold(count: int, hot_every: float, cold_every: float, periods: int) -> tuple[Plan, float]:
    """The first HOT tenants every `hot_every`, the others every `cold_every` (spread over the
    period); and the warm-up: the first cold period, by which every tenant has been asked."""
    hot, cold = list(range(min(HOT, count))), list(range(min(HOT, count), count))
    asks: dict[float, list[int]] = {}
    for k in range(int(periods * cold_every / hot_every)):
        asks.setdefault(round(k * hot_every, 3), []).extend(hot)
    for j, index in enumerate(cold):
        for period in range(periods):
            asks.setdefault(round(period * cold_every + j * cold_every / len(cold), 3), []).append(index)
    return sorted(asks.items()), cold_every


def run_requests(session: Session, scenario: str, plan: Plan, h2d_bps: float | None) -> dict[str, Any]:
    """Sends the plan's requests on time (open loop: a tenant still busy queues them), waits for
    every reply (at most --timeout each), and reads what the scheduler and the driver saw."""
    args = session.bench.args
    if session.watcher is not None:
        session.watcher.section()
    start = time.monotonic() + 0.2
    started_wall = time.time() + 0.2
    records: list[dict[str, Any]] = []
    for offset, indices in plan:
        while (left := start + offset - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        if session.broken:
            raise ScenarioFailed(f"{scenario}: {session.broken} (log: {session.logs})")
        records += session.ask(scenario, indices, offset)
    session.collect(records, args.timeout)
    ended = time.monotonic()
    trace = session.trace()
    annotate(session, records, session.events(), trace, h2d_bps)
    block: dict[str, Any] = {"records": records, "started": round(started_wall, 3), "span_s": round(ended - start, 3)}
    if session.scheduler is not None:
        block["timeline"] = timeline(session, started_wall - 0.2, time.time())
    if session.watcher is not None:
        block["watched"] = session.watcher.section()
    if trace:
        from bench_colocation import link_traffic  # this folder: what crossed the simulated link

        from nvshare_py.testing.residency import pinned_peak

        block["simulated_link_mib"] = link_traffic([line for line in trace if start <= line.get("start", 0) <= ended])
        staging = [(session.tenants[r["tenant"]].pid, int(r["said"].removeprefix("staging="))) for r in session.records
                   if r["key"] == "load" and r.get("said", "").startswith("staging=")]
        block["simulated_pinned_bytes_max"] = pinned_peak([line for line in trace if line.get("start", 0) <= ended],
                                                          leave_out=staging)
    return block


def baseline(bench: Bench, h2d_bps: float | None) -> dict[str, Any]:
    """One tenant alone without nvshare (its load and its requests), and one alone under nvshare
    (its load): the yardsticks of the load target and, without `fits`, of the warm latency."""
    args = bench.args
    out: dict[str, Any] = {}
    session = Session(bench, None, 1, "baseline-native")
    try:
        out["native_load"] = session.load()
        plan = plan_turns(1, args.baseline_requests, min(1.0, args.interval))
        out["native"] = run_requests(session, "baseline", plan, h2d_bps)
    finally:
        session.close()
    session = Session(bench, "on", 1, "baseline-nvshare")
    try:
        out["nvshare_load"] = session.load()
    finally:
        session.close()
    return out


def fits_count(bench: Bench, budget: bool = True) -> int:
    """How many tenants fit the card's free memory, and the budget where one is set (`budget`)
    (with 5 % for contexts and the allocator)."""
    room = bench.card["free"]
    if budget and bench.budget:
        room = min(room, bench.budget)
    return min(bench.args.tenants, int(0.95 * room // bench.tenant_bytes))


def scenario_plans(args: argparse.Namespace) -> dict[str, tuple[Plan, float]]:
    """The request scenarios asked for, in their order: plan and warm-up."""
    plans: dict[str, tuple[Plan, float]] = {}
    if "turns" in args.scenarios:
        plans["turns"] = plan_turns(args.tenants, args.rounds, args.interval), 0.0
    if "bursts" in args.scenarios:
        plans["bursts"] = plan_bursts(args.tenants, args.bursts, args.burst_size, args.interval), 0.0
    if "hot-cold" in args.scenarios:
        plans["hot-cold"] = plan_hot_cold(args.tenants, args.hot_every, args.cold_every, args.cold_periods)
    return plans


def run_all(bench: Bench, h2d_bps: float | None, failures: list[dict[str, Any]],
            save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every scenario in every mode: {scenario: {mode: block}} (blocks keep their records)."""
    args = bench.args
    done: dict[str, Any] = {}

    def failed(scenario: str, mode: str, failure: BaseException) -> None:
        failures.append({"scenario": scenario, "mode": mode, "error": f"{type(failure).__name__}: {failure}"[-3000:]})
        print(f"  {scenario} {mode}: FAILED {str(failure)[-600:]}", file=sys.stderr, flush=True)

    if "fits" in args.scenarios:
        count = fits_count(bench)
        for mode in ("none", *args.modes):
            if count < 1:
                break
            try:
                session = Session(bench, None if mode == "none" else mode, count, f"fits-{mode}")
                try:
                    load = session.load()
                    block = run_requests(session, "fits", plan_turns(count, args.rounds, args.interval), h2d_bps)
                    block["load"] = load
                    block["tenants"] = count
                finally:
                    session.close()
                done.setdefault("fits", {})[mode] = block
                progress("fits", mode, block)
            except (ScenarioFailed, RuntimeError, OSError, AssertionError) as failure:
                failed("fits", mode, failure)
            save(done)
    plans = scenario_plans(args)
    if not plans and "load" not in args.scenarios:
        return done
    # Where every tenant fits the card itself (a budget below it plays a smaller card), the
    # same requests without nvshare are what a warm request is held against: three requests at
    # once share the GPU natively too, which one tenant alone does not show.
    if plans and args.native == "auto" and fits_count(bench, budget=False) == args.tenants:
        run_mode(bench, "none", plans, h2d_bps, done, failed, save)
    for mode in args.modes:
        run_mode(bench, mode, plans, h2d_bps, done, failed, save)
    return done


def run_mode(bench: Bench, mode: str, plans: dict[str, tuple[Plan, float]], h2d_bps: float | None,
             done: dict[str, Any], failed: Callable[[str, str, BaseException], None],
             save: Callable[[dict[str, Any]], None]) -> None:
    """The load and the request scenarios of one mode on one session, started afresh after a
    scenario failed or left requests unanswered."""
    args = bench.args
    session = None
    try:
        for scenario, (plan, warm_up) in plans.items() if plans else [("load", ([], 0.0))]:
            try:
                if session is None:
                    session = Session(bench, None if mode == "none" else mode, args.tenants, mode)
                    load = session.load()
                    if "load" in args.scenarios and mode != "none" and mode not in done.get("load", {}):
                        done.setdefault("load", {})[mode] = load
                        progress("load", mode, load)
                    if load["loaded"] < load["tenants"]:
                        raise ScenarioFailed(f"{load['tenants'] - load['loaded']} tenants did not load: "
                                             f"{load.get('failures')}")
                if scenario == "load":
                    continue
                block = run_requests(session, scenario, plan, h2d_bps)
                block["warm_up_s"] = warm_up
                done.setdefault(scenario, {})[mode] = block
                progress(scenario, mode, block)
                if any(not r["answered"] for r in block["records"]):
                    session.close()  # requests still queued in it would spill into the next scenario
                    session = None
            except (ScenarioFailed, RuntimeError, OSError, AssertionError) as failure:
                failed(scenario, mode, failure)
                if session is not None:
                    session.close()
                session = None
            save(done)
    finally:
        if session is not None:
            session.close()


def progress(scenario: str, mode: str, block: dict[str, Any]) -> None:
    if "records" not in block:
        print(f"  {scenario:9} {mode:5} loaded {block['loaded']}/{block['tenants']}, makespan {block['makespan_s']} s, "
              f"each {block['load_s']}", file=sys.stderr, flush=True)
        return
    answered = [r for r in block["records"] if r.get("answered")]
    lat = latency([r["latency_s"] for r in answered]) or {}
    print(f"  {scenario:9} {mode:5} {len(answered)}/{len(block['records'])} answered, p50 {lat.get('p50_s')} s, "
          f"p99 {lat.get('p99_s')} s, max {lat.get('max_s')} s, cold {sum(1 for r in answered if r.get('cold'))}",
          file=sys.stderr, flush=True)


# --- the report ---------------------------------------------------------------------------------------


def warm_reference(done: dict[str, Any], base: dict[str, Any] | None,
                   scenario: str | None = None) -> tuple[float | None, str]:
    """The warm p99 without nvshare that the warm requests of `scenario` are held against: the
    same scenario without nvshare where it ran (every tenant fits the card), else `fits` without
    nvshare, else the baseline tenant alone."""
    for source, block in (("the same scenario without nvshare", done.get(scenario or "", {}).get("none")),
                          ("fits without nvshare", done.get("fits", {}).get("none")),
                          ("one tenant alone without nvshare", (base or {}).get("native"))):
        if block:
            warm = [r["latency_s"] for r in block["records"] if r.get("answered") and not r["first"]]
            if warm:
                return percentile(warm, 0.99), source
    return None, "none measured"


def load_figures(load: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(load)
    alone = (base or {}).get("native_load", {}).get("makespan_s")
    alone_nvshare = (base or {}).get("nvshare_load", {}).get("makespan_s")
    makespan = load.get("makespan_s")
    out["alone_native_s"], out["alone_nvshare_s"] = alone, alone_nvshare
    out["sum_alone_native_s"] = round(alone * load["tenants"], 3) if alone else None
    out["ratio_to_sum_alone_native"] = round(makespan / (alone * load["tenants"]), 3) if makespan and alone else None
    out["ratio_to_sum_alone_nvshare"] = (round(makespan / (alone_nvshare * load["tenants"]), 3)
                                         if makespan and alone_nvshare else None)
    out["targets"] = {"load_ratio": target(out["ratio_to_sum_alone_native"], LOAD_RATIO_MAX),
                      "every_tenant_loaded": target(load["tenants"] - load["loaded"], 0)}
    return out


def scenario_figures(scenario: str, block: dict[str, Any], reference: float | None,
                     idle_window: float) -> dict[str, Any]:
    figures = request_figures(block["records"], reference, idle_window)
    for key in ("started", "span_s", "tenants", "warm_up_s", "watched", "simulated_link_mib",
                "simulated_pinned_bytes_max", "timeline"):
        if key in block:
            figures[key] = block[key]
    if "load" in block:
        figures["load"] = block["load"]
    watched = block.get("watched")
    if watched:
        pinned, swapped = watched["pinned_bytes_max"], watched["swapped_bytes_max"]
        figures["pinned_ratio"] = round(pinned / swapped, 3) if swapped else None
        figures["targets"]["pinned_ratio"] = target(figures["pinned_ratio"], PINNED_RATIO_MAX)
    if scenario == "hot-cold":
        figures["hot_swap_ins"] = sum(1 for r in block["records"] if r["tenant"] < HOT and r.get("cold")
                                      and r["offset_s"] >= block["warm_up_s"])
        figures["targets"]["hot_swap_ins"] = target(figures["hot_swap_ins"], 0)
    return figures


def summarise(bench: Bench, done: dict[str, Any], base: dict[str, Any] | None, h2d_bps: float | None,
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary, scenarios): the issue's figures over every nvshare run and per mode, and per
    scenario and mode the figures without the records."""
    reference, reference_source = warm_reference(done, base)
    scenarios: dict[str, Any] = {}
    for scenario, modes in done.items():
        own, own_source = warm_reference(done, base, scenario)
        for mode, block in modes.items():
            if scenario == "load":
                figures = load_figures(block, base)
            else:
                figures = scenario_figures(scenario, block, own, bench.idle_window)
                figures["warm_reference"] = own_source
                figures["warm_reference_p99_s"] = round(own, 4) if own else None
            scenarios.setdefault(scenario, {})[mode] = figures
    natively = sorted(scenario for scenario, modes in done.items()
                      if scenario not in ("load", "fits") and "none" in modes)
    if natively:
        reference_source = f"the same scenario without nvshare ({', '.join(natively)}), else {reference_source}"
    summary: dict[str, Any] = {"warm_reference": reference_source,
                               "warm_reference_p99_s": round(reference, 4) if reference else None,
                               "idle_window_s": bench.idle_window}
    modes = sorted({mode for modes in done.values() for mode in modes if mode != "none"})
    summary.update(mode_summary(bench, done, scenarios, modes, h2d_bps))
    summary["by_mode"] = {mode: mode_summary(bench, done, scenarios, [mode], h2d_bps) for mode in modes}
    return summary, scenarios


def mode_summary(bench: Bench, done: dict[str, Any], scenarios: dict[str, Any], modes: list[str],
                 h2d_bps: float | None) -> dict[str, Any]:
    records = [r for scenario, blocks in done.items() if scenario != "load" for mode, block in blocks.items()
               if mode in modes for r in block["records"]]
    answered = [r for r in records if r.get("answered")]
    cold = [r for r in answered if r.get("cold")]
    figures = [f for scenario, blocks in scenarios.items() if scenario != "load" for mode, f in blocks.items()
               if mode in modes]
    largest = max((r["S"] for r in cold), default=bench.tenant_bytes)
    ratios = [f["warm_p99_ratio"] for f in figures if f.get("warm_p99_ratio") is not None]
    waits = [f["idle_holder_wait_max_s"] for f in figures if f.get("idle_holder_wait_max_s") is not None]
    watched = [f["watched"] for f in figures if f.get("watched")]
    pinned = max((w["pinned_bytes_max"] for w in watched), default=None)
    swapped = max((w["swapped_bytes_max"] for w in watched), default=None)
    hot = [f["hot_swap_ins"] for f in figures if "hot_swap_ins" in f]
    loads = [f for mode, f in scenarios.get("load", {}).items() if mode in modes]
    load_ratio = max((f["ratio_to_sum_alone_native"] for f in loads if f["ratio_to_sum_alone_native"] is not None),
                     default=None)
    out: dict[str, Any] = {
        "requests": len(records), "answered": len(answered), "cold": len(cold),
        "p99_s": round(percentile([r["latency_s"] for r in answered], 0.99), 4) if answered else None,
        "cold_p99_s": round(percentile([r["latency_s"] for r in cold], 0.99), 4) if cold else None,
        "cold_max_s": round(max(r["latency_s"] for r in cold), 4) if cold else None,
        "cold_bound_s": cold_bound(largest, h2d_bps) if h2d_bps else None,
        "cold_bound_for_bytes": largest,
        "cold_over_bound": sum(1 for r in cold if r.get("bound_s") is not None and r["latency_s"] > r["bound_s"]),
        "cold_over_queue_bound": sum(1 for r in cold if r.get("queue_bound_s") is not None
                                     and r["latency_s"] > r["queue_bound_s"]),
        "warm_p99_ratio": max(ratios) if ratios else None,
        "idle_holder_wait_max_s": max(waits) if waits else None,
        "hot_swap_ins": sum(hot) if hot else None,
        "pinned_bytes_max": pinned,
        "swapped_bytes_max": swapped,
        "pinned_ratio": round(pinned / swapped, 3) if pinned is not None and swapped else None,
        "load_ratio": load_ratio,
    }
    simulated = [f["simulated_pinned_bytes_max"] for f in figures if "simulated_pinned_bytes_max" in f]
    if simulated:
        out["simulated_pinned_bytes_max"] = max(simulated)
    out["targets"] = {
        "cold_over_bound": target(out["cold_over_bound"] if cold and h2d_bps else None, 0),
        "p99_s": target(out["p99_s"], P99_MAX_S),
        "warm_p99_ratio": target(out["warm_p99_ratio"], WARM_RATIO_MAX),
        "idle_holder_wait_max_s": target(out["idle_holder_wait_max_s"], round(bench.idle_window + IDLE_SLACK_S, 3)),
        "hot_swap_ins": target(out["hot_swap_ins"], 0),
        "load_ratio": target(load_ratio, LOAD_RATIO_MAX),
        "pinned_ratio": target(out["pinned_ratio"], PINNED_RATIO_MAX),
        "every_request_answered": target(len(records) - len(answered), 0),
        "stretch_cold_over_1.05x": target(sum(1 for r in cold if r["latency_s"] > r["stretch_bound_s"])
                                            if cold and h2d_bps else None, 0),
    }
    return out


def table(summary: dict[str, Any], scenarios: dict[str, Any]) -> str:
    def s(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = [f"{'scenario':10}{'mode':6}{'asked':>6}{'done':>5}{'p50':>8}{'p99':>8}{'max':>8}{'warm p99':>9}"
             f"{'cold':>5}{'cold p99':>9}{'>bound':>7}{'idle wait':>10}{'pinned MiB':>11}{'out MiB':>8}"]
    for scenario, modes in scenarios.items():
        for mode, f in modes.items():
            if scenario == "load":
                lines.append(f"{'load':10}{mode:6}{f['tenants']:>6}{f['loaded']:>5}  makespan {s(f['makespan_s'])} s, "
                             f"{s(f['ratio_to_sum_alone_native'])} x the sum alone without nvshare, "
                             f"{s(f['ratio_to_sum_alone_nvshare'])} x under nvshare")
                continue
            lat, warm, cold = f["latency"] or {}, f["warm"] or {}, f["cold"] or {}
            watched = f.get("watched") or {}
            lines.append(f"{scenario:10}{mode:6}{f['requests']:>6}{f['answered']:>5}{s(lat.get('p50_s')):>8}"
                         f"{s(lat.get('p99_s')):>8}{s(lat.get('max_s')):>8}{s(warm.get('p99_s')):>9}"
                         f"{cold.get('n', 0):>5}{s(cold.get('p99_s')):>9}"
                         f"{s(f['targets']['cold_over_bound']['value']):>7}{s(f['idle_holder_wait_max_s']):>10}"
                         f"{s(watched.get('pinned_bytes_max', 0) // MIB if watched else None):>11}"
                         f"{s(watched.get('swapped_out_bytes', 0) // MIB if watched else None):>8}")
    lines.append("targets: " + ", ".join(f"{name} {s(t['value'])} (<= {t['limit']}: "
                                         f"{'-' if t['met'] is None else 'met' if t['met'] else 'MISSED'})"
                                         for name, t in summary["targets"].items()))
    return "\n".join(lines)


# --- the program --------------------------------------------------------------------------------------


def link_bandwidth(bench: Bench) -> dict[str, Any]:
    """The pinned link each way: measured on a GPU before any tenant starts (bench_swap_bandwidth's
    ceiling, a process of its own), modelled on the simulated driver."""
    if not bench.args.gpu:
        bps = MIB / (SIM_PINNED_US_PER_MIB * 1e-6 * bench.args.sim_cost_scale)
        return {"how": f"modelled: SIMCUDA_PINNED_US_PER_MIB {SIM_PINNED_US_PER_MIB} x SIMCUDA_COST_SCALE "
                       f"{bench.args.sim_cost_scale}", "h2d_GBps": round(bps / 1e9, 4), "d2h_GBps": round(bps / 1e9, 4)}
    from bench_swap_bandwidth import in_child

    from nvshare_py.testing.scheduler import child_env

    nbytes = min(bench.tenant_bytes, 8 * GIB) // (2 * MIB) * (2 * MIB)
    try:
        ceiling = in_child("ceiling", nbytes, child_env())
    except (Exception, SystemExit) as failure:
        return {"how": "measured: bench_swap_bandwidth.py's ceiling", "error": str(failure)[-2000:],
                "h2d_GBps": None, "d2h_GBps": None}
    return {"how": f"measured: pinned cudaMemcpy of {nbytes} bytes (bench_swap_bandwidth.py's ceiling)",
            "h2d_GBps": ceiling["pinned_h2d_GBps"], "d2h_GBps": ceiling["pinned_d2h_GBps"], "ceiling": ceiling}


def scheduler_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected key=value (a daemon option without its dashes)")
    return key.replace("-", "_"), value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short scenarios on the simulated driver (a few minutes)")
    parser.add_argument("--gpu", action="store_true", help="a real card with PyTorch instead of the simulated driver")
    parser.add_argument("--kernels", action="store_true", help="tenants are Jupyter kernels of the nvshare kernelspec")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--native", choices=("auto", "never"), default="auto",
                        help="auto: where every tenant fits the card itself (--budget-gib below it plays a smaller "
                             "card), run the request scenarios without nvshare too, the reference for their warm "
                             "requests; never: hold warm requests against fits, else one tenant alone")
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--gib", type=float, default=30.0, help="weights per tenant (GiB; divided by "
                        f"{SIM_DIVISOR} on the simulated driver)")
    parser.add_argument("--card-gib", type=float, default=ISSUE_CARD_GIB,
                        help=f"the simulated card before division (default: the issue's H200, {ISSUE_CARD_GIB})")
    parser.add_argument("--budget-gib", type=float,
                        help="the scheduler's budget for the card (nvsharectl set-budget; divided as --gib on the "
                             "simulated driver). Default: none, the card's size as the daemon measures it, as in the "
                             "issue. A budget below the card makes a shared card behave like a smaller one without "
                             "oversubscribing it physically")
    parser.add_argument("--sim-cost-scale", type=float, default=SIM_DIVISOR,
                        help="SIMCUDA_COST_SCALE (default: the size divisor, so that modelled times are the H200's)")
    parser.add_argument("--interval", type=float, help="seconds between requests in turn (default 3; --quick 1.5)")
    parser.add_argument("--rounds", type=int, help="rounds of turns (each tenant once) (default 4; --quick 2)")
    parser.add_argument("--bursts", type=int, help="bursts (default 6; --quick 2)")
    parser.add_argument("--burst-size", type=int, default=3, help="tenants asked at once in a burst")
    parser.add_argument("--hot-every", type=float, default=1.0, help="seconds between a hot tenant's requests")
    parser.add_argument("--cold-every", type=float, help="seconds between a cold tenant's requests (default 60; "
                        "--quick 15)")
    parser.add_argument("--cold-periods", type=int, help="length of hot-cold in cold periods (default 3; --quick 2)")
    parser.add_argument("--baseline-requests", type=int, help="requests of the tenant alone (default 30; --quick 10)")
    parser.add_argument("--request-ms", type=float, default=11.0,
                        help="simulated driver: a request's kernel (the issue's decode step on an H200)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a request (or a tenant's start) may take")
    parser.add_argument("--load-timeout", type=float, default=600.0, help="seconds the loads may take")
    parser.add_argument("--sample", type=float, default=0.2, help="seconds between two looks at the status")
    parser.add_argument("--host-gib", type=float, help="--gpu: the host memory free for the tenants, instead of "
                        "MemAvailable (a virtual machine whose memory grows as it is used shows too little at first)")
    parser.add_argument("--scheduler-option", type=scheduler_option, action="append", default=[],
                        metavar="KEY=VALUE", help="a daemon option (tq=10, idle_release=0.5, ...); repeatable")
    parser.add_argument("--out", type=Path, help="the JSON file (default: benchmarks/results/tenants-<date>"
                        "[-quick|-gpu].json)")
    parser.add_argument("--tenant", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tenant:
        return args
    quick = args.quick
    for name, full, short in (("interval", 3.0, 1.5), ("rounds", 4, 2), ("bursts", 6, 2), ("cold_every", 60.0, 15.0),
                              ("cold_periods", 3, 2), ("baseline_requests", 30, 10)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    args.scheduler_option = dict(args.scheduler_option)
    return args


def check_safety(bench: Bench) -> None:
    """On a GPU: the tenants' total below the card plus half of the host's MemAvailable (or of
    --host-gib, on a machine whose memory grows as it is used)."""
    if not bench.args.gpu:
        return
    available = int(bench.args.host_gib * GIB) if bench.args.host_gib else 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:") and not available:
                available = int(line.split()[1]) * 1024
    total = bench.args.tenants * bench.tenant_bytes
    if total >= bench.card["total"] + available // 2:
        raise SystemExit(f"{bench.args.tenants} x {bench.args.gib:g} GiB is more than the card "
                         f"({bench.card['total'] / GIB:.1f} GiB) and half of MemAvailable ({available / GIB:.1f} GiB) "
                         "hold: fewer tenants or smaller ones")


def document_head(args: argparse.Namespace, bench: Bench, link: dict[str, Any], logs: Path) -> dict[str, Any]:
    """What the run was: backend, machine, settings, the link, the targets."""
    from bench_colocation import machine_load

    backend = (f"real GPU {bench.card['name']} (torch {bench.card.get('torch')})" if args.gpu else
               f"simulated driver (tests/simcuda, residency modelled, H200 costs x {args.sim_cost_scale:g}, sizes / "
               f"{SIM_DIVISOR})")
    settings = {key: value for key, value in vars(args).items() if key not in ("tenant", "out")}
    settings.update(tenant_bytes=bench.tenant_bytes, card_bytes=bench.card["total"], budget_bytes=bench.budget,
                    fits_tenants=fits_count(bench), idle_window_s=bench.idle_window, scheduler_options=bench.options)
    return {
        "benchmark": "tenants",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend, "simulated": not args.gpu, "quick": args.quick, "kernels": args.kernels,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "load_before": machine_load()},
        "settings": settings, "link": link, "logs": str(logs),
        "targets": {
            "cold": f"<= S / ({COLD_LINK_SHARE} x pinned h2d) + {COLD_SLACK_S} s; stretch {STRETCH} x S / pinned h2d",
            "p99": f"<= {P99_MAX_S} s", "warm": f"<= {WARM_RATIO_MAX} x no nvshare",
            "idle_holder_wait": f"<= idle window + {IDLE_SLACK_S} s", "hot_swap_ins": "0 after the warm-up",
            "load": f"<= {LOAD_RATIO_MAX} x the sum of loads alone without nvshare",
            "pinned": f"<= {PINNED_RATIO_MAX} x the peak of swapped-out bytes",
            "auto": "the same request targets, and every request answered"},
    }


def main() -> None:
    args = parse_args()
    if args.tenant:
        tenant_main(args.tenant[0], int(args.tenant[1]), int(args.tenant[2]))
        return
    sys.path[:0] = [str(BENCHMARKS), str(GPU_BENCHMARKS)]  # the benchmarks this one builds on
    from bench_colocation import machine_load

    work = Path(tempfile.mkdtemp(prefix="nvs-tenants-", dir="/tmp"))
    logs = Path(os.environ.get("NVSHARE_BENCH_LOGS") or tempfile.mkdtemp(prefix="nvs-tenants-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs of every child: {logs}", file=sys.stderr, flush=True)
    out = args.out or BENCHMARKS / "results" / (f"tenants-{datetime.date.today().isoformat()}"
                                                + ("-gpu" if args.gpu else "") + ("-quick" if args.quick else "")
                                                + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # A SIGTERM ends the run through the finally clauses that end every child.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        bench = Bench(args, work, logs)
        check_safety(bench)
        link = link_bandwidth(bench)
        h2d_bps = link["h2d_GBps"] * 1e9 if link.get("h2d_GBps") else None
        document = document_head(args, bench, link, logs)
        failures: list[dict[str, Any]] = []

        def save(done: dict[str, Any]) -> None:
            """What was measured so far survives a later failure."""
            results = [r for blocks in done.values() for block in blocks.values() for r in block.get("records", [])]
            out.write_text(json.dumps({**document, "partial": True, "failures": failures, "results": results},
                                      indent=1, default=str) + "\n")

        base = None
        if set(args.scenarios) != {"fits"}:  # fits has its own yardstick
            try:
                base = baseline(bench, h2d_bps)
            except (ScenarioFailed, RuntimeError, OSError, AssertionError) as failure:
                failures.append({"scenario": "baseline", "error": f"{type(failure).__name__}: {failure}"[-3000:]})
        done = run_all(bench, h2d_bps, failures, save)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary, scenarios = summarise(bench, done, base, h2d_bps)
    results = [r for blocks in done.values() for block in blocks.values() for r in block.get("records", [])]
    if base and "native" in base:
        results = base["native"]["records"] + results
        base = {key: value for key, value in base.items() if key != "native"} | {
            "native_requests": request_figures(base["native"]["records"], None, bench.idle_window)}
    document.update({"summary": summary, "baseline": base, "scenarios": scenarios, "failures": failures,
                     "results": results, "elapsed_s": round(time.monotonic() - started, 1)})
    document["machine"]["load_after"] = machine_load()
    text = json.dumps(document, indent=1, default=str)
    out.write_text(text + "\n")
    print(table(summary, scenarios), file=sys.stderr)
    print(f"written to {out}; logs in {logs}", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
