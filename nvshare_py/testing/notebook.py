"""Jupyter kernels driven as a notebook front end drives them (jupyter_client; the package's
`jupyter` extra), for tests and benchmarks of the nvshare kernelspec.

    kernel = Kernel(spec_dir, "python3-nvshare", env)   # started from a kernelspec directory
    kernel = Kernel(spec_dir, name, env, log=file)      # its stdout and stderr (the interceptor's
                                                        #   log) into that open file
    kernel.run(SETUP)                  # -> Cell (stdout, stderr, displays, updates, result,
                                       #   error, notes); AssertionError if the cell failed
    msg_id = kernel.submit(code); kernel.collect(msg_id, until=...)   # a cell still running
    kernel.status()                    # what the extension reports (%nvshare json)
    kernel.shutdown()
"""

from __future__ import annotations

import ast
import queue
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from jupyter_client.provisioning import LocalProvisioner

from nvshare_py.testing.scheduler import CHILD_CWD, PATIENCE

# The GPU work of the cells: the ctypes driver binding, through the interceptor, on simcuda.
SETUP = """
from nvshare_py.driver import Driver
gpu = Driver()
gpu.context(0)
buffer = gpu.alloc(64 << 20)
"""


@dataclass
class Cell:
    stdout: str = ""
    stderr: str = ""
    displays: list[str] = field(default_factory=list)  # text/plain of display_data
    updates: list[str] = field(default_factory=list)  # text/plain of update_display_data
    result: str = ""  # text/plain of execute_result
    error: str = ""

    @property
    def notes(self) -> list[str]:
        return [text for text in self.displays if text.startswith("nvshare: this cell waited")]


class Kernel:
    """One kernel from the kernelspec, driven like a notebook front end drives it."""

    def __init__(self, spec_dir: str, name: str, env: dict[str, str], log: IO[str] | None = None) -> None:
        specs = KernelSpecManager(kernel_dirs=[spec_dir])
        self.manager = KernelManager(kernel_name=name, kernel_spec_manager=specs)
        output = {} if log is None else {"stdout": log, "stderr": log}
        self.manager.start_kernel(env=env, cwd=CHILD_CWD, **output)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client_id = ""

    @property
    def pid(self) -> int:
        provisioner = self.manager.provisioner
        assert isinstance(provisioner, LocalProvisioner) and provisioner.pid is not None, "a started local kernel"
        return provisioner.pid

    def submit(self, code: str) -> str:
        return self.client.execute(code)

    def collect(self, msg_id: str, timeout: float = 2 * PATIENCE, cell: Cell | None = None,
                until: Callable[[Cell], bool] = lambda cell: False) -> Cell:
        """Everything cell `msg_id` printed and displayed, once it has finished (or, with
        `until`, once that holds of what it has shown so far; collect again to go on)."""
        cell = cell or Cell()
        deadline = time.monotonic() + timeout
        while not until(cell):
            try:
                msg = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"cell {msg_id} of kernel {self.pid} did not finish within {timeout:g} s: {cell}")
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    cell.stdout += content["text"]
                else:
                    cell.stderr += content["text"]
            elif kind == "display_data":
                cell.displays.append(content["data"].get("text/plain", ""))
            elif kind == "update_display_data":
                cell.updates.append(content["data"].get("text/plain", ""))
            elif kind == "execute_result":
                cell.result = content["data"].get("text/plain", "")
            elif kind == "error":
                cell.error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                return cell
        return cell

    def run(self, code: str, timeout: float = 2 * PATIENCE) -> Cell:
        cell = self.collect(self.submit(code), timeout)
        assert not cell.error, f"cell failed: {cell.error}\n{cell.stderr}"
        return cell

    def status(self) -> dict:
        """What the extension reports (%nvshare json), evaluated in the kernel."""
        return ast.literal_eval(self.run("%nvshare json").result)

    def shutdown(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
        else:
            self.manager.cleanup_resources()
