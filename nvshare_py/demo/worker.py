"""The two programs of `nvshare-demo`, and its GPU probe. nvshare_py.demo runs them; they are
not meant to be run by hand.

    python -m nvshare_py.demo.worker probe
        Without the interceptor: one JSON line describing CUDA device 0 (uuid, name, total and
        free memory), or exit status 1 with the reason on stderr.
    python -m nvshare_py.demo.worker training|notebook --until UNIX_TIME --tq SECONDS [--parent PID]
        Under the interceptor: GPU work on device 0 until UNIX_TIME, with progress as JSON lines
        on stdout ({"event": "started"|"step"|"cell"|"done", ...}); exit status 1 on a driver
        error.

training   steps of 0.2 s of kernels, each followed by a 20 ms host-side pause, well inside the
           idle window of a holder that others wait for (the scheduler's contended window,
           0.1 s): it keeps the lock until its time quantum runs out while the notebook waits,
           and then hands it over.
notebook   a "cell" of 0.6 s of kernels after half a time quantum of thinking: it asks while the
           training holds the lock, waits for it, runs, and then idles, so it gives the lock back
           early.

Each keeps a 4 MiB buffer that every step fills with the step's number, and reads it back at
the end ("verified"), so the demo also shows that results stay right. The kernels are
`nvshare_sleep` (the GPU is busy for that long, on a real GPU as on the simulated one) and
`nvshare_fill` from nvshare_py.driver.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time

from ..driver import Driver, DriverError, DriverNotFound

BUFFER_BYTES = 4 << 20
TRAINING_KERNELS = (4, 50_000)  # per step: 4 kernels of 50 ms
# The host-side part of a step: well inside the contended idle window (0.1 s: while the notebook
# waits, a pause that long releases the lock early), also on a busy machine.
TRAINING_PAUSE = 0.02
NOTEBOOK_KERNELS = (6, 100_000)  # per cell: 6 kernels of 100 ms
NOTEBOOK_THINKING = 0.5  # time quanta between cells: it asks halfway through the training's quantum
NOTEBOOK_THINKING_MIN = 1.0  # seconds; longer than the demo's idle window, so it releases early
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# Loaded at import, not in die_with_parent: that also runs between fork and exec (the demo's
# preexec_fn for the scheduler), where the child should do as little as it can.
_LIBC = ctypes.CDLL(None, use_errno=True)


def say(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def probe() -> int:
    try:
        with Driver() as cuda:
            devices = cuda.devices()
            if not devices:
                print("the CUDA driver reports no device", file=sys.stderr)
                return 1
            cuda.context(0)
            free, total = cuda.mem_get_info()
    except (DriverNotFound, DriverError) as error:
        print(error, file=sys.stderr)
        return 1
    device = devices[0]
    print(json.dumps({"uuid": device.uuid, "name": device.name, "total": total, "free": free}))
    return 0


def die_with_parent(parent: int) -> None:
    """SIGTERM when the demo, process `parent`, goes, however it goes (so that nothing it started
    outlives it); exit at once if it went already. Also the scheduler's preexec_fn."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if parent and os.getppid() != parent:  # the demo went before the line above took effect
        raise SystemExit(1)


def _set_program_name(name: str) -> None:
    """A telling name in `nvsharectl status` (the interceptor reports /proc/self/comm)."""
    _LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _work(cuda: Driver, buffer: int, step: int, kernels: tuple[int, int]) -> None:
    count, microseconds = kernels
    for _ in range(count):
        cuda.launch_sleep(microseconds)
    cuda.fill(buffer, step, BUFFER_BYTES // 4)
    cuda.synchronize()


def training(cuda: Driver, buffer: int, until: float, tq: float) -> int:
    steps = 0
    while time.time() < until:
        _work(cuda, buffer, steps + 1, TRAINING_KERNELS)
        steps += 1
        say("step", n=steps, gpu_s=round(steps * _seconds(TRAINING_KERNELS), 3))
        time.sleep(TRAINING_PAUSE)
    return steps


def notebook(cuda: Driver, buffer: int, until: float, tq: float) -> int:
    cells = 0
    thinking = max(NOTEBOOK_THINKING_MIN, NOTEBOOK_THINKING * tq)
    while time.time() + thinking < until:
        time.sleep(thinking)
        began = time.time()
        _work(cuda, buffer, cells + 1, NOTEBOOK_KERNELS)
        cells += 1
        say("cell", n=cells, gpu_s=round(cells * _seconds(NOTEBOOK_KERNELS), 3), took=round(time.time() - began, 3))
    return cells


def _seconds(kernels: tuple[int, int]) -> float:
    return kernels[0] * kernels[1] / 1e6


PROGRAMS = {"training": training, "notebook": notebook}


def run(role: str, until: float, tq: float) -> int:
    try:
        with Driver() as cuda:
            cuda.context(0)
            device = cuda.devices()[0]
            buffer = cuda.alloc(BUFFER_BYTES)
            say("started", device=device.uuid, pid=os.getpid())
            done = PROGRAMS[role](cuda, buffer, until, tq)
            last = int.from_bytes(cuda.memcpy_dtoh(buffer, 4), "little")
            cuda.free(buffer)
    except (DriverNotFound, DriverError) as error:
        print(f"{role}: {error}", file=sys.stderr)
        return 1
    say("done", n=done, verified=last == done)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvshare_py.demo.worker")
    parser.add_argument("role", choices=["probe", *PROGRAMS])
    parser.add_argument("--until", type=float, default=0.0, help="Unix time at which to stop")
    parser.add_argument("--tq", type=float, default=3.0, help="the scheduler's time quantum, seconds")
    parser.add_argument("--parent", type=int, default=0, help="the demo's pid: exit when it goes")
    args = parser.parse_args(argv)
    if args.role == "probe":
        return probe()
    die_with_parent(args.parent)
    _set_program_name(f"nvs-{args.role}")
    return run(args.role, args.until, args.tq)


if __name__ == "__main__":
    sys.exit(main())
