#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/: clang, ASan + UBSan, coverage-instrumented hypic_core) in
# build-fuzz/ and runs each for SECONDS on its committed seed corpus (fuzz/corpus/<target>). Inputs
# the fuzzer finds go to a scratch copy, so the committed corpus only changes by hand. A crash,
# sanitizer report, timeout (10 s per input) or memory blow-up (2 GB) fails the script and leaves
# the input in build-fuzz/artifacts/.
# Usage: scripts/fuzz.sh [SECONDS per target, default 20] [target ...]   (default: every target)
# Prints one line per target: executions, coverage, corpus size.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-20}"
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(fuzz_request fuzz_chat_template fuzz_tokenizer fuzz_safetensors fuzz_config
                                     fuzz_segment_file fuzz_gguf)
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHYPIC_FUZZ=ON \
  -DHYPIC_CUDA=OFF -DHYPIC_BUILD_TESTS=OFF >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target "${targets[@]}" | tail -1
mkdir -p build-fuzz/artifacts
status=0
for t in "${targets[@]}"; do
  work="$(mktemp -d)"
  log="build-fuzz/artifacts/$t.log"
  # Leak checks off: OpenBLAS and the per-process fixtures keep buffers until exit by design.
  if ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
     timeout -k 10 "$((secs + 120))" "build-fuzz/fuzz/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="build-fuzz/artifacts/$t-" "$work" "fuzz/corpus/$t" >"$log" 2>&1; then
    runs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')"
    cov="$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo '?')"
    echo "$t: ok, $runs executions in ${secs} s, coverage $cov, corpus $(ls "$work" | wc -l) new inputs"
  else
    echo "$t: FAILED (log: $log)"
    tail -40 "$log"
    status=1
  fi
  rm -rf "$work"
done
exit $status
