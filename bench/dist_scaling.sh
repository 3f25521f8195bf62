#!/usr/bin/env bash
# Data-parallel scaling on one machine (SPEC S27, issue 6): kiln bench under mpirun and PyTorch
# DDP (bench/torch_ddp.py, SyncBN as kiln's default) on 1, 2, 4, 8 GPUs — as many as there are —
# in one run, --batch per GPU; prints a markdown table for bench/RESULTS.md with the scaling
# efficiency rate(N) / (N * rate(1)). Usage:
#   bench/dist_scaling.sh [MODEL] [BATCH_PER_GPU] [amp|fp32]
#   BUILD=build-gpu bench/dist_scaling.sh resnet50 256 amp
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-resnet50}
BATCH=${2:-256}
PREC=${3:-amp}
BUILD=${BUILD:-build-gpu}
STEPS=${STEPS:-30}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # no NVLink multicast on shared machines
gpus=$(nvidia-smi -L | wc -l)
flag=""; [ "$PREC" = amp ] && flag="--amp"
mpirun_=(mpirun --allow-run-as-root --oversubscribe -x NCCL_NVLS_ENABLE -x NCCL_DEBUG)
log=$(mktemp -d)
rows=()
for n in 1 2 4 8; do
  [ "$n" -gt "$gpus" ] && break
  "${mpirun_[@]}" -np "$n" "$BUILD"/kiln bench --model "$MODEL" --batch "$BATCH" $flag --steps "$STEPS" \
    --warmup 5 --repeats 3 >"$log/kiln_$n.txt" 2>&1
  k=$(grep '^{"bench":"kiln"' "$log/kiln_$n.txt" | tail -1)
  [ -z "$k" ] && { echo "kiln bench on $n GPUs failed:"; tail -20 "$log/kiln_$n.txt"; }
  torchrun --standalone --nproc_per_node "$n" bench/torch_ddp.py --model "$MODEL" --batch "$BATCH" $flag \
    --sync-bn --steps "$STEPS" >"$log/torch_$n.txt" 2>&1
  t=$(grep '^{"bench": "torch-ddp"' "$log/torch_$n.txt" | tail -1)
  [ -z "$t" ] && { echo "torch DDP on $n GPUs failed:"; tail -20 "$log/torch_$n.txt"; }
  rows+=("$n|$k|$t")
done
python3 - "$MODEL" "$BATCH" "$PREC" "${rows[@]}" <<'PY'
import json, sys
model, batch, prec = sys.argv[1:4]
print(f"{model}, batch {batch} per GPU, {prec}, synthetic data, SyncBN in both")
print("| GPUs | kiln img/s | kiln efficiency | PyTorch DDP img/s | DDP efficiency | kiln / DDP |")
print("|---|---|---|---|---|---|")
base = {}
for row in sys.argv[4:]:
    n, k, t = row.split("|", 2)
    n = int(n)
    kv = json.loads(k)["images_per_second"] if k else float("nan")
    tv = json.loads(t)["images_per_second"] if t else float("nan")
    base.setdefault("k", kv); base.setdefault("t", tv)
    print(f"| {n} | {kv:.0f} | {kv / (n * base['k']):.2f} | {tv:.0f} | {tv / (n * base['t']):.2f} | {kv / tv:.2f} |")
PY
echo "logs: $log"
