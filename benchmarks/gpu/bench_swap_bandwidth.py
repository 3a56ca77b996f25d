"""Swap-out and swap-in bandwidth of real lock handoffs against the link's ceiling measured in the
same run (issue 18 target: at least 80 % of pinned cudaMemcpy, both ways, the first eviction of a
process included).

    python benchmarks/gpu/bench_swap_bandwidth.py [--gib 16] [--rounds 3] [--vmm-gib 4] [--out FILE]
    python benchmarks/gpu/bench_swap_bandwidth.py --quick    # the simulated driver (tests/simcuda), at
                                                              # H200 costs x SIM_COST_SCALE

Builds libnvshare.so from this tree (or uses $NVSHARE_LIBRARY). One process per part, one after
the other, so that at most `--gib` of device memory is in use at once:

1. `ceiling`, no nvshare: `--gib` of pinned host memory (cuMemHostAlloc, its cost per GiB), and
   cuMemAlloc memory copied into it and back (cuMemcpyDtoHAsync/HtoDAsync, the better of two
   each): what the link moves. Then managed memory of the same size written on the device and
   prefetched to the host (the process's first eviction: the host's pages are populated), back,
   to the host again (a later eviction) and back: the path swapping took before issue 18.
2. `engine`: one process under the interceptor with `--gib` allocated by cuMemAlloc (converted to
   managed memory). The scheduler is a script in this process (a pyzmq ROUTER speaking
   docs/protocol.md), so that each residency message goes out exactly when measured. It sends
   PREPARE bytes=<all> and waits until MEMORY says the pinned area is ready (allocating it is
   paid once, ahead of handoffs, as the real scheduler arranges), then per round: DROP evict=<all>
   (swap-out: until its RELEASE), then GRANT prefetch=<all> to the process, which waits at the
   gate reading one word (swap-in: until the read returns; the gate opens only once everything
   is back). Every round writes a new value first and checks it afterwards (1,024 words spread
   over the buffer). Round 0 is the process's first eviction.
3. `vmm` and `torch`: the same with `--vmm-gib` of VMM memory (swapped by default, NVSHARE_VMM=swap): one handle
   made with cuMemCreate/cuMemMap through nvshare_py.driver (sampled check), then (where
   PyTorch is installed, not with --quick) a PyTorch process with
   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, whose allocator reserves through
   cuMemCreate/cuMemMap in 20 MiB handles (checked in full: min and max of the tensor). On a real
   GPU, NVML's memory for the process before each swap-out and after it (target: none of the
   buffer left on the device). `--vmm-gib 0` skips both.

Each part's result is printed (stderr) and written out as soon as it is measured; a part that
fails is recorded with its error (the child's stderr, where the interceptor's warnings name a
refused driver call) and the next part still runs.

Prints a short table (stderr) and one JSON document (stdout), also written to --out, else to
$OUT/swap_bandwidth.json when $OUT is set, else (with --quick) to
benchmarks/results/swap-bandwidth-<date>-quick.json. Safety: `--gib` is refused above a third of
the device's free memory.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from ctypes import byref, c_void_p
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402
from nvshare_py.testing.scripted import ScriptedScheduler  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
PATIENCE_MS = 120_000
CHECKED_WORDS = 1024
TARGET = 0.8  # of the ceiling
# --quick: the simulated driver's H200 costs times this, a link of about 1.4 GB/s in the same
# proportions, so that what it models outweighs the real copying of the bytes on this machine.
SIM_COST_SCALE = 40


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


# --- 1. the ceiling, without nvshare ---------------------------------------------------------


def ceiling(nbytes: int) -> dict:
    from bench_swap_paths import Api, Location, timed  # noqa: PLC0415 (this directory)

    from nvshare_py.driver import Driver

    cuda = Driver()
    cuda.context(0)
    api = Api()
    free, _ = cuda.mem_get_info()
    if nbytes > free // 3:
        raise SystemExit(f"{nbytes} bytes is more than a third of the free memory ({free}): lower --gib")
    stream = cuda.create_stream()
    words = nbytes // 4
    out: dict = {"driver": cuda.version, "discard_entry_points": {
        name: api.status[name] for name in ("cuMemDiscardBatchAsync", "cuMemDiscardAndPrefetchBatchAsync")}}
    pinned = c_void_p()
    start = time.perf_counter()
    api.check("cuMemHostAlloc", byref(pinned), nbytes, 0)
    out["pin_s_per_gib"] = round((time.perf_counter() - start) / (nbytes / GIB), 3)
    device = cuda.alloc(nbytes, "plain")
    cuda.fill(device, 7, words)
    d2h = min(timed(cuda, stream, lambda: api.check("cuMemcpyDtoHAsync", pinned, device, nbytes, c_void_p(stream)))
              for _ in range(2))
    h2d = min(timed(cuda, stream, lambda: api.check("cuMemcpyHtoDAsync", device, pinned, nbytes, c_void_p(stream)))
              for _ in range(2))
    out["pinned_d2h_GBps"], out["pinned_h2d_GBps"] = gbps(nbytes, d2h), gbps(nbytes, h2d)
    cuda.free(device)
    api.check("cuMemFreeHost", pinned)

    managed = cuda.alloc(nbytes, "managed")
    cuda.fill(managed, 5, words)  # made on the device: no host pages yet

    def prefetch(where: int) -> float:
        return timed(cuda, stream, lambda: api.check("cuMemPrefetchAsync", managed, nbytes, Location(where, 0), 0,
                                                     c_void_p(stream)))

    host, on_device = 2, 1  # CU_MEM_LOCATION_TYPE_HOST, _DEVICE
    first_out, first_in, later_out, later_in = prefetch(host), prefetch(on_device), prefetch(host), prefetch(on_device)
    out["managed_prefetch"] = {"to_host_first_GBps": gbps(nbytes, first_out), "to_host_later_GBps": gbps(nbytes, later_out),
                               "to_device_GBps": gbps(nbytes, min(first_in, later_in))}
    cuda.free(managed)
    return out


# --- 2 and 3: a process under the interceptor, swapped by a scripted scheduler -----------------------


class Buffer:
    """`nbytes` of device memory of one family, written and checked by value."""

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind = kind
        if kind == "torch":
            import torch

            self.torch = torch
            self.tensor = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
            # The check's own allocations (the reductions' outputs and buffers) are made now, and
            # stay cached: after a swap-in the check maps nothing new (`grow` below does).
            self.holds(0)
            return
        from nvshare_py.driver import Driver

        self.cuda = Driver(via="dlsym")
        self.cuda.context(0)
        self.nbytes = nbytes
        self.ptr = self.cuda.alloc(nbytes, "plain" if kind == "converted" else "vmm")

    def fill(self, value: int) -> None:
        if self.kind == "torch":
            self.tensor.fill_(value)
            self.torch.cuda.synchronize()
        else:
            self.cuda.fill(self.ptr, value, self.nbytes // 4)
            self.cuda.synchronize()

    def first_word(self) -> int:
        """Reads one word: a call through the gate, which opens once the memory is back."""
        if self.kind == "torch":
            return int(self.tensor[0].item())
        return int.from_bytes(self.cuda.memcpy_dtoh(self.ptr, 4), "little")

    def holds(self, value: int) -> bool:
        if self.kind == "torch":  # every word: the smallest and the largest are the value
            return int(self.tensor.min().item()) == value == int(self.tensor.max().item())
        step = self.nbytes // CHECKED_WORDS // 4 * 4
        return all(int.from_bytes(self.cuda.memcpy_dtoh(self.ptr + k * step, 4), "little") == value
                   for k in range(CHECKED_WORDS))


def child(kind: str, nbytes: int, rounds: int) -> None:
    """Told on stdin when to go on; prints what happened with CLOCK_MONOTONIC stamps."""
    buffer = Buffer(kind, nbytes)

    def say(*words) -> None:
        print(*words, f"t={time.monotonic():.6f}", flush=True)

    for round_ in range(rounds):
        buffer.fill(round_ + 1)
        say("resident", round_)
        sys.stdin.readline()          # the parent sent DROP evict= and saw the RELEASE
        first = buffer.first_word()   # waits at the gate for the GRANT's swap-in
        say("back", round_, f"first={first}")
        say("checked", round_, f"intact={int(first == round_ + 1 and buffer.holds(round_ + 1))}")
    if kind == "torch":  # after the swap-ins: the allocator maps new memory beside the swapped one
        try:
            grown = buffer.torch.ones(64 << 20, dtype=buffer.torch.uint8, device="cuda")
            ok = int(grown.sum().item()) == 64 << 20
        except RuntimeError as failure:
            print(f"growing after the swap-ins failed: {failure}", file=sys.stderr, flush=True)
            ok = False
        say("grow", f"ok={int(ok)}")


def child_log(process: subprocess.Popen) -> str:
    """The end of a child's log (its stderr, a file)."""
    process.stderr.seek(0)
    return process.stderr.read()[-3000:]


def line_of(process: subprocess.Popen, prefix: str) -> tuple[dict[str, str], float]:
    while True:
        line = process.stdout.readline()
        if not line:
            raise SystemExit(f"the process ended before {prefix!r}: {child_log(process)}")
        if line.startswith(prefix):
            fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
            return fields, float(fields["t"])


class Nvml:
    """The device memory NVML counts for a process (real GPU only; None where it cannot tell)."""

    def __init__(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML, or no GPU: nothing to report
            self.nvml = None

    def used_by(self, pid: int) -> int | None:
        if self.nvml is None:
            return None
        try:
            processes = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            return None
        return next((p.usedGpuMemory for p in processes if p.pid == pid), None)


def handoffs(kind: str, nbytes: int, rounds: int, library: Path, env: dict[str, str], nvml: Nvml | None) -> dict:
    script = ScriptedScheduler(PATIENCE_MS)
    env = {**env, **script.env, "LD_PRELOAD": str(library), "NVSHARE_LOG": os.environ.get("NVSHARE_LOG", "warn")}
    if kind == "torch":  # its allocator reserves through cuMemCreate/cuMemMap; a failure names its C++ frames
        env.update(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", TORCH_SHOW_CPP_STACKTRACES="1")
    # Its log goes to a file: at NVSHARE_LOG=debug it outgrows a pipe nobody reads meanwhile.
    # $NVSHARE_BENCH_LOGS: a folder to keep it in.
    logs = Path(os.environ.get("NVSHARE_BENCH_LOGS") or tempfile.mkdtemp(prefix="nvs-swap-bandwidth-"))
    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / f"{kind}.log", "w+")
    process = subprocess.Popen([sys.executable, __file__, "--child", kind, str(nbytes), str(rounds)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    process.stderr = log  # read back on failure (line_of), from its start
    grant, measured = 1, []
    try:
        script.expect("ACQUIRE")
        script.send("GRANT", device=script.device, grant=grant, mode="on", exclusive=1, quantum_ms=600_000)
        line_of(process, "resident")
        # The area is paid once, before the first handoff (the scheduler's PREPARE).
        prepared = script.send("PREPARE", device=script.device, bytes=nbytes)
        while int(script.expect("MEMORY").get("area", 0)) < nbytes:
            pass
        area_s = script.received - prepared
        for round_ in range(rounds):
            if round_ > 0:
                line_of(process, "resident")
            on_device = nvml.used_by(process.pid) if nvml else None
            drop_sent = script.send("DROP", device=script.device, grant=grant, grace_ms=600_000, reason="quantum",
                                    evict=nbytes)
            release = script.expect("RELEASE")
            released = script.received
            after_out = nvml.used_by(process.pid) if nvml else None
            process.stdin.write("\n")
            process.stdin.flush()
            script.expect("ACQUIRE")
            grant += 1
            grant_sent = script.send("GRANT", device=script.device, grant=grant, mode="on", exclusive=1,
                                     quantum_ms=600_000, prefetch=nbytes)
            _, back = line_of(process, "back")
            checked, _ = line_of(process, "checked")
            measured.append({"out_s": round(released - drop_sent, 4), "in_s": round(back - grant_sent, 4),
                             "resident_after_release": int(release.get("resident", -1)),
                             "intact": checked["intact"] == "1",
                             "nvml_process_bytes_before_after_out": [on_device, after_out]})
        grow = line_of(process, "grow")[0]["ok"] == "1" if kind == "torch" else None
        process.stdin.close()
        if process.wait(timeout=PATIENCE_MS / 1000) != 0:
            raise SystemExit(f"the process failed: {child_log(process)}")
        # The engine's own figures, as its last MEMORY said them.
        while script.socket.poll(200):
            script.seen.append(script.socket.recv_multipart()[-1].decode())
        last = [text for text in script.seen if text.startswith("NVSHARE/1 MEMORY\n")][-1]
        memory = dict(line.split("=", 1) for line in last.split("\n")[1:])
        figures = {key: memory.get(key) for key in ("engine", "area", "out_bps", "in_bps")}
    finally:
        if process.poll() is None:
            process.kill()
        script.close()
        log.close()
    for one in measured:
        one["out_GBps"], one["in_GBps"] = gbps(nbytes, one["out_s"]), gbps(nbytes, one["in_s"])
    later = measured[1:] or measured
    return {"kind": kind, "bytes": nbytes, "area_ready_s": round(area_s, 3), "memory_report": figures,
            "new_allocation_after_swap_ins_ok": grow,
            "rounds": measured,
            "out_first_GBps": measured[0]["out_GBps"], "in_first_GBps": measured[0]["in_GBps"],
            "out_later_GBps": round(statistics.median(r["out_GBps"] for r in later), 2),
            "in_later_GBps": round(statistics.median(r["in_GBps"] for r in later), 2),
            "intact": all(r["intact"] for r in measured)}


def in_child(function: str, nbytes: int, env: dict[str, str]) -> dict:
    run = subprocess.run([sys.executable, __file__, "--part", function, str(nbytes)], env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode != 0:
        raise SystemExit(f"{function} failed: {run.stderr[-3000:]}")
    return json.loads(run.stdout.splitlines()[-1])


def torch_available(env: dict[str, str]) -> bool:
    return subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"], env=env,
                          capture_output=True).returncode == 0


PARTS = ("engine", "vmm", "torch")  # the handoff parts, beside the ceiling


def ratios(document: dict) -> None:
    top = document["ceiling"]
    for part in PARTS:
        measured = document.get(part)
        if not measured or "error" in measured or "error" in top:
            continue
        for when in ("first", "later"):
            measured[f"out_{when}_vs_ceiling"] = round(measured[f"out_{when}_GBps"] / top["pinned_d2h_GBps"], 3)
            measured[f"in_{when}_vs_ceiling"] = round(measured[f"in_{when}_GBps"] / top["pinned_h2d_GBps"], 3)
        measured["target_met"] = measured["intact"] and all(
            measured[f"{way}_{when}_vs_ceiling"] >= TARGET for way in ("out", "in") for when in ("first", "later"))


def table(document: dict) -> str:
    top = document["ceiling"]
    lines = [f"{'path':<34}{'out GB/s':>10}{'in GB/s':>10}{'out/ceil':>10}{'in/ceil':>10}"]
    if "error" in top:
        lines.append(f"ceiling: FAILED {top['error'][-300:]}")
    else:
        managed = top["managed_prefetch"]
        lines += [f"{'pinned cudaMemcpy (ceiling)':<34}{top['pinned_d2h_GBps']:>10.2f}{top['pinned_h2d_GBps']:>10.2f}",
                  f"{'managed prefetch, first eviction':<34}{managed['to_host_first_GBps']:>10.2f}"
                  f"{managed['to_device_GBps']:>10.2f}",
                  f"{'managed prefetch, later':<34}{managed['to_host_later_GBps']:>10.2f}"
                  f"{managed['to_device_GBps']:>10.2f}"]
    for part in PARTS:
        m = document.get(part)
        if m is None:
            continue
        if "error" in m:
            lines.append(f"{part}: FAILED {m['error'][-600:]}")
            continue
        for when in ("first", "later"):
            label = f"{part}, {when} eviction"
            lines.append(f"{label:<34}{m[f'out_{when}_GBps']:>10.2f}{m[f'in_{when}_GBps']:>10.2f}"
                         f"{m.get(f'out_{when}_vs_ceiling', float('nan')):>10.2f}"
                         f"{m.get(f'in_{when}_vs_ceiling', float('nan')):>10.2f}")
        lines.append(f"  {part}: intact {m['intact']}, area ready in {m['area_ready_s']} s, engine "
                     f"{m['memory_report']['engine']}, target {'met' if m.get('target_met') else 'MISSED'}; NVML "
                     f"bytes of the process before/after each swap-out "
                     f"{[r['nvml_process_bytes_before_after_out'] for r in m['rounds']]}"
                     + ("" if m.get("new_allocation_after_swap_ins_ok") is None else
                        f"; a new allocation after the swap-ins {'worked' if m['new_allocation_after_swap_ins_ok'] else 'FAILED'}"))
    if "error" not in top:
        lines.append(f"pinning {top['pin_s_per_gib']} s/GiB")
    return "\n".join(lines)


def attempt(name: str, measure) -> dict:
    """One part; a failure is recorded (and the next part still runs)."""
    try:
        result = measure()
    except (Exception, SystemExit) as failure:  # a child that failed, a driver that refused
        result = {"error": f"{type(failure).__name__}: {failure}"}
    print(f"{name}: {json.dumps(result)[:2000]}", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--vmm-gib", type=float, default=4.0, help="VMM memory for the vmm parts (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the simulated driver, 256 MiB (64 MiB of VMM memory)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--part", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    if args.part:
        print(json.dumps({"ceiling": ceiling}[args.part[0]](int(args.part[1]))))
        return

    work = Path(tempfile.mkdtemp(prefix="nvs-swap-bw-"))
    env = dict(os.environ)
    if args.quick:
        from nvshare_py.testing.simcuda import build_simcuda

        args.gib, args.vmm_gib = 0.25, 0.0625
        (work / "machine").mkdir()
        env = build_simcuda(ROOT, work / "sim").env(memory="2G", SIMCUDA_RESIDENCY_DIR=str(work / "machine"),
                                              SIMCUDA_COST_SCALE=str(SIM_COST_SCALE))
    nbytes = int(args.gib * GIB) // (2 * MIB) * (2 * MIB)
    vmm_bytes = int(args.vmm_gib * GIB) // (2 * MIB) * (2 * MIB)
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "swap_bandwidth.json"
    if out is None and args.quick:
        out = ROOT / "benchmarks" / "results" / f"swap-bandwidth-{datetime.date.today().isoformat()}-quick.json"
    started = time.monotonic()
    document: dict = {"benchmark": "swap-bandwidth", "quick": args.quick, "gib": args.gib, "vmm_gib": args.vmm_gib,
                      "rounds": args.rounds, "date": datetime.date.today().isoformat()}

    def record(name: str, measure) -> None:
        document[name] = attempt(name, measure)
        if out is not None:  # what was measured so far survives a later failure
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(document, indent=1) + "\n")

    library = benchmark_library(ROOT, work / "lib")
    nvml = None if args.quick else Nvml()
    record("ceiling", lambda: in_child("ceiling", nbytes, env))
    record("engine", lambda: handoffs("converted", nbytes, args.rounds, library, env, None))
    if vmm_bytes:
        record("vmm", lambda: handoffs("vmm", vmm_bytes, args.rounds, library, env, nvml))
        if not args.quick and torch_available(env):
            record("torch", lambda: handoffs("torch", vmm_bytes, args.rounds, library, env, nvml))
    document["elapsed_s"] = round(time.monotonic() - started, 1)
    ratios(document)
    print(table(document), file=sys.stderr)
    text = json.dumps(document, indent=1)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
