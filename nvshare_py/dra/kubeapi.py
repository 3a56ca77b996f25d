"""The API server as the DRA driver uses it (resource.k8s.io/v1, Kubernetes 1.34 and later):
its ResourceSlices (listed, created, replaced, deleted), the ResourceClaims the kubelet asks
it to prepare (read), and its Node (read, for the slices' owner). The connection, the
credentials and the pods of the node are the device plugin's (nvshare_py/deviceplugin/kubeapi.py).
"""

from __future__ import annotations

import httpx

from nvshare_py.deviceplugin.kubeapi import ApiError

RESOURCE_API = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_API}/resourceslices"


class NotFound(ApiError):
    """The object does not exist (HTTP 404)."""


class Conflict(ApiError):
    """The object changed since it was read (HTTP 409): read it again."""


def _json(response: httpx.Response, what: str, ok: tuple[int, ...] = (200,)) -> dict:
    if response.status_code == 404:
        raise NotFound(f"{what}: not found")
    if response.status_code == 409:
        raise Conflict(f"{what}: {_message(response)}")
    if response.status_code not in ok:
        raise ApiError(f"{what}: HTTP {response.status_code} {_message(response)}".rstrip())
    try:
        document = response.json()
    except ValueError:
        raise ApiError(f"{what}: the answer is not JSON") from None
    if not isinstance(document, dict):
        raise ApiError(f"{what}: the answer is not an object")
    return document


def _message(response: httpx.Response) -> str:
    """The Status message of a refusal (what the API server says is wrong), else the text."""
    try:
        return str(response.json().get("message") or response.text[:300])
    except (ValueError, AttributeError):
        return response.text[:300]


async def get_claim(client: httpx.AsyncClient, namespace: str, name: str) -> dict:
    response = await client.get(f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}")
    return _json(response, f"reading ResourceClaim {namespace}/{name}")


async def get_node(client: httpx.AsyncClient, name: str) -> dict:
    return _json(await client.get(f"/api/v1/nodes/{name}"), f"reading Node {name}")


async def list_slices(client: httpx.AsyncClient, driver: str, node: str) -> list[dict]:
    """This driver's ResourceSlices of `node`."""
    params = {"fieldSelector": f"spec.driver={driver},spec.nodeName={node}"}
    document = _json(await client.get(SLICES, params=params), f"listing the ResourceSlices of node {node}")
    return list(document.get("items") or [])


async def create_slice(client: httpx.AsyncClient, document: dict) -> dict:
    return _json(await client.post(SLICES, json=document), "creating a ResourceSlice", ok=(200, 201))


async def replace_slice(client: httpx.AsyncClient, document: dict) -> dict:
    name = document["metadata"]["name"]
    return _json(await client.put(f"{SLICES}/{name}", json=document), f"replacing ResourceSlice {name}")


async def delete_slice(client: httpx.AsyncClient, name: str) -> None:
    try:
        _json(await client.delete(f"{SLICES}/{name}"), f"deleting ResourceSlice {name}", ok=(200, 202))
    except NotFound:
        pass  # gone already: what was wanted
