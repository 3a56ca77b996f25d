"""Gangs end to end (issue 19): data-parallel jobs of two ranks, each rank a simapp process on
its own simulated GPU under libnvshare.so, joined every step by a collective
(tests/simcuda's nvshare_allreduce, which spins on the GPU until its partner's matching one has
run, as NCCL's does), with the real scheduler daemon.

Without gangs two such jobs deadlock on the locks (each holds one GPU and spins for its
partner, who waits for the other GPU) and progress only through revocations; with gangs each
job is granted both GPUs at once and they take turns. The ranks find their gang from
torchrun's variables (interceptor/gang.c); NVSHARE_GANG=none is the gang-less path.

The deadlock is made certain, not left to chance, by the order of arrival: job a's rank 0 and
job b's rank 1 come first (each could take its GPU alone), then their partners."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nvshare_py.testing.scheduler import PATIENCE, wait_for

DEVICES = ["GPU-5151ad00-0000-4000-8000-000000000000", "GPU-5151ad00-0000-4000-8000-000000000001"]
STEPS = 20
COMPUTE_US = 8000  # two compute kernels per step, then the all-reduce
# Quanta short enough that a job cannot finish inside one, so that the jobs must take turns.
TIMINGS = {"tq": 0.25, "grace": 0.25, "idle_release": 0.3}
RANKS = 2
SUM = sum(rank + 1 for rank in range(RANKS))  # every rank contributes its rank + 1


class Rank:
    def __init__(self, job: str, rank: int, process: subprocess.Popen) -> None:
        self.job, self.rank, self.process = job, rank, process

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self) -> list[dict]:
        """The rank's step lines; fails the test, with its stderr, when it fails."""
        try:
            out, err = self.process.communicate(timeout=PATIENCE * 2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            raise AssertionError(f"job {self.job} rank {self.rank} still runs after {PATIENCE * 2:g} s:\n{err[-3000:]}")
        assert self.process.returncode == 0, f"job {self.job} rank {self.rank} failed:\n{err[-3000:]}"
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def correct(self) -> bool:
        """It ran to its end and its final check found the all-reduced sum."""
        last = self.wait()[-1]
        return last["step"].startswith("check") and last["ok"]


@pytest.fixture
def launch(simcuda, libnvshare, tmp_path):
    """launch(scheduler, job, rank, gang=None, steps=..., extra={}) -> Rank: one rank of a
    data-parallel job on GPU `rank` (CUDA_VISIBLE_DEVICES, as torchrun's users set it per
    LOCAL_RANK), with torchrun's variables (a port of its own per job). `gang` sets
    NVSHARE_GANG; `extra` more of the environment; `pause_ms`: the rank spends that long on the
    CPU before each all-reduce."""
    ranks: list[Rank] = []
    ports: dict[str, str] = {}

    def start(scheduler, job: str, rank: int, gang: str | None = None, steps: int = STEPS,
              extra: dict[str, str] | None = None, pause_ms: float = 0) -> Rank:
        port = ports.setdefault(job, str(29500 + len(ports)))
        env = simcuda.env(devices=2, **scheduler.env)
        env.update(LD_PRELOAD=str(libnvshare), CUDA_VISIBLE_DEVICES=str(rank), NVSHARE_LOG="info",
                   SIMCUDA_COLLECTIVE=f"{RANKS}:{tmp_path / (job + '.collective')}",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(RANKS),
                   LOCAL_WORLD_SIZE=str(RANKS), RANK=str(rank), LOCAL_RANK=str(rank))
        if gang is not None:
            env["NVSHARE_GANG"] = gang
        env.update(extra or {})
        pause = f"sleep:{pause_ms:g}," if pause_ms else ""  # on the CPU, before its all-reduce
        argv = simcuda.simapp_argv("alloc:plain:64K",
                                   f"repeat:{steps}:kernel:{COMPUTE_US},kernel:{COMPUTE_US},"
                                   f"{pause}allreduce:0:{rank + 1},stream-sync", f"check:0:{SUM}")
        started = Rank(job, rank, subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                   text=True))
        ranks.append(started)
        return started

    yield start
    for rank in ranks:
        if rank.process.poll() is None:
            rank.process.kill()
            rank.process.wait()


def events(scheduler, kind: str | None = None) -> list[dict]:
    return [e for e in scheduler.events() if kind is None or e["kind"] == kind]


def client_of(scheduler, pid: int) -> str:
    """The client id the process registered as (from the timeline: also once it is gone)."""
    def find():
        for event in events(scheduler, "register"):
            fields = dict(part.split("=", 1) for part in event["detail"].split() if "=" in part)
            if int(fields["pid"]) == pid:
                return event["client"]
        return None
    return wait_for(find, what=f"the registration of pid {pid}")


def holds(scheduler, *pids: int) -> bool:
    clients = {client_of(scheduler, pid) for pid in pids}
    held = {h["client"] for d in scheduler.status()["devices"] for h in d["holders"]}
    return clients <= held


def gang_states(scheduler) -> dict[str, str]:
    return {gang["name"]: gang["state"] for gang in scheduler.status()["gangs"]}


def mixed_holds(scheduler, jobs: dict[str, str]) -> list[dict]:
    """Grants made while the other GPU was held by another job (`jobs`: client id -> job),
    replayed from the timeline."""
    holder: dict[str, tuple[str, int]] = {}  # device -> (client, grant)
    mixed = []
    for event in scheduler.events():
        device, client = event.get("device", ""), event.get("client", "")
        if event["kind"] == "grant":
            others = [jobs.get(c) for d, (c, _) in holder.items() if d != device]
            if any(job != jobs.get(client) for job in others):
                mixed.append(event)
            holder[device] = (client, event["grant"])
        elif event["kind"] in ("release", "revoke", "lost") and holder.get(device, ("", -1))[1] == event["grant"]:
            del holder[device]
    return mixed


def first_hold_end(scheduler) -> str:
    """How the first grant that ended, ended: `release` or `revoke`."""
    return next(e["kind"] for e in scheduler.events() if e["kind"] in ("release", "revoke"))


def test_without_gangs_two_jobs_deadlock_until_the_scheduler_revokes(scheduler_factory, launch):
    scheduler = scheduler_factory(**TIMINGS)
    a0, b1 = launch(scheduler, "a", 0, gang="none"), launch(scheduler, "b", 1, gang="none")
    wait_for(lambda: holds(scheduler, a0.pid, b1.pid), what="a0 holding GPU0 and b1 GPU1")
    a1, b0 = launch(scheduler, "a", 1, gang="none"), launch(scheduler, "b", 0, gang="none")
    assert all(rank.correct() for rank in (a0, a1, b0, b1))
    # a0 spins for a1, which waits for GPU1; b1 spins for b0, which waits for GPU0: no holder
    # can drain, and the first lock to change hands is taken away by the grace.
    assert first_hold_end(scheduler) == "revoke"
    assert len(events(scheduler, "revoke")) >= 1


def test_with_gangs_the_same_jobs_take_turns_with_both_gpus_at_once(scheduler_factory, launch):
    scheduler = scheduler_factory(**TIMINGS)
    a0, b1 = launch(scheduler, "a", 0), launch(scheduler, "b", 1)  # torchrun's variables: a gang each
    # Neither first rank is granted its GPU alone: each gang waits for its other member.
    wait_for(lambda: set(gang_states(scheduler).values()) == {"members"}, what="both gangs waiting for members")
    assert events(scheduler, "grant") == []
    a1, b0 = launch(scheduler, "a", 1), launch(scheduler, "b", 0)
    assert all(rank.correct() for rank in (a0, a1, b0, b1))
    turns = events(scheduler, "gang-turn")
    assert len(turns) >= 3, turns  # the jobs took turns (neither fits in one quantum)
    jobs = {client_of(scheduler, rank.pid): rank.job for rank in (a0, a1, b0, b1)}
    assert mixed_holds(scheduler, jobs) == []  # the two GPUs always held by one job
    # No deadlock: the first turn's members drained and released on their own. (A turn that
    # ends between two ranks' launches of one all-reduce is the fence's: the next test.)
    assert first_hold_end(scheduler) == "release"


def test_a_turn_that_ends_between_two_ranks_launches_of_an_all_reduce_stops_both_after_it(
        scheduler_factory, launch):
    """Issue 31: rank 1 of each job spends 100 ms on the CPU before each all-reduce, which rank 0
    launched at once; nearly every quantum ends in that window. Without the fence rank 0's
    all-reduce spun for a partner whose gate had closed, it could not drain, and it was revoked
    at almost every turn. With it (the simulated collective named as one: NVSHARE_COLLECTIVES),
    the gang agrees on the last all-reduce: rank 1 runs on to it, and nobody is revoked."""
    scheduler = scheduler_factory(tq=0.25, grace=5.0, idle_release=0.3)
    counted = {"NVSHARE_COLLECTIVES": "nvshare_allreduce"}
    ranks = [launch(scheduler, job, rank, extra=counted, pause_ms=100 if rank == 1 else 0, steps=8)
             for job in ("a", "b") for rank in range(RANKS)]
    assert all(rank.correct() for rank in ranks)
    assert events(scheduler, "revoke") == []
    behind = [e for e in events(scheduler, "gang-fence") if "behind=0" not in e["detail"]]
    assert behind, events(scheduler, "gang-fence")  # the cause: a member stopped short and caught up


def test_a_two_rank_job_beside_a_single_gpu_job_both_finish_and_the_single_one_gets_turns(
        scheduler_factory, launch, simcuda, libnvshare):
    scheduler = scheduler_factory(**TIMINGS)
    ranks = [launch(scheduler, "a", rank, steps=30) for rank in range(RANKS)]
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
    assert all(rank.correct() for rank in ranks)
    single_client = client_of(scheduler, single.pid)
    gang_clients = {client_of(scheduler, rank.pid) for rank in ranks}
    grants = events(scheduler, "grant")
    gang_seqs = [e["seq"] for e in grants if e["client"] in gang_clients]
    # Each job needs several quanta: the single job was granted GPU0 between two of the gang's
    # grants, i.e. it got turns while the gang ran, not only after it finished.
    assert any(min(gang_seqs) < e["seq"] < max(gang_seqs) for e in grants if e["client"] == single_client), grants


def test_a_process_using_two_gpus_is_a_gang_of_one(scheduler_factory, simcuda, libnvshare, tmp_path):
    """Model parallel within one process: its all-reduce on GPU0 waits for its own one on GPU1.
    Two such processes, each granted its GPUs one by one, would deadlock as two jobs do; as
    gangs of one each gets both at once."""
    scheduler = scheduler_factory(**TIMINGS)
    processes = []
    for name in ("p", "q"):
        env = simcuda.env(devices=2, **scheduler.env)
        env.update(LD_PRELOAD=str(libnvshare), SIMCUDA_COLLECTIVE=f"2:{tmp_path / name}")
        step = (f"device:0,kernel:{COMPUTE_US},allreduce:0:1,device:1,kernel:{COMPUTE_US},allreduce:1:2,"
                "stream-sync,device:0,stream-sync")
        argv = simcuda.simapp_argv("device:0", "alloc:plain:64K", "device:1", "alloc:plain:64K",
                                   f"repeat:{3 * STEPS}:{step}", "check:1:3", "device:0", "check:0:3")
        processes.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=PATIENCE * 2) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-3000:]
        checks = [json.loads(line) for line in out.splitlines() if '"check' in line]
        assert [c["ok"] for c in checks] == [True, True]
    turns = events(scheduler, "gang-turn")
    assert turns
    jobs = {client_of(scheduler, p.pid): name for p, name in zip(processes, ("p", "q"))}
    assert mixed_holds(scheduler, jobs) == []  # one process's two GPUs at once, never one each
    grants = [e["client"] for e in events(scheduler, "grant")]
    first = grants[0]
    assert first in grants[grants.index(next(c for c in grants if c != first)):], grants  # they took turns


def test_a_late_rank_is_waited_for_and_the_gang_then_runs(scheduler_factory, launch):
    scheduler = scheduler_factory(**TIMINGS)
    early = launch(scheduler, "a", 0)
    wait_for(lambda: gang_states(scheduler).get("torch:127.0.0.1:29500") == "members", what="the gang waiting")
    assert events(scheduler, "grant") == []  # the early rank waits for its partner, holding nothing
    late = launch(scheduler, "a", 1)
    assert early.correct() and late.correct()
    late_client = client_of(scheduler, late.pid)
    first_grant = events(scheduler, "grant")[0]["seq"]
    registered = next(e["seq"] for e in events(scheduler, "register") if e["client"] == late_client)
    assert registered < first_grant


def test_a_gang_that_waited_out_its_missing_rank_runs_and_says_so(scheduler_factory, simcuda, libnvshare):
    scheduler = scheduler_factory(**TIMINGS, gang_wait=0.5)
    env = simcuda.env(devices=2, **scheduler.env)
    env.update(LD_PRELOAD=str(libnvshare), NVSHARE_GANG="half-job:2")  # its partner never comes
    run = simcuda.run_simapp("alloc:plain:64K", f"kernel:{COMPUTE_US}", "sync", env=env)
    assert run.returncode == 0, run.stderr
    incomplete = [e for e in events(scheduler, "gang-incomplete") if "name=half-job" in e["detail"]]
    assert incomplete and "members=1" in incomplete[0]["detail"] and "size=2" in incomplete[0]["detail"]
    assert [e for e in events(scheduler, "grant") if e["seq"] > incomplete[0]["seq"]]  # then it ran


def test_a_rank_that_dies_ends_its_gangs_hold_and_the_other_job_goes_on(scheduler_factory, launch):
    scheduler = scheduler_factory(**TIMINGS)
    a = [launch(scheduler, "a", rank, steps=10_000) for rank in range(RANKS)]  # runs until killed
    wait_for(lambda: holds(scheduler, *(rank.pid for rank in a)), what="job a's turn")
    a[1].process.kill()  # dies holding GPU1 in its gang's turn
    a[1].process.wait()
    b = [launch(scheduler, "b", rank) for rank in range(RANKS)]
    assert all(rank.correct() for rank in b)  # b got both GPUs: a's hold ended
    dead = client_of(scheduler, a[1].pid)
    partner = client_of(scheduler, a[0].pid)
    gone = next(e["seq"] for e in events(scheduler) if e["kind"] in ("lost", "unregister") and e["client"] == dead)
    # The dead rank's partner was told to stop (its all-reduce spins for the dead rank, so the
    # grace then takes its GPU: a dead member ends the gang's hold like a dead single holder).
    ended = [e for e in events(scheduler) if e["seq"] > gone and e["client"] == partner
             and (e["kind"] == "revoke" or (e["kind"] == "drop" and e["detail"] == "gang"))]
    assert ended, events(scheduler)
