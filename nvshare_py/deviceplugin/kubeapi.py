"""The Kubernetes API server as the device plugin reads it: the pods of one node, listed and
then watched (https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes).

In a cluster the plugin finds the API server the way every in-cluster client does: the address
in KUBERNETES_SERVICE_HOST/PORT, the CA and the service account token under
/var/run/secrets/kubernetes.io/serviceaccount. The token is read for every request, since the
kubelet rotates bound service account tokens in place. HTTP is httpx (async, streaming), so the
watch is one cancellable task of the plugin's asyncio tree.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Mapping

import httpx

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CONNECT_TIMEOUT_S = 10.0
# The API server ends a watch after this long (a new one resumes from the last version seen);
# a connection that stays silent well past it is dead, not idle: bookmarks arrive meanwhile.
WATCH_SECONDS = 300
WATCH_READ_TIMEOUT_S = WATCH_SECONDS + 60.0


class ApiError(RuntimeError):
    """The API server refused a request, or answered with something that is not the API."""


class WatchExpired(ApiError):
    """The version a watch resumes from is too old (410 Gone): list again."""


@dataclass(frozen=True)
class ApiServer:
    url: str
    token_file: Path
    ca_file: Path

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] = os.environ,
                   service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> "ApiServer | None":
        """The API server of the cluster this process runs in; None outside a cluster."""
        host = environ.get("KUBERNETES_SERVICE_HOST")
        port = environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            return None
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", service_account_dir / "token", service_account_dir / "ca.crt")

    def client(self) -> httpx.AsyncClient:
        """A client for this server; use as an async context manager."""
        try:
            tls = ssl.create_default_context(cafile=str(self.ca_file))
        except OSError as error:
            raise ApiError(f"cannot read the cluster's CA certificate {self.ca_file}: {error.strerror or error}") from None
        return httpx.AsyncClient(base_url=self.url, verify=tls, auth=_TokenFile(self.token_file),
                                 timeout=httpx.Timeout(CONNECT_TIMEOUT_S), trust_env=False)


class _TokenFile(httpx.Auth):
    def __init__(self, path: Path) -> None:
        self.path = path

    def auth_flow(self, request: httpx.Request):
        try:
            token = self.path.read_text().strip()
        except OSError as error:
            raise ApiError(f"cannot read the service account token {self.path}: {error.strerror or error}") from None
        request.headers["Authorization"] = f"Bearer {token}"
        yield request


def _pods_query(node: str) -> dict[str, str]:
    return {"fieldSelector": f"spec.nodeName={node}"}


def _check(response: httpx.Response, what: str) -> None:
    if response.status_code != 200:
        detail = response.text[:300] if not response.is_stream_consumed else ""
        raise ApiError(f"{what}: HTTP {response.status_code} {detail}".rstrip())


async def list_pods(client: httpx.AsyncClient, node: str) -> tuple[list[dict], str]:
    """The pods on `node`, and the resource version to watch from."""
    response = await client.get("/api/v1/pods", params=_pods_query(node))
    _check(response, f"listing the pods of node {node}")
    try:
        document = response.json()
        return list(document["items"] or []), str(document["metadata"]["resourceVersion"])
    except (ValueError, KeyError, TypeError):
        raise ApiError("the pod list is not a PodList") from None


async def post_event(client: httpx.AsyncClient, event: dict) -> None:
    """Creates an Event (core/v1) in the namespace of its object."""
    namespace = event["involvedObject"]["namespace"]
    response = await client.post(f"/api/v1/namespaces/{namespace}/events", json=event)
    if response.status_code not in (200, 201):
        raise ApiError(f"creating an event in {namespace}: HTTP {response.status_code} {response.text[:300]}".rstrip())


async def watch_pods(client: httpx.AsyncClient, node: str, version: str) -> AsyncIterator[tuple[str, dict]]:
    """Changes to the pods on `node` after `version`, as (type, object): ADDED, MODIFIED,
    DELETED with the pod; BOOKMARK with a newer version only. Ends when the server ends the
    watch; raises WatchExpired when `version` is too old."""
    params = dict(_pods_query(node), watch="true", resourceVersion=version, allowWatchBookmarks="true",
                  timeoutSeconds=str(WATCH_SECONDS))
    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=WATCH_READ_TIMEOUT_S)
    async with client.stream("GET", "/api/v1/pods", params=params, timeout=timeout) as response:
        if response.status_code != 200:
            await response.aread()
            if response.status_code == 410:
                raise WatchExpired("the watch's resource version is too old")
            _check(response, f"watching the pods of node {node}")
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
            except (ValueError, KeyError, TypeError):
                raise ApiError(f"a watch event is not JSON of the API: {line[:200]!r}") from None
            if kind == "ERROR":
                # A Status object; 410 ("Expired"/"Gone") means: list again.
                if isinstance(obj, dict) and obj.get("code") == 410:
                    raise WatchExpired(obj.get("message", "the watch expired"))
                raise ApiError(f"the watch failed: {obj.get('message') if isinstance(obj, dict) else obj}")
            yield kind, obj
