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
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import build_interceptor  # noqa: E402
from nvshare_py.testing.scheduler import SchedulerProcess  # noqa: E402


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
    parser.add_argument("--parts", nargs="+", choices=("launch", "train"), default=("launch", "train"))
    parser.add_argument("--rounds", type=int, default=5, help="launch-loop processes per variant")
    parser.add_argument("--train-rounds", type=int, default=5, help="training processes per variant")
    parser.add_argument("--gate-only", action="store_true",
                        help="also measure NVSHARE_MANAGED=0 (the lock gate without memory conversion)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nvs-bench-", dir="/tmp"))
    if "launch" in args.parts:
        subprocess.run(["nvcc", "-O2", "-o", str(work / "launch_bench"), str(ROOT / "benchmarks/gpu/launch_bench.cu")],
                       check=True)
    library = build_interceptor(ROOT, work)
    (work / "s").mkdir()
    scheduler = SchedulerProcess(work / "s", {"log_level": "info"})
    env = scheduler.env
    variants = {"native": env, "nvshare": dict(env, LD_PRELOAD=str(library))}
    if args.gate_only:
        variants["nvshare-gate-only"] = dict(variants["nvshare"], NVSHARE_MANAGED="0")
    commands = {"launch": ([str(work / "launch_bench")], args.rounds, ("launch_ns_median", "alloc_1MiB_ns",
                                                                       "free_1MiB_ns", "alloc_256MiB_ns", "free_256MiB_ns")),
                "train": ([sys.executable, str(ROOT / "benchmarks/gpu/train_bench.py")], args.train_rounds,
                          ("step_ms_median",))}
    raw: dict[str, dict[str, list[dict]]] = {}
    scheduler.start()
    try:
        for part in args.parts:
            argv, rounds, _ = commands[part]
            raw[part] = {name: [] for name in variants}
            for _ in range(rounds):  # variants interleaved, so drifts of the machine hit all alike
                for name, variant_env in variants.items():
                    raw[part][name].append(run_json(argv, variant_env))
    finally:
        scheduler.stop()

    result = {"gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip(), "raw": raw}
    for part in args.parts:
        for key in commands[part][2]:
            medians = {name: statistics.median(r[key] for r in runs) for name, runs in raw[part].items()}
            result.setdefault(part, {})[key] = {
                **medians, **{f"{name}_overhead_pct": overhead(medians["native"], value)
                              for name, value in medians.items() if name != "native"}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    for part, key in (("launch", "launch_ns_median"), ("train", "step_ms_median")):
        if part in result:
            print(f"{part} {key}: " + ", ".join(f"{name} {value:.4g}" if not name.endswith("pct") else f"{name} {value:+.2f} %"
                                                 for name, value in result[part][key].items()))


if __name__ == "__main__":
    main()
