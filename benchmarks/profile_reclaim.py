"""Where the daemon's time goes on the `reclaim` flood (bench_floods.py): a HELLO claiming a busy
device and 40 invented ones, then its connection closing, fed to the daemon's own pump
(`Daemon._feed`: the core, the metrics observer, the timeline, the log) without sockets.

    python benchmarks/profile_reclaim.py [--rounds 300] [--claims 40] [--top 25] [--no-profile] [--no-gc-freeze]

Prints the time of each step (milliseconds, mean and worst) as JSON: the HELLO, the later
steps that handle the rest of its claims (core.CLAIMS_PER_STEP) and the close; then the
cProfile table of the HELLOs and their later steps, sorted by cumulative time. `gc_pause_ms`
gives the cyclic garbage collector's pauses by generation: a full (generation 2) collection
walks every container the process has, and was the longest stall of all (20-40 ms on the
2-core dev VM) until the daemon froze what it made at start-up (--no-gc-freeze shows it).
A profile, not a benchmark: run bench_floods.py --attacks reclaim for what an innocent
client sees.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import pstats
import tempfile
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's nvshare_py, without installing

from nvshare_py.scheduler import events as ev
from nvshare_py.scheduler.config import DaemonConfig
from nvshare_py.scheduler.core import SchedulerCore
from nvshare_py.scheduler.daemon import Daemon
from nvshare_py.scheduler.logs import log
from nvshare_py.scheduler.metrics import SchedulerMetrics

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"


class Wires:
    """Stands in for the daemon's ConnectionServer: every connection is open, writes go nowhere."""

    class _Every:
        def __contains__(self, key: object) -> bool:
            return True

    connections = _Every()

    def send(self, connection: int, data: bytes) -> None:
        pass

    def restart_idle(self, connection: int) -> None:
        pass


class Later:
    """Stands in for the daemon's nursery: keeps the claims tasks (Daemon._handle_claims) the
    pump starts; the script feeds their pieces itself, timing each step."""

    def __init__(self) -> None:
        self.keys: list[ev.ClientKey] = []

    def start_soon(self, task: object, key: ev.ClientKey) -> None:
        self.keys.append(key)


def info(pid: int, session: str) -> ev.ClientInfo:
    return ev.ClientInfo(pid=pid, session=session, uid=1001, user="attacker", program="attack")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--claims", type=int, default=40, help="invented devices claimed besides the busy one")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="leave out the gc.freeze() the daemon does once set up (Daemon.serve)")
    parser.add_argument("--no-profile", action="store_true", help="time the steps only (the profiler slows them)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        logging.basicConfig(filename=f"{scratch}/log", level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        daemon = Daemon(DaemonConfig(socket_dir=scratch))
        daemon.core = SchedulerCore(daemon.config.core_config(False), 0.0)
        daemon._clients = Wires()  # type: ignore[assignment]
        daemon._metrics = SchedulerMetrics(restarted=False, started=time.time())
        daemon._watch = lambda cid: None  # type: ignore[method-assign]  # no pidfds here
        later = daemon._nursery = Later()  # type: ignore[assignment]
        if not args.no_gc_freeze:
            gc.freeze()
        now = 100.0  # past any recovery window
        daemon._feed(ev.Register(now, 1, info(1, "0" * 16), wanted=(GPU,)))  # the innocent holder
        held = (GPU, *(f"D{n}" for n in range(args.claims)))
        hellos: list[float] = []
        pieces: list[float] = []
        closes: list[float] = []
        profile = cProfile.Profile()
        collections: dict[int, list[float]] = {0: [], 1: [], 2: []}  # the cyclic collector's pauses by generation
        started: list[float] = []

        def collector(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                collections[info["generation"]].append(time.perf_counter() - started.pop())

        gc.callbacks.append(collector)
        for round_ in range(args.rounds):
            key = 2 + round_
            now += 0.001
            start = time.perf_counter()
            if not args.no_profile:
                profile.enable()
            daemon._feed(ev.Register(now, key, info(1000 + round_, f"{round_ + 1:016x}"), held=held))
            profile.disable()
            hellos.append(time.perf_counter() - start)
            while later.keys:  # the rest of the claims, a step each (on a branch that splits them)
                start = time.perf_counter()
                if not args.no_profile:
                    profile.enable()
                daemon._feed(ev.HandleClaims(now, later.keys.pop()))
                profile.disable()
                pieces.append(time.perf_counter() - start)
            start = time.perf_counter()
            daemon._feed(ev.Unregister(now, key, "disconnected"))
            closes.append(time.perf_counter() - start)
        gc.callbacks.remove(collector)
        log.handlers.clear()

    def ms(values: list[float]) -> dict[str, float]:
        if not values:
            return {"n": 0}
        return {"n": len(values), "mean": round(1e3 * sum(values) / len(values), 3),
                "max": round(1e3 * max(values), 3)}

    print(json.dumps({"claims": len(held), "rounds": args.rounds, "hello_ms": ms(hellos),
                      "later_claims_steps_ms": ms(pieces), "close_ms": ms(closes),
                      "gc_pause_ms": {f"generation {n}": ms(pauses) for n, pauses in collections.items()}}))
    if args.no_profile:
        return
    table = io.StringIO()
    pstats.Stats(profile, stream=table).sort_stats("cumulative").print_stats(args.top)
    print(table.getvalue())


if __name__ == "__main__":
    main()
