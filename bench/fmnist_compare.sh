#!/usr/bin/env bash
# Fashion-MNIST side by side (issue 3): kiln's default job and PyTorch's same network and
# recipe, in one run on the same machine, then a table. Not a test: timings are noisy; compare
# the ratio from one run. Usage: bench/fmnist_compare.sh [EPOCHS] [DEVICE]
#   CPU: PyTorch is Debian's python3-torch (1.13) with 2 threads, kiln on the same 2 cores.
#   GPU: bench/fmnist_compare.sh 5 cuda  (PyTorch 2.11 on the GPU machine)
#   KILN_FLAGS="--tf32" bench/fmnist_compare.sh 5 cuda  (kiln with PyTorch's default conv numerics)
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${1:-5}
DEVICE=${2:-cpu}
BUILD=${BUILD:-build}
PY=${PYTHON:-python3}
[ "$DEVICE" = cpu ] && [ -x /usr/bin/python3 ] && PY=/usr/bin/python3
out=$(mktemp -d)
echo "== kiln ($DEVICE) =="
# KILN_FLAGS adds kiln train flags, e.g. "--tf32": PyTorch's convolutions take TF32 on a GPU by
# default (torch.backends.cudnn.allow_tf32, reported in its JSON line), kiln's only with --tf32.
# shellcheck disable=SC2086
"$BUILD"/kiln train --config configs/fashion_mnist.yaml --epochs "$EPOCHS" --device "$DEVICE" \
  --output "$out/kiln" --progress plain ${KILN_FLAGS:-} | tee "$out/kiln.log"
echo "== PyTorch ($DEVICE) =="
"$PY" bench/fmnist_torch.py --epochs "$EPOCHS" --device "$DEVICE" --threads "$(nproc)" | tee "$out/torch.log"
"$PY" - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
k = json.load(open(f"{out}/kiln/summary.json"))
t = json.loads(open(f"{out}/torch.log").read().strip().splitlines()[-1])
ke = k["train_seconds"] / k["epochs"]
te = sum(t["epoch_seconds"]) / len(t["epoch_seconds"])
print(f"\n| | s/epoch | images/s | test top-1 |\n|---|---|---|---|")
print(f"| kiln | {ke:.1f} | {k['images_per_second']:.0f} | {k['final_top1']:.2f}% |")
print(f"| PyTorch {t['torch']} | {te:.1f} | {t['images_per_second']:.0f} | {t['test_top1']:.2f}% |")
print(f"kiln/PyTorch speed: {t['images_per_second'] and k['images_per_second'] / t['images_per_second']:.2f}x")
print(f"kiln flags: {os.environ.get('KILN_FLAGS') or '(defaults)'}; PyTorch cudnn.allow_tf32: {t.get('cudnn_allow_tf32')}")
PY
