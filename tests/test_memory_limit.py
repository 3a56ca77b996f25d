"""NVSHARE_MEMORY_LIMIT on the simulated driver: an allocation past the limit fails at once with
CUDA_ERROR_OUT_OF_MEMORY and the program goes on; frees give the budget back; threads never
pass it together; cuMemGetInfo, cuDeviceTotalMem and NVML show a device of the limit's size;
without a limit nothing changes; a malformed limit is refused loudly, never ignored."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Limits, not admission: the programs here allocate past the device (oversubscription), which
# admission would weigh against the host's memory.
pytestmark = pytest.mark.scheduler_options(admission_spill="off")

MiB, GiB = 1 << 20, 1 << 30
SIM_TOTAL = 16 * GiB
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
DEVICE0 = "GPU-5151ad00-0000-4000-8000-000000000000"
DEVICE1 = "GPU-5151ad00-0000-4000-8000-000000000001"

# A CUDA program driven by its arguments (one step each); prints one JSON list of the results.
#   alloc:FAMILY:BYTES  free:N (the Nth allocation that succeeded)  free-async-after:US:BYTES
#   meminfo  total  nvml  use:DEV  threads:COUNT:BYTES (each thread allocates until refused)
PROGRAM = r"""
import ctypes, json, os, sys, threading
from nvshare_py.driver import Driver, DriverError

cuda = Driver(via=os.environ.get("NVS_APP_VIA", "dlsym"))
cuda.context(0)
results, pointers = [], []

def attempt(family, size):
    try:
        pointer = cuda.alloc(size, family) if family != "pitch" else cuda.alloc_pitch(size, 1)[0]
    except DriverError as error:
        return {"error": error.code}
    pointers.append(pointer)
    return {"ok": True}

for step in sys.argv[1:]:
    name, *args = step.split(":")
    if name == "alloc":
        results.append(attempt(args[0], int(args[1])))
    elif name == "free":
        cuda.free(pointers[int(args[0])])
        results.append({"freed": int(args[0])})
    elif name == "free-async-after":
        # a stream-ordered free behind slow work: the budget comes back when that work is done
        ptr = cuda.alloc(int(args[1]), "async")
        cuda.launch_sleep(int(args[0]))
        cuda.free(ptr)
        results.append({"freed-async": True})
    elif name == "use":
        cuda.context(int(args[0]))
    elif name == "meminfo":
        free, total = cuda.mem_get_info()
        results.append({"free": free, "total": total})
    elif name == "total":
        results.append({"totals": [d.total_memory for d in cuda.devices()]})
    elif name == "nvml":
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(args[0]) if args else 0)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        results.append({"v1": [v1.total, v1.free, v1.used], "v2": [v2.total, v2.reserved, v2.free, v2.used]})
        pynvml.nvmlShutdown()
    elif name == "threads":
        count, size = int(args[0]), int(args[1])
        got = [0] * count
        start = threading.Barrier(count)
        def run(i):
            cuda.context(0)
            start.wait()
            while "ok" in attempt("plain", size):
                got[i] += 1
        threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
        for t in threads: t.start()
        for t in threads: t.join()
        results.append({"allocated": sum(got), "threads_that_allocated": sum(1 for g in got if g)})
print(json.dumps(results))
"""

NVML_ONLY = r"""
import json, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
print(json.dumps({"v1": [v1.total, v1.free, v1.used], "v2": [v2.total, v2.reserved, v2.free, v2.used]}))
"""


@pytest.fixture
def run(simcuda, libnvshare, scheduler):
    """run(*steps, limit=None, **env) -> (results, stderr) of PROGRAM under the interceptor."""
    scheduler_env = {k: v for k, v in scheduler.env.items() if k.startswith("NVSHARE_")}

    def start(*steps: str, limit: str | None = None, program: str = PROGRAM, devices: int = 1, **extra: str):
        env = simcuda.env(devices=devices, **scheduler_env, LD_PRELOAD=str(libnvshare), **extra)
        env.pop("NVSHARE_MEMORY_LIMIT", None)
        if limit is not None:
            env["NVSHARE_MEMORY_LIMIT"] = limit
        done = subprocess.run([sys.executable, "-c", program, *steps], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"the program failed ({done.returncode}):\n{done.stderr}"
        return json.loads(done.stdout.splitlines()[-1]), done.stderr

    return start


def refusals(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "refused" in line and "NVSHARE_MEMORY_LIMIT" in line]


# Every family, converted (NVSHARE_MANAGED=1) and passed through (0); the application's own
# managed memory and VMM memory are never converted.
@pytest.mark.parametrize("family, managed", [
    *((family, managed) for family in ("plain", "pitch", "async", "pool") for managed in ("1", "0")),
    ("managed", "1"), ("vmm", "1")])
def test_an_allocation_past_the_limit_fails_and_the_program_goes_on(run, family, managed):
    results, stderr = run(f"alloc:{family}:{48 * MiB}", f"alloc:{family}:{32 * MiB}", f"alloc:{family}:{16 * MiB}",
                          "meminfo", limit="64M", NVSHARE_MANAGED=managed, SIMCUDA_MEMORY="80M")
    assert results[0] == {"ok": True}
    assert results[1] == {"error": OUT_OF_MEMORY}  # 48 + 32 > 64: refused, at once
    # A smaller one still fits. On an 80 MiB device this also shows that nothing of the refused
    # one stayed in the driver (48 + 32 + 16 > 80 would fail there, for physical memory).
    assert results[2] == {"ok": True}
    assert results[3] == {"free": 0, "total": 64 * MiB}
    (line,) = refusals(stderr)
    assert f"of {32 * MiB} bytes on device 0" in line and f"uses {48 * MiB} of its {64 * MiB}-byte" in line


def test_frees_give_the_budget_back(run):
    results, _ = run(f"alloc:plain:{60 * MiB}", f"alloc:plain:{60 * MiB}", "free:0", f"alloc:plain:{60 * MiB}",
                     f"alloc:vmm:{16 * MiB}", f"alloc:plain:{40 * MiB}", "free:2", f"alloc:plain:{40 * MiB}",
                     "meminfo", limit="100M")
    assert [r.get("ok", r.get("error", "freed")) for r in results[:8]] == [
        True, OUT_OF_MEMORY, "freed", True, True, OUT_OF_MEMORY, "freed", True]
    assert results[8] == {"free": 0, "total": 100 * MiB}


def test_a_stream_ordered_free_gives_the_budget_back_once_its_work_is_done(run):
    """The refused-looking allocation waits for the device's pending stream-ordered free (the
    kernel queued before it still uses the memory) instead of failing."""
    results, stderr = run(f"free-async-after:300000:{48 * MiB}", f"alloc:plain:{48 * MiB}", "meminfo", limit="64M")
    assert results[1] == {"ok": True}, stderr
    assert results[2] == {"free": 16 * MiB, "total": 64 * MiB}
    assert refusals(stderr) == []


def test_an_allocation_waits_for_a_stream_ordered_free_that_the_worker_is_looking_at(run):
    """Was: the worker took the pending frees off their list while it asked whether their work
    was done, and an allocation that needed one of them found the list empty, waited for nothing
    and was refused (CI under two CPU hogs). Here every query of the simulated driver takes
    0.1 s, so the worker holds the list most of the time."""
    results, stderr = run(f"free-async-after:300000:{48 * MiB}", f"alloc:plain:{48 * MiB}", "meminfo", limit="64M",
                          SIMCUDA_EVENT_QUERY_US="100000")
    assert results[1] == {"ok": True}, stderr
    assert refusals(stderr) == []


def test_threads_allocating_together_never_pass_the_limit(run):
    results, stderr = run(f"threads:8:{MiB}", "meminfo", limit="64M")
    assert results[0]["allocated"] == 64  # exactly the limit: none beyond it, none lost
    assert results[1] == {"free": 0, "total": 64 * MiB}
    assert refusals(stderr), stderr  # each thread's refusal, at most a line a second


@pytest.mark.parametrize("via", ["dlsym", "gpa"])  # ctypes/PyTorch, and the CUDA runtime's way
def test_the_limited_process_sees_a_device_of_the_limits_size(run, via):
    results, _ = run("meminfo", f"alloc:plain:{GiB}", "meminfo", "total", "nvml", limit="4G", NVS_APP_VIA=via)
    assert results[0] == {"free": 4 * GiB, "total": 4 * GiB}
    assert results[2] == {"free": 3 * GiB, "total": 4 * GiB}
    assert results[3] == {"totals": [4 * GiB]}
    # NVML inside the process: the limit, and the process's own use
    assert results[4] == {"v1": [4 * GiB, 3 * GiB, GiB], "v2": [4 * GiB, 0, 3 * GiB, GiB]}


def test_a_limit_above_the_device_shows_the_device(run):
    results, _ = run("meminfo", "total", limit="64G")
    assert results == [{"free": SIM_TOTAL, "total": SIM_TOTAL}, {"totals": [SIM_TOTAL]}]


def test_limits_per_device_by_ordinal_and_by_uuid(run):
    steps = ("meminfo", "use:1", "meminfo", f"alloc:plain:{3 * GiB}", "total")
    by_ordinal, _ = run(*steps, limit="0=1G,1=2G", devices=2)
    assert [r["total"] for r in by_ordinal if "total" in r] == [GiB, 2 * GiB]
    assert by_ordinal[2] == {"error": OUT_OF_MEMORY}
    assert by_ordinal[3] == {"totals": [GiB, 2 * GiB]}
    # a UUID entry wins over the entry for every device
    by_uuid, _ = run(*steps, limit=f"8G, {DEVICE1}=2G", devices=2)
    assert [r["total"] for r in by_uuid if "total" in r] == [8 * GiB, 2 * GiB]
    assert by_uuid[3] == {"totals": [8 * GiB, 2 * GiB]}


def test_nvml_in_a_process_that_allocated_nothing_shows_the_devices_use_clipped_to_the_limit(run):
    """nvidia-smi in a limited container: NVML's own figure of used memory (every process's),
    no more than the limit."""
    within, _ = run(limit="8G", program=NVML_ONLY, SIMNVML_USED="3G")
    assert within == {"v1": [8 * GiB, 5 * GiB, 3 * GiB], "v2": [8 * GiB, 0, 5 * GiB, 3 * GiB]}
    beyond, _ = run(limit="2G", program=NVML_ONLY, SIMNVML_USED="3G")
    assert beyond == {"v1": [2 * GiB, 0, 2 * GiB], "v2": [2 * GiB, 0, 0, 2 * GiB]}


def test_nvml_with_an_ordinal_limit_and_no_cuda_says_it_cannot_apply_it(run):
    results, stderr = run(limit="0=8G", program=NVML_ONLY, SIMNVML_USED="3G")
    assert results["v1"] == [SIM_TOTAL, SIM_TOTAL - 3 * GiB, 3 * GiB]
    assert f"{DEVICE0}=SIZE" in stderr


def test_without_a_limit_nothing_changes(run):
    results, stderr = run(f"alloc:plain:{20 * GiB}", "meminfo", "total", "nvml", SIMNVML_USED="1G")
    assert results[0] == {"ok": True}  # oversubscription: more than the device
    assert results[1] == {"free": 0, "total": SIM_TOTAL}
    assert results[2] == {"totals": [SIM_TOTAL]}
    # NVML untouched: the driver library's own figures, not this process's
    assert results[3] == {"v1": [SIM_TOTAL, 15 * GiB, GiB], "v2": [SIM_TOTAL, 0, 15 * GiB, GiB]}
    assert refusals(stderr) == []


@pytest.mark.parametrize("setting", ["8X", "lots", "0=8G,", "0=0", "GPU-=4G", "=4G", "99=1G"])
def test_a_malformed_limit_refuses_every_allocation_and_says_why(run, setting):
    """An operator who set a limit must never get an unlimited process: the program starts,
    every allocation fails with out-of-memory, and the messages name the setting."""
    results, stderr = run("alloc:plain:4096", "alloc:managed:4096", "meminfo", limit=setting)
    assert results[:2] == [{"error": OUT_OF_MEMORY}, {"error": OUT_OF_MEMORY}]
    assert results[2] == {"free": 0, "total": 0}
    assert f"NVSHARE_MEMORY_LIMIT={setting}:" in stderr and "every allocation is refused" in stderr
    assert "NVSHARE_MEMORY_LIMIT is malformed" in stderr


@pytest.mark.parametrize("text", ["8G", "512M", "1.5GiB", "1048576", "2k", "3 mb", "0.5T", "1p", "7b", "1ib",
                                  "9223372036854775807", "9223372036854775808", "8X", "1.", ".5G", "0", "G", "1gi"])
def test_sizes_mean_what_they_mean_to_nvsharectl(run, text):
    """One spelling of a size on both sides: the interceptor reads it as nvsharectl does."""
    from ctl.main import parse_size

    try:
        expected = parse_size(text)
    except ValueError:
        expected = None
    results, _ = run("meminfo", limit=text, SIMCUDA_MEMORY="2097152000G")
    assert results[0]["total"] == (0 if expected is None else min(expected, 2000 << 50))


# The run-time entry point the control path will call (nvs_limit_set), on its own: limits.c with
# the configuration and logging it needs, driven from two threads.
RUNTIME_SET = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include "config.h"
#include "gate.h"
#include "limits.h"

static struct nvs_device devices[3];

static void *set_from_another_thread(void *unused) {
    nvs_limit_set(&devices[1], 1 << 20);          /* before anyone read device 1's limit */
    nvs_limit_set(&devices[2], NVS_NO_LIMIT);     /* lifted */
    return NULL;
}

int main(void) {
    nvs_config_load();
    for (int i = 0; i < 3; i++) devices[i].ordinal = i, snprintf(devices[i].uuid, 64, "GPU-%d", i);
    printf("configured %llu\n", (unsigned long long)nvs_limit_of(&devices[0]));
    pthread_t other;
    pthread_create(&other, NULL, set_from_another_thread, NULL);
    pthread_join(other, NULL);
    printf("set %llu %llu\n", (unsigned long long)nvs_limit_of(&devices[1]),
           (unsigned long long)(nvs_limit_of(&devices[2]) == NVS_NO_LIMIT));
    nvs_limit_set(&devices[0], 3 << 20);
    printf("changed %llu\n", (unsigned long long)nvs_limit_of(&devices[0]));
    return 0;
}
"""


@pytest.mark.parametrize("setting", [None, "8G"])
def test_a_limit_set_at_run_time_wins_over_the_configured_one(compile_c, setting):
    from fixtures.interceptor import INTERCEPTOR_DIR

    sources = [str(INTERCEPTOR_DIR / name) for name in ("limits.c", "config.c", "log.c")]
    program = compile_c(RUNTIME_SET, "limits_runtime_set",
                        flags=[*sources, "-iquote", str(INTERCEPTOR_DIR), "-std=gnu11", "-include", "glibc_compat.h"])
    env = {"PATH": "/usr/bin:/bin", "NVSHARE_LOG": "info"}
    if setting is not None:
        env["NVSHARE_MEMORY_LIMIT"] = setting
    done = subprocess.run([str(program)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    configured = f"{8 * GiB}" if setting else f"{(1 << 64) - 1}"  # NVS_NO_LIMIT
    assert done.stdout.splitlines() == [f"configured {configured}", f"set {MiB} 1", f"changed {3 * MiB}"]
    assert "device 0 (GPU-0): memory limit 3145728 bytes" in done.stderr


def test_a_limit_set_before_the_program_starts_governs_its_first_memory_calls(run, scheduler):
    # Issue 20: with a default limit of 64 MiB set on the scheduler, a new program's first
    # 128 MiB allocation succeeded and its first cuMemGetInfo showed the whole device (what
    # JAX, PyTorch and TensorFlow size themselves from): the limit came only after a DEVICE,
    # which went out only after that allocation. Now the limits come with the registration,
    # and the first memory call waits for it.
    scheduler.request("set-limit", bytes=64 * MiB)
    scheduler.request("set-limit", bytes=32 * MiB, device=DEVICE1)  # a device's own wins on it
    first_queries, _ = run("meminfo", "total", "nvml")
    assert first_queries[0] == {"free": 64 * MiB, "total": 64 * MiB}
    assert first_queries[1] == {"totals": [64 * MiB]}
    assert first_queries[2]["v1"] == [64 * MiB, 64 * MiB, 0]
    first_allocation, stderr = run(f"alloc:plain:{128 * MiB}", f"alloc:plain:{48 * MiB}")
    assert first_allocation == [{"error": OUT_OF_MEMORY}, {"ok": True}]
    assert refusals(stderr)
    other_device, _ = run("use:1", "meminfo", devices=2)
    assert other_device == [{"free": 32 * MiB, "total": 32 * MiB}]


def test_without_a_scheduler_the_first_memory_calls_go_on_and_say_so_once(simcuda, libnvshare, tmp_path):
    env = simcuda.env(LD_PRELOAD=str(libnvshare), NVSHARE_SOCKET_DIR=str(tmp_path), NVSHARE_FAIL_MODE="closed")
    done = subprocess.run([sys.executable, "-c", PROGRAM, "meminfo", f"alloc:plain:{GiB}", f"alloc:plain:{GiB}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [{"free": SIM_TOTAL, "total": SIM_TOTAL}, {"ok": True},
                                                         {"ok": True}]
    assert done.stderr.count("allocations go on without its memory limits") == 1, done.stderr
