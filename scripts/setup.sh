#!/usr/bin/env bash
# Installs and stages what kiln's build needs. Safe to run again: it does only what is missing.
#  - Debian packages (when apt-get is there and we are root): oneDNN 2.6, zlib, libjpeg-turbo,
#    libpng, yaml-cpp, GoogleTest, OpenMPI, clang (fuzzers), clang-format, Fashion-MNIST.
#  - .deps/ (git-ignored), so that a machine without those packages (the GPU machine, which
#    cannot install anything) builds from the same files when `.deps` is carried there:
#    oneDNN's headers and library, GoogleTest's sources, the pinned cuDNN frontend headers,
#    the pinned CUTLASS headers as one tar (the SM90 kernels and their probe).
set -euo pipefail
cd "$(dirname "$0")/.."
DEPS=.deps
CUDNN_FRONTEND_VERSION=1.16.0   # pinned; header-only
NVJPEG_VERSION=13.0.1.86        # pinned; the GPU machine's CUDA 13.0 toolkit has nvJPEG 13.0.1
CUTLASS_VERSION=4.2.0.0         # pinned; header-only, the wheel carries CUTLASS's C++ tree
mkdir -p "$DEPS"

need_pkgs=()
want=(libdnnl-dev zlib1g-dev libjpeg62-turbo-dev libpng-dev libyaml-cpp-dev libgtest-dev
      libopenmpi-dev openmpi-bin clang libclang-rt-14-dev clang-format dataset-fashion-mnist ninja-build cmake g++)
if command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  for p in "${want[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
  done
  if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "setup: installing ${need_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
  fi
fi

# oneDNN, staged (about 40 MB) so the GPU machine can build the CPU backend it tests against.
if [ ! -f "$DEPS/dnnl/lib/libdnnl.so.2" ] && [ -f /usr/include/oneapi/dnnl/dnnl.hpp ]; then
  mkdir -p "$DEPS/dnnl/include/oneapi" "$DEPS/dnnl/lib"
  cp -r /usr/include/oneapi/dnnl "$DEPS/dnnl/include/oneapi/"
  cp /usr/include/dnnl*.h /usr/include/dnnl*.hpp "$DEPS/dnnl/include/" 2>/dev/null || true
  lib=$(readlink -f /usr/lib/x86_64-linux-gnu/libdnnl.so.2)
  cp "$lib" "$DEPS/dnnl/lib/libdnnl.so.2"
  ln -sf libdnnl.so.2 "$DEPS/dnnl/lib/libdnnl.so"
fi

# GoogleTest sources, for machines that have only its headers.
if [ ! -f "$DEPS/googletest/CMakeLists.txt" ] && [ -d /usr/src/googletest ]; then
  cp -r /usr/src/googletest "$DEPS/googletest"
fi

# cuDNN frontend headers from the pinned wheel (never committed).
if [ ! -f "$DEPS/cudnn-frontend/include/cudnn_frontend.h" ]; then
  tmp=$(mktemp -d)
  if python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 -d "$tmp" "nvidia-cudnn-frontend==${CUDNN_FRONTEND_VERSION}" 2>/dev/null; then
    mkdir -p "$DEPS/cudnn-frontend"
    python3 - "$tmp" "$DEPS/cudnn-frontend" <<'PY'
import sys, zipfile, glob, os
whl = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("include/") and not n.endswith("/"):
            z.extract(n, sys.argv[2])
PY
    echo "setup: cuDNN frontend ${CUDNN_FRONTEND_VERSION} headers in $DEPS/cudnn-frontend"
  else
    echo "setup: could not download nvidia-cudnn-frontend; the CUDA backend will not be built"
  fi
  rm -rf "$tmp"
fi
# nvJPEG's header and library from the pinned wheel (never committed), for toolkits without
# nvJPEG: the build links against it, the GPU machine runs with its own toolkit's libnvjpeg.
if [ ! -f "$DEPS/nvjpeg/include/nvjpeg.h" ]; then
  tmp=$(mktemp -d)
  got=""
  for plat in manylinux_2_28_x86_64 manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64; do
    if python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --platform "$plat" -d "$tmp" "nvidia-nvjpeg==${NVJPEG_VERSION}" 2>/dev/null; then
      got=1
      break
    fi
  done
  if [ -n "$got" ]; then
    mkdir -p "$DEPS/nvjpeg/include" "$DEPS/nvjpeg/lib"
    python3 - "$tmp" "$DEPS/nvjpeg" <<'PY'
import sys, zipfile, glob, os
whl = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        base = os.path.basename(n)
        if n.endswith("/include/nvjpeg.h"):
            dst = os.path.join(sys.argv[2], "include", base)
        elif "/lib/libnvjpeg.so" in n:
            dst = os.path.join(sys.argv[2], "lib", base)
        else:
            continue
        with z.open(n) as src, open(dst, "wb") as out:
            out.write(src.read())
PY
    # The linker looks for libnvjpeg.so; the wheel has only the versioned name.
    for lib in "$DEPS"/nvjpeg/lib/libnvjpeg.so.*; do ln -sf "$(basename "$lib")" "$DEPS/nvjpeg/lib/libnvjpeg.so"; done
    echo "setup: nvJPEG ${NVJPEG_VERSION} header and library in $DEPS/nvjpeg"
  else
    echo "setup: could not download nvidia-nvjpeg; the GPU JPEG decoder will not be built"
  fi
  rm -rf "$tmp"
fi
# CUTLASS's C++ headers (cute/, cutlass/, and tools/util's cutlass/util/) from the pinned wheel,
# which carries the source tree under cutlass_library/source/ (never committed). Kept as one
# gzipped tar (2.5 MB; the tree is 28 MB, which would push .deps past what the device tool
# carries to the GPU machine): CMake unpacks it into the build folder for the SM90 kernels.
CUTLASS_TGZ="$DEPS/cutlass/cutlass-${CUTLASS_VERSION}-include.tar.gz"
if [ ! -f "$CUTLASS_TGZ" ]; then
  tmp=$(mktemp -d)
  if python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
      "nvidia-cutlass==${CUTLASS_VERSION}" 2>/dev/null; then
    mkdir -p "$DEPS/cutlass"
    python3 - "$tmp" "$CUTLASS_TGZ.partial" <<'PY'
import sys, zipfile, glob, os, tarfile, io
whl = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
roots = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")
with zipfile.ZipFile(whl) as z, tarfile.open(sys.argv[2], "w:gz") as tar:
    for n in sorted(z.namelist()):
        for r in roots:
            if n.startswith(r) and not n.endswith("/"):
                data = z.read(n)
                info = tarfile.TarInfo("include/" + n[len(r):])
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
PY
    # Renamed only when complete, so an interrupted run is redone rather than half-used.
    mv "$CUTLASS_TGZ.partial" "$CUTLASS_TGZ"
    echo "setup: CUTLASS ${CUTLASS_VERSION} headers in $CUTLASS_TGZ"
  else
    echo "setup: could not download nvidia-cutlass; the SM90 CUTLASS kernels will not be built"
  fi
  rm -rf "$tmp"
fi
# The Python module's build and tests (SPEC S30): a venv in the build folder with the pinned
# packages of python/requirements-dev.txt; the CMake project builds kiln._kiln when it is there.
PYENV="${KILN_BUILD_DIR:-build}/pyenv"
if [ ! -x "$PYENV/bin/pytest" ] && command -v python3 >/dev/null 2>&1; then
  if python3 -m venv "$PYENV" >/dev/null 2>&1 &&
      "$PYENV/bin/python" -m pip install -q --disable-pip-version-check -r python/requirements-dev.txt; then
    echo "setup: Python venv with nanobind and pytest in $PYENV"
  else
    rm -rf "$PYENV"
    echo "setup: could not make the Python venv $PYENV (python3-venv, or PyPI); the Python module will not be built"
  fi
fi
echo "setup: done"
