"""`nvshare-run`: run any program under nvshare.

    nvshare-run [--socket-dir D] [--fail-open] [--print-library] [--] COMMAND [ARGS...]

Puts libnvshare.so in front of LD_PRELOAD, points the interceptor at the scheduler's socket
directory, checks that the scheduler answers there, and execs COMMAND in this process (so
signals, exit status and the pid are the program's own).

Exit status: that of COMMAND; 2 for a usage error or a missing libnvshare.so; 3 when the
scheduler is not reachable (unless --fail-open); 126/127 when COMMAND cannot be executed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import library
from .paths import ENV_SOCKET_DIR, SocketPaths, connect_error

EXIT_USAGE = 2
EXIT_NO_SCHEDULER = 3

app = typer.Typer(add_completion=False, context_settings={"allow_interspersed_args": False})


def scheduler_unreachable(paths: SocketPaths) -> str | None:
    """Why the scheduler's client socket cannot be connected to, or None when it can."""
    error = connect_error(paths.client_socket)
    return None if error is None else error.strerror or str(error)


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


@app.command()
def run(
    command: Optional[List[str]] = typer.Argument(None, metavar="COMMAND [ARGS]...", show_default=False),
    socket_dir: Optional[Path] = typer.Option(
        None, "--socket-dir", envvar=ENV_SOCKET_DIR,
        help="The scheduler's socket directory (default: the per-user default of nvshare-scheduler).",
    ),
    fail_open: bool = typer.Option(
        False, "--fail-open",
        help="Run even if the scheduler is unreachable, and let the program's GPU work run unscheduled "
             "while there is none (NVSHARE_FAIL_MODE=open).",
    ),
    print_library: bool = typer.Option(False, "--print-library", help="Print the path of libnvshare.so and exit."),
) -> None:
    """Run COMMAND with its GPU work scheduled by nvshare."""
    try:
        lib = library.path()
    except library.LibraryNotFound as error:
        raise fail(str(error), EXIT_USAGE) from None
    if print_library:
        typer.echo(str(lib))
        return
    if not command:
        raise fail("no command given (usage: nvshare-run [OPTIONS] [--] COMMAND [ARGS]...)", EXIT_USAGE)

    paths = SocketPaths.resolve(socket_dir)
    env = dict(os.environ)
    env[ENV_SOCKET_DIR] = str(paths.root)
    env["LD_PRELOAD"] = with_preload(env.get("LD_PRELOAD"), lib)
    if fail_open:
        env["NVSHARE_FAIL_MODE"] = "open"

    reason = scheduler_unreachable(paths)
    if reason is not None:
        where = f"no nvshare scheduler at {paths.client_socket} ({reason})"
        if not fail_open:
            raise fail(
                f"{where}. Start nvshare-scheduler, point --socket-dir or {ENV_SOCKET_DIR} at its directory, "
                f"or pass --fail-open to run unscheduled until it is reachable.",
                EXIT_NO_SCHEDULER,
            )
        typer.echo(f"nvshare-run: {where}; running unscheduled until it is reachable (--fail-open)", err=True)

    status, why = exec_command(command, env)
    raise fail(why, status)


def main() -> None:
    app(prog_name="nvshare-run")


if __name__ == "__main__":
    main()
