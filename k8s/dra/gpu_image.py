"""Write the end-to-end run's container image (docker-archive format, what `ctr images import`
reads): k8s/test/busybox_image.py's static busybox, plus a layer with a CUDA program and what
it needs, so that a pod's process is a real client of the nvshare scheduler on the simulated
driver: simapp and the simulated libcuda.so.1 / libnvidia-ml.so.1 (tests/simcuda) in
/usr/lib/sim, and the C library they and libnvshare.so load, from this machine.

    python gpu_image.py BUSYBOX SIMCUDA_BUILD_DIR OUTPUT.tar NAME:TAG
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test"))
from busybox_image import layer as busybox_layer  # noqa: E402  (k8s/test/busybox_image.py)

SIM_DIR = "usr/lib/sim"


def shared_libraries(binary: Path) -> list[Path]:
    """The libraries `binary` loads (ldd), the dynamic loader included."""
    found = []
    for line in subprocess.run(["ldd", str(binary)], check=True, capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/") and "libcuda" not in path:
            found.append(Path(path))
    return found


def gpu_layer(simcuda: Path) -> bytes:
    programs = [simcuda / "simapp", simcuda / "libcuda.so.1", simcuda / "libnvidia-ml.so.1"]
    libraries = sorted({library for program in programs for library in shared_libraries(program)}
                       | {Path("/lib/x86_64-linux-gnu/libdl.so.2"), Path("/lib/x86_64-linux-gnu/libpthread.so.0"),
                          Path("/lib/x86_64-linux-gnu/librt.so.1"), Path("/lib/x86_64-linux-gnu/libm.so.6")})
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        made = set()
        for target, source in [(f"{SIM_DIR}/{p.name}", p) for p in programs] + [(str(p)[1:], p) for p in libraries]:
            parts = Path(target).parts
            for depth in range(1, len(parts)):
                directory = "/".join(parts[:depth])
                if directory not in made and directory not in ("bin", "usr", "usr/lib", "var", "etc", "tmp"):
                    info = tarfile.TarInfo(directory)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                    made.add(directory)
            data = source.resolve().read_bytes()
            info = tarfile.TarInfo(target)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def main(busybox: str, simcuda: str, output: str, name: str) -> None:
    layers = [busybox_layer(busybox), gpu_layer(Path(simcuda))]
    diff_ids = ["sha256:" + hashlib.sha256(data).hexdigest() for data in layers]
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["/bin/sleep", "2147483647"], "Env": ["PATH=/bin", f"LD_LIBRARY_PATH=/{SIM_DIR}"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    names = [f"layer{index}.tar" for index in range(len(layers))]
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name], "Layers": names}]).encode()
    with tarfile.open(output, "w") as archive:
        for member, data in [*zip(names, layers), (config_name, config), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main(*sys.argv[1:])
