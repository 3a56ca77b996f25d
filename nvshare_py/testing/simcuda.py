"""The simulated CUDA driver of tests/simcuda, built from a checkout.

    simcuda = build_simcuda(checkout, out_dir)       # make -C tests/simcuda BUILD=out_dir
    trace = out_dir / "trace.jsonl"
    run = simcuda.run_simapp("kernel:1000", "kernel:1000", "sync", env=simcuda.env(trace=trace))
    assert run.returncode == 0, run.stderr
    run.steps[0]["rc"]                               # the step lines, "init" excluded
    kernels = [line for line in simcuda.read_trace(trace) if line["op"] == "kernel"]

    simcuda.lib_dir        # Path holding libcuda.so.1 and libnvidia-ml.so.1
    simcuda.simapp         # Path of the simapp program (steps: tests/simcuda/README.md)
    simcuda.env(trace=None, devices=1, memory="16G", **extra)
                           # environment for child processes: LD_LIBRARY_PATH (the simulated
                           # libraries first), SIMCUDA_DEVICES, SIMCUDA_MEMORY, SIMCUDA_TRACE (only
                           # when `trace` is given), PYTHONPATH (so children import this
                           # nvshare_py); CUDA_VISIBLE_DEVICES removed; `extra` set last
    simcuda.read_trace(path)          # the trace file's lines as dicts ([] if it does not exist)
    simcuda.run_simapp(*steps, env=None, entry="gpa", ptds=False, preload=None, timeout=60)
                           # runs simapp to completion -> SimappRun(returncode, init, steps,
                           # stderr); env defaults to simcuda.env(); preload sets LD_PRELOAD
    simcuda.simapp_argv(*steps, entry="gpa", ptds=False)
                           # the command line, for callers that start simapp themselves
    simcuda.python(code, env=None, argv=(), timeout=60)
                           # runs `python -c code` (env defaults to simcuda.env()) and returns
                           # its last stdout line parsed as JSON; AssertionError, showing
                           # stderr, if the child fails
    simcuda.real_env()     # environment for child processes without the simulated driver
    simcuda.real_gpu()     # whether a real driver with a GPU answers there (for gpu tests)
    parse_steps(text)      # simapp's stdout -> list of dicts
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvshare_py.testing import CHECKOUT_SIMCUDA, PACKAGE_PARENT


def parse_steps(text: str) -> list[dict[str, Any]]:
    """simapp's stdout: one JSON object per line."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@dataclass
class SimappRun:
    returncode: int
    init: dict[str, Any]
    steps: list[dict[str, Any]]
    stderr: str


class SimCuda:
    def __init__(self, lib_dir: Path):
        self.lib_dir = lib_dir
        self.simapp = lib_dir / "simapp"

    def env(self, trace: str | os.PathLike[str] | None = None, devices: int = 1, memory: str = "16G",
            **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.pop("SIMCUDA_TRACE", None)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(self.lib_dir), env.get("LD_LIBRARY_PATH", "")) if p)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
        env["SIMCUDA_DEVICES"] = str(devices)
        env["SIMCUDA_MEMORY"] = memory
        if trace is not None:
            env["SIMCUDA_TRACE"] = str(trace)
        env.update(extra)
        return env

    @staticmethod
    def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        path = Path(path)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def simapp_argv(self, *steps: str, entry: str = "gpa", ptds: bool = False) -> list[str]:
        return [str(self.simapp), f"--entry={entry}", *(["--ptds"] if ptds else []), *steps]

    def run_simapp(self, *steps: str, env: dict[str, str] | None = None, entry: str = "gpa", ptds: bool = False,
                   preload: str | os.PathLike[str] | None = None, timeout: float = 60) -> SimappRun:
        env = dict(env if env is not None else self.env())
        if preload is not None:
            env["LD_PRELOAD"] = str(preload)
        result = subprocess.run(self.simapp_argv(*steps, entry=entry, ptds=ptds), env=env, capture_output=True,
                                text=True, timeout=timeout)
        lines = parse_steps(result.stdout)
        init = lines[0] if lines and lines[0]["step"] == "init" else {}
        return SimappRun(result.returncode, init, lines[1:] if init else lines, result.stderr)

    def python(self, code: str, env: dict[str, str] | None = None, argv: tuple[str, ...] = (), timeout: float = 60) -> Any:
        run = subprocess.run([sys.executable, "-c", code, *argv], env=env if env is not None else self.env(),
                             capture_output=True, text=True, timeout=timeout)
        assert run.returncode == 0, f"child python failed ({run.returncode}):\n{run.stderr}"
        return json.loads(run.stdout.splitlines()[-1])

    def real_env(self) -> dict[str, str]:
        env = self.env()
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in env["LD_LIBRARY_PATH"].split(os.pathsep)
                                                 if p and p != str(self.lib_dir))
        for name in ("SIMCUDA_DEVICES", "SIMCUDA_MEMORY"):
            env.pop(name)
        return env

    def real_gpu(self) -> bool:
        code = "from nvshare_py.driver import Driver; print(Driver().devices()[0].name)"
        run = subprocess.run([sys.executable, "-c", code], env=self.real_env(), capture_output=True, text=True,
                             timeout=120)
        return run.returncode == 0 and run.stdout.strip() != "nvshare simulated GPU"


def build_simcuda(checkout: Path, out_dir: Path) -> SimCuda:
    """`make -C tests/simcuda BUILD=<out_dir>`: libcuda.so.1, libnvidia-ml.so.1, simapp."""
    source = checkout / CHECKOUT_SIMCUDA
    result = subprocess.run(["make", "-s", "-C", str(source), f"BUILD={out_dir}"], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {source} failed:\n{result.stdout}\n{result.stderr}")
    return SimCuda(out_dir)
