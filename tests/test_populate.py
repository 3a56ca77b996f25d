"""interceptor/populate.c, the page making ahead of pinning (area.c's chunks, pool.c's
segments), built with a small harness (tests/c/populate_harness.c): every page of a range is
made present, whatever its size against the threads' parts, and a part that fails says why (a
pool segment over a full /dev/shm: EFAULT)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler: populate.c cannot be built here")
    output = tmp_path_factory.mktemp("populate") / "populate_harness"
    command = [compiler, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-O2", "-pthread", "-iquote",
               str(REPO / "interceptor"), str(REPO / "interceptor" / "populate.c"),
               str(REPO / "tests" / "c" / "populate_harness.c"), "-o", str(output)]
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(command)}\n{built.stderr}"
    return output


def populate(harness: Path, *args: str) -> dict[str, str]:
    done = subprocess.run([str(harness), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    words = dict(word.split("=", 1) for word in done.stdout.split())
    if int(words["error"]) == errno.EINVAL:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (before 5.14)")
    return words


@pytest.mark.parametrize("size", [40 * MIB + 4096, 3 * MIB, 4096])
def test_every_page_of_the_range_is_made_present(harness, size):
    words = populate(harness, "anon", str(size))
    assert int(words["error"]) == 0
    assert words["present"] == words["pages"], words


def test_a_range_the_file_cannot_back_fails_with_efault_after_making_what_it_can(harness):
    # 40 MiB mapped over a file of 20 MiB: the pieces past its end cannot be had (a pool segment
    # whose /dev/shm filled up), the ones before it are made.
    words = populate(harness, "short-file", str(40 * MIB), str(20 * MIB))
    assert int(words["error"]) == errno.EFAULT, words
    assert int(words["present"]) >= 20 * MIB // os.sysconf("SC_PAGESIZE"), words
