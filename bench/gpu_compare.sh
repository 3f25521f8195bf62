#!/usr/bin/env bash
# Side-by-side throughput on one GPU (SPEC Q3): kiln bench and PyTorch (eager and
# torch.compile, bench/torch_reference.py) on the same models, batch and precision, in one
# run; prints a markdown table for bench/RESULTS.md. Usage:
#   bench/gpu_compare.sh [MODELS] [BATCH] [PRECISIONS] [TORCH_MODES]
#   bench/gpu_compare.sh "resnet50 vgg16_bn" 256 "amp fp32" "eager,compile"
# STAGE=once has kiln train on one batch resident on the device, as the PyTorch reference does
# (default every-step: kiln copies the batch from the host each step, as a loader would).
set -uo pipefail
cd "$(dirname "$0")/.."
MODELS=${1:-"resnet50 vgg16_bn"}
BATCH=${2:-256}
PRECISIONS=${3:-"amp"}
TORCH_MODES=${4:-"eager,compile"}
BUILD=${BUILD:-build-gpu}
STEPS=${STEPS:-30}
STAGE=${STAGE:-every-step}
log=${COMPARE_LOGS:-$(mktemp -d)}
mkdir -p "$log"
rows=()
for m in $MODELS; do
  for prec in $PRECISIONS; do
    flag=""; [ "$prec" = amp ] && flag="--amp"
    "$BUILD"/kiln bench --model "$m" --batch "$BATCH" $flag --steps "$STEPS" --warmup 5 --repeats 3 --stage "$STAGE" \
      >"$log/kiln_${m}_${prec}.txt" 2>&1
    k=$(grep '^{"bench":"kiln"' "$log/kiln_${m}_${prec}.txt" | tail -1)
    [ -z "$k" ] && { echo "kiln bench $m $prec failed:"; tail -5 "$log/kiln_${m}_${prec}.txt"; }
    python3 bench/torch_reference.py --model "$m" --batch "$BATCH" $flag --modes "$TORCH_MODES" \
      --steps "$STEPS" >"$log/torch_${m}_${prec}.txt" 2>&1
    cat "$log/torch_${m}_${prec}.txt" | grep -E "images_per_second|Error" | tail -3
    rows+=("$m|$prec|$k|$(grep -E '^\{"bench": ?"torch"' "$log/torch_${m}_${prec}.txt" | tr '\n' '#')")
  done
done
python3 - "${rows[@]}" <<'PY'
import json, sys
print("| model | precision | kiln img/s | PyTorch eager | torch.compile | kiln / eager | kiln / compile |")
print("|---|---|---|---|---|---|---|")
for row in sys.argv[1:]:
    m, prec, k, t = row.split("|", 3)
    kv = json.loads(k)["images_per_second"] if k else float("nan")
    tv = {}
    for line in filter(None, t.split("#")):
        j = json.loads(line)
        tv[j["mode"]] = j["images_per_second"]
    e, c = tv.get("eager", float("nan")), tv.get("compile", float("nan"))
    print(f"| {m} | {prec} | {kv:.0f} | {e:.0f} | {c:.0f} | {kv / e:.2f} | {kv / c:.2f} |")
PY
echo "logs: $log"
