"""What the IPython extension costs a notebook cell (nvshare_py.ipython, docs/notebooks.md).

    pip install '.[jupyter]'    # the kernels are driven through jupyter_client
    python benchmarks/bench_notebook_cells.py [--cells N] [--output FILE]

Runs the real scheduler and real kernels from the "Python 3 (nvshare)" kernelspec on the
simulated driver (both built here with make), each kernel registered with the scheduler (it
allocated GPU memory). Measured:

- hooks: the extension's pre_run_cell + post_run_cell, timed inside the kernel (what the
  notes after cells add to every cell): with a scheduler (one non-blocking QUERY before, one
  more and both answers after), and with no scheduler socket (a stat, nothing else);
- cell round trip: an empty cell, executed through jupyter_client, in a kernel with notes on,
  the same kernel with `%nvshare note off`, and a kernel of a kernelspec installed with
  `--no-extension`; interleaved, so that drift of the machine hits all three alike.

Prints JSON and writes benchmarks/results/notebook-cells-<date>.json.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import build_interceptor  # noqa: E402
from nvshare_py.testing.notebook import SETUP, Kernel  # noqa: E402
from nvshare_py.testing.scheduler import DEFAULT_OPTIONS, SchedulerProcess, child_env, short_socket_dir  # noqa: E402
from nvshare_py.testing.simcuda import build_simcuda  # noqa: E402

HOOK_TIMING = """
import time
extension = get_ipython().magics_manager.registry["NvshareMagics"].extension
extension.note_seconds = 1.0
samples = []
for _ in range({cells}):
    started = time.perf_counter()
    extension.pre_run_cell()
    extension.post_run_cell()
    samples.append(time.perf_counter() - started)
print(samples)
"""


def summary_us(samples: list[float]) -> dict:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50_us": round(statistics.median(ordered) * 1e6, 1),
            "p90_us": round(pick(0.90) * 1e6, 1), "p99_us": round(pick(0.99) * 1e6, 1),
            "max_us": round(ordered[-1] * 1e6, 1)}


def install(prefix: Path, library: Path, *extra: str) -> None:
    run = subprocess.run([sys.executable, "-m", "nvshare_py.jupyter", "install", "--prefix", str(prefix), *extra],
                         env=child_env(extra={"NVSHARE_LIBRARY": str(library)}), capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"nvshare-jupyter install failed:\n{run.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=500)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="nvs-bench-nb-"))
    socket_dir = short_socket_dir()
    os.environ["JUPYTER_RUNTIME_DIR"] = str(work / "runtime")
    scheduler = SchedulerProcess(socket_dir, {**DEFAULT_OPTIONS, "log_level": "info", "idle_release": 1.0})
    kernels: list[Kernel] = []
    try:
        library = build_interceptor(REPO, work)
        simcuda = build_simcuda(REPO, work)
        scheduler.start()
        prefix = work / "jupyter"
        install(prefix, library)
        install(prefix, library, "--name", "plain", "--no-extension")
        spec_dir = str(prefix / "share" / "jupyter" / "kernels")

        def start(name: str, **env: str) -> Kernel:
            kernel = Kernel(spec_dir, name, simcuda.env(**{"NVSHARE_SOCKET_DIR": str(socket_dir), **env}))
            kernels.append(kernel)
            kernel.client.wait_for_ready(timeout=120)
            kernel.run(SETUP)  # registered with the scheduler, 64 MiB reported
            return kernel

        noted = start("nvshare")
        plain = start("plain")
        lonely = start("nvshare", NVSHARE_SOCKET_DIR=str(work / "no-scheduler"), NVSHARE_FAIL_MODE="open")

        def hooks(kernel: Kernel) -> dict:
            return summary_us(ast.literal_eval(kernel.run(HOOK_TIMING.format(cells=args.cells)).stdout))

        results = {"hooks_with_scheduler": hooks(noted), "hooks_without_scheduler_socket": hooks(lonely)}

        muted = start("nvshare")
        muted.run("%nvshare note off")
        round_trips: dict[str, list[float]] = {"notes_on": [], "notes_off": [], "no_extension": []}
        for _ in range(args.cells):
            for label, kernel in (("notes_on", noted), ("notes_off", muted), ("no_extension", plain)):
                started = time.perf_counter()
                kernel.run("pass")
                round_trips[label].append(time.perf_counter() - started)
        results["empty_cell_round_trip"] = {label: summary_us(samples) for label, samples in round_trips.items()}
    finally:
        for kernel in kernels:
            kernel.shutdown()
        scheduler.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(socket_dir, ignore_errors=True)

    document = {
        "benchmark": "notebook-cells",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "cells": args.cells,
        "results": results,
    }
    text = json.dumps(document, indent=2)
    print(text)
    output = args.output or REPO / "benchmarks" / "results" / f"notebook-cells-{document['date']}.json"
    output.write_text(text + "\n")


if __name__ == "__main__":
    main()
