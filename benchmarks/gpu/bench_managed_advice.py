"""Steady-state cost of managed memory (issue 8): a GPT-2 training step natively and under nvshare.

    python benchmarks/gpu/bench_managed_advice.py [--rounds 10] [--out results.json]

Real GPU only. Builds libnvshare.so from this tree with make (or uses $NVSHARE_LIBRARY), starts a
scheduler, and runs, in separate processes, one variant after the other in every round (the
order rotates from round to round, so drifts of the machine hit every variant alike):

- `native`: no interceptor;
- `nvshare`: under the interceptor (allocations converted to managed memory), lock held;
- `nvshare-managed-0`: under the interceptor with NVSHARE_MANAGED=0 (the lock gate alone);
- `nvshare-advise`: NVSHARE_ADVISE=1, every converted allocation advised onto its device
  (cuMemAdvise SetPreferredLocation + SetAccessedBy), see interceptor/memory.c.

Each process trains GPT-2 124M (transformers' GPT2Config(), random weights, nothing downloaded;
a torch.nn model of the same shape when transformers is missing, and the JSON says so) with bf16
autocast, batch 8 x 512 tokens and AdamW: 8 warm-up steps, then 30 timed ones; its result is the
median step time, that of the same number of steps after `--late-warmup` steps (a transient
cost fades, a steady one stays), and the GPU's own time per step summed by the profiler over 5
more steps (host noise does not reach it), and the host's time per submission (20,000
back-to-back launches of a one-element kernel: the cost the interceptor's gate adds to every
launch, which a launch-bound step pays once per device operation). Every measured process is pinned to the same CPUs
(`--cpus`). Only one process uses the GPU at a time and each needs a few GiB.

Prints one JSON document: per variant the median step of every run, and the overhead against
`native` (paired by round: run / native run of the same round - 1) as median and 90th percentile;
the issue's target is median <= 0.5 %, p90 <= 1 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's nvshare_py, without installing

from nvshare_py.testing.interceptor import benchmark_library  # noqa: E402
from nvshare_py.testing.scheduler import SchedulerProcess  # noqa: E402
VARIANTS = {
    "native": None,
    "nvshare": {},
    "nvshare-managed-0": {"NVSHARE_MANAGED": "0"},
    "nvshare-advise": {"NVSHARE_ADVISE": "1"},
}


def train(warmup: int, steps: int, late_warmup: int, batch: int, tokens: int) -> dict:
    """One process's measurement (run with --child)."""
    import torch

    torch.manual_seed(0)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        model_name = "transformers GPT2LMHeadModel(GPT2Config()), random weights"
        model = GPT2LMHeadModel(GPT2Config()).cuda()

        def loss_of(ids):
            return model(input_ids=ids, labels=ids).loss
    except ImportError:
        model_name = "torch.nn GPT-2 124M shape (transformers not installed)"
        model = Gpt2Shaped().cuda()

        def loss_of(ids):
            logits = model(ids)
            return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (batch, tokens), device="cuda")
    times = []
    late_times = []  # the same count of steps after `late_warmup` steps: a transient cost fades

    def one_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(ids)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()

    for step in range(max(warmup, late_warmup) + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        one_step()
        torch.cuda.synchronize()
        if warmup <= step < warmup + steps:
            times.append(time.perf_counter() - start)
        if step >= late_warmup:
            late_times.append(time.perf_counter() - start)
    # The GPU's own time per step (kernels and copies, summed by the profiler): the host's
    # scheduling noise, which moves wall-clock steps by several per cent from process to
    # process on a shared machine, does not reach it, while page faults and TLB misses of
    # managed memory do.
    from torch.profiler import ProfilerActivity, profile

    profiled_steps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(profiled_steps):
            one_step()
        torch.cuda.synchronize()
    averages = profiler.key_averages()
    gpu_us = sum(event.self_device_time_total for event in averages)
    device_ops = sum(event.count for event in averages if event.self_device_time_total > 0)
    # The host's cost of one submission (the interceptor's gate is on this path): back-to-back
    # launches of a one-element kernel, so the launch path, not the GPU, sets the pace.
    tiny = torch.zeros(1, device="cuda")
    launches = 20000
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(launches):
        tiny.add_(1)
    torch.cuda.synchronize()
    launch_us = (time.perf_counter() - started) / launches * 1e6
    # Spread within a run tells a uniform slowdown (every step pays) from spikes (the driver
    # migrating pages now and then).
    return {"step_ms_median": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3,
            "step_ms_p90": percentile(times, 0.9) * 1e3, "step_ms_max": max(times) * 1e3,
            "late_step_ms_median": statistics.median(late_times) * 1e3,
            "gpu_ms_per_step": gpu_us / profiled_steps / 1e3,
            "device_ops_per_step": device_ops / profiled_steps, "launch_us": launch_us,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "model": model_name,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}


def Gpt2Shaped():
    """GPT-2 124M's shape from torch.nn alone: 12 pre-norm causal layers of width 768, 12 heads,
    1024 positions, a 50257-token embedding tied to the output."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(50257, 768)
            self.positions = torch.nn.Embedding(1024, 768)
            layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.1, activation="gelu",
                                                     batch_first=True, norm_first=True)
            self.layers = torch.nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(768)

        def forward(self, ids):
            length = ids.shape[1]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
            x = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
            x = self.norm(self.layers(x, mask=mask, is_causal=True))
            return x @ self.tokens.weight.T

    return Model()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def parse_cpus(text: str) -> set[int]:
    """'2-5' or '2,3' or '' (no pinning)."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="processes per variant")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--late-warmup", type=int, default=40,
                        help="the same number of steps is timed again after this many")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--cpus", default="2-5",
                        help="CPUs every measured process is pinned to (the same for every variant), '' for none")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(train(args.warmup, args.steps, args.late_warmup, args.batch, args.tokens)))
        return
    if "native" not in args.variants:
        raise SystemExit("overheads are measured against `native`: keep it among --variants")
    work = Path(tempfile.mkdtemp(prefix="nvs-advice-", dir="/tmp"))
    preload = benchmark_library(ROOT, work)
    scheduler = SchedulerProcess(work / "s", {"log_level": "info"})
    base = dict(scheduler.env)
    base.pop("LD_PRELOAD", None)
    envs = {name: base if extra is None else dict(base, LD_PRELOAD=str(preload), **extra)
            for name, extra in VARIANTS.items() if name in args.variants}
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--warmup", str(args.warmup),
            "--late-warmup", str(args.late_warmup),
            "--steps", str(args.steps), "--batch", str(args.batch), "--tokens", str(args.tokens)]
    cpus = parse_cpus(args.cpus)

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    runs: dict[str, list[dict]] = {name: [] for name in envs}
    (work / "s").mkdir()
    scheduler.start()
    try:
        names = list(envs)
        for round_number in range(args.rounds):
            shift = round_number % len(names)
            for name in names[shift:] + names[:shift]:
                out = subprocess.run(argv, env=envs[name], capture_output=True, text=True, preexec_fn=pin)
                if out.returncode != 0:
                    raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stderr[-3000:]}")
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {round_number + 1} {name}: {runs[name][-1]['step_ms_median']:.2f} ms, "
                      f"launch {runs[name][-1]['launch_us']:.2f} us", file=sys.stderr, flush=True)
    finally:
        scheduler.stop()
    native = [run["step_ms_median"] for run in runs["native"]]
    document = {
        "benchmark": "managed-advice",
        "model": runs["native"][0]["model"], "gpu": runs["native"][0]["gpu"], "torch": runs["native"][0]["torch"],
        "settings": {"rounds": args.rounds, "warmup": args.warmup, "late_warmup": args.late_warmup, "cpus": args.cpus,
                     "steps": args.steps, "batch": args.batch,
                     "tokens": args.tokens},
        "variants": {},
    }
    for name, results in runs.items():
        steps = [run["step_ms_median"] for run in results]
        paired = [(step / base_step - 1) * 100 for step, base_step in zip(steps, native)]
        late = [run["late_step_ms_median"] for run in results]
        gpu = [run["gpu_ms_per_step"] for run in results]
        gpu_paired = [(step / base_step - 1) * 100
                      for step, base_step in zip(gpu, (run["gpu_ms_per_step"] for run in runs["native"]))]
        late_paired = [(step / base_step - 1) * 100
                       for step, base_step in zip(late, (run["late_step_ms_median"] for run in runs["native"]))]
        document["variants"][name] = {
            "step_ms": [round(step, 3) for step in steps],
            "step_ms_median": round(statistics.median(steps), 3),
            "peak_gib": max(run["peak_gib"] for run in results),
            "within_run_p90_over_median_pct": round(statistics.median(
                (run["step_ms_p90"] / run["step_ms_median"] - 1) * 100 for run in results), 3),
            "within_run_max_ms": [round(run["step_ms_max"], 3) for run in results],
            "overhead_pct_median": round(statistics.median(paired), 3),
            "overhead_pct_p90": round(percentile(paired, 0.9), 3),
            "late_step_ms": [round(step, 3) for step in late],
            "late_overhead_pct_median": round(statistics.median(late_paired), 3),
            "late_overhead_pct_p90": round(percentile(late_paired, 0.9), 3),
            "gpu_ms_per_step": [round(step, 3) for step in gpu],
            "gpu_overhead_pct_median": round(statistics.median(gpu_paired), 3),
            "gpu_overhead_pct_p90": round(percentile(gpu_paired, 0.9), 3),
            "device_ops_per_step": round(statistics.median(run["device_ops_per_step"] for run in results)),
            "launch_us": [round(run["launch_us"], 3) for run in results],
            "launch_us_median": round(statistics.median(run["launch_us"] for run in results), 3),
        }
    print(f"{'variant':20} {'median ms':>10} {'overhead median':>16} {'p90':>8} {'late median':>12} {'late p90':>9}"
          f" {'GPU median':>11} {'GPU p90':>8} {'launch us':>10}", file=sys.stderr)
    for name, row in document["variants"].items():
        print(f"{name:20} {row['step_ms_median']:10.2f} {row['overhead_pct_median']:15.2f}% "
              f"{row['overhead_pct_p90']:7.2f}% {row['late_overhead_pct_median']:11.2f}% "
              f"{row['late_overhead_pct_p90']:8.2f}% {row['gpu_overhead_pct_median']:10.2f}% "
              f"{row['gpu_overhead_pct_p90']:7.2f}% {row['launch_us_median']:10.2f}", file=sys.stderr)
    text = json.dumps(document, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
