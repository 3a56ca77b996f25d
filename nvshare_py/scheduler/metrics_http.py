"""Serving the scheduler's metrics over HTTP (`nvshare-scheduler --metrics ADDRESS`,
docs/metrics.md): a small HTTP/1.1 server on the daemon's Trio thread, hardened like its
Unix sockets (docs/scheduler.md, *Security model*).

- Every scrape is served from a *snapshot*: the exposition rendered at most once per
  SNAPSHOT_INTERVAL, whatever the number of scrapers; scrapes that arrive while one is being
  rendered wait for it. So scraping costs the pump one status document and one stepped render
  per interval, never one per request.
- Connections are bounded: at most CONNECTIONS_MAX at once and PER_PEER_MAX from one address.
  When the table (or the peer's share) is full, the connection that has waited longest
  without finishing its request makes room, so that nobody can keep scrapers out by holding
  connections open; a request must arrive within REQUEST_TIMEOUT and the answer be taken
  within SEND_TIMEOUT.
- Running out of descriptors makes the acceptor wait and try again, never end.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Awaitable, Callable

import trio
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .logs import RateLimit, log, note

SNAPSHOT_INTERVAL = 1.0  # seconds; Prometheus scrapes every 15 s or more
CONNECTIONS_MAX = 16
PER_PEER_MAX = 4
REQUEST_TIMEOUT = 5.0
SEND_TIMEOUT = 10.0
REQUEST_MAX = 8192
ACCEPT_RETRY = 0.1
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Snapshot:
    """The exposition, rendered by `render` at most every `interval` seconds; callers in
    between get the last one, callers during a render wait for it."""

    def __init__(self, render: Callable[[], Awaitable[bytes]], interval: float = SNAPSHOT_INTERVAL) -> None:
        self.render = render
        self.interval = interval
        self.renders = 0
        self._body = b""
        self._taken = -float("inf")
        self._rendering: trio.Event | None = None

    async def get(self) -> bytes:
        if self._rendering is not None:
            await self._rendering.wait()
            return self._body
        if trio.current_time() - self._taken < self.interval:
            return self._body
        self._rendering = done = trio.Event()
        try:
            self._body = await self.render()
            self._taken = trio.current_time()
            self.renders += 1
        finally:
            self._rendering = None
            done.set()
        return self._body


class _Pending:
    """A connection that has not sent its whole request yet."""

    __slots__ = ("peer", "scope", "counted")

    def __init__(self, peer: str, scope: trio.CancelScope) -> None:
        self.peer = peer
        self.scope = scope
        self.counted = True  # in MetricsServer.open (until _make_room closes it)


class MetricsServer:
    def __init__(self, sockets: list[socket.socket], snapshot: Snapshot) -> None:
        self.sockets = sockets
        self.snapshot = snapshot
        self.open: dict[str, int] = {}  # peer address -> connections
        self._pending: list[_Pending] = []  # oldest first
        self._log = RateLimit()

    async def serve(self) -> None:
        """Answer `GET /metrics` (and `/`) on the sockets from bind_metrics until cancelled."""
        for sock in self.sockets:
            host, port = sock.getsockname()[:2]
            log.info("serving metrics address=%s", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        async with trio.open_nursery() as nursery:
            for sock in self.sockets:
                nursery.start_soon(self._accept, sock, nursery)

    async def _accept(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        while True:
            await trio.lowlevel.wait_readable(listener)
            try:
                sock, address = listener.accept()
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                note("cannot accept a metrics connection", self._log, error=exc.strerror)
                await trio.sleep(ACCEPT_RETRY)
                continue
            peer = str(address[0]) if isinstance(address, tuple) else ""
            if not self._make_room(peer):
                sock.close()
                note("metrics connection refused", self._log, peer=peer, reason="too many connections")
                continue
            sock.setblocking(False)
            self.open[peer] = self.open.get(peer, 0) + 1
            nursery.start_soon(self._serve, trio.SocketStream(trio.socket.from_stdlib_socket(sock)), peer)

    def _make_room(self, peer: str) -> bool:
        """Whether a new connection from `peer` may be served, closing the connection that
        has waited longest for its request if that is what it takes."""
        while sum(self.open.values()) >= CONNECTIONS_MAX or self.open.get(peer, 0) >= PER_PEER_MAX:
            crowded = peer if self.open.get(peer, 0) >= PER_PEER_MAX else None
            victim = next((p for p in self._pending if crowded is None or p.peer == crowded), None)
            if victim is None:
                return False
            self._pending.remove(victim)
            victim.scope.cancel()
            # Its task has not run its `finally` yet: count it out now.
            self.open[victim.peer] -= 1
            victim.counted = False
        return True

    async def _serve(self, stream: trio.SocketStream, peer: str) -> None:
        pending = _Pending(peer, trio.CancelScope(deadline=trio.current_time() + REQUEST_TIMEOUT))
        self._pending.append(pending)
        try:
            async with stream:
                request = None
                with pending.scope:
                    request = await _read_request(stream)
                if pending in self._pending:
                    self._pending.remove(pending)
                if request is None:
                    return
                with trio.move_on_after(SEND_TIMEOUT):
                    await self._answer(stream, request)
        finally:
            if pending in self._pending:
                self._pending.remove(pending)
            if pending.counted:
                self.open[peer] -= 1
            if not self.open.get(peer, 1):
                del self.open[peer]

    async def _answer(self, stream: trio.SocketStream, request: bytes) -> None:
        if len(request) > REQUEST_MAX:
            await _respond(stream, "431 Request Header Fields Too Large", b"request too large\n")
            return
        method, _, rest = request.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            await _respond(stream, "405 Method Not Allowed", b"GET only\n")
        elif path not in (b"/metrics", b"/"):
            await _respond(stream, "404 Not Found", b"metrics are at /metrics\n")
        else:
            try:
                body = await self.snapshot.get()
            except Exception:
                log.exception("cannot render metrics")
                await _respond(stream, "500 Internal Server Error", b"see the scheduler's log\n")
                return
            await _respond(stream, "200 OK", body, CONTENT_TYPE_LATEST, head=method == b"HEAD")


async def _read_request(stream: trio.SocketStream) -> bytes | None:
    """The request's head (up to its blank line), longer than REQUEST_MAX when it is too
    long; None when the peer left or broke the connection first."""
    request = b""
    try:
        while b"\r\n\r\n" not in request and b"\n\n" not in request:
            chunk = await stream.receive_some(REQUEST_MAX)
            if not chunk:
                return None
            request += chunk
            if len(request) > REQUEST_MAX:
                break
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return None
    return request


async def _respond(stream: trio.SocketStream, status: str, body: bytes,
                   content_type: str = "text/plain; charset=utf-8", head: bool = False) -> None:
    header = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
              "Connection: close\r\n\r\n").encode()
    try:
        await stream.send_all(header if head else header + body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the scraper left


def parse_address(address: str) -> tuple[str | None, int]:
    """`HOST:PORT`, `[IPV6]:PORT` or `:PORT` (every interface); port 0 picks a free one (the
    log says which). Raises ValueError."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT or :PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host or None), int(port_text)


def bind_metrics(address: str) -> list[socket.socket]:
    """Listening sockets for `address` (every address family the host name resolves to).
    Synchronous, so that the daemon can refuse to start before it touches its socket directory;
    raises ValueError for a malformed address and OSError when the port cannot be bound."""
    host, port = parse_address(address)
    bound: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                   flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # ":PORT" binds IPv4 and IPv6 separately, as trio does
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(CONNECTIONS_MAX * 8)
            sock.setblocking(False)
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound
