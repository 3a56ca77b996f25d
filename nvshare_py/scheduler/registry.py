"""Who the lock core knows: its registrations (by connection, by session, and in the order they
were last heard from), the devices, and what the operator set for the clients (fairshare.Settings:
weights, priorities, memory limits, kept for a process across its registrations).

Bookkeeping only: nothing here grants, queues or sends. The core (core.py) registers and removes
clients; the lock (lock.py) and the rules beside it look clients, devices and settings up here.
"""

from __future__ import annotations

from collections import OrderedDict

from . import fairshare
from .events import ClientInfo, ClientKey, Mode
from .records import Client, Device, Pair


def same_process(old: ClientInfo, new: ClientInfo) -> bool:
    """A reconnection: same random session, and the kernel-verified host pid and uid do not
    contradict it (0 / None mean the daemon could not see them)."""
    return (
        old.session == new.session
        and (old.host_pid == new.host_pid or old.host_pid == 0 or new.host_pid == 0)
        and (old.uid == new.uid or old.uid is None or new.uid is None)
    )


class Registry:
    """The clients by their connection's key (in registration order: c1, c2, ...), the devices
    by id, and the settings; `default_mode` and `default_tq` are what a device has until it is
    set on its own."""

    def __init__(self, mode: Mode, tq: float) -> None:
        self.settings = fairshare.Settings()
        self.default_mode: Mode = mode
        self.default_tq = tq
        self.clients: dict[ClientKey, Client] = {}
        self.devices: dict[str, Device] = {}
        self._sessions: dict[str, list[Client]] = {}
        # Clients ordered by last message, least recently heard first: the head is the next
        # one to time out, so heartbeats and timeouts cost O(1).
        self._silence: OrderedDict[ClientKey, Client] = OrderedDict()
        self._client_numbers = 0

    def register(self, key: ClientKey, info: ClientInfo, now: float) -> tuple[Client, list[Client]]:
        """A new registration, and the registrations of the same process it replaces (a
        reconnection, same_process). The process keeps what was set for it: from the
        registrations it reconnects as, or from one it ended (BYE, a closed connection) while it
        lived on."""
        self._client_numbers += 1
        client = Client(key, f"c{self._client_numbers}", info, now)
        predecessors = [old for old in self._sessions.get(info.session, ()) if same_process(old.info, info)]
        self.clients[client.key] = client
        self._sessions.setdefault(info.session, []).append(client)
        self._silence[client.key] = client
        for old in predecessors:
            self.settings.rename_client(old.cid, client.cid)
        if client.process is not None:
            self.settings.restore(client.process, client.cid)
        return client, predecessors

    def unlink(self, client: Client, *, park: bool) -> None:
        """The registration ends. `park`: its process may register again and then keeps its
        settings (fairshare.Settings.park); else they end with it."""
        process = client.process
        if park and process is not None:
            self.settings.park(client.cid, process)
        else:
            self.settings.forget_client(client.cid)
            if process is not None:
                self.settings.forget_process(process)
        del self.clients[client.key]
        del self._silence[client.key]
        same_session = self._sessions[client.info.session]
        same_session.remove(client)
        if not same_session:
            del self._sessions[client.info.session]

    def heard(self, client: Client, now: float) -> None:
        """A message from the client: it is alive."""
        client.last_seen = now
        self._silence.move_to_end(client.key)

    def most_silent(self) -> Client | None:
        """The client heard from longest ago: the next to time out."""
        return next(iter(self._silence.values()), None)

    def device(self, device_id: str) -> Device:
        """The device of that id, made with the defaults when first named."""
        dev = self.devices.get(device_id)
        if dev is None:
            dev = self.devices[device_id] = Device(device_id, self.default_mode, self.default_tq)
        return dev

    def weight(self, client: Client) -> int:
        return self.settings.weight.resolve(client.cid, client.info.pod_uid)

    def priority(self, client: Client) -> int:
        return self.settings.priority.resolve(client.cid, client.info.pod_uid)

    def limit(self, pair: Pair) -> int | None:
        client = pair.client
        return self.settings.limit(client.cid, client.info.pod_uid, pair.device.id)
