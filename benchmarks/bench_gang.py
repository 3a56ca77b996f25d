"""Data-parallel jobs sharing GPUs under nvshare, with and without gangs (issue 19).

    python benchmarks/bench_gang.py --quick          # simulated driver, a few minutes
    python benchmarks/bench_gang.py                  # simulated driver, more steps
    python benchmarks/bench_gang.py --gpu            # two real GPUs: PyTorch + NCCL (issue 19's table)
    python benchmarks/bench_gang.py --random 40      # simulated: 40 randomized rounds, revocations counted

A job has two ranks, one per GPU, each a process; every step is compute followed by an
all-reduce that waits for the other rank (NCCL's, or the simulated driver's nvshare_allreduce,
which spins on the GPU until its partner's has run). Cases:
- `alone_native`, `alone_nvshare`: one job, without nvshare and under it (scheduler on);
- `sequential`: two jobs one after the other, without nvshare (the baseline);
- `together_native`: two jobs at once, without nvshare;
- `together_nvshare`: two jobs at once under nvshare, ranks in gangs (found from torchrun's
  variables, interceptor/gang.c);
- `together_nvshare_no_gangs`: the same with NVSHARE_GANG=none (each rank takes each GPU's
  lock on its own, as before gangs: the deadlock that only revocations break);
- `beside_single`: one job beside a single-GPU job on GPU 0 (matmuls only), under nvshare.

ARRIVAL: under nvshare, job a's rank 0 and job b's rank 1 start first, the other ranks once
those have registered and asked for their GPU: without gangs each first rank takes its GPU and
the deadlock is certain (started all at once it depends on who asks first: issue 19's run saw
23 revocations, some simulated runs none); with gangs they wait for their partners.

Makespan: from the first rank's first step to the last rank's end, from the ranks' own
CLOCK_MONOTONIC stamps. Revocations and grants come from the scheduler's timeline.

Simulated driver: tests/simcuda with residency modelled (so that processes on one simulated GPU
take turns on it, as on a real one), two GPUs; the jobs are simapp's `allreduce` loop. Real
GPUs (`--gpu`): each rank is `python -c` of WORKER below, torch.distributed initialised from
the environment (MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK/LOCAL_WORLD_SIZE, as
torchrun sets them), device LOCAL_RANK, backend NCCL; each step 20 matmuls of 4096x4096 and an
all-reduce of 64 MiB, 300 steps, then a checksum that must agree between ranks and runs. The
scheduler measures the GPUs through NVML; libnvshare.so is built from this tree.

RANDOM (`--random N`, issue 31): N rounds of two two-rank jobs on the simulated driver under
nvshare, each round drawn from `--seed`: steps of 1-5 compute kernels of 0.5-6 ms, each rank
pausing on the CPU between its launches at random (0-4 ms: so a quantum often ends after one
rank launched its all-reduce and before the other did), and in half of the rounds long CPU
phases after a step (40-150 ms, past an idle window of 50 ms: ranks pause within their gang's
turn); TQ 0.1-0.25 s, grace 1 s. Each round counts revocations, drops, the gang fences
(`gang-fence` events) and those that found a member behind. `--no-fence` runs the same rounds
with the collectives uncounted (NVSHARE_COLLECTIVES empty: the DROP closes each gate where it
finds it, as before the fence), for contrast.

Prints ONE JSON document on stdout: `summary.two_jobs` holds `sequential_s`, `nvshare_s`,
`revocations` (gangs) and `nvshare_no_gangs_s`, `no_gangs_revocations` (for contrast),
`native_together_s`, and the ratios; `results` holds every case. --out DIR also writes it to
DIR/gang-<sim|gpu>-<date>[-quick].json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nvshare_py.control import request  # noqa: E402
from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402
from nvshare_py.paths import ENV_SOCKET_DIR  # noqa: E402
from nvshare_py.testing.scheduler import SchedulerProcess, short_socket_dir  # noqa: E402
from nvshare_py.testing.simcuda import build_simcuda  # noqa: E402
from nvshare_py.timeline import detail_fields  # noqa: E402

SIM_DEVICES = 2
SIM_MEMORY = "1G"
SIM_TIMESLICE_US = 2000
JOB_TIMEOUT_S = 600.0

WORKER = r"""
import faulthandler, json, os, sys, time
import torch, torch.distributed as dist
if os.environ.get("BENCH_GANG_TRACE"):  # where each rank is, every few seconds (--keep)
    faulthandler.dump_traceback_later(float(os.environ["BENCH_GANG_TRACE"]), repeat=True)
steps, matmuls, n, reduce_mib = (int(a) for a in sys.argv[1:5])
local = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
torch.manual_seed(1234 + dist.get_rank())
a = torch.randn(n, n, device="cuda") / n ** 0.5
b = torch.randn(n, n, device="cuda")
grad = torch.ones(reduce_mib * 2 ** 20 // 4, device="cuda")
dist.all_reduce(grad)  # NCCL's communicator is up before the clock starts
torch.cuda.synchronize()
dist.barrier()
start = time.monotonic()
for step in range(steps):
    for _ in range(matmuls):
        b = a @ b
    grad.fill_(float(step % 7))
    dist.all_reduce(grad)
    torch.cuda.synchronize()  # a training step's loss.item()
end = time.monotonic()
checksum = float(grad[:1024].sum().item())
print(json.dumps({"rank": dist.get_rank(), "start": start, "end": end, "checksum": checksum}), flush=True)
dist.destroy_process_group()
"""

SINGLE = r"""
import json, sys, time
import torch
steps, matmuls, n = (int(a) for a in sys.argv[1:4])
a = torch.randn(n, n, device="cuda") / n ** 0.5
b = torch.randn(n, n, device="cuda")
torch.cuda.synchronize()
start = time.monotonic()
for step in range(steps):
    for _ in range(matmuls):
        b = a @ b
    torch.cuda.synchronize()
print(json.dumps({"rank": "single", "start": start, "end": time.monotonic(), "checksum": 0.0}), flush=True)
"""


def arrival(jobs: list[str]) -> list[tuple[int, str, int]]:
    """(job number, job, rank) in the order the ranks start (ARRIVAL): job i's rank i % 2
    first, then the others."""
    firsts = [(number, job, number % 2) for number, job in enumerate(jobs)]
    return firsts + [(number, job, 1 - number % 2) for number, job in enumerate(jobs)]


def waits(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per client: its devices, whether it ran in a gang, and the longest and median time from asking for a device (event
    `acquire`) to being granted it (`grant`), in seconds: the waits the wait bound is about."""
    asked: dict[tuple[str, str], float] = {}
    per_client: dict[str, dict[str, Any]] = {}
    in_gangs = {member for event in events if event["kind"] == "gang-turn"
                for member in detail_fields(event["detail"]).get("members", "").split(",")}
    for event in events:
        key = (event["client"], event["device"])
        if event["kind"] == "acquire":
            asked.setdefault(key, event["t"])
        elif event["kind"] == "grant" and key in asked:
            entry = per_client.setdefault(event["client"], {"devices": set(), "waits": []})
            entry["devices"].add(event["device"])
            entry["waits"].append(event["t"] - asked.pop(key))
    return {client: {"devices": sorted(entry["devices"]), "gang": client in in_gangs, "grants": len(entry["waits"]),
                     "max_wait_s": round(max(entry["waits"]), 3),
                     "median_wait_s": round(sorted(entry["waits"])[len(entry["waits"]) // 2], 3)}
            for client, entry in per_client.items()}


class Scheduler(SchedulerProcess):
    """The daemon on a fresh socket directory, started at once; what its timeline counts, and
    its log and timeline kept on request (--keep)."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(short_socket_dir(), options)
        self.env.pop("LD_PRELOAD", None)  # the daemon is no CUDA program
        self.start()
        self.events_seen: list[dict[str, Any]] = []

    def timeline(self) -> dict[str, int]:
        """Grants, revocations and drops with reason gang, from the daemon's events."""
        self.events_seen = self.events()
        kinds = [event["kind"] for event in self.events_seen]
        return {"grants": kinds.count("grant"), "revocations": kinds.count("revoke"),
                "drops": kinds.count("drop"), "waits": waits(self.events_seen)}

    def close(self, keep: Path | None = None) -> None:
        """Stop the daemon; with `keep`, its log and timeline go there first."""
        self.stop()
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.log_path, keep / "scheduler.log")
            (keep / "events.json").write_text(json.dumps(self.events_seen, indent=0))
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def run_ranks(commands: list[tuple[list[str], dict[str, str]]], timeout: float,
              scheduler: Scheduler | None = None, first: int = 0, keep: Path | None = None,
              asked: bool = True) -> dict[str, Any]:
    """Start the ranks; each prints JSON lines with start/end stamps (simapp's steps, or
    WORKER's one line). Makespan from the first start to the last end. Under a scheduler the
    `first` commands start alone and the rest once those have registered and (`asked`) asked for
    their GPU (see ARRIVAL). Each rank writes to files, not pipes: a rank whose pipe nobody read
    while the harness waited for another rank blocked in write() mid-step (simapp prints a line
    per step; 64 KiB of them is about 90 steps), its partner spun in the step's collective, and
    the run showed revocations and hangs that were the harness's."""
    outputs: list[tuple[Any, Any]] = []

    def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        outputs.append((out, err))
        return subprocess.Popen(argv, env=env, stdout=out, stderr=err, text=True, cwd="/")

    started = time.monotonic()
    staged = scheduler is not None and first > 0
    processes = [start(*command) for command in (commands[:first] if staged else commands)]
    if staged:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            clients = request(scheduler.paths, "status", timeout=10.0)["clients"]
            if sum(1 for client in clients if client["devices"] or not asked) >= first:
                break
            time.sleep(0.05)
        processes += [start(*command) for command in commands[first:]]
    lines, finished, errors = [], True, []
    for process, (out_file, err_file) in zip(processes, outputs):
        try:
            process.wait(timeout=max(1.0, started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            finished = False
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
        out_file.close()
        err_file.close()
        if process.returncode not in (0, None) and finished:
            errors.append(err[-2000:])
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"rank{len(lines)}.stderr").write_text(err)
        lines.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n---\n".join(errors))
    if not finished:
        return {"makespan_s": round(timeout, 3), "finished": False}
    first = min(line["start"] for rank in lines for line in rank if line.get("step") != "init")
    last = max(line["end"] for rank in lines for line in rank)
    correct = all(rank[-1].get("ok", True) for rank in lines)  # simapp's final check
    checksums = sorted({rank[-1]["checksum"] for rank in lines if "checksum" in rank[-1] and rank[-1]["rank"] != "single"})
    return {"makespan_s": round(last - first, 3), "finished": True, "correct": correct,
            **({"checksums": checksums} if checksums else {})}


class Simulated:
    """Ranks are simapp processes on the simulated driver (tests/simcuda)."""

    def __init__(self, work: Path, steps: int, compute_us: int, kernels: int) -> None:
        self.work = work
        self.sim = build_simcuda(REPO, work / "sim").lib_dir
        self.library = benchmark_library(REPO, work / "lib")
        self.steps, self.compute_us, self.kernels = steps, compute_us, kernels
        self.keep: Path | None = None  # where a case's logs go (--keep)
        self.timeout = JOB_TIMEOUT_S
        self.runs = 0

    def base_env(self, run: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LD_PRELOAD")}
        env.update(LD_LIBRARY_PATH=str(self.sim), SIMCUDA_DEVICES=str(SIM_DEVICES), SIMCUDA_MEMORY=SIM_MEMORY,
                   SIMCUDA_RESIDENCY_DIR=str(run), SIMCUDA_TIMESLICE_US=str(SIM_TIMESLICE_US), NVSHARE_LOG="error")
        return env

    def commands(self, run: Path, jobs: list[str], single: bool, env: dict[str, str]) -> list[tuple[list[str], dict[str, str]]]:
        out = []
        compute = ",".join([f"kernel:{self.compute_us}"] * self.kernels)
        for number, job, rank in arrival(jobs):
            rank_env = {**env, "CUDA_VISIBLE_DEVICES": str(rank),
                        "SIMCUDA_COLLECTIVE": f"2:{run / (job + '.collective')}",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + number), "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
            argv = [str(self.sim / "simapp"), "alloc:plain:1M",
                    f"repeat:{self.steps}:{compute},allreduce:0:{rank + 1}:1024,stream-sync", "check:0:3:1024"]
            out.append((argv, rank_env))
        if single:
            argv = [str(self.sim / "simapp"), "alloc:plain:1M", f"repeat:{self.steps}:{compute},stream-sync"]
            out.append((argv, {**env, "CUDA_VISIBLE_DEVICES": "0"}))
        return out

    def run(self, jobs: list[str], nvshare: Scheduler | None, single: bool = False, gangs: bool = True) -> dict[str, Any]:
        self.runs += 1
        run = self.work / f"run{self.runs}"
        run.mkdir()
        env = self.base_env(run)
        if nvshare is not None:
            # The simulated all-reduce counts as a collective (a gang's fence, interceptor/collective.c).
            env.update({ENV_SOCKET_DIR: str(nvshare.socket_dir)}, LD_PRELOAD=str(self.library),
                       NVSHARE_COLLECTIVES="nvshare_allreduce")
            if not gangs:
                env["NVSHARE_GANG"] = "none"
        result = run_ranks(self.commands(run, jobs, single, env), self.timeout, nvshare, first=len(jobs), keep=self.keep)
        shutil.rmtree(run, ignore_errors=True)
        return result


def random_rounds(work: Path, rounds: int, seed: int, fence: bool, say: Callable[[str], None],
                  timeout: float) -> dict[str, Any]:
    """RANDOM (the module's docstring): `rounds` rounds drawn from `seed`."""
    runner = Simulated(work, steps=1, compute_us=1000, kernels=1)
    rng = random.Random(seed)
    results = []

    def step(rng: random.Random) -> list[str]:
        parts = []
        for _ in range(rng.randint(1, 5)):
            parts.append(f"kernel:{rng.randint(500, 6000)}")
            if rng.random() < 0.5:
                parts.append(f"sleep:{rng.uniform(0, 4):.2f}")
        return parts

    for number in range(rounds):
        long_pauses = rng.random() < 0.5
        tq, steps = rng.choice([0.1, 0.15, 0.25]), rng.randint(20, 60) if long_pauses else rng.randint(40, 120)
        options = {"mode": "on", "tq": tq, "grace": 1.0, "idle_release": 0.05 if long_pauses else 0.3,
                   "heartbeat_interval": 0.2, "heartbeat_timeout": 10.0, "log_level": "warning"}
        scheduler = Scheduler(options)
        run = work / f"round{number}"
        run.mkdir()
        env = runner.base_env(run)
        env.update({ENV_SOCKET_DIR: str(scheduler.socket_dir)}, LD_PRELOAD=str(runner.library),
                   NVSHARE_COLLECTIVES="nvshare_allreduce" if fence else "")
        commands = []
        for job_number, job, rank in arrival(["a", "b"]):
            pause = [f"sleep:{rng.uniform(40, 150):.1f}"] if long_pauses and rng.random() < 0.5 else []
            rank_env = {**env, "CUDA_VISIBLE_DEVICES": str(rank), "SIMCUDA_COLLECTIVE": f"2:{run / (job + '.collective')}",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + job_number), "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
            body = ",".join(step(rng) + [f"allreduce:0:{rank + 1}:1024", "stream-sync"] + pause)
            commands.append(([str(runner.sim / "simapp"), "alloc:plain:1M", f"repeat:{steps}:{body}", "check:0:3:1024"],
                             rank_env))
        try:
            outcome = run_ranks(commands, timeout, scheduler, first=2)
            outcome.update(scheduler.timeline())
            fences = [detail_fields(e["detail"]) for e in scheduler.events_seen if e["kind"] == "gang-fence"]
        finally:
            scheduler.close()
            shutil.rmtree(run, ignore_errors=True)
        outcome.pop("waits", None)
        outcome.update(round=number, tq=tq, steps=steps, long_pauses=long_pauses, fences=len(fences),
                       fences_behind=sum(1 for f in fences if f.get("behind", "0") != "0"))
        results.append(outcome)
        say(f"round {number}: {outcome}")
    return {"rounds": results, "summary": {
        "rounds": rounds, "finished": sum(1 for r in results if r.get("finished")),
        "correct": sum(1 for r in results if r.get("correct")), "revocations": sum(r["revocations"] for r in results),
        "rounds_with_revocations": sum(1 for r in results if r["revocations"]), "drops": sum(r["drops"] for r in results),
        "fences": sum(r["fences"] for r in results), "fences_behind": sum(r["fences_behind"] for r in results),
        "makespan_s_total": round(sum(r["makespan_s"] for r in results), 3)}}


class RealGpus:
    """Ranks are PyTorch processes (WORKER) on two real GPUs."""

    def __init__(self, work: Path, steps: int, matmuls: int, n: int, reduce_mib: int) -> None:
        self.keep: Path | None = None  # where a case's logs go (--keep)
        self.timeout = JOB_TIMEOUT_S
        self.library = benchmark_library(REPO, work / "lib")
        self.args = [str(steps), str(matmuls), str(n), str(reduce_mib)]
        self.single_args = [str(steps), str(matmuls), str(n)]

    def run(self, jobs: list[str], nvshare: Scheduler | None, single: bool = False, gangs: bool = True) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LD_PRELOAD")}
        if nvshare is not None:
            env.update({ENV_SOCKET_DIR: str(nvshare.socket_dir)}, LD_PRELOAD=str(self.library),
                       NVSHARE_LOG="debug" if self.keep else "warn")
        if self.keep:
            env["BENCH_GANG_TRACE"] = "2"
            if not gangs:
                env["NVSHARE_GANG"] = "none"
        commands = []
        for number, _, rank in arrival(jobs):
            rank_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + number), "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
            commands.append(([sys.executable, "-c", WORKER, *self.args], rank_env))
        if single:
            commands.append(([sys.executable, "-c", SINGLE, *self.single_args], {**env, "CUDA_VISIBLE_DEVICES": "0"}))
        # A PyTorch rank registers at its first CUDA call, then waits in NCCL's rendezvous for its
        # partner before it uses the GPU: the others start once the first ones have registered.
        result = run_ranks(commands, self.timeout, nvshare, first=len(jobs), keep=self.keep, asked=False)
        result["correct"] = len(result.get("checksums", [0])) == 1  # every rank of every job agrees
        return result


CASES = ("alone_native", "alone_nvshare", "sequential", "together_native", "together_nvshare",
         "together_nvshare_no_gangs", "beside_single")


def measure(runner: Any, options: dict[str, Any], say: Callable[[str], None],
            cases: tuple[str, ...] = CASES) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def under_nvshare(name: str, jobs: list[str], **kwargs: Any) -> None:
        scheduler = Scheduler(options)
        keep = runner.keep
        runner.keep = None if keep is None else keep / name
        try:
            outcome = runner.run(jobs, scheduler, **kwargs)
            outcome.update(scheduler.timeline())
        finally:
            scheduler.close(runner.keep)
            runner.keep = keep
        results[name] = outcome
        say(f"{name}: {outcome}")

    if "alone_native" in cases:
        results["alone_native"] = runner.run(["a"], None)
        say(f"alone_native: {results['alone_native']}")
    if "alone_nvshare" in cases:
        under_nvshare("alone_nvshare", ["a"])
    if "sequential" in cases:
        first, second = runner.run(["a"], None), runner.run(["b"], None)
        results["sequential"] = {"makespan_s": round(first["makespan_s"] + second["makespan_s"], 3),
                                 "finished": first["finished"] and second["finished"],
                                 "correct": first.get("correct") and second.get("correct")}
        say(f"sequential: {results['sequential']}")
    if "together_native" in cases:
        results["together_native"] = runner.run(["a", "b"], None)
        say(f"together_native: {results['together_native']}")
    if "together_nvshare" in cases:
        under_nvshare("together_nvshare", ["a", "b"])
    if "together_nvshare_no_gangs" in cases:
        under_nvshare("together_nvshare_no_gangs", ["a", "b"], gangs=False)
    if "beside_single" in cases:
        under_nvshare("beside_single", ["a"], single=True)
    return results


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from the cases that ran (a figure whose cases did not run is None)."""
    def makespan(case: str) -> float | None:
        return results[case]["makespan_s"] if case in results else None

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return None if numerator is None or not denominator else round(numerator / denominator, 3)

    sequential, gang, no_gang = makespan("sequential"), makespan("together_nvshare"), makespan("together_nvshare_no_gangs")
    alone, alone_nvshare = makespan("alone_native"), makespan("alone_nvshare")
    beside = results.get("beside_single", {})
    return {
        "two_jobs": {
            "sequential_s": sequential,
            "nvshare_s": gang,
            "revocations": results.get("together_nvshare", {}).get("revocations"),
            "nvshare_to_sequential": ratio(gang, sequential),
            "nvshare_no_gangs_s": no_gang,
            "no_gangs_revocations": results.get("together_nvshare_no_gangs", {}).get("revocations"),
            "no_gangs_to_sequential": ratio(no_gang, sequential),
            "native_together_s": makespan("together_native"),
            "native_together_to_nvshare": ratio(makespan("together_native"), gang),
            "all_correct": all(r.get("correct", False) for r in results.values()),
        },
        "one_job": {"native_s": alone, "nvshare_s": alone_nvshare,
                    "overhead": None if alone is None or alone_nvshare is None else round(alone_nvshare / alone - 1, 4)},
        "beside_single": {"makespan_s": beside.get("makespan_s"), "finished": beside.get("finished"),
                          "revocations": beside.get("revocations"),
                          "single_waits": [w for w in beside.get("waits", {}).values() if not w["gang"]]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="two real GPUs, PyTorch + NCCL")
    parser.add_argument("--quick", action="store_true", help="fewer steps (simulated: a few minutes)")
    parser.add_argument("--tq", type=float, default=None, help="the scheduler's time quantum (s)")
    parser.add_argument("--steps", type=int, default=None, help="steps per rank (default: by --quick and --gpu)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here (a directory)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep each case under nvshare's scheduler log (info), timeline and ranks' stderr here")
    parser.add_argument("--job-timeout", type=float, default=JOB_TIMEOUT_S, help="a case's ranks are killed after this (s)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="the cases to run (default: all)")
    parser.add_argument("--random", type=int, default=0, metavar="ROUNDS", help="simulated: randomized rounds instead of the cases")
    parser.add_argument("--seed", type=int, default=31, help="of --random")
    parser.add_argument("--no-fence", action="store_true", help="--random with the collectives uncounted (no fence)")
    args = parser.parse_args()
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="bench-gang-"))
    try:
        if args.random:
            started = time.monotonic()
            document = {"benchmark": "bench_gang", "driver": "simulated", "random": args.random, "seed": args.seed,
                        "fence": not args.no_fence,
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                                    "load_average": os.getloadavg()},
                        **random_rounds(work, args.random, args.seed, not args.no_fence, say, args.job_timeout)}
            document["seconds"] = round(time.monotonic() - started, 1)
            text = json.dumps(document, indent=2)
            print(text)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                name = f"gang-random-sim-{datetime.date.today().isoformat()}{'-no-fence' if args.no_fence else ''}.json"
                (args.out / name).write_text(text + "\n")
            return
        if args.gpu:
            steps = args.steps or (60 if args.quick else 300)
            runner: Any = RealGpus(work, steps=steps, matmuls=20, n=4096, reduce_mib=64)
            tq = args.tq if args.tq is not None else 5.0
            config = {"steps": steps, "matmuls": 20, "n": 4096, "allreduce_mib": 64, "backend": "nccl"}
        else:
            steps = args.steps or (60 if args.quick else 200)
            runner = Simulated(work, steps=steps, compute_us=5000, kernels=4)
            tq = args.tq if args.tq is not None else 0.25
            config = {"steps": steps, "kernels_per_step": 4, "kernel_us": 5000, "devices": SIM_DEVICES,
                      "residency_timeslice_us": SIM_TIMESLICE_US}
        runner.keep, runner.timeout = args.keep, args.job_timeout
        options = {"mode": "on", "tq": tq, "grace": tq, "idle_release": 0.3, "heartbeat_interval": 0.2,
                   "heartbeat_timeout": 10.0, "log_level": "info" if args.keep else "warning"}
        started = time.monotonic()
        results = measure(runner, options, say, tuple(args.cases))
        document = {
            "benchmark": "bench_gang", "driver": "gpu" if args.gpu else "simulated", "quick": args.quick,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_average": os.getloadavg()},
            "config": config, "scheduler": options, "seconds": round(time.monotonic() - started, 1),
            "summary": summary(results), "results": results,
        }
        text = json.dumps(document, indent=2)
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            name = f"gang-{'gpu' if args.gpu else 'sim'}-{datetime.date.today().isoformat()}{'-quick' if args.quick else ''}.json"
            (args.out / name).write_text(text + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
