"""The lock core's side of admission (admission.py decides): a client's ADMIT asked, ADMITTED and
REFUSED answered with their timeline events and log lines, and the node's capacity kept in step
with the devices' budgets and the operator's spill. The core (core.py) calls it where a client
asks, reports its memory or leaves, where a budget changes and at every tick; views.py reads the
book (`Admissions.book`).
"""

from __future__ import annotations

from .. import protocol
from .admission import Admit, AdmissionBook, AdmissionConfig, Decision, Refuse, Waiter
from .events import Action, AdmitRequest, LockEvent, Log, Send
from .records import Device, Pair


class Admissions:
    """The admission book of every pair, and the sum of the devices' budgets (known ones): the
    capacity less the spill."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.book: AdmissionBook[Pair] = AdmissionBook(config)
        self._budgets = 0
        self.book.set_capacity(config.spill or 0)

    def report(self, pair: Pair, used: int) -> None:
        """The pair uses `used` bytes (MEMORY), which count up to the device's size."""
        self.book.report(pair, pair.client.principal, min(used, pair.device.size))

    def budget_changed(self, dev: Device, before: int) -> None:
        """A device's budget changed from `before`: the capacity follows, and the uses on the
        device count up to its size again (which may have changed)."""
        self._budgets += dev.budget - before
        self.book.set_capacity(self._budgets + (self.book.config.spill or 0))
        for pair in dev.pairs:
            if pair.used:
                self.report(pair, pair.used)

    def reconfigure(self, config: AdmissionConfig) -> None:
        """The operator's new policy and spill (`set-admission`): the capacity follows."""
        self.book.reconfigure(config)
        self.book.set_capacity(self._budgets + (config.spill or 0))

    def ask(self, pair: Pair, ev: AdmitRequest, limit: int | None, out: list[Action]) -> None:
        """ADMIT: answered now where it can be, else it waits (settle answers it later)."""
        if ev.request and limit is not None and ev.bytes > limit:
            # Past the operator's limit: no wait can change that (docs/protocol.md, REFUSED).
            self._answer(Refuse(Waiter(pair, ev.request, ev.bytes, ev.now, 0), "limit"),
                         ev.now, out)
            return
        waiter = self.book.ask(pair, pair.client.principal, ev.request, ev.bytes, ev.now)
        self.settle(ev.now, out)
        if waiter is not None and ev.request and pair in self.book.waiters:
            out.append(LockEvent(ev.now, "admit-wait", ev.device, pair.client.cid, detail=str(ev.bytes)))
            out.append(Log("info", "admission-waits", {"client": pair.client.cid, "device": ev.device,
                                                      "bytes": ev.bytes, "capacity": self.book.capacity}))

    def settle(self, now: float, out: list[Action]) -> None:
        """Answer the admission questions that can be answered now (cheap when none can)."""
        for decision in self.book.settle(now):
            self._answer(decision, now, out)

    def _answer(self, decision: Decision[Pair], now: float, out: list[Action]) -> None:
        waiter = decision.waiter
        pair = waiter.pair
        cid, device_id = pair.client.cid, pair.device.id
        waited = now - waiter.since
        if isinstance(decision, Admit):
            out.append(Send(pair.client.key, protocol.Admitted(device=device_id, request=waiter.request,
                                                               bytes=decision.total)))
            if waited > 0:
                out.append(LockEvent(now, "admitted", device_id, cid, detail=f"{decision.total} after {waited:.3f}s"))
            return
        out.append(Send(pair.client.key, protocol.Refused(device=device_id, request=waiter.request,
                                                          reason=decision.reason)))
        out.append(LockEvent(now, "refused", device_id, cid, detail=f"{waiter.bytes} {decision.reason}"))
        out.append(Log("warning", "admission-refused", {"client": cid, "device": device_id, "bytes": waiter.bytes,
                                                      "reason": decision.reason,
                                                      "capacity": self.book.capacity}))
