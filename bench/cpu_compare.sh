#!/usr/bin/env bash
# The CPU comparison of issue 17: hypic against llama.cpp's CPU build on the very same GGUF files,
# made by llama.cpp's own tools: convert_hf_to_gguf.py (through tools/gguf/convert.py) to bf16, then
# llama-quantize to Q8_0 and Q4_K_M. Models: the trained default model (models/default) and the
# real Qwen3.5-0.8B shape with random weights (tools/bench/random_hf_folder.py, the Qwen tokenizer
# from .peer/tokenizer.tar.gz). llama.cpp is built from .peer/llama.cpp.tar.gz (scripts/pack-llama-
# peer.sh) in $WORK, CPU only, GGML_NATIVE, without AMX (advertised here, but it traps). Nothing of
# it enters the repository. Needs python3 with numpy and torch (Debian python3-numpy python3-torch,
# python3-regex, python3-tqdm) for the converter; run on an idle machine.
# Usage: bench/cpu_compare.sh [MODELS...]   (default: default qwen3_5_0_8b)
# Environment: WORK (/tmp/hypic-cpu-peer), TYPES (bf16 q8_0 q4_k_m), THREADS (1,2), PREFILL
# (512,2048), CONTEXT (512), TOKENS (64), REPEATS (3), OUT (.: cpu_compare.jsonl is written there),
# PREPARE_ONLY=1 (build and convert, run nothing), PYTHON (the interpreter with numpy and torch),
# ACTIVATIONS (f32,bf16: hypic's prefill also with `--activations bf16`; f32 alone skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
work="${WORK:-/tmp/hypic-cpu-peer}"
llama="$work/llama.cpp"
py="${PYTHON:-python3}"
mkdir -p "$work"
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(default qwen3_5_0_8b)

if [ ! -x "$llama/build/bin/llama-bench" ] || [ ! -x "$llama/build/bin/llama-quantize" ]; then
  [ -f "$llama/convert_hf_to_gguf.py" ] || tar -C "$work" -xzf .peer/llama.cpp.tar.gz
  flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$llama" -B "$llama/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" > "$work/cmake.log"
  cmake --build "$llama/build" -j"$(nproc)" --target llama-bench llama-quantize > "$work/build.log"
fi
[ -x build/hypic ] || scripts/build.sh

specs=()
for m in "${models[@]}"; do
  hf="$root/models/default"
  if [ "$m" != default ]; then
    hf="$work/hf/$m"
    if [ ! -f "$hf/model.safetensors" ]; then
      mkdir -p "$work/tok"
      [ -f "$work/tok/tokenizer.json" ] || tar -C "$work/tok" -xzf .peer/tokenizer.tar.gz
      "$py" tools/bench/random_hf_folder.py --config "bench/configs/$m.json" --tokenizer "$work/tok" --out "$hf"
    fi
  fi
  bf16="$work/gguf/$m-bf16.gguf"
  mkdir -p "$work/gguf"
  if [ ! -s "$bf16" ]; then
    PYTHONPATH=tools/gguf/stub LLAMA_CPP_DIR="$llama" "$py" tools/gguf/convert.py "$hf" --outtype bf16 \
      --outfile "$bf16.part" > "$work/convert-$m.log" 2>&1 || { tail -20 "$work/convert-$m.log" >&2; exit 1; }
    mv "$bf16.part" "$bf16"
  fi
  for t in ${TYPES:-bf16 q8_0 q4_k_m}; do
    f="$work/gguf/$m-$t.gguf"
    if [ "$t" != bf16 ] && [ ! -s "$f" ]; then
      "$llama/build/bin/llama-quantize" "$bf16" "$f" "${t^^}" > "$work/quantize-$m-$t.log" 2>&1
    fi
    specs+=(--gguf "$m:$t:$f")
  done
done

[ "${PREPARE_ONLY:-0}" = 1 ] && exit 0
# Each engine on its best kernels for this CPU: an OPENBLAS_CORETYPE inherited from the shell (this
# machine's environment sets Haswell) would hold hypic's f32 products to AVX2 sgemm on an AVX-512
# core; unset, hypic picks the family from the CPU's instruction sets (src/backend/cpu/blas_core.h).
unset OPENBLAS_CORETYPE
out="${OUT:-.}/cpu_compare.jsonl"
echo "llama.cpp $(cat .peer/llama.cpp.commit 2>/dev/null || echo '?'), hypic $(git rev-parse --short HEAD), $(nproc) cores" >&2
python3 tools/bench/cpu_compare.py --hypic build/hypic --llama-bench "$llama/build/bin/llama-bench" "${specs[@]}" \
  --threads "${THREADS:-1,2}" --prefill "${PREFILL:-512,2048}" --context "${CONTEXT:-512}" --tokens "${TOKENS:-64}" \
  --repeats "${REPEATS:-3}" --activations "${ACTIVATIONS:-f32,bf16}" | tee "$out.tmp"
grep '^{' "$out.tmp" > "$out"
rm -f "$out.tmp"
