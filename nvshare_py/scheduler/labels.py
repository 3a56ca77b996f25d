"""Bounds on the label values of the scheduler's metrics (docs/metrics.md, *Labels and their
bounds*): clients choose what they are called, so the set of series they can make the daemon
keep, render and send must be bounded, with a share per user, and what is no longer used must
make room for what is.

`Places` keeps at most `total` keys, at most `per_owner` of one owner; a key in use (its users
are live) is never evicted, a key nobody uses any more is, least recently used first, when a
new key needs its place. The caller removes the series of every key it is told was evicted.
Sans-I/O and independent of prometheus_client.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator


class _Place:
    __slots__ = ("owner", "users")

    def __init__(self, owner: Hashable) -> None:
        self.owner = owner
        self.users: set[Hashable] = set()


class Places:
    def __init__(self, total: int, per_owner: int) -> None:
        self.total = total
        self.per_owner = per_owner
        self._places: collections.OrderedDict[Hashable, _Place] = collections.OrderedDict()  # LRU first
        self._owned: collections.Counter[Hashable] = collections.Counter()
        self._by_user: dict[Hashable, set[Hashable]] = {}

    def __len__(self) -> int:
        return len(self._places)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._places

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._places)

    def take(self, key: Hashable, owner: Hashable, user: Hashable | None = None) -> tuple[bool, list[Hashable]]:
        """A place for `key` (owned by `owner`, used by `user` from now until `release`):
        (whether it has one, the keys evicted to make room)."""
        place = self._places.get(key)
        evicted: list[Hashable] = []
        if place is None:
            if self._owned[owner] >= self.per_owner:
                victim = self._unused(owner)
                if victim is None:
                    return False, evicted
                evicted.append(self._evict(victim))
            if len(self._places) >= self.total:
                victim = self._unused(None)
                if victim is None:
                    return False, evicted
                evicted.append(self._evict(victim))
            place = self._places[key] = _Place(owner)
            self._owned[owner] += 1
        else:
            self._places.move_to_end(key)
        if user is not None:
            place.users.add(user)
            self._by_user.setdefault(user, set()).add(key)
        return True, evicted

    def release(self, user: Hashable) -> None:
        """`user` is gone: the places it used may be evicted once nobody else uses them."""
        for key in self._by_user.pop(user, ()):
            place = self._places.get(key)
            if place is not None:
                place.users.discard(user)

    def unused(self, key: Hashable) -> None:
        """Whatever used `key` is gone (a device the core forgot)."""
        place = self._places.get(key)
        if place is not None:
            for user in place.users:
                self._by_user.get(user, set()).discard(key)
            place.users.clear()

    def _unused(self, owner: Hashable | None) -> Hashable | None:
        """The least recently used key nobody uses (of `owner`, when given)."""
        for key, place in self._places.items():
            if not place.users and (owner is None or place.owner == owner):
                return key
        return None

    def _evict(self, key: Hashable) -> Hashable:
        place = self._places.pop(key)
        self._owned[place.owner] -= 1
        if not self._owned[place.owner]:
            del self._owned[place.owner]
        return key
