"""The API server stand-in (apiserver_standin.py: pods, events, HTTPS, the token) with what a
DRA driver also uses, as the real one answers it (resource.k8s.io/v1):

- `GET .../namespaces/<ns>/resourceclaims/<name>`: claims the test put there (`put_claim`);
- `GET /api/v1/nodes/<name>`: nodes the test put there (`put_node`);
- ResourceSlices: list (`fieldSelector` on `spec.driver` and `spec.nodeName`), get, create
  (`generateName` makes the name; a UID and a resourceVersion are given), replace (409 when
  the resourceVersion is not the stored one), delete (404 when absent). With
  `consumable_capacity = False` the stand-in drops `allowMultipleAllocations` and the capacity
  `requestPolicy` from what it stores, as an API server without DRAConsumableCapacity does.
  With `claim_gate` (a threading.Event) a claim's answer waits until it is set.

Real validation of the documents is for tests/test_dra_apiserver.py, against a real API server.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid as uuidlib
from urllib.parse import parse_qs, urlsplit

from apiserver_standin import TOKEN, ApiServerStandin, _Handler

RESOURCE = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE}/resourceslices"


class DraApiServerStandin(ApiServerStandin):
    def __init__(self, directory) -> None:
        self.handler = _DraHandler
        super().__init__(directory)
        self.claims: dict[tuple[str, str], dict] = {}
        self.nodes: dict[str, dict] = {}
        self.slices: dict[str, dict] = {}
        self.consumable_capacity = True
        self.slice_writes = 0  # creates, replaces and deletes answered
        self.claim_gate: threading.Event | None = None  # a claim's GET waits for it to be set

    def put_claim(self, claim: dict) -> None:
        with self._changed:
            metadata = claim["metadata"]
            self.claims[metadata["namespace"], metadata["name"]] = copy.deepcopy(claim)
            self._changed.notify_all()

    def delete_claim(self, namespace: str, name: str) -> None:
        with self._changed:
            self.claims.pop((namespace, name), None)

    def put_node(self, name: str) -> str:
        uid = str(uuidlib.uuid4())
        with self._changed:
            self.nodes[name] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid}}
        return uid

    def delete_slices(self) -> None:
        """Someone else removes the driver's slices (the kubelet does after a driver went away)."""
        with self._changed:
            self.slices.clear()
            self._changed.notify_all()

    def slice_list(self) -> list[dict]:
        with self._changed:
            return [copy.deepcopy(document) for _, document in sorted(self.slices.items())]

    # ---- serving (handler threads) ------------------------------------------------------

    def _store_slice(self, document: dict, name: str | None = None) -> dict:
        """Under `_changed`."""
        document = copy.deepcopy(document)
        metadata = document.setdefault("metadata", {})
        if name is None:
            name = metadata.get("name") or f"{metadata.get('generateName', 'slice-')}{uuidlib.uuid4().hex[:5]}"
            metadata["uid"] = str(uuidlib.uuid4())
        metadata["name"] = name
        metadata.pop("generateName", None)
        self._version += 1
        metadata["resourceVersion"] = str(self._version)
        if not self.consumable_capacity:
            for device in document.get("spec", {}).get("devices", []):
                device.pop("allowMultipleAllocations", None)
                for capacity in (device.get("capacity") or {}).values():
                    capacity.pop("requestPolicy", None)
        self.slices[name] = document
        self.slice_writes += 1
        self._changed.notify_all()
        return copy.deepcopy(document)


class _DraHandler(_Handler):
    standin: DraApiServerStandin

    def _authorized(self, method: str) -> tuple[str, dict] | None:
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        authorized = self.headers.get("Authorization") == f"Bearer {TOKEN}"
        self.standin._note({"method": method, "path": url.path, "query": query, "authorized": authorized})
        if not authorized:
            self._status(401, "Unauthorized")
            return None
        return url.path, query

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/api/v1/pods":
            return super().do_GET()
        found = self._authorized("GET")
        if found is None:
            return
        path, query = found
        parts = path.split("/")
        standin = self.standin
        if "resourceclaims" in parts and standin.claim_gate is not None:
            standin.claim_gate.wait(60)
        with standin._changed:
            if path.startswith(f"{RESOURCE}/namespaces/") and len(parts) == 8 and parts[6] == "resourceclaims":
                document = standin.claims.get((parts[5], parts[7]))
            elif path.startswith("/api/v1/nodes/") and len(parts) == 5:
                document = standin.nodes.get(parts[4])
            elif path == SLICES:
                wanted = dict(item.split("=", 1) for item in query.get("fieldSelector", "").split(",") if item)
                items = [copy.deepcopy(d) for d in standin.slices.values()
                         if all(str(d["spec"].get(key.split(".", 1)[1])) == value for key, value in wanted.items())]
                document = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                            "metadata": {"resourceVersion": str(standin._version)}, "items": items}
            elif path.startswith(f"{SLICES}/"):
                document = standin.slices.get(parts[-1])
            else:
                document = None
            document = copy.deepcopy(document)
        if document is None:
            return self._status(404, "NotFound")
        self._json(document)

    def _body(self) -> dict | None:
        try:
            return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError:
            self._status(400, "BadRequest")
            return None

    def do_POST(self) -> None:
        if not urlsplit(self.path).path.startswith(SLICES):
            return super().do_POST()
        found = self._authorized("POST")
        if found is None:
            return
        document = self._body()
        if document is None:
            return
        with self.standin._changed:
            stored = self.standin._store_slice(document)
        self._json(stored, 201)

    def do_PUT(self) -> None:
        found = self._authorized("PUT")
        if found is None:
            return
        path, _ = found
        document = self._body()
        if document is None:
            return
        name = path.rsplit("/", 1)[-1]
        with self.standin._changed:
            current = self.standin.slices.get(name)
            if not path.startswith(f"{SLICES}/") or current is None:
                return self._status(404, "NotFound")
            if document.get("metadata", {}).get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return self._status(409, "Conflict")
            document["metadata"]["uid"] = current["metadata"]["uid"]
            stored = self.standin._store_slice(document, name)
        self._json(stored)

    def do_DELETE(self) -> None:
        found = self._authorized("DELETE")
        if found is None:
            return
        path, _ = found
        with self.standin._changed:
            removed = self.standin.slices.pop(path.rsplit("/", 1)[-1], None) if path.startswith(f"{SLICES}/") else None
            if removed is not None:
                self.standin.slice_writes += 1
                self.standin._changed.notify_all()
        if removed is None:
            return self._status(404, "NotFound")
        self._json(removed)
