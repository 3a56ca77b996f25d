"""`nvshare-jupyter`: the kernelspec it installs is ipykernel's run through the launcher, lands
where asked, never replaces a kernelspec it did not write, and refuses to install kernels that
could not share the GPU; the launcher keeps LD_PRELOAD and always starts the kernel.
(Kernels started from it are in tests/test_jupyter_kernels.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from nvshare_py.testing.scheduler import child_env, run_child

CLI = [sys.executable, "-m", "nvshare_py.jupyter"]


@pytest.fixture
def cli(libnvshare, tmp_path):
    """Runs nvshare-jupyter with this tree's libnvshare.so and a private Jupyter data dir."""

    def run(*args: str, **env: str):
        extra = {"NVSHARE_LIBRARY": str(libnvshare), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
                 "NVSHARE_SOCKET_DIR": str(tmp_path / "no-scheduler"), **env}
        return run_child([*CLI, *args], child_env(extra=extra))

    return run


def spec_dir(prefix: Path, name: str = "nvshare") -> Path:
    return prefix / "share" / "jupyter" / "kernels" / name


def test_install_into_a_prefix_writes_ipykernels_spec_run_through_the_launcher(cli, tmp_path, libnvshare):
    prefix = tmp_path / "env"
    done = cli("install", "--prefix", str(prefix), "--socket-dir", "/srv/nvshare", "--env", "XLA_PYTHON_CLIENT_PREALLOCATE=false")
    assert done.returncode == 0, done.stderr
    assert f"Installed kernelspec nvshare (Python 3 (nvshare)) in {spec_dir(prefix)}" in done.stdout
    assert f"JUPYTER_PATH={prefix / 'share' / 'jupyter'}" in done.stdout  # Jupyter would not look there
    assert "no scheduler answers at /srv/nvshare/client/scheduler.sock" in done.stdout

    spec = KernelSpecManager(kernel_dirs=[str(spec_dir(prefix).parent)]).get_kernel_spec("nvshare")
    assert spec.display_name == "Python 3 (nvshare)" and spec.language == "python"
    assert spec.argv[:5] == [sys.executable, "-m", "nvshare_py.jupyter", "launch", "--"]
    assert spec.argv[5:] == [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext=nvshare_py"]
    assert spec.env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NVSHARE_LIBRARY": str(libnvshare),
                        "NVSHARE_SOCKET_DIR": "/srv/nvshare"}
    assert spec.metadata["nvshare"]["extension"] is True
    assert (spec_dir(prefix) / "logo-64x64.png").exists()  # ipykernel's resources came along


def test_options_are_recorded_and_the_extension_can_be_left_out(cli, tmp_path):
    prefix = tmp_path / "env"
    done = cli("install", "--prefix", str(prefix), "--name", "gpu-shared", "--display-name", "Shared GPU",
               "--fail-open", "--no-extension")
    assert done.returncode == 0, done.stderr
    spec = json.loads((spec_dir(prefix, "gpu-shared") / "kernel.json").read_text())
    assert spec["display_name"] == "Shared GPU"
    assert spec["env"]["NVSHARE_FAIL_MODE"] == "open"
    assert not any(arg.startswith("--ext") for arg in spec["argv"])


def test_user_install_and_uninstall(cli, tmp_path):
    target = tmp_path / "data" / "kernels" / "nvshare"
    assert cli("install").returncode == 0  # --user is the default
    assert (target / "kernel.json").exists()
    reinstalled = cli("install", "--user", "--display-name", "Again")
    assert reinstalled.returncode == 0, reinstalled.stderr  # its own kernelspec is replaced
    assert json.loads((target / "kernel.json").read_text())["display_name"] == "Again"
    removed = cli("uninstall")
    assert removed.returncode == 0, removed.stderr
    assert not target.exists()
    again = cli("uninstall")
    assert again.returncode == 1 and "there is no kernelspec nvshare" in again.stderr


def test_a_kernelspec_it_did_not_write_is_never_replaced_or_removed(cli, tmp_path):
    prefix = tmp_path / "env"
    foreign = spec_dir(prefix, "python3")
    foreign.mkdir(parents=True)
    (foreign / "kernel.json").write_text(json.dumps({"argv": ["python3"], "display_name": "Python 3", "language": "python"}))
    before = (foreign / "kernel.json").read_text()
    refused = cli("install", "--prefix", str(prefix), "--name", "python3")
    assert refused.returncode == 1 and "did not install" in refused.stderr
    kept = cli("uninstall", "--prefix", str(prefix), "--name", "python3")
    assert kept.returncode == 1 and "left alone" in kept.stderr
    assert (foreign / "kernel.json").read_text() == before


def test_the_stock_python3_kernel_is_not_hidden_silently(cli, tmp_path):
    """Jupyter finds the stock python3 kernelspec (ipykernel's, in this Python environment): one
    of ours under that name in the user's directory, which Jupyter searches first (unless it
    prefers the environment's), would take its place in every notebook."""
    target = tmp_path / "data" / "kernels" / "python3"
    refused = cli("install", "--name", "python3", JUPYTER_PREFER_ENV_PATH="0")
    assert refused.returncode == 1 and "a kernelspec named python3 is already in" in refused.stderr
    assert "--shadow" in refused.stderr and not target.exists()
    on_purpose = cli("install", "--name", "python3", "--shadow", JUPYTER_PREFER_ENV_PATH="0")
    assert on_purpose.returncode == 0, on_purpose.stderr
    assert "it hides the kernelspec python3 in" in on_purpose.stdout and (target / "kernel.json").exists()
    again = cli("install", "--name", "python3", JUPYTER_PREFER_ENV_PATH="0")  # a reinstall hides it as much
    assert again.returncode == 1 and "--shadow" in again.stderr  # it would still hide the stock one


def test_no_kernelspec_without_the_interceptor(cli, tmp_path):
    prefix = tmp_path / "env"
    refused = cli("install", "--prefix", str(prefix), NVSHARE_LIBRARY=str(tmp_path / "missing.so"))
    assert refused.returncode == 1
    assert "does not name a file" in refused.stderr and "nothing was installed" in refused.stderr
    assert not spec_dir(prefix).exists()


@pytest.mark.parametrize("args", [["--user", "--prefix", "/tmp/x"], ["--sys-prefix", "--user"]])
def test_one_place_at_a_time(cli, args):
    refused = cli("install", *args)
    assert refused.returncode == 2 and "choose one of" in refused.stderr


def test_invalid_names_are_usage_errors(cli, tmp_path):
    refused = cli("install", "--prefix", str(tmp_path / "env"), "--name", "no/slash")
    assert refused.returncode == 2 and "Invalid kernel name" in refused.stderr


# --- the launcher --------------------------------------------------------------------------

SHOW = ("import os, json; print(json.dumps({'pid': os.getpid(), 'preload': os.environ.get('LD_PRELOAD', ''), "
        "'dir': os.environ['NVSHARE_SOCKET_DIR'], 'program': os.environ.get('NVSHARE_PROGRAM')}))")


def test_launcher_preloads_the_interceptor_first_keeps_the_rest_and_execs(compile_c, libnvshare, tmp_path):
    other = compile_c("int nvshare_test_other;\n", "libother.so", shared=True)
    socket_dir = tmp_path / "no-scheduler"
    env = child_env(socket_dir, {"NVSHARE_LIBRARY": str(libnvshare), "LD_PRELOAD": f"{other}:{libnvshare}"})
    child = subprocess.Popen([*CLI, "launch", "--", sys.executable, "-c", SHOW], env=env, cwd="/",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    shown = json.loads(out.strip().splitlines()[-1])
    assert shown["pid"] == child.pid  # exec: the kernel keeps the launcher's pid (signals, interrupts)
    assert shown["preload"] == f"{libnvshare}:{other}"
    assert shown["dir"] == str(socket_dir)
    # No scheduler runs there: it says so, and starts the program all the same.
    assert f"no nvshare scheduler at {socket_dir}/client/scheduler.sock" in err
    assert "calls wait until one is started" in err


def test_launcher_starts_the_kernel_without_nvshare_when_the_library_is_gone(tmp_path):
    env = child_env(tmp_path / "no-scheduler", {"NVSHARE_LIBRARY": str(tmp_path / "gone.so"), "LD_PRELOAD": ""})
    run = run_child([*CLI, "launch", "--", sys.executable, "-c", SHOW], env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["preload"] == ""
    assert "WITHOUT nvshare" in run.stderr


def test_launcher_names_the_kernel_after_its_notebook(tmp_path):
    env = child_env(tmp_path / "no-scheduler", {"JPY_SESSION_NAME": "/home/ada/work/analysis.ipynb"})
    run = run_child([*CLI, "launch", "--", sys.executable, "-c", SHOW], env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["program"] == "analysis.ipynb"


def test_launcher_reports_a_command_that_cannot_run(tmp_path):
    run = run_child([*CLI, "launch", "--", "/nonexistent/python"], child_env(tmp_path))
    assert run.returncode == 127 and "cannot run /nonexistent/python" in run.stderr
