"""Residency rules of the lock core: how much memory moves at a handoff (docs/scheduler.md,
"Budgets and swapping"). Pure functions over the core's pairs and devices; core.py decides when
they are asked and carries out what they say.

What the scheduler knows of a pair (one client on one device):
- `used`: MEMORY.used, all the client's allocations on the device (converted and unconverted);
- `resident`: the latest `resident=` the client reported (MEMORY, RELEASE, EVICTED): its
  converted bytes it believes are on the device; None while it never reported one (a client
  that does not swap: nothing of it is ever asked to move);
- `swapped`: bytes the scheduler saw it move to the host (drops of `resident` that a free does
  not explain) and not yet bring back.

A pair's *footprint*, what it occupies of the device now, is `used - swapped`: unconverted
allocations can never move and count in full, and a client that reports no residency counts
with all it allocated. The budget holds the footprints of a device's clients. When the lock
passes to a *grantee*, it wants all of its memory back (`used`, at most the budget); the
*excess* is what the others' footprints leave short of that.
"""

from __future__ import annotations

from typing import Iterable


def footprint(pair) -> int:
    """Bytes the pair occupies on the device now."""
    return max(0, pair.used - pair.swapped)


def movable(pair) -> int:
    """Bytes the pair could move to the host if asked: its converted memory on the device."""
    return pair.resident or 0


def excess(dev, grantee) -> int:
    """Bytes by which the device's budget falls short when `grantee` brings all its memory back
    while every other client keeps what it has; <= 0 when it fits. An unknown budget (0: the
    clients disagree on the device's size and none was set) moves nothing."""
    budget = dev.budget
    if budget <= 0:
        return 0
    wanted = min(grantee.used, budget)
    # Every footprint is at most its `used`, whose sum the device keeps: when even that fits,
    # the answer needs no walk over the clients (every handoff asks, most of them fit).
    bound = dev.used - footprint(grantee) + wanted - budget
    if bound <= 0:
        return bound
    others = sum(footprint(pair) for pair in dev.pairs if pair is not grantee)
    return others + wanted - budget


def evict_on_drop(dev, holder, grantee) -> int:
    """DROP's `evict=`: what `holder` moves out before its release so that `grantee` fits.

    Exactly the excess, never more: memory the holder keeps resident is memory it need not
    bring back at its next turn (a move each way costs about 8 GiB / 0.2 s on an H200), so the
    smallest eviction that makes room is the cheapest handoff. Whatever the holder cannot cover
    (its converted memory on the device is less than the excess) is asked of the idle clients
    with EVICT at grant time."""
    if grantee is None or dev.mode == "off":
        return 0
    return max(0, min(movable(holder), excess(dev, grantee)))


def prefetch_on_grant(dev, grantee) -> int:
    """GRANT's `prefetch=`: the part of the grantee's evicted memory that fits now."""
    budget = dev.budget
    if dev.mode == "off" or budget <= 0 or not grantee.swapped:
        return 0
    room = budget - sum(footprint(pair) for pair in dev.pairs)
    return max(0, min(grantee.swapped, room))


def eviction_plan(dev, grantee, asked: Iterable) -> list[tuple[object, int]]:
    """EVICTs that would cover the excess for `grantee`: (pair, bytes) for clients that do not
    hold the lock and have converted memory on the device, least recently held first (the
    one whose turn is furthest away, under FCFS), none already asked in this wait."""
    need = excess(dev, grantee)
    asked = set(asked)
    plan = []
    candidates = sorted(
        (pair for pair in dev.pairs
         if pair is not grantee and pair.hold is None and pair not in asked and movable(pair) > 0),
        key=lambda pair: pair.last_held,
    )
    for pair in candidates:
        if need <= 0:
            break
        amount = min(movable(pair), need)
        plan.append((pair, amount))
        need -= amount
    return plan


def report(pair, resident: int, freed: int = 0) -> None:
    """Apply a `resident=` report. A drop in `resident` is memory moved to the host, except
    what the client freed meanwhile (`freed`: how much its `used` fell in the same report); a
    rise is memory brought back."""
    if pair.resident is not None:
        change = resident - pair.resident
        if change < 0:
            pair.swapped += max(0, -change - freed)
        else:
            pair.swapped -= change
    pair.swapped = max(0, min(pair.swapped, pair.used))
    pair.resident = resident
