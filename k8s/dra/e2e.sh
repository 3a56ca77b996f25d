#!/usr/bin/env bash
# The nvshare DRA driver end to end on a real Kubernetes 1.34 (opt-in; not part of the test suite).
#
#   sudo PYTHON=/path/to/venv/bin/python k8s/dra/e2e.sh [RESULT_DIR]      # exit status 0: all passed
#
# 1. Builds (once, into $NVDRA_WORK, default /var/tmp/nvdra) Kubernetes, etcd, containerd and the
#    CNI loopback plugin from their Go modules with the machine's Go (k8s/dra/build.sh).
# 2. Compares the driver's protos with the kubelet's own (k8s.io/kubelet of that release, from
#    the Go module cache; grpcio-tools in a venv of its own under $NVDRA_WORK).
# 3. Runs k8s/dra/e2e.py twice: on a cluster with DRAConsumableCapacity (one device per GPU that
#    many claims share) and on one without it (the driver's share devices). Each starts a control
#    plane and a node on loopback addresses, the nvshare scheduler and the DRA driver on the
#    simulated GPUs, runs k8s/dra/examples' claims with pods that print what they got and run a
#    CUDA program, checks it all, deletes them and checks the cleanup.
# Results: RESULT_DIR (default k8s/dra/results) gets e2e-<date>-<version>-<mode>.json and
# protos-<date>-<version>.txt. KUBERNETES_VERSION (default 1.34.4) picks another release, with
# NVDRA_WORK pointing at a directory of its own (its bin/ holds one release).
# Needs root, go, make, cc, openssl, busybox (busybox-static), runc (Debian's works) and a
# Python with nvshare_py's test extra (PYTHON).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python3}
RESULTS=${1:-$REPO/k8s/dra/results}
W=${NVDRA_WORK:-/var/tmp/nvdra}
DATE=$(date -u +%Y-%m-%d)
export PATH=$PATH:/usr/local/go/bin

[ "$(id -u)" = 0 ] || { echo "e2e.sh: run as root (containerd and the kubelet need it)" >&2; exit 2; }
for tool in go make cc openssl busybox runc; do
    command -v "$tool" >/dev/null || { echo "e2e.sh: $tool is missing (see the header)" >&2; exit 2; }
done
mkdir -p "$RESULTS"

export NVSHARE_KUBE_BIN=$(NVDRA_WORK=$W "$REPO/k8s/dra/build.sh")
version=$("$NVSHARE_KUBE_BIN/kubelet" --version | sed 's/^Kubernetes v//')
apis=$(go mod download -json "k8s.io/kubelet@v0.${version#*.}" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')/pkg/apis
[ -x "$W/protoc-venv/bin/python" ] || { "$PYTHON" -m venv "$W/protoc-venv" && "$W/protoc-venv/bin/pip" -q install grpcio-tools; }
(cd "$REPO" && "$W/protoc-venv/bin/python" -m nvshare_py.dra.kubeletapi.regenerate --compare "$apis") \
    | tee "$RESULTS/protos-$DATE-$version.txt"

status=0
"$PYTHON" "$REPO/k8s/dra/e2e.py" "$RESULTS/e2e-$DATE-$version-consumable-capacity.json" || status=1
"$PYTHON" "$REPO/k8s/dra/e2e.py" --no-consumable-capacity "$RESULTS/e2e-$DATE-$version-share-devices.json" || status=1
exit $status
