"""Which tenants' memory leaves a device, when, and how much pinned host memory that takes
(issue 29; docs/scheduler.md, "Many tenants"). Pure functions over the core's records;
swapping.py decides when they are asked and sends what they say.

Handoffs alone (residency.py) met memory pressure only when the lock changed hands: a tenant
that grew or loaded beside idle ones left the driver to page those out fault by fault, and every
handoff evicted a slice of everybody, so that every later request paid a swap-in. Here:

- *Pressure is met when it arises.* After anything that changes what the device's clients
  occupy, idle tenants are asked to move out (EVICT) until what stays fits the budget, with room
  for the waiters that are being woken and a *headroom*.
- *Whole tenants, least recently used first.* A victim is asked for all of its swappable memory,
  so a tenant is either resident (its requests are warm) or out (one swap-in brings all of it
  back); the victims are the idle tenants (no grant, not waiting, nothing in flight) in order of
  priority class (the lowest first: a higher class is evicted last), then of use, then the
  larger first. *Of use*: by default (`lru2`) the use before the last one, the least recent
  first, and among equals the last use: a cold tenant that has just served its once-a-minute
  request goes before a hot one asked every second, which plain recency (`lru`, the last use
  alone) would evict for it (LRU-2, O'Neil et al. 1993); for cyclic requests to more tenants
  than fit both orders are the same, and no order helps.
- *A slice where a whole tenant would be too much.* When what is still needed is less than an
  eighth of the next victim's memory, that victim is asked for what is needed alone: on the
  H200 each PyTorch tenant kept some 100 MB that no swap moves, so three hot tenants and a
  whole tenant's headroom came to a few hundred MB over the budget, and taking a whole hot
  tenant for them brought it back at its next request, every second. For the same reason a
  headroom short by less than an eighth of itself is left as it is: a swap-in that shares the
  link with that little loses little.
- *Headroom.* While the device's clients have more memory than its budget (pressure), room for
  one more tenant is kept free when nobody waits, so that the next request's swap-in does not
  share the link with an eviction (two processes' copies of managed memory the opposite ways ran
  at 24 GB/s each on an H200, each alone at 44-52: docs/scheduler.md). `auto`: what the tenant
  with most memory out would bring back, at most a quarter of the budget, and never made of that
  tenant's own memory.
- *Asking is waking.* The waiters are woken in the order they will be served: room is made for
  their memory (idle victims, never another waiter or a holder) and they are told to bring it
  back ahead of their grant (residency.prefetch_ahead), whether the lock is busy or not: the
  next one is granted once its memory is back, and the lock is lent meanwhile to waiters that
  have nothing to move (lock.py, Lock._lend).
- *Pinned memory follows what is out.* The swap pool of a user (or pod), which its processes
  share (docs/interceptor.md, "The swap pool"), is sized to what they have out or are moving out.

Words: a pair *leaves* bytes it was asked to move out and has not been seen moving yet
(`SwapState.leaving`); its *committed* footprint is what it occupies less what leaves
(residency.committed), what the plans count on. Room that is only committed is never handed out
(PREFETCH and grants wait for the reports: residency.occupied).
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Iterable

from .records import Client, Device, Pair
from .residency import committed, converted, excess, movable

# `auto` headroom is at most this share of the budget: on a device whose tenants are each large
# against it, keeping a whole one free would leave too little for the rest.
HEADROOM_SHARE = 4
# A need under 1/SLICE_SHARE of the next victim's memory takes a slice of it, not all of it; a
# headroom short by less than 1/SLICE_SHARE of itself is left as it is.
SLICE_SHARE = 8
# POOL is sent again when what it says moved by this much, or by an eighth (or to or from 0).
POOL_STEP = 512 << 20


def last_used(pair: Pair) -> float:
    """When the pair last ran: now (infinity) while it holds a grant, else when its last grant
    ended (-infinity: never)."""
    return float("inf") if pair.hold is not None else pair.last_held


def idle(pair: Pair) -> bool:
    """Neither holding, nor waiting, nor bringing memory back: a tenant nobody uses now."""
    return pair.hold is None and pair.waiting_since is None and not pair.overdue and not pair.swap.allowed


def ran(pair: Pair) -> bool:
    """Whether the pair ever held the device (or asks for it now). One that never did has only
    allocated: its memory is counted (room for it is needed when it runs), but no page of it is
    on the card yet, so it presses on nobody and moving it out would copy nothing of worth."""
    return pair.grants > 0 or pair.waiting_since is not None


def under_pressure(dev: Device) -> bool:
    """Whether the device's clients have allocated more than its budget: then somebody's memory
    must be out, and the headroom is kept (memory that fits never moves)."""
    return dev.budget > 0 and dev.mode != "off" and dev.used > dev.budget


def headroom(dev: Device, setting: int | None) -> tuple[int, Pair | None]:
    """Bytes kept free under pressure while nobody waits, and the tenant they are for (None:
    any): `setting`, or with None (`auto`) room for the tenant with most memory out to come
    back whole, at most 1/HEADROOM_SHARE of the budget. Never made by evicting that tenant
    itself: moving part of a tenant out so that it can come back costs two moves for nothing."""
    if not under_pressure(dev):
        return 0, None
    if setting is not None:
        return min(setting, dev.budget), None
    out = [pair for pair in dev.pairs if pair.swapped > 0 and idle(pair)]  # not on its way back already
    if not out:
        return 0, None
    largest = max(out, key=lambda pair: pair.swapped)
    return min(largest.swapped, dev.budget // HEADROOM_SHARE), largest


def wanted_back(waiter: Pair) -> int:
    """The bytes a waiter still has to bring back beyond what it was allowed already."""
    if waiter.resident is None:
        return 0
    return max(0, converted(waiter) - max(waiter.resident, waiter.swap.allowed))


ORDERS = ("lru2", "lru")


def order_key(pair: Pair, klass: int, order: str) -> tuple[float, ...]:
    """Where a pair of priority class `klass` stands in eviction order (the smallest goes
    first): its class, its use (ORDERS: the use before the last one, then the last; or the last
    alone; a holder's last use is now), then the larger first."""
    last = last_used(pair)
    used = ((pair.last_held if pair.hold is not None else pair.held_before), last) if order == "lru2" else (last,)
    return (klass, *used, -movable(pair))


def behind_once_back(out: Pair, first: Pair, klass_out: int, klass_first: int, order: str, now: float) -> bool:
    """Whether `out`, a tenant whose memory is out, would stand behind `first` (the first idle
    tenant in eviction order) once it has come back and served, so that the headroom restored
    after its return would take `first`. By last use (`lru`) the tenant back is the most recent.
    By the use before the last (`lru2`), its last use becomes that; it comes back, as far as its
    last two uses tell, as long after its last as it came after the one before (now at the
    earliest; now if it ran once), and `first` goes on running as often as it has meanwhile. A
    cold tenant that has just served and left again thus stays behind no tenant that runs more
    often: on an H200 (three tenants asked every second, three every 20 s) one asked every
    second was told to register segments while each cold tenant left, as if that one were back
    at once, and its requests waited for the registrations (max 0.12 s against 20 ms without
    nvshare)."""
    if klass_out != klass_first:
        return klass_out > klass_first
    if order != "lru2":
        return True
    back_at = now if out.held_before == -math.inf else max(now, 2 * out.last_held - out.held_before)
    first_before_then = max(first.held_before, back_at - (first.last_held - first.held_before))
    return out.last_held > first_before_then


def victims(dev: Device, key: Callable[[Pair], tuple[float, ...]]) -> list[Pair]:
    """The idle pairs with swappable memory that is not leaving already, in eviction order
    (`key`: order_key with the pair's class and the configured order)."""
    candidates = [pair for pair in dev.pairs if idle(pair) and ran(pair) and movable(pair) > pair.swap.leaving]
    return sorted(candidates, key=key)


def asked_of(available: int, need: int, most_recent: bool) -> int:
    """What a victim with `available` bytes to move is asked for when `need` bytes are wanted:
    all of it, or `need` alone when that is under an eighth of it (SLICE_SHARE); the most
    recently used idle tenant (the last holder, back soon) never more than `need`, as a holder
    at its DROP (residency.evict_on_drop)."""
    if most_recent or need < available // SLICE_SHARE:
        return min(need, available)
    return available


def pressure_plan(dev: Device, woken: Iterable[Pair], room: int, room_for: Pair | None,
                  key: Callable[[Pair], tuple[float, ...]]) -> list[tuple[Pair, int, str]]:
    """EVICTs (pair, bytes, why) that keep the device's committed memory within its budget,
    with room for the memory of the woken waiters and `room` more (the headroom, which is not
    made of `room_for`'s own memory): whole idle tenants in eviction order. `why` is what the
    timeline says: `pressure` (what the clients keep is over the budget), `wake` (room for a
    waiter's memory) or `headroom`.

    Pressure is what the tenants that ran keep on the device: one that has only allocated presses
    on nobody yet (its room is made when it runs: room_plan). Pressure and waking cannot wait:
    whole idle tenants in eviction order, except that the most recently used of them gives only
    what is needed, as in room_plan (two training jobs taking turns: the one that has just
    released is back within a step, and moving all of it out doubled what a handoff moved).
    The headroom can wait: a holder that comes before every idle
    tenant in eviction order (the cold tenant that is serving its rare request) is waited for,
    and goes when it is idle, rather than a tenant that is used more often; the rest of the most
    recent one stands in that order like any idle tenant."""
    budget = dev.budget
    if budget <= 0 or dev.mode == "off":
        return []
    held = sum(committed(pair) for pair in dev.pairs if ran(pair))
    wanted = sum(wanted_back(waiter) for waiter in woken)
    over = held - budget
    urgent = over + wanted
    plan: list[tuple[Pair, int, str]] = []
    idle_ones = victims(dev, key)
    latest = max(idle_ones, key=last_used, default=None)
    left = {pair: movable(pair) - pair.swap.leaving for pair in idle_ones}
    while urgent > 0 and idle_ones:
        pair = idle_ones.pop(0)
        amount = asked_of(left[pair], urgent, pair is latest)
        plan.append((pair, amount, "pressure" if over > 0 else "wake"))
        left[pair] -= amount
        urgent -= amount
        over -= amount
    spare = room + min(0, urgent)
    if spare <= room // SLICE_SHARE:
        return plan
    if latest is not None and latest not in idle_ones and left[latest] > 0:
        idle_ones.append(latest)
    holders = [pair for pair in dev.pairs if pair.hold is not None and movable(pair) > 0]
    for pair in sorted(idle_ones + holders, key=key):
        if spare <= room // SLICE_SHARE or pair.hold is not None:
            break
        if pair is not room_for:
            plan.append((pair, left[pair], "headroom"))
            spare -= left[pair]
    return plan


def room_plan(dev: Device, grantee: Pair, asked: Iterable[Pair], key: Callable[[Pair], tuple[float, ...]],
              later_first: Iterable[Pair]) -> list[tuple[Pair, int]]:
    """EVICTs that cover what still keeps `grantee`, the next to be granted, out (the grant
    waits for their answers, residency.excess): whole idle tenants in eviction order, except
    that the most recently used of them (the last holder, as a rule) is asked only for what is
    still needed, as a holder is at its DROP (residency.evict_on_drop); then, if that is not
    enough, as much as is needed of the other waiters, the last to be served first
    (`later_first`); none already asked in this wait."""
    need = excess(dev, grantee, planned=True)
    asked = set(asked)
    plan: list[tuple[Pair, int]] = []
    idle_ones = victims(dev, key)
    latest = max(idle_ones, key=last_used, default=None)
    for pair in idle_ones:
        if need <= 0:
            return plan
        if pair not in asked:
            amount = asked_of(movable(pair) - pair.swap.leaving, need, pair is latest)
            plan.append((pair, amount))
            need -= amount
    for pair in later_first:
        if need <= 0:
            break
        amount = min(movable(pair) - pair.swap.leaving, need)
        if pair is not grantee and pair.hold is None and pair not in asked and amount > 0:
            plan.append((pair, amount))
            need -= amount
    return plan


def pool_targets(devices: Iterable[Device], principal: Callable[[Client], Hashable]) -> dict[Hashable, int]:
    """The swap pool each principal (a pod, else a user) needs: what its processes have moved out
    on any device, or are moving out (EVICT asked, a holder's announced eviction), and at least,
    on a device under pressure, what must be out there once it settles (its clients' memory over
    the budget, and the headroom), as far as the principal's own memory goes: so that the pool
    grows while tenants load, ahead of the evictions that will need it. Bytes: the pool rounds
    them up to its segments, one more for each of its processes (docs/interceptor.md, *The swap
    pool*). Only principals with a client that swaps are named."""
    out: dict[Hashable, int] = {}
    for dev in devices:
        moving: dict[Hashable, int] = {}
        swappable: dict[Hashable, int] = {}
        for pair in dev.pairs:
            if pair.resident is None:
                continue
            owner = principal(pair.client)
            announced = pair.hold.told_swap[0] if pair.hold is not None else 0
            moving[owner] = moving.get(owner, 0) + pair.swapped + max(pair.swap.leaving, announced)
            swappable[owner] = swappable.get(owner, 0) + converted(pair)
        settled = dev.used - dev.budget + dev.headroom if under_pressure(dev) else 0
        for owner in moving:
            out[owner] = out.get(owner, 0) + max(moving[owner], min(swappable[owner], settled))
    return out


def exposure(dev: Device, key: Callable[[Pair], tuple[float, ...]],
             behind: Callable[[Pair, Pair], bool]) -> dict[Pair, int]:
    """What each pair may be asked to move out soon (POOL need=): under pressure, the pairs
    moving out, and the idle tenants first in eviction order as far as what must still leave for
    the device to settle goes, or, if more, the largest tenant's memory: the headroom restored
    after a tenant comes back into it, whatever is leaving now (on an H200, counting what left
    for the device to settle as that headroom kept the next victim from registering ahead, and
    its eviction for the headroom registered everything on its path). That one is needed only if
    a tenant that is out would stand behind the first idle tenant in eviction order once back
    (`behind`: behind_once_back); where every tenant out would come first itself (cold tenants
    beside hot ones: lru2), it leaves again and none of the resident ones is asked. All of their
    swappable memory each (on the device or out: an eviction's progress does not change it, so
    POOL is not sent again for every block moved). A holder stands where it will once it releases
    (order_key: its use before the last is its previous grant): a cold tenant serving its rare
    request is the one to leave after it, not the hot tenant behind it in order (told so on an
    H200 while each cold request was served); a holder asked for part of its memory at its DROP
    registers what it lacks on the swap's path. Nothing leaves a device that is not under
    pressure. A member of a pool registers segments others made only for that much
    (docs/interceptor.md, *The pool*): a registration holds up its process's GPU calls, and on
    an H200 hot tenants late in eviction order, asked every second, registered the segments cold
    tenants freed while serving, their requests waiting 35-60 ms where they took 20 ms without
    nvshare."""
    if not under_pressure(dev):
        return {}
    settling = sum(committed(pair) for pair in dev.pairs) - (dev.budget - dev.headroom)
    order = victims(dev, key)
    returning = [pair for pair in dev.pairs if pair.swapped > 0 and pair.hold is None]
    headroom_next = (max((converted(pair) for pair in dev.pairs), default=0)
                     if order and any(behind(pair, order[0]) for pair in returning) else 0)
    cover = max(headroom_next, settling)
    exposed = {pair: converted(pair) for pair in dev.pairs if pair.swap.leaving > 0}
    holders = [pair for pair in dev.pairs if pair.hold is not None and movable(pair) > pair.swap.leaving]
    for pair in sorted(order + holders, key=key):
        if cover <= 0:
            break
        exposed[pair] = converted(pair)
        cover -= movable(pair)
    return exposed


def pool_due(told: int, target: int) -> bool:
    """Whether a pool's size changed enough to be told again: by POOL_STEP or an eighth, or to or
    from 0 (every MEMORY report moves what is out by a little)."""
    change = abs(target - told)
    return target != told and (told == 0 or target == 0 or change >= min(POOL_STEP, max(told, target) // 8))
