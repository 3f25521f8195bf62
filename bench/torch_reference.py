#!/usr/bin/env python3
"""PyTorch's side of `kiln bench` (SPEC Q3): the same training step on synthetic data —
torchvision model, channels_last, SGD (momentum 0.9, fused), FP16 autocast with GradScaler
under --amp — in eager mode and with torch.compile. Warm-up excluded; median of repeats.
Prints one JSON line per mode.

  python3 bench/torch_reference.py --model resnet50 --batch 256 --amp --modes eager,compile

--cudnn-benchmark off leaves cuDNN's algorithm choice to its heuristics: in FP32 at batch 256
the benchmark's search over VGG16-BN's convolutions did not end within 370 s on the H200
(bench/RESULTS.md), so that row may need it; each JSON line says which was used.
--cuda-profiler-range brackets the timed steps for a tracer (`scripts/gpu-check.sh timeline`).
"""
import argparse
import json
import statistics
import time

import torch
import torchvision

p = argparse.ArgumentParser()
p.add_argument("--model", default="resnet50")
p.add_argument("--batch", type=int, default=256)
p.add_argument("--amp", action="store_true")
p.add_argument("--steps", type=int, default=50)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--modes", default="eager,compile")
p.add_argument("--image-size", type=int, default=224)
p.add_argument("--cudnn-benchmark", choices=["on", "off"], default="on")
p.add_argument("--cuda-profiler-range", action="store_true",
               help="cudaProfilerStart/Stop around the timed steps, as kiln bench's flag (tools/cupti_trace.cpp)")
args = p.parse_args()

torch.backends.cudnn.benchmark = args.cudnn_benchmark == "on"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")


def run(mode):
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-5, fused=True)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    if mode == "compile":
        step = torch.compile(step)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    rates = []
    if args.cuda_profiler_range:
        torch.cuda.profiler.start()
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        rates.append(args.steps * args.batch / (time.perf_counter() - t0))
    if args.cuda_profiler_range:
        torch.cuda.profiler.stop()
    return {"bench": "torch", "mode": mode, "model": args.model, "batch": args.batch, "amp": args.amp,
            "images_per_second": round(statistics.median(rates), 1), "warmup_seconds": round(warm_s, 1),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "cudnn_benchmark": args.cudnn_benchmark}


for m in args.modes.split(","):
    print(json.dumps(run(m)), flush=True)
