"""Regenerate api_pb2.py, api_pb2.pyi and api_pb2_grpc.py from api.proto.

Run from a checkout with grpcio-tools installed:

    python -m nvshare_py.deviceplugin.v1beta1.regenerate

The proto is compiled relative to the repository root so the generated stubs import each
other as `nvshare_py.deviceplugin.v1beta1.api_pb2`, while the proto package (and so every gRPC
method path) stays `v1beta1`. The stubs demand a protobuf runtime at least as new as the
protoc in grpcio-tools and a grpcio at least as new as grpcio-tools: after regenerating, keep
the `grpcio`/`protobuf` minimums in pyproject.toml in step (`python -m ... --print-minimums`).
The DRA driver's stubs (nvshare_py/dra/kubeletapi) are made by the same two functions.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PROTO = HERE / "api.proto"


def regenerate(protos: list[Path]) -> None:
    """Compiles `protos` (files inside the checkout) into stubs beside each of them."""
    from grpc_tools import protoc

    proto_include = Path(protoc.__file__).parent / "_proto"
    status = protoc.main([
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{proto_include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *(str(proto.relative_to(ROOT)) for proto in protos),
    ])
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")


def generated_minimums(proto: Path) -> dict[str, str]:
    """The runtime versions the committed stubs of `proto` refuse to run below."""
    pb2 = proto.with_name(f"{proto.stem}_pb2.py").read_text()
    grpc_stub = proto.with_name(f"{proto.stem}_pb2_grpc.py").read_text()
    protobuf = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    grpcio = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_stub)
    found = {}
    if protobuf:
        found["protobuf"] = ".".join(protobuf.groups())
    if grpcio:
        found["grpcio"] = grpcio.group(1)
    return found


if __name__ == "__main__":
    if "--print-minimums" not in sys.argv[1:]:
        regenerate([PROTO])
    for package, version in generated_minimums(PROTO).items():
        print(f"{package}>={version}")
