"""Admission on the simulated driver: what it costs on the allocation path, what one decision
costs with many pairs, and how it holds against hostile clients (issue 20).

    python benchmarks/bench_admission.py [--part path|decisions|attacks|all] [--out results.json]
                                         [--rounds 5] [--iterations 20000] [--round-trips 200]
                                         [--attack-seconds 60] [--baseline-seconds 10]

`path`: builds the simulated driver, libnvshare.so and benchmarks/c/alloc_loop.c, starts two
schedulers (admission on with a large spill, and admission off), and alternates processes that
time cuMemAlloc_v2 + cuMemFree_v2 pairs under the interceptor:
- 4 KiB pairs: without a scheduler (admission not in force: the old path), with admission on
  (every pair stays within the admitted chunk: no message, one compare-and-swap more), and with
  admission off at the scheduler (the same path: the client still asks once per chunk);
- 1 GiB pairs with an untimed pause after each that is longer than the client's give-back delay
  (interceptor/client_core_admission.c, GIVE_BACK_AFTER_S): without a scheduler, and with admission on,
  where every allocation crosses the admitted total (the free before it gave the chunk back) and
  so waits for an ADMIT/ADMITTED round trip to the daemon: the price of asking.
Per variant the median over rounds of each round's median and p90 (ns per pair). The simulated
driver's own allocation is an mmap: the figures are the interceptor's bookkeeping, the round trip
and a system call, not a real GPU's.

`decisions`: the scheduler core alone (no I/O), 300 clients on 64 devices each (19,200 (client,
device) pairs) and 100 questions waiting: the time the core takes per MEMORY report (a stream
of them) and per ADMIT, median and p99 in microseconds.

`attacks`: the real daemon measuring a simulated 16 GiB GPU (4 GiB spill, admission timeout
5 s). An innocent client asks for 64 MiB more and gives it back, again and again, timing each
ADMIT; first alone (`--baseline-seconds`), then for `--attack-seconds` while hostile clients of
another user (uid 1001: needs root and setpriv, as the tests' other-user checks) run at once:
one says the GPU and 63 invented devices are 4 EiB (DEVICE, again and again), one reports 4 EiB
in use on them (MEMORY, a new figure each time), one asks for the whole node and for more than
is free (ADMIT, the questions waiting), and 300 connections of 64 devices each stream MEMORY
reports (19,200 pairs). Every second the capacity and the reserved total are read. Reported:
the innocent's ADMIT latency (p50, p99, max) alone and under attack, its REFUSED answers, and
the capacity's minimum and maximum.
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
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from bench_memory_limit import build  # noqa: E402  (the same three builds)

from nvshare_py.paths import CLIENT_SOCKET  # noqa: E402
from nvshare_py.testing.simcuda import build_simcuda  # noqa: E402

SMALL, LARGE = 4096, 1 << 30
SETTLE_MS = "300"  # time to register before the timing starts (alloc_loop's third argument)
# After each 1 GiB pair: long enough for the client's give-back (GIVE_BACK_AFTER_S = 1 s) to go
# out, so that the next allocation asks again (alloc_loop's fourth argument).
GIVE_BACK_PAUSE_US = "1200000"
MiB, GiB = 1 << 20, 1 << 30
GPU0 = "GPU-5151ad00-0000-4000-8000-000000000000"  # the simulated GPU (tests/simcuda)
OTHER_UID = 1001


def start_scheduler(socket_dir: Path, *options: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    daemon = subprocess.Popen([sys.executable, "-m", "nvshare_py.scheduler", "--socket-dir", str(socket_dir),
                               "--mode", "off", "--log-level", "warning", *options],
                              env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (socket_dir / CLIENT_SOCKET).exists():
        if time.monotonic() > deadline or daemon.poll() is not None:
            raise SystemExit(f"the scheduler on {socket_dir} did not start")
        time.sleep(0.05)
    return daemon


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {"n": 0}
    return {"n": len(ordered), "p50": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)],
            "max": ordered[-1]}


# --- the allocation path ----------------------------------------------------------------------

def allocation_path(work: Path, rounds: int, iterations: int, round_trips: int) -> dict:
    sim, library, loop = build(work)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NVSHARE_", "SIMCUDA_", "CUDA_VISIBLE"))}
    base.update(LD_LIBRARY_PATH=str(sim), LD_PRELOAD=str(library), NVSHARE_FAIL_MODE="open", NVSHARE_LOG="error",
                SIMCUDA_MEMORY="64G")
    on, off, none = work / "on", work / "off", work / "none"
    daemons = [start_scheduler(on, "--admission-spill", str(1 << 40), "--admission-share", "1"),
               start_scheduler(off, "--admission-spill", "off")]
    variants = {
        "4 KiB, no scheduler": (none, SMALL, iterations, "0"),
        "4 KiB, admission on (within the chunk)": (on, SMALL, iterations, "0"),
        "4 KiB, admission off at the scheduler": (off, SMALL, iterations, "0"),
        "1 GiB, no scheduler": (none, LARGE, round_trips, GIVE_BACK_PAUSE_US),
        "1 GiB, admission on (a round trip each)": (on, LARGE, round_trips, GIVE_BACK_PAUSE_US),
    }
    results: dict[str, list[dict]] = {name: [] for name in variants}
    try:
        for _ in range(rounds):
            for name, (socket_dir, size, count, pause) in variants.items():  # alternated: drifts hit all
                env = {**base, "NVSHARE_SOCKET_DIR": str(socket_dir)}
                out = subprocess.run([str(loop), str(count), str(size), SETTLE_MS, pause], env=env,
                                     capture_output=True, text=True, check=True)
                results[name].append(json.loads(out.stdout))
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=30)
    shown = {name: {"median_ns": statistics.median(r["median_ns"] for r in runs),
                    "p90_ns": statistics.median(r["p90_ns"] for r in runs),
                    "iterations": runs[0]["iterations"]} for name, runs in results.items()}
    return {
        "what": "cuMemAlloc_v2 + cuMemFree_v2 (converted to managed) under libnvshare.so, simulated driver",
        "rounds": rounds,
        "variants": shown,
        "admission_on_minus_no_scheduler_ns": (shown["4 KiB, admission on (within the chunk)"]["median_ns"]
                                               - shown["4 KiB, no scheduler"]["median_ns"]),
        "round_trip_ns": (shown["1 GiB, admission on (a round trip each)"]["median_ns"]
                          - shown["1 GiB, no scheduler"]["median_ns"]),
    }


# --- one decision with many pairs -------------------------------------------------------------

def decisions() -> dict:
    from nvshare_py.scheduler.admission import AdmissionConfig
    from nvshare_py.scheduler.core import CoreConfig, SchedulerCore
    from nvshare_py.scheduler.events import AdmitRequest, ClientInfo, DeviceMeasured, MemoryReport, Register

    core = SchedulerCore(CoreConfig(heartbeat_timeout=1e9, admission=AdmissionConfig(spill=4 * GiB, timeout=1e6)), 0.0)
    core.handle(DeviceMeasured(0.0, GPU0, 16 * GiB))
    devices = [GPU0] + [f"GPU-invented-{n}" for n in range(63)]
    for key in range(300):
        core.handle(Register(0.0, key, ClientInfo(pid=key, session=f"{key:016x}", host_pid=10_000 + key, uid=key)))
        for device in devices:
            core.handle(MemoryReport(0.0, key, device, 1 * MiB))
    for key in range(100):  # questions that cannot be admitted now: they wait
        core.handle(AdmitRequest(0.0, key, GPU0, 1, 32 * GiB if key == 0 else 4 * GiB))
    reports, admits = [], []
    for n in range(20_000):
        key, device = n % 300, devices[n % 64]
        started = time.perf_counter()
        core.handle(MemoryReport(1.0, key, device, (1 + n % 7) * MiB))
        reports.append((time.perf_counter() - started) * 1e6)
    for n in range(2_000):
        key = 100 + n % 200
        started = time.perf_counter()
        core.handle(AdmitRequest(1.0, key, GPU0, n + 2, 64 * MiB + n))
        admits.append((time.perf_counter() - started) * 1e6)
    return {"what": "SchedulerCore.handle, 300 clients x 64 devices = 19,200 pairs, 100 questions waiting (us)",
            "memory_report_us": percentiles(reports), "admit_us": percentiles(admits)}


# --- hostile clients --------------------------------------------------------------------------

# Each hostile client, run as another user with the daemon's socket directory in NVSHARE_SOCKET_DIR.
HOSTILE_PRELUDE = r"""
import itertools, os, sys, time, zmq
from nvshare_py import protocol
from nvshare_py.paths import SocketPaths
ENDPOINT = SocketPaths.resolve(None).client_endpoint
HUGE = 1 << 62
DEVICES = ["GPU-5151ad00-0000-4000-8000-000000000000"] + ["GPU-invented-%d" % n for n in range(63)]
context = zmq.Context()
def connect(number):
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ENDPOINT)
    sock.send(protocol.Hello(pid=os.getpid(), session="%016x" % (os.getpid() * 1000 + number)).encode())
    return sock
def drain(sock):
    while sock.poll(0):
        sock.recv()
deadline = time.monotonic() + float(sys.argv[1])
print("ready", flush=True)
"""
HOSTILE = {
    "inflate": HOSTILE_PRELUDE + r"""
sock = connect(0)
while time.monotonic() < deadline:
    for device in DEVICES:
        sock.send(protocol.DeviceAnnouncement(device=device, total=HUGE).encode())
    drain(sock)
    time.sleep(0.01)
""",
    "lie": HOSTILE_PRELUDE + r"""
sock = connect(0)
for n in itertools.count():
    if time.monotonic() >= deadline:
        break
    for device in DEVICES:
        sock.send(protocol.Memory(device=device, used=HUGE - n).encode())
    drain(sock)
    time.sleep(0.01)
""",
    "reserve": HOSTILE_PRELUDE + r"""
socks = [connect(n) for n in range(16)]
for n in itertools.count():
    if time.monotonic() >= deadline:
        break
    for i, sock in enumerate(socks):
        # the whole node, then more than is free, from 16 connections: questions that wait
        sock.send(protocol.Admit(device=DEVICES[0], request=n + 1, bytes=HUGE if i == 0 else (12 << 30) + n).encode())
        drain(sock)
    time.sleep(0.05)
""",
    "pairs": HOSTILE_PRELUDE + r"""
socks = [connect(n) for n in range(300)]
for n in itertools.count():
    if time.monotonic() >= deadline:
        break
    for sock in socks:
        for device in DEVICES:
            sock.send(protocol.Memory(device=device, used=(1 << 20) + n).encode())
        drain(sock)
    time.sleep(0.01)
""",
}


class Innocent:
    """A well-behaved client: asks for `step` more, gives it back, and times each question."""

    def __init__(self, socket_dir: Path) -> None:
        import zmq

        from nvshare_py import protocol
        from nvshare_py.paths import SocketPaths

        self.protocol = protocol
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.connect(SocketPaths(socket_dir).client_endpoint)
        self.sock.send(protocol.Hello(pid=os.getpid(), session=os.urandom(8).hex()).encode())
        self.sock.send(protocol.DeviceAnnouncement(device=GPU0, total=16 * GiB).encode())
        self.request = 0
        self.refused: list[str] = []

    def _answer(self, request: int, timeout: float) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
                message = self.protocol.decode(self.sock.recv(), self.protocol.SCHEDULER_MESSAGES)
                if isinstance(message, (self.protocol.Admitted, self.protocol.Refused)) and message.request == request:
                    return message
        return None

    def run(self, seconds: float, step: int = 64 * MiB) -> list[float]:
        latencies = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.request += 1
            started = time.monotonic()
            self.sock.send(self.protocol.Admit(device=GPU0, request=self.request, bytes=step).encode())
            answer = self._answer(self.request, 30.0)
            latencies.append((time.monotonic() - started) * 1e3)
            if not isinstance(answer, self.protocol.Admitted):
                self.refused.append(getattr(answer, "reason", "no answer"))
            self.sock.send(self.protocol.Admit(device=GPU0, request=0, bytes=0).encode())
            self.sock.send(self.protocol.Heartbeat().encode())
            time.sleep(0.02)
        return latencies


def attacks(work: Path, attack_seconds: float, baseline_seconds: float, names: list[str]) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    sim = build_simcuda(ROOT, work / "sim").lib_dir
    if os.geteuid() != 0 or subprocess.run(["setpriv", "--version"], capture_output=True).returncode != 0:
        raise SystemExit("the attacks run as another user: run as root, with setpriv (util-linux)")
    socket_dir = work / "attacks"
    daemon = start_scheduler(socket_dir, "--admission-spill", str(4 * GiB), "--admission-timeout", "5",
                             env={"LD_LIBRARY_PATH": str(sim), "SIMCUDA_DEVICES": "1", "SIMCUDA_MEMORY": "16G"})
    from nvshare_py.control import request
    from nvshare_py.paths import SocketPaths

    paths = SocketPaths(socket_dir)
    samples: list[dict] = []

    def sample() -> None:
        status = request(paths, "status", timeout=30.0)
        samples.append({"t": time.monotonic(), "capacity": status["admission"]["capacity"],
                        "reserved": status["admission"]["reserved"], "clients": len(status["clients"])})

    hostile_env = {**os.environ, "PYTHONPATH": str(ROOT), "NVSHARE_SOCKET_DIR": str(socket_dir)}
    as_other = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    hostile: list[subprocess.Popen] = []
    try:
        sample()
        innocent = Innocent(socket_dir)
        alone = innocent.run(baseline_seconds)
        refused_alone = list(innocent.refused)
        for name in names:
            code = HOSTILE[name]
            process = subprocess.Popen([*as_other, sys.executable, "-c", code, str(attack_seconds + 5)],
                                       env=hostile_env, cwd="/", stdout=subprocess.PIPE, text=True)
            hostile.append(process)
            if process.stdout.readline().strip() != "ready":
                raise SystemExit(f"the hostile client {name} did not start")
        time.sleep(2.0)  # the attacks are under way
        sample()
        under_attack: list[float] = []
        ends = time.monotonic() + attack_seconds
        while time.monotonic() < ends:
            under_attack += innocent.run(min(1.0, ends - time.monotonic()))
            sample()
        refused_under_attack = innocent.refused[len(refused_alone):]
    finally:
        for process in hostile:
            process.kill()
            process.wait()
        daemon.terminate()
        daemon.wait(timeout=30)
    capacities = [s["capacity"] for s in samples]
    return {
        "what": "an innocent client's ADMIT round trip (ms) alone and while hostile clients of another user "
                "inflate DEVICE sizes, lie in MEMORY, reserve and queue ADMITs, and stream reports over 19,200 pairs",
        "attack_seconds": attack_seconds,
        "attackers": names,
        "innocent_alone_ms": percentiles(alone),
        "innocent_under_attack_ms": percentiles(under_attack),
        "refused_alone": refused_alone,
        "refused_under_attack": refused_under_attack,
        "capacity_min": min(capacities),
        "capacity_max": max(capacities),
        "reserved_max": max(s["reserved"] for s in samples),
        "clients_max": max(s["clients"] for s in samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["path", "decisions", "attacks", "all"], default="all")
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--round-trips", type=int, default=20, help="iterations of the 1 GiB variants")
    parser.add_argument("--attack-seconds", type=float, default=60.0)
    parser.add_argument("--baseline-seconds", type=float, default=10.0)
    parser.add_argument("--attackers", nargs="+", choices=list(HOSTILE), default=list(HOSTILE),
                        help="which hostile clients run together (default: all)")
    parser.add_argument("--each", action="store_true", help="also run each hostile client alone first")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nvs-admission-bench-", dir="/tmp"))
    result: dict = {"load_average_before": os.getloadavg()}
    if args.part in ("path", "all"):
        result["path"] = allocation_path(work, args.rounds, args.iterations, args.round_trips)
    if args.part in ("decisions", "all"):
        result["decisions"] = decisions()
    if args.part in ("attacks", "all"):
        if args.each:
            result["attacks_alone"] = {name: attacks(work / name, args.attack_seconds, args.baseline_seconds, [name])
                                       for name in args.attackers}
        result["attacks"] = attacks(work / "together", args.attack_seconds, args.baseline_seconds, args.attackers)
    result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
