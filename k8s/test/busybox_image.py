"""Write a tiny container image (docker-archive format, what `ctr images import` reads) whose
root file system is a static busybox and nothing else, for tests on machines that cannot reach a
registry. Its default command sleeps forever, so it also serves as the pod sandbox ("pause")
image.

    python busybox_image.py BUSYBOX OUTPUT.tar NAME:TAG
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile

APPLETS = ("sh", "sleep", "env", "ls", "cat", "grep", "test", "stat", "echo", "head", "id", "true")
DIRECTORIES = ("bin", "dev", "proc", "sys", "etc", "tmp", "var", "var/run", "usr", "usr/lib")


def layer(busybox: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in DIRECTORIES:
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        with open(busybox, "rb") as binary:
            data = binary.read()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    return buffer.getvalue()


def main(busybox: str, output: str, name: str) -> None:
    layer_tar = layer(busybox)
    diff_id = "sha256:" + hashlib.sha256(layer_tar).hexdigest()
    config = json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": ["/bin/sleep", "2147483647"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name], "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(output, "w") as archive:
        for member, data in (("layer.tar", layer_tar), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main(*sys.argv[1:])
