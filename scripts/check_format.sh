#!/usr/bin/env bash
# Every C++/CUDA source as .clang-format writes it (clang-format --dry-run -Werror): CI fails on
# a file that differs, naming it. Fix with: clang-format -i FILE (or this script with --fix).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || {
  echo "check_format: clang-format is not installed (scripts/setup.sh installs it)" >&2
  exit 1
}
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' '*.hpp')
if [ "${1:-}" = --fix ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
clang-format --dry-run -Werror "${files[@]}"
echo "check_format: ${#files[@]} files formatted as .clang-format says ($(clang-format --version | head -1))"
