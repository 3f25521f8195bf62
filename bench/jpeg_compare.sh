#!/usr/bin/env bash
# Training from a JPEG folder (issue 16), kiln beside PyTorch in one run on one GPU machine:
# makes an ImageNet-like folder from a fixed seed (bench/make_jpeg_folder.py), then for each
# model at batch 256 in AMP:
#   synthetic     kiln bench (no input pipeline): the speed the folder runs are held to
#   input-*       kiln bench --input-only: files to the staged input buffer, no step, per path
#   folder-*      kiln bench --data folder: training steps fed from the folder, per path, timed
#                 over many steps with no epoch boundary (the train-* rows' epochs are short)
#   train-*       kiln train on the folder, per decode path (last epoch's images/s)
#   eval-*        kiln eval of the val split (Resize + CenterCrop) per decode path, with the
#                 weights an earlier train-* row of the model saved
#   torch         bench/torch_jpeg.py: ImageFolder + DataLoader, same transforms and model
# Each row gives the host cores busy during it (from /proc/stat). Prints a markdown table.
#
#   bench/jpeg_compare.sh [MODELS] [ROWS]
#   MODELS entries may name their own rows: "resnet50=synthetic,train-gpu vgg16_bn=synthetic"
#   ROWS: any of synthetic input-gpu input-cpu input-float folder-gpu folder-cpu train-gpu
#         train-cpu train-float eval-gpu eval-cpu
#         torch torch-eval; *-float is the host's float path (--no-input-u8), the one kiln
#         had before issue 16; train-base runs kiln train with no --decode (older builds);
#         input-cpu-plain is the host's uint8 path with the fixed-point resample and the
#         progressive early stop off (KILN_RESAMPLE_FIXED_POINT=0 KILN_JPEG_PROGRESSIVE_STOP=0);
#         a row may repeat (alternating rounds), each run adds its line to the table
# Environment: BUILD (default build-gpu), JPEG_ROOT (default /tmp/kiln-jpegs; made if missing),
# WORKERS (default the cores), EPOCHS (default 3: the first warms up), LOGS, BENCH_EXTRA (flags
# added to the folder-* and input-* rows' kiln bench, e.g. "--auto-augment ra --random-erase 0.25").
set -uo pipefail
cd "$(dirname "$0")/.."
MODELS=${1:-"resnet50 vgg16_bn"}
ROWS=${2:-"synthetic input-gpu input-cpu input-float train-gpu train-cpu torch"}
BUILD=${BUILD:-build-gpu}
ROOT=${JPEG_ROOT:-/tmp/kiln-jpegs}
WORKERS=${WORKERS:-$(nproc)}
EPOCHS=${EPOCHS:-3}
log=${LOGS:-$(mktemp -d)}
mkdir -p "$log"

for _ in $(seq 300); do [ -d "$ROOT.partial" ] || break; sleep 1; done  # another writer, still at it
[ -d "$ROOT/train" ] || python3 bench/make_jpeg_folder.py "$ROOT" --jobs "$(nproc)" | tee "$log/folder.json"

busy() { awk '/^cpu /{b=$2+$3+$4+$7+$8+$9; print b, b+$5+$6}' /proc/stat; }
cores_between() {  # "busy total" before and after -> cores busy
  python3 -c "import sys,os; a=list(map(int,sys.argv[1].split())); b=list(map(int,sys.argv[2].split())); print(round(os.cpu_count()*(b[0]-a[0])/max(b[1]-a[1],1),1))" "$1" "$2"
}
bench_cores() {  # the bench's own figure (its process, timed repeats only), else the row's
  local c
  c=$(grep -o '"host_cores_busy":[0-9.]*' "$1" | tail -1 | cut -d: -f2)
  [ -n "$c" ] && echo "$c (timed repeats)" || cores_between "$2" "$(busy)"
}
last_epoch_rate() {  # images/s of the last epoch in a run's metrics.csv
  python3 - "$1" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print(rows[-1]["images_per_second"] if rows else "nan")
PY
}

decode_flags() {
  case $1 in
    float) echo "--decode cpu --no-input-u8" ;;
    cpu-plain) echo "--decode cpu" ;;
    base) echo "" ;;
    *) echo "--decode $1" ;;
  esac
}

table=()
row() { table+=("| $1 | $2 | $3 | $4 | $5 |"); echo "== $1 $2: $3 img/s, $4 cores busy ($5)"; }

for entry in $MODELS; do
  m=${entry%%=*}
  rows=$ROWS
  [ "$entry" != "$m" ] && rows=${entry#*=} && rows=${rows//,/ }
  for r in $rows; do
    out="$log/${m}_${r}.txt"
    b0=$(busy)
    case $r in
      synthetic)
        "$BUILD"/kiln bench --model "$m" --batch 256 --amp --steps 30 --warmup 5 --repeats 3 >"$out" 2>&1
        v=$(grep '^{"bench":"kiln"' "$out" | tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{}').get('images_per_second','nan'))")
        row "$m" "$r" "$v" "$(cores_between "$b0" "$(busy)")" "kiln bench" ;;
      folder-*)
        "$BUILD"/kiln bench --model "$m" --batch 256 --amp --data folder --data-dir "$ROOT" \
          $(decode_flags "${r#folder-}") ${BENCH_EXTRA:-} --workers "$WORKERS" --steps 60 --warmup 10 --repeats 3 >"$out" 2>&1
        v=$(grep '^{"bench":"kiln-folder"' "$out" | tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{}').get('images_per_second','nan'))")
        row "$m" "$r" "$v" "$(bench_cores "$out" "$b0")" "kiln bench --data folder: steps fed from the files" ;;
      input-*)
        plain=""
        [ "$r" = input-cpu-plain ] && plain="KILN_RESAMPLE_FIXED_POINT=0 KILN_JPEG_PROGRESSIVE_STOP=0"
        env $plain "$BUILD"/kiln bench --input-only --model "$m" --batch 256 --amp --data folder --data-dir "$ROOT" \
          $(decode_flags "${r#input-}") ${BENCH_EXTRA:-} --workers "$WORKERS" --steps 40 >"$out" 2>&1
        v=$(grep '^{"bench":"kiln-input"' "$out" | tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{}').get('images_per_second','nan'))")
        row "$m" "$r" "$v" "$(bench_cores "$out" "$b0")" "files to the staged input buffer, no step" ;;
      eval-*)
        ckpt=$(ls "$log"/run_"${m}"_train-*/last.safetensors 2>/dev/null | head -1)
        v=nan
        if [ -n "$ckpt" ]; then
          "$BUILD"/kiln eval --model "$m" --amp --batch-size 256 --data folder --data-dir "$ROOT" \
            $(decode_flags "${r#*-}") --workers "$WORKERS" --weights "$ckpt" >"$out" 2>&1
          v=$(grep -o '([0-9.]* images/s)' "$out" | tail -1 | tr -d '(' | cut -d' ' -f1)
        else
          echo "no train-* row of $m ran before $r: nothing to evaluate" >"$out"
        fi
        row "$m" "$r" "${v:-nan}" "$(cores_between "$b0" "$(busy)")" "kiln eval of the val split, Resize(256) + CenterCrop(224)" ;;
      train-*)
        dir="$log/run_${m}_${r}"
        rm -rf "$dir"
        "$BUILD"/kiln train --model "$m" --amp --batch-size 256 --data folder --data-dir "$ROOT" --random-resized-crop \
          $(decode_flags "${r#*-}") --workers "$WORKERS" --epochs "$EPOCHS" --eval-every 1000 --progress plain \
          --output "$dir" >"$out" 2>&1
        v=nan; [ -f "$dir/metrics.csv" ] && v=$(last_epoch_rate "$dir/metrics.csv")
        row "$m" "$r" "$v" "$(cores_between "$b0" "$(busy)")" "kiln train, last of $EPOCHS epochs; $(grep -E 'input-bound|compute-bound' "$out" | tail -1)" ;;
      torch|torch-eval)
        extra=""; [ "$r" = torch-eval ] && extra="--eval"
        python3 bench/torch_jpeg.py "$ROOT" --model "$m" --batch 256 --amp --epochs "$EPOCHS" --workers "$WORKERS" $extra >"$out" 2>&1
        v=$(grep '"phase": "train"' "$out" | tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{}').get('images_per_second','nan'))")
        c=$(grep '"phase": "train"' "$out" | tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{}').get('host_cores_busy','nan'))")
        row "$m" "$r" "$v" "$c" "torchvision ImageFolder + DataLoader($WORKERS workers), last of $EPOCHS epochs"
        if [ "$r" = torch-eval ]; then
          v=$(grep '"phase": "eval"' "$out" | tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read() or '{}').get('images_per_second','nan'))")
          row "$m" "torch eval" "$v" "-" "Resize(256) CenterCrop(224), second pass"
        fi ;;
      *) echo "unknown row $r"; exit 2 ;;
    esac
    [ -s "$out" ] && grep -iE "error|fail" "$out" | head -3
    grep -h "host ms per batch" "$out" 2>/dev/null
  done
done
echo
echo "| model | row | images/s | host cores busy | what |"
echo "|---|---|---|---|---|"
printf '%s\n' "${table[@]}"
echo "logs: $log"
