"""libnvshare.so must load into any process of any container: nothing but libc, only the hook
symbols exported, glibc symbol versions no newer than 2.17, and a dlsym override that keeps
RTLD_NEXT working for other interposers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.interceptor import INTERCEPTOR_DIR, REPO_ROOT

GLIBC_FLOOR = (2, 17)
ALLOWED_NEEDED = {"libc.so.6", "libdl.so.2", "libpthread.so.0"}


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def hook_names() -> set[str]:
    text = (INTERCEPTOR_DIR / "hooks.h").read_text()
    return set(re.findall(r"X\((?:GATED|CONTEXT|CUSTOM),\s*(\w+),", text))


def exported(lib: Path) -> dict[str, set[str]]:
    """Defined global symbols -> their versions."""
    symbols: dict[str, set[str]] = {}
    for line in readelf("--dyn-syms", str(lib)).splitlines():
        fields = line.split()
        if len(fields) < 8 or fields[6] in ("UND", "ABS") or fields[4] not in ("GLOBAL", "WEAK"):
            continue
        name, _, version = fields[7].replace("@@", "@").partition("@")
        symbols.setdefault(name, set()).add(version)
    return symbols


def test_needs_only_libc(libnvshare):
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", str(libnvshare))))
    assert "libc.so.6" in needed
    assert needed <= ALLOWED_NEEDED, f"unexpected dependencies: {needed - ALLOWED_NEEDED}"


def test_exports_exactly_the_hooks_and_dlsym(libnvshare):
    symbols = exported(libnvshare)
    hooks = hook_names()
    assert len(hooks) > 100  # the list parsed
    assert set(symbols) == hooks | {"dlsym"}
    # PyTorch/JAX/ctypes import dlsym@GLIBC_2.2.5, newer binaries dlsym@GLIBC_2.34
    assert symbols["dlsym"] == {"GLIBC_2.2.5", "GLIBC_2.34"}


def test_glibc_versions_needed_are_old(libnvshare):
    section = readelf("-V", str(libnvshare)).split("Version needs section", 1)[1]
    versions = {tuple(int(p) for p in v.split(".")) for v in re.findall(r"Name: GLIBC_([0-9.]+)", section)}
    assert versions, "no glibc version references found (readelf output changed?)"
    newest = max(versions)
    assert newest <= GLIBC_FLOOR, (
        f"libnvshare.so needs GLIBC_{'.'.join(map(str, newest))}: pin the symbol in interceptor/glibc_compat.h"
    )


@pytest.mark.parametrize("argv", [["/bin/true"], [sys.executable, "-c", "import ctypes; ctypes.CDLL(None)"]])
def test_loads_into_any_process(libnvshare, argv):
    env = dict(os.environ, LD_PRELOAD=str(libnvshare))
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stderr == ""  # no CUDA use: not a word, no thread, no connection


@pytest.mark.parametrize("setting, expected", [
    ({}, "cuda_async"),  # XLA's default allocator maps cuMemCreate memory, which cannot be managed
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}, "bfc"),  # the user's choice wins
    ({"NVSHARE_MANAGED": "0"}, None),  # no conversion wanted: nothing to adapt
])
def test_jax_is_steered_to_an_allocator_nvshare_converts(libnvshare, setting, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_PYTHON_CLIENT_ALLOCATOR", "NVSHARE_MANAGED")}
    env.update(setting, LD_PRELOAD=str(libnvshare))
    code = "import json, os; print(json.dumps(os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR')))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == expected


NEXT_PROBE_LIBRARY = """
#define _GNU_SOURCE
#include <dlfcn.h>
int nvs_probe_value(void) { return %(value)d; }
"""

NEXT_CALLER_LIBRARY = """
#define _GNU_SOURCE
#include <dlfcn.h>
%(symver)s
int nvs_probe_value(void) { return 2; }
int nvs_next_value(void) {
    int (*next)(void) = (int (*)(void))dlsym(RTLD_NEXT, "nvs_probe_value");
    return next ? next() : -1;
}
"""

OLD_DLSYM = '__asm__(".symver dlsym, dlsym@GLIBC_2.2.5");'


@pytest.mark.parametrize("cflags", ["default", "-O0 -g"])
@pytest.mark.parametrize("dlsym_version", ["GLIBC_2.2.5", "GLIBC_2.34"])
def test_rtld_next_still_finds_the_next_definition(libnvshare, libnvshare_variant, compile_c, dlsym_version, cflags):
    """Another interposer's dlsym(RTLD_NEXT, ...) goes through nvshare's dlsym, which must pass
    the caller's identity (its return address) on to glibc: otherwise glibc searches after
    libnvshare and the interposer finds itself. Whatever the optimiser does: an unoptimised build
    makes no tail calls."""
    if cflags != "default":
        libnvshare = libnvshare_variant(cflags)
    symver = OLD_DLSYM if dlsym_version == "GLIBC_2.2.5" else ""
    caller = compile_c(NEXT_CALLER_LIBRARY % {"symver": symver}, f"libnextcaller_{dlsym_version}.so", shared=True)
    imports = readelf("--dyn-syms", str(caller))
    assert f"dlsym@{dlsym_version}" in imports
    probe = compile_c(NEXT_PROBE_LIBRARY % {"value": 1}, "libnextprobe.so", shared=True)
    script = "import ctypes; print(ctypes.CDLL(None).nvs_next_value())"
    env = dict(os.environ, LD_PRELOAD=f"{libnvshare}:{caller}:{probe}")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


PUBLICATION_HARNESS = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
typedef int CUresult;
static CUresult (*mem_get_info)(size_t *, size_t *);
static CUresult (*device_get_attribute)(int *, int, int);
static CUresult (*memset_d8)(unsigned long long, unsigned char, size_t);
static atomic_int loaded;
/* Started before the driver is loaded and told that it is with a relaxed store: nothing orders
 * the loading thread's writes before these threads' reads except what libnvshare does itself. */
static void *late(void *which) {
    while (!atomic_load_explicit(&loaded, memory_order_relaxed))
        ;
    int value;
    return (void *)(long)(which ? device_get_attribute(&value, 1, 0) : memset_d8(0, 0, 0));
}
int main(int argc, char **argv) {
    /* RTLD_LOCAL: the sanitizer's own dlsym calls stay with glibc. */
    void *nvshare = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!nvshare) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    mem_get_info = dlsym(nvshare, "cuMemGetInfo_v2");
    device_get_attribute = dlsym(nvshare, "cuDeviceGetAttribute");
    memset_d8 = dlsym(nvshare, "cuMemsetD8_v2");
    pthread_t threads[8];
    for (long i = 0; i < 8; i++) pthread_create(&threads[i], NULL, late, (void *)(i % 2));
    CUresult first = mem_get_info(NULL, NULL); /* loads the driver */
    atomic_store_explicit(&loaded, 1, memory_order_relaxed);
    for (int i = 0; i < 8; i++) pthread_join(threads[i], NULL);
    printf("loaded %d\n", first);
    return 0;
}
"""


def test_driver_functions_are_published_to_other_threads_without_a_data_race(libnvshare_variant, compile_c, simcuda):
    """The thread that loads the driver writes nvs_real; every wrapper's first line reads it
    without a lock. ThreadSanitizer watches threads that learn of the load only through a relaxed
    flag (no ordering of their own) call wrappers: the read must be an acquire paired with the
    loader's release, or it is a data race (visible as stale pointers on aarch64/GH200)."""
    try:
        harness = compile_c(PUBLICATION_HARNESS, "publication_harness", flags=["-fsanitize=thread", "-g"])
    except subprocess.CalledProcessError as error:
        pytest.skip(f"this compiler cannot build with -fsanitize=thread: {error.stderr.strip()[:200]}")
    library = libnvshare_variant("-O1 -g -fsanitize=thread", "-fsanitize=thread")
    env = simcuda.env(TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    result = subprocess.run([str(harness), str(library)], env=env, capture_output=True, text=True, timeout=120)
    assert "ThreadSanitizer" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("loaded "), result.stdout


def test_installed_package_ships_a_loadable_library():
    """What `pip install .` put into the package: nvshare_py.library.path() exists and loads."""
    import ctypes

    import nvshare_py
    from nvshare_py import library

    if Path(nvshare_py.__file__).resolve().is_relative_to(REPO_ROOT) and not library.PACKAGED.exists():
        pytest.skip("nvshare_py is imported from the source tree, which has no built _lib (pip install . builds it)")
    env_override = os.environ.pop(library.ENV_LIBRARY, None)
    try:
        path = library.path()
    finally:
        if env_override is not None:
            os.environ[library.ENV_LIBRARY] = env_override
    assert path == library.PACKAGED and path.is_file()
    ctypes.CDLL(str(path))


def test_library_override_and_clear_error(monkeypatch, tmp_path, libnvshare):
    from nvshare_py import library

    monkeypatch.setenv(library.ENV_LIBRARY, str(libnvshare))
    assert library.path() == libnvshare
    monkeypatch.setenv(library.ENV_LIBRARY, str(tmp_path / "missing.so"))
    with pytest.raises(library.LibraryNotFound, match="does not name a file"):
        library.path()
    monkeypatch.delenv(library.ENV_LIBRARY)
    monkeypatch.setattr(library, "PACKAGED", tmp_path / "_lib" / "libnvshare.so")
    with pytest.raises(library.LibraryNotFound, match="pip"):
        library.path()
