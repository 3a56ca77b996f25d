"""End-to-end training throughput: ResNet-18 on synthetic images. One JSON line.

Run natively and under nvshare (lock held); the ratio of the medians is the overhead."""

import argparse
import json
import time

import torch
import torchvision


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=100).cuda().to(memory_format=torch.channels_last)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    labels = torch.randint(0, 100, (args.batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    print(json.dumps({"step_ms_median": times[len(times) // 2] * 1e3, "step_ms_p10": times[len(times) // 10] * 1e3,
                      "steps": args.steps, "batch": args.batch, "images_per_s": args.batch / times[len(times) // 2]}))


if __name__ == "__main__":
    main()
