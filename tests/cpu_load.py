"""Keep every CPU busy, to check that the test suite does not depend on an idle machine.

    python3 tests/cpu_load.py -- pytest -q                   # the suite under full CPU load
    python3 tests/cpu_load.py --repeat 5 -- pytest -q        # five runs in a row, stop at a failure
    python3 tests/cpu_load.py --processes 4 --seconds 600    # just the load, for 10 minutes

Starts `--processes` busy-looping Python processes (default: one per CPU), runs the command
(`--repeat` times, stopping at the first failure) and stops them again; the exit status is the
command's. Without a command it keeps the load up for `--seconds` (or until Ctrl-C). Each busy
process also stops by itself after `--seconds` and as soon as this script is gone, so an
interrupted run never leaves load behind. Nothing to install: the standard library only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

# One busy process: spin until the deadline or until its parent (this script) is gone.
BUSY = """
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while os.getppid() == parent and time.monotonic() < deadline:
    for _ in range(100_000):
        pass
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [--processes N] [--seconds S] [--repeat K] [-- COMMAND ...]")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                        help="busy processes to start (default: one per CPU, %(default)s here)")
    parser.add_argument("--seconds", type=float, default=3600.0,
                        help="the longest the load stays up (default: %(default)g)")
    parser.add_argument("--repeat", type=int, default=1, help="run the command this many times in a row")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run under load (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.processes < 1 or args.seconds <= 0 or args.repeat < 1:
        parser.error("--processes, --seconds and --repeat must be positive")

    # Started in the background of a shell, this script would pass SIGINT on ignored to the
    # command (and to the programs its tests start); handled here, it is back to normal there.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid()), str(args.seconds)])
            for _ in range(args.processes)]
    print(f"cpu_load: {len(busy)} busy processes for at most {args.seconds:g} s", file=sys.stderr, flush=True)
    status = 0
    try:
        if not command:
            for process in busy:
                process.wait()
            return 0
        for run in range(1, args.repeat + 1):
            started = time.monotonic()
            status = subprocess.call(command)
            print(f"cpu_load: run {run}/{args.repeat} exited {status} after {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)
            if status != 0:
                break
        return status
    except KeyboardInterrupt:
        return 130
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
