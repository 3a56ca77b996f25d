"""What slows a process's swap while the swap pool grows (issue 29): its own pinner, or others'.

    python benchmarks/gpu/probe_swap_beside_pinners.py [--gib 4] [--seconds 4] [--out FILE] [DIR]

On an H200, six tenants loading at once under a budget moved memory out at 1.8-2.7 GB/s while
their pool grew, where the same moves took 0.26 s for 13 GB (50 GB/s) once it had grown: almost
all of the time went into queueing the copies and discards (2.8 s of 2.9). Every member of the
pool then maps (MADV_POPULATE_WRITE, four threads) and registers (cuMemHostRegister) every
segment. This probe runs the swap engine's cycle (out: pinned copies of managed memory into
registered segments of DIR, default /dev/shm, then one discard; in: one discard-and-prefetch,
then the copies back) for `--seconds`, alone and beside each of:

- a thread of the same process registering and unregistering mapped segments in a loop;
- four threads of the same process mapping present segment pages in a loop (no CUDA);
- five other processes registering and unregistering mapped segments (each its own context);
- five other processes registering unmapped present segments (the driver maps them);
- five other processes mapping present pages on four threads each (no CUDA).

It reports GB/s of the cycle (both ways), the longest single call that queued work (a copy, a
discard), and how many operations the others did. No nvshare involved: plain ctypes calls (the
entry points of bench_swap_paths.py). One JSON document (stdout, and --out or
$OUT/swap-beside-pinners.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from ctypes import c_size_t, c_uint64, c_void_p
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_swap_paths import (CU_MEM_LOCATION_TYPE_DEVICE, CU_MEMHOSTREGISTER_PORTABLE, GIB, Api, Driver,  # noqa: E402
                              Location, libc_for_maps, write_document)
from probe_pool_pinning import MADV_POPULATE_WRITE, SEGMENT, Files  # noqa: E402

OTHERS = 5
THREADS = 4


def present(files: Files) -> None:
    files.fallocate(files.fds)
    files.map()
    files.populate(files.maps)


def map_loop(libc, fds: list[int], stop: threading.Event, counts: list[int]) -> None:
    """Maps each file's present pages and unmaps them, until `stop`."""
    while not stop.is_set():
        for fd in fds:
            address = libc.mmap(None, SEGMENT, 3, 0x01, fd, 0)
            libc.madvise(c_void_p(address), SEGMENT, MADV_POPULATE_WRITE)
            libc.munmap(c_void_p(address), SEGMENT)
            counts[0] += 1


def register_loop(api: Api, maps: list[int], stop: threading.Event, counts: list[int]) -> None:
    while not stop.is_set():
        for address in maps:
            api.check("cuMemHostRegister", c_void_p(address), SEGMENT, CU_MEMHOSTREGISTER_PORTABLE)
            api.check("cuMemHostUnregister", c_void_p(address))
            counts[0] += 1


def direct_loop(api: Api, libc, fds: list[int], stop: threading.Event, counts: list[int]) -> None:
    while not stop.is_set():
        for fd in fds:
            address = libc.mmap(None, SEGMENT, 3, 0x01, fd, 0)
            api.check("cuMemHostRegister", c_void_p(address), SEGMENT, CU_MEMHOSTREGISTER_PORTABLE)
            api.check("cuMemHostUnregister", c_void_p(address))
            libc.munmap(c_void_p(address), SEGMENT)
            counts[0] += 1


def child(kind: str, directory: str, count: int) -> None:
    """A pool member's pinner, doing one kind of work until SIGTERM; prints its operation count."""
    libc = libc_for_maps()
    files = Files(libc, Path(directory), f"child-{os.getpid()}", count)
    present(files)
    stop, counts = threading.Event(), [0]
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if kind == "map":
        shares = [files.fds[k::THREADS] for k in range(THREADS)]
        threads = [threading.Thread(target=map_loop, args=(libc, share, stop, counts)) for share in shares]
    else:
        cuda, api = Driver(), Api()
        cuda.context(0)

        def registering() -> None:
            cuda.context(0)  # current on this thread too
            if kind == "register":
                register_loop(api, files.maps, stop, counts)
            else:
                direct_loop(api, libc, files.fds, stop, counts)

        threads = [threading.Thread(target=registering)]
    print("ready", flush=True)
    for t in threads:
        t.start()
    while not stop.is_set():
        stop.wait(0.05)
    for t in threads:
        t.join()
    files.remove(None)
    print(json.dumps({"ops": counts[0]}), flush=True)


class Cycle:
    """The swap engine's moves of `count` segments of managed memory through registered segments."""

    def __init__(self, cuda: Driver, api: Api, files: Files) -> None:
        self.cuda, self.api, self.files = cuda, api, files
        self.n = len(files.maps)
        self.managed = cuda.alloc(self.n * SEGMENT, "managed")
        cuda.fill(self.managed, 7, self.n * SEGMENT // 4)
        cuda.synchronize()
        self.stream_id = cuda.create_stream()
        self.stream = c_void_p(self.stream_id)
        self.ptrs = (c_uint64 * self.n)(*[self.managed + k * SEGMENT for k in range(self.n)])
        self.sizes = (c_size_t * self.n)(*[SEGMENT] * self.n)
        self.here = (Location * 1)(Location(CU_MEM_LOCATION_TYPE_DEVICE, 0))
        self.index = (c_size_t * 1)(0)
        self.longest_call = 0.0
        self.steps: dict[str, float] = {}

    def call(self, name: str, *args) -> None:
        start = time.perf_counter()
        self.api.check(name, *args)
        self.longest_call = max(self.longest_call, time.perf_counter() - start)

    def step(self, name: str, work) -> None:
        start = time.perf_counter()
        work()
        self.cuda.stream_synchronize(self.stream_id)
        self.steps[name] = self.steps.get(name, 0.0) + time.perf_counter() - start

    def once(self) -> None:
        def out() -> None:
            for k, host in enumerate(self.files.maps):
                self.call("cuMemcpyDtoHAsync", c_void_p(host), self.ptrs[k], SEGMENT, self.stream)

        def back() -> None:
            for k, host in enumerate(self.files.maps):
                self.call("cuMemcpyHtoDAsync", self.ptrs[k], c_void_p(host), SEGMENT, self.stream)

        self.step("copies_out", out)
        self.step("discard", lambda: self.call("cuMemDiscardBatchAsync", self.ptrs, self.sizes, self.n, 0, self.stream))
        self.step("discard_prefetch", lambda: self.call("cuMemDiscardAndPrefetchBatchAsync", self.ptrs, self.sizes,
                                                        self.n, self.here, self.index, 1, 0, self.stream))
        self.step("copies_in", back)

    def run(self, seconds: float) -> dict:
        self.once()  # warm
        self.longest_call, self.steps, cycles, start = 0.0, {}, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            self.once()
            cycles += 1
        took = time.perf_counter() - start
        return {"GBps": round(2 * cycles * self.n * SEGMENT / took / 1e9, 2), "cycles": cycles,
                "longest_call_s": round(self.longest_call, 4),
                "step_s_per_cycle": {k: round(v / max(cycles, 1), 4) for k, v in self.steps.items()}}


def beside_children(cycle: Cycle, kind: str, directory: Path, count: int, seconds: float) -> dict:
    procs = [subprocess.Popen([sys.executable, __file__, "--child", kind, str(directory), str(count)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(OTHERS)]
    try:
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"a {kind} child did not start: {line!r}")
        out = cycle.run(seconds)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
    ops = []
    for p in procs:
        text, errors = p.communicate(timeout=120)
        lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
        ops.append(lines[-1]["ops"] if lines else None)
        if errors.strip():
            out.setdefault("others_errors", []).append(errors.strip()[-600:])
    out["others_ops"] = ops
    return out


def beside_thread(cycle: Cycle, kind: str, files: Files, api: Api, libc, cuda: Driver, seconds: float) -> dict:
    stop, counts = threading.Event(), [0]

    def registering() -> None:
        cuda.context(0)
        register_loop(api, files.maps, stop, counts)

    if kind == "register":
        threads = [threading.Thread(target=registering)]
    else:
        threads = [threading.Thread(target=map_loop, args=(libc, files.fds[k::THREADS], stop, counts))
                   for k in range(THREADS)]
    for t in threads:
        t.start()
    try:
        out = cycle.run(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join()
    out["ops"] = counts[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    count = max(THREADS, int(args.gib * GIB) // SEGMENT)
    work = args.dir / f"nvshare-probe-{os.getpid()}"
    work.mkdir(mode=0o700)
    cuda = Driver()
    cuda.context(0)
    api, libc = Api(), libc_for_maps()
    target, spare = Files(libc, work, "target", count), Files(libc, work, "spare", count)
    document: dict = {"probe": "swap-beside-pinners", "segment": SEGMENT, "bytes": count * SEGMENT,
                      "others": OTHERS, "dir": str(args.dir)}
    try:
        present(target)
        present(spare)
        for address in target.maps:
            api.check("cuMemHostRegister", c_void_p(address), SEGMENT, CU_MEMHOSTREGISTER_PORTABLE)
        cycle = Cycle(cuda, api, target)
        runs = document["runs"] = {}
        runs["alone"] = cycle.run(args.seconds)
        runs["own_thread_registering"] = beside_thread(cycle, "register", spare, api, libc, cuda, args.seconds)
        runs["own_4_threads_mapping"] = beside_thread(cycle, "map", spare, api, libc, cuda, args.seconds)
        for kind in ("register", "direct", "map"):
            runs[f"others_{kind}"] = beside_children(cycle, kind, work, count // 2, args.seconds)
        runs["alone_again"] = cycle.run(args.seconds)
        for address in target.maps:
            api.check("cuMemHostUnregister", c_void_p(address))
    finally:
        target.remove(None)
        spare.remove(None)
        for leftover in work.iterdir():
            leftover.unlink()
        work.rmdir()
    print(write_document(document, args.out, "swap-beside-pinners.json"))


if __name__ == "__main__":
    main()
