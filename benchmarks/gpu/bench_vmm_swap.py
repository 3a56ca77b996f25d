"""VMM memory swapped by the real scheduler, round after round, while programs grow and free memory
between rounds (issue 31): memory made with cuMemCreate/cuMemMap, which cannot be converted, under
nvshare's default policy (NVSHARE_VMM=swap).

    OUT=/tmp/out python benchmarks/gpu/bench_vmm_swap.py [--parts segments torch jax nccl] [--gib 4] [--rounds 10]
    python benchmarks/gpu/bench_vmm_swap.py --quick     # the simulated driver: the driver-level part only

Parts, each under a scheduler of its own (`on`, TQ 3 s, idle release 0.2 s) with a budget of
`--budget` x `--gib` per GPU, so that each handoff moves the idle program's memory out:

- segments: PyTorch's expandable segments without PyTorch (nvshare_py/testing/segments.py): one
  reserved range, 20 MiB handles (2 MiB with --quick) mapped side by side, one cuMemSetAccess per
  run, unmap+release one by one; two processes on device 0, `--gib` each. Runs on the simulated
  driver too (--quick).
- torch: PyTorch with `expandable_segments:True`; two processes on device 0.
- jax: JAX with XLA's BFC allocator (few large handles); two processes on device 0.
- nccl: two jobs of two ranks each (torch.distributed, NCCL, one GPU a rank; devices 0 and 1),
  `--gib` per rank; each job a gang, the other job forcing its memory out at each handoff. After
  each round's all_reduce its result is checked. NCCL_NVLS_ENABLE=0 (no NVLink multicast) is
  always set, and NCCL allocates with cuMem (NCCL_CUMEM_ENABLE=1). Needs two GPUs (skipped, saying
  so, with fewer). NCCL's buffers shared with the peer rank (exported) never move, by design.

Every round of every program: check every tensor (each word; segments: each handle's value), grow
(128-384 MiB; segments: 2-4 handles), free the oldest grown every other round (torch and jax also
empty their cache every third round), then compute nothing for a second so that the other program
is granted the device and this one is moved out. Meanwhile NVML is sampled (real GPU only), and
the scheduler's status: per round how many bytes NVML showed of the process while it was out, and
how many the process had swapped out then. `--vmm` sets NVSHARE_VMM (default: the library's);
every child's log (NVSHARE_LOG, default `info`; `debug` names every VMM call: `vmm:` lines) is
kept under $OUT/vmm-logs (or $NVSHARE_BENCH_LOGS).

Prints one JSON document (also $OUT/vmm-swap.json): per part and process each round's check, and
the scheduler's events; `ok` per part when every round of every process was intact, every
all_reduce right and no driver call failed; `swapped_rounds`: the rounds during whose pause the
process had memory out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402
from nvshare_py.testing.scheduler import DEFAULT_OPTIONS, SchedulerProcess, short_socket_dir  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
TORCH_HANDLE = 20 * MIB  # PyTorch's expandable segments map large blocks in handles of this size
# No NVLink multicast, ever: on a shared host it can put the GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# --- the children: one framework's process, one NCCL rank ----------------------------------------------


class TorchMemory:
    def __init__(self) -> None:
        import torch

        self.torch = torch

    def tensor(self, nbytes: int, value: int):
        return self.torch.full((nbytes // 4,), value, dtype=self.torch.int32, device="cuda")

    def holds(self, tensor, value: int) -> bool:
        return bool((tensor == value).all().item())

    def settle(self) -> None:
        self.torch.cuda.synchronize()

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()

    def reserved(self) -> int:
        return int(self.torch.cuda.memory_reserved())


class JaxMemory:
    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp

    def tensor(self, nbytes: int, value: int):
        return self.jnp.full((nbytes // 4,), value, dtype=self.jnp.int32).block_until_ready()

    def holds(self, tensor, value: int) -> bool:
        return bool(self.jnp.all(tensor == value))

    def settle(self) -> None:
        self.jnp.zeros(1).block_until_ready()

    def empty_cache(self) -> None:
        self.jax.clear_caches()

    def reserved(self) -> int:
        stats = self.jax.devices()[0].memory_stats() or {}
        return int(stats.get("bytes_reserved", stats.get("bytes_in_use", 0)))


def child(framework: str, nbytes: int, rounds: int) -> None:
    """Prints `round <r> intact=<0|1> reserved=<bytes> [allreduce=<0|1>] t=<monotonic>` per round,
    and `pause` / `resume` stamps around each idle second. framework `nccl`: a torch.distributed
    rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set), whose every round also all-reduces
    a tensor and checks the sum."""
    distributed = None
    if framework == "nccl":
        import torch
        import torch.distributed as distributed

        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        distributed.init_process_group("nccl", device_id=torch.device("cuda", local))
        rank, world = distributed.get_rank(), distributed.get_world_size()
    memory = JaxMemory() if framework == "jax" else TorchMemory()
    tag = 16 * int(os.environ.get("RANK", "0"))
    base = [(memory.tensor(nbytes // 4, 11 + tag + k), 11 + tag + k) for k in range(4)]
    grown: list[tuple[object, int]] = []
    for round_ in range(rounds):
        reduced = ""
        try:
            intact = all(memory.holds(tensor, value) for tensor, value in base + grown)
            if distributed is not None:
                summed = memory.tensor(4 * MIB, rank + 1 + round_)
                distributed.all_reduce(summed)
                expected = sum(r + 1 + round_ for r in range(world))
                reduced = f" allreduce={int(memory.holds(summed, expected))}"
            value = 100 + tag + round_
            grown.append((memory.tensor((128 << 20) * (1 + round_ % 3), value), value))
            if round_ % 2 == 1:
                grown.pop(0)
            if round_ % 3 == 2:
                memory.empty_cache()
            memory.settle()
            error = ""
        except Exception as failure:  # the framework's error names the refused driver call
            intact, error = False, f" error={type(failure).__name__}:{str(failure)[:300]!r}"
        print(f"round {round_} intact={int(intact)} reserved={memory.reserved()}{reduced}{error} "
              f"t={time.monotonic():.6f}", flush=True)
        if error:
            break
        print(f"pause t={time.monotonic():.6f}", flush=True)
        time.sleep(1.0)
        print(f"resume t={time.monotonic():.6f}", flush=True)
    if distributed is not None:
        distributed.destroy_process_group()


# --- the parent ------------------------------------------------------------------------------------


class NvmlSampler:
    """NVML's device memory per process and device, sampled every 50 ms on a thread (real GPU
    only: without NVML nothing is sampled)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (monotonic, pid, bytes on all devices)
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no NVML or no GPU
            self.nvml, self.handles = None, []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.nvml is not None and not self._stop.wait(0.05):
            now, used = time.monotonic(), {}
            try:
                for handle in self.handles:
                    for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        used[process.pid] = used.get(process.pid, 0) + (process.usedGpuMemory or 0)
            except self.nvml.NVMLError:
                continue
            self.samples.extend((now, pid, total) for pid, total in used.items())

    def least_between(self, pid: int, start: float, end: float) -> int | None:
        seen = [used for t, p, used in self.samples if p == pid and start <= t <= end]
        return min(seen) if seen else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class SwappedSampler:
    """What each client process told the scheduler it had swapped out, summed over its devices,
    sampled every 100 ms."""

    def __init__(self, scheduler: SchedulerProcess) -> None:
        self.scheduler = scheduler
        self.samples: list[tuple[float, int, int]] = []  # (monotonic, pid, bytes swapped out)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                clients = self.scheduler.status()["clients"]
            except Exception:  # the daemon is busy or going: the next sample
                continue
            now = time.monotonic()
            for client in clients:
                swapped = sum(pair.get("swapped", 0) for pair in client["devices"].values())
                self.samples.append((now, client["pid"], swapped))

    def most_between(self, pid: int, start: float, end: float) -> int:
        return max((s for t, p, s in self.samples if p == pid and start <= t <= end), default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def device_uuids(env: dict[str, str]) -> list[str]:
    code = "from nvshare_py.driver import Driver; print(' '.join(d.uuid for d in Driver().devices()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_rounds(lines: list[str], pid: int, nvml: NvmlSampler, swapped: SwappedSampler) -> list[dict]:
    """Each `round` line of a child, with what NVML showed of it and what it had swapped out
    during the pause after it."""
    rounds: list[dict] = []
    pause = 0.0
    for line in lines:
        words = dict(word.split("=", 1) for word in line.split()[1:] if "=" in word)
        if line.startswith("round"):
            entry: dict = {"round": int(line.split()[1]), "intact": words["intact"] == "1"}
            for key in ("reserved", "handles"):
                if key in words:
                    entry[key] = int(words[key])
            if words.get("bad", "-") != "-":
                entry["bad"] = words["bad"]
            if "allreduce" in words:
                entry["allreduce"] = words["allreduce"] == "1"
            if "error" in words:
                entry["error"] = words["error"]
            rounds.append(entry)
        elif line.startswith("pause"):
            pause = float(words["t"])
        elif line.startswith("resume") and rounds:
            rounds[-1]["nvml_bytes_while_out"] = nvml.least_between(pid, pause, float(words["t"]))
            rounds[-1]["swapped_while_out"] = swapped.most_between(pid, pause, float(words["t"]))
    return rounds


def run_part(part: str, nbytes: int, rounds: int, budget: float, library: Path, logs: Path, base_env: dict[str, str],
             vmm: str | None, nvml: NvmlSampler, quick: bool) -> dict:
    scheduler = SchedulerProcess(short_socket_dir(), {**DEFAULT_OPTIONS, "tq": 3.0, "idle_release": 0.2,
                                                      "log_level": "info"}).start()
    swapped = SwappedSampler(scheduler)
    try:
        env = {**base_env, **scheduler.env, **NO_MULTICAST, "LD_PRELOAD": str(library),
               "NVSHARE_LOG": os.environ.get("NVSHARE_LOG", "info"), "TORCH_SHOW_CPP_STACKTRACES": "1",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
               "XLA_PYTHON_CLIENT_ALLOCATOR": "bfc", "NCCL_CUMEM_ENABLE": "1"}
        if vmm:
            env["NVSHARE_VMM"] = vmm
        devices = device_uuids({**base_env, "PYTHONPATH": str(ROOT)})
        used = devices[:2] if part == "nccl" else devices[:1]
        if len(used) < (2 if part == "nccl" else 1):
            return {"skipped": f"needs {2 if part == 'nccl' else 1} GPUs, found {len(devices)}", "ok": None}
        for device in used:
            scheduler.request("set-budget", device=device, bytes=int(budget * nbytes))
        # (name, argv, extra environment) of each process: two programs, or two jobs of two ranks
        programs: list[tuple[str, list[str], dict[str, str]]] = []
        if part == "segments":
            handle = 2 * MIB if quick else TORCH_HANDLE
            for k in range(2):
                programs.append((f"segments-{k}", [sys.executable, "-m", "nvshare_py.testing.segments", "--handles",
                                                   str(max(3, nbytes // handle)), "--handle-bytes", str(handle),
                                                   "--rounds", str(rounds), "--pause", "1.0", "--tag", str(k + 1)],
                                 {"PYTHONPATH": str(ROOT)}))
        elif part == "nccl":
            for job in range(2):
                port = str(free_port())
                for rank in range(2):
                    programs.append((f"nccl-{job}-{rank}", [sys.executable, __file__, "--child", "nccl", str(nbytes),
                                                            str(rounds)],
                                     {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
                                      "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}))
        else:
            for k in range(2):
                argv = [sys.executable, __file__, "--child", part, str(nbytes), str(rounds)]
                programs.append((f"{part}-{k}", argv, {}))
        children = []
        for name, argv, extra in programs:
            log = open(logs / f"{name}.log", "w+")
            children.append((name, subprocess.Popen(argv, env={**env, **extra}, stdout=subprocess.PIPE, stderr=log,
                                                    text=True, cwd=ROOT), log))
        results = []
        for name, process, log in children:
            lines = process.stdout.read().splitlines()
            process.wait(timeout=900)
            log.seek(0)
            text = log.read()
            found = read_rounds(lines, process.pid, nvml, swapped)
            refused = [line for line in text.splitlines() if "failed" in line and "cuMem" in line]
            results.append({"name": name, "pid": process.pid, "exit": process.returncode, "rounds": found,
                            "swapped_rounds": sum(1 for r in found if r.get("swapped_while_out", 0) > 0),
                            "refused_driver_calls": refused[:20],
                            "log_tail": text[-1500:] if process.returncode else ""})
        kinds: dict[str, int] = {}
        for event in scheduler.events():
            kinds[event.get("kind", "?")] = kinds.get(event.get("kind", "?"), 0) + 1
        return {"processes": results, "events": kinds, "budget": int(budget * nbytes),
                "ok": all(p["exit"] == 0 and len(p["rounds"]) == rounds and not p["refused_driver_calls"]
                          and all(r["intact"] and r.get("allreduce", True) for r in p["rounds"]) for p in results)}
    finally:
        swapped.stop()
        scheduler.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["segments", "torch", "jax", "nccl"],
                        choices=("segments", "torch", "jax", "nccl"))
    parser.add_argument("--gib", type=float, default=4.0, help="memory of each program (each rank)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--budget", type=float, default=1.5, help="the budget per GPU, in --gib")
    parser.add_argument("--vmm", choices=("swap", "allow", "hide"), help="NVSHARE_VMM for the children")
    parser.add_argument("--quick", action="store_true",
                        help="the simulated driver: the segments part, 64 MiB of 2 MiB handles each")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="nvs-vmm-swap-"))
    logs = Path(os.environ.get("NVSHARE_BENCH_LOGS") or out / "vmm-logs")
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nvs-vmm-swap-build-"))
    library = benchmark_library(ROOT, work / "lib")
    env = dict(os.environ)
    if args.quick:
        from nvshare_py.testing.simcuda import build_simcuda

        args.parts, args.gib = ["segments"], 0.0625
        (work / "machine").mkdir()
        env = build_simcuda(ROOT, work / "sim").env(memory="1G", SIMCUDA_RESIDENCY_DIR=str(work / "machine"))
    nbytes = int(args.gib * GIB) // (2 * MIB) * (2 * MIB)
    nvml = NvmlSampler()
    document: dict = {"benchmark": "vmm-swap", "quick": args.quick, "gib": args.gib, "rounds": args.rounds,
                      "budget": args.budget, "vmm": args.vmm or "default"}
    for part in args.parts:
        started = time.monotonic()
        try:
            document[part] = run_part(part, nbytes, args.rounds, args.budget, library, logs, env, args.vmm, nvml,
                                      args.quick)
        except Exception as failure:  # one part failing leaves the others' results
            document[part] = {"error": repr(failure)[:2000], "ok": False}
        document[part]["elapsed_s"] = round(time.monotonic() - started, 1)
        swapped = [p["swapped_rounds"] for p in document[part].get("processes", [])]
        print(f"{part}: ok={document[part].get('ok')} swapped rounds per process={swapped}", file=sys.stderr,
              flush=True)
        (out / "vmm-swap.json").write_text(json.dumps(document, indent=1) + "\n")  # what ran so far survives
    nvml.stop()
    text = json.dumps(document, indent=1)
    (out / "vmm-swap.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
