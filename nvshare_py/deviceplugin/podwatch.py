"""The pod watcher: nvshare.com/* annotations of the pods on this node become the scheduler's
per-pod settings (podsettings.py says which and how), over the scheduler's control socket.

Two tasks under one owner (`PodSettingsSync.run`, a branch of the plugin's task tree):
- `_follow_pods` lists the node's pods, then watches them, listing again whenever the watch
  cannot resume; every change goes into `PodSettings` and wakes the other task;
- the `SchedulerLink` (schedulerlink.py) sends what `PodSettings` (and the owner's
  `other_settings`: the DRA driver's GPU modes) says is pending, and everything again to a
  scheduler that restarted.
Both are idempotent from the pods alone: a plugin that restarts lists the pods and sends their
settings again, which changes nothing in a scheduler that has them.

What a pod asks for is the `reader`'s to say: its annotations (`read_pod`, the device plugin),
or the settings of the nvshare ResourceClaims it uses (the DRA driver, nvshare_py/dra), which
change when a claim is prepared or unprepared: `refresh()` reads every pod again then.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Callable, Sequence

import httpx

from nvshare_py.paths import SocketPaths

from .kubeapi import ApiError, ApiServer, WatchExpired, list_pods, post_event, watch_pods
from .podsettings import Pod, PodSettings, Problem, read_pod
from .schedulerlink import SchedulerLink, SettingsSource
from .tasks import run_until_first_exits

log = logging.getLogger(__name__)

EVENT_REASON = "InvalidNvshareAnnotation"
EVENT_COMPONENT = "nvshare-device-plugin"


class PodSettingsSync:
    def __init__(self, api: ApiServer, node: str, paths: SocketPaths, *, retry_interval: float = 5.0,
                 resync_interval: float = 30.0, reader: Callable[[dict], Pod | None] = read_pod,
                 what: str = "nvshare.com/ annotations", other_settings: Sequence[SettingsSource] = ()) -> None:
        self.api = api
        self.node = node
        self.paths = paths
        self.reader = reader
        self.what = what
        self._documents: dict[str, dict] = {}  # the node's pods as last seen, by the reader's pod UID
        self.retry_interval = retry_interval
        self.resync_interval = resync_interval
        self.settings = PodSettings()
        self.scheduler = SchedulerLink(paths, [self.settings, *other_settings], retry_interval=retry_interval,
                                       resync_interval=resync_interval)
        self._event_failure_said = False
        self._api_failing = False

    async def run(self) -> None:
        log.info("applying the %s of the pods on node %s through %s", self.what, self.node,
                 self.paths.control_socket)
        await run_until_first_exits(self._follow_pods(), self.scheduler.run())

    # ---- the API server -------------------------------------------------------------------

    async def _follow_pods(self) -> None:
        """Never returns: every failure is retried (said once until a list succeeds again)."""
        while True:
            try:
                async with self.api.client() as client:
                    await self._list_and_watch(client)
            except WatchExpired as expired:
                log.info("listing the pods again: %s", expired)
                continue
            except (ApiError, httpx.HTTPError) as error:
                if not self._api_failing:
                    log.warning("cannot follow the pods of node %s (retrying every %g s): %s", self.node,
                                self.retry_interval, _describe(error))
                self._api_failing = True
            await asyncio.sleep(self.retry_interval)

    async def _list_and_watch(self, client: httpx.AsyncClient) -> None:
        documents, version = await list_pods(client, self.node)
        self._api_failing = False
        self._documents = {}
        pods = []
        for document in documents:
            pod = self.reader(document)
            if pod is not None:
                self._documents[pod.uid] = document
                pods.append(pod)
        await self._report(client, self.settings.replace_all(pods))
        self.scheduler.wake()
        log.info("following the %d pods on node %s", len(pods), self.node)
        while True:  # the server ends each watch after a while; the next resumes where it ended
            async for kind, document in watch_pods(client, self.node, version):
                version = (document.get("metadata") or {}).get("resourceVersion") or version
                pod = self.reader(document) if kind != "BOOKMARK" else None
                if pod is None:
                    continue
                if kind == "DELETED":
                    self._documents.pop(pod.uid, None)
                    self.settings.remove(pod.uid)
                else:
                    self._documents[pod.uid] = document
                    await self._report(client, self.settings.update(pod))
                self.scheduler.wake()

    def refresh(self) -> None:
        """What the pods ask for changed without a change of the pods (the reader's other
        input): every pod is read again."""
        pods = [pod for pod in map(self.reader, self._documents.values()) if pod is not None]
        self.settings.replace_all(pods)
        self.scheduler.wake()

    async def _report(self, client: httpx.AsyncClient, problems: list[Problem]) -> None:
        """In the plugin's log, and as a Warning event of the pod (`kubectl describe pod`)."""
        for problem in problems:
            log.warning("%s", problem)
            try:
                await post_event(client, self._event(problem))
            except (ApiError, httpx.HTTPError) as error:
                if not self._event_failure_said:
                    log.warning("cannot record events about pods (the warnings stay in this log only): %s",
                                _describe(error))
                    self._event_failure_said = True

    def _event(self, problem: Problem) -> dict:
        namespace, _, name = problem.pod.partition("/")
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name,
                               "uid": problem.pod_uid},
            "type": "Warning", "reason": EVENT_REASON, "message": str(problem),
            "source": {"component": EVENT_COMPONENT, "host": self.node},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__
