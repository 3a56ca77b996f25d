"""Bursts of GPU work separated by CPU-only pauses, like a notebook or a training job with
data loading. Prints one JSON line per burst with host-side start/end (CLOCK_MONOTONIC)."""

import argparse
import json
import time

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--burst-seconds", type=float, default=1.0)
    parser.add_argument("--pause-seconds", type=float, default=0.5)
    parser.add_argument("--name", default="burst")
    args = parser.parse_args()
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    # Size one chunk of work to ~50 ms so a burst is a whole number of chunks.
    start = time.monotonic()
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize()
    per_matmul = (time.monotonic() - start) / 10
    chunk = max(1, int(0.05 / per_matmul))
    for index in range(args.bursts):
        begin = time.monotonic()
        while time.monotonic() - begin < args.burst_seconds:
            for _ in range(chunk):
                c = a @ b
            torch.cuda.synchronize()
        end = time.monotonic()
        print(json.dumps({"name": args.name, "burst": index, "start": begin, "end": end,
                          "checksum": float(c[0, :8].sum())}), flush=True)
        time.sleep(args.pause_seconds)


if __name__ == "__main__":
    main()
