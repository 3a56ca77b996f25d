"""What every local user may see of the scheduler: the `status` answer of the status socket
(docs/protocol.md, *Status socket*; docs/scheduler.md, *Security model*).

What `nvidia-smi` shows every user of a machine, and no more: for each GPU who holds it and who
waits, with user, program, process and how long; for every client its user, program, process
and what it holds or waits for with how much memory. A user's own clients (the same
kernel-verified uid) are shown in full, as on the control socket. Left out for other users'
clients: what they say about where they run (host, container, pod, namespace, the pod's UID)
and their settings (weights, priorities, limits), which only root and the scheduler's user
read, on the control socket.
"""

from __future__ import annotations

from typing import Any

from .views import user_name

JsonObject = dict[str, Any]

_SCHEDULER_FIELDS = ("version", "pid", "started", "socket_dir", "restarted", "defaults")
_DEVICE_FIELDS = ("device", "name", "total", "budget", "mode", "tq", "used", "resident", "swapped", "headroom",
                  "moved_out", "moved_in")
# What a user sees of another user's client, and of its state on each device.
_OTHERS_FIELDS = ("client", "uid", "host_pid", "program", "connected", "silent")
_OTHERS_PAIR_FIELDS = ("state", "used", "resident", "swapped", "last_ran")


def public_status(document: JsonObject, viewer: int | None) -> JsonObject:
    """The status `document` (docs/protocol.md, *Status document*) as user `viewer` may see it."""
    clients: list[JsonObject] = document.get("clients", [])
    by_id = {client["client"]: client for client in clients}

    def who(entry: JsonObject) -> JsonObject:
        client = by_id.get(entry.get("client", ""), {})
        return {**entry, "uid": client.get("uid"), "user": _user(client), "program": client.get("program", ""),
                "host_pid": client.get("host_pid", 0)}

    devices = [
        {**{key: dev[key] for key in _DEVICE_FIELDS if key in dev},
         "holders": [who(holder) for holder in dev.get("holders", [])],
         "waiters": [who(waiter) for waiter in dev.get("waiters", [])]}
        for dev in document.get("devices", [])
    ]
    shown = []
    for client in clients:
        if viewer is not None and client.get("uid") == viewer:
            shown.append({**client, "user": _user(client)})
        else:
            shown.append({**{key: client[key] for key in _OTHERS_FIELDS if key in client}, "user": _user(client),
                          "devices": {device: {key: pair[key] for key in _OTHERS_PAIR_FIELDS if key in pair}
                                      for device, pair in client.get("devices", {}).items()}})
    scheduler = document.get("scheduler", {})
    public: JsonObject = {
        "scheduler": {key: scheduler[key] for key in _SCHEDULER_FIELDS if key in scheduler},
        "viewer": {"uid": viewer, "user": user_name(viewer)},
        "devices": devices,
        "clients": shown,
    }
    if "admission" in document:
        public["admission"] = document["admission"]
    if "refused" in document:  # whose processes wait for a connection: as for clients, no pod UID of others
        public["refused"] = [entry if viewer is not None and entry.get("uid") == viewer
                             else {key: value for key, value in entry.items() if key != "pod_uid"}
                             for entry in document["refused"]]
    return public


def _user(client: JsonObject) -> str:
    name = client.get("user")
    return name if isinstance(name, str) and name else user_name(client.get("uid"))
