"""Keeping the scheduler told: the per-pod settings a `PodSettings` wants, sent over the
scheduler's control socket. The device plugin's pod watcher (podwatch.py) and the DRA driver's
claim watcher (nvshare_py/dra/claimwatch.py) each run one, beside the task that feeds their
`PodSettings`.

Before each round it asks the scheduler who it is (pid and start time in `status`): a
scheduler that restarted has forgotten everything, and gets every setting again. It also
wakes every `resync_interval` without a change, so a restart is noticed even on a quiet node.
A scheduler that cannot be reached is said once and retried every `retry_interval`.
"""

from __future__ import annotations

import asyncio
import logging

from nvshare_py import control
from nvshare_py.paths import SocketPaths

from .podsettings import PodSettings, Request

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0


class SchedulerLink:
    def __init__(self, paths: SocketPaths, settings: PodSettings, *, retry_interval: float = 5.0,
                 resync_interval: float = 30.0) -> None:
        self.paths = paths
        self.settings = settings
        self.retry_interval = retry_interval
        self.resync_interval = resync_interval
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """The settings changed: send what is pending now."""
        self._changed.set()

    async def run(self) -> None:
        told = None  # (pid, start time) of the scheduler that has the settings
        failing = False
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), self.resync_interval)
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            try:
                identity = await self._scheduler_identity()
                if identity != told:
                    if told is not None:
                        log.info("the scheduler restarted: sending the pods' settings again")
                    self.settings.scheduler_restarted()
                    told = identity
                for request in self.settings.pending():
                    await self._send(request)
                if failing:
                    log.info("the scheduler answers again")
                failing = False
            except control.ControlFailure as failure:
                if not failing:
                    log.warning("cannot reach the scheduler (retrying every %g s): %s", self.retry_interval, failure)
                failing = True
                told = None
                await asyncio.sleep(self.retry_interval)
                self._changed.set()

    async def _scheduler_identity(self) -> tuple:
        scheduler = (await self._request("status"))["scheduler"]
        return scheduler["pid"], scheduler["started"]

    async def _send(self, request: Request) -> None:
        try:
            await self._request(request.op, **request.fields)
        except control.ControlFailure as failure:
            if failure.exit_code != control.EXIT_REFUSED:
                raise
            log.warning("pod %s (%s): the scheduler refused %s: %s", request.pod, request.pod_uid, request, failure)
        else:
            log.info("pod %s (%s): %s", request.pod, request.pod_uid, request)
        self.settings.told(request)

    async def _request(self, op: str, **fields) -> dict:
        # The control client is blocking (zmq REQ); its own timeout bounds the thread.
        return await asyncio.to_thread(control.request, self.paths, op, timeout=CONTROL_TIMEOUT_S, **fields)
