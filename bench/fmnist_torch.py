#!/usr/bin/env python3
"""PyTorch's side of the Fashion-MNIST comparison (issue 3's anchor): the same CNN as kiln's
`cnn` (four 3x3 Conv+BN+ReLU with 32, 32, 64, 64 channels, two 2x2 max-pools, one fc), batch
128, SGD with Nesterov momentum 0.9, weight decay 5e-4 on conv/fc weights, a one-cycle
schedule peaking at 0.1 with the momentum held at 0.9 (as kiln's onecycle; --cycle-momentum
restores OneCycleLR's default 0.95 -> 0.85 -> 0.95), random horizontal flips,
Normalize(0.2860, 0.3530). --init kiln starts the convs as kiln does (kaiming normal, fan_out).

Issue 18's recipe (bench/fidelity_compare.sh): --label-smoothing (CrossEntropyLoss's), and
mixup / cutmix of each training batch: torchvision.transforms.v2's MixUp and CutMix under
RandomChoice (cutmix with probability --mixup-switch-prob) where the installed torchvision has
them (0.16+), else the same arithmetic written out (Debian's torchvision 0.14): one lambda ~
Beta(a, a) per batch, sample n's partner is sample n - 1 (batch.roll(1, 0)), cutmix's box as
v2.CutMix with lambda corrected to the clipped box's area, soft targets. --mixup-prob (timm's)
mixes a batch with that probability (torchvision's reference: always). The test set is clean.

Prints one line per epoch and a JSON line last. Runs on the CPU (Debian's python3-torch, with
--threads: `apt-get install python3-torch python3-torchvision`, a bench tool, not a build
dependency) or on a GPU (--device cuda).
"""
import argparse
import gzip
import json
import math
import struct
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--epochs", type=int, default=5)
p.add_argument("--batch-size", type=int, default=128)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--device", default="cpu")
p.add_argument("--max-steps", type=int, default=0, help="steps per epoch (0 = all)")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--cycle-momentum", action="store_true",
               help="OneCycleLR's momentum cycling (0.95 -> 0.85 -> 0.95); kiln holds it at 0.9")
p.add_argument("--init", choices=["torch", "kiln"], default="torch",
               help="kiln: conv weights kaiming_normal_(fan_out, relu) as kiln's init_weights (and "
                    "torchvision's ResNet); torch: PyTorch's defaults. fc and BN start alike")
p.add_argument("--label-smoothing", type=float, default=0.0)
p.add_argument("--mixup-alpha", type=float, default=0.0, help="0 = off (torchvision's reference: 0.2)")
p.add_argument("--cutmix-alpha", type=float, default=0.0, help="0 = off (torchvision's reference: 1.0)")
p.add_argument("--mixup-prob", type=float, default=1.0, help="share of mixed batches (timm's mixup_prob)")
p.add_argument("--mixup-switch-prob", type=float, default=0.5, help="cutmix's share with both on")
p.add_argument("--mix-impl", choices=["auto", "v2", "script"], default="auto",
               help="v2: torchvision.transforms.v2's MixUp/CutMix; script: the arithmetic below")
p.add_argument("--mix-selfcheck", action="store_true",
               help="compare the script's mix with v2's on random batches (same draws) and exit")
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)
dev = torch.device(args.device)


def idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, n = struct.unpack(">II", data[:8])
    if magic == 2051:
        rows, cols = struct.unpack(">II", data[8:16])
        return np.frombuffer(data, np.uint8, offset=16).reshape(n, 1, rows, cols)
    return np.frombuffer(data, np.uint8, offset=8).astype(np.int64)


d = args.data_dir
xtr = torch.tensor(idx(f"{d}/train-images-idx3-ubyte.gz"), dtype=torch.float32).div_(255).sub_(0.2860).div_(0.3530)
ytr = torch.tensor(idx(f"{d}/train-labels-idx1-ubyte.gz"))
xte = torch.tensor(idx(f"{d}/t10k-images-idx3-ubyte.gz"), dtype=torch.float32).div_(255).sub_(0.2860).div_(0.3530)
yte = torch.tensor(idx(f"{d}/t10k-labels-idx1-ubyte.gz"))
xtr, ytr, xte, yte = xtr.to(dev), ytr.to(dev), xte.to(dev), yte.to(dev)


def cbr(i, o):
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(i, o, 3, 1, 1, bias=False), bn=nn.BatchNorm2d(o), relu=nn.ReLU()))


net = nn.Sequential(OrderedDict(block1=cbr(1, 32), block2=cbr(32, 32), pool1=nn.MaxPool2d(2), block3=cbr(32, 64),
                                block4=cbr(64, 64), pool2=nn.MaxPool2d(2), flatten=nn.Flatten(),
                                fc=nn.Linear(64 * 7 * 7, 10))).to(dev)
if args.init == "kiln":
    # With BN after each conv the scale still matters: weight decay's pull and the step's
    # relative size depend on the weight norm (PyTorch's default is ~2.4x smaller here).
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
decay = [p_ for n, p_ in net.named_parameters() if n.endswith("weight") and ("conv" in n or n.startswith("fc"))]
rest = [p_ for n, p_ in net.named_parameters() if not (n.endswith("weight") and ("conv" in n or n.startswith("fc")))]
opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": rest, "weight_decay": 0}],
                      lr=args.lr, momentum=0.9, nesterov=True)
bs = args.batch_size
steps = len(xtr) // bs
if args.max_steps:
    steps = min(steps, args.max_steps)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps * args.epochs,
                                            cycle_momentum=args.cycle_momentum)
loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
CLASSES = 10


def v2_mixer():
    """torchvision's reference (references/classification/train.py): RandomChoice of the two."""
    from torchvision.transforms import v2
    ts, ps = [], []
    if args.cutmix_alpha > 0:
        ts.append(v2.CutMix(alpha=args.cutmix_alpha, num_classes=CLASSES))
        ps.append(args.mixup_switch_prob if args.mixup_alpha > 0 else 1.0)
    if args.mixup_alpha > 0:
        ts.append(v2.MixUp(alpha=args.mixup_alpha, num_classes=CLASSES))
        ps.append(1.0 - args.mixup_switch_prob if args.cutmix_alpha > 0 else 1.0)
    choice = v2.RandomChoice(ts, p=ps) if len(ts) > 1 else ts[0]

    def mix(x, y):
        if args.mixup_prob < 1.0 and not torch.rand(1).item() < args.mixup_prob:
            return x, y
        return choice(x, y)
    return mix


def script_mixer():
    """v2.MixUp / v2.CutMix's arithmetic (torchvision 0.16+) for a torchvision without them."""
    def beta(alpha):
        return float(torch.distributions.Beta(torch.tensor([alpha]), torch.tensor([alpha])).sample(()))

    def mix(x, y):
        if args.mixup_prob < 1.0 and not torch.rand(1).item() < args.mixup_prob:
            return x, y
        cut = args.cutmix_alpha > 0
        if cut and args.mixup_alpha > 0:  # v2.RandomChoice's draw, so that --mix-selfcheck can match
            p_ = torch.tensor([args.mixup_switch_prob, 1.0 - args.mixup_switch_prob])
            cut = int(torch.multinomial(p_ / p_.sum(), 1)) == 0
        target = nn.functional.one_hot(y, CLASSES).float()
        if cut:
            lam = beta(args.cutmix_alpha)
            H, W = x.shape[-2:]
            r_x, r_y = torch.randint(W, size=(1,)), torch.randint(H, size=(1,))
            r = 0.5 * math.sqrt(1.0 - lam)
            r_w_half, r_h_half = int(r * W), int(r * H)
            x1, y1 = int(torch.clamp(r_x - r_w_half, min=0)), int(torch.clamp(r_y - r_h_half, min=0))
            x2, y2 = int(torch.clamp(r_x + r_w_half, max=W)), int(torch.clamp(r_y + r_h_half, max=H))
            out = x.clone()
            out[..., y1:y2, x1:x2] = x.roll(1, 0)[..., y1:y2, x1:x2]
            lam = float(1.0 - (x2 - x1) * (y2 - y1) / (W * H))
        else:
            lam = beta(args.mixup_alpha)
            out = x.roll(1, 0).mul_(1.0 - lam).add_(x.mul(lam))
        return out, target.roll(1, 0).mul_(1.0 - lam).add_(target.mul(lam))
    return mix


if args.mix_selfcheck:
    # The written-out arithmetic against v2's on the same random draws: equal outputs say the
    # CPU table (torchvision 0.14, the script's path) ran torchvision's recipe.
    try:
        from torchvision.transforms import v2
        assert hasattr(v2, "MixUp")
    except (ImportError, AssertionError):
        print(json.dumps({"mix_selfcheck": "skipped: this torchvision has no transforms.v2.MixUp"}))
        raise SystemExit(0)
    worst, kinds = 0.0, set()
    v2_mix, script_mix = v2_mixer(), script_mixer()
    for trial in range(200):
        g = torch.Generator().manual_seed(trial)
        x = torch.randn(16, 1, 28, 28, generator=g).to(dev)
        y = torch.randint(CLASSES, (16,), generator=g).to(dev)
        torch.manual_seed(1000 + trial)
        xa, ya = v2_mix(x.clone(), y.clone())
        torch.manual_seed(1000 + trial)
        xb, yb = script_mix(x.clone(), y.clone())
        if ya.ndim == 1:  # an unmixed batch (--mixup-prob < 1)
            ya = nn.functional.one_hot(ya, CLASSES).float()
            yb = nn.functional.one_hot(yb, CLASSES).float() if yb.ndim == 1 else yb
        kinds.add("cutmix" if bool((xa == x).any()) and not torch.equal(xa, x) else
                  "none" if torch.equal(xa, x) else "mixup")
        worst = max(worst, (xa - xb).abs().max().item(), (ya - yb).abs().max().item())
    ok = worst == 0.0
    print(json.dumps({"mix_selfcheck": "PASS" if ok else "FAIL", "trials": 200, "max_abs_diff": worst,
                      "kinds_seen": sorted(kinds), "torchvision": __import__("torchvision").__version__}))
    raise SystemExit(0 if ok else 1)

mixer, mix_impl = None, "off"
if args.mixup_alpha > 0 or args.cutmix_alpha > 0:
    impl = args.mix_impl
    if impl == "auto":
        try:
            from torchvision.transforms import v2  # noqa: F401
            impl = "v2" if hasattr(v2, "MixUp") else "script"
        except ImportError:
            impl = "script"
    mixer, mix_impl = (v2_mixer() if impl == "v2" else script_mixer()), impl
epoch_times, acc, train_losses = [], 0.0, []
for epoch in range(args.epochs):
    net.train()
    perm = torch.randperm(len(xtr), device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        idx_ = perm[i * bs:(i + 1) * bs]
        x, y = xtr[idx_], ytr[idx_]
        flip = torch.rand(bs, device=dev) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        if mixer:
            x, y = mixer(x, y)
        loss = loss_fn(net(x), y)
        loss_sum = loss.detach() if i == 0 else loss_sum + loss.detach()  # no sync per step
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    epoch_times.append(time.perf_counter() - t0)
    net.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(xte), 1000):
            correct += (net(xte[i:i + 1000]).argmax(1) == yte[i:i + 1000]).sum().item()
    acc = 100.0 * correct / len(xte)
    train_losses.append(loss_sum.item() / steps)
    print(f"torch epoch {epoch + 1}: {epoch_times[-1]:.1f}s, {steps * bs / epoch_times[-1]:.0f} img/s, "
          f"train loss {train_losses[-1]:.4f}, test top-1 {acc:.2f}%",
          flush=True)
try:
    import torchvision
    tv_version = torchvision.__version__
except ImportError:
    tv_version = None
print(json.dumps({"bench": "torch", "device": args.device, "threads": args.threads, "torch": torch.__version__,
                  "torchvision": tv_version, "seed": args.seed, "epochs": args.epochs,
                  "label_smoothing": args.label_smoothing, "mixup_alpha": args.mixup_alpha,
                  "cutmix_alpha": args.cutmix_alpha, "mixup_prob": args.mixup_prob,
                  "mixup_switch_prob": args.mixup_switch_prob, "mix_impl": mix_impl,
                  "cycle_momentum": args.cycle_momentum, "init": args.init, "train_loss": train_losses,
                  "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32, "epoch_seconds": epoch_times, "images_per_second": steps * bs * len(epoch_times) / sum(epoch_times),
                  "test_top1": acc}))
