"""`nvshare-run`: run any program under nvshare.

    nvshare-run [--socket-dir D] [--fail-open] [--] COMMAND [ARGS...]
    nvshare-run --print-library | --print-socket-dir | --print-simulated-driver

Puts libnvshare.so in front of LD_PRELOAD, points the interceptor at the scheduler's socket
directory, checks that the scheduler answers there, and execs COMMAND in this process (so
signals, exit status and the pid are the program's own). Without --socket-dir or
NVSHARE_SOCKET_DIR that is the system scheduler's directory when one serves, else this user's
(nvshare_py/paths.py); --print-socket-dir shows which and why.

Where no CUDA driver can be loaded (a machine without a GPU) it says so in one line before
running COMMAND, on a terminal only (scripts run their commands quietly), and names the
simulated driver that nvshare_py ships for trying it out.

Exit status: that of COMMAND; 2 for a usage error or a missing libnvshare.so; 3 when the
scheduler is not reachable (unless --fail-open); 126/127 when COMMAND cannot be executed.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import library
from .clikit import APP_SETTINGS, VERSION_OPTION
from .paths import ENV_SOCKET_DIR, SocketPaths, connect_error, not_a_directory, system_socket_dir

EXIT_USAGE = 2
EXIT_NO_SCHEDULER = 3

# The simulated CUDA driver and NVML built into the package (setup.py), for machines without a GPU.
SIMULATED_DRIVER_DIR = Path(__file__).resolve().parent / "_lib" / "simcuda"

app = typer.Typer(**APP_SETTINGS)


def scheduler_unreachable(paths: SocketPaths) -> str | None:
    """Why the scheduler's client socket cannot be connected to, or None when it can."""
    error = connect_error(paths.client_socket)
    return None if error is None else error.strerror or str(error)


def driver_missing() -> str | None:
    """Why this machine's CUDA driver (libcuda.so.1) cannot be loaded, or None when it can.
    Loaded in this process, which has COMMAND's LD_LIBRARY_PATH; exec discards it."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        return str(error)
    return None


def simulated_driver_hint() -> str:
    return f"LD_LIBRARY_PATH={SIMULATED_DRIVER_DIR} nvshare-run COMMAND"


def start_advice(paths: SocketPaths) -> str:
    """What to do when no scheduler answers where `paths` points."""
    if paths.origin in ("set explicitly", ENV_SOCKET_DIR):
        return f"Start nvshare-scheduler --socket-dir {paths.root}, or point --socket-dir or {ENV_SOCKET_DIR} at " \
               "the directory a scheduler serves"
    return (f"No scheduler serves this machine: start one as root (nvshare-scheduler; it serves {system_socket_dir()} "
            "and every user's programs use it), or as yourself for your own programs only (stop yours when the "
            "system one runs again: programs of two schedulers share GPUs without taking turns; both log a warning)")


def with_preload(existing: str | None, lib: Path) -> str:
    """LD_PRELOAD with `lib` first (once), keeping whatever was there."""
    others = [entry for entry in (existing or "").replace(" ", ":").split(":") if entry and entry != str(lib)]
    return ":".join([str(lib), *others])


def exec_command(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Replace this process with COMMAND (so it keeps the pid, signals and exit status). Returns
    only when it cannot be executed: the exit status a shell gives then (127 not found, 126
    otherwise) and why."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        return 127, f"{command[0]}: command not found"
    except OSError as error:
        return 126, f"{command[0]}: {error.strerror or error}"


def fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"nvshare-run: {message}", err=True)
    return typer.Exit(code)


@app.command(context_settings={**APP_SETTINGS["context_settings"], "allow_interspersed_args": False})
def run(
    command: Optional[List[str]] = typer.Argument(None, metavar="COMMAND [ARGS]...", show_default=False),
    socket_dir: Optional[Path] = typer.Option(
        None, "--socket-dir", envvar=ENV_SOCKET_DIR,
        help="The scheduler's socket directory [default: the system scheduler's when one serves, else this user's]",
    ),
    fail_open: bool = typer.Option(
        False, "--fail-open",
        help="Run even if the scheduler is unreachable, and let the program's GPU work run unscheduled "
             "while there is none (NVSHARE_FAIL_MODE=open).",
    ),
    print_library: bool = typer.Option(False, "--print-library", help="Print the path of libnvshare.so and exit."),
    print_socket_dir: bool = typer.Option(
        False, "--print-socket-dir", help="Print the scheduler's socket directory that COMMAND would use, and why; exit."
    ),
    print_simulated_driver: bool = typer.Option(
        False, "--print-simulated-driver",
        help="Print the directory of the simulated CUDA driver (for LD_LIBRARY_PATH on a machine without a GPU); exit.",
    ),
    version: bool = VERSION_OPTION,
) -> None:
    """Run COMMAND with its GPU work scheduled by nvshare."""
    if print_simulated_driver:
        if not (SIMULATED_DRIVER_DIR / "libcuda.so.1").is_file():
            raise fail(f"the simulated driver is not installed at {SIMULATED_DRIVER_DIR}: install nvshare_py with "
                       f"pip (which builds it), or build it with `make -C tests/simcuda BUILD=<dir>`", EXIT_USAGE)
        typer.echo(str(SIMULATED_DRIVER_DIR))
        return
    paths = SocketPaths.resolve(socket_dir)
    if print_socket_dir:
        typer.echo(paths.describe())
        return
    try:
        lib = library.path()
    except library.LibraryNotFound as error:
        raise fail(str(error), EXIT_USAGE) from None
    if print_library:
        typer.echo(str(lib))
        return
    if not command:
        raise fail("no command given (usage: nvshare-run [OPTIONS] [--] COMMAND [ARGS]...)", EXIT_USAGE)

    problem = not_a_directory(paths.root)
    if problem is not None:
        raise fail(problem, EXIT_USAGE)
    env = dict(os.environ)
    env[ENV_SOCKET_DIR] = str(paths.root)
    env["LD_PRELOAD"] = with_preload(env.get("LD_PRELOAD"), lib)
    if fail_open:
        env["NVSHARE_FAIL_MODE"] = "open"

    reason = scheduler_unreachable(paths)
    if reason is not None:
        where = f"no nvshare scheduler at {paths.client_socket} ({reason}; socket directory {paths.describe()})"
        if not fail_open:
            raise fail(f"{where}. {start_advice(paths)}, or pass --fail-open to run unscheduled until it is reachable.",
                       EXIT_NO_SCHEDULER)
        typer.echo(f"nvshare-run: {where}; running unscheduled until it is reachable (--fail-open)", err=True)

    if sys.stderr.isatty() and driver_missing() is not None:
        typer.echo(f"nvshare-run: no CUDA driver; simulated one: {simulated_driver_hint()}", err=True)
    status, why = exec_command(command, env)
    raise fail(why, status)


def main() -> None:
    app(prog_name="nvshare-run")


if __name__ == "__main__":
    main()
