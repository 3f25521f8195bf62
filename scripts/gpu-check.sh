#!/usr/bin/env bash
# Builds kiln with the CUDA backend and runs its checks on a GPU machine (the H200 that the
# device tool lends: the working tree is copied there with `.deps` carried, see
# scripts/setup.sh). Prints a short table last.
#
#   bash scripts/gpu-check.sh [gpu|all|bench]     (default: all)
#     gpu    configure, build, ctest -L gpu (GPU_TESTS_REGEX: only the tests it matches;
#            GPU_TESTS_EXCLUDE: not those it matches; GPU_TESTS_SHARD=i/n: every n-th test from
#            the i-th, so that the suite, ~10 minutes on an H100, fits in n calls)
#     all    gpu, then the CPU tests (ctest -LE gpu)
#     bench  gpu, then `kiln bench` over a few models (KILN_BENCH, BENCH_TORCH=1 adds PyTorch)
#     tune   build, then `kiln tune` (the engine table, SPEC S16) for KILN_TUNE_LIST
#            ("model:batch:amp ...", default ResNet-50 and VGG16-BN at 256 in AMP) into
#            configs/engines/<gpu>_cudnn<version>.tsv (a copy lands in the logs), then
#            `kiln bench` of each with the table and with KILN_ENGINE_TABLE=0
#     compare  gpu, then for COMPARE_MODELS (default "resnet50 vgg16_bn") at batch 256 in
#            COMPARE_PRECISIONS (default amp): kiln under each of COMPARE_BASELINES (environment
#            settings separated by ";", default KILN_FUSION=0; issue 20's table wants
#            KILN_CUTLASS=0, its "today's form"), then
#            bench/gpu_compare.sh (kiln with its defaults, PyTorch eager and torch.compile)
#            in the same call: the table bench/RESULTS.md wants (SPEC Q3, issue 5);
#            COMPARE_TESTS=0 builds kiln and its CLI alone and runs no GPU tests, so that the
#            table fits one call of a freshly started machine (~130 s build, ~300 s table)
#     ab     build, then `kiln bench` (batch 256, AMP) of AB_MODELS (default "resnet50 vgg16_bn")
#            under each of AB_VARIANTS, environment settings separated by ";" (default: the
#            defaults, then KILN_PAD_CHANNELS=0, KILN_PAD_CHANNELS=1, KILN_FUSE_GRAD_SUM=0 and
#            KILN_CBR_FORM=genstats), in one call: an optimisation's gain measured against its
#            absence, no tests run (STAGE=once: kiln bench --stage once; AB_ROUNDS=n: the
#            variants n times over, alternating, since a machine drifts by ~0.5% within a call)
#     forms  build, then tools/conv_forms.cpp's probe at batch 256: cuDNN's fused convolution
#            graphs (genstats, the MLPerf-style prologue, dgrad+drelu+dbn_weight) timed beside
#            the plain ones for ResNet-50's layers (issue 5; FORMS_ENGINES engines each, default 3)
#     cutlass  build (CUTLASS's headers staged in .deps/cutlass by scripts/setup.sh), then
#            tools/cutlass_probe: ResNet-50's 1x1 stride-1 convolutions at batch 256 as SM90
#            CUTLASS GEMMs whose epilogue also writes BatchNorm's per-channel sums, timed and
#            checked against cuDNN's fprop + kiln's statistics pass (issue 20; CUTLASS_REPS runs
#            each, default 20), and the probe's SASS per variant (HGMMA count, registers,
#            stack, shared memory, local loads and stores)
#     cutlass-step  build (with the SM90 CUTLASS kernels: KILN_CUTLASS_KERNELS=ON), the GPU
#            tests of the CUTLASS CBR path (GpuCutlass*; CUTLASS_TESTS=0 skips them), then
#            `kiln bench` of ResNet-50 (CUTLASS_MODEL) AMP at batch 256 with KILN_CUTLASS=0 and =1
#            alternating (CUTLASS_DGRAD_AB=1: three forms, KILN_CUTLASS=0, =1 with
#            KILN_CUTLASS_DGRAD=0, and both =1),
#            CUTLASS_CONV_AB=1: KILN_CUTLASS=0, =1, and =1 with KILN_CUTLASS_CONV=1;
#            CUTLASS_CONV_DGRAD_AB=1 likewise with KILN_CUTLASS_CONV_DGRAD=1, and both set
#            five forms (neither, each, both); CUTLASS_TIMED_AB=1: cuDNN, the fixed
#            defaults (KILN_CUTLASS_TIMED=0) and each layer timed (the default); CUTLASS_MODEL
#            may name several models, e.g. "resnet50 vgg16_bn"),
#            CUTLASS_ROUNDS rounds (default 2), each row's img/s and how many layers took the
#            CUTLASS GEMM (CBR forwards; convolutions before BN+add+ReLU; data gradients)
#            (issue 20 stage 2)
#     cutlass-dgrad  build (KILN_CUTLASS_KERNELS=ON and the probe), the CUTLASS GPU tests
#            (DGRAD_TESTS_REGEX, default GpuCutlass: the data gradient with BatchNorm-backward's
#            sums in its epilogue, GpuCutlassDgradBn.*, and the forward's, whose units share code),
#            `kiln_cutlass_probe --dgrad`: ResNet-50's 1x1 and 3x3 and VGG16-BN's 3x3 data
#            gradients that feed BatchNorm at batch 256, cuDNN's dgrad + kiln's sums pass against the SM90 kernel (CUTLASS_REPS
#            runs each), and the units' registers, stack and LDL/STL (issue 20 stage 2, backward);
#            DGRAD_PROBE_SHAPE=TEXT times only the probe's shapes named TEXT (e.g. vgg);
#            DGRAD_NCU=TEXT adds ncu over the kernels of the probe's shapes named TEXT;
#            CONV_PROBE=1 adds `kiln_cutlass_probe --conv` (3x3 convolutions with the statistics),
#            CONV_NCU=TEXT ncu over its kernels for the shapes named TEXT; PROLOGUE_PROBE=1
#            `kiln_cutlass_probe --prologue` (BatchNorm + ReLU on the 1x1 GEMM's operand load
#            against kiln's apply pass), DGRAD_PROBE=0 leaves the data gradient's probe out,
#            DGRAD_TESTS=0 builds the probe alone and runs no tests
#     first-layer  build (the SM90 kernels too), the first layer's GPU tests (FirstLayer: its
#            direct convolution, weight gradient and BatchNorm fold against float64 and against
#            each other, and whole steps with each form), `kiln_cutlass_probe --first-layer`
#            (each kernel against cuDNN's at batch 256), the step's timed choices (KILN_LOG=debug
#            lines), then `kiln bench` (AMP, batch 256) of FIRST_MODELS (default "vgg16_bn
#            resnet50") under each of FIRST_VARIANTS (";"-separated environment settings,
#            default: KILN_FIRST_LAYER_WGRAD=0, KILN_FIRST_LAYER_BN_FOLD=0, the defaults),
#            FIRST_ROUNDS rounds (default 2) (issue 20)
#     fold-dgrad  build (the SM90 kernels too), FOLD_TESTS_REGEX's GPU tests (default: GpuFoldDgrad,
#            the first layer's and the two that want the same bits twice), the fold kernel's
#            registers and spills, then `kiln_cutlass_probe --fold-dgrad` (BatchNorm's dx pass
#            folded into ResNet-50's 1x1 data gradients against the dx pass then the SM90 data
#            gradient, batch 256, FOLD_REPS runs each, default 9) (issue 20)
#     kernels  build, then Nsight Compute over two timed AMP steps at batch 256 of each of
#            PROFILE_MODELS (default "resnet50 vgg16_bn") and bench/kernel_breakdown.py's table
#            of GPU time per step by kernel kind (issue 5's breakdown; no tests run)
#     jpeg   build, then (JPEG_TESTS=1: the GPU tests first; =after: last; JPEG_TESTS_REGEX
#            picks them) bench/jpeg_compare.sh for
#            JPEG_MODELS (default "resnet50 vgg16_bn") and JPEG_ROWS (its default rows): training
#            from a generated ImageNet-like JPEG folder, kiln per decode path beside
#            torchvision's DataLoader, with the host cores busy in each row (issue 16)
#     python build the Python module (KILN_PYTHON=ON; nanobind from the wheels in KILN_PY_WHEELS,
#            a folder, where the machine has none), run python/tests with pytest (PY_PYTEST_ARGS
#            added; PY_DEBUG=1 first runs PY_DEBUG_TESTS under cuda-gdb for a native backtrace),
#            then bench/python_overhead.py: engine.train_step from Python against `kiln bench`
#            (cnn, batch 128, on the GPU; issue 19's overhead figure)
#     timeline  build, then for PROFILE_MODELS: tools/cupti_trace.cpp's trace of 5 timed AMP
#            steps at batch 256, kiln's and PyTorch eager's (TIMELINE_TORCH=0: kiln's only), and
#            bench/gpu_timeline.py's busy / idle split and kernel time by kind (what ncu's
#            kernel sums miss: gaps, copies, kernels slower in the real run than in ncu's
#            replay), then kiln's bench with nvidia-smi sampling SM clock and power every 100 ms
#     fidelity  build kiln and kiln_cli, then bench/fidelity_compare.sh on the GPU: issue 18's
#            Fashion-MNIST recipe (label smoothing 0.1, mixup 0.2 / cutmix 1.0, 10 epochs) in
#            kiln and in PyTorch (torchvision.transforms.v2's MixUp/CutMix) for seeds
#            FIDELITY_SEEDS (default "0 1 2"), the final test top-1 per seed and the means;
#            passes within 0.3 points. The GPU machine has no Fashion-MNIST: FIDELITY_DATA_DIR
#            names the folder of its four .gz files (default /usr/share/datasets/fashion-mnist)
# Logs go to /tmp/kiln-gpu-check; where $OUT is set (the device tool's output folder, which
# returns at most 8 files) they are packed into $OUT/logs.tgz and the summary into
# $OUT/summary.txt.
# Environment: KILN_GPU_BUILD (build dir, default build-gpu), KILN_JOBS (default nproc).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
BUILD=${KILN_GPU_BUILD:-build-gpu}
JOBS=${KILN_JOBS:-$(nproc)}
LOGS=/tmp/kiln-gpu-check
rm -rf "$LOGS" && mkdir -p "$LOGS"
# Where $OUT is set, everything comes back as two files, however the script ends.
pack() {
  [ -n "${OUT:-}" ] || return 0
  tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
  printf '%s\n' "${SUMMARY[@]}" >"$OUT/summary.txt"
}
trap pack EXIT
SUMMARY=()
note() { SUMMARY+=("$(printf '%-14s %s' "$1" "$2")"); echo "== $1: $2"; }
t0=$(date +%s)
since() { echo "$(( $(date +%s) - t0 ))s"; }
# One summary line per CUTLASS unit object ($1: prefix of its CMake target, $2: its source's
# name): registers, stack, HGMMA count and local loads / stores (0 LDL/STL: nothing spilled).
sass_notes() {
  command -v cuobjdump >/dev/null 2>&1 || return 0
  local o v sass
  for o in "$BUILD"/CMakeFiles/"$1"_*.dir/src/backend/cuda/cutlass/"$2".o; do
    [ -f "$o" ] || continue
    v=$(basename "$(dirname "$(dirname "$(dirname "$(dirname "$(dirname "$o")")")")")" .dir)
    sass=$(cuobjdump --dump-sass "$o" 2>&1)
    note "sass ${v#kiln_}" "$(cuobjdump --dump-resource-usage "$o" 2>&1 | grep -A1 device_kernel |
      grep -o 'REG:[0-9]* STACK:[0-9]*' | head -1), $(grep -c HGMMA <<<"$sass") HGMMA, $(
      grep -c 'LDL\|STL' <<<"$sass") LDL/STL"
  done
}
# A mode's end: the summary table last, and the status as the exit code.
finish() {
  echo
  echo "== summary (logs in $LOGS)"
  printf '%s\n' "${SUMMARY[@]}"
  exit $status
}

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
nvcc --version 2>&1 | tail -1
cmake --version | head -1
echo "commit ${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '? (pass KILN_COMMIT=...)')}"

# cuDNN: a system library normally; else the one in PyTorch's Python packages.
extra=()
if ! ldconfig -p 2>/dev/null | grep -q 'libcudnn\.so'; then
  lib=$(find / -xdev -name 'libcudnn.so.9*' -path '*nvidia/cudnn*' 2>/dev/null | head -1)
  if [ -n "$lib" ]; then
    dir=$(dirname "$lib")
    [ -e "$dir/libcudnn.so" ] || ln -sf "$(basename "$lib")" "$dir/libcudnn.so" 2>/dev/null || true
    extra+=("-DKILN_CUDNN_LIB=$lib" "-DKILN_CUDNN_INCLUDE=$(dirname "$dir")/include")
    export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
    echo "cuDNN from $dir"
  fi
fi
grep -h '#define CUDNN_M[AI]' /usr/include/cudnn_version.h /usr/local/cuda/include/cudnn_version.h 2>/dev/null | head -2

if [ "$MODE" = python ]; then
  if [ -n "${KILN_PY_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/kiln-pyext "$KILN_PY_WHEELS"/*.whl \
      >"$LOGS/pip.log" 2>&1 || tail -5 "$LOGS/pip.log"
    export PYTHONPATH="/tmp/kiln-pyext${PYTHONPATH:+:$PYTHONPATH}"
  fi
  extra+=(-DKILN_PYTHON=ON "-DPython_EXECUTABLE=$(command -v python3)")
fi

echo "== configure"
# The probe is configured only where it can build; here its absence is an error.
case "$MODE" in cutlass|cutlass-dgrad|first-layer|fold-dgrad) extra+=("-DKILN_CUTLASS_PROBE=ON") ;; esac
# The backend's CUTLASS kernels likewise where the GPU tests or the CUTLASS step run.
case "$MODE" in gpu|all|cutlass-step|cutlass-dgrad|first-layer|fold-dgrad) extra+=("-DKILN_CUTLASS_KERNELS=ON") ;; esac
if ! cmake -S . -B "$BUILD" -G Ninja -DKILN_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${extra[@]}" >"$LOGS/configure.log" 2>&1; then
  tail -30 "$LOGS/configure.log"
  note configure "FAILED ($(since))"
  printf '%s\n' "${SUMMARY[@]}"
  exit 1
fi
note configure "ok ($(since))"

echo "== build"
targets=()  # all: everything
# Every executable holding tests labelled gpu: ctest only sees the tests of what was built.
gpu_tests=(kiln_gpu_tests kiln_sweep_tests kiln_conv_forms)
[ "$MODE" = gpu ] && targets=(kiln "${gpu_tests[@]}")
[ "$MODE" = bench ] && targets=(kiln kiln_cli "${gpu_tests[@]}")
[ "$MODE" = compare ] && targets=(kiln kiln_cli "${gpu_tests[@]}")
[ "$MODE" = compare ] && [ "${COMPARE_TESTS:-1}" = 0 ] && targets=(kiln kiln_cli)
[ "$MODE" = tune ] && targets=(kiln kiln_cli)
[ "$MODE" = fidelity ] && targets=(kiln kiln_cli)
[ "$MODE" = ab ] && targets=(kiln kiln_cli)
[ "$MODE" = kernels ] && targets=(kiln kiln_cli)
[ "$MODE" = timeline ] && targets=(kiln kiln_cli kiln_cupti_trace)
[ "$MODE" = forms ] && targets=(kiln_conv_forms)
[ "$MODE" = python ] && targets=(kiln kiln_cli kiln_python kiln_py_reference)
[ "$MODE" = cutlass ] && targets=(kiln_cutlass_probe kiln_cutlass_layout_check)
[ "$MODE" = cutlass-step ] && targets=(kiln kiln_cli kiln_gpu_tests)
[ "$MODE" = cutlass-dgrad ] && targets=(kiln kiln_gpu_tests kiln_cutlass_probe)
[ "$MODE" = first-layer ] && targets=(kiln kiln_cli kiln_gpu_tests kiln_cutlass_probe)
[ "$MODE" = fold-dgrad ] && targets=(kiln kiln_cli kiln_gpu_tests kiln_cutlass_probe)
# DGRAD_TESTS=0: the probe alone (no library, no tests: a shorter build for a probe-only call).
[ "$MODE" = cutlass-dgrad ] && [ "${DGRAD_TESTS:-1}" = 0 ] && targets=(kiln_cutlass_probe)
[ "$MODE" = jpeg ] && targets=(kiln kiln_cli "${gpu_tests[@]}" kiln_cupti_trace)
if ! cmake --build "$BUILD" -j "$JOBS" ${targets[@]:+--target "${targets[@]}"} >"$LOGS/build.log" 2>&1; then
  grep -E 'error|FAILED' "$LOGS/build.log" | head -40
  note build "FAILED ($(since))"
  printf '%s\n' "${SUMMARY[@]}"
  exit 1
fi
note build "ok ($(since))"

status=0
ctest_line() { grep -E 'tests passed|No tests were found' "$1" | tail -1; }

if [ "$MODE" = tune ]; then
  # VGG16-BN's large convolutions take ~10 ms a run per engine: give each model minutes.
  for cfg in ${KILN_TUNE_LIST:-resnet50:256:1 vgg16_bn:256:1}; do
    IFS=: read -r m b a <<<"$cfg"
    amp=(); [ "$a" = 1 ] && amp=(--amp)
    name="$m-b$b${amp:+-amp}"
    KILN_LOG=info timeout "${TUNE_TIMEOUT:-300}" "$BUILD/kiln" tune "$m" --batch "$b" "${amp[@]}" \
      >"$LOGS/tune-$name.log" 2>&1 || status=1
    note "tune $name" "$(tail -1 "$LOGS/tune-$name.log" | cut -c1-160) ($(since))"
    for table in on off; do
      env_table=(); [ "$table" = off ] && env_table=(KILN_ENGINE_TABLE=0)
      env "${env_table[@]}" "$BUILD/kiln" bench --device cuda --model "$m" --batch "$b" "${amp[@]}" --steps 20 \
        --warmup 5 --repeats 3 >"$LOGS/bench-$name-table-$table.log" 2>&1 || status=1
      ips=$(grep -o '"images_per_second":[0-9.]*' "$LOGS/bench-$name-table-$table.log" | cut -d: -f2)
      note "table $table" "$name ${ips:-FAILED} img/s"
    done
  done
  cp configs/engines/*.tsv "$LOGS/" 2>/dev/null || true
  finish
fi

if [ "$MODE" = fidelity ]; then
  data=${FIDELITY_DATA_DIR:-/usr/share/datasets/fashion-mnist}
  fid=(bash bench/fidelity_compare.sh --device cuda --data-dir "$data" --seeds "${FIDELITY_SEEDS:-0 1 2}"
    --out "$LOGS/fidelity")
  # Seed by seed, kiln then PyTorch (~1 min a seed on an H200); the table is printed again
  # apart, so that a run cut by the timeout still reports the seeds it finished.
  BUILD="$BUILD" timeout "${FIDELITY_TIMEOUT:-420}" "${fid[@]}" >"$LOGS/fidelity-runs.log" 2>&1 || status=1
  grep '^== ' "$LOGS/fidelity-runs.log"
  BUILD="$BUILD" "${fid[@]}" --table-only >"$LOGS/fidelity.log" 2>&1 || status=1
  cat "$LOGS/fidelity.log"
  while IFS= read -r line; do SUMMARY+=("$line"); done < <(grep -E '^\||^PyTorch|^mix self|^fidelity' "$LOGS/fidelity.log")
  note fidelity "($(since))"
  finish
fi

if [ "$MODE" = jpeg ]; then
  jpeg_tests() {
    ctest --test-dir "$BUILD" -L gpu -R "${JPEG_TESTS_REGEX:-.}" -j 8 --timeout 300 --output-on-failure \
      >"$LOGS/ctest-gpu.log" 2>&1 || status=1
    grep -E 'Failed|\*\*\*|Exception|Timeout' "$LOGS/ctest-gpu.log" | head -40
    grep -E 'error|Failure|Expected|Which is|differ|> ' "$LOGS/ctest-gpu.log" | head -60
    note "gpu tests" "$(ctest_line "$LOGS/ctest-gpu.log") ($(since))"
  }
  [ "${JPEG_TESTS:-0}" = 1 ] && jpeg_tests
  LOGS="$LOGS/jpeg" BUILD="$BUILD" bash bench/jpeg_compare.sh "${JPEG_MODELS:-resnet50 vgg16_bn}" \
    ${JPEG_ROWS:+"$JPEG_ROWS"} >"$LOGS/jpeg-compare.log" 2>&1 || status=1
  grep -E '^== |host ms per batch' "$LOGS/jpeg-compare.log"
  while IFS= read -r line; do SUMMARY+=("$line"); done < <(grep '^|' "$LOGS/jpeg-compare.log")
  note "jpeg compare" "($(since))"
  # JPEG_TRACE=1: tools/cupti_trace.cpp's trace of 5 steps fed from the folder with GPU decode
  # (the decode, resample and step kernels per stream: does the step wait for its input, or
  # do the input's kernels slow the step?), for the first of JPEG_MODELS.
  tracer="$BUILD/libkiln_cupti_trace.so"
  if [ "${JPEG_TRACE:-0}" = 1 ] && [ -f "$tracer" ]; then
    m=${JPEG_MODELS:-resnet50}; m=${m%% *}; m=${m%%=*}
    csv="$LOGS/trace-folder-$m.csv"
    if CUDA_INJECTION64_PATH="$tracer" KILN_TRACE_OUT="$csv" "$BUILD/kiln" bench --model "$m" --batch 256 --amp \
         --data folder --data-dir "${JPEG_ROOT:-/tmp/kiln-jpegs}" --decode gpu --steps 5 --warmup 10 --repeats 1 \
         --cuda-profiler-range >"$LOGS/traced-folder-$m.log" 2>&1 &&
       python3 bench/gpu_timeline.py "$csv" --steps 5 --top 15 >"$LOGS/timeline-folder-$m.txt" 2>&1; then
      note "trace folder" "$(head -1 "$LOGS/timeline-folder-$m.txt")"
      sed -n '2,30p' "$LOGS/timeline-folder-$m.txt"
      grep 'host ms' "$LOGS/traced-folder-$m.log"
      gzip -f "$csv"
    else
      status=1
      note "trace folder" "FAILED: $(tail -2 "$LOGS/traced-folder-$m.log" 2>/dev/null | cut -c1-150)"
    fi
  fi
  [ "${JPEG_TESTS:-0}" = after ] && jpeg_tests
  finish
fi

if [ "$MODE" = python ]; then
  export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
  KILN_PY_REFERENCE=$(find "$BUILD" -name kiln_py_reference -type f | head -1)
  export KILN_PY_REFERENCE
  if [ "${PY_DEBUG:-0}" = 1 ]; then
    # No gdb on the GPU machine; cuda-gdb also debugs host code.
    timeout 240 cuda-gdb -batch -ex "handle SIGPIPE nostop noprint" -ex run -ex bt -ex "info sharedlibrary" \
      --args python3 -m pytest -x -q -p no:cacheprovider ${PY_DEBUG_TESTS:-python/tests/test_cuda_input.py} \
      >"$LOGS/pytest-gdb.txt" 2>&1
    grep -A40 -E "SIGSEGV|signal" "$LOGS/pytest-gdb.txt" | head -60
  fi
  # shellcheck disable=SC2086
  timeout "${PY_TIMEOUT:-400}" python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfs --tb=short \
    ${PY_PYTEST_ARGS:-} python/tests >"$LOGS/pytest.txt" 2>&1 || status=1
  grep -vE "^SKIPPED.*Fashion-MNIST" "$LOGS/pytest.txt" | tail -40
  note pytest "$(tail -1 "$LOGS/pytest.txt") ($(since))"
  python3 bench/python_overhead.py --kiln "$BUILD/kiln" --model cnn --batch 128 --device cuda \
    >"$LOGS/python-overhead.txt" 2>&1 || status=1
  cat "$LOGS/python-overhead.txt"
  while IFS= read -r line; do note "py overhead" "$line"; done < <(grep -E '"side"|overhead_percent' "$LOGS/python-overhead.txt")
  finish
fi

if [ "$MODE" = forms ]; then
  "$BUILD/kiln_conv_forms" --batch 256 --max-engines "${FORMS_ENGINES:-3}" >"$LOGS/conv-forms.txt" 2>&1 || status=1
  cat "$LOGS/conv-forms.txt"
  note "conv forms" "$(grep -F '**per step**' "$LOGS/conv-forms.txt" || tail -1 "$LOGS/conv-forms.txt")"
  finish
fi

if [ "$MODE" = cutlass ]; then
  # The accumulator layout the register sums assume (host only), before the kernels run.
  "$BUILD/kiln_cutlass_layout_check" >"$LOGS/cutlass-layout.txt" 2>&1 || status=1
  note "cutlass layout" "$(tr '\n' ' ' <"$LOGS/cutlass-layout.txt")"
  "$BUILD/kiln_cutlass_probe" --batch 256 --reps "${CUTLASS_REPS:-20}" >"$LOGS/cutlass-probe.txt" 2>&1 || status=1
  cat "$LOGS/cutlass-probe.txt"
  # Whether the kernels run on Hopper's warpgroup MMA (HGMMA), and what each holds: per
  # variant (one object file each) its GEMM kernel's registers, stack and static shared
  # memory, and its local loads and stores (LDL/STL: run-time-indexed or spilled registers).
  if command -v cuobjdump >/dev/null 2>&1; then
    cuobjdump --dump-sass "$BUILD/kiln_cutlass_probe" >"$LOGS/cutlass-probe.sass" 2>&1
    cuobjdump --dump-resource-usage "$BUILD/kiln_cutlass_probe" >"$LOGS/cutlass-resources.txt" 2>&1
    # The variants of probe_variants.h's list, X(tile_m, tile_n, mode, cluster_m, cluster_n), as
    # CMake names their units (older units may linger in the build folder).
    for v in $(sed -n 's/^ *X(\([0-9]*\), \([0-9]*\), \([a-z_]*\), \([0-9]*\), \([0-9]*\)).*/\1x\2_\3_\4x\5/p' \
      tools/cutlass_probe/probe_variants.h); do
      o="$BUILD/CMakeFiles/kiln_probe_gemm_stats_$v.dir/src/backend/cuda/cutlass/gemm_stats_sm90.cu.o"
      sass=$(cuobjdump --dump-sass "$o" 2>&1)
      printf '%-28s %s, %s HGMMA, %s LDL/STL\n' "$v" \
        "$(cuobjdump --dump-resource-usage "$o" 2>&1 | grep -A1 device_kernel |
          grep -o 'REG:[0-9]* STACK:[0-9]* SHARED:[0-9]*' | head -1)" \
        "$(grep -c HGMMA <<<"$sass")" "$(grep -c 'LDL\|STL' <<<"$sass")"
    done | tee "$LOGS/cutlass-variants.txt"
    local_mem=$(grep -v ', 0 LDL/STL$' "$LOGS/cutlass-variants.txt" | cut -d' ' -f1 | tr '\n' ' ')
    note "cutlass LDL/STL" "${local_mem:-none} (variants whose GEMM uses local memory)"
    note "cutlass sass" "$(grep -c HGMMA "$LOGS/cutlass-probe.sass") HGMMA, $(grep -c 'UTMASTG\|UBLKCP' "$LOGS/cutlass-probe.sass") TMA stores"
    gzip -f "$LOGS/cutlass-probe.sass"
  fi
  note "cutlass probe" "$(grep '^summary:' "$LOGS/cutlass-probe.txt" || tail -1 "$LOGS/cutlass-probe.txt")"
  finish
fi

if [ "$MODE" = cutlass-dgrad ]; then
  if [ "${DGRAD_TESTS:-1}" = 1 ]; then
    ctest --test-dir "$BUILD" -L gpu -R "${DGRAD_TESTS_REGEX:-GpuCutlass}" -j 2 --timeout 600 --output-on-failure \
      >"$LOGS/ctest-cutlass-dgrad.log" 2>&1 || status=1
    grep -E 'Failed|\*\*\*|Exception|Timeout' "$LOGS/ctest-cutlass-dgrad.log" | head -40
    grep -E 'error|Failure|Expected|Which is|differ|> ' "$LOGS/ctest-cutlass-dgrad.log" | head -60
    note "cutlass tests" "$(ctest_line "$LOGS/ctest-cutlass-dgrad.log") ($(since))"
  fi
  # PROLOGUE_PROBE=1: `kiln_cutlass_probe --prologue` first: BatchNorm + ReLU on the 1x1 GEMM's
  # operand load against kiln's apply pass before the GEMM (ResNet-50's conv3 layers).
  if [ "${PROLOGUE_PROBE:-0}" = 1 ]; then
    "$BUILD/kiln_cutlass_probe" --prologue --batch 256 --reps "${CUTLASS_REPS:-20}" \
      >"$LOGS/cutlass-prologue-probe.txt" 2>&1 || status=1
    cat "$LOGS/cutlass-prologue-probe.txt"
    sass_notes kiln_probe_gemm_bn_prologue gemm_stats_sm90.cu
    sass_notes kiln_probe_gemm_bn_folded gemm_stats_sm90.cu
    note "prologue probe" "$(grep '^summary:' "$LOGS/cutlass-prologue-probe.txt" || tail -1 "$LOGS/cutlass-prologue-probe.txt")"
  fi
  # DGRAD_PROBE=0 skips the data gradient's probe; DGRAD_PROBE_SHAPE=TEXT times only the shapes
  # it names (the probe's --shape, e.g. "vgg"), to leave a call time for more.
  if [ "${DGRAD_PROBE:-1}" = 1 ]; then
    shape=()
    [ -n "${DGRAD_PROBE_SHAPE:-}" ] && shape=(--shape "$DGRAD_PROBE_SHAPE")
    "$BUILD/kiln_cutlass_probe" --dgrad --batch 256 --reps "${CUTLASS_REPS:-20}" "${shape[@]}" \
      >"$LOGS/cutlass-dgrad-probe.txt" 2>&1 || status=1
    cat "$LOGS/cutlass-dgrad-probe.txt"
    sass_notes kiln_dgrad_bn dgrad_bn_sm90.cu  # the data-gradient units (dgrad_bn.h's lists)
    sass_notes kiln_conv_dgrad_bn conv_dgrad_bn_sm90.cu
    # DGRAD_NCU=TEXT: ncu on the data-gradient kernels of the probe's shapes named TEXT (e.g.
    # "conv1 56x56 64>256"): where the epilogue's time goes (issue 20).
    if [ -n "${DGRAD_NCU:-}" ]; then
      ncu --clock-control none --kernel-name-base mangled --kernel-name regex:DgradBn --launch-count 12 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section Occupancy \
        "$BUILD/kiln_cutlass_probe" --dgrad --batch 256 --reps 1 --shape "$DGRAD_NCU" \
        >"$LOGS/ncu-dgrad.txt" 2>&1 || status=1
      note "dgrad ncu" "$(grep -c 'Duration' "$LOGS/ncu-dgrad.txt") kernels profiled ($LOGS/ncu-dgrad.txt)"
    fi
    note "dgrad probe" "$(grep '^summary:' "$LOGS/cutlass-dgrad-probe.txt" || tail -1 "$LOGS/cutlass-dgrad-probe.txt")"
  fi
  # CONV_PROBE=1: `kiln_cutlass_probe --conv` too, VGG16-BN's and ResNet-50's 3x3 layers as the
  # SM90 implicit-GEMM convolution with BatchNorm's statistics against cuDNN + kiln's pass.
  if [ "${CONV_PROBE:-0}" = 1 ]; then
    "$BUILD/kiln_cutlass_probe" --conv --batch 256 --reps "${CUTLASS_REPS:-20}" \
      >"$LOGS/cutlass-conv-probe.txt" 2>&1 || status=1
    cat "$LOGS/cutlass-conv-probe.txt"
    sass_notes kiln_conv_stats conv_stats_sm90.cu  # conv_stats.h's units
    # CONV_NCU=TEXT: ncu on the convolution kernels of the probe's shapes named TEXT.
    if [ -n "${CONV_NCU:-}" ]; then
      ncu --clock-control none --kernel-name-base mangled --kernel-name regex:ConvUniversal \
        --launch-count 12 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        "$BUILD/kiln_cutlass_probe" --conv --batch 256 --reps 1 --shape "$CONV_NCU" \
        >"$LOGS/ncu-conv.txt" 2>&1 || status=1
      note "conv ncu" "$(grep -c 'Duration' "$LOGS/ncu-conv.txt") kernels profiled ($LOGS/ncu-conv.txt)"
    fi
    note "conv probe" "$(grep '^summary:' "$LOGS/cutlass-conv-probe.txt" || tail -1 "$LOGS/cutlass-conv-probe.txt")"
  fi
  finish
fi

if [ "$MODE" = cutlass-step ]; then
  if [ "${CUTLASS_TESTS:-1}" = 1 ]; then
    ctest --test-dir "$BUILD" -L gpu -R Cutlass -j 4 --timeout 600 --output-on-failure \
      >"$LOGS/ctest-cutlass.log" 2>&1 || status=1
    grep -E 'Failed|\*\*\*|Exception|Timeout' "$LOGS/ctest-cutlass.log" | head -40
    grep -E 'error|Failure|Expected|Which is|differ|> |resnet50 AMP' "$LOGS/ctest-cutlass.log" | head -60
    note "cutlass tests" "$(ctest_line "$LOGS/ctest-cutlass.log") ($(since))"
  fi
  sass_notes kiln_gemm_stats gemm_stats_sm90.cu  # the forward's units (gemm_stats.h's list)
  # Each form: KILN_CUTLASS, KILN_CUTLASS_DGRAD, KILN_CUTLASS_CONV, KILN_CUTLASS_CONV_DGRAD and
  # KILN_CUTLASS_TIMED (auto: their defaults; the A/B forms fix the timing off, so that each
  # auto follows its fixed default).
  forms=("0 auto auto auto 0" "auto auto auto auto 1")
  [ "${CUTLASS_DGRAD_AB:-0}" = 1 ] && forms=("0 auto auto auto 0" "1 0 auto auto 0" "1 1 auto auto 0")
  [ "${CUTLASS_CONV_AB:-0}" = 1 ] && forms=("0 auto 0 0 0" "1 auto 0 0 0" "1 auto 1 0 0")
  [ "${CUTLASS_CONV_DGRAD_AB:-0}" = 1 ] && forms=("0 auto 0 0 0" "1 auto 0 0 0" "1 auto 0 1 0")
  # Both: the forward's and the data gradient's implicit GEMM, apart and together.
  [ "${CUTLASS_CONV_AB:-0}${CUTLASS_CONV_DGRAD_AB:-0}" = 11 ] &&
    forms=("0 auto 0 0 0" "1 auto 0 0 0" "1 auto 1 0 0" "1 auto 0 1 0" "1 auto 1 1 0")
  # CUTLASS_TIMED_AB=1: cuDNN, the fixed defaults, and each layer timed (kiln's default).
  [ "${CUTLASS_TIMED_AB:-0}" = 1 ] &&
    forms=("0 auto auto auto 0" "auto auto auto auto 0" "auto auto auto auto 1")
  for m in ${CUTLASS_MODEL:-resnet50}; do
  for round in $(seq 1 "${CUTLASS_ROUNDS:-2}"); do
    for form in "${forms[@]}"; do
      read -r on dgrad conv cdgrad timed <<<"$form"
      log="$LOGS/bench-$m-cutlass$on-dgrad$dgrad-conv$conv-cdgrad$cdgrad-timed$timed-r$round.log"
      KILN_CUTLASS=$on KILN_CUTLASS_DGRAD=$dgrad KILN_CUTLASS_CONV=$conv \
        KILN_CUTLASS_CONV_DGRAD=$cdgrad KILN_CUTLASS_TIMED=$timed "$BUILD/kiln" bench --device cuda \
        --model "$m" --batch 256 --amp --steps "${STEPS:-20}" --warmup 5 --repeats 3 >"$log" 2>&1 ||
        status=1
      ips=$(grep -o '"images_per_second":[0-9.]*' "$log" | cut -d: -f2)
      # kiln bench's lines: CBR forwards and convolutions before BN+add+ReLU on the GEMM / kept;
      # data gradients before a BatchNorm backward on the SM90 kernel / kept.
      layers=$(grep -o 'KILN_CUTLASS=[a-z0-9]*): .*' "$log" | sed 's/ (the log says why)//;s/^[^:]*: //')
      tlayers=$(grep -o 'timed per layer (KILN_CUTLASS_TIMED=1): .*' "$log" | sed 's/^[^:]*: //')
      dlayers=$(grep -o 'KILN_CUTLASS_DGRAD=[a-z0-9]*): .*' "$log" | sed 's/ (the log says why)//;s/^[^:]*: //')
      clayers=$(sed -n 's/.*of those, \([0-9]*\) on the SM90 implicit-GEMM convolution.*/\1/p' "$log" | head -1)
      cdlayers=$(sed -n 's/.*of those, \([0-9]*\) on the SM90 implicit-GEMM data gradient.*/\1/p' "$log" | head -1)
      note "$m KILN_CUTLASS=$on DGRAD=$dgrad CONV=$conv CONV_DGRAD=$cdgrad TIMED=$timed" "round $round: ${ips:-FAILED: $(tail -1 "$log" | cut -c1-150)} img/s ($(since))${layers:+; $layers}${dlayers:+; dgrad: $dlayers}${clayers:+; implicit-GEMM convolutions: $clayers}${cdlayers:+; implicit-GEMM data gradients: $cdlayers}${tlayers:+; timed: $tlayers}"
    done
  done
  done
  finish
fi

if [ "$MODE" = kernels ]; then
  for m in ${PROFILE_MODELS:-resnet50 vgg16_bn}; do
    # Only the timed steps are recorded (--cuda-profiler-range): 2 steps x 1 repeat.
    ncu --profile-from-start off --clock-control none --print-units base --csv --page raw \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      "$BUILD/kiln" bench --device cuda --model "$m" --batch 256 --amp --steps 2 --warmup 3 --repeats 1 \
      --cuda-profiler-range >"$LOGS/ncu-$m.csv" 2>"$LOGS/ncu-$m.err" || status=1
    if python3 bench/kernel_breakdown.py "$LOGS/ncu-$m.csv" --steps 2 >"$LOGS/kernels-$m.txt" 2>&1; then
      note "kernels $m" "$(head -1 "$LOGS/kernels-$m.txt")"
      sed -n '2,16p' "$LOGS/kernels-$m.txt"
    else
      status=1
      note "kernels $m" "FAILED: $(tail -1 "$LOGS/kernels-$m.txt" "$LOGS/ncu-$m.err" | cut -c1-150)"
    fi
  done
  finish
fi

if [ "$MODE" = timeline ]; then
  tracer="$BUILD/libkiln_cupti_trace.so"
  [ -f "$tracer" ] || { note timeline "FAILED: no $tracer (the toolkit has no CUPTI: see CMakeLists.txt)"; status=1; finish; }
  # One traced run: CUDA_INJECTION64_PATH loads tools/cupti_trace.cpp, which records what runs
  # between cudaProfilerStart and Stop (5 timed steps x 1 repeat) and writes $2's CSV.
  traced() {
    local name=$1 csv="$LOGS/trace-$1.csv"; shift
    if CUDA_INJECTION64_PATH="$tracer" KILN_TRACE_OUT="$csv" "$@" >"$LOGS/traced-$name.log" 2>&1 &&
       python3 bench/gpu_timeline.py "$csv" --steps 5 --top 15 >"$LOGS/timeline-$name.txt" 2>&1; then
      note "timeline $name" "$(head -1 "$LOGS/timeline-$name.txt")"
      sed -n '2,24p' "$LOGS/timeline-$name.txt"
      gzip -f "$csv"  # kept for a closer look (full kernel names); a few hundred kB
    else
      status=1
      note "timeline $name" "FAILED: $(tail -2 "$LOGS/traced-$name.log" "$LOGS/timeline-$name.txt" 2>/dev/null | cut -c1-150)"
    fi
  }
  for m in ${PROFILE_MODELS:-resnet50 vgg16_bn}; do
    traced "$m" "$BUILD/kiln" bench --device cuda --model "$m" --batch 256 --amp --steps 5 --warmup 5 --repeats 1 \
      --cuda-profiler-range
    # PyTorch's eager step, traced alike in the same call: SPEC Q3's breakdown beside kiln's.
    [ "${TIMELINE_TORCH:-1}" = 1 ] && traced "$m-torch-eager" python3 bench/torch_reference.py --model "$m" \
      --batch 256 --amp --modes eager --steps 5 --warmup 5 --repeats 1 --cuda-profiler-range
    # Clocks and power while the same bench runs unprofiled: is a sustained step throttled?
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
      --format=csv -lms 100 >"$LOGS/clocks-$m.csv" 2>&1 &
    smi=$!
    "$BUILD/kiln" bench --device cuda --model "$m" --batch 256 --amp --steps 30 --warmup 5 --repeats 3 \
      >"$LOGS/bench-clocks-$m.log" 2>&1 || status=1
    kill $smi 2>/dev/null; wait $smi 2>/dev/null
    note "clocks $m" "$(python3 - "$LOGS/clocks-$m.csv" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) >= 5 and r[1].strip().split()[0].isdigit()]
sm = [float(r[1].split()[0]) for r in rows]
pw = [float(r[3].split()[0]) for r in rows if r[3].strip().split()[0].replace('.', '', 1).isdigit()]
busy = [s for s in sm if s > 1000] or sm
print(f"SM clock median {statistics.median(busy):.0f} MHz (min {min(busy):.0f}, max {max(busy):.0f}) over {len(busy)} samples; "
      f"power median {statistics.median(pw) if pw else float('nan'):.0f} W, max {max(pw) if pw else float('nan'):.0f} W")
PY
)"
  done
  finish
fi

# `kiln bench` of model $1 (AMP, batch 256) under environment settings $2 (empty: the defaults),
# logged to $LOGS/$3.log; a summary line with its img/s and $4.
bench_variant() {
  # shellcheck disable=SC2086
  env $2 timeout 300 "$BUILD/kiln" bench --device cuda --model "$1" --batch 256 --amp --steps "${STEPS:-20}" \
    --warmup 5 --repeats 3 --stage "${STAGE:-every-step}" >"$LOGS/$3.log" 2>&1 || status=1
  local ips
  ips=$(grep -o '"images_per_second":[0-9.]*' "$LOGS/$3.log" | tail -1 | cut -d: -f2)
  note "$1" "${2:-defaults}: ${ips:-FAILED} img/s ($4$(since))"
}

# The GPU tests matching regex $2, four at a time, logged to $LOGS/ctest-$1.log: the failures
# (their expectations, long value lists left out) and a summary line "$1 tests".
gpu_tests_matching() {
  ctest --test-dir "$BUILD" -L gpu -R "$2" -j 4 --timeout 300 --output-on-failure \
    >"$LOGS/ctest-$1.log" 2>&1 || status=1
  grep -E '\(Failed\)|\(Timeout\)' "$LOGS/ctest-$1.log" | head -20
  grep -B3 -A12 'Failure' "$LOGS/ctest-$1.log" | grep -v 'Which is: {' | head -60
  note "$1 tests" "$(ctest_line "$LOGS/ctest-$1.log") ($(since))"
}

if [ "$MODE" = first-layer ]; then
  gpu_tests_matching first 'FirstLayer'
  timeout 120 "$BUILD/kiln_cutlass_probe" --first-layer --batch 256 --reps 9 >"$LOGS/first-probe.log" 2>&1 ||
    status=1
  head -30 "$LOGS/first-probe.log"
  IFS=';' read -r -a variants <<<"${FIRST_VARIANTS:-KILN_FIRST_LAYER_WGRAD=0;KILN_FIRST_LAYER_BN_FOLD=0;}"
  for m in ${FIRST_MODELS:-vgg16_bn resnet50}; do
    # The timed choices each first layer made (lines with their times; refusals left out).
    KILN_LOG=debug timeout 120 "$BUILD/kiln" bench --device cuda --model "$m" --batch 256 --amp --steps 2 \
      --warmup 1 --repeats 1 >"$LOGS/first-choices-$m.log" 2>&1 || status=1
    grep -E "(direct convolution|direct weight gradient|folded into the direct weight gradient) [0-9.]+ ms" \
      "$LOGS/first-choices-$m.log" | cut -c1-300
  done
  for r in $(seq "${FIRST_ROUNDS:-2}"); do
    for m in ${FIRST_MODELS:-vgg16_bn resnet50}; do
      for v in "${variants[@]}"; do
        bench_variant "$m" "$v" "first-$m-$(echo "${v:-defaults}" | tr ' =' '_-')-$r" "round $r, "
      done
    done
  done
  finish
fi

if [ "$MODE" = fold-dgrad ]; then
  gpu_tests_matching fold "${FOLD_TESTS_REGEX:-GpuFoldDgrad|FirstLayer|GpuAutotune.OffAndOnTrainAlike|vgg_first_20x18}"
  if command -v cuobjdump >/dev/null 2>&1; then
    o="$BUILD/CMakeFiles/kiln_cutlass_probe.dir/src/backend/cuda/fold_dgrad.cu.o"
    note "sass fold" "$(cuobjdump --dump-resource-usage "$o" 2>&1 | grep -o 'REG:[0-9]* STACK:[0-9]* SHARED:[0-9]*' | head -1), $(
      cuobjdump --dump-sass "$o" 2>&1 | grep -c 'LDL\|STL') LDL/STL, $(cuobjdump --dump-sass "$o" 2>&1 | grep -c HMMA) HMMA"
  fi
  timeout 240 "$BUILD/kiln_cutlass_probe" --fold-dgrad --batch 256 --reps "${FOLD_REPS:-9}" \
    >"$LOGS/fold-probe.log" 2>&1 || status=1
  cat "$LOGS/fold-probe.log" | head -30
  note "fold probe" "$(grep '^summary' "$LOGS/fold-probe.log" | cut -c1-200) ($(since))"
  finish
fi

if [ "$MODE" = ab ]; then
  IFS=';' read -r -a variants <<<"${AB_VARIANTS:-;KILN_PAD_CHANNELS=0;KILN_PAD_CHANNELS=1;KILN_FUSE_GRAD_SUM=0;KILN_CBR_FORM=genstats}"
  for m in ${AB_MODELS:-resnet50 vgg16_bn}; do
    for r in $(seq 1 "${AB_ROUNDS:-1}"); do
      for v in "${variants[@]}"; do
        bench_variant "$m" "$v" "ab-$m-$(echo "${v:-defaults}" | tr ' =' '_-')-$r" "round $r, "
      done
    done
  done
  finish
fi

if [ "$MODE" != compare ] || [ "${COMPARE_TESTS:-1}" != 0 ]; then
  echo "== GPU tests"
  shard=()
  [ -n "${GPU_TESTS_SHARD:-}" ] && shard=(-I "${GPU_TESTS_SHARD%/*},,${GPU_TESTS_SHARD#*/}")
  ctest --test-dir "$BUILD" -L gpu -R "${GPU_TESTS_REGEX:-.}" ${GPU_TESTS_EXCLUDE:+-E "$GPU_TESTS_EXCLUDE"} \
    "${shard[@]}" -j 8 --timeout 300 --output-on-failure \
    >"$LOGS/ctest-gpu.log" 2>&1 || status=1
  grep -E 'Failed|\*\*\*|Exception|Timeout' "$LOGS/ctest-gpu.log" | head -40
  grep -E 'error|Failure|Expected|Which is|differ|> ' "$LOGS/ctest-gpu.log" | head -60
  note "gpu tests" "$(ctest_line "$LOGS/ctest-gpu.log") ($(since))"
  # The golden steps' errors against PyTorch, which passing tests print too (ctest's full log).
  grep -h '^torch golden\|^KILN_CUTLASS=1: ' "$BUILD/Testing/Temporary/LastTest.log" 2>/dev/null | cut -c1-420
fi

if [ "$MODE" = all ]; then
  echo "== CPU tests"
  ctest --test-dir "$BUILD" -LE gpu -j "$JOBS" --timeout 300 >"$LOGS/ctest-cpu.log" 2>&1 || status=1
  grep -E '\*\*\*Failed|Timeout' "$LOGS/ctest-cpu.log" | head -20
  note "cpu tests" "$(ctest_line "$LOGS/ctest-cpu.log") ($(since))"
fi

if [ "$MODE" = bench ]; then
  echo "== bench"
  # KILN_BENCH="model:batch:amp ..." overrides the list; BENCH_TORCH=1 adds PyTorch's side
  # (bench/torch_reference.py, eager and torch.compile) for the same configurations.
  cli="$BUILD/kiln"
  # FP32 (TF32 off) is slow: ResNet-50 ~0.54 s a step, VGG16-BN several times that on an H200.
  list=${KILN_BENCH:-"cnn:128:0 resnet50:256:1 vgg16_bn:256:1 resnet50:256:0"}
  if "$cli" bench --help >/dev/null 2>&1; then
    for cfg in $list; do
      IFS=: read -r m b a <<<"$cfg"
      amp=(); [ "$a" = 1 ] && amp=(--amp)
      name="$m-b$b${amp:+-amp}"
      "$cli" bench --device cuda --model "$m" --batch "$b" "${amp[@]}" --steps "${BENCH_STEPS:-10}" --warmup 3 \
        >"$LOGS/bench-$name.log" 2>&1 || status=1
      ips=$(grep -o '"images_per_second":[0-9.]*' "$LOGS/bench-$name.log" | cut -d: -f2)
      note "kiln $name" "${ips:-FAILED: $(tail -1 "$LOGS/bench-$name.log" | cut -c1-150)} img/s"
      if [ "${BENCH_TORCH:-0}" = 1 ] && [ -f bench/torch_reference.py ] && [ "$m" != cnn ]; then
        python3 bench/torch_reference.py --model "$m" --batch "$b" "${amp[@]}" --steps "${BENCH_STEPS:-10}" \
          --warmup 5 >"$LOGS/torch-$name.log" 2>&1 || true
        note "torch $name" "$(grep -o '"mode": *"[a-z]*"\|"images_per_second": *[0-9.]*' "$LOGS/torch-$name.log" | tr '\n' ' ')"
      fi
    done
  else
    note bench "skipped: this kiln has no 'bench' command yet"
  fi
fi

if [ "$MODE" = compare ]; then
  echo "== compare"
  precisions=${COMPARE_PRECISIONS:-amp}
  IFS=';' read -r -a baselines <<<"${COMPARE_BASELINES:-KILN_FUSION=0}"
  for m in ${COMPARE_MODELS:-resnet50 vgg16_bn}; do
    for prec in $precisions; do
      amp=(); [ "$prec" = amp ] && amp=(--amp)
      for v in "${baselines[@]}"; do
        name="$m-$prec-$(echo "$v" | tr ' =' '_-')"
        # shellcheck disable=SC2086
        env $v "$BUILD/kiln" bench --device cuda --model "$m" --batch 256 "${amp[@]}" --steps "${STEPS:-20}" \
          --warmup 5 --repeats 3 >"$LOGS/bench-$name.log" 2>&1 || status=1
        ips=$(grep -o '"images_per_second":[0-9.]*' "$LOGS/bench-$name.log" | cut -d: -f2)
        note "kiln $v" "$m $prec ${ips:-FAILED} img/s"
      done
    done
  done
  COMPARE_LOGS="$LOGS/compare" BUILD="$BUILD" STEPS=${STEPS:-20} bash bench/gpu_compare.sh \
    "${COMPARE_MODELS:-resnet50 vgg16_bn}" 256 "$precisions" "eager,compile" >"$LOGS/compare.log" 2>&1 || status=1
  while IFS= read -r line; do SUMMARY+=("$line"); done < <(grep '^|' "$LOGS/compare.log")
fi

echo
echo "== summary (logs in $LOGS)"
printf '%s\n' "${SUMMARY[@]}"
exit $status
