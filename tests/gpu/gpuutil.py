"""Helpers of the real-GPU tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WORKLOADS = Path(__file__).resolve().parent / "workloads"


def run_workload(script: str, env: dict[str, str], *args: str, timeout: float = 600) -> dict:
    """Run a workload to completion and return its last stdout line as JSON."""
    run = subprocess.run([sys.executable, str(WORKLOADS / script), *args], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, f"{script} {args} failed ({run.returncode}):\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])
