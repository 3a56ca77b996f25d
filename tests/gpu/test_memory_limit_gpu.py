"""NVSHARE_MEMORY_LIMIT on a real GPU: PyTorch, NVML in the process and nvidia-smi in a limited
process report the limit; an allocation past it raises OutOfMemoryError and the program goes on.
At most 1.5 GiB is allocated (limit 2 GiB)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from gpuutil import run_workload

pytestmark = pytest.mark.gpu
LIMIT = 2 << 30


@pytest.fixture
def limited(gpu_env, libnvshare, scheduler_factory):
    scheduler = scheduler_factory(tq=2, grace=2, idle_release=0.5)
    env = dict(gpu_env, **{k: v for k, v in scheduler.env.items() if k.startswith("NVSHARE")})
    env.update(LD_PRELOAD=str(libnvshare), NVSHARE_LOG="info", NVSHARE_MEMORY_LIMIT="2G",
               NVS_TEST_LIMIT_BYTES=str(LIMIT))
    return env


def test_pytorch_and_nvml_see_the_limit(limited, record):
    pytest.importorskip("torch")
    pytest.importorskip("pynvml")
    result = run_workload("torch_limit.py", limited)
    record("memory_limit_torch", **result)
    free, total = result["mem_get_info"]
    assert total == LIMIT and 0 < free <= LIMIT
    assert result["total_memory"] == LIMIT
    assert result["over_limit"] == "OutOfMemoryError"
    nvml_total, nvml_free, nvml_used = result["nvml"]
    assert nvml_total == LIMIT and nvml_used >= int(0.75 * LIMIT) and nvml_free + nvml_used == LIMIT
    assert result["after_free"] == "allocated"


def test_nvidia_smi_in_a_limited_process_shows_the_limit(limited, record):
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi")
    query = ["nvidia-smi", "-i", "0", "--query-gpu=memory.total,memory.used,memory.free", "--format=csv,noheader,nounits"]
    shown = subprocess.run(query, env=limited, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    total, used, free = (int(v) for v in shown.stdout.split(","))  # MiB
    record("memory_limit_nvidia_smi", total_mib=total, used_mib=used, free_mib=free, stderr=shown.stderr[-500:])
    assert total == LIMIT >> 20 and used + free <= total
