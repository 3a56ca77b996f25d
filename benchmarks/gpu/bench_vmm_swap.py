"""VMM memory swapped by the real scheduler, round after round, while the program grows and frees
memory between rounds (issue 31): PyTorch with `expandable_segments:True` and JAX with XLA's own
allocator, whose memory is made with cuMemCreate/cuMemMap and cannot be converted.

    OUT=/tmp/out python benchmarks/gpu/bench_vmm_swap.py [--frameworks torch jax] [--gib 4] [--rounds 10]

Two processes of one framework share device 0 under the real scheduler (`on`, TQ 3 s, idle release
0.2 s) with a budget of 1.5 x `--gib`, so that each handoff moves one of them out. Each process
holds `--gib` in tensors of known values and, every round: checks every tensor (each word), then
grows (a new tensor of 128-384 MiB), frees its oldest grown tensor every other round and empties
its allocator's cache every third round (the allocator unmaps and releases handles, or maps new
ones next to those that were swapped), and then computes nothing for a second, so that the other
process is granted the device and this one is moved out. Meanwhile NVML is sampled: what the
process keeps on the device while it is out. `NVSHARE_VMM` is left as the library's default unless
`--vmm` names a policy; every child's log (NVSHARE_LOG, default `info`; `debug` names every VMM
call) is kept under $OUT/vmm-logs (or $NVSHARE_BENCH_LOGS).

Prints one JSON document (also $OUT/vmm-swap.json): per framework and process each round's check,
how much NVML showed of the process while it was out, and the scheduler's evictions; `ok` when
every round of every process was intact and no driver call failed.
"""

from __future__ import annotations

import argparse
import json
import os
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


# --- the child: one framework's process ---------------------------------------------------------------


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
    """Prints `round <r> intact=<0|1> reserved=<bytes> t=<monotonic>` per round, and `pause` /
    `resume` stamps around each idle second."""
    memory = TorchMemory() if framework == "torch" else JaxMemory()
    base = [(memory.tensor(nbytes // 4, 11 + k), 11 + k) for k in range(4)]
    grown: list[tuple[object, int]] = []
    for round_ in range(rounds):
        try:
            intact = all(memory.holds(tensor, value) for tensor, value in base + grown)
            value = 100 + round_
            grown.append((memory.tensor((128 << 20) * (1 + round_ % 3), value), value))
            if round_ % 2 == 1:
                grown.pop(0)
            if round_ % 3 == 2:
                memory.empty_cache()
            memory.settle()
            error = ""
        except Exception as failure:  # the framework's error names the refused driver call
            intact, error = False, f" error={type(failure).__name__}:{str(failure)[:300]!r}"
        print(f"round {round_} intact={int(intact)} reserved={memory.reserved()}{error} t={time.monotonic():.6f}",
              flush=True)
        if error:
            break
        print(f"pause t={time.monotonic():.6f}", flush=True)
        time.sleep(1.0)
        print(f"resume t={time.monotonic():.6f}", flush=True)


# --- the parent ------------------------------------------------------------------------------------


class NvmlSampler:
    """NVML's device memory per process, sampled every 50 ms on a thread (real GPU only)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (monotonic, pid, bytes)
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML or no GPU: nothing sampled
            self.nvml = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.nvml is not None and not self._stop.wait(0.05):
            try:
                for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                    self.samples.append((time.monotonic(), process.pid, process.usedGpuMemory or 0))
            except self.nvml.NVMLError:
                pass

    def least_between(self, pid: int, start: float, end: float) -> int | None:
        seen = [used for t, p, used in self.samples if p == pid and start <= t <= end]
        return min(seen) if seen else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def uuid_of_device_0(env: dict[str, str]) -> str:
    code = "from nvshare_py.driver import Driver; print(Driver().devices()[0].uuid)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()[-1]


def run_framework(framework: str, nbytes: int, rounds: int, library: Path, logs: Path, vmm: str | None,
                  sampler: NvmlSampler) -> dict:
    scheduler = SchedulerProcess(short_socket_dir(), {**DEFAULT_OPTIONS, "tq": 3.0, "idle_release": 0.2,
                                                      "log_level": "info"}).start()
    try:
        env = {**scheduler.env, "LD_PRELOAD": str(library), "NVSHARE_LOG": os.environ.get("NVSHARE_LOG", "info"),
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_SHOW_CPP_STACKTRACES": "1",
               "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}
        if vmm:
            env["NVSHARE_VMM"] = vmm
        device = uuid_of_device_0({**os.environ, "PYTHONPATH": str(ROOT)})
        scheduler.request("set-budget", device=device, bytes=int(1.5 * nbytes))
        children = []
        for k in range(2):
            log = open(logs / f"{framework}-{k}.log", "w+")
            children.append((subprocess.Popen([sys.executable, __file__, "--child", framework, str(nbytes), str(rounds)],
                                              env=env, stdout=subprocess.PIPE, stderr=log, text=True), log))
        results = []
        for process, log in children:
            lines = process.stdout.read().splitlines()
            process.wait(timeout=600)
            log.seek(0)
            text = log.read()
            rounds_seen, pauses = [], {}
            for line in lines:
                words = dict(word.split("=", 1) for word in line.split()[1:] if "=" in word)
                if line.startswith("round"):
                    rounds_seen.append({"round": int(line.split()[1]), "intact": words["intact"] == "1",
                                        "reserved": int(words["reserved"]), **({"error": words["error"]}
                                                                               if "error" in words else {})})
                elif line.startswith("pause"):
                    pauses["start"] = float(words["t"])
                elif line.startswith("resume") and rounds_seen:
                    rounds_seen[-1]["nvml_bytes_while_out"] = sampler.least_between(process.pid, pauses["start"],
                                                                                    float(words["t"]))
            refused = [line for line in text.splitlines() if "failed" in line and "cuMem" in line]
            results.append({"pid": process.pid, "exit": process.returncode, "rounds": rounds_seen,
                            "refused_driver_calls": refused[:20], "log_tail": text[-1500:] if process.returncode else ""})
        events = scheduler.events()
        kinds: dict[str, int] = {}
        for event in events:
            kinds[event.get("kind", "?")] = kinds.get(event.get("kind", "?"), 0) + 1
        return {"processes": results, "events": kinds,
                "ok": all(p["exit"] == 0 and len(p["rounds"]) == rounds and all(r["intact"] for r in p["rounds"])
                          and not p["refused_driver_calls"] for p in results)}
    finally:
        scheduler.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", nargs="+", default=["torch", "jax"], choices=("torch", "jax"))
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--vmm", choices=("allow", "swap", "hide"), help="NVSHARE_VMM for the children")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="nvs-vmm-swap-"))
    logs = Path(os.environ.get("NVSHARE_BENCH_LOGS") or out / "vmm-logs")
    logs.mkdir(parents=True, exist_ok=True)
    library = benchmark_library(ROOT, Path(tempfile.mkdtemp(prefix="nvs-vmm-swap-build-")))
    nbytes = int(args.gib * GIB) // (2 * MIB) * (2 * MIB)
    sampler = NvmlSampler()
    document: dict = {"benchmark": "vmm-swap", "gib": args.gib, "rounds": args.rounds, "vmm": args.vmm or "default"}
    for framework in args.frameworks:
        started = time.monotonic()
        try:
            document[framework] = run_framework(framework, nbytes, args.rounds, library, logs, args.vmm, sampler)
        except Exception as failure:  # one framework failing leaves the other's result
            document[framework] = {"error": repr(failure)[:2000], "ok": False}
        document[framework]["elapsed_s"] = round(time.monotonic() - started, 1)
        print(f"{framework}: ok={document[framework].get('ok')}", file=sys.stderr, flush=True)
    sampler.stop()
    text = json.dumps(document, indent=1)
    (out / "vmm-swap.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
