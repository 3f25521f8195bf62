#!/usr/bin/env python3
"""Writes an ImageNet-like image folder for the JPEG benchmarks (issue 16), from a fixed seed.

root/{train,val}/<class>/*.JPEG: sizes drawn from ~400x350 to 500x500, quality 88-92, about
110 KB a file like ImageNet's, 8% progressive and 4% greyscale. The content is a smooth random
field with texture and edges, so that the files compress like photographs (random noise would
be 3x larger, flat colour 10x smaller). Needs numpy and Pillow (both on the GPU machine).

  bench/make_jpeg_folder.py ROOT [--classes 100] [--train 130] [--val 20] [--seed 0] [--jobs N]
"""
import argparse
import io
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image


def smooth_field(rng, h, w, cells):
    """Bilinearly upsampled random grid: the low frequencies of a photograph."""
    grid = rng.random((cells + 1, cells + 1, 3)).astype(np.float32)
    ys = np.linspace(0, cells, h, dtype=np.float32)
    xs = np.linspace(0, cells, w, dtype=np.float32)
    y0 = np.minimum(ys.astype(int), cells - 1)
    x0 = np.minimum(xs.astype(int), cells - 1)
    fy = (ys - y0)[:, None, None]
    fx = (xs - x0)[None, :, None]
    a = grid[y0][:, x0]
    b = grid[y0][:, x0 + 1]
    c = grid[y0 + 1][:, x0]
    d = grid[y0 + 1][:, x0 + 1]
    return (a * (1 - fx) + b * fx) * (1 - fy) + (c * (1 - fx) + d * fx) * fy


def make_image(seed, klass, index):
    rng = np.random.default_rng([seed, klass, index])
    h = int(rng.integers(350, 501))
    w = int(rng.integers(400, 501))
    base = smooth_field(rng, h, w, int(rng.integers(3, 9)))
    detail = smooth_field(rng, h, w, int(rng.integers(40, 90)))
    # A class tint, so that a model can learn something from the folder.
    tint = np.array([(klass * 37) % 100, (klass * 61) % 100, (klass * 83) % 100], np.float32) / 100.0
    img = 0.55 * base + 0.25 * detail + 0.2 * tint
    img += rng.normal(0.0, 0.08, (h, w, 3)).astype(np.float32)  # sensor noise: most of the bytes
    # A few hard edges (objects).
    for _ in range(int(rng.integers(2, 6))):
        y, x = int(rng.integers(0, h)), int(rng.integers(0, w))
        r = int(rng.integers(20, 120))
        img[max(0, y - r):y + r, max(0, x - r):x + r] *= float(rng.uniform(0.6, 1.3))
    arr = np.clip(img * 255.0, 0, 255).astype(np.uint8)
    progressive = rng.random() < 0.08
    grey = rng.random() < 0.04
    pil = Image.fromarray(arr)
    if grey:
        pil = pil.convert("L")
    buf = io.BytesIO()
    pil.save(buf, "JPEG", quality=int(rng.integers(88, 93)), progressive=progressive, subsampling="4:2:0")
    return buf.getvalue(), progressive, grey


def write_class(args):
    root, split, seed, klass, count = args
    d = os.path.join(root, split, f"n{klass:08d}")
    os.makedirs(d, exist_ok=True)
    total = prog = grey = 0
    for i in range(count):
        data, p, g = make_image(seed + (0 if split == "train" else 7919), klass, i)
        with open(os.path.join(d, f"{split}_{klass:04d}_{i:05d}.JPEG"), "wb") as f:
            f.write(data)
        total += len(data)
        prog += p
        grey += g
    return total, prog, grey, count


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--train", type=int, default=130)
    ap.add_argument("--val", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    a = ap.parse_args()
    if os.path.isdir(os.path.join(a.root, "train")):
        print(json.dumps({"jpeg_folder": a.root, "exists": True}))
        return 0
    # Written under ROOT.partial and renamed, so that a reader never sees half a folder.
    part = a.root.rstrip("/") + ".partial"
    work = [(part, "train", a.seed, k, a.train) for k in range(a.classes)]
    work += [(part, "val", a.seed, k, a.val) for k in range(a.classes)]
    with ProcessPoolExecutor(a.jobs) as ex:
        res = list(ex.map(write_class, work))
    os.rename(part, a.root)
    n = sum(r[3] for r in res)
    stats = {"images": n, "mean_kb": round(sum(r[0] for r in res) / n / 1024, 1),
             "progressive": sum(r[1] for r in res), "grey": sum(r[2] for r in res),
             "classes": a.classes, "train_per_class": a.train, "val_per_class": a.val, "seed": a.seed}
    print(json.dumps({"jpeg_folder": a.root, **stats}))


if __name__ == "__main__":
    sys.exit(main())
