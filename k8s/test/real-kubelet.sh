#!/usr/bin/env bash
# The device plugin against a real kubelet (opt-in; not part of the default test suite).
#
#   sudo k8s/test/real-kubelet.sh [RESULT.json]
#
# Builds the kubelet from the distribution's `kubernetes` source package with the distribution's
# Go, runs it standalone (no API server) on containerd + runc, starts the nvshare scheduler and
# the device plugin on GPUs from the simulated NVML (tests/simcuda), and runs static pods that ask
# for nvshare.com/gpu. It checks registration, allocation (the pods' environment, read-only
# mounts and device nodes), health (a GPU that disappears is not allocated) and re-registration
# after a kubelet restart, and writes the outcome as JSON (default
# k8s/test/results/real-kubelet-<date>.json). Exit status 0 when every check passed.
#
# Needs root, and: apt-get install golang-go containerd runc busybox-static rsync jq dpkg-dev
# (Debian 12). Debian 12 has no `kubernetes` source package; the script fetches Debian 11's
# (1.20.2) through a private APT source list, so the system's APT configuration is not touched.
# Everything lives under $NVK_WORK (default /var/tmp/nvk; kept short: socket paths are limited),
# the kubelet build is kept there between runs, and nothing is written into the repository but
# the result. Outside it: /var/lib/kubelet/device-plugins (a 1.20 kubelet serves plugins there
# whatever its --root-dir; removed afterwards if the script created it) and the pods' logs in
# /var/log/pods and /var/log/containers (removed afterwards). Container images come from a tarball (busybox-static as the root file system), as
# no registry is needed. Ports used on loopback: 10248, 10250, 10255.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
W=${NVK_WORK:-/var/tmp/nvk}
PYTHON=${PYTHON:-python3}
RESULT=${1:-$REPO/k8s/test/results/real-kubelet-$(date -u +%Y-%m-%d).json}
SUITE=${NVK_SUITE:-bullseye}
IMAGE=registry.example.com/nvshare-test/busybox:local
TIMEOUT=${NVK_TIMEOUT:-120}

[ "$(id -u)" = 0 ] || { echo "real-kubelet.sh: run as root (containerd and the kubelet need it)" >&2; exit 2; }
for tool in go containerd runc ctr busybox rsync make cc curl jq; do
    command -v "$tool" >/dev/null || { echo "real-kubelet.sh: $tool is missing (see the header)" >&2; exit 2; }
done
mkdir -p "$W"
LOG=$W/logs
rm -rf "$LOG" && mkdir -p "$LOG"
say() { printf '%s real-kubelet: %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$LOG/steps.log" >&2; }

# ---- 1. the kubelet, from the distribution's source package ------------------------------------
KUBELET=$W/build/kubelet
if [ ! -x "$KUBELET" ]; then
    mkdir -p "$W/build/apt/lists/partial" "$W/build/src"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $SUITE main" \
        > "$W/build/apt/sources.list"
    APT=(-o "Dir::Etc::SourceList=$W/build/apt/sources.list" -o "Dir::Etc::SourceParts=$W/build/apt/none"
         -o "Dir::State::Lists=$W/build/apt/lists")
    say "fetching the kubernetes source package ($SUITE)"
    apt-get "${APT[@]}" update >"$LOG/apt.log" 2>&1
    apt-cache "${APT[@]}" showsrc kubernetes | grep -m1 '^Version:' | tee -a "$LOG/steps.log"
    # The Debian packaging (debian.tar.xz) is not needed to build the kubelet: the orig tarball is
    # the upstream tree. Its download may fail on a mirror that dropped it; the orig is enough.
    (cd "$W/build/src" && apt-get "${APT[@]}" source --download-only kubernetes >>"$LOG/apt.log" 2>&1) || true
    orig=$(ls "$W"/build/src/kubernetes_*.orig.tar.gz | head -n1)
    [ -f "$orig" ] || { echo "real-kubelet.sh: no kubernetes source in $W/build/src (see $LOG/apt.log)" >&2; exit 1; }
    rm -rf "$W/build/tree" && mkdir -p "$W/build/tree"
    tar -xzf "$orig" -C "$W/build/tree" --strip-components=1
    say "building the kubelet with $(go version)"
    started=$(date +%s)
    (cd "$W/build/tree" && GOCACHE=$W/build/gocache make WHAT=cmd/kubelet >"$LOG/build.log" 2>&1)
    cp "$W/build/tree/_output/local/bin/linux/amd64/kubelet" "$KUBELET"
    echo $(( $(date +%s) - started )) > "$W/build/seconds"
    say "built in $(cat "$W/build/seconds") s"
fi
KUBELET_VERSION=$("$KUBELET" --version)

# ---- 2. the node: nvshare parts, device nodes, image, containerd --------------------------------
PIDS=()
KUBELET_PID=
# A 1.20 kubelet serves device plugins in /var/lib/kubelet/device-plugins whatever its --root-dir.
PLUGIN_DIR=/var/lib/kubelet/device-plugins
[ -d /var/lib/kubelet ] && CREATED_VAR_LIB_KUBELET= || CREATED_VAR_LIB_KUBELET=1
[ -S "$PLUGIN_DIR/kubelet.sock" ] && pgrep -x kubelet >/dev/null && {
    echo "real-kubelet.sh: a kubelet already runs here; this test needs $PLUGIN_DIR to itself" >&2; exit 2; }
cleanup() {
    set +e
    if [ -n "$KUBELET_PID" ]; then kill "$KUBELET_PID"; wait "$KUBELET_PID"; fi 2>/dev/null
    # Containers outlive the kubelet and containerd (their shims keep them): end them first.
    if [ -S "$W/containerd/containerd.sock" ]; then
        for task in $("${CTR[@]}" tasks ls -q 2>/dev/null); do "${CTR[@]}" tasks kill -s SIGKILL "$task"; done
        sleep 1
        for task in $("${CTR[@]}" tasks ls -q 2>/dev/null); do "${CTR[@]}" tasks delete -f "$task" >/dev/null; done
    fi
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null; done
    grep -E " $W(/| )" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l
    rm -rf /var/log/pods/default_*-nvshare-test_*
    rm -f /var/log/containers/*-nvshare-test_default_*.log
    rm -f "$PLUGIN_DIR/kubelet.sock" "$PLUGIN_DIR/nvshare.sock" "$PLUGIN_DIR/kubelet_internal_checkpoint" "$PLUGIN_DIR/DEPRECATION"
    [ -n "$CREATED_VAR_LIB_KUBELET" ] && rm -rf /var/lib/kubelet
}
CTR=(ctr --address "$W/containerd/containerd.sock" -n k8s.io)
trap cleanup EXIT
trap 'exit 143' TERM INT
rm -rf "$W/containerd" "$W/kubelet" "$W/manifests" "$W/nvshare" "$W/dev" "$W/lib" "$W/simnvml" "$W/cni"
mkdir -p "$W/containerd" "$W/kubelet" "$W/manifests" "$W/dev" "$W/lib" "$W/simnvml" "$W/cni/bin" "$W/cni/conf"

make -s -C "$REPO/interceptor" BUILD="$W/lib" >"$LOG/make.log" 2>&1
make -s -C "$REPO/tests/simcuda" BUILD="$W/simnvml" "$W/simnvml/libnvidia-ml.so.1" >>"$LOG/make.log" 2>&1
# Stand-ins for the GPUs' device nodes: character devices with /dev/null's numbers, so that runc
# creates real device nodes in the containers that are given them.
for name in nvidia0 nvidia1 nvidiactl nvidia-uvm; do mknod -m 666 "$W/dev/$name" c 1 3; done

# runc with --debug; when it fails, its log and the container's OCI spec are kept in $LOG (the
# bundle is deleted at once), because containerd's own message rarely says why.
cat > "$W/runc-debug" <<EOF
#!/bin/sh
log= bundle= previous=
for argument in "\$@"; do
    [ "\$previous" = --log ] && log=\$argument
    [ "\$previous" = --bundle ] && bundle=\$argument
    previous=\$argument
done
runc --debug "\$@"
status=\$?
if [ \$status -ne 0 ]; then
    [ -n "\$log" ] && cp "\$log" "$LOG/runc-failed-\$\$.log"
    [ -n "\$bundle" ] && cp "\$bundle/config.json" "$LOG/runc-failed-\$\$-config.json"
fi
exit \$status
EOF
chmod +x "$W/runc-debug"
RESTRICT_OOM=false
(echo -1 > /proc/self/oom_score_adj) 2>/dev/null || RESTRICT_OOM=true
cat > "$W/containerd/config.toml" <<EOF
version = 2
root = "$W/containerd/root"
state = "$W/containerd/state"
[grpc]
  address = "$W/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$IMAGE"
  # Without CAP_SYS_RESOURCE (a container, or a VM that withholds it) lowering oom_score_adj
  # fails, and the kubelet asks -998 for every pod sandbox: keep scores at containerd's or above.
  restrict_oom_score_adj = $RESTRICT_OOM
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    BinaryName = "$W/runc-debug"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$W/cni/bin"
    conf_dir = "$W/cni/conf"
EOF
containerd --config "$W/containerd/config.toml" >"$LOG/containerd.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do "${CTR[@]}" version >/dev/null 2>&1 && break; sleep 0.2; done
"$PYTHON" "$REPO/k8s/test/busybox_image.py" "$(command -v busybox)" "$W/image.tar" "$IMAGE"
"${CTR[@]}" images import "$W/image.tar" >>"$LOG/steps.log"

export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
"$PYTHON" -m nvshare_py.scheduler --socket-dir "$W/nvshare" >"$LOG/scheduler.log" 2>&1 &
PIDS+=($!)
: > "$W/nvml-state"
LD_LIBRARY_PATH=$W/simnvml SIMCUDA_DEVICES=2 SIMNVML_STATE=$W/nvml-state \
    "$PYTHON" -m nvshare_py.deviceplugin serve --replicas 2 --device-plugin-dir "$PLUGIN_DIR" \
    --socket-dir "$W/nvshare" --library "$W/lib/libnvshare.so" --device-dir "$W/dev" \
    --health-interval 0.5 >"$LOG/plugin.log" 2>&1 &
PIDS+=($!)

start_kubelet() {
    "$KUBELET" --root-dir="$W/kubelet" --pod-manifest-path="$W/manifests" --file-check-frequency=1s \
        --container-runtime=remote --container-runtime-endpoint="unix://$W/containerd/containerd.sock" \
        --cgroup-driver=cgroupfs --cgroups-per-qos=false --enforce-node-allocatable= --fail-swap-on=false \
        --address=127.0.0.1 --read-only-port=10255 --hostname-override=nvshare-test --cert-dir="$W/kubelet/pki" \
        --image-gc-high-threshold=100 --image-gc-low-threshold=99 --eviction-hard= --oom-score-adj=0 --v=2 \
        >>"$LOG/kubelet.log" 2>&1 &
    KUBELET_PID=$!
}
start_kubelet

# ---- 3. checks ---------------------------------------------------------------------------------
CHECKS=$W/checks.jsonl
: > "$CHECKS"
FAILED=0
check() {  # check NAME DETAIL COMMAND...: passes when COMMAND succeeds within $TIMEOUT s
    local name=$1 detail=$2; shift 2
    local deadline=$(( $(date +%s) + TIMEOUT ))
    until "$@" >/dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            say "FAIL $name: $detail"
            jq -cn --arg n "$name" --arg d "$detail" '{check: $n, passed: false, detail: $d}' >> "$CHECKS"
            FAILED=1
            return 0
        fi
        sleep 0.5
    done
    say "ok   $name: $detail"
    jq -cn --arg n "$name" --arg d "$detail" '{check: $n, passed: true, detail: $d}' >> "$CHECKS"
}
pods() { curl -sf http://127.0.0.1:10255/pods; }
running() { pods | jq -e --arg p "$1-nvshare-test" \
    '.items[] | select(.metadata.name == $p) | .status.containerStatuses[0].state.running' >/dev/null; }
pod_log() { cat /var/log/pods/default_"$1"-nvshare-test_*/gpu/0.log 2>/dev/null; }
log_has() { pod_log "$1" | grep -q -- "$2"; }
static_pod() {  # static_pod NAME: a pod that asks for one nvshare.com/gpu and shows what it got
    cat > "$W/manifests/$1.yaml" <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: default}
spec:
  hostNetwork: true
  restartPolicy: Never
  containers:
    - name: gpu
      image: $IMAGE
      imagePullPolicy: Never
      command: ["/bin/sh", "-c", "env; grep nvshare /proc/mounts; ls -l /dev; ls $W/nvshare/client; echo done; sleep 2147483647"]
      resources:
        limits: {nvshare.com/gpu: 1}
EOF
}
gpu() { printf 'GPU-5151ad00-0000-4000-8000-%012x' "$1"; }

check kubelet-healthz "the kubelet serves /healthz" curl -sf http://127.0.0.1:10248/healthz
check registration "the plugin registered nvshare.com/gpu with the kubelet" grep -q "registered nvshare.com/gpu" "$LOG/plugin.log"
check list-and-watch "the kubelet watches the device list" grep -q "the kubelet is watching the device list" "$LOG/plugin.log"

static_pod gpu-a
check pod-a-running "a static pod asking for nvshare.com/gpu runs" running gpu-a
check pod-a-output "the pod printed what it was given" log_has gpu-a "^.*done$"
check allocate "the plugin logged the allocation" grep -q "allocated GPU-5151ad00" "$LOG/plugin.log"
check pod-a-env "NVIDIA_VISIBLE_DEVICES, LD_PRELOAD and NVSHARE_SOCKET_DIR in the pod" \
    sh -c "pod_log() { cat /var/log/pods/default_gpu-a-nvshare-test_*/gpu/0.log; }; \
           pod_log | grep -q 'NVIDIA_VISIBLE_DEVICES=GPU-5151ad00' && pod_log | grep -q 'LD_PRELOAD=/usr/lib/nvshare/libnvshare.so' \
           && pod_log | grep -q 'NVSHARE_SOCKET_DIR=$W/nvshare'"
check pod-a-mounts "the library and the client socket directory are mounted read-only" \
    sh -c "cat /var/log/pods/default_gpu-a-nvshare-test_*/gpu/0.log | grep -E ' /usr/lib/nvshare/libnvshare.so .* ro[ ,]' >/dev/null \
           && cat /var/log/pods/default_gpu-a-nvshare-test_*/gpu/0.log | grep -E ' $W/nvshare/client .* ro[ ,]' >/dev/null"
check pod-a-scheduler-socket "the scheduler's socket is visible in the pod" log_has gpu-a "scheduler.sock"
A_GPU=$(pod_log gpu-a | sed -n 's/.*NVIDIA_VISIBLE_DEVICES=GPU-5151ad00-0000-4000-8000-0*\([0-9a-f]*\)$/\1/p' | head -n1)
A_GPU=${A_GPU:-0}
OTHER=$(( 1 - A_GPU ))
check pod-a-device-nodes "the pod has /dev/nvidia$A_GPU, nvidiactl and nvidia-uvm as character devices, not /dev/nvidia$OTHER" \
    sh -c "log=\$(cat /var/log/pods/default_gpu-a-nvshare-test_*/gpu/0.log); \
           echo \"\$log\" | grep -q ' c.* nvidia$A_GPU\$' && echo \"\$log\" | grep -q ' nvidiactl\$' \
           && echo \"\$log\" | grep -q ' nvidia-uvm\$' && ! echo \"\$log\" | grep -q ' nvidia$OTHER\$'"

# GPU $OTHER has both devices free, so the spread policy would suggest it next: once it is gone,
# the next pod must get GPU $A_GPU all the same.
echo "$OTHER gone" > "$W/nvml-state.new" && mv "$W/nvml-state.new" "$W/nvml-state"
check health-unhealthy "the plugin reports GPU $OTHER gone and sends the kubelet 2 of 4 devices healthy" \
    sh -c "grep -q 'GPU $OTHER ($(gpu $OTHER)) is gone' '$LOG/plugin.log' && grep -q '2 of 4 devices healthy' '$LOG/plugin.log'"
static_pod gpu-b
check health-respected "a pod started while GPU $OTHER is gone gets GPU $A_GPU, though spread prefers GPU $OTHER" \
    sh -c "cat /var/log/pods/default_gpu-b-nvshare-test_*/gpu/0.log 2>/dev/null | grep -q 'NVIDIA_VISIBLE_DEVICES=$(gpu "$A_GPU")'"
: > "$W/nvml-state.new" && mv "$W/nvml-state.new" "$W/nvml-state"
check health-recovered "the plugin reports GPU $OTHER back and sends 4 of 4 devices healthy again" \
    sh -c "grep -q 'GPU $OTHER ($(gpu $OTHER)) answers again' '$LOG/plugin.log' \
           && [ \$(grep -c '4 of 4 devices healthy' '$LOG/plugin.log') -ge 2 ]"
static_pod gpu-c
check pod-c-spread "the next pod gets GPU $OTHER again (healthy, and the least shared)" \
    sh -c "cat /var/log/pods/default_gpu-c-nvshare-test_*/gpu/0.log 2>/dev/null | grep -q 'NVIDIA_VISIBLE_DEVICES=$(gpu $OTHER)'"

say "restarting the kubelet"
kill "$KUBELET_PID"; wait "$KUBELET_PID" 2>/dev/null || true
start_kubelet
check reregistration "the plugin registered again after the kubelet restart" \
    sh -c "[ \$(grep -c 'registered nvshare.com/gpu' '$LOG/plugin.log') -ge 2 ]"
check pods-survive "the pods kept running across the kubelet restart" running gpu-a
static_pod gpu-d
check allocate-after-restart "a pod started after the restart is given a GPU" \
    sh -c "cat /var/log/pods/default_gpu-d-nvshare-test_*/gpu/0.log 2>/dev/null | grep -q 'NVIDIA_VISIBLE_DEVICES=GPU-'"

# ---- 4. stop the pods, then everything else; record ---------------------------------------------
# What pod A saw, for the record: its nvshare variables, mounts, device nodes and sockets.
pod_log gpu-a | sed 's/^[^ ]* std[a-z]* [FP] //' | grep -E 'NVIDIA|LD_PRELOAD|NVSHARE|nvshare|nvidia|\.sock' > "$W/pod-a.txt" || true
rm -f "$W"/manifests/*.yaml
check pods-removed "the kubelet dropped the static pods whose manifests were removed" sh -c "! curl -sf http://127.0.0.1:10255/pods | jq -e '.items[]' >/dev/null"

mkdir -p "$(dirname "$RESULT")"
jq -n --slurpfile checks "$CHECKS" --rawfile pod_a "$W/pod-a.txt" --arg kubelet "$KUBELET_VERSION" --arg go "$(go version)" \
    --arg containerd "$(containerd --version)" --arg runc "$(runc --version | head -n1)" \
    --arg kernel "$(uname -r)" --arg date "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    --arg build_seconds "$(cat "$W/build/seconds" 2>/dev/null || echo unknown)" \
    '{test: "real-kubelet", date: $date, kubelet: $kubelet, go: $go, containerd: $containerd, runc: $runc,
      kernel: $kernel, kubelet_build_seconds: $build_seconds,
      passed: ([$checks[] | select(.passed)] | length), failed: ([$checks[] | select(.passed | not)] | length),
      checks: $checks, pod_a_saw: ($pod_a | rtrimstr("\n") | split("\n"))}' > "$RESULT"
say "result: $RESULT ($(jq -r '"\(.passed) passed, \(.failed) failed"' "$RESULT"))"
exit $FAILED
