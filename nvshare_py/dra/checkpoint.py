"""The claims this driver has prepared, kept on the node so that a restarted driver answers as
the one before it: a claim prepared again gets the same devices, one unprepared is cleaned up.
One JSON file, replaced in one rename on every change (never half written)."""

from __future__ import annotations

import json
from pathlib import Path

from nvshare_py.deviceplugin.injection import replace_file

from .claims import PreparedClaim

KIND = "nvshare-dra-checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """The checkpoint exists but cannot be read: the driver does not guess what it prepared."""


def load(path: Path) -> dict[str, PreparedClaim]:
    """Prepared claims by UID; none when there is no checkpoint yet."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise CheckpointError(f"cannot read the checkpoint {path}: {error.strerror}") from None
    try:
        document = json.loads(text)
        if document.get("kind") != KIND or document.get("version") != VERSION:
            raise CheckpointError(f"{path} is not a version {VERSION} {KIND}")
        claims = [PreparedClaim.from_json(claim) for claim in document["claims"]]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"the checkpoint {path} is damaged ({error}); move it away to start afresh "
                              "(claims prepared before are then prepared again when the kubelet asks)") from None
    return {claim.uid: claim for claim in claims}


def save(path: Path, claims: dict[str, PreparedClaim]) -> None:
    document = {"kind": KIND, "version": VERSION,
                "claims": [claim.to_json() for _, claim in sorted(claims.items())]}
    replace_file(path, (json.dumps(document, indent=1) + "\n").encode(), 0o600)
