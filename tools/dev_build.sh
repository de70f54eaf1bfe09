#!/usr/bin/env bash
# Developer build: compiles pyspec._core into the source tree (pyspec/_core*.so) so tests run
# against the working copy. A lock keeps concurrent builds from stepping on each other.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/pyspec-build.lock bash -c '
  if [ ! -f build/dev/build.ninja ]; then
    cmake -S . -B build/dev -G Ninja -DPYSPEC_INPLACE=ON \
      -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" >/dev/null
  fi
  cmake --build build/dev -j2 "$@"
' _ "$@"
