"""Swap-out and swap-in bandwidth of a real lock handoff against bulk prefetch (issue 8 target:
at least 80 % of the bulk prefetch bandwidth measured in the same run).

    python benchmarks/gpu/bench_swap_bandwidth.py [--gib 8] [--rounds 3] [--out swap.json]

Real GPU only. Builds libnvshare.so from this tree with make (or uses $NVSHARE_LIBRARY). The
scheduler is a script in this process (a pyzmq ROUTER speaking docs/protocol.md), so that each
residency message goes out exactly when measured: one child process under the interceptor
allocates `--gib` GiB with cuMemAlloc (converted to managed memory) and writes all of it with a
kernel; then, per round:

- swap-out: DROP evict=<all> is sent; the time until its RELEASE (drain of an idle GPU, then the
  interceptor's bulk move to the host, synchronised) gives the swap-out bandwidth;
- swap-in: the process submits a kernel, which waits at the closed gate; GRANT prefetch=<all>
  is sent; the time until the kernel's launch returns (the gate opens after the prefetch) gives
  the swap-in bandwidth;
- bulk, in the same process while it holds the lock: cuMemPrefetchAsync of the buffer to the
  host and back on a stream of its own, each synchronised (the bandwidth to compare with), and
  a kernel over the buffer after it was moved to the host without a prefetch back (the
  fault-driven page-in that swapping replaces, for reference).

Safety rule: the buffer is at most a quarter of the device's free memory (one process; nothing
else is allocated). Prints a short table and one JSON document (also written to --out, or to
$OUT/swap_bandwidth.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this tree's nvshare_py and the tests' fixtures

from fixtures.interceptor import benchmark_library  # noqa: E402
from fixtures.scripted import ScriptedScheduler  # noqa: E402

GIB = 1 << 30
PATIENCE_MS = 120_000


# --- the child: one process under the interceptor ------------------------------------------


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def child(nbytes: int, rounds: int) -> None:
    from nvshare_py.driver import Driver

    cuda = Driver(via="dlsym")
    cuda.context(0)
    free, _ = cuda.mem_get_info()
    if nbytes > free // 4:
        raise SystemExit(f"{nbytes} bytes is more than a quarter of the free memory ({free}): lower --gib")
    library = ctypes.CDLL("libcuda.so.1")  # the interceptor's exported wrappers come first
    prefetch = library.cuMemPrefetchAsync_v2
    prefetch.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p]
    host, device = _Location(2, 0), _Location(1, 0)  # CU_MEM_LOCATION_TYPE_HOST, _DEVICE

    def say(*words) -> None:
        print(*words, f"t={time.monotonic():.6f}", flush=True)

    ptr = cuda.alloc(nbytes, "plain")
    words = nbytes // 4
    cuda.fill(ptr, 1, words)
    cuda.synchronize()
    stream = cuda.create_stream()

    def timed_move(where: _Location) -> float:
        start = time.perf_counter()
        code = prefetch(ptr, nbytes, where, 0, stream)
        if code != 0:
            raise SystemExit(f"cuMemPrefetchAsync_v2 failed ({code})")
        cuda.stream_synchronize(stream)
        return time.perf_counter() - start

    for round_ in range(rounds):
        say("resident", round_)
        sys.stdin.readline()              # the parent sends DROP evict= and waits for RELEASE
        cuda.fill(ptr, 2, words)          # waits at the gate until the GRANT's prefetch is done
        say("launched", round_)
        cuda.synchronize()
        out_s = timed_move(host)
        in_s = timed_move(device)
        timed_move(host)
        start = time.perf_counter()
        cuda.fill(ptr, 3, words)
        cuda.synchronize()
        fault_s = time.perf_counter() - start
        say("bulk", round_, f"out={out_s:.6f}", f"in={in_s:.6f}", f"fault={fault_s:.6f}")


# --- the parent: the scripted scheduler (tests/fixtures/scripted.py) and the measurement --------------------------------


def line_of(process: subprocess.Popen, prefix: str) -> tuple[list[str], float]:
    while True:
        line = process.stdout.readline()
        if not line:
            raise SystemExit(f"the process ended before {prefix!r}: {process.stderr.read()}")
        if line.startswith(prefix):
            words = line.split()
            return words, float(words[-1].split("=", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    nbytes = int(args.gib * GIB) // 4 * 4
    if args.child:
        child(nbytes, args.rounds)
        return

    library = benchmark_library(Path(tempfile.mkdtemp(prefix="nvs-swap-build-")))
    script = ScriptedScheduler(PATIENCE_MS)
    env = {**os.environ, **script.env, "LD_PRELOAD": str(library), "NVSHARE_LOG": "warn"}
    process = subprocess.Popen([sys.executable, __file__, "--child", "--gib", str(args.gib), "--rounds",
                                str(args.rounds)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    grant = 1
    rounds = []
    try:
        script.expect("ACQUIRE")
        script.send("GRANT", device=script.device, grant=grant, mode="on", exclusive=1, quantum_ms=600_000)
        for round_ in range(args.rounds):
            line_of(process, "resident")
            drop_sent = script.send("DROP", device=script.device, grant=grant, grace_ms=600_000, reason="quantum",
                                    evict=nbytes)
            release = script.expect("RELEASE")
            released = script.received
            process.stdin.write("\n")
            process.stdin.flush()
            script.expect("ACQUIRE")
            grant += 1
            grant_sent = script.send("GRANT", device=script.device, grant=grant, mode="on", exclusive=1,
                                     quantum_ms=600_000, prefetch=nbytes)
            _, launched = line_of(process, "launched")
            words, _ = line_of(process, "bulk")
            bulk = dict(word.split("=") for word in words[2:-1])
            rounds.append({"swap_out_s": released - drop_sent, "swap_in_s": launched - grant_sent,
                           "resident_after_release": int(release.get("resident", -1)),
                           "bulk_out_s": float(bulk["out"]), "bulk_in_s": float(bulk["in"]),
                           "fault_in_s": float(bulk["fault"])})
        if process.wait(timeout=PATIENCE_MS / 1000) != 0:
            raise SystemExit(f"the process failed: {process.stderr.read()}")
    finally:
        if process.poll() is None:
            process.kill()
        script.close()

    def gbps(seconds: list[float]) -> float:
        return nbytes / statistics.median(seconds) / 1e9

    summary = {
        "bytes": nbytes,
        "rounds": rounds,
        "swap_out_GBps": gbps([r["swap_out_s"] for r in rounds]),
        "swap_in_GBps": gbps([r["swap_in_s"] for r in rounds]),
        "bulk_out_GBps": gbps([r["bulk_out_s"] for r in rounds]),
        "bulk_in_GBps": gbps([r["bulk_in_s"] for r in rounds]),
        "fault_in_GBps": gbps([r["fault_in_s"] for r in rounds]),
    }
    summary["swap_out_vs_bulk"] = summary["swap_out_GBps"] / summary["bulk_out_GBps"]
    summary["swap_in_vs_bulk"] = summary["swap_in_GBps"] / summary["bulk_in_GBps"]
    summary["target_met"] = summary["swap_out_vs_bulk"] >= 0.8 and summary["swap_in_vs_bulk"] >= 0.8
    print(f"{'direction':<10}{'handoff GB/s':>14}{'bulk GB/s':>12}{'ratio':>8}", file=sys.stderr)
    for direction in ("out", "in"):
        print(f"{direction:<10}{summary[f'swap_{direction}_GBps']:>14.2f}{summary[f'bulk_{direction}_GBps']:>12.2f}"
              f"{summary[f'swap_{direction}_vs_bulk']:>8.2f}", file=sys.stderr)
    print(f"{'fault-in':<10}{summary['fault_in_GBps']:>14.2f}", file=sys.stderr)
    text = json.dumps(summary, indent=2)
    print(text)
    out = args.out or (Path(os.environ["OUT"]) / "swap_bandwidth.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
