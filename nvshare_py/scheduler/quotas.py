"""What the registrations of one principal may make the lock core keep: (client, device)
pairs and distinct device ids (docs/scheduler.md, *What a registration costs*).

The core bounds one registration (protocol.MAX_DEVICES devices); this bounds what one user's
many registrations add up to, so that a user at its connection limit cannot make the daemon
hold more than a known amount: every device id a client names makes the core keep a pair
(about 1.4 KiB) and, for an id nobody used before, a device (about 2.2 KiB more). Sans-I/O:
the daemon asks before it feeds the core an event that names a device, and says when a
registration ended.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable

from .. import protocol

# A principal's registrations together: (client, device) pairs, and distinct device ids.
PAIRS_PER_PRINCIPAL = 512
DEVICES_PER_PRINCIPAL = protocol.MAX_DEVICES


class _Holder:
    __slots__ = ("pairs", "devices")

    def __init__(self) -> None:
        self.pairs = 0
        self.devices: collections.Counter[str] = collections.Counter()  # device -> registrations naming it


class DeviceQuota:
    def __init__(self, pairs: int = PAIRS_PER_PRINCIPAL, devices: int = DEVICES_PER_PRINCIPAL) -> None:
        self.pairs = pairs
        self.devices = devices
        self._named: dict[Hashable, tuple[Hashable, set[str]]] = {}  # registration -> (principal, devices)
        self._holders: dict[Hashable, _Holder] = {}

    def admit(self, registration: Hashable, principal: Hashable, devices: Iterable[str]) -> str | None:
        """Count `devices` as named by `registration` (of `principal`); the reason when that
        would pass the principal's quota, in which case nothing is counted."""
        named = self._named.get(registration)
        known = named[1] if named is not None else set()
        new = {device for device in devices if device not in known}
        if not new:
            return None
        holder = self._holders.get(principal) or _Holder()
        if holder.pairs + len(new) > self.pairs:
            return f"the clients of one user may use at most {self.pairs} (client, device) pairs together"
        unseen = sum(1 for device in new if device not in holder.devices)
        if len(holder.devices) + unseen > self.devices:
            return f"the clients of one user may use at most {self.devices} devices together"
        self._holders[principal] = holder
        if named is None:
            self._named[registration] = (principal, new)
        else:
            known |= new
        holder.pairs += len(new)
        holder.devices.update(new)
        return None

    def forget(self, registration: Hashable) -> None:
        """The registration ended: what it named no longer counts."""
        named = self._named.pop(registration, None)
        if named is None:
            return
        principal, devices = named
        holder = self._holders[principal]
        holder.pairs -= len(devices)
        holder.devices.subtract(devices)
        for device in devices:
            if not holder.devices[device]:
                del holder.devices[device]
        if not holder.pairs:
            del self._holders[principal]

    def held(self, principal: Hashable) -> tuple[int, int]:
        """(pairs, distinct devices) counted for `principal`."""
        holder = self._holders.get(principal)
        return (holder.pairs, len(holder.devices)) if holder is not None else (0, 0)
