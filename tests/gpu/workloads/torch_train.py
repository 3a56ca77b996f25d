"""A small deterministic PyTorch training run; prints one JSON line with what it computed.

Modes: eager, compile (torch.compile), graph (a whole training step captured in a CUDA graph).
Run natively and under nvshare, the printed losses and checksum must be identical.
"""

import argparse
import json
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from managed import summarise  # noqa: E402


def build(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(64 * 16 * 16, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    ).to(device)
    inputs = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device)
    labels = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(2)).to(device)
    return model, inputs, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["eager", "compile", "graph"], default="eager")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda")
    model, inputs, labels = build(device)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []

    def step():
        optimiser.zero_grad(set_to_none=False)
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optimiser.step()
        return loss

    if args.mode == "compile":
        step = torch.compile(step)
    if args.mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up outside the graph, as CUDA graph capture requires
                losses.append(step().item())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = step()
        for _ in range(args.steps - 3):
            graph.replay()
            losses.append(static_loss.item())
    else:
        for _ in range(args.steps):
            losses.append(step().item())
    torch.cuda.synchronize()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    segments = [s["address"] for s in torch.cuda.memory_snapshot()]
    tensors = [p.data_ptr() for p in model.parameters()] + [inputs.data_ptr(), labels.data_ptr()]
    print(json.dumps({
        "framework": "torch", "mode": args.mode, "losses": losses, "checksum": checksum,
        "managed": summarise(segments + tensors), "segments": len(segments),
    }))


if __name__ == "__main__":
    main()
