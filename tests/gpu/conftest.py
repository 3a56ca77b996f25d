"""Real-GPU tests: skipped cleanly where no NVIDIA GPU answers.

Results worth keeping are appended, as JSON lines, to the file named by NVSHARE_GPU_RESULTS
(benchmarks/gpu/run_gpu_suite.sh sets it), so the numbers land in benchmarks/results/.
"""

from __future__ import annotations

import json
import os

import pytest

from gpuutil import WORKLOADS


@pytest.fixture(scope="session")
def gpu_env(simcuda) -> dict[str, str]:
    """Environment for child processes on the real driver; skips the test without a GPU."""
    if not simcuda.real_gpu():
        pytest.skip("no NVIDIA GPU with a working driver here")
    env = simcuda.real_env()
    # Several framework processes share the card: no framework may grab most of its memory.
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", TF_FORCE_GPU_ALLOW_GROWTH="true", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORKLOADS), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="session")
def record():
    """record(name, **values): keep a result for benchmarks/results/."""
    target = os.environ.get("NVSHARE_GPU_RESULTS")

    def write(name: str, **values) -> None:
        if target:
            with open(target, "a") as out:
                out.write(json.dumps({"test": name, **values}) + "\n")

    return write
