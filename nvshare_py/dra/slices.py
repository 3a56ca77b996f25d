"""The node's ResourceSlices: what they should say, and what it takes to get there from what
the API server has. Pure; the driver's publishing task (server.py) lists, writes and deletes.

One pool per node, named after the node, of one or more slices (at most 128 devices each, the
API's limit). A change of the devices is a new pool generation, written to every slice of
the pool. The slices are owned by the Node, so that they go when the node is deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

from .devices import DeviceSet
from .quantity import parse_quantity

MAX_DEVICES_PER_SLICE = 128
API_VERSION = "resource.k8s.io/v1"


@dataclass(frozen=True)
class Plan:
    create: list[dict]  # whole ResourceSlice objects
    replace: list[dict]  # whole objects with the resourceVersion they replace
    delete: list[str]  # names

    @property
    def empty(self) -> bool:
        return not (self.create or self.replace or self.delete)


def _chunks(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)] or [[]]


def desired_specs(devices: DeviceSet, driver: str, node: str) -> list[dict]:
    """The slices' specs, less the pool's generation."""
    chunks = _chunks(devices.documents(), MAX_DEVICES_PER_SLICE)
    return [{"driver": driver, "nodeName": node, "pool": {"name": node, "resourceSliceCount": len(chunks)},
             "devices": chunk} for chunk in chunks]


_QUANTITIES = frozenset({"value", "default", "min", "max", "step"})


def _comparable(spec: dict) -> dict:
    """A spec as the API server's copy and ours compare: without the pool's generation, and
    with every quantity a number (the server writes 16Gi where we wrote 17179869184)."""
    def walk(item: object, key: str = "") -> object:
        if isinstance(item, dict):
            return {name: walk(value, name) for name, value in item.items()}
        if isinstance(item, list):
            return [walk(value, key) for value in item]
        if key in _QUANTITIES or key == "validValues":
            try:
                return parse_quantity(item)
            except ValueError:
                return item
        return item
    pool = dict(spec.get("pool") or {})
    pool.pop("generation", None)
    return walk(dict(spec, pool=pool))  # type: ignore[return-value]


def plan(existing: list[dict], desired: list[dict], node: str, node_uid: str | None) -> Plan:
    """The writes that make `existing` (this driver's slices of the node, as listed) say
    `desired`. Nothing when they do already."""
    existing = sorted(existing, key=lambda document: document["metadata"]["name"])
    if [_comparable(document.get("spec") or {}) for document in existing] == [_comparable(spec) for spec in desired]:
        return Plan([], [], [])
    generation = 1 + max((int((document.get("spec") or {}).get("pool", {}).get("generation") or 0)
                          for document in existing), default=0)
    owner = ([{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}]
             if node_uid else [])
    replace, create = [], []
    for index, spec in enumerate(desired):
        spec = dict(spec, pool=dict(spec["pool"], generation=generation))
        if index < len(existing):
            metadata = dict(existing[index]["metadata"])
            if owner:
                metadata["ownerReferences"] = owner
            replace.append({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": metadata, "spec": spec})
        else:
            metadata = {"generateName": f"{node}-{spec['driver']}-"}
            if owner:
                metadata["ownerReferences"] = owner
            create.append({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": metadata, "spec": spec})
    delete = [document["metadata"]["name"] for document in existing[len(desired):]]
    return Plan(create, replace, delete)


def dropped_fields(sent: dict, stored: dict) -> list[str]:
    """Fields of the devices the API server did not keep: those of features the cluster does
    not have enabled (the API server drops them silently)."""
    dropped = []
    stored_devices = {device["name"]: device for device in (stored.get("spec") or {}).get("devices") or []}
    for device in (sent.get("spec") or {}).get("devices") or []:
        kept = stored_devices.get(device["name"], {})
        if device.get("allowMultipleAllocations") and not kept.get("allowMultipleAllocations"):
            dropped.append("allowMultipleAllocations")
        for name, capacity in (device.get("capacity") or {}).items():
            if "requestPolicy" in capacity and "requestPolicy" not in (kept.get("capacity") or {}).get(name, {}):
                dropped.append(f"capacity.{name}.requestPolicy")
    return sorted(set(dropped))
