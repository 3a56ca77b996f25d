"""Admission end to end: the real daemon, programs under the interceptor on the simulated driver.
An allocation past the node's capacity blocks until another program frees memory; one larger
than the whole capacity fails at once; one that waits past the timeout fails with
CUDA_ERROR_OUT_OF_MEMORY, and in every case the program goes on."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading

import pytest

from nvshare_py.testing.scheduler import PATIENCE, wait_for

MiB, GiB = 1 << 20, 1 << 30
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
DEVICE0 = "GPU-5151ad00-0000-4000-8000-000000000000"

# A CUDA program that obeys one command a line on stdin and answers one JSON line each:
#   alloc BYTES -> {"ok": true} | {"error": CODE}    free -> {"freed": true} (oldest first)
# Its first allocation waits for its registration (issue 20), so every allocation is asked for.
PROGRAM = r"""
import json, sys
from nvshare_py.driver import Driver, DriverError
cuda = Driver(via="dlsym")
cuda.context(0)
cuda.launch_sleep(1)
cuda.synchronize()
pointers = []
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    command = line.split()
    if command[0] == "alloc":
        try:
            pointers.append(cuda.alloc(int(command[1]), "plain"))
            print(json.dumps({"ok": True}), flush=True)
        except DriverError as error:
            print(json.dumps({"error": error.code}), flush=True)
    elif command[0] == "free":
        cuda.free(pointers.pop(0))
        print(json.dumps({"freed": True}), flush=True)
"""


class Program:
    """PROGRAM running under the interceptor; `ask` sends a command, `answer` waits for a reply."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, self.stderr.append), daemon=True).start()
        assert self.answer() == {"ready": True}

    @staticmethod
    def _read(stream, put) -> None:
        for line in stream:
            put(line)

    def ask(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def answer(self, timeout: float = PATIENCE) -> dict:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"no answer in {timeout} s; the program's log:\n{''.join(self.stderr)}") from None

    def log_shows(self, *words: str) -> None:
        """Wait until the program's log has every word (its reader thread may lag its output)."""
        wait_for(lambda: all(word in "".join(self.stderr) for word in words), what=f"{words} in the program's log")

    def pending(self) -> bool:
        return not self.lines.empty()

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=PATIENCE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def programs(simcuda, libnvshare, scheduler):
    started: list[Program] = []
    env = simcuda.env(memory="1G", **{k: v for k, v in scheduler.env.items() if k.startswith("NVSHARE_")},
                      LD_PRELOAD=str(libnvshare), PYTHONPATH=scheduler.env.get("PYTHONPATH", ""))

    def start() -> Program:
        started.append(Program(env))
        return started[-1]

    yield start
    for program in started:
        program.close()


def waiters(scheduler) -> list[tuple[str, int]]:
    return [(w["client"], w["bytes"]) for w in scheduler.status()["admission"]["waiters"]]


# The daemon measures the simulated 1 GiB GPU (NVML): with no spill, that is the capacity. The
# programs run as one user: no quota between them (share 1).
ONE_GIB_NODE = dict(admission_spill=0, mode="off", gpus=1, gpu_memory="1G", admission_share=1)


@pytest.mark.scheduler_options(**ONE_GIB_NODE)
def test_a_blocked_allocation_resumes_when_another_program_frees(scheduler, programs):
    first = programs()
    first.ask(f"alloc {900 * MiB}")
    assert first.answer() == {"ok": True}
    second = programs()
    second.ask(f"alloc {300 * MiB}")
    seen = wait_for(lambda: waiters(scheduler), what="the second program waiting for admission")
    assert [bytes_ for _, bytes_ in seen] == [300 * MiB]
    assert not second.pending()  # its thread is blocked, not failed
    shown = scheduler.ctl("status").stdout
    assert f"{seen[0][0]} waits" in shown and "(a total of 300.0 MiB)" in shown, shown
    first.ask("free")
    assert first.answer() == {"freed": True}
    assert second.answer() == {"ok": True}
    kinds = [e["kind"] for e in scheduler.events()]
    assert "admit-wait" in kinds and "admitted" in kinds


@pytest.mark.scheduler_options(**ONE_GIB_NODE)
def test_more_than_the_whole_capacity_fails_at_once_and_the_program_goes_on(scheduler, programs):
    program = programs()
    program.ask(f"alloc {2 * GiB}")
    assert program.answer() == {"error": OUT_OF_MEMORY}
    program.ask(f"alloc {10 * MiB}")
    assert program.answer() == {"ok": True}
    program.log_shows("too-large", "CUDA_ERROR_OUT_OF_MEMORY")
    assert waiters(scheduler) == []


@pytest.mark.scheduler_options(**ONE_GIB_NODE, admission_timeout=0.5)
def test_a_wait_past_the_timeout_fails_with_out_of_memory_and_the_program_goes_on(scheduler, programs):
    first = programs()
    first.ask(f"alloc {900 * MiB}")
    assert first.answer() == {"ok": True}
    second = programs()
    second.ask(f"alloc {300 * MiB}")
    assert second.answer() == {"error": OUT_OF_MEMORY}
    second.log_shows("timeout", "CUDA_ERROR_OUT_OF_MEMORY")
    second.ask(f"alloc {50 * MiB}")  # what fits is still admitted
    assert second.answer() == {"ok": True}
    assert [e["detail"] for e in scheduler.events() if e["kind"] == "refused"] == [f"{300 * MiB} timeout"]


@pytest.mark.scheduler_options(admission_spill="off", mode="off")
def test_without_admission_nothing_waits(scheduler, programs):
    first = programs()
    first.ask(f"alloc {900 * MiB}")
    second = programs()
    second.ask(f"alloc {900 * MiB}")
    assert first.answer() == {"ok": True} and second.answer() == {"ok": True}
    assert scheduler.status()["admission"]["enabled"] is False


@pytest.mark.scheduler_options(admission_spill=0)
def test_set_admission_changes_the_settings_and_nvsharectl_shows_them(scheduler):
    done = scheduler.ctl("set-admission", "--spill", "2G", "--policy", "best-fit", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    assert "spill 2.0 GiB, policy best-fit, timeout 30 s" in done.stdout
    admission = scheduler.status()["admission"]
    assert (admission["enabled"], admission["spill"], admission["policy"], admission["timeout"]) == \
        (True, 2 * GiB, "best-fit", 30.0)
    refused = scheduler.ctl("set-admission", "--policy", "lifo")
    assert refused.returncode != 0 and "policy must be one of" in refused.stderr
    assert scheduler.ctl("set-admission", "--spill", "off").returncode == 0
    assert scheduler.status()["admission"]["enabled"] is False
    shown = scheduler.ctl("status")
    assert "admission: off" in shown.stdout


# A hostile local client (issue 20): it says the GPU is 4 EiB (DEVICE), that it uses 4 EiB of it
# and of devices nobody has (MEMORY), and asks for the whole node (ADMIT); then it stays.
HOSTILE = r"""
import sys, zmq
from nvshare_py import protocol
from nvshare_py.paths import SocketPaths
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(SocketPaths.resolve(None).client_endpoint)
def send(message):
    sock.send(message.encode())
send(protocol.Hello(pid=1, session="00000000000000ff"))
assert protocol.decode(sock.recv(), protocol.SCHEDULER_MESSAGES).TYPE in ("LIMIT", "WELCOME")
huge = 1 << 62
for n in range(8):
    device = "GPU-5151ad00-0000-4000-8000-00000000000" + str(n)
    send(protocol.DeviceAnnouncement(device=device, total=huge))
    send(protocol.Memory(device=device, used=huge))
send(protocol.Admit(device="GPU-5151ad00-0000-4000-8000-000000000000", request=1, bytes=huge))
send(protocol.Admit(device="GPU-5151ad00-0000-4000-8000-000000000001", request=2, bytes=1 << 30))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.scheduler_options(admission_spill=0, mode="off", gpus=1, gpu_memory="1G")
def test_a_hostile_client_can_neither_inflate_the_capacity_nor_jam_the_others(scheduler, programs):
    from fixtures.scheduler import as_other_user
    argv = as_other_user("dac_read_search")  # another user: its own quota (3/4 of the capacity)
    capacity = scheduler.status()["admission"]["capacity"]
    assert capacity == 1 * GiB
    hostile = subprocess.Popen([*argv, sys.executable, "-c", HOSTILE], env=scheduler.env, cwd="/",
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hostile.stdout.readline().strip() == "ready"
        wait_for(lambda: scheduler.status()["admission"]["reserved"] == 768 * MiB,
                 what="the hostile client's claims, counted up to its quota")
        admission = scheduler.status()["admission"]
        assert admission["capacity"] == capacity and scheduler.device(DEVICE0)["total"] == 1 * GiB
        innocent = programs()
        innocent.ask(f"alloc {200 * MiB}")
        assert innocent.answer() == {"ok": True}  # at once: it waited for nobody
        assert "admit-wait" not in [e["kind"] for e in scheduler.events()]
        assert scheduler.status()["admission"]["capacity"] == capacity
    finally:
        hostile.kill()
        hostile.wait()


# The caching allocator's pattern (issue 20's storm): 2 MiB small-pool segments, 20 MiB segments,
# large blocks rounded up to 2 MiB; an out-of-memory retry (cuMemGetInfo, empty_cache frees the
# cached segments, the allocation again); empty_cache between two phases.
PYTORCH_LIKE = r"""
import time
from nvshare_py.driver import Driver
MiB = 1 << 20
cuda = Driver(via="dlsym")
cuda.context(0)
cuda.launch_sleep(1)  # registered first, whatever the interceptor's rule for the first allocation
cuda.synchronize()
held = []
def allocate(*sizes):
    for size in sizes:
        held.append(cuda.alloc(size * MiB, "plain"))
def empty_cache(keep=0):
    while len(held) > keep:
        cuda.free(held.pop())
allocate(2, 20, 20, 64, 64, 64, 130)
cuda.mem_get_info()
empty_cache(keep=1)
allocate(128, 258, 2)
empty_cache()
allocate(2, 20, 64, 64, 64, 130, 258, 512)
cuda.mem_get_info()
print("done", flush=True)
"""


@pytest.mark.scheduler_options(admission_spill=4 * GiB, mode="off", gpus=1)
def test_a_pytorch_like_allocation_pattern_asks_a_handful_of_times(scheduler, simcuda, libnvshare):
    # Issue 20: 35,707 ADMITs in a process's first second, each answered with the same total.
    env = simcuda.env(LD_PRELOAD=str(libnvshare), NVSHARE_SOCKET_DIR=str(scheduler.socket_dir), NVSHARE_LOG="debug")
    done = subprocess.run([sys.executable, "-c", PYTORCH_LIKE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
    admits = [line for line in done.stderr.splitlines() if "sent NVSHARE/1 ADMIT" in line]
    assert 1 <= len(admits) <= 10, "\n".join(admits[:20])  # questions and give-backs together
