"""Residency rules of the lock core: how much memory moves at a handoff, when, and what it costs
(docs/scheduler.md, "Budgets and swapping"). Pure functions over the core's pairs and devices;
the core decides when they are asked and carries out what they say (swapping.py, and lock.py for
the quanta).

What the scheduler knows of a pair (one client on one device):
- `used`: MEMORY.used, all the client's allocations on the device (converted and unconverted);
- `resident`: the latest `resident=` the client reported (MEMORY, RELEASE, EVICTED): its
  swappable bytes it believes are on the device; None while it never reported one (a client
  that does not swap: nothing of it is ever asked to move);
- `swapped`: bytes the scheduler saw it move to the host (drops of `resident` that a free does
  not explain) and not yet bring back;
- `swap` (a SwapState): what its swap engine said of itself (MEMORY engine=, area=, out_bps=,
  in_bps=) and what the scheduler told it to prepare (PREPARE) and to bring back ahead of its
  grant (PREFETCH).

A pair's *footprint*, what it occupies of the device now, is `used - swapped`: unconverted
allocations can never move and count in full, and a client that reports no residency counts
with all it allocated. What it *occupies* also holds what it was allowed to bring back and has
not reported yet (memory in flight). The budget holds what the device's clients occupy. When the
lock passes to a *grantee*, it wants all of its memory back (`used`, at most the budget); the
*excess* is what the others leave short of that.

Handoffs are pipelined (issue 18): the holder is told with CONTENDED what its release will move
out, so that it moves it as its quantum ends; as it reports the move (MEMORY resident=, piece by
piece), the next waiter is allowed to bring its own memory back into the room made (PREFETCH);
its gate opens once the rest came back after the GRANT. The two moves do not add up to twice the
link, though: on an H200 two processes' copies of managed memory the opposite ways ran at 24 GB/s
each (with the pages made anew on one side, 40 and 24), where cuMemAlloc memory's ran at 51 and
50 (benchmarks/results/swap-paths-h200-2026-11-28-handoff*.json). So a handoff is priced as the
two moves one after the other; the pipeline saves the messages and start-ups between them.
"""

from __future__ import annotations

from typing import Iterable

from .records import Device, Pair

# Before a client has measured its swap engine: pinned copies at the pace of a PCIe 4.0 x16 link,
# the slowest a data-centre GPU of recent years has (an H200's moved 52-55 GB/s), so that costs
# are not underestimated.
UNMEASURED_COPY_BPS = 25e9
# Memory moved out by the driver's prefetch (an engine without the pinned path, or what its
# pinned area cannot hold yet): a process's first eviction ran at 2.5-6.6 GB/s on an H200, later
# ones at 11-15.
MIGRATE_OUT_BPS = 4e9
# Under a budget a quantum is long enough that a handoff's swapping takes at most this share of
# it (issue 18).
SWAP_SHARE_OF_QUANTUM = 0.10
# What a handoff costs besides moving memory: the drain, the messages, the copies' start-up.
HANDOFF_OVERHEAD_S = 0.05
# A holder whose last pause away lasted this many contended idle windows is released after a
# SERVER_WINDOW_SHARE-th of the window when its release moves nothing (free_idle_ms).
LONG_PAUSE_FACTOR = 2
SERVER_WINDOW_SHARE = 50
# A holder whose memory grew by at least this much in its grant is loading or building up and
# keeps the usual window (free_idle_ms). A request's own allocations stay well under it: on an
# H200 a server's first request after its memory came back (cuBLAS's workspace and the request's
# tensors) counted as a load, kept the 0.1 s window and held three hot requests for 58 ms.
LOAD_GROWTH_BYTES = 256 << 20
# PREPARE and PREFETCH are sent again only when what they say moved by this much (or to 0, or
# to everything): the clients' areas grow in chunks of this size and their moves in blocks.
STEP_BYTES = 64 << 20


def footprint(pair: Pair) -> int:
    """Bytes the pair occupies on the device now."""
    return max(0, pair.used - pair.swapped)


def converted(pair: Pair) -> int:
    """Bytes of the pair a swap can move, on the device or not."""
    return (pair.resident or 0) + pair.swapped if pair.resident is not None else 0


def occupied(pair: Pair) -> int:
    """What the budget holds of the pair: its footprint, or what it was allowed to bring back
    ahead of its grant when that is more (memory in flight counts before it arrives)."""
    if not pair.swap.allowed or pair.resident is None:
        return footprint(pair)
    return max(footprint(pair), min(pair.used, pair.swap.allowed + pair.used - converted(pair)))


def committed(pair: Pair) -> int:
    """What the pair occupies once the moves it was asked for are done (SwapState.leaving):
    what plans of further moves count on. Room that is only committed is never handed out:
    PREFETCH and grants wait for the reports (`occupied`)."""
    return max(0, occupied(pair) - pair.swap.leaving)


def movable(pair: Pair) -> int:
    """Bytes the pair could move to the host if asked: its swappable memory on the device."""
    return pair.resident or 0


def excess(dev: Device, grantee: Pair, planned: bool = False) -> int:
    """Bytes by which the device's budget falls short when `grantee` brings all its memory back
    while every other client keeps what it has; <= 0 when it fits. `planned`: counting the
    moves asked for as done (`committed`), for deciding what else to ask. An unknown budget (0:
    the clients disagree on the device's size and none was set) moves nothing."""
    budget = dev.budget
    if budget <= 0:
        return 0
    wanted = min(grantee.used, budget)
    # What any pair occupies is at most its `used`, whose sum the device keeps: when even that
    # fits, the answer needs no walk over the clients (every handoff asks, most of them fit).
    bound = dev.used - footprint(grantee) + wanted - budget
    if bound <= 0:
        return bound
    held = committed if planned else occupied
    others = sum(held(pair) for pair in dev.pairs if pair is not grantee)
    return others + wanted - budget


def evict_on_drop(dev: Device, holder: Pair, grantee: Pair | None) -> int:
    """DROP's (and CONTENDED's) `evict=`: what `holder` moves out before its release so that
    `grantee` fits.

    Exactly the excess, never more: memory the holder keeps resident is memory it need not
    bring back at its next turn, so the smallest eviction that makes room is the cheapest
    handoff. Idle tenants asked to move out already (eviction.py) count as gone: the holder, the
    most recently used, is asked only for what they cannot cover. Whatever the holder cannot
    cover (its swappable memory on the device is less than the excess) is asked of the others
    with EVICT at grant time."""
    if grantee is None or dev.mode == "off":
        return 0
    return max(0, min(movable(holder), excess(dev, grantee, planned=True)))


def prefetch_on_grant(dev: Device, grantee: Pair) -> int:
    """GRANT's `prefetch=`: the part of the grantee's evicted memory that fits now."""
    budget = dev.budget
    if dev.mode == "off" or budget <= 0 or not grantee.swapped:
        return 0
    room = budget - sum(occupied(pair) for pair in dev.pairs if pair is not grantee) - footprint(grantee)
    return max(0, min(grantee.swapped, room))


def prefetch_ahead(dev: Device, waiter: Pair) -> int:
    """PREFETCH's `resident=` for `waiter`, the next one to be granted: how much of its swappable
    memory may be on the device while it still waits, in the room the others leave (0: nothing
    to say). It rises as the holder reports its memory going out, and the waiter's moves in run
    meanwhile (sharing the link with the holder's moves out)."""
    budget = dev.budget
    if dev.mode == "off" or budget <= 0 or waiter.resident is None or not waiter.swapped:
        return 0
    others = sum(occupied(pair) for pair in dev.pairs if pair is not waiter)
    unconverted = waiter.used - converted(waiter)
    allowed = min(converted(waiter), budget - others - unconverted)
    if allowed <= waiter.resident:
        return 0
    told = waiter.swap.allowed
    step = min(STEP_BYTES, max(1, converted(waiter) // 8))
    if allowed < converted(waiter) and allowed - told < step:
        return 0  # wait until there is a block's worth more (or an eighth of it all, or all of it)
    return allowed if allowed > told else 0


def runs_in_place(dev: Device, pair: Pair) -> bool:
    """Whether granting `pair` adds nothing to what the device holds, and the moves asked for
    already make the room the budget wants: it ran before (its pages were made on the card), it
    reports residency, nothing of it is out or leaving, and once what others were asked to move
    out has left, it fits. Its grant then need not wait for those moves to end: on an H200, after
    six tenants of 17 GiB loaded under an 80 GiB budget, the first request in turn, to a tenant
    that had all of its memory on the card, waited 0.69 s from its ACQUIRE for two idle
    tenants' evictions to finish."""
    return (pair.grants > 0 and pair.resident is not None and pair.swapped == 0 and not pair.swap.leaving
            and excess(dev, pair, planned=True) <= 0)


def nearly_back(pair: Pair) -> bool:
    """Whether what the pair has out is at most a block (STEP_BYTES) and a 32nd of its converted
    memory: what a grant brings back in a few milliseconds."""
    return pair.swapped <= min(STEP_BYTES, converted(pair) // 32)


def report(pair: Pair, resident: int, freed: int = 0) -> None:
    """Apply a `resident=` report. A drop in `resident` is memory moved to the host, except
    what the client freed meanwhile (`freed`: how much its `used` fell in the same report); a
    rise is memory brought back. The device counts both (its metrics)."""
    if pair.resident is not None:
        change = resident - pair.resident
        if change < 0:
            moved = max(0, -change - freed)
            pair.swapped += moved
            pair.swap.leaving = max(0, pair.swap.leaving - moved)
            pair.device.moved_out += moved
        else:
            pair.device.moved_in += min(change, pair.swapped)
            pair.swapped -= change
    pair.swapped = max(0, min(pair.swapped, pair.used))
    pair.resident = resident
    if pair.swap.allowed and resident >= min(pair.swap.allowed, converted(pair)):
        pair.swap.allowed = 0  # arrived: it occupies it now


def report_engine(pair: Pair, engine: str, area: int | None, out_bps: int, in_bps: int, pool: bool) -> None:
    """Apply what a MEMORY report says of the client's swap engine (an empty engine: nothing)."""
    if not engine:
        return
    pair.swap.engine = engine
    pair.swap.area = area or 0
    pair.swap.pool = pool
    if out_bps:
        pair.swap.out_bps = out_bps
    if in_bps:
        pair.swap.in_bps = in_bps


# --- what swapping costs, and the policy that weighs it -----------------------------------------


def handoff_seconds(dev: Device, holder: Pair, grantee: Pair | None) -> float:
    """How long a handoff from `holder` to `grantee` stalls the grantee for swapping: the holder's
    eviction at its measured pace out, then the grantee's swapped memory at its pace in (the two
    processes' moves share the link, see above). 0 when nothing moves."""
    if grantee is None or dev.mode == "off" or dev.budget <= 0:
        return 0.0
    out = _out_seconds(holder, evict_on_drop(dev, holder, grantee))
    back = min(grantee.swapped, converted(grantee)) / (grantee.swap.in_bps or UNMEASURED_COPY_BPS)
    moves = out + back
    return moves + HANDOFF_OVERHEAD_S if moves > 0 else 0.0


def _out_seconds(pair: Pair, nbytes: int) -> float:
    """How long `pair` takes to move `nbytes` more to the host: through what its pinned area has
    free at its measured pace, the rest by the driver's prefetch. So while an area is still
    being pinned, a handoff costs what the slow path costs, and the quanta and idle windows wait
    for the area instead of paying that."""
    if pair.swap.engine != "copy":
        return nbytes / (pair.swap.out_bps or MIGRATE_OUT_BPS)
    through_area = min(nbytes, max(0, pair.swap.area - pair.swapped))
    return through_area / (pair.swap.out_bps or UNMEASURED_COPY_BPS) + (nbytes - through_area) / MIGRATE_OUT_BPS


def quantum_floor(dev: Device, holder: Pair, grantee: Pair | None) -> float:
    """Under a budget, the shortest quantum for `holder` while `grantee` is next: long enough
    that the handoff's swapping is at most SWAP_SHARE_OF_QUANTUM of it (0: no floor)."""
    return handoff_seconds(dev, holder, grantee) / SWAP_SHARE_OF_QUANTUM


def idle_ms(dev: Device, holder: Pair, grantee: Pair | None, free_ms: int) -> int:
    """CONTENDED's `idle_ms=`: while others wait, how long the holder may be idle before it
    releases (0: the client's own window applies).

    A release for a pause costs what it makes the *holder* move: its eviction now and the same
    bytes back at its next turn (the grantee's memory comes back whenever it is granted, and
    from its request on, ahead of its grant: eviction.py). So the ski-rental rule: a holder is
    not released for idleness shorter than that round trip, priced at the holder's measured
    pace; a busy job's short pauses do not swap both ways for less than they gain. When the
    release moves nothing of the holder's, its pauses are worth nothing to it and another tenant
    is waiting: `free_ms` (the operator's --idle-release-contended; 0: the client's window), or
    less for a holder whose pauses are long (free_idle_ms). Only a measured price counts (issue
    29): a first quantum, a move nobody has measured yet, or an area still being pinned keep no
    idle GPU from the others, so an unmeasured price gets the window of a release that moves
    nothing. It used to leave the client's own window (1 s): on an H200 a server asked every
    second, which had to give up 0.4 GB when released and had never measured a move, kept the
    lock for 20 s of its quantum while three others' requests waited."""
    if grantee is None:
        return 0  # it waits behind itself: nobody to let in
    evict = evict_on_drop(dev, holder, grantee)
    if not evict or not holder.swap.out_bps or not holder.swap.in_bps:
        return free_idle_ms(holder, free_ms)
    round_trip = evict / holder.swap.out_bps + evict / holder.swap.in_bps
    return round((round_trip + HANDOFF_OVERHEAD_S) * 1000)


def free_idle_ms(holder: Pair, free_ms: int) -> int:
    """The idle window, while others wait, of a holder whose release moves none of its memory:
    `free_ms`, or a fiftieth of it (at least 1 ms; 2 ms by default) when the holder's last pause
    away from the device lasted at least LONG_PAUSE_FACTOR times `free_ms`. Its pauses are
    expected to repeat, as the client's ski-rental rule expects (docs/interceptor.md): a server
    between requests asked every second comes back long after the waiters were served, so the
    window only delays them (three servers asked at once in mode on: the third waited for two
    windows, 0.25 s, for a request of 11 ms on the simulated driver; with a tenth of it, 10 ms,
    an H200's requests of 3 ms at once took twice their time without nvshare, 21 against 10 ms
    at the median). Releasing a server in a host gap of its request costs it one ACQUIRE and the
    other requests' time, as sharing the GPU natively would; a training job whose host pauses
    are short keeps the window, so that it is not handed off at every step. A single long pause of such a job buys it one
    shorter window: its next pause, short, restores the usual one. So does allocating while it
    holds: a program that grows in its grant is loading or building up, and a load's host gaps
    (filling its next staging buffer) are short. On an H200 a tenant that had been away 0.84 s
    setting up its load was released 2 ms into the first gap of its 17 GiB load, waited 7 s
    behind the others' loads and evictions to finish it, and the six loads took 1.61 x the sum
    of each alone. Growth under LOAD_GROWTH_BYTES (a request's workspace) is a server's."""
    building_up = holder.hold is not None and holder.used - holder.hold.used_at_grant >= LOAD_GROWTH_BYTES
    if free_ms and holder.away >= LONG_PAUSE_FACTOR * free_ms / 1000 and not building_up:
        return max(1, free_ms // SERVER_WINDOW_SHARE)
    return free_ms


def area_targets(devices: Iterable[Device], spill: int | None) -> dict[Pair, int]:
    """PREPARE's bytes for every pair that swaps: the most of its memory it may be asked to
    hold on the host at once on its device, i.e. its swappable memory, but no more than what
    the device's clients have beyond its budget. Within the node's host-memory policy: with
    admission's spill set, the areas together take at most the spill (each is cut in the same
    proportion)."""
    targets = {}
    for dev in devices:
        budget = dev.budget
        over = dev.used - budget if budget > 0 and dev.mode != "off" else 0
        for pair in dev.pairs:
            if pair.resident is None or pair.swap.engine == "migrate":
                continue  # does not swap, or needs no area
            targets[pair] = max(0, min(converted(pair), over))
    total = sum(targets.values())
    if spill is not None and total > spill:
        targets = {pair: bytes_ * spill // total for pair, bytes_ in targets.items()}
    return targets


def _moved(told: int, now: int, step: int) -> bool:
    """Whether a figure the client was told moved enough to tell it again: from or to nothing,
    or by `step`, or by an eighth of itself when that is less."""
    return now != told and (told == 0 or now == 0 or abs(now - told) >= min(step, max(now, told) // 8))


def swap_notice_changed(told: tuple[int, int], now: tuple[int, int]) -> bool:
    """Whether CONTENDED should be sent again for what a handoff moves and costs (evict=,
    idle_ms=)."""
    return _moved(told[0], now[0], STEP_BYTES) or _moved(told[1], now[1], 100)


def prepare_due(pair: Pair, target: int) -> bool:
    """Whether PREPARE should say `target` now."""
    return _moved(pair.swap.prepared, target, STEP_BYTES)
