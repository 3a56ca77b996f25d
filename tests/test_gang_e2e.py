"""Gangs end to end (issue 19): data-parallel jobs of two ranks, each rank a simapp process on
its own simulated GPU under libnvshare.so, joined every step by a collective
(tests/simcuda's nvshare_allreduce, which spins on the GPU until its partner's matching one has
run, as NCCL's does), with the real scheduler daemon.

Without gangs two such jobs deadlock on the locks (each holds one GPU and spins for its
partner, who waits for the other GPU) and progress only through revocations; with gangs each
job is granted both GPUs at once and they take turns without one. The ranks find their gang
from torchrun's variables (interceptor/gang.c); NVSHARE_GANG=none is the gang-less path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fixtures.scheduler import PATIENCE, wait_for

DEVICES = ["GPU-5151ad00-0000-4000-8000-000000000000", "GPU-5151ad00-0000-4000-8000-000000000001"]
STEPS = 20
COMPUTE_US = 8000  # two compute kernels per step, then the all-reduce
# Quanta short enough that a job cannot finish inside one, so that the jobs must take turns.
TIMINGS = {"tq": 0.25, "grace": 0.25, "idle_release": 0.3}


@dataclass
class Job:
    name: str
    ranks: list[subprocess.Popen] = field(default_factory=list)

    def wait(self) -> list[list[dict]]:
        """Every rank's step lines; fails the test, with the rank's stderr, when one fails."""
        results = []
        for rank, process in enumerate(self.ranks):
            try:
                out, err = process.communicate(timeout=PATIENCE * 2)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
                raise AssertionError(f"job {self.name} rank {rank} still runs after {PATIENCE * 2:g} s:\n{err[-3000:]}")
            assert process.returncode == 0, f"job {self.name} rank {rank} failed:\n{err[-3000:]}"
            results.append([json.loads(line) for line in out.splitlines() if line.strip()])
        return results


@pytest.fixture
def launch(simcuda, libnvshare, tmp_path):
    """launch(scheduler, name, ranks=[0, 1], gang=None, steps=..., env={}) -> Job: a
    data-parallel job whose rank i runs on GPU i (CUDA_VISIBLE_DEVICES, as torchrun's users set
    it per LOCAL_RANK), with torchrun's variables (a port of its own per job). `gang` sets
    NVSHARE_GANG. Each rank contributes i + 1 to every all-reduce; every rank checks the sum."""
    jobs: list[Job] = []
    ports = iter(range(29500, 29600))

    def start(scheduler, name: str, ranks: tuple[int, ...] = (0, 1), gang: str | None = None, steps: int = STEPS,
              extra: dict[str, str] | None = None) -> Job:
        job = Job(name)
        port = str(next(ports))
        total = sum(rank + 1 for rank in ranks)
        for rank in ranks:
            env = simcuda.env(devices=2, **scheduler.env)
            env.update(LD_PRELOAD=str(libnvshare), CUDA_VISIBLE_DEVICES=str(rank), NVSHARE_LOG="info",
                       SIMCUDA_COLLECTIVE=f"{len(ranks)}:{tmp_path / (name + '.collective')}",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(len(ranks)),
                       LOCAL_WORLD_SIZE=str(len(ranks)), RANK=str(rank), LOCAL_RANK=str(rank))
            if gang is not None:
                env["NVSHARE_GANG"] = gang
            env.update(extra or {})
            argv = simcuda.simapp_argv("alloc:plain:64K",
                                       f"repeat:{steps}:kernel:{COMPUTE_US},kernel:{COMPUTE_US},"
                                       f"allreduce:0:{rank + 1},stream-sync", f"check:0:{total}")
            job.ranks.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        for process in job.ranks:
            if process.poll() is None:
                process.kill()
                process.wait()


def revocations(scheduler) -> int:
    return sum(1 for event in scheduler.events() if event["kind"] == "revoke")


def checked(results: list[list[dict]]) -> bool:
    """Every rank's final check found the all-reduced sum."""
    return all(steps[-1]["step"].startswith("check") and steps[-1]["ok"] for steps in results)


def test_two_jobs_without_gangs_progress_only_through_revocations(scheduler_factory, launch):
    scheduler = scheduler_factory(**TIMINGS)
    jobs = [launch(scheduler, name, gang="none") for name in ("a", "b")]
    results = [job.wait() for job in jobs]
    assert all(checked(r) for r in results)
    assert revocations(scheduler) > 0  # the deadlock of issue 19, broken only by the grace


def registrations(scheduler) -> dict[str, int]:
    """Client id -> pid, from the timeline's register events (also of clients gone since)."""
    found = {}
    for event in scheduler.events():
        if event["kind"] == "register":
            fields = dict(part.split("=", 1) for part in event["detail"].split() if "=" in part)
            found[event["client"]] = int(fields["pid"])
    return found


def grants_of(scheduler, pids: set[int]) -> list[dict]:
    clients = {cid for cid, pid in registrations(scheduler).items() if pid in pids}
    return [e for e in scheduler.events() if e["kind"] == "grant" and e["client"] in clients]


def test_two_jobs_in_gangs_take_turns_without_revocations(scheduler_factory, launch):
    scheduler = scheduler_factory(**TIMINGS)
    jobs = [launch(scheduler, name) for name in ("a", "b")]  # torchrun's variables: a gang each
    results = [job.wait() for job in jobs]
    assert all(checked(r) for r in results)
    turns = [e for e in scheduler.events() if e["kind"] == "gang" and "turn=" in e["detail"]]
    assert len(turns) >= 3, turns  # the jobs took turns (neither fits in one quantum)
    assert all("devices=2" in e["detail"] for e in turns)  # each turn: both GPUs at once
    assert revocations(scheduler) == 0


def test_a_two_rank_job_beside_a_single_gpu_job_both_finish_and_the_single_one_gets_turns(
        scheduler_factory, launch, simcuda, libnvshare):
    scheduler = scheduler_factory(**TIMINGS)
    job = launch(scheduler, "a", steps=30)
    env = simcuda.env(devices=2, **scheduler.env)
    env.update(LD_PRELOAD=str(libnvshare), CUDA_VISIBLE_DEVICES="0")
    single = subprocess.Popen(simcuda.simapp_argv("alloc:plain:64K", f"repeat:60:kernel:{COMPUTE_US},stream-sync"),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = single.communicate(timeout=PATIENCE * 2)
    finally:
        if single.poll() is None:
            single.kill()
    assert single.returncode == 0, err[-3000:]
    assert checked(job.wait())
    rank_pids = {process.pid for process in job.ranks}
    single_grants = grants_of(scheduler, {single.pid})
    gang_grants = grants_of(scheduler, rank_pids)
    # Each job needs several quanta: the single job was granted GPU0 again after the gang had
    # it, i.e. it got turns between the gang's (it was not starved until the gang finished).
    first_gang, last_gang = min(e["seq"] for e in gang_grants), max(e["seq"] for e in gang_grants)
    assert any(first_gang < e["seq"] < last_gang for e in single_grants), (single_grants, gang_grants)
