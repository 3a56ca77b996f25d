"""Cost of NVSHARE_MEMORY_LIMIT on the allocation path, on the simulated driver.

    python benchmarks/bench_memory_limit.py [--out results.json] [--rounds 7] [--iterations 20000]

Builds the simulated driver (tests/simcuda), libnvshare.so and benchmarks/c/alloc_loop.c, then
alternates processes that time cuMemAlloc_v2 + cuMemFree_v2 pairs (4 KiB, converted to managed
memory) under the interceptor without a limit and with one that is never reached, and prints
one JSON document: per variant the median over rounds of each round's median and p90 (ns per
pair), and the difference. The simulated driver's own allocation is an mmap, so the figures are
the interceptor's bookkeeping plus a system call, not a real GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import build_interceptor  # noqa: E402
from nvshare_py.testing.simcuda import build_simcuda  # noqa: E402

VARIANTS = {"no limit": None, "limit never reached": "64G"}


def build(work: Path) -> tuple[Path, Path, Path]:
    sim = build_simcuda(ROOT, work / "sim").lib_dir
    library = build_interceptor(ROOT, work / "nvs")
    loop = work / "alloc_loop"
    subprocess.run(["cc", "-O2", "-o", str(loop), str(ROOT / "benchmarks/c/alloc_loop.c"), f"-L{sim}", "-l:libcuda.so.1"],
                   check=True)
    return sim, library, loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=20000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nvs-limit-bench-", dir="/tmp"))
    sim, library, loop = build(work)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NVSHARE_", "SIMCUDA_", "CUDA_VISIBLE"))}
    # No scheduler: allocations do not wait for the lock, and fail-open keeps the process running.
    base.update(LD_LIBRARY_PATH=str(sim), LD_PRELOAD=str(library), NVSHARE_FAIL_MODE="open",
                NVSHARE_SOCKET_DIR=str(work / "no-scheduler"), NVSHARE_LOG="error")
    rounds: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, limit in VARIANTS.items():  # alternated, so drifts in machine load hit both
            env = dict(base)
            if limit is not None:
                env["NVSHARE_MEMORY_LIMIT"] = limit
            out = subprocess.run([str(loop), str(args.iterations), "4096"], env=env, capture_output=True, text=True,
                                 check=True)
            rounds[name].append(json.loads(out.stdout))
    result = {
        "what": "cuMemAlloc_v2 + cuMemFree_v2 of 4 KiB (converted to managed) under libnvshare.so, simulated driver",
        "iterations_per_round": args.iterations,
        "rounds": args.rounds,
        "load_average": os.getloadavg(),
        "variants": {
            name: {"median_ns": statistics.median(r["median_ns"] for r in runs),
                   "p90_ns": statistics.median(r["p90_ns"] for r in runs)}
            for name, runs in rounds.items()
        },
    }
    none, limited = (result["variants"][name] for name in VARIANTS)
    result["limit_minus_no_limit_ns"] = {"median": limited["median_ns"] - none["median_ns"],
                                         "p90": limited["p90_ns"] - none["p90_ns"]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
