"""CDI specs (https://github.com/cncf-tags/container-device-interface, spec 0.6.0) of prepared
claims: what the container runtime adds to a container given a claim's devices.

One spec file per claim in the CDI directory (`/var/run/cdi`, where containerd and CRI-O look),
kind `<driver>/claim`, and in it one CDI device per GPU of the claim, named
`<claim UID>-<GPU UUID>`. Each holds everything a container needs for that claim
(deviceplugin/injection.py: the library, the client socket directory, the variables, the
control device nodes) plus the GPU's own device node, so that a container given any of the
claim's devices runs under nvshare. The limits go in as NVSHARE_MEMORY_LIMIT by GPU UUID: what
frameworks and `nvidia-smi` in the container see from the start (the scheduler enforces the
same limit for the pod; a process cannot raise it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from nvshare_py.deviceplugin.config import CdiNames
from nvshare_py.deviceplugin.injection import ContainerEdits, Injection, container_edits, device_nodes, replace_file
from nvshare_py.deviceplugin.inventory import PhysicalGpu

from .claims import PreparedClaim

CDI_VERSION = "0.6.0"
DEFAULT_CDI_DIR = Path("/var/run/cdi")
INSTALLER = "nvshare-dra-driver"
_READ_ONLY = ["ro", "nosuid", "nodev", "rbind", "rprivate"]


def kind(driver: str) -> str:
    return f"{driver}/claim"


def spec_path(cdi_dir: Path, driver: str, claim_uid: str) -> Path:
    return cdi_dir / f"{driver}-claim_{claim_uid}.json"


def claim_of_spec(path: Path, driver: str) -> str | None:
    """The claim UID of one of this driver's spec files; None for any other file."""
    match = re.fullmatch(re.escape(driver) + r"-claim_([-0-9a-zA-Z]+)\.json", path.name)
    return match.group(1) if match else None


def device_id(driver: str, claim_uid: str, gpu_uuid: str) -> str:
    """The fully qualified CDI name of one GPU of a claim."""
    return f"{kind(driver)}={claim_uid}-{gpu_uuid}"


def cdi_ids(claim: PreparedClaim, driver: str, gpus: dict[str, PhysicalGpu], nvidia: CdiNames,
            nvidia_kind: str) -> dict[str, tuple[str, ...]]:
    """Device name -> the CDI names the kubelet gives the runtime for it: nvshare's, and the
    node's NVIDIA spec's where the operator asked for it (--nvidia-cdi)."""
    ids = {}
    for device in claim.devices:
        names = [device_id(driver, claim.uid, device.gpu_uuid)]
        if nvidia is not CdiNames.OFF:
            gpu = gpus[device.gpu_uuid]
            names.append(f"{nvidia_kind}={gpu.uuid if nvidia is CdiNames.UUID else gpu.index}")
        ids[device.device] = tuple(names)
    return ids


def _limit_env(claim: PreparedClaim) -> str:
    return ",".join(f"{uuid}={limit}" for uuid, limit in claim.gpu_limits.items() if limit is not None)


def spec(claim: PreparedClaim, driver: str, injection: Injection, gpus: dict[str, PhysicalGpu]) -> dict:
    """The CDI spec of a prepared claim (raises MissingHostFile when the node lacks a file the
    containers need)."""
    claim_gpus = sorted({gpus[device.gpu_uuid] for device in claim.devices}, key=lambda gpu: gpu.index)
    common = container_edits(injection, claim_gpus, INSTALLER)
    limits = _limit_env(claim)
    devices = []
    for gpu in claim_gpus:
        env = dict(common.env)
        if limits:
            env["NVSHARE_MEMORY_LIMIT"] = limits
        edits = ContainerEdits(env, common.mounts, device_nodes(injection, [gpu]))
        devices.append({"name": f"{claim.uid}-{gpu.uuid}", "containerEdits": _edits(edits)})
    return {"cdiVersion": CDI_VERSION, "kind": kind(driver),
            "annotations": {f"{driver}/claim": f"{claim.namespace}/{claim.name}"},
            "devices": devices}


def _edits(edits: ContainerEdits) -> dict:
    document: dict = {"env": [f"{name}={value}" for name, value in edits.env.items()]}
    if edits.mounts:
        document["mounts"] = [{"hostPath": mount.host_path, "containerPath": mount.container_path,
                               "options": _READ_ONLY if mount.read_only else ["rbind", "rprivate"]}
                              for mount in edits.mounts]
    if edits.device_nodes:
        document["deviceNodes"] = [{"path": node.container_path, "hostPath": node.host_path,
                                    "permissions": node.permissions} for node in edits.device_nodes]
    return document


def write(path: Path, document: dict) -> None:
    replace_file(path, (json.dumps(document, indent=2) + "\n").encode(), 0o644)
