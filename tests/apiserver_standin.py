"""A stand-in for the Kubernetes API server's pod endpoints, over real HTTPS, for the device
plugin's pod watcher.

It does what the API server does for `GET /api/v1/pods`, as far as a node's pod watcher sees:
- bearer-token authentication (401 without the token) and TLS with a certificate of its own CA;
- `fieldSelector=spec.nodeName=<node>` (the only selector it knows; anything else is 400);
- a list answers a PodList whose `metadata.resourceVersion` is the store's current version;
- `watch=true&resourceVersion=N` streams, as chunked JSON lines, every change after N
  (ADDED / MODIFIED / DELETED with the whole object, each with its own resourceVersion), then
  waits for more until `timeoutSeconds` or `end_watches()`; a version older than the history it
  keeps is answered as the real server does: HTTP 200 and one ERROR event with a 410 Status;
- compaction (`annotate(..., compact=True)` compacts right after the change): a watch that
  has not delivered everything ends, and resuming from any version before it gets 410;
- `allowWatchBookmarks=true` gets a BOOKMARK when a watch is ended by `end_watches()`;
- `POST /api/v1/namespaces/<ns>/events` records an Event (201), kept in `events`; with
  `events_forbidden` it answers 403 as the API server does without RBAC for it.
It is a test double for what the pod watcher relies on, not for the rest of the API.
"""

from __future__ import annotations

import copy
import json
import ssl
import subprocess
import threading
import time
import uuid as uuidlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

WAIT_TIMEOUT_S = 60.0
TOKEN = "standin-service-account-token"


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (also its own CA), and its key."""
    cert, key = directory / "ca.crt", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=kubernetes", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


class ApiServerStandin:
    handler: type | None = None  # the request handler class (None: _Handler below); a subclass may serve more

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.ca_file, key = make_certificate(self.directory)
        self.token_file = self.directory / "token"
        self.token_file.write_text(TOKEN + "\n")
        self._pods: dict[tuple[str, str], dict] = {}
        self._history: list[tuple[int, str, dict]] = []  # (version, type, object)
        self._oldest = 1  # the oldest version a watch may resume from
        self._version = 1
        self._watch_generation = 0
        self._changed = threading.Condition()
        self.requests: list[dict] = []  # method, path, query, authorized
        self.lists = 0  # answered pod lists
        self.events: list[dict] = []
        self.events_forbidden = False
        handler = type("Handler", (self.handler or _Handler,), {"standin": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(self.ca_file, key)
        # The handshake happens in the handler's thread, under its timeout: a client that goes
        # away mid-handshake (a cancelled watcher) must not hold up the accepting thread, which
        # stop() waits for.
        self._server.socket = tls.wrap_socket(self._server.socket, server_side=True, do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._server.serve_forever, name="apiserver", daemon=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "ApiServerStandin":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.end_watches()
        self._server.shutdown()
        self._server.server_close()

    # ---- the store ------------------------------------------------------------------------

    def add_pod(self, name: str, node: str, annotations: dict[str, str] | None = None,
                namespace: str = "default", uid: str | None = None) -> str:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuidlib.uuid4()),
                            "annotations": dict(annotations or {})},
               "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.example.com/app"}]},
               "status": {"phase": "Running"}}
        self._change("ADDED", pod)
        return pod["metadata"]["uid"]

    def annotate(self, name: str, annotations: dict[str, str | None], namespace: str = "default",
                 compact: bool = False) -> None:
        """`kubectl annotate`: None removes an annotation. `compact`: etcd compacts the history
        at once, so the change is only seen by listing again."""
        with self._changed:
            pod = copy.deepcopy(self._pods[namespace, name])
        for key, value in annotations.items():
            if value is None:
                pod["metadata"]["annotations"].pop(key, None)
            else:
                pod["metadata"]["annotations"][key] = value
        self._change("MODIFIED", pod, compact)

    def set_phase(self, name: str, phase: str, namespace: str = "default") -> None:
        with self._changed:
            pod = copy.deepcopy(self._pods[namespace, name])
        pod["status"]["phase"] = phase
        self._change("MODIFIED", pod)

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        with self._changed:
            pod = copy.deepcopy(self._pods[namespace, name])
        self._change("DELETED", pod)

    def end_watches(self) -> None:
        """The server ends every open watch (as its timeout does), with a bookmark first."""
        with self._changed:
            self._watch_generation += 1
            self._changed.notify_all()

    def _change(self, kind: str, pod: dict, compact: bool = False) -> None:
        with self._changed:
            self._version += 1
            pod["metadata"]["resourceVersion"] = str(self._version)
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            if kind == "DELETED":
                del self._pods[key]
            else:
                self._pods[key] = pod
            self._history.append((self._version, kind, copy.deepcopy(pod)))
            if compact:
                self._version += 1
                self._oldest = self._version
                self._history.clear()
            self._changed.notify_all()

    # ---- what tests use -------------------------------------------------------------------

    def wait_until(self, predicate, timeout: float = WAIT_TIMEOUT_S, what: str = "condition"):
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = predicate()
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"API server stand-in: no {what} within {timeout} s; "
                                       f"requests so far: {self.requests[-10:]}")
                self._changed.wait(min(left, 0.5))

    # ---- serving (handler threads) --------------------------------------------------------

    def _note(self, record: dict) -> None:
        with self._changed:
            self.requests.append(record)
            self._changed.notify_all()

    def _list(self, node: str) -> dict:
        with self._changed:
            self.lists += 1
            self._changed.notify_all()
            items = [copy.deepcopy(pod) for pod in self._pods.values() if pod["spec"]["nodeName"] == node]
            return {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(self._version)},
                    "items": items}

    def _watch(self, node: str, since: int, seconds: float, bookmarks: bool, send) -> None:
        """Streams the changes after `since` through `send` (outside the lock: a slow reader
        never holds up the store)."""
        deadline = time.monotonic() + seconds
        with self._changed:
            generation = self._watch_generation
            expired = since < self._oldest or since > self._version
            oldest = self._oldest
        if expired:
            send({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                              "reason": "Expired", "code": 410,
                                              "message": f"too old resource version: {since} ({oldest})"}})
            return
        sent = since
        while True:
            with self._changed:
                events = [{"type": kind, "object": pod} for version, kind, pod in self._history
                          if version > sent and pod["spec"]["nodeName"] == node]
                if sent < self._oldest:
                    return  # compacted past what this watch delivered: it ends, and cannot resume
                sent = self._version
                ended = self._watch_generation != generation
                if not events and not ended and time.monotonic() < deadline:
                    self._changed.wait(min(0.5, max(0.0, deadline - time.monotonic())))
                    continue
            for event in events:
                send(event)
            if ended:
                if bookmarks:
                    send({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                                                         "metadata": {"resourceVersion": str(sent)}}})
                return
            if time.monotonic() >= deadline:
                return


class _Handler(BaseHTTPRequestHandler):
    standin: ApiServerStandin
    protocol_version = "HTTP/1.1"
    timeout = WAIT_TIMEOUT_S  # on the connection's socket: no handler waits forever for a peer

    def log_message(self, format, *args) -> None:  # the tests' output stays readable
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        authorized = self.headers.get("Authorization") == f"Bearer {TOKEN}"
        self.standin._note({"method": "GET", "path": url.path, "query": query, "authorized": authorized})
        if not authorized:
            return self._status(401, "Unauthorized")
        if url.path != "/api/v1/pods":
            return self._status(404, "NotFound")
        selector = query.get("fieldSelector", "")
        field, _, node = selector.partition("=")
        if field != "spec.nodeName" or not node:
            return self._status(400, "BadRequest")
        if query.get("watch") not in ("true", "1"):
            return self._json(self.standin._list(node))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(event: dict) -> None:
            data = json.dumps(event).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        try:
            self.standin._watch(node, int(query.get("resourceVersion") or 0), float(query.get("timeoutSeconds", 1800)),
                                query.get("allowWatchBookmarks") == "true", send)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            pass  # the watcher went away
        self.close_connection = True

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        authorized = self.headers.get("Authorization") == f"Bearer {TOKEN}"
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.standin._note({"method": "POST", "path": url.path, "query": {}, "authorized": authorized})
        if not authorized:
            return self._status(401, "Unauthorized")
        parts = url.path.split("/")
        if len(parts) != 6 or parts[:4] != ["", "api", "v1", "namespaces"] or parts[5] != "events":
            return self._status(404, "NotFound")
        if self.standin.events_forbidden:
            return self._status(403, "Forbidden")
        try:
            event = json.loads(body)
        except ValueError:
            return self._status(400, "BadRequest")
        if event.get("kind") != "Event" or event["involvedObject"]["namespace"] != parts[4]:
            return self._status(400, "BadRequest")
        with self.standin._changed:
            self.standin.events.append(event)
            self.standin._changed.notify_all()
        self._json(event, 201)

    def _json(self, document: dict, code: int = 200) -> None:
        data = json.dumps(document).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str) -> None:
        self._json({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code}, code)
