#!/usr/bin/env bash
# The test command: Release build + every test, then the unit tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/), then a short run of every libFuzzer
# target (scripts/fuzz.sh, clang; HYPIC_FUZZ_SECONDS per target, default 15; HYPIC_SKIP_FUZZ=1 to
# skip). Prints ctest's summary lines and one line per fuzz target.
# Each ctest run is bounded as a whole (HYPIC_CTEST_LIMIT_S, default 2400 s): a test that hangs
# past its own timeout (a child holding ctest's pipe, say) ends the run as a failure with ctest's
# output so far, instead of running the CI job out of time with nothing to show.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="$(nproc)"

limit="${HYPIC_CTEST_LIMIT_S:-2400}"
# The test binaries link OpenBLAS, whose load-time CPU detection falls back to SSE3 kernels on
# virtual machines that hide the CPU model (hypic itself re-executes on the right ones:
# src/backend/cpu/blas_core.h). Name the kernels here so the tests run at the machine's speed.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  flags="$(grep -m1 '^flags' /proc/cpuinfo || true)"
  has() { [[ " $flags " == *" $1 "* ]]; }
  if has avx512f && has avx512bw && has avx512vl && has avx512dq; then export OPENBLAS_CORETYPE=SkylakeX
  elif has avx2 && has fma; then export OPENBLAS_CORETYPE=Haswell; fi
fi
scripts/build.sh
(cd build && timeout -k 30 "$limit" ctest --output-on-failure -j "$jobs")

if [ "${HYPIC_SKIP_SANITIZERS:-0}" != 1 ]; then
  # The CUDA backend is left out here: no GPU to run it on, and nvcc would double the build time.
  # -O1: the sanitized server tests and attacks run several times faster than at -O0, and asserts
  # and the poisoning of uninitialized buffers (Debug) stay on.
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-g -O1" -DHYPIC_SANITIZE=ON \
    -DHYPIC_CUDA=OFF >/dev/null
  cmake --build build-asan -j "$jobs"
  # Leak checking is off: OpenBLAS keeps per-thread buffers alive until exit by design.
  (cd build-asan && ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
     timeout -k 30 "$limit" ctest --output-on-failure -j "$jobs" -LE slow)
fi

if [ "${HYPIC_SKIP_FUZZ:-0}" != 1 ]; then
  scripts/fuzz.sh "${HYPIC_FUZZ_SECONDS:-15}"
fi
