#!/usr/bin/env python3
"""PyTorch DDP's side of the data-parallel scaling run (SPEC S27, issue 6): the step of
bench/torch_reference.py (torchvision model, channels_last, SGD momentum 0.9 fused, FP16 autocast
with GradScaler under --amp, synthetic data) wrapped in DistributedDataParallel over NCCL, one
process per GPU, --batch per process. --sync-bn converts BatchNorm to SyncBatchNorm, as kiln's
default. Rank 0 prints one JSON line: the images/s of all processes together (median of repeats).

  torchrun --nproc_per_node 2 bench/torch_ddp.py --model resnet50 --batch 256 --amp --sync-bn
  mpirun -np 2 python3 bench/torch_ddp.py ...      (OMPI_COMM_WORLD_* are read too)
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torchvision

p = argparse.ArgumentParser()
p.add_argument("--model", default="resnet50")
p.add_argument("--batch", type=int, default=256, help="per process")
p.add_argument("--amp", action="store_true")
p.add_argument("--sync-bn", action="store_true")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--image-size", type=int, default=224)
args = p.parse_args()

# torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; mpirun sets OMPI_COMM_WORLD_*.
env = os.environ
rank = int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", 0)))
world = int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1)))
local = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
env.setdefault("MASTER_ADDR", "127.0.0.1")
env.setdefault("MASTER_PORT", "29531")
env.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on shared machines
torch.cuda.set_device(local)
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))

torch.backends.cudnn.benchmark = True
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda", local)
torch.manual_seed(0)
model = getattr(torchvision.models, args.model)()
if args.sync_bn:
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
model = model.to(dev).to(memory_format=torch.channels_last)
model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
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


for _ in range(args.warmup):
    step()
torch.cuda.synchronize()
rates = []
for _ in range(args.repeats):
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    rates.append(world * args.steps * args.batch / (time.perf_counter() - t0))
if rank == 0:
    print(json.dumps({"bench": "torch-ddp", "model": args.model, "batch": args.batch, "amp": args.amp,
                      "sync_bn": args.sync_bn, "world": world,
                      "images_per_second": round(statistics.median(rates), 1), "torch": torch.__version__,
                      "gpu": torch.cuda.get_device_name()}), flush=True)
dist.destroy_process_group()
