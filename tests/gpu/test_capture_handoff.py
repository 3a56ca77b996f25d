"""CUDA-graph capture survives lock handoffs on a real GPU (issue 10). One process captures and
replays a graph of 8 linear layers in a loop for 25 s while another runs bursts on the same GPU,
so the lock keeps changing hands (by quantum, pre-drain and idleness). Measured before the fix
on an H200 with PyTorch 2.11: 4 of 930 captures failed at TQ 1 s, 10 of 873 at TQ 0.3 s. Target:
no failed capture while the lock still changes hands. Memory: a few MiB per process.

    python3 -m pytest tests/gpu/test_capture_handoff.py -m gpu -p no:cacheprovider -q -rA -s
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuutil import WORKLOADS

pytestmark = pytest.mark.gpu

SECONDS = 25.0


def needs(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here")


@pytest.mark.parametrize("tq", [0.3, 1.0])
def test_graph_captures_survive_handoffs(gpu_env, libnvshare, scheduler_factory, record, tq):
    needs("torch")
    scheduler = scheduler_factory(tq=tq, grace=max(2.0, 4 * tq), idle_release=0.25)
    env = dict(gpu_env, **{k: v for k, v in scheduler.env.items() if k.startswith("NVSHARE")})
    env.update(LD_PRELOAD=str(libnvshare), NVSHARE_LOG="info")
    bursts = int(SECONDS / 0.5)
    capture = subprocess.Popen([sys.executable, str(WORKLOADS / "graph_capture.py"), "--seconds", str(SECONDS)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    burst = subprocess.Popen([sys.executable, str(WORKLOADS / "burst.py"), "--bursts", str(bursts),
                              "--burst-seconds", "0.2", "--pause-seconds", "0.3", "--name", "burst"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = capture.communicate(timeout=600)
    burst_out, burst_err = burst.communicate(timeout=600)
    assert capture.returncode == 0, err[-4000:]
    assert burst.returncode == 0, burst_err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    grants = [e for e in scheduler.events() if e["kind"] == "grant"]
    handoffs = sum(1 for a, b in zip(grants, grants[1:]) if a["client"] != b["client"])
    summary = {"tq": tq, "captures": result["captures"], "failed": result["failed"], "errors": result["errors"],
               "replays": result["replays"], "handoffs": handoffs, "grants": len(grants)}
    print(json.dumps(summary))
    record("capture_handoff", **summary)
    assert handoffs >= 4, f"the lock hardly changed hands: {summary}"
    assert result["failed"] == 0, f"captures failed under handoffs: {summary}\n{err[-4000:]}"
