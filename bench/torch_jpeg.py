#!/usr/bin/env python3
"""PyTorch's side of bench/jpeg_compare.sh (issue 16): training from an image folder as a
PyTorch user does it — torchvision ImageFolder + DataLoader (num_workers = the cores,
pin_memory, persistent workers), RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor +
Normalize, the torchvision model in channels_last, SGD (momentum 0.9, fused), FP16 autocast
with GradScaler under --amp, eager. Then evaluation (Resize(256), CenterCrop(224)) through the
same DataLoader settings. Prints one JSON line per phase, with the host cores busy during it.

  python3 bench/torch_jpeg.py ROOT --model resnet50 --batch 256 --amp --epochs 2
"""
import argparse
import json
import os
import time

import torch
import torchvision
from torchvision import transforms as T

p = argparse.ArgumentParser()
p.add_argument("root")
p.add_argument("--model", default="resnet50")
p.add_argument("--batch", type=int, default=256)
p.add_argument("--amp", action="store_true")
p.add_argument("--epochs", type=int, default=2, help="the last one is timed; the first warms up")
p.add_argument("--workers", type=int, default=os.cpu_count())
p.add_argument("--eval", action="store_true", help="also time evaluation over val/")
args = p.parse_args()

torch.backends.cudnn.benchmark = True
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def cpu_busy():
    """(busy, total) jiffies of all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def cores_busy(a, b):
    busy, total = b[0] - a[0], b[1] - a[1]
    return round(os.cpu_count() * busy / max(total, 1), 1)


def loader(split, tf, shuffle):
    ds = torchvision.datasets.ImageFolder(os.path.join(args.root, split), tf)
    return ds, torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=shuffle, drop_last=shuffle,
                                           num_workers=args.workers, pin_memory=True,
                                           persistent_workers=True, prefetch_factor=4)


train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
train_set, train_loader = loader("train", train_tf, True)
model = getattr(torchvision.models, args.model)(num_classes=len(train_set.classes))
model = model.to(dev).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-5, fused=True)
scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
loss_fn = torch.nn.CrossEntropyLoss()
common = {"model": args.model, "batch": args.batch, "amp": args.amp, "workers": args.workers,
          "torch": torch.__version__, "torchvision": torchvision.__version__}

for epoch in range(args.epochs):
    model.train()
    torch.cuda.synchronize()
    c0, t0, n = cpu_busy(), time.perf_counter(), 0
    for x, y in train_loader:
        x = x.to(dev, non_blocking=True).to(memory_format=torch.channels_last)
        y = y.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        n += x.shape[0]
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    print(json.dumps({"bench": "torch-jpeg", "phase": "train", "epoch": epoch + 1, **common,
                      "images_per_second": round(n / secs, 1), "seconds": round(secs, 2),
                      "host_cores_busy": cores_busy(c0, cpu_busy()), "loss": round(float(loss), 4)}), flush=True)

if args.eval:
    eval_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    _, val_loader = loader("val", eval_tf, False)
    model.eval()
    for rep in range(2):  # the first pass starts the workers
        torch.cuda.synchronize()
        c0, t0, n, hits = cpu_busy(), time.perf_counter(), 0, 0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
            for x, y in val_loader:
                x = x.to(dev, non_blocking=True).to(memory_format=torch.channels_last)
                hits += int((model(x).argmax(1).cpu() == y).sum())
                n += x.shape[0]
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        print(json.dumps({"bench": "torch-jpeg", "phase": "eval", "pass": rep + 1, **common,
                          "images_per_second": round(n / secs, 1), "seconds": round(secs, 2),
                          "host_cores_busy": cores_busy(c0, cpu_busy())}), flush=True)
