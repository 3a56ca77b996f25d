"""The claims this driver has prepared, kept on the node so that a restarted driver answers as
the one before it: a claim prepared again gets the same devices, one unprepared is cleaned up.
With them, the GPUs whose scheduling mode the driver set and has not given back to the
scheduler's default (gpumodes.py), so that a restarted driver gives them back.
One JSON file, replaced in one rename on every change (never half written)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nvshare_py.deviceplugin.injection import replace_file

from .claims import PreparedClaim

KIND = "nvshare-dra-checkpoint"
VERSION = 1  # without `modesSet` (and devices without `mode`): from a driver before claims' modes


class CheckpointError(RuntimeError):
    """The checkpoint exists but cannot be read: the driver does not guess what it prepared."""


@dataclass(frozen=True)
class Checkpoint:
    claims: dict[str, PreparedClaim] = field(default_factory=dict)  # by UID
    modes_set: frozenset[str] = frozenset()  # GPU UUIDs


def load(path: Path) -> Checkpoint:
    """What the driver had prepared; nothing when there is no checkpoint yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Checkpoint()
    except OSError as error:
        raise CheckpointError(f"cannot read the checkpoint {path}: {error.strerror}") from None
    try:
        document = json.loads(text)
        if document.get("kind") != KIND or document.get("version") != VERSION:
            raise CheckpointError(f"{path} is not a version {VERSION} {KIND}")
        claims = [PreparedClaim.from_json(claim) for claim in document["claims"]]
        modes_set = document.get("modesSet", [])
        if not isinstance(modes_set, list) or not all(isinstance(uuid, str) for uuid in modes_set):
            raise ValueError(f"modesSet is not a list of GPU UUIDs: {modes_set!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"the checkpoint {path} is damaged ({error}); move it away to start afresh "
                              "(claims prepared before are then prepared again when the kubelet asks)") from None
    return Checkpoint({claim.uid: claim for claim in claims}, frozenset(modes_set))


def save(path: Path, checkpoint: Checkpoint) -> None:
    document = {"kind": KIND, "version": VERSION,
                "claims": [claim.to_json() for _, claim in sorted(checkpoint.claims.items())],
                "modesSet": sorted(checkpoint.modes_set)}
    replace_file(path, (json.dumps(document, indent=1) + "\n").encode(), 0o600)
