#!/usr/bin/env python3
"""Writes tests/data/golden_cnn.safetensors: one PyTorch training step of kiln's `cnn` model
(the Fashion-MNIST default) for tests/e2e/golden_test.cpp to match (SPEC Q2).

Run with Debian's python3-torch (1.13, CPU):  /usr/bin/python3 tests/golden/make_cnn_golden.py
The file holds, in torchvision's names and layouts: the initial weights and buffers, the batch
(images NHWC for kiln, labels), the loss, every parameter's gradient ("grad.<name>"), and the
weights and running statistics after one SGD step ("after.<name>"). float64 is used for the
reference computation and the results are stored as float32.
"""
import json
import struct
from collections import OrderedDict

import torch
import torch.nn as nn

torch.set_default_dtype(torch.float64)


def cbr(i, o):
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(i, o, 3, 1, 1, bias=False),
                                     bn=nn.BatchNorm2d(o), relu=nn.ReLU()))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1, self.block2 = cbr(1, 32), cbr(32, 32)
        self.pool1 = nn.MaxPool2d(2, 2)
        self.block3, self.block4 = cbr(32, 64), cbr(64, 64)
        self.pool2 = nn.MaxPool2d(2, 2)
        self.fc = nn.Linear(64 * 7 * 7, 10)

    def forward(self, x):
        x = self.pool1(self.block2(self.block1(x)))
        x = self.pool2(self.block4(self.block3(x)))
        return self.fc(torch.flatten(x, 1))


# A ReLU's backward and a max-pool's argmax are discontinuous: where a ReLU input lies within
# FP32 rounding of zero, or two values of a pooling window within rounding of each other, an
# FP32 implementation may take the other side and pass one element's whole gradient where the
# reference passes none (or to another element). The reference is only comparable where the
# step is continuous, so the seed is drawn until no ReLU input lies within MARGIN of zero and
# no pooling window's two largest values (the largest positive) lie within MARGIN of each other.
# FP32 implementations differ from float64 by ~1e-6 here (measured on the CPU and the GPU);
# MARGIN leaves 10x room.
MARGIN = 1e-5


def margin_of(net, x):
    """Smallest distance of any ReLU input from 0 and of any pooling window's top two."""
    worst = [float("inf")]

    def relu_in(_, inp, __):
        worst[0] = min(worst[0], inp[0].abs().min().item())

    def pool_in(_, inp, __):
        t = inp[0]
        n, c, h, w = t.shape
        win = t.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(-1, 4)
        top2 = win.topk(2, dim=1).values
        gap = (top2[:, 0] - top2[:, 1])[top2[:, 0] > 0]
        if gap.numel():
            worst[0] = min(worst[0], gap.min().item())

    hooks = [m.register_forward_hook(relu_in) for m in net.modules() if isinstance(m, nn.ReLU)]
    hooks += [m.register_forward_hook(pool_in) for m in net.modules() if isinstance(m, nn.MaxPool2d)]
    with torch.no_grad():
        net.train()
        state = {k: v.clone() for k, v in net.state_dict().items()}
        net(x)
        net.load_state_dict(state)  # undo the running-statistics update of this probe
    for h in hooks:
        h.remove()
    return worst[0]


N = 8
y = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9])
for seed in range(1234, 1234 + 5000):
    torch.manual_seed(seed)
    net = CNN()
    # Non-trivial BN affine parameters, so their gradients are tested too.
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    x = torch.randn(N, 1, 28, 28)
    margin = margin_of(net, x)
    if margin >= MARGIN:
        break
else:
    raise SystemExit("no seed in 5000 keeps every ReLU input and pooling tie %g away" % MARGIN)
print("seed", seed, "margin", margin)
lr, momentum, wd = 0.1, 0.9, 5e-4

out = {}


def put(name, t):
    out[name] = t.detach().to(torch.float32).contiguous()


for k, v in net.state_dict().items():
    if not k.endswith("num_batches_tracked"):
        put(k, v)
put("input.nhwc", x.permute(0, 2, 3, 1))
out["labels"] = y.to(torch.int32)

decay = [p for n, p in net.named_parameters() if n.endswith("weight") and ("conv" in n or n.startswith("fc"))]
no_decay = [p for n, p in net.named_parameters() if not any(p is q for q in decay)]
opt = torch.optim.SGD([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                      lr=lr, momentum=momentum, nesterov=True)
net.train()
loss = nn.functional.cross_entropy(net(x), y)
opt.zero_grad()
loss.backward()
out["loss"] = loss.detach().reshape(1).to(torch.float32)
for n, p in net.named_parameters():
    put("grad." + n, p.grad)
opt.step()
for k, v in net.state_dict().items():
    if not k.endswith("num_batches_tracked"):
        put("after." + k, v)

# safetensors writer (the format: u64 header length, JSON header, raw little-endian data).
header, blobs, offset = {}, [], 0
for name in sorted(out):
    t = out[name]
    raw = t.numpy().tobytes()
    header[name] = {"dtype": {torch.float32: "F32", torch.int32: "I32"}[t.dtype],
                    "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
    blobs.append(raw)
    offset += len(raw)
header["__metadata__"] = {"made_by": "tests/golden/make_cnn_golden.py", "torch": torch.__version__,
                          "seed": str(seed), "margin": "%.3g" % margin}
h = json.dumps(header, separators=(",", ":")).encode()
h += b" " * ((8 - len(h) % 8) % 8)
with open("tests/data/golden_cnn.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for b in blobs:
        f.write(b)
print("loss", loss.item())
