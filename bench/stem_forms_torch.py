#!/usr/bin/env python3
"""ResNet-50's stem (7x7 stride-2 convolution, 3 -> 64 channels, 224x224) in FP16 channels-last
on the GPU, timed in the forms it could take: cuDNN on 3 channels (what kiln and PyTorch run),
on 4 and 8 zero-padded channels, as a 4x4 stride-1 convolution of the 2x2 space-to-depth input
(12 channels, padded to 16), and as an explicit im2col copy + GEMM. Forward and weight gradient
each, cudnn.benchmark on (cuDNN times every engine). Each form's output is checked against the
3-channel convolution, so a faster form that computes something else is not reported as one.

    python3 bench/stem_forms_torch.py [--batch 256] [--reps 20]
"""
import argparse

import torch
import torch.nn.functional as F


def timed(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def pad_c(t, c):
    return F.pad(t, (0, 0, 0, 0, 0, c - t.shape[1])).contiguous(memory_format=torch.channels_last)


def space_to_depth(x):
    # [N, C, 230, 230] (the 224 input with the conv's padding of 3) -> [N, 4C, 115, 115]
    n, c, h, w = x.shape
    x = x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
    return x.reshape(n, 4 * c, h // 2, w // 2)


def s2d_weight(w):
    # 7x7 stride 2 = 4x4 stride 1 over 2x2 blocks: pad the kernel to 8x8, then fold.
    k, c = w.shape[:2]
    w8 = F.pad(w, (0, 1, 0, 1))
    return w8.view(k, c, 4, 2, 4, 2).permute(0, 3, 5, 1, 2, 4).reshape(k, 4 * c, 4, 4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    dev = "cuda"
    cl = torch.channels_last
    n = a.batch
    x = torch.randn(n, 3, 224, 224, device=dev, dtype=torch.half).contiguous(memory_format=cl)
    w = (torch.randn(64, 3, 7, 7, device=dev, dtype=torch.half) * 0.1).contiguous(memory_format=cl)
    dy = torch.randn(n, 64, 112, 112, device=dev, dtype=torch.half).contiguous(memory_format=cl)
    ref = F.conv2d(x, w, stride=2, padding=3).float()
    ref_dw = torch.nn.grad.conv2d_weight(x, w.shape, dy, stride=2, padding=3).float()
    scale = ref.abs().max().item()
    print(f"GPU: {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}, batch {n}")
    print("| form | forward ms | weight gradient ms | forward max error / max |z| |")
    print("|---|---|---|---|")

    def row(name, fwd, wgrad, out):
        err = (out.float() - ref).abs().max().item() / scale
        print(f"| {name} | {timed(fwd, a.reps):.3f} | {timed(wgrad, a.reps):.3f} | {err:.2e} |")

    for c in (3, 4, 8):
        xc, wc = (x, w) if c == 3 else (pad_c(x, c), pad_c(w, c))
        out = F.conv2d(xc, wc, stride=2, padding=3)
        row(f"cuDNN, {c} channels", lambda: F.conv2d(xc, wc, stride=2, padding=3),
            lambda: torch.nn.grad.conv2d_weight(xc, wc.shape, dy, stride=2, padding=3), out)

    # Space-to-depth: the padded input folded into 2x2 blocks, a 4x4 stride-1 convolution.
    xp = F.pad(x, (3, 3, 3, 3))
    for c in (12, 16):
        xs = pad_c(space_to_depth(xp), c)
        ws = pad_c(s2d_weight(w), c)
        out = F.conv2d(xs, ws)  # 115 - 4 + 1 = 112: the stem's output exactly
        row(f"space-to-depth, {c} channels, 4x4 stride 1", lambda: F.conv2d(xs, ws),
            lambda: torch.nn.grad.conv2d_weight(xs, ws.shape, dy), out)
        print(f"|   (the fold itself: {timed(lambda: pad_c(space_to_depth(xp), c), a.reps):.3f} ms) | | | |")

    # im2col + GEMM: [N*112*112, 147 -> 152] x [152, 64].
    xpl = xp.permute(0, 2, 3, 1).contiguous()  # NHWC [N, 230, 230, 3]
    s = xpl.stride()
    cols_view = xpl.as_strided((n, 112, 112, 7, 7, 3), (s[0], 2 * s[1], 2 * s[2], s[1], s[2], s[3]))
    cols = torch.zeros(n * 112 * 112, 152, device=dev, dtype=torch.half)

    def im2col():
        cols[:, :147].view(n, 112, 112, 7, 7, 3).copy_(cols_view)

    im2col()
    wmat = torch.zeros(152, 64, device=dev, dtype=torch.half)
    wmat[:147] = w.permute(2, 3, 1, 0).reshape(147, 64)
    out = (cols @ wmat).view(n, 112, 112, 64).permute(0, 3, 1, 2)
    dyl = dy.permute(0, 2, 3, 1).reshape(-1, 64)
    row("im2col + GEMM (GEMM only)", lambda: cols @ wmat, lambda: dyl.t() @ cols, out)
    print(f"|   (the im2col copy by torch's strided copy: {timed(im2col, a.reps):.3f} ms) | | | |")
    dw = (dyl.t().float() @ cols.float())[:, :147].view(64, 7, 7, 3).permute(0, 3, 1, 2)
    print(f"im2col weight gradient max error / max: "
          f"{(dw - ref_dw).abs().max().item() / ref_dw.abs().max().item():.2e}")


if __name__ == "__main__":
    main()
