#!/usr/bin/env bash
# Issue 18's fidelity check: Fashion-MNIST, the default job (configs/fashion_mnist.yaml: the
# small CNN, batch 128, SGD Nesterov, one-cycle to 0.1, flips) for 10 epochs with label
# smoothing 0.1 and mixup 0.2 / cutmix 1.0 (switch probability 0.5), in kiln and in PyTorch
# (bench/fmnist_torch.py: the same network and recipe; torchvision.transforms.v2's MixUp and
# CutMix where installed, the same arithmetic written out where not), for each seed; then one
# table of the final test top-1 per seed and the means. Passes when the means are within
# --tolerance points (issue 18: 0.3).
#
#   bench/fidelity_compare.sh [--device cpu|cuda] [--data-dir DIR] [--seeds "0 1 2"]
#       [--epochs 10] [--out DIR] [--sides kiln,torch] [--threads N] [--tolerance 0.3]
#       [--table-only]
#   BUILD (default build) holds kiln; PYTHON picks the interpreter with torch (on the CPU:
#   /usr/bin/python3 where it has Debian's python3-torch: `apt-get install python3-torch
#   python3-torchvision`, a bench tool only, not in scripts/setup.sh).
#   KILN_FLAGS / TORCH_FLAGS add flags to one side (e.g. TORCH_FLAGS=--mix-impl=script).
# Each run's log and result stay in --out (default /tmp/kiln-fidelity-DEVICE); a run whose
# result is there is not run again, so the sides can run apart (--sides) and a stopped
# table resumes. On the CPU (2 cores) one run of 10 epochs takes ~10 minutes a side; on an
# H200 kiln's takes seconds and PyTorch's ~20-30 s.
# Exit status: 0 within tolerance, 1 a run failed, 2 the means differ by more.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cpu
DATA_DIR=
SEEDS="0 1 2"
EPOCHS=10
OUTDIR=
SIDES=kiln,torch
THREADS=$(nproc)
TOLERANCE=0.3
TABLE_ONLY=0
# Besides the recipe, PyTorch's side starts its conv weights as kiln does (--init kiln) and
# holds the momentum at 0.9 (fmnist_torch.py's default, as kiln's onecycle): the runs differ in
# the framework, not in the model. The recipe: torchvision's reference values for mixup and cutmix, issue 18's smoothing.
LABEL_SMOOTHING=0.1
MIXUP_ALPHA=0.2
CUTMIX_ALPHA=1.0
MIXUP_PROB=1.0
SWITCH_PROB=0.5
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --data-dir) DATA_DIR=$2; shift 2 ;;
    --seeds) SEEDS=$2; shift 2 ;;
    --epochs) EPOCHS=$2; shift 2 ;;
    --out) OUTDIR=$2; shift 2 ;;
    --sides) SIDES=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --tolerance) TOLERANCE=$2; shift 2 ;;
    --table-only) TABLE_ONLY=1; shift ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "fidelity_compare.sh: unknown argument '$1' (see --help)" >&2; exit 1 ;;
  esac
done
case "$DEVICE" in cpu | cuda) ;; *) echo "--device must be cpu or cuda, got '$DEVICE'" >&2; exit 1 ;; esac
OUTDIR=${OUTDIR:-/tmp/kiln-fidelity-$DEVICE}
BUILD=${BUILD:-build}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ "$DEVICE" = cpu ] && /usr/bin/python3 -c 'import torch' 2>/dev/null && PYTHON=/usr/bin/python3
fi
data=()
if [ -n "$DATA_DIR" ]; then
  for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
    [ -f "$DATA_DIR/$f" ] || { echo "--data-dir $DATA_DIR has no $f (Fashion-MNIST's four .gz files)" >&2; exit 1; }
  done
  data=(--data-dir "$DATA_DIR")
fi
mkdir -p "$OUTDIR"
recipe=(--label-smoothing "$LABEL_SMOOTHING" --mixup-alpha "$MIXUP_ALPHA" --cutmix-alpha "$CUTMIX_ALPHA"
  --mixup-prob "$MIXUP_PROB" --mixup-switch-prob "$SWITCH_PROB")
failed=0

run_kiln() {  # seed
  local dir="$OUTDIR/kiln-s$1"
  [ -f "$dir/summary.json" ] && return 0
  rm -rf "$dir"  # a stopped run's folder would be resumed, not restarted
  echo "== kiln seed $1 ($DEVICE, $EPOCHS epochs) $(date -u +%H:%M:%S)"
  # shellcheck disable=SC2086
  if ! "$BUILD"/kiln train --config configs/fashion_mnist.yaml --epochs "$EPOCHS" --device "$DEVICE" \
    --seed "$1" "${recipe[@]}" "${data[@]}" --output "$dir" --progress plain ${KILN_FLAGS:-} \
    >"$OUTDIR/kiln-s$1.log" 2>&1; then
    tail -5 "$OUTDIR/kiln-s$1.log"
    failed=1
  fi
}

run_torch() {  # seed
  local log="$OUTDIR/torch-s$1.log"
  grep -q '"test_top1"' "$log" 2>/dev/null && return 0
  echo "== PyTorch seed $1 ($DEVICE, $EPOCHS epochs) $(date -u +%H:%M:%S)"
  # shellcheck disable=SC2086
  if ! "$PYTHON" bench/fmnist_torch.py --epochs "$EPOCHS" --device "$DEVICE" --threads "$THREADS" \
    --seed "$1" --init kiln "${recipe[@]}" "${data[@]}" ${TORCH_FLAGS:-} >"$log.part" 2>&1; then
    tail -5 "$log.part"
    failed=1
    return 0
  fi
  mv "$log.part" "$log"
}

if [ "$TABLE_ONLY" = 0 ]; then
  # Where torchvision has transforms.v2 (the GPU machine), fmnist_torch.py's written-out mix
  # (the CPU table's path on Debian's torchvision 0.14) against v2's on the same draws.
  case ",$SIDES," in *,torch,*)
    [ -f "$OUTDIR/mix-selfcheck.json" ] ||
      "$PYTHON" bench/fmnist_torch.py --mix-selfcheck --device "$DEVICE" "${recipe[@]}" "${data[@]}" 2>&1 |
        tail -1 >"$OUTDIR/mix-selfcheck.json" || true ;;
  esac
  for s in $SEEDS; do
    case ",$SIDES," in *,kiln,*) run_kiln "$s" ;; esac
    case ",$SIDES," in *,torch,*) run_torch "$s" ;; esac
  done
fi

set +e
"$PYTHON" - "$OUTDIR" "$TOLERANCE" "$SEEDS" <<'PY'
import json, os, statistics, sys
out, tol, seeds = sys.argv[1], float(sys.argv[2]), sys.argv[3].split()
rows, meta = [], {}
losses = {}  # the last epoch's training loss (the mixed, smoothed targets'), a diagnostic
for s in seeds:
    k = t = None
    try:
        k = json.load(open(f"{out}/kiln-s{s}/summary.json"))["final_top1"]
        with open(f"{out}/kiln-s{s}/metrics.jsonl") as f:
            losses[("kiln", s)] = [json.loads(l) for l in f if l.strip()][-1]["train_loss"]
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        tj = json.loads(open(f"{out}/torch-s{s}.log").read().strip().splitlines()[-1])
        t, meta = tj["test_top1"], tj
        losses[("torch", s)] = tj["train_loss"][-1]
    except (OSError, KeyError, ValueError, IndexError):
        pass
    rows.append((s, k, t))
fmt = lambda v: "—" if v is None else f"{v:.2f}%"
diff = lambda a, b: "—" if a is None or b is None else f"{a - b:+.2f}"
fl = lambda side, s: f"{losses[(side, s)]:.4f}" if (side, s) in losses else "—"
print(f"\n| seed | kiln | PyTorch | kiln − PyTorch | train loss kiln / PyTorch |\n|---|---|---|---|---|")
for s, k, t in rows:
    print(f"| {s} | {fmt(k)} | {fmt(t)} | {diff(k, t)} | {fl('kiln', s)} / {fl('torch', s)} |")
ks = [k for _, k, _ in rows if k is not None]
ts = [t for _, _, t in rows if t is not None]
# The means over the seeds both sides finished: a partial table still compares like with like.
pairs = [(k, t) for _, k, t in rows if k is not None and t is not None]
km = statistics.mean(k for k, _ in pairs) if pairs else None
tm = statistics.mean(t for _, t in pairs) if pairs else None
sd = lambda v: f" (sd {statistics.stdev(v):.2f})" if len(v) > 1 else ""
print(f"| mean of {len(pairs)} seed{'s' if len(pairs) != 1 else ''} | {fmt(km)}{sd([k for k, _ in pairs])} | "
      f"{fmt(tm)}{sd([t for _, t in pairs])} | {diff(km, tm)} | |")
print(f"PyTorch {meta.get('torch', '?')}, torchvision {meta.get('torchvision', '?')} "
      f"(mixup/cutmix: {meta.get('mix_impl', '?')}); device {meta.get('device', '?')}")
if os.path.exists(f"{out}/mix-selfcheck.json"):
    print("mix self-check (script vs torchvision v2, same draws):", open(f"{out}/mix-selfcheck.json").read().strip())
complete = len(ks) == len(ts) == len(seeds)
if not complete:
    print(f"fidelity: INCOMPLETE ({len(ks)} kiln and {len(ts)} PyTorch runs of {len(seeds)})")
    sys.exit(1)
ok = abs(km - tm) <= tol
print(f"fidelity: {'PASS' if ok else 'FAIL'} (|kiln − PyTorch| = {abs(km - tm):.2f} points, tolerance {tol})")
sys.exit(0 if ok else 2)
PY
verdict=$?
[ "$failed" = 1 ] && exit 1
exit $verdict
