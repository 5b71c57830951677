#!/usr/bin/env bash
# The test command: Release build + every test, then the unit tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/), then a short run of every libFuzzer
# target (scripts/fuzz.sh, clang; HYPIC_FUZZ_SECONDS per target, default 15; HYPIC_SKIP_FUZZ=1 to
# skip). Prints ctest's summary lines and one line per fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="$(nproc)"

scripts/build.sh
(cd build && ctest --output-on-failure -j "$jobs")

if [ "${HYPIC_SKIP_SANITIZERS:-0}" != 1 ]; then
  # The CUDA backend is left out here: no GPU to run it on, and nvcc would double the build time.
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DHYPIC_SANITIZE=ON -DHYPIC_CUDA=OFF >/dev/null
  cmake --build build-asan -j "$jobs"
  # Leak checking is off: OpenBLAS keeps per-thread buffers alive until exit by design.
  (cd build-asan && ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
     ctest --output-on-failure -j "$jobs" -LE slow)
fi

if [ "${HYPIC_SKIP_FUZZ:-0}" != 1 ]; then
  scripts/fuzz.sh "${HYPIC_FUZZ_SECONDS:-15}"
fi
