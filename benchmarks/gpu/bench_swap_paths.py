"""What the CUDA driver offers a swap engine (issue 18), measured through the driver API itself.

    OUT=/tmp/out python benchmarks/gpu/bench_swap_paths.py [--gib 8]

No nvshare involved: plain processes calling libcuda through ctypes (nvshare_py.driver for the
context, the allocations and the fill kernel; the rest resolved with cuGetProcAddress at
cudaVersion 13000, as the interceptor's swap engine resolves it). Runs on a real GPU (about a
minute on an H100) and on the simulated driver (tests/simcuda, to check the script itself).

1. `engine` (one process, `--gib` of managed memory resident on the device, the same of pinned
   host memory): what allocating and registering pinned memory costs per GiB; device-resident
   managed memory -> pinned (cuMemcpyDtoHAsync), cuMemDiscardBatchAsync (and cuMemGetInfo's
   free memory before and after), cuMemDiscardAndPrefetchBatchAsync back to the device, pinned
   -> managed (cuMemcpyHtoDAsync), every word checked; twice (into freshly allocated pinned
   memory, then reused); the ceiling (cuMemAlloc memory <-> the same pinned memory) and the
   managed prefetch both ways, in the same process.
2. `overlap` (two processes, `--gib`/2 of device memory and as much pinned memory each): each
   direction alone, then one process's device->host copy beside the other's host->device copy,
   two device->host copies at once, and a device->host copy beside the other process's kernels.
3. `vmm` (one process, `--gib`/2): cuMemCreate/Map/SetAccess memory copied to pinned, unmapped
   and released (cuMemGetInfo's free memory before and after), created again, mapped at the same
   address, copied back and checked.
4. `pinning` (one process, `--gib`/2 in 64 MiB chunks): what pinning costs per GiB, as the swap
   area pins it (cuMemHostAlloc), and what registering costs with ordinary pages, with
   transparent huge pages, and from 4 threads at once; memory made present first
   (MADV_POPULATE_WRITE, from 1 or 4 threads) and registered afterwards, in 64 and 512 MiB.
5. `handoff` (two processes, `--gib`/2 of managed memory and as much pinned memory each): the
   swap engine's moves, batch by batch as it makes them: one process's swap-out beside the
   other's swap-in, and beside each half of it (the copies, the pages made anew), each alone
   first.
6. `shared` (two processes, `--gib`/2 in 512 MiB segments): pinned memory shared between processes,
   as a node-wide swap pool would have it (issue 29): files in /dev/shm (and in a hugetlbfs mount
   where one has free pages), mapped MAP_SHARED, made present (fallocate, or MADV_POPULATE_WRITE
   from 4 threads), registered with cuMemHostRegister in one process and then in a second one that
   maps the same files; managed memory copied into them and back in each process (the second
   reads what the first wrote), and what registering costs the device (cuMemGetInfo's free memory)
   and the host (Shmem in /proc/meminfo). `--parts` picks parts (default: all).

Safety: at most 2 x `--gib` of device memory at once (the engine part's managed buffer and its
cuMemAlloc ceiling buffer), refused unless that is below a third of the free memory. Writes
swap-paths.json into $OUT (or --out); prints a short table.

(Some 800 lines: the six parts, about a hundred lines each with their child processes. They
share the entry points resolved as the swap engine resolves them (`Api`), the timing and
checking helpers and the one swap-paths.json, and run as one command on a GPU machine.)

Why one file of some 830 lines: each swap path is a short measurement through the driver API,
and the point of the script is to run them side by side in one process on one GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from ctypes import POINTER, byref, c_int, c_size_t, c_uint, c_uint64, c_ulonglong, c_void_p
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nvshare_py.driver import COPY_PTX, Driver  # noqa: E402

GIB = 1 << 30
CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_LOCATION_TYPE_HOST = 1, 2
CU_MEMHOSTREGISTER_PORTABLE = 1


class Location(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", Location),
                ("win32HandleMetaData", c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", c_int)]


SIGNATURES = {  # name: (cudaVersion of this ABI, argtypes)
    "cuMemcpyDtoHAsync": (3020, [c_void_p, c_uint64, c_size_t, c_void_p]),
    "cuMemcpyHtoDAsync": (3020, [c_uint64, c_void_p, c_size_t, c_void_p]),
    "cuMemHostAlloc": (2020, [POINTER(c_void_p), c_size_t, c_uint]),
    "cuMemHostRegister": (6050, [c_void_p, c_size_t, c_uint]),
    "cuMemHostUnregister": (4000, [c_void_p]),
    "cuMemFreeHost": (2000, [c_void_p]),
    "cuMemPrefetchAsync": (12020, [c_uint64, c_size_t, Location, c_uint, c_void_p]),
    "cuMemDiscardBatchAsync": (13000, [POINTER(c_uint64), POINTER(c_size_t), c_size_t, c_ulonglong, c_void_p]),
    "cuMemDiscardAndPrefetchBatchAsync": (13000, [POINTER(c_uint64), POINTER(c_size_t), c_size_t, POINTER(Location),
                                                  POINTER(c_size_t), c_size_t, c_ulonglong, c_void_p]),
    "cuMemCreate": (10020, [POINTER(c_uint64), c_size_t, POINTER(AllocationProp), c_ulonglong]),
    "cuMemRelease": (10020, [c_uint64]),
    "cuMemMap": (10020, [c_uint64, c_size_t, c_size_t, c_uint64, c_ulonglong]),
    "cuMemUnmap": (10020, [c_uint64, c_size_t]),
    "cuMemSetAccess": (10020, [c_uint64, c_size_t, POINTER(AccessDesc), c_size_t]),
    "cuMemAddressReserve": (10020, [POINTER(c_uint64), c_size_t, c_size_t, c_uint64, c_ulonglong]),
    "cuMemAddressFree": (10020, [c_uint64, c_size_t]),
    "cuModuleLoadData": (2000, [POINTER(c_void_p), ctypes.c_char_p]),
    "cuModuleGetFunction": (2000, [POINTER(c_void_p), c_void_p, ctypes.c_char_p]),
    "cuLaunchKernel": (4000, [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                              POINTER(c_void_p), c_void_p]),
}


class Api:
    """The functions above, resolved with cuGetProcAddress_v2 (None: the driver has none)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        gpa = lib.cuGetProcAddress_v2
        gpa.argtypes = [ctypes.c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
        self.status: dict[str, str] = {}
        for name, (version, argtypes) in SIGNATURES.items():
            address, status = c_void_p(), c_int()
            result = gpa(name.encode(), byref(address), version, 0, byref(status))
            found = result == 0 and address.value
            self.status[name] = "found" if found else f"missing (CUresult {result}, status {status.value})"
            setattr(self, name, ctypes.CFUNCTYPE(c_int, *argtypes)(address.value) if found else None)

    def check(self, name: str, *args) -> None:
        function = getattr(self, name)
        if function is None:
            raise RuntimeError(f"{name}: {self.status[name]}")
        result = function(*args)
        if result != 0:
            raise RuntimeError(f"{name} failed with CUresult {result}")


def timed(cuda: Driver, stream: int, action) -> float:
    cuda.synchronize()
    start = time.perf_counter()
    action()
    cuda.stream_synchronize(stream)
    return time.perf_counter() - start


def check_words(cuda: Driver, ptr: int, nbytes: int, first: int, second: int) -> bool:
    """The buffer's first half holds `first`, its second half `second` (sampled at 64 places)."""
    for k in range(64):
        offset = (nbytes // 64) * k // 4 * 4
        want = first if offset < nbytes // 2 else second
        if int.from_bytes(cuda.memcpy_dtoh(ptr + offset, 4), "little") != want:
            return False
    return True


def write_document(document: dict, out: Path | None, name: str) -> str:
    """The document as JSON, written to `out`, else to $OUT/`name` when $OUT is set; its text."""
    text = json.dumps(document, indent=1)
    path = out or (Path(os.environ["OUT"]) / name if os.environ.get("OUT") else None)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return text


def gbps(nbytes: int, seconds: float) -> float | None:
    """GB/s; None for a move that was not measured (negative seconds)."""
    if seconds < 0:
        return None
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


# --- part 1: the engine's path in one process --------------------------------------------------


def libc_for_maps() -> ctypes.CDLL:
    """libc with the signatures of the calls the probes make: mmap, madvise, munmap, fallocate."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = c_void_p
    libc.mmap.argtypes = [c_void_p, c_size_t, c_int, c_int, c_int, ctypes.c_long]
    libc.madvise.argtypes = [c_void_p, c_size_t, c_int]
    libc.munmap.argtypes = [c_void_p, c_size_t]
    libc.fallocate.argtypes = [c_int, c_int, ctypes.c_long, ctypes.c_long]
    return libc


def engine(nbytes: int) -> dict:
    cuda = Driver()
    cuda.context(0)
    api = Api()
    free, total = cuda.mem_get_info()
    if 2 * nbytes > free // 3:
        raise SystemExit(f"2 x {nbytes} bytes is more than a third of the free memory ({free})")
    out: dict = {"driver": cuda.version, "api": api.status, "bytes": nbytes}
    stream = cuda.create_stream()
    words = nbytes // 4

    start = time.perf_counter()
    pinned = c_void_p()
    api.check("cuMemHostAlloc", byref(pinned), nbytes, 0)
    out["host_alloc_s_per_gib"] = round((time.perf_counter() - start) / (nbytes / GIB), 4)
    # Registration of ordinary memory: what an area grown in place would pay.
    libc = libc_for_maps()
    area = libc.mmap(None, nbytes, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    start = time.perf_counter()
    registered = api.cuMemHostRegister is not None and api.cuMemHostRegister(c_void_p(area), nbytes, 0) == 0
    out["host_register_s_per_gib"] = round((time.perf_counter() - start) / (nbytes / GIB), 4) if registered else None

    managed = cuda.alloc(nbytes, "managed")
    device = cuda.alloc(nbytes, "plain")
    ptrs, sizes = (c_uint64 * 1)(managed), (c_size_t * 1)(nbytes)
    here = (Location * 1)(Location(CU_MEM_LOCATION_TYPE_DEVICE, 0))
    index = (c_size_t * 1)(0)

    # The ceiling: device memory <-> pinned memory, both directions.
    cuda.fill(device, 7, words)
    d2h = timed(cuda, stream, lambda: api.check("cuMemcpyDtoHAsync", pinned, device, nbytes, c_void_p(stream)))
    h2d = timed(cuda, stream, lambda: api.check("cuMemcpyHtoDAsync", device, pinned, nbytes, c_void_p(stream)))
    out["ceiling"] = {"d2h_GBps": gbps(nbytes, d2h), "h2d_GBps": gbps(nbytes, h2d)}

    rounds = []
    for round_ in range(2):
        cuda.fill(managed, 0x11110000 + round_, words // 2)
        cuda.fill(managed + nbytes // 2, 0x22220000 + round_, words - words // 2)
        cuda.synchronize()
        one = {}
        one["out_s"] = timed(cuda, stream, lambda: api.check("cuMemcpyDtoHAsync", pinned, managed, nbytes,
                                                              c_void_p(stream)))
        free_before = cuda.mem_get_info()[0]
        if api.cuMemDiscardBatchAsync is not None:
            one["discard_s"] = timed(cuda, stream, lambda: api.check("cuMemDiscardBatchAsync", ptrs, sizes, 1, 0,
                                                                      c_void_p(stream)))
            one["free_gib_before_after_discard"] = [round(free_before / GIB, 2), round(cuda.mem_get_info()[0] / GIB, 2)]
            one["discard_prefetch_s"] = timed(cuda, stream, lambda: api.check(
                "cuMemDiscardAndPrefetchBatchAsync", ptrs, sizes, 1, here, index, 1, 0, c_void_p(stream)))
        one["in_s"] = timed(cuda, stream, lambda: api.check("cuMemcpyHtoDAsync", managed, pinned, nbytes,
                                                             c_void_p(stream)))
        one["intact"] = check_words(cuda, managed, nbytes, 0x11110000 + round_, 0x22220000 + round_)
        one["out_GBps"], one["in_GBps"] = gbps(nbytes, one["out_s"]), gbps(nbytes, one["in_s"])
        rounds.append(one)
    out["engine"] = rounds

    # The managed prefetch both ways (the old swap path), twice: the first to-host pays for the
    # host pages.
    prefetches = []
    for _ in range(2):
        to_host = timed(cuda, stream, lambda: api.check("cuMemPrefetchAsync", managed, nbytes,
                                                         Location(CU_MEM_LOCATION_TYPE_HOST, 0), 0, c_void_p(stream)))
        to_device = timed(cuda, stream, lambda: api.check("cuMemPrefetchAsync", managed, nbytes,
                                                           Location(CU_MEM_LOCATION_TYPE_DEVICE, 0), 0,
                                                           c_void_p(stream)))
        prefetches.append({"to_host_GBps": gbps(nbytes, to_host), "to_device_GBps": gbps(nbytes, to_device)})
    out["prefetch"] = prefetches
    if registered:
        reg = timed(cuda, stream, lambda: api.check("cuMemcpyDtoHAsync", c_void_p(area), device, nbytes,
                                                     c_void_p(stream)))
        out["registered_d2h_GBps"] = gbps(nbytes, reg)
        api.check("cuMemHostUnregister", c_void_p(area))
    cuda.free(managed)
    cuda.free(device)
    api.check("cuMemFreeHost", pinned)
    return out


# --- part 2: two processes on the link ----------------------------------------------------------


def overlap_child(nbytes: int) -> None:
    """Told on stdin what to do and when (a CLOCK_MONOTONIC time), prints seconds per action."""
    cuda = Driver()
    cuda.context(0)
    api = Api()
    stream = cuda.create_stream()
    pinned = c_void_p()
    api.check("cuMemHostAlloc", byref(pinned), nbytes, 0)
    device = cuda.alloc(nbytes, "plain")
    cuda.fill(device, 3, nbytes // 4)
    cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        action, at = line.split()
        while time.monotonic() < float(at):
            pass
        start = time.perf_counter()
        if action == "d2h":
            api.check("cuMemcpyDtoHAsync", pinned, device, nbytes, c_void_p(stream))
        elif action == "h2d":
            api.check("cuMemcpyHtoDAsync", device, pinned, nbytes, c_void_p(stream))
        elif action == "kernels":  # about as long as a copy alone: 40 kernels of 10 ms
            for _ in range(40):
                cuda.launch_sleep(10_000, stream)
        cuda.stream_synchronize(stream)
        print(time.perf_counter() - start, flush=True)


def overlap(nbytes: int) -> dict:
    children = [subprocess.Popen([sys.executable, __file__, "--overlap-child", str(nbytes)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for child in children:
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("an overlap child failed")

    def run(first: str, second: str | None) -> list[float]:
        at = time.monotonic() + 0.2
        plan = [(children[0], first)] + ([(children[1], second)] if second else [])
        for child, action in plan:
            child.stdin.write(f"{action} {at}\n")
            child.stdin.flush()
        return [float(child.stdout.readline()) for child, _ in plan]

    out = {"bytes_each": nbytes}
    out["d2h_alone_GBps"] = gbps(nbytes, run("d2h", None)[0])
    out["h2d_alone_GBps"] = gbps(nbytes, run("h2d", None)[0])
    d2h, h2d = run("d2h", "h2d")
    out["d2h_beside_h2d_GBps"], out["h2d_beside_d2h_GBps"] = gbps(nbytes, d2h), gbps(nbytes, h2d)
    one, two = run("d2h", "d2h")
    out["two_d2h_GBps"] = [gbps(nbytes, one), gbps(nbytes, two)]
    kernels_alone = run("kernels", None)[0]
    d2h, kernels = run("d2h", "kernels")
    out["d2h_beside_kernels_GBps"] = gbps(nbytes, d2h)
    out["kernels_alone_s"], out["kernels_beside_d2h_s"] = round(kernels_alone, 4), round(kernels, 4)
    for child in children:
        child.stdin.close()
        child.wait(timeout=60)
    return out


# --- part 5: a handoff's two moves at once, in two processes -------------------------------------

HANDOFF_BATCH = 512 << 20  # as the swap engine's batches
HANDOFF_BLOCK = 64 << 20  # the interceptor's blocks of converted memory (memory.c)
HANDOFF_ACTIONS = {
    # name: (direction, with the discard / discard-and-prefetch, the copies (None, "ce": the copy
    # engines, cuMemcpy*Async; "kernel": COPY_PTX on the SMs), streams, the ranges a batch's
    # calls name and its copies move: the whole batch, or a block each)
    "out": ("out", True, "ce", 2, HANDOFF_BATCH),          # the engine's swap-out: copies into the area, then discards
    "out_copies": ("out", False, "ce", 2, HANDOFF_BATCH),  # its copies alone (the pages stay)
    "out_copies_1": ("out", False, "ce", 1, HANDOFF_BATCH),  # the same on one stream
    "out_kernel": ("out", True, "kernel", 1, HANDOFF_BATCH),  # the swap-out with a kernel writing the area
    "in": ("in", True, "ce", 1, HANDOFF_BATCH),            # the engine's swap-in: pages made anew, then copies back
    "in_copies": ("in", False, "ce", 1, HANDOFF_BATCH),    # copies into pages that are still there
    "in_pages": ("in", True, None, 1, HANDOFF_BATCH),      # making the pages anew alone
    "in_kernel": ("in", True, "kernel", 1, HANDOFF_BATCH),  # the swap-in with a kernel reading the area
    "in_blocks": ("in", True, "ce", 1, HANDOFF_BLOCK),     # the swap-in as the engine makes it: a range and a copy a block
}
# The copy kernel's grid: 8 blocks of 256 threads for each of an H100's or H200's 132 SMs.
COPY_GRID, COPY_THREADS = 132 * 8, 256


def handoff_child(nbytes: int, family: str) -> None:
    """Device memory of `family` (managed, as nvshare converts it; plain: cuMemAlloc, for the
    copies only) and a pinned area as large; told on stdin an action of HANDOFF_ACTIONS and when
    to start it (a CLOCK_MONOTONIC time), it first puts its memory where the action starts from
    (out of the clock), then moves it in batches as the engine does (two in flight; on two
    streams in turn or on one) and prints the seconds it took."""
    cuda = Driver()
    cuda.context(0)
    api = Api()
    streams = [cuda.create_stream(), cuda.create_stream()]
    area = c_void_p()
    api.check("cuMemHostAlloc", byref(area), nbytes, 0)
    managed = cuda.alloc(nbytes, family)
    cuda.fill(managed, 5, nbytes // 4)
    cuda.synchronize()
    here = (Location * 1)(Location(CU_MEM_LOCATION_TYPE_DEVICE, 0))
    index = (c_size_t * 1)(0)
    batches = [(offset, min(HANDOFF_BATCH, nbytes - offset)) for offset in range(0, nbytes, HANDOFF_BATCH)]
    resident = True
    module, copy_kernel = c_void_p(), c_void_p()
    try:
        api.check("cuModuleLoadData", byref(module), COPY_PTX.encode())
        api.check("cuModuleGetFunction", byref(copy_kernel), module, b"nvshare_copy")
    except RuntimeError:  # the simulated driver runs only its own kernels
        copy_kernel = None

    def kernel_copy(dst: int, src: int, size: int, stream: c_void_p) -> None:
        arguments = [c_uint64(dst), c_uint64(src), c_uint64(size // 16)]
        pointers = (c_void_p * 3)(*(ctypes.addressof(argument) for argument in arguments))
        api.check("cuLaunchKernel", copy_kernel, COPY_GRID, 1, 1, COPY_THREADS, 1, 1, 0, stream, pointers, None)

    def move(direction: str, pages: bool, copies: str | None, n_streams: int, block: int) -> None:
        in_flight: list[int] = []
        for k, (offset, size) in enumerate(batches):
            stream = c_void_p(streams[k % n_streams])
            ranges = [(start, min(block, offset + size - start)) for start in range(offset, offset + size, block)]
            ptrs = (c_uint64 * len(ranges))(*(managed + start for start, _ in ranges))
            sizes = (c_size_t * len(ranges))(*(length for _, length in ranges))
            if direction == "in" and pages:
                api.check("cuMemDiscardAndPrefetchBatchAsync", ptrs, sizes, len(ranges), here, index, 1, 0, stream)
            for start, length in ranges:
                device, host = managed + start, area.value + start
                if copies == "kernel":
                    target, source = (host, device) if direction == "out" else (device, host)
                    kernel_copy(target, source, length, stream)
                elif copies == "ce" and direction == "out":
                    api.check("cuMemcpyDtoHAsync", c_void_p(host), device, length, stream)
                elif copies == "ce":
                    api.check("cuMemcpyHtoDAsync", device, c_void_p(host), length, stream)
            if direction == "out" and pages:
                api.check("cuMemDiscardBatchAsync", ptrs, sizes, len(ranges), 0, stream)
            in_flight.append(stream.value)
            if len(in_flight) == 2:
                cuda.stream_synchronize(in_flight.pop(0))
        for stream_ in in_flight:
            cuda.stream_synchronize(stream_)

    print("ready", flush=True)
    for line in sys.stdin:
        action, at = line.split()
        direction, pages, copies, n_streams, block = HANDOFF_ACTIONS[action]
        if copies == "kernel" and copy_kernel is None:
            print(-1, flush=True)  # not measured
            continue
        # Where the action starts from: out from resident memory; in from discarded memory,
        # except the copies alone, which need the pages there.
        want_resident = direction == "out" or not pages
        if want_resident and not resident:
            move("in", True, "ce", 1, HANDOFF_BATCH)
        elif not want_resident and resident:
            move("out", True, "ce", 2, HANDOFF_BATCH)
        resident = want_resident
        while time.monotonic() < float(at):
            pass
        start = time.perf_counter()
        move(direction, pages, copies, n_streams, block)
        print(time.perf_counter() - start, flush=True)
        resident = direction == "in" or not pages


def handoff(nbytes: int) -> dict:
    """Each move alone, then the swap-out of one process beside the swap-in of the other, and
    the same with one side reduced to its copies or its page work: which of them slows the
    other down when a handoff's two moves overlap; the copies again with cuMemAlloc memory."""
    children = [subprocess.Popen([sys.executable, __file__, "--handoff-child", str(nbytes), family],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for family in ("managed", "managed", "plain", "plain")]
    for child in children:
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("a handoff child failed")

    def run(first: str, second: str | None, pair: int = 0) -> list[float]:
        """The first action in one child, the second in the other, of the managed pair (0) or
        the plain one (1)."""
        at = time.monotonic() + 2.0  # time to put the memory where the action starts from
        one, other = children[2 * pair:2 * pair + 2]
        plan = [(one, first)] + ([(other, second)] if second else [])
        for child, action in plan:
            child.stdin.write(f"{action} {at}\n")
            child.stdin.flush()
        return [float(child.stdout.readline()) for child, _ in plan]

    out: dict = {"bytes_each": nbytes, "batch": HANDOFF_BATCH}
    for action in HANDOFF_ACTIONS:
        out[f"{action}_alone_GBps"] = [gbps(nbytes, run(action, None)[0]) for _ in range(2)]
    for first, second in (("out", "in"), ("out_copies", "in"), ("out", "in_copies"), ("out", "in_pages"),
                          ("out_copies", "in_copies"), ("out_copies_1", "in_copies"), ("out_kernel", "in"),
                          ("out", "in_kernel")):
        measured = [run(first, second) for _ in range(2)]
        out[f"{first}_beside_{second}_GBps"] = [[gbps(nbytes, a), gbps(nbytes, b)] for a, b in measured]
    for first, second in (("out_copies", None), ("in_copies", None), ("out_copies", "in_copies"),
                          ("out_copies_1", "in_copies")):
        measured = [run(first, second, pair=1) for _ in range(2)]
        out[f"plain_{first}" + (f"_beside_{second}" if second else "_alone") + "_GBps"] = [
            [gbps(nbytes, t) for t in times] for times in measured]
    for child in children:
        child.stdin.close()
        child.wait(timeout=60)
    return out


# --- part 4: how fast pinned memory can be had ---------------------------------------------------------


def on_threads(cuda: Driver, work, shares: list) -> float:
    """Seconds for `work(share)` on a thread per share, each with the context current; a thread's
    failure is raised here."""
    import threading

    failures: list[BaseException] = []

    def run(share) -> None:
        try:
            cuda.context(0)
            work(share)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            failures.append(exc)

    start = time.perf_counter()
    workers = [threading.Thread(target=run, args=(share,)) for share in shares]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        raise RuntimeError(f"a probe thread failed: {failures[0]}")
    return time.perf_counter() - start


def pinning(nbytes: int) -> dict:
    """Seconds per GiB to pin `nbytes` in 64 MiB chunks: cuMemHostAlloc one after the other and
    from 2, 4 and 8 threads at once;
    cuMemHostRegister of ordinary memory, of memory advised to transparent huge pages
    (MADV_HUGEPAGE), and from 4 threads at once (each registering its own chunks)."""
    cuda = Driver()
    cuda.context(0)
    api = Api()
    chunk = 64 << 20
    count = max(1, nbytes // chunk)
    libc = libc_for_maps()
    per_gib = count * chunk / GIB
    out: dict = {"bytes": count * chunk, "chunk": chunk}

    def timed_on_threads(work, shares: list) -> float:
        """Seconds per GiB for `work(share)` on a thread each (the context current there too)."""
        return round(on_threads(cuda, work, shares) / per_gib, 4)

    def host_alloc(threads: int) -> float:
        hosts: list[c_void_p] = []

        def work(n: int) -> None:
            for _ in range(n):
                host = c_void_p()
                api.check("cuMemHostAlloc", byref(host), chunk, 1)  # PORTABLE, as the swap area
                hosts.append(host)

        seconds_per_gib = timed_on_threads(work, [len(range(k, count, threads)) for k in range(threads)])
        for host in hosts:
            api.check("cuMemFreeHost", host)
        return seconds_per_gib

    out["host_alloc_s_per_gib"] = host_alloc(1)
    for threads in (2, 4, 8):
        out[f"host_alloc_{threads}_threads_s_per_gib"] = host_alloc(threads)

    def register(huge: bool, threads: int) -> float:
        regions = []
        for _ in range(count):
            region = libc.mmap(None, chunk, 3, 0x22, -1, 0)
            if huge:
                libc.madvise(c_void_p(region), chunk, 14)  # MADV_HUGEPAGE
            regions.append(region)

        def work(mine: list[int]) -> None:
            for region in mine:
                api.check("cuMemHostRegister", c_void_p(region), chunk, 1)

        seconds_per_gib = timed_on_threads(work, [regions[k::threads] for k in range(threads)])
        for region in regions:
            api.check("cuMemHostUnregister", c_void_p(region))
            libc.munmap(c_void_p(region), chunk)
        return seconds_per_gib

    out["register_s_per_gib"] = register(False, 1)
    out["register_thp_s_per_gib"] = register(True, 1)
    out["register_4_threads_s_per_gib"] = register(False, 4)
    out["register_thp_4_threads_s_per_gib"] = register(True, 4)

    def populated_then_registered(threads: int, size: int) -> tuple[float, float]:
        """Transparent huge pages made present first (MADV_POPULATE_WRITE, from `threads` threads,
        each its own regions of `size`), then registered one after the other: seconds per GiB
        of each step (population None where the kernel has no MADV_POPULATE_WRITE, 5.14+)."""
        regions = []
        for _ in range(count * chunk // size):
            region = libc.mmap(None, size, 3, 0x22, -1, 0)
            libc.madvise(c_void_p(region), size, 14)  # MADV_HUGEPAGE
            regions.append(region)
        failed = []

        def populate(mine: list[int]) -> None:
            failed.extend(region for region in mine if libc.madvise(c_void_p(region), size, 23) != 0)

        populating = timed_on_threads(populate, [regions[k::threads] for k in range(threads)])
        registering = timed_on_threads(lambda mine: [api.check("cuMemHostRegister", c_void_p(region), size, 1)
                                                     for region in mine], [regions])
        for region in regions:
            api.check("cuMemHostUnregister", c_void_p(region))
            libc.munmap(c_void_p(region), size)
        return (None if failed else populating), registering

    for threads in (1, 4):
        out[f"populate_thp_{threads}_threads_s_per_gib"], out[f"register_populated_thp_{threads}_s_per_gib"] = \
            populated_then_registered(threads, chunk)
    out["populate_thp_4_threads_512mib_s_per_gib"], out["register_populated_thp_512mib_s_per_gib"] = \
        populated_then_registered(4, 8 * chunk)
    return out


# --- part 3: VMM memory out and back in --------------------------------------------------------


def vmm(nbytes: int) -> dict:
    cuda = Driver()
    cuda.context(0)
    api = Api()
    stream = cuda.create_stream()
    prop = AllocationProp(type=1, location=Location(CU_MEM_LOCATION_TYPE_DEVICE, 0))
    access = AccessDesc(Location(CU_MEM_LOCATION_TYPE_DEVICE, 0), 3)  # PROT_READWRITE
    size = nbytes // (2 << 20) * (2 << 20)
    pinned = c_void_p()
    api.check("cuMemHostAlloc", byref(pinned), size, 0)
    handle, ptr = c_uint64(), c_uint64()
    api.check("cuMemCreate", byref(handle), size, byref(prop), 0)
    api.check("cuMemAddressReserve", byref(ptr), size, 0, 0, 0)
    api.check("cuMemMap", ptr.value, size, 0, handle.value, 0)
    api.check("cuMemSetAccess", ptr.value, size, byref(access), 1)
    cuda.fill(ptr.value, 0x33330000, size // 8)
    cuda.fill(ptr.value + size // 2, 0x44440000, size // 4 - size // 8)
    cuda.synchronize()
    out: dict = {"bytes": size}
    free_mapped = cuda.mem_get_info()[0]
    out["out_s"] = timed(cuda, stream, lambda: api.check("cuMemcpyDtoHAsync", pinned, ptr.value, size,
                                                          c_void_p(stream)))
    start = time.perf_counter()
    api.check("cuMemUnmap", ptr.value, size)
    api.check("cuMemRelease", handle.value)
    out["release_s"] = time.perf_counter() - start
    out["free_gib_mapped_released"] = [round(free_mapped / GIB, 2), round(cuda.mem_get_info()[0] / GIB, 2)]
    start = time.perf_counter()
    api.check("cuMemCreate", byref(handle), size, byref(prop), 0)
    api.check("cuMemMap", ptr.value, size, 0, handle.value, 0)
    api.check("cuMemSetAccess", ptr.value, size, byref(access), 1)
    out["recreate_s"] = time.perf_counter() - start
    out["in_s"] = timed(cuda, stream, lambda: api.check("cuMemcpyHtoDAsync", ptr.value, pinned, size,
                                                         c_void_p(stream)))
    out["intact"] = check_words(cuda, ptr.value, size, 0x33330000, 0x44440000)
    out["out_GBps"], out["in_GBps"] = gbps(size, out["out_s"]), gbps(size, out["in_s"])
    api.check("cuMemUnmap", ptr.value, size)
    api.check("cuMemRelease", handle.value)
    api.check("cuMemAddressFree", ptr.value, size)
    api.check("cuMemFreeHost", pinned)
    return out


# --- part 6: pinned memory shared between processes (a node-wide swap pool) ------------------------

SEGMENT = 512 << 20


def shared_files(directory: Path, count: int) -> list[int]:
    """`count` files of SEGMENT bytes in `directory`, opened read-write (their descriptors)."""
    return [os.open(directory / f"segment{k}", os.O_RDWR | os.O_CREAT, 0o600) for k in range(count)]


def map_shared(libc, fds: list[int]) -> list[int]:
    maps = []
    for fd in fds:
        os.ftruncate(fd, SEGMENT)
        address = libc.mmap(None, SEGMENT, 3, 0x01, fd, 0)  # PROT_READ|WRITE, MAP_SHARED
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of a shared segment failed")
        libc.madvise(c_void_p(address), SEGMENT, 14)  # MADV_HUGEPAGE: honoured where shmem_enabled allows
        maps.append(address)
    return maps


def meminfo() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields


def register_all(api: Api, cuda: Driver, maps: list[int]) -> dict:
    """Registers every segment (PORTABLE): seconds per GiB, and the device memory it took."""
    free_before = cuda.mem_get_info()[0]
    start = time.perf_counter()
    for address in maps:
        api.check("cuMemHostRegister", c_void_p(address), SEGMENT, CU_MEMHOSTREGISTER_PORTABLE)
    seconds = time.perf_counter() - start
    return {"register_s_per_gib": round(seconds / (len(maps) * SEGMENT / GIB), 4),
            "device_bytes_taken": free_before - cuda.mem_get_info()[0]}


def copies_through(api: Api, cuda: Driver, maps: list[int], managed: int, direction: str) -> float:
    """Managed memory into the segments (out) or back (in), a segment a copy, on one stream."""
    stream = cuda.create_stream()

    def move() -> None:
        for k, address in enumerate(maps):
            if direction == "out":
                api.check("cuMemcpyDtoHAsync", c_void_p(address), managed + k * SEGMENT, SEGMENT, c_void_p(stream))
            else:
                api.check("cuMemcpyHtoDAsync", managed + k * SEGMENT, c_void_p(address), SEGMENT, c_void_p(stream))
    seconds = timed(cuda, stream, move)
    cuda.destroy_stream(stream)
    return seconds


def shared_child(directory: str, count: int) -> None:
    """The second process: maps the files the first one made, registers them, brings what the
    first one wrote into managed memory of its own and checks it, then copies it out again."""
    cuda = Driver()
    cuda.context(0)
    api = Api()
    libc = libc_for_maps()
    maps = map_shared(libc, shared_files(Path(directory), count))
    out = register_all(api, cuda, maps)
    nbytes = count * SEGMENT
    managed = cuda.alloc(nbytes, "managed")
    cuda.fill(managed, 9, nbytes // 4)
    cuda.synchronize()
    out["in_GBps"] = gbps(nbytes, copies_through(api, cuda, maps, managed, "in"))
    out["reads_what_the_first_wrote"] = check_words(cuda, managed, nbytes, 0x55550000, 0x66660000)
    out["out_GBps"] = gbps(nbytes, copies_through(api, cuda, maps, managed, "out"))
    for address in maps:
        api.check("cuMemHostUnregister", c_void_p(address))
    print(json.dumps(out), flush=True)


def shared(nbytes: int) -> dict:
    import threading

    cuda = Driver()
    cuda.context(0)
    api = Api()
    libc = libc_for_maps()
    count = max(2, nbytes // SEGMENT)
    nbytes = count * SEGMENT
    info = meminfo()
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    out: dict = {"bytes": nbytes, "segment": SEGMENT,
                 "shmem_thp": thp.read_text().strip() if thp.exists() else None,
                 "hugepages_free_bytes": info.get("HugePages_Free", 0) // 1024 * info.get("Hugepagesize", 0)}
    backings = [("shm", Path("/dev/shm"))]
    hugetlbfs = Path("/dev/hugepages")
    if out["hugepages_free_bytes"] >= nbytes and hugetlbfs.is_dir():
        backings.append(("hugetlbfs", hugetlbfs))
    managed = cuda.alloc(nbytes, "managed")
    for name, root in backings:
        directory = root / f"nvshare-probe-{os.getpid()}"
        directory.mkdir(mode=0o700)
        one: dict = {}
        try:
            fds = shared_files(directory, count)
            shmem_before = meminfo().get("Shmem", 0)
            half = count // 2
            start = time.perf_counter()
            for fd in fds[:half]:
                if libc.fallocate(fd, 0, 0, SEGMENT) != 0:
                    raise OSError(ctypes.get_errno(), "fallocate")
            one["fallocate_s_per_gib"] = round((time.perf_counter() - start) / (half * SEGMENT / GIB), 4)
            maps = map_shared(libc, fds)
            rest = maps[half:]
            start = time.perf_counter()
            failed: list[int] = []
            workers = [threading.Thread(target=lambda mine: failed.extend(
                a for a in mine if libc.madvise(c_void_p(a), SEGMENT, 23) != 0), args=(rest[k::4],)) for k in range(4)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            one["populate_4_threads_s_per_gib"] = (None if failed else
                                                   round((time.perf_counter() - start) / (len(rest) * SEGMENT / GIB), 4))
            after = meminfo()
            one["shmem_added_bytes"] = after.get("Shmem", 0) - shmem_before
            one["shmem_huge_pages_bytes"] = after.get("ShmemHugePages", 0)
            one.update(register_all(api, cuda, maps))
            cuda.fill(managed, 0x55550000, nbytes // 8)
            cuda.fill(managed + nbytes // 2, 0x66660000, nbytes // 4 - nbytes // 8)
            cuda.synchronize()
            one["out_GBps"] = gbps(nbytes, copies_through(api, cuda, maps, managed, "out"))
            one["in_GBps"] = gbps(nbytes, copies_through(api, cuda, maps, managed, "in"))
            one["intact"] = check_words(cuda, managed, nbytes, 0x55550000, 0x66660000)
            run = subprocess.run([sys.executable, __file__, "--shared-child", str(directory), str(count)],
                                 capture_output=True, text=True, timeout=300)
            one["second_process"] = (json.loads(run.stdout.splitlines()[-1]) if run.returncode == 0
                                     else {"error": run.stderr[-2000:]})
            for address in maps:
                api.check("cuMemHostUnregister", c_void_p(address))
                libc.munmap(c_void_p(address), SEGMENT)
            for fd in fds:
                os.close(fd)
        except (OSError, RuntimeError) as exc:
            one["error"] = str(exc)
        finally:
            for path in directory.iterdir():
                path.unlink()
            directory.rmdir()
        out[name] = one
    cuda.free(managed)
    return out


def in_child(part: str, nbytes: int) -> dict:
    """Each part in a process of its own: a clean context, and its memory gone afterwards."""
    run = subprocess.run([sys.executable, __file__, "--part", part, str(nbytes)], capture_output=True, text=True,
                         timeout=300)
    if run.returncode != 0:
        return {"error": run.stderr[-3000:]}
    return json.loads(run.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--parts", nargs="+", default=["engine", "overlap", "vmm", "pinning", "handoff", "shared"],
                        choices=("engine", "overlap", "vmm", "pinning", "handoff", "shared"))
    parser.add_argument("--part", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--overlap-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--handoff-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--shared-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shared_child:
        shared_child(args.shared_child[0], int(args.shared_child[1]))
        return
    if args.overlap_child:
        overlap_child(args.overlap_child)
        return
    if args.handoff_child:
        handoff_child(int(args.handoff_child[0]), args.handoff_child[1])
        return
    if args.part:
        part, nbytes = args.part[0], int(args.part[1])
        print(json.dumps({"engine": engine, "overlap": overlap, "vmm": vmm, "pinning": pinning,
                          "handoff": handoff, "shared": shared}[part](nbytes)))
        return
    nbytes = int(args.gib * GIB) // (2 << 20) * (2 << 20)
    started = time.monotonic()
    sizes = {"engine": nbytes, "overlap": nbytes // 2, "vmm": nbytes // 2, "pinning": nbytes // 2,
             "handoff": nbytes // 2, "shared": nbytes // 2}
    document = {"benchmark": "swap-paths", "gib": args.gib,
                **{part: in_child(part, sizes[part]) for part in args.parts}}
    document["elapsed_s"] = round(time.monotonic() - started, 1)
    text = write_document(document, args.out, "swap-paths.json")
    e = document.get("engine", {"error": "not run"})
    if "error" not in e:
        print(f"ceiling pinned: d2h {e['ceiling']['d2h_GBps']} GB/s, h2d {e['ceiling']['h2d_GBps']} GB/s",
              file=sys.stderr)
        for i, r in enumerate(e["engine"]):
            print(f"engine round {i}: out {r['out_GBps']} GB/s, in {r['in_GBps']} GB/s, discard {r.get('discard_s')}"
                  f" s, discard+prefetch {r.get('discard_prefetch_s')} s, intact {r['intact']}", file=sys.stderr)
        print(f"prefetch: {e['prefetch']}; pinned alloc {e['host_alloc_s_per_gib']} s/GiB, register "
              f"{e['host_register_s_per_gib']} s/GiB", file=sys.stderr)
    print(json.dumps({k: document[k] for k in ("overlap", "vmm", "pinning", "handoff", "shared")
                      if k in document}, indent=1),
          file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
