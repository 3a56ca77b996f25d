"""Regenerate the stubs of dra_v1.proto, dra_v1beta1.proto and registration.proto, or compare
those protos with the kubelet's own.

    python -m nvshare_py.dra.kubeletapi.regenerate                 # needs grpcio-tools
    python -m nvshare_py.dra.kubeletapi.regenerate --compare DIR   # needs grpcio-tools

DIR is the `pkg/apis` directory of the k8s.io/kubelet module (`go mod download -json
k8s.io/kubelet@v0.34.4` prints where it is). The comparison compiles the upstream files, less
their Go-only gogoproto options, and checks that the package, every message (field names,
numbers, labels, types) and every service method (types, streaming) are the same as ours;
comments and option lines may differ. Exit status 1 and one line per difference otherwise; a
field we have and an older upstream lacks is a note, not a difference.
The stubs are made as the device plugin's (nvshare_py/deviceplugin/v1beta1/regenerate.py).
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from nvshare_py.deviceplugin.v1beta1.regenerate import generated_minimums, regenerate

HERE = Path(__file__).resolve().parent
# ours -> the upstream file under k8s.io/kubelet's pkg/apis
PROTOS = {
    HERE / "dra_v1.proto": "dra/v1/api.proto",
    HERE / "dra_v1beta1.proto": "dra/v1beta1/api.proto",
    HERE / "registration.proto": "pluginregistration/v1/api.proto",
}
_GOGO = re.compile(r'^\s*(import\s+"github\.com/gogo/[^"]*";|option\s+\(gogoproto\.[^;]*;|option\s+go_package[^;]*;)\s*$',
                   re.MULTILINE)
_FIELD_OPTIONS = re.compile(r"\s*\[\(gogoproto\.[^\]]*\]")


def _descriptor(proto_text: str, name: str):
    """The FileDescriptorProto of one proto file's text."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="nvs-proto-") as scratch:
        source = Path(scratch) / name
        source.write_text(proto_text)
        out = Path(scratch) / "set.pb"
        include = Path(protoc.__file__).parent / "_proto"
        status = protoc.main(["protoc", f"-I{scratch}", f"-I{include}", f"--descriptor_set_out={out}", name])
        if status != 0:
            raise SystemExit(f"protoc could not compile {name}")
        descriptors = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return descriptors.file[0]


def _contract(descriptor) -> dict:
    """What the wire depends on: package, messages and services, without names of files."""
    def message(m) -> dict:
        return {"fields": {f.name: (f.number, f.label, f.type, f.type_name, f.proto3_optional) for f in m.field},
                "nested": {n.name: message(n) for n in m.nested_type},
                "map_entry": m.options.map_entry}
    return {"package": descriptor.package,
            "messages": {m.name: message(m) for m in descriptor.message_type},
            "services": {s.name: sorted((m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                                        for m in s.method) for s in descriptor.service}}


def _differences(ours: dict, theirs: dict, where: str = "") -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = []
        for key in sorted(set(ours) | set(theirs)):
            if key not in ours:
                found.append(f"{where}{key}: only upstream")
            elif key not in theirs:
                found.append(f"{where}{key}: only here")
            else:
                found += _differences(ours[key], theirs[key], f"{where}{key}.")
        return found
    return [] if ours == theirs else [f"{where.rstrip('.')}: here {ours!r}, upstream {theirs!r}"]


def compare(apis_dir: Path) -> tuple[list[str], list[str]]:
    """(differences, notes) between our protos and upstream's: a field only here is a note (a
    newer API than the one compared with; its older peers skip unknown fields), anything else
    a difference."""
    differences: list[str] = []
    notes: list[str] = []
    for ours, upstream in PROTOS.items():
        upstream_text = _FIELD_OPTIONS.sub("", _GOGO.sub("", (apis_dir / upstream).read_text()))
        theirs = _contract(_descriptor(upstream_text, "upstream.proto"))
        mine = _contract(_descriptor(ours.read_text(), "ours.proto"))
        for line in _differences(mine, theirs):
            newer = ".fields." in line and line.endswith(": only here")
            (notes if newer else differences).append(f"{ours.name} against {upstream}: {line}")
    return differences, notes


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["--compare"] and len(arguments) == 2:
        found, notes = compare(Path(arguments[1]))
        for line in found:
            print(line)
        for line in notes:
            print(f"note: {line}")
        print(f"{len(PROTOS)} protos compared with {arguments[1]}: {len(found)} differences, {len(notes)} notes")
        raise SystemExit(1 if found else 0)
    if arguments:
        raise SystemExit(__doc__)
    regenerate(list(PROTOS))
    for proto in PROTOS:
        print(proto.name, " ".join(f"{package}>={version}" for package, version in generated_minimums(proto).items()))
