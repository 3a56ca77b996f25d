"""Keeping the scheduler told: the per-pod settings a `PodSettings` wants, sent over the
scheduler's control socket. The pod watcher (podwatch.py) of the device plugin and of the DRA
driver (whose pods' settings come from their claims, nvshare_py/dra/podclaims.py) runs one,
beside the task that feeds its `PodSettings`; the DRA driver's GPU modes
(nvshare_py/dra/gpumodes.py) go through it too. Each such source of settings says what is
pending and hears what was told (`SettingsSource`).

Before each round it asks the scheduler who it is (pid and start time in `status`): a
scheduler that restarted has forgotten everything, and gets every setting again. It also
wakes every `resync_interval` without a change, so a restart is noticed even on a quiet node.
A scheduler that cannot be reached is said once and retried every `retry_interval`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping, Protocol, Sequence

from nvshare_py import control
from nvshare_py.paths import SocketPaths

log = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 5.0


class SettingsSource(Protocol):
    """Settings the scheduler is kept told of. Its requests have `op` and `fields` (the control
    request), `subject` (whom it is for, in log lines) and a `str()` (what it sets)."""

    def scheduler_restarted(self) -> None:
        """A new scheduler knows none of the settings: every one is pending again."""

    def pending(self, scheduler: Mapping[str, Any]) -> Sequence[Any]:
        """The requests that bring the scheduler up to date; `scheduler`: its part of the status."""

    def told(self, request: Any) -> None:
        """The scheduler answered `request`, accepting or refusing it."""


class SchedulerLink:
    def __init__(self, paths: SocketPaths, sources: Sequence[SettingsSource], *, retry_interval: float = 5.0,
                 resync_interval: float = 30.0) -> None:
        self.paths = paths
        self.sources = list(sources)
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
                scheduler = (await self._request("status"))["scheduler"]
                identity = scheduler["pid"], scheduler["started"]
                if identity != told:
                    if told is not None:
                        log.info("the scheduler restarted: sending every setting again")
                    for source in self.sources:
                        source.scheduler_restarted()
                    told = identity
                for source in self.sources:
                    for request in source.pending(scheduler):
                        await self._send(source, request)
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

    async def _send(self, source: SettingsSource, request: Any) -> None:
        try:
            await self._request(request.op, **request.fields)
        except control.ControlFailure as failure:
            if failure.exit_code != control.EXIT_REFUSED:
                raise
            log.warning("%s: the scheduler refused %s: %s", request.subject, request, failure)
        else:
            log.info("%s: %s", request.subject, request)
        source.told(request)

    async def _request(self, op: str, **fields) -> dict:
        # The control client is blocking (zmq REQ); its own timeout bounds the thread.
        return await asyncio.to_thread(control.request, self.paths, op, timeout=CONTROL_TIMEOUT_S, **fields)
