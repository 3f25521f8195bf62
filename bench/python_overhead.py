#!/usr/bin/env python3
"""Python's overhead (issue 19): `engine.train_step` driven from a Python loop against
`kiln bench` in C++, same model, batch, device and step count, in one run.

Python's batches are made once and reused, on the device where the engine is (torch CUDA
tensors through DLPack on a GPU, NumPy arrays on the CPU), as `kiln bench --stage once` trains
on a batch resident on the device; each step's statistics stay on the device unread (as
kiln bench's), the last step's read at the end of a repeat.
Prints one JSON line per side and the ratio; median over repeats.

  python3 bench/python_overhead.py --kiln build/kiln --model cnn --batch 128 --device cuda
"""
import argparse
import json
import statistics
import subprocess
import time

import numpy as np

import kiln

p = argparse.ArgumentParser()
p.add_argument("--kiln", required=True, help="the kiln CLI, for `kiln bench`")
p.add_argument("--model", default="cnn")
p.add_argument("--batch", type=int, default=128)
p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
p.add_argument("--amp", action="store_true")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--repeats", type=int, default=5)
args = p.parse_args()

model = kiln.zoo(args.model)
engine = kiln.Engine(model, batch=args.batch, amp=args.amp, device=args.device, seed=1)
rng = np.random.default_rng(0)
hwc = tuple(model.input)  # (height, width, channels)
images = rng.standard_normal((args.batch, *hwc), dtype=np.float32)
labels = rng.integers(0, model.num_classes, args.batch).astype(np.int64)
if args.device == "cuda":
    import torch
    images = torch.from_numpy(images).cuda()
    labels = torch.from_numpy(labels).cuda()
    sync = torch.cuda.synchronize
else:
    sync = lambda: None  # noqa: E731

for _ in range(args.warmup):
    engine.train_step(images, labels, lr=0.01)
sync()
py = []
for _ in range(args.repeats):
    t = time.perf_counter()
    for _ in range(args.steps):
        s = engine.train_step(images, labels, lr=0.01)
    s.loss  # the last step's statistics: every step has finished
    sync()
    py.append(args.batch * args.steps / (time.perf_counter() - t))
py_ips = statistics.median(py)
print(json.dumps({"side": "python", "images_per_s": round(py_ips, 1),
                  "repeats": [round(x, 1) for x in py], "last_loss": s.loss}))

# once: the batch stays on the device (as Python's does); every-step: copied from the host each
# step, as a loader does (Python copies device to device into the input slot each step).
for stage in ("once", "every-step"):
    cmd = [args.kiln, "bench", "--model", args.model, "--batch", str(args.batch), "--device",
           args.device, "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats",
           str(args.repeats), "--stage", stage] + (["--amp"] if args.amp else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"bench"')]
    if not rows:
        raise SystemExit("python_overhead: `kiln bench` printed no JSON line:\n" + out)
    cpp_ips = rows[-1]["images_per_second"]
    print(json.dumps({"side": "c++", "stage": stage, "images_per_s": cpp_ips,
                      "command": " ".join(cmd)}))
    print(json.dumps({"stage": stage, "python_vs_cpp": round(py_ips / cpp_ips, 4),
                      "overhead_percent": round(100 * (1 - py_ips / cpp_ips), 2)}))
