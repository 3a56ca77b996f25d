"""The simulated NVML (tests/simcuda/nvml.c), driven through nvidia-ml-py as the plugin does.

Each check runs in a fresh process: NVML reads SIMCUDA_* once, and nvidia-ml-py loads
libnvidia-ml.so.1 through the dynamic loader, so LD_LIBRARY_PATH must be set at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_deviceplugin import simnvml_dir  # noqa: F401  (the fixture that builds the library)

UUID0 = "GPU-5151ad00-0000-4000-8000-000000000000"
UUID1 = "GPU-5151ad00-0000-4000-8000-000000000001"


def run_nvml(nvml_dir, script: str, state_file=None, **env) -> dict:
    environment = dict(os.environ, LD_LIBRARY_PATH=str(nvml_dir), **env)
    if state_file is not None:
        environment["SIMNVML_STATE"] = str(state_file)
    prelude = textwrap.dedent("""
        import json, pynvml as n
        def code(call):
            try:
                call()
            except n.NVMLError as error:
                return error.value
            return 0
        out = {}
    """)
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script) + "\nprint(json.dumps(out))"],
                          env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_reports_the_simulated_driver_devices(simnvml_dir):  # noqa: F811
    out = run_nvml(simnvml_dir, """
        out["before_init"] = code(n.nvmlDeviceGetCount)
        n.nvmlInit()
        out["count"] = n.nvmlDeviceGetCount()
        handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(out["count"])]
        out["uuids"] = [n.nvmlDeviceGetUUID(h) for h in handles]
        out["names"] = sorted({n.nvmlDeviceGetName(h) for h in handles})
        out["memory"] = [n.nvmlDeviceGetMemoryInfo(h).total for h in handles]
        out["memory_v2"] = n.nvmlDeviceGetMemoryInfo(handles[1], n.nvmlMemory_v2).total
        out["index_by_uuid"] = n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(out["uuids"][2]))
        out["minor"] = n.nvmlDeviceGetMinorNumber(handles[2])
        out["cc"] = n.nvmlDeviceGetCudaComputeCapability(handles[0])
        out["unknown_uuid"] = code(lambda: n.nvmlDeviceGetHandleByUUID("GPU-nope"))
        out["bad_index"] = code(lambda: n.nvmlDeviceGetHandleByIndex(3))
        out["too_small"] = n.nvmlErrorString(7)
        n.nvmlShutdown()
        out["after_shutdown"] = code(n.nvmlDeviceGetCount)
    """, SIMCUDA_DEVICES="3", SIMCUDA_MEMORY="512M")
    assert out["before_init"] == out["after_shutdown"] == 1  # NVML_ERROR_UNINITIALIZED
    assert out["count"] == 3
    assert out["uuids"] == [f"GPU-5151ad00-0000-4000-8000-{i:012x}" for i in range(3)]
    assert out["names"] == ["nvshare simulated GPU"]
    assert out["memory"] == [512 << 20] * 3 and out["memory_v2"] == 512 << 20
    assert out["index_by_uuid"] == 2 and out["minor"] == 2 and out["cc"] == [9, 0]
    assert out["unknown_uuid"] == 6 and out["bad_index"] == 2  # NOT_FOUND, INVALID_ARGUMENT
    assert out["too_small"] == "Insufficient Size"


def test_a_gone_gpu_fails_every_lookup_until_it_is_back(simnvml_dir, tmp_path):  # noqa: F811
    state = tmp_path / "state"
    out = run_nvml(simnvml_dir, f"""
        n.nvmlInit()
        handle = n.nvmlDeviceGetHandleByIndex(1)
        open({str(state)!r}, "w").write("1 gone\\n")
        out["count"] = n.nvmlDeviceGetCount()
        out["by_index"] = code(lambda: n.nvmlDeviceGetHandleByIndex(1))
        out["by_uuid"] = code(lambda: n.nvmlDeviceGetHandleByUUID({UUID1!r}))
        out["query"] = code(lambda: n.nvmlDeviceGetMemoryInfo(handle))
        out["other_gpu"] = code(lambda: n.nvmlDeviceGetHandleByIndex(0))
        open({str(state)!r}, "w").write("1 ok\\n")
        out["back"] = code(lambda: n.nvmlDeviceGetMemoryInfo(handle))
    """, state_file=state, SIMCUDA_DEVICES="2")
    assert out == {"count": 2, "by_index": 15, "by_uuid": 6, "query": 15, "other_gpu": 0, "back": 0}


def test_an_xid_is_delivered_once_to_each_event_set(simnvml_dir, tmp_path):  # noqa: F811
    state = tmp_path / "state"
    state.write_text("0 xid:79\n")  # already there when the sets register: still delivered
    out = run_nvml(simnvml_dir, f"""
        n.nvmlInit()
        handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        out["supported"] = n.nvmlDeviceGetSupportedEventTypes(handles[0])
        first, second = n.nvmlEventSetCreate(), n.nvmlEventSetCreate()
        for handle in handles:
            n.nvmlDeviceRegisterEvents(handle, n.nvmlEventTypeXidCriticalError, first)
        n.nvmlDeviceRegisterEvents(handles[0], n.nvmlEventTypeXidCriticalError, second)
        def take(event_set):
            try:
                data = n.nvmlEventSetWait_v2(event_set, 50)
            except n.NVMLError_Timeout:
                return None
            return [n.nvmlDeviceGetUUID(data.device), data.eventType, data.eventData]
        out["first"] = take(first)
        out["first_again"] = take(first)
        out["second"] = take(second)
        open({str(state)!r}, "w").write("0 xid:79\\n1 xid:48\\n")
        out["other_gpu"] = take(first)
        out["second_other_gpu"] = take(second)  # not registered for GPU 1
        open({str(state)!r}, "w").write("0 ok\\n")
        take(first)
        open({str(state)!r}, "w").write("0 xid:79\\n")
        out["rearmed"] = take(first)
        out["unsupported"] = code(lambda: n.nvmlDeviceRegisterEvents(handles[0], n.nvmlEventTypePState, first))
        n.nvmlEventSetFree(first)
        n.nvmlEventSetFree(second)
    """, state_file=state, SIMCUDA_DEVICES="2")
    xid = 8  # nvmlEventTypeXidCriticalError
    assert out["supported"] == xid
    assert out["first"] == out["second"] == out["rearmed"] == [UUID0, xid, 79]
    assert out["first_again"] is None and out["second_other_gpu"] is None
    assert out["other_gpu"] == [UUID1, xid, 48]
    assert out["unsupported"] == 3  # NOT_SUPPORTED


@pytest.mark.parametrize("variable, value", [("SIMCUDA_DEVICES", "two"), ("SIMCUDA_MEMORY", "16T")])
def test_bad_settings_fail_init_with_a_message(simnvml_dir, variable, value):  # noqa: F811
    environment = dict(os.environ, LD_LIBRARY_PATH=str(simnvml_dir), **{variable: value})
    done = subprocess.run([sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"], env=environment,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{variable}={value}" in done.stderr and "NVMLError_Unknown" in done.stderr
