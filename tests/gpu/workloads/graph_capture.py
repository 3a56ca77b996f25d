"""CUDA-graph capture in a loop (the torch.cuda.graph / torch.compile "reduce-overhead" /
vLLM pattern): capture a graph of 8 linear layers, replay it, again, for --seconds. A capture
that a synchronise from another thread invalidates raises; each is counted, not fatal. Prints
one JSON line. Uses a few MiB of GPU memory."""

import argparse
import json
import time

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--replays", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).cuda()
    x = torch.randn(64, 512, device="cuda")
    side = torch.cuda.Stream()
    with torch.no_grad():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture, as torch's docs ask
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        captures = failed = replays = 0
        errors: dict[str, int] = {}
        begin = time.monotonic()
        while time.monotonic() - begin < args.seconds:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    y = model(x)
                for _ in range(args.replays):
                    graph.replay()
                    replays += 1
                torch.cuda.synchronize()
                captures += 1
            except RuntimeError as exc:
                failed += 1
                key = str(exc).splitlines()[0][:120]
                errors[key] = errors.get(key, 0) + 1
                torch.cuda.synchronize()
        checksum = float(y[0, :8].sum())
    print(json.dumps({"captures": captures, "failed": failed, "replays": replays, "errors": errors,
                      "seconds": time.monotonic() - begin, "checksum": checksum}), flush=True)


if __name__ == "__main__":
    main()
