#!/usr/bin/env python3
"""One PyTorch training step of a kiln zoo model, in float64 on the CPU: the reference that
tests/support/torch_golden.h compares kiln's step with (SPEC Q2, issue 4).

    python3 tests/golden/torch_step.py MODEL IN.safetensors OUT.safetensors \
        [--lr 0.1] [--momentum 0.9] [--nesterov] [--weight-decay 5e-4] [--choices KILN.safetensors]

MODEL is one of kiln's small forms written here in plain torch.nn with torchvision's module
names, so that kiln's export (kiln::export_state_dict) loads as it is:
  cnn             the Fashion-MNIST default (28x28x1), as tests/golden/make_cnn_golden.py
  resnet18_small  ResNet-18 with a 3x3 stride-1 stem and no max-pool (32x32x3)
  resnet50_small  ResNet-50 (bottleneck blocks, stride on the 3x3) with the same stem (32x32x3)
  vgg11_bn_small  VGG11-BN features and one fc classifier on the 1x1x512 map (32x32x3)
(src/blueprint/zoo.cpp defines them; the architectures here must follow it.)

IN holds, in torchvision's names and layouts, every parameter and BatchNorm buffer
(num_batches_tracked optional), the batch "input.nhwc" (F32, N,H,W,C) and "labels" (I32 or
I64). Other tensors (a golden file's "grad.*", "after.*", "loss") are ignored, so the
committed tests/data/golden_cnn.safetensors is a valid input too.

--choices gives kiln's discrete decisions of the same step: "relu.<path>" (U8, N,C,H,W: 1 where
kiln's ReLU passed its input, i.e. its output is > 0) and "argmax.<path>" (I32, N,C,H,W: the
max-pool's pick, ih * W + iw in the input plane, as kiln and torch number it). A ReLU input or
a max-pool's top two within rounding of each other is decided by rounding: float32 and float64
may choose differently, and one element routed differently moves a whole channel's gradient by
its size (seen: a ResNet-18 pre-activation of 2e-6 gave 4e-2 errors upstream). The reference
then follows kiln's choice and stays exact otherwise; "check.kinks" [4] (F32) says how far
that went: how many ReLU choices differ from float64's, the largest |input| among them
(relative to that input tensor's largest magnitude), how many max-pool picks differ, and the
largest shortfall of a pick below its window's maximum (same scale). A wrong kiln forward
shows there as margins far above rounding.

OUT gets, as F32: "loss" [1], "grad.<param>" for every parameter, and "after.<name>" for every
parameter and running statistic after one SGD step (and "check.kinks" with --choices). The
conventions are kiln's (src/graph/compiler.cpp, src/backend/cpu/optim.cpp): mean cross-entropy; BatchNorm in
training mode with kiln's eps and momentum (1e-5, 0.1: torch's defaults) and the unbiased
batch variance in the running statistic; SGD with momentum (dampening 0, optionally Nesterov)
and weight decay on conv and fc weights only (not on BatchNorm parameters or biases).

Works with torch 1.13 (Debian's python3-torch) and 2.x; needs neither torchvision, numpy nor
the safetensors package (the format is read and written by hand: a u64 little-endian header
length, a JSON header, then the raw little-endian data).
"""
import argparse
import json
import struct
from collections import OrderedDict

import torch
import torch.nn as nn

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
NAMES = {v: k for k, v in DTYPES.items()}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    data = bytearray(blob[8 + n:])  # writable, so torch.frombuffer does not warn
    out = {}
    for name, h in header.items():
        begin, end = h["data_offsets"]
        dtype = DTYPES[h["dtype"]]
        if end == begin:
            t = torch.zeros(0, dtype=dtype)
        else:
            size = torch.empty((), dtype=dtype).element_size()
            t = torch.frombuffer(data, dtype=dtype, count=(end - begin) // size, offset=begin).clone()
        out[name] = t.reshape(h["shape"])
    return out


def write_safetensors(path, tensors, metadata):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = bytearray(t.numel() * t.element_size())
        if t.numel():
            torch.frombuffer(raw, dtype=t.dtype).copy_(t.reshape(-1))
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


# ---- kiln's discrete choices (--choices) ---------------------------------------------------------

CHOICES = {}  # "relu.<path>" / "argmax.<path>" -> tensor
KINKS = {"relu_flips": 0, "relu_margin": 0.0, "pool_flips": 0, "pool_gap": 0.0}


class ReLU(nn.Module):
    """ReLU that, given kiln's mask for its path, passes exactly the elements kiln passed."""

    def forward(self, x):
        mask = CHOICES.get("relu." + self.path)
        if mask is None:
            return torch.relu(x)
        mask = mask.to(torch.bool).reshape(x.shape)
        differ = mask != (x > 0)
        if differ.any():
            KINKS["relu_flips"] += int(differ.sum())
            scale = max(x.detach().abs().max().item(), 1e-300)
            KINKS["relu_margin"] = max(KINKS["relu_margin"], x.detach()[differ].abs().max().item() / scale)
        return x * mask.to(x.dtype)


class MaxPool2d(nn.MaxPool2d):
    """Max-pool that, given kiln's argmax for its path, takes kiln's pick of each window."""

    def forward(self, x):
        idx = CHOICES.get("argmax." + self.path)
        if idx is None:
            return super().forward(x)
        best = super().forward(x).detach()
        n, c, h, w = x.shape
        idx = idx.to(torch.int64).reshape(best.shape)
        # The pick must lie in its own window (a stray index is a kiln bug, not rounding).
        oh = torch.arange(best.shape[2]).view(1, 1, -1, 1) * self.stride - self.padding
        ow = torch.arange(best.shape[3]).view(1, 1, 1, -1) * self.stride - self.padding
        ih, iw = idx // w, idx % w
        inside = (ih >= oh) & (ih < oh + self.kernel_size) & (iw >= ow) & (iw < ow + self.kernel_size)
        if not bool(inside.all()):
            raise SystemExit("torch_step.py: kiln's argmax of %s leaves its window" % self.path)
        y = x.reshape(n, c, h * w).gather(2, idx.reshape(n, c, -1)).reshape(best.shape)
        gap = best - y.detach()
        if (gap > 0).any():
            KINKS["pool_flips"] += int((gap > 0).sum())
            scale = max(x.detach().abs().max().item(), 1e-300)
            KINKS["pool_gap"] = max(KINKS["pool_gap"], gap.max().item() / scale)
        return y


def name_kinks(net):
    for path, m in net.named_modules():
        if isinstance(m, (ReLU, MaxPool2d)):
            m.path = path


# ---- kiln's zoo models (src/blueprint/zoo.cpp) in torchvision's names -------------------------

def cbr(i, o):
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(i, o, 3, 1, 1, bias=False),
                                     bn=nn.BatchNorm2d(o), relu=ReLU()))


class CNN(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.block1, self.block2 = cbr(1, 32), cbr(32, 32)
        self.pool1 = MaxPool2d(2, 2)
        self.block3, self.block4 = cbr(32, 64), cbr(64, 64)
        self.pool2 = MaxPool2d(2, 2)
        self.fc = nn.Linear(64 * 7 * 7, classes)

    def forward(self, x):
        x = self.pool1(self.block2(self.block1(x)))
        x = self.pool2(self.block4(self.block3(x)))
        return self.fc(torch.flatten(x, 1))  # C,H,W order: kiln's export permutes fc columns to it


class BasicBlock(nn.Module):
    # kiln: residual(seq(conv1, bn1, relu, conv2, bn2), downsample), then add and ReLU
    # ("relu_out": torchvision reuses `relu`; a module without state changes no name).
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = ReLU()
        self.relu_out = ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu_out(y + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    # kiln: residual(seq(conv1 1x1, bn1, relu, conv2 3x3 with the block's stride, bn2, relu2,
    # conv3 1x1 to 4 * width, bn3), downsample), then add and ReLU (torchvision's V1.5 block;
    # "relu2" and "relu_out": torchvision reuses `relu`, which changes no name of a state).
    expansion = 4

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, 1, 0, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu2 = ReLU()
        self.conv3 = nn.Conv2d(width, cout, 1, 1, 0, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu_out = ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn3(self.conv3(self.relu2(self.bn2(self.conv2(y)))))
        return self.relu_out(y + (x if self.downsample is None else self.downsample(x)))


class ResNetSmall(nn.Module):
    # The CIFAR form: 3x3 stride-1 stem, no max-pool; four stages of `blocks` blocks, the first
    # of stages 2 to 4 with stride 2.
    def __init__(self, block, blocks, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = ReLU()
        cin = 64
        for s, width in enumerate([64, 128, 256, 512]):
            layer = []
            for b in range(blocks[s]):
                layer.append(block(cin, width, 2 if (b == 0 and s > 0) else 1))
                cin = width * getattr(block, "expansion", 1)
            setattr(self, "layer%d" % (s + 1), nn.Sequential(*layer))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class VGG11BNSmall(nn.Module):
    # torchvision's VGG11-BN features (conv with bias, BN, ReLU; "M" = 2x2 max-pool), then, as
    # kiln's small form, flatten and a single fc named "classifier" on the 1x1x512 map.
    CFG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]

    def __init__(self, classes=10):
        super().__init__()
        layers, cin = [], 3
        for v in self.CFG:
            if v == "M":
                layers.append(MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, v, 3, 1, 1, bias=True), nn.BatchNorm2d(v), ReLU()]
                cin = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


MODELS = {"cnn": CNN,
          "resnet18_small": lambda: ResNetSmall(BasicBlock, [2, 2, 2, 2]),
          "resnet50_small": lambda: ResNetSmall(Bottleneck, [3, 4, 6, 3]),
          "vgg11_bn_small": VGG11BNSmall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--nesterov", action="store_true")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--choices", help="kiln's ReLU masks and max-pool picks of the same step")
    args = ap.parse_args()

    torch.set_default_dtype(torch.float64)
    src = read_safetensors(args.input)
    net = MODELS[args.model]()
    name_kinks(net)
    if args.choices:
        CHOICES.update(read_safetensors(args.choices))
        paths = {"relu." + m.path for m in net.modules() if isinstance(m, ReLU)}
        paths |= {"argmax." + m.path for m in net.modules() if isinstance(m, MaxPool2d)}
        if set(CHOICES) != paths:
            raise SystemExit("torch_step.py: %s has choices for %s; %s has %s"
                             % (args.choices, sorted(CHOICES), args.model, sorted(paths)))
    # Every parameter and running statistic must come from the file (a missing one would
    # silently compare against torch's own initialisation).
    state = net.state_dict()
    load = OrderedDict()
    for name, ref in state.items():
        if name.endswith("num_batches_tracked"):
            load[name] = src[name].to(torch.int64).reshape(()) if name in src else ref
            continue
        if name not in src:
            raise SystemExit("torch_step.py: %s lacks '%s'" % (args.input, name))
        t = src[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise SystemExit("torch_step.py: '%s' is %s in %s; %s expects %s"
                             % (name, list(t.shape), args.input, args.model, list(ref.shape)))
        load[name] = t.to(torch.float64)
    net.load_state_dict(load)
    x = src["input.nhwc"].to(torch.float64).permute(0, 3, 1, 2).contiguous()
    y = src["labels"].to(torch.int64).reshape(-1)

    # Weight decay on conv and fc weights only, as kiln (ParamDesc::decay).
    decay_ids = {id(m.weight) for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    decay = [p for p in net.parameters() if id(p) in decay_ids]
    no_decay = [p for p in net.parameters() if id(p) not in decay_ids]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, momentum=args.momentum, nesterov=args.nesterov)
    net.train()
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()

    out = {"loss": loss.detach().reshape(1).to(torch.float32)}
    for n, p in net.named_parameters():
        out["grad." + n] = p.grad.detach().to(torch.float32)
    opt.step()
    for k, v in net.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            out["after." + k] = v.detach().to(torch.float32)
    if args.choices:
        out["check.kinks"] = torch.tensor([KINKS["relu_flips"], KINKS["relu_margin"], KINKS["pool_flips"],
                                           KINKS["pool_gap"]], dtype=torch.float32)
    write_safetensors(args.output, out, {"made_by": "tests/golden/torch_step.py", "model": args.model,
                                         "torch": torch.__version__})
    print("torch_step.py: %s loss %.9g (torch %s)%s" % (
        args.model, loss.item(), torch.__version__,
        "; followed kiln at %d ReLU(s) (largest |input| %.2g of scale) and %d max-pool pick(s) (gap %.2g)"
        % (KINKS["relu_flips"], KINKS["relu_margin"], KINKS["pool_flips"], KINKS["pool_gap"]) if args.choices else ""))


if __name__ == "__main__":
    main()
