"""Which prepared claims each pod of the node uses, as the pod's scheduler settings: the DRA
driver's reader for the pod watcher (nvshare_py/deviceplugin/podwatch.py), which follows the
node's pods and keeps the scheduler told through the same control requests as for annotations.

A pod names its claims in `spec.resourceClaims` (`resourceClaimName`) or through a template,
whose claim's name the pod's `status.resourceClaimStatuses` records. Of those this driver has
prepared, the pod gets the highest weight and priority any asks for, and on each GPU the
memory limit of the claims there (the largest; none if one of them has none). Every pod that
shares a claim gets its settings, also pods that join after the kubelet prepared it.
"""

from __future__ import annotations

from typing import Callable

from nvshare_py.deviceplugin.podsettings import FINISHED_PHASES, MEMORY_LIMIT, PRIORITY, WEIGHT, Pod

from .claims import PreparedClaim, merge_limits


def claim_names(document: dict) -> list[str]:
    """The names of the ResourceClaims a Pod object uses (in its namespace)."""
    names = [entry.get("resourceClaimName") for entry in (document.get("spec") or {}).get("resourceClaims") or []]
    names += [entry.get("resourceClaimName")
              for entry in (document.get("status") or {}).get("resourceClaimStatuses") or []]
    return [name for name in dict.fromkeys(names) if isinstance(name, str) and name]


def settings_of(pod_uid: str, pod_name: str, claims: list[PreparedClaim]) -> Pod:
    weights = [claim.weight for claim in claims if claim.weight is not None]
    priorities = [claim.priority for claim in claims if claim.priority is not None]
    values = {}
    if weights:
        values[WEIGHT] = max(weights)
    if priorities:
        values[PRIORITY] = max(priorities)
    limits = merge_limits(pair for claim in claims for pair in claim.gpu_limits.items())
    device_values = {(MEMORY_LIMIT, uuid): limit for uuid, limit in limits.items() if limit is not None}
    return Pod(pod_uid, pod_name, values, device_values=device_values)


def reader(prepared: Callable[[], dict[tuple[str, str], PreparedClaim]]) -> Callable[[dict], Pod | None]:
    """A pod reader over the claims `prepared()` returns, by (namespace, name)."""
    def read(document: dict) -> Pod | None:
        metadata = document.get("metadata") or {}
        uid = metadata.get("uid")
        if not isinstance(uid, str) or not uid:
            return None
        namespace = str(metadata.get("namespace", ""))
        name = f"{namespace}/{metadata.get('name', '')}"
        if (document.get("status") or {}).get("phase") in FINISHED_PHASES:
            return Pod(uid, name)
        claims = prepared()
        used = [claims[namespace, claim] for claim in claim_names(document) if (namespace, claim) in claims]
        return settings_of(uid, name, used)
    return read
