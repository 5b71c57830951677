#!/usr/bin/env bash
# The GPU comparison of issue 10, run on the device machine in one call: hypic (--backend cuda) and
# its two peers, llama.cpp built with CUDA (bench/llama_peer.sh, issue 18) and transformers, on the
# real Qwen3.5 shapes of bench/configs with random bf16 weights, the same
# lengths on the same GPU. Writes every figure as JSON lines to $OUT/gpu_compare.jsonl (or
# ./gpu_compare.jsonl) and prints one table with ratios (tools/bench/compare_table.py).
# Usage (device, from the repository root, after scripts/pack-device.sh here):
#   bash scripts/device-run.sh bash bench/gpu_compare.sh [shapes...]
# Environment: PREFILL (default 4096,32768), PREFILL_LONG (for 35B-A3B, default 65536; 0: none), CONTEXT
# (4096), STEPS (16), BATCHES (1,32), REPEATS (2: timed runs after a warm-up), APPEND=1 (see
# below), PEER=0 to skip
# transformers, LLAMA=0 to skip llama.cpp (on by default when .peer/llama.cpp.tar.gz was packed;
# LLAMA_SHAPES names the shapes it runs, default all three; 35B-A3B's GGUF is stretched from one layer
# period, its large tensors zero: bench/llama_peer.sh). hypic loads each shape twice (prefill lengths, then decode batches).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}/gpu_compare.jsonl"
# APPEND=1 keeps the figures in /tmp/hypic-gpu-compare.jsonl across calls on one warm machine (600 s
# per call may not hold all three shapes with three engines; each call's $OUT starts empty) and
# copies the whole file to $OUT at the end: one file, one table, one machine.
if [ "${APPEND:-0}" = 1 ]; then
  final="$out"
  out=/tmp/hypic-gpu-compare.jsonl
  touch "$out"
else
  : > "$out"
fi
if [ "${PEER:-1}" = 1 ] && ! grep -q '"ceilings"' "$out" 2>/dev/null; then
  python3 tools/bench/transformers_bench.py --config x --ceilings >> "$out"
fi
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=(qwen3_5_0_8b qwen3_5_9b qwen3_5_35b_a3b)
prefill="${PREFILL:-4096,32768}"
ctx="${CONTEXT:-4096}" steps="${STEPS:-16}" batches="${BATCHES:-1,32}" reps="${REPEATS:-2}"
llama="${LLAMA:-$([ -f .peer/llama.cpp.tar.gz ] && echo 1 || echo 0)}"
if [ "$llama" = 1 ]; then
  lshapes=()
  for s in ${LLAMA_SHAPES:-qwen3_5_0_8b qwen3_5_9b qwen3_5_35b_a3b}; do [[ " ${shapes[*]} " == *" $s "* ]] && lshapes+=("$s"); done
  [ ${#lshapes[@]} -gt 0 ] && bash bench/llama_peer.sh prepare "${lshapes[@]}" &&
    PREFILL="$prefill" CONTEXT="${CONTEXT:-4096}" REPEATS=3 bash bench/llama_peer.sh bench "${lshapes[@]}" >> "$out"
fi
for s in "${shapes[@]}"; do
  cfg="bench/configs/$s.json"
  lens="$prefill"
  [ "$s" = qwen3_5_35b_a3b ] && [ "${PREFILL_LONG:-65536}" != 0 ] && lens="$prefill,${PREFILL_LONG:-65536}"
  tag="import json,sys; [print(json.dumps(dict(json.loads(l), peer='hypic', shape='$s'))) for l in sys.stdin if l.startswith('{')]"
  hypic bench prefill --backend cuda --config "$cfg" --random-weights --lengths "$lens" --repeats "$reps" --json |
    python3 -c "$tag" >> "$out"
  hypic bench decode --backend cuda --config "$cfg" --random-weights --context "$ctx" --tokens "$steps" \
    --batches "$batches" --repeats 1 --json | python3 -c "$tag" >> "$out"
  if [ "${PEER:-1}" = 1 ]; then
    PYTHONUNBUFFERED=1 python3 tools/bench/transformers_bench.py --config "$cfg" --prefill "$lens" \
      --decode-batches "$batches" --context "$ctx" --decode-steps "$steps" --repeats "$reps" |
      python3 -c "import json,sys; [print(json.dumps(dict(json.loads(l), shape='$s'))) for l in sys.stdin if l.startswith('{')]" >> "$out"
  fi
done
[ "${APPEND:-0}" = 1 ] && cp "$out" "$final"
python3 tools/bench/compare_table.py "$out"
