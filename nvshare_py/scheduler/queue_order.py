"""The order a device's waiters are served in (docs/scheduler.md, "Weights and priorities"): the
highest effective priority class first (the class a waiter queued in, raised by ageing:
fairshare.effective_class), then ACQUIRE order. Pure functions over the core's records; the lock
(lock.py) grants in this order, and the swapping (swapping.py) wakes and evicts by it.
"""

from __future__ import annotations

from . import fairshare
from .records import Device, Pair


def rank(pair: Pair, ageing: int) -> int:
    """A waiter's effective priority class (fairshare.effective_class). A gang's waiters
    share one: it ages by the grants on whichever of its devices saw most, so that the gang
    ranks alike on all of them (one order between gangs on every device: no deadlock) and
    never falls behind a waiter that queued after it on any of them."""
    waited = pair.device.grants_made - pair.queued_grants
    if pair.gang_queued:
        waited = max(other.device.grants_made - other.queued_grants
                     for other in pair.client.gang.pairs() if other.gang_queued)
    return fairshare.effective_class(pair.queued_class, waited, ageing)


def next_waiter(dev: Device, ageing: int) -> Pair | None:
    """The waiter served next: the highest effective class, the earliest ACQUIRE among
    equals. Ageing keeps ACQUIRE order within a class (an earlier waiter has seen at least
    as many grants), so only the head of each class can be next; where gangs wait (whose
    ageing is the gang's, rank) every waiter is compared."""
    if dev.gang_waiters:
        return max(dev.queue, key=lambda pair: (rank(pair, ageing), -pair.queued_seq), default=None)
    best = None
    best_key = None
    for waiters in dev.classes:
        if not waiters:
            continue
        head = next(iter(waiters))
        key = (rank(head, ageing), -head.queued_seq)
        if best_key is None or key > best_key:
            best, best_key = head, key
    return best


def service_order(dev: Device, ageing: int) -> list[Pair]:
    """The waiters in the order they would be served if nothing changed: priority classes
    (with ageing), then ACQUIRE order (next_waiter's rule, applied to the whole queue)."""
    return sorted(dev.queue, key=lambda pair: (-rank(pair, ageing), pair.queued_seq))


def next_other_waiter(pair: Pair, ageing: int) -> Pair | None:
    """The waiter served next after `pair`'s release (priority classes, then ACQUIRE order);
    None when that is `pair` itself."""
    grantee = next_waiter(pair.device, ageing)
    # It asked again and is served next: a handoff to itself moves nothing, and no room is
    # made for anyone behind it.
    return None if grantee is pair else grantee
