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

torch.manual_seed(1234)
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


net = CNN()
# Non-trivial BN affine parameters, so their gradients are tested too.
for m in net.modules():
    if isinstance(m, nn.BatchNorm2d):
        m.weight.data.uniform_(0.5, 1.5)
        m.bias.data.uniform_(-0.2, 0.2)
N = 8
x = torch.randn(N, 1, 28, 28)
y = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9])
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
header["__metadata__"] = {"made_by": "tests/golden/make_cnn_golden.py", "torch": torch.__version__}
h = json.dumps(header, separators=(",", ":")).encode()
h += b" " * ((8 - len(h) % 8) % 8)
with open("tests/data/golden_cnn.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for b in blobs:
        f.write(b)
print("loss", loss.item())
