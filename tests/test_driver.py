"""nvshare_py.driver against the simulated driver (and, marked gpu, against a real one).

Every test runs the binding in a child process, where the simulated libcuda.so.1 is found
through LD_LIBRARY_PATH like the real one would be.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from nvshare_py.driver import FAMILIES, VIAS, Driver, DriverNotFound

PRELUDE = """
import json, os, sys, threading, time
from nvshare_py.driver import Driver, DriverError, FAMILIES
result = {}
def looked_up():  # the driver functions a preloaded shim's dlsym saw so far (see `shim` below)
    if not os.path.exists(os.environ["SHIM_DLSYM_LOG"]):
        return []
    with open(os.environ["SHIM_DLSYM_LOG"]) as log:
        return [name for name in log.read().split() if name.startswith("cu")]
"""


def run(simcuda, code: str, env: dict[str, str] | None = None) -> dict:
    return simcuda.python(PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(result))\n", env=env)


def test_a_missing_driver_is_a_clear_error():
    with pytest.raises(DriverNotFound, match="LD_LIBRARY_PATH"):
        Driver("/nonexistent/libcuda.so.1")


def test_an_unknown_entry_path_is_refused():
    with pytest.raises(ValueError, match="gpa-ptds"):
        Driver(via="dlopen")


SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int cuMemAlloc_v2(void *p, unsigned long n) { (void)p; (void)n; return 999; }

void *dlsym(void *handle, const char *name) {
    static void *(*real)(void *, const char *);
    if (real == NULL) real = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    const char *path = getenv("SHIM_DLSYM_LOG");
    int log = path != NULL ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600) : -1;
    if (log >= 0) {
        dprintf(log, "%s\n", name);
        close(log);
    }
    return real(handle, name);
}
"""


@pytest.fixture
def shim(tmp_path):
    """A library to preload: a cuMemAlloc_v2 of its own that fails with CUresult 999, and a
    dlsym that writes every name looked up to $SHIM_DLSYM_LOG (tmp_path/dlsym.log)."""
    source = tmp_path / "shim.c"
    source.write_text(SHIM)
    library = tmp_path / "libshim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"], check=True)
    return library


def shim_env(simcuda, shim) -> dict[str, str]:
    return simcuda.env(LD_PRELOAD=str(shim), SHIM_DLSYM_LOG=str(shim.parent / "dlsym.log"))


def test_every_function_is_resolved_through_cuGetProcAddress(simcuda, shim):
    """The addresses are those of the ABI versions asked for, and a preloaded library that
    exports the same names is not what the binding calls (it did not use dlsym)."""
    result = run(simcuda, """
        import ctypes
        cuda = ctypes.CDLL("libcuda.so.1")
        def exported(name):
            return ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value
        legacy, per_thread = Driver(), Driver(via="gpa-ptds")
        result["dlsym"] = sorted(set(looked_up()))
        names = ["cuMemAlloc_v2", "cuLaunchKernel", "cuMemcpyHtoD_v2", "cuMemAllocAsync", "cuStreamSynchronize"]
        result["legacy"] = [legacy.resolved[name] == exported(name) for name in names]
        twins = ["cuMemAlloc_v2", "cuLaunchKernel_ptsz", "cuMemcpyHtoD_v2_ptds", "cuMemAllocAsync_ptsz", "cuStreamSynchronize_ptsz"]
        result["per thread"] = [per_thread.resolved[name] == exported(twin) for name, twin in zip(names, twins)]
        legacy.context(0)
        result["alloc"] = legacy.alloc(4096) > 0
    """, env=shim_env(simcuda, shim))
    assert result == {"dlsym": ["cuGetProcAddress_v2"], "legacy": [True] * 5, "per thread": [True] * 5, "alloc": True}


def test_dlsym_looks_in_the_library_and_export_in_the_global_scope(simcuda, shim):
    """`dlsym` binds the driver library's own symbols, whatever else is loaded; `export` binds
    what the process's global scope binds first, as a program linked against libcuda would:
    a preloaded library's definition (here a cuMemAlloc_v2 failing with 999), else the driver's."""
    result = run(simcuda, """
        import ctypes
        cuda = ctypes.CDLL("libcuda.so.1")
        def exported(name):
            return ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value
        for via in ("dlsym", "export"):
            before = len(looked_up())
            driver = Driver(via=via)
            result[via + " looked up"] = sorted(looked_up()[before:]) == sorted(driver.resolved)
            result[via] = {name: address == exported(name) for name, address in driver.resolved.items()}
            driver.context(0)
            try:
                result[via + " alloc"] = driver.alloc(4096) > 0
            except DriverError as error:
                result[via + " alloc"] = error.code
    """, env=shim_env(simcuda, shim))
    assert result["dlsym looked up"] is True and result["export looked up"] is True
    assert result["dlsym"] and all(result["dlsym"].values()), result["dlsym"]
    assert result["dlsym alloc"] is True
    assert [name for name, same in result["export"].items() if not same] == ["cuMemAlloc_v2"]
    assert result["export alloc"] == 999


@pytest.mark.parametrize("via", VIAS)
def test_every_entry_path_drives_the_device(simcuda, tmp_path, via):
    """Memory, kernels and copies work whichever way the functions were found; per-thread
    default stream code submits through the _ptsz entry points."""
    trace = tmp_path / "trace.jsonl"
    result = run(simcuda, f"""
        with Driver(via={via!r}) as driver:
            driver.context(0)
            ptr = driver.alloc(4096)
            driver.fill(ptr, 0x01020304, 1024)
            driver.synchronize()
            result["filled"] = driver.memcpy_dtoh(ptr, 4096) == bytes.fromhex("04030201") * 1024
            driver.free(ptr)
    """, env=simcuda.env(trace=trace))
    assert result == {"filled": True}
    kernel, copy = simcuda.read_trace(trace)
    assert kernel["name"] == "nvshare_fill" and copy["op"] == "memcpy"
    if via == "gpa-ptds":
        assert [kernel["api"], copy["api"]] == ["cuLaunchKernel_ptsz", "cuMemcpyDtoH_v2_ptds"]
    else:
        assert [kernel["api"], copy["api"]] == ["cuLaunchKernel", "cuMemcpyDtoH_v2"]


def test_pitch_attributes_and_ipc_handles(simcuda):
    result = run(simcuda, """
        with Driver() as driver:
            driver.context(0)
            ptr, pitch = driver.alloc_pitch(100, 3)
            free, total = driver.mem_get_info()
            result["pitch"] = [pitch, total - free]
            driver.memcpy_htod(ptr + 2 * pitch, b"third row")
            result["row"] = driver.memcpy_dtoh(ptr + 2 * pitch, 9).decode()
            driver.free(ptr)
            result["vmm"] = driver.device_attribute(102)  # VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            device_memory = driver.alloc(1 << 20)
            result["ipc"] = len(driver.ipc_mem_handle(device_memory))
            managed = driver.alloc(1 << 20, "managed")
            try:
                driver.ipc_mem_handle(managed)
            except DriverError as error:
                result["ipc managed"] = error.function
    """)
    pitch, used = result["pitch"]
    assert pitch >= 100 and used >= 3 * pitch
    assert result["row"] == "third row"
    assert result["vmm"] == 1
    assert result["ipc"] == 64
    assert result["ipc managed"] == "cuIpcGetMemHandle"  # the driver refuses managed memory


def test_devices_are_enumerated(simcuda):
    result = run(simcuda, """
        with Driver() as driver:
            result["version"] = driver.version
            result["devices"] = [[d.index, d.uuid, d.name, d.total_memory] for d in driver.devices()]
    """, env=simcuda.env(devices=2, memory="3G"))
    assert result == {"version": 13000, "devices": [
        [0, "GPU-5151ad00-0000-4000-8000-000000000000", "nvshare simulated GPU", 3 << 30],
        [1, "GPU-5151ad00-0000-4000-8000-000000000001", "nvshare simulated GPU", 3 << 30],
    ]}


def test_each_allocation_family_holds_data_and_is_accounted(simcuda):
    result = run(simcuda, """
        with Driver() as driver:
            driver.context(0)
            free_before, total = driver.mem_get_info()
            for family in FAMILIES:
                ptr = driver.alloc(1 << 20, family)
                free_during, _ = driver.mem_get_info()
                driver.fill(ptr, 0xDEADBEEF, 1 << 18)
                driver.synchronize()
                filled = driver.memcpy_dtoh(ptr, 1 << 20) == bytes.fromhex("efbeadde") * (1 << 18)
                driver.memcpy_htod(ptr + 8, b"nvshare!")
                copied = driver.memcpy_dtoh(ptr, 24) == bytes.fromhex("efbeadde") * 2 + b"nvshare!" + bytes.fromhex("efbeadde") * 2
                managed = driver.is_managed(ptr)
                driver.free(ptr)
                driver.synchronize()  # async and pool memory goes back in stream order
                result[family] = [filled, copied, managed, free_before - free_during, driver.mem_get_info()[0] == free_before]
            try:
                driver.free(12345)
            except ValueError as error:
                result["unknown free"] = str(error)
            try:
                driver.alloc(10, "sparse")
            except ValueError as error:
                result["unknown family"] = str(error)
    """)
    counted = {"plain": 1 << 20, "pitch": 1 << 20, "async": 1 << 20, "pool": 1 << 20, "managed": 0, "host": 0,
               "vmm": 2 << 20}  # vmm: rounded up to the 2 MiB granularity
    for family in FAMILIES:
        assert result[family] == [True, True, family == "managed", counted[family], True], family
    assert "not allocated by this Driver" in result["unknown free"]
    assert "sparse" in result["unknown family"]


def test_launch_sleep_is_asynchronous_and_synchronize_waits_for_it(simcuda, tmp_path):
    trace = tmp_path / "trace.jsonl"
    result = run(simcuda, """
        import ctypes
        with Driver() as driver:
            driver.context(0)
            # A host function (through the simulated driver itself) holds the queue, so the
            # kernel cannot even start until the launch has returned, however slow the machine.
            cuda = ctypes.CDLL("libcuda.so.1")
            opened = threading.Event()
            @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
            def hold(_):
                opened.wait(60)
            assert cuda.cuLaunchHostFunc(None, hold, None) == 0
            driver.launch_sleep(200000)
            result["returned"] = time.clock_gettime(time.CLOCK_MONOTONIC)
            opened.set()
            driver.synchronize()
            result["synchronized"] = time.clock_gettime(time.CLOCK_MONOTONIC)
            stream = driver.create_stream()
            driver.launch_sleep(1000, stream)
            driver.stream_synchronize(stream)
            driver.destroy_stream(stream)
    """, env=simcuda.env(trace=trace))
    first, second = [line for line in simcuda.read_trace(trace) if line["op"] == "kernel"]
    assert first["name"] == "nvshare_sleep" and first["api"] == "cuLaunchKernel"
    assert first["end"] - first["start"] >= 0.2
    assert result["returned"] < first["start"] and first["end"] <= result["synchronized"]
    assert second["api"] == "cuLaunchKernel" and second["start"] >= first["end"]  # one context, one queue
    assert second["end"] - second["start"] >= 0.001


def test_failures_raise_driver_errors_with_the_cuda_name(simcuda):
    result = run(simcuda, """
        with Driver() as driver:
            driver.context(0)
            try:
                driver.alloc(128 << 20)
            except DriverError as error:
                result["oom"] = [error.function, error.code, error.name]
            def no_context():
                try:
                    driver.alloc(4096)
                except DriverError as error:
                    result["thread"] = [error.code, error.name]
            thread = threading.Thread(target=no_context)
            thread.start()
            thread.join()
    """, env=simcuda.env(memory="64M"))
    assert result == {"oom": ["cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY"],
                      "thread": [201, "CUDA_ERROR_INVALID_CONTEXT"]}


@pytest.mark.gpu
def test_kernels_run_on_a_real_gpu(simcuda):
    """The embedded PTX compiles and runs on the real driver (1 MiB buffers only)."""
    if not simcuda.real_gpu():
        pytest.skip("no real CUDA driver with a GPU here")
    env = simcuda.real_env()
    result = run(simcuda, """
        from nvshare_py.driver import VIAS
        for via in VIAS:
            with Driver(via=via) as driver:
                driver.context(0)
                for family in FAMILIES:
                    ptr = driver.alloc(1 << 20, family)
                    driver.fill(ptr, 0x01020304, 1 << 18)
                    driver.synchronize()
                    result[f"{via}/{family}"] = [driver.memcpy_dtoh(ptr, 1 << 20) == bytes.fromhex("04030201") * (1 << 18),
                                                 driver.is_managed(ptr)]
                    driver.free(ptr)
                start = time.monotonic()
                driver.launch_sleep(100000)
                driver.synchronize()
                result[f"{via}/slept"] = time.monotonic() - start >= 0.1
    """, env=env)
    for via in VIAS:
        for family in FAMILIES:
            assert result[f"{via}/{family}"] == [True, family == "managed"]
        assert result[f"{via}/slept"] is True
