"""libnvshare.so must load into any process of any container: nothing but libc, only the hook
symbols exported, glibc symbol versions no newer than 2.17, and a dlsym override that keeps
RTLD_NEXT working for other interposers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.interceptor import INTERCEPTOR_DIR, REPO_ROOT

GLIBC_FLOOR = (2, 17)
ALLOWED_NEEDED = {"libc.so.6", "libdl.so.2", "libpthread.so.0"}
# The files of the client core (one module, whose interface is client_core.h), each calling only
# those after it (client_core_internal.h).
CLIENT_CORE_FILES = ["client_core.c", "client_core_output.c", "client_core_registration.c", "client_core_observe.c",
                     "client_core_swap.c", "client_core_handoff.c", "client_core_admission.c", "client_core_fence.c",
                     "client_core_actions.c"]


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def hook_names() -> set[str]:
    text = (INTERCEPTOR_DIR / "hook_table.h").read_text()
    return set(re.findall(r"X\((?:GATED|LAUNCH|CONTEXT|CUSTOM),\s*(\w+),", text))


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


# --- the locking rule: no CUDA call and no I/O while nvs_mu is held ----------------------------

# Files whose code is checked.
LOCK_CHECKED_FILES = ["gate.c", "context.c", "memory.c", "admission.c", "hooks.c", "loader.c", "log.c", "config.c", "notify.c",
                      "client.c", "worker.c", *CLIENT_CORE_FILES, "swap.c", "vmm.c", "area.c", "pool.c"]
# Direct CUDA calls and I/O; a function that makes one (transitively, among the interceptor's
# functions) counts as one.
FORBIDDEN_UNDER_NVS_MU = re.compile(
    r"\bnvs_real\.\w+\s*\(|\b(?:nvs_log|nvs_debug|nvs_info|nvs_warn|nvs_error|write|read|"
    r"fprintf|printf|send|recv|poll|nanosleep|usleep|dlopen|dlsym)\s*\(")
CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")
FUNCTION = re.compile(r"\b([A-Za-z_]\w*)\s*\([^;{}]*\)\s*\{")


def strip_c(text: str) -> str:
    """The code without comments, string and character literals, or preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])*'", "''", text)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", text, flags=re.M)


def function_bodies(text: str) -> dict[str, str]:
    """Top-level function definitions -> their bodies (including the outer braces)."""
    bodies: dict[str, str] = {}
    position = 0
    while (match := FUNCTION.search(text, position)) is not None:
        if text[:match.start()].count("{") != text[:match.start()].count("}"):
            position = match.end()  # not at top level (a call inside an initialiser)
            continue
        depth, i = 0, match.end() - 1
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        bodies[match.group(1)] = text[match.end() - 1:i]
        position = i
    return bodies


def violations_under_lock(name: str, body: str, blocking: set[str], lock: str = "nvs_mu") -> list[str]:
    """Statements of `body` that make a CUDA call or I/O while `lock` is held. A `_locked`
    function is called with nvs_mu held. A block that ends in `return` does not change the state
    after it (`if (...) { unlock; return; }`)."""
    held = lock == "nvs_mu" and name.endswith("_locked")
    found, saved = [], []
    for token in re.finditer(r"[{};]|[^{};]+", body):
        piece = token.group()
        if piece == "{":
            saved.append((held, False))
        elif piece == "}":
            before, returned = saved.pop()
            if returned:
                held = before
        elif piece == ";" or not piece.strip():
            continue
        else:
            if held:
                calls = {c for c in CALL.findall(piece) if c in blocking}
                if FORBIDDEN_UNDER_NVS_MU.search(piece) or calls:
                    found.append(f"{name}: {' '.join(piece.split())}")
            if re.search(rf"pthread_mutex_lock\s*\(\s*&{lock}\s*\)", piece):
                held = True
            if re.search(rf"pthread_mutex_unlock\s*\(\s*&{lock}\s*\)", piece):
                held = False
            if re.match(r"\s*return\b", piece) and saved:
                saved[-1] = (saved[-1][0], True)
    return found


def blocking_functions(bodies: dict[str, tuple[str, str]]) -> set[str]:
    """The interceptor's functions that make a CUDA call or I/O, directly or through another."""
    blocking = {name for name, (_, body) in bodies.items() if FORBIDDEN_UNDER_NVS_MU.search(body)}
    while True:
        more = {name for name, (_, body) in bodies.items()
                if name not in blocking and any(c in blocking for c in CALL.findall(body))}
        if not more:
            return blocking
        blocking |= more


def interceptor_functions() -> dict[str, tuple[str, str]]:
    """Every function of interceptor/*.c -> (its file, its body)."""
    bodies: dict[str, tuple[str, str]] = {}
    for path in sorted(INTERCEPTOR_DIR.glob("*.c")):
        for name, body in function_bodies(strip_c(path.read_text())).items():
            bodies[name] = (path.name, body)
    return bodies


@pytest.mark.parametrize("lock, files", [("nvs_mu", LOCK_CHECKED_FILES), ("mem_mu", ["memory.c"]), ("vmm_mu", ["vmm.c"])])
def test_no_cuda_call_or_io_while_a_lock_is_held(lock, files):
    """gate.h: nvs_mu is never held across a CUDA call or I/O. A stderr pipe nobody reads, or a
    driver call that blocks, would otherwise stall every thread that needs the lock state (the
    client thread, every waiter at a closed gate). mem_mu, taken by every allocation and free, and
    vmm_mu, taken by every VMM call and the swap engine, are leaf locks under the same rule."""
    bodies = interceptor_functions()
    blocking = blocking_functions(bodies)
    assert {"nvs_device_get", "nvs_memory_poll_frees"} <= blocking  # the analysis sees through calls
    checked = [name for name, (file, _) in bodies.items() if file in files]
    assert len(checked) > 20, checked
    problems = [v for name in checked for v in violations_under_lock(name, bodies[name][1], blocking, lock)]
    assert problems == []


@pytest.mark.parametrize("body, expected", [
    ("{ pthread_mutex_lock(&nvs_mu); nvs_debug(\"x\"); pthread_mutex_unlock(&nvs_mu); }", 1),
    ("{ pthread_mutex_lock(&nvs_mu); helper(); pthread_mutex_unlock(&nvs_mu); }", 1),
    ("{ pthread_mutex_lock(&nvs_mu); x = 1; pthread_mutex_unlock(&nvs_mu); nvs_real.cuInit(0); }", 0),
    ("{ pthread_mutex_lock(&nvs_mu); if (a) { pthread_mutex_unlock(&nvs_mu); return; } nvs_warn(\"y\"); }", 1),
    ("{ pthread_mutex_lock(&nvs_mu); if (a) { pthread_mutex_unlock(&nvs_mu); wake(); pthread_mutex_lock(&nvs_mu); } "
     "pthread_mutex_unlock(&nvs_mu); nvs_warn(\"z\"); }", 0),
])
def test_the_lock_check_finds_what_it_should(body, expected):
    assert len(violations_under_lock("f", body, {"helper"})) == expected
    assert len(violations_under_lock("f_locked", "{ nvs_error(\"e\"); }", set())) == 1
    assert violations_under_lock("g", body.replace("nvs_mu", "mem_mu"), {"helper"}, "mem_mu") == \
        violations_under_lock("g", body, {"helper"})


# --- hook prototypes against the CUDA toolkit's cuda.h ------------------------------------------

CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
# Hooks of entry points newer than CUDA 13.0 (13.2's copies with attributes, 13.1's multicast
# bindings per device): a 13.0 toolkit does not declare them, so they cannot be checked against it.
NEWER_THAN_CUDA_13_0 = {"cuMemcpyWithAttributesAsync", "cuMemcpy3DWithAttributesAsync", "cuMulticastBindMem_v2",
                        "cuMulticastBindAddr_v2"}


def make_signatures(interceptor_dir: Path, build: Path, cuda_home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(interceptor_dir), f"BUILD={build}", f"CUDA_HOME={cuda_home}",
                           "signatures"], capture_output=True, text=True, timeout=300)


def test_hook_prototypes_match_the_cuda_toolkit(tmp_path):
    if not (CUDA_HOME / "include" / "cuda.h").exists():
        pytest.skip(f"no CUDA toolkit headers at {CUDA_HOME}/include/cuda.h (set CUDA_HOME)")
    result = make_signatures(INTERCEPTOR_DIR, tmp_path, CUDA_HOME)
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "signatures.checked").read_text()
    assert report.startswith("checked against"), report
    unchecked = set(report.split(":", 1)[1].split()) - {"none"}
    assert unchecked <= NEWER_THAN_CUDA_13_0, f"hooks the toolkit does not declare: {unchecked}"


def test_the_prototype_check_fails_on_a_wrong_parameter_type(tmp_path):
    """The check is real: one parameter of one hook declared with the wrong width fails the build,
    naming the hook."""
    if not (CUDA_HOME / "include" / "cuda.h").exists():
        pytest.skip(f"no CUDA toolkit headers at {CUDA_HOME}/include/cuda.h (set CUDA_HOME)")
    copy = tmp_path / "interceptor"
    shutil.copytree(INTERCEPTOR_DIR, copy)
    hooks = copy / "hook_table.h"
    text = hooks.read_text()
    wrong = text.replace("X(GATED, cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n)",
                         "X(GATED, cuMemsetD8_v2, (CUdeviceptr d, unsigned int v, size_t n)")
    assert wrong != text
    hooks.write_text(wrong)
    result = make_signatures(copy, tmp_path / "build", CUDA_HOME)
    assert result.returncode != 0
    assert "cuMemsetD8_v2" in result.stderr, result.stderr


def test_without_toolkit_headers_the_prototype_check_says_it_was_skipped(tmp_path):
    result = make_signatures(INTERCEPTOR_DIR, tmp_path / "build", tmp_path / "no-cuda")
    assert result.returncode == 0, result.stderr
    assert "signatures: not checked, no CUDA toolkit headers" in result.stdout


# --- layering: which object uses which, from the symbols they define and need -----------------

# The narrow upward interface: gate.c and memory.c tell the client shell that a waiter appeared,
# memory changed or frees are pending, and start it; the loader registers the client's fork
# handlers at first use. Every other dependency points down (docs/architecture.md).
NOTIFY_SYMBOLS = {"nvs_client_wake", "nvs_client_memory_changed", "nvs_worker_kick", "nvs_runtime_start",
                  "nvs_fork_prepare", "nvs_fork_parent", "nvs_fork_child"}


def object_dependencies(build: Path) -> dict[tuple[str, str], set[str]]:
    """(user, provider) -> the symbols `user`.o takes from `provider`.o, read with nm."""
    defined: dict[str, str] = {}
    needed: dict[str, set[str]] = {}
    for obj in sorted(build.glob("*.o")):
        unit = obj.stem + ".c"
        lines = subprocess.run(["nm", str(obj)], check=True, capture_output=True, text=True).stdout.splitlines()
        needed[unit] = {fields[1] for fields in map(str.split, lines) if len(fields) == 2 and fields[0] == "U"}
        for fields in map(str.split, lines):
            if len(fields) == 3 and fields[1] in "TDBRGS":
                defined[fields[2]] = unit
    edges: dict[tuple[str, str], set[str]] = {}
    for unit, symbols in needed.items():
        for symbol in symbols:
            provider = defined.get(symbol)
            if provider is not None and provider != unit:
                edges.setdefault((unit, provider), set()).add(symbol)
    return edges


def test_objects_depend_on_each_other_without_cycles_beyond_the_notify_interface(libnvshare):
    import graphlib

    edges = object_dependencies(libnvshare.parent)
    assert ("hooks.c", "loader.c") in edges  # nm read the objects
    graph: dict[str, set[str]] = {}
    for (user, provider), symbols in edges.items():
        graph.setdefault(provider, set())
        if not symbols <= NOTIFY_SYMBOLS:
            graph.setdefault(user, set()).add(provider)
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    # The driver loader is at the bottom with configuration and logging; the hook table on top.
    assert {provider for (user, provider) in edges if user == "loader.c"} - {"config.c", "log.c"} <= {"notify.c"}
    assert not any(provider == "hooks.c" for (_, provider) in edges)
    assert order.index("loader.c") < order.index("gate.c") < order.index("hooks.c")
    # gate.c and memory.c do not know each other's internals in both directions.
    assert ("gate.c", "memory.c") not in edges
    # The client's lock logic is pure: its files need only each other and the protocol codec (and
    # libc), and call one way, down CLIENT_CORE_FILES. The rest of the library calls only its
    # interface, client_core.h.
    core = set(CLIENT_CORE_FILES)
    assert {provider for (user, provider) in edges if user in core} - core == {"message.c"}
    assert [(user, provider) for (user, provider) in edges if user in core and provider in core
            and CLIENT_CORE_FILES.index(provider) < CLIENT_CORE_FILES.index(user)] == []
    assert ("client_core.c", "client_core_actions.c") in edges  # the core's files were read
    assert all(symbol.startswith("nvs_core_") for (user, provider), symbols in edges.items()
               if provider in core and user not in core for symbol in symbols)
    # Nothing below the client shell calls into it or the worker except through notify.c.
    lower = {"loader.c", "hooks.c", "gate.c", "memory.c", "context.c"}
    assert not any(user in lower and provider in {"client.c", "worker.c"} for (user, provider) in edges)


AARCH64_MAIN = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    int (*next_value)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "nvs_next_value");
    printf("%d\n", next_value ? next_value() : -1);
    return 0;
}
"""


def test_rtld_next_still_finds_the_next_definition_on_aarch64(tmp_path):
    """The dlsym entry's aarch64 assembly, built unoptimised and run under qemu-user: the
    interposer's RTLD_NEXT lookup finds the next definition, not its own."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    sysroot = Path("/usr/aarch64-linux-gnu")
    if cross is None or qemu is None or not sysroot.is_dir():
        pytest.skip("needs aarch64-linux-gnu-gcc, qemu-aarch64 and /usr/aarch64-linux-gnu "
                    "(Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)")
    build = subprocess.run(["make", "-s", "-C", str(INTERCEPTOR_DIR), f"BUILD={tmp_path / 'nvs'}", f"CC={cross}",
                            "CFLAGS=-O0 -g", f"CUDA_HOME={tmp_path / 'no-cuda'}"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    sources = {"libnextprobe.so": NEXT_PROBE_LIBRARY % {"value": 1},
               "libnextcaller.so": NEXT_CALLER_LIBRARY % {"symver": ""}, "main": AARCH64_MAIN}
    for name, source in sources.items():
        (tmp_path / f"{name}.c").write_text(source)
        shared = ["-shared", "-fPIC"] if name.endswith(".so") else []
        subprocess.run([cross, *shared, "-O0", "-o", str(tmp_path / name), str(tmp_path / f"{name}.c"), "-ldl"],
                       check=True, capture_output=True, text=True)
    preload = ":".join(str(p) for p in (tmp_path / "nvs" / "libnvshare.so", tmp_path / "libnextcaller.so",
                                        tmp_path / "libnextprobe.so"))
    result = subprocess.run([qemu, "-L", str(sysroot), "-E", f"LD_PRELOAD={preload}", str(tmp_path / "main")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


# --- layering: which module includes which module's header ---------------------------------------

INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([\w.]+)\.h"', re.M)


CLIENT_CORE_MODULES = {Path(name).stem for name in CLIENT_CORE_FILES} | {"client_core_internal"}


def module(name: str) -> str:
    """The module of a file's stem: the client core's files and their private header are one,
    `client_core`."""
    return "client_core" if name in CLIENT_CORE_MODULES else name


def include_graph() -> dict[str, set[str]]:
    """Module -> the modules whose header it includes. A module is a name: its .c and its .h
    (gate.c and gate.h are `gate`); a header without a .c (hook_table.h, cuda_types.h) is a
    module of its own; the client core's files are one (`module`)."""
    graph: dict[str, set[str]] = {}
    for path in sorted([*INTERCEPTOR_DIR.glob("*.c"), *INTERCEPTOR_DIR.glob("*.h")]):
        if path.name == "signatures.c":  # not part of the library (make signatures)
            continue
        included = {module(name) for name in INCLUDE.findall(path.read_text())} - {module(path.stem)}
        graph.setdefault(module(path.stem), set()).update(included)
    return graph


def test_modules_include_each_other_one_way():
    """Every header declares one module's interface, and the includes between modules point one
    way: a change to a module's header rebuilds only the modules above it, and each module can be
    read knowing only those below it. With one header for everything (the old nvshare.h) every
    unit saw every other one, and gate -> hooks -> nvml -> gate was a circle."""
    import graphlib

    graph = include_graph()
    assert {"gate", "memory", "hooks", "loader", "hook_table"} <= set(graph)  # the files were read
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    # The hook table is data: the driver's types and nothing else of nvshare.
    assert graph["hook_table"] == {"cuda_types"}
    # The loader knows the hook table, not the wrappers; the hooks sit above the gate and NVML.
    assert order.index("hook_table") < order.index("loader") < order.index("gate") < order.index("hooks")
    assert order.index("nvml") < order.index("hooks")
    # The client core is pure: the protocol codec only. Its private header is its own files'
    # alone, and they are all listed.
    assert graph["client_core"] == {"message"}
    includers = {path.name for path in [*INTERCEPTOR_DIR.glob("*.c"), *INTERCEPTOR_DIR.glob("*.h")]
                 if "client_core_internal" in INCLUDE.findall(path.read_text())}
    assert includers == set(CLIENT_CORE_FILES) == {path.name for path in INTERCEPTOR_DIR.glob("client_core*.c")}
    # Nothing includes the shells' files; the lower units reach them through notify.h.
    assert not any({"client", "hooks", "context"} & included for included in graph.values())


def test_includes_and_links_point_the_same_way(libnvshare):
    """A module includes the headers of what it uses: together with the link graph (which object
    uses which object's symbols) the dependencies still have no circle, so a header is never
    included against the direction of the calls."""
    import graphlib

    graph = {module: set(included) for module, included in include_graph().items()}
    for (user, provider), symbols in object_dependencies(libnvshare.parent).items():
        if not symbols <= NOTIFY_SYMBOLS and module(user.removesuffix(".c")) != module(provider.removesuffix(".c")):
            graph.setdefault(module(user.removesuffix(".c")), set()).add(module(provider.removesuffix(".c")))
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a cycle
