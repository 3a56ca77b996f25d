"""libnvshare.so end to end on the simulated driver with the real scheduler: what an
application sees (allocations, memory figures, entry paths, policies) and that every GPU
submission waits for the lock."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from fixtures.interceptor import gated_hook_names, line_time
from nvshare_py.testing.scheduler import wait_for

GiB = 1 << 30
SIM_TOTAL = 16 * GiB  # simcuda's default SIMCUDA_MEMORY
DEVICE0 = "GPU-5151ad00-0000-4000-8000-000000000000"


@pytest.mark.parametrize("via", ["dlsym", "export", "gpa", "gpa-ptds"])
def test_every_allocation_family_becomes_managed_on_every_entry_path(scheduler, cuda_app, via):
    app = cuda_app(scheduler.env, "init", "alloc:plain:4096", "alloc:pitch:100", "alloc:async:4096",
                   "alloc:pool:4096", "alloc:managed:4096", "kernel:1000", "sync", env={"NVS_APP_VIA": via})
    assert app.wait() == 0, app.stderr
    pointers = [line for line in app.lines if line.startswith("ptr ")]
    assert len(pointers) == 5
    assert all("managed=1" in line for line in pointers), pointers
    # pitched rows: the width rounded up, never below the 512 bytes real drivers use
    assert "pitch=512" in next(line for line in pointers if line.startswith("ptr pitch"))
    assert len(app.kernels()) == 1


def test_without_conversion_allocations_stay_device_memory(scheduler, cuda_app):
    app = cuda_app(scheduler.env, "init", "alloc:plain:4096", "alloc:async:4096", env={"NVSHARE_MANAGED": "0"})
    assert app.wait() == 0, app.stderr
    assert [line.split()[3] for line in app.lines if line.startswith("ptr ")] == ["managed=0", "managed=0"]


def test_stream_ordered_free_waits_for_the_work_queued_before_it(scheduler, cuda_app):
    """cuMemFreeAsync of converted memory behind a slow kernel and a kernel writing into it: the
    memory must still exist when that kernel runs (simcuda fails the context otherwise)."""
    app = cuda_app(scheduler.env, "init", "free-async-after:200000", "sync", f"meminfo-free:{SIM_TOTAL}")
    assert app.wait() == 0, app.stderr  # the sync saw no error from the fill kernel
    meminfo = next(line for line in app.lines if line.startswith("meminfo"))
    assert f"free={SIM_TOTAL} " in meminfo  # the deferred free happened and was uncounted
    kinds = [op["name"] for op in app.kernels()]
    assert kinds == ["nvshare_sleep", "nvshare_fill"]


def test_memory_figures_are_per_process(scheduler, cuda_app):
    """free = total - this process's allocations; another process's memory does not count."""
    other = cuda_app(scheduler.env, "init", f"alloc:plain:{4 * GiB}", "wait")
    other.expect("waiting")
    app = cuda_app(scheduler.env, "init", "meminfo", f"alloc:plain:{GiB}", f"alloc:plain:{2 * GiB}", "meminfo")
    assert app.wait() == 0, app.stderr
    first, second = [line for line in app.lines if line.startswith("meminfo")]
    assert f"free={SIM_TOTAL} total={SIM_TOTAL}" in first
    assert f"free={SIM_TOTAL - 3 * GiB} total={SIM_TOTAL}" in second
    other.continue_()
    assert other.wait() == 0


def test_memory_reports_and_identity_reach_the_scheduler(scheduler, cuda_app):
    app = cuda_app(scheduler.env, "init", f"alloc:plain:{3 * GiB}", "alloc:managed:1000", "wait",
                   env={"NVSHARE_PROGRAM": "analysis.ipynb", "NVSHARE_POD_NAME": "nb-0"})
    app.expect("waiting")

    def used():
        for client in scheduler.status()["clients"]:
            if client["pid"] == app.pid and DEVICE0 in client["devices"]:
                return client["devices"][DEVICE0]["used"] == 3 * GiB + 1000
        return False

    wait_for(used, what="the MEMORY report in the scheduler's status")
    (client,) = [c for c in scheduler.status()["clients"] if c["pid"] == app.pid]
    assert (client["program"], client["pod"]) == ("analysis.ipynb", "nb-0")
    app.continue_()
    assert app.wait() == 0


@pytest.mark.parametrize("policy,expected", [(None, "1"), ("allow", "1"), ("swap", "1"), ("hide", "0")])
def test_vmm_policy(scheduler, cuda_app, policy, expected):
    """NVSHARE_VMM: VMM memory is swapped by default (and with `hide`, where a program makes it
    all the same), never with `allow`; `hide` says the device has no VMM."""
    app = cuda_app(scheduler.env, "init", "vmm-attr", f"alloc:vmm:{2 << 20}", "meminfo",
                   env={"NVSHARE_VMM": policy} if policy else {})
    assert app.wait() == 0, app.stderr
    assert any(line.startswith(f"vmm-supported {expected}") for line in app.lines)
    # passed through unconverted, but counted as this process's memory
    assert next(line for line in app.lines if line.startswith("ptr vmm")).split()[3] == "managed=0"
    assert any(f"free={SIM_TOTAL - (2 << 20)} " in line for line in app.lines if line.startswith("meminfo"))
    said = " ".join(app.stderr.split())
    assert ("nvshare swaps each one mapped once, whole, and not exported" in said) == (policy != "allow"), said
    assert f"NVSHARE_VMM={policy or 'swap'}" in said, said


def test_ipc_of_converted_memory_explains_itself(scheduler, cuda_app):
    app = cuda_app(scheduler.env, "init", "ipc")
    assert app.wait() == 0, app.stderr
    result = int(next(line for line in app.lines if line.startswith("ipc-result")).split()[1])
    assert result != 0  # the driver refuses managed memory
    assert "NVSHARE_MANAGED=0" in app.stderr


def test_every_gated_entry_point_waits_for_the_lock(scheduler_factory, cuda_app):
    """Another client holds the device: each gated entry point, called from its own thread,
    returns only after that client has released the lock."""
    scheduler = scheduler_factory(tq=600, grace=600)  # the holder keeps the lock until told
    holder = scheduler.agent()
    holder.send(f"announce {DEVICE0} {SIM_TOTAL}")
    holder.send(f"acquire {DEVICE0}")
    holder.expect(f"granted {DEVICE0}")
    app = cuda_app(scheduler.env, "init", "gated-all")
    names = app.expect("gated ").split()[1].split(",")
    assert sorted(names) == sorted(gated_hook_names())  # every one of them, none skipped
    assert {"cuLaunchKernel", "cuLaunchKernelEx_ptsz", "cuGraphLaunch", "cuMemcpyHtoD_v2", "cuMemsetD8Async",
            "cuMemcpyBatchAsync_v2", "cuMemPrefetchAsync_v2_ptsz", "cuMemcpy3DPeerAsync"} <= set(names)
    calling = lambda: {line.split()[1] for line in app.lines if line.startswith("calling ")}  # noqa: E731
    wait_for(lambda: calling() == set(names), what="a call of every gated entry point")
    wait_for(lambda: any(w for d in scheduler.status()["devices"] for w in d["waiters"]), what="the app waiting")
    released_at = time.monotonic()
    holder.send(f"release {DEVICE0}")
    holder.expect(f"released {DEVICE0}")
    assert app.wait() == 0, app.stderr
    returned = {line.split()[1]: line_time(line) for line in app.lines if line.startswith("returned ")}
    assert set(returned) == set(names)
    early = [name for name, t in returned.items() if t < released_at]
    assert early == [], f"returned while another client held the lock: {early}"


ENTRY_PROBE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
%(symver)s
typedef int (*gpa_v2_fn)(const char *, void **, int, unsigned long long, int *);
typedef int (*gpa_v1_fn)(const char *, void **, int, unsigned long long);
int main(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    void *self = dlopen(NULL, RTLD_NOW);
    void *ours = dlsym(self, "cuLaunchKernel");  /* the preloaded wrapper */
    void *from_dlsym = dlsym(cuda, "cuLaunchKernel");
    printf("dlsym-wrapped %%d\n", from_dlsym == ours);
    gpa_v2_fn gpa = (gpa_v2_fn)dlsym(cuda, "cuGetProcAddress_v2");
    printf("gpa-wrapped %%d\n", (void *)gpa == dlsym(self, "cuGetProcAddress_v2"));
    void *p = NULL; int status = -1;
    int r = gpa("cuGetProcAddress", &p, 12000, 0, &status);
    printf("gpa-self %%d %%d %%d\n", r, status, p == dlsym(self, "cuGetProcAddress_v2"));
    r = gpa("cuGetProcAddress", &p, 11030, 0, NULL);
    printf("gpa-self-v1 %%d %%d\n", r, p == dlsym(self, "cuGetProcAddress"));
    r = gpa("cuLaunchKernel", &p, 12000, 2, NULL);   /* per-thread default stream, NULL status */
    printf("gpa-ptsz %%d %%d\n", r, p == dlsym(self, "cuLaunchKernel_ptsz"));
    r = gpa("cuMemcpyHtoD", &p, 12000, 2, &status);
    printf("gpa-ptds %%d %%d\n", r, p == dlsym(self, "cuMemcpyHtoD_v2_ptds"));
    r = gpa("cuMemAlloc", &p, 12000, 0, &status);
    printf("gpa-alloc %%d %%d\n", r, p == dlsym(self, "cuMemAlloc_v2"));
    p = (void *)1; status = -1;
    r = gpa("cuMemcpyBatchAsync", &p, 11000, 0, &status);   /* introduced after 11.0 */
    printf("gpa-too-new %%d %%d %%d\n", r, status, p == NULL);
    gpa_v1_fn gpa1 = (gpa_v1_fn)dlsym(cuda, "cuGetProcAddress");
    r = gpa1("cuMemAlloc", &p, 12000, 0);
    printf("gpa1-alloc %%d %%d\n", r, p == dlsym(self, "cuMemAlloc_v2"));
    return 0;
}
"""


@pytest.mark.parametrize("dlsym_version", ["GLIBC_2.2.5", "GLIBC_2.34"])
def test_lookups_lead_to_the_wrappers(compile_c, dlsym_version, libnvshare, simcuda):
    """dlsym (old and new glibc callers) and cuGetProcAddress (including the lookup of
    cuGetProcAddress itself, the per-thread flag, a NULL symbolStatus and a version that is too
    old) hand out the wrapper of exactly the ABI version the driver chose."""
    import os
    import subprocess

    symver = '__asm__(".symver dlsym, dlsym@GLIBC_2.2.5");' if dlsym_version == "GLIBC_2.2.5" else ""
    probe = compile_c(ENTRY_PROBE % {"symver": symver}, f"entry_probe_{dlsym_version}")
    def run(preload: bool) -> dict[str, str]:
        env = simcuda.env()
        if preload:
            env["LD_PRELOAD"] = str(libnvshare)
        out = subprocess.run([str(probe)], env=env, capture_output=True, text=True, timeout=60, check=True).stdout
        return dict(re.findall(r"^(\S+) (.*)$", out, re.M))

    results, native = run(preload=True), run(preload=False)
    assert results["dlsym-wrapped"] == "1"
    assert results["gpa-wrapped"] == "1"
    assert results["gpa-self"] == "0 0 1"
    assert results["gpa-self-v1"] == "0 1"
    assert results["gpa-ptsz"] == "0 1"
    assert results["gpa-ptds"] == "0 1"
    assert results["gpa-alloc"] == "0 1"
    # the driver's answer (CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, no pointer) passed on as is
    assert results["gpa-too-new"] == native["gpa-too-new"]
    assert results["gpa-too-new"].split()[1:] == ["2", "1"]
    assert results["gpa1-alloc"] == "0 1"


@pytest.mark.parametrize("entry,ptds", [("direct", False), ("dlsym", False), ("gpa", False), ("gpa", True)])
def test_simapp_allocations_are_managed_on_every_entry_path(scheduler, simcuda, libnvshare, entry, ptds):
    """simapp, a C program driving the driver as cudart does (or linked against it directly)."""
    env = simcuda.env(NVSHARE_SOCKET_DIR=str(scheduler.socket_dir))
    families = ["plain", "pitch", "async", "pool"]
    steps = [f"alloc:{family}:4096" for family in families] + [f"ptr:{i}" for i in range(len(families))]
    run = simcuda.run_simapp(*steps, "kernel:1000", "sync", env=env, entry=entry, ptds=ptds, preload=libnvshare)
    assert run.returncode == 0, run.stderr
    assert all(step["rc"] == 0 for step in run.steps), run.steps
    pointers = [step for step in run.steps if step["step"].startswith("ptr:")]
    assert [(p["family"], p["managed"]) for p in pointers] == [(family, True) for family in families]


CONTEXT_DESTROY_PROBE = r"""
import ctypes, json, sys, threading, time
from ctypes import byref, c_int, c_size_t, c_uint64, c_void_p
cuda = ctypes.CDLL("libcuda.so.1")
result = {}
assert cuda.cuInit(0) == 0
dev = c_int()
cuda.cuDeviceGet(byref(dev), 0)
contexts = []
for _ in range(int(sys.argv[1])):
    ctx, module, function = c_void_p(), c_void_p(), c_void_p()
    assert cuda.cuCtxCreate_v2(byref(ctx), 0, dev) == 0
    cuda.cuModuleLoadData(byref(module), b"image")
    cuda.cuModuleGetFunction(byref(function), module, b"nvshare_sleep")
    ptr, duration = c_uint64(), c_uint64(100000)
    assert cuda.cuMemAlloc_v2(byref(ptr), 1 << 20) == 0
    params = (c_void_p * 1)(ctypes.addressof(duration))
    assert cuda.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, None, params, None) == 0
    assert cuda.cuMemFreeAsync(ptr, None) == 0  # pending behind the kernel
    assert cuda.cuCtxPopCurrent_v2(byref(c_void_p())) == 0
    contexts.append(ctx)
# The application destroys its contexts while the frees are still pending, from several threads
# (the worker thread polls the pending frees meanwhile).
results = [None] * len(contexts)
def destroy(i):
    results[i] = cuda.cuCtxDestroy_v2(contexts[i])
threads = [threading.Thread(target=destroy, args=(i,)) for i in range(len(contexts))]
for t in threads: t.start()
for t in threads: t.join()
result["destroy"] = results
primary = c_void_p()
cuda.cuDevicePrimaryCtxRetain(byref(primary), dev)
cuda.cuCtxSetCurrent(primary)
time.sleep(0.3)  # the worker's polls, if any were left
free, total = c_size_t(), c_size_t()
cuda.cuMemGetInfo_v2(byref(free), byref(total))
result["free"] = free.value == total.value
print(json.dumps(result))
"""


def test_destroying_a_context_completes_its_pending_stream_ordered_frees(scheduler, simcuda, libnvshare):
    """cuMemFreeAsync of converted memory is completed later, in the allocating context. When the
    application destroys that context first, nvshare must complete those frees before the context
    goes (never push, query or free in a destroyed context), and count the memory as freed."""
    env = simcuda.env(NVSHARE_SOCKET_DIR=str(scheduler.socket_dir), LD_PRELOAD=str(libnvshare), NVSHARE_LOG="warn")
    run = subprocess.run([sys.executable, "-c", CONTEXT_DESTROY_PROBE, "4"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"destroy": [0, 0, 0, 0], "free": True}, run.stderr
    assert "deferred free" not in run.stderr, run.stderr
