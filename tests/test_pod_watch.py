"""The device plugin's pod watcher end to end: pods (with nvshare.com/* annotations) in a
stand-in API server over real HTTPS, the watcher's asyncio tasks as the plugin runs them, and
the scheduler's control socket: a recording stand-in for the behaviour of the watcher (restarts,
refusals, an absent scheduler), and the real daemon for what its settings become."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from apiserver_standin import ApiServerStandin
from nvshare_py.control import ControlFailure
from nvshare_py.deviceplugin.kubeapi import ApiServer
from nvshare_py.deviceplugin.podsettings import MEMORY_LIMIT, PRIORITY, WEIGHT
from nvshare_py.deviceplugin.podwatch import PodSettingsSync
from nvshare_py.paths import SocketPaths
from nvshare_py.testing.scheduler import wait_for

NODE = "gpu-node-1"
PATIENCE = 60.0  # an upper guard only


@pytest.fixture
def apiserver():
    directory = Path(tempfile.mkdtemp(prefix="nvs-api-", dir="/tmp"))
    standin = ApiServerStandin(directory).start()
    yield standin
    standin.stop()
    shutil.rmtree(directory)


class ControlStandin:
    """The scheduler's control socket as the contract (CONTRACT.md) describes the per-pod
    settings: it keeps {(op, pod_uid): value}, answers `status` with who it is, and can
    restart (forgetting everything), refuse, or be away."""

    VALUE_KEYS = {"set-weight": "weight", "set-priority": "priority", "set-limit": "bytes"}

    def __init__(self, socket_dir: Path) -> None:
        self.paths = SocketPaths(socket_dir)
        self.paths.control_dir.mkdir(parents=True, exist_ok=True)
        self.settings: dict[tuple[str, str], int] = {}
        self.requests: list[dict] = []
        self.refuse: set[str] = set()
        self.started = 1.0
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> "ControlStandin":
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="control")
        ready = threading.Event()
        self._thread_ready = ready
        self._thread.start()
        assert ready.wait(PATIENCE)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(PATIENCE)
        self.paths.control_socket.unlink(missing_ok=True)

    def restart(self, unnoticed: bool = False) -> None:
        """A new scheduler: nothing set, another start time. `unnoticed`: between two requests,
        so that nobody finds the socket away."""
        if not unnoticed:
            self.stop()
        with self._changed:
            self.settings.clear()
            self.started += 1
        if not unnoticed:
            self.start()

    def _serve(self) -> None:
        context = zmq.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.paths.control_endpoint)
        self._thread_ready.set()
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                routing, empty, body = router.recv_multipart()
                router.send_multipart([routing, empty, zmq.utils.jsonapi.dumps(self._answer(
                    zmq.utils.jsonapi.loads(body)))])
        finally:
            router.close(0)
            context.term()

    def _answer(self, request: dict) -> dict:
        op = request["op"]
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()
            if op == "status":
                return {"v": 1, "ok": True, "result": {"scheduler": {"pid": 4242, "started": self.started}}}
            if op in self.refuse or op not in self.VALUE_KEYS:
                return {"v": 1, "ok": False, "error": {"code": "unknown-op", "message": f"unknown op {op!r}"}}
            value = request[self.VALUE_KEYS[op]]
            if value is None:
                self.settings.pop((op, request["pod_uid"]), None)
            else:
                self.settings[op, request["pod_uid"]] = value
            return {"v": 1, "ok": True, "result": {}}

    def wait_for_settings(self, expected: dict, what: str = "the pods' settings") -> None:
        deadline = time.monotonic() + PATIENCE
        with self._changed:
            while self.settings != expected:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what}: expected {expected}, have {self.settings}; "
                                         f"requests {self.requests[-10:]}")
                self._changed.wait(0.5)


@pytest.fixture
def control_standin():
    directory = Path(tempfile.mkdtemp(prefix="nvs-ctl-", dir="/tmp"))
    standin = ControlStandin(directory).start()
    yield standin
    standin.stop()
    shutil.rmtree(directory)


class RunningSync:
    """A PodSettingsSync on an asyncio loop of its own thread, as the plugin runs it; its log
    lines are collected."""

    def __init__(self, apiserver: ApiServerStandin, paths: SocketPaths) -> None:
        self.sync = PodSettingsSync(ApiServer(apiserver.url, apiserver.token_file, apiserver.ca_file), NODE, paths,
                                    retry_interval=0.05, resync_interval=0.2)
        self.lines: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="pod-sync")

    def _run(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            await self.sync.run()
        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # shown by the test that stops it
            self.failure = error

    def start(self) -> "RunningSync":
        self._thread.start()
        wait_for(lambda: self._task is not None or not self._thread.is_alive(), what="the watcher's loop")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(PATIENCE)
        assert not self._thread.is_alive(), "the pod watcher did not end when cancelled"
        assert self.failure is None, f"the pod watcher failed: {self.failure!r}"

    def log_has(self, text: str) -> bool:
        return any(text in line for line in self.lines)


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@contextmanager
def running_sync(apiserver: ApiServerStandin, paths: SocketPaths):
    running = RunningSync(apiserver, paths)
    handler = _Lines(running.lines)
    logger = logging.getLogger("nvshare_py.deviceplugin")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    running.start()
    try:
        yield running
    finally:
        running.stop()
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_annotations_become_the_pods_settings_and_follow_changes(apiserver, control_standin):
    notebook = apiserver.add_pod("nb-0", NODE, {WEIGHT: "4", PRIORITY: "2", MEMORY_LIMIT: "8Gi"})
    apiserver.add_pod("elsewhere", "gpu-node-2", {WEIGHT: "9"})  # another node's: not ours
    apiserver.add_pod("plain", NODE)
    with running_sync(apiserver, control_standin.paths) as running:
        control_standin.wait_for_settings({("set-weight", notebook): 4, ("set-priority", notebook): 2,
                                           ("set-limit", notebook): 8 << 30})
        # A pod created later, a changed and a removed annotation.
        job = apiserver.add_pod("job", NODE, {PRIORITY: "7"})
        apiserver.annotate("nb-0", {WEIGHT: "10", MEMORY_LIMIT: None})
        control_standin.wait_for_settings({("set-weight", notebook): 10, ("set-priority", notebook): 2,
                                           ("set-priority", job): 7}, "after the changes")
        # A deleted pod's settings go; so do those of a pod whose containers have all ended.
        apiserver.delete_pod("nb-0")
        apiserver.set_phase("job", "Succeeded")
        control_standin.wait_for_settings({}, "after the pods went away")
        wait_for(lambda: running.log_has(f"pod default/nb-0 ({notebook}): {WEIGHT}=10"), what="the change logged")
    pods = [r for r in apiserver.requests if r["path"] == "/api/v1/pods"]
    assert pods and all(r["authorized"] and r["query"]["fieldSelector"] == f"spec.nodeName={NODE}" for r in pods)
    assert any(r["query"].get("watch") == "true" for r in pods)


def test_bad_values_are_reported_and_not_applied(apiserver, control_standin):
    uid = apiserver.add_pod("nb-0", NODE, {WEIGHT: "heavy", PRIORITY: "9", MEMORY_LIMIT: "2Gi"})
    with running_sync(apiserver, control_standin.paths) as running:
        control_standin.wait_for_settings({("set-limit", uid): 2 << 30})
        wait_for(lambda: running.log_has(f"WARNING pod default/nb-0: {WEIGHT}='heavy' ignored: not an integer from 1 to 1000")
                 and running.log_has(f"WARNING pod default/nb-0: {PRIORITY}='9' ignored: not an integer from 0 to 7"),
                 what="warnings about the bad values")
        # Also as Warning events of the pod, which `kubectl describe pod` shows its owner.
        events = apiserver.wait_until(lambda: len(apiserver.events) >= 2 and list(apiserver.events), what="2 events")
        assert {event["message"] for event in events} == {
            f"pod default/nb-0: {WEIGHT}='heavy' ignored: not an integer from 1 to 1000",
            f"pod default/nb-0: {PRIORITY}='9' ignored: not an integer from 0 to 7"}
        assert all(event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "default",
                                               "name": "nb-0", "uid": uid}
                   and event["type"] == "Warning" and event["reason"] == "InvalidNvshareAnnotation" for event in events)
        # Fixed: applied. A value that turns bad removes the setting (the pod no longer asks for one).
        apiserver.annotate("nb-0", {WEIGHT: "3", PRIORITY: None, MEMORY_LIMIT: "a lot"})
        control_standin.wait_for_settings({("set-weight", uid): 3}, "after the fix")
        wait_for(lambda: running.log_has(f"{MEMORY_LIMIT}='a lot' ignored"), what="the warning about the limit")
        apiserver.wait_until(lambda: len(apiserver.events) == 3, what="the event about the limit")
    sent = [r for r in control_standin.requests if r["op"] != "status"]
    assert all(r.get("weight") not in ("heavy",) and r.get("priority") != 9 for r in sent)
    assert len(apiserver.events) == 3  # each bad value once, however often the pod changed


def test_without_rights_to_record_events_the_warnings_stay_in_the_log(apiserver, control_standin):
    apiserver.events_forbidden = True
    uid = apiserver.add_pod("nb-0", NODE, {WEIGHT: "0", PRIORITY: "1"})
    with running_sync(apiserver, control_standin.paths) as running:
        control_standin.wait_for_settings({("set-priority", uid): 1})
        wait_for(lambda: running.log_has(f"{WEIGHT}='0' ignored") and running.log_has("cannot record events about pods"),
                 what="the warning and why it is not an event")


def test_a_restarted_scheduler_or_plugin_gets_the_settings_again(apiserver, control_standin):
    uid = apiserver.add_pod("nb-0", NODE, {WEIGHT: "5"})
    expected = {("set-weight", uid): 5}
    with running_sync(apiserver, control_standin.paths) as running:
        control_standin.wait_for_settings(expected)
        control_standin.restart()  # forgets the settings
        control_standin.wait_for_settings(expected, "after the scheduler restarted")
        # A restart between two requests is told by the scheduler's start time.
        control_standin.restart(unnoticed=True)
        control_standin.wait_for_settings(expected, "after an unnoticed restart")
        assert running.log_has("the scheduler restarted: sending every setting again")
        # Away for a while: said once, and caught up when it is back.
        control_standin.stop()
        apiserver.annotate("nb-0", {WEIGHT: "6"})
        wait_for(lambda: running.log_has("cannot reach the scheduler"), what="the scheduler missed")
        control_standin.start()
        control_standin.wait_for_settings({("set-weight", uid): 6}, "after the scheduler came back")
    # A plugin that starts again sends the same settings: nothing changes.
    with running_sync(apiserver, control_standin.paths):
        wait_for(lambda: sum(r["op"] == "set-weight" and r["weight"] == 6 for r in control_standin.requests) >= 2,
                 what="the settings sent again by the new plugin")
        control_standin.wait_for_settings({("set-weight", uid): 6})


def test_a_watch_that_cannot_resume_lists_again_and_misses_nothing(apiserver, control_standin):
    uid = apiserver.add_pod("nb-0", NODE, {WEIGHT: "2"})
    with running_sync(apiserver, control_standin.paths):
        control_standin.wait_for_settings({("set-weight", uid): 2})
        lists = apiserver.lists
        # Compacted before the watch saw it: the change is only in the next list.
        apiserver.annotate("nb-0", {WEIGHT: "3"}, compact=True)
        control_standin.wait_for_settings({("set-weight", uid): 3}, "after the relist")
        assert apiserver.lists > lists
        # A watch the server ends in the ordinary way (its timeout; a bookmark first) resumes
        # where it was, without listing again.
        lists = apiserver.lists
        apiserver.end_watches()
        apiserver.annotate("nb-0", {WEIGHT: "4"})
        control_standin.wait_for_settings({("set-weight", uid): 4}, "after the watch resumed")
        assert apiserver.lists == lists


def test_a_refused_setting_is_said_and_not_sent_again_and_again(apiserver, control_standin):
    control_standin.refuse.add("set-priority")
    uid = apiserver.add_pod("nb-0", NODE, {PRIORITY: "3", WEIGHT: "2"})
    with running_sync(apiserver, control_standin.paths) as running:
        control_standin.wait_for_settings({("set-weight", uid): 2})
        wait_for(lambda: running.log_has(f"pod default/nb-0 ({uid}): the scheduler refused {PRIORITY}=3"),
                 what="the refusal logged")
        apiserver.annotate("nb-0", {"unrelated": "x"})
        apiserver.annotate("nb-0", {WEIGHT: "4"})
        control_standin.wait_for_settings({("set-weight", uid): 4})
    assert sum(r["op"] == "set-priority" for r in control_standin.requests) == 1


def test_the_api_server_refusing_the_token_is_reported(apiserver, control_standin):
    apiserver.token_file.write_text("a token the server does not know\n")
    with running_sync(apiserver, control_standin.paths) as running:
        wait_for(lambda: running.log_has(f"cannot follow the pods of node {NODE}") and running.log_has("HTTP 401"),
                 what="the refusal logged")
        # A rotated token is read again at the next try.
        uid = apiserver.add_pod("nb-0", NODE, {WEIGHT: "7"})
        apiserver.token_file.write_text("standin-service-account-token\n")
        control_standin.wait_for_settings({("set-weight", uid): 7})
        # A failure after a success is said again.
        apiserver.token_file.write_text("revoked\n")
        apiserver.end_watches()
        wait_for(lambda: sum("cannot follow the pods" in line for line in running.lines) == 2,
                 what="the second failure logged")


def test_the_plugin_runs_the_watcher_only_where_it_can(monkeypatch, caplog):
    from nvshare_py.deviceplugin.config import PluginConfig
    from nvshare_py.deviceplugin.server import pod_settings_sync

    paths = SocketPaths(Path("/tmp/nvs-nowhere"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    caplog.set_level(logging.INFO, "nvshare_py.deviceplugin")
    assert pod_settings_sync(PluginConfig(socket_paths=paths, node_name=NODE)) is None
    assert "not in a Kubernetes cluster" in caplog.text
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert pod_settings_sync(PluginConfig(socket_paths=paths)) is None
    assert "the node's name is not set (NODE_NAME" in caplog.text
    assert pod_settings_sync(PluginConfig(socket_paths=paths, node_name=NODE, pod_settings=False)) is None
    sync = pod_settings_sync(PluginConfig(socket_paths=paths, node_name=NODE))
    assert (sync.node, sync.api.url, sync.paths) == (NODE, "https://10.96.0.1:443", paths)


def test_in_cluster_configuration_comes_from_the_service_account(tmp_path):
    api = ApiServer.in_cluster({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path)
    assert api == ApiServer("https://10.96.0.1:443", tmp_path / "token", tmp_path / "ca.crt")
    assert ApiServer.in_cluster({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"},
                                tmp_path).url == "https://[fd00::1]:443"
    assert ApiServer.in_cluster({}, tmp_path) is None


# ---- the real scheduler -----------------------------------------------------------------------


def pod_settings(status: dict) -> dict:
    """{(setting, pod_uid): value} of the settings the scheduler's status shows per pod."""
    settings = status.get("settings") or status["scheduler"].get("settings") or {}
    found = {}
    for name in ("weight", "priority"):
        for uid, value in settings.get(name, {}).get("pods", {}).items():
            found[name, uid] = value
    for device, limits in settings.get("limit", {}).items():
        for uid, value in limits.get("pods", {}).items():
            found["limit", uid] = value
    return found


def test_the_real_scheduler_takes_the_pods_settings(apiserver, scheduler):
    try:
        scheduler.request("set-weight", pod_uid="probe", weight=None)
    except ControlFailure as failure:
        if failure.code == "unknown-op":
            pytest.skip("this scheduler has no per-pod settings yet (set-weight)")
        raise
    notebook = apiserver.add_pod("nb-0", NODE, {WEIGHT: "4", PRIORITY: "2", MEMORY_LIMIT: "1Gi"})
    with running_sync(apiserver, scheduler.paths):
        wait_for(lambda: pod_settings(scheduler.status()) == {("weight", notebook): 4, ("priority", notebook): 2,
                                                              ("limit", notebook): 1 << 30},
                 what="the pod's settings in the scheduler's status")
        scheduler.restart()
        wait_for(lambda: pod_settings(scheduler.status()) == {("weight", notebook): 4, ("priority", notebook): 2,
                                                              ("limit", notebook): 1 << 30},
                 what="the settings again after the scheduler restarted")
        apiserver.delete_pod("nb-0")
        wait_for(lambda: pod_settings(scheduler.status()) == {}, what="the settings removed")


@contextmanager
def fake_pod_cgroup(pod_uid: str):
    """A cgroup where the kubelet's cgroupfs driver would put a container of pod `pod_uid`;
    yields a function that moves a process into it. Skips where cgroups cannot be made."""
    v1 = Path("/sys/fs/cgroup/pids")
    root = v1 if (v1 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
    levels = [root / "kubepods", root / "kubepods" / "burstable", root / "kubepods" / "burstable" / f"pod{pod_uid}"]
    container = levels[-1] / "c0ffee"
    made = []
    try:
        for directory in [*levels, container]:
            if not directory.exists():
                directory.mkdir()
                made.append(directory)
    except OSError as error:
        for directory in reversed(made):
            directory.rmdir()
        pytest.skip(f"cannot make cgroups here ({error.strerror})")
    moved = []

    def move(pid: int) -> None:
        (container / "cgroup.procs").write_text(str(pid))
        moved.append(pid)

    try:
        yield move
    finally:
        for pid in moved:
            try:
                (root / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # gone
        for directory in reversed(made):
            try:
                directory.rmdir()
            except OSError:
                pass  # a shared level another run still uses


def test_a_client_in_an_annotated_pod_gets_the_pods_settings(apiserver, scheduler):
    try:
        scheduler.request("set-weight", pod_uid="probe", weight=None)
    except ControlFailure as failure:
        if failure.code == "unknown-op":
            pytest.skip("this scheduler has no per-pod settings yet (set-weight)")
        raise
    notebook = apiserver.add_pod("nb-0", NODE, {WEIGHT: "7", PRIORITY: "3"})
    with fake_pod_cgroup(notebook) as move, running_sync(apiserver, scheduler.paths):
        # The client says it is another pod; the scheduler believes its cgroup.
        agent = scheduler.agent(env={"NVSHARE_POD_NAME": "someone-else", "NVSHARE_POD_NAMESPACE": "x"})
        move(agent.pid)
        # Its registration is read again when it reconnects to a restarted scheduler.
        scheduler.restart()

        def mine():
            clients = scheduler.status()["clients"]
            return clients and clients[0]["pod_uid"] == notebook and clients[0]
        # The pod's settings arrive as one request each (set-weight, then set-priority): wait for both.
        client = wait_for(lambda: (c := mine()) and c["weight"] == 7 and c["priority"] == 3 and c,
                          what="the pod's weight and priority on its client")
        assert client["priority"] == 3 and client["pod"] == "someone-else"
        agent.kill()


# A CUDA program under the interceptor that waits for a line on stdin (so that it can be moved
# into a pod's cgroup before it registers), then makes its first memory calls.
FIRST_MEMORY_CALLS = r"""
import json, sys
sys.stdin.readline()
from nvshare_py.driver import Driver, DriverError
cuda = Driver(via="dlsym")
cuda.context(0)
free, total = cuda.mem_get_info()
try:
    cuda.alloc(128 << 20, "plain")
    allocation = "ok"
except DriverError as error:
    allocation = error.code
print(json.dumps({"free": free, "total": total, "allocation": allocation}))
"""


def test_a_pods_memory_limit_annotation_governs_its_programs_first_memory_calls(apiserver, scheduler, simcuda,
                                                                                libnvshare):
    # Issue 20: a pod annotated nvshare.com/memory-limit was not limited where it matters (the
    # first cuMemGetInfo, which frameworks size themselves from, and the first allocation).
    notebook = apiserver.add_pod("nb-0", NODE, {MEMORY_LIMIT: "64Mi"})
    env = simcuda.env(LD_PRELOAD=str(libnvshare), NVSHARE_SOCKET_DIR=str(scheduler.socket_dir))
    with fake_pod_cgroup(notebook) as move, running_sync(apiserver, scheduler.paths):
        wait_for(lambda: pod_settings(scheduler.status()) == {("limit", notebook): 64 << 20},
                 what="the pod's limit in the scheduler's status")
        program = subprocess.Popen([sys.executable, "-c", FIRST_MEMORY_CALLS], env=env, cwd="/", text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        move(program.pid)
        out, err = program.communicate("go\n", timeout=PATIENCE)
    assert program.returncode == 0, err
    assert json.loads(out) == {"free": 64 << 20, "total": 64 << 20, "allocation": 2}  # CUDA_ERROR_OUT_OF_MEMORY
