"""Every real-GPU measurement of issue 18 in one run (about 7 minutes on an H100 80 GB).

    OUT=/tmp/out python benchmarks/gpu/run_issue18.py [--cases pair four] [--modes MODE ...] [--no-bandwidth]

1. benchmarks/gpu/bench_swap_bandwidth.py --gib 16 --vmm-gib 4: the link's ceiling (pinned
   copies), the managed prefetch both ways (first and later eviction), and the swap engine's
   out/in over real handoffs for converted memory and for PyTorch's expandable segments (VMM),
   with NVML's view of a swapped-out process.
2. benchmarks/bench_colocation.py --gpu --working-set: two jobs of 24 GiB under a 32 GiB budget
   (sequential, both at once without nvshare, nvshare without a budget, swap, auto) and four of
   12 GiB under 24 GiB (sequential, together, swap); each step hold.add_(1) over the working set,
   2 s of matrix products, 1 s of CPU; TQ 10 s. The handoff stalls against
   S / (0.8 x link) + 50 ms with the link measured in step 1.

Safety: at most 48 GiB of device memory at once (the jobs run together without nvshare), so the
card must have 56 GiB free; refused otherwise. The pinned swap areas take up to 48 GiB of host
memory (bounded by the scheduler's admission spill, half of MemAvailable). libnvshare.so is built
once from this tree (or $NVSHARE_LIBRARY). Prints a short table; writes issue18.json, and each
benchmark's own JSON, into $OUT (default: benchmarks/results); a call for some of the cases
writes issue18-<cases>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402

GIB = 1 << 30
NEEDED_FREE = 56 * GIB


def run(argv: list[str], env: dict[str, str], timeout: float) -> int:
    """Runs one benchmark (its own output goes to stderr and its JSON file); its exit status
    (124: killed at `timeout`). A failure does not stop the next benchmark."""
    print("+", " ".join(argv), file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        code = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = 124
    print(f"  ({time.monotonic() - started:.0f} s, exit {code})", file=sys.stderr, flush=True)
    return code


def gpu() -> dict:
    """The card, asked in a process of its own (this one keeps no CUDA context during the runs)."""
    code = ("import json, torch; free, total = torch.cuda.mem_get_info(); "
            "print(json.dumps({'name': torch.cuda.get_device_name(), 'torch': torch.__version__, "
            "'free': free, 'total': total}))")
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     check=True).stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=["pair", "four"], help="working-set cases (none: skip them)")
    parser.add_argument("--modes", nargs="+", help="working-set modes (default: each case's own)")
    parser.add_argument("--no-bandwidth", action="store_true",
                        help="skip the bandwidth part: reuse $OUT/swap_bandwidth.json of an earlier call")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    card = gpu()
    if card["free"] < NEEDED_FREE:
        raise SystemExit(f"{card['free'] / GIB:.1f} GiB free of {card['total'] / GIB:.1f}: these runs need "
                         f"{NEEDED_FREE // GIB} GiB")
    env = {**os.environ, "NVSHARE_LIBRARY": str(benchmark_library(ROOT, Path(tempfile.mkdtemp(prefix="nvs-issue18-"))))}
    started = time.monotonic()
    bandwidth_json = out / "swap_bandwidth.json"
    code = 0
    if not args.no_bandwidth:
        bandwidth_json.unlink(missing_ok=True)
        code = run([sys.executable, str(ROOT / "benchmarks/gpu/bench_swap_bandwidth.py"), "--gib", "16", "--vmm-gib",
                    "4", "--rounds", "3", "--out", str(bandwidth_json)], env, 300)
    bandwidth = json.loads(bandwidth_json.read_text()) if bandwidth_json.exists() else {}
    bandwidth.setdefault("ceiling", {"error": f"bench_swap_bandwidth.py exited {code} before measuring it"})
    link = bandwidth["ceiling"].get("pinned_h2d_GBps")
    colocation, files = {"cases": {}}, [bandwidth_json.name]
    if args.cases:
        before = {path: path.stat().st_mtime for path in out.glob("colocation-ws-*-gpu*.json")}
        code = run([sys.executable, str(ROOT / "benchmarks/bench_colocation.py"), "--gpu", "--working-set", *args.cases,
                    *(["--ws-modes", *args.modes] if args.modes else []),
                    *(["--link-gbps", str(link)] if link else []), "--out", str(out)], env, 480)
        written = [path for path in out.glob("colocation-ws-*-gpu*.json") if before.get(path) != path.stat().st_mtime]
        if written:
            colocation = json.loads(written[0].read_text())
            files.append(written[0].name)
        else:
            colocation["error"] = f"bench_colocation.py exited {code} without results"

    summary = {"gpu": card["name"], "torch": card["torch"], "driver": bandwidth["ceiling"].get("driver"),
               "elapsed_s": round(time.monotonic() - started), "colocation_error": colocation.get("error"),
               "bandwidth": {part: {key: value for key, value in bandwidth[part].items()
                                    if key.endswith(("GBps", "ceiling")) or key in (
                                        "intact", "target_met", "kind", "error", "new_allocation_after_swap_ins_ok")}
                             for part in ("engine", "vmm", "torch") if part in bandwidth},
               "ceiling": {key: bandwidth["ceiling"].get(key) for key in ("pinned_d2h_GBps", "pinned_h2d_GBps",
                                                                          "managed_prefetch", "pin_s_per_gib", "error")},
               "vmm_nvml_bytes_before_after_out": {part: [r["nvml_process_bytes_before_after_out"]
                                                          for r in bandwidth[part]["rounds"]]
                                                   for part in ("vmm", "torch") if "rounds" in bandwidth.get(part, {})},
               "working_set": {name: {mode: {key: o.get(key) for key in ("makespan_s", "ratio_to_sequential",
                                                                         "ratio_to_together", "ratio_to_on", "grants")}
                                      | {"max_stall_s": (o.get("stalls") or {}).get("max_stall_s"),
                                         "stalls_within_bound": (o.get("stalls") or {}).get("within_bound"),
                                         "stalls": (o.get("stalls") or {}).get("handoffs_with_memory_to_bring_back")}
                                      for mode, o in case["modes"].items()}
                               for name, case in colocation["cases"].items()},
               "files": files}
    name = "issue18.json" if set(args.cases) == {"pair", "four"} else "issue18-" + "-".join(args.cases or ["none"]) + ".json"
    (out / name).write_text(json.dumps(summary, indent=1) + "\n")

    print(f"\n{summary['gpu']}, driver {summary['driver']}, torch {summary['torch']}, {summary['elapsed_s']} s")
    c = summary["ceiling"]
    print(f"ceiling: pinned d2h {c['pinned_d2h_GBps']} GB/s, h2d {c['pinned_h2d_GBps']} GB/s; managed prefetch "
          f"{c['managed_prefetch']}; pinning {c['pin_s_per_gib']} s/GiB")
    for part, b in summary["bandwidth"].items():
        if "error" in b:
            print(f"{part:7}: FAILED {b['error'][-400:]}")
            continue
        print(f"{part:7} ({b['kind']}): out first {b['out_first_GBps']} ({b['out_first_vs_ceiling']}), later "
              f"{b['out_later_GBps']} ({b['out_later_vs_ceiling']}); in first {b['in_first_GBps']} "
              f"({b['in_first_vs_ceiling']}), later {b['in_later_GBps']} ({b['in_later_vs_ceiling']}); intact "
              f"{b['intact']}; target (0.8) {'met' if b.get('target_met') else 'MISSED'}"
              + ("" if b.get("new_allocation_after_swap_ins_ok") is None else
                 f"; new allocation after the swap-ins {'ok' if b['new_allocation_after_swap_ins_ok'] else 'FAILED'}"))
    print(f"vmm: NVML bytes of the process before/after each swap-out {summary['vmm_nvml_bytes_before_after_out']}")
    print(f"{'case':6}{'mode':12}{'makespan':>10}{'/seq':>7}{'/together':>10}{'/on':>7}{'grants':>8}{'max stall':>10}")
    for name, modes in summary["working_set"].items():
        for mode, o in modes.items():
            cells = [o["ratio_to_sequential"], o["ratio_to_together"], o["ratio_to_on"]]
            print(f"{name:6}{mode:12}{o['makespan_s']:>10.1f}" + "".join(
                f"{'-' if v is None else format(v, '.2f'):>{w}}" for v, w in zip(cells, (7, 10, 7)))
                  + f"{o['grants'] or 0:>8}{'-' if o['max_stall_s'] is None else format(o['max_stall_s'], '.3f'):>10}")
    print("targets: out/in >= 0.8 of the ceiling; pair swap <= 0.80 x sequential and <= 1.10 x on "
          "(stretch <= 1.05 x together); four swap <= 0.80 x sequential")


if __name__ == "__main__":
    main()
