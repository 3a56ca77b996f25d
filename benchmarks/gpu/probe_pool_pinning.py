"""What growing the swap pool costs (issue 29), step by step, in the directories given.

    python benchmarks/gpu/probe_pool_pinning.py [--gib 2] [--segment-mib 512] [--out FILE] DIR...

The swap pool (interceptor/pool.c) is files of 512 MiB segments in shared memory, made present
and registered with cuMemHostRegister in every process that uses them. Its growth decides how
long the first eviction under pressure waits. This probe measures, for each DIR (a tmpfs or
hugetlbfs directory; /dev/shm and a tmpfs mounted with huge=always are the cases that matter),
with `--gib` per variant, each in seconds per GiB:

- making pages present with fallocate, on one thread and on four (a file each);
- registering them, on one thread and on four (a segment each);
- mapping present pages first (MADV_POPULATE_WRITE, four threads) and registering afterwards;
- making and mapping them in one step (MADV_POPULATE_WRITE without fallocate, four threads);
- registering the same files in a second process (as the pool's other members do);
- pinned copies out of device memory (managed, resident, as a swap-out's) into segments
  registered before, alone and beside a thread that grows the pool meanwhile, the old way
  (fallocate, register) and the new one (made present from four threads, register): GB/s;

and how much of the memory came as huge pages (ShmemHugePages in /proc/meminfo). No nvshare
involved: plain ctypes calls (the entry points of bench_swap_paths.py). Writes one JSON document
(stdout, and --out or $OUT/pool-pinning.json).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from ctypes import c_void_p
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_swap_paths import (CU_MEMHOSTREGISTER_PORTABLE, GIB, Api, Driver, libc_for_maps, meminfo,  # noqa: E402
                              on_threads, write_document)

SEGMENT = 512 << 20  # the pool's (NVSHARE_POOL_SEGMENT); --segment-mib changes it
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
THREADS = 4


class Files:
    """`count` segment files in `directory` under `prefix`, opened, sized and mapped MAP_SHARED."""

    def __init__(self, libc, directory: Path, prefix: str, count: int) -> None:
        self.libc = libc
        self.paths = [directory / f"{prefix}-{k}" for k in range(count)]
        self.fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in self.paths]
        for fd in self.fds:
            os.ftruncate(fd, SEGMENT)
        self.maps: list[int] = []

    def fallocate(self, fds: list[int]) -> None:
        for fd in fds:
            if self.libc.fallocate(fd, 0, 0, SEGMENT) != 0:
                raise OSError(ctypes.get_errno(), "fallocate")

    def map(self) -> None:
        for fd in self.fds:
            address = self.libc.mmap(None, SEGMENT, 3, 0x01, fd, 0)  # PROT_READ|WRITE, MAP_SHARED
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap")
            self.libc.madvise(c_void_p(address), SEGMENT, MADV_HUGEPAGE)
            self.maps.append(address)

    def populate(self, maps: list[int]) -> None:
        for address in maps:
            if self.libc.madvise(c_void_p(address), SEGMENT, MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE")

    def remove(self, api: Api | None, unlink: bool = True) -> None:
        """Unregistered (with `api`), unmapped, closed and removed (`unlink`)."""
        for address in self.maps:
            if api is not None:
                api.check("cuMemHostUnregister", c_void_p(address))
            self.libc.munmap(c_void_p(address), SEGMENT)
        for fd in self.fds:
            os.close(fd)
        for path in self.paths if unlink else ():
            path.unlink(missing_ok=True)


def register(api: Api, maps: list[int]) -> None:
    for address in maps:
        api.check("cuMemHostRegister", c_void_p(address), SEGMENT, CU_MEMHOSTREGISTER_PORTABLE)


def second_process(directory: str, prefix: str, count: int) -> None:
    cuda = Driver()
    cuda.context(0)
    files = Files(libc_for_maps(), Path(directory), prefix, count)
    files.map()
    api = Api()
    seconds = on_threads(cuda, lambda maps: register(api, maps), [files.maps])
    files.remove(api, unlink=False)  # the first process's files
    print(json.dumps({"register_s_per_gib": round(seconds / (count * SEGMENT / GIB), 4)}))


def probe(directory: Path, count: int) -> dict:
    cuda = Driver()
    cuda.context(0)
    api = Api()
    libc = libc_for_maps()
    gib = count * SEGMENT / GIB
    out: dict = {"bytes_per_variant": count * SEGMENT}
    huge_before = meminfo().get("ShmemHugePages", 0)
    made: list[Files] = []
    try:
        for name in ("one", "four", "mapped", "faulted"):
            made.append(Files(libc, directory, name, count))  # each removed at the end, even if the next fails
        one, four, mapped_first, faulted = made
        out["fallocate_s_per_gib"] = round(on_threads(cuda, one.fallocate, [one.fds]) / gib, 4)
        out["fallocate_4_threads_s_per_gib"] = round(
            on_threads(cuda, four.fallocate, [four.fds[k::THREADS] for k in range(THREADS)]) / gib, 4)
        for files in made:
            files.map()
        out["register_s_per_gib"] = round(on_threads(cuda, lambda m: register(api, m), [one.maps]) / gib, 4)
        out["register_4_threads_s_per_gib"] = round(
            on_threads(cuda, lambda m: register(api, m), [four.maps[k::THREADS] for k in range(THREADS)]) / gib, 4)
        mapped_first.fallocate(mapped_first.fds)
        out["map_present_4_threads_s_per_gib"] = round(
            on_threads(cuda, mapped_first.populate, [mapped_first.maps[k::THREADS] for k in range(THREADS)]) / gib, 4)
        out["register_mapped_s_per_gib"] = round(
            on_threads(cuda, lambda m: register(api, m), [mapped_first.maps]) / gib, 4)
        out["populate_4_threads_s_per_gib"] = round(
            on_threads(cuda, faulted.populate, [faulted.maps[k::THREADS] for k in range(THREADS)]) / gib, 4)
        out["register_populated_s_per_gib"] = round(
            on_threads(cuda, lambda m: register(api, m), [faulted.maps]) / gib, 4)
        out["shmem_huge_pages_bytes"] = meminfo().get("ShmemHugePages", 0) - huge_before
        run = subprocess.run([sys.executable, __file__, "--segment-mib", str(SEGMENT >> 20), "--second", str(directory),
                              "one", str(count)],
                             capture_output=True, text=True, timeout=300)
        out["second_process"] = (json.loads(run.stdout.splitlines()[-1]) if run.returncode == 0
                                 else {"error": run.stderr[-2000:]})
    except (OSError, RuntimeError) as exc:
        out["error"] = str(exc)
    finally:
        for files in made:
            files.remove(api if "error" not in out else None)
    return out


def copies_beside_growth(directory: Path, count: int) -> dict:
    """GB/s of DtoH copies into `count` registered segments while nothing else happens, and while
    another thread makes and registers `count` more segments (each way)."""
    cuda = Driver()
    cuda.context(0)
    api = Api()
    libc = libc_for_maps()
    nbytes = count * SEGMENT
    managed = cuda.alloc(nbytes, "managed")
    cuda.fill(managed, 7, nbytes // 4)
    cuda.synchronize()
    stream = cuda.create_stream()
    target = Files(libc, directory, "target", count)
    made = [target]
    out: dict = {}
    try:
        target.fallocate(target.fds)
        target.map()
        register(api, target.maps)

        def copy_once() -> None:
            for k, address in enumerate(target.maps):
                api.check("cuMemcpyDtoHAsync", c_void_p(address), managed + k * SEGMENT, SEGMENT, c_void_p(stream))
            cuda.stream_synchronize(stream)

        def copying_while(growing: threading.Thread | None) -> float:
            copy_once()  # warm
            copied, start = 0, time.perf_counter()
            if growing is not None:
                growing.start()
            while copied == 0 or (growing is not None and growing.is_alive()):
                copy_once()
                copied += nbytes
            seconds = time.perf_counter() - start
            if growing is not None:
                growing.join()
            return round(copied / seconds / 1e9, 2)

        out["alone_GBps"] = copying_while(None)
        for way in ("fallocate_then_register", "populate_4_threads_then_register"):
            files = Files(libc, directory, way, count)
            made.append(files)
            files.map()

            def grow(files: Files = files, way: str = way) -> None:
                cuda.context(0)
                if way.startswith("fallocate"):
                    files.fallocate(files.fds)
                else:
                    on_threads(cuda, files.populate, [files.maps[k::THREADS] for k in range(THREADS)])
                register(api, files.maps)

            start = time.perf_counter()
            out[f"beside_{way}_GBps"] = copying_while(threading.Thread(target=grow))
            out[f"{way}_growth_s_per_gib"] = round((time.perf_counter() - start) / (nbytes / GIB), 4)
    except (OSError, RuntimeError) as exc:
        out["error"] = str(exc)
    finally:
        for files in made:
            files.remove(api if "error" not in out else None)
        cuda.free(managed)
    return out


def mount_options(directory: Path) -> str | None:
    best = None
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if str(directory.resolve()).startswith(fields[1]) and (best is None or len(fields[1]) >= len(best[1])):
            best = fields
    return f"{best[2]} {best[3]}" if best else None


def main() -> None:
    global SEGMENT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--segment-mib", type=int, default=SEGMENT >> 20)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--second", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    SEGMENT = args.segment_mib << 20
    if args.second:
        second_process(args.second[0], args.second[1], int(args.second[2]))
        return
    count = max(THREADS, int(args.gib * GIB) // SEGMENT)
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    document: dict = {"probe": "pool-pinning", "segment": SEGMENT,
                      "shmem_enabled": thp.read_text().strip() if thp.exists() else None}
    for directory in args.dirs:
        work = directory / f"nvshare-probe-{os.getpid()}"
        work.mkdir(mode=0o700)
        try:
            document[str(directory)] = {"mount": mount_options(directory), **probe(work, count),
                                        "copies": copies_beside_growth(work, count)}
        finally:
            work.rmdir()
    print(write_document(document, args.out, "pool-pinning.json"))


if __name__ == "__main__":
    main()
