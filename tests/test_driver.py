"""nvshare_py.driver against the simulated driver (and, marked gpu, against a real one).

Every test runs the binding in a child process, where the simulated libcuda.so.1 is found
through LD_LIBRARY_PATH like the real one would be.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from nvshare_py.driver import FAMILIES, Driver, DriverNotFound

PRELUDE = """
import json, sys, threading, time
from nvshare_py.driver import Driver, DriverError, FAMILIES
result = {}
"""


def run(simcuda, code: str, env: dict[str, str] | None = None) -> dict:
    return simcuda.python(PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(result))\n", env=env)


def test_a_missing_driver_is_a_clear_error():
    with pytest.raises(DriverNotFound, match="LD_LIBRARY_PATH"):
        Driver("/nonexistent/libcuda.so.1")


def test_every_function_is_resolved_through_cuGetProcAddress(simcuda, tmp_path):
    """The addresses are those of the ABI versions asked for, and a preloaded library that
    exports the same names is not what the binding calls (it did not use dlsym)."""
    shim_source = tmp_path / "shim.c"
    shim_source.write_text("int cuMemAlloc_v2(void *p, unsigned long n) { (void)p; (void)n; return 999; }\n")
    shim = tmp_path / "libshim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(shim_source)], check=True)
    result = run(simcuda, """
        import ctypes
        cuda = ctypes.CDLL("libcuda.so.1")
        def exported(name):
            return ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value
        legacy, per_thread = Driver(), Driver(per_thread_default_stream=True)
        names = ["cuMemAlloc_v2", "cuLaunchKernel", "cuMemcpyHtoD_v2", "cuMemAllocAsync", "cuStreamSynchronize"]
        result["legacy"] = [legacy.resolved[name] == exported(name) for name in names]
        twins = ["cuMemAlloc_v2", "cuLaunchKernel_ptsz", "cuMemcpyHtoD_v2_ptds", "cuMemAllocAsync_ptsz", "cuStreamSynchronize_ptsz"]
        result["per thread"] = [per_thread.resolved[name] == exported(twin) for name, twin in zip(names, twins)]
        legacy.context(0)
        result["alloc"] = legacy.alloc(4096) > 0
    """, env=simcuda.env(LD_PRELOAD=str(shim)))
    assert result == {"legacy": [True] * 5, "per thread": [True] * 5, "alloc": True}


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
        with Driver() as driver:
            driver.context(0)
            driver.launch_sleep(200000)
            result["returned"] = time.clock_gettime(time.CLOCK_MONOTONIC)
            driver.synchronize()
            result["synchronized"] = time.clock_gettime(time.CLOCK_MONOTONIC)
            stream = driver.create_stream()
            driver.launch_sleep(1000, stream)
            driver.stream_synchronize(stream)
            driver.destroy_stream(stream)
    """, env=simcuda.env(trace=trace))
    first, second = simcuda.read_trace(trace)
    assert first["name"] == "nvshare_sleep" and first["api"] == "cuLaunchKernel"
    assert first["end"] - first["start"] >= 0.2
    assert result["returned"] < first["end"] <= result["synchronized"]
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
        for per_thread in (False, True):
            with Driver(per_thread_default_stream=per_thread) as driver:
                driver.context(0)
                for family in FAMILIES:
                    ptr = driver.alloc(1 << 20, family)
                    driver.fill(ptr, 0x01020304, 1 << 18)
                    driver.synchronize()
                    result[f"{per_thread}/{family}"] = [driver.memcpy_dtoh(ptr, 1 << 20) == bytes.fromhex("04030201") * (1 << 18),
                                                        driver.is_managed(ptr)]
                    driver.free(ptr)
                start = time.monotonic()
                driver.launch_sleep(100000)
                driver.synchronize()
                result[f"{per_thread}/slept"] = time.monotonic() - start >= 0.1
    """, env=env)
    for per_thread in (False, True):
        for family in FAMILIES:
            assert result[f"{per_thread}/{family}"] == [True, family == "managed"]
        assert result[f"{per_thread}/slept"] is True
