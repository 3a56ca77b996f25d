"""Overhead of nvshare on a real GPU, native vs under the interceptor with the lock held.

    python benchmarks/bench_overhead.py [--out results.json] [--rounds 5]

Builds benchmarks/gpu/launch_bench.cu with nvcc and libnvshare.so with make, starts a
scheduler, then alternates native and intercepted runs of
- the launch-bound loop (empty kernels through the CUDA runtime) and allocation latency,
- an end-to-end PyTorch training loop (benchmarks/gpu/train_bench.py),
and prints one JSON document (medians of the rounds and the overhead in percent).
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


def run_json(argv: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{argv} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def overhead(native: float, shared: float) -> float:
    return round((shared / native - 1.0) * 100.0, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-rounds", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nvs-bench-", dir="/tmp"))
    subprocess.run(["nvcc", "-O2", "-o", str(work / "launch_bench"), str(ROOT / "benchmarks/gpu/launch_bench.cu")],
                   check=True)
    subprocess.run(["make", "-s", "-C", str(ROOT / "interceptor"), f"BUILD={work}"], check=True)
    socket_dir = work / "s"
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=python_path, NVSHARE_SOCKET_DIR=str(socket_dir))
    scheduler_log = open(work / "scheduler.log", "wb")
    scheduler = subprocess.Popen([sys.executable, "-m", "nvshare_py.scheduler", "--socket-dir", str(socket_dir)],
                                 env=env, stdout=scheduler_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (socket_dir / "client" / "scheduler.sock").exists():
            if time.monotonic() > deadline or scheduler.poll() is not None:
                raise SystemExit("the scheduler did not start:\n" + (work / "scheduler.log").read_text())
            time.sleep(0.1)
        shared_env = dict(env, LD_PRELOAD=str(work / "libnvshare.so"))
        launch = {"native": [], "nvshare": []}
        for _ in range(args.rounds):
            launch["native"].append(run_json([str(work / "launch_bench")], env))
            launch["nvshare"].append(run_json([str(work / "launch_bench")], shared_env))
        train = {"native": [], "nvshare": []}
        for _ in range(args.train_rounds):
            train["native"].append(run_json([sys.executable, str(ROOT / "benchmarks/gpu/train_bench.py")], env))
            train["nvshare"].append(run_json([sys.executable, str(ROOT / "benchmarks/gpu/train_bench.py")], shared_env))
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=30)

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    result = {"gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip(),
              "launch": {}, "alloc": {}, "train": {}, "raw": {"launch": launch, "train": train}}
    for key in ("launch_ns_median", "launch_ns_min"):
        native, shared = median(launch["native"], key), median(launch["nvshare"], key)
        result["launch"][key] = {"native": native, "nvshare": shared, "overhead_pct": overhead(native, shared)}
    for key in ("alloc_1MiB_ns", "free_1MiB_ns", "alloc_256MiB_ns", "free_256MiB_ns"):
        result["alloc"][key] = {"native": median(launch["native"], key), "nvshare": median(launch["nvshare"], key)}
    native, shared = median(train["native"], "step_ms_median"), median(train["nvshare"], "step_ms_median")
    result["train"] = {"step_ms_native": native, "step_ms_nvshare": shared, "overhead_pct": overhead(native, shared)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    print(f"launch: native {result['launch']['launch_ns_median']['native']:.0f} ns, nvshare "
          f"{result['launch']['launch_ns_median']['nvshare']:.0f} ns ({result['launch']['launch_ns_median']['overhead_pct']:+.2f} %); "
          f"train step: native {native:.2f} ms, nvshare {shared:.2f} ms ({result['train']['overhead_pct']:+.2f} %)")


if __name__ == "__main__":
    main()
