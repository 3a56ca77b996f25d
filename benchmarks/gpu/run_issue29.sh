#!/bin/bash
# Issue 29's and issue 31's real-GPU runs, as made through the device tool (benchmarks/results/README.md):
#   bash benchmarks/gpu/run_issue29.sh PART...
# PART: smoke (2 tenants of 1 GiB, one round: the script itself), hot-cold-small (6 x 12 GiB under a
# 48 GiB budget, mode on, the hot-cold scenario alone: what fits one H200's host), hot-cold-small-auto (the
# same in mode auto), turns-small (the same size, mode on, requests in turn and in bursts of three),
# turns-small-hugepool (its requests in turn with the pool in the huge tmpfs below), issue-80-on and issue-80-auto
# (the issue's proportions on an 80 GiB card: 6 x 17 GiB under a budget of 80 GiB, every scenario), issue-80-asked-at-once
# (the same size, mode on, only the loads, bursts and hot-cold: tenants asked together), issue-80-hot (the same
# size, mode on, the loads and three periods of hot-cold: do the hot tenants stay resident), issue-80-turns (the same
# size, mode on, the loads and three rounds in turn, nothing else), tenants-on, tenants-auto (the issue's
# 6 x 30 GiB on one card, scheduler defaults but for admission_share=1: the six tenants are one user's,
# and 0.75 of the node's capacity would hold the sixth's load back for the admission timeout), vmm
# (bench_vmm_swap.py: segments, torch, jax, nccl: NCCL needs two GPUs), pair (issue 18's pair, sequential
# and swap), pool-probe (probe_pool_pinning.py: what growing the swap pool costs, in /dev/shm and in a
# tmpfs mounted with huge=always), pinners-probe (probe_swap_beside_pinners.py: the swap engine's moves
# beside pool members that map and register segments), pair-hugepool (the pair's swap run with its pool in that tmpfs). The
# huge tmpfs is mounted at $HUGE_POOL (default /tmp/nvshare-huge): run as root, or the whole script
# under `unshare -Urm` (a user namespace of its own may mount a tmpfs). Needs the wheels of trio, outcome, sniffio and pyzmq in .whl/ when the machine lacks them.
# Writes everything under $OUT (or ./gpu-out); each part's JSON and a tarball of its logs (with WAITS=1 also where
# the tenants' main threads waited: sample_waits.py).
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
free -g | head -2 | tee "$OUT/machine.txt"
df -h /dev/shm | tee -a "$OUT/machine.txt"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee -a "$OUT/machine.txt"
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)' | tee -a "$OUT/machine.txt"
# HOST_GIB: the host's free memory where MemAvailable starts small and grows as memory is used
# (the two-GPU machines here: 31 GiB at first, 256 GiB the limit).
TENANTS=(python3 benchmarks/bench_tenants.py --gpu --scheduler-option admission_share=1 ${HOST_GIB:+--host-gib $HOST_GIB}
         ${NVSHARE_LOG:+--scheduler-option log_level=$NVSHARE_LOG})
SMALL=("${TENANTS[@]}" --tenants 6 --gib 12 --budget-gib 48)  # the *-small parts: what one H200's host holds
HUGE_POOL=${HUGE_POOL:-/tmp/nvshare-huge}
huge_pool() {
    mkdir -p "$HUGE_POOL" && { mountpoint -q "$HUGE_POOL" ||
        mount -t tmpfs -o huge=always,mode=0700 nvshare-huge "$HUGE_POOL"; } && grep " $HUGE_POOL " /proc/mounts
}
for part in "$@"; do
    logs=$OUT/logs-$part; mkdir -p "$logs"
    # WAITS=1: where each tenant's main thread waits, beside the part (sample_waits.py), into its logs
    [ -n "${WAITS:-}" ] && { python3 benchmarks/gpu/sample_waits.py "$logs/waits.txt" 900 & waits=$!; }
    case $part in
    smoke) NVSHARE_BENCH_LOGS=$logs timeout 200 "${TENANTS[@]}" --tenants 2 --gib 1 --scenarios turns --modes on \
               --rounds 1 --interval 1 --baseline-requests 3 --out "$OUT/tenants-smoke.json" 2>&1 | tail -15
           smoked=$? ;;
    tenants-on|tenants-auto)
        [ "${smoked:-0}" = 0 ] || { echo "the smoke run failed: $part not run"; continue; }
        NVSHARE_BENCH_LOGS=$logs timeout 500 "${TENANTS[@]}" --modes "${part#tenants-}" --rounds 3 --bursts 2 \
            --cold-every 20 --cold-periods 2 --baseline-requests 10 --out "$OUT/$part.json" 2>&1 | tail -25 ;;
    hot-cold-small|hot-cold-small-auto)  # warm requests beside cold ones, at a size a single H200's host holds
        mode=on; [ "$part" = hot-cold-small-auto ] && mode=auto
        NVSHARE_BENCH_LOGS=$logs timeout 240 "${SMALL[@]}" --modes $mode --scenarios hot-cold \
            --cold-every 20 --cold-periods 1 --baseline-requests 10 --out "$OUT/$part.json" 2>&1 | tail -25 ;;
    turns-small)  # every request cold (requests in turn), and bursts of three, at the same size in mode on
        NVSHARE_BENCH_LOGS=$logs timeout 300 "${SMALL[@]}" --modes on --scenarios turns bursts \
            --rounds 3 --bursts 2 --baseline-requests 10 --out "$OUT/$part.json" 2>&1 | tail -25 ;;
    issue-80-on|issue-80-auto)  # 180 GiB on 141 GiB is 102 GiB on 80: the card never physically full
        NVSHARE_BENCH_LOGS=$logs timeout 450 "${TENANTS[@]}" --tenants 6 --gib 17 --budget-gib 80 \
            --modes "${part#issue-80-}" --scenarios load turns bursts hot-cold --rounds 3 --bursts 2 \
            --cold-every 20 --cold-periods 1 --baseline-requests 10 --out "$OUT/$part.json" 2>&1 | tail -25 ;;
    issue-80-asked-at-once)  # where ACQUIREs cross EVICTs: several tenants asked together
        NVSHARE_BENCH_LOGS=$logs timeout 300 "${TENANTS[@]}" --tenants 6 --gib 17 --budget-gib 80 --modes on \
            --scenarios load bursts hot-cold --bursts 2 --cold-every 20 --cold-periods 1 --baseline-requests 3 \
            --native never --out "$OUT/$part.json" 2>&1 | tail -25 ;;
    issue-80-turns)  # the loads and three rounds of requests in turn at the same size, mode on (no run without nvshare)
        NVSHARE_BENCH_LOGS=$logs timeout 300 "${TENANTS[@]}" --tenants 6 --gib 17 --budget-gib 80 --modes on \
            --scenarios load turns --rounds 3 --baseline-requests 3 --native never --out "$OUT/$part.json" 2>&1 | tail -25 ;;
    issue-80-hot)  # the issue's hot tenants at its proportions: three periods of the cold ones, the first the warm-up
        NVSHARE_BENCH_LOGS=$logs timeout 400 "${TENANTS[@]}" --tenants 6 --gib 17 --budget-gib 80 --modes on \
            --scenarios load hot-cold --cold-every 20 --cold-periods 3 --baseline-requests 3 \
            --out "$OUT/$part.json" 2>&1 | tail -25 ;;
    turns-small-hugepool)  # requests in turn with the pool in the huge tmpfs (no run without nvshare: turns-small has it)
        huge_pool || { echo "no huge tmpfs: $part not run"; continue; }
        NVSHARE_POOL_DIR=$HUGE_POOL NVSHARE_BENCH_LOGS=$logs timeout 300 "${SMALL[@]}" --modes on \
            --scenarios turns --rounds 3 --baseline-requests 10 --native never --out "$OUT/$part.json" 2>&1 | tail -25 ;;
    vmm) OUT=$OUT NVSHARE_LOG=debug NVSHARE_BENCH_LOGS=$logs timeout 400 python3 benchmarks/gpu/bench_vmm_swap.py \
             2>&1 | tail -25 ;;
    pair) NVSHARE_BENCH_LOGS=$logs timeout 300 python3 benchmarks/bench_colocation.py --gpu --working-set pair \
              --ws-modes sequential swap --out "$OUT" 2>&1 | tail -12 ;;
    pool-probe) huge_pool || echo "no huge tmpfs: /dev/shm only"
        dirs=(/dev/shm); mountpoint -q "$HUGE_POOL" && dirs+=("$HUGE_POOL")
        timeout 300 python3 benchmarks/gpu/probe_pool_pinning.py --gib 4 --out "$OUT/pool-pinning.json" "${dirs[@]}" \
            2>&1 | tail -40 ;;
    pinners-probe) timeout 300 python3 benchmarks/gpu/probe_swap_beside_pinners.py --out "$OUT/swap-beside-pinners.json" \
            2>&1 | tail -60 ;;
    pair-hugepool) huge_pool || { echo "no huge tmpfs: $part not run"; continue; }
        NVSHARE_POOL_DIR=$HUGE_POOL NVSHARE_BENCH_LOGS=$logs timeout 300 python3 benchmarks/bench_colocation.py --gpu \
            --working-set pair --ws-modes swap --out "$OUT/hugepool" 2>&1 | tail -12 ;;
    *) echo "unknown part $part" >&2 ;;
    esac
    [ -n "${waits:-}" ] && { kill "$waits"; wait "$waits" 2>/dev/null; unset waits; }
    tar czf "$OUT/logs-$part.tgz" -C "$OUT" "logs-$part" && rm -rf "$logs"
done
