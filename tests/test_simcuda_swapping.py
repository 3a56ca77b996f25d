"""Swapping by the interceptor on the simulated driver with residency modelled
(docs/interceptor.md "Swapping"): a process told to evict moves its converted memory to the host
in bulk, at prefetch cost, before it releases; a grant that allows a prefetch brings it back in
bulk before the process's kernels run, so they fault nothing; an EVICT to a process that does
not hold the device moves the least recently used, largest allocations first and is answered
with what stays resident.

The scheduler here is a script (a pyzmq ROUTER speaking docs/protocol.md) so that each message
of the residency protocol is sent exactly when the test wants it; the scheduler's own rules for
when to send them are tested with its core."""

from __future__ import annotations

import shutil

import pytest
import zmq

from fixtures.residency import MIB, migrations, moved
from fixtures.scheduler import short_socket_dir

PATIENCE_MS = 30_000  # one message, on a loaded 2-core machine


class ScriptedScheduler:
    """A client socket at <dir>/client/scheduler.sock that answers registration and liveness
    checks by itself and hands every other message to the test."""

    def __init__(self) -> None:
        self.dir = short_socket_dir()
        (self.dir / "client").mkdir(mode=0o755)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.bind(f"ipc://{self.dir}/client/scheduler.sock")
        self.peer: list[bytes] = []
        self.seen: list[str] = []
        self.device = ""

    @property
    def env(self) -> dict[str, str]:
        return {"NVSHARE_SOCKET_DIR": str(self.dir)}

    def send(self, kind: str, **fields) -> None:
        text = f"NVSHARE/1 {kind}" + "".join(f"\n{key}={value}" for key, value in fields.items())
        self.socket.send_multipart([*self.peer, text.encode()])

    def expect(self, kind: str) -> dict[str, str]:
        """The next message of type `kind` (others are kept in `seen`), as its fields."""
        while True:
            if not self.socket.poll(PATIENCE_MS):
                raise AssertionError(f"no {kind} within {PATIENCE_MS / 1000:g} s; got {self.seen}")
            *self.peer, data = self.socket.recv_multipart()
            text = data.decode()
            self.seen.append(text)
            header, *lines = text.split("\n")
            fields = dict(line.split("=", 1) for line in lines)
            if header.endswith(" HELLO"):
                self.send("WELCOME", client="c1", heartbeat_ms=600_000, idle_release_ms=0, version=1)
            elif header.endswith(" QUERY"):
                self.send("STATUS", json="{}")
            elif header.endswith(" DEVICE"):
                self.device = fields["device"]
            if header == f"NVSHARE/1 {kind}":
                return fields

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def scripted():
    scheduler = ScriptedScheduler()
    yield scheduler
    scheduler.close()


def grant(scheduler: ScriptedScheduler, number: int, **extra) -> None:
    scheduler.expect("ACQUIRE")
    scheduler.send("GRANT", device=scheduler.device, grant=number, mode="on", exclusive=1, quantum_ms=60_000, **extra)


@pytest.mark.parametrize("advise", ["0", "1"])
def test_evict_on_release_and_prefetch_on_grant_move_memory_in_bulk(scripted, cuda_app, simcuda, tmp_path, advise):
    """The same with NVSHARE_ADVISE=1: advice (preferred location: the device) does not keep a
    prefetch to the host from moving the pages, and stays on the allocations."""
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path), "NVSHARE_ADVISE": advise}
    app = cuda_app(env, "init", "alloc:plain:16777216", "alloc:plain:8388608", "kernel:1000", "sync",
                   "wait", "kernel:1000", "sync")
    grant(scripted, 1)
    app.expect("waiting")  # its first kernel faulted its 24 MiB in
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum", evict=24 * MIB)
    release = scripted.expect("RELEASE")
    assert (release["grant"], release["reason"], release["resident"]) == ("1", "drop", "0")
    # The swap-out's stream was synchronised before the RELEASE: its migrations are in the trace.
    out = migrations(simcuda.read_trace(cuda_app.trace), direction="to_host", owner=app.pid)
    assert [(m["cause"], m["bytes"]) for m in out] == [("prefetch", 16 * MIB), ("prefetch", 8 * MIB)]

    app.continue_()
    grant(scripted, 2, prefetch=24 * MIB)
    assert app.wait() == 0, app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    assert moved(lines, owner=app.pid, cause="prefetch", direction="to_device") == 24 * MIB
    assert moved(lines, owner=app.pid, cause="fault") == 24 * MIB  # the first touch only
    last_kernel = max((line for line in lines if line["op"] == "kernel"), key=lambda line: line["start"])
    brought_in = [m for m in migrations(lines, direction="to_device", cause="prefetch")]
    assert all(m["end"] <= last_kernel["start"] + 1e-6 for m in brought_in)  # before the kernel ran
    memory = [text for text in scripted.seen if text.startswith("NVSHARE/1 MEMORY") and "resident=0" in text]
    assert memory, scripted.seen  # the scheduler heard that nothing stayed resident
    advice = [line for line in lines if line["op"] == "advise"]
    assert len(advice) == (4 if advise == "1" else 0)  # given once per allocation, never taken back


def test_a_drop_without_evict_moves_nothing(scripted, cuda_app, simcuda, tmp_path):
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path)}
    app = cuda_app(env, "init", "alloc:plain:16777216", "kernel:1000", "sync", "wait", "kernel:1000", "sync")
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum")
    assert "resident" not in scripted.expect("RELEASE")
    app.continue_()
    grant(scripted, 2, prefetch=16 * MIB)  # nothing was swapped: nothing to bring back
    assert app.wait() == 0, app.stderr
    lines = simcuda.read_trace(cuda_app.trace)
    assert migrations(lines, cause="prefetch") == []
    assert moved(lines, owner=app.pid) == 16 * MIB  # the first touch, nothing else


def test_evict_moves_the_largest_of_the_oldest_allocations_first(scripted, cuda_app, simcuda, tmp_path):
    env = {**scripted.env, "SIMCUDA_MEMORY": "64M", "SIMCUDA_RESIDENCY_DIR": str(tmp_path)}
    app = cuda_app(env, "init", "alloc:plain:8388608", "alloc:plain:16777216", "kernel:1000", "sync", "wait")
    grant(scripted, 1)
    app.expect("waiting")
    scripted.send("DROP", device=scripted.device, grant=1, grace_ms=60_000, reason="quantum")
    scripted.expect("RELEASE")
    scripted.send("EVICT", device=scripted.device, bytes=4 * MIB)  # it holds nothing now
    assert scripted.expect("EVICTED")["resident"] == str(8 * MIB)
    app.continue_()
    assert app.wait() == 0, app.stderr
    out = migrations(simcuda.read_trace(cuda_app.trace), direction="to_host", owner=app.pid)
    assert [(m["cause"], m["bytes"]) for m in out] == [("prefetch", 16 * MIB)]
