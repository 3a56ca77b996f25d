"""The types check: mypy over nvshare_py and ctl with pyproject.toml's [tool.mypy] (strict for
the scheduler and the wire), so CI (.ci/run runs this suite) fails on a type error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_finds_no_type_errors(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")
    # The checkout's sources, whatever nvshare_py this run imports; its cache outside the tree.
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml",
                             "--cache-dir", str(tmp_path / "mypy-cache")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"mypy found type errors:\n{result.stdout}{result.stderr}"
