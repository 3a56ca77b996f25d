"""A CUDA-graph capture survives a handoff (issue 10): a context synchronise from another thread
invalidates a stream capture (measured on an H200, modelled by the simulated driver), so the
interceptor must neither drain nor probe while a capture is in progress, and the capturing
thread's launches must pass the closed gate (they only build the graph)."""

from __future__ import annotations

import subprocess

from nvshare_py.testing.simcuda import parse_steps


def test_a_capture_survives_the_end_of_its_quantum(scheduler_factory, simcuda, libnvshare):
    scheduler = scheduler_factory(tq=0.2, grace=30)
    env = simcuda.env()
    env.update({k: v for k, v in scheduler.env.items() if k.startswith("NVSHARE")})
    env.update(LD_PRELOAD=str(libnvshare), NVSHARE_IDLE_RELEASE_MS="0")
    # A holds the lock and captures for 1.5 s, far past its 0.2 s quantum, while B waits.
    capture = subprocess.Popen(
        simcuda.simapp_argv("stream:new", "kernel:1000", "stream-sync", "capture-begin", "kernel:1000",
                            "sleep:1500", "kernel:1000", "capture-end", "graph-launch", "stream-sync",
                            "capture-begin", "kernel:1000", "capture-end", "graph-launch", "stream-sync"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in capture.stdout:  # until the capture is in progress
            seen.append(line)
            if '"capture-begin"' in line:
                break
        assert seen and '"capture-begin"' in seen[-1], f"no capture began: {seen}"
        other = subprocess.run(simcuda.simapp_argv("kernel:1000", "sync"), env=env, capture_output=True,
                               text=True, timeout=120)
        rest, err = capture.communicate(timeout=120)
        out = "".join(seen) + rest
    finally:
        if capture.poll() is None:
            capture.kill()
    assert capture.returncode == 0 and other.returncode == 0, err + other.stderr
    ends = [step for step in parse_steps(out) if step["step"] == "capture-end"]
    assert [step["rc"] for step in ends] == [0, 0], f"a capture was invalidated: {ends}\n{err}"
    launches = [step for step in parse_steps(out) if step["step"] == "graph-launch"]
    assert [step["rc"] for step in launches] == [0, 0], launches
    # the lock did change hands: B ran, so A released after its capture ended
    releases = [e for e in scheduler.events() if e["kind"] == "release"]
    assert releases, scheduler.events()
