#!/usr/bin/env python3
"""How far rounding alone takes a zoo model's training step from float64, in PyTorch: the
reference the golden tests' tolerances are argued from (tests/support/torch_golden.h,
tests/gpu/gpu_golden_test.cpp). No kiln involved.

    python3 bench/golden_rounding.py MODEL [--mode fp16|fp32] [--scale S] [--batch 4] [--seeds 7 8 9]
                                           [--small-bn3]

fp16 emulates kiln's AMP in float64: every convolution input, weight and output, BatchNorm
output and ReLU output rounded to FP16 (and each of their gradients on the way back, scaled by
the loss scale S); fp32 is PyTorch's own float32 step. Either is compared with the float64 step
of the same weights and batch (torch's initialisation, then BatchNorm parameters and running
statistics randomised as the golden tests do; --small-bn3: a bottleneck's bn3 weights from
[0.05, 0.15], as tests/support/torch_golden.h's resnet50_small_step), the reference following the rounded step's ReLU
choices as tests/golden/torch_step.py --choices does. Prints the loss's relative error, the
worst gradient error of its tensor's scale (a bias on its weight's scale) and the worst running
statistic's, and how many ReLU choices the reference followed (and how far from the kink, of
that input tensor's scale).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
import torch_step as ts  # noqa: E402


class Fp16(torch.autograd.Function):
    """Rounds to FP16 and back, forward and backward: a tensor kiln stores in FP16 under AMP."""

    @staticmethod
    def forward(ctx, x):
        return x.half().to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.half().to(g.dtype)


EMULATE = [False]
MASKS = {}
plain_conv, plain_bn, plain_relu = nn.Conv2d.forward, nn.BatchNorm2d.forward, ts.ReLU.forward


def conv_forward(self, x):
    if not EMULATE[0]:
        return plain_conv(self, x)
    return Fp16.apply(F.conv2d(Fp16.apply(x), Fp16.apply(self.weight), self.bias, self.stride, self.padding))


def bn_forward(self, x):
    y = plain_bn(self, x)
    return Fp16.apply(y) if EMULATE[0] else y


def relu_forward(self, x):
    if not EMULATE[0]:
        return plain_relu(self, x)
    MASKS["relu." + self.path] = (x > 0).to(torch.uint8)
    return Fp16.apply(torch.relu(x)) if EMULATE[1] else torch.relu(x)


nn.Conv2d.forward, nn.BatchNorm2d.forward, ts.ReLU.forward = conv_forward, bn_forward, relu_forward
EMULATE.append(True)  # EMULATE[1]: round (fp16) or only record the choices (fp32)


def step(model, seed, batch, rounded, mode, scale, small_bn3):
    torch.manual_seed(seed)
    net = ts.MODELS[model]()
    ts.name_kinks(net)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.uniform_(-0.2, 0.2, generator=g)
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
        if small_bn3:
            for name, m in net.named_modules():
                if name.endswith(".bn3"):
                    m.weight.uniform_(0.05, 0.15, generator=g)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    y = torch.tensor([(3 * i) % 10 for i in range(batch)])
    net.train()
    if rounded and mode == "fp32":
        net, x = net.float(), x.float()
        EMULATE[0], EMULATE[1] = False, False
        ts.ReLU.forward = lambda self, t: (MASKS.__setitem__("relu." + self.path, (t > 0).to(torch.uint8)),
                                           torch.relu(t))[1]
        loss = F.cross_entropy(net(x), y)
        ts.ReLU.forward = relu_forward
        loss.backward()
        scale = 1.0
    else:
        EMULATE[0], EMULATE[1] = rounded, True
        loss = F.cross_entropy(net(Fp16.apply(x) if rounded else x), y)
        (loss * (scale if rounded else 1.0)).backward()
        EMULATE[0] = False
        scale = scale if rounded else 1.0
    out = {n: p.grad.detach().double() / scale for n, p in net.named_parameters()}
    out.update({"buf." + n: b.detach().double() for n, b in net.named_buffers() if "running" in n})
    return loss.item(), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=sorted(ts.MODELS))
    ap.add_argument("--mode", choices=["fp16", "fp32"], default="fp16")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9])
    ap.add_argument("--small-bn3", action="store_true")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    for seed in args.seeds:
        MASKS.clear()
        ts.CHOICES.clear()
        ts.KINKS["relu_flips"], ts.KINKS["relu_margin"] = 0, 0.0
        loss_r, got = step(args.model, seed, args.batch, True, args.mode, args.scale, args.small_bn3)
        ts.CHOICES.update(MASKS)
        loss_f, want = step(args.model, seed, args.batch, False, args.mode, 1.0, args.small_bn3)
        grads, bufs = [], []
        for n, w in want.items():
            if not torch.isfinite(got[n]).all():
                raise SystemExit("%s: %s overflowed at loss scale %g" % (args.model, n, args.scale))
            scale = w.abs().max().item()
            if n.endswith(".bias") and n[:-5] + ".weight" in want:
                scale = max(scale, want[n[:-5] + ".weight"].abs().max().item())
            e = ((got[n] - w).abs().max().item() / max(scale, 1e-30), n)
            (bufs if n.startswith("buf.") else grads).append(e)
        grads.sort()
        print("%s%s %s scale %g batch %d seed %d: loss %.2g, worst gradient %.3g (%s), median tensor %.2g, "
              "running statistic %.2g (%s); ReLU choices followed %d (within %.2g of scale)" % (
                  args.model, " (small bn3)" if args.small_bn3 else "", args.mode, args.scale, args.batch, seed, abs(loss_r - loss_f) / abs(loss_f),
                  grads[-1][0], grads[-1][1], grads[len(grads) // 2][0], max(bufs)[0], max(bufs)[1][4:],
                  ts.KINKS["relu_flips"], ts.KINKS["relu_margin"]))


if __name__ == "__main__":
    main()
