"""Weighted GPU time on a real GPU (issue 9): three busy PyTorch processes under nvshare with
weights 1:2:4, measured in the seed paper's own terms (formula 5: over each window of ΔT = 60 s,
|a client's share - its configured share| <= δ = 3 percentage points).

    python benchmarks/gpu/bench_fairness.py [--windows 2] [--tq 1] [--out fairness.json]

Real GPU only; finishes in about 2.5 minutes with the defaults (warm-up + 2 windows of 60 s).
Builds libnvshare.so from this tree with make (or uses $NVSHARE_LIBRARY), starts a scheduler
(nvshare_py/testing/scheduler.py's SchedulerProcess; --tq 1, --min-quantum 0.1, early release off: the quanta are 0.25, 0.5 and 1 s, so a
window's edge cuts at most 1 s of one client's turn, under 2 points of 60 s), starts three worker processes under LD_PRELOAD
that each keep the GPU busy with bf16 matrix products (about 100 MiB each: far below any card's
free memory, so the safety rule holds), sets their weights with `nvsharectl set-weight`, and
reads the scheduler's lock timeline (`events`) and status afterwards.

For each window and client it reports
- `share`: the client's part of the time the lock was held in the window (the weighted-quanta
  guarantee; formula 5's measure with lock time as the utilisation),
- `utilisation`: its held time / the window's length (handoffs, when nobody holds, count for
  nobody),
- `configured`: weight / sum of weights,
and whether |share - configured| <= δ. Prints a short table and writes the JSON document to
--out, or to $OUT/fairness.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402
from nvshare_py.testing.scheduler import SchedulerProcess  # noqa: E402

WEIGHTS = (1, 2, 4)
WINDOW = 60.0
DELTA = 0.03


def work_loop(size: int) -> None:
    """A worker (run with --child): bf16 matrix products in short synchronised bursts until killed."""
    import torch

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print("ready", flush=True)
    while True:
        for _ in range(8):
            a = (a @ b).clamp_(-1, 1)
        torch.cuda.synchronize()


def held_in(events: list[dict], start: float, end: float) -> dict[str, float]:
    """Seconds each client held the lock within [start, end] (wall clock), from the timeline."""
    open_holds: dict[int, tuple[str, float]] = {}
    held: dict[str, float] = {}
    for event in events:
        if event["kind"] == "grant":
            open_holds[event["grant"]] = (event["client"], event["t"])
        elif event["kind"] in ("release", "revoke", "lost", "unregister") and event.get("grant") in open_holds:
            client, since = open_holds.pop(event["grant"])
            held[client] = held.get(client, 0.0) + max(0.0, min(event["t"], end) - max(since, start))
    for client, since in open_holds.values():
        held[client] = held.get(client, 0.0) + max(0.0, end - max(since, start))
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2, help="60 s windows measured after the warm-up")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of contention before the first window")
    parser.add_argument("--tq", type=float, default=1.0, help="the scheduler's time quantum (the heaviest client's quantum)")
    parser.add_argument("--min-quantum", type=float, default=0.1)
    parser.add_argument("--size", type=int, default=4096, help="matrix size of the workers' products")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        work_loop(args.size)
        return
    out_path = args.out or (Path(os.environ["OUT"]) / "fairness.json" if os.environ.get("OUT") else None)

    work = Path(tempfile.mkdtemp(prefix="nvs-fair-", dir="/tmp"))
    preload = benchmark_library(ROOT, work)
    scheduler = SchedulerProcess(work / "s", {"tq": args.tq, "min_quantum": args.min_quantum, "idle_release": 0,
                                              "log_level": "info"})
    base = dict(scheduler.env)
    base.pop("LD_PRELOAD", None)
    base["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the safety rule, should a framework be imported
    workers: list[subprocess.Popen] = []

    def ctl(*argv: str) -> str:
        done = scheduler.ctl(*argv)
        if done.returncode != 0:
            raise SystemExit(f"nvsharectl {' '.join(argv)} failed: {done.stderr}")
        return done.stdout

    (work / "s").mkdir()
    scheduler.start()
    try:
        worker_env = dict(base, LD_PRELOAD=str(preload))
        for _ in WEIGHTS:
            workers.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", "--size",
                                             str(args.size)], env=worker_env, stdout=subprocess.PIPE, text=True))
        for worker in workers:
            if worker.stdout.readline().strip() != "ready":
                raise SystemExit(f"a worker failed to start (exit {worker.wait()})")
        # Who is who: the registration of each worker's pid, once it has used the GPU.
        deadline = time.monotonic() + 60
        while True:
            status = json.loads(ctl("status", "--json"))
            by_pid = {c["host_pid"]: c for c in status["clients"] if c["devices"]}
            if all(w.pid in by_pid for w in workers):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"workers not registered: {status['clients']}")
            time.sleep(0.2)
        clients = {by_pid[w.pid]["client"]: weight for w, weight in zip(workers, WEIGHTS)}
        for client, weight in clients.items():
            ctl("set-weight", str(weight), "--client", client)
        device = next(iter(by_pid[workers[0].pid]["devices"]))
        print(f"weights {clients} on {device}; warm-up {args.warmup:g} s, then {args.windows} x {WINDOW:g} s",
              file=sys.stderr, flush=True)
        time.sleep(args.warmup)
        start = time.time()
        status_shares = []
        for k in range(args.windows):
            time.sleep(max(0.0, start + (k + 1) * WINDOW - time.time()))
            status = json.loads(ctl("status", "--json"))
            status_shares.append({c["client"]: c["devices"].get(device, {}).get("achieved")
                                  for c in status["clients"] if c["client"] in clients})
        events = json.loads(ctl("events", "--json"))["events"]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
        scheduler.stop()

    total_weight = sum(clients.values())
    windows = []
    for k in range(args.windows):
        w_start, w_end = start + k * WINDOW, start + (k + 1) * WINDOW
        held = held_in(events, w_start, w_end)
        held_total = sum(held.get(c, 0.0) for c in clients)
        rows = {}
        for client, weight in clients.items():
            share = held.get(client, 0.0) / held_total if held_total else 0.0
            configured = weight / total_weight
            rows[client] = {"weight": weight, "configured": round(configured, 4), "share": round(share, 4),
                            "utilisation": round(held.get(client, 0.0) / WINDOW, 4),
                            "status_achieved": status_shares[k].get(client),
                            "within_delta": abs(share - configured) <= DELTA}
        grants = sum(1 for e in events if e["kind"] == "grant" and w_start <= e["t"] < w_end)
        windows.append({"window": k, "held_s": round(held_total, 3), "grants": grants, "clients": rows})
    document = {
        "benchmark": "fairness", "formula": "paper formula 5, delta 3 points, window 60 s",
        "settings": {"tq": args.tq, "min_quantum": args.min_quantum, "weights": list(WEIGHTS), "size": args.size,
                     "warmup": args.warmup},
        "gpu": _gpu_name(), "windows": windows,
        "met": all(row["within_delta"] for window in windows for row in window["clients"].values()),
    }
    print(f"{'window':>6} {'client':>6} {'weight':>6} {'configured':>10} {'share':>8} {'utilisation':>11} {'ok':>3}")
    for window in windows:
        for client, row in window["clients"].items():
            print(f"{window['window']:>6} {client:>6} {row['weight']:>6} {row['configured'] * 100:9.1f}% "
                  f"{row['share'] * 100:7.1f}% {row['utilisation'] * 100:10.1f}% {'yes' if row['within_delta'] else 'NO':>3}")
    print(f"formula 5 with delta {DELTA * 100:g} points met: {document['met']}")
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {out_path}")


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    main()
