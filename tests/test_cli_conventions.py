"""What every nvshare command line does alike: -h and --version, flags that read as flags, and
one line that says what is wrong and what to do instead of a traceback."""

from __future__ import annotations

import ctypes
import os
import pty
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvshare_py import __version__
from nvshare_py.run import SIMULATED_DRIVER_DIR
from nvshare_py.testing.scheduler import CHILD_CWD, child_env, nvsharectl_module, run_child

TOOLS = {  # the tool's name -> the module that runs it
    "nvshare-scheduler": "nvshare_py.scheduler",
    "nvsharectl": nvsharectl_module(),  # installed as nvshare_py.ctl; ./ctl in a checkout
    "nvshare-run": "nvshare_py.run",
    "nvshare-jupyter": "nvshare_py.jupyter",
    "nvshare-demo": "nvshare_py.demo",
    "nvshare-device-plugin": "nvshare_py.deviceplugin",
    "nvshare-dra-driver": "nvshare_py.dra",
}


def tool(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_child([sys.executable, "-m", module, *args], env or child_env())


def one_line_without_traceback(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_has_short_help_and_version(name):
    help_text = tool(TOOLS[name], "-h")
    assert help_text.returncode == 0, help_text.stderr
    assert f"Usage: {name}" in help_text.stdout
    # A flag shown as "--fail-open <bool>" reads as an option that takes a value.
    assert "<bool>" not in help_text.stdout
    version = tool(TOOLS[name], "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"{name} (nvshare_py) {__version__}"


@pytest.mark.parametrize("module, option, allowed", [
    ("nvshare_py.scheduler", "--tq", "from 0.1 to 86400"),
    ("nvshare_py.scheduler", "--heartbeat-interval", "from 0.01 to 3600"),
    ("nvshare_py.demo", "--duration", "from 1 to 3600"),
    (nvsharectl_module(), "--timeout", "from 0.001 to"),
])
def test_numbers_are_refused_in_our_words_with_the_range(module, option, allowed):
    for value, why in (("soon", "'soon' is not a number"), ("1e12", "1e12 is out of range")):
        result = tool(module, option, value, *(["status"] if module == nvsharectl_module() else []))
        assert result.returncode == 2, result.stderr
        assert why in result.stderr and allowed in result.stderr, result.stderr
        assert "Input should be" not in result.stderr and "Traceback" not in result.stderr


def test_subcommands_take_short_help_too():
    result = tool(nvsharectl_module(), "status", "-h")
    assert result.returncode == 0 and "--wide" in result.stdout


def test_idle_release_0_means_off_everywhere(scheduler_factory):
    # The interceptor's NVSHARE_IDLE_RELEASE_MS=0 turns early release off; so does the scheduler's 0.
    scheduler = scheduler_factory(idle_release=0)
    assert scheduler.status()["scheduler"]["defaults"]["idle_release"] == 0


def test_heartbeat_timeout_is_checked_by_the_shared_configuration():
    from nvshare_py.scheduler.daemon import DaemonConfig

    with pytest.raises(ValueError, match="heartbeat_timeout must be longer than heartbeat_interval"):
        DaemonConfig(heartbeat_interval=2.0, heartbeat_timeout=1.0)


def blocked(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment in which importing `modules` fails as it does where they are not installed."""
    for module in modules:
        package = tmp_path / "blocked" / module
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {module!r}'!r}, name={module!r})\n")
    env = child_env()
    env["PYTHONPATH"] = f"{tmp_path / 'blocked'}:{env['PYTHONPATH']}"
    return env


def test_jupyter_install_without_the_jupyter_extra(tmp_path):
    result = tool("nvshare_py.jupyter", "install", "--prefix", str(tmp_path / "prefix"),
                  env=blocked(tmp_path, "jupyter_core"))
    assert result.returncode == 1
    line = one_line_without_traceback(result)
    assert "jupyter_core is not installed" in line and "pip install '.[jupyter]'" in line
    assert not (tmp_path / "prefix").exists()


def test_device_plugin_without_the_k8s_extra(tmp_path):
    env = blocked(tmp_path, "grpc")
    assert tool("nvshare_py.deviceplugin", "--help", env=env).returncode == 0
    assert tool("nvshare_py.deviceplugin", "serve", "--help", env=env).returncode == 0
    for command in (["serve"], ["install-library", "--to", str(tmp_path)]):
        result = tool("nvshare_py.deviceplugin", *command, env=env)
        assert result.returncode == 1, command
        line = one_line_without_traceback(result)
        assert "grpc is not installed" in line and "pip install '.[k8s]'" in line


def test_a_socket_directory_that_is_a_file(tmp_path, libnvshare):
    a_file = tmp_path / "nvshare"
    a_file.write_text("")
    env = child_env(extra={"NVSHARE_LIBRARY": str(libnvshare)})
    for module, args, status in (("nvshare_py.scheduler", ["--socket-dir", str(a_file)], 1),
                                 (nvsharectl_module(), ["--socket-dir", str(a_file), "status"], 2),
                                 ("nvshare_py.run", ["--socket-dir", str(a_file), "--fail-open", "true"], 2)):
        result = tool(module, *args, env=env)
        assert result.returncode == status, (module, result.stderr)
        line = one_line_without_traceback(result)
        assert f"{a_file} is a file, not a directory" in line and "--socket-dir" in line, line


def test_nvshare_run_without_a_driver_names_the_simulated_one_on_a_terminal_only(tmp_path, libnvshare):
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has a CUDA driver")
    except OSError:
        pass
    env = child_env(extra={"NVSHARE_LIBRARY": str(libnvshare), "NVSHARE_SOCKET_DIR": str(tmp_path)})
    quiet = tool("nvshare_py.run", "--fail-open", "sh", "-c", "exit 7", env=env)
    assert quiet.returncode == 7  # the command's own status
    assert "CUDA driver" not in quiet.stderr  # scripts run their commands without it

    controller, terminal = pty.openpty()
    try:
        run = subprocess.run([sys.executable, "-m", "nvshare_py.run", "--fail-open", "true"], env=env, cwd=CHILD_CWD,
                             stdout=subprocess.PIPE, stderr=terminal, timeout=60)
        os.close(terminal)
        shown = b""
        while select.select([controller], [], [], 0)[0]:
            try:
                chunk = os.read(controller, 4096)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(controller)
    assert run.returncode == 0
    lines = [line for line in shown.decode().splitlines() if "CUDA driver" in line]
    (warning,) = lines
    assert f"LD_LIBRARY_PATH={SIMULATED_DRIVER_DIR} nvshare-run COMMAND" in warning
    assert len(warning) <= 80 + len(str(SIMULATED_DRIVER_DIR))  # one line, not a paragraph


@pytest.mark.parametrize("module, option, value, words", [
    ("nvshare_py.scheduler", "--mode", "sometimes", "'sometimes' is not a mode: give on, off or auto"),
    ("nvshare_py.scheduler", "--log-level", "loud", "'loud' is not a log level: give debug, info, warning or error"),
    ("nvshare_py.scheduler", "--admission-policy", "lifo", "'lifo' is not an admission policy: give fifo, best-fit"),
    ("nvshare_py.scheduler", "--swapping", "maybe", "'maybe' is not on or off: give on or off"),
    ("nvshare_py.deviceplugin", "--log-level", "loud", "'loud' is not a log level: give debug, info, warning or error"),
])
def test_choices_are_refused_in_our_words(module, option, value, words):
    result = tool(module, *(["serve"] if module == "nvshare_py.deviceplugin" else []), option, value)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Value error" not in result.stderr and "Traceback" not in result.stderr


def test_the_device_plugin_exits_2_on_usage_errors_and_logs_as_the_scheduler_does(tmp_path):
    for argv in (["--ignored-xids", "thirteen"], ["--replicas", "0"], ["--container-env", "NOEQUALS"]):
        result = tool("nvshare_py.deviceplugin", "serve", *argv)
        assert result.returncode == 2, (argv, result.stderr)
        assert "Traceback" not in result.stderr
    missing = tool("nvshare_py.deviceplugin", "install-library", "--to", str(tmp_path), "--from", str(tmp_path / "no.so"))
    assert missing.returncode == 1  # not a usage error: the file is not there
    (line,) = missing.stderr.splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} ERROR .*no\.so does not exist", line), line


def test_the_systemd_unit_and_tmpfiles_entry_are_shipped_and_valid(tmp_path):
    unit = tool("nvshare_py.scheduler", "--print-systemd-unit")
    assert unit.returncode == 0, unit.stderr
    exec_start = next(line for line in unit.stdout.splitlines() if line.startswith("ExecStart="))
    assert "@SCHEDULER@" not in exec_start and exec_start.endswith(("nvshare-scheduler", "-m nvshare_py.scheduler"))
    assert "Restart=on-failure" in unit.stdout and "WantedBy=multi-user.target" in unit.stdout
    entry = tool("nvshare_py.scheduler", "--print-tmpfiles")
    assert entry.returncode == 0 and "d /run/nvshare 0755 root root -" in entry.stdout
    if shutil.which("systemd-analyze") is None or shutil.which("systemd-tmpfiles") is None:
        pytest.skip("systemd's tools are not installed here")
    (tmp_path / "nvshare-scheduler.service").write_text(unit.stdout)
    verified = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "nvshare-scheduler.service")],
                              capture_output=True, text=True, timeout=60)
    ours = [line for line in verified.stderr.splitlines() if "nvshare-scheduler.service" in line]
    assert verified.returncode == 0 and ours == [], verified.stderr
    (tmp_path / "nvshare.conf").write_text(entry.stdout)
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    made = subprocess.run(["systemd-tmpfiles", "--create", f"--root={root}", str(tmp_path / "nvshare.conf")],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert oct((root / "run" / "nvshare").stat().st_mode & 0o777) == "0o755"


def test_a_malformed_interceptor_setting_is_a_warning(simcuda, libnvshare, tmp_path):
    env = simcuda.env(NVSHARE_MANAGED="maybe", NVSHARE_SOCKET_DIR=str(tmp_path), NVSHARE_FAIL_MODE="open",
                      LD_PRELOAD=str(libnvshare))
    run = subprocess.run([str(simcuda.simapp), "alloc:plain:1M"], env=env, cwd=CHILD_CWD, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (line,) = [line for line in run.stderr.splitlines() if "NVSHARE_MANAGED" in line]
    assert ": warning: NVSHARE_MANAGED=maybe is not 1 or 0" in line
