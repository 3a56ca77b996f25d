"""The lock core's swapping: when it asks the residency rules (residency.py) and the eviction rules
(eviction.py), and what it sends of their answers (docs/scheduler.md, "Budgets and swapping" and
"Many tenants"): EVICT to make room before a grant, to relieve memory pressure and to wake waiters;
PREFETCH, a waiter's memory back ahead of its grant; POOL and PREPARE, the pinned host memory the
swaps need; and the figures a holder's DROP and CONTENDED carry.

The lock (lock.py) calls it at the moments of its rules (a grant, a drop, a device settled), the
core (core.py) after anything that changes what is out; nothing here grants, queues or drops.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable

from .. import protocol
from . import eviction, residency
from .admitting import Admissions
from .core_config import CoreConfig, ms
from .events import Action, LockEvent, Log, Send
from .queue_order import next_other_waiter, service_order
from .records import Device, Pair
from .registry import Registry

# How long a user's swap pool keeps its size after what it must hold fell below it, before it
# shrinks (eviction.py): a tenant's swap-in frees its part of the pool a moment before the
# eviction that restores the headroom needs it again, and pinning it anew each time would cost
# seconds of every process's time.
POOL_SHRINK_AFTER = 30.0


def end_eviction_wait(dev: Device) -> None:
    """The device's wait for room ends: EVICTED answers that come later only update what the
    clients keep resident."""
    dev.evict_asked.clear()
    dev.evict_awaited.clear()
    dev.evict_deadline = None
    dev.evict_for = None


class Swapping:
    """The swap pool of each principal (eviction.py): the size its clients were told, and since
    when what it must hold has been below that (None: not below)."""

    def __init__(self, config: CoreConfig, registry: Registry, admissions: Admissions) -> None:
        self._config = config
        self._registry = registry
        self._admissions = admissions
        self._pools: dict[Hashable, tuple[int, float | None]] = {}

    def next_deadline(self) -> float | None:
        """When a swap pool that is larger than it must be shrinks."""
        shrinks = [below + POOL_SHRINK_AFTER for _, below in self._pools.values() if below is not None]
        return min(shrinks, default=None)

    def pool_sizes(self) -> dict[Hashable, int]:
        """The swap pools' sizes by principal, for views.py."""
        return {owner: told for owner, (told, _) in self._pools.items()}

    # --- a handoff ------------------------------------------------------------------------

    def room_made(self, dev: Device, pair: Pair, now: float, out: list[Action]) -> bool:
        """Whether `pair`, the next waiter, may be granted now as far as residency goes.
        While its memory would not fit beside what the others keep resident, idle clients are
        asked to EVICT (eviction.room_plan) and the grant waits for their EVICTED answers,
        at most the grace: then it proceeds with a warning, as it does at once when nothing
        that could move is left to ask (the driver's faults then share the device). A waiter
        whose memory is all on the device, and fits once the moves asked for are done, waits for
        none of them (residency.runs_in_place)."""
        if (self._config.swapping and dev.mode != "off" and residency.excess(dev, pair) > 0
                and not residency.runs_in_place(dev, pair)):
            if dev.evict_deadline is not None and now >= dev.evict_deadline:
                out.append(Log("warning", "evict-timeout", {
                    "device": dev.id, "client": pair.client.cid,
                    "silent": ",".join(other.client.cid for other in dev.evict_awaited)}))
            else:
                later_first = reversed(service_order(dev, self._config.ageing))
                for other, amount in eviction.room_plan(dev, pair, dev.evict_asked, self._evict_order, later_first):
                    dev.evict_asked[other] = amount
                    dev.evict_awaited[other] = None
                    other.swap.for_grant = True
                    self._evict(other, amount, f"room for={pair.client.cid}", now, out)
                # Moves asked for earlier (pressure, waking) are waited for as well.
                for other in dev.pairs:
                    if other.swap.leaving and other not in dev.evict_asked:
                        dev.evict_asked[other] = other.swap.leaving
                        dev.evict_awaited[other] = None
                if dev.evict_awaited:
                    if dev.evict_deadline is None:
                        dev.evict_deadline = now + self._config.grace
                    dev.evict_for = pair
                    return False
        end_eviction_wait(dev)
        return True

    def restores_first(self, pair: Pair, now: float) -> bool:
        """Whether `pair`, the next waiter, room made for it, brings its memory back before it is
        granted (PREFETCH: prefetch_ahead) rather than under its grant, whose gate stays closed
        until it is back. Then the lock is lent meanwhile to waiters that are ready (lock.py,
        Lock._lend): in mode on, a tenant asked every second waited for a cold one's whole
        swap-in (0.5 s for 20 GiB on an H200) though nothing of its own had to move. Until its
        `restore_by`: the grace, plus what its memory takes at its measured pace, after it was
        first asked, so that a client that does not act on PREFETCH, or whose last bytes cannot
        come back ahead, is granted all the same. What is nearly back is granted (the rest comes
        back under the grant: residency.nearly_back)."""
        dev = pair.device
        if (not self._config.swapping or dev.mode == "off" or dev.budget <= 0 or pair.resident is None
                or pair.gang_queued or residency.nearly_back(pair)):
            return False
        if pair.swap.restore_by is None:
            pace = pair.swapped / pair.swap.in_bps if pair.swap.in_bps else 0.0
            pair.swap.restore_by = now + self._config.grace + pace
        if now < pair.swap.restore_by:
            return True
        pair.swap.restore_by = -math.inf  # ran out in this wait: no timer for it any more
        return False

    @staticmethod
    def room_ready(dev: Device, now: float) -> bool:
        """Whether the device waits for no EVICTED answer any more (room_made would decide now),
        or has waited for them as long as it does."""
        return not dev.evict_awaited or (dev.evict_deadline is not None and now >= dev.evict_deadline)

    def ready(self, dev: Device, pair: Pair) -> bool:
        """Whether the waiter `pair` may run without any memory moving for it: nothing of its own
        out or leaving, and room for all of it beside what the others occupy."""
        if not self._config.swapping or dev.mode == "off":
            return True
        nothing_out = pair.resident is None or (residency.nearly_back(pair) and not pair.swap.leaving)
        return nothing_out and (residency.excess(dev, pair) <= 0 or residency.runs_in_place(dev, pair))

    def granted(self, pair: Pair) -> tuple[int, int, int]:
        """The pair is granted its device: (prefetch, swapped, over). `prefetch`: what GRANT
        tells it to bring back at once; `swapped`: what it still has to bring back before its
        gate opens (the rest came in ahead of the grant, behind the holder's swap-out);
        `over`: by how much the grant exceeds the budget."""
        dev = pair.device
        # An EVICT still pending is moot now: a client granted the device keeps what it has
        # (it answers EVICTED with it), and its memory is no room for anyone.
        pair.swap.leaving = 0
        pair.swap.for_grant = False
        prefetch = residency.prefetch_on_grant(dev, pair) if self._config.swapping else 0
        # The grant brings the rest back: until the grantee says it has, all of it counts as in
        # flight (nobody else is let into its room meanwhile).
        pair.swap.allowed = residency.converted(pair) if pair.resident is not None and pair.swapped else 0
        # Made while the budget is exceeded (a holder or an EVICT did not answer within the
        # grace, or nothing more could move): the event says by how much.
        over = max(0, residency.excess(dev, pair)) if self._config.swapping and dev.mode != "off" else 0
        swapped = pair.swapped if pair.swap.allowed else 0
        return prefetch, swapped, over

    def evict_on_drop(self, pair: Pair) -> int:
        """DROP's `evict=` for the holder `pair`: room for the queue's head (residency.py)."""
        if not self._config.swapping or pair.held.reason == "conflict":  # a refused claim holds nothing
            return 0
        return residency.evict_on_drop(pair.device, pair, next_other_waiter(pair, self._config.ageing))

    def contended_swap(self, pair: Pair) -> tuple[int, int]:
        """CONTENDED's evict= and idle_ms= for the holder `pair` (residency.py). Without swapping
        nothing of the holder's moves: its pauses are worth nothing to it."""
        free_ms = ms(self._config.idle_release_contended)
        grantee = next_other_waiter(pair, self._config.ageing)
        if not self._config.swapping:
            return (0, residency.free_idle_ms(pair, free_ms) if grantee is not None else 0)
        return (self.evict_on_drop(pair), residency.idle_ms(pair.device, pair, grantee, free_ms))

    # --- a device settled -----------------------------------------------------------------

    def relieve_pressure(self, dev: Device, now: float, out: list[Action]) -> None:
        """Idle tenants moved out, whole and least recently used first, when what the device's
        clients keep is over its budget, or leaves no room for the waiters being woken or for
        the headroom (eviction.pressure_plan)."""
        if not self._config.swapping or not eviction.under_pressure(dev):
            dev.headroom = 0
            return  # memory that fits never moves
        woken = self._woken(dev)
        dev.headroom, room_for = eviction.headroom(dev, self._config.headroom)
        # The headroom is for the next request: it is made while nobody waits and no swap-in
        # runs, so that its eviction never shares the link with memory on its way in.
        quiet = not woken and not any(pair.swap.allowed for pair in dev.pairs)
        for victim, amount, why in eviction.pressure_plan(dev, woken, dev.headroom if quiet else 0, room_for,
                                                          self._evict_order):
            whom = f" for={woken[0].client.cid}" if why == "wake" else ""
            self._evict(victim, amount, f"{why}{whom}", now, out)

    def prefetch_ahead(self, dev: Device, now: float, out: list[Action]) -> None:
        """PREFETCH to the woken waiters, in the order they will be served: room others made (or
        that was free) each may fill with its swapped-out memory while it waits, so that its
        gate opens sooner after the grant (residency.prefetch_ahead). A waiter served later gets
        room only once the ones before it have all theirs. The event says also how many bytes more
        than before it may bring back (`bytes=`: what the metrics count as asked to move in)."""
        if not self._config.swapping or dev.mode == "off":
            return
        for waiter in self._woken(dev):
            allowed = residency.prefetch_ahead(dev, waiter)
            if allowed:
                more = allowed - max(waiter.resident or 0, waiter.swap.allowed)
                waiter.swap.allowed = allowed
                out.append(Send(waiter.client.key, protocol.Prefetch(device=dev.id, resident=allowed)))
                out.append(LockEvent(now, "prefetch", dev.id, waiter.client.cid,
                                     detail=f"resident={allowed} bytes={max(0, more)}"))
                out.append(Log("debug", "prefetch-ahead", {"client": waiter.client.cid, "device": dev.id,
                                                           "resident": allowed}))
            if eviction.wanted_back(waiter) > 0:
                break

    def take_back_eviction(self, pair: Pair, now: float, out: list[Action]) -> None:
        """ACQUIRE from a pair whose memory moves out for an EVICT: it was idle when chosen, and
        its ACQUIRE crossed the EVICT (four tenants asked at once on an H200, and the one chosen a
        millisecond before its ACQUIRE arrived waited 1.4 s for its 18 GB to leave, then for them
        to come back). Victims are idle tenants (eviction.py), so the EVICT is taken back: a
        PREFETCH of what is on the device (the client stops the move after the pieces in flight,
        answers EVICTED with what stayed, and brings back what left meanwhile), and what was
        counted as leaving is no longer room for anyone; others are asked instead. Not an EVICT
        that makes room for the waiter granted next (`for_grant`): that grant waits for it, and
        the waiter keeps its turn (issue 20: a holder that released and asked again at once was
        granted while its memory moved out for nobody)."""
        if not self._config.swapping or not pair.swap.leaving or pair.swap.for_grant or pair.resident is None:
            return
        keep = max(pair.resident, pair.swap.allowed)
        pair.swap.leaving = 0
        pair.swap.allowed = keep
        dev = pair.device
        out.append(Send(pair.client.key, protocol.Prefetch(device=dev.id, resident=keep)))
        out.append(LockEvent(now, "prefetch", dev.id, pair.client.cid, detail=f"resident={keep} bytes=0"))
        out.append(Log("debug", "evict-taken-back", {"client": pair.client.cid, "device": dev.id, "resident": keep}))

    def _woken(self, dev: Device) -> list[Pair]:
        """The waiters whose memory comes back ahead of their grant (asking is waking,
        eviction.py): in service order, up to the first that holds a grant (a draining holder
        that asked again). Gangs wait for their turn as a whole: none of them is woken early."""
        woken = []
        for waiter in service_order(dev, self._config.ageing):
            if waiter.hold is not None or waiter.gang_queued:
                break
            woken.append(waiter)
        return woken

    def _evict_order(self, pair: Pair) -> tuple[float, ...]:
        """Where an idle pair stands in eviction order (eviction.order_key): a higher priority
        class later, then by use."""
        return eviction.order_key(pair, self._registry.priority(pair.client), self._config.eviction_order)

    def _behind_once_back(self, now: float) -> Callable[[Pair, Pair], bool]:
        """Whether a pair that is out would stand behind another in eviction order once back, as
        of `now` (eviction.behind_once_back, with each one's priority class)."""
        def behind(out: Pair, first: Pair) -> bool:
            return eviction.behind_once_back(out, first, self._registry.priority(out.client),
                                             self._registry.priority(first.client), self._config.eviction_order, now)
        return behind

    def _evict(self, pair: Pair, amount: int, why: str, now: float, out: list[Action]) -> None:
        """EVICT `amount` bytes of `pair`, and the timeline says why it was chosen."""
        pair.swap.leaving += amount
        dev = pair.device
        idle_for = f" idle={now - pair.last_held:.1f}s" if pair.last_held > -math.inf else " idle=never-ran"
        detail = f"bytes={amount} reason={why} class={self._registry.priority(pair.client)}{idle_for}"
        out.append(Send(pair.client.key, protocol.Evict(device=dev.id, bytes=amount)))
        out.append(LockEvent(now, "evict", dev.id, pair.client.cid, detail=detail))
        out.append(Log("debug", "evict-asked", {"client": pair.client.cid, "device": dev.id, "bytes": amount,
                                                "why": why}))

    # --- pinned host memory ---------------------------------------------------------------

    def size_swap_space(self, now: float, out: list[Action]) -> None:
        """The swap pools (POOL) and, for processes without one, their private areas (PREPARE)."""
        self._size_pools(now, out)
        self._prepare_areas(out)

    def _size_pools(self, now: float, out: list[Action]) -> None:
        """POOL to every client whose principal's swap pool changed size (eviction.pool_targets,
        by enough: eviction.pool_due): it grows at once, and shrinks once what it must hold has
        been below its size for POOL_SHRINK_AFTER; and to a client whose need= (what it may be
        asked to move out soon: eviction.exposure) moved by as much."""
        if not self._config.swapping:
            return
        targets = eviction.pool_targets(self._registry.devices.values(), lambda client: client.principal)
        for owner in self._pools.keys() - targets.keys():
            targets[owner] = 0
        for owner, target in targets.items():
            told, below = self._pools.get(owner, (0, None))
            if target >= told:
                below = None
                if eviction.pool_due(told, target):
                    told = target
            elif below is None:
                below = now
            elif now - below >= POOL_SHRINK_AFTER:
                below = None
                if eviction.pool_due(told, target):
                    told = target
            if told or below is not None:
                self._pools[owner] = (told, below)
            else:
                self._pools.pop(owner, None)
        need: dict[Hashable, int] = {}
        for dev in self._registry.devices.values():
            for pair, exposed in eviction.exposure(dev, self._evict_order, self._behind_once_back(now)).items():
                need[pair.client.key] = need.get(pair.client.key, 0) + exposed
        for client in self._registry.clients.values():
            size = self._pools.get(client.principal, (0, None))[0]
            wants = need.get(client.key, 0) if size else None
            told_need = client.told_pool_need
            need_moved = wants != told_need and (wants is None or told_need is None
                                                 or eviction.pool_due(told_need, wants))
            if size != client.told_pool or need_moved:
                client.told_pool = size
                client.told_pool_need = wants
                out.append(Send(client.key, protocol.Pool(bytes=size, need=wants)))
                out.append(Log("debug", "pool", {"client": client.cid, "bytes": size, "need": wants}))

    def _prepare_areas(self, out: list[Action]) -> None:
        """PREPARE to the clients whose swap area should change (residency.area_targets)."""
        if not self._config.swapping:
            return
        targets = residency.area_targets(self._registry.devices.values(), self._admissions.book.config.spill)
        for dev in self._registry.devices.values():
            for pair in dev.pairs:
                target = targets.get(pair, 0)
                if residency.prepare_due(pair, target):
                    pair.swap.prepared = target
                    out.append(Send(pair.client.key, protocol.Prepare(device=dev.id, bytes=target)))
                    out.append(Log("debug", "prepare", {"client": pair.client.cid, "device": dev.id, "bytes": target}))
