#!/usr/bin/env bash
# Build what the DRA tests run, from the published Go modules, with the machine's Go:
#   Kubernetes (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl),
#   etcd, containerd (with its runc shim and ctr) and the CNI loopback plugin.
#
#   k8s/dra/build.sh            # into $NVDRA_WORK (default /var/tmp/nvdra); prints the bin directory
#
# Each component is built once into $NVDRA_WORK/<component>-<version>/bin and linked into
# $NVDRA_WORK/bin, the directory tests/kube_cluster.py looks in (NVSHARE_KUBE_BIN names another).
# Nothing is written into the repository. Versions: KUBERNETES_VERSION (1.34.4), ETCD_VERSION
# (3.6.16), CONTAINERD_VERSION (2.2.9), CNI_PLUGINS_VERSION (1.9.1). Needs go (1.24 or newer)
# and the Go module proxy. k8s.io/kubernetes cannot be `go install`ed (its go.mod replaces its
# staging modules with directories its module zip does not have), nor etcd's server: each is
# built from a go.mod of our own that requires it and pins those modules at the same release.
# On a 2-core machine the first Kubernetes build takes 6 to 30 minutes, the others about one each.
set -euo pipefail

W=${NVDRA_WORK:-/var/tmp/nvdra}
KUBERNETES_VERSION=${KUBERNETES_VERSION:-1.34.4}
ETCD_VERSION=${ETCD_VERSION:-3.6.16}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-2.2.9}
CNI_PLUGINS_VERSION=${CNI_PLUGINS_VERSION:-1.9.1}
export PATH=$PATH:/usr/local/go/bin
command -v go >/dev/null || { echo "build.sh: go is missing" >&2; exit 2; }
export CGO_ENABLED=0
mkdir -p "$W/bin"
say() { printf '%s build: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# go_module DIR MODULE VERSION [REPLACED_MODULE...]: a go.mod requiring MODULE@VERSION, with the
# named modules pinned by `replace` to the versions given as module@version.
go_module() {
    local dir=$1 module=$2 version=$3; shift 3
    mkdir -p "$dir/bin"
    {
        printf 'module nvdra.local/build\n\ngo 1.24\n\nrequire %s v%s\n' "$module" "$version"
        if [ $# -gt 0 ]; then
            printf '\nreplace (\n'
            for pinned in "$@"; do printf '\t%s => %s %s\n' "${pinned%@*}" "${pinned%@*}" "${pinned#*@}"; done
            printf ')\n'
        fi
    } > "$dir/go.mod"
}

# tools DIR PACKAGE...: a file that imports the packages, so that `go mod tidy` keeps them.
tools() {
    local dir=$1; shift
    { printf '//go:build tools\n\npackage tools\n\nimport (\n'
      for package in "$@"; do printf '\t_ "%s"\n' "$package"; done
      printf ')\n'; } > "$dir/tools.go"
    (cd "$dir" && go mod tidy >/dev/null 2>&1)
}

link() { for binary in "$@"; do ln -sf "$binary" "$W/bin/"; done; }

# ---- Kubernetes -----------------------------------------------------------------------------
K=$W/k8s-$KUBERNETES_VERSION
if [ ! -x "$K/bin/kubectl" ]; then
    say "Kubernetes v$KUBERNETES_VERSION"
    dir=$(go mod download -json "k8s.io/kubernetes@v$KUBERNETES_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    staging=$(sed -n '/^replace (/,/^)/p' "$dir/go.mod" | awk '/=> \.\/staging/ {print $1}')
    minor=${KUBERNETES_VERSION#*.}
    go_module "$K" k8s.io/kubernetes "$KUBERNETES_VERSION" $(for m in $staging; do echo "$m@v0.$minor"; done)
    commands=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)
    tools "$K" "${commands[@]/#/k8s.io/kubernetes/cmd/}"
    version=k8s.io/component-base/version
    flags="-s -w -X $version.gitVersion=v$KUBERNETES_VERSION -X $version.gitMajor=1 -X $version.gitMinor=${minor%%.*}"
    flags+=" -X $version.gitTreeState=clean -X $version.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    started=$(date +%s)
    (cd "$K" && nice go build -trimpath -ldflags "$flags" -o bin/ "${commands[@]/#/k8s.io/kubernetes/cmd/}")
    echo $(( $(date +%s) - started )) > "$K/build-seconds"
fi
link "$K"/bin/*

# ---- etcd -----------------------------------------------------------------------------------
E=$W/etcd-$ETCD_VERSION
if [ ! -x "$E/bin/etcd" ]; then
    say "etcd v$ETCD_VERSION"
    go_module "$E" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" \
        $(for m in api/v3 client/pkg/v3 client/v3 pkg/v3; do echo "go.etcd.io/etcd/$m@v$ETCD_VERSION"; done)
    tools "$E" go.etcd.io/etcd/server/v3
    (cd "$E" && nice go build -trimpath -ldflags "-s -w" -o bin/etcd go.etcd.io/etcd/server/v3)
fi
link "$E/bin/etcd"

# ---- containerd -----------------------------------------------------------------------------
C=$W/containerd-$CONTAINERD_VERSION
if [ ! -x "$C/bin/ctr" ]; then
    say "containerd v$CONTAINERD_VERSION"
    go_module "$C" github.com/containerd/containerd/v2 "$CONTAINERD_VERSION"
    commands=(containerd containerd-shim-runc-v2 ctr)
    tools "$C" "${commands[@]/#/github.com/containerd/containerd/v2/cmd/}"
    (cd "$C" && nice go build -trimpath -tags "no_btrfs no_devmapper no_zfs" \
        -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=v$CONTAINERD_VERSION" \
        -o bin/ "${commands[@]/#/github.com/containerd/containerd/v2/cmd/}")
fi
link "$C"/bin/*

# ---- CNI: the loopback plugin (the test node has no pod network) ------------------------------
N=$W/cni-$CNI_PLUGINS_VERSION
if [ ! -x "$N/bin/loopback" ]; then
    say "CNI plugins v$CNI_PLUGINS_VERSION (loopback)"
    go_module "$N" github.com/containernetworking/plugins "$CNI_PLUGINS_VERSION"
    tools "$N" github.com/containernetworking/plugins/plugins/main/loopback
    (cd "$N" && go build -trimpath -ldflags "-s -w" -o bin/loopback github.com/containernetworking/plugins/plugins/main/loopback)
fi
link "$N/bin/loopback"

echo "$W/bin"
