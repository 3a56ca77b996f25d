"""`nvshare-jupyter`: a Jupyter kernelspec whose kernels share the GPU through nvshare.

    nvshare-jupyter install [--user | --sys-prefix | --prefix P] [--name nvshare]
                            [--display-name "Python 3 (nvshare)"] [--socket-dir D]
                            [--fail-open] [--env KEY=VALUE]... [--no-extension] [--shadow]
    nvshare-jupyter uninstall [--user | --sys-prefix | --prefix P] [--name nvshare]
    nvshare-jupyter launch [--] COMMAND [ARGS...]      (what the kernelspec runs)

The kernelspec is ipykernel's own (same kernel, same notebooks) with one difference: its
command line starts with `python -m nvshare_py.jupyter launch --`, which puts libnvshare.so in
front of LD_PRELOAD (keeping what was there), sets NVSHARE_SOCKET_DIR and execs ipykernel, so
the kernel process keeps its pid, signals (interrupts) and exit status. ipykernel gets
`--ext=nvshare_py`, which loads the IPython extension (`%nvshare`, notes after cells that
waited for the GPU).

Why a launcher and not `nvshare-run`: nvshare-run refuses to start a program when no scheduler
answers, and a kernel that cannot start is a poor experience (Jupyter retries and then shows
"kernel died" with the reason hidden in the server's log). The launcher always starts the
kernel; when something is missing it says so on stderr (the server's log), and the extension
repeats it in the notebook, in the first cell's output:
- no scheduler: the kernel runs under nvshare with the interceptor's usual fail mode (closed:
  GPU calls wait until a scheduler is started; `install --fail-open` makes them run
  unscheduled meanwhile);
- no libnvshare.so (a broken installation): the kernel runs without nvshare, and says so.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

import typer

from . import __version__, library
from .clikit import APP_SETTINGS, VERSION_OPTION, missing_extra
from .paths import ENV_SOCKET_DIR, SocketPaths
from .run import exec_command, scheduler_unreachable, with_preload

DEFAULT_NAME = "nvshare"
DEFAULT_DISPLAY_NAME = "Python 3 (nvshare)"
EXIT_FAILED = 1
EXIT_USAGE = 2

app = typer.Typer(**APP_SETTINGS, no_args_is_help=True, help="Jupyter kernels that share the GPU through nvshare.")


@app.callback()
def options(version: bool = VERSION_OPTION) -> None:
    """Jupyter kernels that share the GPU through nvshare."""


def echo(message: str) -> None:
    typer.echo(f"nvshare-jupyter: {message}", err=True)


def chosen_prefix(user: bool, sys_prefix: bool, prefix: Optional[Path]) -> Optional[Path]:
    """The prefix chosen by --sys-prefix / --prefix; None for --user (the default)."""
    if sum((user, sys_prefix, prefix is not None)) > 1:
        echo("choose one of --user, --sys-prefix and --prefix")
        raise typer.Exit(EXIT_USAGE)
    if sys_prefix:
        return Path(sys.prefix)
    return None if prefix is None else prefix.absolute()


def require_jupyter() -> None:
    """Exit with one line that names the missing part of the `jupyter` extra and the command
    that installs it."""
    for module in ("jupyter_core", "jupyter_client", "ipykernel"):
        try:
            importlib.import_module(module)
        except ImportError:
            typer.echo(missing_extra("nvshare-jupyter", "jupyter", module), err=True)
            raise typer.Exit(EXIT_FAILED) from None


def kernels_dir(prefix: Optional[Path]) -> Path:
    """Where Jupyter keeps kernelspecs under `prefix`, or the user's own (None)."""
    if prefix is not None:
        return prefix / "share" / "jupyter" / "kernels"
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "kernels"


def kernel_command(extension: bool) -> list[str]:
    """ipykernel's own command line, run through the launcher."""
    from ipykernel.kernelspec import get_kernel_dict

    ipykernel_argv = get_kernel_dict(["--ext=nvshare_py"] if extension else [])["argv"]
    return [sys.executable, "-m", "nvshare_py.jupyter", "launch", "--", *ipykernel_argv]


def is_ours(spec_dir: Path) -> bool:
    try:
        spec = json.loads((spec_dir / "kernel.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(spec, dict) and isinstance(spec.get("metadata"), dict) and "nvshare" in spec["metadata"]


def shadowed(name: str, target: Path) -> Path | None:
    """The kernelspec called `name` that a kernelspec at `target` would hide from Jupyter (one
    nvshare-jupyter did not write, in a directory Jupyter searches after target's, or the
    python3 that ipykernel provides where no directory has one), or None."""
    from jupyter_client.kernelspec import KernelSpecManager

    manager = KernelSpecManager()
    searched = [Path(directory).absolute() for directory in manager.kernel_dirs]
    if target.parent.absolute() not in searched:
        return None  # Jupyter does not look there: it hides nothing
    later = searched[searched.index(target.parent.absolute()) + 1:]
    for directory in later:
        candidate = directory / name
        if (candidate / "kernel.json").is_file() and not is_ours(candidate):
            return candidate
    found = manager.find_kernel_specs().get(name)  # e.g. ipykernel's own python3, in no directory
    if found is not None and Path(found).absolute().parent not in searched:
        return Path(found)
    return None


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            echo(f"--env {pair!r}: expected KEY=VALUE")
            raise typer.Exit(EXIT_USAGE)
        env[key] = value
    return env


WHERE_USER = typer.Option(False, "--user", help="For the current user (the default).")
WHERE_SYS_PREFIX = typer.Option(False, "--sys-prefix", help=f"In this Python environment ({sys.prefix}).")
WHERE_PREFIX = typer.Option(None, "--prefix", help="Under PREFIX/share/jupyter/kernels.")
NAME = typer.Option(DEFAULT_NAME, "--name", help="The kernelspec's name (a directory name).")


@app.command()
def install(
    user: bool = WHERE_USER,
    sys_prefix: bool = WHERE_SYS_PREFIX,
    prefix: Optional[Path] = WHERE_PREFIX,
    name: str = NAME,
    display_name: str = typer.Option(DEFAULT_DISPLAY_NAME, "--display-name", help="The name notebooks show."),
    socket_dir: Optional[Path] = typer.Option(
        None, "--socket-dir",
        help=f"The scheduler's socket directory, recorded in the kernelspec (default: {ENV_SOCKET_DIR} of the "
             "Jupyter server, else the per-user default of nvshare-scheduler).",
    ),
    fail_open: bool = typer.Option(
        False, "--fail-open",
        help="While no scheduler answers, let the kernels' GPU work run unscheduled instead of waiting.",
    ),
    env: List[str] = typer.Option([], "--env", metavar="KEY=VALUE", help="More environment for the kernels."),
    extension: bool = typer.Option(True, "--extension/--no-extension",
                                   help="Load the IPython extension (%nvshare) in every kernel."),
    shadow: bool = typer.Option(False, "--shadow",
                                help="Install under the name of another kernelspec Jupyter finds elsewhere (such as "
                                     "the stock python3), hiding it from the notebooks that would find this one first."),
) -> None:
    """Install the kernelspec: ipykernel kernels running under nvshare."""
    require_jupyter()
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager

    prefix = chosen_prefix(user, sys_prefix, prefix)
    directory = kernels_dir(prefix)
    try:
        lib = library.path()
    except library.LibraryNotFound as error:
        echo(f"{error}\nWithout libnvshare.so the kernels would not share the GPU; nothing was installed.")
        raise typer.Exit(EXIT_FAILED) from None
    target = directory / name.lower()
    if target.exists() and not is_ours(target):
        echo(f"{target} is a kernelspec that nvshare-jupyter did not install; choose another --name")
        raise typer.Exit(EXIT_FAILED)
    hidden = shadowed(name.lower(), target)
    if hidden is not None and not shadow:
        echo(f"a kernelspec named {name.lower()} is already in {hidden} (Jupyter's stock Python kernel is python3): "
             f"one of that name in {directory} would hide it from the notebooks that look there first, which "
             "then run under nvshare without saying so. Choose another --name, or pass --shadow to hide it on purpose.")
        raise typer.Exit(EXIT_FAILED)

    kernel_env = parse_env(env)
    if os.environ.get(library.ENV_LIBRARY):
        kernel_env[library.ENV_LIBRARY] = str(lib)  # the copy checked here, not the packaged one
    if socket_dir is not None:
        kernel_env[ENV_SOCKET_DIR] = str(socket_dir.absolute())
    if fail_open:
        kernel_env["NVSHARE_FAIL_MODE"] = "open"
    overrides = {
        "argv": kernel_command(extension),
        "display_name": display_name,
        "env": kernel_env,
        "metadata": {"debugger": True, "nvshare": {"version": __version__, "extension": extension}},
    }
    with tempfile.TemporaryDirectory(prefix="nvshare-kernelspec-") as scratch:
        staged = write_kernel_spec(Path(scratch) / "spec", overrides=overrides)
        manager = KernelSpecManager()
        try:
            if prefix is None:
                installed = manager.install_kernel_spec(staged, name, user=True)
            else:
                installed = manager.install_kernel_spec(staged, name, prefix=str(prefix))
        except ValueError as error:  # an invalid name
            echo(str(error))
            raise typer.Exit(EXIT_USAGE) from None
        except OSError as error:
            echo(f"cannot write {target}: {error.strerror or error}")
            raise typer.Exit(EXIT_FAILED) from None

    typer.echo(f"Installed kernelspec {name.lower()} ({display_name}) in {installed}")
    if hidden is not None:
        typer.echo(f"  it hides the kernelspec {name.lower()} in {hidden} (--shadow)")
    typer.echo(f"  its kernels preload {lib}")
    if directory not in {Path(found).absolute() for found in KernelSpecManager().kernel_dirs}:
        typer.echo(f"  Jupyter does not look in {directory}: start it with JUPYTER_PATH={directory.parent}")
    paths = SocketPaths.resolve(kernel_env.get(ENV_SOCKET_DIR))  # --socket-dir is recorded there
    reason = scheduler_unreachable(paths)
    if reason is None:
        typer.echo(f"  the scheduler in {paths.describe()} answers")
    else:
        typer.echo(f"  no scheduler answers at {paths.client_socket} yet ({reason}): start nvshare-scheduler"
                   + ("" if socket_dir else ", or reinstall with --socket-dir if it serves another directory"))


@app.command()
def uninstall(
    user: bool = WHERE_USER,
    sys_prefix: bool = WHERE_SYS_PREFIX,
    prefix: Optional[Path] = WHERE_PREFIX,
    name: str = NAME,
) -> None:
    """Remove a kernelspec that `install` wrote."""
    require_jupyter()
    target = kernels_dir(chosen_prefix(user, sys_prefix, prefix)) / name.lower()
    if not target.is_dir():
        echo(f"there is no kernelspec {name.lower()} in {target.parent}")
        raise typer.Exit(EXIT_FAILED)
    if not is_ours(target):
        echo(f"{target} was not installed by nvshare-jupyter; left alone")
        raise typer.Exit(EXIT_FAILED)
    shutil.rmtree(target)
    typer.echo(f"Removed kernelspec {name.lower()} from {target.parent}")


@app.command(context_settings={**APP_SETTINGS["context_settings"], "allow_interspersed_args": False})
def launch(
    command: List[str] = typer.Argument(..., metavar="COMMAND [ARGS]...", show_default=False),
) -> None:
    """Run COMMAND (a kernel) under nvshare; start it even when something is missing."""
    paths = SocketPaths.resolve()
    env = dict(os.environ)
    env[ENV_SOCKET_DIR] = str(paths.root)
    # Jupyter tells a kernel which notebook it serves; status and notes then name the notebook
    # ("held by c3 (analysis.ipynb)") instead of "python".
    notebook = os.path.basename(env.get("JPY_SESSION_NAME", ""))
    if notebook:
        env.setdefault("NVSHARE_PROGRAM", notebook)
    try:
        lib = library.path()
    except library.LibraryNotFound as error:
        echo(f"{error}. Starting the kernel WITHOUT nvshare: its GPU work is not scheduled.")
    else:
        env["LD_PRELOAD"] = with_preload(env.get("LD_PRELOAD"), lib)
        reason = scheduler_unreachable(paths)
        if reason is not None:
            waits = env.get("NVSHARE_FAIL_MODE") != "open"
            echo(f"no nvshare scheduler at {paths.client_socket} ({reason}); the kernel's GPU "
                 + ("calls wait until one is started." if waits else "work runs unscheduled until one is started."))
    status, why = exec_command(command, env)
    echo(f"cannot run {why}")
    raise typer.Exit(status)


def main() -> None:
    app(prog_name="nvshare-jupyter")


if __name__ == "__main__":
    main()
