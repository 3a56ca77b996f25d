"""The control requests as the lock core carries them out (docs/scheduler.md; nvsharectl sends
them, control.py turns them into the events SetMode, SetQuantum, SetBudget, SetWeight,
SetPriority, SetLimit and SetAdmission): each is checked before anything changes (ControlError),
then applied to the devices or clients it names, and what follows is settled at once.

Also the one place that tells a client its memory limits (LIMIT, sync_limits), at its
registration and whenever a limit changes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, TypeVar

from .. import protocol
from ..vocabulary import GPU_UUID, MODE
from . import fairshare
from .admission import AdmissionConfig
from .admitting import Admissions
from .core_config import CoreConfig, check_seconds, ms
from .events import (
    Action,
    ControlError,
    LockEvent,
    Log,
    Send,
    SetAdmission,
    SetBudget,
    SetLimit,
    SetMode,
    SetPriority,
    SetQuantum,
    SetWeight,
)
from .lock import Lock
from .records import Client, Device
from .registry import Registry
from .turns import GangTurns


T = TypeVar("T")


def _checked(check: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`check(...)`'s answer; what it refuses (ValueError) is the request's: a bad request."""
    try:
        return check(*args, **kwargs)
    except ValueError as exc:
        raise ControlError("bad-request", str(exc)) from None


def _shown(value: int | None) -> str:
    """A setting as the log shows it: `unset` where it was taken back."""
    return "unset" if value is None else str(value)


class ControlRequests:
    """`budget_changed(device, before, now, out)`: the core's settling of what depends on a
    device's budget, after SetBudget changed it from `before`."""

    def __init__(self, config: CoreConfig, registry: Registry, lock: Lock, turns: GangTurns, admissions: Admissions,
                 budget_changed: Callable[[Device, int, float, list[Action]], None]) -> None:
        self._config = config
        self._registry = registry
        self._lock = lock
        self._turns = turns
        self._admissions = admissions
        self._budget_changed = budget_changed

    # --- device settings ------------------------------------------------------------------

    def _targets(self, device_id: str | None) -> list[Device]:
        """The devices a setting is for: all known ones (None), or the one named. An operator
        may configure a GPU before any client has announced it (a budget set at boot applies to
        the first program), so an unknown device is made when named by its UUID; anything else
        unknown is refused, so that a typo does not configure a device that never comes."""
        if device_id is None:
            return list(self._registry.devices.values())
        dev = self._registry.devices.get(device_id)
        if dev is None:
            # A GPU as the interceptor names it: the only name under which a device nobody has
            # announced yet may be configured.
            if not GPU_UUID.match(device_id):
                raise ControlError("unknown-device", f"no client has announced device {device_id}, and it is not "
                                                     f"a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
            dev = self._registry.device(device_id)
        return [dev]

    def _notify_settings(self, dev: Device, out: list[Action]) -> None:
        """MODE to every client of the device: its mode or quantum changed."""
        notice = protocol.ModeNotice(device=dev.id, mode=dev.mode, quantum_ms=ms(dev.tq))
        out.extend(Send(pair.client.key, notice) for pair in dev.pairs)

    def set_mode(self, ev: SetMode, out: list[Action]) -> None:
        if ev.mode not in MODE:
            raise ControlError("bad-request", f"mode must be {MODE.describe()}, not {ev.mode!r}")
        targets = self._targets(ev.device)
        if ev.device is None:
            self._registry.default_mode = ev.mode
        out.append(Log("info", "mode-set", {"device": ev.device or "", "mode": ev.mode}))
        for dev in targets:
            if dev.mode == ev.mode:
                continue
            dev.mode = ev.mode
            out.append(LockEvent(ev.now, "mode", dev.id, detail=ev.mode))
            self._notify_settings(dev, out)
            self._lock.settle(dev, ev.now, out)
        if ev.device is not None:
            self._lock.forget_if_unused(targets[0])  # set back to the defaults on a device nobody uses

    def set_quantum(self, ev: SetQuantum, out: list[Action]) -> None:
        _checked(check_seconds, "tq", ev.seconds, allow_zero=False)
        targets = self._targets(ev.device)
        if ev.device is None:
            self._registry.default_tq = ev.seconds
        out.append(Log("info", "tq-set", {"device": ev.device or "", "seconds": ev.seconds}))
        for dev in targets:
            if dev.tq == ev.seconds:
                continue
            dev.tq = ev.seconds
            out.append(LockEvent(ev.now, "tq", dev.id, detail=f"{ev.seconds:g}"))
            self._notify_settings(dev, out)
            for pair in dev.holders.values():
                pair.held.contended = False  # the quantum left changed: tell it again
            self._lock.settle(dev, ev.now, out)
        if ev.device is not None:
            self._lock.forget_if_unused(targets[0])

    def set_budget(self, ev: SetBudget, out: list[Action]) -> None:
        budget = ev.budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ControlError("bad-request", f"budget must be a positive number of bytes or null, not {budget!r}")
        (dev,) = self._targets(ev.device)
        before = dev.budget
        dev.budget_override = budget
        detail = "total" if budget is None else str(budget)
        out.append(LockEvent(ev.now, "budget", dev.id, detail=detail))
        out.append(Log("info", "budget-set", {"device": dev.id, "budget": detail}))
        self._budget_changed(dev, before, ev.now, out)
        self._lock.forget_if_unused(dev)

    # --- per-client settings (fairshare.py) ----------------------------------------------

    def _target(self, client: str | None, pod_uid: str | None) -> fairshare.Target:
        """Whom a setting is for; a client must be registered now (its id dies with it)."""
        target = _checked(fairshare.Target, client, pod_uid)
        if client is not None and not any(c.cid == client for c in self._registry.clients.values()):
            raise ControlError("unknown-client", f"no client {client} is registered")
        if pod_uid is not None and (not isinstance(pod_uid, str) or not pod_uid):
            raise ControlError("bad-request", "pod_uid must be a pod's UID")
        return target

    def set_weight(self, ev: SetWeight, out: list[Action]) -> None:
        weight = _checked(fairshare.check_weight, ev.weight)
        target = self._target(ev.client, ev.pod_uid)
        self._registry.settings.weight.set(target, weight, fairshare.DEFAULT_WEIGHT)
        out.append(Log("info", "weight-set", {"target": target.describe(), "weight": _shown(weight)}))
        for dev in list(self._registry.devices.values()):
            self._lock.settle(dev, ev.now, out)  # quanta follow the weights at once

    def set_priority(self, ev: SetPriority, out: list[Action]) -> None:
        priority = _checked(fairshare.check_priority, ev.priority)
        target = self._target(ev.client, ev.pod_uid)
        self._registry.settings.priority.set(target, priority, fairshare.DEFAULT_PRIORITY)
        out.append(Log("info", "priority-set", {"target": target.describe(), "priority": _shown(priority)}))
        for dev in list(self._registry.devices.values()):
            moved = set()
            for pair in dev.queue:
                if pair.gang_queued:
                    klass = self._turns.queue_class(pair.client.gang)
                else:
                    klass = self._registry.priority(pair.client)
                if klass != pair.queued_class:
                    del dev.classes[pair.queued_class][pair]
                    moved.add(klass)
                    pair.queued_class = klass
                    dev.classes[klass][pair] = None
            for klass in moved:  # back into ACQUIRE order
                dev.classes[klass] = OrderedDict.fromkeys(sorted(dev.classes[klass], key=lambda p: p.queued_seq))
            self._lock.settle(dev, ev.now, out)

    def set_limit(self, ev: SetLimit, out: list[Action]) -> None:
        limit = _checked(fairshare.check_limit, ev.limit, protocol.MAX_INT)
        target = self._target(ev.client, ev.pod_uid)
        self._registry.settings.set_limit(target, ev.device, limit)
        out.append(Log("info", "limit-set", {"target": target.describe(), "device": ev.device or "",
                                             "bytes": _shown(limit)}))
        for client in self._registry.clients.values():
            self.sync_limits(client, out)

    def sync_limits(self, client: Client, out: list[Action]) -> None:
        """LIMIT to the client for every resolved limit it was not told: the one for every
        device (no `device`), then each device whose own differs from what the client applies
        to it. So a client knows its limits on devices it has not named yet (docs/protocol.md)."""
        settings = self._registry.settings
        cid, pod_uid = client.cid, client.info.pod_uid
        every = settings.limit_every(cid, pod_uid) or 0
        if every != client.told_every:
            client.told_every = every
            out.append(Send(client.key, protocol.Limit(bytes=every)))
            out.append(Log("info", "limit-sent", {"client": cid, "device": "", "bytes": every}))
        for device in sorted(set(settings.limit_devices()) | set(client.told)):
            limit = settings.limit(cid, pod_uid, device) or 0
            if limit != client.told.get(device, client.told_every):
                client.told[device] = limit
                out.append(Send(client.key, protocol.Limit(bytes=limit, device=device)))
                out.append(Log("info", "limit-sent", {"client": cid, "device": device, "bytes": limit}))

    # --- admission (admitting.py) ---------------------------------------------------------

    def set_admission(self, ev: SetAdmission, out: list[Action]) -> None:
        old = self._admissions.book.config
        spill = old.spill if ev.keep_spill else ev.spill
        if spill == "auto":
            if self._config.auto_spill is None:
                raise ControlError("bad-request", "this scheduler did not measure the host: give the spill in bytes")
            spill = self._config.auto_spill
        policy = old.policy if ev.policy is None else ev.policy
        timeout = old.timeout if ev.timeout is None else ev.timeout
        share = old.share if ev.share is None else ev.share
        new = _checked(AdmissionConfig, spill=spill, policy=policy, timeout=timeout, share=share, seed=old.seed)
        self._admissions.reconfigure(new)
        shown = "off" if spill is None else spill
        out.append(LockEvent(ev.now, "admission", detail=f"spill={shown} policy={policy} timeout={timeout:g} "
                                                         f"share={share:g}"))
        out.append(Log("info", "admission-set", {"spill": shown, "policy": policy, "timeout": timeout,
                                                "share": share}))
        self._admissions.settle(ev.now, out)
