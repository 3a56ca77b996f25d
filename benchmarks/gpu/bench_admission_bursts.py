"""The admission storm on a real GPU (issue 20): two PyTorch processes taking turns with short
bursts, as in the case where one interceptor sent 35,707 ADMITs in its first second and the
idle probe gave the lock away in the middle of a burst.

    python benchmarks/gpu/bench_admission_bursts.py [--runs 3] [--bursts 6] [--gap 7] [--out bursts.json]

Real GPU only; about (runs x (bursts x gap + 15)) seconds (3 runs of 6 bursts: about 3 minutes).
Builds libnvshare.so from this tree with make (or uses $NVSHARE_LIBRARY), starts a scheduler
with its defaults (mode on, admission on, idle release 1 s), and per run two worker processes
under LD_PRELOAD with NVSHARE_LOG=debug, the second started half a gap after the first. Each
worker makes its first CUDA calls (the caching allocator's first segments, cuBLAS), measures
how many 4096x4096 float32 matrix products take 1 s while it holds the GPU, then bursts: that
many products and a synchronize, then `--gap` seconds of sleep. Every tensor is 64 MiB and a
worker holds a few: far below any card's free memory (the safety rule).

Per worker it reports
- `admits_first_second`: ADMIT questions its interceptor sent in the first second after its
  first one (each `sent NVSHARE/1 ADMIT` debug line, stamped as it arrives), and `admits`: all;
- `bursts_s`: each burst's length (from its first product to the end of its synchronize);
- `mid_burst_releases`: releases of its lock (scheduler events) inside one of its bursts;
- `overlaps`: the other worker's grants inside one of its bursts.
And it checks the issue's targets: at most 10 ADMITs in the first second, no release in the
middle of a burst, every burst (after the calibrated first) within 5 % of 1 s. Prints a short
table and writes the JSON document to --out, or to $OUT/admission-bursts.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402
from nvshare_py.testing.scheduler import SchedulerProcess  # noqa: E402
from nvshare_py.timeline import registered_pid  # noqa: E402

SIZE = 4096
BURST_S = 1.0
ADMIT_LINE = "sent NVSHARE/1 ADMIT"


def worker(bursts: int, gap: float) -> None:
    """Run with --child: warm up, calibrate a 1 s burst, then burst; one JSON line per burst."""
    import torch

    a = torch.randn(SIZE, SIZE, device="cuda")
    b = torch.randn(SIZE, SIZE, device="cuda")
    c = a @ b
    torch.cuda.synchronize()
    # Calibrate: products per second while this process holds the GPU.
    count, started = 0, time.monotonic()
    while time.monotonic() - started < 0.5:
        for _ in range(10):
            c = a @ b
        torch.cuda.synchronize()
        count += 10
    per_burst = max(1, round(count / (time.monotonic() - started) * BURST_S))
    print(json.dumps({"calibrated": per_burst}), flush=True)
    for _ in range(bursts):
        time.sleep(gap)
        start = time.time()
        for _ in range(per_burst):
            c = a @ b
        torch.cuda.synchronize()
        print(json.dumps({"burst": [start, time.time()]}), flush=True)
    del c


class Worker:
    def __init__(self, env: dict[str, str], bursts: int, gap: float) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, "--child", "--bursts", str(bursts), "--gap", str(gap)],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.admits: list[float] = []  # monotonic arrival of each ADMIT line
        self.bursts: list[tuple[float, float]] = []  # wall clock
        self.calibrated = 0
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._stderr, daemon=True),
                         threading.Thread(target=self._stdout, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _stderr(self) -> None:
        for line in self.process.stderr:
            if ADMIT_LINE in line:
                self.admits.append(time.monotonic())
            elif ": error: " in line or "Traceback" in line:
                self.errors.append(line.strip())

    def _stdout(self) -> None:
        for line in self.process.stdout:
            record = json.loads(line)
            if "calibrated" in record:
                self.calibrated = record["calibrated"]
            else:
                self.bursts.append(tuple(record["burst"]))

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        for thread in self._threads:
            thread.join(10)
        return code


def inside(t: float, spans: list[tuple[float, float]]) -> bool:
    return any(start < t < end for start, end in spans)


def one_run(library: Path, bursts: int, gap: float) -> dict:
    socket_dir = Path(tempfile.mkdtemp(prefix="nvs-bursts-", dir="/tmp"))
    scheduler = SchedulerProcess(socket_dir, {"log_level": "info"})
    scheduler.start()
    env = dict(scheduler.env, LD_PRELOAD=str(library), NVSHARE_LOG="debug")
    try:
        first = Worker(env, bursts, gap)
        time.sleep(gap / 2)
        second = Worker(env, bursts, gap)
        timeout = bursts * (gap + 10) + 120
        codes = [first.wait(timeout), second.wait(timeout)]
        events = scheduler.events()
        clients = {registered_pid(event): event["client"] for event in events if event["kind"] == "register"}
    finally:
        scheduler.stop()
    workers = {"first": first, "second": second}
    out: dict = {"exit_codes": codes}
    for name, w in workers.items():
        other = second if w is first else first
        me, them = clients.get(w.process.pid), clients.get(other.process.pid)
        admits_first_second = sum(1 for t in w.admits if t - w.admits[0] <= 1.0) if w.admits else 0
        releases = [e for e in events if e["client"] == me and e["kind"] in ("release", "revoke")
                    and inside(e["t"], w.bursts)]
        overlaps = [e for e in events if e["client"] == them and e["kind"] == "grant" and inside(e["t"], w.bursts)]
        lengths = [round(end - start, 4) for start, end in w.bursts]
        out[name] = {
            "client": me,
            "calibrated_products": w.calibrated,
            "admits_first_second": admits_first_second,
            "admits": len(w.admits),
            "bursts_s": lengths,
            "mid_burst_releases": [f"{e['kind']} {e['detail']} at +{e['t'] - w.bursts[0][0]:.3f}s" for e in releases],
            "overlaps": len(overlaps),
            "errors": w.errors[:5],
            "targets": {
                "admits_first_second_at_most_10": admits_first_second <= 10,
                "no_mid_burst_release": not releases,
                "bursts_within_5_percent_of_1s": all(abs(length - BURST_S) <= 0.05 * BURST_S for length in lengths[1:]),
            },
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--gap", type=float, default=7.0, help="seconds between a worker's bursts")
    parser.add_argument("--out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        worker(args.bursts, args.gap)
        return
    library = benchmark_library(ROOT, Path(tempfile.mkdtemp(prefix="nvs-bursts-lib-", dir="/tmp")))
    runs = [one_run(library, args.bursts, args.gap) for _ in range(args.runs)]
    met = all(all(run[w]["targets"].values()) for run in runs for w in ("first", "second"))
    result = {"what": "two PyTorch processes bursting 1 s of 4096x4096 matrix products, "
                      f"{args.gap:g} s apart, under the scheduler's defaults (issue 20)",
              "runs": runs, "targets_met": met}
    print(f"{'run':>3} {'worker':>6} {'ADMITs 1st s':>12} {'ADMITs':>6} {'mid-burst rel.':>14} {'overlaps':>8}  bursts (s)")
    for number, run in enumerate(runs, 1):
        for name in ("first", "second"):
            w = run[name]
            print(f"{number:>3} {name:>6} {w['admits_first_second']:>12} {w['admits']:>6} "
                  f"{len(w['mid_burst_releases']):>14} {w['overlaps']:>8}  {' '.join(f'{s:.3f}' for s in w['bursts_s'])}")
    print("targets met" if met else "TARGETS MISSED")
    text = json.dumps(result, indent=2)
    out = args.out or (os.path.join(os.environ["OUT"], "admission-bursts.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
