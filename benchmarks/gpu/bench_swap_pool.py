"""Processes of one user swapping through one shared swap pool (issue 29) during real handoffs:
what joining the pool costs, how fast memory moves through its segments, whether it comes back
intact, and how much pinned memory the pool holds against what is out at most.

    python benchmarks/gpu/bench_swap_pool.py [--gib 8] [--processes 2] [--rounds 2] [--out FILE]
    python benchmarks/gpu/bench_swap_pool.py --quick    # the simulated driver (tests/simcuda)

Builds libnvshare.so from this tree. Each process (bench_swap_bandwidth.py's child: `--gib` of
cuMemAlloc memory, converted to managed memory, written with a new value each round and checked
at 1,024 words after each swap-in) has a scheduler of its own, a script in this process, so that
each message goes out exactly when measured. All processes are started and granted; each is told
`POOL bytes=<--gib>` (the pool holds one process's memory: each can move all of it, one at a
time) and the time until its `MEMORY area=` says it can use all of it is its join time (the first
makes the segments, the others register them). Then, round after round, each process in turn is
sent `DROP evict=<all>` (out: until its RELEASE) and `GRANT prefetch=<all>` (in: until its first
read after the gate returns), through the same segments. The pool's files are summed after every
move: the pinned memory for swapping, against the most that was out at once (`--gib`; target: at
most 1.2 times). The processes' debug logs give each segment's making and registering times.

Prints a short summary (stderr) and one JSON document (stdout), also written to --out, else to
$OUT/swap_pool.json when $OUT is set, else (with --quick) to
benchmarks/results/swap-pool-<date>-quick.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_swap_bandwidth import GIB, MIB, PATIENCE_MS, SIM_COST_SCALE, gbps, line_of  # noqa: E402

from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402
from nvshare_py.testing.scripted import ScriptedScheduler  # noqa: E402

CHILD = Path(__file__).resolve().parent / "bench_swap_bandwidth.py"
POOL_TARGET = 1.2  # the pool's pinned bytes against the most that was out at once


def pool_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("segment-*")) if directory.is_dir() else 0


class Member:
    """One process under the interceptor with its scripted scheduler."""

    def __init__(self, index: int, nbytes: int, rounds: int, env: dict[str, str], logs: Path) -> None:
        self.script = ScriptedScheduler(PATIENCE_MS)
        self.log = open(logs / f"process-{index}.log", "w+")
        self.process = subprocess.Popen([sys.executable, str(CHILD), "--child", "converted", str(nbytes), str(rounds)],
                                        env={**env, **self.script.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True)
        self.process.stderr = self.log  # line_of reads it back on failure
        self.grant = 1
        self.script.expect("ACQUIRE")
        self.script.send("GRANT", device=self.script.device, grant=1, mode="on", exclusive=1, quantum_ms=600_000)
        line_of(self.process, "resident")

    def area_at_least(self, nbytes: int) -> None:
        while int(self.script.expect("MEMORY").get("area", 0)) < nbytes:
            pass

    def turn(self, nbytes: int, first: bool) -> dict:
        """Its memory out and back; the times and whether it is intact."""
        if not first:
            line_of(self.process, "resident")
        sent = self.script.send("DROP", device=self.script.device, grant=self.grant, grace_ms=600_000,
                                reason="quantum", evict=nbytes)
        release = self.script.expect("RELEASE")
        out_s = self.script.received - sent
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        self.script.expect("ACQUIRE")
        self.grant += 1
        sent = self.script.send("GRANT", device=self.script.device, grant=self.grant, mode="on", exclusive=1,
                                quantum_ms=600_000, prefetch=nbytes)
        _, back = line_of(self.process, "back")
        checked, _ = line_of(self.process, "checked")
        return {"out_s": round(out_s, 4), "in_s": round(back - sent, 4), "out_GBps": gbps(nbytes, out_s),
                "in_GBps": gbps(nbytes, back - sent), "resident_after_release": int(release.get("resident", -1)),
                "intact": checked["intact"] == "1"}

    def finish(self) -> str:
        """Ends it (its exit leaves the pool); its log."""
        self.process.stdin.close()
        code = self.process.wait(timeout=PATIENCE_MS / 1000)
        self.log.seek(0)
        text = self.log.read()
        self.script.close()
        if code != 0:
            raise SystemExit(f"a process failed ({code}): {text[-3000:]}")
        return text


def segment_times(logs: list[str]) -> dict:
    """Seconds per GiB to make a segment present and register it (its maker) and to register one
    another process made, from the debug logs."""
    made = [(int(b), float(p), float(r)) for log in logs for b, p, r in re.findall(
        r"swap pool: made segment-\d+ \((\d+) bytes present in ([\d.]+) s, registered in ([\d.]+) s\)", log)]
    registered = [(int(b), float(s)) for log in logs for b, s in re.findall(
        r"swap pool: registered segment-\d+ \((\d+) bytes\) in ([\d.]+) s", log)]

    def per_gib(pairs: list[tuple[int, float]]) -> float | None:
        total = sum(b for b, _ in pairs)
        return round(sum(s for _, s in pairs) / (total / GIB), 3) if total else None

    return {"segments_made": len(made), "present_s_per_gib": per_gib([(b, p) for b, p, _ in made]),
            "maker_register_s_per_gib": per_gib([(b, r) for b, _, r in made]),
            "segments_registered_by_others": len(registered), "other_register_s_per_gib": per_gib(registered)}


def measure(nbytes: int, processes: int, rounds: int, env: dict[str, str], shm: Path, logs: Path) -> dict:
    pool = shm / f"nvshare-pool-{os.geteuid()}"
    members: list[Member] = []
    try:
        joins = []
        for index in range(processes):
            members.append(Member(index, nbytes, rounds, env, logs))
            sent = members[-1].script.send("POOL", bytes=nbytes)
            members[-1].area_at_least(nbytes)
            joins.append(round(members[-1].script.received - sent, 3))
        pinned = [pool_bytes(pool)]
        moves = []
        for round_ in range(rounds):
            for index, member in enumerate(members):
                moves.append({"round": round_, "process": index, **member.turn(nbytes, first=round_ == 0)})
                pinned.append(pool_bytes(pool))
        texts = [member.finish() for member in members]
    finally:
        for member in members:
            if member.process.poll() is None:
                member.process.kill()
    warnings = [line for text in texts for line in text.splitlines() if "warning" in line]
    return {"bytes": nbytes, "processes": processes, "rounds": rounds, "join_s": joins, "moves": moves,
            "intact": all(m["intact"] for m in moves), "pool_bytes_max": max(pinned),
            "pool_vs_most_out": round(max(pinned) / nbytes, 3), "pool_target_met": max(pinned) <= POOL_TARGET * nbytes,
            "pool_removed_at_exit": not pool.exists(), **segment_times(texts), "warnings": warnings}


def summary(result: dict) -> str:
    lines = [f"{result['processes']} processes x {result['bytes'] / GIB:g} GiB, pool {result['pool_bytes_max'] / GIB:g}"
             f" GiB ({result['pool_vs_most_out']} x the most out; target {POOL_TARGET}), joins {result['join_s']} s"]
    for m in result["moves"]:
        lines.append(f"  round {m['round']} process {m['process']}: out {m['out_GBps']} GB/s, in {m['in_GBps']} GB/s, "
                     f"intact {m['intact']}")
    lines.append(f"  segments made {result['segments_made']} (present {result['present_s_per_gib']} s/GiB, registered "
                 f"{result['maker_register_s_per_gib']} s/GiB), registered by the others "
                 f"{result['segments_registered_by_others']} ({result['other_register_s_per_gib']} s/GiB); pool removed "
                 f"at exit {result['pool_removed_at_exit']}; warnings {len(result['warnings'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the simulated driver, 256 MiB, segments of 64 MiB")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nvs-swap-pool-"))
    shm = Path(tempfile.mkdtemp(prefix="nvs-swap-pool-", dir="/dev/shm"))
    env = dict(os.environ)
    if args.quick:
        from nvshare_py.testing.simcuda import build_simcuda

        args.gib = 0.25
        (work / "machine").mkdir()
        env = build_simcuda(ROOT, work / "sim").env(memory="2G", SIMCUDA_RESIDENCY_DIR=str(work / "machine"),
                                                    SIMCUDA_COST_SCALE=str(SIM_COST_SCALE),
                                                    NVSHARE_POOL_SEGMENT="64M")
    nbytes = int(args.gib * GIB) // (2 * MIB) * (2 * MIB)
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "swap_pool.json"
    if out is None and args.quick:
        out = ROOT / "benchmarks" / "results" / f"swap-pool-{datetime.date.today().isoformat()}-quick.json"
    logs = Path(os.environ.get("NVSHARE_BENCH_LOGS") or work / "logs")
    logs.mkdir(parents=True, exist_ok=True)
    env.update(LD_PRELOAD=str(benchmark_library(ROOT, work / "lib")), NVSHARE_LOG="debug", NVSHARE_POOL_DIR=str(shm))
    started = time.monotonic()
    document = {"benchmark": "swap-pool", "quick": args.quick, "date": datetime.date.today().isoformat(),
                "shm": shutil.disk_usage("/dev/shm")._asdict()}
    try:
        document.update(measure(nbytes, args.processes, args.rounds, env, shm, logs))
    except (Exception, SystemExit) as failure:  # recorded: the logs of the processes say more
        document["error"] = f"{type(failure).__name__}: {failure}"
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    document["elapsed_s"] = round(time.monotonic() - started, 1)
    print(document.get("error") or summary(document), file=sys.stderr)
    text = json.dumps(document, indent=1)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
