"""Cost of admission on the allocation path, on the simulated driver.

    python benchmarks/bench_admission.py [--out results.json] [--rounds 5] [--iterations 20000]

Builds the simulated driver, libnvshare.so and benchmarks/c/alloc_loop.c, starts two schedulers
(admission on with a large spill, and admission off), and alternates processes that time
cuMemAlloc_v2 + cuMemFree_v2 pairs under the interceptor:

- 4 KiB pairs: without a scheduler (admission not in force: the old path), with admission on
  (every pair stays within the admitted chunk: no message, one compare-and-swap more), and with
  admission off at the scheduler (the same path: the client still asks once per chunk);
- 1 GiB pairs with a 20 ms untimed pause after each: without a scheduler, and with admission
  on, where every allocation crosses the admitted total (during the pause the free before it
  gave the chunk back) and so waits for an ADMIT/ADMITTED round trip to the daemon: the price
  of asking, paid once per chunk in real programs.

Prints one JSON document: per variant the median over rounds of each round's median and p90
(ns per pair). The simulated driver's own allocation is an mmap: the figures are the
interceptor's bookkeeping, the round trip and a system call, not a real GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from bench_memory_limit import build  # noqa: E402  (the same three builds)

from nvshare_py.paths import CLIENT_SOCKET  # noqa: E402

SMALL, LARGE = 4096, 1 << 30
SETTLE_MS = "300"  # time to register before the timing starts (alloc_loop's third argument)
GIVE_BACK_PAUSE_US = "20000"  # after each 1 GiB pair: the give-back goes out (fourth argument)


def start_scheduler(socket_dir: Path, spill: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    daemon = subprocess.Popen([sys.executable, "-m", "nvshare_py.scheduler", "--socket-dir", str(socket_dir),
                               "--mode", "off", "--admission-spill", spill, "--log-level", "warning"],
                              env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (socket_dir / CLIENT_SOCKET).exists():
        if time.monotonic() > deadline or daemon.poll() is not None:
            raise SystemExit(f"the scheduler on {socket_dir} did not start")
        time.sleep(0.05)
    return daemon


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--round-trips", type=int, default=200, help="iterations of the 1 GiB variants")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nvs-admission-bench-", dir="/tmp"))
    sim, library, loop = build(work)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NVSHARE_", "SIMCUDA_", "CUDA_VISIBLE"))}
    base.update(LD_LIBRARY_PATH=str(sim), LD_PRELOAD=str(library), NVSHARE_FAIL_MODE="open", NVSHARE_LOG="error",
                SIMCUDA_MEMORY="64G")
    on, off, none = work / "on", work / "off", work / "none"
    daemons = [start_scheduler(on, str(1 << 40)), start_scheduler(off, "off")]
    variants = {
        "4 KiB, no scheduler": (none, SMALL, args.iterations, "0"),
        "4 KiB, admission on (within the chunk)": (on, SMALL, args.iterations, "0"),
        "4 KiB, admission off at the scheduler": (off, SMALL, args.iterations, "0"),
        "1 GiB, no scheduler": (none, LARGE, args.round_trips, GIVE_BACK_PAUSE_US),
        "1 GiB, admission on (a round trip each)": (on, LARGE, args.round_trips, GIVE_BACK_PAUSE_US),
    }
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    try:
        for _ in range(args.rounds):
            for name, (socket_dir, size, iterations, pause) in variants.items():  # alternated: drifts hit all
                env = {**base, "NVSHARE_SOCKET_DIR": str(socket_dir)}
                out = subprocess.run([str(loop), str(iterations), str(size), SETTLE_MS, pause], env=env,
                                     capture_output=True, text=True, check=True)
                rounds[name].append(json.loads(out.stdout))
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=30)
    result = {
        "what": "cuMemAlloc_v2 + cuMemFree_v2 (converted to managed) under libnvshare.so, simulated driver",
        "rounds": args.rounds,
        "load_average": os.getloadavg(),
        "variants": {
            name: {"median_ns": statistics.median(r["median_ns"] for r in runs),
                   "p90_ns": statistics.median(r["p90_ns"] for r in runs),
                   "iterations": runs[0]["iterations"]}
            for name, runs in rounds.items()
        },
    }
    v = result["variants"]
    result["admission_on_minus_no_scheduler_ns"] = (v["4 KiB, admission on (within the chunk)"]["median_ns"]
                                                    - v["4 KiB, no scheduler"]["median_ns"])
    result["round_trip_ns"] = (v["1 GiB, admission on (a round trip each)"]["median_ns"]
                               - v["1 GiB, no scheduler"]["median_ns"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
