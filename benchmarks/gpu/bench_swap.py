"""Swapping on a real GPU (issue 8): bulk moves against fault-driven paging, and two jobs under a
memory budget below the card's size.

    OUT=/tmp/out python benchmarks/gpu/bench_swap.py [--quick]

Real GPU only (PyTorch; libcuda through ctypes, no CUDA toolkit needed). Builds libnvshare.so
from this tree with make (or uses $NVSHARE_LIBRARY). Runs in well under 5 minutes on an H100 or
H200. Writes swap-<date>.json into $OUT (or --out) and prints a table and the JSON.

Part (a), raw bandwidth, one process without nvshare: an 8 GiB managed buffer
(cuMemAllocManaged) is first touched by a kernel, then moved to the host with
cuMemPrefetchAsync and measured coming back three ways: fault-driven (a kernel touches it),
bulk (cuMemPrefetchAsync to the device, then the same kernel), and the prefetch alone. The
issue's target: swap-out and swap-in during a handoff reach 80 % of the bulk bandwidth measured
here (8 GiB in about 0.25 s or less on an H200).

Part (b), two jobs under a budget: the scheduler's budget is set to 16 GiB (`set-budget`), two
PyTorch jobs of 12 GiB each (60-75 % of the budget) alternate about 1 s of GPU work over all
their memory with 1 s on the CPU. As far as nvshare is concerned they are oversubscribed, so
every handoff must swap; their summed memory (24 GiB) stays far below the card's free memory
(safety rule: the script refuses to run unless the free memory is at least 3 times the jobs'
sum). Modes: `sequential` (one job after the other, no nvshare), `off` (no scheduling), `on`
(serialised, `--swapping off`: nothing moves, the pages stay on the card because it really has
room), `swap` (serialised, `--swapping on`: each handoff evicts the holder's memory in bulk and
prefetches the grantee's). The issue's target: `swap` finishes both at least 1.5x faster than
`sequential` (the paper reports 1.35x). `swap` needs the interceptor's side of issue 8 (it
reports `resident=`, evicts on DROP/EVICT, prefetches on GRANT): the JSON records what the
scheduler asked to move and what the clients said they moved, so a run with an interceptor that
does not swap shows it (nothing swapped out).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this tree's nvshare_py, bench_colocation

from bench_colocation import GPU_JOB, gpu_jobs, gpu_uuid  # noqa: E402  (the paper's pytorch-add job, one copy)
from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402
from nvshare_py.testing.scheduler import SchedulerProcess, child_env  # noqa: E402
from nvshare_py.timeline import detail_fields  # noqa: E402

GiB = 1 << 30
CU_MEM_ATTACH_GLOBAL = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
CU_DEVICE_CPU = -1

# --- part (a): bandwidth, raw --------------------------------------------------------------


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Driver:
    """The few driver calls part (a) needs, on the context PyTorch made current."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self._prefetch_v2 = getattr(self.cuda, "cuMemPrefetchAsync_v2", None)

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUDA error {result}")

    def alloc_managed(self, size: int) -> int:
        pointer = ctypes.c_uint64()
        self.check(self.cuda.cuMemAllocManaged(ctypes.byref(pointer), ctypes.c_size_t(size),
                                               ctypes.c_uint(CU_MEM_ATTACH_GLOBAL)), "cuMemAllocManaged")
        return pointer.value

    def free(self, pointer: int) -> None:
        self.check(self.cuda.cuMemFree_v2(ctypes.c_uint64(pointer)), "cuMemFree")

    def prefetch(self, pointer: int, size: int, device: int | None) -> None:
        """Bulk move to `device` (None: host) on the legacy stream; returns once it is queued."""
        if self._prefetch_v2 is not None:
            location = (CUmemLocation(CU_MEM_LOCATION_TYPE_HOST, 0) if device is None
                        else CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device))
            result = self._prefetch_v2(ctypes.c_uint64(pointer), ctypes.c_size_t(size), location, ctypes.c_uint(0),
                                       ctypes.c_void_p(0))
        else:
            result = self.cuda.cuMemPrefetchAsync(ctypes.c_uint64(pointer), ctypes.c_size_t(size),
                                                  ctypes.c_int(CU_DEVICE_CPU if device is None else device),
                                                  ctypes.c_void_p(0))
        self.check(result, "cuMemPrefetchAsync")

    def synchronize(self) -> None:
        self.check(self.cuda.cuCtxSynchronize(), "cuCtxSynchronize")


def bandwidth(size: int, repeats: int) -> dict:
    """Part (a), in this process, without nvshare."""
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    device = torch.cuda.current_device()
    driver = Driver()
    pointer = driver.alloc_managed(size)

    class Managed:  # torch reads a device pointer through the CUDA array interface
        __cuda_array_interface__ = {"shape": (size // 4,), "typestr": "<f4", "data": (pointer, False), "version": 2}

    buffer = torch.as_tensor(Managed(), device="cuda")

    def timed(action) -> float:
        driver.synchronize()
        start = time.perf_counter()
        action()
        driver.synchronize()
        return time.perf_counter() - start

    def kernel() -> None:
        buffer.add_(1.0)

    def to_host() -> None:
        driver.prefetch(pointer, size, None)

    def to_device() -> None:
        driver.prefetch(pointer, size, device)

    def prefetch_then_kernel() -> None:
        to_device()
        kernel()

    samples: dict[str, list[float]] = {name: [] for name in
                                       ("first_touch", "kernel_resident", "to_host_prefetch", "fault_in_with_kernel",
                                        "prefetch_in_with_kernel", "prefetch_in_alone")}
    try:
        samples["first_touch"].append(timed(kernel))
        for _ in range(repeats):
            samples["kernel_resident"].append(timed(kernel))
            samples["to_host_prefetch"].append(timed(to_host))
            samples["fault_in_with_kernel"].append(timed(kernel))
            timed(to_host)
            samples["prefetch_in_with_kernel"].append(timed(prefetch_then_kernel))
            timed(to_host)
            samples["prefetch_in_alone"].append(timed(to_device))
    finally:
        del buffer
        driver.synchronize()
        driver.free(pointer)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "bytes": size,
        "seconds_median": {name: round(value, 4) for name, value in medians.items()},
        "seconds_all": {name: [round(v, 4) for v in values] for name, values in samples.items()},
        "gb_per_s": {
            "to_host_prefetch": round(size / medians["to_host_prefetch"] / 1e9, 2),
            "to_device_prefetch": round(size / medians["prefetch_in_alone"] / 1e9, 2),
            "to_device_faults": round(size / max(1e-9, medians["fault_in_with_kernel"] - medians["kernel_resident"]) / 1e9,
                                      2),
        },
        "bulk_speedup_over_faults": round(medians["fault_in_with_kernel"] / medians["prefetch_in_with_kernel"], 2),
    }


# --- part (b): two jobs under a budget -----------------------------------------------------


CALIBRATE = r"""
import sys, time, torch
n = int(sys.argv[1]) // 4 // 2
a = torch.ones(n, device="cuda"); b = torch.ones(n, device="cuda")
for _ in range(5): a.add_(b)
torch.cuda.synchronize(); t = time.monotonic()
for _ in range(50): a.add_(b)
torch.cuda.synchronize(); print((time.monotonic() - t) / 50)
"""


def colocation(work: Path, base_env: dict, preload: Path, budget: int, job_bytes: int, steps: int, burst_s: float,
               cpu_s: float, tq: float, timeout: float) -> dict:
    per_iter = float(subprocess.run([sys.executable, "-c", CALIBRATE, str(job_bytes)], env=base_env,
                                    capture_output=True, text=True, check=True).stdout.split()[-1])
    iters = max(1, round(burst_s / per_iter))
    argv = [sys.executable, "-c", GPU_JOB, str(job_bytes), str(steps), str(iters), str(cpu_s)]
    result = {"iterations_per_burst": iters, "burst_s_calibrated": round(iters * per_iter, 3), "modes": {}}
    device = gpu_uuid(base_env)
    result["modes"]["sequential"] = {"makespan_s": round(sum(gpu_jobs([argv], base_env, timeout) for _ in range(2)), 3)}
    print(f"  sequential: {result['modes']['sequential']}", file=sys.stderr, flush=True)
    for name, mode, swapping in (("off", "off", "off"), ("on", "on", "off"), ("swap", "on", "on")):
        socket_dir = work / f"s-{name}"
        socket_dir.mkdir()
        scheduler = SchedulerProcess(socket_dir, {"mode": mode, "swapping": swapping, "tq": tq, "log_level": "info"})
        scheduler.start()
        try:
            env = dict(scheduler.env, LD_PRELOAD=str(preload), NVSHARE_LOG="error")
            scheduler.request("set-budget", device=device, bytes=budget)  # before any job has started
            makespan = gpu_jobs([argv, argv], env, timeout)
            events = scheduler.events()
            grants = [e for e in events if e["kind"] == "grant" and e["device"] == device]
            outcome = {
                "makespan_s": round(makespan, 3),
                "grants": len(grants),
                "evict_requests": sum(1 for e in events if e["kind"] == "evict"),
                "evicted_answers": sum(1 for e in events if e["kind"] == "evicted"),
                "prefetch_granted_gib": round(sum(int(detail_fields(e["detail"]).get("prefetch", 0))
                                                  for e in grants) / GiB, 2),
                # What PREFETCHes let waiters bring back ahead of their grants (event detail bytes=).
                "prefetch_ahead_gib": round(sum(int(detail_fields(e["detail"]).get("bytes", 0))
                                                for e in events if e["kind"] == "prefetch") / GiB, 2),
                # What DROPs asked holders to evict: the daemon's info log ("drop grant ... evict=N").
                "evict_on_drop_gib": round(sum(int(n) for n in re.findall(r" drop grant .* evict=(\d+)",
                                                                          scheduler.log_text())) / GiB, 2),
            }
        finally:
            scheduler.stop()
        outcome["ratio_to_sequential"] = round(outcome["makespan_s"] / result["modes"]["sequential"]["makespan_s"], 3)
        outcome["speedup_over_sequential"] = round(1 / outcome["ratio_to_sequential"], 3)
        result["modes"][name] = outcome
        print(f"  {name}: {outcome}", file=sys.stderr, flush=True)
    result["modes"]["sequential"].update(ratio_to_sequential=1.0, speedup_over_sequential=1.0)
    return result


def table(document: dict) -> str:
    """The text summary of a result document."""
    settings = document["settings"]
    seconds = document["bandwidth"]["seconds_median"]
    rate = document["bandwidth"]["gb_per_s"]
    lines = [
        f"{document['gpu']}, {settings['buffer_gib']:g} GiB managed buffer (medians):",
        f"  to host, bulk prefetch      {seconds['to_host_prefetch']:.3f} s  ({rate['to_host_prefetch']} GB/s)",
        f"  to device, bulk prefetch    {seconds['prefetch_in_alone']:.3f} s  ({rate['to_device_prefetch']} GB/s)",
        f"  to device by faults+kernel  {seconds['fault_in_with_kernel']:.3f} s",
        f"  prefetch + kernel           {seconds['prefetch_in_with_kernel']:.3f} s  "
        f"(bulk {document['bandwidth']['bulk_speedup_over_faults']}x faster; kernel alone {seconds['kernel_resident']:.3f} s)",
        f"two {settings['job_gib']:g} GiB jobs under a {settings['budget_gib']:g} GiB budget, {settings['gpu_burst_s']:g} s GPU / {settings['cpu_s']:g} s CPU steps:",
        f"  {'mode':11} {'makespan':>9} {'vs seq':>7} {'grants':>6} {'evicted':>9} {'EVICTs':>6} {'prefetch':>9}",
    ]
    for name, outcome in document["colocation"]["modes"].items():
        lines.append(f"  {name:11} {outcome['makespan_s']:>8.2f}s {outcome['speedup_over_sequential']:>6.2f}x "
                     f"{outcome.get('grants', '-'):>6} {str(outcome.get('evict_on_drop_gib', '-')) + ' GiB':>9} "
                     f"{outcome.get('evict_requests', '-'):>6} "
                     f"{str(outcome.get('prefetch_granted_gib', '-')) + ' GiB':>9}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--buffer-gib", type=float, default=8.0, help="part (a): managed buffer size")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="part (b): the scheduler's budget")
    parser.add_argument("--job-gib", type=float, default=12.0, help="part (b): each job's memory")
    parser.add_argument("--tq", type=float, default=4.0, help="part (b): time quantum, seconds")
    parser.add_argument("--burst", type=float, default=1.0, help="part (b): seconds of GPU work per step")
    parser.add_argument("--cpu", type=float, default=1.0, help="part (b): seconds on the CPU per step")
    parser.add_argument("--child-bandwidth", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeats, steps = (2, 5) if args.quick else (3, 8)
    if args.child_bandwidth:
        print(json.dumps(bandwidth(int(args.buffer_gib * GiB), repeats)))
        return

    # Asked of a child, so that this process holds no CUDA context while the jobs run.
    probe = subprocess.run([sys.executable, "-c", "import torch; f, t = torch.cuda.mem_get_info(); "
                            "print(f, t, torch.cuda.get_device_name())"], capture_output=True, text=True, check=True)
    free_text, total_text, gpu = probe.stdout.strip().split(" ", 2)
    free, total = int(free_text), int(total_text)
    job_bytes = int(args.job_gib * GiB)
    # Safety rule: summed managed memory far below the free memory (part (b) holds two jobs at
    # once in modes off/on; part (a) runs alone before it).
    if 2 * job_bytes * 3 > free or args.buffer_gib * GiB * 3 > free:
        raise SystemExit(f"refusing: {free / GiB:.1f} GiB free is less than 3x the memory asked for "
                         f"(jobs {2 * args.job_gib:g} GiB, buffer {args.buffer_gib:g} GiB)")
    work = Path(tempfile.mkdtemp(prefix="nvs-swap-", dir="/tmp"))
    base_env = child_env()
    base_env.pop("LD_PRELOAD", None)
    preload = benchmark_library(ROOT, work)
    started = time.monotonic()
    print("(a) bulk prefetch vs fault-driven paging", file=sys.stderr, flush=True)
    child = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child-bandwidth", "--buffer-gib",
                            str(args.buffer_gib)] + (["--quick"] if args.quick else []),
                           env=base_env, capture_output=True, text=True, timeout=240)
    if child.returncode != 0:
        raise SystemExit(f"part (a) failed:\n{child.stderr[-3000:]}")
    part_a = json.loads(child.stdout.strip().splitlines()[-1])
    print("(b) two jobs under a budget", file=sys.stderr, flush=True)
    part_b = colocation(work, base_env, preload, int(args.budget_gib * GiB), job_bytes, steps, burst_s=args.burst, cpu_s=args.cpu,
                        tq=args.tq, timeout=240)
    versions = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                              env=base_env, capture_output=True, text=True).stdout.split()
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip()
    document = {
        "benchmark": "swap",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu, "driver": driver, "torch": versions[:1], "cuda": versions[1:2],
        "free_gib_at_start": round(free / GiB, 1), "total_gib": round(total / GiB, 1),
        "settings": {"quick": args.quick, "buffer_gib": args.buffer_gib, "budget_gib": args.budget_gib,
                     "job_gib": args.job_gib, "tq_s": args.tq, "steps": steps, "gpu_burst_s": args.burst, "cpu_s": args.cpu},
        "bandwidth": part_a,
        "colocation": part_b,
        "targets": {
            "bulk_8gib_within_s_h200": 0.25,
            "swap_speedup_over_sequential": 1.5,
            "paper_speedup_over_sequential": 1.35,
        },
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"swap-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(table(document), file=sys.stderr)
    print(json.dumps(document, indent=1))
    print(f"written: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
