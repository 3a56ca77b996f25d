"""The control protocol (docs/protocol.md, *Control socket*): who may ask, what each op
takes, which core event it feeds and what it answers; served on two sockets.

Every op is one row of an op table: `validate` turns the request's fields into arguments (or
raises ControlError bad-request), `event` makes the lock-core event that carries the change out
(None for a read), `result` says what the reply holds once the core has taken the event. The
core judges the values of settings itself (ControlError) before it changes anything.

- The control socket serves OPS to root and the daemon's user.
- The status socket serves READ_ONLY_OPS (`status`, `events`) to every local user, each
  seeing what public.py lets an unprivileged user see; no op there changes anything.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .. import protocol
from . import events as ev, runtime, zmtp
from .connections import ByteBudget, Connection, ConnectionLimits, ConnectionServer, PeerCredentials
from .fairness import Turns
from .logs import RateLimit, emit, log
from .public import public_status
from .runtime import CoreFailure

EVENTS_DEFAULT_LIMIT = 1000
# A control connection is closed when one message (all its frames) is larger than this;
# between the request limit and this, a request is answered too-large.
CONTROL_WIRE_MAX = 2 * protocol.CONTROL_REQUEST_MAX
# Control connections come from root and the daemon's user (nvsharectl, the readiness probe):
# a few at a time. What they may hold: a few replies of the largest size.
CONTROL_LIMITS = ConnectionLimits(total=16, per_principal=8, per_uid=8)
CONTROL_BYTES = 4 * protocol.CONTROL_REPLY_MAX
# Silence allowed on a control connection (a REQ socket reconnects by itself after it is closed).
CONTROL_IDLE_TIMEOUT = 60.0
# The status socket: every local user may connect, a few connections each; replies are cut to
# STATUS_REPLY_MAX, and built from a status document at most STATUS_INTERVAL seconds old.
STATUS_LIMITS = ConnectionLimits.sharing(64, per_principal=4, per_uid=8)
STATUS_REPLY_MAX = 1024 * 1024
STATUS_BYTES = 2 * STATUS_REPLY_MAX
STATUS_INTERVAL = 0.5
_INTERNAL_ERROR = "the scheduler failed on this request; see its log"


JsonObject = dict[str, Any]


class Host(Protocol):
    """What the control protocol needs of the daemon."""

    def status(self) -> JsonObject: ...

    def events(self, since: int, limit: int) -> Encoded: ...

    def apply(self, event: ev.Event) -> None: ...

    def admission_settings(self) -> JsonObject: ...


Arguments = dict[str, Any]


class Encoded(str):
    """A result already encoded as JSON text, put into the reply as it is: an `events` page,
    joined from entries encoded when they were recorded (eventring.py)."""


@dataclass(frozen=True)
class Op:
    validate: Callable[[JsonObject], Arguments]
    event: Callable[[Arguments, float], ev.Event] | None
    result: Callable[[Arguments, Host, PeerCredentials], Any]


def _number(request: JsonObject, key: str) -> float:
    value = request.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ev.ControlError("bad-request", f"{key} must be a number")
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        raise ev.ControlError("bad-request", f"{key} is too large") from None


def _integer(request: JsonObject, key: str, default: int, *, minimum: int, maximum: int = protocol.MAX_INT) -> int:
    value = request.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ev.ControlError("bad-request", f"{key} must be an integer from {minimum} to {maximum}")
    return value


def _setting_target(request: JsonObject) -> tuple[str | None, str | None]:
    """The optional `client` or `pod_uid` a setting is for (neither: the default)."""
    client, pod_uid = request.get("client"), request.get("pod_uid")
    for key, value in (("client", client), ("pod_uid", pod_uid)):
        if value is not None and (not isinstance(value, str) or not value or len(value) > protocol.MAX_VALUE):
            raise ev.ControlError("bad-request", f"{key} must be a non-empty string")
    if client is not None and pod_uid is not None:
        raise ev.ControlError("bad-request", "give client or pod_uid, not both")
    return client, pod_uid


def _device(request: JsonObject, *, required: bool) -> str | None:
    device = request.get("device")
    if device is None and not required:
        return None
    if not isinstance(device, str) or not device:
        raise ev.ControlError("bad-request", "device must be a device id")
    return device


# --- the ops -----------------------------------------------------------------------------------


def _events_arguments(request: JsonObject) -> Arguments:
    return {"since": _integer(request, "since", 0, minimum=0),
            "limit": _integer(request, "limit", EVENTS_DEFAULT_LIMIT, minimum=1, maximum=protocol.CONTROL_EVENTS_MAX)}


def _tq_arguments(request: JsonObject) -> Arguments:
    return {"seconds": _number(request, "seconds"), "device": _device(request, required=False)}


def _mode_arguments(request: JsonObject) -> Arguments:
    return {"mode": request.get("mode"), "device": _device(request, required=False)}


def _budget_arguments(request: JsonObject) -> Arguments:
    budget = request.get("bytes")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= protocol.MAX_INT
    ):
        raise ev.ControlError("bad-request", "bytes must be an integer > 0, or null for the device's total")
    return {"bytes": budget, "device": _device(request, required=True)}


def _admission_arguments(request: JsonObject) -> Arguments:
    """`spill` (bytes, "auto", or null: admission off), `policy`, `timeout` (seconds), `share`
    (of the capacity, one user or pod at most); each optional. The core judges the values."""
    spill = request.get("spill")
    if spill is not None and spill != "auto" and (isinstance(spill, bool) or not isinstance(spill, int)
                                                  or not 0 <= spill <= protocol.MAX_INT):
        raise ev.ControlError("bad-request", 'spill must be an integer >= 0, "auto", or null to turn admission off')
    return {"spill": spill, "keep_spill": "spill" not in request,
            "timeout": _number(request, "timeout") if "timeout" in request else None,
            "share": _number(request, "share") if "share" in request else None,
            "policy": request.get("policy")}


def _target_arguments(value_key: str) -> Callable[[JsonObject], Arguments]:
    """Per-client settings (docs/scheduler.md, "Weights and priorities"): the core judges the
    value and whether the client exists."""
    def validate(request: JsonObject) -> Arguments:
        client, pod_uid = _setting_target(request)
        return {"client": client, "pod_uid": pod_uid, value_key: request.get(value_key)}
    return validate


def _limit_arguments(request: JsonObject) -> Arguments:
    return dict(_target_arguments("bytes")(request), device=_device(request, required=False))


def _nothing(request: JsonObject) -> Arguments:
    return {}


OPS: dict[str, Op] = {
    "status": Op(_nothing, None, lambda a, host, peer: host.status()),
    "events": Op(_events_arguments, None, lambda a, host, peer: host.events(a["since"], a["limit"])),
    "set-tq": Op(_tq_arguments, lambda a, now: ev.SetQuantum(now, a["seconds"], a["device"]),
                 lambda a, host, peer: {"device": a["device"], "tq": a["seconds"]}),
    "set-mode": Op(_mode_arguments, lambda a, now: ev.SetMode(now, a["mode"], a["device"]),
                   lambda a, host, peer: {"device": a["device"], "mode": a["mode"]}),
    "set-budget": Op(_budget_arguments, lambda a, now: ev.SetBudget(now, a["device"], a["bytes"]),
                     lambda a, host, peer: {"device": a["device"], "budget": a["bytes"]}),
    "set-admission": Op(_admission_arguments,
                        lambda a, now: ev.SetAdmission(now, spill=a["spill"], keep_spill=a["keep_spill"],
                                                       policy=a["policy"], timeout=a["timeout"], share=a["share"]),
                        lambda a, host, peer: host.admission_settings()),
    "set-weight": Op(_target_arguments("weight"),
                     lambda a, now: ev.SetWeight(now, a["weight"], a["client"], a["pod_uid"]),
                     lambda a, host, peer: {"client": a["client"], "pod_uid": a["pod_uid"], "weight": a["weight"]}),
    "set-priority": Op(_target_arguments("priority"),
                       lambda a, now: ev.SetPriority(now, a["priority"], a["client"], a["pod_uid"]),
                       lambda a, host, peer: {"client": a["client"], "pod_uid": a["pod_uid"], "priority": a["priority"]}),
    "set-limit": Op(_limit_arguments,
                    lambda a, now: ev.SetLimit(now, a["bytes"], a["device"], a["client"], a["pod_uid"]),
                    lambda a, host, peer: {"client": a["client"], "pod_uid": a["pod_uid"], "device": a["device"],
                                     "bytes": a["bytes"]}),
}


class StatusCache:
    """The host's status document, taken at most every `interval` seconds (a status built
    for every request of every user would let them make the pump work at will)."""

    def __init__(self, host: Host, now: Callable[[], float], interval: float = STATUS_INTERVAL) -> None:
        self.host = host
        self.now = now
        self.interval = interval
        self._document: JsonObject = {}
        self._taken = -float("inf")

    def document(self) -> JsonObject:
        if self.now() - self._taken >= self.interval:
            self._document = self.host.status()
            self._taken = self.now()
        return self._document


def read_only_ops(cache: StatusCache) -> dict[str, Op]:
    """The status socket's ops: what every local user may ask. `status` is the document
    public.py makes for the asking user; `events` the lock timeline as on the control socket."""
    return {
        "status": Op(_nothing, None, lambda a, host, peer: public_status(cache.document(), peer.uid)),
        "events": OPS["events"],
    }


# --- requests and replies ----------------------------------------------------------------------


Authorisation = Callable[[PeerCredentials], "str | None"]


class ControlProtocol:
    """Answers requests for `host` with `ops`, to peers `authorise` lets in (it says why not)."""

    def __init__(self, host: Host, ops: dict[str, Op], authorise: Authorisation, now: Callable[[], float],
                 refused: str = "control request refused") -> None:
        self.host = host
        self.ops = ops
        self.authorise = authorise
        self.now = now
        self.refused = refused  # the log line for a refused peer
        self._forbidden_log = RateLimit()

    def answer(self, body: list[bytes], peer: PeerCredentials) -> JsonObject:
        if len(body) != 1:
            return failure("bad-request", "a request is one frame of JSON")
        frame = body[0]
        refusal = self.authorise(peer)
        if refusal is not None:
            suppressed = self._forbidden_log.take()
            if suppressed is not None:
                emit(logging.WARNING, self.refused, reason=refusal, suppressed=suppressed)
            return failure("forbidden", refusal)
        if len(frame) > protocol.CONTROL_REQUEST_MAX:
            return failure("too-large", f"request of {len(frame)} bytes, limit {protocol.CONTROL_REQUEST_MAX}")
        try:
            request = json.loads(frame)
        except ValueError:
            return failure("bad-request", "not JSON")
        try:
            if not isinstance(request, dict) or request.get("v") != 1:
                raise ev.ControlError("bad-request", 'a request is a JSON object with "v": 1')
            result = self._perform(request, peer)
        except ev.ControlError as exc:
            return failure(exc.code, str(exc))
        except CoreFailure:
            raise  # the lock table may be half-updated: the daemon must stop (Daemon._feed)
        except Exception:
            # A read failing (`status` built from the core's state): answered, and the daemon
            # serves on; the core was not changed.
            log.exception("control request %r failed", request.get("op"))
            return failure("internal", _INTERNAL_ERROR)
        return {"v": 1, "ok": True, "result": result}

    def _perform(self, request: JsonObject, peer: PeerCredentials) -> Any:
        op_name = request.get("op")
        op = self.ops.get(op_name) if isinstance(op_name, str) else None
        if op is None:
            if op_name in OPS:
                raise ev.ControlError("forbidden", f"{op_name} is not served on the status socket, which only "
                                      f"reads ({', '.join(self.ops)}): use the control socket")
            raise ev.ControlError("unknown-op", f"unknown op {op_name!r}")
        arguments = op.validate(request)
        if op.event is not None:
            self.host.apply(op.event(arguments, self.now()))
        return op.result(arguments, self.host, peer)


def controller(uid: int, pid_namespace: tuple[int, int]) -> Authorisation:
    """Who may use the control socket: root or the daemon's `uid`, in the daemon's pid
    namespace (`pid_namespace`: runtime.pid_namespace())."""
    def authorise(peer: PeerCredentials) -> str | None:
        if peer.uid is not None and peer.uid not in (0, uid):
            return f"uid {peer.uid} may not control this scheduler"
        return local_process(peer, pid_namespace)
    return authorise


def local_user(pid_namespace: tuple[int, int]) -> Authorisation:
    """Who may use the status socket: any uid, in the daemon's pid namespace."""
    return lambda peer: local_process(peer, pid_namespace)


def local_process(peer: PeerCredentials, pid_namespace: tuple[int, int]) -> str | None:
    """Why `peer` is not a process the daemon can see in its own pid namespace (None: it is)."""
    if peer.uid is None:
        return "the peer's credentials are unknown"
    if peer.pid == 0:
        return "the peer's process is not visible in the scheduler's pid namespace"
    try:
        namespace = runtime.pid_namespace(peer.pid)
    except OSError:
        return "the peer's pid namespace cannot be read"
    if namespace != pid_namespace:
        return "the peer runs in another pid namespace"
    return None


def fitted(reply: JsonObject, limit: int = protocol.CONTROL_REPLY_MAX) -> bytes:
    """The reply as JSON within `limit` bytes. A status too large for it (many clients)
    keeps the first devices and clients and says in "truncated" how many it left out, so that
    status always answers; anything else too large is answered too-large. An Encoded result
    goes in as it is (`answer` made the reply around it)."""
    result = reply.get("result")
    if isinstance(result, Encoded):
        data = f'{{"v":1,"ok":true,"result":{result}}}'.encode()
        return data if len(data) <= limit else json.dumps(failure("too-large", f"reply of {len(data)} bytes")).encode()
    data = json.dumps(reply, separators=(",", ":")).encode()
    if len(data) <= limit:
        return data
    if isinstance(result, dict) and "devices" in result and "clients" in result:
        devices, clients, gangs = result["devices"], result["clients"], result.get("gangs")
        shown = len(devices) + len(clients)
        while shown > 0:
            shown = shown * 3 // 4
            kept_devices = devices[:shown]
            kept_clients = clients[:shown]
            cut = dict(result, devices=kept_devices, clients=kept_clients,
                       truncated={"devices": len(devices) - len(kept_devices),
                                  "clients": len(clients) - len(kept_clients)})
            if gangs is not None:  # every gang has a client: no more gangs than clients
                cut["gangs"] = gangs[:shown]
                cut["truncated"]["gangs"] = len(gangs) - len(cut["gangs"])
            data = json.dumps(dict(reply, result=cut), separators=(",", ":")).encode()
            if len(data) <= limit:
                return data
    return json.dumps(failure("too-large", f"reply of {len(data)} bytes")).encode()


def failure(code: str, message: str) -> JsonObject:
    return {"v": 1, "ok": False, "error": {"code": code, "message": message}}


# --- the socket --------------------------------------------------------------------------------


def split_envelope(frames: tuple[bytes, ...]) -> tuple[list[bytes], list[bytes]]:
    """ROUTER framing towards the peer: a REQ peer's request comes behind an empty delimiter
    frame, which its reply must repeat; a DEALER's may (docs/protocol.md)."""
    if len(frames) > 1 and not frames[0]:
        return [b""], list(frames[1:])
    return [], list(frames)


class ControlServer:
    """A socket whose messages are requests of `protocol`, each answered in order on its
    connection: the control socket (`control_server`) or the status socket (`status_server`)."""

    def __init__(self, name: str, listener: socket.socket, protocol_: ControlProtocol, turns: Turns,
                 limits: ConnectionLimits, budget: ByteBudget, reply_max: int) -> None:
        self.protocol = protocol_
        self.reply_max = reply_max
        self.connections = ConnectionServer(
            name, listener, limits, CONTROL_WIRE_MAX, self._on_message, _nothing_to_do, turns=turns, budget=budget,
            idle_timeout=CONTROL_IDLE_TIMEOUT, outgoing_max=reply_max + 64)

    async def serve(self) -> None:
        await self.connections.serve()

    def _on_message(self, connection: Connection, frames: tuple[bytes, ...]) -> None:
        envelope, body = split_envelope(frames)
        data = fitted(self.protocol.answer(body, connection.credentials), self.reply_max)
        self.connections.write(connection, zmtp.message([*envelope, data]))


def control_server(listener: socket.socket, protocol_: ControlProtocol, turns: Turns) -> ControlServer:
    return ControlServer("control", listener, protocol_, turns, CONTROL_LIMITS,
                         ByteBudget(CONTROL_BYTES, CONTROL_BYTES), protocol.CONTROL_REPLY_MAX)


def status_server(listener: socket.socket, protocol_: ControlProtocol, turns: Turns) -> ControlServer:
    return ControlServer("status", listener, protocol_, turns, STATUS_LIMITS,
                         ByteBudget(STATUS_BYTES, STATUS_BYTES * 8), STATUS_REPLY_MAX)


def _nothing_to_do(connection: Connection) -> None:
    pass
